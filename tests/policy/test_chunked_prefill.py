"""Chunked prefill on the host side: the controller's contract (policy/controller.py's module
doc) run by the step simulator, by hand; the timeline that records it; the step-time model that
prices it; and the admission of input tokens per step."""

from typing import cast

import numpy as np
import pytest

from flexfloor_jax.policy import accounting, costs, release_policy, scheduler, stepsim
from flexfloor_jax.policy.controller import ControllerError, Finish, Plan, Seq, run
from flexfloor_jax.policy.pages import PagePool


def off():
  return release_policy.ReleasePolicy(False)


def sim(seqs, queues, workers, slots, chunk, spd=8, **kw):
  return stepsim.simulate(seqs, None, queues, off(), workers, slots, spd, return_record=True,
                          prefill_chunk=chunk, **kw)


def finish_of(rec, q):
  return next(f for f in rec.timeline.finishes if f['seq_id'] == q)


class Recording(stepsim.SimExecutor):
  """SimExecutor that logs admissions, preemptions (and whether the row was pending), and each
  decode's pages per occupied row when a pool is given."""

  def __init__(self, *a, pool=None, **k):
    super().__init__(*a, **k)
    self.events, self.pool, self.owned = [], pool, []

  def admit(self, assign):
    self.events.append(('admit', self.steps, list(assign)))
    super().admit(assign)

  def preempt(self, slots):
    self.events.append(('preempt', self.steps, [(w, s, (w, s) in self.pending_slot)
                                                for w, s in slots]))
    super().preempt(slots)

  def migrate(self, moves):
    self.events.append(('migrate', self.steps, list(moves)))
    return super().migrate(moves)

  def decode(self, max_steps, stop_on_refill, stop_on_idle):
    if self.pool is not None:
      self.owned.append((self.steps, {s: self.pool.owned(0, s) for s in range(2)}))
    return super().decode(max_steps, stop_on_refill, stop_on_idle)


# -- the contract, by hand ----------------------------------------------------------------------

def test_a_prompt_longer_than_a_chunk_turns_live_where_the_contract_says():
  """A prompt of 10 tokens in chunks of 4 (one worker, one slot): its input runs in steps 0, 1
  and 2 (4 + 4 + 2 tokens), its last input token in step ceil(10 / 4) - 1 = 2, which makes its
  first token; a response of 3 tokens then makes one a step and finishes in step 4. One of 1
  token finishes in step 2, at its first token."""
  m, rec = sim([Seq(0, 'a', 0, 10, 3, 64)], {0: [0]}, 1, 1, 4)
  f = finish_of(rec, 0)
  assert (f['step'], f['num_tokens'], f['reason']) == (4, 3, 'target')
  assert rec.finishes[0] == Finish(0, 0, 0, 3, 'target')
  (r,) = rec.timeline.steps
  assert (r['kind'], r['start'], r['num_steps'], r['chunk']) == ('decode', 0, 5, 4)
  assert r['pending'] == [[[0, 0, 10]]] and r['live'] == [0]
  d = accounting.dispatch_steps(rec.timeline, r)
  assert d['tokens'][:, 0].tolist() == [4, 4, 2, 0, 0]
  assert d['past'][:, 0].tolist() == [0, 4, 8, 0, 0]  # the prefix each chunk's attention reads
  assert d['first'][:, 0].tolist() == [0, 0, 1, 0, 0]
  assert d['rows'][:, 0].tolist() == [0, 0, 0, 1, 1]  # it decodes from step 3 on
  assert (m['prefill_steps'], m['decode_steps'], m['generated_tokens']) == (0, 5, 3)
  _, one = sim([Seq(0, 'a', 0, 10, 1, 64)], {0: [0]}, 1, 1, 4)
  assert finish_of(one, 0)['step'] == 2 and one.timeline.num_steps == 3


def test_two_sequences_on_one_worker_share_the_chunk_budget_in_order():
  """Prompts of 5 and 6 tokens admitted together to one worker, chunks of 4: the input stream is
  a0..a4 b0..b5; step 0 runs a0-a3, step 1 a4 and b0-b2, step 2 b3-b5. The first sequence turns
  in at step 1 (ceil(5/4) - 1), the second at step 2 (ceil(11/4) - 1), so responses of 2 and 3
  tokens finish in steps 2 and 4."""
  seqs = [Seq(0, 'a', 0, 5, 2, 64), Seq(1, 'b', 0, 6, 3, 64)]
  ex = Recording(seqs, 1, 2, prefill_chunk=4)
  rec = run(seqs, {0: [0, 1]}, ex, off(), steps_per_dispatch=8, clock=lambda: float(ex.steps),
            prefill_chunk=4)
  assert ex.events == [('admit', 0, [(0, 0, 0), (0, 1, 1)])]  # both at once, lowest slot first
  assert (finish_of(rec, 0)['step'], finish_of(rec, 1)['step']) == (2, 4)
  (r,) = rec.timeline.steps
  assert r['pending'] == [[[0, 0, 5], [1, 0, 6]]]
  d = accounting.dispatch_steps(rec.timeline, r)
  assert d['tokens'][:, 0].tolist() == [4, 4, 3, 0, 0]
  assert d['past'][:, 0].tolist() == [0, 4 + 0, 3, 0, 0]  # step 1: a's 4 before a4, b's none
  assert d['first'][:, 0].tolist() == [0, 1, 1, 0, 0]
  assert d['rows'][:, 0].tolist() == [0, 0, 1, 1, 1]


def test_a_dispatch_stops_for_refill_and_the_next_input_waits_its_turn():
  """One worker, two slots, queue [0, 1, 2]: 0 (prompt 10) and 1 (prompt 5) are admitted; 0
  turns in at step 2 and finishes in step 4 (3 tokens), which stops the dispatch (2 is queued);
  2 is admitted then, its 4 tokens behind nothing (1's input is all in): it turns in at step 5,
  finishes in step 6 with 2 tokens, as does 1 (4 tokens from step 3)."""
  seqs = [Seq(0, 'a', 0, 10, 3, 64), Seq(1, 'b', 0, 5, 4, 64), Seq(2, 'c', 0, 4, 2, 64)]
  m, rec = sim(seqs, {0: [0, 1, 2]}, 1, 2, 4)
  assert [(r['start'], r['num_steps']) for r in rec.timeline.steps] == [(0, 5), (5, 2)]
  assert rec.timeline.steps[1]['pending'] == [[[2, 0, 4]]]
  assert rec.timeline.steps[1]['live'] == [1]
  assert {f['seq_id']: (f['step'], f['slot']) for f in rec.timeline.finishes} == {
      0: (4, 0), 1: (6, 1), 2: (6, 0)}
  assert m['generated_tokens'] == 9 and m['device_steps'] == 7


def test_no_step_is_prefill_only_while_a_row_decodes():
  """The same batch, one-shot and chunked: one-shot refills stall the live rows (the counter
  counts those prefill steps), chunked never runs a prefill-only step."""
  rng = np.random.default_rng(0)
  seqs = [Seq(i, f'p{i}', 0, int(rng.integers(4, 40)), int(n), 64)
          for i, n in enumerate(rng.integers(2, 40, 24))]
  queues = scheduler.static_placement(seqs, [0, 1, 2])
  one, rec1 = sim(seqs, queues, 3, 2, 0)
  chk, rec2 = sim(seqs, queues, 3, 2, 16)
  assert one['prefill_only_steps_while_decoding'] > 0
  assert chk['prefill_only_steps_while_decoding'] == 0 and chk['prefill_steps'] == 0
  for m, rec in ((one, rec1), (chk, rec2)):
    assert m['generated_tokens'] == sum(int(s.target_len or 0) for s in seqs)
    assert {q: f.num_tokens for q, f in rec.finishes.items()} == {s.seq_id: s.target_len
                                                                   for s in seqs}
  # the prompts rode in steps that decoded rows
  by = accounting.finishes_by_step(rec2.timeline)
  mixed = 0
  for r in rec2.timeline.steps:
    d = accounting.dispatch_steps(rec2.timeline, r, by)
    mixed += int(((d['tokens'].sum(1) > 0) & (d['rows'].sum(1) > 0)).sum())
  assert mixed > 0


def test_one_shot_is_todays_timeline():
  """prefill_chunk=0 is the one-shot loop: one prefill step per admission round, no chunk keys
  on the decode records, the prefilled seq of each worker on the prefill's."""
  seqs = [Seq(0, 'a', 0, 8, 3, 64), Seq(1, 'b', 0, 8, 2, 64)]
  m, rec = sim(seqs, {0: [0, 1]}, 1, 1, 0)
  got = [(r['kind'], r['start'], r['num_steps'], r['live'], r.get('admitted'))
         for r in rec.timeline.steps]
  assert got == [('prefill', 0, 1, [1], [0]), ('decode', 1, 2, [1], None),
                 ('prefill', 3, 1, [1], [1]), ('decode', 4, 1, [1], None)]
  assert not any('chunk' in r or 'pending' in r for r in rec.timeline.steps)
  assert (m['device_steps'], m['prefill_steps'], m['decode_steps']) == (5, 2, 3)
  assert m['prefill_only_steps_while_decoding'] == 0  # nothing else was live at either prefill
  default = stepsim.simulate(seqs, None, {0: [0, 1]}, off(), 1, 1, 8)
  assert default == m


def test_the_executor_must_run_the_controllers_chunk():
  seqs = [Seq(0, 'a', 0, 8, 3, 64)]
  ex = stepsim.SimExecutor(seqs, 1, 1, prefill_chunk=4)
  with pytest.raises(ControllerError, match='prefill_chunk'):
    run(seqs, {0: [0]}, ex, off(), prefill_chunk=8)
  with pytest.raises(ValueError, match='prefill_chunk'):
    run(seqs, {0: [0]}, ex, off(), prefill_chunk=-1)


class Early(stepsim.SimExecutor):
  """Reports a pending sequence's finish one step before its input is all in."""

  def decode(self, max_steps, stop_on_refill, stop_on_idle):
    k, out = super().decode(max_steps, stop_on_refill, stop_on_idle)
    return k, [Finish(f.seq_id, f.worker, f.slot, f.num_tokens + 1, f.reason) for f in out]


def test_a_finish_before_the_input_turns_in_fails_loudly():
  seqs = [Seq(0, 'a', 0, 10, 3, 64)]
  ex = Early(seqs, 1, 1, prefill_chunk=4)
  with pytest.raises(ControllerError, match='turns in at step 2'):
    run(seqs, {0: [0]}, ex, off(), prefill_chunk=4)


# -- migration and preemption of pending rows ---------------------------------------------------

class MoveOnce:
  """A release policy that, the first time worker 0's slot 0 is occupied, moves it to worker
  1's slot 1 and releases worker 0."""
  enabled = True

  def __init__(self):
    self.done = False

  def stop_masks(self, st):
    z = np.zeros(len(st.active), bool)
    return z, z

  def plan(self, st):
    if self.done or st.slots[0][0] < 0:
      return None
    self.done = True
    return Plan(moves=[(0, 0, 1, 1)], new_active=[1])


def test_migrating_a_pending_sequence_is_a_preemption_queued_on_the_destination():
  """Seq 0 (prompt 10) is admitted to worker 0, pending; the plan moves it to worker 1 and
  releases worker 0. Its partial input is dropped (preempt at the source, no migration), it goes
  to the front of worker 1's queue, is admitted there again with its whole prompt, and
  finishes on worker 1 as if it had started there."""
  seqs = [Seq(0, 'a', 0, 10, 3, 64), Seq(1, 'b', 0, 4, 2, 64)]
  ex = Recording(seqs, 2, 2, prefill_chunk=4)
  rec = run(seqs, {0: [0], 1: [1]}, ex, MoveOnce(), clock=lambda: float(ex.steps),
            prefill_chunk=4)
  assert ex.events == [('admit', 0, [(0, 0, 0), (1, 0, 1)]), ('preempt', 0, [(0, 0, True)]),
                       ('admit', 0, [(1, 1, 0)])]  # no migrate
  (mig,) = rec.timeline.migrations
  assert mig['moves'] == [] and mig['queue_moves'] == [[0, 1, 0]]
  # worker 1's input: 1's prompt (4 tokens: in at step 0, 2 tokens: done in step 1), then 0's
  # whole prompt (10 more: in at ceil(14 / 4) - 1 = 3, 3 tokens: done in step 5)
  assert rec.timeline.steps[0]['pending'] == [[[1, 0, 4], [0, 0, 10]]]
  assert rec.finishes[0] == Finish(0, 1, 1, 3, 'target')
  assert finish_of(rec, 0)['step'] == 5 and finish_of(rec, 1)['step'] == 1
  m = rec.metrics()
  assert m['num_migrations'] == 0 and m['generated_tokens'] == 5
  assert [w['release_step'] for w in m['workers']] == [0, 6]


def _paged(seqs, pages, spd, chunk):
  pool = PagePool(1, pages, 4, 2, predicted={s.seq_id: 1.0 for s in seqs}, margin=0.0)
  ex = Recording(seqs, 1, 2, prefill_chunk=chunk, pool=pool)
  rec = run(seqs, {0: [s.seq_id for s in seqs]}, ex, off(), steps_per_dispatch=spd, kv=pool,
            clock=lambda: float(ex.steps), prefill_chunk=chunk)
  pool.check()
  assert pool.used_pages(0) == 0
  return pool, ex, rec


def test_paged_pool_grows_a_pending_row_and_preempts_it_first():
  """A pool of 6 pages of 4 tokens, one worker, chunks of 4, 3 steps a dispatch. A (prompt 4)
  takes pages for 4 + 1 tokens (2); B (prompt 12) is admitted beside it (A's 2 pages + B's
  reservation of 12 + 1 + 3 tokens = 4 pages fit 6) with pages for 13 tokens (4). Before the
  first dispatch every row holds pages for its input + 3 tokens: A 2, B 4 (pending: its whole
  prompt + max_steps). That dispatch runs A's prompt and B's first 8 tokens; A has 3 tokens.
  Before the next, A needs 4 + 3 + 3 tokens (3 pages), the pool has none free: the youngest row,
  B, still pending, is preempted (its 8 tokens of input lost), queued first again, admitted when
  A finishes (step 5, A's 6th token) into slot 0 with its whole prompt, in at step 6 + 2."""
  seqs = [Seq(0, 'a', 0, 4, 6, 16), Seq(1, 'b', 0, 12, 3, 8)]
  pool, ex, rec = _paged(seqs, 6, 3, 4)
  assert ex.events == [('admit', 0, [(0, 0, 0), (0, 1, 1)]), ('preempt', 3, [(0, 1, True)]),
                       ('admit', 6, [(0, 0, 1)])]
  assert ex.owned[0] == (0, {0: 2, 1: 4})
  assert pool.preemptions == [dict(worker=0, slot=1, seq_id=1, pages=4)]
  assert [(r['start'], r['pending']) for r in rec.timeline.steps] == [
      (0, [[[0, 0, 4], [1, 0, 12]]]), (3, [[]]), (6, [[[1, 0, 12]]]), (9, [[]])]
  assert (finish_of(rec, 0)['step'], finish_of(rec, 1)['step']) == (5, 10)
  assert rec.finishes[1].num_tokens == 3


def test_paged_pool_resumes_a_preempted_live_row_with_the_tokens_it_kept():
  """Pool of 6 pages, chunks of 4, 4 steps a dispatch: A (prompt 4, 6 tokens) and B (prompt 8,
  5 tokens) start together; B turns in at step 2 and has 2 tokens after the first dispatch.
  Then A needs 3 pages and B 4 of the 6: B, the youngest, is preempted live with its 2 tokens;
  it comes back when A is done (step 5) with an input of 8 + 2 tokens, turns in at step
  6 + ceil(10/4) - 1 = 8 (its 3rd token) and finishes in step 10 with 5 tokens in all."""
  seqs = [Seq(0, 'a', 0, 4, 6, 16), Seq(1, 'b', 0, 8, 5, 8)]
  pool, ex, rec = _paged(seqs, 6, 4, 4)
  assert ex.events == [('admit', 0, [(0, 0, 0), (0, 1, 1)]), ('preempt', 4, [(0, 1, False)]),
                       ('admit', 6, [(0, 0, 1)])]
  assert rec.timeline.steps[2]['pending'] == [[[1, 0, 10]]]
  assert finish_of(rec, 1)['step'] == 10 and rec.finishes[1].num_tokens == 5


@pytest.mark.parametrize('seed', [0, 1, 2, 3])
@pytest.mark.parametrize('kind', ['static', 'release', 'compaction', 'paged', 'paged_release'])
def test_conservation_under_chunked_prefill(seed, kind):
  """Random batches under every policy, fixed slots and a tight paged pool, chunks small enough
  that prompts stay pending for a while (so that releases move and pools preempt pending rows):
  every sequence finishes once with its own length, device-steps are the steps the timeline
  holds x its workers, and the pool gives every page back."""
  rng = np.random.default_rng(seed)
  N, B = 4, 3
  L = rng.integers(1, 50, 30)
  seqs = [Seq(i, f'p{i // 4}', i % 4, int(rng.integers(1, 60)), int(n), 64)
          for i, n in enumerate(L)]
  pred = {s.seq_id: float(n) * rng.uniform(0.5, 1.5) for s, n in zip(seqs, L, strict=True)}
  kv = PagePool(N, 32, 4, B, predicted=pred, margin=0.0) if kind.startswith('paged') else None
  if kind in ('static', 'paged'):
    queues = scheduler.static_placement(seqs, list(range(N)))
    pol = release_policy.ReleasePolicy(False)
  else:
    queues = cast(dict[int, list[int]], scheduler.flexfloor_placement(
        seqs, list(pred.values()), list(range(N)), B))
    pol = release_policy.ReleasePolicy(floor=1, predicted=pred, compaction=kind != 'release')
  chunk = int(rng.integers(1, 6))
  m, rec = stepsim.simulate(seqs, None, queues, pol, N, B, 5, return_record=True, kv=kv,
                            prefill_chunk=chunk)
  assert {q: f.num_tokens for q, f in rec.finishes.items()} == {s.seq_id: s.target_len
                                                                 for s in seqs}
  assert m['generated_tokens'] == L.sum() and m['prefill_steps'] == 0
  assert m['prefill_only_steps_while_decoding'] == 0
  assert m['device_steps'] == sum(r['num_steps'] * len(r['active']) for r in rec.timeline.steps)
  if kv is not None:
    kv.check()
    assert all(kv.used_pages(w) == 0 for w in range(N))
  # the rows the timeline says decode in each step never exceed the slots
  by = accounting.finishes_by_step(rec.timeline)
  for r in rec.timeline.steps:
    d = accounting.dispatch_steps(rec.timeline, r, by)
    assert (d['rows'] >= 0).all() and (d['rows'] <= B).all()
    assert (d['tokens'] <= chunk).all()


# -- pricing ------------------------------------------------------------------------------------

class Linear:
  """A hand step cost linear in every argument: pricing a piece at its middle step is exact,
  so a dispatch's closed form must equal the sum over its steps."""
  name = 'linear'

  def mixed_seconds(self, rows, kv, chunk, past):
    w = np.arange(1, len(rows) + 1)  # weights by worker, so a mix-up between workers shows
    return float(1.0 + (w * (0.1 * rows + 0.001 * kv + 0.01 * chunk + 0.0001 * past)).sum())

  def worker_step_seconds(self, rows, kv):
    return self.mixed_seconds(rows, kv, np.zeros(len(rows)), np.zeros(len(rows)))


def test_dispatch_seconds_with_chunks_is_the_sum_of_its_steps():
  """Two workers: worker 0 has live rows (5 and 2 tokens left, 30 and 12 cached) and a pending
  list of a half-run prompt and a fresh one; worker 1 only pending input. The closed form equals
  the step-by-step sum of the same cost over the timeline's own expansion of the dispatch."""
  cost = Linear()
  C, k = 4, 7
  rem = np.array([[5, 2, 0], [0, 0, 0]], float)
  ctx = np.array([[30, 12, 0], [0, 0, 0]], float)
  # (left, ran, after): worker 0: c has 6 of 9 run, d fresh; worker 1: e, f fresh
  pending = [[(3, 6, 3), (5, 0, 5)], [(11, 0, 0), (3, 0, 4)]]
  got = costs.mixed_dispatch_seconds(cost.mixed_seconds, rem, ctx, k, C, pending)
  # the same dispatch as a timeline record, expanded step by step
  tl = accounting.Timeline(workers=[0, 1], slots_per_worker=3, t_start=0.0)
  tl.add_step('decode', 0, k, [0, 1], [2, 0], 0.0, 1.0, chunk=C,
              pending=[[[2, 6, 3], [3, 0, 5]], [[4, 0, 11], [5, 0, 3]]])
  # finishes: worker 0's live rows in steps 4 and 1; c turns in at 0 (3 <= 4), 3 more: step 3;
  # d turns in at 1 (8 tokens in), 5 more: step 6; e at 2 (11), finishes there; f at 3, step 7
  for q, w, at in ((0, 0, 4), (1, 0, 1), (2, 0, 3), (3, 0, 6), (4, 1, 2)):
    tl.add_finish(q, w, 0, 1, 'target', at)
  d = accounting.dispatch_steps(tl, tl.steps[0])
  assert d['tokens'].tolist() == [[4, 4], [4, 4], [0, 4], [0, 2], [0, 0], [0, 0], [0, 0]]
  assert d['first'].tolist() == [[1, 0], [1, 0], [0, 1], [0, 1], [0, 0], [0, 0], [0, 0]]
  assert d['rows'].tolist() == [[2, 0], [3, 0], [3, 0], [3, 0], [2, 1], [1, 1], [1, 1]]
  # cached tokens per row per step, by hand: a: 30 + t (t <= 4); b: 12 + t (t <= 1);
  # c: in at 0 with 9 + 1 cached from step 1 (to step 3); d: in at 1, 5 + 1 from step 2 (to 6);
  # f: in at 3, 3 + 1 from step 4 (its 4 more tokens run past the dispatch)
  want = 0.0
  for t in range(k):
    rows = np.zeros(2)
    kv = np.zeros(2)
    for w, start, end, c0 in ((0, 0, 5, 30), (0, 0, 2, 12), (0, 1, 4, 10), (0, 2, 7, 6),
                              (1, 4, 8, 4)):
      if start <= t < end:
        rows[w] += 1
        kv[w] += c0 + t - start
    want += cost.mixed_seconds(rows, kv, d['tokens'][t].astype(float),
                               d['past'][t].astype(float))
  assert got == pytest.approx(want, rel=1e-12)
  assert d['past'].tolist() == [[6 + 0, 0], [0 + 1, 4], [0, 8], [0, 0 + 1], [0, 0], [0, 0],
                                [0, 0]]
  # no pending input: the decode-only closed form
  assert costs.mixed_dispatch_seconds(cost.mixed_seconds, rem, ctx, 3, C, [[], []]) == \
      pytest.approx(costs.dispatch_seconds(cost.worker_step_seconds, rem, ctx, 3))


class Table:
  """A hand cost table: a step of `base` seconds, each input token adding `per_token`."""
  name = 'table'

  def __init__(self, per_token):
    self.per_token = per_token

  def mixed_seconds(self, rows_w, kv_w, chunk_w, past_w):
    return float(0.01 + 0.001 * rows_w.max() + self.per_token * chunk_w.max())

  def worker_step_seconds(self, rows_w, kv_w):
    return self.mixed_seconds(rows_w, kv_w, np.zeros(len(rows_w)), np.zeros(len(rows_w)))

  def decode_seconds(self, n_active, live_seqs):
    return self.worker_step_seconds(np.full(n_active, live_seqs / n_active), np.zeros(n_active))

  def prefill_seconds(self, prompt_w):
    return self.mixed_seconds(np.zeros(len(prompt_w)), prompt_w * 0, prompt_w, prompt_w * 0)


def test_admission_chunk_takes_few_tokens_where_they_cost_and_all_where_free():
  # 10 ms a token against a 14 ms decode step: one token (the least) is all a step takes
  assert costs.admission_chunk(Table(0.01), 512, 4, 300.0) == 1
  # 10 us a token: 10% of 14 ms is 140 tokens
  assert costs.admission_chunk(Table(1e-5), 512, 4, 300.0) == 140
  assert costs.admission_chunk(Table(1e-5), 64, 4, 300.0) == 64  # the configured chunk caps it
  assert costs.admission_chunk(Table(0.0), 512, 4, 300.0) == 512  # free: all of it
  assert costs.admission_chunk(Table(1e-5), 512, 4, 300.0, growth=0.2) == 280
  with pytest.raises(ValueError, match='max_chunk'):
    costs.admission_chunk(Table(0.0), 0, 4, 300.0)


def test_measured_table_prices_a_mixed_step_as_a_step_of_its_size():
  c = costs.MeasuredStepCost({2: 0.004, 8: 0.006})
  z = np.zeros(4)
  assert c.mixed_seconds(z + 3, z + 900, z + 256, z) == c.decode_seconds(4) == pytest.approx(
      0.0046666666)
