"""Seconds of a simulated step: the roofline model of an accelerator, and the linear model of
emulated CPU devices fitted to measured timelines.

Roofline (`RooflineCost`), one SPMD step on an EP group of n active workers:
  per worker w:  t_w = max(bytes_w / HBM bandwidth, flops_w / peak flops)
     bytes_w = non-expert weights (replicated; all read every step)
             + experts held by w that at least one token of the step is routed to (expected
               number under uniform top-k routing) x bytes of one expert
             + KV bytes of w's live sequences (every cached token of every live slot is read;
               a sliding-window layer only its window's: Model.kv_read_bytes)
  all_to_all:   t_a2a = max_w (dispatch + combine bytes leaving w) / interconnect bandwidth
                        + 2 collectives x layers x collective latency        (0 when n = 1)
  step time   = fixed step overhead + max_w t_w + t_a2a
A mixed step (chunked prefill: `mixed_seconds`) runs, beside each worker's live rows, c_w input
tokens whose sequences hold p_w tokens before them: its new tokens are rows + c_w (dense FLOPs,
routed copies, the experts the step's tokens touch and the all_to_all all grow with them), it
reads the chunk's prefix and the chunk's own KV (p_w + c_w tokens) beside the rows' caches, and
the chunk's causal attention is c_w x p_w + c_w^2 / 2 token-context products (exact for a chunk
within one sequence, an upper bound for one spanning several). With no input tokens it is the
decode step; with no live rows and p_w = 0 the one-shot prefill step of c_w tokens (but for
a sliding window's read, which a prefill step bounds by its tokens' windows).
Memory/compute of a worker overlap (max); the all_to_all does not overlap them (sum): in a decode
step the expert matmul of a layer needs its dispatched tokens and the next layer needs the
combined output, so nothing is left to hide it behind. The slowest worker gates the SPMD step
(max over workers). A release costs a switch and barrier (`release_latency_s`) and the moved
experts' bytes point to point (`p2p_bw`, what one device achieves to one other, not the link's
aggregate), spread over the survivors; a migration its KV bytes point to point.

`cpu` hardware (`LinearCost`): fitted by least squares to the measured timelines of one workload
(`fit_cpu`; its static and flexfloor rollouts): decode dispatch seconds ~ dispatch + steps +
steps x active workers (x expert slots) + live slot-steps, prefill ~ steps + steps x active
workers (x expert slots), plus a cost per release and per migration. Emulated CPU devices share
the host's cores, so a CPU step costs more with more active workers (the opposite of a real
accelerator, where fewer workers holding more experts each are slower per step).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flexfloor_jax.policy import accounting
from flexfloor_jax.sim.presets import Hardware, Model, parse_cost_model


class RooflineCost:
  """Seconds of one SPMD step from the state of the group (the roofline of the module doc)."""

  def __init__(self, model: Model, hw: Hardware):
    self.model, self.hw = model, hw

  def step_seconds(self, experts_held: np.ndarray, tokens: np.ndarray, ctx: np.ndarray,
                   attn_ctx: np.ndarray | None = None) -> float:
    """experts_held, tokens (new tokens this step), ctx (cached tokens read): per active worker.
    attn_ctx: token x context products for attention FLOPs (default ctx: each new token attends
    over its own sequence's cache). A step with attn_ctx given is a prefill, never looked up in a
    measured step table."""
    m, hw = self.model, self.hw
    n = len(experts_held)
    T = float(tokens.sum())
    if T <= 0:
      return hw.step_overhead_s
    hit = 1.0 - (1.0 - m.top_k / m.experts) ** T  # the chance an expert gets >= 1 of the T tokens
    bytes_w = m.nonexpert_read_bytes + experts_held * hit * m.expert_bytes \
        + m.kv_read_bytes(tokens, ctx)
    routed = T * m.top_k * experts_held / m.experts  # token copies served by each worker
    if attn_ctx is None:
      attn_ctx = ctx
    flops_w = (2.0 * tokens * m.nonexpert_read_params + 2.0 * routed * m.expert_params
               + m.attn_flops_per_ctx_token * attn_ctx)
    t_w = np.maximum(bytes_w / hw.hbm_bw, flops_w / hw.peak_flops)
    if hw.step_table is not None and attn_ctx is ctx:  # decode (attn_ctx defaulted): measured
      t_w = hw.step_table.worker_seconds(m, experts_held, tokens, ctx)
    t = hw.step_overhead_s + float(t_w.max())
    if n > 1:
      a2a = 2.0 * m.layers * tokens * m.top_k * m.hidden * m.dtype_bytes * (n - 1) / n
      t += float(a2a.max()) / hw.link_bw + 2 * m.layers * hw.collective_latency_s
    return t

  def mixed_seconds(self, experts_held: np.ndarray, rows: np.ndarray, kv: np.ndarray,
                    chunk: np.ndarray, past: np.ndarray) -> float:
    """A decode step of `rows` live rows reading `kv` cached tokens per active worker in which
    each worker also runs `chunk` input tokens whose sequences hold `past` tokens before them
    (module doc). A measured step table prices the decode part; the input tokens add what
    they add on the roofline."""
    rows, kv = np.asarray(rows, float), np.asarray(kv, float)
    chunk, past = np.asarray(chunk, float), np.asarray(past, float)
    if not chunk.any():
      return self.step_seconds(experts_held, rows, kv)
    m, hw = self.model, self.hw
    n = len(experts_held)
    tokens = rows + chunk
    T = float(tokens.sum())
    segs = (chunk > 0).astype(float)  # the chunk's sequences, for the sliding window's read
    bytes_kv = m.kv_read_bytes(rows, kv) + m.kv_read_bytes(segs, past + chunk)
    attn = kv + chunk * past + chunk * chunk / 2
    t_w = self._worker_seconds(experts_held, tokens, T, bytes_kv, attn)
    if hw.step_table is not None:  # measured decode, plus what the input tokens add
      decode = self._worker_seconds(experts_held, rows, float(rows.sum()),
                                    m.kv_read_bytes(rows, kv), kv)
      t_w = hw.step_table.worker_seconds(m, experts_held, rows, kv) + np.maximum(t_w - decode,
                                                                                 0.0)
    t = hw.step_overhead_s + float(t_w.max())
    if n > 1:
      a2a = 2.0 * m.layers * tokens * m.top_k * m.hidden * m.dtype_bytes * (n - 1) / n
      t += float(a2a.max()) / hw.link_bw + 2 * m.layers * hw.collective_latency_s
    return t

  def _worker_seconds(self, experts_held, tokens, T: float, kv_bytes, attn) -> np.ndarray:
    """Per worker max(bytes / HBM, FLOPs / peak) of a step whose group runs T new tokens, the
    worker `tokens` of them, reading `kv_bytes` of KV for `attn` token-context products."""
    m, hw = self.model, self.hw
    hit = 1.0 - (1.0 - m.top_k / m.experts) ** T
    bytes_w = m.nonexpert_read_bytes + experts_held * hit * m.expert_bytes + kv_bytes
    routed = T * m.top_k * experts_held / m.experts
    flops_w = (2.0 * tokens * m.nonexpert_read_params + 2.0 * routed * m.expert_params
               + m.attn_flops_per_ctx_token * attn)
    return np.maximum(bytes_w / hw.hbm_bw, flops_w / hw.peak_flops)

  @property
  def p2p_bw(self) -> float:
    return self.hw.p2p_bw or self.hw.link_bw

  def migrate_seconds(self, kv_bytes: float) -> float:
    """A migration round: the KV bytes point to point (one source's rows to their destinations,
    at worst one pair at a time), after a launch."""
    return self.hw.step_overhead_s + kv_bytes / self.p2p_bw

  def shrink_seconds(self, expert_moves: int, survivors: int = 1) -> float:
    """A release: the switch and barrier, then the moved experts point to point; the moves spread
    over the survivors, each receiving ceil(moves / survivors) experts one after the other."""
    per_device = -(-int(expert_moves) // max(1, int(survivors)))
    return self.hw.release_latency_s + per_device * self.model.expert_bytes / self.p2p_bw


class RooflineStepCost:
  """The policy's StepCost interface (policy/costs.py) on the roofline: one decode step of n active
  workers holding `live` sequences between them, experts spread as evenly as the placement
  spreads them (the slowest worker, with ceil(E/n), gates the step), each sequence reading
  `ctx_per_seq` cached tokens. What the time-aware floor decides on where nothing is measured."""

  name = "roofline"

  def __init__(self, model: Model, hw: Hardware, ctx_per_seq: float):
    self.roof, self.ctx = RooflineCost(model, hw), float(ctx_per_seq)
    self.name = f"roofline:{model.name}@{hw.name}"
    self._held_by_n: dict[int, np.ndarray] = {}  # the simulator asks for a few sizes, often

  def _held(self, n: int) -> np.ndarray:
    held = self._held_by_n.get(n)
    if held is None:
      E = self.roof.model.experts
      held = np.full(n, E // n, float)
      held[:E % n] += 1
      held.setflags(write=False)
      self._held_by_n[n] = held
    return held

  def decode_seconds(self, n_active: int, live_seqs: int) -> float:
    n = int(n_active)
    tok = np.full(n, max(float(live_seqs), 1.0) / n)
    return self.roof.step_seconds(self._held(n), tok, tok * self.ctx)

  def worker_step_seconds(self, rows_w: np.ndarray, kv_w: np.ndarray) -> float:
    rows_w = np.asarray(rows_w, float)
    return self.roof.step_seconds(self._held(len(rows_w)), rows_w, np.asarray(kv_w, float))

  def prefill_seconds(self, prompt_w: np.ndarray) -> float:
    tok = np.asarray(prompt_w, float)
    # causal attention over the prompt: ~P^2/2 token-context products; KV read = the prompt
    return self.roof.step_seconds(self._held(len(tok)), tok, tok, tok * tok / 2)

  def mixed_seconds(self, rows_w: np.ndarray, kv_w: np.ndarray, chunk_w: np.ndarray,
                    past_w: np.ndarray) -> float:
    return self.roof.mixed_seconds(self._held(len(rows_w)), rows_w, kv_w, chunk_w, past_w)


def named_step_cost(text: str, seqs) -> RooflineStepCost:
  """scheduler.step_cost 'roofline:MODEL@HARDWARE' as the StepCost a rollout of `seqs` decides on
  (the runner) and is replayed with (the bench): the named pair's roofline, a live row reading
  its prompt and a quarter of its cap on average."""
  model, hw = parse_cost_model(text)
  ctx = sum(s.prompt_len + s.max_new_tokens / 4 for s in seqs) / max(1, len(seqs))
  return RooflineStepCost(model, hw, ctx)


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
    x: dict[str, float] = dict.fromkeys(LinearCost.NAMES, 0.0)
    if r["kind"] == "decode":
      live, slot_steps = sum(r["live"]), 0
      for j in range(r["start"], r["start"] + k):
        slot_steps += live
        live -= fin_at.get(j, 0)
      if r.get("chunk"):  # chunked prefill: rows also turn live inside the dispatch
        slot_steps = int(accounting.dispatch_steps(tl, r)["rows"].sum())
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
  return LinearCost(**dict(zip(LinearCost.NAMES, map(float, coef), strict=True)), fitted_on=name)

