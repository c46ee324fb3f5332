"""Ahead-of-time compiled executables per mesh: StepSet (one mesh's prefill, decode and SPMD
movers), StepCache (the StepSets of a release chain, compiled in the background, and the
single-device movers), StepCachePool (StepCaches kept across rollouts with identical specs)."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from flexfloor_jax.engine import movers
from flexfloor_jax.engine import state as state_lib
from flexfloor_jax.engine.spec import EngineSpec, SeqInput, cache_spec, pages_spec
from flexfloor_jax.engine.steps import decode_local, prefill_local
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.runtime import distributed
from flexfloor_jax.runtime import mesh as mesh_lib


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


class StepSet:
  """The executables for one mesh (a set of devices): compiled ahead of time, never on the
  critical path of a rollout."""

  def __init__(self, spec: EngineSpec, mesh: Mesh, rest_abstract, experts_abstract):
    self.spec, self.mesh = spec, mesh
    n = mesh.size
    self.rest_sharding = mesh_lib.tree_shardings(mesh, tfm.param_specs(rest_abstract))
    self.expert_sharding = mesh_lib.tree_shardings(mesh, tfm.param_specs(experts_abstract))
    self.cache_sharding = mesh_lib.named(mesh, cache_spec())
    shapes = state_lib.state_shapes(spec, n)

    def rows(x):
      return mesh_lib.named(mesh, mesh_lib.batch_spec(len(x.shape)))

    self.state_sharding = jax.tree.map(rows, shapes)
    if spec.paged:
      self.pages_sharding = mesh_lib.named(mesh, pages_spec())
      self.state_sharding = self.state_sharding.replace(k_pages=self.pages_sharding,
                                                        v_pages=self.pages_sharding)
    else:
      self.state_sharding = self.state_sharding.replace(k=self.cache_sharding,
                                                        v=self.cache_sharding)
    if shapes.k_ring is not None:  # the sliding layers' rings: rows on axis 1, as the cache
      self.state_sharding = self.state_sharding.replace(k_ring=self.cache_sharding,
                                                        v_ring=self.cache_sharding)
    self.worker_sharding = mesh_lib.named(mesh, mesh_lib.batch_spec(1))
    self.host_spec = mesh_lib.batch_spec(2)
    self.host_sharding = mesh_lib.named(mesh, self.host_spec)
    s = spec.expert_slots
    self.abstract_rest = _abstract(rest_abstract, self.rest_sharding)
    self.abstract_experts = {
        k: jax.ShapeDtypeStruct((v.shape[0], n * s) + v.shape[2:], v.dtype,
                                sharding=self.expert_sharding[k])
        for k, v in experts_abstract.items()}
    self.abstract_state = _abstract(shapes, self.state_sharding)
    self._compiled: dict[str, Any] = {}

  # -- builders
  def _specs(self, tree):
    return jax.tree.map(lambda s: s.spec, tree)

  def _step_jit(self, body, num_replicated_out: int, **kw):
    spec, n = self.spec, self.mesh.size
    st = self._specs(self.state_sharding)
    in_specs = (self._specs(self.rest_sharding), self._specs(self.expert_sharding), st,
                self.host_spec)
    out_specs = (st,) + (mesh_lib.replicated_spec(),) * num_replicated_out
    fn = jax.shard_map(functools.partial(body, spec, n, **kw), mesh=self.mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)
    return jax.jit(fn, donate_argnums=(2,))

  def _args_abstract(self, kind: str, width: int = 0):
    spec = self.spec
    m = spec.pages_per_seq * (1 if kind == "prefill" else spec.slots_per_worker)
    decode = kind == "decode"
    cols = state_lib.host_width(kind, width or spec.max_prompt_len, spec.cfg.num_experts, m,
                                spec.prefill_queue if decode else 0,
                                spec.slots_per_worker * (1 + spec.draft_tokens)
                                if decode and spec.draft_tokens else 0)
    host = jax.ShapeDtypeStruct((self.mesh.size, cols), jnp.int32, sharding=self.host_sharding)
    return (self.abstract_rest, self.abstract_experts, self.abstract_state, host)

  def prefill_args_abstract(self, width: int = 0):
    return self._args_abstract("prefill", width)

  def decode_args_abstract(self):
    return self._args_abstract("decode")

  def put_host(self, host: np.ndarray, e2s: np.ndarray) -> jax.Array:
    """A step's host inputs (one row per worker, then the expert table) onto this mesh by a plain
    transfer: a jnp array would be resharded onto a new mesh by a computation compiled at its
    first use."""
    return jax.device_put(state_lib.with_expert_table(host, e2s), self.host_sharding)

  def compile(self) -> StepSet:
    if not self._compiled:
      if not self.spec.chunked:  # chunked prefill: prompts ride in the decode steps
        self._compiled["prefill"] = self._step_jit(prefill_local, 1).lower(
            *self.prefill_args_abstract()).compile()
      self._compiled["decode"] = self._step_jit(decode_local, 2).lower(
          *self.decode_args_abstract()).compile()
      self._compiled.update(movers.compile_movers(self))
      if self.spec.paged and jax.process_count() > 1:  # migrations move pages by SPMD steps
        self._compiled.update(movers.compile_page_movers(self))
      # Multi-controller: the next collectives (warm-up, else the first step) are this mesh's
      # first, where gloo builds its communicator with a short timeout of its own; the processes
      # compile in different times, so they meet at a barrier (long timeout) first.
      distributed.sync(f"mesh/{self.mesh.size}")
      if self.spec.warm_up:
        self.warm_up()
    return self

  def resume_prefill(self):
    """The prefill of preempted sequences (paged KV), spec.resume_width token columns: compiled
    at its first use, since only a run that preempts needs it."""
    self.compile()
    if "prefill_resume" not in self._compiled:
      w = self.spec.resume_width
      self._compiled["prefill_resume"] = self._step_jit(prefill_local, 1, width=w).lower(
          *self.prefill_args_abstract(w)).compile()
    return self._compiled["prefill_resume"]

  def page_programs(self) -> dict:
    """The SPMD page movers, {extract_pages, insert_pages} (movers.compile_page_movers): compiled
    with the mesh when several processes run it (the only path that needs them), else at their
    first use."""
    self.compile()
    if "extract_pages" not in self._compiled:
      self._compiled.update(movers.compile_page_movers(self))
    return {k: self._compiled[k] for k in ("extract_pages", "insert_pages")}

  def warm_up(self):
    """Run each executable once on placeholder inputs, with one live decode slot per worker and
    valid mover indices: XLA:CPU compiles a kernel at its first execution, so a loop body (decode
    steps, grouped-matmul tiles) or an in-range insert that warm-up skipped would be compiled on
    the first real call after a release."""

    def zeros(a):
      return jnp.zeros(a.shape, a.dtype, device=a.sharding)

    spec = self.spec
    n, lp = self.mesh.size, spec.max_prompt_len
    e2s = np.zeros((spec.cfg.num_experts,), np.int32)
    rest, experts, st = jax.tree.map(zeros, self.prefill_args_abstract()[:-1])
    m, b = spec.pages_per_seq, spec.slots_per_worker
    row = np.minimum(np.arange(m), spec.num_pages - 1)  # paged KV: valid page ids
    tables = np.broadcast_to(row, (n, b, m)) if m else None
    queue = queued = None
    if spec.chunked:
      # a chunk of input into decode slot 0 of every worker, its last token in the step: the
      # slot goes live (limit 2) within the one step
      c = spec.prefill_rows
      one = np.zeros((spec.prefill_queue, len(state_lib.QUEUE_COLS)), np.int32)
      col = {name: i for i, name in enumerate(state_lib.QUEUE_COLS)}
      one[:c, col["position"]] = np.arange(c)
      one[c - 1, col["last"]], one[:, col["limit"]] = 1, 2
      queue, queued = np.broadcast_to(one, (n,) + one.shape), np.full(n, c)
    else:
      # a full-width prompt into decode slot 0 of every worker, left live (limit 2)
      seq = SeqInput(tokens=np.zeros((lp,), np.int32), limit=2, stop_eos=False, phash=0,
                     sample=0)
      host = state_lib.prefill_host(lp, n, 0, 0, [(p, 0, seq, 0, row) for p in range(n)], m)
      st, _ = self._compiled["prefill"](rest, experts, st, self.put_host(host, e2s))
    # speculative decoding: no draft (the step's code is the same whatever the drafts hold)
    drafts = (np.zeros((n, b, 1 + spec.draft_tokens), np.int32) if spec.draft_tokens else None)
    host = state_lib.decode_host(1, np.zeros(n, bool), np.zeros(n, bool), tables, queue=queue,
                                 queued=queued, chunk=spec.prefill_rows,
                                 drafts=drafts)  # one step
    jax.block_until_ready(self._compiled["decode"](rest, experts, st, self.put_host(host, e2s)))
    idx = jax.device_put(np.zeros((n,), np.int32), self.worker_sharding)
    full = {"experts": self.abstract_experts, "rows": self.abstract_state.row_dict()}
    for group, tree in full.items():
      t = jax.tree.map(zeros, tree)
      taken = self._compiled[f"extract_{group}"](t, idx)
      jax.block_until_ready(self._compiled[f"insert_{group}"](t, taken, idx))
    if "extract_pages" in self._compiled:
      t = jax.tree.map(zeros, self.abstract_state.page_dict())
      ids = jax.device_put(np.zeros((n, movers.page_block(m)), np.int32), self.host_sharding)
      taken = self._compiled["extract_pages"](t, ids)
      jax.block_until_ready(self._compiled["insert_pages"](t, taken, ids))

  def __getitem__(self, name: str):
    return self.compile()._compiled[name]


def default_compile_threads() -> int:
  """Threads that compile mesh sizes side by side: XLA's backend compile releases the GIL and
  runs mostly on one core, so independent sizes overlap up to the core count (a few more threads
  would only fight the rollout for the same cores)."""
  return max(1, min(4, os.cpu_count() or 1))


class StepCache:
  """Ahead-of-time compiled StepSets, one per mesh of the release chain, compiled in the
  background at rollout start (and kept across rollouts by JAX's persistent cache).

  Sizes compile in the order `prefetch` is given them, `compile_threads` at a time. The
  single-device movers (movers.SlotMovers, RowMovers) are compiled per device, and only for the
  devices `plan_movers` names for a size, right after that size's StepSet: a release onto a size
  needs its own executables first, and the movers only of the devices its moves touch. A move
  whose devices have no movers yet takes the SPMD extract/insert path of the StepSets instead
  (compiled with them), so no move ever waits for a compile."""

  def __init__(self, spec: EngineSpec, devices: Sequence[mesh_lib.Device], chain: Sequence[int],
               rest_abstract, experts_abstract, *, compile_threads: int = 0):
    self.spec, self.devices, self.chain = spec, list(devices), list(chain)
    self._abs = (rest_abstract, experts_abstract)
    self.compile_threads = int(compile_threads) or default_compile_threads()
    self._pool = self._new_pool()
    self._futures: dict[int, Any] = {}
    self._sets: dict[int, StepSet] = {}
    self._slot_movers: dict = {}  # device -> movers.SlotMovers (expert slots)
    self._row_movers: dict = {}  # device -> movers.RowMovers (sequence rows)
    self._page_movers: dict = {}  # device -> movers.PageMovers (paged KV)
    self._movers_lock = threading.Lock()
    # size -> (devices needing slot movers, devices needing row movers) after that size's
    # StepSet; None: every device of the chain at the first smaller size (no plan given)
    self._mover_plan: dict[int, tuple[set, set]] | None = None
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
      if self.spec.paged:
        self.page_movers(row_devs)
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
    """{device: movers.RowMovers}, compiled for `devices` (default: the chain's) if missing;
    returns every device's compiled so far."""
    b = self.spec.slots_per_worker
    shard = state_lib.state_shapes(self.spec, 1).row_dict()  # one worker's sequence rows
    devs = [self.devices[w] for w in self.chain] if devices is None else devices
    return self._movers(self._row_movers, devs, lambda d: movers.RowMovers(shard, d, b))

  def page_movers(self, devices=None) -> dict:
    """{device: movers.PageMovers} (paged KV), as row_movers."""
    shard = state_lib.state_shapes(self.spec, 1).page_dict()  # one worker's pool
    devs = [self.devices[w] for w in self.chain] if devices is None else devices
    return self._movers(self._page_movers, devs,
                        lambda d: movers.PageMovers(shard, d, self.spec.pages_per_seq))

  def slot_movers(self, devices=None) -> dict:
    """{device: movers.SlotMovers}, as row_movers."""
    s = self.spec.expert_slots
    shard = {k: jax.ShapeDtypeStruct((v.shape[0], s) + v.shape[2:], v.dtype)
             for k, v in self._abs[1].items()}
    devs = [self.devices[w] for w in self.chain] if devices is None else devices
    return self._movers(self._slot_movers, devs, lambda d: movers.SlotMovers(shard, d, s))

  def row_movers_ready(self, devices=None) -> bool:
    """Are the single-device sequence movers of `devices` (default: the chain's) compiled?"""
    devs = [self.devices[w] for w in self.chain] if devices is None else devices
    with self._movers_lock:
      return all(d in self._row_movers and (not self.spec.paged or d in self._page_movers)
                 for d in devs)

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
    # shutdown cancels the queued compiles before it returns: forget them, so that they are not
    # ready and a reused cache (reopen, prefetch) submits them again
    self._futures = {n: f for n, f in self._futures.items() if not f.cancelled()}


class StepCachePool:
  """Reuses StepCaches across runs whose EngineSpec, devices, release chain and parameter shapes
  are the same (static and flexfloor differ in expert slots per worker, so each gets its own).
  Pass it to `runner.run(..., step_cache=pool)`: the runner asks it for the StepCache of its
  spec (`get`), so a cache is only ever shared between identical specs."""

  def __init__(self):
    self._caches: dict = {}
    self.hits = self.misses = 0

  def _key(self, spec, devices, chain, rest_abs, exp_abs):
    def shapes(t):
      return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(t))

    return (spec, tuple(d.id for d in devices), tuple(chain), str(jax.tree.structure(rest_abs)),
            shapes(rest_abs), shapes(exp_abs))

  def get(self, spec: EngineSpec, devices, chain, rest_abs, exp_abs, **kw) -> StepCache:
    key = self._key(spec, devices, chain, rest_abs, exp_abs)
    c = self._caches.get(key)
    if c is None:
      self.misses += 1
      c = self._caches[key] = StepCache(spec, devices, chain, rest_abs, exp_abs, **kw)
    else:
      self.hits += 1
      c.reopen()  # the runner closes the caches it gets from a pool after each run
    return c
