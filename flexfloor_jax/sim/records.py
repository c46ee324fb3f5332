"""Run records of measured rollouts, their replay, and the cpu preset calibrated on them.

A run record (bench_out/runs/*.json, written by flexfloor_jax.bench) holds what replaying a
measured rollout needs: its sequences, their actual lengths, the length history it was scheduled
with, the policy fields, and the measured timeline. `calibrate_and_predict` fits the `cpu` preset
(`costs.LinearCost`) on some records and replays others on it: device_steps must match exactly
(same policy code), wall seconds within 25%.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import SimpleNamespace

from flexfloor_jax.io.jsonl import read_json
from flexfloor_jax.policy import accounting
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.floor import preallocated_slots
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rollout import kv_pool
from flexfloor_jax.sim.costs import LinearCost, fit_cpu, named_step_cost
from flexfloor_jax.sim.presets import Model
from flexfloor_jax.sim.replay import replay


def make_run_record(*, name: str, epoch: int, seqs: list[Seq], lengths: Mapping[int, int],
                    history, schedule: str, placement: str, compaction: bool, num_workers: int,
                    slots_per_worker: int, floor: int, steps_per_dispatch: int, num_experts: int,
                    timeline: accounting.Timeline, summary: dict,
                    kv: dict | None = None) -> dict:
  """`kv`: paged KV, the run's pool (kv_pages, page_size, max_seqs_per_worker, kv_margin,
  max_seq_len; slots_per_worker is then its max_seqs); None: fixed slots (no 'kv' key)."""
  keep = ("device_steps", "tokens_per_device_step", "generation_wall_s", "generated_tokens",
          "idle_after_finish_fraction", "slot_utilization", "throughput_tokens_per_s",
          "makespan_steps", "occupied_device_seconds")
  return dict(name=name, epoch=int(epoch), schedule=schedule, placement=placement,
              compaction=bool(compaction), num_workers=num_workers,
              slots_per_worker=slots_per_worker, floor=floor,
              steps_per_dispatch=steps_per_dispatch, num_experts=int(num_experts),
              expert_slots=preallocated_slots(schedule, num_experts, num_workers, floor),
              seqs=[dataclasses.asdict(s) for s in seqs],
              lengths={str(k): int(v) for k, v in lengths.items()},
              history={p: {str(e): v for e, v in d.items()} for p, d in history.data.items()},
              release_sizes=summary.get("release_sizes"),
              makespan_slack=summary.get("makespan_slack", 0.05),
              step_cost=summary.get("step_cost", "measured"),
              prefill_chunk=int(summary.get("prefill_chunk", 0)),
              step_seconds={str(k): v for k, v in history.step_seconds.items()},
              timeline=timeline.to_dict(), summary={k: summary[k] for k in keep if k in summary},
              **({"kv": dict(kv)} if kv else {}))


def load_run_record(path: str) -> dict:
  rec = read_json(path, "a run record")
  need = {"seqs", "lengths", "history", "schedule", "timeline", "num_workers"}
  if not isinstance(rec, dict) or not need <= set(rec):
    raise ValueError(f"{path} is not a run record (written by flexfloor_jax.bench into "
                     f"<output_dir>/runs/); it needs keys {sorted(need)}")
  return rec


def kv_factory(spec: dict | None, num_workers: int):
  """A run record's paged pool -> (predicted lengths) -> a fresh PagePool, built as the runner
  builds it (kv_pool.make_pool); None for a fixed-slot record."""
  if not spec:
    return None

  r = SimpleNamespace(kv_pages=spec["kv_pages"], page_size=spec["page_size"],
                      max_seqs=spec["max_seqs_per_worker"], kv_margin=spec["kv_margin"],
                      slots_per_worker=spec["max_seqs_per_worker"])
  return kv_pool.pool_factory(r, num_workers, spec["max_seq_len"])


def replay_record(rec: dict, cost=None, model: Model | None = None):
  seqs = [Seq(**s) for s in rec["seqs"]]
  lengths = {int(k): v for k, v in rec["lengths"].items()}
  hist = LengthHistory(rec["history"], rec.get("step_seconds"))
  step_cost = rec.get("step_cost", "measured")
  # a run that decided in a named pair's seconds is replayed deciding in them too
  policy_cost = named_step_cost(step_cost, seqs) if step_cost.startswith("roofline:") else None
  return replay(seqs, lengths, hist, rec["schedule"], rec["num_workers"], rec["slots_per_worker"],
                rec["floor"], cost=cost, model=model,
                steps_per_dispatch=rec["steps_per_dispatch"],
                placement=rec.get("placement", "auto"), compaction=rec.get("compaction", True),
                epoch=rec.get("epoch", 0), num_experts=rec.get("num_experts", 8),
                sizes=rec.get("release_sizes"), makespan_slack=rec.get("makespan_slack", 0.05),
                step_cost=step_cost, policy_cost=policy_cost,
                kv=kv_factory(rec.get("kv"), rec["num_workers"]),
                prefill_chunk=rec.get("prefill_chunk", 0))


def fit_records(recs: list[dict], name: str = "") -> LinearCost:
  """The cpu preset fitted on measured run records (one workload: e.g. its static and flexfloor
  rollouts)."""
  return fit_cpu([(accounting.Timeline.from_dict(r["timeline"]), r.get("expert_slots", 1))
                  for r in recs], name or "+".join(str(r.get("name", "?")) for r in recs))


def predict_record(cost: LinearCost, rec: dict) -> dict:
  """Replay a measured run on the fitted cpu preset: device_steps (must match exactly: same
  policy code) and wall seconds (target: within 25%) against what was measured."""
  m, _ = replay_record(rec, cost=cost)
  measured = accounting.metrics(accounting.Timeline.from_dict(rec["timeline"]))
  wall = float(m["generation_wall_s"])
  return dict(name=rec.get("name"), measured_device_steps=measured["device_steps"],
              predicted_device_steps=m["device_steps"],
              device_steps_exact=measured["device_steps"] == m["device_steps"],
              measured_wall_s=measured["generation_wall_s"], predicted_wall_s=wall,
              wall_rel_error=wall / measured["generation_wall_s"] - 1.0)


def calibrate_and_predict(fit_recs, pred_recs) -> dict:
  """Fit the cpu preset on `fit_recs` (one workload), predict each of `pred_recs` (held out)."""
  fit_recs = [fit_recs] if isinstance(fit_recs, dict) else list(fit_recs)
  pred_recs = [pred_recs] if isinstance(pred_recs, dict) else list(pred_recs)
  cost = fit_records(fit_recs)
  return dict(cpu_preset=cost.to_dict(), fit=[predict_record(cost, r) for r in fit_recs],
              predictions=[predict_record(cost, r) for r in pred_recs])


def format_calibration(r: dict) -> str:
  """What `python -m flexfloor_jax.sim --calibrate=... --predict=...` prints."""
  c = r["cpu_preset"]
  lines = [f"cpu preset, least squares on {c['fitted_on']}:",
           "  " + ", ".join(f"{k}={c[k] * 1e3:.3f}ms" for k in LinearCost.NAMES)]
  for tag, rows in (("fit", r["fit"]), ("held out", r["predictions"])):
    for p in rows:
      lines.append(f"  {tag:8} {p['name']:>16}: device_steps measured {p['measured_device_steps']}"
                   f" predicted {p['predicted_device_steps']} "
                   f"({'exact' if p['device_steps_exact'] else 'MISMATCH'}); wall measured "
                   f"{p['measured_wall_s']:.2f} s predicted {p['predicted_wall_s']:.2f} s "
                   f"({p['wall_rel_error'] * 100:+.1f}%)")
  return "\n".join(lines)

