"""Cluster-scale simulator: the rollout policy the engine runs, on a cost model. Numpy only: no
module of this package imports JAX (tests/test_layout.py checks each in a fresh
interpreter).

  presets   hardware (published device figures) and model presets
  costs     seconds of a step: the roofline model, and the linear cpu model fitted to timelines
  replay    one rollout through the runner's own policy code, its clock run by a cost model
  records   run records of measured rollouts: replay, calibration of the cpu model, prediction
  cluster   static vs balanced vs FlexFloor on a cluster of EP groups, and the RL step after it
  plot      the figure of a cluster simulation (sim.png)
  cli       `python -m flexfloor_jax.sim`: flags, table, sim.json
"""
