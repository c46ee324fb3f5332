"""What every checkpoint reader shares: the file names that mark a format, the dtypes a checkpoint
may ask for, the one error type, and JSON reading that names the file."""

from __future__ import annotations

import json
from typing import Any

Params = dict[str, Any]

HF_CONFIG_FILE = "config.json"  # marks a Hugging Face directory
ORBAX_CONFIG_FILE = "model_config.json"
ORBAX_PARAMS_DIR = "params"

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

class CheckpointError(ValueError):
  """A checkpoint that cannot be used; the message names the file and the key or field."""


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path}: file not found") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from None
