//! Compiles `csrc/c10d_shim.cpp` against the libtorch that tch links and links it with
//! libtorch's `torch_cpu` and `c10`, which hold c10d and Gloo. The libtorch is the one torch-sys's
//! build found, whichever of tch's ways found it (`LIBTORCH`, `LIBTORCH_USE_PYTORCH=1`, the
//! `download-libtorch` feature): torch-sys passes its folder on as `DEP_TCH_LIBTORCH_LIB`. This
//! build passes it on in turn (`DEP_TOPR_C10D_LIBTORCH`) to the Llama example's.
//!
//! The PyTorch wheels ship c10d's headers but not Gloo's; `csrc/gloo_decls` declares the few
//! Gloo names that `ProcessGroupGloo.hpp` mentions (see `csrc/README.md` for why that is sound).
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=TOPR_REQUIRE_CUDA_SHIMS");
    println!("cargo:rerun-if-changed=csrc");
    let libtorch = libtorch_dir();
    println!("cargo:libtorch={}", libtorch.display());
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
    // NCCL, when libtorch is a CUDA build whose CUDA and NCCL headers are found.
    println!("cargo::rustc-check-cfg=cfg(topr_nccl)");
    let cuda = cuda_include(&libtorch).filter(|_| libtorch.join("lib/libtorch_cuda.so").exists());
    if let Some(cuda) = &cuda {
        // For dependent build scripts (the Llama example's CUDA graphs): DEP_TOPR_C10D_CUDA_INCLUDE.
        let joined = std::env::join_paths(cuda).expect("paths without separators");
        println!("cargo:cuda_include={}", joined.to_string_lossy());
    }
    let nccl = libtorch.parent().map(|site| site.join("nvidia/nccl/include")).filter(|d| d.join("nccl.h").exists());
    // c10d's NCCL header includes the CUDA half-precision headers, which include CCCL's
    // `nv/target` (the nvidia-cuda-cccl wheel; scripts/env.sh installs it).
    let cccl = cuda.as_ref().is_some_and(|dirs| dirs.iter().any(|d| d.join("nv/target").exists()));
    let nccl = nccl.filter(|_| cccl);
    let built = match (cuda, nccl) {
        (Some(cuda), Some(nccl)) => {
            // A header these wheels lack (another CUDA wheel's layout) leaves Gloo alone rather
            // than failing the build.
            let compiled = cc::Build::new()
                .cpp(true)
                .file("csrc/nccl_shim.cpp")
                .include(&csrc)
                .include("csrc/gloo_decls")
                .include(&include)
                .include(include.join("torch/csrc/api/include"))
                .includes(cuda)
                .include(nccl)
                .flag("-std=c++17")
                .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
                .define("USE_C10D_NCCL", None)
                .define("USE_CUDA", None)
                .define("GLOG_USE_GLOG_EXPORT", None)
                .warnings(false)
                .try_compile("topr_nccl");
            match compiled {
                Ok(()) => true,
                // CI sets TOPR_REQUIRE_CUDA_SHIMS=1: there a shim that no longer compiles (a new
                // torch's API) must fail the build, not hide behind the fallback.
                Err(e) if std::env::var("TOPR_REQUIRE_CUDA_SHIMS").as_deref() == Ok("1") => {
                    panic!("topr-dist: the NCCL shim did not compile: {e}")
                }
                Err(e) => {
                    println!("cargo:warning=topr-dist: the NCCL shim did not compile ({e}): Gloo only");
                    false
                }
            }
        }
        _ => {
            println!(
                "cargo:warning=topr-dist: libtorch is not a CUDA build, or its CUDA, CCCL (nvidia-cuda-cccl) or NCCL headers are missing: Gloo only"
            );
            false
        }
    };
    if built {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-cfg=topr_nccl");
    }
}

/// The libtorch that tch links: the parent of torch-sys's `lib` folder (`DEP_TCH_LIBTORCH_LIB`,
/// set on Linux and macOS), else `LIBTORCH`.
fn libtorch_dir() -> PathBuf {
    let from_tch =
        std::env::var_os("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from).and_then(|lib| lib.parent().map(PathBuf::from));
    match from_tch.or_else(|| std::env::var_os("LIBTORCH").map(PathBuf::from)) {
        Some(dir) => dir,
        None => panic!(
            "topr-dist: torch-sys did not say where libtorch is and LIBTORCH is not set. Set LIBTORCH to a libtorch \
             or a torch Python package directory, or LIBTORCH_USE_PYTORCH=1 with torch installed for python3 \
             (or `source scripts/env.sh` in the repository)"
        ),
    }
}

/// The folders of the CUDA runtime's headers for `libtorch`: the one holding `cuda_runtime_api.h`
/// — beside a torch wheel (`nvidia/cu13/include`, `nvidia/cuda_runtime/include`), in `CUDA_HOME`,
/// or in `/usr/local/cuda` — and, when it lacks the compiler's `crt/` headers that
/// `cuda_runtime.h` includes (the wheels' runtime packages leave them to nvcc's), triton's copy
/// of them, which CUDA builds of torch install.
fn cuda_include(libtorch: &std::path::Path) -> Option<Vec<PathBuf>> {
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let site = libtorch.parent()?;
    let mut candidates: Vec<PathBuf> =
        ["cu13/include", "cuda_runtime/include", "cu12/include"].iter().map(|s| site.join("nvidia").join(s)).collect();
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    let main = candidates.into_iter().find(|d| d.join("cuda_runtime_api.h").exists())?;
    if main.join("crt/host_config.h").exists() {
        return Some(vec![main]);
    }
    let triton = site.join("triton/backends/nvidia/include");
    triton.join("crt/host_config.h").exists().then(|| vec![main, triton])
}
