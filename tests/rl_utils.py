"""Small GRPO configs for the tests of rl/ (tiny preset, random init, a few tokens)."""

from flexfloor_jax.config.files import load_config

# What grpo_config sets over configs/grpo.py's tiny preset, besides the run's own fields; a
# trainer child gets the same values as flags (config_flags), so both run the same programs.
SIZES = {
    "scheduler.release_sizes": "2",  # 8 -> 2 -> 1: 3 compiled meshes instead of 8: test time
    # releases whenever a worker is free (device-steps): the mechanism under test (released
    # workers' log-probs, static == flexfloor), not the seconds-priced decision
    "scheduler.step_cost": "steps",
    "model.checkpoint": "",
    "model.max_seq_len": 40,
    "rollout.max_prompt_len": 24,
    "rollout.max_new_tokens": 12,
    "rollout.samples_per_prompt": 2,
    "rollout.slots_per_worker": 1,
    "rl.num_prompts": 4,
    "rl.task_size": 2,
    "rl.kl_beta": 0.1,
}
RUN_FIELDS = ("steps", "checkpoint_every", "schedule", "rl.lr")


def _get(c, path):
  for key in path.split("."):
    c = c[key]
  return c


def grpo_config(out_dir, *, steps=3, schedule="flexfloor", lr=1e-3, checkpoint_every=2):
  c = load_config("grpo", "tiny")
  c.steps, c.output_dir, c.checkpoint_every = steps, str(out_dir), checkpoint_every
  c.schedule = schedule
  c.update_from_flattened_dict(SIZES)
  c.rl.lr = lr
  return c


def config_flags(c, extra=()) -> list[str]:
  """`--config.<field>=<value>` flags that give the trainer CLI (configs/grpo.py) the config `c`
  of grpo_config: its sizes, its run fields and the `extra` fields (e.g. 'rl.routing_replay')."""
  return [f"--config.{p}={_get(c, p)}" for p in (*SIZES, *RUN_FIELDS, *extra)]
