"""Qwen3-MoE rollout config:
`python -m flexfloor_jax.rollout --config=configs/qwen3_moe.py[:preset]`.

Presets: tiny (default; the qwen3-tiny model: per-head q/k norms, 16 experts, top-4, random init,
runs on a laptop CPU with emulated devices), 30b-a3b, 235b-a22b (published dimensions; TPU/GPU
with a checkpoint, whose config.json then decides every dimension). Every field is that of
configs/mixtral.py; override any with --config.section.field=value.
"""

import ml_collections

from flexfloor_jax.config.files import load_config

PRESETS = {"tiny": "qwen3-tiny", "30b-a3b": "qwen3-30b-a3b", "235b-a22b": "qwen3-235b-a22b"}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  preset = preset or "tiny"
  # The model presets' own names are accepted too (python -m flexfloor_jax.memory passes them).
  name = PRESETS.get(preset, preset)
  if name not in PRESETS.values():
    raise ValueError(f"unknown preset {preset!r} for configs/qwen3_moe.py; choose one of "
                     f"{tuple(PRESETS)}")
  # The Mixtral config of the same scale: its rollout, mesh and scheduler fields.
  c = load_config("mixtral", "tiny" if name == "qwen3-tiny" else "8x7b")
  c.preset = name
  return c
