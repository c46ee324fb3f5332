"""The memory floor's terms, from the shapes the engine allocates (no memory allocated).

  python -m flexfloor_jax.memory [--preset 8x7b] [--device_memory_gb 80] [--workers 8]

Bytes one device of the active group holds:
- experts: `expert_slots` slots of one expert each (all layers of w1, w3, w2), preallocated for
  the floor, the same on every mesh size;
- non-expert: every other weight, replicated;
- KV: the KV caches of the worker's decode slots and their slot state (tokens, log-probs, ...);
- workspace: what a release or a migration holds in flight on a device. elastic.move_on_devices
  moves in rounds that touch a device at most once as source and once as destination, one expert
  slot (or one sequence row: KV + slot state) each way; dispatch is asynchronous, so a round's rows may
  still be alive when the next one's arrive: 2 expert slots + 2 sequence rows.
XLA's temporaries inside a compiled step are not live arrays and are not counted here (on a device,
`compiled.memory_analysis()` reports them).

The runner takes the floor from these terms, and tests/test_elastic.py checks them against the
bytes that `jax.live_arrays()` shows on each device at every mesh size of the tiny preset.
"""

from __future__ import annotations

import dataclasses
import math

from flexfloor_jax.policy import footprint
from flexfloor_jax.policy.floor import FloorError, floor_workers


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
  import jax
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def floor_terms(model_cfg, slots_per_worker: int, max_seq_len: int, max_new_tokens: int,
                record_routes: bool = False) -> FloorTerms:
  """The terms from the shapes of the model's parameters and of the engine's per-worker arrays."""
  import jax

  from flexfloor_jax import engine as engine_lib
  from flexfloor_jax.model import transformer as tfm

  # shapes without tracing (the runner computes the floor before every input check has passed);
  # tests/test_presets.py checks them against jax.eval_shape of the init
  params = tfm.param_shapes(model_cfg)
  rest, experts = engine_lib.split_params(params)
  expert = _nbytes(experts) // model_cfg.num_experts
  dt = tfm.dtype_of(model_cfg)
  kv_row = 2 * model_cfg.num_layers * max_seq_len * model_cfg.num_kv_heads * model_cfg.head_dim \
      * jax.numpy.dtype(dt).itemsize
  state = engine_lib.state_bytes_per_worker(model_cfg, slots_per_worker, max_seq_len,
                                            max_new_tokens, record_routes)
  kv = slots_per_worker * kv_row + state
  row = kv_row + state // slots_per_worker
  return FloorTerms(expert=expert, nonexpert=_nbytes(rest), kv=kv, workspace=2 * expert + 2 * row)


def terms_for_config(config, model_cfg, max_seq_len: int | None = None) -> FloorTerms:
  """The floor's terms of a config; rollout.kv='paged': KV = the page pool + the state of its
  max_seqs rows, and a sequence row in flight = a full sequence's pages + its state."""
  r = config.rollout
  seq = max_seq_len or config.model.max_seq_len
  t = floor_terms(model_cfg, r.slots_per_worker, seq, r.max_new_tokens, r.record_routes)
  if getattr(r, "kv", "slots") != "paged":
    return t
  from flexfloor_jax import engine as engine_lib
  from flexfloor_jax.policy import kv_pool
  from flexfloor_jax.policy.pages import pages_for
  per_token = (t.kv - engine_lib.state_bytes_per_worker(
      model_cfg, r.slots_per_worker, seq, r.max_new_tokens, r.record_routes)) // (
          r.slots_per_worker * seq)
  state = engine_lib.state_bytes_per_worker(model_cfg, r.max_seqs, seq, r.max_new_tokens,
                                            r.record_routes)
  pool = kv_pool.pages_per_worker(r, seq) * r.page_size * per_token
  row = pages_for(seq, r.page_size) * r.page_size * per_token + state // r.max_seqs
  return dataclasses.replace(t, kv=pool + state, workspace=2 * t.expert + 2 * row)


def main(argv=None):
  import argparse

  from flexfloor_jax import cli
  from flexfloor_jax.model.config import PRESETS

  p = argparse.ArgumentParser(description="The memory floor of a configs/mixtral.py preset.")
  p.add_argument("--preset", default="8x7b", choices=sorted(PRESETS))
  p.add_argument("--device_memory_gb", type=float, default=0.0,
                 help="per-device budget (default: the preset's mesh.device_memory_gb, else 16)")
  p.add_argument("--workers", type=int, default=8)
  args = p.parse_args(argv)
  config = cli.load_config("mixtral", args.preset)
  model_cfg = PRESETS[config.preset].replace(dtype=config.model.dtype)
  seq_len = config.model.max_seq_len or (config.rollout.max_prompt_len
                                         + config.rollout.max_new_tokens)
  t = terms_for_config(config, model_cfg, seq_len)
  gib = 2.0**30
  n = args.workers
  mem = args.device_memory_gb or config.mesh.device_memory_gb or 16.0
  e = model_cfg.num_experts
  print(f"{config.preset} ({model_cfg.dtype}): {e} experts, {config.rollout.slots_per_worker} "
        f"decode slots x {seq_len} tokens per worker, {n} workers, {mem:g} GiB per device")
  print(f"  expert slot  {t.expert / gib:9.3f} GiB  (one expert, all layers)")
  print(f"  non-expert   {t.nonexpert / gib:9.3f} GiB")
  print(f"  KV           {t.kv / gib:9.3f} GiB  (KV caches + slot state of one worker)")
  print(f"  workspace    {t.workspace / gib:9.3f} GiB  (2 expert slots + 2 sequence rows in flight)")
  try:
    floor = t.floor(e, int(mem * gib), n)
  except FloorError as err:
    print(f"  no floor: {err}")
    return
  slots = footprint.expert_slots(e, floor)
  print(f"  floor: {floor} workers, {slots} expert slots each: {t.per_device(slots) / gib:.3f} GiB "
        f"per device = non-expert + {slots} x expert + KV + workspace")


if __name__ == "__main__":
  main()
