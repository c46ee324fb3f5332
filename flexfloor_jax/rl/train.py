"""GRPO on the elastic rollout: `python -m flexfloor_jax.rl.train --config=configs/grpo.py`.

Each step: rollout (the library API's RolloutEngine, kept across the steps: update_params with
the current params, then generate; schedule from the config, group size =
rollout.samples_per_prompt, lengths='model', the length history passed in and updated) -> rewards
-> group-normalised advantages -> log-probs recomputed by the training forward on all devices ->
clipped PG + optional KL (k3) + MoE aux loss -> grad clip + AdamW -> weight sync (params
replicated for the next rollout, timed as timing_s/update_weights).

Checkpoints: rl/checkpoints.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import time

import jax
import numpy as np
import optax

from flexfloor_jax import api
from flexfloor_jax import engine as engine_lib
from flexfloor_jax.config import cli, settings
from flexfloor_jax.config.cli import fail
from flexfloor_jax.io import output_dir
from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.model import checkpoint as ckpt
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS, model_identity, resolve_moe_backend
from flexfloor_jax.model.tokenizer import load_tokenizer
from flexfloor_jax.policy.accounting import jsonable
from flexfloor_jax.policy.history import HistoryError, LengthHistory
from flexfloor_jax.rl import actor as actor_lib
from flexfloor_jax.rl import checkpoints as ckpts
from flexfloor_jax.rl import cli as rl_cli
from flexfloor_jax.rl import tasks as tasks_lib
from flexfloor_jax.rl.checkpoints import TrainError
from flexfloor_jax.rl.loss import group_advantages
from flexfloor_jax.rl.reuse import ReleasedScorer, sequence_row
from flexfloor_jax.rollout import inputs
from flexfloor_jax.runtime import mesh as mesh_lib
from flexfloor_jax.runtime.backend import enable_compilation_cache

log = logging.getLogger(__name__)

# Metrics that must be bitwise equal between an interrupted-and-resumed run and a straight one.
DETERMINISTIC_KEYS = ("critic/score/mean", "critic/score/max", "critic/score/min",
                      "response_length/mean", "response_length/max", "response_length/clip_ratio",
                      "actor/pg_loss", "actor/kl", "actor/grad_norm", "actor/aux_loss",
                      "actor/pg_clipfrac", "actor/loss", "rollout/tokens_sha1")


# ----------------------------------------------------------------------------- metrics


def _read_metrics(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line from a kill: dropped
          break
  return rows


def _append_metrics(path: str, row: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(jsonable(row, nonfinite_to_none=True), allow_nan=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def plot_metrics(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  if not rows:
    return
  x = [r["step"] for r in rows]
  fig, ax = plt.subplots(1, 3, figsize=(13, 3.4))
  ax[0].plot(x, [r["critic/score/mean"] for r in rows], "o-")
  ax[0].set_title("critic/score/mean")
  ax[1].plot(x, [r["tokens_per_device_step"] for r in rows], "o-", label="tokens/device-step")
  ax[1].plot(x, [r["idle_after_finish_fraction"] for r in rows], "s-", label="idle after finish")
  ax[1].set_title("rollout efficiency")
  ax[1].legend()
  ax[2].plot(x, [r["response_length/mean"] for r in rows], "o-")
  ax[2].set_title("response_length/mean")
  for a in ax:
    a.set_xlabel("step")
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=90)
  plt.close(fig)
  atomic_write(path, buf.getvalue())


# ----------------------------------------------------------------------------- batch


def build_batch(responses, prompt_tokens: dict, rewards, group_size: int, t_max: int,
                num_workers: int):
  """Right-padded [B', T] arrays (B' = B rounded up to the workers; padding rows are masked);
  with recorded routes also route [B', T, L, K] (positions never fed keep expert ids 0..K-1:
  their outputs reach no log-prob)."""
  b = len(responses)
  bp = -(-b // num_workers) * num_workers
  toks = np.zeros((bp, t_max), np.int32)
  valid = np.zeros((bp, t_max), bool)
  mask = np.zeros((bp, t_max - 1), bool)
  roll = np.zeros((bp, t_max - 1), np.float32)
  for i, r in enumerate(responses):
    p = prompt_tokens[r["prompt_id"]]
    toks[i], valid[i] = sequence_row(p, r["tokens"], t_max)
    n = len(r["tokens"])
    mask[i, len(p) - 1:len(p) - 1 + n] = True
    roll[i, len(p) - 1:len(p) - 1 + n] = r["logprobs"]
  adv = np.zeros((bp,), np.float32)
  adv[:b] = group_advantages(rewards, group_size)
  out = {"tokens": toks, "valid": valid, "mask": mask, "adv": adv}
  if responses and "routes" in responses[0]:
    _, nl, k = np.shape(responses[0]["routes"])
    route = np.broadcast_to(np.arange(k, dtype=np.int32), (bp, t_max, nl, k)).copy()
    for i, r in enumerate(responses):
      route[i, :len(r["routes"])] = r["routes"]
    out["route"] = route
  return out, roll


# ----------------------------------------------------------------------------- the loop


def _check_finite(name: str, values, resp, step: int) -> None:
  """values[i]: response i's numbers (a scalar or an array). A NaN or infinite reward or
  log-prob would train on garbage (and the loss would turn NaN a step later, far from its
  cause): stop at the first one, naming the response."""
  bad = np.flatnonzero([not np.all(np.isfinite(np.asarray(v, float))) for v in values])
  if bad.size:
    r = resp[bad[0]]
    raise TrainError(f"step {step}: {name} of prompt {r['prompt_id']!r} sample {r['sample']} is "
                     f"not finite ({bad.size} response(s) in all); nothing of this step was "
                     "trained on or saved")


def train(config, *, stop_after: int | None = None, progress: bool = False,
          step_cache=None) -> list[dict]:
  """Run (or resume) GRPO as the config says; returns the metrics rows of this output_dir.
  `stop_after`: return after that step (tests: an in-process interruption).
  `step_cache`: the engine.StepCachePool that keeps the rollouts' compiled steps; pass one to
  several runs in a process (a sweep, a resumed run) and runs of the same engine spec reuse them
  instead of tracing and loading them again; by default one for this run.
  output_dir is checked and locked before anything is compiled: a second run on it fails at
  once naming the holder's pid (two runs would interleave checkpoints and history).
  settings.load(config, "train") checks every field first, before anything is built (a bad
  field fails in well under a second with ConfigError)."""
  st = settings.load(config, "train")
  assert st.train is not None  # load(config, "train") reads the train section
  # the checkpoint's inventory and tokenizer (no tensor read), as the rollout CLI checks them
  inputs.tokenizer_for(st, inputs.model_config(st))
  try:
    output_dir.check_dir(st.train.output_dir, "output_dir")
  except output_dir.OutputDirError as e:
    raise TrainError(str(e)) from None
  lock = None
  if jax.process_index() == 0:  # the process that writes history and metrics
    try:
      lock = output_dir.acquire(st.train.output_dir, "output_dir")
    except output_dir.OutputDirError as e:
      raise TrainError(str(e)) from None
  try:
    return _train(config, st, stop_after=stop_after, progress=progress, step_cache=step_cache)
  finally:
    if lock is not None:
      lock.release()


def task_prompts(st: settings.Settings):
  """The run's prompt set (rl section), written to <train.output_dir>/prompts.jsonl for the
  rollouts, and its reward: (reward_fn, prompt rows, rows by id, path of the prompts file)."""
  assert st.train is not None  # settings of the 'train' entry
  os.makedirs(st.train.output_dir, exist_ok=True)
  path = os.path.join(st.train.output_dir, "prompts.jsonl")
  return (*tasks_lib.prompt_set(st.rl, path), path)


def _train(config, st: settings.Settings, *, stop_after: int | None, progress: bool,
           step_cache) -> list[dict]:
  """The loop; `config` itself only for the checkpoints (rl/checkpoints.py)."""
  train_st, rl = st.train, st.rl
  assert train_st is not None and rl is not None  # load(config, "train") reads both sections
  out = train_st.output_dir
  reward_fn, rows, by_id, prompts_path = task_prompts(st)

  # -- model
  if st.model.checkpoint:
    try:
      loaded = ckpt.load_checkpoint(st.model.checkpoint)
    except ckpt.CheckpointError as e:
      raise TrainError(f"model.checkpoint: {e}") from None
    assert loaded is not None  # None only for an empty path
    model_cfg, params = loaded
  else:
    model_cfg = PRESETS[st.preset]
    params = tfm.init_params(model_cfg, jax.random.key(st.model.init_seed),
                             scale=st.model.init_scale)
  model_cfg = model_cfg.replace(dtype=st.model.dtype)
  model_id = model_identity(model_cfg)
  params = jax.tree.map(lambda x: x.astype(model_cfg.dtype), params)
  tokenizer = load_tokenizer(st.model.checkpoint, model_cfg)
  if tokenizer is None:
    raise TrainError("model.checkpoint: the model has no tokenizer (no tokenizer.json, and not "
                     "the byte vocabulary); the RL prompts are text")
  prompt_tokens = {r["id"]: tokenizer.encode(r["prompt"], add_bos=True) for r in rows}

  devices = mesh_lib.select_devices(st.mesh.num_devices)
  mesh = mesh_lib.make_ep_mesh(devices)
  n = len(devices)
  moe_impl, moe_interpret = resolve_moe_backend(st.model.moe_backend, devices[0].platform)
  spec = actor_lib.ActorSpec(cfg=model_cfg, num_workers=n,
                             temperature=st.sampling.temperature, tile_m=rl.tile_m,
                             clip_eps=rl.clip_eps, kl_beta=rl.kl_beta, aux_coef=rl.aux_coef,
                             moe_backend=moe_impl, interpret=moe_interpret)
  optimizer = optax.chain(optax.clip_by_global_norm(rl.grad_clip),
                          optax.adamw(rl.lr, b1=rl.b1, b2=rl.b2, weight_decay=rl.weight_decay))
  act = actor_lib.Actor(spec, mesh, optimizer)
  params = actor_lib.shard_params(params, mesh)
  ref_params = params if rl.kl_beta > 0 else None
  # Moments follow the params' shardings; scalars (step counts) replicated on the mesh (so a
  # restored state has the same shardings, and the update step compiles once).
  rep = mesh_lib.replicated(mesh)
  psh = jax.tree.map(lambda x: x.sharding, params)
  opt_state = optax.tree_map_params(optimizer, lambda x, sh: jax.device_put(x, sh),
                                    optimizer.init(params), psh,
                                    transform_non_params=lambda x: jax.device_put(x, rep))

  # -- resume
  history_path = st.scheduler.history_path or os.path.join(out, "history.json")
  metrics_path = os.path.join(out, "metrics.jsonl")
  max_new = st.rollout.max_new_tokens
  start = 0

  def abs_of(t):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)

  resumed = ckpts.resume_state(config, abs_of(params), abs_of(opt_state), model_id, max_new)
  if resumed is not None:
    start, params, opt_state, history = resumed  # the checkpoint's history wins
    history.save(history_path, merge=False)
    kept = [r for r in _read_metrics(metrics_path) if r["step"] <= start]
    atomic_write(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
  else:
    try:
      history = LengthHistory.load(history_path, max_new_tokens=max_new, model=model_id)
    except HistoryError as e:
      raise TrainError(f"scheduler.history_path: {e}") from None
    if os.path.exists(metrics_path):
      os.unlink(metrics_path)

  t_max = st.rollout.max_prompt_len + st.rollout.max_new_tokens
  g = st.rollout.samples_per_prompt
  # compiled steps kept across the steps' rollouts
  pool = step_cache if step_cache is not None else engine_lib.StepCachePool()
  rollout_params = actor_lib.replicate(params, mesh)
  # The library API's engine, kept across the steps with the run's history (saved here, with
  # the checkpoints); the task ids stay the prompts' identities (history, sampling keys).
  rollout = api.RolloutEngine(
      st.replace(rollout=dict(output_dir=out, record_routes=rl.routing_replay),
                 scheduler=dict(history_path="")),
      rollout_params, tokenizer, devices=devices, model_cfg=model_cfg, history=history,
      step_cache=pool)
  task_ids = [r["id"] for r in rows]
  # Released workers score finished responses during the rollout (flexfloor; one process).
  scorer = None
  if (rl.released_logprobs and not rl.routing_replay and st.schedule == "flexfloor"
      and jax.process_count() == 1):
    scorer = ReleasedScorer(spec, devices, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), t_max)
    if st.rollout.wait_compiles:  # reproducible timing (tests, benchmarks)
      scorer.wait_compiled()
  for step in range(start + 1, train_st.steps + 1):
    t_step = time.perf_counter()
    t0 = time.perf_counter()
    if scorer is not None:
      scorer.reset(params, prompt_tokens)
    rollout.update_params(rollout_params)
    res = rollout.generate([prompt_tokens[i] for i in task_ids], prompt_ids=task_ids,
                           step=step - 1, on_release=scorer and scorer.on_release,
                           progress=progress)
    t_gen = time.perf_counter() - t0
    history.save(history_path)
    resp = res.responses
    rewards = tasks_lib.score_responses(reward_fn, by_id, resp)
    _check_finite("the reward", rewards, resp, step)
    _check_finite("a rollout log-prob", [r["logprobs"] for r in resp], resp, step)
    lens = np.array([r["num_tokens"] for r in resp], float)
    batch, roll_lp = build_batch(resp, prompt_tokens, rewards, g, t_max, n)

    t0 = time.perf_counter()
    # Old log-probs: those the released workers computed, the rest on the full mesh (equal
    # bitwise either way: fixed per-device shapes, rl/reuse.py).
    done = scorer.results() if scorer is not None else {}
    old_lp = np.zeros_like(roll_lp)
    on_released = [i for i, r in enumerate(resp) if (r["prompt_id"], r["sample"]) in done]
    for i in on_released:
      old_lp[i] = done[(resp[i]["prompt_id"], resp[i]["sample"])]
    rest = np.setdiff1d(np.arange(len(old_lp)), on_released)
    if len(rest):
      old_lp[rest] = act.logprobs(params, batch["tokens"][rest], batch["valid"][rest],
                                  batch["route"][rest] if "route" in batch else None)
    ref_lp = (act.logprobs(ref_params, batch["tokens"], batch["valid"], batch.get("route"))
              if ref_params is not None else old_lp)
    t_lp = time.perf_counter() - t0
    _check_finite("an old log-prob (training forward)",
                  np.where(batch["mask"], old_lp, 0.0)[:len(resp)], resp, step)
    if ref_params is not None:
      _check_finite("a reference log-prob", np.where(batch["mask"], ref_lp, 0.0)[:len(resp)],
                    resp, step)
    diff = np.abs(old_lp - roll_lp)[batch["mask"]]
    batch["old_logp"], batch["ref_logp"] = old_lp, ref_lp
    num_tokens = float(batch["mask"].sum())

    t0 = time.perf_counter()
    for _ in range(rl.updates_per_step):
      params, opt_state, m = act.update(params, opt_state, batch, num_tokens)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    bad = sorted(k for k in ("loss", "pg_loss", "kl", "grad_norm", "aux_loss")
                 if not math.isfinite(m[k]))
    if bad:  # the weights are garbage now: never checkpoint or roll out with them
      raise TrainError(f"step {step}: the update gave a non-finite {', '.join(bad)} "
                       f"({', '.join(f'{k}={m[k]}' for k in bad)}); nothing of this step was "
                       "saved (lower rl.lr or rl.grad_clip and resume)")
    t_upd = time.perf_counter() - t0
    t0 = time.perf_counter()
    rollout_params = jax.block_until_ready(actor_lib.replicate(params, mesh))
    t_sync = time.perf_counter() - t0

    s = res.summary
    row = {"step": step, "schedule": st.schedule,
           "critic/score/mean": float(rewards.mean()), "critic/score/max": float(rewards.max()),
           "critic/score/min": float(rewards.min()),
           "critic/exact_match": float(np.mean(rewards == 1.0)),
           "rollout/tokens_sha1": hashlib.sha1(json.dumps(
               [[r["prompt_id"], r["sample"], list(map(int, r["tokens"]))] for r in resp]
           ).encode()).hexdigest(),
           "response_length/mean": float(lens.mean()), "response_length/max": float(lens.max()),
           "response_length/clip_ratio": float(np.mean(
               [r["finish_reason"] != "eos" for r in resp])),
           "actor/pg_loss": m["pg_loss"], "actor/kl": m["kl"], "actor/grad_norm": m["grad_norm"],
           "actor/aux_loss": m["aux_loss"], "actor/pg_clipfrac": m["pg_clipfrac"],
           "actor/loss": m["loss"], "actor/lr": float(rl.lr),
           "rollout/logprob_max_abs_diff": float(diff.max()) if diff.size else 0.0,
           "rollout/logprobs_on_released": len(on_released) / len(resp),
           "timing_s/gen": t_gen, "timing_s/logprob": t_lp, "timing_s/update": t_upd,
           "timing_s/update_weights": t_sync,
           "tokens_per_device_step": s.get("tokens_per_device_step"),
           "idle_after_finish_fraction": s.get("idle_after_finish_fraction"),
           "device_steps": s.get("device_steps"), "generated_tokens": s.get("generated_tokens"),
           "slot_utilization": s.get("slot_utilization"),
           "occupied_device_seconds": s.get("occupied_device_seconds")}
    row["timing_s/step"] = time.perf_counter() - t_step
    # The row before the checkpoint: a kill between the two leaves a row that resume drops (its
    # step is after the newest checkpoint) and recomputes, never a checkpoint without its row.
    _append_metrics(metrics_path, row)
    if step % train_st.checkpoint_every == 0 or step == train_st.steps:
      ckpts.save_checkpoint(config, step, params, opt_state, history)
      if jax.process_index() == 0:
        ckpts.prune_checkpoints(config, step)
    if progress:
      print(f"step {step}: score {row['critic/score/mean']:.3f} len "
            f"{row['response_length/mean']:.1f} pg {row['actor/pg_loss']:.4f} gnorm "
            f"{row['actor/grad_norm']:.3f} tok/dev-step {row['tokens_per_device_step']:.3f} "
            f"({row['timing_s/step']:.1f}s)", flush=True)
    if stop_after is not None and step >= stop_after:
      break
  if scorer is not None:
    scorer.close()
  rows_out = _read_metrics(metrics_path)
  plot_metrics(rows_out, os.path.join(out, "metrics.png"))
  return rows_out


# ----------------------------------------------------------------------------- CLI


def main(argv):
  del argv
  config = rl_cli.config_value()
  try:
    settings.load(config, "train")  # before jax starts
    enable_compilation_cache()
    rows = train(config, progress=True)
  except (TrainError, ValueError) as e:  # settings.ConfigError among them
    fail(str(e))
  if rows:
    print(f"{len(rows)} steps; last critic/score/mean {rows[-1]['critic/score/mean']:.3f}; "
          f"metrics in {config.output_dir}/metrics.jsonl")


if __name__ == "__main__":
  cli.run(main)
