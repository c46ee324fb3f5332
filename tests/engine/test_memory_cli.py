"""`python -m flexfloor_jax.memory`, the memory floor of a preset term by term (engine/memory.py):
bad arguments are one `error:` line and exit 2 (argparse's usage line above it), checked in
process through memory.main's parser, and once as a user runs it. (A valid run: the README's
commands, test_readme.py.)"""

import subprocess
import sys

import checkout
import pytest

from flexfloor_jax import memory


@pytest.mark.parametrize("args, names", [
    (["--preset", "nope"], ["--preset", "'nope'"]),
    (["--workers", "two"], ["--workers", "'two'"]),
    (["--device_memory_gb", "lots"], ["--device_memory_gb", "'lots'"]),
])
def test_bad_argument_is_one_error_line(capsys, args, names):
  with pytest.raises(SystemExit) as e:
    memory.main(args)
  assert e.value.code == 2
  err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
  assert len(err) == 1 and all(n in err[0] for n in names), err


@pytest.mark.parametrize("args", [["--workers", "0"], ["--device_memory_gb", "-1"]])
def test_impossible_sizes_are_one_error_line(capsys, args):
  with pytest.raises(SystemExit) as e:
    memory.main(["--preset", "tiny", *args])
  assert e.value.code == 2
  err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
  assert len(err) == 1 and args[0] in err[0], err


def test_cli_bad_preset_as_a_user_runs_it():
  proc = subprocess.run([sys.executable, "-m", "flexfloor_jax.memory", "--preset", "nope"],
                        cwd=checkout.ROOT, env=checkout.child_env(), capture_output=True,
                        text=True, timeout=120)
  err = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
  assert proc.returncode == 2 and len(err) == 1 and "--preset" in err[0], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and proc.stdout == ""
