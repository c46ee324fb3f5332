"""The Engine: prefill / insert / decode on the active workers and read the results back; a
thin executor over the typed decode state (state.py) and the compiled steps (step_set.py).

Every worker owns B decode slots with a fixed-length KV cache. One compiled prefill step fills at
most one decode slot per worker; one compiled decode dispatch runs up to `max_steps` decode steps
on all active workers inside a `lax.while_loop`, stopping early when the caller asked to hear
about a finish. The engine knows how to change its mesh (elastic.release / elastic.migrate do
it), never why; finish reasons and the stop rule come from policy/controller.py.

Paged KV (spec.kv == 'paged'): the decode slots are the pool's max_seqs sequence rows, and the KV
lives in each worker's pool of pages. The page tables are the host pool's (`attach_pages`, a
policy.pages.PagePool that the controller drives): they go with every prefill and decode, and a
migration moves only the pages the pool says. `preempt` drops rows and keeps (on the host) the
tokens and log-probs they had made; a later prefill of such a sequence recomputes the KV of its
prompt + those tokens (a prefill `spec.resume_width` wide, compiled at the first preemption) and
continues; its output is the kept tokens + the new ones.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flexfloor_jax.engine import elastic
from flexfloor_jax.engine import state as state_lib
from flexfloor_jax.engine.spec import EngineSpec, SeqInput, SeqOutput, slot_layout, split_params
from flexfloor_jax.engine.step_set import StepCache, StepSet
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.policy.controller import Finish, dispatch_stops, finish_reason
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.pages import PagePool
from flexfloor_jax.runtime import distributed
from flexfloor_jax.runtime import mesh as mesh_lib


class Engine:
  """Executes prefill / decode / migrate / shrink on the active workers. Worker ids are indices
  into `devices`; the active workers are always a tail of `chain` (release order)."""

  def __init__(self, spec: EngineSpec, params: tfm.Params, devices: Sequence[mesh_lib.Device],
               chain: Sequence[int], placement: ExpertPlacement, *, seed: int = 0,
               epoch: int = 0, step_cache: StepCache | None = None,
               prefetch_sizes: Sequence[int] = (), compile_threads: int = 0,
               mover_plan: dict | None = None):
    """`prefetch_sizes`: the smaller meshes to compile, in the order they should be ready;
    `mover_plan`: StepCache.plan_movers's argument (None: movers for every device)."""
    self.spec, self.seed, self.epoch = spec, int(seed), int(epoch)
    self.devices, self.chain = list(devices), list(chain)
    rest, experts = split_params(params)
    rest_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rest)
    exp_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), experts)
    self.steps = step_cache or StepCache(spec, devices, chain, rest_abs, exp_abs,
                                         compile_threads=compile_threads)
    n = len(self.chain)
    self.active = list(self.chain)
    if mover_plan is not None:
      self.steps.plan_movers(mover_plan)
    self.steps.prefetch([n, *[m for m in prefetch_sizes if m != n]])
    ss = self.steps.get(n)
    self.rest = jax.device_put(rest, ss.rest_sharding)
    # The replicated weights never change: their views over every smaller mesh (the same
    # buffers) are made now, not when a release waits for them.
    self._rest_views = {m: jax.tree.map(
        lambda a, m=m: elastic.reassemble(a, mesh_lib.replicated(self.steps.mesh_for(m)),
                                          a.shape),
        self.rest) for m in range(1, n)}
    self.experts = slot_layout(experts, placement.slot_expert()[self.active],
                               ss.expert_sharding["w1"])
    self.set_placement(placement)
    self.state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                              ss.abstract_state)
    self.seqs: dict[int, SeqInput] = {}
    self.outputs: dict[int, SeqOutput] = {}
    self._seq_in_slot: dict[tuple[int, int], int] = {}  # (worker, decode slot) -> live seq id
    self.expert_counts = np.zeros((spec.cfg.num_experts,), np.int64)
    self.compiles_after_start = 0
    self._pending_release_t0: float | None = None
    self._migrate_t0: float | None = None  # a plan's migration: its release decision time
    self.release_latencies: list[float] = []
    self.release_sizes: list[int] = []  # active workers on the mesh each latency was timed on
    self.pages: PagePool | None = None  # paged KV: the host's page pool (attach_pages)
    self._tables: np.ndarray | None = None  # page tables the device last got [W, B, M]
    self._kept: dict[int, tuple[list, list]] = {}  # preempted seq -> (tokens, logprobs) so far
    self.preemptions = 0
    # chunked prefill (spec.chunked): input tokens a step takes per worker (at most
    # spec.prefill_rows; the controller's prefill_chunk), and each worker's admitted sequences
    # whose input is not all in yet, in the order the steps take it: [slot, seq id, input tokens,
    # tokens taken, tokens it had made before (a resumed sequence)]
    self.prefill_chunk = spec.prefill_rows
    self._pending: dict[int, list[list]] = {}
    # speculative decoding (spec.draft_tokens): the most drafted tokens a slot verifies in a
    # dispatch; after each dispatch, per sequence live at its start, (tokens made, drafted rows
    # verified, drafted tokens kept) (policy.controller's DraftingExecutor)
    self.draft_tokens = spec.draft_tokens
    self.dispatch_report: dict[int, tuple[int, int, int]] = {}
    self._generated: dict[int, int] = {}  # seq id -> tokens made, as the last read saw it
    self._drafts_seen: dict[int, tuple[int, int]] = {}  # seq id -> the last call's (drafted, kept)

  # -- setup
  @property
  def stepset(self) -> StepSet:
    return self.steps.get(len(self.active))

  def set_placement(self, placement: ExpertPlacement):
    self.placement = placement
    self.e2s = placement.expert_to_slot(self.active).astype(np.int32)  # sent with each step

  def attach_pages(self, pool):
    """Paged KV: the page pool (policy.pages.PagePool) whose tables the steps use."""
    spec = self.spec
    if not spec.paged:
      raise ValueError("attach_pages needs an engine with spec.kv == 'paged'")
    want = (spec.slots_per_worker, spec.num_pages, spec.page_size, spec.pages_per_seq)
    got = (pool.max_seqs, pool.num_pages, pool.page_size, pool.max_pages_per_seq)
    if got != want or pool.num_workers < len(self.devices):
      raise ValueError(f"page pool (max_seqs, num_pages, page_size, max_pages_per_seq) {got} "
                       f"for {pool.num_workers} workers; the engine needs {want} for "
                       f"{len(self.devices)}")
    self.pages = pool
    self._tables = pool.tables()

  def _page_tables(self) -> np.ndarray:
    if self.pages is None:
      raise RuntimeError("paged KV: attach_pages(pool) before the first step")
    tables = self._tables = self.pages.tables()
    return tables

  def add_sequences(self, seqs: dict[int, SeqInput]):
    lp = self.spec.max_prompt_len
    for sid, s in seqs.items():
      if len(s.tokens) > lp:
        raise ValueError(f"sequence {sid}: prompt of {len(s.tokens)} tokens exceeds "
                         f"max_prompt_len={lp}")
      if len(s.tokens) + s.limit > self.spec.max_seq_len:
        raise ValueError(f"sequence {sid}: prompt {len(s.tokens)} + {s.limit} new tokens "
                         f"exceeds model.max_seq_len={self.spec.max_seq_len}")
    self.seqs.update(seqs)

  def active_workers(self) -> list[int]:
    return list(self.active)

  def _pos(self, worker: int) -> int:
    return self.active.index(worker)

  def _read(self, *arrays) -> list:
    """Host values of device arrays, the same on every process (multi-controller: gathered,
    and passed through the key-value store to processes whose workers were all released)."""
    return distributed.host_values(arrays)

  # -- steps
  def prefill(self, assign: Sequence[tuple[int, int, int]]) -> list[Finish]:
    """Insert sequences (worker, decode slot, seq id), at most one per worker: one prefill step
    that also samples each one's first token."""
    if self.spec.chunked:
      raise ValueError("chunked prefill (spec.prefill_rows > 0): sequences come in by admit")
    self._migrate_t0 = None  # a migration without a release
    workers = [w for w, _, _ in assign]
    if len(set(workers)) != len(workers):
      raise ValueError(f"two prefills for one worker in one step: {list(assign)}")
    fresh = [a for a in assign if a[2] not in self._kept]
    resumed = [a for a in assign if a[2] in self._kept]
    tables = self._page_tables() if self.spec.paged else None
    for w, s, sid in assign:
      self._seq_in_slot[(w, s)] = sid
    ss = self.stepset
    # fresh prompts take the usual prefill; resumed sequences (paged KV) a wider one apart, so
    # a fresh prompt's prefill never depends on a preemption beside it
    for group, width, step in ((fresh, self.spec.max_prompt_len, "prefill"),
                               (resumed, self.spec.resume_width, "prefill_resume")):
      if not group:
        continue
      rows = []
      for w, s, sid in group:
        q, kept = self.seqs[sid], self._kept.get(sid, ([], []))[0]
        if kept:
          q = dataclasses.replace(q, tokens=np.concatenate([q.tokens, np.asarray(kept,
                                                                                 np.int32)]))
        rows.append((self._pos(w), s, q, len(kept), None if tables is None else tables[w, s]))
      host = state_lib.prefill_host(width, len(self.active), self.seed, self.epoch, rows,
                                    self.spec.pages_per_seq, self.spec.sampling.temperature)
      fn = ss.resume_prefill() if step == "prefill_resume" else ss["prefill"]
      self.state, counts = fn(self.rest, self.experts, self.state, ss.put_host(host, self.e2s))
      self.expert_counts += self._read(counts)[0]
    if self._pending_release_t0 is not None:  # a prefill is the first output on the new mesh
      self._first_output_on_new_mesh(self.state)
    return self._read_finishes()

  def admit(self, assign: Sequence[tuple[int, int, int]]):
    """Chunked prefill: sequences (worker, decode slot, seq id) into free slots, any number per
    worker. Nothing runs: each one's input (its prompt; a resumed sequence's prompt + the tokens
    it had made) joins the end of its worker's queue, which the next decode steps take
    `prefill_chunk` tokens at a time (policy.controller's contract)."""
    if not self.spec.chunked:
      raise ValueError("admit needs an engine with chunked prefill (spec.prefill_rows > 0)")
    self._migrate_t0 = None
    for w, s, sid in assign:
      if (w, s) in self._seq_in_slot:
        raise ValueError(f"admission of seq {sid} into busy slot {(w, s)}")
      kept = self._kept.get(sid, ([], []))[0]
      toks = np.concatenate([self.seqs[sid].tokens, np.asarray(kept, np.int32)]).astype(np.int32)
      self._pending.setdefault(w, []).append([s, sid, toks, 0, len(kept)])
      self._seq_in_slot[(w, s)] = sid

  def _queue(self, max_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Each active worker's queue for a dispatch: its pending input tokens in order, up to
    spec.prefill_queue ([n, prefill_queue, len(QUEUE_COLS)], entries per worker)."""
    qlen, c = self.spec.prefill_queue, self.prefill_chunk
    col = {name: i for i, name in enumerate(state_lib.QUEUE_COLS)}
    queue = np.zeros((len(self.active), qlen, len(col)), np.int32)
    queued = np.zeros((len(self.active),), np.int32)
    for p, w in enumerate(self.active):
      k = 0
      for s, sid, toks, done, gen in self._pending.get(w, []):
        take = min(len(toks) - done, qlen - k)
        q, rows = self.seqs[sid], slice(k, k + take)
        pos = np.arange(done, done + take)
        for name, val in (("token", toks[done:done + take]), ("slot", s), ("position", pos),
                          ("last", pos == len(toks) - 1), ("limit", q.limit),
                          ("stop_eos", q.stop_eos), ("phash", q.phash), ("sample", q.sample),
                          ("generated", gen)):
          queue[p, rows, col[name]] = val
        k += take
        if k == qlen:
          if max_steps * c > qlen:
            raise ValueError(f"a dispatch of {max_steps} steps of {c} input tokens needs a queue "
                             f"of {max_steps * c} entries; spec.prefill_queue is {qlen}")
          break
      queued[p] = k
    return queue, queued

  def _take(self, steps: int):
    """The input the dispatch's `steps` steps took: `prefill_chunk` tokens a step per worker,
    in queue order; a sequence whose input is all in leaves the queue (its slot is live, or it
    has finished)."""
    for w in list(self._pending):
      budget = steps * self.prefill_chunk
      rest = []
      for ent in self._pending[w]:
        take = min(len(ent[2]) - ent[3], budget)
        ent[3] += take
        budget -= take
        if ent[3] < len(ent[2]):
          rest.append(ent)
      self._pending[w] = rest

  def _pending_slots(self) -> set[tuple[int, int]]:
    return {(w, ent[0]) for w, lst in self._pending.items() for ent in lst}

  def _slot_of(self) -> dict[int, tuple[int, int]]:
    """Occupied seq id -> its (worker, decode slot): _seq_in_slot inverted."""
    return {sid: ws for ws, sid in self._seq_in_slot.items()}

  def responses(self, seq_ids: Sequence[int]) -> dict[int, np.ndarray]:
    """The response tokens each of these live sequences has made so far (speculative decoding's
    drafts continue them): one read of the outputs."""
    scalars, toks = self._read(self.state.scalars, self.state.out_tokens)
    b, n_col = self.spec.slots_per_worker, state_lib.SCALAR_COLS.index("n_gen")
    where = self._slot_of()
    out = {}
    for sid in seq_ids:
      w, s = where[sid]
      row = self._pos(w) * b + s
      k = int(scalars[row, n_col])
      kept = self._kept.get(sid, ([], []))[0]  # a resumed sequence's tokens from before
      out[sid] = np.asarray(list(kept) + toks[row, len(kept):k].tolist(), np.int32)
    return out

  def _draft_array(self, drafts: dict[int, np.ndarray]) -> np.ndarray:
    """[active workers, B, 1 + D] the drafts by slot: length, then tokens."""
    d_n, b = self.spec.draft_tokens, self.spec.slots_per_worker
    out = np.zeros((len(self.active), b, 1 + d_n), np.int32)
    where = self._slot_of()
    for sid, d in drafts.items():
      d = np.asarray(d, np.int32).reshape(-1)
      if len(d) > d_n:
        raise ValueError(f"a draft of {len(d)} tokens for seq {sid}; draft_tokens is {d_n}")
      if sid not in where:
        raise ValueError(f"a draft for seq {sid}, which is not live")
      w, s = where[sid]
      out[self._pos(w), s, 0] = len(d)
      out[self._pos(w), s, 1:1 + len(d)] = d
    return out

  def decode(self, max_steps: int, stop_on_refill, stop_on_idle,
             drafts: dict[int, np.ndarray] | None = None) -> tuple[int, list[Finish]]:
    """Up to `max_steps` decode steps on all active workers (stop masks by worker position);
    chunked prefill: each step also takes its workers' next input tokens; speculative decoding
    (spec.draft_tokens > 0): `drafts` (seq id -> at most draft_tokens tokens) are verified in
    the workers' free decode rows, and `dispatch_report` says what each sequence made."""
    self._migrate_t0 = None
    ss = self.stepset
    tables = self._page_tables()[self.active] if self.spec.paged else None
    d_n = self.spec.draft_tokens
    if drafts and not d_n:
      raise ValueError("drafts need an engine with spec.draft_tokens > 0")
    todo: dict[int, np.ndarray] = dict(drafts or {})
    before = dict(self._generated) if d_n else {}
    live0 = [sid for ws, sid in self._seq_in_slot.items()] if d_n else []
    tally: dict[int, tuple[int, int]] = dict.fromkeys(live0, (0, 0))

    def host(k):
      queue = queued = None
      if self.spec.chunked:
        queue, queued = self._queue(k)
      return ss.put_host(state_lib.decode_host(
          k, stop_on_refill, stop_on_idle, tables, self.spec.sampling.temperature, queue=queue,
          queued=queued, chunk=self.prefill_chunk, seed=self.seed, epoch=self.epoch,
          drafts=self._draft_array(todo) if d_n else None), self.e2s)

    def count():
      for sid, (r, kept) in self._drafts_seen.items():
        if sid in tally:
          tally[sid] = (tally[sid][0] + r, tally[sid][1] + kept)

    total, finishes = 0, []
    if self._pending_release_t0 is not None and max_steps > 0:
      # First step on a new mesh alone, to time release decision -> first output.
      out = ss["decode"](self.rest, self.experts, self.state, host(1))
      self._first_output_on_new_mesh(out)
      self.state, steps, counts = out
      steps, counts = self._read(steps, counts)
      self.expert_counts += counts
      total = int(steps)
      self._take(total)
      finishes = self._read_finishes()
      count()
      live = {w for w, _ in self._seq_in_slot}
      if total == 0 or max_steps == 1 or dispatch_stops(
          [f.worker for f in finishes], live, self.active, stop_on_refill, stop_on_idle):
        self._report(before, live0, tally)
        return total, finishes
      max_steps -= 1
      if todo:  # what the step made moves each draft on, or ends it where they differ
        todo = self._drafts_after(todo, before)
    self.state, steps, counts = ss["decode"](self.rest, self.experts, self.state, host(max_steps))
    steps, counts = self._read(steps, counts)
    self.expert_counts += counts
    self._take(int(steps))
    finishes += self._read_finishes(step_offset=total)
    count()
    self._report(before, live0, tally)
    return total + int(steps), finishes

  def _drafts_after(self, drafts: dict[int, np.ndarray], before: dict[int, int]
                    ) -> dict[int, np.ndarray]:
    """The drafts still alive after a dispatch's first device call, moved past the tokens it made
    (its drafts' places start over with each call)."""
    where = self._slot_of()
    live = [sid for sid in drafts if sid in where]
    got = self.responses(live)
    out = {}
    for sid in live:
      made = got[sid][before[sid]:]
      d = np.asarray(drafts[sid])
      m = min(len(made), len(d))
      if np.array_equal(made[:m], d[:m]) and len(d) > len(made):
        out[sid] = d[len(made):]
    return out

  def _report(self, before: dict[int, int], live0: list[int], tally: dict) -> None:
    """dispatch_report for the sequences live at the dispatch's start (speculative decoding)."""
    if not self.spec.draft_tokens:
      return
    self.dispatch_report = {sid: (self._generated[sid] - before[sid], *tally[sid])
                            for sid in live0}
    where = self._slot_of()
    for sid in [s for s in self._generated if s not in where]:
      del self._generated[sid]

  def _first_output_on_new_mesh(self, out):
    """Release decision -> first output on the new mesh (block_until_ready), recorded once."""
    jax.block_until_ready(out)
    assert self._pending_release_t0 is not None  # callers check that a release is pending
    self.release_latencies.append(time.perf_counter() - self._pending_release_t0)
    self.release_sizes.append(len(self.active))
    self._pending_release_t0 = None

  def _read_finishes(self, step_offset: int = 0) -> list[Finish]:
    """Results of the sequences finished since the last call (into `outputs`): the small
    scalars array is read every time, the outputs only when something finished. A Finish's
    step is the device call's step + `step_offset` (the steps of the dispatch before it)."""
    scalars, = self._read(self.state.scalars)
    col = {name: scalars[:, i] for i, name in enumerate(state_lib.SCALAR_COLS)}
    live, n_gen = col["live"], col["n_gen"]
    b = self.spec.slots_per_worker
    if self.spec.draft_tokens:
      self._drafts_seen = {}
      for (w, s), sid in self._seq_in_slot.items():
        row = self._pos(w) * b + s
        self._generated[sid] = int(n_gen[row])
        self._drafts_seen[sid] = (int(col["drafted"][row]), int(col["accepted"][row]))
    pending = self._pending_slots()  # admitted, input not all in: not live yet, not finished
    done = [(w, s, sid) for (w, s), sid in self._seq_in_slot.items()
            if not live[self._pos(w) * b + s] and (w, s) not in pending]
    if not done:
      return []
    toks, lps = self._read(self.state.out_tokens, self.state.out_logprobs)
    routes = self._read(self.state.routes)[0] if self.state.routes is not None else None
    out = []
    for w, s, sid in done:
      row = self._pos(w) * b + s  # the decode slot's sequence row
      k = int(n_gen[row])
      q = self.seqs[sid]
      tk, lp = self._merged(sid, toks[row, :k], lps[row, :k])
      self._kept.pop(sid, None)
      reason = finish_reason(k, q.limit, target=q.fixed_length,
                             eos=bool(q.stop_eos and tk and tk[-1] in self.spec.cfg.stop_ids))
      fed = len(q.tokens) + k - 1  # positions that went through the model
      self.outputs[sid] = SeqOutput(tk, lp, reason, w, s,
                                    None if routes is None else routes[row, :fed].copy())
      del self._seq_in_slot[(w, s)]
      out.append(Finish(seq_id=sid, worker=w, slot=s, num_tokens=k, reason=reason,
                        step=int(col["done_step"][row]) + step_offset))
    return out

  def _merged(self, sid: int, toks, lps) -> tuple[list, list]:
    """A sequence's tokens and log-probs: those kept from before its preemption (paged KV),
    then the device's from there on."""
    kt, kl = self._kept.get(sid, ([], []))
    return list(kt) + toks[len(kt):].tolist(), list(kl) + lps[len(kl):].tolist()

  def preempt(self, slots: Sequence[tuple[int, int]]):
    """Paged KV: drop the live sequences of these (worker, decode slot)s, keeping the tokens and
    log-probs each has made; a later prefill of the sequence recomputes its KV and continues.
    The rows go dead by a host write of the scalars (no compile)."""
    if not slots:
      return
    scalars, toks, lps = self._read(self.state.scalars, self.state.out_tokens,
                                     self.state.out_logprobs)
    scalars = np.array(scalars)
    b, col = self.spec.slots_per_worker, state_lib.SCALAR_COLS
    pending = self._pending_slots()
    for w, s in slots:
      sid = self._seq_in_slot.pop((w, s))
      if (w, s) in pending:  # its input not all in: not live, and it keeps what it had kept
        self._pending[w] = [e for e in self._pending[w] if e[0] != s]
        continue
      row = self._pos(w) * b + s
      k = int(scalars[row, col.index("n_gen")])
      self._kept[sid] = self._merged(sid, toks[row, :k], lps[row, :k])
      scalars[row, col.index("live")] = 0
    self.state = self.state.replace(
        scalars=jax.device_put(scalars, self.state.scalars.sharding))
    self.preemptions += len(slots)

  # -- elastic (elastic.py moves the data)
  def migrate(self, moves: Sequence[tuple[int, int, int, int]]) -> int:
    """Move live sequences (src_worker, src_slot, dst_worker, dst_slot); returns KV bytes sent."""
    if not moves:
      return 0
    pending = self._pending_slots()
    if any((sw, ss) in pending for sw, ss, _, _ in moves):
      raise ValueError("a sequence whose input is not all in moves as a preemption, not a "
                       f"migration: {[m for m in moves if (m[0], m[1]) in pending]}")
    self._migrate_t0 = time.perf_counter()  # the release that follows is timed from here
    page_moves = None
    if self.spec.paged:
      # The pool has moved the rows already. The data is in the pages of the tables the device
      # last got (a table only grows at its end: pages taken since hold nothing yet), and goes
      # to the first as many pages of the destination's new table.
      pool, last = self.pages, self._tables
      assert pool is not None and last is not None  # both set by attach_pages
      page_moves, m = [], pool.num_pages
      for sw, ss, dw, ds in moves:
        src = last[sw, ss][last[sw, ss] < m]
        dst = pool.table(dw)[ds, :len(src)]
        if len(src) > pool.owned(dw, ds):
          raise RuntimeError(f"migration {(sw, ss, dw, ds)}: {len(src)} pages with data, "
                             f"{pool.owned(dw, ds)} at the destination")
        page_moves.append((src, dst))
    self.state, kv_bytes = elastic.migrate(self.steps, self.devices, self.active, self.state,
                                           moves, page_moves)
    if self.spec.paged:
      assert self.pages is not None  # set by attach_pages
      self._tables = self.pages.tables()
    for sw, s_, dw, ds in moves:
      if (sw, s_) in self._seq_in_slot:
        self._seq_in_slot[(dw, ds)] = self._seq_in_slot.pop((sw, s_))
    return kv_bytes

  def shrink(self, new_active: Sequence[int]) -> dict:
    """Release the workers not in `new_active` (a tail of the chain, none holding a live
    sequence): elastic.release moves the experts and reassembles the rest."""
    t0 = time.perf_counter()
    new_active = list(new_active)
    if new_active != self.chain[len(self.chain) - len(new_active):]:
      raise ValueError(f"active set {new_active} is not a tail of the release chain {self.chain}")
    released = [w for w in self.active if w not in new_active]
    live = [k for k in self._seq_in_slot if k[0] in released]
    if live:
      raise ValueError(f"workers {released} still hold live sequences {live}: migrate first")
    n = len(new_active)
    r = elastic.release(self.steps, self.devices, self.active, new_active, self.placement,
                        self.experts, self.state)
    self.rest = self._rest_views.pop(n)
    self._rest_views = {m: v for m, v in self._rest_views.items() if m < n}
    self.experts, self.state, self.active = r.experts, r.state, new_active
    self.set_placement(r.placement)
    # The latency counts from the decision: the plan's migrations when it had any.
    self._pending_release_t0 = t0 if self._migrate_t0 is None else self._migrate_t0
    self._migrate_t0 = None
    return {"released": r.released, "expert_bytes_moved": r.expert_bytes,
            "expert_moves": r.expert_moves, "shrink_seconds": time.perf_counter() - t0}
