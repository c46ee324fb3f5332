"""The expert placement table: which (worker, slot) holds each expert, and how it changes when
workers are released (only the experts of released workers move)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexfloor_jax.policy.floor import FloorError, expert_slots


@dataclass
class ExpertPlacement:
  """expert -> list of (worker, slot) replicas over N workers x S preallocated slots each.

  Replica 0 is the one tokens are routed to; with one replica per expert the arrays below mean
  exactly "where the expert lives". Keeping a list per expert lets replicas be added without
  changing `slot_expert` / `expert_to_slot`.
  """
  num_workers: int
  slots: int
  replicas: list[list[tuple[int, int]]]

  @property
  def num_experts(self) -> int:
    return len(self.replicas)

  @classmethod
  def initial(cls, num_experts: int, workers: list[int], slots: int,
              num_workers: int | None = None) -> ExpertPlacement:
    """Contiguous blocks of ceil(E/n) experts per worker, in the order of `workers`."""
    n = len(workers)
    per = expert_slots(num_experts, n)
    if per > slots:
      raise FloorError(f'{num_experts} experts need {per} slots on each of {n} workers; '
                       f'only {slots} are preallocated')
    reps = [[(int(workers[e // per]), e % per)] for e in range(num_experts)]
    return cls(num_workers=num_workers or (max(workers) + 1), slots=slots, replicas=reps)

  def workers_of(self, e: int) -> list[int]:
    return [w for w, _ in self.replicas[e]]

  def slot_expert(self) -> np.ndarray:
    """[N, S] expert id held in each slot, -1 = empty."""
    t = np.full((self.num_workers, self.slots), -1, np.int64)
    for e, reps in enumerate(self.replicas):
      for w, s in reps:
        t[w, s] = e
    return t

  def expert_to_slot(self, active: list[int]) -> np.ndarray:
    """[E] global slot id (position of worker in `active` * S + slot) of each expert's replica 0."""
    pos = {w: i for i, w in enumerate(active)}
    out = np.empty(self.num_experts, np.int64)
    for e, reps in enumerate(self.replicas):
      w, s = reps[0]
      if w not in pos:
        raise ValueError(f'expert {e} lives on worker {w}, which is not active {active}')
      out[e] = pos[w] * self.slots + s
    return out

  def after_release(self, released: list[int], survivors: list[int]) -> ExpertPlacement:
    """Move only the replicas that lived on released workers, each into an empty slot of the
    survivor that holds the fewest experts (ties: first in `survivors`); all others stay put."""
    gone = set(released)
    if gone & set(survivors):
      raise ValueError(f'workers {sorted(gone & set(survivors))} both released and surviving')
    table = self.slot_expert()
    load = {w: int((table[w] >= 0).sum()) for w in survivors}
    reps = [list(r) for r in self.replicas]
    homeless = [(e, i) for e, r in enumerate(reps) for i, (w, _) in enumerate(r) if w in gone]
    if sum(self.slots - load[w] for w in survivors) < len(homeless):
      raise FloorError(f'{len(survivors)} survivors x {self.slots} slots cannot hold '
                       f'{self.num_experts} experts: releasing {sorted(gone)} goes below the floor')
    for e, i in homeless:
      w = min(survivors, key=lambda v: (load[v], survivors.index(v)))
      s = int(np.flatnonzero(table[w] < 0)[0])
      table[w, s] = e
      load[w] += 1
      reps[e][i] = (int(w), s)
    return ExpertPlacement(num_workers=self.num_workers, slots=self.slots, replicas=reps)

  def moves_since(self, old: ExpertPlacement) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """(expert, (src worker, slot), (dst worker, slot)) of replicas that moved."""
    return [(e, a, b) for e in range(self.num_experts)
            for a, b in zip(old.replicas[e], self.replicas[e], strict=False) if a != b]
