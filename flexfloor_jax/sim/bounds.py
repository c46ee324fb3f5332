"""Lower bounds, in a step cost model's seconds, that no schedule of a set of responses can beat.

Not a heuristic given the true lengths (that is an "oracle policy" run): a proof-style minimum
over every placement, admission and release, from three facts of the step cost model
(policy.costs.StepCost; the roofline's satisfies them): a step is no faster with more rows or
more cached tokens on a worker; a row reads at least its own cached tokens; and a step of n
workers holding r rows between them is no faster than the same step with the rows spread evenly
(the slowest worker gates an SPMD step).

makespan: the longest response makes one token per step, after its own prefill step. Its t-th
  decode step reads at least prompt + t cached tokens and costs at least the cheapest one-row
  step over every group size (`step_floor`); summed over its steps as a lower Riemann sum of that
  non-decreasing function.
occupied device-seconds: every response's first token comes from its prefill, a step in which a
  worker admits at most one prompt (at least the cheapest prefill step of n workers each admitting
  a prompt of the shortest length, per prompt); every other token is made in a decode step, and a
  step of n workers and r rows costs n x t(n, r) device-seconds for r tokens, at least
  `token_floor` per token (the cheapest over every n and r up to n x max_seqs rows, each reading
  the fewest cached tokens any response reads); and at least `min_workers` devices (the fewest
  that hold the model) are held until the makespan bound.
Chunked prefill (`prefill_chunk` C > 0: a prompt's tokens ride inside decode steps, at most C a
step per worker; policy.controller's module doc) changes the prompt terms, on one more fact of
the step cost model: a mixed step (StepCost.mixed_seconds) is no faster with more input tokens,
more rows or more cached tokens. makespan: the longest response's prompt runs in at least
ceil(P/C) steps, the last of which makes its first token; in every one of them but the last its
worker still has input waiting after the step, so the step runs C input tokens there (a step
takes min(C, pending)); each such step is no faster than the cheapest step running C input
tokens on one worker and nothing else (`chunk_floor`), and the last runs what is left of the
prompt, at least P - (ceil(P/C) - 1) C tokens (more steps would only add full ones). A step
that runs input beside rows stalls none, so no one-shot prefill step is on the path and this
term replaces the prefill term.
occupied: a mixed step of n workers holding r rows costs no less than the decode step of those
rows, which `token_floor` already charges to its r tokens; the prompts' own work is not
separable from it without more premises, so the prompt term is dropped (the bound stays a
bound, a weaker one).
"""

from __future__ import annotations

import numpy as np

from flexfloor_jax.policy.costs import StepCost


def step_floor(cost: StepCost, max_workers: int, ctx: float) -> float:
  """The cheapest decode step holding one row that reads `ctx` cached tokens, over every group
  size from 1 to max_workers."""
  best = np.inf
  for n in range(1, max_workers + 1):
    rows, kv = np.zeros(n), np.zeros(n)
    rows[0], kv[0] = 1.0, float(ctx)
    best = min(best, cost.worker_step_seconds(rows, kv))
  return float(best)


def token_floor(cost: StepCost, max_workers: int, max_seqs: int, ctx: float) -> float:
  """The fewest device-seconds a generated token can cost: n x t(n, r) / r over every group size
  n and every total of r <= n x max_seqs rows (spread evenly: a relaxation, never above an
  integer spread), each row reading `ctx` cached tokens."""
  best = np.inf
  for n in range(1, max_workers + 1):
    for r in range(1, n * max_seqs + 1):
      per = np.full(n, r / n)
      best = min(best, n * cost.worker_step_seconds(per, per * ctx) / r)
  return float(best)


def chunk_floor(cost: StepCost, max_workers: int, tokens: int = 1) -> float:
  """The cheapest step that runs `tokens` input tokens on one worker and nothing else (no rows,
  no prefix), over every group size from 1 to max_workers: chunked prefill's steps that run
  that many of a prompt's tokens are no faster."""
  best = np.inf
  for n in range(1, max_workers + 1):
    z = np.zeros(n)
    best = min(best, cost.mixed_seconds(z, z, np.eye(1, n)[0] * float(tokens), z))
  return float(best)


def lower_bound(lengths, prompt_lens, cost: StepCost, *, max_workers: int, max_seqs: int,
                min_workers: int, chunks: int = 64, prefill_chunk: int = 0) -> dict:
  """Lower bounds on the makespan (s) and the occupied device-seconds of generating responses of
  `lengths` tokens (after prompts of `prompt_lens` tokens) on groups of at most `max_workers`
  workers with at most `max_seqs` rows each, at least `min_workers` devices holding the model.
  prefill_chunk: the most input tokens a step runs per worker under chunked prefill (the module
  doc); 0 = one-shot prefill steps."""
  L = np.asarray(lengths, np.int64)
  P = np.asarray(prompt_lens, np.int64)
  if not len(L):
    return dict(makespan_s=0.0, occupied_device_seconds=0.0)
  i = int(np.argmax(L))
  longest, prompt = int(L[i]), int(P[i])
  if prefill_chunk > 0:  # its prompt in >= ceil(P / C) steps: all but the last run C tokens
    C = int(prefill_chunk)
    full = -(-max(prompt, 1) // C) - 1
    prefill = full * chunk_floor(cost, max_workers, C) \
        + chunk_floor(cost, max_workers, max(prompt, 1) - full * C)
  else:
    prefill = min(cost.prefill_seconds(np.eye(1, n)[0] * prompt)
                  for n in range(1, max_workers + 1))
  # decode steps 1..longest-1 read >= prompt + t cached tokens: a lower Riemann sum in chunks
  span = 0.0
  edges = np.unique(np.linspace(1, longest, min(chunks, longest) + 1).astype(np.int64))
  for a, b in zip(edges[:-1], edges[1:], strict=True):
    span += (b - a) * step_floor(cost, max_workers, prompt + a)
  makespan = float(prefill + span)
  per_token = token_floor(cost, max_workers, max_seqs, float(P.min()) + 1.0)
  # each response's first token comes from its prefill, which costs at least a prefill step of
  # n workers admitting one prompt each, per prompt (n x its seconds / n prompts)
  per_prompt = 0.0 if prefill_chunk > 0 else min(cost.prefill_seconds(np.full(n, float(P.min())))
                                                 for n in range(1, max_workers + 1))
  work = float((L - 1).sum()) * per_token + len(L) * per_prompt
  occupied = max(work, min_workers * makespan)
  return dict(makespan_s=makespan, occupied_device_seconds=occupied,
              token_floor_s=per_token, prefill_floor_s=per_prompt, longest=longest)
