"""The bench's output: the printed table and summary lines, bench.png, and bench.json with the
runs' records published as one set in output_dir."""

from __future__ import annotations

import json
import os

from flexfloor_jax.bench.document import (
  DRAFT_SUFFIX,
  DRAFTED_SCHEDULES,
  DRAFTING_ADVANTAGE_TOLERANCE,
  PAPER_THROUGHPUT,
  PAPER_TOKENS_PER_DEVICE_TIME,
)
from flexfloor_jax.io import output_dir
from flexfloor_jax.policy import accounting

RELEASE_ONLY_TARGET = 0.9  # release alone should recover at least this share of its ceiling
# The headline is in the named cost model's seconds (every run's timeline replayed on it);
# device-steps follow as counts
TABLE = (("tokens_per_occupied_device_second", "tok/occ-dev-s", ".1f"),
         ("makespan_s", "makespan s", ".4f"),
         ("tokens_per_device_step", "tok/dev-step", ".3f"), ("makespan_steps", "steps", ".0f"),
         ("slot_utilization", "slot util", ".3f"),
         ("idle_after_finish_fraction", "idle after fin", ".3f"),
         ("device_steps", "dev-steps", ".0f"), ("mean_reward", "reward", ".3f"))


# paged KV (rollout.kv='paged'): the pool's columns, after the others
KV_TABLE = (("kv_pool_bytes", "pool B/worker", "d"), ("kv_pages", "pages", "d"),
            ("kv_peak_pages", "peak pages", "d"), ("preemptions", "preempt", "d"))
SCHEDULES = ("static", "balanced", "flexfloor", "release_only", "release_compaction") + tuple(
    f"{n}{DRAFT_SUFFIX}" for n in DRAFTED_SCHEDULES)  # speculative decoding's, when it ran
# the table's rows of speculative decoding's ratios (ep["ratios"] keys), when it ran
DRAFT_TABLE_PAIRS = (("ff_draft/static_draft", "flexfloor_draft_static_draft"),
                     ("ff_draft/static", "flexfloor_draft_static"))


def is_paged(doc: dict) -> bool:
  return any("kv_pool" in e for e in doc["epochs"])


def format_table(doc: dict) -> str:
  paged = is_paged(doc)
  cols = [("epoch", 5), ("run", 22)] + [(h, max(len(h), 9)) for _, h, _ in TABLE] + [
      ("ceiling", 8), ("of ceiling", 10)] + (
      [(h, max(len(h), 7)) for _, h, _ in KV_TABLE] if paged else [])
  # rows without the pool's columns get dashes there (nothing to add with fixed slots)

  def fmt_row(vals):
    return " ".join(f"{v:>{w}}" for v, (_, w) in zip(
        list(vals) + ["-"] * (len(cols) - len(vals)), cols, strict=True))

  lines = [f"seconds: {doc['cost_model']['name']} (every run's timeline replayed on it, releases "
           f"and migrations charged); device-steps: counts",
           fmt_row([c for c, _ in cols])]
  dash = "-"

  def cell(m, key, f):
    v = m.get(key)
    return dash if v is None else format(v, f)

  for ep in doc["epochs"]:
    k = ep["epoch"]
    for name in SCHEDULES:
      if name in ep:
        m = ep[name]
        lines.append(fmt_row([k, name] + [cell(m, key, f) for key, _, f in TABLE]
                             + [dash, dash]
                             + ([cell(m, key, f) for key, _, f in KV_TABLE] if paged else [])))
    bd, op = ep["bound"], ep["oracle_policy"]
    tokens = ep["static"]["generated_tokens"]
    lines.append(fmt_row([k, "lower bound", format(tokens / bd["occupied_device_seconds"], ".1f"),
                          format(bd["makespan_s"], ".4f")] + [dash] * (len(TABLE) - 2)))
    lines.append(fmt_row([k, "oracle policy", dash, dash,
                          format(op["tokens_per_device_step"], ".3f"),
                          format(op["makespan_steps"], ".0f")]))
    sp = ep["makespan_speedup"]
    for label, r in (("flexfloor/static", ep["ratios"]["flexfloor_static"]),
                     ("flexfloor/balanced", ep["ratios"]["flexfloor_balanced"])):
      tp = f"{r['tokens_per_occupied_device_second']:.3f}" + (
          f" (paper {PAPER_TOKENS_PER_DEVICE_TIME})" if label == "flexfloor/static" else "")
      lines.append(fmt_row([k, label, tp, f"x{r['throughput']:.3f} faster"]))
    for label, key in DRAFT_TABLE_PAIRS:
      if key in ep["ratios"]:
        r = ep["ratios"][key]
        lines.append(fmt_row([k, label, f"{r['tokens_per_occupied_device_second']:.3f}",
                              f"x{r['throughput']:.3f} faster"]))
    for name, r in (("balanced", ep["ratio_balanced"]), ("flexfloor", ep["ratio"])):
      lines.append(fmt_row([k, f"steps {name}/static", dash, dash,
                            format(r["tokens_per_device_step"], ".3f"),
                            f"x{sp[name]:.2f} faster"]
                           + [cell(r, key, ".3f") for key, _, _ in TABLE[4:]]))
    for name in ("release_only", "release_compaction"):  # placement unchanged: vs the ceiling
      if f"ratio_{name}" in ep:
        r = ep[f"ratio_{name}"]
        lines.append(fmt_row([k, f"{name}/static", cell(r, TABLE[0][0], ".3f"), dash,
                              format(r["tokens_per_device_step"], ".3f")]
                             + [cell(r, key, ".3f") for key, _, _ in TABLE[3:]]
                             + [format(ep["release_only_ceiling"], ".3f"),
                                format(ep[f"{name}_of_ceiling"], ".3f")]))
  return "\n".join(lines)


def summary_lines(doc: dict) -> list[str]:
  eps = [e for e in doc["epochs"] if e["epoch"] >= 1] or doc["epochs"]
  out = []
  ks = [e["epoch"] for e in eps]

  def fmt(xs):
    return ", ".join(f"{x:.3f}" for x in xs)

  slack = doc["config"]["scheduler"].get("makespan_slack", 0.05)
  fs = [e["ratios"]["flexfloor_static"] for e in eps]
  fb = [e["ratios"]["flexfloor_balanced"] for e in eps]
  out.append(f"epochs {ks}, {doc['cost_model']['name']} seconds: flexfloor/static tokens per "
             f"occupied device-second {fmt(r['tokens_per_occupied_device_second'] for r in fs)} "
             f"(paper {PAPER_TOKENS_PER_DEVICE_TIME}), throughput "
             f"{fmt(r['throughput'] for r in fs)} (paper {PAPER_THROUGHPUT})")
  out.append(f"epochs {ks}, {doc['cost_model']['name']} seconds: flexfloor/balanced tokens per "
             f"occupied device-second {fmt(r['tokens_per_occupied_device_second'] for r in fb)} "
             f"(target > 1), balanced/flexfloor makespan {fmt(r['throughput'] for r in fb)} "
             f"(target >= {1 / (1 + slack):.3f})")
  if "seed_summary" in doc:
    rows = [r for r in doc["seed_summary"] if r["epoch"] in ks]
    for pair, label in (("flexfloor_static", "flexfloor/static"),
                        ("flexfloor_balanced", "flexfloor/balanced")):
      for key, what in (("tokens_per_occupied_device_second", "tokens per occupied device-second"),
                        ("throughput", "throughput")):
        cells = ", ".join(f"{r[pair][key]['median']:.3f} [{r[pair][key]['min']:.3f}, "
                          f"{r[pair][key]['max']:.3f}]" for r in rows)
        out.append(f"epochs {ks} over seeds {','.join(map(str, doc['seeds']))}, median [min, max]: "
                   f"{label} {what} {cells}")
  r = [e["ratio"]["tokens_per_device_step"] for e in eps]
  ro = [e["oracle_policy"]["ratio_tokens_per_device_step"] for e in eps]
  ms = [e["makespan_speedup"]["flexfloor"] for e in eps]
  out.append(f"epochs {ks}, device-steps (a count): flexfloor/static tokens_per_device_step "
             f"{fmt(r)} (oracle policy {fmt(ro)}); static/flexfloor makespan (steps) {fmt(ms)}")
  if all("release_only_of_ceiling" in e for e in doc["epochs"]):
    q = [e["release_only_of_ceiling"] for e in doc["epochs"]]
    out.append(f"release-only / ceiling per epoch: {', '.join(f'{x:.3f}' for x in q)} "
               f"(target >= {RELEASE_ONLY_TARGET})")
  if all("release_compaction_of_ceiling" in e for e in doc["epochs"]):
    q = [e["release_compaction_of_ceiling"] for e in doc["epochs"]]
    out.append(f"release + compaction (placement unchanged) / ceiling per epoch: "
               f"{', '.join(f'{x:.3f}' for x in q)} (target > 1: past the ceiling)")
  if is_paged(doc):
    out += paged_lines(doc, eps)
  if any("drafting" in e for e in doc["epochs"]):
    out += drafting_lines(doc)
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


def pct(ratio: float) -> str:
  """A ratio as a gain: 1.654 -> '+65%'."""
  return f"{(ratio - 1) * 100:+.0f}%"


def drafting_lines(doc: dict) -> list[str]:
  """Speculative decoding (bench.draft_tokens > 0), per epoch: each schedule's acceptance and mean
  accepted length, its makespan plain -> drafted; flexfloor over static with both drafting against
  both decoding plainly (and whether drafting keeps the advantage, within
  DRAFTING_ADVANTAGE_TOLERANCE); and flexfloor drafting over static decoding plainly, beside the
  paper's gains against verl."""
  out = []
  name = doc["cost_model"]["name"]
  paper = f"paper: {pct(PAPER_TOKENS_PER_DEVICE_TIME)} / {pct(PAPER_THROUGHPUT)} against verl"
  for e in doc["epochs"]:
    if "drafting" not in e:
      continue
    k, dr = e["epoch"], e["drafting"]
    d = e[f"static{DRAFT_SUFFIX}"].get("draft_tokens")
    acc = ", ".join(f"{n} {r['acceptance']:.3f} / {r['mean_accepted_length']:.2f} "
                    f"({r['accepted_tokens']} of {r['drafted_tokens']})" for n, r in dr.items())
    out.append(f"drafting (draft_tokens {d}), epoch {k}: acceptance / mean accepted length "
               f"(accepted of drafted tokens): {acc}")
    ms = ", ".join(f"{n} {r['makespan_s']['plain']:.4f} -> {r['makespan_s']['drafted']:.4f} "
                   f"(x{r['makespan_s']['ratio']:.3f})" for n, r in dr.items())
    out.append(f"drafting, epoch {k}, {name} seconds: makespan s plain -> drafted: {ms}")
    both, plain = e["ratios"]["flexfloor_draft_static_draft"], e["ratios"]["flexfloor_static"]
    out.append(f"drafting, epoch {k}: flexfloor+draft/static+draft tokens per occupied "
               f"device-second {both['tokens_per_occupied_device_second']:.3f}, throughput "
               f"{both['throughput']:.3f}; flexfloor/static "
               f"{plain['tokens_per_occupied_device_second']:.3f}, {plain['throughput']:.3f}; "
               f"advantage kept (within {DRAFTING_ADVANTAGE_TOLERANCE}): "
               f"{e['drafting_keeps_advantage']}")
    r = e["ratios"]["flexfloor_draft_static"]
    n = int(e["static"]["num_workers"])  # a mean over the repeats: a float
    out.append(f"drafting, epoch {k}: flexfloor with drafting over static without it on {n} "
               f"devices: {pct(r['tokens_per_occupied_device_second'])} tokens per occupied "
               f"device-second, {pct(r['throughput'])} throughput ({paper})")
  ok = all(all(e.get("drafts_match_sim", {}).values()) for e in doc["epochs"])
  out.append(f"sim replay drafts as the runs did (drafted and accepted tokens == measured): {ok}")
  return out


def paged_lines(doc: dict, eps: list[dict]) -> list[str]:
  """Paged KV: the paged pool's targets (flexfloor and balanced against static, on one pool), the
  pool every schedule ran on, and per schedule its peak pages and preemptions."""
  ks = [e["epoch"] for e in eps]

  def fmt(xs):
    return ", ".join(f"{x:.3f}" for x in xs)

  out = []
  for name, key in (("flexfloor", "ratio"), ("balanced", "ratio_balanced")):
    r = [e[key]["tokens_per_device_step"] for e in eps]
    ms = [e["makespan_speedup"][name] for e in eps]
    out.append(f"paged KV, same pool, epochs {ks}: {name}/static tokens_per_device_step "
               f"{fmt(r)} (target >= 2.0); static/{name} makespan (steps) {fmt(ms)} "
               f"(target >= 1.5)")
  p = doc["epochs"][0]["kv_pool"]
  same = all(e["kv_pool"] == p for e in doc["epochs"])
  out.append(f"paged KV pool per worker, every schedule and epoch on the same one: {same}: "
             f"{p['kv_pool_bytes']} bytes ({p['kv_pages']} pages of {p['page_size']} tokens; "
             f"the fixed-slot cache {p['kv_fixed_slot_bytes']} bytes), max_seqs "
             f"{p['max_seqs_per_worker']}, kv_margin {p['kv_margin']}")
  names = [n for n in SCHEDULES if all(n in e for e in doc["epochs"])]
  for key, label in (("kv_peak_pages", "peak pages"), ("preemptions", "preemptions")):
    per = "; ".join(f"{n} " + ", ".join(str(e[n][key]) for e in doc["epochs"]) for n in names)
    out.append(f"paged KV {label} per epoch {[e['epoch'] for e in doc['epochs']]}: {per}")
  ok = all(all(e.get("kv_matches_sim", {}).values()) for e in doc["epochs"])
  out.append(f"sim replay on the same pool: peak pages and preemptions == measured for every "
             f"run: {ok}")
  return out


def plot(doc: dict, timelines: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  last = doc["epochs"][-1]["epoch"]
  fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4))
  for (name, k), tl in sorted(timelines.items()):
    if k != last:
      continue
    xs, active, _ = accounting.live_series(tl)
    a.step(xs, active, where="post", label=name,
           ls={"release_only": "--", "release_compaction": ":"}.get(
               name, "-." if name.endswith(DRAFT_SUFFIX) else "-"))
  a.set_xlabel("step (prefill + decode)")
  a.set_ylabel("active workers")
  a.set_title(f"epoch {last}: active workers")
  a.legend()
  ks = [e["epoch"] for e in doc["epochs"]]
  name = doc["cost_model"]["name"]
  b.plot(ks, [e["ratios"]["flexfloor_static"]["tokens_per_occupied_device_second"]
              for e in doc["epochs"]], "o-", label=f"flexfloor/static tok/occ-dev-s ({name})")
  b.plot(ks, [e["ratios"]["flexfloor_static"]["throughput"] for e in doc["epochs"]], "s-",
         label=f"flexfloor/static throughput ({name})")
  b.plot(ks, [e["ratio"]["tokens_per_device_step"] for e in doc["epochs"]], "^:",
         label="flexfloor/static tokens/device-step (count)")
  if all("ratio_release_only" in e for e in doc["epochs"]):
    b.plot(ks, [e["ratio_release_only"]["tokens_per_device_step"] for e in doc["epochs"]], "d--",
           label="release only / static")
    b.plot(ks, [e["release_only_ceiling"] for e in doc["epochs"]], "k:", label="release ceiling")
  if all("ratio_release_compaction" in e for e in doc["epochs"]):
    b.plot(ks, [e["ratio_release_compaction"]["tokens_per_device_step"] for e in doc["epochs"]],
           "s--", label="release + compaction / static")
  if all("flexfloor_draft_static" in e["ratios"] for e in doc["epochs"]):
    b.plot(ks, [e["ratios"]["flexfloor_draft_static"]["tokens_per_occupied_device_second"]
                for e in doc["epochs"]], "v-.",
           label=f"flexfloor+draft/static tok/occ-dev-s ({name})")
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


BENCH_OUTPUTS = ("bench.json", "runs", "bench.png")


def write_outputs(doc, timelines, records, out_dir: str) -> str:
  """bench.json (first: it survives a later failure), runs/ and bench.png, published as one set
  (io/output_dir.py); returns the set's directory. Raises output_dir.OutputWriteError naming the
  file."""
  # a with block: an interrupted publish discards the half-written set
  with output_dir.OutputSet(out_dir, "output_dir", owns=BENCH_OUTPUTS) as s:
    s.write("bench.json", json.dumps(doc, indent=2))
    for (name, k), rec in records.items():
      s.write(os.path.join("runs", f"{name}_e{k}.json"), json.dumps(rec, indent=2))
    with s.writing("bench.png") as path:
      plot(doc, timelines, path)
    return s.publish()
