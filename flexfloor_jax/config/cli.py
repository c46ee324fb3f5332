"""Shared bits of the command-line entry points: one-line errors and the --config flag with "did
you mean" help for misspelled fields (the config's fields are checked by settings.load)."""

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags
from ml_collections import config_flags

from flexfloor_jax.io import output_dir


def fail(msg: str) -> NoReturn:
  """One clear line on stderr and a non-zero exit (no traceback for bad input)."""
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


# ----------------------------------------------------------------------------- --config flag


def unknown_override(err: Exception) -> NoReturn:
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
  try:
    return config_flags.DEFINE_config_file("config", default, help_)
  except (AttributeError, KeyError) as e:
    unknown_override(e)


def config_file_error(e: OSError) -> NoReturn:
  lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
  fail(f"--config: {lines[-1] if lines else e}")


def parse_flags(argv):
  """absl's parser, but a bad flag (an unknown preset raises inside the config file, a misspelled
  field) is one line on stderr, not ml_collections' embedded traceback plus a usage hint."""
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


INTERRUPTED = 130  # the shell's exit status for a run ended by SIGINT
# After Ctrl-C or SIGTERM, how long the run may take to unwind by itself before the watchdog ends
# it: a main thread blocked in a device program (a collective waiting for a process that has
# stopped) runs no Python code, so it never sees the signal.
UNWIND_S = 5.0


def _interrupted() -> NoReturn:
  print("error: interrupted; the output directory keeps its last complete set of outputs",
        file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(INTERRUPTED)


def _watchdog(wakeup: int) -> None:
  """Ends the process UNWIND_S seconds after SIGINT or SIGTERM if the run has not ended by then,
  releasing the locks it holds first (their flocks would go with the process, their lock files
  would not)."""
  while not set(os.read(wakeup, 64)) & {signal.SIGINT, signal.SIGTERM}:
    pass
  time.sleep(UNWIND_S)
  output_dir.release_all()
  _interrupted()


def run(main: Callable[[list[str]], object]) -> NoReturn:
  """absl's app.run with this module's flag parser, for the entry points that take --config.
  Ctrl-C or SIGTERM ends the run with one line instead of a traceback: the exception unwinds
  first, so the output directory's lock is released and its staging removed, and outputs are
  published all-or-nothing, so the directory keeps a complete set. The exit is immediate after
  that: compiles still running in background threads would otherwise hold the process. A run
  that cannot unwind (its main thread blocked in a device program) is ended by a watchdog."""
  signal.signal(signal.SIGTERM, signal.default_int_handler)
  wakeup, notify = os.pipe()
  os.set_blocking(notify, False)
  signal.set_wakeup_fd(notify)  # written at the C level, even while the main thread is blocked
  threading.Thread(target=_watchdog, args=(wakeup,), daemon=True, name="interrupt").start()

  def interruptible(argv):
    try:
      return main(argv)
    except KeyboardInterrupt:
      _interrupted()

  app.run(interruptible, flags_parser=parse_flags)
  raise AssertionError("app.run returned")  # it exits
