"""Model families: one module per Hugging Face `model_type` (base.py says what a family states).
The checkpoint's `model_type` picks the family; random-init presets (model/config.py) name theirs
in `ModelConfig.family`."""

from __future__ import annotations

from flexfloor_jax.model.checkpoint_format import CheckpointError
from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.model.families import deepseek_v3, gpt_oss, mixtral, qwen3_moe
from flexfloor_jax.model.families.base import Family, HFConfig, Put, Weight

FAMILIES: dict[str, Family] = {f.model_type: f for f in (mixtral.FAMILY, qwen3_moe.FAMILY,
                                                          gpt_oss.FAMILY, deepseek_v3.FAMILY)}

__all__ = ["FAMILIES", "Family", "Put", "Weight", "config_from_hf", "family_of"]


def family_of(model_type, source: str) -> Family:
  if model_type not in FAMILIES:
    names = ", ".join(repr(n) for n in FAMILIES)
    raise CheckpointError(f"{source}: field 'model_type' is {model_type!r}; supported: {names}")
  return FAMILIES[model_type]


def config_from_hf(hf: dict, source: str) -> ModelConfig:
  """The ModelConfig of a config.json dict, by its model_type's family."""
  return family_of(hf.get("model_type"), source).config_from_hf(HFConfig(hf, source))
