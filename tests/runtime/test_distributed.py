"""Multi-controller rollouts: 2 processes x 4 emulated CPU devices (gloo collectives over
loopback, `python -m flexfloor_jax.launch`) give responses token-identical to one process with 8
devices, for flexfloor on the fixed-slot cache and on the paged pool; flexfloor's releases cross
the host boundary (workers 0-3 live on process 0, 4-7 on process 1: process 0's workers are all
released and its experts move to process 1, after which process 0 follows the control loop
without devices, through the key-value store).
"""

import json
import os
import subprocess
import sys
import time

import checkout
import pytest
from checkout import ROOT

SMALL = ["--config.rollout.num_prompts=2", "--config.rollout.samples_per_prompt=8",
         "--config.rollout.max_new_tokens=24", "--config.rollout.wait_compiles=True",
         "--config.scheduler.release_sizes=2",  # 8 -> 2 -> 1: compiles only the meshes it uses
         "--config.scheduler.step_cost=steps"]  # release whenever free: the mechanism under test


def _env() -> dict:
  """A child's environment (checkout.child_env), without a multi-process setup of this one."""
  env = checkout.child_env()
  for k in ("FLEXFLOOR_COORDINATOR", "FLEXFLOOR_NUM_PROCESSES", "FLEXFLOOR_PROCESS_ID",
            "FLEXFLOOR_DEVICES_PER_PROCESS"):
    env.pop(k, None)
  return env


def _run(cmd, timeout):
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, (proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:])
  return proc, time.perf_counter() - t0


def _rollout(out, schedule, processes, options=SMALL, timeout=400):
  """`options` may name another config file (--config=...; default configs/mixtral.py)."""
  named = any(o.startswith("--config=") for o in options)
  config = [] if named else ["--config=configs/mixtral.py"]
  args = [sys.executable, "-m", "flexfloor_jax.rollout", *config, *options,
          f"--config.schedule={schedule}", f"--config.rollout.output_dir={out}"]
  if processes == 1:
    return _run(args + ["--config.mesh.cpu_devices=8"], timeout=timeout)
  launch = [sys.executable, "-m", "flexfloor_jax.launch", f"--num_processes={processes}",
            "--devices_per_process=4", f"--timeout={timeout}", "--"]
  return _run(launch + args, timeout=timeout + 50)


def _load(out):
  with open(os.path.join(out, "responses.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  with open(os.path.join(out, "summary.json")) as f:
    return rows, json.load(f)


def _assert_same_responses(ref, got):
  """The same (prompt, sample) rows in the same order, with equal tokens and log-probs."""
  def key(rows):
    return [(r["prompt_id"], r["sample"]) for r in rows]
  assert key(got) == key(ref)
  for a, b in zip(ref, got, strict=True):
    assert a["tokens"] == b["tokens"], (a["prompt_id"], a["sample"])
    assert a["logprobs"] == b["logprobs"]


def _assert_process_logs(out, proc):
  """Only process 0 writes outputs; each process writes its own log."""
  for k in (0, 1):
    assert os.path.isfile(os.path.join(out, f"process_{k}.log"))
  assert "[p0]" in proc.stdout and "[p1]" in proc.stdout


# a pool of 20 pages a worker, admission on the bare predictions: the release's survivors have
# rows for the moved sequences, which then outgrow the first-run predictions and preempt
PAGED = SMALL + ["--config.rollout.kv=paged", "--config.rollout.kv_pages=20",
                 "--config.rollout.kv_margin=0"]


@pytest.mark.slow
def test_two_processes_match_one_paged(tmp_path):
  """flexfloor on the paged KV pool, release sizes 8 -> 2 -> 1: live sequences
  migrate before the release onto 2 workers, their pages moved by the SPMD page movers over the
  mesh that spans both processes (a ppermute), and sequences that outgrow their pool are
  preempted and prefilled again;
  token-identical to one process. (The fixed-slot cache runs across processes below, with every
  release size.)"""
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _, t1 = _rollout(one, "flexfloor", 1, PAGED)
  proc, t2 = _rollout(two, "flexfloor", 2, PAGED)
  print(f"paged flexfloor: 1 process {t1:.1f}s, 2 processes {t2:.1f}s")
  ref, s1 = _load(one)
  got, s2 = _load(two)
  _assert_same_responses(ref, got)
  for k in ("generated_tokens", "device_steps", "num_migrations", "preemptions",
            "kv_pages_allocated", "kv_peak_pages"):
    assert s2[k] == s1[k], k
  assert s1["kv"] == "paged" and s1["num_migrations"] > 0 and s1["preemptions"] > 0
  # every move sends its live pages (one process) or whole blocks of pages (SPMD), so at most
  # a block of padding more per move
  assert s2["kv_bytes_migrated"] >= s1["kv_bytes_migrated"] > 0
  _assert_process_logs(two, proc)
  assert [(r["workers"], r["final"]) for r in s2["releases"]] == \
      [(r["workers"], r["final"]) for r in s1["releases"]]


@pytest.mark.slow
def test_two_processes_match_one_chunked(tmp_path):
  """Chunked prefill (a page of prompt tokens per decode step) on the paged pool, flexfloor
  releasing 8 -> 2 -> 1 across the processes: each process builds the dispatches' input queues
  from its own copy of the host state, and the responses, steps and migrations are one
  process's."""
  opts = PAGED + ["--config.rollout.prefill_chunk=16"]
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _rollout(one, "flexfloor", 1, opts)
  proc, _ = _rollout(two, "flexfloor", 2, opts)
  ref, s1 = _load(one)
  got, s2 = _load(two)
  _assert_same_responses(ref, got)
  for k in ("generated_tokens", "device_steps", "num_migrations", "preemptions",
            "prefill_only_steps_while_decoding"):
    assert s2[k] == s1[k], k
  assert s1["prefill_chunk"] == 16 and s1["prefill_only_steps_while_decoding"] == 0
  assert s1["num_migrations"] > 0
  _assert_process_logs(two, proc)


# The README's two-process command as a user runs it, on half the preset's prompts (32
# responses: the same releases, in about half the decode steps): the preset's default release
# sizes (8 -> 6 -> 4 -> 2 -> 1), so the mesh of 6 is split unevenly over the processes (2 + 4
# devices) and migrations and expert moves cross the process boundary on it.
DEFAULT_SIZES = ["--config.scheduler.step_cost=steps",
                 "--config.rollout.lengths=workload", "--config.sampling.temperature=1.0",
                 "--config.sampling.seed=5", "--config.rollout.num_prompts=4"]
_BURN = "while True: pass"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two rollouts, one of them on cores it shares with other busy processes
def test_default_release_sizes_under_load_match_one(tmp_path):
  """flexfloor with every release size, 2 processes while busy processes compete for the
  cores: token-identical to one process. The load lets the processes' compiles drift apart, so
  a new mesh's first collective waits on the slower process; the uneven mesh of 6 moves KV rows
  and experts across the process boundary onto a reordered mesh."""
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _, t1 = _rollout(one, "flexfloor", 1, DEFAULT_SIZES)
  # The load: under `pytest -n 2` (README) the suite's other worker (the suite is CPU-bound: both
  # workers are busy until its last files); run alone, a burner.
  alone = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") == "1"
  burners = [subprocess.Popen([sys.executable, "-c", _BURN])] if alone else []
  try:
    _, t2 = _rollout(two, "flexfloor", 2, DEFAULT_SIZES, timeout=1200)
  finally:
    for b in burners:
      b.kill()
      b.wait()
  print(f"default release sizes: 1 process {t1:.1f}s, 2 processes under load {t2:.1f}s")
  ref, s1 = _load(one)
  got, s2 = _load(two)
  assert s2["release_sizes"] == s1["release_sizes"] and 6 in s2["release_sizes"]
  _assert_same_responses(ref, got)
  assert [(r["workers"], r["final"], r["stats"].get("expert_moves")) for r in s2["releases"]] == \
      [(r["workers"], r["final"], r["stats"].get("expert_moves")) for r in s1["releases"]]
  assert s2["num_migrations"] == s1["num_migrations"] > 0  # KV rows moved between workers
  # the release onto 6 workers (2 of process 0, 4 of process 1) moved experts
  assert s2["releases"][0]["workers"] == [0, 1] and s2["releases"][0]["stats"]["expert_moves"] > 0
  # process 0's workers are all released mid-run; it follows the control loop without devices
  early = [r for r in s2["releases"] if not r["final"]]
  assert {0, 1, 2, 3} <= {w for r in early for w in r["workers"]}, s2["releases"]
  assert s2["device_steps"] < 8 * s2["makespan_steps"]
  for k in (0, 1):
    assert os.path.isfile(os.path.join(two, f"process_{k}.log"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_two_processes_match_one_for_each_family(family, tmp_path):
  """The other families' tiny presets (configs/qwen3_moe.py, configs/gpt_oss.py,
  configs/deepseek_v3.py: its latent cache moved with the KV rows) on the
  fixed-slot cache, flexfloor 8 -> 2 -> 1 across the host boundary: token- and log-prob-identical
  to one process, with the same releases."""
  options = [*SMALL, "--config.rollout.samples_per_prompt=4",
             "--config.rollout.max_new_tokens=16"]
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  args = [f"--config=configs/{family}.py", *options]
  _, t1 = _rollout(one, "flexfloor", 1, args)
  proc, t2 = _rollout(two, "flexfloor", 2, args)
  print(f"{family} flexfloor: 1 process {t1:.1f}s, 2 processes {t2:.1f}s")
  ref, s1 = _load(one)
  got, s2 = _load(two)
  _assert_same_responses(ref, got)
  assert s1["generated_tokens"] == s2["generated_tokens"] > 0
  assert len(s1["releases"]) >= 1
  assert [(r["workers"], r["final"]) for r in s2["releases"]] == \
      [(r["workers"], r["final"]) for r in s1["releases"]]
  _assert_process_logs(two, proc)


def _store_of(rows, path):
  """A response store holding `rows`' responses as an earlier epoch: the drafts are right."""
  from flexfloor_jax.policy.drafts import ResponseStore
  store = ResponseStore("byte")  # the tiny preset's byte tokenizer
  store.add_rollout(0, [(r["prompt_id"], r["sample"], r["tokens"]) for r in rows])
  store.save(path)
  return path


@pytest.mark.slow
def test_two_processes_match_one_drafting(tmp_path):
  """Speculative decoding on the paged pool, flexfloor releasing 8 -> 2 -> 1 across the
  processes: each process drafts from its own copy of the host state and the store; the
  responses, steps, drafted and accepted tokens are one process's. Against plain decoding the
  tokens are the same; the pool preempts sequences (whose KV a later prefill recomputes, within
  fp32 rounding of what decoding wrote) at other points when rows run ahead by their drafts, so
  the log-probs agree within 1e-5."""
  plain, one, two = (str(tmp_path / n) for n in ("plain", "one", "two"))
  _rollout(plain, "flexfloor", 1, PAGED)
  ref, s0 = _load(plain)
  stores = [_store_of(ref, str(tmp_path / f"store_{n}.npz")) for n in ("one", "two")]
  _rollout(one, "flexfloor", 1, PAGED + ["--config.rollout.draft_tokens=4",
                                        f"--config.rollout.draft_store={stores[0]}"])
  proc, _ = _rollout(two, "flexfloor", 2, PAGED + ["--config.rollout.draft_tokens=4",
                                                  f"--config.rollout.draft_store={stores[1]}"])
  got1, s1 = _load(one)
  got2, s2 = _load(two)
  _assert_same_responses(got1, got2)
  for k in ("generated_tokens", "device_steps", "num_migrations", "preemptions",
            "drafted_tokens", "accepted_tokens"):
    assert s2[k] == s1[k], k
  assert s1["accepted_tokens"] > 0 and s1["device_steps"] < s0["device_steps"]
  assert s0["preemptions"] > 0
  for a, b in zip(ref, got1, strict=True):
    assert (a["prompt_id"], a["sample"], a["tokens"]) == (b["prompt_id"], b["sample"], b["tokens"])
    assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) <= 1e-5
  _assert_process_logs(two, proc)
