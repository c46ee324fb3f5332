"""Length history, prediction, and the three placements (static verl-like, balanced, FlexFloor).

A placement is {worker: [seq ids in queue (FIFO) order]}; the controller prefills queue heads into
free slots, so a worker's queue order is its start order.
"""

from __future__ import annotations

import heapq
import json
import logging
import os

import numpy as np

from flexfloor_jax.policy.atomic import atomic_write
from flexfloor_jax.policy.controller import Seq

HISTORY_FORMAT = 'flexfloor_jax.length_history'
HISTORY_VERSION = 1

log = logging.getLogger(__name__)


def static_placement(seqs: list[Seq], workers: list[int]) -> dict[int, list[int]]:
  """verl: the batch in input order cut into equal contiguous chunks, one per worker, FIFO."""
  chunks = np.array_split(np.arange(len(seqs)), len(workers))
  return {int(w): [seqs[i].seq_id for i in c] for w, c in zip(workers, chunks)}


def balanced_placement(seqs: list[Seq], predicted, workers: list[int],
                       slots_per_worker: int) -> dict[int, list[int]]:
  """The strong baseline: longest predicted first, each onto the worker whose list-scheduled finish
  (LPT over its B slots) grows least; samples of one prompt may go to different workers. Queues
  are longest first, so with a shared queue at run time every free slot takes the longest work
  still waiting."""
  pred = np.asarray(predicted, float)
  lanes = {int(w): [0.0] * slots_per_worker for w in workers}
  queues: dict[int, list[int]] = {int(w): [] for w in workers}
  for i in sorted(range(len(seqs)), key=lambda i: (-pred[i], i)):
    w = min(lanes, key=lambda v: (lanes[v][0] + pred[i], v))
    heapq.heapreplace(lanes[w], lanes[w][0] + pred[i])
    queues[w].append(seqs[i].seq_id)
  return queues


# ---------------------------------------------------------------------------------------------
# History

class HistoryError(ValueError):
  pass


class LengthHistory:
  """prompt id -> epoch -> response lengths of its samples."""

  def __init__(self, data: dict[str, dict[int, list[int]]] | None = None,
               step_seconds: dict[int, float] | None = None, model: str | None = None):
    self.data = {p: {int(e): list(map(int, v)) for e, v in d.items()} for p, d in (data or {}).items()}
    # median decode-step seconds by active-group size, measured by the engine (policy.costs)
    self.step_seconds = {int(n): float(t) for n, t in (step_seconds or {}).items()}
    # Identity of the model whose responses these are (model.config.model_identity): saved with
    # the file, so that one model's lengths never steer another model's schedule unnoticed.
    self.model = model

  def add_step_seconds(self, table: dict[int, float]) -> None:
    """A run's measured step times: each size measured now replaces the older figure."""
    self.step_seconds.update({int(n): float(t) for n, t in table.items()})

  def __len__(self):
    return len(self.data)

  def __contains__(self, prompt_id):
    return prompt_id in self.data

  def add(self, prompt_id: str, epoch: int, lengths) -> None:
    self.data.setdefault(str(prompt_id), {})[int(epoch)] = [int(x) for x in lengths]

  def add_rollout(self, epoch: int, seqs: list[Seq], lengths: dict[int, int]) -> None:
    """Record one rollout: lengths by seq id (e.g. Finish.num_tokens)."""
    by_prompt: dict[str, list[tuple[int, int]]] = {}
    for s in seqs:
      by_prompt.setdefault(s.prompt_id, []).append((s.sample, int(lengths[s.seq_id])))
    for p, v in by_prompt.items():
      self.add(p, epoch, [n for _, n in sorted(v)])

  def epochs(self, prompt_id: str) -> dict[int, list[int]]:
    return self.data.get(prompt_id, {})

  def all_lengths(self) -> np.ndarray:
    return np.asarray([n for d in self.data.values() for v in d.values() for n in v], float)

  def save(self, path: str) -> None:
    """Atomic: a temp file in the same directory, fsync, os.replace; a crash leaves the old file."""
    doc = {'format': HISTORY_FORMAT, 'version': HISTORY_VERSION,
           'prompts': {p: {str(e): v for e, v in sorted(d.items())} for p, d in self.data.items()},
           'step_seconds': {str(n): t for n, t in sorted(self.step_seconds.items())}}
    if self.model is not None:
      doc['model'] = self.model
    atomic_write(path, json.dumps(doc), durable=True)

  @classmethod
  def from_table(cls, table, source: str, *, max_new_tokens: int | None = None,
                 step_seconds=None, model: str | None = None) -> 'LengthHistory':
    """A history from its saved "prompts" table, every value checked: each prompt's epochs are
    integers >= 0 holding non-empty lists of whole lengths in [1, max_new_tokens] (every response
    has at least its first token; max_new_tokens unchecked when None). HistoryError names
    `source` (the file) and the prompt otherwise."""
    if not isinstance(table, dict):
      raise HistoryError(f'length history {source}: "prompts" must be an object, got '
                         f'{type(table).__name__}')
    hi = max_new_tokens if max_new_tokens is not None else float('inf')
    data: dict[str, dict[int, list[int]]] = {}
    for p, d in table.items():
      where = f'length history {source}: prompt {p!r}'
      if not isinstance(d, dict):
        raise HistoryError(f'{where}: malformed entry {d!r:.80} (expected epoch -> lengths)')
      for e, v in d.items():
        try:
          epoch = int(e)
        except (TypeError, ValueError):
          raise HistoryError(f'{where}: epoch {e!r} is not an integer') from None
        if epoch < 0:
          raise HistoryError(f'{where}: epoch {epoch} is negative')
        if not isinstance(v, list) or not v:
          raise HistoryError(f'{where} epoch {epoch}: lengths must be a non-empty list, got '
                             f'{v!r:.80}')
        for x in v:
          if not (isinstance(x, (int, np.integer)) and not isinstance(x, bool)) or not 1 <= x <= hi:
            rng = ('>= 1' if max_new_tokens is None else
                   f'in [1, {max_new_tokens}] (rollout.max_new_tokens)')
            raise HistoryError(f'{where} epoch {epoch}: length {x!r} is not a whole number {rng}')
        data.setdefault(str(p), {})[epoch] = [int(x) for x in v]
    return cls(data, step_seconds, model)

  @classmethod
  def load(cls, path: str, *, max_new_tokens: int | None = None,
           model: str | None = None) -> 'LengthHistory':
    """Missing file -> empty history. Corrupt or foreign file, or an impossible value (a length
    outside [1, max_new_tokens], an empty list) -> HistoryError naming the path and the prompt
    (never a silent reset: that would throw away what the scheduler learned). A file recorded
    for another model than `model` -> a warning and an empty history (the file is replaced when
    this run saves); a file that records no model is taken as this model's."""
    if not os.path.exists(path):
      return cls(model=model)
    try:
      with open(path) as f:
        doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise HistoryError(f'length history {path} is unreadable or corrupt ({e}); '
                         'fix or remove it to start from an empty history') from e
    if not isinstance(doc, dict) or doc.get('format') != HISTORY_FORMAT:
      raise HistoryError(f'{path} is not a flexfloor_jax length history (format marker missing)')
    if doc.get('version') != HISTORY_VERSION:
      raise HistoryError(f'length history {path} has version {doc.get("version")!r}, '
                         f'this code reads {HISTORY_VERSION}')
    recorded = doc.get('model')
    if model is not None and recorded is not None and recorded != model:
      log.warning('length history %s was recorded for model %s, not this model (%s): starting '
                  'from an empty history; this run replaces the file when it saves', path,
                  recorded, model)
      return cls(model=model)
    try:
      steps = {int(n): float(t) for n, t in (doc.get('step_seconds') or {}).items()}
    except (AttributeError, TypeError, ValueError) as e:
      raise HistoryError(f'length history {path} has a malformed "step_seconds" table ({e})') from e
    if any(n < 1 or not np.isfinite(t) or t <= 0 for n, t in steps.items()):
      raise HistoryError(f'length history {path}: "step_seconds" needs sizes >= 1 and finite '
                         f'seconds > 0, got {steps}')
    if 'prompts' not in doc:
      raise HistoryError(f'length history {path} has no "prompts" table')
    return cls.from_table(doc['prompts'], path, max_new_tokens=max_new_tokens, step_seconds=steps,
                          model=model if model is not None else recorded)


# ---------------------------------------------------------------------------------------------
# Prediction

def predict(history: LengthHistory, seqs: list[Seq], prior: float | None = None, *,
            window: int = 3, quantile: float = 0.75) -> np.ndarray:
  """Predicted length per seq (same order as `seqs`).

  Seen prompt: the `quantile` of its samples over its last `window` epochs. Samples of one prompt
  are exchangeable, so all get the same value; a high quantile leans towards the group's tail,
  which is what decides when a worker holding the group is done. Unseen prompt: `prior`, else the
  median of all recorded lengths, else half of max_new_tokens.
  """
  pool = history.all_lengths()
  glob = prior if prior is not None else (float(np.median(pool)) if pool.size else None)
  cache: dict[str, float] = {}
  out = np.empty(len(seqs))
  for i, s in enumerate(seqs):
    if s.prompt_id not in cache:
      ep = history.epochs(s.prompt_id)
      if ep:
        recent = [n for e in sorted(ep)[-window:] for n in ep[e]]
        cache[s.prompt_id] = float(np.quantile(recent, quantile))
      else:
        cache[s.prompt_id] = glob if glob is not None else s.max_new_tokens / 2
    out[i] = min(cache[s.prompt_id], s.max_new_tokens)
  return out


def _ranks(x: np.ndarray) -> np.ndarray:
  """1-based ranks, ties get their average rank."""
  order = np.argsort(x, kind='stable')
  xs = x[order]
  r = np.empty(len(x))
  i = 0
  while i < len(x):
    j = i
    while j + 1 < len(x) and xs[j + 1] == xs[i]:
      j += 1
    r[order[i:j + 1]] = (i + j) / 2 + 1
    i = j + 1
  return r


def prediction_quality(pred, actual) -> dict:
  """Spearman rank correlation (average ranks) and mean absolute error."""
  p, a = np.asarray(pred, float), np.asarray(actual, float)
  if p.shape != a.shape or p.ndim != 1:
    raise ValueError(f'pred and actual must be 1-D of one shape, got {p.shape} and {a.shape}')
  rp, ra = _ranks(p) - (len(p) + 1) / 2, _ranks(a) - (len(a) + 1) / 2
  den = np.sqrt((rp**2).sum() * (ra**2).sum())
  return {'spearman': float((rp * ra).sum() / den) if den > 0 else 0.0,
          'mae': float(np.abs(p - a).mean()) if len(p) else 0.0}


# ---------------------------------------------------------------------------------------------
# FlexFloor placement

def _pack(order, pred, chain, B, cap):
  """First-fit decreasing from the chain's tail: each worker takes the longest remaining seqs that
  keep its list-scheduled finish (LPT onto B slots) <= cap; what fits nowhere goes where it grows
  a worker's finish least. Queue order = longest first."""
  left = list(order)
  queues = {w: [] for w in chain}
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


def sample_scenarios(history: LengthHistory, seqs: list[Seq], predicted, num: int, seed: int = 0,
                     window: int = 3) -> list[dict[int, int]]:
  """`num` plausible length draws. Per draw, each seen prompt picks one of its last `window`
  epochs and its seqs resample that epoch's lengths, so a group shifts as a whole (as between
  epochs) and its samples differ (as at run time), which a point prediction per group hides.
  Unseen prompts keep their prediction."""
  rng = np.random.default_rng([seed, 7])
  out = []
  for _ in range(num):
    pick: dict[str, list[int] | None] = {}
    draw = {}
    for s, p in zip(seqs, predicted):
      if s.prompt_id not in pick:
        ep = history.epochs(s.prompt_id)
        recent = sorted(ep)[-window:]
        pick[s.prompt_id] = ep[recent[rng.integers(len(recent))]] if recent else None
      pool = pick[s.prompt_id]
      draw[s.seq_id] = int(rng.choice(pool)) if pool else max(1, int(round(p)))
    out.append(draw)
  return out


def flexfloor_placement(seqs: list[Seq], predicted, workers_chain: list[int],
                        slots_per_worker: int, *, floor: int = 1, steps_per_dispatch: int = 8,
                        num_candidates: int = 12, policy_kw: dict | None = None,
                        scenarios: list[dict[int, int]] | None = None,
                        makespan_slack: float = 0.05, late_tol: float | None = None,
                        return_info: bool = False):
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

  Lateness: with `late_tol` None, a candidate is late if it is later than the budget in any
  scenario. With a tolerance, its mean makespan over the scenarios must stay within the mean budget
  and no single scenario may exceed its budget by more than `late_tol` (a fraction): one outlier
  draw no longer vetoes a placement that is on time on average.
  """
  from flexfloor_jax.policy import planner, stepsim  # planner/stepsim import controller only
  pred = np.clip(np.rint(np.asarray(predicted, float)), 1,
                 [s.max_new_tokens for s in seqs]).astype(np.int64)
  ids = [s.seq_id for s in seqs]
  plens = {q: int(p) for q, p in zip(ids, pred)}
  N, B = len(workers_chain), slots_per_worker
  kw = dict(policy_kw or {})

  if sorted(workers_chain) != list(range(N)):
    raise ValueError(f'workers must be 0..N-1 in some order, got {workers_chain}')
  worlds = list(scenarios) if scenarios else [plens]

  def sim(queues, enabled=True):
    """Device-steps (mean) and makespan (per scenario) over the length scenarios, with the same
    release policy as at run time (it sees only the predictions)."""
    ds, ms = 0.0, []
    for L in worlds:
      pol = planner.ReleasePolicy(enabled=enabled, floor=floor, chain=list(workers_chain),
                                  predicted=plens, **kw)
      m = stepsim.simulate(seqs, L, queues, pol, N, B, steps_per_dispatch)
      ds += m['device_steps'] / len(worlds)
      ms.append(m['makespan_steps'])
    return {'device_steps': ds, 'makespan_steps': np.asarray(ms, float)}

  static_q = static_placement(seqs, sorted(workers_chain))
  ms_static = sim(static_q, enabled=False)['makespan_steps']  # the baseline never releases
  bal_q = balanced_placement(seqs, pred, sorted(workers_chain), B)
  ms_bal = np.zeros(len(worlds))
  for j, L in enumerate(worlds):  # the balanced schedule: full width, shared queue
    pol = planner.ReleasePolicy(enabled=True, floor=N, chain=list(workers_chain),
                                predicted=plens, shared_queue=True, compaction=False, swap=False)
    ms_bal[j] = stepsim.simulate(seqs, L, bal_q, pol, N, B, steps_per_dispatch)['makespan_steps']
  order = sorted(range(len(seqs)), key=lambda i: (-pred[i], i))  # ties keep groups together
  lo = max(float(pred.max()), float(pred.sum()) / (N * B))
  ms_budget = ms_bal * (1.0 + makespan_slack)
  cands = []
  for c in np.unique(np.linspace(lo, max(lo, ms_budget.mean()), num_candidates).round()):
    cands.append((float(c), _pack(order, pred.astype(float), list(workers_chain), B, float(c))))
  # head-light: the first h workers get B seqs each and no queue (no refill prefill steps while
  # many workers are active); the rest is LPT-balanced over the tail
  for h in range(1, N):
    if B * h >= len(seqs):
      break
    qi = {w: [] for w in workers_chain}
    for j, w in enumerate(workers_chain[:h]):
      qi[w] = list(order[len(order) - B * (j + 1):len(order) - B * j])
    tail = list(workers_chain[h:])
    lanes = {w: [0.0] * B for w in tail}
    for i in order[:len(order) - B * h]:
      w = min(tail, key=lambda v: (lanes[v][0] + pred[i], -tail.index(v)))
      heapq.heapreplace(lanes[w], lanes[w][0] + pred[i])
      qi[w].append(i)
    cands.append((f'head{h}', qi))
  # sorted equal chunks: the head gets the shortest predicted sequences (no packing at all)
  chunks = np.array_split(np.asarray(order[::-1]), N)
  cands.append(('sorted', {w: [int(i) for i in c[::-1]] for w, c in zip(workers_chain, chunks)}))
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
  info = dict(cap=best[2], predicted_device_steps=best[3]['device_steps'],
              predicted_makespan=float(best[3]['makespan_steps'].mean()),
              static_predicted_makespan=float(ms_static.mean()),
              balanced_predicted_makespan=float(ms_bal.mean()))
  return (best[1], info) if return_info else best[1]


def flexfloor_schedule(seqs: list[Seq], history: LengthHistory, workers_chain: list[int],
                       slots_per_worker: int, *, floor: int = 1, steps_per_dispatch: int = 8,
                       num_scenarios: int = 8, seed: int = 0, prior: float | None = None,
                       policy_kw: dict | None = None, late_tol: float | None = 0.15,
                       shallow_late_tol: float | None = 0.05, quantile: float = 0.9,
                       makespan_slack: float = 0.05):
  """predict -> scenarios from history -> placement, in one call (what the runner needs).
  Returns (queues, predicted lengths by seq id, info). `seed` keys the scenario draws (use the
  epoch) so a schedule is reproducible. Lateness tolerance (see `flexfloor_placement`): `late_tol`
  once every prompt of the batch has >= 2 recorded epochs, else `shallow_late_tol` (with one
  epoch the scenarios only resample that epoch and underestimate the spread between epochs).
  `quantile` goes to `predict`: placement leans further into each group's tail than the default.
  Tuned on the synthetic workload (stepsim, seeds 0-2, epochs 0-7)."""
  pred = predict(history, seqs, prior, quantile=quantile)
  sc = sample_scenarios(history, seqs, pred, num_scenarios, seed) if len(history) else None
  depth = min((len(history.epochs(s.prompt_id)) for s in seqs), default=0)
  tol = late_tol if depth >= 2 else shallow_late_tol
  queues, info = flexfloor_placement(seqs, pred, workers_chain, slots_per_worker, floor=floor,
                                     steps_per_dispatch=steps_per_dispatch, scenarios=sc,
                                     policy_kw=policy_kw, late_tol=tol, return_info=True,
                                     makespan_slack=makespan_slack)
  return queues, {s.seq_id: float(p) for s, p in zip(seqs, pred)}, info
