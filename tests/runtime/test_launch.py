"""The local multi-process launcher, `python -m flexfloor_jax.launch` (runtime/launch.py): a
missing command is one error line; when a child fails the others are stopped and its exit status
is the launcher's; a timeout stops them all; a killed or stopped launcher leaves no child
running. (Rollouts across processes: test_distributed.py.)"""

import os
import re
import signal
import subprocess
import sys
import time

import checkout
import pytest
from checkout import ROOT

from flexfloor_jax.runtime import launch


def test_no_command_is_one_error_line(capsys):
  """What `python -m flexfloor_jax.launch --num_processes=2` without `-- command` runs."""
  assert launch.launch([], 2) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and "--" in err[0], err


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_processes=0), "--num_processes=0"),
    (dict(num_processes=2, devices_per_process=0), "--devices_per_process=0"),
    (dict(num_processes=2, timeout=0.0), "--timeout=0"),
])
def test_nothing_to_start_is_one_error_line(capsys, kwargs, name):
  """A launcher asked to start nothing (or to give it no time) says so instead of exiting 0."""
  assert launch.launch(["python", "-c", "pass"], **kwargs) == 2
  err = capsys.readouterr().err.strip().splitlines()
  flag, value = name.split("=")  # the schema's line: the flag, its bounds, the value given
  assert len(err) == 1 and err[0].startswith(f"error: {flag}:") and value in err[0], err


def _launch(*args, timeout=60):
  return subprocess.run([sys.executable, "-m", "flexfloor_jax.launch", *args], cwd=ROOT,
                        env=checkout.child_env(), capture_output=True, text=True, timeout=timeout)


def test_launch_fails_when_a_child_fails():
  code = ("import os, sys, time; i = int(os.environ['FLEXFLOOR_PROCESS_ID']); "
          "print('hello', i, os.environ['FLEXFLOOR_NUM_PROCESSES']); "
          "sys.exit(3) if i == 1 else time.sleep(60)")
  t0 = time.perf_counter()
  proc = _launch("--num_processes=2", "--timeout=50", "--", sys.executable, "-c", code)
  assert proc.returncode == 3, (proc.stdout, proc.stderr)
  assert "[p0] hello 0 2" in proc.stdout and "[p1] hello 1 2" in proc.stdout
  assert time.perf_counter() - t0 < 30  # process 0 was killed, not waited for


def test_launch_timeout():
  proc = _launch("--num_processes=2", "--timeout=2", "--", sys.executable, "-c",
                 "import time; time.sleep(60)")
  assert proc.returncode == 124 and "timeout" in proc.stderr


def _alive(pid: int) -> bool:
  """Running (a zombie waiting for a reaper counts as gone)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return not any(ln.startswith("State:") and "Z" in ln for ln in f)
  except FileNotFoundError:
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_launcher_leaves_no_child(sig):
  """Children run in sessions of their own (so that a terminal's Ctrl-C reaches the launcher
  only): they must still die with the launcher, whether it is killed or told to stop."""
  code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"
  launcher = subprocess.Popen([sys.executable, "-m", "flexfloor_jax.launch",
                               "--num_processes=2", "--", sys.executable, "-c", code],
                              cwd=ROOT, env=checkout.child_env(), stdout=subprocess.PIPE, text=True)
  pids = []
  try:
    t0 = time.monotonic()
    while len(pids) < 2 and time.monotonic() - t0 < 60:
      m = re.search(r"pid (\d+)", launcher.stdout.readline())
      if m:
        pids.append(int(m.group(1)))
    assert len(pids) == 2
    os.kill(launcher.pid, sig)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not any(_alive(p) for p in pids), f"children outlived the launcher ({sig.name})"
  finally:
    for p in pids:  # never leave them behind, whatever failed
      if _alive(p):
        os.kill(p, signal.SIGKILL)
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()


