//! Makes the `llama` binary load libtorch's CUDA backend.
//!
//! The binary calls nothing in `libtorch_cuda.so` directly, so the linker's default
//! `--as-needed` drops it from the binary's needed libraries, and libtorch then reports no CUDA
//! device at run time even on a GPU machine (tch-rs issue #329 and its many duplicates). When the
//! libtorch in `LIBTORCH` is a CUDA build, link `libtorch_cuda` with `--no-as-needed`. A CPU-only
//! libtorch has no `libtorch_cuda.so`, and nothing is added.
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Some(dir) = std::env::var_os("LIBTORCH") else { return };
    let lib = Path::new(&dir).join("lib");
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-search=native={}", lib.display());
        for arg in ["-Wl,--no-as-needed", "-ltorch_cuda", "-Wl,--as-needed"] {
            println!("cargo:rustc-link-arg-bins={arg}");
        }
    }
}
