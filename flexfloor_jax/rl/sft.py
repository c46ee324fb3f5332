"""SFT warm start: `python -m flexfloor_jax.rl.sft --config=configs/grpo.py`.

Teacher forcing on the built-in tasks (prompt -> answer + EOS, loss on the answer tokens only),
optax AdamW, one device (the dense reference MoE: same math as the ep path, simplest to
differentiate). Saves an orbax checkpoint (model.checkpoint.save_orbax) at
<sft.output_dir>/checkpoint, then samples one rollout of the RL prompt set with it (runner.run,
the config's sampling) and reports the mean reward to <sft.output_dir>/sft_metrics.json.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flexfloor_jax.config import cli, settings
from flexfloor_jax.config.cli import fail
from flexfloor_jax.io import output_dir
from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.model import checkpoint as ckpt
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.model.tokenizer import ByteTokenizer
from flexfloor_jax.rl import cli as rl_cli
from flexfloor_jax.rl import tasks as tasks_lib
from flexfloor_jax.rollout import runner
from flexfloor_jax.runtime.backend import enable_compilation_cache


def make_examples(st, tokenizer):
  """(tokens [N, T], loss mask [N, T-1]) of the SFT pool; T = longest example rounded to 8.
  `st`: settings.Settings with the rl and sft sections."""
  s = st.sft
  rows = tasks_lib.make_prompts(st.rl.tasks, s.num_prompts, s.seed + 1000, st.rl.task_size)
  seqs = []
  for r in rows:
    p = tokenizer.encode(r["prompt"], add_bos=True)
    a = tokenizer.encode(r["answer"]) + [tokenizer.eos_id]
    seqs.append((p, a))
  t = -(-max(len(p) + len(a) for p, a in seqs) // 8) * 8
  toks = np.full((len(seqs), t), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(seqs), t - 1), bool)
  for i, (p, a) in enumerate(seqs):
    toks[i, :len(p) + len(a)] = p + a
    mask[i, len(p) - 1:len(p) + len(a) - 1] = True
  return toks, mask


class SFTError(ValueError):
  """Bad input or a diverged run; the message names the field or the step."""


def sft(config, *, progress: bool = False, step_cache=None) -> dict:
  """`config`: a ConfigDict (settings.load checks it before anything is built: ConfigError) or
  its settings.Settings (entry 'sft'). `step_cache`: an engine.StepCachePool for the evaluation
  rollout's compiled steps (train.train takes one too: GRPO from this checkpoint in the same
  process reuses them)."""
  st = config if isinstance(config, settings.Settings) else settings.load(config, "sft")
  assert st.sft is not None  # load(config, "sft") reads the sft section
  # Locked like every output directory (io/output_dir.py): two runs would interleave the
  # checkpoint's files, and a Ctrl-C's line names what it kept.
  try:
    lock = output_dir.acquire(st.sft.output_dir, "sft.output_dir")
  except output_dir.OutputDirError as e:
    raise SFTError(str(e)) from None
  with lock:
    return _sft(st, progress=progress, step_cache=step_cache)


def _sft(st, *, progress: bool, step_cache) -> dict:
  s = st.sft
  cfg = PRESETS[st.preset].replace(dtype=st.model.dtype)
  tok = ByteTokenizer()
  toks, mask = make_examples(st, tok)
  params = tfm.init_params(cfg, jax.random.key(st.model.init_seed), scale=st.model.init_scale)
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, s.lr, max(1, s.steps // 20),
                                                       max(2, s.steps)),
                    weight_decay=s.weight_decay)
  opt_state = opt.init(params)

  def loss_fn(p, t, m):
    logits, _ = tfm.forward(p, cfg, t, valid_BT=t != tok.pad_id)
    lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(lp, t[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(m, nll, 0.0)) / jnp.maximum(jnp.sum(m), 1)

  @jax.jit
  def step(p, o, t, m):
    loss, g = jax.value_and_grad(loss_fn)(p, t, m)
    u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  rng = np.random.default_rng(s.seed)
  losses = []
  t0 = time.perf_counter()
  for i in range(s.steps):
    idx = rng.choice(len(toks), s.batch_size, replace=False)
    params, opt_state, loss = step(params, opt_state, jnp.asarray(toks[idx]),
                                   jnp.asarray(mask[idx]))
    losses.append(float(loss))
    if not np.isfinite(losses[-1]):  # diverged: the weights are garbage, never save them
      raise SFTError(f"sft step {i}: the loss is {losses[-1]}; no checkpoint written (lower "
                     f"sft.lr={s.lr})")
    if progress and (i % 25 == 0 or i == s.steps - 1):
      print(f"sft step {i}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
  train_s = time.perf_counter() - t0
  path = os.path.join(s.output_dir, "checkpoint")
  ckpt.save_orbax(path, params, cfg)

  # Reward of the saved model on the RL prompt set (one rollout, the config's sampling).
  c = st.replace(rollout=dict(prompts=os.path.join(s.output_dir, "eval_prompts.jsonl"),
                              output_dir=s.output_dir))
  reward_fn, _, by_id = tasks_lib.prompt_set(st.rl, c.rollout.prompts)
  res = runner.run(c, params=params, model_cfg=cfg, tokenizer=tok, write_outputs=False,
                   progress=False, step_cache=step_cache)
  rewards = tasks_lib.score_responses(reward_fn, by_id, res.responses)
  out = {"steps": s.steps, "final_loss": float(np.mean(losses[-10:])), "first_loss": losses[0],
         "train_seconds": train_s, "checkpoint": path,
         "eval/score/mean": float(np.mean(rewards)),
         "eval/exact_match": float(np.mean([r == 1.0 for r in rewards])),
         "eval/response_length/mean": float(np.mean([r["num_tokens"] for r in res.responses]))}
  atomic_write(os.path.join(s.output_dir, "sft_metrics.json"), json.dumps(out, indent=2))
  return out


def main(argv):
  del argv
  config = rl_cli.config_value()
  try:
    st = settings.load(config, "sft")  # before jax starts
    enable_compilation_cache()
    out = sft(st, progress=True)
  except (settings.ConfigError, SFTError) as e:
    fail(str(e))
  print(f"sft: loss {out['first_loss']:.3f} -> {out['final_loss']:.3f} in "
        f"{out['train_seconds']:.0f}s; reward {out['eval/score/mean']:.3f} (exact "
        f"{out['eval/exact_match']:.3f}); checkpoint {out['checkpoint']}")


if __name__ == "__main__":
  cli.run(main)
