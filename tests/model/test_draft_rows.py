"""Drafted tokens as query rows of the plain decode step (the model level of speculative
decoding): a free query row i carries drafted position j of a live sequence s (token d_j at
position p_s + j, `rows_B[i] = s`: the cache row it reads and writes), at the same compiled width
Q as plain decoding, through `transformer.decode(..., rows_B)` and `paged.decode_paged(...,
rows_B)`.

A drafted token is accepted only where plain decoding would have sampled the same token, and it
must sample it from bitwise the same logits: then speculative decoding changes no sample and no
log-prob, only how many steps they take. So every check here is bitwise (np.array_equal on the
fp32 logits and cache values, no tolerance), of the numbers as computed under jax.jit with the
config static, as the engine compiles its step, under the suite's XLA flags.

For every family's tiny model (Mixtral, Mixtral with a window of 6 on every layer, Qwen3-MoE,
GPT-OSS with its window cut to 6 and sinks, DeepSeek-V3 with MLA), on fixed slots and on the
paged pool, at compiled widths Q = 4 and Q = 8, with up to D = 3 drafted rows per sequence (the
caches made for chunk = D + 1: rings of window + D positions):
- a live row's logits, and what it writes, are the same alone with the other rows invalid and
  rows_B None (the plain engine step), alone with rows_B = arange(Q), beside the other live row,
  and beside drafted rows of its own sequence and of another live sequence in the free rows;
- one drafted step (t_0 at p in the live row, t_1..t_D at p+1..p+D in free rows) gives each
  drafted row the logits of the plain one-token step at its position, and leaves the store (slots
  or pages, and rings) as D + 1 plain steps leave it;
- a rejected draft (t_j wrong, j = 1, 2, D: positions p+j..p+D hold K/V from wrong inputs)
  leaves no trace: plain steps on from p + j with the right tokens give the plain run's logits
  and, at the end, its store bit for bit (what lies beyond the accepted position is masked, then
  overwritten). The live positions cross a multiple of the ring's length within those steps.
The caches start full of random values (the history of the live sequences and stale rows of
earlier ones) and the norms and biases are random, so a wrong row, slot, position or mask, or a
dropped term, shows."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from model_utils import FAMILIES, noisy_params, random_cache

from flexfloor_jax.model import paged
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig

KINDS = ("slots", "paged")
WIDTHS = (4, 8)  # compiled decode widths: the engine compiles one per run, each must hold

D = 3  # the most drafted rows of one sequence a step carries
CHUNK = D + 1  # query rows of one sequence per step: the live row and its drafts
S, PAGE = 32, 4  # positions per cache row; page size
M = S // PAGE  # pages per sequence: the paged view is as long as a slot
SPARE_PAGES = 3  # pages no sequence owns
REJECTS = (1, 2, D)  # the drafted position whose token is wrong, one rejection check each
CONT = 5  # plain steps after the rejection, from p + j
STEPS = max(REJECTS) + CONT  # the plain reference run's steps, from p

# The live sequences: cache row -> position of the token fed next (p). The cache rows are the
# query rows of plain decoding (rows_B None: query row i is cache row i), so the slots cache and
# the rings have Q rows. Positions: above the ring's 9 slots (the rings have wrapped before the
# first step), and each run crosses a multiple of 9 (18, 27) after the rejected position.
POS = {0: 23, 2: 14, 5: 23}
# Which live sequences carry how many drafted rows: DRAFTED for the drafting and rejection
# checks (every sequence D drafts; at Q = 4 one sequence fills the width), BESIDE for the
# independence check (two live sequences at both widths; at Q = 8 a dead row left over).
DRAFTED = {4: {2: D}, 8: {2: D, 5: D}}
BESIDE = {4: {2: 1, 0: 1}, 8: {2: D, 5: D - 1}}

Store = tfm.KVCache | paged.PagedKVCache
# query row -> (cache row, token, position): the valid rows of one step
Feeds = dict[int, tuple[int, int, int]]

# The step as the engine compiles it: the config static, everything else traced. rows_B None and
# rows_B an array are two programs (the plain step reads its rows in place, the other gathers).
_DECODE = jax.jit(tfm.decode, static_argnums=1)
_DECODE_PAGED = jax.jit(paged.decode_paged, static_argnums=1)


@functools.cache
def _family_params(family: str):
  return noisy_params(FAMILIES[family], 10 * sorted(FAMILIES).index(family))


def _same(got, want, what: str):
  """Bitwise equality; on failure, how many values differ, the largest |diff| and where (the
  leading indices: the query row of logits, the layer and row of a store)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  if np.array_equal(got, want):
    return
  bad = np.argwhere(got != want)
  diff = np.abs(got.astype(np.float64) - want.astype(np.float64)).max()
  raise AssertionError(f"{what}: {len(bad)} of {got.size} values differ, max|diff| {diff:.3g}, "
                       f"at leading indices {sorted({tuple(b[:2]) for b in bad.tolist()})[:12]}")


@dataclasses.dataclass
class Case:
  """One family on one store at one width: params, the live sequences' tokens, the page table,
  the store's start state."""
  family: str
  cfg: ModelConfig
  kind: str
  q: int
  params: dict
  tokens: dict[int, np.ndarray]  # cache row -> [STEPS]: the tokens plain decoding feeds from p
  wrong: dict[int, np.ndarray]  # cache row -> [D + 1]: tokens other than tokens[row][:D + 1]
  table: np.ndarray  # [Q, M]: each sequence row's pages (paged)
  start: Store  # every value random

  @property
  def name(self) -> str:
    return f"{self.family}-{self.kind}-Q{self.q}"

  def run(self, cache: Store, feeds: Feeds, with_rows: bool, seed: int):
    """One step: the rows of `feeds` valid, every other row dead (invalid, at its own cache row,
    a random token and a random in-range position, so a write from it would show). with_rows:
    rows_B given (the drafting step's program), else None (the plain step's). Each query row
    brings its cache row's table row (paged), as the engine's step does."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, self.cfg.vocab_size, self.q).astype(np.int32)
    positions = rng.integers(0, S, self.q).astype(np.int32)
    valid = np.zeros(self.q, bool)
    rows = np.arange(self.q, dtype=np.int32)
    for i, (row, token, pos) in feeds.items():
      rows[i], tokens[i], positions[i], valid[i] = row, token, pos, True
    assert with_rows or np.array_equal(rows, np.arange(self.q)), "rows_B None: row i is row i"
    kw = {"rows_B": rows} if with_rows else {}
    if self.kind == "slots":
      logits, cache, _ = _DECODE(self.params, self.cfg, cache, tokens, positions, valid, **kw)
    else:
      logits, cache, _ = _DECODE_PAGED(self.params, self.cfg, cache, self.table[rows], tokens,
                                       positions, valid, **kw)
    return np.asarray(logits), cache

  def at(self, cache: Store, row: int, positions) -> dict[str, np.ndarray]:
    """What the store holds for sequence row `row` at `positions`, in every layer: its slot
    row or its pages, and its ring slots."""
    pos = np.asarray(positions)
    out = {}
    if self.kind == "slots":
      for name in ("k", "v"):
        out[name] = np.asarray(getattr(cache, name))[:, row, pos]
    else:  # [L, K, pages, page, hd]
      for name in ("k", "v"):
        out[name] = np.asarray(getattr(cache, f"{name}_pages"))[
            :, :, self.table[row, pos // PAGE], pos % PAGE]
    if cache.k_ring is not None:
      r = cache.k_ring.shape[2]
      for name in ("k_ring", "v_ring"):
        out[name] = np.asarray(getattr(cache, name))[:, row, pos % r]
    return out

  def same_at(self, got: Store, want: Store, row: int, positions, what: str):
    for name, arr in self.at(got, row, positions).items():
      _same(arr, self.at(want, row, positions)[name], f"{self.name} {what}: row {row} {name}")

  def same_store(self, got: Store, want: Store, what: str):
    """Every value of the two stores (all rows, positions, pages and ring slots)."""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want), strict=True):
      _same(a, b, f"{self.name} {what}: {jax.tree_util.keystr(path)}")


@functools.cache
def _case(family: str, kind: str, q: int) -> Case:
  cfg = FAMILIES[family]
  seed = 10 * sorted(FAMILIES).index(family) + q + (kind == "paged")
  rng = np.random.default_rng(seed)
  rows = sorted(set(DRAFTED[q]) | set(BESIDE[q]))
  tokens = {s: rng.integers(3, cfg.vocab_size, STEPS) for s in rows}
  wrong = {s: 3 + (t[:D + 1] - 3 + rng.integers(1, cfg.vocab_size - 3, D + 1))
           % (cfg.vocab_size - 3) for s, t in tokens.items()}
  assert all(np.all(wrong[s] != tokens[s][:D + 1]) for s in rows)
  num_pages = q * M + SPARE_PAGES
  table = rng.permutation(num_pages)[:q * M].reshape(q, M).astype(np.int32)
  if kind == "slots":
    empty = tfm.KVCache.zeros(cfg, q, S, chunk=CHUNK)
  else:
    empty = paged.PagedKVCache.zeros(cfg, num_pages, PAGE, rows=q, max_len=S, chunk=CHUNK)
  return Case(family, cfg, kind, q, _family_params(family), tokens, wrong, table,
              random_cache(empty, seed))


def _plain_feeds(case: Case, seqs, k: int) -> Feeds:
  """Plain step k: each live sequence's own row fed its token k at p + k."""
  return {s: (s, int(case.tokens[s][k]), POS[s] + k) for s in seqs}


def _draft_rows(q: int, layout: dict[int, int]) -> dict[int, tuple[int, int]]:
  """query row -> (sequence row s, drafted index j in 1..layout[s]): the drafts in the free
  rows in a shuffled order (not grouped by sequence, not in position order)."""
  free = np.random.default_rng(q).permutation([i for i in range(q) if i not in layout])
  pairs = [(s, j) for s in sorted(layout) for j in range(1, layout[s] + 1)]
  assert len(pairs) <= len(free)
  return {int(i): p for i, p in zip(free, pairs, strict=False)}


def _drafted_feeds(case: Case, layout: dict[int, int], wrong: int = 0) -> Feeds:
  """One drafting step: each live sequence's row fed t_0 at p, its drafts t_j at p + j in free
  rows (rows_B = s). wrong > 0: t_wrong replaced by a token plain decoding would not feed."""
  feeds = {s: (s, int(case.tokens[s][0]), POS[s]) for s in layout}
  for i, (s, j) in _draft_rows(case.q, layout).items():
    token = int((case.wrong if j == wrong else case.tokens)[s][j])
    feeds[i] = (s, token, POS[s] + j)
  return feeds


@dataclasses.dataclass
class Plain:
  logits: list[np.ndarray]  # per step, [Q, V]
  caches: list[Store]  # after each step


@functools.cache
def _plain(family: str, kind: str, q: int) -> Plain:
  """The reference: STEPS plain one-token steps (rows_B None) of DRAFTED[q]'s sequences."""
  case = _case(family, kind, q)
  cache, out = case.start, Plain([], [])
  for k in range(STEPS):
    logits, cache = case.run(cache, _plain_feeds(case, DRAFTED[q], k), False, 100 + k)
    out.logits.append(logits)
    out.caches.append(cache)
  return out


PARAMS = [(f, k, q) for f in FAMILIES for k in KINDS for q in WIDTHS]
IDS = [f"{f}-{k}-Q{q}" for f, k, q in PARAMS]


@pytest.mark.parametrize("family, kind, q", PARAMS, ids=IDS)
def test_live_row_independent_of_rows_and_drafts(family, kind, q):
  """A live row's logits and its written K/V (position p of its row: slot or page, and ring
  slot) are bitwise the same (a) alone, rows_B None; (b) alone, rows_B = arange(Q); beside the
  other live row, rows_B None; (c) beside drafted rows of its own and of another live sequence
  (two layouts at Q = 8: D and D - 1 drafts with a dead row; D and D)."""
  case = _case(family, kind, q)
  seqs = sorted(set(BESIDE[q]) | set(DRAFTED[q]))
  # run name -> (logits, store, the live sequences it carries)
  runs: dict[str, tuple[np.ndarray, Store, set[int]]] = {}
  for s in seqs:
    alone = {s: (s, int(case.tokens[s][0]), POS[s])}
    runs[f"alone-{s}-none"] = (*case.run(case.start, alone, False, 1), {s})
    runs[f"alone-{s}-arange"] = (*case.run(case.start, alone, True, 2), {s})
  runs["beside-none"] = (*case.run(case.start, _plain_feeds(case, seqs, 0), False, 3), set(seqs))
  for name, layout in (("beside-drafts", BESIDE[q]), ("drafted", DRAFTED[q])):
    runs[name] = (*case.run(case.start, _drafted_feeds(case, layout), True, 4), set(layout))
  for s in seqs:
    ref_logits, ref_cache, _ = runs[f"alone-{s}-none"]
    assert ref_logits[s].std() > 0.2  # not flat: a wrong key or term would show
    before = case.at(case.start, s, [POS[s]])
    for name, arr in case.at(ref_cache, s, [POS[s]]).items():  # it wrote (the test can fail)
      assert arr.size == 0 or not np.array_equal(arr, before[name]), name
    for other in (f"alone-{s}-arange", "beside-none", "beside-drafts", "drafted"):
      logits, cache, live = runs[other]
      if s not in live:
        continue
      _same(logits[s], ref_logits[s], f"{case.name} {other}: logits of live row {s}")
      case.same_at(cache, ref_cache, s, [POS[s]], other)


@pytest.mark.parametrize("family, kind, q", PARAMS, ids=IDS)
def test_drafted_rows_match_plain_steps(family, kind, q):
  """One drafted step against D + 1 plain steps: the live row's logits are plain step 0's, the
  row drafting position p + j plain step j's, bitwise; the store after it is the store after
  the plain steps, at the sequences' positions p..p+D and everywhere else."""
  case = _case(family, kind, q)
  plain = _plain(family, kind, q)
  feeds = _drafted_feeds(case, DRAFTED[q])
  logits, cache = case.run(case.start, feeds, True, 5)
  for i, (s, _, pos) in feeds.items():
    j = pos - POS[s]
    assert plain.logits[j][s].std() > 0.2
    _same(logits[i], plain.logits[j][s],
          f"{case.name}: query row {i} (sequence {s}, drafted position p+{j}) vs plain step {j}")
  for s in DRAFTED[q]:
    case.same_at(cache, plain.caches[D], s, POS[s] + np.arange(D + 1), "drafted vs plain")
  case.same_store(cache, plain.caches[D], "drafted vs plain")


@pytest.mark.parametrize("family, kind, q", PARAMS, ids=IDS)
def test_rejected_drafts_leave_no_trace(family, kind, q):
  """For each j of REJECTS: a drafted step with t_j wrong, then CONT plain steps from p + j with
  the right tokens (what the engine runs after rejecting t_j: the model's token at p + j is
  t_j, the K/V at p + j.. p + D came from a wrong input). The accepted rows' logits, each later
  step's logits and the final store are bitwise the plain run's. The wrong draft did write
  something else (the check can fail), and each sequence's positions cross a multiple of the
  ring's length after the rejected one."""
  case = _case(family, kind, q)
  plain = _plain(family, kind, q)
  for reject in REJECTS:
    what = f"{case.name} t_{reject} rejected"
    feeds = _drafted_feeds(case, DRAFTED[q], wrong=reject)
    logits, cache = case.run(case.start, feeds, True, 6 + reject)
    for i, (s, _, pos) in feeds.items():
      j = pos - POS[s]
      if j < reject:  # accepted: the wrong token later in the step does not reach them
        _same(logits[i], plain.logits[j][s], f"{what}: accepted query row {i} (p+{j})")
      else:  # the wrong input's row and those after it differ from the plain step's
        assert not np.array_equal(logits[i], plain.logits[j][s]), (what, i, j)
    for s in DRAFTED[q]:
      at = [POS[s] + reject]
      provisional, right = case.at(cache, s, at), case.at(plain.caches[reject], s, at)
      assert any(a.size and not np.array_equal(a, right[n]) for n, a in provisional.items())
      if cache.k_ring is not None:
        r = cache.k_ring.shape[2]
        assert (POS[s] + reject) // r < (POS[s] + reject + CONT - 1) // r, "must wrap the ring"
    for k in range(reject, reject + CONT):
      logits, cache = case.run(cache, _plain_feeds(case, DRAFTED[q], k), False, 200 + k)
      for s in DRAFTED[q]:
        _same(logits[s], plain.logits[k][s], f"{what}: sequence {s}, plain step p+{k} after it")
    case.same_store(cache, plain.caches[reject + CONT - 1], f"{what}: store at the end")


@pytest.mark.parametrize("kind", KINDS)
def test_rings_hold_the_drafts(kind):
  """The stores here are laid out for chunk = D + 1: the sliding families' rings hold window + D
  positions (the live row and its D drafts beside the window), in every sliding layer."""
  for family in ("gpt-oss", "mixtral-sliding"):
    cfg = FAMILIES[family]
    assert cfg.sliding_window is not None
    lay = tfm.kv_layout(cfg, S, chunk=CHUNK)
    assert lay.ring_len == cfg.sliding_window + D
    start = _case(family, kind, WIDTHS[0]).start
    assert start.k_ring is not None and start.k_ring.shape[1:3] == (WIDTHS[0], lay.ring_len)
    assert start.ring_layers == lay.ring_layers
    assert set(lay.ring_layers) == {i for i in range(cfg.num_layers)
                                    if cfg.window_of(i) is not None}
