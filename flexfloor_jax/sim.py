"""Cluster-scale simulator: the rollout policy the engine runs, on a roofline cost model.

`python -m flexfloor_jax.sim --model=mixtral-8x7b --hardware=tpu-v5p --devices=8,64,256,1024`
`python -m flexfloor_jax.sim --calibrate=bench_out/runs/static_e0.json,bench_out/runs/flexfloor_e0.json \
                             --predict=bench_out/runs/flexfloor_e3.json,bench_out/runs/static_e3.json`

Numpy only: this module imports no JAX (a test checks it in a fresh interpreter). What it replays
is not a copy of the policy but the policy itself: `policy.controller.run` drives a
`policy.stepsim.SimExecutor` (subclassed here only to advance a clock by a cost model), with the
placement from `policy.scheduler` and the release policy from `policy.planner`, chosen exactly as
`runner.run` chooses them (`plan_rollout`). With the same sequences and lengths the simulated
device_steps therefore equal the engine's (tests/test_sim.py checks it against real rollouts).

Cost model of one SPMD step on an EP group of n active workers (`RooflineCost`):
  per worker w:  t_w = max(bytes_w / HBM bandwidth, flops_w / peak flops)      (roofline)
     bytes_w = non-expert weights (replicated; all read every step)
             + experts held by w that at least one token of the step is routed to (expected
               number under uniform top-k routing) x bytes of one expert
             + KV bytes of w's live sequences (every cached token of every live slot is read)
  all_to_all:   t_a2a = max_w (dispatch + combine bytes leaving w) / interconnect bandwidth
                        + 2 collectives x layers x collective latency        (0 when n = 1)
  step time   = fixed step overhead + max_w t_w + t_a2a
Memory/compute of a worker overlap (max); the all_to_all does not overlap them (sum): in a decode
step the expert matmul of a layer needs its dispatched tokens and the next layer needs the
combined output, so nothing is left to hide it behind. The slowest worker gates the SPMD step
(max over workers). A release costs the moved experts' bytes over the interconnect, a migration
its KV bytes.

Scale (`simulate_cluster`): D devices run as D/ep expert-parallel groups (dp x ep, ep <= E), each
group serving its own contiguous share of the batch (verl's data-parallel split), each group the
size of a layout someone would run (8 workers for Mixtral's 8 experts). Within a group the policy
releases workers down to the group's memory floor; across groups a group is released as a whole
when its last sequence is done, while the static baseline holds every device until the batch's
last response (synchronous rollout). Moving sequences between groups is not modelled.

`cpu` hardware: a linear cost model fitted by least squares to the measured timelines of one
workload (`fit_cpu`; its static and flexfloor rollouts): decode dispatch seconds ~ dispatch +
steps + steps x active workers (x expert slots) + live slot-steps, prefill ~ steps + steps x
active workers (x expert slots), plus a cost per release and per migration. Emulated CPU devices
share the host's cores, so a CPU step costs more with more active workers (the opposite of a real
accelerator, where fewer workers holding more experts each are slower per step).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Mapping, Optional

import numpy as np

from flexfloor_jax.policy import (accounting, controller, plan, planner, reuse, scheduler,
                                  stepsim, workload)
from flexfloor_jax.policy.atomic import atomic_open, atomic_write
from flexfloor_jax.policy.controller import Seq

GB = 1e9
GIB = 2.0**30

# ----------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  hbm_bw: float  # bytes/s per device
  hbm_bytes: float  # bytes per device
  link_bw: float  # bytes/s a device can send to its EP group (one direction)
  peak_flops: float  # dense bf16 FLOP/s per device
  step_overhead_s: float = 20e-6  # launch + host sync per step (assumption, not a published figure)
  collective_latency_s: float = 5e-6  # per all_to_all (assumption, not a published figure)
  source: str = ""
  # --hardware=measured:FILE: measured decode-step times per worker (policy/measured_hw.py)
  step_table: object = dataclasses.field(default=None, compare=False, repr=False)


HARDWARE = {
    # cloud.google.com/tpu/docs/v5e: 16 GiB HBM2 at 819 GB/s, ICI 1,600 Gbps per chip (= 200 GB/s),
    # 197 TFLOP/s bf16.
    "tpu-v5e": Hardware("tpu-v5e", 819 * GB, 16 * GIB, 200 * GB, 197e12,
                        source="cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e at 2,765 GB/s, ICI 4,800 Gbps per chip
    # (= 600 GB/s; the page also lists 1,200 GB/s bidirectional), 459 TFLOP/s bf16.
    "tpu-v5p": Hardware("tpu-v5p", 2765 * GB, 95 * GIB, 600 * GB, 459e12,
                        source="cloud.google.com/tpu/docs/v5p"),
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): 80 GB HBM3 at 3.35 TB/s,
    # NVLink 900 GB/s bidirectional (450 GB/s each way), 989 TFLOP/s dense bf16. An EP group of 8
    # is one NVLink/NVSwitch node.
    "h100": Hardware("h100", 3350 * GB, 80 * GB, 450 * GB, 989e12,
                     source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s bidirectional, same GH100 compute as H100 (989 TFLOP/s dense bf16).
    "h200": Hardware("h200", 4800 * GB, 141 * GB, 450 * GB, 989e12,
                     source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
}


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  vocab: int
  hidden: int  # D
  ffn: int  # F per expert
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  experts: int
  top_k: int
  dtype_bytes: int = 2
  source: str = ""

  @property
  def expert_bytes(self) -> int:
    """One expert, all layers (w1, w3, w2)."""
    return 3 * self.layers * self.hidden * self.ffn * self.dtype_bytes

  @property
  def nonexpert_params(self) -> int:
    d, h, k, hd = self.hidden, self.heads, self.kv_heads, self.head_dim
    attn = d * h * hd * 2 + d * k * hd * 2
    return 2 * self.vocab * d + self.layers * (attn + d * self.experts + 2 * d) + d

  @property
  def nonexpert_bytes(self) -> int:
    """All non-expert weights (what each worker holds: replicated)."""
    return self.nonexpert_params * self.dtype_bytes

  @property
  def nonexpert_read_bytes(self) -> int:
    """Non-expert weights read per decode step: all but the embedding table (a row gather)."""
    return (self.nonexpert_params - self.vocab * self.hidden) * self.dtype_bytes

  @property
  def kv_bytes_per_token(self) -> int:
    return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

  @property
  def params(self) -> int:
    return self.nonexpert_params + self.experts * 3 * self.layers * self.hidden * self.ffn


MODELS = {
    # mistralai/Mixtral-8x7B-v0.1 config.json
    "mixtral-8x7b": Model("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8, 128, 8, 2,
                          source="huggingface.co/mistralai/Mixtral-8x7B-v0.1/config.json"),
    # mistralai/Mixtral-8x22B-v0.1 config.json
    "mixtral-8x22b": Model("mixtral-8x22b", 32768, 6144, 16384, 56, 48, 8, 128, 8, 2,
                           source="huggingface.co/mistralai/Mixtral-8x22B-v0.1/config.json"),
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, moe_intermediate_size 768, 48 layers, 32 heads,
    # 4 KV heads, head_dim 128, 128 experts, 8 per token, vocab 151936, untied embeddings.
    "qwen3-30b-a3b": Model("qwen3-30b-a3b", 151936, 2048, 768, 48, 32, 4, 128, 128, 8,
                           source="huggingface.co/Qwen/Qwen3-30B-A3B/config.json"),
    # configs/mixtral.py tiny preset (flexfloor_jax.model.config.PRESETS['tiny']), float32.
    "tiny": Model("tiny", 259, 128, 256, 4, 4, 2, 32, 8, 2, dtype_bytes=4,
                  source="flexfloor_jax/model/config.py PRESETS['tiny']"),
}


# ----------------------------------------------------------------------------- cost models


class RooflineCost:
  """Seconds of one SPMD step from the state of the group (see the module doc)."""

  def __init__(self, model: Model, hw: Hardware):
    self.model, self.hw = model, hw

  def step_seconds(self, experts_held: np.ndarray, tokens: np.ndarray, ctx: np.ndarray,
                   attn_ctx: Optional[np.ndarray] = None) -> float:
    """experts_held, tokens (new tokens this step), ctx (cached tokens read): per active worker.
    attn_ctx: token x context products for attention FLOPs (default tokens x ctx / max(tokens,1))."""
    m, hw = self.model, self.hw
    n = len(experts_held)
    T = float(tokens.sum())
    if T <= 0:
      return hw.step_overhead_s
    hit = 1.0 - (1.0 - m.top_k / m.experts) ** T  # P(an expert gets >= 1 of the T tokens)
    dff = 3 * m.layers * m.hidden * m.ffn
    bytes_w = m.nonexpert_read_bytes + experts_held * hit * m.expert_bytes \
        + ctx * m.kv_bytes_per_token
    routed = T * m.top_k * experts_held / m.experts  # token copies served by each worker
    if attn_ctx is None:
      attn_ctx = ctx
    flops_w = (2.0 * tokens * (m.nonexpert_params - m.vocab * m.hidden) + 2.0 * routed * dff
               + 4.0 * m.layers * m.heads * m.head_dim * attn_ctx)
    t_w = np.maximum(bytes_w / hw.hbm_bw, flops_w / hw.peak_flops)
    if hw.step_table is not None and attn_ctx is ctx:  # decode (attn_ctx defaulted): measured
      t_w = hw.step_table.worker_seconds(m, experts_held, tokens, ctx)
    t = hw.step_overhead_s + float(t_w.max())
    if n > 1:
      a2a = 2.0 * m.layers * tokens * m.top_k * m.hidden * m.dtype_bytes * (n - 1) / n
      t += float(a2a.max()) / hw.link_bw + 2 * m.layers * hw.collective_latency_s
    return t

  def migrate_seconds(self, kv_bytes: float) -> float:
    return self.hw.step_overhead_s + kv_bytes / self.hw.link_bw

  def shrink_seconds(self, expert_moves: int) -> float:
    return self.hw.step_overhead_s + expert_moves * self.model.expert_bytes / self.hw.link_bw


class RooflineStepCost:
  """The policy's StepCost interface (policy/costs.py) on the roofline: one decode step of n active
  workers holding `live` sequences between them, experts spread as evenly as the placement
  spreads them (the slowest worker, with ceil(E/n), gates the step), each sequence reading
  `ctx_per_seq` cached tokens. What the time-aware floor decides on where nothing is measured."""

  name = "roofline"

  def __init__(self, model: Model, hw: Hardware, ctx_per_seq: float):
    self.roof, self.ctx = RooflineCost(model, hw), float(ctx_per_seq)
    self.name = f"roofline:{hw.name}"

  def decode_seconds(self, n_active: int, live_seqs: int) -> float:
    n, E = int(n_active), self.roof.model.experts
    held = np.full(n, E // n, float)
    held[:E % n] += 1
    tok = np.full(n, max(float(live_seqs), 1.0) / n)
    return self.roof.step_seconds(held, tok, tok * self.ctx)


@dataclasses.dataclass
class LinearCost:
  """The `cpu` hardware preset: fitted to measured step times (`fit_cpu`).

  A step's work on emulated CPU devices grows with the active workers (they share the host's
  cores) and with the expert slots each worker holds (S: the engine's expert matmul runs over all
  S preallocated slots, empty or not; S = ceil(E / floor) for flexfloor, ceil(E / N) for static)."""
  decode_dispatch: float = 0.0  # s per decode dispatch (host sync, launch)
  decode_step: float = 0.0  # s per decode step
  decode_step_worker: float = 0.0  # s per decode step per active worker
  decode_step_worker_slot: float = 0.0  # s per decode step per active worker per expert slot
  decode_slot_step: float = 0.0  # s per live decode slot per step
  prefill_step: float = 0.0  # s per prefill step
  prefill_worker: float = 0.0  # s per prefill step per active worker
  prefill_worker_slot: float = 0.0  # s per prefill step per active worker per expert slot
  release: float = 0.0  # s per release (reshard, first step on the new mesh)
  migration: float = 0.0  # s per migration round
  fitted_on: str = ""

  NAMES = ("decode_dispatch", "decode_step", "decode_step_worker", "decode_step_worker_slot",
           "decode_slot_step", "prefill_step", "prefill_worker", "prefill_worker_slot",
           "release", "migration")

  def to_dict(self):
    return dataclasses.asdict(self)


def _dispatch_rows(tl: accounting.Timeline, expert_slots: int):
  """Per step record of a timeline: LinearCost's features and the seconds it took, including
  the host gap up to the next record (where releases and migrations happen)."""
  fin_at: dict[int, int] = {}
  for f in tl.finishes:
    fin_at[f["step"]] = fin_at.get(f["step"], 0) + 1
  events = sorted([(r["t"], "release") for r in tl.releases if not r["final"]]
                  + [(m["t"], "migration") for m in tl.migrations])
  end = tl.t_end if tl.t_end is not None else tl.steps[-1]["t1"]
  S = float(expert_slots)
  X, y = [], []
  for i, r in enumerate(tl.steps):
    nxt = tl.steps[i + 1]["t0"] if i + 1 < len(tl.steps) else end
    n, k = len(r["active"]), r["num_steps"]
    x = dict.fromkeys(LinearCost.NAMES, 0.0)
    if r["kind"] == "decode":
      live, slot_steps = sum(r["live"]), 0
      for j in range(r["start"], r["start"] + k):
        slot_steps += live
        live -= fin_at.get(j, 0)
      x.update(decode_dispatch=1.0, decode_step=k, decode_step_worker=k * n,
               decode_step_worker_slot=k * n * S, decode_slot_step=slot_steps)
    else:
      x.update(prefill_step=k, prefill_worker=k * n, prefill_worker_slot=k * n * S)
    x["release"] = sum(1 for t, e in events if e == "release" and r["t1"] <= t <= nxt)
    x["migration"] = sum(1 for t, e in events if e == "migration" and r["t1"] <= t <= nxt)
    X.append([x[nm] for nm in LinearCost.NAMES])
    y.append(nxt - r["t0"])
  return np.asarray(X, float), np.asarray(y, float)


def fit_cpu(runs, name: str = "") -> LinearCost:
  """Least squares of the seconds of every dispatch (and the host gap after it) on LinearCost's
  features. runs: [(Timeline, expert slots per worker)], all from one workload; the static and
  the flexfloor rollout of it between them vary both the active workers and the expert slots
  (one rollout alone cannot tell the per-slot from the per-worker term: the fit is then the
  minimum-norm one, right only for rollouts with the same expert slots)."""
  rows = [_dispatch_rows(tl, S) for tl, S in runs]
  X = np.concatenate([r[0] for r in rows]) if rows else np.zeros((0, len(LinearCost.NAMES)))
  y = np.concatenate([r[1] for r in rows]) if rows else np.zeros(0)
  if not len(y):
    raise ValueError("no steps to fit")
  coef, *_ = np.linalg.lstsq(X, y, rcond=None)
  return LinearCost(**dict(zip(LinearCost.NAMES, map(float, coef))), fitted_on=name)


# ----------------------------------------------------------------------------- executor


class CostExecutor(stepsim.SimExecutor):
  """stepsim.SimExecutor whose clock advances by a cost model (cost=None: no time; the clock is
  then the step count). The stepping (what runs, when a dispatch stops, who finishes) is
  SimExecutor's own; only time is added, so device_steps are the same as a plain SimExecutor's
  and the engine's."""

  def __init__(self, seqs, num_workers, slots_per_worker, lengths=None, *, cost=None,
               expert_placement=None, kv_bytes_per_token: int = 1, expert_bytes: int = 0):
    super().__init__(seqs, num_workers, slots_per_worker, lengths,
                     kv_bytes_per_token=kv_bytes_per_token, expert_placement=expert_placement,
                     expert_bytes=expert_bytes)
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

  def decode(self, max_steps, stop_on_refill, stop_on_idle):
    c = self.cost
    if c is None:
      return super().decode(max_steps, stop_on_refill, stop_on_idle)
    rem, ctx = self._ctx_matrix()
    held = self._experts_held()
    k, out = super().decode(max_steps, stop_on_refill, stop_on_idle)
    if k <= 0:
      return k, out
    if isinstance(c, LinearCost):
      slot_steps = float(np.minimum(rem, k).sum())
      n, S = len(held), self._expert_slots()
      self.t += (c.decode_dispatch + k * c.decode_step + k * n * c.decode_step_worker
                 + k * n * S * c.decode_step_worker_slot + slot_steps * c.decode_slot_step)
    else:
      for j in range(k):
        live = rem > j
        self.t += c.step_seconds(held, live.sum(1).astype(float), ((ctx + j) * live).sum(1))
    return k, out

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
      s = self.cost.shrink_seconds(stats["expert_moves"])
    else:
      s = 0.0
    stats["seconds"] = float(s)
    self.t += s
    return stats


# ----------------------------------------------------------------------------- the policy


plan_rollout = plan.plan_rollout  # the runner's own placement + release policy


def replay(seqs: list[Seq], lengths: Optional[Mapping[int, int]], history, schedule: str,
           num_workers: int, slots_per_worker: int, floor: int, *, cost=None,
           model: Optional[Model] = None, steps_per_dispatch: int = 8, placement: str = "auto",
           compaction: bool = True, epoch: int = 0,
           num_experts: Optional[int] = None, sizes=None, makespan_slack: float = 0.05,
           policy_cost=None, step_cost: str = "measured"):
  """One rollout through the real policy code on a cost model -> (metrics, record).
  cost=None: one second per step (stepsim's convention). `model` sizes the expert placement
  (slots: ceil(E / floor) for flexfloor, ceil(E / N) for static, as the runner preallocates).
  `sizes`: the run's allowed active-group sizes (summary.json `release_sizes`; None = all).
  `policy_cost`: the step cost model the release policy decides on (time-aware floor); None = as
  the runner decides with `step_cost` (summary.json's): 'measured' = the step times kept in
  `history`, 'steps' = device-steps alone."""
  queues, policy, _ = plan_rollout(seqs, history, schedule, num_workers, slots_per_worker, floor,
                                   steps_per_dispatch=steps_per_dispatch, placement=placement,
                                   compaction=compaction, epoch=epoch,
                                   sizes=tuple(sizes) if sizes else None,
                                   makespan_slack=makespan_slack, cost=policy_cost,
                                   step_cost=step_cost)
  E = model.experts if model is not None else (num_experts or 8)
  slots = math.ceil(E / (floor if schedule == "flexfloor" else num_workers))
  pl = planner.ExpertPlacement.initial(E, list(range(num_workers)), slots, num_workers=num_workers)
  ex = CostExecutor(seqs, num_workers, slots_per_worker, lengths, cost=cost, expert_placement=pl,
                    kv_bytes_per_token=model.kv_bytes_per_token if model else 1,
                    expert_bytes=model.expert_bytes if model else 0)
  clock = ex.clock
  rec = controller.run(seqs, queues, ex, policy, steps_per_dispatch=steps_per_dispatch,
                       clock=clock)
  return rec.metrics(), rec


# ----------------------------------------------------------------------------- run records
# A run record (bench_out/runs/*.json) holds what replaying a measured rollout needs: its
# sequences, their actual lengths, the length history it was scheduled with, the policy fields,
# and the measured timeline.


def make_run_record(*, name: str, epoch: int, seqs: list[Seq], lengths: Mapping[int, int], history,
                    schedule: str, placement: str, compaction: bool, num_workers: int,
                    slots_per_worker: int, floor: int, steps_per_dispatch: int, num_experts: int,
                    timeline: accounting.Timeline, summary: dict) -> dict:
  keep = ("device_steps", "tokens_per_device_step", "generation_wall_s", "generated_tokens",
          "idle_after_finish_fraction", "slot_utilization", "throughput_tokens_per_s",
          "makespan_steps", "occupied_device_seconds")
  return dict(name=name, epoch=int(epoch), schedule=schedule, placement=placement, compaction=bool(compaction),
              num_workers=num_workers, slots_per_worker=slots_per_worker, floor=floor,
              steps_per_dispatch=steps_per_dispatch, num_experts=int(num_experts),
              expert_slots=math.ceil(num_experts / (floor if schedule == "flexfloor"
                                                    else num_workers)),
              seqs=[dataclasses.asdict(s) for s in seqs],
              lengths={str(k): int(v) for k, v in lengths.items()},
              history={p: {str(e): v for e, v in d.items()} for p, d in history.data.items()},
              release_sizes=summary.get("release_sizes"),
              makespan_slack=summary.get("makespan_slack", 0.05),
              step_cost=summary.get("step_cost", "measured"),
              step_seconds={str(k): v for k, v in history.step_seconds.items()},
              timeline=timeline.to_dict(), summary={k: summary[k] for k in keep if k in summary})


def load_run_record(path: str) -> dict:
  try:
    with open(path) as f:
      rec = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: cannot read run record ({e})") from None
  need = {"seqs", "lengths", "history", "schedule", "timeline", "num_workers"}
  if not isinstance(rec, dict) or not need <= set(rec):
    raise ValueError(f"{path} is not a run record (written by flexfloor_jax.bench into "
                     f"<output_dir>/runs/); it needs keys {sorted(need)}")
  return rec


def replay_record(rec: dict, cost=None, model: Optional[Model] = None):
  seqs = [Seq(**s) for s in rec["seqs"]]
  lengths = {int(k): v for k, v in rec["lengths"].items()}
  hist = scheduler.LengthHistory(rec["history"], rec.get("step_seconds"))
  return replay(seqs, lengths, hist, rec["schedule"], rec["num_workers"], rec["slots_per_worker"],
                rec["floor"], cost=cost, model=model,
                steps_per_dispatch=rec["steps_per_dispatch"],
                placement=rec.get("placement", "auto"), compaction=rec.get("compaction", True),
                epoch=rec.get("epoch", 0), num_experts=rec.get("num_experts", 8),
                sizes=rec.get("release_sizes"), makespan_slack=rec.get("makespan_slack", 0.05),
                step_cost=rec.get("step_cost", "measured"))


def fit_records(recs: list[dict], name: str = "") -> LinearCost:
  """The cpu preset fitted on measured run records (one workload: e.g. its static and flexfloor
  rollouts)."""
  return fit_cpu([(accounting.Timeline.from_dict(r["timeline"]), r.get("expert_slots", 1))
                  for r in recs], name or "+".join(str(r.get("name", "?")) for r in recs))


def predict_record(cost: LinearCost, rec: dict) -> dict:
  """Replay a measured run on the fitted cpu preset: device_steps (must match exactly: same
  policy code) and wall seconds (target: within 25%) against what was measured."""
  m, _ = replay_record(rec, cost=cost)
  measured = accounting.metrics(accounting.Timeline.from_dict(rec["timeline"]))
  return dict(name=rec.get("name"), measured_device_steps=measured["device_steps"],
              predicted_device_steps=m["device_steps"],
              device_steps_exact=measured["device_steps"] == m["device_steps"],
              measured_wall_s=measured["generation_wall_s"], predicted_wall_s=m_wall(m),
              wall_rel_error=m_wall(m) / measured["generation_wall_s"] - 1.0)


def calibrate_and_predict(fit_recs, pred_recs) -> dict:
  """Fit the cpu preset on `fit_recs` (one workload), predict each of `pred_recs` (held out)."""
  fit_recs = [fit_recs] if isinstance(fit_recs, dict) else list(fit_recs)
  pred_recs = [pred_recs] if isinstance(pred_recs, dict) else list(pred_recs)
  cost = fit_records(fit_recs)
  return dict(cpu_preset=cost.to_dict(), fit=[predict_record(cost, r) for r in fit_recs],
              predictions=[predict_record(cost, r) for r in pred_recs])


def m_wall(m: dict) -> float:
  return float(m["generation_wall_s"])


# ----------------------------------------------------------------------------- cluster scale


def floor_for(model: Model, hw: Hardware, ep: int, slots_per_worker: int,
              max_seq_len: int) -> int:
  kv = slots_per_worker * max_seq_len * model.kv_bytes_per_token
  return planner.floor_workers(model.experts, model.expert_bytes, model.nonexpert_bytes, kv,
                               int(hw.hbm_bytes), ep)


def _cluster_metrics(groups: list[dict], hold_to_end: bool) -> dict:
  """Metrics of the whole cluster (seconds) from each group's worker timeline."""
  end = max(g["metrics"]["generation_wall_s"] for g in groups)
  occ = idle = 0.0
  tokens = sum(g["metrics"]["generated_tokens"] for g in groups)
  ds = sum(g["metrics"]["device_steps"] for g in groups)
  for g in groups:
    for w in g["metrics"]["workers"]:
      rel = end if hold_to_end else w["release_s"]
      occ += rel
      idle += rel - w["local_finish_s"]
  n = sum(len(g["metrics"]["workers"]) for g in groups)
  # devices: those of groups that got work (the others go before the first step)
  return dict(devices=n, generated_tokens=tokens, device_steps=ds,
              occupied_device_seconds=occ,
              tokens_per_occupied_device_second=tokens / occ if occ else 0.0,
              idle_after_finish_fraction_seconds=idle / occ if occ else 0.0,
              generation_wall_s=end, throughput_tokens_per_s=tokens / end if end else 0.0,
              worker_releases=sum(g["metrics"]["num_worker_releases"] for g in groups))


def _group_job(job):
  """One EP group's rollout (a top-level function: it runs in worker processes)."""
  sched, gs, hist, ep, B, floor, model, hw, spd, epoch, sizes, slack, ctx, placement = job
  m, rec = replay(gs, None, hist, sched, ep, B, floor, cost=RooflineCost(model, hw), model=model,
                  steps_per_dispatch=spd, epoch=epoch, sizes=sizes, makespan_slack=slack,
                  policy_cost=RooflineStepCost(model, hw, ctx), placement=placement)
  rel = m.pop("releases", [])
  m["num_worker_releases"] = sum(len(r["workers"]) for r in rel if not r["final"])
  # for the RL step model: when each response finished, its tokens, when workers were released
  tl = rec.timeline
  m["finish_s"] = [tl.step_end_time(f["step"] + 1) - tl.t_start for f in tl.finishes]
  m["finish_tokens"] = [gs[f["seq_id"]].prompt_len + f["num_tokens"] for f in tl.finishes]
  return m


def rl_step_seconds(groups: list[dict], model: Model, hw: Hardware, floor: int,
                    released: bool) -> dict:
  """An RL step on the cluster (roofline): generation, old log-probs of every response (a
  compute-bound forward), update (~3 forwards: forward + backward); with `released`, the
  workers released during generation score finished responses meanwhile (policy/reuse.py), in
  groups of `floor` devices (the fewest that hold the model)."""
  active = model.nonexpert_params + model.top_k * 3 * model.layers * model.hidden * model.ffn
  spt = 2.0 * active / hw.peak_flops
  gen = max(g["generation_wall_s"] for g in groups)
  n = sum(len(g["workers"]) for g in groups)
  lp = reuse.logprob_phase_seconds(
      [t for g in groups for t in g["finish_s"]], [k for g in groups for k in g["finish_tokens"]],
      [w["release_s"] for g in groups for w in g["workers"]] if released else [], gen, n, spt,
      group=floor)
  update = 3.0 * lp["without"]
  return dict(gen_s=gen, logprob_s=lp["with"], update_s=update,
              step_s=gen + lp["with"] + update, scored_during_generation=lp["scored_early"])


def group_split(seqs: list[Seq], schedule: str, history, groups: int, lanes: int, ep: int,
                slack: float = 0.05, *, num_scenarios: int = 8, num_candidates: int = 16,
                seed: int = 0) -> list[list[int]]:
  """Which sequences each EP group serves (indices into `seqs`).
  static: verl's contiguous data-parallel chunks. balanced: longest predicted first onto the group
  whose list-scheduled finish (over its ep x slots lanes) grows least. flexfloor: packed from the
  last group backwards, longest first, each group's lanes up to a cap, so the first groups get
  the short work (or none), finish early and are released whole. The cap is chosen like the
  in-group placement's (scheduler.flexfloor_placement): over length scenarios drawn from the
  history, the largest packing whose mean makespan stays within `slack` of the balanced split's
  and that holds the fewest group-seconds (a group is held until its last response)."""
  if schedule == "static":
    return [list(map(int, g)) for g in np.array_split(np.arange(len(seqs)), groups)]
  # a group admits one sequence per worker per prefill step and every lane waits for it: each
  # sequence costs its group's lanes lanes/ep = slots-per-worker lane-steps on top of its length
  prefill = lanes / ep
  pred = scheduler.predict(history, seqs, quantile=0.9) + prefill
  idx = [dataclasses.replace(s, seq_id=i) for i, s in enumerate(seqs)]
  bal = scheduler.balanced_placement(idx, pred, list(range(groups)), lanes)
  if schedule == "balanced":
    return [bal[g] for g in range(groups)]
  worlds = ([np.array([d[i] for i in range(len(seqs))], float) + prefill
             for d in scheduler.sample_scenarios(history, idx, pred, num_scenarios, seed)]
            if len(history) else [pred])

  def finishes(split):
    """[scenario, group] list-scheduled finish (lane-steps) of a split; queues in split order."""
    return np.array([[planner.list_schedule_finish([], list(L[q]), lanes) if q else 0.0
                      for q in split] for L in worlds])

  bal_split = [bal[g] for g in range(groups)]
  budget = finishes(bal_split).max(axis=1).mean() * (1.0 + slack)
  order = sorted(range(len(seqs)), key=lambda i: (-pred[i], i))
  lo = float(pred.sum()) / (groups * lanes)
  hi = max(planner.list_schedule_finish([], [pred[i] for i in q], lanes) for q in bal_split)
  best = (float(finishes(bal_split).sum(axis=1).mean()), bal_split)  # balanced: always on time
  for cap in np.linspace(lo, max(lo, hi) * (1.0 + slack), num_candidates):
    packed = scheduler._pack(order, pred, list(range(groups)), lanes, float(cap))
    split = [packed[g] for g in range(groups)]
    fin = finishes(split)
    if fin.max(axis=1).mean() <= budget and fin.sum(axis=1).mean() < best[0]:
      best = (float(fin.sum(axis=1).mean()), split)
  return best[1]


SCHEDULES = plan.SCHEDULES
RUNS = SCHEDULES + ("oracle_balanced", "oracle_flexfloor")


def simulate_cluster(model: Model, hw: Hardware, devices: int, *, ep: int = 0,
                     slots_per_worker: int = workload.DEFAULT_SLOTS_PER_WORKER,
                     seqs_per_device: int = 8, samples_per_prompt: int = 8,
                     length_scale: float = 8.0, prompt_len: int = 256, epochs: int = 3,
                     steps_per_dispatch: int = 0, seed: int = 0,
                     processes: Optional[int] = None, release_sizes: str = "",
                     makespan_slack: float = 0.05) -> dict:
  """Static vs balanced vs FlexFloor on `devices` devices (dp groups of ep workers) at epoch
  `epochs - 1`, the length history of the epochs before it (workload lengths) driving the
  scheduler. The workload is policy.workload's, scaled: seqs_per_device sequences per device
  (the default rollout: 64 on 8 workers), median and cap x length_scale (cap = max_new_tokens).
  steps_per_dispatch 0 = the default rollout's 8 x length_scale: the same host-check granularity
  relative to response length (finishes and refills stop a dispatch at the exact step anyway).
  Across groups: `group_split`; inside a group, the runner's own policy (plan_rollout), its release
  policy deciding on the roofline (RooflineStepCost: the time-aware floor) and `release_sizes`.
  processes: worker processes for the groups (default: all cores; 1 = in this process)."""
  steps_per_dispatch = steps_per_dispatch or max(
      1, int(round(workload.DEFAULT_STEPS_PER_DISPATCH * length_scale)))
  ep = ep or min(devices, model.experts, 8)
  if ep > model.experts or devices % ep:
    raise ValueError(f"ep={ep} must divide devices={devices} and be <= {model.experts} experts")
  num_prompts = max(1, devices * seqs_per_device // samples_per_prompt)
  spec = workload.WorkloadSpec(num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                               seed=seed, median=workload.DEFAULT_MEDIAN * length_scale,
                               cap=int(round(workload.DEFAULT_CAP * length_scale)))
  floor = floor_for(model, hw, ep, slots_per_worker, prompt_len + spec.cap)
  sizes = planner.release_sizes(release_sizes, ep, floor)
  last = epochs - 1
  seqs = workload.make_seqs(spec, last, prompt_len=prompt_len)
  hist = scheduler.LengthHistory()
  for e in range(last):
    prev = workload.make_seqs(spec, e, prompt_len=prompt_len)
    hist.add_rollout(e, prev, {s.seq_id: s.target_len for s in prev})
  ctx = prompt_len + spec.median / 2  # mean cached tokens a live sequence reads (decode)
  # the schedules with perfect knowledge (every sequence its own prompt, whose history is its
  # actual length): what the policy and the cost model allow on these lengths. oracle_balanced's
  # makespan bounds the throughput, oracle_flexfloor's device time the tokens per device-second.
  oracle = [dataclasses.replace(s, prompt_id=f"{s.prompt_id}/{s.sample}") for s in seqs]
  known = scheduler.LengthHistory()
  known.add_rollout(last, oracle, {s.seq_id: s.target_len for s in oracle})
  # across groups the split spends the slack (group_split); inside a group of several the
  # placement is balanced's and releases keep to that group's balanced makespan, or the two
  # slacks would compound (a placement made for releasing buys little where a release must pay
  # in roofline seconds)
  inner_slack, inner_placement = (makespan_slack, "auto") if devices == ep else (0.0, "balanced")
  jobs, labels = [], []
  for label in RUNS:
    sched = label.removeprefix("oracle_")
    ss, hh = (oracle, known) if label.startswith("oracle_") else (seqs, hist)
    for g in group_split(ss, sched, hh, devices // ep, ep * slots_per_worker, ep,
                         makespan_slack, seed=last):
      if not g:  # a group given no work is released before the first step
        continue
      labels.append(label)
      jobs.append((sched, [dataclasses.replace(ss[i], seq_id=j) for j, i in enumerate(g)],
                   hh, ep, slots_per_worker, floor, model, hw, steps_per_dispatch, last, sizes,
                   inner_slack, ctx, inner_placement))
  procs = min(processes if processes is not None else (os.cpu_count() or 1), len(jobs))
  if procs > 1 and devices // ep > 1:
    import concurrent.futures
    import multiprocessing
    mp = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=mp) as pool:
      results = list(pool.map(_group_job, jobs, chunksize=max(1, len(jobs) // (4 * procs))))
  else:
    results = [_group_job(j) for j in jobs]
  groups_of = lambda label: [m for lb, m in zip(labels, results) if lb == label]
  out = {label: _cluster_metrics([dict(metrics=m) for m in groups_of(label)],
                                 hold_to_end=not label.endswith("flexfloor")) for label in RUNS}
  rl = {"static": rl_step_seconds(groups_of("static"), model, hw, floor, released=False),
        "flexfloor": rl_step_seconds(groups_of("flexfloor"), model, hw, floor, released=False),
        "flexfloor_released_logprobs": rl_step_seconds(groups_of("flexfloor"), model, hw, floor,
                                                       released=True)}
  keys = ("tokens_per_occupied_device_second", "throughput_tokens_per_s",
          "occupied_device_seconds", "generation_wall_s")
  s = out["static"]
  ratio = {k: out["flexfloor"][k] / s[k] for k in keys if s[k]}
  ratio_balanced = {k: out["balanced"][k] / s[k] for k in keys if s[k]}
  ratio_oracle = {label: {k: out[label][k] / s[k] for k in keys if s[k]}
                  for label in RUNS if label.startswith("oracle_")}
  return dict(model=model.name, hardware=hw.name, devices=devices, ep=ep, groups=devices // ep,
              floor=floor, epoch=last, workload=dataclasses.asdict(spec), prompt_len=prompt_len,
              slots_per_worker=slots_per_worker, steps_per_dispatch=steps_per_dispatch,
              release_sizes=list(sizes) if sizes else None, makespan_slack=makespan_slack,
              cost_model=RooflineStepCost(model, hw, ctx).name,
              static=s, balanced=out["balanced"], flexfloor=out["flexfloor"], ratio=ratio,
              ratio_balanced=ratio_balanced, oracle_balanced=out["oracle_balanced"],
              oracle_flexfloor=out["oracle_flexfloor"], ratio_oracle=ratio_oracle,
              rl_step=rl)


# ----------------------------------------------------------------------------- output


def format_cluster_table(rows: list[dict]) -> str:
  """One row per device count; seconds-based metrics of summary.json for the three schedules
  (wall = the rollout's makespan, every group's last response)."""
  cols = [("devices", 7, "d"), ("ep x dp", 8, "s"), ("floor", 5, "d"),
          ("tok/occ-dev-s static", 20, ".1f"), ("balanced", 9, ".1f"), ("flexfloor", 10, ".1f"),
          ("ff/st", 6, ".3f"), ("ff/bal", 6, ".3f"),
          ("wall_s static", 13, ".2f"), ("balanced", 9, ".2f"), ("flexfloor", 10, ".2f"),
          ("tok/s ff/st", 11, ".3f"), ("bal/st", 6, ".3f"), ("idle_s ff", 9, ".3f"),
          ("oracle/st tok/occ", 17, ".3f"), ("tok/s", 6, ".3f")]
  lines = [" ".join(f"{name:>{w}}" for name, w, _ in cols)]
  for r in rows:
    s, b, f = r["static"], r["balanced"], r["flexfloor"]
    k = "tokens_per_occupied_device_second"
    vals = [r["devices"], f"{r['ep']}x{r['groups']}", r["floor"], s[k], b[k], f[k],
            r["ratio"][k], f[k] / b[k] if b[k] else 0.0, s["generation_wall_s"],
            b["generation_wall_s"], f["generation_wall_s"], r["ratio"]["throughput_tokens_per_s"],
            r["ratio_balanced"]["throughput_tokens_per_s"],
            f["idle_after_finish_fraction_seconds"], r["ratio_oracle"]["oracle_flexfloor"][k],
            r["ratio_oracle"]["oracle_balanced"]["throughput_tokens_per_s"]]
    lines.append(" ".join(f"{v:>{w}{fmt}}" for (_, w, fmt), v in zip(cols, vals)))
  return "\n".join(lines)


def _atomic_savefig(fig, path: str):
  with atomic_open(path, "wb") as f:
    fig.savefig(f, format="png", dpi=110)


def atomic_write_text(path: str, text: str):
  atomic_write(path, text)


def plot_cluster(rows: list[dict], path: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  xs = [r["devices"] for r in rows]
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
  a.plot(xs, [r["static"]["tokens_per_occupied_device_second"] for r in rows], "o-",
         label="static")
  a.plot(xs, [r["flexfloor"]["tokens_per_occupied_device_second"] for r in rows], "s-",
         label="flexfloor")
  a.set_xscale("log", base=2)
  a.set_xlabel("devices")
  a.set_ylabel("tokens / occupied device-second")
  a.legend()
  b.plot(xs, [r["ratio"]["tokens_per_occupied_device_second"] for r in rows], "o-",
         label="tokens / occupied device-s")
  b.plot(xs, [r["ratio"]["throughput_tokens_per_s"] for r in rows], "s--", label="throughput")
  b.axhline(1.654, color="gray", ls=":", label="paper 1.654")
  b.set_xscale("log", base=2)
  b.set_xlabel("devices")
  b.set_ylabel("flexfloor / static")
  b.legend(fontsize=8)
  r0 = rows[0]
  fig.suptitle(f"{r0['model']} on {r0['hardware']} (ep={r0['ep']}, floor {r0['floor']}, "
               f"epoch {r0['epoch']})")
  fig.tight_layout()
  try:
    _atomic_savefig(fig, path)
  finally:
    plt.close(fig)
  return path


# ----------------------------------------------------------------------------- CLI


def main(argv=None):
  from absl import app, flags  # noqa: F401  (absl imports no jax)
  del argv
  F = flags.FLAGS
  if F.calibrate or F.predict:
    if not (F.calibrate and F.predict):
      print("error: --calibrate and --predict go together (run records, comma-separated)",
            file=sys.stderr)
      sys.exit(2)
    try:
      fit = [load_run_record(p) for p in F.calibrate.split(",") if p]
      pred = [load_run_record(p) for p in F.predict.split(",") if p]
      r = calibrate_and_predict(fit, pred)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(format_calibration(r))
    ok = all(p["device_steps_exact"] and abs(p["wall_rel_error"]) <= 0.25
             for p in r["predictions"])
    return 0 if ok else 1
  if F.model not in MODELS:
    print(f"error: --model must be one of {sorted(MODELS)}, got {F.model!r}", file=sys.stderr)
    sys.exit(2)
  if F.hardware.startswith("measured:"):  # a step table of scripts/device_check.sh
    from flexfloor_jax.policy import measured_hw
    try:
      HARDWARE[F.hardware] = measured_hw.load_hardware(F.hardware[len("measured:"):], HARDWARE,
                                                       MODELS[F.model])
    except ValueError as e:
      print(f"error: --hardware: {e}", file=sys.stderr)
      sys.exit(2)
  if F.hardware not in HARDWARE:
    print(f"error: --hardware must be one of {sorted(HARDWARE)} (cpu: use --calibrate), got "
          f"{F.hardware!r}", file=sys.stderr)
    sys.exit(2)
  model, hw = MODELS[F.model], HARDWARE[F.hardware]
  try:
    devs = [int(x) for x in F.devices.split(",") if x.strip()]
  except ValueError:
    print(f"error: --devices must be a comma-separated list of ints, got {F.devices!r}",
          file=sys.stderr)
    sys.exit(2)
  rows = []
  for d in devs:
    try:
      rows.append(simulate_cluster(model, hw, d, ep=F.ep, slots_per_worker=F.slots_per_worker,
                                   length_scale=F.length_scale, prompt_len=F.prompt_len,
                                   epochs=F.epochs, seed=F.seed,
                                   steps_per_dispatch=F.steps_per_dispatch,
                                   release_sizes=F.release_sizes,
                                   makespan_slack=F.makespan_slack))
    except (ValueError, planner.FloorError) as e:
      print(f"error: {d} devices: {e}", file=sys.stderr)
      sys.exit(2)
  r0 = rows[0]
  print(f"{model.name} ({model.params / 1e9:.1f}B params, {model.experts} experts top-"
        f"{model.top_k}) on {hw.name} ({hw.hbm_bw / GB:.0f} GB/s HBM, {hw.hbm_bytes / GIB:.0f} GiB,"
        f" {hw.link_bw / GB:.0f} GB/s link; {hw.source}); workload: {F.slots_per_worker} slots x "
        f"8 seqs per device, median {r0['workload']['median']:.0f} cap {r0['workload']['cap']} "
        f"tokens, prompt {F.prompt_len}, {r0['steps_per_dispatch']} steps per dispatch, epoch "
        f"{r0['epoch']} (history of {r0['epoch']} epochs)")
  print(format_cluster_table(rows))
  print("RL step = generation + old log-probs + update (~3 forwards), roofline seconds; "
        "+reuse: released workers score finished responses during generation")
  for r in rows:
    q = r["rl_step"]
    st, fl, re = q["static"], q["flexfloor"], q["flexfloor_released_logprobs"]
    print(f"  {r['devices']:>5} devices: static {st['step_s']:.2f} s, flexfloor "
          f"{fl['step_s']:.2f} s (log-probs {fl['logprob_s']:.3f} s), +reuse {re['step_s']:.2f} s "
          f"(log-probs {re['logprob_s']:.3f} s, {re['scored_during_generation']:.0%} scored during "
          f"generation): step time x{fl['step_s'] / re['step_s']:.3f}")
  out = F.output_dir
  os.makedirs(out, exist_ok=True)
  atomic_write_text(os.path.join(out, "sim.json"), json.dumps(rows, indent=2))
  plot_cluster(rows, os.path.join(out, "sim.png"))
  print(f"wrote {os.path.join(out, 'sim.json')} and {os.path.join(out, 'sim.png')}")
  return 0


def format_calibration(r: dict) -> str:
  c = r["cpu_preset"]
  lines = [f"cpu preset, least squares on {c['fitted_on']}:",
           "  " + ", ".join(f"{k}={c[k] * 1e3:.3f}ms" for k in LinearCost.NAMES)]
  for tag, rows in (("fit", r["fit"]), ("held out", r["predictions"])):
    for p in rows:
      lines.append(f"  {tag:8} {p['name']:>16}: device_steps measured {p['measured_device_steps']}"
                   f" predicted {p['predicted_device_steps']} "
                   f"({'exact' if p['device_steps_exact'] else 'MISMATCH'}); wall measured "
                   f"{p['measured_wall_s']:.2f} s predicted {p['predicted_wall_s']:.2f} s "
                   f"({p['wall_rel_error'] * 100:+.1f}%)")
  return "\n".join(lines)


def _define_flags():
  from absl import flags
  flags.DEFINE_string("model", "mixtral-8x7b", f"model preset: {', '.join(MODELS)}")
  flags.DEFINE_string("hardware", "tpu-v5p", f"hardware preset: {', '.join(HARDWARE)}")
  flags.DEFINE_string("devices", "8,64,256,1024", "comma-separated device counts")
  flags.DEFINE_integer("ep", 0, "EP group size (workers per group); 0 = min(devices, E, 8)")
  flags.DEFINE_integer("slots_per_worker", workload.DEFAULT_SLOTS_PER_WORKER,
                       "decode slots per worker")
  flags.DEFINE_float("length_scale", 8.0, "response lengths x this (median 64, cap 256 at 1)")
  flags.DEFINE_integer("prompt_len", 256, "prompt tokens per sequence")
  flags.DEFINE_integer("epochs", 3, "simulate epoch epochs-1 with the history of the ones before")
  flags.DEFINE_integer("seed", 0, "workload seed")
  flags.DEFINE_integer("steps_per_dispatch", 0, "decode steps between host checks; 0 = 8 x "
                       "length_scale (the default rollout's granularity)")
  flags.DEFINE_string("output_dir", "sim_out", "where sim.json and sim.png go")
  flags.DEFINE_string("release_sizes", "", "active-group sizes a release may leave inside a "
                      "group: '' = every size | 'pow2' | a comma list (scheduler.release_sizes)")
  flags.DEFINE_float("makespan_slack", 0.05, "flexfloor's makespan may exceed balanced's "
                     "predicted one by this fraction (scheduler.makespan_slack)")
  flags.DEFINE_string("calibrate", "", "run records (bench_out/runs/*.json, comma-separated) of "
                      "one workload to fit the cpu preset on")
  flags.DEFINE_string("predict", "", "run records (comma-separated) to predict with the fitted "
                      "cpu preset (target: device_steps exact, wall within 25%)")


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
