"""Page accounting of the paged KV pool (numpy only): every worker's pool of fixed-size pages, the
page table of each sequence row, admission by memory, growth before a decode dispatch, preemption
of the youngest sequence when a worker's pool runs out; and the pool's size from a memory budget.

Each worker (one device) has `num_pages` pages of `page_size` tokens, page ids 0..num_pages-1 local
to that worker, and `max_seqs` sequence rows (the compile-time maximum of concurrent sequences: the
engine's decode batch). A row's page table is an int32 row of `max_pages_per_seq` entries padded
with `num_pages`, an out-of-range id, so that a device scatter through the padding drops the write.
Free pages are handed out lowest id first, so the same calls give the same page ids.

Admission (`admits`): a sequence starts on a worker while the worker has fewer than `max_seqs` live
rows and its reservation fits beside the reservations of the rows already there. A reservation is
max(pages the row owns, pages of prompt + predicted response x (1 + margin), capped at prompt +
max_new_tokens); without a prediction, the cap. A worker with no live row admits any sequence
whose cap fits the pool (progress is always possible).

Growth (`grow`): before each decode dispatch every live row must own pages for its next `steps`
tokens (capped at its limit). Where a worker's free pages do not cover the growth, its youngest
row (the most recently admitted or migrated in) is preempted: its pages go back, and the caller
queues the sequence at the front of its worker's queue, to be recomputed by a prefill later.

Chunked prefill (policy.controller's module doc): an admitted sequence whose input has not all
run yet (pending) owns a row like a live one. Admission allocates it pages for input + 1 tokens
(its input: the prompt, and a resumed sequence's kept tokens), as a one-shot prefill does; the
controller passes `grow` the tokens it kept as its generated count (0 for a fresh one), so it
holds pages for its whole input + the dispatch's steps (it may turn live in the dispatch's
first step and make a token in each), and it is preempted by the same rule, youngest first: a
pending row was admitted last, so it usually goes first, and loses only its partial input.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

import numpy as np


class PagePoolError(RuntimeError):
  pass


def pages_for(tokens: int, page_size: int) -> int:
  """Pages that hold `tokens` tokens: ceil(tokens / page_size) (0 for 0)."""
  if page_size < 1 or tokens < 0:
    raise ValueError(f'pages_for({tokens}, {page_size}): tokens >= 0 and page_size >= 1')
  return -(-int(tokens) // int(page_size))


def pool_pages(device_memory_bytes: int, weight_bytes: int, workspace_bytes: int,
               kv_bytes_per_token: int, page_size: int) -> int:
  """Pages of one worker's pool from its memory budget: what the device holds beside its weights
  (non-expert + its expert slots: memory.FloorTerms.resident without KV) and the release
  workspace, in whole pages of `page_size` tokens x `kv_bytes_per_token` (all layers, K and V)."""
  left = int(device_memory_bytes) - int(weight_bytes) - int(workspace_bytes)
  return max(0, left // (int(page_size) * int(kv_bytes_per_token)))


def equal_budget_pages(slots_per_worker: int, max_seq_len: int, page_size: int) -> int:
  """Pages of a pool with the KV bytes of the fixed-slot cache (slots_per_worker rows of
  max_seq_len tokens), rounded down: slots_per_worker * max_seq_len // page_size."""
  return int(slots_per_worker) * int(max_seq_len) // int(page_size)


def kv_budget_bytes(num_pages: int, page_size: int, kv_bytes_per_token: int) -> int:
  """KV bytes of a pool of `num_pages` pages (the inverse of pool_pages' division)."""
  return int(num_pages) * int(page_size) * int(kv_bytes_per_token)


def makespan_lower_bound(seqs, lengths: Mapping[int, int], num_workers: int, num_pages: int,
                         page_size: int, max_seqs: int) -> dict:
  """Steps no schedule of `seqs` (prompt_len, max_new_tokens, seq_id) with response `lengths` can
  beat on `num_workers` pools of `num_pages` pages of `page_size` tokens and `max_seqs` rows each
  (a release only removes capacity). A step is one prefill round (at most one new sequence per
  worker) or one decode step; a sequence makes one token per step it takes part in. Terms:
    longest: L_max + ceil(S/N) - 1: the longest response makes one token per step, and of the
      >= ceil(S/N) prefill rounds (S sequences, one per worker per round) all but its own make
      none of its tokens (assumes it is not preempted: a recompute prefill makes a token);
    rows: R + ceil((sum L - N R) / (N max_seqs)) with R = ceil(S/N) prefill rounds (<= N tokens
      each) and decode steps of <= N max_seqs tokens;
    pages: ceil(page_steps / (N num_pages)), page_steps = sum over sequences of
      sum_{t=1..L} pages_for(prompt + t): while a step makes its t-th token a sequence holds
      pages for at least prompt + t tokens (the pool allocates prompt + 1 at prefill and grows
      to prompt + generated + the dispatch's steps before a decode), and a step holds at most
      N num_pages pages. kv_token_steps: the same sum in tokens, sum of (prompt + t).
  bound: the largest term."""
  N, S = int(num_workers), len(seqs)
  L = {s.seq_id: int(min(max(int(lengths[s.seq_id]), 1), s.max_new_tokens)) for s in seqs}
  R = -(-S // N)
  total = sum(L.values())
  longest = max(L.values()) + R - 1 if S else 0
  rows = R + -(-max(0, total - N * R) // (N * int(max_seqs))) if S else 0
  page_steps = tok_steps = 0
  for s in seqs:
    t = np.arange(1, L[s.seq_id] + 1, dtype=np.int64) + int(s.prompt_len)
    page_steps += int((-(-t // int(page_size))).sum())
    tok_steps += int(t.sum())
  pages = -(-page_steps // (N * int(num_pages)))
  return dict(longest=int(longest), rows=int(rows), pages=int(pages), page_steps=page_steps,
              kv_token_steps=tok_steps, bound=int(max(longest, rows, pages)))


class PagePool:
  """The pools of `num_workers` workers. Rows are addressed (worker, slot), slot < max_seqs.

  predicted: seq id -> predicted response length (for admission); margin: the safety margin on
  it (0.25 = reserve 25% more than predicted). max_pages_per_seq: the page table's width (default:
  every page of the pool). page_ids=False (the simulator): pages are counted, not named, and
  there are no page tables (a pool of tens of thousands of pages, sequences of a thousand
  pages each, would spend its time handing out ids nobody reads); admission, growth, preemption
  and moves decide the same."""

  def __init__(self, num_workers: int, num_pages: int, page_size: int, max_seqs: int,
               max_pages_per_seq: int | None = None, *,
               predicted: Mapping[int, float] | None = None, margin: float = 0.25,
               page_ids: bool = True):
    if min(num_workers, num_pages, page_size, max_seqs) < 1 or margin < 0:
      raise ValueError(f'PagePool({num_workers}, {num_pages}, {page_size}, {max_seqs}, '
                       f'margin={margin}): sizes must be >= 1, margin >= 0')
    self.num_workers, self.num_pages = int(num_workers), int(num_pages)
    self.page_size, self.max_seqs = int(page_size), int(max_seqs)
    self.max_pages_per_seq = int(max_pages_per_seq or num_pages)
    self.predicted = dict(predicted or {})
    self.margin = float(margin)
    N, S, P = self.num_workers, self.max_seqs, self.max_pages_per_seq
    # free pages of a worker: the pages given back (a min-heap) and every id from _fresh[w] up,
    # never handed out; those given back are all below _fresh[w], so the lowest free id is the
    # heap's top or _fresh[w] (a pool of tens of thousands of pages is not listed page by page)
    self._returned: list[list[int]] = [[] for _ in range(N)]
    self._fresh = [0] * N
    self.page_ids = bool(page_ids)
    self._used = [0] * N  # page_ids=False: pages in use per worker
    self._tables = np.full((N, S, P) if page_ids else (N, S, 0), self.num_pages, np.int32)
    self._owned = np.zeros((N, S), np.int64)  # pages per row
    self._seq = np.full((N, S), -1, np.int64)  # seq id per row, -1 = free row
    self._limit = np.zeros((N, S), np.int64)  # prompt + max_new_tokens per row
    self._reserve = np.zeros((N, S), np.int64)  # predicted pages (margin, cap) per row
    self._prompt = np.zeros((N, S), np.int64)
    self._age = np.zeros((N, S), np.int64)  # admission tick: larger = younger
    self._tick = 0
    self.peak_used = [0] * N
    self.preemptions: list[dict] = []  # {'worker', 'slot', 'seq_id', 'pages'}
    self.allocated = 0  # pages handed out, over the pool's life
    self.freed = 0  # pages given back

  # ---- reading ------------------------------------------------------------------------------

  def free_pages(self, w: int) -> int:
    if not self.page_ids:
      return self.num_pages - self._used[w]
    return len(self._returned[w]) + self.num_pages - self._fresh[w]

  def used_pages(self, w: int) -> int:
    return self.num_pages - self.free_pages(w)

  def seq_at(self, w: int, slot: int) -> int:
    return int(self._seq[w, slot])

  def owned(self, w: int, slot: int) -> int:
    return int(self._owned[w, slot])

  def live_rows(self, w: int) -> list[int]:
    return [int(s) for s in np.flatnonzero(self._seq[w] >= 0)]

  def table(self, w: int) -> np.ndarray:
    """[max_seqs, max_pages_per_seq] int32 page ids of worker w's rows (padding: num_pages)."""
    return self._tables[w].copy()

  def tables(self) -> np.ndarray:
    """[num_workers, max_seqs, max_pages_per_seq] int32: every worker's page tables."""
    return self._tables.copy()

  def stats(self) -> dict:
    return dict(num_pages=self.num_pages, page_size=self.page_size, max_seqs=self.max_seqs,
                peak_pages=max(self.peak_used), peak_pages_per_worker=list(self.peak_used),
                preemptions=len(self.preemptions), pages_allocated=self.allocated,
                pages_freed=self.freed)

  def check(self) -> None:
    """Conservation on every worker: each page free or owned by exactly one row, never both
    (page_ids=False: the rows own what the worker counts as used, no more than its pages)."""
    for w in range(self.num_workers):
      if not self.page_ids:
        if int(self._owned[w].sum()) != self._used[w] or self._used[w] > self.num_pages:
          raise PagePoolError(f'worker {w}: rows own {int(self._owned[w].sum())} pages, '
                              f'{self._used[w]} counted used of {self.num_pages}')
        continue
      owned = [int(p) for s in range(self.max_seqs) for p in self._tables[w, s, :self._owned[w, s]]]
      pad = (self._tables[w] != self.num_pages).sum()
      free = self._returned[w] + list(range(self._fresh[w], self.num_pages))
      every = owned + free
      if sorted(every) != list(range(self.num_pages)) or pad != len(owned):
        raise PagePoolError(f'worker {w}: pages owned {sorted(owned)}, free '
                            f'{sorted(free)} do not partition 0..{self.num_pages - 1}')

  # ---- admission ----------------------------------------------------------------------------

  def reservation(self, seq, generated: int = 0, steps: int = 1) -> int:
    """Pages a sequence (prompt_len, max_new_tokens, seq_id) reserves when it starts with
    `generated` tokens already made (a preempted one) and decodes `steps` tokens per dispatch."""
    limit = seq.prompt_len + seq.max_new_tokens
    now = min(seq.prompt_len + generated + 1 + steps, limit)
    p = self.predicted.get(seq.seq_id)
    want = seq.max_new_tokens if p is None else min(seq.max_new_tokens,
                                                    math.ceil(float(p) * (1.0 + self.margin)))
    return pages_for(max(now, seq.prompt_len + want), self.page_size)

  def _reserved(self, w: int) -> int:
    return int(np.maximum(self._owned[w], self._reserve[w]).sum())

  def admits(self, w: int, seq, generated: int = 0, steps: int = 1) -> bool:
    """May `seq` start on worker w now (see the module doc)?"""
    live = int((self._seq[w] >= 0).sum())
    if live >= self.max_seqs:
      return False
    if live == 0:
      cap = pages_for(seq.prompt_len + seq.max_new_tokens, self.page_size)
      if cap > min(self.num_pages, self.max_pages_per_seq):
        raise PagePoolError(f'seq {seq.seq_id} needs up to {cap} pages, more than a pool of '
                            f'{self.num_pages} ({self.max_pages_per_seq} per sequence) holds')
      return True
    return self._reserved(w) + self.reservation(seq, generated, steps) <= self.num_pages

  # ---- allocation ---------------------------------------------------------------------------

  def _take(self, w: int, slot: int, n: int) -> None:
    if n > self.free_pages(w) or self._owned[w, slot] + n > self.max_pages_per_seq:
      raise PagePoolError(f'worker {w} row {slot}: {n} more pages, {self.free_pages(w)} free, '
                          f'{self._owned[w, slot]} owned of {self.max_pages_per_seq}')
    k = int(self._owned[w, slot])
    for j in range(n if self.page_ids else 0):
      if self._returned[w]:
        self._tables[w, slot, k + j] = heapq.heappop(self._returned[w])
      else:
        self._tables[w, slot, k + j] = self._fresh[w]
        self._fresh[w] += 1
    self._owned[w, slot] = k + n
    self._used[w] += n
    self.allocated += n
    self.peak_used[w] = max(self.peak_used[w], self.used_pages(w))

  def allocate(self, w: int, slot: int, seq, tokens: int) -> np.ndarray:
    """Row `slot` of worker w takes `seq` with pages for `tokens` tokens (its prompt and what it
    has generated); returns its page table row. Raises PagePoolError if they are not free."""
    if self._seq[w, slot] >= 0:
      raise PagePoolError(f'worker {w} row {slot} holds seq {self._seq[w, slot]}')
    self._take(w, slot, pages_for(tokens, self.page_size))
    self._seq[w, slot] = seq.seq_id
    self._prompt[w, slot] = seq.prompt_len
    self._limit[w, slot] = seq.prompt_len + seq.max_new_tokens
    self._reserve[w, slot] = self.reservation(seq, 0, 0)
    self._tick += 1
    self._age[w, slot] = self._tick
    return self._tables[w, slot].copy()

  def free(self, w: int, slot: int) -> int:
    """Row `slot` of worker w gives its pages back (a finish); returns how many."""
    n = int(self._owned[w, slot])
    for p in self._tables[w, slot, :n]:
      heapq.heappush(self._returned[w], int(p))
    self._used[w] -= n
    self._tables[w, slot] = self.num_pages
    self._owned[w, slot] = 0
    self._seq[w, slot] = -1
    self._reserve[w, slot] = 0
    self.freed += n
    return n

  def grow(self, generated: Mapping[tuple[int, int], int],
           steps: int) -> list[tuple[int, int, int]]:
    """Before a decode dispatch of `steps` steps: every live row (worker, slot) -> tokens it has
    generated so far must own pages for prompt + generated + steps tokens (at most its limit);
    a chunked prefill's pending row counts the tokens it kept (module doc).
    Where a worker's free pages fall short, its youngest rows are preempted (pages freed) until
    the rest fit; returns the preempted (worker, slot, seq id), youngest first. The survivors
    grow oldest first."""
    if not self.page_ids and self._grow_counted(generated, steps):
      return []
    out = []
    for w in range(self.num_workers):
      rows = [s for s in self.live_rows(w)]
      if not rows:
        continue
      missing = [s for s in rows if (w, s) not in generated]
      if missing:
        raise PagePoolError(f'worker {w}: rows {missing} are live but have no generated count')
      need = {s: max(0, pages_for(min(self._prompt[w, s] + generated[w, s] + steps,
                                       self._limit[w, s]), self.page_size) - self._owned[w, s])
              for s in rows}
      rows.sort(key=lambda s: self._age[w, s])  # oldest first
      while sum(need[s] for s in rows) > self.free_pages(w):
        if len(rows) == 1:
          raise PagePoolError(f'worker {w}: seq {self._seq[w, rows[0]]} alone needs '
                              f'{need[rows[0]]} more pages, {self.free_pages(w)} free')
        s = rows.pop()
        q = int(self._seq[w, s])
        self.preemptions.append(dict(worker=w, slot=s, seq_id=q, pages=int(self._owned[w, s])))
        self.free(w, s)
        out.append((w, s, q))
      for s in rows:
        if need[s]:  # most steps a row's last page still has room
          self._take(w, s, int(need[s]))
    return out

  def _grow_counted(self, generated: Mapping[tuple[int, int], int], steps: int) -> bool:
    """grow() on a counted pool (page_ids=False) when every worker's rows fit: all rows at once
    in numpy (the simulator calls grow before every dispatch of every run). False, changing
    nothing, where some worker falls short: grow() then preempts row by row."""
    live = self._seq >= 0
    gen = np.full(live.shape, -1, np.int64)
    for (w, s), g in generated.items():
      gen[w, s] = g
    if (live & (gen < 0)).any():
      return False  # grow() names the rows without a count
    tokens = np.minimum(self._prompt + gen + steps, self._limit)
    need = np.where(live, np.maximum(0, -(-tokens // self.page_size) - self._owned), 0)
    per_w = need.sum(1)
    used = np.asarray(self._used, np.int64)
    if (per_w > self.num_pages - used).any() or (self._owned + need > self.max_pages_per_seq).any():
      return False
    self._owned += need
    self._used = [int(u) for u in used + per_w]
    self.allocated += int(per_w.sum())
    self.peak_used = [max(p, u) for p, u in zip(self.peak_used, self._used, strict=True)]
    return True

  def move(self, moves: list[tuple[int, int, int, int]]) -> list[bool]:
    """Migrations (src_worker, src_slot, dst_worker, dst_slot): every source gives its pages back
    first, then each destination row takes as many pages as its source owned, in the order given
    (it becomes its worker's youngest row). A destination without enough free pages takes
    nothing: that entry is False and the caller preempts the sequence instead."""
    src = []
    for sw, ss, _, _ in moves:
      if self._seq[sw, ss] < 0:
        raise PagePoolError(f'move from free row {(sw, ss)}')
      src.append((int(self._seq[sw, ss]), int(self._owned[sw, ss]), int(self._prompt[sw, ss]),
                  int(self._limit[sw, ss]), int(self._reserve[sw, ss])))
    for sw, ss, _, _ in moves:
      self.free(sw, ss)
    ok = []
    for (_, _, dw, ds), (q, n, prompt, limit, reserve) in zip(moves, src, strict=True):
      if self._seq[dw, ds] >= 0 or n > self.free_pages(dw):
        ok.append(False)
        continue
      self._take(dw, ds, n)
      self._seq[dw, ds], self._prompt[dw, ds] = q, prompt
      self._limit[dw, ds], self._reserve[dw, ds] = limit, reserve
      self._tick += 1
      self._age[dw, ds] = self._tick
      ok.append(True)
    return ok
