"""tunix's GRPO learner on the elastic rollout: the tiny preset learns the project's verifiable
tasks (sort, add, reverse, count) with flexfloor_jax.integrations.tunix as tunix's rollout
engine. Needs the `[tunix]` extra (docs/tunix.md).

  python scripts/tunix_grpo.py --steps=4                                  # random init, CPU
  python scripts/tunix_grpo.py --checkpoint=sft_out/checkpoint --steps=20  # from the SFT warm start

On CPU, 8 devices are emulated (the mesh the rollout shrinks and tunix trains on). Each step
prints the mean reward and which devices the rollout released, and when.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np
import optax
from grain import python as grain
from jax.sharding import AxisType
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from flexfloor_jax.config import settings
from flexfloor_jax.config.files import load_config
from flexfloor_jax.integrations import tunix as ff_tunix
from flexfloor_jax.model.tokenizer import load_tokenizer
from flexfloor_jax.rl import tasks
from flexfloor_jax.rollout import inputs, runner
from flexfloor_jax.runtime.backend import emulate_cpu_devices, enable_compilation_cache


def reward(prompts, completions, answer, task, **kw):
  """The project's built-in reward (rl/tasks.py) of each completion, as tunix calls a reward."""
  return [tasks.reward({"answer": a, "task": t}, text)
          for text, a, t in zip(completions, answer, task, strict=True)]


class ReportingRollout(ff_tunix.FlexFloorRollout):
  """The flexfloor backend, printing each rollout's reward, measures and releases."""

  def __init__(self, *a, rows, **kw):
    super().__init__(*a, **kw)
    self.by_prompt = {r["prompt"]: r for r in rows}

  def generate(self, prompts, rollout_config, **kw):
    t0 = time.perf_counter()
    out = super().generate(prompts, rollout_config, **kw)
    g = self.last_generation
    assert g is not None  # set by every generate
    rows = [self.by_prompt[p] for p in prompts]
    scores = reward(prompts, out.text, [r["answer"] for r in rows], [r["task"] for r in rows])
    s = g.summary
    print(f"rollout {self.engine.step}: reward {np.mean(scores):.3f}, {s['generated_tokens']} "
          f"tokens in {time.perf_counter() - t0:.1f} s, occupied device-s "
          f"{s['occupied_device_seconds']:.2f}, makespan {s['makespan_s']:.2f} s, released "
          f"(devices, step) {[(r['devices'], r['step']) for r in g.releases]}", flush=True)
    return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--checkpoint", default="", help="'' = random init; an SFT/orbax/HF directory")
  ap.add_argument("--steps", type=int, default=4, help="GRPO steps (one rollout each)")
  ap.add_argument("--lr", type=float, default=3e-4)
  ap.add_argument("--cpu_devices", type=int, default=8)
  args = ap.parse_args()
  emulate_cpu_devices(args.cpu_devices)  # before the first JAX operation
  enable_compilation_cache()

  c = load_config("grpo", "tiny")  # configs/grpo.py: the tasks, group size, lengths at EOS
  c.model.checkpoint = args.checkpoint
  st = settings.load(c, "train")
  rl = st.rl
  assert rl is not None  # load(..., "train") reads the rl section
  cfg = inputs.model_config(st)
  params = runner.load_params(st, cfg)
  rows = tasks.make_prompts(rl.tasks, rl.num_prompts, rl.prompt_seed, rl.task_size)
  group = st.rollout.samples_per_prompt

  mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",), axis_types=(AxisType.Auto,))
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=st.rollout.max_new_tokens,
      max_prompt_length=st.rollout.max_prompt_len, temperature=st.sampling.temperature,
      top_p=st.sampling.top_p, kv_cache_size=st.model.max_seq_len)
  cluster = rl_cluster_lib.RLCluster(
      actor=ff_tunix.FlexFloorModel(params, cfg),
      tokenizer=ff_tunix.TunixTokenizer(load_tokenizer(st.model.checkpoint, cfg)),
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR,
                                                rl_cluster_lib.Role.REFERENCE,
                                                rl_cluster_lib.Role.ROLLOUT)},
          rollout_engine=functools.partial(ReportingRollout, config=st, rows=rows),
          rollout_config=rollout_config,
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=optax.adamw(args.lr), eval_every_n_steps=10**6,
              max_steps=args.steps)))
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=reward,
      algo_config=grpo_learner.GRPOConfig(num_generations=group, num_iterations=1, beta=0.0))

  # the same prompts every step: their lengths repeat, which the scheduler learns
  data = (grain.MapDataset.source(rows).repeat(args.steps).batch(len(rows))
          .map(lambda b: {"prompts": b["prompt"], "answer": b["answer"], "task": b["task"]}))
  learner.train(data)


if __name__ == "__main__":
  main()
