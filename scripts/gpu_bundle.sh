#!/usr/bin/env bash
# Builds the GPU check's bundle: the Llama example compiled in release mode against one torch
# version, with run.sh and its two Python helpers, for a GPU machine that has that torch for
# python3 but no Rust, no network and no download (the H200 machine of the run of 2026-11-30 had
# torch 2.11.0).
#
#   scripts/gpu_bundle.sh OUT_DIR [TORCH_VERSION]     # TORCH_VERSION: 2.11.0 (default), 2.12.0 or 2.13.0
#
# Then, on the GPU machine:  OUT_DIR/run.sh RESULTS_DIR   (see run.sh; at most ~8 minutes on one H200)
# and here, to try the bundle on the CPU at toy sizes:  OUT_DIR/run.sh RESULTS_DIR --device cpu --size tiny
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: $0 OUT_DIR [TORCH_VERSION]" >&2; exit 2; }
out=$1
version=${2:-2.11.0}
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
    echo "gpu_bundle.sh: $out exists and is not empty: choose a new folder" >&2
    exit 2
fi
cd "$root"
# shellcheck source=env.sh
TOPR_TORCH_VERSION=$version source scripts/env.sh
cargo build --release -p topr-llama --bin llama
bin="${CARGO_TARGET_DIR:-$root/target}/release/llama"
# The bundle needs libtorch's CUDA backend among the binary's libraries (examples/llama/build.rs).
if [ -e "$TOPR_LIBTORCH/lib/libtorch_cuda.so" ]; then
    if ! readelf -d "$bin" | grep -q 'libtorch_cuda.so'; then
        echo "gpu_bundle.sh: $bin does not load libtorch_cuda.so: it would see no GPU" >&2
        exit 1
    fi
    # NCCL and the CUDA graphs fall back (to Gloo, to eager steps) when their shims do not build:
    # a bundle for a GPU must have both, or its rare run would measure neither.
    syms=$(readelf -s -W "$bin")
    for need in ProcessGroupNCCL:NCCL topr_cuda_graph_replay:"CUDA graphs"; do
        if ! grep -q "${need%%:*}" <<< "$syms"; then
            echo "gpu_bundle.sh: $bin was built without ${need#*:} (see the build's warnings)" >&2
            exit 1
        fi
    done
fi
mkdir -p "$out"
# Assembled in a temporary folder beside OUT_DIR and moved in at the end: a failed build leaves
# no bundle that looks whole.
tmp=$(mktemp -d "$(dirname "$out")/.gpu-bundle.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
strip -o "$tmp/llama" "$bin"
cp scripts/gpu_bundle/run.sh scripts/gpu_bundle/report.py scripts/gpu_bundle/losses_torch.py \
    examples/llama/tests/reference/bench_hf.py "$tmp/"
chmod +x "$tmp/run.sh" "$tmp/llama"
# The demo's plots need a TrueType font, which the GPU machine's image lacks: DejaVu Sans
# (Bitstream Vera licence, free to redistribute), where the machine that builds the bundle has it.
font=${TOPR_PLOT_FONT:-/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf}
[ -f "$font" ] && cp "$font" "$tmp/font.ttf"
echo "$version" > "$tmp/TORCH_VERSION"
git -C "$root" describe --always --dirty > "$tmp/COMMIT" 2>/dev/null || echo unknown > "$tmp/COMMIT"
# A GPU machine lent through a 64 MiB transfer takes the repository's tracked files (about 19 MiB
# on 2026-12-04) with the bundle: 40 MiB leaves room for both.
size=$(du -sm "$tmp" | cut -f1)
if [ "$size" -gt 40 ]; then
    echo "gpu_bundle.sh: the bundle is $size MiB, more than the 40 MiB that can be carried beside the repository" >&2
    exit 1
fi
mv "$tmp"/* "$out/"
echo "gpu_bundle.sh: $out ($size MiB, torch $version, commit $(cat "$out/COMMIT")); run $out/run.sh RESULTS_DIR" >&2
