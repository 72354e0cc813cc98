#!/usr/bin/env bash
# One device call for the C++ host path (csrc/host): build pagedfuse._host (and _C) against
# the machine's CUDA torch, run its tests and the CUDA kernel tests, then time the eager host
# path with bench_overhead on CUDA (cuda_decode, and the no-op backend for the Python path).
#   LIB=path/_cuda_kernels.so benchmarks/gpu_hostpath.sh
# LIB: a prebuilt sm_90 CUDA library (the same csrc/cuda) to copy instead of compiling it
# here (minutes saved); without it setup.py builds it with nvcc (/usr/local/cuda/bin).
# Every step is bounded by `timeout` (about 400 s in all). Logs and the overhead record go to
# $OUT (default /tmp/pagedfuse-hostpath): copy overhead-cuda-*.json into benchmarks/results/.
set -uo pipefail
OUT=${OUT:-/tmp/pagedfuse-hostpath}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
cd "$(dirname "$0")/.."
PY=python3
status=0
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== build ($SECONDS s)"
if [ -n "${LIB:-}" ]; then
  cp "$LIB" pagedfuse/_cuda_kernels.so && echo "CUDA library from $LIB"
  build_env="PAGEDFUSE_CUDA=0"  # _C and _host only: the library is the one copied
else
  build_env="PAGEDFUSE_CUDA=1 PAGEDFUSE_CUDA_ARCH=90"
fi
if ! timeout 240 env $build_env $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  echo "BUILD FAILED (see build.log)"; grep -E "error" "$OUT/build.log" | head -20; status=1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import torch; from pagedfuse.ops import cuda_native, library as l; \
print('host path:', l.HOST is not None and l.HOST.CUDA, '| CUDA C++ decode:', \
cuda_native.decode_available(torch.device('cuda')))" || status=1

echo "== tests ($SECONDS s)"
timeout 150 $PY -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_host_path.py \
  >"$OUT/host_path.log" 2>&1 || status=1
tail -3 "$OUT/host_path.log"
timeout 150 $PY -m pytest -q -m cuda -p no:cacheprovider -rf --tb=short \
  tests/test_cuda_kernels.py >"$OUT/cuda_kernels.log" 2>&1 || status=1
tail -3 "$OUT/cuda_kernels.log"

echo "== bench_overhead ($SECONDS s)"
timeout 120 $PY benchmarks/bench_overhead.py --device cuda --threads 1 \
  --backends cuda_decode --noop --json "$OUT" >"$OUT/overhead.log" 2>&1 || status=1
cat "$OUT/overhead.log"
echo "== done in $SECONDS s, status $status"
exit $status
