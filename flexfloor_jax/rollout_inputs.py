"""What a rollout reads from the user (config fields, model shape, prompts, lengths file, length
history, output directory, memory budget), checked with one RolloutError naming the field or file,
before anything is compiled. Imports no JAX at module level.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from flexfloor_jax.policy import costs, outputs, plan, workload
from flexfloor_jax.policy.history import HistoryError, LengthHistory
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.jsonl import iter_jsonl

BUILTIN_PROMPTS = (
    "Sort the digits 3 1 4 1 5 9 2 6:", "Add 27 and 58:", "Reverse the word 'expert':",
    "Count to twelve:", "Name a prime larger than 40:", "Spell 'mixture' backwards:",
    "What is 9 times 7?", "List three colours:", "Continue: 2 4 8 16", "Write a haiku about GPUs:",
    "Translate 'hello' to French:", "Sum the numbers 1 to 10:",
)


class RolloutError(ValueError):
  """Bad input: the message names the config field or the file."""


@dataclasses.dataclass
class Prompt:
  prompt_id: str
  tokens: list[int]
  text: Optional[str] = None


def _check(cond: bool, msg: str):
  if not cond:
    raise RolloutError(msg)


def validate_config(config) -> None:
  r, s = config.rollout, config.sampling
  _check(config.schedule in plan.SCHEDULES,
         f"schedule must be one of {plan.SCHEDULES}, got {config.schedule!r}")
  for k, v in (config.get("workload") or {}).items():
    _check(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
           and (k != "median" or v > 0),
           f"workload.{k} must be a number >= 0 (median > 0), got {v!r}")
  slack = config.scheduler.get("makespan_slack", 0.05)
  _check(isinstance(slack, (int, float)) and not isinstance(slack, bool) and 0 <= slack <= 1,
         f"scheduler.makespan_slack must be a fraction in [0, 1], got {slack!r}")
  _check(config.scheduler.get("step_cost", "auto") in costs.STEP_COSTS,
         f"scheduler.step_cost must be one of {costs.STEP_COSTS}, got "
         f"{config.scheduler.get('step_cost')!r}")
  _check(config.scheduler.get("placement", "auto") in plan.PLACEMENTS,
         f"scheduler.placement must be one of {plan.PLACEMENTS}, got "
         f"{config.scheduler.get('placement')!r}")
  _check(r.max_new_tokens > 0, f"rollout.max_new_tokens must be > 0, got {r.max_new_tokens}")
  _check(r.samples_per_prompt > 0,
         f"rollout.samples_per_prompt must be > 0, got {r.samples_per_prompt}")
  _check(r.slots_per_worker > 0, f"rollout.slots_per_worker must be > 0, got {r.slots_per_worker}")
  _check(r.steps_per_dispatch > 0,
         f"rollout.steps_per_dispatch must be > 0, got {r.steps_per_dispatch}")
  _check(r.max_prompt_len > 0, f"rollout.max_prompt_len must be > 0, got {r.max_prompt_len}")
  _check(r.epoch >= 0, f"rollout.epoch must be >= 0, got {r.epoch}")
  _check(s.temperature >= 0, f"sampling.temperature must be >= 0, got {s.temperature}")
  _check(0 < s.top_p <= 1, f"sampling.top_p must be in (0, 1], got {s.top_p}")
  _check(s.top_k >= 0, f"sampling.top_k must be >= 0, got {s.top_k}")
  from flexfloor_jax.model.config import MOE_BACKENDS  # jax-free: checked before jax starts
  _check(config.model.moe_backend in MOE_BACKENDS,
         f"model.moe_backend must be one of {', '.join(MOE_BACKENDS)}, got "
         f"{config.model.moe_backend!r}")
  _check(config.mesh.num_devices >= 0,
         f"mesh.num_devices must be >= 0, got {config.mesh.num_devices}")
  # moe.EXCHANGES plus 'auto', spelled out: validation runs before jax is imported
  _check(config.model.get("exchange", "auto") in ("auto", "all_to_all", "ragged"),
         f"model.exchange must be 'auto', 'all_to_all' or 'ragged', got "
         f"{config.model.get('exchange')!r}")
  _check(config.model.max_seq_len == 0 or config.model.max_seq_len > 1,
         f"model.max_seq_len must be 0 (longest prompt + rollout.max_new_tokens, capped by the "
         f"model's max_position_embeddings) or > 1, got {config.model.max_seq_len}")
  threads = r.get("compile_threads", 0)
  _check(isinstance(threads, int) and not isinstance(threads, bool) and threads >= 0,
         f"rollout.compile_threads must be an integer >= 0 (0 = one per core, at most 4), "
         f"got {threads!r}")
  _check(r.lengths in ("auto", "model", "workload") or os.path.isfile(r.lengths),
         f"rollout.lengths must be 'model', 'workload' or a lengths JSONL file; "
         f"{r.lengths!r} is neither (file not found)")


def load_prompts(config, tokenizer, eos_or_bos: Optional[int]) -> list[Prompt]:
  r = config.rollout
  if not r.prompts:
    _check(tokenizer is not None, "rollout.prompts is empty (built-in prompts) but the model has "
           "no tokenizer: give a JSONL of {\"id\", \"tokens\"}")
    n = r.num_prompts
    _check(n > 0, f"rollout.num_prompts must be > 0, got {n}")
    return [Prompt(f"builtin-{i}", tokenizer.encode(BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)],
                                                    add_bos=True),
                   BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]) for i in range(n)]
  path = r.prompts
  _check(os.path.isfile(path), f"rollout.prompts: file {path} not found")
  out, seen = [], set()
  try:
    rows = list(iter_jsonl(path))
  except ValueError as e:
    raise RolloutError(f"rollout.prompts: {e}") from None
  for ln, row in rows:
    _check("id" in row and ("prompt" in row or "tokens" in row),
           f"rollout.prompts: {path}:{ln} needs \"id\" and \"prompt\" or \"tokens\"")
    pid = str(row["id"])
    _check(pid not in seen, f"rollout.prompts: {path}:{ln} repeats id {pid!r}")
    seen.add(pid)
    if "tokens" in row:
      toks = row["tokens"]
      _check(isinstance(toks, list) and toks and all(isinstance(t, int) for t in toks),
             f"rollout.prompts: {path}:{ln} \"tokens\" must be a non-empty list of ints")
      out.append(Prompt(pid, list(toks), None))
    else:
      _check(tokenizer is not None, f"rollout.prompts: {path}:{ln} has text but the model has "
             "no tokenizer (give \"tokens\")")
      _check(isinstance(row["prompt"], str) and row["prompt"],
             f"rollout.prompts: {path}:{ln} \"prompt\" must be a non-empty string")
      out.append(Prompt(pid, tokenizer.encode(row["prompt"], add_bos=True), row["prompt"]))
  _check(bool(out), f"rollout.prompts: {path} holds no prompts")
  return out


# ----------------------------------------------------------------------------- length history


def history_file(config) -> str:
  return config.scheduler.history_path or os.path.join(config.rollout.output_dir, "history.json")


def load_history(config, model_cfg) -> LengthHistory:
  """The length history for this run, checked: lengths in [1, rollout.max_new_tokens], recorded
  for this model (another model's history: a warning and an empty one). The rollout CLI calls it
  before jax starts, `run` when not handed one: the same checks either way."""
  from flexfloor_jax.model.config import model_identity
  try:
    return LengthHistory.load(history_file(config),
                                        max_new_tokens=config.rollout.max_new_tokens,
                                        model=model_identity(model_cfg))
  except HistoryError as e:
    raise RolloutError(f"scheduler.history_path: {e}") from None


# ----------------------------------------------------------------------------- output directory


def check_output_dir(config) -> None:
  """rollout.output_dir usable (a directory, creatable, writable): before jax starts."""
  try:
    outputs.check_dir(config.rollout.output_dir, "rollout.output_dir")
  except outputs.OutputDirError as e:
    raise RolloutError(str(e)) from None


# ------------------------------------------------------------------ sequences, cache, budget


def resolve_lengths_mode(config) -> str:
  mode = config.rollout.lengths
  if mode == "auto":
    return "model" if config.model.checkpoint else "workload"
  return mode


def workload_spec(config, num_prompts: int) -> workload.WorkloadSpec:
  w = config.get("workload") or {}
  return workload.WorkloadSpec(num_prompts=num_prompts,
                               samples_per_prompt=config.rollout.samples_per_prompt,
                               seed=config.sampling.seed, cap=config.rollout.max_new_tokens,
                               sigma=float(w.get("sigma", workload.DEFAULT_SIGMA)),
                               median=float(w.get("median", workload.DEFAULT_MEDIAN)),
                               epoch_noise=float(w.get("epoch_noise",
                                                       workload.DEFAULT_EPOCH_NOISE)),
                               sample_noise=float(w.get("sample_noise",
                                                        workload.DEFAULT_SAMPLE_NOISE)))


def build_seqs(config, prompts: list[Prompt], mode: str) -> list[Seq]:
  r = config.rollout
  targets = None
  if mode == "workload":
    lens = workload.lengths(workload_spec(config, len(prompts)), r.epoch)
    targets = {(p.prompt_id, j): int(lens[i, j]) for i, p in enumerate(prompts)
               for j in range(r.samples_per_prompt)}
  elif mode != "model":
    try:
      table = workload.read_lengths_jsonl(mode)
    except ValueError as e:
      raise RolloutError(f"rollout.lengths: {e}") from None
    targets = {}
    for p in prompts:
      for j in range(r.samples_per_prompt):
        _check((p.prompt_id, j) in table,
               f"rollout.lengths: {mode} has no length for id {p.prompt_id!r} sample {j}")
        n = int(table[(p.prompt_id, j)])
        _check(1 <= n <= r.max_new_tokens, f"rollout.lengths: {mode}: length {n} of "
               f"{p.prompt_id!r} sample {j} is outside 1..rollout.max_new_tokens")
        targets[(p.prompt_id, j)] = n
  seqs = []
  for p in prompts:
    for j in range(r.samples_per_prompt):
      t = None if targets is None else targets[(p.prompt_id, j)]
      seqs.append(Seq(seq_id=len(seqs), prompt_id=p.prompt_id, sample=j,
                      prompt_len=len(p.tokens), target_len=t, max_new_tokens=r.max_new_tokens))
  return seqs


def resolve_max_seq_len(config, prompts: list[Prompt], model_cfg) -> int:
  """The KV cache length: model.max_seq_len when set (checked against the prompts and the
  model by the caller), else what the run needs, the longest prompt + rollout.max_new_tokens,
  capped by the model's max_position_embeddings."""
  if config.model.max_seq_len:
    return int(config.model.max_seq_len)
  need = max(len(p.tokens) for p in prompts) + config.rollout.max_new_tokens
  # the prefill writes its whole width (rollout.max_prompt_len) into the cache
  need = max(need, config.rollout.max_prompt_len)
  return int(min(need, model_cfg.max_position_embeddings))


def memory_budget_bytes(config, devices) -> int:
  if config.mesh.device_memory_gb > 0:
    return int(config.mesh.device_memory_gb * 2**30)
  import jax
  local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
  stats = local[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return 16 * 2**30  # CPU reports none: a 16 GB accelerator


def check_prompts(config, prompts: list[Prompt], model_cfg, seq_len: int) -> None:
  """Every prompt fits rollout.max_prompt_len and, with rollout.max_new_tokens, the KV cache; its
  token ids are in the vocabulary; the cache fits the model's positions."""
  r = config.rollout
  for p in prompts:
    _check(len(p.tokens) <= r.max_prompt_len, f"rollout.prompts: prompt {p.prompt_id!r} has "
           f"{len(p.tokens)} tokens, more than rollout.max_prompt_len={r.max_prompt_len}")
    _check(len(p.tokens) + r.max_new_tokens <= seq_len,
           f"rollout.prompts: prompt {p.prompt_id!r} ({len(p.tokens)} tokens) + "
           f"rollout.max_new_tokens={r.max_new_tokens} exceeds model.max_seq_len={seq_len}"
           + ("" if config.model.max_seq_len else
              " (the model's max_position_embeddings)"))
    bad = [t for t in p.tokens if not 0 <= t < model_cfg.vocab_size]
    _check(not bad, f"rollout.prompts: prompt {p.prompt_id!r} has token ids {bad[:4]} outside "
           f"the vocabulary of {model_cfg.vocab_size}")
  _check(seq_len <= model_cfg.max_position_embeddings,
         f"model.max_seq_len={seq_len} exceeds the model's "
         f"max_position_embeddings={model_cfg.max_position_embeddings}")


def model_config(config):
  """The model's shape: a checkpoint's (its inventory only, no tensor read) or the preset's, in
  model.dtype. RolloutError names model.checkpoint when the checkpoint cannot be used."""
  from flexfloor_jax.model import checkpoint as ckpt
  from flexfloor_jax.model.config import PRESETS
  if config.model.checkpoint:
    try:
      cfg = ckpt.inspect_checkpoint(config.model.checkpoint)
    except ckpt.CheckpointError as e:
      raise RolloutError(f"model.checkpoint: {e}") from None
  else:
    cfg = PRESETS[config.preset]
  return cfg.replace(dtype=config.model.dtype)
