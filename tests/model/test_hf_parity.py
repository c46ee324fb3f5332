"""Acceptance: our loader + transformer.py compute what transformers' MixtralForCausalLM computes.

Tiny random fp32 checkpoints written by `save_pretrained` (both expert layouts), eager attention on
the torch side. Cases (tests/hf_utils.py CASES): "gqa" (explicit head_dim 24 != 64/4, 8 experts,
hub layout, one file) and "swa" (sliding window 4 on prompts of 5-16 tokens plus 32 generated,
fused layout, sharded).
"""

from __future__ import annotations

import os

import hf_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexfloor_jax.model import hf_checkpoint as hf
from flexfloor_jax.model import transformer as tr

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# The reference is transformers': compared as a user's run compiles (test_user_flags.py).
pytestmark = pytest.mark.user_flags

LOGIT_TOL = 1e-4  # fp32, ours vs torch
# fp32, our decode vs our full forward: two fp32 summation orders of the same math, each about 1e-5
# off a float64 evaluation of the gqa case (|logit| up to 6), so they differ by up to ~1.5e-5 and
# 1e-5 would sit inside that noise. A real cache bug (position, window, padding) is >1e-3.
CACHE_TOL = 2e-5
MARGIN = 10 * LOGIT_TOL  # a greedy token is only meaningful when top-1 beats top-2 by this
MAX_CLOSE_FRACTION = 0.01
NEW_TOKENS = 32
# Different prompt lengths (right padding on both sides). Max 16; the window (4) is far shorter.
LENGTHS = np.array([16, 12, 14, 5, 9, 13, 7, 15])
PAD_T = 16


class Case:
  """One saved checkpoint: the torch reference, our loaded cfg/params, jitted entry points
  (compiled once per case and shape)."""

  def __init__(self, name: str, root: str):
    fused = name == "swa"
    self.path = os.path.join(root, name)
    self.torch_model = hf_utils.make_checkpoint(
        self.path, name, seed=0, fused=fused, max_shard_size="200KB" if fused else None)
    self.cfg, self.params = hf.load_hf(self.path)
    cfg = self.cfg
    self.forward = jax.jit(lambda p, t, v: tr.forward(p, cfg, t, valid_BT=v)[0])
    self.prefill = jax.jit(lambda p, t, n: tr.prefill(p, cfg, t, n)[:3])
    self.insert = jax.jit(tr.insert)
    self.decode = jax.jit(
        lambda p, c, t, pos: tr.decode(p, cfg, c, t, pos, jnp.ones(t.shape, bool))[:2],
        donate_argnums=1)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("hf_parity"))
  return {name: Case(name, root) for name in ("gqa", "swa")}


def _prompts(seed: int, vocab: int):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (len(LENGTHS), PAD_T))
  valid = np.arange(PAD_T)[None] < LENGTHS[:, None]
  return np.where(valid, tokens, 0), valid


def test_layouts_as_written(cases):
  """What transformers 5.x save_pretrained writes: hub layout by default, fused with
  save_original_format=False (sharded here). Both are the layouts our loader reads."""
  from safetensors import safe_open

  keys = {}
  for name, case in cases.items():
    ks = set()
    for f in os.listdir(case.path):
      if f.endswith(".safetensors"):
        with safe_open(os.path.join(case.path, f), "np") as h:
          ks |= set(h.keys())
    keys[name] = ks
  assert "model.layers.0.block_sparse_moe.experts.7.w1.weight" in keys["gqa"]
  assert not any("gate_up_proj" in k for k in keys["gqa"])
  assert "model.layers.0.mlp.experts.gate_up_proj" in keys["swa"]
  assert os.path.exists(os.path.join(cases["swa"].path, hf.INDEX_FILE))


def test_config_dimensions(cases):
  gqa, swa = cases["gqa"].cfg, cases["swa"].cfg
  assert (gqa.head_dim, gqa.num_heads, gqa.num_kv_heads, gqa.num_experts, gqa.num_layers,
          gqa.rope_theta, gqa.sliding_window) == (24, 4, 2, 8, 3, 5000.0, None)
  assert (swa.head_dim, swa.num_experts, swa.intermediate_size, swa.rope_theta,
          swa.sliding_window, swa.rms_eps) == (16, 4, 80, 20000.0, 4, 1e-6)


@pytest.mark.parametrize("name", ["gqa", "swa"])
def test_logits_match_torch(cases, name):
  """fp32 logits of a right-padded batch of different lengths, valid positions only."""
  case = cases[name]
  tokens, valid = _prompts(seed=11, vocab=case.cfg.vocab_size)
  with torch.no_grad():
    ref = case.torch_model(input_ids=torch.tensor(tokens),
                           attention_mask=torch.tensor(valid.astype(np.int64))).logits.numpy()
  ours = np.asarray(case.forward(case.params, jnp.asarray(tokens), jnp.asarray(valid)))
  diff = np.abs(ours - ref)[valid].max()
  print(f"[{name}] logits max|diff| = {diff:.3g} (logit std {ref[valid].std():.2f})")
  assert ref[valid].std() > 0.5, "logits are flat: the test would not distinguish anything"
  assert diff <= LOGIT_TOL
  if case.cfg.sliding_window is not None:
    # The window must matter at these lengths, or this case tests nothing about it.
    no_window = tr.forward(case.params, case.cfg.replace(sliding_window=None),
                           jnp.asarray(tokens), valid_BT=jnp.asarray(valid))[0]
    assert np.abs(np.asarray(no_window) - ref)[valid].max() > 1e-2


def _torch_greedy(model, prompt: np.ndarray):
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(prompt[None]),
                         attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
  return (out.sequences[0, len(prompt):].numpy(),
          torch.stack(out.logits, 0)[:, 0].numpy())  # [N], [N, V]


def _our_greedy(case: Case, tokens: np.ndarray):
  """prefill + insert + decode, all slots at once (each at its own position)."""
  b = tokens.shape[0]
  lengths = jnp.asarray(LENGTHS)
  logits, k, v = case.prefill(case.params, jnp.asarray(tokens), lengths)
  cache = case.insert(tr.KVCache.zeros(case.cfg, b, PAD_T + NEW_TOKENS), k, v, jnp.arange(b),
                      lengths)
  toks, all_logits = [], []
  tok = jnp.argmax(logits, -1).astype(jnp.int32)
  for i in range(NEW_TOKENS):
    if i:
      logits, cache = case.decode(case.params, cache, tok, lengths + i - 1)
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
    toks.append(np.asarray(tok))
    all_logits.append(np.asarray(logits))
  return np.stack(toks, 1), np.stack(all_logits, 1)  # [B, N], [B, N, V]


@pytest.mark.parametrize("name", ["gqa", "swa"])
def test_greedy_generation_matches_torch(cases, name):
  """32 greedy tokens equal torch generate() wherever the reference's top-1/top-2 margin is
  > 1e-3; the first closer position ends that sequence's comparison (a near tie may flip and
  the continuations then legitimately differ) and is counted; > 1% such positions fails."""
  case = cases[name]
  tokens, _ = _prompts(seed=23, vocab=case.cfg.vocab_size)
  ours_tok, ours_logits = _our_greedy(case, tokens)
  compared = close = 0
  max_diff = 0.0
  margins = []
  for b, n in enumerate(LENGTHS):
    ref_tok, ref_logits = _torch_greedy(case.torch_model, tokens[b, :n])
    top2 = np.sort(ref_logits, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    for i in range(NEW_TOKENS):
      margins.append(margin[i])
      if margin[i] <= MARGIN:
        close += 1
        break
      compared += 1
      # Same prefix so far, so the logits are comparable too, not only the argmax.
      max_diff = max(max_diff, float(np.abs(ours_logits[b, i] - ref_logits[i]).max()))
      assert ours_tok[b, i] == ref_tok[i], (
          f"[{name}] seq {b} step {i}: ours {ours_tok[b, i]} vs torch {ref_tok[i]} "
          f"(reference margin {margin[i]:.3g})")
  total = len(LENGTHS) * NEW_TOKENS
  margins = np.asarray(margins)
  print(f"[{name}] greedy: {compared}/{total} positions compared, {close} too close; "
        f"margin min {margins.min():.3g} median {np.median(margins):.3g}; "
        f"decode logits max|diff| {max_diff:.3g}")
  assert close <= MAX_CLOSE_FRACTION * total, (
      f"{close} of {total} positions have margin <= {MARGIN}")
  assert max_diff <= LOGIT_TOL


@pytest.mark.parametrize("name", ["gqa", "swa"])
def test_kv_cache_decode_equals_full_forward(cases, name):
  """Teacher-forced decode from a prefilled cache gives the full-sequence logits. Two rounds:
  prompts of different lengths (padded k/v past each length land in the cache and must be
  overwritten or masked), then 1-token prompts decoded to the end (every position 0..27). The
  cache (48) is longer than the window (4), so the swa case keeps every layer in a ring of 4
  positions (transformer.KVLayout) and reads its window from it."""
  case = cases[name]
  total_t = PAD_T + 12
  b = len(LENGTHS)
  rows = np.arange(b)
  rng = np.random.default_rng(37)
  seq = rng.integers(0, case.cfg.vocab_size, (b, total_t))
  full = np.asarray(case.forward(case.params, jnp.asarray(seq), jnp.ones(seq.shape, bool)))
  diffs = []
  for lengths in (LENGTHS, np.ones(b, np.int64)):
    prompt = np.where(np.arange(PAD_T)[None] < lengths[:, None], seq[:, :PAD_T], 0)
    logits, k, v = case.prefill(case.params, jnp.asarray(prompt), jnp.asarray(lengths))
    diffs.append(np.abs(np.asarray(logits) - full[rows, lengths - 1]).max())
    cache = case.insert(tr.KVCache.zeros(case.cfg, b, PAD_T + NEW_TOKENS), k, v, jnp.arange(b),
                        jnp.asarray(lengths))
    for i in range(total_t - lengths.max()):
      pos = lengths + i
      logits, cache = case.decode(case.params, cache, jnp.asarray(seq[rows, pos], jnp.int32),
                                  jnp.asarray(pos))
      diffs.append(np.abs(np.asarray(logits) - full[rows, pos]).max())
  print(f"[{name}] cache decode vs full forward max|diff| = {max(diffs):.3g} "
        f"over {len(diffs)} steps")
  assert max(diffs) <= CACHE_TOL
