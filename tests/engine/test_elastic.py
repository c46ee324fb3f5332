"""Elastic expert parallelism: releases happen, change no token, move only what they must."""

import gc
import itertools
import json
import logging

import engine_utils
import jax
import numpy as np
import pytest

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.engine import elastic, memory
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rollout import inputs, runner

MODEL = PRESETS["tiny"].replace(num_layers=2)


def get_config():
  return engine_utils.rollout_config()


@pytest.fixture(scope="module")
def params():
  return tfm.init_params(MODEL, jax.random.key(3), scale=0.1)


def run(c, params, tmp_path, name, **kw):
  c.rollout.output_dir = str(tmp_path / name)
  return runner.run(c, params=params, model_cfg=MODEL, write_outputs=False, progress=False, **kw)


def sizes_over_time(res):
  sizes = [len(res.timeline.workers)]
  for r in res.timeline.releases:
    if not r.get("final"):
      sizes.append(sizes[-1] - len(r["workers"]))
  return sizes


@pytest.mark.parametrize("lengths", ["file", "model"])
def test_flexfloor_responses_equal_static(lengths, params, tmp_path, step_caches):
  c = get_config()
  c.rollout.lengths = (engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
                       if lengths == "file" else "model")
  c.schedule = "static"
  static = run(c, params, tmp_path, "static", step_cache=step_caches)
  c.schedule = "flexfloor"
  flex = run(c, params, tmp_path, "flex", step_cache=step_caches)
  # balanced places by predicted length: with no history every prediction is equal and LPT
  # reproduces static's chunks here, so it gets a history in which later prompts ran longer
  hist = LengthHistory()
  for i, pid in enumerate(sorted({r["prompt_id"] for r in static.responses})):
    hist.add(pid, 0, [1 + 4 * i + j for j in range(c.rollout.samples_per_prompt)])
  c.schedule = "balanced"
  bal = run(c, params, tmp_path, "balanced", history=hist, step_cache=step_caches)
  def key(r):
    return (r["prompt_id"], r["sample"])
  a = {key(r): r for r in static.responses}
  for other in (flex, bal):
    b = {key(r): r for r in other.responses}
    assert a.keys() == b.keys()
    moved = sum(a[k]["worker"] != b[k]["worker"] for k in a)
    assert moved > 0, "the placements should differ, or the test proves nothing"
    for k in a:
      assert a[k]["tokens"] == b[k]["tokens"], k
      assert a[k]["logprobs"] == b[k]["logprobs"], k
  assert sizes_over_time(bal) == [8]  # full width, never releases
  if lengths == "model":
    # A random model seldom emits EOS, so most responses run to the cap together: the tokens
    # are what this case checks.
    assert {r["finish_reason"] for r in static.responses} >= {"length"}
    return
  # Releases happened all the way down the chain to the floor.
  sizes = sizes_over_time(flex)
  assert sizes[0] == 8 and sizes[-1] == flex.summary["floor"] == 1, sizes
  assert all(x > y for x, y in itertools.pairwise(sizes)), sizes
  assert sizes_over_time(static) == [8]
  assert flex.summary["device_steps"] < static.summary["device_steps"]


def _pooled_steps(step_caches, spec, params, devices, chain):
  """The session's StepCache of `spec` on these devices: the runner's flexfloor spec is the one
  the runner tests above ran, so its StepSets are built already (no trace, lower or load)."""
  return step_caches.get(spec, devices, chain, *engine_lib.abstract_split(params))


def test_rollout_from_an_orbax_checkpoint_equals_the_weights_in_memory(params, tmp_path,
                                                                        step_caches):
  """`model.checkpoint` an orbax checkpoint (restored onto one device, as load_orbax does without
  shardings) on 8 workers: the responses of the same weights passed in memory, bit for bit (the
  expert-slot gather must take weights committed to another device)."""
  from flexfloor_jax.model import checkpoint as ckpt
  c = get_config()
  c.rollout.lengths = "model"  # what 'auto' picks with a checkpoint: EOS or the cap ends a response
  mem = run(c, params, tmp_path, "mem", step_cache=step_caches)
  ckpt.save_orbax(str(tmp_path / "ckpt"), params, MODEL)
  c.model.checkpoint = str(tmp_path / "ckpt")
  c.rollout.output_dir = str(tmp_path / "from_ckpt")
  got = runner.run(c, write_outputs=False, progress=False, step_cache=step_caches)
  def key(res):
    return [(r["prompt_id"], r["sample"], r["tokens"], r["logprobs"])
                       for r in res.responses]
  assert key(got) == key(mem) and len(mem.responses) > 0


def test_release_moves_only_released_experts_and_keeps_buffers(params, step_caches):
  """Shrink 8 -> 6 with two live workers left alone: bytes sent = the released workers'
  experts, measured from the transfers; the survivors' buffers are the same buffers. (The
  runner's flexfloor spec: its executables are compiled already.)"""
  devices = jax.devices()[:8]
  chain = list(range(8))
  spec = engine_utils.rollout_spec(MODEL)
  placement = ExpertPlacement.initial(MODEL.num_experts, chain, spec.expert_slots, num_workers=8)
  eng = engine_lib.Engine(spec, params, devices, chain, placement, seed=0,
                          step_cache=_pooled_steps(step_caches, spec, params, devices, chain),
                          prefetch_sizes=[6])
  rng = np.random.default_rng(0)
  eng.add_sequences({i: engine_lib.SeqInput(tokens=rng.integers(0, 256, 10).astype(np.int32),
                                            limit=20, stop_eos=False, phash=i, sample=0)
                     for i in range(4)})
  eng.prefill([(4, 0, 0), (7, 1, 1)])
  eng.decode(3, np.zeros(8, bool), np.zeros(8, bool))
  # A migration (compaction) by the single-device movers equals the SPMD extract/insert path.
  eng.steps.wait_all()
  assert eng.steps.row_movers_ready()
  tree = eng.state.as_dict()
  copy = jax.tree.map(lambda a: a.copy(), tree)
  spmd, spmd_bytes = elastic.move_rows(eng.stepset, "rows", copy, [(7, 1, 5, 0)])
  kv_bytes = eng.migrate([(7, 1, 5, 0)])
  moved = eng.state.as_dict()
  for k in tree:
    np.testing.assert_array_equal(np.asarray(moved[k]), np.asarray(spmd[k]), err_msg=k)
  def row(a):
    return a.nbytes // a.shape[1]  # one sequence row of the cache (all layers)
  assert kv_bytes == row(eng.state.k) + row(eng.state.v) > 0
  assert spmd_bytes == kv_bytes + sum(a.nbytes // a.shape[0] for k, a in moved.items()
                                      if k not in ("k", "v"))

  def pointers(arr):
    return {s.device.id: s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}

  before = {k: pointers(v) for k, v in {**eng.experts, "k": eng.state.k, "v": eng.state.v,
                                        "scalars": eng.state.scalars}.items()}
  held = placement.slot_expert()
  released = [0, 1]
  expected = sum(int((held[w] >= 0).sum()) for w in released) * sum(
      eng.experts[k].nbytes // (8 * spec.expert_slots) for k in tfm.EXPERT_KEYS)
  stats = eng.shrink(chain[2:])
  assert stats["expert_bytes_moved"] == expected > 0
  survivors = {devices[w].id for w in chain[2:]}
  after = {k: pointers(v) for k, v in {**eng.experts, "k": eng.state.k, "v": eng.state.v,
                                       "scalars": eng.state.scalars}.items()}
  for k in before:
    assert set(after[k]) == survivors
    for d in survivors:
      assert after[k][d] == before[k][d], (k, d)
  # Every expert is still served, each from exactly one slot of an active worker.
  se = eng.placement.slot_expert()[eng.active]
  assert sorted(se[se >= 0].tolist()) == list(range(MODEL.num_experts))
  # The moved experts' weights arrived intact: compare slot contents with the canonical weights.
  _, canon = engine_lib.split_params(params)
  for k in tfm.EXPERT_KEYS:
    w = np.asarray(eng.experts[k])
    for pos, row in enumerate(se):
      for s, e in enumerate(row):
        if e >= 0:
          np.testing.assert_array_equal(w[:, pos * spec.expert_slots + s],
                                        np.asarray(canon[k][:, e]))
  # Decoding continues on the smaller mesh.
  steps, _ = eng.decode(2, np.zeros(6, bool), np.zeros(6, bool))
  assert steps == 2


def test_a_cache_closed_mid_compile_compiles_the_dropped_sizes_when_reused(params):
  """A pooled StepCache (bench epochs, RL steps) is closed after each run, which drops the
  compiles not started yet; reused, it compiles those sizes again (a dropped size must not count
  as ready: a release onto it, in a later run, would get a cancelled compile)."""
  spec = engine_utils.rollout_spec(MODEL)  # the runner's flexfloor spec: persistent-cache hits
  cache = engine_lib.StepCache(spec, jax.devices()[:8], list(range(8)),
                               *engine_lib.abstract_split(params), compile_threads=1)
  cache.prefetch([8, 1])  # one thread: 1 waits behind 8, and close() drops it
  cache.close()
  assert not cache.ready(1)
  cache.reopen()
  cache.prefetch([8, 1])
  cache.wait([8, 1])
  assert cache.ready(8) and cache.ready(1) and cache.get(1).mesh.size == 1


def test_no_compile_during_rollout(params, tmp_path):
  c = get_config()
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  c.scheduler.release_sizes = "pow2"  # 8 -> 4 -> 2 -> 1: 4 meshes to load instead of 8
  messages = []

  class Capture(logging.Handler):
    def emit(self, record):
      messages.append(record.getMessage())

  from flexfloor_jax.policy import controller
  orig = controller.run

  def run_capturing(*a, **kw):
    h = Capture()
    logging.getLogger("jax").addHandler(h)
    jax.config.update("jax_log_compiles", True)
    try:
      return orig(*a, **kw)
    finally:
      jax.config.update("jax_log_compiles", False)
      logging.getLogger("jax").removeHandler(h)

  controller.run = run_capturing
  try:
    res = run(c, params, tmp_path, "flex")
  finally:
    controller.run = orig
  compiles = [m for m in messages if "ompil" in m]
  assert not compiles, compiles[:5]
  assert len(res.summary["release_latency_s"]) >= 3
  print("release latency / median decode step:", res.summary["release_latency_over_median_step"])


def test_floor_is_respected(params, tmp_path, step_caches):
  c = get_config()
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  t = inputs.terms_for_config(c, MODEL)
  # Room for 2 experts per worker (plus slack below one more expert): the floor is 4 workers.
  budget = t.per_device(2) + t.expert // 2
  c.mesh.device_memory_gb = budget / 2**30
  c.scheduler.release_sizes = "pow2"  # 8 -> 4: the floor, in 2 meshes to compile instead of 5
  res = run(c, params, tmp_path, "floor4", step_cache=step_caches)
  assert res.summary["floor"] == 4
  sizes = sizes_over_time(res)
  assert min(sizes) == 4, sizes
  # A budget under the model size fails before generation, leaving no output.
  c.mesh.device_memory_gb = (t.nonexpert + MODEL.num_experts * t.expert // 8) / 2 / 2**30
  out = tmp_path / "too_small"
  c.rollout.output_dir = str(out)
  with pytest.raises(runner.RolloutError, match="mesh.device_memory_gb"):
    runner.run(c, params=params, model_cfg=MODEL, progress=False)
  assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_greedy_tokens_identical_across_mesh_sizes(params, tmp_path, step_caches):
  """Greedy rollout through the runner on 1, 2, 3 (uneven expert placement), 4 and 8 workers."""
  c = get_config()
  c.schedule = "static"
  c.sampling.temperature = 0.0
  c.rollout.lengths = "model"
  c.rollout.max_new_tokens = 16
  out = {}
  for n in (1, 2, 3, 4, 8):
    c.mesh.num_devices = n
    res = run(c, params, tmp_path, f"n{n}", step_cache=step_caches)
    out[n] = {(r["prompt_id"], r["sample"]): (r["tokens"], r["logprobs"]) for r in res.responses}
  for n in (1, 2, 3, 4):
    assert out[n] == out[8], n


def test_pallas_backend_matches_xla(params, tmp_path, step_caches):
  """model.moe_backend='pallas' (interpret mode on CPU) gives the XLA path's greedy tokens.
  (The XLA run is the 2-worker run of test_greedy_tokens_identical_across_mesh_sizes: the same
  spec, so the same executables.)"""
  c = get_config()
  c.schedule = "static"
  c.sampling.temperature = 0.0
  c.rollout.lengths = "model"
  c.rollout.num_prompts = 2
  c.rollout.samples_per_prompt = 2
  c.rollout.max_new_tokens = 16
  c.mesh.num_devices = 2
  out = {}
  for backend in ("xla", "pallas"):
    c.model.moe_backend = backend
    out[backend] = run(c, params, tmp_path, backend, step_cache=step_caches).responses
  for a, b in zip(out["xla"], out["pallas"], strict=True):
    assert a["tokens"] == b["tokens"]
    assert np.abs(np.subtract(a["logprobs"], b["logprobs"])).max() <= 1e-4


def test_measured_step_times_drive_the_next_run(params, tmp_path, step_caches):
  """The engine's per-size decode step times go into the length history; the next run's release
  policy decides on them (the time-aware floor's measured source)."""
  c = get_config()
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  c.scheduler.step_cost = "measured"  # 'auto' decides on device-steps on emulated CPU devices
  hist = LengthHistory()
  first = run(c, params, tmp_path, "first", history=hist, step_cache=step_caches)
  assert first.summary["cost_model"] is None  # nothing measured before the first run
  measured = {int(k): v for k, v in first.summary["step_seconds_measured"].items()}
  assert len(measured) >= 2 and hist.step_seconds == measured
  path = tmp_path / "history.json"
  hist.save(str(path))
  back = LengthHistory.load(str(path))
  assert back.step_seconds == measured
  second = run(c, params, tmp_path, "second", history=back, step_cache=step_caches)
  assert second.summary["step_cost"] == "measured"
  assert second.summary["cost_model"] == "measured"
  assert {int(k): v for k, v in second.summary["cost_table"].items()} == measured
  assert second.summary["releases"] and sizes_over_time(second)[-1] == 1  # released on it


def test_default_path_releases_and_a_warm_rerun_compiles_nothing(params, tmp_path):
  """The default (wait_compiles=False) flexfloor path: it waits only for the sizes the plan
  expects (every size while the length history is empty) and releases workers; a second run
  in the same process, with a fresh StepCache, finds every executable in the persistent cache
  (the CLI's thresholds keep them all) and compiles nothing."""
  import os

  from flexfloor_jax.runtime.backend import enable_compilation_cache
  enable_compilation_cache(jax.config.jax_compilation_cache_dir or os.environ.get(
      "FLEXFLOOR_JAX_CACHE"))
  c = get_config()
  c.rollout.wait_compiles = False
  c.rollout.lengths = engine_utils.long_tailed_lengths(c, tmp_path / "lengths.jsonl")
  c.scheduler.release_sizes = "pow2"  # 8 -> 4 -> 2 -> 1: 4 meshes per run instead of 8
  first = run(c, params, tmp_path, "first")
  s = first.summary
  assert s["max_seq_len"] == c.model.max_seq_len  # an explicit length wins
  assert s["compile_plan"]["source"] == "no_history"
  assert s["compile_plan"]["waited_for"] == [4, 2, 1]
  assert s["releases_held_for_compile_steps"] == 0
  assert len([r for r in s["releases"] if not r["final"]]) >= 3
  assert sizes_over_time(first)[-1] == 1

  cache = jax.config.jax_compilation_cache_dir
  def count():
    return len([f for f in os.listdir(cache) if f.endswith("-cache")])
  before = count()
  events = []  # a compile request that finds its executable in JAX's cache is a hit

  def listen(event, **kw):
    if event in ("/jax/compilation_cache/compile_requests_use_cache",
                 "/jax/compilation_cache/cache_hits"):
      events.append(event)

  jax.monitoring.register_event_listener(listen)
  try:
    second = run(c, params, tmp_path, "second")
  finally:
    jax.monitoring.unregister_event_listener(listen)
  requests = events.count("/jax/compilation_cache/compile_requests_use_cache")
  hits = events.count("/jax/compilation_cache/cache_hits")
  assert requests > 0 and hits == requests, f"{requests - hits} of {requests} compiled again"
  # nothing new written: nothing was compiled (other processes, e.g. the other pytest-xdist
  # worker, write to the same cache directory meanwhile, so only a serial run can count)
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    assert count() == before
  assert second.summary["device_steps"] == s["device_steps"]


def test_max_seq_len_defaults_to_what_the_run_needs(params, tmp_path):
  """No length flag: the KV length is the longest prompt + rollout.max_new_tokens (512 here,
  more than any hand-set default of the tiny preset)."""
  c = get_config()
  c.model.max_seq_len = 0
  c.schedule = "static"
  c.mesh.num_devices = 1
  c.rollout.num_prompts = 2
  c.rollout.samples_per_prompt = 1
  c.rollout.max_new_tokens = 512
  path = tmp_path / "lengths.jsonl"
  path.write_text("".join(json.dumps({"id": f"builtin-{i}", "sample": 0, "length": 3}) + "\n"
                          for i in range(2)))
  c.rollout.lengths = str(path)
  res = run(c, params, tmp_path, "long")
  longest = max(len(inputs.BUILTIN_PROMPTS[i]) for i in range(2)) + 1  # bytes + BOS
  assert res.summary["max_seq_len"] == longest + 512
  assert all(r["num_tokens"] == 3 for r in res.responses)


def test_route_rows_moves_blocks_within_the_mesh():
  """The multi-controller transfer (a ppermute over the mesh the rows were extracted on): each
  moved block lands on its destination device unchanged, also with a leading layer axis, and one
  executable serves a repeat of the same moves."""
  from flexfloor_jax.runtime import mesh as mesh_lib
  devs = jax.devices()[:6]
  mesh = mesh_lib.make_ep_mesh(devs)
  k = np.arange(2 * 6 * 3, dtype=np.float32).reshape(2, 6, 3)  # [L, rows, ...]: row axis 1
  s = np.arange(6 * 4, dtype=np.int32).reshape(6, 4)
  rows = {"k": jax.device_put(k, mesh_lib.sharding(mesh, "layer", "batch", None)),
          "s": jax.device_put(s, mesh_lib.sharding(mesh, "batch", None))}
  dst_of_src = {0: devs[3], 1: devs[5], 4: devs[0]}
  n_fns = len(elastic._route_fns)
  for _ in range(2):
    out = elastic.route_rows(rows, dst_of_src, devs)
    assert set(out["k"]) == set(dst_of_src.values())
    for p, d in dst_of_src.items():
      np.testing.assert_array_equal(np.asarray(out["k"][d]), k[:, p:p + 1])
      np.testing.assert_array_equal(np.asarray(out["s"][d]), s[p:p + 1])
      assert out["k"][d].devices() == {d}
  assert len(elastic._route_fns) == n_fns + 1


def _live_bytes(exclude):
  """{device id: bytes} of the distinct live buffers of arrays not in `exclude` (array ids; the
  caller keeps those arrays alive, so none of their buffers is reused). A view of an array over a
  smaller mesh shares its buffers: counted once."""
  seen, per_device = set(), {}
  for a in jax.live_arrays():
    if id(a) in exclude:
      continue
    for s in a.addressable_shards:
      buf = (s.device.id, s.data.unsafe_buffer_pointer())
      if buf not in seen:
        seen.add(buf)
        per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
  return per_device


def test_live_bytes_match_the_floor_at_every_mesh_size(params, step_caches):
  """Every mesh size of the tiny preset from 8 workers down to the floor (1: the runner's
  flexfloor spec, every expert on one worker; its executables are compiled already), by the
  engine's own releases: each active device holds the floor's resident bytes (non-expert + its
  expert slots + KV and slot state) within a small margin (the movers' slot-index scalars),
  whatever meshes were built before; each released device holds nothing of the rollout."""
  gc.collect()
  before = jax.live_arrays()  # kept alive to the end: the test's own arrays (params)
  devices, chain, e = jax.devices()[:8], list(range(8)), MODEL.num_experts
  terms = memory.floor_terms(MODEL, slots_per_worker=2, max_seq_len=96, max_new_tokens=32)
  spec = engine_utils.rollout_spec(MODEL)
  slots = spec.expert_slots
  assert slots == e and terms.floor(e, terms.per_device(slots), 8) == 1  # the floor: 1 worker
  placement = ExpertPlacement.initial(e, chain, slots, num_workers=8)
  host_params = jax.tree.map(np.asarray, params)  # no device buffer that the engine could alias
  eng = engine_lib.Engine(spec, host_params, devices, chain, placement, seed=0,
                          step_cache=_pooled_steps(step_caches, spec, host_params, devices, chain),
                          prefetch_sizes=range(7, 0, -1))
  eng.steps.wait_all()
  want = terms.resident(slots)
  margin = 4 * (slots + spec.slots_per_worker) + 64  # int32 slot indices of the movers
  for n in range(8, 0, -1):
    if n < 8:
      eng.shrink(chain[8 - n:])
    jax.block_until_ready((eng.experts, eng.state))
    gc.collect()
    live = _live_bytes({id(a) for a in before})
    for w in chain[8 - n:]:
      assert abs(live[devices[w].id] - want) <= margin, (n, w, live[devices[w].id], want)
    for w in chain[:8 - n]:
      assert live.get(devices[w].id, 0) <= margin, (n, w, live.get(devices[w].id))
  assert eng.active == chain[7:]


def test_move_rounds_use_each_device_once_each_way():
  """Hand-worked: moves keep their order, each goes to the first round where its source and its
  destination are free."""
  moves = [(0, 0, 2, 1), (0, 1, 3, 0), (1, 0, 2, 2), (1, 1, 3, 1), (4, 0, 2, 0)]
  assert list(elastic.move_rounds(moves)) == [
      [(0, 0, 2, 1), (1, 1, 3, 1)], [(0, 1, 3, 0), (1, 0, 2, 2)], [(4, 0, 2, 0)]]
  assert list(elastic.move_rounds([])) == []
