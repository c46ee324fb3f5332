"""Dispatch plan: where each routed row goes in the padded tile layout.

The padded tile layout sorts rows by group and starts every group at a multiple of `tile_m`, so
each tile of `tile_m` rows belongs to exactly one group. Expert matmuls then run as GEMMs of one
fixed shape [tile_m, K] x [K, N], which makes a row's result independent of how many rows its group
got and of which rows share its tile (batch invariance, bitwise).

Everything here is static-shaped jnp (jittable, no Python loop over rows), so the plan is built
inside the decode step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class DispatchPlan:
  """Row maps of the padded tile layout (all int32).

  row_src: [P] source row of each padded row, -1 for padding (feeds `permute`).
  row_dst: [R] padded position of each source row, -1 if not dispatched (feeds `permute` back and
    `combine`).
  group_sizes: [G] real (unpadded) rows per group, for load statistics.
  tile_group: [P // tile_m] group of each tile; unused tiles repeat the last used group (0 if none)
    so that a weight fetch for them is valid and, on TPU, is the block already resident.
  num_tiles_used: [] number of leading tiles that hold rows; the rest are all padding.
  """

  row_src: jax.Array
  row_dst: jax.Array
  group_sizes: jax.Array
  tile_group: jax.Array
  num_tiles_used: jax.Array

  if TYPE_CHECKING:  # flax.struct.dataclass adds it (dataclasses.replace)
    def replace(self, **changes: Any) -> DispatchPlan: ...


def padded_rows(num_rows: int, num_groups: int, tile_m: int) -> int:
  """Smallest static number of padded rows that holds any assignment of `num_rows` rows.

  Each non-empty group wastes at most tile_m - 1 rows and at most min(num_groups, num_rows) groups
  are non-empty, so the tiles needed are floor((R + min(G, R) * (tile_m - 1)) / tile_m) (a sum of
  ceilings is at most the floor of the summed numerators). At least one tile is returned so that
  kernels never see a zero-sized operand.
  """
  if num_rows < 0 or num_groups <= 0 or tile_m <= 0:
    raise ValueError(f"bad sizes: rows={num_rows} groups={num_groups} tile_m={tile_m}")
  nonempty = min(num_groups, num_rows)
  tiles = (num_rows + nonempty * (tile_m - 1)) // tile_m
  return max(tiles, 1) * tile_m


def make_plan(
    group_ids_R: jax.Array, num_groups: int, tile_m: int, num_rows_padded: int
) -> DispatchPlan:
  """Builds the padded tile layout for rows with group ids `group_ids_R` (-1: not dispatched).

  Rows keep their source order inside a group (stable sort), so the plan is a deterministic function
  of the group ids. `num_rows_padded` must be a multiple of `tile_m` and at least
  `padded_rows(R_dispatched, num_groups, tile_m)`; rows that would fall past it are dropped (the
  caller's static sizing makes that impossible).
  """
  if num_rows_padded % tile_m:
    raise ValueError(f"num_rows_padded={num_rows_padded} not a multiple of tile_m={tile_m}")
  (num_rows,) = group_ids_R.shape
  num_tiles = num_rows_padded // tile_m
  gid_R = group_ids_R.astype(jnp.int32)
  valid_R = (gid_R >= 0) & (gid_R < num_groups)
  # Undispatched rows sort after every group.
  key_R = jnp.where(valid_R, gid_R, num_groups)

  group_sizes_G = jnp.bincount(key_R, length=num_groups + 1)[:num_groups].astype(jnp.int32)
  tiles_G = (group_sizes_G + tile_m - 1) // tile_m
  tile_end_G = jnp.cumsum(tiles_G)
  tile_start_G = tile_end_G - tiles_G
  start_G = jnp.cumsum(group_sizes_G) - group_sizes_G  # unpadded start of each group
  num_tiles_used = tile_end_G[-1].astype(jnp.int32)

  # Stable sort by group: position j of the sorted order holds source row order_R[j].
  order_R = jnp.argsort(key_R, stable=True).astype(jnp.int32)
  skey_R = key_R[order_R]
  svalid_R = skey_R < num_groups
  sg_R = jnp.minimum(skey_R, num_groups - 1)
  rank_R = jnp.arange(num_rows, dtype=jnp.int32) - start_G[sg_R]
  sdst_R = jnp.where(svalid_R, tile_start_G[sg_R] * tile_m + rank_R, -1)
  sdst_R = jnp.where(sdst_R < num_rows_padded, sdst_R, -1)

  row_dst_R = jnp.full((num_rows,), -1, jnp.int32).at[order_R].set(sdst_R)
  # Scatter the inverse map; index num_rows_padded (out of bounds) drops the undispatched rows.
  row_src_P = (
      jnp.full((num_rows_padded,), -1, jnp.int32)
      .at[jnp.where(sdst_R >= 0, sdst_R, num_rows_padded)]
      .set(order_R, mode="drop")
  )

  # Group of tile i: the number of groups whose tile range ends at or before i (empty groups have
  # start == end and are skipped). Unused tiles repeat the last used tile's group.
  tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
  tile_group = jnp.searchsorted(tile_end_G, tile_ids, side="right").astype(jnp.int32)
  tile_group = jnp.minimum(tile_group, num_groups - 1)
  last_used = jnp.where(
      num_tiles_used > 0, tile_group[jnp.clip(num_tiles_used - 1, 0, num_tiles - 1)], 0
  )
  tile_group = jnp.where(tile_ids < num_tiles_used, tile_group, last_used)
  return DispatchPlan(
      row_src=row_src_P,
      row_dst=row_dst_R,
      group_sizes=group_sizes_G,
      tile_group=tile_group,
      num_tiles_used=jnp.minimum(num_tiles_used, num_tiles),
  )
