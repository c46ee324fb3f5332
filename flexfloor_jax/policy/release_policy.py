"""The release policy: when to release workers, and which sequences to move so that they can go.

Chain rule. Executables are compiled ahead of time for the tails of one release chain fixed at
rollout start (chain[0] is released first), so the active set is always chain[i:]. Only the head of
the active chain can go. If another worker is idle first, the head's sequences move into free slots
(into the idle worker: a swap; or, with compaction, into any free slots) and the head goes.

Cost model. Moving work off the head pays when the device-steps it saves exceed the migration cost
in device-step equivalents: cost = steps_per_migration + steps_per_kv_byte * KV bytes. Savings are
estimated by `future_device_steps`: each worker's predicted finish (its live remaining tokens and
queue list-scheduled on B slots), released in chain order, the last `floor` kept to the end. A move
that would push the predicted completion of the rollout later is never taken. The runner should set
kv_bytes_per_token to what its migrate() reports and steps_per_kv_byte from
`kv_cost_steps_per_byte(link bandwidth, step time)`.

Work stealing. Queued (not yet prefilled) seqs carry no KV, so moving one off the worker predicted
to finish last onto a spare slot is free; it is done when it brings the predicted completion
forward.
Shared queue (`shared_queue`, the balanced schedule): every spare slot takes the longest-predicted
seq still waiting anywhere, whatever it does to the predicted finish (list scheduling, LPT order).

Time-aware floor (`cost`): device-steps say every release pays, seconds may not (an SPMD step is as
slow as the worker holding the most experts, so 8 -> 7 workers can make every step slower and cost
more device-seconds than it saves). With a step cost model a release from n to m workers happens
only when occupied device-seconds per token drop (m x t(m) over the rows m workers run, against
the same for n) and the makespan it adds, predicted remaining steps x (t(m) - t(n)), fits in what
is left of the slack budget (`makespan_slack` x the predicted makespan in seconds at full
width).

A ReleasePolicy holds per-rollout state (the chain, its decisions): use a fresh one per rollout.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from flexfloor_jax.policy.controller import Plan, Seq, State
from flexfloor_jax.policy.costs import StepCost


def kv_cost_steps_per_byte(link_bytes_per_s: float, step_seconds: float) -> float:
  """Device-step equivalents of moving one KV byte: transfer time over one step's time."""
  return 1.0 / (link_bytes_per_s * step_seconds)


def list_schedule_finish(busy: list[float], queue: list[float], slots: int) -> float:
  """Finish time of a worker: live remaining tokens `busy`, then `queue` FIFO onto free slots."""
  if len(busy) + len(queue) <= slots:  # every queued seq finds an empty slot (a tail's case)
    ends = [float(x) for x in busy] + [float(x) for x in queue]
    if slots > len(ends):
      ends.append(0.0)  # an empty slot finishes now
    return max(ends) if ends else 0.0
  h = sorted(list(busy) + [0.0] * (slots - len(busy)))
  for p in queue:
    heapq.heappush(h, heapq.heappop(h) + p)
  return max(h) if h else 0.0


def future_device_steps(finish: list[float], floor: int) -> float:
  """Device-steps from now if workers (in chain order) release at their predicted finish but never
  before the workers ahead of them in the chain, and the last `floor` stay to the end."""
  r = np.maximum.accumulate(np.asarray(finish, float)) if finish else np.zeros(0)
  if len(r) and floor > 0:
    r[-floor:] = r.max()
  return float(r.sum())


@dataclass
class ReleasePolicy:
  """When to release workers and when moving sequences makes that possible.

  predicted: seq id -> predicted length (never the actual one); a seq without one gets
  `prior_len` (default: half its max_new_tokens). A live seq past its prediction is assumed to run
  halfway to its cap.
  """
  enabled: bool = True
  floor: int = 1
  chain: list[int] | None = None  # None: the active workers' order at the first decision
  compaction: bool = True  # move into any free slots, not only into one idle worker
  swap: bool = True  # chain rule: may move the head's work into an idle worker
  predicted: Mapping[int, float] | None = None
  prior_len: float | None = None
  kv_bytes_per_token: float = 1.0  # what the engine's migrate() will report per token
  steps_per_kv_byte: float = 1.0 / 4096  # device-step equivalents per KV byte moved
  steps_per_migration: float = 1.0  # fixed cost of one migration round (sync, launch)
  steal: bool = True  # move queued seqs off the critical worker onto spare slots
  steal_steps_per_step: float = 2.0  # device-steps a steal may add per step of completion gained
  decisions: list[dict] = field(default_factory=list)  # why each evacuation happened
  # Active-group sizes a release may leave (one compiled executable set each); None = every size
  # down to the floor. A release that cannot reach an allowed size keeps the workers it would
  # have released (and their sequences: the evacuations are undone).
  sizes: tuple[int, ...] | None = None
  shared_queue: bool = False  # spare slots pull the longest waiting seq (see the module doc)
  # Step cost model (a StepCost: decode_seconds(n_active, live_seqs)); None = device-steps only.
  cost: StepCost | None = None
  makespan_slack: float = 0.05  # fraction of the predicted makespan a release may add (with cost)
  predicted_makespan_steps: float | None = None  # at full width; sets the slack budget (with cost)
  slack_used_s: float = 0.0  # seconds of makespan the releases so far are predicted to add
  # Admission: rows a worker runs at once (costs.admission_rows); None = every slot
  max_rows: int | None = None
  # Paged KV: the rows a worker's pool holds at once on the predicted lengths (pages over the
  # mean reservation); None = every slot. Bounds the rows a release's survivors are predicted to
  # run and the spare rows an evacuation may fill: a group that cannot hold its work at once runs
  # longer on fewer workers than slots say
  pool_rows: int | None = None

  def __post_init__(self):
    if self.floor < 1:
      raise ValueError(f'floor must be >= 1, got {self.floor}')
    if self.makespan_slack < 0:
      raise ValueError(f'makespan_slack must be >= 0, got {self.makespan_slack}')

  # -- estimates ------------------------------------------------------------------------------
  def _pred(self, seq: Seq) -> float:
    if self.predicted is not None and seq.seq_id in self.predicted:
      return float(self.predicted[seq.seq_id])
    return float(self.prior_len if self.prior_len is not None else seq.max_new_tokens / 2)

  def remaining(self, seq: Seq, generated: int) -> float:
    p = min(self._pred(seq), seq.max_new_tokens)
    if generated < p:
      return p - generated
    return max(1.0, (seq.max_new_tokens - generated) / 2)

  def _chain(self, st: State) -> list[int]:
    if self.chain is None:
      self.chain = list(st.active)
    chain = [w for w in self.chain if w in set(st.active)]
    if len(chain) != len(st.active) or chain != self.chain[len(self.chain) - len(chain):]:
      raise ValueError(f'active workers {st.active} are not a tail of the chain {self.chain}')
    return chain

  # -- controller hooks -----------------------------------------------------------------------
  def stop_masks(self, st: State):
    n = len(st.active)
    no = np.zeros(n, bool)
    if not self.enabled:
      return no, no
    if self.shared_queue and any(st.queues[w] for w in st.active):
      share = np.ones(n, bool)  # any freed slot may take waiting work from another worker
    else:
      share = no
    if n <= self.floor:
      return share, no
    chain = self._chain(st)
    head = chain[0]
    if self.swap or self.compaction:
      idle = np.ones(n, bool)  # any worker going idle may let the head go
    else:
      idle = np.array([w == head for w in st.active])
    fin = no
    if self.compaction:
      need = st.num_live(head)
      spare = sum(max(0, st.num_free(w) - len(st.queues[w])) for w in chain[1:])
      if need <= spare + 1:  # one more finish anywhere could make room for the head's seqs
        fin = np.ones(n, bool)
    return fin | share, idle

  def plan(self, st: State) -> Plan | None:
    if not self.enabled:
      return None
    chain = self._chain(st)
    B = self._rows(st)
    may_release = len(st.active) > self.floor and self._may_release(st, chain)
    may_steal = (self.steal or self.shared_queue) and self._may_steal(st, chain)
    if not (may_release or may_steal):
      return None
    # working copy: per worker, live [(slot, seq, remaining)] and queue [seq]
    live = {w: [(s, q, self.remaining(st.seqs[q], st.generated[q])) for s, q in st.live(w)]
            for w in chain}
    queue = {w: list(st.queues[w]) for w in chain}
    # free rows the pool can fill (a worker past its pool's rows has none)
    free = {w: st.free_slots(w)[:max(0, B - st.num_live(w))] for w in chain}
    slot_moves, queue_moves = {}, {}  # seq id -> (sw, ss, dw, ds) / (sw, dw)

    def add_queue_moves(qm):
      for sw, dw, q in qm:
        queue_moves[q] = (queue_moves[q][0] if q in queue_moves else sw, dw)

    alive = list(chain)
    cost = self.cost
    keep = self.sizes is not None or cost is not None
    snaps = {}  # active size -> working state there (sizes a release may stop at)

    def save():  # the lists change in place; their items (ints, tuples) never do
      return (list(alive), {w: list(v) for w, v in live.items()},
              {w: list(v) for w, v in queue.items()}, {w: list(v) for w, v in free.items()},
              dict(slot_moves), dict(queue_moves), len(self.decisions))

    if keep:
      snaps[len(alive)] = save()
    while may_release and len(alive) > self.floor:
      h = alive[0]
      if live[h] or queue[h]:
        if not (self.swap or self.compaction):
          break
        ev = self._evacuate(h, alive, live, queue, free, B, st)
        if ev is None:
          break
        for sw, ss, dw, ds, q in ev[0]:  # a seq moved twice in one plan moves once
          src = slot_moves.pop(q)[:2] if q in slot_moves else (sw, ss)
          slot_moves[q] = (*src, dw, ds)
        add_queue_moves(ev[1])
      alive.pop(0)
      if keep and (self.sizes is None or len(alive) in self.sizes):
        snaps[len(alive)] = save()
    if snaps:
      n = len(chain)
      if cost is not None:  # the size with the fewest device-seconds per token among those that pay
        steps = {m: self._step(snaps[m][0], snaps[m][1], snaps[m][2], st, B) for m in snaps}
        ok = [m for m in snaps if m == n or self._release_pays(n, m, steps[n], steps[m],
                                                               snaps[m][1], snaps[m][2], st, B)]
        pick = min(ok, key=lambda m: (self._seconds_per_token(m, *steps[m]), m))
      else:  # the smallest allowed size reached
        pick = min(snaps)
      alive, live, queue, free, slot_moves, queue_moves, nd = snaps[pick]
      del self.decisions[nd:]
    if self.shared_queue:
      add_queue_moves(self._share(alive, queue, free, st))
    elif self.steal:
      add_queue_moves(self._steal(alive, live, queue, free, B, st))
    queue_moves = {q: v for q, v in queue_moves.items() if v[0] != v[1]}
    if len(alive) == len(chain) and not slot_moves and not queue_moves:
      return None
    if cost is not None and len(alive) < len(chain):
      self.slack_used_s += self._added_makespan(steps[len(chain)], steps[len(alive)], live, queue,
                                                st, B)
    return Plan(moves=list(slot_moves.values()),
                queue_moves=[(sw, dw, q) for q, (sw, dw) in queue_moves.items()],
                new_active=[w for w in st.active if w in set(alive)])

  def _rows(self, st: State) -> int:
    """Rows a worker runs at once: its slots, fewer where the pool holds fewer."""
    B = st.slots_per_worker
    return max(1, min(B, self.pool_rows)) if self.pool_rows else B

  # -- time-aware floor -----------------------------------------------------------------------
  def _remaining_steps(self, live, queue, st, B) -> float:
    return max((self._finish(w, live, queue, st, B) for w in live), default=0.0)

  def _step(self, ws, live, queue, st, B) -> tuple[float, int]:
    """(seconds, rows) of the next decode step on workers `ws` holding the rows `live`, each
    reading its cached tokens (prompt and what it generated), once the free rows take the queued
    seqs, each where the fewest rows are (the shared queue spreads them so) reading its prompt.
    The actual rows and lengths, not a mean: a long tail's rows read far more than the batch's
    mean context, and a release's survivors hold the evacuated rows beside their own."""
    assert self.cost is not None
    rows = np.array([len(live[w]) for w in ws], float)
    kv = np.array([sum(st.seqs[q].prompt_len + st.generated.get(q, 0) for _, q, _ in live[w])
                   for w in ws], float)
    waiting = [q for w in ws for q in queue[w]]
    for q in waiting[:max(0, int(len(ws) * B - rows.sum()))]:
      i = int(np.argmin(rows))
      rows[i] += 1
      kv[i] += st.seqs[q].prompt_len
    return float(self.cost.worker_step_seconds(rows, kv)), int(rows.sum())

  def _added_makespan(self, before, after, live, queue, st, B) -> float:
    """Predicted makespan a release adds: its remaining steps x what it adds to a step."""
    return max(0.0, self._remaining_steps(live, queue, st, B) * (after[0] - before[0]))

  @staticmethod
  def _seconds_per_token(m: int, seconds: float, rows: int) -> float:
    """Occupied device-seconds per generated token on m workers: m x the step, per row. Per step
    would favour a group too small to run every row at once: its steps are cheaper, but each
    makes fewer tokens."""
    return m * seconds / max(rows, 1)

  def _release_pays(self, n, m, before, after, live, queue, st, B) -> bool:
    """With a cost model: going from n to m workers (their next steps `before` and `after`,
    each (seconds, rows)) lowers device-seconds per token and the makespan it adds fits in the
    slack left."""
    if self._seconds_per_token(m, *after) >= self._seconds_per_token(n, *before):
      return False
    if self.predicted_makespan_steps is None:
      return True
    assert self.cost is not None and self.chain is not None  # set before plan() weighs a release
    # the budget: a share of the predicted makespan at full width (the group's first size)
    full = len(self.chain)
    budget = self.makespan_slack * self.predicted_makespan_steps * self.cost.decode_seconds(
        full, min(before[1], full * B))
    added = self._added_makespan(before, after, live, queue, st, B)
    return self.slack_used_s + added <= budget + 1e-12

  def _share(self, alive, queue, free, st):
    """Shared queue: while a worker has a slot its own queue will not fill and another has seqs
    waiting beyond its free slots, the longest waiting seq moves to the worker with the most spare
    slots (ties: latest in the chain)."""
    moves = []
    while True:
      spare = {w: len(free[w]) - len(queue[w]) for w in alive}
      recips = [w for w in alive if spare[w] > 0]
      donors = [w for w in alive if spare[w] < 0]
      if not recips or not donors:
        return moves
      best = None
      for d in donors:
        for q in queue[d][len(free[d]):]:
          p = self._pred(st.seqs[q])
          if best is None or p > best[0]:
            best = (p, d, q)
      assert best is not None  # every donor has a seq waiting beyond its free slots
      _, d, q = best
      r = max(recips, key=lambda w: (spare[w], alive.index(w)))
      queue[d].remove(q)
      queue[r].append(q)
      moves.append((d, r, q))

  def _may_steal(self, st: State, chain: list[int]) -> bool:
    """Some worker has a slot its own queue will not fill while another has seqs waiting."""
    spare = waiting = False
    for w in chain:
      f, q = st.num_free(w), len(st.queues[w])
      spare |= f > q
      waiting |= q > f
    return spare and waiting

  def _steal(self, alive, live, queue, free, B, st):
    """Work stealing (queue moves only, no KV): the last queued seq of the worker predicted to
    finish last moves to a worker with a spare slot, while that lowers the predicted completion
    time without adding device-steps beyond `steal_steps_per_step` per step gained."""
    moves = []
    for _ in range(len(alive) * B):
      fin = {w: self._finish(w, live, queue, st, B) for w in alive}
      donors = [w for w in alive if len(queue[w]) > len(free[w])]
      recips = [w for w in alive if len(free[w]) > len(queue[w])]
      if not donors or not recips:
        break
      d = max(donors, key=lambda w: fin[w])
      q = queue[d][-1]
      p = self._pred(st.seqs[q])
      queue[d].pop()
      fin_d = self._finish(d, live, queue, st, B)
      ms0 = max(fin.values())
      ds0 = future_device_steps([fin[w] for w in alive], self.floor)
      best = None
      for r in recips:
        new = dict(fin)
        new[d], new[r] = fin_d, self._finish(r, live, queue, st, B, (), [p])
        ms = max(new.values())
        ds = future_device_steps([new[w] for w in alive], self.floor)
        gain = ms0 - ms
        if gain > 0 and ds - ds0 <= self.steal_steps_per_step * gain:
          if best is None or (ds, -gain) < best[0]:
            best = ((ds, -gain), r)
      if best is None:
        queue[d].append(q)
        break
      queue[best[1]].append(q)
      moves.append((d, best[1], q))
    return moves

  def _may_release(self, st: State, chain: list[int]) -> bool:
    """Cheap necessary condition for plan() to release anything (it runs between all dispatches)."""
    h = chain[0]
    need = st.num_live(h)
    if not need and not st.queues[h]:
      return True
    if self.compaction:
      return need <= sum(max(0, st.num_free(w) - len(st.queues[w])) for w in chain[1:])
    if self.swap:
      B = st.slots_per_worker
      return any(st.num_free(w) == B and not st.queues[w] for w in chain[1:])
    return False

  def _finish(self, w, live, queue, st, B, extra_busy=(), extra_queue=()):
    busy = [r for _, _, r in live[w]] + list(extra_busy)
    qs = [self._pred(st.seqs[q]) for q in queue[w]] + list(extra_queue)
    return list_schedule_finish(busy, qs, B)

  def _evacuate(self, h, alive, live, queue, free, B, st):
    """Moves that empty the head, if they save more than they cost; applied to the working copy."""
    others = alive[1:]
    # each worker's own live remainders and queued predictions: fixed while the head's work is
    # placed (only the extras change), so read once rather than at every candidate's finish
    base = {w: ([r for _, _, r in live[w]], [self._pred(st.seqs[q]) for q in queue[w]])
            for w in alive}

    def finish(w, extra_busy=(), extra_queue=()):
      busy, qs = base[w]
      return list_schedule_finish(busy + list(extra_busy), qs + list(extra_queue), B)

    fin = {w: finish(w) for w in alive}
    # slots a worker's own queue will fill at the next admission are not spare
    spare = {w: free[w][len(queue[w]):] for w in others}
    if not self.compaction:  # swap only: one fully idle worker takes everything
      idle = [w for w in others if len(free[w]) == B and not queue[w]]
      if not idle:
        return None
      spare = {idle[-1]: spare[idle[-1]]}
    add_busy = {w: [] for w in spare}
    add_q = {w: [] for w in spare}
    moves, kv = [], 0.0
    for s, q, r in sorted(live[h], key=lambda x: -x[2]):
      cands = [w for w in spare if spare[w]]
      if not cands:
        return None
      # least growth of the recipient's predicted finish; ties -> latest in chain (lives longest)
      def growth(w, r=r):
        return (finish(w, add_busy[w] + [r], add_q[w]) - fin[w],
                -alive.index(w))
      w = min(cands, key=growth)
      moves.append((h, s, w, spare[w].pop(0), q, r))
      add_busy[w].append(r)
      kv += (st.seqs[q].prompt_len + st.generated[q]) * self.kv_bytes_per_token
    qmoves = []
    for q in queue[h]:
      p = self._pred(st.seqs[q])
      w = min(spare, key=lambda w: (finish(w, add_busy[w], add_q[w] + [p]), -alive.index(w)))
      qmoves.append((h, w, q))
      add_q[w].append(p)
    new_fin = [finish(w, add_busy.get(w, []), add_q.get(w, [])) for w in others]
    if max(new_fin) > max(fin.values()) + 1e-9:
      return None  # never trade completion time for device-steps
    before = future_device_steps([fin[w] for w in alive], self.floor)
    after = future_device_steps(new_fin, self.floor)
    saved = before - after
    cost = (self.steps_per_migration if moves else 0.0) + self.steps_per_kv_byte * kv
    if saved <= cost:
      return None
    self.decisions.append(dict(step=st.step, head=h, moves=len(moves), queued=len(qmoves),
                               saved=saved, cost=cost))
    for _, _s, w, ds, q, r in moves:
      live[w].append((ds, q, r))
      free[w].remove(ds)
    for _, w, q in qmoves:
      queue[w].append(q)
    live[h], queue[h] = [], []
    return [(a, b, c, d, q) for a, b, c, d, q, _ in moves], qmoves
