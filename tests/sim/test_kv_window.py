"""The simulator charges a sliding-window layer only its window's KV, as the engine allocates it:
hand-computed bytes for GPT-OSS-20B, the same figures as the engine's memory terms (one source of
dimensions: model.config.PRESETS), and Mixtral's unchanged."""

import dataclasses

import numpy as np

from flexfloor_jax.engine import memory
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.policy.floor import floor_workers
from flexfloor_jax.sim import cluster, presets
from flexfloor_jax.sim.costs import RooflineCost

# GPT-OSS-20B: 24 layers, 12 of them sliding (window 128), 8 kv heads of 64 dims, bfloat16:
# K and V of one layer for one token = 2 x 8 x 64 x 2 bytes
LAYER_TOKEN = 2 * 8 * 64 * 2


def test_gpt_oss_kv_bytes_by_hand():
  m = presets.MODELS["gpt-oss-20b"]
  assert (m.layers, m.sliding_layers, m.sliding_window) == (24, 12, 128)
  assert m.kv_bytes_per_token == 12 * LAYER_TOKEN == 24576  # the full layers: what pages hold
  assert m.kv_bytes(100) == 100 * 24 * LAYER_TOKEN  # inside the window: every layer every token
  assert m.kv_bytes(1000) == 1000 * 12 * LAYER_TOKEN + 128 * 12 * LAYER_TOKEN == 27721728
  np.testing.assert_array_equal(m.kv_bytes(np.array([100, 1000])), [4915200, 27721728])
  # a worker with 2 rows of 500 cached tokens reads the full layers' 1000 and 2 windows of 128;
  # one row of 40 and one of 60 tokens: every token of every layer
  np.testing.assert_array_equal(m.kv_read_bytes(np.array([2, 2]), np.array([1000, 100])),
                                [1000 * 24576 + 256 * 24576, 100 * 24 * LAYER_TOKEN])
  # the engine's memory terms for the same preset: the same bytes per token and per window
  per_token, rings = memory.kv_bytes(PRESETS["gpt-oss-20b"], 3072)
  assert (per_token, rings) == (24576, 128 * 12 * LAYER_TOKEN)
  assert m.kv_bytes(3072) == 3072 * per_token + rings


def test_roofline_and_floor_charge_the_window_only():
  """A decode step's KV read and the floor's KV of GPT-OSS-20B against the same model with no
  sliding layers: the step reads (1000 - 128) x 12 layers' tokens less for a row of 1000, and 4
  slots of 3072 tokens hold 4 x (3072 - 128) x 12 layers' tokens less."""
  m = presets.MODELS["gpt-oss-20b"]
  full = dataclasses.replace(m, sliding_layers=0, sliding_window=0)
  hw = presets.HARDWARE["h100"]
  one = np.array([1.0]), np.array([1000.0])
  held = np.array([4.0])
  dt = RooflineCost(full, hw).step_seconds(held, *one) - RooflineCost(m, hw).step_seconds(
      held, *one)
  np.testing.assert_allclose(dt, (1000 - 128) * 12 * LAYER_TOKEN / hw.hbm_bw, rtol=1e-9)
  kv = 4 * (3072 * 24576 + 128 * 12 * LAYER_TOKEN)
  assert cluster.floor_for(m, hw, 8, 4, 3072) == floor_workers(
      m.experts, m.expert_bytes, m.nonexpert_bytes, kv, int(hw.hbm_bytes), 8)
  assert full.kv_bytes(3072) - m.kv_bytes(3072) == (3072 - 128) * 12 * LAYER_TOKEN


def test_models_without_a_window_are_charged_every_token():
  m = presets.MODELS["mixtral-8x7b"]
  assert m.sliding_layers == 0
  per_token = 2 * 32 * 8 * 128 * 2
  assert m.kv_bytes_per_token == per_token and m.kv_bytes(4096) == 4096 * per_token
  np.testing.assert_array_equal(m.kv_read_bytes(np.array([3]), np.array([777])),
                                [777 * per_token])
