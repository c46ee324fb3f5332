"""Atomic file output: write to a temp file beside the target, then rename over it, so a failed
or killed run leaves the old file (or none), never a partial one."""

from __future__ import annotations

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", *, durable: bool = False):
  """Yields a file object; on success the temp file replaces `path`, on error it is removed.
  durable=True also fsyncs the file and the directory (the rename survives a power loss)."""
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
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
