"""`python -m flexfloor_jax.rollout --config=configs/mixtral.py[:preset] [--config.x=y ...]`.

On CPU the devices are emulated (`--cpu_devices`, default from the config's mesh.cpu_devices
field or 8), which must happen before jax is imported: hence the late imports.
"""

import os

from absl import app, flags

from flexfloor_jax import distributed
from flexfloor_jax.cli import (config_loaded, define_config, emulate_cpu_devices, fail,
                               parse_flags, process_log)


_CONFIG = define_config("configs/mixtral.py", "Rollout config file.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")
_DIST_FLAGS = distributed.define_flags()


def prepare(config):
  """Every check that needs no JAX, then the length history loaded against this model (its
  lengths in [1, rollout.max_new_tokens]; another model's history: a warning and a fresh one).
  Raises runner.RolloutError or cli.ConfigError."""
  from flexfloor_jax import runner
  from flexfloor_jax.cli import validate_common
  from flexfloor_jax.model import checkpoint as ckpt
  from flexfloor_jax.model.config import PRESETS, model_identity
  from flexfloor_jax.policy import scheduler

  validate_common(config)
  runner.validate_config(config)
  if config.model.checkpoint:
    try:
      model_cfg = ckpt.inspect_checkpoint(config.model.checkpoint)
    except ckpt.CheckpointError as e:
      raise runner.RolloutError(f"model.checkpoint: {e}") from None
  else:
    model_cfg = PRESETS[config.preset]
  r = config.rollout
  if r.prompts and os.path.isfile(r.prompts):
    # One pass over the lines (JSON, objects, valid Unicode) so that a bad line fails before jax
    # starts; the runner checks each row's fields and lengths once the tokenizer is loaded.
    from flexfloor_jax.policy.jsonl import iter_jsonl
    try:
      for _ in iter_jsonl(r.prompts):
        pass
    except ValueError as e:
      raise runner.RolloutError(f"rollout.prompts: {e}") from None
  path = config.scheduler.history_path or os.path.join(r.output_dir, "history.json")
  try:
    return scheduler.LengthHistory.load(path, max_new_tokens=r.max_new_tokens,
                                        model=model_identity(model_cfg))
  except scheduler.HistoryError as e:
    raise runner.RolloutError(f"scheduler.history_path: {e}") from None


def main(argv):
  del argv
  config = _CONFIG.value
  config_loaded(config)
  from flexfloor_jax import runner
  from flexfloor_jax.cli import ConfigError
  try:
    history = prepare(config)  # before jax starts: bad input fails in well under a second
  except (ConfigError, runner.RolloutError) as e:
    fail(str(e))
  emulate_cpu_devices(_CPU_DEVICES.value or distributed.local_cpu_devices()
                      or config.mesh.cpu_devices)
  distributed.initialize_from_flags(_DIST_FLAGS)  # no-op unless multi-process is configured
  from flexfloor_jax.cli import enable_compilation_cache
  enable_compilation_cache()
  from flexfloor_jax.model.checkpoint import CheckpointError
  try:
    res = runner.run(config, history=history)
  except runner.RolloutError as e:
    fail(str(e))
  except CheckpointError as e:  # found while reading the tensors (NaN values, say)
    fail(f"model.checkpoint: {e}")
  s = res.summary
  log = process_log(config.rollout.output_dir)
  log(f"{s['schedule']}: {s['num_sequences']} responses, {s['generated_tokens']} tokens, "
      f"{s['device_steps']} device-steps, tokens/device-step {s['tokens_per_device_step']:.3f}, "
      f"idle after finish {s['idle_after_finish_fraction']:.3f}, slot utilization "
      f"{s['slot_utilization']:.3f}, {s['throughput_tokens_per_s']:.1f} tokens/s; "
      f"{release_line(s)}; outputs in {config.rollout.output_dir}/")


def release_line(s: dict) -> str:
  """What the elastic group did: releases, the smallest active group, and the steps compiles
  held releases back (the mechanism, without opening summary.json)."""
  n = s["num_workers"]
  releases = [r for r in s.get("releases", []) if r.get("workers") and not r.get("final")]
  smallest = n - sum(len(r["workers"]) for r in releases)
  out = (f"{len(releases)} release{'s' if len(releases) != 1 else ''}, "
         f"smallest active group {smallest} of {n} workers")
  if s.get("releases_held_for_compile_steps"):
    out += (f", releases held {s['releases_held_for_compile_steps']} steps for compiles"
            f" (rollout.wait_compiles=true waits for them)")
  return out


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
