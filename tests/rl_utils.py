"""Small GRPO configs for tests/test_rl_*.py (tiny preset, random init, a few tokens)."""

import os

from flexfloor_jax.cli import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def grpo_config(out_dir, *, steps=3, schedule="flexfloor", lr=1e-3, checkpoint_every=2):
  c = load_config("grpo", "tiny")
  c.steps, c.output_dir, c.checkpoint_every = steps, str(out_dir), checkpoint_every
  c.schedule = schedule
  c.scheduler.release_sizes = "pow2"  # 4 compiled meshes instead of 8: test time
  c.model.checkpoint = ""
  c.model.max_seq_len = 40
  c.rollout.max_prompt_len = 24
  c.rollout.max_new_tokens = 12
  c.rollout.samples_per_prompt = 2
  c.rollout.slots_per_worker = 1
  c.rl.num_prompts = 4
  c.rl.task_size = 2
  c.rl.lr = lr
  c.rl.kl_beta = 0.1
  return c
