"""Mosaic GPU grouped matmul (Hopper wgmma): tile metadata read from GMEM inside the kernel (no
scalar prefetch on Mosaic GPU); tiles under 64 rows as the swapped product W^T x^T, one CTA per tile
and N block, so a repeated expert's weights come from L2 rather than once per call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Block sizes: 128 rows keep a 128x128 fp32 accumulator in one warpgroup's registers; 64
# K-columns of a 2-byte dtype are one 128-byte swizzle row.
_MGPU_BLOCK_M = 128
_MGPU_BLOCK_N = 128
_MGPU_BLOCK_K = 64
_MGPU_STAGES = 3

# The wgmma accumulator reference. jax's mosaic_gpu module exports it as ACC without marking the
# import a re-export, so the type checker takes the name for private.
_ACC = plgpu.ACC  # type: ignore[reportPrivateImportUsage]


# Decode tiles (tile_m < 64, a multiple of 8) go through the swapped product out^T = W^T x^T:
# wgmma's M (64 per warpgroup) then runs over the weights' N and its N (a multiple of 8) over the
# tile's rows, so an 8-row tile is one wgmma shape instead of a 64-row block 7/8 padding.
_MGPU_SWAP_BLOCK_N = 64


def mgpu_supported(lhs, rhs, tile_m, out_dtype, transpose_rhs) -> bool:
  del out_dtype
  k_dim = lhs.shape[1]
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if not (lhs.dtype == rhs.dtype and lhs.dtype in (jnp.bfloat16, jnp.float16)
          and k_dim % _MGPU_BLOCK_K == 0):
    return False
  if tile_m < 64:
    return tile_m % 8 == 0 and n_dim % _MGPU_SWAP_BLOCK_N == 0
  block_m = min(tile_m, _MGPU_BLOCK_M)
  return block_m % 64 == 0 and tile_m % block_m == 0 and n_dim % _MGPU_BLOCK_N == 0


def gmm_mgpu_swapped(lhs, rhs, tile_group, used, *, tile_m, out_dtype, transpose_rhs):
  """Mosaic GPU kernel for decode tiles: one CTA per (tile, 64-column N block) computes
  out^T[n block, tile rows] = W[g]^T[n block] @ x_tile^T with a [64, tile_m] fp32 accumulator; the
  result comes back transposed ([N, rows]) and is transposed once in XLA (rows are few at decode).
  A row's value is one fixed wgmma shape per tile, as in the row-major kernel.
  """
  num_rows, k_dim = lhs.shape
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bn, bk = _MGPU_SWAP_BLOCK_N, _MGPU_BLOCK_K

  def body(tg_gmem, used_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ti, ni = lax.axis_index("m"), lax.axis_index("n")
    out_block = out_gmem.at[pl.ds(ni * bn, bn), pl.ds(ti * tile_m, tile_m)]

    def store(value):
      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bn, tile_m), out_gmem.dtype))
      def _(o_smem):
        o_smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_block)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    is_used = ti < used_gmem[0]

    @pl.when(is_used)
    def _():
      group = tg_gmem[ti]

      def step(_, lhs_smem, rhs_smem, acc_ref):
        # A = W^T block [bn, bk]; B = x_tile^T [bk, tile_m] (K-major, as wgmma takes B)
        a = rhs_smem if transpose_rhs else plgpu.transpose_ref(rhs_smem, (1, 0))
        plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(lhs_smem, (1, 0)))

      def acc_scope(acc_ref):
        rhs_spec = (
            plgpu.BlockSpec((bn, bk), lambda k: (ni, k))
            if transpose_rhs
            else plgpu.BlockSpec((bk, bn), lambda k: (k, ni))
        )
        plgpu.emit_pipeline(
            lambda idx, lhs_smem, rhs_smem: step(idx, lhs_smem, rhs_smem, acc_ref),
            grid=(k_dim // bk,),
            in_specs=[plgpu.BlockSpec((tile_m, bk), lambda k: (ti, k)), rhs_spec],
            max_concurrent_steps=min(_MGPU_STAGES, k_dim // bk),
        )(lhs_gmem, rhs_gmem.at[group])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, _ACC((bn, tile_m), jnp.float32))
      store(acc.astype(out_gmem.dtype))

    @pl.when(jnp.logical_not(is_used))
    def _():
      store(jnp.zeros((bn, tile_m), out_gmem.dtype))

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((n_dim, num_rows), out_dtype),
      grid=(num_rows // tile_m, n_dim // bn),
      grid_names=("m", "n"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
  )
  return kernel(tile_group, used.reshape((1,)), lhs, rhs).T


def gmm_mgpu(lhs, rhs, tile_group, used, *, tile_m, out_dtype, transpose_rhs):
  """Mosaic GPU kernel: one CTA per (row block, N block); a row block is a slice of one tile.

  No scalar prefetch on Mosaic GPU, so tile_group / num_tiles_used are GMEM refs read inside the
  kernel; the K loop is an `emit_pipeline` of TMA copies feeding wgmma. Unused tiles store zeros.
  """
  num_rows, k_dim = lhs.shape
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_m = min(tile_m, _MGPU_BLOCK_M)
  blocks_per_tile = tile_m // block_m
  bn, bk = _MGPU_BLOCK_N, _MGPU_BLOCK_K

  def body(tg_gmem, used_gmem, lhs_gmem, rhs_gmem, out_gmem):
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    tile = lax.div(mi, jnp.int32(blocks_per_tile))
    out_block = out_gmem.at[pl.ds(mi * block_m, block_m), pl.ds(ni * bn, bn)]

    def store(value):
      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, bn), out_gmem.dtype))
      def _(o_smem):
        o_smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_block)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    is_used = tile < used_gmem[0]

    @pl.when(is_used)
    def _():
      group = tg_gmem[tile]

      def step(_, lhs_smem, rhs_smem, acc_ref):
        rhs_op = plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem
        plgpu.wgmma(acc_ref, lhs_smem, rhs_op)

      def acc_scope(acc_ref):
        rhs_spec = (
            plgpu.BlockSpec((bn, bk), lambda k: (ni, k))
            if transpose_rhs
            else plgpu.BlockSpec((bk, bn), lambda k: (k, ni))
        )
        plgpu.emit_pipeline(
            lambda idx, lhs_smem, rhs_smem: step(idx, lhs_smem, rhs_smem, acc_ref),
            grid=(k_dim // bk,),
            in_specs=[plgpu.BlockSpec((block_m, bk), lambda k: (mi, k)), rhs_spec],
            max_concurrent_steps=min(_MGPU_STAGES, k_dim // bk),
        )(lhs_gmem, rhs_gmem.at[group])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, _ACC((block_m, bn), jnp.float32))
      store(acc.astype(out_gmem.dtype))

    @pl.when(jnp.logical_not(is_used))
    def _():
      store(jnp.zeros((block_m, bn), out_gmem.dtype))

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
      grid=(num_rows // block_m, n_dim // bn),
      grid_names=("m", "n"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
  )
  return kernel(tile_group, used.reshape((1,)), lhs, rhs)
