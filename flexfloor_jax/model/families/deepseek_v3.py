"""DeepSeek-V3 (`deepseek_v3`; DeepSeek-V3/R1, Kimi-K2, Moonlight).

Blocks: multi-head latent attention (q through a rank `q_lora_rank` projection with an RMSNorm,
or one dense `q_proj` when q_lora_rank is null as in Moonlight; keys and values from a latent of
`kv_lora_rank` values plus one RoPE key of `qk_rope_head_dim` values per token; heads of
`qk_nope_head_dim` + qk_rope_head_dim for q and k, `v_head_dim` for v), the cache holding the
latent and the RoPE key (model/transformer.py says how prompts and decode steps attend); a
sigmoid router whose `e_score_correction_bias` only chooses the experts, grouped top-k
(`n_group`, `topk_group`), weights normalised (`norm_topk_prob`) and multiplied by
`routed_scaling_factor`; `n_shared_experts` shared SwiGLU experts (one SwiGLU of n_shared_experts
x moe_intermediate_size) every token of an MoE layer runs, replicated like every non-expert
weight; the first `first_k_dense_replace` layers dense (`intermediate_size`); YaRN RoPE with
`mscale` / `mscale_all_dim`. `rope_interleave` (true in the published files): the RoPE
dimensions come in pairs (x0, x1), (x2, x3), ...; the q and k columns of those dimensions are
reordered on load (evens, then odds) so that the rotate-half RoPE computes the same rotation.

Safetensors layout (what transformers 5.x writes; the published files the same):
  model.layers.N.self_attn.q_a_proj.weight [Rq, D], q_a_layernorm.weight [Rq],
      q_b_proj.weight [H*(n+r), Rq]            (q_lora_rank set)
  model.layers.N.self_attn.q_proj.weight [H*(n+r), D]   (q_lora_rank null)
  model.layers.N.self_attn.kv_a_proj_with_mqa.weight [Rkv+r, D], kv_a_layernorm.weight [Rkv],
      kv_b_proj.weight [H*(n+v), Rkv], o_proj.weight [D, H*v]
  model.layers.N.mlp.{gate,up,down}_proj.weight        (dense layers)
  model.layers.N.mlp.gate.weight [E, D], gate.e_score_correction_bias [E]
  model.layers.N.mlp.experts.J.{gate,up,down}_proj.weight (or fused gate_up_proj / down_proj)
  model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight
Layers N >= num_hidden_layers up to num_nextn_predict_layers more are multi-token prediction
modules: skipped on load with one log line (RL frameworks run without them).
Published V3/R1 and Kimi-K2 weights are float8 e4m3 with one float32 `weight_scale_inv` per
128 x 128 block (`quantization_config.quant_method` 'fp8'): dequantized on load into the run's
dtype (base.dequantize_fp8_block). Any other quantization is refused in one line naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.model.families import base


def config_from_hf(c: base.HFConfig) -> ModelConfig:
  quant = c.hf.get("quantization_config")
  if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
    _check_fp8(c)
  if not c.flag("rope_interleave", True):
    raise c.error("field 'rope_interleave' is false; only the published interleaved RoPE "
                  "layout is supported")
  common = base.common_fields(c, yarn=True, quantized=("fp8",), mscale=True)
  layers, heads = common["num_layers"], common["num_heads"]
  kv_heads = c.integer("num_key_value_heads", None)
  if kv_heads is not None and kv_heads != heads:
    raise c.error(f"field 'num_key_value_heads' is {kv_heads}; multi-head latent attention "
                  f"expands the latent into every one of the {heads} heads "
                  "(num_attention_heads)")
  if c.flag("attention_bias", False):
    raise c.error("field 'attention_bias' is true; DeepSeek-V3 attention without biases only")
  scoring = c.get("scoring_func", "sigmoid")
  if scoring != "sigmoid":
    raise c.error(f"field 'scoring_func' is {scoring!r}; only 'sigmoid' routing is supported")
  method = c.get("topk_method", "noaux_tc")
  if method != "noaux_tc":
    raise c.error(f"field 'topk_method' is {method!r}; only 'noaux_tc' (grouped top-k with the "
                  "correction bias) is supported")
  freq = c.integer("moe_layer_freq", 1)
  if freq != 1:
    raise c.error(f"field 'moe_layer_freq' is {freq!r}; only 1 (every layer after the dense "
                  "ones is MoE) is supported")
  first_dense = c.integer("first_k_dense_replace", 0) or 0
  if not 0 <= first_dense <= layers:
    raise c.error(f"field 'first_k_dense_replace' must be in [0, {layers}] (num_hidden_layers), "
                  f"got {first_dense}")
  shared = c.integer("n_shared_experts", 0) or 0
  if shared < 0:
    raise c.error(f"field 'n_shared_experts' must be >= 0, got {shared}")
  for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
    v = c.integer(name)
    if v is None or v < 1:
      raise c.error(f"field '{name}' must be >= 1, got {v!r}")
  q_lora = c.integer("q_lora_rank", None)
  if q_lora is not None and q_lora < 1:
    raise c.error(f"field 'q_lora_rank' must be >= 1 or null, got {q_lora}")
  experts = c.integer("n_routed_experts")
  n_group = c.integer("n_group", 1) or 1
  topk_group = c.integer("topk_group", 1) or 1
  moe_f = c.integer("moe_intermediate_size")
  dense = tuple(range(first_dense))
  # ModelConfig's own checks name their field (n_group, topk_group, ...): base.make_config
  return base.make_config(
      c, **{**common, "num_kv_heads": heads, "head_dim": c.integer("qk_rope_head_dim")},
      family="deepseek_v3", intermediate_size=moe_f, num_experts=experts,
      top_k=c.integer("num_experts_per_tok"), rms_eps=c.number("rms_norm_eps", 1e-6),
      norm_topk_prob=c.flag("norm_topk_prob", True), router="sigmoid_grouped",
      n_group=n_group, topk_group=topk_group,
      routed_scaling_factor=c.number("routed_scaling_factor", 1.0),
      dense_layers=dense, dense_intermediate_size=c.integer("intermediate_size") if dense else 0,
      shared_intermediate_size=shared * moe_f, kv_lora_rank=c.integer("kv_lora_rank"),
      q_lora_rank=q_lora or 0, qk_nope_head_dim=c.integer("qk_nope_head_dim"),
      v_head_dim=c.integer("v_head_dim"))


FP8_BLOCK = (128, 128)  # the published checkpoints' weight_block_size


def _check_fp8(c: base.HFConfig):
  quant = c.hf["quantization_config"]
  fmt = quant.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise c.error(f"field 'quantization_config.fmt' is {fmt!r}; only e4m3 FP8 is dequantized")
  block = quant.get("weight_block_size")
  if block != list(FP8_BLOCK):
    raise c.error(f"field 'quantization_config.weight_block_size' is {block!r}; only FP8 blocks "
                  f"of {list(FP8_BLOCK)} are dequantized")


def _rope_order(width: int, rope: int, heads: int, at: int) -> np.ndarray:
  """Column order of a [.., width] output whose heads' RoPE dims ([at, at + rope) of each of
  `heads` heads of width // heads) are interleaved pairs: those dims as evens then odds."""
  idx = np.arange(width)
  per = width // heads
  inner = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
  for h in range(heads):
    start = h * per + at
    idx[start:start + rope] = start + inner
  return idx


def weights(cfg: ModelConfig, keys: Collection[str], tied: bool) -> list[base.Weight]:
  d, h = cfg.hidden_size, cfg.num_heads
  n, r, v, rq, rkv = (cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim, cfg.q_lora_rank,
                      cfg.kv_lora_rank)
  q_width = h * (n + r)
  # interleaved RoPE dims -> rotate-half order (rows of the HF [out, in] matrices)
  q_order, kv_order = _rope_order(q_width, r, h, n), _rope_order(rkv + r, r, 1, rkv)

  def rows(order):
    return lambda t: t[order].T

  out = base.embedding_weights(cfg, keys, tied)
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out += [base.Weight(p + "input_layernorm.weight", (d,), (base.Put("attn_norm", (i,)),)),
            base.Weight(p + "post_attention_layernorm.weight", (d,),
                        (base.Put("mlp_norm", (i,)),))]
    if rq:
      out += [base.Weight(a + "q_a_proj.weight", (rq, d),
                          (base.Put("wq_a", (i,), base.transpose),)),
              base.Weight(a + "q_a_layernorm.weight", (rq,), (base.Put("q_a_norm", (i,)),)),
              base.Weight(a + "q_b_proj.weight", (q_width, rq),
                          (base.Put("wq_b", (i,), rows(q_order)),))]
    else:
      out.append(base.Weight(a + "q_proj.weight", (q_width, d),
                             (base.Put("wq", (i,), rows(q_order)),)))
    out += [base.Weight(a + "kv_a_proj_with_mqa.weight", (rkv + r, d),
                        (base.Put("wkv_a", (i,), rows(kv_order)),)),
            base.Weight(a + "kv_a_layernorm.weight", (rkv,), (base.Put("kv_a_norm", (i,)),)),
            base.Weight(a + "kv_b_proj.weight", (h * (n + v), rkv),
                        (base.Put("wkv_b", (i,), base.transpose),)),
            base.Weight(a + "o_proj.weight", (d, h * v), (base.Put("wo", (i,), base.transpose),))]
    m = p + "mlp."
    if i in cfg.dense_layers:
      j = cfg.dense_layers.index(i)  # its dense stack entry
      out += base.swiglu(m, base.GATE_UP_DOWN, "dense_", (j,), cfg.dense_intermediate_size, d)
      continue
    out += base.routed_experts(cfg, i, keys, m, base.GATE_UP_DOWN)
    out.append(base.Weight(m + "gate.e_score_correction_bias", (cfg.num_experts,),
                           (base.Put("router_correction", (i,)),)))
    if cfg.shared_intermediate_size:
      out += base.swiglu(m + "shared_experts.", base.GATE_UP_DOWN, "shared_", (i,),
                         cfg.shared_intermediate_size, d)
  return [_fp8(w, keys) for w in out]


def _fp8(w: base.Weight, keys: Collection[str]) -> base.Weight:
  """`w` read from its FP8 codes and block scales where the checkpoint holds them so (the
  published files: every projection but the router's; norms, embeddings and lm_head are bf16)."""
  scales = w.key + "_scale_inv"
  if not w.key.endswith(".weight") or scales not in keys:
    return w
  return dataclasses.replace(w, quant="fp8", scales_key=scales, block=FP8_BLOCK)


def ignored(hf: dict, cfg: ModelConfig) -> tuple[tuple[str, ...], str]:
  """The multi-token prediction layers' key prefixes (num_nextn_predict_layers of them after the
  model's layers)."""
  m = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
  if not isinstance(m, int) or isinstance(m, bool) or m < 0:
    return (), ""
  layers = range(cfg.num_layers, cfg.num_layers + m)
  return (tuple(f"model.layers.{i}." for i in layers),
            f"{m} multi-token prediction layer(s) (layers {', '.join(map(str, layers))})")


FAMILY = base.Family("deepseek_v3", "DeepSeek-V3", config_from_hf, weights, ignored)
