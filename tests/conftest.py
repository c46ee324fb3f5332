"""Tests emulate 8 CPU devices; XLA_FLAGS (xla_env.py) must be set before jax is imported."""

import os

import xla_env

os.environ.setdefault("XLA_FLAGS", xla_env.suite_flags())

import jax  # noqa: E402

# Persistent compilation cache: keeps the suite inside CI's time limit on 2 cores.
_CACHE = os.environ.get("FLEXFLOOR_JAX_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# With `-n 2 --dist loadfile` (README) each file runs whole on one worker, files handed out in
# collection order: start the longest (cold cache) first so that no long file is
# left for the end while the other worker idles.
_LONGEST_FIRST = ("test_elastic.py", "test_distributed.py", "test_rl_train.py", "test_bench.py",
                  "test_rl_grpo.py", "test_ep.py", "test_notebooks.py", "test_cli.py",
                  "test_paged_engine.py", "test_sim.py", "test_kernels.py", "test_engine.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda it: rank.get(os.path.basename(str(it.fspath)), len(rank)))
