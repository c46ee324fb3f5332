"""Suite setup, before jax is imported: XLA_FLAGS (xla_env.py: 8 emulated CPU devices, and the
compile-speed CODEGEN flags unless FLEXFLOOR_TEST_XLA=user), the persistent compilation cache, the
`user_flags` tests skipped outside their own process, and one StepCachePool per process."""

import os

import checkout
import pytest
import xla_env

if xla_env.user_mode():
  os.environ["XLA_FLAGS"] = xla_env.user_flags(os.environ.get("XLA_FLAGS"))
else:
  os.environ.setdefault("XLA_FLAGS", xla_env.suite_flags())
# JAX writes the cache directory's path into every persistent-cache key (as XLA's GPU autotune
# cache directory, an option it sets on CPU too), so a copy of the cache at another path never
# hits. Without that option a key depends on the program and the flags only, and the SIGKILL
# test's child (rl/test_train.py) loads the executables from its copy of this cache instead of
# compiling them all again. Child processes inherit the setting with the environment.
os.environ.setdefault("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES", "none")


def pytest_configure(config):
  """The persistent compilation cache: keeps the suite inside CI's time limit on 2 cores. (jax is
  imported here, after XLA_FLAGS above, which its backend reads when it starts.)"""
  import jax
  jax.config.update("jax_compilation_cache_dir", checkout.CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_modifyitems(config, items):
  """Outside the user-flags process the `user_flags` tests skip: this process compiles with
  CODEGEN, and test_user_flags.py runs them in a process of their own."""
  if xla_env.user_mode():
    return
  skip = pytest.mark.skip(reason=f"compiled with the suite's CODEGEN flags here; run under a "
                          f"user's flags by test_user_flags.py ({xla_env.MODE_VAR}="
                          f"{xla_env.USER})")
  for item in items:
    if item.get_closest_marker("user_flags"):
      item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_executables():
  """After each file, JAX's in-memory caches go (a later file loads what it needs from the
  persistent cache): every loaded XLA:CPU executable holds memory maps, and a pytest process
  that kept every file's executables reached the kernel's limit (vm.max_map_count, 65,530)
  and died by a segfault in the next load."""
  yield
  import gc

  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def step_caches():
  """One engine.StepCachePool for this pytest process: runs of the same EngineSpec on the same
  devices (the canonical shapes of engine_utils.rollout_config above all) reuse the StepSets an
  earlier test compiled, across tests and files, instead of tracing, lowering and loading them
  from the persistent cache again. Tests of compiling itself take fresh caches."""
  from flexfloor_jax import engine
  return engine.StepCachePool()


@pytest.fixture
def no_compile(monkeypatch):
  """Reaching the engine (the first compile) fails the test: input checks must come before it."""
  from flexfloor_jax import engine

  def boom(*a, **k):
    raise AssertionError("reached the engine: a check came too late")
  monkeypatch.setattr(engine.Engine, "__init__", boom)
