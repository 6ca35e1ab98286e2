#!/usr/bin/env bash
# Every speed ratio targeted for version 0.2 in one run, side by side on the machine it runs on:
# the Llama example against transformers (generation tokens/s at batch 1 and 16 — 16 rows is
# also what `sample` generates by default, 4 prompts × 4 samples — and training forward +
# backward tokens/s, plain and through the fused log-prob path, each with its FLOP/s and share
# of the machine's measured peak), and the token-level losses against the same computations
# written in PyTorch (TOPR, PPO, DPO at B = 512, T = 2048, forward + backward, the same
# libtorch). REPS repetitions, alternating the two sides; prints mean ± sd over repetitions and
# the ratio of each repetition's pair.
#
#   scripts/bench_llama.sh [MODEL_DIR] [REPS] [OUT]
#
# Defaults: models/smollm2-135m-instruct (made offline by scripts/smollm2.sh), 3, and
# target/bench-llama.jsonl (every measurement, one JSON line each, with its repetition). The sizes
# can be changed for a quick check of the script: NEW (64 new tokens), B and T (training batch,
# 8 × 256, the size of the 0.2 training target), LOSS_B and LOSS_T (512 × 2048), ITERS (10 timed calls per loss).
# TRAIN_ONLY=1 measures the training side by side only (generation reduced to one token at batch 1,
# no losses); PAIRS=N adds N alternating pairs of training steps with our two training kernels
# (plain matmul, oneDNN) in one process per repetition.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
model="${1:-models/smollm2-135m-instruct}"
reps="${2:-3}"
out="${3:-target/bench-llama.jsonl}"
[ -f "$model/model.safetensors" ] || scripts/smollm2.sh "$model"
cargo build --release -q -p topr-llama --bin llama
NEW=${NEW:-64} B=${B:-8} T=${T:-256} GEN=${GEN:-1,16} PAIRS=${PAIRS:-0}
if [ -n "${TRAIN_ONLY:-}" ]; then NEW=1 GEN=1; fi
LOSS_B=${LOSS_B:-512} LOSS_T=${LOSS_T:-2048} ITERS=${ITERS:-10}
# The PyTorch side gets the allocator settings the llama binary gives itself (keep_freed_memory).
malloc=(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=67108864)
: > "$out"
tag() { python3 -c 'import json,sys; r=int(sys.argv[1]); [print(json.dumps({**json.loads(l), "rep": r})) for l in sys.stdin if l.startswith("{")]' "$1"; }
for ((r = 0; r < reps; r++)); do
    echo "repetition $((r + 1)) of $reps" >&2
    ./target/release/llama bench --model "$model" --new-tokens $NEW --gen-batch $GEN --train-batch $B --train-len $T --kernel-pairs $PAIRS 2>/dev/null | tag $r >> "$out"
    "$TOPR_REFERENCE_PYTHON" examples/llama/tests/reference/bench_hf.py "$model" $NEW $B $T --gen-batch $GEN 2>/dev/null | tag $r >> "$out"
    if [ -n "${TRAIN_ONLY:-}" ]; then continue; fi
    ./target/release/llama check losses --device cpu --batch $LOSS_B --len $LOSS_T --iters $ITERS 2>/dev/null | tag $r >> "$out"
    env "${malloc[@]}" "$TOPR_REFERENCE_PYTHON" scripts/gpu_bundle/losses_torch.py --device cpu --batch $LOSS_B \
        --len $LOSS_T --iters $ITERS 2>/dev/null | tag $r >> "$out"
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def ms(v):
    return f"{statistics.mean(v):.3g} ± {statistics.stdev(v):.2g}" if len(v) > 1 else f"{v[0]:.3g}"
def pick(**kw):
    out = {}
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            out[r["rep"]] = r
    return out
print(f"{'measurement':44} {'topr-loss':>18} {'reference':>18} {'ratio':>14} {'target':>8}")
def line(name, ours, theirs, key, target, higher_is_better=True):
    reps = sorted(set(ours) & set(theirs))
    if not reps:
        print(f"{name:44} (missing)"); return
    a = [ours[r][key] for r in reps]; b = [theirs[r][key] for r in reps]
    ratio = [x / y for x, y in zip(a, b)]
    print(f"{name:44} {ms(a):>18} {ms(b):>18} {ms(ratio):>14} {target:>8}")
for batch, target in [(1, "≥ 1.2"), (16, "≥ 2")]:
    line(f"generate tokens/s, batch {batch}", pick(what="generate", impl="topr-loss", batch=batch),
         pick(what="generate", impl="transformers", batch=batch), "tokens_per_s", target)
line("train fwd+bwd tokens/s", pick(what="train_fwd_bwd", impl="topr-loss"),
     pick(what="train_fwd_bwd", impl="transformers"), "tokens_per_s", "≥ 1.3")
line("fused log-prob path / plain (ours)", pick(what="train_fwd_bwd_fused_logprobs", impl="topr-loss"),
     pick(what="train_fwd_bwd", impl="topr-loss"), "tokens_per_s", "≥ 1")
for loss in ["topr_token_loss", "ppo_clip_loss", "dpo_loss"]:
    for checks in ["full", "shapes"]:
        line(f"{loss} ms, {checks} checks / PyTorch", pick(what="loss", loss=loss, checks=checks, device="cpu"),
             pick(what="loss", loss=loss, checks="pytorch", device="cpu"), "ms", "≤ 1")
pairs = [r["ratio"] for r in rows if r.get("what") == "train_kernels_pair"]
if pairs:
    se = statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else float("nan")
    print(f"{'train kernels, oneDNN / plain (ours, pairs)':44} {'':>18} {'':>18} {statistics.mean(pairs):>7.3f} ± {se:.3f} (n = {len(pairs)})")
print("\nroofline (ours): share of the measured peak (a matmul in the same run)")
peak = [r["tflops"] for r in rows if r.get("what") == "peak"]
if peak:
    print(f"  peak {ms([p * 1e3 for p in peak])} GFLOP/s")
for what in ["generate", "train_fwd_bwd", "train_fwd_bwd_fused_logprobs"]:
    for r in sorted({(x.get("batch"), x.get("len")) for x in rows if x.get("what") == what and x.get("impl") == "topr-loss"}, key=str):
        v = [x for x in rows if x.get("what") == what and x.get("impl") == "topr-loss" and (x.get("batch"), x.get("len")) == r]
        print(f"  {what} batch {r[0]}: {ms([x['achieved_tflops'] * 1e3 for x in v])} GFLOP/s, "
              f"{ms([100 * x['share_of_peak'] for x in v])} % of peak")
PY
