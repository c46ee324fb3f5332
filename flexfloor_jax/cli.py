"""Shared bits of the command-line entry points: one-line errors, the --config flag with "did you
mean" help for misspelled fields, and the field checks every entry point runs before any heavy
import (rollout, sft, train)."""

import math
import os
import re
import sys


def fail(msg: str) -> None:
  """One clear line on stderr and a non-zero exit (no traceback for bad input)."""
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


# ----------------------------------------------------------------------------- --config flag


def unknown_override(err: Exception) -> None:
  """A --config.a.b=v override naming a field the config lacks: ml_collections raises a bare
  KeyError/AttributeError (while the flag is defined, or while parsing): one line instead, with
  ml_collections' own "Did you mean" hint."""
  msg = err
  while isinstance(msg, BaseException):
    msg = msg.args[0] if msg.args else str(msg)
  lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()] or [""]
  key, hint = lines[0].strip("\"'"), " ".join(lines[1:])
  given = [a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--config.")]
  bad = [a for a in given if key in a[len("--config."):].split(".")] or given
  fail(f"{bad[0] if bad else '--config'}: no such config field {key!r}" +
       (f" ({hint})" if hint else ""))


def define_config(default: str, help_: str):
  """config_flags.DEFINE_config_file('config', ...); a misspelled override fails in one line."""
  from ml_collections import config_flags
  try:
    return config_flags.DEFINE_config_file("config", default, help_)
  except (AttributeError, KeyError) as e:
    unknown_override(e)


def config_file_error(e: OSError) -> None:
  lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
  fail(f"--config: {lines[-1] if lines else e}")


def parse_flags(argv):
  """absl's parser, but a bad flag (an unknown preset raises inside the config file, a misspelled
  field) is one line on stderr, not ml_collections' embedded traceback plus a usage hint."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) <= 1:
      fail(lines[0] if lines else type(e).__name__)
    head = lines[0].split(": Error whilst parsing config file")[0].rstrip(":")
    last = re.sub(r"^[A-Za-z_.]*(Error|Exception): ", "", lines[-1])
    fail(f"{head}: {last}")
  except OSError as e:  # a missing config file, hit while applying --config.x overrides to it
    config_file_error(e)
  except (AttributeError, KeyError) as e:
    unknown_override(e)


def config_loaded(config) -> None:
  """A config file that failed to load raises on first access (ml_collections defers it)."""
  try:
    config.mesh  # noqa: B018
  except OSError as e:
    config_file_error(e)


# ----------------------------------------------------------------------------- field checks


class ConfigError(ValueError):
  """A config field with a value no run can use; the message names the field."""


DTYPES = ("float32", "bfloat16", "float16")


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_int(config, name: str, lo: int = 1) -> None:
  """Field `name` (dotted) must be an integer >= lo."""
  v = _get(config, name)
  if not _is_int(v) or v < lo:
    raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")


def check_num(config, name: str, lo: float = 0.0, hi: float = math.inf, *,
              lo_open: bool = False, hi_open: bool = False) -> None:
  """Field `name` (dotted) must be a finite number in the interval lo..hi."""
  v = _get(config, name)
  ok = _is_num(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
  if not ok:
    iv = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open or hi == math.inf else ']'}"
    raise ConfigError(f"{name} must be a finite number in {iv}, got {v!r}")


def _get(config, name: str):
  v = config
  for part in name.split("."):
    v = v[part]
  return v


def validate_common(config) -> None:
  """Fields of the model / mesh / rollout sections that the runner does not check, or checks
  only after loading the model and compiling (a JAX error then). Numpy-free, jax-free."""
  m, r = config.model, config.rollout
  if m.dtype not in DTYPES:
    extra = (" (JAX computes float64 as float32 unless jax_enable_x64 is set: the run would not "
             "be what was asked)" if m.dtype == "float64" else "")
    raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {m.dtype!r}{extra}")
  check_int(config, "model.max_seq_len", 0)  # 0 = longest prompt + max_new_tokens (the runner)
  for name in ("rollout.max_prompt_len", "rollout.max_new_tokens",
               "rollout.samples_per_prompt", "rollout.slots_per_worker",
               "rollout.steps_per_dispatch", "rollout.num_prompts"):
    check_int(config, name)
  check_int(config, "mesh.num_devices", 0)
  check_int(config, "rollout.epoch", 0)
  gb = config.mesh.device_memory_gb
  if not _is_num(gb) or gb < 0:
    raise ConfigError(f"mesh.device_memory_gb must be a number >= 0 (0 = the device's own "
                      f"memory), got {gb!r}")
  if m.max_seq_len and r.max_prompt_len > m.max_seq_len:
    raise ConfigError(f"rollout.max_prompt_len={r.max_prompt_len} exceeds model.max_seq_len="
                      f"{m.max_seq_len} (the prefill writes max_prompt_len positions into a KV "
                      "cache of max_seq_len)")
  for name in ("model.checkpoint", "rollout.prompts", "rollout.output_dir",
               "scheduler.history_path"):
    if not isinstance(_get(config, name), str):
      raise ConfigError(f"{name} must be a string, got {_get(config, name)!r}")


def load_config(name: str, preset: str = ""):
  """get_config(preset) of configs/<name>.py, loaded by path as config_flags loads config files
  (so that it works from any working directory)."""
  import importlib.util
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"_flexfloor_configs_{name}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(preset)


def cache_dir() -> str:
  """The persistent compilation cache's directory: $FLEXFLOOR_JAX_CACHE, else
  ~/.cache/flexfloor_jax/xla."""
  return os.environ.get("FLEXFLOOR_JAX_CACHE",
                        os.path.join(os.path.expanduser("~"), ".cache", "flexfloor_jax", "xla"))


def enable_compilation_cache(path: str | None = None) -> None:
  """JAX's persistent compilation cache, keeping every executable: a second run compiles
  nothing. JAX's defaults skip compiles under a second, and a mesh size's movers and warm-up ops
  each compile in well under that; recompiled on every run, they made a warm start as slow as a
  cold one for the sizes a release waits for."""
  import jax
  jax.config.update("jax_compilation_cache_dir", path or cache_dir())
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size limit


def emulate_cpu_devices(n: int) -> None:
  """Ask XLA:CPU for n devices; harmless on TPU/GPU. Must run before jax is imported."""
  if "jax" in sys.modules:
    return
  flag = f"--xla_force_host_platform_device_count={n}"
  cur = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in cur:
    os.environ["XLA_FLAGS"] = (cur + " " + flag).strip()


def process_log(output_dir: str):
  """print(), and in a multi-process run also a line in <output_dir>/process_<k>.log (each
  process writes its own log; only process 0 writes the outputs)."""
  import jax
  if jax.process_count() == 1:
    return print
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, f"process_{jax.process_index()}.log")

  def log(msg: str):
    print(msg)
    with open(path, "a") as f:
      f.write(msg + "\n")
  return log


def prepare_rollout(config):
  """Every check that needs no JAX (rollout.output_dir included: a file, read-only or not
  creatable), then the length history loaded against this model (runner.load_history, which
  runner.run applies too when called without one). Raises runner.RolloutError or
  cli.ConfigError."""
  from flexfloor_jax import rollout_inputs, runner

  validate_common(config)
  runner.validate_config(config)
  model_cfg = rollout_inputs.model_config(config)
  r = config.rollout
  if not config.model.max_seq_len and r.max_prompt_len > model_cfg.max_position_embeddings:
    raise runner.RolloutError(
        f"rollout.max_prompt_len={r.max_prompt_len} exceeds the model's max_position_embeddings="
        f"{model_cfg.max_position_embeddings}, the longest KV cache (model.max_seq_len) it allows")
  if r.prompts and os.path.isfile(r.prompts):
    # One pass over the lines (JSON, objects, valid Unicode) so that a bad line fails before jax
    # starts; the runner checks each row's fields and lengths once the tokenizer is loaded.
    from flexfloor_jax.policy.jsonl import iter_jsonl
    try:
      for _ in iter_jsonl(r.prompts):
        pass
    except ValueError as e:
      raise runner.RolloutError(f"rollout.prompts: {e}") from None
  runner.check_output_dir(config)
  return runner.load_history(config, model_cfg)
