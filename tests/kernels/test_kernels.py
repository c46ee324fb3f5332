"""MoE dispatch kernels: plan invariants, Pallas (interpret) == XLA, gradients, batch invariance,
and cross-platform lowering of the compiled Pallas kernels from this CPU machine."""

import functools
import importlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Submodule imports: they work even where `kernels` was installed (editable) before it had an
# __init__.py and resolves as a namespace package.
from kernel_utils import combine_numpy

from flexfloor_jax.kernels.combine import combine
from flexfloor_jax.kernels.dispatch_plan import make_plan, padded_rows
from flexfloor_jax.kernels.grouped_matmul import grouped_matmul
from flexfloor_jax.kernels.permute import permute

S = jax.ShapeDtypeStruct
# the modules (the package's `grouped_matmul` etc. attributes are the functions)
gmm_lib = importlib.import_module("flexfloor_jax.kernels.grouped_matmul")
gmm_tpu = importlib.import_module("flexfloor_jax.kernels.gmm_tpu")
gmm_xla = importlib.import_module("flexfloor_jax.kernels.gmm_xla")
permute_lib = importlib.import_module("flexfloor_jax.kernels.permute")
combine_lib = importlib.import_module("flexfloor_jax.kernels.combine")
triton_util = importlib.import_module("flexfloor_jax.kernels.triton_util")


def _key(seed):
  return jax.random.key(seed)


def _group_ids(seed, num_rows, num_groups, p_undispatched=0.2, probs=None):
  """Random group ids with some -1 (not dispatched)."""
  rng = np.random.default_rng(seed)
  g = rng.choice(num_groups, size=num_rows, p=probs)
  g[rng.random(num_rows) < p_undispatched] = -1
  return g.astype(np.int32)


# Edge-case assignments shared by the kernel tests, all with the same (rows, groups) so that each
# jitted kernel compiles once for the whole file: (name, group_ids).
NUM_ROWS, NUM_GROUPS = 40, 6


def _one_row_groups():
  g = np.full((NUM_ROWS,), -1, np.int32)
  g[[3, 17, 30]] = [4, 0, 2]  # groups 1, 3, 5 empty
  return g


CASES = [
    ("mixed_empty_groups", _group_ids(1, NUM_ROWS, NUM_GROUPS, probs=[0.4, 0, 0.3, 0, 0.3, 0])),
    ("one_row_groups", _one_row_groups()),
    ("all_in_one_group", np.full((NUM_ROWS,), 2, np.int32)),
    ("undispatched_rows", _group_ids(2, NUM_ROWS, NUM_GROUPS, p_undispatched=0.6)),
    ("nothing_dispatched", np.full((NUM_ROWS,), -1, np.int32)),
]
CASE_IDS = [c[0] for c in CASES]

_jit_gmm = jax.jit(
    grouped_matmul,
    static_argnames=("tile_m", "impl", "interpret", "preferred_element_type", "transpose_rhs"),
)
_jit_permute = jax.jit(permute, static_argnames=("impl", "interpret"))
_jit_combine = jax.jit(combine, static_argnames=("impl", "interpret"))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _plan(group_ids, num_groups, tile_m):
  rows = padded_rows(group_ids.shape[0], num_groups, tile_m)
  return make_plan(jnp.asarray(group_ids), num_groups, tile_m, rows)


# --------------------------------------------------------------------------------------------------
# dispatch plan


def _numpy_plan(group_ids, num_groups, tile_m, num_rows_padded):
  """Loop reference of the padded tile layout."""
  row_src = np.full(num_rows_padded, -1)
  row_dst = np.full(len(group_ids), -1)
  tile_group, pos = [], 0
  for g in range(num_groups):
    rows = [r for r, gid in enumerate(group_ids) if gid == g]
    for j, r in enumerate(rows):
      row_src[pos + j] = r
      row_dst[r] = pos + j
    tiles = -(-len(rows) // tile_m)
    tile_group += [g] * tiles
    pos += tiles * tile_m
  used = len(tile_group)
  fill = tile_group[-1] if tile_group else 0
  tile_group += [fill] * (num_rows_padded // tile_m - used)
  return row_src, row_dst, np.array(tile_group), used


def test_padded_rows_is_minimal_and_safe():
  """Exhaustive over tiny sizes: no assignment needs more rows, and some assignment needs all."""
  for num_rows, num_groups, tile_m in itertools.product(range(0, 7), range(1, 4), range(1, 4)):
    worst = 0
    for sizes in itertools.product(range(num_rows + 1), repeat=num_groups):
      if sum(sizes) == num_rows:
        worst = max(worst, sum(-(-s // tile_m) for s in sizes))
    assert padded_rows(num_rows, num_groups, tile_m) == max(worst, 1) * tile_m


@pytest.mark.parametrize("name,group_ids", CASES, ids=CASE_IDS)
def test_make_plan_matches_loop_reference(name, group_ids):
  num_groups = NUM_GROUPS
  tile_m = 4
  plan = _plan(group_ids, num_groups, tile_m)
  rows = plan.row_src.shape[0]
  row_src, row_dst, tile_group, used = _numpy_plan(group_ids, num_groups, tile_m, rows)
  np.testing.assert_array_equal(plan.row_src, row_src)
  np.testing.assert_array_equal(plan.row_dst, row_dst)
  np.testing.assert_array_equal(plan.tile_group, tile_group)
  assert int(plan.num_tiles_used) == used
  np.testing.assert_array_equal(
      plan.group_sizes, [(group_ids == g).sum() for g in range(num_groups)]
  )


def test_make_plan_conservation_order_and_determinism():
  num_groups, tile_m = 7, 8
  group_ids = _group_ids(3, 300, num_groups, probs=np.array([30, 1, 0, 5, 2, 1, 0.5]) / 39.5)
  plan = _plan(group_ids, num_groups, tile_m)
  # Deterministic: a second call (fresh device buffers) and the loop reference agree exactly.
  again = _plan(np.array(group_ids), num_groups, tile_m)
  for a, b in zip(jax.tree.leaves(plan), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(a, b)
  want = _numpy_plan(group_ids, num_groups, tile_m, plan.row_src.shape[0])
  np.testing.assert_array_equal(plan.row_src, want[0])

  row_src, row_dst = np.asarray(plan.row_src), np.asarray(plan.row_dst)
  dispatched = np.flatnonzero(group_ids >= 0)
  # Every dispatched row appears exactly once; padding is -1; the two maps are inverse.
  np.testing.assert_array_equal(np.sort(row_src[row_src >= 0]), dispatched)
  assert (row_dst[group_ids < 0] == -1).all()
  np.testing.assert_array_equal(row_src[row_dst[dispatched]], dispatched)
  filled = np.flatnonzero(row_src >= 0)
  np.testing.assert_array_equal(row_dst[row_src[filled]], filled)
  # Tiles are single-group, groups are ordered, order inside a group is by source row (stable).
  assert (np.asarray(plan.tile_group)[filled // tile_m] == group_ids[row_src[filled]]).all()
  keys = group_ids[row_src[filled]] * 10_000 + row_src[filled]
  assert (np.diff(keys) > 0).all()


# --------------------------------------------------------------------------------------------------
# permute


@pytest.mark.parametrize("name,group_ids", CASES, ids=CASE_IDS)
def test_permute_pallas_equals_xla_and_roundtrips(name, group_ids):
  plan = _plan(group_ids, NUM_GROUPS, 8)
  seed = CASE_IDS.index(name)
  x = jax.random.normal(_key(100 + seed), (len(group_ids), 128), jnp.float32)
  xp = _jit_permute(x, plan.row_src)
  src = np.asarray(plan.row_src)
  ref = np.where((src >= 0)[:, None], np.asarray(x)[np.maximum(src, 0)], 0)
  np.testing.assert_array_equal(xp, ref)
  np.testing.assert_array_equal(_jit_permute(x, plan.row_src, impl="pallas", interpret=True), xp)
  # Unpermute with row_dst gives x back for dispatched rows and zeros for the others.
  back = _jit_permute(xp, plan.row_dst, impl="pallas", interpret=True)
  np.testing.assert_array_equal(back, np.where((group_ids >= 0)[:, None], x, 0))


def test_permute_bf16():
  x = jax.random.normal(_key(7), (50, 256), jnp.bfloat16)
  idx = jax.random.randint(_key(8), (64,), -1, 50)
  np.testing.assert_array_equal(
      _jit_permute(x, idx, impl="pallas", interpret=True).astype(jnp.float32),
      _jit_permute(x, idx).astype(jnp.float32),
  )


# --------------------------------------------------------------------------------------------------
# grouped matmul


def _dense_reference(lhs, rhs, tile_group, used, tile_m, transpose_rhs=False):
  """Every group densely over all rows, masked to the rows of its tiles (jnp, differentiable)."""
  tile_of_row = jnp.arange(lhs.shape[0]) // tile_m
  row_group = jnp.where(tile_of_row < used, tile_group[tile_of_row], -1)
  out = 0.0
  for g in range(rhs.shape[0]):
    w = rhs[g].T if transpose_rhs else rhs[g]
    out = out + jnp.where((row_group == g)[:, None], jnp.dot(lhs, w, precision="highest"), 0.0)
  return out


_jit_dense = jax.jit(_dense_reference, static_argnums=(4, 5))


def _gmm_inputs(seed, group_ids, num_groups, tile_m, k_dim, n_dim, transpose_rhs=False):
  plan = _plan(group_ids, num_groups, tile_m)
  x = jax.random.normal(_key(seed), (len(group_ids), k_dim)) / np.sqrt(k_dim)
  lhs = _jit_permute(x, plan.row_src)
  shape = (num_groups, n_dim, k_dim) if transpose_rhs else (num_groups, k_dim, n_dim)
  rhs = jax.random.normal(_key(seed + 1), shape)
  return plan, lhs, rhs


@pytest.mark.parametrize("schedule", ["weights_outer", "k_blocked"])
@pytest.mark.parametrize("name,group_ids", CASES, ids=CASE_IDS)
def test_grouped_matmul_pallas_equals_xla(name, group_ids, schedule, monkeypatch):
  num_groups, tile_m, seed = NUM_GROUPS, 8, 200 + 10 * CASE_IDS.index(name)
  # K=384 and N=640: 5 N-blocks of 128 in either TPU schedule, 3 K-blocks of 128 in the K-blocked
  # one (forced by a zero VMEM budget for the weights-outer one).
  if schedule == "k_blocked":
    monkeypatch.setattr(gmm_tpu, "_TPU_VMEM_BUDGET", 0)
  plan, lhs, rhs = _gmm_inputs(seed, group_ids, num_groups, tile_m, 384, 640)
  args = (lhs, rhs, plan.tile_group, plan.num_tiles_used)
  out = _jit_gmm(*args, tile_m=tile_m)
  ref = _jit_dense(*args, tile_m)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
  # a fresh trace: the schedule is chosen at trace time from the module's budget
  pallas = jax.jit(lambda *a: grouped_matmul(*a, tile_m=tile_m, impl="pallas", interpret=True))
  out_pallas = pallas(*args)
  assert float(jnp.max(jnp.abs(out_pallas - out))) <= 1e-5
  used_rows = int(plan.num_tiles_used) * tile_m
  assert not np.asarray(out_pallas[used_rows:]).any() and not np.asarray(out[used_rows:]).any()


def test_grouped_matmul_xla_any_tile_order():
  """The XLA loop takes each run of same-group tiles with one weight slice; tiles need not be
  sorted by group (a group may come back after another), and tiles past num_tiles_used are zero."""
  tile_m, k_dim, n_dim, groups = 8, 64, 96, 5
  tile_group = jnp.asarray([3, 3, 0, 3, 1, 1, 1, 4, 2, 2], jnp.int32)
  lhs = jax.random.normal(_key(900), (tile_group.shape[0] * tile_m, k_dim))
  rhs = jax.random.normal(_key(901), (groups, k_dim, n_dim))
  for used in (0, 1, 4, 8, 10):
    out = _jit_gmm(lhs, rhs, tile_group, used, tile_m=tile_m)
    ref = _jit_dense(lhs, rhs, tile_group, used, tile_m)
    assert float(jnp.max(jnp.abs(out - ref))) <= 1e-5, used
    assert not np.asarray(out[used * tile_m:]).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tile_m,transpose_rhs", [(8, False), (8, True), (32, False)])
def test_grouped_matmul_xla_rounds_equal_run_loop_bitwise(dtype, tile_m, transpose_rhs):
  """The XLA forward picks group-batched rounds (weights read in place) or the run loop (one slice
  per run) from the tile counts; the choice must not change a bit, in any tile order, with empty
  groups and unused tiles, or a token's output would depend on its batch company."""
  k_dim, n_dim, groups = 64, 96, 5
  rng = np.random.default_rng(tile_m + 7 * transpose_rhs)
  shape = (groups, n_dim, k_dim) if transpose_rhs else (groups, k_dim, n_dim)
  rhs = jax.random.normal(_key(910 + tile_m), shape, dtype)
  kw = dict(tile_m=tile_m, out_dtype=dtype, transpose_rhs=transpose_rhs)
  rounds = jax.jit(functools.partial(gmm_xla.gmm_rounds, **kw))
  run_loop = jax.jit(functools.partial(gmm_xla.gmm_run_loop, **kw))
  auto = jax.jit(functools.partial(gmm_xla.gmm_xla, **kw))
  layouts = [np.concatenate([np.arange(groups), np.full(5, groups - 1)]),  # decode: one round
             np.repeat(np.arange(groups), 2),  # balanced, two tiles per group: the run loop
             np.asarray([3, 3, 0, 3, 1, 1, 1, 4, 2, 2]),  # unsorted, a group comes back
             np.asarray([0] * 9 + [4]),  # skewed: the run loop
             rng.integers(0, groups, 10)]
  for i, tile_group in enumerate(layouts):
    tile_group = jnp.asarray(tile_group, jnp.int32)
    lhs = jax.random.normal(_key(920 + i), (tile_group.shape[0] * tile_m, k_dim), dtype)
    for used in (0, 3, 10):
      args = (lhs, rhs, tile_group, jnp.int32(used))
      ref = run_loop(*args)
      assert np.array_equal(np.asarray(rounds(*args)), np.asarray(ref)), (i, used)
      assert np.array_equal(np.asarray(auto(*args)), np.asarray(ref)), (i, used)
      assert not np.asarray(ref[used * tile_m:]).any()
      if used:
        assert np.asarray(ref[:tile_m]).any()


def _weight_fetches(sch, tile_group, used):
  """Weight blocks the Pallas TPU pipeline copies: it fetches a block only when the rhs index map
  gives a different block index than on the previous grid step (row-major grid order)."""
  fetched, prev = 0, None
  for idx in itertools.product(*(range(d) for d in sch.grid)):
    block = tuple(int(v) for v in sch.rhs_map(*idx, tile_group, np.asarray([used])))
    fetched += block != prev
    prev = block
  return fetched


def _pallas_cost_bytes(*args, **kw):
  jaxpr = jax.make_jaxpr(lambda *a: grouped_matmul(*a, impl="pallas", interpret=True, **kw))(*args)

  def calls(jx):  # pallas_call equations, also inside custom_vjp and other nested jaxprs
    for e in jx.eqns:
      if e.primitive.name == "pallas_call":
        yield e
      for v in e.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else [v]):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            yield from calls(sub)

  (eqn,) = list(calls(jaxpr.jaxpr))
  return eqn.params["cost_estimate"].bytes_accessed


def test_pallas_tpu_reads_each_expert_once_at_decode_shapes():
  """Decode shape (8-row tiles, 8-64 rows per expert, the weights a stack of several layers' slots
  as the MoE layer passes them): the TPU schedule fetches every used expert's weight blocks once,
  and the kernel's cost estimate counts each expert's weight bytes once (not once per tile)."""
  tile_m, k_dim, n_dim, slots, layers = 8, 256, 384, 4, 3
  sizes = [8, 64, 0, 30]  # rows per slot: one tile, eight tiles, empty, four tiles
  ids = np.repeat(np.arange(slots), sizes).astype(np.int32)
  plan = _plan(ids, slots, tile_m)
  tg = plan.tile_group + 1 * slots  # layer 1 of the stack, as moe.py offsets it
  used, num_tiles = int(plan.num_tiles_used), plan.tile_group.shape[0]
  assert used == 1 + 8 + 4 < num_tiles
  sch = gmm_tpu.tpu_schedule(num_tiles * tile_m, k_dim, n_dim, tile_m, 4, 4, False)
  assert sch.weights_outer
  n_blocks = n_dim // sch.tn
  assert _weight_fetches(sch, np.asarray(tg), used) == 3 * n_blocks  # three non-empty experts
  # the K-blocked schedule (long K) fetches a tile's weights per tile
  long_k = gmm_tpu.tpu_schedule(num_tiles * tile_m, 2**14, n_dim, tile_m, 4, 4, False)
  assert not long_k.weights_outer
  assert _weight_fetches(long_k, np.asarray(tg), used) == used * long_k.grid[1] * long_k.grid[2]

  lhs = S((num_tiles * tile_m, k_dim), jnp.float32)
  rhs = S((layers * slots, k_dim, n_dim), jnp.float32)
  args = (lhs, rhs, S(tg.shape, jnp.int32), S((), jnp.int32))
  w_bytes, lhs_bytes, out_bytes = k_dim * n_dim * 4, num_tiles * tile_m * k_dim * 4, \
      num_tiles * tile_m * n_dim * 4
  got = _pallas_cost_bytes(*args, tile_m=tile_m, num_groups=slots)
  assert got == slots * w_bytes + lhs_bytes * n_blocks + out_bytes, got
  # without the hint the estimate can only bound the groups by the tiles and the stack
  assert _pallas_cost_bytes(*args, tile_m=tile_m) == min(num_tiles, layers * slots) * w_bytes + \
      lhs_bytes * n_blocks + out_bytes


def test_grouped_matmul_transpose_rhs_and_bf16():
  group_ids, num_groups, tile_m = CASES[0][1], NUM_GROUPS, 16
  plan, lhs, rhs_GNK = _gmm_inputs(300, group_ids, num_groups, tile_m, 256, 128, transpose_rhs=True)
  args = (lhs, rhs_GNK, plan.tile_group, plan.num_tiles_used)
  out = _jit_gmm(*args, tile_m=tile_m, transpose_rhs=True)
  np.testing.assert_allclose(out, _jit_dense(*args, tile_m, transpose_rhs=True), atol=1e-5)
  out_p = _jit_gmm(*args, tile_m=tile_m, transpose_rhs=True, impl="pallas", interpret=True)
  assert float(jnp.max(jnp.abs(out_p - out))) <= 1e-5
  # bf16 operands, fp32 accumulation and output on both paths.
  bf = (lhs.astype(jnp.bfloat16), rhs_GNK.astype(jnp.bfloat16)) + args[2:]
  kw = dict(tile_m=tile_m, transpose_rhs=True, preferred_element_type=jnp.float32)
  out_bf = _jit_gmm(*bf, **kw)
  assert out_bf.dtype == jnp.float32
  out_bf_p = _jit_gmm(*bf, **kw, impl="pallas", interpret=True)
  assert float(jnp.max(jnp.abs(out_bf_p - out_bf))) <= 1e-5


def test_shape_checks():
  tg = jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match="tile_m"):  # tile_group was built for another tile_m
    grouped_matmul(jnp.zeros((64, 8)), jnp.zeros((2, 8, 8)), tg, 1, tile_m=8)
  with pytest.raises(ValueError, match="multiple of tile_m"):
    make_plan(jnp.zeros((5,), jnp.int32), 2, 4, 10)
  with pytest.raises(ValueError, match="impl"):
    permute(jnp.zeros((4, 8)), jnp.zeros((4,), jnp.int32), impl="triton")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_grouped_matmul_gradients(impl, transpose_rhs):
  group_ids, num_groups, tile_m = CASES[0][1], NUM_GROUPS, 8
  seed = 400 + 2 * transpose_rhs + (impl == "pallas")
  plan, lhs, rhs = _gmm_inputs(seed, group_ids, num_groups, tile_m, 128, 256, transpose_rhs)
  cot = jax.random.normal(_key(seed + 50), (lhs.shape[0], 256))
  tg, used = plan.tile_group, plan.num_tiles_used

  def loss(fn):
    return lambda left, right: jnp.sum(fn(left, right) * cot)

  def gmm(left, right):
    return grouped_matmul(left, right, tg, used, tile_m=tile_m, impl=impl, interpret=True,
                          transpose_rhs=transpose_rhs)

  def ref(left, right):
    return _dense_reference(left, right, tg, used, tile_m, transpose_rhs)

  got = jax.jit(jax.grad(loss(gmm), argnums=(0, 1)))(lhs, rhs)
  want = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(lhs, rhs)
  for g, w in zip(got, want, strict=True):
    assert g.shape == w.shape
    assert float(jnp.max(jnp.abs(g - w))) <= 1e-4


@functools.partial(jax.jit, static_argnums=(3, 4))
def _pipeline(x_RD, group_ids, rhs, tile_m, impl="xla"):
  """plan -> permute -> grouped_matmul -> unpermute, as the MoE layer runs it."""
  plan = _plan(group_ids, rhs.shape[0], tile_m)
  y = grouped_matmul(permute(x_RD, plan.row_src), rhs, plan.tile_group, plan.num_tiles_used,
                     tile_m=tile_m, impl=impl, interpret=impl == "pallas")
  return permute(y, plan.row_dst)


def _pipeline_row(x_RD, group_ids, rhs, tile_m, row, impl="xla"):
  return np.asarray(_pipeline(x_RD, jnp.asarray(group_ids), rhs, tile_m, impl)[row])


def _placement(group_ids, num_groups, tile_m, row):
  """(tile index, position inside the tile) of a source row."""
  dst = int(_plan(group_ids, num_groups, tile_m).row_dst[row])
  return dst // tile_m, dst % tile_m


@pytest.mark.parametrize("tile_m,k_dim,n_dim,impl", [(16, 64, 128, "xla"), (256, 256, 512, "xla"),
                                                     (8, 64, 128, "pallas")])
def test_grouped_matmul_batch_invariance_bitwise(tile_m, k_dim, n_dim, impl):
  """A row's output is bitwise the same whatever shares its tile, wherever in the tile it sits, and
  however many rows the other groups get (the row's tile index moves)."""
  num_groups, rows, row = 4, 3 * tile_m, 5
  rhs = jax.random.normal(_key(500 + tile_m), (num_groups, k_dim, n_dim))
  x = jax.random.normal(_key(501 + tile_m), (rows, k_dim))
  base_ids = _group_ids(502, rows, num_groups, p_undispatched=0.1)
  base_ids[row] = 1
  base = _pipeline_row(x, base_ids, rhs, tile_m, row, impl)
  assert np.isfinite(base).all() and base.any()

  rng = np.random.default_rng(503)
  placements = {_placement(base_ids, num_groups, tile_m, row)}
  for trial in range(3):
    # Fresh contents for every other row, new group sizes for the other groups, a different number
    # of same-group rows before this one (changes its position inside the tile).
    x2 = jax.random.normal(_key(600 + trial), (rows, k_dim)).at[row].set(x[row])
    ids = rng.choice([-1, 0, 2, 3], size=rows, p=[0.1, 0.25 * trial, 0.4, 0.5 - 0.25 * trial])
    ids[rng.random(rows) < 0.3] = 1
    ids[row] = 1
    ids = ids.astype(np.int32)
    placements.add(_placement(ids, num_groups, tile_m, row))
    out = _pipeline_row(x2, ids, rhs, tile_m, row, impl)
    assert np.array_equal(out.view(np.uint32), base.view(np.uint32)), f"trial {trial}"
  # The trials did move the row: other tile indices and other positions inside the tile.
  assert len({t for t, _ in placements}) > 1 and len({p for _, p in placements}) > 1, placements


# --------------------------------------------------------------------------------------------------
# combine


@pytest.mark.parametrize("name,group_ids", CASES, ids=CASE_IDS)
def test_combine_pallas_equals_xla(name, group_ids):
  top_k = 2
  seed = 700 + CASE_IDS.index(name)
  plan = _plan(group_ids, NUM_GROUPS, 8)
  y = jax.random.normal(_key(seed), (plan.row_src.shape[0], 128))
  row_dst_TK = plan.row_dst.reshape(-1, top_k)
  w = jax.random.uniform(_key(seed + 1), row_dst_TK.shape)
  # A skipped slot contributes nothing, even with a non-finite weight.
  w = jnp.where(row_dst_TK < 0, jnp.nan, w)
  out = _jit_combine(y, row_dst_TK, w)
  ref = combine_numpy(np.asarray(y), np.asarray(row_dst_TK), np.asarray(w))
  np.testing.assert_allclose(out, ref, atol=1e-6, rtol=0)
  assert np.isfinite(np.asarray(out)).all()
  out_p = _jit_combine(y, row_dst_TK, w, impl="pallas", interpret=True)
  assert float(jnp.max(jnp.abs(out_p - out))) <= 1e-6


def test_combine_bf16_topk4():
  y = jax.random.normal(_key(800), (96, 256), jnp.bfloat16)
  dst = jax.random.randint(_key(801), (32, 4), -1, 96)
  w = jax.random.uniform(_key(802), (32, 4), jnp.float32)
  out = _jit_combine(y, dst, w)
  assert out.dtype == jnp.bfloat16
  ref = combine_numpy(np.asarray(y.astype(jnp.float32)), np.asarray(dst), np.asarray(w))
  np.testing.assert_array_equal(out.astype(jnp.float32),
                                jnp.asarray(ref).astype(jnp.bfloat16).astype(jnp.float32))
  out_p = _jit_combine(y, dst, w, impl="pallas", interpret=True)
  np.testing.assert_array_equal(out_p.astype(jnp.float32), out.astype(jnp.float32))


def test_permute_and_combine_pallas_gradients_equal_xla():
  """impl='pallas' trains: its backward pass is the XLA one, so the gradients are the same bits."""
  x = jax.random.normal(_key(810), (24, 128))
  src = jax.random.randint(_key(811), (40,), -1, 24)
  ct = jax.random.normal(_key(812), (40, 128))
  dst = jax.random.randint(_key(813), (12, 3), -1, 40)
  w = jax.random.uniform(_key(814), (12, 3))
  ct2 = jax.random.normal(_key(815), (12, 128))

  def loss(x, w, impl):
    y = permute(x, src, impl=impl, interpret=True)
    return jnp.sum(y * ct) + jnp.sum(combine(y, dst, w, impl=impl, interpret=True) * ct2)

  grads = {impl: jax.jit(jax.grad(functools.partial(loss, impl=impl), argnums=(0, 1)))(x, w)
           for impl in ("xla", "pallas")}
  for gx, gp in zip(grads["xla"], grads["pallas"], strict=True):
    assert float(jnp.max(jnp.abs(gx))) > 0
    np.testing.assert_array_equal(gp, gx)


# --------------------------------------------------------------------------------------------------
# GPU (Pallas Triton) permute and combine, in interpret mode on this CPU machine. The compiled
# kernels differ from these runs only in the multiply (PTX mul.rn there, `*` here) and in how the
# K products are summed (straight adds there, a loop here; the same order): see
# tests/kernels/test_kernels_gpu.py for the compiled ones.

_permute_gpu = jax.jit(functools.partial(permute_lib._permute_gpu, interpret=True))
_combine_gpu = jax.jit(functools.partial(combine_lib._combine_gpu, interpret=True))
_permute_xla = jax.jit(permute_lib.permute_xla)
_combine_xla = jax.jit(combine_lib.combine_xla)


def _assert_same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
  diff = np.abs(a.astype(np.float32) - b.astype(np.float32))
  assert np.isnan(diff).sum() == 0 and diff.max(initial=0) == 0, diff.max(initial=0)
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_gpu_blocks_cover_large_rows_in_several_programs():
  """D = 4096 is split into column blocks, rows per program stay a small power of two, and awkward
  sizes fall back to smaller blocks that still divide the array."""
  assert triton_util.blocks(64, 4096) == (8, 512)
  assert triton_util.blocks(16, 128) == (16, 128)
  assert triton_util.blocks(24, 96) == (8, 32)
  assert triton_util.blocks(5, 3) == (1, 1)
  for rows, d in [(64, 4096), (1000, 14336), (7, 96), (512, 256)]:
    r, c = triton_util.blocks(rows, d)
    assert rows % r == 0 and d % c == 0 and r * c <= triton_util.MAX_BLOCK_ELEMS
    assert r & (r - 1) == 0 and c & (c - 1) == 0


@pytest.mark.parametrize("name,group_ids", CASES, ids=CASE_IDS)
def test_permute_gpu_kernel_equals_xla(name, group_ids):
  """Dispatch (row_src) and unpermute (row_dst) of the padded layout: the same bits as the XLA
  gather, padding rows exactly 0."""
  plan = _plan(group_ids, NUM_GROUPS, 8)
  seed = CASE_IDS.index(name)
  x = jax.random.normal(_key(900 + seed), (len(group_ids), 256), jnp.float32)
  xp = _permute_gpu(x, plan.row_src)
  _assert_same_bits(xp, _permute_xla(x, plan.row_src))
  src = np.asarray(plan.row_src)
  ref = np.where((src >= 0)[:, None], np.asarray(x)[np.maximum(src, 0)], 0)
  np.testing.assert_array_equal(xp, ref)
  _assert_same_bits(_permute_gpu(xp, plan.row_dst), _permute_xla(xp, plan.row_dst))


@pytest.mark.parametrize("num_src,d_dim,num_rows,dtype", [
    (50, 4096, 64, jnp.bfloat16),  # Mixtral's D: 8 column blocks of 512
    (37, 96, 24, jnp.float32),
    (20, 256, 48, jnp.bfloat16),
    (7, 3, 5, jnp.float32),  # odd sizes: 1 x 1 blocks
], ids=["d4096_bf16", "d96_f32", "d256_bf16", "odd_f32"])
def test_permute_gpu_kernel_shapes(num_src, d_dim, num_rows, dtype):
  """Indices below 0 (zero rows) and past the end (clamped, as jnp.take(mode='clip') does)."""
  x = jax.random.normal(_key(num_src + d_dim), (num_src, d_dim), dtype)
  src = jax.random.randint(_key(num_rows), (num_rows,), -3, num_src + 3)
  src = src.at[:3].set(jnp.array([-1, num_src + 1, num_src - 1]))  # each kind at least once
  _assert_same_bits(_permute_gpu(x, src), _permute_xla(x, src))


@pytest.mark.parametrize("name,group_ids", CASES, ids=CASE_IDS)
def test_combine_gpu_kernel_equals_xla(name, group_ids):
  """Top-2 combine over the padded layout, skipped slots carrying nan / inf weights: the same bits
  as combine_xla and the numpy loop (products rounded to fp32, then added in k order)."""
  top_k = 2
  seed = 950 + CASE_IDS.index(name)
  plan = _plan(group_ids, NUM_GROUPS, 8)
  y = jax.random.normal(_key(seed), (plan.row_src.shape[0], 256))
  row_dst_TK = plan.row_dst.reshape(-1, top_k)
  w = jax.random.uniform(_key(seed + 1), row_dst_TK.shape)
  skip = np.asarray(row_dst_TK) < 0
  bad = np.where(np.arange(skip.size).reshape(skip.shape) % 2, np.inf, np.nan)
  w = jnp.where(skip, bad, w)
  out = _combine_gpu(y, row_dst_TK, w)
  assert np.isfinite(np.asarray(out)).all()
  _assert_same_bits(out, _combine_xla(y, row_dst_TK, w))
  np.testing.assert_array_equal(
      out, combine_numpy(np.asarray(y), np.asarray(row_dst_TK), np.asarray(w)))


@pytest.mark.parametrize("num_src,d_dim,num_tokens,top_k,y_dtype,w_dtype", [
    (96, 256, 32, 4, jnp.bfloat16, jnp.float32),
    (64, 4096, 16, 2, jnp.bfloat16, jnp.bfloat16),  # Mixtral's D and top-k
    (40, 128, 24, 6, jnp.float32, jnp.float32),  # K not a power of two
    (13, 3, 5, 3, jnp.float32, jnp.float32),  # odd sizes: 1 x 1 blocks
], ids=["bf16_k4", "d4096_k2", "f32_k6", "odd"])
def test_combine_gpu_kernel_shapes(num_src, d_dim, num_tokens, top_k, y_dtype, w_dtype):
  y = jax.random.normal(_key(num_src + d_dim), (num_src, d_dim), y_dtype)
  dst = jax.random.randint(_key(top_k), (num_tokens, top_k), -1, num_src)
  dst = dst.at[0, 0].set(-1).at[0, 1].set(num_src - 1)  # a skipped and a valid slot at least
  w = jax.random.uniform(_key(num_tokens), (num_tokens, top_k)).astype(w_dtype)
  out = _combine_gpu(y, dst, w)
  assert out.dtype == y_dtype
  _assert_same_bits(out, _combine_xla(y, dst, w))


# --------------------------------------------------------------------------------------------------
# Cross-platform lowering (compiled, non-interpret kernels) from this CPU machine


def _custom_calls(exported):
  text = exported.mlir_module()
  return (set(re.findall(r'custom_call @?"?([\w$.]+)', text))
          | set(re.findall(r'call_target_name = "([^"]+)"', text)))


# The Pallas Triton lowering's custom call: jaxlib <= 0.10.2 hands the Triton IR to XLA
# (`__gpu$xla.gpu.triton`); a jaxlib that compiles it at lowering time emits the compiled kernel
# as `triton_kernel_call_ffi` (`triton_kernel_call` in older ones). Triton IR has no stability
# guarantee, so export needs these targets allowed explicitly.
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi", "triton_kernel_call")


def _gmm_export_fns(dtype, tile_m=128, transpose_rhs=False):
  shape = (4, 512, 256) if transpose_rhs else (4, 256, 512)
  args = (S((512, 256), dtype), S(shape, dtype), S((512 // tile_m,), jnp.int32), S((), jnp.int32))
  kw = dict(tile_m=tile_m, impl="pallas", transpose_rhs=transpose_rhs)

  def fwd(left, right, tg, u):
    return grouped_matmul(left, right, tg, u, **kw)

  def loss(left, right, tg, u):
    return jnp.sum(fwd(left, right, tg, u).astype(jnp.float32))
  grad = jax.grad(loss, argnums=(0, 1))
  return fwd, grad, args


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_kernels_lower_for_tpu(dtype):
  for transpose_rhs in (False, True):
    fwd, grad, args = _gmm_export_fns(dtype, transpose_rhs=transpose_rhs)
    for fn in (fwd, grad):
      exp = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
      assert "tpu_custom_call" in _custom_calls(exp)
  # a K too long for one VMEM weight block: the K-blocked schedule
  long_k = (S((256, 2**15), dtype), S((2, 2**15, 256), dtype), S((2,), jnp.int32), S((), jnp.int32))
  assert not gmm_tpu.tpu_schedule(256, 2**15, 256, 128, jnp.dtype(dtype).itemsize, 4,
                                   False).weights_outer

  def fk(left, right, tg, u):
    return grouped_matmul(left, right, tg, u, tile_m=128, impl="pallas")
  exp = jax.export.export(jax.jit(fk), platforms=["tpu"])(*long_k)
  assert "tpu_custom_call" in _custom_calls(exp)
  def fp(x, s):
    return permute(x, s, impl="pallas")
  exp = jax.export.export(jax.jit(fp), platforms=["tpu"])(S((100, 256), dtype),
                                                         S((512,), jnp.int32))
  assert "tpu_custom_call" in _custom_calls(exp)
  def fc(y, d, w):
    return combine(y, d, w, impl="pallas")
  exp = jax.export.export(jax.jit(fc), platforms=["tpu"])(
      S((512, 256), dtype), S((64, 2), jnp.int32), S((64, 2), jnp.float32)
  )
  assert "tpu_custom_call" in _custom_calls(exp)


@pytest.mark.parametrize("tile_m", [128, 8], ids=["prefill_tile", "decode_tile"])
def test_grouped_matmul_mosaic_gpu_lowers_for_cuda(tile_m):
  """128: the row-major wgmma kernel; 8 (the engine's decode tile): the swapped-product kernel.
  A lowering error fails the test: the kernel must keep lowering for cuda."""
  for transpose_rhs in (False, True):
    fwd, grad, args = _gmm_export_fns(jnp.bfloat16, tile_m=tile_m, transpose_rhs=transpose_rhs)
    for fn in (fwd, grad):
      exp = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
      assert "mosaic_gpu_v2" in _custom_calls(exp)


def _export_triton_for_cuda(fn, *args):
  """Exports fn for cuda. A jaxlib that compiles Triton kernels at lowering time needs the CUDA
  plugin's Triton compiler: without it (a CPU-only install of such a jaxlib) nothing can be
  checked here, and only that one error skips; every other error fails."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in TRITON_CALLS]
  try:
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
  except RuntimeError as e:
    if "does not have a Triton compilation handler" in str(e):
      pytest.skip(f"this jaxlib compiles Triton kernels at lowering time and has no CUDA "
                  f"Triton compiler installed: {e}")
    raise


@pytest.fixture
def verified_triton_modules(monkeypatch):
  """MLIR-verifies each Triton module the Pallas lowering builds (op types, power-of-two tensor
  sizes, pointer / mask shapes agreeing), which jaxlib <= 0.10.2 otherwise leaves to XLA's
  compile on the GPU. Returns the list of verified modules' texts, or None where this jax has no
  such private hook (then only the custom call is checked)."""
  from jax._src.pallas.triton import lowering as triton_lowering

  seen = []
  build = getattr(triton_lowering, "lower_jaxpr_to_triton_module", None)
  if build is None:
    return None

  def build_and_verify(*args, **kwargs):
    result = build(*args, **kwargs)
    with result.module.context:
      assert result.module.operation.verify()
    seen.append(str(result.module))
    return result

  monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", build_and_verify)
  return seen


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_permute_combine_pallas_lower_for_cuda(dtype, verified_triton_modules):
  """impl='pallas' on cuda is the Pallas Triton kernels (not the XLA gather), at Mixtral's D and
  at sizes that need 1-wide blocks; combine multiplies with mul.rn. Lowering errors fail."""
  def fp(x, s):
    return permute(x, s, impl="pallas")
  def fc(y, d, w):
    return combine(y, d, w, impl="pallas")
  cases = [
      (fp, (S((100, 4096), dtype), S((512,), jnp.int32))),
      (fp, (S((7, 3), dtype), S((5,), jnp.int32))),
      (fc, (S((512, 4096), dtype), S((256, 2), jnp.int32), S((256, 2), jnp.float32))),
      (fc, (S((13, 3), dtype), S((5, 6), jnp.int32), S((5, 6), dtype))),
  ]
  for fn, args in cases:
    exp = _export_triton_for_cuda(fn, *args)
    calls = _custom_calls(exp)
    assert calls & set(TRITON_CALLS), calls
    assert "stablehlo.gather" not in exp.mlir_module()  # not the XLA fallback
  texts = verified_triton_modules
  if texts is not None:
    assert len(texts) == len(cases), len(texts)
    assert sum("mul.rn.f32" in t for t in texts) == 2  # the two combines
    assert all("tt.load" in t for t in texts)
