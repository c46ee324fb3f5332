"""Rollout log-probs == the training forward's log-probs of the same tokens (no train/inference
mismatch): tiny preset (4 layers, fp32), random init, temperature 1.0, no top-p / top-k, responses
ending at EOS, the rollout on the flexfloor schedule (released workers, moved experts) and the
training forward on all 8 devices with ep_moe. Compared as a user's run compiles
(test_user_flags.py): the two sides are different programs."""

import jax
import numpy as np
import pytest
from rl_utils import grpo_config

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.model.tokenizer import ByteTokenizer
from flexfloor_jax.rl import actor, tasks, train
from flexfloor_jax.rollout import runner
from flexfloor_jax.runtime import mesh as mesh_lib

# fp32: two programs of the same math (other fusions, other summation orders) differ by rounding
# far below this; a wrong token, position or temperature moves log-probs by much more.
TOL = 1e-4
pytestmark = pytest.mark.user_flags


def test_rollout_logprobs_equal_training_forward(tmp_path, step_caches):
  c = grpo_config(tmp_path)
  c.rollout.prompts = str(tmp_path / "prompts.jsonl")
  c.rollout.output_dir = str(tmp_path)
  c.sampling.temperature, c.sampling.top_p, c.sampling.top_k = 1.0, 1.0, 0
  rows = tasks.make_prompts(c.rl.tasks, c.rl.num_prompts, seed=7, size=2)
  tasks.write_prompts_jsonl(rows, c.rollout.prompts)
  cfg = PRESETS["tiny"]
  params = tfm.init_params(cfg, jax.random.key(11), scale=0.1)  # fresh weights for this test
  tok = ByteTokenizer()
  res = runner.run(c, params=params, model_cfg=cfg, tokenizer=tok, write_outputs=False,
                   progress=False, step_cache=step_caches)
  assert len({r["worker"] for r in res.responses}) > 1
  ptoks = {r["id"]: tok.encode(r["prompt"], add_bos=True) for r in rows}
  t_max = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  batch, roll = train.build_batch(res.responses, ptoks, np.zeros(len(res.responses)),
                                  c.rollout.samples_per_prompt, t_max, 8)
  mesh = mesh_lib.make_ep_mesh(jax.devices())
  a = actor.Actor(actor.ActorSpec(cfg, 8, temperature=1.0, tile_m=8), mesh, None)
  lp = a.logprobs(actor.shard_params(params, mesh), batch["tokens"], batch["valid"])
  m = batch["mask"]
  assert m.sum() == sum(r["num_tokens"] for r in res.responses) > 0
  diff = np.abs(lp - roll)[m]
  print(f"log-prob parity: {m.sum()} tokens, max|diff| {diff.max():.3g}")
  assert diff.max() <= TOL
  # The recorded log-probs are real (not a degenerate constant): spread over a range.
  assert np.ptp(roll[m]) > 1.0
