"""The trainer's checkpoints: save, find, verify, prune and resume.

Checkpoints: <output_dir>/checkpoints/step_<k>/ holds state/ (orbax: params, opt_state) and
meta.json (step, sampling seed, length history, the size of every file under state/), written
last: a checkpoint without meta.json is incomplete. A restart resumes from the newest checkpoint
that is complete and verified (meta.json readable, every state file present at its recorded size,
orbax restores it, every value finite); newer damaged or incomplete ones are skipped with a
warning naming them, and entries that are not step_<k> directories are ignored. Its length
history wins over <output_dir>/history.json, and metrics.jsonl rows after it are dropped. After
each save only the newest `keep_checkpoints` complete checkpoints are kept (0 = all).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from flexfloor_jax.io.atomic import atomic_write
from flexfloor_jax.model.checkpoint import finite_flags
from flexfloor_jax.policy.history import HistoryError, LengthHistory

log = logging.getLogger(__name__)


class TrainError(ValueError):
  """Training cannot start or go on (bad config, no usable checkpoint); the message says why."""


def _ckpt_root(config) -> str:
  return os.path.join(config.output_dir, "checkpoints")


_STEP_DIR = re.compile(r"step_(\d+)")
META = "meta.json"


def checkpoint_dirs(config) -> list[tuple[int, str]]:
  """(step, path) of every step_<k> directory, newest first. Anything else in checkpoints/ (a
  user's step_6.bak copy, a stray file) is not a checkpoint and is ignored."""
  root = _ckpt_root(config)
  if not os.path.isdir(root):
    return []
  out = []
  for name in os.listdir(root):
    m = _STEP_DIR.fullmatch(name)
    if m and os.path.isdir(os.path.join(root, name)):
      out.append((int(m.group(1)), os.path.join(root, name)))
  return sorted(out, reverse=True)


def latest_checkpoint(config) -> tuple[int, str] | None:
  """The newest complete checkpoint (meta.json written), not verified (see train's resume)."""
  for k, path in checkpoint_dirs(config):
    if os.path.isfile(os.path.join(path, META)):
      return k, path
  return None


def _state_files(state_dir: str) -> dict[str, int]:
  """Relative path -> size of every file orbax wrote."""
  out = {}
  for d, _, names in os.walk(state_dir):
    for n in names:
      f = os.path.join(d, n)
      out[os.path.relpath(f, state_dir)] = os.path.getsize(f)
  return out


def save_checkpoint(config, step: int, params, opt_state, history) -> str:
  path = os.path.abspath(os.path.join(_ckpt_root(config), f"step_{step}"))
  if os.path.exists(path):
    shutil.rmtree(path)
  os.makedirs(path)
  ck = ocp.StandardCheckpointer()
  ck.save(os.path.join(path, "state"), {"params": params, "opt_state": opt_state})
  ck.wait_until_finished()
  ck.close()
  meta = {"step": step, "sampling_seed": int(config.sampling.seed),
          "history": {p: {str(e): v for e, v in d.items()} for p, d in history.data.items()},
          "model": history.model,
          # Sizes let a restart tell a truncated or deleted data file before orbax reads it.
          "files": _state_files(os.path.join(path, "state"))}
  atomic_write(os.path.join(path, META), json.dumps(meta), durable=True)
  return path


class DamagedCheckpoint(Exception):
  """A checkpoint that cannot be resumed from; the message says why, in one line."""


def read_meta(path: str, step: int) -> dict:
  """meta.json of step_<step>, and its recorded state files present at their sizes."""
  f = os.path.join(path, META)
  try:
    with open(f) as fh:
      meta = json.load(fh)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise DamagedCheckpoint(f"{f} is unreadable ({e})") from None
  if not isinstance(meta, dict) or meta.get("step") != step or not isinstance(
      meta.get("history"), dict):
    raise DamagedCheckpoint(f"{f} does not describe step {step} (fields step, history)")
  for rel, size in (meta.get("files") or {}).items():
    g = os.path.join(path, "state", rel)
    if not os.path.isfile(g):
      raise DamagedCheckpoint(f"{g} is missing")
    if os.path.getsize(g) != size:
      raise DamagedCheckpoint(f"{g} has {os.path.getsize(g)} bytes, {size} were written")
  return meta


def _first_line(e: BaseException, limit: int = 240) -> str:
  """tensorstore errors run to kilobytes; the first line says what failed."""
  text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
  return text if len(text) <= limit else text[:limit] + "..."


def nonfinite_leaf(tree) -> str | None:
  """The path of the first array in `tree` holding a NaN or an infinity, else None."""
  leaves = [(kp, x) for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  for (kp, _), ok in zip(leaves, finite_flags(x for _, x in leaves), strict=True):
    if not ok:
      return jax.tree_util.keystr(kp)
  return None


def load_checkpoint(path: str, params_abs, opt_abs, step: int | None = None):
  """(params, opt_state, meta) of a verified checkpoint; DamagedCheckpoint otherwise."""
  if step is None:
    step = int(os.path.basename(os.path.normpath(path))[len("step_"):])
  meta = read_meta(path, step)
  ck = ocp.StandardCheckpointer()
  try:
    state = ck.restore(os.path.join(os.path.abspath(path), "state"),
                       {"params": params_abs, "opt_state": opt_abs})
  except Exception as e:  # tensorstore / orbax: any failure to read the state is damage here
    raise DamagedCheckpoint(f"{path}/state cannot be restored: {_first_line(e)}") from None
  finally:
    ck.close()
  bad = nonfinite_leaf(state)
  if bad is not None:
    raise DamagedCheckpoint(f"{path}/state: tensor {bad} holds NaN or infinite values")
  return state["params"], state["opt_state"], meta


def prune_checkpoints(config, newest: int) -> list[str]:
  """After saving step `newest`: keep the newest `keep_checkpoints` complete checkpoints up to it
  and remove older ones (and older incomplete ones: interrupted saves). Newer leftovers (damaged
  ones skipped on resume) stay until this run overwrites them. Returns the removed paths."""
  keep = int(config.keep_checkpoints)
  if keep <= 0:
    return []
  dirs = [(k, p) for k, p in checkpoint_dirs(config) if k <= newest]
  complete = [k for k, p in dirs if os.path.isfile(os.path.join(p, META))]
  if newest not in complete:
    return []
  kept = set(complete[:keep])
  removed = []
  for k, p in dirs:
    if k not in kept and k < newest:
      shutil.rmtree(p, ignore_errors=True)
      removed.append(p)
  return removed


def resume_state(config, params_abs, opt_abs, model_id: str, max_new_tokens: int):
  """(step, params, opt_state, history) of the newest verified checkpoint, skipping damaged and
  incomplete ones with a warning each; None when there is no checkpoint at all. TrainError when
  checkpoints exist but none can be used (starting over would discard them: the user decides)."""
  tried = []
  for k, path in checkpoint_dirs(config):
    if not os.path.isfile(os.path.join(path, META)):
      log.warning("checkpoint %s is incomplete (no %s: its save was interrupted); skipped",
                  path, META)
      continue
    try:
      params, opt_state, meta = load_checkpoint(path, params_abs, opt_abs, k)
      history = LengthHistory.from_table(
          meta["history"], os.path.join(path, META), max_new_tokens=max_new_tokens,
          model=model_id)
    except (DamagedCheckpoint, HistoryError) as e:
      log.warning("checkpoint %s is damaged, skipped: %s", path, e)
      tried.append(f"{path} ({e})")
      continue
    if tried:
      log.warning("resuming from %s, the newest usable checkpoint", path)
    return k, params, opt_state, history
  if tried:
    raise TrainError(f"no usable checkpoint in {_ckpt_root(config)}: " + "; ".join(tried) +
                     ". Move them away to start over")
  return None
