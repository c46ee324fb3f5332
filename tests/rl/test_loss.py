"""rl/loss.py on a hand-computed example: advantages, clipping, KL (k3), token mean, aux loss."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from flexfloor_jax.rl import loss


def test_group_advantages_by_hand():
  # group [1, 0]: mean 0.5, unbiased std sqrt(0.25 + 0.25) = 0.70710678 -> +-0.70710678.
  # group [3, 3]: std 0 -> advantages 0 (eps keeps it finite).
  adv = loss.group_advantages([1.0, 0.0, 3.0, 3.0], group_size=2)
  np.testing.assert_allclose(adv, [0.70710678, -0.70710678, 0.0, 0.0], atol=1e-6)
  # group of 1: std taken as 1 -> advantage 0.
  np.testing.assert_allclose(loss.group_advantages([5.0, 2.0], 1), [0.0, 0.0])


def test_clipped_pg_kl_token_mean_by_hand():
  eps, beta = 0.2, 0.1
  old = jnp.array([[-1.0, -1.0, -1.0, -1.0, -3.0]])
  ratio = jnp.array([[1.5, 0.5, 0.5, 1.5, 7.0]])
  logp = old + jnp.log(ratio)
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0, 100.0]])
  mask = jnp.array([[True, True, True, True, False]])  # the last token is not a response token
  ref = logp + math.log(2.0)
  # per token max(-A r, -A clip(r, 0.8, 1.2)):
  #  A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped)   A=+1 r=0.5: max(-0.5, -0.8) = -0.5
  #  A=-1 r=0.5: max(0.5, 0.8)   =  0.8 (clipped)   A=-1 r=1.5: max(1.5, 1.2)   =  1.5
  # token mean over 4 tokens: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15; clip fraction 2/4.
  # k3 KL with d = ref - logp = ln 2: e^d - d - 1 = 2 - 0.69314718 - 1 = 0.30685282.
  total, m = loss.grpo_token_mean(logp, old, ref, adv, mask, clip_eps=eps, kl_beta=beta)
  assert float(m["pg_loss"]) == pytest.approx(0.15, abs=1e-6)
  assert float(m["pg_clipfrac"]) == pytest.approx(0.5)
  assert float(m["kl"]) == pytest.approx(0.30685282, abs=1e-6)
  assert float(total) == pytest.approx(0.15 + 0.1 * 0.30685282, abs=1e-6)
  # num_tokens given (global count, as each device passes it): partial sums.
  _, m8 = loss.grpo_token_mean(logp, old, ref, adv, mask, clip_eps=eps, kl_beta=beta,
                               num_tokens=8.0)
  assert float(m8["pg_loss"]) == pytest.approx(0.6 / 8, abs=1e-6)


def test_kl_k3_zero_at_equal_and_clamped():
  x = jnp.array([-2.0, -0.1])
  np.testing.assert_allclose(loss.kl_k3(x, x), [0.0, 0.0], atol=0)
  assert float(loss.kl_k3(jnp.array(-50.0), jnp.array(0.0))) == 10.0


def test_load_balance_loss_by_hand():
  # 1 layer, E=2, k=1. Token 0 logits (0, 0) -> p (0.5, 0.5); token 1 (ln 3, 0) -> (0.75, 0.25);
  # token 2 is padding (ignored). Both valid tokens go to expert 0: f = (1, 0),
  # P = (0.625, 0.375); loss = E * sum f P = 2 * 0.625 = 1.25. Uniform routing gives 1.
  logits = jnp.array([[[0.0, 0.0], [math.log(3.0), 0.0], [9.0, -9.0]]])
  experts = jnp.array([[[0], [0], [1]]])
  valid = jnp.array([True, True, False])
  assert float(loss.load_balance_loss(logits, experts, valid, 2)) == pytest.approx(1.25, abs=1e-6)
  uni = loss.load_balance_loss(jnp.zeros((1, 2, 2)), jnp.array([[[0], [1]]]),
                               jnp.array([True, True]), 2)
  assert float(uni) == pytest.approx(1.0, abs=1e-6)
