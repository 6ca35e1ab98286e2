#!/usr/bin/env bash
# Wall time of the Llama example's `train` and `sample` as one process and as a group of two ranks
# on the machine it runs on (loopback), for docs/distributed.md. Writes one JSON line per run to OUT
# (default target/bench-distributed.jsonl) and prints a table. Run after `source scripts/env.sh`.
#
#   scripts/bench_distributed.sh [OUT] [REPEATS] [MODEL_DIR]
#
# Without MODEL_DIR the model is the README demo's (4 layers, hidden 128, 0.8 M parameters):
# `train` takes 512 worked solutions of the synthetic task (16 steps of 32 completions, TOPR,
# micro-batches of 8); `sample` draws 4 completions of up to 96 tokens for 64 prompts.
# Configurations: one process with libtorch's default threads (one per core) and with one
# thread; two ranks with one thread each (OMP_NUM_THREADS=1, a core each) and with the default
# threads each (oversubscribed). With MODEL_DIR (e.g. models/smollm2-135m-instruct, whose
# gradients make the all-reduce cost something): 64 solutions (4 steps of 16, micro-batches of
# 4), 2 completions of up to 32 tokens for 16 prompts (batches of 4), and only the first and third
# configurations.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/bench-distributed.jsonl}
reps=${2:-2}
model=${3:-}
cargo build --release -q -p topr-llama --bin llama
bin=target/release/llama
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
task=(--task synthetic --difficulty 1)
if [ -z "$model" ]; then
    "$bin" init --out "$W/m0" >/dev/null 2>&1
    model="$W/m0"
    n_sft=512; train_size=(--batch-size 32 --micro-batch-size 8); sample_size=(--synthetic-n 64 --samples-per-prompt 4 --max-new-tokens 96 --batch-prompts 8)
    configs=("1 process|1|" "1 process, 1 thread|1|1" "2 ranks, 1 thread each|2|1" "2 ranks, default threads each|2|")
else
    n_sft=64; train_size=(--batch-size 16 --micro-batch-size 4); sample_size=(--synthetic-n 16 --samples-per-prompt 2 --max-new-tokens 32 --batch-prompts 4)
    configs=("1 process|1|" "2 ranks, 1 thread each|2|1")
fi
"$bin" sft-data --model "$model" "${task[@]}" --synthetic-n "$n_sft" --out "$W/sft.jsonl" 2>/dev/null
: > "$out"

port=29600
# timed NAME CONFIG RANKS THREADS COMMAND...: runs COMMAND as RANKS ranks (1: no group), each
# with THREADS intra-op threads (empty: libtorch's default), and appends its wall time.
timed() {
    local what=$1 config=$2 ranks=$3 threads=$4; shift 4
    local t0 t1 pids=() r
    port=$((port + 1))
    t0=$(date +%s.%N)
    for ((r = 0; r < ranks; r++)); do
        if [ "$ranks" -gt 1 ]; then
            env ${threads:+OMP_NUM_THREADS=$threads} RANK=$r WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
                "$@" >/dev/null 2>"$W/err.$r" &
        else
            env ${threads:+OMP_NUM_THREADS=$threads} "$@" >/dev/null 2>"$W/err.$r" &
        fi
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    t1=$(date +%s.%N)
    printf '{"what":"%s","config":"%s","ranks":%d,"threads":"%s","seconds":%.2f}\n' \
        "$what" "$config" "$ranks" "${threads:-default}" "$(echo "$t1 - $t0" | bc -l)" | tee -a "$out"
}

for ((k = 0; k < reps; k++)); do
    for cfg in "${configs[@]}"; do
        IFS='|' read -r name ranks threads <<< "$cfg"
        rm -rf "$W/train" "$W/s.jsonl" "$W/s.jsonl.run.json"
        timed train "$name" "$ranks" "$threads" "$bin" train --model "$model" --data "$W/sft.jsonl" --out "$W/train" \
            --objective topr --lr 1e-5 "${train_size[@]}" --save-every 0
        timed sample "$name" "$ranks" "$threads" "$bin" sample --model "$model" "${task[@]}" "${sample_size[@]}" \
            --out "$W/s.jsonl"
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault((r["what"], r["config"]), []).append(r["seconds"])
print(f"{'':6} {'configuration':32} {'seconds (mean ± sd)':>22}")
for (what, cfg), v in by.items():
    sd = statistics.stdev(v) if len(v) > 1 else 0.0
    print(f"{what:6} {cfg:32} {statistics.mean(v):14.2f} ± {sd:5.2f}")
PY
