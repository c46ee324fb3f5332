"""The length history: each prompt's response lengths by epoch (and the measured decode-step seconds
by active-group size), kept in one JSON file across runs, every value checked when it is read."""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.io.output_dir import DirLock, OutputDirError, lock_file
from flexfloor_jax.policy.controller import Seq

HISTORY_FORMAT = 'flexfloor_jax.length_history'
HISTORY_VERSION = 1
LOCK_WAIT_S = 120.0  # another run saving the same file: wait this long for its lock

log = logging.getLogger(__name__)


class HistoryError(ValueError):
  """A history file or table that cannot be used; the message names the file and the prompt."""


def lock_history(path: str) -> DirLock:
  """The lock every writer of the history file `path` holds while it reads, merges and replaces
  it: `<path>.lock` beside it (io/output_dir.lock_file, the output directories' lock), whichever
  output directory the writer publishes to. Another writer holding it: wait up to LOCK_WAIT_S,
  then HistoryError; a lock left by a killed writer is taken over with a warning."""
  return lock_beside(path, 'length history', HistoryError)


def lock_beside(path: str, what: str, error: type[Exception]) -> DirLock:
  """`<path>.lock` for a file that runs sharing it read, merge and replace (`what`: its name in
  messages); failures raise `error`."""
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # as the save would
  except OSError as e:
    raise error(f'{what} {path}: cannot create its directory: {e}') from None
  try:
    return lock_file(path, path + '.lock', what, lambda pid, where: (
        f'{what} {path} is being saved by pid {pid}{where} for more than '
        f'{LOCK_WAIT_S:.0f} s (lock file {path}.lock)'), wait_s=LOCK_WAIT_S)
  except OutputDirError as e:
    raise error(str(e)) from None


class LengthHistory:
  """prompt id -> epoch -> response lengths of its samples."""

  def __init__(self, data: dict[str, dict[int, list[int]]] | None = None,
               step_seconds: dict[int, float] | None = None, model: str | None = None):
    self.data = {p: {int(e): list(map(int, v)) for e, v in d.items()}
                 for p, d in (data or {}).items()}
    # median decode-step seconds by active-group size, measured by the engine (policy.costs)
    self.step_seconds = {int(n): float(t) for n, t in (step_seconds or {}).items()}
    # Identity of the model whose responses these are (model.config.model_identity): saved with
    # the file, so that one model's lengths never steer another model's schedule unnoticed.
    self.model = model
    # What the file held when loaded (or last saved): what differs is this run's own, and wins
    # over the file's when saved; the rest of the file is kept (save).
    self._base: dict[tuple[str, int], list[int]] = {}
    self._base_steps: dict[int, float] = {}

  def _mark_saved(self) -> None:
    self._base = {(p, e): list(v) for p, d in self.data.items() for e, v in d.items()}
    self._base_steps = dict(self.step_seconds)

  def add_step_seconds(self, table: dict[int, float]) -> None:
    """A run's measured step times: each size measured now replaces the older figure."""
    self.step_seconds.update({int(n): float(t) for n, t in table.items()})

  def __len__(self):
    return len(self.data)

  def __contains__(self, prompt_id):
    return prompt_id in self.data

  def add(self, prompt_id: str, epoch: int, lengths) -> None:
    self.data.setdefault(str(prompt_id), {})[int(epoch)] = [int(x) for x in lengths]

  def add_rollout(self, epoch: int, seqs: list[Seq], lengths: dict[int, int]) -> None:
    """Record one rollout: lengths by seq id (e.g. Finish.num_tokens)."""
    by_prompt: dict[str, list[tuple[int, int]]] = {}
    for s in seqs:
      by_prompt.setdefault(s.prompt_id, []).append((s.sample, int(lengths[s.seq_id])))
    for p, v in by_prompt.items():
      self.add(p, epoch, [n for _, n in sorted(v)])

  def epochs(self, prompt_id: str) -> dict[int, list[int]]:
    return self.data.get(prompt_id, {})

  def all_lengths(self) -> np.ndarray:
    return np.asarray([n for d in self.data.values() for v in d.values() for n in v], float)

  def save(self, path: str, *, current: str | None = None, merge: bool = True) -> None:
    """Merged with the file as it is now, so that runs sharing one history file lose nothing:
    under a lock on the file (`<path>.lock`, io/output_dir.lock_file: another run saving waits;
    a lock left by a killed run is taken over with a warning), the file is read again and this
    run's entries (prompt, epoch) and step seconds, those added or changed since it was loaded,
    replace the file's; the file's other entries are kept. Where another run wrote the same
    prompt and epoch since, this run's values win with a warning naming the file and the count.
    A file recorded for another model is replaced, with a warning. Atomic: a temp file in the
    same directory, fsync, os.replace; a crash leaves the old file.
    `current`: the file to merge with when `path` is a new copy of it (the rollout's history.json
    staged beside its outputs): the caller holds lock_history(current) until the copy replaces
    it. Raises OSError, or HistoryError when the file cannot be locked or became unreadable.
    `merge=False`: the file becomes exactly this history (a trainer resuming from a checkpoint
    drops the epochs the file recorded after it), still under the lock."""
    if current is not None:
      self._save_merged(path, current, merge)
      return
    with lock_history(path):
      self._save_merged(path, path, merge)

  def _save_merged(self, path: str, current: str, merge: bool = True) -> None:
    data, steps, model = self._read_current(current) if merge else ({}, {}, None)
    conflicts = 0
    for p, d in self.data.items():
      for e, v in d.items():
        base = self._base.get((p, e))
        theirs = data.get(p, {}).get(e)
        if v == base and theirs is not None:
          continue  # unchanged by this run: the file's (maybe newer) value stands
        if theirs is not None and theirs != v and theirs != base:
          conflicts += 1
        data.setdefault(p, {})[e] = list(v)
    if conflicts:
      log.warning('length history %s: another run saved %d of the entries (prompt, epoch) this '
                  'run wrote, with other lengths, since this run loaded it: this run\'s replace '
                  'them', current, conflicts)
    for n, t in self.step_seconds.items():
      if self._base_steps.get(n) != t or n not in steps:
        steps[n] = t
    doc = {'format': HISTORY_FORMAT, 'version': HISTORY_VERSION,
           'prompts': {p: {str(e): v for e, v in sorted(d.items())} for p, d in data.items()},
           'step_seconds': {str(n): t for n, t in sorted(steps.items())}}
    if self.model is not None or model is not None:
      doc['model'] = self.model if self.model is not None else model
    atomic_write(path, json.dumps(doc), durable=True)
    self._mark_saved()

  def _read_current(self, path: str):
    """The history file as it is now, to merge with: (prompts, step seconds, model), read and
    checked by `load`; empty when missing or recorded for another model (a warning: it is
    replaced)."""
    try:
      now = LengthHistory.load(path)  # no model given: the file's own, whichever it is
    except HistoryError as e:
      raise HistoryError(f'length history {path} became unreadable since this run loaded it '
                         f'({e}); not replaced: fix or remove it, this run\'s lengths were not '
                         'saved') from None
    if self.model is not None and now.model is not None and now.model != self.model:
      log.warning('length history %s was recorded for model %s, not this model (%s): replacing '
                  'it with this run\'s history (%d prompt(s) of the other model dropped)', path,
                  now.model, self.model, len(now.data))
      return {}, {}, None
    return now.data, dict(now.step_seconds), now.model

  @classmethod
  def from_table(cls, table, source: str, *, max_new_tokens: int | None = None,
                 step_seconds=None, model: str | None = None) -> LengthHistory:
    """A history from its saved "prompts" table, every value checked: each prompt's epochs are
    integers >= 0 holding non-empty lists of whole lengths in [1, max_new_tokens] (every response
    has at least its first token; max_new_tokens unchecked when None). HistoryError names
    `source` (the file) and the prompt otherwise."""
    if not isinstance(table, dict):
      raise HistoryError(f'length history {source}: "prompts" must be an object, got '
                         f'{type(table).__name__}')
    hi = max_new_tokens if max_new_tokens is not None else float('inf')
    data: dict[str, dict[int, list[int]]] = {}
    for p, d in table.items():
      where = f'length history {source}: prompt {p!r}'
      if not isinstance(d, dict):
        raise HistoryError(f'{where}: malformed entry {d!r:.80} (expected epoch -> lengths)')
      for e, v in d.items():
        try:
          epoch = int(e)
        except (TypeError, ValueError):
          raise HistoryError(f'{where}: epoch {e!r} is not an integer') from None
        if epoch < 0:
          raise HistoryError(f'{where}: epoch {epoch} is negative')
        if not isinstance(v, list) or not v:
          raise HistoryError(f'{where} epoch {epoch}: lengths must be a non-empty list, got '
                             f'{v!r:.80}')
        for x in v:
          if not (isinstance(x, (int, np.integer)) and not isinstance(x, bool)) or not 1 <= x <= hi:
            rng = ('>= 1' if max_new_tokens is None else
                   f'in [1, {max_new_tokens}] (rollout.max_new_tokens)')
            raise HistoryError(f'{where} epoch {epoch}: length {x!r} is not a whole number {rng}')
        data.setdefault(str(p), {})[epoch] = [int(x) for x in v]
    return cls(data, step_seconds, model)

  @classmethod
  def load(cls, path: str, *, max_new_tokens: int | None = None,
           model: str | None = None) -> LengthHistory:
    """Missing file -> empty history. Corrupt or foreign file, or an impossible value (a length
    outside [1, max_new_tokens], an empty list) -> HistoryError naming the path and the prompt
    (never a silent reset: that would throw away what the scheduler learned). A file recorded
    for another model than `model` -> a warning and an empty history (the file is replaced when
    this run saves); a file that records no model is taken as this model's."""
    if not os.path.exists(path):
      return cls(model=model)
    try:
      with open(path) as f:
        doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise HistoryError(f'length history {path} is unreadable or corrupt ({e}); '
                         'fix or remove it to start from an empty history') from e
    if not isinstance(doc, dict) or doc.get('format') != HISTORY_FORMAT:
      raise HistoryError(f'{path} is not a flexfloor_jax length history (format marker missing)')
    if doc.get('version') != HISTORY_VERSION:
      raise HistoryError(f'length history {path} has version {doc.get("version")!r}, '
                         f'this code reads {HISTORY_VERSION}')
    recorded = doc.get('model')
    if model is not None and recorded is not None and recorded != model:
      log.warning('length history %s was recorded for model %s, not this model (%s): starting '
                  'from an empty history; this run replaces the file when it saves', path,
                  recorded, model)
      return cls(model=model)
    try:
      steps = {int(n): float(t) for n, t in (doc.get('step_seconds') or {}).items()}
    except (AttributeError, TypeError, ValueError) as e:
      raise HistoryError(f'length history {path} has a malformed "step_seconds" table ({e})') from e
    if any(n < 1 or not np.isfinite(t) or t <= 0 for n, t in steps.items()):
      raise HistoryError(f'length history {path}: "step_seconds" needs sizes >= 1 and finite '
                         f'seconds > 0, got {steps}')
    if 'prompts' not in doc:
      raise HistoryError(f'length history {path} has no "prompts" table')
    h = cls.from_table(doc['prompts'], path, max_new_tokens=max_new_tokens, step_seconds=steps,
                       model=model if model is not None else recorded)
    h._mark_saved()
    return h
