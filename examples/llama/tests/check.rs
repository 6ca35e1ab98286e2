//! The GPU check's own commands through the built binary, on the CPU: `init --vocab-size`,
//! `check parity`, `check peak`, `check losses` and `bench --gen-batch` (the GPU bundle's
//! `run.sh` runs them; CI runs the bundle at toy sizes too).

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn llama(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_llama")).args(args).output().unwrap()
}

/// The JSON lines a successful command printed.
fn records(args: &[&str]) -> Vec<Value> {
    let out = llama(args);
    assert!(out.status.success(), "llama {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A tiny model with `vocab` embedding rows, made by `init`.
fn model(name: &str, vocab: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    let size = ["--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"];
    let out = llama(&[&["init", "--out", dir.to_str().unwrap(), "--vocab-size", vocab][..], &size[..]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

#[test]
fn init_pads_the_vocabulary_and_keeps_the_tokenizers_special_ids() {
    let dir = model("check_vocab", "1000");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["vocab_size"], 1000);
    // The byte-level tokenizer's specials follow its 256 byte tokens, whatever the rows.
    assert_eq!((cfg["bos_token_id"].as_i64(), cfg["eos_token_id"].as_i64()), (Some(256), Some(257)));
    // The model generates and scores with the padded vocabulary.
    let out = llama(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "2+2", "--max-new-tokens", "4"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Fewer rows than the tokenizer's ids: refused in one line naming the flag, nothing written.
    let bad = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("check_vocab_bad");
    let _ = std::fs::remove_dir_all(&bad);
    let out = llama(&["init", "--out", bad.to_str().unwrap(), "--vocab-size", "100"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--vocab-size 100") && err.trim().lines().count() == 1, "{err}");
    assert!(!bad.exists());
}

#[test]
fn parity_on_the_cpu_compares_the_cpu_with_itself() {
    let dir = model("check_parity", "300");
    let r = records(&[
        "check",
        "parity",
        "--model",
        dir.to_str().unwrap(),
        "--device",
        "cpu",
        "--prompts",
        "2",
        "--len",
        "8",
        "--new-tokens",
        "4",
    ]);
    assert_eq!(r.len(), 1);
    let p = &r[0];
    assert_eq!(p["what"], "parity");
    assert_eq!(p["f32_rel"], 0.0);
    assert_eq!(p["greedy_identical"], true);
    assert_eq!(p["positions"], 16);
    // bf16 is a real rounding, even on the CPU: not zero, well inside the stated bound.
    let bf16 = p["bf16_rel"].as_f64().unwrap();
    assert!(bf16 > 0.0 && bf16 < 5e-2, "{bf16}");
}

#[test]
fn losses_report_their_host_reads_full_and_none_with_shape_checks() {
    let r = records(&["check", "losses", "--device", "cpu", "--batch", "4", "--len", "8", "--iters", "1"]);
    let reads = |loss: &str, checks: &str| {
        r.iter()
            .find(|x| x["loss"] == loss && x["checks"] == checks)
            .map(|x| x["host_reads_per_call"].as_u64().unwrap())
            .unwrap()
    };
    for loss in ["topr_token_loss", "ppo_clip_loss", "dpo_loss"] {
        assert!(reads(loss, "full") > 0, "{loss}");
        assert_eq!(reads(loss, "shapes"), 0, "{loss}");
    }
    assert!(r.iter().all(|x| x["ms"].as_f64().unwrap() > 0.0));
}

/// The largest accepted sizes of `check losses` (2^40 tokens, about 140 TB) are refused with a
/// one-line error naming the sizes and the memory, before anything is allocated (was: a panic on
/// the failed allocation, exit 101).
#[test]
fn sizes_beyond_the_memory_are_refused_naming_them() {
    let max = (1u64 << 20).to_string();
    let out = llama(&["check", "losses", "--device", "cpu", "--batch", &max, "--len", &max, "--iters", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    for needle in ["error: ", "--batch 1048576 --len 1048576", "140737.5 GB", "available"] {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    assert!(out.stdout.is_empty());
    // Sampling whose KV cache (4096 slots × 7232 positions × 256 layers, about 1 TB) the memory
    // cannot hold: refused naming it, before any prefill.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("check_deep");
    let _ = std::fs::remove_dir_all(&dir);
    let size = ["--layers", "256", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"];
    let m = dir.join("deep");
    let out = llama(&[&["init", "--out", m.to_str().unwrap(), "--max-positions", "8192"][..], &size[..]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let data = dir.join("d.jsonl");
    let task = ["--task", "synthetic", "--synthetic-n", "4096", "--samples-per-prompt", "4", "--batch-prompts", "1024"];
    let out = llama(
        &[
            &["sample", "--model", m.to_str().unwrap(), "--out", data.to_str().unwrap()][..],
            &task,
            &["--max-new-tokens", "7000"],
        ]
        .concat(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(last.starts_with("error: the KV cache of 4096 slot(s) × 7232 positions (256 layers) would take"), "{err}");
    // Training whose micro-batch logits (1,024 completions × their predicted positions × a
    // million ids, about half a TB with their log-softmax and gradient) the memory cannot hold:
    // refused before the first forward.
    let wide = dir.join("wide");
    let size = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"];
    let out = llama(&[&["init", "--out", wide.to_str().unwrap(), "--vocab-size", "1000000"][..], &size[..]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sft = dir.join("sft.jsonl");
    let out = llama(&[
        "sft-data",
        "--model",
        wide.to_str().unwrap(),
        "--out",
        sft.to_str().unwrap(),
        "--synthetic-n",
        "1024",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let trained = dir.join("trained");
    let (w, d, t) = (wide.to_str().unwrap(), sft.to_str().unwrap(), trained.to_str().unwrap());
    let args = ["train", "--model", w, "--data", d, "--out", t, "--objective", "sft", "--batch-size", "1024"];
    let out = llama(&[&args[..], &["--micro-batch-size", "1024"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        last.starts_with("error: the logits of a micro-batch of 1024 completion(s) ×") && last.contains("available"),
        "{err}"
    );
    assert!(!trained.join("model.safetensors").exists());
}

#[test]
fn peak_and_bench_report_what_the_mfu_needs() {
    let peak = records(&["check", "peak", "--device", "cpu", "--n", "64"]);
    assert!(peak[0]["tflops"].as_f64().unwrap() > 0.0);
    let dir = model("check_bench", "300");
    let r = records(&[
        "bench",
        "--model",
        dir.to_str().unwrap(),
        "--new-tokens",
        "2",
        "--gen-batch",
        "1,3",
        "--train-batch",
        "2",
        "--train-len",
        "8",
        "--prompt-pairs",
        "2",
    ]);
    // The prompt pairs: half of each sequence prompt, both ways timed, their ratio.
    let pairs: Vec<&serde_json::Value> = r.iter().filter(|x| x["what"] == "train_prompt_pair").collect();
    assert_eq!(pairs.len(), 2);
    for x in &pairs {
        let (all, completion) = (x["all_positions_s"].as_f64().unwrap(), x["completion_positions_s"].as_f64().unwrap());
        assert!(all > 0.0 && completion > 0.0 && x["prompt"] == 4, "{x}");
        assert!((x["ratio"].as_f64().unwrap() - completion / all).abs() <= 1e-12, "{x}");
    }
    let r: Vec<serde_json::Value> = r.into_iter().filter(|x| x["what"] != "train_prompt_pair").collect();
    let batches: Vec<i64> =
        r.iter().filter(|x| x["what"] == "generate").map(|x| x["batch"].as_i64().unwrap()).collect();
    assert_eq!(batches, [1, 3]);
    // The bandwidth share: bytes a step reads (weights and cached keys and values) per second over
    // the copy bandwidth measured in the same run.
    let bw = r.iter().find(|x| x["what"] == "copy_bandwidth").unwrap()["bytes_per_s"].as_f64().unwrap();
    assert!(bw.is_finite() && bw > 0.0, "{bw}");
    for x in r.iter().filter(|x| x["what"] == "generate") {
        let steps_per_s = x["tokens_per_s"].as_f64().unwrap() / x["batch"].as_f64().unwrap();
        let want = x["bytes_per_step"].as_f64().unwrap() * steps_per_s / bw;
        assert!((x["bandwidth_share"].as_f64().unwrap() - want).abs() <= 1e-9 * want.max(1.0), "{x}");
        assert_eq!(x["cuda_graphs"], false, "no CUDA graphs on the CPU");
    }
    // 6N + 12·L·d·T with N = 300·32 (tied output layer) + 2 layers of attention and MLP.
    let (v, h, kv, i, l, t) = (300.0, 32.0, 16.0, 64.0, 2.0, 8.0);
    let n = v * h + l * (2.0 * h * h + 2.0 * h * kv + 3.0 * h * i + 2.0 * h) + h;
    let want = 6.0 * n + 12.0 * l * h * t;
    for x in r.iter().filter(|x| x["what"].as_str().unwrap().starts_with("train")) {
        assert_eq!(x["flops_per_token"].as_f64().unwrap(), want);
    }
    // The roofline: the peak of the model's dtype measured in the same run, and every throughput
    // line's achieved TFLOP/s as FLOPs a token × tokens/s, and its share of that peak.
    let peak = r.iter().find(|x| x["what"] == "peak").unwrap()["tflops"].as_f64().unwrap();
    for x in r.iter().filter(|x| x["what"] != "peak" && x["what"] != "copy_bandwidth") {
        let achieved = x["flops_per_token"].as_f64().unwrap() * x["tokens_per_s"].as_f64().unwrap() / 1e12;
        assert!((x["achieved_tflops"].as_f64().unwrap() - achieved).abs() <= 1e-12 * achieved.max(1.0), "{x}");
        assert!((x["share_of_peak"].as_f64().unwrap() - achieved / peak).abs() <= 1e-9, "{x}");
    }
}

/// `bench --profile`: one trace and one summary line per profiled batch size (eagerly only on the
/// CPU), the summary counting the libtorch operators of the generated tokens, no kernels and no
/// copies to the host.
#[test]
fn bench_profiles_generation_into_traces_and_summaries() {
    let dir = model("check_profile", "301");
    let traces = std::env::temp_dir().join(format!("llama_bench_profile_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&traces);
    let r = records(&[
        "bench",
        "--model",
        dir.to_str().unwrap(),
        "--new-tokens",
        "40",
        "--gen-batch",
        "1",
        "--train-batch",
        "1",
        "--train-len",
        "4",
        "--profile",
        traces.to_str().unwrap(),
        "--profile-batch",
        "1,2",
    ]);
    let profiles: Vec<&serde_json::Value> = r.iter().filter(|x| x["what"] == "profile").collect();
    let batches: Vec<i64> = profiles.iter().map(|x| x["batch"].as_i64().unwrap()).collect();
    assert_eq!(batches, [1, 2]);
    for x in profiles {
        assert_eq!(x["cuda_graphs"], false);
        assert!(traces.join(x["trace"].as_str().unwrap()).is_file(), "{x}");
        let s = &x["summary"];
        assert_eq!(s["steps"], 32, "{x}"); // up to 32 tokens
        assert_eq!((s["kernels_per_step"].as_f64(), s["device_to_host_per_step"].as_f64()), (Some(0.0), Some(0.0)));
        let ops: Vec<&str> = s["top_ops"].as_array().unwrap().iter().map(|o| o["name"].as_str().unwrap()).collect();
        assert!(!ops.is_empty() && ops.iter().all(|o| o.contains("::")), "{ops:?}");
        // The crate's own kernels are named in the trace beside libtorch's operators.
        let trace = std::fs::read_to_string(traces.join(x["trace"].as_str().unwrap())).unwrap();
        assert!(trace.contains("\"topr::next_tokens\"") && trace.contains("\"aten::embedding\""), "{x}");
        assert!(s["wall_us_per_step"].as_f64().unwrap() > 0.0, "{x}");
        assert!(x["unprofiled_wall_us_per_token"].as_f64().unwrap() > 0.0 && x["tokens"] == 32, "{x}");
    }
    std::fs::remove_dir_all(&traces).unwrap();
}

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    // `llama check losses | head -1`: the reader is gone before the first line is written. The
    // command must end as a Unix tool does (SIGPIPE), not panic in `println!`.
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_llama"))
        .args(["check", "losses", "--device", "cpu", "--batch", "64", "--len", "64", "--iters", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}
