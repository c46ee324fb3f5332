"""Model dimensions. A checkpoint's config.json overrides every field here (see checkpoint.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

from flexfloor_jax.policy import footprint


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
  sliding_window: Optional[int] = None  # None = full causal attention
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

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def param_count(self) -> int:
    """Parameter count from the dimensions alone (embed + layers + norm + untied lm_head)."""
    e = self.num_experts
    return (footprint.nonexpert_params(self.vocab_size, self.hidden_size, self.num_layers,
                                       self.num_heads, self.num_kv_heads, self.head_dim, e)
            + e * footprint.expert_params(self.hidden_size, self.intermediate_size,
                                          self.num_layers))


def model_identity(cfg: ModelConfig) -> str:
  """A short hash of the model's configuration (every field but dtype: a bf16 copy of a model
  answers as long as its fp32 original). Recorded in the length history, so that a history is
  not used for a model of another shape or vocabulary; two checkpoints of one architecture
  share it."""
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"}
  return "cfg-" + hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


# Byte-level tokenizer vocabulary: 256 bytes + pad/bos/eos (see tokenizer.py).
BYTE_VOCAB = 259

PRESETS = {
    # The Mixtral architecture at a size that runs in seconds on 2 CPU cores.
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
