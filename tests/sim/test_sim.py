"""flexfloor_jax.sim: numpy only, the engine's policy code on a cost model, calibration."""

import json
import subprocess
import sys

import numpy as np
import pytest
from checkout import ROOT

from flexfloor_jax.policy import plan, release_policy, stepsim, workload
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.sim import cluster, costs, presets, records, replay


def test_cli_mixtral_8x7b_tpu_v5p_64_devices(tmp_path):
  r = subprocess.run([sys.executable, "-m", "flexfloor_jax.sim", "--model=mixtral-8x7b",
                      "--hardware=tpu-v5p", "--devices=64", f"--output_dir={tmp_path}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "tok/occ-dev-s" in r.stdout
  (row,) = json.loads((tmp_path / "sim.json").read_text())
  assert row["devices"] == 64 and row["ep"] == 8 and row["groups"] == 8
  s, f = row["static"], row["flexfloor"]
  assert s["tokens_per_occupied_device_second"] > 0 and f["tokens_per_occupied_device_second"] > 0
  assert row["ratio"]["tokens_per_occupied_device_second"] == pytest.approx(
      f["tokens_per_occupied_device_second"] / s["tokens_per_occupied_device_second"])
  # the static baseline holds every device to the batch's end; flexfloor releases whole groups
  # as they finish (the time-aware floor decides inside a group) and keeps balanced's makespan
  b = row["balanced"]
  assert s["occupied_device_seconds"] == pytest.approx(64 * s["generation_wall_s"])
  assert s["worker_releases"] == 0 and b["worker_releases"] == 0
  assert f["occupied_device_seconds"] < b["occupied_device_seconds"]
  assert f["generation_wall_s"] <= (1 + row["makespan_slack"]) * b["generation_wall_s"]
  for name in ("oracle_balanced", "oracle_flexfloor"):  # perfect knowledge, same policy code
    assert row[name]["generated_tokens"] == s["generated_tokens"]
  line = [ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] == "64"]
  assert line, r.stdout
  assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag, named, value", [
    ("--model=nope", "--model", "'nope'"),
    ("--seeds=0,x", "--seeds", "'x'"),
    ("--seeds=1,1", "--seeds", "repeat"),
    ("--seeds=-2", "--seeds", "-2"),
    ("--memory_utilization=1.5", "--memory_utilization", "1.5"),
    ("--prefill_chunk=-1", "--prefill_chunk", "-1"),
    ("--prefill_chunk=2.5", "flag --prefill_chunk", "2.5"),
    (("--workload=grpo_trace", "--seeds=0,19"), "--seeds", "seed 19"),  # 20 epochs recorded
    # a group of 8 H100s cannot hold DeepSeek-V3: refused with its floor, before any run
    (("--model=deepseek-v3", "--hardware=h100", "--devices=64"), "--ep", "memory floor is 32"),
])
def test_bad_cli_input_is_one_line(tmp_path, flag, named, value):
  """Bad input, as a user runs it: exit 2, one `error:` line naming the flag and the value, no
  traceback, nothing written. (The sim's checks read absl's parsed flags inside cli.main: these
  runs are their test. A bad measured table: test_measured_hw.py.)"""
  out = tmp_path / "out"
  flags = [flag] if isinstance(flag, str) else list(flag)
  r = subprocess.run([sys.executable, "-m", "flexfloor_jax.sim", *flags, f"--output_dir={out}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=60)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
  assert lines[0].startswith(f"error: {named}") and value in lines[0], lines
  assert r.stdout == "" and not out.exists()


def _history(spec, epochs):
  h = LengthHistory()
  for e in range(epochs):
    seqs = workload.make_seqs(spec, e)
    h.add_rollout(e, seqs, {s.seq_id: s.target_len for s in seqs})
  return h


@pytest.mark.parametrize("schedule,placement", [("static", "auto"), ("flexfloor", "auto"),
                                                ("flexfloor", "static")])
@pytest.mark.parametrize("epoch", [0, 2])
def test_replay_device_steps_equal_stepsim(schedule, placement, epoch):
  """The sim's executor only adds time: its device_steps are stepsim's, with or without a cost
  model, on either hardware."""
  spec = workload.WorkloadSpec()
  seqs, hist = workload.make_seqs(spec, epoch), _history(spec, epoch)
  args = (seqs, None, hist, schedule, 8, 4, 1)
  kw = dict(placement=placement, epoch=epoch)
  queues, policy, _ = plan.plan_rollout(seqs, hist, schedule, 8, 4, 1, placement=placement,
                                        epoch=epoch)
  ref = stepsim.simulate(seqs, None, queues, policy, 8, 4, 8)
  plain, _ = replay.replay(*args, **kw)
  m, hw = presets.MODELS["mixtral-8x7b"], presets.HARDWARE
  roof, _ = replay.replay(*args, model=m, cost=costs.RooflineCost(m, hw["tpu-v5p"]), **kw)
  assert plain["device_steps"] == ref["device_steps"] == roof["device_steps"]
  assert plain["generated_tokens"] == roof["generated_tokens"] == sum(s.target_len for s in seqs)
  assert roof["generation_wall_s"] > 0
  h100, _ = replay.replay(*args, model=m, cost=costs.RooflineCost(m, hw["h100"]), **kw)
  assert h100["device_steps"] == ref["device_steps"]


def test_roofline_fewer_workers_with_more_experts_cost_more():
  m, hw = presets.MODELS["mixtral-8x7b"], presets.HARDWARE["tpu-v5p"]
  c = costs.RooflineCost(m, hw)
  t = {}
  for n in (1, 2, 4, 8):
    held = np.full(n, 8 / n)
    tok = np.full(n, 32.0 / n)
    t[n] = c.step_seconds(held, tok, tok * 1000)
  assert t[1] > t[2] > t[4] > t[8] > hw.step_overhead_s
  # memory bound: one worker reading all 8 experts is close to 8 x one worker reading one
  assert t[1] / t[8] > 4
  # device-time per step (n x t(n)) still falls as workers go: what release saves
  assert 8 * t[8] > 1 * t[1]


def test_presets_are_published_figures():
  assert presets.HARDWARE["tpu-v5p"].hbm_bw == 2765e9
  assert presets.HARDWARE["h200"].hbm_bytes == 141e9
  assert presets.MODELS["mixtral-8x7b"].params == pytest.approx(46.7e9, rel=0.01)
  assert presets.MODELS["mixtral-8x22b"].params == pytest.approx(140.6e9, rel=0.01)
  assert presets.MODELS["qwen3-30b-a3b"].params == pytest.approx(30.5e9, rel=0.02)
  for hw in presets.HARDWARE.values():
    assert hw.source


def test_floor_per_hardware():
  m, hw = presets.MODELS["mixtral-8x7b"], presets.HARDWARE
  # v5e (16 GiB): one 11 GB expert per chip and no fewer chips; v5p (95 GiB) holds it all
  assert cluster.floor_for(m, hw["tpu-v5e"], 8, 4, 2304) == 8
  assert cluster.floor_for(m, hw["tpu-v5p"], 8, 4, 2304) == 1
  assert cluster.floor_for(presets.MODELS["mixtral-8x22b"], hw["tpu-v5p"], 8, 4, 2304) == 4


def _history_of(seqs, epochs=2):
  h = LengthHistory()
  for e in range(epochs):
    h.add_rollout(e, seqs, {s.seq_id: s.target_len for s in seqs})
  return h


@pytest.mark.parametrize("lanes", [2, 4])
def test_group_split_packs_within_balanced_makespan(lanes):
  """Across EP groups, flexfloor packs the long work onto the last groups: every sequence goes to
  exactly one group, the predicted makespan (list schedule of the known lengths) stays within
  the slack of balanced's, and the groups are held for fewer lane-steps in all."""
  rng = np.random.default_rng(3)
  lengths = np.r_[rng.integers(2, 12, 40), [60, 45]]
  seqs = [Seq(i, f"p{i}", 0, 4, int(n), 64) for i, n in enumerate(lengths)]
  hist, G, ep, slack = _history_of(seqs), 6, 1, 0.05
  pre = lanes / ep  # each sequence's prefill lane-steps, as group_split counts them

  def finishes(split):
    return [release_policy.list_schedule_finish([], [lengths[i] + pre for i in g], lanes)
            if g else 0.0 for g in split]

  out = {k: cluster.group_split(seqs, k, hist, G, lanes, ep, slack) for k in plan.SCHEDULES}
  for k, split in out.items():
    assert sorted(i for g in split for i in g) == list(range(len(seqs))), k
  assert out["static"][0] == list(range(7))  # contiguous chunks
  fb, ff = finishes(out["balanced"]), finishes(out["flexfloor"])
  assert max(ff) <= (1 + slack) * max(fb)
  assert sum(ff) < sum(fb)
  assert min(ff) < min(fb)  # a group left with short (or no) work goes early


def test_cluster_groups_and_static_hold():
  m, hw = presets.MODELS["mixtral-8x7b"], presets.HARDWARE
  r = cluster.simulate_cluster(m, hw["tpu-v5e"], 16, length_scale=1.0, processes=1)
  assert r["ep"] == 8 and r["groups"] == 2 and r["floor"] == 8
  # floor 8 = the whole group: no release inside a group, only whole groups that finish early
  assert r["flexfloor"]["worker_releases"] == 0
  assert r["ratio"]["tokens_per_occupied_device_second"] >= 1.0
  with pytest.raises(ValueError, match="ep="):
    cluster.simulate_cluster(m, hw["tpu-v5e"], 12, ep=8)


def test_rl_step_released_logprobs_shorten_the_step():
  """64 tpu-v5p chips in 8 EP groups: the groups given the short work finish early and are
  released whole, and their devices score finished responses, so less log-prob work is left
  after generation (inside one group the time-aware floor keeps all 8: 8 -> 7 costs seconds)."""
  r = cluster.simulate_cluster(presets.MODELS["mixtral-8x7b"], presets.HARDWARE["tpu-v5p"], 64,
                               length_scale=1.0, processes=1)
  q = r["rl_step"]
  st, fl, re = q["static"], q["flexfloor"], q["flexfloor_released_logprobs"]
  assert st["scored_during_generation"] == 0 and fl["scored_during_generation"] == 0
  assert re["scored_during_generation"] > 0.5
  assert re["logprob_s"] < 0.5 * fl["logprob_s"]
  assert re["gen_s"] == fl["gen_s"] and re["update_s"] == fl["update_s"]
  assert re["step_s"] < fl["step_s"]


# ----------------------------------------------------------------------------- calibration


def _rollout(pool, seed: int, schedule: str = "flexfloor"):
  from flexfloor_jax.bench import runs as bench_runs
  from flexfloor_jax.config import settings
  from flexfloor_jax.rollout import runner
  config = bench_runs.get_bench_config()
  config.sampling.seed = seed  # also the workload seed: another workload
  config.scheduler.release_sizes = "pow2"  # 4 meshes to compile instead of 8 (the fit is per step)
  st = settings.load(config, "bench")
  c = bench_runs.run_config(st, dict(bench_runs.variants(st))[schedule], 0)
  hist = LengthHistory()
  seqs, model_cfg = bench_runs.seqs_for(c)
  res = runner.run(c, write_outputs=False, history=LengthHistory(), progress=False,
                   step_cache=pool)
  s = res.summary
  return records.make_run_record(
      name=f"{schedule}_seed{seed}", epoch=0, seqs=seqs,
      lengths={q: f.num_tokens for q, f in res.record.finishes.items()}, history=hist,
      schedule=schedule, placement="auto", compaction=bool(c.scheduler.compaction),
      num_workers=s["num_workers"], slots_per_worker=s["slots_per_worker"], floor=s["floor"],
      steps_per_dispatch=c.rollout.steps_per_dispatch, num_experts=model_cfg.num_experts,
      timeline=res.record.timeline, summary=s)


@pytest.mark.slow
def test_cpu_preset_fitted_on_one_workload_predicts_another(step_caches):
  """Real rollouts on two workloads (seeds): the cpu preset fitted on the first (run before and
  after the second) predicts the second's device_steps exactly (same policy code) and wall time
  within 25%. (The session's step caches: the bench tests' executables when they ran here.)"""
  pool = step_caches
  # the process's first rollout also pays one-time costs (XLA:CPU compiles kernels at their first
  # execution) that a per-step cost model does not describe: fit on a warm run
  _rollout(pool, seed=0)
  # fitted on the same workload run just before and just after the held-out one, so that a
  # change in the machine's other load during the test weighs on the fit as on the prediction
  a = _rollout(pool, seed=0)
  b = _rollout(pool, seed=1)
  a_after = _rollout(pool, seed=0)
  assert a["lengths"] != b["lengths"] and a["lengths"] == a_after["lengths"]
  a_after["name"] += "_after"
  r = records.calibrate_and_predict([a, a_after], [b])
  print(records.format_calibration(r))
  (p,) = r["predictions"]
  assert p["device_steps_exact"], p
  assert abs(p["wall_rel_error"]) <= 0.25, records.format_calibration(r)


def test_paged_kv_cluster_table():
  """--kv=paged: a pool with full rows for max_seqs = slots_per_worker and a margin that reserves
  every sequence's cap admits exactly as fixed slots do (the same table); with more sequences per
  worker than slots, memory decides and every schedule still generates every token."""
  from flexfloor_jax.sim.cluster import simulate_cluster
  from flexfloor_jax.sim.presets import HARDWARE, MODELS
  kw = dict(length_scale=1.0, prompt_len=32, processes=1, epochs=1)
  model, hw = MODELS["mixtral-8x7b"], HARDWARE["tpu-v5p"]
  slots = simulate_cluster(model, hw, 8, **kw)
  full = simulate_cluster(model, hw, 8, kv="paged", page_size=16, max_seqs=4, kv_margin=1e9,
                          kv_memory="slots", **kw)
  assert full["kv"]["num_pages"] == 4 * (32 + 256) // 16
  for label in ("static", "balanced", "flexfloor"):
    assert full[label] == slots[label], label
    assert full["kv"][label]["preemptions"] == 0
  more = simulate_cluster(model, hw, 8, kv="paged", page_size=16, max_seqs=8, kv_memory="slots",
                          **kw)
  assert more["kv"]["max_seqs"] == 8
  for label in ("static", "balanced", "flexfloor"):
    assert more[label]["generated_tokens"] == slots["static"]["generated_tokens"]
    assert 0 < more["kv"][label]["peak_pages"] <= more["kv"]["num_pages"]
  with pytest.raises(ValueError):
    simulate_cluster(model, hw, 8, kv="pages", **kw)


def test_grpo_trace_replays_the_recorded_lengths():
  """The grpo_trace workload at 8 devices: every schedule generates exactly the trace's lengths
  of the replayed epoch (seed 0: its last), scheduled with the history of the epochs before."""
  from flexfloor_jax.policy import workload
  from flexfloor_jax.sim import cluster, presets
  trace = workload.load_trace(cluster.GRPO_TRACE)
  want = sum(n for e in trace.epochs.values() for n in e[-1])
  r = cluster.simulate_cluster(presets.MODELS["qwen3-30b-a3b"], presets.HARDWARE["h100"], 8,
                               workload_name="grpo_trace", processes=1)
  assert r["epoch"] == trace.num_epochs - 1
  for name in ("static", "balanced", "flexfloor"):
    assert r[name]["generated_tokens"] == want
  assert r["workload"]["cap"] == trace.max_new_tokens
