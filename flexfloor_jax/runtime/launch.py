"""Local multi-process launcher (testing multi-host code on one machine).

  python -m flexfloor_jax.launch --num_processes=2 [--devices_per_process=4] [--timeout=600] \
      -- python -m flexfloor_jax.rollout --config=configs/mixtral.py ...

Spawns N children on a free loopback port; each learns coordinator / process count / its id (and
its number of emulated CPU devices) from FLEXFLOOR_* environment variables, which
flexfloor_jax.runtime.distributed reads. Output lines are prefixed with `[pK]` and forwarded. When
any child fails (or the timeout passes) the others are killed and the launcher exits non-zero.

Children never outlive the launcher: each runs in its own process group (so a terminal's Ctrl-C
reaches only the launcher), SIGINT / SIGTERM / SIGHUP to the launcher are forwarded to every
child's whole group (SIGHUP as SIGTERM) and the launcher waits for them all, exiting 128 + the
signal's number; a child still running STOP_S seconds later is killed. On Linux each child also
gets SIGKILL from the kernel when the launcher dies in a way it cannot handle (kill -9, a crash):
prctl(PR_SET_PDEATHSIG). The latter reaches the command itself, not processes it forks; run the
program directly rather than through a shell wrapper.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from flexfloor_jax.config import schema
from flexfloor_jax.config.reader import ConfigError
from flexfloor_jax.config.settings import MAX_CPU_DEVICES
from flexfloor_jax.runtime import distributed

# Each process is a jax runtime of its own on this host: a few per core is already a crowd
MAX_PROCESSES = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchFlags:
  """The launcher's flags: type, default, bounds and doc of each (config/schema.py)."""
  num_processes: int = schema.Int(hi=MAX_PROCESSES, default=2, doc="local processes to spawn")
  devices_per_process: int = schema.Int(hi=MAX_CPU_DEVICES, default=4,
                                        doc="emulated CPU devices per process")
  timeout: float = schema.Num(lo_open=True, default=900.0,
                              doc="seconds before all children are killed")
  port: int = schema.Int(0, 65535, default=0, doc="coordinator port (0 = a free one)")


schema.define_absl_flags(LaunchFlags)


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # forwarded to the children
STOP_S = 10.0  # after forwarding a signal, how long the children get before SIGKILL


def _child_setup():
  """The children's preexec_fn: the signals the launcher blocks while it starts them unblocked,
  and (Linux) SIGKILL from the kernel when the launcher dies. Resolved here, in the parent: the
  child runs it between fork and exec, where little is safe."""
  prctl = None
  if sys.platform.startswith("linux"):
    try:
      prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
      prctl = None  # the signal forwarding below still covers a launcher that is told to stop
  parent = os.getpid()

  def preexec():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)
    if prctl is not None:
      prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
      if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
  return preexec


class _Stop(Exception):
  """The launcher got one of STOPPING: unwind into the cleanup, which forwards it."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise_stop(signum, frame):
  raise _Stop(signum)


def _pump(stream, prefix: str, out):
  for line in iter(stream.readline, b""):
    out.write(prefix + line.decode(errors="replace"))
    out.flush()
  stream.close()


def launch(command: list[str], num_processes: int, devices_per_process: int = 4,
           timeout: float = 900.0, port: int = 0) -> int:
  if not command or not command[0]:
    print("error: no command given to start (put it after --)", file=sys.stderr)
    return 2
  try:
    schema.check_flags(LaunchFlags, dict(num_processes=num_processes,
                                         devices_per_process=devices_per_process,
                                         timeout=timeout, port=port))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if shutil.which(command[0]) is None:  # else every child fails to start, after the forks
    print(f"error: command {command[0]!r} not found (nor executable)", file=sys.stderr)
    return 2
  port = port or free_port()
  procs, pumps = [], []
  preexec = _child_setup()
  old_handlers = {}
  if threading.current_thread() is threading.main_thread():
    old_handlers = {s: signal.signal(s, _raise_stop) for s in STOPPING}
  try:
    return _run(command, num_processes, devices_per_process, timeout, port, procs, pumps,
                preexec)
  finally:
    for s, h in old_handlers.items():
      signal.signal(s, h)


def _run(command, num_processes, devices_per_process, timeout, port, procs, pumps,
         preexec) -> int:
  rc, forward = 0, signal.SIGTERM
  try:
    # A signal while a child is half-started would leave it unstopped: held until all have
    # started (the children unblock them before exec).
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
    try:
      _start(command, num_processes, devices_per_process, port, procs, preexec)
    finally:
      signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)
    # Output pumps start after the last fork: no thread runs while a child is between fork and
    # exec (the preexec_fn).
    for i, p in enumerate(procs):
      t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", sys.stdout), daemon=True)
      t.start()
      pumps.append(t)
    rc = _wait(procs, timeout)
  except _Stop as e:
    print(f"launch: {e}; stopping all processes", file=sys.stderr, flush=True)
    rc = 128 + e.signum
    forward = signal.SIGTERM if e.signum == signal.SIGHUP else e.signum
  finally:
    _stop_all(procs, pumps, forward)
  return rc


def _start(command, num_processes, devices_per_process, port, procs, preexec) -> None:
  for i in range(num_processes):
    env = dict(os.environ)
    env[distributed.ENV_COORD] = f"127.0.0.1:{port}"
    env[distributed.ENV_NPROC] = str(num_processes)
    env[distributed.ENV_PID] = str(i)
    env[distributed.ENV_DEVICES] = str(devices_per_process)
    flags_ = [f for f in env.get("XLA_FLAGS", "").split()
              if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(
        flags_ + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    env.setdefault("PYTHONUNBUFFERED", "1")
    p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, preexec_fn=preexec)
    procs.append(p)


def _wait(procs, timeout: float) -> int:
  deadline = time.monotonic() + timeout
  while True:
    codes = [p.poll() for p in procs]
    bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if bad:
      i, c = bad[0]
      print(f"launch: process {i} exited with {c}; stopping the others", file=sys.stderr)
      return c if c > 0 else 1
    if all(c == 0 for c in codes):
      return 0
    if time.monotonic() > deadline:
      print(f"launch: timeout after {timeout:.0f}s; stopping all processes", file=sys.stderr)
      return 124
    time.sleep(0.1)


def _stop_all(procs, pumps, sig: int = signal.SIGTERM) -> None:
  """`sig` to every running child's process group, then wait for all of them (reaped), SIGKILL to
  those still there STOP_S seconds later. Another signal to the launcher meanwhile must not cut
  this short: ignored until done."""
  restore = {}
  if threading.current_thread() is threading.main_thread():
    restore = {s: signal.signal(s, signal.SIG_IGN) for s in STOPPING}
  try:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass
    deadline = time.monotonic() + STOP_S
    for p in procs:
      try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        print(f"launch: process {procs.index(p)} still running {STOP_S:.0f} s after "
              f"{signal.Signals(sig).name}; killing it", file=sys.stderr, flush=True)
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        p.wait()
    for t in pumps:
      t.join(timeout=5)
  finally:
    for s, h in restore.items():
      signal.signal(s, h)


def main(argv):
  cmd = list(argv[1:])
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  F = flags.FLAGS
  sys.exit(launch(cmd, F.num_processes, F.devices_per_process, F.timeout, F.port))


if __name__ == "__main__":
  from flexfloor_jax.config.cli import parse_flags
  app.run(main, flags_parser=parse_flags)
