"""Process-wide JAX setup of the entry points: emulated CPU devices, the persistent compilation
cache, and a per-process log in multi-process runs."""

import logging
import os

import jax


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
  jax.config.update("jax_compilation_cache_dir", path or cache_dir())
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size limit


def emulate_cpu_devices(n: int) -> None:
  """n devices on the CPU backend (harmless on TPU/GPU), through jax's config: any time before
  the first JAX operation, whatever was imported before. A device count already in XLA_FLAGS (a
  launcher's, per process) wins; once the backend has started (a notebook's or a test's process)
  its devices stay."""
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # the backend has started: its devices stay
    if jax.default_backend() == "cpu" and jax.device_count() != n:
      logging.warning("%d emulated CPU devices asked for after the backend started with %d",
                      n, jax.device_count())


def process_log(output_dir: str):
  """print(), and in a multi-process run also a line in <output_dir>/process_<k>.log (each
  process writes its own log; only process 0 writes the outputs)."""
  if jax.process_count() == 1:
    return print
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, f"process_{jax.process_index()}.log")

  def log(msg: str):
    print(msg)
    with open(path, "a") as f:
      f.write(msg + "\n")
  return log


