"""KV-cache decode equals the full-sequence forward on the project's own tiny preset (<= 1e-5 fp32).

The random-init model the default rollout runs (configs/mixtral.py:tiny, init_scale 0.1): prompts of
different lengths are prefilled, then decoded teacher-forced to the end; every position's logits are
compared with one full-sequence forward. The HF-checkpoint cases (larger logits) are in
test_hf_parity.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flexfloor_jax.model import transformer as tr
from flexfloor_jax.model.config import PRESETS

# fp32, same math in two summation orders. For scale: against a float64 evaluation of this model
# each fp32 path is itself about 1e-5 off, and decode vs forward comes close to TOL on some
# draws. A cache bug (position, padding, mask) is > 1e-3.
TOL = 1e-5


def test_tiny_preset_cache_decode_equals_full_forward():
  cfg = PRESETS["tiny"]
  params = tr.init_params(cfg, jax.random.key(11), scale=0.1)
  forward = jax.jit(lambda p, t: tr.forward(p, cfg, t, valid_BT=jnp.ones(t.shape, bool))[0])
  prefill = jax.jit(lambda p, t, n: tr.prefill(p, cfg, t, n)[:3])
  decode = jax.jit(lambda p, c, t, pos: tr.decode(p, cfg, c, t, pos, jnp.ones(t.shape, bool))[:2],
                   donate_argnums=1)
  rng = np.random.default_rng(2026)  # fixed draw: the margin to TOL is small (see above)
  lengths = np.array([20, 3, 11, 17, 1, 8])
  b, pad_t, total_t = len(lengths), 20, 36
  rows = np.arange(b)
  seq = rng.integers(3, cfg.vocab_size, (b, total_t))
  full = np.asarray(forward(params, jnp.asarray(seq)))
  # Not flat: tokens are told apart, so a cache bug (position, padding) would show (>1e-3).
  assert full.std(axis=-1).mean() > 0.2, full.std(axis=-1).mean()
  prompt = np.where(np.arange(pad_t)[None] < lengths[:, None], seq[:, :pad_t], 0)
  logits, k, v = prefill(params, jnp.asarray(prompt), jnp.asarray(lengths))
  diffs = [np.abs(np.asarray(logits) - full[rows, lengths - 1]).max()]
  cache = jax.jit(tr.insert)(tr.KVCache.zeros(cfg, b, total_t), k, v, jnp.arange(b))
  for i in range(total_t - lengths.max()):
    pos = lengths + i
    logits, cache = decode(params, cache, jnp.asarray(seq[rows, pos], jnp.int32), jnp.asarray(pos))
    diffs.append(np.abs(np.asarray(logits) - full[rows, pos]).max())
  print(f"tiny preset: cache decode vs full forward max|diff| = {max(diffs):.3g} "
        f"over {len(diffs)} steps, |logit| up to {np.abs(full).max():.2f}")
  assert max(diffs) <= TOL
