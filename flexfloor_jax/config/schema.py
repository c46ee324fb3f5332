"""The schema every entry point reads its input through: each field of a settings dataclass
declares its type, default, bounds and one-line doc once, as field metadata (`Int`, `Num`,
`Choice`, `Flag`, `Text`, `Custom`). `read` builds the dataclass from a config section or from
parsed command-line flags with one check per field; `define_absl_flags` and `add_arguments`
make a command line's flags from the same declarations; `defaults` gives the config files the
schema's defaults. No JAX.

Choices are `Literal` types where this package owns them; names defined elsewhere (the model's
kernels, the scheduler's placements) are given as `choices=`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from absl import flags

from flexfloor_jax.config.reader import REQUIRED, ConfigError, Reader

# Token ids, positions and lengths travel in the engine's int32 arrays; seeds, epochs and
# sample indices are folded into uint32 PRNG keys (a larger value wraps or overflows there).
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


def _field(kind: str, default, doc: str, **meta) -> Any:
  meta = dict(kind=kind, doc=doc, **meta)
  if default is REQUIRED:
    return dataclasses.field(metadata=meta)
  if isinstance(default, (list, dict, set)):
    raise TypeError("schema defaults are immutable values")
  return dataclasses.field(default=default, metadata=meta)


def Int(lo: int = 1, hi: int = INT32_MAX, *, default=REQUIRED, doc: str = "",
        note: str = "") -> Any:
  """An integer in [lo, hi] (a boolean is not one)."""
  return _field("int", default, doc, lo=lo, hi=hi, note=note)


def Num(lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False,
        default=REQUIRED, doc: str = "", note: str = "") -> Any:
  """A finite number in [lo, hi] (open ends as asked); an integer is taken as a number."""
  return _field("num", default, doc, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, note=note)


def Choice(choices: tuple[str, ...] | None = None, *, default=REQUIRED, doc: str = "",
           note: str = "") -> Any:
  """One of `choices`, or of the field's Literal type when None."""
  return _field("choice", default, doc, choices=choices, note=note)


def Flag(*, default=REQUIRED, doc: str = "") -> Any:
  """true or false (not 0/1, not a string)."""
  return _field("flag", default, doc)


def Text(*, default=REQUIRED, doc: str = "", nonempty: bool = False) -> Any:
  """A string (non-empty when asked: a path that must name something)."""
  return _field("text", default, doc, nonempty=nonempty)


def Custom(*, default=REQUIRED, doc: str = "") -> Any:
  """A field whose check needs more than a type and bounds: its section reads it and passes the
  value to `read`."""
  return _field("custom", default, doc)


def meta(cls, name: str) -> dict:
  return dict(next(f for f in dataclasses.fields(cls) if f.name == name).metadata)


def choices_of(cls, name: str) -> tuple[str, ...]:
  """A choice field's values: its `choices=`, else its Literal type's arguments."""
  m = meta(cls, name)
  if m.get("choices"):
    return tuple(m["choices"])
  hint = typing.get_type_hints(cls)[name]
  return tuple(typing.get_args(hint))


def default(cls, name: str):
  """The schema's default of field `name` (REQUIRED when it has none)."""
  f = next(f for f in dataclasses.fields(cls) if f.name == name)
  return REQUIRED if f.default is dataclasses.MISSING else f.default


def defaults(cls) -> dict:
  """Every field of `cls` that has a default, with it: what a config file starts a section
  from."""
  return {f.name: f.default for f in dataclasses.fields(cls)
          if f.default is not dataclasses.MISSING}


def read_field(cls, r: Reader, name: str):
  """One field of `cls` from reader `r`, checked as its metadata says."""
  m, d = meta(cls, name), default(cls, name)
  kind, note = m["kind"], m.get("note", "")
  if kind == "int":
    return r.int(name, m["lo"], hi=m["hi"], default=d, note=note)
  if kind == "num":
    return r.num(name, m["lo"], m["hi"], lo_open=m["lo_open"], hi_open=m["hi_open"], default=d,
                 note=note)
  if kind == "choice":
    return r.choice(name, choices_of(cls, name), default=d, note=note)
  if kind == "flag":
    return r.flag(name, default=d)
  if kind == "text":
    return r.text(name, default=d, nonempty=m["nonempty"])
  raise AssertionError(f"{cls.__name__}.{name}: a custom field is read by its section")


def read(cls, r: Reader, **given):
  """`cls` with each field read from `r` and checked, except the custom ones (and any other
  named in `given`), whose checked values are given."""
  values = dict(given)
  for f in dataclasses.fields(cls):
    if f.name not in values:
      values[f.name] = read_field(cls, r, f.name)
  return cls(**values)


# ----------------------------------------------------------------------------- command lines


def check_flags(cls, values: dict):
  """`cls` from parsed command-line flags (name -> value): ConfigError naming `--flag`."""
  r = Reader(values, "", flag_style=True)
  return read(cls, r, **{f.name: values[f.name] for f in dataclasses.fields(cls)
                         if f.metadata.get("kind") == "custom"})


def flag_help(cls, name: str) -> str:
  m = meta(cls, name)
  out = m["doc"]
  if m["kind"] == "choice":
    out += f" ({' | '.join(choices_of(cls, name))})"
  return out


def define_absl_flags(cls, flag_values=None) -> None:
  """One absl flag per field of `cls`, with its default and doc. Integers and numbers are
  absl's typed flags (a value that does not parse is a parse error, one line through
  config.cli.parse_flags); choices are strings, checked with the rest by `check_flags`."""
  fv = flag_values or flags.FLAGS
  for f in dataclasses.fields(cls):
    d: Any = default(cls, f.name)
    if d is REQUIRED:
      raise TypeError(f"{cls.__name__}.{f.name}: a command-line flag needs a default")
    kind, help_ = f.metadata["kind"], flag_help(cls, f.name)
    if kind == "int":
      flags.DEFINE_integer(f.name, d, help_, flag_values=fv)
    elif kind == "num":
      flags.DEFINE_float(f.name, d, help_, flag_values=fv)
    elif kind == "flag":
      flags.DEFINE_boolean(f.name, d, help_, flag_values=fv)
    else:
      flags.DEFINE_string(f.name, d, help_, flag_values=fv)


def add_arguments(cls, parser) -> None:
  """One argparse option per field of `cls` (`--name`), with its default and doc; values are
  parsed by type and then checked by `check_flags`."""
  types = {"int": int, "num": float, "text": str, "choice": str, "custom": str}
  for f in dataclasses.fields(cls):
    kind = f.metadata["kind"]
    parser.add_argument(f"--{f.name}", type=types[kind], default=default(cls, f.name),
                        help=flag_help(cls, f.name))


__all__ = ["INT32_MAX", "UINT32_MAX", "REQUIRED", "ConfigError", "Reader", "Int", "Num", "Choice",
           "Flag", "Text", "Custom", "read", "read_field", "defaults", "default", "choices_of",
           "check_flags", "define_absl_flags", "add_arguments"]
