"""Expert parallelism on 8 emulated devices: the EP model equals the single-device model, decode is
bitwise the same whatever the mesh size, slot, worker and company, every routed token copy comes
back once, and the MoE layer's gradients (the training path) equal a dense per-expert reference.

Each tolerance sits an order of magnitude above the fp32 rounding of two summation orders of the
same math at the test's magnitudes, and far below what a routing or layout bug costs (a whole
expert's output, or another token's).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import EP, TINY, EPSetup, make_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.moe import ep_moe, exchange_capacities, tile_m_for_rows

MESH_SIZES = (1, 2, 3, 4, 8)  # 3: ceil(8/3) = 3 slots per worker, one empty slot on worker 2


@pytest.fixture(scope="module")
def params():
  return make_params(TINY, seed=1)


@pytest.fixture(scope="module")
def setups(params):
  """One EP group per mesh size (S = ceil(E/N)), shared by the tests of this module."""
  cache = {}

  def get(n):
    if n not in cache:
      cache[n] = EPSetup(params, TINY, n)
    return cache[n]

  return get


def _layer0(params):
  return {k: v[0] for k, v in params["layers"].items()}


_VARIANTS = {}


def _variant(setups, n, **ep_changes):
  """The EPSetup of mesh size n with its EPConfig changed (shared, so compiled layers are too)."""
  key = (n, tuple(sorted(ep_changes.items())))
  if all(getattr(setups(n).ep, f) == v for f, v in ep_changes.items()):
    return setups(n)
  if key not in _VARIANTS:
    st = copy.copy(setups(n))
    st.ep = dataclasses.replace(st.ep, **ep_changes)
    _VARIANTS[key] = st
  return _VARIANTS[key]


# ----------------------------------------------------------------------------- 1. EP == dense


@pytest.fixture(scope="module")
def forward_case(params):
  """6 right-padded sequences of 16 tokens and the dense single-device reference logits."""
  rng = np.random.default_rng(10)
  b, t = 6, 16
  tokens = rng.integers(0, TINY.vocab_size, (b, t)).astype(np.int32)
  lengths = np.array([16, 9, 13, 16, 5, 11])
  valid = np.arange(t)[None] < lengths[:, None]
  ref, aux = jax.jit(lambda p, x, v: tfm.forward(p, TINY, x, valid_BT=v))(params, tokens, valid)
  return tokens, valid, np.asarray(ref), np.asarray(aux["expert_counts"])


@pytest.mark.parametrize("n", MESH_SIZES)
def test_ep_forward_equals_single_device(setups, forward_case, n):
  """Full-sequence forward inside shard_map with ep_moe (experts in the slot layout, tokens
  sharded over 'ep') equals transformer.forward with the dense MoE on one device. With 96 tokens
  on one worker the layer also runs its chunked path (chunk_tokens=64). The logits are not flat
  (up to a few units), so 1e-4 is tight against a wrong expert or position, loose against the
  few e-6 that fp32 reordering gives."""
  tokens, valid, ref, ref_counts = forward_case
  assert np.abs(ref).max() > 1.0 and ref[valid].std() > 0.5  # logits are not flat
  st = setups(n)
  b0, t = tokens.shape
  b = -(-b0 // n) * n  # pad the batch to a multiple of N with invalid (fully masked) rows
  rng = np.random.default_rng(11)
  tok = np.concatenate([tokens, rng.integers(0, TINY.vocab_size, (b - b0, t)).astype(np.int32)])
  val = np.concatenate([valid, np.zeros((b - b0, t), bool)])
  logits, counts = st.forward_fn()(st.rest, st.experts, st.shard(tok), st.shard(val))
  logits = np.asarray(logits)[:b0]
  assert np.isfinite(logits).all()
  diff = float(np.abs(logits - ref)[valid].max())
  assert diff <= 1e-4, f"N={n}: max|EP - dense| = {diff:.3g}"
  # Same routing as the dense model; every valid token counted top_k times per layer.
  counts = np.asarray(counts)
  assert (counts.sum(-1) == valid.sum() * TINY.top_k).all()
  np.testing.assert_array_equal(counts, ref_counts)


@pytest.mark.parametrize("n", (1, 8))
def test_ep_forward_ragged_exchange_bitwise(setups, forward_case, n):
  """The full forward (every layer's experts as one stacked [L*S, ...] array) with
  exchange='ragged' gives bitwise the logits and counts of exchange='all_to_all'; on one worker
  the 96 tokens also take the chunked path."""
  tokens, valid, _, _ = forward_case
  b = -(-tokens.shape[0] // n) * n
  tok = np.pad(tokens, ((0, b - tokens.shape[0]), (0, 0)))
  val = np.pad(valid, ((0, b - tokens.shape[0]), (0, 0)))
  outs = []
  for st in (setups(n), _variant(setups, n, exchange="ragged")):
    outs.append([np.asarray(a) for a in st.forward_fn()(st.rest, st.experts, st.shard(tok),
                                                         st.shard(val))])
  for a, b in zip(*outs, strict=True):
    np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- 2. bitwise decode

B_SLOTS, PROMPT_W, CACHE_LEN, DECODE_STEPS = 3, 12, 32, 6
# (N, probe worker, probe slot, company seed): worker 0..7, slot 0..2, five mesh sizes, and two
# different companies on the same mesh for N=1 and N=8.
PLACEMENTS = [(1, 0, 0, 1), (1, 0, 2, 2), (2, 1, 1, 3), (3, 2, 0, 4), (4, 3, 2, 5),
              (8, 7, 1, 6), (8, 0, 0, 7)]


@functools.cache
def _step_fns(st):
  return st.step_fns()


def _run_probe(st, probe_prompt, probe_tokens, w, s, seed):
  """Prefill every slot (random company of random lengths, some slots empty), then decode;
  company slots stop at random steps. Returns the probe's logits [1 + steps, V] and checks
  expert-count conservation at every step."""
  pre, dec = _step_fns(st)
  n, k = st.n, TINY.top_k
  rng = np.random.default_rng(seed)
  nb = n * B_SLOTS
  row = w * B_SLOTS + s
  toks = rng.integers(0, TINY.vocab_size, (nb, PROMPT_W)).astype(np.int32)
  lens = rng.integers(0, PROMPT_W + 1, nb).astype(np.int32)  # 0 = empty slot
  toks[row] = rng.integers(0, TINY.vocab_size, PROMPT_W)  # garbage past the probe's prompt
  toks[row, : len(probe_prompt)] = probe_prompt
  lens[row] = len(probe_prompt)
  ck, cv = st.empty_cache(B_SLOTS, CACHE_LEN)
  # The empty cache is zeros; fill it with garbage so a read of an unwritten position would show.
  ck = st.shard(np.asarray(rng.standard_normal(ck.shape), np.float32), P(None, EP))
  cv = st.shard(np.asarray(rng.standard_normal(cv.shape), np.float32), P(None, EP))
  logits, ck, cv, counts = pre(st.rest, st.experts, ck, cv, st.shard(toks), st.shard(lens))
  out = [np.asarray(logits)[row]]
  np.testing.assert_array_equal(np.asarray(counts).sum(-1), lens.sum() * k)
  die = rng.integers(1, DECODE_STEPS + 2, nb)
  for i in range(DECODE_STEPS):
    dt = rng.integers(0, TINY.vocab_size, nb).astype(np.int32)
    dt[row] = probe_tokens[i]
    pos = (lens + i).astype(np.int32)
    live = (lens > 0) & (die > i)
    live[row] = True
    logits, ck, cv, counts = dec(st.rest, st.experts, ck, cv, st.shard(dt), st.shard(pos),
                                 st.shard(live))
    out.append(np.asarray(logits)[row])
    np.testing.assert_array_equal(np.asarray(counts).sum(-1), live.sum() * k)
  return np.stack(out)


def test_decode_logits_bitwise_across_mesh_slot_and_company(setups):
  """The same probe sequence prefilled and decoded on N in {1,2,3,4,8}, on worker 0..7, in slot
  0..2, beside different random sequences (other lengths, empty slots, slots that stop): its
  prefill and decode logits are bitwise identical (np.array_equal): the combine
  (kernels/combine.py) rounds each product before adding, so that no compiler may contract its
  `acc + w * y` into an FMA in one program and not in another."""
  if len(jax.devices()) < max(p[0] for p in PLACEMENTS):  # e.g. one GPU: skip before any work
    pytest.skip(f"needs {max(p[0] for p in PLACEMENTS)} devices, {jax.default_backend()} has "
                f"{len(jax.devices())}")
  prng = np.random.default_rng(123)
  probe_prompt = prng.integers(0, TINY.vocab_size, 9).astype(np.int32)
  probe_tokens = prng.integers(0, TINY.vocab_size, DECODE_STEPS).astype(np.int32)
  runs = {p: _run_probe(setups(p[0]), probe_prompt, probe_tokens, *p[1:]) for p in PLACEMENTS}
  base_key = PLACEMENTS[0]
  base = runs[base_key]
  assert np.isfinite(base).all() and base.std() > 0.5
  # Sanity: the probe's logits change from step to step (the test would be vacuous otherwise).
  assert not np.array_equal(base[1], base[2])
  for key, got in runs.items():
    diff = np.abs(got - base).max()
    assert np.array_equal(got, base), f"{key} vs {base_key}: max|diff| {diff:.3g}"


@functools.cache
def _layer_fn(st):
  """ep_moe on one layer (layer-0 params passed in) -> (y, routed experts, per-worker counts)."""

  def local(rl, experts, x, v):
    lyr = {**rl, **{k: e[0] for k, e in experts.items()}}
    y, aux = st.moe_fn()(x, lyr, v)
    return y, aux["experts"], aux["expert_counts"][None]

  _, es = st.specs()
  return jax.jit(jax.shard_map(local, mesh=st.mesh, in_specs=(P(), es, P(EP), P(EP)),
                               out_specs=(P(EP), P(EP), P(EP)), check_vma=False))


def _skewed_router(lp, rest_lp):
  """Layer 0's router scaled down, plus a bias towards experts 6 and 7, placed as the setup's
  own router is (the same argument layout, so the same compiled layer)."""
  bias = jnp.zeros((TINY.hidden_size, TINY.num_experts)).at[:, 6:].set(1.0)
  return jax.device_put(lp["router"] * 0.01 + bias, rest_lp["router"].sharding)


def _layer_inputs(params, st, n, t, router, seed):
  """(layer-0 non-expert params, tokens [n*t, D], valid [n*t]) with about a quarter of the tokens
  invalid; 'skewed' routes every copy to experts 6 and 7."""
  lp = _layer0(params)
  rest_lp = {k: v[0] for k, v in st.rest["layers"].items()}
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n * t, TINY.hidden_size)).astype(np.float32)
  if router == "skewed":
    # Tokens with a positive mean push the logits of experts 6 and 7 far above the rest.
    rest_lp = {**rest_lp, "router": _skewed_router(lp, rest_lp)}
    # Positive tokens (logits of 6 and 7 ~ sum(x) far above the rest), scaled so the expert
    # activations stay O(1): at |x| ~ 1.3 they reach tens, and both fp32 paths then drift from a
    # float64 evaluation by more than the tolerance on some CPUs: conditioning, not routing.
    x = (np.abs(x) + 0.5) * 0.25
  valid = rng.random(n * t) > 0.25
  valid[0] = True
  return rest_lp, x, valid


@pytest.mark.parametrize("n", (1, 3, 8))
@pytest.mark.parametrize("router", ("random", "skewed"))
@pytest.mark.parametrize("exchange", ("all_to_all", "ragged"))
def test_every_routed_copy_comes_back_once(params, setups, n, router, exchange):
  """ep_moe on one layer equals the dense reference token by token (a dropped or duplicated copy
  would be off by a whole expert output), invalid tokens get exactly 0, and expert_counts
  conserve copies: per worker sum = valid tokens * top_k, equal to the bincount of the routed
  experts. 'skewed': every token picks experts 6 and 7, so all copies of every worker go to one
  or two destinations (the capacity tokens*top_k per destination is reached exactly). Both
  exchanges ('ragged': the packed buffers and ragged_all_to_all). 1e-5 is a few times the fp32
  rounding of the layer at these magnitudes; a dropped copy is off by a whole expert output."""
  st = _variant(setups, n, exchange=exchange)
  rest_lp, x, valid = _layer_inputs(params, st, n, 24, router, 20 + n)
  lp = {**_layer0(params), "router": rest_lp["router"]}

  fn = _layer_fn(st)
  y, experts, counts = (np.asarray(a) for a in fn(rest_lp, st.experts, st.shard(x),
                                                  st.shard(valid)))
  want, _ = jax.jit(lambda x, lp, v: tfm.moe_dense_reference(x, lp, v, top_k=TINY.top_k))(
      x, lp, valid)
  want = np.asarray(want)
  if router == "skewed":
    assert (np.sort(experts[valid], -1) == [6, 7]).all()
  diff = np.abs(y - want)[valid].max()
  assert diff <= 1e-5, f"max|ep_moe - dense| = {diff:.3g}"
  assert (y[~valid] == 0).all()
  want_counts = np.bincount(experts[valid].reshape(-1), minlength=TINY.num_experts)
  for w in range(n):  # psum'd: every worker holds the global counts
    np.testing.assert_array_equal(counts[w], want_counts)
  assert counts[0].sum() == valid.sum() * TINY.top_k


# Qwen3-MoE's routing at tiny width: 128 experts, top-8, one layer.
Q128 = TINY.replace(num_experts=128, top_k=8, num_layers=1, hidden_size=32, intermediate_size=16)


@pytest.fixture(scope="module")
def q128_setups():
  params = make_params(Q128, seed=4)
  cache = {}

  def get(n, **ep_changes):
    key = (n, tuple(sorted(ep_changes.items())))
    if key not in cache:
      st = EPSetup(params, Q128, n)
      st.ep = dataclasses.replace(st.ep, **ep_changes)
      cache[key] = st
    return cache[key]

  return params, get


@pytest.mark.parametrize("t", (2, 8))
def test_128_experts_top8_decode_batches(q128_setups, t):
  """Decode batches at 128 experts, top-8: t tokens per worker, so 1 (t=2) or 4 (t=8) rows per
  expert slot at 8 workers on average, most tiles of the engine's 8-row decode tile padding.
  Per mesh size (16, 64 and 128 slots per worker) the layer equals the dense reference, invalid
  tokens get 0, and a token's output is bitwise the same at every mesh size (tiles of one GEMM
  shape, the k=8 copies added in k order; as in the engine, t per worker stays the same, since
  the router's matmul may round differently for another number of rows); capacity factors
  change no bit."""
  params, get = q128_setups
  lp = {k: v[0] for k, v in params["layers"].items()}
  rng = np.random.default_rng(60 + t)
  x = rng.standard_normal((8 * t, Q128.hidden_size)).astype(np.float32)
  valid = rng.random(8 * t) > 0.25
  valid[0] = True
  want, _ = jax.jit(lambda x, lp, v: tfm.moe_dense_reference(x, lp, v, top_k=Q128.top_k))(
      x, lp, valid)
  want = np.asarray(want)
  outs = {}
  for n, changes in ((8, {}), (8, {"capacity_factors": (1.25, 2)}), (2, {}), (1, {})):
    st = get(n, **changes)
    rest_lp = {k: v[0] for k, v in st.rest["layers"].items()}
    r = n * t  # the first n workers' tokens of the 8-worker batch
    y, experts, counts = (np.asarray(a) for a in _layer_fn(st)(
        rest_lp, st.experts, st.shard(x[:r]), st.shard(valid[:r])))
    assert st.slots == 128 // n
    diff = np.abs(y - want[:r])[valid[:r]].max()
    assert diff <= 1e-5, f"N={n} {changes}: max|ep_moe - dense| = {diff:.3g}"
    assert (y[~valid[:r]] == 0).all()
    assert counts[0].sum() == valid[:r].sum() * Q128.top_k
    outs[(n, bool(changes))] = y
  for (n, factors), y in outs.items():
    np.testing.assert_array_equal(y, outs[(8, False)][:n * t], err_msg=f"N={n} {factors=}")


# ----------------------------------------------------------------------------- 3. gradients


@pytest.mark.parametrize("n", (1, 2))
def test_moe_gradients_equal_dense_reference(params, setups, n):
  """Training path: ep_moe with the XLA kernels (grouped_matmul's custom_vjp, permute's
  scatter-add transpose, the combine) inside shard_map — N=1 is the layout a trainer replica
  uses, N=2 also differentiates through the all_to_all. jax.grad of sum(y * cotangent) wrt x,
  the router and w1/w3/w2 equals the dense per-expert reference (moe_dense_reference: vmap of the
  SwiGLU over all experts). Tokens include invalid ones (no gradient through them on the EP side,
  so they are excluded from the reference loss too). Gradients reach tens, so their fp32
  rounding reaches ~1e-5; 1e-4 keeps a margin above it."""
  st = setups(n)
  lp = _layer0(params)
  t = 40  # per worker: > 4 tiles of 8 rows for some experts
  rng = np.random.default_rng(30 + n)
  x = rng.standard_normal((n * t, TINY.hidden_size)).astype(np.float32)
  ct = rng.standard_normal((n * t, TINY.hidden_size)).astype(np.float32)
  valid = rng.random(n * t) > 0.2
  # Slot layout with S = ceil(8/N): canonical expert e sits in global slot e2s[e].
  e2s = np.asarray(st.e2s)
  mask = jnp.asarray(valid, jnp.float32)[:, None]

  def ep_loss(x, router, w1, w3, w2):
    def local(x, v, ct, router, w1, w3, w2):
      lyr = {"router": router, "w1": w1, "w3": w3, "w2": w2}
      y, _ = ep_moe(x, lyr, v, st.e2s, st.ep, TINY.num_experts)
      return jnp.sum(y * ct)[None]

    def to_slots(w):  # canonical [E, ...] -> slot layout [N*S, ...] (empty slots zero)
      return jnp.zeros((n * st.slots,) + w.shape[1:], w.dtype).at[e2s].set(w)

    fn = jax.shard_map(local, mesh=st.mesh,
                       in_specs=(P(EP), P(EP), P(EP), P(), P(EP), P(EP), P(EP)),
                       out_specs=P(EP), check_vma=False)
    return jnp.sum(fn(x, jnp.asarray(valid), jnp.asarray(ct), router, to_slots(w1),
                      to_slots(w3), to_slots(w2)))

  def dense_loss(x, router, w1, w3, w2):
    lyr = {"router": router, "w1": w1, "w3": w3, "w2": w2}
    y, _ = tfm.moe_dense_reference(x, lyr, jnp.asarray(valid), top_k=TINY.top_k)
    return jnp.sum(y * ct * mask)

  args = (jnp.asarray(x), lp["router"], lp["w1"], lp["w3"], lp["w2"])
  argnums = tuple(range(5))
  got_val, got = jax.jit(jax.value_and_grad(ep_loss, argnums=argnums))(*args)
  want_val, want = jax.jit(jax.value_and_grad(dense_loss, argnums=argnums))(*args)
  assert abs(float(got_val) - float(want_val)) <= 1e-3 * max(1.0, abs(float(want_val)))
  for name, g, w in zip(("x", "router", "w1", "w3", "w2"), got, want, strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape
    assert np.abs(w).max() > 1e-2, name  # a real gradient, not a vacuous comparison
    diff = float(np.abs(g - w).max())
    assert diff <= 1e-4, f"N={n} d{name}: max|diff| {diff:.3g} (scale {np.abs(w).max():.3g})"
  # Invalid tokens get no gradient from the EP layer.
  assert (np.asarray(got[0])[~valid] == 0).all()


@pytest.mark.parametrize("n", (3, 8))
def test_capacity_buckets_change_no_bit(params, setups, n):
  """Exchange buffers sized by capacity factors (the smallest bucket of 1, 1.5, 2 or 4 x the
  balanced load cap/N, or the exact cap, that holds the largest count any
  worker sends to any worker) give bitwise the outputs of the exact capacity: 'random' routing
  takes a smaller bucket, 'skewed' (every copy to the holders of experts 6 and 7) the exact one,
  'full' (skewed, the first half of every worker's tokens valid) fills a smaller bucket to its
  last row with invalid copies behind it (an invalid copy's -1 send position once wrapped onto
  that row and overwrote a valid copy)."""
  st = setups(n)
  factors = (1, 1.5, 2, 4)
  bucketed = _variant(setups, n, capacity_factors=factors)
  lp = _layer0(params)
  t = 24
  e2s = np.asarray(st.e2s)
  for router in ("random", "skewed", "full"):
    rest_lp = {k: v[0] for k, v in st.rest["layers"].items()}
    rng = np.random.default_rng(40 + n)
    x = rng.standard_normal((n * t, TINY.hidden_size)).astype(np.float32)
    if router != "random":
      rest_lp = {**rest_lp, "router": _skewed_router(lp, rest_lp)}
      x = (np.abs(x) + 0.5) * 0.25
    valid = rng.random(n * t) > 0.25
    if router == "full":
      valid = np.tile(np.arange(t) < t // 2, n)
    outs = [[np.asarray(a) for a in _layer_fn(s)(rest_lp, st.experts, st.shard(x), st.shard(valid))]
            for s in (st, bucketed)]
    for a, b in zip(*outs, strict=True):
      np.testing.assert_array_equal(a, b)
    # the largest (source, destination) count decides the bucket
    experts = outs[0][1].reshape(n, t, -1)
    dest = e2s[experts] // st.slots
    sent = np.stack([np.bincount(dest[w][valid.reshape(n, t)[w]].reshape(-1), minlength=n)
                     for w in range(n)])  # [source, destination]
    counts = sent.max(1)
    cap = t * TINY.top_k
    if router == "random":
      assert max(counts) <= cap // 2, counts  # a smaller bucket than the exact capacity
    caps = exchange_capacities(cap, n, factors)
    if router == "full":  # the last worker's rows of a smaller bucket are exactly full
      assert sent[:, -1].max() == sent.max() and sent.max() in caps[:-1], (sent, caps)


def test_exchange_capacities_and_tile_for_rows():
  """Capacity buckets: factors of the balanced load tokens*k/N, rounded up, the exact capacity
  last and never exceeded (one worker: only the exact one). Tiles: half the rows per expert as a
  power of two at most the rows below 16, at most half of them from there, 1 to 128."""
  assert exchange_capacities(4096, 8, (1.25, 1.5, 2)) == [640, 768, 1024, 4096]
  assert exchange_capacities(48, 8, (1, 1.5, 2, 4)) == [6, 9, 12, 24, 48]
  assert exchange_capacities(48, 1, (1.25, 2)) == [48]
  assert exchange_capacities(48, 8, (0, 100)) == [48]
  assert [tile_m_for_rows(r) for r in (0.5, 2, 3, 8, 15, 16, 32, 64, 256, 4096)] == [
      1, 2, 2, 8, 8, 8, 16, 32, 128, 128]


# ----------------------------------------------------------------------------- 4. ragged exchange


def _ragged_model(operands, outputs, in_off, send, out_off, recv):
  """numpy model of ragged_all_to_all, written from its documented SEND / RECEIVE pseudocode:
  worker w's slice i goes to worker i // (K / N) and lands at w's output_offsets[i] there."""
  n, k = in_off.shape
  per = k // n
  results = [o.copy() for o in outputs]
  for w in range(n):
    for i in range(k):
      dst = i // per
      sl = operands[w][in_off[w, i]: in_off[w, i] + send[w, i]]
      # the receiver's recv_sizes entry for this slice: its slice (w * per + i % per)
      assert recv[dst, w * per + i % per] == send[w, i]
      results[dst][out_off[w, i]: out_off[w, i] + send[w, i]] = sl
  return results


@pytest.mark.parametrize("per", (1, 2))
def test_ragged_all_to_all_reference_matches_numpy_model(per):
  """The pure-JAX ragged_all_to_all (what the ragged exchange runs on CPU) on 4 workers with
  random slice sizes (zeros included), slices laid out in random order with gaps on the sending
  side, written in random order with gaps on the receiving side, 1 or 2 slices per destination:
  equals the numpy model row for row, and rows nobody writes keep `output`'s values."""
  from flexfloor_jax.kernels.ragged_exchange import ragged_all_to_all
  n, rows_in, rows_out, d = 4, 24, 40, 3
  k = n * per
  rng = np.random.default_rng(50 + per)
  send = rng.integers(0, 4, (n, k))  # slice i of worker w: send[w, i] rows
  send[0, 0] = 0
  in_off = np.zeros((n, k), np.int64)
  for w in range(n):  # sender layout: random slice order, random gaps
    at = 0
    for i in rng.permutation(k):
      at += int(rng.integers(0, 2))
      in_off[w, i], at = at, at + send[w, i]
    assert at <= rows_in
  recv = np.zeros((n, k), np.int64)
  out_off = np.zeros((n, k), np.int64)
  for dst in range(n):  # receiver layout: its incoming slices in random order, random gaps
    incoming = [(w, dst * per + j) for w in range(n) for j in range(per)]
    at = 0
    for j in rng.permutation(len(incoming)):
      w, i = incoming[j]
      at += int(rng.integers(0, 3))
      out_off[w, i], at = at, at + send[w, i]
      recv[dst, w * per + i % per] = send[w, i]
    assert at <= rows_out
  operands = rng.standard_normal((n, rows_in, d)).astype(np.float32)
  outputs = rng.standard_normal((n, rows_out, d)).astype(np.float32)
  want = np.stack(_ragged_model(operands, outputs, in_off, send, out_off, recv))
  assert not np.array_equal(want, outputs)

  mesh = jax.make_mesh((n,), (EP,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])
  fn = jax.jit(jax.shard_map(
      lambda *a: ragged_all_to_all(*(x[0] for x in a), axis_name=EP, impl="reference")[None],
      mesh=mesh, in_specs=P(EP), out_specs=P(EP), check_vma=False))
  def i32(a):
    return jnp.asarray(a, jnp.int32)
  got = fn(operands, outputs, i32(in_off), i32(send), i32(out_off), i32(recv))
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("n,chunk", [(n, 64) for n in MESH_SIZES] + [(1, 8), (8, 8)])
def test_ragged_exchange_bitwise_equals_all_to_all(params, setups, n, chunk):
  """exchange='ragged' (the reference ragged_all_to_all on CPU) gives bitwise the outputs, routed
  experts and counts of exchange='all_to_all' on every mesh size, for random routing and for
  'skewed' routing (every copy of every worker to one or two destinations: the worst case the
  receive buffer is sized for), with invalid tokens, in one chunk (24 tokens per worker, chunk
  64) and in three (chunk 8, on one and on eight workers)."""
  base = _variant(setups, n, chunk_tokens=chunk)
  ragged = _variant(setups, n, chunk_tokens=chunk, exchange="ragged")
  for router in ("random", "skewed"):
    rest_lp, x, valid = _layer_inputs(params, base, n, 24, router, 60 + n)
    outs = [[np.asarray(a) for a in _layer_fn(s)(rest_lp, s.experts, s.shard(x), s.shard(valid))]
            for s in (base, ragged)]
    assert np.abs(outs[0][0][valid]).max() > 0.1  # a real output, not zeros on both sides
    for a, b in zip(*outs, strict=True):
      np.testing.assert_array_equal(a, b)
    assert (outs[1][0][~valid] == 0).all()


@pytest.mark.parametrize("platform", ("tpu", "cuda"))
def test_ragged_exchange_lowers_to_native_op(setups, platform):
  """The shard_mapped EP layer with exchange='ragged' exports for TPU and CUDA from this CPU
  machine, and there it is the native ragged_all_to_all (rows and slot ids out, rows back), not
  the CPU reference's padded all_to_all."""
  n = 4
  st = _variant(setups, n, exchange="ragged")
  rest_lp = {k: v[0] for k, v in st.rest["layers"].items()}
  x = np.zeros((n * 8, TINY.hidden_size), np.float32)
  valid = np.ones(n * 8, bool)
  rest_specs = jax.tree.map(lambda _: P(), rest_lp)
  _, expert_specs = st.specs()
  def sds(tree, specs):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=NamedSharding(st.mesh, s)),
        tree, specs)
  args = (sds(rest_lp, rest_specs), sds(st.experts, expert_specs),
          sds(x, P(EP)), sds(valid, P(EP)))
  exported = jax.export.export(
      _layer_fn(st), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
  text = exported.mlir_module()
  # a custom call today (@ragged_all_to_all); a StableHLO op should it become one
  ops = re.findall(r"(?:@|stablehlo\.)ragged_all_to_all\b", text)
  assert len(ops) == 3, ops
  assert "stablehlo.all_to_all" not in text


def test_exchange_setting_reaches_the_layer():
  """model.exchange: 'auto' resolves by backend (all_to_all on CPU, where ragged_all_to_all does
  not exist), an explicit value reaches EngineSpec's EPConfig, and a bad value fails the config
  check and EPConfig alike."""
  from flexfloor_jax import engine as engine_lib
  from flexfloor_jax.config.files import load_config
  from flexfloor_jax.config.settings import ConfigError, load
  spec = engine_lib.EngineSpec(cfg=TINY, slots_per_worker=2, expert_slots=4, max_seq_len=16,
                               max_prompt_len=8, max_new_tokens=8, sampling=None)
  auto = "all_to_all" if jax.default_backend() == "cpu" else "ragged"
  assert spec.ep(2, 8).exchange == auto
  assert dataclasses.replace(spec, exchange="ragged").ep(2, 8).exchange == "ragged"
  with pytest.raises(ValueError, match="exchange"):
    dataclasses.replace(spec, exchange="nccl").ep(2, 8)
  c = load_config("mixtral", "tiny")
  assert c.model.exchange == "auto"
  assert load(c).model.exchange == "auto"
  c.model.exchange = "nccl"
  with pytest.raises(ConfigError, match="model.exchange: must be"):
    load(c)
