"""The engine keeps a GPT-OSS sliding layer's KV as a ring of its window, with fixed slots and on
the paged pool (transformer.KVLayout): the arrays it allocates for that layer are window-sized,
the memory floor counts the window only, and responses that run past three windows are the same
whichever store holds them, recomputed after a preemption or moved by a migration; their
log-probs are the full forward's (no cache at all)."""

import dataclasses

import engine_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexfloor_jax.config import settings
from flexfloor_jax.engine import memory
from flexfloor_jax.engine import state as state_lib
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.rollout import inputs, runner

# tests/engine/test_families_engine.py's GPT-OSS model (shared compiles): a sliding layer 0
# (window 16) and a full layer 1
MODEL = PRESETS["gpt-oss-tiny"].replace(num_layers=2, sliding_layers=(0,))
WINDOW = 16
LOGPROB_TOL = 1e-5  # fp32: the engine's cached decode vs the forward, two summation orders


@pytest.fixture(scope="module")
def params():
  return tfm.init_params(MODEL, jax.random.key(5), scale=0.1)


def run(c, params, tmp_path, name, step_caches):
  c.rollout.output_dir = str(tmp_path / name)
  return runner.run(c, params=params, model_cfg=MODEL, write_outputs=False, progress=False,
                    step_cache=step_caches)


def by_key(res):
  return {(r["prompt_id"], r["sample"]): r for r in res.responses}


def greedy_config(tmp_path, length: int):
  """rollout_config() on the GPT-OSS model, static, greedy, every response `length` tokens."""
  c = engine_utils.rollout_config()
  c.preset = "gpt-oss-tiny"
  c.schedule = "static"
  c.scheduler.release_sizes = "4,2"  # test_families_engine.py's
  c.sampling.temperature = 0.0
  path = tmp_path / "lengths.jsonl"
  with open(path, "w") as f:
    for i in range(c.rollout.num_prompts):
      for j in range(c.rollout.samples_per_prompt):
        f.write(f'{{"id": "builtin-{i}", "sample": {j}, "length": {length}}}\n')
  c.rollout.lengths = str(path)
  return c


def test_engine_arrays_hold_the_window_of_a_sliding_layer():
  """The decode state the engine allocates (state_shapes: what Engine and StepSet build):
  fixed slots keep layer 1 at every one of max_seq_len positions and layer 0 in a ring of 16;
  the paged pool pages layer 1 only and keeps layer 0's rings per sequence row. The floor's KV
  counts 96 + 16 positions per row of one layer each, not 2 x 96 (hand-computed: K and V of 2
  kv heads x 32 dims in fp32 = 512 bytes per layer and position)."""
  spec = engine_utils.rollout_spec(MODEL)
  b, s, kv = spec.slots_per_worker, spec.max_seq_len, (MODEL.num_kv_heads, MODEL.head_dim)
  st = state_lib.state_shapes(spec, 8)
  fixed = st.as_dict()
  assert fixed["k"].shape == fixed["v"].shape == (1, 8 * b, s, *kv)
  assert fixed["k_ring"].shape == fixed["v_ring"].shape == (1, 8 * b, WINDOW, *kv)
  assert st.ring_layers == (0,)
  pspec = dataclasses.replace(spec, kv="paged", num_pages=12, slots_per_worker=4)
  pt = state_lib.state_shapes(pspec, 8)
  pool = pt.as_dict()
  assert "k" not in pool
  assert pool["k_pages"].shape == (1, MODEL.num_kv_heads, 8 * 12, 16, MODEL.head_dim)
  assert pool["k_ring"].shape == (1, 8 * 4, WINDOW, *kv)
  assert set(pt.row_dict()) >= {"k_ring", "v_ring"} and set(pt.page_dict()) == {"k_pages",
                                                                                 "v_pages"}
  per_pos = 2 * 2 * 32 * 4
  assert memory.kv_bytes(MODEL, 96) == (96 * per_pos // 96, WINDOW * per_pos)
  state2 = state_lib.state_bytes_per_worker(MODEL, 2, 96, 32)
  assert memory.floor_terms(MODEL, 2, 96, 32).kv == 2 * (96 + 16) * per_pos + state2
  # paged: 12 pages of 16 positions of layer 1, and layer 0's ring for each of the 4 rows
  c = engine_utils.rollout_config()
  c.rollout.kv = "paged"
  t = inputs.terms_for_config(settings.load(c), MODEL, 96)
  state4 = state_lib.state_bytes_per_worker(MODEL, 4, 96, 32)
  assert t.kv == 12 * 16 * per_pos + 4 * 16 * per_pos + state4


def test_greedy_past_the_window_is_the_same_in_every_store(params, tmp_path, step_caches):
  """Greedy, every response 32 tokens after prompts of 15-33 (47-65 positions: 2.9-4 windows):
  the paged pool's tokens equal the fixed slots', and a pool too small for two sequences
  (preempted rows recomputed: their rings refilled by the resume prefill) gives them too;
  log-probs within 1e-5 of each other and of the full forward of prompt + response, whose
  greedy token is the engine's wherever its top-2 margin is clear."""
  c = greedy_config(tmp_path, 32)
  slots = run(c, params, tmp_path, "slots", step_caches)
  c.rollout.kv = "paged"
  paged = run(c, params, tmp_path, "paged", step_caches)
  c.rollout.kv_pages = 6  # one longest sequence (96 tokens) per worker
  small = run(c, params, tmp_path, "small", step_caches)
  assert small.summary["preemptions"] > 0
  a = by_key(slots)
  for other in (paged, small):
    b = by_key(other)
    assert a.keys() == b.keys() and len(a) == 16
    for k in a:
      assert a[k]["tokens"] == b[k]["tokens"], k
      np.testing.assert_allclose(b[k]["logprobs"], a[k]["logprobs"], rtol=0, atol=LOGPROB_TOL)
  forward = jax.jit(lambda p, t: tfm.forward(p, MODEL, t)[0])
  prep = runner.prepare(settings.load(c), devices=jax.devices()[:8], model_cfg=MODEL)
  prompt_tokens = {p.prompt_id: list(p.tokens) for p in prep.prompts}
  d_lp, compared, ends = 0.0, 0, []
  for k, r in a.items():
    prompt = prompt_tokens[k[0]]
    seq = prompt + r["tokens"]
    ends.append(len(seq))
    logits = np.asarray(forward(params, jnp.asarray([seq], jnp.int32)))[0, len(prompt) - 1:-1]
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    d_lp = max(d_lp, float(np.abs(lp[np.arange(len(r["tokens"])), r["tokens"]]
                                  - np.asarray(r["logprobs"])).max()))
    top2 = np.sort(logits, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4
    compared += int(clear.sum())
    assert (np.argmax(logits, -1) == r["tokens"])[clear].all(), k
  print(f"sliding window {WINDOW}: sequences of {min(ends)}-{max(ends)} positions; engine vs "
        f"forward log-prob max|diff| {d_lp:.3g}; {compared} greedy tokens compared; "
        f"{small.summary['preemptions']} preemptions")
  assert min(ends) > 2.9 * WINDOW and compared >= 0.95 * 16 * 32
  assert d_lp <= LOGPROB_TOL


def test_paged_migration_moves_the_rings(params, tmp_path, step_caches):
  """Paged KV, sampled, long-tailed: flexfloor (releases, live sequences migrated with their
  pages and their rings) gives static's tokens and log-probs bit for bit; a migration's bytes
  are whole pages of layer 1 plus one ring of layer 0 per moved row."""
  c = engine_utils.rollout_config()
  c.preset = "gpt-oss-tiny"
  c.rollout.kv = "paged"
  c.scheduler.release_sizes = "2"
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  c.schedule = "static"
  static = run(c, params, tmp_path, "static", step_caches)
  c.schedule = "flexfloor"
  flex = run(c, params, tmp_path, "flex", step_caches)
  a, b = by_key(static), by_key(flex)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k]["tokens"] == b[k]["tokens"], k
    assert a[k]["logprobs"] == b[k]["logprobs"], k
  assert sum(a[k]["worker"] != b[k]["worker"] for k in a) > 0
  moved = [m for m in flex.timeline.migrations if m["moves"]]
  assert moved, "no live sequence migrated: the rings' move went untested"
  per_pos = 2 * MODEL.num_kv_heads * MODEL.head_dim * 4
  page, ring = 16 * per_pos, WINDOW * per_pos
  for m in moved:
    assert (m["kv_bytes"] - len(m["moves"]) * ring) % page == 0
    assert m["kv_bytes"] > len(m["moves"]) * ring
