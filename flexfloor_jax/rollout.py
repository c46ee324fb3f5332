"""`python -m flexfloor_jax.rollout --config=configs/mixtral.py[:preset] [--config.x=y ...]`.

On CPU the devices are emulated (`--cpu_devices`, default from the config's mesh.cpu_devices
field or 8), which must happen before jax is imported: hence the late imports.
"""

import re
import sys

from absl import app, flags
from ml_collections import config_flags

from flexfloor_jax import distributed
from flexfloor_jax.cli import emulate_cpu_devices, fail, process_log


def _unknown_override(err: Exception) -> None:
  """A --config.a.b=v override naming a field the config lacks: ml_collections raises a bare
  KeyError/AttributeError (while the flag is defined, or while parsing): one line instead."""
  msg = err
  while isinstance(msg, BaseException):
    msg = msg.args[0] if msg.args else str(msg)
  lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()] or [""]
  key, hint = lines[0].strip("\"'"), " ".join(lines[1:])
  given = [a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--config.")]
  bad = [a for a in given if key in a[len("--config."):].split(".")] or given
  fail(f"{bad[0] if bad else '--config'}: no such config field {key!r}" +
       (f" ({hint})" if hint else ""))


try:
  _CONFIG = config_flags.DEFINE_config_file("config", "configs/mixtral.py", "Rollout config file.")
except (AttributeError, KeyError) as e:
  _unknown_override(e)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")
_DIST_FLAGS = distributed.define_flags()


def _parse_flags(argv):
  """absl's parser, but a bad flag (an unknown preset raises inside the config file) is one line
  on stderr, not ml_collections' embedded traceback plus a usage hint."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) <= 1:
      fail(lines[0] if lines else type(e).__name__)
    head = lines[0].split(": Error whilst parsing config file")[0].rstrip(":")
    last = re.sub(r"^[A-Za-z_.]*(Error|Exception): ", "", lines[-1])
    fail(f"{head}: {last}")
  except OSError as e:  # a missing config file, hit while applying --config.x overrides to it
    _config_file_error(e)
  except (AttributeError, KeyError) as e:
    _unknown_override(e)


def _config_file_error(e: OSError) -> None:
  lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
  fail(f"--config: {lines[-1] if lines else e}")


def main(argv):
  del argv
  config = _CONFIG.value
  try:
    config.mesh  # noqa: B018  a config file that failed to load raises on first access
  except OSError as e:  # missing or unreadable config file (ml_collections defers the error)
    _config_file_error(e)
  emulate_cpu_devices(_CPU_DEVICES.value or distributed.local_cpu_devices()
                      or config.mesh.cpu_devices)
  distributed.initialize_from_flags(_DIST_FLAGS)  # no-op unless multi-process is configured
  from flexfloor_jax import runner
  from flexfloor_jax.cli import enable_compilation_cache
  enable_compilation_cache()
  try:
    res = runner.run(config)
  except runner.RolloutError as e:
    fail(str(e))
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
  app.run(main, flags_parser=_parse_flags)
