"""Benchmark config: `python -m flexfloor_jax.bench --config=configs/bench.py`.

Every field of configs/mixtral.py's tiny preset (the same workload parameters, slots per worker
and cache length: the bench measures the main job, it does not retune it), plus the bench's own:
output_dir, epochs, repeats, release_only, cost_model, seeds, draft_tokens. Override any
field with --config.section.field=value.
"""

import ml_collections

from flexfloor_jax.config.files import load_config


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  c = load_config("mixtral", preset or "tiny")
  # The runner's flexfloor placement: 'auto' = length-aware scheduler, 'static' = the baseline's
  # contiguous chunks with release on (the "release alone" measurement). The bench sets it per run.
  c.scheduler.placement = "auto"
  # Releases must not depend on when background compiles finish: compile every mesh size first.
  c.rollout.wait_compiles = True
  c.scheduler.release_sizes = ""  # every size (the tiny preset's default compiles 5 of 8)
  c.rollout.output_dir = "bench_out/rollout"  # unused: the bench writes no per-rollout outputs

  c.output_dir = "bench_out"  # bench.json, bench.png, runs/*.json (timelines, for sim calibration)
  c.epochs = 4  # epochs 0..epochs-1; the length history grows from one epoch to the next
  c.repeats = 1  # runs of each schedule per epoch (machine noise shows in the wall-clock figures)
  c.release_only = True  # also the static placement with release alone, and with compaction
  # The step cost model every run's timeline is replayed on: the roofline of a named full-size
  # model and hardware pair (the tiny model stands for it), 'roofline:MODEL@HARDWARE' of the
  # simulator's presets. Emulated CPU devices share the host's cores: their wall time says
  # nothing about an accelerator's, so the headline is in these seconds.
  c.cost_model = "roofline:mixtral-8x7b@h100"
  # Workload seeds (each sets sampling.seed, which draws the lengths): every epoch runs for each,
  # the headline ratios reported as the median with min and max. '' = sampling.seed alone.
  c.seeds = ""
  # Speculative decoding: also static, balanced and flexfloor with rollout.draft_tokens = this,
  # drafting from the earlier epochs' responses (configs/bench_drafts.py); 0 = not
  c.draft_tokens = 0
  return c
