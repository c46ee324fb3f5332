#!/usr/bin/env bash
# One prepared check for a lent GPU machine (one GPU; about 9 minutes; README "Device check"):
#   1. environment: nvidia-smi, jax / jaxlib / flax versions, jax.devices()
#   2. tests/kernels/test_kernels_gpu.py: the compiled Mosaic GPU grouped matmul against XLA and float64,
#      the Pallas Triton permute and combine against XLA
#   3. the rollout end to end with each family's tiny preset (configs/mixtral.py, qwen3_moe.py,
#      gpt_oss.py), greedy, on the GPU (the kernels 'auto' picks there, matmuls in full fp32)
#      against the same run on the CPU (one device; all six runs at once): equal responses and
#      tokens, the largest log-prob difference -> e2e.txt
#   4. scripts/step_table.py: decode-step times of a few Qwen3-30B-A3B-shaped layers
#      (STEP_TABLE_MODEL) by experts held per device, batch and KV length -> step_table.json
#      (python -m flexfloor_jax.sim --hardware=measured:step_table.json), plus copy / matmul
#      ceilings and the Pallas kernels as a variant
#   5. tests/kernels/test_kernels.py and tests/engine/test_ep.py on the GPU (TF32 off): parity tests that need
#      more devices than the machine has skip themselves (tests/engine_utils.py), listed as skipped
#   6. python -m flexfloor_jax.kernels.bench (f32 as in the README, then bf16 Mixtral-shaped, xla vs pallas)
#   7. python -m flexfloor_jax.bench.moe on one GPU (it needs no more devices than --devices)
# Every step has its own time limit and runs even when an earlier one failed; the results go to
# $OUT (default device_check_out/): log.txt (all output), env.txt, pytest.txt, bench.txt,
# e2e.txt and e2e/ (each run's outputs and log), step_table.json, step_table.txt, summary.txt
# (one line per step).
#
#   scripts/device_check.sh              # on the GPU machine, from the repository root
#   scripts/device_check.sh --dry-run    # tiny shapes on CPU: every step in a few minutes
# Environment: OUT (output folder), TOTAL_S (time for everything, default 540 s, dry run 700 s;
# the step table gets what the steps around it leave), STEP_TABLE_MODEL (step_table.py --model,
# default qwen3-30b-a3b; mixtral-8x7b's table is configs/hardware/h200_step_table.json),
# STEP_TABLE_ARGS (extra arguments for step_table.py).
set -u -o pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-device_check_out}
TOTAL_S=${TOTAL_S:-$([ $DRY = 1 ] && echo 700 || echo 540)}
MODEL=${STEP_TABLE_MODEL:-qwen3-30b-a3b}
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
: >"$OUT/summary.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$SECONDS
if [ $DRY = 1 ]; then
  export JAX_PLATFORMS=cpu
fi

left() { echo $((TOTAL_S - (SECONDS - START))); }

# step NAME LIMIT_S OUTFILE CMD...: run with a time limit, output to OUTFILE and log.txt
step() {
  local name=$1 limit=$2 file=$3
  shift 3
  if [ "$limit" -lt 5 ]; then
    echo "$name: skipped (no time left)" | tee -a "$OUT/summary.txt" "$LOG"
    return
  fi
  echo "=== $name (limit ${limit}s, at $((SECONDS - START))s): $*" | tee -a "$LOG" "$file"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG" "$file"
  local rc=$?
  local tail
  tail=$(grep -v -E '^(=== [a-z0-9_]+ \(limit|\s*$)' "$file" | tail -1 | cut -c1-160)
  echo "$name: rc=$rc in $((SECONDS - t0))s${tail:+ -- $tail}" | tee -a "$OUT/summary.txt" "$LOG"
}

# 1. environment
{
  echo "date: $(date -u +%FT%TZ)  dry_run: $DRY  host: $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  $PY -c "import jax, jaxlib, flax, numpy; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'flax', flax.__version__, 'numpy', numpy.__version__); print(jax.devices())"
  $PY -c "import ml_collections" 2>&1 | tail -1
  git log --oneline -1 2>/dev/null
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$LOG"

TIMEOUT_FLAG=""
$PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT_FLAG="--timeout=120"
PYTEST=($PY -P -m pytest -q -rfEs -p no:cacheprovider $TIMEOUT_FLAG)
# tests/conftest.py sets the suite's XLA:CPU flags only when XLA_FLAGS is unset: keep them off the
# device's (possibly newer) XLA, which aborts on a flag it does not know.
export XLA_FLAGS="${XLA_FLAGS:-}"

# 2. compiled Mosaic GPU kernels (skip on CPU)
step gpu_kernel_tests 120 "$OUT/pytest.txt" "${PYTEST[@]}" -v tests/kernels/test_kernels_gpu.py

# 3. greedy rollouts of each family's tiny preset, all six processes at once (compiling is
# most of a tiny run: the host's cores share it; the device runs share the GPU, so none
# preallocates its memory). On the dry run the "device" run is 8 emulated CPU devices against
# the reference's one: bitwise the same tokens (placement invariance), so any difference fails;
# on a GPU a difference is reported with the position it starts at.
mkdir -p "$OUT/e2e"
step e2e_rollouts $([ $DRY = 1 ] && echo 300 || echo 150) "$OUT/e2e.txt" $PY - "$OUT/e2e" $DRY <<'PY'
import json, os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
out, dry = sys.argv[1], sys.argv[2] == "1"
args = ["--config.sampling.temperature=0", "--config.schedule=static",
        "--config.rollout.num_prompts=2", "--config.rollout.samples_per_prompt=2",
        "--config.rollout.max_new_tokens=16"]
fams = ("mixtral", "qwen3_moe", "gpt_oss")

def rollout(fam, tag, env, extra):
  d = f"{out}/{fam}.{tag}"
  with open(d + ".log", "w") as log:
    rc = subprocess.call([sys.executable, "-m", "flexfloor_jax.rollout", f"--config=configs/{fam}.py",
                          *args, *extra, f"--config.rollout.output_dir={d}"],
                         env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
  return {json.dumps([r["prompt_id"], r["sample"]]): r for r in map(json.loads,
          open(f"{d}/responses.jsonl"))} if rc == 0 else rc

with ThreadPoolExecutor(2 * len(fams)) as pool:
  ref = {f: pool.submit(rollout, f, "cpu", {"JAX_PLATFORMS": "cpu"},
                        ["--config.mesh.cpu_devices=1"]) for f in fams}
  dev = {f: pool.submit(rollout, f, "device", {"JAX_DEFAULT_MATMUL_PRECISION": "highest",
                                               "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, [])
         for f in fams}
  ref, dev = ({f: x.result() for f, x in d.items()} for d in (ref, dev))
bad = 0
for f in fams:
  a, b = dev[f], ref[f]
  if not isinstance(a, dict) or not isinstance(b, dict):
    print(f"{f}: rollout failed (device rc {a if isinstance(a, int) else 0}, cpu rc "
          f"{b if isinstance(b, int) else 0}; see {out}/{f}.*.log)")
    bad = 1
    continue
  same = sum(a[k]["tokens"] == b[k]["tokens"] for k in b)
  toks = sum(len(b[k]["tokens"]) for k in b)
  eq = sum(x == y for k in b for x, y in zip(a[k]["tokens"], b[k]["tokens"]))
  first = min((next((i for i, (x, y) in enumerate(zip(a[k]["tokens"], b[k]["tokens"])) if x != y),
                    len(b[k]["tokens"])) for k in b), default=0)
  lp = max((abs(x - y) for k in b for x, y in zip(a[k]["logprobs"], b[k]["logprobs"])), default=0)
  where = "no token differs" if eq == toks else f"the first difference at token {first}"
  print(f"{f}: {same}/{len(b)} responses equal, {eq}/{toks} tokens at the same positions, "
        f"{where}, largest |logprob difference| {lp:.2e}")
  bad |= (same != len(b) or len(a) != len(b)) and (2 if dry else 3)
sys.exit(bad)
PY

# 4. step table: what the steps after it need is kept back (parity tests 120 s, benches 90 s).
# The table is the XLA path (tile 8, the engine's decode settings with moe_backend='xla', as the
# H200 Mixtral table); the Pallas kernels that moe_backend='auto' runs on a GPU are a variant.
if [ $DRY = 1 ]; then
  ST_ARGS=(--dry_run --model=$MODEL --compile_threads=2 --experts=2,16 --variant="pallas:8:64:8")
  REST=200
else
  ST_ARGS=(--model=$MODEL --compile_threads=16 --experts=16,32,128 --batches=8,32,128
           --variant="pallas:8:64:8|32")
  REST=210
fi
ST_LIMIT=$(( $(left) - REST ))
step step_table $ST_LIMIT "$OUT/step_table.txt" $PY scripts/step_table.py \
  --out="$OUT/step_table.json" --ceilings --budget_s=$(( ST_LIMIT > 80 ? ST_LIMIT - 40 : 40 )) \
  "${ST_ARGS[@]}" ${STEP_TABLE_ARGS:-}

# 5. parity tests on the GPU (on CPU: one emulated device, as on a one-GPU machine); -v: a test
# cut off by the time limit still leaves the results of the ones before it
if [ $DRY = 1 ]; then
  step parity_tests 100 "$OUT/pytest.txt" \
    env XLA_FLAGS=--xla_force_host_platform_device_count=1 "${PYTEST[@]}" -v tests/engine/test_ep.py \
    tests/kernels/test_kernels.py -k \
    "forward_equals or comes_back_once or bitwise_across or padded_rows or batch_invariance"
else
  step parity_tests 120 "$OUT/pytest.txt" env JAX_DEFAULT_MATMUL_PRECISION=highest \
    "${PYTEST[@]}" -v tests/kernels/test_kernels.py tests/engine/test_ep.py
fi

# 6. flexfloor_jax.kernels.bench: f32 at the README's shape, then bf16 at Mixtral's expert shape, xla vs pallas
if [ $DRY = 1 ]; then
  step kernels_bench 40 "$OUT/bench.txt" $PY -m flexfloor_jax.kernels.bench --runs 3
  step kernels_bench_bf16 40 "$OUT/bench.txt" $PY -m flexfloor_jax.kernels.bench --runs 3 --dtype bfloat16 \
    --impl pallas --k 256 --n 512 --tile_m 128
else
  step kernels_bench 20 "$OUT/bench.txt" $PY -m flexfloor_jax.kernels.bench --runs 20
  step kernels_bench_bf16_xla 20 "$OUT/bench.txt" $PY -m flexfloor_jax.kernels.bench --runs 10 \
    --dtype bfloat16 --impl xla --k 4096 --n 14336 --tile_m 64 128
  step kernels_bench_bf16_pallas 20 "$OUT/bench.txt" $PY -m flexfloor_jax.kernels.bench --runs 10 \
    --dtype bfloat16 --impl pallas --k 4096 --n 14336 --tile_m 64 128
fi

# 7. moe_bench on one device (the README's 4096 tokens, D=256 F=512; needs only --devices devices)
L6=$(( $(left) - 3 ))
step moe_bench $(( L6 < 30 ? L6 : 30 )) "$OUT/bench.txt" $PY -m flexfloor_jax.bench.moe \
  --devices=1 --tokens_per_worker=$([ $DRY = 1 ] && echo 256 || echo 4096) --runs=10

echo "=== done in $((SECONDS - START))s" | tee -a "$LOG"
cat "$OUT/summary.txt"
