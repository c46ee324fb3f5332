"""The floor: the fewest workers that still hold every expert, the live KV caches and the
in-flight workspace on each device, and the active-group sizes a release may leave above it."""

from __future__ import annotations

import math


class FloorError(ValueError):
  """The model (or a release) does not fit: below the floor, or not even on every worker."""


def expert_slots(num_experts: int, workers: int) -> int:
  """Slots each of `workers` needs so that every expert has one: ceil(E / workers)."""
  return math.ceil(num_experts / workers)


def preallocated_slots(schedule: str, num_experts: int, num_workers: int, floor: int) -> int:
  """Expert slots a worker allocates for a rollout: a flexfloor rollout may shrink to `floor`
  workers and the slots cannot grow after the start, so it allocates the floor's; the other
  schedules never shrink."""
  return expert_slots(num_experts, floor if schedule == "flexfloor" else num_workers)
def floor_workers(num_experts: int, expert_bytes: int, nonexpert_bytes: int,
                  kv_bytes_per_worker: int, device_memory_bytes: int, max_workers: int,
                  workspace_bytes: int = 0) -> int:
  """Fewest workers n such that nonexpert + ceil(E/n) expert slots + KV + workspace fit on each
  device (`workspace_bytes`: what a release or migration holds in flight on one device)."""
  def need(n):
    return (nonexpert_bytes + expert_slots(num_experts, n) * expert_bytes
            + kv_bytes_per_worker + workspace_bytes)
  for n in range(1, max_workers + 1):
    if need(n) <= device_memory_bytes:
      return n
  gib = 2.0**30
  raise FloorError(
      f'model does not fit on {max_workers} workers: each needs {need(max_workers) / gib:.2f} GiB '
      f'(non-expert {nonexpert_bytes / gib:.2f} + '
      f'{expert_slots(num_experts, max_workers)} of '
      f'{num_experts} experts x {expert_bytes / gib:.2f} + KV {kv_bytes_per_worker / gib:.2f} + '
      f'workspace {workspace_bytes / gib:.2f}) but a device has '
      f'{device_memory_bytes / gib:.2f} GiB')


def parse_release_sizes(text: str) -> str | frozenset[int] | None:
  """`scheduler.release_sizes` parsed: '' -> None (every size), 'pow2', or the set of sizes of a
  comma list. Raises ValueError naming the bad entry."""
  text = str(text).strip()
  if not text or text == 'pow2':
    return text or None
  picked = set()
  for part in text.split(','):
    try:
      m = int(part)
    except ValueError:
      raise ValueError(f"{part.strip()!r} is not 'pow2' or a comma list of sizes") from None
    if m < 1:
      raise ValueError(f'sizes must be >= 1, got {m}')
    picked.add(m)
  return frozenset(picked)


def release_sizes(text: str, num_workers: int, floor: int) -> tuple[int, ...] | None:
  """Allowed active-group sizes from `scheduler.release_sizes` (parse_release_sizes): None for
  every size; the full group and the floor are always allowed, sizes outside
  [floor, num_workers] are dropped."""
  parsed = parse_release_sizes(text)
  if parsed is None:
    return None
  # the only text parse_release_sizes returns is 'pow2'
  picked = ({1 << i for i in range(num_workers.bit_length())} if isinstance(parsed, str)
            else parsed)
  return tuple(sorted({m for m in picked if floor <= m <= num_workers} | {floor, num_workers},
                      reverse=True))
