"""The XLA flags the suite compiles with (conftest.py sets them before jax is imported) and the
ones its child processes get: the same code-generation flags, without the device count, which
each child sets for itself (the CLI's mesh.cpu_devices, launch's --devices_per_process)."""

import os

DEVICE_COUNT = "xla_force_host_platform_device_count"

# XLA:CPU's elemental kernel emitters instead of its newer fusion emitters, and LLVM's optimization
# level 1 instead of 2: both compile faster (compiling is most of a cold run of the suite) and the
# tiny programs run no slower. Greedy tokens are the same and log-probs differ from the default
# build in the last bits, so every test compares runs compiled alike (this process and its
# children); no test property depends on how XLA:CPU generates code.
# An XLA that does not know a flag aborts the process: XLA_FLAGS set by the caller (even empty, as
# scripts/device_check.sh does on a device) replace these.
CODEGEN = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1")


def suite_flags() -> str:
  """XLA_FLAGS for the pytest process: 8 emulated CPU devices and CODEGEN."""
  return " ".join((f"--{DEVICE_COUNT}=8",) + CODEGEN)


def child_flags() -> str:
  """XLA_FLAGS for a child process: this process's flags without the device count."""
  return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if DEVICE_COUNT not in f)
