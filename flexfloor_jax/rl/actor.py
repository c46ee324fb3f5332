"""The training forward on the full `ep` mesh: per-token log-probs of rollout tokens and the GRPO
update step, as jitted pure functions of the params pytree.

Layout: the batch is split over the workers (data-parallel attention), the experts over the same
axis (canonical [L, E, ...] weights sharded on E: with E % N == 0 worker w holds experts
w*S .. w*S+S-1, which is exactly the slot layout with the identity expert -> slot table), the
non-expert weights are replicated. The MoE is `moe.ep_moe`, the kernel path the rollout runs, so
the log-probs match the rollout's (temperature-scaled, no top-p / top-k truncation: what
sampling.sample_one records).

Gradients are taken inside `shard_map` of each worker's partial loss (its tokens' share of the
global token mean): replicated-weight gradients are psum'd over the axis; expert gradients arrive
complete through the transposed all_to_all. The load-balance aux loss is computed per worker on
its own tokens and averaged over workers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig, resolve_moe_backend
from flexfloor_jax.model.moe import EPConfig, ep_moe
from flexfloor_jax.rl import loss as loss_lib
from flexfloor_jax.runtime import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class ActorSpec:
  cfg: ModelConfig
  num_workers: int
  temperature: float = 1.0
  tile_m: int = 8  # expert GEMM row tile (numerics: the rollout's decode uses 8)
  chunk_tokens: int = 64
  clip_eps: float = 0.2
  kl_beta: float = 0.0
  aux_coef: float = 0.0
  moe_backend: str = "auto"  # 'auto' | 'xla' | 'pallas' (model.config.resolve_moe_backend)
  interpret: bool = False  # force Pallas interpret mode (the resolution picks it on CPU anyway)
  logprob_rows: int = 4  # rows per device of each log-prob call (fixed: part of the numerics)

  def ep(self) -> EPConfig:
    e = self.cfg.num_experts
    if e % self.num_workers:
      raise ValueError(f"the training mesh needs num_experts ({e}) divisible by the number of "
                       f"devices ({self.num_workers})")
    impl, interpret = resolve_moe_backend(self.moe_backend, jax.default_backend())
    return EPConfig(num_workers=self.num_workers, slots_per_worker=e // self.num_workers,
                    top_k=self.cfg.top_k, tile_m=self.tile_m, chunk_tokens=self.chunk_tokens,
                    backend=impl, interpret=interpret or self.interpret,
                    choices=tfm.MoEChoices.of(self.cfg))


def shard_params(params, mesh):
  """Experts sharded on their expert axis, everything else replicated (tfm.param_specs)."""
  return jax.device_put(params, mesh_lib.tree_shardings(mesh, tfm.param_specs(params)))


def replicate(params, mesh):
  """Weight sync target: every weight replicated on the mesh (the engine re-lays experts out)."""
  return jax.device_put(params, mesh_lib.replicated(mesh))


def _local_logprobs(spec: ActorSpec, params, tokens_BT, valid_BT, route_BTLK=None):
  """[B, T-1] log-probs of tokens[:, 1:] under the temperature-scaled model; and the MoE aux.
  `route_BTLK`: routing replay (the rollout's experts of every token and layer)."""
  cfg, ep = spec.cfg, spec.ep()
  e2s = jnp.arange(cfg.num_experts, dtype=jnp.int32)

  def moe_fn(x, lp, valid):
    return ep_moe(x, lp, valid, e2s, ep, cfg.num_experts)

  route = None if route_BTLK is None else jnp.transpose(route_BTLK, (2, 0, 1, 3))
  logits, aux = tfm.forward(params, cfg, tokens_BT, valid_BT=valid_BT, moe_fn=moe_fn,
                            route_LBTK=route)
  t = 1.0 if spec.temperature == 0 else spec.temperature
  logp = jax.nn.log_softmax(logits[:, :-1] / t, axis=-1)
  return jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)[..., 0], aux


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  """x with zero rows appended up to `rows` (padding rows are invalid: valid=False)."""
  if len(x) < rows:
    return np.concatenate([x, np.zeros((rows - len(x),) + x.shape[1:], x.dtype)])
  return x


class Actor:
  """Compiled log-prob and update steps for one mesh and spec (`optimizer` None: log-probs
  only)."""

  def __init__(self, spec: ActorSpec, mesh, optimizer: optax.GradientTransformation | None):
    self.spec, self.mesh, self.optimizer = spec, mesh, optimizer
    self._logprob_fn = {}  # keyed by routing replay on/off
    self._update_fn = None

  # -- log-probs (no grad)
  def logprob_program(self, params, replay: bool):
    """The jitted per-micro-batch log-prob program: [N*r, T] rows in, [N*r, T-1] out (`params`:
    any tree of the params' structure)."""
    if self._logprob_fn.get(replay) is None:
      pspecs = tfm.param_specs(params)
      bs = (mesh_lib.batch_spec(2), mesh_lib.batch_spec(2)) + (
          (mesh_lib.batch_spec(4),) if replay else ())
      fn = jax.shard_map(lambda p, *b: _local_logprobs(self.spec, p, *b)[0], mesh=self.mesh,
                         in_specs=(pspecs, *bs), out_specs=mesh_lib.batch_spec(2), check_vma=False)
      self._logprob_fn[replay] = jax.jit(fn)
    return self._logprob_fn[replay]

  def logprobs(self, params, tokens_BT, valid_BT, route_BTLK=None) -> np.ndarray:
    """[B, T-1] log-probs (host), with `route_BTLK` the recorded routing replayed. Computed in
    micro-batches of spec.logprob_rows rows per device: every call has the same per-device
    shapes, so a row's log-probs do not depend on the rows around it or on the mesh size (the
    released workers of a rollout compute the same numbers: rl/reuse.py)."""
    fn = self.logprob_program(params, route_BTLK is not None)
    args = [np.asarray(a) for a in (tokens_BT, valid_BT, route_BTLK) if a is not None]
    b, step = args[0].shape[0], self.spec.num_workers * self.spec.logprob_rows
    out = []
    for i in range(0, b, step):
      chunk = [pad_rows(a[i:i + step], step) for a in args]
      out.append(fn(params, *map(self.shard_batch, chunk)))
    return np.concatenate([np.asarray(o) for o in out])[:b]

  def shard_batch(self, x):
    x = jnp.asarray(x)
    return jax.device_put(x, mesh_lib.named(self.mesh, mesh_lib.batch_spec(x.ndim)))

  # -- update
  def update(self, params, opt_state, batch, num_tokens):
    """One optimizer step. batch: tokens, valid, mask [B, T] / [B, T-1], old_logp, ref_logp
    [B, T-1], adv [B], optionally route [B, T, L, K] (routing replay); num_tokens = global count
    of response tokens. Returns (params, opt_state, metrics)."""
    if self._update_fn is None:
      self._update_fn = self._build_update(params, batch)
    batch = {k: self.shard_batch(v) for k, v in batch.items()}
    return self._update_fn(params, opt_state, batch, jnp.float32(num_tokens))

  def _build_update(self, params, batch):
    spec, axis = self.spec, mesh_lib.mesh_axis("batch")
    pspecs = tfm.param_specs(params)
    bspecs = {k: mesh_lib.batch_spec(np.ndim(v)) for k, v in batch.items()}

    def grads_local(p, b, n):
      def local_loss(p):
        logp, aux = _local_logprobs(spec, p, b["tokens"], b["valid"], b.get("route"))
        loss, m = loss_lib.grpo_token_mean(logp, b["old_logp"], b["ref_logp"], b["adv"][:, None],
                                           b["mask"], clip_eps=spec.clip_eps,
                                           kl_beta=spec.kl_beta, num_tokens=n)
        bb, t = b["tokens"].shape
        lb = loss_lib.load_balance_loss(aux["router_logits"], aux["experts"],
                                        b["valid"].reshape(bb * t), spec.cfg.num_experts)
        m["aux_loss"] = lb / spec.num_workers
        return loss + spec.aux_coef * m["aux_loss"], m

      (loss, m), g = jax.value_and_grad(local_loss, has_aux=True)(p)
      # Replicated weights: each worker's gradient covers its own tokens -> sum. Expert slots:
      # the backward all_to_all already brought every worker's cotangents home.
      g = jax.tree.map(lambda x, s: jax.lax.psum(x, axis) if mesh_lib.is_replicated(s) else x,
                       g, pspecs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
      m = jax.tree.map(lambda x: jax.lax.psum(x, axis), {**m, "loss": loss})
      return g, m

    rep = mesh_lib.replicated_spec()
    gfn = jax.shard_map(grads_local, mesh=self.mesh, in_specs=(pspecs, bspecs, rep),
                        out_specs=(pspecs, rep), check_vma=False)
    opt = self.optimizer
    assert opt is not None  # an actor that updates has an optimizer
    shardings = mesh_lib.tree_shardings(self.mesh, pspecs)

    def step(p, o, b, n):
      g, m = gfn(p, b, n)
      m["grad_norm"] = optax.global_norm(g)
      upd, o = opt.update(g, o, p)
      p = optax.apply_updates(p, upd)
      p = jax.lax.with_sharding_constraint(p, shardings)
      return p, o, m

    return jax.jit(step)  # no donation: the rollout copy and the reference may share buffers
