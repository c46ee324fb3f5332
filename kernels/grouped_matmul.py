"""Grouped (per-expert) matmul over the padded tile layout of `kernels.dispatch_plan`.

Tile i (rows [i*tile_m, (i+1)*tile_m)) is multiplied by rhs[tile_group[i]] for i < num_tiles_used;
later tiles are zero and cost no matmul. Every tile is the same [tile_m, K] x [K, N] GEMM with fp32
accumulation, so a row's result is bitwise independent of the other rows of its tile and of the
group sizes (batch invariance; see DESIGN.md "Determinism").

Decode shapes (8-row tiles, a few tiles per expert) are weight-bound: each expert's weights are read
once per call where the backend allows, not once per tile. impl='xla' (the CPU default, and the path
used for training) runs, when the tiles are spread over the groups, group-batched rounds (the r-th
tile of every group in one batched dot that reads the weights in place), else loops over runs of
same-group tiles with one weight slice per run; dynamic trip counts, a `jax.custom_vjp`. impl='pallas' picks, at lowering time, a Mosaic TPU kernel
(megablox-style, tile metadata through scalar prefetch; weight blocks outermost where a [K, tn] block
fits VMEM), a Mosaic GPU kernel (Hopper wgmma; tile metadata read from GMEM inside the kernel
because Mosaic GPU has no scalar prefetch; tiles under 64 rows as the swapped product W^T x^T, one
CTA per tile and N block, so a repeated expert's weights come from L2 rather than once per call;
`_mgpu_supported` says which shapes and dtypes, the others take the XLA loop on GPU), the XLA loop
on ROCm, or on any other platform the TPU kernel in interpret mode (`interpret=True` forces that
everywhere). The Pallas forward shares the custom_vjp: d_lhs runs the same Pallas kernel on
transposed weights, d_rhs the XLA "tgmm" loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

# 256 keeps the per-tile GEMM efficient on XLA:CPU (128-row tiles run ~1.5x slower per flop there)
# while bounding padding waste to < 256 rows per group; see `python -m kernels.bench`.
DEFAULT_TILE_M = 256


def grouped_matmul(
    lhs_PK: jax.Array,
    rhs_GKN: jax.Array,
    tile_group: jax.Array,
    num_tiles_used: jax.Array,
    *,
    tile_m: int = DEFAULT_TILE_M,
    impl: str = "xla",
    interpret: bool = False,
    preferred_element_type=None,
    transpose_rhs: bool = False,
    num_groups: int | None = None,
) -> jax.Array:
  """out_PN[tile i] = lhs tile i @ rhs_GKN[tile_group[i]] for i < num_tiles_used, else 0.

  `transpose_rhs=True` takes rhs as [G, N, K] and contracts its last dim (used by the backward pass,
  saves materialising a transposed copy of the weights). Output dtype: `preferred_element_type` or
  lhs's; accumulation is always fp32. Differentiable w.r.t. lhs and rhs for both impls.
  """
  num_rows, k_dim = lhs_PK.shape
  k_rhs = rhs_GKN.shape[2] if transpose_rhs else rhs_GKN.shape[1]
  if rhs_GKN.ndim != 3 or k_rhs != k_dim:
    raise ValueError(f"shape mismatch: lhs {lhs_PK.shape}, rhs {rhs_GKN.shape}, {transpose_rhs=}")
  if num_rows % tile_m or tile_group.shape != (num_rows // tile_m,):
    raise ValueError(
        f"rows {num_rows} must be tiles of tile_m={tile_m} matching tile_group {tile_group.shape}"
    )
  if impl not in ("xla", "pallas"):
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
  out_dtype = jnp.dtype(preferred_element_type or lhs_PK.dtype)
  return _gmm(
      lhs_PK,
      rhs_GKN,
      tile_group.astype(jnp.int32),
      jnp.asarray(num_tiles_used, jnp.int32).reshape(()),
      tile_m,
      impl,
      bool(interpret),
      out_dtype,
      bool(transpose_rhs),
      int(num_groups or rhs_GKN.shape[0]),
  )


# --------------------------------------------------------------------------------------------------
# custom_vjp shared by both impls


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _gmm(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs, groups):
  return _gmm_forward(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs,
                      groups)


def _gmm_fwd(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs, groups):
  out = _gmm_forward(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs,
                     groups)
  return out, (lhs, rhs, tile_group, used)


def _gmm_bwd(tile_m, impl, interpret, out_dtype, transpose_rhs, groups, res, d_out):
  del out_dtype
  lhs, rhs, tile_group, used = res
  # Cotangents enter in the operand precision (as megablox does); accumulation stays fp32.
  d_out = d_out.astype(lhs.dtype)
  # Same tiles, weights transposed: d_lhs tile = d_out tile @ rhs[g]^T.
  d_lhs = _gmm_forward(
      d_out, rhs.astype(lhs.dtype), tile_group, used, tile_m, impl, interpret, lhs.dtype,
      not transpose_rhs, groups,
  )
  d_rhs_GKN = _tgmm_xla(lhs, d_out, tile_group, used, rhs.shape[0], tile_m)
  d_rhs = jnp.swapaxes(d_rhs_GKN, 1, 2) if transpose_rhs else d_rhs_GKN
  return d_lhs, d_rhs.astype(rhs.dtype), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _gmm_forward(lhs, rhs, tile_group, used, tile_m, impl, interpret, out_dtype, transpose_rhs,
                 groups):
  if impl == "xla":
    if rhs.shape[0] != groups:  # a stack of several layers' groups: slice one expert per run
      return _gmm_xla(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs)
    return _gmm_xla_auto(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs)
  return _gmm_pallas(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs, interpret,
                     groups)


# --------------------------------------------------------------------------------------------------
# XLA reference (CPU fast path)


def _dot_dims(transpose_rhs: bool):
  return (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))


def _gmm_xla(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs):
  """Expert-outer loop: each run of tiles of one group takes its weights once, then one fixed-shape
  [tile_m, K] dot per tile of the run, written in place into a zero buffer.

  A run is a maximal range of consecutive tiles of one group; the padded layout sorts tiles by
  group, so the outer trip count is the number of non-empty groups and an expert's weights are sliced
  once per call however many tiles it has (a per-tile slice re-reads them once per tile). Any
  tile_group is correct, unsorted ones only take more runs. Each tile is still its own GEMM
  of one shape, so the numerics (and batch invariance) are those of the per-tile loop. Trip counts
  are dynamic, so padding tiles cost nothing; the zero buffer is a calloc on CPU.
  """
  num_rows = lhs.shape[0]
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  num_tiles = tile_group.shape[0]
  used = jnp.minimum(used, num_tiles)
  # run_end[i]: first tile after i whose group differs from tile i's (num_tiles if none).
  idx = jnp.arange(num_tiles, dtype=jnp.int32)
  boundary = jnp.where(tile_group[1:] != tile_group[:-1], idx[1:], num_tiles)
  run_end = lax.cummin(jnp.append(boundary, num_tiles), reverse=True)

  def run(carry):
    start, out = carry
    g = tile_group[start]
    end = jnp.minimum(run_end[start], used)
    w = lax.dynamic_index_in_dim(rhs, g, 0, keepdims=False)

    def tile(i, out):
      x = lax.dynamic_slice_in_dim(lhs, i * tile_m, tile_m, 0)
      y = lax.dot_general(x, w, _dot_dims(transpose_rhs), preferred_element_type=jnp.float32)
      return lax.dynamic_update_slice_in_dim(out, y.astype(out_dtype), i * tile_m, 0)

    return end, lax.fori_loop(start, end, tile, out)

  init = (jnp.int32(0), jnp.zeros((num_rows, n_dim), out_dtype))
  return lax.while_loop(lambda c: c[0] < used, run, init)[1]


def _gmm_xla_rounds(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs):
  """Group-batched rounds: round r multiplies the r-th tile of every group by its weights in one
  batched dot over all of rhs, so the weights are read in place (the run loop's per-expert slice is
  a copy on XLA:CPU) and the trip count is the largest number of tiles of any group. Each batch
  element is the same [tile_m, K] x [K, N] GEMM as a tile of the run loop (tests check bitwise)."""
  num_rows, k_dim = lhs.shape
  groups = rhs.shape[0]
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  num_tiles = tile_group.shape[0]
  used = jnp.minimum(used, num_tiles)
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  group_T = jnp.where(tile < used, tile_group, groups)  # unused tiles: a group past the last
  count_G = jnp.bincount(group_T, length=groups + 1)[:groups]
  order_T = jnp.argsort(group_T, stable=True).astype(jnp.int32)  # tiles of each group in order
  start_G = jnp.cumsum(count_G) - count_G
  lhs_TMK = lhs.reshape(num_tiles, tile_m, k_dim)
  dims = (((2,), (2 if transpose_rhs else 1,)), ((0,), (0,)))

  def round_(r, out_TMN):
    has_G = r < count_G
    tile_G = jnp.where(has_G, order_T[jnp.minimum(start_G + r, num_tiles - 1)], num_tiles)
    x_GMK = jnp.take(lhs_TMK, jnp.minimum(tile_G, num_tiles - 1), axis=0)
    y_GMN = lax.dot_general(x_GMK, rhs, dims, preferred_element_type=jnp.float32)
    return out_TMN.at[tile_G].set(y_GMN.astype(out_dtype), mode="drop")

  out = lax.fori_loop(0, jnp.max(count_G), round_,
                      jnp.zeros((num_tiles, tile_m, n_dim), out_dtype))
  return out.reshape(num_rows, n_dim)


def _gmm_xla_auto(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs):
  """Rounds where they waste little (each round multiplies every group, used or not: decode
  shapes, where the weight reads dominate), the run loop otherwise (skewed or prefill shapes).
  Both compute every tile with the same GEMM, so the choice changes no bit of the result."""
  groups, num_tiles = rhs.shape[0], tile_group.shape[0]
  used = jnp.minimum(used, num_tiles)
  group_T = jnp.where(jnp.arange(num_tiles) < used, tile_group, groups)
  rounds = jnp.max(jnp.bincount(group_T, length=groups + 1)[:groups])
  args = (lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs)
  return lax.cond(rounds * groups <= 2 * used,
                  lambda a: _gmm_xla_rounds(*a[:4], *args[4:]),
                  lambda a: _gmm_xla(*a[:4], *args[4:]), args[:4])


def _tgmm_xla(lhs, d_out, tile_group, used, num_groups, tile_m):
  """d_rhs[g] = sum over used tiles of group g, in tile order, of lhs_tile^T @ d_out_tile (fp32)."""
  k_dim, n_dim = lhs.shape[1], d_out.shape[1]

  def body(i, acc):
    x = lax.dynamic_slice_in_dim(lhs, i * tile_m, tile_m, 0)
    dy = lax.dynamic_slice_in_dim(d_out, i * tile_m, tile_m, 0)
    upd = lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    g = tile_group[i]
    cur = lax.dynamic_index_in_dim(acc, g, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(acc, cur + upd, g, 0)

  return lax.fori_loop(0, used, body, jnp.zeros((num_groups, k_dim, n_dim), jnp.float32))


# --------------------------------------------------------------------------------------------------
# Pallas: one kernel body per backend, chosen at lowering time


def _pick_block(dim: int, prefs=(512, 256, 128)) -> int:
  for b in prefs:
    if dim % b == 0:
      return b
  return dim  # a full-extent block is always legal on TPU


def _gmm_pallas(lhs, rhs, tile_group, used, tile_m, out_dtype, transpose_rhs, interpret, groups):
  kw = dict(tile_m=tile_m, out_dtype=out_dtype, transpose_rhs=transpose_rhs, num_groups=groups)
  tpu = functools.partial(_gmm_tpu, **kw, interpret=False)
  interp = functools.partial(_gmm_tpu, **kw, interpret=True)
  args = (lhs, rhs, tile_group, used)
  if interpret:
    return interp(*args)
  xla = functools.partial(_gmm_xla, tile_m=tile_m, out_dtype=out_dtype, transpose_rhs=transpose_rhs)
  if _mgpu_supported(lhs, rhs, tile_m, out_dtype, transpose_rhs):
    cuda = functools.partial(
        _gmm_mgpu_swapped if tile_m < 64 else _gmm_mgpu,
        tile_m=tile_m, out_dtype=out_dtype, transpose_rhs=transpose_rhs,
    )
  else:  # shapes/dtypes the wgmma kernel does not take (e.g. fp32): XLA on GPU.
    cuda = xla
  # ROCm: no compiled Pallas kernel here, so the XLA loop rather than the interpreter.
  return lax.platform_dependent(*args, tpu=tpu, cuda=cuda, rocm=xla, default=interp)


# VMEM the weights-outer schedule may use for its double-buffered blocks: inside every TPU
# generation's default scoped VMEM limit (16 MiB on v5e), with room for Mosaic's own scratch.
_TPU_VMEM_BUDGET = 12 * 2**20


@dataclasses.dataclass(frozen=True)
class _TpuSchedule:
  """Grid and blocks of the Mosaic TPU kernel; the index maps take (grid indices..., tg, used) and
  also run on numpy values, so a test can replay which weight blocks the pipeline fetches.

  weights_outer: grid (N blocks, row tiles) and one dot over the whole K per tile. Consecutive tiles
    of one group ask for the same weight block, which the Pallas pipeline does not fetch again, so
    every used expert's weights are read once per call (the decode case: few rows, many weights).
  otherwise: grid (row tiles, N blocks, K blocks), K accumulated in VMEM, weights read once per
    tile; taken when a [K, tn] weight block does not fit the VMEM budget (then a tile is large
    enough to amortise it, or K is too long for one block).
  """
  weights_outer: bool
  grid: tuple
  tn: int
  tk: int
  lhs_block: tuple
  rhs_block: tuple
  out_block: tuple
  lhs_map: object
  rhs_map: object
  out_map: object


def _tpu_schedule(num_rows, k_dim, n_dim, tile_m, in_itemsize, out_itemsize, transpose_rhs):
  num_tiles = num_rows // tile_m
  rhs_kn = lambda g, k, n: (g, n, k) if transpose_rhs else (g, k, n)

  def clamp(i, used):  # steps past the used tiles repeat the last used tile's blocks: no DMA
    return jnp.where(i < used[0], i, jnp.maximum(used[0] - 1, 0))

  for tn in (512, 256, 128):
    if n_dim % tn:
      continue
    vmem = 2 * (k_dim * tn + tile_m * k_dim) * in_itemsize + 2 * tile_m * tn * out_itemsize
    if vmem <= _TPU_VMEM_BUDGET:
      return _TpuSchedule(
          weights_outer=True, grid=(n_dim // tn, num_tiles), tn=tn, tk=k_dim,
          lhs_block=(tile_m, k_dim), rhs_block=(None,) + rhs_kn(None, k_dim, tn)[1:],
          out_block=(tile_m, tn),
          lhs_map=lambda n, i, tg, used: (clamp(i, used), 0),
          rhs_map=lambda n, i, tg, used: rhs_kn(tg[clamp(i, used)], 0, n),
          out_map=lambda n, i, tg, used: (i, n),
      )

  tn, tk = _pick_block(n_dim), _pick_block(k_dim)
  n_blocks, k_blocks = n_dim // tn, k_dim // tk

  def effective(i, n, k, used):
    active = i < used[0]
    return (clamp(i, used), jnp.where(active, n, n_blocks - 1), jnp.where(active, k, k_blocks - 1))

  def lhs_map(i, n, k, tg, used):
    i, _, k = effective(i, n, k, used)
    return i, k

  def rhs_map(i, n, k, tg, used):
    i, n, k = effective(i, n, k, used)
    return rhs_kn(tg[i], k, n)

  return _TpuSchedule(
      weights_outer=False, grid=(num_tiles, n_blocks, k_blocks), tn=tn, tk=tk,
      lhs_block=(tile_m, tk), rhs_block=(None,) + rhs_kn(None, tk, tn)[1:], out_block=(tile_m, tn),
      lhs_map=lhs_map, rhs_map=rhs_map, out_map=lambda i, n, k, tg, used: (i, n),
  )


def _gmm_tpu(lhs, rhs, tile_group, used, *, tile_m, out_dtype, transpose_rhs, num_groups,
             interpret):
  """Mosaic TPU kernel, megablox-style: tile_group and num_tiles_used arrive through scalar
  prefetch and the rhs index_map picks the tile's group (schedules: `_TpuSchedule`). Steps past
  num_tiles_used fetch nothing new and skip the matmul: they only store a zero output block.
  """
  num_rows, k_dim = lhs.shape
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  num_tiles = num_rows // tile_m
  sch = _tpu_schedule(num_rows, k_dim, n_dim, tile_m, lhs.dtype.itemsize, out_dtype.itemsize,
                      transpose_rhs)
  dims = _dot_dims(transpose_rhs)

  if sch.weights_outer:
    def kernel(tg_ref, used_ref, lhs_ref, rhs_ref, out_ref):
      active = pl.program_id(1) < used_ref[0]

      @pl.when(active)
      def _():
        out_ref[...] = lax.dot_general(
            lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32
        ).astype(out_ref.dtype)

      @pl.when(jnp.logical_not(active))
      def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    scratch, semantics = [], ("parallel", "arbitrary")
    # Each used group's weights once; the lhs once per N block.
    weight_reads = min(num_tiles, num_groups)
  else:
    k_blocks = sch.grid[2]

    def kernel(tg_ref, used_ref, lhs_ref, rhs_ref, out_ref, acc_ref):
      i, k = pl.program_id(0), pl.program_id(2)

      @pl.when(k == 0)
      def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

      @pl.when(i < used_ref[0])
      def _():
        acc_ref[...] += lax.dot_general(
            lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32
        )

      @pl.when(k == k_blocks - 1)
      def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    scratch = [pltpu.VMEM((tile_m, sch.tn), jnp.float32)]
    semantics = ("parallel", "parallel", "arbitrary")
    weight_reads = num_tiles  # the weight block of every tile, also when its group repeats

  cost = pl.CostEstimate(
      flops=2 * num_rows * k_dim * n_dim,
      transcendentals=0,
      bytes_accessed=int(
          lhs.size * lhs.dtype.itemsize * (n_dim // sch.tn)
          + weight_reads * k_dim * n_dim * rhs.dtype.itemsize
          + num_rows * n_dim * out_dtype.itemsize
      ),
  )
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=sch.grid,
          in_specs=[pl.BlockSpec(sch.lhs_block, sch.lhs_map),
                    pl.BlockSpec(sch.rhs_block, sch.rhs_map)],
          out_specs=pl.BlockSpec(sch.out_block, sch.out_map),
          scratch_shapes=scratch,
      ),
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      cost_estimate=cost,
      interpret=interpret,
  )(tile_group, used.reshape((1,)), lhs, rhs)


# Mosaic GPU (Hopper wgmma). Block sizes: 128 rows keep a 128x128 fp32 accumulator in one warpgroup's
# registers; 64 K-columns of a 2-byte dtype are one 128-byte swizzle row.
_MGPU_BLOCK_M = 128
_MGPU_BLOCK_N = 128
_MGPU_BLOCK_K = 64
_MGPU_STAGES = 3


# Decode tiles (tile_m < 64, a multiple of 8) go through the swapped product out^T = W^T x^T:
# wgmma's M (64 per warpgroup) then runs over the weights' N and its N (a multiple of 8) over the
# tile's rows, so an 8-row tile is one wgmma shape instead of a 64-row block 7/8 padding.
_MGPU_SWAP_BLOCK_N = 64


def _mgpu_supported(lhs, rhs, tile_m, out_dtype, transpose_rhs) -> bool:
  del out_dtype
  k_dim = lhs.shape[1]
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if not (lhs.dtype == rhs.dtype and lhs.dtype in (jnp.bfloat16, jnp.float16)
          and k_dim % _MGPU_BLOCK_K == 0):
    return False
  if tile_m < 64:
    return tile_m % 8 == 0 and n_dim % _MGPU_SWAP_BLOCK_N == 0
  block_m = min(tile_m, _MGPU_BLOCK_M)
  return block_m % 64 == 0 and tile_m % block_m == 0 and n_dim % _MGPU_BLOCK_N == 0


def _gmm_mgpu_swapped(lhs, rhs, tile_group, used, *, tile_m, out_dtype, transpose_rhs):
  """Mosaic GPU kernel for decode tiles: one CTA per (tile, 64-column N block) computes
  out^T[n block, tile rows] = W[g]^T[n block] @ x_tile^T with a [64, tile_m] fp32 accumulator; the
  result comes back transposed ([N, rows]) and is transposed once in XLA (rows are few at decode).
  A row's value is one fixed wgmma shape per tile, as in the row-major kernel.
  """
  num_rows, k_dim = lhs.shape
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bn, bk = _MGPU_SWAP_BLOCK_N, _MGPU_BLOCK_K

  def body(tg_gmem, used_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ti, ni = lax.axis_index("m"), lax.axis_index("n")
    out_block = out_gmem.at[pl.ds(ni * bn, bn), pl.ds(ti * tile_m, tile_m)]

    def store(value):
      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bn, tile_m), out_gmem.dtype))
      def _(o_smem):
        o_smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_block)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    is_used = ti < used_gmem[0]

    @pl.when(is_used)
    def _():
      group = tg_gmem[ti]

      def step(_, lhs_smem, rhs_smem, acc_ref):
        # A = W^T block [bn, bk]; B = x_tile^T [bk, tile_m] (K-major, as wgmma takes B)
        a = rhs_smem if transpose_rhs else plgpu.transpose_ref(rhs_smem, (1, 0))
        plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(lhs_smem, (1, 0)))

      def acc_scope(acc_ref):
        rhs_spec = (
            plgpu.BlockSpec((bn, bk), lambda k: (ni, k))
            if transpose_rhs
            else plgpu.BlockSpec((bk, bn), lambda k: (k, ni))
        )
        plgpu.emit_pipeline(
            lambda idx, l, r: step(idx, l, r, acc_ref),
            grid=(k_dim // bk,),
            in_specs=[plgpu.BlockSpec((tile_m, bk), lambda k: (ti, k)), rhs_spec],
            max_concurrent_steps=min(_MGPU_STAGES, k_dim // bk),
        )(lhs_gmem, rhs_gmem.at[group])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bn, tile_m), jnp.float32))
      store(acc.astype(out_gmem.dtype))

    @pl.when(jnp.logical_not(is_used))
    def _():
      store(jnp.zeros((bn, tile_m), out_gmem.dtype))

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((n_dim, num_rows), out_dtype),
      grid=(num_rows // tile_m, n_dim // bn),
      grid_names=("m", "n"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
  )
  return kernel(tile_group, used.reshape((1,)), lhs, rhs).T


def _gmm_mgpu(lhs, rhs, tile_group, used, *, tile_m, out_dtype, transpose_rhs):
  """Mosaic GPU kernel: one CTA per (row block, N block); a row block is a slice of one tile.

  No scalar prefetch on Mosaic GPU, so tile_group / num_tiles_used are GMEM refs read inside the
  kernel; the K loop is an `emit_pipeline` of TMA copies feeding wgmma. Unused tiles store zeros.
  """
  num_rows, k_dim = lhs.shape
  n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_m = min(tile_m, _MGPU_BLOCK_M)
  blocks_per_tile = tile_m // block_m
  bn, bk = _MGPU_BLOCK_N, _MGPU_BLOCK_K

  def body(tg_gmem, used_gmem, lhs_gmem, rhs_gmem, out_gmem):
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    tile = lax.div(mi, jnp.int32(blocks_per_tile))
    out_block = out_gmem.at[pl.ds(mi * block_m, block_m), pl.ds(ni * bn, bn)]

    def store(value):
      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, bn), out_gmem.dtype))
      def _(o_smem):
        o_smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_block)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    is_used = tile < used_gmem[0]

    @pl.when(is_used)
    def _():
      group = tg_gmem[tile]

      def step(_, lhs_smem, rhs_smem, acc_ref):
        rhs_op = plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem
        plgpu.wgmma(acc_ref, lhs_smem, rhs_op)

      def acc_scope(acc_ref):
        rhs_spec = (
            plgpu.BlockSpec((bn, bk), lambda k: (ni, k))
            if transpose_rhs
            else plgpu.BlockSpec((bk, bn), lambda k: (k, ni))
        )
        plgpu.emit_pipeline(
            lambda idx, l, r: step(idx, l, r, acc_ref),
            grid=(k_dim // bk,),
            in_specs=[plgpu.BlockSpec((block_m, bk), lambda k: (mi, k)), rhs_spec],
            max_concurrent_steps=min(_MGPU_STAGES, k_dim // bk),
        )(lhs_gmem, rhs_gmem.at[group])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, bn), jnp.float32))
      store(acc.astype(out_gmem.dtype))

    @pl.when(jnp.logical_not(is_used))
    def _():
      store(jnp.zeros((block_m, bn), out_gmem.dtype))

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
      grid=(num_rows // block_m, n_dim // bn),
      grid_names=("m", "n"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
  )
  return kernel(tile_group, used.reshape((1,)), lhs, rhs)
