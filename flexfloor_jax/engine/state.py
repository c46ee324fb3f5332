"""The engine's typed device state and the column layouts of its host inputs.

Names: a *decode slot* is a place for one sequence on a worker (B per worker); its *sequence row*
is its row in the global arrays (position of the worker among the active ones * B + slot); an
*expert slot* is a place for one expert's weights on a worker (S per worker).

DecodeState (a pytree; leading row axis N*B, or axis 1 for the KV cache, sharded over workers):
  k, v          the KV cache [Lf, N*B, max_seq_len, Hkv, Dh] (spec.kv == 'slots'), or None
  k_pages, v_pages  the paged KV pool [Lf, Hkv, N*num_pages, page_size, Dh] (spec.kv == 'paged',
                page axis sharded: each worker holds its own num_pages pages, page ids local), or
                None; B is then spec.slots_per_worker = the pool's max_seqs sequence rows
  k_ring, v_ring  [Lr, N*B, window, Hkv, Dh]: the sliding layers (`ring_layers`) whose window is
                shorter than max_seq_len keep a ring of their window per sequence row, fixed slots
                and paged pool alike (transformer.KVLayout); None where no layer does. Lf: the
                other layers, every layer without rings
  scalars       int32 [N*B, len(SCALAR_COLS)]: a decode slot's scalars and sequence key packed
                into one array, so a release reassembles one array for them instead of eight
  out_tokens, out_logprobs  [N*B, max_new_tokens]
  routes        [N*B, max_seq_len, L, K] the experts each fed token used (routing replay), or None

A step's host inputs travel as one int32 array sharded over the workers, one row per worker (one
transfer per step instead of one per input); the last num_experts columns of every row hold the
expert -> global expert slot table, so a release moves no separate table either. The builders
and readers below own those column layouts (PREFILL_COLS, DECODE_COLS): nothing else indexes
the host arrays. Paged KV: a prefill row also carries the page table of the row it fills
(pages_per_seq columns), a decode row the page tables of all its worker's B rows (B x
pages_per_seq); the tables come from the host's page pool with every step.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.paged import PagedKVCache

# done_step, drafted, accepted: what the last decode dispatch did to the slot (the step it
# finished in, -1 none; speculative decoding: the drafted rows it verified and the drafted tokens
# it kept), reset at every dispatch's start
SCALAR_COLS = ("tokens", "positions", "live", "n_gen", "limit", "stop_eos", "key0", "key1",
               "done_step", "drafted", "accepted")
_SCALAR = {name: i for i, name in enumerate(SCALAR_COLS)}


@struct.dataclass
class Scalars:
  """A decode slot's scalars, one array per field (inside a step)."""
  tokens: jax.Array  # input token of the next step
  positions: jax.Array  # where that token's KV goes
  live: jax.Array  # bool
  n_gen: jax.Array  # tokens generated so far
  limit: jax.Array  # tokens to generate at most
  stop_eos: jax.Array  # bool
  key: jax.Array  # uint32[2] sequence key
  done_step: jax.Array  # the last dispatch's step in which it finished, -1 none
  drafted: jax.Array  # drafted rows it verified in the last dispatch
  accepted: jax.Array  # drafted tokens it kept in the last dispatch

  if TYPE_CHECKING:  # flax.struct.dataclass adds it (dataclasses.replace)
    def replace(self, **changes: Any) -> Scalars: ...

  @classmethod
  def unpack(cls, a: jax.Array) -> Scalars:
    def col(name):
      return a[:, _SCALAR[name]]

    return cls(tokens=col("tokens"), positions=col("positions"), live=col("live") != 0,
               n_gen=col("n_gen"), limit=col("limit"), stop_eos=col("stop_eos") != 0,
               done_step=col("done_step"), drafted=col("drafted"), accepted=col("accepted"),
               key=jax.lax.bitcast_convert_type(
                   a[:, _SCALAR["key0"]:_SCALAR["key1"] + 1], jnp.uint32))

  def pack(self) -> jax.Array:
    key = jax.lax.bitcast_convert_type(self.key, jnp.int32)
    cols = [key[:, i - _SCALAR["key0"]] if name.startswith("key")
            else getattr(self, name).astype(jnp.int32) for i, name in enumerate(SCALAR_COLS)]
    return jnp.stack(cols, 1)


@struct.dataclass
class DecodeState:
  """Everything the decode slots hold on device (see the module docstring)."""
  scalars: jax.Array
  out_tokens: jax.Array
  out_logprobs: jax.Array
  k: jax.Array | None = None
  v: jax.Array | None = None
  routes: jax.Array | None = None
  k_pages: jax.Array | None = None
  v_pages: jax.Array | None = None
  k_ring: jax.Array | None = None
  v_ring: jax.Array | None = None
  ring_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())

  if TYPE_CHECKING:  # flax.struct.dataclass adds it (dataclasses.replace)
    def replace(self, **changes: Any) -> DecodeState: ...

  def as_dict(self) -> dict:
    """{name: array} of the fields present (elastic.py moves rows by name)."""
    names = ("k", "v", "scalars", "out_tokens", "out_logprobs", "routes", "k_pages", "v_pages",
             *RING_FIELDS)
    return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

  def row_dict(self) -> dict:
    """The fields with a sequence-row axis (everything but a paged pool's pages)."""
    return {n: a for n, a in self.as_dict().items() if n not in PAGE_FIELDS}

  def page_dict(self) -> dict:
    """The paged pool's pages ({} with fixed slots)."""
    return {n: a for n, a in self.as_dict().items() if n in PAGE_FIELDS}

  def slot_scalars(self) -> Scalars:
    return Scalars.unpack(self.scalars)

  @property
  def cache(self) -> tfm.KVCache:
    assert self.k is not None and self.v is not None  # fixed slots (spec.kv == 'slots')
    return tfm.KVCache(self.k, self.v, self.k_ring, self.v_ring, ring_layers=self.ring_layers)

  @property
  def paged(self):
    assert self.k_pages is not None and self.v_pages is not None  # spec.kv == 'paged'
    return PagedKVCache(self.k_pages, self.v_pages, self.k_ring, self.v_ring,
                        ring_layers=self.ring_layers)


PAGE_FIELDS = ("k_pages", "v_pages")
# The sliding layers' rings: sequence rows on axis 1 (after the layer axis), as k and v.
RING_FIELDS = ("k_ring", "v_ring")
KV_FIELDS = ("k", "v", *PAGE_FIELDS, *RING_FIELDS)


def cache_fields(cache: tfm.KVCache | PagedKVCache) -> dict:
  """The DecodeState fields that hold `cache` (as `DecodeState.cache` / `paged` gave it)."""
  if isinstance(cache, PagedKVCache):
    kv = dict(k_pages=cache.k_pages, v_pages=cache.v_pages)
  else:
    kv = dict(k=cache.k, v=cache.v)
  return dict(kv, k_ring=cache.k_ring, v_ring=cache.v_ring)


def ring_chunk(prefill_rows: int = 0, draft_tokens: int = 0) -> int:
  """The most query rows one sequence has in a step (kv_layout's chunk): a chunk of its prompt
  (chunked prefill), or its token and its drafted tokens (speculative decoding)."""
  return max(1, int(prefill_rows), int(draft_tokens) + 1)


def state_shapes(spec, n: int) -> DecodeState:
  """DecodeState of ShapeDtypeStructs for n workers (`spec`: an EngineSpec, or anything with its
  cfg, slots_per_worker, max_seq_len, max_new_tokens and record_routes)."""
  cfg, nb = spec.cfg, n * spec.slots_per_worker
  # chunked prefill, drafting: a sliding layer's ring holds the query rows a sequence has in one
  # step beyond its window (kv_layout)
  lay = tfm.kv_layout(cfg, spec.max_seq_len, chunk=ring_chunk(getattr(spec, "prefill_rows", 0),
                                                               getattr(spec, "draft_tokens", 0)))
  nf, dt = len(lay.full_layers), tfm.dtype_of(cfg)
  heads, kd, vd = cfg.kv_dims()  # MLA: k holds the latent, v the RoPE key (other widths)
  if getattr(spec, "kv", "slots") == "paged":
    page_shape = (nf, heads, n * spec.num_pages, spec.page_size)
    kv_fields = dict(k_pages=jax.ShapeDtypeStruct(page_shape + (kd,), dt),
                     v_pages=jax.ShapeDtypeStruct(page_shape + (vd,), dt))
    k = v = None
  else:
    k = jax.ShapeDtypeStruct((nf, nb, spec.max_seq_len, heads, kd), dt)
    v = jax.ShapeDtypeStruct((nf, nb, spec.max_seq_len, heads, vd), dt)
    kv_fields = {}
  if lay.ring_layers:
    ring = jax.ShapeDtypeStruct((len(lay.ring_layers), nb, lay.ring_len, cfg.num_kv_heads,
                                 cfg.head_dim), dt)
    kv_fields.update(k_ring=ring, v_ring=ring)
  # ShapeDtypeStructs in the fields that hold arrays in the concrete state
  fields: dict[str, Any] = dict(
      k=k, v=v, **kv_fields,
      scalars=jax.ShapeDtypeStruct((nb, len(SCALAR_COLS)), jnp.int32),
      out_tokens=jax.ShapeDtypeStruct((nb, spec.max_new_tokens), jnp.int32),
      out_logprobs=jax.ShapeDtypeStruct((nb, spec.max_new_tokens), jnp.float32),
      routes=jax.ShapeDtypeStruct((nb, spec.max_seq_len, cfg.num_layers, cfg.top_k), jnp.int32)
      if spec.record_routes else None)
  return DecodeState(**fields, ring_layers=lay.ring_layers)


def state_bytes_per_worker(cfg, slots_per_worker: int, max_seq_len: int, max_new_tokens: int,
                           record_routes: bool = False) -> int:
  """Bytes of one worker's decode-slot state without the KV cache (memory.py counts that
  apart), without an EngineSpec."""
  spec = types.SimpleNamespace(cfg=cfg, slots_per_worker=slots_per_worker, max_seq_len=max_seq_len,
                               max_new_tokens=max_new_tokens, record_routes=record_routes)
  arrays = state_shapes(spec, 1).as_dict()
  return sum(math.prod(v.shape) * v.dtype.itemsize for k, v in arrays.items()
             if k not in KV_FIELDS)


# ----------------------------------------------------------------------------- host inputs

# Prefill rows: the prompt's `width` token columns (max_prompt_len; a resumed sequence's prefill:
# max_seq_len), then PREFILL_COLS, then (paged KV) the filled row's page table. `generated`: the
# tokens a resumed (preempted) sequence had made; its tokens are prompt + those.
# `temperature` (both layouts): the sampling temperature's float32 bits, a runtime input rather
# than a compiled constant, so that a rollout at another temperature reuses the executables.
PREFILL_COLS = ("length", "slot", "limit", "stop_eos", "phash", "sample", "seed", "epoch",
                "generated", "temperature")
# Decode rows: DECODE_COLS, then (chunked prefill: spec.prefill_queue > 0) the worker's queue of
# input tokens, prefill_queue entries of QUEUE_COLS, then (speculative decoding: spec.draft_tokens
# D > 0) each of the worker's B slots' draft, B x (1 + D) columns: its length, then its tokens,
# then (paged KV) the page tables of the worker's B rows. `chunk`: the input tokens a step takes
# from the queue (at most spec.prefill_rows), `queued`: the queue's entries; `seed`, `epoch`:
# the sequence keys' inputs.
DECODE_COLS = ("max_steps", "stop_on_refill", "stop_on_idle", "temperature", "chunk", "queued",
               "seed", "epoch")
# A queue entry: one input token of a sequence being prefilled into decode slot `slot` at
# `position`; `last` marks its sequence's last input token, whose step samples the sequence's
# token number `generated` (0, or the tokens a resumed sequence had made) and makes the slot live
# with `limit`, `stop_eos` and the key of (`phash`, `sample`).
QUEUE_COLS = ("token", "slot", "position", "last", "limit", "stop_eos", "phash", "sample",
              "generated")


def temperature_bits(temperature: float) -> int:
  """The int32 column value that carries a float32 temperature."""
  return int(np.float32(temperature).view(np.int32))


def temperature_of(col: jax.Array) -> jax.Array:
  """Inside a step: the float32 temperature of a `temperature` column value."""
  return jax.lax.bitcast_convert_type(col, jnp.float32)


def prefill_host(width: int, n: int, seed: int, epoch: int, rows: Sequence[tuple],
                 pages_per_seq: int = 0, temperature: float = 1.0) -> np.ndarray:
  """Host inputs of one prefill step on n workers: `rows` (worker position, decode slot,
  SeqInput[, generated, page table row]), at most one per position; a worker without one
  prefills nothing (slot -1). pages_per_seq > 0: paged KV, each row brings its page table."""
  lp = width
  host = np.zeros((n, lp + len(PREFILL_COLS) + pages_per_seq), np.int32)
  col = {name: lp + i for i, name in enumerate(PREFILL_COLS)}
  host[:, col["slot"]] = -1
  host[:, col["seed"]] = seed
  host[:, col["epoch"]] = epoch
  host[:, col["temperature"]] = temperature_bits(temperature)
  t0 = lp + len(PREFILL_COLS)
  for p, slot, q, *more in rows:
    generated = more[0] if more else 0
    if host[p, col["slot"]] >= 0:
      raise ValueError(f"two prefills for worker position {p} in one step")
    host[p, :len(q.tokens)] = q.tokens
    for name, val in (("length", len(q.tokens)), ("slot", slot), ("limit", q.limit),
                      ("stop_eos", q.stop_eos), ("phash", q.phash), ("sample", q.sample),
                      ("generated", generated)):
      host[p, col[name]] = val
    if pages_per_seq:
      host[p, t0:] = np.asarray(more[1], np.int32)[:pages_per_seq]
  return host


def decode_host(max_steps: int, stop_on_refill, stop_on_idle, tables=None,
                temperature: float = 1.0, queue=None, queued=None, chunk: int = 0,
                seed: int = 0, epoch: int = 0, drafts=None) -> np.ndarray:
  """Host inputs of one decode dispatch: the masks are per worker position; `queue` (chunked
  prefill) [n, prefill_queue, len(QUEUE_COLS)] each worker's input tokens in the order its steps
  take them, `queued` [n] how many are real, `chunk` how many a step takes; `drafts`
  (speculative decoding) [n, B, 1 + D] each slot's draft length and tokens; `tables` (paged KV)
  [n, B, pages_per_seq] the page tables of every worker's rows."""
  n = len(stop_on_refill)
  cols = {"max_steps": np.full(n, max_steps), "stop_on_refill": stop_on_refill,
          "stop_on_idle": stop_on_idle, "temperature": np.full(n, temperature_bits(temperature)),
          "chunk": np.full(n, chunk), "queued": np.zeros(n) if queued is None else queued,
          "seed": np.full(n, seed), "epoch": np.full(n, epoch)}
  host = np.stack([np.asarray(cols[name]) for name in DECODE_COLS], axis=1).astype(np.int32)
  if queue is not None:
    q = np.asarray(queue, np.int32)
    host = np.concatenate([host, q.reshape(q.shape[0], -1)], 1)
  if drafts is not None:
    d = np.asarray(drafts, np.int32)
    host = np.concatenate([host, d.reshape(d.shape[0], -1)], 1)
  if tables is not None:
    t = np.asarray(tables, np.int32)
    host = np.concatenate([host, t.reshape(t.shape[0], -1)], 1)
  return host


def with_expert_table(host: np.ndarray, e2s: np.ndarray) -> np.ndarray:
  """Append the expert -> global expert slot table to every row."""
  table = np.broadcast_to(e2s, (host.shape[0], len(e2s)))
  return np.concatenate([host, table], 1).astype(np.int32)


def host_width(kind: str, width: int, num_experts: int, table_cols: int = 0,
               queue_len: int = 0, draft_cols: int = 0) -> int:
  """Columns of a step's host array ('prefill' | 'decode'), the expert table included;
  `table_cols`: the page-table columns (paged KV; prefill: pages_per_seq, decode: B x that);
  `queue_len`: a decode row's queue entries (chunked prefill); `draft_cols`: its drafts' columns
  (speculative decoding: B x (1 + D))."""
  if kind == "prefill":
    cols = width + len(PREFILL_COLS)
  else:
    cols = len(DECODE_COLS) + queue_len * len(QUEUE_COLS) + draft_cols
  return cols + table_cols + num_experts


def read_prefill(host_PC: jax.Array, width: int, num_experts: int, pages_per_seq: int = 0):
  """Inside a step: (prompt tokens [P, T], {PREFILL_COLS name: [P]}, expert table [E], page
  table [P, pages_per_seq] or None)."""
  host_PC, e2s = host_PC[:, :-num_experts], host_PC[0, -num_experts:]
  cols = {name: host_PC[:, width + i] for i, name in enumerate(PREFILL_COLS)}
  t0 = width + len(PREFILL_COLS)
  table = host_PC[:, t0:t0 + pages_per_seq] if pages_per_seq else None
  return host_PC[:, :width], cols, e2s, table


def read_decode(host_PC: jax.Array, num_experts: int, rows: int = 0, pages_per_seq: int = 0,
                queue_len: int = 0, draft_tokens: int = 0):
  """Inside a step: ({DECODE_COLS name: this worker's value}, expert table [E], page tables
  [rows, pages_per_seq] or None, input queue {QUEUE_COLS name: [queue_len]} or None, drafts
  [rows, 1 + draft_tokens] (length, tokens) or None)."""
  n = len(DECODE_COLS)
  queue = drafts = None
  if queue_len:
    q = host_PC[0, n:n + queue_len * len(QUEUE_COLS)].reshape(queue_len, len(QUEUE_COLS))
    queue = {name: q[:, i] for i, name in enumerate(QUEUE_COLS)}
    n += queue_len * len(QUEUE_COLS)
  if draft_tokens:
    w = rows * (1 + draft_tokens)
    drafts = host_PC[0, n:n + w].reshape(rows, 1 + draft_tokens)
    n += w
  table = (host_PC[0, n:n + rows * pages_per_seq].reshape(rows, pages_per_seq)
           if pages_per_seq else None)
  return ({name: host_PC[0, i] for i, name in enumerate(DECODE_COLS)},
          host_PC[0, -num_experts:], table, queue, drafts)
