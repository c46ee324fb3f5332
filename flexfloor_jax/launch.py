"""Local multi-process launcher (testing multi-host code on one machine).

  python -m flexfloor_jax.launch --num_processes=2 [--devices_per_process=4] [--timeout=600] \
      -- python -m flexfloor_jax.rollout --config=configs/mixtral.py ...

Spawns N children on a free loopback port; each learns coordinator / process count / its id (and
its number of emulated CPU devices) from FLEXFLOOR_* environment variables, which
flexfloor_jax.distributed reads. Output lines are prefixed with `[pK]` and forwarded. When any
child fails (or the timeout passes) the others are killed and the launcher exits non-zero.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from flexfloor_jax import distributed

_NUM = flags.DEFINE_integer("num_processes", 2, "Local processes to spawn.")
_DEV = flags.DEFINE_integer("devices_per_process", 4, "Emulated CPU devices per process.")
_TIMEOUT = flags.DEFINE_float("timeout", 900.0, "Seconds before all children are killed.")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port (0 = a free one).")


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream, prefix: str, out):
  for line in iter(stream.readline, b""):
    out.write(prefix + line.decode(errors="replace"))
    out.flush()
  stream.close()


def launch(command: list[str], num_processes: int, devices_per_process: int = 4,
           timeout: float = 900.0, port: int = 0) -> int:
  if not command:
    print("error: no command given (put it after --)", file=sys.stderr)
    return 2
  port = port or free_port()
  procs, pumps = [], []
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
                         start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", sys.stdout), daemon=True)
    t.start()
    pumps.append(t)
  deadline = time.monotonic() + timeout
  rc = 0
  try:
    while True:
      codes = [p.poll() for p in procs]
      bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if bad:
        i, c = bad[0]
        print(f"launch: process {i} exited with {c}; stopping the others", file=sys.stderr)
        rc = c if c > 0 else 1
        break
      if all(c == 0 for c in codes):
        break
      if time.monotonic() > deadline:
        print(f"launch: timeout after {timeout:.0f}s; stopping all processes", file=sys.stderr)
        rc = 124
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    rc = 130
  finally:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass
    for p in procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for t in pumps:
      t.join(timeout=5)
  return rc


def main(argv):
  cmd = list(argv[1:])
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  sys.exit(launch(cmd, _NUM.value, _DEV.value, _TIMEOUT.value, _PORT.value))


if __name__ == "__main__":
  app.run(main)
