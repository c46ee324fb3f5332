"""Flags shared by `python -m flexfloor_jax.rl.sft` and `python -m flexfloor_jax.rl.train`:
--config (default configs/grpo.py) and --cpu_devices; CPU devices are emulated before jax is
imported (hence late imports in the entry points)."""

from absl import app, flags
from ml_collections import config_flags

from flexfloor_jax.cli import emulate_cpu_devices

_CONFIG = config_flags.DEFINE_config_file("config", "configs/grpo.py", "GRPO config file.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")


def config_value():
  config = _CONFIG.value
  emulate_cpu_devices(_CPU_DEVICES.value or config.mesh.cpu_devices)
  return config


def run(main):
  app.run(main)
