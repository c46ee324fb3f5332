"""Which drafted tokens a dispatch verifies (policy/speculation.py), on hand-made step costs whose
answer is plain: nothing where a drafted token costs more than it saves or the drafts are seldom
right, whole drafts where checking is free, never more drafted tokens on a worker than its free
slots, drafting hidden under the slowest worker of the SPMD step, all workers drafting together
where only that pays; without a cost model the Drafter's drafts go out as they are."""

import subprocess
import sys
from collections import deque

import numpy as np
import pytest

from flexfloor_jax.policy.controller import DraftingPolicy, Seq, State
from flexfloor_jax.policy.drafts import Drafter, DraftRow, ResponseStore
from flexfloor_jax.policy.speculation import DraftPolicy

D = 3
CTX = 20  # response tokens a live row has made
PROMPT = 7


class _Hand:
  """A hand-made StepCost: only its mixed step matters here."""
  name = 'hand'

  def mixed_seconds(self, rows_w, kv_w, chunk_w, past_w) -> float:
    raise NotImplementedError

  def decode_seconds(self, n_active, live_seqs):
    return self.mixed_seconds(np.ones(n_active), np.zeros(n_active), np.zeros(n_active),
                              np.zeros(n_active))

  def worker_step_seconds(self, rows_w, kv_w):
    z = np.zeros(len(rows_w))
    return self.mixed_seconds(rows_w, kv_w, z, z)

  def prefill_seconds(self, prompt_w):
    return self.worker_step_seconds(prompt_w, prompt_w)


class Doubling(_Hand):
  """Each drafted token a worker checks doubles the step (compute-bound)."""
  name = 'doubling'

  def mixed_seconds(self, rows_w, kv_w, chunk_w, past_w):
    return 2.0 ** float(np.max(chunk_w))


class Free(_Hand):
  """Drafted tokens hide under the weight reads: the step costs the same."""
  name = 'free'

  def mixed_seconds(self, rows_w, kv_w, chunk_w, past_w):
    return 1.0


class Mild(_Hand):
  """Every drafted token in the group adds 10% to the step."""
  name = 'mild'

  def mixed_seconds(self, rows_w, kv_w, chunk_w, past_w):
    return 1.0 + 0.1 * float(np.sum(chunk_w))


class Slowest(_Hand):
  """A worker's step time grows with its query rows (live + drafted), the SPMD step waits for
  the slowest worker."""
  name = 'slowest'

  def mixed_seconds(self, rows_w, kv_w, chunk_w, past_w):
    return 0.1 * float(np.max(np.asarray(rows_w) + np.asarray(chunk_w)))


class SharedStep(_Hand):
  """A step whose time grows with the most drafted tokens any worker checks, by 30% a token."""
  name = 'shared'

  def mixed_seconds(self, rows_w, kv_w, chunk_w, past_w):
    return 1.0 + 0.3 * float(np.max(chunk_w))


def _stored(q):
  """Sequence q's prompt's earlier response: distinct tokens per sequence."""
  return np.arange(1000 * q, 1000 * q + 200, dtype=np.int32)


def _rollout(live_per_worker, slots=8, made=CTX, max_new=1000):
  """A State with live_per_worker[w] live rows on worker w (the lowest slots), every sequence of
  its own prompt, which wrote the same tokens in an earlier epoch (so each row drafts its next D
  tokens), and the rows' responses so far."""
  store = ResponseStore('tok')
  seqs, table, generated, responses = {}, [], {}, {}
  q = 0
  for n in live_per_worker:
    row = [-1] * slots
    for s in range(n):
      seqs[q] = Seq(q, f'p{q}', 0, PROMPT, None, max_new)
      row[s] = q
      generated[q] = made
      responses[q] = _stored(q)[:made]
      q += 1
    table.append(row)
  store.add_rollout(0, [(seqs[x].prompt_id, 0, _stored(x)) for x in seqs])
  W = len(live_per_worker)
  st = State(seqs=seqs, active=list(range(W)), slots_per_worker=slots, slots=table,
             generated=generated, queues={w: deque() for w in range(W)}, step=0)
  return st, store, responses


def _policy(store, cost, **kw):
  return DraftPolicy(Drafter(store), D, cost=cost, **kw)


def _lens(st, drafts):
  """Drafted tokens per active worker."""
  return [sum(len(drafts.get(q, ())) for q in st.slots[w] if q >= 0) for w in st.active]


def _sure(pol):
  """Every drafted token so far was kept: the estimate goes to (near) one."""
  for _ in range(100):
    pol.observe({0: (4, 3, 3)})


def _never(pol):
  for _ in range(100):
    pol.observe({0: (1, 3, 0)})


def test_nothing_drafted_where_checking_costs_more_than_it_saves():
  st, store, resp = _rollout([2, 2])
  pol = _policy(store, Doubling(), prior_acceptance=1.0)
  _sure(pol)
  assert pol.acceptance == 1.0
  # the drafts are there: without a cost model every row drafts its next D tokens
  whole = _policy(store, None).drafts(st, resp, 8)
  assert len(whole) == 4 and all(len(d) == D for d in whole.values())
  assert pol.drafts(st, resp, 8) == {}


def test_whole_drafts_where_checking_is_free():
  st, store, resp = _rollout([2, 2])  # 6 free slots per worker: room for 2 x D
  pol = _policy(store, Free())
  d = pol.drafts(st, resp, 8)
  assert sorted(d) == [0, 1, 2, 3]
  for q, x in d.items():
    np.testing.assert_array_equal(x, _stored(q)[CTX:CTX + D])
    assert x.dtype == np.int32


def test_low_acceptance_drafts_nothing_high_acceptance_drafts():
  st, store, resp = _rollout([1, 1])
  low = _policy(store, Mild())
  _never(low)
  assert low.acceptance < 0.05
  assert low.drafts(st, resp, 8) == {}
  high = _policy(store, Mild())
  _sure(high)
  assert high.acceptance > 0.95
  d = high.drafts(st, resp, 8)
  assert sorted(d) == [0, 1]
  for q, x in d.items():  # cut, never changed: a prefix of what the prompt wrote next
    assert len(x) >= 1
    np.testing.assert_array_equal(x, _stored(q)[CTX:CTX + len(x)])


def test_free_slots_bound_a_workers_drafted_tokens():
  # worker 0: 6 live rows, 2 free slots; worker 1: 1 live row, 7 free slots
  st, store, resp = _rollout([6, 1])
  pol = _policy(store, Free())
  d = pol.drafts(st, resp, 8)
  assert _lens(st, d) == [2, D]
  for q, x in d.items():
    np.testing.assert_array_equal(x, _stored(q)[CTX:CTX + len(x)])
  # level by level in slot order: the two lowest slots take one token each
  assert {q: len(x) for q, x in d.items() if q < 6} == {0: 1, 1: 1}
  # a full worker drafts nothing
  st, store, resp = _rollout([8, 1])
  assert _lens(st, _policy(store, Free()).drafts(st, resp, 8)) == [0, D]


def test_without_cost_the_drafts_are_the_drafters():
  # free slots do not cut them (the executor verifies what its slots allow)
  st, store, resp = _rollout([6, 1, 3])
  pol: DraftingPolicy = _policy(store, None)  # the controller's protocol (pyright checks)
  d = pol.drafts(st, resp, 8)
  rows = [DraftRow(q, st.seqs[q].prompt_id, resp[q], ()) for q in sorted(resp)]
  ref = Drafter(store).draft_rows(rows, D)
  assert sorted(d) == sorted(resp)
  for r, x in zip(rows, ref, strict=True):
    np.testing.assert_array_equal(d[r.seq], x)
  assert _lens(st, d) == [6 * D, D, 3 * D]


def test_drafting_hides_under_the_slowest_worker():
  # worker 0 (6 rows) gates the step; worker 1's drafted tokens are free up to 6 query rows
  st, store, resp = _rollout([6, 1])
  pol = _policy(store, Slowest(), prior_acceptance=1.0)
  assert _lens(st, pol.drafts(st, resp, 8)) == [0, D]


def test_alike_workers_draft_together_or_not_at_all():
  # one worker's drafted token alone stretches the shared step by 30% for one more token of
  # eight; all eight workers' together pay
  st, store, resp = _rollout([1] * 8)
  pol = _policy(store, SharedStep(), prior_acceptance=1.0)
  assert _lens(st, pol.drafts(st, resp, 8)) == [D] * 8


def test_a_row_drafts_no_further_than_its_limit():
  # a row that may make 2 more tokens: its own next one and one drafted
  st, store, resp = _rollout([1], made=CTX, max_new=CTX + 2)
  assert _lens(st, _policy(store, Free()).drafts(st, resp, 8)) == [1]


def test_siblings_draft_from_each_other():
  # two samples of one prompt, nothing stored: the one behind drafts what the other wrote
  ahead = np.arange(500, 560, dtype=np.int32)
  seqs = {0: Seq(0, 'p', 0, PROMPT, None, 1000), 1: Seq(1, 'p', 1, PROMPT, None, 1000)}
  st = State(seqs=seqs, active=[0], slots_per_worker=5, slots=[[0, 1, -1, -1, -1]],
             generated={0: 40, 1: 10}, queues={0: deque()}, step=0)
  pol = DraftPolicy(Drafter(ResponseStore('tok')), D, cost=Free())
  d = pol.drafts(st, {0: ahead[:40], 1: ahead[:10]}, 8)
  assert list(d) == [1]
  np.testing.assert_array_equal(d[1], ahead[10:10 + D])


def test_observe_counts_and_the_estimate():
  pol = DraftPolicy(Drafter(), D, prior_acceptance=0.5, prior_weight=8.0)
  assert pol.acceptance == 0.5
  pol.observe({0: (4, 3, 3), 1: (2, 3, 1), 2: (1, 0, 0)})
  assert (pol.verified, pol.kept, pol.rejected) == (6, 4, 1)
  assert (pol.drafted, pol.accepted) == (6, 4)
  # 4 kept and 1 mismatch: the two tokens verified after seq 1's mismatch are no trials
  assert pol.acceptance == pytest.approx((4 + 4) / (8 + 5))
  pol.start_rollout()
  assert (pol.drafted, pol.accepted, pol.kept) == (0, 0, 4)
  with pytest.raises(ValueError, match='seq 3'):
    pol.observe({3: (1, 1, 2)})


@pytest.mark.parametrize('kw, name', [
    ({'draft_tokens': 0}, 'draft_tokens'),
    ({'draft_tokens': 2.5}, 'draft_tokens'),
    ({'draft_tokens': True}, 'draft_tokens'),
    ({'prior_acceptance': -0.1}, 'prior_acceptance'),
    ({'prior_acceptance': 1.5}, 'prior_acceptance'),
    ({'prior_acceptance': float('nan')}, 'prior_acceptance'),
    ({'prior_acceptance': 'high'}, 'prior_acceptance'),
    ({'prior_weight': 0.0}, 'prior_weight'),
    ({'prior_weight': -1.0}, 'prior_weight'),
    ({'prior_weight': float('inf')}, 'prior_weight'),
])
def test_bad_arguments_are_named(kw, name):
  args = {'draft_tokens': D, **kw}
  with pytest.raises(ValueError, match=name):
    DraftPolicy(Drafter(), args.pop('draft_tokens'), **args)


def test_wrong_objects_are_named():
  with pytest.raises(TypeError, match='drafter'):
    DraftPolicy(object(), D)  # type: ignore[arg-type]
  with pytest.raises(TypeError, match='cost'):
    DraftPolicy(Drafter(), D, cost=object())  # type: ignore[arg-type]


def test_imports_no_jax():
  code = ('import sys\nimport flexfloor_jax.policy.speculation\n'
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
  r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == '[]'


def test_drafts_not_sent_still_teach_the_estimate():
  """A policy that has seen only mismatches sends nothing under a mild cost; the rows then make
  exactly what the unsent drafts said, dispatch after dispatch: those count as kept, the
  estimate climbs back and drafts go out again. Rows that make other tokens teach mismatches."""
  st, store, _ = _rollout([1, 1])
  pol = _policy(store, Mild())
  _never(pol)
  low = pol.acceptance
  sent_at = None
  for made in range(CTX, CTX + 60, D):  # each dispatch the rows make D tokens, as stored
    for q in (0, 1):
      st.generated[q] = made
    if pol.drafts(st, {q: _stored(q)[:made] for q in (0, 1)}, 8):
      sent_at = made
      break
  assert pol.acceptance > low and sent_at is not None
  # the same, but the rows make other tokens than the drafts: the estimate only falls
  st, store, _ = _rollout([1, 1])
  pol = _policy(store, Mild())
  _never(pol)
  before = pol.acceptance
  for made in range(CTX, CTX + 30, D):
    for q in (0, 1):
      st.generated[q] = made
    resp = {q: np.concatenate([_stored(q)[:CTX], -1 - np.arange(made - CTX, dtype=np.int32)])
            for q in (0, 1)}
    assert pol.drafts(st, resp, 8) == {}
  assert pol.acceptance < before
