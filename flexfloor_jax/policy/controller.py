"""The rollout control loop. It decides what runs; an Executor (the JAX engine, or stepsim's numpy
SimExecutor) runs it. Both are driven by this same code, so the simulator's device_steps equal the
engine's exactly when lengths are fixed.

Loop, until every sequence has finished:
  (a) admission: while some active worker has a free slot and a non-empty queue, one prefill step in
      which each such worker moves its queue head into its lowest free slot;
  (c) release: the policy may migrate live sequences (and queued ones) and shrink the active set;
      if it changed anything, back to (a) (moved queues may now be admitted);
  (b) one decode dispatch of up to `steps_per_dispatch` steps that stops early when a worker with a
      queue frees a slot (so it refills: continuous batching) or when the policy asks.
(c) sits after admission so a sequence that finished at prefill can free its worker before the
next dispatch; it also runs once before the first step, for workers the placement gave nothing.
Right after (c) shrinks the active set, while sequences are live, the first step on the new mesh
is one decode step and the admissions the release made possible (queues moved off released
workers) follow it: a release then costs its survivors one decode step plus the shrink, not a
prefill on top (a prefill step costs more than a decode step), and those seqs start one step
later.

Paged KV (`kv`, a policy.pages.PagePool): a slot is then one of the worker's max_seqs sequence
rows, and memory decides as well: (a) admits a queue head only while the pool admits it, and
before (b) every live row grows to hold the dispatch's tokens; where a pool runs out its youngest
rows are preempted (the executor's `preempt`), go back to the front of their worker's queue and
are recomputed by a later prefill, which makes their next token (a resumed sequence keeps the
tokens it had). A migration whose destination lacks the pages becomes such a preemption, queued
on the destination. Without `kv` nothing of this runs.

The controller keeps its own slot table (it knows what it assigned; finishes free slots) and checks
every Finish against it, so an executor that misbehaves fails loudly instead of skewing metrics.

Chunked prefill (`run(..., prefill_chunk=C)`, C > 0; C = 0 is the one-shot prefill above,
unchanged). A one-shot prefill step stalls every live row for a step; here prompts ride inside
the decode steps, C input tokens per worker per step (vLLM's and SGLang's chunked prefill), and
no step ever runs input while a live row waits. The executor is a ChunkedExecutor (`admit` in
place of `prefill`) whose `prefill_chunk` attribute equals C (the controller refuses a
mismatch); the contract it implements:
  - Admission runs no step. Every active worker's free slots take its queue heads in queue
    order, lowest free slot first, as many as it has free slots (paged KV: while the pool
    admits each, its pages allocated for input + 1 tokens, as a one-shot admission does).
    `executor.admit(assign)` gets (worker, slot, seq_id) triples, any number per worker, each
    worker's in the order its queue gave them. Each admitted sequence's input joins the end of
    its worker's pending list: its prompt; a sequence resumed after a preemption, its prompt +
    the tokens it had made and kept. From admission its slot is occupied (not free) and pending
    (not live).
  - A decode dispatch of k steps, `executor.decode(max_steps, stop_on_refill, stop_on_idle)`
    as in one-shot mode: in each step every active worker runs one decode token for each of its
    live rows plus the next min(C, P) input tokens of its pending list (P: the input tokens
    still pending there), taken in list order, so that one step's tokens may end one sequence's
    input and start the next one's. A sequence whose last input token runs in step j makes its
    first token in step j, from that token's logits (a resumed sequence: its next token); it may
    finish there (its limit or EOS), else it is a live row from step j + 1 on and makes one token
    per step. With pending list [(s_1, n_1), (s_2, n_2), ...] at the dispatch's start (n_i input
    tokens of s_i still to run), s_i's last input token runs in step ceil((n_1 + ... + n_i) / C)
    - 1 of the dispatch (0-based). The controller knows every sequence's step from C and its own
    pending lists and checks each Finish against it: a sequence that had g tokens before its
    input turned in at step j and finishes with m tokens finished in step j + m - g - 1, which
    must lie inside the dispatch.
  - Stop rules as in one-shot mode (`worker_stops` per worker, `dispatch_stops`), with a worker's
    pending sequences counted as live: the dispatch stops after the step in which a worker with
    stop_on_refill had a slot finish, or a worker with stop_on_idle had a slot finish and holds
    no live or pending sequence after that step, or after which no row is live and nothing is
    pending anywhere. Steps that run input tokens while no row is live anywhere are allowed
    (nothing stalls).
  - Preemption (`executor.preempt`) takes pending rows too: the executor drops the row's pending
    input and its partial KV; the sequence keeps only the tokens it had made before (none for a
    fresh one), and its next admission's input is its prompt + those.
  - Migration of a pending sequence is a preemption: where a release's plan moves a pending
    sequence, the controller preempts it at the source (`executor.preempt`) and queues it at the
    front of the destination's queue, from where admission takes it again (its input
    recomputed). `executor.migrate` only ever gets live rows.
  - Paged KV: a pending row holds pages like a live row that has made the tokens it kept: before
    every dispatch `kv.grow` makes each row own pages for prompt + generated + max_steps tokens
    (a pending row: its whole input + max_steps, since it may turn live in step 0 and make a
    token in every step), and where a pool runs out its youngest rows are preempted, pending
    ones as live ones (a pending row was admitted last, so it is usually the first to go).
  - After a shrink admission follows at once: it costs no step, so the one-shot rule of one
    decode step on the new mesh first does not apply.
  - The timeline records each chunked dispatch's `chunk` (C) and `pending` (per active worker,
    its pending list at the dispatch's start: [seq id, input tokens already run, input tokens
    left]): with its live rows and the finishes, every step's live rows and input tokens per
    worker follow (accounting.dispatch_steps), which is what prices it in seconds
    (costs.mixed_dispatch_seconds).

Speculative decoding (`run(..., drafting=P)`, P a DraftingPolicy with `draft_tokens` D > 0; the
executor is a DraftingExecutor with the same `draft_tokens`; not with chunked prefill). Before
each dispatch the controller asks the executor for every live sequence's response tokens so far
(`executor.responses`), and the policy for drafts (`P.drafts(st, responses, max_steps)`: seq id
-> at most D tokens it guesses come next; a seq without one decodes plainly). Pages (paged KV)
are grown and admission asks for max_steps + D tokens, the most a row can make in a dispatch.
`executor.decode(max_steps, stop_on_refill, stop_on_idle, drafts=...)`, per step and worker:
  - a live row s whose draft is still alive wants w_s = min(draft tokens it has not made yet,
    limit - generated - 1) verification rows; the worker's free slots (not live at the step's
    start) are handed out in slot order: s gets v_s = min(w_s, free slots left after the lower
    live slots took theirs);
  - the row's own token and its v_s drafted tokens run in one step; x_0..x_v are the tokens
    plain decoding samples after each of them (the key of each position, bitwise its logits).
    The row makes x_0..x_a, where a counts the leading drafted tokens equal to the token sampled
    before them (x_{j-1} == d_j), cut after the first token that finishes it (limit or EOS);
  - the draft stays alive while every token the row made equals the draft's token at that place
    (where the draft has one); a dead draft verifies nothing for the rest of the dispatch.
So the tokens are those plain decoding makes, only sooner. After the dispatch,
`executor.dispatch_report` gives, for every sequence live at its start, (tokens made, drafted rows
verified, drafted tokens kept); a Finish carries its `step` inside the dispatch. The stop rules are
the one-shot ones. The timeline records each dispatch's `drafted`, `accepted` and `drafts`
(sequences whose draft was verified) per worker, and the policy hears the report
(`P.observe(dispatch_report)`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np

from flexfloor_jax.policy.accounting import Timeline
from flexfloor_jax.policy.accounting import metrics as _metrics


@dataclass
class Seq:
  seq_id: int
  prompt_id: str
  sample: int
  prompt_len: int
  target_len: int | None  # None = stop at EOS / max_new_tokens
  max_new_tokens: int


@dataclass
class Finish:
  seq_id: int
  worker: int
  slot: int
  num_tokens: int  # generated tokens, the prefill's first token included
  reason: str  # 'length' | 'eos' | 'target'
  step: int = -1  # drafting executors: the dispatch step (0-based) in which it finished


def finish_reason(num_tokens: int, limit: int, *, target: bool, eos: bool) -> str:
  """Why a sequence finished, the one rule for the engine and the step simulator: 'eos' when it
  stopped on an EOS token before its limit (`eos`: it stops at EOS and its last token is one),
  else 'target' for a fixed-length target (workload lengths) or 'length' (max_new_tokens)."""
  if eos and num_tokens < limit:
    return 'eos'
  return 'target' if target else 'length'


def worker_stops(finished, live, stop_on_refill, stop_on_idle):
  """The one stop rule, per worker (bool arrays or scalars, numpy or jnp: only `&`, `|`, `~`):
  a worker asks its decode dispatch to stop after a step in which it had a slot `finished` and
  either it refills on a finish, or it stops on idle and no slot of its is `live` any more. The
  dispatch stops when any worker asks, or nothing is live anywhere."""
  return finished & (stop_on_refill | (stop_on_idle & ~live))


def dispatch_stops(finished: list[int], live: set[int], active: list[int],
                   stop_on_refill: np.ndarray, stop_on_idle: np.ndarray) -> bool:
  """Does a decode dispatch stop after a step in which the workers `finished` each had a slot
  finish (one entry per finish), leaving `live` as the workers with live slots? `worker_stops`
  over the active workers (masks by position in `active`); the engine's device loop applies
  the same function on device."""
  if not live:
    return True
  fin = np.array([w in set(finished) for w in active], bool)
  alive = np.array([w in live for w in active], bool)
  return bool(np.any(worker_stops(fin, alive, np.asarray(stop_on_refill, bool),
                                  np.asarray(stop_on_idle, bool))))


class Executor(Protocol):
  """What the engine implements. `slots_per_worker` (B) is the same on every worker. A chunked
  prefill executor is a ChunkedExecutor as well."""
  slots_per_worker: int

  def prefill(self, assign: list[tuple[int, int, int]]) -> list[Finish]:
    """One-shot only. (worker, slot, seq_id), at most one per active worker; one SPMD prefill
    step on all active workers that also generates each sequence's first token (a target of 1
    finishes here)."""
    ...

  def decode(self, max_steps: int, stop_on_refill: np.ndarray,
             stop_on_idle: np.ndarray) -> tuple[int, list[Finish]]:
    """Up to max_steps decode steps on all active workers. Masks are indexed by position in
    active_workers(). Stops after the step in which a worker with stop_on_refill had a slot finish,
    or a worker with stop_on_idle went from some live slot to none, or no live slot is left.
    Chunked: each step also runs the workers' next input tokens, and pending sequences count as
    live (module doc). Returns (steps run, finishes)."""
    ...

  def migrate(self, moves: list[tuple[int, int, int, int]]) -> int:
    """(src_worker, src_slot, dst_worker, dst_slot) of live sequences; returns KV bytes moved.
    Sources are live, destinations free, all distinct and no slot is both: the moves commute."""
    ...

  def shrink(self, new_active: list[int]) -> dict:
    """New active set (a tail of the release chain); returns stats (expert bytes, seconds, ...)."""
    ...

  def preempt(self, slots: list[tuple[int, int]]) -> None:
    """Paged KV (run's `kv`), and chunked prefill's migration of a pending sequence: drop the
    sequences of these occupied (worker, slot)s, remembering the tokens each has generated; a
    later prefill (chunked: admission) of such a sequence recomputes them and makes one more
    (its Finish then counts them all). A pending row drops its pending input and partial KV."""
    ...

  def active_workers(self) -> list[int]:
    ...


class ChunkedExecutor(Executor, Protocol):
  """An executor of chunked prefill: `prefill_chunk` (C) input tokens a step per worker (an
  executor without the attribute is one-shot: C = 0), and `admit` in place of `prefill`."""
  prefill_chunk: int

  def admit(self, assign: list[tuple[int, int, int]]) -> None:
    """(worker, slot, seq_id), any number per worker: no step runs; each one's input joins the
    end of its worker's pending list (module doc)."""
    ...


class DraftingExecutor(Executor, Protocol):
  """An executor of speculative decoding (module doc): `draft_tokens` (D) is the most drafted
  tokens a row verifies in a dispatch."""
  draft_tokens: int
  dispatch_report: dict[int, tuple[int, int, int]]

  def responses(self, seq_ids: list[int]) -> dict[int, np.ndarray]:
    """The response tokens each of these live sequences has made so far (int32)."""
    ...

  def decode(self, max_steps: int, stop_on_refill: np.ndarray, stop_on_idle: np.ndarray,
             drafts: dict[int, np.ndarray] | None = None) -> tuple[int, list[Finish]]:
    ...


class DraftingPolicy(Protocol):
  """What drafts (policy.speculation.DraftPolicy)."""
  draft_tokens: int

  def drafts(self, st: State, responses: dict[int, np.ndarray],
             max_steps: int) -> dict[int, np.ndarray]:
    ...

  def observe(self, report: dict[int, tuple[int, int, int]]) -> None:
    ...


@dataclass
class Plan:
  """A release decision: migrations first, then the new active set."""
  moves: list[tuple[int, int, int, int]] = field(default_factory=list)
  queue_moves: list[tuple[int, int, int]] = field(default_factory=list)  # (src_w, dst_w, seq_id)
  new_active: list[int] | None = None


class ReleasePolicyLike(Protocol):
  enabled: bool

  def stop_masks(self, st: State) -> tuple[np.ndarray, np.ndarray]:
    """(stop_on_finish, stop_on_idle) by position in st.active."""
    ...

  def plan(self, st: State) -> Plan | None:
    ...


@dataclass
class State:
  """What a release policy sees between dispatches (read-only by convention)."""
  seqs: dict[int, Seq]
  active: list[int]
  slots_per_worker: int
  slots: list[list[int]]  # [worker][slot] seq id, -1 = free (lists: this is the hot path)
  generated: dict[int, int]  # live seq id -> tokens generated so far
  queues: dict[int, deque]  # worker -> queued seq ids (FIFO)
  step: int  # steps done so far
  # chunked prefill: worker -> its pending list, in order: [seq id, input tokens left, input
  # tokens run]. A pending seq holds its slot (in `slots`, as a live one) and `generated` counts
  # the tokens it kept from before a preemption (0 for a fresh one)
  pending: dict[int, list[list[int]]] = field(default_factory=dict)

  @property
  def slot_seq(self) -> np.ndarray:
    """[num_workers, B] seq id per slot, -1 = free."""
    return np.asarray(self.slots, np.int64)

  def live(self, w: int) -> list[tuple[int, int]]:
    """(slot, seq_id) of worker w's occupied slots (chunked prefill: pending ones too)."""
    return [(s, q) for s, q in enumerate(self.slots[w]) if q >= 0]

  def free_slots(self, w: int) -> list[int]:
    return [s for s, q in enumerate(self.slots[w]) if q < 0]

  def num_free(self, w: int) -> int:
    return self.slots[w].count(-1)

  def num_live(self, w: int) -> int:
    return len(self.slots[w]) - self.slots[w].count(-1)


@dataclass
class RolloutRecord:
  timeline: Timeline
  finishes: dict[int, Finish]  # seq id -> its Finish
  prefill_worker: dict[int, int]  # seq id -> worker that prefilled it

  def metrics(self) -> dict:
    return _metrics(self.timeline)


class ControllerError(RuntimeError):
  pass


def turn_steps(pending: list[list[int]], chunk: int) -> list[int]:
  """One worker's pending list ([seq id, input tokens left, ...] in order) -> the step of a
  dispatch (0-based) in which each one's last input token runs, `chunk` tokens a step."""
  out, end = [], 0
  for ent in pending:
    end += int(ent[1])
    out.append(-(-end // chunk) - 1)
  return out


def run(seqs: list[Seq], queues: dict[int, list[int]], executor: Executor,
        policy: ReleasePolicyLike, steps_per_dispatch: int = 8,
        clock: Callable[[], float] = time.perf_counter, slots_per_worker: int | None = None,
        kv=None, prefill_chunk: int = 0, drafting: DraftingPolicy | None = None
        ) -> RolloutRecord:
  """Generate every sequence; see the module doc for the loop. kv: a policy.pages.PagePool
  (paged KV; its max_seqs rows are the slots), None = fixed slots. prefill_chunk: input tokens
  a decode step takes per worker (chunked prefill, the module doc's contract); 0 = one-shot
  prefill steps. drafting: speculative decoding (the module doc's contract), None = off."""
  if steps_per_dispatch < 1:
    raise ValueError(f'steps_per_dispatch must be >= 1, got {steps_per_dispatch}')
  C = prefill_chunk
  if isinstance(C, bool) or not isinstance(C, (int, np.integer)) or C < 0:
    raise ValueError(f'prefill_chunk must be an integer >= 0, got {prefill_chunk!r}')
  C = int(C)
  if int(getattr(executor, 'prefill_chunk', 0) or 0) != C:
    raise ControllerError(f'the executor runs prefill_chunk='
                          f'{getattr(executor, "prefill_chunk", 0)}, the controller was asked '
                          f'for {C}')
  if C and not callable(getattr(executor, 'admit', None)):
    raise ControllerError('chunked prefill needs an executor with admit (ChunkedExecutor)')
  chunked_ex = cast(ChunkedExecutor, executor)
  D = int(drafting.draft_tokens) if drafting is not None else 0
  if D < 0 or D != int(getattr(executor, 'draft_tokens', 0) or 0):
    raise ControllerError(f'the executor verifies draft_tokens='
                          f'{getattr(executor, "draft_tokens", 0)}, the drafting policy drafts {D}')
  if D and C:
    raise ControllerError('speculative decoding and chunked prefill do not run together')
  drafting_ex = cast(DraftingExecutor, executor)
  B = int(slots_per_worker or executor.slots_per_worker)
  cap = getattr(policy, 'max_rows', None)  # admission decided in seconds (costs.admission_rows)
  if cap:
    B = min(B, int(cap))
  workers = list(executor.active_workers())
  seq_by_id = {s.seq_id: s for s in seqs}
  if len(seq_by_id) != len(seqs):
    raise ControllerError('duplicate seq_id in seqs')
  queued = [q for w in queues for q in queues[w]]
  if sorted(queued) != sorted(seq_by_id):
    missing, extra = set(seq_by_id) - set(queued), [q for q in queued if q not in seq_by_id]
    raise ControllerError(f'queues must hold every seq exactly once: missing '
                          f'{sorted(missing)[:8]}, unknown {extra[:8]}, {len(queued)} queued for '
                          f'{len(seqs)} seqs')
  if not set(queues) <= set(workers):
    raise ControllerError(f'queues for inactive workers {sorted(set(queues) - set(workers))}')
  st = State(seqs=seq_by_id, active=list(workers), slots_per_worker=B,
             slots=[[-1] * B for _ in range(max(workers) + 1)], generated={},
             queues={w: deque(queues.get(w, [])) for w in workers}, step=0,
             pending={w: [] for w in workers} if C else {})
  tl = Timeline(workers=sorted(workers), slots_per_worker=B, t_start=clock())
  done: dict[int, Finish] = {}
  where: dict[int, tuple[int, int]] = {}  # occupied seq (live or pending) -> (worker, slot)
  prefilled_on: dict[int, int] = {}
  resume: dict[int, int] = {}  # preempted seq -> tokens it had generated (paged KV)

  def finish(f: Finish, step: int):
    if f.seq_id not in where or where[f.seq_id] != (f.worker, f.slot):
      raise ControllerError(f'finish of seq {f.seq_id} at worker {f.worker} slot {f.slot}, '
                            f'but the controller has it at {where.get(f.seq_id)}')
    del where[f.seq_id]
    st.slots[f.worker][f.slot] = -1
    if kv is not None:
      kv.free(f.worker, f.slot)
    del st.generated[f.seq_id]
    done[f.seq_id] = f
    tl.add_finish(f.seq_id, f.worker, f.slot, f.num_tokens, f.reason, step)

  def admits(w: int) -> bool:
    q = st.queues[w][0]
    return kv is None or kv.admits(w, seq_by_id[q], resume.get(q, 0), steps_per_dispatch + D)

  if policy.enabled:  # workers the placement gave nothing go before the first step
    _release(st, policy, executor, tl, clock, where, kv, resume)
  shrunk = False  # the active set shrank since the last decode dispatch
  while len(done) < len(seqs):
    if C:  # (a) chunked admission: every free slot takes a queue head; no step runs
      assign = []
      for w in st.active:
        row = st.slots[w]
        while st.queues[w] and -1 in row and admits(w):
          s, q = row.index(-1), st.queues[w].popleft()
          row[s] = q
          st.generated[q] = g = resume.pop(q, 0)
          where[q] = (w, s)
          prefilled_on[q] = w
          st.pending[w].append([q, seq_by_id[q].prompt_len + g, 0])
          if kv is not None:  # before the next head asks the pool
            kv.allocate(w, s, seq_by_id[q], seq_by_id[q].prompt_len + g + 1)
          assign.append((w, s, q))
      if assign:
        chunked_ex.admit(assign)
    # (a) admission: one prefill step per round while any active worker can take a queued seq
    # (right after a shrink, a decode step on the new mesh goes first; see the module doc)
    while not C and not (shrunk and where):
      assign = []
      for w in st.active:
        row = st.slots[w]
        if st.queues[w] and -1 in row and admits(w):
          assign.append((w, row.index(-1), st.queues[w].popleft()))
      if not assign:
        break
      for w, s, q in assign:
        st.slots[w][s] = q
        st.generated[q] = resume.pop(q, 0) + 1
        where[q] = (w, s)
        prefilled_on[q] = w
        if kv is not None:
          kv.allocate(w, s, seq_by_id[q], seq_by_id[q].prompt_len + st.generated[q])
      t0 = clock()
      fins = executor.prefill(assign)
      by_w = {w: q for w, _, q in assign}
      tl.add_step('prefill', st.step, 1, st.active, [st.num_live(w) for w in st.active], t0,
                  clock(), admitted=[by_w.get(w, -1) for w in st.active])
      for f in fins:
        if f.num_tokens != st.generated.get(f.seq_id, 1):
          raise ControllerError(f'prefill finish of seq {f.seq_id} with {f.num_tokens} tokens')
        finish(f, st.step)
      st.step += 1
    if len(done) == len(seqs):
      break
    # (c) release, right before the dispatch so it runs on the fewest workers; after a change,
    # admit again (moved queues) and ask again
    n_active = len(st.active)
    if policy.enabled and _release(st, policy, executor, tl, clock, where, kv, resume):
      shrunk |= len(st.active) < n_active
      continue
    if not where:
      stuck = {w: list(q) for w, q in st.queues.items() if q}
      raise ControllerError(f'nothing live, {len(seqs) - len(done)} seqs unfinished; '
                            f'queues {stuck}')
    # (b) one decode dispatch
    # admissions deferred by a shrink wait for one step only
    deferred = shrunk and any(st.queues[w] and st.num_free(w) for w in st.active)
    max_steps = 1 if deferred and not C else steps_per_dispatch
    if kv is not None:  # pages for the dispatch's tokens; the youngest rows give way
      lost = kv.grow({where[q]: g for q, g in st.generated.items()}, max_steps + D)
      if lost:
        _preempt(st, executor, where, resume, [(w, s, w) for w, s, _ in lost])
        continue
    refill = np.array([bool(st.queues[w]) for w in st.active])
    if policy.enabled:
      stop_fin, stop_idle = policy.stop_masks(st)
    else:
      stop_fin = stop_idle = np.zeros(len(st.active), bool)
    turn: dict[int, int] = {}  # pending seq -> step of this dispatch its input turns in
    for w in st.active if C else ():
      turn.update(zip((e[0] for e in st.pending[w]), turn_steps(st.pending[w], C), strict=True))
    # the timeline's record of the pending lists: [seq id, input tokens run, input tokens left]
    snap = [[[e[0], e[2], e[1]] for e in st.pending[w]] for w in st.active] if C else None
    live0 = [st.num_live(w) - len(st.pending.get(w, ())) for w in st.active]
    shrunk = False
    if D:
      t0 = clock()
      drafts = _drafts(st, drafting, drafting_ex, max_steps, D)
      k, fins = drafting_ex.decode(max_steps, refill | np.asarray(stop_fin, bool),
                                   np.asarray(stop_idle, bool), drafts=drafts)
      t1 = clock()
      if not 1 <= k <= max_steps:
        raise ControllerError(f'decode ran {k} steps, asked for 1..{max_steps}')
      _drafted_dispatch(st, drafting, drafting_ex, tl, k, fins, drafts, live0, t0, t1, where,
                        finish)
      continue
    t0 = clock()
    k, fins = executor.decode(max_steps, refill | np.asarray(stop_fin, bool),
                              np.asarray(stop_idle, bool))
    t1 = clock()
    if not 1 <= k <= max_steps:
      raise ControllerError(f'decode ran {k} steps, asked for 1..{max_steps}')
    tl.add_step('decode', st.step, k, st.active, live0, t0, t1, chunk=C, pending=snap)
    for f in fins:
      g = st.generated.get(f.seq_id)
      if g is None:
        raise ControllerError(f'decode finish of seq {f.seq_id} that is not live')
      j = turn.get(f.seq_id, 0)  # its first token of this dispatch (live rows: step 0)
      at = st.step + j + (f.num_tokens - g) - 1  # then one token per step
      if not st.step + j <= at < st.step + k:
        raise ControllerError(f'seq {f.seq_id} finished with {f.num_tokens} tokens; it had {g} '
                              f'before a dispatch of {k} steps' +
                              (f' and its input turns in at step {j}' if f.seq_id in turn
                               else ''))
      finish(f, at)
    for q in st.generated:
      j = turn.get(q, 0)
      if j < k:
        st.generated[q] += k - j
    for w in st.pending:  # the input the k steps took, C tokens a step per worker
      budget = k * C
      for ent in st.pending[w]:
        take = min(ent[1], budget)
        ent[1] -= take
        ent[2] += take
        budget -= take
      st.pending[w] = [ent for ent in st.pending[w] if ent[1] > 0]
    st.step += k

  tl.t_end = clock()
  tl.add_release(st.active, st.step, tl.t_end, {}, final=True)
  return RolloutRecord(timeline=tl, finishes=done, prefill_worker=prefilled_on)


def _drafts(st: State, drafting, executor, max_steps: int, D: int) -> dict[int, np.ndarray]:
  """The policy's drafts for the live sequences, checked: at most D tokens, live seqs only."""
  live = list(st.generated)
  got = executor.responses(live)
  for q in live:
    if q not in got or len(got[q]) != st.generated[q]:
      raise ControllerError(f'the executor reports {len(got.get(q, ()))} response tokens for seq '
                            f'{q}; the controller counts {st.generated[q]}')
  drafts = {}
  for q, d in drafting.drafts(st, got, max_steps).items():
    d = np.asarray(d, np.int32).reshape(-1)
    if q not in st.generated:
      raise ControllerError(f'a draft for seq {q}, which is not live')
    if len(d) > D:
      raise ControllerError(f'a draft of {len(d)} tokens for seq {q}; draft_tokens is {D}')
    if len(d):
      drafts[q] = d
  return drafts


def _drafted_dispatch(st: State, drafting, executor, tl: Timeline, k: int, fins, drafts,
                      live0, t0, t1, where, finish) -> None:
  """Account a speculative dispatch of k steps: every live sequence's tokens from the executor's
  report, checked against the contract (a token a step at least, each kept drafted token one
  more), its finishes at the steps they report; then the step count advances."""
  report = {int(q): tuple(int(x) for x in v) for q, v in executor.dispatch_report.items()}
  if set(report) != set(st.generated):
    raise ControllerError(f'dispatch report for seqs {sorted(report)[:8]}, live were '
                          f'{sorted(st.generated)[:8]}')
  fin = {f.seq_id: f for f in fins}
  if len(fin) != len(fins) or not set(fin) <= set(report):
    raise ControllerError(f'decode finishes {sorted(fin)[:8]} are not of live seqs, once each')
  pos = {w: i for i, w in enumerate(st.active)}
  drafted, accepted, verified = ([0] * len(st.active) for _ in range(3))
  for q, (made, rows, kept) in report.items():
    d, f = len(drafts.get(q, ())), fin.get(q)
    if f is not None and not 0 <= f.step < k:
      raise ControllerError(f'seq {q} finished at dispatch step {f.step} of {k}')
    steps = k if f is None else f.step + 1
    if not (0 <= kept <= min(rows, d) and rows <= d and made == steps + kept):
      raise ControllerError(f'seq {q}: {made} tokens in {steps} steps with {kept} of {rows} '
                            f'drafted rows kept, from a draft of {d}')
    if f is not None and f.num_tokens != st.generated[q] + made:
      raise ControllerError(f'seq {q} finished with {f.num_tokens} tokens; it had '
                            f'{st.generated[q]} and made {made}')
    i = pos[where[q][0]]
    drafted[i] += rows
    accepted[i] += kept
    verified[i] += rows > 0
  tl.add_step('decode', st.step, k, st.active, live0, t0, t1, drafted=drafted, accepted=accepted,
              drafts=verified)
  for f in fins:
    finish(f, st.step + f.step)
  for q in st.generated:
    st.generated[q] += report[q][0]
  st.step += k
  drafting.observe(report)


def _preempt(st: State, executor: Executor, where, resume, lost) -> None:
  """Paged KV, and chunked prefill's pending migrations: the sequences at (worker, slot) leave
  (pages already freed by the pool), each to the front of worker `to`'s queue, in the order
  given (youngest first, so the oldest ends up first). A pending one leaves its pending list and
  keeps the tokens it had kept."""
  executor.preempt([(w, s) for w, s, _ in lost])
  for w, s, to in lost:
    q = st.slots[w][s]
    st.slots[w][s] = -1
    del where[q]
    resume[q] = st.generated.pop(q)
    if st.pending:
      st.pending[w] = [e for e in st.pending[w] if e[0] != q]
    st.queues[to].appendleft(q)


def _check_moves(st: State, moves) -> None:
  for sw, ss, dw, ds in moves:
    if st.slots[sw][ss] < 0 or dw not in st.active or st.slots[dw][ds] >= 0:
      raise ControllerError(f'bad migration {(sw, ss, dw, ds)}: source must be live, '
                            'destination free and active')


def _release(st: State, policy: ReleasePolicyLike, executor: Executor, tl: Timeline, clock,
             where, kv=None, resume=None) -> bool:
  """Carry out the policy's plan; True if anything moved or was released."""
  plan = policy.plan(st)
  if plan is None:
    return False
  lost_q = []  # (src, dst, seq) of moves that became preemptions queued on the destination
  pending = {e[0] for v in st.pending.values() for e in v}
  if pending and any(st.slots[sw][ss] in pending for sw, ss, _, _ in plan.moves):
    # chunked prefill: a pending seq's partial KV is dropped, not moved (module doc)
    _check_moves(st, plan.moves)
    gone = [m for m in plan.moves if st.slots[m[0]][m[1]] in pending]
    plan = Plan(moves=[m for m in plan.moves if st.slots[m[0]][m[1]] not in pending],
                queue_moves=list(plan.queue_moves), new_active=plan.new_active)
    lost_q += [(sw, dw, st.slots[sw][ss]) for sw, ss, dw, _ in gone]
    if kv is not None:
      for sw, ss, _, _ in gone:
        kv.free(sw, ss)
    _preempt(st, executor, where, resume, [(sw, ss, dw) for sw, ss, dw, _ in gone])
  if plan.moves and kv is not None:
    _check_moves(st, plan.moves)  # the controller's checks first, the pool's after
    ok = kv.move(list(plan.moves))
    lost = [m for m, fits in zip(plan.moves, ok, strict=True) if not fits]
    plan = Plan(moves=[m for m, fits in zip(plan.moves, ok, strict=True) if fits],
                queue_moves=list(plan.queue_moves), new_active=plan.new_active)
    lost_q += [(sw, dw, st.slots[sw][ss]) for sw, ss, dw, _ in lost]
    _preempt(st, executor, where, resume, [(sw, ss, dw) for sw, ss, dw, _ in lost])
  if plan.moves:
    srcs = [(sw, ss) for sw, ss, _, _ in plan.moves]
    dsts = [(dw, ds) for _, _, dw, ds in plan.moves]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
      raise ControllerError(f'migration reuses a slot: {plan.moves}')
    _check_moves(st, plan.moves)
    kv_bytes = executor.migrate(list(plan.moves))
    qs = [st.slots[sw][ss] for sw, ss, _, _ in plan.moves]
    for sw, ss, _, _ in plan.moves:
      st.slots[sw][ss] = -1
    for (_, _, dw, ds), q in zip(plan.moves, qs, strict=True):
      st.slots[dw][ds] = q
      where[q] = (dw, ds)
  else:
    kv_bytes = 0
  for sw, dw, q in plan.queue_moves:
    st.queues[sw].remove(q)
    st.queues[dw].append(q)
  if plan.moves or plan.queue_moves or lost_q:
    tl.add_migration(st.step, plan.moves, list(plan.queue_moves) + lost_q, kv_bytes, clock())
  new = plan.new_active
  if new is None or list(new) == st.active:
    return bool(plan.moves or plan.queue_moves or lost_q)
  gone_w = [w for w in st.active if w not in set(new)]
  for w in gone_w:
    if st.live(w) or st.queues[w]:
      raise ControllerError(f'release of worker {w} that still holds work')
  if not set(new) <= set(st.active):
    raise ControllerError(f'new active set {new} is not a subset of {st.active}')
  stats = executor.shrink(list(new))
  st.active = list(executor.active_workers())
  if sorted(st.active) != sorted(new):
    raise ControllerError(f'executor active {st.active} after shrink to {new}')
  for w in gone_w:
    del st.queues[w]
    st.pending.pop(w, None)
  tl.add_release(gone_w, st.step, clock(), stats)
  return True
