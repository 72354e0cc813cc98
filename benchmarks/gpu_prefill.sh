#!/usr/bin/env bash
# One device call for the prefill kernels: GPU tests, then the tile-shape sweep, then the
# side-by-side benchmark with the sweep's best shapes (or the defaults: MODE=bench).
#   benchmarks/gpu_prefill.sh          tests + sweep + benchmark
#   benchmarks/gpu_prefill.sh bench    tests + benchmark with the default plans
#   benchmarks/gpu_prefill.sh sweep    tests + sweep
# Every part is bounded by `timeout`, so the run fits one 10-minute call; the budgets and
# the sweep's cache kinds (SWEEP_KINDS) and the benchmark's extra flags (BENCH_ARGS, e.g.
# --no-flex) come from the environment. Logs and results go to $OUT (default
# /tmp/pagedfuse-prefill). No build: the Triton paths need none.
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-/tmp/pagedfuse-prefill}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=python3
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cudnn', torch.backends.cudnn.version())"

echo "== pytest tests/test_prefill_cuda.py ($SECONDS s)"
timeout "${TEST_S:-150}" $PY -m pytest -q -p no:cacheprovider -n 8 tests/test_prefill_cuda.py \
  >"$OUT/pytest_prefill.log" 2>&1 || { echo "pytest FAILED"; status=1; }
tail -25 "$OUT/pytest_prefill.log"

plans=()
if [ "$MODE" != bench ]; then
  echo "== sweep ($SECONDS s)"
  # shellcheck disable=SC2086
  timeout "${SWEEP_S:-170}" $PY benchmarks/bench_prefill.py --sweep --budget "${SWEEP_BUDGET:-120}" \
    --kinds ${SWEEP_KINDS:-bf16 int8_k int8_kv} --json "$OUT/prefill_sweep.json" \
    >"$OUT/sweep.log" 2>&1 || { echo "sweep FAILED"; status=1; }
  grep -v '^{"geometry"' "$OUT/sweep.log" | tail -5
  [ -s "$OUT/prefill_sweep.json" ] && plans=(--plans "$OUT/prefill_sweep.json")
fi
if [ "$MODE" != sweep ]; then
  echo "== benchmark ($SECONDS s)"
  # shellcheck disable=SC2086
  timeout "${BENCH_S:-330}" $PY benchmarks/bench_prefill.py "${plans[@]}" ${BENCH_ARGS:-} \
    --budget "${BENCH_BUDGET:-270}" --json "$OUT/prefill.json" --plot "$OUT/prefill.png" \
    >"$OUT/bench.log" 2>&1 || { echo "benchmark FAILED"; status=1; }
  grep -v "^qwen35\|^llama3_8b\|^tinyllama" "$OUT/bench.log" | tail -60
fi
echo "gpu_prefill status $status ($SECONDS s)"
exit $status
