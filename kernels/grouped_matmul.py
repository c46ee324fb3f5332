"""Grouped (per-expert) matmul over the padded tile layout of `flexfloor_jax.kernels.dispatch_plan`:
the API, its custom_vjp and the choice of kernel.

Tile i (rows [i*tile_m, (i+1)*tile_m)) is multiplied by rhs[tile_group[i]] for i < num_tiles_used;
later tiles are zero and cost no matmul. Every tile is the same [tile_m, K] x [K, N] GEMM with fp32
accumulation, so a row's result is bitwise independent of the other rows of its tile and of the
group sizes (batch invariance).

Decode shapes (8-row tiles, a few tiles per expert) are weight-bound: each expert's weights are read
once per call where the backend allows, not once per tile. impl='xla' (`gmm_xla`: the CPU default
and the training path) runs one group-batched round when every group has at most one tile (one
batched dot that reads the weights in place), else a loop over runs of same-group tiles with one
weight slice per run. impl='pallas' picks, at lowering time, the Mosaic TPU kernel (`gmm_tpu`),
the Mosaic GPU kernel (`gmm_mgpu`; `mgpu_supported` says which shapes and dtypes, the others take
the XLA loop on GPU), the XLA loop on ROCm, or on any other platform the TPU kernel in interpret
mode (`interpret=True` forces that everywhere). The Pallas
forward shares the custom_vjp: d_lhs runs the same kernel on transposed weights, d_rhs the XLA
"tgmm" loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flexfloor_jax.kernels.gmm_mgpu import gmm_mgpu, gmm_mgpu_swapped, mgpu_supported
from flexfloor_jax.kernels.gmm_tpu import gmm_tpu
from flexfloor_jax.kernels.gmm_xla import gmm_run_loop, gmm_xla, tgmm_xla

# 256 keeps the per-tile GEMM efficient on XLA:CPU (smaller tiles cost more per flop there)
# while bounding padding waste to < 256 rows per group; see `python -m flexfloor_jax.kernels.bench`.
DEFAULT_TILE_M = 256


def grouped_matmul(
    lhs_PK: jax.Array,
    rhs_GKN: jax.Array,
    tile_group: jax.Array,
    num_tiles_used: jax.Array,
    *,
    tile_m: int = DEFAULT_TILE_M,
    impl: str = "xla",
    interpret: bool = False,
    preferred_element_type=None,
    transpose_rhs: bool = False,
    num_groups: int | None = None,
) -> jax.Array:
  """out_PN[tile i] = lhs tile i @ rhs_GKN[tile_group[i]] for i < num_tiles_used, else 0.

  `transpose_rhs=True` takes rhs as [G, N, K] and contracts its last dim (used by the backward pass,
  saves materialising a transposed copy of the weights). Output dtype: `preferred_element_type` or
  lhs's; accumulation is always fp32. Differentiable w.r.t. lhs and rhs for both impls.
  """
  num_rows, k_dim = lhs_PK.shape
  k_rhs = rhs_GKN.shape[2] if transpose_rhs else rhs_GKN.shape[1]
  if rhs_GKN.ndim != 3 or k_rhs != k_dim:
    raise ValueError(f"shape mismatch: lhs {lhs_PK.shape}, rhs {rhs_GKN.shape}, {transpose_rhs=}")
  if num_rows % tile_m or tile_group.shape != (num_rows // tile_m,):
    raise ValueError(
        f"rows {num_rows} must be tiles of tile_m={tile_m} matching tile_group {tile_group.shape}"
    )
  if impl not in ("xla", "pallas"):
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
  out_dtype = jnp.dtype(preferred_element_type or lhs_PK.dtype)
  return _gmm(
      lhs_PK,
      rhs_GKN,
      tile_group.astype(jnp.int32),
      jnp.asarray(num_tiles_used, jnp.int32).reshape(()),
      tile_m,
      impl,
      bool(interpret),
      out_dtype,
      bool(transpose_rhs),
      int(num_groups or rhs_GKN.shape[0]),
  )


# --------------------------------------------------------------------------------------------------
# custom_vjp shared by both impls


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _gmm(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs, groups):
  return _gmm_forward(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs,
                      groups)


def _gmm_fwd(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs, groups):
  out = _gmm_forward(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs,
                     groups)
  return out, (lhs, rhs, tile_group, used)


def _gmm_bwd(tile_m, impl, interpret, out_dtype, transpose_rhs, groups, res, d_out):
  del out_dtype
  lhs, rhs, tile_group, used = res
  # Cotangents enter in the operand precision (as megablox does); accumulation stays fp32.
  d_out = d_out.astype(lhs.dtype)
  # Same tiles, weights transposed: d_lhs tile = d_out tile @ rhs[g]^T.
  d_lhs = _gmm_forward(
      d_out, rhs.astype(lhs.dtype), tile_group, used, tile_m, impl, interpret, lhs.dtype,
      not transpose_rhs, groups,
  )
  d_rhs_GKN = tgmm_xla(lhs, d_out, tile_group, used, rhs.shape[0], tile_m)
  d_rhs = jnp.swapaxes(d_rhs_GKN, 1, 2) if transpose_rhs else d_rhs_GKN
  return d_lhs, d_rhs.astype(rhs.dtype), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _gmm_forward(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs,
                 groups):
  if impl == "xla":
    if rhs.shape[0] != groups:  # a stack of several layers' groups: slice one expert per run
      return gmm_run_loop(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs)
    return gmm_xla(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs)
  return _gmm_pallas(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs, interpret,
                     groups)


# --------------------------------------------------------------------------------------------------
# Pallas: one kernel body per backend, chosen at lowering time


def _gmm_pallas(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs, interpret, groups):
  kw = dict(tile_m=tile_m, out_dtype=out_dtype, transpose_rhs=transpose_rhs, num_groups=groups)
  tpu = functools.partial(gmm_tpu, **kw, interpret=False)
  interp = functools.partial(gmm_tpu, **kw, interpret=True)
  args = (lhs, rhs, tile_group, used)
  if interpret:
    return interp(*args)
  xla = functools.partial(gmm_run_loop, tile_m=tile_m, out_dtype=out_dtype,
                          transpose_rhs=transpose_rhs)
  if mgpu_supported(lhs, rhs, tile_m, out_dtype, transpose_rhs):
    cuda = functools.partial(
        gmm_mgpu_swapped if tile_m < 64 else gmm_mgpu,
        tile_m=tile_m, out_dtype=out_dtype, transpose_rhs=transpose_rhs,
    )
  else:  # shapes/dtypes the wgmma kernel does not take (e.g. fp32): XLA on GPU.
    cuda = xla
  # ROCm: no compiled Pallas kernel here, so the XLA loop rather than the interpreter.
  return lax.platform_dependent(*args, tpu=tpu, cuda=cuda, rocm=xla, default=interp)
