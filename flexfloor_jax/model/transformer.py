"""The MoE decoder as pure functions over a params pytree, assembled from the block choices of
the model config (model/config.py; a family's reader in model/families/ sets them).

Mixtral's blocks compute what Hugging Face `MixtralForCausalLM` computes: RMSNorm, rotate-half
RoPE, GQA with an explicit head_dim and optional sliding window, a router that takes the top-k of
a softmax over every expert and renormalises, SwiGLU experts, untied lm_head. Other choices:
per-head RMSNorm of q and k before RoPE (`qk_norm`), top-k weights left unnormalised
(`norm_topk_prob=False`), dense SwiGLU layers in place of the MoE (`dense_layers`); q/k/v/o
biases, a sink logit per head and sliding windows on some layers only (`attn_bias`,
`attn_sinks`, `sliding_layers`), a router with a bias that takes the top-k logits and a softmax
over them (`router='topk_softmax'`), experts with biases and the clamped SwiGLU
(`expert_act='clamped_swiglu'`), YaRN RoPE (`yarn_factor`); multi-head latent attention
(`kv_lora_rank` > 0, DeepSeek-V3: below), a sigmoid router with a correction bias, grouped top-k
and a scaling factor (`router='sigmoid_grouped'`), a shared expert every token runs
(`shared_intermediate_size`).

Params are a nested dict (layers stacked on a leading axis and run with `lax.scan`):
  embed [V, D]; final_norm [D]; lm_head [D, V]
  layers: attn_norm [L, D]; wq [L, D, H*hd]; wk, wv [L, D, K*hd]; wo [L, H*hd, D]
          mlp_norm [L, D]; router [L, D, E]; w1, w3 [L, E, D, F]; w2 [L, E, F, D]
          q_norm, k_norm [L, hd] (qk_norm only)
          bq [L, H*hd]; bk, bv [L, K*hd]; bo [L, D] (attn_bias); sinks [L, H] (attn_sinks)
          router_bias [L, E] (router_bias); b1, b3 [L, E, F]; b2 [L, E, D] (expert_bias)
          dense_w1, dense_w3 [Ld, D, Fd]; dense_w2 [Ld, Fd, D] (dense_layers only: one entry
          per dense layer, in layer order, passed whole to the layer scan and indexed by the
          layer's `dense_idx`; the MoE weights of a dense layer are never read)
          MLA (kv_lora_rank > 0) instead of wq/wk/wv: wq [L, D, H*(n+r)] or (q_lora_rank > 0)
          wq_a [L, D, Rq], q_a_norm [L, Rq], wq_b [L, Rq, H*(n+r)]; wkv_a [L, D, Rkv+r];
          kv_a_norm [L, Rkv]; wkv_b [L, Rkv, H*(n+v)]; wo [L, H*v, D] (n, r, v:
          qk_nope_head_dim, head_dim (the RoPE part), v_head_dim)
          router_correction [L, E] (router='sigmoid_grouped'); shared_w1, shared_w3 [L, D, Fs],
          shared_w2 [L, Fs, D] (shared_intermediate_size > 0)
Expert weights may instead be in the expert-parallel *slot* layout [L, N*S, ...] (see moe.py);
the MoE function passed in (`moe_fn`) decides how they are read.

Multi-head latent attention: q's heads are a nope part and a RoPE part (HF's `q_proj` or
`q_b_proj(q_a_layernorm(q_a_proj(x)))`); keys and values come from one latent per token,
`kv_a_layernorm` of the first kv_lora_rank outputs of `kv_a_proj_with_mqa`, and one RoPE key (its
last head_dim outputs, roped) shared by every head. The cache keeps the latent and the roped key
(KVCache.k and .v, one 'head' each): kv_lora_rank + head_dim values per token and layer. Prompt
passes expand the latent into every head's keys and values through `kv_b_proj` (as transformers
does); a decode step absorbs `kv_b_proj` into the query and the output instead (q_nope W_uk
scores the latent directly, the attention-weighted latent goes through W_uv), so it reads the
compact cache and never expands it: the same math in another order (fp32 agreement ~1e-6),
fixed shapes per row, as serving engines decode MLA. `PARAM_AXES` names every leaf's
logical axes (runtime/mesh.py maps them to mesh axes: `param_specs`); `EXPERT_KEYS` are the expert
stacks, `EXPERT_ARRAYS` those and their biases.

The forward functions are written for one worker's local batch: under expert parallelism they run
inside `shard_map` and only `moe_fn` communicates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, overload

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.runtime import mesh as mesh_lib

Params = dict[str, Any]
# moe_fn(x_TD, layer_params, valid_T) -> (y_TD, aux); aux is a dict of per-layer arrays.
MoEFn = Callable[[jax.Array, Params, jax.Array], tuple[jax.Array, dict]]

_NEG_INF = -1e30


EXPERT_KEYS = ("w1", "w3", "w2")  # the expert stacks of `layers`, in (gate, up, down) order
EXPERT_BIAS_KEYS = ("b1", "b3", "b2")  # their biases, where the model has them (expert_bias)
# Every array with an expert axis (which expert parallelism shards), in that order.
EXPERT_ARRAYS = EXPERT_KEYS + EXPERT_BIAS_KEYS

# Logical axes of every params leaf, by leaf name (the layout above). The router's last dim is
# every expert's logit, which each worker computes whole: not the sharded 'expert' axis.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("layer", "embed"),
    "wq": ("layer", "embed", "heads"),
    "wk": ("layer", "embed", "kv_heads"),
    "wv": ("layer", "embed", "kv_heads"),
    "wo": ("layer", "heads", "embed"),
    "mlp_norm": ("layer", "embed"),
    "router": ("layer", "embed", None),
    "w1": ("layer", "expert", "embed", "mlp"),
    "w3": ("layer", "expert", "embed", "mlp"),
    "w2": ("layer", "expert", "mlp", "embed"),
    "q_norm": ("layer", None),
    "k_norm": ("layer", None),
    "dense_w1": ("layer", "embed", "mlp"),
    "dense_w3": ("layer", "embed", "mlp"),
    "dense_w2": ("layer", "mlp", "embed"),
    "bq": ("layer", "heads"),
    "bk": ("layer", "kv_heads"),
    "bv": ("layer", "kv_heads"),
    "bo": ("layer", "embed"),
    "sinks": ("layer", None),
    "router_bias": ("layer", None),
    "b1": ("layer", "expert", "mlp"),
    "b3": ("layer", "expert", "mlp"),
    "b2": ("layer", "expert", "embed"),
    "wq_a": ("layer", "embed", None),
    "q_a_norm": ("layer", None),
    "wq_b": ("layer", None, "heads"),
    "wkv_a": ("layer", "embed", None),
    "kv_a_norm": ("layer", None),
    "wkv_b": ("layer", None, "heads"),
    "router_correction": ("layer", None),
    "shared_w1": ("layer", "embed", "mlp"),
    "shared_w3": ("layer", "embed", "mlp"),
    "shared_w2": ("layer", "mlp", "embed"),
}
# The dense layers' MLP stacks: one entry per dense layer, not per layer (a DeepSeek-V3 has 3
# dense layers of 61; a stack over every layer would replicate 58 unused dense MLPs).
DENSE_KEYS = ("dense_w1", "dense_w3", "dense_w2")


def param_logical_axes(params: Params) -> Params:
  """The logical axes of each leaf of `params` (or of any part of it: the engine's non-expert
  params, the expert stacks in canonical or slot layout), as a tree of the same structure.
  Leaves may be arrays or ShapeDtypeStructs; a leaf this model does not have is an error."""

  def axes(path, leaf):
    name = getattr(path[-1], "key", None)
    if name not in PARAM_AXES:
      raise KeyError(f"no logical axes for param {jax.tree_util.keystr(path)}")
    ax = PARAM_AXES[name]
    if len(ax) != len(leaf.shape):
      raise ValueError(f"param {jax.tree_util.keystr(path)} has shape {leaf.shape}, "
                       f"logical axes {ax}")
    return ax

  return jax.tree_util.tree_map_with_path(axes, params)


def param_specs(params: Params) -> Params:
  """PartitionSpecs of `params` (or of any part of it, canonical or slot layout) from their
  logical axes: expert stacks sharded on their expert axis, everything else replicated."""
  return mesh_lib.tree_specs(param_logical_axes(params))


def scan_layers(fn, carry, layers: Params, *extra_xs, whole_experts: bool = True):
  """lax.scan over the layers. whole_experts=True (prefill, decode) does not slice the expert
  weights: a scanned operand is copied layer by layer, which for expert slots would move every
  slot's weights on every step. The expert arrays are passed whole with the layer index
  ('layer'); moe_fn indexes them.

  whole_experts=False (the training forward) scans them like every other weight: under autodiff
  the whole stacks are loop-invariant operands of the scan, so every layer's backward would add
  a gradient of all layers' experts into the running total (L times the expert-gradient traffic
  of the layer's own slice)."""
  # the dense stacks have one entry per dense layer: passed whole, indexed by 'dense_idx'
  dense = {k: layers[k] for k in DENSE_KEYS if k in layers}
  if not whole_experts:
    rest = {k: v for k, v in layers.items() if k not in dense}
    return jax.lax.scan(lambda c, xs: fn(c, {**xs[0], **dense}, *xs[1:]), carry,
                        (rest, *extra_xs))
  experts = {k: layers[k] for k in EXPERT_ARRAYS + DENSE_KEYS if k in layers}
  rest = {k: v for k, v in layers.items() if k not in experts}
  n = jax.tree.leaves(rest)[0].shape[0]

  def body(c, xs):
    lp, li = xs[0], xs[1]
    return fn(c, {**lp, **experts, "layer": li}, *xs[2:])

  return jax.lax.scan(body, carry, (rest, jnp.arange(n, dtype=jnp.int32), *extra_xs))


def layer_experts(lp: Params):
  """(w1, w3, w2[, b1, b3, b2]) of this layer: indexed from the whole stacks that scan_layers
  passes, or as given when the caller passes one layer's weights (no 'layer' key)."""
  keys = [k for k in EXPERT_ARRAYS if k in lp]
  if "layer" not in lp:
    return tuple(lp[k] for k in keys)
  return tuple(lp[k][lp["layer"]] for k in keys)


def dtype_of(cfg: ModelConfig):
  return jnp.dtype(cfg.dtype)


# ----------------------------------------------------------------------------- init


def _layer_shapes(cfg: ModelConfig) -> dict:
  d, f, e, h, k, hd, nl = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts,
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)
  shapes = {
      "attn_norm": (nl, d), "wq": (nl, d, h * hd), "wk": (nl, d, k * hd), "wv": (nl, d, k * hd),
      "wo": (nl, h * hd, d), "mlp_norm": (nl, d), "router": (nl, d, e), "w1": (nl, e, d, f),
      "w3": (nl, e, d, f), "w2": (nl, e, f, d),
  }
  if cfg.mla:
    del shapes["wk"], shapes["wv"]
    n, v, rq, rkv = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    if rq:
      del shapes["wq"]
      shapes.update(wq_a=(nl, d, rq), q_a_norm=(nl, rq), wq_b=(nl, rq, h * (n + hd)))
    else:
      shapes["wq"] = (nl, d, h * (n + hd))
    shapes.update(wkv_a=(nl, d, rkv + hd), kv_a_norm=(nl, rkv), wkv_b=(nl, rkv, h * (n + v)),
                  wo=(nl, h * v, d))
  if cfg.router == "sigmoid_grouped":
    shapes.update(router_correction=(nl, e))
  if cfg.shared_intermediate_size:
    fs = cfg.shared_intermediate_size
    shapes.update(shared_w1=(nl, d, fs), shared_w3=(nl, d, fs), shared_w2=(nl, fs, d))
  if cfg.qk_norm:
    shapes.update(q_norm=(nl, hd), k_norm=(nl, hd))
  if cfg.dense_layers:
    fd, nd = cfg.dense_intermediate_size, len(cfg.dense_layers)
    shapes.update(dense_w1=(nd, d, fd), dense_w3=(nd, d, fd), dense_w2=(nd, fd, d))
  if cfg.attn_bias:
    shapes.update(bq=(nl, h * hd), bk=(nl, k * hd), bv=(nl, k * hd), bo=(nl, d))
  if cfg.attn_sinks:
    shapes.update(sinks=(nl, h))
  if cfg.router_bias:
    shapes.update(router_bias=(nl, e))
  if cfg.expert_bias:
    shapes.update(b1=(nl, e, f), b3=(nl, e, f), b2=(nl, e, d))
  return shapes


def param_shapes(cfg: ModelConfig) -> Params:
  """The params' shapes and dtypes from the config alone, without tracing (equal to
  `abstract_params`, tested): what the memory floor is computed from before any input check has
  passed."""
  dt = dtype_of(cfg)

  def s(shape):
    return jax.ShapeDtypeStruct(shape, dt)

  d, v = cfg.hidden_size, cfg.vocab_size
  return {"embed": s((v, d)), "layers": {k: s(v_) for k, v_ in _layer_shapes(cfg).items()},
          "final_norm": s((d,)), "lm_head": s((d, v))}


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
  """Seeded random init (normal(0, scale) matrices, ones for norms)."""
  d = cfg.hidden_size
  dt = dtype_of(cfg)
  shapes = _layer_shapes(cfg)
  keys = jax.random.split(key, len(shapes) + 2)
  layers = {}
  for i, (name, shape) in enumerate(sorted(shapes.items())):
    if name.endswith("norm"):
      layers[name] = jnp.ones(shape, dt)
    else:
      layers[name] = (scale * jax.random.normal(keys[i], shape, jnp.float32)).astype(dt)
  return {
      "embed": (scale * jax.random.normal(keys[-2], (cfg.vocab_size, d), jnp.float32)).astype(dt),
      "layers": layers,
      "final_norm": jnp.ones((d,), dt),
      "lm_head": (scale * jax.random.normal(keys[-1], (d, cfg.vocab_size), jnp.float32)).astype(dt),
  }


def abstract_params(cfg: ModelConfig) -> Params:
  """Shapes and dtypes of the params without allocating them (works for 8x7b / 8x22b)."""
  return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))


# ----------------------------------------------------------------------------- building blocks


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return w * y.astype(x.dtype)


def yarn_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """YaRN's inverse frequencies [hd/2] and the scale of cos and sin (the paper's mscale,
  0.1 ln(factor) + 1): dims that turn fewer than beta_slow times over the pre-training length
  are interpolated by the factor, more than beta_fast times kept, a linear ramp between."""
  hd, base, factor = cfg.head_dim, cfg.rope_theta, cfg.yarn_factor
  pos_freqs = np.float32(base) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))

  def dim_of(rotations):  # the dim that turns `rotations` times over the original length
    return hd * math.log(cfg.yarn_original_max_position / (rotations * 2 * math.pi)) / (
        2 * math.log(base))

  low, high = dim_of(cfg.yarn_beta_fast), dim_of(cfg.yarn_beta_slow)
  if cfg.yarn_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, hd - 1)
  high = high + 0.001 if low == high else high  # a zero-width ramp
  ramp = np.clip((np.arange(hd // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (the original frequency)
  inv_freq = (1 / (factor * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep
  if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:  # DeepSeek's pair of scales
    scale = yarn_mscale(factor, cfg.yarn_mscale) / yarn_mscale(factor, cfg.yarn_mscale_all_dim)
  else:
    scale = yarn_mscale(factor)
  return inv_freq.astype(np.float32), scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention scale 0.1 mscale ln(factor) + 1 (1 without scaling)."""
  return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float,
         yarn: tuple[np.ndarray, float] | None = None) -> jax.Array:
  """Rotate-half RoPE (the Hugging Face layout: q/k need no permutation). `yarn`: the inverse
  frequencies and cos/sin scale of YaRN scaling (yarn_frequencies) instead of theta's."""
  hd = x_BTNH.shape[-1]
  if yarn is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  else:
    inv_freq = jnp.asarray(yarn[0])
  freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  if yarn is not None:
    cos, sin = cos * yarn[1], sin * yarn[1]
  cos, sin = cos.astype(x_BTNH.dtype), sin.astype(x_BTNH.dtype)
  x1, x2 = x_BTNH[..., : hd // 2], x_BTNH[..., hd // 2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BTNH * cos + rotated * sin


def attention_mask(q_pos_BT: jax.Array, k_pos_BS: jax.Array, k_valid_BS: jax.Array,
                   sliding_window: int | jax.Array | None) -> jax.Array:
  """[B, T, S] bool: causal, valid keys only, and within the sliding window if any."""
  q = q_pos_BT[:, :, None]
  kp = k_pos_BS[:, None, :]
  mask = (kp <= q) & k_valid_BS[:, None, :]
  if sliding_window is not None:
    mask &= kp > q - sliding_window
  return mask


def attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
           mask_BTS: jax.Array, sinks_H: jax.Array | None = None) -> jax.Array:
  """GQA attention, softmax in fp32. Per-sequence math only: batch rows never mix. `sinks_H`:
  a logit per head that joins the softmax's denominator and attends to nothing (GPT-OSS)."""
  b, t, h, hd = q_BTHD.shape
  kh = k_BSKD.shape[2]
  q = q_BTHD.reshape(b, t, kh, h // kh, hd)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKD).astype(jnp.float32) / math.sqrt(hd)
  scores = jnp.where(mask_BTS[:, None, None], scores, _NEG_INF)
  if sinks_H is None:
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKD.dtype)
  else:
    # query head kv*g + j uses kv head kv: the sinks in the same (kv, group) order
    sink = sinks_H.astype(jnp.float32).reshape(1, kh, h // kh, 1, 1)
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores - top)
    probs = (e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(v_BSKD.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKD)
  return out.reshape(b, t, h * hd)


@dataclasses.dataclass(frozen=True)
class MoEChoices:
  """The block choices the expert-parallel layer needs beside shapes (EPConfig carries them)."""
  norm_topk_prob: bool = True
  router: str = "softmax_topk"  # ModelConfig.router
  expert_act: str = "swiglu"  # ModelConfig.expert_act
  swiglu_limit: float = 7.0
  swiglu_alpha: float = 1.702
  n_group: int = 1  # router 'sigmoid_grouped' (ModelConfig.n_group, ...)
  topk_group: int = 1
  routed_scaling_factor: float = 1.0

  @classmethod
  def of(cls, cfg: ModelConfig) -> MoEChoices:
    return cls(norm_topk_prob=cfg.norm_topk_prob, router=cfg.router, expert_act=cfg.expert_act,
               swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
               n_group=cfg.n_group, topk_group=cfg.topk_group,
               routed_scaling_factor=cfg.routed_scaling_factor)


def route_layer(x_TD: jax.Array, lp: Params, top_k: int, choices: MoEChoices):
  """`route` with this layer's router weights, bias or correction bias and replayed experts
  (`lp['route']`) as the model's block choices say."""
  return route(x_TD, lp["router"], top_k, lp.get("route"), normalize=choices.norm_topk_prob,
               kind=choices.router, bias_E=lp.get("router_bias"),
               correction_E=lp.get("router_correction"), n_group=choices.n_group,
               topk_group=choices.topk_group, scaling=choices.routed_scaling_factor)


def _grouped_sigmoid_topk(scores_TE: jax.Array, choice_TE: jax.Array, top_k: int,
                          n_group: int, topk_group: int) -> jax.Array:
  """DeepSeek-V3's expert choice: each group of experts scored by the sum of its two best
  `choice_TE` values, the topk_group best groups kept, the top_k of `choice_TE` among their
  experts. Returns the experts [T, K]."""
  t, e = scores_TE.shape
  grouped = choice_TE.reshape(t, n_group, e // n_group)
  group_TG = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  _, groups_TK = jax.lax.top_k(group_TG, topk_group)
  keep_TG = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], groups_TK].set(True)
  keep_TE = jnp.repeat(keep_TG, e // n_group, axis=1)
  masked = jnp.where(keep_TE, choice_TE, -jnp.inf)
  return jax.lax.top_k(masked, top_k)[1]


def route(x_TD: jax.Array, router_DE: jax.Array, top_k: int, replay_TK=None, *,
          normalize: bool = True, kind: str = "softmax_topk", bias_E: jax.Array | None = None,
          correction_E: jax.Array | None = None, n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0):
  """Top-k routing. kind 'softmax_topk' (HF Mixtral, Qwen3-MoE): softmax over all logits in
  fp32, top-k, renormalised when `normalize` (Qwen3's norm_topk_prob). 'topk_softmax' (GPT-OSS):
  the logits (with `bias_E`) in the input's dtype, their top-k, a softmax over those k.
  'sigmoid_grouped' (DeepSeek-V3): fp32 logits, sigmoid scores; experts chosen by score +
  `correction_E` with grouped top-k (n_group, topk_group), weighted by their scores without the
  correction, normalised when `normalize` and multiplied by `scaling`.
  `replay_TK` (routing replay): use these experts instead of the top-k, weighted as the current
  router weighs them (equal to the top-k path when they coincide)."""
  if kind == "sigmoid_grouped":
    # the router in fp32 whatever the model's dtype, as transformers keeps it
    logits_TE = x_TD.astype(jnp.float32) @ router_DE.astype(jnp.float32)
    scores_TE = jax.nn.sigmoid(logits_TE)
    if replay_TK is None:
      choice_TE = scores_TE if correction_E is None else (
          scores_TE + correction_E.astype(jnp.float32))
      experts_TK = _grouped_sigmoid_topk(scores_TE, choice_TE, top_k, n_group, topk_group)
    else:
      experts_TK = replay_TK.astype(jnp.int32)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if normalize:
      weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    weights_TK = weights_TK * scaling
    return logits_TE, weights_TK.astype(x_TD.dtype), experts_TK.astype(jnp.int32)
  if kind == "topk_softmax":
    logits_TE = x_TD @ router_DE + (0 if bias_E is None else bias_E)
    if replay_TK is None:
      top_TK, experts_TK = jax.lax.top_k(logits_TE, top_k)
    else:
      experts_TK = replay_TK.astype(jnp.int32)
      top_TK = jnp.take_along_axis(logits_TE, experts_TK, axis=-1)
    weights_TK = jax.nn.softmax(top_TK, axis=-1)
    return logits_TE.astype(jnp.float32), weights_TK.astype(x_TD.dtype), experts_TK.astype(
        jnp.int32)
  logits_TE = (x_TD @ router_DE).astype(jnp.float32)
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  if replay_TK is None:
    weights_TK, experts_TK = jax.lax.top_k(probs_TE, top_k)
  else:
    experts_TK = replay_TK.astype(jnp.int32)
    weights_TK = jnp.take_along_axis(probs_TE, experts_TK, axis=-1)
  if normalize:
    weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
  return logits_TE, weights_TK.astype(x_TD.dtype), experts_TK.astype(jnp.int32)


def glu(h1: jax.Array, h3: jax.Array, choices: MoEChoices = MoEChoices()) -> jax.Array:
  """The experts' gated activation of gate h1 and up h3: SwiGLU, or GPT-OSS's clamped form."""
  if choices.expert_act == "swiglu":
    return jax.nn.silu(h1) * h3
  limit = choices.swiglu_limit
  gate = jnp.minimum(h1, limit)
  up = jnp.clip(h3, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(choices.swiglu_alpha * gate))


def expert_ffn(x_TD: jax.Array, w1_DF: jax.Array, w3_DF: jax.Array, w2_FD: jax.Array,
               *biases: jax.Array, choices: MoEChoices = MoEChoices()):
  """One expert on every row; `biases` (b1, b3, b2) where the experts have them."""
  if not biases:
    return glu(x_TD @ w1_DF, x_TD @ w3_DF, choices) @ w2_FD
  b1_F, b3_F, b2_D = biases
  return glu(x_TD @ w1_DF + b1_F, x_TD @ w3_DF + b3_F, choices) @ w2_FD + b2_D


def moe_dense_reference(x_TD: jax.Array, lp: Params, valid_T: jax.Array, *, top_k: int,
                        choices: MoEChoices = MoEChoices()):
  """Every expert on every token, weighted by the router: exact and simple, E times the work."""
  logits_TE, weights_TK, experts_TK = route_layer(x_TD, lp, top_k, choices)
  e = lp["router"].shape[-1]
  weights = layer_experts(lp)
  y_ETD = jax.vmap(lambda *w: expert_ffn(x_TD, *w, choices=choices))(*weights)
  y_TKD = jnp.take_along_axis(jnp.moveaxis(y_ETD, 0, 1), experts_TK[:, :, None], axis=1)
  y_TD = jnp.zeros_like(x_TD, dtype=jnp.float32)
  for j in range(top_k):  # fixed k order
    y_TD = y_TD + weights_TK[:, j, None].astype(jnp.float32) * y_TKD[:, j].astype(jnp.float32)
  counts_E = jnp.sum(jax.nn.one_hot(experts_TK, e, dtype=jnp.int32) * valid_T[:, None, None],
                     axis=(0, 1))
  aux = {"router_logits": logits_TE, "experts": experts_TK, "expert_counts": counts_E}
  return y_TD.astype(x_TD.dtype), aux


def default_moe_fn(cfg: ModelConfig) -> MoEFn:
  choices = MoEChoices.of(cfg)
  return lambda x, lp, valid: moe_dense_reference(x, lp, valid, top_k=cfg.top_k, choices=choices)


# transformers' q_a_layernorm and kv_a_layernorm take RMSNorm's default eps, not rms_norm_eps
MLA_NORM_EPS = 1e-6


def _mla_qkv(cfg: ModelConfig, lp: Params, h_BTD: jax.Array, pos_BT: jax.Array):
  """MLA's query [B, T, H, n + r] (nope part, then the roped part), latent [B, T, 1, Rkv] and
  roped key [B, T, 1, r]: what a token contributes to attention and to the cache."""
  b, t, _ = h_BTD.shape
  n, r, rkv = cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank
  if cfg.q_lora_rank:
    q = rms_norm(h_BTD @ lp["wq_a"], lp["q_a_norm"], MLA_NORM_EPS) @ lp["wq_b"]
  else:
    q = h_BTD @ lp["wq"]
  q = q.reshape(b, t, cfg.num_heads, n + r)
  kv = h_BTD @ lp["wkv_a"]
  latent = rms_norm(kv[..., :rkv], lp["kv_a_norm"], MLA_NORM_EPS)[:, :, None]
  k_pe = kv[..., None, rkv:]
  yarn = yarn_frequencies(cfg) if cfg.yarn_factor else None
  q = jnp.concatenate([q[..., :n], rope(q[..., n:], pos_BT, cfg.rope_theta, yarn)], axis=-1)
  return q, latent, rope(k_pe, pos_BT, cfg.rope_theta, yarn)


def mla_softmax_scale(cfg: ModelConfig) -> float:
  """1/sqrt(q/k head dim), times YaRN's mscale(factor, mscale_all_dim)^2 (transformers'
  yarn_apply_mscale)."""
  scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
  if cfg.yarn_factor and cfg.yarn_mscale_all_dim:
    scale *= yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
  return scale


def _mla_softmax(scores_BHTS: jax.Array, mask_BTS: jax.Array, dtype) -> jax.Array:
  scores = jnp.where(mask_BTS[:, None], scores_BHTS.astype(jnp.float32), _NEG_INF)
  return jax.nn.softmax(scores, axis=-1).astype(dtype)


def mla_attend_expanded(cfg: ModelConfig, lp: Params, q_BTHQ: jax.Array, latent_BS1R: jax.Array,
                        kpe_BS1r: jax.Array, mask_BTS: jax.Array) -> jax.Array:
  """MLA over a prompt: the latent expanded through kv_b_proj into every head's nope keys and
  values (transformers' order of operations). Returns [B, T, H*v]."""
  b, t, h, _ = q_BTHQ.shape
  n, v = cfg.qk_nope_head_dim, cfg.v_head_dim
  s = latent_BS1R.shape[1]
  kv_BSHX = (latent_BS1R[:, :, 0] @ lp["wkv_b"]).reshape(b, s, h, n + v)
  k_BSHQ = jnp.concatenate(
      [kv_BSHX[..., :n], jnp.broadcast_to(kpe_BS1r, (b, s, h, kpe_BS1r.shape[-1]))], axis=-1)
  scores = jnp.einsum("bthq,bshq->bhts", q_BTHQ, k_BSHQ) * mla_softmax_scale(cfg)
  probs = _mla_softmax(scores, mask_BTS, kv_BSHX.dtype)
  out = jnp.einsum("bhts,bshv->bthv", probs, kv_BSHX[..., n:])
  return out.reshape(b, t, h * v)


def mla_attend_absorbed(cfg: ModelConfig, lp: Params, q_BTHQ: jax.Array, latent_BS1R: jax.Array,
                        kpe_BS1r: jax.Array, mask_BTS: jax.Array) -> jax.Array:
  """MLA over the latent cache with kv_b_proj absorbed: q_nope W_uk is a query in latent space
  (scores = that . latent + q_pe . k_pe), and the probability-weighted latent goes through W_uv.
  Reads kv_lora_rank + r values per cached token instead of H x (n + r + v); the same scores and
  output as `mla_attend_expanded` up to rounding. Returns [B, T, H*v]."""
  b, t, h, _ = q_BTHQ.shape
  n, v, rkv = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
  w_RHX = lp["wkv_b"].reshape(rkv, h, n + v)
  q_lat = jnp.einsum("bthn,rhn->bthr", q_BTHQ[..., :n], w_RHX[..., :n])
  scores = (jnp.einsum("bthr,bsr->bhts", q_lat, latent_BS1R[:, :, 0])
            + jnp.einsum("bthp,bsp->bhts", q_BTHQ[..., n:], kpe_BS1r[:, :, 0]))
  probs = _mla_softmax(scores * mla_softmax_scale(cfg), mask_BTS, latent_BS1R.dtype)
  out_lat = jnp.einsum("bhts,bsr->bthr", probs, latent_BS1R[:, :, 0])
  out = jnp.einsum("bthr,rhv->bthv", out_lat, w_RHX[..., n:])
  return out.reshape(b, t, h * v)


def self_attend(cfg: ModelConfig, lp: Params, q, k, v, mask_BTS: jax.Array) -> jax.Array:
  """A prompt's attention over its own keys and values (_qkv's)."""
  if cfg.mla:
    return mla_attend_expanded(cfg, lp, q, k, v, mask_BTS)
  return attend(q, k, v, mask_BTS, _sinks(cfg, lp))


def cache_attend(cfg: ModelConfig, lp: Params, q, k_cache, v_cache, mask_BTS: jax.Array):
  """A decode token's attention over one layer's cache (MLA: the latent one, absorbed)."""
  if cfg.mla:
    return mla_attend_absorbed(cfg, lp, q, k_cache, v_cache, mask_BTS)
  return attend(q, k_cache, v_cache, mask_BTS, _sinks(cfg, lp))


def _qkv(cfg: ModelConfig, lp: Params, x_BTD: jax.Array, pos_BT: jax.Array):
  """(q, k, v) of the layer's tokens: GQA's [B, T, heads, hd]; MLA's query, latent and roped
  key (_mla_qkv), k and v being what the cache keeps."""
  b, t, _ = x_BTD.shape
  h = rms_norm(x_BTD, lp["attn_norm"], cfg.rms_eps)
  if cfg.mla:
    return _mla_qkv(cfg, lp, h, pos_BT)
  q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
  if cfg.attn_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
  k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  if cfg.qk_norm:  # per head, over the head dim, before RoPE (what the cache then holds)
    q = rms_norm(q, lp["q_norm"], cfg.rms_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_eps)
  yarn = yarn_frequencies(cfg) if cfg.yarn_factor else None
  return rope(q, pos_BT, cfg.rope_theta, yarn), rope(k, pos_BT, cfg.rope_theta, yarn), v


def _attn_out(cfg: ModelConfig, lp: Params, out_BTX: jax.Array) -> jax.Array:
  """The attention output's projection (with its bias where the model has one)."""
  y = out_BTX @ lp["wo"]
  return y + lp["bo"] if cfg.attn_bias else y


def _sinks(cfg: ModelConfig, lp: Params):
  return lp["sinks"] if cfg.attn_sinks else None


def _layer_mask(cfg: ModelConfig, q_pos, k_pos, k_valid):
  """lp -> the layer's [B, T, S] mask. One mask for every layer unless only some layers slide
  (sliding_layers): then both, and each layer picks by its flag."""
  if not cfg.sliding_layers:
    mask = attention_mask(q_pos, k_pos, k_valid, cfg.sliding_window)
    return lambda lp: mask
  full = attention_mask(q_pos, k_pos, k_valid, None)
  window = attention_mask(q_pos, k_pos, k_valid, cfg.sliding_window)
  return lambda lp: jnp.where(lp["is_sliding"], window, full)


# A window no position reaches: what a full-attention layer passes where windows are per layer.
NO_WINDOW = 2**30


def layer_window(cfg: ModelConfig, lp: Params):
  """The sliding window this layer reads: static (None or the model's) unless only some layers
  slide, then traced from the layer's flag (NO_WINDOW for a full-attention layer)."""
  if not cfg.sliding_layers or cfg.sliding_window is None:
    return cfg.sliding_window
  return jnp.where(lp["is_sliding"], cfg.sliding_window, NO_WINDOW)


def _layer_xs(params: Params, cfg: ModelConfig) -> Params:
  """The per-layer inputs of the layer scan: the layer weights, plus a flag per layer saying
  which MLP it runs (models with dense layers) and whether it slides (models where only some
  layers do)."""
  xs = params["layers"]
  for key, layers in (("is_dense", cfg.dense_layers), ("is_sliding", cfg.sliding_layers)):
    if layers:
      xs = {**xs, key: jnp.zeros((cfg.num_layers,), bool).at[jnp.asarray(layers)].set(True)}
  if cfg.dense_layers:  # each layer's entry in the dense stacks (0 for an MoE layer: unread)
    idx = np.zeros((cfg.num_layers,), np.int32)
    idx[list(cfg.dense_layers)] = np.arange(len(cfg.dense_layers), dtype=np.int32)
    xs = {**xs, "dense_idx": jnp.asarray(idx)}
  return xs


def _mlp(cfg: ModelConfig, lp: Params, x_BTD: jax.Array, valid_BT: jax.Array, moe_fn: MoEFn):
  b, t, d = x_BTD.shape
  h = rms_norm(x_BTD, lp["mlp_norm"], cfg.rms_eps)
  if "route" in lp:  # routing replay: this layer's recorded experts [B, T, K]
    lp = {**lp, "route": lp["route"].reshape(b * t, -1)}
  h_TD, valid_T = h.reshape(b * t, d), valid_BT.reshape(b * t)

  def moe(h_TD):
    y, aux = moe_fn(h_TD, lp, valid_T)
    if cfg.shared_intermediate_size:  # every token's shared expert, after the routed ones
      y = y + expert_ffn(h_TD, lp["shared_w1"], lp["shared_w3"], lp["shared_w2"])
    return y, aux

  if not cfg.dense_layers:
    y, aux = moe(h_TD)
  else:
    # One branch per layer, the same on every worker (the flag is the layer's), so the MoE's
    # exchanges run on all workers or on none. A dense layer routes nothing: its aux is zeros
    # of the MoE's shapes (no expert counted, expert 0 recorded for routing replay, unused).
    def dense(h_TD):
      i = lp["dense_idx"]
      y = expert_ffn(h_TD, lp["dense_w1"][i], lp["dense_w3"][i], lp["dense_w2"][i])
      e = lp["router"].shape[-1]
      return y, {"router_logits": jnp.zeros((b * t, e), jnp.float32),
                 "experts": jnp.zeros((b * t, cfg.top_k), jnp.int32),
                 "expert_counts": jnp.zeros((e,), jnp.int32)}

    y, aux = jax.lax.cond(lp["is_dense"], dense, moe, h_TD)
  return x_BTD + y.reshape(b, t, d), aux


def _logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
  return (rms_norm(x, params["final_norm"], cfg.rms_eps) @ params["lm_head"]).astype(jnp.float32)


# ----------------------------------------------------------------------------- entry points


@overload
def forward(params: Params, cfg: ModelConfig, tokens_BT: jax.Array, *,
            valid_BT: jax.Array | None = None, moe_fn: MoEFn | None = None,
            return_hidden: Literal[False] = False,
            route_LBTK: jax.Array | None = None) -> tuple[jax.Array, dict]: ...


@overload
def forward(params: Params, cfg: ModelConfig, tokens_BT: jax.Array, *,
            valid_BT: jax.Array | None = None, moe_fn: MoEFn | None = None,
            return_hidden: Literal[True],
            route_LBTK: jax.Array | None = None) -> tuple[jax.Array, dict, jax.Array]: ...


def forward(params: Params, cfg: ModelConfig, tokens_BT: jax.Array, *,
            valid_BT: jax.Array | None = None, moe_fn: MoEFn | None = None,
            return_hidden: bool = False, route_LBTK: jax.Array | None = None
            ) -> tuple[jax.Array, dict] | tuple[jax.Array, dict, jax.Array]:
  """Full-sequence causal logits [B, T, V] (fp32), no cache. Right padding: pass valid_BT.
  `route_LBTK`: routing replay, the experts each layer must use for each token."""
  moe_fn = moe_fn or default_moe_fn(cfg)
  b, t = tokens_BT.shape
  if valid_BT is None:
    valid_BT = jnp.ones((b, t), bool)
  pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  mask = _layer_mask(cfg, pos_BT, pos_BT, valid_BT)
  x = params["embed"][tokens_BT]

  def layer(x, lp):
    q, k, v = _qkv(cfg, lp, x, pos_BT)
    x = x + _attn_out(cfg, lp, self_attend(cfg, lp, q, k, v, mask(lp)))
    return _mlp(cfg, lp, x, valid_BT, moe_fn)

  layers = _layer_xs(params, cfg)
  if route_LBTK is not None:
    layers = {**layers, "route": route_LBTK}
  x, aux = scan_layers(layer, x, layers, whole_experts=False)
  logits = _logits(params, cfg, x)
  return (logits, aux, x) if return_hidden else (logits, aux)


# ----------------------------------------------------------------------------- KV cache layout


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """Which layers a KV cache keeps whole and which as a ring (`kv_layout`).

  A sliding layer reads only the last `window` positions, so where its window is shorter than the
  cache it keeps only those: a ring of `ring_len` positions per sequence row, position t at
  t % ring_len, each write replacing a position that has left the window. Every other layer
  keeps every position. Why a ring: it holds exactly what the layer reads, in a shape fixed per
  row as the full cache's is (the decode stays batch-invariant), with no page bookkeeping. A paged
  pool keeps the rings the same way beside its pages, one per sequence row, and its pages hold
  only the full layers: a page shared by every layer could not be given back while a full layer
  still reads it, so sliding layers in pages would save nothing.

  `ring_len` is window + chunk - 1, `chunk` being the most query rows of one sequence a decode
  step carries (prompt tokens fed as query rows, `decode`'s rows_B). Every row of a step writes
  before any row reads, so the row at position p must still find p - window + 1 .. p after the
  step's later rows (up to p + chunk - 1) have written: window + chunk - 1 distinct slots. The
  later rows land in slots that held positions older than p's window, which the mask (the
  window, not the ring) hides. chunk = 1 (one token per sequence a step): a ring of the window."""
  full_layers: tuple[int, ...]
  ring_layers: tuple[int, ...]
  ring_len: int  # positions a ring layer keeps (0 without ring layers)


def kv_layout(cfg: ModelConfig, max_len: int, ring: bool = True, chunk: int = 1) -> KVLayout:
  """The layout of a cache of `max_len` positions for steps of at most `chunk` query rows per
  sequence: the sliding layers as rings of window + chunk - 1 positions where that is shorter
  than max_len (and `ring`), else every layer whole."""
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1 query rows per sequence, got {chunk}")
  w = cfg.sliding_window
  every = tuple(range(cfg.num_layers))
  if not ring or not w or w + chunk - 1 >= max_len:
    return KVLayout(every, (), 0)
  rings = tuple(i for i in every if cfg.window_of(i) is not None)
  return KVLayout(tuple(i for i in every if i not in rings), rings, int(w) + chunk - 1)


def _check_ring(cfg: ModelConfig, ring_layers: tuple[int, ...], ring_len: int):
  """A ring must hold at least the window its layer reads (the mask then keeps the window). What
  it holds beyond the window bounds the query rows of one sequence a step may carry (KVLayout),
  which the rows' traced values cannot be checked against here."""
  for i in ring_layers:
    w = cfg.window_of(i)
    if w is None or ring_len < w:
      raise ValueError(f"layer {i}: a ring of {ring_len} positions for a layer that reads "
                       f"{'every position' if w is None else f'{w} positions'}")


def _kv_xs(xs: Params, num_layers: int, ring_layers: tuple[int, ...]) -> Params:
  """The layer scan's inputs plus, for a cache with rings, each layer's kind (is_ring) and its
  index in the full-layer arrays (full_idx) or in the rings (ring_idx); the other index is out
  of range, so a write through it is dropped."""
  ring = np.zeros((num_layers,), bool)
  ring[list(ring_layers)] = True
  full_idx = np.where(ring, int((~ring).sum()), np.cumsum(~ring) - 1).astype(np.int32)
  ring_idx = np.where(ring, np.cumsum(ring) - 1, len(ring_layers)).astype(np.int32)
  return {**xs, "is_ring": jnp.asarray(ring), "full_idx": jnp.asarray(full_idx),
          "ring_idx": jnp.asarray(ring_idx)}


def split_layers(num_layers: int, ring_layers: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """(full layers, ring layers) as index arrays into a stack of every layer."""
  ring = np.asarray(ring_layers, np.int32)
  return np.setdiff1d(np.arange(num_layers, dtype=np.int32), ring), ring


def ring_window(cfg: ModelConfig, k_BRKD: jax.Array, v_BRKD: jax.Array, positions_B: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A ring's keys and values of the window each query reads, oldest position first ([B, W, K,
  hd] each, W = the window), and their mask [B, 1, W] (positions before the sequence's start
  hold nothing). Attending over these instead of the whole ring makes a row's result independent
  of the ring's length and of where in it the window wraps: rings sized for more query rows a
  step (chunked prefill, drafted tokens) give bitwise the logits of rings of the window."""
  assert cfg.sliding_window, "a ring holds a sliding layer's window"
  w = int(cfg.sliding_window)
  r = k_BRKD.shape[1]
  pos_BW = positions_B[:, None] - (w - 1) + jnp.arange(w, dtype=positions_B.dtype)
  slot_BW = pos_BW % r
  rows_B1 = jnp.arange(k_BRKD.shape[0])[:, None]
  return k_BRKD[rows_B1, slot_BW], v_BRKD[rows_B1, slot_BW], (pos_BW >= 0)[:, None, :]


def insert_ring(k_ring: jax.Array, v_ring: jax.Array, k: jax.Array, v: jax.Array,
                rows_P: jax.Array, lengths_P: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Write the ring layers' prefilled k/v [n_ring, P, T, K, hd] into rings [n_ring, B, R, K, hd]:
  the last R positions of each prompt (t < lengths_P[p], t >= lengths_P[p] - R) at t % R, so no
  two writes share a slot; a row < 0 writes nothing."""
  b, r = k_ring.shape[1:3]
  p, t = k.shape[1:3]
  pos_PT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
  n_P1 = lengths_P[:, None]
  slot_PT = jnp.where((pos_PT < n_P1) & (pos_PT >= n_P1 - r), pos_PT % r, r)  # r: dropped
  rows_PT = jnp.broadcast_to(jnp.where(rows_P < 0, b, rows_P)[:, None], (p, t))
  return (k_ring.at[:, rows_PT, slot_PT].set(k, mode="drop"),
          v_ring.at[:, rows_PT, slot_PT].set(v, mode="drop"))


def write_ring(k_ring: jax.Array, v_ring: jax.Array, ring_idx: jax.Array, rows_B: jax.Array,
               positions_B: jax.Array, k_B1KD: jax.Array, v_B1KD: jax.Array):
  """One decode token per row into ring `ring_idx` (out of range: a full layer, dropped) at its
  position's slot; a row out of range (a paged dead row) writes nothing."""
  slot_B = positions_B % k_ring.shape[2]
  return (k_ring.at[ring_idx, rows_B, slot_B].set(k_B1KD[:, 0], mode="drop"),
          v_ring.at[ring_idx, rows_B, slot_B].set(v_B1KD[:, 0], mode="drop"))


def by_layer_kind(lp: Params, has_full: bool, full_fn, ring_fn):
  """The layer's attention through its own store: a cond on the layer's kind where the cache
  has both (one branch runs: a full layer reads no ring, a ring layer no full cache)."""
  if not has_full:
    return ring_fn()
  return jax.lax.cond(lp["is_ring"], ring_fn, full_fn)


@flax.struct.dataclass
class KVCache:
  """Per-slot KV cache. k, v [num full layers, B, S, K, hd]: slot b's token at position p is at
  [:, b, p]. MLA (ModelConfig.kv_dims): k the latent [.., 1, kv_lora_rank], v the roped key
  [.., 1, qk_rope_head_dim]. k_ring, v_ring [num ring layers, B, R, K, hd] (or None): the
  sliding layers of `ring_layers` keep position p at [:, b, p % R] (KVLayout). Without rings
  k, v hold every layer."""
  k: jax.Array
  v: jax.Array
  k_ring: jax.Array | None = None
  v_ring: jax.Array | None = None
  ring_layers: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, length: int, ring: bool = True,
            chunk: int = 1) -> KVCache:
    """A cache of `length` positions per slot in kv_layout(cfg, length, ring, chunk): `chunk`
    is the most query rows of one sequence a decode step will carry."""
    lay = kv_layout(cfg, length, ring, chunk)
    dt = dtype_of(cfg)
    heads, kd, vd = cfg.kv_dims()  # MLA: the latent in k, the RoPE key in v
    shape = (len(lay.full_layers), batch, length, heads, kd)
    if not lay.ring_layers:
      return cls(jnp.zeros(shape, dt), jnp.zeros(shape[:-1] + (vd,), dt))
    rshape = (len(lay.ring_layers), batch, lay.ring_len, cfg.num_kv_heads, cfg.head_dim)
    return cls(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros(rshape, dt),
               jnp.zeros(rshape, dt), ring_layers=lay.ring_layers)

  @property
  def length(self) -> int:
    return self.k.shape[2]


def prefill(params: Params, cfg: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array, *,
            moe_fn: MoEFn | None = None):
  """Prompt pass for right-padded prompts. Returns (last-token logits [B, V], k, v
  [num_layers, B, T, K, hd], aux). `insert` writes k/v into cache slots."""
  moe_fn = moe_fn or default_moe_fn(cfg)
  b, t = tokens_BT.shape
  pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  valid_BT = pos_BT < lengths_B[:, None]
  mask = _layer_mask(cfg, pos_BT, pos_BT, valid_BT)
  x = params["embed"][tokens_BT]

  def layer(x, lp):
    q, k, v = _qkv(cfg, lp, x, pos_BT)
    x = x + _attn_out(cfg, lp, self_attend(cfg, lp, q, k, v, mask(lp)))
    x, aux = _mlp(cfg, lp, x, valid_BT, moe_fn)
    return x, (k, v, aux)

  x, (k, v, aux) = scan_layers(layer, x, _layer_xs(params, cfg))
  last = jnp.take_along_axis(x, jnp.maximum(lengths_B - 1, 0)[:, None, None], axis=1)[:, 0]
  return _logits(params, cfg, last), k, v, aux


def insert(cache: KVCache, k: jax.Array, v: jax.Array, slots_P: jax.Array,
           lengths_P: jax.Array | None = None) -> KVCache:
  """Write prefilled k/v [num_layers, P, T, K, hd] into cache slots (slot < 0: dropped). A
  full layer takes all T positions (the padding past a prompt is masked, then overwritten); a
  ring layer only the last R of the prompt's lengths_P[p] positions, which a cache with rings
  therefore needs."""
  t = k.shape[2]
  b = cache.k.shape[1]
  slots = jnp.where(slots_P < 0, b, slots_P)  # out of range -> dropped by mode='drop'
  if cache.k_ring is None or cache.v_ring is None:
    ck = cache.k.at[:, slots, :t].set(k, mode="drop")
    cv = cache.v.at[:, slots, :t].set(v, mode="drop")
    return KVCache(ck, cv)
  if lengths_P is None:
    raise ValueError("insert into a cache with ring layers needs the prompts' lengths_P")
  full, ring = split_layers(k.shape[0], cache.ring_layers)
  ck, cv = cache.k, cache.v
  if full.size:
    ck = ck.at[:, slots, :t].set(k[full], mode="drop")
    cv = cv.at[:, slots, :t].set(v[full], mode="drop")
  rk, rv = insert_ring(cache.k_ring, cache.v_ring, k[ring], v[ring], slots_P, lengths_P)
  return KVCache(ck, cv, rk, rv, ring_layers=cache.ring_layers)


def query_rows(rows_B: jax.Array | None, ok_B: jax.Array, n_rows: int
               ) -> tuple[jax.Array, jax.Array | None]:
  """(write rows [Q], read rows [Q] or None) of a step's query rows over a cache of n_rows
  sequence rows. rows_B [Q]: the cache row each query row reads and writes; None: query row i
  is cache row i (Q must be n_rows; no gather, today's reads). A query row writes where `ok_B`
  and its row is in range; elsewhere its write row is n_rows, which mode='drop' drops (a
  negative row must not reach the scatter: it would index from the end). Its read row is
  clipped into range: what a row that writes nothing reads is never used."""
  q = ok_B.shape[0]
  if rows_B is None:
    if q != n_rows:
      raise ValueError(f"{q} query rows over a cache of {n_rows} rows need rows_B")
    return jnp.where(ok_B, jnp.arange(q, dtype=jnp.int32), n_rows), None
  rows_B = rows_B.astype(jnp.int32)
  ok_B = ok_B & (rows_B >= 0) & (rows_B < n_rows)
  return jnp.where(ok_B, rows_B, n_rows), jnp.clip(rows_B, 0, n_rows - 1)


def read_rows(x_BX: jax.Array, rows_Q: jax.Array | None) -> jax.Array:
  """The cache rows the query rows read ([Q, ...]); x_BX itself where query row i is row i."""
  return x_BX if rows_Q is None else x_BX[rows_Q]


def decode(params: Params, cfg: ModelConfig, cache: KVCache, tokens_B: jax.Array,
           positions_B: jax.Array, valid_B: jax.Array, *, moe_fn: MoEFn | None = None,
           rows_B: jax.Array | None = None):
  """One decode step of Q query rows: the token of query row i, at positions_B[i], is written
  into cache row rows_B[i] (None: row i) and attends to that row's positions <= its own (a ring
  layer: to the positions of its window the ring holds). Returns (logits [Q, V] fp32, new
  cache, aux).

  A query row is a decode token or a prompt token (chunked prefill): both are one token over
  its sequence's fixed-length cache row, one code path, so a prompt token's K/V and logits do
  not depend on the chunk or step it lands in. Several query rows may share a cache row
  (consecutive positions of one prompt): every layer writes all rows' K/V before any row
  reads, and the position mask keeps each to its own past. Rings hold window + chunk - 1
  positions for up to `chunk` rows of one sequence (KVLayout). A row that is not valid, or
  whose cache row or position is out of range, writes nothing (a dead slot must not overwrite a
  sequence being prefilled into its row); its logits are meaningless. Per-row shapes are fixed
  by the cache length and the ring length, so at a fixed Q a row's result does not depend on
  the other rows (batch invariance)."""
  moe_fn = moe_fn or default_moe_fn(cfg)
  q_n = tokens_B.shape[0]
  s = cache.length
  pos_B1 = positions_B[:, None]
  k_pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q_n, s))
  mask = _layer_mask(cfg, pos_B1, k_pos_BS, jnp.ones((q_n, s), bool))
  x = params["embed"][tokens_B][:, None]
  writes_B = valid_B & (positions_B >= 0) & (positions_B < s)
  w_rows, r_rows = query_rows(rows_B, writes_B, cache.k.shape[1])

  if cache.k_ring is None or cache.v_ring is None:
    def layer(carry, lp):
      x, ck, cv = carry
      li = lp["layer"]
      q, k, v = _qkv(cfg, lp, x, pos_B1)
      ck = ck.at[li, w_rows, positions_B].set(k[:, 0], mode="drop")
      cv = cv.at[li, w_rows, positions_B].set(v[:, 0], mode="drop")
      out = cache_attend(cfg, lp, q, read_rows(ck[li], r_rows), read_rows(cv[li], r_rows),
                         mask(lp))
      x = x + _attn_out(cfg, lp, out)
      x, aux = _mlp(cfg, lp, x, valid_B[:, None], moe_fn)
      return (x, ck, cv), aux

    (x, ck, cv), aux = scan_layers(layer, (x, cache.k, cache.v), _layer_xs(params, cfg))
    return _logits(params, cfg, x[:, 0]), KVCache(ck, cv), aux

  r = cache.k_ring.shape[2]
  _check_ring(cfg, cache.ring_layers, r)
  has_full = cache.k.shape[0] > 0

  def ring_attend(q, rk_BRKD, rv_BRKD, sinks):
    k, v, m = ring_window(cfg, rk_BRKD, rv_BRKD, positions_B)
    return attend(q, k, v, m, sinks)

  def ring_layer(carry, lp):
    x, ck, cv, rk, rv = carry
    fi, ri = lp["full_idx"], lp["ring_idx"]
    q, k, v = _qkv(cfg, lp, x, pos_B1)
    if has_full:
      ck = ck.at[fi, w_rows, positions_B].set(k[:, 0], mode="drop")
      cv = cv.at[fi, w_rows, positions_B].set(v[:, 0], mode="drop")
    rk, rv = write_ring(rk, rv, ri, w_rows, positions_B, k, v)
    sinks = _sinks(cfg, lp)
    out = by_layer_kind(
        lp, has_full,
        lambda: attend(q, read_rows(ck[fi], r_rows), read_rows(cv[fi], r_rows), mask(lp), sinks),
        lambda: ring_attend(q, read_rows(rk[ri], r_rows), read_rows(rv[ri], r_rows), sinks))
    x = x + _attn_out(cfg, lp, out)
    x, aux = _mlp(cfg, lp, x, valid_B[:, None], moe_fn)
    return (x, ck, cv, rk, rv), aux

  xs = _kv_xs(_layer_xs(params, cfg), cfg.num_layers, cache.ring_layers)
  (x, ck, cv, rk, rv), aux = scan_layers(
      ring_layer, (x, cache.k, cache.v, cache.k_ring, cache.v_ring), xs)
  return _logits(params, cfg, x[:, 0]), KVCache(ck, cv, rk, rv, cache.ring_layers), aux
