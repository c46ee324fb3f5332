"""Tokenizers: a byte-level one for the tiny preset (no files needed) and a wrapper around a
checkpoint's tokenizer.json (`tokenizers` library, local file only, never the hub)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as _Tok

from flexfloor_jax.model.checkpoint_format import CheckpointError
from flexfloor_jax.model.config import BYTE_VOCAB


class Tokenizer(Protocol):
  # read-only: a tokenizer whose ids are always set (ByteTokenizer's ints) is one too
  @property
  def vocab_size(self) -> int: ...

  @property
  def bos_id(self) -> int | None: ...

  @property
  def eos_id(self) -> int | None: ...

  @property
  def pad_id(self) -> int | None: ...

  def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes 0..255 plus pad=256, bos=257, eos=258 (PRESETS['tiny'] bos_id / eos_id)."""

  vocab_size = BYTE_VOCAB
  pad_id = 256
  bos_id = 257
  eos_id = 258

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [self.bos_id] + ids if add_bos else ids

  def decode(self, ids: Sequence[int]) -> str:
    """Specials and out-of-range ids are skipped; invalid UTF-8 (a sampled byte soup) becomes
    U+FFFD instead of raising."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A checkpoint directory's tokenizer.json. bos/eos come from the model config (config.json is
  what the model was trained with); pad is the tokenizer's if it defines one."""

  def __init__(self, path: str, bos_id: int | None = None, eos_id: int | None = None):
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
      self._tok = _Tok.from_file(file)
    except Exception as e:  # the tokenizers library raises its own untyped errors
      msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise CheckpointError(f"{file}: cannot read the tokenizer ({msg})") from None
    with open(file, "rb") as f:  # what its token ids mean: the file's content, not its path
      self.digest = hashlib.sha256(f.read()).hexdigest()[:16]
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.bos_id = bos_id if bos_id is not None and bos_id >= 0 else None
    self.eos_id = eos_id if eos_id is not None and eos_id >= 0 else None
    self.pad_id = None
    if self._tok.padding is not None:
      self.pad_id = self._tok.padding.get("pad_id")

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    # add_special_tokens=False: the post-processor would add bos on its own; we decide here.
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(checkpoint_dir: str, cfg) -> Tokenizer | None:
  """tokenizer.json in the checkpoint dir -> HFTokenizer; the byte vocabulary (259) ->
  ByteTokenizer; otherwise None (prompts must then be token ids)."""
  if checkpoint_dir and os.path.isfile(os.path.join(checkpoint_dir, "tokenizer.json")):
    return HFTokenizer(checkpoint_dir, bos_id=cfg.bos_id, eos_id=cfg.eos_id)
  if cfg.vocab_size == BYTE_VOCAB:
    return ByteTokenizer()
  return None


def tokenizer_identity(tokenizer: Tokenizer | None, cfg) -> str:
  """What a token id means, as a key for files of token ids kept across runs (the response
  store): the byte vocabulary, a tokenizer.json's content, or, where prompts come as ids, the
  vocabulary size alone."""
  if isinstance(tokenizer, ByteTokenizer):
    return "byte"
  if isinstance(tokenizer, HFTokenizer):
    return f"hf:{tokenizer.digest}"
  return f"ids:{cfg.vocab_size}"
