//! The llama example's commands end to end, as a user runs them: a CI-sized run of `init`,
//! `sft-data`, `train`, `eval`, `sample` and `iterate` (resumed), through the built binary.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The example binary, built (or found up to date) once per test run with the profile of the
/// tests themselves, so that running this test alone never uses a stale binary.
fn llama() -> PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    let release = !cfg!(debug_assertions);
    BUILD.call_once(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "--example",
            "llama",
            "--manifest-path",
            concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        ]);
        if release {
            cmd.arg("--release");
        }
        assert!(cmd.status().unwrap().success(), "building the llama example failed");
    });
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).parent().unwrap().to_path_buf();
    target.join(if release { "release" } else { "debug" }).join("examples").join("llama")
}

fn run(args: &[&str]) -> String {
    let out = Command::new(llama()).args(args).output().unwrap();
    assert!(out.status.success(), "llama {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_ci_sized_run_of_every_command() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llama_cli");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let m0 = dir.join("m0");
    run(&[
        "init",
        "--out",
        s(&m0),
        "--layers",
        "2",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "64",
    ]);
    let sft = dir.join("sft.jsonl");
    let task = ["--task", "synthetic", "--synthetic-n", "12", "--difficulty", "1"];
    let mut a = vec!["sft-data", "--model", s(&m0), "--out", s(&sft)];
    a.extend_from_slice(&task);
    run(&a);
    let m1 = dir.join("m1");
    let summary: Value = serde_json::from_str(
        run(&[
            "train",
            "--model",
            s(&m0),
            "--data",
            s(&sft),
            "--out",
            s(&m1),
            "--objective",
            "sft",
            "--lr",
            "1e-3",
            "--batch-size",
            "6",
            "--micro-batch-size",
            "3",
        ])
        .trim(),
    )
    .unwrap();
    assert_eq!(summary["steps"], 2);
    assert!(summary["final_loss"].as_f64().unwrap().is_finite());
    assert_eq!(std::fs::read_to_string(m1.join("metrics.jsonl")).unwrap().lines().count(), 2);

    let mut a = vec!["eval", "--model", s(&m1), "--max-new-tokens", "8", "--samples", "2"];
    a.extend_from_slice(&task);
    let e: Value = serde_json::from_str(run(&a).trim()).unwrap();
    assert_eq!(e["questions"], 12);
    assert!(e["pass_at_k"].as_f64().unwrap() >= e["pass1_sampled"].as_f64().unwrap());

    let data = dir.join("data.jsonl");
    let mut a =
        vec!["sample", "--model", s(&m1), "--out", s(&data), "--samples-per-prompt", "2", "--max-new-tokens", "8"];
    a.extend_from_slice(&task);
    let v: Value = serde_json::from_str(run(&a).trim()).unwrap();
    assert_eq!(v["completions"], 24);

    let work = dir.join("work");
    let mut a = vec![
        "iterate",
        "--model",
        s(&m1),
        "--work",
        s(&work),
        "--iterations",
        "1",
        "--samples-per-prompt",
        "2",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--eval-n",
        "6",
        "--lr",
        "1e-4",
        "--baseline=-0.5",
    ];
    a.extend_from_slice(&task);
    let first = run(&a);
    assert!(first.contains("iteration"), "{first}");
    let rows = std::fs::read_to_string(work.join("iterations.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), 2);
    // Rerunning resumes: nothing is sampled or trained again, the table is the same.
    let data_before = std::fs::read_to_string(work.join("iter-1/data.jsonl")).unwrap();
    let second = run(&a);
    assert_eq!(first, second);
    assert_eq!(std::fs::read_to_string(work.join("iter-1/data.jsonl")).unwrap(), data_before);

    // Errors are one clear line, not a panic.
    let out = Command::new(llama())
        .args(["train", "--model", s(&m0), "--data", "/nonexistent.jsonl", "--out", s(&dir.join("x"))])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("error: opening /nonexistent.jsonl"), "{err}");
}
