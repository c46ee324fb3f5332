"""The lower bound (sim/bounds.py): never beaten, and tight where the answer is known by hand."""

import numpy as np
import pytest

from flexfloor_jax.policy import release_policy, stepsim
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.sim import bounds, presets
from flexfloor_jax.sim.costs import RooflineStepCost


def _run(seqs, workers, slots, cost):
  queues = {w: [s.seq_id for s in seqs[w::workers]] for w in range(workers)}
  pol = release_policy.ReleasePolicy(enabled=False)
  return stepsim.simulate(seqs, None, queues, pol, workers, slots, 8, cost=cost)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_one_sequence_on_one_worker_meets_the_makespan_bound(model):
  """One response alone on one worker: its makespan is its prefill plus one one-row step per
  token, which is what the bound sums (as a lower Riemann sum of the growing cached tokens)."""
  m, hw = presets.MODELS[model], presets.HARDWARE["h100"]
  cost = RooflineStepCost(m, hw, 0.0)
  seqs = [Seq(0, "p", 0, 512, 3000, 4096)]
  run = _run(seqs, 1, 1, cost)
  b = bounds.lower_bound([3000], [512], cost, max_workers=1, max_seqs=1, min_workers=1)
  assert b["makespan_s"] <= run["makespan_s"] <= 1.001 * b["makespan_s"]
  # one worker, one row: every token costs at least the one-row step of the shortest context
  assert b["occupied_device_seconds"] <= run["occupied_device_seconds"] <= (
      1.01 * b["occupied_device_seconds"])


def test_equal_lengths_at_full_width_meet_the_device_time_bound():
  """Eight workers x four rows of equal responses: every decode step runs full, so the device
  time is the tokens times the cheapest token of a full step, up to the prefill rounds and the
  growth of the cached tokens (32 tokens after prompts of 1,024): within 6%."""
  m, hw = presets.MODELS["qwen3-30b-a3b"], presets.HARDWARE["h100"]
  cost = RooflineStepCost(m, hw, 0.0)
  seqs = [Seq(i, f"p{i}", 0, 1024, 32, 64) for i in range(32)]
  run = _run(seqs, 8, 4, cost)
  b = bounds.lower_bound([32] * 32, [1024] * 32, cost, max_workers=8, max_seqs=4, min_workers=1)
  ratio = run["occupied_device_seconds"] / b["occupied_device_seconds"]
  assert 1.0 <= ratio <= 1.06, ratio
  assert run["makespan_s"] >= b["makespan_s"]


def test_no_policy_beats_the_bound_on_random_lengths():
  """Random lengths and placements on the roofline: every run stays above both bounds."""
  rng = np.random.default_rng(0)
  m, hw = presets.MODELS["qwen3-30b-a3b"], presets.HARDWARE["tpu-v5p"]
  cost = RooflineStepCost(m, hw, 0.0)
  for _ in range(5):
    L = rng.integers(1, 200, 24)
    seqs = [Seq(i, f"p{i}", 0, int(rng.integers(16, 300)), int(n), 256) for i, n in enumerate(L)]
    run = _run(seqs, 4, 3, cost)
    b = bounds.lower_bound(L, [s.prompt_len for s in seqs], cost, max_workers=4, max_seqs=3,
                           min_workers=1)
    assert run["makespan_s"] >= b["makespan_s"]
    assert run["occupied_device_seconds"] >= b["occupied_device_seconds"]
