"""The compiled GPU kernels on a real GPU. The Mosaic GPU grouped matmul (kernels/grouped_matmul.py
`_gmm_mgpu`, Hopper wgmma): equal to the XLA path and to a float64 reference, zeros in unused tiles,
gradients, bitwise batch invariance, and the EP MoE layer with backend='pallas'. The Pallas Triton
permute and combine (`_permute_gpu`, `_combine_gpu`): bitwise equal to the XLA gather and to the
combine's definition, and their gradients. The Pallas Triton paged attention
(`kernels/paged_attention.py`, impl='pallas') against its XLA reference. Skipped without a GPU
(CI); `scripts/device_check.sh` runs it on a lent one. test_kernels.py checks the same kernels in
interpret mode and their lowering for cuda from a CPU machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_utils import combine_numpy, paged_attention_inputs

from flexfloor_jax.kernels.combine import combine
from flexfloor_jax.kernels.dispatch_plan import make_plan, padded_rows
from flexfloor_jax.kernels.grouped_matmul import grouped_matmul
from flexfloor_jax.kernels.paged_attention import paged_attention, paged_attention_xla
from flexfloor_jax.kernels.permute import permute, permute_xla

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a GPU (compiled Mosaic GPU kernel)")

_gmm = jax.jit(grouped_matmul, static_argnames=("tile_m", "impl", "interpret",
                                                "preferred_element_type", "transpose_rhs"))
_permute = jax.jit(permute, static_argnames=("impl", "interpret"))
_combine = jax.jit(combine, static_argnames=("impl", "interpret"))


def _inputs(seed, rows, groups, tile_m, k, n, transpose_rhs=False, p_skip=0.15):
  """Padded-layout bf16 inputs from random group ids (some empty groups, some rows undispatched)."""
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.ones(groups))
  probs[rng.choice(groups, 2, replace=False)] = 0.0  # two empty groups
  probs /= probs.sum()
  ids = rng.choice(groups, rows, p=probs)
  ids[rng.random(rows) < p_skip] = -1
  plan = make_plan(jnp.asarray(ids, jnp.int32), groups, tile_m, padded_rows(rows, groups, tile_m))
  x = rng.standard_normal((rows, k)).astype(np.float32)
  lhs = jnp.zeros((plan.row_src.shape[0], k), jnp.bfloat16).at[plan.row_dst].set(
      jnp.asarray(x, jnp.bfloat16), mode="drop")
  shape = (groups, n, k) if transpose_rhs else (groups, k, n)
  rhs = jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), jnp.bfloat16)
  return plan, lhs, rhs


def _reference(lhs, rhs, tile_group, used, tile_m, transpose_rhs):
  l64 = np.asarray(lhs.astype(jnp.float32), np.float64)
  r64 = np.asarray(rhs.astype(jnp.float32), np.float64)
  out = np.zeros((l64.shape[0], r64.shape[1] if transpose_rhs else r64.shape[2]))
  for i in range(int(used)):
    w = r64[int(tile_group[i])]
    out[i * tile_m:(i + 1) * tile_m] = l64[i * tile_m:(i + 1) * tile_m] @ (w.T if transpose_rhs
                                                                           else w)
  return out


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("tile_m", [8, 16, 64, 128, 256])  # 8, 16: the swapped decode kernel
def test_mosaic_gpu_gmm_equals_xla_and_float64(tile_m, transpose_rhs):
  k, n = 512, 768
  plan, lhs, rhs = _inputs(tile_m + transpose_rhs, 1000, 8, tile_m, k, n, transpose_rhs)
  args = (lhs, rhs, plan.tile_group, plan.num_tiles_used)
  kw = dict(tile_m=tile_m, transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32)
  hlo = _gmm.lower(*args, **kw, impl="pallas").as_text()
  assert "mosaic_gpu" in hlo, "the Pallas path fell back to XLA: not the Mosaic GPU kernel"
  out_p = np.asarray(_gmm(*args, **kw, impl="pallas"))
  out_x = np.asarray(_gmm(*args, **kw, impl="xla"))
  assert np.isfinite(out_p).all()
  used = int(plan.num_tiles_used) * tile_m
  assert 0 < used < out_p.shape[0]  # some unused tiles
  assert not out_p[used:].any(), "unused tiles must be zero"
  ref = _reference(lhs, rhs, plan.tile_group, plan.num_tiles_used, tile_m, transpose_rhs)
  # bf16 operands, fp32 accumulation: both paths within accumulation-order rounding of float64
  assert _rel(out_p, ref) <= 1e-5, _rel(out_p, ref)
  assert _rel(out_x, ref) <= 1e-3, _rel(out_x, ref)
  assert _rel(out_p, out_x) <= 1e-3, _rel(out_p, out_x)


def test_mosaic_gpu_gmm_bf16_output_and_gradients():
  """bf16 output (forward) and the gradients (d_lhs: the same kernel on transposed weights, bf16
  output; d_rhs: the XLA tgmm), each path against float64: a bf16 result is within its rounding
  (relative norm ~2e-3) of the exact one."""
  # d_lhs contracts over N: N=512 (8 K-steps of 64), clear of the race below
  tile_m, k, n = 128, 256, 512
  plan, lhs, rhs = _inputs(7, 600, 4, tile_m, k, n)
  tg, used = plan.tile_group, plan.num_tiles_used
  ref = _reference(lhs, rhs, tg, used, tile_m, False)
  for impl in ("pallas", "xla"):
    out = _gmm(lhs, rhs, tg, used, tile_m=tile_m, impl=impl)
    assert out.dtype == jnp.bfloat16
    assert _rel(np.asarray(out.astype(jnp.float32)), ref) <= 5e-3, (impl, "out")
  ct = jax.random.normal(jax.random.key(8), ref.shape, jnp.float32)
  d_out = ct.astype(jnp.bfloat16)  # the cotangent enters in the operand precision
  ref_dl = _reference(d_out, jnp.swapaxes(rhs, 1, 2), tg, used, tile_m, False)
  errs = {}

  def loss(left, right, impl):
    out = grouped_matmul(left, right, tg, used, tile_m=tile_m, impl=impl)
    return jnp.sum(out.astype(jnp.float32) * ct)

  for impl in ("pallas", "xla"):
    d_lhs, d_rhs = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(lhs, rhs, impl)
    errs[impl] = _rel(np.asarray(d_lhs.astype(jnp.float32)), ref_dl)
    # d_rhs: both paths use the XLA tgmm
    assert np.abs(np.asarray(d_rhs.astype(jnp.float32))).max() > 0
  assert max(errs.values()) <= 5e-3, errs


@pytest.mark.parametrize("tile_m", [8, 128])
def test_mosaic_gpu_gmm_batch_invariance_bitwise(tile_m):
  """A row's output is bitwise the same whatever else is in the batch and wherever its tile is."""
  k, n, groups, rows = 256, 256, 4, 3 * 128
  rng = np.random.default_rng(9)
  rhs = jnp.asarray(rng.standard_normal((groups, k, n)) / 16, jnp.bfloat16)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  row = 5
  outs = []
  for trial in range(3):
    ids = rng.choice([-1, 0, 2, 3], size=rows, p=[0.1, 0.2 * trial, 0.4, 0.5 - 0.2 * trial])
    ids[rng.random(rows) < 0.3] = 1
    ids[row] = 1
    x2 = rng.standard_normal((rows, k)).astype(np.float32)
    x2[row] = x[row]
    plan = make_plan(jnp.asarray(ids, jnp.int32), groups, tile_m,
                     padded_rows(rows, groups, tile_m))
    lhs = jnp.zeros((plan.row_src.shape[0], k), jnp.bfloat16).at[plan.row_dst].set(
        jnp.asarray(x2, jnp.bfloat16), mode="drop")
    out = _gmm(lhs, rhs, plan.tile_group, plan.num_tiles_used, tile_m=tile_m, impl="pallas",
               preferred_element_type=jnp.float32)
    outs.append(np.asarray(out)[int(plan.row_dst[row])])
  for o in outs[1:]:
    assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))


def test_ep_moe_pallas_backend_equals_xla_on_one_gpu():
  """The EP MoE layer (one worker, 8 expert slots) with backend='pallas' (Mosaic GPU grouped
  matmuls) against backend='xla', bf16, tile_m=64."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from flexfloor_jax.model.moe import EPConfig, ep_moe
  from flexfloor_jax.runtime import mesh as mesh_lib

  d, f, e, k, t = 256, 512, 8, 2, 96
  keys = jax.random.split(jax.random.key(11), 5)
  x = jax.random.normal(keys[0], (t, d), jnp.bfloat16)
  router = jax.random.normal(keys[1], (d, e), jnp.bfloat16)
  w1 = (jax.random.normal(keys[2], (e, d, f)) / 16).astype(jnp.bfloat16)
  w3 = (jax.random.normal(keys[3], (e, d, f)) / 16).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[4], (e, f, d)) / 22).astype(jnp.bfloat16)
  mesh = mesh_lib.make_ep_mesh(jax.devices()[:1])
  e2s = jnp.arange(e, dtype=jnp.int32)
  ep_ax = mesh_lib.EP_AXIS

  def run(backend):
    ep = EPConfig(num_workers=1, slots_per_worker=e, top_k=k, tile_m=64, chunk_tokens=t,
                  backend=backend)

    def local(x, router, w1, w3, w2):
      lp = {"router": router, "w1": w1, "w3": w3, "w2": w2}
      return ep_moe(x, lp, jnp.ones(x.shape[0], bool), e2s, ep, e)[0]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(ep_ax), P()) + (P(ep_ax),) * 3,
                               out_specs=P(ep_ax), check_vma=False))
    def put(a, s):
      return jax.device_put(a, NamedSharding(mesh, s))
    return np.asarray(fn(put(x, P(ep_ax)), put(router, P()), put(w1, P(ep_ax)),
                         put(w3, P(ep_ax)), put(w2, P(ep_ax))).astype(jnp.float32))

  yp, yx = run("pallas"), run("xla")
  assert np.isfinite(yp).all() and np.abs(yx).max() > 0
  assert _rel(yp, yx) <= 2e-2, _rel(yp, yx)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [4096, 256, 96])  # Mixtral's D; a small one; not a power of two
def test_triton_permute_and_combine_equal_xla(d, dtype):
  """Dispatch -> (expert rows) -> unpermute -> top-2 combine through a padded plan, compiled."""
  rng = np.random.default_rng(d)
  tokens, top_k, groups, tile_m = 200, 2, 8, 8
  ids = rng.choice(groups, tokens * top_k)
  ids[rng.random(ids.size) < 0.1] = -1  # some copies not dispatched
  plan = make_plan(jnp.asarray(ids, jnp.int32), groups, tile_m,
                   padded_rows(ids.size, groups, tile_m))
  x = jnp.asarray(rng.standard_normal((tokens * top_k, d)), dtype)
  src = jnp.concatenate([plan.row_src, jnp.asarray([-5, x.shape[0] + 3], jnp.int32)])  # clamped
  text = _permute.lower(x, src, impl="pallas").as_text()
  assert "triton" in text, "impl='pallas' fell back to XLA: not the Triton kernel"
  xp = _permute(x, src, impl="pallas")
  np.testing.assert_array_equal(np.asarray(xp).view(np.uint8),
                                np.asarray(_permute(x, src, impl="xla")).view(np.uint8))
  back = _permute(xp[:plan.row_src.shape[0]], plan.row_dst, impl="pallas")
  np.testing.assert_array_equal(np.asarray(back).view(np.uint8),
                                np.asarray(permute_xla(xp[:plan.row_src.shape[0]],
                                                       plan.row_dst)).view(np.uint8))

  y = jnp.asarray(rng.standard_normal((plan.row_src.shape[0], d)), dtype)
  row_dst = plan.row_dst.reshape(tokens, top_k)
  w = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
  w = jnp.where(row_dst < 0, jnp.nan, w)  # skipped slots add nothing, even with a nan weight
  assert "triton" in _combine.lower(y, row_dst, w, impl="pallas").as_text()
  out = np.asarray(_combine(y, row_dst, w, impl="pallas"))
  ref = combine_numpy(np.asarray(y.astype(jnp.float32)), np.asarray(row_dst), np.asarray(w))
  ref = np.asarray(jnp.asarray(ref).astype(dtype))
  assert np.isfinite(out.astype(np.float32)).all()
  # The kernel's products are rounded on their own (mul.rn): the definition's bits exactly.
  np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8))
  # combine_xla on the GPU: XLA may fuse its multiply and add into an FMA (one rounding less per
  # term), so within 2 ulp of the output dtype rather than bitwise; printed for the record.
  out_x = np.asarray(_combine(y, row_dst, w, impl="xla"))
  print(f"d={d} {jnp.dtype(dtype).name}: combine kernel == combine_xla bitwise: "
        f"{np.array_equal(out.view(np.uint8), out_x.view(np.uint8))}")
  np.testing.assert_array_max_ulp(out.astype(np.float32), out_x.astype(np.float32),
                                  maxulp=2 if dtype == jnp.float32 else 2 * 2**16)


def test_triton_permute_and_combine_gradients():
  """impl='pallas' trains with the XLA backward passes: the gradients' bits equal impl='xla'."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((64, 512)), jnp.float32)
  src = jnp.asarray(rng.integers(-1, 64, 96), jnp.int32)
  dst = jnp.asarray(rng.integers(-1, 96, (32, 2)), jnp.int32)
  w = jnp.asarray(rng.random((32, 2)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((32, 512)), jnp.float32)

  def loss(x, w, impl):
    return jnp.sum(combine(permute(x, src, impl=impl), dst, w, impl=impl) * ct)

  grads = {impl: jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, impl)
           for impl in ("pallas", "xla")}
  for gp, gx in zip(grads["pallas"], grads["xla"], strict=True):
    assert np.abs(np.asarray(gx)).max() > 0
    np.testing.assert_array_equal(np.asarray(gp), np.asarray(gx))


@pytest.mark.xfail(strict=False, reason=(
    "race in _gmm_mgpu: with block_m=128 and K/64 = 5 or 6 pipeline steps (3 in flight) some rows "
    "come out wrong (a few % of a tile's norm) and differ from run to run on an H200 "
    "(scripts/probe_mgpu_bf16.py reproduces it); other K/64 and every K at tile_m=64 are right "
    "and repeatable"))
@pytest.mark.parametrize("k", [320, 384])
def test_mosaic_gpu_gmm_k_steps_5_6_tile_128(k):
  tile_m, n = 128, 256
  plan, lhs, rhs = _inputs(k, 600, 4, tile_m, k, n, p_skip=0.1)
  args = (lhs, rhs, plan.tile_group, plan.num_tiles_used)
  kw = dict(tile_m=tile_m, preferred_element_type=jnp.float32, impl="pallas")
  ref = _reference(*args, tile_m, False)
  outs = [np.asarray(_gmm(*args, **kw)) for _ in range(3)]
  for o in outs:
    assert _rel(o, ref) <= 1e-5, _rel(o, ref)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)],
                         ids=["f32", "bf16"])
def test_paged_attention_triton_equals_reference(dtype, tol):
  """The compiled Triton paged-attention kernel (what model.attention_backend='pallas' runs on a
  CUDA GPU) against the XLA reference on ragged lengths and shuffled pages, in fp32 at the highest
  matmul precision (another implementation: <= 1e-4) and in bf16; empty rows exactly 0."""
  q, kp, vp, table, lengths = paged_attention_inputs(4, dtype)
  with jax.default_matmul_precision("highest"):
    got = jax.jit(lambda *a: paged_attention(*a, impl="pallas"))(q, kp, vp, table, lengths)
    ref = jax.jit(paged_attention_xla)(*(x.astype(jnp.float32) if x.dtype == dtype else x
                                         for x in (q, kp, vp, table, lengths)))
  d = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(ref))))
  print(f"triton paged attention {jnp.dtype(dtype).name}: max|diff| {d:.3g}")
  assert got.dtype == dtype and d <= tol
  np.testing.assert_array_equal(np.asarray(got, np.float32)[4], 0)
