"""What a rollout reads from the user besides the config's fields (settings.py checks those):
model shape, prompts, lengths file, length history, output directory, memory budget, checked with
one RolloutError naming the field or file, before anything is compiled. Each function takes the
rollout's settings (settings.Settings).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from absl import logging

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.config import settings
from flexfloor_jax.config.schema import INT32_MAX
from flexfloor_jax.engine import memory
from flexfloor_jax.io import output_dir
from flexfloor_jax.io.jsonl import iter_jsonl
from flexfloor_jax.model import checkpoint as ckpt
from flexfloor_jax.model.config import PRESETS, model_identity
from flexfloor_jax.model.tokenizer import load_tokenizer, tokenizer_identity
from flexfloor_jax.policy import workload
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.drafts import ResponseStore, StoreError
from flexfloor_jax.policy.floor import parse_release_sizes
from flexfloor_jax.policy.history import HistoryError, LengthHistory
from flexfloor_jax.policy.pages import pages_for
from flexfloor_jax.rollout import kv_pool

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
  text: str | None = None


def _check(cond: object, msg: str):
  if not cond:
    raise RolloutError(msg)


def load_prompts(config, tokenizer, eos_or_bos: int | None) -> list[Prompt]:
  r = config.rollout
  if not r.prompts:
    _check(tokenizer is not None, "rollout.prompts is empty (built-in prompts) but the model has "
           "no tokenizer: give a JSONL of {\"id\", \"tokens\"}")
    n = r.num_prompts
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
    where = f"rollout.prompts: {path}:{ln}"
    _check(isinstance(row, dict), f"{where} must be a JSON object, got {type(row).__name__}")
    _check("id" in row and ("prompt" in row or "tokens" in row),
           f"{where} needs \"id\" and \"prompt\" or \"tokens\"")
    # JSON types taken strictly: true is not the id 1, nor the token 1
    rid = row["id"]
    _check(isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool)),
           f"{where} \"id\" must be a string or an integer, got {rid!r}")
    pid = str(rid)
    _check(pid not in seen, f"{where} repeats id {pid!r}")
    seen.add(pid)
    if "tokens" in row:
      toks = row["tokens"]
      _check(isinstance(toks, list) and toks, f"{where} \"tokens\" must be a non-empty list of "
             f"token ids, got {toks!r}")
      bad = [t for t in toks if not isinstance(t, int) or isinstance(t, bool)
             or not 0 <= t <= INT32_MAX]
      _check(not bad, f"{where} \"tokens\" must be token ids (integers in [0, {INT32_MAX}]), "
             f"got {bad[0]!r}" if bad else "")
      out.append(Prompt(pid, list(toks), None))
    else:
      _check(tokenizer is not None, f"{where} has text but the model has no tokenizer (give "
             "\"tokens\")")
      _check(isinstance(row["prompt"], str) and row["prompt"],
             f"{where} \"prompt\" must be a non-empty string, got {row['prompt']!r}")
      out.append(Prompt(pid, tokenizer.encode(row["prompt"], add_bos=True), row["prompt"]))
  _check(bool(out), f"rollout.prompts: {path} holds no prompts")
  return out


# ----------------------------------------------------------------------------- length history


def history_file(config) -> str:
  return config.scheduler.history_path or os.path.join(config.rollout.output_dir, "history.json")


def store_file(config) -> str:
  """Speculative decoding's response store: rollout.draft_store, or response_store.npz beside
  the length history."""
  return config.rollout.draft_store or os.path.join(
      os.path.dirname(os.path.abspath(history_file(config))), "response_store.npz")


def load_store(config, tokenizer, model_cfg) -> ResponseStore:
  """The response store the drafts come from (an empty one where the file does not exist yet),
  checked before anything compiles: a file that does not parse, or was written for another
  tokenizer, is one RolloutError naming it."""
  try:
    return ResponseStore.load(store_file(config), tokenizer_identity(tokenizer, model_cfg))
  except StoreError as e:
    raise RolloutError(f"rollout.draft_store: {e}") from None


def load_history(config, model_cfg) -> LengthHistory:
  """The length history for this run, checked: lengths in [1, rollout.max_new_tokens], recorded
  for this model (another model's history: a warning and an empty one). The rollout CLI calls it
  before jax starts, `run` when not handed one: the same checks either way."""
  try:
    return LengthHistory.load(history_file(config), max_new_tokens=config.rollout.max_new_tokens,
                              model=model_identity(model_cfg))
  except HistoryError as e:
    raise RolloutError(f"scheduler.history_path: {e}") from None


# ----------------------------------------------------------------------------- output directory


ROLLOUT_OUTPUTS = ("responses.jsonl", "summary.json", "timeline.png", "history.json")


def history_in_set(config) -> bool:
  """The length history is rollout.output_dir's history.json (published with the set)."""
  return os.path.abspath(history_file(config)) == os.path.abspath(
      os.path.join(config.rollout.output_dir, "history.json"))


def _owned(config) -> dict:
  # history.json as a regular file is the run's own input when it is the length history: read,
  # and carried into the new set; anything else of those names must be this project's link
  return dict(names=ROLLOUT_OUTPUTS, adopt=("history.json",) if history_in_set(config) else ())


def check_output_dir(config) -> None:
  """rollout.output_dir usable (a directory, creatable, writable, and every name the publish
  replaces this project's own: io/output_dir.check_owned): before anything is compiled."""
  try:
    output_dir.check_dir(config.rollout.output_dir, "rollout.output_dir", **_owned(config))
  except output_dir.OutputDirError as e:
    raise RolloutError(str(e)) from None


def lock_output_dir(config) -> output_dir.DirLock:
  """rollout.output_dir locked for this run (io/output_dir.py): RolloutError naming the holder
  when another run has it."""
  try:
    return output_dir.acquire(config.rollout.output_dir, "rollout.output_dir", **_owned(config))
  except output_dir.OutputDirError as e:
    raise RolloutError(str(e)) from None


# ------------------------------------------------------------------ sequences, cache, budget


def resolve_lengths_mode(config) -> str:
  mode = config.rollout.lengths
  if mode == "auto":
    return "model" if config.model.checkpoint else "workload"
  return mode


def workload_spec(config, num_prompts: int) -> workload.WorkloadSpec:
  w = config.workload
  return workload.WorkloadSpec(num_prompts=num_prompts,
                               samples_per_prompt=config.rollout.samples_per_prompt,
                               seed=config.sampling.seed, cap=config.rollout.max_new_tokens,
                               sigma=w.sigma, median=w.median, epoch_noise=w.epoch_noise,
                               sample_noise=w.sample_noise)


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
  local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
  stats = local[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return 16 * 2**30  # CPU reports none: a 16 GB accelerator


def host_available_bytes() -> int | None:
  """The host memory available to new allocations (Linux MemAvailable; else the free pages);
  None when the system reports neither."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def check_host_memory(terms: memory.FloorTerms, expert_slots: int, devices) -> None:
  """Emulated CPU devices keep their arrays in the host's memory, all of them together: the
  bytes this process's devices will hold (each: non-expert weights, its expert slots, KV and the
  move workspace) must fit what the host has available, checked before anything is allocated."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  if not local or any(d.platform != "cpu" for d in local):
    return
  need = len(local) * terms.per_device(expert_slots)
  have = host_available_bytes()
  if have is not None and need > have:
    raise RolloutError(
        f"the {len(local)} emulated CPU devices need an estimated {need:,} bytes of host memory "
        f"({terms.per_device(expert_slots):,} each) and {have:,} bytes are available; lower "
        "rollout.slots_per_worker, model.max_seq_len or mesh.num_devices")


def check_release_sizes(config, num_workers: int) -> None:
  """scheduler.release_sizes against the group: sizes at or above it cannot be left and are
  skipped, with one warning line naming them (a preset's list, e.g. '6,4,2', run on fewer
  workers keeps the sizes below the group; sizes below the floor are the memory's to drop)."""
  parsed = parse_release_sizes(config.scheduler.release_sizes)
  if not isinstance(parsed, frozenset) or num_workers <= 1:
    return
  past = sorted(n for n in parsed if n >= num_workers)
  if past:
    logging.warning("scheduler.release_sizes: %s not below the group of %d workers, skipped",
                    past, num_workers)


def check_prompts(config, prompts: list[Prompt], model_cfg, seq_len: int) -> None:
  """Every prompt fits rollout.max_prompt_len and, with rollout.max_new_tokens, the KV cache
  (settings.check_cache); its token ids are in the vocabulary; the cache fits the model's
  positions."""
  for p in prompts:
    try:
      settings.check_cache(config.rollout, seq_len, len(p.tokens))
    except settings.ConfigError as e:
      raise RolloutError(f"rollout.prompts: prompt {p.prompt_id!r} has {e}"
                         + ("" if config.model.max_seq_len else
                            " (the model's max_position_embeddings)")) from None
    bad = [t for t in p.tokens if not 0 <= t < model_cfg.vocab_size]
    _check(not bad, f"rollout.prompts: prompt {p.prompt_id!r} has token ids {bad[:4]} outside "
           f"the vocabulary of {model_cfg.vocab_size}")
  try:
    settings.check_cache(config.rollout, seq_len,
                         max_position_embeddings=model_cfg.max_position_embeddings)
  except settings.ConfigError as e:
    raise RolloutError(str(e)) from None


def model_config(config):
  """The model's shape: a checkpoint's (its inventory only, no tensor read) or the preset's, in
  model.dtype. RolloutError names model.checkpoint when the checkpoint cannot be used."""
  if config.model.checkpoint:
    try:
      cfg = ckpt.inspect_checkpoint(config.model.checkpoint)
    except ckpt.CheckpointError as e:
      raise RolloutError(f"model.checkpoint: {e}") from None
  else:
    cfg = PRESETS[config.preset]
  return cfg.replace(dtype=config.model.dtype)


def tokenizer_for(config, model_cfg):
  """The checkpoint's tokenizer (or the byte one, or None): RolloutError naming model.checkpoint
  when its tokenizer.json does not parse."""
  try:
    return load_tokenizer(config.model.checkpoint, model_cfg)
  except ckpt.CheckpointError as e:
    raise RolloutError(f"model.checkpoint: {e}") from None


def check_history_path(config) -> None:
  """scheduler.history_path usable before the run (it is written when the run is done): not a
  directory, and its directory one or creatable."""
  path = history_file(config)
  if os.path.isdir(path):
    raise RolloutError(f"scheduler.history_path: {path} is a directory")
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise RolloutError(f"scheduler.history_path: {path} cannot be created ({parent} is not a "
                       "directory)")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise RolloutError(f"scheduler.history_path: {path} cannot be written ({parent} is not "
                       "writable)")


def prepare_rollout(config):
  """The rollout's settings (settings.load: every field) and every other check that needs no JAX
  (rollout.output_dir included: a file, read-only or not creatable), then the length history
  loaded against this model (load_history, which runner.run applies too when called
  without one): (settings, history). Raises settings.ConfigError or RolloutError."""
  st = settings.load(config)
  model_cfg = model_config(st)
  try:
    settings.check_cache(st.rollout, st.model.max_seq_len,
                         max_position_embeddings=model_cfg.max_position_embeddings)
  except settings.ConfigError as e:
    raise RolloutError(str(e)) from None
  tokenizer = tokenizer_for(st, model_cfg)
  if st.rollout.prompts:
    # Every record checked (JSON, objects, Unicode, each field's type) before jax starts; the
    # runner checks the lengths against the cache once it is sized
    load_prompts(st, tokenizer, model_cfg.bos_id)
  check_output_dir(st)  # first: the history's default place is inside it
  check_history_path(st)
  return st, load_history(st, model_cfg)


def terms_for_config(config, model_cfg, max_seq_len: int | None = None) -> memory.FloorTerms:
  """The floor's terms of a config; rollout.kv='paged': KV = the page pool + the rings of the
  sliding layers and the state of its max_seqs rows, and a sequence row in flight = a full
  sequence's pages + its rings + its state."""
  r = config.rollout
  seq = max_seq_len or config.model.max_seq_len
  # chunked prefill, drafting: rings hold a sequence's query rows of a step beyond the window
  chunk = engine_lib.ring_chunk(getattr(r, "prefill_rows", 0), getattr(r, "draft_tokens", 0))
  t = memory.floor_terms(model_cfg, r.slots_per_worker, seq, r.max_new_tokens, r.record_routes,
                         chunk)
  if getattr(r, "kv", "slots") != "paged":
    return t
  per_token, rings = memory.kv_bytes(model_cfg, seq, chunk)  # pages: the full layers only
  state = engine_lib.state_bytes_per_worker(model_cfg, r.max_seqs, seq, r.max_new_tokens,
                                            r.record_routes)
  pool = kv_pool.pages_per_worker(r, seq) * r.page_size * per_token + r.max_seqs * rings
  row = pages_for(seq, r.page_size) * r.page_size * per_token + rings + state // r.max_seqs
  return dataclasses.replace(t, kv=pool + state, workspace=2 * t.expert + 2 * row)
