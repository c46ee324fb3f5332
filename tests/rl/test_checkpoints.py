"""Issue 20, problems 4-8: each case reproduces a failure a hostile but realistic user hit, and
checks it now recovers or stops with one clear error naming the field, file or tensor.

4. A damaged newest GRPO checkpoint: resume falls back to the previous verified one, with a
   warning naming it; stray entries are ignored; old checkpoints are pruned.
5. NaN or integer weights are refused at load, naming file and tensor; non-finite rewards and
   log-probs never reach training.
6. Killing the launcher (kill -9 or SIGTERM) leaves no child running.
7. Bad counts and strings in the rl, sft and rollout CLIs: one line, before jax starts.
8. Impossible history values are refused naming file and prompt; a history recorded for another
   model is warned about and replaced.
Tiny shapes throughout; the one end-to-end resume (a training step) is in test_rl_train.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from rl_utils import ROOT, grpo_config  # noqa: E402

from flexfloor_jax.policy.history import HistoryError, LengthHistory  # noqa: E402

# ----------------------------------------------------------------------------- 4. checkpoints


def _state(step: int):
  import jax.numpy as jnp
  import optax
  params = {"w": jnp.arange(16.0).reshape(4, 4) + step, "b": jnp.full((4,), float(step))}
  return params, optax.adam(1e-3).init(params)


def _abstract(tree):
  import jax
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _saved(tmp_path, steps=(2, 3)):
  from flexfloor_jax.rl import checkpoints as ckpts
  c = grpo_config(tmp_path / "run")
  for k in steps:
    p, o = _state(k)
    ckpts.save_checkpoint(c, k, p, o, LengthHistory({"q": {k - 1: [3, 4]}}, model="cfg-m"))
  return c


def _data_files(step_dir):
  """The orbax data files of a checkpoint, largest first."""
  out = []
  for d, _, names in os.walk(os.path.join(step_dir, "state")):
    out += [os.path.join(d, n) for n in names if os.sep + "d" + os.sep in os.path.join(d, n)]
  return sorted(out, key=os.path.getsize, reverse=True)


def _damage(step_dir, how):
  meta = os.path.join(step_dir, "meta.json")
  if how == "deleted_data_file":
    for f in _data_files(step_dir):
      os.unlink(f)
  elif how == "truncated_data_file":
    f = _data_files(step_dir)[0]
    with open(f, "r+b") as fh:
      fh.truncate(os.path.getsize(f) // 2)
  elif how == "truncated_data_file_no_sizes":  # older meta.json: orbax itself must notice
    with open(meta) as fh:
      m = json.load(fh)
    del m["files"]
    with open(meta, "w") as fh:
      json.dump(m, fh)
    for f in _data_files(step_dir):
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
  elif how == "truncated_meta":
    with open(meta, "r+b") as fh:
      fh.truncate(20)
  elif how == "incomplete":  # killed before meta.json was written
    os.unlink(meta)
  elif how == "nan_values":
    import jax.numpy as jnp

    from flexfloor_jax.rl import checkpoints as ckpts
    p, o = _state(3)
    p["w"] = p["w"].at[1, 2].set(jnp.nan)
    c = grpo_config(os.path.dirname(os.path.dirname(step_dir)))
    ckpts.save_checkpoint(c, 3, p, o, LengthHistory({"q": {2: [3, 4]}}, model="cfg-m"))
  elif how == "history_out_of_range":
    with open(meta) as fh:
      m = json.load(fh)
    m["history"]["q"]["2"] = [3, -4]
    with open(meta, "w") as fh:
      json.dump(m, fh)
  else:
    raise AssertionError(how)


DAMAGE = ("deleted_data_file", "truncated_data_file", "truncated_data_file_no_sizes",
          "truncated_meta", "incomplete", "nan_values", "history_out_of_range")


@pytest.mark.parametrize("how", DAMAGE)
def test_resume_skips_damaged_newest_checkpoint(tmp_path, caplog, how):
  """Before: a tensorstore dump, a one-line JSON error naming no file, or NaN weights resumed.
  Now: step 2 is restored exactly, and the warning names step_3."""
  from flexfloor_jax.rl import checkpoints as ckpts
  c = _saved(tmp_path)
  step3 = os.path.join(c.output_dir, "checkpoints", "step_3")
  _damage(step3, how)
  p2, o2 = _state(2)
  with caplog.at_level(logging.WARNING, logger=ckpts.__name__):
    k, params, opt_state, history = ckpts.resume_state(c, _abstract(p2), _abstract(o2),
                                                       "cfg-m", max_new_tokens=12)
  assert k == 2
  assert np.array_equal(np.asarray(params["w"]), np.asarray(p2["w"]))
  assert history.data == {"q": {1: [3, 4]}} and history.model == "cfg-m"
  warned = " ".join(r.getMessage() for r in caplog.records)
  assert step3 in warned, warned
  assert len(warned) < 1500, "one line per checkpoint, not a tensorstore dump"


def test_stray_entries_are_not_checkpoints(tmp_path):
  """Before: `checkpoints/step_6.bak` gave "invalid literal for int()" naming no file."""
  from flexfloor_jax.rl import checkpoints as ckpts
  c = _saved(tmp_path)
  root = os.path.join(c.output_dir, "checkpoints")
  shutil.copytree(os.path.join(root, "step_3"), os.path.join(root, "step_6.bak"))
  with open(os.path.join(root, "step_9"), "w") as f:  # a file, not a directory
    f.write("notes")
  os.makedirs(os.path.join(root, "step_x"))
  assert ckpts.latest_checkpoint(c)[0] == 3
  p, o = _state(3)
  assert ckpts.resume_state(c, _abstract(p), _abstract(o), "cfg-m", 12)[0] == 3


def test_no_usable_checkpoint_is_an_error_naming_each(tmp_path):
  """Starting over would discard the run's checkpoints and metrics: the user decides."""
  from flexfloor_jax.rl import checkpoints as ckpts
  c = _saved(tmp_path)
  for k in (2, 3):
    _damage(os.path.join(c.output_dir, "checkpoints", f"step_{k}"), "truncated_meta")
  p, o = _state(2)
  with pytest.raises(ckpts.TrainError) as e:
    ckpts.resume_state(c, _abstract(p), _abstract(o), "cfg-m", 12)
  assert "step_2" in str(e.value) and "step_3" in str(e.value)


def test_prune_keeps_newest(tmp_path):
  from flexfloor_jax.rl import checkpoints as ckpts
  c = _saved(tmp_path, steps=(1, 2, 3, 4, 5))
  root = os.path.join(c.output_dir, "checkpoints")
  os.unlink(os.path.join(root, "step_4", "meta.json"))  # an interrupted save: not counted
  shutil.copytree(os.path.join(root, "step_1"), os.path.join(root, "step_1.bak"))
  c.keep_checkpoints = 3
  ckpts.prune_checkpoints(c, 5)
  assert sorted(os.listdir(root)) == ["step_1.bak", "step_2", "step_3", "step_5"]
  c.keep_checkpoints = 0  # keep all
  assert ckpts.prune_checkpoints(c, 5) == []


# ----------------------------------------------------------------------------- 5. weights

TINY_HF = {"model_type": "mixtral", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 4, "num_local_experts": 2, "num_experts_per_tok": 1,
           "max_position_embeddings": 64, "eos_token_id": 2, "bos_token_id": 1,
           "torch_dtype": "float32", "tie_word_embeddings": False}


def _tiny_hf(path, *, dtype=np.float32, poison=None, config=None):
  """A Mixtral directory in the hub layout written with numpy (no torch): config.json and one
  safetensors file; `poison` = (key, value) written into that tensor."""
  from safetensors.numpy import save_file
  cfg = dict(TINY_HF, **(config or {}))
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  d, v, f_, e = 8, 16, 8, 2
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "lm_head.weight": (v, d), "model.layers.0.input_layernorm.weight": (d,),
            "model.layers.0.post_attention_layernorm.weight": (d,),
            "model.layers.0.self_attn.q_proj.weight": (8, d),
            "model.layers.0.self_attn.k_proj.weight": (4, d),
            "model.layers.0.self_attn.v_proj.weight": (4, d),
            "model.layers.0.self_attn.o_proj.weight": (d, 8),
            "model.layers.0.block_sparse_moe.gate.weight": (e, d)}
  for j in range(e):
    q = f"model.layers.0.block_sparse_moe.experts.{j}."
    shapes.update({q + "w1.weight": (f_, d), q + "w3.weight": (f_, d), q + "w2.weight": (d, f_)})
  rng = np.random.default_rng(0)
  tensors = {k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in shapes.items()}
  tensors = {k: t.astype(dtype) for k, t in tensors.items()}
  if poison is not None:
    key, value = poison
    tensors[key] = tensors[key].copy()
    tensors[key].flat[3] = value
  save_file(tensors, os.path.join(path, "model.safetensors"))
  return str(path)


EXPERT = "model.layers.0.block_sparse_moe.experts.1.w2.weight"


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_hf_weight_is_refused_naming_the_tensor(tmp_path, value):
  """Before: exit 0 and responses.jsonl full of bare NaN."""
  from flexfloor_jax.model import checkpoint as ck
  path = _tiny_hf(tmp_path / "hf", poison=(EXPERT, value))
  with pytest.raises(ck.CheckpointError, match=re.escape(EXPERT)) as e:
    ck.load_checkpoint(path)
  assert "model.safetensors" in str(e.value) and "NaN or infinite" in str(e.value)


def test_cast_overflow_is_refused(tmp_path):
  """A finite float32 weight that a float16 run would turn into inf."""
  from flexfloor_jax.model import checkpoint as ck
  path = _tiny_hf(tmp_path / "hf", poison=(EXPERT, 1e6))
  ck.load_checkpoint(path)  # float32: fine
  with pytest.raises(ck.CheckpointError, match=re.escape(EXPERT)):
    ck.load_checkpoint(path, dtype="float16")


def test_integer_hf_weights_are_refused_before_any_read(tmp_path, monkeypatch):
  """Before: int8 tensors under the normal names were cast and every log-prob was 0.0."""
  from flexfloor_jax.model import checkpoint as ck
  path = _tiny_hf(tmp_path / "hf", dtype=np.int8)
  with pytest.raises(ck.CheckpointError, match=r"model\.embed_tokens\.weight' has dtype I8") as e:
    ck.inspect_checkpoint(path)
  assert "float32" in str(e.value)


def test_nonfinite_orbax_weight_is_refused(tmp_path):
  import jax
  import jax.numpy as jnp

  from flexfloor_jax.model import checkpoint as ck
  from flexfloor_jax.model import transformer as tfm
  from flexfloor_jax.model.config import ModelConfig
  cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=4, num_experts=2, top_k=1)
  params = tfm.init_params(cfg, jax.random.key(0), scale=0.1)
  params["layers"]["w1"] = params["layers"]["w1"].at[0, 1, 2, 3].set(jnp.nan)
  ck.save_orbax(str(tmp_path / "o"), params, cfg)
  with pytest.raises(ck.CheckpointError, match=r"\['layers'\]\['w1'\]"):
    ck.load_orbax(str(tmp_path / "o"))


def test_nonfinite_reward_or_logprob_stops_training():
  from flexfloor_jax.rl import train
  resp = [{"prompt_id": "p0", "sample": 0}, {"prompt_id": "p1", "sample": 1}]
  train._check_finite("the reward", np.array([1.0, 0.5]), resp, 4)  # finite: no error
  with pytest.raises(train.TrainError, match=r"step 4: the reward of prompt 'p1' sample 1"):
    train._check_finite("the reward", np.array([1.0, np.nan]), resp, 4)
  with pytest.raises(train.TrainError, match=r"log-prob of prompt 'p0' sample 0"):
    train._check_finite("a rollout log-prob", [[-0.1, -np.inf], [-0.2]], resp, 4)


# ----------------------------------------------------------------------------- 6. launcher


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
  """Before: children in their own sessions survived the launcher (> 5 min, ~1 GB each)."""
  code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  launcher = subprocess.Popen([sys.executable, "-m", "flexfloor_jax.runtime.launch",
                               "--num_processes=2", "--", sys.executable, "-c", code],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
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


# ----------------------------------------------------------------------------- 7. inputs


def _hf_config_only(tmp_path, **override):
  d = tmp_path / "ckpt"
  d.mkdir(exist_ok=True)
  (d / "config.json").write_text(json.dumps(dict(TINY_HF, **override)))
  return str(d)


def _history_file(tmp_path, prompts, model=None):
  doc = {"format": "flexfloor_jax.length_history", "version": 1, "prompts": prompts}
  if model is not None:
    doc["model"] = model
  p = tmp_path / "hist.json"
  p.write_text(json.dumps(doc))
  return str(p)


def _cases(tmp_path):
  """name -> (module, args, substrings the one error line must hold)."""
  surrogate = tmp_path / "prompts.jsonl"
  surrogate.write_text('{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "x\\ud800y"}\n')
  empty = _history_file(tmp_path, {"builtin-0": {"0": []}})
  out = f"--config.output_dir={tmp_path / 'out'}"
  rout = f"--config.rollout.output_dir={tmp_path / 'rout'}"
  return {
      "train_checkpoint_every_0": ("rl.train", [out, "--config.checkpoint_every=0"],
                                   ["checkpoint_every", "0"]),
      "train_steps_0": ("rl.train", [out, "--config.steps=0"], ["steps", ">= 1"]),
      "train_misspelled_field": ("rl.train", [out, "--config.rl.lrr=0.1"],
                                 ["--config.rl.lrr", 'Did you mean "lr"']),
      "sft_batch_size_0": ("rl.sft", ["--config.sft.batch_size=0"], ["sft.batch_size"]),
      "sft_steps_0": ("rl.sft", ["--config.sft.steps=0"], ["sft.steps"]),
      "sft_misspelled_field": ("rl.sft", ["--config.sft.step=5"],
                               ["--config.sft.step", 'Did you mean "steps"']),
      "max_prompt_len_over_max_seq_len": ("rollout", [rout, "--config.rollout.max_prompt_len=1000",
                                                      "--config.model.max_seq_len=320"],
                                          ["rollout.max_prompt_len=1000", "model.max_seq_len"]),
      "dtype_fp16x": ("rollout", [rout, "--config.model.dtype=fp16x"], ["model.dtype", "fp16x"]),
      "dtype_float64": ("rollout", [rout, "--config.model.dtype=float64"],
                        ["model.dtype", "float64"]),
      "device_memory_negative": ("rollout", [rout, "--config.mesh.device_memory_gb=-5"],
                                 ["mesh.device_memory_gb", "-5"]),
      "prompt_lone_surrogate": ("rollout", [rout, f"--config.rollout.prompts={surrogate}"],
                                [f"{surrogate}:2", "'prompt'", "surrogate"]),
      "history_empty_lengths": ("rollout", [rout, f"--config.scheduler.history_path={empty}"],
                                ["scheduler.history_path", empty, "'builtin-0'", "non-empty"]),
      "config_json_hidden_size_text": (
          "rollout", [rout, "--config.model.checkpoint=" + _hf_config_only(
              tmp_path, hidden_size="sixty-four")],
          ["config.json", "'hidden_size'", "sixty-four"]),
  }


def test_bad_inputs_fail_in_one_line_before_jax(tmp_path):
  """Before: ZeroDivisionError after a full step, silence, a useless checkpoint, IndexError after
  100 s, a JAX broadcasting error, tracebacks, or a silent float32 / auto memory run. Now each
  exits 2 with one line on stderr naming the field, file or line, without importing jax
  (python -X importtime lists every import)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)

  def run(item):
    name, (mod, args, expect) = item
    cfg = "configs/mixtral.py" if mod == "rollout" else "configs/grpo.py"
    cmd = [sys.executable, "-X", "importtime", "-m", f"flexfloor_jax.{mod}", f"--config={cfg}",
           *args]
    return name, expect, subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                        timeout=120)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    runs = list(pool.map(run, sorted(_cases(tmp_path).items())))
  failures = []
  for name, expect, proc in runs:
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    imported = {ln.split("|")[-1].strip() for ln in proc.stderr.splitlines()
                if ln.startswith("import time:")}
    why = []
    if proc.returncode != 2:
      why.append(f"exit {proc.returncode}")
    if len(lines) != 1 or not lines[0].startswith("error: "):
      why.append(f"stderr {lines[-5:]}")
    else:
      why += [f"{s!r} missing" for s in expect if s not in lines[0]]
    if "jax" in imported:
      why.append("jax was imported")
    if why:
      failures.append(f"{name}: {'; '.join(why)}")
  assert not failures, "\n".join(failures)


def test_validation_helpers_name_the_field():
  from flexfloor_jax.config.cli import load_config
  from flexfloor_jax.config.settings import ConfigError, load
  c = load_config("grpo", "tiny")
  load(c), load(c, "train"), load(c, "sft")  # the defaults pass
  bad = load_config("grpo", "tiny")
  bad.sft.batch_size = 5000
  with pytest.raises(ConfigError, match=r"sft.batch_size=5000 exceeds .* sft.num_prompts"):
    load(bad, "sft")
  bad = load_config("grpo", "tiny")
  bad.rl.b2 = 1.0
  with pytest.raises(ConfigError, match=r"rl.b2"):
    load(bad, "train")
  bad = load_config("mixtral", "tiny")
  bad.rollout.max_new_tokens = 0
  with pytest.raises(ConfigError, match=r"rollout.max_new_tokens"):
    load(bad)


# ----------------------------------------------------------------------------- 8. history


@pytest.mark.parametrize("lengths, why", [
    ([3, -4], "-4"), ([3, 1e15], "1000000000000000"), ([0], "0"), ([True], "True"), ([2.5], "2.5"),
    ([13], "13"), ([], "non-empty")])
def test_impossible_history_values_name_file_and_prompt(tmp_path, lengths, why):
  """Before: negative lengths and 1e15 were accepted and steered the schedule."""
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


def test_rollout_cli_loads_history_against_its_model(tmp_path, caplog):
  """What the rollout CLI hands the runner (which saves it): this model's identity; another
  model's history is replaced, not used."""
  from flexfloor_jax.config.cli import load_config
  from flexfloor_jax.model.config import PRESETS, model_identity
  from flexfloor_jax.rollout.inputs import prepare_rollout
  c = load_config("mixtral", "tiny")
  c.scheduler.history_path = _history_file(tmp_path, {"builtin-0": {"0": [40]}},
                                           model="cfg-0123456789abcdef")
  with caplog.at_level(logging.WARNING):
    _, h = prepare_rollout(c)
  assert len(h) == 0 and h.model == model_identity(PRESETS["tiny"])
  assert "cfg-0123456789abcdef" in caplog.text
  assert model_identity(PRESETS["tiny"]) == model_identity(PRESETS["tiny"].replace(
      dtype="bfloat16")) != model_identity(PRESETS["8x7b"])
