"""Speculative decoding on the GRPO workload:
`python -m flexfloor_jax.bench --config=configs/bench_drafts.py`, after the SFT warm start
`python -m flexfloor_jax.rl.sft --config=configs/grpo.py` (it writes sft_out/checkpoint and the RL
prompt set sft_out/eval_prompts.jsonl, which this config reads).

configs/bench.py on the trace of a GRPO step of configs/grpo.py: the SFT model's own responses
(rollout.lengths 'model': each stops at EOS) to the RL prompts (rl.num_prompts of them, each
sampled rl's group size times at temperature 1.0), at grpo.py's max_new_tokens, max_prompt_len
and cache length. Each epoch samples the same model anew (rollout.epoch keys the sampling), as a
GRPO step of a slowly changing policy does. What it measures: static, balanced and flexfloor,
each decoding plainly and drafting (draft_tokens 4: each live row's next tokens drafted from the
earlier epochs' responses of its prompt and from its sibling samples, verified in free decode
rows; the tokens are plain decoding's), in the seconds of the bench's cost model: per schedule
the acceptance, the mean accepted length and the makespan plain -> drafted; whether flexfloor
keeps its advantage over static when both draft; and flexfloor drafting over static decoding
plainly, beside the paper's gains against verl. Epoch 0 drafts from siblings alone (the store is
empty), epochs 1 and 2 from the earlier epochs too. The release-alone variants are left out.
"""

import os

from flexfloor_jax.config.files import load_config


def get_config(preset: str = "tiny"):
  preset = preset or "tiny"
  c = load_config("bench", preset)
  g = load_config("grpo", preset)  # the GRPO step's shape, kept in step with configs/grpo.py
  c.model.checkpoint = g.model.checkpoint  # the SFT warm start: sft_out/checkpoint
  c.model.max_seq_len = g.model.max_seq_len
  c.rollout.prompts = os.path.join(g.sft.output_dir, "eval_prompts.jsonl")  # rl.sft writes it
  # A prompts file's rows are all read (num_prompts sizes the built-in set only): rl.sft writes
  # rl.num_prompts rows, so the run is a GRPO step's, num_prompts x samples_per_prompt sequences
  c.rollout.num_prompts = g.rl.num_prompts
  c.rollout.samples_per_prompt = g.rollout.samples_per_prompt
  c.rollout.lengths = g.rollout.lengths  # 'model': responses stop at EOS
  c.rollout.max_new_tokens = g.rollout.max_new_tokens
  c.rollout.max_prompt_len = g.rollout.max_prompt_len
  c.sampling.temperature = g.sampling.temperature
  c.rollout.slots_per_worker = g.rollout.slots_per_worker  # the main job's (configs/bench.py's)
  c.epochs = 3  # epoch 0 drafts from siblings alone, epochs 1 and 2 from the earlier ones too
  c.draft_tokens = 4
  c.release_only = False
  c.output_dir = "bench_out/drafts"
  return c
