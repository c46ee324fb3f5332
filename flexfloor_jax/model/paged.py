"""The decoder's KV cache as a pool of fixed-size pages, read and written through page tables.

`PagedKVCache` holds one worker's pool: k_pages, v_pages [num layers in pages, K, num_pages,
page_size, hd] (kv-head major, the layout of `flexfloor_jax.kernels.paged_attention`). A row's
page table [M] names the pages holding its positions in order (position t: page
table[t // page_size], offset t % page_size; an entry < 0 is "no page"). Which pages a row owns is
decided by the caller: nothing here allocates.
Sliding layers whose window is shorter than a sequence keep no pages: each sequence row has a ring
of its window (plus chunk - 1 positions where a step carries up to `chunk` prompt rows of one
sequence) per sliding layer beside the pool (k_ring, v_ring [num ring layers, rows, R, K, hd];
transformer.KVLayout says why), and the pages hold the other layers only. A pool made without
rows keeps every layer in its pages.
A decode step's query rows are decode tokens or prompt tokens (chunked prefill) alike: each
brings its sequence's page table row, and `rows_B` names its sequence row for the rings.
With M * page_size equal to a fixed-slot cache's length and the same values in the pages (and
rings), `decode_paged` is bitwise equal to `transformer.decode` for every live row (tested): the
default attention gathers the pages and runs the same attention math, and a ring layer runs the
fixed-slot cache's own ring attention.
Multi-head latent attention (DeepSeek-V3) pages its latent cache the same way: k_pages holds the
latent [L, 1, pages, page_size, kv_lora_rank], v_pages the roped key [.., qk_rope_head_dim], and
a decode step gathers a row's pages and runs the fixed-slot decode's absorbed attention over
them (the paged-attention kernels are GQA's; `attention` is not used for such a model).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from flexfloor_jax.kernels.paged_attention import gather_pages, paged_attention_xla
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig

# attention(q_BHD, k_pages_KPSD, v_pages_KPSD, page_table_BM, lengths_B, *, sliding_window)
# -> [B, H, hd]: `flexfloor_jax.kernels.paged_attention.paged_attention` with an impl bound, or its
# reference.
PagedAttentionFn = Callable[..., jax.Array]


@flax.struct.dataclass
class PagedKVCache:
  """k_pages, v_pages [num layers in pages, K, num_pages, page_size, hd]; k_ring, v_ring
  [num ring layers, rows, R, K, hd] for the sliding layers of `ring_layers`, or None (every layer
  in the pages)."""
  k_pages: jax.Array
  v_pages: jax.Array
  k_ring: jax.Array | None = None
  v_ring: jax.Array | None = None
  ring_layers: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

  @classmethod
  def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, rows: int = 0,
            max_len: int = 0, chunk: int = 1) -> PagedKVCache:
    """A pool of `num_pages` pages. `rows` > 0: the pool serves that many sequence rows of at
    most `max_len` tokens, and the sliding layers whose window is shorter keep rings
    (transformer.kv_layout) instead of pages, sized for steps of up to `chunk` query rows per
    sequence."""
    lay = tfm.kv_layout(cfg, max_len, ring=rows > 0, chunk=chunk)
    dt = tfm.dtype_of(cfg)
    heads, kd, vd = cfg.kv_dims()  # MLA: the latent in k, the RoPE key in v
    shape = (len(lay.full_layers), heads, num_pages, page_size, kd)
    if not lay.ring_layers:
      return cls(jnp.zeros(shape, dt), jnp.zeros(shape[:-1] + (vd,), dt))
    rshape = (len(lay.ring_layers), rows, lay.ring_len, cfg.num_kv_heads, cfg.head_dim)
    return cls(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros(rshape, dt),
               jnp.zeros(rshape, dt), ring_layers=lay.ring_layers)

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
                 lengths_P: jax.Array, rows_P: jax.Array | None = None) -> PagedKVCache:
  """Write prefilled k/v [num_layers, P, T, K, hd] into the pages of each row's page table:
  positions t < lengths_P[p] only (the prompt, not its padding). A row of length <= 0 (no
  prefill) writes nothing, nor does a position whose table entry is < 0. A pool with rings
  writes its ring layers into the rings of sequence rows `rows_P` (< 0: none), the last R
  positions of each prompt."""
  t = k.shape[2]
  pos_PT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (k.shape[1], t))
  page_PT, off_PT = _page_of(cache, page_table_PM, pos_PT, pos_PT < lengths_P[:, None])
  ring = cache.k_ring is not None and cache.v_ring is not None
  full, ring_idx = tfm.split_layers(k.shape[0], cache.ring_layers)
  kf, vf = (k[full], v[full]) if ring else (k, v)
  # [L, K, P, T, hd]: the advanced indices (page, offset) are adjacent, so they stay in place
  ck = cache.k_pages.at[:, :, page_PT, off_PT].set(jnp.moveaxis(kf, 3, 1), mode="drop")
  cv = cache.v_pages.at[:, :, page_PT, off_PT].set(jnp.moveaxis(vf, 3, 1), mode="drop")
  if not ring:
    return PagedKVCache(ck, cv)
  if rows_P is None:
    raise ValueError("insert_paged into a pool with rings needs the sequence rows rows_P")
  assert cache.k_ring is not None and cache.v_ring is not None  # ring
  rk, rv = tfm.insert_ring(cache.k_ring, cache.v_ring, k[ring_idx], v[ring_idx],
                           jnp.where(lengths_P > 0, rows_P, -1), lengths_P)
  return PagedKVCache(ck, cv, rk, rv, ring_layers=cache.ring_layers)


def mla_paged_attention(cfg: ModelConfig, lp: tfm.Params, q_B1HQ: jax.Array,
                        latent_pages: jax.Array, kpe_pages: jax.Array, page_table_BM: jax.Array,
                        lengths_B: jax.Array) -> jax.Array:
  """One layer's MLA for a decode token per row over its pages: [B, 1, H*v]; 0 for a dead row
  (length 0). The gathered rows have the fixed-slot cache's shape when the table spans its
  length, and the same mask, so this is transformer.decode's attention bit for bit."""
  b = q_B1HQ.shape[0]
  latent_BS1R = gather_pages(latent_pages, page_table_BM)
  kpe_BS1r = gather_pages(kpe_pages, page_table_BM)
  s = latent_BS1R.shape[1]
  k_pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  mask_B1S = tfm.attention_mask((lengths_B - 1)[:, None], k_pos_BS, jnp.ones((b, s), bool), None)
  out = tfm.mla_attend_absorbed(cfg, lp, q_B1HQ, latent_BS1R, kpe_BS1r, mask_B1S)
  return jnp.where((lengths_B > 0)[:, None, None], out, jnp.zeros((), out.dtype))


def decode_paged(params: tfm.Params, cfg: ModelConfig, cache: PagedKVCache,
                 page_table_BM: jax.Array, tokens_B: jax.Array, positions_B: jax.Array,
                 live_B: jax.Array, *, moe_fn: tfm.MoEFn | None = None,
                 attention: PagedAttentionFn = paged_attention_xla,
                 rows_B: jax.Array | None = None):
  """One decode step of Q query rows, the analogue of `transformer.decode`: the token of query
  row i at positions_B[i] is written at its page through page_table_BM[i] (its sequence's table
  row) and attends to positions <= its own through that table; a ring layer writes and reads
  the ring of sequence row rows_B[i] (None: row i) instead. Prompt tokens are query rows like
  decode tokens (chunked prefill): rows of one sequence share its table row and ring row, every
  layer writes them all before any reads, and its rings hold window + chunk - 1 positions
  (transformer.KVLayout). A dead row (live_B False) writes nothing and its attention output is
  0; a live row whose rows_B is out of range writes no ring (its pages follow its table) and
  its ring attention is 0. Returns (logits [Q, V] fp32, new cache, aux)."""
  moe_fn = moe_fn or tfm.default_moe_fn(cfg)
  b = tokens_B.shape[0]
  pos_B1 = positions_B[:, None]
  lengths_B = jnp.where(live_B, positions_B + 1, 0).astype(jnp.int32)
  page_B, off_B = _page_of(cache, page_table_BM, positions_B, live_B)
  x = params["embed"][tokens_B][:, None]

  if cache.k_ring is None or cache.v_ring is None:
    def layer(carry, lp):
      x, ck, cv = carry
      li = lp["layer"]
      q, k, v = tfm._qkv(cfg, lp, x, pos_B1)
      # [B, K, hd] values: li, page and offset are advanced indices split by a slice -> leading B
      ck = ck.at[li, :, page_B, off_B].set(k[:, 0], mode="drop")
      cv = cv.at[li, :, page_B, off_B].set(v[:, 0], mode="drop")
      if cfg.mla:
        out = mla_paged_attention(cfg, lp, q, ck[li], cv[li], page_table_BM, lengths_B)
      else:
        # the sinks only where the model has them: the Pallas kernels take none
        sinks = {"sinks_H": lp["sinks"]} if cfg.attn_sinks else {}
        out = attention(q[:, 0], ck[li], cv[li], page_table_BM, lengths_B,
                        sliding_window=tfm.layer_window(cfg, lp), **sinks).reshape(b, 1, -1)
      x = x + tfm._attn_out(cfg, lp, out)
      x, aux = tfm._mlp(cfg, lp, x, live_B[:, None], moe_fn)
      return (x, ck, cv), aux

    (x, ck, cv), aux = tfm.scan_layers(layer, (x, cache.k_pages, cache.v_pages),
                                       tfm._layer_xs(params, cfg))
    return tfm._logits(params, cfg, x[:, 0]), PagedKVCache(ck, cv), aux

  r = cache.k_ring.shape[2]
  tfm._check_ring(cfg, cache.ring_layers, r)
  has_full = cache.k_pages.shape[0] > 0
  n_rows = cache.k_ring.shape[1]
  # a dead row's ring write, or one at a position its table cannot hold (as its pages drop):
  # out of range, dropped
  span = page_table_BM.shape[1] * cache.page_size
  w_rows, r_rows = tfm.query_rows(rows_B, live_B & (positions_B >= 0) & (positions_B < span),
                                  n_rows)
  ring_live_B = live_B if rows_B is None else live_B & (rows_B >= 0) & (rows_B < n_rows)

  def ring_layer(carry, lp):
    x, ck, cv, rk, rv = carry
    fi, ri = lp["full_idx"], lp["ring_idx"]
    q, k, v = tfm._qkv(cfg, lp, x, pos_B1)
    if has_full:
      ck = ck.at[fi, :, page_B, off_B].set(k[:, 0], mode="drop")
      cv = cv.at[fi, :, page_B, off_B].set(v[:, 0], mode="drop")
    rk, rv = tfm.write_ring(rk, rv, ri, w_rows, positions_B, k, v)
    sinks = tfm._sinks(cfg, lp)

    def full():
      # the pages hold full layers only: no window (the sliding layers are the rings)
      kw = {"sinks_H": sinks} if sinks is not None else {}
      out_BHD = attention(q[:, 0], ck[fi], cv[fi], page_table_BM, lengths_B,
                          sliding_window=None, **kw)
      return out_BHD.reshape(b, 1, -1).astype(q.dtype)

    def ring():
      k_w, v_w, m_w = tfm.ring_window(cfg, tfm.read_rows(rk[ri], r_rows),
                                      tfm.read_rows(rv[ri], r_rows), positions_B)
      out = tfm.attend(q, k_w, v_w, m_w, sinks)
      return jnp.where(ring_live_B[:, None, None], out, jnp.zeros((), out.dtype))

    x = x + tfm._attn_out(cfg, lp, tfm.by_layer_kind(lp, has_full, full, ring))
    x, aux = tfm._mlp(cfg, lp, x, live_B[:, None], moe_fn)
    return (x, ck, cv, rk, rv), aux

  xs = tfm._kv_xs(tfm._layer_xs(params, cfg), cfg.num_layers, cache.ring_layers)
  (x, ck, cv, rk, rv), aux = tfm.scan_layers(
      ring_layer, (x, cache.k_pages, cache.v_pages, cache.k_ring, cache.v_ring), xs)
  return (tfm._logits(params, cfg, x[:, 0]),
          PagedKVCache(ck, cv, rk, rv, ring_layers=cache.ring_layers), aux)
