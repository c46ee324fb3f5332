"""Side-by-side benchmark: `python -m flexfloor_jax.bench --config=configs/bench.py`.

For each epoch k = 0..epochs-1, in one process: the static baseline, the balanced baseline
(longest predicted first onto the least-loaded worker, shared queue, full width, no release),
FlexFloor (scheduler + release), (release_only) FlexFloor with the static placement, i.e. release alone, and
(release_compaction) the static placement with release and compaction of stragglers; the same
prompts, seeds and workload (rollout.epoch = k), every mesh size compiled before the first step
(rollout.wait_compiles) so releases are reproducible. One length history lives in memory: every
run of epoch k is scheduled with the history of epochs 0..k-1 (a copy: a run of epoch k never sees
epoch k's own lengths), and epoch k's lengths join it after the epoch.

Printed: one table (per epoch and schedule the summary.json measures, then the flexfloor/static
ratios with the paper's 1.654, static makespan / each schedule's makespan, the bound: a
perfect-knowledge balanced placement of the actual lengths with release, in the step simulator, the release-only ratio against its ceiling
1 / (1 - static idle_after_finish_fraction), and a roofline-weighted device-time ratio: each run
replayed through the simulator (flexfloor_jax.sim, same policy code, same device_steps) with every
step costed by the roofline for this model on `roofline_hardware`). Written to output_dir:
bench.json, bench.png and runs/<schedule>_e<k>.json (each run's sequences, lengths, history and
timeline: what `python -m flexfloor_jax.sim --calibrate=... --predict=...` reads).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

from absl import app, flags

from flexfloor_jax import cli
from flexfloor_jax.policy import outputs
from flexfloor_jax.policy.accounting import jsonable

PAPER_TOKENS_PER_DEVICE_TIME = 1.654  # +65.4% response tokens per occupied device time
PAPER_THROUGHPUT = 1.527  # +52.7% generation throughput
RELEASE_ONLY_TARGET = 0.9  # issue 5: release alone reaches >= 0.9 of its ceiling
TABLE = (("tokens_per_device_step", "tok/dev-step", ".3f"), ("makespan_steps", "makespan", ".0f"),
         ("slot_utilization", "slot util", ".3f"),
         ("idle_after_finish_fraction", "idle after fin", ".3f"), ("device_steps", "dev-steps", ".0f"),
         ("throughput_tokens_per_s", "tokens/s", ".1f"), ("mean_reward", "reward", ".3f"))


def get_bench_config(preset: str = "tiny"):
  """configs/bench.py's get_config() (loaded by path, as config_flags loads it)."""
  return cli.load_config("bench", preset)


def variants(config) -> list[tuple[str, dict]]:
  out = [("static", dict(schedule="static", placement="auto", compaction=False)),
         ("balanced", dict(schedule="balanced", placement="auto", compaction=False)),
         ("flexfloor", dict(schedule="flexfloor", placement="auto",
                            compaction=bool(config.scheduler.compaction)))]
  if config.release_only:
    # The baseline's placement kept: release alone, then release + compaction of stragglers.
    out.append(("release_only", dict(schedule="flexfloor", placement="static", compaction=False)))
    out.append(("release_compaction", dict(schedule="flexfloor", placement="static",
                                           compaction=True)))
  return out


def run_config(config, variant: dict, epoch: int):
  c = copy.deepcopy(config)
  c.schedule = variant["schedule"]
  c.scheduler.placement = variant["placement"]
  c.scheduler.compaction = variant.get("compaction", config.scheduler.compaction)
  c.rollout.epoch = int(epoch)
  c.rollout.wait_compiles = True
  return c


# ----------------------------------------------------------------------------- one epoch


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


def _seqs_for(config):
  """The runner's own sequence list for this config (same prompts, prompt lengths, targets)."""
  from flexfloor_jax import runner
  from flexfloor_jax.model.config import PRESETS
  from flexfloor_jax.tokenizer import load_tokenizer
  if config.model.checkpoint:
    from flexfloor_jax.model import checkpoint as ckpt
    try:
      model_cfg = ckpt.inspect_checkpoint(config.model.checkpoint)
    except ckpt.CheckpointError as e:
      raise runner.RolloutError(f"model.checkpoint: {e}") from None
  else:
    model_cfg = PRESETS[config.preset]
  model_cfg = model_cfg.replace(dtype=config.model.dtype)
  tok = load_tokenizer(config.model.checkpoint, model_cfg)
  prompts = runner.load_prompts(config, tok, model_cfg.bos_id)
  return runner.build_seqs(config, prompts, runner.resolve_lengths_mode(config)), model_cfg


def _same_responses(a: list[dict], b: list[dict]) -> bool:
  key = lambda r: (r["prompt_id"], r["sample"])
  return {key(r): r["tokens"] for r in a} == {key(r): r["tokens"] for r in b}


def validate_bench(config) -> None:
  """The bench's own fields (runner.RolloutError naming the field)."""
  from flexfloor_jax import runner
  from flexfloor_jax.sim.presets import HARDWARE
  if config.epochs < 1 or config.repeats < 1:
    raise runner.RolloutError(f"epochs and repeats must be >= 1, got {config.epochs}, "
                              f"{config.repeats}")
  if config.roofline_hardware not in HARDWARE:
    raise runner.RolloutError(f"roofline_hardware must be one of {sorted(HARDWARE)}, got "
                              f"{config.roofline_hardware!r}")


def run_bench(config, *, progress: bool = True):
  """All epochs -> (the bench.json document, {(schedule, epoch): Timeline}, {(schedule, epoch):
  run record}) (what write_outputs() writes)."""
  from tqdm import tqdm

  from flexfloor_jax import engine as engine_lib
  from flexfloor_jax import runner
  from flexfloor_jax.policy import scheduler
  from flexfloor_jax.sim import costs, presets, records as sim_records, replay

  validate_bench(config)
  pool = engine_lib.StepCachePool(engine_lib)
  hw = presets.HARDWARE[config.roofline_hardware]
  history = scheduler.LengthHistory()
  names = [n for n, _ in variants(config)]
  epochs, timelines, records = [], {}, {}
  t_all = time.perf_counter()
  for k in range(config.epochs):
    runs: dict[str, list] = {n: [] for n in names}
    bar = tqdm(total=len(names) * config.repeats, desc=f"epoch {k}", unit="run",
               disable=not progress, leave=True, file=sys.stderr)
    for rep in range(config.repeats):
      for name, v in variants(config):
        bar.set_postfix_str(name)
        c = run_config(config, v, k)
        before = copy.deepcopy(history)
        h = copy.deepcopy(history)  # the runner adds this run's lengths to it
        with pool.installed():
          res = runner.run(c, write_outputs=False, history=h, progress=False)
        runs[name].append((c, res, before, h))
        bar.update(1)
    bar.close()
    seqs, model_cfg = _seqs_for(run_config(config, variants(config)[0][1], k))
    model = presets.Model.from_config(f"{model_cfg.hidden_size}d-{model_cfg.num_experts}e",
                                      model_cfg)
    ep: dict = {"epoch": k}
    for name in names:
      per = []
      for rep, (c, res, before, h) in enumerate(runs[name]):
        s = res.summary
        m = _scalars(s)
        lengths = {q: f.num_tokens for q, f in res.record.finishes.items()}
        kw = dict(steps_per_dispatch=c.rollout.steps_per_dispatch,
                  placement=c.scheduler.placement, compaction=bool(c.scheduler.compaction),
                  epoch=k, sizes=s.get("release_sizes"),
                  makespan_slack=float(c.scheduler.makespan_slack),
                  step_cost=s.get("step_cost", "measured"))
        args = (seqs, lengths, before, c.schedule, s["num_workers"], s["slots_per_worker"],
                s["floor"])
        plain, _ = replay.replay(*args, **kw)
        roof, _ = replay.replay(*args, cost=costs.RooflineCost(model, hw), model=model, **kw)
        m["sim_device_steps"] = plain["device_steps"]
        m["roofline_occupied_device_seconds"] = roof["occupied_device_seconds"]
        m["roofline_tokens_per_device_second"] = (
            roof["generated_tokens"] / roof["occupied_device_seconds"])
        m["roofline_wall_s"] = roof["generation_wall_s"]
        per.append(m)
        if rep == 0:
          timelines[(name, k)] = res.record.timeline
          records[(name, k)] = sim_records.make_run_record(
              name=f"{name}_e{k}", epoch=k, seqs=seqs, lengths=lengths, history=before,
              schedule=c.schedule, placement=c.scheduler.placement,
              compaction=bool(c.scheduler.compaction), num_workers=s["num_workers"],
              slots_per_worker=s["slots_per_worker"], floor=s["floor"],
              steps_per_dispatch=c.rollout.steps_per_dispatch,
              num_experts=model_cfg.num_experts, timeline=res.record.timeline, summary=s)
      merged = {key: sum(p[key] for p in per) / len(per) for key in per[0]
                if all(key in p for p in per)}
      for key in ("device_steps", "generated_tokens", "sim_device_steps"):
        if key in merged:
          merged[key] = per[0][key]
      ep[name] = merged
      if config.repeats > 1:
        ep.setdefault("repeats", {})[name] = {
            "throughput_tokens_per_s": [p["throughput_tokens_per_s"] for p in per],
            "device_steps": [p["device_steps"] for p in per]}
      ep.setdefault("device_steps_match_sim", {})[name] = all(
          p["device_steps"] == p["sim_device_steps"] for p in per)
    base = runs["static"][0][1].responses
    ep["responses_identical"] = {n: _same_responses(base, runs[n][0][1].responses)
                                 for n in names if n != "static"}
    st = ep["static"]
    ep["ratio"] = _ratios(ep["flexfloor"], st)
    ep["ratio_balanced"] = _ratios(ep["balanced"], st)
    ep["flexfloor_over_balanced"] = _ratios(ep["flexfloor"], ep["balanced"])
    ep["bound"] = _bound(seqs, runs["flexfloor"][0][1], st,
                         runs["flexfloor"][0][0].rollout.steps_per_dispatch)
    ep["makespan_speedup"] = {n: st["makespan_steps"] / ep[n]["makespan_steps"]
                              for n in names + ["bound"] if ep.get(n, {}).get("makespan_steps")}
    if "release_only" in ep:
      ep["ratio_release_only"] = _ratios(ep["release_only"], st)
      ceil = 1.0 / (1.0 - st["idle_after_finish_fraction"])
      ep["release_only_ceiling"] = ceil
      ep["release_only_of_ceiling"] = ep["ratio_release_only"]["tokens_per_device_step"] / ceil
    if "release_compaction" in ep:
      ep["ratio_release_compaction"] = _ratios(ep["release_compaction"], st)
      ep["release_compaction_of_ceiling"] = (
          ep["ratio_release_compaction"]["tokens_per_device_step"] / ep["release_only_ceiling"])
    epochs.append(ep)
    history = runs["flexfloor"][0][3]  # epoch k's lengths join the shared history
  calibration = _calibrate(records)
  doc = {"config": config.to_dict(), "paper": {"tokens_per_device_time_ratio":
                                               PAPER_TOKENS_PER_DEVICE_TIME,
                                               "throughput_ratio": PAPER_THROUGHPUT},
         "roofline": {"hardware": hw.name, "model": dataclasses_asdict(model), "source": hw.source},
         "epochs": epochs, "calibration": calibration,
         "step_cache": {"hits": pool.hits, "misses": pool.misses},
         "bench_seconds": time.perf_counter() - t_all}
  return jsonable(doc, nonfinite_to_none=True), timelines, records


def _bound(seqs, ff_result, static: dict, steps_per_dispatch: int) -> dict:
  """The bound a workload sets: the balanced placement of the *actual* lengths (perfect
  knowledge) with release and the shared queue, in the step simulator (the engine's own steps for
  the same lengths), at flexfloor's floor and release sizes."""
  from flexfloor_jax.policy import planner, scheduler, stepsim
  s = ff_result.summary
  lengths = {q: f.num_tokens for q, f in ff_result.record.finishes.items()}
  by_id = {x.seq_id: x for x in seqs}
  n, b = s["num_workers"], s["slots_per_worker"]
  actual = [float(lengths[x.seq_id]) for x in seqs]
  queues = scheduler.balanced_placement(seqs, actual, list(range(n)), b)
  pol = planner.ReleasePolicy(floor=s["floor"], chain=list(range(n)), shared_queue=True,
                              predicted={q: float(v) for q, v in lengths.items()},
                              sizes=tuple(s["release_sizes"]) if s.get("release_sizes") else None)
  m = stepsim.simulate(list(by_id.values()), lengths, queues, pol, n, b, steps_per_dispatch)
  return dict(tokens_per_device_step=m["tokens_per_device_step"],
              makespan_steps=m["makespan_steps"], device_steps=m["device_steps"],
              ratio_tokens_per_device_step=m["tokens_per_device_step"]
              / static["tokens_per_device_step"])


def dataclasses_asdict(x):
  import dataclasses
  return dataclasses.asdict(x)


def _ratios(a: dict, b: dict) -> dict:
  return {k: a[k] / b[k] for k in a if k in b and isinstance(b[k], (int, float)) and b[k]}


def _calibrate(records: dict) -> dict | None:
  """The sim's cpu preset fitted on the workload of epoch 0 (its static and flexfloor runs),
  predicting the runs of every later epoch (held-out workloads: other lengths)."""
  from flexfloor_jax.sim.records import calibrate_and_predict
  fit = [records[(n, 0)] for n in ("static", "flexfloor") if (n, 0) in records]
  held = [rec for (n, k), rec in sorted(records.items(), key=lambda kv: (kv[0][1], kv[0][0]))
          if k > 0]
  if not fit:
    return None
  return calibrate_and_predict(fit, held)


# ----------------------------------------------------------------------------- table, plot


def format_table(doc: dict) -> str:
  hw = doc["roofline"]["hardware"]
  cols = [("epoch", 5), ("run", 25)] + [(h, 20 if i == 0 else max(len(h), 9))
                                       for i, (_, h, _) in enumerate(TABLE)] + [
      (f"roofline dev-time ({hw})", 24), ("ceiling", 8), ("of ceiling", 10)]
  fmt_row = lambda vals: " ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols))
  lines = [fmt_row([c for c, _ in cols])]
  dash = "-"

  def cell(m, key, f):
    v = m.get(key)
    return dash if v is None else format(v, f)

  for ep in doc["epochs"]:
    k = ep["epoch"]
    for name in ("static", "balanced", "flexfloor", "release_only", "release_compaction"):
      if name in ep:
        m = ep[name]
        lines.append(fmt_row([k, name] + [cell(m, key, f) for key, _, f in TABLE]
                             + [format(m["roofline_tokens_per_device_second"], ".4g") +
                                " tok/dev-s", dash, dash]))
    bd = ep["bound"]
    lines.append(fmt_row([k, "bound (actual lengths)", format(bd["tokens_per_device_step"], ".3f"),
                          format(bd["makespan_steps"], ".0f")] + [dash] * (len(TABLE) - 2)
                         + [dash, dash, dash]))
    sp = ep["makespan_speedup"]
    for name, r in (("balanced", ep["ratio_balanced"]), ("flexfloor", ep["ratio"])):
      tp = f"{r['tokens_per_device_step']:.3f}" + (
          f" (paper {PAPER_TOKENS_PER_DEVICE_TIME})" if name == "flexfloor" else "")
      lines.append(fmt_row([k, f"{name}/static", tp, f"x{sp[name]:.2f} faster"] + [
          cell(r, key, ".3f") for key, _, _ in TABLE[2:]]
          + [cell(r, "roofline_tokens_per_device_second", ".3f"), dash, dash]))
    lines.append(fmt_row([k, "bound/static", format(bd["ratio_tokens_per_device_step"], ".3f"),
                          f"x{sp['bound']:.2f} faster"] + [dash] * (len(TABLE) - 2)
                         + [dash, dash, dash]))
    for name in ("release_only", "release_compaction"):  # placement unchanged: vs the ceiling
      if f"ratio_{name}" in ep:
        r = ep[f"ratio_{name}"]
        lines.append(fmt_row([k, f"{name}/static", format(r["tokens_per_device_step"], ".3f")]
                             + [cell(r, key, ".3f") for key, _, _ in TABLE[1:]]
                             + [cell(r, "roofline_tokens_per_device_second", ".3f"),
                                format(ep["release_only_ceiling"], ".3f"),
                                format(ep[f"{name}_of_ceiling"], ".3f")]))
  return "\n".join(lines)


def summary_lines(doc: dict) -> list[str]:
  eps = [e for e in doc["epochs"] if e["epoch"] >= 1] or doc["epochs"]
  out = []
  ks = [e["epoch"] for e in eps]
  fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
  r = [e["ratio"]["tokens_per_device_step"] for e in eps]
  rb = [e["bound"]["ratio_tokens_per_device_step"] for e in eps]
  ms = [e["makespan_speedup"]["flexfloor"] for e in eps]
  mb = [e["makespan_speedup"]["bound"] for e in eps]
  fb = [e["flexfloor_over_balanced"]["tokens_per_device_step"] for e in eps]
  mfb = [e["flexfloor"]["makespan_steps"] / e["balanced"]["makespan_steps"] for e in eps]
  slack = doc["config"]["scheduler"].get("makespan_slack", 0.05)
  t = [e["ratio"]["throughput_tokens_per_s"] for e in eps]
  out.append(f"epochs {ks}: flexfloor/static tokens_per_device_step {fmt(r)} (target >= 1.65, "
             f"paper {PAPER_TOKENS_PER_DEVICE_TIME}; bound {fmt(rb)})")
  out.append(f"epochs {ks}: static/flexfloor makespan (steps) {fmt(ms)} (target >= 1.5; bound "
             f"{fmt(mb)}); wall throughput ratio {fmt(t)} (paper {PAPER_THROUGHPUT})")
  out.append(f"epochs {ks}: flexfloor/balanced tokens_per_device_step {fmt(fb)} (target > 1); "
             f"flexfloor/balanced makespan {fmt(mfb)} (target <= {1 + slack:.2f})")
  if all("release_only_of_ceiling" in e for e in doc["epochs"]):
    q = [e["release_only_of_ceiling"] for e in doc["epochs"]]
    out.append(f"release-only / ceiling per epoch: {', '.join(f'{x:.3f}' for x in q)} "
               f"(target >= {RELEASE_ONLY_TARGET})")
  if all("release_compaction_of_ceiling" in e for e in doc["epochs"]):
    q = [e["release_compaction_of_ceiling"] for e in doc["epochs"]]
    out.append(f"release + compaction (placement unchanged) / ceiling per epoch: "
               f"{', '.join(f'{x:.3f}' for x in q)} (target > 1: past the ceiling)")
  ok = all(all(e["device_steps_match_sim"].values()) for e in doc["epochs"])
  ident = all(all(e["responses_identical"].values()) for e in doc["epochs"])
  out.append(f"sim replay device_steps == measured for every run: {ok}; responses token-identical "
             f"to static for every schedule: {ident}")
  cal = doc.get("calibration")
  if cal and cal["predictions"]:
    errs = [p["wall_rel_error"] for p in cal["predictions"]]
    out.append(f"cpu preset fitted on epoch 0 ({cal['cpu_preset']['fitted_on']}) predicts the "
               f"{len(errs)} runs of later epochs' wall "
               f"time within {max(abs(e) for e in errs) * 100:.1f}% (mean "
               f"{sum(errs) / len(errs) * 100:+.1f}%), device_steps exact: "
               f"{all(p['device_steps_exact'] for p in cal['predictions'])}")
  return out


def plot(doc: dict, timelines: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from flexfloor_jax.policy import accounting
  last = doc["epochs"][-1]["epoch"]
  fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4))
  for (name, k), tl in sorted(timelines.items()):
    if k != last:
      continue
    xs, active, _ = accounting.live_series(tl)
    a.step(xs, active, where="post", label=name,
           ls={"release_only": "--", "release_compaction": ":"}.get(name, "-"))
  a.set_xlabel("step (prefill + decode)")
  a.set_ylabel("active workers")
  a.set_title(f"epoch {last}: active workers")
  a.legend()
  ks = [e["epoch"] for e in doc["epochs"]]
  b.plot(ks, [e["ratio"]["tokens_per_device_step"] for e in doc["epochs"]], "o-",
         label="flexfloor/static tokens/device-step")
  b.plot(ks, [e["ratio"]["throughput_tokens_per_s"] for e in doc["epochs"]], "s-",
         label="flexfloor/static throughput")
  b.plot(ks, [e["ratio"]["roofline_tokens_per_device_second"] for e in doc["epochs"]], "^-",
         label=f"roofline device-time ({doc['roofline']['hardware']})")
  if all("ratio_release_only" in e for e in doc["epochs"]):
    b.plot(ks, [e["ratio_release_only"]["tokens_per_device_step"] for e in doc["epochs"]], "d--",
           label="release only / static")
    b.plot(ks, [e["release_only_ceiling"] for e in doc["epochs"]], "k:", label="release ceiling")
  if all("ratio_release_compaction" in e for e in doc["epochs"]):
    b.plot(ks, [e["ratio_release_compaction"]["tokens_per_device_step"] for e in doc["epochs"]],
           "s--", label="release + compaction / static")
  b.axhline(PAPER_TOKENS_PER_DEVICE_TIME, color="gray", ls="-.", label="paper 1.654")
  b.set_xticks(ks)
  b.set_xlabel("epoch")
  b.set_ylabel("ratio")
  b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  try:
    fig.savefig(path, format="png", dpi=110)
  finally:
    plt.close(fig)


def write_outputs(doc, timelines, records, out_dir: str) -> str:
  """bench.json (first: it survives a later failure), runs/ and bench.png, published as one set
  (policy/outputs.py); returns the set's directory. Raises outputs.OutputWriteError naming the
  file."""
  s = outputs.OutputSet(out_dir, "output_dir", owns=("bench.json", "runs", "bench.png"))
  s.write("bench.json", json.dumps(doc, indent=2))
  for (name, k), rec in records.items():
    s.write(os.path.join("runs", f"{name}_e{k}.json"), json.dumps(rec, indent=2))
  with s.writing("bench.png") as path:
    plot(doc, timelines, path)
  return s.publish()


# ----------------------------------------------------------------------------- CLI

_CONFIG = cli.define_config("configs/bench.py", "Benchmark config file.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")


def main(argv):
  del argv
  config = _CONFIG.value
  cli.config_loaded(config)
  from flexfloor_jax import runner
  from flexfloor_jax.cli import ConfigError, enable_compilation_cache, fail
  try:  # every field checked before jax starts, as the rollout CLI does
    cli.validate_common(config)
    runner.validate_config(config)
    validate_bench(config)
  except (ConfigError, runner.RolloutError) as e:
    fail(str(e))
  try:  # checked and locked before jax starts: a second bench on this directory fails at once
    lock = outputs.acquire(config.output_dir, "output_dir")
  except outputs.OutputDirError as e:
    fail(str(e))
  with lock:
    cli.emulate_cpu_devices(_CPU_DEVICES.value or config.mesh.cpu_devices)  # before jax starts
    enable_compilation_cache()
    try:
      doc, timelines, records = run_bench(config)
    except runner.RolloutError as e:
      fail(str(e))
    print(format_table(doc))
    for line in summary_lines(doc):
      print(line)
    try:
      write_outputs(doc, timelines, records, config.output_dir)
    except outputs.OutputWriteError as e:
      fail(str(e))
  print(f"wrote {config.output_dir}/bench.json, bench.png, runs/ ({doc['bench_seconds']:.0f} s)")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
