"""Floor, release chain rule, swap/compaction, expert placement."""

import numpy as np
import pytest

from flexfloor_jax.policy import release_policy, scheduler, stepsim
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.floor import FloorError, floor_workers, release_sizes
from flexfloor_jax.policy.release_policy import ReleasePolicy


def mkseqs(lengths, max_new=256):
  return [Seq(i, f'p{i}', 0, 8, int(n), max_new) for i, n in enumerate(lengths)]


def test_floor_workers():
  # per worker: non-expert 5 + ceil(8 / n) x 10 + KV 5; n=1: 90, n=2: 50 <= 60
  assert floor_workers(8, 10, 5, 5, 60, 8) == 2
  assert floor_workers(8, 10, 5, 5, 90, 8) == 1
  assert floor_workers(8, 10, 5, 5, 20, 8) == 8  # 5 + 10 + 5
  with pytest.raises(FloorError, match=r'4 workers.*2 of 8 experts'):
    floor_workers(8, 2**30, 2**30, 2**30, 2**31, 4)


def releases(rec):
  return [r for r in rec.timeline.releases if not r['final']]


@pytest.mark.parametrize('floor', [1, 2, 3])
def test_never_below_floor_and_chain_rule(floor):
  rng = np.random.default_rng(floor)
  N, B = 6, 2
  seqs = mkseqs(rng.integers(1, 120, 40))
  chain = [3, 1, 5, 0, 2, 4]
  pred = {s.seq_id: s.target_len * rng.uniform(0.6, 1.4) for s in seqs}
  queues = scheduler.flexfloor_placement(seqs, list(pred.values()), chain, B, floor=floor)
  pol = ReleasePolicy(floor=floor, chain=chain, predicted=pred)
  ex = stepsim.SimExecutor(seqs, N, B)
  from flexfloor_jax.policy.controller import run
  rec = run(seqs, queues, ex, pol, 8)
  gone = []
  for r in releases(rec):  # released in chain order (one event may release several heads)
    gone += r['workers']
    assert set(gone) == set(chain[:len(gone)])
  for r in rec.timeline.steps:  # active set is always a chain tail, never below the floor
    assert sorted(r['active']) == sorted(chain[len(chain) - len(r['active']):])
    assert len(r['active']) >= floor
  assert len(gone) == N - floor  # everything above the floor was released before the end


@pytest.mark.parametrize('sizes', ['pow2', '5,3'])
def test_release_sizes_only_allowed_groups(sizes):
  """With scheduler.release_sizes the active group only ever has an allowed size, every
  sequence still finishes exactly once, and it still gets down to the floor."""
  rng = np.random.default_rng(11)
  N, B, floor = 8, 2, 1
  allowed = release_sizes(sizes, N, floor)
  assert allowed == {'pow2': (8, 4, 2, 1), '5,3': (8, 5, 3, 1)}[sizes]
  seqs = mkseqs(rng.integers(1, 150, 48))
  chain = list(range(N))
  pred = {s.seq_id: s.target_len * rng.uniform(0.6, 1.4) for s in seqs}
  queues = scheduler.flexfloor_placement(seqs, list(pred.values()), chain, B, floor=floor)
  ex = stepsim.SimExecutor(seqs, N, B)
  from flexfloor_jax.policy.controller import run
  rec = run(seqs, queues, ex, ReleasePolicy(floor=floor, chain=chain, predicted=pred,
                                            sizes=allowed), 8)
  assert {len(r['active']) for r in rec.timeline.steps} <= set(allowed)
  assert sorted(rec.finishes) == [s.seq_id for s in seqs]
  assert all(rec.finishes[s.seq_id].num_tokens == s.target_len for s in seqs)
  assert sum(len(r['workers']) for r in releases(rec)) == N - floor
  # every size is at least as good in device-steps (more places to stop)
  ex2 = stepsim.SimExecutor(seqs, N, B)
  rec2 = run(seqs, queues, ex2, ReleasePolicy(floor=floor, chain=chain, predicted=pred), 8)
  assert rec2.metrics()['device_steps'] <= rec.metrics()['device_steps']


def test_release_sizes_parsing():
  assert release_sizes('', 8, 1) is None
  assert release_sizes('6, 4,2', 8, 3) == (8, 6, 4, 3)
  with pytest.raises(ValueError, match="'x' is not"):
    release_sizes('4,x', 8, 1)
  with pytest.raises(ValueError, match='>= 1'):
    release_sizes('0', 8, 1)


def test_swap_releases_idle_non_head():
  # chain [0, 1]: the head w0 holds the long seq, w1 finishes first. The swap moves w0's seq into
  # idle w1 and releases w0 instead of keeping both to the end.
  seqs = mkseqs([100, 5])
  q = {0: [0], 1: [1]}
  off = stepsim.simulate(seqs, None, q, ReleasePolicy(chain=[0, 1], swap=False, compaction=False),
                         2, 1, 8)
  on, rec = stepsim.simulate(seqs, None, q, ReleasePolicy(chain=[0, 1], compaction=False), 2, 1, 8,
                             return_record=True)
  assert off['device_steps'] == 2 * 100  # w1 idle but not the head: waits (chain rule)
  assert on['device_steps'] < 2 * 12 + 100
  assert rec.timeline.migrations[0]['moves'] == [[0, 0, 1, 0]]
  assert releases(rec)[0]['workers'] == [0]
  assert on['idle_after_finish_fraction'] == 0.0


def test_compaction_merges_stragglers():
  # 3 workers x 2 slots; after the 10-token seqs end (~step 12) each worker has one long seq and
  # one free slot. Compaction: w0's seq moves into a free slot, w0 goes; when the 150 ends, w1's
  # remaining seq joins w2: about 3 x 12 + 2 x 138 + 1 x 50 = 362 device-steps. Release-only (swap)
  # must wait for a worker to empty: 3 x 150 + 2 x 30 + 20 = 530.
  seqs = mkseqs([200, 10, 150, 10, 180, 10])
  q = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
  pred = {s.seq_id: s.target_len for s in seqs}
  ro = stepsim.simulate(seqs, None, q, ReleasePolicy(predicted=pred, compaction=False), 3, 2, 8)
  co, rec = stepsim.simulate(seqs, None, q, ReleasePolicy(predicted=pred), 3, 2, 8,
                             return_record=True)
  assert 530 <= ro['device_steps'] <= 540 and 360 <= co['device_steps'] <= 375
  assert co['makespan_steps'] <= ro['makespan_steps']
  assert co['num_migrations'] >= 1
  assert co['slot_utilization'] > ro['slot_utilization']


def test_migration_cost_blocks_worthless_moves():
  seqs = mkseqs([200, 10, 150, 10, 180, 10])
  q = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
  pred = {s.seq_id: s.target_len for s in seqs}
  m = stepsim.simulate(seqs, None, q, ReleasePolicy(predicted=pred, steps_per_migration=1e6),
                       3, 2, 8)
  assert m['num_migrations'] == 0


def test_plan_never_delays_completion():
  # The head holds a queue; moving it onto a busy survivor would finish later: not done.
  seqs = mkseqs([50, 50, 50, 100])
  q = {0: [0, 1, 2], 1: [3]}
  pred = {s.seq_id: s.target_len for s in seqs}
  m = stepsim.simulate(seqs, None, q, ReleasePolicy(predicted=pred), 2, 1, 8)
  st = stepsim.simulate(seqs, None, q, ReleasePolicy(False), 2, 1, 8)
  assert m['makespan_steps'] <= st['makespan_steps']


def test_future_device_steps():
  # chain order finishes [5, 3, 8]: releases at 5, 5, 8; floor 2 keeps the last two to 8
  assert release_policy.future_device_steps([5, 3, 8], 1) == 18
  assert release_policy.future_device_steps([5, 3, 8], 2) == 21
  assert release_policy.list_schedule_finish([4], [3, 3, 3], 2) == 7  # slots free at 4 and 0


def test_expert_placement_moves_only_released():
  p = ExpertPlacement.initial(8, [0, 1, 2, 3], slots=4)  # floor 2 -> S = 4
  t0 = p.slot_expert()
  assert t0[:, :2].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and (t0[:, 2:] == -1).all()
  p1 = p.after_release([0], [1, 2, 3])
  moved = p1.moves_since(p)
  assert sorted(e for e, _, _ in moved) == [0, 1]  # only worker 0's experts moved
  for e in range(2, 8):
    assert p1.replicas[e] == p.replicas[e]
  assert sorted(p1.workers_of(0) + p1.workers_of(1)) == [1, 2]  # balanced: fewest experts first
  t1 = p1.slot_expert()
  assert (t1[0] == -1).all() and sorted(t1[t1 >= 0].tolist()) == list(range(8))
  active = [1, 2, 3]
  g = p1.expert_to_slot(active)
  for e in range(8):
    assert t1[active[g[e] // 4], g[e] % 4] == e
  p2 = p1.after_release([1], [2, 3])
  assert {e for e, _, _ in p2.moves_since(p1)} == {e for e in range(8) if p1.workers_of(e) == [1]}
  assert sorted(int((p2.slot_expert()[w] >= 0).sum()) for w in (2, 3)) == [4, 4]
  with pytest.raises(FloorError, match='below the floor'):
    p2.after_release([2], [3])
  with pytest.raises(ValueError, match='not active'):
    p2.expert_to_slot([3])


def test_expert_placement_in_sim_shrink():
  seqs = mkseqs([100, 5, 5, 5])
  ep = ExpertPlacement.initial(8, [0, 1, 2, 3], slots=8)
  m, rec = stepsim.simulate(seqs, None, {0: [1], 1: [2], 2: [3], 3: [0]},
                            ReleasePolicy(chain=[0, 1, 2, 3]), 4, 1, 8, return_record=True,
                            expert_placement=ep, expert_bytes=10)
  moved = sum(r['stats'].get('expert_moves', 0) for r in releases(rec))
  assert moved == 6  # the experts of the three released workers, each moved once


def test_work_stealing_shortens_completion():
  # floor 2: nobody can be released. w0 holds three 50-token seqs in one slot (~150 steps); w1
  # finishes its 10 early, takes a queued 50 from w0 and the rollout ends ~50 steps sooner.
  seqs = mkseqs([50, 50, 50, 10])
  q = {0: [0, 1, 2], 1: [3]}
  pred = {s.seq_id: s.target_len for s in seqs}
  off = stepsim.simulate(seqs, None, q, ReleasePolicy(floor=2, predicted=pred, steal=False),
                         2, 1, 8)
  on, rec = stepsim.simulate(seqs, None, q, ReleasePolicy(floor=2, predicted=pred), 2, 1, 8,
                             return_record=True)
  assert on['makespan_steps'] <= off['makespan_steps'] - 40
  assert any(m['queue_moves'] for m in rec.timeline.migrations)
  assert on['kv_bytes_migrated'] == 0  # queued seqs have no KV yet


@pytest.mark.parametrize("pool_rows, released", [(None, True), (2, False)])
def test_evacuation_fills_only_the_rows_the_pool_holds(pool_rows, released):
  """Worker 0 runs one row, worker 1 two of its four slots; all three have 50 tokens left. Moving
  worker 0's row onto worker 1 frees worker 0 at no cost in completion: the policy does it. When
  worker 1's pool holds only two rows at once (ReleasePolicy.pool_rows), it has no free row to
  give: nothing moves (the moved row would wait for pages on the survivor, not run)."""
  from collections import deque

  from flexfloor_jax.policy.controller import State
  seqs = {i: Seq(i, f"p{i}", 0, 8, 100, 100) for i in range(3)}
  st = State(seqs=seqs, active=[0, 1], slots_per_worker=4,
             slots=[[0, -1, -1, -1], [1, 2, -1, -1]], generated={0: 50, 1: 50, 2: 50},
             queues={0: deque(), 1: deque()}, step=50)
  pol = ReleasePolicy(enabled=True, floor=1, chain=[0, 1], steal=False,
                      predicted={i: 100.0 for i in seqs}, pool_rows=pool_rows)
  plan = pol.plan(st)
  if released:
    assert plan is not None and plan.new_active == [1] and plan.moves == [(0, 0, 1, 2)]
  else:
    assert plan is None
