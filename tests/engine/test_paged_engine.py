"""The engine on a paged KV pool (rollout.kv='paged'): the same tokens as the fixed-slot cache,
the same responses whatever the schedule (releases and migrations move pages), preemption by
recompute that changes no token, and every page back in the pool after a run."""

import engine_utils
import jax
import numpy as np
import pytest

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.config import settings
from flexfloor_jax.engine import state as state_lib
from flexfloor_jax.engine.sampling import SamplingParams
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.pages import PagePool
from flexfloor_jax.rollout import inputs, kv_pool, runner

MODEL = PRESETS["tiny"].replace(num_layers=2)  # test_elastic.py's model: shared compiles


@pytest.fixture(scope="module")
def params():
  return tfm.init_params(MODEL, jax.random.key(3), scale=0.1)


def run(c, params, tmp_path, name, step_caches):
  """runner.run on the session's step caches (conftest.py): a spec that this file or another in
  this process ran already reuses its StepSets."""
  c.rollout.output_dir = str(tmp_path / name)
  return runner.run(c, params=params, model_cfg=MODEL, write_outputs=False, progress=False,
                    step_cache=step_caches)


def by_key(res):
  return {(r["prompt_id"], r["sample"]): r for r in res.responses}


def test_host_layouts_carry_page_tables():
  """The page tables travel as columns of the step's host array, and read back as written."""
  m, b, e = 3, 2, 4
  q = engine_lib.SeqInput(tokens=np.array([5, 6, 7], np.int32), limit=9, stop_eos=True, phash=11,
                          sample=1)
  host = state_lib.prefill_host(8, 2, 0, 1, [(1, 0, q, 2, np.array([4, 0, 9]))], m)
  full = state_lib.with_expert_table(host, np.arange(e))
  assert full.shape[1] == state_lib.host_width("prefill", 8, e, m)
  tokens, cols, e2s, table = state_lib.read_prefill(full, 8, e, m)
  assert table.tolist() == [[0, 0, 0], [4, 0, 9]] and e2s.tolist() == [0, 1, 2, 3]
  assert cols["generated"].tolist() == [0, 2] and cols["slot"].tolist() == [-1, 0]
  assert tokens[1, :3].tolist() == [5, 6, 7] and cols["length"].tolist() == [0, 3]
  tables = np.arange(2 * b * m).reshape(2, b, m)
  full = state_lib.with_expert_table(
      state_lib.decode_host(4, np.ones(2, bool), np.zeros(2, bool), tables), np.arange(e))
  assert full.shape[1] == state_lib.host_width("decode", 8, e, b * m)
  for p in range(2):  # inside a step each worker sees its own row
    h, _, t, _, _ = state_lib.read_decode(full[p:p + 1], e, b, m)
    assert t.tolist() == tables[p].tolist() and int(h["max_steps"]) == 4


def test_pool_size_from_the_config():
  """kv_pages 0 = the fixed-slot cache's bytes; a pool must hold one longest sequence; paged
  migration stays on one process."""
  c = engine_utils.rollout_config()
  c.rollout.kv = "paged"
  r = settings.load(c).rollout
  assert (kv_pool.pages_per_worker(r, 96), r.max_seqs, r.lanes) == (12, 4, 4)
  pool = kv_pool.make_pool(r, 8, 96)
  assert (pool.num_pages, pool.max_pages_per_seq, pool.max_seqs) == (12, 6, 4)
  # the floor counts the pool: the fixed-slot KV bytes, beside the state of 4 rows, not 2
  paged = inputs.terms_for_config(settings.load(c), MODEL, 96)
  c.rollout.kv = "slots"
  slots = inputs.terms_for_config(settings.load(c), MODEL, 96)
  c.rollout.kv = "paged"
  def state(rows):
    return engine_lib.state_bytes_per_worker(MODEL, rows, 96, 32)
  assert paged.kv - state(4) == slots.kv - state(2) > 0
  assert (paged.expert, paged.nonexpert) == (slots.expert, slots.nonexpert)
  c.rollout.kv_pages = 5
  with pytest.raises(settings.ConfigError, match="^rollout.kv_pages=5 .*max_seq_len=96"):
    settings.load(c)
  c.model.max_seq_len = 0  # the runner's length: the pool is checked there
  with pytest.raises(kv_pool.KVPoolError, match="^rollout.kv_pages: .*96"):
    kv_pool.pages_per_worker(settings.load(c).rollout, 96)


def greedy_config():
  c = engine_utils.rollout_config()
  c.schedule = "static"
  c.sampling.temperature = 0.0
  c.rollout.lengths = "model"
  return c


@pytest.fixture(scope="module")
def greedy_slots(params, tmp_path_factory, step_caches):
  """The unconstrained reference: the fixed-slot cache, greedy."""
  return run(greedy_config(), params, tmp_path_factory.mktemp("slots"), "slots", step_caches)


def assert_same_responses(ref, other, exact: bool):
  a, b = by_key(ref), by_key(other)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k]["tokens"] == b[k]["tokens"], k
    assert a[k]["finish_reason"] == b[k]["finish_reason"], k
    if exact:
      assert a[k]["logprobs"] == b[k]["logprobs"], k
    else:
      np.testing.assert_allclose(b[k]["logprobs"], a[k]["logprobs"], rtol=0, atol=1e-5)


def assert_pool_conserved(s):
  """Every page handed out came back, and no worker ever held more than its pool."""
  assert s["kv_pages_allocated"] == s["kv_pages_freed"] > 0
  assert 0 < s["kv_peak_pages"] <= s["kv_pages"]
  assert max(s["kv_peak_pages_per_worker"]) == s["kv_peak_pages"]


def test_paged_tokens_equal_fixed_slots(params, greedy_slots, tmp_path, step_caches):
  c = greedy_config()
  c.rollout.kv = "paged"
  paged = run(c, params, tmp_path, "paged", step_caches)
  assert_same_responses(greedy_slots, paged, exact=False)
  s = paged.summary
  assert s["kv"] == "paged" and s["preemptions"] == 0
  # the default pool has the fixed-slot cache's KV bytes: 2 slots x 96 tokens = 12 pages of 16
  assert s["kv_pages"] == 12 and s["max_seqs_per_worker"] == 4
  per_token = 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * 4  # K and V, fp32
  assert s["kv_pool_bytes"] == 12 * 16 * per_token
  assert_pool_conserved(s)


def test_pallas_paged_attention_gives_the_xla_tokens(params, tmp_path, step_caches):
  """model.attention_backend='pallas' (JAX's paged-attention kernel; on CPU the Triton kernel,
  interpreted) in the engine's paged decode: the greedy tokens of the XLA path, log-probs within
  1e-4 (another implementation: the kernel's online softmax in another order)."""
  c = greedy_config()
  c.rollout.kv = "paged"
  c.rollout.num_prompts, c.rollout.samples_per_prompt, c.rollout.max_new_tokens = 2, 2, 8
  c.mesh.num_devices = 2
  out = {}
  for backend in ("xla", "pallas"):
    c.model.attention_backend = backend
    out[backend] = run(c, params, tmp_path, backend, step_caches)
  a, b = by_key(out["xla"]), by_key(out["pallas"])
  assert a.keys() == b.keys() and len(a) == 4
  d = 0.0
  for k in a:
    assert a[k]["tokens"] == b[k]["tokens"], k
    d = max(d, float(np.abs(np.subtract(a[k]["logprobs"], b[k]["logprobs"])).max()))
  print(f"pallas vs xla paged attention: log-prob max |diff| {d:.3g}")
  assert 0 < d <= 1e-4  # not 0: the kernel ran, not the reference
  c.model.attention_backend = "pallas"
  with pytest.raises(runner.RolloutError, match="^model.attention_backend: .*sliding window"):
    runner.prepare(settings.load(c), devices=jax.devices()[:2],
                   model_cfg=MODEL.replace(sliding_window=16))
  c.rollout.kv = "slots"
  with pytest.raises(settings.ConfigError, match="^model.attention_backend: 'pallas'.*rollout.kv"):
    settings.load(c)


def test_preemption_recomputes_and_changes_no_token(params, greedy_slots, tmp_path, step_caches):
  """A pool of 6 pages (one longest sequence) per worker for 2 sequences of ~3 pages each:
  the youngest are preempted, recomputed by a prefill of prompt + their tokens, and finish
  with the unconstrained run's tokens."""
  c = greedy_config()
  c.rollout.kv = "paged"
  c.rollout.kv_pages = 6
  small = run(c, params, tmp_path, "small", step_caches)
  s = small.summary
  assert s["preemptions"] > 0
  assert s["kv_peak_pages"] <= 6
  assert_same_responses(greedy_slots, small, exact=False)
  assert all(len(r["tokens"]) == len(r["logprobs"]) == r["num_tokens"] for r in small.responses)
  assert_pool_conserved(s)


def test_sampled_responses_equal_across_schedules_with_release(params, tmp_path, step_caches):
  """Paged KV, sampled: static and flexfloor (releases down to the floor, live sequences
  migrated page by page) give the same tokens and log-probs, bit for bit."""
  c = engine_utils.rollout_config()
  c.rollout.kv = "paged"
  c.scheduler.release_sizes = "2"  # 8 -> 2 -> 1: 3 meshes to compile
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  c.schedule = "static"
  static = run(c, params, tmp_path, "static", step_caches)
  c.schedule = "flexfloor"
  flex = run(c, params, tmp_path, "flex", step_caches)
  assert_same_responses(static, flex, exact=True)
  a, b = by_key(static), by_key(flex)
  assert sum(a[k]["worker"] != b[k]["worker"] for k in a) > 0
  releases = [r for r in flex.timeline.releases if not r.get("final")]
  assert releases and flex.summary["device_steps"] < static.summary["device_steps"]
  moved = [m for m in flex.timeline.migrations if m["moves"]]
  assert moved, "no live sequence migrated: the page movers went untested"
  page_bytes = 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * 16 * 4
  assert all(m["kv_bytes"] > 0 and m["kv_bytes"] % page_bytes == 0 for m in moved)
  for s in (static.summary, flex.summary):
    assert s["preemptions"] == 0
    assert_pool_conserved(s)


SPEC2 = engine_lib.EngineSpec(  # engine-level tests: 2 workers, 3 rows of up to 6 pages of 8
    cfg=MODEL, slots_per_worker=3, expert_slots=4, max_seq_len=48, max_prompt_len=16,
    max_new_tokens=24, sampling=SamplingParams(temperature=0.0), kv="paged", page_size=8,
    num_pages=12)


@pytest.fixture(scope="module")
def spec2_steps(params, step_caches):
  """SPEC2's StepCache over the first 2 devices, from the session's pool: every engine of the
  tests below runs the same executables instead of tracing and loading them again."""
  return step_caches.get(SPEC2, jax.devices()[:2], [0, 1], *engine_lib.abstract_split(params))


def drive(params, steps, prompts, rows, moves_at, placeholder=False, grown=False):
  """Greedy decode of `prompts` (seq id -> prompt; 20 tokens each) prefilled into `rows` (seq
  id -> (worker, row)) on SPEC2's 2 workers, dispatches of 4 steps; before dispatch i (after
  its growth) the migrations moves_at[i] run (PagePool.move, then Engine.migrate).
  placeholder: a row of worker 1 holds 3 pages and is never dispatched; grown: check that a
  migration carries a page the device has not written yet. Returns the outputs and the pool."""
  placement = ExpertPlacement.initial(MODEL.num_experts, [0, 1], 4, num_workers=2)
  eng = engine_lib.Engine(SPEC2, params, jax.devices()[:2], [0, 1], placement, seed=1,
                          step_cache=steps)
  eng.add_sequences({sid: engine_lib.SeqInput(tokens=p, limit=20, stop_eos=False, phash=sid,
                                              sample=0) for sid, p in prompts.items()})
  pool = PagePool(2, 12, 8, 3, SPEC2.pages_per_seq, margin=0.0)
  eng.attach_pages(pool)
  seqs = {sid: Seq(sid, "p", 0, len(p), None, 20) for sid, p in prompts.items()}
  gen = {}
  if placeholder:
    pool.allocate(1, 0, Seq(99, "x", 0, 20, None, 4), 20)
    gen[(1, 0)] = 0
  where = dict(rows)
  for sid, (w, r) in where.items():
    pool.allocate(w, r, seqs[sid], len(prompts[sid]) + 1)
    assert eng.prefill([(w, r, sid)]) == []
    gen[(w, r)] = 1
  idle = np.zeros(2, bool)
  for i in range(100):
    sent = {at: pool.owned(*at) for at in gen}  # pages of the tables the device last got
    pool.grow(gen, 4)
    moves = moves_at.get(i, [])
    if moves and grown:
      assert any(pool.owned(sw, ss) > sent[(sw, ss)] for sw, ss, _, _ in moves), \
          "no page the device has not written moves: the case is not covered"
    if moves:
      assert pool.move(moves) == [True] * len(moves)
      assert eng.migrate(moves) > 0
      for sw, ss, dw, ds in moves:
        gen[(dw, ds)] = gen.pop((sw, ss))
    k, fins = eng.decode(4, idle, idle)
    for at in gen:
      gen[at] += k
    for f in fins:
      pool.free(f.worker, f.slot)
      del gen[(f.worker, f.slot)]
    if len(eng.outputs) == len(prompts):
      return eng.outputs, pool
  raise AssertionError("did not finish")


@pytest.fixture(params=["devices", "spmd"])
def page_path(request, monkeypatch):
  """How a migration moves pages: single-device movers (one process), or the mesh's SPMD steps
  that several processes use (elastic._migrate_paged_spmd; run here on one process)."""
  if request.param == "spmd":
    from flexfloor_jax.engine import elastic
    monkeypatch.setattr(elastic, "migrate_paged", lambda steps, devices, state, moves, pm:
                        elastic._migrate_paged_spmd(steps.get(2), [0, 1], state, moves, pm))
  return request.param


def test_migration_moves_the_live_pages_into_the_pools_ids(params, spec2_steps, page_path):
  """Engine level: a sequence decodes on worker 0, its table grows once more than the device
  has seen (growth before a dispatch that a migration comes before), then PagePool.move puts it
  on worker 1 at other page ids (a placeholder holds worker 1's first pages), and it finishes
  there with the tokens and log-probs of a run that never moved, bit for bit."""
  prompts = {0: np.arange(3, 14, dtype=np.int32)}
  ref, _ = drive(params, spec2_steps, prompts, {0: (0, 0)}, {}, placeholder=True)
  out, pool = drive(params, spec2_steps, prompts, {0: (0, 0)}, {1: [(0, 0, 1, 1)]},
                    placeholder=True, grown=True)
  assert (out[0].worker, out[0].slot) == (1, 1) and (ref[0].worker, ref[0].slot) == (0, 0)
  assert out[0].tokens == ref[0].tokens and out[0].logprobs == ref[0].logprobs
  assert len(ref[0].tokens) == 20


def test_crossing_migrations_take_every_page_before_writing(params, spec2_steps, page_path):
  """Sequences cross between the workers in one migration: worker 1 sends two (C, then B) and
  receives A, which the pool puts on the pages C just gave back. A device is a source twice, so
  C goes in a later round than A's write: the page movers must read every page first."""
  prompts = {0: np.arange(3, 14, dtype=np.int32), 1: np.arange(20, 29, dtype=np.int32),
             2: np.arange(40, 52, dtype=np.int32)}
  rows = {0: (0, 0), 2: (1, 0), 1: (1, 1)}  # A on worker 0; C (lowest pages), B on worker 1
  ref, _ = drive(params, spec2_steps, prompts, rows, {})
  moves = [(1, 1, 0, 1), (0, 0, 1, 2), (1, 0, 0, 2)]
  out, pool = drive(params, spec2_steps, prompts, rows, {1: moves})
  for sid in prompts:
    assert out[sid].worker == 1 - ref[sid].worker
    assert out[sid].tokens == ref[sid].tokens and out[sid].logprobs == ref[sid].logprobs
  pool.check()
  assert pool.allocated == pool.freed
