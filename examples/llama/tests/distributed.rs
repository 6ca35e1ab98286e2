//! Several processes on one host (loopback only), through the built `llama` binary as a
//! user launches it: sharded sampling and evaluation merge into exactly the files of one
//! process; data-parallel `train` (TOPR and PPO) and `iterate` on 2 ranks take the steps one
//! process takes; a killed rank is an error on the other, not a hang; a killed data-parallel
//! run resumes.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use tch::Tensor;

fn llama() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_llama"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

/// Runs `args` as one process, with one intra-op thread like each rank of [`spawn_group`]: the
/// files of a group and of one process are compared at the same thread count (libtorch's CPU
/// kernels may round differently with another).
fn run(args: &[&str]) -> String {
    let out = Command::new(llama()).args(args).env("OMP_NUM_THREADS", "1").output().unwrap();
    assert!(out.status.success(), "llama {args:?} failed:\n{}", text(&out));
    String::from_utf8(out.stdout).unwrap()
}

fn strs(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

fn run_v(a: &[String]) -> String {
    run(&strs(a))
}

fn run_group_v(a: &[String], world: usize) -> Vec<Output> {
    run_group(&strs(a), world)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The tests of this file run one at a time: each starts several processes, and two tests' ranks
/// on the same cores would oversubscribe them (libtorch's threads spin while they wait).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts `args` as the `world` ranks of a group, as torchrun would (one intra-op thread each:
/// the two ranks share the host's cores).
fn spawn_group(args: &[&str], world: usize, extra_env: &[(&str, &str)]) -> Vec<Child> {
    spawn_ranks(&vec![args.to_vec(); world], extra_env)
}

/// Starts the ranks of a group, rank `r` with `args[r]`.
fn spawn_ranks(args: &[Vec<&str>], extra_env: &[(&str, &str)]) -> Vec<Child> {
    let port = free_port().to_string();
    let world = args.len();
    (0..world)
        .map(|rank| {
            let mut c = Command::new(llama());
            c.args(&args[rank])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra_env {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect()
}

fn run_group(args: &[&str], world: usize) -> Vec<Output> {
    let outs: Vec<Output> = spawn_group(args, world, &[]).into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for (rank, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {rank} of llama {args:?} failed:\n{}", text(o));
    }
    outs
}

/// A directory with a tiny model `m0` and a graded data set of it, `data.jsonl`, whose rewards
/// alternate (a random model is never right: the rewards are set so that every objective has
/// positives and negatives to learn from).
fn setup(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let m0 = dir.join("m0");
    common::tiny_model(&m0, "2");
    let sampled = dir.join("sampled.jsonl");
    run(&[
        "sample",
        "--model",
        s(&m0),
        "--out",
        s(&sampled),
        "--task",
        "synthetic",
        "--synthetic-n",
        "8",
        "--difficulty",
        "1",
        "--samples-per-prompt",
        "4",
        "--max-new-tokens",
        "8",
    ]);
    let data = dir.join("data.jsonl");
    let mut out = String::new();
    for (k, line) in std::fs::read_to_string(&sampled).unwrap().lines().enumerate() {
        let mut v: Value = serde_json::from_str(line).unwrap();
        let good = k % 3 == 0;
        v["correct"] = Value::Bool(good);
        v["reward"] = Value::from(if good { 1.0 } else { -1.0 });
        out.push_str(&v.to_string());
        out.push('\n');
    }
    std::fs::write(&data, out).unwrap();
    (dir, m0, data)
}

fn weights(dir: &Path) -> Vec<(String, Tensor)> {
    let mut w = Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// The largest absolute difference between two models' weights.
fn max_diff(a: &Path, b: &Path) -> f64 {
    let (wa, wb) = (weights(a), weights(b));
    assert_eq!(wa.len(), wb.len());
    wa.iter()
        .zip(&wb)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

const TASK: [&str; 6] = ["--task", "synthetic", "--synthetic-n", "8", "--difficulty", "1"];

#[test]
fn sharded_sampling_and_evaluation_merge_into_the_file_of_one_process() {
    let _serial = serial();
    let (dir, m0, _) = setup("dist_shards");
    let sample = |out: &Path, extra: &[&str]| {
        let mut a = vec![
            "sample",
            "--model",
            s(&m0),
            "--out",
            s(out),
            "--samples-per-prompt",
            "3",
            "--max-new-tokens",
            "8",
            "--batch-prompts",
            "3",
            "--seed",
            "5",
        ];
        a.extend_from_slice(&TASK);
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let one = dir.join("one.jsonl");
    run_v(&sample(&one, &[]));
    // Two shards (8 prompts in batches of 3: 2 batches and 1), merged in either order.
    let parts = [dir.join("s0.jsonl"), dir.join("s1.jsonl")];
    for (k, p) in parts.iter().enumerate() {
        let shard = format!("{k}/2");
        run_v(&sample(p, &["--shard", &shard]));
    }
    let merged = dir.join("merged.jsonl");
    run(&["merge", "--out", s(&merged), s(&parts[1]), s(&parts[0])]);
    let bytes = |p: &Path| std::fs::read(p).unwrap();
    let run_file = |p: &Path| PathBuf::from(format!("{}.run.json", p.display()));
    assert!(!bytes(&one).is_empty());
    assert!(bytes(&one) == bytes(&merged), "the merged shards differ from one process's file");
    assert!(bytes(&run_file(&one)) == bytes(&run_file(&merged)));
    // A group of two ranks writes the same file, and leaves no shard files behind.
    let group = dir.join("group.jsonl");
    run_group_v(&sample(&group, &[]), 2);
    assert!(bytes(&one) == bytes(&group), "the group's file differs from one process's file");
    assert!(bytes(&run_file(&one)) == bytes(&run_file(&group)));
    assert!(!dir.join("group.jsonl.shard-0-of-2").exists() && !dir.join("group.jsonl.shard-1-of-2").exists());
    // Fewer batches than ranks (3 prompts, one batch): rank 1's shard is empty, and the group
    // still writes one process's file.
    let few = |out: &Path| -> Vec<String> {
        let a = [
            "sample",
            "--model",
            s(&m0),
            "--out",
            s(out),
            "--samples-per-prompt",
            "2",
            "--max-new-tokens",
            "4",
            "--batch-prompts",
            "4",
            "--task",
            "synthetic",
            "--synthetic-n",
            "3",
            "--difficulty",
            "1",
        ];
        a.into_iter().map(String::from).collect()
    };
    run_v(&few(&dir.join("few-one.jsonl")));
    run_group_v(&few(&dir.join("few-group.jsonl")), 2);
    assert!(bytes(&dir.join("few-one.jsonl")) == bytes(&dir.join("few-group.jsonl")));
    // Merge refuses: a missing shard, a shard twice, an existing output.
    let err = |args: &[&str]| {
        let o = Command::new(llama()).args(args).output().unwrap();
        assert!(!o.status.success());
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(e.trim().lines().count(), 1, "{e}");
        e
    };
    assert!(err(&["merge", "--out", s(&dir.join("m1.jsonl")), s(&parts[0])]).contains("shard 1/2 is missing"));
    assert!(err(&["merge", "--out", s(&dir.join("m2.jsonl")), s(&parts[0]), s(&parts[0])]).contains("both shard 0/2"));
    assert!(err(&["merge", "--out", s(&merged), s(&parts[0]), s(&parts[1])]).contains("exists"));
    assert!(!dir.join("m1.jsonl").exists() && !dir.join("m2.jsonl").exists());

    // Evaluation (with sampled completions): shards concatenate into one process's file; a group
    // writes it and prints one process's summary.
    let eval = |out: &Path, extra: &[&str]| {
        let mut a = vec!["eval", "--model", s(&m0), "--max-new-tokens", "8", "--samples", "2", "--batch-size", "3"];
        a.extend_from_slice(&TASK);
        a.extend_from_slice(&["--out", s(out)]);
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let q1 = dir.join("q1.jsonl");
    let summary = run_v(&eval(&q1, &[]));
    let mut cat = vec![];
    for k in 0..2 {
        let q = dir.join(format!("q-shard{k}.jsonl"));
        run_v(&eval(&q, &["--shard", &format!("{k}/2")]));
        cat.extend(bytes(&q));
    }
    assert!(bytes(&q1) == cat, "the evaluation's shards differ from one process's file");
    let qg = dir.join("qg.jsonl");
    let outs = run_group_v(&eval(&qg, &[]), 2);
    assert!(bytes(&q1) == bytes(&qg));
    assert_eq!(String::from_utf8_lossy(&outs[0].stdout), summary);
    assert!(outs[1].stdout.is_empty());
}

fn train_args<'a>(m0: &'a Path, data: &'a Path, out: &'a Path, objective: &'a str, epochs: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        s(m0),
        "--data",
        s(data),
        "--out",
        s(out),
        "--objective",
        objective,
        "--lr",
        "3e-3",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "3",
        "--epochs",
        epochs,
    ]
}

#[test]
fn two_ranks_train_as_one_process_does_for_topr_and_ppo() {
    let _serial = serial();
    let (dir, m0, data) = setup("dist_train");
    for objective in ["topr", "ppo"] {
        let one = dir.join(format!("{objective}-one"));
        let two = dir.join(format!("{objective}-two"));
        run(&train_args(&m0, &data, &one, objective, "3"));
        let outs = run_group(&train_args(&m0, &data, &two, objective, "3"), 2);
        let moved = max_diff(&m0, &one);
        let diff = max_diff(&one, &two);
        eprintln!("{objective}: weights moved by up to {moved:.2e}; 2 ranks vs 1 process differ by up to {diff:.2e}");
        assert!(moved > 1e-3, "{objective}: training did not move the weights ({moved})");
        assert!(diff < 1e-5, "{objective}: 2 ranks differ from 1 process by {diff}");
        // The per-step metrics are those of the whole batch (loss up to float order).
        let metrics = |d: &Path| -> Vec<Value> {
            std::fs::read_to_string(d.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let (a, b) = (metrics(&one), metrics(&two));
        assert_eq!(a.len(), 12);
        assert_eq!(a.len(), b.len());
        // Not compared: the TOPR diagnostics that are shares of a subset per micro-batch (of the
        // negatives, the positives, the tokens) averaged over micro-batches, which depend on how
        // the step is split even in one process.
        let fields = [
            "/grad_norm",
            "/stats/loss",
            "/stats/tokens",
            "/stats/sequences",
            "/stats/log_ratio_mean",
            "/stats/clip_fraction",
            "/stats/topr/negative_fraction",
            "/stats/topr/weight_max",
            "/stats/topr/weight_mean",
        ];
        for (x, y) in a.iter().zip(&b) {
            for f in fields {
                match (x.pointer(f).and_then(Value::as_f64), y.pointer(f).and_then(Value::as_f64)) {
                    (Some(u), Some(v)) => {
                        assert!(
                            (u - v).abs() <= 1e-4 * (1.0 + u.abs()),
                            "{objective} step {}: {f} {u} vs {v}",
                            x["step"]
                        )
                    }
                    (None, None) => {}
                    other => panic!("{objective}: {f}: {other:?}"),
                }
            }
        }
        assert!(
            a[0].pointer(if objective == "ppo" { "/stats/clip_fraction" } else { "/stats/topr/weight_max" }).is_some()
        );
        // Rank 0 prints the summary; the other rank prints nothing.
        assert!(String::from_utf8_lossy(&outs[0].stdout).contains("\"steps\":12"));
        assert!(outs[1].stdout.is_empty());
    }
}

/// Ranks started with another learning rate, objective, data file, model of the same shape with
/// other weights, or model of another shape: every rank refuses before a step, naming the field
/// and the rank, with a one-line error (no abort), and leaves no lock behind; the same model and
/// data at other paths are accepted.
#[test]
fn ranks_started_differently_are_refused_before_a_step() {
    let _serial = serial();
    let (dir, m0, data) = setup("dist_disagree");
    let other_weights = dir.join("m0-seed1");
    let out = Command::new(llama())
        .args(["init", "--out", s(&other_weights), "--layers", "2", "--hidden", "32", "--heads", "2"])
        .args(["--kv-heads", "1", "--intermediate", "64", "--seed", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let other_shape = dir.join("m0-wide");
    common::tiny_model(&other_shape, "3");
    let other_data = dir.join("other.jsonl");
    let all = std::fs::read_to_string(&data).unwrap();
    let lines: Vec<&str> = all.lines().collect();
    std::fs::write(&other_data, lines[..lines.len() - 1].join("\n") + "\n").unwrap();
    let copy_data = dir.join("copy.jsonl");
    std::fs::copy(&data, &copy_data).unwrap();
    let base = |out: &Path| train_args(&m0, &data, out, "topr", "1").into_iter().map(String::from).collect::<Vec<_>>();
    let with = |out: &Path, flag: &str, value: &str| {
        let mut a = base(out);
        let at = a.iter().position(|x| x == flag).unwrap();
        a[at + 1] = value.into();
        a
    };
    let cases = [
        ("lr", "--lr", "1e-3", "lr 3e-3 → 1e-3"),
        ("objective", "--objective", "ppo", "objective topr → ppo"),
        ("data", "--data", s(&other_data), "data.bytes"),
        ("weights", "--model", s(&other_weights), "model.content"),
        ("shape", "--model", s(&other_shape), "model.config"),
    ];
    for (name, flag, value, wanted) in cases {
        let out = dir.join(format!("out-{name}"));
        let args = [base(&out), with(&out, flag, value)];
        let outs: Vec<Output> = spawn_ranks(&[strs(&args[0]), strs(&args[1])], &[])
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        for (rank, o) in outs.iter().enumerate() {
            let err = String::from_utf8_lossy(&o.stderr);
            let last = err.lines().last().unwrap_or_default();
            assert_eq!(o.status.code(), Some(1), "{name}, rank {rank}: {}", text(o));
            assert!(
                last.starts_with("error: ") && last.contains("rank 1: ") && last.contains(wanted),
                "{name}, rank {rank}: {err}"
            );
        }
        assert!(!out.join("LOCK").exists(), "{name}: the lock is left behind");
        assert!(!out.join("model.safetensors").exists(), "{name}: a model was saved");
    }
    // The same model and data at other paths: one group, trained as usual.
    let copy_model = dir.join("m0-copy");
    std::fs::create_dir_all(&copy_model).unwrap();
    for f in std::fs::read_dir(&m0).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy_model.join(f.file_name().unwrap())).unwrap();
    }
    let out = dir.join("out-copies");
    let mut second = with(&out, "--data", s(&copy_data));
    let at = second.iter().position(|x| x == "--model").unwrap();
    second[at + 1] = s(&copy_model).into();
    let outs: Vec<Output> = spawn_ranks(&[strs(&base(&out)), strs(&second)], &[])
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (rank, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "copies, rank {rank}: {}", text(o));
    }
    assert!(out.join("model.safetensors").exists());
}

#[test]
fn a_killed_rank_is_an_error_on_the_other_and_the_run_resumes() {
    let _serial = serial();
    let (dir, m0, data) = setup("dist_kill");
    let one = dir.join("one");
    let two = dir.join("two");
    let mut args = train_args(&m0, &data, &one, "topr", "8");
    args.extend_from_slice(&["--save-every", "2"]);
    run(&args);
    let mut args = train_args(&m0, &data, &two, "topr", "8");
    args.extend_from_slice(&["--save-every", "2"]);
    // Rank 1 is killed once rank 0 has written a few steps.
    let mut children = spawn_group(&args, 2, &[]);
    let t0 = Instant::now();
    let metrics = two.join("metrics.jsonl");
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 5 {
        assert!(t0.elapsed() < Duration::from_secs(300), "rank 0 wrote no metrics");
        std::thread::sleep(Duration::from_millis(20));
    }
    children[1].kill().unwrap();
    let killed_at = Instant::now();
    let rank1 = children.pop().unwrap().wait_with_output().unwrap();
    assert!(!rank1.status.success());
    let rank0 = children.pop().unwrap().wait_with_output().unwrap();
    let waited = killed_at.elapsed();
    assert!(!rank0.status.success(), "rank 0 went on without rank 1:\n{}", text(&rank0));
    let err = String::from_utf8_lossy(&rank0.stderr);
    let last = err.trim().lines().last().unwrap_or_default();
    assert!(last.starts_with("error: ") && last.contains("rank 0"), "rank 0's error: {err}");
    assert!(waited < Duration::from_secs(60), "rank 0 took {waited:?} to notice");
    eprintln!("rank 0 after the kill ({:.1} s): {last}", waited.as_secs_f64());
    // A rerun without --resume is refused; with it, the two ranks finish the run and end where
    // one uninterrupted process ends.
    let out = Command::new(llama()).args(&args).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--resume"));
    args.push("--resume");
    let outs = run_group(&args, 2);
    assert!(text(&outs[0]).contains("resuming after step"), "{}", text(&outs[0]));
    let diff = max_diff(&one, &two);
    assert!(diff < 1e-5, "the resumed 2-rank run differs from 1 process by {diff}");
    assert_eq!(std::fs::read_to_string(&metrics).unwrap().lines().count(), 32);
}

#[test]
fn two_ranks_iterate_as_one_process_does() {
    let _serial = serial();
    let (dir, m0, _) = setup("dist_iterate");
    let args = |work: &Path| -> Vec<String> {
        let mut a = vec![
            "iterate",
            "--model",
            s(&m0),
            "--work",
            s(work),
            "--iterations",
            "1",
            "--samples-per-prompt",
            "3",
            "--max-new-tokens",
            "8",
            "--batch-prompts",
            "3",
            "--eval-n",
            "6",
            "--lr",
            "3e-3",
            "--batch-size",
            "6",
            "--micro-batch-size",
            "3",
            "--eval-batch-size",
            "2",
        ];
        a.extend_from_slice(&TASK);
        a.into_iter().map(String::from).collect()
    };
    let (one, two) = (dir.join("one"), dir.join("two"));
    run_v(&args(&one));
    run_group_v(&args(&two), 2);
    let bytes = |p: PathBuf| std::fs::read(p).unwrap();
    for f in ["iter-1/data.jsonl", "eval-initial.questions.jsonl"] {
        assert!(bytes(one.join(f)) == bytes(two.join(f)), "{f} differs");
    }
    let diff = max_diff(&one.join("iter-1/model"), &two.join("iter-1/model"));
    assert!(diff < 1e-5, "the 2-rank iteration's model differs by {diff}");
    assert!(max_diff(&m0, &one.join("iter-1/model")) > 1e-3);
    let rows = |w: &Path| std::fs::read_to_string(w.join("iterations.jsonl")).unwrap().lines().count();
    assert_eq!((rows(&one), rows(&two)), (2, 2));
}

#[test]
fn commands_that_do_not_run_as_a_group_are_refused_under_one() {
    let _serial = serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dist_refused");
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(llama())
        .args(["init", "--out", s(&dir.join("m"))])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("WORLD_SIZE=2") && e.trim().lines().count() == 1, "{e}");
    assert!(!dir.join("m").exists());
    let out = Command::new(llama()).args(["eval", "--model", "x"]).env("WORLD_SIZE", "2").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("RANK"), "{}", String::from_utf8_lossy(&out.stderr));
}
