"""`python -m flexfloor_jax.bench.moe`: the whole expert-parallel MoE layer against the work of
the rows it actually routes.

The reference is one dense SwiGLU (x @ w1, x @ w3, @ w2) over exactly the routed token copies
(tokens x top_k rows) on one device: the least any MoE implementation must compute. The layer
runs on N emulated devices that share this machine's cores, so the ratio is total CPU work, not
a speed-up. Routing, permutes, the exchange and combine are included in the layer's time. The
ragged exchange runs the pure-JAX reference of ragged_all_to_all here (XLA:CPU has no native op),
which moves padded rows: its CPU time says nothing about the native op. The bytes table does: it
counts what each exchange puts on the interconnect for this routing.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from flexfloor_jax import engine
from flexfloor_jax.model.moe import EPConfig, _exchange_capacities, ep_moe
from flexfloor_jax.model.transformer import route
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.floor import expert_slots
from flexfloor_jax.runtime import mesh as mesh_lib
from flexfloor_jax.runtime.backend import emulate_cpu_devices

_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices (= EP workers).")
_TOKENS = flags.DEFINE_integer("tokens_per_worker", 512, "Tokens per worker.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "D")
_FFN = flags.DEFINE_integer("ffn", 512, "F")
_EXPERTS = flags.DEFINE_integer("experts", 8, "E")
_TOPK = flags.DEFINE_integer("top_k", 2, "k")
_TILE = flags.DEFINE_integer("tile_m", 256, "rows per expert GEMM tile")
_RUNS = flags.DEFINE_integer("runs", 10, "timed runs (median)")
_BUCKETS = flags.DEFINE_list("capacity_buckets", ["8", "4", "2"],
                             "EPConfig.capacity_buckets timed beside the exact capacity "
                             "tokens*top_k per destination (empty: the exact capacity only)")


def main(argv):
  del argv
  emulate_cpu_devices(_DEVICES.value)


  n, t, d, f, e, k = (_DEVICES.value, _TOKENS.value, _HIDDEN.value, _FFN.value, _EXPERTS.value,
                      _TOPK.value)
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (n * t, d), jnp.float32)
  router = jax.random.normal(keys[1], (d, e), jnp.float32)
  w1 = 0.05 * jax.random.normal(keys[2], (e, d, f), jnp.float32)
  w3 = 0.05 * jax.random.normal(keys[3], (e, d, f), jnp.float32)
  w2 = 0.05 * jax.random.normal(keys[4], (e, f, d), jnp.float32)
  mesh = mesh_lib.make_ep_mesh(jax.devices()[:n])
  slots = expert_slots(e, n)
  pl = ExpertPlacement.initial(e, list(range(n)), slots)
  ex = engine.slot_layout({"w1": w1[None], "w3": w3[None], "w2": w2[None]}, pl.slot_expert(),
                          mesh_lib.sharding(mesh, "layer", "expert", None, None))
  e2s = jnp.asarray(pl.expert_to_slot(list(range(n))), jnp.int32)
  buckets = tuple(int(b) for b in _BUCKETS.value)

  def make_layer(capacity_buckets=(), exchange="all_to_all"):
    ep = EPConfig(num_workers=n, slots_per_worker=slots, top_k=k, tile_m=_TILE.value,
                  chunk_tokens=t, capacity_buckets=capacity_buckets, exchange=exchange)

    def local(x, router, w1, w3, w2):
      lp = {"router": router, "w1": w1[0], "w3": w3[0], "w2": w2[0]}
      return ep_moe(x, lp, jnp.ones(x.shape[0], bool), e2s, ep, e)[0]

    tokens = mesh_lib.logical_spec("batch", "embed")
    return jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(tokens, mesh_lib.logical_spec())
                                 + (engine.expert_spec(),) * 3,
                                 out_specs=tokens, check_vma=False))

  layer = make_layer()
  bucketed = make_layer(buckets) if buckets else None
  ragged = make_layer(exchange="ragged")
  xs = jax.device_put(x, mesh_lib.sharding(mesh, "batch", "embed"))
  rows = jax.random.normal(keys[0], (n * t * k, d), jnp.float32)
  dense = jax.jit(lambda r, a, b, c: (jax.nn.silu(r @ a) * (r @ b)) @ c)
  args = (rows, w1[0], w3[0], w2[0])

  def timeit(fn, *a):
    jax.block_until_ready(fn(*a))
    out = []
    for _ in range(_RUNS.value):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*a))
      out.append(time.perf_counter() - t0)
    return float(np.median(out))

  # Interleave so that machine noise hits every variant alike.
  tl, td, tb, tr = [], [], [], []
  largs = (xs, router, ex["w1"], ex["w3"], ex["w2"])
  for _ in range(3):
    tl.append(timeit(layer, *largs))
    td.append(timeit(dense, *args))
    tr.append(timeit(ragged, *largs))
    if bucketed is not None:
      tb.append(timeit(bucketed, *largs))
  tl, td = float(np.median(tl)), float(np.median(td))
  print(f"MoE layer on {n} workers: {n * t} tokens x top-{k} = {n * t * k} routed rows, "
        f"D={d} F={f} E={e} tile_m={_TILE.value}")
  print(f"  layer (exact capacity) {tl * 1e3:.2f} ms   dense SwiGLU over the routed rows "
        f"{td * 1e3:.2f} ms   ratio {tl / td:.2f}")
  if bucketed is not None:
    tb = float(np.median(tb))
    same = bool(jnp.array_equal(layer(*largs), bucketed(*largs)))
    print(f"  layer with capacity buckets {buckets}: {tb * 1e3:.2f} ms   ratio {tb / td:.2f}   "
          f"bitwise equal to the exact capacity: {same}")
  tr = float(np.median(tr))
  same = bool(jnp.array_equal(layer(*largs), ragged(*largs)))
  impl = "the reference" if jax.default_backend() == "cpu" else "native"
  print(f"  layer with exchange='ragged' ({impl} ragged_all_to_all): {tr * 1e3:.2f} ms   "
        f"ratio {tr / td:.2f}   bitwise equal to all_to_all: {same}")
  _print_exchange_bytes(np.asarray(x), np.asarray(router), np.asarray(e2s), n, t, k, slots,
                        buckets)


def _print_exchange_bytes(x, router, e2s, n, t, k, slots, buckets):
  """Bytes each device sends per layer (out + back; a device receives as many in total across
  the group), from this routing's counts c[i, j] = copies worker i sends to worker j. With
  b = the activation itemsize and 4-byte int32 slot ids and counts:
    all_to_all: out N*cap*(D*b + 4) (rows and their slot ids) + back N*cap*D*b, cap = tokens*k
      (or the capacity bucket in use), the block a device keeps for itself included;
    ragged: out sum_j c[w, j]*(D*b + 4) + back sum_i c[i, w]*D*b (the rows it received return)
      + N*4 (its counts, gathered by every worker); rows to itself included likewise.
  The ragged figures are what the native ragged_all_to_all moves, not the CPU reference."""

  d, b = x.shape[1], x.dtype.itemsize
  experts = np.asarray(jax.jit(lambda x, r: route(x, r, k)[2])(x, router))
  dest = e2s[experts].reshape(n, t * k) // slots
  c = np.stack([np.bincount(dest[w], minlength=n) for w in range(n)])  # [source, destination]
  cap = t * k

  def a2a(cap):
    return np.full(n, n * cap * (d * b + 4) + n * cap * d * b)

  rows = {"all_to_all (cap = tokens*k)": a2a(cap),
          "ragged": c.sum(1) * (d * b + 4) + c.sum(0) * d * b + n * 4}
  if buckets:
    used = next(cap_b for cap_b in _exchange_capacities(cap, buckets) if cap_b >= c.max())
    rows[f"all_to_all, buckets {tuple(buckets)} (cap {used})"] = a2a(used)
  routed = 2 * t * k * d * b  # the routed rows themselves, out and back
  print(f"  bytes per device per layer (out + back), {n} workers, {t * k} routed rows each, "
        f"D={d}, {b}-byte activations; {c.min()}..{c.max()} rows per (source, destination):")
  print(f"    {'exchange':<40} {'mean MiB':>9} {'max MiB':>9} {'x routed rows':>14}")
  for name, per_dev in rows.items():
    print(f"    {name:<40} {per_dev.mean() / 2**20:9.2f} {per_dev.max() / 2**20:9.2f} "
          f"{per_dev.mean() / routed:14.2f}")


if __name__ == "__main__":
  app.run(main)
