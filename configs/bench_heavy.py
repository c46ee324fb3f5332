"""Heavier-tailed benchmark: `python -m flexfloor_jax.bench --config=configs/bench_heavy.py`.

configs/bench.py with a GRPO-shaped, heavier-tailed workload: 16 prompts x 16 samples (256
sequences), per-prompt lognormal sigma 0.8 around a median of 128 tokens, cap (max_new_tokens)
1024, 8 decode slots per worker; epochs 0-2. The release-alone variants are left out (the default
bench has them) to keep the run short.
"""

from flexfloor_jax.config.files import load_config


def get_config(preset: str = "tiny"):
  c = load_config("bench", preset or "tiny")
  c.rollout.num_prompts = 16
  c.rollout.samples_per_prompt = 16
  c.rollout.max_new_tokens = 1024
  c.rollout.slots_per_worker = 8
  c.model.max_seq_len = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  c.workload.sigma = 0.8
  c.workload.median = 128.0
  c.epochs = 3
  c.output_dir = "bench_out/heavy"
  c.release_only = False
  return c
