"""Which mesh sizes to compile first, and which devices' movers each needs (numpy only).

A release can only move onto a mesh size whose executables are compiled. Compiling every size
down to the floor takes most of a cold start on a small machine, so the compiles follow the plan:
the release policy is replayed on the *predicted* lengths (the step simulator, the same policy
code that runs the rollout), and the sizes that replay reaches compile first, in the order it
reaches them; the other sizes follow, largest first. Never the actual lengths: a rollout does not
know them.

With no length history every prediction is the same prior, and a replay on equal lengths finishes
every worker together: it predicts no release at all, while the real rollout releases workers one
at a time as they go idle. Then the plan expects every size, one at a time, largest first.

Movers: a release from size a onto size b sends the experts of the released workers into empty
slots of the survivors (ExpertPlacement.after_release), so along the expected path the placement
says exactly which devices send or receive an expert; a migration (compaction) moves sequences
between the workers of the mesh it runs on. Those devices get their single-device movers compiled
right after size b's executables; a move the plan did not foresee takes the SPMD path instead.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from flexfloor_jax.policy import stepsim
from flexfloor_jax.policy.expert_placement import ExpertPlacement


@dataclass
class CompilePlan:
  order: list[int]  # smaller mesh sizes, in the order to compile them
  expected: list[int]  # the sizes the plan expects to reach, largest first
  predicted_releases: list[tuple[int, int]]  # (step, size) of the replay; [] without history
  # size -> (workers whose expert slots the release onto it moves, workers a migration moves
  # sequences between before it)
  movers: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
  source: str = "replay"  # 'replay' (predicted lengths) | 'no_history' (every size expected)

  def to_json(self) -> dict:
    return dict(order=self.order, expected=self.expected, source=self.source,
                predicted_releases=[list(x) for x in self.predicted_releases])


def plan_compiles(seqs, queues, policy, predicted: dict, *, num_workers: int,
                  slots_per_worker: int, steps_per_dispatch: int, candidates,
                  placement: ExpertPlacement, chain: list[int],
                  has_history: bool) -> CompilePlan:
  """`candidates`: the smaller sizes a release may leave; `policy`: the rollout's release policy
  (replayed on a copy); `predicted`: seq id -> predicted length; `placement`: the initial expert
  placement over `chain` (release order: chain[0] goes first)."""
  n = num_workers
  cands = sorted({int(m) for m in candidates if m < n}, reverse=True)
  releases, migrations = [], []
  if has_history and cands:
    lengths = {s.seq_id: max(1, min(int(round(predicted[s.seq_id])), s.max_new_tokens))
               for s in seqs}
    _, rec = stepsim.simulate(seqs, lengths, queues, copy.deepcopy(policy), n, slots_per_worker,
                              steps_per_dispatch, return_record=True)
    size = n
    for r in rec.timeline.releases:
      if not r.get("final"):
        size -= len(r["workers"])
        releases.append((int(r["step"]), size))
    migrations = rec.timeline.migrations
  if has_history:
    expected = [m for _, m in releases if m in cands]
    source = "replay"
  else:
    expected = list(cands)
    source = "no_history"
  order = expected + [m for m in cands if m not in expected]

  movers: dict[int, tuple[set, set]] = {}
  at = n  # walk the expected path, the placement along with it
  cur = placement
  for m in expected:
    gone, keep = chain[n - at:n - m], chain[n - m:]
    new = cur.after_release(list(gone), list(keep))
    slot = {w for _, a, b in new.moves_since(cur) for w in (a[0], b[0])}
    if has_history:  # the replay's migrations on the mesh of size `at`, before this release
      row = set()
      for mg in migrations:
        if _size_at(releases, n, mg["step"]) == at:
          row |= {w for mv in mg["moves"] for w in (mv[0], mv[2])}
    else:  # compaction may move the head's sequences into any survivor
      row = set(chain[n - at:])
    movers[m] = (slot, row)
    cur, at = new, m
  seen_slot, seen_row = set(), set()
  out = {}
  for m in expected:  # each device's movers once, with the first size that needs them
    slot, row = movers[m]
    out[m] = (sorted(slot - seen_slot), sorted(row - seen_row))
    seen_slot |= slot
    seen_row |= row
  return CompilePlan(order=order, expected=expected, predicted_releases=releases, movers=out,
                     source=source)


def _size_at(releases, n: int, step: int) -> int:
  """Active-group size of the replay at `step` (a migration comes right before its release)."""
  size = n
  for s, m in releases:
    if s < step:
      size = m
  return size
