"""Parameter counts from a model's dimensions: the one formula that the model config
(param_count), the memory floor and the simulator all use (numpy-free: the simulator imports it).

Mixtral layout: per layer, attention (q and o over heads x head_dim, k and v over kv heads), a
router (hidden x experts), two RMS norms, and per expert w1, w3 (hidden x ffn) and w2 (ffn x
hidden); around the layers an embedding table, a final norm and an untied lm_head.
"""

from __future__ import annotations


def expert_params(hidden: int, ffn: int, layers: int) -> int:
  """One expert over all layers (w1, w3, w2)."""
  return 3 * layers * hidden * ffn


def nonexpert_params(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                     head_dim: int, experts: int) -> int:
  """Every weight but the experts': what each worker holds replicated."""
  d = hidden
  attn = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2
  return 2 * vocab * d + layers * (attn + d * experts + 2 * d) + d


