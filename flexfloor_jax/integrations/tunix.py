"""The elastic rollout as tunix's rollout engine (google-tunix, `pip install -e '.[tunix]'`).

    model = FlexFloorModel(params, model_cfg)           # the actor tunix trains
    cluster = rl_cluster.RLCluster(
        actor=model, reference=ref, tokenizer=TunixTokenizer(ByteTokenizer()),
        cluster_config=rl_cluster.ClusterConfig(
            rollout_engine=functools.partial(FlexFloorRollout, config=rollout_config), ...))

RLCluster builds the engine as `engine(rollout_actor=, tokenizer=, mesh=, rollout_config=)`;
the partial adds the project's rollout config (mesh, schedule, slots, lengths, prompt and
response bounds). tunix sends each prompt `num_generations` times in a row: a run of equal
prompts becomes one prompt with that many samples (one GRPO group on the scheduler), and the
rows come back in tunix's order.
"""

# The module needs google-tunix, an optional extra; the project's own environment checks it
# without one.
# pyright: reportMissingImports=false

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from flexfloor_jax import api
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import ModelConfig
from flexfloor_jax.model.tokenizer import Tokenizer


class FlexFloorModel(nnx.Module):
  """The project's params pytree as nnx.Params (state path `params/<leaf path>`), called as
  tunix's trainer calls a model: `model(tokens, positions, cache, attention_mask)` -> (logits,
  None). Rows are tunix's left-padded prompt + right-padded completion; the valid tokens of a
  row (the attention mask's diagonal) are moved to its front, run through the project's full
  forward at positions 0.. as the rollout saw them, and the logits moved back."""

  def __init__(self, params: tfm.Params, cfg: ModelConfig):
    self.cfg = cfg
    self.params = nnx.data(jax.tree.map(nnx.Param, params))

  def __call__(self, x, positions=None, cache=None, attention_mask=None, **kwargs):
    del positions, cache, kwargs  # positions follow from the mask; no KV cache in training
    params = jax.tree.map(lambda p: p[...], self.params,
                          is_leaf=lambda p: isinstance(p, nnx.Variable))
    valid = (jnp.ones(x.shape, bool) if attention_mask is None
             else jnp.diagonal(attention_mask, axis1=1, axis2=2).astype(bool))
    order = jnp.argsort(~valid, axis=1, stable=True)  # valid tokens first, in their order
    tokens = jnp.take_along_axis(x, order, axis=1)
    logits, _ = tfm.forward(params, self.cfg, tokens,
                            valid_BT=jnp.take_along_axis(valid, order, axis=1))
    back = jnp.argsort(order, axis=1)
    return jnp.take_along_axis(logits, back[..., None], axis=1), None


def params_of(state) -> tfm.Params:
  """The params pytree of a FlexFloorModel's nnx state (what tunix's weight sync passes)."""
  pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
  if not isinstance(pure, dict) or "params" not in pure:
    raise ValueError("update_params: expected the nnx state of a FlexFloorModel (a 'params' "
                     f"entry), got {type(state).__name__}")
  return pure["params"]


class TunixTokenizer:
  """A project tokenizer with the methods tunix's TokenizerAdapter asks for."""

  def __init__(self, tokenizer: Tokenizer):
    self.inner = tokenizer

  def encode(self, text: str, **kwargs) -> list[int]:
    return self.inner.encode(text, add_bos=bool(kwargs.get("add_bos", False)))

  def decode(self, ids, **kwargs) -> str:
    return self.inner.decode([int(i) for i in ids])

  def bos_id(self) -> int | None:
    return self.inner.bos_id

  def eos_id(self) -> int | None:
    return self.inner.eos_id

  def pad_id(self) -> int | None:
    return self.inner.pad_id


# RolloutConfig fields the engine cannot honour, with the values it can (others are left to the
# engines they name: vllm, sglang_jax)
_FIXED = {"tensor_parallel_size": (-1, 1), "expert_parallel_size": (-1, 1)}


class FlexFloorRollout(base_rollout.BaseRollout):
  """tunix's BaseRollout over api.RolloutEngine (see the module docstring)."""

  def __init__(self, rollout_actor: FlexFloorModel, tokenizer=None, mesh=None,
               rollout_config: base_rollout.RolloutConfig | None = None, *, config,
               step_cache=None, score_released: bool = True):
    """`rollout_actor`: the FlexFloorModel whose weights the first rollout uses; `config`: the
    project's rollout config (settings.Settings or a config dict); `mesh`: tunix's rollout mesh,
    whose devices become the workers. `tokenizer` is tunix's adapter: the engine decodes with
    the project's tokenizer of `config` (pass a TunixTokenizer of the same one to RLCluster).
    `score_released`: released devices compute the old-policy log-probs of finished responses
    during the rollout; get_per_token_logps returns those for the rows they cover while the
    weights are still the rollout's."""
    del tokenizer
    if not isinstance(rollout_actor, FlexFloorModel):
      raise ValueError(f"rollout_actor: a FlexFloorModel, got {type(rollout_actor).__name__}")
    self._model = rollout_actor
    devices = list(np.asarray(mesh.devices).reshape(-1)) if mesh is not None else None
    self.engine = api.RolloutEngine(config, params_of(nnx.state(rollout_actor, nnx.Param)),
                                    devices=devices, step_cache=step_cache,
                                    score_released=score_released)
    if rollout_config is not None:
      self._check(rollout_config)
    self._temperature = self.engine.settings.sampling.temperature
    self.last_generation: api.Generation | None = None  # releases, summary of the last call
    self._generated_with: list = []  # the weights (leaves) the last generation ran with
    self.released_rows_used = 0  # rows get_per_token_logps took from released devices

  def _check(self, rc: base_rollout.RolloutConfig) -> None:
    """A RolloutConfig field the engine cannot honour: ValueError naming it."""
    e = self.engine
    cfg = e.model_cfg
    if rc.max_tokens_to_generate != e.max_new_tokens:
      raise ValueError(f"RolloutConfig.max_tokens_to_generate={rc.max_tokens_to_generate}: the "
                       f"engine is built for rollout.max_new_tokens={e.max_new_tokens}")
    if rc.max_prompt_length > e.max_prompt_length:
      raise ValueError(f"RolloutConfig.max_prompt_length={rc.max_prompt_length} exceeds the "
                       f"engine's rollout.max_prompt_len={e.max_prompt_length}")
    eos = set(cfg.stop_ids)
    if rc.eos_tokens is not None and not set(rc.eos_tokens) <= eos:
      raise ValueError(f"RolloutConfig.eos_tokens={list(rc.eos_tokens)}: the model stops at "
                       f"{sorted(eos)} only")
    if rc.data_type is not None and np.dtype(rc.data_type) != np.dtype(cfg.dtype):
      raise ValueError(f"RolloutConfig.data_type={np.dtype(rc.data_type).name}: the engine "
                       f"runs in model.dtype={cfg.dtype}")
    for name, ok in _FIXED.items():
      if getattr(rc, name) not in ok:
        raise ValueError(f"RolloutConfig.{name}={getattr(rc, name)}: the engine lays out its "
                         "own expert-parallel mesh over the rollout mesh's devices")

  # -- BaseRollout
  def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
               **kwargs) -> base_rollout.RolloutOutput:
    self._check(rollout_config)
    prompts = [str(p) for p in prompts]  # numpy strings from a grain batch compare as arrays
    if not prompts:
      raise ValueError("prompts: an empty list")
    runs = _runs(prompts)
    group = runs[0][1] if len({n for _, n in runs}) == 1 else 1
    unique = [p for p, n in runs for _ in range(n // group)]
    rc = rollout_config
    ids = self.engine.encode(unique)
    for i, t in enumerate(ids):
      if len(t) > rc.max_prompt_length:  # tunix's left-padded prompt array could not hold it
        raise ValueError(f"prompts[{i * group}]: {len(t)} tokens, more than "
                         f"RolloutConfig.max_prompt_length={rc.max_prompt_length}")
    temperature = float(rc.temperature)
    seed = None if rc.seed is None else int(np.asarray(rc.seed).reshape(-1)[0])
    self._sync_from_model()
    out = self.engine.generate(ids, samples_per_prompt=group, temperature=temperature,
                               top_p=1.0 if rc.top_p is None else float(rc.top_p),
                               top_k=0 if rc.top_k is None or rc.top_k < 0 else int(rc.top_k),
                               seed=seed)
    self._temperature = temperature
    self.last_generation = out
    self._generated_with = jax.tree.leaves(self.engine.params)
    width, pad = rc.max_prompt_length, self.pad_id()
    left = np.full((len(out.tokens), width), pad, np.int32)
    for i, p in enumerate(out.prompt_tokens):
      left[i, width - len(p):] = p
    return base_rollout.RolloutOutput(
        text=[t or "" for t in out.text], logits=None,
        tokens=[np.asarray(t, np.int32) for t in out.tokens], left_padded_prompt_tokens=left,
        logprobs=[np.asarray(lp, np.float32) for lp in out.logprobs])

  def get_per_token_logps(self, prompt_tokens, completion_tokens) -> jax.Array:
    """[B, C] log-probs of the completion tokens (0 at padding), under the current params at the
    last generate's temperature: the rollout's old-policy log-probs."""
    self._sync_from_model()
    prompts, comps, rows = self.unpad(prompt_tokens, completion_tokens)
    done = self._released_rows()
    have = {j: done[i] for j, i in enumerate(rows) if i in done}
    rest = [j for j in range(len(prompts)) if j not in have]
    if rest:
      got = self.engine.per_token_logps([prompts[j] for j in rest], [comps[j] for j in rest],
                                        temperature=self._temperature)
      have.update(zip(rest, got, strict=True))
    self.released_rows_used += len(prompts) - len(rest)
    out = np.zeros(np.shape(completion_tokens), np.float32)
    for j, r in have.items():
      out[j, :len(r)] = r
    return jnp.asarray(out)

  def unpad(self, prompt_tokens, completion_tokens) -> tuple[list, list, list]:
    """(prompts, completions, row of the last generation or None) of tunix's left-padded
    prompts and right-padded completions. A row of the last generation keeps its exact tokens
    (a sampled token may be the pad id); any other loses its trailing pads."""
    pad = self.pad_id()
    p, c = np.asarray(prompt_tokens), np.asarray(completion_tokens)
    g, width = self.last_generation, c.shape[1]
    known = {} if g is None else {
        (tuple(q), tuple(t) + (pad,) * (width - len(t))): i
        for i, (q, t) in enumerate(zip(g.prompt_tokens, g.tokens, strict=True))}
    prompts, comps, rows = [], [], []
    for q, r in zip(p, c, strict=True):
      q = q[np.argmax(q != pad):].tolist() if (q != pad).any() else []  # left padding
      i = known.get((tuple(q), tuple(r.tolist())))
      if i is not None and g is not None:
        comps.append(list(g.tokens[i]))
      else:
        keep = np.flatnonzero(r != pad)
        comps.append(r[:keep[-1] + 1 if len(keep) else 0].tolist())
      prompts.append(q)
      rows.append(i)
    return prompts, comps, rows

  def _released_rows(self) -> dict:
    """{row of the last generation: log-probs} the released devices computed during it, while
    the weights are still the ones it ran with ({} otherwise)."""
    g = self.last_generation
    leaves = jax.tree.leaves(self.engine.params)
    if g is None or len(leaves) != len(self._generated_with) or any(
        a is not b for a, b in zip(leaves, self._generated_with, strict=True)):
      return {}
    return dict(g.released_logprobs)

  def _sync_from_model(self) -> None:
    """The model's current Params into the engine, left on their devices: tunix shares the
    trainer's model with a rollout engine that is not its own vanilla one, and trains it in
    place without a weight sync."""
    self.engine.update_params(params_of(nnx.state(self._model, nnx.Param)))

  def update_params(self, params, filter_types: tuple[Any, ...] | None = None) -> None:
    """The nnx state of a FlexFloorModel (tunix's weight sync: the trainer's Params, on their
    devices), into the model and the engine; nothing moves between host and devices."""
    del filter_types
    tree = params_of(params)
    self.engine.update_params(tree)
    nnx.update(self._model, {"params": tree})

  def pad_id(self) -> int:
    tok = self.engine.tokenizer
    pad = getattr(tok, "pad_id", None) if tok is not None else None
    return int(pad) if pad is not None else 0

  def eos_id(self) -> int:
    return int(self.engine.model_cfg.eos_id)

  def model(self) -> FlexFloorModel:
    return self._model


def _runs(prompts: list[str]) -> list[tuple[str, int]]:
  """Runs of equal consecutive prompts: [(prompt, count)]."""
  out: list[tuple[str, int]] = []
  for p in prompts:
    if out and out[-1][0] == p:
      out[-1] = (p, out[-1][1] + 1)
    else:
      out.append((p, 1))
  return out
