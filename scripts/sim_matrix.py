"""The simulator's matrix: every model and hardware pair at 8, 64 and 256 devices over five
workload seeds, one `python -m flexfloor_jax.sim` run per pair, timed, and one table of the
seconds-first targets.

  python scripts/sim_matrix.py --kv=paged --workload=long_reasoning
  python scripts/sim_matrix.py --kv=slots --workload=default --out=sim_matrix_slots

Every other flag goes to the simulator as given. Each pair writes <out>/<model>@<hardware>/sim.json;
the table (markdown, median [min, max] over the seeds) is printed and written to <out>/matrix.md.
"""

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
HARDWARE = ("h100", "tpu-v5p")
DEVICES = "8,64,256"
SEEDS = "0,1,2,3,4"


def cell(fig: dict) -> str:
  return f"{fig['median']:.3f} [{fig['min']:.3f}, {fig['max']:.3f}]"


def checks(row: dict) -> list[str]:
  """The targets this row misses (the seconds-first work's list), by name."""
  th, mk = row["throughput ff/st"], row["makespan ff/bal"]
  miss = []
  if th["median"] < 1.0 or th["min"] < 0.97:
    miss.append("throughput >= static")
  if mk["median"] > 1.05:
    miss.append("makespan <= 1.05 x balanced")
  if row["devices"] >= 64:
    if row["tok/occ ff/st"]["median"] < 1.65:
      miss.append("tok/occ >= 1.65 x static")
    if row["tok/occ ff/bal"]["median"] < 1.10:
      miss.append("tok/occ >= 1.10 x balanced")
    want = min(1.5, 0.95 * row["oracle-bal/st throughput"]["median"])
    if th["median"] < want:
      miss.append(f"throughput >= {want:.3f}")
  return miss


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", default="sim_matrix_out")
  args, rest = ap.parse_known_args()
  t_all = time.perf_counter()
  lines = ["| model | hardware | devices | throughput FF/static | tok/occ FF/static | "
           "tok/occ FF/balanced | oracle policy: tok/occ FF/balanced | makespan FF/balanced | "
           "oracle-balanced/static throughput | targets missed |", "|" + "---|" * 10]
  times = []
  for model in MODELS:
    for hw in HARDWARE:
      out = os.path.join(args.out, f"{model}@{hw}")
      t0 = time.perf_counter()
      cmd = [sys.executable, "-m", "flexfloor_jax.sim", f"--model={model}", f"--hardware={hw}",
             f"--devices={DEVICES}", f"--seeds={SEEDS}", f"--output_dir={out}", *rest]
      r = subprocess.run(cmd, capture_output=True, text=True)
      if r.returncode != 0:
        sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:])
        return r.returncode
      times.append(f"{model}@{hw} {time.perf_counter() - t0:.0f} s")
      print(times[-1], flush=True)
      with open(os.path.join(out, "sim.json")) as f:
        summary = json.load(f)["summary"]
      for row in summary:
        lines.append(f"| {model} | {hw} | {row['devices']} | {cell(row['throughput ff/st'])} | "
                     f"{cell(row['tok/occ ff/st'])} | {cell(row['tok/occ ff/bal'])} | "
                     f"{cell(row['oracle-ff/bal tok/occ'])} | "
                     f"{cell(row['makespan ff/bal'])} | "
                     f"{cell(row['oracle-bal/st throughput'])} | "
                     f"{', '.join(checks(row)) or 'none'} |")
  total = time.perf_counter() - t_all
  lines.append("")
  lines.append(f"matrix: {total / 60:.1f} min ({'; '.join(times)})")
  text = "\n".join(lines)
  print(text)
  with open(os.path.join(args.out, "matrix.md"), "w") as f:
    f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
