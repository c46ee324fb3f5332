"""Which sequence goes where and how the group may shrink: one function that the runner (real
rollouts) and the simulator (replays) both call, so what is simulated is what runs. numpy only."""

from __future__ import annotations

from typing import Any

from flexfloor_jax.policy import costs, prediction, release_policy, scheduler
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.history import LengthHistory

SCHEDULES = ("static", "balanced", "flexfloor")
PLACEMENTS = ("auto", "static", "balanced")


def plan_rollout(seqs: list[Seq], history: LengthHistory, schedule: str,
                 num_workers: int, slots_per_worker: int, floor: int, *,
                 steps_per_dispatch: int = 8, placement: str = "auto", compaction: bool = True,
                 epoch: int = 0, sizes: tuple[int, ...] | None = None,
                 makespan_slack: float = 0.05, cost=None, step_cost: str = "measured",
                 kv=None):
  """(queues, release policy, predicted length by seq id).

  schedule='static': the verl-like baseline (contiguous chunks, no release).
  schedule='balanced': the strong baseline: longest predicted first onto the least-loaded worker,
    a shared queue (every free slot takes the longest waiting seq), full width, no release.
  schedule='flexfloor', placement='auto': length-aware placement on the release chain whose
    predicted makespan is within `makespan_slack` of balanced's, release, work stealing, and
    compaction when `compaction`.
  schedule='flexfloor', placement='balanced': balanced's placement and shared queue, with release
    (and compaction when `compaction`): where releases rarely pay in seconds (a roofline decode
    step is gated by the worker holding the most experts), a placement made for releasing buys
    nothing, and the balanced one keeps the makespan.
  schedule='flexfloor', placement='static': the baseline's placement unchanged; release alone
    (compaction=False: its ceiling is 1 / (1 - static idle_after_finish_fraction)) or release plus
    compaction of stragglers (compaction=True), never work stealing.
  `sizes`: the active-group sizes a release may leave (floor.release_sizes); None = all.
  `cost`: a step cost model (policy.costs); with it a release must pay in seconds (time-aware
  floor). None: with step_cost='measured', the step times that previous rollouts measured and kept
  in `history`, if it holds them for >= 2 group sizes; else (or with step_cost='steps')
  device-steps alone.
  `kv`: paged KV, (predicted lengths by seq id) -> a fresh policy.pages.PagePool with max_seqs =
  slots_per_worker: the flexfloor placement simulates its candidates on it, and the balanced and
  flexfloor placements (and placement='balanced''s predicted makespan) estimate a worker's finish
  from its pool (scheduler.PoolLoad: rows and reserved page-steps) instead of lanes."""
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
  if placement not in PLACEMENTS:
    raise ValueError(f"scheduler.placement must be one of {PLACEMENTS}, got {placement!r}")
  workers = list(range(num_workers))
  flex = schedule == "flexfloor"
  if cost is None and step_cost == "measured":
    cost = costs.from_history(history.step_seconds)
  timed: dict[str, Any] = dict(cost=cost, makespan_slack=makespan_slack)
  # admission in seconds: the rows a worker runs at once, for every schedule alike
  rows = admission(seqs, history, cost, slots_per_worker)
  max_rows = rows if rows < slots_per_worker else None  # None: every slot
  timed["max_rows"] = max_rows
  if kv is None:  # fixed slots: the placements fill `rows` lanes (a pool's rows are its own)
    slots_per_worker = rows
  if flex and placement == "auto":
    # the shared queue at run time, in the candidates' simulation as in the rollout
    queues, pred, info = scheduler.flexfloor_schedule(
        seqs, history, workers, slots_per_worker, floor=floor,
        steps_per_dispatch=steps_per_dispatch, seed=epoch, makespan_slack=makespan_slack,
        policy_kw=dict(shared_queue=True, sizes=sizes, max_rows=max_rows), kv=kv, cost=cost)
    policy = release_policy.ReleasePolicy(enabled=True, floor=floor, chain=list(workers),
                                   compaction=bool(compaction), predicted=pred, sizes=sizes,
                                   shared_queue=True,
                                   predicted_makespan_steps=float(info["balanced_predicted_makespan"]),
                                   pool_rows=pool_rows(seqs, pred, kv, steps_per_dispatch),
                                   **timed)
    return queues, policy, pred
  predicted = prediction.predict(history, seqs)
  pred = {s.seq_id: float(p) for s, p in zip(seqs, predicted, strict=True)}
  if schedule == "balanced" or flex and placement == "balanced":
    q90 = prediction.predict(history, seqs, quantile=0.9)
    # paged KV: a worker's finish from its pool (rows and reserved page-steps), not lanes
    load = scheduler.PoolLoad.for_pool(seqs, q90, kv, steps_per_dispatch)
    queues = scheduler.balanced_placement(seqs, q90, workers, slots_per_worker, pool=load)
  if flex and placement == "balanced":
    by_id = dict(zip((s.seq_id for s in seqs), q90, strict=True))
    if load is not None:
      index = {s.seq_id: i for i, s in enumerate(seqs)}
      makespan = max(load.finish([index[q] for q in v]) for v in queues.values())
    else:
      makespan = max(
          release_policy.list_schedule_finish([], [by_id[q] for q in v], slots_per_worker)
          for v in queues.values())
    policy = release_policy.ReleasePolicy(enabled=True, floor=floor, chain=list(workers),
                                   compaction=bool(compaction), predicted=pred, sizes=sizes,
                                   shared_queue=True, predicted_makespan_steps=makespan,
                                   pool_rows=pool_rows(seqs, pred, kv, steps_per_dispatch),
                                   **timed)
    return queues, policy, pred
  if schedule == "balanced":
    policy = release_policy.ReleasePolicy(enabled=True, floor=num_workers, chain=list(workers),
                                   compaction=False, swap=False, steal=False, shared_queue=True,
                                   predicted=pred, max_rows=max_rows)
    return queues, policy, pred
  queues = scheduler.static_placement(seqs, workers)
  policy = release_policy.ReleasePolicy(enabled=flex, floor=floor if flex else num_workers,
                                 chain=list(workers), compaction=flex and bool(compaction),
                                 steal=False, predicted=pred, sizes=sizes, **timed)
  return queues, policy, pred


def pool_rows(seqs: list[Seq], pred: dict[int, float], kv, steps_per_dispatch: int) -> int | None:
  """Paged KV: the rows a worker's pool holds at once on the predicted lengths (its pages over
  the mean reservation); None where the pool never binds (rows alone limit) or slots."""
  if kv is None or not seqs:
    return None
  load = scheduler.PoolLoad(seqs, [pred[s.seq_id] for s in seqs], kv, steps_per_dispatch)
  return load.lanes if load.binds() else None


def admission(seqs: list[Seq], history: LengthHistory, cost, slots_per_worker: int) -> int:
  """Rows a worker runs at once: every slot in device-steps (no cost model), else
  costs.admission_rows at the batch's typical cached tokens (prompt plus half its predicted
  response)."""
  if cost is None or not seqs:
    return slots_per_worker
  pred = prediction.predict(history, seqs)
  ctx = float(sum(s.prompt_len + p / 2 for s, p in zip(seqs, pred, strict=True)) / len(seqs))
  return costs.admission_rows(cost, slots_per_worker, ctx)


def length_buckets(queues: dict[int, list[int]], predicted: dict[int, float]) -> list[dict]:
  """Per worker, the predicted lengths it was given (its queue is longest first: sequences of
  similar length run together there, so its slots empty together)."""
  out = []
  for w in sorted(queues):
    p = [float(predicted[q]) for q in queues[w]]
    out.append(dict(worker=int(w), seqs=len(p), predicted_min=min(p) if p else None,
                    predicted_max=max(p) if p else None,
                    predicted_total=float(sum(p))))
  return out
