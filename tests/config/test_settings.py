"""settings.load: every config file converts to frozen, typed settings; every field of every section
rejects a bad value with one ConfigError that names it; the module runs without jax."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import typing

import pytest
from checkout import ROOT

from flexfloor_jax.config import settings
from flexfloor_jax.config.files import load_config
from flexfloor_jax.config.settings import ConfigError, load
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.model.families import FAMILIES

CONFIG_FILES = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")
# A model family's config file (configs/qwen3_moe.py) takes its family's presets; every other
# file builds on configs/mixtral.py and takes the Mixtral ones.
FILE_PRESETS = [(name, preset) for name in CONFIG_FILES for preset in sorted(PRESETS)
                if PRESETS[preset].family == (name if name in FAMILIES else "mixtral")]
# Each entry point's own fields: whole sections (rl, sft) or fields at the top level (bench,
# train), read from the settings' dataclasses, not listed here.
OWN_SECTIONS = {"rl": settings.RLSettings, "sft": settings.SFTSettings}
OWN_TOP_LEVEL = {"bench": settings.BenchSettings, "train": settings.TrainSettings}


def _holds(c, entry: str) -> bool:
  """Whether config `c` has the fields that entry point reads besides the shared sections."""
  for sec in settings.ENTRIES[entry]:
    if sec in OWN_SECTIONS and sec not in c:
      return False
    if sec in OWN_TOP_LEVEL and not all(f.name in c for f in
                                        dataclasses.fields(OWN_TOP_LEVEL[sec])):
      return False
  return True


def test_config_files_found():
  assert "mixtral" in CONFIG_FILES and len(CONFIG_FILES) > 1


def test_every_preset_has_a_config_file():
  assert {p for _, p in FILE_PRESETS} == set(PRESETS)
  assert {"mixtral", "qwen3_moe", "gpt_oss"} <= set(CONFIG_FILES)


@pytest.mark.parametrize("name,preset", FILE_PRESETS)
def test_config_files_convert(name, preset):
  """Every config file in configs/, at every model preset, converts for every entry point whose
  fields it holds (every file holds the rollout's sections), keeping the file's values."""
  c = load_config(name, preset)
  entries = [e for e in settings.ENTRIES if _holds(c, e)]
  assert "rollout" in entries
  for entry in entries:
    st = load(c, entry)
    assert st.preset == preset and st.schedule == c.schedule
    for sec in ("model", "mesh", "rollout", "sampling", "scheduler"):
      for f in dataclasses.fields(getattr(st, sec)):
        if f.name in c[sec]:
          assert getattr(getattr(st, sec), f.name) == c[sec][f.name], (sec, f.name)
    assert st.workload.median == c.workload.median
    for sec in ("bench", "rl", "sft", "train"):
      assert (getattr(st, sec) is not None) == (sec in settings.ENTRIES[entry]), sec
    if entry == "bench":
      assert st.bench.epochs == c.epochs and st.bench.output_dir == c.output_dir
    if entry == "train":
      assert (st.train.steps, st.train.output_dir) == (c.steps, c.output_dir)
      assert st.rl.tasks == tuple(c.rl.tasks.split(",")) and st.rl.lr == c.rl.lr
    if entry == "sft":
      assert st.sft.batch_size == c.sft.batch_size


def test_every_entry_point_has_a_config_file():
  """Some file of configs/ (at its default preset) converts for each entry point."""
  holds = {e for n in CONFIG_FILES for e in settings.ENTRIES if _holds(load_config(n), e)}
  assert holds == set(settings.ENTRIES)


def test_settings_are_frozen_and_typed():
  st = load(load_config("grpo", "tiny"), "train")
  with pytest.raises(dataclasses.FrozenInstanceError):
    st.rollout.max_new_tokens = 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    st.schedule = "static"
  with pytest.raises(dataclasses.FrozenInstanceError):
    st.rl.lr = 0.0
  assert isinstance(st.workload.median, float) and isinstance(st.mesh.device_memory_gb, float)
  assert isinstance(st.rl.tasks, tuple) and isinstance(st.rollout.wait_compiles, bool)
  # replace: a new object for the values the program sets; the original is unchanged
  c = st.replace(schedule="static", rollout=dict(epoch=3, prompts="p.jsonl"))
  assert (c.schedule, c.rollout.epoch, c.rollout.prompts) == ("static", 3, "p.jsonl")
  assert (st.schedule, st.rollout.epoch) == ("flexfloor", 0) and c.rl is st.rl
  assert settings.as_settings(c) is c


def test_optional_fields_take_their_defaults():
  c = load_config("mixtral", "tiny").to_dict()
  for sec, f in (("model", "exchange"), ("rollout", "compile_threads"),
                 ("rollout", "wait_plan_compiles"), ("rollout", "record_routes"),
                 ("rollout", "kv"), ("rollout", "page_size"), ("rollout", "max_seqs_per_worker"),
                 ("rollout", "kv_pages"), ("rollout", "kv_margin"),
                 ("scheduler", "makespan_slack"), ("scheduler", "step_cost"),
                 ("scheduler", "placement"), ("scheduler", "release_sizes")):
    del c[sec][f]
  del c["workload"]
  st = load(c)
  assert (st.model.exchange, st.rollout.compile_threads, st.rollout.wait_plan_compiles,
          st.rollout.record_routes) == ("auto", 0, True, False)
  assert (st.scheduler.makespan_slack, st.scheduler.step_cost, st.scheduler.placement,
          st.scheduler.release_sizes) == (0.05, "auto", "auto", "")
  assert st.workload == settings.WorkloadSettings()
  assert (st.rollout.kv, st.rollout.page_size, st.rollout.max_seqs_per_worker,
          st.rollout.kv_pages, st.rollout.kv_margin) == ("slots", 16, 0, 0, 0.25)
  assert (st.rollout.max_seqs, st.rollout.lanes) == (8, 4)


@pytest.mark.parametrize("field", ["rollout.max_new_tokens", "model.dtype", "sampling.seed",
                                   "schedule", "mesh"])
def test_a_missing_field_is_named(field):
  c = load_config("mixtral", "tiny").to_dict()
  *path, last = field.split(".")
  node = c
  for p in path:
    node = node[p]
  del node[last]
  with pytest.raises(ConfigError, match=rf"^{field}: .*missing"):
    load(c)


NAN, INF = math.nan, math.inf
# (entry, config file, field, bad value); the top-level fields of bench and train are plain names.
BAD = [
    ("rollout", "mixtral", "preset", "huge"),
    ("rollout", "mixtral", "schedule", "verl"),
    ("rollout", "mixtral", "model.checkpoint", None),
    ("rollout", "mixtral", "model.dtype", "float64"),
    ("rollout", "mixtral", "model.dtype", "fp16x"),
    ("rollout", "mixtral", "model.moe_backend", "triton"),
    ("rollout", "mixtral", "model.attention_backend", "triton"),
    ("rollout", "mixtral", "model.attention_backend", "pallas"),  # needs rollout.kv='paged'
    ("rollout", "mixtral", "model.max_seq_len", 1),
    ("rollout", "mixtral", "model.max_seq_len", -1),
    ("rollout", "mixtral", "model.max_seq_len", "64"),
    ("rollout", "mixtral", "model.init_seed", -1),
    ("rollout", "mixtral", "model.init_scale", -0.1),
    ("rollout", "mixtral", "model.init_scale", NAN),
    ("rollout", "mixtral", "model.exchange", "nccl"),
    ("rollout", "mixtral", "mesh.num_devices", -1),
    ("rollout", "mixtral", "mesh.device_memory_gb", -5.0),
    ("rollout", "mixtral", "mesh.device_memory_gb", INF),
    ("rollout", "mixtral", "mesh.cpu_devices", 0),
    ("rollout", "mixtral", "rollout.prompts", 3),
    ("rollout", "mixtral", "rollout.num_prompts", 0),
    ("rollout", "mixtral", "rollout.samples_per_prompt", 0),
    ("rollout", "mixtral", "rollout.max_new_tokens", 0),
    ("rollout", "mixtral", "rollout.max_new_tokens", -3),
    ("rollout", "mixtral", "rollout.max_new_tokens", True),
    ("rollout", "mixtral", "rollout.max_new_tokens", 2.5),
    ("rollout", "mixtral", "rollout.max_prompt_len", 0),
    ("rollout", "mixtral", "rollout.slots_per_worker", 0),
    ("rollout", "mixtral", "rollout.lengths", "no_such_lengths.jsonl"),
    ("rollout", "mixtral", "rollout.lengths", 7),
    ("rollout", "mixtral", "rollout.epoch", -1),
    ("rollout", "mixtral", "rollout.steps_per_dispatch", 0),
    ("rollout", "mixtral", "rollout.wait_compiles", 1),
    ("rollout", "mixtral", "rollout.wait_plan_compiles", "yes"),
    ("rollout", "mixtral", "rollout.compile_threads", -1),
    ("rollout", "mixtral", "rollout.record_routes", None),
    ("rollout", "mixtral", "rollout.output_dir", None),
    ("rollout", "mixtral", "rollout.kv", "vllm"),
    ("rollout", "mixtral", "rollout.page_size", 0),
    ("rollout", "mixtral", "rollout.max_seqs_per_worker", -1),
    ("rollout", "mixtral", "rollout.kv_pages", -1),
    ("rollout", "mixtral", "rollout.kv_margin", -0.5),
    ("rollout", "mixtral", "rollout.prefill_chunk", -16),
    ("rollout", "mixtral", "rollout.max_prefill_chunk", 1.5),
    ("rollout", "mixtral", "rollout.draft_tokens", 65),
    ("rollout", "mixtral", "rollout.draft_store", 3),
    ("rollout", "mixtral", "workload.sigma", -1.0),
    ("rollout", "mixtral", "workload.median", 0.0),
    ("rollout", "mixtral", "workload.epoch_noise", INF),
    ("rollout", "mixtral", "workload.sample_noise", "x"),
    ("rollout", "mixtral", "sampling.temperature", -1.0),
    ("rollout", "mixtral", "sampling.top_p", 0.0),
    ("rollout", "mixtral", "sampling.top_p", 1.5),
    ("rollout", "mixtral", "sampling.top_k", -1),
    ("rollout", "mixtral", "sampling.seed", -1),
    ("rollout", "mixtral", "scheduler.history_path", None),
    ("rollout", "mixtral", "scheduler.compaction", "true"),
    ("rollout", "mixtral", "scheduler.placement", "random"),
    ("rollout", "mixtral", "scheduler.release_sizes", "4,x"),
    ("rollout", "mixtral", "scheduler.release_sizes", "4,0"),
    ("rollout", "mixtral", "scheduler.makespan_slack", 1.5),
    ("rollout", "mixtral", "scheduler.step_cost", "wall"),
    ("rollout", "mixtral", "scheduler.step_cost", "roofline:mixtral-8x7b@abacus"),
    ("rollout", "mixtral", "scheduler.cost_model", "roofline:nope@h100"),
    ("rollout", "mixtral", "scheduler.cost_model", "steps"),
    ("bench", "bench", "output_dir", ""),
    ("bench", "bench", "epochs", 0),
    ("bench", "bench", "repeats", 0),
    ("bench", "bench", "release_only", "yes"),
    ("bench", "bench", "cost_model", "roofline:mixtral-8x7b@abacus"),
    ("bench", "bench", "cost_model", "roofline:nope@h100"),
    ("bench", "bench", "cost_model", "mixtral-8x7b@h100"),
    ("bench", "bench", "seeds", "0,-1"),
    ("bench", "bench", "seeds", 3),
    ("bench", "bench", "draft_tokens", -1),
    ("bench", "bench", "draft_tokens", 65),  # settings.MAX_DRAFT_TOKENS = 64
    ("train", "grpo", "rl.tasks", "sort,fly"),
    ("train", "grpo", "rl.tasks", ""),
    ("train", "grpo", "rl.num_prompts", 0),
    ("train", "grpo", "rl.task_size", 0),
    ("train", "grpo", "rl.prompt_seed", -1),
    ("train", "grpo", "rl.reward_fn", "no_colon"),
    ("train", "grpo", "rl.reward_fn", "no_such_module_xyz:f"),
    ("train", "grpo", "rl.lr", -1.0),
    ("train", "grpo", "rl.weight_decay", NAN),
    ("train", "grpo", "rl.b1", 1.0),
    ("train", "grpo", "rl.b2", -0.1),
    ("train", "grpo", "rl.grad_clip", 0.0),
    ("train", "grpo", "rl.clip_eps", 0.0),
    ("train", "grpo", "rl.kl_beta", -1.0),
    ("train", "grpo", "rl.aux_coef", -1.0),
    ("train", "grpo", "rl.updates_per_step", 0),
    ("train", "grpo", "rl.tile_m", 0),
    ("train", "grpo", "rl.released_logprobs", 1),
    ("train", "grpo", "rl.routing_replay", "no"),
    ("sft", "grpo", "rl.tasks", "fly"),  # the rl section is sft's too
    ("sft", "grpo", "sft.steps", 0),
    ("sft", "grpo", "sft.batch_size", 0),
    ("sft", "grpo", "sft.lr", -1.0),
    ("sft", "grpo", "sft.weight_decay", -1.0),
    ("sft", "grpo", "sft.seed", -1),
    ("sft", "grpo", "sft.num_prompts", 0),
    ("sft", "grpo", "sft.output_dir", ""),
    ("sft", "grpo", "sft.eval_every", 0),
    ("train", "grpo", "steps", 0),
    ("train", "grpo", "output_dir", ""),
    ("train", "grpo", "checkpoint_every", 0),
    ("train", "grpo", "keep_checkpoints", -1),
]


def _set(c: dict, field: str, value) -> None:
  *path, last = field.split(".")
  for p in path:
    c = c[p]
  c[last] = value


@pytest.mark.parametrize("entry, name, field, value", BAD, ids=[f"{f}={v!r}" for _, _, f, v in BAD])
def test_a_bad_value_is_rejected_naming_the_field(entry, name, field, value):
  c = load_config(name, "tiny").to_dict()  # a plain dict: any type can go in
  _set(c, field, value)
  with pytest.raises(ConfigError) as e:
    load(c, entry)
  msg = str(e.value)
  assert msg.startswith(f"{field}:") or msg.startswith(f"{field} "), msg
  assert "\n" not in msg
  if isinstance(value, str) and value:  # the bad value (a list's bad entry) is in the line
    assert value.split(",")[-1] in msg, msg


def test_every_field_has_a_bad_case():
  """Each field of each section (and each top-level field) appears in BAD."""
  covered = {f for _, _, f, _ in BAD}
  want = {"preset", "schedule"}
  types = typing.get_type_hints(settings.Settings)
  for sec in ("model", "mesh", "rollout", "workload", "sampling", "scheduler", "rl", "sft"):
    cls = next(t for t in typing.get_args(types[sec]) or (types[sec],) if t is not type(None))
    want |= {f"{sec}.{f.name}" for f in dataclasses.fields(cls)}
  for cls in (settings.BenchSettings, settings.TrainSettings):  # top-level fields
    want |= {f.name for f in dataclasses.fields(cls)}
  assert want - covered == set()


@pytest.mark.parametrize("entry, name, changes, expect", [
    ("rollout", "mixtral", {"rollout.max_prompt_len": 1000, "model.max_seq_len": 320},
     ["rollout.max_prompt_len=1000", "model.max_seq_len=320"]),
    ("sft", "grpo", {"sft.batch_size": 5000}, ["sft.batch_size=5000", "sft.num_prompts"]),
    ("sft", "grpo", {"rl.task_size": 40},
     ["rl.task_size=40", "rollout.max_prompt_len", "model.max_seq_len"]),
    ("train", "grpo", {"rollout.lengths": "workload"}, ["rollout.lengths", "'model'"]),
    ("rollout", "mixtral", {"rollout.kv": "paged", "rollout.kv_pages": 3, "model.max_seq_len": 64},
     ["rollout.kv_pages=3", "rollout.page_size=16", "model.max_seq_len=64"]),
    ("rollout", "mixtral", {"rollout.prefill_chunk": 8},
     ["rollout.prefill_chunk=8", "rollout.page_size=16"]),
    ("rollout", "mixtral", {"rollout.prefill_chunk": 64, "rollout.max_prefill_chunk": 32},
     ["rollout.prefill_chunk=64", "rollout.max_prefill_chunk=32"]),
    ("rollout", "mixtral", {"rollout.max_prefill_chunk": 32},
     ["rollout.max_prefill_chunk=32", "rollout.prefill_chunk"]),
    ("rollout", "mixtral", {"rollout.draft_tokens": 4, "rollout.prefill_chunk": 16},
     ["rollout.draft_tokens=4", "rollout.prefill_chunk=16"]),
    ("rollout", "mixtral", {"rollout.draft_tokens": 32, "rollout.max_new_tokens": 32},
     ["rollout.draft_tokens=32", "rollout.max_new_tokens=32"]),
])
def test_fields_checked_together(entry, name, changes, expect):
  c = load_config(name, "tiny").to_dict()
  for f, v in changes.items():
    _set(c, f, v)
  with pytest.raises(ConfigError) as e:
    load(c, entry)
  assert all(s in str(e.value) for s in expect), str(e.value)


def test_sft_accepts_an_automatic_cache_length():
  """model.max_seq_len = 0 (what the run needs) does not fail the evaluation prompts' check."""
  c = load_config("grpo", "tiny")
  c.model.max_seq_len = 0
  assert load(c, "sft").model.max_seq_len == 0


def test_a_lengths_file_is_accepted(tmp_path):
  p = tmp_path / "lengths.jsonl"
  p.write_text('{"id": "a", "sample": 0, "length": 3}\n')
  c = load_config("mixtral", "tiny")
  c.rollout.lengths = str(p)
  assert load(c).rollout.lengths == str(p)


def test_settings_import_no_jax():
  """Every entry point's settings load in a fresh interpreter without jax or flax."""
  code = ("import sys\n"
          "from flexfloor_jax.config.files import load_config\n"
          "from flexfloor_jax.config import settings\n"
          "for name, entry in (('mixtral', 'rollout'), ('bench', 'bench'), ('grpo', 'sft'),\n"
          "                    ('grpo', 'train')):\n"
          "  settings.load(load_config(name), entry)\n"
          "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
          "assert not bad, bad\n")
  env = dict(os.environ)
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0, r.stdout + r.stderr


def test_each_entry_names_its_own_bad_field():
  """grpo.py's defaults pass for every entry that reads it; a bad value fails for the entry that
  reads its section (sft's batch against its pool, the optimizer's b2 for training)."""
  c = load_config("grpo", "tiny")
  load(c), load(c, "train"), load(c, "sft")  # the defaults pass
  bad = load_config("grpo", "tiny")
  bad.sft.batch_size = 5000
  with pytest.raises(ConfigError, match=r"sft.batch_size=5000 exceeds .* sft.num_prompts"):
    load(bad, "sft")
  bad = load_config("grpo", "tiny")
  bad.rl.b2 = 1.0
  with pytest.raises(ConfigError, match=r"rl.b2"):
    load(bad, "train")
  bad = load_config("mixtral", "tiny")
  bad.rollout.max_new_tokens = 0
  with pytest.raises(ConfigError, match=r"rollout.max_new_tokens"):
    load(bad)
