"""Step cost models for the time-aware floor: one interface, two sources. numpy only.

A StepCost answers `decode_seconds(n_active, live_seqs)`: the seconds of one SPMD decode step on
an active group of n workers holding `live_seqs` live sequences between them. The release policy
(release_policy.ReleasePolicy, `cost=`) uses it to release only when device-seconds per step drop
and the makespan stays within its slack. Sources:
  - MeasuredStepCost: the engine's own median decode-step seconds per active-group size, measured
    during a rollout and kept in the length-history file, so the next run decides on them;
  - a hardware preset of the simulator (sim.costs.RooflineStepCost: roofline + per-step and
    per-collective latency) where nothing is measured yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np


class StepCost(Protocol):
  name: str

  def decode_seconds(self, n_active: int, live_seqs: int) -> float:
    ...

  def worker_step_seconds(self, rows_w: np.ndarray, kv_w: np.ndarray) -> float:
    ...

  def prefill_seconds(self, prompt_w: np.ndarray) -> float:
    ...


def dispatch_seconds(step, rem_wb: np.ndarray, ctx_wb: np.ndarray, steps: int) -> float:
  """Seconds of `steps` decode steps of one dispatch, summed in closed form over the intervals in
  which no row finishes: rem_wb, ctx_wb [active workers, rows]: tokens each live row still makes
  and the tokens it has cached (0 where a row is free); step(rows_w, kv_w) -> seconds of one step
  (a StepCost's worker_step_seconds). Within an interval the live rows are fixed and their cached
  tokens grow by one a step, so a worker's KV read is linear in the step: the interval is priced
  at its middle step, exact where one worker gates the whole interval with one bound (memory or
  compute)."""
  rem_wb = np.asarray(rem_wb, float)
  live0 = rem_wb > 0
  ends = np.unique(np.minimum(rem_wb[live0], steps))
  total, a = 0.0, 0.0
  for b in ends:
    if b <= a:
      continue
    live = rem_wb > a
    mid = (a + b - 1) / 2.0
    total += (b - a) * step(live.sum(1).astype(float), ((ctx_wb + mid) * live).sum(1))
    a = b
  return total


def admission_rows(cost: StepCost, max_rows: int, ctx_tokens: float) -> int:
  """Admission in seconds: how many rows a worker runs at once, at most `max_rows` (the compiled
  or memory bound). A worker's tokens per second with r rows of `ctx_tokens` cached tokens each is
  r / worker_step_seconds(r); the largest r within a hair of the best rate is taken. Where a step
  reads the weights once for every row (any roofline, a measured table) the rate grows with r and
  every row is used; where a second row more than doubles a step, rows are better run one after
  another (or on another worker) and fewer are admitted."""
  if max_rows < 1:
    raise ValueError(f"max_rows must be >= 1, got {max_rows}")
  r = np.arange(1, int(max_rows) + 1, dtype=float)
  rate = np.array([n / cost.worker_step_seconds(np.array([n]), np.array([n * ctx_tokens]))
                   for n in r])
  return int(r[rate >= rate.max() * (1.0 - 1e-9)].max())


class MeasuredStepCost:
  """Median decode-step seconds by active-group size; sizes between measured ones are linearly
  interpolated, sizes outside take the nearest measured one (a release to an unmeasured size is
  judged by its neighbour, never refused for lack of data)."""

  name = "measured"

  def __init__(self, table: Mapping[int, float]):
    pts = sorted((int(n), float(t)) for n, t in table.items())
    if len(pts) < 2:
      raise ValueError(f"a measured step-cost table needs >= 2 group sizes, got {dict(pts)}")
    if any(n < 1 or not np.isfinite(t) or t <= 0 for n, t in pts):
      raise ValueError(f"step-cost table needs sizes >= 1 and finite seconds > 0, got {dict(pts)}")
    self.table = dict(pts)
    self._n = np.array([n for n, _ in pts], float)
    self._t = np.array([t for _, t in pts], float)

  def decode_seconds(self, n_active: int, live_seqs: int = 0) -> float:
    del live_seqs  # measured per size over the rollout's own batches
    return float(np.interp(float(n_active), self._n, self._t))

  def worker_step_seconds(self, rows_w: np.ndarray, kv_w: np.ndarray) -> float:
    del kv_w  # the table is per group size, measured over the rollout's own batches
    return self.decode_seconds(len(rows_w))

  def prefill_seconds(self, prompt_w: np.ndarray) -> float:
    return self.decode_seconds(len(prompt_w))  # no prefill measured: a step of the group size


STEP_COSTS = ("auto", "measured", "steps")
# scheduler.cost_model where a config does not name one: the roofline pair configs/mixtral.py's
# model stands for
DEFAULT_COST_MODEL = "roofline:mixtral-8x7b@h100"


def resolve(step_cost: str, platform: str, cost_model: str = DEFAULT_COST_MODEL) -> str:
  """scheduler.step_cost -> 'measured' | 'steps' | 'roofline:MODEL@HARDWARE'. 'auto' decides on
  measured seconds on TPU/GPU and, on emulated CPU devices, in the seconds of `cost_model`
  (scheduler.cost_model: the roofline of the full-size model and hardware pair the run stands
  for): emulated devices share the host's cores, so their step times say nothing about an
  accelerator's and vary with the machine's load from run to run, and device-steps price a step
  over more rows as free. A named roofline pair (the simulator's presets, resolved by the
  runner) decides in that pair's seconds, the tiny model standing for the named one; 'steps'
  keeps device-steps as the objective (a count, kept for comparison)."""
  if str(step_cost).startswith("roofline:"):
    return step_cost
  if step_cost not in STEP_COSTS:
    raise ValueError(f"must be one of {STEP_COSTS} or 'roofline:MODEL@HARDWARE', got "
                     f"{step_cost!r}")
  if step_cost == "auto":
    return cost_model if platform == "cpu" else "measured"
  return step_cost


def from_history(table: Mapping[int, float] | None) -> MeasuredStepCost | None:
  """The measured cost model if the history holds one for >= 2 sizes, else None."""
  if not table or len(table) < 2:
    return None
  return MeasuredStepCost(table)
