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
                  key=upd(sc.key, keys), done_step=upd(sc.done_step, jnp.where(done, 0, -1)),
                  drafted=upd(sc.drafted, 0 * gen_P), accepted=upd(sc.accepted, 0 * gen_P))
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
  Chunked prefill (spec.chunked): each step also runs up to `chunk` input tokens of the
  worker's queue as query rows beside the decode rows (spec.prefill_rows of them, the unused
  ones invalid), each a one-token query over its sequence's cache, exactly as a decode row: a
  sequence's last input token samples its next token and makes its slot live. A worker with
  queued input is not idle, and the loop runs while anything is live or queued.
  Speculative decoding (spec.draft_tokens): each live slot brings a draft; every step hands the
  worker's free decode rows to the drafts still alive (`_draft_rows`) and keeps, per slot, the
  tokens plain decoding makes up to the first drafted token it would not have made
  (`_draft_take`; policy.controller's contract).
  Returns (state, steps run, expert counts [E])."""
  cfg = spec.cfg
  b = st.out_tokens.shape[0]
  h, e2s, table_BM, queue, drafts = read_decode(host_PC, cfg.num_experts, b, spec.pages_per_seq,
                                                spec.prefill_queue, spec.draft_tokens)
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
  c_rows = spec.prefill_rows
  if queue is not None:  # padded by a chunk, so that every step's slice of the queue is in range
    queue = {k: jnp.concatenate([v, jnp.zeros((c_rows,), v.dtype)]) for k, v in queue.items()}
    chunk, queued = h["chunk"], h["queued"]
    qkeys = jax.vmap(sequence_key, in_axes=(None, None, 0, 0))(h["seed"], h["epoch"],
                                                               queue["phash"], queue["sample"])

  def inputs(i, sc):
    """This step's query rows: the B decode rows, then (chunked) the queue's next chunk:
    (tokens, positions, valid, cache rows, keys, token numbers, chunk entries or None)."""
    live = sc.live
    if queue is None:
      return sc.tokens, sc.positions, live, None, sc.key, sc.n_gen, None
    start = i * chunk
    j = jnp.arange(c_rows)
    ent = {k: jax.lax.dynamic_slice_in_dim(v, start, c_rows) for k, v in queue.items()}
    ent["valid"] = (j < chunk) & (start + j < queued)
    ent["key"] = jax.lax.dynamic_slice_in_dim(
        jnp.concatenate([qkeys, jnp.zeros((c_rows, 2), qkeys.dtype)]), start, c_rows)
    slot_C = jnp.where(ent["valid"], ent["slot"], b)  # b: out of range, writes nothing
    return (jnp.concatenate([sc.tokens, ent["token"]]),
            jnp.concatenate([sc.positions, ent["position"]]),
            jnp.concatenate([live, ent["valid"]]), jnp.concatenate([rows, slot_C]),
            jnp.concatenate([sc.key, ent["key"]]), jnp.concatenate([sc.n_gen, ent["generated"]]),
            ent)

  sc0 = st.slot_scalars()
  n_gen0 = sc0.n_gen  # the dispatch's start: a slot's tokens made since are its draft's place

  def step(carry):
    st, sc, i, _, counts, alive = carry
    live = sc.live
    plan = None
    if drafts is not None:
      plan = _draft_rows(sc, alive, drafts, sc.n_gen - n_gen0)
      tok_R, pos_R, valid_R, rows_R, key_R, gen_R = (plan[k] for k in (
          "tokens", "positions", "valid", "rows", "keys", "generated"))
      ent = None
    else:
      tok_R, pos_R, valid_R, rows_R, key_R, gen_R, ent = inputs(i, sc)
    extra = {} if rows_R is None else {"rows_B": rows_R}
    if spec.paged:
      # the host rows carry page tables, and the spec an attention function, when spec.paged
      assert table_BM is not None and attention is not None
      table_RM = table_BM if rows_R is None else table_BM[jnp.clip(rows_R, 0, b - 1)]
      logits, cache, aux = decode_paged(params, cfg, st.paged, table_RM, tok_R, pos_R, valid_R,
                                        moe_fn=moe_fn, attention=attention, **extra)
    else:
      logits, cache, aux = tfm.decode(params, cfg, st.cache, tok_R, pos_R, valid_R,
                                      moe_fn=moe_fn, **extra)
    kv = cache_fields(cache)
    tok_all, lp_all = sample(logits, key_R, gen_R, spec.sampling, temp)
    routes = st.routes
    any_finished, queued_left = jnp.bool_(False), jnp.bool_(False)
    if plan is not None:
      assert drafts is not None  # plan is made from the drafts
      made, fed_R, alive, sc = _draft_take(cfg, plan, drafts, sc, alive, tok_all, lp_all,
                                           sc.n_gen - n_gen0, i, max_new)
      out_tokens = st.out_tokens.at[rows[:, None], made["cols"]].set(made["tokens"], mode="drop")
      out_logprobs = st.out_logprobs.at[rows[:, None], made["cols"]].set(made["logprobs"],
                                                                        mode="drop")
      any_finished = jnp.any(made["finished"])
      route_rows = jnp.where(fed_R, plan["rows"], b)
    else:
      tok, lp = tok_all[:b], lp_all[:b]
      col = jnp.where(live, sc.n_gen, max_new)  # out of range for dead slots: dropped
      out_tokens = st.out_tokens.at[rows, col].set(tok, mode="drop")
      out_logprobs = st.out_logprobs.at[rows, col].set(lp, mode="drop")
      n_gen = sc.n_gen + live.astype(jnp.int32)
      finished = live & ((n_gen >= sc.limit) | (sc.stop_eos & _is_stop(tok, cfg.stop_ids)))
      sc = sc.replace(n_gen=n_gen, tokens=jnp.where(live, tok, sc.tokens),
                      positions=sc.positions + live.astype(jnp.int32), live=live & ~finished,
                      done_step=jnp.where(finished, i, sc.done_step))
      any_finished = jnp.any(finished)
      route_rows = rows if rows_R is None else jnp.where(valid_R, rows_R, b)
    if routes is not None:  # the fed tokens' experts at their positions: aux [L, R, K] -> [R, L, K]
      pos = jnp.where(valid_R, pos_R, spec.max_seq_len)
      routes = routes.at[route_rows, pos].set(jnp.transpose(aux["experts"], (1, 0, 2)),
                                              mode="drop")
    if ent is not None:
      # a sequence's last input token: its next token (number `generated`) and its slot goes
      # live, or finishes at once; the slot was free (not live), so no decode row touched it
      last = ent["valid"] & (ent["last"] != 0)
      tok_c, lp_c, gen_c = tok_all[b:], lp_all[b:], ent["generated"]
      idx = jnp.where(last, ent["slot"], b)  # b = out of range: dropped
      done = (ent["limit"] <= gen_c + 1) | ((ent["stop_eos"] != 0)
                                            & _is_stop(tok_c, cfg.stop_ids))

      def upd(a, val):
        return a.at[idx].set(val, mode="drop")

      sc = sc.replace(tokens=upd(sc.tokens, tok_c),
                      positions=upd(sc.positions, ent["position"] + 1),
                      live=upd(sc.live, ~done), n_gen=upd(sc.n_gen, gen_c + 1),
                      limit=upd(sc.limit, ent["limit"]),
                      stop_eos=upd(sc.stop_eos, ent["stop_eos"] != 0),
                      key=upd(sc.key, ent["key"]),
                      done_step=upd(sc.done_step, jnp.where(done, i, -1)))
      out_tokens = out_tokens.at[idx, gen_c].set(tok_c, mode="drop")
      out_logprobs = out_logprobs.at[idx, gen_c].set(lp_c, mode="drop")
      any_finished = any_finished | jnp.any(last & done)
      queued_left = queued > (i + 1) * chunk
    st = st.replace(**kv, out_tokens=out_tokens, out_logprobs=out_logprobs, routes=routes)
    busy = jnp.any(sc.live) | queued_left
    wake = worker_stops(any_finished, busy, stop_on_refill, stop_on_idle)
    stop = jax.lax.psum(wake.astype(jnp.int32), axis) > 0
    any_busy = jax.lax.psum(busy.astype(jnp.int32), axis) > 0
    counts = counts + aux["expert_counts"].sum(0)
    return st, sc, i + 1, stop | ~any_busy, counts, alive

  def cond(carry):
    return (carry[2] < max_steps) & ~carry[3]

  zero = jnp.zeros_like(sc0.n_gen)
  sc = sc0.replace(done_step=zero - 1, drafted=zero, accepted=zero)
  busy0 = jnp.any(sc.live) | (h["queued"] > 0 if queue is not None else False)
  any_busy = jax.lax.psum(busy0.astype(jnp.int32), axis) > 0
  counts0 = jnp.zeros((cfg.num_experts,), jnp.int32)
  alive0 = jnp.ones((b,), bool)
  st, sc, steps, _, counts, _ = jax.lax.while_loop(
      cond, step, (st.replace(scalars=None), sc, jnp.int32(0), ~any_busy, counts0, alive0))
  return st.replace(scalars=sc.pack()), steps, counts


def _draft_rows(sc, alive, drafts_BD, made_B) -> dict:
  """A speculative step's query rows (the controller's contract): each live slot s whose draft
  is alive wants w_s = min(draft tokens it has not made yet, limit - generated - 1) rows; the
  free (not live) decode rows go to them in slot order, v_s each; free row r carrying s's
  drafted token j (1..v_s) runs that token at s's position + j over s's cache (rows_B = s),
  with the key and token number plain decoding uses there. drafts_BD [B, 1 + D]: each slot's
  draft length, then its tokens; made_B: tokens each slot made in this dispatch (its place in
  its draft). Returns the rows' inputs and the plan's v, start (first free-row rank of each
  slot's rows), the free rows in order and each row's draft offset j (0: none)."""
  b = sc.live.shape[0]
  d_n = drafts_BD.shape[1] - 1
  rows = jnp.arange(b)
  live = sc.live
  dlen, dtok = drafts_BD[:, 0], drafts_BD[:, 1:]
  room = sc.limit - sc.n_gen - 1
  want = jnp.where(live & alive, jnp.clip(jnp.minimum(dlen - made_B, room), 0, d_n), 0)
  free = ~live
  n_free = jnp.sum(free.astype(jnp.int32))
  before = jnp.cumsum(want) - want  # rows the lower live slots want
  v = jnp.clip(n_free - before, 0, want)
  end = jnp.cumsum(v)
  start = end - v
  rank = jnp.cumsum(free.astype(jnp.int32)) - 1  # a free row's place among the free rows
  assigned = free & (rank < end[-1])
  owner = jnp.where(assigned, jnp.clip(jnp.searchsorted(end, rank, side="right"), 0, b - 1),
                    rows)
  j = jnp.where(assigned, rank - start[owner] + 1, 0)
  drafted_tok = dtok[owner, jnp.clip(made_B[owner] + j - 1, 0, max(d_n - 1, 0))]
  return dict(tokens=jnp.where(assigned, drafted_tok, sc.tokens),
              positions=sc.positions[owner] + j, valid=live | assigned, rows=owner,
              keys=sc.key[owner], generated=sc.n_gen[owner] + j, v=v, start=start, j=j,
              free_rows=jnp.nonzero(free, size=b, fill_value=0)[0], assigned=assigned)


def _draft_take(cfg, plan: dict, drafts_BD, sc, alive, tok_R, lp_R, made_B, i, max_new: int):
  """After a speculative step: per live slot, the tokens x_0..x_v sampled after its own token
  and its v drafted ones; it keeps x_0..x_a (a: the leading drafted tokens equal to the token
  sampled before them), cut after the first that finishes it (limit or EOS); its draft stays
  alive while every token it kept equals the draft's token at that place. Returns ({'cols',
  'tokens', 'logprobs': [B, 1 + D] what to write where (cols out of range: nothing),
  'finished': [B]}, which query rows fed a kept token (their routes count), alive, scalars)."""
  b = sc.live.shape[0]
  d_n = drafts_BD.shape[1] - 1
  rows, live = jnp.arange(b), sc.live
  dlen, dtok = drafts_BD[:, 0], drafts_BD[:, 1:]
  v, start, free_rows = plan["v"], plan["start"], plan["free_rows"]
  t = jnp.arange(d_n + 1)
  src = free_rows[jnp.clip(start[:, None] + t[None, 1:] - 1, 0, b - 1)]  # [B, D]: x_j's row
  x = jnp.concatenate([tok_R[:b, None], tok_R[src]], 1)  # [B, 1 + D]
  lp = jnp.concatenate([lp_R[:b, None], lp_R[src]], 1)
  di = made_B[:, None] + t[None]  # the draft's place of x_t
  in_draft = di < dlen[:, None]
  same = in_draft & (x == dtok[rows[:, None], jnp.clip(di, 0, max(d_n - 1, 0))])
  a = jnp.cumprod((same & (t[None] < v[:, None])).astype(jnp.int32), axis=1).sum(1)
  kept = t[None] <= a[:, None]
  ends = ((sc.n_gen[:, None] + t[None] + 1 >= sc.limit[:, None])
          | (sc.stop_eos[:, None] & _is_stop(x, cfg.stop_ids))) & kept
  finished = live & jnp.any(ends, axis=1)
  c = jnp.where(live, jnp.where(finished, jnp.argmax(ends, axis=1) + 1, a + 1), 0)
  made = t[None] < c[:, None]
  alive = alive & ~jnp.any(made & in_draft & ~same, axis=1)
  last = x[rows, jnp.maximum(c - 1, 0)]
  sc = sc.replace(n_gen=sc.n_gen + c, positions=sc.positions + c,
                  tokens=jnp.where(live, last, sc.tokens), live=live & ~finished,
                  done_step=jnp.where(finished, i, sc.done_step), drafted=sc.drafted + v,
                  accepted=sc.accepted + jnp.maximum(c - 1, 0))
  cols = jnp.where(made, sc.n_gen[:, None] - c[:, None] + t[None], max_new)
  owner, j = plan["rows"], plan["j"]
  fed = live | (plan["assigned"] & (j <= c[owner] - 1))
  return dict(cols=cols, tokens=x, logprobs=lp, finished=finished), fed, alive, sc
