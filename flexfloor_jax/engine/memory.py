"""The memory floor's terms, from the shapes the engine allocates (no memory allocated).

Bytes one device of the active group holds:
- experts: `expert_slots` slots of one expert each (all layers of w1, w3, w2), preallocated for
  the floor, the same on every mesh size;
- non-expert: every other weight, replicated;
- KV: the KV caches of the worker's decode slots and their slot state (tokens, log-probs, ...);
  a sliding layer whose window is shorter than a sequence holds only its window (a ring per
  sequence row, transformer.KVLayout), every other layer every position;
- workspace: what a release or a migration holds in flight on a device. elastic.move_on_devices
  moves in rounds that touch a device at most once as source and once as destination, one expert
  slot (or one sequence row: KV + slot state) each way; dispatch is asynchronous, so a round's rows
  may still be alive when the next one's arrive: 2 expert slots + 2 sequence rows.
XLA's temporaries inside a compiled step are not live arrays and are not counted here (on a device,
`compiled.memory_analysis()` reports them).

The runner takes the floor from these terms, and tests/engine/test_elastic.py checks them against
the bytes that `jax.live_arrays()` shows on each device at every mesh size of the tiny preset.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.policy.floor import floor_workers


@dataclasses.dataclass(frozen=True)
class FloorTerms:
  expert: int  # one expert slot, all layers
  nonexpert: int
  kv: int  # one worker: KV caches + slot state
  workspace: int

  def resident(self, expert_slots: int) -> int:
    """Bytes a device holds between releases with `expert_slots` slots."""
    return self.nonexpert + expert_slots * self.expert + self.kv

  def per_device(self, expert_slots: int) -> int:
    return self.resident(expert_slots) + self.workspace

  def floor(self, num_experts: int, device_memory_bytes: int, max_workers: int) -> int:
    return floor_workers(num_experts, self.expert, self.nonexpert, self.kv,
                         device_memory_bytes, max_workers, workspace_bytes=self.workspace)


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=64)  # eval_shape traces: a rollout asks for the same config again
def kv_bytes(model_cfg, max_seq_len: int, chunk: int = 1) -> tuple[int, int]:
  """(bytes per token of the layers that keep every position, bytes of one sequence row's rings:
  the sliding layers' windows) of a cache of max_seq_len positions, from the shapes of one row of
  the engine's cache (transformer.KVCache.zeros, its layout as the engine allocates it). A
  fixed-slot row holds max_seq_len x the first + the second; a paged pool pages the first and
  keeps the second per sequence row. `chunk`: chunked prefill's query rows per step (a ring
  then holds window + chunk - 1 positions)."""
  row = jax.eval_shape(lambda: tfm.KVCache.zeros(model_cfg, 1, max_seq_len, chunk=chunk))
  rings = (row.k_ring, row.v_ring) if row.k_ring is not None else ()
  return _nbytes((row.k, row.v)) // max_seq_len, _nbytes(rings)


def floor_terms(model_cfg, slots_per_worker: int, max_seq_len: int, max_new_tokens: int,
                record_routes: bool = False, chunk: int = 1) -> FloorTerms:
  """The terms from the shapes of the model's parameters and of the engine's per-worker arrays."""
  # shapes without tracing (the runner computes the floor before every input check has passed);
  # tests/model/test_presets.py checks them against jax.eval_shape of the init
  params = tfm.param_shapes(model_cfg)
  rest, experts = engine_lib.split_params(params)
  expert = _nbytes(experts) // model_cfg.num_experts
  per_token, rings = kv_bytes(model_cfg, max_seq_len, chunk)
  kv_row = per_token * max_seq_len + rings
  state = engine_lib.state_bytes_per_worker(model_cfg, slots_per_worker, max_seq_len,
                                            max_new_tokens, record_routes)
  kv = slots_per_worker * kv_row + state
  row = kv_row + state // slots_per_worker
  return FloorTerms(expert=expert, nonexpert=_nbytes(rest), kv=kv, workspace=2 * expert + 2 * row)
