"""Drafts from earlier epochs and sibling samples (policy/drafts.py): the draft is what followed
the longest match, ties go to the most recent source, no draft without a long enough match, drafts
stay within max_draft and their source; siblings are found as they grow; the response store keeps
its bounds, round-trips, merges with another run's saves and refuses a foreign or corrupt file."""

import json
import logging
import os

import numpy as np
import pytest

from flexfloor_jax.policy.drafts import (
  STORE_FORMAT,
  STORE_VERSION,
  Drafter,
  DraftRow,
  ResponseStore,
  SourceIndex,
  StoreError,
  draft,
  lock_store,
)

VOCAB = 50_000


def _tokens(rng, n, vocab=VOCAB):
  return rng.integers(0, vocab, n).astype(np.int32)


def _reference(ctx, sources, max_draft, min_match, max_match):
  """The draft by brute force: every position of every source, the longest suffix match (with a
  token after it), ties to the most recent source, then to the later position."""
  ctx = list(ctx)[-max_match:]
  best, best_len = [], min_match - 1
  for src in reversed([list(s) for s in sources]):
    for p in range(len(src) - 1, 0, -1):  # p: the position of the token that would be drafted
      n = 0
      while n < min(len(ctx), p) and src[p - n - 1] == ctx[-n - 1]:
        n += 1
      if n > best_len:
        best, best_len = src[p:p + max_draft], n
  return best


# ----------------------------------------------------------------------------- draft


def test_the_draft_is_what_followed_the_match():
  src = [11, 12, 13, 14, 15, 16, 17]
  assert draft([90, 12, 13, 14], [src], 3).tolist() == [15, 16, 17]
  assert draft([90, 12, 13, 14], [src], 2).tolist() == [15, 16]
  assert draft(np.array([12, 13], np.int64), [np.array(src)], 4, min_match=2).tolist() == [
      14, 15, 16, 17]
  out = draft([13, 14, 15], [src], 8)
  assert out.dtype == np.int32 and out.tolist() == [16, 17]  # stops at the source's end


def test_the_longest_match_wins_over_a_shorter_more_recent_one():
  older = [5, 1, 2, 3, 40, 41]
  newer = [9, 2, 3, 50, 51]  # matches only the last two tokens, but is the most recent source
  assert draft([5, 1, 2, 3], [older, newer], 2, min_match=2).tolist() == [40, 41]
  assert draft([5, 1, 2, 3], [newer, older], 2, min_match=2).tolist() == [40, 41]
  # equal lengths: the most recent source (the last) wins, and within one source the later spot
  assert draft([1, 2, 3], [[1, 2, 3, 40], [1, 2, 3, 50]], 1).tolist() == [50]
  assert draft([1, 2, 3], [[1, 2, 3, 50], [1, 2, 3, 40]], 1).tolist() == [40]
  assert draft([7, 1, 2], [[1, 2, 60, 0, 1, 2, 70]], 1, min_match=2).tolist() == [70]


def test_no_draft_without_a_long_enough_match():
  src = [1, 2, 3, 4, 5]
  empty = [
      draft([8, 9, 10], [src], 4),  # nothing in common
      draft([9, 3, 4], [src], 4, min_match=3),  # only 2 tokens match
      draft([3, 4], [src], 4, min_match=3),  # the context is shorter than min_match
      draft([3, 4, 5], [src], 4),  # matches at the source's end: nothing followed it
      draft([1, 2, 3], [], 4),  # no sources
      draft([1, 2, 3], [src], 0),  # no room for a draft
  ]
  assert all(d.size == 0 and d.dtype == np.int32 for d in empty)
  assert draft([9, 3, 4], [src], 4, min_match=2).tolist() == [5]


@pytest.mark.parametrize('min_match, max_match', [(1, 4), (2, 16), (3, 8)])
def test_drafts_match_brute_force_and_stay_within_bounds(min_match, max_match):
  """A small vocabulary, so that matches of every length abound: with every occurrence examined,
  each draft is exactly the brute-force one, never longer than max_draft nor past its source."""
  rng = np.random.default_rng(min_match * 100 + max_match)
  sources = [_tokens(rng, int(rng.integers(1, 200)), vocab=6) for _ in range(5)]
  drafted = 0
  for _ in range(300):
    ctx = _tokens(rng, int(rng.integers(0, 30)), vocab=6)
    max_draft = int(rng.integers(0, 12))
    got = draft(ctx, sources, max_draft, min_match, max_match=max_match, max_candidates=10_000)
    assert got.tolist() == _reference(ctx, sources, max_draft, min_match, max_match)
    assert len(got) <= max_draft
    drafted += len(got) > 0
  assert drafted > 100  # the cases did exercise drafting


def test_a_capped_search_still_drafts_only_true_continuations():
  """With the default cap on the occurrences examined, a draft may not be the longest match, but
  it always follows a match of at least min_match tokens and is a slice of its source."""
  rng = np.random.default_rng(7)
  sources = [_tokens(rng, 400, vocab=4) for _ in range(3)]
  for _ in range(200):
    ctx = _tokens(rng, 20, vocab=4)
    got = draft(ctx, sources, 5).tolist()
    assert got, 'with 4 tokens every trigram occurs'
    assert any(src[p - 3:p].tolist() == ctx[-3:].tolist() and src[p:p + len(got)].tolist() == got
               and (len(got) == 5 or p + len(got) == len(src))
               for src in sources for p in range(3, len(src)))


def test_a_source_index_grown_piecewise_equals_one_built_at_once():
  rng = np.random.default_rng(3)
  toks = _tokens(rng, 500, vocab=30)
  grown = SourceIndex((), 3)
  cut = 0
  while cut < len(toks):
    step = int(rng.integers(0, 9))
    grown.extend(toks[cut:cut + step])
    cut += step
  whole = SourceIndex(toks, 3)
  assert grown.tokens == whole.tokens == toks.tolist() and grown.grams == whole.grams
  with pytest.raises(ValueError, match='min_match=2'):
    draft(toks[:5], [whole], 3, min_match=2)


# ----------------------------------------------------------------------------- Drafter


def test_a_siblings_tokens_are_found_after_they_grow():
  d = Drafter(min_match=3)
  row = DraftRow(0, 'p', np.array([70, 1, 2, 3]), [1])
  assert d.draft_rows([row, DraftRow(1, 'p', np.array([5]), [0])], 4)[0].size == 0
  # the sibling reaches the row's suffix: still nothing, no token followed it yet
  assert d.draft_rows([row, DraftRow(1, 'p', np.array([5, 1, 2, 3]), [0])], 4)[0].size == 0
  # it grows in the same call as the row asks: the row sees its new tokens
  out = d.draft_rows([row, DraftRow(1, 'p', np.array([5, 1, 2, 3, 9, 8]), [0])], 4)
  assert out[0].tolist() == [9, 8]
  # and the sibling drafts from the row in turn, once the row has grown past the match
  out = d.draft_rows([(0, 'p', [70, 1, 2, 3, 9, 8, 66], [1]), (1, 'p', [5, 1, 2, 3, 9, 8], [0])], 4)
  assert out[0].size == 0 and out[1].tolist() == [66]
  # siblings that stopped growing draft on, from what they had; equal matches: the last named
  assert d.draft_rows([(2, 'p', [4, 2, 3, 9], [1, 0])], 2)[0].tolist() == [8, 66]
  assert d.draft_rows([(2, 'p', [4, 2, 3, 9], [0, 1])], 2)[0].tolist() == [8]


def test_draft_rows_uses_the_store_then_the_siblings():
  rng = np.random.default_rng(11)
  old, new = _tokens(rng, 60), _tokens(rng, 60)
  store = ResponseStore('tok-a')
  store.add_rollout(0, [('p', 0, old)])
  store.add_rollout(1, [('p', 0, new)])
  d = Drafter(store)
  sib = np.concatenate([old[:30], _tokens(rng, 10)])  # a sibling that repeats the oldest epoch
  rows = [
      DraftRow(0, 'p', np.concatenate([[7], old[10:20]]), [1]),  # longest match: in both
      DraftRow(1, 'p', sib, [0]),
      DraftRow(2, 'p', new[:25], []),  # only the newest epoch holds it
      DraftRow(3, 'q', old[10:20], []),  # another prompt: p's responses are not its sources
  ]
  out = d.draft_rows(rows, 5)
  assert out[0].tolist() == old[20:25].tolist()  # the same match length: the sibling's
  assert out[2].tolist() == new[25:30].tolist()
  assert out[3].size == 0
  # a longer match in the store beats the sibling
  out = d.draft_rows([DraftRow(0, 'p', np.concatenate([[7], old[10:20], old[20:35]]), [1])], 3)
  assert out[0].tolist() == old[35:38].tolist()
  with pytest.raises(ValueError, match="sequence 3 of prompt 'q'"):
    d.draft_rows([DraftRow(0, 'p', old[:3], [3])], 2)
  with pytest.raises(ValueError, match="sequence 3 is of prompt 'q'"):
    d.update(3, 'p', old[:3])
  d.drop('p')
  assert d.draft_rows([DraftRow(5, 'p', old[10:20], [])], 3)[0].tolist() == old[20:23].tolist()
  # equal matches in two epochs: the newer epoch's
  store.add_rollout(0, [('r', 0, [1, 2, 3, 40])])
  d = Drafter(store)
  d.prepare(['r'])  # indexed now: what the store gains later is for the next step's Drafter
  store.add_rollout(1, [('r', 0, [1, 2, 3, 50])])
  assert d.draft_rows([DraftRow(0, 'r', [1, 2, 3], [])], 3)[0].tolist() == [40]
  assert Drafter(store).draft_rows([DraftRow(0, 'r', [1, 2, 3], [])], 3)[0].tolist() == [50]


def test_a_sequence_that_starts_over_is_indexed_again():
  d = Drafter()
  d.update(1, 'p', [1, 2, 3, 4, 5])
  d.update(1, 'p', [1, 2, 3, 9])  # fewer tokens than indexed: started over
  assert d.draft_rows([(0, 'p', [1, 2, 3], [1])], 3)[0].tolist() == [9]


# ----------------------------------------------------------------------------- the store


def test_store_keeps_the_newest_epochs_and_each_responses_prefix():
  rng = np.random.default_rng(5)
  store = ResponseStore('tok-a', max_per_prompt=4, max_tokens=50)
  given = {}
  for epoch in range(5):
    rollout = [(p, s, _tokens(rng, int(rng.integers(1, 120))))
               for p in ('a', 'b') for s in range(3)]
    store.add_rollout(epoch, rollout)
    given.update({(p, epoch, s): t for p, s, t in rollout})
  for p in ('a', 'b'):
    # 3 samples of epoch 4, then epoch 3's lowest sample
    assert {e: sorted(d) for e, d in store.epochs(p).items()} == {4: [0, 1, 2], 3: [0]}
    got = store.responses(p)
    assert len(got) == 4
    want = [given[p, 3, 0]] + [given[p, 4, s] for s in range(3)]  # oldest epoch first
    for g, w in zip(got, want, strict=True):
      assert len(g) <= 50 and g.dtype == np.int32 and g.tolist() == w[:50].tolist()
      assert not g.flags.writeable
  # an epoch given again is replaced by the samples given then
  store.add_rollout(4, [('a', 1, [1, 2, 3])])
  assert {e: sorted(d) for e, d in store.epochs('a').items()} == {4: [1], 3: [0]}
  assert store.responses('zz') == []


@pytest.mark.parametrize('tokens, match', [
    ([1, -2], r'\[0, 2147483648\)'), ([[1, 2]], '1-D'), ([1.5, 2.0], 'integers'),
    ([2**31], r'\[0, 2147483648\)')])
def test_store_refuses_what_is_not_token_ids(tokens, match):
  with pytest.raises(ValueError, match=match):
    ResponseStore('tok-a').add_rollout(0, [('p', 0, tokens)])
  with pytest.raises(ValueError, match='twice'):
    ResponseStore('tok-a').add_rollout(0, [('p', 0, [1]), ('p', 0, [2])])


def test_store_round_trip(tmp_path):
  rng = np.random.default_rng(8)
  path = str(tmp_path / 'responses.npz')
  assert len(ResponseStore.load(path, 'tok-a')) == 0  # missing file: an empty store
  store = ResponseStore('tok-a', max_per_prompt=6, max_tokens=40)
  for epoch in (0, 3):
    store.add_rollout(epoch, [(f'prompt {i}', s, _tokens(rng, int(rng.integers(0, 60))))
                              for i in range(5) for s in range(2)])
  store.save(path)
  assert os.listdir(tmp_path) == ['responses.npz']  # no lock or temp file left
  back = ResponseStore.load(path, 'tok-a', max_per_prompt=6, max_tokens=40)
  assert _as_lists(back) == _as_lists(store)
  # loading with tighter bounds cuts what the file holds to them
  small = ResponseStore.load(path, 'tok-a', max_per_prompt=1, max_tokens=3)
  assert all(list(small.epochs(p)) == [3] and len(small.responses(p)) == 1
             and small.responses(p)[0].tolist() == store.epochs(p)[3][0][:3].tolist()
             for p in store.data)


def _as_lists(store):
  return {p: {e: {s: v.tolist() for s, v in d.items()} for e, d in ep.items()}
          for p, ep in store.data.items()}


def test_saving_merges_with_the_epochs_another_run_saved(tmp_path, caplog):
  rng = np.random.default_rng(9)
  path = str(tmp_path / 'responses.npz')
  first = ResponseStore('tok-a')
  first.add_rollout(0, [('p', 0, _tokens(rng, 20)), ('q', 0, _tokens(rng, 20))])
  first.save(path)
  run_a, run_b = ResponseStore.load(path, 'tok-a'), ResponseStore.load(path, 'tok-a')
  a1, b2 = _tokens(rng, 30), _tokens(rng, 30)
  run_a.add_rollout(1, [('p', 0, a1)])
  run_b.add_rollout(2, [('p', 0, b2), ('r', 0, b2)])
  run_a.save(path)
  run_b.save(path)  # knows nothing of run_a's epoch 1: keeps it
  merged = ResponseStore.load(path, 'tok-a')
  assert sorted(merged.epochs('p')) == [0, 1, 2] and sorted(merged.data) == ['p', 'q', 'r']
  assert merged.epochs('p')[1][0].tolist() == a1.tolist()
  assert merged.epochs('p')[2][0].tolist() == b2.tolist()
  # both write the same prompt and epoch: the later save wins, with a warning naming the file
  x, y = _tokens(rng, 10), _tokens(rng, 10)
  run_a.add_rollout(3, [('p', 0, x)])
  run_b.add_rollout(3, [('p', 0, y)])
  run_a.save(path)
  with caplog.at_level(logging.WARNING):
    run_b.save(path)
  assert ResponseStore.load(path, 'tok-a').epochs('p')[3][0].tolist() == y.tolist()
  assert any(path in r.getMessage() and 'another run saved 1' in r.getMessage()
             for r in caplog.records)
  # a run's entry it did not change does not undo what another run saved over it since
  run_a.add_rollout(4, [('q', 0, x)])
  run_a.save(path)
  assert ResponseStore.load(path, 'tok-a').epochs('p')[3][0].tolist() == y.tolist()
  # the file keeps the saver's bounds
  tight = ResponseStore.load(path, 'tok-a')
  tight.max_per_prompt = 2
  tight.save(path)
  assert sorted(ResponseStore.load(path, 'tok-a').epochs('p')) == [2, 3]
  # merge=False: the file becomes exactly this store
  only = ResponseStore('tok-a')
  only.add_rollout(0, [('z', 0, [1, 2])])
  only.save(path, merge=False)
  assert _as_lists(ResponseStore.load(path, 'tok-a')) == {'z': {0: {0: [1, 2]}}}


def test_a_staged_copy_merges_with_the_file_it_replaces(tmp_path):
  """save(copy, current=path): the rollout's staged copy holds the file's epochs and this run's,
  and the file itself is untouched until the caller moves the copy over it."""
  path, copy = str(tmp_path / 'responses.npz'), str(tmp_path / 'out' / 'responses.npz')
  other = ResponseStore('tok-a')
  other.add_rollout(0, [('p', 0, [1, 2])])
  other.save(path)
  mine = ResponseStore('tok-a')
  mine.add_rollout(1, [('p', 0, [3, 4])])
  with lock_store(path):
    mine.save(copy, current=path)
  assert _as_lists(ResponseStore.load(copy, 'tok-a')) == {'p': {0: {0: [1, 2]}, 1: {0: [3, 4]}}}
  assert _as_lists(ResponseStore.load(path, 'tok-a')) == {'p': {0: {0: [1, 2]}}}
  assert sorted(os.listdir(tmp_path)) == ['out', 'responses.npz']


def test_a_store_for_another_tokenizer_is_refused_naming_the_file(tmp_path):
  path = str(tmp_path / 'responses.npz')
  store = ResponseStore('tok-a')
  store.add_rollout(0, [('p', 0, [1, 2, 3])])
  store.save(path)
  with pytest.raises(StoreError) as e:
    ResponseStore.load(path, 'tok-b')
  assert path in str(e.value) and "'tok-a'" in str(e.value) and "'tok-b'" in str(e.value)
  before = open(path, 'rb').read()
  other = ResponseStore('tok-b')
  other.add_rollout(0, [('p', 0, [4, 5])])
  with pytest.raises(StoreError, match='not replaced') as e:
    other.save(path)
  assert path in str(e.value) and "'tok-a'" in str(e.value)
  assert open(path, 'rb').read() == before and os.listdir(tmp_path) == ['responses.npz']


def _valid_arrays(**change):
  meta = {'format': STORE_FORMAT, 'version': STORE_VERSION, 'tokenizer': 'tok-a',
          'prompts': ['p', 'q']}
  meta.update(change.pop('header', {}))
  arrays = {'meta': np.frombuffer(json.dumps(meta).encode(), np.uint8),
            'prompt': np.array([0, 1, 1]), 'epoch': np.array([0, 0, 1]),
            'sample': np.array([0, 0, 0]), 'offsets': np.array([0, 2, 2, 5]),
            'tokens': np.array([1, 2, 3, 4, 5], np.int32)}
  arrays.update(change)
  return {k: v for k, v in arrays.items() if v is not None}


def _npz(tmp_path, **change):
  path = tmp_path / 'responses.npz'
  with open(path, 'wb') as f:
    np.savez(f, **_valid_arrays(**change))
  return path


def _npy(path, array):
  with open(path, 'wb') as f:
    np.save(f, array)


@pytest.mark.parametrize('make, match', [
    (lambda d: d.write_bytes(b'\x00\xffnot a store'), 'corrupt'),
    (lambda d: d.write_text('{"format": "flexfloor_jax.response_store"}'), 'corrupt'),
    (lambda d: d.write_bytes(_npz(d.parent).read_bytes()[:200]), 'corrupt'),
    (lambda d: _npy(d, np.arange(3)), 'not a flexfloor_jax response store'),
    (lambda d: _npz(d.parent, meta=None), 'no header'),
    (lambda d: _npz(d.parent, meta=np.frombuffer(b'{"format": ', np.uint8)), 'corrupt'),
    (lambda d: _npz(d.parent, header={'format': 'other'}), 'format marker missing'),
    (lambda d: _npz(d.parent, header={'version': 7}), 'version 7'),
    (lambda d: _npz(d.parent, tokens=None), 'no tokens array'),
    (lambda d: _npz(d.parent, offsets=np.array([0, 2, 1, 5])), 'offsets'),
    (lambda d: _npz(d.parent, offsets=np.array([0, 2, 5])), 'one entry per response'),
    (lambda d: _npz(d.parent, prompt=np.array([0, 2, 1])), 'prompt index 2'),
    (lambda d: _npz(d.parent, tokens=np.array([1, 2, 3, -4, 5])), "prompt 'q': token -4"),
    (lambda d: _npz(d.parent, tokens=np.array([1.0, 2, 3, 4, 5])), '1-D integer'),
    (lambda d: _npz(d.parent, epoch=np.array([0, -1, 1])), "prompt 'q': epoch -1"),
    (lambda d: _npz(d.parent, epoch=np.array([0, 1, 1])), 'sample 0 twice'),
    (lambda d: _npz(d.parent, header={'prompts': ['p', 'p']}), 'distinct'),
])
def test_a_corrupt_store_is_refused_naming_the_file(tmp_path, make, match):
  path = tmp_path / 'responses.npz'
  make(path)
  with pytest.raises(StoreError, match=match) as e:
    ResponseStore.load(str(path), 'tok-a')
  assert str(path) in str(e.value)
  # and a save does not replace it
  before = path.read_bytes()
  store = ResponseStore('tok-a')
  store.add_rollout(0, [('p', 0, [1, 2])])
  with pytest.raises(StoreError, match='not replaced'):
    store.save(str(path))
  assert path.read_bytes() == before


def test_hand_made_store_file_loads(tmp_path):
  """The base of the corrupt cases above is a good file: each case breaks one thing."""
  path = _npz(tmp_path)
  store = ResponseStore.load(str(path), 'tok-a')
  assert _as_lists(store) == {'p': {0: {0: [1, 2]}}, 'q': {0: {0: []}, 1: {0: [3, 4, 5]}}}
