r"""CPU benchmark: XLA grouped_matmul vs ONE dense matmul over the same rows, then at decode shapes.

  python -m flexfloor_jax.kernels.bench [--tile_m 128 256] [--runs 30]
  python -m flexfloor_jax.kernels.bench --dtype bfloat16 --impl pallas --k 4096 --n 14336 \
      --tile_m 128   # GPU
  python -m flexfloor_jax.kernels.bench --k 2048 --n 768 --decode_groups 16 \
      --decode_rows 1 2 4 --no_dense   # Qwen3-30B-A3B decode: 16 expert slots per worker

The grouped matmul does the same flops as the dense matmul plus its tile padding, so the ratio shows
the cost of fixed-shape tiles and the per-tile loop. Dense and grouped calls are timed interleaved
(pairs), so drift on a shared machine affects both alike: times are medians after warm-up, the ratio
is the median of the per-pair ratios.

The decode table (8 experts, 8-64 rows each, the engine's decode tile; `--decode_groups`,
`--decode_rows` for others) compares against a per-expert einsum over exactly those rows
('gck,gkn->gcn', what a capacity layout without tiles would run) and
shows, beside the grouped matmul (which picks one group-batched round where every group has at
most one tile, else the run loop), its run loop (one weight slice per expert), the group-batched
rounds whatever the tile counts and a per-tile loop (one weight slice per tile), all timed
interleaved; its ratios are those of the fastest runs (at sub-millisecond calls a loaded machine's
scheduling noise swamps a median).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from flexfloor_jax.kernels.dispatch_plan import make_plan, padded_rows
from flexfloor_jax.kernels.gmm_xla import gmm_rounds, gmm_run_loop
from flexfloor_jax.kernels.grouped_matmul import DEFAULT_TILE_M, grouped_matmul

NUM_ROWS, K_DIM, N_DIM, NUM_GROUPS = 4096, 256, 512, 8
# flexfloor_jax.engine.EngineSpec.decode_tile_m (the kernels import nothing of the engine)
DECODE_TILE_M = 8
DECODE_ROWS_PER_EXPERT = (8, 16, 32, 64)


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


def _time_interleaved(calls, runs: int):
  """Median time of each (fn, args) and the median ratio of each to the first, run by run."""
  for _ in range(3):
    for f, a in calls:
      jax.block_until_ready(f(*a))
  ts = [[] for _ in calls]
  for _ in range(max(runs, 10)):
    for t, (f, a) in zip(ts, calls, strict=True):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*a))
      t.append(time.perf_counter() - t0)
  ts = np.array(ts)
  return np.median(ts, axis=1), np.median(ts / ts[0], axis=1), np.min(ts, axis=1)


def _time_pair(f_a, args_a, f_b, args_b, runs: int):
  t, r, _ = _time_interleaved([(f_a, args_a), (f_b, args_b)], runs)
  return float(t[0]), float(t[1]), float(r[1])


def _per_tile_gmm(lhs, rhs, tile_group, used, tile_m):
  """The per-tile loop: every tile slices its group's weights again (same numerics)."""
  def body(i, out):
    x = jax.lax.dynamic_slice_in_dim(lhs, i * tile_m, tile_m, 0)
    w = jax.lax.dynamic_index_in_dim(rhs, tile_group[i], 0, keepdims=False)
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out.dtype)
    return jax.lax.dynamic_update_slice_in_dim(out, y, i * tile_m, 0)
  return jax.lax.fori_loop(0, used, body, jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype))


def run_decode(runs: int = 30, dtype=jnp.float32, impl: str = "xla", k_dim: int = K_DIM,
               n_dim: int = N_DIM, tile_m: int = DECODE_TILE_M, groups: int = NUM_GROUPS,
               rows_per_expert=DECODE_ROWS_PER_EXPERT) -> list[dict]:
  key_x, key_w = jax.random.split(jax.random.key(1))
  rhs_GKN = jax.random.normal(key_w, (groups, k_dim, n_dim), dtype)
  einsum = jax.jit(lambda x, w: jnp.einsum("gck,gkn->gcn", x, w,
                                           preferred_element_type=jnp.float32).astype(x.dtype))
  gmm = jax.jit(lambda x, r, tg, u: grouped_matmul(x, r, tg, u, tile_m=tile_m, impl=impl))
  per_tile = jax.jit(lambda x, r, tg, u: _per_tile_gmm(x, r, tg, u, tile_m))
  run_loop = jax.jit(lambda x, r, tg, u: gmm_run_loop(x, r, tg, u, tile_m, x.dtype, False))
  rounds = jax.jit(lambda x, r, tg, u: gmm_rounds(x, r, tg, u, tile_m, x.dtype, False))
  results = []
  for per_expert in rows_per_expert:
    rows = per_expert * groups
    x_GCK = jax.random.normal(key_x, (groups, per_expert, k_dim), dtype)
    group_ids = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), per_expert)
    plan = make_plan(group_ids, groups, tile_m, padded_rows(rows, groups, tile_m))
    lhs = jnp.zeros((plan.row_src.shape[0], k_dim), dtype).at[plan.row_dst].set(
        x_GCK.reshape(rows, k_dim))
    args = (lhs, rhs_GKN, plan.tile_group, plan.num_tiles_used)
    _, ratio, t_min = _time_interleaved(
        [(einsum, (x_GCK, rhs_GKN)), (gmm, args), (run_loop, args), (rounds, args),
         (per_tile, args)], runs)
    results.append(dict(rows_per_expert=per_expert, tile_m=tile_m, einsum_ms=1e3 * t_min[0],
                        gmm_ms=1e3 * t_min[1], run_loop_ms=1e3 * t_min[2],
                        rounds_ms=1e3 * t_min[3], per_tile_ms=1e3 * t_min[4],
                        gmm_ratio=float(t_min[1] / t_min[0]),
                        run_loop_ratio=float(t_min[2] / t_min[0]),
                        rounds_ratio=float(t_min[3] / t_min[0]),
                        per_tile_ratio=float(t_min[4] / t_min[0]),
                        gmm_median_ratio=float(ratio[1]), run_loop_median_ratio=float(ratio[2]),
                        rounds_median_ratio=float(ratio[3]),
                        per_tile_median_ratio=float(ratio[4])))
  return results


def run(tile_ms=(DEFAULT_TILE_M,), runs: int = 30, dtype=jnp.float32, impl: str = "xla",
        k_dim: int = K_DIM, n_dim: int = N_DIM) -> list[dict]:
  key_x, key_w = jax.random.split(jax.random.key(0))
  x_RK = jax.random.normal(key_x, (NUM_ROWS, k_dim), dtype)
  rhs_GKN = jax.random.normal(key_w, (NUM_GROUPS, k_dim, n_dim), dtype)
  dense = jax.jit(lambda x, w: jnp.dot(x, w))
  results = []
  for tile_m in tile_ms:
    rows = padded_rows(NUM_ROWS, NUM_GROUPS, tile_m)
    gmm = jax.jit(lambda x, r, tg, u, tm=tile_m: grouped_matmul(x, r, tg, u, tile_m=tm,
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
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
  p.add_argument("--tile_m", type=int, nargs="+", default=[DEFAULT_TILE_M])
  p.add_argument("--runs", type=int, default=30)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--impl", default="xla", choices=["xla", "pallas"],
                 help="pallas: the Mosaic GPU / TPU kernel where the shape allows it")
  p.add_argument("--k", type=int, default=K_DIM)
  p.add_argument("--n", type=int, default=N_DIM)
  p.add_argument("--decode_tile_m", type=int, default=DECODE_TILE_M)
  p.add_argument("--decode_groups", type=int, default=NUM_GROUPS,
                 help="experts of the decode table (one worker's expert slots)")
  p.add_argument("--decode_rows", type=int, nargs="+", default=list(DECODE_ROWS_PER_EXPERT),
                 help="rows per expert of the decode table")
  p.add_argument("--no_dense", action="store_true", help="skip the dense-comparison table")
  p.add_argument("--no_decode", action="store_true", help="skip the decode-shape table")
  args = p.parse_args(argv)
  print(f"{jax.devices()[0].platform}: {NUM_ROWS} rows x [{args.k}x{args.n}] {args.dtype}, "
        f"{NUM_GROUPS} groups, impl={args.impl}, median of {args.runs} interleaved runs")
  if not args.no_dense:
    print(f"{'case':<16}{'tile_m':>7}{'tiles':>7}{'dense ms':>10}{'gmm ms':>9}{'ratio':>7}")
    for r in run(tuple(args.tile_m), args.runs, jnp.dtype(args.dtype), args.impl, args.k,
                 args.n):
      print(f"{r['case']:<16}{r['tile_m']:>7}{r['tiles_used']:>7}{r['dense_ms']:>10.2f}"
            f"{r['gmm_ms']:>9.2f}{r['ratio']:>7.2f}")
  if args.no_decode:
    return
  print(f"\ndecode: {args.decode_groups} experts x [{args.k}x{args.n}], "
        f"tile_m={args.decode_tile_m}; ratios to a per-expert einsum over the same rows")
  print("(ms and ratios of the fastest run, which other load on a shared machine inflates least; "
        "median of the per-run ratios in brackets)")
  print(f"{'rows/expert':>12}{'einsum ms':>10}{'gmm ms':>9}{'gmm':>14}{'run loop':>14}"
        f"{'rounds':>14}{'per-tile':>14}")
  for r in run_decode(args.runs, jnp.dtype(args.dtype), args.impl, args.k, args.n,
                      args.decode_tile_m, args.decode_groups, tuple(args.decode_rows)):
    print(f"{r['rows_per_expert']:>12}{r['einsum_ms']:>10.3f}{r['gmm_ms']:>9.3f}"
          f"{r['gmm_ratio']:>7.2f} [{r['gmm_median_ratio']:4.2f}]"
          f"{r['run_loop_ratio']:>7.2f} [{r['run_loop_median_ratio']:4.2f}]"
          f"{r['rounds_ratio']:>7.2f} [{r['rounds_median_ratio']:4.2f}]"
          f"{r['per_tile_ratio']:>7.2f} [{r['per_tile_median_ratio']:4.2f}]")


if __name__ == "__main__":
  main()
