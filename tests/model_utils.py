"""Shared helpers for the model-level tests of query rows (model/test_chunk_rows.py,
model/test_draft_rows.py): parameters whose every term shows, and caches full of stale values."""

from __future__ import annotations

import jax

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS, ModelConfig

# Each family's tiny preset. GPT-OSS's window is cut to 6 so that its rings (the window + the
# query rows one sequence has in a step, less one) wrap within the steps of the tests; Mixtral
# also runs with a window on every layer (every layer a ring, no full layer: the other branch of
# the ring decode).
FAMILIES: dict[str, ModelConfig] = {
    "mixtral": PRESETS["tiny"],
    "mixtral-sliding": PRESETS["tiny"].replace(sliding_window=6),
    "qwen3-moe": PRESETS["qwen3-tiny"],
    "gpt-oss": PRESETS["gpt-oss-tiny"].replace(sliding_window=6),
    "deepseek-v3": PRESETS["deepseek-v3-tiny"],
}


def noisy_params(cfg: ModelConfig, seed: int):
  """Random weights and biases (scale 0.1: logits not flat) and random norms (not ones), so a
  norm or bias that a path dropped would show."""
  p = tfm.init_params(cfg, jax.random.key(seed), scale=0.1)
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))

  def noisy(path, x):
    if str(getattr(path[-1], "key", "")).endswith("norm"):
      return x * (1 + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype))
    return x

  return jax.tree_util.tree_map_with_path(noisy, p)


def random_cache(cache, seed: int):
  """`cache` with every value random: what the live sequences' history and the stale rows of
  earlier sequences leave."""
  leaves, tree = jax.tree.flatten(cache)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype)
                                   for k, x in zip(keys, leaves, strict=True)])
