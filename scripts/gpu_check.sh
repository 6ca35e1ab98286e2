#!/usr/bin/env bash
# GPU check of the Llama example: runs every subcommand briefly on CUDA in bf16 and prints, per
# stage, the wall time, the throughput the command reports and the peak GPU memory (nvidia-smi,
# polled every 100 ms). Needs a CUDA build of torch 2.13.0 in the venv of scripts/env.sh (or a
# CUDA libtorch in LIBTORCH) and nvidia-smi.
#
#   scripts/gpu_check.sh                 # a 12-layer, 768-wide Llama made by `init` (~110M params)
#   scripts/gpu_check.sh MODEL_DIR       # any Hugging Face Llama directory, e.g. Llama-3.2-1B-Instruct
#
# Output lines:  stage | seconds | peak MiB | what the command printed (JSON, last line)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --release -p topr-llama --bin llama
BIN=target/release/llama
W=${GPU_CHECK_DIR:-/tmp/topr-gpu-check}
rm -rf "$W" && mkdir -p "$W"
DEV=(--device cuda --dtype bf16)
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  "$BIN" init --out "$W/init" --layers 12 --hidden 768 --heads 12 --kv-heads 4 --intermediate 2048 --max-positions 1024
  MODEL="$W/init"
fi
TASK=(--task synthetic --difficulty 2 --max-new-tokens 128)

stage() {
  local name=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$W/$name.mem" &
  local poll=$!
  local start end
  start=$(date +%s.%N)
  if ! "$@" > "$W/$name.out" 2> "$W/$name.err"; then
    kill "$poll"; echo "$name | FAILED | - | $(tail -3 "$W/$name.err" | tr '\n' ' ')"; return 0
  fi
  end=$(date +%s.%N)
  kill "$poll"; wait "$poll" 2>/dev/null || true
  printf '%s | %.1f | %s | %s\n' "$name" "$(echo "$end - $start" | bc)" "$(sort -n "$W/$name.mem" | tail -1)" "$(tail -1 "$W/$name.out")"
}

echo "stage | seconds | peak MiB | output"
stage bench "$BIN" bench --model "$MODEL" "${DEV[@]}" --new-tokens 64 --train-batch 8 --train-len 512
stage sft-data "$BIN" sft-data --model "$MODEL" --out "$W/sft.jsonl" --task synthetic --difficulty 2 --synthetic-n 512
stage train-sft-adamw "$BIN" train --model "$MODEL" "${DEV[@]}" --data "$W/sft.jsonl" --out "$W/sft" \
  --objective sft --optimizer adamw --lr 1e-4 --batch-size 64 --micro-batch-size 16 --save-every 0
stage sample "$BIN" sample --model "$MODEL" "${DEV[@]}" "${TASK[@]}" --synthetic-n 64 --samples-per-prompt 8 \
  --batch-prompts 16 --out "$W/data.jsonl"
# A random or barely trained model answers nothing right: mark the first completion of every
# question correct, so that every objective (DPO's pairs, GRPO's groups) has work to do.
python3 - "$W/data.jsonl" "$W/mixed.jsonl" <<'PY'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as out:
    for line in f:
        r = json.loads(line)
        r["correct"] = r["sample"] == 0
        r["reward"] = 1.0 if r["correct"] else -1.0
        out.write(json.dumps(r) + "\n")
PY
for objective in topr ppo grpo dpo; do
  stage "train-$objective-adafactor" "$BIN" train --model "$MODEL" "${DEV[@]}" --data "$W/mixed.jsonl" \
    --out "$W/$objective" --objective "$objective" --optimizer adafactor --lr 1e-5 --batch-size 64 \
    --micro-batch-size 16 --target-positive-proportion 0.2 --save-every 4
done
stage eval "$BIN" eval --model "$MODEL" "${DEV[@]}" "${TASK[@]}" --synthetic-n 128 --samples 4 --batch-size 64
stage iterate "$BIN" iterate --model "$MODEL" "${DEV[@]}" "${TASK[@]}" --work "$W/iterate" --iterations 1 \
  --synthetic-n 64 --samples-per-prompt 4 --eval-n 64 --optimizer adafactor --lr 1e-5 --batch-size 64 \
  --micro-batch-size 16 --baseline=-0.5
