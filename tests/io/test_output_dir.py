"""What an output directory's publish may replace (io/output_dir.py): only this project's own
links and sets. A user's `latest/` directory, a file, directory or foreign symbolic link named
like a published name, an older version's in-place output, or a `.published` that is not ours
stops the run before anything is compiled with one error naming the path, every file left as it
was; a second run over the project's own directory publishes as before."""

from __future__ import annotations

import hashlib
import os

import engine_utils
import pytest

from flexfloor_jax.bench import report
from flexfloor_jax.io import output_dir
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rollout import outputs as rollout_outputs
from flexfloor_jax.rollout import runner
from flexfloor_jax.rollout.inputs import prepare_rollout


@pytest.fixture
def fake_plot(monkeypatch):
  from flexfloor_jax.policy import accounting

  def plot(tl, path, title=None):
    with open(path, "w") as f:
      f.write(title)
  monkeypatch.setattr(accounting, "plot_timeline", plot)


@pytest.fixture(scope="module")
def model():
  import jax

  from flexfloor_jax.model import transformer as tfm
  from flexfloor_jax.model.config import PRESETS
  cfg = PRESETS["tiny"].replace(num_layers=2)
  return cfg, tfm.init_params(cfg, jax.random.key(3), scale=0.1)


def _config(out):
  c = engine_utils.rollout_config()
  c.schedule = "static"
  c.rollout.output_dir = str(out)
  return c


def _snapshot(root) -> dict:
  """Every entry under `root` (links not followed): its kind and content hash or target."""
  seen = {}
  for d, dirs, files in os.walk(root):
    for n in dirs + files:
      p = os.path.join(d, n)
      rel = os.path.relpath(p, root)
      if os.path.islink(p):
        seen[rel] = ("link", os.readlink(p))
      elif os.path.isdir(p):
        seen[rel] = ("dir",)
      else:
        with open(p, "rb") as f:
          seen[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
  return seen


def _users_latest(out):
  (out / "latest").mkdir()
  (out / "latest" / "notes.txt").write_text("the user's notes")
  return out / "latest"


def _old_in_place_responses(out):  # an older version's output, or a user's: the same to us
  (out / "responses.jsonl").write_text('{"prompt_id": "mine"}\n')
  return out / "responses.jsonl"


def _foreign_summary_link(out):
  (out / "elsewhere.json").write_text('{"mine": 1}')
  os.symlink("elsewhere.json", out / "summary.json")
  return out / "summary.json"


def _published_file(out):
  (out / ".published").write_text("the user's file")
  return out / ".published"


def _users_dir_timeline(out):
  (out / "timeline.png").mkdir()
  (out / "timeline.png" / "a.png").write_bytes(b"\x89PNG")
  return out / "timeline.png"


def _users_entry_in_published(out):
  (out / ".published").mkdir()
  (out / ".published" / "keep-me.txt").write_text("x")
  return out / ".published" / "keep-me.txt"


def _history_elsewhere_but_file_here(out):
  """scheduler.history_path elsewhere: a history.json file here is not this run's input."""
  (out / "history.json").write_text("the user's history.json")
  return out / "history.json"


CASES = {
    "users_latest_dir": _users_latest,
    "regular_responses_jsonl": _old_in_place_responses,
    "foreign_symlink_summary_json": _foreign_summary_link,
    "published_is_a_file": _published_file,
    "users_dir_named_timeline_png": _users_dir_timeline,
    "users_entry_in_published": _users_entry_in_published,
    "history_json_not_the_history": _history_elsewhere_but_file_here,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_foreign_entries_are_refused_before_compiling(tmp_path, model, no_compile, fake_plot,
                                                     case):
  out = tmp_path / "out"
  out.mkdir()
  path = CASES[case](out)
  c = _config(out)
  if case == "history_json_not_the_history":
    c.scheduler.history_path = str(tmp_path / "shared_history.json")
  before = _snapshot(tmp_path)
  cfg, params = model
  for call in (lambda: prepare_rollout(c),  # the CLI's check, before jax starts
               lambda: runner.run(c, params=params, model_cfg=cfg, progress=False)):
    with pytest.raises(runner.RolloutError) as e:
      call()
    msg = str(e.value)
    print(case, "->", msg)
    assert msg.startswith(f"rollout.output_dir: {path} is not a "), msg
    assert "this project made" in msg and "move it away or choose another directory" in msg, msg
    assert _snapshot(tmp_path) == before  # byte-identical, nothing added
  # the publish itself refuses too (a file that appeared during the run), keeping the set
  with pytest.raises(output_dir.OutputWriteError) as e:
    rollout_outputs.publish_outputs(
        str(out), [{"prompt_id": "p", "sample": 0, "logprobs": [-1.0]}], {}, None, "t",
        LengthHistory({"p": {0: [2]}}), c.scheduler.history_path or str(out / "history.json"))
  assert str(path) in str(e.value) and "nothing was published" in str(e.value), e.value
  assert os.path.isfile(os.path.join(e.value.staging, "responses.jsonl"))
  after = _snapshot(tmp_path)
  assert {k: v for k, v in after.items() if not k.startswith("out/.staging")} == before


@pytest.mark.parametrize("case", ["users_latest_dir", "regular_responses_jsonl"])
def test_bench_refuses_foreign_entries(tmp_path, monkeypatch, case):
  """The bench's up-front check (bench/__main__.py) and its publish."""
  monkeypatch.setattr(report, "plot", lambda doc, tl, path: open(path, "w").close())
  out = tmp_path / "out"
  out.mkdir()
  path = {"users_latest_dir": _users_latest,
          "regular_responses_jsonl": lambda o: _old_in_place_responses(o).rename(
              o / "bench.json") or o / "bench.json"}[case](out)
  before = _snapshot(tmp_path)
  with pytest.raises(output_dir.OutputDirError, match=f"output_dir: {path} is not a "):
    output_dir.acquire(str(out), "output_dir", report.BENCH_OUTPUTS)
  with pytest.raises(output_dir.OutputWriteError, match=str(path)):
    report.write_outputs({}, {}, {}, str(out))
  after = _snapshot(tmp_path)
  assert {k: v for k, v in after.items() if not k.startswith("out/.staging")} == before


def test_second_run_on_own_directory_publishes(tmp_path, fake_plot):
  """The project's own links (and a history.json that is the run's length history) are
  replaced as before; the user's other files stay."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "my_notes.txt").write_text("mine")
  # a history file this run reads (scheduler.history_path unset): its input, carried over
  LengthHistory({"old": {0: [4]}}).save(str(out / "history.json"))
  c = _config(out)
  finals = []
  for tag in ("RUN-A", "RUN-B", "RUN-C"):
    _, h = prepare_rollout(c)  # the up-front check passes
    h.add(tag, 1, [3])
    finals.append(rollout_outputs.publish_outputs(
        str(out), [{"prompt_id": tag, "sample": 0, "logprobs": [-1.0]}], {"run": tag}, None,
        tag, h, str(out / "history.json")))
    for n in rollout_outputs.ROLLOUT_OUTPUTS:
      assert os.readlink(out / n) == os.path.join("latest", n)
    assert os.path.realpath(out / "latest") == finals[-1]
    with open(out / "responses.jsonl") as f:
      assert tag in f.read()
  assert set(LengthHistory.load(str(out / "history.json")).data) == {"old", "RUN-A", "RUN-B",
                                                                     "RUN-C"}
  assert (out / "my_notes.txt").read_text() == "mine"
  assert sorted(os.listdir(out / ".published")) == sorted(os.path.basename(f)
                                                          for f in finals[1:])
