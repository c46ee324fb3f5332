"""Side-by-side benchmark: static, balanced and FlexFloor schedules (and release alone) on the same
prompts, epoch after epoch. `python -m flexfloor_jax.bench --config=configs/bench.py`.

  runs      every schedule of every epoch through the runner, each run measured and replayed
  document  bench.json's comparisons: ratios to static, the bound, the release ceiling, calibration
  report    the printed table and summary lines, bench.png, and the published output set
  __main__  the command line: flags, checks before jax starts, the output directory's lock
"""
