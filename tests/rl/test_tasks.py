"""rl/tasks.py: deterministic prompt sets, answers, rewards, user reward functions (no JAX)."""

import numpy as np
import pytest

from flexfloor_jax.rl import tasks


def test_prompt_sets_are_deterministic_and_seeded():
  a = tasks.make_prompts("sort,add,reverse,count", 12, seed=3, size=4)
  b = tasks.make_prompts(["sort", "add", "reverse", "count"], 12, seed=3, size=4)
  c = tasks.make_prompts("sort,add,reverse,count", 12, seed=4, size=4)
  assert a == b
  assert [r["prompt"] for r in a] != [r["prompt"] for r in c]
  assert [r["task"] for r in a[:4]] == ["sort", "add", "reverse", "count"]
  assert len({r["id"] for r in a}) == 12


def test_answers_are_correct():
  for r in tasks.make_prompts("sort,add,reverse,count", 40, seed=0, size=5):
    body = r["prompt"].split(" ", 1)[1].rstrip("=")
    if r["task"] == "sort":
      assert r["answer"] == " ".join(sorted(body.split()))
    elif r["task"] == "add":
      x, y = body.split("+")
      assert int(r["answer"]) == int(x) + int(y)
    elif r["task"] == "reverse":
      assert r["answer"] == body[::-1]
    else:
      assert r["answer"].split() == [str(i) for i in range(1, int(body) + 1)]


def test_answer_lengths_depend_on_the_prompt():
  rows = tasks.make_prompts("count", 64, seed=0, size=12)
  lens = np.array([len(r["answer"]) for r in rows])
  assert lens.min() < 10 and lens.max() > 200  # a few tokens to a few hundred
  adds = [len(r["answer"]) for r in tasks.make_prompts("add", 16, seed=0, size=2)]
  assert max(adds) <= 3


def test_rewards_exact_partial_and_zero():
  row = {"task": "reverse", "answer": "abcd"}
  assert tasks.reward(row, "abcd") == 1.0
  assert tasks.reward(row, "  abcd\n") == 1.0
  assert tasks.reward(row, "abxx") == pytest.approx(0.5 * 2 / 4)
  assert tasks.reward(row, "abcdef") == pytest.approx(0.5 * 4 / 6)
  assert tasks.reward(row, "") == 0.0
  assert tasks.reward({"task": "add", "answer": "85"}, "84") == 0.0
  assert tasks.reward({"task": "add", "answer": "85"}, "85") == 1.0


def user_reward(prompt, response):  # named by test_user_reward_fn as "test_tasks:user_reward"
  return float(len(response) == len(prompt["answer"]))


def test_user_reward_fn(monkeypatch):
  import os
  import sys
  monkeypatch.syspath_prepend(os.path.dirname(__file__))
  f = tasks.load_reward_fn("test_tasks:user_reward")
  assert f({"answer": "abc"}, "xyz") == 1.0 and f({"answer": "abc"}, "x") == 0.0
  assert tasks.load_reward_fn("") is tasks.reward
  with pytest.raises(ValueError, match="module:function"):
    tasks.load_reward_fn("nocolon")
  with pytest.raises(ValueError, match="reward_fn"):
    tasks.load_reward_fn("test_tasks:nope")
  with pytest.raises(ValueError, match="unknown task"):
    tasks.make_prompts("sort,juggle", 2, 0)
  del sys
