"""Mixtral-architecture MoE transformer (Flax NNX params, pure-function forward passes)."""

from flexfloor_jax.model.config import ModelConfig, PRESETS

__all__ = ["ModelConfig", "PRESETS"]
