"""`ragged_all_to_all` with the signature and semantics of `jax.lax.ragged_all_to_all`, and a
pure-JAX reference of it for backends that lack the collective (XLA:CPU).

Semantics (as documented for `jax.lax.ragged_all_to_all`): the K = N * slices_per_device slices
are grouped by destination, slice i going to worker i // (K / N). The caller sends
operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]; `output_offsets[i]` is where that
slice lands in the *receiver's* buffer (the sender's view of the receiver). A receiver writes the
slice it gets from worker j's slice list into `output` at the offset j chose, `recv_sizes[i]` rows
long; every other row of `output` keeps its value.

impl='reference' builds this from one padded `all_to_all` (every slice padded to the largest size
it can have, min(operand rows, output rows)) and a scatter of the received rows into `output`.
impl='native' is `jax.lax.ragged_all_to_all` (TPU, GPU). impl='auto' picks the reference on CPU
and the native op elsewhere through `lax.platform_dependent`: only the branch of the platform being
lowered is lowered, so CPU never meets the native op it cannot compile.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, impl: str = "auto"):
  """See the module docstring. Must run inside a mapped context over `axis_name` (shard_map)."""
  args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
  shapes = [a.shape for a in args[2:]]
  if len(set(shapes)) != 1 or input_offsets.ndim != 1:
    raise ValueError(f"offsets and sizes must be 1-D of one length, got {shapes}")
  if operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
    raise ValueError(f"operand {operand.shape} {operand.dtype} and output {output.shape} "
                     f"{output.dtype} must agree past the leading axis")
  native = functools.partial(lax.ragged_all_to_all, axis_name=axis_name)
  reference = functools.partial(ragged_all_to_all_reference, axis_name=axis_name)
  if impl == "native":
    return native(*args)
  if impl == "reference":
    return reference(*args)
  if impl != "auto":
    raise ValueError(f"impl must be 'auto', 'native' or 'reference', got {impl!r}")
  return lax.platform_dependent(*args, cpu=reference, default=native)


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
  """Pure-JAX ragged_all_to_all: moves K x W rows where the native op moves only the sizes, W the
  largest size a slice can have (it must fit both the operand and the output)."""
  (k,) = input_offsets.shape
  n = lax.axis_size(axis_name)
  if k % n:
    raise ValueError(f"{k} slices do not split over {n} workers")
  w = min(operand.shape[0], output.shape[0])
  r_W = jnp.arange(w, dtype=jnp.int32)
  src_KW = input_offsets.astype(jnp.int32)[:, None] + r_W
  # Rows past a slice's size travel as padding and are dropped on arrival.
  rows = jnp.take(operand, jnp.clip(src_KW, 0, operand.shape[0] - 1), axis=0)
  # Tiled over the slice axis: worker j gets slices j*K/N .. (j+1)*K/N - 1 of every worker, in
  # worker order, which is the order recv_sizes and the all_to_all'd output_offsets use.
  rows = lax.all_to_all(rows, axis_name, 0, 0, tiled=True)
  offsets = lax.all_to_all(output_offsets.astype(jnp.int32), axis_name, 0, 0, tiled=True)
  dst_KW = offsets[:, None] + r_W
  # Out-of-range index (not -1, which a scatter would wrap to the last row): dropped.
  dst_KW = jnp.where(r_W < recv_sizes.astype(jnp.int32)[:, None], dst_KW, output.shape[0])
  return output.at[dst_KW.reshape(-1)].set(rows.reshape((k * w,) + output.shape[1:]), mode="drop")
