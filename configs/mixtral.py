"""Rollout config: `python -m flexfloor_jax.rollout --config=configs/mixtral.py[:preset]`.

Presets: tiny (default; runs on a laptop CPU with emulated devices), 8x7b, 8x22b (TPU/GPU with a
checkpoint). Override any field with --config.section.field=value.

Fields this file does not set take the schema's default (flexfloor_jax/config/settings.py, where
each field's type, bounds and doc are written): the paged KV fields, the workload, the
scheduler's placement, slack and cost models, ...
"""

import ml_collections

from flexfloor_jax.config.settings import defaults_config
from flexfloor_jax.model.config import PRESETS as MODEL_PRESETS

# The Mixtral family's model presets (flexfloor_jax/model/config.py lists every preset)
PRESETS = tuple(k for k, v in MODEL_PRESETS.items() if v.family == "mixtral")


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  preset = preset or "tiny"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for configs/mixtral.py; choose one of {PRESETS}")
  c = defaults_config()  # every section, at the schema's defaults
  c.preset = preset

  c.model.checkpoint = ""  # '' = random init | Hugging Face Mixtral dir | orbax dir
  c.model.dtype = "float32" if preset == "tiny" else "bfloat16"
  # MoE kernels: 'auto' (Pallas on TPU and CUDA GPUs, XLA on CPU, where the XLA path is the fast
  # one) | 'xla' | 'pallas' (on CPU in interpret mode: a parity check, slow)
  c.model.moe_backend = "auto"
  # model.attention_backend (schema default 'xla'): 'pallas' = JAX's paged-attention kernels
  # (Mosaic TPU, Triton on CUDA GPUs; on CPU interpreted, a parity check; no sliding window; the
  # TPU kernel reads k/v as bfloat16)
  # KV cache length (prompt + response); 0 = what the run needs: the longest prompt +
  # rollout.max_new_tokens, capped by the model's max_position_embeddings
  c.model.max_seq_len = 0
  c.model.init_seed = 0  # random init only
  c.model.init_scale = 0.1  # std of random init (large enough that logits are not flat)
  # model.exchange (schema default 'auto'): 'all_to_all' (capacity tokens*top_k per destination)
  # | 'ragged' (routed rows only)

  c.mesh.num_devices = 0  # workers: 0 = all devices
  c.mesh.device_memory_gb = 0.0  # per-device budget; 0 = from the device's memory stats, else 16

  c.rollout.prompts = ""  # '' = built-in prompt set | JSONL of {"id", "prompt"} or {"id", "tokens"}
  c.rollout.num_prompts = 8  # size of the built-in prompt set
  c.rollout.samples_per_prompt = 8  # GRPO group size (samples adjacent in the batch)
  c.rollout.max_new_tokens = 256 if preset == "tiny" else 2048
  c.rollout.max_prompt_len = 48 if preset == "tiny" else 1024  # prefill width
  c.rollout.slots_per_worker = 4  # decode slots per worker (same for every schedule)
  c.rollout.lengths = "auto"  # 'model' | 'workload' | lengths JSONL; auto: workload w/o checkpoint
  c.rollout.epoch = 0  # workload epoch / RL step (keys sampling, drives length history)
  c.rollout.steps_per_dispatch = 8  # decode steps per device dispatch (host checks in between)
  # Mesh sizes compile in background threads; a release never waits for one (until a size is
  # ready the group does not shrink to it; summary.json counts the steps that held back).
  # True: compile every size and mover before the first step (reproducible: benchmarks, tests).
  c.rollout.wait_compiles = False
  # rollout.wait_plan_compiles (schema default true): compile, and wait for, only the sizes the
  # plan expects to reach (every size down to the floor while the length history is empty); a
  # release to another size is held (and reported). False: none is waited for.
  c.rollout.output_dir = "rollout_out"
  # rollout.kv (schema default 'slots'): 'paged' = a pool of pages per worker: sequences take
  # pages as they grow, admission by memory, the youngest preempted and recomputed when a pool
  # runs out (flexfloor_jax/policy/pages.py; rollout.page_size, max_seqs_per_worker, kv_pages,
  # kv_margin)

  # rollout.lengths='workload': synthetic long-tailed lengths (flexfloor_jax/policy/workload.py)
  # from the workload section (sigma, median, epoch_noise, sample_noise: the schema's defaults)

  c.sampling.temperature = 1.0  # 0 = greedy
  c.sampling.top_p = 1.0
  c.sampling.top_k = 0  # 0 = off
  c.sampling.seed = 0

  # 'static' (verl-like baseline) | 'balanced' (longest predicted first onto the least-loaded
  # worker, shared queue, full width, no release: the strong baseline) | 'flexfloor'
  c.schedule = "flexfloor"

  c.scheduler.history_path = ""  # length history file; '' = <output_dir>/history.json
  c.scheduler.compaction = True  # migrate stragglers off workers that could be released
  # scheduler.placement (schema default 'auto': length-aware placement on the release chain);
  # 'balanced' = balanced's placement and shared queue, with release (where a release rarely
  # pays in seconds); 'static' = the baseline's placement kept (flexfloor then releases, and
  # compacts when scheduler.compaction, but never reorders work)
  # active-group sizes a release may leave, one compiled executable set each: '' = every size
  # down to the floor | 'pow2' | a comma list, e.g. '48,32,16' (large pods: fewer compiles)
  # tiny: 5 sizes (8, 6, 4, 2, 1) instead of 8 keep a first run's compiles short on a small CPU
  # machine, for slightly fewer tokens per device-step than every size (README, Performance)
  c.scheduler.release_sizes = "6,4,2" if preset == "tiny" else ""
  # scheduler.makespan_slack: flexfloor's makespan may exceed the balanced schedule's
  # predicted makespan by this fraction, in exchange for less device time.
  # scheduler.step_cost: what placement, admission and releases decide in: 'measured' (the
  # engine's decode-step seconds per group size, kept in the history: the time-aware floor) |
  # 'steps' | 'roofline:MODEL@HARDWARE' | 'auto' (measured on TPU/GPU; on emulated CPU devices,
  # whose step times depend on the host's load, the roofline of scheduler.cost_model, the
  # full-size pair this config stands for)
  return c
