"""The library API (flexfloor_jax/api.py) on 8 emulated devices, tiny preset at the elastic tests'
shapes with a long-tailed workload (engine_utils.tailed_rollout_config: the same compiled steps):
in-memory prompts as strings or token ids, results in input order, the length history keyed by
a hash of the token ids, no compile on a second call with other prompts, another count and
another temperature, new weights on devices without a transfer, old-policy log-probs equal to
the rollout's (on released devices too), and every bad input refused before the engine."""

import json

import jax
import numpy as np
import pytest
from engine_utils import CompileCounter, tailed_rollout_config

from flexfloor_jax import api
from flexfloor_jax.config import settings
from flexfloor_jax.rl import actor
from flexfloor_jax.rollout import runner
from flexfloor_jax.runtime import mesh as mesh_lib

PROMPTS = ["Add 27 and 58:", "Sort 3 1 2:", "Count to five:", "Reverse 'expert':"]
# Two programs of the same math (the rollout's decode steps, the trainer's full forward) differ
# by fp32 rounding, compiled with the suite's flags as well; a wrong token, position or
# temperature moves a log-prob by far more.
LOGP_TOL = 1e-4


@pytest.fixture(scope="module")
def eng(step_caches):
  return api.RolloutEngine(tailed_rollout_config(), step_cache=step_caches, score_released=True)


@pytest.fixture(scope="module")
def first(eng):
  """The first call: strings, the config's 4 samples each, step 0."""
  return eng.generate(PROMPTS, step=0)


def test_generate_returns_rows_in_input_order_with_the_rollout_summary(eng, first):
  n = 4
  ids = eng.encode(PROMPTS)
  assert first.prompt_tokens == [t for t in ids for _ in range(n)]
  assert len(first.tokens) == len(first.logprobs) == len(first.finish_reasons) == 16
  for toks, lps, text in zip(first.tokens, first.logprobs, first.text, strict=True):
    assert 1 <= len(toks) == len(lps) <= eng.max_new_tokens
    assert np.isfinite(lps).all() and max(lps) <= 0
    assert text == eng.tokenizer.decode(toks)
  # the workload's lengths (no checkpoint): every row ran to its target, and they differ
  assert set(first.finish_reasons) == {"target"} and len({len(t) for t in first.tokens}) > 1
  s = first.summary
  assert s["num_sequences"] == 16 and s["generated_tokens"] == sum(map(len, first.tokens))
  assert s["occupied_device_seconds"] > 0 and s["makespan_s"] > 0
  # the elastic group shrank, and the caller heard which devices left and when
  assert first.releases and all(r["devices"] and r["step"] > 0 for r in first.releases)
  released = [d for r in first.releases for d in r["devices"]]
  assert len(released) == len(set(released)) < 8
  assert set(released) <= {d.id for d in jax.devices()}
  # the history is keyed by the token ids' hash, at the call's step
  for t in ids:
    assert eng.history.data[api.prompt_id(t)][0]
  assert first.routes is None


def test_same_call_again_same_tokens_and_history_grows(eng, first):
  """Token ids give what their strings gave (same prompt ids, hence the same keyed samples), and
  a second step's lengths join the same history entries."""
  again = eng.generate(eng.encode(PROMPTS), step=0)
  assert again.tokens == first.tokens
  assert np.abs(np.concatenate(again.logprobs) - np.concatenate(first.logprobs)).max() == 0
  eng.generate(PROMPTS[:2], step=1)
  for t in eng.encode(PROMPTS[:2]):
    assert sorted(eng.history.data[api.prompt_id(t)]) == [0, 1]


def test_second_generate_compiles_nothing(eng, first):
  """Other prompts (token ids and strings, other lengths), another count of prompts and samples,
  another temperature: the executables of the first call serve it."""
  prompts = [[257, 72, 105], "What is 9 times 7?", [257] + [65] * 40]
  with CompileCounter() as cc:
    out = eng.generate(prompts, samples_per_prompt=2, temperature=0.7, step=5)
  assert cc.count == 0, f"compiles: {cc.messages[:5]} {cc.events[:5]}"
  assert len(out.tokens) == 6 and out.prompt_tokens[4] == [257] + [65] * 40


def test_temperature_is_a_runtime_input(eng):
  """Greedy (T = 0) is the argmax whatever the key: another step (whose workload lengths
  differ) and another sample give the same tokens as far as both go, and the recorded log-probs
  are the unscaled model's (they equal per_token_logps at T = 1)."""
  a = eng.generate(PROMPTS[:2], samples_per_prompt=2, temperature=0.0, step=3)
  b = eng.generate(PROMPTS[:2], samples_per_prompt=2, temperature=0.0, step=4)
  rows = [a.tokens[0], a.tokens[1], b.tokens[0], b.tokens[1]]
  m = min(map(len, rows))
  assert m > 0 and all(r[:m] == rows[0][:m] for r in rows)
  assert sum(map(len, a.tokens + b.tokens)) > 4 * m  # lengths differ: the prefixes are checked
  t = eng.generate(PROMPTS[:2], samples_per_prompt=2, temperature=1.0, step=3)
  assert t.tokens != a.tokens
  ref = eng.per_token_logps(a.prompt_tokens, a.tokens, temperature=1.0)
  diff = max(np.abs(np.asarray(x) - r).max() for x, r in zip(a.logprobs, ref, strict=True))
  assert diff <= LOGP_TOL


def test_per_token_logps_equal_the_rollouts(eng, first):
  ref = eng.per_token_logps(first.prompt_tokens, first.tokens)
  assert [len(r) for r in ref] == [len(t) for t in first.tokens]
  diff = max(np.abs(np.asarray(x) - r).max() for x, r in zip(first.logprobs, ref, strict=True))
  print(f"per_token_logps vs rollout: max|diff| {diff:.3g}")
  assert diff <= LOGP_TOL


def test_released_devices_score_finished_responses(eng, first):
  """Rows finished before a release got their log-probs from the released devices, equal to
  per_token_logps (one program's per-device shapes on a one-device mesh and on all 8)."""
  got = first.released_logprobs
  assert 0 < len(got) < len(first.tokens)
  rows = sorted(got)
  ref = eng.per_token_logps([first.prompt_tokens[i] for i in rows],
                            [first.tokens[i] for i in rows])
  diff = max(np.abs(got[i] - r).max() for i, r in zip(rows, ref, strict=True))
  print(f"released devices scored {len(rows)} of {len(first.tokens)} rows: max|diff| {diff:.3g}")
  assert diff <= 1e-5
  assert all(len(got[i]) == len(first.tokens[i]) for i in rows)


def test_caller_ids_give_the_clis_rollout(eng, tmp_path, step_caches):
  """With the prompt ids a JSONL file gives the CLI, generate returns the CLI runner's responses
  (the same keys, tokens and log-probs) and keeps the history under those ids."""
  ids = ["q-a", "q-b"]
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                          for i, p in zip(ids, PROMPTS[:2], strict=True)))
  c = tailed_rollout_config()
  c.rollout.prompts, c.rollout.epoch = str(path), 7
  # a history of its own: the checkout's rollout_out/ may hold the main job's (other lengths)
  c.rollout.output_dir = str(tmp_path / "out")
  res = runner.run(c, params=eng.params, write_outputs=False, progress=False,
                   step_cache=step_caches)
  out = eng.generate(PROMPTS[:2], prompt_ids=ids, step=7)
  assert out.responses and [(r["prompt_id"], r["sample"], r["tokens"]) for r in out.responses] \
      == [(r["prompt_id"], r["sample"], r["tokens"]) for r in res.responses]
  assert [r["logprobs"] for r in out.responses] == [r["logprobs"] for r in res.responses]
  assert sorted(eng.history.data["q-a"]) == [7]


def _trainer_params(eng, seed: int):
  """Another init of the same model, laid out as the trainer holds it (experts sharded over
  their axis, the rest replicated) on the same devices."""
  st = eng.settings.replace(model=dict(init_seed=seed))
  return actor.shard_params(runner.load_params(st, eng.model_cfg),
                            mesh_lib.make_ep_mesh(eng.devices))


def test_update_params_moves_nothing_and_matches_a_fresh_engine(eng, step_caches):
  new = _trainer_params(eng, seed=3)
  old = eng.generate(PROMPTS, temperature=0.0, step=0)
  with jax.transfer_guard("disallow_explicit"):  # no transfer at all, explicit ones included
    eng.update_params(new)
  got = eng.generate(PROMPTS, temperature=0.0, step=0)
  fresh = api.RolloutEngine(tailed_rollout_config(), params=new, step_cache=step_caches)
  want = fresh.generate(PROMPTS, temperature=0.0, step=0)
  assert got.tokens == want.tokens and got.tokens != old.tokens
  diff = np.abs(np.concatenate(got.logprobs) - np.concatenate(want.logprobs)).max()
  assert diff == 0  # the same programs on the same weights
  # per_token_logps follows the new weights too
  ref = eng.per_token_logps(got.prompt_tokens, got.tokens, temperature=1.0)
  assert max(np.abs(np.asarray(x) - r).max()
             for x, r in zip(got.logprobs, ref, strict=True)) <= LOGP_TOL


@pytest.mark.parametrize("prompts, message", [
    ([], "prompts: an empty list"),
    ([[257, 72], []], "prompts[1]: empty"),
    ([[257, 300]], "prompts[0]: token id 300 outside the vocabulary of 259"),
    ([[257] * 49], "prompts[0]: 49 tokens, more than rollout.max_prompt_len=48"),
    (["x" * 60], "prompts[0]: 61 tokens, more than rollout.max_prompt_len=48"),
])
def test_bad_prompts_fail_before_the_engine(eng, no_compile, prompts, message):
  with pytest.raises(ValueError) as e:
    eng.generate(prompts)
  assert str(e.value) == message


def test_bad_settings_fail_before_the_engine(eng, no_compile):
  for kw, field in ((dict(samples_per_prompt=0), "samples_per_prompt"),
                    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                    (dict(prompt_ids=["a", "a", "b", "c"]), "prompt_ids"),
                    (dict(prompt_ids=["a"]), "prompt_ids")):
    with pytest.raises(ValueError, match=rf"^{field}: "):
      eng.generate(PROMPTS, **kw)


def test_update_params_tree_mismatch_names_the_leaf(eng):
  params = eng.params
  missing = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "w1"}}
  with pytest.raises(ValueError, match=r"^update_params: leaf layers/w1 is missing$"):
    eng.update_params(missing)
  reshaped = {**params, "embed": params["embed"][:-1]}
  v, d = params["embed"].shape
  with pytest.raises(ValueError, match=rf"^update_params: leaf embed is float32\[{v - 1}, {d}\], "
                     rf"the engine's is float32\[{v}, {d}\]$"):
    eng.update_params(reshaped)
  assert eng.params is params  # a refused update leaves the weights as they were


def test_settings_are_checked_once(step_caches):
  """A config is checked by settings.load: a bad field fails at construction."""
  c = tailed_rollout_config()
  c.rollout.max_new_tokens = 0
  with pytest.raises(settings.ConfigError, match="rollout.max_new_tokens"):
    api.RolloutEngine(c, step_cache=step_caches)
