"""The placements: which worker runs which sequences, in which order (static verl-like, balanced,
FlexFloor), and `flexfloor_schedule`, the prediction-to-placement pipeline the runner calls.

A placement is {worker: [seq ids in queue (FIFO) order]}; the controller prefills queue heads into
free slots, so a worker's queue order is its start order.
"""

from __future__ import annotations

import heapq

import numpy as np

from flexfloor_jax.policy import release_policy, stepsim
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.policy.prediction import predict, sample_scenarios


def static_placement(seqs: list[Seq], workers: list[int]) -> dict[int, list[int]]:
  """verl: the batch in input order cut into equal contiguous chunks, one per worker, FIFO."""
  chunks = np.array_split(np.arange(len(seqs)), len(workers))
  return {int(w): [seqs[i].seq_id for i in c] for w, c in zip(workers, chunks, strict=True)}


class PoolLoad:
  """Paged KV: a worker's predicted finish from its page pool, not from lanes alone.

  On a pool, concurrency is limited by pages: admission reserves, for every live sequence, the
  pages of its prompt + predicted response x (1 + margin) (PagePool.reservation) and the rows are
  max_seqs. A worker given n sequences i (predicted length p_i, reservation r_i pages) is
  predicted to finish at
    n + max(LPT of the p_i onto its max_seqs rows, sum of r_i p_i / the pool's pages)
  (n: each admission is a prefill step in which none of its live rows decodes; the second term:
  its reserved page-steps, were its pool kept full). Built from the rollout's pool factory `kv`
  (predicted lengths by seq id -> a fresh PagePool) with the placement's own predictions;
  `steps_per_dispatch` as the controller admits with."""

  def __init__(self, seqs: list[Seq], predicted, kv, steps_per_dispatch: int = 8):
    pred = np.asarray(predicted, float)
    pool = kv({s.seq_id: float(p) for s, p in zip(seqs, pred, strict=False)})
    self.pages, self.rows = float(pool.num_pages), int(pool.max_seqs)
    self.reserve = np.array([pool.reservation(s, 0, steps_per_dispatch) for s in seqs], float)
    self.pred = pred
    self.work = self.reserve * pred  # reserved page-steps per sequence

  @property
  def lanes(self) -> int:
    """Rows a worker's pool holds at once on these predictions: its rows, fewer where its pages
    over the mean reservation are fewer."""
    mean = max(float(self.reserve.mean()), 1.0) if len(self.reserve) else 1.0
    return max(1, min(self.rows, int(self.pages // mean)))

  def binds(self) -> bool:
    """Whether pages can ever stop an admission: not when every row may hold the largest
    reservation at once. Otherwise rows alone limit a worker, as fixed slots do, and the lane
    model is the placement's estimate (`for_pool` returns None)."""
    return bool(self.rows * self.reserve.max(initial=0.0) > self.pages)

  @classmethod
  def for_pool(cls, seqs, predicted, kv, steps_per_dispatch: int = 8) -> PoolLoad | None:
    """A PoolLoad where the pool `kv` can bind, else None (place by lanes)."""
    if kv is None:
      return None
    load = cls(seqs, predicted, kv, steps_per_dispatch)
    return load if load.binds() else None

  def empty(self):
    """A worker's load: [row heap of finish times, reserved page-steps, sequences]."""
    return [[0.0] * self.rows, 0.0, 0]

  def finish_with(self, load, i) -> float:
    """Predicted finish of a worker with load `load` once it also runs sequence i."""
    p = self.pred[i]
    return load[2] + 1 + max(load[0][0] + p, max(load[0]),
                             (load[1] + self.reserve[i] * p) / self.pages)

  def add(self, load, i) -> None:
    p = self.pred[i]
    heapq.heapreplace(load[0], load[0][0] + p)
    load[1] += self.reserve[i] * p
    load[2] += 1

  def finish(self, indices) -> float:
    """Predicted finish of a worker given the sequences `indices` (in queue order)."""
    load = self.empty()
    for i in indices:
      self.add(load, i)
    return load[2] + max(load[0] + [load[1] / self.pages])

  def bound(self, num_workers: int) -> float:
    """No worker can finish before the longest prediction, nor all before the page-steps spread
    evenly over every pool (plus their admissions)."""
    n = len(self.pred)
    return max(float(self.pred.max()) + 1,
               float(self.work.sum()) / (num_workers * self.pages) + n / num_workers)


def balanced_placement(seqs: list[Seq], predicted, workers: list[int],
                       slots_per_worker: int, *, pool: PoolLoad | None = None
                       ) -> dict[int, list[int]]:
  """The strong baseline: longest predicted first, each onto the worker whose list-scheduled finish
  (LPT over its B slots) grows least, ties to the one with the fewest sequences; samples of one
  prompt may go to different workers. Queues
  are longest first, so with a shared queue at run time every free slot takes the longest work
  still waiting.
  pool (paged KV, a PoolLoad of the same seqs and predictions): the same rule over the rows the
  pool holds at once (PoolLoad.lanes), where a worker's reserved page-steps over its pages, once
  past its lanes' finish (the pool, not the rows, then limits it), are its finish. Not
  PoolLoad.finish_with's estimate, which prices rows as free: where pages are plentiful it
  stacks rows onto the worker whose longest row ends first while the others run a fraction of
  theirs, and every step of the group waits for the fullest worker."""
  pred = np.asarray(predicted, float)
  queues: dict[int, list[int]] = {int(w): [] for w in workers}
  if pool is not None:
    heaps = {int(w): [0.0] * pool.lanes for w in workers}
    work = dict.fromkeys(heaps, 0.0)  # reserved page-steps

    def key(v, i):
      lane = heaps[v][0] + pred[i]
      paged = (work[v] + pool.work[i]) / pool.pages
      return (paged if paged > max(lane, max(heaps[v])) else lane, len(queues[v]), v)

    for i in sorted(range(len(seqs)), key=lambda i: (-pred[i], i)):
      w = min(heaps, key=lambda v: key(v, i))
      heapq.heapreplace(heaps[w], heaps[w][0] + pred[i])
      work[w] += pool.work[i]
      queues[w].append(seqs[i].seq_id)
    return queues
  lanes = {int(w): [0.0] * slots_per_worker for w in workers}
  for i in sorted(range(len(seqs)), key=lambda i: (-pred[i], i)):
    # ties (free lanes on several workers) go to the worker with the fewest sequences: in steps
    # stacking rows on one worker is free, in seconds its steps are the slowest
    w = min(lanes, key=lambda v: (lanes[v][0] + pred[i], len(queues[v]), v))
    heapq.heapreplace(lanes[w], lanes[w][0] + pred[i])
    queues[w].append(seqs[i].seq_id)
  return queues


def _pack(order, pred, chain, B, cap, pool=None):
  """First-fit decreasing from the chain's tail: each worker takes the longest remaining seqs that
  keep its list-scheduled finish (LPT onto B slots) <= cap; what fits nowhere goes where it grows
  a worker's finish least. Queue order = longest first. pool (a PoolLoad): the finish on the
  worker's page pool instead (PoolLoad.finish_with)."""
  left = list(order)
  queues = {w: [] for w in chain}
  if pool is not None:
    loads = {w: pool.empty() for w in chain}
    for w in reversed(chain):
      rest = []
      for i in left:
        if pool.finish_with(loads[w], i) <= cap:
          pool.add(loads[w], i)
          queues[w].append(i)
        else:
          rest.append(i)
      left = rest
    for i in left:
      w = min(chain, key=lambda v: (pool.finish_with(loads[v], i), -chain.index(v)))
      pool.add(loads[w], i)
      queues[w].append(i)
    return queues
  heaps = {w: [0.0] * B for w in chain}
  for w in reversed(chain):
    h = heaps[w]
    rest = []
    for i in left:
      if h[0] + pred[i] <= cap:
        heapq.heapreplace(h, h[0] + pred[i])
        queues[w].append(i)
      else:
        rest.append(i)
    left = rest
  for i in left:
    w = min(chain, key=lambda v: (heaps[v][0] + pred[i], -chain.index(v)))
    heapq.heapreplace(heaps[w], heaps[w][0] + pred[i])
    queues[w].append(i)
  return queues


def flexfloor_placement(seqs: list[Seq], predicted, workers_chain: list[int],
                        slots_per_worker: int, *, floor: int = 1, steps_per_dispatch: int = 8,
                        num_candidates: int = 12, policy_kw: dict | None = None,
                        scenarios: list[dict[int, int]] | None = None,
                        makespan_slack: float = 0.05, late_tol: float | None = None,
                        return_info: bool = False, kv=None, cost=None):
  """Long predicted sequences on the chain's tail (survives longest), short ones on the head.

  Objective: the makespan first, then the device time. A candidate is on time when its simulated
  completion is within `makespan_slack` (a fraction) of the balanced schedule's (full width, no
  release, shared queue: `balanced_placement`), in every length scenario (`scenarios`, e.g. from
  `sample_scenarios`; default: the point predictions); among those on time, fewest simulated
  device-steps. Candidates are simulated with stepsim under the run-time release policy, which
  sees only the predictions:
    - `_pack` (first-fit decreasing from the tail) for per-worker finish caps from the tightest
      possible (longest prediction, or total work spread evenly) up to the static makespan;
    - head-light: the first h chain workers get B short seqs and no queue, so they refill nothing
      while many workers are active (every prefill step costs all active workers) and go early;
    - sorted equal chunks, the static placement, and the balanced placement itself (with release:
      a release never pushes the predicted completion later, so it is on time).
  Queues are longest-predicted first. Mispredictions are left to compaction and work stealing.
  kv: paged KV, a function (predicted lengths by seq id) -> a fresh policy.pages.PagePool whose
  max_seqs is slots_per_worker; every candidate (and the balanced budget) is then simulated on it,
  and the balanced budget, `_pack` and head-light's tail estimate a worker's finish from its pool
  (PoolLoad: rows and reserved page-steps) instead of B lanes.

  cost: a step cost model (policy.costs.StepCost): candidates, the balanced budget and the static
  makespan are then simulated in its seconds, the release policy of the simulations decides on it
  as at run time, and "fewest device-steps" becomes fewest occupied device-seconds: a step over
  more rows on a worker is slower, which steps do not see.

  Lateness: with `late_tol` None, a candidate is late if it is later than the budget in any
  scenario. With a tolerance, its mean makespan over the scenarios must stay within the mean budget
  and no single scenario may exceed its budget by more than `late_tol` (a fraction), so that one
  outlier draw does not veto a placement that is on time on average.
  """
  pred = np.clip(np.rint(np.asarray(predicted, float)), 1,
                 [s.max_new_tokens for s in seqs]).astype(np.int64)
  ids = [s.seq_id for s in seqs]
  plens = {q: int(p) for q, p in zip(ids, pred, strict=False)}
  N, B = len(workers_chain), slots_per_worker
  kw = dict(policy_kw or {})

  if sorted(workers_chain) != list(range(N)):
    raise ValueError(f'workers must be 0..N-1 in some order, got {workers_chain}')
  worlds = list(scenarios) if scenarios else [plens]

  # what a candidate is scored on: device-steps and steps, or with a cost model its seconds
  work, span = (('occupied_device_seconds', 'makespan_s') if cost is not None
                else ('device_steps', 'makespan_steps'))
  timed = dict(cost=cost) if cost is not None else {}

  def sim(queues, enabled=True):
    """Device time (mean) and makespan (per scenario) over the length scenarios, with the same
    release policy as at run time (it sees only the predictions)."""
    ds, ms = 0.0, []
    for L in worlds:
      pol = release_policy.ReleasePolicy(enabled=enabled, floor=floor, chain=list(workers_chain),
                                  predicted=plens, **kw, **timed)
      m = stepsim.simulate(seqs, L, queues, pol, N, B, steps_per_dispatch,
                           kv=kv(plens) if kv else None, **timed)
      ds += m[work] / len(worlds)
      ms.append(m[span])
    return {'device_steps': ds, 'makespan_steps': np.asarray(ms, float)}

  # paged KV: a worker's finish from its pool (rows and reserved page-steps), not B lanes
  load = PoolLoad.for_pool(seqs, pred, kv, steps_per_dispatch)
  static_q = static_placement(seqs, sorted(workers_chain))
  ms_static = sim(static_q, enabled=False)['makespan_steps']  # the baseline never releases
  bal_q = balanced_placement(seqs, pred, sorted(workers_chain), B, pool=load)

  def balanced_run(L, unit):
    """The balanced schedule in world L: full width, shared queue."""
    pol = release_policy.ReleasePolicy(enabled=True, floor=N, chain=list(workers_chain),
                                predicted=plens, shared_queue=True, compaction=False, swap=False)
    return stepsim.simulate(seqs, L, bal_q, pol, N, B, steps_per_dispatch,
                            kv=kv(plens) if kv else None, **unit)

  # in steps whatever the unit: the packing caps and the release policy's budget are in steps
  steps_bal = np.array([balanced_run(L, {})['makespan_steps'] for L in worlds], float)
  ms_bal = (np.array([balanced_run(L, timed)[span] for L in worlds], float) if timed
            else steps_bal)
  order = sorted(range(len(seqs)), key=lambda i: (-pred[i], i))  # ties keep groups together
  lo = max(float(pred.max()), float(pred.sum()) / (N * B))
  if load is not None:
    lo = max(lo, load.bound(N))
  ms_budget = ms_bal * (1.0 + makespan_slack)
  cands = []
  hi = steps_bal.mean() * (1.0 + makespan_slack)
  for c in np.unique(np.linspace(lo, max(lo, hi), num_candidates).round()):
    cands.append((float(c), _pack(order, pred.astype(float), list(workers_chain), B, float(c),
                                  pool=load)))
  # head-light: the first h workers get B seqs each and no queue (no refill prefill steps while
  # many workers are active); the rest is LPT-balanced over the tail
  for h in range(1, N):
    if B * h >= len(seqs):
      break
    qi = {w: [] for w in workers_chain}
    for j, w in enumerate(workers_chain[:h]):
      qi[w] = list(order[len(order) - B * (j + 1):len(order) - B * j])
    tail = list(workers_chain[h:])
    if load is not None:
      loads = {w: load.empty() for w in tail}
      for i in order[:len(order) - B * h]:
        w = min(tail, key=lambda v: (load.finish_with(loads[v], i), -tail.index(v)))
        load.add(loads[w], i)
        qi[w].append(i)
    else:
      lanes = {w: [0.0] * B for w in tail}
      for i in order[:len(order) - B * h]:
        w = min(tail, key=lambda v: (lanes[v][0] + pred[i], -tail.index(v)))
        heapq.heapreplace(lanes[w], lanes[w][0] + pred[i])
        qi[w].append(i)
    cands.append((f'head{h}', qi))
  # sorted equal chunks: the head gets the shortest predicted sequences (no packing at all)
  chunks = np.array_split(np.asarray(order[::-1]), N)
  cands.append(('sorted', {w: [int(i) for i in c[::-1]]
                           for w, c in zip(workers_chain, chunks, strict=True)}))
  index = {q: i for i, q in enumerate(ids)}
  cands.append(('static', {w: [index[q] for q in v] for w, v in static_q.items()}))
  cands.append(('balanced', {w: [index[q] for q in v] for w, v in bal_q.items()}))
  best = None
  for c, qi in cands:
    queues = {w: [ids[i] for i in v] for w, v in qi.items()}
    m = sim(queues)
    ratio = m['makespan_steps'] / ms_budget
    if late_tol is None:
      late = float(np.maximum(ratio, 1.0).max())  # 1.0 = never late
    else:
      late = max(1.0, float(m['makespan_steps'].mean() / ms_budget.mean()),
                 float(ratio.max()) / (1.0 + late_tol))
    key = (late, m['device_steps'])
    if best is None or key < best[0]:
      best = (key, queues, c, m)
  assert best is not None  # cands always holds the sorted, static and balanced placements
  info = dict(cap=best[2], predicted_device_steps=best[3]['device_steps'],
              predicted_makespan=float(best[3]['makespan_steps'].mean()),
              static_predicted_makespan=float(ms_static.mean()),
              balanced_predicted_makespan=float(steps_bal.mean()),
              unit='seconds' if cost is not None else 'steps')
  return (best[1], info) if return_info else best[1]


def flexfloor_schedule(seqs: list[Seq], history: LengthHistory, workers_chain: list[int],
                       slots_per_worker: int, *, floor: int = 1, steps_per_dispatch: int = 8,
                       num_scenarios: int = 8, seed: int = 0, prior: float | None = None,
                       policy_kw: dict | None = None, late_tol: float | None = 0.15,
                       shallow_late_tol: float | None = 0.05, quantile: float = 0.9,
                       makespan_slack: float = 0.05, kv=None, cost=None):
  """predict -> scenarios from history -> placement, in one call (what the runner needs).
  Returns (queues, predicted lengths by seq id, info). `seed` keys the scenario draws (use the
  epoch) so a schedule is reproducible. Lateness tolerance (see `flexfloor_placement`): `late_tol`
  once every prompt of the batch has >= 2 recorded epochs, else `shallow_late_tol` (with one
  epoch the scenarios only resample that epoch and underestimate the spread between epochs).
  `quantile` goes to `predict`: placement leans further into each group's tail than the default.
  The defaults suit the synthetic workload (policy/workload.py); another workload may want
  others. kv: paged KV, cost: the step cost model (see `flexfloor_placement`)."""
  pred = predict(history, seqs, prior, quantile=quantile)
  sc = sample_scenarios(history, seqs, pred, num_scenarios, seed) if len(history) else None
  depth = min((len(history.epochs(s.prompt_id)) for s in seqs), default=0)
  tol = late_tol if depth >= 2 else shallow_late_tol
  queues, info = flexfloor_placement(seqs, pred, workers_chain, slots_per_worker, floor=floor,
                                     steps_per_dispatch=steps_per_dispatch, scenarios=sc,
                                     policy_kw=policy_kw, late_tol=tol, return_info=True,
                                     makespan_slack=makespan_slack, kv=kv, cost=cost)
  return queues, {s.seq_id: float(p) for s, p in zip(seqs, pred, strict=True)}, info
