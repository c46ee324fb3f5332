"""Metrics against timelines computed by hand."""

import json

import pytest

from flexfloor_jax.policy.accounting import Timeline, live_series, metrics, plot_timeline


def static_timeline():
  # 2 workers, B = 2. Step 0: prefill a (w0) and b (w1), 1 s. Steps 1-4: one decode dispatch of 4
  # steps, 1 s each. b has 2 tokens (prefill + step 1): finishes in step 1, local finish 2.
  # a has 5 tokens (prefill + steps 1..4): finishes in step 4. No release until the end (5, 5 s).
  tl = Timeline(workers=[0, 1], slots_per_worker=2, t_start=0.0)
  tl.add_step('prefill', 0, 1, [0, 1], [1, 1], 0.0, 1.0)
  tl.add_step('decode', 1, 4, [0, 1], [1, 1], 1.0, 5.0)
  tl.add_finish(1, 1, 0, 2, 'target', 1)
  tl.add_finish(0, 0, 0, 5, 'target', 4)
  tl.t_end = 5.0
  tl.add_release([0, 1], 5, 5.0, final=True)
  return tl


def test_static_by_hand():
  m = metrics(static_timeline())
  # device steps: prefill 1 x 2 + decode 4 x 2 = 10
  assert (m['device_steps'], m['device_steps_prefill'], m['device_steps_decode']) == (10, 2, 8)
  assert (m['prefill_steps'], m['decode_steps'], m['makespan_steps']) == (1, 4, 5)
  assert m['generated_tokens'] == 7
  assert m['tokens_per_device_step'] == pytest.approx(0.7)
  # w0: finish 5, release 5 -> idle 0; w1: finish 2, release 5 -> idle 3; occupied 5 + 5
  assert m['idle_after_finish_fraction'] == pytest.approx(3 / 10)
  # seconds: w1's local finish (after 2 steps) is at 2 s, so (5 - 2) / (5 + 5) again
  assert m['occupied_device_seconds'] == pytest.approx(10.0)
  assert m['idle_after_finish_fraction_seconds'] == pytest.approx(0.3)
  # decode tokens 7 - 2 first tokens = 5 over 8 decode device-steps x 2 slots
  assert m['slot_utilization'] == pytest.approx(5 / 16)
  assert m['throughput_tokens_per_s'] == pytest.approx(7 / 5)
  w1 = m['workers'][1]
  assert (w1['start_step'], w1['local_finish_step'], w1['release_step']) == (0, 2, 5)
  assert (w1['local_finish_s'], w1['release_s']) == (pytest.approx(2.0), pytest.approx(5.0))
  json.dumps(m)  # summary.json must be writable


def test_release_by_hand():
  # Same sequences. Decode dispatch 1 is step 1 only (b finishes there); w1 is released at step
  # count 2 (t = 2 s); w0 alone runs steps 2-4 at 0.5 s each, so the rollout ends at 3.5 s.
  tl = Timeline(workers=[0, 1], slots_per_worker=2, t_start=0.0)
  tl.add_step('prefill', 0, 1, [0, 1], [1, 1], 0.0, 1.0)
  tl.add_step('decode', 1, 1, [0, 1], [1, 1], 1.0, 2.0)
  tl.add_finish(1, 1, 0, 2, 'target', 1)
  tl.add_release([1], 2, 2.0, {'expert_bytes_moved': 4})
  tl.add_step('decode', 2, 3, [0], [1], 2.0, 3.5)
  tl.add_finish(0, 0, 0, 5, 'target', 4)
  tl.t_end = 3.5
  tl.add_release([0], 5, 3.5, final=True)
  m = metrics(tl)
  assert m['device_steps'] == 2 + 2 + 3  # 7
  assert m['tokens_per_device_step'] == pytest.approx(1.0)
  assert m['idle_after_finish_fraction'] == 0.0
  assert m['occupied_device_seconds'] == pytest.approx(3.5 + 2.0)
  assert m['slot_utilization'] == pytest.approx(5 / (5 * 2))
  assert [r['workers'] for r in m['releases']] == [[1], [0]]
  assert m['releases'][0]['stats'] == {'expert_bytes_moved': 4}


def test_migration_ends_donor_work():
  # w1 holds b (10 tokens); after step 2 (step count 3) b moves to w0 and w1 is released at 3.
  tl = Timeline(workers=[0, 1], slots_per_worker=2, t_start=0.0)
  tl.add_step('prefill', 0, 1, [0, 1], [1, 1], 0.0, 1.0)
  tl.add_step('decode', 1, 2, [0, 1], [1, 1], 1.0, 3.0)
  tl.add_migration(3, [[1, 0, 0, 1]], [], 100, 3.0)
  tl.add_release([1], 3, 3.0)
  tl.add_step('decode', 3, 7, [0], [2], 3.0, 10.0)
  tl.add_finish(0, 0, 0, 5, 'target', 4)
  tl.add_finish(1, 0, 1, 10, 'target', 9)
  tl.t_end = 10.0
  tl.add_release([0], 10, 10.0, final=True)
  m = metrics(tl)
  assert m['device_steps'] == 2 + 4 + 7
  w1 = m['workers'][1]
  assert (w1['local_finish_step'], w1['release_step']) == (3, 3)
  assert m['idle_after_finish_fraction'] == 0.0
  assert m['kv_bytes_migrated'] == 100 and m['num_migrations'] == 1


def test_release_while_busy_is_caught():
  tl = static_timeline()
  tl.releases = [dict(workers=[1], step=2, t=2.0, stats={}, final=False),
                 dict(workers=[0], step=5, t=5.0, stats={}, final=True)]
  with pytest.raises(AssertionError, match='released while still taking part'):
    metrics(tl)  # w1 is still in the decode record's active list for steps 2-4


def test_live_series_and_roundtrip():
  tl = static_timeline()
  xs, active, live = live_series(tl)
  assert xs == [0, 1, 2, 3, 4]
  assert active == [2, 2, 2, 2, 2]
  assert live == [2, 2, 1, 1, 1]  # b finishes in step 1
  assert metrics(Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))) == metrics(tl)


def test_plot_timeline(tmp_path):
  pytest.importorskip('matplotlib')
  p = tmp_path / 'timeline.png'
  plot_timeline(static_timeline(), str(p))
  assert p.read_bytes()[:4] == b'\x89PNG'
  assert [f.name for f in tmp_path.iterdir()] == ['timeline.png']  # no temp file left
