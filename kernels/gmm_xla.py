"""XLA grouped matmul (the reference of every kernel, and the CPU and training path): the run loop,
group-batched rounds, the choice between them, and the d_rhs loop of the backward pass."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax


def dot_dims(transpose_rhs: bool):
  return (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))


def gmm_run_loop(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs):
  """Expert-outer loop: each run of tiles of one group takes its weights once, then one fixed-shape
  [tile_m, K] dot per tile of the run, written in place into a zero buffer.

  A run is a maximal range of consecutive tiles of one group; the padded layout sorts tiles by
  group, so the outer trip count is the number of non-empty groups and an expert's weights are
  sliced once per call however many tiles it has (a per-tile slice re-reads them once per tile). Any
  tile_group is correct, unsorted ones only take more runs. Each tile is still its own GEMM
  of one shape, so the numerics (and batch invariance) are those of the per-tile loop. Trip counts
  are dynamic, so padding tiles cost nothing; the zero buffer is a calloc on CPU.
  """
  num_rows = lhs.shape[0]
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  num_tiles = tile_group.shape[0]
  used = jnp.minimum(used, num_tiles)
  # run_end[i]: first tile after i whose group differs from tile i's (num_tiles if none).
  idx = jnp.arange(num_tiles, dtype=jnp.int32)
  boundary = jnp.where(tile_group[1:] != tile_group[:-1], idx[1:], num_tiles)
  run_end = lax.cummin(jnp.append(boundary, num_tiles), reverse=True)

  def run(carry):
    start, out = carry
    g = tile_group[start]
    end = jnp.minimum(run_end[start], used)
    w = lax.dynamic_index_in_dim(rhs, g, 0, keepdims=False)

    def tile(i, out):
      x = lax.dynamic_slice_in_dim(lhs, i * tile_m, tile_m, 0)
      y = lax.dot_general(x, w, dot_dims(transpose_rhs), preferred_element_type=jnp.float32)
      return lax.dynamic_update_slice_in_dim(out, y.astype(out_dtype), i * tile_m, 0)

    return end, lax.fori_loop(start, end, tile, out)

  init = (jnp.int32(0), jnp.zeros((num_rows, n_dim), out_dtype))
  return lax.while_loop(lambda c: c[0] < used, run, init)[1]


def _used_tiles_by_group(tile_group, used, groups: int):
  """(group of each tile, `groups` for tiles past `used`; used tiles per group)."""
  num_tiles = tile_group.shape[0]
  group_T = jnp.where(jnp.arange(num_tiles) < used, tile_group, groups)
  return group_T, jnp.bincount(group_T, length=groups + 1)[:groups]


def gmm_rounds(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs):
  """Group-batched rounds: round r multiplies the r-th tile of every group by its weights in one
  batched dot over all of rhs, so the weights are read in place (the run loop's per-expert slice is
  a copy on XLA:CPU) and the trip count is the largest number of tiles of any group. Each batch
  element is the same [tile_m, K] x [K, N] GEMM as a tile of the run loop (tests check bitwise)."""
  num_rows, k_dim = lhs.shape
  groups = rhs.shape[0]
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  num_tiles = tile_group.shape[0]
  group_T, count_G = _used_tiles_by_group(tile_group, jnp.minimum(used, num_tiles), groups)
  order_T = jnp.argsort(group_T, stable=True).astype(jnp.int32)  # tiles of each group in order
  start_G = jnp.cumsum(count_G) - count_G
  lhs_TMK = lhs.reshape(num_tiles, tile_m, k_dim)
  dims = (((2,), (2 if transpose_rhs else 1,)), ((0,), (0,)))

  def round_(r, out_TMN):
    has_G = r < count_G
    tile_G = jnp.where(has_G, order_T[jnp.minimum(start_G + r, num_tiles - 1)], num_tiles)
    x_GMK = jnp.take(lhs_TMK, jnp.minimum(tile_G, num_tiles - 1), axis=0)
    y_GMN = lax.dot_general(x_GMK, rhs, dims, preferred_element_type=jnp.float32)
    return out_TMN.at[tile_G].set(y_GMN.astype(out_dtype), mode="drop")

  out = lax.fori_loop(0, jnp.max(count_G), round_,
                      jnp.zeros((num_tiles, tile_m, n_dim), out_dtype))
  return out.reshape(num_rows, n_dim)


def gmm_xla(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs):
  """One round where it wastes little (every group has at most one tile and at least half of
  the groups have one: decode shapes, where reading the weights in place beats the run loop's
  slice copy), the run loop otherwise. From a second round on the rounds lost on XLA:CPU at
  every shape measured (8-16 groups, [256x512] to [2048x768], 16-256 rows per group: 1.2-1.9x
  the run loop's CPU time, the most at large experts). Both compute every tile with the same
  GEMM, so the choice changes no bit of the result."""
  groups = rhs.shape[0]
  used = jnp.minimum(used, tile_group.shape[0])
  rounds = jnp.max(_used_tiles_by_group(tile_group, used, groups)[1])
  static = dict(tile_m=tile_m, out_dtype=out_dtype, transpose_rhs=transpose_rhs)
  return lax.cond((rounds <= 1) & (groups <= 2 * used), functools.partial(gmm_rounds, **static),
                  functools.partial(gmm_run_loop, **static), lhs, rhs, tile_group, used)


def tgmm_xla(lhs, d_out, tile_group, used, num_groups, tile_m):
  """d_rhs[g] = sum over used tiles of group g, in tile order, of lhs_tile^T @ d_out_tile (fp32)."""
  k_dim, n_dim = lhs.shape[1], d_out.shape[1]

  def body(i, acc):
    x = lax.dynamic_slice_in_dim(lhs, i * tile_m, tile_m, 0)
    dy = lax.dynamic_slice_in_dim(d_out, i * tile_m, tile_m, 0)
    upd = lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    g = tile_group[i]
    cur = lax.dynamic_index_in_dim(acc, g, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(acc, cur + upd, g, 0)

  return lax.fori_loop(0, used, body, jnp.zeros((num_groups, k_dim, n_dim), jnp.float32))
