#!/usr/bin/env bash
# The >= 4K-token long continuous generation (issue 24) on the GPU machine within one call: the reference
# MAC decode is bound by Python (~20 steps/s), so each MAC variant runs in its own process (each with its
# own full-attention run, which is deterministic), spread over the visible GPUs, and the results are merged
# (`macattn eval --long-gen-merge`) into one JSON + PNG.
#   [LONG_GEN_GPUS="0 1"] bash benchmarks/long_gen_parallel.sh OUT_DIR [TOKENS]
# Writes OUT_DIR/eval_long_gen.json / .png and one log per process. LONG_GEN_GPUS: the GPUs to spread the
# processes over (default: every visible one).
set -o pipefail
out=${1:?usage: long_gen_parallel.sh OUT_DIR [TOKENS]}
tokens=${2:-4096}
mkdir -p "$out"
read -r -a gpus <<<"${LONG_GEN_GPUS:-$(python3 -c "import torch; print(*range(max(1, torch.cuda.device_count())))")}"
per_layer=benchmarks/results/tune_agreement_per_layer.json
common=(--long-gen --device cuda --model trained --lengths 4096 --n 1 --long-gen-tokens "$tokens" --threads 2)
variants=(
  "niah_single|mac_tau045|--taus 0.45"
  "niah_single|two_stage|--taus 0.45 --two-stage --no-uniform"
  "niah_single|per_layer|--no-uniform --per-layer $per_layer"
  "niah_single|mac_tau075|--taus 0.75"
)
i=0
pids=()
for v in "${variants[@]}"; do
  IFS='|' read -r task name extra <<<"$v"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]} macattn eval "${common[@]}" --tasks "$task" $extra \
    --out "$out/long_gen_$name.json" > "$out/long_gen_$name.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
parts=("$out"/long_gen_*.json)
macattn eval --long-gen-merge "${parts[@]}" --out "$out/eval_long_gen.json" || rc=1
exit $rc
