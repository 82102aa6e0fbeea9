#!/usr/bin/env bash
# Train a checkpoint on the GPU machine in two calls (a command there runs at most 10 minutes and its
# processes end with it), then measure how its queries' recurrence evolved over training. Run from the
# repo root there, with .data/tiny_llama (training/prep_data.py) carried:
#   call 1:  bash training/device_train.sh start    # trains until STOP seconds, saves resume state
#   call 2:  bash training/device_train.sh finish   # resumes to BUDGET, then `macattn recurrence` over the
#                                                   # snapshots, the result and the packaged checkpoint
# or, for a budget that fits one call:  BUDGET=480 bash training/device_train.sh once
# The second call must come within the machine's idle release (30 s), or the resume state is gone.
# $OUT receives recurrence.json/png, train_log.json and the checkpoint as ckpt.tar.part-* (<= 15 MiB each;
# `cat ckpt.tar.part-* | tar x`). Knobs: BUDGET (default 1000 s), STOP (540 s), MODEL (JSON overrides of
# ModelConfig), SNAPSHOTS (fractions of BUDGET), TRAIN_ARGS (more train_tiny_llama.py flags).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/macattn_out}
CKPT=/tmp/macattn_ckpt
mkdir -p "$OUT"
train() {
  python3 training/train_tiny_llama.py --data .data/tiny_llama --out "$CKPT" --time-budget "${BUDGET:-1000}" \
    --snapshots "${SNAPSHOTS:-0.1,0.25,0.5,0.75}" --model "${MODEL:-{\}}" ${TRAIN_ARGS:-} "$@" 2>&1 | tr '\r' '\n' | grep -v '^ *[0-9]*%' | tail -30
}
report() {   # checkpoint parts, training log and the recurrence of every snapshot, the result and the packaged one
  cp "$CKPT/train_log.json" "$OUT/"
  cp .data/tiny_llama/heldout.txt "$CKPT/"
  (cd "$CKPT" && tar cf - --exclude=snapshots --exclude=resume.pt .) | split -b 15M - "$OUT/ckpt.tar.part-"
  macattn recurrence --model trained $(ls -d "$CKPT"/snapshots/f* | sort) "$CKPT" \
    --haystack .data/tiny_llama/heldout.txt --device cuda --lengths 4096,16384 --n 2 --positions 1024 --quiet \
    --out "$OUT/recurrence.json"
  ls -la "$OUT"
}
setup() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
}
case ${1:-} in
  start) setup; train --stop-after "${STOP:-540}" ;;
  finish) train --resume && report ;;
  once) setup; train && report ;;   # a budget that fits one call (<= ~500 s)
  *) echo "usage: $0 start|finish|once" >&2; exit 2 ;;
esac
