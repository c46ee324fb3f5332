"""The decoder's KV cache as a pool of fixed-size pages, read and written through page tables.

`PagedKVCache` holds one worker's pool: k_pages, v_pages [num_layers, K, num_pages, page_size, hd]
(kv-head major, the layout of `flexfloor_jax.kernels.paged_attention`). A row's page table [M]
names the pages holding its positions in order (position t: page table[t // page_size], offset
t % page_size; an entry < 0 is "no page"). Which pages a row owns is decided by the caller: nothing
here allocates.
With M * page_size equal to a fixed-slot cache's length and the same values in the pages,
`decode_paged` is bitwise equal to `transformer.decode` for every live row (tested): the default
attention gathers the pages and runs the same attention math.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from flexfloor_jax.kernels.paged_attention import paged_attention_xla
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig

# attention(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B, *, sliding_window)
# -> [B, H, hd]: `flexfloor_jax.kernels.paged_attention.paged_attention` with an impl bound, or its
# reference.
PagedAttentionFn = Callable[..., jax.Array]


@flax.struct.dataclass
class PagedKVCache:
  """k_pages, v_pages [num_layers, K, num_pages, page_size, hd]."""
  k_pages: jax.Array
  v_pages: jax.Array

  @classmethod
  def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int) -> PagedKVCache:
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    return cls(jnp.zeros(shape, tfm.dtype_of(cfg)), jnp.zeros(shape, tfm.dtype_of(cfg)))

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[2]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[3]


def _page_of(cache: PagedKVCache, page_table_BM: jax.Array, pos: jax.Array, ok: jax.Array):
  """(page, offset) of positions `pos` [B, ...] of each row; the page is num_pages (out of range,
  so mode='drop' writes nothing) where `ok` is False, the position is negative or past the
  table, or the table's entry is < 0."""
  m = page_table_BM.shape[1]
  idx = pos // cache.page_size
  flat = jnp.clip(idx, 0, m - 1).reshape(pos.shape[0], -1)
  page = jnp.take_along_axis(page_table_BM, flat, axis=1).reshape(pos.shape)
  ok = ok & (pos >= 0) & (idx < m) & (page >= 0)
  return jnp.where(ok, page, cache.num_pages), pos % cache.page_size


def insert_paged(cache: PagedKVCache, k: jax.Array, v: jax.Array, page_table_PM: jax.Array,
                 lengths_P: jax.Array) -> PagedKVCache:
  """Write prefilled k/v [num_layers, P, T, K, hd] into the pages of each row's page table:
  positions t < lengths_P[p] only (the prompt, not its padding). A row of length <= 0 (no
  prefill) writes nothing, nor does a position whose table entry is < 0."""
  t = k.shape[2]
  pos_PT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (k.shape[1], t))
  page_PT, off_PT = _page_of(cache, page_table_PM, pos_PT, pos_PT < lengths_P[:, None])
  # [L, K, P, T, hd]: the advanced indices (page, offset) are adjacent, so they stay in place
  ck = cache.k_pages.at[:, :, page_PT, off_PT].set(jnp.moveaxis(k, 3, 1), mode="drop")
  cv = cache.v_pages.at[:, :, page_PT, off_PT].set(jnp.moveaxis(v, 3, 1), mode="drop")
  return PagedKVCache(ck, cv)


def decode_paged(params: tfm.Params, cfg: ModelConfig, cache: PagedKVCache,
                 page_table_BM: jax.Array, tokens_B: jax.Array, positions_B: jax.Array,
                 live_B: jax.Array, *, moe_fn: tfm.MoEFn | None = None,
                 attention: PagedAttentionFn = paged_attention_xla):
  """One decode step for every row: the token at `positions_B` is written at its page and
  attends to positions <= positions_B through the row's page table. A dead row (live_B False)
  writes nothing and its attention output is 0. Returns (logits [B, V] fp32, new cache, aux),
  the analogue of `transformer.decode`."""
  moe_fn = moe_fn or tfm.default_moe_fn(cfg)
  b = tokens_B.shape[0]
  pos_B1 = positions_B[:, None]
  lengths_B = jnp.where(live_B, positions_B + 1, 0).astype(jnp.int32)
  page_B, off_B = _page_of(cache, page_table_BM, positions_B, live_B)
  x = params["embed"][tokens_B][:, None]

  def layer(carry, lp):
    x, ck, cv = carry
    li = lp["layer"]
    q, k, v = tfm._qkv(cfg, lp, x, pos_B1)
    # [B, K, hd] values: li, page and offset are advanced indices split by a slice -> leading B
    ck = ck.at[li, :, page_B, off_B].set(k[:, 0], mode="drop")
    cv = cv.at[li, :, page_B, off_B].set(v[:, 0], mode="drop")
    # the sinks only where the model has them: the Pallas kernels take none
    sinks = {"sinks_H": lp["sinks"]} if cfg.attn_sinks else {}
    out_BHD = attention(q[:, 0], ck[li], cv[li], page_table_BM, lengths_B,
                        sliding_window=tfm.layer_window(cfg, lp), **sinks)
    x = x + tfm._attn_out(cfg, lp, out_BHD.reshape(b, 1, -1))
    x, aux = tfm._mlp(cfg, lp, x, live_B[:, None], moe_fn)
    return (x, ck, cv), aux

  (x, ck, cv), aux = tfm.scan_layers(layer, (x, cache.k_pages, cache.v_pages),
                                     tfm._layer_xs(params, cfg))
  return tfm._logits(params, cfg, x[:, 0]), PagedKVCache(ck, cv), aux
