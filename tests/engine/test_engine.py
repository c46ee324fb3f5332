"""The rollout engine driven by the policy controller (static placement, no release): responses
do not depend on where or beside what they ran, continuous batching refills slots, and nothing
compiles once the engine's step sets are built.

One EngineSpec serves every test: the runner's flexfloor spec of tests/engine/test_elastic.py
(engine_utils.rollout_spec), through the session's StepCache over the chain of all 8 emulated
devices, so the meshes of 8 and 4 workers (the last 4 devices) are the ones the runner tests
compiled.
"""

from __future__ import annotations

import engine_utils
import jax
import numpy as np
import pytest
from engine_utils import TINY, CompileCounter, make_params

from flexfloor_jax import engine as engine_lib
from flexfloor_jax.engine.sampling import prompt_hash
from flexfloor_jax.policy import controller, release_policy, scheduler
from flexfloor_jax.policy.expert_placement import ExpertPlacement

# rollout_config's engine: 2 decode slots per worker, 8 expert slots (floor 1), 32 new tokens,
# temperature 1.0, top_p 0.9
_ROLLOUT = engine_utils.rollout_config().rollout
SLOTS, MAX_NEW = _ROLLOUT.slots_per_worker, _ROLLOUT.max_new_tokens
MAX_PROMPT = 16  # random prompts of 3..16 tokens (the spec takes up to 48)
CHAIN = list(range(8))


@pytest.fixture(scope="module")
def params():
  return make_params(TINY, seed=3)


@pytest.fixture(scope="module")
def step_cache(params, step_caches):
  spec = engine_utils.rollout_spec(TINY)
  assert (spec.slots_per_worker, spec.max_new_tokens) == (SLOTS, MAX_NEW)
  return step_caches.get(spec, jax.devices()[:8], CHAIN, *engine_lib.abstract_split(params))


def make_seqs(num_prompts: int, samples: int, seed: int):
  """Random prompts (3..16 tokens) and per-sequence limits (2..MAX_NEW); EOS also stops."""
  rng = np.random.default_rng(seed)
  seqs, inputs = [], {}
  for p in range(num_prompts):
    prompt = rng.integers(0, TINY.vocab_size, rng.integers(3, MAX_PROMPT + 1))
    prompt = prompt.astype(np.int32)
    for j in range(samples):
      sid = len(seqs)
      limit = int(rng.integers(2, MAX_NEW + 1))
      seqs.append(controller.Seq(seq_id=sid, prompt_id=f"p{p}", sample=j,
                                 prompt_len=len(prompt), target_len=None, max_new_tokens=limit))
      inputs[sid] = engine_lib.SeqInput(tokens=prompt, limit=limit, stop_eos=True,
                                        phash=prompt_hash(f"p{p}"), sample=j)
  return seqs, inputs


class Recorder:
  """Executor wrapper that records the assignments of each prefill call, in order."""

  def __init__(self, eng):
    self.eng, self.prefills, self.decode_steps = eng, [], []
    self.slots_per_worker = SLOTS

  def prefill(self, assign):
    self.prefills.append(list(assign))
    return self.eng.prefill(assign)

  def decode(self, max_steps, stop_on_refill, stop_on_idle):
    steps, finishes = self.eng.decode(max_steps, stop_on_refill, stop_on_idle)
    self.decode_steps.append(steps)
    return steps, finishes

  def migrate(self, moves):
    return self.eng.migrate(moves)

  def shrink(self, new_active):
    return self.eng.shrink(new_active)

  def active_workers(self):
    return self.eng.active_workers()


def make_engine(params, step_cache, n: int, inputs):
  active = CHAIN[len(CHAIN) - n:]  # StepCache meshes are tails of the chain
  spec = step_cache.spec
  placement = ExpertPlacement.initial(TINY.num_experts, active, spec.expert_slots,
                                      num_workers=len(CHAIN))
  eng = engine_lib.Engine(spec, params, jax.devices(), active, placement, seed=7, epoch=2,
                          step_cache=step_cache)
  eng.add_sequences(inputs)
  return eng, active


def rollout(params, step_cache, n, seqs, inputs, queues, steps_per_dispatch=4):
  eng, active = make_engine(params, step_cache, n, inputs)
  assert sorted(queues) == active
  rec = Recorder(eng)
  policy = release_policy.ReleasePolicy(enabled=False, floor=n)
  record = controller.run(seqs, queues, rec, policy, steps_per_dispatch=steps_per_dispatch,
                          slots_per_worker=SLOTS)
  return eng, rec, record


def _by_key(seqs, eng):
  return {(s.prompt_id, s.sample): eng.outputs[s.seq_id] for s in seqs}


# ----------------------------------------------------------------------------- 4. placement-free


def test_responses_identical_whatever_worker_slot_company_and_mesh(params, step_cache):
  """24 sequences (12 prompts x 2 samples, random prompt lengths and limits, EOS on), sampled at
  temperature 1.0, top_p 0.9, three times: (A) 8 workers, static placement in input order;
  (B) 8 workers, dealt round-robin in reverse worker order, so every sequence runs on another
  worker beside other sequences (worker 0's sequences move to 7 and 7's to 0); (C) 4 workers, a
  random permutation (6 sequences per worker: some wait in the queue and start in a slot freed
  by another). Tokens and log-probs per (prompt_id, sample) are identical, exactly."""
  seqs, inputs = make_seqs(12, 2, seed=40)
  ids = [s.seq_id for s in seqs]
  q_a = scheduler.static_placement(seqs, CHAIN)
  q_b = {w: [i for i in ids if 7 - i % 8 == w] for w in CHAIN}  # reversed round-robin
  perm = np.random.default_rng(41).permutation(ids)
  q_c = {w: [int(q) for q in perm[i::4]] for i, w in enumerate(CHAIN[4:])}

  eng_a, _, rec_a = rollout(params, step_cache, 8, seqs, inputs, q_a)
  eng_b, _, rec_b = rollout(params, step_cache, 8, seqs, inputs, q_b)
  eng_c, _, rec_c = rollout(params, step_cache, 4, seqs, inputs, q_c)
  out_a, out_b, out_c = (_by_key(seqs, e) for e in (eng_a, eng_b, eng_c))

  # The runs really differ in placement: worker 0 <-> 7, slot 0 <-> 3, and company.
  def where(o):
    return {k: (v.worker, v.slot) for k, v in o.items()}
  wa, wb, wc = where(out_a), where(out_b), where(out_c)
  moved = [k for k in wa if wa[k] != wb[k]]
  assert len(moved) == len(wa)
  assert any(wa[k][0] == 0 and wb[k][0] == 7 for k in wa)
  assert any(wa[k][0] == 7 and wb[k][0] == 0 for k in wa)
  assert any(wa[k][1] == 0 and wb[k][1] != 0 for k in wa)
  # Slot 0 in one run, the last slot in another: a queued sequence took a freed slot.
  assert any(wa[k][1] == 0 and wc[k][1] == SLOTS - 1 for k in wa)
  def company(rec):
    return {f.seq_id: f.worker for f in rec.finishes.values()}
  ca, cb = company(rec_a), company(rec_b)
  def pairs(c):
    return {frozenset((a, b)) for a in c for b in c if a < b and c[a] == c[b]}
  assert pairs(ca) != pairs(cb)

  lengths = [len(o.tokens) for o in out_a.values()]
  assert len(set(lengths)) > 3  # varied lengths: slots free at different steps
  for k, a in out_a.items():
    for other in (out_b[k], out_c[k]):
      assert other.tokens == a.tokens, k
      assert other.logprobs == a.logprobs, k  # exact float equality
      assert other.finish_reason == a.finish_reason
    assert len(a.tokens) == len(a.logprobs) >= 1
    assert all(0 <= t < TINY.vocab_size for t in a.tokens)
    assert all(np.isfinite(a.logprobs)) and max(a.logprobs) <= 0.0
  # Sampling is real: not every token is the argmax path (some log-probs well below 0) and the
  # two samples of a prompt differ.
  assert min(min(o.logprobs) for o in out_a.values()) < -2.0
  assert any(out_a[(f"p{p}", 0)].tokens != out_a[(f"p{p}", 1)].tokens for p in range(12))


# ----------------------------------------------------------------------------- 5. batching


def test_continuous_batching_and_no_compile_after_warm_up(params, step_cache):
  """4 workers x 2 slots, 16 sequences queued per worker. From the controller's timeline (the
  i-th prefill step record <-> the i-th prefill call): on every worker some queued sequence is
  prefilled before the last of its first 4 sequences finishes, i.e. slots refill while others
  still decode. And no compilation at all happens inside controller.run once the Engine (and
  its StepSets) exist: jax_log_compiles messages and jax.monitoring compile events both zero."""
  n = 4
  seqs, inputs = make_seqs(32, 2, seed=50)  # 64 sequences
  active = CHAIN[len(CHAIN) - n:]
  queues = scheduler.static_placement(seqs, active)
  assert all(len(q) == 16 for q in queues.values())
  # Warm-up: build the engine (compiles or loads its step set; also warm its first calls).
  eng, _ = make_engine(params, step_cache, n, inputs)
  rec = Recorder(eng)
  policy = release_policy.ReleasePolicy(enabled=False, floor=n)
  with CompileCounter() as cc:
    record = controller.run(seqs, queues, rec, policy, steps_per_dispatch=4,
                            slots_per_worker=SLOTS)
  assert cc.count == 0, f"compiles during the rollout: {cc.messages[:5]} {cc.events[:5]}"
  assert len(eng.outputs) == len(seqs)

  tl = record.timeline
  pre_steps = [r["start"] for r in tl.steps if r["kind"] == "prefill"]
  assert len(pre_steps) == len(rec.prefills)
  prefill_step = {sid: st for st, assign in zip(pre_steps, rec.prefills, strict=True)
                  for _, _, sid in assign}
  finish_step = {f["seq_id"]: f["step"] for f in tl.finishes}
  assert set(prefill_step) == set(finish_step) == {s.seq_id for s in seqs}
  for w in active:
    first, queued = queues[w][:SLOTS], queues[w][SLOTS:]
    assert all(record.prefill_worker[q] == w for q in queues[w])
    last_first = max(finish_step[q] for q in first)
    early = [q for q in queued if prefill_step[q] < last_first]
    assert early, f"worker {w}: no queued sequence started before step {last_first}"
    # Slots were reused: 16 sequences went through every slot.
    assert len({eng.outputs[q].slot for q in queues[w]}) == SLOTS
  # The controller's timeline counts the decode steps the device program reports it ran.
  decode_records = [r for r in tl.steps if r["kind"] == "decode"]
  assert sum(r["num_steps"] for r in decode_records) == sum(rec.decode_steps) > 0


def test_compile_counter_sees_compiles():
  """The counter used above is not blind: a fresh jit function compiles and is counted."""
  x = np.arange(7, dtype=np.float32)
  with CompileCounter() as cc:
    jax.jit(lambda a: a * 3.0 + 1.0)(x).block_until_ready()
  assert cc.count > 0 and cc.messages
