"""One rollout, in stages: `prepare` (host only: model shape, prompts, sequences, floor, placement),
`build_engine` (params, engine, compiles), `execute` (the control loop), `summarize` (metrics and
responses) and `publish_outputs`; `run` chains them.

Order matters for bad input: everything the user gave (config, prompts, lengths file, checkpoint
inventory, memory budget, length history, output directory) is validated, and the output directory
locked, before anything is compiled; the outputs are published as one set (io/output_dir.py), so a
failed or killed run leaves the previous set, never a mix.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.config import settings
from flexfloor_jax.engine.sampling import SamplingParams, prompt_hash
from flexfloor_jax.io import output_dir
from flexfloor_jax.model import checkpoint as ckpt
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import resolve_moe_backend
from flexfloor_jax.policy import compile_plan, controller, costs, plan, prediction, speculation
from flexfloor_jax.policy.accounting import (
  decode_step_medians,
  draft_summary,
  jsonable,
  release_latency_ratios,
)
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.drafts import Drafter, ResponseStore, StoreError
from flexfloor_jax.policy.expert_placement import ExpertPlacement
from flexfloor_jax.policy.floor import FloorError, preallocated_slots, release_sizes
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.policy.ready_floor import ReadyFloor, held_summary, warn_held
from flexfloor_jax.rollout import inputs, kv_pool
from flexfloor_jax.rollout.inputs import (
  Prompt,
  RolloutError,
  build_seqs,
  check_output_dir,
  check_prompts,
  history_file,
  load_history,
  load_prompts,
  lock_output_dir,
  memory_budget_bytes,
  model_config,
  resolve_lengths_mode,
  resolve_max_seq_len,
)
from flexfloor_jax.rollout.outputs import OutputError, check_finite_logprobs, publish_outputs
from flexfloor_jax.runtime import mesh as mesh_lib
from flexfloor_jax.sim.costs import RooflineCost, named_step_cost
from flexfloor_jax.sim.presets import parse_cost_model
from flexfloor_jax.sim.replay import replay, seconds_figures

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- the rollout


@dataclasses.dataclass
class RolloutResult:
  summary: dict
  responses: list[dict]
  timeline: Any
  record: Any


@dataclasses.dataclass
class Prepared:
  """What the host decided before any engine exists: the model's shape, the sequences and their
  schedule, the floor and the expert placement."""
  model_cfg: Any
  tokenizer: Any
  prompts: list[Prompt]
  seqs: list[Seq]
  mode: str  # 'model' | 'workload' | a lengths file
  seq_len: int
  history: LengthHistory
  history_path: str
  devices: list
  floor: int
  expert_slots: int
  allowed: tuple | None  # scheduler.release_sizes, None = every size down to the floor
  step_cost: str
  queues: dict
  policy: Any
  pred_by_seq: dict
  placement: ExpertPlacement
  chain: list[int]  # release order: workers leave from the head
  steps_per_dispatch: int
  flex: bool  # schedule 'flexfloor': the group shrinks as workers finish
  release_sizes: list[int]  # the smaller meshes a release may leave, largest first
  kv_pool: Any = None  # rollout.kv='paged': the host's page pool (policy.pages.PagePool)
  store: Any = None  # rollout.draft_tokens > 0: the drafts' ResponseStore

  @property
  def num_workers(self) -> int:
    return len(self.devices)


@dataclasses.dataclass
class Built:
  """The engine and how its smaller meshes get compiled."""
  engine: Any
  cplan: Any  # compile_plan.CompilePlan, None without releases
  plan_only: bool  # compile (and wait for) only the sizes the plan expects
  close_steps: bool = True  # the run's StepCache is not the caller's: close it after the run


def run(config, *, devices=None, params=None, model_cfg=None, tokenizer=None,
        write_outputs: bool = True, history: LengthHistory | None = None,
        step_cache=None, progress: bool = True, on_release=None,
        prompts: list[Prompt] | None = None,
        response_store: ResponseStore | None = None) -> RolloutResult:
  """Run one rollout as the config says. `params`/`model_cfg`/`tokenizer` skip loading (RL loop);
  `prompts` (in memory, the library API) replace rollout.prompts. `response_store`
  (rollout.draft_tokens > 0): the drafts' store in memory, as `history` (this run's responses
  join it), instead of rollout.draft_store's file.
  `step_cache`: an engine.StepCache (the caller's; kept open) or an engine.StepCachePool (the
  cache of this run's spec is taken from it, and kept there for the next run).
  `on_release(devices, finished)`: called right after each release with the released devices and
  the responses finished so far, {(prompt_id, sample): tokens}; it must not block (RL: released
  workers score finished responses, rl/reuse.py).
  write_outputs: rollout.output_dir is checked and locked (io/output_dir.py) before anything is
  compiled, and the outputs are published there as one set; a failure to write them raises
  OutputError, which holds the result. `config`: settings.Settings, or a config that
  settings.load checks (ConfigError) before anything is built."""
  t_setup = time.perf_counter()
  config = settings.as_settings(config)
  if write_outputs:
    check_output_dir(config)
  # only the process that writes the outputs (process 0) locks the directory
  lock = lock_output_dir(config) if write_outputs and jax.process_index() == 0 else None
  try:
    prep = prepare(config, devices=devices, model_cfg=model_cfg, tokenizer=tokenizer,
                   history=history, prompts=prompts, response_store=response_store)
    # One line per stage: what a long wait is spent on, and where a Ctrl-C landed.
    log.info("building the engine: weights and compiles")
    built = build_engine(config, prep, params=params, step_cache=step_cache)
    try:
      policy, waited, wait_s = wait_for_compiles(config, prep, built)
      setup_s = time.perf_counter() - t_setup
      log.info("generating %d responses on %d workers", len(prep.seqs), prep.num_workers)
      record = execute(prep, built.engine, policy, progress=progress, on_release=on_release,
                       drafting=drafting_policy(config, prep))
    finally:
      if built.close_steps:
        built.engine.steps.close()
    compiles = dict(waited_for=waited, wait_s=wait_s, t_setup=t_setup)
    result = summarize(config, prep, built, policy, record, setup_s=setup_s, compiles=compiles)
    if write_outputs and jax.process_index() == 0:  # multi-process: process 0 writes outputs
      log.info("publishing the outputs in %s", config.rollout.output_dir)
      try:
        publish_outputs(config.rollout.output_dir, result.responses, result.summary,
                        result.timeline, f"{config.schedule}: {prep.num_workers} workers, "
                        f"epoch {config.rollout.epoch}", prep.history, prep.history_path)
      except output_dir.OutputWriteError as e:
        raise OutputError(str(e), result, e.staging) from None
      if prep.store is not None and response_store is None:
        try:  # merged with the file under its lock, as the length history
          prep.store.save(inputs.store_file(config))
        except (OSError, StoreError) as e:
          raise OutputError(f"rollout.draft_store: {e}", result, None) from None
    return result
  finally:
    if lock is not None:
      lock.release()


def prepare(config: settings.Settings, *, devices=None, model_cfg=None, tokenizer=None,
            history: LengthHistory | None = None,
            prompts: list[Prompt] | None = None,
            response_store: ResponseStore | None = None) -> Prepared:
  """The host's part: model shape (the checkpoint's inventory, no tensor read), prompts (read
  from rollout.prompts unless given) and their checks, sequences, length history, floor, release
  sizes, placement and schedule."""
  r = config.rollout
  if model_cfg is None:
    model_cfg = model_config(config)
  if tokenizer is None:
    tokenizer = inputs.tokenizer_for(config, model_cfg)
  if config.model.attention_backend == "pallas" and model_cfg.sliding_window:
    raise RolloutError(f"model.attention_backend: 'pallas' takes no sliding window (the model's "
                       f"is {model_cfg.sliding_window} tokens); use 'xla'")
  if prompts is None:
    prompts = load_prompts(config, tokenizer, model_cfg.bos_id)
  seq_len = resolve_max_seq_len(config, prompts, model_cfg)
  check_prompts(config, prompts, model_cfg, seq_len)
  mode = resolve_lengths_mode(config)
  seqs = build_seqs(config, prompts, mode)
  if history is None:
    history = load_history(config, model_cfg)
  store = None
  if r.draft_tokens:
    store = (response_store if response_store is not None
             else inputs.load_store(config, tokenizer, model_cfg))

  if devices is None:
    try:
      devices = mesh_lib.select_devices(config.mesh.num_devices)
    except ValueError as err:  # more workers asked for than there are devices
      raise RolloutError(str(err)) from None
  devices = list(devices)
  # b: sequences a worker runs at once (paged KV: the pool's rows)
  n, b, e = len(devices), r.lanes, model_cfg.num_experts
  # the floor's terms from the shapes the engine allocates (flexfloor_jax/engine/memory.py)
  try:
    terms = inputs.terms_for_config(config, model_cfg, seq_len)
  except kv_pool.KVPoolError as err:
    raise RolloutError(str(err)) from None
  paged = r.kv == "paged"
  inputs.check_release_sizes(config, n)
  try:
    floor = terms.floor(e, memory_budget_bytes(config, devices), n)
  except FloorError as err:
    raise RolloutError(f"mesh.device_memory_gb: {err}") from None
  flex = config.schedule == "flexfloor"
  slots = preallocated_slots(config.schedule, e, n, floor)
  inputs.check_host_memory(terms, slots, devices)
  allowed = release_sizes(config.scheduler.release_sizes, n, floor)  # checked by settings

  chain = list(range(n))
  step_cost = costs.resolve(config.scheduler.step_cost, devices[0].platform,
                            config.scheduler.cost_model)
  # a named pair: decide in its seconds
  cost = named_step_cost(step_cost, seqs) if step_cost.startswith("roofline:") else None
  queues, policy, pred_by_seq = plan.plan_rollout(
      seqs, history, config.schedule, n, b, floor, steps_per_dispatch=r.steps_per_dispatch,
      placement=config.scheduler.placement, compaction=config.scheduler.compaction,
      epoch=r.epoch, sizes=allowed, makespan_slack=config.scheduler.makespan_slack,
      cost=cost, step_cost=step_cost,
      kv=kv_pool.pool_factory(r, n, seq_len) if paged else None)
  placement = ExpertPlacement.initial(e, chain, slots, num_workers=n)
  return Prepared(model_cfg=model_cfg, tokenizer=tokenizer, prompts=prompts, seqs=seqs, mode=mode,
                  seq_len=seq_len, history=history, history_path=history_file(config),
                  devices=devices, floor=floor, expert_slots=slots, allowed=allowed,
                  step_cost=step_cost, queues=queues, policy=policy, pred_by_seq=pred_by_seq,
                  placement=placement, chain=chain, steps_per_dispatch=r.steps_per_dispatch,
                  flex=flex,
                  kv_pool=kv_pool.make_pool(r, n, seq_len, pred_by_seq) if paged else None,
                  release_sizes=sorted((m for m in (allowed or range(floor, n)) if m < n),
                                       reverse=True) if flex else [],
                  store=store)


def engine_spec(config: settings.Settings, prep: Prepared):
  """The EngineSpec of this rollout (one compiled shape per mesh size)."""
  r = config.rollout
  moe_impl, moe_interpret = resolve_moe_backend(config.model.moe_backend,
                                                prep.devices[0].platform)
  return engine_lib.EngineSpec(
      cfg=prep.model_cfg, slots_per_worker=r.lanes, expert_slots=prep.expert_slots,
      max_seq_len=prep.seq_len, max_prompt_len=r.max_prompt_len,
      max_new_tokens=r.max_new_tokens, exchange=config.model.exchange,
      sampling=SamplingParams(config.sampling.temperature, config.sampling.top_p,
                              config.sampling.top_k),
      moe_backend=moe_impl, interpret=moe_interpret, record_routes=r.record_routes, kv=r.kv,
      page_size=r.page_size, attention_backend=config.model.attention_backend,
      num_pages=prep.kv_pool.num_pages if prep.kv_pool is not None else 0,
      prefill_rows=r.prefill_rows, prefill_queue=r.prefill_rows * r.steps_per_dispatch,
      draft_tokens=r.draft_tokens)


def load_params(config: settings.Settings, model_cfg) -> tfm.Params:
  """model.checkpoint's params in the model's dtype, or a random init (model.init_seed)."""
  if config.model.checkpoint:
    loaded = ckpt.load_checkpoint(config.model.checkpoint, model_cfg)
    assert loaded is not None  # None only for an empty path
    _, params = loaded
    return jax.tree.map(lambda x: x.astype(model_cfg.dtype), params)
  return tfm.init_params(model_cfg, jax.random.key(config.model.init_seed),
                         scale=config.model.init_scale)


def build_engine(config: settings.Settings, prep: Prepared, *, params=None,
                 step_cache=None) -> Built:
  """Params (loaded only now: every input check passed), the engine and its sequences; the
  smaller meshes a release may leave start compiling in the order the plan reaches them
  (policy/compile_plan.py), each with the movers of the devices its releases touch."""
  r, n = config.rollout, prep.num_workers
  if params is None:
    params = load_params(config, prep.model_cfg)
  sizes = prep.release_sizes
  cplan = compile_plan.plan_compiles(
      prep.seqs, prep.queues, prep.policy, prep.pred_by_seq, num_workers=n,
      slots_per_worker=r.lanes, steps_per_dispatch=r.steps_per_dispatch,
      candidates=sizes, placement=prep.placement, chain=prep.chain,
      has_history=len(prep.history) > 0) if prep.flex else None
  # wait_plan_compiles (the default): only the sizes the plan expects are compiled, and waited
  # for; compiling the others in the background slowed generation more than the releases they
  # allow saved (README, Performance), and a release to them is held and reported instead.
  plan_only = (bool(cplan) and not r.wait_compiles and r.wait_plan_compiles
               and jax.process_count() == 1)
  spec = engine_spec(config, prep)
  compile_threads = r.compile_threads
  if isinstance(step_cache, engine_lib.StepCachePool):
    # the pool's cache for this spec (kept across runs); closed after the run
    pool = step_cache
    step_cache = pool.get(spec, prep.devices, prep.chain, *engine_lib.abstract_split(params),
                          compile_threads=compile_threads)
  else:
    pool = None
  eng = engine_lib.Engine(spec, params, prep.devices, prep.chain,
                          prep.placement, seed=config.sampling.seed, epoch=r.epoch,
                          step_cache=step_cache,
                          prefetch_sizes=(cplan.expected if plan_only else cplan.order)
                          if cplan else [],
                          compile_threads=compile_threads,
                          mover_plan=cplan.movers if cplan else None)
  if spec.chunked:
    eng.prefill_chunk = r.prefill_chunk
  by_prompt = {p.prompt_id: p for p in prep.prompts}
  eng.add_sequences({s.seq_id: engine_lib.SeqInput(
      tokens=np.asarray(by_prompt[s.prompt_id].tokens, np.int32),
      limit=s.target_len or s.max_new_tokens, stop_eos=prep.mode == "model",
      phash=prompt_hash(s.prompt_id), sample=s.sample, fixed_length=s.target_len is not None)
      for s in prep.seqs})
  return Built(engine=eng, cplan=cplan, plan_only=plan_only,
               close_steps=pool is not None or step_cache is None)


def wait_for_compiles(config: settings.Settings, prep: Prepared, built: Built):
  """(policy, sizes waited for, seconds waited). The executables of the smaller meshes compile in
  background threads. rollout.wait_compiles: wait for all of them (reproducible releases:
  benchmarks, tests). Else wait for the sizes the plan expects to reach (rollout.wait_plan_compiles)
  or none, and never release onto a mesh whose executables are not ready: a release never waits
  for a compile, and the steps that costs are counted and reported (policy/ready_floor.py)."""
  sizes, eng, policy = prep.release_sizes, built.engine, prep.policy
  t_wait = time.perf_counter()
  waited: list[int] = []
  # multi-controller: every process runs the same loop; a timing-dependent floor would split
  # the processes' plans
  if config.rollout.wait_compiles or jax.process_count() > 1:
    eng.steps.wait_all()
    waited = list(sizes)
  elif prep.flex:
    if built.plan_only:
      waited = list(built.cplan.expected)
      eng.steps.wait(waited)
    policy = ReadyFloor(policy, eng.steps, prep.num_workers, sizes)
  return policy, waited, time.perf_counter() - t_wait


def drafting_policy(config: settings.Settings, prep: Prepared):
  """Speculative decoding's policy (rollout.draft_tokens > 0, else None): drafts from the
  response store and the sibling samples, made where they pay in the seconds of the named cost
  model (scheduler.cost_model, or the roofline pair the run decides in), the same on every
  platform so that the engine and its replay draft alike; with scheduler.step_cost='steps' (a
  count in which a step's rows are free) every draft goes out."""
  r = config.rollout
  if not r.draft_tokens:
    return None
  name = prep.step_cost if prep.step_cost.startswith("roofline:") else config.scheduler.cost_model
  cost = None if prep.step_cost == "steps" else named_step_cost(name, prep.seqs)
  return speculation.DraftPolicy(Drafter(prep.store), r.draft_tokens, cost=cost)


def execute(prep: Prepared, eng, policy, *, progress: bool = True, on_release=None,
            drafting=None):
  """The control loop over the engine; returns the controller's record. `drafting`:
  speculative decoding's policy (drafting_policy), None = plain decoding."""

  bar = tqdm(total=len(prep.seqs), desc="responses", unit="seq", leave=False,
             disable=not (progress and jax.process_index() == 0))
  try:
    def released(workers):
      if on_release is not None:
        done = {(q.prompt_id, q.sample): eng.outputs[q.seq_id].tokens for q in prep.seqs
                if q.seq_id in eng.outputs}
        on_release([prep.devices[w] for w in workers], done)

    if prep.kv_pool is not None:
      eng.attach_pages(prep.kv_pool)
    record = controller.run(prep.seqs, prep.queues, _ProgressExecutor(eng, bar, released), policy,
                            steps_per_dispatch=prep.steps_per_dispatch, kv=prep.kv_pool,
                            prefill_chunk=eng.prefill_chunk if eng.spec.chunked else 0,
                            drafting=drafting)
    if isinstance(policy, ReadyFloor):
      policy.finish(record.timeline)
  finally:
    bar.close()
  return record


def seconds_on_cost_model(config: settings.Settings, prep: Prepared, record,
                          device_steps: int, responses: dict | None = None) -> dict:
  """This rollout in the seconds of a named roofline pair (the one it decided in, else
  scheduler.cost_model): the same policy replayed on the lengths it produced (sim.replay),
  releases and migrations charged. On emulated CPU devices the host's seconds say nothing about
  an accelerator's; these do. `replay_matches_run`: the replay made the run's `device_steps` (not
  when releases waited for background compiles, which the replay does not model).
  Speculative decoding: `responses` (seq id -> its tokens) and a drafting policy like the run's
  replay its drafts, each confirmed by the response as the engine's sampling confirmed it."""
  r = config.rollout
  decided = prep.step_cost.startswith("roofline:")
  name = prep.step_cost if decided else config.scheduler.cost_model
  model, hw = parse_cost_model(name)
  lengths = {q: f.num_tokens for q, f in record.finishes.items()}
  m, _ = replay(prep.seqs, lengths, prep.history, config.schedule, prep.num_workers, r.lanes,
                prep.floor, cost=RooflineCost(model, hw), model=model,
                steps_per_dispatch=prep.steps_per_dispatch,
                placement=config.scheduler.placement, compaction=config.scheduler.compaction,
                epoch=r.epoch, sizes=prep.allowed, makespan_slack=config.scheduler.makespan_slack,
                step_cost=prep.step_cost,
                policy_cost=named_step_cost(name, prep.seqs) if decided else None,
                kv=kv_pool.pool_factory(r, prep.num_workers, prep.seq_len)
                if prep.kv_pool is not None else None, prefill_chunk=r.prefill_chunk,
                responses=responses if r.draft_tokens else None,
                drafting=drafting_policy(config, prep))
  return dict(cost_model=name, **seconds_figures(m),
              replay_matches_run=m["device_steps"] == device_steps)


def summarize(config: settings.Settings, prep: Prepared, built: Built, policy, record, *,
              setup_s: float, compiles: dict) -> RolloutResult:
  """summary.json's metrics and the responses; checks the log-probs are finite and adds this
  rollout to the length history (which the caller publishes)."""
  r, eng, cplan, seqs = config.rollout, built.engine, built.cplan, prep.seqs
  m = record.metrics()
  m["decode_step_median_s"], median_by_size = decode_step_medians(record.timeline)
  predicted = np.array([prep.pred_by_seq[s.seq_id] for s in seqs])
  actual = np.array([record.finishes[s.seq_id].num_tokens for s in seqs], float)
  m["prediction"] = (prediction.prediction_quality(predicted, actual) if len(prep.history)
                     else None)
  t_setup = compiles["t_setup"]
  m.update(schedule=config.schedule, lengths=prep.mode, num_workers=prep.num_workers,
           floor=prep.floor, expert_slots_per_worker=prep.expert_slots,
           slots_per_worker=r.slots_per_worker, setup_seconds=setup_s,
           release_sizes=list(prep.allowed) if prep.allowed else None,
           release_latency_s=eng.release_latencies,
           expert_counts=eng.expert_counts.tolist(), epoch=r.epoch,
           num_sequences=len(seqs), num_prompts=len(prep.prompts),
           makespan_slack=config.scheduler.makespan_slack,
           step_cost=prep.step_cost,
           cost_model=getattr(policy.cost, "name", None) if policy.enabled else None,
           cost_table=({str(k): v for k, v in policy.cost.table.items()}
                       if getattr(policy.cost, "table", None) else None),
           length_buckets=plan.length_buckets(prep.queues, prep.pred_by_seq),
           step_seconds_measured={str(k): v for k, v in median_by_size.items()},
           max_seq_len=prep.seq_len,
           prefill_chunk=eng.prefill_chunk if eng.spec.chunked else 0,
           draft_tokens=eng.spec.draft_tokens,
           compile_plan=dict(cplan.to_json(), waited_for=compiles["waited_for"],
                             wait_s=compiles["wait_s"],
                             compile_threads=eng.steps.compile_threads,
                             # per size: [start, end] of its compile, seconds from setup start
                             compile_s={str(k): [a - t_setup, z - t_setup]
                                        for k, a, z in eng.steps.compile_log if a >= t_setup})
           if cplan else None,
           **held_summary(policy))
  warn_held(m)
  if eng.spec.draft_tokens:
    m.update(draft_summary(record.timeline))
  m["seconds"] = seconds_on_cost_model(
      config, prep, record, m["device_steps"],
      {s.seq_id: eng.outputs[s.seq_id].tokens for s in seqs} if r.draft_tokens else None)
  if prep.kv_pool is not None:
    prep.kv_pool.check()  # every page back in the pool
    m.update(kv_pool.summary(prep.kv_pool, sum(
        a.nbytes for a in eng.state.page_dict().values()) // len(eng.active)))
  m.update(release_latency_ratios(eng.release_latencies, eng.release_sizes,
                                  m["decode_step_median_s"], median_by_size))
  responses = []
  for s in seqs:
    o = eng.outputs[s.seq_id]
    text = prep.tokenizer.decode(o.tokens) if prep.tokenizer is not None else None
    responses.append({"prompt_id": s.prompt_id, "sample": s.sample, "tokens": o.tokens,
                      "text": text, "finish_reason": o.finish_reason,
                      "num_tokens": len(o.tokens), "logprobs": o.logprobs, "worker": o.worker,
                      **({} if o.routes is None else {"routes": o.routes})})
  m = jsonable(m)
  check_finite_logprobs(responses, r.epoch)  # before the history or any file takes them
  prep.history.add_rollout(r.epoch, seqs,
                           {s.seq_id: len(eng.outputs[s.seq_id].tokens) for s in seqs})
  prep.history.add_step_seconds(median_by_size)
  if prep.store is not None:  # after the replay above: it drafts from the store as the run did
    prep.store.add_rollout(r.epoch, [(s.prompt_id, s.sample, eng.outputs[s.seq_id].tokens)
                                     for s in seqs])
  return RolloutResult(summary=m, responses=responses, timeline=record.timeline, record=record)


class _ProgressExecutor:
  """Forwards to the engine (migrate, active_workers: the engine's own), ticks the progress bar
  on every finish, reports releases."""

  def __init__(self, eng, bar, released):
    self._eng, self._bar, self._released = eng, bar, released
    self.slots_per_worker = eng.spec.slots_per_worker
    self.prefill_chunk = eng.prefill_chunk  # chunked prefill (controller.ChunkedExecutor)

  def admit(self, assign):
    self._eng.admit(assign)

  def prefill(self, assign):
    out = self._eng.prefill(assign)
    self._bar.update(len(out))
    return out

  def decode(self, max_steps, stop_on_refill, stop_on_idle, drafts=None):
    k, out = self._eng.decode(max_steps, stop_on_refill, stop_on_idle, drafts=drafts)
    self._bar.update(len(out))
    return k, out

  def shrink(self, new_active):
    info = self._eng.shrink(new_active)
    self._released(info["released"])
    return info

  def migrate(self, moves):
    return self._eng.migrate(moves)

  def preempt(self, slots):
    return self._eng.preempt(slots)

  def active_workers(self):
    return self._eng.active_workers()

  def __getattr__(self, name):
    return getattr(self._eng, name)
