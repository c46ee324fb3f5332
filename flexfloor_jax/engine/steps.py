"""The per-worker bodies of the prefill step and the decode dispatch, run inside `shard_map` over
the `ep` mesh (step_set.py compiles them per mesh). With paged KV (spec.kv == 'paged') the KV goes
through the page tables of the host inputs (model/paged.py); everything else is the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexfloor_jax.engine.sampling import sample, sample_one, sequence_key
from flexfloor_jax.engine.spec import EngineSpec, merge_params
from flexfloor_jax.engine.state import (
  DecodeState,
  cache_fields,
  read_decode,
  read_prefill,
  temperature_of,
)
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.moe import ep_moe
from flexfloor_jax.model.paged import decode_paged, insert_paged
from flexfloor_jax.policy.controller import worker_stops


def _is_stop(tok, stop_ids):
  """Whether each token is one of the model's stop ids (a checkpoint may list several)."""
  hit = tok == stop_ids[0]
  for i in stop_ids[1:]:
    hit = hit | (tok == i)
  return hit


def prefill_local(spec: EngineSpec, n: int, rest, experts, st: DecodeState, host_PC,
                  width: int = 0):
  """At most one prompt per worker into its decode slot (slot -1: none), and its first token;
  a resumed sequence (`generated` g > 0: its tokens are prompt + the g it had made) recomputes
  its KV and makes token g. `width`: token columns (default max_prompt_len).
  Returns (state, expert counts [E])."""
  cfg = spec.cfg
  tokens_PT, c, e2s, table_PM = read_prefill(host_PC, width or spec.max_prompt_len,
                                             cfg.num_experts, spec.pages_per_seq)
  slot_P, eos_P, limit_P = c["slot"], c["stop_eos"] != 0, c["limit"]
  seed, epoch, temp = c["seed"][0], c["epoch"][0], temperature_of(c["temperature"][0])
  ep = spec.ep(n, spec.prefill_tile_m)

  def moe_fn(x, lp, valid):
    return ep_moe(x, lp, valid, e2s, ep, cfg.num_experts)

  active = slot_P >= 0
  lengths = jnp.where(active, c["length"], 0)
  logits, k, v, aux = tfm.prefill(merge_params(rest, experts), cfg, tokens_PT, lengths,
                                  moe_fn=moe_fn)
  if spec.paged:
    assert table_PM is not None  # the host rows carry page tables when spec.paged
    kv = cache_fields(insert_paged(st.paged, k, v, table_PM, lengths, slot_P))
  else:
    kv = cache_fields(tfm.insert(st.cache, k, v, slot_P, lengths))
  gen_P = c["generated"]
  keys = jax.vmap(sequence_key, in_axes=(None, None, 0, 0))(seed, epoch, c["phash"], c["sample"])
  tok, lp = jax.vmap(lambda lg, kd, g: sample_one(lg, kd, g, spec.sampling, temp))(logits, keys,
                                                                                   gen_P)
  sc = st.slot_scalars()
  b = sc.tokens.shape[0]
  idx = jnp.where(active, slot_P, b)  # b = out of range: dropped
  done = (limit_P <= gen_P + 1) | (eos_P & _is_stop(tok, cfg.stop_ids))

  def upd(a, val):
    return a.at[idx].set(val, mode="drop")

  sc = sc.replace(tokens=upd(sc.tokens, tok), positions=upd(sc.positions, lengths),
                  live=upd(sc.live, ~done), n_gen=upd(sc.n_gen, gen_P + 1),
                  limit=upd(sc.limit, limit_P), stop_eos=upd(sc.stop_eos, eos_P),
                  key=upd(sc.key, keys))
  routes = st.routes
  if routes is not None:  # the prompt's experts: aux [L, P*T, K] -> rows [P, T, L, K]
    p, t = tokens_PT.shape
    r = jnp.transpose(aux["experts"].reshape(cfg.num_layers, p, t, -1), (1, 2, 0, 3))
    routes = routes.at[idx, :t].set(r, mode="drop")
  st = st.replace(**kv, scalars=sc.pack(),
                  out_tokens=st.out_tokens.at[idx, gen_P].set(tok, mode="drop"),
                  out_logprobs=st.out_logprobs.at[idx, gen_P].set(lp, mode="drop"), routes=routes)
  return st, aux["expert_counts"].sum(0)


def decode_local(spec: EngineSpec, n: int, rest, experts, st: DecodeState, host_PC):
  """Up to max_steps decode steps in a `lax.while_loop`; stops after a step in which a worker
  with stop_on_refill had a slot finish, or one with stop_on_idle went from live slots to none,
  or nothing is live (policy.controller.worker_stops, the rule the host applies too).
  Returns (state, steps run, expert counts [E])."""
  cfg = spec.cfg
  b = st.out_tokens.shape[0]
  h, e2s, table_BM = read_decode(host_PC, cfg.num_experts, b, spec.pages_per_seq)
  max_steps, stop_on_refill, stop_on_idle = (h["max_steps"], h["stop_on_refill"] != 0,
                                             h["stop_on_idle"] != 0)
  temp = temperature_of(h["temperature"])
  ep = spec.ep(n, spec.decode_tile_m)
  axis = ep.axis
  params = merge_params(rest, experts)

  def moe_fn(x, lp, valid):
    return ep_moe(x, lp, valid, e2s, ep, cfg.num_experts)

  rows = jnp.arange(b)
  max_new = spec.max_new_tokens
  attention = spec.paged_attention() if spec.paged else None

  def step(carry):
    st, sc, i, _, counts = carry
    live = sc.live
    if spec.paged:
      # the host rows carry page tables, and the spec an attention function, when spec.paged
      assert table_BM is not None and attention is not None
      logits, cache, aux = decode_paged(params, cfg, st.paged, table_BM, sc.tokens,
                                        sc.positions, live, moe_fn=moe_fn, attention=attention)
    else:
      logits, cache, aux = tfm.decode(params, cfg, st.cache, sc.tokens, sc.positions, live,
                                      moe_fn=moe_fn)
    kv = cache_fields(cache)
    tok, lp = sample(logits, sc.key, sc.n_gen, spec.sampling, temp)
    col = jnp.where(live, sc.n_gen, max_new)  # out of range for dead slots: dropped
    routes = st.routes
    if routes is not None:  # the fed token's experts at its position: aux [L, B, K] -> [B, L, K]
      pos = jnp.where(live, sc.positions, spec.max_seq_len)
      routes = routes.at[rows, pos].set(jnp.transpose(aux["experts"], (1, 0, 2)), mode="drop")
    st = st.replace(**kv,
                    out_tokens=st.out_tokens.at[rows, col].set(tok, mode="drop"),
                    out_logprobs=st.out_logprobs.at[rows, col].set(lp, mode="drop"),
                    routes=routes)
    n_gen = sc.n_gen + live.astype(jnp.int32)
    finished = live & ((n_gen >= sc.limit) | (sc.stop_eos & _is_stop(tok, cfg.stop_ids)))
    sc = sc.replace(n_gen=n_gen, tokens=jnp.where(live, tok, sc.tokens),
                    positions=sc.positions + live.astype(jnp.int32), live=live & ~finished)
    wake = worker_stops(jnp.any(finished), jnp.any(sc.live), stop_on_refill, stop_on_idle)
    stop = jax.lax.psum(wake.astype(jnp.int32), axis) > 0
    any_live = jax.lax.psum(jnp.any(sc.live).astype(jnp.int32), axis) > 0
    counts = counts + aux["expert_counts"].sum(0)
    return st, sc, i + 1, stop | ~any_live, counts

  def cond(carry):
    return (carry[2] < max_steps) & ~carry[3]

  sc = st.slot_scalars()
  any_live = jax.lax.psum(jnp.any(sc.live).astype(jnp.int32), axis) > 0
  counts0 = jnp.zeros((cfg.num_experts,), jnp.int32)
  st, sc, steps, _, counts = jax.lax.while_loop(
      cond, step, (st.replace(scalars=None), sc, jnp.int32(0), ~any_live, counts0))
  return st.replace(scalars=sc.pack()), steps, counts
