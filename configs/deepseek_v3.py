"""DeepSeek-V3 family rollout config (DeepSeek-V3/R1, Kimi-K2, Moonlight):
`python -m flexfloor_jax.rollout --config=configs/deepseek_v3.py[:preset]`.

Presets: tiny (default; the deepseek-v3-tiny model: multi-head latent attention with a latent
cache, sigmoid routing with a correction bias over 4 expert groups, a shared expert, a dense
first layer, YaRN; random init; runs on a laptop CPU with emulated devices), 671b (DeepSeek-V3
/ R1), moonlight (Moonlight-16B-A3B), kimi-k2 (published dimensions; TPU/GPU with a checkpoint,
whose config.json then decides every dimension; block-FP8 weights are dequantized on load and
multi-token prediction layers skipped). Every field is that of configs/mixtral.py; override any
with --config.section.field=value.
"""

import ml_collections

from flexfloor_jax.config.files import family_config

PRESETS = {"tiny": "deepseek-v3-tiny", "671b": "deepseek-v3", "moonlight": "moonlight-16b-a3b",
           "kimi-k2": "kimi-k2"}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  c = family_config("deepseek_v3", PRESETS, preset)
  # the pair the tiny model stands for: a DeepSeek-V3-family model that an 8-device group holds
  c.scheduler.cost_model = "roofline:moonlight-16b-a3b@h100"
  return c
