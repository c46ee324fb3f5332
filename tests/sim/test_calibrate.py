"""sim/calibrate.py: the static baseline's idle fraction on the step simulator, and the workload
sigma picked to match a target idle fraction."""

import dataclasses
import math
from statistics import NormalDist

import pytest

from flexfloor_jax.policy import workload as W
from flexfloor_jax.sim import calibrate


def test_default_sigma_still_gives_the_paper_idle():
  """DEFAULT_SIGMA is the sigma calibrate_sigma picked for the default workload: its static
  baseline idles after finishing about as often as the paper's verl baseline (IDLE_TARGET)."""
  idle = calibrate.static_idle(W.WorkloadSpec())
  assert abs(idle.mean() - W.IDLE_TARGET) < 0.02, idle


# Two prompts of one sample each, no noise, median 4, cap 9: on two workers of one slot each
# worker decodes one sequence, and lengths follow from sigma alone. The prompts' scores are the
# 1/4 and 3/4 quantiles of N(0, 1), -z and +z with z = 0.6745, so a sequence is 4 * exp(+-z sigma)
# tokens, rounded and clipped to [1, 9]. A worker is occupied until the longer one finishes
# (static: no release), idle from its own finish: idle = (long - short) / (2 * long).
#   sigma = 0:          4 and 4 tokens: idle 0
#   sigma = ln 2 / z:   8 and 2 tokens (4 * 2, 4 / 2): idle 6 / 16 = 0.375
#   sigma = 10:         clipped to 9 and 1 tokens: idle 8 / 18 = 0.444...
TINY = W.WorkloadSpec(num_prompts=2, samples_per_prompt=1, epoch_noise=0.0, sample_noise=0.0,
                      median=4, cap=9, min_len=1)
Z = NormalDist().inv_cdf(0.75)
GRID = {0.0: 0.0, math.log(2) / Z: 6 / 16, 10.0: 8 / 18}  # sigma -> static idle, by hand
SHAPE = dict(epochs=range(1), num_workers=2, slots_per_worker=1)


@pytest.mark.parametrize("sigma, idle", GRID.items())
def test_static_idle_by_hand(sigma, idle):
  got = calibrate.static_idle(dataclasses.replace(TINY, sigma=sigma), **SHAPE)
  assert got.tolist() == pytest.approx([idle])


# target -> the grid sigma nearest it: 0.2 is 0.2 from idle 0 but 0.175 from 0.375; 0.4 is 0.025
# from 0.375 and 0.044 from 0.444; 1.0 is nearest the largest idle.
@pytest.mark.parametrize("target, sigma", [(0.0, 0.0), (0.2, math.log(2) / Z),
                                           (0.4, math.log(2) / Z), (1.0, 10.0)])
def test_calibrate_sigma_picks_the_nearest_idle(target, sigma):
  for grid in (list(GRID), list(GRID)[::-1]):  # in either order
    got, idle = calibrate.calibrate_sigma(target, TINY, grid=grid, **SHAPE)
    assert got == pytest.approx(sigma) and idle == pytest.approx(GRID[got])
