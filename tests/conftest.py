"""Tests emulate 8 CPU devices; XLA_FLAGS (xla_env.py) must be set before jax is imported."""

import os

import xla_env

os.environ.setdefault("XLA_FLAGS", xla_env.suite_flags())
# JAX writes the cache directory's path into every persistent-cache key (as XLA's GPU autotune
# cache directory, an option it sets on CPU too), so a copy of the cache at another path never
# hits. Without that option a key depends on the program and the flags only, and the SIGKILL
# test's child (test_rl_train.py) loads the executables from its copy of this cache instead of
# compiling them all again. Child processes inherit the setting with the environment.
os.environ.setdefault("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES", "none")

import jax  # noqa: E402
import pytest  # noqa: E402

# Persistent compilation cache: keeps the suite inside CI's time limit on 2 cores.
_CACHE = os.environ.get("FLEXFLOOR_JAX_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# With `-n 2 --dist loadfile` (README) each file runs whole on one worker. xdist hands the files
# out by their number of tests, most first, which mixes long files with short ones; handed out
# longest first instead (`--no-loadscope-reorder`), the long files ran side by side and the cold
# suite was not faster (it is CPU-bound). This order only breaks ties: among files with as many
# tests, the longest first.
_LONGEST_FIRST = ("test_elastic.py", "test_distributed.py", "test_rl_grpo.py", "test_rl_train.py",
                  "test_ep.py", "test_bench.py", "test_notebooks.py", "test_cli.py",
                  "test_paged_engine.py", "test_kernels.py", "test_sim.py", "test_engine.py",
                  "test_rl_parity.py", "test_paged_attention.py", "test_routing_replay.py",
                  "test_rl_reuse.py", "test_checkpoint.py", "test_reliability.py",
                  "test_hf_parity.py", "test_outputs.py")
# ... except this file, handed out first: its one test is the suite's longest, and handed out by
# its count of tests it came last, running alone for minutes while the other worker had finished
# (one test uses about one and a half of the two cores).
_FIRST = ("test_rl_grpo.py",)


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda it: rank.get(os.path.basename(str(it.fspath)), len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: no error without it
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` as xdist does it, with the files of _FIRST at the head of its queue."""
  if config.getvalue("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling

  class FirstFilesScheduling(LoadFileScheduling):
    def _assign_work_unit(self, node):
      if not getattr(self, "_reordered", False):  # the queue is complete at the first handout
        self._reordered = True
        first = [s for s in list(self.workqueue) if os.path.basename(s) in _FIRST]
        for scope in reversed(first):
          self.workqueue.move_to_end(scope, last=False)
      super()._assign_work_unit(node)

  return FirstFilesScheduling(config, log)


@pytest.fixture(scope="session")
def step_caches():
  """One engine.StepCachePool for this pytest process: runs of the same EngineSpec on the same
  devices (the canonical shapes of engine_utils.rollout_config above all) reuse the StepSets an
  earlier test compiled, across tests and files, instead of tracing, lowering and loading them
  from the persistent cache again. Tests of compiling itself take fresh caches."""
  from flexfloor_jax import engine
  return engine.StepCachePool()
