#!/usr/bin/env bash
# `llama sample` against transformers sampling the same prompts batched the same way, and
# against another build of `llama` (an earlier version, for before/after), on the CPU.
#
#   scripts/bench_sample.sh [REPEATS] [PROMPTS] [THREADS] [OTHER_LLAMA]
#
# SmolLM2-135M-Instruct (scripts/smollm2.sh builds it), the synthetic task, 4 samples per prompt,
# temperature 1, a 128-token budget. Ours runs twice a round: with its default batching (32
# prompts × 4 samples in flight, "topr-loss") and with 4 prompts × 4 ("topr-loss-16-slots"), the
# batching of the other build's default and of the transformers side (4 prompts × 4 samples a
# batch);
# PROMPTS prompts (default 32), THREADS threads a side (default 1: OMP_NUM_THREADS), REPEATS
# alternating rounds (default 3). Ours is timed as the whole command (its model load included),
# transformers' generation alone. Prints one JSON line per run and, at the end, each side's
# tokens/s as mean ± standard error over the rounds and the per-round ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
repeats="${1:-3}"
prompts="${2:-32}"
threads="${3:-1}"
other="${4:-}"
model=models/smollm2-135m-instruct
scripts/smollm2.sh >/dev/null
source scripts/env.sh >/dev/null
cargo build --release -p topr-llama -q
llama="${CARGO_TARGET_DIR:-target}/release/llama"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tokens_of() { python3 -c 'import json,sys; print(sum(len(json.loads(l)["completion_ids"]) for l in open(sys.argv[1])))' "$1"; }
ours() { # BINARY NAME [--batch-prompts N]
    local out="$work/$2.jsonl"
    rm -f "$out" "$out.run.json"
    local t0 t1
    t0=$(date +%s.%N)
    OMP_NUM_THREADS=$threads "$1" sample --model "$model" --task synthetic --synthetic-n "$prompts" \
        --samples-per-prompt 4 --max-new-tokens 128 --temperature 1 --seed 0 "${@:3}" --out "$out" >/dev/null 2>&1
    t1=$(date +%s.%N)
    local n
    n=$(tokens_of "$out")
    python3 -c "import json,sys; s=float(sys.argv[3])-float(sys.argv[2]); print(json.dumps({'impl': sys.argv[1], 'tokens': int(sys.argv[4]), 'seconds': s, 'tokens_per_s': int(sys.argv[4])/s}))" "$2" "$t0" "$t1" "$n"
}
for r in $(seq "$repeats"); do
    ours "$llama" topr-loss | tee -a "$work/runs.jsonl"
    ours "$llama" topr-loss-16-slots --batch-prompts 4 | tee -a "$work/runs.jsonl"
    [ -n "$other" ] && ours "$other" topr-loss-other | tee -a "$work/runs.jsonl"
    OMP_NUM_THREADS=$threads "$TOPR_REFERENCE_PYTHON" examples/llama/tests/reference/sample_hf.py "$model" \
        "$work/topr-loss.jsonl" --samples 4 --batch-prompts 4 --max-new-tokens 128 --seed "$r" | tee -a "$work/runs.jsonl"
done
python3 - "$work/runs.jsonl" <<'PY'
import json, math, sys
runs = [r for r in map(json.loads, open(sys.argv[1])) if "impl" in r]
by = {}
for r in runs:
    by.setdefault(r["impl"], []).append(r["tokens_per_s"])
def ms(v):
    m = sum(v) / len(v)
    se = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)) if len(v) > 1 else float("nan")
    return m, se
for k, v in by.items():
    m, se = ms(v)
    print(f"{k}: {m:.1f} ± {se:.1f} tokens/s over {len(v)} rounds")
base = by["topr-loss"]
for k, v in by.items():
    if k != "topr-loss":
        m, se = ms([a / b for a, b in zip(base, v)])
        print(f"topr-loss / {k}: {m:.2f} ± {se:.2f} (per-round ratios, mean ± SE)")
PY
