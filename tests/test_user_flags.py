"""The tests marked `user_flags` compare our numbers with a reference computed elsewhere
(transformers, the trainer's forward pass); they must hold for the programs a user's run compiles,
not only for the suite's compile-speed CODEGEN flags (xla_env.py). XLA reads its flags once per
process, so this test runs them in a pytest process of their own with FLEXFLOOR_TEST_XLA=user
(conftest.py then leaves CODEGEN out) and passes when every one of them passed there."""

import os
import re
import subprocess
import sys

import checkout
import pytest
import xla_env

SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def _summary(stdout: str) -> dict[str, int]:
  """The counts of pytest's last summary line ('3 passed, 9 deselected in 4.00s')."""
  lines = [ln for ln in stdout.splitlines() if SUMMARY.search(ln)]
  counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
            for n, k in SUMMARY.findall(lines[-1])} if lines else {}
  return counts


def test_summary_parser():
  assert _summary("x\n== 2 failed, 3 passed, 1 error, 9 deselected in 4.0s ==\n") == {
      "failed": 2, "passed": 3, "error": 1, "deselected": 9}
  assert _summary("no tests ran in 0.01s") == {}


@pytest.mark.user_flags
def test_the_user_flags_process_compiles_without_codegen():
  """Runs in the child only: its XLA flags are a user's (no CODEGEN), on the suite's devices."""
  import jax
  flags = os.environ["XLA_FLAGS"].split()
  assert not set(flags) & set(xla_env.CODEGEN), flags
  assert jax.device_count() == xla_env.SUITE_DEVICES or xla_env.DEVICE_COUNT not in str(flags)


# The child compiles every program of these tests under new flags: on a cold cache it takes
# several times the ini's per-test timeout of a warm one.
@pytest.mark.timeout(3600)
def test_user_flag_tests_pass_under_a_users_flags(request):
  if xla_env.user_mode():
    pytest.skip("this is the user-flags process")
  # The marked tests this session collected (all of them in a run of the whole suite); a run of
  # this file alone collected none: then every marked test under tests/.
  marked = [it for it in request.session.items if it.get_closest_marker("user_flags")]
  targets = sorted({str(it.path) for it in marked}) or [str(checkout.ROOT / "tests")]
  # This process's XLA_FLAGS (the caller's, or the suite's): the child's conftest.py drops CODEGEN.
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env.update({"FLEXFLOOR_JAX_CACHE": checkout.CACHE, xla_env.MODE_VAR: xla_env.USER})
  # -P: the checkout's root stays off sys.path (its kernels/ folder would shadow Hugging Face's
  # `kernels` package, which transformers imports); addopts: the ini's are xdist options.
  cmd = [sys.executable, "-P", "-m", "pytest", "-m", "user_flags", "-p", "no:xdist",
         "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rfEs", *targets]
  proc = subprocess.run(cmd, cwd=checkout.ROOT, env=env, capture_output=True, text=True,
                        timeout=3500)
  out = proc.stdout + proc.stderr
  print(out[-6000:])
  counts = _summary(proc.stdout)
  assert proc.returncode == 0, out[-8000:]
  assert counts.get("passed", 0) > 0, f"no user_flags test ran: {counts}\n{out[-4000:]}"
  assert not counts.get("failed") and not counts.get("error"), counts
  if marked:  # the child ran (or skipped: no torch) at least the tests this session collected
    assert counts.get("passed", 0) + counts.get("skipped", 0) >= len(marked), (counts, marked)
