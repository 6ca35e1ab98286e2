#!/usr/bin/env bash
# Other arms on the SmolLM2 grid's data, seed by seed (`llama compare`), with their records.
#
#   scripts/smollm2_compare.sh ARMS [SEEDS] [WORK]
#   scripts/smollm2_compare.sh topr-p0.9        # p̃ = 0.9 on the grid's five seeds
#
# For each seed N of the grid that scripts/smollm2_study.sh ran in WORK (default
# ~/.cache/topr-loss/runs/smollm2-study), the seed's TOPR arm (real-topr-p0.5, an `iterate` run)
# is copied, without its models, to WORK/compare/seed-N, with the seed's first data set (the
# one every arm of the seed trains on, in its shared/ folder). `llama compare --arms ARMS` then
# trains each arm from the initial model on that data set with the TOPR arm's settings (only the
# objective and the baseline differ) and evaluates it greedily on the same held-out questions,
# paired with TOPR's: compare.md and compare.jsonl give each arm's accuracy and its difference
# to TOPR (p̃ = 0.5) with its standard error over the questions. The grid's own binary runs it
# (WORK/bin/llama, subnormals flushed as in the grid), so the arms are trained as the grid's.
# Resumable: rerun the same command; finished arms are reused. About 12 minutes an arm and a
# seed on 2 cores of an Intel Xeon (2026-12-06). The records (compare-iter-1/ without models) are copied to
# docs/study/real-compare/seed-N/ after each seed, and summarised over seeds by
# scripts/compare_over_seeds.py.
set -euo pipefail
source "$(dirname "$0")/absolute.sh"
cd "$(dirname "$0")/.."
arms="${1:?usage: scripts/smollm2_compare.sh ARMS [SEEDS] [WORK]}"
seeds="${2:-5}"
work=$(absolute "${3:-$HOME/.cache/topr-loss/runs/smollm2-study}")
records=$PWD/docs/study/real-compare
[ -x "$work/bin/llama" ] || { echo "smollm2_compare.sh: $work/bin/llama is missing: run scripts/smollm2_study.sh first" >&2; exit 2; }
source scripts/env.sh
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
gcc -O2 -shared -fPIC -o "$work/bin/flush_subnormals.so" scripts/flush_subnormals.c
for ((seed = 0; seed < seeds; seed++)); do
    from=$work/seed-$seed/real-topr-p0.5
    # The seed's first data set: the one in shared/ whose run record is the TOPR arm's.
    data=
    for d in "$work/seed-$seed"/shared/*/iter-1-data.jsonl; do
        if [ -f "$d" ] && cmp -s "$d.run.json" "$from/iter-1/data.jsonl.run.json"; then data=$d; fi
    done
    if [ ! -f "$from/iter-1/eval.questions.jsonl" ] || [ -z "$data" ]; then
        echo "smollm2_compare.sh: seed $seed has not finished its TOPR arm's first iteration in $work" >&2
        exit 2
    fi
    run=$work/compare/seed-$seed
    if [ ! -d "$run" ]; then
        mkdir -p "$work/compare"
        rm -rf "$run.part"
        mkdir "$run.part"
        tar -C "$from" --exclude=./iter-\*/model --exclude=./iter-\*/state -cf - . | tar -C "$run.part" -xf -
        cp "$data" "$run.part/iter-1/data.jsonl"
        cp "$data.run.json" "$run.part/iter-1/data.jsonl.run.json"
        mv "$run.part" "$run"
    fi
    echo "seed $seed: llama compare --run $run --arms $arms"
    LD_PRELOAD="$work/bin/flush_subnormals.so" "$work/bin/llama" compare --run "$run" --arms "$arms"
    mkdir -p "$records/seed-$seed"
    (cd "$run/compare-iter-1" && find . -type f ! -path '*/model/*' ! -path '*/state*' ! -name LOCK ! -name '*.lock' -print0 |
        xargs -0 -I{} sh -c 'mkdir -p "$(dirname "$1/$0")" && cp "$0" "$1/$0"' {} "$records/seed-$seed")
done
python3 scripts/compare_over_seeds.py "$records"
