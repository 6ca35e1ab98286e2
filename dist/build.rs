//! Compiles `csrc/c10d_shim.cpp` against the libtorch that tch links (`LIBTORCH`, as tch's own
//! build reads it) and links it with libtorch's `torch_cpu` and `c10`, which hold c10d and Gloo.
//!
//! The PyTorch wheels ship c10d's headers but not Gloo's; `csrc/gloo_decls` declares the few
//! Gloo names that `ProcessGroupGloo.hpp` mentions (see `csrc/README.md` for why that is sound).
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=csrc");
    let Some(libtorch) = std::env::var_os("LIBTORCH").map(PathBuf::from) else {
        panic!(
            "topr-dist: LIBTORCH is not set. It compiles a small C++ file against libtorch's c10d headers: \
             `source scripts/env.sh` (or point LIBTORCH at a libtorch or a torch Python package directory)"
        );
    };
    let include = libtorch.join("include");
    if !include.join("torch/csrc/distributed/c10d/ProcessGroupGloo.hpp").exists() {
        panic!(
            "topr-dist: {} has no torch/csrc/distributed/c10d/ProcessGroupGloo.hpp: this libtorch was built without torch.distributed",
            include.display()
        );
    }
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .file("csrc/c10d_shim.cpp")
        .include("csrc/gloo_decls")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .define("USE_C10D_GLOO", None)
        .define("GLOG_USE_GLOG_EXPORT", None)
        .warnings(false)
        .flag_if_supported("-Wno-c++20-extensions")
        .compile("topr_c10d");
    // For the build scripts of crates that depend on this one (`links = "topr_c10d"`): the folder
    // of `c_boundary.hpp`, as DEP_TOPR_C10D_INCLUDE.
    let csrc = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("csrc");
    println!("cargo:include={}", csrc.display());
    println!("cargo:rustc-link-search=native={}", libtorch.join("lib").display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}
