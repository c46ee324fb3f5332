"""Epoch after epoch on a synthetic workload, the length history growing: static, release alone,
release + compaction and FlexFloor side by side in the step simulator. numpy only."""

from __future__ import annotations

from flexfloor_jax.policy import prediction, release_policy, scheduler, stepsim, workload
from flexfloor_jax.policy.history import LengthHistory


def compare_epochs(spec, epochs, num_workers: int = 8, slots_per_worker: int = 4, floor: int = 1,
                   steps_per_dispatch: int = 8, num_scenarios: int = 8,
                   policy_kw: dict | None = None) -> list[dict]:
  """Static vs release-only vs release + compaction vs FlexFloor on a synthetic workload, epoch
  after epoch (the length history of epochs 0..e-1 drives epoch e). Per epoch: the four metric
  dicts and the prediction quality."""
  workers = list(range(num_workers))
  hist = LengthHistory()
  out = []
  for e in range(max(epochs) + 1):
    seqs = workload.make_seqs(spec, e)
    actual = workload.target_lengths(seqs)
    if e in epochs:
      static_q = scheduler.static_placement(seqs, workers)
      args = (num_workers, slots_per_worker, steps_per_dispatch)
      st = stepsim.simulate(seqs, None, static_q, release_policy.ReleasePolicy(enabled=False),
                            *args)
      ro = stepsim.simulate(seqs, None, static_q,
                            release_policy.ReleasePolicy(floor=floor, compaction=False,
                                                         steal=False), *args)
      # the baseline's placement kept, release + compaction of stragglers (runner: placement
      # 'static', compaction on); its predictions come from the same history
      pred_static = {q.seq_id: float(p)
                     for q, p in zip(seqs, prediction.predict(hist, seqs), strict=True)}
      rc = stepsim.simulate(seqs, None, static_q,
                            release_policy.ReleasePolicy(floor=floor, chain=workers,
                                                         compaction=True, steal=False,
                                                         predicted=pred_static), *args)
      queues, pred, info = scheduler.flexfloor_schedule(
          seqs, hist, workers, slots_per_worker, floor=floor,
          steps_per_dispatch=steps_per_dispatch, num_scenarios=num_scenarios, seed=e,
          policy_kw=policy_kw)
      ff = stepsim.simulate(seqs, None, queues, release_policy.ReleasePolicy(
          floor=floor, chain=workers, predicted=pred, **(policy_kw or {})), *args)
      pq = prediction.prediction_quality([pred[s.seq_id] for s in seqs],
                                        [actual[s.seq_id] for s in seqs])
      out.append(dict(epoch=e, static=st, release_only=ro, release_compaction=rc, flexfloor=ff,
                      prediction=pq,
                      placement=info))
    hist.add_rollout(e, seqs, actual)
  return out
