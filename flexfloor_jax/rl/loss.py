"""GRPO loss pieces: group-normalised advantages (numpy, host), clipped policy-gradient objective,
KL to a frozen reference (k3 estimator = verl's `low_var_kl`), token-mean reduction and the
Switch-style MoE load-balance loss (jnp, traced inside the training step).

Conventions (as verl): advantages A_i = (r_i - mean_g) / (std_g + eps) with the unbiased
(ddof=1) std of the group (a group of one gets std 1); ratio = exp(logp - old_logp);
pg = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)); KL k3: with d = ref_logp - logp,
kl = exp(d) - d - 1, clamped to [-10, 10] like verl's low_var_kl.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards, group_size: int, eps: float = 1e-6) -> np.ndarray:
  """rewards [num_prompts * group_size], each prompt's samples adjacent -> advantages (float32)."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  mean = r.mean(axis=1, keepdims=True)
  std = r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.ones_like(mean)
  return ((r - mean) / (std + eps)).reshape(-1).astype(np.float32)


def masked_token_sum(x, mask):
  return jnp.sum(jnp.where(mask, x, 0.0))


def policy_gradient_terms(logp, old_logp, adv, mask, clip_eps: float):
  """Per-token clipped PG loss and a clipped indicator (both [..]); the caller reduces
  them with the token mean."""
  ratio = jnp.exp(logp - old_logp)
  pg1 = -adv * ratio
  pg2 = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  pg = jnp.maximum(pg1, pg2)
  clipped = (pg2 > pg1) & mask
  return pg, clipped


def kl_k3(logp, ref_logp):
  """verl `low_var_kl` (Schulman's k3): exp(ref - logp) - (ref - logp) - 1, clamped [-10, 10]."""
  d = jnp.clip(ref_logp - logp, -20.0, 20.0)
  return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def grpo_token_mean(logp, old_logp, ref_logp, adv, mask, *, clip_eps: float, kl_beta: float,
                    num_tokens=None):
  """(loss, metrics) with the token mean over `mask` (divided by `num_tokens` when given, so that
  per-device partial sums add up to the global token mean)."""
  n = jnp.maximum(jnp.sum(mask), 1) if num_tokens is None else num_tokens
  pg, clipped = policy_gradient_terms(logp, old_logp, adv, mask, clip_eps)
  pg_loss = masked_token_sum(pg, mask) / n
  kl = masked_token_sum(kl_k3(logp, ref_logp), mask) / n
  loss = pg_loss + kl_beta * kl
  return loss, {"pg_loss": pg_loss, "kl": kl,
                "pg_clipfrac": jnp.sum(clipped) / n}


def load_balance_loss(router_logits_LTE, experts_LTK, valid_T, num_experts: int):
  """Switch Transformer aux loss E * sum_e f_e * p_e per layer, averaged over layers.
  f_e = share of the top-k assignments (valid tokens) that go to expert e (not differentiable);
  p_e = mean router softmax probability of e over valid tokens. Uniform routing gives 1.0."""
  v = valid_T.astype(jnp.float32)
  nv = jnp.maximum(jnp.sum(v), 1.0)
  probs = jax.nn.softmax(router_logits_LTE.astype(jnp.float32), axis=-1)
  p_LE = jnp.sum(probs * v[None, :, None], axis=1) / nv
  onehot = jax.nn.one_hot(experts_LTK, num_experts, dtype=jnp.float32)  # [L, T, K, E]
  f_LE = jnp.sum(onehot * v[None, :, None, None], axis=(1, 2)) / (nv * experts_LTK.shape[-1])
  f_LE = jax.lax.stop_gradient(f_LE)
  return jnp.mean(num_experts * jnp.sum(f_LE * p_LE, axis=-1))
