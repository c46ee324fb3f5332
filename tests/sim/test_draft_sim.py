"""Speculative decoding in the step simulator: the controller's per-step rule by hand, tokens
conserved against plain decoding on random responses and drafts, and drafted steps priced as
mixed steps by the step simulator and the replay's executor."""

import numpy as np
import pytest

from flexfloor_jax.policy import release_policy, scheduler, stepsim
from flexfloor_jax.policy.controller import ControllerError, Seq, run
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.policy.pages import PagePool
from flexfloor_jax.sim import costs, presets, replay


class Guesses:
  """A drafting policy of fixed guesses: each live sequence's draft is the next D tokens of its
  guessed response after the tokens it has made (none where the guess is spent)."""

  def __init__(self, guesses, draft_tokens):
    self.guesses = {q: np.asarray(g, np.int32) for q, g in guesses.items()}
    self.draft_tokens = draft_tokens
    self.reports = []

  def drafts(self, st, responses, max_steps):
    del st, max_steps
    return {q: self.guesses[q][len(r):len(r) + self.draft_tokens]
            for q, r in responses.items() if q in self.guesses}

  def observe(self, report):
    self.reports.append(dict(report))


class Nothing(Guesses):
  """Drafts nothing: every dispatch decodes plainly."""

  def drafts(self, st, responses, max_steps):
    return {}


def mkseqs(lengths, prompt=8, max_new=64):
  return [Seq(i, f'p{i // 4}', i % 4, prompt, int(n), max_new) for i, n in enumerate(lengths)]


def responses_for(lengths, vocab=50, seed=0):
  rng = np.random.default_rng(seed)
  return {i: rng.integers(0, vocab, int(n)).astype(np.int32) for i, n in enumerate(lengths)}


def one_worker(lengths, draft_tokens=4):
  """1 worker x 4 slots, every seq prefilled (its first token made), in slots 0, 1, ..."""
  seqs, resp = mkseqs(lengths), responses_for(lengths)
  ex = stepsim.SimExecutor(seqs, 1, 4, responses=resp, draft_tokens=draft_tokens)
  for i in range(len(lengths)):
    ex.prefill([(0, i, i)])
  return ex, resp


NO = np.zeros(1, bool)


def test_a_correct_draft_of_three_makes_four_tokens_in_one_step():
  ex, resp = one_worker([10])
  k, fins = ex.decode(1, NO, NO, drafts={0: resp[0][1:4]})
  assert (k, fins) == (1, [])
  assert ex.dispatch_report == {0: (4, 3, 3)}
  assert ex.generated[0][0] == 5
  np.testing.assert_array_equal(ex.responses([0])[0], resp[0][:5])
  # spent after one step: then a token a step
  ex2, _ = one_worker([10])
  k, _ = ex2.decode(3, NO, NO, drafts={0: resp[0][1:4]})
  assert k == 3 and ex2.dispatch_report == {0: (6, 3, 3)}


def test_a_draft_wrong_at_its_second_token_makes_two_then_decodes_plainly():
  ex, resp = one_worker([10])
  d = resp[0][1:4].copy()
  d[1] += 1  # the token sampled after d_1 differs from d_2
  k, _ = ex.decode(1, NO, NO, drafts={0: d})
  assert k == 1 and ex.dispatch_report == {0: (2, 3, 1)}
  ex, resp = one_worker([10])
  k, _ = ex.decode(4, NO, NO, drafts={0: d})
  # step 0: d_1 kept, d_2 wrong (the draft dies); steps 1-3: one token each, nothing verified
  assert k == 4 and ex.dispatch_report == {0: (5, 3, 1)}
  assert ex.generated[0][0] == 6


def test_free_slots_limit_the_verification_rows():
  """3 live rows and 1 free slot: only the lowest live slot verifies, one drafted token; the
  others decode a token, their drafts still alive (it was their next token)."""
  ex, resp = one_worker([20, 20, 20])
  drafts = {q: resp[q][1:4] for q in range(3)}
  k, _ = ex.decode(1, NO, NO, drafts=drafts)
  assert k == 1 and ex.dispatch_report == {0: (2, 1, 1), 1: (1, 0, 0), 2: (1, 0, 0)}
  # 3 steps: slot 0 takes the free slot while its draft lasts (step 0 keeps d_1 and makes d_2,
  # step 1 keeps d_3: spent), then it goes to slot 1 (made d_1 and d_2 a token a step, its
  # draft alive: keeps d_3 in step 2); slot 2 never gets it
  ex, resp = one_worker([20, 20, 20])
  k, _ = ex.decode(3, NO, NO, drafts=drafts)
  assert k == 3 and ex.dispatch_report == {0: (5, 2, 2), 1: (4, 1, 1), 2: (3, 0, 0)}
  # a draft that went wrong while it waited (its 2nd token, made plainly in step 1) verifies
  # nothing: in step 2 the free slot goes on to slot 2
  ex, resp = one_worker([20, 20, 20])
  bad = dict(drafts)
  bad[1] = resp[1][1:4].copy()
  bad[1][1] += 1
  k, _ = ex.decode(3, NO, NO, drafts=bad)
  assert k == 3 and ex.dispatch_report == {0: (5, 2, 2), 1: (3, 0, 0), 2: (4, 1, 1)}
  # no free slot: nothing verifies
  ex, resp = one_worker([20, 20, 20, 20])
  k, _ = ex.decode(2, NO, NO, drafts={q: resp[q][1:4] for q in range(4)})
  assert ex.dispatch_report == {q: (2, 0, 0) for q in range(4)}


def test_a_draft_beyond_the_length_stops_at_the_length():
  ex, resp = one_worker([3, 30])
  d = np.concatenate([resp[0][1:3], [7, 7]]).astype(np.int32)  # the response ends after 2
  k, fins = ex.decode(8, np.ones(1, bool), NO, drafts={0: d})
  assert k == 1 and len(fins) == 1
  f = fins[0]
  assert (f.seq_id, f.slot, f.num_tokens, f.step, f.reason) == (0, 0, 3, 0, 'target')
  assert ex.dispatch_report == {0: (2, 1, 1), 1: (1, 0, 0)}
  assert ex.slot_seq[0][0] == -1


def test_finish_step_and_report_through_the_controller():
  """1 worker x 4 slots, perfect guesses, D=3, lengths 8 and 12, prefilled at steps 0 and 1.
  First dispatch (8 steps, from step 2), 2 free slots a step: step 0, s0 verifies 2 (3 tokens),
  s1 none; step 1, s0's draft is spent (1 token), s1 verifies 2 (3 tokens); then one token a
  step each: s0 (1 + 3 + 1 + 1 + 1 + 1 = 8) finishes in dispatch step 4, s1 has 1 + 10 = 11
  after it. Second dispatch: s1's draft is its last token, which it may not verify (w =
  min(1, 1 - 1) = 0): it finishes in step 0."""
  lengths = [8, 12]
  seqs, resp = mkseqs(lengths), responses_for(lengths)
  ex = stepsim.SimExecutor(seqs, 1, 4, responses=resp, draft_tokens=3)
  pol = Guesses(resp, 3)
  rec = run(seqs, {0: [0, 1]}, ex, release_policy.ReleasePolicy(False), steps_per_dispatch=8,
            clock=lambda: float(ex.steps), drafting=pol)
  f0, f1 = rec.finishes[0], rec.finishes[1]
  assert (f0.num_tokens, f0.step, f1.num_tokens, f1.step) == (8, 4, 12, 0)
  assert {f['seq_id']: f['step'] for f in rec.timeline.finishes} == {0: 6, 1: 10}
  assert pol.reports == [{0: (7, 2, 2), 1: (10, 2, 2)}, {1: (1, 0, 0)}]
  dec = [(r['start'], r['num_steps'], r['drafted'], r['accepted'])
         for r in rec.timeline.steps if r['kind'] == 'decode']
  assert dec == [(2, 8, [4], [4]), (10, 1, [0], [0])]
  m = rec.metrics()
  assert m['generated_tokens'] == 20 and m['makespan_steps'] == 11
  assert 0 < m['slot_utilization'] <= 1
  plain = stepsim.simulate(seqs, None, {0: [0, 1]}, release_policy.ReleasePolicy(False), 1, 4, 8)
  assert plain['makespan_steps'] == 13  # s1: prefill at 1, 11 decode steps


def random_case(seed, vocab=3):
  """Random lengths (some of 1: done at prefill), responses over a small vocabulary, guesses
  made from each response with random corruption."""
  rng = np.random.default_rng(seed)
  L = rng.integers(1, 40, int(rng.integers(10, 40)))
  L[::7] = 1
  seqs = mkseqs(L)
  resp = {i: rng.integers(0, vocab, int(n)).astype(np.int32) for i, n in enumerate(L)}
  wrong = rng.uniform(0.0, 0.5)
  guess = {q: np.where(rng.random(len(r)) < wrong, (r + 1) % vocab, r).astype(np.int32)
           for q, r in resp.items()}
  return rng, L, seqs, resp, guess


def drafted_run(seqs, queues, N, B, resp, pol, policy, steps, kv=None):
  ex = stepsim.SimExecutor(seqs, N, B, responses=resp, draft_tokens=pol.draft_tokens)
  rec = run(seqs, queues, ex, policy, steps_per_dispatch=steps, clock=lambda: float(ex.steps),
            drafting=pol, kv=kv)
  return rec, ex


def check_conserved(rec, seqs, L, pol):
  assert sorted(rec.finishes) == [s.seq_id for s in seqs]
  for s in seqs:
    f = rec.finishes[s.seq_id]
    assert f.num_tokens == L[s.seq_id] and f.reason == 'target'
  assert len(rec.timeline.finishes) == len(seqs)
  m = rec.metrics()
  assert m['generated_tokens'] == L.sum()
  assert 0 < m['slot_utilization'] <= 1  # verification rows use free slots: <= B tokens a step
  dec = [r for r in rec.timeline.steps if r['kind'] == 'decode']
  drafted = sum(sum(r['drafted']) for r in dec)
  accepted = sum(sum(r['accepted']) for r in dec)
  assert 0 <= accepted <= drafted
  assert accepted == sum(v[2] for rep in pol.reports for v in rep.values())
  assert drafted == sum(v[1] for rep in pol.reports for v in rep.values())
  return m, accepted


@pytest.mark.parametrize('seed', range(6))
def test_drafting_conserves_tokens_and_takes_no_more_steps(seed):
  """Static placement, several workers: every sequence finishes with its full length, drafting
  on or off; on takes no more steps (a worker with a queue has no free slot, so only workers
  that admit nothing more are sped up) and fewer where drafts were kept; drafts always wrong
  run the plain schedule step for step."""
  rng, L, seqs, resp, guess = random_case(seed)
  N, B, D = int(rng.integers(2, 5)), int(rng.integers(2, 6)), int(rng.integers(1, 5))
  steps = int(rng.integers(1, 10))
  queues = scheduler.static_placement(seqs, list(range(N)))
  off = release_policy.ReleasePolicy(False)
  pol_on = Guesses(guess, D)
  on_rec, _ = drafted_run(seqs, queues, N, B, resp, pol_on, off, steps)
  pol_none = Nothing({}, D)
  none_rec, _ = drafted_run(seqs, queues, N, B, resp, pol_none, off, steps)
  plain_m = stepsim.simulate(seqs, None, queues, off, N, B, steps)
  m_on, kept = check_conserved(on_rec, seqs, L, pol_on)
  m_none, _ = check_conserved(none_rec, seqs, L, pol_none)
  # drafting nothing is plain decoding: the same steps as an executor without drafting
  assert m_none['device_steps'] == plain_m['device_steps']
  assert m_none['makespan_steps'] == plain_m['makespan_steps']
  assert m_on['makespan_steps'] <= m_none['makespan_steps']
  assert m_on['device_steps'] <= m_none['device_steps']
  assert m_on['device_steps'] == m_on['makespan_steps'] * N  # static: every worker throughout
  assert m_on['tokens_per_device_step'] >= m_none['tokens_per_device_step']
  assert kept > 0 or m_on['makespan_steps'] == m_none['makespan_steps']
  # always wrong (every drafted token differs from the response): the plain schedule exactly
  pol_bad = Guesses({q: (r + 1) % 3 for q, r in resp.items()}, D)
  bad_rec, _ = drafted_run(seqs, queues, N, B, resp, pol_bad, off, steps)
  m_bad, bad_kept = check_conserved(bad_rec, seqs, L, pol_bad)
  assert bad_kept == 0
  shape = [(r['kind'], r['start'], r['num_steps']) for r in bad_rec.timeline.steps]
  assert shape == [(r['kind'], r['start'], r['num_steps']) for r in none_rec.timeline.steps]
  assert m_bad['makespan_steps'] == m_none['makespan_steps']
  assert {f.seq_id: (f.worker, f.slot) for f in bad_rec.finishes.values()} == \
      {f.seq_id: (f.worker, f.slot) for f in none_rec.finishes.values()}


@pytest.mark.parametrize('seed', range(4))
def test_drafting_conserves_tokens_under_releases_and_paged_kv(seed):
  """A release policy (migrations, shrinks) and a tight page pool (preemptions: a resumed
  sequence's response continues where it stopped): every sequence still finishes whole."""
  rng, L, seqs, resp, guess = random_case(100 + seed)
  N, B, D = 3, 4, int(rng.integers(1, 5))
  pred = {s.seq_id: float(n) * rng.uniform(0.5, 1.5) for s, n in zip(seqs, L, strict=True)}
  queues = scheduler.flexfloor_placement(seqs, list(pred.values()), list(range(N)), B)
  pol = Guesses(guess, D)
  rel = release_policy.ReleasePolicy(floor=1, predicted=pred, compaction=True)
  rec, _ = drafted_run(seqs, queues, N, B, resp, pol, rel, 6)
  check_conserved(rec, seqs, L, pol)
  assert any(not r['final'] for r in rec.timeline.releases)
  pol = Guesses(guess, D)
  kv = PagePool(N, 24, 4, B, predicted={s.seq_id: 1.0 for s in seqs}, margin=0.0,
                page_ids=False)
  rec, _ = drafted_run(seqs, scheduler.static_placement(seqs, list(range(N))), N, B, resp, pol,
                       release_policy.ReleasePolicy(False), 6, kv=kv)
  _, kept = check_conserved(rec, seqs, L, pol)
  assert kv.stats()['preemptions'] > 0 and kept > 0


def test_no_drafts_is_the_plain_executor_exactly():
  """An executor built for drafting that is given no drafts runs the plain jump: the same
  timeline and the same seconds as one without drafting; its dispatch report counts a token a
  step."""
  _, L, seqs, resp, _ = random_case(7)
  queues = scheduler.static_placement(seqs, [0, 1, 2])
  cost = costs.RooflineStepCost(presets.MODELS['mixtral-8x7b'], presets.HARDWARE['h100'], 0.0)
  off = release_policy.ReleasePolicy(False)
  pol = Nothing({}, 3)
  m1, r1 = stepsim.simulate(seqs, None, queues, off, 3, 4, 5, return_record=True, cost=cost,
                            responses=resp, drafting=pol)
  m2, r2 = stepsim.simulate(seqs, None, queues, off, 3, 4, 5, return_record=True, cost=cost)
  strip = [{k: v for k, v in r.items() if k not in ('drafted', 'accepted', 'drafts')}
           for r in r1.timeline.steps]
  assert strip == r2.timeline.steps and r1.timeline.finishes == r2.timeline.finishes
  assert m1['generation_wall_s'] == m2['generation_wall_s']
  assert sum(v[0] for rep in pol.reports for v in rep.values()) == L.sum() - len(L)


def test_responses_must_agree_with_lengths():
  seqs = mkseqs([3, 4])
  resp = {0: [1, 2, 3], 1: [1, 2, 3, 4]}
  stepsim.SimExecutor(seqs, 1, 2, {0: 3, 1: 4}, responses=resp, draft_tokens=2)
  with pytest.raises(stepsim.SimError, match='length'):
    stepsim.SimExecutor(seqs, 1, 2, {0: 3, 1: 5}, responses=resp)
  with pytest.raises(stepsim.SimError, match='responses'):
    stepsim.SimExecutor(seqs, 1, 2, draft_tokens=2)
  with pytest.raises(stepsim.SimError, match='chunked'):
    stepsim.SimExecutor(seqs, 1, 2, responses=resp, draft_tokens=2, prefill_chunk=4)
  ex = stepsim.SimExecutor(seqs, 1, 2, responses=resp, draft_tokens=2)
  with pytest.raises(ControllerError, match='draft_tokens'):
    run(seqs, {0: [0, 1]}, ex, release_policy.ReleasePolicy(False), drafting=Guesses(resp, 3))


ROOF = ('mixtral-8x7b', 'h100')


def test_a_drafted_step_is_priced_as_a_mixed_step():
  """One sequence (prompt 16, length 5) on 1 worker x 4 slots, perfect drafts of 3: a prefill
  step and one decode step that makes the 4 tokens left, priced by hand: the decode step is
  mixed_seconds of 1 row reading 17 cached tokens and 3 verification rows extending its prefix
  of 17 tokens, as a chunk of 3 input tokens would. The step simulator (RooflineStepCost) and
  the replay's executor (RooflineCost, one expert placement) agree with it."""
  m, hw = presets.MODELS[ROOF[0]], presets.HARDWARE[ROOF[1]]
  seqs = [Seq(0, 'p', 0, 16, 5, 64)]
  resp = responses_for([5])
  step_cost = costs.RooflineStepCost(m, hw, 0.0)
  got, rec = stepsim.simulate(seqs, None, {0: [0]}, release_policy.ReleasePolicy(False), 1, 4,
                              8, return_record=True, cost=step_cost, responses=resp,
                              drafting=Guesses(resp, 3))
  assert got['makespan_steps'] == 2 and rec.finishes[0].step == 0
  one = np.ones(1)
  hand = step_cost.prefill_seconds(16 * one) + step_cost.mixed_seconds(
      one, 17 * one, 3 * one, 17 * one)
  assert got['generation_wall_s'] == pytest.approx(hand, rel=1e-12)
  plain = step_cost.prefill_seconds(16 * one) + sum(
      step_cost.worker_step_seconds(one, (17 + j) * one) for j in range(4))
  assert hand < plain  # memory-bound decode: one step of 4 rows beats 4 steps of one

  roof = costs.RooflineCost(m, hw)
  ex = replay.CostExecutor(seqs, 1, 4, cost=roof, responses=resp, draft_tokens=3)
  rec = run(seqs, {0: [0]}, ex, release_policy.ReleasePolicy(False), clock=ex.clock,
            drafting=Guesses(resp, 3))
  held = np.ones(1)  # no placement: one expert held
  hand = roof.step_seconds(held, 16 * one, 16 * one, 16 * one * 16 / 2) + roof.mixed_seconds(
      held, one, 17 * one, 3 * one, 17 * one)
  assert rec.metrics()['generation_wall_s'] == pytest.approx(hand, rel=1e-12)


def test_replay_prices_drafted_dispatches():
  """The bench's replay of a static rollout with perfect drafts: fewer steps than plain
  decoding, the same tokens, fewer seconds on the roofline, and the replay's executor prices
  each drafted step as the step simulator does (8 workers hold one expert each on both); the
  `cpu` preset counts each verification row as a decode row."""
  from flexfloor_jax.policy import plan, workload

  seqs = workload.make_seqs(workload.WorkloadSpec(), 0)
  L = {s.seq_id: min(s.target_len or s.max_new_tokens, s.max_new_tokens) for s in seqs}
  rng = np.random.default_rng(3)
  resp = {q: rng.integers(0, 5, n).astype(np.int32) for q, n in L.items()}
  m, hw = presets.MODELS[ROOF[0]], presets.HARDWARE[ROOF[1]]
  args = (seqs, None, LengthHistory(), 'static', 8, 4, 8)
  roof = costs.RooflineCost(m, hw)
  plain, _ = replay.replay(*args, model=m, cost=roof)
  pol = Guesses(resp, 4)
  got, rec = replay.replay(*args, model=m, cost=roof, responses=resp, drafting=pol)
  assert got['generated_tokens'] == plain['generated_tokens'] == sum(L.values())
  assert got['makespan_steps'] < plain['makespan_steps']
  assert got['device_steps'] < plain['device_steps']
  assert got['generation_wall_s'] < plain['generation_wall_s']
  assert sum(sum(r.get('accepted', [0])) for r in rec.timeline.steps) > 0
  queues, policy, _ = plan.plan_rollout(seqs, LengthHistory(), 'static', 8, 4, 8)
  ref = stepsim.simulate(seqs, None, queues, policy, 8, 4, 8, responses=resp,
                         drafting=Guesses(resp, 4), cost=costs.RooflineStepCost(m, hw, 0.0))
  assert ref['device_steps'] == got['device_steps']
  assert got['generation_wall_s'] == pytest.approx(ref['generation_wall_s'], rel=1e-9)
  lin, rec = replay.replay(*args, cost=costs.LinearCost(decode_slot_step=1.0), responses=resp,
                           drafting=Guesses(resp, 4))
  drafted = sum(sum(r.get('drafted', [0])) for r in rec.timeline.steps)
  kept = sum(sum(r.get('accepted', [0])) for r in rec.timeline.steps)
  # the rows a step decodes: every token but the first, less the kept drafted ones, are one row
  # step each; every verification row one more
  assert lin['generation_wall_s'] == pytest.approx(
      lin['generated_tokens'] - len(seqs) - kept + drafted)
