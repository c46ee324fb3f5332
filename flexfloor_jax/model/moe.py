"""Expert-parallel MoE layer, run per worker inside `shard_map` over the expert axis.

route top-k (home worker) -> permute token copies by destination worker -> exchange -> permute
into the padded tile layout by local expert slot -> grouped matmuls over fixed-shape row tiles ->
unpermute -> exchange back -> weighted combine in k order on the home worker.

Two exchanges (`EPConfig.exchange`), bitwise the same result:
- 'all_to_all' (the reference and the CPU default): `lax.all_to_all` of [N, cap, D] buffers with
  capacity cap = tokens*k per destination (exact, nothing dropped), so every worker sends and
  receives N x its routed rows, most of it padding; `capacity_factors` size cap from the chunk's
  routing instead (buckets at multiples of the balanced load tokens*k/N, exact as the last).
- 'ragged': the copies packed by destination into [tokens*k, D], one all_gather of the
  per-destination counts (the [N, N] count matrix gives every worker the offsets of both
  directions), `ragged_all_to_all` of the rows and their slot ids into a static worst-case
  [N*tokens*k, D] receive buffer (rows past the received total carry slot -1), and back into the
  packed layout. Only routed rows cross the interconnect. XLA:CPU has no ragged_all_to_all: there
  it runs the reference of `flexfloor_jax.kernels.ragged_exchange` (a padded all_to_all), on
  TPU/GPU the native op.
The expert side sees the received rows in the same order on both paths (by source worker, then
by token), so the tiles and their GEMMs are identical.

Batch invariance: every expert matmul is a [tile_m, D] x [D, F] GEMM whatever the group sizes, the
combine adds the k copies in k order, and nothing is summed across workers, so a token's output
does not depend on the mesh size, the placement or the other tokens in the batch.

Expert weights are in the slot layout: per layer [N*S, D, F] (w1, w3) and [N*S, F, D] (w2), S slots
per worker; `expert_to_slot_E` maps expert -> global slot id (worker * S + slot).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from flexfloor_jax.kernels.combine import combine
from flexfloor_jax.kernels.dispatch_plan import make_plan, padded_rows
from flexfloor_jax.kernels.grouped_matmul import grouped_matmul
from flexfloor_jax.kernels.permute import permute
from flexfloor_jax.kernels.ragged_exchange import ragged_all_to_all
from flexfloor_jax.model.transformer import (
  EXPERT_BIAS_KEYS,
  MoEChoices,
  Params,
  glu,
  route_layer,
)
from flexfloor_jax.runtime.mesh import mesh_axis

EXCHANGES = ("all_to_all", "ragged")


def resolve_exchange(exchange: str) -> str:
  """'auto' -> 'ragged' where the backend has ragged_all_to_all (TPU, GPU), else 'all_to_all'
  (XLA:CPU, where the ragged path would run the reference, which moves the padded rows anyway)."""
  if exchange == "auto":
    return "all_to_all" if jax.default_backend() == "cpu" else "ragged"
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange must be 'auto' or one of {EXCHANGES}, got {exchange!r}")
  return exchange


def tile_m_for_rows(rows_per_expert: float) -> int:
  """Expert GEMM tile for groups of about `rows_per_expert` rows on XLA:CPU: the largest power of
  two at most the rows below 16 rows, at most half of them from there, 1 to 128. Measured at
  [2048x768] experts, CPU seconds: the grouped matmul over 16 groups of 256 rows with tiles of
  32, 64, 128 and 256 cost 1.47x, 1.32x, 1.27x and 1.41x one dense matmul over the same rows
  (each used group pads about half a tile; tiles of 64-128 rows run near one large GEMM's rate);
  `python -m flexfloor_jax.bench.moe` at 32 rows per expert slot took 2196, 1992, 1868 and 2058 ms
  with tiles of 8, 16, 32 and 64, and at 2 rows 689, 552, 582 and 555 ms with tiles of 8, 4, 2
  and 1: below 8 rows a tile of 8 multiplies mostly padding. Static: a compiled shape's tile
  must not follow its routing, or a row's result would depend on its batch company. The engine
  keeps its own decode and prefill tiles (8 and 32: the smallest the Mosaic GPU kernel takes is
  8, and a tile is the same on every backend)."""
  rows = rows_per_expert if rows_per_expert < 16 else rows_per_expert / 2
  tile = 1
  while tile < 128 and 2 * tile <= rows:
    tile *= 2
  return tile


@dataclasses.dataclass(frozen=True)
class EPConfig:
  """Static description of one expert-parallel group (one compiled shape)."""
  num_workers: int  # N: size of the active group
  slots_per_worker: int  # S: expert slots each worker holds (preallocated for the floor)
  top_k: int
  tile_m: int = 8  # rows per expert GEMM tile (fixed: part of the numerics)
  chunk_tokens: int = 64  # tokens per exchange; longer inputs loop over chunks
  backend: str = "xla"  # 'xla' | 'pallas'
  interpret: bool = False  # Pallas interpret mode (CPU)
  # Exchange capacity buckets as multiples of the balanced load per destination tokens*top_k/N,
  # e.g. (1.25, 2): the exchange uses the smallest bucket that holds the largest count any worker
  # sends to any worker this chunk (one pmax), else the exact capacity tokens*top_k, so nothing is
  # ever dropped. The expert side's buffers are N x the bucket rows, so a bucket near 1 keeps the
  # layer's work near the routed rows. Each bucket is one more branch of the layer to compile.
  # Empty: always the exact capacity. 'all_to_all' exchange only (the ragged one sends no
  # padding).
  capacity_factors: tuple = ()
  exchange: str = "all_to_all"  # 'all_to_all' | 'ragged' (see the module docstring)
  choices: MoEChoices = MoEChoices()  # the model's router/expert block choices (Mixtral's)

  def __post_init__(self):
    if self.exchange not in EXCHANGES:
      raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")

  @property
  def axis(self) -> str:
    axis = mesh_axis("expert")
    assert axis is not None  # expert slots are split over the workers
    return axis


def _dest_positions(dest_R: jax.Array, valid_R: jax.Array, n: int, cap: int) -> jax.Array:
  """Row in the [n * cap] send buffer of each token copy (stable per destination), -1 if invalid."""
  onehot_RN = (jax.nn.one_hot(dest_R, n, dtype=jnp.int32) * valid_R[:, None].astype(jnp.int32))
  rank_R = jnp.sum(jnp.cumsum(onehot_RN, axis=0) * onehot_RN, axis=1) - 1
  return jnp.where(valid_R, dest_R * cap + rank_R, -1)


def _pack(x_TD, slot_R, valid_R, pos_R, rows: int, ep: EPConfig):
  """The send buffer: token copy r's row and local slot at pos_R[r] of `rows` rows (other rows:
  zero, slot -1). Invalid copies scatter out of range: a -1 index would wrap onto the last row,
  which a valid copy holds when the buffer is exactly full."""
  k, s = ep.top_k, ep.slots_per_worker
  drop_R = jnp.where(valid_R, pos_R, rows)
  src_S = jnp.full((rows,), -1, jnp.int32).at[drop_R].set(
      jnp.arange(slot_R.shape[0], dtype=jnp.int32) // k, mode="drop")
  slot_S = jnp.full((rows,), -1, jnp.int32).at[drop_R].set(slot_R % s, mode="drop")
  return permute(x_TD, src_S, impl=ep.backend, interpret=ep.interpret), slot_S


def _expert_mlp(x_PD, w1, w3, w2, plan, ep: EPConfig, biases=()):
  """The grouped gate/up matmuls, the gated activation, the down matmul. `biases` (b1, b3, b2;
  GPT-OSS): one row per expert slot, added to every row of the tiles of that slot (padding rows
  too: nothing reads them back)."""
  # num_groups: the weights may be the stack of every layer's slots, the tiles reference one layer's
  kw: dict[str, Any] = dict(tile_m=ep.tile_m, impl=ep.backend, interpret=ep.interpret,
                            num_groups=ep.slots_per_worker)
  h1 = grouped_matmul(x_PD, w1, plan.tile_group, plan.num_tiles_used, **kw)
  h3 = grouped_matmul(x_PD, w3, plan.tile_group, plan.num_tiles_used, **kw)
  if not biases:
    h = glu(h1, h3, ep.choices)
    return grouped_matmul(h, w2, plan.tile_group, plan.num_tiles_used, **kw)

  def rows(b_GX):  # [groups, X] -> [P, X]: each tile's group's row, tile_m times
    return jnp.repeat(jnp.take(b_GX, plan.tile_group, axis=0, mode="clip"), ep.tile_m, axis=0)

  b1, b3, b2 = biases
  h = glu(h1 + rows(b1), h3 + rows(b3), ep.choices)
  return grouped_matmul(h, w2, plan.tile_group, plan.num_tiles_used, **kw) + rows(b2)


def exchange_capacities(cap: int, num_workers: int, factors) -> list[int]:
  """Rows per destination of each capacity bucket, ascending, the exact `cap` last: factor f of
  the balanced load cap/N, rounded up, at most cap."""
  caps = {min(cap, math.ceil(f * cap / num_workers)) for f in factors if f > 0}
  return sorted({c for c in caps if c > 0} | {cap})


def _ep_moe_chunk(x_TD, lp: Params, valid_T, expert_to_slot_E, ep: EPConfig):
  t, d = x_TD.shape
  n, s, k = ep.num_workers, ep.slots_per_worker, ep.top_k
  logits_TE, weights_TK, experts_TK = route_layer(x_TD, lp, k, ep.choices)

  # Home side: token copies to their destination workers.
  slot_R = expert_to_slot_E[experts_TK].reshape(t * k)
  valid_R = jnp.repeat(valid_T, k)
  caps = exchange_capacities(t * k, n, ep.capacity_factors)
  args = (x_TD, lp, slot_R, valid_R, weights_TK)
  if ep.exchange == "ragged":
    y_TD = _exchange_ragged(ep, *args)
  elif len(caps) == 1:
    y_TD = _exchange(caps[0], ep, *args)
  else:
    # Buffers of every worker must agree in shape: the bucket follows the largest count of any
    # (source, destination) pair. Rows travel and come back exactly and every expert tile is the
    # same GEMM whatever the buffer size, so the bucket changes no bit of the result.
    dest_R = jnp.where(valid_R, slot_R // s, n)
    need = jnp.max(jnp.bincount(dest_R, length=n + 1)[:n])
    need = jax.lax.pmax(need, ep.axis)
    branch = jnp.searchsorted(jnp.asarray(caps, jnp.int32), need.astype(jnp.int32))
    y_TD = jax.lax.switch(branch, [functools.partial(_exchange, c, ep) for c in caps], *args)
  return y_TD, logits_TE, experts_TK


def _exchange(cap, ep: EPConfig, x_TD, lp, slot_R, valid_R, weights_TK):
  """all_to_all with `cap` rows per destination (every valid copy must fit), the expert MLP on
  the received rows, all_to_all back and the weighted combine."""
  t, d = x_TD.shape
  n, s, k = ep.num_workers, ep.slots_per_worker, ep.top_k
  kw: dict[str, Any] = dict(impl=ep.backend, interpret=ep.interpret)
  send_pos_R = _dest_positions(slot_R // s, valid_R, n, cap)
  send_SD, send_slot = _pack(x_TD, slot_R, valid_R, send_pos_R, n * cap, ep)

  recv_ND = jax.lax.all_to_all(send_SD.reshape(n, cap, d), ep.axis, 0, 0, tiled=True)
  recv_slot = jax.lax.all_to_all(send_slot.reshape(n, cap), ep.axis, 0, 0, tiled=True)
  back_RD = _expert_side(recv_ND.reshape(n * cap, d), recv_slot.reshape(n * cap), lp, ep)
  home_ND = jax.lax.all_to_all(back_RD.reshape(n, cap, d), ep.axis, 0, 0, tiled=True)
  return combine(home_ND.reshape(n * cap, d), send_pos_R.reshape(t, k), weights_TK, **kw)


def _exchange_ragged(ep: EPConfig, x_TD, lp, slot_R, valid_R, weights_TK):
  """The copies packed by destination ([T*k] rows, no per-destination padding), one all_gather
  of the per-destination counts, ragged_all_to_all out, the expert MLP, ragged_all_to_all back
  into the packed layout and the weighted combine."""
  t, d = x_TD.shape
  n, s, k = ep.num_workers, ep.slots_per_worker, ep.top_k
  r = t * k
  kw: dict[str, Any] = dict(impl=ep.backend, interpret=ep.interpret)
  dest_R = slot_R // s
  counts_N = jnp.bincount(jnp.where(valid_R, dest_R, n), length=n + 1)[:n].astype(jnp.int32)
  start_N = jnp.cumsum(counts_N) - counts_N
  # Stable by destination: position = start of the destination's run + rank among its copies.
  pos_R = jnp.where(valid_R, start_N[dest_R] + _dest_positions(dest_R, valid_R, n, 0), -1)
  send_RD, send_slot = _pack(x_TD, slot_R, valid_R, pos_R, r, ep)

  # c[i, j]: copies worker i sends to worker j, known to every worker, so each side derives the
  # offsets of both directions without a second exchange. A receiver stores its sources in
  # worker order: rows from i start at sum(c[:i, j]) in j's buffer.
  c_NN = jax.lax.all_gather(counts_N, ep.axis)
  me = jax.lax.axis_index(ep.axis)
  recv_start_NN = jnp.cumsum(c_NN, axis=0) - c_NN
  # Worst case every worker sends all its copies to one worker: n * r rows, nothing dropped.
  rows = n * r
  exchange = functools.partial(ragged_all_to_all, axis_name=ep.axis)
  fwd = (start_N, counts_N, recv_start_NN[me], c_NN[:, me])
  recv_RD = exchange(send_RD, jnp.zeros((rows, d), x_TD.dtype), *fwd)
  # Rows past the received total keep slot -1: make_plan skips them.
  recv_slot = exchange(send_slot, jnp.full((rows,), -1, jnp.int32), *fwd)
  back_RD = _expert_side(recv_RD, recv_slot, lp, ep)
  # Back: the slice received from i returns to where it left i's packed buffer.
  bwd = (recv_start_NN[:, me], c_NN[:, me], (jnp.cumsum(c_NN, axis=1) - c_NN)[:, me], counts_N)
  home_RD = exchange(back_RD, jnp.zeros((r, d), back_RD.dtype), *bwd)
  return combine(home_RD, pos_R.reshape(t, k), weights_TK, **kw)


def _expert_side(recv_RD, recv_slot_R, lp, ep: EPConfig):
  """Received rows (slot -1: not a copy) -> expert MLP outputs in the same row order."""
  (rows, _), s = recv_RD.shape, ep.slots_per_worker
  kw: dict[str, Any] = dict(impl=ep.backend, interpret=ep.interpret)
  # Group received rows by local slot in the padded tile layout.
  plan = make_plan(recv_slot_R, s, ep.tile_m, padded_rows(rows, s, ep.tile_m))
  x_PD = permute(recv_RD, plan.row_src, **kw)
  # Expert slots of all layers as one [L*S, ...] stack (a free reshape): this layer's groups
  # are rows layer*S .. layer*S+S-1, so no layer's weights are copied out per step.
  # (A caller may also pass one layer's [S, ...] weights, without 'layer'.)
  if "layer" in lp:
    def stack(w):
      return w.reshape((-1,) + w.shape[2:])

    plan = plan.replace(tile_group=plan.tile_group + lp["layer"] * s)
  else:
    def stack(w):
      return w

  biases = tuple(stack(lp[k]) for k in EXPERT_BIAS_KEYS if k in lp)
  y_PD = _expert_mlp(x_PD, stack(lp["w1"]), stack(lp["w3"]), stack(lp["w2"]), plan, ep, biases)
  return permute(y_PD, plan.row_dst, **kw)


def ep_moe(x_TD: jax.Array, lp: Params, valid_T: jax.Array, expert_to_slot_E: jax.Array,
           ep: EPConfig, num_experts: int):
  """MoE on this worker's tokens [T, D]. Long inputs are exchanged in chunks of
  ep.chunk_tokens so the all_to_all buffers stay bounded. Returns (y_TD, aux)."""
  t, d = x_TD.shape
  c = min(ep.chunk_tokens, t)
  if t == c:
    y_TD, logits_TE, experts_TK = _ep_moe_chunk(x_TD, lp, valid_T, expert_to_slot_E, ep)
  else:
    pad = -t % c  # padding tokens are not dispatched
    xp = jnp.pad(x_TD, ((0, pad), (0, 0)))
    vp = jnp.pad(valid_T, (0, pad))
    nc = (t + pad) // c
    # routing replay: the recorded experts are chunked with their tokens
    rp = {} if "route" not in lp else {"route": jnp.pad(lp["route"], ((0, pad), (0, 0))).reshape(
        nc, c, -1)}

    def body(_, xs):
      return None, _ep_moe_chunk(xs[0], {**lp, **xs[2]}, xs[1], expert_to_slot_E, ep)

    _, (y, lg, ex) = jax.lax.scan(body, None, (xp.reshape(nc, c, d), vp.reshape(nc, c), rp))
    y_TD, logits_TE, experts_TK = (y.reshape(-1, d)[:t], lg.reshape(nc * c, -1)[:t],
                                   ex.reshape(nc * c, -1)[:t])
  counts_E = jnp.sum(jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.int32)
                     * valid_T[:, None, None].astype(jnp.int32), axis=(0, 1))
  counts_E = jax.lax.psum(counts_E, ep.axis)
  aux = {"router_logits": logits_TE, "experts": experts_TK, "expert_counts": counts_E}
  return y_TD, aux
