"""The default workload's sigma: the one whose static baseline idles after finishing as often as
the paper reports for verl (`workload.IDLE_TARGET`), found on the step simulator. numpy only."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flexfloor_jax.policy import release_policy, scheduler, stepsim, workload

# The sigmas calibrate_sigma tries by default.
SIGMA_GRID = np.round(np.arange(0.05, 1.2001, 0.01), 3)


def static_idle(spec: workload.WorkloadSpec, epochs=range(8),
                num_workers: int = workload.DEFAULT_WORKERS,
                slots_per_worker: int = workload.DEFAULT_SLOTS_PER_WORKER,
                steps_per_dispatch: int = workload.DEFAULT_STEPS_PER_DISPATCH):
  """Static-baseline idle_after_finish_fraction per epoch (stepsim)."""
  out = []
  for e in epochs:
    seqs = workload.make_seqs(spec, e)
    q = scheduler.static_placement(seqs, list(range(num_workers)))
    m = stepsim.simulate(seqs, None, q, release_policy.ReleasePolicy(enabled=False), num_workers,
                         slots_per_worker, steps_per_dispatch)
    out.append(m['idle_after_finish_fraction'])
  return np.asarray(out)


def calibrate_sigma(target: float = workload.IDLE_TARGET,
                    spec: workload.WorkloadSpec | None = None, epochs=range(8),
                    num_workers: int = workload.DEFAULT_WORKERS,
                    slots_per_worker: int = workload.DEFAULT_SLOTS_PER_WORKER,
                    grid=SIGMA_GRID) -> tuple[float, float] | None:
  """The grid sigma whose mean static idle fraction over `epochs` is nearest `target`.
  A grid, not bisection: with few prompts idle(sigma) is not monotone. Returns (sigma, idle)
  (None for an empty grid)."""
  spec = spec or workload.WorkloadSpec()
  best = None
  for s in grid:
    idle = float(static_idle(replace(spec, sigma=float(s)), epochs, num_workers,
                             slots_per_worker).mean())
    if best is None or abs(idle - target) < abs(best[1] - target):
      best = (float(s), idle)
  return best


