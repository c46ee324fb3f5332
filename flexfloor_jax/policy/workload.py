"""Synthetic long-tailed response lengths, and JSONL files of lengths.

length[p, s] at epoch e =
    clip(round(median * exp(sigma*z_p + epoch_noise*u_pe + sample_noise*v_pse)), min_len, cap)
z_p depends on `seed` alone, so a prompt's mean is the same in every epoch (what makes
history-based prediction meaningful); u, v are fresh per epoch. The cap is max_new_tokens: the
tail piles up there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from flexfloor_jax.io.atomic import atomic_open
from flexfloor_jax.io.jsonl import iter_jsonl, read_json
from flexfloor_jax.policy.controller import Seq

# Defaults: the rollout shape of configs/mixtral.py tiny (8 workers x 4 slots, 8 prompts x 8
# samples, max_new_tokens 256 = cap). cap = 4 x median, so only the far tail is capped. The noise
# levels are small enough that a prompt's history predicts its samples and large enough that the
# samples of one group differ as in GRPO. DEFAULT_SIGMA is the sigma
# `sim.calibrate.calibrate_sigma()` picks for these defaults (static baseline on the step
# simulator, epochs 0-7, seed 0), so that the synthetic static rollout wastes the share of device
# time the paper reports for verl (IDLE_TARGET); tests/sim/test_calibrate.py checks that it still
# does.
DEFAULT_NUM_PROMPTS = 8
DEFAULT_SAMPLES_PER_PROMPT = 8
DEFAULT_MEDIAN = 64
DEFAULT_CAP = 256
DEFAULT_EPOCH_NOISE = 0.1
DEFAULT_SAMPLE_NOISE = 0.25
DEFAULT_SIGMA = 0.36
DEFAULT_WORKERS = 8
DEFAULT_SLOTS_PER_WORKER = 4
DEFAULT_STEPS_PER_DISPATCH = 8
IDLE_TARGET = 0.33  # verl's idle-after-finish fraction in the paper


@dataclass(frozen=True)
class WorkloadSpec:
  num_prompts: int = DEFAULT_NUM_PROMPTS
  samples_per_prompt: int = DEFAULT_SAMPLES_PER_PROMPT
  seed: int = 0
  sigma: float = DEFAULT_SIGMA  # lognormal sigma of per-prompt mean lengths
  epoch_noise: float = DEFAULT_EPOCH_NOISE  # sigma of a prompt's per-epoch multiplicative noise
  sample_noise: float = DEFAULT_SAMPLE_NOISE  # sigma of per-sample multiplicative noise
  median: float = DEFAULT_MEDIAN
  cap: int = DEFAULT_CAP  # = max_new_tokens
  min_len: int = 1


# Named cluster workloads of the simulator and the bench (`--workload`). long_reasoning: RL for
# reasoning, where responses run to thousands of tokens and KV memory, not rows, limits how many
# sequences run at once: per group of 8 devices 16 prompts x 16 samples, per-prompt lognormal
# lengths around a median of 3,000 tokens (sigma 0.6), per-sample noise sigma 0.3, cap 16,384,
# prompts of 512 tokens, the history of 2 earlier epochs. Fixed, not tuned.
# grpo_trace: the response lengths of one of the project's own GRPO runs (real EOS), replayed
# (`Trace`, sim/traces/).
WORKLOADS = ('default', 'long_reasoning', 'grpo_trace')
@dataclass(frozen=True)
class LongReasoning:
  prompts_per_8_devices: int = 16
  samples_per_prompt: int = 16
  median: float = 3000.0
  sigma: float = 0.6
  sample_noise: float = 0.3
  cap: int = 16384
  prompt_len: int = 512
  epochs: int = 3  # the rollout at epoch 2, with the history of epochs 0 and 1


LONG_REASONING = LongReasoning()


def long_reasoning_spec(devices: int, seed: int) -> WorkloadSpec:
  """The long_reasoning workload (`LONG_REASONING`) on `devices` devices."""
  r = LONG_REASONING
  return WorkloadSpec(num_prompts=max(1, r.prompts_per_8_devices * devices // 8),
                      samples_per_prompt=r.samples_per_prompt, seed=seed, sigma=r.sigma,
                      sample_noise=r.sample_noise, median=r.median, cap=r.cap)


def parse_seeds(text: str) -> list[int]:
  """A comma list of workload seeds (ints >= 0) -> the list; ValueError names the bad entry."""
  out = []
  for part in str(text).split(','):
    part = part.strip()
    try:
      seed = int(part)
    except ValueError:
      raise ValueError(f'{part!r} is not an int (seeds are a comma list, e.g. 0,1,2,3,4)') from None
    if seed < 0:
      raise ValueError(f'seeds must be >= 0, got {seed}')
    out.append(seed)
  if len(set(out)) != len(out):
    raise ValueError(f'seeds repeat: {text!r}')
  return out


def prompt_ids(spec: WorkloadSpec) -> list[str]:
  return [f'p{i:04d}' for i in range(spec.num_prompts)]


def prompt_z(spec: WorkloadSpec) -> np.ndarray:
  """Per-prompt standard-normal scores: the P stratified quantiles of N(0, 1), shuffled by seed.
  Stratified rather than drawn, so that a small batch (8 prompts) spans the distribution that
  sigma describes instead of whatever spread one seed happens to draw."""
  nd = NormalDist()
  q = np.array([nd.inv_cdf((i + 0.5) / spec.num_prompts) for i in range(spec.num_prompts)])
  return np.random.default_rng([spec.seed, 0]).permutation(q)


def lengths(spec: WorkloadSpec, epoch: int) -> np.ndarray:
  """int array [num_prompts, samples_per_prompt], deterministic in (spec, epoch)."""
  if epoch < 0:
    raise ValueError(f'epoch must be >= 0, got {epoch}')
  z = prompt_z(spec)
  rng = np.random.default_rng([spec.seed, 1, epoch])
  u = rng.standard_normal((spec.num_prompts, 1))
  v = rng.standard_normal((spec.num_prompts, spec.samples_per_prompt))
  x = spec.median * np.exp(spec.sigma * z[:, None] + spec.epoch_noise * u + spec.sample_noise * v)
  return np.clip(np.rint(x), spec.min_len, spec.cap).astype(np.int64)


def make_seqs(spec: WorkloadSpec, epoch: int | None = None, prompt_len: int = 16,
              with_targets: bool = True) -> list[Seq]:
  """The batch in verl order (each prompt's samples adjacent); targets from `lengths` if asked."""
  L = None
  if with_targets:
    if epoch is None:
      raise TypeError('make_seqs: with_targets needs an epoch')
    L = lengths(spec, epoch)
  out = []
  for p, pid in enumerate(prompt_ids(spec)):
    for s in range(spec.samples_per_prompt):
      out.append(Seq(seq_id=p * spec.samples_per_prompt + s, prompt_id=pid, sample=s,
                     prompt_len=prompt_len, target_len=int(L[p, s]) if L is not None else None,
                     max_new_tokens=spec.cap))
  return out


def target_lengths(seqs: list[Seq]) -> dict[int, int]:
  """seq id -> target length, of sequences made with targets (`make_seqs`' default)."""
  return {s.seq_id: s.target_len for s in seqs if s.target_len is not None}


# ---------------------------------------------------------------------------------------------
# JSONL: one {"id": prompt id, "sample": int, "length": int} per line

def write_lengths_jsonl(path: str, rows) -> None:
  """rows: iterable of (prompt_id, sample, length); atomic write."""
  with atomic_open(path) as f:
    for pid, s, n in rows:
      f.write(json.dumps({'id': str(pid), 'sample': int(s), 'length': int(n)}) + '\n')


def lengths_rows(spec: WorkloadSpec, epoch: int):
  L = lengths(spec, epoch)
  return [(pid, s, int(L[p, s])) for p, pid in enumerate(prompt_ids(spec))
          for s in range(spec.samples_per_prompt)]


def read_lengths_jsonl(path: str) -> dict[tuple[str, int], int]:
  """{(prompt id, sample): length}; errors name the file and line."""
  out = {}
  for i, r in iter_jsonl(path):
    if not {'id', 'sample', 'length'} <= set(r):
      raise ValueError(f'{path}:{i}: need keys "id", "sample", "length", got {json.dumps(r)[:80]}')
    s, n = r['sample'], r['length']
    if (not isinstance(s, int) or not isinstance(n, int) or isinstance(s, bool)
        or isinstance(n, bool) or s < 0 or n < 1):
      raise ValueError(f'{path}:{i}: "sample" must be an int >= 0 and "length" an int >= 1, '
                       f'got sample={s!r} length={n!r}')
    key = (str(r['id']), s)
    if key in out:
      raise ValueError(f'{path}:{i}: duplicate (id, sample) {key}')
    out[key] = n
  return out


# ---------------------------------------------------------------------------------------------
# Recorded traces: {"source": how it was made, "max_new_tokens": cap,
#   "prompts": {prompt id: {"prompt_len": tokens, "epochs": [[sample lengths of epoch 0], ...]}}}


@dataclass(frozen=True)
class Trace:
  """Response lengths a real run recorded: per prompt its prompt length and, for every epoch, the
  lengths of its samples (each prompt the same number of epochs and samples)."""
  source: str
  max_new_tokens: int
  prompt_len: dict[str, int]
  epochs: dict[str, list[list[int]]]

  @property
  def num_epochs(self) -> int:
    return len(next(iter(self.epochs.values())))

  @property
  def samples_per_prompt(self) -> int:
    return len(next(iter(self.epochs.values()))[0])


def load_trace(path: str) -> Trace:
  """A trace file (the format above); ValueError names the file and the bad entry."""
  doc = read_json(path, 'a trace')
  cap = doc.get('max_new_tokens') if isinstance(doc, dict) else None
  prompts = doc.get('prompts') if isinstance(doc, dict) else None
  if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1 or not isinstance(prompts, dict) \
      or not prompts:
    raise ValueError(f'{path}: a trace needs "max_new_tokens" (an int >= 1) and a non-empty '
                     f'"prompts" table')
  plen, epochs, shape = {}, {}, None
  for pid, rec in prompts.items():
    ep = rec.get('epochs') if isinstance(rec, dict) else None
    pl = rec.get('prompt_len') if isinstance(rec, dict) else None
    ok = (isinstance(pl, int) and not isinstance(pl, bool) and pl >= 1 and isinstance(ep, list)
          and ep and all(isinstance(v, list) and v for v in ep)
          and all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= cap
                  for v in ep for n in v))
    if not ok or not isinstance(ep, list):
      raise ValueError(f'{path}: prompt {pid!r}: needs "prompt_len" (an int >= 1) and "epochs", '
                       f'lists of sample lengths (ints in 1..{cap})')
    if shape is None:
      shape = (len(ep), len(ep[0]))
    if (len(ep), {len(v) for v in ep}) != (shape[0], {shape[1]}):
      raise ValueError(f'{path}: prompt {pid!r}: {len(ep)} epochs of {sorted({len(v) for v in ep})}'
                       f' samples; the first prompt has {shape[0]} of {shape[1]}')
    plen[str(pid)], epochs[str(pid)] = pl, [list(v) for v in ep]
  return Trace(source=str(doc.get('source', '')), max_new_tokens=cap, prompt_len=plen,
               epochs=epochs)


def trace_rollout(trace: Trace, copies: int, seed: int) -> tuple[list[Seq], dict[int, list[Seq]]]:
  """The batch a trace replays: `copies` copies of its prompts (prompt ids '<id>/<copy>', one copy
  per group of 8 devices, as the other workloads scale), at epoch num_epochs - 1 - seed (seed 0:
  the trace's last epoch) with targets from the trace; and the batches of every epoch before it
  (the history a run would have). Seeds past the second-to-last epoch have no history: refused."""
  epoch = trace.num_epochs - 1 - int(seed)
  if not 1 <= epoch:
    raise ValueError(f'seed {seed}: the trace has {trace.num_epochs} epochs, so seeds 0..'
                     f'{trace.num_epochs - 2} (each replays an epoch with the ones before it as '
                     f'history)')

  def batch(e: int) -> list[Seq]:
    out = []
    for c in range(copies):
      for pid in trace.epochs:
        for s, n in enumerate(trace.epochs[pid][e]):
          out.append(Seq(seq_id=len(out), prompt_id=f'{pid}/{c}', sample=s,
                         prompt_len=trace.prompt_len[pid], target_len=int(n),
                         max_new_tokens=trace.max_new_tokens))
    return out

  return batch(epoch), {e: batch(e) for e in range(epoch)}
