//! Two things the Llama example needs from the libtorch that tch links (the folder topr-dist's
//! build found through torch-sys, `DEP_TOPR_C10D_LIBTORCH`, however tch found it):
//!
//! 1. `csrc/onednn_linear.cpp`, compiled against libtorch's headers: oneDNN's packed linear layer
//!    for generation and training on the CPU (`src/onednn.rs`), which tch does not wrap.
//!    With it `csrc/decode_attention.cpp` and `csrc/next_tokens.cpp`: the decoding step's
//!    attention and its choice of the next tokens on the CPU (`src/attention.rs`,
//!    `src/next_tokens.rs`), always optimised (their loops are vectorised by the compiler, on
//!    the vectors of `csrc/lanes.hpp`); and `csrc/profile.cpp`, libtorch's profiler
//!    (`src/profile.rs`).
//! 2. `csrc/cuda_graph.cpp` (`src/cuda_graph.rs`), when the libtorch is a CUDA build: libtorch's
//!    CUDA graphs, with the CUDA runtime's headers that topr-dist's build script found (beside
//!    a torch wheel, in `CUDA_HOME` or in `/usr/local/cuda`); it sets the `topr_cuda_graphs` cfg.
//! 3. The `llama` binary must load libtorch's CUDA backend. The binary calls nothing in
//!    `libtorch_cuda.so` directly, so the linker's default `--as-needed` drops it from the
//!    binary's needed libraries, and libtorch then reports no CUDA device at run time even on a
//!    GPU machine (reported many times to tch-rs, first in its GitHub issue 329). When the libtorch is a CUDA
//!    build, link `libtorch_cuda` with `--no-as-needed`. A CPU-only libtorch has no
//!    `libtorch_cuda.so`, and nothing is added.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=TOPR_REQUIRE_CUDA_SHIMS");
    println!("cargo:rerun-if-changed=csrc");
    let libtorch = PathBuf::from(
        std::env::var_os("DEP_TOPR_C10D_LIBTORCH").expect("topr-dist's build script exports the libtorch folder"),
    );
    let include = libtorch.join("include");
    let lib = libtorch.join("lib");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    // topr-dist's `c_boundary.hpp` (exceptions into error messages at the C boundary).
    let shared = std::env::var_os("DEP_TOPR_C10D_INCLUDE").expect("topr-dist's build script exports its csrc folder");
    cc::Build::new()
        .cpp(true)
        .file("csrc/onednn_linear.cpp")
        .file("csrc/decode_attention.cpp")
        .file("csrc/next_tokens.cpp")
        .file("csrc/profile.cpp")
        .include(shared)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .warnings(false)
        // The decoding attention's loops are vectorised by the compiler, also in debug builds;
        // its 64-byte vectors never cross a function boundary, so GCC's note on their ABI is moot.
        .opt_level(3)
        .flag_if_supported("-Wno-psabi")
        .compile("topr_onednn");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo::rustc-check-cfg=cfg(topr_cuda_graphs)");
    // topr-dist's build found the CUDA runtime's headers (DEP_TOPR_C10D_CUDA_INCLUDE) when
    // libtorch is a CUDA build.
    let cuda = std::env::var_os("DEP_TOPR_C10D_CUDA_INCLUDE").map(|v| std::env::split_paths(&v).collect::<Vec<_>>());
    match cuda {
        Some(cuda) if lib.join("libtorch_cuda.so").exists() => {
            // A header these wheels lack (another CUDA wheel's layout) leaves generation eager
            // rather than failing the build.
            let compiled = cc::Build::new()
                .cpp(true)
                .file("csrc/cuda_graph.cpp")
                .include(std::env::var_os("DEP_TOPR_C10D_INCLUDE").expect("set above"))
                .include(&include)
                .include(include.join("torch/csrc/api/include"))
                .includes(cuda)
                .flag("-std=c++17")
                .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
                .define("USE_CUDA", None)
                .warnings(false)
                .try_compile("topr_cuda_graph");
            match compiled {
                Ok(()) => {
                    println!("cargo:rustc-link-lib=dylib=torch_cuda");
                    println!("cargo:rustc-link-lib=dylib=c10_cuda");
                    println!("cargo:rustc-cfg=topr_cuda_graphs");
                }
                // CI sets TOPR_REQUIRE_CUDA_SHIMS=1: there a shim that no longer compiles must fail.
                Err(e) if std::env::var("TOPR_REQUIRE_CUDA_SHIMS").as_deref() == Ok("1") => {
                    panic!("topr-llama: the CUDA graph shim did not compile: {e}")
                }
                Err(e) => {
                    println!("cargo:warning=topr-llama: the CUDA graph shim did not compile ({e}): no CUDA graphs")
                }
            }
        }
        _ => println!(
            "cargo:warning=topr-llama: libtorch is not a CUDA build (or its CUDA headers are missing): no CUDA graphs"
        ),
    }
    if lib.join("libtorch_cuda.so").exists() {
        for arg in ["-Wl,--no-as-needed", "-ltorch_cuda", "-Wl,--as-needed"] {
            println!("cargo:rustc-link-arg-bins={arg}");
        }
    }
}
