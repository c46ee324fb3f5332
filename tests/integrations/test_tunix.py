"""The flexfloor rollout as tunix's rollout engine (flexfloor_jax/integrations/tunix.py): tunix's
RLCluster and GRPO learner train the tiny preset for 2 rollouts on 8 emulated devices with the
elastic rollout at the elastic tests' shapes, long-tailed (engine_utils.tailed_rollout_config).
Needs the `[tunix]` extra; skipped without it (the names contain `tunix`: `-k 'not tunix'`
deselects them)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import tailed_rollout_config

tunix = pytest.importorskip("tunix")

import optax  # noqa: E402
from flax import nnx  # noqa: E402
from grain import python as grain  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from flexfloor_jax import api  # noqa: E402
from flexfloor_jax.config import settings  # noqa: E402
from flexfloor_jax.integrations import tunix as ff_tunix  # noqa: E402
from flexfloor_jax.model.tokenizer import ByteTokenizer  # noqa: E402
from flexfloor_jax.rollout import inputs, runner  # noqa: E402

PROMPTS = ["Add 27 and 58:", "Sort 3 1 2:", "Count to five:", "Reverse 'expert':"]
GROUP = 4
# the rollout's decode steps and the trainer's forward: one model, two programs (fp32 rounding)
LOGP_TOL = 1e-4


class Recorded(ff_tunix.FlexFloorRollout):
  """The backend, keeping each generate's weights (a copy) and results for the checks."""

  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.calls = []

    self.scored = []

  def generate(self, prompts, rollout_config, **kwargs):
    out = super().generate(prompts, rollout_config, **kwargs)
    self.calls.append(dict(prompts=list(prompts), out=out, gen=self.last_generation,
                           step=self.engine.step - 1,
                           params=jax.tree.map(jnp.copy, self.engine.params)))
    return out

  def get_per_token_logps(self, prompt_tokens, completion_tokens):
    """tunix asks for old-policy log-probs (num_iterations > 1) right after a rollout: kept with
    the full mesh's numbers for the same rows, and how many rows released devices gave."""
    used = self.released_rows_used
    out = super().get_per_token_logps(prompt_tokens, completion_tokens)
    g = self.last_generation
    full = []
    for j, i in enumerate(self.unpad(prompt_tokens, completion_tokens)[2]):
      ref = self.engine.per_token_logps([g.prompt_tokens[i]], [g.tokens[i]])[0]
      full.append((np.asarray(out)[j, :len(ref)], ref, i in g.released_logprobs))
    self.scored.append(dict(rows=full, released=self.released_rows_used - used))
    return out


def reward_letters(prompts, completions, **kw):
  """Lower-case letters in a completion: varies within a group of random-model responses."""
  return [float(sum(c.islower() for c in text)) for text in completions]


@pytest.fixture(scope="module")
def trained(step_caches):
  st = settings.load(tailed_rollout_config())
  cfg = inputs.model_config(st)
  params = runner.load_params(st, cfg)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  actor = ff_tunix.FlexFloorModel(params, cfg)
  rc = base_rollout.RolloutConfig(max_tokens_to_generate=st.rollout.max_new_tokens,
                                  max_prompt_length=st.rollout.max_prompt_len,
                                  kv_cache_size=st.model.max_seq_len, temperature=1.0,
                                  top_p=st.sampling.top_p)
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, tokenizer=ff_tunix.TunixTokenizer(ByteTokenizer()),
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                        rl_cluster_lib.Role.ROLLOUT: mesh},
          rollout_engine=functools.partial(Recorded, config=st, step_cache=step_caches),
          offload_to_cpu=False, rollout_config=rc,
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=4)))
  # two iterations per batch: tunix asks the rollout for old-policy log-probs
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=reward_letters,
      algo_config=grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=2, beta=0.0))
  data = (grain.MapDataset.source(PROMPTS * 4).batch(len(PROMPTS))
          .map(lambda x: {"prompts": x, "answer": x}))
  learner.train(data)
  return dict(cluster=cluster, rollout=cluster.rollout, st=st, rc=rc, learner=learner)


def test_tunix_grpo_trains_two_steps_on_the_elastic_rollout(trained):
  ro = trained["rollout"]
  calls = ro.calls
  assert len(calls) == 2 and [c["step"] for c in calls] == [0, 1]
  assert trained["cluster"].actor_trainer.train_steps == 4
  for c in calls:
    # tunix's order: each prompt num_generations times in a row
    assert c["prompts"] == [p for p in PROMPTS for _ in range(GROUP)]
    assert len(c["out"].tokens) == len(PROMPTS) * GROUP
    # the elastic group released workers in each step
    assert c["gen"].releases and c["gen"].summary["occupied_device_seconds"] > 0
  # the second rollout ran on the weights the first step trained
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                       calls[0]["params"], calls[1]["params"]))
  print(f"tunix GRPO: weight change between rollouts max|diff| {max(diffs):.3g}; releases "
        f"{[[r['devices'] for r in c['gen'].releases] for c in calls]}; weight sync "
        f"{trained['learner'].should_sync_weights}")
  assert max(diffs) > 0
  # the length history kept both steps, keyed by the prompts' token ids
  for ids in ro.engine.encode(PROMPTS):
    assert sorted(ro.engine.history.data[api.prompt_id(ids)]) == [0, 1]


def test_tunix_rollout_tokens_equal_a_direct_api_call(trained, step_caches):
  """Step 1's tokens and log-probs, again from a fresh library engine on the weights that step
  used (another length history, so another schedule: the tokens do not depend on it)."""
  c = trained["rollout"].calls[1]
  eng = api.RolloutEngine(trained["st"], params=c["params"], step_cache=step_caches)
  want = eng.generate(PROMPTS, samples_per_prompt=GROUP, temperature=1.0, step=1)
  got = c["out"]
  assert [t.tolist() for t in got.tokens] == want.tokens
  diff = np.abs(np.concatenate(got.logprobs) - np.concatenate(want.logprobs)).max()
  assert diff == 0


def test_tunix_old_logps_from_released_devices(trained):
  """The old-policy log-probs tunix asked for after each rollout: rows released devices scored
  during it equal the full mesh's program for those rows (the same per-device shapes)."""
  scored = trained["rollout"].scored
  assert len(scored) == 2 and all(s["released"] > 0 for s in scored)
  on_released = [np.abs(lp - ref).max() for s in scored for lp, ref, rel in s["rows"] if rel]
  rest = [np.abs(lp - ref).max() for s in scored for lp, ref, rel in s["rows"] if not rel]
  print(f"old log-probs: {len(on_released)} rows from released devices, max|diff| "
        f"{max(on_released):.3g}; {len(rest)} on the full mesh")
  assert max(on_released) <= 1e-5 and (not rest or max(rest) == 0)


def test_tunix_rollout_layout_and_old_logps(trained):
  """left-padded prompts of max_prompt_length, and get_per_token_logps on tunix's padded
  arrays equal to the rollout's log-probs."""
  ro, rc = trained["rollout"], trained["rc"]
  out = ro.calls[-1]["out"]
  pad = ro.pad_id()
  left = out.left_padded_prompt_tokens
  assert left.shape == (len(out.tokens), rc.max_prompt_length)
  ids = ro.engine.encode(PROMPTS)
  for row, p in zip(left, [t for t in ids for _ in range(GROUP)], strict=True):
    assert row[-len(p):].tolist() == p and (row[:-len(p)] == pad).all()
  width = rc.max_tokens_to_generate
  comp = np.full((len(out.tokens), width), pad, np.int32)
  for i, t in enumerate(out.tokens):
    comp[i, :len(t)] = t
  # the rollout's weights are the trained model's now: back to those of the last rollout, as
  # tunix's weight sync passes them (an nnx state on the devices; nothing may move)
  with jax.transfer_guard("disallow_explicit"):
    ro.update_params(nnx.State({"params": ro.calls[-1]["params"]}))
  logps = np.asarray(ro.get_per_token_logps(left, comp))
  for i, lp in enumerate(out.logprobs):
    n = len(lp)
    assert np.abs(logps[i, :n] - lp).max() <= LOGP_TOL and (logps[i, n:] == 0).all()


def test_tunix_rollout_config_fields_it_cannot_honour(trained):
  ro, rc = trained["rollout"], trained["rc"]
  for change, field in ((dict(max_tokens_to_generate=5), "max_tokens_to_generate"),
                        (dict(max_prompt_length=500), "max_prompt_length"),
                        (dict(eos_tokens=[1, 2]), "eos_tokens"),
                        (dict(tensor_parallel_size=2), "tensor_parallel_size")):
    with pytest.raises(ValueError, match=rf"^RolloutConfig\.{field}="):
      ro.generate(PROMPTS, dataclasses.replace(rc, **change))
  with pytest.raises(ValueError, match=r"^prompts\[0\]: 15 tokens, more than "
                     r"RolloutConfig\.max_prompt_length=10$"):
    ro.generate([p for p in PROMPTS for _ in range(GROUP)],
                dataclasses.replace(rc, max_prompt_length=10))
