"""The `ep` mesh and the one table from logical axis names to mesh axes.

Model code names logical axes ('batch', 'expert', ...) and asks this module for mesh axes; no other
module spells a physical axis name.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

EP_AXIS = "ep"

# Logical axis -> mesh axis (None = replicated). DP attention + EP: sequences and expert slots are
# split over the workers, everything else is replicated.
LOGICAL_AXIS_RULES: dict[str, Optional[str]] = {
    "batch": EP_AXIS,  # decode slots, KV cache rows, prompts
    "expert": EP_AXIS,  # expert slots
    "layer": None,
    "embed": None,
    "mlp": None,
    "heads": None,
    "kv_heads": None,
    "vocab": None,
    "length": None,
}


def mesh_axis(logical: str) -> Optional[str]:
  return LOGICAL_AXIS_RULES[logical]


def logical_spec(*logical: Optional[str]) -> P:
  """PartitionSpec for an array whose dims carry these logical names (None = not sharded)."""
  return P(*(None if name is None else mesh_axis(name) for name in logical))


def make_ep_mesh(devices: Sequence[jax.Device]) -> Mesh:
  """1-D mesh over the active workers, in the given order (the release chain's tail)."""
  return jax.make_mesh((len(devices),), (EP_AXIS,), axis_types=(AxisType.Auto,),
                       devices=list(devices))


def sharding(mesh: Mesh, *logical: Optional[str]) -> NamedSharding:
  return NamedSharding(mesh, logical_spec(*logical))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def select_devices(num_devices: int) -> list[jax.Device]:
  """`mesh.num_devices` (0 = all) -> the devices that are workers."""
  devs = jax.devices()
  if num_devices < 0 or num_devices > len(devs):
    raise ValueError(f"mesh.num_devices={num_devices} but {len(devs)} devices are available")
  return devs[: num_devices or len(devs)]
