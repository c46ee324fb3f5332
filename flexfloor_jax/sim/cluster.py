"""A rollout on a cluster of EP groups: static vs balanced vs FlexFloor on the roofline, and the
RL step that follows the rollout.

D devices run as D/ep expert-parallel groups (dp x ep, ep <= E), each group serving its own
share of the batch (verl's data-parallel split), each group the size of a layout someone would
run (8 workers for Mixtral's 8 experts). Within a group the runner's policy releases workers down
to the group's memory floor, deciding on the roofline's step seconds (the time-aware floor);
across groups a group is released as a whole when its last sequence is done, while the static
baseline holds every device until the batch's last response (synchronous rollout). Moving
sequences between groups is not modelled.

Chunked prefill (`prefill_chunk` C > 0): every run, the schedules and the oracles alike, admits
by the controller's chunked contract, each step taking `costs.admission_chunk` input tokens per
worker (at most C: the most a step takes before its roofline seconds grow by a tenth over the
decode step). What decides the runs keeps its one-shot prefill terms: the cross-group split
(`group_split`: a prefill step's lanes per sequence, and its seconds estimate simulating one-shot
prefill) and the in-group placement and release estimates (policy.scheduler, policy.plan); only
FlexFloor's floor choice replays its candidates chunked, as the runs go.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import sys
from typing import Any

import numpy as np

from flexfloor_jax.policy import (
  costs,
  plan,
  prediction,
  release_policy,
  scheduler,
  stepsim,
  workload,
)
from flexfloor_jax.policy.controller import Seq
from flexfloor_jax.policy.floor import FloorError, expert_slots, floor_workers
from flexfloor_jax.policy.floor import release_sizes as allowed_sizes
from flexfloor_jax.policy.history import LengthHistory
from flexfloor_jax.policy.pages import PagePool, equal_budget_pages, pages_for, pool_pages
from flexfloor_jax.sim import bounds, reuse
from flexfloor_jax.sim.costs import RooflineCost, RooflineStepCost
from flexfloor_jax.sim.presets import Hardware, Model
from flexfloor_jax.sim.replay import replay


def floor_for(model: Model, hw: Hardware, ep: int, slots_per_worker: int,
              max_seq_len: int) -> int:
  kv = slots_per_worker * model.kv_bytes(max_seq_len)
  return floor_workers(model.experts, model.expert_bytes, model.nonexpert_bytes, kv,
                       int(hw.hbm_bytes), ep)


class GroupTooSmall(FloorError):
  """An EP group of `ep` workers cannot hold the model: its memory floor (`floor`, None where no
  group of up to one worker per expert holds it) is larger."""

  def __init__(self, message: str, ep: int, floor: int | None):
    super().__init__(message)
    self.ep, self.floor = ep, floor


def group_floor(model: Model, hw: Hardware, ep: int, slots_per_worker: int,
                max_seq_len: int) -> int:
  """`floor_for` of a group of `ep` workers; GroupTooSmall (one line: the floor and what a worker
  holds at it) where the group cannot hold the model."""
  try:
    return floor_for(model, hw, ep, slots_per_worker, max_seq_len)
  except FloorError:
    pass
  kv = slots_per_worker * model.kv_bytes(max_seq_len)
  try:
    n = floor_for(model, hw, model.experts, slots_per_worker, max_seq_len)
  except FloorError as e:
    raise GroupTooSmall(f"an EP group of {ep} workers cannot hold {model.name} on {hw.name}, nor "
                        f"can any group of up to one worker per expert ({e})", ep, None) from None
  gib = 2.0**30
  raise GroupTooSmall(
      f"an EP group of {ep} workers cannot hold {model.name} on {hw.name}: its memory floor is "
      f"{n} workers (each: non-expert {model.nonexpert_bytes / gib:.2f} GiB + "
      f"{expert_slots(model.experts, n)} of {model.experts} experts x "
      f"{model.expert_bytes / gib:.2f} GiB + KV {kv / gib:.2f} GiB of {slots_per_worker} slots x "
      f"{max_seq_len} tokens, on {hw.hbm_bytes / gib:.2f} GiB)", ep, n)


def _cluster_metrics(groups: list[dict], hold_to_end: bool) -> dict:
  """Metrics of the whole cluster (seconds) from each group's worker timeline."""
  end = max(g["metrics"]["generation_wall_s"] for g in groups)
  occ = idle = 0.0
  tokens = sum(g["metrics"]["generated_tokens"] for g in groups)
  ds = sum(g["metrics"]["device_steps"] for g in groups)
  for g in groups:
    for w in g["metrics"]["workers"]:
      rel = end if hold_to_end else w["release_s"]
      occ += rel
      idle += rel - w["local_finish_s"]
  n = sum(len(g["metrics"]["workers"]) for g in groups)
  # devices: those of groups that got work (the others go before the first step)
  return dict(devices=n, generated_tokens=tokens, device_steps=ds,
              occupied_device_seconds=occ,
              tokens_per_occupied_device_second=tokens / occ if occ else 0.0,
              idle_after_finish_fraction_seconds=idle / occ if occ else 0.0,
              generation_wall_s=end, throughput_tokens_per_s=tokens / end if end else 0.0,
              worker_releases=sum(g["metrics"]["num_worker_releases"] for g in groups),
      prefill_only_steps_while_decoding=sum(
          g["metrics"]["prefill_only_steps_while_decoding"] for g in groups))


def _group_job(job):
  """One EP group's rollout (a top-level function: it runs in worker processes)."""
  (sched, gs, hist, ep, B, floor, model, hw, spd, epoch, sizes, slack, ctx, placement,
   chunk) = job[:15]
  kv = None
  if len(job) > 15:  # paged KV: (pages per worker, page size, margin); B is max_seqs
    num_pages, page_size, margin = job[15]

    width = max(pages_for(s.prompt_len + s.max_new_tokens, page_size) for s in gs)

    def make_pool(pred):
      return PagePool(ep, num_pages, page_size, B, min(width, num_pages), predicted=pred,
                      margin=margin, page_ids=False)

    kv = make_pool
  m, rec = replay(gs, None, hist, sched, ep, B, floor, cost=RooflineCost(model, hw), model=model,
                  steps_per_dispatch=spd, epoch=epoch, sizes=sizes, makespan_slack=slack,
                  policy_cost=RooflineStepCost(model, hw, ctx), placement=placement, kv=kv,
                  prefill_chunk=chunk)
  pool = m.pop("kv", None)
  rel = m.pop("releases", [])
  m["num_worker_releases"] = sum(len(r["workers"]) for r in rel if not r["final"])
  # for the RL step model: when each response finished, its tokens, when workers were released
  tl = rec.timeline
  m["finish_s"] = [tl.step_end_time(f["step"] + 1) - tl.t_start for f in tl.finishes]
  m["finish_tokens"] = [gs[f["seq_id"]].prompt_len + f["num_tokens"] for f in tl.finishes]
  if pool is not None:
    m["preemptions"], m["peak_pages"] = pool["preemptions"], pool["peak_pages"]
  return m


def rl_step_seconds(groups: list[dict], model: Model, hw: Hardware, floor: int,
                    released: bool) -> dict:
  """An RL step on the cluster (roofline): generation, old log-probs of every response (a
  compute-bound forward), update (~3 forwards: forward + backward); with `released`, the
  workers released during generation score finished responses meanwhile (sim/reuse.py), in
  groups of `floor` devices (the fewest that hold the model)."""
  active = model.nonexpert_params + model.top_k * model.expert_params
  spt = 2.0 * active / hw.peak_flops
  gen = max(g["generation_wall_s"] for g in groups)
  n = sum(len(g["workers"]) for g in groups)
  lp = reuse.logprob_phase_seconds(
      [t for g in groups for t in g["finish_s"]], [k for g in groups for k in g["finish_tokens"]],
      [w["release_s"] for g in groups for w in g["workers"]] if released else [], gen, n, spt,
      group=floor)
  update = 3.0 * lp["without"]
  return dict(gen_s=gen, logprob_s=lp["with"], update_s=update,
              step_s=gen + lp["with"] + update, scored_during_generation=lp["scored_early"])


def group_split(seqs: list[Seq], schedule: str, history, groups: int, lanes: int, ep: int,
                slack: float = 0.05, *, num_scenarios: int = 8, num_candidates: int = 16,
                seed: int = 0, cost=None, steps_per_dispatch: int = 8) -> list[list[int]]:
  """Which sequences each EP group serves (indices into `seqs`).
  static: verl's contiguous data-parallel chunks. balanced: longest predicted first onto the group
  whose list-scheduled finish (over its ep x slots lanes) grows least. flexfloor: packed from the
  last group backwards, longest first, each group's lanes up to a cap, so the first groups get
  the short work (or none), finish early and are released whole. The cap is chosen like the
  in-group placement's (scheduler.flexfloor_placement): over length scenarios drawn from the
  history, the largest packing whose mean makespan stays within `slack` of the balanced split's
  and that holds the fewest group-seconds (a group is held until its last response).
  cost (a policy.costs.StepCost): a group's finish is also judged in seconds, its run on the
  predicted lengths simulated on the cost model (a packed group runs more rows per worker, each
  step reading more KV: in steps packing is free, in seconds it is not), and the split held for
  the fewest group-seconds among those on time in both units; without, in lane-steps."""
  if schedule == "static":
    return [list(map(int, g)) for g in np.array_split(np.arange(len(seqs)), groups)]
  # a group admits one sequence per worker per prefill step and every lane waits for it: each
  # sequence costs its group's lanes lanes/ep = slots-per-worker lane-steps on top of its length
  prefill = lanes / ep
  pred = prediction.predict(history, seqs, quantile=0.9) + prefill
  idx = [dataclasses.replace(s, seq_id=i) for i, s in enumerate(seqs)]
  bal = scheduler.balanced_placement(idx, pred, list(range(groups)), lanes)
  if schedule == "balanced":
    return [bal[g] for g in range(groups)]
  worlds = ([np.array([d[i] for i in range(len(seqs))], float) + prefill
             for d in prediction.sample_scenarios(history, idx, pred, num_scenarios, seed)]
            if len(history) else [pred])
  slots = max(1, lanes // ep)
  group_s: dict[tuple[int, ...], float] = {}

  def seconds_of(q) -> float:
    """Seconds of a group running the sequences q to their predicted ends: its balanced placement
    on ep workers, simulated on `cost` (a packed group's steps run more rows per worker)."""
    key = tuple(q)
    if key not in group_s:
      sub = [dataclasses.replace(seqs[i], seq_id=j) for j, i in enumerate(q)]
      lengths = {j: int(max(1, round(float(pred[i]) - prefill))) for j, i in enumerate(q)}
      queues = scheduler.balanced_placement(sub, [lengths[j] for j in range(len(q))],
                                            list(range(ep)), slots)
      pol = release_policy.ReleasePolicy(enabled=True, floor=ep, chain=list(range(ep)),
                                         predicted=lengths, shared_queue=True, compaction=False,
                                         swap=False)
      group_s[key] = stepsim.simulate(sub, lengths, queues, pol, ep, slots, steps_per_dispatch,
                                      cost=cost)["makespan_s"]
    return group_s[key]

  def finishes(split):
    """[unit, scenario, group] finish of a split in lane-steps and in seconds (lane-steps again
    without `cost`); queues in split order."""
    steps = np.array([[release_policy.list_schedule_finish([], list(L[q]), lanes) if q else 0.0
                       for q in split] for L in worlds])
    if cost is None:
      return np.stack([steps, steps])
    # seconds: each group's run on the point predictions, scaled by the scenario's lane-steps
    point = np.array([release_policy.list_schedule_finish([], list(pred[q]), lanes) if q else 1.0
                      for q in split])
    secs = np.array([seconds_of(q) if q else 0.0 for q in split])
    return np.stack([steps, steps * (secs / point)])

  bal_split = [bal[g] for g in range(groups)]
  # on time in both units: the seconds estimate prices rows, the lane-steps keep the makespan
  # guard that a mean-rows step time would loosen
  budget = finishes(bal_split).max(axis=2) * (1.0 + slack)  # [unit, scenario]
  order = sorted(range(len(seqs)), key=lambda i: (-pred[i], i))
  lo = float(pred.sum()) / (groups * lanes)
  hi = max(release_policy.list_schedule_finish([], [pred[i] for i in q], lanes) for q in bal_split)
  best = (float(finishes(bal_split)[1].sum(axis=1).mean()), bal_split)  # balanced: on time
  for cap in np.linspace(lo, max(lo, hi) * (1.0 + slack), num_candidates):
    packed = scheduler._pack(order, pred, list(range(groups)), lanes, float(cap))
    split = [packed[g] for g in range(groups)]
    fin = finishes(split)
    held = float(fin[1].sum(axis=1).mean())  # group-seconds (a group held to its last response)
    if (fin.max(axis=2) <= budget).all() and held < best[0]:
      best = (held, split)
  return best[1]


def _kv_summary(paged: dict, max_seqs: int, groups_of, floor_choice) -> dict:
  """Paged KV: per schedule its pool (pages of a worker), preemptions and the peak pages of a
  worker; FlexFloor's floor choice (choose_floor) where the pools come from device memory."""
  out: dict[str, Any] = dict(page_size=paged["static"][1], max_seqs=max_seqs,
                             margin=paged["static"][2], num_pages=paged["static"][0])
  for label in RUNS:
    g = groups_of(label)
    out[label] = dict(num_pages=paged[label.removeprefix("oracle_")][0],
                      preemptions=sum(m["preemptions"] for m in g),
                      peak_pages=max((m["peak_pages"] for m in g), default=0))
  if floor_choice is not None:
    out["floor_choice"] = floor_choice
  return out


# the oracle runs: the same policy told every response's actual length
RUNS = plan.SCHEDULES + ("oracle_balanced", "oracle_flexfloor")


DEFAULT_MAX_NUM_SEQS = 64  # --kv=paged on device memory: the compiled row bound per worker
DEFAULT_MEMORY_UTILIZATION = 0.9  # share of a device's memory a run may use (vLLM's default)


def kv_pages(model: Model, hw: Hardware, expert_slots: int, workspace: int, page_size: int,
             memory_utilization: float) -> int:
  """Pages of one worker's pool on device memory: the usable share of the device less its
  resident weights (non-expert + `expert_slots` experts) and `workspace`."""
  return pool_pages(int(hw.hbm_bytes * memory_utilization),
                    model.nonexpert_bytes + expert_slots * model.expert_bytes, workspace,
                    model.kv_bytes_per_token, page_size)


def choose_floor(model: Model, hw: Hardware, ep: int, probe: list[Seq], history, *, page_size: int,
                 max_seqs: int, margin: float, memory_utilization: float, max_seq_len: int,
                 steps_per_dispatch: int, epoch: int, slack: float, ctx: float,
                 prefill_chunk: int = 0) -> dict:
  """FlexFloor's floor on device memory: a floor of f workers preallocates ceil(E/f) expert slots
  and the move workspace on every device, which leaves fewer KV pages; a small floor releases
  more and holds fewer sequences at once. Each candidate (every feasible size that is a power of
  two, the smallest feasible one and ep) is replayed on the probe group with the predicted lengths
  (never the actual ones) on the roofline, balanced's placement with releases down to it; the
  pick holds the fewest occupied device-seconds among those whose makespan is within `slack` of
  the floor at ep (no release: balanced's memory) and whose makespan x device-seconds is no
  more than the floor at ep's. prefill_chunk: the runs' chunked prefill (0 = one-shot).
  Returns the pick, its pages and every candidate's terms."""
  row = model.kv_bytes(max_seq_len)
  workspace = 2 * model.expert_bytes + 2 * row  # engine.memory.floor_terms: in-flight moves
  pred = prediction.predict(history, probe)
  guess = [dataclasses.replace(s, target_len=int(max(1, min(round(p), s.max_new_tokens))))
           for s, p in zip(probe, pred, strict=True)]
  feasible = [f for f in range(1, ep + 1)
              if kv_pages(model, hw, expert_slots(model.experts, f), workspace, page_size,
                          memory_utilization) * page_size >= max_seq_len]
  if not feasible:
    raise FloorError(f"{model.name} leaves no room for one sequence of {max_seq_len} tokens on "
                     f"{ep} x {hw.name}")
  cands = sorted({feasible[0], ep} | {f for f in feasible if f & (f - 1) == 0})
  rows = []
  for f in cands:
    pages = kv_pages(model, hw, expert_slots(model.experts, f), workspace if f < ep else 0,
                     page_size, memory_utilization)
    # balanced's placement with release: a floor is judged by what releasing to it saves, not
    # by a placement search per candidate (each search simulates hundreds of rollouts)
    m = _group_job(("flexfloor", guess, history, ep, max_seqs, f, model, hw, steps_per_dispatch,
                    epoch, None, slack, ctx, "balanced", prefill_chunk,
                    (pages, page_size, margin)))
    rows.append(dict(floor=f, expert_slots=expert_slots(model.experts, f), pages=pages,
                     workspace_bytes=workspace if f < ep else 0,
                     predicted_makespan_s=m["generation_wall_s"],
                     predicted_occupied_device_seconds=m["occupied_device_seconds"]))
  pick = pick_floor(rows, slack)
  return dict(floor=pick["floor"], pages=pick["pages"], candidates=rows)


# the least share of the full group's predicted device-seconds a smaller floor must save
FLOOR_MIN_SAVING = 0.01


def pick_floor(rows: list[dict], slack: float) -> dict:
  """The floor choice's rule over candidates (floor, predicted_makespan_s,
  predicted_occupied_device_seconds; the last one the full group, which never releases): the
  fewest occupied device-seconds among those within `slack` of the full group's makespan that
  also save at least the share of device-seconds they cost in makespan (never 4% of throughput
  for 1% of device time); ties to the larger floor. A smaller floor must save at least
  FLOOR_MIN_SAVING of the full group's device-seconds: the prediction runs on predicted lengths,
  and a saving below its error buys a pool with fewer pages and releases whose makespan rests on
  lengths the tail may exceed (Qwen3-30B-A3B on H100, long responses, one seed: 0.01% predicted,
  26% later in the run)."""
  ms_ep, occ_ep = rows[-1]["predicted_makespan_s"], rows[-1]["predicted_occupied_device_seconds"]
  ok = [rows[-1]] + [
      r for r in rows[:-1] if r["predicted_makespan_s"] <= (1.0 + slack) * ms_ep
      and r["predicted_makespan_s"] * r["predicted_occupied_device_seconds"]
      <= ms_ep * occ_ep * (1 + 1e-12)
      and r["predicted_occupied_device_seconds"] <= (1.0 - FLOOR_MIN_SAVING) * occ_ep]
  return min(ok, key=lambda r: (r["predicted_occupied_device_seconds"], -r["floor"]))


# The response lengths of a GRPO run of configs/grpo.py (real EOS), how it was made in its
# "source" field: the `grpo_trace` workload.
GRPO_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces", "grpo_tiny.json")


def simulate_cluster(model: Model, hw: Hardware, devices: int, *, ep: int = 0,
                     slots_per_worker: int = workload.DEFAULT_SLOTS_PER_WORKER,
                     seqs_per_device: int = 8, samples_per_prompt: int = 8,
                     length_scale: float = 8.0, prompt_len: int = 256, epochs: int = 3,
                     steps_per_dispatch: int = 0, seed: int = 0,
                     processes: int | None = None, release_sizes: str = "",
                     makespan_slack: float = 0.05, kv: str = "slots",
                     page_size: int = 0,
                     max_seqs: int = 0, kv_margin: float = 0.0, kv_memory: str = "device",
                     memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
                     workload_name: str = "default", check_only: bool = False,
                     prefill_chunk: int = 0) -> dict:
  """Static vs balanced vs FlexFloor on `devices` devices (dp groups of ep workers) at epoch
  `epochs - 1`, the length history of the epochs before it (workload lengths) driving the
  scheduler. The workload is policy.workload's, scaled: seqs_per_device sequences per device
  (the default rollout: 64 on 8 workers), median and cap x length_scale (cap = max_new_tokens);
  workload_name='long_reasoning' replaces it (and prompt_len, epochs) with
  workload.LONG_REASONING; 'grpo_trace' with the lengths of GRPO_TRACE (workload.trace_rollout:
  one copy of its prompts per 8 devices; the seed picks the epoch, 0 = its last).
  steps_per_dispatch 0 = the default rollout's 8 steps per 64 tokens of median response: the same
  host-check granularity relative to response length (finishes and refills stop a dispatch at the
  exact step anyway).
  Across groups: `group_split`; inside a group, the runner's own policy (plan_rollout), its
  placement and release policy deciding on the roofline (RooflineStepCost) and `release_sizes`.
  processes: worker processes for the groups (default: all cores; 1 = in this process).
  kv='paged': each worker's KV is a pool of pages of `page_size` tokens (required there), at
  most `max_seqs` sequences per worker, admission on predictions x (1 + kv_margin), the
  youngest preempted when a pool runs out (policy/pages.py); max_seqs then takes the place of
  slots_per_worker in the placements. The pool's bytes: kv_memory='device' (equal device
  memory): what `memory_utilization` of the device leaves beside each schedule's own resident
  bytes (static and balanced ceil(E/ep) expert slots; FlexFloor the slots of its floor and the
  move workspace, its floor chosen on the roofline by `choose_floor`); max_seqs 0 =
  DEFAULT_MAX_NUM_SEQS.
  kv_memory='slots': the fixed-slot cache's bytes for every schedule (slots_per_worker rows of
  prompt_len + cap tokens: the same floor); max_seqs 0 = 2 x slots_per_worker.
  prefill_chunk: chunked prefill for every run, at most this many input tokens a step per
  worker (the module doc); 0 = one-shot prefill steps.
  Where the group cannot hold the model (ep below its memory floor) GroupTooSmall, before any
  work; check_only: only these checks, returning devices, ep and the floor."""
  if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 0:
    raise ValueError(f"prefill_chunk must be an integer >= 0, got {prefill_chunk!r}")
  if kv not in ("slots", "paged"):
    raise ValueError(f"kv must be 'slots' or 'paged', got {kv!r}")
  if kv == "paged" and page_size < 1:  # the CLI passes --page_size (rollout.page_size's default)
    raise ValueError(f"kv='paged' needs page_size >= 1, got {page_size}")
  if kv_memory not in ("device", "slots"):
    raise ValueError(f"kv_memory must be 'device' or 'slots', got {kv_memory!r}")
  if workload_name not in workload.WORKLOADS:
    raise ValueError(f"workload must be one of {workload.WORKLOADS}, got {workload_name!r}")
  ep = ep or min(devices, model.experts, 8)
  if ep > model.experts or devices % ep:
    raise ValueError(f"ep={ep} must divide devices={devices} and be <= {model.experts} experts")
  trace_batches = None
  if workload_name == "grpo_trace":
    trace = workload.load_trace(GRPO_TRACE)
    seqs, trace_batches = workload.trace_rollout(trace, max(1, devices // 8), seed)
    prompt_len = max(s.prompt_len for s in seqs)  # the cache holds the longest prompt
    epochs = len(trace_batches) + 1
    spec = workload.WorkloadSpec(
        num_prompts=len(seqs) // trace.samples_per_prompt,
        samples_per_prompt=trace.samples_per_prompt, seed=seed,
        median=float(np.median(list(workload.target_lengths(seqs).values()))),
        cap=trace.max_new_tokens)
  elif workload_name == "long_reasoning":
    spec = workload.long_reasoning_spec(devices, seed)
    prompt_len, epochs = workload.LONG_REASONING.prompt_len, workload.LONG_REASONING.epochs
  else:
    num_prompts = max(1, devices * seqs_per_device // samples_per_prompt)
    spec = workload.WorkloadSpec(num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                                 seed=seed, median=workload.DEFAULT_MEDIAN * length_scale,
                                 cap=int(round(workload.DEFAULT_CAP * length_scale)))
  steps_per_dispatch = steps_per_dispatch or max(
      1, int(round(workload.DEFAULT_STEPS_PER_DISPATCH * spec.median / workload.DEFAULT_MEDIAN)))
  floor = group_floor(model, hw, ep, slots_per_worker, prompt_len + spec.cap)
  if check_only:
    return dict(devices=devices, ep=ep, floor=floor)
  last = epochs - 1
  hist = LengthHistory()
  if trace_batches is None:
    seqs = workload.make_seqs(spec, last, prompt_len=prompt_len)
    trace_batches = {e: workload.make_seqs(spec, e, prompt_len=prompt_len) for e in range(last)}
  for e, prev in trace_batches.items():
    hist.add_rollout(e, prev, workload.target_lengths(prev))
  # mean cached tokens a live sequence reads (decode)
  ctx = float(np.mean([s.prompt_len for s in seqs])) + spec.median / 2
  lanes_per_worker = slots_per_worker
  if kv == "paged":
    lanes_per_worker = max_seqs or (2 * slots_per_worker if kv_memory == "slots"
                                    else DEFAULT_MAX_NUM_SEQS)
  # chunked prefill: the input tokens a step takes, decided on the roofline at a full worker
  chunk = (costs.admission_chunk(RooflineStepCost(model, hw, ctx), prefill_chunk,
                                 lanes_per_worker, ctx, ep) if prefill_chunk else 0)
  paged: dict[str, tuple[int, int, float]] = {}  # schedule -> (pages, page size, margin)
  floors: dict[str, int] = {}
  floor_choice = None
  if kv == "paged":
    if kv_memory == "slots":
      pages = equal_budget_pages(slots_per_worker, prompt_len + spec.cap, page_size)
      paged = dict.fromkeys(plan.SCHEDULES, (pages, page_size, kv_margin))
    else:
      fixed = kv_pages(model, hw, expert_slots(model.experts, ep), 0, page_size,
                       memory_utilization)
      groups = devices // ep
      probe = max(group_split(seqs, "balanced", hist, groups, ep * lanes_per_worker, ep),
                  key=len)
      floor_choice = choose_floor(
          model, hw, ep, [dataclasses.replace(seqs[i], seq_id=j) for j, i in enumerate(probe)],
          hist, page_size=page_size, max_seqs=lanes_per_worker, margin=kv_margin,
          memory_utilization=memory_utilization, max_seq_len=prompt_len + spec.cap,
          steps_per_dispatch=steps_per_dispatch, epoch=last, slack=makespan_slack, ctx=ctx,
          prefill_chunk=chunk)
      floor = floor_choice["floor"]
      paged = {"static": (fixed, page_size, kv_margin), "balanced": (fixed, page_size, kv_margin),
               "flexfloor": (floor_choice["pages"], page_size, kv_margin)}
    floors = dict.fromkeys(("static", "balanced"), ep if kv_memory == "device" else floor)
  sizes = allowed_sizes(release_sizes, ep, floor)
  # the schedules with perfect knowledge (every sequence its own prompt, whose history is its
  # actual length): what the policy and the cost model allow on these lengths. oracle_balanced's
  # makespan bounds the throughput, oracle_flexfloor's device time the tokens per device-second.
  oracle = [dataclasses.replace(s, prompt_id=f"{s.prompt_id}/{s.sample}") for s in seqs]
  known = LengthHistory()
  known.add_rollout(last, oracle, workload.target_lengths(oracle))
  # across groups the split spends the slack (group_split); inside a group of several the
  # placement is balanced's and releases keep to that group's balanced makespan, or the two
  # slacks would compound (a placement made for releasing buys little where a release must pay
  # in roofline seconds)
  inner_slack, inner_placement = (makespan_slack, "auto") if devices == ep else (0.0, "balanced")
  jobs, labels = [], []
  for label in RUNS:
    sched = label.removeprefix("oracle_")
    ss, hh = (oracle, known) if label.startswith("oracle_") else (seqs, hist)
    extra = (paged[sched],) if paged else ()
    for g in group_split(ss, sched, hh, devices // ep, ep * lanes_per_worker, ep,
                         makespan_slack, seed=last, cost=RooflineStepCost(model, hw, ctx),
                         steps_per_dispatch=steps_per_dispatch):
      if not g:  # a group given no work is released before the first step
        continue
      labels.append(label)
      jobs.append((sched, [dataclasses.replace(ss[i], seq_id=j) for j, i in enumerate(g)],
                   hh, ep, lanes_per_worker, floors.get(sched, floor), model, hw,
                   steps_per_dispatch, last, sizes, inner_slack, ctx, inner_placement, chunk)
                  + extra)
  procs = min(processes if processes is not None else (os.cpu_count() or 1), len(jobs))
  if procs > 1:  # one group too: its five runs (the schedules and the oracles) are separate jobs
    mp = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=mp) as pool:
      results = list(pool.map(_group_job, jobs, chunksize=max(1, len(jobs) // (4 * procs))))
  else:
    results = [_group_job(j) for j in jobs]

  def groups_of(label):
    return [m for lb, m in zip(labels, results, strict=True) if lb == label]

  out = {label: _cluster_metrics([dict(metrics=m) for m in groups_of(label)],
                                 hold_to_end=not label.endswith("flexfloor")) for label in RUNS}
  rl = {"static": rl_step_seconds(groups_of("static"), model, hw, floor, released=False),
        "flexfloor": rl_step_seconds(groups_of("flexfloor"), model, hw, floor, released=False),
        "flexfloor_released_logprobs": rl_step_seconds(groups_of("flexfloor"), model, hw, floor,
                                                       released=True)}
  lengths = workload.target_lengths(seqs)
  bound = bounds.lower_bound(
      [lengths[s.seq_id] for s in seqs], [s.prompt_len for s in seqs],
      RooflineStepCost(model, hw, ctx), max_workers=ep, max_seqs=lanes_per_worker,
      min_workers=floor_workers(model.experts, model.expert_bytes, model.nonexpert_bytes, 0,
                                int(hw.hbm_bytes), ep), prefill_chunk=chunk)
  # a bound is a bound: no run, oracle policies included, beats it. Asserted on the roofline,
  # whose steps are monotone in rows and cached tokens (bounds' premises); a measured step table
  # interpolates between measurements and need not be
  for label in RUNS if hw.step_table is None else ():
    m = out[label]
    if (m["generation_wall_s"] < bound["makespan_s"] * (1 - 1e-9)
        or m["occupied_device_seconds"] < bound["occupied_device_seconds"] * (1 - 1e-9)):
      raise AssertionError(f"{label} beats the lower bound: {m['generation_wall_s']} s, "
                           f"{m['occupied_device_seconds']} device-s against {bound}")
  keys = ("tokens_per_occupied_device_second", "throughput_tokens_per_s",
          "occupied_device_seconds", "generation_wall_s")
  s = out["static"]
  ratio = {k: out["flexfloor"][k] / s[k] for k in keys if s[k]}
  ratio_balanced = {k: out["balanced"][k] / s[k] for k in keys if s[k]}
  ratio_oracle = {label: {k: out[label][k] / s[k] for k in keys if s[k]}
                  for label in RUNS if label.startswith("oracle_")}
  return dict(model=model.name, hardware=hw.name, devices=devices, ep=ep, groups=devices // ep,
              floor=floor, epoch=last, workload=dataclasses.asdict(spec), prompt_len=prompt_len,
              slots_per_worker=slots_per_worker, steps_per_dispatch=steps_per_dispatch,
              release_sizes=list(sizes) if sizes else None, makespan_slack=makespan_slack,
              prefill_chunk=prefill_chunk, prefill_chunk_tokens=chunk,
              cost_model=RooflineStepCost(model, hw, ctx).name,
              static=s, balanced=out["balanced"], flexfloor=out["flexfloor"], ratio=ratio,
              ratio_balanced=ratio_balanced, oracle_balanced=out["oracle_balanced"],
              oracle_flexfloor=out["oracle_flexfloor"], ratio_oracle=ratio_oracle,
              ratio_flexfloor_balanced={k: out["flexfloor"][k] / out["balanced"][k]
                                        for k in keys if out["balanced"][k]},
              workload_name=workload_name, bound=bound,
              rl_step=rl, **(dict(kv=_kv_summary(paged, lanes_per_worker, groups_of,
                                                 floor_choice)) if paged else {}))

