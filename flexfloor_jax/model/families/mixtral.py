"""Mixtral (`mixtral`): softmax-top-k-renormalise router, SwiGLU experts, optional sliding window
on every layer.

Safetensors layouts (both are what transformers writes, depending on the call):
  hub    model.layers.N.block_sparse_moe.gate.weight [E, D]
         model.layers.N.block_sparse_moe.experts.J.{w1,w3}.weight [F, D], w2 [D, F]
         (the published files, and transformers 5.x `save_pretrained`'s default)
  fused  model.layers.N.mlp.gate.weight [E, D]
         model.layers.N.mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]
         (`save_pretrained(save_original_format=False)`)
Either MoE prefix (`block_sparse_moe` / `mlp`) with either expert layout. w1 = gate, w3 = up,
w2 = down.
"""

from __future__ import annotations

from collections.abc import Collection

from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.model.families import base


def config_from_hf(c: base.HFConfig) -> ModelConfig:
  return base.make_config(
      c, **base.common_fields(c), intermediate_size=c.integer("intermediate_size"),
      num_experts=c.integer("num_local_experts"), top_k=c.integer("num_experts_per_tok"),
      rms_eps=c.number("rms_norm_eps", 1e-5), sliding_window=c.integer("sliding_window", None))


def _moe_prefix(keys: Collection[str], n: int) -> str:
  for moe in ("block_sparse_moe", "mlp"):
    if any(k.startswith(f"model.layers.{n}.{moe}.") for k in keys):
      return moe
  return "block_sparse_moe"  # neither present: report the hub name as missing


def weights(cfg: ModelConfig, keys: Collection[str], tied: bool) -> list[base.Weight]:
  out = base.embedding_weights(cfg, keys, tied)
  for n in range(cfg.num_layers):
    out += base.attention_weights(cfg, n)
    p = f"model.layers.{n}.{_moe_prefix(keys, n)}."
    out += base.routed_experts(cfg, n, keys, p, ("w1", "w3", "w2"))
  return out


FAMILY = base.Family("mixtral", "Mixtral", config_from_hf, weights)
