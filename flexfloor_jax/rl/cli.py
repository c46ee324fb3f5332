"""Flags shared by `python -m flexfloor_jax.rl.sft` and `python -m flexfloor_jax.rl.train`:
--config (default configs/grpo.py) and --cpu_devices; the emulated CPU devices are set through
jax's config before the first JAX operation. A misspelled --config field fails in one line with a
"did you mean", as the rollout CLI does."""

from absl import flags

from flexfloor_jax.config.cli import config_loaded, define_config
from flexfloor_jax.runtime.backend import emulate_cpu_devices

_CONFIG = define_config("configs/grpo.py", "GRPO config file.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")


def config_value():
  config = _CONFIG.value
  config_loaded(config)
  emulate_cpu_devices(_CPU_DEVICES.value or config.mesh.cpu_devices)
  return config


