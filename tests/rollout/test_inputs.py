"""What a rollout reads besides the config's fields (rollout/inputs.py), checked before anything
is compiled.

Bad input (config values, prompts, lengths, length history, checkpoint, devices) raises one
error whose message names the field or the file, nothing is compiled first, and no output file is
left. Each case runs the checks `python -m flexfloor_jax.rollout` runs, in this process:
prepare_rollout, then runner.run up to its engine, on the config the case's --config.x=y flags
would give. The CLI prints that message as its one `error:` line and exits 2
(test_rollout_cli.py runs it once, as a user does). And a length history recorded for another
model is replaced.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import hf_utils
import pytest
from engine_utils import CompileCounter

from flexfloor_jax import engine
from flexfloor_jax.config.files import load_config
from flexfloor_jax.config.settings import ConfigError
from flexfloor_jax.model.config import PRESETS, model_identity
from flexfloor_jax.rollout import runner
from flexfloor_jax.rollout.inputs import prepare_rollout

# Every case fails the same way at full size; small sizes keep a check that comes too late cheap.
SMALL = {"rollout.num_prompts": 2, "rollout.samples_per_prompt": 2,
         "rollout.max_new_tokens": 16, "model.max_seq_len": 64, "rollout.slots_per_worker": 2,
         "mesh.num_devices": 2, "schedule": "static"}
BAD_INPUT_SECONDS = 30  # a check takes milliseconds; a compile-and-run takes far longer


def _write_jsonl(path, rows) -> str:
  with open(path, "w") as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def _history_file(path, prompts, model=None) -> str:
  doc = {"format": "flexfloor_jax.length_history", "version": 1, "prompts": prompts}
  if model is not None:
    doc["model"] = model
  path.write_text(json.dumps(doc))
  return str(path)


def _cases(tmp) -> dict:
  """name -> (config changes, substrings the error must hold). Files under tmp."""
  p = tmp.joinpath
  good = _write_jsonl(p("good.jsonl"), [{"id": "a", "tokens": [257, 72, 105]},
                                        {"id": "b", "prompt": "hello"}])
  surrogate = _write_jsonl(p("surrogate.jsonl"), ['{"id": "a", "prompt": "ok"}',
                                                  '{"id": "b", "prompt": "x\\ud800y"}'])
  empty_history = _history_file(p("hist.json"), {"builtin-0": {"0": []}})
  cases = {
      "bad_schedule": ({"schedule": "verl"}, ["schedule", "verl"]),
      "bad_release_sizes": ({"scheduler.release_sizes": "4,x"},
                            ["scheduler.release_sizes", "'x'"]),
      "max_new_tokens_zero": ({"rollout.max_new_tokens": 0}, ["rollout.max_new_tokens"]),
      "max_new_tokens_negative": ({"rollout.max_new_tokens": -3}, ["rollout.max_new_tokens"]),
      "max_prompt_len_over_max_seq_len": (
          {"rollout.max_prompt_len": 1000, "model.max_seq_len": 320},
          ["rollout.max_prompt_len=1000", "model.max_seq_len"]),
      "dtype_fp16x": ({"model.dtype": "fp16x"}, ["model.dtype", "fp16x"]),
      "dtype_float64": ({"model.dtype": "float64"}, ["model.dtype", "float64"]),
      "device_memory_negative": ({"mesh.device_memory_gb": -5.0},
                                 ["mesh.device_memory_gb", "-5"]),
      "too_many_devices": ({"mesh.num_devices": 99}, ["mesh.num_devices"]),
      "prompts_missing": ({"rollout.prompts": str(p("nope.jsonl"))},
                          ["rollout.prompts", str(p("nope.jsonl"))]),
      "prompts_bad_json": (
          {"rollout.prompts": _write_jsonl(p("badjson.jsonl"), [{"id": "a", "tokens": [1, 2]},
                                                                '{"id": "b", "tokens": [1,'])},
          ["rollout.prompts", str(p("badjson.jsonl")) + ":2"]),
      "prompts_missing_id": (
          {"rollout.prompts": _write_jsonl(p("noid.jsonl"), [{"prompt": "hi"}])},
          ["rollout.prompts", str(p("noid.jsonl")) + ":1", "id"]),
      "prompt_lone_surrogate": ({"rollout.prompts": surrogate},
                                [f"{surrogate}:2", "'prompt'", "surrogate"]),
      "prompt_longer_than_max_prompt_len": (
          {"rollout.prompts": _write_jsonl(p("long.jsonl"), [{"id": "long", "tokens": [65] * 60}]),
           "rollout.max_prompt_len": 48},
          ["rollout.prompts", "'long'", "rollout.max_prompt_len"]),
      "prompt_longer_than_max_seq_len": (
          {"rollout.prompts": _write_jsonl(p("long2.jsonl"),
                                           [{"id": "long2", "tokens": [65] * 40}]),
           "model.max_seq_len": 48, "rollout.max_new_tokens": 16},
          ["rollout.prompts", "'long2'", "model.max_seq_len"]),
      "lengths_missing_file": ({"rollout.lengths": str(p("nolengths.jsonl"))},
                               ["rollout.lengths", str(p("nolengths.jsonl"))]),
      "lengths_bad_json": (
          {"rollout.prompts": good,
           "rollout.lengths": _write_jsonl(p("lens_bad.jsonl"), ["not json"])},
          ["rollout.lengths", str(p("lens_bad.jsonl")) + ":1"]),
      "lengths_no_entry": (
          {"rollout.prompts": good, "rollout.lengths": _write_jsonl(
              p("lens_part.jsonl"), [{"id": "a", "sample": s, "length": 4} for s in range(2)])},
          ["rollout.lengths", str(p("lens_part.jsonl")), "'b'"]),
      "lengths_too_long": (
          {"rollout.prompts": good, "rollout.lengths": _write_jsonl(
              p("lens_long.jsonl"), [{"id": i, "sample": s, "length": 17}
                                     for i in "ab" for s in range(2)])},
          ["rollout.lengths", str(p("lens_long.jsonl")), "rollout.max_new_tokens"]),
      "history_empty_lengths": ({"scheduler.history_path": empty_history},
                                ["scheduler.history_path", empty_history, "'builtin-0'",
                                 "non-empty"]),
  }
  # Checkpoints: a missing directory, another model_type, a deleted tensor, a truncated file, a
  # config.json with text for a number, a cache longer than the checkpoint's positions.
  ckpt = hf_utils.write_numpy_checkpoint(p("ckpt"))
  hf_cfg = json.loads(p("ckpt", "config.json").read_text())
  llama = str(p("ckpt_llama"))
  shutil.copytree(ckpt, llama)
  p("ckpt_llama", "config.json").write_text(json.dumps(dict(hf_cfg, model_type="llama")))
  tensors = hf_utils.read_all(ckpt)
  del tensors[hf_utils.EXPERT_KEY]
  nokey = hf_utils.write_single(str(p("ckpt_nokey")), tensors, hf_cfg)
  trunc = str(p("ckpt_trunc"))
  shutil.copytree(ckpt, trunc)
  st = os.path.join(trunc, "model.safetensors")
  with open(st, "r+b") as f:
    f.truncate(os.path.getsize(st) // 2)
  text = p("ckpt_text")
  text.mkdir()
  text.joinpath("config.json").write_text(json.dumps(dict(hf_cfg, hidden_size="sixty-four")))
  tok_prompts = _write_jsonl(p("tok.jsonl"), [{"id": "t", "tokens": [5, 6, 7]}])

  def ck(d, **more):
    return {"model.checkpoint": str(d), "rollout.prompts": tok_prompts, **more}
  positions = hf_cfg["max_position_embeddings"]
  cases.update({
      "checkpoint_missing_dir": (ck(p("no_ckpt")), ["model.checkpoint", str(p("no_ckpt"))]),
      "checkpoint_other_model_type": (ck(llama), ["model.checkpoint",
                                                 os.path.join(llama, "config.json"), "model_type",
                                                 "llama"]),
      "checkpoint_missing_key": (ck(nokey), ["model.checkpoint", hf_utils.EXPERT_KEY,
                                             os.path.join(nokey, "model.safetensors")]),
      "checkpoint_truncated": (ck(trunc), ["model.checkpoint", st]),
      "checkpoint_config_text_for_a_number": (ck(text), ["config.json", "'hidden_size'",
                                                         "sixty-four"]),
      "max_seq_len_over_checkpoint_positions": (
          ck(ckpt, **{"model.max_seq_len": 2 * positions}),
          [f"model.max_seq_len={2 * positions}", f"max_position_embeddings={positions}"]),
  })
  return cases


CASE_NAMES = (
    "bad_schedule", "bad_release_sizes", "max_new_tokens_zero", "max_new_tokens_negative",
    "max_prompt_len_over_max_seq_len", "dtype_fp16x", "dtype_float64", "device_memory_negative",
    "too_many_devices", "prompts_missing", "prompts_bad_json", "prompts_missing_id",
    "prompt_lone_surrogate", "prompt_longer_than_max_prompt_len",
    "prompt_longer_than_max_seq_len", "lengths_missing_file", "lengths_bad_json",
    "lengths_no_entry", "lengths_too_long", "history_empty_lengths", "checkpoint_missing_dir",
    "checkpoint_other_model_type", "checkpoint_missing_key", "checkpoint_truncated",
    "checkpoint_config_text_for_a_number", "max_seq_len_over_checkpoint_positions")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("rollout_bad_input")
  cases = _cases(tmp)
  assert sorted(cases) == sorted(CASE_NAMES)
  return cases, tmp


class _ReachedTheEngine(Exception):
  pass


@pytest.fixture
def engine_forbidden(monkeypatch):
  """A bad input that gets past every check to the engine fails the test there (its check is
  missing or comes too late) instead of running a rollout."""
  def refuse(*args, **kwargs):
    raise _ReachedTheEngine("a bad input reached the engine: its check is missing or too late")
  monkeypatch.setattr(engine.Engine, "__init__", refuse)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_fails_before_compiling_naming_the_field(cases, name, engine_forbidden, capsys):
  cases, tmp = cases
  changes, expect = cases[name]
  out = tmp / f"out_{name}"
  c = load_config("mixtral", "tiny")
  c.update_from_flattened_dict({**SMALL, **changes, "rollout.output_dir": str(out)})
  t0 = time.perf_counter()
  with CompileCounter(ignore_existing_threads=True) as compiles:
    # the errors the CLI turns into its one `error:` line (any other would be a traceback)
    with pytest.raises((ConfigError, runner.RolloutError)) as e:
      st, history = prepare_rollout(c)
      runner.run(st, history=history, progress=False)
  secs = time.perf_counter() - t0
  msg = str(e.value)
  assert "\n" not in msg, msg
  for s in expect:
    assert s in msg, f"{name}: {s!r} not in {msg!r}"
  assert compiles.count == 0, f"{name}: compiled before failing: {compiles.messages[:3]}"
  assert secs < BAD_INPUT_SECONDS, f"{name}: took {secs:.1f}s"
  leftover = sorted(os.listdir(out)) if out.is_dir() else []
  assert not leftover, f"{name}: output files left behind: {leftover}"
  assert capsys.readouterr().out == ""


def test_config_file_errors_name_the_preset_and_the_file():
  """`--config=configs/mixtral.py:nope` and a config file that does not exist: the CLIs load
  config files by name through config.files.load_config."""
  with pytest.raises(ValueError, match=r"preset 'nope'"):
    load_config("mixtral", "nope")
  with pytest.raises(OSError, match=r"configs/missing\.py"):
    load_config("missing")


def test_history_of_another_model_is_replaced(tmp_path, caplog):
  """prepare_rollout hands the runner (which saves it) a history for this model's identity; a
  history recorded for another model is warned about and not used."""
  c = load_config("mixtral", "tiny")
  c.scheduler.history_path = _history_file(tmp_path / "hist.json", {"builtin-0": {"0": [40]}},
                                           model="cfg-0123456789abcdef")
  with caplog.at_level(logging.WARNING):
    _, h = prepare_rollout(c)
  assert len(h) == 0 and h.model == model_identity(PRESETS["tiny"])
  assert "cfg-0123456789abcdef" in caplog.text
  # the identity is the model's shape: not its dtype, and not another preset's
  assert model_identity(PRESETS["tiny"]) == model_identity(PRESETS["tiny"].replace(
      dtype="bfloat16")) != model_identity(PRESETS["8x7b"])
