"""The library API: an elastic rollout engine that another trainer calls in memory.

    engine = RolloutEngine(config, params, tokenizer)
    out = engine.generate(["Add 2 and 3:", [257, 83, 111]], samples_per_prompt=4, step=0)
    engine.update_params(new_params)  # on devices, in the trainer's sharding
    logps = engine.per_token_logps(prompt_tokens, completion_tokens)

Built once, the object keeps what a rollout would otherwise rebuild: the compiled steps of every
mesh size it may release to (a StepCachePool), the length history the scheduler predicts from,
and the memory floor, which cannot move because the KV cache length is fixed at
rollout.max_prompt_len + rollout.max_new_tokens. Any prompts within that bound, any number of
them and any temperature then reuse the same executables; top_p and top_k are compiled in, so a
new value of either compiles once.

A prompt's identity in the length history is a hash of its token ids, so a trainer that sends
the same question as a string at every step keeps its history. Every input is checked before
anything is transferred or compiled: ValueError, one line naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, NoReturn

import jax
import numpy as np

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.config import settings
from flexfloor_jax.model.config import model_identity
from flexfloor_jax.model.tokenizer import load_tokenizer
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.rl import actor as actor_lib
from flexfloor_jax.rl.reuse import ReleasedScorer
from flexfloor_jax.rollout import inputs, runner
from flexfloor_jax.rollout.inputs import Prompt
from flexfloor_jax.runtime import mesh as mesh_lib


@dataclasses.dataclass
class Generation:
  """One `generate` call's results, row r = prompt r // samples_per_prompt, sample
  r % samples_per_prompt (a prompt's samples adjacent, as GRPO groups them)."""
  prompt_tokens: list[list[int]]
  tokens: list[list[int]]
  text: list[str | None]
  logprobs: list[list[float]]  # log_softmax(logits / T) of each generated token
  finish_reasons: list[str]  # 'eos' | 'length' | 'target' (a workload's fixed length)
  routes: list[np.ndarray] | None  # [prompt + tokens - 1, layers, top_k] when record_routes
  # Devices the rollout released, in order: {"devices": [device ids], "step": SPMD step}
  releases: list[dict]
  summary: dict  # summary.json's measures (occupied_device_seconds, makespan_s, ...)
  # row -> its tokens' log-probs as per_token_logps gives them, computed by released devices
  # while the rest generated (score_released; rows finished before a release only)
  released_logprobs: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
  # the rows as the rollout CLI writes them to responses.jsonl (prompt_id, sample, tokens, text,
  # finish_reason, num_tokens, logprobs, worker[, routes])
  responses: list[dict] = dataclasses.field(default_factory=list)


def prompt_id(tokens: Sequence[int]) -> str:
  """The length history's key of a prompt: a hash of its token ids."""
  return hashlib.sha1(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:20]


def _fail(msg: str) -> NoReturn:
  raise ValueError(msg)


class RolloutEngine:
  """An elastic rollout engine kept across calls (see the module docstring)."""

  def __init__(self, config, params=None, tokenizer=None, *, devices=None, model_cfg=None,
               history: LengthHistory | None = None,
               step_cache: engine_lib.StepCachePool | None = None, score_released: bool = False):
    """`config`: a rollout config (configs/mixtral.py) or its settings.Settings. `params`: the
    model's params pytree (None: the config's checkpoint, else random init); `tokenizer`: None =
    the checkpoint's (or the byte vocabulary's); `model_cfg`: the model's shape when the caller
    has it (default: the checkpoint's inventory or the preset's); `history`: a length history to
    continue (default: scheduler.history_path's when set, saved there after every call; else an
    empty one);
    `step_cache`: a StepCachePool to share compiled steps with other engines of the same shapes
    (default: the engine's own). `score_released`: devices the rollout releases compute the
    old-policy log-probs of the responses finished by then (Generation.released_logprobs; the
    flexfloor schedule on one process, at the config's temperature)."""
    st = settings.as_settings(config)
    if model_cfg is None:
      model_cfg = inputs.model_config(st)
    r = st.rollout
    # One KV cache length for every call: the compiled shapes and the floor never move.
    seq_len = st.model.max_seq_len or min(r.max_prompt_len + r.max_new_tokens,
                                          model_cfg.max_position_embeddings)
    try:  # a prompt of the full width and its longest response fit the cache
      settings.check_cache(r, seq_len, r.max_prompt_len)
    except settings.ConfigError as e:
      _fail(f"rollout.max_prompt_len: {e}")
    # wait_compiles: every mesh size is compiled before the first call's first step, so that no
    # later call (other prompts, another count) compiles
    self.settings = st.replace(model=dict(max_seq_len=seq_len), rollout=dict(wait_compiles=True))
    self.model_cfg = model_cfg
    self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(
        st.model.checkpoint, model_cfg)
    try:
      self.devices = list(devices) if devices is not None else mesh_lib.select_devices(
          st.mesh.num_devices)
    except ValueError as e:
      _fail(f"mesh.num_devices: {e}")
    self._history_path = st.scheduler.history_path
    if history is None:
      history = (inputs.load_history(st, model_cfg) if self._history_path
                 else LengthHistory(model=model_identity(model_cfg)))
    self.history = history
    self.params = params if params is not None else runner.load_params(st, model_cfg)
    self._paths, self._leaves = _leaf_table(self.params)
    self._steps = step_cache if step_cache is not None else engine_lib.StepCachePool()
    self._actor: actor_lib.Actor | None = None
    self._actor_params = None  # the params the actor's copy was made of, and that copy
    self.step = 0  # the next call's default step (keys the sampling)
    self._scorer: ReleasedScorer | None = None
    if score_released and st.schedule == "flexfloor" and jax.process_count() == 1:
      # compiled for every device in the background now; each generate waits for it
      self._scorer = ReleasedScorer(
          self._actor_spec(self._scoring_temperature()), self.devices,
          jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params), seq_len)

  @property
  def max_prompt_length(self) -> int:
    return self.settings.rollout.max_prompt_len

  @property
  def max_new_tokens(self) -> int:
    return self.settings.rollout.max_new_tokens

  # -- generate
  def encode(self, prompts: Sequence[str | Sequence[int] | np.ndarray]) -> list[list[int]]:
    """Token ids of each prompt (a string gets the tokenizer's BOS first), checked: ValueError
    naming the prompt when it is empty, too long or has an id outside the vocabulary."""
    if isinstance(prompts, str):
      _fail("prompts: a list of strings or token-id lists, got one string")
    prompts = list(prompts)  # a numpy batch too: rows of ids, or strings
    if not prompts:
      _fail("prompts: an empty list")
    out = []
    v, lp = self.model_cfg.vocab_size, self.max_prompt_length
    for i, p in enumerate(prompts):
      if isinstance(p, str):
        if self.tokenizer is None:
          _fail(f"prompts[{i}]: a string, but the model has no tokenizer (give token ids)")
        ids = self.tokenizer.encode(p, add_bos=True)
      else:
        arr = np.asarray(p)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
          _fail(f"prompts[{i}]: token ids must be a flat list of ints")
        ids = arr.astype(np.int64).tolist()
      if not ids:
        _fail(f"prompts[{i}]: empty")
      bad = [t for t in ids if not 0 <= t < v]
      if bad:
        _fail(f"prompts[{i}]: token id {bad[0]} outside the vocabulary of {v}")
      if len(ids) > lp:
        _fail(f"prompts[{i}]: {len(ids)} tokens, more than rollout.max_prompt_len={lp}")
      out.append(ids)
    return out

  def generate(self, prompts: Sequence[str | Sequence[int] | np.ndarray], *,
               samples_per_prompt: int | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
               step: int | None = None, on_release=None,
               prompt_ids: Sequence[str] | None = None, progress: bool = False) -> Generation:
    """Responses to `prompts` (strings or token ids), `samples_per_prompt` each (default
    rollout.samples_per_prompt). Sampling settings default to the config's; `step` (default:
    one more than the last call's) keys the sampling with `seed` and is the length history's
    epoch. `on_release(devices, finished)`: runner.run's, called at each release with the
    responses finished so far by (prompt id, sample). `prompt_ids`: the prompts' identities in
    the length history and the sampling keys, when the caller has its own (distinct; default:
    a hash of the token ids). `progress`: a progress bar of finished responses."""
    st = self.settings
    s = st.sampling
    n = st.rollout.samples_per_prompt if samples_per_prompt is None else samples_per_prompt
    temperature = s.temperature if temperature is None else temperature
    top_p = s.top_p if top_p is None else top_p
    top_k = s.top_k if top_k is None else top_k
    seed = s.seed if seed is None else seed
    step = self.step if step is None else step
    for name, ok, want in (("samples_per_prompt", isinstance(n, int) and n >= 1, "an int >= 1"),
                           ("temperature", temperature >= 0, ">= 0 (0 = greedy)"),
                           ("top_p", 0 < top_p <= 1, "in (0, 1]"),
                           ("top_k", isinstance(top_k, int) and top_k >= 0, "an int >= 0"),
                           ("step", isinstance(step, int) and step >= 0, "an int >= 0")):
      if not ok:
        _fail(f"{name}: must be {want}")
    ids = self.encode(prompts)
    if prompt_ids is not None:
      given = [str(p) for p in prompt_ids]
      if len(given) != len(ids) or len(set(given)) != len(given):
        _fail(f"prompt_ids: {len(given)} ids ({len(set(given))} distinct) for {len(ids)} "
              "prompts (need one distinct id per prompt)")
    seen: dict[str, int] = {}
    rows = []
    for i, toks in enumerate(ids):
      if prompt_ids is not None:
        rows.append(Prompt(given[i], toks))
        continue
      # a prompt sent twice in one call: its own id (and sampling key) per occurrence
      pid = prompt_id(toks)
      k = seen[pid] = seen.get(pid, -1) + 1
      rows.append(Prompt(pid if k == 0 else f"{pid}.{k}", toks))
    call = st.replace(rollout=dict(samples_per_prompt=n, epoch=step),
                      sampling=dict(temperature=float(temperature), top_p=float(top_p),
                                    top_k=int(top_k), seed=int(seed)))
    releases: list[dict] = []
    scorer = self._scorer
    if scorer is not None and (temperature or 1.0) != self._scoring_temperature():
      scorer = None  # compiled for the config's temperature (greedy: the unscaled model's)
    if scorer is not None:
      scorer.wait_compiled()
      scorer.reset(self.params, {p.prompt_id: p.tokens for p in rows})

    def released(devices, finished):
      releases.append({"devices": [d.id for d in devices]})
      if scorer is not None:
        scorer.on_release(devices, finished)
      if on_release is not None:
        on_release(devices, finished)

    res = runner.run(call, devices=self.devices, params=self.params, model_cfg=self.model_cfg,
                     tokenizer=self.tokenizer, write_outputs=False, history=self.history,
                     step_cache=self._steps, progress=progress, on_release=released,
                     prompts=rows)
    steps = [r["step"] for r in res.summary.get("releases", []) if r.get("workers")
             and not r.get("final")]
    for rel, at in zip(releases, steps, strict=False):
      rel["step"] = at
    if self._history_path and jax.process_index() == 0:
      self.history.save(self._history_path)
    self.step = step + 1
    by_key = {(r["prompt_id"], r["sample"]): r for r in res.responses}
    keys = [(p.prompt_id, j) for p in rows for j in range(n)]
    out = [by_key[k] for k in keys]
    scored = scorer.results() if scorer is not None else {}
    released_lp = {}
    for i, (k, p) in enumerate(zip(keys, [p for p in rows for _ in range(n)], strict=True)):
      if k in scored:  # [t_max - 1] over prompt + response: the response's tokens
        released_lp[i] = scored[k][len(p.tokens) - 1:len(p.tokens) - 1 + len(by_key[k]["tokens"])]
    return Generation(
        prompt_tokens=[list(p.tokens) for p in rows for _ in range(n)],
        tokens=[list(map(int, r["tokens"])) for r in out], text=[r["text"] for r in out],
        logprobs=[list(map(float, r["logprobs"])) for r in out],
        finish_reasons=[r["finish_reason"] for r in out],
        routes=[r["routes"] for r in out] if st.rollout.record_routes else None,
        releases=releases, summary=res.summary, released_logprobs=released_lp, responses=out)

  # -- weights
  def update_params(self, params) -> None:
    """The next calls generate with `params`: the same tree of arrays as the engine's (shapes
    and dtypes; ValueError naming the first leaf that differs), left where they are, in the
    trainer's sharding. Nothing moves here: the next rollout lays them out on its mesh, device
    to device."""
    paths, leaves = _leaf_table(params)
    if paths != self._paths:
      missing = [p for p in self._paths if p not in set(paths)]
      extra = [p for p in paths if p not in set(self._paths)]
      _fail(f"update_params: leaf {missing[0]} is missing" if missing else
            f"update_params: unexpected leaf {extra[0]}" if extra else
            "update_params: the leaves are in another order")
    for path, new, old in zip(paths, leaves, self._leaves, strict=True):
      if tuple(np.shape(new)) != tuple(old.shape) or np.dtype(new.dtype) != np.dtype(old.dtype):
        _fail(f"update_params: leaf {path} is {np.dtype(new.dtype).name}"
              f"{list(np.shape(new))}, the engine's is {np.dtype(old.dtype).name}"
              f"{list(old.shape)}")
    self.params = params

  # -- old-policy log-probs
  def per_token_logps(self, prompt_tokens: Sequence[Sequence[int]],
                      completion_tokens: Sequence[Sequence[int]], *,
                      temperature: float | None = None) -> list[np.ndarray]:
    """log_softmax(logits / T) of each completion token after its prompt, under the current
    params (T: the config's temperature unless given; 1 when greedy): one float32 array per row,
    the rollout's log-probs to within fp32 rounding."""
    if len(prompt_tokens) != len(completion_tokens) or not len(prompt_tokens):
      _fail(f"per_token_logps: {len(prompt_tokens)} prompts and {len(completion_tokens)} "
            "completions (need as many, at least one)")
    t = self.settings.sampling.temperature if temperature is None else temperature
    width = self.settings.model.max_seq_len
    rows = [list(map(int, p)) + list(map(int, c))
            for p, c in zip(prompt_tokens, completion_tokens, strict=True)]
    for i, (row, c) in enumerate(zip(rows, completion_tokens, strict=True)):
      if len(row) > width or len(c) > self.max_new_tokens:
        _fail(f"per_token_logps: row {i}: {len(row) - len(c)} prompt + {len(c)} completion "
              f"tokens exceed model.max_seq_len={width} or rollout.max_new_tokens="
              f"{self.max_new_tokens}")
      if any(not 0 <= x < self.model_cfg.vocab_size for x in row):
        _fail(f"per_token_logps: row {i} has a token id outside the vocabulary of "
              f"{self.model_cfg.vocab_size}")
    actor = self._logprob_actor(t)
    if self._actor_params is None or self._actor_params[0] is not self.params:
      self._actor_params = (self.params, actor_lib.shard_params(self.params, actor.mesh))
    tokens = np.zeros((len(rows), width), np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
      tokens[i, :len(row)], valid[i, :len(row)] = row, True
    logp = actor.logprobs(self._actor_params[1], tokens, valid)  # [B, width - 1]
    return [logp[i, len(p) - 1:len(p) - 1 + len(c)].astype(np.float32)
            for i, (p, c) in enumerate(zip(prompt_tokens, completion_tokens, strict=True))]

  def _scoring_temperature(self) -> float:
    t = self.settings.sampling.temperature
    return 1.0 if t == 0 else t  # greedy records the unscaled model's log-probs

  def _actor_spec(self, temperature: float) -> actor_lib.ActorSpec:
    """The log-prob program's spec: the same per-device shapes on the full mesh and on a
    released device (rl/reuse.py), so both give the same numbers."""
    return actor_lib.ActorSpec(self.model_cfg, len(self.devices), temperature=float(temperature),
                               tile_m=8, moe_backend=self.settings.model.moe_backend)

  def _logprob_actor(self, temperature: float) -> actor_lib.Actor:
    spec = self._actor_spec(temperature)
    if self._actor is None or self._actor.spec != spec:
      try:
        spec.ep()
      except ValueError as e:
        _fail(f"per_token_logps: {e}")
      self._actor = actor_lib.Actor(spec, mesh_lib.make_ep_mesh(self.devices), None)
    return self._actor


def _leaf_table(params) -> tuple[list[str], list[Any]]:
  """('/'-joined key paths, leaves) of a params tree, in tree order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return ["/".join(_key(k) for k in path) for path, _ in flat], [leaf for _, leaf in flat]


def _key(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)
