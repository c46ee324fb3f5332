"""Weights the loader refuses (model/checkpoint.py), naming the file and the tensor: NaN or
infinite values, values a float16 run would overflow, integer tensors (refused from the
inventory, before any read), and non-finite orbax weights."""

import re

import hf_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_utils import EXPERT_KEY as EXPERT

from flexfloor_jax.model import checkpoint as ck
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_hf_weight_is_refused_naming_the_tensor(tmp_path, value):
  """A NaN or infinite weight would make every log-prob NaN: refused at load."""
  path = hf_utils.write_numpy_checkpoint(tmp_path / "hf", poison=(EXPERT, value))
  with pytest.raises(ck.CheckpointError, match=re.escape(EXPERT)) as e:
    ck.load_checkpoint(path)
  assert "model.safetensors" in str(e.value) and "NaN or infinite" in str(e.value)


def test_cast_overflow_is_refused(tmp_path):
  """A finite float32 weight that a float16 run would turn into inf."""
  path = hf_utils.write_numpy_checkpoint(tmp_path / "hf", poison=(EXPERT, 1e6))
  ck.load_checkpoint(path)  # float32: fine
  with pytest.raises(ck.CheckpointError, match=re.escape(EXPERT)):
    ck.load_checkpoint(path, dtype="float16")


def test_integer_hf_weights_are_refused_before_any_read(tmp_path, monkeypatch):
  """int8 tensors under the normal names would be cast to floats without meaning: refused from
  the inventory, naming the tensor, its dtype and the floating dtypes that load."""
  path = hf_utils.write_numpy_checkpoint(tmp_path / "hf", dtype=np.int8)
  with pytest.raises(ck.CheckpointError, match=r"model\.embed_tokens\.weight' has dtype I8") as e:
    ck.inspect_checkpoint(path)
  assert "float32" in str(e.value)


def test_nonfinite_orbax_weight_is_refused(tmp_path):
  cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=4, num_experts=2, top_k=1)
  params = tfm.init_params(cfg, jax.random.key(0), scale=0.1)
  params["layers"]["w1"] = params["layers"]["w1"].at[0, 1, 2, 3].set(jnp.nan)
  ck.save_orbax(str(tmp_path / "o"), params, cfg)
  with pytest.raises(ck.CheckpointError, match=r"\['layers'\]\['w1'\]"):
    ck.load_orbax(str(tmp_path / "o"))


