"""Paged KV cache: decode through page tables is bitwise the fixed-slot decode, independent of the
page assignment and the batch company; dead rows write nothing; the Pallas paged-attention kernels
(interpret mode on CPU) agree with the XLA reference, and lower for TPU and cuda."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import TINY, make_params
from kernel_utils import paged_attention_inputs

from flexfloor_jax.kernels import paged_attention as pa
from flexfloor_jax.model import paged
from flexfloor_jax.model import transformer as tfm

S = jax.ShapeDtypeStruct
PAGE, M = 4, 5  # 5 pages of 4: the paged view is as long as a fixed cache of 20
NUM_PAGES = 48
PROMPT_T = 8
STEPS = 6


def _gathered(cache: paged.PagedKVCache, table):
  """Every layer's pages in table order: [L, B, M*PAGE, K, hd], the fixed cache's layout."""
  view = jax.vmap(pa.gather_pages, in_axes=(0, None))
  return np.asarray(view(cache.k_pages, table)), np.asarray(view(cache.v_pages, table))


def _garbage_pool(cfg, seed, rows: int = 0):
  """A pool full of finite values that no row owns (stale pages and rings of earlier
  sequences); `rows` > 0: with the sliding layers' rings for that many rows of M*PAGE tokens."""
  c = paged.PagedKVCache.zeros(cfg, NUM_PAGES, PAGE, rows, M * PAGE)
  leaves, tree = jax.tree.flatten(c)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype)
                                   for k, x in zip(keys, leaves, strict=True)])


def _tables(rng, rows):
  """Each row gets M distinct pages drawn from a shuffled pool: not contiguous, not in order."""
  return rng.permutation(NUM_PAGES)[: rows * M].reshape(rows, M).astype(np.int32)


@functools.cache
def _steps(cfg):
  prefill = jax.jit(lambda p, t, n: tfm.prefill(p, cfg, t, n)[:3])
  decode = jax.jit(lambda p, c, t, pos, live: tfm.decode(p, cfg, c, t, pos, live)[:2])
  decode_p = jax.jit(lambda p, c, pt, t, pos, live:
                     paged.decode_paged(p, cfg, c, pt, t, pos, live)[:2])
  return prefill, decode, decode_p


_insert = jax.jit(tfm.insert)
_insert_paged = jax.jit(paged.insert_paged)


def _run_paged(params, cfg, prompts, lengths, table, pool, steps):
  """Prefill + insert_paged, then `steps` greedy decode steps; every step's logits [B, V]."""
  prefill, _, decode_p = _steps(cfg)
  logits, k, v = prefill(params, jnp.asarray(prompts), jnp.asarray(lengths))
  cache = _insert_paged(pool, k, v, jnp.asarray(table), jnp.asarray(lengths))
  out = [np.asarray(logits)]
  live = jnp.ones(len(lengths), bool)
  for i in range(steps):
    tok = jnp.argmax(jnp.asarray(out[-1]), axis=-1).astype(jnp.int32)
    logits, cache = decode_p(params, cache, jnp.asarray(table), tok,
                             jnp.asarray(lengths + i, jnp.int32), live)
    out.append(np.asarray(logits))
  return out, cache


def _prompts(rng, lengths, cfg):
  toks = rng.integers(3, cfg.vocab_size, (len(lengths), PROMPT_T))
  valid = np.arange(PROMPT_T)[None] < np.asarray(lengths)[:, None]
  return np.where(valid, toks, 0).astype(np.int32)


# -------------------------------------------------------------------------------------- model level


@pytest.mark.parametrize("window, sliding, ring", [(None, (), True), (6, (), True),
                                                   (6, (), False), (6, (1,), True)],
                         ids=["causal", "sliding6", "sliding6-full-store", "layer1-sliding6"])
def test_decode_paged_bitwise_equals_fixed_slot_decode(window, sliding, ring):
  """Prefill into pages == insert into slots at every prompt position; then each decode step's
  logits and new k/v (every position a row has written) are bitwise those of `tfm.decode` over a
  fixed cache of length M*PAGE. Row lengths 3 and 7 cross a page boundary while decoding; 8 ends
  exactly on one (its first decode token opens a new page); 1 is a one-token prompt. A window of
  6 on every layer: both caches keep every layer in rings of 6 positions and none in pages or
  full rows, or (full store) every position of every layer; on layer 1 only (GPT-OSS's mix):
  layer 0 in pages and full rows, layer 1 in rings."""
  cfg = TINY.replace(sliding_window=window, sliding_layers=sliding)
  params = make_params(cfg, seed=3)
  rng = np.random.default_rng(7)
  lengths = np.array([3, 8, 7, 1], np.int32)
  b = len(lengths)
  prompts = _prompts(rng, lengths, cfg)
  table = _tables(rng, b)
  prefill, decode, decode_p = _steps(cfg)

  logits, k, v = prefill(params, jnp.asarray(prompts), jnp.asarray(lengths))
  fixed = _insert(tfm.KVCache.zeros(cfg, b, M * PAGE, ring), k, v, jnp.arange(b),
                  jnp.asarray(lengths))
  pool = _insert_paged(_garbage_pool(cfg, 1, b if ring else 0), k, v, jnp.asarray(table),
                       jnp.asarray(lengths), jnp.arange(b))
  rings = window is not None and ring
  n_ring = (len(sliding) or cfg.num_layers) if rings else 0
  kv_shape = (cfg.num_kv_heads, cfg.head_dim)
  assert fixed.k.shape == (cfg.num_layers - n_ring, b, M * PAGE, *kv_shape)
  assert pool.k_pages.shape[0] == cfg.num_layers - n_ring
  if rings:
    assert fixed.k_ring.shape == pool.k_ring.shape == (n_ring, b, window, *kv_shape)
  else:
    assert fixed.k_ring is None and pool.k_ring is None

  def assert_same_cache(written_B):
    gk, gv = _gathered(pool, jnp.asarray(table))
    for r in range(b):
      n = written_B[r]
      np.testing.assert_array_equal(gk[:, r, :n], np.asarray(fixed.k)[:, r, :n])
      np.testing.assert_array_equal(gv[:, r, :n], np.asarray(fixed.v)[:, r, :n])
      if rings:  # the ring slots of the window's positions
        slots = np.arange(max(0, n - window), n) % window
        for a, f in ((pool.k_ring, fixed.k_ring), (pool.v_ring, fixed.v_ring)):
          np.testing.assert_array_equal(np.asarray(a)[:, r, slots], np.asarray(f)[:, r, slots])

  assert_same_cache(lengths)
  lf = lp = np.asarray(logits)
  live = jnp.ones(b, bool)
  for i in range(STEPS):
    tok = jnp.asarray(np.argmax(lf, axis=-1), jnp.int32)
    pos = jnp.asarray(lengths + i)
    lf, fixed = decode(params, fixed, tok, pos, live)
    lp, pool = decode_p(params, pool, jnp.asarray(table), tok, pos, live)
    lf, lp = np.asarray(lf), np.asarray(lp)
    np.testing.assert_array_equal(lp, lf, err_msg=f"decode step {i}")
    assert_same_cache(lengths + i + 1)
  assert lf.std(axis=-1).mean() > 0.2  # not flat: a wrong key or position would show


def test_paged_logits_independent_of_pages_and_company():
  """The same prompt decoded at another batch row, beside other prompts, through another page
  assignment over a pool with other stale contents: bitwise the same logits at every step."""
  cfg = TINY
  params = make_params(cfg, seed=4)
  rng = np.random.default_rng(11)
  lengths_a = np.array([5, 8, 2, 6], np.int32)
  prompts_a = _prompts(rng, lengths_a, cfg)
  lengths_b = np.array([7, 3, 5, 1], np.int32)  # the sequence moves from row 0 to row 2
  prompts_b = _prompts(rng, lengths_b, cfg)
  prompts_b[2] = prompts_a[0]
  table_a, table_b = _tables(rng, 4), _tables(rng, 4)
  assert not np.array_equal(table_a[0], table_b[2])
  out_a, _ = _run_paged(params, cfg, prompts_a, lengths_a, table_a, _garbage_pool(cfg, 5), STEPS)
  out_b, _ = _run_paged(params, cfg, prompts_b, lengths_b, table_b, _garbage_pool(cfg, 6), STEPS)
  for i, (la, lb) in enumerate(zip(out_a, out_b, strict=True)):
    np.testing.assert_array_equal(la[0], lb[2], err_msg=f"step {i}")
  assert not np.array_equal(out_a[-1][1], out_b[-1][1])  # the company did differ


def test_dead_rows_and_missing_pages_write_nothing():
  """insert_paged: a row of length 0 and the padding past a prompt write nothing. decode_paged:
  dead rows, and a live row whose position's table entry is -1, leave every pool byte unchanged;
  the live rows change exactly their own (page, offset) in every layer."""
  cfg = TINY
  params = make_params(cfg, seed=5)
  rng = np.random.default_rng(13)
  lengths = np.array([3, 0, 6, 4], np.int32)
  table = _tables(rng, 4)
  table[3, 1] = -1  # row 3's position 4 has no page
  prompts = _prompts(rng, lengths, cfg)
  prefill, _, decode_p = _steps(cfg)
  pool0 = _garbage_pool(cfg, 9)
  _, k, v = prefill(params, jnp.asarray(prompts), jnp.asarray(lengths))
  pool1 = _insert_paged(pool0, k, v, jnp.asarray(table), jnp.asarray(lengths))

  def changed(before, after):
    return np.any(np.asarray(before.k_pages) != np.asarray(after.k_pages), axis=(0, 1, 4)) | \
        np.any(np.asarray(before.v_pages) != np.asarray(after.v_pages), axis=(0, 1, 4))

  want = np.zeros((NUM_PAGES, PAGE), bool)
  for r, n in enumerate(lengths):
    for t in range(n):
      want[table[r, t // PAGE], t % PAGE] = True
  np.testing.assert_array_equal(changed(pool0, pool1), want)

  live = np.array([True, False, False, True])
  pos = np.array([3, 0, 6, 4], np.int32)
  tok = jnp.asarray(rng.integers(3, cfg.vocab_size, 4), jnp.int32)
  logits, pool2 = decode_p(params, pool1, jnp.asarray(table), tok, jnp.asarray(pos),
                           jnp.asarray(live))
  want = np.zeros((NUM_PAGES, PAGE), bool)
  want[table[0, 0], 3] = True  # row 0 only: 1, 2 dead, row 3's page is missing
  np.testing.assert_array_equal(changed(pool1, pool2), want)
  assert np.all(np.isfinite(np.asarray(logits)))


# -------------------------------------------------------------------------------------- kernels


_ref = jax.jit(pa.paged_attention_xla)
_tpu_interp = jax.jit(functools.partial(pa.paged_attention_tpu, interpret=True))
_gpu_interp = jax.jit(functools.partial(pa.paged_attention_gpu, interpret=True))


def _maxdiff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pallas_kernels_equal_reference_fp32(kernel, seed):
  """fp32, GQA 8 heads over 2 kv heads: the kernels differ from the reference in where 1/sqrt(D)
  is applied and in the online softmax's order, so <= 1e-4. The TPU kernel rounds k/v to bf16:
  given bf16-valued pages here (bf16 pools are the bf16 case below). Empty rows are exactly 0."""
  q, kp, vp, table, lengths = paged_attention_inputs(seed, jnp.float32,
                                                     bf16_values=kernel == "tpu")
  ref = _ref(q, kp, vp, table, lengths)
  got = (_tpu_interp if kernel == "tpu" else _gpu_interp)(q, kp, vp, table, lengths)
  d = _maxdiff(got, ref)
  print(f"{kernel} fp32 seed {seed}: max|diff| {d:.3g}")
  assert d <= 1e-4
  np.testing.assert_array_equal(np.asarray(got)[4], 0)
  np.testing.assert_array_equal(np.asarray(ref)[4], 0)


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_pallas_kernels_bf16(kernel):
  """bf16 pages and queries: the kernels compute in fp32 and round once; the reference (the
  model's attention) rounds scores and probabilities to bf16 on the way. Both are compared with
  the reference in fp32 on the same bf16 values."""
  q, kp, vp, table, lengths = paged_attention_inputs(2, jnp.bfloat16)
  ref32 = _ref(*(x.astype(jnp.float32) for x in (q, kp, vp)), table, lengths)
  got = (_tpu_interp if kernel == "tpu" else _gpu_interp)(q, kp, vp, table, lengths)
  ref16 = _ref(q, kp, vp, table, lengths)
  assert got.dtype == jnp.bfloat16
  d, d_ref = _maxdiff(got, ref32), _maxdiff(ref16, ref32)
  print(f"{kernel} bf16: kernel vs fp32 ref {d:.3g}, bf16 ref vs fp32 ref {d_ref:.3g}")
  assert d <= 1e-2


def test_dispatcher_and_sliding_window_refused():
  """impl='pallas' with interpret runs the TPU kernel; without it on CPU, the XLA reference
  (bitwise); the kernels refuse a sliding window rather than ignore it."""
  q, kp, vp, table, lengths = paged_attention_inputs(3, jnp.float32, bf16_values=True)
  via = jax.jit(functools.partial(pa.paged_attention, impl="pallas", interpret=True))
  np.testing.assert_array_equal(np.asarray(via(q, kp, vp, table, lengths)),
                                np.asarray(_tpu_interp(q, kp, vp, table, lengths)))
  cpu = jax.jit(functools.partial(pa.paged_attention, impl="pallas"))
  np.testing.assert_array_equal(np.asarray(cpu(q, kp, vp, table, lengths)),
                                np.asarray(_ref(q, kp, vp, table, lengths)))
  for fn in (pa.paged_attention_tpu, pa.paged_attention_gpu):
    with pytest.raises(ValueError, match="sliding window"):
      fn(q, kp, vp, table, lengths, sliding_window=4)
  with pytest.raises(ValueError, match="impl"):
    pa.paged_attention(q, kp, vp, table, lengths, impl="triton")


def test_decode_paged_with_kernel_attention_close_to_reference():
  """decode_paged with a Pallas kernel as its attention (the GPU one, interpret mode: it keeps
  fp32 k/v, where the TPU kernel would round the new token's k/v to bf16): logits within 1e-4 of
  the reference attention's on the tiny model."""
  cfg = TINY
  params = make_params(cfg, seed=6)
  rng = np.random.default_rng(17)
  lengths = np.array([3, 8, 5, 1], np.int32)
  table = jnp.asarray(_tables(rng, 4))
  prefill, _, decode_p = _steps(cfg)
  _, k, v = prefill(params, jnp.asarray(_prompts(rng, lengths, cfg)), jnp.asarray(lengths))
  pool = _insert_paged(_garbage_pool(cfg, 2), k, v, table, jnp.asarray(lengths))
  attn = functools.partial(pa.paged_attention_gpu, interpret=True)
  kern = jax.jit(lambda p, c, pt, t, pos, live:
                 paged.decode_paged(p, cfg, c, pt, t, pos, live, attention=attn)[0])
  args = (table, jnp.asarray(rng.integers(3, cfg.vocab_size, 4), jnp.int32),
          jnp.asarray(lengths), jnp.ones(4, bool))
  got = kern(params, pool, *args)
  ref, _ = decode_p(params, pool, *args)
  d = _maxdiff(got, ref)
  print(f"decode_paged kernel vs reference: max|diff| {d:.3g}")
  assert d <= 1e-4


# -------------------------------------------------------------------------------------- lowering

TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi", "triton_kernel_call")


def _custom_calls(exported):
  text = exported.mlir_module()
  return (set(re.findall(r'custom_call @?"?([\w$.]+)', text))
          | set(re.findall(r'call_target_name = "([^"]+)"', text)))


def _mixtral_decode_args(dtype):
  """One layer of Mixtral 8x7B decode attention: 32 heads over 8 kv heads of 128, 16-token
  pages, 64 pages (1024 positions) per row, 8 rows, a 512-page pool."""
  return (S((8, 32, 128), dtype), S((8, 512, 16, 128), dtype), S((8, 512, 16, 128), dtype),
          S((8, 64), jnp.int32), S((8,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_paged_attention_pallas_lowers_for_tpu_and_cuda(dtype):
  """The compiled kernels (not the interpreter, not the XLA fallback) lower for their
  platforms from this CPU machine. A lowering error fails the test."""
  fn = jax.jit(functools.partial(pa.paged_attention, impl="pallas"))
  args = _mixtral_decode_args(dtype)
  exp = jax.export.export(fn, platforms=["tpu"])(*args)
  assert "tpu_custom_call" in _custom_calls(exp)
  checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in TRITON_CALLS]
  exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
  assert _custom_calls(exp) & set(TRITON_CALLS), _custom_calls(exp)
