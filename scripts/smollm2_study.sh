#!/usr/bin/env bash
# The real-model study: SmolLM2-135M-Instruct over seeds (TOPR against SFT on the positives,
# naive REINFORCE and TIS with TOPR's baseline; the composition sweep p~ in {0.05, 0.1, 0.2, 0.5};
# TOPR over 2 iterations), on the CPU. docs/study.md has the results and their reading.
#
#   scripts/smollm2_study.sh [SEEDS] [WORK]
#
# SEEDS: the number of seeds (default 5; the seeds 0..SEEDS). WORK: the study's work directory
# (default ~/.cache/topr-loss/runs/smollm2-study, outside the clone, so that a later clone on the
# same machine resumes it). Resumable: rerun the same command; finished stages are reused, an
# interrupted training resumes from its last saved step. A seed takes several hours on 2 cores.
# After the study (or when interrupted), the small records of what finished — settings,
# per-question results, evaluation summaries, training metrics, the tables and plots; never model
# weights or data sets, nor the seeds' shared/ folders, whose files every arm holds a copy of —
# are copied to docs/study/real/.
#
# One binary for every seed: the first run copies target/release/llama to WORK/bin/llama (with
# the commit it was built from in WORK/bin/commit.txt) and every resume runs that copy, so that
# a later version of the sampler (other random streams) never mixes into a grid started before
# it. To rebuild the binary of a grid: `git checkout $(cat WORK/bin/commit.txt)` and build.
set -euo pipefail
cd "$(dirname "$0")/.."
seeds="${1:-5}"
work="${2:-$HOME/.cache/topr-loss/runs/smollm2-study}"
scripts/smollm2.sh
source scripts/env.sh
cargo build --release -p topr-llama
copy_records() {
    local out=docs/study/real
    mkdir -p "$out"
    (cd "$work" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.txt' \) \
        ! -name 'data.jsonl' ! -path '*/shared/*' ! -path '*/model/*' ! -path '*/state*' ! -name '*.lock' \
        -print0) | while IFS= read -r -d '' f; do
        mkdir -p "$out/$(dirname "$f")"
        cp "$work/$f" "$out/$f"
    done
}
trap copy_records EXIT
mkdir -p "$work"
if [ ! -x "$work/bin/llama" ]; then
    mkdir -p "$work/bin"
    cp target/release/llama "$work/bin/llama.part" && mv "$work/bin/llama.part" "$work/bin/llama"
    git rev-parse HEAD > "$work/bin/commit.txt"
fi
echo "study binary: $work/bin/llama, built from commit $(cat "$work/bin/commit.txt")"
/usr/bin/time -f "study: %e s" -a -o "$work/times.txt" "$work/bin/llama" study --work "$work" \
    --model models/smollm2-135m-instruct --claims real-negatives,real-composition,real-iterated --seeds "$seeds"
