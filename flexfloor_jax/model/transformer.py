"""Mixtral decoder as pure functions over a params pytree.

Computes what Hugging Face `MixtralForCausalLM` computes: RMSNorm, rotate-half RoPE, GQA with an
explicit head_dim and optional sliding window, top-k router with a softmax over the selected
logits, SwiGLU experts, untied lm_head.

Params are a nested dict (layers stacked on a leading axis and run with `lax.scan`):
  embed [V, D]; final_norm [D]; lm_head [D, V]
  layers: attn_norm [L, D]; wq [L, D, H*hd]; wk, wv [L, D, K*hd]; wo [L, H*hd, D]
          mlp_norm [L, D]; router [L, D, E]; w1, w3 [L, E, D, F]; w2 [L, E, F, D]
Expert weights may instead be in the expert-parallel *slot* layout [L, N*S, ...] (see moe.py);
the MoE function passed in (`moe_fn`) decides how they are read. `PARAM_AXES` names every leaf's
logical axes (runtime/mesh.py maps them to mesh axes: `param_specs`); `EXPERT_KEYS` are the expert
stacks.

The forward functions are written for one worker's local batch: under expert parallelism they run
inside `shard_map` and only `moe_fn` communicates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, overload

import flax.struct
import jax
import jax.numpy as jnp

from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.runtime import mesh as mesh_lib

Params = dict[str, Any]
# moe_fn(x_TD, layer_params, valid_T) -> (y_TD, aux); aux is a dict of per-layer arrays.
MoEFn = Callable[[jax.Array, Params, jax.Array], tuple[jax.Array, dict]]

_NEG_INF = -1e30


EXPERT_KEYS = ("w1", "w3", "w2")  # the expert stacks of `layers`, in (gate, up, down) order

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
}


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
  if not whole_experts:
    return jax.lax.scan(lambda c, xs: fn(c, *xs), carry, (layers, *extra_xs))
  experts = {k: layers[k] for k in EXPERT_KEYS if k in layers}
  rest = {k: v for k, v in layers.items() if k not in experts}
  n = jax.tree.leaves(rest)[0].shape[0]

  def body(c, xs):
    lp, li = xs[0], xs[1]
    return fn(c, {**lp, **experts, "layer": li}, *xs[2:])

  return jax.lax.scan(body, carry, (rest, jnp.arange(n, dtype=jnp.int32), *extra_xs))


def layer_experts(lp: Params):
  """(w1, w3, w2) of this layer: indexed from the whole stacks that scan_layers passes, or as
  given when the caller passes one layer's weights (no 'layer' key)."""
  if "layer" not in lp:
    return tuple(lp[k] for k in EXPERT_KEYS)
  return tuple(lp[k][lp["layer"]] for k in EXPERT_KEYS)


def dtype_of(cfg: ModelConfig):
  return jnp.dtype(cfg.dtype)


# ----------------------------------------------------------------------------- init


def _layer_shapes(cfg: ModelConfig) -> dict:
  d, f, e, h, k, hd, nl = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts,
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)
  return {
      "attn_norm": (nl, d), "wq": (nl, d, h * hd), "wk": (nl, d, k * hd), "wv": (nl, d, k * hd),
      "wo": (nl, h * hd, d), "mlp_norm": (nl, d), "router": (nl, d, e), "w1": (nl, e, d, f),
      "w3": (nl, e, d, f), "w2": (nl, e, f, d),
  }


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


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotate-half RoPE (the Hugging Face layout: q/k need no permutation)."""
  hd = x_BTNH.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x_BTNH.dtype), jnp.sin(emb).astype(x_BTNH.dtype)
  x1, x2 = x_BTNH[..., : hd // 2], x_BTNH[..., hd // 2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BTNH * cos + rotated * sin


def attention_mask(q_pos_BT: jax.Array, k_pos_BS: jax.Array, k_valid_BS: jax.Array,
                   sliding_window: int | None) -> jax.Array:
  """[B, T, S] bool: causal, valid keys only, and within the sliding window if any."""
  q = q_pos_BT[:, :, None]
  kp = k_pos_BS[:, None, :]
  mask = (kp <= q) & k_valid_BS[:, None, :]
  if sliding_window is not None:
    mask &= kp > q - sliding_window
  return mask


def attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
           mask_BTS: jax.Array) -> jax.Array:
  """GQA attention, softmax in fp32. Per-sequence math only: batch rows never mix."""
  b, t, h, hd = q_BTHD.shape
  kh = k_BSKD.shape[2]
  q = q_BTHD.reshape(b, t, kh, h // kh, hd)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKD).astype(jnp.float32) / math.sqrt(hd)
  scores = jnp.where(mask_BTS[:, None, None], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKD.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKD)
  return out.reshape(b, t, h * hd)


def route(x_TD: jax.Array, router_DE: jax.Array, top_k: int, replay_TK=None):
  """Top-k routing as HF Mixtral: softmax over all logits in fp32, top-k, renormalise.
  `replay_TK` (routing replay): use these experts instead of the top-k, weighted by the current
  router's probabilities of them, renormalised (equal to the top-k path when they coincide)."""
  logits_TE = (x_TD @ router_DE).astype(jnp.float32)
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  if replay_TK is None:
    weights_TK, experts_TK = jax.lax.top_k(probs_TE, top_k)
  else:
    experts_TK = replay_TK.astype(jnp.int32)
    weights_TK = jnp.take_along_axis(probs_TE, experts_TK, axis=-1)
  weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
  return logits_TE, weights_TK.astype(x_TD.dtype), experts_TK.astype(jnp.int32)


def expert_ffn(x_TD: jax.Array, w1_DF: jax.Array, w3_DF: jax.Array, w2_FD: jax.Array) -> jax.Array:
  return (jax.nn.silu(x_TD @ w1_DF) * (x_TD @ w3_DF)) @ w2_FD


def moe_dense_reference(x_TD: jax.Array, lp: Params, valid_T: jax.Array, *, top_k: int):
  """Every expert on every token, weighted by the router: exact and simple, E times the work."""
  logits_TE, weights_TK, experts_TK = route(x_TD, lp["router"], top_k, lp.get("route"))
  e = lp["router"].shape[-1]
  y_ETD = jax.vmap(expert_ffn, in_axes=(None, 0, 0, 0))(x_TD, *layer_experts(lp))
  y_TKD = jnp.take_along_axis(jnp.moveaxis(y_ETD, 0, 1), experts_TK[:, :, None], axis=1)
  y_TD = jnp.zeros_like(x_TD, dtype=jnp.float32)
  for j in range(top_k):  # fixed k order
    y_TD = y_TD + weights_TK[:, j, None].astype(jnp.float32) * y_TKD[:, j].astype(jnp.float32)
  counts_E = jnp.sum(jax.nn.one_hot(experts_TK, e, dtype=jnp.int32) * valid_T[:, None, None],
                     axis=(0, 1))
  aux = {"router_logits": logits_TE, "experts": experts_TK, "expert_counts": counts_E}
  return y_TD.astype(x_TD.dtype), aux


def default_moe_fn(cfg: ModelConfig) -> MoEFn:
  return lambda x, lp, valid: moe_dense_reference(x, lp, valid, top_k=cfg.top_k)


def _qkv(cfg: ModelConfig, lp: Params, x_BTD: jax.Array, pos_BT: jax.Array):
  b, t, _ = x_BTD.shape
  h = rms_norm(x_BTD, lp["attn_norm"], cfg.rms_eps)
  q = (h @ lp["wq"]).reshape(b, t, cfg.num_heads, cfg.head_dim)
  k = (h @ lp["wk"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  v = (h @ lp["wv"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  return rope(q, pos_BT, cfg.rope_theta), rope(k, pos_BT, cfg.rope_theta), v


def _mlp(cfg: ModelConfig, lp: Params, x_BTD: jax.Array, valid_BT: jax.Array, moe_fn: MoEFn):
  b, t, d = x_BTD.shape
  h = rms_norm(x_BTD, lp["mlp_norm"], cfg.rms_eps)
  if "route" in lp:  # routing replay: this layer's recorded experts [B, T, K]
    lp = {**lp, "route": lp["route"].reshape(b * t, -1)}
  y, aux = moe_fn(h.reshape(b * t, d), lp, valid_BT.reshape(b * t))
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
  mask = attention_mask(pos_BT, pos_BT, valid_BT, cfg.sliding_window)
  x = params["embed"][tokens_BT]

  def layer(x, lp):
    q, k, v = _qkv(cfg, lp, x, pos_BT)
    x = x + attend(q, k, v, mask) @ lp["wo"]
    return _mlp(cfg, lp, x, valid_BT, moe_fn)

  layers = params["layers"] if route_LBTK is None else {**params["layers"], "route": route_LBTK}
  x, aux = scan_layers(layer, x, layers, whole_experts=False)
  logits = _logits(params, cfg, x)
  return (logits, aux, x) if return_hidden else (logits, aux)


@flax.struct.dataclass
class KVCache:
  """Per-slot KV cache: k, v [num_layers, B, S, K, hd]. Slot b's token at position p is at
  [:, b, p]."""
  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, length: int) -> KVCache:
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return cls(jnp.zeros(shape, dtype_of(cfg)), jnp.zeros(shape, dtype_of(cfg)))

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
  mask = attention_mask(pos_BT, pos_BT, valid_BT, cfg.sliding_window)
  x = params["embed"][tokens_BT]

  def layer(x, lp):
    q, k, v = _qkv(cfg, lp, x, pos_BT)
    x = x + attend(q, k, v, mask) @ lp["wo"]
    x, aux = _mlp(cfg, lp, x, valid_BT, moe_fn)
    return x, (k, v, aux)

  x, (k, v, aux) = scan_layers(layer, x, params["layers"])
  last = jnp.take_along_axis(x, jnp.maximum(lengths_B - 1, 0)[:, None, None], axis=1)[:, 0]
  return _logits(params, cfg, last), k, v, aux


def insert(cache: KVCache, k: jax.Array, v: jax.Array, slots_P: jax.Array) -> KVCache:
  """Write prefilled k/v [num_layers, P, T, K, hd] into cache slots (slot < 0: dropped)."""
  t = k.shape[2]
  b = cache.k.shape[1]
  slots = jnp.where(slots_P < 0, b, slots_P)  # out of range -> dropped by mode='drop'
  ck = cache.k.at[:, slots, :t].set(k, mode="drop")
  cv = cache.v.at[:, slots, :t].set(v, mode="drop")
  return KVCache(ck, cv)


def decode(params: Params, cfg: ModelConfig, cache: KVCache, tokens_B: jax.Array,
           positions_B: jax.Array, valid_B: jax.Array, *, moe_fn: MoEFn | None = None):
  """One decode step for every slot: token at `positions_B` attends to cache[:positions_B] and
  itself. Returns (logits [B, V] fp32, new cache, aux). Per-slot shapes are fixed by the cache
  length, so a slot's result does not depend on the other slots (batch invariance)."""
  moe_fn = moe_fn or default_moe_fn(cfg)
  b = tokens_B.shape[0]
  s = cache.length
  pos_B1 = positions_B[:, None]
  k_pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  mask = attention_mask(pos_B1, k_pos_BS, jnp.ones((b, s), bool), cfg.sliding_window)
  x = params["embed"][tokens_B][:, None]
  rows = jnp.arange(b)

  def layer(carry, lp):
    x, ck, cv = carry
    li = lp["layer"]
    q, k, v = _qkv(cfg, lp, x, pos_B1)
    ck = ck.at[li, rows, positions_B].set(k[:, 0])
    cv = cv.at[li, rows, positions_B].set(v[:, 0])
    x = x + attend(q, ck[li], cv[li], mask) @ lp["wo"]
    x, aux = _mlp(cfg, lp, x, valid_B[:, None], moe_fn)
    return (x, ck, cv), aux

  (x, ck, cv), aux = scan_layers(layer, (x, cache.k, cache.v), params["layers"])
  return _logits(params, cfg, x[:, 0]), KVCache(ck, cv), aux
