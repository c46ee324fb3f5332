"""GQA decode attention that reads each sequence's keys and values through a page table.

Layout (one layer of a paged KV pool, kv-head major, as both JAX library kernels take it):
  q_BHD            [B, H, D]       the decode token's queries (rotary already applied)
  k/v_pages_KPSD   [K, P, S, D]    K kv heads, P pages of S positions each
  page_table_BM    int32 [B, M]    sequence b's position t lives in page page_table_BM[b, t // S]
                                   at offset t % S; an entry < 0 is "no page" (read as page 0,
                                   never attended to by a well-formed table)
  lengths_B        int32 [B]       keys at positions < lengths_B[b] are attended to; the query
                                   is at position lengths_B[b] - 1. A row of length 0 returns 0.
  -> out_BHD       [B, H, D]

`paged_attention_xla`, the reference and the CPU default, gathers the pages into a contiguous
[B, M*S, K, D] view and runs the model's own decode attention (`transformer.attend` with
`transformer.attention_mask`): with M*S equal to a fixed-slot cache's length and the same values
in the pages, it is bitwise equal to `transformer.decode`'s attention.

impl='pallas' adapts the Pallas paged-attention kernels that ship with JAX:
`jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic TPU) and
`jax.experimental.pallas.ops.gpu.paged_attention` (Pallas Triton, cuda), picked at lowering time.
Neither takes a softmax scale (q is scaled before the call) nor a sliding window (refused), so they
agree with the reference to rounding, not bitwise. The TPU kernel computes with k and v rounded to
bfloat16 whatever their dtype. `interpret=True` runs the TPU kernel in interpret mode everywhere
(the CPU test path); `paged_attention_gpu(..., interpret=True)` is the GPU kernel's CPU test path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

from flexfloor_jax.model import transformer as tfm


def paged_attention(q_BHD: jax.Array, k_pages_KPSD: jax.Array, v_pages_KPSD: jax.Array,
                    page_table_BM: jax.Array, lengths_B: jax.Array, *,
                    sliding_window: int | None = None, impl: str = "xla",
                    interpret: bool = False, sinks_H: jax.Array | None = None) -> jax.Array:
  """Paged GQA decode attention (layout in the module docstring); impl 'xla' | 'pallas'.
  `sinks_H`: a logit per head in each softmax's denominator (GPT-OSS; the XLA path only)."""
  if impl == "xla":
    return paged_attention_xla(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B,
                               sliding_window=sliding_window, sinks_H=sinks_H)
  if impl != "pallas":
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
  if sinks_H is not None:
    raise ValueError("the Pallas paged-attention kernels take no attention sinks; use impl='xla'")
  args = (q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B)
  if interpret:
    return paged_attention_tpu(*args, sliding_window=sliding_window, interpret=True)
  return lax.platform_dependent(
      *args,
      tpu=functools.partial(paged_attention_tpu, sliding_window=sliding_window),
      cuda=functools.partial(paged_attention_gpu, sliding_window=sliding_window),
      # no compiled kernel for ROCm or CPU here: the XLA reference, not an interpreter
      default=functools.partial(paged_attention_xla, sliding_window=sliding_window),
  )


def gather_pages(pages_KPSD: jax.Array, page_table_BM: jax.Array) -> jax.Array:
  """The pages of each row, in page-table order, as one contiguous [B, M*S, K, D] view."""
  k, p, s, d = pages_KPSD.shape
  b, m = page_table_BM.shape
  pages_KBMSD = jnp.take(pages_KPSD, jnp.clip(page_table_BM, 0, p - 1), axis=1)
  return jnp.transpose(pages_KBMSD, (1, 2, 3, 0, 4)).reshape(b, m * s, k, d)


def paged_attention_xla(q_BHD: jax.Array, k_pages_KPSD: jax.Array, v_pages_KPSD: jax.Array,
                        page_table_BM: jax.Array, lengths_B: jax.Array, *,
                        sliding_window: int | jax.Array | None = None,
                        sinks_H: jax.Array | None = None) -> jax.Array:
  """Reference: gather the pages, then the fixed-slot decode's attention over them. The window
  may be traced (a model whose layers differ: transformer.layer_window)."""
  b, h, d = q_BHD.shape
  _check(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B)
  k_BSKD = gather_pages(k_pages_KPSD, page_table_BM)
  v_BSKD = gather_pages(v_pages_KPSD, page_table_BM)
  s = k_BSKD.shape[1]
  k_pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  mask_B1S = tfm.attention_mask((lengths_B - 1)[:, None], k_pos_BS, jnp.ones((b, s), bool),
                                sliding_window)
  out_BHD = tfm.attend(q_BHD[:, None], k_BSKD, v_BSKD, mask_B1S, sinks_H)[:, 0].reshape(b, h, d)
  return _zero_empty_rows(out_BHD, lengths_B)


def _check(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B):
  b, h, d = q_BHD.shape
  k = k_pages_KPSD.shape[0]
  if k_pages_KPSD.ndim != 4 or k_pages_KPSD.shape != v_pages_KPSD.shape:
    raise ValueError(f"k/v pages must both be [K, P, S, D], got {k_pages_KPSD.shape}, "
                     f"{v_pages_KPSD.shape}")
  if h % k or k_pages_KPSD.shape[3] != d:
    raise ValueError(f"q {q_BHD.shape} does not fit kv pages {k_pages_KPSD.shape}")
  if page_table_BM.ndim != 2 or page_table_BM.shape[0] != b or lengths_B.shape != (b,):
    raise ValueError(f"page table {page_table_BM.shape} / lengths {lengths_B.shape} do not fit "
                     f"batch {b}")


def _zero_empty_rows(out_BHD, lengths_B):
  return jnp.where((lengths_B > 0)[:, None, None], out_BHD, jnp.zeros((), out_BHD.dtype))


def _kernel_inputs(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B, sliding_window):
  """Checks, then q scaled by 1/sqrt(D) (the library kernels take no scale) and the table and
  lengths clamped to what the kernels may read."""
  if sliding_window is not None:
    raise ValueError("the Pallas paged-attention kernels have no sliding window: use impl='xla'")
  _check(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B)
  p, s, d = k_pages_KPSD.shape[1:]
  m = page_table_BM.shape[1]
  q = (q_BHD.astype(jnp.float32) * (1.0 / math.sqrt(d))).astype(q_BHD.dtype)
  table = jnp.clip(page_table_BM.astype(jnp.int32), 0, p - 1)
  lengths = jnp.clip(lengths_B.astype(jnp.int32), 0, m * s)
  return q, table, lengths


def _largest_divisor(n: int, at_most: int) -> int:
  return max(c for c in range(1, min(n, max(at_most, 1)) + 1) if n % c == 0)


def paged_attention_tpu(q_BHD: jax.Array, k_pages_KPSD: jax.Array, v_pages_KPSD: jax.Array,
                        page_table_BM: jax.Array, lengths_B: jax.Array, *,
                        sliding_window: int | None = None,
                        interpret: bool = False) -> jax.Array:
  """The JAX Mosaic TPU paged-attention kernel on this layout. Blocks of up to 512 positions."""
  q, table, lengths = _kernel_inputs(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B,
                                     sliding_window)
  s, m = k_pages_KPSD.shape[2], table.shape[1]
  call = functools.partial(tpu_paged, pages_per_compute_block=_largest_divisor(m, 512 // s))
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      out = call(q, k_pages_KPSD, v_pages_KPSD, lengths, table)
  else:
    out = call(q, k_pages_KPSD, v_pages_KPSD, lengths, table)
  return _zero_empty_rows(out.astype(q_BHD.dtype), lengths)


def paged_attention_gpu(q_BHD: jax.Array, k_pages_KPSD: jax.Array, v_pages_KPSD: jax.Array,
                        page_table_BM: jax.Array, lengths_B: jax.Array, *,
                        sliding_window: int | None = None,
                        interpret: bool = False) -> jax.Array:
  """The JAX Pallas Triton paged-attention kernel on this layout: the pages split over up to 16
  programs per row (flash-decoding), up to 8 pages per compute block."""
  q, table, lengths = _kernel_inputs(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B,
                                     sliding_window)
  m = table.shape[1]
  k_splits = _largest_divisor(m, 16)
  out = gpu_paged.paged_attention(
      q, k_pages_KPSD, v_pages_KPSD, table, lengths, block_h=16,
      pages_per_compute_block=_largest_divisor(m // k_splits, 8), k_splits=k_splits,
      interpret=interpret)
  return _zero_empty_rows(out.astype(q_BHD.dtype), lengths)
