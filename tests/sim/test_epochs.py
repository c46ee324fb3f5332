"""sim/epochs.py end to end on the default workload and shape (step simulator): FlexFloor vs
static vs release alone, epoch after epoch."""

import pytest

from flexfloor_jax.policy import workload
from flexfloor_jax.sim import epochs


@pytest.fixture(scope='module')
def results():
  return epochs.compare_epochs(workload.WorkloadSpec(), range(2, 4), num_scenarios=4)


def ratio(x, kind):
  return x[kind]['tokens_per_device_step'] / x['static']['tokens_per_device_step']


def test_release_only_reaches_its_ceiling(results):
  # releasing every worker at its local finish (swaps make any order possible) is exactly
  # 1 / (1 - idle_static)
  for x in results:
    ceiling = 1 / (1 - x['static']['idle_after_finish_fraction'])
    assert ratio(x, 'release_only') == pytest.approx(ceiling, rel=0.02)


def test_compaction_with_placement_unchanged_goes_past_the_ceiling(results):
  # release alone can only remove the idle time after local finish; moving stragglers off
  # workers that could otherwise go removes more
  for x in results:
    ceiling = 1 / (1 - x['static']['idle_after_finish_fraction'])
    rc = ratio(x, 'release_compaction')
    assert rc > 1.03 * ceiling, (rc, ceiling)
    assert x['release_compaction']['generated_tokens'] == x['static']['generated_tokens']


def test_flexfloor_beats_release_only(results):
  for x in results:
    assert ratio(x, 'flexfloor') > ratio(x, 'release_only') + 0.05
    assert ratio(x, 'flexfloor') > 1.5
    assert x['flexfloor']['makespan_steps'] <= 1.05 * x['static']['makespan_steps']
    assert x['flexfloor']['generated_tokens'] == x['static']['generated_tokens']
    assert x['static']['idle_after_finish_fraction'] > 0.25
    assert x['flexfloor']['idle_after_finish_fraction'] < 0.05
