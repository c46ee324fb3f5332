"""The XLA flags the suite compiles with (conftest.py sets them before jax is imported) and the
ones its child processes get: the same code-generation flags, without the device count, which
each child sets for itself (the CLI's mesh.cpu_devices, launch's --devices_per_process).

Two modes, one per process (XLA reads its flags once): the suite's, with CODEGEN, and the user's,
without (FLEXFLOOR_TEST_XLA=user), in which the tests marked `user_flags` run (test_user_flags.py
starts that process)."""

import os

DEVICE_COUNT = "xla_force_host_platform_device_count"
SUITE_DEVICES = 8

# XLA:CPU's elemental kernel emitters instead of its newer fusion emitters, and LLVM's optimization
# level 1 instead of 2: both compile faster (compiling is most of a cold run of the suite) and the
# tiny programs run no slower. Greedy tokens are the same and log-probs differ from the default
# build in the last bits, so every test compares runs compiled alike (this process and its
# children), and the parity tests, whose references are computed elsewhere (transformers, the
# trainer's forward), run without these flags, as a user's run compiles.
# An XLA that does not know a flag aborts the process: XLA_FLAGS set by the caller (even empty, as
# scripts/device_check.sh does on a device) replace these.
CODEGEN = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1")

# The environment variable that selects the mode, and its value for the user's flags.
MODE_VAR = "FLEXFLOOR_TEST_XLA"
USER = "user"


def user_mode() -> bool:
  """Whether this process compiles as a user's run does (no CODEGEN flags)."""
  return os.environ.get(MODE_VAR) == USER


def suite_flags() -> str:
  """XLA_FLAGS for the pytest process: the emulated devices and CODEGEN."""
  return " ".join((f"--{DEVICE_COUNT}={SUITE_DEVICES}",) + CODEGEN)


def user_flags(flags: str | None = None) -> str:
  """XLA_FLAGS for the user-flags pytest process: `flags` (the caller's, by default the
  emulated devices) without CODEGEN."""
  if flags is None:
    flags = f"--{DEVICE_COUNT}={SUITE_DEVICES}"
  return " ".join(f for f in flags.split() if f not in CODEGEN)


def child_flags() -> str:
  """XLA_FLAGS for a child process: this process's flags without the device count."""
  return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if DEVICE_COUNT not in f)
