"""Shared helpers for the engine tests (engine/test_ep.py, engine/test_engine.py): a tiny model,
the expert-parallel setup of one mesh (slot layout, expert -> slot table) and per-worker forward /
prefill / decode steps run inside `jax.shard_map` with `ep_moe`; compile counting; the small
rollout config that the elastic and output tests share (one set of compiled shapes)."""

from __future__ import annotations

import json
import logging
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.config.files import load_config
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.model.moe import EPConfig, ep_moe
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.runtime import mesh as mesh_lib

EP = mesh_lib.EP_AXIS
# The tiny preset with 2 layers (fp32): compiles in seconds on 2 cores.
TINY = PRESETS["tiny"].replace(num_layers=2, dtype="float32")
INIT_SCALE = 0.1  # large enough that logits are not flat


def make_params(cfg=TINY, seed: int = 0, scale: float = INIT_SCALE):
  return tfm.init_params(cfg, jax.random.key(seed), scale=scale)


class EPSetup:
  """One expert-parallel group over the first n devices: mesh, slot-layout experts, e2s."""

  def __init__(self, params, cfg, n: int, slots: int | None = None, *, tile_m: int = 8,
               chunk_tokens: int = 64, backend: str = "xla", interpret: bool = False):
    if len(jax.devices()) < n:  # e.g. one GPU (scripts/device_check.sh): report, do not fake
      import pytest
      pytest.skip(f"needs {n} devices, {jax.default_backend()} has {len(jax.devices())}")
    e = cfg.num_experts
    self.n, self.cfg = n, cfg
    self.slots = slots or math.ceil(e / n)
    self.mesh = mesh_lib.make_ep_mesh(jax.devices()[:n])
    self.placement = ExpertPlacement.initial(e, list(range(n)), self.slots)
    rest, experts = engine_lib.split_params(params)
    exp_sh = mesh_lib.named(self.mesh, engine_lib.expert_spec())
    self.rest = jax.device_put(rest, mesh_lib.tree_shardings(self.mesh, tfm.param_specs(rest)))
    self.experts = engine_lib.slot_layout(experts, self.placement.slot_expert(), exp_sh)
    self.e2s = jnp.asarray(self.placement.expert_to_slot(list(range(n))), jnp.int32)
    self.ep = EPConfig(num_workers=n, slots_per_worker=self.slots, top_k=cfg.top_k,
                       tile_m=tile_m, chunk_tokens=chunk_tokens, backend=backend,
                       interpret=interpret)

  def moe_fn(self):
    e2s, ep, e = self.e2s, self.ep, self.cfg.num_experts
    return lambda x, lp, valid: ep_moe(x, lp, valid, e2s, ep, e)

  def specs(self):
    """The engine's layout (tfm.param_specs): replicated non-expert params, expert slots over
    the workers."""
    return tfm.param_specs(self.rest), tfm.param_specs(self.experts)

  def shard(self, x, spec=None):
    """Onto the mesh as `spec` says; by default rows over the workers (mesh_lib.batch_spec)."""
    spec = spec if spec is not None else mesh_lib.batch_spec(np.ndim(x))
    return jax.device_put(x, mesh_lib.named(self.mesh, spec))

  # -- full-sequence forward (test 1)
  def forward_fn(self):
    cfg, moe_fn = self.cfg, self.moe_fn()

    def local(rest, experts, tokens, valid):
      params = engine_lib.merge_params(rest, experts)
      logits, aux = tfm.forward(params, cfg, tokens, valid_BT=valid, moe_fn=moe_fn)
      return logits, aux["expert_counts"]

    rs, es = self.specs()
    rows, rep = mesh_lib.batch_spec(1), mesh_lib.replicated_spec()  # rows: leading dim, any rank
    fn = jax.shard_map(local, mesh=self.mesh, in_specs=(rs, es, rows, rows),
                       out_specs=(rows, rep), check_vma=False)
    return jax.jit(fn)

  # -- prefill / decode with logits (test 2)
  def step_fns(self):
    """(prefill, decode) jitted over the mesh. Per worker:
    prefill(tokens [B, T], lengths [B]) -> (last logits [B, V], cache, counts [L, E]);
    decode(cache, tokens [B], positions [B], valid [B]) -> (logits [B, V], cache, counts)."""
    cfg, moe_fn = self.cfg, self.moe_fn()
    rs, es = self.specs()
    cspec = engine_lib.cache_spec()
    rows, rep = mesh_lib.batch_spec(1), mesh_lib.replicated_spec()  # rows: leading dim, any rank

    def pre_local(rest, experts, ck, cv, tokens, lengths):
      params = engine_lib.merge_params(rest, experts)
      logits, k, v, aux = tfm.prefill(params, cfg, tokens, lengths, moe_fn=moe_fn)
      slots = jnp.where(lengths > 0, jnp.arange(tokens.shape[0]), -1)
      cache = tfm.insert(tfm.KVCache(ck, cv), k, v, slots)
      return logits, cache.k, cache.v, aux["expert_counts"]

    def dec_local(rest, experts, ck, cv, tokens, positions, valid):
      params = engine_lib.merge_params(rest, experts)
      logits, cache, aux = tfm.decode(params, cfg, tfm.KVCache(ck, cv), tokens, positions,
                                      valid, moe_fn=moe_fn)
      return logits, cache.k, cache.v, aux["expert_counts"]

    pre = jax.shard_map(pre_local, mesh=self.mesh,
                        in_specs=(rs, es, cspec, cspec, rows, rows),
                        out_specs=(rows, cspec, cspec, rep), check_vma=False)
    dec = jax.shard_map(dec_local, mesh=self.mesh,
                        in_specs=(rs, es, cspec, cspec, rows, rows, rows),
                        out_specs=(rows, cspec, cspec, rep), check_vma=False)
    return jax.jit(pre, donate_argnums=(2, 3)), jax.jit(dec, donate_argnums=(2, 3))

  def empty_cache(self, slots_per_worker: int, length: int):
    c = tfm.KVCache.zeros(self.cfg, self.n * slots_per_worker, length)
    return self.shard(c.k, engine_lib.cache_spec()), self.shard(c.v, engine_lib.cache_spec())


# ----------------------------------------------------------------------------- compile counting


class CompileCounter:
  """Counts compilations while active: jax's compile log messages ('Compiling ...',
  'Finished XLA compilation ...', with jax_log_compiles) and jax.monitoring's trace / lowering /
  backend-compile duration events (a persistent-cache hit still traces and lowers).

  ignore_existing_threads: count only what this thread and threads started while active compile,
  not threads an earlier test left running (background compiles of its other mesh sizes)."""

  EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def __init__(self, ignore_existing_threads: bool = False):
    self.messages: list[str] = []
    self.events: list[str] = []
    self._ignore_existing = ignore_existing_threads
    self._ignored: set[int] = set()
    self._handler = logging.Handler()
    self._handler.emit = self._emit
    self._handler.setLevel(logging.DEBUG)

  def _counted(self) -> bool:
    return threading.get_ident() not in self._ignored

  def _emit(self, record):
    msg = record.getMessage()
    if ("Compiling" in msg or "Finished XLA compilation" in msg) and self._counted():
      self.messages.append(msg.splitlines()[0][:200])

  def _listener(self, event, duration, **kw):
    if event in self.EVENTS and self._counted():
      self.events.append(event)

  def __enter__(self):
    if self._ignore_existing:
      self._ignored = {t.ident for t in threading.enumerate()} - {threading.get_ident()}
    self._old_flag = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    self._loggers = [logging.getLogger("jax")]  # child loggers propagate to it
    self._levels = [lg.level for lg in self._loggers]
    for lg in self._loggers:
      lg.addHandler(self._handler)
      lg.setLevel(logging.DEBUG)
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)
    for lg, lvl in zip(self._loggers, self._levels, strict=True):
      lg.removeHandler(self._handler)
      lg.setLevel(lvl)
    jax.config.update("jax_log_compiles", self._old_flag)
    return False

  @property
  def count(self) -> int:
    return len(self.messages) + len(self.events)


def family_model(preset: str):
  """(config, params) of a preset's tiny model for the engine's rollout tests: TINY for 'tiny',
  else the preset cut to 2 layers (its sliding layers among them kept)."""
  if preset == "tiny":
    return TINY, make_params()
  cfg = PRESETS[preset]
  cfg = cfg.replace(num_layers=2, sliding_layers=tuple(i for i in cfg.sliding_layers if i < 2))
  return cfg, tfm.init_params(cfg, jax.random.key(5), scale=0.1)


def rollout_config():
  """The tiny preset at the shapes engine/test_elastic.py compiles: 16 sequences, 32 new
  tokens."""
  c = load_config("mixtral", "tiny")
  c.rollout.num_prompts = 4
  c.rollout.samples_per_prompt = 4
  c.rollout.max_new_tokens = 32
  c.rollout.slots_per_worker = 2
  c.rollout.steps_per_dispatch = 4
  c.rollout.wait_compiles = True
  c.scheduler.release_sizes = ""  # every size: the release order is what the elastic tests check
  # The release mechanism under test (moves, migrations, compiles, identical responses): in
  # device-steps every free worker is released. Deciding in seconds is tests/policy's.
  c.scheduler.step_cost = "steps"
  c.model.max_seq_len = 96
  c.sampling.temperature = 1.0
  c.sampling.top_p = 0.9
  return c


def tailed_rollout_config():
  """rollout_config() with a long-tailed workload (median 12 of 32 new tokens): the same compiled
  shapes, and workers finish their own responses one by one, so the group shrinks in every step
  and released devices have finished responses to score (the library API's tests)."""
  c = rollout_config()
  c.workload.median = 12.0
  c.workload.sigma = 0.8
  return c


def rollout_spec(cfg, **changes) -> engine_lib.EngineSpec:
  """The EngineSpec that runner.run builds for rollout_config() with flexfloor on 8 devices
  (floor 1: 8 expert slots per worker), with `changes`: an engine a test builds by hand on it
  runs the executables the runner tests compiled (the same programs on the same meshes: found in
  the persistent compilation cache) instead of compiling its own."""
  import dataclasses

  from flexfloor_jax.config import settings
  from flexfloor_jax.rollout import runner
  st = settings.load(rollout_config())
  prep = runner.prepare(st, devices=jax.devices()[:8], model_cfg=cfg)
  return dataclasses.replace(runner.engine_spec(st, prep), **changes)


def long_tailed_lengths(c, path):
  """A lengths file with a long tail within max_new_tokens (the default workload's median of 64
  would cap every response at rollout_config's 32 tokens): one straggler at the cap, the rest
  short and varied, so the group shrinks all the way to the floor."""
  rng = np.random.default_rng(7)
  with open(path, "w") as f:
    for i in range(c.rollout.num_prompts):
      base = rng.integers(3, c.rollout.max_new_tokens // 2)
      for j in range(c.rollout.samples_per_prompt):
        n = int(np.clip(base + rng.integers(-2, 3), 1, c.rollout.max_new_tokens))
        if i == 0 and j == 0:
          n = c.rollout.max_new_tokens
        f.write(json.dumps({"id": f"builtin-{i}", "sample": j, "length": n}) + "\n")
  return str(path)
