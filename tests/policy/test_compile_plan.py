"""Compiles follow the plan (policy/compile_plan.py), and a release held back by a compile that is
not ready is counted, never silent (policy/ready_floor.py). Host-side: numpy only, no compiles."""

import copy
import itertools

import pytest

from flexfloor_jax.policy import compile_plan, controller, plan, ready_floor, stepsim, workload
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.history import LengthHistory

N, B, E = 8, 4, 8
SPEC = workload.WorkloadSpec(num_prompts=8, samples_per_prompt=8, seed=0, cap=256)


def _setup(history, epoch=0, sizes=None):
  seqs = workload.make_seqs(SPEC, epoch)
  queues, policy, pred = plan.plan_rollout(seqs, history, "flexfloor", N, B, 1,
                                           steps_per_dispatch=8, epoch=epoch, sizes=sizes)
  return seqs, queues, policy, pred


def _plan(history, **kw):
  seqs, queues, policy, pred = _setup(history, **kw)
  cands = [m for m in (kw.get("sizes") or range(1, N)) if m < N]
  placement = ExpertPlacement.initial(E, list(range(N)), E, num_workers=N)
  return compile_plan.plan_compiles(seqs, queues, policy, pred, num_workers=N, slots_per_worker=B,
                                    steps_per_dispatch=8, candidates=cands, placement=placement,
                                    chain=list(range(N)), has_history=len(history) > 0)


def test_no_history_expects_every_size_with_movers_along_the_path():
  p = _plan(LengthHistory())
  assert p.source == "no_history" and p.predicted_releases == []
  assert p.order == p.expected == [7, 6, 5, 4, 3, 2, 1]
  # 8 -> 7 sends worker 0's one expert to worker 1; 7 -> 6 sends worker 1's two to 2 and 3
  assert p.movers[7] == ([0, 1], list(range(8)))
  assert p.movers[6] == ([2, 3], [])
  slot = [w for m in p.expected for w in p.movers[m][0]]
  assert len(slot) == len(set(slot))  # each device's movers once, with the first size needing them


def test_with_history_the_sizes_the_replay_reaches_compile_first():
  hist = LengthHistory()
  seqs = workload.make_seqs(SPEC, 0)
  hist.add_rollout(0, seqs, {s.seq_id: s.target_len for s in seqs})
  p = _plan(hist, epoch=1)
  assert p.source == "replay" and p.predicted_releases
  assert p.expected == [m for _, m in p.predicted_releases]
  assert p.order[:len(p.expected)] == p.expected
  assert sorted(p.order, reverse=True) == [7, 6, 5, 4, 3, 2, 1]
  assert all(a > b for a, b in itertools.pairwise(p.expected))
  # release_sizes: only allowed sizes are compiled at all
  q = _plan(hist, epoch=1, sizes=(8, 4, 2, 1))
  assert sorted(q.order, reverse=True) == [4, 2, 1] and set(q.expected) <= {4, 2, 1}


class _Compiled:
  """StepCache.ready() of a cache that has compiled `sizes` and no others."""

  def __init__(self, sizes):
    self.sizes = set(sizes)

  def ready(self, m):
    return m in self.sizes


@pytest.mark.parametrize("ready", [(7, 6, 5), (7, 6, 5, 4, 3, 2, 1)])
def test_releases_held_for_compile_are_counted(ready):
  seqs, queues, policy, _ = _setup(LengthHistory())
  free = controller.run(seqs, queues, stepsim.SimExecutor(seqs, N, B), copy.deepcopy(policy),
                        steps_per_dispatch=8)
  held = ready_floor.ReadyFloor(copy.deepcopy(policy), _Compiled(ready), N, range(7, 0, -1))
  rec = controller.run(seqs, queues, stepsim.SimExecutor(seqs, N, B), held, steps_per_dispatch=8)
  held.finish(rec.timeline)
  summary = ready_floor.held_summary(held)
  steps, free_steps = rec.metrics()["device_steps"], free.metrics()["device_steps"]
  if len(ready) == 7:  # every size compiled: the unrestricted policy's rollout, nothing held
    assert steps == free_steps
    assert summary["releases_held_for_compile_steps"] == 0
    assert summary["releases_held_for_compile"] == {}
    return
  assert steps > free_steps
  assert summary["releases_held_for_compile_steps"] > 0
  assert summary["releases_held_for_compile_device_steps"] > 0
  assert {int(k) for k in summary["releases_held_for_compile"]} <= {4, 3, 2, 1}
  assert sum(summary["releases_held_for_compile"].values()) == \
      summary["releases_held_for_compile_steps"]
  sizes = [N]
  for r in rec.timeline.releases:
    if not r["final"]:
      sizes.append(sizes[-1] - len(r["workers"]))
  assert min(sizes) == 5, sizes  # never onto a size not compiled
