"""A release at Qwen3-MoE's expert count: 128 experts on 8 workers, 32 preallocated slots each
(the floor of 4 workers), shrunk to 4 workers, so each survivor receives 16 experts in one
release. Tiny dimensions; the engine's real programs on 8 emulated CPU devices."""

import jax
import numpy as np
import pytest

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.engine import elastic
from flexfloor_jax.engine.sampling import SamplingParams
from flexfloor_jax.model import transformer as tfm
from flexfloor_jax.model.config import PRESETS
from flexfloor_jax.policy.expert_placement import ExpertPlacement

E, N, FLOOR = 128, 8, 4
CFG = PRESETS["qwen3-tiny"].replace(num_experts=E, top_k=8, num_layers=2, hidden_size=64,
                                    intermediate_size=16, head_dim=16, dtype="float32")
SLOTS = E // FLOOR  # 32: each worker's slots hold the experts of the floor's group
SPEC = engine_lib.EngineSpec(cfg=CFG, slots_per_worker=2, expert_slots=SLOTS, max_seq_len=24,
                             max_prompt_len=8, max_new_tokens=12,
                             sampling=SamplingParams(temperature=0.0), warm_up=False)
CHAIN = list(range(N))
SURVIVORS = CHAIN[N - FLOOR:]  # a release keeps a tail of the chain


@pytest.fixture(scope="module")
def params():
  return tfm.init_params(CFG, jax.random.key(5), scale=0.1)


@pytest.fixture(scope="module")
def steps(params):
  """One StepCache for both engines of the test: sizes 8 and 4, slot movers on every device."""
  if len(jax.devices()) < N:
    pytest.skip(f"needs {N} devices, {jax.default_backend()} has {len(jax.devices())}")
  return engine_lib.StepCache(SPEC, jax.devices()[:N], CHAIN, *engine_lib.abstract_split(params))


def _engine(params, steps):
  placement = ExpertPlacement.initial(E, CHAIN, SLOTS, num_workers=N)
  eng = engine_lib.Engine(SPEC, params, jax.devices()[:N], CHAIN, placement, seed=0,
                          step_cache=steps, prefetch_sizes=[FLOOR])
  rng = np.random.default_rng(1)
  eng.add_sequences({i: engine_lib.SeqInput(tokens=rng.integers(0, 256, 6).astype(np.int32),
                                            limit=SPEC.max_new_tokens, stop_eos=False, phash=i,
                                            sample=0)
                     for i in range(2)})
  eng.prefill([(SURVIVORS[0], 0, 0), (SURVIVORS[2], 1, 1)])
  return eng


def _decode_to_end(eng):
  while len(eng.outputs) < 2:
    n = len(eng.active)
    eng.decode(4, np.zeros(n, bool), np.zeros(n, bool))
  return {sid: o.tokens for sid, o in eng.outputs.items()}


def test_release_of_half_the_workers_moves_16_experts_to_each_survivor(params, steps):
  """8 -> 4 at 128 experts: the 64 experts of the released workers move, 16 to each survivor,
  into its empty slots; every moved slot holds the source weights bit for bit (single-device
  movers, and the SPMD extract/insert path the same bits); the survivors' own slots keep their
  buffers; greedy tokens after the release equal those of an engine that never released."""
  eng = _engine(params, steps)
  n_before = len(eng.active)
  eng.decode(3, np.zeros(n_before, bool), np.zeros(n_before, bool))
  old_placement = eng.placement
  copies = {k: v.copy() for k, v in eng.experts.items()}

  def pointers(arr):
    return {s.device.id: s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}

  before = {k: pointers(v) for k, v in eng.experts.items()}
  stats = eng.shrink(SURVIVORS)

  moves = [(*a, *b) for _, a, b in eng.placement.moves_since(old_placement)]
  assert stats["expert_moves"] == len(moves) == E // 2
  per_survivor = np.bincount([dw for _, _, dw, _ in moves], minlength=N)
  assert per_survivor[SURVIVORS].tolist() == [E // N] * FLOOR
  slot_bytes = sum(v.nbytes // (N * SLOTS) for v in copies.values())
  assert stats["expert_bytes_moved"] == len(moves) * slot_bytes
  devices = jax.devices()[:N]
  for k, v in eng.experts.items():
    after = pointers(v)
    assert set(after) == {devices[w].id for w in SURVIVORS}
    assert all(after[d] == before[k][d] for d in after), k

  # Bit for bit: every active slot against the canonical weights, every moved slot against
  # the slot it left.
  _, canon = engine_lib.split_params(params)
  held = eng.placement.slot_expert()[eng.active]
  assert sorted(held[held >= 0].tolist()) == list(range(E))
  src = {k: np.asarray(v) for k, v in copies.items()}
  for k, v in eng.experts.items():
    got, want = np.asarray(v), np.asarray(canon[k])
    for pos, row in enumerate(held):
      for s, e in enumerate(row):
        if e >= 0:
          np.testing.assert_array_equal(got[:, pos * SLOTS + s], want[:, e], err_msg=k)
    for sw, ss, dw, ds in moves:
      np.testing.assert_array_equal(got[:, SURVIVORS.index(dw) * SLOTS + ds],
                                    src[k][:, sw * SLOTS + ss], err_msg=k)

  # The SPMD path (multi-controller, or movers the plan left out) moves the same bits.
  spmd, spmd_bytes = elastic._move_experts_spmd(steps.get(N), steps.get(FLOOR), devices, CHAIN,
                                                SURVIVORS, copies, moves)
  assert spmd_bytes == stats["expert_bytes_moved"]
  for k, v in eng.experts.items():
    np.testing.assert_array_equal(np.asarray(spmd[k]), np.asarray(v), err_msg=k)

  released = _decode_to_end(eng)
  static = _decode_to_end(_engine(params, steps))
  assert all(len(t) == SPEC.max_new_tokens for t in static.values())
  assert released == static
