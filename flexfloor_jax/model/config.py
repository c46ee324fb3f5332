"""Model dimensions and block choices. A checkpoint's config.json overrides every field here (its
family's reader in model/families/ sets them); random-init presets name their family in `family`.

The block choices (qk_norm, norm_topk_prob, dense_layers, ...) are what the transformer is
assembled from: it reads these fields, never the family's name, and their defaults are Mixtral's,
so a Mixtral config is what it was before families existed (same fields, same identity).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
from typing import Any

from flexfloor_jax.model import param_count

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")
EXPERT_ACTS = ("swiglu", "clamped_swiglu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  hidden_size: int  # D
  intermediate_size: int  # F (per expert)
  num_layers: int
  num_heads: int  # H
  num_kv_heads: int  # K (GQA when K < H)
  head_dim: int
  num_experts: int  # E
  top_k: int
  rope_theta: float = 1e6
  rms_eps: float = 1e-5
  sliding_window: int | None = None  # None = full causal attention
  max_position_embeddings: int = 32768
  eos_id: int = 2
  bos_id: int = 1
  dtype: str = "float32"  # activation / parameter dtype
  # The family (a checkpoint's model_type) and its block choices; defaults: Mixtral's.
  family: str = "mixtral"
  qk_norm: bool = False  # per-head RMSNorm of q and k on the head dim, before RoPE
  norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum 1
  # Layers whose MLP is one dense SwiGLU of dense_intermediate_size instead of the MoE.
  dense_layers: tuple[int, ...] = ()
  dense_intermediate_size: int = 0
  extra_eos_ids: tuple[int, ...] = ()  # further stop tokens beside eos_id (checkpoints' lists)
  # Layers that read only the last sliding_window positions; () = every layer when
  # sliding_window is set (Mixtral), else the named ones (GPT-OSS's layer_types).
  sliding_layers: tuple[int, ...] = ()
  attn_bias: bool = False  # q/k/v/o projections with biases
  attn_sinks: bool = False  # a learned logit per head joins each softmax and is dropped after it
  # 'softmax_topk': top-k of a softmax over every expert (Mixtral, Qwen3-MoE) | 'topk_softmax':
  # top-k of the logits, softmax over the chosen k (GPT-OSS)
  router: str = "softmax_topk"
  router_bias: bool = False
  # 'swiglu': silu(gate) * up | 'clamped_swiglu': gate clamped above, up to +-swiglu_limit,
  # gate * sigmoid(swiglu_alpha * gate) * (up + 1) (GPT-OSS)
  expert_act: str = "swiglu"
  expert_bias: bool = False  # gate, up and down projections of each expert with biases
  swiglu_limit: float = 7.0
  swiglu_alpha: float = 1.702
  # YaRN RoPE scaling: factor (0 = plain RoPE), the pre-training length, the ramp's rotations
  # and whether its bounds are rounded (transformers' 'truncate')
  yarn_factor: float = 0.0
  yarn_original_max_position: int = 4096
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_truncate: bool = True
  # YaRN's DeepSeek attention scales (0: unset): cos/sin scaled by
  # mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim) when both are set (else the
  # paper's mscale(factor)), and MLA's softmax scale by mscale(factor, yarn_mscale_all_dim)^2
  yarn_mscale: float = 0.0
  yarn_mscale_all_dim: float = 0.0
  # Multi-head latent attention (DeepSeek-V3) when kv_lora_rank > 0: q through a rank
  # q_lora_rank projection (0: one dense projection), keys and values from a shared latent of
  # kv_lora_rank values plus one RoPE key of head_dim (qk_rope_head_dim) values per token, which
  # is what the cache holds; q/k heads of qk_nope_head_dim + head_dim, v heads of v_head_dim.
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  v_head_dim: int = 0
  # router='sigmoid_grouped' (DeepSeek-V3): experts in n_group groups, the topk_group best
  # groups (by their two best biased scores) open, the chosen weights multiplied by
  # routed_scaling_factor
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  # a dense SwiGLU of this width that every token of an MoE layer also runs (0: none)
  shared_intermediate_size: int = 0

  def __post_init__(self):
    # JSON (orbax's model_config.json) gives lists: tuples keep the config hashable.
    for f in ("dense_layers", "extra_eos_ids", "sliding_layers"):
      object.__setattr__(self, f, tuple(int(x) for x in getattr(self, f)))
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "num_experts", "top_k"):
      v = getattr(self, f)
      if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:  # null, a string
        raise ValueError(f"model.{f} must be an integer > 0, got {v!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
    bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f"dense_layers {bad} outside the {self.num_layers} layers")
    if self.dense_layers and self.dense_intermediate_size <= 0:
      raise ValueError("dense_intermediate_size must be > 0 when dense_layers are given, got "
                       f"{self.dense_intermediate_size}")

    bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f"sliding_layers {bad} outside the {self.num_layers} layers")
    if self.sliding_layers and not self.sliding_window:
      raise ValueError("sliding_layers need a sliding_window")
    if self.router not in ROUTERS:
      raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
    if self.expert_act not in EXPERT_ACTS:
      raise ValueError(f"expert_act must be one of {EXPERT_ACTS}, got {self.expert_act!r}")
    for f in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "shared_intermediate_size"):
      if getattr(self, f) < 0:
        raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")
    if self.mla:
      if self.v_head_dim <= 0 or self.qk_nope_head_dim <= 0:
        raise ValueError("multi-head latent attention (kv_lora_rank > 0) needs qk_nope_head_dim "
                         f"and v_head_dim > 0, got {self.qk_nope_head_dim}, {self.v_head_dim}")
      if self.sliding_window or self.attn_bias or self.attn_sinks or self.qk_norm:
        raise ValueError("multi-head latent attention takes no sliding window, attention "
                         "biases, sinks or q/k norms")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
    if self.router == "sigmoid_grouped":
      if self.n_group < 1 or self.num_experts % self.n_group:
        raise ValueError(f"n_group ({self.n_group}) must divide num_experts "
                         f"({self.num_experts})")
      if self.num_experts // self.n_group < 2:
        raise ValueError(f"n_group ({self.n_group}) leaves fewer than 2 experts per group: a "
                         "group is scored by its two best experts")
      if not 1 <= self.topk_group <= self.n_group:
        raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got "
                         f"{self.topk_group}")
      if self.top_k > self.topk_group * (self.num_experts // self.n_group):
        raise ValueError(f"top_k ({self.top_k}) must be <= the experts of topk_group "
                         f"({self.topk_group}) groups of {self.num_experts // self.n_group}")
      if not self.routed_scaling_factor > 0:
        raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

  @property
  def mla(self) -> bool:
    """Multi-head latent attention (kv_lora_rank > 0) instead of GQA."""
    return self.kv_lora_rank > 0

  def kv_dims(self) -> tuple[int, int, int]:
    """(heads, k values, v values) of one cached token of one layer: GQA's K and V heads of
    head_dim; MLA's one 'head' of the latent (kv_lora_rank, in k) and the RoPE key (head_dim, in
    v)."""
    if self.mla:
      return 1, self.kv_lora_rank, self.head_dim
    return self.num_kv_heads, self.head_dim, self.head_dim

  def window_of(self, layer: int) -> int | None:
    """The sliding window layer `layer` reads (None: every position)."""
    if self.sliding_window and (not self.sliding_layers or layer in self.sliding_layers):
      return self.sliding_window
    return None

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Every token id that ends a response (eos_id -1: none, never matches)."""
    return (self.eos_id, *self.extra_eos_ids)

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  def param_count(self) -> int:
    """Parameters the model's layout holds, from the dimensions alone (embed + layers + norm +
    untied lm_head). With dense layers that is more than the checkpoint's: the layer stacks keep
    one shape, so expert and dense weights exist on every layer (zero where unused)."""
    e = self.num_experts
    return (self.nonexpert_param_count()
            + e * param_count.expert_params(self.hidden_size, self.intermediate_size,
                                          self.num_layers, bias=self.expert_bias))

  def mla_attn_params(self) -> int:
    """One layer's MLA projections and norms (0 for GQA)."""
    if not self.mla:
      return 0
    return param_count.mla_attn_params(self.hidden_size, self.num_heads, self.q_lora_rank,
                                       self.kv_lora_rank, self.qk_nope_head_dim, self.head_dim,
                                       self.v_head_dim)

  def nonexpert_param_count(self) -> int:
    """Every weight but the routed experts' (replicated on each worker)."""
    return param_count.nonexpert_params(
        self.vocab_size, self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads,
        self.head_dim, self.num_experts, qk_norm=self.qk_norm, attn_bias=self.attn_bias,
        sinks=self.attn_sinks, router_bias=self.router_bias,
        dense_ffn=self.dense_intermediate_size if self.dense_layers else 0,
        dense_count=len(self.dense_layers), mla_attn=self.mla_attn_params(),
        shared_ffn=self.shared_intermediate_size,
        router_correction=self.router == "sigmoid_grouped")


_BLOCK_FIELDS = ("family", "qk_norm", "norm_topk_prob", "dense_layers", "dense_intermediate_size",
                 "extra_eos_ids", "sliding_layers", "attn_bias", "attn_sinks", "router",
                 "router_bias", "expert_act", "expert_bias", "swiglu_limit", "swiglu_alpha",
                 "yarn_factor", "yarn_original_max_position", "yarn_beta_fast", "yarn_beta_slow",
                 "yarn_truncate", "yarn_mscale", "yarn_mscale_all_dim", "kv_lora_rank",
                 "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
                 "routed_scaling_factor", "shared_intermediate_size")


def model_identity(cfg: ModelConfig) -> str:
  """A short hash of the model's configuration (every field but dtype: a bf16 copy of a model
  answers as long as its fp32 original). Recorded in the length history, so that a history is
  not used for a model of another shape or vocabulary; two checkpoints of one architecture
  share it."""
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"}
  # Block choices at their default (Mixtral's) are left out: a Mixtral keeps the identity it had
  # before the families' fields existed, so its length histories stay usable.
  for f in dataclasses.fields(ModelConfig):
    if f.name in _BLOCK_FIELDS and fields[f.name] == f.default:
      del fields[f.name]
  return "cfg-" + hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- MoE kernels
# `model.moe_backend` = 'auto' | 'xla' | 'pallas': resolved here, in one place, into the kernels'
# `impl=` / `interpret=` arguments (runner, rl/train, EngineSpec.ep, ActorSpec.ep). This module
# imports no jax, so the CLIs check the name before jax starts.

MOE_BACKENDS = ("auto", "xla", "pallas")
# Paged decode attention (rollout.kv='paged'): 'xla' (gather the pages, the model's own attention)
# | 'pallas' (JAX's paged-attention kernels: Mosaic TPU, Triton on CUDA; interpreted on CPU)
ATTENTION_BACKENDS = ("xla", "pallas")

# Platforms with compiled Pallas kernels, as jax names them: a CUDA device reports 'gpu'
# (`Device.platform`, `jax.default_backend()`), a lowering names it 'cuda'.
COMPILED_PALLAS_PLATFORMS = ("tpu", "gpu", "cuda")


def resolve_moe_backend(name: str, platform: str) -> tuple[str, bool]:
  """(impl, interpret) for `name` on `platform` ('cpu', 'gpu', 'tpu', ...).

  'auto': 'pallas' where compiled Pallas kernels exist, else 'xla' (on CPU the XLA path is the fast
  one: a Pallas kernel there only runs interpreted). On TPU every kernel is Mosaic TPU. On CUDA
  GPUs permute and combine are Pallas Triton kernels for every shape and dtype; the grouped matmul
  takes its Mosaic GPU kernel only for bf16/fp16 operands of one dtype with K % 64 == 0 and either
  tiles of 8..56 rows (multiples of 8: the swapped kernel) with N % 64 == 0 or tiles of 64 rows or
  a multiple of 128 with N % 128 == 0, and the XLA loop otherwise (e.g. fp32, the tiny preset; see
  `flexfloor_jax.kernels.gmm_mgpu.mgpu_supported`). The engine's decode and prefill tiles (8, 32)
  and the actor's (8) take the swapped kernel, clear of the row-major kernel's race at tile_m 128
  with K/64 = 5 or 6 (README "Device check").
  'pallas': the Pallas kernels; on CPU in interpret mode (the parity-test path).
  'xla': the XLA references everywhere.
  """
  if name not in MOE_BACKENDS:
    raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {name!r}")
  compiled = platform in COMPILED_PALLAS_PLATFORMS
  if name == "auto":
    name = "pallas" if compiled else "xla"
  return name, name == "pallas" and platform == "cpu"


# Byte-level tokenizer vocabulary: 256 bytes + pad/bos/eos (see tokenizer.py).
BYTE_VOCAB = 259

# GPT-OSS's block choices and the RoPE of its config.json (theta 150000; YaRN factor 32 over 4096
# pre-training positions, beta 32 / 1, bounds not rounded), shared by its presets.
_GPT_OSS: dict[str, Any] = dict(
    family="gpt_oss", rope_theta=150000.0, rms_eps=1e-5, attn_bias=True, attn_sinks=True,
    router="topk_softmax", router_bias=True, expert_act="clamped_swiglu", expert_bias=True,
    swiglu_limit=7.0, swiglu_alpha=1.702, yarn_factor=32.0, yarn_original_max_position=4096,
    yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_truncate=False)

# DeepSeek-V3's block choices (deepseek-ai/DeepSeek-V3 config.json: sigmoid routing with the
# correction bias, renormalised; YaRN factor 40 over 4096 positions, mscale and mscale_all_dim 1),
# shared by its presets; Moonlight and Kimi-K2 replace what differs.
_DEEPSEEK: dict[str, Any] = dict(
    family="deepseek_v3", router="sigmoid_grouped", norm_topk_prob=True, rope_theta=10000.0,
    rms_eps=1e-6, yarn_factor=40.0, yarn_original_max_position=4096, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0, yarn_truncate=True, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
    qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)

PRESETS = {
    # The Mixtral architecture at a size that runs in seconds on a laptop CPU.
    "tiny": ModelConfig(vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=256,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8,
                        top_k=2, rope_theta=10000.0, rms_eps=1e-5, sliding_window=None,
                        max_position_embeddings=4096, eos_id=258, bos_id=257),
    # Published Mixtral dimensions (mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1 config.json).
    "8x7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, num_experts=8,
                        top_k=2, rope_theta=1e6, rms_eps=1e-5, sliding_window=None,
                        max_position_embeddings=32768, eos_id=2, bos_id=1, dtype="bfloat16"),
    "8x22b": ModelConfig(vocab_size=32768, hidden_size=6144, intermediate_size=16384,
                         num_layers=56, num_heads=48, num_kv_heads=8, head_dim=128,
                         num_experts=8, top_k=2, rope_theta=1e6, rms_eps=1e-5,
                         sliding_window=None, max_position_embeddings=65536, eos_id=2, bos_id=1,
                         dtype="bfloat16"),
    # Qwen3-MoE at laptop size: per-head q/k norms, explicit head_dim (48 != 128 / 4), 16 small
    # experts, top-4, renormalised (as the published checkpoints).
    "qwen3-tiny": ModelConfig(vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=64,
                              num_layers=4, num_heads=4, num_kv_heads=2, head_dim=48,
                              num_experts=16, top_k=4, rope_theta=10000.0, rms_eps=1e-6,
                              max_position_embeddings=4096, eos_id=258, bos_id=257,
                              family="qwen3_moe", qk_norm=True, norm_topk_prob=True),
    # Published Qwen3-MoE dimensions (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B config.json and
    # generation_config.json: eos 151645, also stops at 151643; no dense layers; no BOS
    # prepended, as their tokenizer does). The simulator's model rows take the same dimensions
    # from here (sim/presets.py).
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=768,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                 num_experts=128, top_k=8, rope_theta=1e6, rms_eps=1e-6,
                                 max_position_embeddings=40960, eos_id=151645, bos_id=-1,
                                 dtype="bfloat16", family="qwen3_moe", qk_norm=True,
                                 norm_topk_prob=True, extra_eos_ids=(151643,)),
    "qwen3-235b-a22b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=1536,
                                   num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
                                   num_experts=128, top_k=8, rope_theta=1e6, rms_eps=1e-6,
                                   max_position_embeddings=40960, eos_id=151645, bos_id=-1,
                                   dtype="bfloat16", family="qwen3_moe", qk_norm=True,
                                   norm_topk_prob=True, extra_eos_ids=(151643,)),
    # GPT-OSS at laptop size: q/k/v/o biases, sinks, layers 0 and 2 sliding (window 16), YaRN as
    # published, a biased top-k-then-softmax router, 16 experts with biases and clamped SwiGLU.
    "gpt-oss-tiny": ModelConfig(**_GPT_OSS, vocab_size=BYTE_VOCAB, hidden_size=128,
                                intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                head_dim=32, num_experts=16, top_k=4, sliding_window=16,
                                sliding_layers=(0, 2), max_position_embeddings=4096, eos_id=258,
                                bos_id=257),
    # Published GPT-OSS dimensions (openai/gpt-oss-20b, gpt-oss-120b config.json: alternating
    # sliding (128) and full layers, sliding first; generation_config.json's stop ids 200002,
    # 199999, 200012; no BOS prepended). The published experts are MXFP4, dequantized on load:
    # these presets are the model in bfloat16.
    "gpt-oss-20b": ModelConfig(**_GPT_OSS, vocab_size=201088, hidden_size=2880,
                               intermediate_size=2880, num_layers=24, num_heads=64,
                               num_kv_heads=8, head_dim=64, num_experts=32, top_k=4,
                               sliding_window=128, sliding_layers=tuple(range(0, 24, 2)),
                               max_position_embeddings=131072, eos_id=200002, bos_id=-1,
                               extra_eos_ids=(199999, 200012), dtype="bfloat16"),
    "gpt-oss-120b": ModelConfig(**_GPT_OSS, vocab_size=201088, hidden_size=2880,
                                intermediate_size=2880, num_layers=36, num_heads=64,
                                num_kv_heads=8, head_dim=64, num_experts=128, top_k=4,
                                sliding_window=128, sliding_layers=tuple(range(0, 36, 2)),
                                max_position_embeddings=131072, eos_id=200002, bos_id=-1,
                                extra_eos_ids=(199999, 200012), dtype="bfloat16"),
    # DeepSeek-V3 at laptop size: MLA (q through rank 48, a latent of 64 + a RoPE key of 16 per
    # token), 16 experts in 4 groups (2 open), top-4, scaled by 2.5, one shared expert, layer 0
    # dense, YaRN as published.
    "deepseek-v3-tiny": ModelConfig(**{**_DEEPSEEK, "qk_nope_head_dim": 32, "v_head_dim": 32,
                                       "kv_lora_rank": 64},
                                    vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=64,
                                    num_layers=4, num_heads=4, num_kv_heads=4, head_dim=16,
                                    num_experts=16, top_k=4, q_lora_rank=48, n_group=4,
                                    topk_group=2, routed_scaling_factor=2.5,
                                    shared_intermediate_size=64, dense_layers=(0,),
                                    dense_intermediate_size=192, max_position_embeddings=4096,
                                    eos_id=258, bos_id=257),
    # Published DeepSeek-family dimensions (config.json of deepseek-ai/DeepSeek-V3,
    # moonshotai/Moonlight-16B-A3B, moonshotai/Kimi-K2-Instruct; their multi-token prediction
    # layers are not loaded). The V3 and Kimi-K2 weights are published in block FP8, dequantized
    # on load: these presets are the models in bfloat16.
    "deepseek-v3": ModelConfig(**_DEEPSEEK, vocab_size=129280, hidden_size=7168,
                               intermediate_size=2048, num_layers=61, num_heads=128,
                               num_kv_heads=128, head_dim=64, num_experts=256, top_k=8,
                               q_lora_rank=1536, n_group=8, topk_group=4,
                               routed_scaling_factor=2.5, shared_intermediate_size=2048,
                               dense_layers=(0, 1, 2), dense_intermediate_size=18432,
                               max_position_embeddings=163840, eos_id=1, bos_id=0,
                               dtype="bfloat16"),
    "moonlight-16b-a3b": ModelConfig(**{**_DEEPSEEK, "rope_theta": 50000.0, "rms_eps": 1e-5,
                                        "yarn_factor": 0.0, "yarn_mscale": 0.0,
                                        "yarn_mscale_all_dim": 0.0},
                                     vocab_size=163840, hidden_size=2048, intermediate_size=1408,
                                     num_layers=27, num_heads=16, num_kv_heads=16, head_dim=64,
                                     num_experts=64, top_k=6, q_lora_rank=0, n_group=1,
                                     topk_group=1, routed_scaling_factor=2.446,
                                     shared_intermediate_size=2 * 1408, dense_layers=(0,),
                                     dense_intermediate_size=11264, max_position_embeddings=8192,
                                     eos_id=163585, bos_id=163584, dtype="bfloat16"),
    "kimi-k2": ModelConfig(**{**_DEEPSEEK, "rope_theta": 50000.0, "yarn_factor": 32.0,
                              "yarn_beta_fast": 1.0},
                           vocab_size=163840, hidden_size=7168, intermediate_size=2048,
                           num_layers=61, num_heads=64, num_kv_heads=64, head_dim=64,
                           num_experts=384, top_k=8, q_lora_rank=1536, n_group=1, topk_group=1,
                           routed_scaling_factor=2.827, shared_intermediate_size=2048,
                           dense_layers=(0,), dense_intermediate_size=18432,
                           max_position_embeddings=131072, eos_id=163585, bos_id=163584,
                           dtype="bfloat16"),
}
