"""GRPO checkpoints (rl/checkpoints.py): a damaged newest checkpoint is skipped for the previous
verified one, with a warning naming it; stray entries are not checkpoints; with none usable the
error names each; old checkpoints are pruned. And non-finite rewards or log-probs stop training,
naming the response. Tiny shapes throughout; the one end-to-end resume (a training step) is in
test_train.py."""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rl_utils import grpo_config

from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rl import checkpoints as ckpts
from flexfloor_jax.rl import train


def _state(step: int):
  params = {"w": jnp.arange(16.0).reshape(4, 4) + step, "b": jnp.full((4,), float(step))}
  return params, optax.adam(1e-3).init(params)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _saved(tmp_path, steps=(2, 3)):
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
  """Whatever is wrong with step 3 (missing or truncated data, a truncated or missing meta.json,
  NaN weights, an impossible length history), step 2 is restored exactly and one short warning
  names step_3 (not a tensorstore dump)."""
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
  """A copy (step_6.bak), a file (step_9) and a bad number (step_x) beside the checkpoints are
  skipped, not parsed as steps."""
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
  c = _saved(tmp_path)
  for k in (2, 3):
    _damage(os.path.join(c.output_dir, "checkpoints", f"step_{k}"), "truncated_meta")
  p, o = _state(2)
  with pytest.raises(ckpts.TrainError) as e:
    ckpts.resume_state(c, _abstract(p), _abstract(o), "cfg-m", 12)
  assert "step_2" in str(e.value) and "step_3" in str(e.value)


def test_prune_keeps_newest(tmp_path):
  c = _saved(tmp_path, steps=(1, 2, 3, 4, 5))
  root = os.path.join(c.output_dir, "checkpoints")
  os.unlink(os.path.join(root, "step_4", "meta.json"))  # an interrupted save: not counted
  shutil.copytree(os.path.join(root, "step_1"), os.path.join(root, "step_1.bak"))
  c.keep_checkpoints = 3
  ckpts.prune_checkpoints(c, 5)
  assert sorted(os.listdir(root)) == ["step_1.bak", "step_2", "step_3", "step_5"]
  c.keep_checkpoints = 0  # keep all
  assert ckpts.prune_checkpoints(c, 5) == []


def test_nonfinite_reward_or_logprob_stops_training():
  resp = [{"prompt_id": "p0", "sample": 0}, {"prompt_id": "p1", "sample": 1}]
  train._check_finite("the reward", np.array([1.0, 0.5]), resp, 4)  # finite: no error
  with pytest.raises(train.TrainError, match=r"step 4: the reward of prompt 'p1' sample 1"):
    train._check_finite("the reward", np.array([1.0, np.nan]), resp, 4)
  with pytest.raises(train.TrainError, match=r"log-prob of prompt 'p0' sample 0"):
    train._check_finite("a rollout log-prob", [[-0.1, -np.inf], [-0.2]], resp, 4)


