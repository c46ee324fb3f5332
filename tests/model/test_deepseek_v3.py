"""The DeepSeek-V3 family beyond transformers parity (tests/model/test_family_parity.py): the
published presets' shapes, parameter counts and latent-cache floors; multi-token prediction
layers skipped on load with one log line; block-FP8 checkpoints dequantized on load; bad
config.json values refused in one line naming the field; the paged latent cache equal to the
fixed-slot one bit for bit."""

from __future__ import annotations

import copy
import json
import logging
import math
import os

import hf_utils
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flexfloor_jax import memory as memory_cli
from flexfloor_jax.engine import memory
from flexfloor_jax.model import hf_checkpoint as hf
from flexfloor_jax.model import paged
from flexfloor_jax.model import transformer as tr
from flexfloor_jax.model.checkpoint_format import CheckpointError
from flexfloor_jax.model.config import PRESETS

# A config.json as transformers writes it (tests/hf_utils.py DEEPSEEK_CASES['ds']), for checks
# that need no torch.
DS = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
      "n_routed_experts": 12, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
      "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 40, "qk_rope_head_dim": 8,
      "qk_nope_head_dim": 12, "v_head_dim": 20, "routed_scaling_factor": 2.5,
      "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
      "rope_parameters": dict(hf_utils.DEEPSEEK_ROPE), "rope_interleave": True,
      "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
      "tie_word_embeddings": False, "num_nextn_predict_layers": 1}

# (preset, published total parameters, published activated parameters): DeepSeek-V3 671B / 37B,
# Moonlight-16B-A3B 16B / 3B, Kimi-K2 1.03T / 32B (model cards; multi-token prediction modules
# not counted)
PUBLISHED = [("deepseek-v3", 671e9, 37e9), ("moonlight-16b-a3b", 16.0e9, 3.0e9),
             ("kimi-k2", 1.03e12, 32e9)]


@pytest.mark.parametrize("name,total,active", PUBLISHED)
def test_full_size_presets(name, total, active, capsys):
  """eval_shape of the init (nothing allocated) has param_shapes' shapes and the preset's count;
  less the expert slots of the dense layers (the layout keeps expert stacks on every layer) that
  is the published size, and the published activated size; the KV bytes per token are the
  latent cache's: layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes; the memory CLI prints a
  floor on 80 GiB devices."""
  cfg = PRESETS[name]
  abstract = tr.abstract_params(cfg)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), tr.param_shapes(cfg)) == \
      jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
  assert n == cfg.param_count()
  expert = 3 * cfg.hidden_size * cfg.intermediate_size
  checkpoint = n - len(cfg.dense_layers) * cfg.num_experts * expert
  assert abs(checkpoint - total) <= 0.005 * total, f"{name}: {checkpoint / 1e9:.2f}B"
  moe_layers = cfg.num_layers - len(cfg.dense_layers)
  act = checkpoint - (cfg.num_experts - cfg.top_k) * moe_layers * expert
  assert abs(act - active) <= 0.03 * active, f"{name}: {act / 1e9:.2f}B active"
  assert abstract["layers"]["dense_w1"].shape[0] == len(cfg.dense_layers)
  assert "wk" not in abstract["layers"] and "wkv_b" in abstract["layers"]
  specs = tr.param_specs(abstract)
  assert {k for k, s in specs["layers"].items() if tuple(s) and any(s)} == {"w1", "w3", "w2"}

  per_token, rings = memory.kv_bytes(cfg, 4096)
  assert per_token == cfg.num_layers * (cfg.kv_lora_rank + cfg.head_dim) * 2 and rings == 0
  memory_cli.main(["--preset", name, "--device_memory_gb", "80", "--workers", "64"])
  out = capsys.readouterr().out
  print(out)
  assert f"{per_token:,} bytes per token = {cfg.num_layers} layers x (512 latent + 64 RoPE key)" \
      " values x 2 bytes" in out
  assert "floor:" in out, out


def test_v3_kv_term_is_the_latent_cache():
  """The figure the floor's KV term is built from: 61 layers x (512 + 64) values x 2 bytes =
  70,272 bytes per token in bf16 (GQA over 128 heads of 192 would be 61 x 2 x 128 x 192 x 2)."""
  per_token, _ = memory.kv_bytes(PRESETS["deepseek-v3"], 3072)
  assert per_token == 61 * (512 + 64) * 2 == 70272
  t = memory.floor_terms(PRESETS["deepseek-v3"], 4, 3072, 1024)
  state = t.kv - 4 * 3072 * per_token
  assert 0 < state < 0.01 * t.kv  # the rest of the KV term is slot state


def _numpy_config(**changes) -> dict:
  cfg = copy.deepcopy(DS)
  cfg.update(changes)
  return cfg


@pytest.mark.parametrize("changes,needle", [
    (dict(n_group=5), "n_group"),
    (dict(topk_group=6), "topk_group"),
    (dict(num_experts_per_tok=7), "top_k"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                               "weight_block_size": [64, 64]}), "weight_block_size"),
    (dict(quantization_config={"quant_method": "gptq"}), "'gptq'"),
])
def test_bad_config_is_one_line_naming_the_field(changes, needle):
  with pytest.raises(CheckpointError) as e:
    hf.config_from_hf(_numpy_config(**changes), "ckpt/config.json")
  msg = str(e.value)
  assert needle in msg and "\n" not in msg and msg.startswith("ckpt/config.json"), msg


def test_config_reads_every_choice():
  cfg = hf.config_from_hf(_numpy_config(), "config.json")
  assert (cfg.family, cfg.mla, cfg.kv_dims(), cfg.num_kv_heads, cfg.yarn_mscale,
          cfg.yarn_mscale_all_dim, cfg.dense_layers, cfg.shared_intermediate_size) == (
              "deepseek_v3", True, (1, 32, 8), 4, 0.707, 0.9, (0,), 24)
  cfg = hf.config_from_hf(_numpy_config(q_lora_rank=None, n_shared_experts=2), "config.json")
  assert (cfg.q_lora_rank, cfg.shared_intermediate_size) == (0, 48)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
  """A two-layer DeepSeek-V3 saved by transformers, its dense layer's MLP 200 wide (two FP8
  row blocks of 128)."""
  pytest.importorskip("torch")
  path = str(tmp_path_factory.mktemp("ds_small") / "ckpt")
  model = hf_utils.build_model(hf_utils.deepseek_config("ds", num_hidden_layers=2,
                                                        intermediate_size=200), seed=3)
  hf_utils.save(model, path)
  return path


def _rewrite(src: str, dst: str, tensors: dict, config_changes: dict):
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  config.update(config_changes)
  hf_utils.write_single(dst, tensors, config)


def _same_params(a, b):
  for (pa, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a),
                             jax.tree_util.tree_leaves_with_path(b), strict=True):
    assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(pa)


def test_mtp_layer_skipped_with_one_log_line(small_checkpoint, tmp_path, caplog):
  """A multi-token prediction layer after the model's layers (keys as the published V3 file's
  layer 61) loads as the same params with one log line; without num_nextn_predict_layers the
  same keys are refused."""
  tensors = hf_utils.read_all(small_checkpoint)
  rng = np.random.default_rng(0)
  mtp = {"model.layers.2.enorm.weight": (64,), "model.layers.2.hnorm.weight": (64,),
         "model.layers.2.eh_proj.weight": (64, 128),
         "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": (40, 64),
         "model.layers.2.mlp.gate.weight": (12, 64),
         "model.layers.2.shared_head.head.weight": (300, 64)}
  extra = {k: rng.standard_normal(s).astype(np.float32) for k, s in mtp.items()}
  _rewrite(small_checkpoint, str(tmp_path / "mtp"), {**tensors, **extra},
           {"num_nextn_predict_layers": 1})
  _, plain = hf.load_hf(small_checkpoint)
  with caplog.at_level(logging.INFO, logger=hf.log.name):
    cfg, params = hf.load_hf(str(tmp_path / "mtp"))
  lines = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
  assert len(lines) == 1 and "6 tensors" in lines[0] and "layers 2" in lines[0], lines
  assert cfg.num_layers == 2
  _same_params(plain, params)

  _rewrite(small_checkpoint, str(tmp_path / "no_mtp"), {**tensors, **extra},
           {"num_nextn_predict_layers": 0})
  with pytest.raises(CheckpointError, match="unexpected key 'model.layers.2."):
    hf.inspect_hf(str(tmp_path / "no_mtp"))


def _quantize(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
  """Block-FP8 codes [R, C] (e4m3) and float32 scales [ceil(R/128), ceil(C/128)], a different
  scale per block."""
  r, c = w.shape
  sr, sc = -(-r // 128), -(-c // 128)
  scales = (np.abs(w).max() / 448 * rng.uniform(0.5, 2.0, (sr, sc))).astype(np.float32)
  full = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:r, :c]
  codes = np.clip(w / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  return codes, scales


def test_fp8_block_checkpoint_is_dequantized(small_checkpoint, tmp_path):
  """The published FP8 layout (every projection but the router's as e4m3 codes with a
  `weight_scale_inv` per 128 x 128 block; norms, embeddings, lm_head, router and correction
  bias in full precision) loads as the same params as a float32 checkpoint holding codes x
  scales: bit for bit, over matrices of one and of two blocks."""
  tensors = hf_utils.read_all(small_checkpoint)
  rng = np.random.default_rng(1)
  fp8, dequant = {}, {}
  quantized = 0
  for k, t in tensors.items():
    if (t.ndim == 2 and k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight")):
      codes, scales = _quantize(t, rng)
      fp8[k], fp8[k + "_scale_inv"] = codes, scales
      full = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:t.shape[0], :t.shape[1]]
      dequant[k] = codes.astype(np.float32) * full
      quantized += 1
    else:
      fp8[k] = dequant[k] = t
  assert quantized > 10 and fp8["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
  quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]}
  _rewrite(small_checkpoint, str(tmp_path / "fp8"), fp8, {"quantization_config": quant})
  _rewrite(small_checkpoint, str(tmp_path / "ref"), dequant, {})
  _, p8 = hf.load_hf(str(tmp_path / "fp8"))
  _, ref = hf.load_hf(str(tmp_path / "ref"))
  _same_params(ref, p8)
  # and the codes really are quantized: far from the original weights at e4m3's 3-bit mantissa
  _, orig = hf.load_hf(small_checkpoint)
  d = np.abs(np.asarray(p8["layers"]["wkv_b"]) - np.asarray(orig["layers"]["wkv_b"])).max()
  assert d > 1e-3

  bad = dict(fp8)
  bad["model.layers.0.mlp.gate_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
  _rewrite(small_checkpoint, str(tmp_path / "bad"), bad, {"quantization_config": quant})
  with pytest.raises(CheckpointError, match="gate_proj.weight_scale_inv' has shape"):
    hf.inspect_hf(str(tmp_path / "bad"))


def test_paged_latent_cache_equals_fixed_slots():
  """Prefill then 6 decode steps of 3 rows: the latent cache in fixed slots and in a pool of
  shuffled pages (page 4, 8 pages of 4 positions a row) give bitwise equal logits and hold the
  same latent and RoPE key values."""
  cfg = PRESETS["deepseek-v3-tiny"].replace(num_layers=2)
  params = tr.init_params(cfg, jax.random.key(3), scale=0.1)
  b, s, ps = 3, 32, 4
  rng = np.random.default_rng(0)
  lengths = np.array([7, 3, 11])
  tokens = np.zeros((b, 12), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(0, cfg.vocab_size, n)
  first, k, v, _ = jax.jit(lambda p, t, n: tr.prefill(p, cfg, t, n))(params, tokens, lengths)
  assert k.shape[-2:] == (1, cfg.kv_lora_rank) and v.shape[-2:] == (1, cfg.head_dim)
  fixed = tr.insert(tr.KVCache.zeros(cfg, b, s), k, v, jnp.arange(b), jnp.asarray(lengths))
  table = rng.permutation(b * s // ps).reshape(b, s // ps).astype(np.int32)
  pool = paged.insert_paged(paged.PagedKVCache.zeros(cfg, b * s // ps, ps), k, v,
                            jnp.asarray(table), jnp.asarray(lengths))
  dec = jax.jit(lambda p, c, t, pos: tr.decode(p, cfg, c, t, pos, jnp.ones((b,), bool)))
  dec_p = jax.jit(lambda p, c, t, pos: paged.decode_paged(p, cfg, c, jnp.asarray(table), t, pos,
                                                          jnp.ones((b,), bool)))
  tok, pos = jnp.argmax(first, -1).astype(jnp.int32), jnp.asarray(lengths)
  for _ in range(6):
    la, fixed, _ = dec(params, fixed, tok, pos)
    lb, pool, _ = dec_p(params, pool, tok, pos)
    assert np.array_equal(np.asarray(la), np.asarray(lb))
    tok, pos = jnp.argmax(la, -1).astype(jnp.int32), pos + 1
  gathered = np.asarray(pool.k_pages)[:, 0][:, table].reshape(2, b, s, cfg.kv_lora_rank)
  for i, n in enumerate(np.asarray(pos)):
    assert np.array_equal(gathered[:, i, :n], np.asarray(fixed.k)[:, i, :n, 0])
