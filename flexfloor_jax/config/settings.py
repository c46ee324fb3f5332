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
import typing
from collections.abc import Callable
from typing import Any, Literal

import ml_collections

from flexfloor_jax.config import schema
from flexfloor_jax.config.reader import REQUIRED, ConfigError, Reader
from flexfloor_jax.config.schema import (
  INT32_MAX,
  UINT32_MAX,
  Choice,
  Custom,
  Flag,
  Int,
  Num,
  Text,
  read,
)
from flexfloor_jax.model.config import ATTENTION_BACKENDS, MOE_BACKENDS, PRESETS
from flexfloor_jax.model.tokenizer import ByteTokenizer
from flexfloor_jax.policy import costs, plan, workload
from flexfloor_jax.policy.floor import parse_release_sizes
from flexfloor_jax.policy.pages import pages_for
from flexfloor_jax.rl import tasks as tasks_lib
from flexfloor_jax.sim.presets import parse_cost_model

# ----------------------------------------------------------------------------- shared sections

Dtype = Literal["float32", "bfloat16", "float16"]
Exchange = Literal["auto", "all_to_all", "ragged"]  # moe.EXCHANGES and 'auto' (moe imports jax)
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
EXCHANGES: tuple[str, ...] = typing.get_args(Exchange)
# Emulated CPU devices share the host's cores and memory: past this, jax spends minutes starting
# them, and the host runs out of memory before any work
MAX_CPU_DEVICES = 1024
# No accelerator has more memory than this per device (GiB); a larger figure is a typo
MAX_DEVICE_MEMORY_GB = 16384.0
# The workload's lognormal spreads (sigma and the noises): past this nearly every length sits at
# 1 or at the cap, whatever the median
MAX_WORKLOAD_SIGMA = 3.0
# speculative decoding: each drafted token is a decode row a step verifies
MAX_DRAFT_TOKENS = 64


def Seed(doc: str):
  """A seed, an epoch: folded into uint32 PRNG keys."""
  return Int(0, UINT32_MAX, doc=doc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSettings:
  checkpoint: str = Text(doc="'' = random init | a Hugging Face directory | an orbax directory")
  dtype: Dtype = Choice(doc="activation and parameter dtype")
  moe_backend: str = Choice(MOE_BACKENDS, doc="MoE kernels: 'auto' (Pallas on TPU and CUDA "
                            "GPUs, XLA on CPU) | 'xla' | 'pallas' (interpreted on CPU)")
  attention_backend: str = Choice(ATTENTION_BACKENDS, default="xla",
                                  doc="paged decode attention (rollout.kv='paged' only)")
  max_seq_len: int = Custom(doc="KV cache length; 0 = the longest prompt + "
                            "rollout.max_new_tokens, capped by max_position_embeddings")
  init_seed: int = Seed(doc="random init only")
  init_scale: float = Num(doc="std of random init")
  exchange: Exchange = Choice(default="auto", doc="EP token exchange ('auto': 'ragged' where "
                              "ragged_all_to_all exists, else 'all_to_all')")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSettings:
  num_devices: int = Int(0, note=" (0 = all devices)", doc="workers: 0 = all devices")
  device_memory_gb: float = Num(hi=MAX_DEVICE_MEMORY_GB, note=" (0 = the device's own memory)",
                                doc="per-device budget (GiB); 0 = the device's own, else 16")
  cpu_devices: int = Int(hi=MAX_CPU_DEVICES, default=8,
                         doc="emulated devices when running on CPU (set before jax starts)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSettings:
  prompts: str = Text(doc="'' = built-in prompt set | JSONL of {id, prompt} or {id, tokens}")
  num_prompts: int = Int(doc="size of the built-in prompt set")
  samples_per_prompt: int = Int(doc="GRPO group size (samples adjacent in the batch)")
  max_new_tokens: int = Int(doc="response length cap")
  max_prompt_len: int = Int(doc="prefill width")
  slots_per_worker: int = Int(doc="decode slots per worker (same for every schedule)")
  lengths: str = Custom(doc="'model' | 'workload' | lengths JSONL; 'auto': workload without a "
                        "checkpoint")
  epoch: int = Seed(doc="workload epoch / RL step (keys sampling, drives the history)")
  steps_per_dispatch: int = Int(doc="decode steps per device dispatch (host checks between)")
  wait_compiles: bool = Flag(doc="compile every mesh size and mover before the first step")
  wait_plan_compiles: bool = Flag(default=True, doc="compile, and wait for, the sizes the plan "
                                  "expects to reach")
  compile_threads: int = Int(0, default=0, note=" (0 = one per core, at most 4)",
                             doc="sizes compiled side by side; 0 = one per core, at most 4")
  record_routes: bool = Flag(default=False, doc="responses carry every fed token's top-k "
                             "experts per layer (RL routing replay)")
  output_dir: str = Text(doc="where responses.jsonl, summary.json, timeline.png go")
  kv: Literal["slots", "paged"] = Choice(default="slots", doc="KV memory: 'slots' (a cache row "
                                         "of model.max_seq_len per slot) | 'paged' (a page "
                                         "pool per worker)")
  page_size: int = Int(default=16, doc="paged: tokens per page")
  max_seqs_per_worker: int = Int(0, default=0, note=" (0 = 2 x rollout.slots_per_worker)",
                                 doc="paged: sequence rows per worker; 0 = 2 x slots_per_worker")
  kv_pages: int = Int(0, default=0, note=" (0 = the bytes of the fixed-slot cache)",
                      doc="paged: pages per worker; 0 = the fixed-slot cache's bytes")
  kv_margin: float = Num(default=0.25, doc="paged: admission reserves predicted length x "
                         "(1 + margin)")
  prefill_chunk: int = Int(0, default=0, note=" (0 = prefill steps apart)",
                           doc="chunked prefill: input tokens a decode step takes per worker "
                           "(vLLM's chunked prefill); 0 = one-shot prefill steps")
  max_prefill_chunk: int = Int(0, default=0, note=" (0 = rollout.prefill_chunk)",
                               doc="the compiled bound of prefill_chunk: runs with chunks up to "
                               "it share their executables and their tokens")
  draft_tokens: int = Int(0, MAX_DRAFT_TOKENS, default=0, note=" (0 = off)",
                          doc="speculative decoding: tokens drafted per live sequence and "
                          "dispatch from earlier epochs' responses and sibling samples, verified "
                          "in free decode rows (the responses do not change); 0 = off")
  draft_store: str = Text(default="", doc="speculative decoding: the response store file; '' = "
                          "response_store.npz beside the length history")

  @property
  def max_seqs(self) -> int:
    """Paged KV: sequence rows per worker (max_seqs_per_worker, 0 resolved)."""
    return self.max_seqs_per_worker or 2 * self.slots_per_worker

  @property
  def lanes(self) -> int:
    """Sequences a worker runs at once: its decode slots, or (paged KV) its sequence rows."""
    return self.max_seqs if self.kv == "paged" else self.slots_per_worker

  @property
  def prefill_rows(self) -> int:
    """Chunked prefill: the query rows for input tokens a step compiles beside its decode rows
    (max_prefill_chunk, 0 resolved); 0 = one-shot prefill."""
    return (self.max_prefill_chunk or self.prefill_chunk) if self.prefill_chunk else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSettings:
  """rollout.lengths='workload': length = clip(median * exp(sigma z_prompt + epoch_noise u +
  sample_noise v), 1, rollout.max_new_tokens) (policy/workload.py)."""
  sigma: float = Num(hi=MAX_WORKLOAD_SIGMA, default=workload.DEFAULT_SIGMA,
                     doc="lognormal sigma of per-prompt mean lengths")
  median: float = Num(lo=1.0, default=float(workload.DEFAULT_MEDIAN),
                      note=" (tokens: below one every length is 1)",
                      doc="median response length (tokens)")
  epoch_noise: float = Num(hi=MAX_WORKLOAD_SIGMA, default=workload.DEFAULT_EPOCH_NOISE,
                           doc="sigma of a prompt's per-epoch noise")
  sample_noise: float = Num(hi=MAX_WORKLOAD_SIGMA, default=workload.DEFAULT_SAMPLE_NOISE,
                            doc="sigma of per-sample noise")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSettings:
  temperature: float = Num(note=" (0 = greedy)", doc="0 = greedy")
  top_p: float = Num(0, 1, lo_open=True, doc="nucleus sampling mass")
  top_k: int = Int(0, note=" (0 = off)", doc="0 = off")
  seed: int = Seed(doc="sampling seed (with rollout.epoch, keys every sequence)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
  history_path: str = Text(doc="length history file; '' = <rollout.output_dir>/history.json")
  compaction: bool = Flag(doc="migrate stragglers off workers that could be released")
  placement: str = Choice(plan.PLACEMENTS, default="auto", doc="'auto' = length-aware "
                          "placement | 'balanced' | 'static' (the baseline's, kept)")
  release_sizes: str = Custom(default="", doc="active-group sizes a release may leave: '' = "
                              "every size down to the floor | 'pow2' | a comma list")
  makespan_slack: float = Num(0, 1, default=0.05, doc="flexfloor's makespan may exceed "
                              "balanced's predicted one by this fraction")
  step_cost: str = Custom(default="auto", doc="what decisions are priced in: 'measured' | "
                          "'steps' | 'roofline:MODEL@HARDWARE' | 'auto'")
  cost_model: str = Custom(default=costs.DEFAULT_COST_MODEL, doc="'roofline:MODEL@HARDWARE': "
                           "what 'auto' decides in on emulated CPU devices")


def _model(c) -> ModelSettings:
  r = Reader(c.get("model"), "model")
  dtype = r.choice("dtype", DTYPES, note=" (JAX computes float64 as float32 unless "
                   "jax_enable_x64 is set: the run would not be what was asked)"
                   if r.raw("dtype") == "float64" else "")
  seq = r.raw("max_seq_len")
  if (not isinstance(seq, numbers.Integral) or isinstance(seq, bool) or seq < 0 or seq == 1
      or int(seq) > INT32_MAX):
    r.fail("max_seq_len", "0 (the longest prompt + rollout.max_new_tokens, capped by the "
           f"model's max_position_embeddings) or an integer in [2, {INT32_MAX}]", seq)
  return read(ModelSettings, r, dtype=dtype, max_seq_len=int(seq))


def _mesh(c) -> MeshSettings:
  return read(MeshSettings, Reader(c.get("mesh"), "mesh"))


def _rollout(c) -> RolloutSettings:
  r = Reader(c.get("rollout"), "rollout")
  lengths = r.text("lengths")
  if lengths not in ("auto", "model", "workload") and not os.path.isfile(lengths):
    raise ConfigError(f"rollout.lengths: must be 'model', 'workload' or a lengths JSONL file; "
                      f"{lengths!r} is neither (file not found)")
  return read(RolloutSettings, r, lengths=lengths)


def _workload(c) -> WorkloadSettings:
  return read(WorkloadSettings, Reader(c.get("workload"), "workload", optional=True))


def _sampling(c) -> SamplingSettings:
  return read(SamplingSettings, Reader(c.get("sampling"), "sampling"))


def _scheduler(c) -> SchedulerSettings:
  r = Reader(c.get("scheduler"), "scheduler")
  sizes = r.text("release_sizes", default=schema.default(SchedulerSettings, "release_sizes"))
  try:
    parse_release_sizes(sizes)
  except ValueError as e:
    raise ConfigError(f"scheduler.release_sizes: {e}") from None
  return read(SchedulerSettings, r, release_sizes=sizes, step_cost=_step_cost(r),
              cost_model=_cost_model(r, schema.default(SchedulerSettings, "cost_model")))


def _step_cost(r: Reader) -> str:
  """scheduler.step_cost: one of costs.STEP_COSTS or a named roofline pair."""
  d = schema.default(SchedulerSettings, "step_cost")
  text = r.text("step_cost", default=d)
  if text.startswith("roofline:"):
    try:
      parse_cost_model(text)
    except ValueError as e:
      raise ConfigError(f"{r.name('step_cost')}: {e}") from None
    return text
  return r.choice("step_cost", costs.STEP_COSTS, default=d)


# ----------------------------------------------------------------------------- entry sections


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSettings:
  output_dir: str = Text(nonempty=True, doc="bench.json, bench.png, runs/*.json")
  epochs: int = Int(doc="epochs 0..epochs-1; the length history grows from one to the next")
  repeats: int = Int(doc="runs of each schedule per epoch")
  release_only: bool = Flag(doc="also the static placement with release alone, and with "
                            "compaction")
  cost_model: str = Custom(doc="'roofline:MODEL@HARDWARE': every run replayed in its seconds")
  seeds: tuple[int, ...] = Custom(default=(), doc="workload seeds (sampling.seed) to run every "
                                  "epoch for: a comma list; '' = sampling.seed alone")
  draft_tokens: int = Int(0, MAX_DRAFT_TOKENS, default=0, note=" (0 = not)",
                          doc="speculative decoding: also run static, balanced and flexfloor "
                          "with rollout.draft_tokens = this, drafting from a response store of "
                          "the earlier epochs (0 = not)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLSettings:
  tasks: tuple[str, ...] = Custom(doc="built-in tasks, a comma list (rl/tasks.py)")
  num_prompts: int = Int(doc="prompts per step")
  task_size: int = Int(doc="problem size (digits, letters)")
  prompt_seed: int = Seed(doc="seed of the prompt set")
  reward_fn: str = Custom(doc="'' = the built-in rewards | 'module:function' "
                          "(fn(prompt_row, text) -> float)")
  lr: float = Num(doc="AdamW learning rate")
  weight_decay: float = Num(doc="AdamW weight decay")
  b1: float = Num(0, 1, hi_open=True, doc="AdamW beta1")
  b2: float = Num(0, 1, hi_open=True, doc="AdamW beta2")
  grad_clip: float = Num(lo_open=True, doc="global gradient-norm clip")
  clip_eps: float = Num(lo_open=True, doc="PPO ratio clip")
  kl_beta: float = Num(doc="> 0: k3 KL to the frozen initial policy")
  aux_coef: float = Num(doc="load-balance loss coefficient")
  updates_per_step: int = Int(doc="optimizer steps per rollout")
  tile_m: int = Int(doc="expert GEMM tile of the training forward")
  released_logprobs: bool = Flag(doc="flexfloor: released workers score finished responses")
  routing_replay: bool = Flag(doc="replay the rollout's routing in the training forward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTSettings:
  steps: int = Int(doc="optimizer steps")
  batch_size: int = Int(doc="examples per step (at most sft.num_prompts)")
  lr: float = Num(doc="AdamW learning rate")
  weight_decay: float = Num(doc="AdamW weight decay")
  seed: int = Seed(doc="seed of the training pool and batches")
  num_prompts: int = Int(doc="training pool size")
  output_dir: str = Text(nonempty=True, doc="checkpoint at <output_dir>/checkpoint")
  eval_every: int = Int(doc="steps between evaluations")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSettings:
  steps: int = Int(doc="RL steps")
  output_dir: str = Text(nonempty=True, doc="checkpoints, metrics, prompts")
  checkpoint_every: int = Int(doc="orbax checkpoint every k steps (and after the last)")
  keep_checkpoints: int = Int(0, note=" (0 = keep all)", doc="newest complete checkpoints "
                              "kept; 0 = keep all")


def _bench(c, parts: dict) -> BenchSettings:
  r = Reader(c, "")
  b = read(BenchSettings, r, cost_model=_cost_model(r), seeds=_seeds(r))
  # the drafted runs take rollout.draft_tokens = draft_tokens: the rollout's own checks
  # (check_chunk) for it, named by the bench's field
  ro, d = parts["rollout"], b.draft_tokens
  if d and ro.max_new_tokens and d >= ro.max_new_tokens:
    raise ConfigError(f"draft_tokens={d} must be below rollout.max_new_tokens="
                      f"{ro.max_new_tokens}")
  if d and ro.prefill_chunk:
    raise ConfigError(f"draft_tokens={d} with rollout.prefill_chunk={ro.prefill_chunk}: "
                      "speculative decoding and chunked prefill do not run together; set one of "
                      "them to 0")
  return b


def _seeds(r: Reader) -> tuple[int, ...]:
  """bench's seeds: a comma list of workload seeds; '' or absent (an older config) = the run of
  sampling.seed alone."""
  text = r.text("seeds", default="")
  if not text.strip():
    return typing.cast(tuple[int, ...], schema.default(BenchSettings, "seeds"))
  try:
    seeds = tuple(workload.parse_seeds(text))
  except ValueError as e:
    raise ConfigError(f"{r.name('seeds')}: {e}") from None
  if max(seeds) > UINT32_MAX:
    raise ConfigError(f"{r.name('seeds')}: seed {max(seeds)} exceeds {UINT32_MAX} (seeds key "
                      "uint32 PRNG streams)")
  return seeds


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
  rl = read(RLSettings, r, tasks=tasks, reward_fn=reward_fn)
  # A prompt holds at least task_size characters: a size past the prefill width cannot fit, and
  # rendering its prompts (before the exact check in _sft, and the runner's) would take minutes
  if rl.task_size > parts["rollout"].max_prompt_len:
    raise ConfigError(f"rl.task_size={rl.task_size}: its prompts hold more than "
                      f"{rl.task_size} tokens; they need rollout.max_prompt_len > "
                      f"{rl.task_size} and model.max_seq_len > {rl.task_size} + "
                      "rollout.max_new_tokens")
  return rl


def _sft(c, parts: dict) -> SFTSettings:
  s = read(SFTSettings, Reader(c.get("sft"), "sft"))
  if s.batch_size > s.num_prompts:  # batches are drawn without replacement from the pool
    raise ConfigError(f"sft.batch_size={s.batch_size} exceeds the pool of "
                      f"sft.num_prompts={s.num_prompts} examples")
  # The closing evaluation rollout's prompts (the byte tokenizer of the preset), checked as the
  # runner will check them after training.
  rl, ro, seq = parts["rl"], parts["rollout"], parts["model"].max_seq_len
  for row in tasks_lib.make_prompts(rl.tasks, rl.num_prompts, rl.prompt_seed, rl.task_size):
    n = len(ByteTokenizer().encode(row["prompt"], add_bos=True))
    try:
      check_cache(ro, seq, n)
    except ConfigError:
      raise ConfigError(f"rl.task_size={rl.task_size}: evaluation prompt {row['id']!r} has {n} "
                        f"tokens; it needs rollout.max_prompt_len >= {n} and model.max_seq_len "
                        f">= {n} + rollout.max_new_tokens") from None
  return s


def _train(c, parts: dict) -> TrainSettings:
  if parts["rollout"].lengths != "model":
    raise ConfigError(f"rollout.lengths: must be 'model' for RL (responses end at EOS), got "
                      f"{parts['rollout'].lengths!r}")
  return read(TrainSettings, Reader(c, ""))


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
  check_cache(ro, m.max_seq_len)
  if m.attention_backend == "pallas" and ro.kv != "paged":
    raise ConfigError("model.attention_backend: 'pallas' is the paged decode's kernel; it needs "
                      f"rollout.kv='paged' (got rollout.kv={ro.kv!r})")
  if ro.kv == "paged" and m.max_seq_len and ro.kv_pages and (
      ro.kv_pages < pages_for(m.max_seq_len, ro.page_size)):
    raise ConfigError(f"rollout.kv_pages={ro.kv_pages} of rollout.page_size={ro.page_size} "
                      f"tokens cannot hold one sequence of model.max_seq_len={m.max_seq_len}")
  check_chunk(ro)
  for name in ENTRIES[entry]:
    parts[name] = SECTIONS[name](config, parts)
  return Settings(preset=preset, schedule=schedule, **parts)


def check_chunk(ro: RolloutSettings) -> None:
  """Chunked prefill: a chunk of at least one page (a step's input tokens fill whole pages of
  the pool) and at most the compiled bound."""
  c, bound = ro.prefill_chunk, ro.max_prefill_chunk
  if c and c < ro.page_size:
    raise ConfigError(f"rollout.prefill_chunk={c} is below one page (rollout.page_size="
                      f"{ro.page_size}); 0 turns chunked prefill off")
  if c and bound and c > bound:
    raise ConfigError(f"rollout.prefill_chunk={c} exceeds its compiled bound "
                      f"rollout.max_prefill_chunk={bound}")
  if bound and not c:
    raise ConfigError(f"rollout.max_prefill_chunk={bound} without rollout.prefill_chunk: set "
                      "the chunk too, or 0 for both")
  d = ro.draft_tokens
  if d and ro.max_new_tokens and d >= ro.max_new_tokens:
    raise ConfigError(f"rollout.draft_tokens={d} must be below rollout.max_new_tokens="
                      f"{ro.max_new_tokens}")
  if d and c:
    raise ConfigError(f"rollout.draft_tokens={d} with rollout.prefill_chunk={c}: speculative "
                      "decoding and chunked prefill do not run together; set one of them to 0")


def check_cache(ro: RolloutSettings, max_seq_len: int, prompt_len: int | None = None,
                max_position_embeddings: int | None = None) -> None:
  """The one check of a prompt against the KV cache, wherever its length becomes known: the
  prefill writes rollout.max_prompt_len positions into a cache of `max_seq_len` (0: not fixed
  yet), which must also hold a prompt of `prompt_len` tokens plus rollout.max_new_tokens and fit
  the model's `max_position_embeddings`. ConfigError names the fields."""
  if max_seq_len and ro.max_prompt_len > max_seq_len:
    raise ConfigError(f"rollout.max_prompt_len={ro.max_prompt_len} exceeds model.max_seq_len="
                      f"{max_seq_len} (the prefill writes max_prompt_len positions into a KV "
                      "cache of max_seq_len)")
  if prompt_len is not None and prompt_len > ro.max_prompt_len:
    raise ConfigError(f"{prompt_len} tokens, more than rollout.max_prompt_len="
                      f"{ro.max_prompt_len}")
  if prompt_len is not None and max_seq_len and prompt_len + ro.max_new_tokens > max_seq_len:
    raise ConfigError(f"{prompt_len} tokens + rollout.max_new_tokens={ro.max_new_tokens} "
                      f"exceeds model.max_seq_len={max_seq_len}")
  if max_position_embeddings is not None:
    cache = max_seq_len or ro.max_prompt_len
    if cache > max_position_embeddings:
      name = "model.max_seq_len" if max_seq_len else "rollout.max_prompt_len"
      raise ConfigError(f"{name}={cache} exceeds the model's max_position_embeddings="
                        f"{max_position_embeddings}")


def defaults_config(*sections: str) -> Any:
  """The schema's defaults of the named shared sections, as a ConfigDict per section: what the
  config files start from, so that every default is written once, here."""
  classes = dict(model=ModelSettings, mesh=MeshSettings, rollout=RolloutSettings,
                 workload=WorkloadSettings, sampling=SamplingSettings,
                 scheduler=SchedulerSettings)
  c = ml_collections.ConfigDict()
  for name in sections or tuple(classes):
    c[name] = ml_collections.ConfigDict(schema.defaults(classes[name]))
  return c


def as_settings(config) -> Settings:
  """`config` itself when it is already Settings, else load(config) (the rollout's sections)."""
  return config if isinstance(config, Settings) else load(config)
