"""Hugging Face Mixtral checkpoints (config.json + safetensors), validated before any read.

A checkpoint decides the model's shape: `load_hf` takes every dimension from config.json; a preset's
dimensions apply only to random init. Everything is validated from config.json and the safetensors
headers (`inspect_hf`, no tensor is read) before anything is compiled, so a CLI fails in seconds.

Two safetensors key layouts are read (both are what `transformers` writes, depending on the call):
  hub    model.layers.N.block_sparse_moe.gate.weight [E, D]
         model.layers.N.block_sparse_moe.experts.E.{w1,w3}.weight [F, D], w2 [D, F]
         (the published Mixtral files, and what transformers 5.x `save_pretrained` writes by
         default: it converts its in-memory fused experts back to this layout)
  fused  model.layers.N.mlp.gate.weight [E, D]
         model.layers.N.mlp.experts.gate_up_proj [E, 2F, D] (gate rows first, then up)
         model.layers.N.mlp.experts.down_proj [E, D, F]
         (transformers 5.x in-memory layout: `save_pretrained(save_original_format=False)`)
Either MoE prefix (`block_sparse_moe` / `mlp`) is accepted with either expert layout.
HF matrices are [out, in]; ours are [in, out]: every matrix is transposed. w1 = gate, w3 = up,
w2 = down. Layers stack on axis 0 (names: transformer.py docstring).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import jax
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so safetensors' numpy reader has it
import numpy as np
from safetensors import safe_open

from flexfloor_jax.model.checkpoint_format import (
  DTYPES,
  HF_CONFIG_FILE,
  CheckpointError,
  Params,
  read_json,
)
from flexfloor_jax.model.config import ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = HF_CONFIG_FILE
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports carry; not parameters
# safetensors dtypes a parameter may have: floating point, cast to the model's dtype at load.
# An integer or fp8 tensor under a parameter's name would cast to garbage (quantized weights
# need their scales), so it is refused.
_FLOAT_TENSOR_DTYPES = ("F64", "F32", "F16", "BF16")


# ----------------------------------------------------------------------------- config.json


def config_from_hf(hf: dict, source: str = CONFIG_FILE) -> ModelConfig:
  """ModelConfig from a Mixtral config.json dict; every dimension comes from the file."""

  def field(name, default: Any = KeyError):  # KeyError: required
    if name in hf:
      return hf[name]
    if default is KeyError:
      raise CheckpointError(f"{source}: missing field '{name}'")
    return default

  def int_field(name, default: Any = KeyError) -> Any:  # an int, or the file's null
    v = field(name, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
      raise CheckpointError(f"{source}: field '{name}' must be an integer, got {v!r}")
    return v

  def num_field(name, default: Any = KeyError):
    v = field(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
      raise CheckpointError(f"{source}: field '{name}' must be a finite number, got {v!r}")
    return float(v)

  model_type = hf.get("model_type")
  if model_type != "mixtral":
    raise CheckpointError(f"{source}: field 'model_type' is {model_type!r}; only 'mixtral' is "
                          "supported")
  hidden, heads = int_field("hidden_size"), int_field("num_attention_heads")
  kv_heads = int_field("num_key_value_heads", None)
  head_dim = int_field("head_dim", None)
  # transformers 5 nests rope_theta in rope_parameters; 4.x has it top level.
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(rope, dict):
    raise CheckpointError(f"{source}: field 'rope_parameters' must be an object, got {rope!r}")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise CheckpointError(f"{source}: field 'rope_parameters.rope_type' is {rope_type!r}; only "
                          "'default' RoPE is supported")
  theta = rope.get("rope_theta", hf.get("rope_theta", 1e6))
  if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not math.isfinite(theta):
    raise CheckpointError(f"{source}: field 'rope_theta' must be a finite number, got {theta!r}")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise CheckpointError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")
  eos = hf.get("eos_token_id", 2)
  if isinstance(eos, (list, tuple)):  # several stop ids: the first one is the model's eos
    eos = eos[0] if eos else None
  bos = hf.get("bos_token_id", 1)
  for name, v in (("eos_token_id", eos), ("bos_token_id", bos)):
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
      raise CheckpointError(f"{source}: field '{name}' must be an integer, got {v!r}")
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if dtype not in DTYPES:
    raise CheckpointError(f"{source}: field 'dtype' is {dtype!r}; expected one of "
                          "float32, bfloat16, float16")
  sw = int_field("sliding_window", None)
  try:
    return ModelConfig(
        vocab_size=int_field("vocab_size"), hidden_size=hidden,
        intermediate_size=int_field("intermediate_size"),
        num_layers=int_field("num_hidden_layers"), num_heads=heads,
        num_kv_heads=kv_heads if kv_heads is not None else heads,
        head_dim=head_dim if head_dim is not None else hidden // heads,
        num_experts=int_field("num_local_experts"), top_k=int_field("num_experts_per_tok"),
        rope_theta=float(theta), rms_eps=num_field("rms_norm_eps", 1e-5),
        sliding_window=sw,
        max_position_embeddings=int_field("max_position_embeddings", 32768),
        eos_id=-1 if eos is None else eos,  # -1: no eos token, never matches
        bos_id=-1 if bos is None else bos,
        dtype=DTYPES[dtype])
  except (TypeError, ValueError, ZeroDivisionError) as e:
    if isinstance(e, CheckpointError):
      raise
    raise CheckpointError(f"{source}: {e}") from None


def _hf_config(path: str) -> tuple[ModelConfig, dict]:
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: checkpoint directory not found")
  cfg_path = os.path.join(path, CONFIG_FILE)
  hf = read_json(cfg_path)
  return config_from_hf(hf, cfg_path), hf


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


def _expected(cfg: ModelConfig, inv: dict[str, _Entry], tied: bool) -> dict[str, tuple]:
  """HF key -> expected HF shape, for the expert layout this checkpoint uses."""
  d, f, e, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.vocab_size
  qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  exp = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if not (tied and "lm_head.weight" not in inv):
    exp["lm_head.weight"] = (v, d)
  for n in range(cfg.num_layers):
    p = f"model.layers.{n}."
    exp.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (qd, d), p + "self_attn.k_proj.weight": (kd, d),
                p + "self_attn.v_proj.weight": (kd, d), p + "self_attn.o_proj.weight": (d, qd)})
    moe = _moe_prefix(inv, n)
    exp[f"{p}{moe}.gate.weight"] = (e, d)
    if f"{p}{moe}.experts.gate_up_proj" in inv or f"{p}{moe}.experts.down_proj" in inv:
      exp[f"{p}{moe}.experts.gate_up_proj"] = (e, 2 * f, d)
      exp[f"{p}{moe}.experts.down_proj"] = (e, d, f)
    else:
      for j in range(e):
        q = f"{p}{moe}.experts.{j}."
        exp.update({q + "w1.weight": (f, d), q + "w3.weight": (f, d), q + "w2.weight": (d, f)})
  return exp


def _moe_prefix(inv: dict, n: int) -> str:
  for moe in ("block_sparse_moe", "mlp"):
    if any(k.startswith(f"model.layers.{n}.{moe}.") for k in inv):
      return moe
  return "block_sparse_moe"  # neither present: report the hub name as missing


def _validate(path: str) -> tuple[ModelConfig, dict, dict[str, _Entry], dict[str, tuple]]:
  cfg, hf = _hf_config(path)
  inv = _inventory(path)
  tied = bool(hf.get("tie_word_embeddings", False))
  exp = _expected(cfg, inv, tied)
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
    if inv[key].dtype not in _FLOAT_TENSOR_DTYPES:
      raise CheckpointError(f"{inv[key].file}: key '{key}' has dtype {inv[key].dtype}; the "
                            f"model's dtype is {cfg.dtype} ({os.path.join(path, CONFIG_FILE)}) "
                            f"and only floating-point tensors ({', '.join(_FLOAT_TENSOR_DTYPES)}) "
                            "can be cast to it")
  for key, ent in inv.items():
    if key not in exp and not key.endswith(_IGNORED_SUFFIXES):
      raise CheckpointError(f"{ent.file}: unexpected key '{key}' (not part of a Mixtral with "
                            f"{cfg.num_layers} layers and {cfg.num_experts} experts)")
  return cfg, hf, inv, exp


def inspect_hf(path: str) -> ModelConfig:
  """Validate config.json and every key/shape from the safetensors headers; read no tensor."""
  return _validate(path)[0]


# ----------------------------------------------------------------------------- load HF


def load_hf(path: str, *, dtype: str | None = None, shardings: Any = None
            ) -> tuple[ModelConfig, Params]:
  """Read a Hugging Face Mixtral directory into our params layout.

  dtype: cast to this instead of config.json's dtype (the returned cfg says which).
  shardings: optional pytree of jax.sharding.Sharding matching the params, for device_put.
  Stacked arrays are preallocated and filled one tensor at a time, so host memory peaks at about
  one copy of the model (plus the device copy made at the end).
  """

  cfg, _, inv, exp = _validate(path)
  if dtype is not None:
    if dtype not in DTYPES:
      raise CheckpointError(f"dtype {dtype!r}: expected one of float32, bfloat16, float16")
    cfg = cfg.replace(dtype=DTYPES[dtype])
  dt = np.dtype(cfg.dtype)
  d, f, e, nl = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.num_layers
  qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layers = {"attn_norm": np.empty((nl, d), dt), "mlp_norm": np.empty((nl, d), dt),
            "wq": np.empty((nl, d, qd), dt), "wk": np.empty((nl, d, kd), dt),
            "wv": np.empty((nl, d, kd), dt), "wo": np.empty((nl, qd, d), dt),
            "router": np.empty((nl, d, e), dt), "w1": np.empty((nl, e, d, f), dt),
            "w3": np.empty((nl, e, d, f), dt), "w2": np.empty((nl, e, f, d), dt)}

  handles: dict[str, Any] = {}

  def get(key: str) -> np.ndarray:
    """The tensor cast to the model's dtype, every value finite: a NaN weight would otherwise
    run to the end and write NaN log-probs; checked after the cast, which can overflow."""
    fpath = inv[key].file
    if fpath not in handles:
      handles[fpath] = safe_open(fpath, framework="np").__enter__()
    with np.errstate(over="ignore"):  # an overflow is reported below, naming the tensor
      t = handles[fpath].get_tensor(key).astype(dt, copy=False)
    if not np.isfinite(t).all():
      n = int(t.size - np.count_nonzero(np.isfinite(t)))
      raise CheckpointError(f"{fpath}: tensor '{key}' holds {n} NaN or infinite value(s) (as "
                            f"{cfg.dtype})")
    return t

  try:
    embed = get("model.embed_tokens.weight")
    final_norm = get("model.norm.weight")
    lm_head = np.ascontiguousarray((get("lm_head.weight") if "lm_head.weight" in exp else embed).T)
    for n in range(nl):
      p = f"model.layers.{n}."
      layers["attn_norm"][n] = get(p + "input_layernorm.weight")
      layers["mlp_norm"][n] = get(p + "post_attention_layernorm.weight")
      for ours, hf_name in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")):
        layers[ours][n] = get(f"{p}self_attn.{hf_name}_proj.weight").T
      moe = _moe_prefix(inv, n)
      layers["router"][n] = get(f"{p}{moe}.gate.weight").T
      fused = f"{p}{moe}.experts.gate_up_proj"
      if fused in exp:
        gate_up = get(fused)  # [E, 2F, D]: gate rows, then up rows
        layers["w1"][n] = np.swapaxes(gate_up[:, :f], 1, 2)
        layers["w3"][n] = np.swapaxes(gate_up[:, f:], 1, 2)
        del gate_up
        layers["w2"][n] = np.swapaxes(get(f"{p}{moe}.experts.down_proj"), 1, 2)
      else:
        for j in range(e):
          q = f"{p}{moe}.experts.{j}."
          layers["w1"][n, j] = get(q + "w1.weight").T
          layers["w3"][n, j] = get(q + "w3.weight").T
          layers["w2"][n, j] = get(q + "w2.weight").T
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)

  params = {"embed": embed, "layers": layers, "final_norm": final_norm, "lm_head": lm_head}
  if shardings is not None:
    params = jax.tree.map(jax.device_put, params, shardings)
  else:
    params = jax.tree.map(jax.numpy.asarray, params)
  return cfg, params
