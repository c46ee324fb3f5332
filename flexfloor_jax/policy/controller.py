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
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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
  """What the engine implements. `slots_per_worker` (B) is the same on every worker."""
  slots_per_worker: int

  def prefill(self, assign: list[tuple[int, int, int]]) -> list[Finish]:
    """(worker, slot, seq_id), at most one per active worker; one SPMD prefill step on all active
    workers that also generates each sequence's first token (a target of 1 finishes here)."""
    ...

  def decode(self, max_steps: int, stop_on_refill: np.ndarray,
             stop_on_idle: np.ndarray) -> tuple[int, list[Finish]]:
    """Up to max_steps decode steps on all active workers. Masks are indexed by position in
    active_workers(). Stops after the step in which a worker with stop_on_refill had a slot finish,
    or a worker with stop_on_idle went from some live slot to none, or no live slot is left.
    Returns (steps run, finishes)."""
    ...

  def migrate(self, moves: list[tuple[int, int, int, int]]) -> int:
    """(src_worker, src_slot, dst_worker, dst_slot) of live sequences; returns KV bytes moved.
    Sources are live, destinations free, all distinct and no slot is both: the moves commute."""
    ...

  def shrink(self, new_active: list[int]) -> dict:
    """New active set (a tail of the release chain); returns stats (expert bytes, seconds, ...)."""
    ...

  def preempt(self, slots: list[tuple[int, int]]) -> None:
    """Paged KV only (run's `kv`): drop the sequences of these live (worker, slot)s, remembering
    the tokens each has generated; a later prefill of such a sequence recomputes them and makes
    one more (its Finish then counts them all)."""
    ...

  def active_workers(self) -> list[int]:
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

  @property
  def slot_seq(self) -> np.ndarray:
    """[num_workers, B] seq id per slot, -1 = free."""
    return np.asarray(self.slots, np.int64)

  def live(self, w: int) -> list[tuple[int, int]]:
    """(slot, seq_id) of worker w's live slots."""
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


def run(seqs: list[Seq], queues: dict[int, list[int]], executor: Executor,
        policy: ReleasePolicyLike, steps_per_dispatch: int = 8,
        clock: Callable[[], float] = time.perf_counter, slots_per_worker: int | None = None,
        kv=None) -> RolloutRecord:
  """Generate every sequence; see the module doc for the loop. kv: a policy.pages.PagePool
  (paged KV; its max_seqs rows are the slots), None = fixed slots."""
  if steps_per_dispatch < 1:
    raise ValueError(f'steps_per_dispatch must be >= 1, got {steps_per_dispatch}')
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
             queues={w: deque(queues.get(w, [])) for w in workers}, step=0)
  tl = Timeline(workers=sorted(workers), slots_per_worker=B, t_start=clock())
  done: dict[int, Finish] = {}
  where: dict[int, tuple[int, int]] = {}  # live seq -> (worker, slot)
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

  if policy.enabled:  # workers the placement gave nothing go before the first step
    _release(st, policy, executor, tl, clock, where, kv, resume)
  shrunk = False  # the active set shrank since the last decode dispatch
  while len(done) < len(seqs):
    # (a) admission: one prefill step per round while any active worker can take a queued seq
    # (right after a shrink, a decode step on the new mesh goes first; see the module doc)
    while not (shrunk and where):
      assign = []
      for w in st.active:
        row = st.slots[w]
        if st.queues[w] and -1 in row and (kv is None or kv.admits(
            w, seq_by_id[st.queues[w][0]], resume.get(st.queues[w][0], 0), steps_per_dispatch)):
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
      tl.add_step('prefill', st.step, 1, st.active, [st.num_live(w) for w in st.active], t0,
                  clock())
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
    pending = shrunk and any(st.queues[w] and st.num_free(w) for w in st.active)
    max_steps = 1 if pending else steps_per_dispatch
    if kv is not None:  # pages for the dispatch's tokens; the youngest rows give way
      lost = kv.grow({where[q]: g for q, g in st.generated.items()}, max_steps)
      if lost:
        _preempt(st, executor, where, resume, [(w, s, w) for w, s, _ in lost])
        continue
    refill = np.array([bool(st.queues[w]) for w in st.active])
    if policy.enabled:
      stop_fin, stop_idle = policy.stop_masks(st)
    else:
      stop_fin = stop_idle = np.zeros(len(st.active), bool)
    live0 = [st.num_live(w) for w in st.active]
    shrunk = False
    t0 = clock()
    k, fins = executor.decode(max_steps, refill | np.asarray(stop_fin, bool),
                              np.asarray(stop_idle, bool))
    t1 = clock()
    if not 1 <= k <= max_steps:
      raise ControllerError(f'decode ran {k} steps, asked for 1..{max_steps}')
    tl.add_step('decode', st.step, k, st.active, live0, t0, t1)
    for f in fins:
      g = st.generated.get(f.seq_id)
      if g is None:
        raise ControllerError(f'decode finish of seq {f.seq_id} that is not live')
      at = st.step + (f.num_tokens - g) - 1  # one token per decode step
      if not st.step <= at < st.step + k:
        raise ControllerError(f'seq {f.seq_id} finished with {f.num_tokens} tokens; it had {g} '
                              f'before a dispatch of {k} steps')
      finish(f, at)
    for q in st.generated:
      st.generated[q] += k
    st.step += k

  tl.t_end = clock()
  tl.add_release(st.active, st.step, tl.t_end, {}, final=True)
  return RolloutRecord(timeline=tl, finishes=done, prefill_worker=prefilled_on)


def _preempt(st: State, executor: Executor, where, resume, lost) -> None:
  """Paged KV: the sequences at (worker, slot) leave (pages already freed by the pool), each to
  the front of worker `to`'s queue, in the order given (youngest first, so the oldest ends up
  first)."""
  executor.preempt([(w, s) for w, s, _ in lost])
  for w, s, to in lost:
    q = st.slots[w][s]
    st.slots[w][s] = -1
    del where[q]
    resume[q] = st.generated.pop(q)
    st.queues[to].appendleft(q)


def _release(st: State, policy: ReleasePolicyLike, executor: Executor, tl: Timeline, clock,
             where, kv=None, resume=None) -> bool:
  """Carry out the policy's plan; True if anything moved or was released."""
  plan = policy.plan(st)
  if plan is None:
    return False
  lost = []  # paged KV: moves whose destination lacks the pages (preempted there)
  if plan.moves and kv is not None:
    for sw, ss, dw, ds in plan.moves:  # the controller's checks first, the pool's after
      if st.slots[sw][ss] < 0 or dw not in st.active or st.slots[dw][ds] >= 0:
        raise ControllerError(f'bad migration {(sw, ss, dw, ds)}: source must be live, '
                              'destination free and active')
    ok = kv.move(list(plan.moves))
    lost = [m for m, fits in zip(plan.moves, ok, strict=True) if not fits]
    plan = Plan(moves=[m for m, fits in zip(plan.moves, ok, strict=True) if fits],
                queue_moves=list(plan.queue_moves), new_active=plan.new_active)
    lost_q = [(sw, dw, st.slots[sw][ss]) for sw, ss, dw, _ in lost]
    _preempt(st, executor, where, resume, [(sw, ss, dw) for sw, ss, dw, _ in lost])
  if plan.moves:
    srcs = [(sw, ss) for sw, ss, _, _ in plan.moves]
    dsts = [(dw, ds) for _, _, dw, ds in plan.moves]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
      raise ControllerError(f'migration reuses a slot: {plan.moves}')
    for sw, ss, dw, ds in plan.moves:
      if st.slots[sw][ss] < 0 or dw not in st.active or st.slots[dw][ds] >= 0:
        raise ControllerError(f'bad migration {(sw, ss, dw, ds)}: source must be live, '
                              'destination free and active')
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
  if plan.moves or plan.queue_moves or lost:
    tl.add_migration(st.step, plan.moves, list(plan.queue_moves) + (lost_q if lost else []),
                     kv_bytes, clock())
  new = plan.new_active
  if new is None or list(new) == st.active:
    return bool(plan.moves or plan.queue_moves or lost)
  gone = [w for w in st.active if w not in set(new)]
  for w in gone:
    if st.live(w) or st.queues[w]:
      raise ControllerError(f'release of worker {w} that still holds work')
  if not set(new) <= set(st.active):
    raise ControllerError(f'new active set {new} is not a subset of {st.active}')
  stats = executor.shrink(list(new))
  st.active = list(executor.active_workers())
  if sorted(st.active) != sorted(new):
    raise ControllerError(f'executor active {st.active} after shrink to {new}')
  for w in gone:
    del st.queues[w]
  tl.add_release(gone, st.step, clock(), stats)
  return True
