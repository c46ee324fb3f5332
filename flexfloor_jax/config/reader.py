"""Reading one config section's fields, each checked as it is read: a bad value raises
ConfigError naming the field (settings.py builds the typed settings with it). No JAX."""

from __future__ import annotations

import math
import numbers
from typing import NoReturn, cast


class ConfigError(ValueError):
  """A config field with a value no run can use; the message starts with the field's name."""


REQUIRED = object()


def one_of(values) -> str:
  values = [repr(v) for v in values]
  return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


class Reader:
  """Reads and checks the fields of one config section (prefix '': the top level)."""

  def __init__(self, node, prefix: str, optional: bool = False, flag_style: bool = False):
    if node is None and not optional:
      raise ConfigError(f"{prefix}: section missing from the config")
    self.node, self.prefix, self.flag_style = node, prefix, flag_style

  def name(self, field: str) -> str:
    if self.flag_style:  # a command line's flags: named as the user typed them
      return f"--{field}"
    return f"{self.prefix}.{field}" if self.prefix else field

  def fail(self, field: str, what: str, v) -> NoReturn:
    raise ConfigError(f"{self.name(field)}: must be {what}, got {v!r}")

  def raw(self, field: str, default=REQUIRED):
    v = REQUIRED if self.node is None else self.node.get(field, REQUIRED)
    if v is REQUIRED:
      if default is REQUIRED:
        raise ConfigError(f"{self.name(field)}: missing from the config")
      return default
    return v

  def int(self, field: str, lo: int = 1, default=REQUIRED, note: str = "", *,
          hi: int | None = None) -> int:
    v = self.raw(field, default)
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
      self.fail(field, f"an integer >= {lo}{note}", v)
    if hi is not None and int(v) > hi:
      self.fail(field, f"an integer in [{lo}, {hi}]{note}", v)
    return int(v)

  def num(self, field: str, lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = False,
          hi_open: bool = False, default=REQUIRED, note: str = "") -> float:
    v = self.raw(field, default)
    real = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    x = cast(float, v)  # once `real`, a numbers.Real: it compares and converts as a float does
    ok = real and (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
    if not ok:
      iv = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open or hi == math.inf else ']'}"
      self.fail(field, f"a finite number in {iv}{note}", v)
    return float(x)

  def choice(self, field: str, choices, default=REQUIRED, note: str = "") -> str:
    v = self.raw(field, default)
    if not isinstance(v, str) or v not in choices:
      self.fail(field, f"one of {one_of(choices)}{note}", v)
    return v

  def flag(self, field: str, default=REQUIRED) -> bool:
    v = self.raw(field, default)
    if not isinstance(v, bool):
      self.fail(field, "true or false", v)
    return v

  def text(self, field: str, default=REQUIRED, nonempty: bool = False) -> str:
    v = self.raw(field, default)
    if not isinstance(v, str) or (nonempty and not v):
      self.fail(field, "a non-empty path" if nonempty else "a string", v)
    return v
