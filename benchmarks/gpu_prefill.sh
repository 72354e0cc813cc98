#!/usr/bin/env bash
# One device call for the prefill kernels: GPU tests, then the tile-shape sweep, then the
# side-by-side benchmark with the sweep's best shapes (or the defaults: MODE=bench), then the
# end-to-end transformers run where HF_S (seconds) is set.
#   benchmarks/gpu_prefill.sh          tests + sweep + benchmark
#   benchmarks/gpu_prefill.sh bench    tests + benchmark with the default plans
#   benchmarks/gpu_prefill.sh sweep    tests + sweep
#   benchmarks/gpu_prefill.sh gluon    tests + the Gluon kernel's tile sweep
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

echo "== pytest: the prefill kernels' GPU tests ($SECONDS s)"
timeout "${TEST_S:-150}" $PY -m pytest -q -p no:cacheprovider -n 8 -m cuda \
  tests/test_prefill_cuda.py tests/test_gluon_prefill.py tests/test_backends.py \
  tests/test_mixed_batch.py \
  >"$OUT/pytest_prefill.log" 2>&1 || { echo "pytest FAILED"; status=1; }
tail -25 "$OUT/pytest_prefill.log"

if [ "$MODE" = gluon ]; then
  echo "== Gluon tile sweep ($SECONDS s)"
  timeout "${SWEEP_S:-300}" $PY benchmarks/bench_prefill.py --gluon-sweep \
    --budget "${SWEEP_BUDGET:-260}" --json "$OUT/gluon_tiles.json" >"$OUT/gluon_sweep.log" 2>&1 \
    || { echo "Gluon sweep FAILED"; status=1; }
  grep -c '"ms"' "$OUT/gluon_sweep.log"
  echo "gpu_prefill status $status ($SECONDS s)"
  exit $status
fi
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
if [ -n "${HF_S:-}" ]; then  # the issue's end-to-end case: 16 prompts of 4096 tokens
  echo "== bench_hf ($SECONDS s)"
  timeout "$HF_S" $PY benchmarks/bench_hf.py --device cuda --requests 16 --min-prompt 4096 \
    --max-prompt 4096 --new-tokens 64 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 \
    --layers 4 --max-batch-tokens 4096 --json "$OUT/hf.json" >"$OUT/hf.log" 2>&1 \
    || { echo "bench_hf FAILED"; status=1; }
  tail -15 "$OUT/hf.log"
fi
echo "gpu_prefill status $status ($SECONDS s)"
exit $status
