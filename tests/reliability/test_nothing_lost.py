"""Nothing lost, nothing hung, one clear line: one table of named cases, each a failure the
project had, run as a user meets it.

Data: a run never deletes or overwrites what it did not create (a user's `latest/` directory or
`.lock` file is refused before anything is compiled, naming the path, and left as it was), and
runs sharing one length history keep every epoch (the later run wins where both wrote the same
prompt and epoch, with a warning; a killed saver's lock is taken over with a warning).

Signals: Ctrl-C (SIGINT) or SIGTERM at each stage of `python -m flexfloor_jax.rollout` (input
checks, a cold compile, prefill, mid-decode, publishing) and to `python -m flexfloor_jax.launch`
running two processes ends it within 10 s with exit status 128 + the signal (130 for the rollout,
which ends every interruption alike) and one `error:` line per process saying what was kept; no
traceback, no ignored exception, no abort dump; the output directory shows its previous set,
whole; nothing staged or half-published is left; the lock is free. Each signal is sent when the
stage's own line appears in the output (runner.py logs one per stage; the input checks are
caught reading a length history that is a FIFO), not after a fixed sleep.

Bad input: one `error:` line, exit status 2.

The signal cases start from a copy of one complete run's output directory (the `previous`
fixture) and share the suite's compilation cache, except the cold compile's, which starts
empty.
"""

from __future__ import annotations

import errno
import glob
import inspect
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import checkout
import pytest
from checkout import ROOT

from flexfloor_jax.io import output_dir
from flexfloor_jax.policy import accounting
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rollout import outputs as rollout_outputs

SIGNAL_EXIT_S = 10.0  # the promise: a signal at any stage ends the run within this
START_S = 600.0  # a child reaching its stage on a loaded 2-core machine
ROLLOUT = [sys.executable, "-m", "flexfloor_jax.rollout", "--config=configs/mixtral.py",
           "--config.schedule=static"]  # one mesh size: the fewest compiles
LAUNCH = [sys.executable, "-m", "flexfloor_jax.launch", "--num_processes=2", "--"]
INTERRUPTED = re.compile(r"error: interrupted; .*")


# ----------------------------------------------------------------------------- helpers


class Child:
  """A CLI with stdout and stderr merged, read by a thread; `wait_for(regex)` blocks until the
  output matches."""

  def __init__(self, cmd, env=None):
    self.proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env or checkout.child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        # a shell's background job ignores SIGINT: give the child the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    self.out = ""
    self._grew = threading.Condition()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    assert self.proc.stdout is not None
    for chunk in iter(lambda: os.read(self.proc.stdout.fileno(), 65536), b""):
      with self._grew:
        self.out += chunk.decode(errors="replace")
        self._grew.notify_all()
    with self._grew:
      self._grew.notify_all()

  def wait_for(self, pattern: str, timeout: float = START_S) -> None:
    deadline = time.monotonic() + timeout
    with self._grew:
      while not re.search(pattern, self.out):
        assert self.proc.poll() is None or self._reader.is_alive(), (
            f"ended before {pattern!r}:\n{self.out[-4000:]}")
        assert time.monotonic() < deadline, f"no {pattern!r} in {timeout:.0f} s"
        self._grew.wait(1.0)

  def signal_and_wait(self, sig) -> tuple[int, float]:
    """(exit status, seconds from the signal to the exit)."""
    t0 = time.monotonic()
    self.proc.send_signal(sig)
    try:
      code = self.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      code = None
    took = time.monotonic() - t0
    self._reader.join(timeout=10)
    assert code is not None, f"still running 60 s after {sig.name}:\n{self.out[-4000:]}"
    return code, took

  def kill(self):
    """Whatever failed, nothing is left running (a launcher's children die with it)."""
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


def _pieces(out: str) -> list[str]:
  """The output's lines, progress-bar redraws (\\r) split apart, launcher prefixes removed."""
  return [re.sub(r"^\[p\d+\] ", "", p) for p in re.split(r"[\r\n]", out) if p.strip()]


def _published(out) -> dict:
  """What the fixed names show: the set `latest` points to and the text of its files."""
  return {"latest": os.readlink(out / "latest"),
          "sets": sorted(os.listdir(out / output_dir.PUBLISHED)),
          "responses": (out / "responses.jsonl").read_text(),
          "summary": json.loads((out / "summary.json").read_text())}


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
  """One complete run's output directory, and what it shows (each signal case starts from a
  copy and must find it unchanged)."""
  out = tmp_path_factory.mktemp("previous") / "out"
  proc = subprocess.run([*ROLLOUT, f"--config.rollout.output_dir={out}"], cwd=ROOT,
                        env=checkout.child_env(), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return out, _published(out)


def _copy(previous, tmp_path):
  src, shown = previous
  out = tmp_path / "out"
  shutil.copytree(src, out, symlinks=True)
  return out, shown


def _check_interrupted(child: Child, code: int, took: float, sig, out, shown, *,
                       processes: int = 1, locked: bool = True) -> None:
  """Ended in time with one line per process saying what was kept, nothing dumped, and the
  output directory as the previous run left it, unlocked."""
  text = child.out
  assert took < SIGNAL_EXIT_S, f"{took:.1f} s after {sig.name}:\n{text[-4000:]}"
  assert code == (128 + sig if processes > 1 else 130), (code, text[-4000:])
  for bad in ("Traceback", "Exception ignored", "Fatal Python error", "Check failure",
              "Terminating process"):
    assert bad not in text, f"{bad!r} after {sig.name}:\n{text[-6000:]}"
  lines = [m.group(0) for p in _pieces(text) if (m := INTERRUPTED.search(p))]
  run_id = os.path.basename(shown["latest"])
  kept = (f"error: interrupted; {out} keeps its last complete set of outputs ({run_id})"
          if locked else "error: interrupted; nothing was written")
  want = [kept] + [f"error: interrupted; process {k} of {processes} writes no outputs"
                   for k in range(1, processes)]
  assert sorted(lines) == sorted(want), text[-4000:]
  assert [p for p in _pieces(text) if p.startswith("error:")] == lines, text[-4000:]
  assert _published(out) == shown
  assert not (out / output_dir.LOCK_NAME).exists()
  staging = out / output_dir.STAGING
  assert not staging.exists() or not any(staging.iterdir())
  assert not [n for n in os.listdir(out) if n.startswith(".link-")]


# ----------------------------------------------------------------------------- the cases


def input_checks(previous, tmp_path, sig):
  """A signal while the inputs are checked, before jax starts. Was: a traceback, or the Ctrl-C
  lost inside an import and the run published anyway. The length history is a FIFO: the run is
  caught reading it."""
  out, shown = _copy(previous, tmp_path)
  fifo = tmp_path / "history.fifo"
  os.mkfifo(fifo)
  child = Child([*ROLLOUT, f"--config.rollout.output_dir={out}",
                 f"--config.scheduler.history_path={fifo}"])
  writer = None
  try:
    deadline = time.monotonic() + START_S
    while writer is None:  # opens once the run opened the FIFO to read it
      try:
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
      except OSError as e:
        assert e.errno == errno.ENXIO and child.proc.poll() is None, child.out[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    code, took = child.signal_and_wait(sig)
  finally:
    if writer is not None:
      os.close(writer)
    child.kill()
  _check_interrupted(child, code, took, sig, out, shown, locked=False)


def _at_stage(previous, tmp_path, sig, marker, *args, env=None, launcher=False, python=(),
              then=None, locked=True):
  """The rollout (through the launcher), signalled once `marker` shows in its output and then
  `then(out)` holds."""
  out, shown = _copy(previous, tmp_path)
  rollout = [ROLLOUT[0], *python, *ROLLOUT[1:]]
  child = Child([*(LAUNCH if launcher else []), *rollout, f"--config.rollout.output_dir={out}",
                 *args], env=env)
  try:
    child.wait_for(marker)
    deadline = time.monotonic() + 60
    while then is not None and not then(out):
      assert time.monotonic() < deadline and child.proc.poll() is None, child.out[-4000:]
      time.sleep(0.001)
    code, took = child.signal_and_wait(sig)
  finally:
    child.kill()
  _check_interrupted(child, code, took, sig, out, shown, processes=2 if launcher else 1,
                     locked=locked)


def imports(previous, tmp_path, sig):
  """While the entry point imports its modules (seconds: jax, the model): there is nothing to
  clean up yet. Was: a KeyboardInterrupt traceback, or the Ctrl-C dropped by an import that
  catches it and the run publishing anyway. The marker: -X importtime's line for jax."""
  _at_stage(previous, tmp_path, sig, r"\| +jax\n", python=("-X", "importtime"), locked=False)


def cold_compile(previous, tmp_path, sig):
  """While the engine compiles, on an empty compilation cache. Was: 30 s to exit (the
  background compiles waited for), then an "Exception ignored" traceback and 5 s (the
  KeyboardInterrupt raised inside jax's garbage-collector callback, and dropped)."""
  _at_stage(previous, tmp_path, sig, r"building the engine",
            env=checkout.child_env(FLEXFLOOR_JAX_CACHE=str(tmp_path / "empty_cache")))


def prefill(previous, tmp_path, sig):
  """As generation starts: the first prefill."""
  _at_stage(previous, tmp_path, sig, r"generating \d+ responses")


def mid_decode(previous, tmp_path, sig):
  """With responses finished and others decoding (4x the default's responses on the same
  shapes: generation lasts seconds after the first finishes). Was: a 48-line traceback."""
  _at_stage(previous, tmp_path, sig, r"responses:\s+[1-9]\d*%",
            "--config.rollout.samples_per_prompt=32")


def publishing(previous, tmp_path, sig):
  """While the new set is written (its responses are staged, its timeline not yet): it is
  discarded, the previous one still shown. Was: the half-written set left in .staging."""
  def staged(out):
    return any(os.path.exists(os.path.join(d, "responses.jsonl"))
               for d in glob.glob(str(out / output_dir.STAGING / "*")))
  _at_stage(previous, tmp_path, sig, r"publishing the outputs", then=staged)


GC_CALLBACK = """
import gc, sys, time
from flexfloor_jax.runtime import interrupt
interrupt.install()  # as config.cli.run does
slept = []
def callback(phase, info):  # jax's garbage-collector callback, slow here
  if phase == "start" and not slept:
    slept.append(1)
    sys.stdout.write("in the callback\\n")  # one write: the signal may follow at once
    sys.stdout.flush()
    time.sleep(30)
gc.callbacks.append(callback)
interrupt.run_main(lambda: (gc.collect(), time.sleep(60)))
"""


def in_a_gc_callback(previous, tmp_path, sig):
  """A signal that lands while a garbage-collector callback runs (jax has one: during a cold
  compile the main thread is often in it). Was: "Exception ignored in: <function
  _xla_gc_callback>" with a traceback, the KeyboardInterrupt dropped, and the run ended by the
  watchdog 5 s later. Now it is delivered again at once."""
  child = Child([sys.executable, "-c", GC_CALLBACK])
  try:
    child.wait_for(r"(?m)^in the callback$", timeout=60)
    code, took = child.signal_and_wait(sig)
  finally:
    child.kill()
  assert code == 130 and took < 2.0, (code, took, child.out)
  assert child.out.strip().splitlines()[-1] == "error: interrupted; nothing was written", child.out
  assert "Exception ignored" not in child.out and "Traceback" not in child.out, child.out


def launcher(previous, tmp_path, sig):
  """To the launcher of two processes, mid-generation. Was: the children left running until a
  10 s SIGKILL fallback, then "Fatal Python error: Aborted" (a process whose coordination
  service went away) and a stale lock."""
  _at_stage(previous, tmp_path, sig, r"\[p0\] [^\n]*generating \d+ responses", launcher=True)


def _cli(args, timeout=120):
  return subprocess.run([*ROLLOUT, *args], cwd=ROOT, env=checkout.child_env(),
                        capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc, *needles):
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
      proc.returncode, proc.stderr[-3000:])
  for n in needles:
    assert n in lines[0], lines[0]


def users_latest_dir(tmp_path):
  """An output directory holding a user's own `latest/`. Was: exit 0 and the user's files in
  it gone."""
  out = tmp_path / "out"
  (out / "latest").mkdir(parents=True)
  (out / "latest" / "notes.txt").write_text("mine")
  _one_error_line(_cli([f"--config.rollout.output_dir={out}"]), f"{out / 'latest'}")
  assert (out / "latest" / "notes.txt").read_text() == "mine"
  assert sorted(os.listdir(out)) == ["latest"]


def users_lock_file(tmp_path):
  """A user's file named `.lock` in the output directory. Was: truncated by the lock, then
  removed by its release."""
  out = tmp_path / "out"
  out.mkdir()
  (out / ".lock").write_text("my notes\n")
  _one_error_line(_cli([f"--config.rollout.output_dir={out}"]), f"{out / '.lock'}")
  assert (out / ".lock").read_text() == "my notes\n"


def bad_value(tmp_path):
  """A bad value: one line naming the field, exit status 2, no traceback."""
  _one_error_line(_cli([f"--config.rollout.output_dir={tmp_path / 'out'}",
                        "--config.rollout.samples_per_prompt=0"]), "rollout.samples_per_prompt")
  assert not (tmp_path / "out").exists()


@pytest.fixture
def fake_plot(monkeypatch):
  def plot(timeline, path, title=None):
    with open(path, "w") as f:
      f.write(title or "")
  monkeypatch.setattr(accounting, "plot_timeline", plot)


def _publish(out, history, history_path, tag="run"):
  rollout_outputs.publish_outputs(str(out), [{"prompt_id": "p", "sample": 0, "logprobs": [-1.0]}],
                                  {"run": tag}, None, tag, history, str(history_path))


def _epochs(path) -> dict:
  return {p: sorted(int(e) for e in d) for p, d in json.loads(path.read_text())["prompts"].items()}


def shared_history(tmp_path):
  """Two runs in different output directories add epochs to one history file kept elsewhere
  (scheduler.history_path), both loading it before either saves. Was: both exit 0 and one
  epoch's lengths gone (the lock covered the output directory, not the history file)."""
  path = tmp_path / "shared" / "history.json"
  path.parent.mkdir()
  a, b = LengthHistory.load(str(path)), LengthHistory.load(str(path))
  a.add("p", 0, [3, 4])
  b.add("p", 1, [5, 6])
  _publish(tmp_path / "a", a, path)
  _publish(tmp_path / "b", b, path)
  assert _epochs(path) == {"p": [0, 1]}


def same_prompt_and_epoch(tmp_path, caplog):
  """Both runs write the same prompt and epoch: the later save wins, and says so."""
  path = tmp_path / "history.json"
  a, b = LengthHistory.load(str(path)), LengthHistory.load(str(path))
  a.add("p", 0, [3, 4])
  b.add("p", 0, [5, 6])
  _publish(tmp_path / "a", a, path)
  with caplog.at_level(logging.WARNING):
    _publish(tmp_path / "b", b, path)
  assert json.loads(path.read_text())["prompts"] == {"p": {"0": [5, 6]}}
  assert "another run saved 1 of the entries" in caplog.text and str(path) in caplog.text


def history_in_a_runs_set(tmp_path, monkeypatch):
  """One run keeps its history in its own output directory (published with its set), another
  points scheduler.history_path at that file and saves while the first publishes. Was: the
  first run's publish, which took only its output directory's lock, replaced the file the second
  had just saved, and the second run's epoch was gone."""
  out_a = tmp_path / "a"
  path = out_a / "history.json"
  a, b = LengthHistory.load(str(path)), LengthHistory.load(str(path))
  a.add("p", 0, [3, 4])
  b.add("p", 1, [5, 6])
  saver = threading.Thread(target=lambda: _publish(tmp_path / "b", b, path, "b"))
  real = output_dir.OutputSet.publish

  def publish(self):  # the other run saves between this run's merge and its publish
    if self.out == str(out_a):
      saver.start()
      saver.join(timeout=1.0)  # it waits for the history's lock (was: it saved at once)
    return real(self)
  monkeypatch.setattr(output_dir.OutputSet, "publish", publish)
  _publish(out_a, a, path, "a")
  saver.join(timeout=60)
  assert not saver.is_alive()
  assert _epochs(path) == {"p": [0, 1]}


def killed_savers_lock(tmp_path, caplog):
  """A history lock left by a killed process is taken over, with a warning naming its pid."""
  path = tmp_path / "shared" / "history.json"
  path.parent.mkdir()
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (path.parent / "history.json.lock").write_text(f"{dead.pid} {socket.gethostname()}\n")
  h = LengthHistory()
  h.add("p", 0, [3])
  with caplog.at_level(logging.WARNING):
    _publish(tmp_path / "a", h, path)
  assert _epochs(path) == {"p": [0]}
  assert f"pid {dead.pid}" in caplog.text
  assert not (path.parent / "history.json.lock").exists()


STAGES = {"imports": imports, "input_checks": input_checks, "cold_compile": cold_compile,
          "in_a_gc_callback": in_a_gc_callback, "prefill": prefill, "mid_decode": mid_decode,
          "publishing": publishing, "launcher": launcher}
# name -> (stage, signal): each stage once per signal where it is cheap; the launcher with both
CASES = {
    "sigint_imports": ("imports", signal.SIGINT),
    "sigint_input_checks": ("input_checks", signal.SIGINT),
    "sigterm_cold_compile": ("cold_compile", signal.SIGTERM),
    "sigterm_in_a_gc_callback": ("in_a_gc_callback", signal.SIGTERM),
    "sigint_prefill": ("prefill", signal.SIGINT),
    "sigint_mid_decode": ("mid_decode", signal.SIGINT),
    "sigterm_mid_decode": ("mid_decode", signal.SIGTERM),
    "sigterm_publishing": ("publishing", signal.SIGTERM),
    "sigint_launcher_two_processes": ("launcher", signal.SIGINT),
    "sigterm_launcher_two_processes": ("launcher", signal.SIGTERM),
}
DATA = {"users_latest_dir": users_latest_dir, "users_lock_file": users_lock_file,
        "bad_value": bad_value, "shared_history": shared_history,
        "same_prompt_and_epoch": same_prompt_and_epoch,
        "history_in_a_runs_set": history_in_a_runs_set,
        "killed_savers_lock": killed_savers_lock}


@pytest.mark.parametrize("case", list(DATA))
def test_nothing_lost(case, tmp_path, request, fake_plot):
  fn = DATA[case]
  fn(tmp_path, **{n: request.getfixturevalue(n) for n in inspect.signature(fn).parameters
                  if n != "tmp_path"})


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_ends_the_run_in_one_line(case, previous, tmp_path):
  stage, sig = CASES[case]
  STAGES[stage](previous, tmp_path, sig)
