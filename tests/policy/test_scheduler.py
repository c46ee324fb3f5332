"""Static placement, prediction, FlexFloor placement. (The length history: test_history.py.)"""


import numpy as np
import pytest

from flexfloor_jax.policy import prediction, release_policy, scheduler, stepsim, workload
from flexfloor_jax.policy.controller import Seq, run
from flexfloor_jax.policy.history import (
  LengthHistory,
)


def test_static_placement_is_contiguous_chunks():
  seqs = workload.make_seqs(workload.WorkloadSpec(), 0)
  q = scheduler.static_placement(seqs, list(range(8)))
  assert q[0] == list(range(8)) and q[7] == list(range(56, 64))
  assert all(len({seqs[i].prompt_id for i in v}) == 1 for v in q.values())  # a group per worker
  q = scheduler.static_placement(seqs[:10], [0, 1, 2])
  assert [len(v) for v in q.values()] == [4, 3, 3] and sum(q.values(), []) == list(range(10))


def test_prediction_quality_by_hand():
  # ranks: pred [1, 2.5, 2.5, 4], actual [1, 3, 2, 4]; centred: [-1.5, 0, 0, 1.5] and
  # [-1.5, .5, -.5, 1.5]; spearman = 4.5 / sqrt(4.5 * 5)
  q = prediction.prediction_quality([1, 2, 2, 3], [1, 3, 2, 4])
  assert q['spearman'] == pytest.approx(4.5 / np.sqrt(22.5))
  assert q['mae'] == pytest.approx(0.5)
  assert prediction.prediction_quality([5, 5, 5], [1, 2, 3])['spearman'] == 0.0


def test_prediction_converges_on_default_workload():
  spec = workload.WorkloadSpec()
  h = LengthHistory()
  sp = []
  for e in range(4):
    seqs = workload.make_seqs(spec, e)
    actual = [s.target_len for s in seqs]
    sp.append(prediction.prediction_quality(prediction.predict(h, seqs), actual)['spearman'])
    h.add_rollout(e, seqs, {s.seq_id: s.target_len for s in seqs})
  assert sp[0] == 0.0  # no history: one prior for everybody
  assert sp[3] >= 0.8, sp


def test_predict_unseen_prompt_uses_prior():
  h = LengthHistory()
  h.add('seen', 0, [10, 20, 30, 40])
  seqs = [workload.Seq(0, 'seen', 0, 4, None, 100), workload.Seq(1, 'new', 0, 4, None, 100)]
  p = prediction.predict(h, seqs)
  assert p[0] == pytest.approx(np.quantile([10, 20, 30, 40], 0.75))
  assert p[1] == pytest.approx(25.0)  # global median
  assert prediction.predict(h, seqs, prior=7.0)[1] == 7.0
  assert prediction.predict(LengthHistory(), seqs)[0] == 50.0  # nothing known: half the cap


@pytest.mark.parametrize('epoch', [1, 3])
def test_flexfloor_placement_replays_within_capacity(epoch):
  spec = workload.WorkloadSpec()
  h = LengthHistory()
  for e in range(epoch):
    s = workload.make_seqs(spec, e)
    h.add_rollout(e, s, {x.seq_id: x.target_len for x in s})
  seqs = workload.make_seqs(spec, epoch)
  chain = [2, 0, 1, 3, 7, 4, 5, 6]
  queues, pred, info = scheduler.flexfloor_schedule(seqs, h, chain, 4, num_scenarios=3, seed=epoch)
  assert sorted(sum(queues.values(), [])) == [s.seq_id for s in seqs]
  assert set(queues) <= set(chain)

  class Checked(stepsim.SimExecutor):
    def prefill(self, assign):
      out = super().prefill(assign)
      assert all(sum(q >= 0 for q in self.slot_seq[w]) <= 4 for w in self._active)
      return out

  ex = Checked(seqs, 8, 4)  # actual lengths, not the predicted ones
  rec = run(seqs, queues, ex, release_policy.ReleasePolicy(chain=chain, predicted=pred), 8)
  assert len(rec.finishes) == len(seqs)
  assert info['predicted_makespan'] <= info['static_predicted_makespan'] + 1e-9


def test_flexfloor_puts_long_on_tail():
  spec = workload.WorkloadSpec()
  seqs = workload.make_seqs(spec, 0)
  pred = np.array([s.target_len for s in seqs], float)  # oracle predictions
  chain = list(range(8))
  q = scheduler.flexfloor_placement(seqs, pred, chain, 4)
  def mean(w):
    return np.mean([pred[i] for i in q[w]]) if q[w] else 0.0
  assert mean(chain[-1]) > mean(chain[0])
  for w in chain:  # longest predicted first within a worker
    assert [pred[i] for i in q[w]] == sorted([pred[i] for i in q[w]], reverse=True)


def _two_long_six_short():
  """2 workers, pools of 16 pages of 4 tokens and 4 rows, no margin; prompts of 4. A response of
  40 reserves ceil(44 / 4) = 11 pages, so a pool runs one at a time (22 > 16); one of 4 reserves
  3 at admission (prompt + 1 + 5 steps of a dispatch = 10 tokens)."""
  from flexfloor_jax.policy.pages import PagePool
  seqs = [Seq(i, f'p{i}', 0, 4, n, 60) for i, n in enumerate([40, 40] + [4] * 6)]
  pred = [float(s.target_len) for s in seqs]
  def kv(p):
    return PagePool(2, 16, 4, 4, predicted=p, margin=0.0)
  return seqs, pred, kv


def test_pool_aware_balanced_placement_by_hand():
  """Lanes: the two 40s key 40 on both workers (4 free lanes each); the tie goes to the worker
  with fewer sequences, so they spread, and the 4s alternate. On the pool (PoolLoad: finish =
  sequences + max(rows' LPT, reserved page-steps / 16)): the second 40 would make worker 0's
  finish 2 + 22 x 40 / 16 = 57 > worker 1's 41, so the 40s go to different workers, the 4s
  alternate; 43 steps = the lower bound (40 + 4 prefill rounds - 1), where both 40s stacked on
  one worker run one after the other (85)."""
  seqs, pred, kv = _two_long_six_short()
  lane = scheduler.balanced_placement(seqs, pred, [0, 1], 4)
  load = scheduler.PoolLoad(seqs, pred, kv, 5)
  assert list(load.reserve) == [11, 11] + [3] * 6
  assert load.finish([0, 1, 2, 3]) == 4 + 22 * 40 / 16 + 6 * 4 / 16
  mem = scheduler.balanced_placement(seqs, pred, [0, 1], 4, pool=load)
  assert lane == mem == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
  lengths = {s.seq_id: s.target_len for s in seqs}
  stacked = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}  # both 40s on worker 0: one after the other
  ms = [stepsim.simulate(seqs, None, q, release_policy.ReleasePolicy(False), 2, 4, 5,
                         kv=kv(lengths))['makespan_steps'] for q in (stacked, mem)]
  assert ms == [85, 43]
  from flexfloor_jax.policy import pages
  assert pages.makespan_lower_bound(seqs, lengths, 2, 16, 4, 4)['bound'] == 43


def test_pool_balanced_placement_spreads_rows_where_pages_are_plentiful():
  """2 workers of 8 rows, pools of 120 pages of 4 tokens: the pages could stop an admission (8
  rows x a 100's 26 pages > 120), but the predicted lengths fit at once (106 pages in all). The
  rows then decide, as with lanes: the 100 and the 90 on different workers, the 10s alternate,
  8 sequences each. A finish that prices rows as free (sequences + the longest row) puts 10s on
  the worker with the 90 until it holds 11 more than the other, and in seconds, where a step is
  as slow as its fullest worker, that placement runs longer."""
  from flexfloor_jax.policy.pages import PagePool
  seqs = [Seq(i, f'p{i}', 0, 4, n, 200) for i, n in enumerate([100, 90] + [10] * 14)]
  pred = [float(s.target_len) for s in seqs]

  def kv(p):
    return PagePool(2, 120, 4, 8, predicted=p, margin=0.0)

  load = scheduler.PoolLoad(seqs, pred, kv, 5)
  assert load.binds() and load.lanes == 8
  q = scheduler.balanced_placement(seqs, pred, [0, 1], 8, pool=load)
  assert sorted(len(v) for v in q.values()) == [8, 8]
  assert {0, 1} <= {q[0][0], q[1][0]}  # the two long ones apart, each first in its queue
  stacked = {0: [0, 2, 3], 1: [1] + list(range(4, 16))}

  class PerRow:  # 1 s a step plus 0.1 s a row on the fullest worker
    name = "hand"

    def worker_step_seconds(self, rows_w, kv_w):
      return 1.0 + 0.1 * float(max(rows_w))

    def decode_seconds(self, n_active, live_seqs):
      return 1.0 + 0.1 * -(-live_seqs // n_active)

    def prefill_seconds(self, prompt_w):
      return 1.0

  lengths = {s.seq_id: s.target_len for s in seqs}
  secs = [stepsim.simulate(seqs, None, v, release_policy.ReleasePolicy(False), 2, 8, 5,
                           kv=kv(lengths), cost=PerRow())['makespan_s'] for v in (q, stacked)]
  assert secs[0] < secs[1]


def test_pool_aware_pack_spreads_what_lanes_stack():
  """_pack with lanes puts everything on the chain's tail (the 8 onto its 4 lanes finish at 44);
  on the pool the tail takes the first 40 and three 4s (4 sequences + 40 = 44; the second 40
  would make it 2 + 22 x 40 / 16 = 57, a fifth sequence 45), the head the rest: 43 steps on the
  pool, where the lanes' placement runs both 40s on one worker one after the other."""
  seqs, pred, kv = _two_long_six_short()
  load = scheduler.PoolLoad(seqs, pred, kv, 5)
  order = sorted(range(len(seqs)), key=lambda i: (-pred[i], i))
  p = np.asarray(pred)
  assert scheduler._pack(order, p, [0, 1], 4, 44.0) == {0: [], 1: list(range(8))}
  packed = scheduler._pack(order, p, [0, 1], 4, 44.0, pool=load)
  assert packed == {0: [1, 5, 6, 7], 1: [0, 2, 3, 4]}
  assert [load.finish(v) for v in packed.values()] == [44.0, 44.0]
  lengths = {s.seq_id: s.target_len for s in seqs}
  ms = [stepsim.simulate(seqs, None, q, release_policy.ReleasePolicy(False), 2, 4, 5,
                         kv=kv(lengths))['makespan_steps']
        for q in ({0: [], 1: list(range(8))}, packed)]
  assert ms[1] == 43 < ms[0]


def test_pool_load_only_where_pages_can_bind():
  """PoolLoad.for_pool: the hand case's pools (4 rows, 16 pages, a 40 reserving 11) can stop an
  admission, so placement goes by the pool; a pool of 4 x 11 = 44 pages cannot (every row may
  hold the largest reservation), so placement keeps the lanes (None), as on fixed slots."""
  from flexfloor_jax.policy.pages import PagePool
  seqs, pred, kv = _two_long_six_short()
  assert isinstance(scheduler.PoolLoad.for_pool(seqs, pred, kv, 5), scheduler.PoolLoad)
  def roomy(p):
    return PagePool(2, 44, 4, 4, predicted=p, margin=0.0)
  assert scheduler.PoolLoad.for_pool(seqs, pred, roomy, 5) is None
  def tight(p):
    return PagePool(2, 43, 4, 4, predicted=p, margin=0.0)
  assert isinstance(scheduler.PoolLoad.for_pool(seqs, pred, tight, 5), scheduler.PoolLoad)
  assert scheduler.PoolLoad.for_pool(seqs, pred, None, 5) is None
