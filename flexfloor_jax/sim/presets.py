"""The simulator's hardware and model presets: published device figures and model dimensions.

A `Model` is sized from its dimensions by `model.param_count`, the formula the engine's model
config uses as well; the presets take their dimensions from `model.config.PRESETS` (one source).
Its KV bytes follow the engine's cache layout (model.transformer.KVLayout): a sliding-window layer
holds only its window's tokens of a sequence, every other layer all of them; a multi-head latent
attention layer (DeepSeek-V3) its latent and RoPE key (kv_lora_rank + qk_rope_head_dim values a
token), not K and V per head.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from flexfloor_jax.model import param_count
from flexfloor_jax.model.config import PRESETS, ModelConfig
from flexfloor_jax.sim.measured_hw import StepTable

GB = 1e9
GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  hbm_bw: float  # bytes/s per device
  hbm_bytes: float  # bytes per device
  link_bw: float  # bytes/s a device can send to its EP group (one direction)
  peak_flops: float  # dense bf16 FLOP/s per device
  step_overhead_s: float = 20e-6  # launch + host sync per step (assumption, not a published figure)
  collective_latency_s: float = 5e-6  # per all_to_all (assumption, not a published figure)
  # a release: experts and KV rows move point to point, at what one device achieves sending to
  # one other (not the link's aggregate over every peer), after a switch of compiled executables
  # and a barrier over the group
  p2p_bw: float = 0.0  # bytes/s, one device to one other; 0 = link_bw
  release_latency_s: float = 1e-3  # switch + barrier per release (assumption, not published)
  source: str = ""
  # --hardware=measured:FILE: measured decode-step times per worker (sim/measured_hw.py)
  step_table: StepTable | None = dataclasses.field(default=None, compare=False, repr=False)


HARDWARE = {
    # cloud.google.com/tpu/docs/v5e: 16 GiB HBM2 at 819 GB/s, ICI 1,600 Gbps per chip (= 200 GB/s),
    # 197 TFLOP/s bf16.
    # point to point: one of the chip's 4 ICI links (1,600 Gbps / 4 = 50 GB/s; an assumption)
    "tpu-v5e": Hardware("tpu-v5e", 819 * GB, 16 * GIB, 200 * GB, 197e12, p2p_bw=50 * GB,
                        source="cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e at 2,765 GB/s, ICI 4,800 Gbps per chip
    # (= 600 GB/s; the page also lists 1,200 GB/s bidirectional), 459 TFLOP/s bf16.
    # point to point: one of the chip's 6 ICI links (4,800 Gbps / 6 = 100 GB/s; an assumption)
    "tpu-v5p": Hardware("tpu-v5p", 2765 * GB, 95 * GIB, 600 * GB, 459e12, p2p_bw=100 * GB,
                        source="cloud.google.com/tpu/docs/v5p"),
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): 80 GB HBM3 at 3.35 TB/s,
    # NVLink 900 GB/s bidirectional (450 GB/s each way), 989 TFLOP/s dense bf16. An EP group of 8
    # is one NVLink/NVSwitch node.
    # point to point: 80% of one direction's NVLink through the switch (an assumption, not
    # a published figure)
    "h100": Hardware("h100", 3350 * GB, 80 * GB, 450 * GB, 989e12, p2p_bw=360 * GB,
                     source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s bidirectional, same GH100 compute as H100 (989 TFLOP/s dense bf16).
    "h200": Hardware("h200", 4800 * GB, 141 * GB, 450 * GB, 989e12, p2p_bw=360 * GB,
                     source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
}

# bytes per parameter of a model config's dtype name (bfloat16 has no numpy dtype)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclasses.dataclass(frozen=True)
class Model:
  """A model's dimensions. The sizes derived from them are computed once (cached_property: the
  simulator asks for them every simulated step)."""
  name: str
  vocab: int
  hidden: int  # D
  ffn: int  # F per expert
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  experts: int
  top_k: int
  dtype_bytes: int = 2
  source: str = ""
  # layers that read only the last `sliding_window` tokens (GPT-OSS: every other one); 0: none
  sliding_layers: int = 0
  sliding_window: int = 0
  # DeepSeek-V3 (0 where the model has none): values a token caches per layer (kv_lora_rank +
  # qk_rope_head_dim; 0: GQA's 2 x kv_heads x head_dim), the latent's width, one layer's MLA
  # weights, the shared expert's width, the dense layers (no routed experts there) and their
  # width, and a correction bias per expert
  kv_values: int = 0
  kv_lora_rank: int = 0
  mla_attn_params: int = 0
  shared_ffn: int = 0
  dense_layers: int = 0
  dense_ffn: int = 0
  router_correction: bool = False

  @classmethod
  def from_config(cls, name: str, cfg: ModelConfig, source: str = "") -> Model:
    """The engine's model config (`model.config.ModelConfig`) as a simulator model."""
    sliding = sum(cfg.window_of(i) is not None for i in range(cfg.num_layers))
    mla: dict[str, Any] = {}
    if cfg.mla:
      _, kd, vd = cfg.kv_dims()
      mla = dict(kv_values=kd + vd, kv_lora_rank=cfg.kv_lora_rank,
                 mla_attn_params=cfg.mla_attn_params(), shared_ffn=cfg.shared_intermediate_size,
                 dense_layers=len(cfg.dense_layers), dense_ffn=cfg.dense_intermediate_size,
                 router_correction=cfg.router == "sigmoid_grouped")
    return cls(name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
               cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts, cfg.top_k,
               dtype_bytes=DTYPE_BYTES.get(cfg.dtype, 4), source=source,
               sliding_layers=sliding, sliding_window=(cfg.sliding_window or 0) if sliding else 0,
               **mla)

  @functools.cached_property
  def expert_params(self) -> int:
    """One expert, all its MoE layers (w1, w3, w2): a dense layer has none."""
    return param_count.expert_params(self.hidden, self.ffn, self.layers - self.dense_layers)

  @functools.cached_property
  def expert_bytes(self) -> int:
    return self.expert_params * self.dtype_bytes

  @functools.cached_property
  def nonexpert_params(self) -> int:
    return param_count.nonexpert_params(self.vocab, self.hidden, self.layers, self.heads,
                                      self.kv_heads, self.head_dim, self.experts,
                                      dense_ffn=self.dense_ffn, dense_count=self.dense_layers,
                                      mla_attn=self.mla_attn_params, shared_ffn=self.shared_ffn,
                                      router_correction=self.router_correction)

  @functools.cached_property
  def nonexpert_bytes(self) -> int:
    """All non-expert weights (what each worker holds: replicated)."""
    return self.nonexpert_params * self.dtype_bytes

  @functools.cached_property
  def nonexpert_read_params(self) -> int:
    """Non-expert weights read per decode step: all but the embedding table (a row gather)."""
    return self.nonexpert_params - self.vocab * self.hidden

  @functools.cached_property
  def nonexpert_read_bytes(self) -> int:
    return self.nonexpert_read_params * self.dtype_bytes

  def _kv_layer_token_bytes(self) -> int:
    """K and V (MLA: the latent and the RoPE key) of one layer, one token."""
    return (self.kv_values or 2 * self.kv_heads * self.head_dim) * self.dtype_bytes

  @functools.cached_property
  def attn_flops_per_ctx_token(self) -> float:
    """Decode attention FLOPs per cached token a query attends to, all layers: GQA's q.k and
    p.v over every query head (4 x heads x head_dim a layer); MLA's absorbed form (the engine's
    decode: model/transformer.py) scores the latent and the RoPE key and sums the latent per
    head (heads x (4 x kv_lora_rank + 2 x qk_rope_head_dim) a layer)."""
    if self.kv_lora_rank:
      return float(self.layers * self.heads * (4 * self.kv_lora_rank + 2 * self.head_dim))
    return 4.0 * self.layers * self.heads * self.head_dim

  @functools.cached_property
  def kv_bytes_per_token(self) -> int:
    """KV bytes per cached token of the layers that keep every token (all of them without
    sliding layers): what a paged pool's pages hold per token, the growth of a sequence past its
    window."""
    return (self.layers - self.sliding_layers) * self._kv_layer_token_bytes()

  def kv_bytes(self, tokens):
    """KV bytes one sequence of `tokens` cached tokens holds (scalar or array): every token in a
    full layer, min(tokens, window) in a sliding one."""
    window = np.minimum(tokens, self.sliding_window)
    out = tokens * self.kv_bytes_per_token + \
        window * self.sliding_layers * self._kv_layer_token_bytes()
    return int(out) if np.ndim(out) == 0 else out

  def kv_read_bytes(self, rows, ctx):
    """KV bytes a step reads on each worker with `rows` sequences holding `ctx` cached tokens
    between them (arrays per worker): the full layers every token, the sliding layers at most
    each row's window, min(ctx, rows x window). Exact when every row is past its window or none
    is; otherwise an upper bound of the per-row sum (rows are not seen one by one here)."""
    ctx = np.asarray(ctx, float)
    window = np.minimum(ctx, np.asarray(rows, float) * self.sliding_window)
    return ctx * self.kv_bytes_per_token + \
        window * self.sliding_layers * self._kv_layer_token_bytes()

  @functools.cached_property
  def params(self) -> int:
    return self.nonexpert_params + self.experts * self.expert_params


# model preset name -> (its dimensions in model.config.PRESETS, the published config.json's repo)
_PUBLISHED = {
    "mixtral-8x7b": ("8x7b", "mistralai/Mixtral-8x7B-v0.1"),
    "mixtral-8x22b": ("8x22b", "mistralai/Mixtral-8x22B-v0.1"),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B"),
    "gpt-oss-20b": ("gpt-oss-20b", "openai/gpt-oss-20b"),
    "gpt-oss-120b": ("gpt-oss-120b", "openai/gpt-oss-120b"),
    "deepseek-v3": ("deepseek-v3", "deepseek-ai/DeepSeek-V3"),
    "moonlight-16b-a3b": ("moonlight-16b-a3b", "moonshotai/Moonlight-16B-A3B"),
    "kimi-k2": ("kimi-k2", "moonshotai/Kimi-K2-Instruct"),
}
MODELS = {name: Model.from_config(name, PRESETS[preset],
                                  source=f"huggingface.co/{repo}/config.json")
          for name, (preset, repo) in _PUBLISHED.items()}
MODELS["tiny"] = Model.from_config("tiny", PRESETS["tiny"],
                                   source="flexfloor_jax/model/config.py PRESETS['tiny']")


def parse_cost_model(text: str) -> tuple[Model, Hardware]:
  """A named step cost model: 'roofline:MODEL@HARDWARE' (a MODELS and a HARDWARE preset, e.g.
  'roofline:mixtral-8x7b@h100'), the roofline a run on emulated CPU devices is replayed on (the
  tiny model stands for the named one). ValueError names the part that does not parse."""
  kind, _, pair = str(text).partition(":")
  model, _, hw = pair.partition("@")
  if kind != "roofline" or not model or not hw:
    raise ValueError(f"{text!r} is not 'roofline:MODEL@HARDWARE' (e.g. "
                     f"'roofline:mixtral-8x7b@h100')")
  if model not in MODELS:
    raise ValueError(f"model {model!r} of {text!r} is not one of {sorted(MODELS)}")
  if hw not in HARDWARE:
    raise ValueError(f"hardware {hw!r} of {text!r} is not one of {sorted(HARDWARE)}")
  return MODELS[model], HARDWARE[hw]
