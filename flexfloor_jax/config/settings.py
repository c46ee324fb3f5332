"""The one step from a config to typed settings: a ConfigDict of configs/*.py becomes frozen
dataclasses, one per section, with every field checked once, before the first JAX operation (this
module imports numpy and the package's jax-free modules only). A bad value raises ConfigError,
one line that starts with the field: `rollout.slots_per_worker: must be an integer >= 1, got 0`.

`load(config, entry)` reads the sections every entry point shares (model, mesh, rollout,
workload, sampling, schedule, scheduler) and the entry's own (ENTRIES: bench; rl + sft;
rl + train). Settings keep the config's names (settings.rollout.max_new_tokens is
config.rollout.max_new_tokens), except that the top-level fields of the bench and of training
live in `settings.bench` and `settings.train`. Fields that older configs may lack have their
default here, and only here.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable
from typing import Any

from flexfloor_jax.config.reader import DTYPES, EXCHANGES, REQUIRED, ConfigError, Reader
from flexfloor_jax.model.config import ATTENTION_BACKENDS, MOE_BACKENDS, PRESETS
from flexfloor_jax.model.tokenizer import ByteTokenizer
from flexfloor_jax.policy import costs, plan, workload
from flexfloor_jax.policy.floor import parse_release_sizes
from flexfloor_jax.policy.pages import pages_for
from flexfloor_jax.rl import tasks as tasks_lib
from flexfloor_jax.sim.presets import parse_cost_model

# ----------------------------------------------------------------------------- shared sections


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  checkpoint: str  # '' = random init
  dtype: str
  moe_backend: str
  attention_backend: str  # paged decode attention: 'xla' | 'pallas' (rollout.kv='paged' only)
  max_seq_len: int  # 0 = the longest prompt + rollout.max_new_tokens (the runner)
  init_seed: int
  init_scale: float
  exchange: str


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  num_devices: int  # 0 = all
  device_memory_gb: float  # 0 = the device's own
  cpu_devices: int


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  prompts: str
  num_prompts: int
  samples_per_prompt: int
  max_new_tokens: int
  max_prompt_len: int
  slots_per_worker: int
  lengths: str
  epoch: int
  steps_per_dispatch: int
  wait_compiles: bool
  wait_plan_compiles: bool
  compile_threads: int
  record_routes: bool
  output_dir: str
  kv: str = "slots"  # 'slots' (fixed-length rows) | 'paged' (a page pool per worker)
  page_size: int = 16  # paged: tokens per page
  max_seqs_per_worker: int = 0  # paged: sequence rows per worker; 0 = 2 x slots_per_worker
  kv_pages: int = 0  # paged: pages per worker; 0 = the fixed-slot cache's bytes
  kv_margin: float = 0.25  # paged: admission reserves predicted length x (1 + margin)

  @property
  def max_seqs(self) -> int:
    """Paged KV: sequence rows per worker (max_seqs_per_worker, 0 resolved)."""
    return self.max_seqs_per_worker or 2 * self.slots_per_worker

  @property
  def lanes(self) -> int:
    """Sequences a worker runs at once: its decode slots, or (paged KV) its sequence rows."""
    return self.max_seqs if self.kv == "paged" else self.slots_per_worker


@dataclasses.dataclass(frozen=True)
class WorkloadSettings:
  sigma: float = workload.DEFAULT_SIGMA
  median: float = float(workload.DEFAULT_MEDIAN)
  epoch_noise: float = workload.DEFAULT_EPOCH_NOISE
  sample_noise: float = workload.DEFAULT_SAMPLE_NOISE


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  temperature: float
  top_p: float
  top_k: int
  seed: int


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
  history_path: str
  compaction: bool
  placement: str
  release_sizes: str
  makespan_slack: float
  step_cost: str
  cost_model: str  # 'roofline:MODEL@HARDWARE': what 'auto' decides in on emulated CPU devices


def _model(c) -> ModelSettings:
  r = Reader(c.get("model"), "model")
  dtype = r.choice("dtype", DTYPES, note=" (JAX computes float64 as float32 unless "
                   "jax_enable_x64 is set: the run would not be what was asked)"
                   if r.raw("dtype") == "float64" else "")
  seq = r.raw("max_seq_len")
  if not isinstance(seq, numbers.Integral) or isinstance(seq, bool) or seq < 0 or seq == 1:
    r.fail("max_seq_len", "0 (the longest prompt + rollout.max_new_tokens, capped by the "
           "model's max_position_embeddings) or an integer > 1", seq)
  return ModelSettings(checkpoint=r.text("checkpoint"), dtype=dtype,
                       moe_backend=r.choice("moe_backend", MOE_BACKENDS),
                       attention_backend=r.choice("attention_backend", ATTENTION_BACKENDS,
                                                  default="xla"),
                       max_seq_len=int(seq),
                       init_seed=r.int("init_seed", 0), init_scale=r.num("init_scale"),
                       exchange=r.choice("exchange", EXCHANGES, default="auto"))


def _mesh(c) -> MeshSettings:
  r = Reader(c.get("mesh"), "mesh")
  return MeshSettings(num_devices=r.int("num_devices", 0, note=" (0 = all devices)"),
                      device_memory_gb=r.num("device_memory_gb",
                                             note=" (0 = the device's own memory)"),
                      cpu_devices=r.int("cpu_devices", default=8))


def _rollout(c) -> RolloutSettings:
  r = Reader(c.get("rollout"), "rollout")
  lengths = r.text("lengths")
  if lengths not in ("auto", "model", "workload") and not os.path.isfile(lengths):
    raise ConfigError(f"rollout.lengths: must be 'model', 'workload' or a lengths JSONL file; "
                      f"{lengths!r} is neither (file not found)")
  return RolloutSettings(
      prompts=r.text("prompts"), num_prompts=r.int("num_prompts"),
      samples_per_prompt=r.int("samples_per_prompt"), max_new_tokens=r.int("max_new_tokens"),
      max_prompt_len=r.int("max_prompt_len"), slots_per_worker=r.int("slots_per_worker"),
      lengths=lengths, epoch=r.int("epoch", 0), steps_per_dispatch=r.int("steps_per_dispatch"),
      wait_compiles=r.flag("wait_compiles"),
      wait_plan_compiles=r.flag("wait_plan_compiles", default=True),
      compile_threads=r.int("compile_threads", 0, default=0,
                            note=" (0 = one per core, at most 4)"),
      record_routes=r.flag("record_routes", default=False), output_dir=r.text("output_dir"),
      kv=r.choice("kv", ("slots", "paged"), default="slots"),
      page_size=r.int("page_size", default=16),
      max_seqs_per_worker=r.int("max_seqs_per_worker", 0, default=0,
                                note=" (0 = 2 x rollout.slots_per_worker)"),
      kv_pages=r.int("kv_pages", 0, default=0,
                     note=" (0 = the bytes of the fixed-slot cache)"),
      kv_margin=r.num("kv_margin", default=0.25))


def _workload(c) -> WorkloadSettings:
  r, d = Reader(c.get("workload"), "workload", optional=True), WorkloadSettings()
  return WorkloadSettings(sigma=r.num("sigma", default=d.sigma),
                          median=r.num("median", lo_open=True, default=d.median),
                          epoch_noise=r.num("epoch_noise", default=d.epoch_noise),
                          sample_noise=r.num("sample_noise", default=d.sample_noise))


def _sampling(c) -> SamplingSettings:
  r = Reader(c.get("sampling"), "sampling")
  return SamplingSettings(temperature=r.num("temperature", note=" (0 = greedy)"),
                          top_p=r.num("top_p", 0, 1, lo_open=True),
                          top_k=r.int("top_k", 0, note=" (0 = off)"), seed=r.int("seed", 0))


def _scheduler(c) -> SchedulerSettings:
  r = Reader(c.get("scheduler"), "scheduler")
  sizes = r.text("release_sizes", default="")
  try:
    parse_release_sizes(sizes)
  except ValueError as e:
    raise ConfigError(f"scheduler.release_sizes: {e}") from None
  return SchedulerSettings(
      history_path=r.text("history_path"), compaction=r.flag("compaction"),
      placement=r.choice("placement", plan.PLACEMENTS, default="auto"), release_sizes=sizes,
      makespan_slack=r.num("makespan_slack", 0, 1, default=0.05),
      step_cost=_step_cost(r), cost_model=_cost_model(r, costs.DEFAULT_COST_MODEL))


def _step_cost(r: Reader) -> str:
  """scheduler.step_cost: one of costs.STEP_COSTS or a named roofline pair."""
  text = r.text("step_cost", default="auto")
  if text.startswith("roofline:"):
    try:
      parse_cost_model(text)
    except ValueError as e:
      raise ConfigError(f"{r.name('step_cost')}: {e}") from None
    return text
  return r.choice("step_cost", costs.STEP_COSTS, default="auto")


# ----------------------------------------------------------------------------- entry sections


@dataclasses.dataclass(frozen=True)
class BenchSettings:
  output_dir: str
  epochs: int
  repeats: int
  release_only: bool
  cost_model: str  # 'roofline:MODEL@HARDWARE': every run replayed in its seconds
  seeds: tuple[int, ...] = ()  # workload seeds (sampling.seed) to run every epoch for; () = one


@dataclasses.dataclass(frozen=True)
class RLSettings:
  tasks: tuple[str, ...]
  num_prompts: int
  task_size: int
  prompt_seed: int
  reward_fn: str  # '' = the built-in rewards | 'module:function'
  lr: float
  weight_decay: float
  b1: float
  b2: float
  grad_clip: float
  clip_eps: float
  kl_beta: float
  aux_coef: float
  updates_per_step: int
  tile_m: int
  released_logprobs: bool
  routing_replay: bool


@dataclasses.dataclass(frozen=True)
class SFTSettings:
  steps: int
  batch_size: int
  lr: float
  weight_decay: float
  seed: int
  num_prompts: int
  output_dir: str
  eval_every: int


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  steps: int
  output_dir: str
  checkpoint_every: int
  keep_checkpoints: int  # 0 = keep all


def _bench(c, parts: dict) -> BenchSettings:
  r = Reader(c, "")
  return BenchSettings(output_dir=r.text("output_dir", nonempty=True), epochs=r.int("epochs"),
                       repeats=r.int("repeats"), release_only=r.flag("release_only"),
                       cost_model=_cost_model(r), seeds=_seeds(r))


def _seeds(r: Reader) -> tuple[int, ...]:
  """bench's seeds: a comma list of workload seeds; '' or absent (an older config) = the run of
  sampling.seed alone."""
  text = r.text("seeds", default="")
  if not text.strip():
    return ()
  try:
    return tuple(workload.parse_seeds(text))
  except ValueError as e:
    raise ConfigError(f"{r.name('seeds')}: {e}") from None


def _cost_model(r: Reader, default=REQUIRED) -> str:
  """A cost_model field (the bench's; the scheduler's, which older configs lack), checked before
  any run (sim.presets.parse_cost_model)."""
  text = r.text("cost_model", default=default, nonempty=True)
  try:
    parse_cost_model(text)
  except ValueError as e:
    raise ConfigError(f"{r.name('cost_model')}: {e}") from None
  return text


def _rl(c, parts: dict) -> RLSettings:
  r = Reader(c.get("rl"), "rl")
  try:
    tasks = tuple(tasks_lib.parse_tasks(r.raw("tasks")))
    reward_fn = r.text("reward_fn")
    tasks_lib.load_reward_fn(reward_fn)  # imports the user's module: it must exist
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from None
  return RLSettings(
      tasks=tasks, num_prompts=r.int("num_prompts"), task_size=r.int("task_size"),
      prompt_seed=r.int("prompt_seed", 0), reward_fn=reward_fn,
      lr=r.num("lr"), weight_decay=r.num("weight_decay"), b1=r.num("b1", 0, 1, hi_open=True),
      b2=r.num("b2", 0, 1, hi_open=True), grad_clip=r.num("grad_clip", lo_open=True),
      clip_eps=r.num("clip_eps", lo_open=True), kl_beta=r.num("kl_beta"),
      aux_coef=r.num("aux_coef"), updates_per_step=r.int("updates_per_step"),
      tile_m=r.int("tile_m"), released_logprobs=r.flag("released_logprobs"),
      routing_replay=r.flag("routing_replay"))


def _sft(c, parts: dict) -> SFTSettings:
  r = Reader(c.get("sft"), "sft")
  s = SFTSettings(steps=r.int("steps"), batch_size=r.int("batch_size"), lr=r.num("lr"),
                  weight_decay=r.num("weight_decay"), seed=r.int("seed", 0),
                  num_prompts=r.int("num_prompts"),
                  output_dir=r.text("output_dir", nonempty=True), eval_every=r.int("eval_every"))
  if s.batch_size > s.num_prompts:  # batches are drawn without replacement from the pool
    raise ConfigError(f"sft.batch_size={s.batch_size} exceeds the pool of "
                      f"sft.num_prompts={s.num_prompts} examples")
  # The closing evaluation rollout's prompts (the byte tokenizer of the preset), checked as the
  # runner will check them after training.
  rl, ro, seq = parts["rl"], parts["rollout"], parts["model"].max_seq_len
  for row in tasks_lib.make_prompts(rl.tasks, rl.num_prompts, rl.prompt_seed, rl.task_size):
    n = len(ByteTokenizer().encode(row["prompt"], add_bos=True))
    if n > ro.max_prompt_len or (seq and n + ro.max_new_tokens > seq):
      raise ConfigError(f"rl.task_size={rl.task_size}: evaluation prompt {row['id']!r} has {n} "
                        f"tokens; it needs rollout.max_prompt_len >= {n} and model.max_seq_len "
                        f">= {n} + rollout.max_new_tokens")
  return s


def _train(c, parts: dict) -> TrainSettings:
  r = Reader(c, "")
  if parts["rollout"].lengths != "model":
    raise ConfigError(f"rollout.lengths: must be 'model' for RL (responses end at EOS), got "
                      f"{parts['rollout'].lengths!r}")
  return TrainSettings(steps=r.int("steps"), output_dir=r.text("output_dir", nonempty=True),
                       checkpoint_every=r.int("checkpoint_every"),
                       keep_checkpoints=r.int("keep_checkpoints", 0, note=" (0 = keep all)"))


# section -> its reader; entry point -> the sections it reads besides the shared ones
SECTIONS: dict[str, Callable[[Any, dict], Any]] = {
    "bench": _bench, "rl": _rl, "sft": _sft, "train": _train}
ENTRIES: dict[str, tuple[str, ...]] = {
    "rollout": (), "bench": ("bench",), "sft": ("rl", "sft"), "train": ("rl", "train")}


# ----------------------------------------------------------------------------- the settings


@dataclasses.dataclass(frozen=True)
class Settings:
  preset: str
  schedule: str
  model: ModelSettings
  mesh: MeshSettings
  rollout: RolloutSettings
  workload: WorkloadSettings
  sampling: SamplingSettings
  scheduler: SchedulerSettings
  bench: BenchSettings | None = None
  rl: RLSettings | None = None
  sft: SFTSettings | None = None
  train: TrainSettings | None = None

  def replace(self, **changes) -> Settings:
    """A copy with fields the program sets (not the user's: they are not checked again), e.g.
    replace(schedule="static", rollout=dict(epoch=3)): a dict updates that section."""
    return dataclasses.replace(self, **{
        k: dataclasses.replace(getattr(self, k), **v) if isinstance(v, dict) else v
        for k, v in changes.items()})


def load(config, entry: str = "rollout") -> Settings:
  """The settings of `config` for entry point `entry` (a key of ENTRIES); ConfigError names the
  first bad field."""
  r = Reader(config, "")
  preset = r.choice("preset", tuple(PRESETS))
  schedule = r.choice("schedule", plan.SCHEDULES)
  parts: dict[str, Any] = dict(
      model=_model(config), mesh=_mesh(config), rollout=_rollout(config),
      workload=_workload(config), sampling=_sampling(config), scheduler=_scheduler(config))
  m: ModelSettings = parts["model"]
  ro: RolloutSettings = parts["rollout"]
  if m.max_seq_len and ro.max_prompt_len > m.max_seq_len:
    raise ConfigError(f"rollout.max_prompt_len={ro.max_prompt_len} exceeds model.max_seq_len="
                      f"{m.max_seq_len} (the prefill writes max_prompt_len positions into a KV "
                      "cache of max_seq_len)")
  if m.attention_backend == "pallas" and ro.kv != "paged":
    raise ConfigError("model.attention_backend: 'pallas' is the paged decode's kernel; it needs "
                      f"rollout.kv='paged' (got rollout.kv={ro.kv!r})")
  if ro.kv == "paged" and m.max_seq_len and ro.kv_pages and (
      ro.kv_pages < pages_for(m.max_seq_len, ro.page_size)):
    raise ConfigError(f"rollout.kv_pages={ro.kv_pages} of rollout.page_size={ro.page_size} "
                      f"tokens cannot hold one sequence of model.max_seq_len={m.max_seq_len}")
  for name in ENTRIES[entry]:
    parts[name] = SECTIONS[name](config, parts)
  return Settings(preset=preset, schedule=schedule, **parts)


def as_settings(config) -> Settings:
  """`config` itself when it is already Settings, else load(config) (the rollout's sections)."""
  return config if isinstance(config, Settings) else load(config)
