"""Reading JSON and JSONL inputs with errors that name the file (and line)."""

from __future__ import annotations

import json
from collections.abc import Iterator


def read_json(path: str, what: str):
  """The JSON document in `path`; ValueError '<path>: cannot read <what>: ...' otherwise."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f'{path}: cannot read {what}: {e}') from None


def iter_jsonl(path: str) -> Iterator[tuple[int, dict]]:
  """(line number, object) of each non-blank line; ValueError '<path>:<line>: ...' otherwise."""
  try:
    f = open(path)
  except OSError as e:
    raise ValueError(f'{path}: cannot read: {e}') from e
  with f:
    for ln, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{ln}: not JSON ({e.msg})') from None
      if not isinstance(row, dict):
        raise ValueError(f'{path}:{ln}: not a JSON object: {line.strip()[:80]}')
      bad = _lone_surrogate(row)
      if bad is not None:
        raise ValueError(f'{path}:{ln}: field {bad[0]!r} is not valid Unicode text (a lone '
                         f'surrogate \\u{ord(bad[1]):04x}, which no UTF-8 tokenizer can encode)')
      yield ln, row


def _lone_surrogate(x, field=None):
  """(field, char) of the first string holding a lone UTF-16 surrogate: JSON's \\ud800 escapes
  decode to one, and encoding it later (tokenizers, output files) raises."""
  if isinstance(x, str):
    try:
      x.encode('utf-8')  # at C speed; surrogates are the only str chars UTF-8 refuses
    except UnicodeEncodeError as e:
      return field, x[e.start]
  elif isinstance(x, dict):
    for k, v in x.items():
      hit = _lone_surrogate(k, k) or _lone_surrogate(v, k if field is None else field)
      if hit:
        return hit
  elif isinstance(x, list):
    for v in x:
      hit = _lone_surrogate(v, field)
      if hit:
        return hit
  return None
