"""One rollout replayed through the policy code the runner runs, with a clock from a cost model.

What is replayed is not a copy of the policy but the policy itself: `policy.controller.run` drives
a `policy.stepsim.SimExecutor` (subclassed here only to advance a clock by a cost model), with the
placement from `policy.scheduler` and the release policy from `policy.release_policy`, chosen
exactly as `runner.run` chooses them (`plan.plan_rollout`). With the same sequences and lengths the
simulated device_steps therefore equal the engine's (tests/sim/test_sim.py checks it against real
rollouts).

Chunked prefill (`replay(..., prefill_chunk=C)`): the controller runs the mode the engine ran,
and a dispatch's mixed steps are priced from the input tokens each worker runs in each of them
(the pending lists the timeline records at each dispatch: costs.mixed_dispatch_seconds over
the cost model's mixed_seconds). The `cpu` preset (LinearCost) was fitted on one-shot runs and
has no input-token term: it prices a mixed step as the decode step of its rows.

Speculative decoding (`replay(..., responses=R, drafting=P)`): the controller drafts as the
engine did (P, a DraftingPolicy, asked for drafts from the tokens each sequence has made of its
response in R) and the executor keeps the drafted tokens the responses confirm, so a drafted run
replays step for step given the same drafts. A step with drafted rows is priced as a mixed step
(the cost model's mixed_seconds, its verification rows as input tokens); the `cpu` preset counts
verification rows as decode rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flexfloor_jax.policy import controller, costs, plan, stepsim
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.floor import preallocated_slots
from flexfloor_jax.sim.costs import LinearCost
from flexfloor_jax.sim.presets import Model


class CostExecutor(stepsim.SimExecutor):
  """stepsim.SimExecutor whose clock advances by a cost model (cost=None: no time; the clock is
  then the step count). The stepping (what runs, when a dispatch stops, who finishes) is
  SimExecutor's own; only time is added, so device_steps are the same as a plain SimExecutor's
  and the engine's."""

  def __init__(self, seqs, num_workers, slots_per_worker, lengths=None, *, cost=None,
               expert_placement=None, kv_bytes_per_token: int = 1, expert_bytes: int = 0,
               prefill_chunk: int = 0, responses=None, draft_tokens: int = 0):
    super().__init__(seqs, num_workers, slots_per_worker, lengths,
                     kv_bytes_per_token=kv_bytes_per_token, expert_placement=expert_placement,
                     expert_bytes=expert_bytes, prefill_chunk=prefill_chunk,
                     responses=responses, draft_tokens=draft_tokens)
    self.cost = cost

  def clock(self) -> float:
    return self.t if self.cost is not None else float(self.steps)

  def _expert_slots(self) -> int:
    return self.placement.slots if self.placement is not None else 1

  def _experts_held(self) -> np.ndarray:
    if self.placement is None:
      return np.ones(len(self._active))
    t = self.placement.slot_expert()
    return np.array([(t[w] >= 0).sum() for w in self._active], float)

  def _ctx_matrix(self):
    """[n, B] remaining tokens and cached context of live slots (0 where free)."""
    n, B = len(self._active), self.slots_per_worker
    rem, ctx = np.zeros((n, B)), np.zeros((n, B))
    for i, w in enumerate(self._active):
      for s, q in enumerate(self.slot_seq[w]):
        if q >= 0:
          rem[i, s] = self.remaining[w][s]
          ctx[i, s] = self.seqs[q].prompt_len + self.generated[w][s]
    return rem, ctx

  def prefill(self, assign):
    out = super().prefill(assign)
    c = self.cost
    if isinstance(c, LinearCost):
      n, S = len(self._active), self._expert_slots()
      self.t += c.prefill_step + c.prefill_worker * n + c.prefill_worker_slot * n * S
    elif c is not None:
      pos = {w: i for i, w in enumerate(self._active)}
      tok = np.zeros(len(self._active))
      for w, _, q in assign:
        tok[pos[w]] = self.seqs[q].prompt_len
      # causal attention over the prompt: ~P^2/2 token-context products; KV read = the prompt
      self.t += c.step_seconds(self._experts_held(), tok, tok, tok * tok / 2)
    return out

  def decode(self, max_steps, stop_on_refill, stop_on_idle, drafts=None):
    c = self.cost
    if drafts:  # step by step; its steps are priced by _price_drafted
      return super().decode(max_steps, stop_on_refill, stop_on_idle, drafts=drafts)
    if c is None:
      return super().decode(max_steps, stop_on_refill, stop_on_idle)
    rem, ctx = self._ctx_matrix()
    held = self._experts_held()
    pend = self.pending_lists() if self.prefill_chunk else []
    k, out = super().decode(max_steps, stop_on_refill, stop_on_idle)
    if k <= 0:
      return k, out
    if isinstance(c, LinearCost):
      slot_steps = float(np.minimum(rem, k).sum())
      for lst in pend:  # rows that turn live inside the dispatch
        end = 0
        for left, _, after in lst:
          end += left
          slot_steps += min(max(0, k - (-(-end // self.prefill_chunk))), after)
      n, S = len(held), self._expert_slots()
      self.t += (c.decode_dispatch + k * c.decode_step + k * n * c.decode_step_worker
                 + k * n * S * c.decode_step_worker_slot + slot_steps * c.decode_slot_step)
    elif any(pend):  # chunked prefill: mixed steps, from the input tokens each worker runs
      self.t += costs.mixed_dispatch_seconds(
          lambda rows, kv, ch, past: c.mixed_seconds(held, rows, kv, ch, past), rem, ctx, k,
          self.prefill_chunk, pend)
    else:  # closed form over the intervals in which no row finishes
      self.t += costs.dispatch_seconds(lambda rows, kv: c.step_seconds(held, rows, kv), rem, ctx,
                                       k)
    return k, out

  def _price_drafted(self, steps) -> None:
    """A drafted dispatch's steps, each (rows_w, kv_w, drafted_w, past_w) per active worker
    (SimExecutor._price_drafted): the roofline's mixed step (its decode step where no row is
    drafted); the `cpu` preset's dispatch with the verification rows counted as decode rows."""
    c = self.cost
    if c is None or not steps:
      return
    if isinstance(c, LinearCost):
      k, n, S = len(steps), len(self._active), self._expert_slots()
      slot_steps = float(sum(rows.sum() + drafted.sum() for rows, _, drafted, _ in steps))
      self.t += (c.decode_dispatch + k * c.decode_step + k * n * c.decode_step_worker
                 + k * n * S * c.decode_step_worker_slot + slot_steps * c.decode_slot_step)
      return
    held = self._experts_held()
    for rows, kv, drafted, past in steps:
      self.t += float(c.mixed_seconds(held, rows, kv, drafted, past))

  def migrate(self, moves):
    kv = super().migrate(moves)
    if isinstance(self.cost, LinearCost):
      self.t += self.cost.migration
    elif self.cost is not None:
      self.t += self.cost.migrate_seconds(kv)
    return kv

  def shrink(self, new_active):
    stats = super().shrink(new_active)
    if isinstance(self.cost, LinearCost):
      s = self.cost.release
    elif self.cost is not None:
      s = self.cost.shrink_seconds(stats["expert_moves"], len(new_active))
    else:
      s = 0.0
    stats["seconds"] = float(s)
    self.t += s
    return stats


def seconds_figures(m: dict) -> dict:
  """A replay's headline in its cost model's seconds (metrics of `replay` with a cost):
  occupied_device_seconds, makespan_s, tokens_per_occupied_device_second,
  throughput_tokens_per_s."""
  tokens = m["generated_tokens"]
  return dict(occupied_device_seconds=m["occupied_device_seconds"], makespan_s=m["makespan_s"],
              tokens_per_occupied_device_second=tokens / m["occupied_device_seconds"],
              throughput_tokens_per_s=tokens / m["makespan_s"])


def replay(seqs: list[Seq], lengths: Mapping[int, int] | None, history, schedule: str,
           num_workers: int, slots_per_worker: int, floor: int, *, cost=None,
           model: Model | None = None, steps_per_dispatch: int = 8, placement: str = "auto",
           compaction: bool = True, epoch: int = 0,
           num_experts: int | None = None, sizes=None, makespan_slack: float = 0.05,
           policy_cost=None, step_cost: str = "measured", kv=None, prefill_chunk: int = 0,
           responses=None, drafting=None, draft_tokens: int | None = None):
  """One rollout through the real policy code on a cost model -> (metrics, record).
  cost=None: one second per step (stepsim's convention). `model` sizes the expert placement
  (`preallocated_slots`: what the runner preallocates).
  `sizes`: the run's allowed active-group sizes (summary.json `release_sizes`; None = all).
  `policy_cost`: the step cost model the release policy decides on (time-aware floor); None = as
  the runner decides with `step_cost` (summary.json's): 'measured' = the step times kept in
  `history`, 'steps' = device-steps alone.
  `kv`: paged KV, (predicted lengths by seq id) -> a fresh policy.pages.PagePool whose max_seqs is
  `slots_per_worker`; the placement is simulated on it and the rollout runs on one (its stats in
  the metrics under 'kv').
  `prefill_chunk`: the run's chunked prefill (input tokens a step per worker; 0 = one-shot
  prefill steps), priced step by step from the input tokens each worker runs.
  `responses` (seq id -> its response tokens; their counts are the lengths) and `drafting` (a
  controller DraftingPolicy): the run's speculative decoding, replayed with the policy's drafts
  (`draft_tokens`: the executor's, default the policy's; responses alone replay plain decoding
  of them)."""
  queues, policy, pred = plan.plan_rollout(
      seqs, history, schedule, num_workers, slots_per_worker, floor,
      steps_per_dispatch=steps_per_dispatch, placement=placement, compaction=compaction,
      epoch=epoch, sizes=tuple(sizes) if sizes else None, makespan_slack=makespan_slack,
      cost=policy_cost, step_cost=step_cost, kv=kv)
  E = model.experts if model is not None else (num_experts or 8)
  slots = preallocated_slots(schedule, E, num_workers, floor)
  pl = ExpertPlacement.initial(E, list(range(num_workers)), slots, num_workers=num_workers)
  ex = CostExecutor(seqs, num_workers, slots_per_worker, lengths, cost=cost, expert_placement=pl,
                    kv_bytes_per_token=model.kv_bytes_per_token if model else 1,
                    expert_bytes=model.expert_bytes if model else 0,
                    prefill_chunk=prefill_chunk, responses=responses,
                    draft_tokens=(draft_tokens if draft_tokens is not None else
                                  int(drafting.draft_tokens) if drafting is not None else 0))
  pool = kv(pred) if kv is not None else None
  rec = controller.run(seqs, queues, ex, policy, steps_per_dispatch=steps_per_dispatch,
                       clock=ex.clock, kv=pool, prefill_chunk=prefill_chunk, drafting=drafting)
  m = rec.metrics()
  if pool is not None:
    m["kv"] = pool.stats()
  return m, rec

