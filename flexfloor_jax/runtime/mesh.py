"""The `ep` mesh and the one table from logical axis names to mesh axes.

Model code names logical axes ('batch', 'expert', ...) and asks this module for mesh axes; no other
module spells a physical axis name, nor writes a PartitionSpec: every spec of the package's own
layouts comes from the helpers here (`logical_spec`, `batch_spec`, `replicated_spec`, and
`tree_specs` for a params tree from its logical axes, `model.transformer.param_logical_axes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

EP_AXIS = "ep"

# The class of jax.devices()' items. jaxlib defines it in a compiled module that ships no type
# stubs, so the type checker cannot take `jax.Device` as a class: annotations name this alias.
Device: TypeAlias = jax.Device  # type: ignore[reportInvalidTypeForm]

# Logical axis -> mesh axis (None = replicated). DP attention + EP: sequences and expert slots are
# split over the workers, everything else is replicated.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
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


def mesh_axis(logical: str) -> str | None:
  return LOGICAL_AXIS_RULES[logical]


def logical_spec(*logical: str | None) -> P:
  """PartitionSpec for an array whose dims carry these logical names (None = not sharded)."""
  return P(*(None if name is None else mesh_axis(name) for name in logical))


def replicated_spec() -> P:
  """PartitionSpec of an array every worker holds whole."""
  return P()


def is_replicated(spec: P) -> bool:
  """No dim of `spec` is sharded."""
  return all(a is None for a in spec)


def batch_spec(ndim: int) -> P:
  """Rows (decode slots, sequences, one row per worker) split over the workers; other dims
  whole."""
  return logical_spec("batch", *([None] * (ndim - 1)))


def param_spec(*logical: str | None) -> P:
  """PartitionSpec of a parameter with these logical axes, up to its last sharded dim: P() for a
  replicated weight, P(None, 'ep') for an [L, E, ...] expert stack (the form checkpoints store)."""
  spec = list(logical_spec(*logical))
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_specs(axes_tree: Any) -> Any:
  """A tree of logical-axes tuples (one per leaf) -> the same tree of `param_spec`s."""
  return jax.tree.map(lambda ax: param_spec(*ax), axes_tree, is_leaf=_is_axes)


def tree_shardings(mesh: Mesh, spec_tree: Any) -> Any:
  """A tree of PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                      is_leaf=lambda x: isinstance(x, P))


def make_ep_mesh(devices: Sequence[Device]) -> Mesh:
  """1-D mesh over the active workers, in the given order (the release chain's tail)."""
  return jax.make_mesh((len(devices),), (EP_AXIS,), axis_types=(AxisType.Auto,),
                       devices=list(devices))


def sharding(mesh: Mesh, *logical: str | None) -> NamedSharding:
  return NamedSharding(mesh, logical_spec(*logical))


def named(mesh: Mesh, spec: P) -> NamedSharding:
  return NamedSharding(mesh, spec)


def replicated(mesh: Mesh | AbstractMesh) -> NamedSharding:
  return NamedSharding(mesh, replicated_spec())


def select_devices(num_devices: int) -> list[Device]:
  """`mesh.num_devices` (0 = all) -> the devices that are workers."""
  devs = jax.devices()
  if num_devices < 0 or num_devices > len(devs):
    raise ValueError(f"mesh.num_devices={num_devices} but {len(devs)} devices are available")
  return devs[: num_devices or len(devs)]
