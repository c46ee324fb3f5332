"""Carrying out a release or a migration: all their data movement (new mesh, moved experts,
reassembled decode state). `release` and `migrate` take the engine's arrays explicitly and
return the new ones; the Engine only forwards to them.

The plan (which workers go, which sequences move) comes from policy/; this module only executes
it, with transfers that can be counted:
- surviving shards (KV cache rows, slot state, expert slots, replicated weights) are reassembled
  into arrays over the smaller mesh from their existing device buffers
  (`jax.make_array_from_single_device_arrays`): no copy;
- an expert that lived on a released worker is cut out on its old device by a compiled
  single-device `take`, sent with a `jax.device_put` to its new device (the bytes counted are
  those transfers), and written into an empty slot by a compiled single-device `put` that donates
  the survivor's buffer, so the survivor's existing buffers stay where they are (multi-controller:
  SPMD `extract`/`insert` steps around a `ppermute` over the old mesh instead, `route_rows`);
- a migrated sequence (compaction) moves its KV rows and slot state the same way: a single-device
  `take`, one transfer, a donating `put` (RowMovers; multi-controller: the SPMD steps).
The SPMD movers are compiled per mesh ahead of time with the decode step (StepSet.compile), the
single-device ones per device (SlotMovers, RowMovers), both off the critical path (movers.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from flexfloor_jax.engine import movers
from flexfloor_jax.runtime import distributed
from flexfloor_jax.runtime import mesh as mesh_lib


def move_rounds(moves: Sequence[tuple]):
  """Yield `moves` ((src, src slot, dst, dst slot), in order) as rounds in which a device is at
  most once a source and once a destination, each move in the first round that has room: a
  device holds at most one taken and one received slot in flight (the floor's workspace term),
  and every process builds the same rounds from the same plan, so multi-controller transfers
  issue the same collectives in the same order."""
  pending = list(moves)
  while pending:
    rnd, rest, srcs, dsts = [], [], set(), set()
    for m in pending:
      if m[0] in srcs or m[2] in dsts:
        rest.append(m)
      else:
        rnd.append(m)
        srcs.add(m[0])
        dsts.add(m[2])
    pending = rest
    yield rnd


def move_on_devices(shards: dict, moves: Sequence[tuple], movers: dict) -> int:
  """Move expert slots (SlotMovers) or sequence rows (RowMovers) between devices: `shards` is
  {name: {device: buffer}} (updated in place), `moves` (src device, src slot, dst device, dst
  slot), `movers` {device: movers}. Source slots are left
  as they are. Returns the bytes transferred."""

  def on(d):
    return {k: b[d] for k, b in shards.items()}

  moved = 0
  for rnd in move_rounds(moves):
    rows = [movers[sd].take(on(sd), movers[sd].slot[ss]) for sd, ss, _, _ in rnd]
    sent = jax.device_put(rows, [dd for _, _, dd, _ in rnd])  # one batched transfer
    del rows
    for (_, _, dd, ds), row in zip(rnd, sent, strict=True):
      for k, b in movers[dd].put(on(dd), row, movers[dd].slot[ds]).items():
        shards[k][dd] = b
    moved += sum(x.nbytes for x in jax.tree.leaves(sent))
  return moved


def shards_by_device(arr: jax.Array) -> dict:
  return {s.device: s.data for s in arr.addressable_shards}


def assemble(by_dev: dict, sharding: NamedSharding, shape, dtype) -> jax.Array:
  """Global array over `sharding`'s mesh from the buffers {device: buffer} (no copy)."""
  mesh = sharding.mesh
  assert isinstance(mesh, Mesh)  # a concrete sharding: its mesh has devices
  devs = mesh.devices.reshape(-1)
  if jax.process_count() > 1:  # this process's devices only (maybe none: all released)
    devs = [d for d in devs if d.process_index == jax.process_index()]
  return jax.make_array_from_single_device_arrays(shape, sharding, [by_dev[d] for d in devs],
                                                  dtype=dtype)


def reassemble(arr: jax.Array, sharding: NamedSharding, shape, buffers: dict | None = None):
  """Global array over `sharding`'s mesh from the existing per-device buffers of `arr` (no copy);
  `buffers` overrides the buffer of some devices."""
  by_dev = shards_by_device(arr)
  if buffers:
    by_dev.update(buffers)
  return assemble(by_dev, sharding, shape, arr.dtype)


_route_fns: dict = {}  # (mesh, source->destination pairs, row shapes) -> compiled ppermute


def route_rows(rows: dict, dst_of_src: dict, devs: list) -> dict:
  """Multi-controller row transfer: the block at mesh position p of each array in `rows`
  (sharded one block per device over `devs`, the mesh the rows were extracted on) goes to device
  dst_of_src[p], which is in the same mesh. Returns {name: {dst device: buffer}} for this
  process's destination devices.

  One jitted shard_map `ppermute` over that mesh moves every block (gloo collectives; a plain
  device_put between devices of different processes is not implemented on CPU, and a device_put
  onto the same devices in another order aborted the process in `_different_device_order_reshard`,
  a failed check in PjRt's RemapArrays, on a mesh split unevenly over the processes).
  The ppermute's device order is the mesh's, the same on every process. Compiled once per
  (mesh, moves, shapes), then a barrier: its first collective must not start on one process
  while the other is still compiling it."""
  pos = {d: i for i, d in enumerate(devs)}
  perm = tuple(sorted((int(p), pos[d]) for p, d in dst_of_src.items()))
  names = sorted(rows)
  mesh = rows[names[0]].sharding.mesh
  key = (mesh, perm, tuple((k, rows[k].shape, rows[k].dtype, rows[k].sharding.spec)
                           for k in names))
  fn = _route_fns.get(key)
  if fn is None:
    axis = mesh.axis_names[0]
    specs = {k: rows[k].sharding.spec for k in names}

    def local(t):
      return {k: jax.lax.ppermute(x, axis, perm) for k, x in t.items()}

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=specs,
                               check_vma=False)).lower({k: rows[k] for k in names}).compile()
    distributed.sync(f"route/{mesh.size}")
    _route_fns[key] = fn
  moved = fn({k: rows[k] for k in names})
  out = {}
  for name in rows:
    held = shards_by_device(moved[name])
    out[name] = {d: held[d] for d in dst_of_src.values() if d in held}
  return out


def move_rows(stepset, group: str, tree: dict, moves: Sequence[tuple[int, int, int, int]]):
  """Move rows (src_pos, src_row, dst_pos, dst_row) within one mesh: extract on the source,
  device_put to the destination, insert there. Returns (new tree, bytes transferred).
  Moves are done in rounds (move_rounds)."""
  mesh = stepset.mesh
  devs = list(mesh.devices.reshape(-1))
  n = len(devs)
  wsh = mesh_lib.named(mesh, mesh_lib.batch_spec(1))
  rows_abs = stepset[f"taken_{group}"]
  moved_bytes = 0
  for rnd in move_rounds(moves):
    src_idx = np.full((n,), -1, np.int32)
    dst_idx = np.full((n,), -1, np.int32)
    for sp, sr, dp, dr in rnd:
      src_idx[sp] = sr
      dst_idx[dp] = dr
    rows = stepset[f"extract_{group}"](tree, jax.device_put(src_idx, wsh))
    new_rows = {}
    if jax.process_count() > 1:  # no cross-host device_put: a ppermute over the mesh instead
      routed = route_rows(rows, {sp: devs[dp] for sp, _, dp, _ in rnd}, devs)
      for name, r in rows.items():
        moved_bytes += len(rnd) * (r.nbytes // n)
        new_rows[name] = reassemble(r, rows_abs[name].sharding, rows_abs[name].shape,
                                    routed[name])
      tree = stepset[f"insert_{group}"](tree, new_rows, jax.device_put(dst_idx, wsh))
      continue
    for name, r in rows.items():
      by_dev = shards_by_device(r)
      bufs = {}
      for sp, _, dp, _ in rnd:
        moved = jax.device_put(by_dev[devs[sp]], devs[dp])
        moved_bytes += moved.nbytes
        bufs[devs[dp]] = moved
      new_rows[name] = reassemble(r, rows_abs[name].sharding, rows_abs[name].shape, bufs)
    tree = stepset[f"insert_{group}"](tree, new_rows, jax.device_put(dst_idx, wsh))
  return tree, moved_bytes


def shrink_tree(tree: dict, target_abstract: dict) -> dict:
  """Reassemble every array of `tree` over the smaller mesh of `target_abstract` (same names):
  the survivors' buffers are reused as they are."""
  return {k: reassemble(v, target_abstract[k].sharding, target_abstract[k].shape)
          for k, v in tree.items()}


# ----------------------------------------------------------------------------- a plan, carried out


def _move_by_device(tree: dict, target: dict, devices, moves, movers) -> tuple[dict, int]:
  """Worker moves by the single-device movers; the arrays reassembled as `target` says (its
  mesh, shapes). Returns (arrays, bytes sent)."""
  shards = {k: shards_by_device(a) for k, a in tree.items()}
  nbytes = move_on_devices(shards, [(devices[sw], s_, devices[dw], ds)
                                    for sw, s_, dw, ds in moves], movers)
  return {k: assemble(shards[k], t.sharding, t.shape, t.dtype) for k, t in target.items()}, nbytes


def migrate(steps, devices: Sequence, active: Sequence[int], state, moves,
            page_moves=None) -> tuple:
  """Move live sequences (src worker, src decode slot, dst worker, dst decode slot) between the
  active workers: their sequence rows of the decode state `state` (an engine DecodeState; its KV
  rows and scalars). `steps`: the engine's StepCache. Returns (new state, KV bytes sent).
  Paged KV: `page_moves` gives each move's (source page ids, destination page ids), and only
  those pages move (migrate_paged)."""
  if page_moves is not None:
    if jax.process_count() > 1:
      return _migrate_paged_spmd(steps.get(len(active)), active, state, moves, page_moves)
    return migrate_paged(steps, devices, state, moves, page_moves)
  b = steps.spec.slots_per_worker
  tree = state.as_dict()
  touched = {devices[w] for sw, _, dw, _ in moves for w in (sw, dw)}
  if jax.process_count() == 1 and steps.row_movers_ready(touched):
    tree, nbytes = _move_by_device(tree, tree, devices, moves, steps.row_movers(()))
  else:  # multi-controller, or no movers compiled for these devices: SPMD extract/insert
    pos = {w: i for i, w in enumerate(active)}
    rows = [(pos[sw], s_, pos[dw], ds) for sw, s_, dw, ds in moves]
    tree, nbytes = move_rows(steps.get(len(active)), "rows", tree, rows)
  state = state.replace(**tree)
  rows_total = len(active) * b
  kv_names = ("k", "v", "k_ring", "v_ring")  # a row's KV: the full layers' and the rings
  kv_per_row = sum(a.nbytes for k, a in state.as_dict().items() if k in kv_names) // rows_total
  rest_per_row = sum(a.nbytes for k, a in state.as_dict().items() if k not in kv_names) \
      // rows_total
  return state, int(nbytes * kv_per_row // (kv_per_row + rest_per_row))


def migrate_paged(steps, devices: Sequence, state, moves, page_moves) -> tuple:
  """Paged KV: a migrated sequence's row (scalars, outputs) by the RowMovers and its live pages
  by the PageMovers: taken on the source at the source page ids, written on the destination at
  the destination page ids (what the host's page pool chose). In rounds (move_rounds) when no
  device is both a source and a destination; else every page is taken before any is written, as
  the pool may hand a destination the pages another move's source just gave back. Movers the
  plan did not compile are compiled here. Returns (new state, KV bytes sent)."""
  touched = {devices[w] for sw, _, dw, _ in moves for w in (sw, dw)}
  rows = state.row_dict()
  rows, _ = _move_by_device(rows, rows, devices, moves, steps.row_movers(touched))
  pm = steps.page_movers(touched)
  pools = state.page_dict()
  shards = {k: shards_by_device(a) for k, a in pools.items()}

  def on(d):
    return {k: b[d] for k, b in shards.items()}

  if _holds_all(moves):
    batches = [list(range(len(moves)))]
  else:
    batches = [[i for _, i, _, _ in rnd] for rnd in
               move_rounds([(sw, i, dw, i) for i, (sw, _, dw, _) in enumerate(moves)])]
  for batch in batches:
    taken = [pm[devices[moves[i][0]]].take(on(devices[moves[i][0]]),
                                           pm[devices[moves[i][0]]].ids(page_moves[i][0]))
             for i in batch]
    sent = jax.device_put(taken, [devices[moves[i][2]] for i in batch])
    del taken
    for i, pages in zip(batch, sent, strict=True):
      d = devices[moves[i][2]]
      for k, b in pm[d].put(on(d), pages, pm[d].ids(page_moves[i][1])).items():
        shards[k][d] = b
  pools = {k: assemble(shards[k], a.sharding, a.shape, a.dtype) for k, a in pools.items()}
  page_bytes = sum(a.nbytes // a.shape[2] for a in pools.values())
  return state.replace(**rows, **pools), int(page_bytes * sum(len(s) for s, _ in page_moves)
                                             + _ring_bytes_per_row(state) * len(moves))


def _ring_bytes_per_row(state) -> int:
  """KV bytes of one sequence row's rings (the sliding layers' windows; 0 without), which a
  paged migration moves with the row."""
  return sum(a.nbytes // a.shape[1] for k, a in state.as_dict().items()
             if k in ("k_ring", "v_ring"))


def _holds_all(moves) -> bool:
  """Must every page be taken before any is written? When a worker is both a source and a
  destination: the pool may hand a destination the pages another move's source just gave back."""
  return bool({m[0] for m in moves} & {m[2] for m in moves})


def _migrate_paged_spmd(stepset, active: Sequence[int], state, moves, page_moves) -> tuple:
  """migrate_paged by the mesh's SPMD steps (multi-controller, where a device_put between the
  devices of two processes is not implemented): the rows by move_rows, the pages in chunks of
  the page movers' block (movers.page_block pages) by extract_pages on the sources, a ppermute
  over the mesh (route_rows) and insert_pages at the destinations' page ids, in move_rounds
  (a move's chunks in successive rounds). Every process runs the same rounds from the same plan.
  Returns (new state, KV bytes sent: each chunk sends a whole block, its last one padded)."""
  pos = {w: i for i, w in enumerate(active)}
  rows, _ = move_rows(stepset, "rows", state.row_dict(),
                      [(pos[sw], s_, pos[dw], ds) for sw, s_, dw, ds in moves])
  prog = stepset.page_programs()
  n, pad = stepset.mesh.size, stepset.spec.num_pages
  c = movers.page_block(stepset.spec.pages_per_seq)
  chunks = [(pos[sw], src[j:j + c], pos[dw], dst[j:j + c])
            for (sw, _, dw, _), (src, dst) in zip(moves, page_moves, strict=False)
            for j in range(0, len(src), c)]
  devs = list(stepset.mesh.devices.reshape(-1))
  pools = state.page_dict()
  hold = _holds_all(moves)
  pending, sent = [], 0
  for rnd in move_rounds([(sp, k, dp, k) for k, (sp, _, dp, _) in enumerate(chunks)]):
    src_ids, dst_ids = np.full((n, c), pad, np.int32), np.full((n, c), pad, np.int32)
    for sp, k, dp, _ in rnd:
      src_ids[sp, :len(chunks[k][1])] = chunks[k][1]
      dst_ids[dp, :len(chunks[k][3])] = chunks[k][3]
    block = prog["extract_pages"](pools, jax.device_put(src_ids, stepset.host_sharding))
    routed = route_rows(block, {sp: devs[dp] for sp, _, dp, _ in rnd}, devs)
    block = {k: reassemble(b, b.sharding, b.shape, routed[k]) for k, b in block.items()}
    sent += len(rnd) * sum(b.nbytes // n for b in block.values())
    pending.append((block, jax.device_put(dst_ids, stepset.host_sharding)))
    if not hold:
      pools = prog["insert_pages"](pools, *pending.pop())
  for block, ids in pending:
    pools = prog["insert_pages"](pools, block, ids)
  return state.replace(**rows, **pools), int(sent + _ring_bytes_per_row(state) * len(moves))


@dataclasses.dataclass
class Release:
  """What `release` did: the arrays over the smaller mesh and what moved."""
  experts: dict
  state: Any
  placement: Any  # the new expert_placement.ExpertPlacement
  released: list
  expert_moves: int
  expert_bytes: int


def release(steps, devices: Sequence, active: Sequence[int], new_active: Sequence[int],
            placement, experts: dict, state) -> Release:
  """Carry out a release: the workers of `active` not in `new_active` leave. Only the experts that
  lived on released workers move, into empty expert slots of the survivors
  (ExpertPlacement.after_release); the survivors' expert slots and sequence rows of `state` are
  reassembled over the smaller mesh from their existing buffers. No host sync: the movers and the
  first step on the new mesh queue back to back."""
  active, new_active = list(active), list(new_active)
  new_ss = steps.get(len(new_active))
  released = [w for w in active if w not in new_active]
  new_placement = placement.after_release(released, new_active)
  # (src worker, src slot, dst worker, dst slot) of every expert that leaves a released worker
  moves = [(*a, *b) for _, a, b in new_placement.moves_since(placement)]
  touched = {devices[w] for sw, _, dw, _ in moves for w in (sw, dw)}
  if jax.process_count() > 1 or not steps.slot_movers_ready(touched):
    # multi-controller, or a release the mover plan did not foresee: SPMD extract/insert
    experts, moved = _move_experts_spmd(steps.get(len(active)), new_ss, devices, active,
                                        new_active, experts, moves)
  else:
    experts, moved = _move_by_device(experts, new_ss.abstract_experts, devices, moves,
                                     steps.slot_movers(()))
  state = state.replace(**shrink_tree(state.as_dict(), new_ss.abstract_state.as_dict()))
  return Release(experts=experts, state=state, placement=new_placement, released=released,
                 expert_moves=len(moves), expert_bytes=int(moved))


def _move_experts_spmd(old_ss, new_ss, devices, active, new_active, experts, moves):
  """Expert moves by the StepSets' SPMD steps: extract on the old mesh, a transfer (one
  process: a device_put per moved expert; multi-controller, where a cross-host device_put is
  not implemented: a ppermute over the old mesh, route_rows), SPMD insert into the survivors'
  empty expert slots on the new mesh. Returns (experts over the new mesh, bytes this process
  counted)."""
  old_pos = {w: i for i, w in enumerate(active)}
  new_pos = {w: i for i, w in enumerate(new_active)}
  moved_bytes = 0
  pieces = []  # (dst worker, dst slot, {name: buffer on dst, None on another process})
  devs_old = list(old_ss.mesh.devices.reshape(-1))
  taken = None
  # One extract per source device and one block per destination device in each round.
  for rnd in move_rounds([(old_pos[sw], ss_, dw, ds) for sw, ss_, dw, ds in moves]):
    # Cut the moving experts out on the old mesh.
    idx = np.full((len(active),), -1, np.int32)
    for sp, sslot, _, _ in rnd:
      idx[sp] = sslot
    taken = old_ss["extract_experts"](experts, jax.device_put(idx, old_ss.worker_sharding))
    if jax.process_count() == 1:
      local = {name: shards_by_device(r) for name, r in taken.items()}
      for sp, _, dw, ds in rnd:
        sent = {name: jax.device_put(local[name][devs_old[sp]], devices[dw]) for name in taken}
        moved_bytes += sum(a.nbytes for a in sent.values())
        pieces.append((dw, ds, sent))
      continue
    routed = route_rows(taken, {sp: devices[dw] for sp, _, dw, _ in rnd}, devs_old)
    for _, _, dw, ds in rnd:
      moved_bytes += sum(a.nbytes // len(devs_old) for a in taken.values())
      pieces.append((dw, ds, {name: r.get(devices[dw]) for name, r in routed.items()}))
  experts = shrink_tree(experts, new_ss.abstract_experts)
  # Write the moved experts into empty expert slots of the survivors (donated, in place).
  taken_abs = new_ss["taken_experts"]
  devs_new = list(new_ss.mesh.devices.reshape(-1))
  # Workers that receive nothing in a round get a block of the last extract as filler (their
  # index is -1: the insert drops it); the extract's blocks have a shard on every survivor.
  filler = taken
  while pieces:
    assert filler is not None  # pieces come from an extract
    idx = np.full((len(new_active),), -1, np.int32)
    busy, later, rnd = set(), [], []
    for pc in pieces:
      (later if pc[0] in busy else rnd).append(pc)
      busy.add(pc[0])
    pieces = later
    block = {}
    for name in taken_abs:
      bufs = {}
      for dw, _, b in rnd:
        if b[name] is not None:  # None: the destination is another process's device
          bufs[devs_new[new_pos[dw]]] = b[name]
      block[name] = reassemble(filler[name], taken_abs[name].sharding, taken_abs[name].shape,
                               bufs)
    for dw, ds, _ in rnd:
      idx[new_pos[dw]] = ds
    experts = new_ss["insert_experts"](experts, block,
                                       jax.device_put(idx, new_ss.worker_sharding))
  return experts, moved_bytes
