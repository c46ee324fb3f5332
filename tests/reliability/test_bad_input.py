"""Bad input, one table: every entry point (rollout, bench, rl.sft, rl.train, sim, memory, launch)
run as a user runs it, with one bad value each. The promise for every case: exit status 2, one
`error:` line naming the field, flag or file (and the value where there is one), no traceback,
nothing written where the outputs would go, and nothing compiled (each case gets an empty
persistent compilation cache, which every compile would write into: jax caches every program
here, however fast).

Each case is a failure the project had: a traceback (a checkpoint's config value of the wrong
type, a tokenizer file that does not parse, an orbax directory without parameters, an integer
past the engine's int32/uint32 arrays, a path checked only once the work was done, flags of sim,
memory and launch, a reward function that is not a function) or a value accepted silently (a
boolean as a token id or prompt id, a memory figure no device has, a launcher with nothing to
start, a workload whose lengths all degenerate to one value).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import checkout
import hf_utils
import pytest
from checkout import ROOT

PY = sys.executable
ROLLOUT = [PY, "-m", "flexfloor_jax.rollout", "--config=configs/mixtral.py",
           "--config.rollout.output_dir={out}"]
BENCH = [PY, "-m", "flexfloor_jax.bench", "--config=configs/bench.py", "--config.output_dir={out}"]
SFT = [PY, "-m", "flexfloor_jax.rl.sft", "--config=configs/grpo.py",
       "--config.sft.output_dir={out}", "--config.model.checkpoint="]
TRAIN = [PY, "-m", "flexfloor_jax.rl.train", "--config=configs/grpo.py",
         "--config.output_dir={out}", "--config.model.checkpoint="]
SIM = [PY, "-m", "flexfloor_jax.sim", "--output_dir={out}", "--devices=8"]
MEMORY = [PY, "-m", "flexfloor_jax.memory", "--preset=tiny"]
LAUNCH = [PY, "-m", "flexfloor_jax.launch"]
# a command the launcher may start: it exits at once, so a launcher that wrongly starts it
# fails the case on its exit status, not on a hang
TRUE = "--", PY, "-c", "pass"


# ----------------------------------------------------------------------------- input files


def hf_dir(tmp, **config) -> str:
  """A tiny Hugging Face checkpoint (numpy-written) with config.json's fields updated."""
  return hf_utils.write_numpy_checkpoint(tmp / "hf", config=config)


def hf_null(tmp):
  return dict(ckpt=hf_dir(tmp, hidden_size=None))


def hf_string(tmp):
  return dict(ckpt=hf_dir(tmp, num_local_experts="2"))


def hf_float_string(tmp):
  return dict(ckpt=hf_dir(tmp, rope_theta="large"))


def hf_bad_tokenizer(tmp):
  path = hf_dir(tmp)
  with open(os.path.join(path, "tokenizer.json"), "w") as f:
    f.write('{"version": "1.0", "model": ')  # cut off
  return dict(ckpt=path)


def _orbax(tmp, params: bool = True, **changes) -> str:
  from flexfloor_jax.model.config import PRESETS
  path = tmp / "orbax"
  (path / "params").mkdir(parents=True)
  if params:  # a directory with orbax's files but no arrays in it
    (path / "params" / "_CHECKPOINT_METADATA").write_text("{}")
  cfg = dict(dataclasses.asdict(PRESETS["tiny"]), **changes)
  (path / "model_config.json").write_text(json.dumps(cfg))
  return str(path)


def orbax_no_params(tmp):
  return dict(ckpt=_orbax(tmp, params=False))


def orbax_empty_params(tmp):
  return dict(ckpt=_orbax(tmp))


def orbax_wrong_type(tmp):
  return dict(ckpt=_orbax(tmp, rope_theta="x"))


def orbax_null(tmp):
  return dict(ckpt=_orbax(tmp, rms_eps=None))


def prompts(*rows) -> Callable:
  def make(tmp):
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dict(prompts=str(path))
  return make


def a_file(tmp):
  path = tmp / "a_file"
  path.write_text("not a directory\n")
  return dict(file=str(path))


def reward_module(tmp):
  (tmp / "my_rewards.py").write_text("score = 3\n\n\ndef one_arg(text):\n  return 1.0\n")
  return dict(pythonpath=str(tmp))


def nothing(tmp):
  return {}


def store_of_another_tokenizer(tmp):
  from flexfloor_jax.policy.drafts import ResponseStore
  path = tmp / "store.npz"
  store = ResponseStore("hf:0123456789abcdef")
  store.add_rollout(0, [("builtin-0", 0, [1, 2, 3, 4])])
  store.save(str(path))
  return dict(store=str(path))


def store_not_parsing(tmp):
  path = tmp / "store.npz"
  path.write_bytes(b"not a response store\n")
  return dict(store=str(path))


@dataclasses.dataclass
class Case:
  name: str
  cmd: list[str]
  args: tuple[str, ...]
  needles: tuple[str, ...]
  setup: Callable = nothing


def case(name, cmd, args, needles, setup=nothing) -> Case:
  return Case(name, cmd, (args,) if isinstance(args, str) else tuple(args),
              (needles,) if isinstance(needles, str) else tuple(needles), setup)


CASES = [
    # --- a checkpoint's config of the wrong type or null: rollout
    case("hf_config_null", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("config.json", "hidden_size"), hf_null),
    case("hf_config_string_for_int", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("config.json", "num_local_experts"), hf_string),
    case("hf_config_string_for_float", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("config.json", "rope_theta"), hf_float_string),
    case("orbax_config_string_for_float", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("model_config.json", "rope_theta"), orbax_wrong_type),
    case("orbax_config_null", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("model_config.json", "rms_eps"), orbax_null),
    case("tokenizer_does_not_parse", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("model.checkpoint", "tokenizer.json"), hf_bad_tokenizer),
    # --- an orbax directory without parameters: rollout and trainer
    case("orbax_without_params_rollout", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("model.checkpoint", "params"), orbax_no_params),
    case("orbax_empty_params_rollout", ROLLOUT, "--config.model.checkpoint={ckpt}",
         ("model.checkpoint", "params"), orbax_empty_params),
    case("orbax_empty_params_train", TRAIN, "--config.model.checkpoint={ckpt}",
         ("model.checkpoint", "params"), orbax_empty_params),
    case("orbax_without_params_train", TRAIN, "--config.model.checkpoint={ckpt}",
         ("model.checkpoint", "params"), orbax_no_params),
    # --- prompt records: JSON types taken strictly
    case("prompt_id_boolean", ROLLOUT, "--config.rollout.prompts={prompts}",
         ("rollout.prompts", ":1", '"id"'), prompts({"id": True, "tokens": [5, 6]})),
    case("prompt_id_float", ROLLOUT, "--config.rollout.prompts={prompts}",
         ("rollout.prompts", ":1", '"id"'), prompts({"id": 1.5, "tokens": [5, 6]})),
    case("prompt_id_null", ROLLOUT, "--config.rollout.prompts={prompts}",
         ("rollout.prompts", ":1", '"id"'), prompts({"id": None, "tokens": [5, 6]})),
    case("token_id_boolean", ROLLOUT, "--config.rollout.prompts={prompts}",
         ("rollout.prompts", ":2", '"tokens"'),
         prompts({"id": "a", "tokens": [5]}, {"id": "b", "tokens": [5, True]})),
    case("token_id_past_int32", ROLLOUT, "--config.rollout.prompts={prompts}",
         ("rollout.prompts", ":1", "4294967296"), prompts({"id": "a", "tokens": [5, 2**32]})),
    case("prompt_text_not_a_string", ROLLOUT, "--config.rollout.prompts={prompts}",
         ("rollout.prompts", ":1", '"prompt"'), prompts({"id": "a", "prompt": ["Add", 2]})),
    case("prompt_record_not_an_object", ROLLOUT, "--config.rollout.prompts={prompts}",
         ("rollout.prompts", ":1"), prompts([1, 2, 3])),
    # --- integers past what the engine's arrays hold
    case("seed_past_uint32", ROLLOUT, "--config.sampling.seed=4294967296",
         ("sampling.seed", "4294967296")),
    case("epoch_past_uint32", ROLLOUT, "--config.rollout.epoch=4294967296",
         ("rollout.epoch", "4294967296")),
    case("init_seed_past_uint32", ROLLOUT, "--config.model.init_seed=18446744073709551616",
         ("model.init_seed",)),
    case("max_new_tokens_past_int32", ROLLOUT, "--config.rollout.max_new_tokens=2147483648",
         ("rollout.max_new_tokens", "2147483648")),
    case("max_seq_len_past_int32", ROLLOUT, "--config.model.max_seq_len=4294967296",
         ("model.max_seq_len", "4294967296")),
    case("cpu_devices_past_host", ROLLOUT, "--config.mesh.cpu_devices=100000",
         ("mesh.cpu_devices", "100000")),
    # --- a chunk of input tokens per step out of range (chunked prefill)
    case("prefill_chunk_below_a_page", ROLLOUT, "--config.rollout.prefill_chunk=8",
         ("rollout.prefill_chunk=8", "rollout.page_size=16")),
    case("draft_tokens_out_of_range", ROLLOUT, "--config.rollout.draft_tokens=65",
         ("rollout.draft_tokens", "65")),
    case("draft_store_of_another_tokenizer", ROLLOUT,
         ("--config.rollout.draft_tokens=4", "--config.rollout.draft_store={store}"),
         ("rollout.draft_store", "{store}", "tokenizer"), store_of_another_tokenizer),
    case("draft_store_not_parsing", ROLLOUT,
         ("--config.rollout.draft_tokens=4", "--config.rollout.draft_store={store}"),
         ("rollout.draft_store", "{store}"), store_not_parsing),
    case("prefill_chunk_above_its_bound", ROLLOUT,
         ("--config.rollout.prefill_chunk=64", "--config.rollout.max_prefill_chunk=32"),
         ("rollout.prefill_chunk=64", "rollout.max_prefill_chunk=32")),
    # --- memory figures that cannot be
    case("device_memory_no_device_has", ROLLOUT, "--config.mesh.device_memory_gb=1e12",
         ("mesh.device_memory_gb",)),
    case("emulated_devices_exhaust_host", ROLLOUT,
         ("--config.rollout.slots_per_worker=100000", "--config.mesh.device_memory_gb=16000"),
         ("emulated CPU devices", "bytes of host memory", "available")),
    # --- workload parameters that degenerate every length
    case("workload_median_below_one", ROLLOUT, "--config.workload.median=0.001",
         ("workload.median", "0.001")),
    case("workload_sigma_huge", BENCH, "--config.workload.sigma=1000",
         ("workload.sigma", "1000")),
    # --- paths checked up front
    case("history_path_under_a_file", ROLLOUT, "--config.scheduler.history_path={file}/h.json",
         ("scheduler.history_path",), a_file),
    case("prompts_is_a_directory", ROLLOUT, "--config.rollout.prompts={tmp}",
         ("rollout.prompts",)),
    case("sim_output_dir_is_a_file", SIM[:-2], ("--output_dir={file}", "--devices=8"),
         ("--output_dir",), a_file),
    # --- a reward function that is not one; sft and train fields
    case("reward_fn_not_callable", TRAIN, "--config.rl.reward_fn=my_rewards:score",
         ("rl.reward_fn", "my_rewards:score"), reward_module),
    case("reward_fn_wrong_arguments", TRAIN, "--config.rl.reward_fn=my_rewards:one_arg",
         ("rl.reward_fn", "my_rewards:one_arg"), reward_module),
    case("reward_fn_missing_name", SFT, "--config.rl.reward_fn=os:no_such_function",
         ("rl.reward_fn", "no_such_function")),
    case("sft_task_size_past_prompt", SFT, "--config.rl.task_size=100000000",
         ("rl.task_size", "100000000")),
    case("train_steps_zero", TRAIN, "--config.steps=0", ("steps",)),
    case("sft_seed_past_uint32", SFT, "--config.sft.seed=4294967296", ("sft.seed",)),
    # --- sim flags
    case("sim_devices_zero", SIM[:-1], "--devices=0", ("--devices", "0")),
    case("sim_devices_negative", SIM[:-1], "--devices=8,-8", ("--devices", "-8")),
    case("sim_ep_negative", SIM, "--ep=-1", ("--ep", "-1")),
    case("sim_slots_zero", SIM, "--slots_per_worker=0", ("--slots_per_worker", "0")),
    case("sim_length_scale_zero", SIM, "--length_scale=0", ("--length_scale", "0")),
    case("sim_length_scale_nan", SIM, "--length_scale=nan", ("--length_scale", "nan")),
    case("sim_prompt_len_zero", SIM, "--prompt_len=0", ("--prompt_len", "0")),
    case("sim_epochs_zero", SIM, "--epochs=0", ("--epochs", "0")),
    case("sim_steps_per_dispatch_negative", SIM, "--steps_per_dispatch=-1",
         ("--steps_per_dispatch", "-1")),
    case("sim_page_size_zero", SIM, ("--kv=paged", "--page_size=0"), ("--page_size", "0")),
    case("sim_max_num_seqs_negative", SIM, ("--kv=paged", "--max_num_seqs=-2"),
         ("--max_num_seqs", "-2")),
    case("sim_kv_margin_negative", SIM, ("--kv=paged", "--kv_margin=-1"), ("--kv_margin", "-1")),
    case("sim_makespan_slack_nan", SIM, "--makespan_slack=nan", ("--makespan_slack", "nan")),
    case("sim_release_sizes_bad", SIM, "--release_sizes=4,x", ("--release_sizes", "x")),
    case("sim_seed_negative", SIM, "--seed=-1", ("--seed", "-1")),
    # --- memory flags
    case("memory_nan", MEMORY, "--device_memory_gb=nan", ("--device_memory_gb", "nan")),
    case("memory_inf", MEMORY, "--device_memory_gb=inf", ("--device_memory_gb", "inf")),
    case("memory_no_device_has", MEMORY, "--device_memory_gb=1e15",
         ("--device_memory_gb", "1000000000000000")),
    case("memory_workers_not_a_number", MEMORY, "--workers=two", ("--workers", "two")),
    # --- launch flags
    case("launch_nothing_to_start", LAUNCH, ("--num_processes=2", "--"), ("command",)),
    case("launch_no_processes", LAUNCH, ("--num_processes=0", *TRUE), ("--num_processes", "0")),
    case("launch_timeout_nan", LAUNCH, ("--timeout=nan", *TRUE), ("--timeout", "nan")),
    case("launch_port_out_of_range", LAUNCH, ("--port=70000", *TRUE), ("--port", "70000")),
    case("launch_command_not_found", LAUNCH,
         ("--num_processes=1", "--", "no_such_program_xyz"), ("no_such_program_xyz",)),
]


def test_the_table_is_large_and_names_unique():
  assert len(CASES) >= 40
  assert len({c.name for c in CASES}) == len(CASES)
  entries = {c.cmd[2] for c in CASES}
  assert entries == {"flexfloor_jax.rollout", "flexfloor_jax.bench", "flexfloor_jax.rl.sft",
                     "flexfloor_jax.rl.train", "flexfloor_jax.sim", "flexfloor_jax.memory",
                     "flexfloor_jax.launch"}


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_before_any_compile(c: Case, tmp_path):
  subs = dict(tmp=str(tmp_path), out=str(tmp_path / "out"), **c.setup(tmp_path))
  cmd = [a.format(**subs) for a in (*c.cmd, *c.args)]
  cache = tmp_path / "jax_cache"
  env = checkout.child_env(FLEXFLOOR_JAX_CACHE=str(cache))
  if "pythonpath" in subs:
    env["PYTHONPATH"] = subs["pythonpath"]
  t0 = time.monotonic()
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  took = time.monotonic() - t0
  text = proc.stdout + proc.stderr
  errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
  assert proc.returncode == 2, (proc.returncode, text[-4000:])
  assert "Traceback" not in text, text[-4000:]
  assert len(errors) == 1 and errors[0].startswith("error: "), text[-4000:]
  for n in c.needles:
    assert n.format(**subs) in errors[0], (n, errors[0])
  assert not (tmp_path / "out").exists(), os.listdir(tmp_path / "out")
  assert not cache.exists() or not any(cache.iterdir()), f"compiled before failing ({took:.1f} s)"
