"""The bench's runs: every schedule of every epoch through the runner, in one process, each run
measured (summary.json's numbers) and replayed through the simulator (device_steps and the
roofline's device time).

For each epoch k = 0..epochs-1: the static baseline, the balanced baseline (longest predicted first
onto the least-loaded worker, shared queue, full width, no release), FlexFloor (scheduler +
release), (release_only) FlexFloor with the static placement, i.e. release alone, and
(release_compaction) the static placement with release and compaction of stragglers; the same
prompts, seeds and workload (rollout.epoch = k), every mesh size compiled before the first step
(rollout.wait_compiles) so releases are reproducible. One length history lives in memory: every
run of epoch k is scheduled with the history of epochs 0..k-1 (a copy: a run of epoch k never sees
epoch k's own lengths), and epoch k's lengths join it after the epoch.

Speculative decoding (bench.draft_tokens = D > 0): static, balanced and flexfloor run again as
static_draft, balanced_draft and flexfloor_draft, the same schedules with rollout.draft_tokens = D,
drafting from a response store (policy.drafts.ResponseStore) kept in memory beside the length
history, one per workload seed: every drafted run of epoch k drafts from a copy of it (the
responses of epochs 0..k-1, and its own sibling samples as they grow), and epoch k's responses
(any plain run's: every schedule makes the same tokens) join it after the epoch. A drafted run is
replayed with its responses and a drafting policy built as the run's (runner.drafting_policy)
over the store as it was before the run, so that the replay drafts, and accepts, as the run did.
Drafted runs write no run record (runs/*.json): a record replays plain decoding (sim.records keeps
no responses or store), which would not make a drafted run's steps.
"""

from __future__ import annotations

import copy
import sys
import time
from types import SimpleNamespace
from typing import Any, cast

from tqdm import tqdm

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.bench import document
from flexfloor_jax.bench.document import lanes, paged, pool_factory
from flexfloor_jax.config import files, settings
from flexfloor_jax.engine import memory as engine_memory
from flexfloor_jax.model.tokenizer import tokenizer_identity
from flexfloor_jax.policy.accounting import draft_summary
from flexfloor_jax.policy.drafts import ResponseStore
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rollout import inputs, runner
from flexfloor_jax.sim import costs, presets, replay
from flexfloor_jax.sim import records as sim_records


def get_bench_config(preset: str = "tiny"):
  """configs/bench.py's get_config() (loaded by path, as config_flags loads it)."""
  return files.load_config("bench", preset)


DRAFT_SUFFIX = document.DRAFT_SUFFIX  # "static_draft": static with speculative decoding


def variants(st) -> list[tuple[str, dict]]:
  """(name, schedule and scheduler fields) of every run of an epoch; `st`: the bench's
  settings.Settings."""
  out = [("static", dict(schedule="static", placement="auto", compaction=False)),
         ("balanced", dict(schedule="balanced", placement="auto", compaction=False)),
         ("flexfloor", dict(schedule="flexfloor", placement="auto",
                            compaction=st.scheduler.compaction))]
  if st.bench.release_only:
    # The baseline's placement kept: release alone, then release + compaction of stragglers.
    out.append(("release_only", dict(schedule="flexfloor", placement="static", compaction=False)))
    out.append(("release_compaction", dict(schedule="flexfloor", placement="static",
                                           compaction=True)))
  if st.bench.draft_tokens:
    # Speculative decoding: the three schedules again, drafting (run_config sets draft_tokens)
    out += [(f"{name}{DRAFT_SUFFIX}", dict(v, draft=True)) for name, v in out[:3]]
  return out


def run_config(st, variant: dict, epoch: int):
  """The settings of one run: a variant of `st` at epoch `epoch`, every mesh size compiled
  before the first step, deciding in the seconds of the cost model it is scored on; a drafted
  variant with rollout.draft_tokens = bench.draft_tokens, every other one without drafting."""
  return st.replace(schedule=variant["schedule"],
                    scheduler=dict(placement=variant["placement"],
                                   compaction=variant["compaction"],
                                   step_cost=st.bench.cost_model),
                    rollout=dict(epoch=int(epoch), wait_compiles=True,
                                 draft_tokens=st.bench.draft_tokens if variant.get("draft")
                                 else 0))


def seqs_for(config):
  """The runner's own sequence list for this config or its settings (same prompts, prompt
  lengths, targets)."""
  config = settings.as_settings(config)
  model_cfg = inputs.model_config(config)
  tok = inputs.tokenizer_for(config, model_cfg)
  prompts = inputs.load_prompts(config, tok, model_cfg.bos_id)
  return inputs.build_seqs(config, prompts, inputs.resolve_lengths_mode(config)), model_cfg


def new_store(config) -> ResponseStore:
  """An empty response store for this config's runs, keyed by its tokenizer as the runner keys
  the store file (inputs.load_store)."""
  config = settings.as_settings(config)
  model_cfg = inputs.model_config(config)
  return ResponseStore(tokenizer_identity(inputs.tokenizer_for(config, model_cfg), model_cfg))


def drafting_policy(c, summary: dict, seqs, store):
  """A fresh drafting policy of a drafted run `c` (the policy learns its acceptance as it goes:
  one per replay), by the runner's own rule (runner.drafting_policy, which reads the run's step
  cost, sequences and store of its Prepared: the cost model is the roofline pair the run decided
  in, none with step_cost 'steps'), drafting from `store` (the store before the run)."""
  prep = SimpleNamespace(step_cost=summary["step_cost"], seqs=seqs, store=store)
  return runner.drafting_policy(c, cast(runner.Prepared, prep))


def _scalars(summary: dict) -> dict:
  """Numeric measures of a summary.json (lists and labels left out; prediction flattened)."""
  out = {}
  for k, v in summary.items():
    if isinstance(v, bool):
      continue
    if isinstance(v, (int, float)):
      out[k] = v
  pred = summary.get("prediction")
  if isinstance(pred, dict):
    for k, v in pred.items():
      out[f"prediction_{k}"] = v
  return out


def _run_epoch(st, k: int, history, pool, progress: bool, store=None) -> dict:
  """Every schedule of epoch k, `repeats` times, each from a copy of `history` (a drafted one
  also from a copy of the response store `store`): schedule -> [(run settings, result, history
  before, history after, store before (None: not drafted))]."""

  names = [n for n, _ in variants(st)]
  runs: dict[str, list] = {n: [] for n in names}
  bar = tqdm(total=len(names) * st.bench.repeats, desc=f"epoch {k}", unit="run",
             disable=not progress, leave=True, file=sys.stderr)
  for _ in range(st.bench.repeats):
    for name, v in variants(st):
      bar.set_postfix_str(name)
      c = run_config(st, v, k)
      before = copy.deepcopy(history)
      h = copy.deepcopy(history)  # the runner adds this run's lengths to it
      drafted = bool(c.rollout.draft_tokens)
      store_before = copy.deepcopy(store) if drafted else None
      # the runner adds this run's responses to its store
      run_store = copy.deepcopy(store) if drafted else None
      res = runner.run(c, write_outputs=False, history=h, progress=False, step_cache=pool,
                       response_store=run_store)
      runs[name].append((c, res, before, h, store_before))
      bar.update(1)
  bar.close()
  return runs


def fixed_slot_kv_bytes(model_cfg, slots_per_worker: int, max_seq_len: int) -> int:
  """KV bytes per worker of the fixed-slot cache (slots_per_worker rows of max_seq_len tokens in
  the full layers, a window's ring in each sliding layer: engine.memory.kv_bytes): what
  kv_pages=0 gives the paged pool, rounded down to whole pages."""
  per_token, rings = engine_memory.kv_bytes(model_cfg, max_seq_len)
  return int(slots_per_worker) * (int(max_seq_len) * per_token + rings)


def kv_spec(c, summary: dict) -> dict | None:
  """A run record's paged pool (what sim.records.replay_record rebuilds it from); None: fixed
  slots."""
  if not paged(summary):
    return None
  r = c.rollout
  return dict(kv_pages=summary["kv_pages"], page_size=r.page_size,
              max_seqs_per_worker=summary["max_seqs_per_worker"], kv_margin=r.kv_margin,
              max_seq_len=summary["max_seq_len"])


# summary.json's seconds on emulated CPU devices are the host's: kept under host_*, while the
# bench's own keys of these names are in the named cost model's seconds
HOST_SECONDS = ("occupied_device_seconds", "makespan_s", "throughput_tokens_per_s",
                "generation_wall_s", "tokens_per_occupied_device_second")


def _measure(c, res, before, seqs, k: int, model, hw, store=None) -> tuple[dict, dict]:
  """One run's measures and the lengths it produced: its summary's counts (the host's seconds as
  host_*), the simulator's device_steps for the same lengths, and the run replayed on the named
  cost model (`model` on `hw`, releases and migrations charged): occupied_device_seconds,
  makespan_s, tokens_per_occupied_device_second and throughput_tokens_per_s in its seconds.
  Paged KV: the replays run on a pool built as the run's, so its peak pages and preemptions are
  checked too (sim_kv_*). A drafted run (rollout.draft_tokens > 0) is replayed drafting, each
  drafted token confirmed by its response: a drafting policy built as the run's over `store`, the
  response store before the run (drafting_policy), so that the replay makes its device-steps too
  (its drafted and accepted tokens: sim_drafted_tokens, sim_accepted_tokens)."""
  s = res.summary
  m = _scalars(s)
  for key in HOST_SECONDS:
    if key in m:
      m[f"host_{key}"] = m.pop(key)
  lengths = {q: f.num_tokens for q, f in res.record.finishes.items()}
  kw: dict[str, Any] = dict(
      steps_per_dispatch=c.rollout.steps_per_dispatch, placement=c.scheduler.placement,
      compaction=c.scheduler.compaction, epoch=k, sizes=s.get("release_sizes"),
      makespan_slack=c.scheduler.makespan_slack, step_cost=s.get("step_cost", "measured"),
      prefill_chunk=s.get("prefill_chunk", 0))
  if kw["step_cost"].startswith("roofline:"):  # the run decided in the named pair's seconds
    kw["policy_cost"] = costs.named_step_cost(kw["step_cost"], seqs)
  if paged(s):
    kw["kv"] = pool_factory(c, s)
  args = (seqs, lengths, before, c.schedule, s["num_workers"], lanes(s), s["floor"])
  drafted = bool(c.rollout.draft_tokens)
  if drafted:
    by_key = {(r["prompt_id"], r["sample"]): r["tokens"] for r in res.responses}
    kw["responses"] = {x.seq_id: by_key[(x.prompt_id, x.sample)] for x in seqs}

  def policy():  # a fresh one per replay: it learns as it goes
    return drafting_policy(c, s, seqs, store) if drafted else None

  plain, plain_rec = replay.replay(*args, drafting=policy(), **kw)
  roof, _ = replay.replay(*args, cost=costs.RooflineCost(model, hw), model=model,
                          drafting=policy(), **kw)
  m["sim_device_steps"] = plain["device_steps"]
  if drafted:
    d = draft_summary(plain_rec.timeline)
    m["sim_drafted_tokens"], m["sim_accepted_tokens"] = d["drafted_tokens"], d["accepted_tokens"]
  if paged(s):
    m["sim_kv_peak_pages"] = plain["kv"]["peak_pages"]
    m["sim_preemptions"] = plain["kv"]["preemptions"]
  if roof["device_steps"] != plain["device_steps"]:
    raise AssertionError(f"the cost model's replay ran {roof['device_steps']} device-steps, the "
                         f"plain one {plain['device_steps']}")
  m.update(replay.seconds_figures(roof))
  return m, lengths


def run_bench(config, st=None, *, progress: bool = True):
  """All epochs, for every seed -> (the bench.json document, {(schedule, epoch): Timeline},
  {(schedule, epoch): run record}) (what report.write_outputs() writes; timelines and records of
  the first seed). `st`: the config's settings (settings.load(config, "bench"), which raises
  ConfigError; loaded here when not given). With several `seeds` (each the workload's
  sampling.seed), the document's epochs are the first seed's, `by_seed` holds every seed's and
  `seed_summary` the headline ratios' median, min and max per epoch."""

  st = settings.load(config, "bench") if st is None else st
  bench = st.bench
  assert bench is not None  # load(config, "bench") reads the bench section
  pool = engine_lib.StepCachePool()
  t_all = time.perf_counter()
  seeds = list(bench.seeds) or [st.sampling.seed]
  by_seed = {seed: _run_seed(st.replace(sampling=dict(seed=seed)), pool, progress)
             for seed in seeds}
  epochs, timelines, records = by_seed[seeds[0]]
  doc = document.make_document(config, epochs, records, bench.cost_model, pool, t_all)
  if len(seeds) > 1:
    doc["seeds"] = seeds
    doc["by_seed"] = {str(s): document.jsonable(by_seed[s][0], nonfinite_to_none=True)
                      for s in seeds}
    doc["seed_summary"] = document.seed_summary([by_seed[s][0] for s in seeds])
  return doc, timelines, records


def _run_seed(st, pool, progress: bool):
  """Every epoch of one workload seed (st.sampling.seed) -> (epoch entries, timelines, records)."""
  bench = st.bench
  model, hw = presets.parse_cost_model(bench.cost_model)
  history = LengthHistory()
  names = [n for n, _ in variants(st)]
  # speculative decoding: earlier epochs' responses, drafted from (a copy per run)
  store = new_store(st) if bench.draft_tokens else None
  epochs, timelines, records = [], {}, {}
  for k in range(bench.epochs):
    runs = _run_epoch(st, k, history, pool, progress, store)
    seqs, model_cfg = seqs_for(run_config(st, variants(st)[0][1], k))
    ep: dict = {"epoch": k, "cost_model": bench.cost_model}
    for name in names:
      per = []
      for rep, (c, res, before, _h, store_before) in enumerate(runs[name]):
        m, lengths = _measure(c, res, before, seqs, k, model, hw, store_before)
        per.append(m)
        if rep == 0:
          s = res.summary
          timelines[(name, k)] = res.record.timeline
          if c.rollout.draft_tokens:
            continue  # no run record: a record replays plain decoding (the module doc)
          records[(name, k)] = sim_records.make_run_record(
              name=f"{name}_e{k}", epoch=k, seqs=seqs, lengths=lengths, history=before,
              schedule=c.schedule, placement=c.scheduler.placement,
              compaction=c.scheduler.compaction, num_workers=s["num_workers"],
              slots_per_worker=lanes(s), floor=s["floor"],
              steps_per_dispatch=c.rollout.steps_per_dispatch,
              num_experts=model_cfg.num_experts, timeline=res.record.timeline, summary=s,
              kv=kv_spec(c, s))
      # the mean of each measure over the repeats; counts stay integers: the first run's
      merged = {key: sum(p[key] for p in per) / len(per) for key in per[0]
                if all(key in p for p in per)}
      for key in ("device_steps", "generated_tokens", "sim_device_steps", "kv_pool_bytes",
                  "kv_pages", "page_size", "max_seqs_per_worker", "kv_peak_pages", "preemptions",
                  "sim_kv_peak_pages", "sim_preemptions", "draft_tokens", "drafted_tokens",
                  "accepted_tokens", "rejected_tokens", "sim_drafted_tokens",
                  "sim_accepted_tokens"):
        if key in merged:
          merged[key] = per[0][key]
      if paged(runs[name][0][1].summary):
        c0, s0 = runs[name][0][0], runs[name][0][1].summary
        merged["kv_margin"] = c0.rollout.kv_margin
        merged["kv_fixed_slot_bytes"] = fixed_slot_kv_bytes(
            model_cfg, c0.rollout.slots_per_worker, s0["max_seq_len"])
        ep.setdefault("kv_matches_sim", {})[name] = all(
            (p["kv_peak_pages"], p["preemptions"]) == (p["sim_kv_peak_pages"],
                                                       p["sim_preemptions"]) for p in per)
      ep[name] = dict(merged, cost_model=bench.cost_model)
      if bench.repeats > 1:
        ep.setdefault("repeats", {})[name] = {
            "throughput_tokens_per_s": [p["throughput_tokens_per_s"] for p in per],
            "device_steps": [p["device_steps"] for p in per]}
      ep.setdefault("device_steps_match_sim", {})[name] = all(
          p["device_steps"] == p["sim_device_steps"] for p in per)
      if "sim_drafted_tokens" in per[0]:
        ep.setdefault("drafts_match_sim", {})[name] = all(
            (p["drafted_tokens"], p["accepted_tokens"]) == (p["sim_drafted_tokens"],
                                                            p["sim_accepted_tokens"])
            for p in per)
    document.add_comparisons(ep, names, runs, seqs)
    document.add_seconds(ep, names, seqs, runs["static"][0][1], model, hw)
    document.add_drafting(ep)
    epochs.append(ep)
    history = runs["flexfloor"][0][3]  # epoch k's lengths join the shared history
    if store is not None:  # epoch k's responses (every schedule's are static's) join the store
      store.add_rollout(k, [(r["prompt_id"], r["sample"], r["tokens"])
                            for r in runs["static"][0][1].responses])
  return epochs, timelines, records
