"""README.md's commands, run as a user runs them.

Every ```bash block of README.md is one of:
- tagged: its first line is `# needs: WORD ...` with WORDs from NEEDS (a checkpoint, a GPU, a
  TPU, several hosts): skipped here;
- CI's: every command in it is a line of .ci/run (the install + main job line, lint, the tests),
  which CI runs itself: recognised, not run again (and every README command of .ci/run must be
  in the README);
- runnable: every command is `python -m flexfloor_jax.<entry point> ...` without shell syntax;
  the test runs it, command by command, and asserts exit status 0.
A block that is none of these fails `test_every_block_is_known`, and so do fences with a shell
language other than `bash` or with no language: no command is left unchecked by accident.

Runnable commands run in a subprocess whose working directory is a fresh temporary directory
holding a copy of configs/ (rollout_out/, sft_out/, ... land there), with `python` replaced by
this interpreter and the environment's XLA_FLAGS removed: a user's flags, not the suite's
compile-speed ones (tests/xla_env.py). So the three schedules' end-to-end rollouts of the README
run here under the flags of a user's run. The compiled programs go to the suite's persistent
cache (tests/checkout.py), so a second run of this file loads rather than compiles them.

Long jobs run shortened: SHORTEN appends overrides to them (each names a real config field or
flag; the CLI rejects a misspelled one, failing the test).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import checkout
import pytest

README = checkout.ROOT / "README.md"
CI_SCRIPT = checkout.ROOT / ".ci" / "run"

NEEDS = frozenset({"checkpoint", "gpu", "tpu", "multi-host"})
_NEEDS_LINE = re.compile(r"#\s*needs:\s*(.*)$")
# Fence languages that hold shell commands but are not `bash`: refused (write ```bash so the
# command is run, or ```text for output).
_SHELL_LANGS = frozenset({"sh", "shell", "console", "zsh", "bash-session", "shell-session"})
_ENTRY = re.compile(r"flexfloor_jax(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_SHELL_TOKENS = frozenset({"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "2>&1"})

# Overrides appended to long commands (keyed by the module after `python -m`), so that the whole
# file runs in minutes on 2 cores. Each keeps the command doing what the README says it does,
# at a smaller size:
SHORTEN = {
  # 200 SFT steps (5-7 min) -> 4: the checkpoint and eval prompts the next commands read are
  # still written (configs/grpo.py, sft.steps).
  "flexfloor_jax.rl.sft": ("--config.sft.steps=4",),
  # 20 GRPO steps (4-5 min) -> 1 (configs/grpo.py, steps): rollout, update, checkpoint.
  "flexfloor_jax.rl.train": ("--config.steps=1",),
  # 4 epochs x 5 runs (2-4 min) -> 1 epoch of static, balanced, FlexFloor (configs/bench.py).
  "flexfloor_jax.bench": ("--config.epochs=1", "--config.release_only=false"),
  # Appended to the launched rollout (the command after `--`): half the prompts, as
  # the distributed tests run it (configs/mixtral.py, rollout.num_prompts).
  "flexfloor_jax.launch": ("--config.rollout.num_prompts=4",),
}
# Seconds one command may take (cold compiles on 2 loaded cores included).
COMMAND_TIMEOUT_S = 1200


@dataclasses.dataclass
class Block:
  line: int  # 1-based line of the opening fence
  lang: str
  commands: list[str]  # backslash continuations joined, comment lines dropped
  needs: frozenset[str]  # tags of a `# needs:` first line
  kind: str = ""  # 'tagged' | 'ci' | 'run' | 'unknown'
  why: str = ""  # for 'unknown': what is wrong
  argvs: list[list[str]] = dataclasses.field(default_factory=list)  # for 'run'


def parse_blocks(text: str) -> list[Block]:
  """Every fenced block of `text` (```lang ... ```), with its commands if it is a shell block."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    m = re.match(r"^(\s*)(```+|~~~+)\s*(\S*)", lines[i])
    if not m:
      i += 1
      continue
    fence, lang, start = m.group(2), m.group(3).lower(), i
    body = []
    i += 1
    while i < len(lines) and not lines[i].strip().startswith(fence):
      body.append(lines[i])
      i += 1
    i += 1
    blocks.append(_block(start + 1, lang, body))
  return blocks


def _block(line: int, lang: str, body: list[str]) -> Block:
  needs: frozenset[str] = frozenset()
  first = next((ln.strip() for ln in body if ln.strip()), "")
  m = _NEEDS_LINE.match(first)
  if m:
    needs = frozenset(m.group(1).replace(",", " ").split())
  commands, cur = [], ""
  for raw in body:
    ln = raw.strip()
    if not cur and (not ln or ln.startswith("#")):
      continue
    if ln.endswith("\\"):
      cur += ln[:-1].rstrip() + " "
      continue
    commands.append(" ".join((cur + ln).split()))
    cur = ""
  if cur:
    commands.append(" ".join(cur.split()))
  return Block(line, lang, commands, needs)


def ci_commands(script: str) -> list[str]:
  """The commands of .ci/run that the README states (its plumbing left out: shebang, shell
  options, the virtual environment and pip's own upgrade)."""
  plumbing = ("set ", "cd ", "python3 -m venv", "source ", "python -m pip install --upgrade pip",
              ". ")
  out = []
  for ln in script.splitlines():
    ln = " ".join(ln.split())
    if ln and not ln.startswith("#") and not ln.startswith(plumbing):
      out.append(ln)
  return out


def to_argv(command: str) -> list[str]:
  """A README command as the argv this test runs; ValueError saying why it cannot be run."""
  try:
    argv = shlex.split(command)
  except ValueError as e:
    raise ValueError(f"cannot split {command!r}: {e}") from e
  for tok in argv:
    if tok in _SHELL_TOKENS or "$" in tok or "`" in tok:
      raise ValueError(f"shell syntax {tok!r} in {command!r}: a runnable command is one process; "
                       f"tag the block `# needs: ...` if it cannot run here")
  argv = _python_module(argv, command)
  module = argv[2]
  if module == "flexfloor_jax.launch":  # the launched command: python -m flexfloor_jax.<x>
    if "--" not in argv:
      raise ValueError(f"{command!r}: the launcher runs the command after `--`")
    k = argv.index("--")
    argv = argv[:k + 1] + _python_module(argv[k + 1:], command)
  return argv + list(SHORTEN.get(module, ()))


def _python_module(argv: list[str], command: str) -> list[str]:
  if len(argv) < 3 or argv[0] != "python" or argv[1] != "-m" or not _ENTRY.match(argv[2]):
    raise ValueError(f"{command!r} is not `python -m flexfloor_jax.<entry point> ...`, the one "
                     f"form this test knows how to run")
  return [sys.executable, *argv[1:]]


def classify(blocks: list[Block], ci: list[str]) -> list[Block]:
  """Sets each block's kind (and its argvs or what is wrong with it)."""
  for b in blocks:
    if b.lang != "bash":
      if b.lang in _SHELL_LANGS or b.lang == "":
        b.kind, b.why = "unknown", (f"a fence with language {b.lang or 'none'!r}: write ```bash "
                                    f"for commands (run or tagged), ```text for anything else")
      else:
        b.kind = "other"
      continue
    if b.needs:
      bad = b.needs - NEEDS
      b.kind, b.why = ("unknown", f"unknown `# needs:` words {sorted(bad)}; known: "
                       f"{sorted(NEEDS)}") if bad else ("tagged", "")
      continue
    if not b.commands:
      b.kind, b.why = "unknown", "an empty bash block"
      continue
    in_ci = [c in ci for c in b.commands]
    if all(in_ci):
      b.kind = "ci"
      continue
    if any(in_ci):
      b.kind, b.why = "unknown", ("CI runs some of this block's commands but not all: keep CI's "
                                  "commands in blocks of their own")
      continue
    try:
      b.argvs = [to_argv(c) for c in b.commands]
      b.kind = "run"
    except ValueError as e:
      b.kind, b.why = "unknown", str(e)
  return blocks


def _readme_blocks() -> list[Block]:
  ci = ci_commands(CI_SCRIPT.read_text()) if CI_SCRIPT.exists() else []
  return classify(parse_blocks(README.read_text()), ci)


BLOCKS = _readme_blocks()
RUN = [b for b in BLOCKS if b.kind == "run"]


# ----------------------------------------------------------------------------- the parser itself


_SAMPLE = """\
Text.

```bash
pip install -e '.[test]' && python -m flexfloor_jax.rollout --config=configs/mixtral.py
```

```bash
# a comment first
python -m flexfloor_jax.rollout --config=configs/mixtral.py \\
  --config.schedule=static
python -m flexfloor_jax.bench --config=configs/bench.py
```

```bash
# needs: gpu multi-host
python -m flexfloor_jax.rollout --process_id=$i
```

```text
flexfloor: 64 responses
```

```bash
# needs: quantum
python -m flexfloor_jax.memory
```

```bash
ls rollout_out/
```

```sh
python -m flexfloor_jax.memory
```

```bash
python -m flexfloor_jax.memory > out.txt
```
"""


def test_parser_sorts_the_blocks():
  ci = ci_commands("#!/usr/bin/env bash\nset -euo pipefail\ncd x\nsource .ci-venv/bin/activate\n"
                   "pip install -e '.[test]' && python -m flexfloor_jax.rollout "
                   "--config=configs/mixtral.py\n# tests\npytest -q\n")
  assert ci == ["pip install -e '.[test]' && python -m flexfloor_jax.rollout "
                "--config=configs/mixtral.py", "pytest -q"]
  blocks = classify(parse_blocks(_SAMPLE), ci)
  assert [b.kind for b in blocks] == ["ci", "run", "tagged", "other", "unknown", "unknown",
                                      "unknown", "unknown"]
  run = blocks[1]
  assert run.line == 7
  assert run.commands == ["python -m flexfloor_jax.rollout --config=configs/mixtral.py "
                          "--config.schedule=static",
                          "python -m flexfloor_jax.bench --config=configs/bench.py"]
  assert run.argvs[0] == [sys.executable, "-m", "flexfloor_jax.rollout",
                          "--config=configs/mixtral.py", "--config.schedule=static"]
  assert run.argvs[1][-2:] == list(SHORTEN["flexfloor_jax.bench"])
  assert blocks[2].needs == {"gpu", "multi-host"}
  assert "quantum" in blocks[4].why
  assert "python -m flexfloor_jax" in blocks[5].why  # `ls`: a form the test does not run
  assert "```bash" in blocks[6].why
  assert "shell syntax" in blocks[7].why


def test_launched_command_is_checked_and_shortened():
  argv = to_argv("python -m flexfloor_jax.launch --num_processes=2 -- "
                 "python -m flexfloor_jax.rollout --config=configs/mixtral.py")
  k = argv.index("--")
  assert argv[0] == argv[k + 1] == sys.executable
  assert argv[-1] == SHORTEN["flexfloor_jax.launch"][-1]  # appended to the launched rollout
  with pytest.raises(ValueError, match="entry point"):
    to_argv("python -m flexfloor_jax.launch -- bash -c 'echo hi'")


# ----------------------------------------------------------------------------- README.md


def test_every_block_is_known():
  unknown = [f"README.md line {b.line}: {b.why}" for b in BLOCKS if b.kind == "unknown"]
  assert not unknown, "\n".join(unknown)
  assert RUN, "no runnable block found in README.md"


def test_readme_states_what_ci_runs():
  """CI runs the README's commands (.ci/run says so): every command of .ci/run is in a README
  block, which this file then recognises and does not run again."""
  assert CI_SCRIPT.exists(), f"{CI_SCRIPT} is missing"
  in_readme = {c for b in BLOCKS if b.kind == "ci" for c in b.commands}
  missing = [c for c in ci_commands(CI_SCRIPT.read_text()) if c not in in_readme]
  assert not missing, f"commands of .ci/run in no README bash block of their own: {missing}"


def test_every_shortening_is_used():
  """SHORTEN names only commands the README has (a renamed entry point would leave a dead row
  and run the long job in full)."""
  modules = {argv[2] for b in RUN for argv in b.argvs}
  assert set(SHORTEN) <= modules, sorted(set(SHORTEN) - modules)


@pytest.fixture
def workdir(tmp_path):
  shutil.copytree(checkout.ROOT / "configs", tmp_path / "configs",
                  ignore=shutil.ignore_patterns("__pycache__"))
  return tmp_path


def _user_env() -> dict[str, str]:
  """This environment without XLA_FLAGS (a user's run compiles with XLA's defaults) nor pytest's
  variables, with the suite's persistent compilation cache."""
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and not k.startswith("PYTEST_")}
  env["FLEXFLOOR_JAX_CACHE"] = checkout.CACHE
  env["PYTHONUNBUFFERED"] = "1"
  return env


# Several commands per block, each possibly compiling cold: past the ini's per-test timeout.
@pytest.mark.timeout(3 * COMMAND_TIMEOUT_S)
@pytest.mark.parametrize("block", RUN, ids=[f"line{b.line}" for b in RUN])
def test_readme_block_runs(block, workdir):
  env = _user_env()
  for command, argv in zip(block.commands, block.argvs, strict=True):
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
      pytest.fail(f"README.md line {block.line}: {command!r} ran past {COMMAND_TIMEOUT_S} s\n"
                  f"{out[-3000:]}")
    secs = time.perf_counter() - t0
    print(f"README.md line {block.line}: {secs:.0f} s: {shlex.join(argv[1:])}")
    assert proc.returncode == 0, (
        f"README.md line {block.line}: {command!r} exited {proc.returncode} (run as "
        f"{shlex.join(argv)} in {workdir})\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
        f"{proc.stderr[-5000:]}")
