"""The compiled programs that move expert slots and sequence rows: SPMD extract / insert per mesh
(compile_movers, compiled with each StepSet) and single-device take / put per device (SlotMovers,
RowMovers; PageMovers for the pages of a paged KV pool, and their SPMD form compile_page_movers).
elastic.py decides nothing either: it runs these for a release or a migration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.runtime import mesh as mesh_lib


def _row_axis_of(name: str) -> int:
  """Row (sharded) axis of each moved leaf: cache k/v, the sliding layers' rings and experts
  carry a leading layer axis."""
  return 1 if name in ("k", "v", "k_ring", "v_ring", *tfm.EXPERT_ARRAYS) else 0


def _extract_local(tree, idx_1):
  i = jnp.maximum(idx_1[0], 0)
  return {name: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=_row_axis_of(name))
          for name, a in tree.items()}


def _insert_local(tree, rows, idx_1):
  out = {}
  for name, a in tree.items():
    ax = _row_axis_of(name)
    i = jnp.where(idx_1[0] >= 0, idx_1[0], a.shape[ax])  # out of range: dropped (no-op)
    index = (slice(None),) * ax + (i,)
    out[name] = a.at[index].set(jax.lax.index_in_dim(rows[name], 0, ax, keepdims=False),
                                mode="drop")
  return out


def compile_movers(stepset) -> dict:
  """extract/insert executables for expert slots ("experts") and for sequence rows (the decode
  state, "rows") on this mesh, and the abstract arrays one extract returns ("taken_*")."""
  mesh = stepset.mesh
  w = mesh_lib.batch_spec(1)  # one mover index per worker
  idx_abs = jax.ShapeDtypeStruct((mesh.size,), jnp.int32, sharding=mesh_lib.named(mesh, w))
  out = {}
  groups = {"experts": stepset.abstract_experts, "rows": stepset.abstract_state.row_dict()}
  for group, tree in groups.items():
    specs = {k: v.sharding.spec for k, v in tree.items()}
    ext = jax.jit(jax.shard_map(_extract_local, mesh=mesh, in_specs=(specs, w), out_specs=specs,
                                check_vma=False))
    taken_abs = jax.eval_shape(ext, tree, idx_abs)
    taken_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tree[k].sharding)
                 for k, v in taken_abs.items()}
    ins = jax.jit(jax.shard_map(_insert_local, mesh=mesh, in_specs=(specs, specs, w),
                                out_specs=specs, check_vma=False), donate_argnums=0)
    out[f"extract_{group}"] = ext.lower(tree, idx_abs).compile()
    out[f"insert_{group}"] = ins.lower(tree, taken_abs, idx_abs).compile()
    out[f"taken_{group}"] = taken_abs
  # No placeholder buffers per mesh: a mover that needs filler rows takes them from its own
  # extract, so a mesh's build leaves nothing on its devices that the memory floor does not count.
  return out


def _take_pages(pools, ids):
  """The pages `ids` of each pool [L, K, num_pages, ...] (ids >= num_pages: the last page)."""
  return {k: jnp.take(x, jnp.clip(ids, 0, x.shape[2] - 1), axis=2) for k, x in pools.items()}


def _put_pages(pools, pages, ids):
  """`pages` written at `ids` of each pool (ids >= num_pages: nothing written)."""
  return {k: x.at[:, :, ids].set(pages[k], mode="drop") for k, x in pools.items()}


def _take_pages_local(pools, ids_1M):  # one worker's row of the SPMD page ids
  return _take_pages(pools, ids_1M[0])


def _put_pages_local(pools, pages, ids_1M):
  return _put_pages(pools, pages, ids_1M[0])


# A multi-controller migration sends a sequence's pages in blocks of a quarter of a full
# sequence: at most that much padding per move, in at most 4 rounds, one block shape to compile.
PAGE_BLOCKS_PER_SEQ = 4


def page_block(pages_per_seq: int) -> int:
  """Pages per worker in one SPMD page move (compile_page_movers)."""
  return -(-pages_per_seq // PAGE_BLOCKS_PER_SEQ)


def compile_page_movers(stepset) -> dict:
  """Paged KV, multi-controller: SPMD extract / insert of a block of page_block pages per
  worker on this mesh. Page ids [N, page_block], one row per worker (local ids; entries >=
  num_pages are padding: extract reads the last page, insert writes nothing)."""
  mesh = stepset.mesh
  pools = stepset.abstract_state.page_dict()
  specs = {k: v.sharding.spec for k, v in pools.items()}
  w = mesh_lib.batch_spec(2)
  ids_abs = jax.ShapeDtypeStruct((mesh.size, page_block(stepset.spec.pages_per_seq)), jnp.int32,
                                 sharding=mesh_lib.named(mesh, w))
  ext = jax.jit(jax.shard_map(_take_pages_local, mesh=mesh, in_specs=(specs, w),
                              out_specs=specs, check_vma=False))
  taken_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=pools[k].sharding)
               for k, v in jax.eval_shape(ext, pools, ids_abs).items()}
  ins = jax.jit(jax.shard_map(_put_pages_local, mesh=mesh, in_specs=(specs, specs, w),
                              out_specs=specs, check_vma=False), donate_argnums=0)
  return {"extract_pages": ext.lower(pools, ids_abs).compile(),
          "insert_pages": ins.lower(pools, taken_abs, ids_abs).compile()}


class SlotMovers:
  """Single-device movers of expert slots, for one device's shard {name: [L, S, ...]}: only the
  devices an expert leaves or joins run anything (an SPMD step costs every device of the mesh a
  launch, which on emulated devices is most of a release). A taken slot is one flat buffer
  holding all its weights: one transfer per moved expert."""

  def __init__(self, shard_abstract: dict, device: mesh_lib.Device, slots: int):
    sh = SingleDeviceSharding(device)
    tree = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)
            for k, v in shard_abstract.items()}
    idx = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
    # (traced dicts iterate in sorted key order: so do the offsets)
    row_shapes = {k: (v.shape[0], 1) + v.shape[2:] for k, v in sorted(tree.items())}
    ends = np.cumsum([int(np.prod(r)) for r in row_shapes.values()])

    def take(t, i):
      return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, i, 1, axis=1).reshape(-1)
                              for x in t.values()])

    def put(t, row, i):
      parts = jnp.split(row, ends[:-1])
      return {k: jax.lax.dynamic_update_slice_in_dim(x, p.reshape(row_shapes[k]), i, axis=1)
              for (k, x), p in zip(t.items(), parts, strict=True)}

    self.take = jax.jit(take).lower(tree, idx).compile()
    row = jax.ShapeDtypeStruct((int(ends[-1]),), next(iter(tree.values())).dtype, sharding=sh)
    self.put = jax.jit(put, donate_argnums=0).lower(tree, row, idx).compile()
    # Slot indices already on the device (a host scalar would cost a transfer per call).
    self.slot = [jax.device_put(np.int32(s), device) for s in range(slots)]
    # First executions compile XLA:CPU kernels: run both once here, on placeholders.
    t = {k: jnp.zeros(v.shape, v.dtype, device=sh) for k, v in tree.items()}
    jax.block_until_ready(self.put(t, self.take(t, self.slot[0]), self.slot[0]))


class RowMovers:
  """Single-device movers of sequence rows (compaction), for one device's shard of the decode
  state {name: [.., B, ..]} (row axis per `_row_axis_of`): a migrated sequence costs a
  `take` on its source device, one transfer and a `put` on its destination, instead of an SPMD
  extract and insert on every device of the mesh per round."""

  def __init__(self, shard_abstract: dict, device: mesh_lib.Device, rows: int):
    sh = SingleDeviceSharding(device)
    tree = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)
            for k, v in shard_abstract.items()}
    idx = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)

    def take(t, i):
      return {k: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=_row_axis_of(k)) for k, x in t.items()}

    def put(t, row, i):
      return {k: jax.lax.dynamic_update_slice_in_dim(x, row[k], i, axis=_row_axis_of(k))
              for k, x in t.items()}

    self.take = jax.jit(take).lower(tree, idx).compile()
    row_abs = jax.eval_shape(take, tree, idx)
    row_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in row_abs.items()}
    self.put = jax.jit(put, donate_argnums=0).lower(tree, row_abs, idx).compile()
    self.slot = [jax.device_put(np.int32(r), device) for r in range(rows)]
    t = {k: jnp.zeros(v.shape, v.dtype, device=sh) for k, v in tree.items()}
    jax.block_until_ready(self.put(t, self.take(t, self.slot[0]), self.slot[0]))


class PageMovers:
  """Single-device movers of a paged KV pool's pages, for one device's shard {k_pages, v_pages:
  [L, K, num_pages, page_size, D]}: `take(pool, ids)` cuts out the pages `ids` [M] (entries
  >= num_pages: padding, read as the last page), `put(pool, pages, ids)` writes them at `ids`
  (padding entries write nothing) and donates the pool. A migrated sequence moves only its live
  pages, into the page ids its destination's page table names."""

  def __init__(self, shard_abstract: dict, device: mesh_lib.Device, pages_per_seq: int):
    sh = SingleDeviceSharding(device)
    tree = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)
            for k, v in shard_abstract.items()}
    ids = jax.ShapeDtypeStruct((pages_per_seq,), jnp.int32, sharding=sh)
    self.device, self.pages_per_seq = device, pages_per_seq
    self.num_pages = next(iter(tree.values())).shape[2]

    self.take = jax.jit(_take_pages).lower(tree, ids).compile()
    pages_abs = jax.eval_shape(_take_pages, tree, ids)
    pages_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)
                 for k, v in pages_abs.items()}
    self.put = jax.jit(_put_pages, donate_argnums=0).lower(tree, pages_abs, ids).compile()
    t = {k: jnp.zeros(v.shape, v.dtype, device=sh) for k, v in tree.items()}
    i0 = self.ids([0])
    jax.block_until_ready(self.put(t, self.take(t, i0), i0))

  def ids(self, pages) -> jax.Array:
    """Page ids [M] on this device, padded with num_pages (writes nothing)."""
    out = np.full((self.pages_per_seq,), self.num_pages, np.int32)
    out[:len(pages)] = pages
    return jax.device_put(out, self.device)
