#!/usr/bin/env bash
# The GPU tier in parts that each fit a ten-minute call on a lent machine (a fresh H100/H200
# builds the kernels in about 2-4 minutes, side by side).  Usage, from the repository root:
#   bash tests/gpu/run.sh build   # every kernel + the benchmarks' fold extension
#   bash tests/gpu/run.sh first   # marker order, RMP, the fold kills, crash and in-place cases
#   bash tests/gpu/run.sh rest    # the other files (fused kernels, lending, preinit, fences, ...)
#   bash tests/gpu/run.sh all     # build, first, rest
# Logs go to $OUT (default ./gpu-logs).  Each part ends itself at LIMIT seconds (default 560).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
LIMIT=${LIMIT:-560}
PYTEST=(python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE)
FIRST=(tests/gpu/test_marker_stream_gpu.py tests/gpu/test_rmp_gpu.py tests/gpu/test_fold_kill_gpu.py
       tests/gpu/test_rmu_crash_gpu.py tests/gpu/test_inplace_gpu.py tests/gpu/test_parity_cuda.py
       tests/gpu/test_rmp_perf_paths.py tests/gpu/test_rmp_preattach.py tests/gpu/test_rmu_adamw_cuda.py)

build() {
  python3 -m leto_run --build-kernels > "$OUT/build.log" 2>&1 &
  python3 -c "from leto_runtime.rmu.fused import load_fold; load_fold()" > "$OUT/build_fold.log" 2>&1 &
  wait
  tail -8 "$OUT/build.log"; tail -2 "$OUT/build_fold.log"
}

case "${1:-all}" in
  build) build ;;
  first) timeout -s INT "$LIMIT" "${PYTEST[@]}" "${FIRST[@]}" 2>&1 | tee "$OUT/first.log" | tail -40 ;;
  rest)
    mapfile -t REST < <(ls tests/gpu/test_*.py | grep -v -F -x "$(printf '%s\n' "${FIRST[@]}")")
    timeout -s INT "$LIMIT" "${PYTEST[@]}" "${REST[@]}" 2>&1 | tee "$OUT/rest.log" | tail -40 ;;
  all) build; "$0" first; "$0" rest ;;
  *) echo "usage: $0 build|first|rest|all" >&2; exit 2 ;;
esac
