"""GRPO post-training config: `python -m flexfloor_jax.rl.train --config=configs/grpo.py` (and
`python -m flexfloor_jax.rl.sft --config=configs/grpo.py` for the warm start).

Every section of configs/mixtral.py (model, mesh, rollout, sampling, schedule, scheduler) under the
same names, plus steps / output_dir / checkpoint_every / keep_checkpoints and the `rl` and `sft`
sections. The rollout's prompts are the built-in tasks (rl.tasks), written to
<output_dir>/prompts.jsonl.
"""

import ml_collections

from flexfloor_jax.config.files import load_config


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  preset = preset or "tiny"
  c = load_config("mixtral", preset)
  c.steps = 20
  c.output_dir = "grpo_out"
  c.checkpoint_every = 5  # orbax checkpoint every k steps (and after the last)
  c.keep_checkpoints = 3  # newest complete checkpoints kept, older ones removed (0 = keep all)

  c.model.checkpoint = "sft_out/checkpoint"  # the SFT warm start ('' = random init)
  c.model.max_seq_len = 160
  c.rollout.lengths = "model"  # RL: responses stop at EOS (never synthetic lengths)
  c.rollout.samples_per_prompt = 8  # GRPO group size
  c.rollout.max_new_tokens = 96
  c.rollout.max_prompt_len = 32
  c.rollout.wait_compiles = True  # releases independent of background compile timing
  c.sampling.temperature = 1.0

  c.rl = ml_collections.ConfigDict()
  c.rl.tasks = "sort,add,reverse,count"
  c.rl.num_prompts = 8  # prompts per step (the same set every step: lengths repeat per epoch)
  c.rl.task_size = 3  # problem size (digits, letters; count goes to 8 * task_size)
  c.rl.prompt_seed = 0
  c.rl.reward_fn = ""  # '' = built-in rewards | 'module:function' (fn(prompt_row, text) -> float)
  c.rl.lr = 3e-4 if preset == "tiny" else 1e-6  # tiny: large enough to learn within its steps
  c.rl.weight_decay = 0.0
  c.rl.b1 = 0.9
  c.rl.b2 = 0.999
  c.rl.grad_clip = 1.0
  c.rl.clip_eps = 0.2
  c.rl.kl_beta = 0.0  # > 0: k3 KL (verl low_var_kl) to the frozen initial policy
  c.rl.aux_coef = 0.01  # Switch load-balance loss coefficient
  c.rl.updates_per_step = 1  # optimizer steps per rollout (full batch each)
  c.rl.tile_m = 8  # expert GEMM tile of the training forward (the rollout decode's)
  c.rl.released_logprobs = True  # flexfloor: released workers score finished responses
  # Replay the rollout's routing (recorded per token) in the training forward; released-worker
  # scoring is then off (its one-device programs do not replay)
  c.rl.routing_replay = False

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 200
  c.sft.batch_size = 16
  c.sft.lr = 3e-3
  c.sft.weight_decay = 0.0
  c.sft.seed = 0
  c.sft.num_prompts = 4096  # training pool (seed differs from the RL prompts: sft.seed + 1000)
  c.sft.output_dir = "sft_out"  # checkpoint at <output_dir>/checkpoint
  c.sft.eval_every = 100
  return c
