//! The `llama` binary's commands end to end, as a user runs them: a CI-sized run of `init`,
//! `sft-data`, `train`, `eval`, `sample` and `iterate` (resumed), through the built binary.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `llama` binary, built by cargo for the integration tests with their profile.
fn llama() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_llama"))
}

fn run(args: &[&str]) -> String {
    let out = Command::new(llama()).args(args).output().unwrap();
    assert!(out.status.success(), "llama {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A new directory under the test temp dir with a tiny model from `init` in `m0`.
fn fresh_tiny_model(name: &str, layers: &str) -> (PathBuf, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let m0 = dir.join("m0");
    common::tiny_model(&m0, layers);
    (dir, m0)
}

#[test]
fn a_ci_sized_run_of_every_command() {
    let (dir, m0) = fresh_tiny_model("llama_cli", "2");
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
    // Rerunning without --resume refuses to touch the finished run; with it, nothing is sampled
    // or trained again and the table is the same.
    let out = Command::new(llama()).args(&a).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"));
    let data_before = std::fs::read_to_string(work.join("iter-1/data.jsonl")).unwrap();
    a.push("--resume");
    let second = run(&a);
    assert_eq!(first, second);
    assert_eq!(std::fs::read_to_string(work.join("iter-1/data.jsonl")).unwrap(), data_before);

    // Every other objective and Adafactor, on the sampled data with some completions marked
    // correct (so that DPO has pairs and GRPO non-zero advantages).
    let mixed = dir.join("mixed.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            let good = v["sample"] == 0;
            v["correct"] = good.into();
            v["reward"] = (if good { 1.0 } else { -1.0 }).into();
            v.to_string()
        })
        .collect();
    std::fs::write(&mixed, lines.join("\n") + "\n").unwrap();
    // Every objective, with the rollout corrections, advantage estimators, KL and entropy terms.
    let extra: [(&str, &str, &str, &[&str]); 22] = [
        ("ppo", "adamw", "none", &["--rejection", "k1-token:0.5:2", "--off-policy-mask", "0.2"]),
        ("grpo", "adamw", "token-tis:2", &["--advantage", "rloo", "--kl-coef", "0.01", "--kl-estimator", "k3-plus"]),
        ("dpo", "adafactor", "none", &["--dpo-loss", "robust", "--dpo-label-smoothing", "0.1"]),
        ("topr", "adafactor", "sequence-mis:0.5:2", &["--kl-coef", "0.05", "--kl-estimator", "low-var-kl"]),
        ("gspo", "adamw", "sequence-tis:1.5", &["--advantage", "batch-std"]),
        ("cispo", "adafactor", "token-mis:0.2:5", &["--advantage", "reinforce-pp"]),
        ("sapo", "adamw", "none", &["--entropy-coef", "0.01", "--top-entropy", "0.5"]),
        ("gmpo", "adamw", "none", &["--advantage", "opo", "--rejection", "k3-seq-max:0.5"]),
        ("clip-cov", "adamw", "none", &["--advantage", "reinforce-pp-baseline", "--off-policy-mask", "0.1"]),
        ("kl-cov", "adamw", "token-tis:2", &["--advantage", "dr-grpo", "--top-entropy", "0.2"]),
        ("dppo-tv", "adamw", "none", &["--advantage", "passk"]),
        ("dppo-kl", "adafactor", "token-tis:2", &["--rejection", "k2-token:0.5"]),
        ("dro", "adamw", "none", &["--dro-beta", "0.2", "--rejection", "k2-token:2,k3-seq-max:0.5"]),
        ("decoupled-ppo", "adamw", "none", &["--proximal", "recompute"]),
        ("decoupled-ppo", "adafactor", "geometric-tis:2", &["--advantage", "dr-grpo"]),
        ("vespo", "adamw", "none", &["--advantage", "rloo"]),
        ("bapo", "adamw", "none", &["--advantage", "maxrl"]),
        ("prefix-ratio", "adafactor", "none", &["--advantage", "lens", "--positive-nll", "0.1"]),
        ("grpo", "adamw", "none", &["--advantage", "gdpo"]),
        ("dpo", "adamw", "none", &["--dpo-loss", "ipo"]),
        ("dpo", "adamw", "none", &["--dpo-loss", "discopop"]),
        ("dpo", "adafactor", "none", &["--dpo-mix", "sigmoid:0.8,bco-pair:0.2"]),
    ];
    for (i, (objective, optimizer, correction, flags)) in extra.into_iter().enumerate() {
        let out = dir.join(format!("m-{i}-{objective}-{optimizer}"));
        let mut args = vec![
            "train",
            "--model",
            s(&m1),
            "--data",
            s(&mixed),
            "--out",
            s(&out),
            "--objective",
            objective,
            "--optimizer",
            optimizer,
            "--lr",
            "1e-3",
            "--batch-size",
            "8",
            "--micro-batch-size",
            "3",
            "--rollout-correction",
            correction,
        ];
        args.extend(flags);
        let summary: Value = serde_json::from_str(run(&args).trim()).unwrap();
        // 24 completions: 3 steps of 8; DPO has 12 pairs, 4 per step of 8 completions.
        assert_eq!(summary["steps"], 3, "{objective}: {summary}");
        assert_eq!(summary["objective"], objective);
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let last: Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
        assert!(last["stats"]["loss"].as_f64().unwrap().is_finite(), "{objective}: {last}");
        match objective {
            "dpo" => assert!(last["stats"]["dpo_accuracy"].is_number(), "{last}"),
            "ppo" | "grpo" | "gspo" | "cispo" => assert!(last["stats"]["clip_fraction"].is_number(), "{last}"),
            "sapo" | "gmpo" | "clip-cov" | "kl-cov" | "dppo-tv" | "dppo-kl" | "dro" | "decoupled-ppo" | "vespo"
            | "bapo" | "prefix-ratio" => {
                assert!(last["stats"]["clip_fraction"].is_null(), "{last}")
            }
            _ => assert!(last["stats"]["topr"]["truncated_fraction_neg"].is_number(), "{last}"),
        }
        assert!(out.join("model.safetensors").exists() && !out.join("state").exists());
    }

    // A completion longer than the model's context (512 here): an error naming the file and the
    // record, or skipped and counted with --skip-bad-records.
    let long = dir.join("long.jsonl");
    let mut lines: Vec<String> = std::fs::read_to_string(&mixed).unwrap().lines().map(String::from).collect();
    let mut v: Value = serde_json::from_str(&lines[1]).unwrap();
    v["completion_ids"] = serde_json::json!(vec![65; 600]);
    v["logp_mu"] = serde_json::json!(vec![-1.0; 600]);
    lines[1] = v.to_string();
    std::fs::write(&long, lines.join("\n") + "\n").unwrap();
    let long_out = dir.join("long");
    let args = ["train", "--model", s(&m1), "--data", s(&long), "--out", s(&long_out), "--batch-size", "8"];
    let out = Command::new(llama()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("long.jsonl: record 2") && err.contains("context"), "{err}");
    let out = Command::new(llama()).args(args).arg("--skip-bad-records").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("skipped 1 record(s)"), "{err}");

    // An unknown optimiser is refused.
    let out = Command::new(llama())
        .args(["train", "--model", s(&m1), "--data", s(&mixed), "--out", s(&dir.join("sgd")), "--optimizer", "sgd"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("sgd"));

    // Errors are one clear line, not a panic.
    let out = Command::new(llama())
        .args(["train", "--model", s(&m0), "--data", "/nonexistent.jsonl", "--out", s(&dir.join("x"))])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("error: opening /nonexistent.jsonl"), "{err}");
}

/// A training run killed (SIGKILL) in the middle and resumed with `--resume` ends with the same
/// model and the same metrics, step for step, as a run that was never interrupted.
#[test]
fn a_killed_training_run_resumes_where_it_stopped() {
    let (dir, m0) = fresh_tiny_model("llama_cli_kill", "1");
    let sft = dir.join("sft.jsonl");
    run(&["sft-data", "--model", s(&m0), "--out", s(&sft), "--task", "synthetic", "--synthetic-n", "20"]);
    let train = |out: &Path| -> Vec<String> {
        [
            "train",
            "--model",
            s(&m0),
            "--data",
            s(&sft),
            "--out",
            s(out),
            "--objective",
            "sft",
            "--optimizer",
            "adafactor",
            "--lr",
            "1e-3",
            "--batch-size",
            "2",
            "--micro-batch-size",
            "1",
            "--epochs",
            "4",
            "--warmup-steps",
            "5",
            "--lr-decay",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    let total = 40; // 20 completions, 2 per step, 4 epochs
    let whole = dir.join("whole");
    run(&train(&whole).iter().map(String::as_str).collect::<Vec<_>>());

    let killed = dir.join("killed");
    // The child is always killed and waited for, also when the test fails (clippy can't see it).
    #[allow(clippy::zombie_processes)]
    let mut child = Command::new(llama()).args(train(&killed)).stderr(std::process::Stdio::null()).spawn().unwrap();
    let progress = killed.join("state/progress.json");
    let start = std::time::Instant::now();
    let step_at_kill = loop {
        let step = std::fs::read_to_string(&progress)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["step"].as_u64());
        if step.is_some_and(|n| n >= 5) {
            let _ = child.kill();
            child.wait().unwrap();
            break step.unwrap();
        }
        if start.elapsed().as_secs() > 120 {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the run saved no state in 2 minutes");
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(step_at_kill < total && !killed.join("model.safetensors").exists(), "killed too late");

    // Without --resume the interrupted state is not silently overwritten.
    let out = Command::new(llama()).args(train(&killed)).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"), "{}", String::from_utf8_lossy(&out.stderr));

    let mut args = train(&killed);
    args.push("--resume".into());
    run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!killed.join("state").exists(), "the state of a finished run is removed");
    let metrics = |d: &Path| std::fs::read_to_string(d.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> =
        metrics(&killed).lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=total).collect::<Vec<u64>>(), "each step logged once, in order");
    assert_eq!(metrics(&killed), metrics(&whole), "the resumed run took the same steps");
    let read = |d: &Path| {
        let mut t = tch::Tensor::read_safetensors(d.join("model.safetensors")).unwrap();
        t.sort_by(|x, y| x.0.cmp(&y.0));
        t
    };
    let (a, b) = (read(&whole), read(&killed));
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{na} differs after the resume");
    }
}

/// The README's demo at CI size: every stage runs, the table and the plots are written, and a
/// rerun continues only with --resume.
#[test]
fn the_demo_runs_end_to_end_at_ci_size() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llama_cli_demo");
    let _ = std::fs::remove_dir_all(&dir);
    let table = run(&["demo", "--quick", "--work", s(&dir)]);
    assert!(table.contains("iteration") && table.contains("accuracy"), "{table}");
    let rows = std::fs::read_to_string(dir.join("topr/iterations.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), 2, "{rows}");
    for png in ["topr/iterations.png", "warm-up/training.png"] {
        let bytes = std::fs::read(dir.join(png)).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{png}");
    }
    let out = Command::new(llama()).args(["demo", "--quick", "--work", s(&dir)]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--resume"));
    assert_eq!(run(&["demo", "--quick", "--work", s(&dir), "--resume"]), table);
}

/// Same seed, same numbers: two `init` runs (separate processes, so separate hash-map orders)
/// write the same weights.
#[test]
fn init_is_deterministic() {
    let (dir, a) = fresh_tiny_model("llama_cli_init", "2");
    let b = dir.join("again");
    common::tiny_model(&b, "2");
    let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(bytes(&a) == bytes(&b), "two inits with the same seed differ");
}

/// Runs `llama args` expecting a refusal: a failure exit status that is not a panic's (101),
/// and one error line (the last of stderr, after any log lines) that contains every `needle`.
fn refused(args: &[&str], needles: &[&str]) {
    let out = Command::new(llama()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    assert!(!out.status.success() && code != Some(101) && code.is_some(), "llama {args:?}: exit {code:?}\n{err}");
    assert!(!err.contains("panicked"), "llama {args:?} panicked:\n{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "llama {args:?}: not one error line:\n{err}");
    assert_eq!(err.lines().last(), Some(errors[0]), "llama {args:?}: the error is not one line:\n{err}");
    for n in needles {
        assert!(errors[0].contains(n), "llama {args:?}: {:?} does not name {n:?}", errors[0]);
    }
}

/// Every numeric option out of its range is refused before anything is loaded or written, in one
/// line naming the option.
#[test]
fn out_of_range_options_are_refused_naming_the_option() {
    let (dir, m0) = fresh_tiny_model("llama_cli_refuse_options", "1");
    let out = dir.join("out");
    let (m, o) = (s(&m0), s(&out));
    let train = |extra: &[&'static str]| -> Vec<String> {
        let mut a: Vec<String> =
            ["train", "--model", m, "--data", "/nonexistent.jsonl", "--out", o].map(String::from).to_vec();
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    let with = |cmd: &[&str], extra: &[&'static str]| -> Vec<String> {
        cmd.iter().chain(extra).map(|x| x.to_string()).collect()
    };
    let eval = ["eval", "--model", m];
    let sample = ["sample", "--model", m, "--out", o];
    let generate = ["generate", "--model", m, "--prompt", "hi"];
    let iterate = ["iterate", "--model", m, "--work", o];
    let init = ["init", "--out", o];
    let cases: Vec<(Vec<String>, &str)> = vec![
        (train(&["--batch-size", "0"]), "--batch-size"),
        (train(&["--batch-size", "-3"]), "--batch-size"),
        (train(&["--micro-batch-size", "0"]), "--micro-batch-size"),
        (train(&["--micro-batch-size", "99999999999"]), "--micro-batch-size"),
        (train(&["--epochs", "0"]), "--epochs"),
        (train(&["--lr", "nan"]), "--lr"),
        (train(&["--lr", "-1e-5"]), "--lr"),
        (train(&["--lr", "0"]), "--lr"),
        (train(&["--weight-decay", "-0.1"]), "--weight-decay"),
        (train(&["--rollout-correction", "token-tis"]), "--rollout-correction"),
        (train(&["--rollout-correction", "token-mis:2:1"]), "--rollout-correction"),
        (train(&["--rollout-correction", "sequence-tis:-1"]), "--rollout-correction"),
        (train(&["--objective", "dpo", "--rollout-correction", "token-tis:2"]), "--rollout-correction"),
        (train(&["--objective", "dpo", "--kl-coef", "0.1"]), "--kl-coef"),
        (train(&["--objective", "dpo", "--top-entropy", "0.2"]), "--top-entropy"),
        (train(&["--objective", "topr", "--advantage", "rloo"]), "--advantage"),
        (train(&["--top-entropy", "1.5"]), "--top-entropy"),
        (train(&["--rejection", "k1-seq-max:0.5:2"]), "--rejection"),
        (train(&["--objective", "dpo", "--dpo-mix", "sigmoid:0.5,ipo:0.5"]), "--dpo-mix"),
        (train(&["--objective", "dpo", "--dpo-mix", "sigmoid"]), "--dpo-mix"),
        (train(&["--objective", "topr", "--dpo-mix", "sigmoid:1"]), "--dpo-mix"),
        (train(&["--rejection", "k3-token"]), "--rejection"),
        (train(&["--rejection", "k4-token:1"]), "--rejection"),
        (train(&["--rejection", "k2-token:2,"]), "--rejection"),
        (train(&["--rejection", "k2-token:2,none"]), "--rejection"),
        (train(&["--objective", "dro", "--dro-beta", "0"]), "--dro-beta"),
        (train(&["--objective", "topr", "--dro-beta", "0.2"]), "--dro-beta"),
        (train(&["--objective", "ppo", "--proximal", "recompute"]), "--proximal"),
        (train(&["--positive-nll", "-1"]), "--positive-nll"),
        (train(&["--objective", "dpo", "--positive-nll", "0.1"]), "--positive-nll"),
        (train(&["--objective", "dpo", "--off-policy-mask", "0.1"]), "--off-policy-mask"),
        (train(&["--kl-coef", "-1"]), "--kl-coef"),
        (train(&["--entropy-coef", "nan"]), "--entropy-coef"),
        (train(&["--objective", "dpo", "--dpo-loss", "exo-pair"]), "--dpo-loss"),
        (
            train(&["--objective", "dpo", "--dpo-loss", "robust", "--dpo-label-smoothing", "0.5"]),
            "--dpo-label-smoothing",
        ),
        (train(&["--max-grad-norm", "0"]), "--max-grad-norm"),
        (train(&["--max-grad-norm", "-1"]), "--max-grad-norm"),
        (train(&["--max-grad-norm", "NaN"]), "--max-grad-norm"),
        (train(&["--max-grad-norm", "inf"]), "--max-grad-norm"),
        (train(&["--dpo-beta", "0"]), "--dpo-beta"),
        (train(&["--baseline", "nan"]), "--baseline"),
        (train(&["--target-positive-proportion", "1.5"]), "--target-positive-proportion"),
        (train(&["--warmup-steps", "-1"]), "--warmup-steps"),
        (train(&["--save-every", "-1"]), "--save-every"),
        (train(&["--train-seed", "-1"]), "--train-seed"),
        (with(&eval, &["--temperature", "0"]), "--temperature"),
        (with(&eval, &["--temperature", "nan"]), "--temperature"),
        (with(&eval, &["--top-p", "0"]), "--top-p"),
        (with(&eval, &["--top-p", "1.01"]), "--top-p"),
        (with(&eval, &["--top-k", "-1"]), "--top-k"),
        (with(&eval, &["--max-new-tokens", "0"]), "--max-new-tokens"),
        (with(&eval, &["--max-new-tokens", "-5"]), "--max-new-tokens"),
        (with(&eval, &["--batch-size", "0"]), "--batch-size"),
        (with(&eval, &["--samples", "-1"]), "--samples"),
        (with(&eval, &["--synthetic-n", "0"]), "--synthetic-n"),
        (with(&eval, &["--difficulty", "0"]), "--difficulty"),
        (with(&eval, &["--difficulty", "1000"]), "--difficulty"),
        (with(&eval, &["--limit", "-1"]), "--limit"),
        (with(&eval, &["--shots", "100000"]), "--shots"),
        // Flags the chosen task or prompt style would ignore.
        (with(&eval, &["--data", "/nonexistent.jsonl"]), "--data"),
        (with(&eval, &["--shots", "2"]), "--shots"),
        (with(&eval, &["--shots-data", "/nonexistent.jsonl"]), "--shots-data"),
        (with(&eval, &["--task", "gsm8k", "--data", "/nonexistent.jsonl", "--synthetic-n", "5"]), "--synthetic-n"),
        (with(&eval, &["--task", "gsm8k", "--data", "/nonexistent.jsonl", "--difficulty", "3"]), "--difficulty"),
        (with(&sample, &["--samples-per-prompt", "0"]), "--samples-per-prompt"),
        (with(&sample, &["--batch-prompts", "0"]), "--batch-prompts"),
        (with(&generate, &["--temperature", "-1"]), "--temperature"),
        (with(&generate, &["--top-p", "nan"]), "--top-p"),
        (with(&generate, &["--max-new-tokens", "0"]), "--max-new-tokens"),
        (with(&iterate, &["--iterations", "0"]), "--iterations"),
        (with(&iterate, &["--samples-per-prompt", "0"]), "--samples-per-prompt"),
        (with(&iterate, &["--eval-n", "0"]), "--eval-n"),
        (with(&iterate, &["--raw-share", "1"]), "--raw-share"),
        (with(&iterate, &["--raw-share", "0"]), "--raw-share"),
        (with(&iterate, &["--raw-share", "nan"]), "--raw-share"),
        (with(&iterate, &["--raw-share", "0.5", "--curate", "one-positive"]), "--raw-share"),
        (with(&iterate, &["--eval-batch-size", "0"]), "--eval-batch-size"),
        (with(&iterate, &["--batch-size", "0"]), "--batch-size"),
        (with(&init, &["--layers", "0"]), "--layers"),
        (with(&init, &["--heads", "0"]), "--heads"),
        (with(&init, &["--kv-heads", "0"]), "--kv-heads"),
        (with(&init, &["--hidden", "-128"]), "--hidden"),
        (with(&init, &["--hidden", "100000000"]), "--hidden"),
        (with(&init, &["--max-positions", "0"]), "--max-positions"),
        (with(&init, &["--heads", "3"]), "--heads 3"),
        (with(&init, &["--heads", "4", "--kv-heads", "3"]), "--kv-heads 3"),
        (with(&init, &["--hidden", "20", "--heads", "4"]), "head size"),
        (with(&init, &["--layers", "256", "--hidden", "8192", "--intermediate", "100000"]), "--layers"),
        (with(&["sft-data", "--model", m, "--out", o], &["--slip-rate", "2"]), "--slip-rate"),
        (with(&["bench", "--model", m], &["--train-len", "1"]), "--train-len"),
        (with(&["bench", "--model", m], &["--train-len", "100000"]), "--train-len"),
        (with(&["bench", "--model", m], &["--kernel-pairs", "-1"]), "--kernel-pairs"),
        (with(&["demo", "--work", o], &["--sft-epochs", "0"]), "--sft-epochs"),
        (with(&["demo", "--work", o], &["--iterations", "-2"]), "--iterations"),
        (with(&["init"], &[]), "--out"),
    ];
    for (args, flag) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, &[flag]);
        assert!(!out.exists(), "llama {args:?} left {o} behind");
    }
    // "Off" is explicit, and accepted.
    let out = Command::new(llama()).args(train(&["--max-grad-norm", "none"])).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("opening /nonexistent.jsonl"));
}

/// Every data-set record is checked when read: an error naming the file, the line and what is
/// wrong, before the model is loaded and before the output directory is created.
#[test]
fn bad_data_records_are_refused_naming_file_and_line() {
    let (dir, m0) = fresh_tiny_model("llama_cli_refuse_records", "1");
    let sft = dir.join("sft.jsonl");
    run(&["sft-data", "--model", s(&m0), "--out", s(&sft), "--task", "synthetic", "--synthetic-n", "4"]);
    let lines: Vec<String> = std::fs::read_to_string(&sft).unwrap().lines().map(String::from).collect();
    let mutated = |f: &dyn Fn(&mut Value)| -> String {
        let mut v: Value = serde_json::from_str(&lines[1]).unwrap();
        f(&mut v);
        let mut all = lines.clone();
        all[1] = v.to_string();
        all.join("\n") + "\n"
    };
    let cases: Vec<(&str, String, &str)> = vec![
        ("vocab", mutated(&|v| v["completion_ids"][0] = 100_000.into()), "outside the model's vocabulary"),
        ("negative", mutated(&|v| v["prompt_ids"][0] = (-1).into()), "prompt_ids[0] = -1"),
        ("empty_prompt", mutated(&|v| v["prompt_ids"] = serde_json::json!([])), "prompt_ids is empty"),
        (
            "short_logp",
            mutated(&|v| {
                v["logp_mu"].as_array_mut().unwrap().pop();
            }),
            "logp_mu has",
        ),
        (
            "long_logp",
            mutated(&|v| {
                v["logp_mu"].as_array_mut().unwrap().push((-1.0).into());
            }),
            "logp_mu has",
        ),
        ("null_reward", mutated(&|v| v["reward"] = Value::Null), "reward"),
        (
            "huge_logp",
            {
                let text = mutated(&|v| v["logp_mu"][0] = "HUGE".into());
                text.replace("\"HUGE\"", "-1e300")
            },
            "out of range",
        ),
        ("huge_reward", mutated(&|v| v["reward"] = "HUGE".into()).replace("\"HUGE\"", "1e999"), "out of range"),
        ("cut", format!("{}\n{}\n{}", lines[0], lines[1], &lines[2][..40]), "cut short"),
    ];
    for (name, text, what) in &cases {
        let data = dir.join(format!("{name}.jsonl"));
        std::fs::write(&data, text).unwrap();
        let out = dir.join(format!("out-{name}"));
        let line = if *name == "cut" { ":3" } else { ":2" };
        let file_line = format!("{name}.jsonl{line}");
        refused(&["train", "--model", s(&m0), "--data", s(&data), "--out", s(&out)], &[&file_line, what]);
        assert!(!out.exists(), "{name}: the output directory was created");
    }
    // With --skip-bad-records a cut last line is skipped, reported and counted.
    let out = Command::new(llama())
        .args(["train", "--model", s(&m0), "--data", s(&dir.join("cut.jsonl")), "--out", s(&dir.join("out-skip"))])
        .args(["--skip-bad-records", "--objective", "sft", "--batch-size", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("cut.jsonl:3: skipping") && err.contains("skipped 1 record"), "{err}");
}

/// Models are checked on load: invalid config values and non-finite weights are refused naming
/// the file and the field (or tensor).
#[test]
fn bad_models_are_refused_naming_file_and_field() {
    let (dir, m0) = fresh_tiny_model("llama_cli_refuse_models", "1");
    let copy = |name: &str| -> PathBuf {
        let to = dir.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for f in std::fs::read_dir(&m0).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
        }
        to
    };
    let cases: Vec<(&str, &str, Value, &str)> = vec![
        ("heads0", "num_attention_heads", 0.into(), "num_attention_heads must be >= 1"),
        ("kv0", "num_key_value_heads", 0.into(), "num_key_value_heads must be >= 1"),
        ("hidden33", "hidden_size", 33.into(), "hidden_size 33 is not a multiple of num_attention_heads"),
        ("eps0", "rms_norm_eps", 0.0.into(), "rms_norm_eps"),
        ("eps_neg", "rms_norm_eps", (-1e-5).into(), "rms_norm_eps"),
        ("layers0", "num_hidden_layers", 0.into(), "num_hidden_layers must be >= 1"),
        ("vocab0", "vocab_size", 0.into(), "vocab_size must be >= 1"),
        ("vocab_neg", "vocab_size", (-5).into(), "vocab_size must be >= 1"),
        ("bos", "bos_token_id", 260.into(), "bos_token_id 260"),
        ("eos", "eos_token_id", serde_json::json!([257, 9999]), "eos_token_id 9999"),
        ("pad", "pad_token_id", (-1).into(), "pad_token_id -1"),
        ("huge", "num_hidden_layers", 1_000_000_000.into(), "parameters"),
        ("intermediate_huge", "intermediate_size", 1_000_000_000.into(), "parameters"),
    ];
    for (name, field, value, what) in cases {
        let m = copy(name);
        let path = m.join("config.json");
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        cfg[field] = value;
        std::fs::write(&path, cfg.to_string()).unwrap();
        refused(&["generate", "--model", s(&m), "--prompt", "hi", "--max-new-tokens", "2"], &["config.json", what]);
    }
    // Non-finite weights, and weights that overflow the dtype they are converted to.
    let m = copy("nan_weights");
    let file = m.join("model.safetensors");
    let tensors = tch::Tensor::read_safetensors(&file).unwrap();
    let victim = tensors.iter().position(|(n, _)| n == "model.norm.weight").unwrap();
    let _ = tensors[victim].1.get(0).fill_(f64::NAN);
    tch::Tensor::write_safetensors(&tensors, &file).unwrap();
    refused(
        &["generate", "--model", s(&m), "--prompt", "hi"],
        &["model.safetensors", "model.norm.weight", "non-finite"],
    );
    let m = copy("overflow_weights");
    let file = m.join("model.safetensors");
    let tensors = tch::Tensor::read_safetensors(&file).unwrap();
    let victim = tensors.iter().position(|(n, _)| n == "model.norm.weight").unwrap();
    let _ = tensors[victim].1.get(0).fill_(1e30);
    tch::Tensor::write_safetensors(&tensors, &file).unwrap();
    refused(&["generate", "--model", s(&m), "--prompt", "hi", "--dtype", "f16"], &["model.norm.weight", "non-finite"]);
    // A generation_config.json naming an EOS id outside the vocabulary.
    let m = copy("gen_eos");
    std::fs::write(m.join("generation_config.json"), r#"{"eos_token_id": 70000}"#).unwrap();
    refused(&["generate", "--model", s(&m), "--prompt", "hi"], &["generation_config.json", "eos_token_id 70000"]);
}

/// Runs `llama args`, returning (success, stderr).
fn attempt(args: &[&str]) -> (bool, String) {
    let out = Command::new(llama()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `args` and `extra` as one argument list.
fn with(args: &[&str], extra: &[&str]) -> Vec<String> {
    args.iter().chain(extra).map(|x| x.to_string()).collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The host name as the lock files record it.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default()
}

/// A lock file naming `pid` as its holder.
fn lock_for(path: &Path, pid: u32) {
    let holder = serde_json::json!({"pid": pid, "host": host(), "command": "llama train --out elsewhere"});
    std::fs::write(path, holder.to_string()).unwrap();
}

/// The pid of a process that has exited (and been waited for).
fn gone_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// Outputs are written whole or not at all: a write that fails leaves no destination file and
/// ends the command with one line naming the path; outputs that are not regular files (devices)
/// are refused before anything runs, so `sample --out /dev/full` stops at once.
#[test]
fn failed_writes_leave_no_file_and_name_the_path() {
    let (dir, m0) = fresh_tiny_model("llama_cli_writes", "1");
    let task = ["--task", "synthetic", "--synthetic-n", "2", "--max-new-tokens", "2"];
    refused(
        &with(&["sample", "--model", s(&m0), "--out", "/dev/full"], &task)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        &["/dev/full", "not a regular file"],
    );
    refused(
        &strs(&with(&["eval", "--model", s(&m0), "--out", "/dev/full"], &task)),
        &["/dev/full", "not a regular file"],
    );
    refused(&["sft-data", "--model", s(&m0), "--out", "/dev/null"], &["/dev/null", "not a regular file"]);
    // Nor is a device read as a data file (it would be read without end).
    let x = dir.join("x");
    refused(&["train", "--model", s(&m0), "--data", "/dev/zero", "--out", s(&x)], &["/dev/zero", "device"]);

    // A write that fails half-way (the file size limit, which binds root too: `ulimit -f`, with
    // SIGXFSZ ignored so that the write returns EFBIG instead of killing the process).
    let limited = |args: &[&str]| -> (bool, String) {
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        let script = format!("trap '' XFSZ; ulimit -f 4; exec '{}' {}", llama().display(), quoted.join(" "));
        let out = Command::new("sh").arg("-c").arg(script).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let full = dir.join("full");
    std::fs::create_dir_all(&full).unwrap();
    let q = full.join("q.jsonl");
    let many = ["--synthetic-n", "40", "--max-new-tokens", "4"];
    let (ok, err) = limited(&strs(&with(&["eval", "--model", s(&m0), "--out", s(&q)], &many)));
    let last = err.lines().last().unwrap_or_default();
    assert!(!ok && last.starts_with("error: writing ") && last.contains(s(&q)), "{err}");
    assert_eq!(std::fs::read_dir(&full).unwrap().count(), 0, "a failed eval --out left a file behind");
    // sample stops at the first failed write, naming its file (what was written is kept: it
    // resumes).
    let d = full.join("d.jsonl");
    let (ok, err) = limited(&strs(&with(&["sample", "--model", s(&m0), "--out", s(&d)], &many)));
    let last = err.lines().last().unwrap_or_default();
    assert!(!ok && last.starts_with("error: writing ") && last.contains(s(&d)), "{err}");
    assert!(std::fs::metadata(&d).unwrap().len() <= 4096 && !full.join("d.jsonl.lock").exists());

    let ro = dir.join("read-only");
    std::fs::create_dir_all(&ro).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::File::create(ro.join("probe")).is_ok() {
        eprintln!("skipped: this user (root?) writes into a read-only directory");
        return;
    }
    let sft = ro.join("sft.jsonl");
    refused(&["sft-data", "--model", s(&m0), "--out", s(&sft), "--synthetic-n", "2"], &[s(&sft)]);
    let q = ro.join("questions.jsonl");
    refused(&strs(&with(&["eval", "--model", s(&m0), "--out", s(&q)], &task)), &[s(&q)]);
    refused(&["init", "--out", s(&ro.join("m"))], &[s(&ro.join("m"))]);
    assert_eq!(std::fs::read_dir(&ro).unwrap().count(), 0, "a failed write left a file behind");
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();

    // A successful eval --out writes the whole file and leaves no lock or temporary file.
    let ok = dir.join("ok");
    std::fs::create_dir_all(&ok).unwrap();
    run(&strs(&with(&["eval", "--model", s(&m0), "--out", s(&ok.join("q.jsonl"))], &task)));
    let names: Vec<String> =
        std::fs::read_dir(&ok).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["q.jsonl"]);
    assert_eq!(std::fs::read_to_string(ok.join("q.jsonl")).unwrap().lines().count(), 2);
}

/// No command writes into its own input model: an output that is the model directory, lies
/// inside it or contains it is refused before anything is written; `train` refuses an output
/// directory holding a finished model, `init` and `convert` one holding any model.
#[test]
fn a_run_never_writes_into_its_own_model() {
    let (dir, m0) = fresh_tiny_model("llama_cli_own_model", "1");
    let sft = dir.join("sft.jsonl");
    run(&["sft-data", "--model", s(&m0), "--out", s(&sft), "--synthetic-n", "4"]);
    let before = std::fs::read(m0.join("model.safetensors")).unwrap();
    let train = |out: &Path| -> Vec<String> {
        with(
            &["train", "--model", s(&m0), "--data", s(&sft), "--objective", "sft", "--batch-size", "4"],
            &["--out", s(out)],
        )
    };
    let inside = m0.join("sub");
    let same = dir.join("x/../m0");
    for out in [&m0, &inside, &dir, &same] {
        refused(&strs(&train(out)), &["input model directory"]);
    }
    assert!(!inside.exists());
    let task = ["--synthetic-n", "2", "--max-new-tokens", "2"];
    refused(
        &strs(&with(&["iterate", "--model", s(&m0), "--work", s(&m0.join("w"))], &task)),
        &["input model directory"],
    );
    refused(
        &strs(&with(&["sample", "--model", s(&m0), "--out", s(&m0.join("d.jsonl"))], &task)),
        &["input model directory"],
    );
    refused(
        &strs(&with(&["eval", "--model", s(&m0), "--out", s(&m0.join("q.jsonl"))], &task)),
        &["input model directory"],
    );
    refused(&["sft-data", "--model", s(&m0), "--out", s(&m0.join("sft.jsonl"))], &["input model directory"]);
    refused(&["convert", "--model", s(&m0), "--out", s(&m0)], &["input model directory"]);
    refused(&["init", "--out", s(&m0)], &["holds a model already"]);
    assert_eq!(std::fs::read(m0.join("model.safetensors")).unwrap(), before, "the input model changed");

    // A finished model is not overwritten, with or without --resume; no lock is left behind.
    let m1 = dir.join("m1");
    run(&strs(&train(&m1)));
    let trained = std::fs::read(m1.join("model.safetensors")).unwrap();
    refused(&strs(&train(&m1)), &["holds a finished model", "another --out"]);
    refused(&strs(&with(&strs(&train(&m1)), &["--resume"])), &["holds a finished model"]);
    refused(&["convert", "--model", s(&m0), "--out", s(&m1)], &["holds a model already"]);
    assert_eq!(std::fs::read(m1.join("model.safetensors")).unwrap(), trained);
    assert!(!m1.join("LOCK").exists(), "the lock outlived the refused run");
}

/// A directory in use is locked: a second run on it is refused naming the holder's pid and
/// command; a lock whose process has exited is taken over with a note.
#[test]
fn locked_outputs_refuse_a_second_run_and_stale_locks_are_taken_over() {
    let (dir, m0) = fresh_tiny_model("llama_cli_locks", "1");
    let sft = dir.join("sft.jsonl");
    run(&["sft-data", "--model", s(&m0), "--out", s(&sft), "--synthetic-n", "4"]);
    let me = std::process::id();
    let pid = format!("process {me}");

    let out = dir.join("m1");
    std::fs::create_dir_all(&out).unwrap();
    lock_for(&out.join("LOCK"), me);
    let train =
        ["train", "--model", s(&m0), "--data", s(&sft), "--out", s(&out), "--objective", "sft", "--batch-size", "4"];
    refused(&train, &[&pid, "llama train --out elsewhere"]);
    assert!(!out.join("model.safetensors").exists());
    // The holder exited: its lock is taken over, and removed at the end of the run.
    lock_for(&out.join("LOCK"), gone_pid());
    let (ok, err) = attempt(&train);
    assert!(ok && err.contains("taking over"), "{err}");
    assert!(out.join("model.safetensors").exists() && !out.join("LOCK").exists());

    let task = ["--synthetic-n", "2", "--max-new-tokens", "2"];
    let data = dir.join("d.jsonl");
    lock_for(&dir.join("d.jsonl.lock"), me);
    refused(&strs(&with(&["sample", "--model", s(&m0), "--out", s(&data)], &task)), &[&pid]);
    assert!(!data.exists());
    let q = dir.join("q.jsonl");
    lock_for(&dir.join("q.jsonl.lock"), me);
    refused(&strs(&with(&["eval", "--model", s(&m0), "--out", s(&q)], &task)), &[&pid]);
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    lock_for(&work.join("LOCK"), me);
    refused(&strs(&with(&["iterate", "--model", s(&m0), "--work", s(&work)], &task)), &[&pid]);
    let demo = dir.join("demo");
    std::fs::create_dir_all(&demo).unwrap();
    lock_for(&demo.join("LOCK"), me);
    refused(&["demo", "--quick", "--work", s(&demo)], &[&pid]);
}

/// `sample` extends an existing data set only with the same model, task and settings: another
/// task is refused, naming what differs, and the file is left as it was.
#[test]
fn sampling_more_into_a_data_set_of_another_task_is_refused() {
    let (dir, m0) = fresh_tiny_model("llama_cli_sample_resume", "1");
    let data = dir.join("d.jsonl");
    let sample = |extra: &[&str]| {
        with(
            &["sample", "--model", s(&m0), "--out", s(&data), "--samples-per-prompt", "1", "--max-new-tokens", "2"],
            extra,
        )
    };
    run(&strs(&sample(&["--synthetic-n", "2"])));
    let before = std::fs::read_to_string(&data).unwrap();
    refused(&strs(&sample(&["--synthetic-n", "2", "--task-seed", "2"])), &["d.jsonl", "prompts.hash", "another --out"]);
    refused(&strs(&sample(&["--synthetic-n", "3"])), &["problems 2 → 3"]);
    refused(&strs(&sample(&["--synthetic-n", "2", "--temperature", "0.5"])), &["sampling.temperature 1.0 → 0.5"]);
    assert_eq!(std::fs::read_to_string(&data).unwrap(), before);
    assert!(!dir.join("d.jsonl.lock").exists());
    // The same settings: nothing to add.
    run(&strs(&sample(&["--synthetic-n", "2"])));
    assert_eq!(std::fs::read_to_string(&data).unwrap(), before);
    // A file of an earlier version (its record has no `streams`: drawn by another scheme) is
    // refused, not extended with other draws.
    let record = std::path::PathBuf::from(format!("{}.run.json", data.display()));
    let mut run_json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    assert_eq!(run_json["streams"], "per_completion");
    run_json.as_object_mut().unwrap().remove("streams");
    std::fs::write(&record, serde_json::to_string(&run_json).unwrap()).unwrap();
    refused(&strs(&sample(&["--synthetic-n", "2"])), &["streams batch → per_completion"]);
    assert_eq!(std::fs::read_to_string(&data).unwrap(), before);
    run_json["streams"] = "per_completion".into();
    std::fs::write(&record, serde_json::to_string(&run_json).unwrap()).unwrap();
    // Other numerics, or other weights of the same size at the same path: another μ.
    refused(&strs(&sample(&["--synthetic-n", "2", "--dtype", "bf16"])), &["numerics.dtype f32 → bf16"]);
    let other = dir.join("other");
    init_seeded(&other, "1", "1");
    std::fs::copy(other.join("model.safetensors"), m0.join("model.safetensors")).unwrap();
    refused(&strs(&sample(&["--synthetic-n", "2"])), &["model.content"]);
    assert_eq!(std::fs::read_to_string(&data).unwrap(), before);
}

/// `llama init` of the tiny shape with `layers` and `seed`.
fn init_seeded(dir: &Path, layers: &str, seed: &str) {
    let args = ["init", "--out", s(dir), "--layers", layers, "--hidden", "32", "--heads", "2", "--kv-heads", "1"];
    run(&strs(&with(&args, &["--intermediate", "64", "--seed", seed])));
}

/// A killed training run resumed with another setting is refused, listing each difference; the
/// state is kept, so the run still resumes with its own settings.
#[test]
fn a_training_run_resumed_with_other_settings_is_refused_listing_them() {
    let (dir, m0) = fresh_tiny_model("llama_cli_train_resume", "1");
    let sft = dir.join("sft.jsonl");
    run(&["sft-data", "--model", s(&m0), "--out", s(&sft), "--synthetic-n", "20"]);
    let out = dir.join("m1");
    let train = |extra: &[&str]| {
        with(
            &["train", "--model", s(&m0), "--data", s(&sft), "--out", s(&out)],
            &[&["--batch-size", "2", "--micro-batch-size", "1", "--epochs", "30"], extra].concat(),
        )
    };
    #[allow(clippy::zombie_processes)] // killed and waited for below, also on failure
    let mut child = Command::new(llama())
        .args(train(&["--lr", "1e-3", "--objective", "sft"]))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !out.join("state/progress.json").exists() && start.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let _ = child.kill();
    child.wait().unwrap();
    assert!(out.join("state").exists() && !out.join("model.safetensors").exists(), "killed too late");
    refused(
        &strs(&train(&["--lr", "2e-3", "--resume", "--objective", "sft"])),
        &["--resume: settings differ", "lr 1e-3 → 2e-3", "another --out"],
    );
    refused(
        &strs(&train(&["--lr", "1e-3", "--resume", "--objective", "tis", "--train-seed", "3"])),
        &["objective sft → tis", "seed 0 → 3"],
    );
    let other = dir.join("other.jsonl");
    let text = std::fs::read_to_string(&sft).unwrap();
    std::fs::write(&other, text.lines().skip(1).collect::<Vec<_>>().join("\n") + "\n").unwrap();
    let mut a = train(&["--lr", "1e-3", "--resume", "--objective", "sft"]);
    a[4] = s(&other).to_string();
    refused(&strs(&a), &["data.path", "records.hash"]);
    refused(
        &strs(&train(&["--lr", "1e-3", "--resume", "--objective", "sft", "--dtype", "bf16"])),
        &["numerics.dtype f32 → bf16"],
    );
    assert!(out.join("state").exists(), "a refused resume removed the state");
}

/// `iterate --resume` refuses another objective, naming it; a smaller `--iterations` keeps the
/// rows of later iterations in iterations.jsonl, which carries each row's settings.
#[test]
fn iterate_resumes_only_its_own_settings_and_keeps_every_row() {
    let (dir, m0) = fresh_tiny_model("llama_cli_iterate_resume", "1");
    let work = dir.join("work");
    let iterate = |extra: &[&str]| with(&tiny_iterate(&m0, &work), extra);
    run(&strs(&iterate(&["--iterations", "2"])));
    let rows = std::fs::read_to_string(work.join("iterations.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), 3, "{rows}");
    for line in rows.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["settings"]["train"]["objective"], "topr", "{v}");
        assert_eq!(v["settings"]["iterations"], 2, "{v}");
    }
    let table = run(&strs(&iterate(&["--iterations", "1", "--resume"])));
    assert_eq!(std::fs::read_to_string(work.join("iterations.jsonl")).unwrap(), rows, "rows were rewritten");
    assert_eq!(table.lines().count(), 4, "the table shows every row of the run:\n{table}");
    // A last row cut short by an interrupted write is dropped, and the resumed loop writes it again.
    std::fs::write(work.join("iterations.jsonl"), &rows[..rows.len() - 20]).unwrap();
    run(&strs(&iterate(&["--iterations", "2", "--resume"])));
    assert_eq!(std::fs::read_to_string(work.join("iterations.jsonl")).unwrap(), rows, "the cut row comes back");
    refused(
        &strs(&iterate(&["--iterations", "2", "--resume", "--objective", "tis"])),
        &["train.objective topr → tis", "another --work"],
    );
    refused(&strs(&iterate(&["--iterations", "2", "--resume", "--task-seed", "5"])), &["task.seed 1 → 5"]);
    refused(&strs(&iterate(&["--iterations", "2", "--resume", "--dtype", "bf16"])), &["numerics.dtype f32 → bf16"]);
    assert!(!work.join("LOCK").exists());
    compare_trains_other_arms_on_an_iterations_data(&dir, &work);
}

/// A loop's work directory restored from its small records on another machine (settings, done
/// markers, evaluations, metrics; no weights, data sets or training state, as `study`'s records
/// are committed) resumes where it stopped: a finished loop samples and trains nothing, and a
/// longer one trains the missing models again from their records' seeds, finds the same
/// trainings, and ends with the same results as the original work directory. A record that
/// the rebuilt training does not reproduce is replaced: that iteration's evaluation and the later
/// iterations are made again from the rebuilt model.
#[test]
fn a_loop_restored_from_its_records_resumes_with_the_same_results() {
    let (dir, m0) = fresh_tiny_model("llama_cli_iterate_restore", "1");
    let iterate = |work: &Path, n: &str| {
        let mut args = with(&tiny_iterate(&m0, work), &["--lr", "1e-3", "--iterations", n]);
        if work.join("settings.json").exists() {
            args.push("--resume".into());
        }
        let out = Command::new(llama()).args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stderr).unwrap()
    };
    let original = dir.join("original");
    iterate(&original, "2");
    let restore = |to: &Path| copy_records(&original, to);
    let (same, edited, stopped) = (dir.join("restored"), dir.join("edited"), dir.join("stopped"));
    restore(&same);
    restore(&edited);
    restore(&stopped);
    // As a rebuild of iteration 1 leaves it when it stops half-way: its record set aside.
    let (done, kept) = (stopped.join("iter-1/train.done.json"), stopped.join("iter-1/train.done.recorded.json"));
    std::fs::rename(&done, &kept).unwrap();

    let log = iterate(&same, "2");
    assert!(!log.contains("training it again"), "a finished loop needs no model:\n{log}");
    assert!(!same.join("iter-1/data.jsonl").exists() && !same.join("iter-2/model").exists());

    // The record of iteration 1's training, as other code would have left it.
    let done = edited.join("iter-1/train.done.json");
    let mut record: Value = serde_json::from_str(&std::fs::read_to_string(&done).unwrap()).unwrap();
    record["final_loss"] = Value::from(123.0);
    std::fs::write(&done, record.to_string()).unwrap();
    std::fs::write(edited.join("iter-1/eval.json"), "{\"stale\": true}").unwrap();

    // As a rebuild of iteration 1 leaves it when a kill stops its clean-up: trained again, with a
    // record that differs set aside, the evaluation and the later iteration of the record's model
    // still there. It is settled before anything else: they are made again.
    let cleanup = dir.join("cleanup");
    assert!(Command::new("cp").arg("-r").arg(&original).arg(&cleanup).status().unwrap().success());
    std::fs::write(cleanup.join("iter-1/train.done.recorded.json"), record.to_string()).unwrap();

    iterate(&original, "3");
    let log = iterate(&cleanup, "3");
    assert!(log.contains("iteration 1: rebuilt, but its training differs from the record"), "{log}");
    assert!(!cleanup.join("iter-1/train.done.recorded.json").exists());
    let log = iterate(&same, "3");
    assert_eq!(log.matches("the same training as recorded").count(), 2, "{log}");
    let log = iterate(&edited, "3");
    assert!(log.contains("iteration 1: rebuilt, but its training differs from the record"), "{log}");
    let log = iterate(&stopped, "3");
    assert_eq!(log.matches("the same training as recorded").count(), 2, "{log}");
    assert!(done.exists() && !kept.exists());
    for f in ["iter-1/eval.json", "iter-2/eval.json", "iter-3/eval.json", "iter-3/metrics.jsonl"] {
        let read = |w: &Path| std::fs::read_to_string(w.join(f)).unwrap();
        assert_eq!(read(&same), read(&original), "{f} of the restored loop");
        assert_eq!(read(&edited), read(&original), "{f} of the loop with an edited record");
        assert_eq!(read(&stopped), read(&original), "{f} of the loop whose rebuild had stopped");
        assert_eq!(read(&cleanup), read(&original), "{f} of the loop whose clean-up had stopped");
    }
    // The table's rows (their settings record the --iterations of the run that added them).
    let accuracies = |w: &Path| -> Vec<(Value, Value)> {
        let text = std::fs::read_to_string(w.join("iterations.jsonl")).unwrap();
        let rows = text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap());
        rows.map(|r| (r["iteration"].clone(), r["accuracy"].clone())).collect()
    };
    assert_eq!(accuracies(&original).len(), 4);
    assert_eq!(accuracies(&same), accuracies(&original));
    assert_eq!(accuracies(&edited), accuracies(&original));
    assert_eq!(accuracies(&stopped), accuracies(&original));
    assert_eq!(accuracies(&cleanup), accuracies(&original));
}

/// `iterate` of the tiny model `m0` in `work` at CI size: 4 problems, 2 samples of 4 tokens each,
/// batches of 8, 2 held-out problems.
fn tiny_iterate<'a>(m0: &'a Path, work: &'a Path) -> Vec<&'a str> {
    let sizes = ["--synthetic-n", "4", "--difficulty", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4"];
    let mut args = vec!["iterate", "--model", s(m0), "--work", s(work)];
    args.extend(sizes);
    args.extend(["--batch-size", "8", "--eval-n", "2"]);
    args
}

/// Copies the small records of the work directory `from` to `to`, as `scripts/smollm2_study.sh`
/// commits them: JSON and JSONL files, without data sets, models or training state.
fn copy_records(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if path.is_dir() {
            if !["model", "state", "shared"].contains(&name.as_str()) {
                copy_records(&path, &to.join(&name));
            }
        } else if (name.ends_with(".json") || name.ends_with(".jsonl")) && name != "data.jsonl" {
            std::fs::create_dir_all(to).unwrap();
            std::fs::copy(&path, to.join(&name)).unwrap();
        }
    }
}

/// `compare` on the finished two-iteration run of the test above (TOPR, baseline 0): an arm with
/// the run's own objective and baseline reproduces the run's model bit for bit (same μ, same
/// data, same settings), the table pairs every arm with μ and the run's model, a rerun reuses the
/// finished arms, and an unfinished iteration or a bad arm is refused in one line.
fn compare_trains_other_arms_on_an_iterations_data(dir: &Path, work: &Path) {
    let compare = ["compare", "--run", s(work), "--iteration", "2", "--arms", "topr,reinforce-p0.5"];
    let table = run(&compare);
    assert!(table.contains("| reinforce-p0.5 |"), "{table}");
    let out = work.join("compare-iter-2");
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        weights(&out.join("topr/model")) == weights(&work.join("iter-2/model")),
        "the run's own arm gives the run's weights"
    );
    assert!(weights(&out.join("reinforce-p0.5/model")) != weights(&work.join("iter-2/model")));
    let read = |f: &Path| -> Vec<Value> {
        std::fs::read_to_string(f).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let rows = read(&out.join("compare.jsonl"));
    let names: Vec<&str> = rows.iter().map(|r| r["arm"].as_str().unwrap()).collect();
    assert_eq!(names, ["mu", "run", "topr", "reinforce-p0.5"]);
    assert!(rows.iter().all(|r| r["questions"] == 2), "{rows:?}");
    assert_eq!(rows[2]["vs_run"], 0.0);
    assert_eq!(rows[0]["gain"], 0.0);
    // μ of iteration 2 is iteration 1's model.
    let it = read(&work.join("iterations.jsonl"));
    assert_eq!(rows[0]["accuracy"], it[1]["accuracy"]);
    assert_eq!(rows[1]["accuracy"], it[2]["accuracy"]);
    assert_eq!(rows[2]["accuracy"], it[2]["accuracy"]);
    let done = out.join("reinforce-p0.5/train.done.json");
    let stamp = std::fs::metadata(&done).unwrap().modified().unwrap();
    assert_eq!(run(&compare), table, "a rerun reuses the finished arms");
    assert_eq!(std::fs::metadata(&done).unwrap().modified().unwrap(), stamp);
    refused(&["compare", "--run", s(work), "--iteration", "3"], &["iteration 3", "not finished"]);
    refused(&strs(&with(&compare, &["--dtype", "bf16"])), &["--dtype", "made in f32 on cpu", "asks for bf16 on cpu"]);
    assert!(std::fs::read_to_string(out.join("compare.md")).unwrap().contains("in f32 on cpu (onednn kernels)"));
    refused(&["compare", "--run", s(work), "--arms", "topr-p1.5"], &["(0, 1)"]);
    refused(&["compare", "--run", s(work), "--arms", "nope"], &["unknown objective"]);
    refused(&["compare", "--run", s(dir)], &["settings.json"]);
}

/// Settings that would train nothing, or ascend the loss, are refused naming the option, before
/// anything is written: a top-entropy share of 0, DPO-mixture weights of 0, below 0 or beyond
/// f32, and SFT on a data set without a positive.
#[test]
fn no_op_or_reversed_training_is_refused() {
    let (dir, m0) = fresh_tiny_model("llama_cli_no_op", "1");
    let out = dir.join("out");
    let train = |extra: &[&str]| -> Vec<String> {
        with(&["train", "--model", s(&m0), "--data", "/nonexistent.jsonl", "--out", s(&out)], extra)
    };
    for (extra, flag) in [
        (&["--top-entropy", "0"][..], "--top-entropy"),
        (&["--objective", "dpo", "--dpo-mix", "sigmoid:0"][..], "--dpo-mix"),
        (&["--objective", "dpo", "--dpo-mix", "sigmoid:-1"][..], "--dpo-mix"),
        (&["--objective", "dpo", "--dpo-mix", "sigmoid:1e39"][..], "--dpo-mix"),
        (&["--objective", "dpo", "--dpo-mix", "sigmoid:0.5,bco-pair:0"][..], "--dpo-mix"),
    ] {
        refused(&strs(&train(extra)), &[flag]);
        assert!(!out.exists(), "{extra:?} left {} behind", out.display());
    }
    // A data set without a positive: an untrained model answers none of its questions.
    let data = dir.join("d.jsonl");
    let task = ["--task", "synthetic", "--synthetic-n", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4"];
    run(&strs(&with(&["sample", "--model", s(&m0), "--out", s(&data)], &task)));
    let samples = topr_llama::sample::read_dataset(&data, false).unwrap().0;
    assert!(samples.iter().all(|x| x.reward < 0.0), "a positive among {} samples", samples.len());
    let sft = with(&["train", "--model", s(&m0), "--data", s(&data), "--out", s(&out)], &["--objective", "sft"]);
    refused(&strs(&sft), &["positives", s(&data)]);
    assert!(!topr_llama::io::holds_model(&out), "SFT on no positive left a model in {}", out.display());
    // The prefix an interrupted `sample` leaves is refused: it holds the first prompts only.
    let whole = std::fs::read_to_string(&data).unwrap();
    let first_three: String = whole.split_inclusive('\n').take(3).collect();
    std::fs::write(&data, first_three).unwrap();
    let topr = with(&["train", "--model", s(&m0), "--data", s(&data), "--out", s(&out)], &["--objective", "topr"]);
    refused(&strs(&topr), &[s(&data), "3 of its 4 completions", "interrupted `sample`"]);
    assert!(!out.exists(), "a refused run left {} behind", out.display());
    std::fs::write(&data, whole).unwrap();
    // TOPR learns from the same negatives.
    run(&strs(&topr));
    assert!(topr_llama::io::holds_model(&out));
}

/// A resumed demo does not reuse warm-up stages made with other settings: `--sft-epochs` (or
/// any size, seed or recipe) different from the record of the warm-up is refused naming it, and
/// the finished demo is left as it was; the same settings resume.
#[test]
fn a_demo_resumed_with_another_warm_up_is_refused() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llama_cli_demo_resume");
    let _ = std::fs::remove_dir_all(&dir);
    let work = dir.join("demo");
    let demo = |extra: &[&str]| with(&["demo", "--quick", "--work", s(&work)], extra);
    run(&strs(&demo(&[])));
    let table = std::fs::read(work.join("topr/iterations.jsonl")).unwrap();
    refused(&strs(&demo(&["--resume", "--sft-epochs", "3"])), &["sft_epochs 1 → 3", "--work"]);
    assert_eq!(std::fs::read(work.join("topr/iterations.jsonl")).unwrap(), table);
    run(&strs(&demo(&["--resume"])));
    assert_eq!(std::fs::read(work.join("topr/iterations.jsonl")).unwrap(), table);
}

/// Every `llama` command line of the README and the docs names only flags its subcommand has:
/// each `--flag` after `llama SUB` (or `llama check SUB`) in a code span or a code block is in
/// `llama SUB --help`, so that a renamed or removed flag cannot stay documented.
#[test]
fn the_docs_name_only_flags_the_commands_have() {
    let repo = common::repo();
    let mut files = vec![repo.join("README.md")];
    let docs = std::fs::read_dir(repo.join("docs")).unwrap().map(|e| e.unwrap().path());
    files.extend(docs.filter(|p| p.extension().is_some_and(|x| x == "md")));
    let mut help = std::collections::HashMap::new();
    let (mut checked, mut wrong) = (0, Vec::new());
    for file in &files {
        for code in code_of(&std::fs::read_to_string(file).unwrap()) {
            for (command, flags) in llama_command_lines(&code) {
                let text = help.entry(command.clone()).or_insert_with(|| help_of(&command));
                for flag in flags {
                    checked += 1;
                    if !has_flag(text, &flag) {
                        wrong.push(format!("{}: llama {command} --{flag}", file.display()));
                    }
                }
            }
        }
    }
    assert!(checked > 100, "only {checked} documented flags found: is the scan broken?");
    assert!(wrong.is_empty(), "documented flags the commands do not have:\n{}", wrong.join("\n"));
}

/// `llama ARGS --help`, or "" when ARGS is no command.
fn help_of(command: &str) -> String {
    let out = Command::new(llama()).args(command.split(' ')).arg("--help").output().unwrap();
    if out.status.success() { String::from_utf8(out.stdout).unwrap() } else { String::new() }
}

/// Whether `help` lists `--flag` (not only a longer flag that starts with it).
fn has_flag(help: &str, flag: &str) -> bool {
    let needle = format!("--{flag}");
    help.match_indices(&needle)
        .any(|(i, _)| !help[i + needle.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-'))
}

/// The code of a Markdown text: each line of a fenced block, and each `code span` elsewhere.
fn code_of(text: &str) -> Vec<String> {
    let (mut out, mut fenced) = (Vec::new(), false);
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            out.push(line.to_string());
        } else {
            out.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
        }
    }
    out
}

/// The `llama` commands of a line of code and the flags each names, up to a comment or the
/// next command of a chain; a word after `llama` that is no subcommand (`--`, `train|eval`) is
/// skipped, and so is its line.
fn llama_command_lines(code: &str) -> Vec<(String, Vec<String>)> {
    let words: Vec<&str> = code.split_whitespace().collect();
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        let Some(&sub) = words.get(i + 1).filter(|_| *w == "llama") else { continue };
        if !sub.chars().all(|c| c.is_ascii_lowercase() || c == '-') || sub.starts_with('-') {
            continue;
        }
        let mut rest = &words[i + 2..];
        let mut command = sub.to_string();
        if sub == "check" && !rest.is_empty() {
            command = format!("check {}", rest[0]);
            rest = &rest[1..];
        }
        let end = rest.iter().position(|w| w.starts_with('#') || ["&&", "||", "|", ";"].contains(w));
        let flags = rest[..end.unwrap_or(rest.len())]
            .iter()
            .filter_map(|w| w.trim_start_matches(['[', '(']).strip_prefix("--"))
            .map(|f| f.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect::<String>())
            .filter(|f| !f.is_empty())
            .collect();
        out.push((command, flags));
    }
    out
}
