"""Decode-step time table on one accelerator -> JSON the simulator loads \
(`--hardware=measured:FILE`).

  python scripts/step_table.py --out=h200_step_table.json            # Mixtral-8x7B layers, GPU/TPU
  python scripts/step_table.py --model=qwen3-30b-a3b --out=q.json    # Qwen3-30B-A3B layers
  python scripts/step_table.py --dry_run --out=/tmp/t.json           # tiny shapes, CPU, seconds

Times this project's real decode step (transformer.decode with the expert-parallel MoE layer
`ep_moe`, run inside shard_map as the engine runs it, `steps` decode steps per dispatch in one
fori_loop, sampled token fed back) for a stack of `--layers` layers of `--model` on ONE device
(mixtral-8x7b: hidden 4096, ffn 14336, 32 q / 8 kv heads of 128, E=8 top-2; qwen3-30b-a3b: hidden
2048, expert ffn 768, 32 q / 4 kv heads of 128 with q/k norms, E=128 top-8; bf16; the dry run
takes the family's tiny preset), as a function of
  - experts held by the device (Mixtral 1, 2, 4, 8; Qwen3 16, 32, 64, 128): emulates one worker
    of an n = E/e way EP group. The router still picks top-k of all E experts; expert j is served
    by local slot j mod e, so the device reads e experts' weights and its grouped matmuls get the
    ~B*k token copies an EP worker gets on average (its own batch's worth). The all_to_all is not
    timed (one device): the simulator adds it from its interconnect model;
  - decode batch B on the device (its sequences: DP attention) and KV cache length (the step
    attends over the whole cache, as the engine's fixed-shape decode does).
Per-layer seconds = (step - fixed) / layers, where `fixed` (embedding, final norm, lm_head, argmax)
is timed per batch with the same loop and no layers. Timing: compile ahead of time, warm up, then
`--repeats` timed runs of enough dispatches to last >= --min_run_s each, jax.block_until_ready at
the end of each; the table records the median and every repeat. Rows are written after every batch
block, so a run cut short still leaves a full grid over the batches it finished (`--budget_s` stops
it cleanly before that). Schema: flexfloor_jax/sim/measured_hw.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ints(s):
  return [int(x) for x in s.split(",") if x.strip()]


# --model -> (model.config preset, its tiny preset for --dry_run, default experts per device,
# dry-run experts per device)
MODELS = {"mixtral-8x7b": ("8x7b", "tiny", [1, 2, 4, 8], [1, 2, 8]),
          "qwen3-30b-a3b": ("qwen3-30b-a3b", "qwen3-tiny", [16, 32, 64, 128], [2, 4, 16])}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--dry_run", action="store_true", help="tiny shapes on CPU (checks every step)")
  p.add_argument("--model", default="mixtral-8x7b", choices=sorted(MODELS),
                 help="the layer shape timed (the simulator model the table serves)")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--experts", type=_ints, default=None,
                 help="experts per device (Mixtral 1,2,4,8; Qwen3 16,32,64,128)")
  p.add_argument("--batches", type=_ints, default=None, help="decode batches (32,8,128,256)")
  p.add_argument("--kv", type=_ints, default=None, help="KV cache lengths (1024,4096)")
  p.add_argument("--steps", type=int, default=8, help="decode steps per dispatch (fori_loop)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--min_run_s", type=float, default=0.05, help="each timed run lasts at least")
  p.add_argument("--budget_s", type=float, default=0.0, help="stop starting new batch blocks "
                 "after this many seconds (0 = no limit)")
  p.add_argument("--tile_m", type=int, default=8, help="expert GEMM row tile (engine decode: 8)")
  p.add_argument("--chunk_tokens", type=int, default=64, help="tokens per exchange (engine: 64)")
  p.add_argument("--backend", default="xla", help="MoE kernels: xla | pallas")
  p.add_argument("--variant", action="append", default=[],
                 help="extra rows with other kernel settings, 'backend:tile_m:chunk_tokens:"
                      "batches' (batches '|'-separated), timed at the first kv and all experts "
                      "after the table, recorded under 'variants' (not used by the simulator)")
  p.add_argument("--compile_threads", type=int, default=8, help="parallel XLA compiles")
  p.add_argument("--base_preset", default="h200", help="simulator preset for link / memory")
  p.add_argument("--ceilings", action="store_true", help="also measure copy GB/s and bf16 matmul")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.dry_run:
    from flexfloor_jax.runtime.backend import emulate_cpu_devices
    emulate_cpu_devices(1)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from flexfloor_jax import engine as engine_lib
  from flexfloor_jax.model import transformer as tfm
  from flexfloor_jax.model.config import PRESETS
  from flexfloor_jax.model.moe import EPConfig, ep_moe
  from flexfloor_jax.runtime import mesh as mesh_lib

  t_start = time.perf_counter()
  full, tiny, full_experts, tiny_experts = MODELS[args.model]
  if args.dry_run:
    cfg = PRESETS[tiny].replace(num_layers=2, dtype="bfloat16")
    experts = args.experts or tiny_experts
    batches = args.batches or [8, 16]
    kvs = args.kv or [32, 64]
    args.repeats, args.min_run_s = min(args.repeats, 2), min(args.min_run_s, 0.005)
  else:
    cfg = PRESETS[full].replace(num_layers=args.layers)
    experts = args.experts or full_experts
    batches = args.batches or [32, 8, 128, 256]
    kvs = args.kv or [1024, 4096]
  L, E = cfg.num_layers, cfg.num_experts
  dev = jax.devices()[0]
  if dev.platform == "cpu" and not args.dry_run:
    print(f"error: no accelerator (jax.devices() is CPU): {args.model} layers would take hours "
          "here; use --dry_run for the tiny CPU check", file=sys.stderr)
    return 2
  mesh = mesh_lib.make_ep_mesh([dev])
  ax = mesh_lib.EP_AXIS

  def log(*a):
    print(f"[{time.perf_counter() - t_start:7.1f}s]", *a, flush=True)

  log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, layers {L}, "
      f"D={cfg.hidden_size} F={cfg.intermediate_size} E={E} top-{cfg.top_k} {cfg.dtype}")

  params = jax.jit(lambda k: tfm.init_params(cfg, k))(jax.random.key(0))
  rest, canon = engine_lib.split_params(params)
  del params
  rep = NamedSharding(mesh, P())
  rest = jax.device_put(rest, rep)
  exp_sh = NamedSharding(mesh, P(None, ax))
  # expert weights of e slots: the first e experts' weights ([L, e, ...], slot layout, 1 worker)
  held = {e: {k: jax.device_put(v[:, :e], exp_sh) for k, v in canon.items()} for e in experts}
  del canon
  jax.block_until_ready(held)

  def make_step(e, backend, tile_m, chunk_tokens):
    ep = EPConfig(num_workers=1, slots_per_worker=e, top_k=cfg.top_k, tile_m=tile_m,
                  chunk_tokens=chunk_tokens, backend=backend)
    e2s = jnp.arange(E, dtype=jnp.int32) % e  # expert j -> local slot j mod e

    def moe_fn(x, lp, valid):
      return ep_moe(x, lp, valid, e2s, ep, E)


    def local(rest, ex, ck, cv, tok, pos):
      prm = engine_lib.merge_params(rest, ex)
      valid = jnp.ones(tok.shape, bool)
      s = ck.shape[2]

      def body(_, c):
        ck, cv, tok, pos = c
        logits, cache, _ = tfm.decode(prm, cfg, tfm.KVCache(ck, cv), tok, pos, valid,
                                      moe_fn=moe_fn)
        return cache.k, cache.v, jnp.argmax(logits, -1).astype(jnp.int32), (pos + 1) % s

      return jax.lax.fori_loop(0, args.steps, body, (ck, cv, tok, pos))

    cs = P(None, ax)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, ax), cs, cs, P(ax), P(ax)),
                       out_specs=(cs, cs, P(ax), P(ax)), check_vma=False)
    return jax.jit(fn, donate_argnums=(2, 3, 4, 5))

  def fixed_step(rest, tok):
    def body(_, tok):
      x = rest["embed"][tok]
      logits = tfm.rms_norm(x, rest["final_norm"], cfg.rms_eps) @ rest["lm_head"]
      return jnp.argmax(logits.astype(jnp.float32), -1).astype(jnp.int32)
    return jax.lax.fori_loop(0, args.steps, body, tok)

  fixed_fn = jax.jit(fixed_step, donate_argnums=(1,))

  def timed(call, state):
    """-> (median s per decode step, all repeats, compile-free first call s, final state)."""
    t0 = time.perf_counter()
    state = jax.block_until_ready(call(state))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(call(state))
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(np.ceil(args.min_run_s / one)))
    reps = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      for _ in range(n):
        state = call(state)
      jax.block_until_ready(state)
      reps.append((time.perf_counter() - t0) / (n * args.steps))
    return float(np.median(reps)), reps, first, state

  rng = np.random.default_rng(0)
  dt = tfm.dtype_of(cfg)
  cache_sh = NamedSharding(mesh, P(None, ax))
  bsh = NamedSharding(mesh, P(ax))

  def new_cache(b, s):
    shape = (L, b, s, cfg.num_kv_heads, cfg.head_dim)
    mk = jax.jit(lambda k: jax.random.normal(k, shape, dt), out_shardings=cache_sh)
    return mk(jax.random.key(b * 7 + s)), mk(jax.random.key(b * 7 + s + 1))

  def new_tokens(b, s):
    tok = jax.device_put(rng.integers(0, cfg.vocab_size, b).astype(np.int32), bsh)
    pos = jax.device_put(rng.integers(0, s, b).astype(np.int32), bsh)
    return tok, pos

  def abstract(b, s):
    cache = jax.ShapeDtypeStruct((L, b, s, cfg.num_kv_heads, cfg.head_dim), dt,
                                 sharding=cache_sh)
    vec = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=bsh)
    return cache, cache, vec, vec

  import concurrent.futures
  pool = concurrent.futures.ThreadPoolExecutor(max(1, args.compile_threads))

  def submit(step, e, b, s):
    """Lower (trace) here, in the main thread, and compile in the pool: XLA compiles release the
    GIL, so they run in parallel (on the device machine's cores) and behind the timing of
    earlier blocks without holding up its dispatches. -> future of (executable | exception, s)."""
    t0 = time.perf_counter()
    try:
      lo = step.lower(rest, held[e], *abstract(b, s))
    except Exception as ex:  # reported per job
      f = concurrent.futures.Future()
      f.set_result((ex, time.perf_counter() - t0))
      return f
    t_lower = time.perf_counter() - t0

    def comp():
      t1 = time.perf_counter()
      try:
        return lo.compile(), t_lower + time.perf_counter() - t1
      except Exception as ex:
        return ex, t_lower + time.perf_counter() - t1

    return pool.submit(comp)

  def time_compiled(compiled, e, state):
    def call(st):
      return compiled(rest, held[e], *st)

    med, reps, first, state = timed(call, state)
    return med, reps, state

  meta: dict[str, Any] = dict(format="flexfloor_jax.step_table", version=1, device=dev.device_kind,
              platform=dev.platform, jax_version=jax.__version__,
              created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              dtype=cfg.dtype, dry_run=bool(args.dry_run),
              model=dict(hidden=cfg.hidden_size, ffn=cfg.intermediate_size, heads=cfg.num_heads,
                         kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, experts=E,
                         top_k=cfg.top_k, vocab=cfg.vocab_size),
              layers_timed=L, sim_base_preset=args.base_preset,
              engine=dict(moe_backend=args.backend, decode_tile_m=args.tile_m,
                          chunk_tokens=args.chunk_tokens, steps_per_dispatch=args.steps,
                          attention="dense over the whole KV cache (engine's fixed shapes)",
                          expert_emulation=f"top-{cfg.top_k} of E={E}, expert j served by "
                          "slot j mod e"),
              timing=dict(repeats=args.repeats, min_run_s=args.min_run_s,
                          statistic="median over repeats of seconds per decode step"),
              measured={}, fixed=[], rows=[], variants=[])
  try:
    st = dev.memory_stats() or {}
    meta["device_memory_bytes_limit"] = int(st.get("bytes_limit", 0)) or None
  except Exception:  # not every backend reports memory stats
    pass

  def write():
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
      json.dump(meta, f, indent=1)
    os.replace(tmp, args.out)

  if args.ceilings:
    n = (1 << 20) if args.dry_run else (1 << 30)  # elements: 2 GiB of bf16 on a GPU
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    scale = jax.jit(lambda x: x * jnp.bfloat16(1.001))
    med, reps, _, _ = timed(lambda y: scale(y), x)
    meta["measured"]["hbm_bw"] = 2 * 2 * n / (med * args.steps)  # read + write, per call
    m = 512 if args.dry_run else 8192
    a = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    bm = jax.random.normal(jax.random.key(3), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda a: (a @ bm) * jnp.bfloat16(1e-2))
    med, reps, _, _ = timed(lambda y: mm(y), a)
    meta["measured"]["peak_flops"] = 2.0 * m ** 3 / (med * args.steps)
    meta["measured"]["how"] = ("hbm_bw: x * c over 2 GiB bf16, bytes read + written; peak_flops: "
                               "8192^3 bf16 matmul chained; medians")
    del x, a, bm
    log(f"ceilings: copy {meta['measured']['hbm_bw'] / 1e9:.0f} GB/s, bf16 matmul "
        f"{meta['measured']['peak_flops'] / 1e12:.0f} TFLOP/s")
    write()

  steps = {e: make_step(e, args.backend, args.tile_m, args.chunk_tokens) for e in experts}
  t0 = time.perf_counter()
  futures = {b: [(e, s, submit(steps[e], e, b, s)) for s in kvs for e in experts]
             for b in batches}
  log(f"lowered {sum(map(len, futures.values()))} steps in {time.perf_counter() - t0:.1f}s; "
      f"compiling in {args.compile_threads} threads")

  def over_budget():
    return args.budget_s and time.perf_counter() - t_start > args.budget_s

  # Time nothing while compiles run: XLA:GPU autotunes on the device and would disturb the timing.
  t0 = time.perf_counter()
  all_f = [f for fs in futures.values() for _, _, f in fs]
  budget_left = (args.budget_s - (t0 - t_start)) if args.budget_s else None
  _, pending = concurrent.futures.wait(all_f, timeout=budget_left)
  log(f"compiles: waited {time.perf_counter() - t0:.1f}s" + (
      f"; {len(pending)} still compiling at the budget (blocks then timed beside them)"
      if pending else ""))
  if pending:
    meta["timing"]["note"] = "some blocks were timed while later ones still compiled"

  done_batches = []
  for b in batches:
    if over_budget():
      left = [x for x in batches if x not in done_batches]
      log(f"budget {args.budget_s:.0f}s spent: batches {done_batches} done, left out {left}")
      meta["stopped_early"] = f"budget {args.budget_s}s spent: batches left out {left}"
      break
    tok = jax.device_put(rng.integers(0, cfg.vocab_size, b).astype(np.int32), bsh)
    fmed, freps, _, _ = timed(lambda t: fixed_fn(rest, t), tok)
    t0 = time.perf_counter()
    exes = [(e, s, f.result()) for e, s, f in futures[b]]
    log(f"B={b}: waited {time.perf_counter() - t0:.1f}s for its {len(exes)} compiles")
    block = []
    for s in kvs:
      state = (*new_cache(b, s), *new_tokens(b, s))
      for e, js, (exe, comp) in exes:
        if js != s:
          continue
        if isinstance(exe, Exception):
          raise exe
        med, reps, state = time_compiled(exe, e, state)
        per_layer, note = (med - fmed) / L, {}
        if per_layer <= 0:  # timing noise larger than the layers (a loaded CPU)
          per_layer, note = med / L, dict(note="fixed part not subtracted: it exceeded the step")
        block.append(dict(experts_per_device=e, batch=b, kv_len=s, seconds_per_layer=per_layer,
                          step_seconds=med, repeats=reps, compile_s=round(comp, 2), **note))
        log(f"e={e} B={b:4d} kv={s:5d}: step {med * 1e3:8.3f} ms, per layer "
            f"{per_layer * 1e3:7.3f} ms (fixed {fmed * 1e3:.3f} ms; lower+compile {comp:.1f}s; "
            f"spread {(max(reps) - min(reps)) / med:.1%})")
      del state
    meta["fixed"].append(dict(batch=b, seconds=fmed, repeats=freps))
    meta["rows"].extend(block)
    done_batches.append(b)
    write()

  s_var = kvs[0]  # variants: other kernel settings at the first kv length (not used by the sim)
  var_jobs = []
  for spec in args.variant if not over_budget() else []:
    backend, tile_m, chunk, bs = spec.split(":")
    for b in _ints(bs.replace("|", ",")):
      for e in experts:
        v = dict(backend=backend, tile_m=int(tile_m), chunk_tokens=int(chunk),
                 experts_per_device=e, batch=b, kv_len=s_var)
        var_jobs.append((v, submit(make_step(e, backend, int(tile_m), int(chunk)), e, b, s_var)))
  if args.variant and not var_jobs:
    meta["variants_left_out"] = f"budget {args.budget_s}s spent: {args.variant}"
  state, state_b = None, None
  for v, f in var_jobs:
    e, b = v["experts_per_device"], v["batch"]
    if over_budget():
      log(f"budget spent: variants from {v} on left out")
      meta["variants_left_out"] = f"budget {args.budget_s}s spent: from {v} on"
      break
    if state_b != b:
      state, state_b = None, None
      state, state_b = (*new_cache(b, s_var), *new_tokens(b, s_var)), b
    tag = f"variant {v['backend']} tile_m={v['tile_m']} chunk={v['chunk_tokens']} e={e} B={b}"
    try:
      exe, comp = f.result()
      if isinstance(exe, Exception):
        raise exe
      med, reps, state = time_compiled(exe, e, state)
    except Exception as ex:  # recorded; the table stands without it
      meta["variants"].append(dict(v, error=f"{type(ex).__name__}: {ex}"[:800]))
      log(f"{tag}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
      state_b = None  # donated buffers may be gone
      continue
    row: dict[str, Any] = dict(v, step_seconds=med, repeats=reps, compile_s=round(comp, 2))
    fixed = [r["seconds"] for r in meta["fixed"] if r["batch"] == b]
    if fixed:
      row["seconds_per_layer"] = (med - fixed[0]) / L
    meta["variants"].append(row)
    log(f"{tag} kv={s_var}: step {med * 1e3:.3f} ms" +
        (f", per layer {row['seconds_per_layer'] * 1e3:.3f} ms" if fixed else ""))
    write()
  state = None

  write()
  # the table must load as a simulator preset
  from flexfloor_jax.sim import measured_hw
  tab = measured_hw.load(args.out)
  log(f"wrote {args.out}: {len(meta['rows'])} rows; {measured_hw.describe(tab)}")
  pool.shutdown(wait=False, cancel_futures=True)
  sys.stdout.flush()
  os._exit(0)  # compiles still running after a budget stop would hold up a normal exit


if __name__ == "__main__":
  sys.exit(main())
