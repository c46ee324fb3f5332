"""Command line of the simulator: its flags (`define_flags`), what it prints, sim.json and
sim.png. `python -m flexfloor_jax.sim` (__main__.py) runs it; usage in __main__'s docstring.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.policy import workload
from flexfloor_jax.policy.floor import FloorError
from flexfloor_jax.sim import measured_hw
from flexfloor_jax.sim.cluster import simulate_cluster
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
  if F.model not in MODELS:
    print(f"error: --model must be one of {sorted(MODELS)}, got {F.model!r}", file=sys.stderr)
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
    devs = [int(x) for x in F.devices.split(",") if x.strip()]
  except ValueError:
    print(f"error: --devices must be a comma-separated list of ints, got {F.devices!r}",
          file=sys.stderr)
    sys.exit(2)
  rows = []
  for d in devs:
    try:
      rows.append(simulate_cluster(model, hw, d, ep=F.ep, slots_per_worker=F.slots_per_worker,
                                   length_scale=F.length_scale, prompt_len=F.prompt_len,
                                   epochs=F.epochs, seed=F.seed,
                                   steps_per_dispatch=F.steps_per_dispatch,
                                   release_sizes=F.release_sizes,
                                   makespan_slack=F.makespan_slack,
                                   **(dict(kv=F.kv, page_size=F.page_size, max_seqs=F.max_seqs,
                                           kv_margin=F.kv_margin) if F.kv != "slots" else {})))
    except (ValueError, FloorError) as e:
      print(f"error: {d} devices: {e}", file=sys.stderr)
      sys.exit(2)
  r0 = rows[0]
  print(f"{model.name} ({model.params / 1e9:.1f}B params, {model.experts} experts top-"
        f"{model.top_k}) on {hw.name} ({hw.hbm_bw / GB:.0f} GB/s HBM, {hw.hbm_bytes / GIB:.0f} GiB,"
        f" {hw.link_bw / GB:.0f} GB/s link; {hw.source}); workload: {F.slots_per_worker} slots x "
        f"8 seqs per device, median {r0['workload']['median']:.0f} cap {r0['workload']['cap']} "
        f"tokens, prompt {F.prompt_len}, {r0['steps_per_dispatch']} steps per dispatch, epoch "
        f"{r0['epoch']} (history of {r0['epoch']} epochs)")
  if "kv" in r0:
    k = r0["kv"]
    print(f"paged KV: {k['num_pages']} pages of {k['page_size']} tokens per worker (the bytes of "
          f"{F.slots_per_worker} slots), at most {k['max_seqs']} sequences per worker, admission "
          f"margin {k['margin']:g}; preemptions static/balanced/flexfloor: "
          + ", ".join(f"{r['devices']} devices {r['kv']['static']['preemptions']}/"
                      f"{r['kv']['balanced']['preemptions']}/{r['kv']['flexfloor']['preemptions']}"
                      for r in rows))
  print(format_cluster_table(rows))
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
  atomic_write(os.path.join(out, "sim.json"), json.dumps(rows, indent=2))
  plot_cluster(rows, os.path.join(out, "sim.png"))
  print(f"wrote {os.path.join(out, 'sim.json')} and {os.path.join(out, 'sim.png')}")
  return 0


def define_flags():
  flags.DEFINE_string("model", "mixtral-8x7b", f"model preset: {', '.join(MODELS)}")
  flags.DEFINE_string("hardware", "tpu-v5p", f"hardware preset: {', '.join(HARDWARE)}")
  flags.DEFINE_string("devices", "8,64,256,1024", "comma-separated device counts")
  flags.DEFINE_integer("ep", 0, "EP group size (workers per group); 0 = min(devices, E, 8)")
  flags.DEFINE_integer("slots_per_worker", workload.DEFAULT_SLOTS_PER_WORKER,
                       "decode slots per worker")
  flags.DEFINE_float("length_scale", 8.0, "response lengths x this (median 64, cap 256 at 1)")
  flags.DEFINE_integer("prompt_len", 256, "prompt tokens per sequence")
  flags.DEFINE_integer("epochs", 3, "simulate epoch epochs-1 with the history of the ones before")
  flags.DEFINE_integer("seed", 0, "workload seed")
  flags.DEFINE_integer("steps_per_dispatch", 0, "decode steps between host checks; 0 = 8 x "
                       "length_scale (the default rollout's granularity)")
  flags.DEFINE_string("output_dir", "sim_out", "where sim.json and sim.png go")
  flags.DEFINE_string("release_sizes", "", "active-group sizes a release may leave inside a "
                      "group: '' = every size | 'pow2' | a comma list (scheduler.release_sizes)")
  flags.DEFINE_float("makespan_slack", 0.05, "flexfloor's makespan may exceed balanced's "
                     "predicted one by this fraction (scheduler.makespan_slack)")
  flags.DEFINE_enum("kv", "slots", ["slots", "paged"], "KV cache: 'slots' = slots_per_worker "
                    "rows of the full length; 'paged' = a page pool of the same bytes "
                    "(policy/pages.py): concurrency from memory")
  flags.DEFINE_integer("page_size", 16, "--kv=paged: tokens per page")
  flags.DEFINE_integer("max_seqs", 0, "--kv=paged: most sequences per worker; 0 = 2 x "
                       "slots_per_worker")
  flags.DEFINE_float("kv_margin", 0.0, "--kv=paged: admission reserves predicted length x "
                     "(1 + this)")
  flags.DEFINE_string("calibrate", "", "run records (bench_out/runs/*.json, comma-separated) of "
                      "one workload to fit the cpu preset on")
  flags.DEFINE_string("predict", "", "run records (comma-separated) to predict with the fitted "
                      "cpu preset (target: device_steps exact, wall within 25%)")

