"""Acceptance for the Qwen3-MoE, GPT-OSS and DeepSeek-V3 families: our loader, transformer and
engine compute what transformers' Qwen3MoeForCausalLM, GptOssForCausalLM and
DeepseekV3ForCausalLM compute.

Tiny random fp32 checkpoints written by `save_pretrained` (tests/hf_utils.py QWEN3_CASES,
GPT_OSS_CASES), every norm weight (q_norm and k_norm included) drawn around 1 and every bias and
attention sink around 0, eager attention on the torch side. Qwen3-MoE: "q3" (12 experts, top-4
renormalised, layer 1 dense, hub layout) and "q3s" (32 experts, top-8 not renormalised, layers 0
and 2 dense, fused layout in shards). GPT-OSS: "go" (12 experts, sliding / full / sliding layers,
YaRN, clamps that bind) and "go3" (32 experts, full then sliding, in shards). DeepSeek-V3 (every
correction bias random): "ds" (MLA with q_lora_rank, 12 experts in 4 groups, 2 open, top-4, a
shared expert, layer 0 dense, YaRN with both mscales) and "ml" (as Moonlight: no q_lora_rank;
32 experts in 8 groups, 3 open, top-6, fused layout in shards). Greedy responses
come from the whole rollout path (runner.run: the engine's prefill and decode under expert
parallelism) at 1, 3 and 8 workers; 12 experts on 8 workers and 32 on 3 hold their experts in
uneven slots.
"""

from __future__ import annotations

import json
import os
import shutil

import hf_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexfloor_jax.config.files import load_config
from flexfloor_jax.model import hf_checkpoint as hf
from flexfloor_jax.model import transformer as tr
from flexfloor_jax.rl import actor, train
from flexfloor_jax.rollout import runner
from flexfloor_jax.rollout.inputs import Prompt
from flexfloor_jax.runtime import mesh as mesh_lib

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# The reference is transformers': compared as a user's run compiles (test_user_flags.py).
pytestmark = pytest.mark.user_flags

LOGIT_TOL = 1e-4  # fp32, ours vs torch
MARGIN = 10 * LOGIT_TOL  # a greedy token is only meaningful when top-1 beats top-2 by this
MAX_CLOSE_FRACTION = 0.02
NEW_TOKENS = 20
LENGTHS = np.array([16, 12, 14, 5, 9, 13])  # prompt lengths (right padding for the forward)
PAD_T = 16
WORKERS = {"q3": (1, 3, 8), "q3s": (1, 3), "go": (1, 3, 8), "go3": (1, 3), "ds": (1, 3, 8),
           "ml": (1, 3, 8)}  # both DeepSeek cases at 8: with and without q_lora_rank
# saved in several files (the Qwen3 and DeepSeek ones in the fused expert layout)
SHARDED = ("q3s", "go3", "ml")


class Case:
  def __init__(self, name: str, root: str):
    self.name = name
    self.path = os.path.join(root, name)
    config = (hf_utils.qwen3_config(name) if name in hf_utils.QWEN3_CASES
              else hf_utils.deepseek_config(name) if name in hf_utils.DEEPSEEK_CASES
              else hf_utils.gpt_oss_config(name))
    self.torch_model = hf_utils.build_model(config, seed=1)
    sharded = name in SHARDED
    hf_utils.save(self.torch_model, self.path, fused=sharded,
                  max_shard_size="100KB" if sharded else None)
    self.cfg, self.params = hf.load_hf(self.path)
    cfg = self.cfg
    self.forward = jax.jit(lambda p, t, v: tr.forward(p, cfg, t, valid_BT=v)[0])
    rng = np.random.default_rng(23)
    self.prompts = [rng.integers(4, cfg.vocab_size, n).astype(np.int32) for n in LENGTHS]
    self.runs: dict = {}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("qwen3_parity"))
  return {name: Case(name, root) for name in WORKERS}


def _torch_greedy(model, prompt: np.ndarray):
  """NEW_TOKENS greedy tokens (no stop) and the logits of every step [N, V]."""
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(prompt[None].astype(np.int64)),
                         attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
  return (out.sequences[0, len(prompt):].numpy(),
          torch.stack(out.logits, 0)[:, 0].numpy().astype(np.float64))


@pytest.fixture(scope="module")
def references(cases):
  return {name: [_torch_greedy(case.torch_model, p) for p in case.prompts]
          for name, case in cases.items()}


def _rollout(case: Case, workers: int, tmp, *, lengths: str | None = None, checkpoint=None,
             step_cache=None):
  """Greedy responses of the case's prompts through runner.run on `workers` devices (static
  schedule): {prompt index: response dict}. `lengths`: a lengths file (every response exactly
  NEW_TOKENS, no stop) or None ('model': stop at the checkpoint's stop ids)."""
  c = load_config("qwen3_moe", "tiny")
  c.model.checkpoint = checkpoint or case.path
  c.model.max_seq_len = PAD_T + NEW_TOKENS
  c.mesh.num_devices = workers
  c.rollout.max_prompt_len = PAD_T
  c.rollout.max_new_tokens = NEW_TOKENS
  c.rollout.samples_per_prompt = 1
  c.rollout.slots_per_worker = 2
  c.rollout.wait_compiles = True
  c.rollout.lengths = lengths or "model"
  c.rollout.output_dir = str(tmp)
  c.scheduler.history_path = str(tmp / "history.json")
  c.sampling.temperature = 0.0
  c.schedule = "static"
  prompts = [Prompt(f"p{i}", [int(t) for t in p]) for i, p in enumerate(case.prompts)]
  res = runner.run(c, prompts=prompts, write_outputs=False, progress=False,
                   step_cache=step_cache)
  return {int(r["prompt_id"][1:]): r for r in res.responses}


def _fixed_lengths(path):
  with open(path, "w") as f:
    for i in range(len(LENGTHS)):
      f.write(json.dumps({"id": f"p{i}", "sample": 0, "length": NEW_TOKENS}) + "\n")
  return str(path)


def test_config_and_layout(cases):
  """Every block choice comes from config.json. Qwen3-MoE: q/k norms, head_dim, the two router
  normalisations, the dense layers of mlp_only_layers and decoder_sparse_step, both eos ids.
  GPT-OSS: biases, sinks, the sliding layers of layer_types, YaRN, the clamped SwiGLU."""
  q3, q3s = cases["q3"].cfg, cases["q3s"].cfg
  assert (q3.family, q3.qk_norm, q3.head_dim, q3.num_experts, q3.top_k, q3.norm_topk_prob,
          q3.dense_layers, q3.intermediate_size, q3.dense_intermediate_size, q3.eos_id,
          q3.extra_eos_ids, q3.rms_eps) == ("qwen3_moe", True, 24, 12, 4, True, (1,), 40, 112, 2,
                                           (3,), 1e-6)
  assert (q3s.num_experts, q3s.top_k, q3s.norm_topk_prob, q3s.dense_layers,
          q3s.num_kv_heads) == (32, 8, False, (0, 2), 1)
  p = cases["q3"].params["layers"]
  # the dense layer's weights are the dense stack's one entry; its expert slots are never filled
  assert p["dense_w1"].shape[0] == 1 and np.abs(np.asarray(p["dense_w1"][0])).max() > 0
  assert np.abs(np.asarray(p["w1"][1])).max() == 0
  assert os.path.exists(os.path.join(cases["q3s"].path, hf.INDEX_FILE))
  go, go3 = cases["go"].cfg, cases["go3"].cfg
  assert (go.family, go.attn_bias, go.attn_sinks, go.router, go.router_bias, go.expert_act,
          go.expert_bias, go.swiglu_limit, go.swiglu_alpha, go.sliding_window, go.sliding_layers,
          go.yarn_factor, go.yarn_original_max_position, go.yarn_truncate, go.rope_theta) == (
              "gpt_oss", True, True, "topk_softmax", True, "clamped_swiglu", True, 1.5, 1.702,
              4, (0, 2), 32.0, 4096, False, 150000.0)
  assert (go3.num_experts, go3.sliding_layers, go3.sliding_window) == (32, (1,), 5)
  assert os.path.exists(os.path.join(cases["go3"].path, hf.INDEX_FILE))
  ds, ml = cases["ds"].cfg, cases["ml"].cfg
  assert (ds.family, ds.mla, ds.kv_lora_rank, ds.q_lora_rank, ds.qk_nope_head_dim, ds.head_dim,
          ds.v_head_dim, ds.router, ds.num_experts, ds.top_k, ds.n_group, ds.topk_group,
          ds.routed_scaling_factor, ds.shared_intermediate_size, ds.dense_layers,
          ds.dense_intermediate_size, ds.yarn_factor, ds.yarn_mscale, ds.yarn_mscale_all_dim) == (
              "deepseek_v3", True, 32, 40, 12, 8, 20, "sigmoid_grouped", 12, 4, 4, 2, 2.5, 24,
              (0,), 96, 4.0, 0.707, 0.9)
  assert (ml.q_lora_rank, ml.num_experts, ml.n_group, ml.topk_group, ml.top_k) == (0, 32, 8, 3, 6)
  pd = cases["ds"].params["layers"]
  # the dense stack holds the one dense layer; the correction bias is the checkpoint's
  assert pd["dense_w1"].shape == (1, 64, 96) and np.abs(np.asarray(pd["dense_w1"][0])).max() > 0
  assert np.abs(np.asarray(pd["router_correction"][1:])).min() > 0
  assert "wq_a" in pd and "wq" in cases["ml"].params["layers"]
  assert os.path.exists(os.path.join(cases["ml"].path, hf.INDEX_FILE))


@pytest.mark.parametrize("name", list(WORKERS))
def test_logits_match_torch(cases, name):
  """fp32 logits of a right-padded batch, valid positions only; and each Qwen3 choice matters at
  these weights (a forward without it is far off), so the match is not by accident."""
  case = cases[name]
  tokens = np.zeros((len(LENGTHS), PAD_T), np.int64)
  for b, p in enumerate(case.prompts):
    tokens[b, :len(p)] = p
  valid = np.arange(PAD_T)[None] < LENGTHS[:, None]
  with torch.no_grad():
    ref = case.torch_model(input_ids=torch.tensor(tokens),
                           attention_mask=torch.tensor(valid.astype(np.int64))).logits.numpy()
  ours = np.asarray(case.forward(case.params, jnp.asarray(tokens), jnp.asarray(valid)))
  diff = np.abs(ours - ref)[valid].max()
  print(f"[{name}] logits max|diff| = {diff:.3g} (logit std {ref[valid].std():.2f})")
  assert ref[valid].std() > 0.5, "logits are flat: the test would not distinguish anything"
  assert diff <= LOGIT_TOL

  for what, (params, cfg) in _variants(case).items():
    params = {**params, "layers": {k: v for k, v in params["layers"].items()
                                   if cfg.dense_layers or not k.startswith("dense_")}}
    other = np.asarray(tr.forward(params, cfg, jnp.asarray(tokens), valid_BT=jnp.asarray(valid))[0])
    assert np.abs(other - ref)[valid].max() > 1e-2, what


def _variants(case: Case) -> dict:
  """The case's model with one of its family's choices undone (params, cfg) by name."""
  cfg, params = case.cfg, case.params
  layers = params["layers"]

  def with_layers(**changes):
    return params | {"layers": layers | changes}

  if cfg.family == "qwen3_moe":
    return {"no q/k norm weights": (with_layers(q_norm=jnp.ones_like(layers["q_norm"]),
                                                k_norm=jnp.ones_like(layers["k_norm"])), cfg),
            "other router normalisation": (params, cfg.replace(
                norm_topk_prob=not cfg.norm_topk_prob)),
            "no dense layers": (params, cfg.replace(dense_layers=(), dense_intermediate_size=0))}
  if cfg.family == "deepseek_v3":
    return {"no correction bias": (with_layers(
                router_correction=jnp.zeros_like(layers["router_correction"])), cfg),
            "no group limit": (params, cfg.replace(topk_group=cfg.n_group)),
            "no routing scale": (params, cfg.replace(routed_scaling_factor=1.0)),
            "other router normalisation": (params, cfg.replace(
                norm_topk_prob=not cfg.norm_topk_prob)),
            "no shared expert": (with_layers(shared_w2=jnp.zeros_like(layers["shared_w2"])),
                                 cfg),
            "no dense layers": (params, cfg.replace(dense_layers=(), dense_intermediate_size=0)),
            "no mscale_all_dim": (params, cfg.replace(yarn_mscale_all_dim=0.0)),
            "no YaRN": (params, cfg.replace(yarn_factor=0.0))}
  zeros = {k: jnp.zeros_like(layers[k]) for k in ("bq", "bk", "bv", "bo")}
  out = {"no sinks": (with_layers(sinks=jnp.full_like(layers["sinks"], -1e9)), cfg),
         "no attention biases": (with_layers(**zeros), cfg),
         "no router bias": (with_layers(router_bias=jnp.zeros_like(layers["router_bias"])), cfg),
         "no expert biases": (with_layers(**{k: jnp.zeros_like(layers[k])
                                             for k in ("b1", "b3", "b2")}), cfg),
         "no YaRN": (params, cfg.replace(yarn_factor=0.0)),
         "every layer full": (params, cfg.replace(sliding_window=None, sliding_layers=()))}
  if cfg.swiglu_limit < 2:
    out["no clamp"] = (params, cfg.replace(swiglu_limit=1e9))
  return out


@pytest.mark.parametrize("name", list(WORKERS))
def test_greedy_rollout_matches_torch(cases, references, name, tmp_path, step_caches):
  """Greedy responses of the rollout at each worker count equal torch generate() wherever the
  reference's top-1/top-2 margin is > 1e-3 (the first closer position ends that sequence's
  comparison and is counted; more than 2% such positions fails), and the engine's per-token
  log-probs are within 1e-4 of torch's log-softmax there. Every worker count gives the same
  tokens as one worker, at every position."""
  case = cases[name]
  lengths = _fixed_lengths(tmp_path / "lengths.jsonl")
  runs = {n: _rollout(case, n, tmp_path / f"w{n}", lengths=lengths, step_cache=step_caches)
          for n in WORKERS[name]}
  compared = close = 0
  max_lp = 0.0
  for b, (ref_tok, ref_logits) in enumerate(references[name]):
    ref_lp = ref_logits - np.log(np.exp(ref_logits - ref_logits.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - ref_logits.max(-1, keepdims=True)
    top2 = np.sort(ref_logits, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    for n, run in runs.items():
      r = run[b]
      assert r["num_tokens"] == NEW_TOKENS and r["finish_reason"] == "target", r["finish_reason"]
      assert r["tokens"] == runs[1][b]["tokens"], f"[{name}] seq {b}: {n} workers != 1 worker"
      for i in range(NEW_TOKENS):
        if margin[i] <= MARGIN:
          close += n == 1
          break
        compared += 1
        assert r["tokens"][i] == ref_tok[i], (
            f"[{name}] {n} workers, seq {b} step {i}: ours {r['tokens'][i]} vs torch "
            f"{ref_tok[i]} (margin {margin[i]:.3g})")
        max_lp = max(max_lp, abs(r["logprobs"][i] - ref_lp[i, ref_tok[i]]))
  total = len(LENGTHS) * NEW_TOKENS
  print(f"[{name}] workers {WORKERS[name]}: {compared} token positions compared, {close} of "
        f"{total} too close; log-prob max|diff| {max_lp:.3g}")
  assert close <= MAX_CLOSE_FRACTION * total
  assert compared >= 0.9 * total * len(runs)
  assert max_lp <= LOGIT_TOL
  case.runs.update(runs)


def test_stops_at_any_listed_eos(cases, tmp_path, step_caches):
  """A checkpoint whose eos_token_id lists two ids stops each response at the first of either
  (its second id is a token the greedy responses make; the first one too for another prompt)."""
  case = cases["q3"]
  if 1 not in case.runs:
    pytest.skip("needs test_greedy_rollout_matches_torch[q3]'s responses")
  greedy = {b: r["tokens"] for b, r in case.runs[1].items()}
  first, second = greedy[0][6], greedy[1][4]
  ckpt = tmp_path / "eos"
  shutil.copytree(case.path, ckpt)
  with open(ckpt / "config.json") as f:
    config = json.load(f)
  config["eos_token_id"] = [int(first), int(second)]
  with open(ckpt / "config.json", "w") as f:
    json.dump(config, f)
  os.remove(ckpt / "generation_config.json")  # its stop ids (2, 3) would add to these
  out = _rollout(case, 1, tmp_path / "run", checkpoint=str(ckpt), step_cache=step_caches)
  stops = {int(first), int(second)}
  ended = set()
  for b, toks in greedy.items():
    cut = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))
    assert out[b]["tokens"] == toks[:cut], b
    assert out[b]["finish_reason"] == ("eos" if cut < len(toks) else "length")
    if cut < len(toks):
      ended.add(toks[cut - 1])
  assert ended == stops  # both listed ids ended a response


@pytest.mark.parametrize("name", ["q3", "go", "ds"])
def test_rollout_logprobs_equal_training_forward(cases, name):
  """The GRPO training forward (rl/actor.py: the whole sequence through ep_moe on 4 workers, 3
  experts each; Qwen3's dense layer, GPT-OSS's windows and sinks included) gives the rollout's
  log-probs of its 8-worker greedy responses within 1e-4."""
  case = cases[name]
  if 8 not in case.runs:
    pytest.skip(f"needs test_greedy_rollout_matches_torch[{name}]'s responses")
  responses = [dict(r, prompt_id=f"p{b}") for b, r in sorted(case.runs[8].items())]
  ptoks = {f"p{b}": [int(t) for t in p] for b, p in enumerate(case.prompts)}
  batch, roll = train.build_batch(responses, ptoks, np.zeros(len(responses)), 1,
                                  PAD_T + NEW_TOKENS, 4)
  mesh = mesh_lib.make_ep_mesh(jax.devices()[:4])
  a = actor.Actor(actor.ActorSpec(case.cfg, 4, temperature=1.0, tile_m=8), mesh, None)
  lp = a.logprobs(actor.shard_params(case.params, mesh), batch["tokens"], batch["valid"])
  m = batch["mask"]
  assert m.sum() == len(responses) * NEW_TOKENS
  diff = np.abs(lp - roll)[m]
  print(f"[{name}] training forward vs rollout log-probs: {m.sum()} tokens, max|diff| "
        f"{diff.max():.3g}")
  assert diff.max() <= LOGIT_TOL
  assert np.ptp(roll[m]) > 1.0  # real log-probs, not a constant
