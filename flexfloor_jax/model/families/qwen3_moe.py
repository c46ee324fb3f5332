"""Qwen3-MoE (`qwen3_moe`; Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B).

Blocks: GQA with an explicit head_dim and a per-head RMSNorm of q and k (`q_norm`, `k_norm`, over
the head dim) before RoPE; a router that takes the top-k of a softmax over every expert,
renormalised when `norm_topk_prob` (true in the published checkpoints, false by default in
transformers' config class); SwiGLU experts of `moe_intermediate_size`; dense SwiGLU layers of
`intermediate_size` where `mlp_only_layers` names the layer or (layer + 1) is not a multiple of
`decoder_sparse_step`; a sliding window on every layer only when `use_sliding_window`.

Safetensors layouts (transformers 5.x writes the first by default):
  hub    model.layers.N.mlp.gate.weight [E, D]
         model.layers.N.mlp.experts.J.{gate_proj,up_proj}.weight [F, D], down_proj [D, F]
  fused  model.layers.N.mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]
  dense  model.layers.N.mlp.{gate_proj,up_proj}.weight [Fd, D], down_proj [D, Fd]
"""

from __future__ import annotations

from collections.abc import Collection

from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.model.families import base


def config_from_hf(c: base.HFConfig) -> ModelConfig:
  common = base.common_fields(c)
  # Qwen3's tokenizer prepends no BOS (add_bos_token false; config.json's bos_token_id is its
  # <|endoftext|>): prompts are encoded as transformers encodes them.
  common["bos_id"] = -1
  layers = common["num_layers"]
  if c.flag("attention_bias", False):
    raise c.error("field 'attention_bias' is true; Qwen3-MoE attention without biases only")
  # The published files name the expert count num_experts; transformers 5 writes its alias.
  experts_field = "num_experts" if "num_experts" in c.hf else "num_local_experts"
  step = c.integer("decoder_sparse_step", 1)
  if step is None or step < 1:
    raise c.error(f"field 'decoder_sparse_step' must be >= 1, got {step!r}")
  mlp_only = c.int_list("mlp_only_layers", [])
  bad = [i for i in mlp_only if not 0 <= i < layers]
  if bad:
    raise c.error(f"field 'mlp_only_layers' names layers {bad} outside the {layers} layers "
                  "(num_hidden_layers)")
  dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step)
  window = c.integer("sliding_window", None) if c.flag("use_sliding_window", False) else None
  return base.make_config(
      c, **common, family="qwen3_moe", qk_norm=True,
      intermediate_size=c.integer("moe_intermediate_size"), num_experts=c.integer(experts_field),
      top_k=c.integer("num_experts_per_tok"), rms_eps=c.number("rms_norm_eps", 1e-6),
      sliding_window=window, norm_topk_prob=c.flag("norm_topk_prob", False),
      dense_layers=dense,
      dense_intermediate_size=c.integer("intermediate_size") if dense else 0)


def weights(cfg: ModelConfig, keys: Collection[str], tied: bool) -> list[base.Weight]:
  d = cfg.hidden_size
  out = base.embedding_weights(cfg, keys, tied)
  for n in range(cfg.num_layers):
    out += base.attention_weights(cfg, n)
    p = f"model.layers.{n}.mlp."
    if n in cfg.dense_layers:
      j = cfg.dense_layers.index(n)  # its dense stack entry
      out += base.swiglu(p, base.GATE_UP_DOWN, "dense_", (j,), cfg.dense_intermediate_size, d)
      continue
    out += base.routed_experts(cfg, n, keys, p, base.GATE_UP_DOWN)
  return out


FAMILY = base.Family("qwen3_moe", "Qwen3-MoE", config_from_hf, weights)
