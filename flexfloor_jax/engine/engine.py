"""Rollout engine: per-worker decode slots over the `ep` mesh; prefill / insert / decode.

Every worker owns B decode slots with a fixed-length KV cache. One compiled prefill step fills at
most one slot per worker; one compiled decode dispatch runs up to `max_steps` decode steps on all
active workers inside a `lax.while_loop`, stopping early when the caller asked to hear about a
finish. The engine knows how to change its mesh (see elastic.py), never why.

Per-slot device state (leading axis N*B, sharded over workers):
  tokens (input token of the next step), positions (where that token's KV goes), live, n_gen,
  limit (tokens to generate), stop_eos, key (uint32[2] sequence key), out_tokens, out_logprobs.
The scalars and the key travel as one int32 array `slots` (SLOT_COLS): a release reassembles
three arrays of state instead of nine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import sys
import threading
import time
import types
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flexfloor_jax import distributed
from flexfloor_jax import elastic
from flexfloor_jax import mesh as mesh_lib
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig, resolve_moe_backend
from flexfloor_jax.model.moe import EPConfig, ep_moe, resolve_exchange
from flexfloor_jax.policy.planner import ExpertPlacement
from flexfloor_jax.sampling import SamplingParams, sample, sample_one, sequence_key


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """Everything that fixes compiled shapes (identical for every schedule: fairness)."""
  cfg: ModelConfig
  slots_per_worker: int  # B
  expert_slots: int  # S: expert slots per worker, preallocated for the floor
  max_seq_len: int  # KV cache length per slot (prompt + response)
  max_prompt_len: int  # prefill width
  max_new_tokens: int
  sampling: SamplingParams
  decode_tile_m: int = 8
  prefill_tile_m: int = 32
  chunk_tokens: int = 64
  moe_backend: str = "auto"  # 'auto' | 'xla' | 'pallas' (model.config.resolve_moe_backend)
  interpret: bool = False  # force Pallas interpret mode (the resolution picks it on CPU anyway)
  warm_up: bool = True  # run each executable once at compile time (placeholder inputs)
  record_routes: bool = False  # keep every token's top-k experts per layer (RL routing replay)
  # EP token exchange: 'auto' ('ragged' on TPU/GPU, 'all_to_all' on CPU) | 'all_to_all' | 'ragged'
  exchange: str = "auto"

  def ep(self, n: int, tile_m: int) -> EPConfig:
    impl, interpret = resolve_moe_backend(self.moe_backend, jax.default_backend())
    return EPConfig(num_workers=n, slots_per_worker=self.expert_slots, top_k=self.cfg.top_k,
                    tile_m=tile_m, chunk_tokens=self.chunk_tokens, backend=impl,
                    interpret=interpret or self.interpret,
                    exchange=resolve_exchange(self.exchange))


# ----------------------------------------------------------------------------- shardings


def split_params(params: tfm.Params) -> tuple[tfm.Params, dict]:
  """(non-expert params, expert weights {w1, w3, w2} in canonical [L, E, ...] layout)."""
  layers = dict(params["layers"])
  experts = {k: layers.pop(k) for k in tfm.EXPERT_KEYS}
  rest = dict(params)
  rest["layers"] = layers
  return rest, experts


def merge_params(rest: tfm.Params, experts: dict) -> tfm.Params:
  out = dict(rest)
  out["layers"] = {**rest["layers"], **experts}
  return out


def expert_spec() -> PartitionSpec:
  """PartitionSpec of one expert stack ([L, E, ...] canonical or [L, N*S, ...] slots)."""
  return mesh_lib.param_spec(*tfm.PARAM_AXES["w1"])


def cache_spec() -> PartitionSpec:
  return mesh_lib.logical_spec("layer", "batch", None, None, None)


SLOT_COLS = ("tokens", "positions", "live", "n_gen", "limit", "stop_eos", "key0", "key1")
COL = {name: i for i, name in enumerate(SLOT_COLS)}


def state_shapes(spec: EngineSpec, n: int) -> dict[str, jax.ShapeDtypeStruct]:
  nb = n * spec.slots_per_worker
  return {
      "slots": jax.ShapeDtypeStruct((nb, len(SLOT_COLS)), jnp.int32),
      "out_tokens": jax.ShapeDtypeStruct((nb, spec.max_new_tokens), jnp.int32),
      "out_logprobs": jax.ShapeDtypeStruct((nb, spec.max_new_tokens), jnp.float32),
      # [slot, position, layer, k]: the experts each fed token used (routing replay)
      **({"routes": jax.ShapeDtypeStruct(
          (nb, spec.max_seq_len, spec.cfg.num_layers, spec.cfg.top_k), jnp.int32)}
         if spec.record_routes else {}),
  }


def state_bytes_per_worker(cfg: ModelConfig, slots_per_worker: int, max_seq_len: int,
                           max_new_tokens: int, record_routes: bool = False) -> int:
  """Bytes of one worker's slot state (`state_shapes` for one worker), without an EngineSpec."""
  spec = types.SimpleNamespace(cfg=cfg, slots_per_worker=slots_per_worker, max_seq_len=max_seq_len,
                               max_new_tokens=max_new_tokens, record_routes=record_routes)
  return sum(math.prod(v.shape) * v.dtype.itemsize for v in state_shapes(spec, 1).values())


def _unpack(st: dict) -> dict:
  """Device state -> one array per field (inside a step)."""
  a = st["slots"]
  out = {k: a[:, COL[k]] for k in ("tokens", "positions", "n_gen", "limit")}
  out.update(live=a[:, COL["live"]] != 0, stop_eos=a[:, COL["stop_eos"]] != 0,
             key=jax.lax.bitcast_convert_type(a[:, COL["key0"]:COL["key1"] + 1], jnp.uint32),
             out_tokens=st["out_tokens"], out_logprobs=st["out_logprobs"])
  if "routes" in st:
    out["routes"] = st["routes"]
  return out


def _pack(st: dict) -> dict:
  key = jax.lax.bitcast_convert_type(st["key"], jnp.int32)
  cols = [key[:, i - COL["key0"]] if k.startswith("key") else st[k].astype(jnp.int32)
          for i, k in enumerate(SLOT_COLS)]
  out = {"slots": jnp.stack(cols, 1), "out_tokens": st["out_tokens"],
         "out_logprobs": st["out_logprobs"]}
  if "routes" in st:
    out["routes"] = st["routes"]
  return out


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ----------------------------------------------------------------------------- per-worker steps


# Host inputs of a step travel as one int32 array sharded over the workers, one row per worker:
# one transfer per step instead of one per input (each costs a transfer to every device). The
# last num_experts columns of every row hold the expert -> global slot table, so a release
# moves no separate table either.
# Prefill rows: the prompt's max_prompt_len token columns, then PREFILL_COLS.
PREFILL_COLS = ("length", "slot", "limit", "eos", "phash", "sample", "seed", "epoch")
DECODE_COLS = ("max_steps", "stop_on_refill", "stop_on_idle")


def _prefill_local(spec: EngineSpec, n: int, rest, experts, cache_k, cache_v, st, host_PC):
  cfg = spec.cfg
  host_PC, e2s = host_PC[:, :-cfg.num_experts], host_PC[0, -cfg.num_experts:]
  tokens_PT = host_PC[:, :spec.max_prompt_len]
  lengths_P, slot_P, limit_P, eos_P, phash_P, sample_P = (
      host_PC[:, spec.max_prompt_len + i] for i in range(6))
  eos_P = eos_P != 0
  seed, epoch = host_PC[0, -2], host_PC[0, -1]
  ep = spec.ep(n, spec.prefill_tile_m)
  moe_fn = lambda x, lp, valid: ep_moe(x, lp, valid, e2s, ep, cfg.num_experts)
  active = slot_P >= 0
  lengths = jnp.where(active, lengths_P, 0)
  logits, k, v, aux = tfm.prefill(merge_params(rest, experts), cfg, tokens_PT, lengths,
                                  moe_fn=moe_fn)
  cache = tfm.insert(tfm.KVCache(cache_k, cache_v), k, v, slot_P)
  keys = jax.vmap(sequence_key, in_axes=(None, None, 0, 0))(seed, epoch, phash_P, sample_P)
  tok, lp = jax.vmap(lambda l, kd: sample_one(l, kd, jnp.int32(0), spec.sampling))(logits, keys)
  st = _unpack(st)
  b = st["tokens"].shape[0]
  idx = jnp.where(active, slot_P, b)  # b = out of range: dropped
  done = (limit_P <= 1) | (eos_P & (tok == cfg.eos_id))
  upd = lambda a, val: a.at[idx].set(val, mode="drop")
  st["tokens"] = upd(st["tokens"], tok)
  st["positions"] = upd(st["positions"], lengths)
  st["live"] = upd(st["live"], ~done)
  st["n_gen"] = upd(st["n_gen"], jnp.ones_like(tok))
  st["limit"] = upd(st["limit"], limit_P)
  st["stop_eos"] = upd(st["stop_eos"], eos_P)
  st["key"] = upd(st["key"], keys)
  st["out_tokens"] = st["out_tokens"].at[idx, 0].set(tok, mode="drop")
  st["out_logprobs"] = st["out_logprobs"].at[idx, 0].set(lp, mode="drop")
  if "routes" in st:  # the prompt's experts: aux [L, P*T, K] -> rows [P, T, L, K]
    p, t = tokens_PT.shape
    r = jnp.transpose(aux["experts"].reshape(cfg.num_layers, p, t, -1), (1, 2, 0, 3))
    st["routes"] = st["routes"].at[idx, :t].set(r, mode="drop")
  return cache.k, cache.v, _pack(st), aux["expert_counts"].sum(0)


def _decode_local(spec: EngineSpec, n: int, rest, experts, cache_k, cache_v, st, host_PC):
  cfg = spec.cfg
  e2s = host_PC[0, -cfg.num_experts:]
  max_steps, stop_on_refill, stop_on_idle = host_PC[0, 0], host_PC[0, 1] != 0, host_PC[0, 2] != 0
  ep = spec.ep(n, spec.decode_tile_m)
  axis = ep.axis
  params = merge_params(rest, experts)
  moe_fn = lambda x, lp, valid: ep_moe(x, lp, valid, e2s, ep, cfg.num_experts)
  st = _unpack(st)
  b = st["tokens"].shape[0]
  rows = jnp.arange(b)
  max_new = spec.max_new_tokens

  def step(carry):
    ck, cv, st, i, _, counts = carry
    live = st["live"]
    logits, cache, aux = tfm.decode(params, cfg, tfm.KVCache(ck, cv), st["tokens"],
                                    st["positions"], live, moe_fn=moe_fn)
    tok, lp = sample(logits, st["key"], st["n_gen"], spec.sampling)
    col = jnp.where(live, st["n_gen"], max_new)  # out of range for dead slots: dropped
    st = dict(st)
    st["out_tokens"] = st["out_tokens"].at[rows, col].set(tok, mode="drop")
    st["out_logprobs"] = st["out_logprobs"].at[rows, col].set(lp, mode="drop")
    if "routes" in st:  # the fed token's experts at its position: aux [L, B, K] -> [B, L, K]
      pos = jnp.where(live, st["positions"], spec.max_seq_len)
      st["routes"] = st["routes"].at[rows, pos].set(jnp.transpose(aux["experts"], (1, 0, 2)),
                                                    mode="drop")
    n_gen = st["n_gen"] + live.astype(jnp.int32)
    finished = live & ((n_gen >= st["limit"]) | (st["stop_eos"] & (tok == cfg.eos_id)))
    st["n_gen"] = n_gen
    st["tokens"] = jnp.where(live, tok, st["tokens"])
    st["positions"] = st["positions"] + live.astype(jnp.int32)
    st["live"] = live & ~finished
    wake = (jnp.any(finished) & stop_on_refill) | (
        stop_on_idle & jnp.any(finished) & ~jnp.any(st["live"]))
    stop = jax.lax.psum(wake.astype(jnp.int32), axis) > 0
    any_live = jax.lax.psum(jnp.any(st["live"]).astype(jnp.int32), axis) > 0
    counts = counts + aux["expert_counts"].sum(0)
    return cache.k, cache.v, st, i + 1, stop | ~any_live, counts

  def cond(carry):
    return (carry[3] < max_steps) & ~carry[4]

  any_live = jax.lax.psum(jnp.any(st["live"]).astype(jnp.int32), axis) > 0
  counts0 = jnp.zeros((cfg.num_experts,), jnp.int32)
  ck, cv, st, steps, _, counts = jax.lax.while_loop(
      cond, step, (cache_k, cache_v, st, jnp.int32(0), ~any_live, counts0))
  return ck, cv, _pack(st), steps, counts


# ----------------------------------------------------------------------------- compiled step set


class StepSet:
  """The executables for one mesh (a set of devices): compiled ahead of time, never on the
  critical path of a rollout."""

  def __init__(self, spec: EngineSpec, mesh: Mesh, rest_abstract, experts_abstract):
    self.spec, self.mesh = spec, mesh
    n = mesh.size
    self.rest_sharding = mesh_lib.tree_shardings(mesh, tfm.param_specs(rest_abstract))
    self.expert_sharding = mesh_lib.tree_shardings(mesh, tfm.param_specs(experts_abstract))
    self.cache_sharding = mesh_lib.named(mesh, cache_spec())
    st_shapes = state_shapes(spec, n)
    self.state_sharding = {k: mesh_lib.named(mesh, mesh_lib.batch_spec(len(v.shape)))
                           for k, v in st_shapes.items()}
    self.worker_sharding = mesh_lib.named(mesh, mesh_lib.batch_spec(1))
    self.host_spec = mesh_lib.batch_spec(2)
    self.host_sharding = mesh_lib.named(mesh, self.host_spec)
    cfg = spec.cfg
    nb, s = n * spec.slots_per_worker, spec.expert_slots
    kv_shape = (cfg.num_layers, nb, spec.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
    dt = tfm.dtype_of(cfg)
    self.abstract_rest = _abstract(rest_abstract, self.rest_sharding)
    self.abstract_experts = {
        k: jax.ShapeDtypeStruct((v.shape[0], n * s) + v.shape[2:], v.dtype,
                                sharding=self.expert_sharding[k])
        for k, v in experts_abstract.items()}
    self.abstract_kv = jax.ShapeDtypeStruct(kv_shape, dt, sharding=self.cache_sharding)
    self.abstract_state = _abstract(st_shapes, self.state_sharding)
    self._compiled: dict[str, Any] = {}

  # -- builders
  def _specs(self, tree):
    return jax.tree.map(lambda s: s.spec, tree)

  def _prefill_jit(self):
    spec, n = self.spec, self.mesh.size
    in_specs = (self._specs(self.rest_sharding), self._specs(self.expert_sharding),
                cache_spec(), cache_spec(), self._specs(self.state_sharding), self.host_spec)
    out_specs = (cache_spec(), cache_spec(), self._specs(self.state_sharding),
                 mesh_lib.replicated_spec())
    fn = jax.shard_map(functools.partial(_prefill_local, spec, n), mesh=self.mesh,
                       in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(fn, donate_argnums=(2, 3, 4))

  def _decode_jit(self):
    spec, n = self.spec, self.mesh.size
    in_specs = (self._specs(self.rest_sharding), self._specs(self.expert_sharding),
                cache_spec(), cache_spec(), self._specs(self.state_sharding), self.host_spec)
    out_specs = (cache_spec(), cache_spec(), self._specs(self.state_sharding),
                 mesh_lib.replicated_spec(), mesh_lib.replicated_spec())
    fn = jax.shard_map(functools.partial(_decode_local, spec, n), mesh=self.mesh,
                       in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(fn, donate_argnums=(2, 3, 4))

  def _args_abstract(self, host_cols: int):
    host = jax.ShapeDtypeStruct((self.mesh.size, host_cols + self.spec.cfg.num_experts),
                                jnp.int32, sharding=self.host_sharding)
    return (self.abstract_rest, self.abstract_experts, self.abstract_kv, self.abstract_kv,
            self.abstract_state, host)

  def prefill_args_abstract(self):
    return self._args_abstract(self.spec.max_prompt_len + len(PREFILL_COLS))

  def decode_args_abstract(self):
    return self._args_abstract(len(DECODE_COLS))

  def put_host(self, host: np.ndarray, e2s: np.ndarray) -> jax.Array:
    """A step's host inputs (one row per worker, then the expert table) onto this mesh by a plain
    transfer: a jnp array would be resharded onto a new mesh by a computation compiled at its
    first use."""
    table = np.broadcast_to(e2s, (host.shape[0], len(e2s)))
    return jax.device_put(np.concatenate([host, table], 1).astype(np.int32), self.host_sharding)

  def compile(self) -> "StepSet":
    if not self._compiled:
      self._compiled["prefill"] = self._prefill_jit().lower(*self.prefill_args_abstract()).compile()
      self._compiled["decode"] = self._decode_jit().lower(*self.decode_args_abstract()).compile()
      self._compiled.update(elastic.compile_movers(self))
      # Multi-controller: the next collectives (warm-up, else the first step) are this mesh's
      # first, where gloo builds its communicator with a short timeout of its own; the processes
      # compile in different times, so they meet at a barrier (long timeout) first.
      distributed.sync(f"mesh/{self.mesh.size}")
      if self.spec.warm_up:
        self.warm_up()
    return self

  def warm_up(self):
    """Run each executable once on placeholder inputs, with one live slot per worker and valid
    mover indices: XLA:CPU compiles a kernel at its first execution, so a loop body (decode
    steps, grouped-matmul tiles) or an in-range insert that warm-up skipped would be compiled on
    the first real call after a release."""
    zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding)
    n, lp = self.mesh.size, self.spec.max_prompt_len
    e = self.spec.cfg.num_experts
    args = list(jax.tree.map(zeros, self.prefill_args_abstract()[:-1]))
    e2s = np.zeros((e,), np.int32)
    host = np.zeros((n, lp + len(PREFILL_COLS)), np.int32)
    host[:, lp:lp + 3] = lp, 0, 2  # length, slot, limit: slot 0 of every worker stays live
    args[2:5] = self._compiled["prefill"](*args, self.put_host(host, e2s))[:3]
    host = np.zeros((n, len(DECODE_COLS)), np.int32)
    host[:, 0] = 1  # one step
    jax.block_until_ready(self._compiled["decode"](*args, self.put_host(host, e2s)))
    idx = jax.device_put(np.zeros((n,), np.int32), self.worker_sharding)
    full = {"experts": self.abstract_experts,
            "slots": {"k": self.abstract_kv, "v": self.abstract_kv, **self.abstract_state}}
    for group, tree in full.items():
      t = jax.tree.map(zeros, tree)
      rows = self._compiled[f"extract_{group}"](t, idx)
      jax.block_until_ready(self._compiled[f"insert_{group}"](t, rows, idx))

  def __getitem__(self, name: str):
    return self.compile()._compiled[name]


# ----------------------------------------------------------------------------- placement helpers


def slot_layout(experts: dict, slot_expert_NS: np.ndarray, sharding: NamedSharding) -> dict:
  """Canonical [L, E, ...] expert weights -> slot layout [L, N*S, ...] (empty slots are zero)."""
  flat = np.asarray(slot_expert_NS).reshape(-1)
  idx = jnp.asarray(np.maximum(flat, 0), jnp.int32)
  empty = jnp.asarray(flat < 0)

  @functools.partial(jax.jit, out_shardings=sharding)
  def gather(w):
    g = jnp.take(w, idx, axis=1)
    return jnp.where(empty[None, :, None, None], jnp.zeros((), w.dtype), g)

  return {k: gather(v) for k, v in experts.items()}


# ----------------------------------------------------------------------------- runtime


@dataclasses.dataclass
class SeqInput:
  """What the engine needs of one sequence."""
  tokens: np.ndarray  # prompt token ids
  limit: int  # tokens to generate at most (fixed target or max_new_tokens)
  stop_eos: bool  # stop at EOS (model lengths) or run to `limit` (workload lengths)
  phash: int  # stable hash of the prompt id
  sample: int
  fixed_length: bool = False


@dataclasses.dataclass
class SeqOutput:
  tokens: list
  logprobs: list
  finish_reason: str
  worker: int
  slot: int
  routes: Optional[np.ndarray] = None  # [prompt + tokens - 1, L, K] when spec.record_routes


def default_compile_threads() -> int:
  """Threads that compile mesh sizes side by side: XLA's backend compile releases the GIL and
  runs mostly on one core, so independent sizes overlap up to the core count (a few more threads
  would only fight the rollout for the same cores)."""
  import os
  return max(1, min(4, os.cpu_count() or 1))


class StepCache:
  """Ahead-of-time compiled StepSets, one per mesh of the release chain, compiled in the
  background at rollout start (and kept across rollouts by JAX's persistent cache).

  Sizes compile in the order `prefetch` is given them, `compile_threads` at a time. The
  single-device movers (elastic.SlotMovers, RowMovers) are compiled per device, and only for the
  devices `plan_movers` names for a size, right after that size's StepSet: a release onto a size
  needs its own executables first, and the movers only of the devices its moves touch. A move
  whose devices have no movers yet takes the SPMD extract/insert path of the StepSets instead
  (compiled with them), so no move ever waits for a compile."""

  def __init__(self, spec: EngineSpec, devices: Sequence[jax.Device], chain: Sequence[int],
               rest_abstract, experts_abstract, *, compile_threads: int = 0):
    self.spec, self.devices, self.chain = spec, list(devices), list(chain)
    self._abs = (rest_abstract, experts_abstract)
    self.compile_threads = int(compile_threads) or default_compile_threads()
    self._pool = self._new_pool()
    self._futures: dict[int, Any] = {}
    self._sets: dict[int, StepSet] = {}
    self._slot_movers: dict = {}  # device -> elastic.SlotMovers
    self._row_movers: dict = {}  # device -> elastic.RowMovers
    self._movers_lock = threading.Lock()
    # size -> (devices needing slot movers, devices needing row movers) after that size's
    # StepSet; None: every device of the chain at the first smaller size (no plan given)
    self._mover_plan: Optional[dict[int, tuple[set, set]]] = None
    self.compile_log: list[tuple[int, float, float]] = []  # (size, start, end) perf_counter

  def _new_pool(self):
    return concurrent.futures.ThreadPoolExecutor(max_workers=self.compile_threads,
                                                 thread_name_prefix="flexfloor-compile")

  def reopen(self):
    """A fresh compile pool after close() (a cache reused by a later rollout)."""
    if getattr(self._pool, "_shutdown", False):
      self._pool = self._new_pool()

  def mesh_for(self, n: int) -> Mesh:
    return mesh_lib.make_ep_mesh([self.devices[w] for w in self.chain[len(self.chain) - n:]])

  def plan_movers(self, plan: dict[int, tuple[Sequence[int], Sequence[int]]]):
    """{size: (workers whose expert slots a release onto `size` moves, workers a migration on
    the mesh of `size` moves sequences between)}: their single-device movers are compiled right
    after that size's StepSet. Call before prefetch."""
    self._mover_plan = {int(m): ({self.devices[w] for w in a}, {self.devices[w] for w in b})
                        for m, (a, b) in plan.items()}

  def _build(self, n: int) -> StepSet:
    t0 = time.perf_counter()
    ss = StepSet(self.spec, self.mesh_for(n), *self._abs).compile()
    if jax.process_count() == 1:
      if self._mover_plan is None:
        every = set() if n == len(self.chain) else {self.devices[w] for w in self.chain}
        slot_devs, row_devs = every, every
      else:
        slot_devs, row_devs = self._mover_plan.get(n, (set(), set()))
      self.row_movers(row_devs)
      self.slot_movers(slot_devs)
    self.compile_log.append((n, t0, time.perf_counter()))
    return ss

  def _movers(self, table: dict, devices, make) -> dict:
    with self._movers_lock:
      todo = [d for d in devices if d not in table]
    for d in todo:  # compiled outside the lock: another size's thread may build other devices
      m = make(d)
      with self._movers_lock:
        table.setdefault(d, m)
    with self._movers_lock:
      return dict(table)

  def row_movers(self, devices=None) -> dict:
    """{device: elastic.RowMovers}, compiled for `devices` (default: the chain's) if missing;
    returns every device's compiled so far."""
    cfg, b = self.spec.cfg, self.spec.slots_per_worker
    kv = jax.ShapeDtypeStruct((cfg.num_layers, b, self.spec.max_seq_len, cfg.num_kv_heads,
                               cfg.head_dim), tfm.dtype_of(cfg))
    shard = {"k": kv, "v": kv, **state_shapes(self.spec, 1)}
    devs = [self.devices[w] for w in self.chain] if devices is None else devices
    return self._movers(self._row_movers, devs, lambda d: elastic.RowMovers(shard, d, b))

  def slot_movers(self, devices=None) -> dict:
    """{device: elastic.SlotMovers}, as row_movers."""
    s = self.spec.expert_slots
    shard = {k: jax.ShapeDtypeStruct((v.shape[0], s) + v.shape[2:], v.dtype)
             for k, v in self._abs[1].items()}
    devs = [self.devices[w] for w in self.chain] if devices is None else devices
    return self._movers(self._slot_movers, devs, lambda d: elastic.SlotMovers(shard, d, s))

  def row_movers_ready(self, devices=None) -> bool:
    """Are the single-device sequence movers of `devices` (default: the chain's) compiled?"""
    devs = [self.devices[w] for w in self.chain] if devices is None else devices
    with self._movers_lock:
      return all(d in self._row_movers for d in devs)

  def slot_movers_ready(self, devices) -> bool:
    with self._movers_lock:
      return all(d in self._slot_movers for d in devices)

  def prefetch(self, sizes: Sequence[int]):
    """Compile these sizes in this order (first given, first started)."""
    for n in sizes:
      if n not in self._futures and n not in self._sets:
        if jax.process_count() > 1:
          # Multi-controller: warm-up and mover setup run collectives, which must be issued in
          # the same order on every process: build in the caller's thread, in order.
          self._sets[n] = self._build(n)
        else:
          self._futures[n] = self._pool.submit(self._build, n)

  def get(self, n: int) -> StepSet:
    if n not in self._sets:
      fut = self._futures.pop(n, None)
      self._sets[n] = fut.result() if fut is not None else self._build(n)
    return self._sets[n]

  def wait(self, sizes: Sequence[int]):
    for n in sizes:
      if n in self._futures or n not in self._sets:
        self.get(n)

  def wait_all(self):
    for n in list(self._futures):
      self.get(n)

  def ready(self, n: int) -> bool:
    """Is the StepSet for n workers compiled (so moving to it costs no compile)?"""
    return n in self._sets or (n in self._futures and self._futures[n].done())

  def close(self):
    """Drop compiles not started yet (those in flight finish: XLA can't be interrupted)."""
    self._pool.shutdown(wait=False, cancel_futures=True)


class StepCachePool:
  """Reuses engine.StepCache across runs whose EngineSpec, devices and release chain are the same
  (static and flexfloor differ in expert slots per worker, so each gets its own).

  runner.run builds its StepCache itself (engine.Engine calls engine.StepCache(spec, devices,
  chain, ...)) and accepts one only ready-made, which would mean rebuilding its EngineSpec here.
  Instead, while `installed()`, engine.StepCache is a factory keyed by exactly the arguments the
  engine passes, so a cache is only ever shared between identical specs."""

  def __init__(self, engine_lib=None):
    engine_lib = engine_lib or sys.modules[__name__]
    self._lib, self._cls = engine_lib, engine_lib.StepCache
    self._caches: dict = {}
    self.hits = self.misses = 0

  def _key(self, spec, devices, chain, rest_abs, exp_abs):
    shapes = lambda t: tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(t))
    return (spec, tuple(d.id for d in devices), tuple(chain), str(jax.tree.structure(rest_abs)),
            shapes(rest_abs), shapes(exp_abs))

  def _make(self, spec, devices, chain, rest_abs, exp_abs, **kw):
    key = self._key(spec, devices, chain, rest_abs, exp_abs)
    c = self._caches.get(key)
    if c is None:
      self.misses += 1
      c = self._caches[key] = self._cls(spec, devices, chain, rest_abs, exp_abs, **kw)
    else:
      self.hits += 1
      c.reopen()  # the runner closes caches it did not get passed
    return c

  @contextlib.contextmanager
  def installed(self):
    self._lib.StepCache = self._make
    try:
      yield self
    finally:
      self._lib.StepCache = self._cls


class Engine:
  """Executes prefill / decode / migrate / shrink on the active workers. Worker ids are indices
  into `devices`; the active workers are always a tail of `chain` (release order)."""

  def __init__(self, spec: EngineSpec, params: tfm.Params, devices: Sequence[jax.Device],
               chain: Sequence[int], placement: ExpertPlacement, *, seed: int = 0,
               epoch: int = 0, step_cache: Optional[StepCache] = None,
               prefetch_sizes: Sequence[int] = (), compile_threads: int = 0,
               mover_plan: Optional[dict] = None):
    """`prefetch_sizes`: the smaller meshes to compile, in the order they should be ready;
    `mover_plan`: StepCache.plan_movers's argument (None: movers for every device)."""
    self.spec, self.seed, self.epoch = spec, int(seed), int(epoch)
    self.devices, self.chain = list(devices), list(chain)
    rest, experts = split_params(params)
    rest_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rest)
    exp_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), experts)
    self.steps = step_cache or StepCache(spec, devices, chain, rest_abs, exp_abs,
                                         compile_threads=compile_threads)
    n = len(self.chain)
    self.active = list(self.chain)
    if mover_plan is not None:
      self.steps.plan_movers(mover_plan)
    self.steps.prefetch([n, *[m for m in prefetch_sizes if m != n]])
    ss = self.steps.get(n)
    self.rest = jax.device_put(rest, ss.rest_sharding)
    # The replicated weights never change: their views over every smaller mesh (the same
    # buffers) are made now, not when a release waits for them.
    self._rest_views = {m: jax.tree.map(
        lambda a: elastic.reassemble(a, mesh_lib.replicated(self.steps.mesh_for(m)), a.shape),
        self.rest) for m in range(1, n)}
    self.experts = slot_layout(experts, placement.slot_expert()[self.active],
                               ss.expert_sharding["w1"])
    self.set_placement(placement)
    self.cache_k = jnp.zeros(ss.abstract_kv.shape, ss.abstract_kv.dtype,
                             device=ss.cache_sharding)
    self.cache_v = jnp.zeros(ss.abstract_kv.shape, ss.abstract_kv.dtype,
                             device=ss.cache_sharding)
    self.state = {k: jnp.zeros(v.shape, v.dtype, device=ss.state_sharding[k])
                  for k, v in ss.abstract_state.items()}
    self.seqs: dict[int, SeqInput] = {}
    self.outputs: dict[int, SeqOutput] = {}
    self._slot_seq: dict[tuple[int, int], int] = {}
    self.expert_counts = np.zeros((spec.cfg.num_experts,), np.int64)
    self.compiles_after_start = 0
    self._pending_release_t0: Optional[float] = None
    self._migrate_t0: Optional[float] = None  # a plan's migration: its release decision time
    self.release_latencies: list[float] = []
    self.release_sizes: list[int] = []  # active workers on the mesh each latency was timed on

  # -- setup
  @property
  def stepset(self) -> StepSet:
    return self.steps.get(len(self.active))

  def set_placement(self, placement: ExpertPlacement):
    self.placement = placement
    self.e2s = placement.expert_to_slot(self.active).astype(np.int32)  # sent with each step

  def add_sequences(self, seqs: dict[int, SeqInput]):
    lp = self.spec.max_prompt_len
    for sid, s in seqs.items():
      if len(s.tokens) > lp:
        raise ValueError(f"sequence {sid}: prompt of {len(s.tokens)} tokens exceeds "
                         f"max_prompt_len={lp}")
      if len(s.tokens) + s.limit > self.spec.max_seq_len:
        raise ValueError(f"sequence {sid}: prompt {len(s.tokens)} + {s.limit} new tokens "
                         f"exceeds model.max_seq_len={self.spec.max_seq_len}")
    self.seqs.update(seqs)

  def active_workers(self) -> list[int]:
    return list(self.active)

  def _pos(self, worker: int) -> int:
    return self.active.index(worker)

  def _read(self, *arrays) -> list:
    """Host values of device arrays, the same on every process (multi-controller: gathered,
    and passed through the key-value store to processes whose workers were all released)."""
    return distributed.host_values(arrays)

  # -- steps
  def prefill(self, assign: Sequence[tuple[int, int, int]]):
    self._migrate_t0 = None  # a migration without a release
    ss, n = self.stepset, len(self.active)
    lp = self.spec.max_prompt_len
    host = np.zeros((n, lp + len(PREFILL_COLS)), np.int32)  # tokens, then PREFILL_COLS
    host[:, lp + 1] = -1  # slot: no prefill on this worker
    host[:, -2:] = self.seed, self.epoch
    for worker, s, sid in assign:
      p = self._pos(worker)
      if host[p, lp + 1] >= 0:
        raise ValueError(f"two prefills for worker {worker} in one step")
      q = self.seqs[sid]
      host[p, : len(q.tokens)] = q.tokens
      host[p, lp:lp + 6] = len(q.tokens), s, q.limit, q.stop_eos, q.phash, q.sample
      self._slot_seq[(worker, s)] = sid
    self.cache_k, self.cache_v, self.state, counts = ss["prefill"](
        self.rest, self.experts, self.cache_k, self.cache_v, self.state,
        ss.put_host(host, self.e2s))
    self.expert_counts += self._read(counts)[0]
    if self._pending_release_t0 is not None:  # a prefill is the first output on the new mesh
      self._first_output_on_new_mesh(self.state)
    return self._collect_finishes()

  def decode(self, max_steps: int, stop_on_refill, stop_on_idle):
    self._migrate_t0 = None
    ss = self.stepset
    host = lambda k: ss.put_host(np.stack([np.full(len(self.active), k), stop_on_refill,
                                           stop_on_idle], axis=1), self.e2s)  # DECODE_COLS
    total, finishes = 0, []
    if self._pending_release_t0 is not None and max_steps > 0:
      # First step on a new mesh alone, to time release decision -> first output.
      out = ss["decode"](self.rest, self.experts, self.cache_k, self.cache_v, self.state,
                         host(1))
      self._first_output_on_new_mesh(out)
      self.cache_k, self.cache_v, self.state, steps, counts = out
      steps, counts = self._read(steps, counts)
      self.expert_counts += counts
      total = int(steps)
      finishes = self._collect_finishes()
      if total == 0 or max_steps == 1 or self._stop_fired(finishes, stop_on_refill, stop_on_idle):
        return total, finishes
      max_steps -= 1
    self.cache_k, self.cache_v, self.state, steps, counts = ss["decode"](
        self.rest, self.experts, self.cache_k, self.cache_v, self.state, host(max_steps))
    steps, counts = self._read(steps, counts)
    self.expert_counts += counts
    return total + int(steps), finishes + self._collect_finishes()

  def _first_output_on_new_mesh(self, out):
    """Release decision -> first output on the new mesh (block_until_ready), recorded once."""
    jax.block_until_ready(out)
    self.release_latencies.append(time.perf_counter() - self._pending_release_t0)
    self.release_sizes.append(len(self.active))
    self._pending_release_t0 = None

  def _stop_fired(self, finishes, stop_on_refill, stop_on_idle) -> bool:
    """Would the device loop have stopped after this step? (Same rule as _decode_local.)"""
    live = {w for w, _ in self._slot_seq}
    if not live:
      return True
    for f in finishes:
      p = self._pos(f.worker)
      if stop_on_refill[p] or (stop_on_idle[p] and f.worker not in live):
        return True
    return False

  def _collect_finishes(self):
    """Finished sequences since the last call: read the small per-slot array once."""
    slots, = self._read(self.state["slots"])
    live, n_gen = slots[:, COL["live"]], slots[:, COL["n_gen"]]
    b = self.spec.slots_per_worker
    done = [(w, s, sid) for (w, s), sid in self._slot_seq.items()
            if not live[self._pos(w) * b + s]]
    if not done:
      return []
    toks, lps = self._read(self.state["out_tokens"], self.state["out_logprobs"])
    routes = self._read(self.state["routes"])[0] if "routes" in self.state else None
    eos = self.spec.cfg.eos_id
    out = []
    from flexfloor_jax.policy.controller import Finish
    for w, s, sid in done:
      row = self._pos(w) * b + s
      k = int(n_gen[row])
      q = self.seqs[sid]
      tk = toks[row, :k].tolist()
      if q.stop_eos and tk and tk[-1] == eos and k < q.limit:
        reason = "eos"
      else:
        reason = "target" if q.fixed_length else "length"
      fed = len(q.tokens) + k - 1  # positions that went through the model
      self.outputs[sid] = SeqOutput(tk, lps[row, :k].tolist(), reason, w, s,
                                    None if routes is None else routes[row, :fed].copy())
      del self._slot_seq[(w, s)]
      out.append(Finish(seq_id=sid, worker=w, slot=s, num_tokens=k, reason=reason))
    return out

  # -- elastic
  def migrate(self, moves: Sequence[tuple[int, int, int, int]]) -> int:
    """Move live sequences (src_worker, src_slot, dst_worker, dst_slot); returns KV bytes sent."""
    if not moves:
      return 0
    self._migrate_t0 = time.perf_counter()  # the release that follows is timed from here
    ss, b = self.stepset, self.spec.slots_per_worker
    tree = {"k": self.cache_k, "v": self.cache_v, **self.state}
    dev = self.devices
    touched = {dev[w] for sw, _, dw, _ in moves for w in (sw, dw)}
    if jax.process_count() == 1 and self.steps.row_movers_ready(touched):
      shards = {k: elastic.shards_by_device(a) for k, a in tree.items()}
      nbytes = elastic.move_slots(shards, [(dev[sw], s_, dev[dw], ds)
                                           for sw, s_, dw, ds in moves],
                                  self.steps.row_movers(()))
      tree = {k: elastic.assemble(shards[k], a.sharding, a.shape, a.dtype)
              for k, a in tree.items()}
    else:  # multi-controller, or no movers compiled for these devices: SPMD extract/insert
      rows = [(self._pos(sw), ss_, self._pos(dw), ds) for sw, ss_, dw, ds in moves]
      tree, nbytes = elastic.move_rows(ss, "slots", tree, rows)
    self.cache_k, self.cache_v = tree.pop("k"), tree.pop("v")
    self.state = tree
    for sw, s_, dw, ds in moves:
      if (sw, s_) in self._slot_seq:
        self._slot_seq[(dw, ds)] = self._slot_seq.pop((sw, s_))
    per_slot = sum(x.nbytes for x in (self.cache_k, self.cache_v)) // (len(self.active) * b)
    state_per_slot = sum(x.nbytes for x in self.state.values()) // (len(self.active) * b)
    return int(nbytes * per_slot // (per_slot + state_per_slot))

  def shrink(self, new_active: Sequence[int]) -> dict:
    """Release the workers not in `new_active` (a tail of the chain). Only the experts that lived
    on released workers move, into empty slots of the survivors (ExpertPlacement.after_release)."""
    t0 = time.perf_counter()
    new_active = list(new_active)
    if new_active != self.chain[len(self.chain) - len(new_active):]:
      raise ValueError(f"active set {new_active} is not a tail of the release chain {self.chain}")
    released = [w for w in self.active if w not in new_active]
    live = [k for k in self._slot_seq if k[0] in released]
    if live:
      raise ValueError(f"workers {released} still hold live sequences {live}: migrate first")
    n = len(new_active)
    new_ss = self.steps.get(n)
    new_placement = self.placement.after_release(released, new_active)
    # (src worker, src slot, dst worker, dst slot) of every expert that leaves a released worker
    moves = [(*a, *b) for _, a, b in new_placement.moves_since(self.placement)]
    dev = self.devices
    touched = {dev[w] for sw, _, dw, _ in moves for w in (sw, dw)}
    if jax.process_count() > 1 or not self.steps.slot_movers_ready(touched):
      # multi-controller, or a release the mover plan did not foresee: SPMD extract/insert
      experts, moved_bytes = self._move_experts_routed(moves, new_ss, new_active)
    else:
      shards = {k: elastic.shards_by_device(a) for k, a in self.experts.items()}
      moved_bytes = elastic.move_slots(shards, [(dev[sw], ss_, dev[dw], ds)
                                                for sw, ss_, dw, ds in moves],
                                       self.steps.slot_movers(()))
      experts = {k: elastic.assemble(shards[k], t.sharding, t.shape, t.dtype)
                 for k, t in new_ss.abstract_experts.items()}
    # Reassemble the survivors' shards over the new mesh (no copy).
    self.rest = self._rest_views.pop(n)
    self._rest_views = {m: v for m, v in self._rest_views.items() if m < n}
    tree = {"k": self.cache_k, "v": self.cache_v, **self.state}
    tgt = {"k": new_ss.abstract_kv, "v": new_ss.abstract_kv, **new_ss.abstract_state}
    tree = elastic.shrink_tree(tree, tgt)
    self.cache_k, self.cache_v = tree.pop("k"), tree.pop("v")
    self.state = tree
    self.experts = experts
    self.active = new_active
    self.set_placement(new_placement)
    # No host sync here: the movers and the first step on the new mesh queue back to back.
    # The latency counts from the decision: the plan's migrations when it had any.
    self._pending_release_t0 = t0 if self._migrate_t0 is None else self._migrate_t0
    self._migrate_t0 = None
    return {"released": released, "expert_bytes_moved": int(moved_bytes),
            "expert_moves": len(moves), "shrink_seconds": time.perf_counter() - t0}

  def _move_experts_routed(self, moves, new_ss, new_active) -> tuple[dict, int]:
    """Expert moves by the StepSets' SPMD steps: extract on the old mesh, a transfer (one
    process: a device_put per moved expert; multi-controller, where a cross-host device_put is
    not implemented: a ppermute over the old mesh, elastic.route_rows), SPMD insert into the
    survivors' empty slots on the new mesh. Returns (experts over the new mesh, bytes this
    process counted)."""
    old_ss = self.stepset
    old_pos = {w: i for i, w in enumerate(self.active)}
    new_pos = {w: i for i, w in enumerate(new_active)}
    moved_bytes = 0
    pieces = []  # (dst worker, dst slot, {name: buffer on dst, None on another process})
    devs_old = list(old_ss.mesh.devices.reshape(-1))
    rows = None
    # One extract per source device and one block per destination device in each round.
    for rnd in elastic.move_rounds([(old_pos[sw], ss_, dw, ds) for sw, ss_, dw, ds in moves]):
      # Cut the moving experts out on the old mesh.
      idx = np.full((len(self.active),), -1, np.int32)
      for sp, sslot, _, _ in rnd:
        idx[sp] = sslot
      rows = old_ss["extract_experts"](self.experts, jax.device_put(idx, old_ss.worker_sharding))
      if jax.process_count() == 1:
        local = {name: elastic.shards_by_device(r) for name, r in rows.items()}
        for sp, _, dw, ds in rnd:
          sent = {name: jax.device_put(local[name][devs_old[sp]], self.devices[dw])
                  for name in rows}
          moved_bytes += sum(a.nbytes for a in sent.values())
          pieces.append((dw, ds, sent))
        continue
      routed = elastic.route_rows(rows, {sp: self.devices[dw] for sp, _, dw, _ in rnd}, devs_old)
      for sp, _, dw, ds in rnd:
        moved_bytes += sum(a.nbytes // len(devs_old) for a in rows.values())
        pieces.append((dw, ds, {name: r.get(self.devices[dw]) for name, r in routed.items()}))
    experts = elastic.shrink_tree(self.experts, new_ss.abstract_experts)
    # Write the moved experts into empty slots of the survivors (donated, in place).
    rows_abs = new_ss["rows_experts"]
    devs_new = list(new_ss.mesh.devices.reshape(-1))
    # Workers that receive nothing in a round get a row of the last extract as filler (their
    # index is -1: the insert drops it); the extract's rows have a shard on every survivor.
    filler = rows
    while pieces:
      idx = np.full((len(new_active),), -1, np.int32)
      taken, rest_pieces, rnd = set(), [], []
      for pc in pieces:
        (rest_pieces if pc[0] in taken else rnd).append(pc)
        taken.add(pc[0])
      pieces = rest_pieces
      row_tree = {}
      for name in rows_abs:
        bufs = {}
        for dw, ds, b in rnd:
          if b[name] is not None:  # None: the destination is another process's device
            bufs[devs_new[new_pos[dw]]] = b[name]
        row_tree[name] = elastic.reassemble(filler[name], rows_abs[name].sharding,
                                            rows_abs[name].shape, bufs)
      for dw, ds, _ in rnd:
        idx[new_pos[dw]] = ds
      experts = new_ss["insert_experts"](experts, row_tree,
                                         jax.device_put(idx, new_ss.worker_sharding))
    return experts, moved_bytes
