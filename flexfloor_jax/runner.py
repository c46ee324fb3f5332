"""One rollout: wires the host-side policy, the engine and the elastic controller together.

Order matters for bad input: everything the user gave (config, prompts, lengths file, checkpoint
inventory, memory budget, length history, output directory) is validated, and the output directory
locked, before anything is compiled; the outputs are published as one set (policy/outputs.py), so
a failed or killed run leaves the previous set, never a mix.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Optional

import numpy as np

from flexfloor_jax.policy import (accounting, compile_plan, costs, outputs, plan, planner,
                                  scheduler, workload)
from flexfloor_jax.policy.accounting import jsonable
from flexfloor_jax.policy.jsonl import iter_jsonl
from flexfloor_jax.policy.controller import Seq

BUILTIN_PROMPTS = (
    "Sort the digits 3 1 4 1 5 9 2 6:", "Add 27 and 58:", "Reverse the word 'expert':",
    "Count to twelve:", "Name a prime larger than 40:", "Spell 'mixture' backwards:",
    "What is 9 times 7?", "List three colours:", "Continue: 2 4 8 16", "Write a haiku about GPUs:",
    "Translate 'hello' to French:", "Sum the numbers 1 to 10:",
)


class RolloutError(ValueError):
  """Bad input: the message names the config field or the file."""


class OutputError(RolloutError):
  """The outputs could not be written (disk full, read-only, ...): the message names the file.
  `result`: the finished rollout (its responses are not lost); `staging`: the directory that
  keeps the files written before the failure (None when nothing could be kept)."""

  def __init__(self, msg: str, result=None, staging=None):
    super().__init__(msg)
    self.result, self.staging = result, staging


@dataclasses.dataclass
class Prompt:
  prompt_id: str
  tokens: list[int]
  text: Optional[str] = None


# ----------------------------------------------------------------------------- validation


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


# ----------------------------------------------------------------------------- history


def history_file(config) -> str:
  return config.scheduler.history_path or os.path.join(config.rollout.output_dir, "history.json")


def load_history(config, model_cfg) -> scheduler.LengthHistory:
  """The length history for this run, checked: lengths in [1, rollout.max_new_tokens], recorded
  for this model (another model's history: a warning and an empty one). The rollout CLI calls it
  before jax starts, `run` when not handed one: the same checks either way."""
  from flexfloor_jax.model.config import model_identity
  try:
    return scheduler.LengthHistory.load(history_file(config),
                                        max_new_tokens=config.rollout.max_new_tokens,
                                        model=model_identity(model_cfg))
  except scheduler.HistoryError as e:
    raise RolloutError(f"scheduler.history_path: {e}") from None


# ----------------------------------------------------------------------------- outputs


def check_output_dir(config) -> None:
  """rollout.output_dir usable (a directory, creatable, writable): before jax starts."""
  try:
    outputs.check_dir(config.rollout.output_dir, "rollout.output_dir")
  except outputs.OutputDirError as e:
    raise RolloutError(str(e)) from None


def check_finite_logprobs(responses: list[dict], epoch: int) -> None:
  """NaN or inf log-probs (weights or activations out of range for model.dtype) are garbage to
  any consumer and invalid JSON in responses.jsonl: stop naming the first response, as the
  trainer and the weight loader do for theirs."""
  bad = [x for x in responses if not all(math.isfinite(v) for v in x["logprobs"])]
  if bad:
    raise RolloutError(f"epoch {epoch}: a log-prob of prompt {bad[0]['prompt_id']!r} sample "
                       f"{bad[0]['sample']} is not finite ({len(bad)} response(s) in all): the "
                       "model computed NaN or inf (check the weights and model.dtype); nothing "
                       "was written")


ROLLOUT_OUTPUTS = ("responses.jsonl", "summary.json", "timeline.png", "history.json")


def publish_outputs(out: str, responses: list[dict], summary: dict, timeline, title: str,
                    history: scheduler.LengthHistory, history_path: str) -> str:
  """responses.jsonl (first: it survives a later failure), summary.json (with the set's run_id),
  timeline.png and, when it lives in `out`, history.json, published as one set; returns the
  set's directory. Raises outputs.OutputWriteError naming the file. A history file elsewhere
  (scheduler.history_path) is replaced on its own after the set is published."""
  s = outputs.OutputSet(out, "rollout.output_dir", owns=ROLLOUT_OUTPUTS)
  s.write("responses.jsonl",
          "".join(json.dumps(jsonable(x), allow_nan=False) + "\n" for x in responses))
  s.write("summary.json", json.dumps(dict(jsonable(summary, nonfinite_to_none=True),
                                          run_id=s.run_id), indent=2, allow_nan=False))
  with s.writing("timeline.png") as path:
    accounting.plot_timeline(timeline, path, title=title)
  in_set = os.path.abspath(history_path) == os.path.abspath(os.path.join(out, "history.json"))
  if in_set:
    with s.writing("history.json") as path:
      history.save(path)
  final = s.publish()
  if not in_set:
    try:
      history.save(history_path)
    except OSError as e:
      raise outputs.OutputWriteError(
          f"scheduler.history_path: writing {history_path} failed: "
          f"{outputs.os_error_text(e)} (the outputs were published in {final})", final,
          tuple(s.written)) from None
  return final


# ----------------------------------------------------------------------------- the rollout


@dataclasses.dataclass
class RolloutResult:
  summary: dict
  responses: list[dict]
  timeline: Any
  record: Any


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
                               epoch_noise=float(w.get("epoch_noise", workload.DEFAULT_EPOCH_NOISE)),
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


def run(config, *, devices=None, params=None, model_cfg=None, tokenizer=None,
        write_outputs: bool = True, history: Optional[scheduler.LengthHistory] = None,
        step_cache=None, progress: bool = True, on_release=None) -> RolloutResult:
  """Run one rollout as the config says. `params`/`model_cfg`/`tokenizer` skip loading (RL loop).
  `on_release(devices, finished)`: called right after each release with the released devices and
  the responses finished so far, {(prompt_id, sample): tokens}; it must not block (RL: released
  workers score finished responses, rl/reuse.py).
  write_outputs: rollout.output_dir is checked and locked (policy/outputs.py) before anything is
  compiled, and the outputs are published there as one set; a failure to write them raises
  OutputError, which holds the result."""
  t_setup = time.perf_counter()
  validate_config(config)  # before the heavy imports: bad fields fail in well under a second
  if write_outputs:
    check_output_dir(config)
  import jax
  lock = None
  if write_outputs and jax.process_index() == 0:  # the process that writes the outputs
    try:
      lock = outputs.acquire(config.rollout.output_dir, "rollout.output_dir")
    except outputs.OutputDirError as e:
      raise RolloutError(str(e)) from None
  try:
    return _run(config, t_setup, devices=devices, params=params, model_cfg=model_cfg,
                tokenizer=tokenizer, write_outputs=write_outputs, history=history,
                step_cache=step_cache, progress=progress, on_release=on_release)
  finally:
    if lock is not None:
      lock.release()


def _run(config, t_setup, *, devices, params, model_cfg, tokenizer, write_outputs, history,
         step_cache, progress, on_release) -> RolloutResult:
  import jax

  from flexfloor_jax import engine as engine_lib
  from flexfloor_jax import memory
  from flexfloor_jax import mesh as mesh_lib
  from flexfloor_jax.model import checkpoint as ckpt
  from flexfloor_jax.model import transformer as tfm
  from flexfloor_jax.model.config import PRESETS, resolve_moe_backend
  from flexfloor_jax.sampling import SamplingParams, prompt_hash
  from flexfloor_jax.tokenizer import load_tokenizer

  r = config.rollout
  # -- model shape (checkpoint inventory checked before anything is compiled)
  if model_cfg is None:
    if config.model.checkpoint:
      try:
        model_cfg = ckpt.inspect_checkpoint(config.model.checkpoint)
      except ckpt.CheckpointError as e:
        raise RolloutError(f"model.checkpoint: {e}") from None
    else:
      model_cfg = PRESETS[config.preset]
    model_cfg = model_cfg.replace(dtype=config.model.dtype)
  if tokenizer is None:
    tokenizer = load_tokenizer(config.model.checkpoint, model_cfg)
  prompts = load_prompts(config, tokenizer, model_cfg.bos_id)
  seq_len = resolve_max_seq_len(config, prompts, model_cfg)
  for p in prompts:
    _check(len(p.tokens) <= r.max_prompt_len, f"rollout.prompts: prompt {p.prompt_id!r} has "
           f"{len(p.tokens)} tokens, more than rollout.max_prompt_len={r.max_prompt_len}")
    _check(len(p.tokens) + r.max_new_tokens <= seq_len,
           f"rollout.prompts: prompt {p.prompt_id!r} ({len(p.tokens)} tokens) + "
           f"rollout.max_new_tokens={r.max_new_tokens} exceeds model.max_seq_len={seq_len}"
           + ("" if config.model.max_seq_len else
              f" (the model's max_position_embeddings)"))
    bad = [t for t in p.tokens if not 0 <= t < model_cfg.vocab_size]
    _check(not bad, f"rollout.prompts: prompt {p.prompt_id!r} has token ids {bad[:4]} outside "
           f"the vocabulary of {model_cfg.vocab_size}")
  _check(seq_len <= model_cfg.max_position_embeddings,
         f"model.max_seq_len={seq_len} exceeds the model's "
         f"max_position_embeddings={model_cfg.max_position_embeddings}")
  mode = resolve_lengths_mode(config)
  seqs = build_seqs(config, prompts, mode)
  history_path = history_file(config)
  if history is None:
    history = load_history(config, model_cfg)

  # -- workers, memory floor, expert slots
  if devices is None:
    try:
      devices = mesh_lib.select_devices(config.mesh.num_devices)
    except ValueError as err:  # more workers asked for than there are devices
      raise RolloutError(str(err)) from None
  devices = list(devices)
  n = len(devices)
  b = r.slots_per_worker
  e = model_cfg.num_experts
  # the floor's terms from the shapes the engine allocates (flexfloor_jax/memory.py)
  terms = memory.terms_for_config(config, model_cfg, seq_len)
  budget = memory_budget_bytes(config, devices)
  try:
    floor = terms.floor(e, budget, n)
  except planner.FloorError as err:
    raise RolloutError(f"mesh.device_memory_gb: {err}") from None
  flex = config.schedule == "flexfloor"
  slots = math.ceil(e / (floor if flex else n))
  try:
    allowed = planner.release_sizes(config.scheduler.get("release_sizes", ""), n, floor)
  except ValueError as err:
    raise RolloutError(f"scheduler.release_sizes: {err}") from None

  # -- placement (host policy)
  chain = list(range(n))  # release order: workers leave from the head
  step_cost = costs.resolve(config.scheduler.get("step_cost", "auto"), devices[0].platform)
  queues, policy, pred_by_seq = plan.plan_rollout(
      seqs, history, config.schedule, n, b, floor, steps_per_dispatch=r.steps_per_dispatch,
      placement=config.scheduler.get("placement", "auto"),
      compaction=bool(config.scheduler.compaction),
      epoch=r.epoch, sizes=allowed,
      makespan_slack=float(config.scheduler.get("makespan_slack", 0.05)),
      step_cost=step_cost)
  predicted = np.array([pred_by_seq[s.seq_id] for s in seqs])
  placement = planner.ExpertPlacement.initial(e, chain, slots, num_workers=n)

  # -- params (loaded only now: all input checks passed)
  if params is None:
    if config.model.checkpoint:
      model_cfg_loaded, params = ckpt.load_checkpoint(config.model.checkpoint, model_cfg)
      params = jax.tree.map(lambda x: x.astype(model_cfg.dtype), params)
    else:
      params = tfm.init_params(model_cfg, jax.random.key(config.model.init_seed),
                               scale=config.model.init_scale)
  moe_impl, moe_interpret = resolve_moe_backend(config.model.moe_backend, devices[0].platform)
  spec = engine_lib.EngineSpec(
      cfg=model_cfg, slots_per_worker=b, expert_slots=slots, max_seq_len=seq_len,
      max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
      sampling=SamplingParams(config.sampling.temperature, config.sampling.top_p,
                              config.sampling.top_k),
      moe_backend=moe_impl, interpret=moe_interpret,
      record_routes=bool(r.get("record_routes", False)))
  # The smaller meshes a release may leave, compiled in the order the plan reaches them (see
  # policy/compile_plan.py), each with the movers of the devices its releases touch.
  sizes = sorted((m for m in (allowed or range(floor, n)) if m < n), reverse=True) if flex else []
  cplan = compile_plan.plan_compiles(
      seqs, queues, policy, pred_by_seq, num_workers=n, slots_per_worker=b,
      steps_per_dispatch=r.steps_per_dispatch, candidates=sizes, placement=placement,
      chain=chain, has_history=len(history) > 0) if flex else None
  # wait_plan_compiles (the default): only the sizes the plan expects are compiled, and waited
  # for; compiling the others in the background slowed generation more than the releases they
  # allow saved (README, Performance), and a release to them is held and reported instead.
  plan_only = (bool(cplan) and not r.wait_compiles and bool(r.get("wait_plan_compiles", True))
               and jax.process_count() == 1)
  eng = engine_lib.Engine(spec, params, devices, chain, placement, seed=config.sampling.seed,
                          epoch=r.epoch, step_cache=step_cache,
                          prefetch_sizes=(cplan.expected if plan_only else cplan.order)
                          if cplan else [],
                          compile_threads=int(r.get("compile_threads", 0)),
                          mover_plan=cplan.movers if cplan else None)
  by_prompt = {p.prompt_id: p for p in prompts}
  eng.add_sequences({s.seq_id: engine_lib.SeqInput(
      tokens=np.asarray(by_prompt[s.prompt_id].tokens, np.int32),
      limit=s.target_len or s.max_new_tokens, stop_eos=mode == "model",
      phash=prompt_hash(s.prompt_id), sample=s.sample, fixed_length=s.target_len is not None)
      for s in seqs})
  # The executables of the smaller meshes compile in background threads. wait_compiles: wait
  # for all of them (reproducible releases: benchmarks, tests). Else wait for the sizes the plan
  # expects to reach (rollout.wait_plan_compiles) or none, and never release onto a mesh whose
  # executables are not ready: a release never waits for a compile, and the steps that costs
  # are counted and reported.
  multi = jax.process_count() > 1  # multi-controller: every process runs this same loop
  t_wait = time.perf_counter()
  waited: list[int] = []
  if r.wait_compiles or multi:  # (a timing-dependent floor would split the processes' plans)
    eng.steps.wait_all()
    waited = list(sizes)
  elif flex:
    if plan_only:
      waited = list(cplan.expected)
      eng.steps.wait(waited)
    policy = _ReadyFloor(policy, eng.steps, n, sizes)
  wait_s = time.perf_counter() - t_wait
  setup_s = time.perf_counter() - t_setup

  from flexfloor_jax.policy import controller
  bar = _progress(len(seqs), progress and jax.process_index() == 0)
  try:
    def released(workers):
      if on_release is not None:
        done = {(q.prompt_id, q.sample): eng.outputs[q.seq_id].tokens for q in seqs
                if q.seq_id in eng.outputs}
        on_release([devices[w] for w in workers], done)

    record = controller.run(seqs, queues, _ProgressExecutor(eng, bar, released), policy,
                            steps_per_dispatch=r.steps_per_dispatch)
    if isinstance(policy, _ReadyFloor):
      policy.finish(record.timeline)
  finally:
    bar.close()
    if step_cache is None:
      eng.steps.close()

  # -- results
  m = record.metrics()
  # Decode seconds per step, by active-group size: emulated devices share the host's cores, so a
  # step costs more on a bigger mesh.
  by_size: dict[int, list[float]] = {}
  for x in record.timeline.steps:
    if x["kind"] == "decode" and x["num_steps"] > 0:
      by_size.setdefault(len(x["active"]), []).append((x["t1"] - x["t0"]) / x["num_steps"])
  per_step = [t for v in by_size.values() for t in v]
  m["decode_step_median_s"] = float(np.median(per_step)) if per_step else 0.0
  actual = np.array([record.finishes[s.seq_id].num_tokens for s in seqs], float)
  m["prediction"] = scheduler.prediction_quality(predicted, actual) if len(history) else None
  m.update(schedule=config.schedule, lengths=mode, num_workers=n, floor=floor,
           expert_slots_per_worker=slots, slots_per_worker=b, setup_seconds=setup_s,
           release_sizes=list(allowed) if allowed else None,
           release_latency_s=eng.release_latencies,
           expert_counts=eng.expert_counts.tolist(), epoch=r.epoch,
           num_sequences=len(seqs), num_prompts=len(prompts),
           makespan_slack=float(config.scheduler.get("makespan_slack", 0.05)),
           step_cost=step_cost,
           cost_model=getattr(policy.cost, "name", None) if policy.enabled else None,
           cost_table=({str(k): v for k, v in policy.cost.table.items()}
                       if getattr(policy.cost, "table", None) else None),
           length_buckets=length_buckets(queues, pred_by_seq),
           step_seconds_measured={str(k): float(np.median(v)) for k, v in by_size.items()},
           max_seq_len=seq_len,
           compile_plan=dict(cplan.to_json(), waited_for=waited, wait_s=wait_s,
                             compile_threads=eng.steps.compile_threads,
                             # per size: [start, end] of its compile, seconds from setup start
                             compile_s={str(k): [a - t_setup, z - t_setup]
                                        for k, a, z in eng.steps.compile_log if a >= t_setup})
           if cplan else None,
           **held_summary(policy))
  if m["releases_held_for_compile_steps"]:
    logging.getLogger(__name__).warning(
        "releases held back %d steps waiting for compiles: %s (%d device-steps); "
        "--config.rollout.wait_compiles=true compiles every size before the first step",
        m["releases_held_for_compile_steps"],
        ", ".join(f"size {k} for {v} steps" for k, v in
                  sorted(m["releases_held_for_compile"].items(), key=lambda kv: -int(kv[0]))),
        m["releases_held_for_compile_device_steps"])
  if eng.release_latencies and "decode_step_median_s" in m:
    m["release_latency_over_median_step"] = max(eng.release_latencies) / max(
        m["decode_step_median_s"], 1e-9)
    # also each release against the median decode step of the mesh it released onto
    ratios = [lat / float(np.median(by_size[k])) for lat, k in
              zip(eng.release_latencies, eng.release_sizes) if k in by_size]
    m["decode_step_median_s_by_size"] = {str(k): float(np.median(v)) for k, v in by_size.items()}
    m["release_latency_over_step_on_new_mesh"] = ratios
  responses = []
  for s in seqs:
    o = eng.outputs[s.seq_id]
    text = tokenizer.decode(o.tokens) if tokenizer is not None else None
    responses.append({"prompt_id": s.prompt_id, "sample": s.sample, "tokens": o.tokens,
                      "text": text, "finish_reason": o.finish_reason,
                      "num_tokens": len(o.tokens), "logprobs": o.logprobs, "worker": o.worker,
                      **({} if o.routes is None else {"routes": o.routes})})
  m = jsonable(m)
  check_finite_logprobs(responses, r.epoch)  # before the history or any file takes them
  history.add_rollout(r.epoch, seqs, {s.seq_id: len(eng.outputs[s.seq_id].tokens) for s in seqs})
  history.add_step_seconds({k: float(np.median(v)) for k, v in by_size.items()})
  tl = record.timeline
  result = RolloutResult(summary=m, responses=responses, timeline=tl, record=record)
  if write_outputs and jax.process_index() == 0:  # multi-process: process 0 writes outputs
    try:
      publish_outputs(r.output_dir, responses, m, tl,
                      f"{config.schedule}: {n} workers, epoch {r.epoch}", history, history_path)
    except outputs.OutputWriteError as e:
      raise OutputError(str(e), result, e.staging) from None
  return result


def length_buckets(queues: dict[int, list[int]], predicted: dict[int, float]) -> list[dict]:
  """Per worker, the predicted lengths it was given (its queue is longest first: sequences of
  similar length run together there, so its slots empty together)."""
  out = []
  for w in sorted(queues):
    p = [float(predicted[q]) for q in queues[w]]
    out.append(dict(worker=int(w), seqs=len(p), predicted_min=min(p) if p else None,
                    predicted_max=max(p) if p else None,
                    predicted_total=float(sum(p))))
  return out


def _progress(total: int, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, desc="responses", unit="seq", disable=not enabled, leave=False)


def held_summary(policy) -> dict:
  """summary.json's account of releases held back by compiles not ready (zeros when none)."""
  held = policy if isinstance(policy, _ReadyFloor) else None
  return dict(
      releases_held_for_compile_steps=held.held_steps if held else 0,
      releases_held_for_compile={str(k): v for k, v in held.held_by_size.items()} if held else {},
      releases_held_for_compile_device_steps=held.held_device_steps if held else 0)


class _ReadyFloor:
  """The release policy, allowed only the mesh sizes already compiled (a release never waits
  for a compile), which also counts what that costs: while some size is not ready, each decision
  asks a copy of the unrestricted policy too, and for as long as that one would have shrunk the
  group further, the steps count against the size it wanted (`held_by_size`) and the extra
  active workers against `held_device_steps`."""

  def __init__(self, policy, steps, n: int, sizes):
    self._policy, self._steps, self._n = policy, steps, n
    self._sizes = list(sizes)  # the smaller meshes a release may leave
    self._full = (policy.floor, policy.sizes)
    self._all_ready = not self._sizes
    self._hold = None  # (step, wanted size, size kept) while a release is held back
    self.held_steps = 0
    self.held_device_steps = 0
    self.held_by_size: dict[int, int] = {}

  def _restrict(self) -> bool:
    """Allow only compiled sizes; False once every size is (the policy is then unrestricted)."""
    if self._all_ready:
      return False
    ready = [m for m in self._sizes if self._steps.ready(m)]
    if len(ready) == len(self._sizes):
      self._all_ready = True
      self._policy.floor, self._policy.sizes = self._full
      return False
    ok = sorted({*ready, self._n}, reverse=True)
    self._policy.floor, self._policy.sizes = ok[-1], tuple(ok)
    return True

  def _close(self, step: int):
    if self._hold is not None:
      s0, want, kept = self._hold
      self.held_steps += step - s0
      self.held_device_steps += (kept - want) * (step - s0)
      self.held_by_size[want] = self.held_by_size.get(want, 0) + step - s0
      self._hold = None

  def stop_masks(self, st):
    if not self._restrict():
      return self._policy.stop_masks(st)
    # stop when the unrestricted policy would: a size that became ready is used at once
    floor, sizes = self._policy.floor, self._policy.sizes
    self._policy.floor, self._policy.sizes = self._full
    try:
      return self._policy.stop_masks(st)
    finally:
      self._policy.floor, self._policy.sizes = floor, sizes

  def plan(self, st):
    self._close(st.step)
    if not self._restrict():
      return self._policy.plan(st)
    probe = copy.deepcopy(self._policy)
    probe.floor, probe.sizes = self._full
    want, got = probe.plan(st), self._policy.plan(st)
    size = lambda p: len(st.active) if p is None or p.new_active is None else len(p.new_active)
    if size(want) < size(got):
      self._hold = (st.step, size(want), size(got))
    return got

  def finish(self, timeline):
    """Close a hold still open when the rollout ended."""
    self._close(timeline.num_steps)

  def __getattr__(self, name):
    return getattr(self._policy, name)


class _ProgressExecutor:
  """Forwards to the engine, ticks the progress bar on every finish, reports releases."""

  def __init__(self, eng, bar, released):
    self._eng, self._bar, self._released = eng, bar, released
    self.slots_per_worker = eng.spec.slots_per_worker

  def prefill(self, assign):
    out = self._eng.prefill(assign)
    self._bar.update(len(out))
    return out

  def decode(self, max_steps, stop_on_refill, stop_on_idle):
    k, out = self._eng.decode(max_steps, stop_on_refill, stop_on_idle)
    self._bar.update(len(out))
    return k, out

  def migrate(self, moves):
    return self._eng.migrate(moves)

  def shrink(self, new_active):
    info = self._eng.shrink(new_active)
    self._released(info["released"])
    return info

  def active_workers(self):
    return self._eng.active_workers()
