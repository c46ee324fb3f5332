"""Shared definitions for the kernel tests (CPU and GPU files)."""

import jax
import jax.numpy as jnp
import numpy as np


def combine_numpy(y, row_dst, w):
  """The combine's numerics in numpy: each fp32 product rounded, then added in k order."""
  acc = np.zeros((row_dst.shape[0], y.shape[1]), np.float32)
  for k in range(row_dst.shape[1]):
    valid = (row_dst[:, k] >= 0)[:, None]
    term = w[:, k, None].astype(np.float32) * y[np.maximum(row_dst[:, k], 0)].astype(np.float32)
    acc = acc + np.where(valid, term, np.float32(0))
  return acc


def paged_attention_inputs(seed, dtype, *, heads=8, kv_heads=2, head_dim=32, page=8, pages=24,
                           m=4, bf16_values=False):
  """Paged-attention inputs (kernels/paged_attention.py's layout). Ragged lengths: 1, exactly one
  page, mid-page, every position, empty, exactly two pages; shuffled non-contiguous pages;
  entries past a row's length are -1 for some rows."""
  rng = np.random.default_rng(seed)
  lengths = np.array([1, page, page + 3, m * page, 0, 2 * page], np.int32)
  b = len(lengths)
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, heads, head_dim), jnp.float32)
  kp = jax.random.normal(ks[1], (kv_heads, pages, page, head_dim), jnp.float32)
  vp = jax.random.normal(ks[2], (kv_heads, pages, page, head_dim), jnp.float32)
  if bf16_values:  # values the TPU kernel's bf16 rounding of k/v leaves unchanged
    kp, vp = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (kp, vp))
  table = rng.permutation(pages)[: b * m].reshape(b, m).astype(np.int32)
  for r in (0, 2):
    used = -(-lengths[r] // page)
    table[r, used:] = -1
  def cast(x):
    return x.astype(dtype)
  return cast(q), cast(kp), cast(vp), jnp.asarray(table), jnp.asarray(lengths)
