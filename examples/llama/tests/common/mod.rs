//! Helpers of the Llama tests: the transformers and torch references (the Python scripts in
//! `tests/reference/`, run with `TOPR_REFERENCE_PYTHON`) and random checkpoints. Each test file
//! uses a part of them.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn python() -> PathBuf {
    PathBuf::from(std::env::var("TOPR_REFERENCE_PYTHON").expect(
        "TOPR_REFERENCE_PYTHON is not set: run the tests after `source scripts/env.sh`, which installs transformers",
    ))
}

/// The repository's root (`scripts/`, `models/`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file under `root` (folders walked, not listed), as paths relative to `root`, sorted.
pub fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// A reference script of `tests/reference/`.
pub fn reference_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference").join(name)
}

pub fn reference(args: &[&str]) -> Value {
    let out = Command::new(python()).arg(reference_script("hf_llama.py")).args(args).output().unwrap();
    assert!(out.status.success(), "reference failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs a list of requests against the checkpoint in `dir` with transformers.
pub fn hf(dir: &Path, requests: Value) -> Vec<Value> {
    let file = dir.join("requests.json");
    std::fs::write(&file, requests.to_string()).unwrap();
    let v = reference(&["run", "--model", dir.to_str().unwrap(), "--requests", file.to_str().unwrap()]);
    v["results"].as_array().unwrap().clone()
}

/// A random checkpoint `name` under the test temp dir (made once per test run).
pub fn random_checkpoint(name: &str, args: &[&str]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llama").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    let mut a = vec!["make", "--out", dir.to_str().unwrap()];
    a.extend_from_slice(args);
    reference(&a);
    dir
}

/// A tiny model from `llama init` in `dir` (hidden 32, 2 heads, 1 key-value head, MLP 64) with
/// `layers` layers, through the built binary.
pub fn tiny_model(dir: &Path, layers: &str) {
    let d = dir.to_str().unwrap();
    let args = ["init", "--out", d, "--layers", layers, "--hidden", "32", "--heads", "2", "--kv-heads", "1"];
    let out = Command::new(env!("CARGO_BIN_EXE_llama")).args(args).args(["--intermediate", "64"]).output().unwrap();
    assert!(out.status.success(), "llama init failed:\n{}", String::from_utf8_lossy(&out.stderr));
}
