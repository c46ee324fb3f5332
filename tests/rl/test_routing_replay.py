"""Routing replay (rl): the training forward can use the experts the rollout recorded instead of
its own top-k. Replaying a model's own routing changes nothing (bitwise); replaying another
routing gives the same log-probs on the ep path (8 workers) as on the dense single-device
reference with the same routing, and the layers report the replayed experts. The log-prob
comparisons between two programs run as a user's run compiles (`user_flags`, test_user_flags.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_utils import grpo_config

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.model.tokenizer import ByteTokenizer
from flexfloor_jax.rl import actor, tasks, train
from flexfloor_jax.rollout import runner
from flexfloor_jax.runtime import mesh as mesh_lib

CFG = PRESETS["tiny"].replace(num_layers=2)
TOL = 1e-4  # ep path vs dense reference: another implementation
# The other families' tiny presets at top-8 of 16 experts (their published k), 2 layers: Qwen3's
# softmax router with and without renormalisation, GPT-OSS's biased top-k-then-softmax,
# DeepSeek-V3's grouped sigmoid router (without its dense layer 0, which routes nothing and
# reports no replayed experts).
FAMILY_CFGS = {
    "mixtral": CFG,
    "qwen3": PRESETS["qwen3-tiny"].replace(num_layers=2, top_k=8),
    "qwen3-unnormalised": PRESETS["qwen3-tiny"].replace(num_layers=2, top_k=8,
                                                        norm_topk_prob=False),
    "gpt-oss": PRESETS["gpt-oss-tiny"].replace(num_layers=2, top_k=8, sliding_layers=(0,)),
    # DeepSeek-V3's sigmoid router: grouped top-8 (3 of 4 groups open), correction bias, scaled
    "deepseek": PRESETS["deepseek-v3-tiny"].replace(num_layers=2, top_k=8, topk_group=3,
                                                    dense_layers=(), dense_intermediate_size=0),
}


def _inputs(seed, cfg=CFG):
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = tfm.init_params(cfg, k1, scale=0.1)
  tokens = jax.random.randint(k2, (8, 12), 0, cfg.vocab_size)
  valid = jnp.arange(12)[None, :] < jnp.array([12, 9, 12, 5, 12, 12, 7, 12])[:, None]
  return params, tokens, valid


def _logp(logits, tokens):
  lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  return np.asarray(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0])


@pytest.mark.parametrize("name", list(FAMILY_CFGS))
def test_replaying_own_routing_is_bitwise_identity(name):
  cfg = FAMILY_CFGS[name]
  params, tokens, valid = _inputs(0, cfg)
  logits, aux = tfm.forward(params, cfg, tokens, valid_BT=valid)
  route_LBTK = aux["experts"].reshape(cfg.num_layers, *tokens.shape, cfg.top_k)
  replayed, aux2 = tfm.forward(params, cfg, tokens, valid_BT=valid, route_LBTK=route_LBTK)
  assert np.array_equal(np.asarray(logits), np.asarray(replayed))
  assert np.array_equal(np.asarray(aux["experts"]), np.asarray(aux2["experts"]))


@pytest.mark.user_flags
@pytest.mark.parametrize("name", list(FAMILY_CFGS))
def test_replayed_routing_ep_equals_dense_reference(name):
  cfg = FAMILY_CFGS[name]
  params, tokens, valid = _inputs(1, cfg)
  _, aux = tfm.forward(params, cfg, tokens, valid_BT=valid)
  own = np.asarray(aux["experts"]).reshape(cfg.num_layers, 8, 12, cfg.top_k)
  # another routing: k distinct experts per token, drawn at random
  rng = np.random.default_rng(2)
  other = np.stack([rng.permutation(cfg.num_experts)[:cfg.top_k]
                    for _ in range(own.size // cfg.top_k)]).reshape(own.shape).astype(np.int32)
  assert (np.sort(other, -1) != np.sort(own, -1)).any(-1).mean() > 0.5
  logits_ref, aux_ref = tfm.forward(params, cfg, tokens, valid_BT=valid,
                                    route_LBTK=jnp.asarray(other))
  assert np.array_equal(np.asarray(aux_ref["experts"]).reshape(other.shape), other)
  logits_own, _ = tfm.forward(params, cfg, tokens, valid_BT=valid)
  ref = _logp(logits_ref, tokens)
  m = np.asarray(valid[:, 1:])
  assert np.abs(ref - _logp(logits_own, tokens))[m].max() > 1e-3  # the replay changes the model

  mesh = mesh_lib.make_ep_mesh(jax.devices())
  a = actor.Actor(actor.ActorSpec(cfg, 8, temperature=1.0), mesh, None)
  p = actor.shard_params(params, mesh)
  got = np.asarray(a.logprobs(p, tokens, valid, np.transpose(other, (1, 2, 0, 3))))
  diff = np.abs(got - ref)[m].max()
  print(f"routing replay ep vs dense: max|diff| {diff:.3g}")
  assert diff <= TOL
  own_ep = np.asarray(a.logprobs(p, tokens, valid))  # and without replay: its own routing
  assert np.abs(own_ep - _logp(logits_own, tokens))[m].max() <= TOL


@pytest.mark.user_flags
def test_rollout_records_routes_and_replay_matches_rollout(tmp_path):
  """rollout.record_routes: each response carries its tokens' experts per layer; they are the
  experts the training forward picks for the same tokens, and replaying them reproduces the
  rollout's log-probs (<= 1e-4)."""
  c = grpo_config(tmp_path)
  c.rollout.prompts, c.rollout.output_dir = str(tmp_path / "prompts.jsonl"), str(tmp_path)
  c.rollout.record_routes = True
  rows = tasks.make_prompts(c.rl.tasks, c.rl.num_prompts, seed=9, size=2)
  tasks.write_prompts_jsonl(rows, c.rollout.prompts)
  cfg = PRESETS["tiny"]
  params = tfm.init_params(cfg, jax.random.key(13), scale=0.1)
  tok = ByteTokenizer()
  res = runner.run(c, params=params, model_cfg=cfg, tokenizer=tok, write_outputs=False,
                   progress=False)
  ptoks = {r["id"]: tok.encode(r["prompt"], add_bos=True) for r in rows}
  for r in res.responses:
    fed = len(ptoks[r["prompt_id"]]) + r["num_tokens"] - 1
    assert r["routes"].shape == (fed, cfg.num_layers, cfg.top_k)
  t_max = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  batch, roll = train.build_batch(res.responses, ptoks, np.zeros(len(res.responses)),
                                  c.rollout.samples_per_prompt, t_max, 8)
  # the training forward's own routing at every fed position (dense reference, one device)
  _, aux = tfm.forward(params, cfg, jnp.asarray(batch["tokens"]), valid_BT=batch["valid"])
  own = np.asarray(aux["experts"]).reshape(cfg.num_layers, *batch["tokens"].shape, cfg.top_k)
  own = np.transpose(own, (1, 2, 0, 3))
  same = [np.array_equal(np.sort(own[i, :len(r["routes"])], -1), np.sort(r["routes"], -1))
          for i, r in enumerate(res.responses)]
  assert all(same), f"{sum(same)} of {len(same)} responses routed alike"
  mesh = mesh_lib.make_ep_mesh(jax.devices())
  a = actor.Actor(actor.ActorSpec(cfg, 8, temperature=1.0), mesh, None)
  lp = a.logprobs(actor.shard_params(params, mesh), batch["tokens"], batch["valid"],
                  batch["route"])
  m = batch["mask"]
  diff = np.abs(lp - roll)[m].max()
  print(f"replayed routing vs rollout log-probs: max|diff| {diff:.3g}")
  assert diff <= TOL
