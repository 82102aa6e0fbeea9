#!/usr/bin/env bash
# One call on the GPU machine (run from the repo root there; $OUT comes back):
#   bash benchmarks/device_job.sh tests tune bench
# Steps run in the order given: tests (CMake native library, then every GPU test -> junit xml + log),
# tune (launch-parameter sweep),
# bench (bench_mac_decode.py; extra args in $BENCH_ARGS), completion (bench_completion_decode.py;
# $COMPLETION_ARGS), e2e (bench_e2e.py; $E2E_ARGS), selectors (bench_selectors.py: two-stage match, page
# selector). FlashInfer installs from .whl/ if carried.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/macattn_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
if ls .whl/flashinfer*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) (cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j 16) > "$OUT/cmake_build.log" 2>&1 \
             || { echo "cmake build failed"; tail -20 "$OUT/cmake_build.log"; }
           timeout "${TEST_TIMEOUT:-300}" python3 -m pytest ${TESTS:-tests} -m gpu -rA -p no:cacheprovider \
             --junitxml="$OUT/junit_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40 ;;
    tune) timeout "${TUNE_TIMEOUT:-240}" python3 benchmarks/bench_mac_decode.py --tune \
             --points "${TUNE_POINTS:-1x131072,32x131072}" 2>&1 | tee "$OUT/tune.log" ;;
    bench) timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_mac_decode.py ${BENCH_ARGS:-} \
             --out "$OUT/bench_mac_decode.json" 2>&1 | tee "$OUT/bench.log" ;;
    completion) timeout "${COMPLETION_TIMEOUT:-300}" python3 benchmarks/bench_completion_decode.py ${COMPLETION_ARGS:-} \
             --out "$OUT/bench_completion_decode.json" 2>&1 | tee "$OUT/completion.log" ;;
    selectors) timeout "${SELECTORS_TIMEOUT:-240}" python3 benchmarks/bench_selectors.py \
             --out "$OUT/bench_selectors.json" 2>&1 | tee "$OUT/selectors.log" | tail -30 ;;
    e2e) timeout "${E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py ${E2E_ARGS:-} \
             --out "$OUT/bench_e2e.json" 2>&1 | tee "$OUT/e2e.log" | tail -40 ;;
  esac
done
echo "=== done $(date +%T)"
