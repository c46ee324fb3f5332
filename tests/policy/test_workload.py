"""Synthetic lengths: deterministic, stable per prompt, capped; JSONL files. (The calibration of
the default sigma: sim/test_calibrate.py.)"""

import dataclasses
import json

import numpy as np
import pytest

from flexfloor_jax.policy import workload as W


def test_deterministic_and_stable():
  spec = W.WorkloadSpec()
  a, b = W.lengths(spec, 3), W.lengths(spec, 3)
  assert a.shape == (8, 8) and a.dtype == np.int64 and (a == b).all()
  assert not (W.lengths(spec, 4) == a).all()
  # a prompt's mean is fixed by the seed: its rank across epochs stays close
  means = np.stack([np.log(W.lengths(spec, e)).mean(1) for e in range(6)])
  assert np.corrcoef(means).min() > 0.8
  other = dataclasses.replace(spec, seed=1)
  assert not (W.lengths(other, 3) == a).all()


def test_cap_and_min():
  spec = W.WorkloadSpec(sigma=2.0, cap=100, min_len=3)
  L = np.concatenate([W.lengths(spec, e).ravel() for e in range(5)])
  assert L.max() == 100 and L.min() >= 3
  assert (L == 100).sum() > 5  # a long tail piles up at the cap


def test_make_seqs_verl_order():
  seqs = W.make_seqs(W.WorkloadSpec(), 0)
  assert [s.prompt_id for s in seqs[:9]] == ['p0000'] * 8 + ['p0001']
  assert [s.sample for s in seqs[:9]] == list(range(8)) + [0]
  assert all(s.max_new_tokens == W.DEFAULT_CAP for s in seqs)
  assert W.make_seqs(W.WorkloadSpec(), with_targets=False)[0].target_len is None


def test_jsonl_roundtrip(tmp_path):
  p = str(tmp_path / 'lengths.jsonl')
  rows = W.lengths_rows(W.WorkloadSpec(), 2)
  W.write_lengths_jsonl(p, rows)
  got = W.read_lengths_jsonl(p)
  assert got == {(pid, s): n for pid, s, n in rows}


@pytest.mark.parametrize('lines, where, match', [
    (['{"id": "a", "sample": 0, "length": 3}', 'nope'], 2, 'not JSON'),
    (['{"id": "a", "sample": 0}'], 1, 'need keys'),
    (['{"id": "a", "sample": 0, "length": 0}'], 1, 'int >= 1'),
    (['{"id": "a", "sample": "x", "length": 4}'], 1, 'int >= 0'),
    (['{"id": "a", "sample": 0, "length": 3}', '', '{"id": "a", "sample": 0, "length": 4}'], 3,
     'duplicate'),
])
def test_jsonl_errors_name_file_and_line(tmp_path, lines, where, match):
  p = tmp_path / 'bad.jsonl'
  p.write_text('\n'.join(lines) + '\n')
  with pytest.raises(ValueError, match=match) as e:
    W.read_lengths_jsonl(str(p))
  assert str(e.value).startswith(f'{p}:{where}:')


def test_jsonl_missing_file(tmp_path):
  with pytest.raises(ValueError, match='cannot read'):
    W.read_lengths_jsonl(str(tmp_path / 'missing.jsonl'))


def _trace(tmp_path, prompts, cap=8):
  path = tmp_path / "trace.json"
  path.write_text(json.dumps({"source": "by hand", "max_new_tokens": cap, "prompts": prompts}))
  return str(path)


def test_trace_replays_an_epoch_with_the_earlier_ones_as_history(tmp_path):
  """Two prompts, three epochs of two samples. Seed 0 replays the last epoch with epochs 0 and 1
  as history, seed 1 the middle one with epoch 0; two copies double the batch under new ids."""
  t = W.load_trace(_trace(tmp_path, {
      "a": {"prompt_len": 3, "epochs": [[1, 2], [3, 4], [5, 6]]},
      "b": {"prompt_len": 5, "epochs": [[7, 8], [1, 1], [2, 8]]}}))
  assert (t.num_epochs, t.samples_per_prompt, t.max_new_tokens) == (3, 2, 8)
  seqs, hist = W.trace_rollout(t, 2, 0)
  assert [s.target_len for s in seqs] == [5, 6, 2, 8, 5, 6, 2, 8]
  assert [s.prompt_id for s in seqs] == ["a/0", "a/0", "b/0", "b/0", "a/1", "a/1", "b/1", "b/1"]
  assert [s.prompt_len for s in seqs[:4]] == [3, 3, 5, 5]
  assert sorted(hist) == [0, 1] and [s.target_len for s in hist[1][:4]] == [3, 4, 1, 1]
  assert len({s.seq_id for s in seqs}) == 8
  seqs, hist = W.trace_rollout(t, 1, 1)
  assert [s.target_len for s in seqs] == [3, 4, 1, 1] and sorted(hist) == [0]
  with pytest.raises(ValueError, match="seeds 0..1"):
    W.trace_rollout(t, 1, 2)  # epoch 0 has no history


@pytest.mark.parametrize("prompts, match", [
    ({}, "non-empty"),
    ({"a": {"prompt_len": 0, "epochs": [[1]]}}, "prompt 'a'"),
    ({"a": {"prompt_len": 2, "epochs": [[1, 9]]}}, r"ints in 1..8"),
    ({"a": {"prompt_len": 2, "epochs": [[1, True]]}}, "prompt 'a'"),
    ({"a": {"prompt_len": 2, "epochs": [[1], [2]]}, "b": {"prompt_len": 2, "epochs": [[1]]}},
     "the first prompt has 2"),
])
def test_trace_errors_name_the_file_and_the_entry(tmp_path, prompts, match):
  path = _trace(tmp_path, prompts)
  with pytest.raises(ValueError, match=match) as e:
    W.load_trace(path)
  assert path in str(e.value)
