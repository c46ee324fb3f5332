"""Occupancy accounting: a rollout's Timeline -> the metrics of summary.json (README "Measures").

Step convention. Steps are the SPMD steps of the rollout (prefill and decode), numbered 0, 1, ... A
"step count" s means "after s steps". A worker is occupied from its start (step count 0) until its
release (the step count at which it was released), and takes part in every step in between, so
  device_steps = sum over steps of active workers = sum over workers of (release - start).
A worker's local finish is the step count after which it held no sequence any more: one past the
step where its last sequence finished, or the step count at which its last sequences were migrated
away (0 for a worker that never got work).

idle_after_finish_fraction = sum_w (release_w - local_finish_w) / sum_w (release_w - start_w), in
device-steps: the headline, since emulated CPU devices share cores and their seconds mean little.
The same ratio in wall seconds is idle_after_finish_fraction_seconds. Inside a decode dispatch of k
steps the wall time of each step is interpolated linearly (the engine only times the dispatch).

prefill_only_steps_while_decoding: steps that ran prompt tokens and stalled a live row (one-shot
prefill steps while some other row was live); a chunked-prefill run has none, its prompts riding
in decode steps (`dispatch_steps` expands such a dispatch step by step).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexfloor_jax.io.atomic import atomic_open


@dataclass
class Timeline:
  """What happened in one rollout; JSON-serialisable (to_dict / from_dict)."""
  workers: list[int]
  slots_per_worker: int
  t_start: float
  t_end: float | None = None
  # {'kind': 'prefill'|'decode', 'start': step, 'num_steps', 'active': [...], 'live': [per active
  #  worker, at the first step: its live rows, a prefill's new ones included], 't0', 't1'};
  # a prefill also 'admitted': [per active worker, the seq id it prefilled, -1 none]; a chunked
  # decode dispatch also 'chunk' (input tokens a step per worker) and 'pending': [per active
  # worker, its pending list at the first step: [seq id, input tokens run, input tokens left]]
  # (controller's module doc; `dispatch_steps` expands it step by step); a speculative dispatch
  # also 'drafted', 'accepted' and 'drafts' [per active worker, over the dispatch]: drafted rows
  # verified, the drafted tokens kept, and the sequences whose draft was verified
  steps: list[dict] = field(default_factory=list)
  # {'seq_id', 'worker', 'slot', 'num_tokens', 'reason', 'step'}: finished in step index 'step'
  finishes: list[dict] = field(default_factory=list)
  # {'step', 'moves': [[sw, ss, dw, ds], ...], 'queue_moves': [[sw, dw, seq_id], ...],
  #  'kv_bytes', 't'}
  migrations: list[dict] = field(default_factory=list)
  # {'workers': [...], 'step': step count at the decision, 't', 'stats': {...}, 'final': bool}
  releases: list[dict] = field(default_factory=list)

  @property
  def num_steps(self) -> int:
    return max((r['start'] + r['num_steps'] for r in self.steps), default=0)

  def add_step(self, kind, start, num_steps, active, live, t0, t1, *, admitted=None, chunk=0,
               pending=None, drafted=None, accepted=None, drafts=None):
    r: dict[str, Any] = dict(kind=kind, start=int(start), num_steps=int(num_steps),
                             active=[int(w) for w in active], live=[int(x) for x in live],
                             t0=float(t0), t1=float(t1))
    if admitted is not None:
      r['admitted'] = [int(q) for q in admitted]
    if chunk:
      r['chunk'] = int(chunk)
      r['pending'] = [[[int(x) for x in e] for e in v] for v in (pending or [[] for _ in active])]
    if drafted is not None:
      r['drafted'] = [int(x) for x in drafted]
      r['accepted'] = [int(x) for x in (accepted or [0] * len(active))]
      r['drafts'] = [int(x) for x in (drafts or [0] * len(active))]
    self.steps.append(r)

  def add_finish(self, seq_id, worker, slot, num_tokens, reason, step):
    self.finishes.append(dict(seq_id=int(seq_id), worker=int(worker), slot=int(slot),
                              num_tokens=int(num_tokens), reason=str(reason), step=int(step)))

  def add_migration(self, step, moves, queue_moves, kv_bytes, t):
    self.migrations.append(dict(step=int(step), moves=[[int(x) for x in m] for m in moves],
                                queue_moves=[[int(x) for x in m] for m in queue_moves],
                                kv_bytes=int(kv_bytes), t=float(t)))

  def add_release(self, workers, step, t, stats=None, final=False):
    self.releases.append(dict(workers=[int(w) for w in workers], step=int(step), t=float(t),
                              stats=jsonable(stats or {}), final=bool(final)))

  def to_dict(self) -> dict:
    return dict(workers=self.workers, slots_per_worker=self.slots_per_worker, t_start=self.t_start,
                t_end=self.t_end, steps=self.steps, finishes=self.finishes,
                migrations=self.migrations, releases=self.releases)

  @classmethod
  def from_dict(cls, d: dict) -> Timeline:
    return cls(**d)

  def step_end_time(self, step_count: int) -> float:
    """Wall time at which `step_count` steps were done (interpolated inside a dispatch)."""
    if step_count <= 0:
      return self.t_start
    for r in self.steps:
      if r['start'] < step_count <= r['start'] + r['num_steps']:
        frac = (step_count - r['start']) / r['num_steps']
        return r['t0'] + frac * (r['t1'] - r['t0'])
    return self.steps[-1]['t1'] if self.steps else self.t_start


def jsonable(x, nonfinite_to_none: bool = False) -> Any:
  """Plain Python for json.dumps: numpy (or jax) scalars and arrays become numbers and lists;
  nonfinite_to_none maps inf/nan floats to None (strict JSON)."""
  if isinstance(x, dict):
    return {str(k): jsonable(v, nonfinite_to_none) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v, nonfinite_to_none) for v in x]
  if hasattr(x, 'item') and callable(x.item) and getattr(x, 'ndim', 1) == 0:
    x = x.item()
  elif hasattr(x, 'tolist'):
    return jsonable(x.tolist(), nonfinite_to_none)
  if nonfinite_to_none and isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def worker_timeline(tl: Timeline) -> list[dict]:
  """Per worker: start, local finish and release, in step counts and seconds."""
  release = {}
  for r in tl.releases:
    for w in r['workers']:
      if w in release:
        raise ValueError(f'worker {w} released twice')
      release[w] = (r['step'], r['t'])
  finish = {w: 0 for w in tl.workers}
  tokens = {w: 0 for w in tl.workers}
  for f in tl.finishes:
    finish[f['worker']] = max(finish[f['worker']], f['step'] + 1)
    tokens[f['worker']] += f['num_tokens']
  for m in tl.migrations:  # a donor's work ends when its sequences leave
    for sw, *_ in m['moves']:
      finish[sw] = max(finish[sw], m['step'])
    for sw, *_ in m['queue_moves']:
      finish[sw] = max(finish[sw], m['step'])
  out = []
  end_step = tl.num_steps
  end_t = tl.t_end if tl.t_end is not None else tl.step_end_time(tl.num_steps)
  for w in tl.workers:
    rs, rt = release.get(w, (end_step, end_t))
    fs = min(finish[w], rs)
    out.append(dict(worker=w, start_step=0, local_finish_step=fs, release_step=rs,
                    start_s=0.0, local_finish_s=min(tl.step_end_time(fs), rt) - tl.t_start,
                    release_s=rt - tl.t_start, tokens=tokens[w]))
  return out


def metrics(tl: Timeline) -> dict:
  """The summary.json measures of one rollout (see module doc for the definitions)."""
  pre = [r for r in tl.steps if r['kind'] == 'prefill']
  dec = [r for r in tl.steps if r['kind'] == 'decode']
  ds_pre = sum(r['num_steps'] * len(r['active']) for r in pre)
  ds_dec = sum(r['num_steps'] * len(r['active']) for r in dec)
  device_steps = ds_pre + ds_dec
  tokens = sum(f['num_tokens'] for f in tl.finishes)
  # Every sequence's first token comes from its prefill step: leave those out of the slot
  # utilisation so that 1.0 means every decode slot of every active worker did work.
  decode_tokens = tokens - len(tl.finishes)
  wt = worker_timeline(tl)
  occ_steps = sum(w['release_step'] - w['start_step'] for w in wt)
  if occ_steps != device_steps:
    raise AssertionError(f'occupied steps {occ_steps} != device_steps {device_steps}: '
                         'a worker was released while still taking part in steps')
  idle_steps = sum(w['release_step'] - w['local_finish_step'] for w in wt)
  occ_s = sum(w['release_s'] - w['start_s'] for w in wt)
  idle_s = sum(w['release_s'] - w['local_finish_s'] for w in wt)
  wall = ((tl.t_end if tl.t_end is not None else tl.step_end_time(tl.num_steps)) - tl.t_start)
  slots = tl.slots_per_worker
  # critical path: first step to the end of the step in which the last response finished
  last = max((f['step'] for f in tl.finishes), default=-1)
  makespan_s = tl.step_end_time(last + 1) - tl.t_start if last >= 0 else 0.0
  return dict(
      device_steps=device_steps,
      prefill_only_steps_while_decoding=stalling_prefill_steps(tl),
      device_steps_prefill=ds_pre,
      device_steps_decode=ds_dec,
      prefill_steps=sum(r['num_steps'] for r in pre),
      decode_steps=sum(r['num_steps'] for r in dec),
      makespan_steps=tl.num_steps,
      makespan_s=makespan_s,
      generated_tokens=tokens,
      num_sequences=len(tl.finishes),
      tokens_per_device_step=tokens / device_steps if device_steps else 0.0,
      occupied_device_steps=occ_steps,
      occupied_device_seconds=occ_s,
      idle_after_finish_fraction=idle_steps / occ_steps if occ_steps else 0.0,
      idle_after_finish_fraction_seconds=idle_s / occ_s if occ_s > 0 else 0.0,
      slot_utilization=decode_tokens / (ds_dec * slots) if ds_dec else 0.0,
      throughput_tokens_per_s=tokens / wall if wall > 0 else 0.0,
      generation_wall_s=wall,
      num_migrations=sum(len(m['moves']) for m in tl.migrations),
      kv_bytes_migrated=sum(m['kv_bytes'] for m in tl.migrations),
      workers=wt,
      releases=[dict(r) for r in tl.releases],
  )


def stalling_prefill_steps(tl: Timeline) -> int:
  """Steps that ran input tokens and stalled a live row: one-shot prefill steps in which some
  active worker held a live row beside the ones it prefilled there. A decode step decodes every
  live row, the input tokens of chunked prefill riding along, so it never counts: a chunked run
  has none. A prefill record without 'admitted' (an older timeline) counts where a worker held
  two rows or more (at most one of them new): a lower count, never a higher one."""
  n = 0
  for r in tl.steps:
    if r['kind'] != 'prefill':
      continue
    adm = r.get('admitted')
    if adm is None:
      held = any(x >= 2 for x in r['live'])
    else:
      held = sum(r['live']) > sum(q >= 0 for q in adm)
    n += r['num_steps'] * bool(held)
  return n


def draft_summary(tl: Timeline) -> dict:
  """Speculative decoding's measures over a rollout: drafted rows verified, drafted tokens
  accepted (kept) and rejected, and the mean accepted length of a verified draft."""
  tot = {k: sum(sum(r.get(k, ())) for r in tl.steps) for k in ('drafted', 'accepted', 'drafts')}
  return dict(drafted_tokens=tot['drafted'], accepted_tokens=tot['accepted'],
              rejected_tokens=tot['drafted'] - tot['accepted'],
              mean_accepted_length=tot['accepted'] / tot['drafts'] if tot['drafts'] else 0.0)


def finishes_by_step(tl: Timeline) -> dict[int, list[int]]:
  """Step -> the workers of the sequences that finished in it (one entry per finish)."""
  out: dict[int, list[int]] = {}
  for f in tl.finishes:
    out.setdefault(f['step'], []).append(f['worker'])
  return out


def dispatch_steps(tl: Timeline, r: dict,
                   fin_at: dict[int, list[int]] | None = None) -> dict[str, np.ndarray]:
  """A step record of `tl`, step by step: per step (rows) and active worker (columns),
  'rows': live rows that decode; 'tokens': input tokens run (chunked prefill); 'past': the
  input tokens before those in their sequences (the prefix their attention reads, summed over
  the sequences a step's tokens span); 'first': sequences whose input turned in (their first
  token made from it). A chunked dispatch per the controller's contract; a one-shot one has no
  input tokens; a prefill step reports its live rows. fin_at: finishes_by_step(tl), computed
  once when many records are expanded."""
  fin_at = finishes_by_step(tl) if fin_at is None else fin_at
  k, act = int(r['num_steps']), r['active']
  n = len(act)
  pos = {w: i for i, w in enumerate(act)}
  delta = np.zeros((k + 1, n), np.int64)
  delta[0] = r['live']
  tokens, past, first = (np.zeros((k, n), np.int64) for _ in range(3))
  C = int(r.get('chunk', 0))
  for i, lst in enumerate(r.get('pending', []) if C else []):
    end = 0
    for _, ran, left in lst:
      a, end = end, end + left  # its tokens' place in the worker's input stream
      j = -(-end // C) - 1
      if j < k:
        first[j, i] += 1
        delta[j + 1, i] += 1
      for t in range(a // C, min(j, k - 1) + 1):
        lo, hi = max(t * C, a), min((t + 1) * C, end)
        tokens[t, i] += hi - lo
        past[t, i] += ran + lo - a
  if r['kind'] == 'decode':
    for t in range(k):
      for w in fin_at.get(r['start'] + t, ()):
        delta[t + 1, pos[w]] -= 1
  return dict(rows=np.cumsum(delta, axis=0)[:k], tokens=tokens, past=past, first=first)


def live_series(tl: Timeline):
  """(steps, active workers, live sequences) per step, for plots."""
  n = tl.num_steps
  active = [0] * n
  live = [0] * n
  fin_at = {}
  for f in tl.finishes:
    fin_at[f['step']] = fin_at.get(f['step'], 0) + 1
  by_step = finishes_by_step(tl)
  for r in tl.steps:
    if r.get('chunk'):  # rows turn live inside the dispatch too
      rows = dispatch_steps(tl, r, by_step)['rows'].sum(axis=1)
      for i in range(r['num_steps']):
        active[r['start'] + i] = len(r['active'])
        live[r['start'] + i] = int(rows[i])
      continue
    cur = sum(r['live'])
    for i in range(r['start'], r['start'] + r['num_steps']):
      active[i] = len(r['active'])
      live[i] = cur
      cur -= fin_at.get(i, 0)
  return list(range(n)), active, live


def plot_timeline(tl: Timeline, path: str, title: str | None = None) -> str:
  """Active workers and live sequences over steps, releases marked; atomic write of `path`."""
  import matplotlib  # lazy: plotting is optional and heavy
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  xs, active, live = live_series(tl)
  fig, ax = plt.subplots(figsize=(8, 3.5))
  ax.step(xs, active, where='post', label='active workers', color='tab:blue')
  ax.set_xlabel('step (prefill + decode)')
  ax.set_ylabel('active workers')
  ax.set_ylim(0, len(tl.workers) + 0.5)
  ax2 = ax.twinx()
  ax2.step(xs, live, where='post', label='live sequences', color='tab:orange', alpha=0.8)
  ax2.set_ylabel('live sequences')
  ax2.set_ylim(0, len(tl.workers) * tl.slots_per_worker + 1)
  for r in tl.releases:
    if not r['final']:
      ax.axvline(r['step'], color='tab:red', lw=0.8, ls='--')
  ax.set_title(title or 'rollout timeline (dashed: releases)')
  h1, l1 = ax.get_legend_handles_labels()
  h2, l2 = ax2.get_legend_handles_labels()
  ax.legend(h1 + h2, l1 + l2, loc='upper right', fontsize=8)
  fig.tight_layout()
  try:
    with atomic_open(path, 'wb') as f:
      fig.savefig(f, format=os.path.splitext(path)[1][1:] or 'png', dpi=110)
  finally:
    plt.close(fig)
  return path


def save_timeline(tl: Timeline, path: str) -> None:
  """JSON dump of a timeline (atomic)."""
  with atomic_open(path) as f:
    json.dump(tl.to_dict(), f)


def decode_step_medians(tl: Timeline) -> tuple[float, dict[int, float]]:
  """The median decode seconds per step over the rollout, and by active-group size (emulated
  devices share the host's cores, so a step costs more on a bigger mesh)."""
  by_size: dict[int, list[float]] = {}
  for x in tl.steps:
    if x["kind"] == "decode" and x["num_steps"] > 0:
      by_size.setdefault(len(x["active"]), []).append((x["t1"] - x["t0"]) / x["num_steps"])
  per_step = [t for v in by_size.values() for t in v]
  return (float(np.median(per_step)) if per_step else 0.0,
          {k: float(np.median(v)) for k, v in by_size.items()})


def release_latency_ratios(latencies: list[float], sizes: list[int], median_s: float,
                           median_by_size: dict[int, float]) -> dict:
  """summary.json's release latencies over the median decode step, overall and on the mesh each
  release went to ({} without releases)."""
  if not latencies:
    return {}
  return dict(release_latency_over_median_step=max(latencies) / max(median_s, 1e-9),
              decode_step_median_s_by_size={str(k): v for k, v in median_by_size.items()},
              release_latency_over_step_on_new_mesh=[
                  lat / median_by_size[k] for lat, k in zip(latencies, sizes, strict=False)
                  if k in median_by_size])
