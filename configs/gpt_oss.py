"""GPT-OSS rollout config:
`python -m flexfloor_jax.rollout --config=configs/gpt_oss.py[:preset]`.

Presets: tiny (default; the gpt-oss-tiny model: attention biases and sinks, sliding and full
layers, YaRN, 16 experts with biases and the clamped SwiGLU, top-4, random init; runs on a laptop
CPU with emulated devices), 20b, 120b (published dimensions; TPU/GPU with a checkpoint, whose
config.json then decides every dimension; MXFP4 experts are dequantized on load). Every field is
that of configs/mixtral.py; override any with --config.section.field=value.
"""

import ml_collections

from flexfloor_jax.config.files import family_config

PRESETS = {"tiny": "gpt-oss-tiny", "20b": "gpt-oss-20b", "120b": "gpt-oss-120b"}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  c = family_config("gpt_oss", PRESETS, preset)
  c.scheduler.cost_model = "roofline:gpt-oss-20b@h100"  # the pair the tiny model stands for
  return c
