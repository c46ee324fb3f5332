"""Per-sequence keyed sampling: the token drawn never depends on the worker, slot or company.

A sequence's key is fold_in(seed, epoch, stable hash of the prompt id, sample index); the key of
its n-th generated token is fold_in(that key, n). Everything is per row, so a row's token is a
function of its own logits and key only.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  # 0 = greedy. The compiled steps read it from their host inputs, not as a constant: it is left
  # out of equality and hash, so engine specs that differ only in it share their executables.
  temperature: float = dataclasses.field(default=1.0, compare=False)
  top_p: float = 1.0
  top_k: int = 0  # 0 = off

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")


def prompt_hash(prompt_id: str) -> int:
  """Stable 31-bit hash of a prompt id (Python's hash() is salted per process)."""
  return zlib.crc32(str(prompt_id).encode("utf-8")) & 0x7FFFFFFF


def sequence_key(seed: jax.Array, epoch: jax.Array, phash: jax.Array, sample: jax.Array):
  """Key data (uint32[2]) of one sequence; all arguments int32 scalars (works under vmap)."""
  key = jax.random.fold_in(jax.random.key(seed), epoch)
  key = jax.random.fold_in(jax.random.fold_in(key, phash), sample)
  return jax.random.key_data(key)


def _truncate(logits_V: jax.Array, sp: SamplingParams) -> jax.Array:
  if sp.top_k and sp.top_k < logits_V.shape[-1]:
    kth = jax.lax.top_k(logits_V, sp.top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  if sp.top_p < 1.0:
    order = jnp.argsort(-logits_V)
    sorted_logits = logits_V[order]
    probs = jax.nn.softmax(sorted_logits)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    keep_sorted = (jnp.cumsum(probs) - probs) < sp.top_p
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    logits_V = jnp.where(keep, logits_V, -jnp.inf)
  return logits_V


def sample_one(logits_V: jax.Array, key_data: jax.Array, n: jax.Array, sp: SamplingParams,
               temperature: jax.Array | float):
  """(token, logprob) for one row: the n-th token of the sequence whose key data is given.
  `temperature` (a traced scalar in the engine's steps; <= 0 = greedy) replaces
  sp.temperature. logprob = log_softmax(logits / T)[token] before top-p / top-k (what a trainer
  recomputes; T = 1 when greedy)."""
  logits_V = logits_V.astype(jnp.float32)
  greedy = jnp.asarray(temperature) <= 0
  # x / 1.0 is exact: greedy and T = 1 give the log-probs of an unscaled log_softmax
  scaled = logits_V / jnp.where(greedy, jnp.float32(1.0), jnp.asarray(temperature, jnp.float32))
  key = jax.random.fold_in(jax.random.wrap_key_data(key_data), n)
  drawn = jax.random.categorical(key, _truncate(scaled, sp)).astype(jnp.int32)
  token = jnp.where(greedy, jnp.argmax(logits_V).astype(jnp.int32), drawn)
  return token, jax.nn.log_softmax(scaled)[token]


def sample(logits_BV, key_data_B2, n_B, sp: SamplingParams, temperature: jax.Array | float):
  return jax.vmap(lambda lg, k, n: sample_one(lg, k, n, sp, temperature))(logits_BV, key_data_B2,
                                                                          n_B)
