"""Shared bits of the command-line entry points: one-line errors, the --config flag with "did you
mean" help for misspelled fields, and the rollout's input checks before any heavy import (the
config's fields are checked by settings.load)."""

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
  """The rollout's settings (settings.load: every field) and every other check that needs no JAX
  (rollout.output_dir included: a file, read-only or not creatable), then the length history
  loaded against this model (runner.load_history, which runner.run applies too when called
  without one): (settings, history). Raises settings.ConfigError or runner.RolloutError."""
  from flexfloor_jax import rollout_inputs, runner, settings

  st = settings.load(config)
  model_cfg = rollout_inputs.model_config(st)
  r = st.rollout
  if not st.model.max_seq_len and r.max_prompt_len > model_cfg.max_position_embeddings:
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
  runner.check_output_dir(st)
  return st, runner.load_history(st, model_cfg)
