"""Reading JSONL inputs with errors that name the file and line."""

from __future__ import annotations

import json
from typing import Iterator


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
      yield ln, row
