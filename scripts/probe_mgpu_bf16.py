"""Probe: the compiled Mosaic GPU grouped matmul against float64, per output dtype, layout and K.

  python scripts/probe_mgpu_bf16.py          # on a GPU (Hopper): f32 / bf16 out, kn / nk, K
  python scripts/probe_mgpu_bf16.py 384,4096 # bf16, kn, these K

Written after the first device check (2026-12-04, H200): the kernel matched float64 to 1e-5 with
fp32 output, but its d_lhs (bf16 output, transposed weights, K=384) was 1.3% (relative norm) off
the XLA path's. Prints, for each case, ||out - ref|| / ||ref|| of both paths against float64 and
the worst tile of each, so a layout- or dtype-specific error shows where it is.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flexfloor_jax.kernels.dispatch_plan import make_plan, padded_rows  # noqa: E402
from flexfloor_jax.kernels.grouped_matmul import grouped_matmul  # noqa: E402

_gmm = jax.jit(grouped_matmul, static_argnames=("tile_m", "impl", "preferred_element_type",
                                                "transpose_rhs"))


def case(seed, rows, groups, tile_m, k, n, transpose_rhs, out_dtype):
  rng = np.random.default_rng(seed)
  ids = rng.choice(groups, rows).astype(np.int32)
  ids[rng.random(rows) < 0.1] = -1
  plan = make_plan(jnp.asarray(ids), groups, tile_m, padded_rows(rows, groups, tile_m))
  p = plan.row_src.shape[0]
  lhs = jnp.asarray(rng.standard_normal((p, k)), jnp.bfloat16)  # every row filled
  shape = (groups, n, k) if transpose_rhs else (groups, k, n)
  rhs = jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), jnp.bfloat16)
  tg, used = plan.tile_group, int(plan.num_tiles_used)
  kw = dict(tile_m=tile_m, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)
  outs = {impl: np.asarray(_gmm(lhs, rhs, tg, plan.num_tiles_used, impl=impl, **kw)
                           .astype(jnp.float32), np.float64) for impl in ("pallas", "xla")}
  l64 = np.asarray(lhs.astype(jnp.float32), np.float64)
  r64 = np.asarray(rhs.astype(jnp.float32), np.float64)
  ref = np.zeros((p, n))
  for i in range(used):
    w = r64[int(tg[i])]
    ref[i * tile_m:(i + 1) * tile_m] = l64[i * tile_m:(i + 1) * tile_m] @ (w.T if transpose_rhs
                                                                           else w)
  again = np.asarray(_gmm(lhs, rhs, tg, plan.num_tiles_used, impl="pallas", **kw)
                     .astype(jnp.float32), np.float64)
  line = (f"tile_m={tile_m:3d} K={k:5d} N={n:4d} {'nk' if transpose_rhs else 'kn'} "
          f"{jnp.dtype(out_dtype).name:8s} used {used:2d}/{p // tile_m:2d} tiles:")
  for impl, o in outs.items():
    err = np.linalg.norm(o - ref) / np.linalg.norm(ref)
    per_tile = [np.linalg.norm(o[i * tile_m:(i + 1) * tile_m] - ref[i * tile_m:(i + 1) * tile_m])
                / max(np.linalg.norm(ref[i * tile_m:(i + 1) * tile_m]), 1e-30) for i in range(used)]
    worst = int(np.argmax(per_tile))
    rows_bad = int((np.abs(o - ref).max(1) > 0.05 * np.abs(ref).max()).sum())
    line += (f"  {impl} rel {err:.2e} (worst tile {worst}: {per_tile[worst]:.2e}; rows off "
             f">5% of max: {rows_bad}; unused tiles zero: {not o[used * tile_m:].any()})")
  line += f"  pallas rerun bitwise equal: {np.array_equal(again, outs['pallas'])}"
  print(line, flush=True)


def main():
  print(jax.devices()[0].device_kind, jax.__version__)
  if len(sys.argv) > 1:  # K values (K/64 pipeline steps, 3 in flight), bf16 in and out, kn
    for k in map(int, sys.argv[1].split(",")):
      for tile_m in (64, 128):
        case(k + tile_m, 600, 4, tile_m, k, 256, False, jnp.bfloat16)
    return
  for out_dtype in (jnp.float32, jnp.bfloat16):
    for transpose_rhs in (False, True):
      for k in (256, 384, 512):
        case(k, 600, 4, 128, k, 256 if transpose_rhs else 384, transpose_rhs, out_dtype)


if __name__ == "__main__":
  main()
