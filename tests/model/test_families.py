"""The family layer's refusals and bookkeeping: an unsupported model_type, a config value out of
range and an unsupported quantization each fail in one line that names the field, before
anything is compiled; MXFP4 experts dequantize as transformers does; the published configs give
the presets; family configs survive JSON (orbax's model_config.json); Mixtral's identity (the key
of its length histories) did not move when the families' fields came."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import hf_utils
import numpy as np
import pytest
from safetensors.numpy import save_file

from flexfloor_jax.config.files import load_config
from flexfloor_jax.model import hf_checkpoint as hf
from flexfloor_jax.model.checkpoint_format import CheckpointError
from flexfloor_jax.model.config import PRESETS, ModelConfig, model_identity
from flexfloor_jax.rollout.inputs import RolloutError, prepare_rollout

QWEN3 = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
         "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
         "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1,
         "eos_token_id": [5, 6], "rope_theta": 1e6, "dtype": "float32"}
GPT_OSS = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
           "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True,
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                            "truncate": False},
           "rope_theta": 150000, "swiglu_limit": 7.0, "eos_token_id": 200002,
           "dtype": "bfloat16"}


def _write(path, config: dict, tensors: dict | None = None) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if tensors:
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return str(path)


def _one_line(err: Exception, *needles: str):
  msg = str(err)
  assert "\n" not in msg, msg
  for n in needles:
    assert n in msg, (msg, n)


def test_published_style_configs_read():
  """A Qwen3-MoE config as the Hub spells it (num_experts) and a GPT-OSS one in transformers
  4.x's form (rope_scaling with yarn, rope_theta at the top level)."""
  q = hf.config_from_hf(QWEN3)
  assert (q.family, q.qk_norm, q.num_experts, q.intermediate_size, q.eos_id,
          q.extra_eos_ids) == ("qwen3_moe", True, 4, 16, 5, (6,))
  g = hf.config_from_hf(GPT_OSS)
  assert (g.family, g.sliding_layers, g.sliding_window, g.yarn_factor, g.yarn_truncate,
          g.rope_theta, g.dtype, g.attn_bias, g.router) == (
              "gpt_oss", (0,), 4, 32.0, False, 150000.0, "bfloat16", True, "topk_softmax")


@pytest.mark.parametrize("config, needles", [
    (dict(QWEN3, model_type="llama"), ["'model_type'", "'llama'", "'mixtral'", "'qwen3_moe'",
                                       "'gpt_oss'"]),
    (dict(QWEN3, mlp_only_layers=[0, 2]), ["'mlp_only_layers'", "[2]", "2 layers"]),
    (dict(QWEN3, decoder_sparse_step=0), ["'decoder_sparse_step'"]),
    (dict(QWEN3, norm_topk_prob="yes"), ["'norm_topk_prob'"]),
    (dict(GPT_OSS, layer_types=["full_attention"]), ["'layer_types'", "2"]),
    (dict(GPT_OSS, layer_types=["sliding_attention", "chunked"]), ["'layer_types'"]),
    (dict(GPT_OSS, sliding_window=None), ["'sliding_window'"]),
    (dict(GPT_OSS, rope_scaling=dict(GPT_OSS["rope_scaling"], mscale=1.0)),
     ["'rope_parameters.mscale'"]),
    (dict(QWEN3, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     ["'rope_parameters.rope_type'", "'yarn'"]),
])
def test_bad_config_is_one_line_naming_the_field(tmp_path, config, needles):
  """inspect_hf (what the rollout checks before compiling) fails with one line that names the
  file and the field."""
  path = _write(tmp_path / "ckpt", config)
  with pytest.raises(CheckpointError) as e:
    hf.inspect_hf(path)
  _one_line(e.value, os.path.join(path, "config.json"), *needles)


def test_mxfp4_experts_dequantize_as_transformers_does(tmp_path):
  """GPT-OSS as published: experts as MXFP4 blocks (two 4-bit codes a byte, 32 a block) and
  scales (one biased power of two a block), flagged in quantization_config. The loader's
  experts equal transformers' dequantization of the same bytes (convert_moe_packed_tensors,
  then its interleaved gate/up columns), and every other tensor is the file's."""
  torch = pytest.importorskip("torch")
  mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
  model = hf_utils.build_model(hf_utils.gpt_oss_config("go", num_hidden_layers=1,
                                                       hidden_size=64, intermediate_size=32), 0)
  path = str(tmp_path / "mxfp4")
  hf_utils.save(model, path)
  tensors = hf_utils.read_all(path)
  rng = np.random.default_rng(0)
  e, d, f = 12, 64, 32
  packed = {}
  for name, (rows, cols) in (("gate_up_proj", (2 * f, d)), ("down_proj", (d, f))):
    key = f"model.layers.0.mlp.experts.{name}"
    del tensors[key]
    packed[name] = (rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8),
                    rng.integers(118, 134, (e, rows, cols // 32), dtype=np.uint8))
    tensors[key + "_blocks"], tensors[key + "_scales"] = packed[name]
  config = json.load(open(os.path.join(path, "config.json")))
  config["quantization_config"] = {"quant_method": "mxfp4",
                                   "modules_to_not_convert": ["model.layers.*.self_attn"]}
  for fname in os.listdir(path):
    if fname.endswith(".safetensors"):
      os.remove(os.path.join(path, fname))
  _write(path, config, tensors)

  cfg, params = hf.load_hf(path)
  layers = params["layers"]

  def theirs(name):
    blocks, scales = (torch.from_numpy(a) for a in packed[name])
    return mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()

  gate_up, down = theirs("gate_up_proj"), theirs("down_proj")
  assert gate_up.shape == (e, d, 2 * f) and np.abs(gate_up).max() > 0
  np.testing.assert_array_equal(np.asarray(layers["w1"][0]), gate_up[..., 0::2])
  np.testing.assert_array_equal(np.asarray(layers["w3"][0]), gate_up[..., 1::2])
  np.testing.assert_array_equal(np.asarray(layers["w2"][0]), down)
  np.testing.assert_array_equal(np.asarray(layers["b1"][0]),
                                tensors["model.layers.0.mlp.experts.gate_up_proj_bias"][:, 0::2])
  np.testing.assert_array_equal(np.asarray(layers["wq"][0]),
                                tensors["model.layers.0.self_attn.q_proj.weight"].T)


def test_other_quantization_is_refused_naming_it(tmp_path, no_compile):
  """A quantization the loader does not decode (fp8 here) fails in one line naming it, before
  any compile (the rollout's own checks)."""
  config = dict(GPT_OSS, quantization_config={"quant_method": "fp8"})
  path = _write(tmp_path / "fp8", config)
  with pytest.raises(CheckpointError) as e:
    hf.inspect_hf(path)
  _one_line(e.value, "'quantization_config.quant_method'", "'fp8'", "dequantize")
  c = load_config("gpt_oss", "tiny")
  c.model.checkpoint = path
  c.rollout.output_dir = str(tmp_path / "out")
  with pytest.raises(RolloutError) as e:
    prepare_rollout(c)
  _one_line(e.value, "model.checkpoint", "'fp8'")


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-235b-a22b", "gpt-oss-tiny", "gpt-oss-120b"])
def test_family_config_survives_json(name):
  """orbax checkpoints keep the ModelConfig as JSON: tuples come back as lists and are made
  tuples again (the config stays hashable: compiled steps are cached by it)."""
  cfg = PRESETS[name]
  back = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
  assert back == cfg and hash(back) == hash(cfg)


def test_mixtral_identity_is_unchanged_by_the_family_fields():
  """A Mixtral's identity is the hash of the fields it had before families existed, so the
  length histories recorded for it stay valid; another family's differs."""
  old = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
         "num_kv_heads", "head_dim", "num_experts", "top_k", "rope_theta", "rms_eps",
         "sliding_window", "max_position_embeddings", "eos_id", "bos_id")
  cfg = PRESETS["tiny"]
  fields = {k: getattr(cfg, k) for k in old}
  want = "cfg-" + hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
  assert model_identity(cfg) == want
  assert model_identity(PRESETS["qwen3-tiny"]) != model_identity(
      PRESETS["qwen3-tiny"].replace(family="mixtral", qk_norm=False))


def test_out_of_range_block_choices_name_the_field():
  base = PRESETS["qwen3-tiny"]
  for changes, needle in ((dict(dense_layers=(4,)), "dense_layers"),
                          (dict(dense_layers=(1,)), "dense_intermediate_size"),
                          (dict(sliding_layers=(0,)), "sliding_window"),
                          (dict(router="sigmoid"), "router"),
                          (dict(expert_act="gelu"), "expert_act")):
    with pytest.raises(ValueError, match=needle):
      base.replace(**changes)


# config.json and generation_config.json of the published checkpoints (huggingface.co/Qwen/
# Qwen3-30B-A3B, openai/gpt-oss-20b; transformers 4.x spellings), quantization left out.
PUBLISHED = {
    "qwen3-30b-a3b": ({
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}),
    "gpt-oss-20b": ({
        "architectures": ["GptOssForCausalLM"], "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
        "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 201088},
        {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012],
         "pad_token_id": 199999}),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_gives_the_preset(tmp_path, name):
  """The presets are what a published checkpoint's config.json and generation_config.json say:
  every dimension, block choice and stop id (the generation config's list included)."""
  config, generation = PUBLISHED[name]
  path = _write(tmp_path / name, config)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump(generation, f)
  assert hf.with_generation_stops(hf.config_from_hf(config), path) == PRESETS[name]
