"""`python -m flexfloor_jax.rollout --config=configs/mixtral.py[:preset] [--config.x=y ...]`.

On CPU the devices are emulated (`--cpu_devices`, default from the config's mesh.cpu_devices
field or 8), which must happen before jax is imported: hence the late imports.
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/mixtral.py", "Rollout config file.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")


def emulate_cpu_devices(n: int) -> None:
  """Ask XLA:CPU for n devices; harmless on TPU/GPU. Must run before jax is imported."""
  if "jax" in sys.modules:
    return
  flag = f"--xla_force_host_platform_device_count={n}"
  cur = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in cur:
    os.environ["XLA_FLAGS"] = (cur + " " + flag).strip()


def main(argv):
  del argv
  config = _CONFIG.value
  emulate_cpu_devices(_CPU_DEVICES.value or config.mesh.cpu_devices)
  from flexfloor_jax import runner
  from flexfloor_jax.cli import fail, enable_compilation_cache
  enable_compilation_cache()
  try:
    res = runner.run(config)
  except runner.RolloutError as e:
    fail(str(e))
  s = res.summary
  print(f"{s['schedule']}: {s['num_sequences']} responses, {s['generated_tokens']} tokens, "
        f"{s['device_steps']} device-steps, tokens/device-step {s['tokens_per_device_step']:.3f}, "
        f"idle after finish {s['idle_after_finish_fraction']:.3f}, slot utilization "
        f"{s['slot_utilization']:.3f}, {s['throughput_tokens_per_s']:.1f} tokens/s; "
        f"outputs in {config.rollout.output_dir}/")


if __name__ == "__main__":
  app.run(main)
