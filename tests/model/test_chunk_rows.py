"""Prompt tokens as query rows of the decode step (the model level of chunked prefill):
`transformer.decode(..., rows_B)` and `paged.decode_paged(..., rows_B)` run a prompt's tokens,
a chunk at a time, as one-token queries over its sequence's cache row beside the decode rows of
other sequences, in one code path.

For every family's tiny model (Mixtral, Qwen3-MoE, GPT-OSS with sliding rings and sinks,
DeepSeek-V3 with MLA) on fixed slots and on the paged pool, in steps of Q = 8 query rows (3
decode rows of live sequences at shuffled cache rows, up to 5 prompt rows):
- a prompt of 21 tokens fed in chunks of 3 or of 5, beside live decode rows or beside invalid
  rows, gives bitwise the same last-token logits and the same cache row (slots, pages, rings);
- it agrees with one-shot `prefill` + `insert` / `insert_paged` within 1e-5 (fp32: two
  summation orders), in the last-token logits, the cached K/V and three decode steps after;
- a decode row's logits are bitwise the same with prompt rows beside it and with those rows
  invalid;
- an invalid query row, or one whose cache row or position is out of range, writes nothing.
The caches start full of random values (stale rows of earlier sequences) and the norms and
biases are random, so a wrong row, slot, position or mask, or a dropped term, shows. A ring of
exactly the window (chunk 1) fed chunks of 5 is far from the one-shot prefill: the chunk's extra
ring positions are needed."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_utils import FAMILIES, noisy_params, random_cache

from flexfloor_jax.model import paged
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig

KINDS = ("slots", "paged")

Q = 8  # query rows per step
C = 5  # the most prompt rows of one sequence per step: the rings' chunk
CHUNKS = (3, 5)
N_ROWS, S = 5, 32  # cache rows (sequence rows), positions per row
PAGE = 4
M = S // PAGE  # pages per sequence: the paged view is as long as a slot
NUM_PAGES = N_ROWS * M + 3
P = 21  # prompt tokens: > both chunks, > the window and the ring
PROMPT_ROW = 1
DEC_ROWS = np.array([2, 0, 3])  # the decode sequences' cache rows (query rows 0-2)
DEC_LENGTHS = np.array([5, 9, 3])
DEC_STEPS = math.ceil(P / min(CHUNKS))
CONT = 3  # decode steps after the prompt
# fp32, the same math in two orders (prefill's causal attention over the prompt vs one query row
# at a time over the cache; MLA also expanded vs absorbed): ~1e-6. A wrong key, slot or position
# is > 1e-3.
TOL = 1e-5

Store = tfm.KVCache | paged.PagedKVCache


@dataclasses.dataclass
class Case:
  """One family on one store: params, the inputs, the store's start states and its steps."""
  cfg: ModelConfig
  kind: str
  params: dict
  prompt: np.ndarray  # [P]
  dec_tokens: np.ndarray  # [3, DEC_STEPS]: the decode rows' fed tokens, step by step
  cont: np.ndarray  # [CONT]: the prompt's tokens after it
  table: np.ndarray  # [N_ROWS, M]: each sequence row's pages (paged)
  garbage: Store  # the store, every value random
  start: Store  # garbage + the decode sequences prefilled (not the prompt)
  one_shot: Store  # garbage + every sequence prefilled, the prompt included
  prefill_logits: np.ndarray  # [V]: the prompt's last token, one-shot
  # (params, cache, [table,] tokens, positions, valid, rows) -> (logits [Q, V], cache)
  step: Callable[..., Any]

  def run(self, cache, tokens, positions, valid, rows):
    args = [jnp.asarray(a) for a in (tokens, positions, valid, rows)]
    if self.kind == "paged":  # each query row brings its sequence's table row (none: all -1)
      ok = (rows >= 0) & (rows < N_ROWS)
      tab = np.where(ok[:, None], self.table[np.clip(rows, 0, N_ROWS - 1)], -1)
      args.insert(0, jnp.asarray(tab, jnp.int32))
    logits, cache = self.step(self.params, cache, *args)
    return np.asarray(logits), cache

  def prompt_row(self, cache) -> dict[str, np.ndarray]:
    """Everything the store holds for the prompt's sequence: its slot row or its pages (every
    position, written or not) and its ring row."""
    out = {}
    if self.kind == "slots":
      out["k"], out["v"] = (np.asarray(x)[:, PROMPT_ROW] for x in (cache.k, cache.v))
    else:  # [L, K, M, page, hd] -> [L, S, K, hd], the slot layout
      for name in ("k", "v"):
        pages = np.asarray(getattr(cache, f"{name}_pages"))[:, :, self.table[PROMPT_ROW]]
        out[name] = np.moveaxis(pages.reshape(*pages.shape[:2], S, pages.shape[-1]), 1, 2)
    if cache.k_ring is not None:
      out["k_ring"], out["v_ring"] = (np.asarray(x)[:, PROMPT_ROW]
                                      for x in (cache.k_ring, cache.v_ring))
    return out


@functools.cache
def _jitted(cfg: ModelConfig, kind: str):
  """The step (one compile per family and store: Q is fixed), prefill and insert."""
  if kind == "slots":
    step = jax.jit(lambda p, c, t, pos, ok, rows: tfm.decode(p, cfg, c, t, pos, ok,
                                                             rows_B=rows)[:2])
  else:
    step = jax.jit(lambda p, c, tab, t, pos, ok, rows: paged.decode_paged(
        p, cfg, c, tab, t, pos, ok, rows_B=rows)[:2])
  prefill = jax.jit(lambda p, t, n: tfm.prefill(p, cfg, t, n)[:3])
  insert = jax.jit(tfm.insert if kind == "slots" else paged.insert_paged)
  return step, prefill, insert


def _empty(cfg: ModelConfig, kind: str, chunk: int = C):
  if kind == "slots":
    return tfm.KVCache.zeros(cfg, N_ROWS, S, chunk=chunk)
  return paged.PagedKVCache.zeros(cfg, NUM_PAGES, PAGE, rows=N_ROWS, max_len=S, chunk=chunk)


@functools.cache
def _case(family: str, kind: str, chunk: int = C) -> Case:
  cfg = FAMILIES[family]
  seed = sorted(FAMILIES).index(family)
  params = noisy_params(cfg, seed)
  rng = np.random.default_rng(100 + seed)
  step, prefill, insert = _jitted(cfg, kind)
  prompt = rng.integers(3, cfg.vocab_size, P)
  dec_prompts = [rng.integers(3, cfg.vocab_size, n) for n in DEC_LENGTHS]
  # one prefill of every sequence: the decode ones (padded) and the prompt
  tokens = np.zeros((4, P), np.int32)
  for i, t in enumerate(dec_prompts):
    tokens[i, :len(t)] = t
  tokens[3] = prompt
  lengths = np.array([*DEC_LENGTHS, P], np.int32)
  logits, k, v = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths))
  table = rng.permutation(NUM_PAGES)[:N_ROWS * M].reshape(N_ROWS, M).astype(np.int32)
  garbage = random_cache(_empty(cfg, kind, chunk), seed)
  rows = np.array([*DEC_ROWS, PROMPT_ROW], np.int32)

  def prefilled(with_prompt: bool):
    if kind == "slots":
      slots = np.where(np.arange(4) < 3 + with_prompt, rows, -1)
      return insert(garbage, k, v, jnp.asarray(slots), jnp.asarray(lengths))
    n = np.where(np.arange(4) < 3 + with_prompt, lengths, 0)  # length 0: writes nothing
    return insert(garbage, k, v, jnp.asarray(table[rows]), jnp.asarray(n), jnp.asarray(rows))

  return Case(cfg, kind, params, prompt, rng.integers(3, cfg.vocab_size, (3, DEC_STEPS)),
              rng.integers(3, cfg.vocab_size, CONT), table, garbage, prefilled(False),
              prefilled(True), np.asarray(logits)[3], step)


@dataclasses.dataclass
class Run:
  last: np.ndarray | None  # [V]: the logits at the prompt's last token
  cache: Store
  dec_logits: list[np.ndarray]  # per step, [3, V]: the decode rows'


def _chunked(case: Case, c: int, company: bool, prompt: bool = True) -> Run:
  """The prompt in chunks of c (query rows 3..), beside the decode rows 0-2 (valid where
  `company`, else invalid). The query rows a chunk leaves over are invalid and point at the
  prompt's cache row at its first position with random tokens: a write from them would
  overwrite the prompt's position 0. prompt=False: DEC_STEPS steps with every prompt row
  invalid."""
  rng = np.random.default_rng(c * 10 + company + 2 * prompt)
  cache = case.start
  steps = math.ceil(P / c) if prompt else DEC_STEPS
  last, dec = None, []
  for j in range(steps):
    tokens = rng.integers(3, case.cfg.vocab_size, Q)
    positions = np.zeros(Q, np.int32)
    valid = np.zeros(Q, bool)
    rows = np.full(Q, PROMPT_ROW, np.int32)
    tokens[:3], positions[:3], valid[:3], rows[:3] = (case.dec_tokens[:, j], DEC_LENGTHS + j,
                                                      company, DEC_ROWS)
    lo, hi = (j * c, min(j * c + c, P)) if prompt else (0, 0)
    n = hi - lo
    tokens[3:3 + n], positions[3:3 + n] = case.prompt[lo:hi], np.arange(lo, hi)
    valid[3:3 + n] = True
    logits, cache = case.run(cache, tokens, positions, valid, rows)
    dec.append(logits[:3])
    if prompt and hi == P:
      last = logits[3 + n - 1]
  return Run(last, cache, dec)


@functools.cache
def _runs(family: str, kind: str) -> dict[str, Run]:
  """The schedules the tests compare (computed once per family and store)."""
  case = _case(family, kind)
  runs = {f"c{c}": _chunked(case, c, company=True) for c in CHUNKS}
  runs["c3-alone"] = _chunked(case, 3, company=False)
  runs["decode-only"] = _chunked(case, 3, company=True, prompt=False)
  return runs


def _continue(case: Case, cache) -> list[np.ndarray]:
  """CONT decode steps of the prompt's sequence (query row 3) after its prompt, the other rows
  invalid: its logits [V] at each."""
  out = []
  for i in range(CONT):
    tokens = np.full(Q, 7, np.int32)
    positions = np.full(Q, P + i, np.int32)
    valid = np.zeros(Q, bool)
    rows = np.arange(Q, dtype=np.int32) % N_ROWS
    tokens[3], valid[3], rows[3] = case.cont[i], True, PROMPT_ROW
    logits, cache = case.run(cache, tokens, positions, valid, rows)
    out.append(logits[3])
  return out


PARAMS = [(f, k) for f in FAMILIES for k in KINDS]
IDS = [f"{f}-{k}" for f, k in PARAMS]


@pytest.mark.parametrize("family, kind", PARAMS, ids=IDS)
def test_prompt_rows_independent_of_chunking_and_company(family, kind):
  """Chunks of 3 beside live decode rows, chunks of 5 beside them, chunks of 3 beside invalid
  rows: bitwise the same logits at the prompt's last token and the same cache row (slots or
  pages, every position, and rings)."""
  runs = _runs(family, kind)
  case = _case(family, kind)
  ref = runs["c3"]
  assert ref.last is not None and ref.last.std() > 0.2  # not flat: a wrong key would show
  want = case.prompt_row(ref.cache)
  before = case.prompt_row(case.start)
  for name, arr in want.items():  # the prompt did write its row (the test can fail)
    assert arr.size == 0 or not np.array_equal(arr, before[name]), name
  for other in ("c5", "c3-alone"):
    got = runs[other]
    np.testing.assert_array_equal(got.last, ref.last, err_msg=other)
    for name, arr in case.prompt_row(got.cache).items():
      np.testing.assert_array_equal(arr, want[name], err_msg=f"{other}: {name}")


@pytest.mark.parametrize("family, kind", PARAMS, ids=IDS)
def test_prompt_rows_match_one_shot_prefill(family, kind):
  """Against prefill + insert of the whole prompt: the last-token logits, the K/V of every
  prompt position (rings: every slot, each holding one of the prompt's last positions) and the
  logits of CONT decode steps after, within TOL."""
  case = _case(family, kind)
  run = _runs(family, kind)["c5"]
  assert run.last is not None
  d_logits = np.abs(run.last - case.prefill_logits).max()
  got, want = case.prompt_row(run.cache), case.prompt_row(case.one_shot)
  d_kv = 0.0
  for name in (n for n in got if got[n].size):  # every layer a ring: no full rows
    a, b = (got[name], want[name]) if "ring" in name else (got[name][:, :P], want[name][:, :P])
    d_kv = max(d_kv, float(np.abs(a - b).max()))
  d_cont = max(np.abs(a - b).max() for a, b in zip(_continue(case, run.cache),
                                                   _continue(case, case.one_shot), strict=True))
  print(f"[{family} {kind}] chunked vs one-shot max|diff|: last logits {d_logits:.3g}, "
        f"K/V {d_kv:.3g}, {CONT} decode steps after {d_cont:.3g}")
  assert max(d_logits, d_kv, d_cont) <= TOL


@pytest.mark.parametrize("family, kind", PARAMS, ids=IDS)
def test_decode_rows_independent_of_prompt_rows(family, kind):
  """The decode rows' logits at every step: bitwise the same beside chunks of 3 prompt rows,
  beside chunks of 5, and beside invalid rows only."""
  runs = _runs(family, kind)
  ref = runs["decode-only"].dec_logits
  assert ref[0].std(-1).min() > 0.2
  for name in ("c3", "c5"):
    got = runs[name].dec_logits
    for j, g in enumerate(got):
      np.testing.assert_array_equal(g, ref[j], err_msg=f"{name} step {j}")


@pytest.mark.parametrize("family, kind", PARAMS, ids=IDS)
def test_invalid_and_out_of_range_rows_write_nothing(family, kind):
  """One step over a store of random values: invalid rows (pointing at real rows), rows -1 and
  N_ROWS (valid; paged: no pages either) and a position past the row write nothing; the valid
  rows change exactly their own (row, position) in every layer: slots, pages and ring slots,
  two rows of one sequence (a chunk) included."""
  case = _case(family, kind)
  #            valid  row     position
  spec = [(True, 2, S - 1), (False, 0, 3), (True, -1, 4), (True, N_ROWS, 5),
          (True, 1, 10), (True, 1, 11), (False, 1, 12), (True, 4, S)]
  valid = np.array([s[0] for s in spec])
  rows = np.array([s[1] for s in spec], np.int32)
  positions = np.array([s[2] for s in spec], np.int32)
  tokens = np.random.default_rng(5).integers(3, case.cfg.vocab_size, Q)
  before = case.garbage
  logits, after = case.run(before, tokens, positions, valid, rows)
  writes = [(2, S - 1), (1, 10), (1, 11)]
  assert np.all(np.isfinite(logits[[0, 4, 5]]))

  def changed(a, b, keep):  # any value differs over the trailing axes but `keep`
    a, b = np.asarray(a), np.asarray(b)
    return np.any(a != b, axis=tuple(i for i in range(a.ndim) if i not in keep))

  if kind == "slots":
    want = np.zeros((N_ROWS, S), bool)
    for r, t in writes:
      want[r, t] = True
    for name in ("k", "v"):  # [L, rows, S, K, hd]: each layer at exactly these
      ch = changed(getattr(before, name), getattr(after, name), (0, 1, 2))
      for layer in ch:
        np.testing.assert_array_equal(layer, want, err_msg=name)
  else:
    want = np.zeros((NUM_PAGES, PAGE), bool)
    for r, t in writes:
      want[case.table[r, t // PAGE], t % PAGE] = True
    for name in ("k_pages", "v_pages"):  # [L, K, pages, page, hd]
      ch = changed(getattr(before, name), getattr(after, name), (0, 2, 3))
      for layer in ch:
        np.testing.assert_array_equal(layer, want, err_msg=name)
  if before.k_ring is not None:
    r_len = before.k_ring.shape[2]
    want = np.zeros((N_ROWS, r_len), bool)
    for r, t in writes:
      want[r, t % r_len] = True
    for name in ("k_ring", "v_ring"):  # [rings, rows, R, K, hd]
      ch = changed(getattr(before, name), getattr(after, name), (0, 1, 2))
      for layer in ch:
        np.testing.assert_array_equal(layer, want, err_msg=name)


def test_ring_holds_the_chunk_beyond_the_window():
  """kv_layout: rings of window + chunk - 1 positions (chunk 1: the window; no rings where that
  reaches the cache length), in both stores. A ring of only the window, fed chunks of 5, loses
  positions that later rows of the step overwrite before earlier rows read them: its last-token
  logits are far (> 1e-3) from the one-shot prefill's, where the chunk's ring is within TOL."""
  cfg = FAMILIES["gpt-oss"]
  w = cfg.sliding_window
  assert w is not None
  assert tfm.kv_layout(cfg, S).ring_len == w
  assert tfm.kv_layout(cfg, S, chunk=C).ring_len == w + C - 1
  assert tfm.kv_layout(cfg, S, chunk=C).ring_layers == cfg.sliding_layers
  assert tfm.kv_layout(cfg, w + C - 1, chunk=C).ring_layers == ()
  with pytest.raises(ValueError, match="chunk"):
    tfm.kv_layout(cfg, S, chunk=0)
  ring = (len(cfg.sliding_layers), N_ROWS, w + C - 1, cfg.num_kv_heads, cfg.head_dim)
  for kind in KINDS:
    for chunk, r_len in ((C, w + C - 1), (1, w)):
      k_ring = _empty(cfg, kind, chunk).k_ring
      assert k_ring is not None and k_ring.shape == ring[:2] + (r_len,) + ring[3:]

  short = _case("gpt-oss", "slots", chunk=1)
  run = _chunked(short, 5, company=True)
  assert run.last is not None
  d_short = np.abs(run.last - short.prefill_logits).max()
  good = _runs("gpt-oss", "slots")["c5"]
  assert good.last is not None
  d_good = np.abs(good.last - short.prefill_logits).max()
  print(f"chunks of 5: ring of the window {d_short:.3g}, of window + 4 {d_good:.3g}")
  assert d_short > 1e-3 and d_good <= TOL
