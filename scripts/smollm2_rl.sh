#!/usr/bin/env bash
# SmolLM2-135M-Instruct trained with TOPR on its own graded samples, on the CPU: a real model that
# measurably improves (docs/study.md has the result and its reading).
#
#   scripts/smollm2_rl.sh [WORK] [ITERATIONS] [ARMS]
#
# Defaults: runs/smollm2-rl, 1 iteration, the arms sft,reinforce. Stages (each resumes, none is
# redone on a rerun):
#   1. `iterate`: greedy pass@1 of the model on 512 held-out synthetic problems (difficulty 1,
#      chat prompts, a 128-token budget), then per iteration 4 samples (temperature 1) for each of
#      256 training problems, graded, one epoch of TOPR (baseline for p̃ = 0.5, AdamW lr 2e-5,
#      batch 16), and the held-out evaluation again;
#   2. `compare`: SFT on the positives and naive REINFORCE trained on iteration 1's data set from
#      the same model with the same settings, on the same held-out problems, paired with TOPR.
# Each stage's wall time goes to WORK/times.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-runs/smollm2-rl}"
iterations="${2:-1}"
arms="${3:-sft,reinforce}"
scripts/smollm2.sh
source scripts/env.sh
cargo build --release -p topr-llama
llama=target/release/llama
mkdir -p "$work"
timed() { local t0=$SECONDS; "$@"; echo "$1 $2: $((SECONDS - t0)) s" >> "$work/times.txt"; }
timed "$llama" iterate --model models/smollm2-135m-instruct --work "$work" \
    --task synthetic --difficulty 1 --synthetic-n 256 --task-seed 1 --samples-per-prompt 4 --batch-prompts 8 \
    --max-new-tokens 128 --eval-n 512 --eval-batch-size 32 --iterations "$iterations" \
    --objective topr --target-positive-proportion 0.5 --lr 2e-5 --batch-size 16 --micro-batch-size 8 \
    --save-every 0 --resume
timed "$llama" compare --run "$work" --iteration 1 --arms "$arms"
