"""CPU benchmark: XLA grouped_matmul vs ONE dense matmul over the same rows.

  python -m kernels.bench [--tile_m 128 256] [--runs 30]
  python -m kernels.bench --dtype bfloat16 --impl pallas --k 4096 --n 14336 --tile_m 128   # GPU

The grouped matmul does the same flops as the dense matmul plus its tile padding, so the ratio shows
the cost of fixed-shape tiles and the per-tile loop. Dense and grouped calls are timed interleaved
(pairs), so drift on a shared machine affects both alike: times are medians after warm-up, the ratio
is the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels.dispatch_plan import make_plan, padded_rows
from kernels.grouped_matmul import DEFAULT_TILE_M, grouped_matmul

NUM_ROWS, K_DIM, N_DIM, NUM_GROUPS = 4096, 256, 512, 8


def _zipf_sizes(total: int, groups: int, s: float = 1.0) -> list[int]:
  w = 1.0 / np.arange(1, groups + 1) ** s
  sizes = np.floor(w / w.sum() * total).astype(int)
  sizes[0] += total - sizes.sum()
  return sizes.tolist()


CASES = {
    "equal 8x512": [512] * 8,
    "zipf s=1": _zipf_sizes(NUM_ROWS, NUM_GROUPS),
    "2 empty groups": [0, 683, 683, 0, 683, 683, 682, 682],
}


def _time_pair(f_a, args_a, f_b, args_b, runs: int):
  for _ in range(3):
    jax.block_until_ready(f_a(*args_a))
    jax.block_until_ready(f_b(*args_b))
  t_a, t_b = [], []
  for _ in range(max(runs, 10)):
    t0 = time.perf_counter()
    jax.block_until_ready(f_a(*args_a))
    t1 = time.perf_counter()
    jax.block_until_ready(f_b(*args_b))
    t2 = time.perf_counter()
    t_a.append(t1 - t0)
    t_b.append(t2 - t1)
  t_a, t_b = np.array(t_a), np.array(t_b)
  return float(np.median(t_a)), float(np.median(t_b)), float(np.median(t_b / t_a))


def run(tile_ms=(DEFAULT_TILE_M,), runs: int = 30, dtype=jnp.float32, impl: str = "xla",
        k_dim: int = K_DIM, n_dim: int = N_DIM) -> list[dict]:
  key_x, key_w = jax.random.split(jax.random.key(0))
  x_RK = jax.random.normal(key_x, (NUM_ROWS, k_dim), dtype)
  rhs_GKN = jax.random.normal(key_w, (NUM_GROUPS, k_dim, n_dim), dtype)
  dense = jax.jit(lambda x, w: jnp.dot(x, w))
  results = []
  for tile_m in tile_ms:
    rows = padded_rows(NUM_ROWS, NUM_GROUPS, tile_m)
    gmm = jax.jit(lambda l, r, tg, u, tm=tile_m: grouped_matmul(l, r, tg, u, tile_m=tm,
                                                                impl=impl))
    for name, sizes in CASES.items():
      assert sum(sizes) == NUM_ROWS, (name, sizes)
      group_ids = jnp.asarray(np.repeat(np.arange(NUM_GROUPS), sizes), jnp.int32)
      plan = make_plan(group_ids, NUM_GROUPS, tile_m, rows)
      lhs = jnp.zeros((rows, k_dim), dtype).at[plan.row_dst].set(x_RK)  # padded layout
      t_dense, t_gmm, ratio = _time_pair(
          dense, (x_RK, rhs_GKN[0]), gmm, (lhs, rhs_GKN, plan.tile_group, plan.num_tiles_used), runs
      )
      results.append(
          dict(case=name, tile_m=tile_m, tiles_used=int(plan.num_tiles_used),
               dense_ms=1e3 * t_dense, gmm_ms=1e3 * t_gmm, ratio=ratio)
      )
  return results


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tile_m", type=int, nargs="+", default=[DEFAULT_TILE_M])
  p.add_argument("--runs", type=int, default=30)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--impl", default="xla", choices=["xla", "pallas"],
                 help="pallas: the Mosaic GPU / TPU kernel where the shape allows it")
  p.add_argument("--k", type=int, default=K_DIM)
  p.add_argument("--n", type=int, default=N_DIM)
  args = p.parse_args(argv)
  print(f"{jax.devices()[0].platform}: {NUM_ROWS} rows x [{args.k}x{args.n}] {args.dtype}, "
        f"{NUM_GROUPS} groups, impl={args.impl}, median of {args.runs} interleaved runs")
  print(f"{'case':<16}{'tile_m':>7}{'tiles':>7}{'dense ms':>10}{'gmm ms':>9}{'ratio':>7}")
  for r in run(tuple(args.tile_m), args.runs, jnp.dtype(args.dtype), args.impl, args.k, args.n):
    print(f"{r['case']:<16}{r['tile_m']:>7}{r['tiles_used']:>7}{r['dense_ms']:>10.2f}"
          f"{r['gmm_ms']:>9.2f}{r['ratio']:>7.2f}")


if __name__ == "__main__":
  main()
