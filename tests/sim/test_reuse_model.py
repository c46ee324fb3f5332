"""sim/reuse.py (numpy only): the log-prob phase with and without released-device reuse,
against hand-computed schedules."""

import pytest

from flexfloor_jax.sim.reuse import logprob_phase_seconds


def test_no_release_no_gain():
  r = logprob_phase_seconds([1, 2, 3], [10, 10, 10], [], gen_end_s=5, num_devices=2,
                            seconds_per_token=0.1)
  assert r["without"] == pytest.approx(1.5) and r["with"] == pytest.approx(1.5)
  assert r["scored_early"] == 0


def test_hand_computed_schedule():
  # 4 devices, 1 s per response (10 tokens x 0.1 s) on one device. Responses finish at
  # 0, 0, 1, 9; gen ends at 10. Device A released at 0.5, device B at 4 (groups of 1).
  # A: r0 at 0.5-1.5, r1 1.5-2.5, r2 2.5-3.5; B at 4: r3 not finished until 9 -> 9-10.
  # All scored before the end; the tail is 0. Without reuse: 4 s of work / 4 devices = 1 s.
  r = logprob_phase_seconds([0, 0, 1, 9], [10] * 4, [0.5, 4], gen_end_s=10, num_devices=4,
                            seconds_per_token=0.1)
  assert r["without"] == pytest.approx(1.0)
  assert r["with"] == pytest.approx(0.0)
  assert r["scored_early"] == 1.0


def test_groups_and_leftover_water_filling():
  # Groups of 2: the released devices at 1 and 2 form one group at t=2 (scoring at 2x speed:
  # 0.5 s per response). Responses finish at 0 x 4 and 8; gen ends at 3.
  # Group: 2-2.5, 2.5-3.0 (r0, r1); at 3.0 it is free and the end has come: r2, r3, r4 left =
  # 3 device-seconds over 4 devices = 0.75 s. Without: 5 / 4 = 1.25 s.
  r = logprob_phase_seconds([0, 0, 0, 0, 8], [10] * 5, [1, 2], gen_end_s=3, num_devices=4,
                            seconds_per_token=0.1, group=2)
  assert r["with"] == pytest.approx(0.75)
  assert r["without"] == pytest.approx(1.25)
  assert r["scored_early"] == pytest.approx(0.4)
  # A response in hand past the end: group of 1 at 2.5 takes r0 until 3.5 (0.5 s past the end);
  # 4 left over 4 devices, the busy one joining at 0.5: T with 3T + (T - 0.5) = 4 -> T = 1.125.
  r = logprob_phase_seconds([0, 0, 0, 0, 0], [10] * 5, [2.5], gen_end_s=3, num_devices=4,
                            seconds_per_token=0.1)
  assert r["with"] == pytest.approx(1.125)
