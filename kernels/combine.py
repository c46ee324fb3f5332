"""Weighted top-k combine: out[t] = sum_{k=0..K-1} weights[t, k] * y[row_dst[t, k]] (row_dst < 0
skipped).

The sum is fp32 and strictly sequential in k (acc = acc + term_k), never a tree reduction, so a
token's output does not depend on where its expert copies were computed or how XLA would choose to
reduce (DESIGN.md "fixed reduction orders"). Each product w * y is rounded to fp32 before it is
added, never fused into an FMA (combine_xla keeps the multiplies out of its accumulation loop's
body; the GPU kernel multiplies with PTX mul.rn), and a skipped slot adds nothing even when its
weight is inf/nan. impl='xla' unrolls K (small, static) gathers; impl='pallas' picks, at lowering
time, a Mosaic TPU kernel (row_dst through scalar prefetch, one DMA per expert copy), a Pallas
Triton kernel on cuda (`_combine_gpu`: a program per [tokens, cols] output block, K masked vector
loads summed in k order), the XLA version on ROCm, or on any other platform the TPU kernel in
interpret mode. `interpret=True` runs the TPU kernel in interpret mode everywhere;
`_combine_gpu(..., interpret=True)` is the GPU kernel's CPU test path. Both impls share one
backward pass (combine_xla's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flexfloor_jax.kernels import triton_util


def combine(
    y_PD: jax.Array,
    row_dst_TK: jax.Array,
    weights_TK: jax.Array,
    *,
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:
  """Returns out_TD (y's dtype): fixed-order fp32 weighted sum of each token's K expert rows.

  Differentiable w.r.t. y and the weights for both impls; impl='pallas' trains with combine_xla's
  backward pass.
  """
  if y_PD.ndim != 2 or row_dst_TK.ndim != 2 or row_dst_TK.shape != weights_TK.shape:
    raise ValueError(f"bad shapes: y {y_PD.shape}, row_dst {row_dst_TK.shape}, "
                     f"w {weights_TK.shape}")
  row_dst_TK = row_dst_TK.astype(jnp.int32)
  if impl == "xla":
    return combine_xla(y_PD, row_dst_TK, weights_TK)
  if impl != "pallas":
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
  return _combine_pallas(y_PD, row_dst_TK, weights_TK, bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_pallas(y_PD, row_dst_TK, weights_TK, interpret):
  interp = functools.partial(_combine_tpu, interpret=True)
  if interpret:
    return interp(y_PD, row_dst_TK, weights_TK)
  return lax.platform_dependent(
      y_PD,
      row_dst_TK,
      weights_TK,
      tpu=functools.partial(_combine_tpu, interpret=False),
      cuda=functools.partial(_combine_gpu, interpret=False),
      # no compiled Pallas kernel for ROCm here: the XLA version rather than the interpreter
      rocm=combine_xla,
      default=interp,
  )


def _combine_pallas_fwd(y_PD, row_dst_TK, weights_TK, interpret):
  out = _combine_pallas(y_PD, row_dst_TK, weights_TK, interpret)
  return out, (y_PD, row_dst_TK, weights_TK)


def _combine_pallas_bwd(interpret, res, d_out):
  del interpret
  y_PD, row_dst_TK, weights_TK = res
  _, vjp = jax.vjp(lambda y, w: combine_xla(y, row_dst_TK, w), y_PD, weights_TK)
  d_y, d_w = vjp(d_out)
  return d_y, None, d_w


_combine_pallas.defvjp(_combine_pallas_fwd, _combine_pallas_bwd)


def _term(w_T, rows_TD, valid_T):
  """One k's contribution; `where` (not w * 0) so a skipped slot adds nothing even if w is
  inf/nan."""
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
          def _(k=k):
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

  def tk_block(i, dst_smem):
    return (i, 0)

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


def _combine_gpu(y_PD, row_dst_TK, weights_TK, *, interpret):
  """Pallas Triton kernel: grid (token blocks, column blocks). A program holds a [tokens, cols]
  fp32 accumulator and, for k = 0..K-1 in order, loads column k of its row_dst / weights block,
  gathers the K-th expert rows with one masked load (skipped slots are not read) and adds
  where(valid, w * y, 0): the same operations, in the same order, as `combine_xla`."""
  num_src, d_dim = y_PD.shape
  num_tokens, top_k = row_dst_TK.shape
  if num_tokens == 0 or d_dim == 0:
    return jnp.zeros((num_tokens, d_dim), y_PD.dtype)
  rows, cols = triton_util.blocks(num_tokens, d_dim)

  def kernel(dst_ref, w_ref, y_ref, out_ref):
    terms = []
    for k in range(top_k):
      idx = dst_ref[:, k]
      valid = idx >= 0
      y = triton_util.gather_rows(y_ref, jnp.clip(idx, 0, num_src - 1), valid, cols)
      w = jnp.broadcast_to(w_ref[:, k].astype(jnp.float32)[:, None], (rows, cols))
      prod = triton_util.mul_rn_f32(w, y.astype(jnp.float32), interpret=interpret)
      terms.append(jnp.where(jnp.broadcast_to(valid[:, None], (rows, cols)), prod, 0.0))
    acc = jnp.zeros((rows, cols), jnp.float32)
    if interpret:
      # XLA:CPU contracts a multiply and an add of one fusion into an FMA, also across the
      # select; a loop over the stacked products gives every add its own loop body, as
      # combine_xla does. (Compiled, mul.rn already keeps each product rounded on its own.)
      terms_K = jnp.stack(terms)
      acc = lax.fori_loop(0, top_k, lambda k, acc: acc + terms_K[k], acc)
    else:
      for term in terms:
        acc = acc + term
    out_ref[...] = acc.astype(out_ref.dtype)

  tk_block = pl.BlockSpec((rows, top_k), lambda i, j: (i, 0))
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_tokens, d_dim), y_PD.dtype),
      grid=(num_tokens // rows, d_dim // cols),
      in_specs=[
          tk_block,
          tk_block,
          # every expert row, one column block: the rows are picked inside the kernel
          pl.BlockSpec((num_src, cols), lambda i, j: (0, j)),
      ],
      out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
      compiler_params=triton_util.compiler_params(),
      interpret=interpret,
      name="combine_gpu",
  )(row_dst_TK, weights_TK, y_PD)
