"""Step cost models for the time-aware floor: one interface, two sources. numpy only.

A StepCost answers `decode_seconds(n_active, live_seqs)`: the seconds of one SPMD decode step on
an active group of n workers holding `live_seqs` live sequences between them. The release policy
(release_policy.ReleasePolicy, `cost=`) uses it to release only when device-seconds per step drop
and the makespan stays within its slack. Sources:
  - MeasuredStepCost: the engine's own median decode-step seconds per active-group size, measured
    during a rollout and kept in the length-history file, so the next run decides on them;
  - a hardware preset of the simulator (sim.costs.RooflineStepCost: roofline + per-step and
    per-collective latency) where nothing is measured yet.
Chunked prefill (policy.controller's module doc) runs prompt tokens inside decode steps:
`mixed_seconds` prices such a step from the input tokens each worker runs beside its live rows,
`mixed_dispatch_seconds` sums a dispatch of them in closed form, and `admission_chunk` decides
how many input tokens a step takes.
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

  def mixed_seconds(self, rows_w: np.ndarray, kv_w: np.ndarray, chunk_w: np.ndarray,
                    past_w: np.ndarray) -> float:
    """A decode step (rows_w live rows reading kv_w cached tokens per worker) in which each
    worker also runs chunk_w input tokens whose sequences hold past_w tokens before them (the
    prefix their attention reads, summed over the sequences the tokens span); chunk_w = 0 is
    worker_step_seconds."""
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


def mixed_dispatch_seconds(step, rem_wb: np.ndarray, ctx_wb: np.ndarray, steps: int, chunk: int,
                           pending: list[list[tuple[int, int, int]]]) -> float:
  """Seconds of `steps` steps of one chunked-prefill dispatch (policy.controller's contract),
  summed in closed form like dispatch_seconds. rem_wb, ctx_wb [active workers, rows]: the live
  rows' tokens still to make and cached tokens (0 where a row is not live); pending: per active
  worker its pending list in order, (input tokens left, input tokens already run, tokens it
  makes after its first); chunk: input tokens a step per worker; step(rows_w, kv_w, chunk_w,
  past_w) -> seconds (a StepCost's mixed_seconds).
  A pending sequence whose input turns in at step j makes its first token there and is a live
  row reading input + 1 + (t - j - 1) cached tokens in steps t = j+1 ... j + its tokens after
  the first. The dispatch is cut where a row starts or stops and around each step in which a
  sequence's input turns in: in between the rows are fixed, each worker runs `chunk` input
  tokens a step (or none) from one sequence, and the rows' cached tokens and the chunk's prefix
  grow by a fixed amount a step, so each piece is priced at its middle step as in
  dispatch_seconds (exact where one bound gates the piece)."""
  rem_wb = np.asarray(rem_wb, float)
  ctx_wb = np.asarray(ctx_wb, float)
  n = rem_wb.shape[0]
  C = int(chunk)
  steps = int(steps)
  # rows as (worker, first step, end step, cached tokens at the first step)
  iw, ib = np.nonzero(rem_wb > 0)
  W, S, E, X = [iw], [np.zeros(len(iw))], [rem_wb[iw, ib]], [ctx_wb[iw, ib]]
  cuts = {0, steps}
  segs = []  # per worker: [(stream start, stream end, input tokens run before)]
  total = np.zeros(n)
  for w, lst in enumerate(pending):
    end, mine = 0, []
    for left, ran, after in lst:
      a, end = end, end + int(left)
      mine.append((a, end, int(ran)))
      j = -(-end // C) - 1
      cuts.update((j, j + 1))
      if after > 0 and j + 1 < steps:
        W.append(np.array([w]))
        S.append(np.array([j + 1.0]))
        E.append(np.array([j + 1.0 + after]))
        X.append(np.array([float(ran + left + 1)]))
    segs.append(mine)
    total[w] = end
  W_, S_, E_, X_ = (np.concatenate(v) for v in (W, S, E, X))
  cuts.update(int(x) for x in S_)
  cuts.update(int(x) for x in E_)
  ends = sorted(c for c in cuts if 0 <= c <= steps)

  def past(w: int, t: int) -> float:
    lo_t, hi_t = t * C, min((t + 1) * C, total[w])
    out = 0.0
    for a, e, ran in segs[w]:
      if e > lo_t and a < hi_t:
        out += ran + max(lo_t, a) - a
    return out

  tot, a = 0.0, 0
  for b in ends:
    if b <= a:
      continue
    live = (S_ <= a) & (E_ > a)
    mid = (a + b - 1) / 2.0
    rows = np.bincount(W_[live], minlength=n).astype(float)
    kv = np.bincount(W_[live], weights=X_[live] + mid - S_[live], minlength=n)
    ch = np.clip(total - a * C, 0, C)
    pw = np.array([(past(w, a) + past(w, b - 1)) / 2.0 if ch[w] else 0.0 for w in range(n)])
    tot += (b - a) * step(rows, kv, ch, pw)
    a = b
  return tot


def admission_chunk(cost: StepCost, max_chunk: int, rows: float, ctx_tokens: float,
                    workers: int = 1, growth: float = 0.1) -> int:
  """Admission decides how many prompt tokens a step takes: the most input tokens per worker,
  up to `max_chunk` (the configured chunk), with which a step of `workers` workers, each holding
  `rows` live rows of `ctx_tokens` cached tokens, takes at most (1 + growth) x the seconds of
  the same step without them (and at least one token, so that prompts progress). Input tokens
  that hide under a step's weight reads are free; past that, every token stretches the step
  each live row waits for, which the rows pay in makespan, while a one-shot prefill would run
  the same tokens at the same compute rate anyway. `growth` is that small stretch a step may
  take. A step's seconds grow with its tokens, so the answer is found by bisection."""
  if max_chunk < 1:
    raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
  if growth < 0:
    raise ValueError(f"growth must be >= 0, got {growth}")
  n = max(1, int(workers))
  r = np.full(n, float(rows))
  kv = r * float(ctx_tokens)

  def secs(c: int) -> float:
    return cost.mixed_seconds(r, kv, np.full(n, float(c)), np.zeros(n))

  limit = secs(0) * (1.0 + growth) * (1.0 + 1e-12)
  lo, hi = 1, int(max_chunk)
  if secs(hi) <= limit:
    return hi
  while lo < hi:  # the largest c with secs(c) <= limit, at least 1
    mid = (lo + hi + 1) // 2
    if secs(mid) <= limit:
      lo = mid
    else:
      hi = mid - 1
  return lo


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

  def mixed_seconds(self, rows_w: np.ndarray, kv_w: np.ndarray, chunk_w: np.ndarray,
                    past_w: np.ndarray) -> float:
    del kv_w, chunk_w, past_w  # no mixed step measured: a step of the group size
    return self.decode_seconds(len(rows_w))


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
