"""Model dimensions. A checkpoint's config.json overrides every field here (see
hf_checkpoint.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from flexfloor_jax.model import param_count


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

  def __post_init__(self):
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "num_experts", "top_k"):
      if getattr(self, f) <= 0:
        raise ValueError(f"model.{f} must be > 0, got {getattr(self, f)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  def param_count(self) -> int:
    """Parameter count from the dimensions alone (embed + layers + norm + untied lm_head)."""
    e = self.num_experts
    return (param_count.nonexpert_params(self.vocab_size, self.hidden_size, self.num_layers,
                                       self.num_heads, self.num_kv_heads, self.head_dim, e)
            + e * param_count.expert_params(self.hidden_size, self.intermediate_size,
                                          self.num_layers))


def model_identity(cfg: ModelConfig) -> str:
  """A short hash of the model's configuration (every field but dtype: a bf16 copy of a model
  answers as long as its fp32 original). Recorded in the length history, so that a history is
  not used for a model of another shape or vocabulary; two checkpoints of one architecture
  share it."""
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"}
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
}
