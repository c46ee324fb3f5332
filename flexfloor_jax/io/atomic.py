"""Atomic file output: write to a temp file beside the target, then rename over it, so a failed
or killed run leaves the old file (or none), never a partial one."""

from __future__ import annotations

import contextlib
import os
import uuid


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", *, durable: bool = False):
  """Yields a file object; on success the temp file replaces `path`, on error it is removed.
  durable=True also fsyncs the file and the directory (the rename survives a power loss)."""
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  fd, tmp = _create_temp(d, "." + os.path.basename(path) + ".")
  try:
    with os.fdopen(fd, mode) as f:
      yield f
      if durable:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  if durable:
    dfd = os.open(d, os.O_RDONLY)
    try:
      os.fsync(dfd)
    finally:
      os.close(dfd)


def atomic_write(path: str, data: str | bytes, *, durable: bool = False) -> None:
  with atomic_open(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
    f.write(data)


def _create_temp(d: str, prefix: str) -> tuple[int, str]:
  """A new file (O_EXCL) with mode 0666 less the umask, as open() makes it: mkstemp's 0600 would
  hide the output from the user's group; reading the umask to chmod afterwards is not
  thread-safe."""
  for _ in range(100):
    tmp = os.path.join(d, f"{prefix}{uuid.uuid4().hex[:12]}.tmp")
    try:
      return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     0o666), tmp
    except FileExistsError:
      continue
  raise FileExistsError(f"no free temporary name in {d}")
