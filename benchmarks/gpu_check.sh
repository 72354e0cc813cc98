#!/usr/bin/env bash
# One device call: build, GPU tests, compute-sanitizer memcheck of each kernel, the demo and
# the transformers benchmark on CUDA, then the decode benchmark.
#   benchmarks/gpu_check.sh          full: all of the above, plus the decode plot
#   benchmarks/gpu_check.sh check    full without the decode benchmark (run that in a call of
#                                    its own when its FlexAttention compiles need the time),
#                                    then the sweeps named in SWEEP, if any
#   benchmarks/gpu_check.sh tune     build, kernel tests, memcheck, tuning sweeps
#                                    (SWEEP: any of tuning/decode_sweeps.py's sweeps: native,
#                                    tiles, splits, splitcheck, locality, targets, balanced,
#                                    skew, host, overhead; default native; SWEEP="" for none)
# VARIANTS (tune/check): nvcc flag sets separated by ";" (e.g. "-DX=1;-DX=2"); after the
# sweeps, the CUDA library is rebuilt for sm_90 with each set and the sweeps run again, so
# kernel builds compare in one call.
# TEST_S (default 240): seconds for the GPU tests (all of them, about 1330, need more than
# 600 s at 14 workers, so two calls: TEST_FILES=tests/test_op_semantics.py in one, the other
# files in the other); WORKERS (default 12): pytest-xdist workers; TEST_FILES (default
# tests/): the test paths of the full and check modes.
# LIB=path/_cuda_kernels.so: take that prebuilt CUDA library (compiled with the same nvcc for
# sm_90 and carried) instead of building it here.
# Wheels under .whl/ (e.g. the transformers version the tests pin) are installed first into
# /tmp/site, ahead of the image's packages. The tests, memcheck and the demo check
# correctness only, so they run side by side; the two benchmarks run alone. Every part is
# bounded by `timeout` and by what is left of BUDGET seconds (default 560) once the decode
# benchmark's BENCH_MIN (default 150) is set aside, so the run fits one 10-minute call.
# Logs and results go to $OUT, default /tmp/pagedfuse-gpu: decode.json and hf.json are records
# to copy into benchmarks/results/ (then benchmarks/summarize.py --write updates the README).
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/pagedfuse-gpu}
BUDGET=${BUDGET:-560}
BENCH_MIN=${BENCH_MIN:-150}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=python3
status=0

# limit CAP: CAP seconds, or less if the decode benchmark would otherwise lose its BENCH_MIN
limit() {
  local left=$((BUDGET - SECONDS - BENCH_MIN))
  echo $((left < $1 ? (left > 10 ? left : 10) : $1))
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || status=1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
$PY -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1

echo "== build ($SECONDS s)"
if [ -n "${LIB:-}" ]; then  # built elsewhere (the same nvcc, sm_90): minutes of device time saved
  cp "$LIB" pagedfuse/_cuda_kernels.so && echo "CUDA library from $LIB" >"$OUT/build.log"
elif ! timeout "$(limit 150)" $PY -m pip install -v --no-build-isolation --no-deps -e . \
    >"$OUT/build.log" 2>&1; then
  echo "BUILD FAILED (see build.log)"; tail -20 "$OUT/build.log"; status=1
fi
grep -E "spill|registers" "$OUT/build.log" | paste - - | grep -v "0 bytes spill stores" \
  | head -8  # variants that spill
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import torch; from pagedfuse.ops import cuda_native as n; \
print('CUDA C++ decode available:', n.decode_available(torch.device('cuda')))"

run_tests() {  # $1: test paths. -v: a run cut by its timeout still names what it ran and failed
  timeout "$(limit ${TEST_S:-240})" $PY -m pytest -m cuda -v -n ${WORKERS:-12} -p no:cacheprovider \
    -rf --tb=short --continue-on-collection-errors $1 >"$OUT/pytest.log" 2>&1
}

run_memcheck() {
  timeout "$(limit 150)" compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY benchmarks/memcheck_cases.py >"$OUT/memcheck.log" 2>&1
}

run_demo() {
  timeout "$(limit 240)" $PY -m pagedfuse.cli demo --device cuda --steps 8 \
    >"$OUT/demo.log" 2>&1
}

if [ "$MODE" != tune ]; then
  echo "== pytest -m cuda (all tests), memcheck and the demo, side by side ($SECONDS s)"
  run_tests "${TEST_FILES:-tests/}" & tests_pid=$!
  run_memcheck & memcheck_pid=$!
  run_demo & demo_pid=$!
  wait $tests_pid || { echo "pytest FAILED"; status=1; }
  wait $memcheck_pid || { echo "memcheck FAILED"; status=1; }
  wait $demo_pid || { echo "demo FAILED"; status=1; }
  grep -E "^FAILED|^ERROR|\[gw[0-9]+\] (FAILED|ERROR)" "$OUT/pytest.log" | head -40
  tail -3 "$OUT/pytest.log"
  tail -6 "$OUT/memcheck.log"
  tr '\r' '\n' <"$OUT/demo.log" | grep -E "PASS|FAIL|cases passed|Error" | grep -v "^pagedfuse"

  echo "== transformers continuous batching on cuda ($SECONDS s)"
  timeout "$(limit 150)" $PY benchmarks/bench_hf.py --device cuda --layers 4 --hidden 1024 \
    --heads 16 --kv-heads 4 --head-dim 64 --requests 16 --min-prompt 64 --max-prompt 256 \
    --new-tokens 64 --repeats 2 --json "$OUT/hf.json" >"$OUT/bench_hf.log" 2>&1 || status=1
  tail -12 "$OUT/bench_hf.log"
else
  echo "== pytest -m cuda (kernel tests)"
  run_tests "tests/test_cuda_kernels.py tests/test_cuda_native.py" || status=1
  grep -E "^FAILED|^ERROR|\[gw[0-9]+\] (FAILED|ERROR)" "$OUT/pytest.log" | head -40
  tail -3 "$OUT/pytest.log"
fi

if [ "$MODE" != full ]; then
  if [ "$MODE" = tune ]; then
    echo "== memcheck ($SECONDS s)"
    run_memcheck || { echo "memcheck FAILED"; status=1; }
    tail -6 "$OUT/memcheck.log"
  fi
  [ "$MODE" = tune ] && default_sweep=native || default_sweep=""
  run_sweeps() {  # $1: a label for the log
    for sweep in ${SWEEP-$default_sweep}; do
      echo "== sweep $sweep, $1 ($SECONDS s)" | tee -a "$OUT/sweep.log"
      timeout $((BUDGET - SECONDS > 60 ? BUDGET - SECONDS : 60)) \
        $PY benchmarks/tuning/decode_sweeps.py "$sweep" 2>&1 | tee -a "$OUT/sweep.log" || status=1
    done
  }
  run_sweeps "default build"
  IFS=';' read -ra variants <<<"${VARIANTS:-}"
  for flags in "${variants[@]}"; do
    echo "== rebuild with $flags ($SECONDS s)"
    PAGEDFUSE_NVCC_FLAGS="$flags" PAGEDFUSE_CUDA_ARCH=90 timeout 120 $PY setup.py build_ext \
      --inplace >"$OUT/build_variant.log" 2>&1 || { echo "BUILD FAILED"; status=1; continue; }
    run_sweeps "$flags"
  done
else
  echo "== decode benchmark ($SECONDS s)"
  timeout $((BUDGET - SECONDS > 60 ? BUDGET - SECONDS : 60)) $PY benchmarks/bench_decode.py \
    --json "$OUT/decode.json" --plot "$OUT/decode_bandwidth.png" >"$OUT/bench.log" 2>&1 \
    || status=1
  tr '\r' '\n' <"$OUT/bench.log" | grep -v "decode bench:" | tail -70
fi
echo "gpu_check status $status ($SECONDS s)"
exit $status
