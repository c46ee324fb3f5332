"""model/param_count.py and policy/floor.py: parameter counts and expert slots, against
hand-computed values."""

import pytest

from flexfloor_jax.model import param_count
from flexfloor_jax.policy import floor


def test_param_counts_of_the_tiny_preset_by_hand():
  # tiny: vocab 259, hidden 128, ffn 256, 4 layers, 4 heads, 2 KV heads, head_dim 32, 8 experts
  # attention per layer: q, o 128 x 4 x 32 = 16384 each; k, v 128 x 2 x 32 = 8192 each: 49152
  # per layer + router 128 x 8 = 1024 + two norms 256: 50432; x 4 layers = 201728
  # embed + lm_head 2 x 259 x 128 = 66304, final norm 128: 268160 non-expert
  assert param_count.nonexpert_params(259, 128, 4, 4, 2, 32, 8) == 268160
  # one expert: w1, w3 (128 x 256) and w2 (256 x 128) in 4 layers: 3 x 32768 x 4 = 393216
  assert param_count.expert_params(128, 256, 4) == 393216


def test_model_config_and_sim_model_count_the_same_params():
  from flexfloor_jax.model.config import PRESETS
  from flexfloor_jax.sim import presets
  assert PRESETS["tiny"].param_count() == 268160 + 8 * 393216 == 3413888
  assert presets.MODELS["tiny"].params == 3413888
  assert presets.MODELS["tiny"].expert_bytes == 4 * 393216  # float32
  assert presets.MODELS["mixtral-8x7b"].params == PRESETS["8x7b"].param_count()


@pytest.mark.parametrize("experts,workers,slots", [(8, 1, 8), (8, 3, 3), (8, 7, 2), (8, 8, 1),
                                                   (128, 7, 19), (1, 4, 1)])
def test_expert_slots(experts, workers, slots):
  assert floor.expert_slots(experts, workers) == slots


def test_preallocated_slots_follow_the_floor_only_for_flexfloor():
  assert floor.preallocated_slots("flexfloor", 8, 8, 3) == 3
  assert floor.preallocated_slots("static", 8, 8, 3) == 1
  assert floor.preallocated_slots("balanced", 8, 8, 3) == 1
  assert floor.preallocated_slots("flexfloor", 8, 8, 8) == 1
