"""The checkout under test (its root, where configs/ and colab/ lie), the suite's persistent
compilation cache, and the environment of the processes tests start (the package's CLIs)."""

import os
import pathlib

import xla_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
# conftest.py points jax at this directory; child processes share it, so that a program the suite
# compiled once is loaded, not compiled again, by every CLI a test runs.
CACHE = os.environ.get("FLEXFLOOR_JAX_CACHE", str(ROOT / ".jax_cache"))


def child_env(**extra: str) -> dict[str, str]:
  """This process's environment for a child that runs the package: the suite's cache, the suite's
  XLA flags without the device count (each CLI emulates its own devices), unbuffered output,
  then `extra`."""
  env = dict(os.environ)
  env["FLEXFLOOR_JAX_CACHE"] = CACHE
  env["XLA_FLAGS"] = xla_env.child_flags()
  env["PYTHONUNBUFFERED"] = "1"
  env.update(extra)
  return env
