"""Shared bits of the command-line entry points."""

import os
import sys


def fail(msg: str) -> None:
  """One clear line on stderr and a non-zero exit (no traceback for bad input)."""
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def load_config(name: str, preset: str = ""):
  """get_config(preset) of configs/<name>.py, loaded by path as config_flags loads config files
  (configs/ is a folder of files, not a package)."""
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
