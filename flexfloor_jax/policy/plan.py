"""Which sequence goes where and how the group may shrink: one function that the runner (real
rollouts) and the simulator (replays) both call, so what is simulated is what runs. numpy only."""

from __future__ import annotations

from flexfloor_jax.policy import planner, scheduler
from flexfloor_jax.policy.controller import Seq

PLACEMENTS = ("auto", "static")


def plan_rollout(seqs: list[Seq], history: scheduler.LengthHistory, schedule: str,
                 num_workers: int, slots_per_worker: int, floor: int, *,
                 steps_per_dispatch: int = 8, placement: str = "auto", compaction: bool = True,
                 epoch: int = 0, sizes: tuple[int, ...] | None = None):
  """(queues, release policy, predicted length by seq id).

  schedule='static': the verl-like baseline (contiguous chunks, no release).
  schedule='flexfloor', placement='auto': length-aware placement on the release chain, release,
    work stealing, and compaction when `compaction`.
  schedule='flexfloor', placement='static': the baseline's placement unchanged; release alone
    (compaction=False: its ceiling is 1 / (1 - static idle_after_finish_fraction)) or release plus
    compaction of stragglers (compaction=True), never work stealing.
  `sizes`: the active-group sizes a release may leave (planner.release_sizes); None = all."""
  if schedule not in ("static", "flexfloor"):
    raise ValueError(f"schedule must be 'static' or 'flexfloor', got {schedule!r}")
  if placement not in PLACEMENTS:
    raise ValueError(f"scheduler.placement must be one of {PLACEMENTS}, got {placement!r}")
  workers = list(range(num_workers))
  flex = schedule == "flexfloor"
  if flex and placement == "auto":
    queues, pred, _ = scheduler.flexfloor_schedule(
        seqs, history, workers, slots_per_worker, floor=floor,
        steps_per_dispatch=steps_per_dispatch, seed=epoch)
    policy = planner.ReleasePolicy(enabled=True, floor=floor, chain=list(workers),
                                   compaction=bool(compaction), predicted=pred, sizes=sizes)
  else:
    predicted = scheduler.predict(history, seqs)
    pred = {s.seq_id: float(p) for s, p in zip(seqs, predicted)}
    queues = scheduler.static_placement(seqs, workers)
    policy = planner.ReleasePolicy(enabled=flex, floor=floor if flex else num_workers,
                                   chain=list(workers), compaction=flex and bool(compaction),
                                   steal=False, predicted=pred, sizes=sizes)
  return queues, policy, pred
