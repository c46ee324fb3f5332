"""Numpy step simulator: an Executor that knows every sequence's length (EOS not modelled).

Driven by the same controller as the engine, so with the same lengths it runs the same steps. A
dispatch is advanced in one jump to the first step where a stop condition fires (no per-step Python
loop unless a cost model needs per-step live counts), which keeps whole-rollout simulation in the
sub-millisecond range and lets the scheduler evaluate candidate placements by simulating them.

Paged KV (`simulate(..., kv=PagePool)`): the B slots are the pool's max_seqs sequence rows and the
controller admits, grows and preempts by pages; the executor only forgets a preempted sequence's
row and resumes it at its next prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

import numpy as np

from flexfloor_jax.policy import costs
from flexfloor_jax.policy.controller import Finish, RolloutRecord, Seq, finish_reason, run


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
  """

  def __init__(self, seqs: list[Seq], num_workers: int, slots_per_worker: int,
               lengths: Mapping[int, int] | None = None, *,
               step_cost: Callable[[str, int, int], float] | None = None,
               kv_bytes_per_token: int = 1, migrate_cost: Callable[[int], float] | None = None,
               expert_placement=None, expert_bytes: int = 0,
               shrink_cost: Callable[[int], float] | None = None, cost=None):
    self.seqs = {s.seq_id: s for s in seqs}
    self.slots_per_worker = B = int(slots_per_worker)
    self.num_workers = N = int(num_workers)
    self.length = {}
    for q, s in self.seqs.items():
      L = s.target_len if lengths is None else lengths[q]
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

  def decode(self, max_steps, stop_on_refill, stop_on_idle):
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
      rem = np.array([[r if q >= 0 else 0 for q, r in zip(self.slot_seq[w], self.remaining[w],
                                                          strict=True)] for w in self._active])
      ctx = np.array([[self.seqs[q].prompt_len + g if q >= 0 else 0
                       for q, g in zip(self.slot_seq[w], self.generated[w], strict=True)]
                      for w in self._active], float)
      self.t += costs.dispatch_seconds(self.time_model.worker_step_seconds, rem, ctx, k)
    elif self.step_cost is not None:
      rems = [r for w in self._active
              for q, r in zip(self.slot_seq[w], self.remaining[w], strict=True) if q >= 0]
      for j in range(k):
        self.t += float(self.step_cost('decode', len(self._active), sum(r > j for r in rems)))
    self.steps += k
    out = []
    for w in self._active:
      row, rem, gen = self.slot_seq[w], self.remaining[w], self.generated[w]
      for s, q in enumerate(row):
        if q < 0:
          continue
        if rem[s] <= k:
          out.append(Finish(q, w, s, gen[s] + rem[s], self._reason(q)))
          row[s], rem[s] = -1, 0
        else:
          rem[s] -= k
          gen[s] += k
    return k, out

  def preempt(self, slots):
    """Paged KV: the sequences of these live (worker, slot)s leave; their next prefill resumes
    them."""
    for w, s in slots:
      q = self.slot_seq[w][s]
      if q < 0:
        raise SimError(f'preempt of free slot {(w, s)}')
      self.resume[q] = self.generated[w][s]
      self.slot_seq[w][s], self.remaining[w][s], self.generated[w][s] = -1, 0, 0

  def migrate(self, moves):
    total = 0
    for sw, ss, dw, ds in moves:
      q = self.slot_seq[sw][ss]
      if q < 0 or self.slot_seq[dw][ds] >= 0 or dw not in self._active:
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
    if any(q >= 0 for w in gone for q in self.slot_seq[w]):
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
             return_record: Literal[False] = False, kv=None, **executor_kw) -> dict: ...


@overload
def simulate(seqs: list[Seq], lengths: Mapping[int, int] | None, queues: dict[int, list[int]],
             policy, num_workers: int, slots_per_worker: int, steps_per_dispatch: int = 8, *,
             return_record: Literal[True], kv=None,
             **executor_kw) -> tuple[dict, RolloutRecord]: ...


def simulate(seqs: list[Seq], lengths: Mapping[int, int] | None, queues: dict[int, list[int]],
             policy, num_workers: int, slots_per_worker: int, steps_per_dispatch: int = 8,
             return_record: bool = False, kv=None,
             **executor_kw) -> dict | tuple[dict, RolloutRecord]:
  """One simulated rollout -> accounting metrics (and the RolloutRecord if asked).
  kv: a policy.pages.PagePool (paged KV; slots_per_worker must be its max_seqs); its stats
  (preemptions, peak pages, ...) join the metrics under 'kv'."""
  if kv is not None and kv.max_seqs != slots_per_worker:
    raise SimError(f'paged KV: slots_per_worker {slots_per_worker} != max_seqs {kv.max_seqs}')
  ex = SimExecutor(seqs, num_workers, slots_per_worker, lengths, **executor_kw)
  timed = executor_kw.get('step_cost') or executor_kw.get('cost')
  clock = ex.clock if timed else _step_clock(ex)
  rec = run(seqs, queues, ex, policy, steps_per_dispatch=steps_per_dispatch, clock=clock, kv=kv)
  m = rec.metrics()
  if kv is not None:
    m['kv'] = kv.stats()
  return (m, rec) if return_record else m


def _step_clock(ex: SimExecutor):
  """Without a cost model one step = one second, so seconds-based metrics mirror steps."""
  return lambda: float(ex.steps)


