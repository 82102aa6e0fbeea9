#!/usr/bin/env bash
# Export the built-in tiny LLaMA with MAC (`macattn build`), write a Triton Inference Server model
# repository for it (`macattn triton-repo`), serve it with the tritonserver binary bundled in the
# nvidia-pytriton wheel and stream one request over gRPC (pip install -e ".[test]" brings both).
#   bash examples/build_and_serve.sh [WORKDIR]
set -euo pipefail
work=${1:-$(mktemp -d)}
macattn build --model llama --tiny --out "$work/engine" --no-progress
macattn triton-repo --engine "$work/engine" --out "$work/repo" --max-batch-size 4
python3 - "$work" <<'PY'
import queue
import sys

import numpy as np
from tritonclient import grpc as grpcclient

from macattn.apps.serving.triton_server import serve

work = sys.argv[1]
with serve(f"{work}/repo", f"{work}/server") as running:
    client = grpcclient.InferenceServerClient(running.grpc_url)
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put(error or result))
    inputs = [grpcclient.InferInput("input_ids", [12], "INT64"), grpcclient.InferInput("max_new_tokens", [1], "INT64")]
    inputs[0].set_data_from_numpy(np.arange(3, 15, dtype=np.int64))
    inputs[1].set_data_from_numpy(np.array([8], dtype=np.int64))
    client.async_stream_infer("macattn", inputs, request_id="0", enable_empty_final_response=True)
    tokens = []
    while True:
        r = responses.get(timeout=60)
        if isinstance(r, Exception):
            raise r
        if r.get_response().outputs:
            tokens += r.as_numpy("output_ids").tolist()
        if r.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    print(f"served by tritonserver at {running.grpc_url}: streamed tokens {tokens}")
PY
