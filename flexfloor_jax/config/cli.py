"""Shared bits of the command-line entry points: one-line errors and the --config flag with "did
you mean" help for misspelled fields (the config's fields are checked by settings.load)."""

import re
import sys
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags
from ml_collections import config_flags

from flexfloor_jax.runtime import interrupt


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


def run(main: Callable[[list[str]], object]) -> NoReturn:
  """absl's app.run with this module's flag parser, for the entry points that take --config.
  Ctrl-C or SIGTERM ends the run with one line saying what was kept instead of a traceback
  (runtime/interrupt.py): the run unwinds first, so the output directory's lock is released and a
  half-written set discarded, and outputs are published all-or-nothing, so the directory keeps a
  complete set. The exit is immediate after that: compiles still running in background threads
  would otherwise hold the process. A run that cannot unwind (its main thread blocked in a device
  program) is ended by a watchdog after the same cleanup."""
  interrupt.install()
  app.run(lambda argv: interrupt.run_main(lambda: main(argv)), flags_parser=parse_flags)
  raise AssertionError("app.run returned")  # it exits
