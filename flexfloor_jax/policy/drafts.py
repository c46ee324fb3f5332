"""Speculative-decoding drafts from text this prompt already produced: the host half.

An RL rollout samples each prompt several times per step and again every epoch, and a policy that
changes by small steps repeats much of what it wrote before. A live row's next tokens are drafted
by suffix matching: the longest suffix of the row's recent tokens that occurs in an earlier
epoch's response of its prompt (the ResponseStore, kept in a file beside the length history) or in
one of its siblings (the same prompt's other samples of this step, found as they grow), and what
followed it there. The engine's decode step is to verify the drafted tokens; this module only
proposes them, from the host, once per dispatch.

ResponseStore  earlier epochs' response tokens by prompt, bounded, saved like the length history
draft          one row's draft from a list of sources (arrays or SourceIndex)
Drafter        one rollout step's drafts: draft_rows(rows, max_draft), one call per dispatch

The store is keyed by the tokenizer's identity and the prompt id, not by the model's weights:
those change every RL step, and the drafts are only proposals that the engine checks.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from flexfloor_jax.io.atomic import atomic_open
from flexfloor_jax.io.output_dir import DirLock
from flexfloor_jax.policy.history import lock_beside

STORE_FORMAT = 'flexfloor_jax.response_store'
STORE_VERSION = 1
MAX_PER_PROMPT = 8  # responses kept per prompt (the newest epochs')
MAX_TOKENS = 1024  # tokens kept per response (its prefix)
MIN_MATCH = 3  # the shortest suffix that drafts: two tokens match by chance too often
MAX_MATCH = 16  # suffixes are compared over at most this many recent tokens
MAX_CANDIDATES = 8  # occurrences of a suffix examined per source (its latest)

_ARRAYS = ('prompt', 'epoch', 'sample', 'offsets', 'tokens')
_TOKEN_LIMIT = 2**31  # tokens are kept as int32
_EMPTY = np.zeros(0, np.int32)
_EMPTY.flags.writeable = False

log = logging.getLogger(__name__)

# prompt id -> epoch -> sample -> that response's tokens (read-only int32, at most max_tokens).
# An epoch's dict is replaced, never changed in place: the copy taken when the file was loaded
# (ResponseStore._base) shares them, and tells this run's entries from the file's.
Responses = dict[str, dict[int, dict[int, np.ndarray]]]


class StoreError(ValueError):
  """A response store file that cannot be used; the message names the file and what is wrong."""


def lock_store(path: str) -> DirLock:
  """The lock every writer of the store file `path` holds while it reads, merges and replaces it:
  `<path>.lock` beside it, the length history's rule (history.lock_history): another writer
  holding it, wait up to LOCK_WAIT_S, then StoreError; a lock left by a killed writer is taken
  over with a warning."""
  return lock_beside(path, 'response store', StoreError)


def _tokens(x, max_tokens: int | None, where: str) -> np.ndarray:
  """`x` as a response's stored tokens: 1-D whole numbers in [0, 2**31), its first `max_tokens`,
  a read-only int32 copy."""
  a = np.asarray(x)
  if a.ndim != 1 or (a.size and a.dtype.kind not in 'iu'):
    raise ValueError(f'{where}: tokens must be a 1-D array of integers, got {a.dtype} '
                     f'{a.shape}')
  if a.size and (int(a.min()) < 0 or int(a.max()) >= _TOKEN_LIMIT):
    raise ValueError(f'{where}: token ids must be in [0, {_TOKEN_LIMIT}), got '
                     f'{int(a.min())}..{int(a.max())}')
  out = np.array(a[:max_tokens], np.int32)
  out.flags.writeable = False
  return out


def _same(a: dict[int, np.ndarray] | None, b: dict[int, np.ndarray] | None) -> bool:
  if a is b:
    return True
  if a is None or b is None:
    return a is b
  return a.keys() == b.keys() and all(np.array_equal(v, b[s]) for s, v in a.items())


def _bounded(epochs: dict[int, dict[int, np.ndarray]], max_per_prompt: int | None,
             max_tokens: int | None = None) -> dict[int, dict[int, np.ndarray]]:
  """One prompt's epochs within the bounds: its newest `max_per_prompt` responses (newest epoch
  first, then the lowest samples), each cut to `max_tokens` (None: no bound). Epochs that need no
  change are the same dict objects, so that what a run did not change compares as unchanged."""
  order = sorted(((e, s) for e, d in epochs.items() for s in d), key=lambda es: (-es[0], es[1]))
  keep = set(order[:max_per_prompt])
  out = {}
  for e, d in epochs.items():
    kept = {s: v for s, v in d.items() if (e, s) in keep}
    if max_tokens is not None and any(len(v) > max_tokens for v in kept.values()):
      kept = {s: v[:max_tokens] for s, v in kept.items()}
    elif len(kept) == len(d):
      kept = d
    if kept:
      out[e] = kept
  return out


class ResponseStore:
  """Earlier epochs' response tokens by prompt, for drafting: prompt id -> epoch -> sample ->
  tokens, for one tokenizer (`tokenizer_id`: the same ids mean the same text; the model's
  weights may differ). Bounded: at most `max_per_prompt` responses per prompt, the newest epochs'
  (within an epoch the lowest samples), each cut to its first `max_tokens` tokens."""

  def __init__(self, tokenizer_id: str, *, max_per_prompt: int = MAX_PER_PROMPT,
               max_tokens: int = MAX_TOKENS):
    if not isinstance(tokenizer_id, str) or not tokenizer_id:
      raise ValueError(f'tokenizer_id must be a non-empty string, got {tokenizer_id!r}')
    if max_per_prompt < 1 or max_tokens < 1:
      raise ValueError(f'max_per_prompt and max_tokens must be >= 1, got {max_per_prompt} and '
                       f'{max_tokens}')
    self.tokenizer_id = tokenizer_id
    self.max_per_prompt = int(max_per_prompt)
    self.max_tokens = int(max_tokens)
    self.data: Responses = {}
    # What the file held when loaded (or last saved), by (prompt, epoch): what differs is this
    # run's own and wins over the file's when saved; the rest of the file is kept (save).
    self._base: dict[tuple[str, int], dict[int, np.ndarray]] = {}

  def __len__(self):
    return len(self.data)

  def __contains__(self, prompt_id):
    return prompt_id in self.data

  def _mark_saved(self) -> None:
    self._base = {(p, e): d for p, ep in self.data.items() for e, d in ep.items()}

  def add_rollout(self, epoch: int, responses: Iterable[tuple[str, int, object]]) -> None:
    """Record one rollout's responses, each (prompt id, sample, tokens): a prompt's epoch
    `epoch` becomes exactly the samples given here (as LengthHistory.add_rollout), then the
    prompt is cut to the bounds. ValueError for a negative epoch or sample, a sample given twice
    or tokens that are not token ids."""
    if int(epoch) < 0:
      raise ValueError(f'epoch must be >= 0, got {epoch}')
    by_prompt: dict[str, dict[int, np.ndarray]] = {}
    for prompt_id, sample, tokens in responses:
      p, s = str(prompt_id), int(sample)
      where = f'prompt {p!r} sample {s}'
      if s < 0:
        raise ValueError(f'{where}: sample must be >= 0')
      if s in by_prompt.setdefault(p, {}):
        raise ValueError(f'{where} is given twice in one rollout')
      by_prompt[p][s] = _tokens(tokens, self.max_tokens, where)
    for p, d in by_prompt.items():
      epochs = dict(self.data.get(p, {}))
      epochs[int(epoch)] = d
      self.data[p] = _bounded(epochs, self.max_per_prompt)

  def responses(self, prompt_id: str) -> list[np.ndarray]:
    """The prompt's stored responses, oldest epoch first (within an epoch by sample): the order
    `draft` takes its sources in, the most recent last. Read-only arrays; empty if none."""
    epochs = self.data.get(prompt_id, {})
    return [v for e in sorted(epochs) for _, v in sorted(epochs[e].items())]

  def epochs(self, prompt_id: str) -> dict[int, dict[int, np.ndarray]]:
    return self.data.get(prompt_id, {})

  def num_tokens(self) -> int:
    return sum(len(v) for ep in self.data.values() for d in ep.values() for v in d.values())

  # ------------------------------------------------------------------------------- the file

  def save(self, path: str, *, current: str | None = None, merge: bool = True) -> None:
    """The length history's rules (LengthHistory.save): merged with the file as it is now, under
    lock_store(path), so that runs sharing one file lose nothing: this run's entries (prompt,
    epoch), those added or changed since it was loaded, replace the file's, and the file's
    others are kept; where another run wrote the same prompt and epoch since, this run's win,
    with a warning naming the file and the count. The result is cut to this store's bounds.
    Atomic: a temp file beside it, fsync, os.replace; a crash leaves the old file.
    `current`: the file to merge with when `path` is a new copy of it; the caller holds
    lock_store(current) until the copy replaces it. `merge=False`: the file becomes exactly
    this store (still under the lock). StoreError, and nothing written, when the file became
    unreadable or was written for another tokenizer; OSError when it cannot be written."""
    if current is not None:
      self._save_merged(path, current, merge)
      return
    with lock_store(path):
      self._save_merged(path, path, merge)

  def _save_merged(self, path: str, current: str, merge: bool) -> None:
    data = self._read_current(current) if merge else {}
    conflicts = 0
    for p, ep in self.data.items():
      for e, d in ep.items():
        base = self._base.get((p, e))
        theirs = data.get(p, {}).get(e)
        if _same(d, base) and theirs is not None:
          continue  # unchanged by this run: the file's (maybe newer) entry stands
        if theirs is not None and not _same(theirs, d) and not _same(theirs, base):
          conflicts += 1
        data.setdefault(p, {})[e] = d
    if conflicts:
      log.warning('response store %s: another run saved %d of the entries (prompt, epoch) this '
                  'run wrote, with other responses, since this run loaded it: this run\'s '
                  'replace them', current, conflicts)
    data = {p: _bounded(ep, self.max_per_prompt, self.max_tokens) for p, ep in data.items()}
    with atomic_open(path, 'wb', durable=True) as f:
      a = self._arrays(data)
      np.savez(f, meta=a['meta'], prompt=a['prompt'], epoch=a['epoch'], sample=a['sample'],
               offsets=a['offsets'], tokens=a['tokens'])
    self._mark_saved()

  def _arrays(self, data: Responses) -> dict[str, np.ndarray]:
    """The file's arrays: one row per response (its prompt's index in the header's list, epoch,
    sample, and where its tokens start and end in `tokens`)."""
    prompts = sorted(p for p, ep in data.items() if ep)
    rows = [(i, e, s, v) for i, p in enumerate(prompts) for e, d in sorted(data[p].items())
            for s, v in sorted(d.items())]
    lengths = np.fromiter((len(r[3]) for r in rows), np.int64, len(rows))
    meta = {'format': STORE_FORMAT, 'version': STORE_VERSION, 'tokenizer': self.tokenizer_id,
            'prompts': prompts}
    return {
        'meta': np.frombuffer(json.dumps(meta).encode(), np.uint8),
        'prompt': np.fromiter((r[0] for r in rows), np.int64, len(rows)),
        'epoch': np.fromiter((r[1] for r in rows), np.int64, len(rows)),
        'sample': np.fromiter((r[2] for r in rows), np.int64, len(rows)),
        'offsets': np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        'tokens': (np.concatenate([r[3] for r in rows]).astype(np.int32) if rows
                   else np.zeros(0, np.int32)),
    }

  def _read_current(self, path: str) -> Responses:
    """The store file as it is now, to merge with, each response cut to this store's max_tokens
    (so that it compares with what this run loaded); empty when missing."""
    try:
      return {p: _bounded(ep, None, self.max_tokens)
              for p, ep in _read(path, self.tokenizer_id).items()}
    except StoreError as e:
      raise StoreError(f'{e}; not replaced: this run\'s responses were not saved') from None

  @classmethod
  def load(cls, path: str, tokenizer_id: str, *, max_per_prompt: int = MAX_PER_PROMPT,
           max_tokens: int = MAX_TOKENS) -> ResponseStore:
    """The store saved at `path`, cut to these bounds; missing file -> an empty store. A file that
    does not parse, is not a response store, was written for another tokenizer than
    `tokenizer_id` (its token ids mean other text) or holds an impossible value -> StoreError
    naming the file and what is wrong, before anything is read into the store."""
    store = cls(tokenizer_id, max_per_prompt=max_per_prompt, max_tokens=max_tokens)
    store.data = {p: _bounded(ep, store.max_per_prompt, store.max_tokens)
                  for p, ep in _read(path, tokenizer_id).items()}
    store._mark_saved()
    return store


def _read(path: str, tokenizer_id: str) -> Responses:
  """A store file's responses, every value checked (see ResponseStore.load); {} when missing."""
  if not os.path.exists(path):
    return {}
  try:
    z = np.load(path, allow_pickle=False)
    if not isinstance(z, np.lib.npyio.NpzFile):  # a plain .npy array
      raise StoreError(f'{path} is not a flexfloor_jax response store (no header)')
    with z:
      if 'meta' not in z.files:
        raise StoreError(f'{path} is not a flexfloor_jax response store (no header)')
      meta = json.loads(z['meta'].tobytes().decode())
      arrays = {k: z[k] for k in _ARRAYS if k in z.files}
  except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
    if isinstance(e, StoreError):
      raise
    raise StoreError(f'response store {path} is unreadable or corrupt ({e}); fix or remove it to '
                     'start from an empty store') from None
  if not isinstance(meta, dict) or meta.get('format') != STORE_FORMAT:
    raise StoreError(f'{path} is not a flexfloor_jax response store (format marker missing)')
  if meta.get('version') != STORE_VERSION:
    raise StoreError(f'response store {path} has version {meta.get("version")!r}, this code '
                     f'reads {STORE_VERSION}')
  if meta.get('tokenizer') != tokenizer_id:
    raise StoreError(f'response store {path} was written for tokenizer {meta.get("tokenizer")!r}, '
                     f'not this run\'s {tokenizer_id!r}: its token ids mean other text here; '
                     'point this run at another file or remove it')
  return _responses(path, meta, arrays)


def _responses(path: str, meta: dict, a: dict[str, np.ndarray]) -> Responses:
  """The responses of a store file's header `meta` and arrays `a`, every value checked."""
  where = f'response store {path}'
  prompts = meta.get('prompts')
  if (not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts)
      or len(set(prompts)) != len(prompts)):
    raise StoreError(f'{where}: the header\'s "prompts" must be a list of distinct strings')
  missing = [k for k in _ARRAYS if k not in a]
  if missing:
    raise StoreError(f'{where} has no {", ".join(missing)} array(s)')
  for k in _ARRAYS:
    if a[k].ndim != 1 or (a[k].size and a[k].dtype.kind not in 'iu'):
      raise StoreError(f'{where}: "{k}" must be a 1-D integer array, got {a[k].dtype} '
                       f'{a[k].shape}')
  n = len(a['prompt'])
  if len(a['epoch']) != n or len(a['sample']) != n or len(a['offsets']) != n + 1:
    raise StoreError(f'{where}: "prompt", "epoch", "sample" need one entry per response and '
                     '"offsets" one more, got lengths '
                     f'{[len(a[k]) for k in ("prompt", "epoch", "sample", "offsets")]}')
  off, tok = a['offsets'].astype(np.int64), a['tokens']
  if off[0] != 0 or off[-1] != len(tok) or np.any(np.diff(off) < 0):
    raise StoreError(f'{where}: "offsets" must rise from 0 to the {len(tok)} tokens')
  out_of_range = (a['prompt'] < 0) | (a['prompt'] >= len(prompts))
  if out_of_range.any():
    raise StoreError(f'{where}: a response names prompt index '
                     f'{int(a["prompt"][np.argmax(out_of_range)])}, not one of the header\'s '
                     f'{len(prompts)}')
  if len(tok) and (tok.min() < 0 or tok.max() >= _TOKEN_LIMIT):
    bad = int(np.argmax((tok < 0) | (tok >= _TOKEN_LIMIT)))
    row = int(np.searchsorted(off, bad, side='right')) - 1
    raise StoreError(f'{where}: prompt {prompts[int(a["prompt"][row])]!r}: token {int(tok[bad])} '
                     f'is not a token id in [0, {_TOKEN_LIMIT})')
  tok = tok.astype(np.int32)
  tok.flags.writeable = False
  data: Responses = {}
  for i, e, s, lo, hi in zip(a['prompt'].tolist(), a['epoch'].tolist(), a['sample'].tolist(),
                             off[:-1].tolist(), off[1:].tolist(), strict=True):
    p = prompts[i]
    if e < 0 or s < 0:
      raise StoreError(f'{where}: prompt {p!r}: epoch {e} sample {s} is negative')
    d = data.setdefault(p, {}).setdefault(e, {})
    if s in d:
      raise StoreError(f'{where}: prompt {p!r} epoch {e} holds sample {s} twice')
    d[s] = tok[lo:hi]
  return data


# ----------------------------------------------------------------------------- drafting


class SourceIndex:
  """One source's tokens and where each of its `n`-grams occurs: n-gram -> the positions of the
  tokens that followed it, oldest first. A gram is indexed once a token follows it, so every
  position found drafts at least one token. `extend` indexes what a growing source (a sibling)
  appended: one dict update per new token. Memory: a list slot, an int and (for a new gram) a
  tuple and a dict entry per token, some 100-200 bytes in CPython."""

  __slots__ = ('n', 'tokens', 'grams')

  def __init__(self, tokens=(), n: int = MIN_MATCH):
    if n < 1:
      raise ValueError(f'min_match must be >= 1, got {n}')
    self.n = n
    self.tokens: list[int] = []
    self.grams: dict[tuple[int, ...], list[int]] = {}
    self.extend(tokens)

  def __len__(self):
    return len(self.tokens)

  def extend(self, new) -> None:
    t, grams, n = self.tokens, self.grams, self.n
    start = len(t)
    t.extend(new.tolist() if isinstance(new, np.ndarray) else map(int, new))
    for p in range(max(n, start), len(t)):
      g = tuple(t[p - n:p])
      where = grams.get(g)
      if where is None:
        grams[g] = [p]
      else:
        where.append(p)


def _match(ctx: list[int], sources: Iterable[SourceIndex], n: int, max_match: int,
           max_candidates: int) -> tuple[SourceIndex, int] | None:
  """The source and position that follow the longest suffix of `ctx` (at least `n`, at most
  `max_match` tokens) among the latest `max_candidates` occurrences of its last `n` tokens in
  each source; `sources` most recent first, and on equal lengths the earlier source (then its
  later occurrence) wins. None where no source holds the last `n` tokens."""
  if len(ctx) < n:
    return None
  g = tuple(ctx[-n:])
  limit = min(max_match, len(ctx))
  best: tuple[SourceIndex, int] | None = None
  best_len = n - 1
  for src in sources:
    where = src.grams.get(g)
    if where is None:
      continue
    toks = src.tokens
    for p in reversed(where[-max_candidates:]):
      top = min(limit, p)
      if best_len >= top:
        continue  # this occurrence cannot beat the match in hand
      if toks[p - top:p] == ctx[-top:]:  # the whole window matches: one compare in C
        length = top
      else:
        length = n
        while toks[p - length - 1] == ctx[-length - 1]:  # stops before `top`: that one differs
          length += 1
      if length > best_len:
        best, best_len = (src, p), length
        if length == limit:
          return best  # nothing longer exists, and later sources are older
  return best


def _check(max_draft: int, min_match: int, max_match: int, max_candidates: int) -> None:
  if max_draft < 0 or min_match < 1 or max_match < min_match or max_candidates < 1:
    raise ValueError(f'need max_draft >= 0, 1 <= min_match <= max_match and max_candidates >= 1, '
                     f'got max_draft={max_draft} min_match={min_match} max_match={max_match} '
                     f'max_candidates={max_candidates}')


def draft(context_tokens, sources: Sequence, max_draft: int, min_match: int = MIN_MATCH, *,
          max_match: int = MAX_MATCH, max_candidates: int = MAX_CANDIDATES) -> np.ndarray:
  """One row's draft: up to `max_draft` tokens that followed, in one of `sources`, the longest
  suffix of `context_tokens` (at least `min_match`, compared over its last `max_match` tokens)
  that occurs there with a token after it; on equal lengths the most recent source wins.
  `sources`: token arrays or SourceIndex (built with n=min_match), oldest first (as
  ResponseStore.responses, then the siblings). Empty (int32) where nothing matches.
  Cost: an array source is indexed here, O(its length); a SourceIndex is not, so a caller that
  drafts again from the same sources keeps their indexes (Drafter does). Then one dict lookup per
  source and at most `max_candidates` suffix compares of <= `max_match` tokens each; the longest
  match is sought among each source's latest `max_candidates` occurrences of the last
  `min_match` tokens."""
  _check(max_draft, min_match, max_match, max_candidates)
  indexed = []
  for s in sources:
    if not isinstance(s, SourceIndex):
      s = SourceIndex(np.asarray(s), min_match)
    elif s.n != min_match:
      raise ValueError(f'a SourceIndex of {s.n}-grams given to draft with min_match={min_match}')
    indexed.append(s)
  ctx = np.asarray(context_tokens)[-max_match:].tolist()
  hit = _match(ctx, reversed(indexed), min_match, max_match, max_candidates)
  if hit is None or max_draft == 0:
    return _EMPTY
  src, p = hit
  return np.asarray(src.tokens[p:p + max_draft], np.int32)


class DraftRow(NamedTuple):
  """A live row asking for a draft (a plain tuple in this order will do)."""
  seq: int  # its sequence id (Seq.seq_id): how its siblings name it
  prompt_id: str
  tokens: np.ndarray | Sequence[int]  # its response tokens so far, which only grow between calls
  siblings: Sequence[int]  # the seq ids of its prompt's other samples this step


# a DraftRow as a plain tuple: (seq, prompt_id, tokens, siblings)
RowTuple = tuple[int, str, np.ndarray | Sequence[int], Sequence[int]]


class Drafter:
  """The drafts of one rollout step: each sequence's tokens are indexed as they grow (it drafts
  from them and its siblings draft from them), each prompt's stored responses once, when a row of
  the prompt first drafts; responses added to the store afterwards are not seen (one Drafter per
  step). draft_rows drafts a dispatch's rows in one call.
  Cost per row and call: indexing its new tokens (one dict update each), then one dict lookup per
  source (its prompt's stored responses and the siblings named) and at most `max_candidates`
  compares of <= `max_match` tokens per source that holds its last `min_match` tokens; a
  prompt's stored responses are indexed once, O(their tokens). No source is scanned per row.
  Memory: SourceIndex's, per indexed token; `drop` frees a prompt whose samples all finished."""

  def __init__(self, store: ResponseStore | None = None, *, min_match: int = MIN_MATCH,
               max_match: int = MAX_MATCH, max_candidates: int = MAX_CANDIDATES):
    _check(0, min_match, max_match, max_candidates)
    self.store = store
    self.min_match, self.max_match, self.max_candidates = min_match, max_match, max_candidates
    self._stored: dict[str, list[SourceIndex]] = {}  # prompt -> its stored responses, oldest first
    self._seqs: dict[int, SourceIndex] = {}
    self._prompt_of: dict[int, str] = {}

  def update(self, seq: int, prompt_id: str, tokens: np.ndarray | Sequence[int]) -> None:
    """Index sequence `seq`'s tokens so far (draft_rows does this for its rows; a caller adds a
    finished sibling's last tokens here). Tokens only grow; fewer than indexed (the sequence
    started over) rebuilds its index. ValueError when `seq` was given for another prompt."""
    idx = self._seqs.get(seq)
    if idx is None:
      self._seqs[seq] = idx = SourceIndex((), self.min_match)
      self._prompt_of[seq] = prompt_id
    elif self._prompt_of[seq] != prompt_id:
      raise ValueError(f'sequence {seq} is of prompt {self._prompt_of[seq]!r}, not {prompt_id!r}')
    if len(tokens) < len(idx):
      self._seqs[seq] = idx = SourceIndex((), self.min_match)
    idx.extend(tokens[len(idx):])

  def draft_rows(self, rows: Iterable[DraftRow | RowTuple], max_draft: int) -> list[np.ndarray]:
    """One draft per row (int32, at most `max_draft` tokens, empty where nothing matches), as
    `draft` with the row's sources: its prompt's stored responses (oldest epoch first), then
    its siblings in the order named (the last the most recent). Every row's tokens are indexed
    before any drafts, so a row finds what its siblings wrote up to this call."""
    _check(max_draft, self.min_match, self.max_match, self.max_candidates)
    rows = [DraftRow._make(r) for r in rows]  # plain tuples too
    for r in rows:
      self.update(r.seq, r.prompt_id, r.tokens)
    out = []
    for r in rows:
      sources = []
      for s in reversed(r.siblings):
        idx = self._seqs.get(s)
        if idx is None or s == r.seq:
          continue  # not started yet: nothing to draft from
        if self._prompt_of[s] != r.prompt_id:
          raise ValueError(f'sequence {r.seq} (prompt {r.prompt_id!r}) names sequence {s} of '
                           f'prompt {self._prompt_of[s]!r} as its sibling')
        sources.append(idx)
      sources.extend(reversed(self._stored_of(r.prompt_id)))
      ctx = self._seqs[r.seq].tokens[-self.max_match:]
      hit = _match(ctx, sources, self.min_match, self.max_match, self.max_candidates)
      if hit is None or max_draft == 0:
        out.append(_EMPTY)
      else:
        src, p = hit
        out.append(np.asarray(src.tokens[p:p + max_draft], np.int32))
    return out

  def prepare(self, prompt_ids: Iterable[str]) -> None:
    """Index these prompts' stored responses now, O(their tokens), e.g. while the step's prompts
    prefill, rather than in the first dispatch that drafts for them."""
    for p in prompt_ids:
      self._stored_of(p)

  def _stored_of(self, prompt_id: str) -> list[SourceIndex]:
    idx = self._stored.get(prompt_id)
    if idx is None:
      responses = self.store.responses(prompt_id) if self.store is not None else []
      idx = self._stored[prompt_id] = [SourceIndex(v, self.min_match) for v in responses]
    return idx

  def drop(self, prompt_id: str) -> None:
    """Free a prompt's indexes (its stored responses and its sequences): its rows are done."""
    self._stored.pop(prompt_id, None)
    for s in [s for s, p in self._prompt_of.items() if p == prompt_id]:
      del self._seqs[s], self._prompt_of[s]
