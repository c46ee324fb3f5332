"""Checkpoints on disk: which format a directory holds, orbax save and restore, and the finite
checks of loaded weights. Hugging Face directories are read by `hf_checkpoint`; `load_checkpoint`
and `inspect_checkpoint` take either.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import typing
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from flexfloor_jax.model import hf_checkpoint
from flexfloor_jax.model.checkpoint_format import (
  DTYPES,
  HF_CONFIG_FILE,
  ORBAX_CONFIG_FILE,
  ORBAX_PARAMS_DIR,
  CheckpointError,
  Params,
  read_json,
)
from flexfloor_jax.model.config import ModelConfig

log = logging.getLogger(__name__)

def _is_orbax_dir(path: str) -> bool:
  return (os.path.isfile(os.path.join(path, ORBAX_CONFIG_FILE))
          and os.path.isdir(os.path.join(path, ORBAX_PARAMS_DIR)))


def save_orbax(path: str, params: Params, cfg: ModelConfig) -> None:
  """Params (sharded or not) under path/params with orbax; the ModelConfig as JSON beside it.
  Blocks until written. Multi-host: every process calls this with its shards."""

  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(path, ORBAX_PARAMS_DIR), params, force=True)
  ckptr.wait_until_finished()
  ckptr.close()
  if jax.process_index() == 0:
    tmp = os.path.join(path, ORBAX_CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
      json.dump(dataclasses.asdict(cfg), f, indent=1)
    os.replace(tmp, os.path.join(path, ORBAX_CONFIG_FILE))


def _json_type_error(value, hint) -> str | None:
  """What is wrong with a JSON `value` for a ModelConfig field typed `hint` (None: nothing).
  JSON's types taken strictly: a boolean is not a number, a number not a string."""
  args = typing.get_args(hint)
  if type(None) in args:  # Optional[...]
    if value is None:
      return None
    hint = next(a for a in args if a is not type(None))
  if hint is bool:
    ok = isinstance(value, bool)
  elif hint is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
  elif hint is float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))
  elif hint is str:
    ok = isinstance(value, str)
  else:  # tuple[int, ...]: a JSON list of integers
    ok = isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in value)
  name = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else "list of ints"
  return None if ok else f"must be {name}, got {value!r}"


def _orbax_config(path: str) -> ModelConfig:
  """model_config.json of an orbax directory, every field's JSON type checked, and the
  parameters' tree listed beside it (an interrupted or foreign save has none): no array read."""
  if not _is_orbax_dir(path):
    raise CheckpointError(f"{path}: not an orbax checkpoint (needs {ORBAX_CONFIG_FILE} and "
                          f"{ORBAX_PARAMS_DIR}/)")
  cfg_path = os.path.join(path, ORBAX_CONFIG_FILE)
  raw = read_json(cfg_path)
  if not isinstance(raw, dict):
    raise CheckpointError(f"{cfg_path}: must hold a JSON object, got {type(raw).__name__}")
  names = {fl.name for fl in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(raw) - names)
  if unknown:
    raise CheckpointError(f"{cfg_path}: unknown field '{unknown[0]}'")
  hints = typing.get_type_hints(ModelConfig)
  for k, v in raw.items():
    bad = _json_type_error(v, hints[k])
    if bad:
      raise CheckpointError(f"{cfg_path}: field '{k}' {bad}")
  meta_path = os.path.join(path, ORBAX_PARAMS_DIR, "_METADATA")
  if not os.path.isfile(meta_path):
    raise CheckpointError(f"{os.path.join(path, ORBAX_PARAMS_DIR)}: holds no saved parameters "
                          "(no orbax _METADATA: an interrupted or foreign save)")
  tree = read_json(meta_path)
  if not isinstance(tree, dict) or not isinstance(tree.get("tree_metadata"), dict) or not (
      tree["tree_metadata"]):
    raise CheckpointError(f"{meta_path}: lists no parameters")
  try:
    return ModelConfig(**raw)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{cfg_path}: {e}") from None


@functools.cache
def _finite_program():
  return jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))


def finite_flags(arrays) -> list[bool]:
  """Whether each array holds only finite values, from one compiled program and one transfer.
  One program per array would put a cross-device reduction per array in flight at once on a
  sharded tree, and XLA:CPU can then leave one device's participant of an all-reduce unscheduled
  until its rendezvous timeout aborts the process."""
  arrays = list(arrays)
  if not arrays:
    return []
  return [bool(f) for f in jax.device_get(_finite_program()(arrays))]


def _check_params(params: Params, where: str, cfg: ModelConfig) -> None:
  """Every array floating point and finite; CheckpointError naming the first bad tensor
  otherwise."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  for kp, x in leaves:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise CheckpointError(f"{where}: tensor '{jax.tree_util.keystr(kp)}' has dtype {x.dtype}; "
                            f"the model's dtype is {cfg.dtype}")
  ok = finite_flags(x for _, x in leaves)
  for (kp, _), good in zip(leaves, ok, strict=True):
    if not good:
      raise CheckpointError(f"{where}: tensor '{jax.tree_util.keystr(kp)}' holds NaN or "
                            f"infinite values (as {cfg.dtype})")


def load_orbax(path: str, shardings: Any = None) -> tuple[ModelConfig, Params]:
  """Restore (cfg, params). With `shardings` (a pytree of jax.sharding.Sharding matching the
  params) each array is restored straight onto it, whatever mesh it was saved from; without,
  every array goes to the first local device."""

  path = os.path.abspath(path)
  cfg = _orbax_config(path)
  params_dir = os.path.join(path, ORBAX_PARAMS_DIR)
  ckptr = ocp.StandardCheckpointer()
  try:
    meta = ckptr.metadata(params_dir)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if shardings is None:
      dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      shardings = jax.tree.map(lambda _: dev, tree)
    target = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s),
                          tree, shardings)
    params = ckptr.restore(params_dir, target)
  finally:
    ckptr.close()
  _check_params(params, params_dir, cfg)
  return cfg, params


# ----------------------------------------------------------------------------- dispatcher


def inspect_checkpoint(path: str) -> ModelConfig:
  """The ModelConfig of a HF or orbax checkpoint without reading any tensor (fail fast)."""
  if os.path.isfile(os.path.join(path, HF_CONFIG_FILE)):
    return hf_checkpoint.inspect_hf(path)
  if _is_orbax_dir(path):
    return _orbax_config(os.path.abspath(path))
  raise CheckpointError(f"{path}: not a checkpoint (no {HF_CONFIG_FILE} for Hugging Face, no "
                        f"{ORBAX_CONFIG_FILE} + {ORBAX_PARAMS_DIR}/ for orbax)")


def load_checkpoint(path: str, preset_cfg: ModelConfig | None = None, *,
                    dtype: str | None = None, shardings: Any = None
                    ) -> tuple[ModelConfig, Params] | None:
  """'' -> None (the caller does random init with preset_cfg); a directory with config.json ->
  Hugging Face; an orbax directory (save_orbax) -> orbax. The checkpoint's dimensions win over
  the preset's; differences are logged."""
  if not path:
    return None
  if os.path.isfile(os.path.join(path, HF_CONFIG_FILE)):
    cfg, params = hf_checkpoint.load_hf(path, dtype=dtype, shardings=shardings)
  elif _is_orbax_dir(path):
    cfg, params = load_orbax(path, shardings=shardings)
    if dtype is not None and DTYPES.get(dtype, dtype) != cfg.dtype:
      cfg = cfg.replace(dtype=DTYPES.get(dtype, dtype))
      params = jax.tree.map(lambda x: x.astype(cfg.dtype), params)
      _check_params(params, os.path.join(path, ORBAX_PARAMS_DIR), cfg)  # the cast may overflow
  else:
    raise CheckpointError(f"{path}: not a checkpoint (no {HF_CONFIG_FILE} for Hugging Face, no "
                          f"{ORBAX_CONFIG_FILE} + {ORBAX_PARAMS_DIR}/ for orbax)")
  if preset_cfg is not None:
    diff = {k: (getattr(preset_cfg, k), getattr(cfg, k)) for k in
            ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "num_experts", "top_k")
            if getattr(preset_cfg, k) != getattr(cfg, k)}
    if diff:
      log.info("checkpoint %s overrides preset dimensions (preset, checkpoint): %s", path, diff)
  return cfg, params
