"""Released-device reuse (rl/reuse.py): during a flexfloor rollout the released workers compute
the log-probs of responses already finished, one device each, and those equal the full mesh's
training-forward log-probs bitwise (fixed per-device shapes, mesh-size invariant MoE)."""

import json

import jax
import numpy as np
from rl_utils import grpo_config

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.model.tokenizer import ByteTokenizer
from flexfloor_jax.rl import actor, reuse, tasks, train
from flexfloor_jax.rollout import runner
from flexfloor_jax.runtime import mesh as mesh_lib


def test_released_workers_logprobs_equal_full_mesh(tmp_path, step_caches):
  c = grpo_config(tmp_path)
  c.rollout.prompts = str(tmp_path / "prompts.jsonl")
  c.rollout.output_dir = str(tmp_path)
  rows = tasks.make_prompts(c.rl.tasks, c.rl.num_prompts, seed=5, size=2)
  tasks.write_prompts_jsonl(rows, c.rollout.prompts)
  # Fixed, spread-out response lengths (a random model rarely says EOS): workers finish one by
  # one and are released while the others still generate.
  g = c.rollout.samples_per_prompt
  lengths = [(r["id"], s) for r in rows for s in range(g)]
  c.rollout.lengths = str(tmp_path / "lengths.jsonl")
  with open(c.rollout.lengths, "w") as f:
    for i, (pid, s) in enumerate(lengths):
      f.write(json.dumps({"id": pid, "sample": s, "length": 2 + i}) + "\n")
  cfg = PRESETS["tiny"]
  params = tfm.init_params(cfg, jax.random.key(12), scale=0.1)
  tok = ByteTokenizer()
  ptoks = {r["id"]: tok.encode(r["prompt"], add_bos=True) for r in rows}
  t_max = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  mesh = mesh_lib.make_ep_mesh(jax.devices())
  spec = actor.ActorSpec(cfg, 8, temperature=1.0, tile_m=8)
  p_mesh = actor.shard_params(params, mesh)
  scorer = reuse.ReleasedScorer(spec, jax.devices(), jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), t_max)
  scorer.wait_compiled()
  scorer.reset(p_mesh, ptoks)
  released = []
  res = runner.run(c, params=params, model_cfg=cfg, tokenizer=tok, write_outputs=False,
                   progress=False, step_cache=step_caches,
                   on_release=lambda d, f: (released.append(len(d)), scorer.on_release(d, f)))
  done = scorer.results()
  scorer.close()
  assert sum(released) >= 4  # workers were released mid-rollout
  assert len(done) >= len(res.responses) // 2, len(done)
  batch, _ = train.build_batch(res.responses, ptoks, np.zeros(len(res.responses)), g, t_max, 8)
  lp = actor.Actor(spec, mesh, None).logprobs(p_mesh, batch["tokens"], batch["valid"])
  m = batch["mask"]
  for i, r in enumerate(res.responses):
    key = (r["prompt_id"], r["sample"])
    if key in done:
      assert np.array_equal(done[key][m[i]], lp[i][m[i]]), key
      assert np.array_equal(done[key], lp[i]), key  # padding positions too
  print(f"released workers scored {len(done)} of {len(res.responses)} responses: bitwise equal")
