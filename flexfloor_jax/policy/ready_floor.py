"""Releases only onto compiled meshes: the release policy restricted to the mesh sizes whose
executables are ready, with an account of what waiting for the others cost (numpy only)."""

from __future__ import annotations

import copy
import logging


def held_summary(policy) -> dict:
  """summary.json's account of releases held back by compiles not ready (zeros when none)."""
  held = policy if isinstance(policy, ReadyFloor) else None
  return dict(
      releases_held_for_compile_steps=held.held_steps if held else 0,
      releases_held_for_compile={str(k): v for k, v in held.held_by_size.items()} if held else {},
      releases_held_for_compile_device_steps=held.held_device_steps if held else 0)


def warn_held(summary: dict) -> None:
  """A warning when releases were held back by compiles (summary: held_summary's fields)."""
  if summary["releases_held_for_compile_steps"]:
    logging.getLogger(__name__).warning(
        "releases held back %d steps waiting for compiles: %s (%d device-steps); "
        "--config.rollout.wait_compiles=true compiles every size before the first step",
        summary["releases_held_for_compile_steps"],
        ", ".join(f"size {k} for {v} steps" for k, v in sorted(
            summary["releases_held_for_compile"].items(), key=lambda kv: -int(kv[0]))),
        summary["releases_held_for_compile_device_steps"])


class ReadyFloor:
  """The release policy, allowed only the mesh sizes already compiled (a release never waits
  for a compile), which also counts what that costs: while some size is not ready, each decision
  asks a copy of the unrestricted policy too, and for as long as that one would have shrunk the
  group further, the steps count against the size it wanted (`held_by_size`) and the extra
  active workers against `held_device_steps`."""

  def __init__(self, policy, steps, n: int, sizes):
    self._policy, self._steps, self._n = policy, steps, n
    self._sizes = list(sizes)  # the smaller meshes a release may leave
    self._full = (policy.floor, policy.sizes)
    self._all_ready = not self._sizes
    self._hold = None  # (step, wanted size, size kept) while a release is held back
    self.held_steps = 0
    self.held_device_steps = 0
    self.held_by_size: dict[int, int] = {}

  def _restrict(self) -> bool:
    """Allow only compiled sizes; False once every size is (the policy is then unrestricted)."""
    if self._all_ready:
      return False
    ready = [m for m in self._sizes if self._steps.ready(m)]
    if len(ready) == len(self._sizes):
      self._all_ready = True
      self._policy.floor, self._policy.sizes = self._full
      return False
    ok = sorted({*ready, self._n}, reverse=True)
    self._policy.floor, self._policy.sizes = ok[-1], tuple(ok)
    return True

  def _close(self, step: int):
    if self._hold is not None:
      s0, want, kept = self._hold
      self.held_steps += step - s0
      self.held_device_steps += (kept - want) * (step - s0)
      self.held_by_size[want] = self.held_by_size.get(want, 0) + step - s0
      self._hold = None

  def stop_masks(self, st):
    if not self._restrict():
      return self._policy.stop_masks(st)
    # stop when the unrestricted policy would: a size that became ready is used at once
    floor, sizes = self._policy.floor, self._policy.sizes
    self._policy.floor, self._policy.sizes = self._full
    try:
      return self._policy.stop_masks(st)
    finally:
      self._policy.floor, self._policy.sizes = floor, sizes

  def plan(self, st):
    self._close(st.step)
    if not self._restrict():
      return self._policy.plan(st)
    probe = copy.deepcopy(self._policy)
    probe.floor, probe.sizes = self._full
    want, got = probe.plan(st), self._policy.plan(st)

    def size(p):
      return len(st.active) if p is None or p.new_active is None else len(p.new_active)

    if size(want) < size(got):
      self._hold = (st.step, size(want), size(got))
    return got

  def finish(self, timeline):
    """Close a hold still open when the rollout ended."""
    self._close(timeline.num_steps)

  def __getattr__(self, name):
    return getattr(self._policy, name)
