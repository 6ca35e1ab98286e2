//! `llama study` at CI size: the harness runs every arm of its claims for every seed, writes its
//! tables and plots, resumes without redoing finished work, and refuses bad options.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn llama() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_llama"))
}

fn study(work: &std::path::Path, extra: &[&str]) -> std::process::Output {
    Command::new(llama())
        .args(["study", "--work", work.to_str().unwrap(), "--scale", "quick", "--seeds", "2"])
        .args(extra)
        .output()
        .unwrap()
}

fn jsonl(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn a_ci_sized_study_runs_resumes_and_reports() {
    let work = std::env::temp_dir().join(format!("llama_study_ci_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let out = study(&work, &["--claims", "negatives,degeneration"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 2 seeds × 4 (claim, arm) pairs × 2 rows (iteration 0 and 1).
    let rows = jsonl(&work.join("study.jsonl"));
    assert_eq!(rows.len(), 16);
    for arm in ["topr-p0.5", "sft", "reinforce"] {
        for seed in [0, 1] {
            assert!(rows.iter().any(|r| r["arm"] == arm && r["seed"] == seed && r["iteration"] == 1), "{arm} {seed}");
        }
    }
    let md = std::fs::read_to_string(work.join("study.md")).unwrap();
    assert!(md.contains("## negatives") && md.contains("## degeneration"), "{md}");
    assert!(md.contains("| topr-p0.5 | 2 |") && md.contains("| sft | 2 |") && md.contains("| reinforce | 2 |"), "{md}");
    assert!(work.join("claim-negatives.png").exists() && work.join("claim-degeneration.png").exists());
    // The negatives claim's sampled evaluation: the initial model and each arm's last iteration,
    // per seed (2 seeds × 2 arms × iterations 0 and 1), and its table.
    let sampled = jsonl(&work.join("study-sampled.jsonl"));
    assert_eq!(sampled.len(), 8);
    assert!(sampled.iter().all(|r| r["claim"] == "negatives" && r["k"] == 8 && r["questions"] == 6));
    assert!(work.join("seed-1/sft/iter-1/eval-k8.questions.jsonl").exists());
    assert!(md.contains("Sampled evaluation") && md.contains("| sft − topr-p0.5, paired by seed | 2 |"), "{md}");
    assert!(md.contains("| sft − topr-p0.5, paired by question | 2 |"), "{md}");
    // Each seed has its own model: the initial weights differ.
    let w0 = std::fs::read(work.join("seed-0/init/model.safetensors")).unwrap();
    let w1 = std::fs::read(work.join("seed-1/init/model.safetensors")).unwrap();
    assert_ne!(w0, w1);
    // The topr arm is shared by both claims and ran once per seed.
    assert!(work.join("seed-0/topr-p0.5/iterations.jsonl").exists());
    // A seed's arms share their initial evaluation and first data set, made once in shared/.
    let shared: Vec<_> = std::fs::read_dir(work.join("seed-0/shared")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(shared.len(), 1, "one set of sampling and evaluation settings: {shared:?}");
    assert!(shared[0].join("iter-1-data.jsonl").exists() && shared[0].join("eval-initial.json").exists());
    for f in ["iter-1/data.jsonl", "eval-initial.json", "eval-initial.questions.jsonl"] {
        let topr = std::fs::read(work.join("seed-0/topr-p0.5").join(f)).unwrap();
        assert_eq!(topr, std::fs::read(work.join("seed-0/sft").join(f)).unwrap(), "{f}");
    }
    // Rerun: everything is finished, nothing changes.
    let before = std::fs::read(work.join("study.jsonl")).unwrap();
    let warm = std::fs::metadata(work.join("seed-1/warm-up/model.safetensors")).unwrap().modified().unwrap();
    let out = study(&work, &["--claims", "negatives,degeneration"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(work.join("study.jsonl")).unwrap(), before);
    // A rerun with other sizes is refused, naming them.
    let out = study(&work, &["--claims", "negatives,degeneration", "--eval-n", "99"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("scale.eval_n 6 → 99") && err.contains("--work"), "{err}");
    // --report-only redraws the same tables, with the sizes the study recorded; flags that
    // would describe other runs are refused.
    std::fs::remove_file(work.join("study.md")).unwrap();
    let report = |extra: &[&str]| {
        Command::new(llama())
            .args(["study", "--work", work.to_str().unwrap(), "--seeds", "2", "--claims", "negatives,degeneration"])
            .args(["--report-only"])
            .args(extra)
            .output()
            .unwrap()
    };
    for flag in [&["--eval-n", "99"][..], &["--iterations", "7"], &["--scale", "quick"], &["--device", "cpu"]] {
        let out = report(flag);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(flag[0]) && err.contains("study.json"), "{flag:?}: {err}");
    }
    // A model given to a study of the demo model's claims is refused, reporting or not.
    let out = report(&["--model", "/no/such/model"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--model") && err.contains("no real-model claim"), "{err}");
    assert!(!work.join("study.md").exists(), "a refused report wrote study.md");
    let out = report(&[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let md = std::fs::read_to_string(work.join("study.md")).unwrap();
    assert!(md.contains("6 held-out problems a seed") && md.contains("f32 on cpu (onednn kernels)"), "{md}");
    assert_eq!(std::fs::read(work.join("study.jsonl")).unwrap(), before);
    assert!(std::fs::read_to_string(work.join("study.md")).unwrap().contains("| topr-p0.5 | 2 |"));
    assert_eq!(std::fs::metadata(work.join("seed-1/warm-up/model.safetensors")).unwrap().modified().unwrap(), warm);
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn the_verifier_claim_runs_its_pipeline_per_seed_and_reports() {
    let work = std::env::temp_dir().join(format!("llama_study_verifier_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let out = study(&work, &["--claims", "verifier"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(work.join("verifier.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for (seed, r) in rows.iter().enumerate() {
        assert_eq!(r["seed"], seed);
        let v = r["summary"]["verifier_at_k"]["mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&v));
        assert!(work.join(format!("seed-{seed}/verifier/verifier/round-2/model/model.safetensors")).exists());
    }
    let md = std::fs::read_to_string(work.join("study.md")).unwrap();
    assert!(md.contains("## verifier") && md.contains("| verifier@k (its pick) | 2 |"), "{md}");
    assert!(work.join("claim-verifier.png").exists());
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn bad_study_options_are_refused_in_one_line() {
    let work = std::env::temp_dir().join(format!("llama_study_bad_{}", std::process::id()));
    for (args, needle) in [
        (vec!["--claims", "stability"], "--claims"),
        (vec!["--claims", ""], "--claims"),
        (vec!["--seeds", "0"], "--seeds"),
        (vec!["--iterations", "0"], "--iterations"),
        (vec!["--report-only"], "--report-only"),
    ] {
        let out = study(&work, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
    assert!(!work.exists(), "a refused study wrote {}", work.display());
}

/// `scripts/smollm2_study.sh`'s records: each sampled data set is copied once (a seed's shared
/// first one and the iterated arm's later ones, not the arms' copies of the shared one), never the
/// weights or training states; put back into a new work directory, a data set comes back only when
/// its record names this clone's model (else its sampler would refuse it as sampled otherwise).
#[test]
fn the_grid_scripts_records_hold_each_data_set_once_and_come_back_only_to_the_same_clone() {
    let repo = std::fs::canonicalize(common::repo()).unwrap();
    let tmp = std::env::temp_dir().join(format!("llama_study_records_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let (work, records, back) = (tmp.join("work"), tmp.join("records"), tmp.join("back"));
    let here = format!("{{\"model\": {{\"path\": \"{}/models/smollm2-135m-instruct\"}}}}", repo.display());
    let elsewhere = "{\"model\": {\"path\": \"/elsewhere/models/smollm2-135m-instruct\"}}";
    // The iterated arm's second data set was sampled from its first model, in the work directory.
    let first_model = format!("{{\"model\": {{\"path\": \"{}/seed-0/arm/iter-1/model\"}}}}", work.display());
    let files: &[(&str, &str)] = &[
        ("study.json", "{}"),
        // The grid's logs of wall time, which a restore puts back so that they go on.
        ("times.txt", "study: 1 s\n"),
        ("progress.txt", "2026-12-05T18:00:00Z [study 0 s] seed 0, arm arm (1/1)\n"),
        // The tables and plots, drawn from the records where they are copied, not copied.
        ("study.md", "# drawn by the grid's binary"),
        ("study.jsonl", "{}\n"),
        ("study-sampled.jsonl", "{}\n"),
        ("claim-real-negatives.png", "png"),
        ("seed-0/shared/h0/iter-1-data.jsonl", "{}\n"),
        ("seed-0/shared/h0/iter-1-data.jsonl.run.json", &here),
        ("seed-0/shared/h0/eval-initial.json", "{}"),
        ("seed-0/arm/iter-1/data.jsonl", "{}\n"),
        ("seed-0/arm/iter-1/data.jsonl.run.json", &here),
        ("seed-0/arm/iter-1/train.done.json", "{}"),
        ("seed-0/arm/iter-1/model/config.json", "{}"),
        ("seed-0/arm/iter-2/data.jsonl", "{}\n"),
        ("seed-0/arm/iter-2/data.jsonl.run.json", &first_model),
        ("seed-0/arm/iter-2/train.done.json", "{}"),
        ("seed-0/arm/iter-2/model/config.json", "{}"),
        ("seed-0/arm/iter-3/state/progress.json", "{}"),
        ("seed-1/shared/h1/iter-1-data.jsonl", "{}\n"),
        ("seed-1/shared/h1/iter-1-data.jsonl.run.json", elsewhere),
    ];
    for (f, text) in files {
        let p = work.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let script = |option: &str, dir: &std::path::Path| {
        let out = Command::new("bash")
            .arg(repo.join("scripts/smollm2_study.sh"))
            .args([option, dir.to_str().unwrap()])
            .env("TOPR_STUDY_RECORDS", &records)
            .env("TOPR_STUDY_REPORT", "0")
            .output()
            .unwrap();
        assert!(out.status.success(), "{option}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let listed = |dir: &std::path::Path| -> Vec<String> {
        common::files_under(dir).iter().map(|p| p.to_str().unwrap().to_string()).collect()
    };
    script("--copy-records", &work);
    let copied = [
        "progress.txt",
        "seed-0/arm/iter-1/data.jsonl.run.json",
        "seed-0/arm/iter-1/train.done.json",
        "seed-0/arm/iter-2/data.jsonl",
        "seed-0/arm/iter-2/data.jsonl.run.json",
        "seed-0/arm/iter-2/train.done.json",
        "seed-0/shared/h0/iter-1-data.jsonl",
        "seed-0/shared/h0/iter-1-data.jsonl.run.json",
        "seed-1/shared/h1/iter-1-data.jsonl",
        "seed-1/shared/h1/iter-1-data.jsonl.run.json",
        "study.json",
        "times.txt",
    ];
    assert_eq!(listed(&records), copied);
    script("--restore-records", &back);
    // Not another clone's data set, nor one sampled from a model that the records do not keep.
    let restored: Vec<&str> = copied
        .iter()
        .copied()
        .filter(|f| !f.starts_with("seed-1") && !f.starts_with("seed-0/arm/iter-2/data"))
        .collect();
    assert_eq!(listed(&back), restored);
    // The machine is lost: the restored work directory takes the old one's place. Its records are
    // copied unchanged, the second data set included, whose training record is still there.
    std::fs::remove_dir_all(&work).unwrap();
    std::fs::rename(&back, &work).unwrap();
    script("--copy-records", &work);
    assert_eq!(listed(&records), copied);
    // A stage made again (a rebuilt iteration 1 that differed from its record): the study removed
    // its later iteration from the work directory, and the records drop it too, so that a restore
    // never brings it back; another clone's data set, which is never restored here, stays.
    std::fs::remove_dir_all(work.join("seed-0/arm/iter-2")).unwrap();
    std::fs::write(work.join("seed-0/arm/iter-1/train.done.json"), "{\"again\": true}").unwrap();
    // A plot, which a restore does not bring back, stays whether the work directory has it or not.
    std::fs::write(records.join("seed-0/arm/iterations.png"), "png").unwrap();
    script("--copy-records", &work);
    std::fs::remove_file(records.join("seed-0/arm/iterations.png")).unwrap();
    let kept: Vec<&str> = copied.iter().copied().filter(|f| !f.starts_with("seed-0/arm/iter-2")).collect();
    assert_eq!(listed(&records), kept);
    let done = std::fs::read_to_string(records.join("seed-0/arm/iter-1/train.done.json")).unwrap();
    assert_eq!(done, "{\"again\": true}");
    assert!(!records.join("seed-0/arm/iter-2").exists());
    // Two machines took turns: each log has lines the other lacks. Both directions merge them,
    // progress.txt in order of its dates, and merging again adds nothing.
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).unwrap();
    let (first, other, mine) = (
        "2026-12-05T18:00:00Z [study 0 s] seed 0, arm arm (1/1)\n",
        "2026-12-05T19:00:00Z [study 5 s] seed 1, arm arm (1/1)\n",
        "2026-12-05T18:30:00Z [study 9 s] seed 0, arm arm (1/1)\n",
    );
    std::fs::write(records.join("progress.txt"), format!("{first}{other}")).unwrap();
    std::fs::write(work.join("progress.txt"), format!("{first}{mine}")).unwrap();
    std::fs::write(records.join("times.txt"), "study: 1 s\nstudy: 3 s\n").unwrap();
    std::fs::write(work.join("times.txt"), "study: 1 s\nstudy: 2 s\n").unwrap();
    for _ in 0..2 {
        script("--copy-records", &work);
        assert_eq!(read(records.join("progress.txt")), format!("{first}{mine}{other}"));
        assert_eq!(read(records.join("times.txt")), "study: 1 s\nstudy: 3 s\nstudy: 2 s\n");
    }
    std::fs::write(records.join("times.txt"), "study: 1 s\nstudy: 3 s\nstudy: 3 s\n").unwrap();
    script("--restore-records", &work);
    assert_eq!(read(work.join("progress.txt")), format!("{first}{mine}{other}"));
    assert_eq!(read(work.join("times.txt")), "study: 1 s\nstudy: 2 s\nstudy: 3 s\nstudy: 3 s\n");
    // A relative WORK and records folder are taken from the caller's folder, and give the same
    // records as absolute ones (the clean-up once looked for the work directory's files from
    // inside the records folder, found none, and removed every record).
    let copy = |work_arg: &str, records_arg: &str| {
        let out = Command::new("bash")
            .arg(repo.join("scripts/smollm2_study.sh"))
            .args(["--copy-records", work_arg])
            .current_dir(&tmp)
            .env("TOPR_STUDY_RECORDS", records_arg)
            .env("TOPR_STUDY_REPORT", "0")
            .output()
            .unwrap();
        assert!(out.status.success(), "{work_arg}: {}", String::from_utf8_lossy(&out.stderr));
    };
    copy(work.to_str().unwrap(), tmp.join("absolute").to_str().unwrap());
    copy("work", "relative");
    copy("work", "relative");
    assert!(!listed(&tmp.join("absolute")).is_empty());
    assert_eq!(listed(&tmp.join("relative")), listed(&tmp.join("absolute")));
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// The committed real-model tables (`docs/study/real/study.md`) hold what their committed records
/// say: every cell recomputed from the per-question files by an independent script
/// (`scripts/check_real_study.py`, plain Python), so that a table drawn by an older version, or
/// records committed without their tables drawn again, fail here.
#[test]
fn the_committed_real_model_tables_are_recomputed_from_their_records() {
    let repo = common::repo();
    let out = Command::new("python3")
        .arg(repo.join("scripts/check_real_study.py"))
        .arg(repo.join("docs/study/real"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    // Three claims' tables, each arm's every column: far more than a hundred cells.
    let checked: usize = text.split(" cells checked, 0 differ").next().and_then(|n| n.trim().parse().ok()).unwrap_or(0);
    assert!(checked >= 150, "{text}");
}

/// The committed summary of the arms trained beside the grid (`docs/study/real-compare/summary.md`,
/// by `scripts/smollm2_compare.sh`) is what its records give: redrawn by
/// `scripts/compare_over_seeds.py` in a copy, from the per-question files (each accuracy checked
/// against `compare.jsonl`), it comes out byte for byte.
#[test]
fn the_committed_compare_summary_is_redrawn_from_its_records() {
    let repo = common::repo();
    let records = repo.join("docs/study/real-compare");
    let tmp = std::env::temp_dir().join(format!("llama_compare_summary_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(Command::new("cp").arg("-r").arg(&records).arg(&tmp).status().unwrap().success());
    std::fs::remove_file(tmp.join("summary.md")).unwrap();
    let out = Command::new("python3")
        .arg(repo.join("scripts/compare_over_seeds.py"))
        .arg(&tmp)
        .arg(repo.join("docs/study/real"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = std::fs::read_to_string(records.join("summary.md")).unwrap();
    assert_eq!(std::fs::read_to_string(tmp.join("summary.md")).unwrap(), want);
    assert!(want.contains("| topr-p0.9 | 5 |"), "{want}");
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// The committed real-model tables are what this version draws from the committed records, and
/// drawing them needs only the records: `--report-only` without `--model` (a clone of the records
/// has no SmolLM2 weights), in a copy of the records folder.
#[test]
fn the_committed_real_model_tables_are_redrawn_from_the_records_alone() {
    let repo = common::repo();
    let records = repo.join("docs/study/real");
    let tmp = std::env::temp_dir().join(format!("llama_study_redraw_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let status = Command::new("cp").arg("-r").arg(&records).arg(&tmp).status().unwrap();
    assert!(status.success());
    for table in ["study.md", "study.jsonl", "study-sampled.jsonl"] {
        std::fs::remove_file(tmp.join(table)).unwrap();
    }
    let seeds = std::fs::read_to_string(records.join("study.md")).unwrap();
    let seeds = seeds.split(" seed(s) planned").next().and_then(|h| h.rsplit(' ').next()).unwrap().to_string();
    let out = Command::new(llama())
        .args(["study", "--work", tmp.to_str().unwrap(), "--report-only", "--seeds", &seeds])
        .args(["--claims", "real-negatives,real-composition,real-iterated"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for table in ["study.md", "study.jsonl", "study-sampled.jsonl"] {
        let (drawn, committed) = (std::fs::read(tmp.join(table)).unwrap(), std::fs::read(records.join(table)).unwrap());
        assert!(
            drawn == committed,
            "{table}: the committed table is not what the records give (scripts/smollm2_study.sh --copy-records)"
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// `scripts/compare_studies.py` (plain Python) gives each arm's mean ± SE over seeds as the
/// study's own report does (the committed iterated study's tables, drawn by the Rust code), and
/// the difference of two runs ± its SE: zero against itself, and by hand on two small runs.
#[test]
fn the_study_comparison_script_agrees_with_the_report() {
    let repo = common::repo();
    let compare = |before: &str, after: &str| {
        let out = Command::new("python3")
            .arg(repo.join("scripts/compare_studies.py"))
            .args([repo.join(before), repo.join(after)])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let itself = compare("docs/study/iterated", "docs/study/iterated");
    // Every cell of the report's accuracy columns (docs/study/iterated/tables.md: per claim, the
    // rows `| arm | seeds | iteration 0 | … |`) is the script's mean ± SE of the same arm and
    // iteration, in the same claim's section, and its difference to itself is zero.
    let tables = std::fs::read_to_string(repo.join("docs/study/iterated/tables.md")).unwrap();
    let mut checked = 0;
    for (claim, iterations) in [("negatives", 3), ("iterated", 6)] {
        let section = |text: &str| -> String {
            let start = text.find(&format!("## {claim}\n")).unwrap_or_else(|| panic!("no {claim} in\n{text}"));
            let rest = &text[start + 4..];
            rest[..rest.find("\n## ").unwrap_or(rest.len())].to_string()
        };
        let (report, script) = (section(&tables), section(&itself));
        for arm in report.lines().filter(|l| l.starts_with("| topr-p0.5 | 5 |") || l.starts_with("| sft | 5 |")) {
            let cells: Vec<&str> = arm.split('|').map(str::trim).collect();
            for i in 0..iterations {
                let row = format!("| {} | {i} | {} (5) | {} (5) |", cells[1], cells[3 + i], cells[3 + i]);
                assert!(script.contains(&row), "{row} not in\n{script}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 3 + 3 + 6, "{tables}");
    let rows: Vec<&str> = itself.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| arm")).collect();
    assert!(rows.len() == 12 && rows.iter().all(|l| l.contains("| +0.000 ± ") && l.ends_with("| +0.0 |")), "{itself}");
    // Two runs that differ, written here: means 0.2 and 0.3 over 3 seeds, each SE
    // sqrt(0.01 / 3) = 0.0577, the difference's SE 0.0816 (+1.2 of it).
    let tmp = std::env::temp_dir().join(format!("llama_compare_{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for (name, values) in [("before.jsonl", [0.1, 0.2, 0.3]), ("after.jsonl", [0.2, 0.3, 0.4])] {
        let lines: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(seed, a)| format!(r#"{{"claim":"c","arm":"a","seed":{seed},"iteration":1,"accuracy":{a}}}"#))
            .collect();
        std::fs::write(tmp.join(name), lines.join("\n")).unwrap();
    }
    let differ = compare(tmp.join("before.jsonl").to_str().unwrap(), tmp.join("after.jsonl").to_str().unwrap());
    let row = "| a | 1 | 0.200 ± 0.058 (3) | 0.300 ± 0.058 (3) | +0.100 ± 0.082 | +1.2 |";
    assert!(differ.contains(row), "{row} not in\n{differ}");
    std::fs::remove_dir_all(&tmp).unwrap();
}
