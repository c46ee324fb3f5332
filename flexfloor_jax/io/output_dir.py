"""A run's output directory: checked and locked before anything is compiled, and the run's files
published all-or-nothing. Host side: stdlib only (no numpy, no jax).

Layout of <output_dir>:
  .lock                         held while a run writes here: "<pid> <host>" of the holder (flock)
  .staging/<run_id>/            a set being written; left, and named in the error, when writing
                                fails (the responses are written first, so they survive)
  .published/<run_id>/          complete sets: the current one and the one before (a reader may
                                still be reading it)
  latest -> .published/<run_id> the pointer; replacing it (one rename) is the publish
  responses.jsonl -> latest/responses.jsonl, summary.json -> latest/summary.json, ...
                                one fixed link per name in the set, so the usual paths work

Why this shape: a set of files cannot be replaced by renaming the files one by one (a kill between
two renames leaves files of two runs side by side), and a directory cannot be renamed over a
non-empty one; a symbolic link can be. Every fixed name resolves through `latest`, so at any
moment all of them show one run's set (a name the current set lacks is missing, never another
run's file). A reader who opens several files while a run publishes may straddle the switch;
resolving `latest` once (os.path.realpath) reads one set, and summary.json carries its run_id.

Only this project's own links and sets are ever replaced or removed (check_owned, called before
the run starts and again at the publish): anything else under those names stops the run.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import re
import shutil
import socket
import time
import uuid

try:
  import fcntl
except ImportError:  # not POSIX: the pid check alone
  fcntl = None

LOCK_NAME = ".lock"
STAGING = ".staging"
PUBLISHED = ".published"
LATEST = "latest"

log = logging.getLogger(__name__)


class OutputDirError(Exception):
  """The output directory cannot be used; the message names the config field and the path."""


class OutputWriteError(OutputDirError):
  """Writing the outputs failed (disk full, read-only filesystem, ...). `staging`: the directory
  holding what was written before the failure (kept); `kept`: those names."""

  def __init__(self, msg: str, staging: str | None = None, kept: tuple[str, ...] = ()):
    super().__init__(msg)
    self.staging, self.kept = staging, kept


def os_error_text(e: OSError) -> str:
  code = errno.errorcode.get(e.errno, "") if e.errno else ""
  return f"{e.strerror or e}" + (f" ({code})" if code else "")


# ----------------------------------------------------------------------------- check


def check_dir(path: str, field: str = "output_dir", names: tuple[str, ...] = (),
              adopt: tuple[str, ...] = ()) -> str:
  """Create `path` if missing and make sure this process can write files and symbolic links in
  it (the publish needs both): an existing file, a path under a file, a read-only filesystem or
  a directory without write permission fail here, naming `field` and the path, instead of after
  the run. `names`: what the run will publish there, each checked to be missing or this
  project's own link (check_owned), with `latest`, .published and .staging. Returns the path."""
  if not isinstance(path, str) or not path:
    raise OutputDirError(f"{field} must be a non-empty path, got {path!r}")
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputDirError(f"{field}: {path} exists and is not a directory")
  created = not os.path.exists(path)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise OutputDirError(
        f"{field}: cannot create the directory {path}: {os_error_text(e)}") from None
  if created and not _CREATED:
    atexit.register(_remove_created)
  if created:
    _CREATED.add(os.path.abspath(path))
  probe = os.path.join(path, f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  made = []
  try:
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    made.append(probe)
    os.symlink(os.path.basename(probe), probe + ".link")
    made.append(probe + ".link")
  except OSError as e:
    what = "symbolic links (the outputs are published through one)" if made else "files"
    raise OutputDirError(f"{field}: cannot write {what} in {path}: {os_error_text(e)}") from None
  finally:
    for p in made:
      with contextlib.suppress(OSError):
        os.unlink(p)
  if names:
    check_owned(path, names, field, adopt)
  _check_lock_file(os.path.join(path, LOCK_NAME), field)
  return path


def _check_lock_file(lock_path: str, field: str) -> None:
  """A file under the lock's name must be a lock this project made: locking truncates it, and
  the release removes it."""
  try:
    fd = os.open(lock_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
  except FileNotFoundError:
    return
  except OSError as e:  # a directory, a link, unreadable: not a lock of ours
    raise _not_ours_lock(lock_path, field, os_error_text(e)) from None
  try:
    ours = _read_holder(fd)[2]
  finally:
    os.close(fd)
  if not ours:
    raise _not_ours_lock(lock_path, field, 'its content is not "<pid> <host>"')


def _not_ours_lock(lock_path: str, field: str, why: str) -> OutputDirError:
  return OutputDirError(f"{field}: {lock_path} is not a lock file this project made ({why}); "
                        "move it away or choose another directory")


_RUN_ID = re.compile(r"\d{8}-\d{6}-\d+-[0-9a-f]{6}$")  # new_run_id()
_RETIRED = re.compile(r"old-.+-[0-9a-f]{8}$")  # an older version's in-place output, retired


def _describe(p: str) -> str:
  if os.path.islink(p):
    return f"a symbolic link to {_link_target(p)}"
  if os.path.isdir(p):
    return "a directory"
  return "a regular file" if os.path.isfile(p) else "not a regular file"


def _not_ours(p: str, field: str, what: str = "link") -> OutputDirError:
  return OutputDirError(f"{field}: {p} is not a {what} this project made ({_describe(p)}); move "
                        "it away or choose another directory")


def check_owned(out: str, names, field: str = "output_dir", adopt=()) -> None:
  """Everything a publish of `names` in `out` replaces or removes is this project's own, or
  OutputDirError naming the first path that is not (a user's file, directory or symbolic link,
  or an older version's in-place output: the two cannot be told apart), changing nothing:
    <name>      missing, or a symbolic link to latest/<name>
    latest      missing, or a symbolic link to .published/<one name>
    .published  missing, or a directory (not a link) holding only published sets
    .staging    missing, or a directory (not a link)
  `adopt`: names whose regular file is the run's own input, carried into the new set (the
  rollout's history.json when it is the length history): allowed, replaced at the publish."""
  for name in sorted(set(names)):
    p = os.path.join(out, name)
    if not os.path.lexists(p) or _link_target(p) == os.path.join(LATEST, name):
      continue
    if name in adopt and os.path.isfile(p) and not os.path.islink(p):
      continue
    raise _not_ours(p, field)
  p = os.path.join(out, LATEST)
  t = _link_target(p)
  if os.path.lexists(p) and (t is None or os.path.dirname(t) != PUBLISHED
                             or os.path.basename(t) in ("", ".", "..")):
    raise _not_ours(p, field)
  for d in (PUBLISHED, STAGING):
    p = os.path.join(out, d)
    if not os.path.lexists(p):
      continue
    if os.path.islink(p) or not os.path.isdir(p):
      raise _not_ours(p, field, "directory")
    if d == PUBLISHED:  # its entries are removed when they are not the last two sets
      for entry in sorted(os.listdir(p)):
        if not (_RUN_ID.match(entry) or _RETIRED.match(entry)):
          raise _not_ours(os.path.join(p, entry), field, "published set")


# ----------------------------------------------------------------------------- lock


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:  # a zombie (killed, not yet reaped) holds nothing
    with open(f"/proc/{pid}/status") as f:
      return not any(ln.startswith("State:") and "Z" in ln for ln in f)
  except OSError:
    return True


_HOLDER = re.compile(r"(\d+) (\S+)\n?")  # what lock_file writes: "<pid> <host>"


def _read_holder(fd: int) -> tuple[int | None, str, bool]:
  """(pid, host, ours) of a lock file: ours is False for content this project never writes (a
  user's own file under the lock's name), which must not be truncated or removed. An empty file
  is ours: a holder that died between creating and writing it."""
  try:
    data = os.pread(fd, 257, 0)
  except OSError:
    return None, "", True
  m = _HOLDER.fullmatch(data.decode("utf-8", "replace"))
  if m is None:
    return None, "", not data
  return int(m.group(1)), m.group(2), True


_HELD: set[DirLock] = set()  # the locks this process holds (release_all)
# Output directories this process created: a run that stops before writing anything (bad input
# found once the devices are known, an interrupt) leaves no empty directory behind
_CREATED: set[str] = set()


def _remove_created() -> None:
  for path in _CREATED:
    with contextlib.suppress(OSError):  # rmdir removes only an empty directory
      os.rmdir(path)
# Output directories this process locked, and whether it publishes sets there (kept_notes).
_LOCKED: dict[str, bool] = {}


def release_all() -> None:
  """Releases every lock this process holds: for an exit that cannot unwind the run (a signal
  while the main thread is blocked in a device program)."""
  for lock in list(_HELD):
    lock.release()


def kept_notes() -> list[str]:
  """What each output directory this process locked holds now, for the line that ends an
  interrupted run: the set its fixed names show (or none yet), or for a directory without
  published sets (a trainer's checkpoints), what was saved before."""
  notes = []
  for path, publishes in _LOCKED.items():
    if not publishes:
      notes.append(f"{path} keeps what was saved before the signal")
      continue
    t = _link_target(os.path.join(path, LATEST))
    notes.append(f"{path} keeps its last complete set of outputs ({os.path.basename(t)})" if t
                 else f"nothing was published in {path}")
  return notes


class DirLock:
  """A held lock file (lock_file); release() (or leaving a `with` block) frees it and removes
  the lock file."""

  def __init__(self, path: str, lock_path: str, fd: int):
    self.path, self.lock_path, self._fd = path, lock_path, fd
    _HELD.add(self)

  def release(self) -> None:
    _HELD.discard(self)
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      with contextlib.suppress(OSError):  # removed while held: whoever opens it next retries
        os.unlink(self.lock_path)
    finally:
      os.close(fd)  # drops the flock, whatever interrupted the unlink

  @property
  def held(self) -> bool:
    return self._fd is not None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def acquire(path: str, field: str = "output_dir", names: tuple[str, ...] = (),
            adopt: tuple[str, ...] = ()) -> DirLock:
  """Lock output directory `path` for this run (checked first, see check_dir, with `names` and
  `adopt`). Another live run holding it: OutputDirError naming `field`, the path and the holder's
  pid. A lock left by a run that died (kill -9, a crash: its flock is gone, or its pid on this
  host is not running) is taken over with a warning naming that pid."""
  check_dir(path, field, names, adopt)
  lock_path = os.path.join(path, LOCK_NAME)

  def busy(pid, where):
    return (f"{field}: {path} is in use by another run (pid {pid}{where}; lock file "
            f"{lock_path}): wait for it to finish or choose another {field}")
  lock = lock_file(path, lock_path, field, busy)
  _LOCKED[path] = bool(names)
  return lock


def lock_file(path: str, lock_path: str, field: str, busy_message, wait_s: float = 0.0) -> DirLock:
  """Lock `path` (an output directory, a history file, ...) through the flock of `lock_path`,
  which holds "<pid> <host>" of the holder. Held by a live process: wait up to `wait_s` seconds
  for it, then OutputDirError(busy_message(pid, " on <host>" or "")). A lock left by a process
  that died (its flock is gone, or its pid on this host is not running) is taken over with a
  warning naming `field`, `path` and that pid."""
  host = socket.gethostname()
  deadline = time.monotonic() + wait_s
  changes = 0
  while True:
    try:
      # never through a link: locking truncates the file it reaches
      fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
      raise OutputDirError(
          f"{field}: cannot create the lock file {lock_path}: {os_error_text(e)}") from None
    try:
      busy = not _flock(fd)
      if not busy:
        try:  # the holder removed the file after we opened it: lock the new one instead
          same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
          same = False
        if not same:
          os.close(fd)
          changes += 1
          if changes > 100:
            raise OutputDirError(f"{field}: could not lock {path} ({lock_path} keeps changing)")
          continue
      pid, pid_host, ours = _read_holder(fd)
      if not ours:
        raise _not_ours_lock(lock_path, field, 'its content is not "<pid> <host>"')
      # A filesystem without working flock: the pid decides (this host's processes only).
      if not busy and pid is not None and pid_host == host and pid != os.getpid():
        busy = _pid_alive(pid)
      if busy:
        if time.monotonic() < deadline:
          os.close(fd)
          time.sleep(0.01)
          continue
        raise OutputDirError(busy_message(
            pid if pid is not None else "?",
            f" on {pid_host}" if pid_host and pid_host != host else ""))
      if pid is not None:
        log.warning("%s: taking over the lock of %s left by pid %d%s, which is no longer "
                    "running (killed or crashed?)", field, path, pid,
                    f" on {pid_host}" if pid_host else "")
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()} {host}\n".encode(), 0)
      return DirLock(path, lock_path, fd)
    except BaseException:
      with contextlib.suppress(OSError):
        os.close(fd)
      raise


def _flock(fd: int) -> bool:
  """Exclusive, non-blocking; True when locked (or when the filesystem has no flock at all)."""
  if fcntl is None:
    return True
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False
  except OSError as e:
    if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
      return True
    raise


# ----------------------------------------------------------------------------- the set


def new_run_id() -> str:
  """Sortable by start time, unique across processes and hosts."""
  return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class OutputSet:
  """The files of one run: written under <out>/.staging/<run_id>/, then publish()ed at once.

    s = OutputSet(out, "rollout.output_dir")
    s.write("responses.jsonl", text)          # first: kept if a later write fails
    with s.writing("timeline.png") as path:   # for writers that take a path
      plot(path)
    s.publish()

  Files are created with open() (mode 0666 less the umask). Any OSError while writing becomes
  OutputWriteError naming the file and the staging directory, which keeps what was written; no
  partial set is ever published. `owns`: every name this writer may publish (the fixed link of
  one this set lacks is removed). The publish replaces or removes only this project's own links
  and sets (check_owned, which the run also calls before it starts): anything else there, a
  user's file or an older version's in-place output, stops it with OutputWriteError naming that
  path, nothing changed. `adopt`: names whose regular file the run read as its input and carried
  into this set (the rollout's history.json): replaced by the link like the others."""

  def __init__(self, out: str, field: str = "output_dir", run_id: str | None = None,
               owns: tuple[str, ...] = (), adopt: tuple[str, ...] = ()):
    self.out, self.field, self.owns, self.adopt = out, field, tuple(owns), tuple(adopt)
    self.run_id = run_id or new_run_id()
    self.staging = os.path.join(out, STAGING, self.run_id)
    self.written: list[str] = []
    with self.writing(None):
      os.makedirs(self.staging)

  def __enter__(self):
    return self

  def __exit__(self, kind, exc, tb):
    """Leaving a `with` block on an exception other than OutputWriteError (Ctrl-C, a failed
    check) discards the set; after a disk error the files written are kept, as that error
    says."""
    if kind is not None and not issubclass(kind, OutputWriteError):
      self.discard()

  def discard(self) -> None:
    """Removes this set unless it is published: the staging directory, the set moved under
    .published but not yet pointed to, and the fixed links made for it that show nothing. What
    the fixed names show stays the previous set."""
    out = self.out
    if _link_target(os.path.join(out, LATEST)) == os.path.join(PUBLISHED, self.run_id):
      return
    for d in (self.staging, os.path.join(out, PUBLISHED, self.run_id)):
      shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(OSError):
      os.rmdir(os.path.join(out, STAGING))  # only when empty
    with contextlib.suppress(OSError):
      for entry in os.listdir(out):
        p = os.path.join(out, entry)
        if _link_target(p) == os.path.join(LATEST, entry) and not os.path.exists(p):
          os.unlink(p)

  @contextlib.contextmanager
  def writing(self, name: str | None):
    """Yields the staging path of `name` (its parent directories made); an OSError inside
    becomes OutputWriteError naming that path."""
    path = self.staging if name is None else os.path.join(self.staging, name)
    try:
      if name is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
      yield path
    except OSError as e:
      kept = tuple(self.written)
      where = (f"the files written so far ({', '.join(kept)}) are kept in {self.staging}"
               if kept else "nothing could be kept")
      raise OutputWriteError(f"{self.field}: writing {path} failed: {os_error_text(e)}; nothing "
                             f"was published ({where})", self.staging if kept else None,
                             kept) from None
    if name is not None:
      self.written.append(name)

  def write(self, name: str, data: str | bytes) -> str:
    with self.writing(name) as path:
      with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return path

  def publish(self) -> str:
    """Make this set the directory's current one (see the module docstring); returns its final
    directory. Every step before the pointer's replacement leaves the previous set showing."""
    with self.writing(None):
      _fsync_tree(self.staging)
    out = self.out
    final = os.path.join(out, PUBLISHED, self.run_id)
    latest = os.path.join(out, LATEST)
    names = sorted({n.split("/")[0].split(os.sep)[0] for n in self.written})
    try:
      check_owned(out, (*names, *self.owns), self.field, self.adopt)
    except OutputDirError as e:
      raise OutputWriteError(f"{e}; nothing was published (the files are kept in "
                             f"{self.staging})", self.staging, tuple(self.written)) from None
    try:
      os.makedirs(os.path.join(out, PUBLISHED), exist_ok=True)
      os.rename(self.staging, final)
      previous = _link_target(latest)
      # the fixed links first: until the pointer moves they show the previous set
      for name in names:
        _point(os.path.join(out, name), os.path.join(LATEST, name))
      _point(latest, os.path.join(PUBLISHED, self.run_id))  # the publish
    except OSError as e:
      raise OutputWriteError(f"{self.field}: publishing {final} in {out} failed: "
                             f"{os_error_text(e)}",
                             final if os.path.isdir(final) else self.staging,
                             tuple(self.written)) from None
    _fsync_dir(out)
    self._tidy(names, previous)
    return final

  def _tidy(self, names, previous: str | None) -> None:
    """After the publish: fixed links of names this set lacks (dangling now), and sets other than
    this one and the previous one. Failures here lose nothing: a warning."""
    out = self.out
    try:
      for entry in os.listdir(out):
        p = os.path.join(out, entry)
        if entry not in names and _link_target(p) == os.path.join(LATEST, entry):
          os.unlink(p)
        elif _TMP_LINK_NAME.match(entry) and os.path.islink(p):  # left by a killed publish
          os.unlink(p)
      keep = {self.run_id, os.path.basename(previous or "")}
      root = os.path.join(out, PUBLISHED)
      for entry in os.listdir(root):
        p = os.path.join(root, entry)
        if entry in keep or not (_RUN_ID.match(entry) or _RETIRED.match(entry)):
          continue  # not ours (check_owned refuses it before the run): never removed
        if os.path.isdir(p) and not os.path.islink(p):
          shutil.rmtree(p)
        else:  # a retired in-place file of an older version
          os.unlink(p)
      with contextlib.suppress(OSError):
        os.rmdir(os.path.join(out, STAGING))  # only when empty
    except OSError as e:
      log.warning("%s: tidying %s after publishing failed: %s", self.field, out, os_error_text(e))


def _link_target(path: str) -> str | None:
  try:
    return os.readlink(path)
  except OSError:
    return None


_TMP_LINK = ".link-"
_TMP_LINK_NAME = re.compile(re.escape(_TMP_LINK) + r"[0-9a-f]{8}$")


def _point(path: str, target: str) -> None:
  """Make `path` a symbolic link to `target` (relative), replacing what is there (this project's
  own link: check_owned) in one rename."""
  if _link_target(path) == target:
    return
  d = os.path.dirname(path)
  tmp = os.path.join(d, f"{_TMP_LINK}{uuid.uuid4().hex[:8]}")
  os.symlink(target, tmp)
  try:
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def _fsync_tree(root: str) -> None:
  """The set reaches the disk before it is published (a power loss then cannot publish a set
  whose files are empty)."""
  for d, _, files in os.walk(root):
    for name in files:
      fd = os.open(os.path.join(d, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    _fsync_dir(d)


def _fsync_dir(d: str) -> None:
  try:
    fd = os.open(d, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:  # some filesystems refuse fsync on a directory
    pass
  finally:
    os.close(fd)
