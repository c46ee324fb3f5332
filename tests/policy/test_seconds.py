"""Makespan-first scheduling and the time-aware floor (numpy only): the balanced baseline, the
shared queue, the step cost models and the release decisions they drive."""

import json
import subprocess
import sys

import pytest

from flexfloor_jax.policy import (
  accounting,
  costs,
  plan,
  release_policy,
  scheduler,
  stepsim,
  workload,
)
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.history import HistoryError, LengthHistory


def seqs_of(lengths, prompt="p"):
  return [Seq(i, f"{prompt}{i}", 0, 4, int(n), 64) for i, n in enumerate(lengths)]


def test_balanced_placement_is_lpt_by_hand():
  # 1 slot per worker: 5 -> w0 (5), 4 -> w1 (4), 3 -> w1 (7 < 8), 3 -> w0 (8 < 10)
  s = seqs_of([3, 5, 4, 3])
  q = scheduler.balanced_placement(s, [3, 5, 4, 3], [0, 1], 1)
  assert q == {0: [1, 3], 1: [2, 0]}


def test_shared_queue_takes_waiting_work_and_conserves():
  """Every seq queued on worker 0: with the shared queue the idle workers pull from it (longest
  waiting first) and every seq finishes exactly once; without it worker 0 does all the work."""
  lengths = [9, 2, 7, 3, 8, 1, 6, 4]
  s = seqs_of(lengths)
  queues = {0: [x.seq_id for x in s], 1: [], 2: [], 3: []}
  pred = {x.seq_id: float(x.target_len) for x in s}
  alone = stepsim.simulate(s, None, queues, release_policy.ReleasePolicy(enabled=False), 4, 1, 8,
                           return_record=True)
  shared = release_policy.ReleasePolicy(floor=4, chain=[0, 1, 2, 3], predicted=pred,
                                        shared_queue=True, compaction=False, swap=False,
                                        steal=False)
  m, rec = stepsim.simulate(s, None, queues, shared, 4, 1, 8, return_record=True)
  assert sorted(rec.finishes) == sorted(pred)
  assert {f.num_tokens for f in rec.finishes.values()} == set(lengths)
  assert m["makespan_steps"] < alone[0]["makespan_steps"] / 2
  assert len({f.worker for f in rec.finishes.values()}) == 4
  assert m["device_steps"] == 4 * m["makespan_steps"]  # full width: nothing released


def _release_sizes(cost, slack=0.05, lengths=(40, 3, 3, 3, 3, 3, 3, 3), with_steps=False):
  """Sizes the group passes through; worker 0 (the chain's head) has nothing to do."""
  s = seqs_of(lengths)
  queues = {w: [w] for w in range(1, 8)}
  queues[0] = []
  queues[7] = [7, 0]
  pred = {x.seq_id: float(x.target_len) for x in s}
  pol = release_policy.ReleasePolicy(floor=1, chain=list(range(8)), predicted=pred, cost=cost,
                              makespan_slack=slack, predicted_makespan_steps=45.0)
  m, rec = stepsim.simulate(s, None, queues, pol, 8, 2, 4, return_record=True)
  sizes, steps = [8], []
  for r in rec.timeline.releases:
    if not r["final"]:
      sizes.append(sizes[-1] - len(r["workers"]))
      steps.append(r["step"])
  return (sizes, steps) if with_steps else sizes


def test_time_aware_floor_refuses_a_release_that_costs_device_seconds():
  # 8 -> 7 makes each step twice as slow: 7 x 2.0 > 8 x 1.0 device-seconds per step; no smaller
  # size pays either (n x t(n) >= 8 everywhere)
  slow = costs.MeasuredStepCost({8: 1.0, 7: 2.0, 6: 2.0, 5: 2.0, 4: 2.0, 3: 3.0, 2: 4.0, 1: 8.0})
  assert _release_sizes(slow) == [8]
  # device-steps alone (no cost model) release all the way down
  assert _release_sizes(None)[-1] == 1


def test_time_aware_floor_releases_when_it_pays():
  flat = costs.MeasuredStepCost({8: 1.0, 1: 1.0})  # every size as fast: fewer devices pay
  assert _release_sizes(flat)[-1] == 1
  # 4 workers: 4 x 1.5 < 8 x 1.0 pays in device-seconds but adds 0.5 s to each remaining step.
  # A 5% slack of the predicted 45-step makespan (2.25 s) admits it only once <= 4.5 steps of
  # the 40-token straggler remain; a generous slack takes it as soon as the short seqs are done.
  half = costs.MeasuredStepCost({8: 1.0, 5: 2.0, 4: 1.5, 3: 3.0, 1: 8.0})
  sizes, steps = _release_sizes(half, slack=0.05, with_steps=True)
  assert sizes == [8, 4] and steps[0] >= 40 - 5
  sizes, steps = _release_sizes(half, slack=1.0, with_steps=True)
  assert sizes == [8, 4] and steps[0] <= 8


def test_measured_cost_interpolates_and_rejects_bad_tables():
  c = costs.MeasuredStepCost({8: 2.0, 4: 1.0})
  assert c.decode_seconds(6) == pytest.approx(1.5)
  assert c.decode_seconds(1) == 1.0 and c.decode_seconds(16) == 2.0
  assert costs.from_history({8: 1.0}) is None and costs.from_history({}) is None
  for bad in ({8: 1.0}, {8: 1.0, 0: 1.0}, {8: 1.0, 4: float("nan")}, {8: 1.0, 4: -1.0}):
    with pytest.raises(ValueError):
      costs.MeasuredStepCost(bad)


def test_history_keeps_step_seconds(tmp_path):
  h = LengthHistory()
  h.add("p", 0, [3, 4])
  h.add_step_seconds({8: 0.02, 4: 0.01})
  h.add_step_seconds({4: 0.012})  # newer measurement of a size replaces the older
  path = str(tmp_path / "h.json")
  h.save(path)
  back = LengthHistory.load(path)
  assert back.step_seconds == {8: 0.02, 4: 0.012} and back.data == h.data
  _, pol, _ = plan.plan_rollout(seqs_of([5, 6, 7, 8]), back, "flexfloor", 2, 2, 1)
  assert isinstance(pol.cost, costs.MeasuredStepCost) and pol.cost.table == {4: 0.012, 8: 0.02}
  doc = json.load(open(path))
  doc["step_seconds"] = {"8": -1}
  (tmp_path / "bad.json").write_text(json.dumps(doc))
  with pytest.raises(HistoryError, match="step_seconds"):
    LengthHistory.load(str(tmp_path / "bad.json"))


def test_flexfloor_with_balanced_placement_releases_on_balanced_queues():
  h = LengthHistory()
  for i, n in enumerate([9, 2, 7, 3, 8, 1, 6, 4]):
    h.add(f"p{i}", 0, [n])
  s = [Seq(i, f"p{i}", 0, 4, None, 64) for i in range(8)]
  bal_q, bal_pol, _ = plan.plan_rollout(s, h, "balanced", 4, 1, 1)
  q, pol, _ = plan.plan_rollout(s, h, "flexfloor", 4, 1, 1, placement="balanced",
                                cost=costs.MeasuredStepCost({4: 1.0, 1: 1.0}))
  # LPT by hand: 9, 8, 7, 6 -> w0..w3; then 4 -> w3 (10), 3 -> w2 (10), 2 -> w1 (10), 1 -> w0 (10)
  assert q == bal_q == {0: [0, 5], 1: [4, 1], 2: [2, 3], 3: [6, 7]}
  assert pol.enabled and pol.shared_queue and pol.floor == 1 and bal_pol.floor == 4
  assert pol.predicted_makespan_steps == 10.0  # the longest worker's list-scheduled finish
  with pytest.raises(ValueError, match="placement"):
    plan.plan_rollout(s, h, "flexfloor", 4, 1, 1, placement="lpt")


def test_step_cost_setting_picks_the_cost_model():
  h = LengthHistory()
  h.add("p", 0, [3, 4])
  h.add_step_seconds({8: 0.02, 4: 0.01})
  s = seqs_of([5, 6, 7, 8])
  _, measured, _ = plan.plan_rollout(s, h, "flexfloor", 2, 2, 1, step_cost="measured")
  _, steps, _ = plan.plan_rollout(s, h, "flexfloor", 2, 2, 1, step_cost="steps")
  assert isinstance(measured.cost, costs.MeasuredStepCost) and steps.cost is None
  # emulated CPU devices share the host's cores: 'auto' decides in the named pair's seconds there
  assert costs.resolve("auto", "cpu", "roofline:qwen3-30b-a3b@h100") == \
      "roofline:qwen3-30b-a3b@h100"
  assert costs.resolve("auto", "gpu") == costs.resolve("auto", "tpu") == "measured"
  assert costs.resolve("steps", "gpu") == "steps" and costs.resolve("measured", "cpu") == "measured"
  with pytest.raises(ValueError, match="step_cost|one of"):
    costs.resolve("seconds", "cpu")


def test_makespan_seconds_by_hand():
  tl = accounting.Timeline(workers=[0, 1], slots_per_worker=1, t_start=10.0)
  tl.add_step("prefill", 0, 1, [0, 1], [1, 1], 10.0, 11.0)
  tl.add_step("decode", 1, 4, [0, 1], [1, 1], 11.0, 15.0)  # 1 s per step, interpolated
  tl.add_finish(0, 0, 0, 3, "target", 2)  # in step 2: ends at 13.0
  tl.add_finish(1, 1, 0, 4, "target", 3)  # in step 3: ends at 14.0
  tl.t_end = 15.5
  tl.add_release([0, 1], 5, 15.5, final=True)
  m = accounting.metrics(tl)
  assert m["makespan_s"] == pytest.approx(4.0) and m["makespan_steps"] == 5


@pytest.mark.parametrize("epoch", [1, 2, 3])
def test_flexfloor_within_slack_of_balanced_on_default_workload(epoch):
  """Makespan first: on the default workload FlexFloor's simulated makespan stays within the
  slack (plus the prediction error the scenarios allow) of the balanced schedule's, and it
  uses fewer device-steps than balanced."""
  spec, N, B = workload.WorkloadSpec(), 8, 4
  hist = LengthHistory()
  for e in range(epoch):
    prev = workload.make_seqs(spec, e)
    hist.add_rollout(e, prev, {s.seq_id: s.target_len for s in prev})
  seqs = workload.make_seqs(spec, epoch)
  out = {}
  for sched in plan.SCHEDULES:
    q, pol, _ = plan.plan_rollout(seqs, hist, sched, N, B, 1, epoch=epoch)
    out[sched] = stepsim.simulate(seqs, None, q, pol, N, B, 8)
  assert out["flexfloor"]["makespan_steps"] <= 1.05 * out["balanced"]["makespan_steps"]
  assert out["balanced"]["makespan_steps"] < out["static"]["makespan_steps"]
  assert out["flexfloor"]["device_steps"] < out["balanced"]["device_steps"]


def test_roofline_makes_eight_to_seven_a_loss():
  """The cost model's key term: with 8 experts, 7 workers means one holds 2 experts and gates the
  step, so 7 x t(7) > 8 x t(8) on the roofline; 4 workers (2 experts each) pay."""
  code = ("from flexfloor_jax.sim import costs, presets; c = costs.RooflineStepCost("
          "presets.MODELS['mixtral-8x7b'], presets.HARDWARE['tpu-v5p'], 512); "
          "t = {n: c.decode_seconds(n, 32) for n in (8, 7, 4)}; "
          "print(7 * t[7] > 8 * t[8], 4 * t[4] < 8 * t[8], 'jax' in __import__('sys').modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["True", "True", "False"]


class HandCost:
  """A hand step-cost table: a step takes 1 s plus `per_row` s for every row past the first on
  its busiest worker (the slowest worker gates an SPMD step); a prefill step takes 1 s."""

  name = "hand"

  def __init__(self, per_row: float):
    self.per_row = per_row

  def worker_step_seconds(self, rows_w, kv_w):
    del kv_w
    return 1.0 + self.per_row * max(0.0, float(max(rows_w)) - 1.0)

  def decode_seconds(self, n_active, live_seqs):
    return self.worker_step_seconds([-(-max(live_seqs, 1) // n_active)], None)

  def prefill_seconds(self, prompt_w):
    del prompt_w
    return 1.0


@pytest.mark.parametrize("per_row, spread", [(1.0, True), (0.0, False)])
def test_placement_spreads_rows_only_where_packing_costs_seconds(per_row, spread):
  """Two responses of 20 tokens, two workers of two slots, floor 1. Packing both on one worker lets
  the other go at once: free in steps. With a table where a second row on a worker doubles its
  step, the packed run takes 40 s against the spread run's 20 (late), so the placement spreads
  them; with a table where rows are free, packing holds 20 device-s against 40, so it packs."""
  s = seqs_of([20, 20])
  queues, info = scheduler.flexfloor_placement(
      s, [20, 20], [0, 1], 2, floor=1, cost=HandCost(per_row), return_info=True,
      policy_kw=dict(shared_queue=True))
  assert info["unit"] == "seconds"
  assert sorted(len(q) for q in queues.values()) == ([1, 1] if spread else [0, 2])
  # the same in device-steps alone: packing is always free there
  steps_q = scheduler.flexfloor_placement(s, [20, 20], [0, 1], 2, floor=1,
                                          policy_kw=dict(shared_queue=True))
  assert sorted(len(q) for q in steps_q.values()) == [0, 2]


@pytest.mark.parametrize("per_row, spread", [(1.0, True), (0.0, False)])
def test_group_split_spreads_rows_only_where_packing_costs_seconds(per_row, spread):
  """Across groups: four responses of 100 tokens, two groups of one worker with four lanes.
  Packed into one group, the other group goes at once (free in lane-steps; with free rows two
  more prefill rounds, within the slack); when rows cost seconds, the packed group's steps are
  four times as long and it is late, so the split spreads."""
  from flexfloor_jax.sim import cluster
  s = [Seq(i, f"p{i}", 0, 4, 100, 128) for i in range(4)]
  hist = LengthHistory()
  hist.add_rollout(0, s, {x.seq_id: x.target_len for x in s})
  split = cluster.group_split(s, "flexfloor", hist, 2, 4, 1, 0.05, cost=HandCost(per_row))
  assert sorted(len(g) for g in split) == ([2, 2] if spread else [0, 4])


def test_dispatch_seconds_equal_the_sum_of_steps_where_a_step_is_linear():
  """A dispatch priced interval by interval at the middle step equals the step-by-step sum when a
  step's seconds are linear in the gating worker's cached tokens (here one worker gates: it holds
  the most rows and tokens throughout), whatever the finishes inside the dispatch."""
  import numpy as np
  rng = np.random.default_rng(5)
  rem = rng.integers(0, 40, (3, 4)).astype(float)
  rem[0] = [40, 38, 39, 40]  # worker 0 runs longest and holds the most
  ctx = np.where(rem > 0, rng.integers(10, 50, (3, 4)) + 1000 * (np.arange(3) == 0)[:, None], 0)

  def step(rows_w, kv_w):
    return 0.5 + 0.01 * float(np.max(kv_w)) + 0.2 * float(np.max(rows_w))

  k = 35
  want = sum(step((rem > j).sum(1), ((ctx + j) * (rem > j)).sum(1)) for j in range(k))
  assert costs.dispatch_seconds(step, rem, ctx, k) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("per_row, small", [(1.0, False), (0.0, True)])
def test_floor_choice_releases_only_where_packing_is_free_in_seconds(per_row, small):
  """The floor choice (sim.cluster.pick_floor) over runs of the release policy on a hand table:
  four workers of four slots, each with a response of 20 tokens and one of 200. Releasing below
  four workers means moving the 200s together (or their queued starts: a few more prefill
  rounds). When a second row on a
  worker doubles its step, that makes every remaining step slower and no release pays, so every
  floor runs the same and the full group is kept; when rows are free, floor 1 holds the fewest
  device-seconds at the same makespan and is chosen."""
  from flexfloor_jax.sim import cluster
  s = [Seq(i, f"p{i}", 0, 4, 20 if i % 2 == 0 else 200, 256) for i in range(8)]
  pred = {x.seq_id: float(x.target_len) for x in s}
  cost = HandCost(per_row)
  rows = []
  for floor in (1, 2, 4):
    pol = release_policy.ReleasePolicy(enabled=True, floor=floor, chain=[0, 1, 2, 3],
                                       predicted=pred, cost=cost)
    m = stepsim.simulate(s, None, {w: [2 * w, 2 * w + 1] for w in range(4)}, pol, 4, 4, 8,
                         cost=cost)
    rows.append(dict(floor=floor, predicted_makespan_s=m["makespan_s"],
                     predicted_occupied_device_seconds=m["occupied_device_seconds"]))
  pick = cluster.pick_floor(rows, 0.05)["floor"]
  assert (pick == 1 if small else pick == 4), rows


def test_floor_choice_keeps_the_full_group_for_a_saving_within_the_predictions_error():
  """Candidates as the simulator's floor choice prints them: floor 4 predicted at the full
  group's makespan and 0.5% fewer device-seconds, floor 2 1.5% fewer at 1% more makespan. The
  0.5% is within what predicted lengths can tell: the full group stays unless floor 2 is on
  offer; with it, floor 2 (its saving is larger than what it costs in makespan, and than 1%)."""
  from flexfloor_jax.sim import cluster
  full = dict(floor=8, predicted_makespan_s=50.0, predicted_occupied_device_seconds=400.0)
  four = dict(floor=4, predicted_makespan_s=50.0, predicted_occupied_device_seconds=398.0)
  two = dict(floor=2, predicted_makespan_s=50.5, predicted_occupied_device_seconds=394.0)
  assert cluster.pick_floor([four, full], 0.05)["floor"] == 8
  assert cluster.pick_floor([two, four, full], 0.05)["floor"] == 2


@pytest.mark.parametrize("per_row, rows", [(1.5, 1), (1.0, 4), (0.0, 4)])
def test_admission_rows_follow_the_step_cost(per_row, rows):
  """A worker's rate with r rows is r / (1 + per_row (r - 1)) tokens a second: below one row's
  when a second row costs more than a step (1.5), flat at 1.0 (ties keep every row), rising when
  rows are free."""
  assert costs.admission_rows(HandCost(per_row), 4, 100.0) == rows


@pytest.mark.parametrize("per_row, spread", [(1.5, True), (0.0, False)])
def test_admission_spreads_rows_only_where_packing_costs_seconds(per_row, spread):
  """Both responses queued on worker 0 of two workers with two slots each (the shared queue, as
  the flexfloor schedule runs). When a second row costs 1.5 steps, admission runs one row per
  worker, so worker 1 takes the other from the queue: 20 steps of 1 s against 20 of 2.5 s packed.
  When rows are free, one worker runs both and the other goes at once."""
  s = seqs_of([20, 20])
  pred = {x.seq_id: 20.0 for x in s}
  cost = HandCost(per_row)
  hist = LengthHistory()
  hist.add_rollout(0, s, {x.seq_id: x.target_len for x in s})
  max_rows = plan.admission(s, hist, cost, 2)
  assert max_rows == (1 if spread else 2)
  pol = release_policy.ReleasePolicy(floor=1, chain=[0, 1], predicted=pred, cost=cost,
                                     shared_queue=True, max_rows=max_rows)
  m, rec = stepsim.simulate(s, None, {0: [0, 1], 1: []}, pol, 2, 2, 4, cost=cost,
                            return_record=True)
  assert len({f.worker for f in rec.finishes.values()}) == (2 if spread else 1)
  packed = release_policy.ReleasePolicy(floor=1, chain=[0, 1], predicted=pred, cost=cost,
                                        shared_queue=True)
  m_packed = stepsim.simulate(s, None, {0: [0, 1], 1: []}, packed, 2, 2, 4, cost=cost)
  if spread:  # the decision is the faster one in the table's seconds
    assert m["makespan_s"] < m_packed["makespan_s"]
  else:
    assert m["occupied_device_seconds"] == m_packed["occupied_device_seconds"]


class KVCost:
  """A hand step: 1 s plus 0.01 s per cached token on the worker that reads the most (decode
  steps are bound by reading KV); decode_seconds spreads rows of `ctx` tokens evenly, the mean
  context a policy without the rows' own lengths would price."""

  name = "hand-kv"

  def __init__(self, ctx: float):
    self.ctx = ctx

  def worker_step_seconds(self, rows_w, kv_w):
    del rows_w
    return 1.0 + 0.01 * float(max(kv_w))

  def decode_seconds(self, n_active, live_seqs):
    return 1.0 + 0.01 * self.ctx * -(-max(live_seqs, 1) // n_active)

  def prefill_seconds(self, prompt_w):
    return 1.0


def test_release_priced_on_the_rows_own_cached_tokens():
  """Worker 0 holds a row with 1000 cached tokens and 90 steps to go, worker 1 one with 10 and
  95. Moving the long row onto worker 1 adds 0.1 s to a step that reading it already gates
  (11 s -> 11.1 s): 9.5 s of makespan, inside a 5% slack of 100 steps at full width
  (30 s), and device-seconds per token halve, so worker 0 goes. Priced at the mean context
  (505 tokens a row) the same move would look like 6 s -> 11 s a step, 480 s of makespan, and
  be refused."""
  from collections import deque

  from flexfloor_jax.policy.controller import State
  seqs = {0: Seq(0, "a", 0, 990, 100, 100), 1: Seq(1, "b", 0, 5, 100, 100)}
  st = State(seqs=seqs, active=[0, 1], slots_per_worker=2, slots=[[0, -1], [1, -1]],
             generated={0: 10, 1: 5}, queues={0: deque(), 1: deque()}, step=10)
  pol = release_policy.ReleasePolicy(enabled=True, floor=1, chain=[0, 1], steal=False,
                                     predicted={0: 100.0, 1: 100.0}, cost=KVCost(505.0),
                                     makespan_slack=0.05, predicted_makespan_steps=100.0)
  p = pol.plan(st)
  assert p is not None and p.new_active == [1] and p.moves == [(0, 0, 1, 1)]
  assert pol.slack_used_s == pytest.approx(95 * 0.1)  # the 95 steps left x 0.1 s
