#!/usr/bin/env bash
# The real-model study: SmolLM2-135M-Instruct over seeds (TOPR against SFT on the positives,
# naive REINFORCE and TIS with TOPR's baseline; the composition sweep p~ in {0.05, 0.1, 0.2, 0.5};
# TOPR over 2 iterations), on the CPU. docs/study.md has the results and their reading.
#
#   scripts/smollm2_study.sh [SEEDS] [WORK]
#   scripts/smollm2_study.sh --copy-records [WORK]      # only copy WORK's records to docs/study/real/
#                                                       # and draw their tables and plots there
#                                                       # (for the seeds WORK has)
#   scripts/smollm2_study.sh --restore-records [WORK]   # only put docs/study/real/'s back into WORK
#
# TOPR_STUDY_RECORDS names another records folder than docs/study/real (for tests);
# TOPR_STUDY_REPORT=0 copies the records without drawing their tables (for tests);
# TOPR_STUDY_SUBNORMALS=keep runs the grid's binary without subnormals flushed (see below).
# WORK/progress.txt logs when each arm starts and on which CPU; WORK/times.txt each pass's time.
# Both go on across machines: a copy or a restore merges the two logs' lines (never drops one).
# SEEDS: the number of seeds (default 5; the seeds 0..SEEDS). WORK: the study's work directory
# (default ~/.cache/topr-loss/runs/smollm2-study, outside the clone, so that a later clone on the
# same machine resumes it; a relative WORK or TOPR_STUDY_RECORDS is taken from the folder the
# script is called from). Stop it with Ctrl-C or `kill PID`: it stops the study, then copies the
# records of what finished. Resumable: rerun the same command; finished stages are reused, an
# interrupted training resumes from its last saved step. A seed takes several hours on 2 cores.
# On another machine (or after WORK is lost), the records committed in docs/study/real/ are put
# back into WORK first (never over a file WORK has): finished iterations are not run again, and
# a model that an unfinished iteration starts from is trained again from its recorded seeds (on
# its restored data set, or one sampled again), checked against its record.
# After the study (or when interrupted), the records of what finished — settings, per-question
# results, evaluation summaries, training metrics, each arm's plot, and the sampled data sets
# (each once, about 4 MB each: a seed's first, in its shared/ folder, which a restored grid takes
# instead of sampling it again, and the iterated arm's later ones, records only: they were sampled
# from a model of the work directory, which a new one trains again); never model weights — are copied to
# docs/study/real/, and the study's tables and plots there (study.md, study.jsonl,
# study-sampled.jsonl, claim-*.png) are drawn from those records with this clone's `llama` (`study
# --report-only`): the statistics are those of the current version, the runs those of the grid's
# (scripts/check_real_study.py recomputes every cell from the records).
#
# The grid runs in two passes: the real-negatives and real-iterated claims over every seed, then
# every claim (the second pass reuses what the first finished; the order changes no number).
#
# One binary for every seed: the grid's commit is commit.txt of the records folder (written by the
# first run, from HEAD). The binary is built from that commit — here when HEAD is it, else in a
# git worktree at WORK/src — and copied to WORK/bin/llama, which every resume runs, so that a
# later version of the sampler (other random streams) never mixes into a grid started before it.
set -euo pipefail
# WORK and TOPR_STUDY_RECORDS are taken from the folder the script is called from; the rest of the
# script runs in the clone's root, with both made absolute (the records' clean-up compares them
# from inside the records folder).
source "$(dirname "$0")/absolute.sh"
cd "$(dirname "$0")/.."
only=
case "${1:-}" in
    --copy-records | --restore-records) only=$1; shift; set -- 5 "$@" ;;
esac
records=$PWD/docs/study/real
[ -z "${TOPR_STUDY_RECORDS:-}" ] || records=$(absolute "$TOPR_STUDY_RECORDS")
seeds="${1:-5}"
work=$(absolute "${2:-$HOME/.cache/topr-loss/runs/smollm2-study}")
# A copy draws the tables of the seeds the work directory has (the grid's SEEDS).
if [ "$only" = --copy-records ]; then
    have=$(find "$work" -maxdepth 1 -type d -name 'seed-*' 2> /dev/null | wc -l)
    [ "$have" -gt 0 ] && seeds=$have
fi
model=models/smollm2-135m-instruct
claims=real-negatives,real-composition,real-iterated
# A data set's record names the model it was sampled from by its path: the base model's key in
# this clone (records from a clone elsewhere name another path).
base_model_key() {
    printf '"path": "%s/%s"' "$(pwd -P)" "$model"
}
copy_records() {
    local out=$records
    mkdir -p "$out"
    # A seed's arms hold copies of its shared first data set (iter-1/data.jsonl): the shared
    # folder's (iter-1-data.jsonl) is copied, theirs not.
    (cd "$work" && find . -type f ! -path '*/model/*' ! -path '*/state*' ! -name '*.lock' \
        ! -path './bin/*' ! -path './src/*' ! -path ./times.txt ! -path ./progress.txt \
        ! -path ./study.md ! -path ./study.jsonl ! -path ./study-sampled.jsonl ! -path './claim-*.png' \( \
        \( \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.txt' \) \
            ! -name 'data.jsonl' ! -path '*/shared/*' \) \
        -o \( -path '*/shared/*' \( -name 'iter-1-data.jsonl' -o -name 'iter-1-data.jsonl.run.json' \) \) \
        -o \( -name 'data.jsonl' ! -path '*/shared/*' ! -path '*/iter-1/*' \) \) \
        -print0) | while IFS= read -r -d '' f; do
        mkdir -p "$out/$(dirname "$f")"
        cp "$work/$f" "$out/$f"
    done
    merge_logs "$work" "$out"
    # A record the work directory no longer has is a stage the study made again (an iteration
    # whose rebuilt training differed from its record, and the iterations after it): it goes, so
    # that a restore never brings back a result of the model before. A data set sampled in a clone
    # elsewhere stays: it is never restored here, so its absence says nothing (a data set sampled
    # from a model of this work directory, a later iteration's, is this grid's own).
    local key here
    key=$(base_model_key)
    here="\"path\": \"$(cd "$work" && pwd -P)/"
    # Only the kinds a restore brings back (settings, results, data sets: .json and .jsonl) in the
    # seeds' folders, and only from a work directory the study has run in (its study.json).
    [ -f "$work/study.json" ] || return 0
    local gone
    gone=$(cd "$out" && find . -path './seed-*' -type f \( -name '*.json' -o -name '*.jsonl' \) -print0 | while IFS= read -r -d '' f; do
        [ -e "$work/$f" ] && continue
        case "$f" in
            *data.jsonl) grep -qF -e "$key" -e "$here" "$f.run.json" 2>/dev/null || continue ;;
            *data.jsonl.run.json) grep -qF -e "$key" -e "$here" "$f" || continue ;;
        esac
        # A later iteration's data set (sampled from a model of the work directory) is never put
        # back: in a work directory restored from the records it is missing while its iteration's
        # training record is there, and the training it recorded stands (an iteration made again
        # loses its whole folder first).
        case "$f" in
            *data.jsonl | *data.jsonl.run.json)
                if [ -e "$work/$(dirname "$f")/train.done.json" ] || [ -e "$work/$(dirname "$f")/train.done.recorded.json" ]; then
                    continue
                fi ;;
        esac
        printf '%s\n' "$f"
    done)
    [ -z "$gone" ] || (cd "$out" && printf '%s\n' "$gone" | while IFS= read -r f; do rm -f "$f"; done)
    find "$out" -mindepth 1 -type d -empty -delete
}
# The tables and plots of the records, drawn by this clone's `llama` (built here) in the records
# folder itself: every number in them can be recomputed from the files beside them.
report() {
    [ "${TOPR_STUDY_REPORT:-1}" != 0 ] || return 0
    source scripts/env.sh > /dev/null
    cargo build --release -p topr-llama -q
    # No --model: the tables come from the records alone (the weights need not be here).
    "${CARGO_TARGET_DIR:-target}/release/llama" study --work "$records" --claims "$claims" \
        --seeds "$seeds" --report-only
}
restore_records() {
    local from=$records
    [ -d "$from" ] || return 0
    # A data set's record names the model by its path: one sampled in a clone elsewhere would
    # be refused as sampled otherwise, so it is left out and sampled again.
    local key
    key=$(base_model_key)
    (cd "$from" && find . -type f \( -name '*.json' -o -name '*.jsonl' \) -print0) | while IFS= read -r -d '' f; do
        case "$f" in
            *data.jsonl) grep -qF "$key" "$from/$f.run.json" 2>/dev/null || continue ;;
            *data.jsonl.run.json) grep -qF "$key" "$from/$f" || continue ;;
        esac
        if [ ! -e "$work/$f" ]; then
            mkdir -p "$work/$(dirname "$f")"
            cp "$from/$f" "$work/$f"
        fi
    done
    # The grid's logs of wall time go on in the new work directory (a copy would otherwise lose
    # them).
    merge_logs "$from" "$work"
}
# Merges the grid's logs of wall time of folder $1 into folder $2's: $2's lines, then those of
# $1 that $2 lacks (counted: a line twice in $1 and once in $2 is added once), so that two
# machines that took turns on one grid lose no line, and merging again adds nothing.
# progress.txt's lines, each dated, are then put in order of their dates (stable: lines of one
# second keep their order).
merge_logs() {
    local log
    for log in times.txt progress.txt; do
        [ -f "$1/$log" ] || continue
        awk 'NR == FNR { n[$0]++; print; next } n[$0] > 0 { n[$0]--; next } { print }' \
            "$2/$log" "$1/$log" 2> /dev/null > "$2/$log.part" || cp "$1/$log" "$2/$log.part"
        if [ "$log" = progress.txt ]; then
            LC_ALL=C sort -s -k1,1 "$2/$log.part" > "$2/$log.sorted" && mv "$2/$log.sorted" "$2/$log.part"
        fi
        mv "$2/$log.part" "$2/$log"
    done
}
# Passes the study's stderr through, and appends its progress lines (`[study N s] seed S, arm A
# (k/n)`: the start of each arm) to WORK/progress.txt with the date and time: each arm's wall
# time is the gap to the next line.
# A line it fails to write is lost, never the study: were it to stop, the study would die of
# SIGPIPE at its next line.
stamp_progress() {
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        printf '%s\n' "$line" || true
        case "$line" in
            '[study '*) printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$line" >> "$work/progress.txt" || true ;;
        esac
    done
}
# One pass of the study over claims $1, its stderr through stamp_progress; it returns once the
# pass's last progress line is written, so that the records copied after it have it. In a group,
# so that the shell itself opens the process substitution and sets $! to it (on a plain external
# command the child opens it and $! stays unset, which `set -u` refuses).
run_pass() {
    local status=0
    {
        /usr/bin/time -f "study ($1): %e s" -a -o "$work/times.txt" env LD_PRELOAD="$preload" \
            "$work/bin/llama" study --work "$work" --model "$model" --claims "$1" --seeds "$seeds"
    } 2> >(stamp_progress >&2) || status=$?
    wait "$!" 2> /dev/null || true
    return "$status"
}
# The rest runs for hours: braced, so that bash has read all of it before it starts (an edit of
# this file meanwhile changes nothing of a grid in progress), and it exits before reading on.
{
case "$only" in
    --copy-records) copy_records; report; exit 0 ;;
    --restore-records) mkdir -p "$work"; restore_records; exit 0 ;;
esac
scripts/smollm2.sh
source scripts/env.sh
mkdir -p "$work"
restore_records
trap 'copy_records; report' EXIT
pin=$records/commit.txt
mkdir -p "$(dirname "$pin")"
[ -f "$pin" ] || git rev-parse HEAD > "$pin"
commit=$(cat "$pin")
if [ ! -x "$work/bin/llama" ]; then
    mkdir -p "$work/bin"
    if [ "$commit" = "$(git rev-parse HEAD)" ] && git diff --quiet HEAD -- src examples dist Cargo.toml; then
        cargo build --release -p topr-llama
        built=${CARGO_TARGET_DIR:-target}/release/llama
    else
        # The grid's own commit, built beside the clone (in a target folder of its own).
        [ -d "$work/src" ] || git worktree add --detach "$work/src" "$commit"
        (cd "$work/src" && CARGO_TARGET_DIR="$OLDPWD/target/study-grid" cargo build --release -p topr-llama)
        built=target/study-grid/release/llama
    fi
    cp "$built" "$work/bin/llama.part"
    mv "$work/bin/llama.part" "$work/bin/llama"
    echo "$commit" > "$work/bin/commit.txt"
fi
echo "study binary: $work/bin/llama, built from commit $(cat "$work/bin/commit.txt")"
# The grid runs for hours beside other work on the same cores: OpenMP's threads sleep while they
# wait instead of spinning (with the cores shared, spinning took most of the grid's CPU time in
# a profile). The numbers do not depend on it.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# Two passes of the same study: real-negatives and real-iterated over every seed first (TOPR,
# over its two iterations, against SFT, naive REINFORCE and TIS: the central question, answered
# over all the seeds before the rest), then every claim (the composition arms). Each arm is
# seeded by its seed alone, so the order changes no number; the second pass reuses everything
# the first finished. TOPR's second iteration stays in the first pass because it starts from the
# first iteration's weights, which the records do not keep: trained again on another CPU, they
# could differ in the last bits, and the study would then redo the arm's evaluations.
# Subnormal floats flushed to zero in the grid's binary, which predates the binary doing so
# itself (topr_llama::subnormal): a collapsing arm's probabilities below 1.2e-38 put the CPU on its
# slow path (naive REINFORCE's steps went from 11 s to about 200 s). Preloaded from
# scripts/flush_subnormals.c; TOPR_STUDY_SUBNORMALS=keep runs without it. Since
# 2026-12-05T19:24Z (progress.txt says which arms ran with it); before, every arm kept them.
preload=
if [ "${TOPR_STUDY_SUBNORMALS:-flush}" != keep ]; then
    gcc -O2 -shared -fPIC -o "$work/bin/flush_subnormals.so" scripts/flush_subnormals.c
    preload="$work/bin/flush_subnormals.so"
    # The loader splits LD_PRELOAD at spaces and colons, and would run the grid unflushed.
    case "$preload" in
        *[[:space:]:]*) echo "smollm2_study.sh: the work directory's path ($work) has a space or a colon, which LD_PRELOAD cannot name; choose another WORK" >&2; exit 2 ;;
    esac
else
    # A grid pinned at a commit whose binary flushes them itself keeps them only when told.
    export TOPR_SUBNORMALS=keep
fi
cpu=$(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo)
printf '%s start: commit %s, %s, %s cores, subnormals %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$commit" \
    "${cpu:-unknown CPU}" "$(nproc)" "$([ -n "$preload" ] && echo flushed || echo kept)" >> "$work/progress.txt"
# Each pass runs as a job of its own process group, so that a TERM, HUP or INT sent to this
# script stops the study (the whole group) before the EXIT trap copies its records; bash alone
# would run the trap at once and leave the study running, writing what the trap copies.
for pass_claims in real-negatives,real-iterated "$claims"; do
    status=0
    set -m
    run_pass "$pass_claims" &
    pass=$!
    set +m
    trap 'kill -TERM -- -"$pass" 2> /dev/null || true; wait "$pass" || true; exit 143' TERM HUP INT
    wait "$pass" || status=$?
    trap - TERM HUP INT
    [ "$status" = 0 ] || exit "$status"
done
exit
}
