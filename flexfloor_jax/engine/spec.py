"""What fixes the engine's compiled shapes and layouts: EngineSpec, the sequences it takes and
gives back (SeqInput, SeqOutput), and the parameter layouts (non-expert / expert split, expert
slots over the `ep` mesh, KV cache spec)."""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flexfloor_jax.config import schema
from flexfloor_jax.config.settings import RolloutSettings
from flexfloor_jax.engine.sampling import SamplingParams
from flexfloor_jax.kernels import paged_attention as pa
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ATTENTION_BACKENDS, ModelConfig, resolve_moe_backend
from flexfloor_jax.model.moe import EPConfig, resolve_exchange
from flexfloor_jax.policy.pages import pages_for
from flexfloor_jax.runtime import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """Everything that fixes compiled shapes (identical for every schedule: fairness)."""
  cfg: ModelConfig
  slots_per_worker: int  # B: decode slots per worker (paged KV: the pool's max_seqs rows)
  expert_slots: int  # S: expert slots per worker, preallocated for the floor
  max_seq_len: int  # KV cache length per decode slot (prompt + response)
  max_prompt_len: int  # prefill width
  max_new_tokens: int
  sampling: SamplingParams
  decode_tile_m: int = 8
  prefill_tile_m: int = 32
  chunk_tokens: int = 64
  moe_backend: str = "auto"  # 'auto' | 'xla' | 'pallas' (model.config.resolve_moe_backend)
  interpret: bool = False  # force Pallas interpret mode (the resolution picks it on CPU anyway)
  warm_up: bool = True  # run each executable once at compile time (placeholder inputs)
  record_routes: bool = False  # keep every token's top-k experts per layer (RL routing replay)
  # EP token exchange: 'auto' ('ragged' on TPU/GPU, 'all_to_all' on CPU) | 'all_to_all' | 'ragged'
  exchange: str = "auto"
  # KV: 'slots' (a fixed-length cache row per decode slot) | 'paged' (a pool of num_pages pages
  # of page_size tokens per worker, read and written through page tables from the host)
  kv: str = "slots"
  page_size: int = cast(int, schema.default(RolloutSettings, "page_size"))
  num_pages: int = 0  # pages per worker (paged KV)
  # paged decode attention: 'xla' (flexfloor_jax.kernels.paged_attention's reference) | 'pallas'
  # (JAX's paged-attention kernels; interpreted on CPU)
  attention_backend: str = "xla"
  # Chunked prefill (prefill_rows > 0): a decode step runs, beside its B decode rows,
  # `prefill_rows` query rows of input tokens from each worker's queue (sequences admitted into
  # free slots, their prompts taken a chunk per step), and no step is a prefill step; a dispatch
  # takes its queue of at most `prefill_queue` entries per worker. 0: one-shot prefill steps.
  prefill_rows: int = 0
  prefill_queue: int = 0
  # Speculative decoding (draft_tokens D > 0): each dispatch brings up to D drafted tokens per
  # slot, which the decode steps verify in the worker's free decode rows (steps.decode_local);
  # 0: plain decoding. Not with chunked prefill.
  draft_tokens: int = 0

  def __post_init__(self):
    if self.draft_tokens < 0 or (self.draft_tokens and self.prefill_rows):
      raise ValueError(f"EngineSpec: draft_tokens ({self.draft_tokens}) must be >= 0, and 0 "
                       "with chunked prefill (prefill_rows > 0)")
    if self.prefill_rows < 0 or (self.prefill_queue < self.prefill_rows if self.prefill_rows
                                 else self.prefill_queue != 0):
      raise ValueError(f"EngineSpec: prefill_rows ({self.prefill_rows}) must be >= 0, and "
                       f"prefill_queue ({self.prefill_queue}) at least prefill_rows when it is "
                       "> 0, else 0")
    if self.kv not in ("slots", "paged"):
      raise ValueError(f"EngineSpec.kv must be 'slots' or 'paged', got {self.kv!r}")
    if self.kv == "paged" and min(self.page_size, self.num_pages) < 1:
      raise ValueError(f"paged KV needs page_size and num_pages >= 1, got {self.page_size}, "
                       f"{self.num_pages}")
    if self.attention_backend not in ATTENTION_BACKENDS:
      raise ValueError(f"EngineSpec.attention_backend must be one of {ATTENTION_BACKENDS}, got "
                       f"{self.attention_backend!r}")
    if self.attention_backend == "pallas" and self.cfg.sliding_window:
      raise ValueError("model.attention_backend='pallas': the Pallas paged-attention kernels "
                       f"take no sliding window (the model's is {self.cfg.sliding_window}); "
                       "use 'xla'")
    if self.attention_backend == "pallas" and self.cfg.attn_sinks:
      raise ValueError("model.attention_backend='pallas': the Pallas paged-attention kernels "
                       "take no attention sinks (the model has them); use 'xla'")

  @property
  def paged(self) -> bool:
    return self.kv == "paged"

  @property
  def chunked(self) -> bool:
    """Chunked prefill: input tokens ride in decode steps (prefill_rows > 0)."""
    return self.prefill_rows > 0

  @property
  def pages_per_seq(self) -> int:
    """Page-table width of a sequence row: max_seq_len in pages (0 with fixed slots)."""
    return pages_for(self.max_seq_len, self.page_size) if self.paged else 0

  @property
  def resume_width(self) -> int:
    """Token columns of a resumed sequence's prefill (prompt + tokens made before it was
    preempted: fewer than max_seq_len)."""
    return self.max_seq_len

  def paged_attention(self):
    """The paged decode's attention function (model.paged.decode_paged's `attention`). 'pallas'
    on CPU interprets the Triton kernel, which computes in the pool's dtype (the TPU kernel
    rounds k/v to bfloat16): the parity check against 'xla' is then to fp32 rounding."""
    if self.attention_backend == "pallas" and jax.default_backend() == "cpu":
      return functools.partial(pa.paged_attention_gpu, interpret=True)
    return functools.partial(pa.paged_attention, impl=self.attention_backend)

  def ep(self, n: int, tile_m: int) -> EPConfig:
    impl, interpret = resolve_moe_backend(self.moe_backend, jax.default_backend())
    return EPConfig(num_workers=n, slots_per_worker=self.expert_slots, top_k=self.cfg.top_k,
                    tile_m=tile_m, chunk_tokens=self.chunk_tokens, backend=impl,
                    interpret=interpret or self.interpret,
                    exchange=resolve_exchange(self.exchange),
                    choices=tfm.MoEChoices.of(self.cfg))


@dataclasses.dataclass
class SeqInput:
  """What the engine needs of one sequence."""
  tokens: np.ndarray  # prompt token ids
  limit: int  # tokens to generate at most (fixed target or max_new_tokens)
  stop_eos: bool  # stop at EOS (model lengths) or run to `limit` (workload lengths)
  phash: int  # stable hash of the prompt id
  sample: int
  fixed_length: bool = False


@dataclasses.dataclass
class SeqOutput:
  tokens: list
  logprobs: list
  finish_reason: str
  worker: int
  slot: int  # the decode slot it finished in
  routes: np.ndarray | None = None  # [prompt + tokens - 1, L, K] when spec.record_routes


# ----------------------------------------------------------------------------- parameter layouts


def split_params(params: tfm.Params) -> tuple[tfm.Params, dict]:
  """(non-expert params, expert weights {w1, w3, w2} (and their biases {b1, b3, b2} where the
  model has them) in canonical [L, E, ...] layout)."""
  layers = dict(params["layers"])
  experts = {k: layers.pop(k) for k in tfm.EXPERT_ARRAYS if k in layers}
  rest = dict(params)
  rest["layers"] = layers
  return rest, experts


def merge_params(rest: tfm.Params, experts: dict) -> tfm.Params:
  out = dict(rest)
  out["layers"] = {**rest["layers"], **experts}
  return out


def abstract_split(params: tfm.Params) -> tuple:
  """(non-expert, expert) shapes of `params` (what a StepCache compiles for)."""
  rest, experts = split_params(params)

  def shape(t):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)

  return shape(rest), shape(experts)


def expert_spec() -> PartitionSpec:
  """PartitionSpec of one expert stack ([L, E, ...] canonical or [L, N*S, ...] expert slots)."""
  return mesh_lib.param_spec(*tfm.PARAM_AXES["w1"])


def cache_spec() -> PartitionSpec:
  return mesh_lib.logical_spec("layer", "batch", None, None, None)


def pages_spec() -> PartitionSpec:
  """The paged pool [L, Hkv, N*num_pages, page_size, Dh]: pages split over the workers."""
  return mesh_lib.logical_spec("layer", "kv_heads", "batch", None, None)


@functools.cache
def _slot_gather(sharding: NamedSharding):
  """One jitted gather per target sharding (the slot table is an argument, not a constant)."""

  def gather(w, idx, empty):
    g = jnp.take(w, idx, axis=1)
    # [1, N*S, 1, ...]: weights [L, N*S, D, F] and biases [L, N*S, F] alike
    empty = empty.reshape((1, -1) + (1,) * (w.ndim - 2))
    return jnp.where(empty, jnp.zeros((), w.dtype), g)

  return jax.jit(gather, out_shardings=sharding)


def slot_layout(experts: dict, slot_expert_NS: np.ndarray, sharding: NamedSharding) -> dict:
  """Canonical [L, E, ...] expert weights -> expert-slot layout [L, N*S, ...] (empty slots are
  zero)."""
  flat = np.asarray(slot_expert_NS).reshape(-1)
  idx = np.maximum(flat, 0).astype(np.int32)
  empty = flat < 0
  gather = _slot_gather(sharding)
  return {k: gather(_onto_mesh(v, sharding), idx, empty) for k, v in experts.items()}


def _onto_mesh(w, sharding: NamedSharding):
  """`w` as the gather takes it: an array committed to other devices than the target mesh's (a
  checkpoint restored onto one device) is copied onto the mesh first, replicated, as a jitted
  computation refuses it (uncommitted arrays and arrays already on the mesh pass as they are)."""
  if (not isinstance(w, jax.Array) or not w.committed
      or w.sharding.device_set == sharding.device_set):
    return w
  src = w if jax.process_count() == 1 else np.asarray(w)  # no cross-host device_put on CPU
  return jax.device_put(src, mesh_lib.replicated(sharding.mesh))
