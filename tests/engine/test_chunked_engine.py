"""Chunked prefill in the engine: prompts ride in decode steps, a chunk of input tokens per step
per worker, and a sampled response does not depend on the schedule, the mesh size or the chunk
size (one compiled bound, rollout.max_prefill_chunk, for both chunks), with releases and
migrations; against the one-shot prefill, log-probs within 1e-5."""

import engine_utils
import jax
import numpy as np
import pytest

from flexfloor_jax.rollout import runner

BOUND = 32  # the compiled bound of both chunks: the tiny prompts hold 15-33 tokens
CHUNKS = (16, 32)  # one page and two: prompts of 17-33 tokens span two or three steps


def _config(preset: str, kv: str, tmp_path, release_sizes: str = "2"):
  c = engine_utils.rollout_config()
  c.preset = preset
  c.rollout.kv = kv
  c.scheduler.release_sizes = release_sizes
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  c.rollout.max_prefill_chunk = BOUND
  return c


def _run(c, model, tmp_path, name, step_caches, *, schedule, workers, chunk):
  cfg, params = model
  c.schedule = schedule
  c.mesh.num_devices = workers
  c.rollout.prefill_chunk = chunk
  if not chunk:
    c.rollout.max_prefill_chunk = 0
  c.rollout.output_dir = str(tmp_path / name)
  return runner.run(c, params=params, model_cfg=cfg, write_outputs=False, progress=False,
                    step_cache=step_caches)


@pytest.fixture
def step_caches():
  """A StepCachePool of this file's own, emptied after each test with JAX's caches: its chunked
  executables (another width for every spec) are used nowhere else, and a pytest process that
  kept them beside every other file's reaches the kernel's limit on memory maps
  (vm.max_map_count) and is killed."""
  from flexfloor_jax import engine
  yield engine.StepCachePool()
  jax.clear_caches()


def _by_key(res):
  return {(r["prompt_id"], r["sample"]): r for r in res.responses}


@pytest.mark.parametrize("preset,kv,sizes", [("tiny", "slots", "6,4,2"),
                                             ("qwen3-tiny", "paged", "2")])
def test_responses_identical_across_schedules_meshes_and_chunks(preset, kv, sizes, tmp_path,
                                                                step_caches):
  """Sampled (temperature 1, top-p 0.9): static on 8 workers with chunks of 16, flexfloor on 8
  (releasing to 2 and 1, migrating live sequences) with chunks of 32, balanced on 3 with 16 and
  static on 1 with 32 give every response's tokens and log-probs bit for bit; no step ran input
  tokens without decoding while a row was live."""
  model = engine_utils.family_model(preset)
  c = _config(preset, kv, tmp_path, sizes)
  runs = {name: _run(c, model, tmp_path, name, step_caches, schedule=s, workers=n, chunk=ch)
          for name, s, n, ch in (("static8", "static", 8, CHUNKS[0]),
                                 ("flex8", "flexfloor", 8, CHUNKS[1]),
                                 ("balanced3", "balanced", 3, CHUNKS[0]),
                                 ("static1", "static", 1, CHUNKS[1]))}
  ref = _by_key(runs["static8"])
  assert len(ref) == 16 and len({t for r in ref.values() for t in r["tokens"]}) > 20
  for name, res in runs.items():
    got = _by_key(res)
    assert got.keys() == ref.keys(), name
    for k in ref:
      assert got[k]["tokens"] == ref[k]["tokens"], (name, k)
      assert got[k]["logprobs"] == ref[k]["logprobs"], (name, k)
    assert res.summary["prefill_only_steps_while_decoding"] == 0, name
  flex = runs["flex8"]
  assert [r for r in flex.timeline.releases if not r.get("final")], "no release"
  moved = sum(len(m["moves"]) for m in flex.timeline.migrations)
  print(f"{preset}/{kv}: {moved} live sequences migrated")
  assert moved, "no live sequence migrated"
  a, b = ref, _by_key(flex)
  assert sum(a[k]["worker"] != b[k]["worker"] for k in a) > 0, "same placement: proves nothing"


def test_chunked_log_probs_match_the_one_shot_prefill(tmp_path, step_caches):
  """The same rollout with one-shot prefill steps: the same tokens, log-probs within 1e-5 (a
  prompt token's attention runs as a one-token query over the cache instead of the prompt's
  own causal attention), and the one-shot run stalls live rows in prefill steps."""
  model = engine_utils.family_model("tiny")
  c = _config("tiny", "slots", tmp_path)
  chunked = _run(c, model, tmp_path, "chunked", step_caches, schedule="static", workers=8,
                 chunk=CHUNKS[0])
  c = _config("tiny", "slots", tmp_path)
  one_shot = _run(c, model, tmp_path, "one_shot", step_caches, schedule="static", workers=8,
                  chunk=0)
  a, b = _by_key(one_shot), _by_key(chunked)
  assert a.keys() == b.keys()
  worst = 0.0
  for k in a:
    assert a[k]["tokens"] == b[k]["tokens"], k
    worst = max(worst, float(np.max(np.abs(np.subtract(a[k]["logprobs"], b[k]["logprobs"])))))
  assert worst <= 1e-5, worst
  assert one_shot.summary["prefill_only_steps_while_decoding"] > 0
  assert chunked.summary["prefill_only_steps_while_decoding"] == 0


@pytest.mark.parametrize("preset,kv", [("gpt-oss-tiny", "slots"), ("deepseek-v3-tiny", "paged")])
def test_ring_and_latent_caches_take_chunks(preset, kv, tmp_path, step_caches):
  """The other families: GPT-OSS's sliding layers (rings of window + chunk - 1 positions) and
  DeepSeek-V3's latent cache take the same chunks: static with chunks of 16 and flexfloor (with
  releases) with 32 give the same tokens and log-probs, bit for bit."""
  model = engine_utils.family_model(preset)
  c = _config(preset, kv, tmp_path)
  static = _run(c, model, tmp_path, "static", step_caches, schedule="static", workers=8,
                chunk=CHUNKS[0])
  flex = _run(c, model, tmp_path, "flex", step_caches, schedule="flexfloor", workers=8,
              chunk=CHUNKS[1])
  a, b = _by_key(static), _by_key(flex)
  assert a.keys() == b.keys() and len(a) == 16
  for k in a:
    assert a[k]["tokens"] == b[k]["tokens"], k
    assert a[k]["logprobs"] == b[k]["logprobs"], k
  assert [r for r in flex.timeline.releases if not r.get("final")], "no release"
