"""`python -m flexfloor_jax.memory [--preset 8x7b] [--device_memory_gb 80] [--workers 8]`: the
memory floor of a model preset, term by term (flexfloor_jax.engine.memory), with the rollout
fields of its family's config file (configs/<family>.py: mixtral.py for 8x7b, qwen3_moe.py for
qwen3-30b-a3b, deepseek_v3.py for deepseek-v3), and the KV bytes per token the floor's KV term
is made of (a latent cache's for multi-head latent attention)."""

import argparse
import dataclasses

import jax.numpy as jnp

from flexfloor_jax.config import files, schema
from flexfloor_jax.config.cli import fail
from flexfloor_jax.config.reader import ConfigError
from flexfloor_jax.config.settings import MAX_DEVICE_MEMORY_GB
from flexfloor_jax.engine.memory import kv_bytes
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.model.transformer import kv_layout
from flexfloor_jax.policy.floor import FloorError, expert_slots
from flexfloor_jax.rollout import inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryFlags:
  """The command line's flags: type, default, bounds and doc of each (config/schema.py)."""
  preset: str = schema.Choice(tuple(sorted(PRESETS)), default="8x7b", doc="model preset")
  device_memory_gb: float = schema.Num(hi=MAX_DEVICE_MEMORY_GB, default=0.0,
                                       doc="per-device budget, GiB (0: the preset's "
                                       "mesh.device_memory_gb, else 16)")
  workers: int = schema.Int(default=8, doc="workers the floor is computed for")


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one `error:` line, as every entry point's bad input
    fail(message.replace("argument ", ""))


def main(argv=None):
  p = _Parser(description="The memory floor of a model preset.")
  schema.add_arguments(MemoryFlags, p)
  try:
    args = schema.check_flags(MemoryFlags, vars(p.parse_args(argv)))
  except ConfigError as e:
    fail(str(e))
  # a family's config file is named after it (configs/qwen3_moe.py) and takes its presets' names
  config = files.load_config(PRESETS[args.preset].family, args.preset)
  model_cfg = PRESETS[config.preset].replace(dtype=config.model.dtype)
  seq_len = config.model.max_seq_len or (config.rollout.max_prompt_len
                                         + config.rollout.max_new_tokens)
  t = inputs.terms_for_config(config, model_cfg, seq_len)
  gib = 2.0**30
  n = args.workers
  mem = args.device_memory_gb or config.mesh.device_memory_gb or 16.0
  e = model_cfg.num_experts
  print(f"{config.preset} ({model_cfg.dtype}): {e} experts, {config.rollout.slots_per_worker} "
        f"decode slots x {seq_len} tokens per worker, {n} workers, {mem:g} GiB per device")
  print(f"  expert slot  {t.expert / gib:9.3f} GiB  (one expert, all layers)")
  print(f"  non-expert   {t.nonexpert / gib:9.3f} GiB")
  print(f"  KV           {t.kv / gib:9.3f} GiB  (KV caches + slot state of one worker)")
  lay = kv_layout(model_cfg, seq_len)
  per_token, _ = kv_bytes(model_cfg, seq_len)
  heads, kd, vd = model_cfg.kv_dims()
  size = jnp.dtype(model_cfg.dtype).itemsize
  what = (f"({kd} latent + {vd} RoPE key) values" if model_cfg.mla
          else f"{heads} KV heads x ({kd} + {vd}) values")
  print(f"               ({per_token:,} bytes per token = {len(lay.full_layers)} layers x {what} "
        f"x {size} bytes)")
  if lay.ring_layers:
    print(f"               ({len(lay.ring_layers)} sliding layers keep their {lay.ring_len}-token "
          f"window, {len(lay.full_layers)} full layers all {seq_len} tokens)")
  print(f"  workspace    {t.workspace / gib:9.3f} GiB  "
        "(2 expert slots + 2 sequence rows in flight)")
  try:
    floor = t.floor(e, int(mem * gib), n)
  except FloorError as err:
    print(f"  no floor: {err}")
    return
  slots = expert_slots(e, floor)
  print(f"  floor: {floor} workers, {slots} expert slots each: {t.per_device(slots) / gib:.3f} GiB "
        f"per device = non-expert + {slots} x expert + KV + workspace")


if __name__ == "__main__":
  main()
