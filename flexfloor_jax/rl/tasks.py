"""Built-in tasks with verifiable rewards (numpy / python only, no JAX).

Each task renders a prompt (text, byte tokenizer) and a reference answer whose length depends on
the prompt: `count` answers grow with n (up to a few hundred bytes), `sort`/`reverse` with the
input length, `add` stays a few tokens. A prompt set is a deterministic function of (tasks, n,
seed, size).

Rewards: exact match (after stripping surrounding whitespace) = 1.0; otherwise partial credit
0.5 * (fraction of reference characters matched position by position, over the longer of the two
strings) for sort / reverse / count, 0 for add. A user reward is any callable named
"module:function" with signature fn(prompt: dict, response: str) -> float; prompt is the prompt
row (id, prompt, task, answer).
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Iterable
from typing import cast

import numpy as np

from flexfloor_jax.io.atomic import atomic_write

TASKS = ("sort", "add", "reverse", "count")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _render(task: str, rng: np.random.Generator, size: int) -> tuple[str, str]:
  """(prompt, answer). `size` scales the problem (digits to sort, letters, count limit)."""
  if task == "sort":
    n = int(rng.integers(2, max(3, size) + 1))
    d = rng.integers(0, 10, n)
    return f"sort {' '.join(map(str, d))}=", " ".join(map(str, sorted(d.tolist())))
  if task == "add":
    hi = 10 ** max(1, min(size, 6))
    a, b = int(rng.integers(0, hi)), int(rng.integers(0, hi))
    return f"add {a}+{b}=", str(a + b)
  if task == "reverse":
    n = int(rng.integers(2, max(3, size) + 1))
    w = "".join(rng.choice(list(_LETTERS), n))
    return f"reverse {w}=", w[::-1]
  if task == "count":
    n = int(rng.integers(1, max(2, 8 * size) + 1))
    return f"count {n}=", " ".join(str(i) for i in range(1, n + 1))
  raise ValueError(f"unknown task {task!r}; built-in tasks are {TASKS}")


def parse_tasks(tasks) -> list[str]:
  names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
  names = [t for t in names if t]
  if not names:
    raise ValueError(f"rl.tasks: must name at least one of {TASKS}, got {tasks!r}")
  for t in names:
    if t not in TASKS:
      raise ValueError(f"rl.tasks: unknown task {t!r}; built-in tasks are {TASKS}")
  return names


def make_prompts(tasks, num_prompts: int, seed: int, size: int = 6) -> list[dict]:
  """`num_prompts` rows {id, prompt, task, answer}, tasks in round-robin order; same arguments,
  same rows (numpy PCG64 seeded by (seed, i))."""
  names = parse_tasks(tasks)
  rows = []
  for i in range(num_prompts):
    task = names[i % len(names)]
    rng = np.random.default_rng([seed, i])
    prompt, answer = _render(task, rng, size)
    rows.append({"id": f"{task}-{seed}-{i}", "prompt": prompt, "task": task, "answer": answer})
  return rows


def write_prompts_jsonl(rows: Iterable[dict], path: str) -> None:
  """The rows as rollout.prompts JSONL ({"id", "prompt"} plus task/answer, which the runner
  ignores)."""
  atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))


def prompt_set(rl, path: str):
  """The prompt set of an `rl` settings section (tasks, num_prompts, prompt_seed, task_size,
  reward_fn), written to `path` as rollout.prompts JSONL, and its reward: (reward_fn, prompt
  rows, rows by id)."""
  rows = make_prompts(rl.tasks, rl.num_prompts, rl.prompt_seed, rl.task_size)
  write_prompts_jsonl(rows, path)
  return load_reward_fn(rl.reward_fn), rows, {r["id"]: r for r in rows}


def _partial(response: str, answer: str) -> float:
  n = max(len(response), len(answer))
  if n == 0:
    return 1.0
  hits = sum(a == b for a, b in zip(response, answer, strict=False))
  return hits / n


def reward(prompt: dict, response: str) -> float:
  """Built-in reward of one response to a prompt row."""
  got, want = response.strip(), prompt["answer"]
  if got == want:
    return 1.0
  if prompt["task"] == "add":
    return 0.0
  return 0.5 * _partial(got, want)


def score_responses(reward_fn: Callable[[dict, str], float], prompts_by_id: dict,
                    responses: Iterable[dict]) -> np.ndarray:
  """[responses] float64: `reward_fn` of each response (a rollout's rows: prompt_id, text) to its
  prompt row."""
  return np.array([float(reward_fn(prompts_by_id[r["prompt_id"]], r["text"])) for r in responses],
                  np.float64)


def load_reward_fn(spec: str | None) -> Callable[[dict, str], float]:
  """'' -> the built-in reward; 'package.module:function' -> that callable."""
  if not spec:
    return reward
  if ":" not in spec:
    raise ValueError(f"rl.reward_fn: must be 'module:function', got {spec!r}")
  mod, fn = spec.split(":", 1)
  try:
    f = getattr(importlib.import_module(mod), fn)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"rl.reward_fn: {spec!r}: {e}") from None
  if not callable(f):
    raise ValueError(f"rl.reward_fn: {spec!r} is not callable")
  try:  # called as fn(prompt_row, text): a function that cannot take them fails at the first step
    inspect.signature(f).bind({}, "")
  except TypeError as e:
    raise ValueError(f"rl.reward_fn: {spec!r} cannot be called as fn(prompt_row, text) ({e})"
                     ) from None
  except ValueError:  # a builtin without a signature: taken as it is
    pass
  return cast(Callable[[dict, str], float], f)  # the user's: taken to be a reward function
