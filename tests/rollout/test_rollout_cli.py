"""The rollout CLI end to end, as a user runs it: `python -m flexfloor_jax.rollout`.

1. Bad input exits 2 with one `error:` line naming the field, and nothing else: no traceback,
   no log line, nothing compiled (JAX_LOG_COMPILES=1 would print a line per compile), no output
   file. One real run shows it (a misspelled field, which only the flag parser can catch); every
   other bad input is checked in process by test_inputs.py, through the checks this CLI runs.
2. With a tiny Hugging Face checkpoint, greedy decoding through the CLI reproduces transformers'
   `generate(do_sample=False)` token for token (EOS stopping on both sides, with an eos id the
   greedy continuations actually emit), under a user's XLA flags (test_user_flags.py).
3. The default-shaped rollout on 8 emulated workers writes responses.jsonl, summary.json with
   every metric, and timeline.png, for both schedules.
(Ctrl-C and SIGTERM at each stage of this CLI: tests/reliability/test_nothing_lost.py.)

The CLI runs share the suite's persistent compilation cache (checkout.child_env).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import checkout
import hf_utils
import numpy as np
import pytest
from checkout import ROOT

BACKEND_PROBE = re.compile(r"^I\d{4} [\d:.]+ +\d+ xla_bridge\.py:\d+\] Unable to initialize "
                           r"backend '\w+'")
BAD_INPUT_SECONDS = 30  # a jax import on a loaded 2-core machine; a compile-and-run takes longer
METRICS = ("device_steps", "device_steps_prefill", "device_steps_decode", "tokens_per_device_step",
           "occupied_device_seconds", "idle_after_finish_fraction", "slot_utilization",
           "throughput_tokens_per_s")
RESPONSE_FIELDS = ("prompt_id", "sample", "tokens", "text", "finish_reason", "num_tokens",
                   "logprobs")


def run_cli(args, *, timeout: float, log_compiles: bool = False, config="configs/mixtral.py"):
  """(CompletedProcess, wall seconds)."""
  cmd = [sys.executable, "-m", "flexfloor_jax.rollout", f"--config={config}", *args]
  env = checkout.child_env(**({"JAX_LOG_COMPILES": "1"} if log_compiles else {}))
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  return proc, time.perf_counter() - t0


def _write_jsonl(path, rows) -> str:
  with open(path, "w") as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


# ----------------------------------------------------------------------------- a tiny HF checkpoint


@pytest.fixture(scope="module")
def greedy_case(tmp_path_factory):
  """A tiny random transformers Mixtral (hf_utils "gqa" shape, max_position_embeddings 256 >= the
  64-token cache used here), saved with an eos id that the greedy continuations emit, so EOS
  stopping is exercised; prompts as token ids (no tokenizer.json); torch's greedy reference."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")

  # initializer_range 0.5 (hf_utils' gqa case uses 0.15): logits spread about three times wider,
  # so reference top-2 margins under 1e-2 are rare; at 0.15 they are common enough to hit the 1%
  # bound below for reasons that say nothing about us.
  model = hf_utils.build_model(
      hf_utils.mixtral_config(**dict(hf_utils.CASES["gqa"], initializer_range=0.5)), seed=0)
  rng = np.random.default_rng(5)
  lengths = [16, 5, 12, 9, 14, 7, 11, 15, 6, 13, 10, 8, 16, 4, 12, 9]
  prompts = {f"p{i}": rng.integers(3, model.config.vocab_size, n).tolist()
             for i, n in enumerate(lengths)}

  def generate(tokens, eos):
    with torch.no_grad():
      out = model.generate(input_ids=torch.tensor([tokens]),
                           attention_mask=torch.ones((1, len(tokens)), dtype=torch.long),
                           do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS, eos_token_id=eos,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return (out.sequences[0, len(tokens):].tolist(),
            torch.stack(out.logits, 0)[:, 0].numpy().astype(np.float64))

  # The eos id: the token that the free-running greedy output of the first prompt without a near
  # tie in its first 11 steps emits at step 10, so that prompt (and any other that emits it)
  # stops at EOS inside the compared region while the rest run to max_new_tokens.
  for toks in prompts.values():
    free, logits = generate(toks, None)
    top2 = np.sort(logits[:11], -1)[:, -2:]
    if (top2[:, 1] - top2[:, 0]).min() >= GREEDY_MARGIN:
      eos = int(free[10])
      break
  else:
    raise AssertionError("every prompt has a near tie in its first 11 greedy steps")
  model.config.eos_token_id = eos
  model.generation_config.eos_token_id = eos
  path = str(tmp_path_factory.mktemp("cli_hf") / "greedy")
  hf_utils.save(model, path)
  with open(f"{path}/config.json") as f:
    assert json.load(f)["eos_token_id"] == eos
  ref = {pid: generate(toks, eos) for pid, toks in prompts.items()}
  return dict(path=path, prompts=prompts, eos=eos, ref=ref)


# ----------------------------------------------------------------------------- 1. bad input


def test_bad_input_through_the_real_cli(tmp_path):
  """A misspelled config field, as a user runs it (JAX_LOG_COMPILES=1): exit 2, one `error:`
  line naming the flag with ml_collections' hint, quickly, nothing on stdout, no output file."""
  out = tmp_path / "out"
  proc, secs = run_cli(["--config.rollout.max_new_tokenz=4", f"--config.rollout.output_dir={out}"],
                       timeout=4 * BAD_INPUT_SECONDS, log_compiles=True)
  # jax's own INFO line when it probes for a TPU on a CPU-only machine is the only other line
  # tolerated.
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not BACKEND_PROBE.match(ln)]
  assert proc.returncode == 2, proc.stderr[-3000:]  # config.cli.fail's status
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert len(lines) == 1, proc.stderr[-3000:]  # no usage hint, no log or compile line
  assert lines[0].startswith("error: --config.rollout.max_new_tokenz"), lines
  assert "max_new_tokenz" in lines[0] and "Did you mean" in lines[0], lines
  assert secs < BAD_INPUT_SECONDS, f"took {secs:.1f}s"
  assert proc.stdout.strip() == "" and not (out.exists() and any(out.iterdir()))


# ----------------------------------------------------------------------------- 2. greedy parity

GREEDY_NEW_TOKENS = 32
GREEDY_MARGIN = 1e-2  # compare only while the reference's top-1 beats top-2 by this much
MAX_CLOSE_FRACTION = 0.01
LOGPROB_TOL = 1e-3  # fp32 logits agree to ~1e-4 (test_hf_parity); log-softmax adds a little


@pytest.mark.user_flags
def test_cli_greedy_matches_transformers(greedy_case, tmp_path):
  """The CLI at temperature 0 with 'model' lengths (stop at EOS or max_new_tokens) emits what
  transformers' greedy generate() emits with the same eos id, token for token, up to the first
  position where the reference's top-2 margin is under 1e-2 (a near tie may flip; those positions
  are counted and may be at most 1%). Log-probs are checked at every compared position."""
  prompts = _write_jsonl(tmp_path / "prompts.jsonl",
                         [{"id": k, "tokens": v} for k, v in greedy_case["prompts"].items()])
  out = tmp_path / "out"
  proc, secs = run_cli([
      f"--config.model.checkpoint={greedy_case['path']}", f"--config.rollout.prompts={prompts}",
      "--config.sampling.temperature=0", "--config.rollout.lengths=model",
      f"--config.rollout.max_new_tokens={GREEDY_NEW_TOKENS}",
      "--config.rollout.samples_per_prompt=1", "--config.rollout.slots_per_worker=8",
      "--config.mesh.num_devices=2", "--config.schedule=static",
      f"--config.rollout.output_dir={out}"], timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(out / "responses.jsonl") as f:
    ours = {r["prompt_id"]: r for r in map(json.loads, f)}
  assert sorted(ours) == sorted(greedy_case["prompts"])
  # no length flag: the checkpoint's max_position_embeddings (256) is not refused, and the KV
  # cache is what the run needs
  with open(out / "summary.json") as f:
    longest = max(len(t) for t in greedy_case["prompts"].values())
    assert json.load(f)["max_seq_len"] == longest + GREEDY_NEW_TOKENS
  eos = greedy_case["eos"]
  total = compared = close = 0
  reasons = []
  max_lp = 0.0
  for pid, (ref_tok, ref_logits) in greedy_case["ref"].items():
    o = ours[pid]
    assert o["num_tokens"] == len(o["tokens"]) == len(o["logprobs"])
    top2 = np.sort(ref_logits, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    ref_lp = ref_logits - ref_logits.max(-1, keepdims=True)
    ref_lp = ref_lp - np.log(np.exp(ref_lp).sum(-1, keepdims=True))
    total += len(ref_tok)
    for i, t in enumerate(ref_tok):
      if margin[i] < GREEDY_MARGIN:
        close += 1
        break
      compared += 1
      assert i < len(o["tokens"]) and o["tokens"][i] == t, (
          f"{pid} step {i}: ours {o['tokens'][i:i + 1]} vs transformers {t} "
          f"(margin {margin[i]:.3g})\nours {o['tokens']}\nref  {ref_tok}")
      max_lp = max(max_lp, abs(o["logprobs"][i] - ref_lp[i, t]))
    else:  # compared to the end: the same length and the same reason to stop
      assert o["tokens"] == ref_tok
      want = "eos" if ref_tok[-1] == eos and len(ref_tok) < GREEDY_NEW_TOKENS else "length"
      assert o["finish_reason"] == want, (pid, o["finish_reason"], want)
      reasons.append(want)
  print(f"greedy CLI vs transformers: {compared}/{total} positions compared, {close} too close "
        f"(margin < {GREEDY_MARGIN}); fully compared: {reasons.count('eos')} stopped at EOS, "
        f"{reasons.count('length')} at max_new_tokens; logprob max|diff| {max_lp:.2g}; {secs:.1f}s")
  assert close <= MAX_CLOSE_FRACTION * total, f"{close} of {total} positions closer than margin"
  assert set(reasons) == {"eos", "length"}, f"EOS stopping not exercised both ways: {reasons}"
  assert max_lp <= LOGPROB_TOL


# ----------------------------------------------------------------------------- 3. default rollout


# flexfloor compiles a mesh per release size: several times static's time, so it is marked slow.
@pytest.mark.parametrize("schedule", ["static", pytest.param("flexfloor", marks=pytest.mark.slow)])
def test_default_rollout_writes_outputs(schedule, tmp_path):
  """The default-shaped run (8 prompts x 8 samples, 256 new tokens, 4 slots) on 8 emulated
  workers with workload lengths writes every output and every metric."""
  out = tmp_path / "out"
  proc, secs = run_cli(["--config.rollout.lengths=workload", f"--config.schedule={schedule}",
                        f"--config.rollout.output_dir={out}"], timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  print(f"{schedule} default rollout: {secs:.1f}s; {proc.stdout.strip()}")
  with open(out / "summary.json") as f:
    s = json.load(f)
  with open(out / "responses.jsonl") as f:
    responses = [json.loads(line) for line in f]

  assert s["num_workers"] == 8 and s["schedule"] == schedule and s["lengths"] == "workload"
  for k in METRICS:
    assert k in s, k
    assert isinstance(s[k], (int, float)) and math.isfinite(s[k]) and s[k] >= 0, (k, s[k])
  assert s["device_steps"] == s["device_steps_prefill"] + s["device_steps_decode"] > 0
  assert 0 <= s["idle_after_finish_fraction"] < 1
  assert 0 < s["slot_utilization"] <= 1
  assert s["occupied_device_seconds"] > 0 and s["throughput_tokens_per_s"] > 0
  generated = sum(r["num_tokens"] for r in responses)
  assert s["tokens_per_device_step"] == pytest.approx(generated / s["device_steps"])

  assert len(responses) == 64 == s["num_sequences"]
  assert sorted((r["prompt_id"], r["sample"]) for r in responses) == sorted(
      (f"builtin-{i}", j) for i in range(8) for j in range(8))
  for r in responses:
    assert set(RESPONSE_FIELDS) <= set(r), set(RESPONSE_FIELDS) - set(r)
    assert r["num_tokens"] == len(r["tokens"]) == len(r["logprobs"]) >= 1
    assert r["finish_reason"] == "target"  # workload lengths ignore EOS
    assert isinstance(r["text"], str)
    assert all(lp <= 1e-6 and math.isfinite(lp) for lp in r["logprobs"])

  png = out / "timeline.png"
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  import matplotlib.image

  img = matplotlib.image.imread(png)
  assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
