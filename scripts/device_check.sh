#!/usr/bin/env bash
# One prepared check for a lent GPU machine (one GPU; about 8 minutes; README "Device check"):
#   1. environment: nvidia-smi, jax / jaxlib / flax versions, jax.devices()
#   2. tests/kernels/test_kernels_gpu.py: the compiled Mosaic GPU grouped matmul against XLA and float64,
#      the Pallas Triton permute and combine against XLA
#   3. scripts/step_table.py: decode-step times of Mixtral-8x7B-shaped layers by experts held per
#      device, batch and KV length -> step_table.json (python -m flexfloor_jax.sim
#      --hardware=measured:step_table.json), plus copy / matmul ceilings and kernel variants
#   4. tests/kernels/test_kernels.py and tests/engine/test_ep.py on the GPU (TF32 off): parity tests that need
#      more devices than the machine has skip themselves (tests/engine_utils.py), listed as skipped
#   5. python -m flexfloor_jax.kernels.bench (f32 as in the README, then bf16 Mixtral-shaped, xla vs pallas)
#   6. python -m flexfloor_jax.bench.moe on one GPU (it needs no more devices than --devices)
# Every step has its own time limit and runs even when an earlier one failed; the results go to
# $OUT (default device_check_out/): log.txt (all output), env.txt, pytest.txt, bench.txt,
# step_table.json, step_table.txt, summary.txt (one line per step).
#
#   scripts/device_check.sh              # on the GPU machine, from the repository root
#   scripts/device_check.sh --dry-run    # tiny shapes on CPU: every step in a few minutes
# Environment: OUT (output folder), TOTAL_S (time for everything, default 470 s; the step table
# gets what the steps around it leave), STEP_TABLE_ARGS (extra arguments for step_table.py).
set -u -o pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-device_check_out}
TOTAL_S=${TOTAL_S:-470}
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

# 3. step table: what the steps after it need is kept back (parity tests 120 s, benches 90 s)
if [ $DRY = 1 ]; then
  ST_ARGS=(--dry_run --compile_threads=2 --experts=1,8 --variant="pallas:64:64:8")
  REST=200
else
  ST_ARGS=(--compile_threads=16 --variant="pallas:64:256:32|256" --variant="xla:8:256:256")
  REST=210
fi
ST_LIMIT=$(( $(left) - REST ))
step step_table $ST_LIMIT "$OUT/step_table.txt" $PY scripts/step_table.py \
  --out="$OUT/step_table.json" --ceilings --budget_s=$(( ST_LIMIT > 80 ? ST_LIMIT - 40 : 40 )) \
  "${ST_ARGS[@]}" ${STEP_TABLE_ARGS:-}

# 4. parity tests on the GPU (on CPU: one emulated device, as on a one-GPU machine); -v: a test
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

# 5. flexfloor_jax.kernels.bench: f32 at the README's shape, then bf16 at Mixtral's expert shape, xla vs pallas
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

# 6. moe_bench on one device (the README's 4096 tokens, D=256 F=512; needs only --devices devices)
L6=$(( $(left) - 3 ))
step moe_bench $(( L6 < 30 ? L6 : 30 )) "$OUT/bench.txt" $PY -m flexfloor_jax.bench.moe \
  --devices=1 --tokens_per_worker=$([ $DRY = 1 ] && echo 256 || echo 4096) --runs=10

echo "=== done in $((SECONDS - START))s" | tee -a "$LOG"
cat "$OUT/summary.txt"
