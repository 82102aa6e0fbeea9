#!/usr/bin/env bash
# One call on the GPU machine (run from the repo root there, .whl/ carried; $OUT comes back):
#   bash benchmarks/serving_job.sh floor serving
# Steps run in the order given:
#   floor    bench_prefill_floor.py (8B shapes: every prompt mix, the chunked-prefill probe, decode floors)
#            -> $OUT/bench_prefill_floor.json, $OUT/floor.log; extra args in $FLOOR_ARGS
#   serving  bench_serving.py --model llama8b-random --device cuda, one --workload per name of
#            $SERVING_WORKLOADS (default: all five), each with its floor measured in the same process
#            -> $OUT/bench_serving.json, $OUT/serving.log; extra args in $SERVING_ARGS (e.g. --mac-ab)
# Each step runs under `timeout` ($FLOOR_TIMEOUT default 200 s, $SERVING_TIMEOUT default 360 s: both steps fit
# one call's 600 s); the serving JSON is rewritten after every record, so a step cut off keeps what it
# measured. All five workloads (with --mac-ab) may not fit one call; split them over two calls, e.g.
#   SERVING_WORKLOADS="ttft_1k ttft_32k mix_1k_64" bash benchmarks/serving_job.sh floor serving
#   SERVING_WORKLOADS="long_4x32k_128 long_4x32k_1024" SERVING_ARGS=--mac-ab SERVING_TAG=long \
#     SERVING_TIMEOUT=540 bash benchmarks/serving_job.sh serving
#
# The device's Python 3.12 (torch, transformers) has no fastapi / uvicorn / openai: they install from the
# carried .whl/ (no index), with pip resolving what the device already has. The wheels (cp312 manylinux
# x86_64 or pure Python; 6.9 MB in all), made on the CPU machine with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VER
# (.whl/ is in .git/info/exclude; pass carry [".whl"] to the run):
#   fastapi 0.165.0, starlette 1.10.0, uvicorn 0.54.0, h11 0.16.0, anyio 4.16.0, sniffio 1.3.1,
#   pydantic 2.13.4, pydantic-core 2.46.4 (cp312), typing-inspection 0.4.2, annotated-types 0.7.0,
#   annotated-doc 0.0.7, opentelemetry-api 1.45.2 (fastapi's), prometheus-client 0.26.0, openai 3.57.0,
#   httpx2 2.16.2, httpcore2 2.16.2, truststore 0.10.5 (openai 3.x's HTTP client), httpx 0.28.1,
#   httpcore 1.0.9, distro 1.9.0, jiter 0.19.0 (cp312), click 8.5.1, idna 3.20, certifi 2026.5.20,
#   typing-extensions 4.16.0, tqdm 4.70.1
# guidellm 0.8.1 is not in these wheels. The device image already holds its heavy needs (pyarrow, pandas, uvloop,
# rich, msgpack, tabulate, protobuf, xxhash, aiofiles, multidict); the rest is 26 wheels, 6.4 MB, for a folder of
# its own (cp312 where compiled): guidellm, datasets, dill, multiprocess, culsans, aiologic, faker, tzdata, ftfy,
# wcwidth, h2, hpack, hyperframe, loguru, pydantic-settings, python-dotenv, sanic, sanic-routing, html5tagger,
# tracerite, httptools, ujson, websockets, more-itertools, eval-type-backport, and click 8.4.2 (guidellm pins
# ~=8.4; carry it instead of the 8.5.1 above, which uvicorn does not need). Not yet run on a device.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/macattn_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
SERVING_PKGS="fastapi uvicorn openai prometheus-client"
if ls .whl/fastapi-*.whl >/dev/null 2>&1; then
  if ! python3 -m pip install -q --no-index --find-links .whl $SERVING_PKGS > "$OUT/pip_serving.log" 2>&1; then
    echo "pip into the system site failed (tail of $OUT/pip_serving.log below); installing into /tmp/serving_site"
    tail -5 "$OUT/pip_serving.log"
    python3 -m pip install -q --no-index --find-links .whl --target /tmp/serving_site $SERVING_PKGS 2>&1 | tail -3
    export PYTHONPATH=/tmp/serving_site${PYTHONPATH:+:$PYTHONPATH}
  fi
else
  echo "no .whl/fastapi-*.whl: carry .whl (see the top of this script)"
fi
python3 -c "import fastapi, uvicorn, openai, prometheus_client; print('serving stack: fastapi', fastapi.__version__, \
'uvicorn', uvicorn.__version__, 'openai', openai.__version__)" || echo "the serving stack does not import"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
WL=""
for w in ${SERVING_WORKLOADS:-ttft_1k ttft_32k mix_1k_64 long_4x32k_128 long_4x32k_1024}; do WL="$WL --workload $w"; done
TAG=${SERVING_TAG:+_$SERVING_TAG}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    floor) timeout -k 10 "${FLOOR_TIMEOUT:-200}" python3 benchmarks/bench_prefill_floor.py ${FLOOR_ARGS:-} \
             --out "$OUT/bench_prefill_floor$TAG.json" 2>&1 | tee "$OUT/floor$TAG.log" | grep -v '^USDT' | tail -40 ;;
    serving) timeout -k 10 "${SERVING_TIMEOUT:-360}" python3 benchmarks/bench_serving.py --model llama8b-random \
             --device cuda $WL ${SERVING_ARGS:-} --out "$OUT/bench_serving$TAG.json" 2>&1 \
             | tee "$OUT/serving$TAG.log" | grep -v '^USDT' | tail -60 ;;
    *) echo "unknown step $step (floor, serving)" ;;
  esac
  echo "=== $step exit ${PIPESTATUS[0]} $(date +%T)"
done
echo "=== done $(date +%T)"
