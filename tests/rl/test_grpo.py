"""GRPO learns: from a short SFT warm start, 12 flexfloor GRPO steps raise the task reward above
an lr=0 control on the same seeds (mean of the last 5 steps); static and flexfloor give identical
rollouts, rewards and updates at every step (token-identical responses) over the first 4 steps, 3
updates included (a step is a function of the params, the optimizer state and the rollout, so the
rest of the static run would repeat the flexfloor run it equals).

The control is the rollouts of the SFT weights at the epochs of the steps it is compared at: with
lr=0, AdamW's update is zero and the weights never change, so step k of an lr=0 run is the rollout
of epoch k-1 with the SFT weights (its first step is checked equal to the trained run's first
step, which rolls out the same weights), without 12 updates that would leave them as they are."""

import numpy as np
import pytest
from rl_utils import grpo_config

from flexfloor_jax.config import settings
from flexfloor_jax.model import checkpoint as ckpt
from flexfloor_jax.model.tokenizer import load_tokenizer
from flexfloor_jax.rl import actor as actor_lib
from flexfloor_jax.rl import sft, train
from flexfloor_jax.rl import tasks as tasks_lib
from flexfloor_jax.rollout import runner
from flexfloor_jax.runtime import mesh as mesh_lib

# The last 5 steps' mean reward must beat the lr=0 control's by this much. Learning shows as a
# reward that climbs well above the control's by the end of 12 steps at lr 6e-4, while the
# control stays flat within a few hundredths: 0.05 is above the control's noise and below the gap.
# (lr 6e-4 for 12 steps rather than 3e-4 for 20: the same gap in less test time.)
MARGIN = 0.05
STEPS, LR = 12, 6e-4
STATIC_STEPS = 4  # the static run: as long as it takes to compare rollouts after 3 updates


def _config(out, sft_dir, *, schedule, lr, steps=STEPS):
  c = grpo_config(out, steps=steps, schedule=schedule, lr=lr, checkpoint_every=100)
  c.rl.tasks, c.rl.task_size, c.rl.num_prompts, c.rl.kl_beta = "sort,reverse,count", 2, 4, 0.0
  c.rollout.samples_per_prompt, c.rollout.slots_per_worker = 8, 4
  c.rollout.max_new_tokens, c.rollout.max_prompt_len, c.model.max_seq_len = 24, 24, 48
  c.sft.steps, c.sft.batch_size, c.sft.output_dir = 60, 16, str(sft_dir)
  c.model.checkpoint = str(sft_dir / "checkpoint")
  return c


def _lr0_control(c, epochs, step_caches) -> dict[int, float]:
  """{epoch: mean reward} of rollouts of the checkpoint `c` starts from, prompted and scored as
  train.train does (its prompts, sampling seeds by epoch, reward function)."""
  st = settings.load(c, "train")
  cfg, params = ckpt.load_checkpoint(st.model.checkpoint)
  cfg = cfg.replace(dtype=st.model.dtype)
  reward_fn, _, by_id, path = train.task_prompts(st)
  devices = mesh_lib.select_devices(st.mesh.num_devices)
  params = actor_lib.replicate(params, mesh_lib.make_ep_mesh(devices))  # as train.train does
  tokenizer = load_tokenizer(st.model.checkpoint, cfg)
  out = {}
  for e in epochs:
    res = runner.run(st.replace(rollout=dict(prompts=path, epoch=e,
                                             output_dir=st.train.output_dir)),
                     devices=devices, params=params, model_cfg=cfg,
                     tokenizer=tokenizer, write_outputs=False, progress=False,
                     step_cache=step_caches)
    out[e] = float(np.mean(tasks_lib.score_responses(reward_fn, by_id, res.responses)))
  return out


@pytest.mark.slow
def test_grpo_beats_lr0_control_and_static_equals_flexfloor(tmp_path, step_caches):
  warm = sft.sft(_config(tmp_path / "x", tmp_path / "sft", schedule="flexfloor", lr=0.0),
                 step_cache=step_caches)
  assert 0.0 < warm["eval/score/mean"] < 0.5  # a weak but non-zero start: room to learn
  runs = {s: train.train(_config(tmp_path / s, tmp_path / "sft", schedule=s, lr=LR, steps=n),
                         step_cache=step_caches)
          for s, n in (("flexfloor", STEPS), ("static", STATIC_STEPS))}
  learned = np.array([r["critic/score/mean"] for r in runs["flexfloor"]])
  assert len(learned) == STEPS
  # the control at the epochs of steps 1 and STEPS-4..STEPS
  control = _lr0_control(_config(tmp_path / "control", tmp_path / "sft", schedule="flexfloor",
                                 lr=0.0), [0, *range(STEPS - 5, STEPS)], step_caches)
  last5 = np.mean([control[e] for e in range(STEPS - 5, STEPS)])
  print(f"last-5 reward {learned[-5:].mean():.3f} vs lr=0 {last5:.3f}")
  assert learned[-5:].mean() >= last5 + MARGIN
  # the static and flexfloor runs are the same run, step by step (so static learns as flexfloor
  # does, against the same control)
  flex, static = runs["flexfloor"], runs["static"]
  assert len(static) == STATIC_STEPS
  for a, b in zip(flex[:STATIC_STEPS], static, strict=True):
    assert a["rollout/tokens_sha1"] == b["rollout/tokens_sha1"]
    assert a["critic/score/mean"] == b["critic/score/mean"]
    assert a["actor/grad_norm"] == b["actor/grad_norm"]
  # ... although flexfloor's released workers computed some of its old log-probs (rl/reuse.py)
  assert max(r["rollout/logprobs_on_released"] for r in flex) > 0
  assert all(r["rollout/logprobs_on_released"] == 0 for r in static)
  assert flex[0]["critic/score/mean"] == control[0]  # same weights, same seeds: the same rollout
  # ... while flexfloor released workers: more tokens per device-step than static
  def eff(rows):
    return np.mean([r["tokens_per_device_step"] for r in rows])
  assert eff(flex[:STATIC_STEPS]) > eff(static)
