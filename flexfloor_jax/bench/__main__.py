"""Side-by-side benchmark: `python -m flexfloor_jax.bench --config=configs/bench.py`.

Runs static, balanced, FlexFloor, release alone and release + compaction on the same prompts for
each epoch (flexfloor_jax/bench/runs.py). Every run's timeline is replayed through the simulator
(flexfloor_jax.sim: the same policy code, the same device_steps) on the named cost model
(`cost_model`, the roofline of a full-size model and hardware pair the tiny model stands for,
releases and migrations charged): the headline is in its seconds (tokens per occupied
device-second, makespan; flexfloor over static and over balanced), beside the lower bound of
those seconds for the epoch's lengths. Device-steps follow as counts, with the oracle policy (a
balanced placement told the actual lengths, with release) and release alone against its ceiling
1 / (1 - static idle_after_finish_fraction). Written to output_dir: bench.json, bench.png and
runs/<schedule>_e<k>.json (each run's sequences, lengths, history and timeline: what
`python -m flexfloor_jax.sim --calibrate=... --predict=...` reads).
"""

from __future__ import annotations

from absl import flags

from flexfloor_jax.bench import report, runs
from flexfloor_jax.config import cli, settings
from flexfloor_jax.config.cli import fail
from flexfloor_jax.io import output_dir
from flexfloor_jax.rollout import runner
from flexfloor_jax.runtime.backend import emulate_cpu_devices, enable_compilation_cache

_CONFIG = cli.define_config("configs/bench.py", "Benchmark config file.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None,
                                    "Emulated devices on CPU (default: config mesh.cpu_devices).")


def main(argv):
  del argv
  config = _CONFIG.value
  cli.config_loaded(config)
  try:  # every field checked before jax starts, as the rollout CLI does
    st = settings.load(config, "bench")
  except settings.ConfigError as e:
    fail(str(e))
  assert st.bench is not None  # load(config, "bench") reads the bench section
  out = st.bench.output_dir
  try:  # checked and locked before jax starts: a second bench on this directory fails at once
    lock = output_dir.acquire(out, "output_dir", report.BENCH_OUTPUTS)
  except output_dir.OutputDirError as e:
    fail(str(e))
  with lock:
    emulate_cpu_devices(_CPU_DEVICES.value or st.mesh.cpu_devices)  # before the first JAX operation
    enable_compilation_cache()
    try:
      doc, timelines, records = runs.run_bench(config, st)
    except runner.RolloutError as e:
      fail(str(e))
    print(report.format_table(doc))
    for line in report.summary_lines(doc):
      print(line)
    try:
      report.write_outputs(doc, timelines, records, out)
    except output_dir.OutputWriteError as e:
      fail(str(e))
  print(f"wrote {out}/bench.json, bench.png, runs/ ({doc['bench_seconds']:.0f} s)")


if __name__ == "__main__":
  cli.run(main)
