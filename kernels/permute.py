"""Row gather into (and out of) the padded tile layout: out[p] = x[row_src[p]], 0 where
row_src[p] < 0.

Passing `plan.row_src` dispatches token copies into the padded layout; passing `plan.row_dst`
gathers them back (unpermute). impl='xla' is `jnp.take` + `where` (the CPU default: a Pallas gather
in interpret mode is orders of magnitude slower). impl='pallas' picks, at lowering time, a Mosaic
TPU kernel (indices through scalar prefetch (SMEM), one DMA per row from HBM into the VMEM output
block), a Pallas Triton kernel on cuda (`_permute_gpu`: a program per [rows, cols] output block,
one masked vector load of its source rows; padding rows are not read), the XLA gather on ROCm, or
on any other platform the TPU kernel in interpret mode. `interpret=True` runs the TPU kernel in
interpret mode everywhere; `_permute_gpu(..., interpret=True)` is the GPU kernel's CPU test path.
Both impls share one backward pass (the XLA gather's transpose).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flexfloor_jax.kernels import triton_util


def permute(
    x_RD: jax.Array, row_src: jax.Array, *, impl: str = "xla", interpret: bool = False
) -> jax.Array:
  """Gathers rows of x_RD by `row_src` (int32[P], -1 = zero row) into out_PD.

  Differentiable w.r.t. x_RD for both impls: the gradient is the XLA gather's transpose (a
  scatter-add), so impl='pallas' trains with the same backward pass as impl='xla'.
  """
  if x_RD.ndim != 2 or row_src.ndim != 1:
    raise ValueError(f"expected x [R, D] and row_src [P], got {x_RD.shape}, {row_src.shape}")
  row_src = row_src.astype(jnp.int32)
  if impl == "xla":
    return permute_xla(x_RD, row_src)
  if impl != "pallas":
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
  return _permute_pallas(x_RD, row_src, bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute_pallas(x_RD, row_src, interpret):
  interp = functools.partial(_permute_tpu, interpret=True)
  if interpret:
    return interp(x_RD, row_src)
  return lax.platform_dependent(
      x_RD,
      row_src,
      tpu=functools.partial(_permute_tpu, interpret=False),
      cuda=functools.partial(_permute_gpu, interpret=False),
      # no compiled Pallas kernel for ROCm here: the XLA gather rather than the interpreter
      rocm=permute_xla,
      default=interp,
  )


def _permute_pallas_fwd(x_RD, row_src, interpret):
  # x is a residual only for its shape (the gather's transpose does not read it): unused in the
  # backward program, so XLA drops it.
  return _permute_pallas(x_RD, row_src, interpret), (x_RD, row_src)


def _permute_pallas_bwd(interpret, res, d_out):
  del interpret
  x_RD, row_src = res
  _, vjp = jax.vjp(lambda x: permute_xla(x, row_src), x_RD)
  return vjp(d_out)[0], None


_permute_pallas.defvjp(_permute_pallas_fwd, _permute_pallas_bwd)


def permute_xla(x_RD: jax.Array, row_src: jax.Array) -> jax.Array:
  """XLA reference: clamp-gather then zero the padding rows."""
  rows = jnp.take(x_RD, jnp.maximum(row_src, 0), axis=0, mode="clip")
  return jnp.where((row_src >= 0)[:, None], rows, jnp.zeros((), x_RD.dtype))


def _block_rows(num_rows: int, dtype) -> int:
  """Rows per grid step: a multiple of the sublane packing (8 for 32-bit) that divides P."""
  packing = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
  for b in (256, 128, 64, 32, 16, 8):
    if b % packing == 0 and num_rows % b == 0:
      return b
  return num_rows  # full extent is always a legal block


def _permute_tpu(x_RD, row_src, *, interpret):
  """Grid over blocks of output rows; x stays in HBM (memory_space=ANY) and each valid row is one
  DMA into the output block. The block is zeroed first so padding rows need no dynamic-offset
  store. Indices live in SMEM, so P is bounded by SMEM size (fine for decode-sized batches)."""
  num_src, d_dim = x_RD.shape
  (num_rows,) = row_src.shape
  block = _block_rows(num_rows, x_RD.dtype)

  def kernel(src_ref, x_hbm, out_ref, sem):
    base = pl.program_id(0) * block
    out_ref[...] = jnp.zeros_like(out_ref)

    def dma(j):
      src = jnp.clip(src_ref[base + j], 0, num_src - 1)
      return pltpu.make_async_copy(x_hbm.at[pl.ds(src, 1)], out_ref.at[pl.ds(j, 1)], sem)

    def start(j, carry):
      @pl.when(src_ref[base + j] >= 0)
      def _():
        dma(j).start()

      return carry

    def wait(j, carry):
      @pl.when(src_ref[base + j] >= 0)
      def _():
        dma(j).wait()

      return carry

    lax.fori_loop(0, block, start, 0)
    lax.fori_loop(0, block, wait, 0)

  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_rows, d_dim), x_RD.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(num_rows // block,),
          in_specs=[pl.BlockSpec(memory_space=pl.MemorySpace.ANY)],
          out_specs=pl.BlockSpec((block, d_dim), lambda i, src_ref: (i, 0)),
          scratch_shapes=[pltpu.SemaphoreType.DMA(())],
      ),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
  )(row_src, x_RD)


def _permute_gpu(x_RD, row_src, *, interpret):
  """Pallas Triton kernel: grid (row blocks, column blocks); each program loads its block of
  row_src, clamps it like `permute_xla` (`take(..., mode='clip')`) and reads the [rows, cols] block
  of source rows with one masked load (rows with row_src < 0 are not read and come out 0)."""
  num_src, d_dim = x_RD.shape
  (num_rows,) = row_src.shape
  if num_rows == 0 or d_dim == 0:
    return jnp.zeros((num_rows, d_dim), x_RD.dtype)
  rows, cols = triton_util.blocks(num_rows, d_dim)

  def kernel(src_ref, x_ref, out_ref):
    src = src_ref[...]
    valid = src >= 0
    safe = jnp.clip(src, 0, num_src - 1)
    out_ref[...] = triton_util.gather_rows(x_ref, safe, valid, cols)

  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_rows, d_dim), x_RD.dtype),
      grid=(num_rows // rows, d_dim // cols),
      in_specs=[
          pl.BlockSpec((rows,), lambda i, j: (i,)),
          # every source row, one column block: the rows are picked inside the kernel
          pl.BlockSpec((num_src, cols), lambda i, j: (0, j)),
      ],
      out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
      compiler_params=triton_util.compiler_params(),
      interpret=interpret,
      name="permute_gpu",
  )(row_src, x_RD)
