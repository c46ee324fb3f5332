"""Mosaic TPU grouped matmul (megablox-style): tile metadata through scalar prefetch; weight blocks
outermost where a [K, tn] block fits VMEM, so each used expert's weights are fetched once a call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flexfloor_jax.kernels.gmm_xla import dot_dims


def _pick_block(dim: int, prefs=(512, 256, 128)) -> int:
  for b in prefs:
    if dim % b == 0:
      return b
  return dim  # a full-extent block is always legal on TPU


# VMEM the weights-outer schedule may use for its double-buffered blocks: inside every TPU
# generation's default scoped VMEM limit (16 MiB on v5e), with room for Mosaic's own scratch.
_TPU_VMEM_BUDGET = 12 * 2**20


@dataclasses.dataclass(frozen=True)
class _TpuSchedule:
  """Grid and blocks of the Mosaic TPU kernel; the index maps take (grid indices..., tg, used) and
  also run on numpy values, so a test can replay which weight blocks the pipeline fetches.

  weights_outer: grid (N blocks, row tiles) and one dot over the whole K per tile. Consecutive tiles
    of one group ask for the same weight block, which the Pallas pipeline does not fetch again, so
    every used expert's weights are read once per call (the decode case: few rows, many weights).
  otherwise: grid (row tiles, N blocks, K blocks), K accumulated in VMEM, weights read once per
    tile; taken when a [K, tn] weight block does not fit the VMEM budget (then a tile is large
    enough to amortise it, or K is too long for one block).
  """
  weights_outer: bool
  grid: tuple
  tn: int
  tk: int
  lhs_block: tuple
  rhs_block: tuple
  out_block: tuple
  lhs_map: Callable[..., Any]
  rhs_map: Callable[..., Any]
  out_map: Callable[..., Any]


def tpu_schedule(num_rows, k_dim, n_dim, tile_m, in_itemsize, out_itemsize, transpose_rhs):
  num_tiles = num_rows // tile_m

  def rhs_kn(g, k, n):
    return (g, n, k) if transpose_rhs else (g, k, n)


  def clamp(i, used):  # steps past the used tiles repeat the last used tile's blocks: no DMA
    return jnp.where(i < used[0], i, jnp.maximum(used[0] - 1, 0))

  for tn in (512, 256, 128):
    if n_dim % tn:
      continue
    vmem = 2 * (k_dim * tn + tile_m * k_dim) * in_itemsize + 2 * tile_m * tn * out_itemsize
    if vmem <= _TPU_VMEM_BUDGET:
      return _TpuSchedule(
          weights_outer=True, grid=(n_dim // tn, num_tiles), tn=tn, tk=k_dim,
          lhs_block=(tile_m, k_dim), rhs_block=(None,) + rhs_kn(None, k_dim, tn)[1:],
          out_block=(tile_m, tn),
          lhs_map=lambda n, i, tg, used: (clamp(i, used), 0),
          rhs_map=lambda n, i, tg, used: rhs_kn(tg[clamp(i, used)], 0, n),
          out_map=lambda n, i, tg, used: (i, n),
      )

  tn, tk = _pick_block(n_dim), _pick_block(k_dim)
  n_blocks, k_blocks = n_dim // tn, k_dim // tk

  def effective(i, n, k, used):
    active = i < used[0]
    return (clamp(i, used), jnp.where(active, n, n_blocks - 1), jnp.where(active, k, k_blocks - 1))

  def lhs_map(i, n, k, tg, used):
    i, _, k = effective(i, n, k, used)
    return i, k

  def rhs_map(i, n, k, tg, used):
    i, n, k = effective(i, n, k, used)
    return rhs_kn(tg[i], k, n)

  return _TpuSchedule(
      weights_outer=False, grid=(num_tiles, n_blocks, k_blocks), tn=tn, tk=tk,
      lhs_block=(tile_m, tk), rhs_block=(None,) + rhs_kn(None, tk, tn)[1:], out_block=(tile_m, tn),
      lhs_map=lhs_map, rhs_map=rhs_map, out_map=lambda i, n, k, tg, used: (i, n),
  )


def gmm_tpu(lhs, rhs, tile_group, used, *, tile_m, out_dtype, transpose_rhs, num_groups,
             interpret):
  """Mosaic TPU kernel, megablox-style: tile_group and num_tiles_used arrive through scalar
  prefetch and the rhs index_map picks the tile's group (schedules: `_TpuSchedule`). Steps past
  num_tiles_used fetch nothing new and skip the matmul: they only store a zero output block.
  """
  num_rows, k_dim = lhs.shape
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  num_tiles = num_rows // tile_m
  sch = tpu_schedule(num_rows, k_dim, n_dim, tile_m, lhs.dtype.itemsize, out_dtype.itemsize,
                      transpose_rhs)
  dims = dot_dims(transpose_rhs)

  semantics: tuple[Literal["parallel", "arbitrary"], ...]
  if sch.weights_outer:
    # One `kernel` per schedule, both by that name (pallas_call names a kernel after its
    # function); the type checker takes the pair for a redeclaration.
    def kernel(tg_ref, used_ref, lhs_ref, rhs_ref, out_ref):  # type: ignore[reportRedeclaration]
      active = pl.program_id(1) < used_ref[0]

      @pl.when(active)
      def _():
        out_ref[...] = lax.dot_general(
            lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32
        ).astype(out_ref.dtype)

      @pl.when(jnp.logical_not(active))
      def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    scratch = []
    semantics = ("parallel", "arbitrary")
    # Each used group's weights once; the lhs once per N block.
    weight_reads = min(num_tiles, num_groups)
  else:
    k_blocks = sch.grid[2]

    def kernel(tg_ref, used_ref, lhs_ref, rhs_ref, out_ref, acc_ref):
      i, k = pl.program_id(0), pl.program_id(2)

      @pl.when(k == 0)
      def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

      @pl.when(i < used_ref[0])
      def _():
        acc_ref[...] += lax.dot_general(
            lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32
        )

      @pl.when(k == k_blocks - 1)
      def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    scratch = [pltpu.VMEM((tile_m, sch.tn), jnp.float32)]
    semantics = ("parallel", "parallel", "arbitrary")
    weight_reads = num_tiles  # the weight block of every tile, also when its group repeats

  cost = pl.CostEstimate(
      flops=2 * num_rows * k_dim * n_dim,
      transcendentals=0,
      bytes_accessed=int(
          lhs.size * lhs.dtype.itemsize * (n_dim // sch.tn)
          + weight_reads * k_dim * n_dim * rhs.dtype.itemsize
          + num_rows * n_dim * out_dtype.itemsize
      ),
  )
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=sch.grid,
          in_specs=[pl.BlockSpec(sch.lhs_block, sch.lhs_map),
                    pl.BlockSpec(sch.rhs_block, sch.rhs_map)],
          out_specs=pl.BlockSpec(sch.out_block, sch.out_map),
          scratch_shapes=scratch,
      ),
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      cost_estimate=cost,
      interpret=interpret,
  )(tile_group, used.reshape((1,)), lhs, rhs)
