"""Speculative decoding in the engine: drafted tokens verified in the workers' free decode rows
leave every response's tokens and log-probs bit for bit those of plain decoding (sampled at
temperature 1, top-p 0.9), on any schedule, mesh size and KV layout, with releases and
migrations; only the steps they take change.

The drafts come from the real path: a response store holding this epoch's plain responses with
every fifth token changed, so that drafts are long and right up to a changed token and wrong
there (both acceptance and rejection happen in every run)."""

import engine_utils
import jax
import numpy as np
import pytest

from flexfloor_jax.policy.drafts import ResponseStore
from flexfloor_jax.rollout import runner

DRAFT = 4


def _config(preset: str, kv: str, tmp_path, release_sizes: str = "2"):
  c = engine_utils.rollout_config()
  c.preset = preset
  c.rollout.kv = kv
  c.rollout.slots_per_worker = 4  # free rows beside the live ones: where drafts are verified
  c.scheduler.release_sizes = release_sizes
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  return c


def _run(c, model, tmp_path, name, step_caches, *, schedule, workers, draft, store=None):
  cfg, params = model
  c.schedule = schedule
  c.mesh.num_devices = workers
  c.rollout.draft_tokens = draft
  c.rollout.output_dir = str(tmp_path / name)
  return runner.run(c, params=params, model_cfg=cfg, write_outputs=False, progress=False,
                    step_cache=step_caches, response_store=store)


@pytest.fixture
def step_caches():
  """A StepCachePool of this file's own, emptied with JAX's caches after each test (as in
  test_chunked_engine.py: the process's memory maps are bounded)."""
  from flexfloor_jax import engine
  yield engine.StepCachePool()
  jax.clear_caches()


def _by_key(res):
  return {(r["prompt_id"], r["sample"]): r for r in res.responses}


def _store(plain) -> ResponseStore:
  """An earlier epoch that wrote what this one writes, but every fifth token."""
  store = ResponseStore("byte")
  rows = []
  for r in plain.responses:
    t = np.asarray(r["tokens"], np.int64).copy()
    t[4::5] = (t[4::5] + 1) % 256
    rows.append((r["prompt_id"], r["sample"], t))
  store.add_rollout(0, rows)
  return store


def _same(ref, res, name):
  got = _by_key(res)
  assert got.keys() == ref.keys(), name
  for k in ref:
    assert got[k]["tokens"] == ref[k]["tokens"], (name, k)
    assert got[k]["logprobs"] == ref[k]["logprobs"], (name, k)
  s = res.summary
  assert s["draft_tokens"] == DRAFT
  # the step simulator, drafting as the engine did and confirming drafts by the responses,
  # replays the run step for step
  assert s["seconds"]["replay_matches_run"], name
  return s


@pytest.mark.parametrize("preset,kv,sizes", [("tiny", "slots", "6,4,2"),
                                             ("tiny", "paged", "2"),
                                             ("qwen3-tiny", "paged", "2")])
def test_drafting_keeps_every_token(preset, kv, sizes, tmp_path, step_caches):
  """Plain static decoding on 8 workers against drafting on 8 (static, and flexfloor releasing
  and migrating live sequences), on 3 (balanced) and on 1 (static): the same tokens and
  log-probs, bit for bit, in fewer steps."""
  model = engine_utils.family_model(preset)
  c = _config(preset, kv, tmp_path, sizes)
  plain = _run(c, model, tmp_path, "plain", step_caches, schedule="static", workers=8, draft=0)
  ref = _by_key(plain)
  assert len(ref) == 16 and len({t for r in ref.values() for t in r["tokens"]}) > 20
  runs = [("static8", "static", 8), ("flex8", "flexfloor", 8), ("balanced3", "balanced", 3)]
  if kv == "slots":
    runs.append(("static1", "static", 1))
  for name, schedule, n in runs:
    res = _run(c, model, tmp_path, name, step_caches, schedule=schedule, workers=n, draft=DRAFT,
               store=_store(plain))
    s = _same(ref, res, name)
    if n > 1:  # one worker has free rows only at the end, when its queue is empty
      assert s["accepted_tokens"] > 0 and s["rejected_tokens"] > 0, (name, s["drafted_tokens"])
    print(f"{preset}/{kv} {name}: {s['drafted_tokens']} drafted, {s['accepted_tokens']} "
          f"accepted, {s['device_steps']} device-steps")
    if name == "static8":
      assert s["device_steps"] < plain.summary["device_steps"]
    if name == "flex8":
      assert [r for r in res.timeline.releases if not r.get("final")], "no release"
      assert sum(len(m["moves"]) for m in res.timeline.migrations), "no live migration"


def test_other_family_with_rings(tmp_path, step_caches):
  """GPT-OSS: sliding layers whose rings hold window + draft_tokens positions; static and
  flexfloor with drafting give plain decoding's tokens and log-probs."""
  model = engine_utils.family_model("gpt-oss-tiny")
  c = _config("gpt-oss-tiny", "slots", tmp_path)
  plain = _run(c, model, tmp_path, "plain", step_caches, schedule="static", workers=8, draft=0)
  ref = _by_key(plain)
  for name, schedule in (("static8", "static"), ("flex8", "flexfloor")):
    s = _same(ref, _run(c, model, tmp_path, name, step_caches, schedule=schedule, workers=8,
                        draft=DRAFT, store=_store(plain)), name)
    assert s["accepted_tokens"] > 0 and s["rejected_tokens"] > 0, (name, s["drafted_tokens"])
