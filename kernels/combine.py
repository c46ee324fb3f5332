"""Weighted top-k combine: out[t] = sum_{k=0..K-1} weights[t, k] * y[row_dst[t, k]] (row_dst < 0 skipped).

The sum is fp32 and strictly sequential in k (acc = acc + term_k), never a tree reduction, so a
token's output does not depend on where its expert copies were computed or how XLA would choose to
reduce (DESIGN.md "fixed reduction orders"). impl='xla' unrolls K (small, static) gathers;
impl='pallas' is a Mosaic TPU kernel (row_dst through scalar prefetch, one DMA per expert copy). On
GPU impl='pallas' uses the XLA version (a fused gather + elementwise kernel there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def combine(
    y_PD: jax.Array,
    row_dst_TK: jax.Array,
    weights_TK: jax.Array,
    *,
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:
  """Returns out_TD (y's dtype): fixed-order fp32 weighted sum of each token's K expert rows."""
  if y_PD.ndim != 2 or row_dst_TK.ndim != 2 or row_dst_TK.shape != weights_TK.shape:
    raise ValueError(f"bad shapes: y {y_PD.shape}, row_dst {row_dst_TK.shape}, w {weights_TK.shape}")
  row_dst_TK = row_dst_TK.astype(jnp.int32)
  if impl == "xla":
    return combine_xla(y_PD, row_dst_TK, weights_TK)
  if impl != "pallas":
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
  interp = functools.partial(_combine_tpu, interpret=True)
  if interpret:
    return interp(y_PD, row_dst_TK, weights_TK)
  return lax.platform_dependent(
      y_PD,
      row_dst_TK,
      weights_TK,
      tpu=functools.partial(_combine_tpu, interpret=False),
      cuda=combine_xla,
      default=interp,
  )


def _term(w_T, rows_TD, valid_T):
  """One k's contribution; `where` (not w * 0) so a skipped slot adds nothing even if w is inf/nan."""
  prod = w_T.astype(jnp.float32)[:, None] * rows_TD.astype(jnp.float32)
  return jnp.where(valid_T[:, None], prod, 0.0)


def combine_xla(y_PD, row_dst_TK, weights_TK):
  """XLA reference: K static gathers, accumulated left to right in fp32."""
  num_tokens, top_k = row_dst_TK.shape
  terms = []
  for k in range(top_k):
    idx = row_dst_TK[:, k]
    rows = jnp.take(y_PD, jnp.maximum(idx, 0), axis=0, mode="clip")
    terms.append(_term(weights_TK[:, k], rows, idx >= 0))
  terms_KTD = jnp.stack(terms)
  # The sum runs in a loop over the materialised fp32 products, so every product is rounded
  # before it is added. Written as `acc + w * y` in one fusion, XLA:CPU's codegen contracts some
  # of the adds into FMAs depending on the surrounding program (e.g. whether an all_to_all
  # separates the combine from the expert side), which changed outputs by an ulp between a
  # 1-worker and a multi-worker mesh. (optimization_barrier does not help: it is expanded away
  # before fusion on CPU.)
  acc = jax.lax.fori_loop(0, top_k, lambda k, acc: acc + terms_KTD[k],
                          jnp.zeros((num_tokens, y_PD.shape[1]), jnp.float32))
  return acc.astype(y_PD.dtype)


def _block_tokens(num_tokens: int, dtype) -> int:
  packing = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
  for b in (128, 64, 32, 16, 8):
    if b % packing == 0 and num_tokens % b == 0:
      return b
  return num_tokens


def _combine_tpu(y_PD, row_dst_TK, weights_TK, *, interpret):
  """Grid over token blocks. Each token's K rows are DMAed from HBM into a [K, block, D] VMEM
  scratch (zeroed first, so skipped slots hold zeros), then summed in k order on the VPU. row_dst
  comes twice: flattened through scalar prefetch for the DMA addresses, and as a VMEM block for the
  validity mask of the vector sum."""
  num_src, d_dim = y_PD.shape
  num_tokens, top_k = row_dst_TK.shape
  block = _block_tokens(num_tokens, y_PD.dtype)

  def kernel(dst_smem, dst_ref, w_ref, y_hbm, out_ref, rows_ref, sem):
    base = pl.program_id(0) * block
    rows_ref[...] = jnp.zeros_like(rows_ref)

    def dma(t, k):
      src = jnp.clip(dst_smem[(base + t) * top_k + k], 0, num_src - 1)
      return pltpu.make_async_copy(
          y_hbm.at[pl.ds(src, 1)], rows_ref.at[k, pl.ds(t, 1)], sem
      )

    def for_each_valid(fn):
      def body(t, carry):
        for k in range(top_k):
          @pl.when(dst_smem[(base + t) * top_k + k] >= 0)
          def _():
            fn(dma(t, k))

        return carry

      lax.fori_loop(0, block, body, 0)

    for_each_valid(lambda c: c.start())
    for_each_valid(lambda c: c.wait())

    dst = dst_ref[...]
    w = w_ref[...]
    acc = jnp.zeros((block, d_dim), jnp.float32)
    for k in range(top_k):
      acc = acc + jnp.where(
          dst[:, k : k + 1] >= 0,
          w[:, k : k + 1].astype(jnp.float32) * rows_ref[k].astype(jnp.float32),
          0.0,
      )
    out_ref[...] = acc.astype(out_ref.dtype)

  tk_block = lambda i, dst_smem: (i, 0)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_tokens, d_dim), y_PD.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(num_tokens // block,),
          in_specs=[
              pl.BlockSpec((block, top_k), tk_block),
              pl.BlockSpec((block, top_k), tk_block),
              pl.BlockSpec(memory_space=pl.MemorySpace.ANY),
          ],
          out_specs=pl.BlockSpec((block, d_dim), tk_block),
          scratch_shapes=[
              pltpu.VMEM((top_k, block, d_dim), y_PD.dtype),
              pltpu.SemaphoreType.DMA(()),
          ],
      ),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
  )(row_dst_TK.reshape(-1), row_dst_TK, weights_TK, y_PD)
