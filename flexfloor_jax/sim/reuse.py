"""Released-device reuse in an RL step (numpy only): how long the old-log-prob phase after
generation lasts when the workers a rollout released score finished responses while the tail is
still generating (rl/reuse.py does it on devices; the simulator times it here).

Model: scoring a response costs `seconds_per_token` x its tokens on one device, and a group of g
devices scores at g x that speed. Released devices pool, in release order, into scorer groups of
`group` devices (the fewest that hold the model). Each group takes the earliest-finished response
not yet scored as soon as it is free and one has finished. At the end of generation every device
is back: the groups finish the response in hand, and what is left is spread over all devices.
"""

from __future__ import annotations

import heapq

import numpy as np


def logprob_phase_seconds(finish_s, tokens, release_s, gen_end_s: float, num_devices: int,
                          seconds_per_token: float, group: int = 1) -> dict:
  """{'without': seconds after gen_end with no reuse, 'with': with reuse, 'scored_early':
  fraction of responses scored before gen_end}. finish_s / tokens: per response; release_s: the
  release time of each released worker (workers kept to the end are left out)."""
  finish_s = np.asarray(finish_s, float)
  work = np.asarray(tokens, float) * seconds_per_token  # device-seconds per response
  without = work.sum() / num_devices
  rel = np.sort(np.asarray(release_s, float))
  starts = [rel[k * group + group - 1] for k in range(len(rel) // group)]
  groups = [(t, k) for k, t in enumerate(starts) if t < gen_end_s]
  end_of = {k: t for t, k in groups}  # when each group is free
  heapq.heapify(groups)
  order = np.argsort(finish_s, kind="stable")
  nxt = 0
  done = np.zeros(len(work), bool)
  while groups and nxt < len(order):
    t, k = heapq.heappop(groups)
    t = max(t, finish_s[order[nxt]])  # idle until a response has finished
    if t >= gen_end_s:
      continue  # this group has nothing to start before the end
    i = order[nxt]
    nxt += 1
    done[i] = True
    end_of[k] = t + work[i] / group
    heapq.heappush(groups, (end_of[k], k))
  # After the end: the rest spread over every device, each group's devices joining when their
  # response in hand is done (water-filling over the devices' free times).
  free = np.zeros(num_devices)
  ends = sorted(max(0.0, e - gen_end_s) for e in end_of.values())
  for j, e in enumerate(ends):
    free[j * group:(j + 1) * group] = e
  tail = _fill_time(np.sort(free), work[~done].sum())
  return {"without": float(without), "with": float(tail),
          "scored_early": float(done.mean()) if len(done) else 0.0}


def _fill_time(free_sorted: np.ndarray, work: float) -> float:
  """Earliest T with sum_d max(0, T - free_d) >= work (devices free at free_sorted), and at least
  the last device's free time (the responses in hand finish too)."""
  t = free_sorted[-1]
  for j in range(1, len(free_sorted) + 1):
    cand = (work + free_sorted[:j].sum()) / j
    if j == len(free_sorted) or cand <= free_sorted[j]:
      t = cand
      break
  return float(max(t, free_sorted[-1]))
