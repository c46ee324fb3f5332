"""The SFT and GRPO command lines (`python -m flexfloor_jax.rl.sft`, `.rl.train`, on
configs/grpo.py): bad input fails before anything is compiled, with one error naming the field.
The checks run in this process as the CLIs run them first (settings.load for their entry);
one real run of each CLI, on a misspelled field, shows what a user sees: exit 2, one `error:`
line with ml_collections' hint, no traceback."""

import subprocess
import sys

import checkout
import pytest
from engine_utils import CompileCounter

from flexfloor_jax.config import settings
from flexfloor_jax.config.files import load_config


@pytest.mark.parametrize("entry, field, value, expect", [
    ("train", "checkpoint_every", 0, ["checkpoint_every", "0"]),
    ("train", "steps", 0, ["steps", ">= 1"]),
    ("sft", "sft.batch_size", 0, ["sft.batch_size"]),
    ("sft", "sft.steps", 0, ["sft.steps"]),
])
def test_bad_input_names_the_field_before_compiling(entry, field, value, expect):
  c = load_config("grpo")
  c.update_from_flattened_dict({field: value})
  with CompileCounter(ignore_existing_threads=True) as compiles:
    with pytest.raises(settings.ConfigError) as e:
      settings.load(c, entry)
  msg = str(e.value)
  assert msg.startswith(f"{field}: ") and "\n" not in msg, msg
  assert all(s in msg for s in expect), msg
  assert compiles.count == 0


@pytest.mark.parametrize("module, field, hint", [
    ("rl.sft", "sft.step", "steps"),
    ("rl.train", "rl.lrr", "lr"),
])
def test_cli_misspelled_field_is_one_line(tmp_path, module, field, hint):
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, "-m", f"flexfloor_jax.{module}", "--config=configs/grpo.py",
       f"--config.{field}=1", f"--config.output_dir={out}", f"--config.sft.output_dir={out}"],
      cwd=checkout.ROOT, env=checkout.child_env(), capture_output=True, text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith(f"error: --config.{field}"), lines
  assert f'Did you mean "{hint}"' in lines[0], lines
  assert proc.stdout == "" and not out.exists()
