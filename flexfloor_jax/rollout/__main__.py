"""`python -m flexfloor_jax.rollout --config=configs/mixtral.py[:preset] [--config.x=y ...]`.

On CPU the devices are emulated (`--cpu_devices`, default from the config's mesh.cpu_devices
field or 8), set before the first JAX operation; every input is checked before that.
"""

from flexfloor_jax.runtime import interrupt

interrupt.exit_at_once()  # before the imports below, which take seconds: see runtime/interrupt.py

from absl import flags  # noqa: E402

from flexfloor_jax.config import cli  # noqa: E402
from flexfloor_jax.config.cli import config_loaded, define_config, fail  # noqa: E402
from flexfloor_jax.config.settings import ConfigError  # noqa: E402
from flexfloor_jax.model.checkpoint import CheckpointError  # noqa: E402
from flexfloor_jax.rollout import runner  # noqa: E402
from flexfloor_jax.rollout.inputs import prepare_rollout  # noqa: E402
from flexfloor_jax.runtime import distributed  # noqa: E402
from flexfloor_jax.runtime.backend import (  # noqa: E402
  emulate_cpu_devices,
  enable_compilation_cache,
  process_log,
)

_CONFIG = define_config("configs/mixtral.py", "Rollout config file.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")
_DIST_FLAGS = distributed.define_flags()


def main(argv):
  del argv
  config = _CONFIG.value
  config_loaded(config)
  try:  # before jax starts: bad input fails in well under a second
    st, history = prepare_rollout(config)
  except (ConfigError, runner.RolloutError) as e:
    fail(str(e))
  emulate_cpu_devices(_CPU_DEVICES.value or distributed.local_cpu_devices()
                      or st.mesh.cpu_devices)
  distributed.initialize_from_flags(_DIST_FLAGS)  # no-op unless multi-process is configured
  enable_compilation_cache()
  try:
    res = runner.run(st, history=history)
  except runner.RolloutError as e:
    fail(str(e))
  except CheckpointError as e:  # found while reading the tensors (NaN values, say)
    fail(f"model.checkpoint: {e}")
  s = res.summary
  log = process_log(st.rollout.output_dir)
  log(f"{s['schedule']}: {s['num_sequences']} responses, {s['generated_tokens']} tokens, "
      f"{s['device_steps']} device-steps, tokens/device-step {s['tokens_per_device_step']:.3f}, "
      f"idle after finish {s['idle_after_finish_fraction']:.3f}, slot utilization "
      f"{s['slot_utilization']:.3f}, {s['throughput_tokens_per_s']:.1f} tokens/s; "
      f"{release_line(s)}; outputs in {st.rollout.output_dir}/")
  sec = s["seconds"]
  log(f"in {sec['cost_model']} seconds: makespan {sec['makespan_s']:.3f} s, "
      f"{sec['occupied_device_seconds']:.3f} occupied device-seconds, "
      f"{sec['tokens_per_occupied_device_second']:.0f} tokens per occupied device-second")


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
  cli.run(main)
