"""A rollout's output directory (rollout/outputs.py, io/output_dir.py) against what a hostile but
realistic user does to it: the run stops with one clear error or recovers, losing nothing.

1. An output_dir that is a file, read-only or not creatable fails before anything is compiled,
   naming the field and the path (rollout, library and CLI paths; rl.train).
2. A second run on a locked output_dir fails at once naming the holder's pid; a lock left by a
   killed run is taken over with a warning.
3. The outputs are published all-or-nothing: a kill at any point of a publish leaves one run's
   set (never a mix); files get the umask's mode; a disk error (ENOSPC, EROFS) names the file
   and keeps the responses.
4. Non-finite log-probs never reach responses.jsonl (invalid JSON): a clear error naming the
   prompt.
5. runner.run called directly checks the length history as the CLI does.
Host-side parts in-process; the rollouts use engine/test_elastic.py's tiny shapes (no new
compiles).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys

import engine_utils
import pytest
from checkout import ROOT
from rl_utils import grpo_config

from flexfloor_jax.io import output_dir
from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rollout import outputs as rollout_outputs
from flexfloor_jax.rollout import runner
from flexfloor_jax.rollout.inputs import prepare_rollout


def _config(out):
  """test_elastic's shapes (compiled there already), static schedule: one mesh size."""
  c = engine_utils.rollout_config()
  c.schedule = "static"
  c.rollout.output_dir = str(out)
  return c


@pytest.fixture(scope="module")
def model():
  import jax

  from flexfloor_jax.model import transformer as tfm
  from flexfloor_jax.model.config import PRESETS
  cfg = PRESETS["tiny"].replace(num_layers=2)
  return cfg, tfm.init_params(cfg, jax.random.key(3), scale=0.1)


def _run(c, model, **kw):
  cfg, params = model
  return runner.run(c, params=params, model_cfg=cfg, progress=False, **kw)


# ----------------------------------------------------------------------------- 1. bad output_dir


def _fail_open_under(monkeypatch, root, err):
  """Opening a file under `root` fails with `err` (a read-only filesystem, as root sees it:
  chmod does not stop root)."""
  real = os.open

  def fake(path, *a, **k):
    if os.path.abspath(os.fsdecode(path)).startswith(str(root) + os.sep):
      raise OSError(err, os.strerror(err), os.fsdecode(path))
    return real(path, *a, **k)
  monkeypatch.setattr(os, "open", fake)


@pytest.mark.parametrize("case", ["existing_file", "under_a_file", "read_only_fs", "no_permission"])
def test_unusable_output_dir_fails_before_compiling(tmp_path, model, no_compile, monkeypatch,
                                                    case):
  """A file, a path under a file, a read-only filesystem, a directory without write permission:
  refused before anything is compiled (not after a whole rollout, which would be thrown away),
  naming rollout.output_dir and the path."""
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  out = {"existing_file": blocker, "under_a_file": blocker / "out"}.get(case, tmp_path / "out")
  if case == "read_only_fs":
    out.mkdir()
    _fail_open_under(monkeypatch, out, errno.EROFS)
  elif case == "no_permission":
    if os.geteuid() == 0:
      pytest.skip("root writes into a mode-0555 directory")
    out.mkdir(mode=0o555)
  c = _config(out)
  for call in (lambda: prepare_rollout(c), lambda: _run(c, model)):
    with pytest.raises(runner.RolloutError) as e:
      call()
    msg = str(e.value)
    assert "rollout.output_dir" in msg and str(out) in msg, msg
  assert blocker.read_text() == "x"
  # rl.train: the same check before its model is built
  from flexfloor_jax.rl import train
  with pytest.raises(train.TrainError, match=r"output_dir: .*" + str(out)):
    train.train(grpo_config(out))


# ----------------------------------------------------------------------------- 2. lock

_HOLD = ("import os, sys; from flexfloor_jax.io import output_dir; "
         "lock = output_dir.acquire(sys.argv[1]); print('locked', flush=True); sys.stdin.read()")


def test_second_run_fails_at_once_and_a_killed_holder_is_taken_over(tmp_path, model, no_compile,
                                                                    caplog, monkeypatch):
  """Two runs on one directory would both write history.json, one run's lengths lost: the second
  fails at once naming the holder; a lock whose holder was killed is taken over."""
  out = tmp_path / "out"
  holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    c = _config(out)
    with pytest.raises(runner.RolloutError) as e:
      _run(c, model)
    msg = str(e.value)
    assert "rollout.output_dir" in msg and str(out) in msg and f"pid {holder.pid}" in msg, msg
    from flexfloor_jax.rl import train
    with pytest.raises(train.TrainError, match=f"{out}.*pid {holder.pid}"):
      train.train(grpo_config(out))
  finally:
    os.kill(holder.pid, signal.SIGKILL)  # a run killed while holding the lock
    holder.wait()
  with caplog.at_level(logging.WARNING):
    lock = output_dir.acquire(str(out))
  assert f"pid {holder.pid}" in caplog.text and str(out) in caplog.text
  with pytest.raises(output_dir.OutputDirError, match=f"pid {os.getpid()}"):
    output_dir.acquire(str(out))  # held: even a second acquire in this process is refused
  lock.release()
  assert os.listdir(out) == []  # released: no lock file left
  with output_dir.acquire(str(out)):  # and free again, without a warning
    pass
  # without the flock (a filesystem that has none), the pid decides: dead is stale, and this
  # process's own pid, alive, is busy
  (out / output_dir.LOCK_NAME).write_text(f"{holder.pid} {socket.gethostname()}\n")
  output_dir.acquire(str(out)).release()
  monkeypatch.setattr(output_dir, "_flock", lambda fd: True)
  (out / output_dir.LOCK_NAME).write_text(f"{os.getppid()} {socket.gethostname()}\n")
  with pytest.raises(output_dir.OutputDirError, match=f"pid {os.getppid()}"):
    output_dir.acquire(str(out))


# ----------------------------------------------------------------------------- 3. publish


def _publish(out, files: dict, owns=()) -> str:
  s = output_dir.OutputSet(str(out), owns=owns)
  for name, text in files.items():
    s.write(name, text)
  return s.publish()


def _visible(out, names) -> dict:
  """What a reader of <out>/<name> sees."""
  seen = {}
  for n in names:
    try:
      with open(os.path.join(out, n)) as f:
        seen[n] = f.read()
    except FileNotFoundError:
      pass
  return seen


class _Killed(BaseException):
  """kill -9 at this point: nothing after it runs (not even except-clauses' clean-up that
  catches Exception)."""


FS_CALLS = ("rename", "replace", "symlink", "unlink", "rmdir")


def _tags(out, names) -> dict:
  """Which run each file a reader of <out>/<name> sees comes from (the newest tag in it: a
  history.json carries the earlier runs' entries too)."""
  return {n: next(t for t in ("RUN-C", "RUN-B", "RUN-A") if t in text)
          for n, text in _visible(out, names).items()}


@pytest.mark.parametrize("via", ["set", "runner"])
def test_publish_shows_one_run_whatever_the_kill_point(tmp_path, monkeypatch, via):
  """A publish killed at each of its filesystem steps in turn (kill -9 between two renames
  could leave one run's responses.jsonl beside another run's summary.json): a reader
  sees the previous set or the new one, whole. `runner`: the rollout's own publish. (An older
  version's in-place files are refused, not replaced: tests/io/test_output_dir.py.)"""
  if via == "set":  # the next set lacks a name of the previous one, and adds one
    sets = {"RUN-A": ["responses.jsonl", "summary.json", "history.json"],
            "RUN-B": ["responses.jsonl", "summary.json", "timeline.png"],
            "RUN-C": ["responses.jsonl", "summary.json"]}
    names = sorted({n for v in sets.values() for n in v})

    def publish(out, tag):
      _publish(out, {n: tag for n in sets[tag]}, owns=names)
  else:
    from flexfloor_jax.policy import accounting
    names = list(rollout_outputs.ROLLOUT_OUTPUTS)
    sets = {tag: names for tag in ("RUN-A", "RUN-B", "RUN-C")}

    def plot(tl, path, title=None):
      with open(path, "w") as f:
        f.write(title)
    monkeypatch.setattr(accounting, "plot_timeline", plot)

    def publish(out, tag):
      rows = [{"prompt_id": tag, "sample": 0, "logprobs": [-1.0]}]
      rollout_outputs.publish_outputs(str(out), rows, {"run": tag}, None, tag,
                                      LengthHistory({tag: {0: [2]}}), str(out / "history.json"))
  k = 0
  while True:
    out = tmp_path / f"k{k}"
    out.mkdir()
    publish(out, "RUN-A")
    calls = [0]

    def killer(real, calls=calls, k=k):  # this kill point's counter
      def f(*args, **kw):
        calls[0] += 1
        if calls[0] > k:
          raise _Killed
        return real(*args, **kw)
      return f
    with monkeypatch.context() as m:
      for name in FS_CALLS:
        m.setattr(os, name, killer(getattr(os, name)))
      try:
        publish(out, "RUN-B")
        done = True
      except _Killed:
        done = False
    seen = _tags(out, names)
    runs = set(seen.values())
    assert len(runs) == 1, (k, seen)
    run = runs.pop()
    assert seen == {n: run for n in sets[run]}, (k, seen)
    # the next run publishes normally over whatever the kill left
    publish(out, "RUN-C")
    assert _tags(out, names) == {n: "RUN-C" for n in sets["RUN-C"]}
    left = sorted(os.listdir(out))
    assert [x for x in left if x.startswith(".link-")] == [], left
    assert len(os.listdir(out / output_dir.PUBLISHED)) <= 2  # this set and the one before
    if done:
      break
    k += 1
  assert k >= 5  # every step of the publish was a kill point


def test_output_files_get_the_umask_mode(tmp_path):
  """Files get the mode the umask gives (mkstemp alone would give 0600 whatever the umask)."""
  old = os.umask(0o027)
  try:
    atomic_write(str(tmp_path / "single.json"), "{}")
    s = output_dir.OutputSet(str(tmp_path / "out"))
    s.write("responses.jsonl", "{}\n")
    with s.writing("history.json") as p:
      LengthHistory({"p": {0: [3]}}).save(p)  # an atomic write inside the set
    final = s.publish()
  finally:
    os.umask(old)
  for p in (tmp_path / "single.json", os.path.join(final, "responses.jsonl"),
            os.path.join(final, "history.json")):
    assert oct(os.stat(p).st_mode & 0o777) == oct(0o640), p


@pytest.mark.parametrize("err, failing", [(errno.ENOSPC, "summary.json"),
                                          (errno.EROFS, "timeline.png"),
                                          (errno.ENOSPC, "responses.jsonl")])
def test_disk_error_names_the_file_and_keeps_the_responses(tmp_path, monkeypatch, err, failing):
  """A disk error midway (full, read-only) publishes nothing, names rollout.output_dir, the file
  and the error, and keeps the responses in the error."""
  from flexfloor_jax.policy import accounting
  out = tmp_path / "out"
  old = {n: f"A:{n}" for n in rollout_outputs.ROLLOUT_OUTPUTS}
  _publish(out, old)
  responses = [{"prompt_id": "p", "sample": 0, "tokens": [1, 2], "logprobs": [-0.5, -0.25]}]
  real_open = open

  def full_disk(path, *a, **k):
    if os.fspath(path).endswith(failing):
      raise OSError(err, os.strerror(err), os.fspath(path))
    return real_open(path, *a, **k)
  monkeypatch.setattr("builtins.open", full_disk)
  monkeypatch.setattr(accounting, "plot_timeline",
                      lambda tl, path, title=None: full_disk(path, "wb").close())
  with pytest.raises(output_dir.OutputWriteError) as e:
    rollout_outputs.publish_outputs(str(out), responses, {"x": 1.0}, None, "t",
                           LengthHistory({"p": {0: [2]}}), str(out / "history.json"))
  monkeypatch.undo()
  msg = str(e.value)
  assert "rollout.output_dir" in msg and failing in msg and os.strerror(err) in msg, msg
  assert errno.errorcode[err] in msg and "nothing was published" in msg, msg
  assert _visible(out, old) == old  # the previous set, whole
  if failing == "responses.jsonl":
    assert e.value.staging is None and "nothing could be kept" in msg
    return
  kept = os.path.join(e.value.staging, "responses.jsonl")
  assert e.value.staging in msg and "responses.jsonl" in msg
  with open(kept) as f:
    assert [json.loads(ln) for ln in f] == responses


# ----------------------------------------------------------------------------- 4-5. rollouts


def test_rollout_publishes_one_set_and_refuses_nonfinite_logprobs(tmp_path, model, monkeypatch,
                                                                 caplog):
  """One rollout through runner.run (the library path): one published set with the history
  in it, valid JSON only, the umask's modes, and a history of another model not used (before:
  runner.run loaded any history unchecked). Then the same run with a NaN weight handed in
  directly (the loader's check bypassed): before, responses.jsonl held bare NaN."""
  import jax
  import jax.numpy as jnp

  from flexfloor_jax.model.config import model_identity
  cfg, params = model
  out = tmp_path / "out"
  out.mkdir()
  LengthHistory({"builtin-0": {0: [7]}}, model="cfg-another-model").save(str(out / "history.json"))
  c = _config(out)
  old = os.umask(0o022)
  try:
    with caplog.at_level(logging.WARNING):
      res = _run(c, model)
  finally:
    os.umask(old)
  assert "cfg-another-model" in caplog.text
  latest = os.path.realpath(out / output_dir.LATEST)
  for name in ("responses.jsonl", "summary.json", "timeline.png", "history.json"):
    assert os.path.realpath(out / name) == os.path.join(latest, name)
    assert os.stat(out / name).st_mode & 0o777 == 0o644, name

  def strict(s):
    raise ValueError(f"non-standard JSON constant {s}")
  with open(out / "summary.json") as f:
    assert json.load(f, parse_constant=strict)["run_id"] == os.path.basename(latest)
  with open(out / "responses.jsonl") as f:
    assert len([json.loads(ln, parse_constant=strict) for ln in f]) == len(res.responses) == 16
  with open(out / "history.json") as f:
    h = json.load(f)
  assert h["model"] == model_identity(cfg) and set(h["prompts"]["builtin-0"]) == {"0"}
  assert h["prompts"]["builtin-0"]["0"] != [7]
  assert sorted(os.listdir(out)) == sorted([".published", "latest", "responses.jsonl",
                                            "summary.json", "timeline.png", "history.json"])

  bad = jax.tree.map(lambda x: x, params)
  bad["layers"]["w1"] = bad["layers"]["w1"].at[0].set(jnp.nan)
  before = os.readlink(out / output_dir.LATEST)
  with pytest.raises(runner.RolloutError) as e:
    runner.run(c, params=bad, model_cfg=cfg, progress=False)
  assert "log-prob of prompt 'builtin-" in str(e.value) and "sample" in str(e.value), e.value
  assert os.readlink(out / output_dir.LATEST) == before  # nothing published


def test_logprob_check_names_the_first_response():
  rs = [{"prompt_id": "a", "sample": 0, "logprobs": [-0.1]},
        {"prompt_id": "b", "sample": 3, "logprobs": [-0.2, float("-inf")]},
        {"prompt_id": "c", "sample": 1, "logprobs": [float("nan")]}]
  rollout_outputs.check_finite_logprobs(rs[:1], 2)
  with pytest.raises(runner.RolloutError, match=r"epoch 2: .*prompt 'b' sample 3 .*2 response"):
    rollout_outputs.check_finite_logprobs(rs, 2)


def test_library_run_checks_history_values(tmp_path, model, no_compile):
  """runner.run called directly (not through the CLI) checks the history's lengths too."""
  out = tmp_path / "out"
  out.mkdir()
  path = out / "history.json"
  path.write_text(json.dumps({"format": "flexfloor_jax.length_history", "version": 1,
                              "prompts": {"builtin-2": {"0": [5, 10**15]}}}))
  with pytest.raises(runner.RolloutError) as e:
    _run(_config(out), model)
  msg = str(e.value)
  assert "scheduler.history_path" in msg and str(path) in msg and "'builtin-2'" in msg, msg
