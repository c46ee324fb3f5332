"""What a model family states, and the pieces families share.

A family (one module per Hugging Face `model_type`) gives:
- `config_from_hf(hf, source)`: the ModelConfig from config.json, every dimension and block choice
  read from the file, one CheckpointError naming the field for a missing or out-of-range value;
- `weights(cfg, keys, tied)`: the checkpoint's tensors as `Weight`s: HF key, HF shape, and where
  each lands in our params layout (model/transformer.py) after which transform.
The loader (model/hf_checkpoint.py) validates and reads any family through these two; the
transformer sees only the ModelConfig's block choices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import Any

import ml_dtypes
import numpy as np

from flexfloor_jax.model.checkpoint_format import DTYPES, CheckpointError
from flexfloor_jax.model.config import ModelConfig


def transpose(t: np.ndarray) -> np.ndarray:
  """HF linear weights are [out, in]; ours [in, out]."""
  return t.T


def same(t: np.ndarray) -> np.ndarray:
  return t


def swap_last(t: np.ndarray) -> np.ndarray:
  """A stack of HF [out, in] matrices [E, out, in] -> ours [E, in, out]."""
  return np.swapaxes(t, -1, -2)


@dataclasses.dataclass(frozen=True)
class Put:
  """Where (part of) a checkpoint tensor lands: params[leaf][index] = fn(tensor). `leaf` is a
  top-level name (embed, final_norm, lm_head) or a layer stack's name under 'layers'."""
  leaf: str
  index: tuple = ()
  fn: Callable[[np.ndarray], np.ndarray] = same


@dataclasses.dataclass(frozen=True)
class Weight:
  key: str  # the safetensors key
  shape: tuple  # its shape, as config.json implies
  puts: tuple[Put, ...]
  # 'mxfp4': `key` holds MXFP4 blocks (uint8 [..., G, 16]: two 4-bit values a byte, 32 a block)
  # and `scales_key` their scales (uint8 [..., G]: a power of two a block, biased by 127); the
  # puts get the dequantized tensor (dequantize_mxfp4)
  # 'fp8': `key` holds float8 e4m3 codes [out, in] and `scales_key` float32 scales, one per
  # block of `block` (rows, cols) (DeepSeek-V3's weight_scale_inv); dequantize_fp8_block
  quant: str = ""
  scales_key: str = ""
  block: tuple[int, int] = (128, 128)

  @property
  def scales_shape(self) -> tuple:
    if self.quant == "fp8":
      return tuple(-(-n // b) for n, b in zip(self.shape, self.block, strict=True))
    return self.shape[:-1]


# The 16 values of an FP4 (E2M1) code: sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """MXFP4 blocks [E, R, G, 16] and scales [E, R, G] -> float32 [E, G*32, R]: each byte holds
  two codes (the low nibble first), a block's 32 values share the scale 2^(s - 127), and the
  result is transposed to [in, out] as GPT-OSS's bfloat16 expert tensors are stored (exact:
  every value is a small integer times a power of two)."""
  e, r, g, b = blocks.shape
  vals = np.empty((e, r, g, 2 * b), np.float32)
  vals[..., 0::2] = FP4_VALUES[blocks & 0x0F]
  vals[..., 1::2] = FP4_VALUES[blocks >> 4]
  vals = np.ldexp(vals, (scales.astype(np.int32) - 127)[..., None])
  return np.ascontiguousarray(np.swapaxes(vals.reshape(e, r, g * 2 * b), 1, 2))


def dequantize_fp8_block(codes: np.ndarray, scales: np.ndarray,
                         block: tuple[int, int]) -> np.ndarray:
  """float8 e4m3 codes [R, C] (as uint8) and float32 scales [ceil(R/br), ceil(C/bc)] ->
  float32 [R, C]: each (br, bc) block times its scale (exact in float32: a 4-bit mantissa times
  a float32)."""
  r, c = codes.shape
  br, bc = block
  vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  full = np.repeat(np.repeat(scales.astype(np.float32), br, axis=0), bc, axis=1)[:r, :c]
  return vals * full


TOP_LEVEL = ("embed", "final_norm", "lm_head")


class HFConfig:
  """config.json's fields, read with the file named in every error."""

  def __init__(self, hf: dict, source: str):
    self.hf, self.source = hf, source

  def error(self, msg: str) -> CheckpointError:
    return CheckpointError(f"{self.source}: {msg}")

  def get(self, name: str, default: Any = KeyError):  # KeyError: required
    if name in self.hf:
      return self.hf[name]
    if default is KeyError:
      raise self.error(f"missing field '{name}'")
    return default

  def integer(self, name: str, default: Any = KeyError) -> Any:
    """An integer, or the file's null."""
    v = self.get(name, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
      raise self.error(f"field '{name}' must be an integer, got {v!r}")
    return v

  def number(self, name: str, default: Any = KeyError) -> float:
    v = self.get(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
      raise self.error(f"field '{name}' must be a finite number, got {v!r}")
    return float(v)

  def flag(self, name: str, default: Any = KeyError) -> bool:
    v = self.get(name, default)
    if not isinstance(v, bool):
      raise self.error(f"field '{name}' must be true or false, got {v!r}")
    return v

  def int_list(self, name: str, default: Any = KeyError) -> list[int]:
    v = self.get(name, default)
    v = [] if v is None else v
    if not isinstance(v, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in v):
      raise self.error(f"field '{name}' must be a list of integers, got {v!r}")
    return v


def common_fields(c: HFConfig, *, yarn: bool = False, quantized: tuple[str, ...] = (),
                  mscale: bool = False) -> dict:
  """The ModelConfig fields every decoder family's config.json spells the same way: vocabulary,
  hidden size, heads, kv heads, head_dim, layers, RoPE theta (default RoPE, or YaRN where the
  family has it; `mscale`: with DeepSeek's mscale and mscale_all_dim), positions, stop and start
  ids, dtype; checks the activation is SiLU and that the weights are not quantized other than as
  the family's loader dequantizes (`quantized`)."""
  quant = c.hf.get("quantization_config")
  if quant:
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in quantized:
      raise c.error(f"field 'quantization_config.quant_method' is {method!r}: quantized "
                    "weights are not supported; dequantize the checkpoint to bfloat16 first "
                    "(transformers: from_pretrained(...), then save_pretrained)")
  hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
  kv_heads = c.integer("num_key_value_heads", None)
  head_dim = c.integer("head_dim", None)
  # transformers 5 nests rope_theta in rope_parameters; 4.x has it top level.
  rope = c.hf.get("rope_parameters") or c.hf.get("rope_scaling") or {}
  if not isinstance(rope, dict):
    raise c.error(f"field 'rope_parameters' must be an object, got {rope!r}")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  supported = ("default", "yarn") if yarn else ("default",)
  if rope_type not in supported:
    names = " or ".join(repr(t) for t in supported)
    raise c.error(f"field 'rope_parameters.rope_type' is {rope_type!r}; only {names} RoPE is "
                  "supported")
  scaling = _yarn_fields(c, rope, mscale) if rope_type == "yarn" else {}
  theta = rope.get("rope_theta", c.hf.get("rope_theta", 1e6))
  if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not math.isfinite(theta):
    raise c.error(f"field 'rope_theta' must be a finite number, got {theta!r}")
  act = c.hf.get("hidden_act", "silu")
  if act != "silu":
    raise c.error(f"field 'hidden_act' is {act!r}; only 'silu' is supported")
  eos = c.hf.get("eos_token_id", 2)
  # Several stop ids (Qwen3, GPT-OSS): the first is the model's eos, every one ends a response.
  eos_list = list(eos) if isinstance(eos, (list, tuple)) else [eos]
  bos = c.hf.get("bos_token_id", 1)
  for name, vals in (("eos_token_id", eos_list), ("bos_token_id", [bos])):
    for v in vals:
      if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise c.error(f"field '{name}' must be an integer, got {v!r}")
  eos_list = [v for v in eos_list if v is not None]
  dtype = c.hf.get("dtype") or c.hf.get("torch_dtype") or "float32"
  if dtype not in DTYPES:
    raise c.error(f"field 'dtype' is {dtype!r}; expected one of float32, bfloat16, float16")
  return dict(
      vocab_size=c.integer("vocab_size"), hidden_size=hidden,
      num_layers=c.integer("num_hidden_layers"),
      num_heads=heads, num_kv_heads=kv_heads if kv_heads is not None else heads,
      head_dim=head_dim if head_dim is not None else hidden // heads,
      rope_theta=float(theta), max_position_embeddings=c.integer("max_position_embeddings", 32768),
      eos_id=eos_list[0] if eos_list else -1,  # -1: no eos token, never matches
      extra_eos_ids=tuple(eos_list[1:]),
      bos_id=-1 if bos is None else bos, dtype=DTYPES[dtype], **scaling)


def _yarn_fields(c: HFConfig, rope: dict, mscale: bool = False) -> dict:
  """YaRN's parameters from rope_parameters; the attention factor is the paper's default, or
  (`mscale`: DeepSeek-V3) from mscale and mscale_all_dim; other overrides are refused."""
  for name in ("attention_factor",) if mscale else ("attention_factor", "mscale",
                                                     "mscale_all_dim"):
    if rope.get(name) is not None:
      raise c.error(f"field 'rope_parameters.{name}' is set; only YaRN's default attention "
                    "scale is supported")
  sub = HFConfig(rope, f"{c.source} (rope_parameters)")
  scales = {}
  if mscale:
    scales = dict(yarn_mscale=sub.number("mscale", 0.0) if rope.get("mscale") is not None
                  else 0.0,
                  yarn_mscale_all_dim=sub.number("mscale_all_dim", 0.0)
                  if rope.get("mscale_all_dim") is not None else 0.0)
  factor = sub.number("factor")
  if factor < 1:
    raise c.error(f"field 'rope_parameters.factor' must be >= 1, got {factor}")
  return dict(yarn_factor=factor,
              yarn_original_max_position=sub.integer("original_max_position_embeddings"),
              yarn_beta_fast=sub.number("beta_fast", 32.0),
              yarn_beta_slow=sub.number("beta_slow", 1.0),
              yarn_truncate=sub.flag("truncate", True), **scales)


def make_config(c: HFConfig, **fields) -> ModelConfig:
  """ModelConfig(**fields); its own range errors as one CheckpointError naming the file."""
  try:
    return ModelConfig(**fields)
  except (TypeError, ValueError, ZeroDivisionError) as e:
    if isinstance(e, CheckpointError):
      raise
    raise c.error(str(e)) from None


def embedding_weights(cfg: ModelConfig, keys: Collection[str], tied: bool) -> list[Weight]:
  """Embedding, final norm and lm_head (the embedding's transpose when tied and absent)."""
  v, d = cfg.vocab_size, cfg.hidden_size
  embed_puts = [Put("embed")]
  out = [Weight("model.embed_tokens.weight", (v, d), ()),
         Weight("model.norm.weight", (d,), (Put("final_norm"),))]
  if tied and "lm_head.weight" not in keys:
    embed_puts.append(Put("lm_head", (), transpose))
  else:
    out.append(Weight("lm_head.weight", (v, d), (Put("lm_head", (), transpose),)))
  out[0] = dataclasses.replace(out[0], puts=tuple(embed_puts))
  return out


def attention_weights(cfg: ModelConfig, n: int) -> list[Weight]:
  """Layer n's norms and q/k/v/o projections (no biases), and q/k norms when cfg.qk_norm."""
  d, hd = cfg.hidden_size, cfg.head_dim
  qd, kd = cfg.num_heads * hd, cfg.num_kv_heads * hd
  p = f"model.layers.{n}."
  out = [Weight(p + "input_layernorm.weight", (d,), (Put("attn_norm", (n,)),)),
         Weight(p + "post_attention_layernorm.weight", (d,), (Put("mlp_norm", (n,)),))]
  for ours, hf_name, shape in (("wq", "q", (qd, d)), ("wk", "k", (kd, d)), ("wv", "v", (kd, d)),
                               ("wo", "o", (d, qd))):
    out.append(Weight(f"{p}self_attn.{hf_name}_proj.weight", shape,
                      (Put(ours, (n,), transpose),)))
  if cfg.qk_norm:
    out += [Weight(p + "self_attn.q_norm.weight", (hd,), (Put("q_norm", (n,)),)),
            Weight(p + "self_attn.k_norm.weight", (hd,), (Put("k_norm", (n,)),))]
  return out


def fused_experts(cfg: ModelConfig, n: int, prefix: str) -> list[Weight]:
  """transformers 5.x in-memory expert layout: gate_up_proj [E, 2F, D] (gate rows, then up
  rows) and down_proj [E, D, F]."""
  d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
  return [Weight(prefix + "gate_up_proj", (e, 2 * f, d),
                 (Put("w1", (n,), lambda t: swap_last(t[:, :f])),
                  Put("w3", (n,), lambda t: swap_last(t[:, f:])))),
          Weight(prefix + "down_proj", (e, d, f), (Put("w2", (n,), swap_last),))]


def swiglu(prefix: str, names: tuple[str, str, str], leaf: str, index: tuple, ffn: int,
           hidden: int) -> list[Weight]:
  """One SwiGLU MLP's [out, in] matrices, `names` = its (gate, up, down) names under `prefix`,
  into the leaves leaf + 'w1', 'w3', 'w2' at `index` (an expert: leaf '', index (layer,
  expert); a dense layer's: 'dense_'; a shared expert's: 'shared_')."""
  shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
  return [Weight(f"{prefix}{name}.weight", shape, (Put(leaf + w, index, transpose),))
          for name, shape, w in zip(names, shapes, ("w1", "w3", "w2"), strict=True)]


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")  # the HF names of a SwiGLU's matrices


def per_expert(cfg: ModelConfig, n: int, prefix: str, names: tuple[str, str, str]) -> list[Weight]:
  """One [out, in] matrix per expert: `names` are the (gate, up, down) names under
  prefix + '{j}.'."""
  out = []
  for j in range(cfg.num_experts):
    out += swiglu(f"{prefix}{j}.", names, "", (n, j), cfg.intermediate_size, cfg.hidden_size)
  return out


def has_fused(keys: Collection[str], prefix: str) -> bool:
  return f"{prefix}gate_up_proj" in keys or f"{prefix}down_proj" in keys


def routed_experts(cfg: ModelConfig, n: int, keys: Collection[str], prefix: str,
                   names: tuple[str, str, str]) -> list[Weight]:
  """A sparse layer's router (prefix + 'gate.weight', no bias) and its SwiGLU experts under
  prefix + 'experts.', fused (`fused_experts`) or one matrix per expert (`per_expert`, named
  `names`), whichever the checkpoint holds."""
  out = [Weight(prefix + "gate.weight", (cfg.num_experts, cfg.hidden_size),
                (Put("router", (n,), transpose),))]
  if has_fused(keys, prefix + "experts."):
    return out + fused_experts(cfg, n, prefix + "experts.")
  return out + per_expert(cfg, n, prefix + "experts.", names)


@dataclasses.dataclass(frozen=True)
class Family:
  model_type: str
  display: str  # as error messages name the architecture
  config_from_hf: Callable[[HFConfig], ModelConfig]
  weights: Callable[[ModelConfig, Collection[str], bool], list[Weight]]
  # (config.json, cfg) -> (key prefixes the loader skips, what they are): checkpoint parts the
  # model does not run (DeepSeek-V3's multi-token prediction layers), logged once, not refused
  ignored: Callable[[dict, ModelConfig], tuple[tuple[str, ...], str]] | None = None
