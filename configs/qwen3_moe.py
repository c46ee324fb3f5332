"""Qwen3-MoE rollout config:
`python -m flexfloor_jax.rollout --config=configs/qwen3_moe.py[:preset]`.

Presets: tiny (default; the qwen3-tiny model: per-head q/k norms, 16 experts, top-4, random init,
runs on a laptop CPU with emulated devices), 30b-a3b, 235b-a22b (published dimensions; TPU/GPU
with a checkpoint, whose config.json then decides every dimension). Every field is that of
configs/mixtral.py; override any with --config.section.field=value.
"""

import ml_collections

from flexfloor_jax.config.files import family_config

PRESETS = {"tiny": "qwen3-tiny", "30b-a3b": "qwen3-30b-a3b", "235b-a22b": "qwen3-235b-a22b"}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  c = family_config("qwen3_moe", PRESETS, preset)
  c.scheduler.cost_model = "roofline:qwen3-30b-a3b@h100"  # the pair the tiny model stands for
  return c
