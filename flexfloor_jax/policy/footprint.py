"""Parameter counts and expert slots from a model's dimensions: the one formula that the model
config (param_count), the memory floor, the expert placement and the simulator all use.

Mixtral layout: per layer, attention (q and o over heads x head_dim, k and v over kv heads), a
router (hidden x experts), two RMS norms, and per expert w1, w3 (hidden x ffn) and w2 (ffn x
hidden); around the layers an embedding table, a final norm and an untied lm_head.
"""

from __future__ import annotations

import math


def expert_params(hidden: int, ffn: int, layers: int) -> int:
  """One expert over all layers (w1, w3, w2)."""
  return 3 * layers * hidden * ffn


def nonexpert_params(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                     head_dim: int, experts: int) -> int:
  """Every weight but the experts': what each worker holds replicated."""
  d = hidden
  attn = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2
  return 2 * vocab * d + layers * (attn + d * experts + 2 * d) + d


def expert_slots(num_experts: int, workers: int) -> int:
  """Slots each of `workers` needs so that every expert has one: ceil(E / workers)."""
  return math.ceil(num_experts / workers)


def preallocated_slots(schedule: str, num_experts: int, num_workers: int, floor: int) -> int:
  """Expert slots a worker allocates for a rollout: a flexfloor rollout may shrink to `floor`
  workers and the slots cannot grow after the start, so it allocates the floor's; the other
  schedules never shrink."""
  return expert_slots(num_experts, floor if schedule == "flexfloor" else num_workers)
