"""Released-device reuse: while the tail of a rollout is still generating, the workers it has
released compute the old log-probs of responses that are already finished, so less of that work
is left for the full mesh after the rollout.

Each released device runs the training forward alone (a one-worker ep mesh holding every expert:
the tiny preset fits; a model that needs several devices to hold its experts would group released
devices up to its floor, not done here). Its program has the full-mesh program's per-device shapes
(`ActorSpec.logprob_rows` rows of `t_max` tokens) and the MoE path is batch- and mesh-size
invariant (fixed expert GEMM tiles, combine in k order), so its log-probs equal the full mesh's
bitwise (tests/rl/test_reuse.py); the trainer's result does not depend on who computed what.

The programs are compiled for every device ahead of time, in a background thread; a release
whose device is not ready yet is skipped (scored on the full mesh later), so nothing compiles or
blocks inside the rollout. Everything here only dispatches: JAX runs it asynchronously on the
released devices while the survivors keep decoding.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.rl import actor as actor_lib
from flexfloor_jax.runtime import mesh as mesh_lib


def sequence_row(prompt, response, t_max: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [t_max], valid [t_max]) of prompt + response, right-padded: the row layout the
  trainer's batch and the released workers share."""
  seq = list(prompt) + list(response)
  toks = np.zeros((t_max,), np.int32)
  toks[:len(seq)] = seq
  return toks, np.arange(t_max) < len(seq)


class ReleasedScorer:
  """Scores finished responses on released devices during a rollout (runner.run's on_release)."""

  def __init__(self, spec: actor_lib.ActorSpec, devices, params_abs, t_max: int):
    self.spec1 = dataclasses.replace(spec, num_workers=1)
    self.rows, self.t_max = spec.logprob_rows, t_max
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._shardings = {}
    self._exe = {d: self._pool.submit(self._compile, d, params_abs) for d in devices
                 if d.process_index == jax.process_index()}
    self.reset(None, {})

  def _mesh_shardings(self, d, params_abs):
    mesh = Mesh(np.array([d]), (mesh_lib.mesh_axis("expert"),))
    psh = mesh_lib.tree_shardings(mesh, tfm.param_specs(params_abs))
    return mesh, psh, mesh_lib.named(mesh, mesh_lib.batch_spec(2))

  def _compile(self, d, params_abs):
    mesh, psh, bsh = self._mesh_shardings(d, params_abs)
    self._shardings[d] = (psh, bsh)
    prog = actor_lib.Actor(self.spec1, mesh, None).logprob_program(params_abs, replay=False)
    p_abs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         params_abs, psh)

    def row(dt):
      return jax.ShapeDtypeStruct((self.rows, self.t_max), dt, sharding=bsh)

    return prog.lower(p_abs, row(np.int32), row(np.bool_)).compile()

  def wait_compiled(self):
    for f in self._exe.values():
      f.result()

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)

  def reset(self, params, prompt_tokens: dict):
    """A new rollout with these (full-mesh) params; forget the last one's results."""
    self.params, self.prompt_tokens = params, prompt_tokens
    self._jobs = []  # (keys, device array [rows, t_max - 1])
    self._taken: set = set()

  def on_release(self, devices, finished: dict):
    ready = [d for d in devices if d in self._exe and self._exe[d].done()]
    todo = [k for k in finished if k not in self._taken]
    if not ready or not todo or self.params is None:
      return
    per = -(-len(todo) // len(ready))
    for i, d in enumerate(ready):
      keys = todo[i * per:(i + 1) * per]
      if not keys:
        break
      exe, (psh, bsh) = self._exe[d].result(), self._shardings[d]
      params = jax.device_put(self.params, psh)  # the whole model onto the released device
      for j in range(0, len(keys), self.rows):
        chunk = keys[j:j + self.rows]
        rows = [sequence_row(self.prompt_tokens[k[0]], finished[k], self.t_max) for k in chunk]
        toks = actor_lib.pad_rows(np.stack([r[0] for r in rows]), self.rows)
        valid = actor_lib.pad_rows(np.stack([r[1] for r in rows]), self.rows)
        out = exe(params, jax.device_put(toks, bsh), jax.device_put(valid, bsh))
        self._jobs.append((chunk, out))
      self._taken.update(keys)

  def results(self) -> dict:
    """{(prompt_id, sample): log-probs [t_max - 1]} of every response scored so far (waits for
    the released devices)."""
    out = {}
    for keys, arr in self._jobs:
      host = np.asarray(arr)
      for i, k in enumerate(keys):
        out[k] = host[i]
    return out
