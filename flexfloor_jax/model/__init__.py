"""Mixtral-architecture MoE transformer (a params pytree, pure-function forward passes)."""

from flexfloor_jax.model.config import PRESETS, ModelConfig

__all__ = ["ModelConfig", "PRESETS"]
