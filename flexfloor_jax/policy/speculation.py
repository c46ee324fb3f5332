"""Speculative decoding: which drafted tokens a dispatch verifies, decided in seconds.

A Drafter (policy.drafts) guesses each live row's next tokens from what its prompt wrote in
earlier epochs and what its sibling samples are writing now. Checking a guess is not free: a
drafted token the step verifies is one more query row in the step (the executor puts it in one of
its worker's free slots, policy.controller's "Speculative decoding"). DraftPolicy decides, once
per dispatch, how many of each row's drafted tokens to hand over, so that the step makes the
most tokens per second:

  - In the tail of a rollout a decode step is bound by reading weights: a worker holds a few live
    rows, and the weights it reads cost the same for one query row or ten. Checking several
    drafted tokens then costs little, and every kept one is a step a long sequence no longer
    waits for.
  - In an MoE every token is routed to top_k of E experts, and a step reads only the experts some
    token was routed to: more checked tokens touch more experts, so drafting does add weight
    reads until every expert is hit. The roofline (sim.costs.RooflineCost.mixed_seconds) prices
    this: an expert is read with probability 1 - (1 - top_k / E)^T over the T tokens of the
    whole group in the step, drafted ones included; the dense FLOPs, the routed FLOPs and the
    all_to_all bytes grow with the tokens as well.
  - Where a step is compute-bound, or the drafts are seldom right, a drafted token costs more
    step time than the tokens it is expected to save: nothing is drafted.

The decision. A drafted token is kept only if every drafted token before it was (the row keeps
the leading drafted tokens that equal what plain decoding samples), so at a per-token acceptance
a the j-th drafted token of a row is kept with probability a^j and a draft cut to k tokens keeps
a + a^2 + ... + a^k of them on average. `a` is learnt from what the executor reports
(`observe`), and from what the rows made after a draft the policy did not send (every drafted
row is a trial, sent or not, so that a low estimate does not stop drafting, and with it the
observations, for good): a = (prior_weight * prior_acceptance + kept) / (prior_weight + kept +
rejected),
where `rejected` counts the drafts that met a mismatch. The drafted tokens verified after a
mismatch are not counted as trials: they were lost with the first wrong one whatever they were
(with raw verified tokens as the denominator `a` would come out low, the more so the longer the
drafts). A draft cut short by its row finishing (EOS) counts as a rejection too: a slight
underestimate.

Each worker w of the active group holds rows_w live rows reading kv_w cached tokens (prompt +
tokens made, summed over its rows). Handing its rows c_w drafted tokens in all, from rows whose
sequences hold past_w tokens between them (each drafting row's prompt + tokens made, once), makes
the step cost.mixed_seconds(rows, kv, c, past) over the whole active vector: the SPMD step waits
for its slowest worker, so drafting on a worker that is not the slowest is free until it becomes
the slowest, and drafting pays on every worker at once or not at all where the workers are alike.
With a roofline `past_w` is read as each drafting sequence's prefix, and its attention is priced
as c_w x past_w (an upper bound where a worker drafts for several rows: the cost errs high).
The objective is the expected tokens of the step per second:

    (sum_w rows_w + sum of a^j over the drafted tokens handed out) / mixed_seconds(...)

Each worker hands out its drafted tokens in one fixed order, level by level: the first drafted
token of each drafting row (in slot order), then the second of each, ..., as far as its free slots
reach and no row beyond its remaining room (max_new_tokens - made - 1). The expected gain of the
order's tokens falls (a, ..., a, a^2, ...), so a worker's choice is how many of that order it
takes, n_w; a draft is cut, never reordered. The search over (n_w):
  1. jointly: every worker its first min(k, N_w) tokens, for k over 0..max N_w (all workers move
     together: where workers are alike only that pays);
  2. then per worker, the others fixed, its best n_w over 0..N_w, in active order, for at most
     REFINE_PASSES passes (a worker hidden under the slowest one drafts more, the slowest less).
A candidate replaces the one in hand only where it makes strictly more tokens per second (ties
keep fewer drafted tokens). Each scan looks at most SCAN_POINTS evenly spread values of its
range, so a call prices at most SCAN_POINTS * (1 + REFINE_PASSES * workers) steps, and few in
the tail, where the workers hold few rows; repeated vectors are priced once.

The drafted tokens of a row are all verified in the dispatch's first step (the workers' free
slots hold them: the order above stops at the free slots), so that step is what is priced; the
dispatch's other steps are plain decoding whatever is drafted. Without a cost model (`cost=None`)
every non-empty draft goes out whole, as the Drafter made it, and the executor verifies what its
free slots allow, over the dispatch's steps.

A measured step-cost table (policy.costs.MeasuredStepCost) has no mixed step: it prices drafted
tokens as free, the weight-bound tail, and drafting then fills the free slots whenever a > 0.

Host side: numpy only, never JAX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from flexfloor_jax.policy.drafts import Drafter, DraftRow

if TYPE_CHECKING:
  from flexfloor_jax.policy.controller import Seq, State
  from flexfloor_jax.policy.costs import StepCost

SCAN_POINTS = 17  # values of one scan's range priced, at most (evenly spread, both ends in)
REFINE_PASSES = 2  # per-worker passes after the joint scan
_BETTER = 1.0 + 1e-12  # a candidate must beat the one in hand by more than rounding


def _scan(n: int) -> list[int]:
  """The values 0..n a scan prices: all of them, or SCAN_POINTS evenly spread ones."""
  if n + 1 <= SCAN_POINTS:
    return list(range(n + 1))
  return sorted({int(round(float(x))) for x in np.linspace(0, n, SCAN_POINTS)})


class DraftPolicy:
  """What drafts in speculative decoding (policy.controller.DraftingPolicy; the module doc).

  drafter: the rollout step's Drafter (drafts from stored responses and siblings).
  draft_tokens: D, the most drafted tokens a row gets per dispatch (the executor's draft_tokens).
  cost: the step cost model the drafts are priced with (policy.costs.StepCost: its
    mixed_seconds); None drafts every non-empty draft whole.
  prior_acceptance, prior_weight: the per-token acceptance assumed before anything is observed,
    and how many observed trials it weighs as.

  Counters: `verified`, `kept`, `rejected` over the policy's life (what the acceptance is learnt
  from; `start_rollout` keeps them), `drafted` and `accepted` (drafted rows verified and drafted
  tokens kept, the timeline's names) since the last `start_rollout`, `evaluations` the steps the
  last `drafts` call priced."""

  def __init__(self, drafter: Drafter, draft_tokens: int, *, cost: StepCost | None = None,
               prior_acceptance: float = 0.5, prior_weight: float = 8.0):
    if not callable(getattr(drafter, 'draft_rows', None)):
      raise TypeError(f'drafter must be a Drafter (with draft_rows), got {type(drafter).__name__}')
    if (isinstance(draft_tokens, bool) or not isinstance(draft_tokens, (int, np.integer))
        or draft_tokens < 1):
      raise ValueError(f'draft_tokens must be an integer >= 1, got {draft_tokens!r}')
    if cost is not None and not callable(getattr(cost, 'mixed_seconds', None)):
      raise TypeError(f'cost must be a StepCost (with mixed_seconds) or None, got '
                      f'{type(cost).__name__}')
    self.drafter = drafter
    self.draft_tokens = int(draft_tokens)
    self.cost = cost
    self.prior_acceptance = _number('prior_acceptance', prior_acceptance, 0.0, 1.0)
    self.prior_weight = _number('prior_weight', prior_weight, 0.0, math.inf, open_low=True)
    self.verified = self.kept = self.rejected = 0
    self.drafted = self.accepted = 0
    self.evaluations = 0
    # the drafts the last call cut to nothing: seq id -> (draft, its response tokens then);
    # what the row made since tells how much of it would have been kept (_learn_unsent)
    self._unsent: dict[int, tuple[np.ndarray, int]] = {}
    self._seqs: Mapping[int, Seq] | None = None  # the rollout's seqs the families are of
    self._family: dict[str, tuple[int, ...]] = {}  # prompt id -> its seq ids, by sample
    self._siblings: dict[int, tuple[int, ...]] = {}

  # ---------------------------------------------------------------------------- learning

  @property
  def acceptance(self) -> float:
    """The per-token acceptance estimate: the chance a drafted token is kept given that every
    drafted token before it was (module doc)."""
    w = self.prior_weight
    return (w * self.prior_acceptance + self.kept) / (w + self.kept + self.rejected)

  def observe(self, report: Mapping[int, tuple[int, int, int]]) -> None:
    """A dispatch's report, seq id -> (tokens made, drafted rows verified, drafted tokens kept)
    (the executor's dispatch_report): a draft with fewer tokens kept than verified met a
    mismatch (one rejection); every kept token is one accepted trial."""
    for q, (_, rows, kept) in report.items():
      rows, kept = int(rows), int(kept)
      if not 0 <= kept <= rows:
        raise ValueError(f'report for seq {q}: {kept} drafted tokens kept of {rows} verified')
      self.verified += rows
      self.kept += kept
      self.rejected += kept < rows
      self.drafted += rows
      self.accepted += kept

  def start_rollout(self, drafter: Drafter | None = None) -> None:
    """A new rollout step: its Drafter (None keeps the one in hand), the run's counters
    (`drafted`, `accepted`) from zero. What the acceptance was learnt from is kept."""
    if drafter is not None:
      if not callable(getattr(drafter, 'draft_rows', None)):
        raise TypeError(f'drafter must be a Drafter (with draft_rows), got '
                        f'{type(drafter).__name__}')
      self.drafter = drafter
    self.drafted = self.accepted = 0
    self._unsent = {}
    self._seqs, self._family, self._siblings = None, {}, {}

  # ---------------------------------------------------------------------------- drafting

  def drafts(self, st: State, responses: dict[int, np.ndarray],
             max_steps: int) -> dict[int, np.ndarray]:
    """seq id -> its drafted tokens (int32, non-empty, at most draft_tokens), for the live seqs
    in `responses` (seq id -> its response tokens so far): the Drafter's drafts, each cut where
    it stops paying (module doc); all of them whole without a cost model. One draft_rows call."""
    del max_steps  # the drafts are verified in the dispatch's first step: that step is priced
    self.evaluations = 0
    self._learn_unsent(responses)
    if not responses:
      return {}
    if self._seqs is not st.seqs:
      self._families(st.seqs)
    rows = []
    for q in sorted(responses):
      rows.append(DraftRow(q, st.seqs[q].prompt_id, responses[q], self._siblings_of(q, st.seqs)))
    got = self.drafter.draft_rows(rows, self.draft_tokens)
    drafts = {r.seq: np.asarray(d, np.int32).reshape(-1)[:self.draft_tokens]
              for r, d in zip(rows, got, strict=True) if len(d)}
    if self.cost is None or not drafts:
      return drafts
    out = self._priced(st, drafts)
    self._unsent = {q: (d, len(responses[q])) for q, d in drafts.items() if q not in out}
    return out

  def _learn_unsent(self, responses: Mapping[int, np.ndarray]) -> None:
    """What the drafts the last call cut to nothing would have kept: the tokens each such row
    made since, against its draft, as `observe` counts a verified one (the leading equal tokens
    kept, a mismatch one rejection). Without it a low estimate would stop all drafting, and with
    it every observation, for good; the tokens made are plain decoding's either way. A row that
    has finished since is not seen (its last tokens are not in `responses`)."""
    for q, (d, g0) in self._unsent.items():
      r = responses.get(q)
      if r is None:
        continue
      made = np.asarray(r[g0:])
      n = min(len(d), len(made))
      if n == 0:
        continue
      same = d[:n] == made[:n]
      kept = n if bool(same.all()) else int(np.argmin(same))
      self.kept += kept
      self.rejected += kept < n
    self._unsent = {}

  def _families(self, seqs: Mapping[int, Seq]) -> None:
    """Each prompt's seq ids, by sample: once per rollout (its seqs dict)."""
    fam: dict[str, list[tuple[int, int]]] = {}
    for q, s in seqs.items():
      fam.setdefault(s.prompt_id, []).append((s.sample, q))
    self._family = {p: tuple(q for _, q in sorted(v)) for p, v in fam.items()}
    self._siblings = {}
    self._seqs = seqs

  def _siblings_of(self, q: int, seqs: Mapping[int, Seq]) -> tuple[int, ...]:
    sib = self._siblings.get(q)
    if sib is None:
      sib = self._siblings[q] = tuple(x for x in self._family[seqs[q].prompt_id] if x != q)
    return sib

  def _priced(self, st: State, drafts: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """The drafts cut to the tokens per worker that make the most tokens per second of the
    dispatch's first step (module doc's search)."""
    a = self.acceptance
    if a <= 0.0:
      return {}
    cost = self.cost
    assert cost is not None
    W = len(st.active)
    rows, kv = np.zeros(W), np.zeros(W)
    order: list[list[int]] = []  # per worker, the seq ids of its drafted tokens, in order
    gain: list[np.ndarray] = []  # per worker, expected tokens kept of its first n, n = 0..N_w
    past: list[np.ndarray] = []  # per worker, drafting sequences' cached tokens, n = 0..N_w
    for i, w in enumerate(st.active):
      want: list[tuple[int, int, int]] = []  # (seq, cached tokens, tokens it may take)
      for q in st.slots[w]:
        if q < 0:
          continue
        s, g = st.seqs[q], st.generated.get(q, 0)
        ctx = s.prompt_len + g
        rows[i] += 1
        kv[i] += ctx
        d = drafts.get(q)
        take = min(len(d), s.max_new_tokens - g - 1) if d is not None else 0
        if take > 0:
          want.append((q, ctx, take))
      free = st.num_free(w)
      toks = [(q, ctx, lev) for lev in range(1, self.draft_tokens + 1)
              for q, ctx, take in want if take >= lev][:free]
      order.append([q for q, _, _ in toks])
      gain.append(np.concatenate([[0.0], np.cumsum([a ** lev for _, _, lev in toks])]))
      past.append(np.concatenate([[0.0], np.cumsum([ctx if lev == 1 else 0.0
                                                    for _, ctx, lev in toks])]))
    N = [len(o) for o in order]
    if not any(N):
      return {}
    base = float(rows.sum())
    seen: dict[tuple[int, ...], float] = {}

    def rate(n: tuple[int, ...]) -> float:
      r = seen.get(n)
      if r is None:
        t = cost.mixed_seconds(rows, kv, np.asarray(n, float),
                               np.array([past[i][n[i]] for i in range(W)]))
        r = seen[n] = (base + sum(gain[i][n[i]] for i in range(W))) / float(t)
      return r

    # 1. all workers together
    best_n, best = (0,) * W, rate((0,) * W)
    for k in _scan(max(N))[1:]:
      n = tuple(min(k, m) for m in N)
      r = rate(n)
      if r > best * _BETTER:
        best_n, best = n, r
    # 2. one worker at a time, the others fixed
    for _ in range(REFINE_PASSES):
      changed = False
      for i in range(W):
        if not N[i]:
          continue
        for m in _scan(N[i]):
          n = best_n[:i] + (m,) + best_n[i + 1:]
          r = rate(n)
          if r > best * _BETTER:
            best_n, best, changed = n, r, True
      if not changed:
        break
    self.evaluations = len(seen)
    out = {}
    for i in range(W):
      counts: dict[int, int] = {}
      for q in order[i][:best_n[i]]:
        counts[q] = counts.get(q, 0) + 1
      out.update((q, drafts[q][:c]) for q, c in counts.items())
    return dict(sorted(out.items()))


def _number(name: str, x, lo: float, hi: float, *, open_low: bool = False) -> float:
  """x as a finite float in [lo, hi] ((lo, hi] with open_low); ValueError naming `name`."""
  bound = f'> {lo}' if hi == math.inf else f'in {"(" if open_low else "["}{lo}, {hi}]'
  try:
    v = float(x)
  except (TypeError, ValueError):
    raise ValueError(f'{name} must be a number {bound}, got {x!r}') from None
  low_ok = lo < v if open_low else lo <= v
  if isinstance(x, bool) or not math.isfinite(v) or not low_ok or not v <= hi:
    raise ValueError(f'{name} must be a finite number {bound}, got {x!r}')
  return v
