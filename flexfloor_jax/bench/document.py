"""bench.json's comparisons: the ratios of each schedule to static, the bound a workload sets, the
ceiling of release alone, speculative decoding against plain decoding, the calibration of the
simulator's cpu preset, and the document itself."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from flexfloor_jax.policy import release_policy, scheduler, stepsim
from flexfloor_jax.policy.accounting import jsonable
from flexfloor_jax.policy.floor import floor_workers
from flexfloor_jax.rollout import kv_pool
from flexfloor_jax.sim import bounds
from flexfloor_jax.sim.costs import RooflineStepCost
from flexfloor_jax.sim.presets import parse_cost_model
from flexfloor_jax.sim.records import calibrate_and_predict

PAPER_TOKENS_PER_DEVICE_TIME = 1.654  # +65.4% response tokens per occupied device time
PAPER_THROUGHPUT = 1.527  # +52.7% generation throughput

# Speculative decoding (bench.draft_tokens > 0): "<schedule>_draft" is <schedule> drafting
DRAFT_SUFFIX = "_draft"
DRAFTED_SCHEDULES = ("static", "balanced", "flexfloor")  # the schedules run drafting too
# drafting keeps flexfloor's advantage when flexfloor_draft / static_draft is at least
# flexfloor / static less this (tokens per occupied device-second and throughput alike)
DRAFTING_ADVANTAGE_TOLERANCE = 0.02


def is_drafted(name: str) -> bool:
  """Whether a run of this name drafted (speculative decoding)."""
  return name.endswith(DRAFT_SUFFIX)


def ratios(a: dict, b: dict) -> dict:
  return {k: a[k] / b[k] for k in a if k in b and isinstance(b[k], (int, float)) and b[k]}


def same_responses(a: list[dict], b: list[dict]) -> bool:
  def key(r):
    return (r["prompt_id"], r["sample"])

  return {key(r): r["tokens"] for r in a} == {key(r): r["tokens"] for r in b}


def paged(summary: dict) -> bool:
  """Whether a run's summary.json is of the paged KV pool (rollout.kv='paged')."""
  return summary.get("kv") == "paged"


def lanes(summary: dict) -> int:
  """Sequences a worker runs at once: the fixed slots, or the paged pool's rows."""
  return summary["max_seqs_per_worker"] if paged(summary) else summary["slots_per_worker"]


def pool_factory(c, summary: dict):
  """Paged KV: (predicted lengths) -> a fresh PagePool built exactly as the runner built the run's
  (kv_pool.make_pool from the run's rollout settings, workers and max_seq_len); None: fixed
  slots."""
  if not paged(summary):
    return None
  return kv_pool.pool_factory(c.rollout, summary["num_workers"], summary["max_seq_len"])


def oracle_policy(seqs, ff_result, static: dict, steps_per_dispatch: int, kv=None) -> dict:
  """The oracle policy (not a bound: a heuristic told the answers, which a schedule can beat):
  the balanced placement of the *actual* lengths with release and the shared queue, in the step
  simulator (the engine's own steps for the same lengths), at flexfloor's floor and release
  sizes. `kv`: paged KV, the runs' pool factory (it runs on the same pool, admitting by the
  actual lengths)."""
  s = ff_result.summary
  lengths = {q: f.num_tokens for q, f in ff_result.record.finishes.items()}
  by_id = {x.seq_id: x for x in seqs}
  n, b = s["num_workers"], lanes(s)
  actual = [float(lengths[x.seq_id]) for x in seqs]
  queues = scheduler.balanced_placement(seqs, actual, list(range(n)), b)
  known = {q: float(v) for q, v in lengths.items()}
  pol = release_policy.ReleasePolicy(floor=s["floor"], chain=list(range(n)), shared_queue=True,
                              predicted=known,
                              sizes=tuple(s["release_sizes"]) if s.get("release_sizes") else None)
  m = stepsim.simulate(list(by_id.values()), lengths, queues, pol, n, b, steps_per_dispatch,
                       kv=kv(known) if kv is not None else None)
  return dict(tokens_per_device_step=m["tokens_per_device_step"],
              makespan_steps=m["makespan_steps"], device_steps=m["device_steps"],
              ratio_tokens_per_device_step=m["tokens_per_device_step"]
              / static["tokens_per_device_step"])


POOL_KEYS = ("kv_pool_bytes", "kv_pages", "page_size", "max_seqs_per_worker", "kv_margin",
             "kv_fixed_slot_bytes")


def same_pool(ep: dict, names: list[str]) -> dict:
  """Paged KV: the pool every schedule of the epoch ran on (bytes per worker, pages, page size,
  rows, admission margin, and the fixed-slot cache's bytes for reference). Fairness: the
  comparison holds only on one pool, so a schedule on another one raises."""
  pools = {n: {k: ep[n].get(k) for k in POOL_KEYS} for n in names}
  first = pools[names[0]]
  if any(p != first for p in pools.values()):
    raise ValueError(f"epoch {ep['epoch']}: the schedules ran on different KV pools: {pools}")
  return dict(first, same_for_every_schedule=True)


def add_comparisons(ep: dict, names: list[str], runs: dict, seqs) -> None:
  """Into one epoch's entry `ep` (its per-schedule measures already in): whether every schedule's
  responses (drafted runs' too: speculative decoding keeps plain decoding's tokens) equal
  static's, token for token, the ratios to static (and flexfloor to balanced), the bound, the
  makespan speedups, and release alone (and with compaction) against its ceiling
  1 / (1 - static idle_after_finish_fraction). `runs`: schedule -> [(config, result, ...)]."""
  base = runs["static"][0][1].responses
  ep["responses_identical"] = {n: same_responses(base, runs[n][0][1].responses)
                               for n in names if n != "static"}
  st = ep["static"]
  ep["ratio"] = ratios(ep["flexfloor"], st)
  ep["ratio_balanced"] = ratios(ep["balanced"], st)
  ep["flexfloor_over_balanced"] = ratios(ep["flexfloor"], ep["balanced"])
  ff_c, ff_s = runs["flexfloor"][0][0], runs["flexfloor"][0][1].summary
  if paged(ff_s):
    ep["kv_pool"] = same_pool(ep, names)
  kv = pool_factory(ff_c, ff_s)
  ep["oracle_policy"] = oracle_policy(seqs, runs["flexfloor"][0][1], st,
                                      ff_c.rollout.steps_per_dispatch, kv=kv)
  ep["makespan_speedup"] = {n: st["makespan_steps"] / ep[n]["makespan_steps"]
                            for n in names + ["oracle_policy"]
                            if ep.get(n, {}).get("makespan_steps")}
  if "release_only" in ep:
    ep["ratio_release_only"] = ratios(ep["release_only"], st)
    ceil = 1.0 / (1.0 - st["idle_after_finish_fraction"])
    ep["release_only_ceiling"] = ceil
    ep["release_only_of_ceiling"] = ep["ratio_release_only"]["tokens_per_device_step"] / ceil
  if "release_compaction" in ep:
    ep["ratio_release_compaction"] = ratios(ep["release_compaction"], st)
    ep["release_compaction_of_ceiling"] = (
        ep["ratio_release_compaction"]["tokens_per_device_step"] / ep["release_only_ceiling"])


SECONDS = ("tokens_per_occupied_device_second", "throughput_tokens_per_s")
SECONDS_RATIOS = ("tokens_per_occupied_device_second", "throughput")  # keys of ep["ratios"][pair]
# ep["ratios"]'s pairs: the headline's, then speculative decoding's (when it ran)
HEADLINE_PAIRS = ("flexfloor_static", "flexfloor_balanced")
DRAFT_PAIRS = ("flexfloor_draft_static_draft", "flexfloor_draft_static")


def pair(a: dict, b: dict) -> dict:
  """Run a over run b in the cost model's seconds: tokens per occupied device-second and
  throughput (ep["ratios"]'s keys)."""
  return {"tokens_per_occupied_device_second": a["tokens_per_occupied_device_second"]
          / b["tokens_per_occupied_device_second"],
          "throughput": a["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]}


def add_seconds(ep: dict, names: list[str], seqs, static_result, model, hw) -> None:
  """Into one epoch's entry: the headline ratios in the cost model's seconds
  (ratios.flexfloor_static and ratios.flexfloor_balanced: tokens per occupied device-second and
  throughput), and the lower bound of those seconds for these lengths (sim.bounds), which no
  plain run may beat (AssertionError otherwise). Drafted runs are not held to it: the bound is
  plain decoding's (each token of a sequence one step after the last), and speculative decoding
  makes several of a sequence's tokens in one step, so it may legitimately beat it."""
  st, ff, bal = ep["static"], ep["flexfloor"], ep["balanced"]
  ep["ratios"] = {"flexfloor_static": pair(ff, st), "flexfloor_balanced": pair(ff, bal)}
  s = static_result.summary
  by_id = {x.seq_id: x for x in seqs}
  lengths = {q: f.num_tokens for q, f in static_result.record.finishes.items()}
  ctx = sum(x.prompt_len + lengths[q] / 2 for q, x in by_id.items()) / len(by_id)
  b = bounds.lower_bound(
      [lengths[q] for q in by_id], [x.prompt_len for x in by_id.values()],
      RooflineStepCost(model, hw, ctx), max_workers=s["num_workers"], max_seqs=lanes(s),
      min_workers=floor_workers(model.experts, model.expert_bytes, model.nonexpert_bytes, 0,
                                int(hw.hbm_bytes), s["num_workers"]))
  ep["bound"] = b
  for n in names:
    if is_drafted(n):
      continue  # plain decoding's bound: drafting may beat it (the docstring)
    m = ep[n]
    if (m["makespan_s"] < b["makespan_s"] * (1 - 1e-9)
        or m["occupied_device_seconds"] < b["occupied_device_seconds"] * (1 - 1e-9)):
      raise AssertionError(f"epoch {ep['epoch']}: {n} beats the lower bound: "
                           f"{m['makespan_s']} s, {m['occupied_device_seconds']} device-s "
                           f"against {b}")


def add_drafting(ep: dict) -> None:
  """Speculative decoding (the epoch ran <schedule>_draft runs; nothing otherwise): into one
  epoch's entry (after add_seconds),
    ep["drafting"][schedule]: for static, balanced and flexfloor, plain against drafted in the
      cost model's seconds: makespan_s, occupied_device_seconds and
      tokens_per_occupied_device_second, each {"plain", "drafted", "ratio"}, the ratio being
      drafting's gain (> 1: drafting helps): plain / drafted for seconds, drafted / plain for
      tokens per second; and the drafted run's drafted_tokens (drafted rows verified),
      accepted_tokens, rejected_tokens, acceptance (accepted / drafted; 0 when nothing was
      drafted) and mean_accepted_length;
    ep["ratios"]["flexfloor_draft_static_draft"] (both drafting) and
      ep["ratios"]["flexfloor_draft_static"] (flexfloor drafting against static decoding plainly),
      pair()'s keys;
    ep["drafting_keeps_advantage"]: whether flexfloor's advantage over static holds with both
      drafting: flexfloor_draft_static_draft >= flexfloor_static - DRAFTING_ADVANTAGE_TOLERANCE
      in tokens per occupied device-second and in throughput alike (recorded, not asserted)."""
  if not all(f"{n}{DRAFT_SUFFIX}" in ep for n in DRAFTED_SCHEDULES):
    return
  out = {}
  for n in DRAFTED_SCHEDULES:
    p, d = ep[n], ep[f"{n}{DRAFT_SUFFIX}"]
    row: dict = {}
    for key, gain in (("makespan_s", lambda a, b: a / b),
                      ("occupied_device_seconds", lambda a, b: a / b),
                      ("tokens_per_occupied_device_second", lambda a, b: b / a)):
      row[key] = {"plain": p[key], "drafted": d[key], "ratio": gain(p[key], d[key])}
    drafted = d.get("drafted_tokens", 0)
    row.update(drafted_tokens=drafted, accepted_tokens=d.get("accepted_tokens", 0),
               rejected_tokens=d.get("rejected_tokens", 0),
               acceptance=d.get("accepted_tokens", 0) / drafted if drafted else 0.0,
               mean_accepted_length=d.get("mean_accepted_length", 0.0))
    out[n] = row
  ep["drafting"] = out
  ffd, std = ep[f"flexfloor{DRAFT_SUFFIX}"], ep[f"static{DRAFT_SUFFIX}"]
  ep["ratios"]["flexfloor_draft_static_draft"] = pair(ffd, std)
  ep["ratios"]["flexfloor_draft_static"] = pair(ffd, ep["static"])
  both, plain = ep["ratios"]["flexfloor_draft_static_draft"], ep["ratios"]["flexfloor_static"]
  ep["drafting_keeps_advantage"] = all(
      both[key] >= plain[key] - DRAFTING_ADVANTAGE_TOLERANCE for key in SECONDS_RATIOS)


def seed_summary(by_seed: list[list[dict]]) -> list[dict]:
  """Per epoch, over the seeds' epoch entries: the median, min and max of each headline ratio
  (ratios.flexfloor_static and ratios.flexfloor_balanced, in the cost model's seconds; with
  speculative decoding also flexfloor_draft_static_draft and flexfloor_draft_static)."""
  out = []
  for k, eps in enumerate(zip(*by_seed, strict=True)):
    row: dict = {"epoch": k}
    for name in HEADLINE_PAIRS + DRAFT_PAIRS:
      if not all(name in e["ratios"] for e in eps):
        continue  # speculative decoding's pairs: only where it ran
      for key in SECONDS_RATIOS:
        xs = np.array([e["ratios"][name][key] for e in eps], float)
        row.setdefault(name, {})[key] = {"median": float(np.median(xs)), "min": float(xs.min()),
                                         "max": float(xs.max())}
    out.append(row)
  return out


def calibrate(records: dict) -> dict | None:
  """The sim's cpu preset fitted on the workload of epoch 0 (its static and flexfloor runs),
  predicting the runs of every later epoch (held-out workloads: other lengths)."""
  fit = [records[(n, 0)] for n in ("static", "flexfloor") if (n, 0) in records]
  # (drafted runs have no record: runs._run_seed)
  held = [rec for (n, k), rec in sorted(records.items(), key=lambda kv: (kv[0][1], kv[0][0]))
          if k > 0]
  if not fit:
    return None
  return calibrate_and_predict(fit, held)


def make_document(config, epochs: list[dict], records: dict, cost_model: str, pool,
                  t_start: float) -> dict:
  """bench.json: the config, the paper's ratios, the cost model every run was replayed on, every
  epoch's entry, the calibration, the step cache's hits and the bench's seconds since `t_start`
  (perf_counter)."""
  model, hw = parse_cost_model(cost_model)
  doc = {"config": config.to_dict(), "paper": {"tokens_per_device_time_ratio":
                                               PAPER_TOKENS_PER_DEVICE_TIME,
                                               "throughput_ratio": PAPER_THROUGHPUT},
         "cost_model": {"name": cost_model, "model": dataclasses.asdict(model),
                        "hardware": hw.name, "source": hw.source},
         "epochs": epochs, "calibration": calibrate(records),
         "step_cache": {"hits": pool.hits, "misses": pool.misses},
         "bench_seconds": time.perf_counter() - t_start}
  return jsonable(doc, nonfinite_to_none=True)
