//! Helpers of the Llama example's tests: the transformers reference (through
//! `tests/reference/hf_llama.py`) and random checkpoints.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn python() -> PathBuf {
    PathBuf::from(std::env::var("TOPR_REFERENCE_PYTHON").expect(
        "TOPR_REFERENCE_PYTHON is not set: run the tests after `source scripts/env.sh`, which installs transformers",
    ))
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn reference(args: &[&str]) -> Value {
    let out = Command::new(python()).arg(repo().join("tests/reference/hf_llama.py")).args(args).output().unwrap();
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
