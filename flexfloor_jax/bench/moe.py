"""`python -m flexfloor_jax.bench.moe`: the whole expert-parallel MoE layer against the work of
the rows it actually routes.

References, both on one device over as many rows as there are routed token copies (tokens x
top_k):
- dense: one SwiGLU (x @ w1, x @ w3, @ w2) over all of them with one expert's weights, the least
  any MoE implementation must compute (the headline ratio);
- per expert: one batched einsum of every expert's SwiGLU over the routed copies spread evenly,
  c = ceil(copies / E) rows each (a capacity layout with no padding where E divides the copies;
  every expert's weights read once, the most even routing there is). Below a few hundred rows per
  expert, reading all the experts' weights and multiplying few rows per weight is the work, which
  the dense reference leaves out: this is the reference to read there.
The layer runs on N emulated devices that share this machine's cores, so a ratio is total CPU
work, not a speed-up. Routing, permutes, the exchange and combine are included in the layer's
time. Each variant and reference is timed `--runs` times, round-robin so that machine noise hits
all alike; the figures are medians of wall time and of this process's CPU time (on a machine
shared with other work, wall time favours the layer, whose 8 device threads win a larger share of
the cores than one device's matmul threads; CPU seconds do not).

The ragged exchange runs the pure-JAX reference of ragged_all_to_all here (XLA:CPU has no native
op), which moves padded rows: its CPU time says nothing about the native op. The bytes table does:
it counts what each exchange puts on the interconnect for this routing.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from flexfloor_jax import engine
from flexfloor_jax.model.moe import EPConfig, ep_moe, exchange_capacities, tile_m_for_rows
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
_TILE = flags.DEFINE_integer("tile_m", 0, "rows per expert GEMM tile; 0: "
                             "model.moe.tile_m_for_rows of the mean rows per expert slot")
_RUNS = flags.DEFINE_integer("runs", 5, "timed runs of each variant (median)")
_FACTORS = flags.DEFINE_list("capacity_factors", ["1.25", "1.5", "2"],
                             "EPConfig.capacity_factors of the layer (multiples of the balanced "
                             "load tokens*top_k/N per destination; empty: the exact capacity)")
_COMPARE = flags.DEFINE_list("compare", ["exact", "ragged"],
                             "layer variants timed beside it: 'exact' (capacity tokens*top_k per "
                             "destination), 'ragged' (exchange='ragged')")


@dataclasses.dataclass
class Timing:
  name: str
  wall_s: float
  cpu_s: float
  bitwise_equal: bool | None = None  # to the layer (variants only)


def _time_round_robin(calls: dict, runs: int) -> dict:
  """{name: (median wall s, median CPU s)} of `runs` calls each, one of every name per round."""
  for fn in calls.values():
    jax.block_until_ready(fn())
  wall = {k: [] for k in calls}
  cpu = {k: [] for k in calls}
  for _ in range(runs):
    for name, fn in calls.items():
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn())
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return {k: (float(np.median(wall[k])), float(np.median(cpu[k]))) for k in calls}


def run(n: int = 8, t: int = 512, d: int = 256, f: int = 512, e: int = 8, k: int = 2,
        tile_m: int = 0, factors: tuple = (1.25, 1.5, 2.0), compare=("exact", "ragged"),
        runs: int = 5) -> dict:
  """Times the layer (and `compare` variants) against both references on the first n devices.
  Returns the figures, the layer settings and the per-(source, destination) copy counts."""
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (n * t, d), jnp.float32)
  router = jax.random.normal(keys[1], (d, e), jnp.float32)
  w1 = 0.05 * jax.random.normal(keys[2], (e, d, f), jnp.float32)
  w3 = 0.05 * jax.random.normal(keys[3], (e, d, f), jnp.float32)
  w2 = 0.05 * jax.random.normal(keys[4], (e, f, d), jnp.float32)
  mesh = mesh_lib.make_ep_mesh(jax.devices()[:n])
  slots = expert_slots(e, n)
  tile_m = tile_m or tile_m_for_rows(t * k / slots)
  pl = ExpertPlacement.initial(e, list(range(n)), slots)
  ex = engine.slot_layout({"w1": w1[None], "w3": w3[None], "w2": w2[None]}, pl.slot_expert(),
                          mesh_lib.sharding(mesh, "layer", "expert", None, None))
  e2s = jnp.asarray(pl.expert_to_slot(list(range(n))), jnp.int32)

  def make_layer(capacity_factors=(), exchange="all_to_all"):
    ep = EPConfig(num_workers=n, slots_per_worker=slots, top_k=k, tile_m=tile_m,
                  chunk_tokens=t, capacity_factors=capacity_factors, exchange=exchange)

    def local(x, router, w1, w3, w2):
      lp = {"router": router, "w1": w1[0], "w3": w3[0], "w2": w2[0]}
      return ep_moe(x, lp, jnp.ones(x.shape[0], bool), e2s, ep, e)[0]

    tokens = mesh_lib.logical_spec("batch", "embed")
    return jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(tokens, mesh_lib.logical_spec())
                                 + (engine.expert_spec(),) * 3,
                                 out_specs=tokens, check_vma=False))

  xs = jax.device_put(x, mesh_lib.sharding(mesh, "batch", "embed"))
  largs = (xs, router, ex["w1"], ex["w3"], ex["w2"])
  layers = {"layer": make_layer(tuple(factors))}
  if "exact" in compare and len(exchange_capacities(t * k, n, factors)) > 1:  # else the same
    layers["exact"] = make_layer()
  if "ragged" in compare:
    layers["ragged"] = make_layer(exchange="ragged")

  # The references' rows: as many as the routed copies.
  experts = np.asarray(jax.jit(lambda x, r: route(x, r, k)[2])(x, router))
  counts = np.bincount(experts.reshape(-1), minlength=e)
  rows = jax.random.normal(keys[0], (n * t * k, d), jnp.float32)
  dense = jax.jit(lambda r, a, b, c: (jax.nn.silu(r @ a) * (r @ b)) @ c)
  per = -(-n * t * k // e)
  rows_ecd = jax.random.normal(keys[1], (e, per, d), jnp.float32)

  @jax.jit
  def per_expert(r, a, b, c):
    def mm(x, w):
      return jnp.einsum("ecd,edf->ecf", x, w)
    return mm(jax.nn.silu(mm(r, a)) * mm(r, b), c)

  calls: dict[str, Callable[[], Any]] = {name: functools.partial(fn, *largs)
                                         for name, fn in layers.items()}
  calls["dense"] = functools.partial(dense, rows, w1[0], w3[0], w2[0])
  calls["per_expert"] = functools.partial(per_expert, rows_ecd, w1, w3, w2)
  timed = _time_round_robin(calls, runs)
  out_layer = layers["layer"](*largs)
  result = {name: Timing(name, wall_s=timed[name][0], cpu_s=timed[name][1],
                         bitwise_equal=None if name == "layer" or name not in layers
                         else bool(jnp.array_equal(out_layer, layers[name](*largs))))
            for name in calls}
  dest = np.asarray(e2s)[experts].reshape(n, t * k) // slots
  sent = np.stack([np.bincount(dest[w], minlength=n) for w in range(n)])  # [source, dest]
  return dict(timings=result, tile_m=tile_m, slots=slots, factors=tuple(factors),
              sent=sent, counts=counts, dims=dict(n=n, t=t, d=d, f=f, e=e, k=k))


def main(argv):
  del argv
  emulate_cpu_devices(_DEVICES.value)
  factors = tuple(float(x) for x in _FACTORS.value)
  r = run(_DEVICES.value, _TOKENS.value, _HIDDEN.value, _FFN.value, _EXPERTS.value, _TOPK.value,
          _TILE.value, factors, tuple(_COMPARE.value), _RUNS.value)
  n, t, d, f, e, k = (r["dims"][x] for x in "ntdfek")
  tm = r["timings"]
  dense, per_exp = tm["dense"], tm["per_expert"]
  caps = exchange_capacities(t * k, n, factors)
  used = next(c for c in caps if c >= r["sent"].max())
  touched = int((r["counts"] > 0).sum())
  print(f"MoE layer on {n} workers: {n * t} tokens x top-{k} = {n * t * k} routed rows, "
        f"D={d} F={f} E={e} ({r['slots']} slots per worker, {t * k / r['slots']:.1f} rows per "
        f"slot on average, {touched} experts touched), tile_m={r['tile_m']}; median of "
        f"{_RUNS.value} runs, wall and CPU seconds")
  print(f"  dense SwiGLU over the routed rows (one expert's weights): {dense.wall_s * 1e3:.1f} ms "
        f"wall, {dense.cpu_s * 1e3:.1f} ms CPU")
  per = -(-n * t * k // e)
  print(f"  per-expert SwiGLU, one einsum over {e} experts x {per} rows: "
        f"{per_exp.wall_s * 1e3:.1f} ms wall, {per_exp.cpu_s * 1e3:.1f} ms CPU")
  labels = {"layer": f"layer, capacity factors {','.join(f'{x:g}' for x in factors)} "
                     f"(cap {used} of {t * k})",
            "exact": "layer, exact capacity",
            "ragged": "layer, exchange='ragged' ("
            + ("the reference" if jax.default_backend() == "cpu" else "native")
            + " ragged_all_to_all)"}
  print(f"  {'variant':<60} {'wall ms':>9} {'CPU ms':>9} {'/dense wall':>11} {'/dense CPU':>10} "
        f"{'/per-expert CPU':>15}  bitwise equal to the layer")
  for name, lab in labels.items():
    if name not in tm:
      continue
    x = tm[name]
    eq = "" if x.bitwise_equal is None else str(x.bitwise_equal)
    print(f"  {lab:<60} {x.wall_s * 1e3:9.1f} {x.cpu_s * 1e3:9.1f} {x.wall_s / dense.wall_s:11.2f} "
          f"{x.cpu_s / dense.cpu_s:10.2f} {x.cpu_s / per_exp.cpu_s:15.2f}  {eq}")
  _print_exchange_bytes(r["sent"], n, t, d, k, factors, used)


def _print_exchange_bytes(c, n, t, d, k, factors, used):
  """Bytes each device sends per layer (out + back; a device receives as many in total across
  the group), from this routing's counts c[i, j] = copies worker i sends to worker j. With
  b = 4 (fp32 activations) and 4-byte int32 slot ids and counts:
    all_to_all: out N*cap*(D*b + 4) (rows and their slot ids) + back N*cap*D*b, cap = tokens*k
      (or the capacity bucket in use), the block a device keeps for itself included;
    ragged: out sum_j c[w, j]*(D*b + 4) + back sum_i c[i, w]*D*b (the rows it received return)
      + N*4 (its counts, gathered by every worker); rows to itself included likewise.
  The ragged figures are what the native ragged_all_to_all moves, not the CPU reference."""
  b = 4
  cap = t * k

  def a2a(cap):
    return np.full(n, n * cap * (d * b + 4) + n * cap * d * b)

  rows = {"all_to_all (cap = tokens*k)": a2a(cap),
          "ragged": c.sum(1) * (d * b + 4) + c.sum(0) * d * b + n * 4}
  if factors:
    rows[f"all_to_all, capacity factors {factors} (cap {used})"] = a2a(used)
  routed = 2 * t * k * d * b  # the routed rows themselves, out and back
  print(f"  bytes per device per layer (out + back), {n} workers, {t * k} routed rows each, "
        f"D={d}, {b}-byte activations; {c.min()}..{c.max()} rows per (source, destination):")
  print(f"    {'exchange':<48} {'mean MiB':>9} {'max MiB':>9} {'x routed rows':>14}")
  for name, per_dev in rows.items():
    print(f"    {name:<48} {per_dev.mean() / 2**20:9.2f} {per_dev.max() / 2**20:9.2f} "
          f"{per_dev.mean() / routed:14.2f}")


if __name__ == "__main__":
  app.run(main)
