"""What the length history says about the next rollout: a predicted length per sequence, plausible
length scenarios drawn from the recorded epochs, and how good a prediction was."""

from __future__ import annotations

import numpy as np

from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.history import LengthHistory


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
    for s, p in zip(seqs, predicted, strict=False):
      if s.prompt_id not in pick:
        ep = history.epochs(s.prompt_id)
        recent = sorted(ep)[-window:]
        pick[s.prompt_id] = ep[recent[rng.integers(len(recent))]] if recent else None
      pool = pick[s.prompt_id]
      draw[s.seq_id] = int(rng.choice(pool)) if pool else max(1, int(round(p)))
    out.append(draw)
  return out
