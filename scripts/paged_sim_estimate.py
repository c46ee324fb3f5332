"""Step-simulator estimate of the bench on the paged KV pool (no model runs: seconds, not minutes).

  python scripts/paged_sim_estimate.py --config=bench_heavy [--max_seqs=0] [--kv_margin=0.25]

For each epoch the bench's sequences (the config's workload lengths: a run stops each sequence at
its target, so these are the lengths the engine would produce) go through sim/replay.replay, the
same policy code (plan.plan_rollout, controller.run) the runner calls, for static, balanced and
flexfloor, every schedule on one pool built as kv_pool.make_pool builds the runner's (kv_pages 0 =
the fixed-slot cache's bytes) and admitted by the predictions from the same length history; then
the epoch's lengths join the history, as in the bench. Also printed: the fixed-slot runs (the
bench's default mode) for reference, and static's makespan against its longest response
(+ the prefill steps of its worker): no schedule can finish before the longest response has
decoded. Device-steps with step_cost 'steps' (what the bench decides on with emulated CPU devices).
These are estimates: the bench itself replays every measured run to the same device-steps.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="bench_heavy", help="configs/<name>.py (bench, bench_heavy)")
  ap.add_argument("--epochs", type=int, default=0, help="0: the config's")
  ap.add_argument("--page_size", type=int, default=None)
  ap.add_argument("--max_seqs", type=int, default=None, help="rollout.max_seqs_per_worker")
  ap.add_argument("--kv_pages", type=int, default=None)
  ap.add_argument("--kv_margin", type=float, default=None)
  a = ap.parse_args(argv)

  from flexfloor_jax.config import files, settings
  from flexfloor_jax.model.tokenizer import load_tokenizer
  from flexfloor_jax.policy import pages
  from flexfloor_jax.policy.history import LengthHistory
  from flexfloor_jax.rollout import inputs, kv_pool
  from flexfloor_jax.sim import replay

  config = files.load_config(a.config, "tiny")
  config.rollout.kv = "paged"
  for k, v in (("page_size", a.page_size), ("max_seqs_per_worker", a.max_seqs),
               ("kv_pages", a.kv_pages), ("kv_margin", a.kv_margin)):
    if v is not None:
      config.rollout[k] = v
  st = settings.load(config, "bench")
  r = st.rollout
  model_cfg = inputs.model_config(st)
  tok = load_tokenizer(st.model.checkpoint, model_cfg)
  prompts = inputs.load_prompts(st, tok, model_cfg.bos_id)
  seq_len = inputs.resolve_max_seq_len(st, prompts, model_cfg)
  n = st.mesh.num_devices or st.mesh.cpu_devices
  terms = inputs.terms_for_config(st, model_cfg, seq_len)
  floor = terms.floor(model_cfg.num_experts, 16 * 2**30, n)  # the runner's CPU budget: 16 GB
  factory = kv_pool.pool_factory(r, n, seq_len)
  pool = factory({})
  per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * 4
  print(f"{a.config}: {n} workers, floor {floor}, max_seq_len {seq_len}, slots {r.slots_per_worker}"
        f"; paged pool per worker: {pool.num_pages} pages of {pool.page_size} tokens "
        f"({pool.num_pages * pool.page_size * per_token} bytes; fixed slots "
        f"{r.slots_per_worker * seq_len * per_token}), max_seqs {pool.max_seqs}, "
        f"kv_margin {r.kv_margin}")
  history = LengthHistory()
  epochs = a.epochs or st.bench.epochs
  hdr = (f"{'epoch':>5} {'kv':>6} {'run':>10} {'tok/dev-step':>12} {'makespan':>8} "
         f"{'dev-steps':>9} {'peak pages':>10} {'preempt':>7}")
  print(hdr)
  for k in range(epochs):
    ck = st.replace(rollout=dict(epoch=k))
    seqs = inputs.build_seqs(ck, prompts, inputs.resolve_lengths_mode(ck))
    lengths = {s.seq_id: int(s.target_len) for s in seqs}
    res = {}
    for kv in ("slots", "paged"):
      b = r.max_seqs if kv == "paged" else r.slots_per_worker
      for name in ("static", "balanced", "flexfloor"):
        m, rec = replay.replay(
            seqs, lengths, copy.deepcopy(history), name, n, b, floor,
            steps_per_dispatch=r.steps_per_dispatch, placement="auto",
            compaction=st.scheduler.compaction if name == "flexfloor" else False, epoch=k,
            sizes=None, makespan_slack=st.scheduler.makespan_slack, step_cost="steps",
            kv=factory if kv == "paged" else None)
        res[(kv, name)] = (m, rec)
        kvs = m.get("kv", {})
        print(f"{k:>5} {kv:>6} {name:>10} {m['tokens_per_device_step']:>12.3f} "
              f"{m['makespan_steps']:>8.0f} {m['device_steps']:>9.0f} "
              f"{kvs.get('peak_pages', '-'):>10} {kvs.get('preemptions', '-'):>7}")
    for kv in ("paged", "slots"):
      st_m = res[(kv, "static")][0]
      for name in ("flexfloor", "balanced"):
        m = res[(kv, name)][0]
        print(f"      {kv} (same {'pool' if kv == 'paged' else 'slots'}): {name}/static "
              f"tok/dev-step {m['tokens_per_device_step'] / st_m['tokens_per_device_step']:.3f}, "
              f"static/{name} makespan {st_m['makespan_steps'] / m['makespan_steps']:.2f}")
    m = res[("paged", "flexfloor")][0]
    fixed_static = res[("slots", "static")][0]
    print(f"      paged flexfloor / fixed-slot static (same bytes): tok/dev-step "
          f"{m['tokens_per_device_step'] / fixed_static['tokens_per_device_step']:.3f}, makespan "
          f"{fixed_static['makespan_steps'] / m['makespan_steps']:.2f}")
    longest = max(lengths.values())
    print(f"      longest response {longest} tokens; paged static makespan "
          f"{res[('paged', 'static')][0]['makespan_steps']:.0f} steps "
          f"(fixed-slot static {fixed_static['makespan_steps']:.0f})")
    lb = pages.makespan_lower_bound(seqs, lengths, n, pool.num_pages, pool.page_size,
                                    pool.max_seqs)
    st_ms = res[("paged", "static")][0]["makespan_steps"]
    print(f"      lower bound on the pool: {lb['bound']} steps = max(longest + prefill rounds "
          f"{lb['longest']}, rows {lb['rows']}, pages {lb['pages']} [{lb['page_steps']} "
          f"page-steps, {lb['kv_token_steps']} KV token-steps / {n} x {pool.num_pages} pages]); "
          f"paged static / bound {st_ms / lb['bound']:.2f}: static/flexfloor >= 1.5 needs "
          f"flexfloor <= {st_ms / 1.5:.0f} steps")
    history.add_rollout(k, seqs, lengths)


if __name__ == "__main__":
  main()
