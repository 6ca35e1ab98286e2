#!/usr/bin/env bash
# The GPU check of topr-loss's Llama example, run from a bundle made by scripts/gpu_bundle.sh.
# Needs only bash, python3 with the torch the bundle was built against (a CUDA build for a GPU
# run), and nvidia-smi for the memory column: no Rust, no network, no download.
#
#   ./run.sh OUT_DIR                            # on the GPU: the measured check (at most 9 min on one H200)
#   ./run.sh OUT_DIR --device cpu --size tiny   # the same stages at toy sizes on the CPU (CI)
#   ./run.sh OUT_DIR --pack RESULTS.tgz         # also OUT_DIR packed into one file after every stage
#
# --deadline S: the stages' time in all (default 510 s at full size, none at tiny): each stage's
# limit is cut to what is left, and a stage that would get under 30 s is skipped (status
# "skipped" in stages.jsonl), so that a run ends inside a machine's time however slow a stage is.
# The stages run in the order of what matters most: the generation figures, transformers eager,
# the demo, transformers compiled, parity, the profile of a decoding step, the objectives and
# data parallelism, the losses.
# --pack FILE: after every stage, OUT_DIR (without the models, which live elsewhere) is written to
# FILE as a gzipped tar, replaced atomically: a run killed at any point leaves one whole file of
# what had finished, for machines that send back only a few files. report.py can redraw the
# table from the unpacked folder.
# PYTHON (default python3) names the interpreter whose torch provides libtorch. The models and
# training folders go to a temporary folder (TMPDIR), removed at the end.
# Writes to OUT_DIR: stages.jsonl (one line per stage: seconds, peak GPU MiB, exit status),
# logs/STAGE.out and .err (each stage's JSON lines and log), summary.json and table.md (made
# by report.py from them), and plots/ (the demo's). Exits 1 when a stage failed.
set -uo pipefail

usage() { echo "usage: $0 OUT_DIR [--device cuda|cpu] [--size full|tiny] [--deadline S] [--pack FILE]" >&2; exit 2; }
die() { echo "run.sh: $*" >&2; exit 2; }
# limited SECONDS COMMAND...: COMMAND under a time limit, killed 10 s after its SIGTERM if it
# ignores it (exit 124 on the limit, 137 when it had to be killed). Every step runs under one.
limited() { local limit=$1; shift; timeout -k 10 "$limit" "$@"; }

[ $# -ge 1 ] || usage
out=$1; shift
device=cuda
size=full
deadline=
pack=
while [ $# -gt 0 ]; do
    case "$1" in
        --device) [ $# -ge 2 ] || usage; device=$2; shift 2 ;;
        --size) [ $# -ge 2 ] || usage; size=$2; shift 2 ;;
        --deadline) [ $# -ge 2 ] || usage; deadline=$2; shift 2 ;;
        --pack) [ $# -ge 2 ] || usage; pack=$2; shift 2 ;;
        *) usage ;;
    esac
done
case "$deadline" in '' | *[!0-9]*) [ -z "$deadline" ] || die "--deadline: expected whole seconds, got '$deadline'" ;; esac
[ -z "$deadline" ] || deadline=$((10#$deadline))  # 08 and 0510 as decimal
if [ -n "$pack" ]; then
    pack_dir=$(cd "$(dirname "$pack")" 2>/dev/null && pwd) || die "--pack: the folder of '$pack' does not exist"
    pack="$pack_dir/$(basename "$pack")"
fi
case "$device" in cpu|cuda|cuda:[0-9]*) ;; *) die "--device: expected cpu, cuda or cuda:N, got '$device'" ;; esac
case "$size" in full|tiny) ;; *) die "--size: expected full or tiny, got '$size'" ;; esac

here=$(cd "$(dirname "$0")" && pwd)
bin="$here/llama"
[ -x "$bin" ] || die "$bin is missing: run scripts/gpu_bundle.sh to make the bundle"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || die "$PY not found (set PYTHON to a python with torch)"

# libtorch: the torch package of python3, which must be the version the binary was built against.
torch_dir=$(limited 120 "$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) \
    || die "$PY cannot import torch"
torch_version=$(limited 120 "$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
want=$(cat "$here/TORCH_VERSION")
[ "$torch_version" = "$want" ] || die "the bundle was built for torch $want, $PY has torch $torch_version"
export LD_LIBRARY_PATH="$torch_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The bundle's font for the plots, unless the caller names one.
[ -f "$here/font.ttf" ] && export TOPR_PLOT_FONT=${TOPR_PLOT_FONT:-$here/font.ttf}

if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
    die "$out exists and is not empty: choose a new folder"
fi
mkdir -p "$out" || die "cannot create $out"
out=$(cd "$out" && pwd)
case "$pack" in "$out"/*) rmdir "$out" 2>/dev/null; die "--pack: '$pack' lies inside $out, which it packs: choose a file outside it" ;; esac
mkdir -p "$out/logs" "$out/plots" || die "cannot create $out"
W=$(mktemp -d "${TMPDIR:-/tmp}/topr-gpu-check.XXXXXX") || die "cannot create a work folder in ${TMPDIR:-/tmp}"
start=$(date +%s)

# The sizes. full: Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query and 8 key-value heads,
# MLP 8192, its 128,256-entry vocabulary; tied embeddings, 1.24 B parameters) for throughput and
# parity; a 4-layer model for the objectives; the demo's GPU scale. tiny: toy sizes, same stages.
if [ "$size" = full ]; then
    big=(--layers 16 --hidden 2048 --heads 32 --kv-heads 8 --intermediate 8192 --max-positions 2048 --vocab-size 128256)
    small=(--layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 768 --max-positions 512)
    bench=(--new-tokens 128 --gen-batch 1,16,64,256 --train-batch 16 --train-len 1024 --sample-prompts 64 --sample-slots 64 --sample-stop-every 64)
    profile=(--new-tokens 32 --gen-batch 1 --train-batch 1 --train-len 16 --profile-batch 1,64)
    bench_hf=(128 16 1024 --gen-batch 1,16,64,256)
    bench_hf_compiled=(128 16 1024 --gen-batch 1,64 --mode static-compile)
    parity=(--prompts 4 --len 64 --new-tokens 32)
    peak=(--n 8192)
    losses=(--batch 512 --len 2048 --iters 20)
    demo=(--scale gpu)
    problems=128; demo_limit=300; deadline=${deadline:-510}
else
    big=(--layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 --max-positions 256 --vocab-size 2048)
    small=(--layers 1 --hidden 32 --heads 2 --kv-heads 1 --intermediate 64 --max-positions 256)
    bench=(--new-tokens 8 --gen-batch 1,4 --train-batch 2 --train-len 64 --sample-prompts 4 --sample-slots 4 --sample-stop-every 64)
    profile=(--new-tokens 8 --gen-batch 1 --train-batch 1 --train-len 16 --profile-batch 1)
    bench_hf=(8 2 64 --gen-batch 1,4)
    bench_hf_compiled=(8 2 64 --gen-batch 1 --mode static-compile)
    parity=(--prompts 2 --len 16 --new-tokens 8)
    peak=(--n 256)
    losses=(--batch 8 --len 64 --iters 3)
    demo=(--quick)
    problems=16; demo_limit=300
fi
dev=(--device "$device")
[ "$device" = cpu ] && half=(--dtype f32) || half=(--dtype bf16)
failed=0

# The background memory poller of the running stage, stopped however the run ends.
poll=""
stop_poll() { [ -n "$poll" ] && { kill "$poll" 2>/dev/null; wait "$poll" 2>/dev/null; }; poll=""; }
trap 'stop_poll; rm -rf "$W"' EXIT
trap 'stop_poll; rm -rf "$W"; exit 130' INT TERM

# packed: OUT_DIR into --pack's file (written beside it, then renamed over it).
packed() {
    [ -n "$pack" ] || return 0
    tar -czf "$pack.part" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null && mv -f "$pack.part" "$pack"
}

# A TCP port free on the loopback now, for a launched group's rendezvous.
free_port() { limited 20 "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# stage NAME LIMIT_S COMMAND...: runs COMMAND with its stdout and stderr in logs/, under a time
# limit, polling the GPU's used memory every 100 ms, and appends one line to stages.jsonl.
stage() {
    local name=$1 limit=$2; shift 2
    local t0 t1 rc peak="null"
    if [ -n "$deadline" ]; then
        local left=$(( deadline - ($(date +%s) - start) ))
        if [ "$left" -lt 30 ]; then
            echo "[$(( $(date +%s) - start )) s] $name: skipped ($left s left of the ${deadline} s deadline)" >&2
            printf '{"stage":"%s","status":"skipped","exit":0,"seconds":0,"peak_mib":null}\n' "$name" >> "$out/stages.jsonl"
            packed
            return 1
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    if [ "$device" != cpu ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$out/logs/$name.mem" 2>/dev/null &
        poll=$!
    fi
    echo "[$(( $(date +%s) - start )) s] $name" >&2
    t0=$(date +%s.%N); local began=$(date +%s)
    limited "$limit" "$@" > "$out/logs/$name.out" 2> "$out/logs/$name.err"
    rc=$?
    t1=$(date +%s.%N)
    if [ -n "$poll" ]; then
        stop_poll
        peak=$(sort -n "$out/logs/$name.mem" | tail -1); peak=${peak:-null}
    fi
    local status=ok
    [ $rc -eq 0 ] || { status=failed; failed=1; }
    # 124: stopped at the limit; 137 after the limit: killed for ignoring the stop.
    if [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ $(( $(date +%s) - began )) -ge "$limit" ]; }; then status=timeout; fi
    printf '{"stage":"%s","status":"%s","exit":%d,"seconds":%s,"peak_mib":%s}\n' \
        "$name" "$status" "$rc" "$(limited 20 "$PY" -c "print(round($t1 - $t0, 2))")" "$peak" >> "$out/stages.jsonl"
    [ $rc -eq 0 ] || echo "  $name: $status (exit $rc): $(tail -2 "$out/logs/$name.err" | tr '\n' ' ')" >&2
    # A training's metrics, for the report (the work folder is not kept).
    [ -f "$W/$name/metrics.jsonl" ] && cp "$W/$name/metrics.jsonl" "$out/logs/$name.metrics.jsonl"
    packed
    return $rc
}

# The machine, for the report.
limited 60 "$PY" - "$device" > "$out/machine.json" <<'PY'
import json, platform, sys, torch
d = sys.argv[1]
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "cpu_threads": torch.get_num_threads(), "device": d}
if d != "cpu" and torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
print(json.dumps(info))
PY

stage init-big 300 "$bin" init --out "$W/big" "${big[@]}"
cp "$W/big/config.json" "$out/big-config.json" 2>/dev/null
stage init-small 60 "$bin" init --out "$W/small" "${small[@]}"
stage peak 60 "$bin" check peak "${dev[@]}" "${peak[@]}"
# Generation eager and replaying CUDA graphs of the decoding step, side by side (--cuda-graphs:
# on a CUDA device `bench` measures both), with the share of the bandwidth limit; the sampling
# workload with continuous and with draining batches.
stage bench 300 "$bin" bench --model "$W/big" "${dev[@]}" "${half[@]}" "${bench[@]}" --cuda-graphs
# transformers on the same model, sizes and dtype, where python3 has it (the GPU machine's image
# does; CI's torch-only venv does not, and the stage is then left out of the report).
if limited 120 "$PY" -c 'import transformers' 2>/dev/null; then
    stage bench-transformers 240 "$PY" "$here/bench_hf.py" "$W/big" "${bench_hf[@]}" --device "${device/cuda:*/cuda}" \
        --dtype "${half[1]}"
fi
# The demo: a model from scratch, the sloppy teacher's warm-up, then TOPR iterations (at most 5
# minutes; a demo stopped by its limit still reports the iterations it finished).
stage demo "$demo_limit" "$bin" demo --work "$W/demo" "${dev[@]}" "${demo[@]}" --cuda-graphs
cp "$W"/demo/topr/*.png "$W"/demo/warm-up/*.png "$out/plots/" 2>/dev/null
cp "$W/demo/topr/iterations.jsonl" "$out/demo-iterations.jsonl" 2>/dev/null
packed
# transformers' fastest decoding (static cache + torch.compile, CUDA graphs), on the GPU only: on
# the CPU compiling needs a C++ toolchain the bundle does not assume.
if [ "$device" != cpu ] && limited 120 "$PY" -c 'import transformers' 2>/dev/null; then
    stage bench-transformers-compiled 240 "$PY" "$here/bench_hf.py" "$W/big" "${bench_hf_compiled[@]}" \
        --device "${device/cuda:*/cuda}" --dtype "${half[1]}"
fi
stage parity 240 "$bin" check parity --model "$W/big" "${dev[@]}" "${parity[@]}"
# Where a decoding step's time goes: a short generation at batch 1 and 64, eager and replaying
# graphs, recorded by libtorch's profiler (bench --profile, in a process of its own: a profiler
# that fails, or CUPTI staying attached after it, touches no other stage's figures), each run
# summarised in a line (kernels and launches a step, the device's busy share, copies to the host,
# the costliest kernels). Its traces, a few MB each, are left in the work folder and removed.
stage profile 120 "$bin" bench --model "$W/big" "${dev[@]}" "${half[@]}" "${profile[@]}" --cuda-graphs --profile "$W/profiles"

# Every objective a few steps, with AdamW and with Adafactor, on the small model's graded samples.
# A random model answers nothing right: the first completion of every question is marked correct,
# so that every objective (DPO's pairs, GRPO's groups) has work to do.
task=(--task synthetic --difficulty 1 --max-new-tokens 24)
if stage sample 120 "$bin" sample --model "$W/small" "${dev[@]}" "${half[@]}" "${task[@]}" --synthetic-n "$problems" \
        --samples-per-prompt 4 --batch-prompts 16 --out "$W/samples.jsonl"; then
    limited 60 "$PY" - "$W/samples.jsonl" "$W/mixed.jsonl" <<'PY'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as out:
    for line in f:
        r = json.loads(line)
        r["correct"] = r["sample"] == 0
        r["reward"] = 1.0 if r["correct"] else -1.0
        out.write(json.dumps(r) + "\n")
PY
    # Data parallelism (docs/distributed.md): the TOPR run as a launched group of one rank, so the
    # c10d path (rendezvous, all-reduce of the counts on Gloo and of every gradient on NCCL, device
    # to device, where the build has NCCL) runs on the device; then the same with Gloo staging the
    # gradients through the host (TOPR_DIST_BACKEND=gloo). Their times beside train-topr-adamw's
    # are their overheads. On the CPU both are Gloo.
    stage train-topr-dp1 60 env RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" "$bin" train \
        --model "$W/small" "${dev[@]}" "${half[@]}" --data "$W/mixed.jsonl" --out "$W/train-topr-dp1" \
        --objective topr --optimizer adamw --lr 1e-5 --batch-size 32 --micro-batch-size 16 --save-every 0
    stage train-topr-dp1-gloo 60 env TOPR_DIST_BACKEND=gloo RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT="$(free_port)" "$bin" train --model "$W/small" "${dev[@]}" "${half[@]}" --data "$W/mixed.jsonl" \
        --out "$W/train-topr-dp1-gloo" --objective topr --optimizer adamw --lr 1e-5 --batch-size 32 \
        --micro-batch-size 16 --save-every 0
    for objective in topr tis sft reinforce is ppo grpo dpo; do
        for optimizer in adamw adafactor; do
            stage "train-$objective-$optimizer" 60 "$bin" train --model "$W/small" "${dev[@]}" "${half[@]}" \
                --data "$W/mixed.jsonl" --out "$W/train-$objective-$optimizer" --objective "$objective" \
                --optimizer "$optimizer" --lr 1e-5 --batch-size 32 --micro-batch-size 16 --save-every 0
        done
    done
fi


stage losses 120 "$bin" check losses "${dev[@]}" "${losses[@]}"
# The PyTorch side gets the allocator settings the llama binary gives itself (main.rs,
# keep_freed_memory), so that on the CPU both sides allocate alike.
stage losses-pytorch 120 env MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 \
    MALLOC_TOP_PAD_=67108864 "$PY" "$here/losses_torch.py" --device "${device/cuda:*/cuda}" "${losses[@]}"

limited 120 "$PY" "$here/report.py" "$out" || failed=1
packed
echo "[$(( $(date +%s) - start )) s] done: $out/table.md" >&2
exit $failed
