"""Tiny random Mixtral checkpoints for tests (no network).

`transformers.MixtralForCausalLM` ones are the parity reference, so they are built the way a
user's checkpoint would be (`save_pretrained`), with weights large enough that logits are not flat
and norm weights that are not all ones (ones would hide a swapped or untransposed norm). Tests of
what the loader refuses write smaller ones with numpy alone (`write_numpy_checkpoint`: no torch).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

# Parity cases. "gqa": explicit head_dim != hidden/heads, 8 experts, full attention, hub layout.
# "swa": sliding window 4 (most prompts are 9-16 tokens, so it matters), default head_dim, 4
# experts, fused expert layout in several shards.
CASES = {
    "gqa": dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=8,
                num_experts_per_tok=2, rope_theta=5000.0, sliding_window=None, rms_norm_eps=1e-5,
                max_position_embeddings=256, initializer_range=0.15),
    "swa": dict(vocab_size=300, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=None, num_local_experts=4,
                num_experts_per_tok=2, rope_theta=20000.0, sliding_window=4, rms_norm_eps=1e-6,
                max_position_embeddings=256, initializer_range=0.15),
}


def mixtral_config(**overrides):
  from transformers import MixtralConfig

  kw = dict(CASES["gqa"])
  kw.update(overrides)
  theta = kw.pop("rope_theta")
  kw.setdefault("bos_token_id", 1)
  kw.setdefault("eos_token_id", 2)
  return MixtralConfig(rope_parameters={"rope_type": "default", "rope_theta": theta},
                       attn_implementation="eager", **kw)  # pyright: ignore[reportCallIssue]


def build_model(config, seed: int):
  """fp32, eval mode, seeded; norm weights drawn around 1 (q/k norms included), biases and
  attention sinks drawn around 0 (their init values, zeros, would hide a dropped or misplaced
  term). The model class is the config's family's (transformers' auto mapping from
  model_type).

  torch runs single-threaded: these models are tiny, and on a shared 2-core machine torch's
  spinning worker threads slowed generate() down many times next to XLA's threads."""
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(1)

  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
      elif name.endswith(("bias", "sinks")):
        p.copy_(0.3 * torch.randn(p.shape, generator=g))
    # DeepSeek-V3's correction bias is a buffer (zeros at init): drawn at the scale of the
    # sigmoid scores' spread, so that it changes which experts are chosen
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.1 * torch.randn(b.shape, generator=g))
  return model


# Qwen3-MoE parity cases. "q3": 12 experts (not a multiple of 8 workers), top-4 renormalised,
# explicit head_dim 24 != 64/4, layer 1 dense (mlp_only_layers), hub layout, one file, two eos
# ids. "q3s": 32 experts (not a multiple of 3 workers), top-8 not renormalised, every other layer
# dense (decoder_sparse_step 2: layers 0 and 2), fused expert layout in several shards.
QWEN3_CASES = {
    "q3": dict(vocab_size=300, hidden_size=64, intermediate_size=112, moe_intermediate_size=40,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
               num_experts=12, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
               decoder_sparse_step=1, rope_theta=5000.0, rms_norm_eps=1e-6,
               max_position_embeddings=256, initializer_range=0.15),
    "q3s": dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                num_experts=32, num_experts_per_tok=8, norm_topk_prob=False, mlp_only_layers=[],
                decoder_sparse_step=2, rope_theta=20000.0, rms_norm_eps=1e-5,
                max_position_embeddings=256, initializer_range=0.15),
}


def qwen3_config(case: str = "q3", **overrides):
  from transformers import Qwen3MoeConfig

  kw = dict(QWEN3_CASES[case])
  kw.update(overrides)
  theta = kw.pop("rope_theta")
  kw.setdefault("bos_token_id", 1)
  kw.setdefault("eos_token_id", [2, 3])
  return Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": theta},
                        attn_implementation="eager", **kw)  # pyright: ignore[reportCallIssue]


# GPT-OSS parity cases. "go": 12 experts top-4, layers sliding / full / sliding (window 4; prompts
# of 5-16 tokens and 20 generated), YaRN as published (factor 32 over 4096 positions, theta
# 150000: the ramp crosses the head dims), swiglu_limit 1.5 so that the clamps bind at these
# weights. "go3": 32 experts top-4, full then sliding, the published limit 7, in shards.
GPT_OSS_CASES = {
    "go": dict(vocab_size=300, hidden_size=64, intermediate_size=40, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=12,
               num_experts_per_tok=4, sliding_window=4, swiglu_limit=1.5, rms_norm_eps=1e-5,
               max_position_embeddings=131072, initializer_range=0.15),
    "go3": dict(vocab_size=300, hidden_size=64, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_local_experts=32,
                num_experts_per_tok=4, sliding_window=5, swiglu_limit=7.0, rms_norm_eps=1e-5,
                layer_types=["full_attention", "sliding_attention"],
                max_position_embeddings=131072, initializer_range=0.15),
}


def gpt_oss_config(case: str = "go", **overrides):
  from transformers import GptOssConfig

  kw = dict(GPT_OSS_CASES[case])
  kw.update(overrides)
  kw.setdefault("bos_token_id", 1)
  kw.setdefault("eos_token_id", [2, 3])
  rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
          "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
  return GptOssConfig(rope_parameters=rope, attn_implementation="eager", **kw)  # pyright: ignore[reportCallIssue]


# DeepSeek-V3 parity cases (multi-head latent attention, sigmoid grouped routing, shared
# experts). Both: topk_group < n_group, routed_scaling_factor != 1, one shared expert, layer 0
# dense, YaRN with mscale != mscale_all_dim != 0 over 32 original positions (prompts of 5-16
# tokens + 20 generated cross it). "ds": q_lora_rank set, 12 experts in 4 groups of 3 (2 groups
# open), top-4, hub layout, one file. "ml" (as Moonlight: q_lora_rank null): 32 experts in 8
# groups of 4 (3 open), top-6, fused expert layout in shards.
DEEPSEEK_CASES = {
    "ds": dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=1, n_routed_experts=12, num_experts_per_tok=4, n_group=4,
               topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=40,
               qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=20, routed_scaling_factor=2.5,
               norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=128,
               initializer_range=0.15),
    "ml": dict(vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=1, n_routed_experts=32, num_experts_per_tok=6, n_group=8,
               topk_group=3, first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=None,
               qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=12,
               routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-5,
               max_position_embeddings=128, initializer_range=0.15),
}
DEEPSEEK_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                 "mscale_all_dim": 0.9, "original_max_position_embeddings": 32,
                 "beta_fast": 32.0, "beta_slow": 1.0}


def deepseek_config(case: str = "ds", **overrides):
  from transformers import DeepseekV3Config

  kw = dict(DEEPSEEK_CASES[case])
  kw.update(overrides)
  kw.setdefault("bos_token_id", 1)
  kw.setdefault("eos_token_id", 2)
  return DeepseekV3Config(rope_parameters=dict(DEEPSEEK_ROPE), attn_implementation="eager", **kw)  # pyright: ignore[reportCallIssue]


def save(model, path: str, *, fused: bool = False, max_shard_size: str | None = None) -> str:
  """save_pretrained. fused=False: hub layout (block_sparse_moe.experts.N.w1/w2/w3, the 5.x
  default, converted back on save); fused=True: the in-memory layout (mlp.experts.gate_up_proj /
  down_proj). max_shard_size splits into several files with model.safetensors.index.json."""
  kw: dict[str, Any] = {"save_original_format": not fused}
  if max_shard_size:
    kw["max_shard_size"] = max_shard_size
  model.save_pretrained(path, **kw)
  return path


def make_checkpoint(path: str, case: str = "gqa", seed: int = 0, **save_kw):
  """Build and save one case; returns the torch model."""
  model = build_model(mixtral_config(**CASES[case]), seed)
  save(model, path, **save_kw)
  return model


def read_all(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint dir (single or sharded), for tests that rewrite files."""
  from safetensors.numpy import load_file

  out = {}
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      out.update(load_file(os.path.join(path, f)))
  return out


def write_single(path: str, tensors: dict[str, np.ndarray], config: dict) -> str:
  """A one-file checkpoint dir with the given tensors and config dict."""
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return path


# The smallest Mixtral the loader reads: one layer, two experts, a vocabulary of 16.
NUMPY_CONFIG = {"model_type": "mixtral", "vocab_size": 16, "hidden_size": 8,
                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 4, "num_local_experts": 2,
                "num_experts_per_tok": 1, "max_position_embeddings": 64, "eos_token_id": 2,
                "bos_token_id": 1, "torch_dtype": "float32", "tie_word_embeddings": False}
EXPERT_KEY = "model.layers.0.block_sparse_moe.experts.1.w2.weight"


def write_numpy_checkpoint(path, *, dtype=np.float32, poison=None, config=None) -> str:
  """NUMPY_CONFIG (updated by `config`) in the hub layout, written with numpy: config.json and one
  model.safetensors; `poison` = (key, value) written into one element of that tensor."""
  cfg = dict(NUMPY_CONFIG, **(config or {}))
  d, v, f, e = 8, 16, 8, 2
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "lm_head.weight": (v, d), "model.layers.0.input_layernorm.weight": (d,),
            "model.layers.0.post_attention_layernorm.weight": (d,),
            "model.layers.0.self_attn.q_proj.weight": (8, d),
            "model.layers.0.self_attn.k_proj.weight": (4, d),
            "model.layers.0.self_attn.v_proj.weight": (4, d),
            "model.layers.0.self_attn.o_proj.weight": (d, 8),
            "model.layers.0.block_sparse_moe.gate.weight": (e, d)}
  for j in range(e):
    q = f"model.layers.0.block_sparse_moe.experts.{j}."
    shapes.update({q + "w1.weight": (f, d), q + "w3.weight": (f, d), q + "w2.weight": (d, f)})
  rng = np.random.default_rng(0)
  tensors = {k: (rng.standard_normal(s) * 0.1).astype(np.float32).astype(dtype)
             for k, s in shapes.items()}
  if poison is not None:
    key, value = poison
    tensors[key].flat[3] = value
  return write_single(str(path), tensors, cfg)
