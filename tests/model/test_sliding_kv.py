"""A sliding layer's KV cache keeps only its window (transformer.KVLayout): a ring of `window`
positions per row, fixed slots and paged pool alike, while full layers keep every position.

Greedy decoding far past the window (prompt + response 3.8 to 10 windows) from the ring equals
greedy from the full-store cache (every position of every layer, masked to the window: the
layout before rings): the same tokens, log-probs within 1e-5, logits within 2e-5 of the
full-sequence forward's. The arrays a sliding layer gets are window-sized; a model without a
window, or with one no shorter than the cache, keeps the full-store layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexfloor_jax.model import paged
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS

# fp32: the ring and the full store compute the same attention over different key orders and
# lengths (R vs S keys, masked ones contributing exact zeros): their log-probs differ by a few
# 1e-6. A cached decode and the full forward differ by up to ~1.5e-5 in logits (two summation
# orders, as tests/model/test_hf_parity.py's CACHE_TOL). A wrong slot, position or window is
# > 1e-3.
LOGPROB_TOL = 1e-5
LOGIT_TOL = 2e-5
MARGIN = 1e-4  # a greedy token is compared only where top-1 beats top-2 by this
PAD_T = 20
NEW_TOKENS = 60


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@functools.cache
def _fns(cfg):
  prefill = jax.jit(lambda p, t, n: tfm.prefill(p, cfg, t, n)[:3])
  decode = jax.jit(lambda p, c, t, pos: tfm.decode(p, cfg, c, t, pos, jnp.ones(t.shape, bool))[:2])
  decode_p = jax.jit(lambda p, c, pt, t, pos: paged.decode_paged(
      p, cfg, c, pt, t, pos, jnp.ones(t.shape, bool))[:2])
  forward = jax.jit(lambda p, t: tfm.forward(p, cfg, t)[0])
  return prefill, decode, decode_p, forward


def _greedy(cfg, params, prompts, lengths, cache, feed=None, table=None):
  """Prefill + NEW_TOKENS - 1 decode steps from `cache` (a KVCache, or a PagedKVCache with page
  tables `table`): the logits of every step [B, N, V] and the greedy tokens [B, N]. `feed`
  [B, N]: the tokens fed back instead of the argmax (teacher forcing)."""
  prefill, decode, decode_p, _ = _fns(cfg)
  b = len(lengths)
  logits, k, v = prefill(params, jnp.asarray(prompts), jnp.asarray(lengths))
  if table is None:
    cache = jax.jit(tfm.insert)(cache, k, v, jnp.arange(b), jnp.asarray(lengths))
  else:
    cache = jax.jit(paged.insert_paged)(cache, k, v, jnp.asarray(table), jnp.asarray(lengths),
                                        jnp.arange(b))
  out, toks = [np.asarray(logits)], [np.argmax(np.asarray(logits), -1)]
  for i in range(1, NEW_TOKENS):
    tok = jnp.asarray(toks[-1] if feed is None else feed[:, i - 1], jnp.int32)
    pos = jnp.asarray(lengths + i - 1, jnp.int32)
    if table is None:
      logits, cache = decode(params, cache, tok, pos)
    else:
      logits, cache = decode_p(params, cache, jnp.asarray(table), tok, pos)
    out.append(np.asarray(logits))
    toks.append(np.argmax(out[-1], -1))
  return np.stack(out, 1), np.stack(toks, 1), cache


def _case(cfg, seed):
  params = tfm.init_params(cfg, jax.random.key(seed), scale=0.1)
  rng = np.random.default_rng(seed + 1000)
  lengths = np.array([PAD_T, 3, 11, 1, 16])
  prompts = np.where(np.arange(PAD_T)[None] < lengths[:, None],
                     rng.integers(3, cfg.vocab_size, (len(lengths), PAD_T)), 0).astype(np.int32)
  return params, prompts, lengths


@pytest.mark.parametrize("preset, window, sliding", [
    ("gpt-oss-tiny", 16, (0, 2)),  # GPT-OSS: sliding and full layers alternate
    ("tiny", 8, ()),  # Mixtral-style: every layer slides
], ids=["gpt-oss-mixed", "every-layer"])
def test_ring_greedy_equals_full_store_past_the_window(preset, window, sliding):
  """Greedy from rings equals greedy from the full-store cache (each fed its own tokens), the
  log-prob of every chosen token within 1e-5 of the full store's and every logit within 2e-5 of
  the full-sequence forward's; the sequences end 3.8-10 windows past their first position. The rings
  are window-sized: [sliding layers, B, window, K, hd], the full rows [full layers, B, S, K,
  hd]."""
  cfg = PRESETS[preset].replace(sliding_window=window, sliding_layers=sliding)
  params, prompts, lengths = _case(cfg, seed=33 if sliding else 37)
  b, s = len(lengths), PAD_T + NEW_TOKENS
  assert s >= 4 * window and lengths.min() + NEW_TOKENS > 3 * window
  ring = tfm.KVCache.zeros(cfg, b, s)
  n_ring = len(sliding) or cfg.num_layers
  kv = (cfg.num_kv_heads, cfg.head_dim)
  assert ring.k_ring is not None and ring.v_ring is not None
  assert ring.k_ring.shape == ring.v_ring.shape == (n_ring, b, window, *kv)
  assert ring.k.shape == (cfg.num_layers - n_ring, b, s, *kv)
  assert ring.ring_layers == (sliding or tuple(range(cfg.num_layers)))
  full = tfm.KVCache.zeros(cfg, b, s, ring=False)
  assert full.k_ring is None and full.k.shape == (cfg.num_layers, b, s, *kv)

  lf, tf, _ = _greedy(cfg, params, prompts, lengths, full)
  lr, tr, _ = _greedy(cfg, params, prompts, lengths, ring)
  top2 = np.sort(lf, -1)[..., -2:]
  margin = top2[..., 1] - top2[..., 0]
  assert margin.min() > MARGIN, f"a near tie ({margin.min():.3g}): pick another draw"
  np.testing.assert_array_equal(tr, tf)
  lp_full = np.take_along_axis(_log_softmax(lf), tf[..., None], -1)[..., 0]
  lp_ring = np.take_along_axis(_log_softmax(lr), tr[..., None], -1)[..., 0]
  d_lp = np.abs(lp_ring - lp_full).max()
  # the whole sequence (prompt + response) in one forward: logits at each response position
  _, _, _, forward = _fns(cfg)
  rows = np.arange(b)
  seqs = np.zeros((b, s), np.int32)
  for r in rows:
    seqs[r, :lengths[r]] = prompts[r, :lengths[r]]
    seqs[r, lengths[r]:lengths[r] + NEW_TOKENS] = tf[r]
  fw = np.asarray(forward(params, jnp.asarray(seqs)))
  idx = lengths[:, None] - 1 + np.arange(NEW_TOKENS)[None]
  fw_at = fw[rows[:, None], idx]
  d_fw = max(np.abs(lr - fw_at).max(), np.abs(lf - fw_at).max())
  print(f"[{preset} window {window}] {b}x{NEW_TOKENS} greedy tokens equal; log-prob max|diff| "
        f"ring vs full store {d_lp:.3g}; logits max|diff| vs forward {d_fw:.3g}; "
        f"min margin {margin.min():.3g}")
  assert d_lp <= LOGPROB_TOL
  assert d_fw <= LOGIT_TOL
  assert lf.std(-1).mean() > 0.2  # not flat: a wrong key or position would show


def test_paged_rings_equal_fixed_rings_past_the_window():
  """The paged pool with rings (the full layers in pages through shuffled page tables, the
  sliding layers in rings beside them) gives the fixed-slot rings' logits bit for bit over the
  whole response, and its arrays: pages [full layers, K, pages, page size, hd] and rings
  [sliding layers, rows, window, K, hd]."""
  cfg = PRESETS["gpt-oss-tiny"]
  params, prompts, lengths = _case(cfg, seed=41)
  b, s, page = len(lengths), PAD_T + NEW_TOKENS, 8
  m = s // page
  rng = np.random.default_rng(43)
  num_pages = b * m + 3
  table = rng.permutation(num_pages)[:b * m].reshape(b, m).astype(np.int32)
  pool = paged.PagedKVCache.zeros(cfg, num_pages, page, rows=b, max_len=s)
  kv = (cfg.num_kv_heads, cfg.head_dim)
  n_ring = len(cfg.sliding_layers)
  assert pool.k_pages.shape == (cfg.num_layers - n_ring, cfg.num_kv_heads, num_pages, page,
                                cfg.head_dim)
  assert pool.k_ring is not None and pool.k_ring.shape == (n_ring, b, cfg.sliding_window, *kv)
  fixed = tfm.KVCache.zeros(cfg, b, s)
  lf, tf, _ = _greedy(cfg, params, prompts, lengths, fixed)
  lp, tp, _ = _greedy(cfg, params, prompts, lengths, pool, table=table)
  np.testing.assert_array_equal(lp, lf)
  np.testing.assert_array_equal(tp, tf)


def test_layout_keeps_every_position_without_a_binding_window():
  """No window (Mixtral, Qwen3-MoE), or a window no shorter than the cache: every layer whole,
  and the decode is the full-store one bit for bit. GPT-OSS-20B at 3072 positions: its 12 even
  layers in rings of 128, its 12 odd layers whole."""
  tiny = PRESETS["tiny"]
  assert tfm.kv_layout(tiny, 96) == tfm.KVLayout(tuple(range(4)), (), 0)
  assert tfm.kv_layout(tiny.replace(sliding_window=96), 96).ring_layers == ()
  assert tfm.kv_layout(tiny.replace(sliding_window=95), 96).ring_layers == (0, 1, 2, 3)
  g = tfm.kv_layout(PRESETS["gpt-oss-20b"], 3072)
  assert (g.full_layers, g.ring_layers, g.ring_len) == (tuple(range(1, 24, 2)),
                                                         tuple(range(0, 24, 2)), 128)
  cache = tfm.KVCache.zeros(tiny, 2, 24)
  assert cache.k_ring is None and cache.k.shape[0] == tiny.num_layers
  params, prompts, lengths = _case(tiny, seed=47)
  a, ta, _ = _greedy(tiny, params, prompts, lengths, tfm.KVCache.zeros(tiny, 5, 80))
  b, tb, _ = _greedy(tiny, params, prompts, lengths, tfm.KVCache.zeros(tiny, 5, 80, ring=False))
  np.testing.assert_array_equal(a, b)


def test_a_ring_needs_the_prompt_lengths_and_its_window():
  """insert into rings without the prompts' lengths, or a ring shorter than its layer's window,
  is refused rather than filled wrong."""
  cfg = PRESETS["tiny"].replace(sliding_window=4)
  params, prompts, lengths = _case(cfg, seed=53)
  _, k, v = _fns(cfg)[0](params, jnp.asarray(prompts), jnp.asarray(lengths))
  cache = tfm.KVCache.zeros(cfg, len(lengths), 32)
  with pytest.raises(ValueError, match="lengths_P"):
    tfm.insert(cache, k, v, jnp.arange(len(lengths)))
  wide = cfg.replace(sliding_window=6)
  with pytest.raises(ValueError, match="ring of 4 positions"):
    tfm.decode(params, wide, cache, jnp.zeros((5,), jnp.int32), jnp.zeros((5,), jnp.int32),
               jnp.ones((5,), bool))
