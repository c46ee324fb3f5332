"""GPT-OSS (`gpt_oss`; openai/gpt-oss-20b, gpt-oss-120b).

Blocks: GQA with q/k/v/o biases and one learned sink logit per head (it joins each softmax's
denominator and is dropped after it); `layer_types` make a layer `sliding_attention` (the last
`sliding_window` positions) or `full_attention`; YaRN RoPE; a router linear with a bias whose top-k
logits are softmaxed; experts with biases and the clamped SwiGLU (`swiglu_limit`, alpha 1.702).

Safetensors layout (what transformers 5.x writes; the experts are stored [in, out], gate and up
interleaved in the columns: gate the even ones, up the odd ones):
  model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks [H]
  model.layers.N.mlp.router.weight [E, D], router.bias [E]
  model.layers.N.mlp.experts.gate_up_proj [E, D, 2F], gate_up_proj_bias [E, 2F]
  model.layers.N.mlp.experts.down_proj [E, F, D], down_proj_bias [E, D]
The published checkpoints hold the experts in MXFP4 (`quantization_config.quant_method` 'mxfp4'):
gate_up_proj_blocks [E, 2F, D/32, 16] and gate_up_proj_scales [E, 2F, D/32] (down_proj_* the
same over [E, D, F/32]) in place of gate_up_proj and down_proj, dequantized on load into the
run's dtype (base.dequantize_mxfp4: the values of transformers' dequantization). Any other
quantization is refused in one line naming it (base.common_fields).
"""

from __future__ import annotations

from collections.abc import Collection

from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.model.families import base

LAYER_TYPES = ("sliding_attention", "full_attention")


def config_from_hf(c: base.HFConfig) -> ModelConfig:
  # MXFP4 experts (the published checkpoints) are dequantized on load (weights())
  common = base.common_fields(c, yarn=True, quantized=("mxfp4",))
  # GPT-OSS's tokenizer prepends no BOS (harmony prompts start with their own tokens): prompts
  # are encoded as transformers encodes them.
  common["bos_id"] = -1
  layers = common["num_layers"]
  # transformers' default when the file has none: sliding on even layers, full on odd ones
  default = [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(layers)]
  types = c.get("layer_types", default)
  if (not isinstance(types, list) or len(types) != layers
      or any(t not in LAYER_TYPES for t in types)):
    raise c.error(f"field 'layer_types' must list {layers} of {LAYER_TYPES} (one per layer of "
                  f"num_hidden_layers), got {types!r}")
  sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
  window = c.integer("sliding_window", None)
  if sliding and (window is None or window < 1):
    raise c.error(f"field 'sliding_window' must be >= 1 where layer_types has sliding layers, "
                  f"got {window!r}")
  limit = c.number("swiglu_limit", 7.0)
  if limit <= 0:
    raise c.error(f"field 'swiglu_limit' must be > 0, got {limit}")
  return base.make_config(
      c, **common, family="gpt_oss", intermediate_size=c.integer("intermediate_size"),
      num_experts=c.integer("num_local_experts"), top_k=c.integer("num_experts_per_tok"),
      rms_eps=c.number("rms_norm_eps", 1e-5), sliding_window=window if sliding else None,
      sliding_layers=sliding if len(sliding) < layers else (),
      attn_bias=c.flag("attention_bias", True), attn_sinks=True, router="topk_softmax",
      router_bias=True, expert_act="clamped_swiglu", expert_bias=True, swiglu_limit=limit,
      swiglu_alpha=c.number("swiglu_alpha", 1.702))


def _interleaved(leaf_gate: str, leaf_up: str, n: int):
  """Puts of a [..., 2F] tensor whose even columns are the gate's, odd ones the up's."""
  return (base.Put(leaf_gate, (n,), lambda t: t[..., ::2]),
          base.Put(leaf_up, (n,), lambda t: t[..., 1::2]))


def _mxfp4(name: str, out_shape: tuple, puts) -> base.Weight:
  """The blocks and scales of an [E, out, in] expert tensor stored as MXFP4 (32 values a
  block over `in`)."""
  e, rows, cols = out_shape
  return base.Weight(name + "_blocks", (e, rows, -(-cols // 32), 16), puts, quant="mxfp4",
                     scales_key=name + "_scales")


def weights(cfg: ModelConfig, keys: Collection[str], tied: bool) -> list[base.Weight]:
  d, f, e, h, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.num_heads,
                    cfg.head_dim)
  kd = cfg.num_kv_heads * hd
  out = base.embedding_weights(cfg, keys, tied)
  for n in range(cfg.num_layers):
    out += base.attention_weights(cfg, n)
    p = f"model.layers.{n}."
    if cfg.attn_bias:
      out += [base.Weight(f"{p}self_attn.{hf_name}_proj.bias", (size,), (base.Put(ours, (n,)),))
              for ours, hf_name, size in (("bq", "q", h * hd), ("bk", "k", kd), ("bv", "v", kd),
                                          ("bo", "o", d))]
    x = p + "mlp.experts."
    out += [base.Weight(p + "self_attn.sinks", (h,), (base.Put("sinks", (n,)),)),
            base.Weight(p + "mlp.router.weight", (e, d),
                        (base.Put("router", (n,), base.transpose),)),
            base.Weight(p + "mlp.router.bias", (e,), (base.Put("router_bias", (n,)),)),
            base.Weight(x + "gate_up_proj_bias", (e, 2 * f), _interleaved("b1", "b3", n)),
            base.Weight(x + "down_proj_bias", (e, d), (base.Put("b2", (n,)),))]
    if x + "gate_up_proj_blocks" in keys or x + "down_proj_blocks" in keys:
      out += [_mxfp4(x + "gate_up_proj", (e, 2 * f, d), _interleaved("w1", "w3", n)),
              _mxfp4(x + "down_proj", (e, d, f), (base.Put("w2", (n,)),))]
    else:
      out += [base.Weight(x + "gate_up_proj", (e, d, 2 * f), _interleaved("w1", "w3", n)),
              base.Weight(x + "down_proj", (e, f, d), (base.Put("w2", (n,)),))]
  return out


FAMILY = base.Family("gpt_oss", "GPT-OSS", config_from_hf, weights)
