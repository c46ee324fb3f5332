"""Shared pieces of the Pallas Triton (GPU) row kernels in `flexfloor_jax.kernels.permute` and
`flexfloor_jax.kernels.combine`.

Both kernels gather whole rows by a dynamic index vector: a program owns a [rows, cols] output
block, loads its row indices as a vector, and reads the source rows with one masked Triton load of
a [rows, cols] block of pointers (`x_ref.at[row_ids, col_ids]`, both index arrays broadcast to the
block shape). Rows whose index is negative are masked off, so padding rows cost no memory reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

# Columns per program: D is blocked so a row of a large model (D = 4096) spreads over several
# programs, which keeps the grid large enough to fill the GPU at decode batch sizes (a few dozen
# rows). 512 bf16/fp32 elements are 1-2 KiB of contiguous memory per row: full 128-byte lines.
MAX_BLOCK_COLS = 512
# Elements per program (rows x cols): with 4 warps, 32 per thread, so the fp32 accumulator of the
# combine and a row block stay in registers.
MAX_BLOCK_ELEMS = 4096
MAX_BLOCK_ROWS = 32
NUM_WARPS = 4


def pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two that divides n and is <= cap (1 for odd n).

  Triton tensors must have power-of-two sizes and the Pallas Triton lowering does not mask blocks
  that run past the array's end, so blocks divide the array exactly; an awkward size only makes
  the blocks smaller, never the result different.
  """
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def blocks(num_rows: int, d_dim: int) -> tuple[int, int]:
  """(rows, cols) per program for an output of [num_rows, d_dim]."""
  cols = pow2_divisor(d_dim, MAX_BLOCK_COLS)
  rows = pow2_divisor(num_rows, min(MAX_BLOCK_ROWS, max(1, MAX_BLOCK_ELEMS // cols)))
  return rows, cols


def compiler_params() -> pltriton.CompilerParams:
  # Explicit Triton params: pallas_call then lowers with the Triton backend for cuda whatever
  # `jax_pallas_use_mosaic_gpu` says.
  return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def gather_rows(src_ref, row_ids, valid, cols: int):
  """Loads src_ref[row_ids[r], 0:cols] for every r of the block, zeros where `valid` is False.

  row_ids must be in range (clamped by the caller); masked rows are not read.
  """
  rows = row_ids.shape[0]
  row_idx = jnp.broadcast_to(row_ids[:, None], (rows, cols))
  col_idx = jnp.broadcast_to(jnp.arange(cols, dtype=jnp.int32)[None, :], (rows, cols))
  mask = jnp.broadcast_to(valid[:, None], (rows, cols))
  return pltriton.load(src_ref.at[row_idx, col_idx], mask=mask, other=0)


def mul_rn_f32(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
  """fp32 a * b, rounded on its own: never contracted with a following add into an FMA.

  ptxas (and LLVM's NVPTX backend) fuse a plain mul.f32 + add.f32 pair into fma.rn.f32, which
  rounds once instead of twice and so changes the combine's sum; a multiply with an explicit
  rounding modifier (mul.rn) is never fused. Inline PTX has no CPU equivalent, so interpret mode
  (CPU tests) multiplies with `*`.
  """
  if interpret:
    return a * b
  [out] = pltriton.elementwise_inline_asm(
      "mul.rn.f32 $0, $1, $2;",
      args=[a, b],
      constraints="=f,f,f",
      pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
  )
  return out
