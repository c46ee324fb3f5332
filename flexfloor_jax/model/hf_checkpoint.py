"""Hugging Face checkpoints (config.json + safetensors) of the supported families, validated
before any read.

A checkpoint decides the model's family (`model_type`, model/families/) and shape: `load_hf` takes
every dimension and block choice from config.json; a preset's apply only to random init.
Everything is validated from config.json and the safetensors headers (`inspect_hf`, no tensor is
read) before anything is compiled, so a CLI fails in seconds. The family names every tensor, its
shape and where it lands (its key layouts: the family modules' docstrings). HF matrices are
[out, in]; ours are [in, out]. Layers stack on axis 0 (names: transformer.py docstring).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from typing import Any

import jax
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so safetensors' numpy reader has it
import numpy as np
from safetensors import safe_open

from flexfloor_jax.model import families
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.checkpoint_format import (
  DTYPES,
  HF_CONFIG_FILE,
  CheckpointError,
  Params,
  read_json,
)
from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.model.families.base import TOP_LEVEL, dequantize_fp8_block, dequantize_mxfp4

log = logging.getLogger(__name__)

CONFIG_FILE = HF_CONFIG_FILE
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports carry; not parameters
# safetensors dtypes a parameter may have: floating point, cast to the model's dtype at load.
# An integer or fp8 tensor under a parameter's name would cast to garbage (quantized weights
# need their scales), so it is refused.
_FLOAT_TENSOR_DTYPES = ("F64", "F32", "F16", "BF16")
# dtypes of a quantized weight's codes and scales, by Weight.quant
_QUANT_DTYPES = {"mxfp4": ("U8", "U8"), "fp8": ("F8_E4M3", "F32")}


# ----------------------------------------------------------------------------- config.json


def config_from_hf(hf: dict, source: str = CONFIG_FILE) -> ModelConfig:
  """ModelConfig from a config.json dict; its model_type picks the family, and every dimension
  and block choice comes from the file."""
  return families.config_from_hf(hf, source)


def _hf_config(path: str) -> tuple[ModelConfig, dict]:
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: checkpoint directory not found")
  cfg_path = os.path.join(path, CONFIG_FILE)
  hf = read_json(cfg_path)
  return with_generation_stops(config_from_hf(hf, cfg_path), path), hf


def with_generation_stops(cfg: ModelConfig, path: str) -> ModelConfig:
  """`cfg` with the stop ids of the checkpoint's generation_config.json added: what
  transformers' generate() stops on (Qwen3 and GPT-OSS list more there than config.json does)."""
  gen_path = os.path.join(path, GENERATION_CONFIG_FILE)
  if not os.path.isfile(gen_path):
    return cfg
  eos = read_json(gen_path).get("eos_token_id")
  ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
  for i in ids:
    if not isinstance(i, int) or isinstance(i, bool) or i < 0:
      raise CheckpointError(f"{gen_path}: field 'eos_token_id' must be token ids, got {eos!r}")
  if cfg.eos_id < 0 and ids:
    cfg = cfg.replace(eos_id=ids[0])
  extra = tuple(dict.fromkeys(i for i in ids if i not in cfg.stop_ids))
  return cfg.replace(extra_eos_ids=cfg.extra_eos_ids + extra) if extra else cfg


# ----------------------------------------------------------------------------- key inventory


@dataclasses.dataclass(frozen=True)
class _Entry:
  file: str  # absolute path of the .safetensors file holding the key
  shape: tuple
  dtype: str


def _inventory(path: str) -> dict[str, _Entry]:
  """key -> (file, shape, dtype) from the index (if any) and the safetensors headers only."""

  index_path = os.path.join(path, INDEX_FILE)
  if os.path.exists(index_path):
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f"{index_path}: missing or empty field 'weight_map'")
    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
      by_file.setdefault(fname, []).append(key)
    for fname, keys in by_file.items():
      if not os.path.exists(os.path.join(path, fname)):
        raise CheckpointError(f"{index_path}: file '{fname}' named for key '{keys[0]}' "
                              f"(and {len(keys) - 1} more) does not exist in {path}")
    files: dict[str, list[str] | None] = dict(by_file)
  else:
    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not names:
      raise CheckpointError(f"{path}: no *.safetensors file (and no {INDEX_FILE})")
    weight_map = None
    files = {n: None for n in names}

  inv: dict[str, _Entry] = {}
  for fname, keys in files.items():
    fpath = os.path.join(path, fname)
    try:
      with safe_open(fpath, framework="np") as f:
        present = set(f.keys())
        if keys is not None:
          for key in keys:
            if key not in present:
              raise CheckpointError(f"{fpath}: missing key '{key}' (named by {index_path})")
        for key in present:
          if weight_map is not None and weight_map.get(key) != fname:
            continue  # the index decides which file owns a key
          sl = f.get_slice(key)
          inv[key] = _Entry(fpath, tuple(sl.get_shape()), sl.get_dtype())
    except CheckpointError:
      raise
    except Exception as e:  # corrupt header, truncated file
      raise CheckpointError(f"{fpath}: cannot read safetensors header ({e})") from None
  return inv


def _weights(cfg: ModelConfig, inv: dict[str, _Entry], tied: bool) -> list[families.Weight]:
  """The checkpoint's tensors as its family names them, for the layout this checkpoint uses."""
  return families.FAMILIES[cfg.family].weights(cfg, inv.keys(), tied)


def _validate(path: str) -> tuple[ModelConfig, dict, dict[str, _Entry], list[families.Weight]]:
  cfg, hf = _hf_config(path)
  inv = _inventory(path)
  tied = bool(hf.get("tie_word_embeddings", False))
  weights = _weights(cfg, inv, tied)
  exp = {w.key: w.shape for w in weights}
  # quantized tensors: the codes and their scales are not cast but decoded
  packed = {w.key: _QUANT_DTYPES[w.quant][0] for w in weights if w.quant}
  exp.update({w.scales_key: w.scales_shape for w in weights if w.quant})
  packed.update({w.scales_key: _QUANT_DTYPES[w.quant][1] for w in weights if w.quant})
  files = sorted({ent.file for ent in inv.values()})
  if os.path.exists(os.path.join(path, INDEX_FILE)):
    where = os.path.join(path, INDEX_FILE)
  else:
    where = files[0] if len(files) == 1 else ", ".join(files)
  for key, shape in exp.items():
    if key not in inv:
      raise CheckpointError(f"{where}: missing key '{key}' (expected shape {shape} from "
                            f"{os.path.join(path, CONFIG_FILE)})")
    if inv[key].shape != shape:
      raise CheckpointError(f"{inv[key].file}: key '{key}' has shape {inv[key].shape}, expected "
                            f"{shape} from {os.path.join(path, CONFIG_FILE)}")
    if key in packed:
      if inv[key].dtype != packed[key]:
        raise CheckpointError(f"{inv[key].file}: key '{key}' has dtype {inv[key].dtype}; a "
                              f"quantized weight's codes and scales here are {packed[key]}")
    elif inv[key].dtype not in _FLOAT_TENSOR_DTYPES:
      raise CheckpointError(f"{inv[key].file}: key '{key}' has dtype {inv[key].dtype}; the "
                            f"model's dtype is {cfg.dtype} ({os.path.join(path, CONFIG_FILE)}) "
                            f"and only floating-point tensors ({', '.join(_FLOAT_TENSOR_DTYPES)}) "
                            "can be cast to it")
  family = families.FAMILIES[cfg.family]
  skip, what = family.ignored(hf, cfg) if family.ignored else ((), "")
  skipped = [k for k in inv if k not in exp and skip and k.startswith(skip)]
  if skipped:
    log.info("%s: not loading %d tensors of %s", path, len(skipped), what)
  for key, ent in inv.items():
    if key not in exp and not key.endswith(_IGNORED_SUFFIXES) and not (skip
                                                                       and key.startswith(skip)):
      display = families.FAMILIES[cfg.family].display
      raise CheckpointError(f"{ent.file}: unexpected key '{key}' (not part of a {display} with "
                            f"{cfg.num_layers} layers and {cfg.num_experts} experts)")
  return cfg, hf, inv, weights


def _read_bytes(fpath: str, key: str, shape: tuple) -> np.ndarray:
  """One one-byte-per-value tensor of a safetensors file, read from its header's offsets."""
  with open(fpath, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    start, end = json.loads(f.read(n))[key]["data_offsets"]
    f.seek(8 + n + start)
    return np.frombuffer(f.read(end - start), np.uint8).reshape(shape)


def inspect_hf(path: str) -> ModelConfig:
  """Validate config.json and every key/shape from the safetensors headers; read no tensor."""
  return _validate(path)[0]


# ----------------------------------------------------------------------------- load HF


def load_hf(path: str, *, dtype: str | None = None, shardings: Any = None
            ) -> tuple[ModelConfig, Params]:
  """Read a Hugging Face directory of a supported family into our params layout.

  dtype: cast to this instead of config.json's dtype (the returned cfg says which).
  shardings: optional pytree of jax.sharding.Sharding matching the params, for device_put.
  Stacked arrays are preallocated and filled one tensor at a time, so host memory peaks at about
  one copy of the model (plus the device copy made at the end). Parts of a stack that no tensor
  fills (the expert weights of a dense layer and the reverse) stay zero.
  """

  cfg, _, inv, weights = _validate(path)
  if dtype is not None:
    if dtype not in DTYPES:
      raise CheckpointError(f"dtype {dtype!r}: expected one of float32, bfloat16, float16")
    cfg = cfg.replace(dtype=DTYPES[dtype])
  dt = np.dtype(cfg.dtype)
  shapes = tfm.param_shapes(cfg)
  top = {k: np.zeros(shapes[k].shape, dt) for k in TOP_LEVEL}
  layers = {k: np.zeros(v.shape, dt) for k, v in shapes["layers"].items()}

  handles: dict[str, Any] = {}

  def read(key: str) -> np.ndarray:
    fpath = inv[key].file
    if fpath not in handles:
      handles[fpath] = safe_open(fpath, framework="np").__enter__()
    return handles[fpath].get_tensor(key)

  def read_raw(key: str) -> np.ndarray:
    """A tensor's bytes as uint8 of its shape: float8 codes, which safetensors' numpy reader
    has no dtype for."""
    return _read_bytes(inv[key].file, key, inv[key].shape)

  def get(w: families.Weight) -> np.ndarray:
    """The tensor (MXFP4: dequantized) cast to the model's dtype, every value finite: a NaN
    weight would otherwise run to the end and write NaN log-probs; checked after the cast, which
    can overflow."""
    key, fpath = w.key, inv[w.key].file
    with np.errstate(over="ignore"):  # an overflow is reported below, naming the tensor
      if w.quant == "fp8":
        t = dequantize_fp8_block(read_raw(key), read(w.scales_key), w.block).astype(
            dt, copy=False)
      elif w.quant:
        t = dequantize_mxfp4(read(key), read(w.scales_key)).astype(dt, copy=False)
      else:
        t = read(key).astype(dt, copy=False)
    if not np.isfinite(t).all():
      n = int(t.size - np.count_nonzero(np.isfinite(t)))
      raise CheckpointError(f"{fpath}: tensor '{key}' holds {n} NaN or infinite value(s) (as "
                            f"{cfg.dtype})")
    return t

  try:
    for w in weights:
      t = get(w)
      for put in w.puts:
        if put.leaf in top:
          top[put.leaf][...] = put.fn(t)
        else:
          layers[put.leaf][put.index] = put.fn(t)
      del t
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)

  params = {**top, "layers": layers}
  if shardings is not None:
    params = jax.tree.map(jax.device_put, params, shardings)
  else:
    params = jax.tree.map(jax.numpy.asarray, params)
  return cfg, params
