"""Paged KV pool (policy/pages.py) and the step simulator's paged mode: page counts by hand,
conservation, admission within the budget, preemption of the youngest, determinism, the equal
byte budget, and paged = fixed slots when the pool holds every slot's full row."""

import numpy as np
import pytest

from flexfloor_jax.policy import pages, release_policy, scheduler, stepsim
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.pages import PagePool, PagePoolError


def mkseqs(lengths, prompt=8, max_new=64):
  return [Seq(i, f'p{i // 4}', i % 4, prompt, int(n), max_new) for i, n in enumerate(lengths)]


class Checked(stepsim.SimExecutor):
  """SimExecutor that checks the pool's conservation (and no page owned twice) at every call."""

  def __init__(self, pool, *a, **k):
    super().__init__(*a, **k)
    self.pool = pool
    self.admitted = []  # seq ids in prefill order

  def prefill(self, assign):
    self.pool.check()
    for w, _, q in assign:  # the controller allocated the rows: what is reserved fits the pool
      self.admitted.append(q)
      if len(self.pool.live_rows(w)) > 1:
        assert self.pool._reserved(w) <= self.pool.num_pages
    return super().prefill(assign)

  def decode(self, *a):
    self.pool.check()
    for w in range(self.num_workers):
      assert self.pool.free_pages(w) + self.pool.used_pages(w) == self.pool.num_pages
      assert len(self.pool.live_rows(w)) <= self.pool.max_seqs
    return super().decode(*a)


def run_paged(seqs, queues, N, pool, spd=5, policy=None):
  from flexfloor_jax.policy.controller import run
  ex = Checked(pool, seqs, N, pool.max_seqs)
  rec = run(seqs, queues, ex, policy or release_policy.ReleasePolicy(False), steps_per_dispatch=spd,
            clock=lambda: float(ex.steps), kv=pool)
  return rec, ex


def test_pages_for_and_budgets_by_hand():
  assert [pages.pages_for(t, 16) for t in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
  assert pages.pages_for(289, 16) == 19
  # today's fixed-slot cache: 4 rows of 289 tokens = 1156 tokens -> 72 whole pages of 16
  assert pages.equal_budget_pages(4, 289, 16) == 72
  assert pages.equal_budget_pages(4, 256, 16) == 64
  # 10_000 bytes of memory, 6_000 of weights, 1_000 of workspace, 12 bytes per token, pages of
  # 16 tokens (192 bytes): 3_000 // 192 = 15 pages
  assert pages.pool_pages(10_000, 6_000, 1_000, 12, 16) == 15
  assert pages.pool_pages(6_500, 6_000, 1_000, 12, 16) == 0
  assert pages.kv_budget_bytes(15, 16, 12) == 2880


def test_allocate_grow_free_tables_by_hand():
  pool = PagePool(2, 10, 4, 3, max_pages_per_seq=5, predicted={0: 5, 1: 1}, margin=0.0)
  s0, s1 = Seq(0, 'a', 0, 6, None, 10), Seq(1, 'a', 1, 3, None, 10)
  row = pool.allocate(0, 1, s0, 7)  # 7 tokens: 2 pages, lowest ids first
  assert row.tolist() == [0, 1, 10, 10, 10]  # padded with num_pages (out of range)
  pool.allocate(0, 0, s1, 4)
  assert pool.table(0)[0].tolist() == [2, 10, 10, 10, 10]
  # before a dispatch of 3 steps: seq 0 at 6 + 2 generated -> 11 tokens (3 pages), seq 1 at
  # 3 + 1 -> 7 tokens (2 pages)
  assert pool.grow({(0, 1): 2, (0, 0): 1}, 3) == []
  assert pool.table(0)[1].tolist() == [0, 1, 3, 10, 10]  # the older row grows first
  assert pool.table(0)[0].tolist() == [2, 4, 10, 10, 10]
  assert pool.used_pages(0) == 5 and pool.free_pages(1) == 10 and pool.peak_used == [5, 0]
  # the cap: 6 + 10 = 16 tokens = 4 pages, whatever the steps
  pool.grow({(0, 1): 9, (0, 0): 1}, 50)
  assert pool.owned(0, 1) == 4
  assert pool.free(0, 1) == 4 and pool.table(0)[1].tolist() == [10] * 5
  pool.check()
  # reservations: prompt + predicted x (1 + margin), at most the cap, at least the next tokens
  assert pool.reservation(s0) == 3  # 6 + 5 = 11 tokens
  assert pool.reservation(Seq(9, 'b', 0, 6, None, 10)) == 4  # no prediction: the cap, 16
  assert PagePool(1, 10, 4, 3, predicted={0: 5}, margin=1.0).reservation(s0) == 4  # 6+10
  with pytest.raises(PagePoolError):
    pool.allocate(0, 0, s0, 4)  # row busy


def test_admission_respects_the_budget_and_max_seqs():
  seqs = [Seq(i, 'a', i, 8, None, 56) for i in range(6)]
  # each reserves 8 + 24 = 32 tokens = 4 pages of 8; a pool of 10 pages holds two of them
  pool = PagePool(1, 10, 8, 4, predicted={i: 24 for i in range(6)}, margin=0.0)
  assert pool.admits(0, seqs[0], steps=4)
  pool.allocate(0, 0, seqs[0], 9)
  assert pool.admits(0, seqs[1], steps=4)
  pool.allocate(0, 1, seqs[1], 9)
  assert not pool.admits(0, seqs[2], steps=4)  # 4 + 4 + 4 > 10
  big = PagePool(1, 100, 8, 2, predicted={i: 24 for i in range(6)}, margin=0.0)
  big.allocate(0, 0, seqs[0], 9)
  big.allocate(0, 1, seqs[1], 9)
  assert not big.admits(0, seqs[2])  # max_seqs rows taken
  # an empty worker admits anything that fits alone, and refuses loudly what never can
  assert PagePool(1, 8, 8, 2, margin=10.0).admits(0, seqs[0])
  with pytest.raises(PagePoolError):
    PagePool(1, 7, 8, 2).admits(0, seqs[0])  # 64 tokens = 8 pages > 7


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_paged_run_conserves_pages_and_reserved_budget(seed):
  """Under-predicted lengths with no margin: growth runs out, the youngest rows are preempted,
  and still every sequence finishes with its own length; the pool is whole at every step and
  gives back every page it handed out."""
  rng = np.random.default_rng(seed)
  N, M = 3, 6
  lengths = rng.integers(1, 60, size=29)
  seqs = mkseqs(lengths)
  pred = {s.seq_id: 4.0 for s in seqs}  # far too short: admission packs, growth overflows
  pool = PagePool(N, 24, 8, M, predicted=pred, margin=0.0)
  rec, ex = run_paged(seqs, scheduler.static_placement(seqs, list(range(N))), N, pool)
  assert {q: f.num_tokens for q, f in rec.finishes.items()} == {s.seq_id: s.target_len
                                                               for s in seqs}
  assert len(pool.preemptions) > 0
  assert pool.allocated == pool.freed > 0
  assert all(pool.free_pages(w) == pool.num_pages for w in range(N))
  assert (pool.tables() == pool.num_pages).all()
  assert max(pool.peak_used) <= pool.num_pages


def test_preemption_picks_the_youngest_and_requeues_it_first():
  pool = PagePool(1, 6, 4, 3, predicted={0: 1, 1: 1, 2: 1}, margin=0.0)
  s = [Seq(i, 'a', i, 4, None, 40) for i in range(3)]
  for slot, q in ((2, 0), (0, 1), (1, 2)):  # admitted in the order 0, 1, 2
    pool.allocate(0, slot, s[q], 5)  # 2 pages each: the pool is full
  lost = pool.grow({(0, 2): 5, (0, 0): 1, (0, 1): 1}, 4)  # seq 0 needs 2 more pages (13 tok)
  assert lost == [(0, 1, 2), (0, 0, 1)]  # youngest first: seq 2, then seq 1
  assert pool.owned(0, 2) == 4 and pool.free_pages(0) == 2
  assert [p['seq_id'] for p in pool.preemptions] == [2, 1]
  # in a run: the preempted sequence goes back to the front of its worker's queue
  seqs = mkseqs([40, 40, 40, 3, 3], prompt=4, max_new=40)
  pool = PagePool(1, 12, 4, 3, predicted={q: 1.0 for q in range(5)}, margin=0.0)
  rec, ex = run_paged(seqs, {0: [0, 1, 2, 3, 4]}, 1, pool, spd=4)
  assert pool.preemptions[0]['seq_id'] == 2  # the youngest of 0, 1, 2
  assert ex.admitted.count(2) >= 2  # recomputed by a second prefill...
  second = ex.admitted.index(2, ex.admitted.index(2) + 1)
  assert second < ex.admitted.index(3)  # ...before seq 3, queued behind it, starts
  assert {q: f.num_tokens for q, f in rec.finishes.items()} == {0: 40, 1: 40, 2: 40, 3: 3, 4: 3}


def test_migration_without_pages_becomes_a_preemption():
  pool = PagePool(2, 4, 4, 2, margin=0.0)
  a, b = Seq(0, 'a', 0, 4, None, 8), Seq(1, 'a', 1, 4, None, 8)
  pool.allocate(0, 0, a, 9)  # 3 pages
  pool.allocate(1, 0, b, 5)  # 2 pages
  assert pool.move([(0, 0, 1, 1)]) == [False]  # 3 pages, 2 free
  assert pool.seq_at(0, 0) == -1 and pool.seq_at(1, 1) == -1 and pool.free_pages(0) == 4
  assert pool.move([(1, 0, 0, 1)]) == [True] and pool.owned(0, 1) == 2
  pool.check()


def test_deterministic_page_ids():
  def once():
    rng = np.random.default_rng(7)
    seqs = mkseqs(rng.integers(1, 60, size=23))
    pred = {s.seq_id: float(s.target_len) * rng.uniform(0.3, 1.5) for s in seqs}
    pool = PagePool(2, 20, 8, 5, predicted=pred, margin=0.1)
    tables = []

    class Snap(Checked):
      def decode(self, *a):
        tables.append(pool.tables())
        return super().decode(*a)

    from flexfloor_jax.policy.controller import run
    ex = Snap(pool, seqs, 2, 5)
    rec = run(seqs, scheduler.static_placement(seqs, [0, 1]), ex,
              release_policy.ReleasePolicy(False), steps_per_dispatch=4,
              clock=lambda: float(ex.steps), kv=pool)
    return np.stack(tables), pool.preemptions, rec.metrics()
  t1, p1, m1 = once()
  t2, p2, m2 = once()
  assert np.array_equal(t1, t2) and p1 == p2 and m1 == m2


@pytest.mark.parametrize('policy_kind', ['static', 'compaction'])
def test_paged_with_full_rows_runs_the_fixed_slot_steps(policy_kind):
  """A pool of exactly B x max_seq_len / page_size pages, max_seqs = B and a huge margin admits
  exactly when a slot is free and never preempts: the same steps as B fixed slots. (A pool one
  page smaller must differ: the property can fail.)"""
  rng = np.random.default_rng(3)
  N, B, P, L = 4, 3, 8, 72  # prompt 8 + max_new 64 = 72 = 9 pages
  lengths = rng.integers(1, 64, size=37)
  seqs = mkseqs(lengths)
  pred = {s.seq_id: float(n) * rng.uniform(0.5, 1.5) for s, n in zip(seqs, lengths, strict=True)}
  if policy_kind == 'static':
    queues = scheduler.static_placement(seqs, list(range(N)))

    def mk():
      return release_policy.ReleasePolicy(False)
  else:
    queues = scheduler.flexfloor_placement(seqs, list(pred.values()), list(range(N)), B)

    def mk():
      return release_policy.ReleasePolicy(floor=1, predicted=pred, compaction=True)
  m0, r0 = stepsim.simulate(seqs, None, queues, mk(), N, B, 5, return_record=True)
  pool = PagePool(N, pages.equal_budget_pages(B, L, P), P, B, predicted=pred, margin=1e9)
  m1, r1 = stepsim.simulate(seqs, None, queues, mk(), N, B, 5, return_record=True, kv=pool)
  assert m1.pop('kv')['preemptions'] == 0
  assert m0 == m1 and r0.timeline.steps == r1.timeline.steps
  assert r0.timeline.finishes == r1.timeline.finishes
  small = PagePool(N, pages.equal_budget_pages(B, L, P) - 1, P, B, predicted=pred, margin=1e9)
  m2 = stepsim.simulate(seqs, None, queues, mk(), N, B, 5, kv=small)
  m2.pop('kv')
  assert m2 != m0


def test_makespan_lower_bound_by_hand():
  """2 workers, pools of 16 pages of 4 tokens, 4 rows; prompts of 4; responses 40, 40 and six of 4.
  longest: 40 + ceil(8 / 2) - 1 = 43. rows: R = 4 prefill rounds (8 tokens), then 104 - 8 = 96
  tokens at <= 8 per decode step: 4 + 12 = 16. pages: a 40 holds ceil((4 + t) / 4) pages while it
  makes token t = 1..40: 4 x (2 + 3 + ... + 11) = 260 page-steps; a 4: 4 x 2 = 8; 2 x 260 + 6 x 8
  = 568 over 2 x 16 pages: 17.75 -> 18. KV token-steps: 2 x (5 + ... + 44) + 6 x (5 + ... + 8)
  = 1960 + 156."""
  seqs = [Seq(i, f'p{i}', 0, 4, n, 60) for i, n in enumerate([40, 40] + [4] * 6)]
  lb = pages.makespan_lower_bound(seqs, {s.seq_id: s.target_len for s in seqs}, 2, 16, 4, 4)
  assert lb == dict(longest=43, rows=16, pages=18, page_steps=568, kv_token_steps=2116, bound=43)
  # one worker whose pool holds one sequence at a time: the pages term binds (3 x 8 page-steps
  # over 3 pages = 8 > longest 4 + 3 - 1 = 6, rows 3 + ceil(9 / 4) = 6); the run takes 12
  one = [Seq(i, f'p{i}', 0, 4, 4, 8) for i in range(3)]
  lb = pages.makespan_lower_bound(one, {s.seq_id: 4 for s in one}, 1, 3, 4, 4)
  assert (lb['longest'], lb['rows'], lb['pages'], lb['bound']) == (6, 6, 8, 8)
  m = stepsim.simulate(one, None, {0: [0, 1, 2]}, release_policy.ReleasePolicy(False), 1, 4, 5,
                       kv=PagePool(1, 3, 4, 4, predicted={q: 4.0 for q in range(3)}))
  assert m['makespan_steps'] == 12 >= lb['bound']


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_makespan_lower_bound_holds_on_simulated_runs(seed):
  rng = np.random.default_rng(seed)
  N, S, P = 3, 4, 8
  lengths = rng.integers(1, 64, size=29)
  seqs = mkseqs(lengths)
  pred = {s.seq_id: float(n) * rng.uniform(0.5, 1.5) for s, n in zip(seqs, lengths, strict=True)}
  lb = pages.makespan_lower_bound(seqs, {s.seq_id: s.target_len for s in seqs}, N, 12, P, S)
  for queues in (scheduler.static_placement(seqs, list(range(N))),
                 scheduler.balanced_placement(seqs, list(pred.values()), list(range(N)), S)):
    m = stepsim.simulate(seqs, None, queues, release_policy.ReleasePolicy(False), N, S, 5,
                         kv=PagePool(N, 12, P, S, predicted=pred))
    assert m['makespan_steps'] >= max(lb['rows'], lb['pages'])  # with preemptions too
    if m['kv']['preemptions'] == 0:  # 'longest' assumes the longest is not preempted
      assert m['makespan_steps'] >= lb['longest']


@pytest.mark.parametrize('seed', [0, 1])
def test_counting_pages_decides_as_naming_them(seed):
  """page_ids=False (the simulator's pools) admits, grows, preempts and finishes exactly as a pool
  that hands out page ids, with the same page counts, and stays conserved."""
  rng = np.random.default_rng(seed)
  N, M = 3, 6
  seqs = mkseqs(rng.integers(1, 60, size=29))
  pred = {s.seq_id: float(rng.integers(2, 40)) for s in seqs}
  runs = []
  for ids in (True, False):
    pool = PagePool(N, 24, 8, M, predicted=pred, margin=0.0, page_ids=ids)
    rec, _ = run_paged(seqs, scheduler.static_placement(seqs, list(range(N))), N, pool)
    pool.check()
    runs.append((rec.metrics(), pool.stats(), pool.preemptions,
                 {q: (f.worker, f.num_tokens) for q, f in rec.finishes.items()}))
  assert runs[0] == runs[1]
  assert runs[0][1]['preemptions'] > 0
