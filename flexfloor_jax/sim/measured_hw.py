"""Measured decode-step times as a simulator hardware preset (`--hardware=measured:FILE`). numpy
only.

`scripts/device_check.sh` times this project's real decode step (transformer.decode with the
expert-parallel MoE layer, ep_moe) on one accelerator for a Mixtral-shaped layer stack, as a
function of the experts the device holds (emulating one worker of an n-way EP group: E/n experts'
weights, the token copies routed to them), the decode batch on the device, and the KV length, and
writes the table as JSON (`scripts/step_table.py`). This module parses and validates that file and
turns it into per-worker step seconds for the simulator (sim.costs.RooflineCost hands a decode
step's per-worker time to `StepTable.worker_seconds` when the hardware carries a table).

File format (JSON object; `format` and `version` identify it):
  format            "flexfloor_jax.step_table"
  version           1
  device            what timed it (e.g. "NVIDIA H200"); platform ("gpu" | "tpu" | "cpu")
  jax_version, created, dtype ("bfloat16" | "float32" | ...)
  model             {hidden, ffn, heads, kv_heads, head_dim, experts, top_k, vocab}: the layer the
                    table was measured on (sim.presets.Model field names); a simulated model
                    must match it except for vocab and layers
  layers_timed      how many layers the timed stack had (per-layer seconds = (step - fixed) / it)
  sim_base_preset   the simulator preset (sim.presets.HARDWARE) that supplies what one device cannot
                    measure: interconnect bandwidth and latency, HBM capacity (the floor), and the
                    roofline of prefill steps
  measured          optional {hbm_bw (bytes/s, device-to-device copy), peak_flops (bf16 matmul
                    FLOP/s)}: replace the base preset's figures where given
  engine            optional: how the step was run (moe_backend, decode_tile_m, chunk_tokens, ...)
  fixed             optional [{batch, seconds}]: the per-step work outside the layer stack
                    (embedding gather, final norm, lm_head over `model.vocab`, argmax)
  rows              [{experts_per_device, batch, kv_len, seconds_per_layer, ...}]: a full grid over
                    the distinct values of the three keys (every combination exactly once);
                    extra keys (step_seconds, repeats, ...) are kept but not used

Step time of one worker holding e experts with B live sequences that read ctx cached tokens in all:
  seconds_per_layer(e, B, kv = ctx / B) x model.layers + fixed(B) x model.vocab / table vocab
interpolated piecewise-linearly along each axis (trilinear on the grid). Beyond the measured
range: e is clamped (e <= E anyway); B below the smallest measured batch takes its value (a small
decode batch is bound by reading weights, nearly flat in B), above the largest continues the last
segment; kv continues the end segments on both sides (attention work is linear in the cached
tokens read), at kv >= 0 and never below 0 seconds. The all_to_all, step overhead, releases and
migrations stay the base preset's roofline terms (sim.costs.RooflineCost).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any, Literal, overload

import numpy as np

FORMAT = "flexfloor_jax.step_table"
VERSION = 1
MODEL_KEYS = ("hidden", "ffn", "heads", "kv_heads", "head_dim", "experts", "top_k")
AXES = ("experts_per_device", "batch", "kv_len")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class TableError(ValueError):
  """A step table that cannot be used; the message names the file and the field."""


def _err(path: str, field: str, msg: str) -> TableError:
  return TableError(f"{path}: {field}: {msg}")


@overload
def _num(path, field, v, *, integer: Literal[True], positive: bool = True) -> int: ...


@overload
def _num(path, field, v, *, integer: Literal[False] = False, positive: bool = True) -> float: ...


def _num(path, field, v, *, integer: bool = False, positive: bool = True) -> int | float:
  ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  if ok and integer:
    ok = float(v) == int(v)
  if not ok:
    raise _err(path, field, f"must be a finite {'integer' if integer else 'number'}, got {v!r}")
  if positive and v <= 0:
    raise _err(path, field, f"must be > 0, got {v!r}")
  return int(v) if integer else float(v)


def _bracket(grid: np.ndarray, x: np.ndarray, below: str, above: str):
  """(i0, i1, w): x ~ grid[i0] + w (grid[i1] - grid[i0]). Linear between neighbours; beyond an end
  'clamp' holds the end value, 'extend' continues the end segment (w < 0 or > 1)."""
  n = len(grid)
  if n == 1:
    z = np.zeros(x.shape, int)
    return z, z, np.zeros(x.shape)
  i1 = np.clip(np.searchsorted(grid, x, side="right"), 1, n - 1)
  i0 = i1 - 1
  w = (x - grid[i0]) / (grid[i1] - grid[i0])
  if below == "clamp":
    w = np.where(x < grid[0], 0.0, w)
  if above == "clamp":
    w = np.where(x > grid[-1], 1.0, w)
  return i0, i1, w


@dataclasses.dataclass(frozen=True, eq=False)
class StepTable:
  """A validated step table (see the module doc). Build with `parse` or `load`."""
  path: str
  meta: Mapping[str, Any]  # the whole file, as read
  model: Mapping[str, int]
  layers_timed: int
  experts: np.ndarray  # sorted grid values of each axis
  batches: np.ndarray
  kv_lens: np.ndarray
  seconds: np.ndarray  # [len(experts), len(batches), len(kv_lens)] seconds per layer
  fixed_batches: np.ndarray  # [m] (empty: no fixed part)
  fixed_seconds_: np.ndarray  # [m]

  # -- lookups
  def seconds_per_layer(self, experts_per_device, batch, kv_len) -> np.ndarray:
    """Interpolated seconds of one layer (arrays broadcast)."""
    e, b, kv = np.broadcast_arrays(*(np.asarray(a, float) for a in
                                     (experts_per_device, batch, kv_len)))
    ie0, ie1, we = _bracket(self.experts, e, "clamp", "clamp")
    ib0, ib1, wb = _bracket(self.batches, b, "clamp", "extend")
    ik0, ik1, wk = _bracket(self.kv_lens, np.maximum(kv, 0.0), "extend", "extend")
    out = np.zeros(e.shape)
    for ie, fe in ((ie0, 1 - we), (ie1, we)):
      for ib, fb in ((ib0, 1 - wb), (ib1, wb)):
        for ik, fk in ((ik0, 1 - wk), (ik1, wk)):
          out = out + fe * fb * fk * self.seconds[ie, ib, ik]
    return np.maximum(out, 0.0)

  def fixed_seconds(self, batch) -> np.ndarray:
    """Per-step seconds outside the layer stack at this batch (0 when the table has none)."""
    b = np.asarray(batch, float)
    if len(self.fixed_batches) == 0:
      return np.zeros(b.shape)
    i0, i1, w = _bracket(self.fixed_batches, b, "clamp", "extend")
    return np.maximum((1 - w) * self.fixed_seconds_[i0] + w * self.fixed_seconds_[i1], 0.0)

  def worker_seconds(self, model, experts_held, tokens, ctx) -> np.ndarray:
    """Seconds of one decode step's device work per worker: experts held, live sequences and
    cached tokens read (in all) by each; `model` a sim.presets.Model (layers, vocab scale the
    table)."""
    held = np.asarray(experts_held, float)
    tok = np.asarray(tokens, float)
    kv = np.where(tok > 0, np.asarray(ctx, float) / np.maximum(tok, 1e-12), self.kv_lens[0])
    per_layer = self.seconds_per_layer(held, tok, kv)
    v = getattr(model, "vocab", None)
    scale = v / self.model["vocab"] if v and self.model.get("vocab") else 1.0
    return per_layer * int(model.layers) + self.fixed_seconds(tok) * scale

  def check_model(self, model) -> None:
    """Raise TableError unless `model` (a sim.presets.Model) has the dimensions the table was
    measured on (vocab and layer count may differ: the table scales them)."""
    diff = [f"{k} {getattr(model, k, None)} (table {self.model[k]})" for k in MODEL_KEYS
            if getattr(model, k, None) != self.model[k]]
    want = DTYPE_BYTES.get(str(self.meta.get("dtype")))
    if want is not None and getattr(model, "dtype_bytes", want) != want:
      diff.append(f"dtype_bytes {model.dtype_bytes} (table {self.meta['dtype']})")
    if diff:
      raise _err(self.path, "model", f"measured on another layer shape than model "
                 f"{getattr(model, 'name', '?')!r}: " + ", ".join(diff))

  def headline(self, batch: int, kv_len: int) -> dict:
    """{experts_per_device: seconds_per_layer} at one measured (batch, kv_len)."""
    return {int(e): float(self.seconds_per_layer(e, batch, kv_len)) for e in self.experts}


def parse(obj: Any, path: str = "<table>") -> StepTable:
  """Validate a decoded step-table JSON object; TableError names the file and the field."""
  if not isinstance(obj, dict):
    raise _err(path, "(top level)", f"must be a JSON object, got {type(obj).__name__}")
  if obj.get("format") != FORMAT:
    raise _err(path, "format", f"must be {FORMAT!r}, got {obj.get('format')!r}")
  if obj.get("version") != VERSION:
    raise _err(path, "version", f"must be {VERSION}, got {obj.get('version')!r}")
  m = obj.get("model")
  if not isinstance(m, dict):
    raise _err(path, "model", f"must be an object with {', '.join(MODEL_KEYS)}, got {m!r}")
  model = {k: _num(path, f"model.{k}", m.get(k), integer=True) for k in MODEL_KEYS}
  if m.get("vocab") is not None:
    model["vocab"] = _num(path, "model.vocab", m["vocab"], integer=True)
  if model["top_k"] > model["experts"]:
    raise _err(path, "model.top_k", f"{model['top_k']} > experts {model['experts']}")
  layers_timed = _num(path, "layers_timed", obj.get("layers_timed"), integer=True)
  base = obj.get("sim_base_preset")
  if not isinstance(base, str) or not base:
    raise _err(path, "sim_base_preset", f"must name a simulator preset, got {base!r}")
  meas = obj.get("measured", {})
  if not isinstance(meas, dict):
    raise _err(path, "measured", f"must be an object, got {meas!r}")
  for k in ("hbm_bw", "peak_flops"):
    if meas.get(k) is not None:
      _num(path, f"measured.{k}", meas[k])

  rows = obj.get("rows")
  if not isinstance(rows, list) or not rows:
    raise _err(path, "rows", "must be a non-empty list of {experts_per_device, batch, kv_len, "
               "seconds_per_layer}")
  pts = {}
  for i, r in enumerate(rows):
    if not isinstance(r, dict):
      raise _err(path, f"rows[{i}]", f"must be an object, got {r!r}")
    key = tuple(_num(path, f"rows[{i}].{a}", r.get(a), integer=True) for a in AXES)
    if key[0] > model["experts"]:
      raise _err(path, f"rows[{i}].experts_per_device",
                 f"{key[0]} > model.experts {model['experts']}")
    s = _num(path, f"rows[{i}].seconds_per_layer", r.get("seconds_per_layer"))
    if key in pts:
      raise _err(path, f"rows[{i}]", f"duplicate point {dict(zip(AXES, key, strict=True))}")
    pts[key] = s
  grids = [np.array(sorted({k[j] for k in pts}), float) for j in range(3)]
  missing = [dict(zip(AXES, (int(e), int(b), int(k)), strict=True))
             for e in grids[0] for b in grids[1]
             for k in grids[2] if (int(e), int(b), int(k)) not in pts]
  if missing:
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    raise _err(path, "rows", f"not a full grid over experts_per_device x batch x kv_len: missing "
               f"{missing[:3]}{more}")
  sec = np.array([[[pts[(int(e), int(b), int(k))] for k in grids[2]] for b in grids[1]]
                  for e in grids[0]])

  fixed = obj.get("fixed", [])
  if not isinstance(fixed, list):
    raise _err(path, "fixed", f"must be a list of {{batch, seconds}}, got {fixed!r}")
  fx = {}
  for i, r in enumerate(fixed):
    if not isinstance(r, dict):
      raise _err(path, f"fixed[{i}]", f"must be an object, got {r!r}")
    b = _num(path, f"fixed[{i}].batch", r.get("batch"), integer=True)
    if b in fx:
      raise _err(path, f"fixed[{i}].batch", f"duplicate batch {b}")
    fx[b] = _num(path, f"fixed[{i}].seconds", r.get("seconds"), positive=False)
    if fx[b] < 0:
      raise _err(path, f"fixed[{i}].seconds", f"must be >= 0, got {fx[b]}")
  fb = np.array(sorted(fx), float)
  return StepTable(path=path, meta=obj, model=model, layers_timed=layers_timed,
                   experts=grids[0], batches=grids[1], kv_lens=grids[2], seconds=sec,
                   fixed_batches=fb, fixed_seconds_=np.array([fx[int(b)] for b in fb], float))


def load(path: str) -> StepTable:
  """Read and validate a step-table file (TableError on anything wrong, naming file and field)."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise TableError(f"{path}: cannot read: {e.strerror or e}") from None
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise TableError(f"{path}: not JSON: {e}") from None
  return parse(obj, path)


def load_hardware(path: str, presets: Mapping[str, Any], model=None):
  """The simulator hardware for `--hardware=measured:FILE`: the table's base preset (a frozen
  sim.presets.Hardware from `presets`) with the table attached (`step_table`), renamed, and its HBM
  bandwidth and peak FLOP/s replaced by the measured ones where the file has them. With `model`
  (a sim.presets.Model), also checks that the table was measured on that model's layer shape."""
  table = load(path)
  base = table.meta["sim_base_preset"]
  if base not in presets:
    raise _err(path, "sim_base_preset", f"{base!r} is not a simulator preset "
               f"({', '.join(sorted(presets))})")
  if model is not None:
    table.check_model(model)
  hw = presets[base]
  meas = table.meta.get("measured", {})
  dev = table.meta.get("device", "?")
  return dataclasses.replace(
      hw, name=f"measured:{os.path.basename(path)}", step_table=table,
      hbm_bw=float(meas.get("hbm_bw") or hw.hbm_bw),
      peak_flops=float(meas.get("peak_flops") or hw.peak_flops),
      source=f"decode steps measured on {dev} ({path}); link, memory and prefill: {base} "
             f"({hw.source})")


def describe(table: StepTable, batch: int | None = None, kv_len: int | None = None) -> str:
  """One line: device, and seconds per layer by experts held at one (batch, kv_len)."""
  b = int(batch if batch is not None else table.batches[min(1, len(table.batches) - 1)])
  k = int(kv_len if kv_len is not None else table.kv_lens[0])
  h = table.headline(b, k)
  return (f"{table.meta.get('device', '?')}: ms per layer at batch {b}, kv {k}, by experts held: "
          + ", ".join(f"{e}: {s * 1e3:.3f}" for e, s in h.items()))
