#!/usr/bin/env bash
# Side-by-side throughput of the Llama example and transformers on the same machine, in one run:
# generation tokens/s at batch 1 and 16 (greedy, fixed length) and training forward+backward
# tokens/s, SmolLM2-135M-Instruct in f32 on CPU. Usage: scripts/bench_llama.sh [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
model="${1:-models/smollm2-135m-instruct}"
[ -f "$model/model.safetensors" ] || scripts/smollm2.sh "$model"
cargo build --release -p topr-llama --bin llama
NEW=64 B=8 T=128
./target/release/llama bench --model "$model" --new-tokens $NEW --train-batch $B --train-len $T
"$TOPR_REFERENCE_PYTHON" examples/llama/tests/reference/bench_hf.py "$model" $NEW $B $T 2>/dev/null
