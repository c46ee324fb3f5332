"""Ctrl-C and SIGTERM end an entry point at any stage within seconds: one line saying what was
kept, exit status 130, the locks released. Standard library only (it is armed before jax loads).

- `exit_at_once()`, from an entry point's first lines: during the imports and input checks that
  follow, nothing is held, so a signal ends the process there and then. (Python's default would
  raise KeyboardInterrupt into whatever is importing, and some imports catch and drop it: the
  Ctrl-C was lost and the run went on to publish.)
- `install()`, once the entry point runs: both signals raise KeyboardInterrupt, so the run
  unwinds (its lock released, a half-written set discarded), then `exit_interrupted()` ends the
  process without waiting for compiles still running in background threads.
- A watchdog thread: a main thread blocked in a device program (a collective waiting for a peer
  that stopped, a long XLA compile) runs no Python code, so it never sees the exception. UNWIND_S
  seconds after the signal the watchdog ends the process, after the same cleanup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from flexfloor_jax.io import output_dir

INTERRUPTED = 130  # the shell's exit status for a run ended by SIGINT
UNWIND_S = 5.0  # how long the run may take to unwind by itself before the watchdog ends it
SIGNALS = (signal.SIGINT, signal.SIGTERM)

requested = threading.Event()  # a signal arrived: an error from here on is the interruption's
_exiting = threading.Lock()
_cleanups: list[Callable[[], None]] = []
_notes: list[Callable[[], str | None]] = []


def at_exit(fn: Callable[[], None]) -> None:
  """`fn()` runs before an interrupted process exits (after its locks are released): for what
  must not be cut off mid-way by os._exit, such as leaving a multi-process job in step."""
  _cleanups.append(fn)


def note(fn: Callable[[], str | None]) -> None:
  """`fn()` says what this process kept, for the interrupt line (None: nothing to say)."""
  _notes.append(fn)


def message() -> str:
  kept = [s for s in output_dir.kept_notes() + [fn() for fn in _notes] if s]
  return f"error: interrupted; {'; '.join(kept) if kept else 'nothing was written'}"


def exit_interrupted(*, blocked: bool = False) -> NoReturn:
  """Release every lock, run the at_exit cleanups, print the one line, exit 130. The main thread
  and the watchdog may both get here: the second waits for the first to end the process.
  `blocked`: the main thread never unwound, so a progress bar may still hold the line: the
  message starts a new one."""
  if not _exiting.acquire(blocking=False):
    while True:
      time.sleep(60)
  output_dir.release_all()
  line = message()
  for fn in _cleanups:
    with contextlib.suppress(Exception):
      fn()
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
    print(("\n" if blocked else "") + line, file=sys.stderr, flush=True)
  os._exit(INTERRUPTED)


def _at_once(signum, frame) -> None:
  requested.set()
  exit_interrupted()


def exit_at_once() -> None:
  """SIGINT and SIGTERM end the process at once with the line (see the module docstring)."""
  if threading.current_thread() is threading.main_thread():
    for s in SIGNALS:
      signal.signal(s, _at_once)


_swallowed = threading.Event()
_default_unraisable = sys.unraisablehook


def _unraisable(u) -> None:
  """Python drops an exception raised where it cannot propagate (a garbage-collector callback,
  __del__) with an "Exception ignored" traceback: a KeyboardInterrupt that lands there (jax's gc
  callback while compiling, say) would be lost, and the run would go on until the watchdog. It
  is delivered again instead (the watchdog sends the signal anew), without the traceback."""
  if requested.is_set() and isinstance(u.exc_value, KeyboardInterrupt):
    _swallowed.set()
    return
  _default_unraisable(u)


def _watchdog(wakeup: int) -> None:
  while not set(os.read(wakeup, 64)) & set(SIGNALS):
    pass
  requested.set()
  deadline = time.monotonic() + UNWIND_S
  while (left := deadline - time.monotonic()) > 0:
    if _swallowed.wait(left):
      _swallowed.clear()
      time.sleep(0.01)  # the main thread out of the callback and the hook first
      # to the main thread itself, so that a blocking call there returns to run the handler
      main = threading.main_thread().ident
      assert main is not None
      signal.pthread_kill(main, signal.SIGINT)
  exit_interrupted(blocked=True)


def _raise_interrupt(signum, frame) -> None:
  requested.set()  # before the exception: an unraisable hook may see it first
  if frame is not None and frame.f_code is _unraisable.__code__:
    _swallowed.set()  # raised in the hook it would be dropped as well: again, a moment later
    return
  raise KeyboardInterrupt


def install() -> None:
  """Both signals raise KeyboardInterrupt in the main thread (the caller catches it and calls
  exit_interrupted after unwinding); the watchdog ends a run that cannot unwind."""
  for s in SIGNALS:
    signal.signal(s, _raise_interrupt)
  sys.unraisablehook = _unraisable
  wakeup, notify = os.pipe()
  os.set_blocking(notify, False)
  signal.set_wakeup_fd(notify)  # written at the C level, even while the main thread is blocked
  threading.Thread(target=_watchdog, args=(wakeup,), daemon=True, name="interrupt").start()


def run_main(main: Callable[[], object]) -> object:
  """`main()`; after Ctrl-C or SIGTERM, whatever it raises ends the process with the one line
  (a peer's collective failing because that peer stopped is the same interruption)."""
  try:
    return main()
  except KeyboardInterrupt:
    requested.set()
    exit_interrupted()
  except BaseException:
    if requested.is_set():
      exit_interrupted()
    raise
