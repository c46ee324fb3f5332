"""The GRPO loop (rl/train.py) on tiny sizes: metrics, checkpoints and history; a run killed
with SIGKILL resumes from its last complete checkpoint (whose length history wins over a newer
history file) with bitwise-equal deterministic metrics, and so does a run whose newest checkpoint
was damaged (it falls back to the one before). (static == flexfloor step by step:
test_grpo.py.)"""

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from checkout import CACHE, ROOT
from rl_utils import config_flags, grpo_config

from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rl import checkpoints as ckpts
from flexfloor_jax.rl import train

VERL_KEYS = ("critic/score/mean", "response_length/mean", "response_length/max",
             "response_length/clip_ratio", "actor/pg_loss", "actor/kl", "actor/grad_norm",
             "timing_s/gen", "timing_s/logprob", "timing_s/update", "timing_s/step",
             "timing_s/update_weights", "tokens_per_device_step", "idle_after_finish_fraction")


def _det(rows):
  return [{k: r[k] for k in ("step",) + train.DETERMINISTIC_KEYS} for r in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, step_caches):
  """An uninterrupted 3-step run (checkpoints after steps 2 and 3). The resumed runs below take
  the session's step caches too: they run the rollout executables this run compiled."""
  out = tmp_path_factory.mktemp("straight")
  return out, train.train(_config(out), step_cache=step_caches)


def _config(out):
  """3 flexfloor steps replaying the rollout's routing (rl.routing_replay) in the training
  forward."""
  c = grpo_config(out, steps=3, schedule="flexfloor")
  c.rl.routing_replay = True
  return c


def test_metrics_files_and_names(straight):
  out, rows = straight
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    for k in VERL_KEYS:
      assert k in r and r[k] is not None, k
    assert r["rollout/logprob_max_abs_diff"] <= 1e-4  # rollout vs training forward (replayed)
  assert os.path.getsize(out / "metrics.png") > 0
  assert ckpts.latest_checkpoint(grpo_config(out))[0] == 3
  h = LengthHistory.load(str(out / "history.json"))
  assert len(h) == 4 and all(sorted(h.epochs(p)) == [0, 1, 2] for p in h.data)
  # an update happened: the policy moved away from the reference (KL) and gradients are finite
  assert rows[-1]["actor/kl"] > 0 and all(r["actor/grad_norm"] > 0 for r in rows)


def test_resume_after_damaged_latest_checkpoint(straight, tmp_path, caplog, step_caches):
  """Step 3's data file truncated and a stray step_6.bak beside it: a warning naming step_3,
  step 2 restored, step 3 redone bitwise as the straight run did it, and a verified step 3
  written again."""
  out, full = straight
  run = tmp_path / "run"
  shutil.copytree(out, run)
  ck = run / "checkpoints"
  data = [os.path.join(d, n) for d, _, names in os.walk(ck / "step_3" / "state") for n in names
          if os.sep + "d" + os.sep in os.path.join(d, n)]
  victim = max(data, key=os.path.getsize)
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  shutil.copytree(ck / "step_2", ck / "step_6.bak")
  with caplog.at_level(logging.WARNING, logger=train.__name__):
    rows = train.train(_config(run), step_cache=step_caches)
  assert str(ck / "step_3") in caplog.text
  assert _det(rows) == _det(full)
  assert ckpts.read_meta(str(ck / "step_3"), 3)["step"] == 3  # rewritten whole
  assert sorted(os.listdir(ck)) == ["step_2", "step_3", "step_6.bak"]


@pytest.mark.slow
def test_resume_after_sigkill_bitwise(straight, tmp_path, step_caches):
  """kill -9 after the step-2 checkpoint is complete (during step 3), restart: steps 3.. equal
  the straight run bitwise; the checkpoint's length history wins over a newer history file."""
  _, full = straight
  cfg = _config(tmp_path)
  args = [sys.executable, "-m", "flexfloor_jax.rl.train", "--config=configs/grpo.py",
          f"--config.output_dir={tmp_path}", *config_flags(cfg, ("rl.routing_replay",))]
  # The trainer CLI reads a copy of the suite's persistent compilation cache (warmed by
  # `straight`): JAX writes cache entries in place, and the kill may land in the middle of one
  # that this process or the other xdist worker would read. (The copy hits: conftest.py keeps the
  # cache's path out of the keys.)
  cache = tmp_path / "jax_cache"
  shutil.copytree(CACHE, cache, dirs_exist_ok=True)
  env = dict(os.environ, FLEXFLOOR_JAX_CACHE=str(cache))  # this process's XLA_FLAGS
  proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  meta = tmp_path / "checkpoints" / "step_2" / "meta.json"
  t0 = time.time()
  try:
    while not meta.exists():
      assert proc.poll() is None, "trainer exited before its step-2 checkpoint"
      assert time.time() - t0 < 600, "no step-2 checkpoint within 600 s"
      time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  # A newer history file than the checkpoint's (as a later step would write): must lose.
  hist = LengthHistory.load(str(tmp_path / "history.json"))
  for p in list(hist.data):
    hist.add(p, 99, [1, 1])
  hist.save(str(tmp_path / "history.json"))
  rows = train.train(cfg, step_cache=step_caches)
  assert _det(rows) == _det(full)
  h = LengthHistory.load(str(tmp_path / "history.json"))
  assert all(99 not in h.epochs(p) for p in h.data)
