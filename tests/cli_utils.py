"""Run a `python -m flexfloor_jax.<cli>` entry point in this process, as the real CLI would run it
(module executed as __main__, absl's app.run, the same flag parser), for the bad-input cases: each
of them in a subprocess cost a JAX import (seconds) and said nothing more, since every one fails
in the CLI's own Python before or without any JAX work. One real subprocess per CLI (test_cli.py,
test_bench.py) still covers the process boundary: exit status, stderr, no traceback.

What a subprocess checked and how it is checked here:
- exit status: the SystemExit code;
- stderr/stdout: sys.stderr/sys.stdout redirected into buffers (absl logging goes through
  logging's stderr handler, which writes to the redirected sys.stderr);
- "nothing was compiled" (JAX_LOG_COMPILES=1 put a line on stderr per compile): a jax.monitoring
  listener counts backend compiles (and persistent-cache hits) during the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import runpy
import sys
import time

import jax

_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                   "/jax/compilation_cache/cache_retrieval_time_sec")
_counter = {"on": False, "n": 0}


def _listener(event, duration, **kwargs):
  del duration, kwargs
  if _counter["on"] and event in _COMPILE_EVENTS:
    _counter["n"] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)

# jax settings a CLI changes in-process (enable_compilation_cache) and the suite relies on.
_JAX_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")


@dataclasses.dataclass
class Result:
  returncode: int
  stdout: str
  stderr: str
  seconds: float
  compiles: int  # backend compiles + persistent-cache retrievals during the run


def run_in_process(module: str, args: list[str], *, cwd: str) -> Result:
  """`python -m <module> <args>` in this process. Flags the module defines on absl's global
  FLAGS are removed again afterwards (so another CLI module, or this one again, can define
  them), and the jax settings it changes are restored."""
  from absl import app, flags

  app.define_help_flags()  # absl's own flags (app.run defines them once): kept across calls
  fv = flags.FLAGS
  # Other modules' flags (another CLI module imported by a test in this process defines --config
  # too) are set aside while the module runs and put back afterwards.
  stashed = {}
  for name in list(fv):
    owner = fv.find_module_defining_flag(name) or ""
    if not owner.startswith("absl"):
      stashed[name] = (fv[name], owner)
      delattr(fv, name)
  before = set(fv)
  saved = {k: getattr(jax.config, k) for k in _JAX_SETTINGS}
  saved_argv, saved_cwd, saved_mod = sys.argv, os.getcwd(), sys.modules.pop(module, None)
  saved_env = os.environ.get("FLEXFLOOR_JAX_CACHE")
  if saved["jax_compilation_cache_dir"]:  # the CLI's enable_compilation_cache() reads it
    os.environ["FLEXFLOOR_JAX_CACHE"] = saved["jax_compilation_cache_dir"]
  out, err = io.StringIO(), io.StringIO()
  code = 0
  _counter.update(on=True, n=0)
  t0 = time.perf_counter()
  try:
    os.chdir(cwd)
    sys.argv = [module.replace(".", "/") + ".py", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      except BaseException:  # noqa: BLE001 -- a traceback, as the real CLI would print one
        import traceback
        traceback.print_exc(file=err)
        code = 1
  finally:
    secs = time.perf_counter() - t0
    _counter["on"] = False
    os.chdir(saved_cwd)
    sys.argv = saved_argv
    for name in set(fv) - before:
      delattr(fv, name)
    fv.unparse_flags()
    for name, (flag, owner) in stashed.items():
      if name not in fv:
        fv[name] = flag
        if owner:
          fv.register_flag_by_module(owner, flag)
    for k, v in saved.items():
      jax.config.update(k, v)
    if saved_env is None:
      os.environ.pop("FLEXFLOOR_JAX_CACHE", None)
    else:
      os.environ["FLEXFLOOR_JAX_CACHE"] = saved_env
    if saved_mod is not None:
      sys.modules[module] = saved_mod
    else:
      sys.modules.pop(module, None)
  return Result(code, out.getvalue(), err.getvalue(), secs, _counter["n"])
