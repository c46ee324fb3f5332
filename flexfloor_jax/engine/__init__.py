"""The rollout engine: decode slots over the `ep` mesh, prefill / insert / decode, compiled
ahead of time per mesh. Modules: spec (shapes, sequences, parameter layouts), state (the typed
decode state and host-input layouts), steps (per-worker step bodies), step_set (compiled steps
per mesh and their caches), engine (the Engine)."""

from flexfloor_jax.engine.engine import Engine
from flexfloor_jax.engine.spec import (
  EngineSpec,
  SeqInput,
  SeqOutput,
  abstract_split,
  cache_spec,
  expert_spec,
  merge_params,
  slot_layout,
  split_params,
)
from flexfloor_jax.engine.state import (
  DECODE_COLS,
  PREFILL_COLS,
  SCALAR_COLS,
  DecodeState,
  Scalars,
  ring_chunk,
  state_bytes_per_worker,
  state_shapes,
)
from flexfloor_jax.engine.step_set import StepCache, StepCachePool, StepSet, default_compile_threads

__all__ = [
    "DECODE_COLS", "PREFILL_COLS", "SCALAR_COLS", "DecodeState", "Engine", "EngineSpec",
    "Scalars", "SeqInput", "SeqOutput", "StepCache", "StepCachePool", "StepSet", "abstract_split",
    "cache_spec", "default_compile_threads", "expert_spec", "merge_params", "ring_chunk",
    "slot_layout", "split_params", "state_bytes_per_worker", "state_shapes",
]
