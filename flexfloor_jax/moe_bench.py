"""`python -m flexfloor_jax.moe_bench`: the whole expert-parallel MoE layer against the work of
the rows it actually routes.

The reference is one dense SwiGLU (x @ w1, x @ w3, @ w2) over exactly the routed token copies
(tokens x top_k rows) on one device: the least any MoE implementation must compute. The layer
runs on N emulated devices that share this machine's cores, so the ratio is total CPU work, not
a speed-up. Routing, permutes, all_to_all and combine are included in the layer's time.
"""

import time

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 8, "Emulated CPU devices (= EP workers).")
_TOKENS = flags.DEFINE_integer("tokens_per_worker", 512, "Tokens per worker.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "D")
_FFN = flags.DEFINE_integer("ffn", 512, "F")
_EXPERTS = flags.DEFINE_integer("experts", 8, "E")
_TOPK = flags.DEFINE_integer("top_k", 2, "k")
_TILE = flags.DEFINE_integer("tile_m", 256, "rows per expert GEMM tile")
_RUNS = flags.DEFINE_integer("runs", 10, "timed runs (median)")
_BUCKETS = flags.DEFINE_list("capacity_buckets", [], "EPConfig.capacity_buckets, e.g. 8,4,2 "
                             "(empty: the exact capacity tokens*top_k per destination)")


def main(argv):
  del argv
  from flexfloor_jax.cli import emulate_cpu_devices
  emulate_cpu_devices(_DEVICES.value)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from flexfloor_jax import engine, mesh as mesh_lib
  from flexfloor_jax.model.moe import EPConfig, ep_moe
  from flexfloor_jax.policy.planner import ExpertPlacement

  n, t, d, f, e, k = (_DEVICES.value, _TOKENS.value, _HIDDEN.value, _FFN.value, _EXPERTS.value,
                      _TOPK.value)
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (n * t, d), jnp.float32)
  router = jax.random.normal(keys[1], (d, e), jnp.float32)
  w1 = 0.05 * jax.random.normal(keys[2], (e, d, f), jnp.float32)
  w3 = 0.05 * jax.random.normal(keys[3], (e, d, f), jnp.float32)
  w2 = 0.05 * jax.random.normal(keys[4], (e, f, d), jnp.float32)
  mesh = mesh_lib.make_ep_mesh(jax.devices()[:n])
  slots = -(-e // n)
  pl = ExpertPlacement.initial(e, list(range(n)), slots)
  ex = engine.slot_layout({"w1": w1[None], "w3": w3[None], "w2": w2[None]}, pl.slot_expert(),
                          NamedSharding(mesh, engine.expert_spec()))
  e2s = jnp.asarray(pl.expert_to_slot(list(range(n))), jnp.int32)
  buckets = tuple(int(b) for b in _BUCKETS.value)

  def make_layer(capacity_buckets):
    ep = EPConfig(num_workers=n, slots_per_worker=slots, top_k=k, tile_m=_TILE.value,
                  chunk_tokens=t, capacity_buckets=capacity_buckets)

    def local(x, router, w1, w3, w2):
      lp = {"router": router, "w1": w1[0], "w3": w3[0], "w2": w2[0]}
      return ep_moe(x, lp, jnp.ones(x.shape[0], bool), e2s, ep, e)[0]

    return jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(P("ep"), P()) + (P(None, "ep"),) * 3,
                                 out_specs=P("ep"), check_vma=False))

  layer = make_layer(())
  bucketed = make_layer(buckets) if buckets else None
  xs = jax.device_put(x, NamedSharding(mesh, P("ep")))
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

  # Interleave so that machine noise hits both alike.
  tl, td, tb = [], [], []
  largs = (xs, router, ex["w1"], ex["w3"], ex["w2"])
  for _ in range(3):
    tl.append(timeit(layer, *largs))
    td.append(timeit(dense, *args))
    if bucketed is not None:
      tb.append(timeit(bucketed, *largs))
  tl, td = float(np.median(tl)), float(np.median(td))
  print(f"MoE layer on {n} workers: {n * t} tokens x top-{k} = {n * t * k} routed rows, "
        f"D={d} F={f} E={e} tile_m={_TILE.value}")
  print(f"  layer {tl * 1e3:.2f} ms   dense SwiGLU over the routed rows {td * 1e3:.2f} ms   "
        f"ratio {tl / td:.2f}")
  if bucketed is not None:
    tb = float(np.median(tb))
    same = bool(jnp.array_equal(layer(*largs), bucketed(*largs)))
    print(f"  layer with capacity buckets {buckets}: {tb * 1e3:.2f} ms   ratio {tb / td:.2f}   "
          f"bitwise equal to the exact capacity: {same}")
  # Rows each worker exchanges per layer: out and back, n destinations x capacity rows of D.
  from flexfloor_jax.model.moe import _exchange_capacities
  from flexfloor_jax.model.transformer import route
  experts = np.asarray(jax.jit(lambda x, r: route(x, r, k)[2])(x, router))
  dest = np.asarray(e2s)[experts].reshape(n, t * k) // slots
  need = max(np.bincount(dest[w], minlength=n).max() for w in range(n))
  cap = t * k
  used = next(c for c in _exchange_capacities(cap, buckets) if c >= need)
  mib = lambda c: 2 * n * c * d * 4 / 2**20
  print(f"  exchanged per worker per layer (out + back): exact capacity ({cap} rows per "
        f"destination) {mib(cap):.2f} MiB, buckets ({used} rows) {mib(used):.2f} MiB, "
        f"the routed rows themselves {2 * t * k * d * 4 / 2**20:.2f} MiB")


if __name__ == "__main__":
  app.run(main)
