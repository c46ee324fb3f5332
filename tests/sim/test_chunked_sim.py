"""Chunked prefill in the simulator: the roofline prices a mixed step, the lower bounds stay
bounds, the replay prices what the timeline records, and every schedule's makespan shortens
against one-shot prefill on a small group."""

from typing import Any

import numpy as np
import pytest

from flexfloor_jax.policy import accounting, plan, release_policy, stepsim, workload
from flexfloor_jax.policy import costs as pcosts
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.sim import bounds, cluster, costs, presets, replay

LABELS = ("static", "balanced", "flexfloor", "oracle_balanced", "oracle_flexfloor")


def hand_roofline(m, hw, n, rows, kv, prompt):
  """One step of n workers from the roofline's first principles, written out here on its own:
  each worker holds E/n experts and runs `rows` decode tokens reading `kv` cached tokens and
  `prompt` prompt tokens (a prompt's causal attention: P^2 / 2 token-context products, its KV
  written and read once). Per worker the slower of its HBM reads (replicated weights less the
  embedding table, each held expert some token of the step is routed to, the KV) and its FLOPs
  (2 per weight per token, routed copies at top_k / E of the group's tokens per expert held,
  attention over the context); plus the launch, and the two all_to_alls of every layer with
  their latency."""
  held = m.experts / n
  tok = rows + prompt
  group = n * tok
  touched = 1.0 - (1.0 - m.top_k / m.experts) ** group
  read = (m.nonexpert_params - m.vocab * m.hidden) * m.dtype_bytes \
      + held * touched * m.expert_params * m.dtype_bytes \
      + (kv + prompt) * m.layers * 2 * m.kv_heads * m.head_dim * m.dtype_bytes
  flops = 2.0 * tok * (m.nonexpert_params - m.vocab * m.hidden) \
      + 2.0 * group * m.top_k * held / m.experts * m.expert_params \
      + 4.0 * m.layers * m.heads * m.head_dim * (kv + prompt * prompt / 2)
  t = hw.step_overhead_s + max(read / hw.hbm_bw, flops / hw.peak_flops)
  if n > 1:
    t += (2.0 * m.layers * tok * m.top_k * m.hidden * m.dtype_bytes * (n - 1) / n / hw.link_bw
          + 2 * m.layers * hw.collective_latency_s)
  return t


@pytest.mark.parametrize("model, hw, n, rows, ctx, prompt", [
    ("mixtral-8x7b", "h100", 8, 4, 700, 256),
    ("mixtral-8x7b", "h100", 2, 1, 3000, 2048),
    ("qwen3-30b-a3b", "tpu-v5p", 8, 16, 1200, 64),
    ("qwen3-30b-a3b", "h200", 4, 2, 500, 4096),
])
def test_a_mixed_step_lies_between_the_decode_step_and_it_plus_a_prefill(model, hw, n, rows,
                                                                         ctx, prompt):
  """Every worker runs `rows` rows of `ctx` cached tokens and a prompt of `prompt` tokens in one
  step: slower than the decode step alone, faster than that step followed by the one-shot
  prefill of the same prompts (the weights are read once, not twice; the prompt's FLOPs are
  the same). The two brackets come from the hand roofline above, checked against the code's
  decode and prefill steps."""
  m, h = presets.MODELS[model], presets.HARDWARE[hw]
  c = costs.RooflineStepCost(m, h, ctx)
  r, kv, p = np.full(n, float(rows)), np.full(n, rows * float(ctx)), np.full(n, float(prompt))
  decode = hand_roofline(m, h, n, rows, rows * ctx, 0)
  prefill = hand_roofline(m, h, n, 0, 0, prompt)
  assert c.worker_step_seconds(r, kv) == pytest.approx(decode, rel=1e-9)
  assert c.prefill_seconds(p) == pytest.approx(prefill, rel=1e-9)
  mixed = c.mixed_seconds(r, kv, p, np.zeros(n))
  assert decode < mixed < decode + prefill
  assert mixed == pytest.approx(hand_roofline(m, h, n, rows, rows * ctx, prompt), rel=1e-9)
  # no input tokens: the decode step; no rows: the prefill step
  assert c.mixed_seconds(r, kv, np.zeros(n), np.zeros(n)) == c.worker_step_seconds(r, kv)
  z = np.zeros(n)
  assert c.mixed_seconds(z, z, p, z) == pytest.approx(prefill, rel=1e-9)
  # a chunk later in its prompt reads its prefix: never cheaper
  assert c.mixed_seconds(r, kv, p, p * 3) >= mixed


def test_a_measured_step_table_prices_the_decode_part_and_the_roofline_the_rest():
  """--hardware=measured: a mixed step is the measured decode step plus what its input tokens
  add on the roofline (workers alike here, so the two differences are the same)."""

  class Table:
    def worker_seconds(self, model, held, tokens, ctx):
      return np.full(len(held), 0.01)

  m = presets.MODELS["mixtral-8x7b"]
  base = presets.HARDWARE["h100"]
  hw = presets.Hardware(**{**base.__dict__, "step_table": Table()})
  roof, meas = costs.RooflineCost(m, base), costs.RooflineCost(m, hw)
  held, r, kv, ch = np.ones(8), np.full(8, 4.0), np.full(8, 2800.0), np.full(8, 512.0)
  z = np.zeros(8)
  extra = roof.mixed_seconds(held, r, kv, ch, z) - roof.step_seconds(held, r, kv)
  assert extra > 0
  assert meas.mixed_seconds(held, r, kv, ch, z) == pytest.approx(
      meas.step_seconds(held, r, kv) + extra, rel=1e-9)
  assert meas.mixed_seconds(held, r, kv, z, z) == meas.step_seconds(held, r, kv)


def _run(seqs, workers, slots, cost, chunk):
  queues = {w: [s.seq_id for s in seqs[w::workers]] for w in range(workers)}
  pol = release_policy.ReleasePolicy(enabled=False)
  return stepsim.simulate(seqs, None, queues, pol, workers, slots, 8, cost=cost,
                          prefill_chunk=chunk)


def test_no_chunked_run_beats_the_chunked_bound():
  """Random lengths, prompts and chunks on the roofline: every chunked run stays above both
  bounds made for its chunk; one long prompt alone on one worker meets its makespan bound
  within 2% (its prompt steps of a full chunk, then one row a step)."""
  rng = np.random.default_rng(1)
  m, hw = presets.MODELS["qwen3-30b-a3b"], presets.HARDWARE["tpu-v5p"]
  cost = costs.RooflineStepCost(m, hw, 0.0)
  for _ in range(5):
    L = rng.integers(1, 200, 24)
    seqs = [Seq(i, f"p{i}", 0, int(rng.integers(16, 600)), int(n), 256) for i, n in enumerate(L)]
    chunk = int(rng.integers(8, 512))
    run = _run(seqs, 4, 3, cost, chunk)
    b = bounds.lower_bound(L, [s.prompt_len for s in seqs], cost, max_workers=4, max_seqs=3,
                           min_workers=1, prefill_chunk=chunk)
    assert run["makespan_s"] >= b["makespan_s"]
    assert run["occupied_device_seconds"] >= b["occupied_device_seconds"]
    assert run["prefill_only_steps_while_decoding"] == 0
  for chunk in (16, 128, 512, 1024):  # 128 experts, top-8: each chunk touches most of them
    run = _run([Seq(0, "p", 0, 512, 300, 1024)], 1, 1, cost, chunk)
    b = bounds.lower_bound([300], [512], cost, max_workers=1, max_seqs=1, min_workers=1,
                           prefill_chunk=chunk)
    assert b["makespan_s"] <= run["makespan_s"] <= 1.02 * b["makespan_s"], chunk


def test_replay_prices_mixed_steps_as_the_step_simulator_does():
  """The sim's executor (replay.CostExecutor on RooflineCost) and the step simulator (on
  RooflineStepCost) run the same chunked static rollout in the same seconds (8 workers hold one
  expert each on both); the `cpu` preset's row term counts the rows each step decodes, those
  that turn live inside a dispatch included (the timeline's expansion)."""
  spec = workload.WorkloadSpec()
  seqs = workload.make_seqs(spec, 0, prompt_len=96)
  m, hw = presets.MODELS["mixtral-8x7b"], presets.HARDWARE["h100"]
  got, rec = replay.replay(seqs, None, LengthHistory(), "static", 8, 4, 8, model=m,
                           cost=costs.RooflineCost(m, hw), prefill_chunk=40)
  queues, policy, _ = plan.plan_rollout(seqs, LengthHistory(), "static", 8, 4, 8)
  ref = stepsim.simulate(seqs, None, queues, policy, 8, 4, 8, prefill_chunk=40,
                         cost=costs.RooflineStepCost(m, hw, 0.0))
  assert got["device_steps"] == ref["device_steps"] and got["prefill_steps"] == 0
  assert got["generation_wall_s"] == pytest.approx(ref["generation_wall_s"], rel=1e-9)
  one, _ = replay.replay(seqs, None, LengthHistory(), "static", 8, 4, 8, model=m,
                         cost=costs.RooflineCost(m, hw))
  assert one["prefill_only_steps_while_decoding"] > 0 == got["prefill_only_steps_while_decoding"]
  lin, rec = replay.replay(seqs, None, LengthHistory(), "static", 8, 4, 8,
                           cost=costs.LinearCost(decode_slot_step=1.0), prefill_chunk=40)
  by = accounting.finishes_by_step(rec.timeline)
  rows = sum(int(accounting.dispatch_steps(rec.timeline, r, by)["rows"].sum())
             for r in rec.timeline.steps)
  assert lin["generation_wall_s"] == pytest.approx(rows)
  assert rows == lin["generated_tokens"] - len(seqs)  # every token but the first decodes


def test_every_schedule_is_faster_with_chunks_on_a_small_group():
  """One EP group of 8 H100s running Mixtral 8x7B (4 sequences a device, 4 slots, prompts of
  256): chunked prefill shortens every schedule's makespan, the oracles' too, and no step of it
  is prefill-only while a row decodes; the bound (asserted inside) holds for both."""
  m, hw = presets.MODELS["mixtral-8x7b"], presets.HARDWARE["h100"]
  kw: dict[str, Any] = dict(length_scale=1.0, processes=1, seqs_per_device=4,
                            samples_per_prompt=4)
  one = cluster.simulate_cluster(m, hw, 8, **kw)
  chk = cluster.simulate_cluster(m, hw, 8, prefill_chunk=256, **kw)
  assert one["prefill_chunk"] == one["prefill_chunk_tokens"] == 0
  assert chk["prefill_chunk"] == 256 and 1 <= chk["prefill_chunk_tokens"] <= 256
  for label in LABELS:
    assert chk[label]["generation_wall_s"] < one[label]["generation_wall_s"], label
    assert one[label]["prefill_only_steps_while_decoding"] > 0
    assert chk[label]["prefill_only_steps_while_decoding"] == 0
  with pytest.raises(ValueError, match="prefill_chunk"):
    cluster.simulate_cluster(m, hw, 8, prefill_chunk=-1, **kw)


def test_admission_chunk_on_the_roofline_stops_where_compute_takes_over():
  """Mixtral 8x7B on 8 H100s, 4 rows of 512 cached tokens a worker: a decode step reads ~14 GB
  a worker (4.5 ms) and an input token costs ~26 us of compute, so ~170 tokens hide under the
  reads and ~18 more fit in a tenth of the step."""
  m, hw = presets.MODELS["mixtral-8x7b"], presets.HARDWARE["h100"]
  c = costs.RooflineStepCost(m, hw, 512.0)
  got = pcosts.admission_chunk(c, 4096, 4, 512.0, 8)
  r, kv = np.full(8, 4.0), np.full(8, 2048.0)
  base = c.worker_step_seconds(r, kv)
  assert c.mixed_seconds(r, kv, np.full(8, float(got)), np.zeros(8)) <= 1.1 * base
  assert c.mixed_seconds(r, kv, np.full(8, got + 1.0), np.zeros(8)) > 1.1 * base
  assert 120 < got < 260
  assert pcosts.admission_chunk(c, 64, 4, 512.0, 8) == 64

