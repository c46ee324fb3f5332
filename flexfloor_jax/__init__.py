"""flexfloor_jax: elastic expert-parallel rollouts of MoE language models for RL post-training."""

__version__ = "0.1.0"
