"""Numpy step simulator: an Executor that knows every sequence's length (EOS not modelled).

Driven by the same controller as the engine, so with the same lengths it runs the same steps. A
dispatch is advanced in one jump to the first step where a stop condition fires (no per-step Python
loop unless a cost model needs per-step live counts), which keeps whole-rollout simulation in the
sub-millisecond range and lets the scheduler evaluate candidate placements by simulating them.

Paged KV (`simulate(..., kv=PagePool)`): the B slots are the pool's max_seqs sequence rows and the
controller admits, grows and preempts by pages; the executor only forgets a preempted sequence's
row and resumes it at its next prefill.

Chunked prefill (`simulate(..., prefill_chunk=C)`): the executor side of the controller's
contract. Admitted sequences wait in per-worker pending lists (their slots reserved, not live);
a dispatch works out from C at which step each one's input turns in, jumps to the first step at
which a stop rule fires, as for live rows, and prices the mixed steps with the cost model's
mixed_seconds (costs.mixed_dispatch_seconds).

Speculative decoding (`SimExecutor(..., responses=R, draft_tokens=D)`, `simulate(...,
drafting=P)`): the executor side of the controller's drafting contract. Drafting keeps the
tokens plain decoding makes, so a sequence's true continuation (its response in R, whose length
is the sequence's length and plays the part of its limit or EOS) decides exactly which drafted
tokens are kept: given the same drafts the simulator runs the engine's drafting dispatches step
for step. A dispatch with drafts runs a per-step loop (the contract's rule, row by row); one
without drafts takes the jump above. A step with drafted rows is priced with the cost model's
mixed_seconds, its verification rows as input tokens beside the live rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import numpy as np

from flexfloor_jax.policy import costs
from flexfloor_jax.policy.controller import (
  Finish,
  RolloutRecord,
  Seq,
  dispatch_stops,
  finish_reason,
  run,
)


class SimError(RuntimeError):
  pass


class SimExecutor:
  """Executor over N workers x B slots.

  lengths: seq id -> response length (default: each seq's target_len); clipped to max_new_tokens.
  step_cost(kind, num_active, live_slots) -> seconds per step, for simulated wall time (`clock`).
  cost: a policy.costs.StepCost instead (rows and cached tokens per worker, prefill tokens; a
  decode dispatch summed in closed form by costs.dispatch_seconds).
  migrate_cost(kv_bytes) -> seconds, shrink_cost(expert_moves) -> seconds (optional).
  expert_placement: an expert_placement.ExpertPlacement to report expert moves on shrink.
  prefill_chunk: input tokens a decode step takes per worker (chunked prefill: sequences come in
  by `admit`); 0 = one-shot prefill steps. With `step_cost` a mixed step is priced as a decode
  step of its live rows (that model knows no input tokens).
  responses: seq id -> its full response tokens (their count is then its length; `lengths`, if
  given too, must agree); draft_tokens: D > 0 makes this a DraftingExecutor (the controller's
  speculative decoding contract), which needs `responses`. Not with chunked prefill.
  """

  def __init__(self, seqs: list[Seq], num_workers: int, slots_per_worker: int,
               lengths: Mapping[int, int] | None = None, *,
               step_cost: Callable[[str, int, int], float] | None = None,
               kv_bytes_per_token: int = 1, migrate_cost: Callable[[int], float] | None = None,
               expert_placement=None, expert_bytes: int = 0,
               shrink_cost: Callable[[int], float] | None = None, cost=None,
               prefill_chunk: int = 0,
               responses: Mapping[int, Sequence[int] | np.ndarray] | None = None,
               draft_tokens: int = 0):
    self.seqs = {s.seq_id: s for s in seqs}
    self.slots_per_worker = B = int(slots_per_worker)
    self.num_workers = N = int(num_workers)
    self.resp: dict[int, np.ndarray] | None = None
    if responses is not None:
      self.resp = {}
      for q in self.seqs:
        if q not in responses:
          raise SimError(f'no response for seq {q}')
        r = np.asarray(responses[q], np.int32).reshape(-1)
        if not len(r):
          raise SimError(f'seq {q} has an empty response')
        if lengths is not None and int(lengths[q]) != len(r):
          raise SimError(f'seq {q}: length {lengths[q]}, but its response has {len(r)} tokens')
        self.resp[q] = r
    self.length = {}
    for q, s in self.seqs.items():
      L = (s.target_len if lengths is None else lengths[q]) if self.resp is None \
          else len(self.resp[q])
      if L is None:
        raise SimError(f'seq {q} has no target_len and no length was given')
      self.length[q] = int(min(max(int(L), 1), s.max_new_tokens))
    # per worker, per slot: seq id (-1 free), tokens still to generate, tokens generated.
    # Plain lists: with N x B ~ 32 slots, numpy's per-call overhead would dominate.
    self.slot_seq = [[-1] * B for _ in range(N)]
    self.remaining = [[0] * B for _ in range(N)]
    self.generated = [[0] * B for _ in range(N)]
    self._active = list(range(N))
    self.step_cost, self.migrate_cost, self.shrink_cost = step_cost, migrate_cost, shrink_cost
    self.time_model = cost
    self.kv_bytes_per_token = kv_bytes_per_token
    self.placement, self.expert_bytes = expert_placement, expert_bytes
    self.t = 0.0
    self.steps = 0
    self.resume = {}  # preempted seq id -> tokens generated before (paged KV)
    if prefill_chunk < 0:
      raise SimError(f'prefill_chunk must be >= 0, got {prefill_chunk}')
    self.prefill_chunk = int(prefill_chunk)
    # chunked prefill: per worker its pending list in order, [seq id, slot, input tokens left,
    # input tokens run, tokens it had kept]; those slots are reserved in `pending_slot`
    self.pend: list[list[list[int]]] = [[] for _ in range(N)]
    self.pending_slot: set[tuple[int, int]] = set()
    if isinstance(draft_tokens, bool) or int(draft_tokens) != draft_tokens or draft_tokens < 0:
      raise SimError(f'draft_tokens must be an integer >= 0, got {draft_tokens!r}')
    self.draft_tokens = int(draft_tokens)
    if self.draft_tokens and self.resp is None:
      raise SimError('drafting (draft_tokens > 0) needs the responses')
    if self.draft_tokens and self.prefill_chunk:
      raise SimError('speculative decoding and chunked prefill do not run together')
    # drafting: every seq live at the last decode's start -> (tokens made, drafted rows
    # verified, drafted tokens kept)
    self.dispatch_report: dict[int, tuple[int, int, int]] = {}

  def clock(self) -> float:
    return self.t

  def active_workers(self) -> list[int]:
    return list(self._active)

  def _reason(self, q: int) -> str:
    """A response shorter than its cap and not at its target ended on EOS (not modelled)."""
    s = self.seqs[q]
    target = s.target_len is not None and self.length[q] == min(s.target_len, s.max_new_tokens)
    return finish_reason(self.length[q], s.max_new_tokens, target=target, eos=not target)

  def _live_slots(self) -> int:
    return sum(q >= 0 for w in self._active for q in self.slot_seq[w])

  def prefill(self, assign):
    if self.prefill_chunk:
      raise SimError('chunked prefill: sequences come in by admit, not prefill')
    ws = [w for w, _, _ in assign]
    if len(set(ws)) != len(ws) or not set(ws) <= set(self._active):
      raise SimError(f'prefill needs at most one seq per active worker: {assign}')
    out = []
    prompt_w = dict.fromkeys(self._active, 0.0)
    for w, s, q in assign:
      if self.slot_seq[w][s] >= 0:
        raise SimError(f'prefill into busy slot {(w, s)}')
      g = self.resume.pop(q, 0)  # a preempted seq recomputes its g tokens and makes one more
      prompt_w[w] = float(self.seqs[q].prompt_len + g)
      self.slot_seq[w][s] = q
      self.generated[w][s] = g + 1
      self.remaining[w][s] = self.length[q] - g - 1
      if self.remaining[w][s] == 0:
        out.append(Finish(q, w, s, g + 1, self._reason(q)))
        self.slot_seq[w][s] = -1
    self.steps += 1
    if self.time_model is not None:
      self.t += float(self.time_model.prefill_seconds(np.array(list(prompt_w.values()))))
    elif self.step_cost is not None:
      self.t += float(self.step_cost('prefill', len(self._active), self._live_slots() + len(out)))
    return out

  def admit(self, assign):
    """Chunked prefill: (worker, slot, seq id), any number per worker; no step runs."""
    if not self.prefill_chunk:
      raise SimError('admit needs prefill_chunk > 0')
    for w, s, q in assign:
      if w not in self._active or self.slot_seq[w][s] >= 0 or (w, s) in self.pending_slot:
        raise SimError(f'admission of seq {q} into busy or inactive slot {(w, s)}')
      g = self.resume.pop(q, 0)  # a preempted seq recomputes its g tokens
      self.pend[w].append([q, s, self.seqs[q].prompt_len + g, 0, g])
      self.pending_slot.add((w, s))

  def pending_lists(self) -> list[list[tuple[int, int, int]]]:
    """Per active worker its pending list as costs.mixed_dispatch_seconds takes it: (input
    tokens left, input tokens run, tokens it makes after its first)."""
    return [[(left, ran, self.length[q] - g - 1) for q, _, left, ran, g in self.pend[w]]
            for w in self._active]

  def _turns(self, w: int) -> list[int]:
    """Step of the coming dispatch in which each of w's pending seqs' input turns in."""
    out, end, C = [], 0, self.prefill_chunk
    for ent in self.pend[w]:
      end += ent[2]
      out.append(-(-end // C) - 1)
    return out

  def responses(self, seq_ids) -> dict[int, np.ndarray]:
    """Drafting: the response tokens each of these sequences has made so far (int32)."""
    if self.resp is None:
      raise SimError('responses needs the executor built with responses')
    made = dict(self.resume)
    for w in range(self.num_workers):
      for q, g in zip(self.slot_seq[w], self.generated[w], strict=True):
        if q >= 0:
          made[q] = g
    return {int(q): self.resp[q][:made.get(q, 0)] for q in seq_ids}

  def decode(self, max_steps, stop_on_refill, stop_on_idle, drafts=None):
    if drafts:
      return self._decode_drafted(max_steps, stop_on_refill, stop_on_idle, drafts)
    if self.prefill_chunk:
      return self._decode_chunked(max_steps, stop_on_refill, stop_on_idle)
    k = int(max_steps)
    any_live = False
    for i, w in enumerate(self._active):
      rem = [r for q, r in zip(self.slot_seq[w], self.remaining[w], strict=True) if q >= 0]
      if not rem:
        continue
      any_live = True
      if stop_on_refill[i]:
        k = min(k, min(rem))  # a slot of w frees after min(rem) steps
      if stop_on_idle[i]:
        k = min(k, max(rem))  # w goes idle after max(rem) steps
    if not any_live:
      return 0, []
    k = min(k, max(r for w in self._active
                   for q, r in zip(self.slot_seq[w], self.remaining[w], strict=True) if q >= 0))
    if self.time_model is not None:
      rem, ctx = self._live_arrays()
      self.t += costs.dispatch_seconds(self.time_model.worker_step_seconds, rem, ctx, k)
    elif self.step_cost is not None:
      rems = [r for w in self._active
              for q, r in zip(self.slot_seq[w], self.remaining[w], strict=True) if q >= 0]
      for j in range(k):
        self.t += float(self.step_cost('decode', len(self._active), sum(r > j for r in rems)))
    self.steps += k
    if self.draft_tokens:  # no drafts: each live row makes a token a step until it finishes
      self.dispatch_report = {q: (min(r, k), 0, 0) for w in self._active
                              for q, r in zip(self.slot_seq[w], self.remaining[w], strict=True)
                              if q >= 0}
    out: list[Finish] = []
    for w in self._active:
      self._advance_rows(w, k, out)
    return k, out

  def _decode_drafted(self, max_steps, stop_on_refill, stop_on_idle, drafts):
    """decode() with drafts, step by step (the controller's contract): per active worker its
    free slots at the step's start go to its live rows with a live draft in slot order, each
    verifying v = min(draft tokens it has not made, tokens it may still make - 1, free slots
    left) drafted tokens; it makes its own token and the leading drafted ones its response
    confirms (x_{j-1} == d_j), and its draft dies at the first token it makes that differs
    from the draft. Stops as the one-shot jump does (`dispatch_stops` after every step)."""
    if self.prefill_chunk:
      raise SimError('speculative decoding and chunked prefill do not run together')
    if self.resp is None:
      raise SimError('drafts need the executor built with responses')
    B, act = self.slots_per_worker, list(self._active)
    report = {q: [0, 0, 0] for w in act for q in self.slot_seq[w] if q >= 0}
    draft: dict[int, np.ndarray] = {}
    for q, d in drafts.items():
      d = np.asarray(d, np.int32).reshape(-1)
      if q not in report:
        raise SimError(f'a draft for seq {q}, which is not live')
      if len(d) > self.draft_tokens:
        raise SimError(f'a draft of {len(d)} tokens for seq {q}; draft_tokens is '
                       f'{self.draft_tokens}')
      if len(d):
        draft[q] = d
    self.dispatch_report = {}
    if not report:
      return 0, []
    alive = set(draft)
    out: list[Finish] = []
    priced: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    n, k = len(act), 0
    while k < max_steps:
      rows, kv, drafted, past = (np.zeros(n) for _ in range(4))
      finished = []
      for i, w in enumerate(act):
        row, rem, gen = self.slot_seq[w], self.remaining[w], self.generated[w]
        free = B - sum(q >= 0 for q in row)  # slots not live at the step's start
        for s, q in enumerate(row):
          if q < 0:
            continue
          g, r, rep = gen[s], rem[s], report[q]
          ctx = self.seqs[q].prompt_len + g
          rows[i] += 1
          kv[i] += ctx
          v = a = 0
          if q in alive:
            d, m, true = draft[q], rep[0], self.resp[q]
            # the rows it asks for are bounded by its limit (what the engine knows), not by its
            # length: a response that ends at EOS verifies rows past its end, which it never uses
            sq = self.seqs[q]
            room = min(sq.target_len or sq.max_new_tokens, sq.max_new_tokens) - g - 1
            v = max(0, min(len(d) - m, room, free))
            free -= v
            while a < min(v, r) and true[g + a] == d[m + a]:
              a += 1
            c = min(1 + a, len(d) - m)  # the tokens it makes that the draft has a token for
            if c <= 0 or not np.array_equal(true[g:g + c], d[m:m + c]):
              alive.discard(q)  # wrong, or spent
          made = min(1 + a, r)
          a = made - 1  # the drafted tokens it keeps: none past its last token
          if v:  # its v drafted tokens extend a prefix of ctx tokens, as a chunk of input does
            drafted[i] += v
            past[i] += ctx
          rep[0] += made
          rep[1] += v
          rep[2] += a
          gen[s] += made
          rem[s] -= made
          if rem[s] <= 0:
            out.append(Finish(q, w, s, gen[s], self._reason(q), k))
            row[s], rem[s] = -1, 0
            finished.append(w)
      priced.append((rows, kv, drafted, past))
      k += 1
      live = {w for w in act if any(q >= 0 for q in self.slot_seq[w])}
      if dispatch_stops(finished, live, act, stop_on_refill, stop_on_idle):
        break
    self.steps += k
    self.dispatch_report = {q: (v[0], v[1], v[2]) for q, v in report.items()}
    self._price_drafted(priced)
    return k, out

  def _price_drafted(self, steps) -> None:
    """Seconds of a drafted dispatch's steps, each (rows_w, kv_w, drafted_w, past_w) per active
    worker: its live rows and their cached tokens, its verification rows and the context they
    extend (each row's cached tokens plus the drafted tokens before it, summed). A step with
    verification rows is the cost model's mixed step, its drafted rows the input tokens; one
    without is the decode step; `step_cost` prices every step as a decode step of its rows."""
    for rows, kv, drafted, past in steps:
      if self.time_model is not None:
        self.t += float(self.time_model.mixed_seconds(rows, kv, drafted, past) if drafted.any()
                        else self.time_model.worker_step_seconds(rows, kv))
      elif self.step_cost is not None:
        self.t += float(self.step_cost('decode', len(self._active), int(rows.sum())))

  def _decode_chunked(self, max_steps, stop_on_refill, stop_on_idle):
    """decode() under chunked prefill: every row finishes at a known step (a pending one: its
    input's turn-in step + its tokens after the first), and the stop rules count pending
    rows as live (the controller's contract)."""
    k = int(max_steps)
    turns = {w: self._turns(w) for w in self._active}
    fin_w = {}  # worker -> the step in which each of its rows (live or pending) finishes
    for w in self._active:
      f = [r - 1 for q, r in zip(self.slot_seq[w], self.remaining[w], strict=True) if q >= 0]
      f += [j + self.length[e[0]] - e[4] - 1 for e, j in zip(self.pend[w], turns[w],
                                                               strict=True)]
      fin_w[w] = f
    if not any(fin_w.values()):
      return 0, []
    for i, w in enumerate(self._active):
      if not fin_w[w]:
        continue
      if stop_on_refill[i]:
        k = min(k, min(fin_w[w]) + 1)  # a slot of w frees in this step
      if stop_on_idle[i]:
        k = min(k, max(fin_w[w]) + 1)  # w holds nothing after this step
    k = min(k, max(max(f) for f in fin_w.values() if f) + 1)
    if self.time_model is not None:
      rem, ctx = self._live_arrays()
      if any(self.pend[w] for w in self._active):
        self.t += costs.mixed_dispatch_seconds(self.time_model.mixed_seconds, rem, ctx, k,
                                               self.prefill_chunk, self.pending_lists())
      else:
        self.t += costs.dispatch_seconds(self.time_model.worker_step_seconds, rem, ctx, k)
    elif self.step_cost is not None:
      for j in range(k):
        rows = sum(f >= j for w in self._active for f in fin_w[w][:self.num_live(w)])
        rows += sum(t < j <= f for w in self._active
                    for t, f in zip(turns[w], fin_w[w][self.num_live(w):], strict=True))
        self.t += float(self.step_cost('decode', len(self._active), rows))
    self.steps += k
    out: list[Finish] = []
    for w in self._active:
      self._advance_rows(w, k, out)
      row, rem, gen = self.slot_seq[w], self.remaining[w], self.generated[w]
      budget, keep = k * self.prefill_chunk, []
      for ent, j in zip(self.pend[w], turns[w], strict=True):
        q, s, left, _, g = ent
        take = min(left, budget)
        budget -= take
        if j >= k:  # its input not all in yet
          ent[2] -= take
          ent[3] += take
          keep.append(ent)
          continue
        self.pending_slot.discard((w, s))
        made = k - j  # its first token in step j, then one a step
        if g + made >= self.length[q]:
          out.append(Finish(q, w, s, self.length[q], self._reason(q)))
        else:
          row[s], gen[s], rem[s] = q, g + made, self.length[q] - g - made
      self.pend[w] = keep
    return k, out

  def _live_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """[active workers, slots]: the tokens each live row still makes and the tokens it has
    cached (0 for a free or pending slot), as costs.dispatch_seconds takes them."""
    rem = np.array([[r if q >= 0 else 0 for q, r in zip(self.slot_seq[w], self.remaining[w],
                                                        strict=True)] for w in self._active])
    ctx = np.array([[self.seqs[q].prompt_len + g if q >= 0 else 0
                     for q, g in zip(self.slot_seq[w], self.generated[w], strict=True)]
                    for w in self._active], float)
    return rem, ctx

  def _advance_rows(self, w: int, k: int, out: list[Finish]):
    """Worker w's live rows after k decode steps: a row with at most k tokens left finishes
    (into `out`) and frees its slot, the others make k tokens."""
    row, rem, gen = self.slot_seq[w], self.remaining[w], self.generated[w]
    for s, q in enumerate(row):
      if q < 0:
        continue
      if rem[s] <= k:
        out.append(Finish(q, w, s, gen[s] + rem[s], self._reason(q),
                          rem[s] - 1 if self.draft_tokens else -1))
        row[s], rem[s] = -1, 0
      else:
        rem[s] -= k
        gen[s] += k

  def num_live(self, w: int) -> int:
    return sum(q >= 0 for q in self.slot_seq[w])

  def preempt(self, slots):
    """Paged KV, and chunked prefill's pending migrations: the sequences of these live or
    pending (worker, slot)s leave; their next prefill (admission) resumes them."""
    for w, s in slots:
      if (w, s) in self.pending_slot:  # its partial input goes; it keeps what it had kept
        ent = next(e for e in self.pend[w] if e[1] == s)
        self.pend[w].remove(ent)
        self.pending_slot.discard((w, s))
        self.resume[ent[0]] = ent[4]
        continue
      q = self.slot_seq[w][s]
      if q < 0:
        raise SimError(f'preempt of free slot {(w, s)}')
      self.resume[q] = self.generated[w][s]
      self.slot_seq[w][s], self.remaining[w][s], self.generated[w][s] = -1, 0, 0

  def migrate(self, moves):
    total = 0
    for sw, ss, dw, ds in moves:
      q = self.slot_seq[sw][ss]
      if (q < 0 or self.slot_seq[dw][ds] >= 0 or dw not in self._active
          or (dw, ds) in self.pending_slot):
        raise SimError(f'bad migration {(sw, ss, dw, ds)}')
      total += (self.seqs[q].prompt_len + self.generated[sw][ss]) * self.kv_bytes_per_token
      for a in (self.slot_seq, self.remaining, self.generated):
        a[dw][ds] = a[sw][ss]
      self.slot_seq[sw][ss] = -1
    if self.migrate_cost is not None:
      self.t += float(self.migrate_cost(total))
    return int(total)

  def shrink(self, new_active):
    gone = [w for w in self._active if w not in set(new_active)]
    if not set(new_active) <= set(self._active) or not new_active:
      raise SimError(f'shrink to {new_active} from {self._active}')
    if any(q >= 0 for w in gone for q in self.slot_seq[w]) or any(self.pend[w] for w in gone):
      raise SimError(f'shrink releases live slots on {gone}')
    stats: dict[str, Any] = dict(released=gone, expert_moves=0, expert_bytes_moved=0,
                                 seconds=0.0)
    if self.placement is not None:
      new = self.placement.after_release(gone, list(new_active))
      n = len(new.moves_since(self.placement))
      self.placement = new
      stats.update(expert_moves=n, expert_bytes_moved=n * self.expert_bytes)
    if self.shrink_cost is not None:
      stats['seconds'] = float(self.shrink_cost(stats['expert_moves']))
      self.t += stats['seconds']
    self._active = [w for w in self._active if w in set(new_active)]
    return stats


@overload
def simulate(seqs: list[Seq], lengths: Mapping[int, int] | None, queues: dict[int, list[int]],
             policy, num_workers: int, slots_per_worker: int, steps_per_dispatch: int = 8,
             return_record: Literal[False] = False, kv=None, prefill_chunk: int = 0,
             drafting=None, **executor_kw) -> dict: ...


@overload
def simulate(seqs: list[Seq], lengths: Mapping[int, int] | None, queues: dict[int, list[int]],
             policy, num_workers: int, slots_per_worker: int, steps_per_dispatch: int = 8, *,
             return_record: Literal[True], kv=None, prefill_chunk: int = 0,
             drafting=None, **executor_kw) -> tuple[dict, RolloutRecord]: ...


def simulate(seqs: list[Seq], lengths: Mapping[int, int] | None, queues: dict[int, list[int]],
             policy, num_workers: int, slots_per_worker: int, steps_per_dispatch: int = 8,
             return_record: bool = False, kv=None, prefill_chunk: int = 0,
             drafting=None, **executor_kw) -> dict | tuple[dict, RolloutRecord]:
  """One simulated rollout -> accounting metrics (and the RolloutRecord if asked).
  kv: a policy.pages.PagePool (paged KV; slots_per_worker must be its max_seqs); its stats
  (preemptions, peak pages, ...) join the metrics under 'kv'. prefill_chunk: chunked prefill's
  input tokens per step per worker (0 = one-shot prefill steps). drafting: a controller
  DraftingPolicy (speculative decoding; pass `responses` among the executor's keywords;
  draft_tokens defaults to the policy's)."""
  if kv is not None and kv.max_seqs != slots_per_worker:
    raise SimError(f'paged KV: slots_per_worker {slots_per_worker} != max_seqs {kv.max_seqs}')
  if drafting is not None:
    executor_kw.setdefault('draft_tokens', int(drafting.draft_tokens))
  ex = SimExecutor(seqs, num_workers, slots_per_worker, lengths, prefill_chunk=prefill_chunk,
                   **executor_kw)
  timed = executor_kw.get('step_cost') or executor_kw.get('cost')
  clock = ex.clock if timed else _step_clock(ex)
  rec = run(seqs, queues, ex, policy, steps_per_dispatch=steps_per_dispatch, clock=clock, kv=kv,
            prefill_chunk=prefill_chunk, drafting=drafting)
  m = rec.metrics()
  if kv is not None:
    m['kv'] = kv.stats()
  return (m, rec) if return_record else m


def _step_clock(ex: SimExecutor):
  """Without a cost model one step = one second, so seconds-based metrics mirror steps."""
  return lambda: float(ex.steps)


