"""Command line of the simulator: its flags (`define_flags`), what it prints, sim.json and
sim.png. `python -m flexfloor_jax.sim` (__main__.py) runs it; usage in __main__'s docstring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np
from absl import flags

from flexfloor_jax.config import schema
from flexfloor_jax.config.reader import ConfigError
from flexfloor_jax.config.schema import UINT32_MAX, Choice, Custom, Int, Num, Text
from flexfloor_jax.config.settings import RolloutSettings
from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.policy import workload
from flexfloor_jax.policy.floor import FloorError, parse_release_sizes
from flexfloor_jax.sim import measured_hw
from flexfloor_jax.sim.cluster import GRPO_TRACE, GroupTooSmall, simulate_cluster
from flexfloor_jax.sim.plot import plot_cluster
from flexfloor_jax.sim.presets import GB, GIB, HARDWARE, MODELS
from flexfloor_jax.sim.records import calibrate_and_predict, format_calibration, load_run_record


def format_cluster_table(rows: list[dict]) -> str:
  """One row per device count; seconds-based metrics of summary.json for the three schedules
  (wall = the rollout's makespan, every group's last response)."""
  cols = [("devices", 7, "d"), ("ep x dp", 8, "s"), ("floor", 5, "d"),
          ("tok/occ-dev-s static", 20, ".1f"), ("balanced", 9, ".1f"), ("flexfloor", 10, ".1f"),
          ("ff/st", 6, ".3f"), ("ff/bal", 6, ".3f"),
          ("wall_s static", 13, ".2f"), ("balanced", 9, ".2f"), ("flexfloor", 10, ".2f"),
          ("tok/s ff/st", 11, ".3f"), ("bal/st", 6, ".3f"), ("idle_s ff", 9, ".3f"),
          ("oracle/st tok/occ", 17, ".3f"), ("tok/s", 6, ".3f")]
  lines = [" ".join(f"{name:>{w}}" for name, w, _ in cols)]
  for r in rows:
    s, b, f = r["static"], r["balanced"], r["flexfloor"]
    k = "tokens_per_occupied_device_second"
    vals = [r["devices"], f"{r['ep']}x{r['groups']}", r["floor"], s[k], b[k], f[k],
            r["ratio"][k], f[k] / b[k] if b[k] else 0.0, s["generation_wall_s"],
            b["generation_wall_s"], f["generation_wall_s"], r["ratio"]["throughput_tokens_per_s"],
            r["ratio_balanced"]["throughput_tokens_per_s"],
            f["idle_after_finish_fraction_seconds"], r["ratio_oracle"]["oracle_flexfloor"][k],
            r["ratio_oracle"]["oracle_balanced"]["throughput_tokens_per_s"]]
    lines.append(" ".join(f"{v:>{w}{fmt}}" for (_, w, fmt), v in zip(cols, vals, strict=True)))
  return "\n".join(lines)


# the figures each seed gives, by name: (label, row -> value)
SEED_FIGURES = (
    ("throughput ff/st", lambda r: r["ratio"]["throughput_tokens_per_s"]),
    ("tok/occ ff/st", lambda r: r["ratio"]["tokens_per_occupied_device_second"]),
    ("tok/occ ff/bal",
     lambda r: r["ratio_flexfloor_balanced"]["tokens_per_occupied_device_second"]),
    ("makespan ff/bal", lambda r: r["flexfloor"]["generation_wall_s"]
     / r["balanced"]["generation_wall_s"]),
    ("oracle-bal/st throughput",
     lambda r: r["ratio_oracle"]["oracle_balanced"]["throughput_tokens_per_s"]),
    # the same policy told every true length, against balanced told only the history: how much
    # of a tokens-per-device-second target the predictions leave within reach
    ("oracle-ff/bal tok/occ", lambda r: r["oracle_flexfloor"]["tokens_per_occupied_device_second"]
     / r["balanced"]["tokens_per_occupied_device_second"]),
    ("bound/st makespan", lambda r: r["static"]["generation_wall_s"] / r["bound"]["makespan_s"]),
)


def seed_summary(devs: list[int], runs: list[list[dict]]) -> list[dict]:
  """Per device count, each SEED_FIGURES figure over the seeds: median, min, max."""
  out = []
  for i, d in enumerate(devs):
    row: dict = dict(devices=d)
    for name, get in SEED_FIGURES:
      v = np.array([get(rows[i]) for rows in runs], float)
      row[name] = dict(median=float(np.median(v)), min=float(v.min()), max=float(v.max()))
    out.append(row)
  return out


def format_seed_table(devs: list[int], runs: list[list[dict]]) -> str:
  """The seed summary as a table: median [min, max] per figure."""
  names = [n for n, _ in SEED_FIGURES]
  lines = ["devices " + " ".join(f"{n:>24}" for n in names)]
  for row in seed_summary(devs, runs):
    cells = [f"{row[n]['median']:.3f} [{row[n]['min']:.3f}, {row[n]['max']:.3f}]" for n in names]
    lines.append(f"{row['devices']:>7} " + " ".join(f"{c:>24}" for c in cells))
  return "\n".join(lines)


def main(argv=None) -> int:
  """Run what the flags (`define_flags`) ask for; 0 on success, 1 when a calibration misses its
  target; bad input prints one `error:` line and exits 2."""
  del argv
  F = flags.FLAGS
  if F.calibrate or F.predict:
    if not (F.calibrate and F.predict):
      print("error: --calibrate and --predict go together (run records, comma-separated)",
            file=sys.stderr)
      sys.exit(2)
    try:
      fit = [load_run_record(p) for p in F.calibrate.split(",") if p]
      pred = [load_run_record(p) for p in F.predict.split(",") if p]
      r = calibrate_and_predict(fit, pred)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(format_calibration(r))
    ok = all(p["device_steps_exact"] and abs(p["wall_rel_error"]) <= 0.25
             for p in r["predictions"])
    return 0 if ok else 1
  try:
    devs = check_flags(F)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if F.hardware.startswith("measured:"):  # a step table of scripts/device_check.sh
    try:
      HARDWARE[F.hardware] = measured_hw.load_hardware(F.hardware[len("measured:"):], HARDWARE,
                                                       MODELS[F.model])
    except ValueError as e:
      print(f"error: --hardware: {e}", file=sys.stderr)
      sys.exit(2)
  if F.hardware not in HARDWARE:
    print(f"error: --hardware must be one of {sorted(HARDWARE)} (cpu: use --calibrate), got "
          f"{F.hardware!r}", file=sys.stderr)
    sys.exit(2)
  model, hw = MODELS[F.model], HARDWARE[F.hardware]
  try:
    seeds = workload.parse_seeds(F.seeds) if F.seeds.strip() else [F.seed]
  except ValueError as e:
    print(f"error: --seeds: {e}", file=sys.stderr)
    sys.exit(2)
  if F.workload == "grpo_trace":
    try:
      trace = workload.load_trace(GRPO_TRACE)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    for seed in seeds:
      try:
        workload.trace_rollout(trace, 1, seed)
      except ValueError as e:
        print(f"error: --seeds: {e}", file=sys.stderr)
        sys.exit(2)
  def run(d: int, seed: int, check_only: bool = False) -> dict:
    return simulate_cluster(
        model, hw, d, ep=F.ep, slots_per_worker=F.slots_per_worker,
        length_scale=F.length_scale, prompt_len=F.prompt_len, epochs=F.epochs, seed=seed,
        steps_per_dispatch=F.steps_per_dispatch, release_sizes=F.release_sizes,
        makespan_slack=F.makespan_slack, workload_name=F.workload, check_only=check_only,
        prefill_chunk=F.prefill_chunk,
        **(dict(kv=F.kv, page_size=F.page_size, max_seqs=F.max_num_seqs,
                kv_margin=F.kv_margin, kv_memory=F.kv_memory,
                memory_utilization=F.memory_utilization) if F.kv != "slots" else {}))

  # every device count's group checked before any work: a group too small for the model is one
  # line naming --ep and the floor
  for seed in seeds:
    for d in devs:
      try:
        run(d, seed, check_only=True)
      except GroupTooSmall as e:
        ep = (f"--ep={e.ep}" if F.ep else
              f"--ep=0 (min(devices, experts, 8) = {e.ep} at {d} devices)")
        hint = (f"; pass --ep >= {e.floor} dividing every --devices count"
                if e.floor is not None else "")
        print(f"error: {ep}: {e}{hint}", file=sys.stderr)
        sys.exit(2)
      except (ValueError, FloorError) as e:
        print(f"error: {d} devices: {e}", file=sys.stderr)
        sys.exit(2)
  t0 = time.perf_counter()
  by_seed: dict[int, list[dict]] = {}
  for seed in seeds:
    for d in devs:
      try:
        by_seed.setdefault(seed, []).append(run(d, seed))
      except (ValueError, FloorError) as e:
        print(f"error: {d} devices: {e}", file=sys.stderr)
        sys.exit(2)
  rows = by_seed[seeds[0]]
  r0 = rows[0]
  w = r0["workload"]
  print(f"{model.name} ({model.params / 1e9:.1f}B params, {model.experts} experts top-"
        f"{model.top_k}) on {hw.name} ({hw.hbm_bw / GB:.0f} GB/s HBM, {hw.hbm_bytes / GIB:.0f} GiB,"
        f" {hw.link_bw / GB:.0f} GB/s link; {hw.source}); cost model {r0['cost_model']}; "
        f"workload {F.workload}: {w['num_prompts'] * w['samples_per_prompt'] // r0['devices']} "
        f"seqs per device, median {w['median']:.0f} cap {w['cap']} tokens, prompt "
        f"{r0['prompt_len']}, {r0['steps_per_dispatch']} steps per dispatch, epoch {r0['epoch']} "
        f"(history of {r0['epoch']} epochs)")
  if r0["prefill_chunk"]:
    print(f"chunked prefill: at most {r0['prefill_chunk']} input tokens a step per worker, "
          f"{r0['prefill_chunk_tokens']} taken (costs.admission_chunk on the roofline)")
  else:
    print("one-shot prefill: a prefill step admits one prompt per worker and stalls every live "
          "row")
  if "kv" in r0:
    k = r0["kv"]
    source = (f"{F.memory_utilization:g} of device memory less each schedule's weights"
              if F.kv_memory == "device" else f"the bytes of {F.slots_per_worker} slots")
    print(f"paged KV ({source}): pages of {k['page_size']} tokens per worker, at most "
          f"{k['max_seqs']} sequences per worker, admission margin {k['margin']:g}")
    for r in rows:
      k = r["kv"]
      fc = k.get("floor_choice")
      choice = ("; FlexFloor floor candidates " + ", ".join(
          f"{c['floor']}: {c['pages']} pages, predicted {c['predicted_makespan_s']:.2f} s, "
          f"{c['predicted_occupied_device_seconds']:.1f} device-s" for c in fc["candidates"])
          if fc else "")
      print(f"  {r['devices']} devices: pages static/balanced {k['static']['num_pages']}, "
            f"flexfloor {k['flexfloor']['num_pages']} (floor {r['floor']}); preemptions "
            f"{k['static']['preemptions']}/{k['balanced']['preemptions']}/"
            f"{k['flexfloor']['preemptions']}{choice}")
  print(format_cluster_table(rows))
  for r in rows:
    n = [r[label]["prefill_only_steps_while_decoding"] for label in ("static", "balanced",
                                                                       "flexfloor")]
    print(f"  {r['devices']} devices: prefill-only steps while a row decodes static/balanced/"
          f"flexfloor {n[0]}/{n[1]}/{n[2]} (summed over groups)")
  for r in rows:
    b = r["bound"]
    print(f"  {r['devices']} devices: lower bound: makespan {b['makespan_s']:.2f} s, occupied "
          f"{b['occupied_device_seconds']:.1f} device-s (bounds.lower_bound)")
  if len(seeds) > 1:
    print(f"over seeds {','.join(map(str, seeds))}: median [min, max]")
    print(format_seed_table(devs, [by_seed[s] for s in seeds]))
  print("RL step = generation + old log-probs + update (~3 forwards), roofline seconds; "
        "+reuse: released workers score finished responses during generation")
  for r in rows:
    q = r["rl_step"]
    st, fl, re = q["static"], q["flexfloor"], q["flexfloor_released_logprobs"]
    print(f"  {r['devices']:>5} devices: static {st['step_s']:.2f} s, flexfloor "
          f"{fl['step_s']:.2f} s (log-probs {fl['logprob_s']:.3f} s), +reuse {re['step_s']:.2f} s "
          f"(log-probs {re['logprob_s']:.3f} s, {re['scored_during_generation']:.0%} scored during "
          f"generation): step time x{fl['step_s'] / re['step_s']:.3f}")
  out = F.output_dir
  os.makedirs(out, exist_ok=True)
  doc = rows if len(seeds) == 1 else dict(
      seeds=seeds, runs={str(s): by_seed[s] for s in seeds},
      summary=seed_summary(devs, [by_seed[s] for s in seeds]))
  atomic_write(os.path.join(out, "sim.json"), json.dumps(doc, indent=2))
  plot_cluster(rows, os.path.join(out, "sim.png"))
  print(f"wrote {os.path.join(out, 'sim.json')} and {os.path.join(out, 'sim.png')} "
        f"({time.perf_counter() - t0:.0f} s)")
  return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimFlags:
  """The simulator's flags: type, default, bounds and doc of each (config/schema.py)."""
  model: str = Choice(tuple(MODELS), default="mixtral-8x7b", doc="model preset")
  hardware: str = Custom(default="tpu-v5p", doc=f"hardware preset: {', '.join(HARDWARE)}, or "
                         "measured:<step table of scripts/device_check.sh>")
  devices: str = Custom(default="8,64,256,1024", doc="comma-separated device counts")
  ep: int = Int(0, default=0, doc="EP group size (workers per group); 0 = min(devices, E, 8)")
  slots_per_worker: int = Int(default=workload.DEFAULT_SLOTS_PER_WORKER,
                              doc="decode slots per worker")
  # below 1/64 the default workload's median (64 tokens x this) is under one token: every length
  # would be 1
  length_scale: float = Num(1 / 64, 4096.0, default=8.0,
                            doc="response lengths x this (median 64, cap 256 at 1)")
  prompt_len: int = Int(default=256, doc="prompt tokens per sequence")
  epochs: int = Int(default=3, doc="simulate epoch epochs-1 with the history of the ones before")
  seed: int = Int(0, UINT32_MAX, default=0, doc="workload seed (one run; --seeds for several)")
  seeds: str = Custom(default="", doc="comma list of workload seeds, e.g. 0,1,2,3,4: every "
                      "figure the median over them with min and max; '' = --seed")
  workload: str = Choice(tuple(workload.WORKLOADS), default="default", doc="default: "
                         "--length_scale x the default rollout's lengths; long_reasoning: 16 "
                         "prompts x 16 samples per 8 devices, median 3,000 tokens, cap 16,384, "
                         "prompts of 512 (policy/workload.py LONG_REASONING); grpo_trace: the "
                         "lengths of a GRPO run of configs/grpo.py (real EOS), one copy of its "
                         "prompts per 8 devices, the seed picking the epoch (0 = its last, the "
                         "earlier ones the history)")
  steps_per_dispatch: int = Int(0, default=0, doc="decode steps between host checks; 0 = 8 x "
                                "length_scale (the default rollout's granularity)")
  output_dir: str = Text(default="sim_out", nonempty=True, doc="where sim.json and sim.png go")
  release_sizes: str = Custom(default="", doc="active-group sizes a release may leave inside a "
                              "group: '' = every size | 'pow2' | a comma list "
                              "(scheduler.release_sizes)")
  makespan_slack: float = Num(0, 1, default=0.05, doc="flexfloor's makespan may exceed "
                              "balanced's predicted one by this fraction "
                              "(scheduler.makespan_slack)")
  prefill_chunk: int = Int(0, default=0, doc="chunked prefill for every schedule: at most "
                           "this many input tokens per worker ride in each decode step (the "
                           "step-time model picks how many: policy/costs.py admission_chunk); "
                           "0 = one-shot prefill steps, which stall every live row")
  kv: str = Choice(schema.choices_of(RolloutSettings, "kv"), default="slots",
                   doc="KV cache: 'slots' = slots_per_worker rows of the full length; 'paged' = "
                   "a page pool of the same bytes (policy/pages.py): concurrency from memory")
  page_size: int = Int(default=schema.default(RolloutSettings, "page_size"),
                       doc="--kv=paged: tokens per page (rollout.page_size)")
  max_num_seqs: int = Int(0, default=0, doc="--kv=paged: most sequences per worker (vLLM's "
                          "max_num_seqs: the compiled row bound); 0 = 64 on device memory, 2 x "
                          "slots_per_worker with --kv_memory=slots")
  kv_memory: str = Choice(("device", "slots"), default="device", doc="--kv=paged: the pool's "
                          "bytes. device: equal device memory, what --memory_utilization of a "
                          "device leaves beside each schedule's own weights (FlexFloor's floor "
                          "chosen on the roofline); slots: the fixed-slot cache's bytes for "
                          "every schedule")
  memory_utilization: float = Num(0, 1, lo_open=True, default=0.9, doc="--kv=paged on device "
                                  "memory: the share of a device a run may use (vLLM's "
                                  "gpu_memory_utilization)")
  # the simulator's own default: its paged tables were measured without a margin
  kv_margin: float = Num(default=0.0, doc="--kv=paged: admission reserves predicted length x "
                         "(1 + this)")
  calibrate: str = Text(default="", doc="run records (bench_out/runs/*.json, comma-separated) "
                        "of one workload to fit the cpu preset on")
  predict: str = Text(default="", doc="run records (comma-separated) to predict with the "
                      "fitted cpu preset (target: device_steps exact, wall within 25%)")


def check_flags(F) -> list[int]:
  """Every flag checked before any work (schema.check_flags, then the lists and the output
  directory): the device counts. ConfigError names the flag."""
  schema.check_flags(SimFlags, {f.name: F[f.name].value for f in dataclasses.fields(SimFlags)})
  try:
    devs = [int(x) for x in F.devices.split(",") if x.strip()]
  except ValueError:
    devs = []
  bad = [d for d in devs if d < 1]
  if not devs or bad:
    raise ConfigError(f"--devices: must be a comma list of integers >= 1, got {F.devices!r}")
  try:
    parse_release_sizes(F.release_sizes)
  except ValueError as e:
    raise ConfigError(f"--release_sizes: {e}") from None
  out = F.output_dir
  while out and not os.path.exists(out):
    out = os.path.dirname(os.path.abspath(out))
  if out and not os.path.isdir(out):
    raise ConfigError(f"--output_dir: {F.output_dir} cannot be a directory ({out} is a file)")
  return devs


def define_flags():
  schema.define_absl_flags(SimFlags)
