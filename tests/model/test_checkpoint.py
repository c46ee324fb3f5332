"""Checkpoint loading (HF safetensors in both layouts, orbax), its errors, and tokenizers."""

from __future__ import annotations

import json
import os
import shutil

import hf_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexfloor_jax.model import checkpoint as ck
from flexfloor_jax.model import hf_checkpoint as hf
from flexfloor_jax.model import tokenizer as tok_lib
from flexfloor_jax.model import transformer as tr
from flexfloor_jax.model.config import BYTE_VOCAB, PRESETS, ModelConfig
from flexfloor_jax.runtime import mesh as mesh_lib

# Small enough to copy and rewrite in milliseconds; 2 layers so "layer 1" keys exist.
SMALL = dict(hf_utils.CASES["gqa"], num_hidden_layers=2, num_local_experts=4, vocab_size=100)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """One torch model saved three ways: hub single file, hub sharded, fused sharded."""
  pytest.importorskip("transformers")
  root = tmp_path_factory.mktemp("hf")
  model = hf_utils.build_model(hf_utils.mixtral_config(**SMALL), seed=3)
  dirs = {"hub": str(root / "hub"), "hub_sharded": str(root / "hub_sharded"),
          "fused_sharded": str(root / "fused_sharded")}
  hf_utils.save(model, dirs["hub"])
  hf_utils.save(model, dirs["hub_sharded"], max_shard_size="50KB")
  hf_utils.save(model, dirs["fused_sharded"], fused=True, max_shard_size="50KB")
  dirs["model"] = model
  return dirs


def _load_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _dump_json(obj: dict, path: str) -> None:
  with open(path, "w") as f:
    json.dump(obj, f)


def _bitwise_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b) and all(
      x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(la, lb, strict=True)))


# ----------------------------------------------------------------------------- HF loading


def test_layouts_load_identically(hf_dirs):
  """Hub / fused, single / sharded: same params bit for bit, and the mapping is the documented
  one (transpose, w1 = gate, w3 = up, w2 = down, layers stacked on axis 0)."""
  cfg, ref = hf.load_hf(hf_dirs["hub"])
  for name in ("hub_sharded", "fused_sharded"):
    c, p = hf.load_hf(hf_dirs[name])
    assert c == cfg
    assert _bitwise_equal(p, ref), name
  sd = {k: v.numpy() for k, v in hf_dirs["model"].state_dict().items()}
  lp = ref["layers"]
  f = cfg.intermediate_size
  gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # in-memory torch: [E, 2F, D]
  np.testing.assert_array_equal(lp["w1"][1, 2], gate_up[2, :f].T)
  np.testing.assert_array_equal(lp["w3"][1, 2], gate_up[2, f:].T)
  np.testing.assert_array_equal(lp["w2"][1, 3], sd["model.layers.1.mlp.experts.down_proj"][3].T)
  np.testing.assert_array_equal(lp["wk"][1], sd["model.layers.1.self_attn.k_proj.weight"].T)
  np.testing.assert_array_equal(lp["router"][0], sd["model.layers.0.mlp.gate.weight"].T)
  np.testing.assert_array_equal(lp["mlp_norm"][1],
                                sd["model.layers.1.post_attention_layernorm.weight"])
  np.testing.assert_array_equal(ref["lm_head"], sd["lm_head.weight"].T)
  abstract = tr.abstract_params(cfg)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(
      lambda a: (a.shape, a.dtype), ref)


def test_inspect_reads_no_tensor(hf_dirs, monkeypatch):
  """inspect_hf works from headers alone: a safe_open whose get_tensor fails must not matter."""
  import safetensors

  real = safetensors.safe_open

  class HeadersOnly:
    def __init__(self, *a, **kw):
      self._h = real(*a, **kw)

    def __enter__(self):
      self._f = self._h.__enter__()
      return self

    def __exit__(self, *exc):
      return self._h.__exit__(*exc)

    def keys(self):
      return self._f.keys()

    def get_slice(self, k):
      return self._f.get_slice(k)

    def get_tensor(self, k):
      raise AssertionError(f"inspect_hf read tensor {k}")

  monkeypatch.setattr(safetensors, "safe_open", HeadersOnly)
  for name in ("hub", "hub_sharded", "fused_sharded"):
    cfg = hf.inspect_hf(hf_dirs[name])
    assert (cfg.num_layers, cfg.num_experts, cfg.head_dim, cfg.vocab_size) == (2, 4, 24, 100)


def test_bf16_checkpoint(tmp_path):
  """bf16 safetensors read through numpy + ml_dtypes, bits unchanged; dtype override casts."""
  import torch

  model = hf_utils.build_model(hf_utils.mixtral_config(**SMALL), seed=5).to(torch.bfloat16)
  hf_utils.save(model, str(tmp_path))
  cfg, params = hf.load_hf(str(tmp_path))
  assert cfg.dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  ref = model.state_dict()["model.layers.1.self_attn.q_proj.weight"].float().numpy().T
  np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][1], np.float32), ref)
  cfg32, p32 = hf.load_hf(str(tmp_path), dtype="float32")
  assert cfg32.dtype == "float32" and p32["embed"].dtype == jnp.float32


def test_tied_embeddings_without_lm_head(hf_dirs, tmp_path):
  tensors = hf_utils.read_all(hf_dirs["hub"])
  tensors.pop("lm_head.weight")
  config = _load_json(os.path.join(hf_dirs["hub"], "config.json"))
  config["tie_word_embeddings"] = True
  hf_utils.write_single(str(tmp_path), tensors, config)
  _, params = hf.load_hf(str(tmp_path))
  np.testing.assert_array_equal(params["lm_head"], tensors["model.embed_tokens.weight"].T)


def test_config_fields():
  """Every dimension from config.json; nulls and the transformers-4 layout (top-level
  rope_theta, torch_dtype) handled. The published 8x7B config.json gives PRESETS['8x7b']."""
  mixtral_8x7b = {  # mistralai/Mixtral-8x7B-v0.1 config.json
      "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
      "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
      "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
      "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
      "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
      "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
  assert hf.config_from_hf(mixtral_8x7b) == PRESETS["8x7b"]
  v5 = dict(mixtral_8x7b, head_dim=None, sliding_window=7, eos_token_id=[5, 2], dtype="float32",
            rope_parameters={"rope_type": "default", "rope_theta": 123.0})
  del v5["rope_theta"], v5["torch_dtype"]
  cfg = hf.config_from_hf(v5)
  assert (cfg.head_dim, cfg.sliding_window, cfg.eos_id, cfg.rope_theta, cfg.dtype) == (
      128, 7, 5, 123.0, "float32")


# ----------------------------------------------------------------------------- HF errors


def _copy(src: str, dst) -> str:
  dst = str(dst)
  shutil.copytree(src, dst)
  return dst


def _raises(path: str, *needles: str):
  """inspect_hf, load_hf and load_checkpoint all fail with one CheckpointError naming these."""
  for fn in (hf.inspect_hf, hf.load_hf, lambda p: ck.load_checkpoint(p, PRESETS["tiny"])):
    with pytest.raises(ck.CheckpointError) as e:
      fn(path)
    for n in needles:
      assert n in str(e.value), (str(e.value), n)


def test_error_missing_dir(tmp_path):
  missing = str(tmp_path / "nope")
  for fn in (hf.inspect_hf, hf.load_hf):
    with pytest.raises(ck.CheckpointError, match="nope"):
      fn(missing)
  with pytest.raises(ck.CheckpointError, match="not a checkpoint"):
    ck.load_checkpoint(missing, PRESETS["tiny"])


def test_error_missing_config(hf_dirs, tmp_path):
  path = _copy(hf_dirs["hub"], tmp_path / "c")
  os.remove(os.path.join(path, "config.json"))
  for fn in (hf.inspect_hf, hf.load_hf):
    with pytest.raises(ck.CheckpointError, match="config.json"):
      fn(path)
  with pytest.raises(ck.CheckpointError, match=str(tmp_path / "c")):
    ck.load_checkpoint(path, PRESETS["tiny"])  # neither HF nor orbax


def test_error_model_type(hf_dirs, tmp_path):
  path = _copy(hf_dirs["hub"], tmp_path / "c")
  cfg_path = os.path.join(path, "config.json")
  config = _load_json(cfg_path)
  config["model_type"] = "llama"
  _dump_json(config, cfg_path)
  _raises(path, cfg_path, "model_type", "llama")


def test_error_missing_shard(hf_dirs, tmp_path):
  path = _copy(hf_dirs["fused_sharded"], tmp_path / "c")
  index = _load_json(os.path.join(path, hf.INDEX_FILE))
  key, shard = sorted(index["weight_map"].items())[3]
  os.remove(os.path.join(path, shard))
  _raises(path, hf.INDEX_FILE, shard, "key '")


@pytest.mark.parametrize("layout", ["hub", "fused_sharded"])
def test_error_missing_key(hf_dirs, tmp_path, layout):
  key = {"hub": "model.layers.1.block_sparse_moe.experts.2.w3.weight",
         "fused_sharded": "model.layers.1.mlp.experts.down_proj"}[layout]
  tensors = hf_utils.read_all(hf_dirs[layout])
  tensors.pop(key)
  config = _load_json(os.path.join(hf_dirs[layout], "config.json"))
  path = hf_utils.write_single(str(tmp_path / "c"), tensors, config)
  _raises(path, "model.safetensors", key, "missing")


def test_error_missing_key_named_by_index(hf_dirs, tmp_path):
  """The index names a key its file does not hold."""
  path = _copy(hf_dirs["hub_sharded"], tmp_path / "c")
  index_path = os.path.join(path, hf.INDEX_FILE)
  index = _load_json(index_path)
  index["weight_map"]["model.layers.0.extra.weight"] = index["weight_map"]["model.norm.weight"]
  _dump_json(index, index_path)
  _raises(path, index["weight_map"]["model.norm.weight"], "model.layers.0.extra.weight")


def test_error_wrong_shape(hf_dirs, tmp_path):
  key = "model.layers.1.self_attn.k_proj.weight"
  tensors = hf_utils.read_all(hf_dirs["hub"])
  tensors[key] = tensors[key][:-8]
  config = _load_json(os.path.join(hf_dirs["hub"], "config.json"))
  path = hf_utils.write_single(str(tmp_path / "c"), tensors, config)
  _raises(path, "model.safetensors", key, "(40, 64)", "(48, 64)")


def test_error_config_disagrees_with_weights(hf_dirs, tmp_path):
  """A config.json dimension that the tensors do not have is a shape error, not a silent load."""
  path = _copy(hf_dirs["hub"], tmp_path / "c")
  cfg_path = os.path.join(path, "config.json")
  config = _load_json(cfg_path)
  config["intermediate_size"] += 1
  _dump_json(config, cfg_path)
  _raises(path, "model.safetensors", "expected", "experts.0.w1.weight")


def test_error_unexpected_key(hf_dirs, tmp_path):
  tensors = hf_utils.read_all(hf_dirs["hub"])
  tensors["model.layers.2.input_layernorm.weight"] = tensors["model.norm.weight"]
  config = _load_json(os.path.join(hf_dirs["hub"], "config.json"))
  path = hf_utils.write_single(str(tmp_path / "c"), tensors, config)
  _raises(path, "model.safetensors", "model.layers.2.input_layernorm.weight", "unexpected")


# ----------------------------------------------------------------------------- orbax


ORBAX_CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2)


def _ep_shardings(params, devices):
  """The package's param layout (tr.param_specs): experts sharded over the workers on the
  expert axis, everything else replicated."""
  return mesh_lib.tree_shardings(mesh_lib.make_ep_mesh(devices), tr.param_specs(params))


def test_orbax_round_trip(tmp_path):
  params = tr.init_params(ORBAX_CFG, jax.random.key(7), scale=0.3)
  ck.save_orbax(str(tmp_path / "o"), params, ORBAX_CFG)
  cfg, restored = ck.load_orbax(str(tmp_path / "o"))
  assert cfg == ORBAX_CFG
  assert _bitwise_equal(restored, params)
  cfg2, restored2 = ck.load_checkpoint(str(tmp_path / "o"), PRESETS["tiny"])
  assert cfg2 == ORBAX_CFG and _bitwise_equal(restored2, params)
  assert ck.inspect_checkpoint(str(tmp_path / "o")) == ORBAX_CFG


def test_orbax_sharded_8_restores_onto_4_and_1(tmp_path):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (emulated) devices: XLA_FLAGS from conftest.py")
  params = tr.init_params(ORBAX_CFG, jax.random.key(8), scale=0.3)
  sharded = jax.device_put(params, _ep_shardings(params, jax.devices()[:8]))
  assert len(sharded["layers"]["w1"].sharding.device_set) == 8
  ck.save_orbax(str(tmp_path / "o"), sharded, ORBAX_CFG)
  target = _ep_shardings(params, jax.devices()[:4])
  _, on4 = ck.load_orbax(str(tmp_path / "o"), shardings=target)
  assert on4["layers"]["w2"].sharding == target["layers"]["w2"]
  assert len(on4["layers"]["w2"].addressable_shards) == 4
  assert _bitwise_equal(on4, params)
  _, on1 = ck.load_orbax(str(tmp_path / "o"))
  assert len(on1["layers"]["w1"].sharding.device_set) == 1
  assert _bitwise_equal(on1, params)


def test_load_checkpoint_dispatch(hf_dirs, tmp_path):
  assert ck.load_checkpoint("", PRESETS["tiny"]) is None
  assert ck.inspect_checkpoint(hf_dirs["hub"]) == hf.inspect_hf(hf_dirs["hub"])
  cfg, params = ck.load_checkpoint(hf_dirs["fused_sharded"], PRESETS["tiny"], dtype="bfloat16")
  assert cfg.num_experts == 4 and cfg.dtype == "bfloat16"
  assert params["layers"]["w1"].dtype == jnp.bfloat16
  (tmp_path / "junk").mkdir()
  for fn in (ck.inspect_checkpoint, ck.load_checkpoint):
    with pytest.raises(ck.CheckpointError, match=str(tmp_path / "junk")):
      fn(str(tmp_path / "junk"))


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
  tok = tok_lib.ByteTokenizer()
  assert tok.vocab_size == BYTE_VOCAB == PRESETS["tiny"].vocab_size
  assert (tok.bos_id, tok.eos_id) == (PRESETS["tiny"].bos_id, PRESETS["tiny"].eos_id)
  for text in ["", "hello world", "Grüße, 世界 🚀\n\ttabs"]:
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [tok.bos_id] + ids
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
  # A sampled continuation need not be valid UTF-8: replaced, never raised.
  assert tok.decode([0xE4, 0xB8, ord("a")]) == "\ufffda"


def _write_bpe_tokenizer(path) -> None:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  rng = np.random.default_rng(0)
  words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "42", "Grüße"]
  corpus = [" ".join(rng.choice(words, 12)) for _ in range(200)]
  tok.train_from_iterator(corpus, trainer)
  tok.save(os.path.join(str(path), "tokenizer.json"))


def test_hf_tokenizer_round_trip(tmp_path):
  _write_bpe_tokenizer(tmp_path)
  cfg = ORBAX_CFG.replace(vocab_size=300, bos_id=1, eos_id=2)
  tok = tok_lib.load_tokenizer(str(tmp_path), cfg)
  assert isinstance(tok, tok_lib.HFTokenizer)
  for text in ["the quick brown fox", "lazy dog 42 Grüße", "unseen: 世界!"]:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [1] + ids
    assert tok.decode([1] + ids + [2]) == text  # specials skipped


def test_load_tokenizer_dispatch(tmp_path):
  assert isinstance(tok_lib.load_tokenizer("", PRESETS["tiny"]), tok_lib.ByteTokenizer)
  assert isinstance(tok_lib.load_tokenizer(str(tmp_path), PRESETS["tiny"]), tok_lib.ByteTokenizer)
  assert tok_lib.load_tokenizer(str(tmp_path), PRESETS["8x7b"]) is None
