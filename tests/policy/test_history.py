"""The length history (policy/history.py): a round trip, saves that a kill cannot tear, errors
naming the file (and the prompt and epoch) for corrupt files and impossible lengths, and the model
a history was recorded for."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from flexfloor_jax.policy.history import (
  HISTORY_FORMAT,
  HISTORY_VERSION,
  HistoryError,
  LengthHistory,
)


def _history_file(tmp_path, prompts, model=None):
  """A history file in the current format holding `prompts` (and the model's identity)."""
  doc = {"format": "flexfloor_jax.length_history", "version": 1, "prompts": prompts}
  if model is not None:
    doc["model"] = model
  p = tmp_path / "hist.json"
  p.write_text(json.dumps(doc))
  return str(p)


def test_history_roundtrip(tmp_path):
  p = str(tmp_path / 'h.json')
  assert len(LengthHistory.load(p)) == 0  # missing file: empty history
  h = LengthHistory()
  h.add('a', 0, [3, 4])
  h.add('a', 2, [5])
  h.add('b', 1, [7])
  h.save(p)
  h2 = LengthHistory.load(p)
  assert h2.data == {'a': {0: [3, 4], 2: [5]}, 'b': {1: [7]}}
  doc = json.load(open(p))
  assert doc['format'] == HISTORY_FORMAT and doc['version'] == HISTORY_VERSION
  assert os.listdir(tmp_path) == ['h.json']


@pytest.mark.parametrize('content, match', [
    ('{"format": "flexfloor_jax.length_history", "version": 1, "prom', 'corrupt'),
    (b'\xff\xfe\x00', 'corrupt'),
    ('{"hello": 1}', 'not a flexfloor_jax length history'),
    ('[1, 2]', 'not a flexfloor_jax length history'),
    ('{"format": "flexfloor_jax.length_history", "version": 99, "prompts": {}}', 'version 99'),
    ('{"format": "flexfloor_jax.length_history", "version": 1, "prompts": {"a": 3}}', 'malformed'),
])
def test_corrupt_history_names_path(tmp_path, content, match):
  p = tmp_path / 'hist.json'
  p.write_bytes(content if isinstance(content, bytes) else content.encode())
  with pytest.raises(HistoryError, match=match) as e:
    LengthHistory.load(str(p))
  assert str(p) in str(e.value)


def test_history_save_is_crash_safe(tmp_path):
  p = str(tmp_path / 'hist.json')
  old = LengthHistory()
  old.add('a', 0, [1, 2, 3])
  old.save(p)
  # A child process starts saving a much bigger history and is SIGKILLed mid-save (after the
  # data went to the temp file, before the rename): the old file must be intact.
  child = textwrap.dedent(f'''
      import os, sys, time
      from flexfloor_jax.policy.history import LengthHistory
      def slow_fsync(fd):
        print('writing', flush=True)
        time.sleep(60)
      os.fsync = slow_fsync
      h = LengthHistory.load({p!r})
      for i in range(1000):
        h.add(f'p{{i}}', 1, list(range(50)))
      h.save({p!r})
  ''')
  proc = subprocess.Popen([sys.executable, '-c', child], stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == 'writing'
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait(timeout=30)
  assert LengthHistory.load(p).data == {'a': {0: [1, 2, 3]}}
  # and a completed save replaces it
  new = LengthHistory.load(p)
  new.add('b', 1, [9])
  new.save(p)
  assert LengthHistory.load(p).data == {'a': {0: [1, 2, 3]}, 'b': {1: [9]}}


@pytest.mark.parametrize("lengths, why", [
    ([3, -4], "-4"), ([3, 1e15], "1000000000000000"), ([0], "0"), ([True], "True"), ([2.5], "2.5"),
    ([13], "13"), ([], "non-empty")])
def test_impossible_history_values_name_file_and_prompt(tmp_path, lengths, why):
  """Lengths no rollout can produce (negative, over max_new_tokens, not integers, none) would
  steer the schedule: refused, naming the file, the prompt and the epoch."""
  path = _history_file(tmp_path, {"ok": {"0": [4]}, "p7": {"0": [5], "1": lengths}})
  with pytest.raises(HistoryError) as e:
    LengthHistory.load(path, max_new_tokens=12)
  msg = str(e.value)
  assert path in msg and "'p7'" in msg and "epoch 1" in msg and why in msg, msg


def test_history_records_model_and_restarts_for_another(tmp_path, caplog):
  path = str(tmp_path / "h.json")
  LengthHistory({"p": {0: [3, 4]}}, model="cfg-a").save(path)
  with open(path) as f:
    assert json.load(f)["model"] == "cfg-a"
  assert LengthHistory.load(path, max_new_tokens=12, model="cfg-a").data == {"p": {0: [3, 4]}}
  with caplog.at_level(logging.WARNING):
    other = LengthHistory.load(path, max_new_tokens=12, model="cfg-b")
  assert len(other) == 0 and other.model == "cfg-b"
  assert any(path in r.getMessage() and "cfg-a" in r.getMessage() for r in caplog.records)
  # a file from before identities were recorded is taken as this model's, and then records it
  _history_file(tmp_path, {"p": {"0": [3]}})
  old = LengthHistory.load(str(tmp_path / "hist.json"), model="cfg-b")
  assert old.data == {"p": {0: [3]}} and old.model == "cfg-b"


_SAVER = textwrap.dedent('''
    import sys
    from flexfloor_jax.policy.history import LengthHistory
    path, prompt, first, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for epoch in range(first, first + n):  # one run per epoch, each loading then saving
      h = LengthHistory.load(path, model="cfg-a")
      h.add(prompt, epoch, [epoch + 1])
      h.add_step_seconds({epoch + 1: 0.5})
      h.save(path)
''')


def test_concurrent_saves_to_one_history_lose_nothing(tmp_path):
  """Two processes (runs of two output directories sharing scheduler.history_path) each save 40
  epochs to one history file at the same time: every epoch of both, and every step time, is in
  the file afterwards (before: each save replaced the file with its own copy)."""
  path = str(tmp_path / "shared.json")
  n = 40
  procs = [subprocess.Popen([sys.executable, "-c", _SAVER, path, p, str(first), str(n)])
           for p, first in (("a", 0), ("b", 1000))]
  for proc in procs:
    assert proc.wait(timeout=300) == 0
  h = LengthHistory.load(path, model="cfg-a")
  missing = {p: sorted(set(range(first, first + n)) - set(h.epochs(p)))
             for p, first in (("a", 0), ("b", 1000))}
  print("epochs per prompt:", {p: len(h.epochs(p)) for p in ("a", "b")}, "missing:", missing)
  assert missing == {"a": [], "b": []}
  assert set(h.step_seconds) == {e + 1 for e in range(n)} | {e + 1 for e in range(1000, 1000 + n)}
  assert sorted(os.listdir(tmp_path)) == ["shared.json"]  # no lock file or temp file left


def test_same_prompt_and_epoch_the_later_save_wins_with_a_warning(tmp_path, caplog):
  """Two runs load the same history and both record prompt 'a' epoch 3: the later save wins,
  warning with the file and the count; the earlier run's other entries are kept; re-recording
  an epoch this run loaded (a rerun) replaces it without a warning."""
  path = str(tmp_path / "h.json")
  LengthHistory({"a": {0: [5]}}, model="cfg-a").save(path)
  first = LengthHistory.load(path, model="cfg-a")
  second = LengthHistory.load(path, model="cfg-a")
  first.add("a", 3, [7, 8])
  first.add("b", 3, [2])
  first.add_step_seconds({4: 0.25, 8: 0.5})
  second.add("a", 3, [9, 9])
  second.add_step_seconds({4: 0.75})
  with caplog.at_level(logging.WARNING):
    first.save(path)
    assert not caplog.records
    second.save(path)
  warned = [r.getMessage() for r in caplog.records]
  print(warned)
  assert len(warned) == 1 and path in warned[0] and " 1 of the entries" in warned[0], warned
  h = LengthHistory.load(path, model="cfg-a")
  assert h.data == {"a": {0: [5], 3: [9, 9]}, "b": {3: [2]}}
  assert h.step_seconds == {4: 0.75, 8: 0.5}
  caplog.clear()
  rerun = LengthHistory.load(path, model="cfg-a")
  rerun.add("a", 3, [1])
  with caplog.at_level(logging.WARNING):
    rerun.save(path)
  assert not caplog.records and LengthHistory.load(path).data["a"][3] == [1]


def test_saving_over_another_models_history_warns_that_it_replaces_it(tmp_path, caplog):
  """Another model's file is not used (load warns) and is replaced when this run saves, with a
  warning saying so at the save too (it may have been written after this run loaded)."""
  path = str(tmp_path / "h.json")
  LengthHistory({"p": {0: [3]}}, model="cfg-a").save(path)
  h = LengthHistory.load(path, model="cfg-b")
  h.add("q", 1, [4])
  with caplog.at_level(logging.WARNING):
    h.save(path)
  msg = " ".join(r.getMessage() for r in caplog.records)
  assert path in msg and "cfg-a" in msg and "replacing" in msg, msg
  assert LengthHistory.load(path, model="cfg-b").data == {"q": {1: [4]}}


def test_a_killed_savers_lock_is_taken_over(tmp_path, caplog):
  """A history lock left by a killed process: the next save takes it over, naming the pid."""
  path = str(tmp_path / "h.json")
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  holder.kill()
  holder.wait()
  (tmp_path / "h.json.lock").write_text(f"{holder.pid} {socket.gethostname()}\n")
  with caplog.at_level(logging.WARNING):
    LengthHistory({"p": {0: [3]}}).save(path)
  assert f"pid {holder.pid}" in caplog.text and path in caplog.text, caplog.text
  assert sorted(os.listdir(tmp_path)) == ["h.json"]
