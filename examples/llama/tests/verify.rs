//! `llama verify` end to end at CI size: a tiny model from scratch judges its own solutions after
//! one TOPR round on both verdicts of each; the files and the summary are consistent, and a
//! rerun reuses every stage.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn llama(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_llama")).args(args).output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn verify_trains_a_judge_and_picks_among_k() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verify_cli");
    let _ = std::fs::remove_dir_all(&dir);
    let m0 = dir.join("m0");
    common::tiny_model(&m0, "1");
    let work = dir.join("work");
    let args = [
        "verify",
        "--model",
        s(&m0),
        "--work",
        s(&work),
        "--task",
        "synthetic",
        "--synthetic-n",
        "6",
        "--difficulty",
        "1",
        "--max-new-tokens",
        "8",
        "--samples",
        "3",
        "--judge-iterations",
        "1",
        "--eval-n",
        "5",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--lr",
        "1e-3",
    ];
    let o = llama(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(table.contains("verifier@k") && table.contains("maj@k"), "{table}");
    // The stages' files.
    let lines = |f: &str| std::fs::read_to_string(work.join(f)).unwrap().lines().count();
    assert_eq!(lines("solutions.jsonl"), 6 * 3);
    assert_eq!(lines("heldout-solutions.jsonl"), 5 * 3);
    assert_eq!(lines("judge-train.jsonl"), 6 * 3);
    assert_eq!(lines("judge-heldout.jsonl"), 5 * 3);
    // Both verdicts of every training solution, the true one rewarded +1, the other -1.
    assert_eq!(lines("verifier/round-1/data.jsonl"), 6 * 3 * 2);
    let verdicts: Vec<Value> = std::fs::read_to_string(work.join("verifier/round-1/data.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for pair in verdicts.chunks(2) {
        assert_eq!(pair[0]["completion"], "The answer is 0.");
        assert_eq!(pair[1]["completion"], "The answer is 1.");
        assert_ne!(pair[0]["correct"], pair[1]["correct"]);
        for v in pair {
            let r = if v["correct"].as_bool().unwrap() { 1.0 } else { -1.0 };
            assert_eq!(v["reward"].as_f64().unwrap(), r);
            assert!(v["logp_mu"].as_array().unwrap().iter().all(|x| x.as_f64().unwrap() < 0.0));
        }
    }
    assert!(work.join("verifier/round-1/model/model.safetensors").exists());
    // Judge problems carry the truth of the solution they judge.
    let sol: Vec<Value> = std::fs::read_to_string(work.join("heldout-solutions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let judge: Vec<Value> = std::fs::read_to_string(work.join("judge-heldout.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (a, b) in sol.iter().zip(&judge) {
        let want = if a["correct"].as_bool().unwrap() { "#### 1" } else { "#### 0" };
        assert!(b["answer"].as_str().unwrap().ends_with(want));
        assert!(b["question"].as_str().unwrap().contains(a["completion"].as_str().unwrap().trim()));
    }
    // One row per held-out question; the pick is the highest score; the summary follows the rows.
    let rows: Vec<Value> = std::fs::read_to_string(work.join("verify.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 5);
    let mut picked_correct = 0.0;
    for r in &rows {
        let p: Vec<f64> = r["p_correct"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(p.len(), 3);
        assert!(p.iter().all(|v| (0.0..=1.0).contains(v)));
        let k = r["picked"].as_u64().unwrap() as usize;
        assert!(p.iter().all(|v| *v <= p[k]));
        picked_correct += f64::from(u8::from(r["correct"][k].as_bool().unwrap()));
    }
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(work.join("verify.json")).unwrap()).unwrap();
    assert_eq!(summary["questions"], 5);
    assert!((summary["verifier_at_k"]["mean"].as_f64().unwrap() - picked_correct / 5.0).abs() < 1e-12);
    let mean = |k: &str| summary[k]["mean"].as_f64().unwrap();
    assert!(mean("pass_at_k") >= mean("verifier_at_k") && mean("pass_at_k") >= mean("maj_at_k"));
    assert!(mean("pass_at_k") >= mean("pass1"));
    // A rerun reuses every stage: nothing is sampled or trained again, the results are the same.
    let before = std::fs::read(work.join("solutions.jsonl")).unwrap();
    let o = llama(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(log.contains("all 6 prompts already sampled") && !log.contains("completions,"), "{log}");
    assert!(std::fs::read(work.join("solutions.jsonl")).unwrap() == before);
    assert_eq!(String::from_utf8_lossy(&o.stdout), table);
    // A finished judge round is not reused with other training settings.
    let other: Vec<&str> = args.iter().map(|a| if *a == "1e-3" { "2e-3" } else { *a }).collect();
    let o = llama(&other);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    let last = e.trim().lines().last().unwrap_or_default();
    assert!(last.starts_with("error:") && last.contains("lr 1e-3") && last.contains("--work"), "{e}");
    assert!(!last.contains("--resume") && !last.contains("--out"), "verify has neither option: {e}");
    // Solutions sampled otherwise are refused the same way, naming the verifier's --work.
    let other: Vec<&str> = args.iter().map(|a| if *a == "8" { "9" } else { *a }).collect();
    let o = llama(&other);
    let e = String::from_utf8_lossy(&o.stderr);
    let last = e.trim().lines().last().unwrap_or_default();
    assert!(!o.status.success() && last.contains("max_new_tokens 8 → 9"), "{e}");
    assert!(last.contains("--work") && !last.contains("--resume") && !last.contains("--out"), "{e}");
    // Bad settings: a GSM8K task without held-out questions is refused in one line.
    let o = llama(&["verify", "--model", s(&m0), "--work", s(&dir.join("w2")), "--task", "gsm8k", "--data", "x"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--eval-data"));
}

/// A model whose context holds the solver's prompts but not the judge's (the question with the
/// judge's wording around it) is refused before any solution is sampled, naming the question;
/// the work directory is not created.
#[test]
fn a_judge_prompt_beyond_the_context_is_refused_before_sampling() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verify_judge_context");
    let _ = std::fs::remove_dir_all(&dir);
    let m0 = dir.join("m0");
    let size = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"];
    let o = llama(&[&["init", "--out", s(&m0), "--max-positions", "240"][..], &size].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let task = ["--task", "synthetic", "--synthetic-n", "2", "--difficulty", "1", "--max-new-tokens", "8"];
    // The solver's prompts fit.
    let sampled = dir.join("s.jsonl");
    let o =
        llama(&[&["sample", "--model", s(&m0), "--out", s(&sampled), "--samples-per-prompt", "1"][..], &task].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let work = dir.join("work");
    let o = llama(
        &[&["verify", "--model", s(&m0), "--work", s(&work), "--samples", "1", "--eval-n", "2"][..], &task].concat(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: synthetic:0: the judge's prompt") && last.contains("context of 240"), "{err}");
    assert!(!work.exists(), "the refused run wrote {}", work.display());
}
