//! `llama compare`: other objectives on the same data as one iteration of an `iterate` run.
//!
//! Iteration `i` of a run sampled one data set from μ (the initial model for `i = 1`, else
//! iteration `i − 1`'s model) and trained on it with the run's objective. `compare` trains a
//! fresh copy of the same μ on the *same data set* with each listed arm — the run's training
//! settings, only the objective and its baseline changed — evaluates each on the run's held-out
//! questions, and reports each arm paired question by question against μ and against the run's
//! own model. Same model, same data, same budget, same questions: the difference between two
//! arms is the objective's, and its standard error is the paired one (over questions), which is
//! smaller than either accuracy's.
//!
//! Everything lands in `RUN/compare-iter-I/` (one folder per arm, `compare.jsonl`,
//! `compare.md`); a killed comparison resumes (finished arms are reused, an interrupted one
//! resumes as `train` does). The run itself is only read.

use crate::checkpoint::Placement;
use crate::eval::QuestionResult;
use crate::identity::{ModelId, Numerics};
use crate::iterate::{self, Loop};
use crate::layout::LoopDir;
use crate::metrics::read_jsonl;
use crate::settings::{Baseline, Objective, TrainSettings};
use crate::stats::{self, mean_se};
use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// An objective and its baseline, trained on the iteration's data in place of the run's.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompareArm {
    /// Folder and table label (`sft`, `reinforce`, `topr-p0.2`, …).
    pub name: String,
    pub objective: Objective,
    pub baseline: Baseline,
}

/// What to compare.
#[derive(Debug, Clone)]
pub struct CompareSettings {
    /// The `iterate` work directory.
    pub run: PathBuf,
    /// The iteration whose data set the arms train on (≥ 1, finished).
    pub iteration: usize,
    pub arms: Vec<CompareArm>,
    pub at: Placement,
}

/// One line of `compare.jsonl`: an arm (or the run's own model, or μ) on the held-out questions.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompareRow {
    /// The arm's name; `run` for the run's own model at the iteration, `mu` for μ.
    pub arm: String,
    pub iteration: usize,
    pub questions: usize,
    /// Greedy pass@1 and its standard error over questions.
    pub accuracy: f64,
    pub accuracy_se: f64,
    pub invalid_rate: f64,
    /// Accuracy minus μ's, and the standard error of the paired difference over questions.
    pub gain: f64,
    pub gain_se: f64,
    /// Accuracy minus the run's own model's, paired over questions.
    pub vs_run: f64,
    pub vs_run_se: f64,
}

/// Trains and evaluates every arm (or reuses the finished ones), then writes `compare.jsonl`
/// and `compare.md` and prints the table.
pub fn run(s: &CompareSettings) -> Result<Vec<CompareRow>> {
    let rec = iterate::read_run(&s.run)?;
    let i = s.iteration;
    let work = LoopDir::new(&s.run);
    let it = work.iteration(i);
    if i == 0 || !it.trained() || !it.eval().exists() {
        bail!(
            "iteration {i} of {} is not finished (no {}): run `iterate` to it first",
            s.run.display(),
            it.eval().display()
        );
    }
    let (mu_dir, mu_eval) = if i == 1 {
        (rec.model.path.clone(), work.initial_eval())
    } else {
        let prev = work.iteration(i - 1);
        (prev.model(), prev.eval())
    };
    check_inputs(s, &rec, &mu_dir)?;
    let mut names: Vec<&str> = s.arms.iter().map(|a| a.name.as_str()).collect();
    names.sort();
    names.dedup();
    if names.len() != s.arms.len() || names.iter().any(|n| ["run", "mu"].contains(n)) {
        bail!(
            "arm names must be distinct and not `run` or `mu`: {:?}",
            s.arms.iter().map(|a| &a.name).collect::<Vec<_>>()
        );
    }
    let out = work.compare(i);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let _lock = crate::io::Lock::dir(&out)?;
    let lp = Loop::new(s.at, None, &rec.settings, &mu_dir)?;
    let data = it.data();
    let t0 = std::time::Instant::now();
    for (k, arm) in s.arms.iter().enumerate() {
        eprintln!("[compare {:.0} s] arm {} ({}/{})", t0.elapsed().as_secs_f64(), arm.name, k + 1, s.arms.len());
        let dir = out.join(&arm.name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let train = TrainSettings { objective: arm.objective, baseline: arm.baseline, ..rec.settings.train.clone() };
        lp.train_on(None, &mu_dir, &data, &train, &dir, &dir.join("model"))?;
        lp.evaluate_cached(&dir.join("model"), &dir.join("eval.json"))?;
    }
    let mu = questions(&mu_eval)?;
    let own = questions(&it.eval())?;
    let mut rows = vec![row("mu", i, &mu, &mu, &own)?, row("run", i, &own, &mu, &own)?];
    for arm in &s.arms {
        rows.push(row(&arm.name, i, &questions(&out.join(&arm.name).join("eval.json"))?, &mu, &own)?);
    }
    let mut jsonl = String::new();
    for r in &rows {
        jsonl.push_str(&serde_json::to_string(r)?);
        jsonl.push('\n');
    }
    crate::io::write_file(&out.join("compare.jsonl"), jsonl)?;
    let md = table(s, &rec.settings.train, &rec.numerics, &rows)?;
    crate::io::write_file(&out.join("compare.md"), &md)?;
    print!("{md}");
    Ok(rows)
}

/// Refuses a comparison whose arms would be made in other numerics than the run's model (the
/// table would mix precisions), or whose μ is no longer the run's initial model.
fn check_inputs(s: &CompareSettings, rec: &iterate::IterateRun, mu_dir: &Path) -> Result<()> {
    let numerics = Numerics::of(s.at);
    if numerics != rec.numerics {
        bail!(
            "--dtype, --device, --kernels: the run in {} was made in {}; its arms must be too (this comparison asks for {})",
            s.run.display(),
            rec.numerics.describe(),
            numerics.describe()
        );
    }
    if s.iteration == 1 && ModelId::of(mu_dir)? != rec.model {
        bail!("the run's initial model {} has changed since the run started: its μ is gone", mu_dir.display());
    }
    Ok(())
}

/// Whether each held-out question was answered correctly (greedy), in question order.
fn questions(eval_summary: &Path) -> Result<Vec<(String, bool, bool)>> {
    let file = crate::layout::questions_file(eval_summary);
    let rows: Vec<QuestionResult> = read_jsonl(&file)?;
    Ok(rows.into_iter().map(|q| (q.id, q.greedy_correct, q.greedy_invalid)).collect())
}

/// Mean and paired standard error of `a − b` over the same questions.
fn paired(a: &[(String, bool, bool)], b: &[(String, bool, bool)]) -> Result<(f64, f64)> {
    if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.0 != y.0) {
        bail!("two evaluations of the comparison are not on the same questions");
    }
    stats::paired(&correct(a), &correct(b))
}

/// 1 for each question answered correctly, else 0.
fn correct(q: &[(String, bool, bool)]) -> Vec<f64> {
    q.iter().map(|x| f64::from(u8::from(x.1))).collect()
}

fn row(
    arm: &str,
    iteration: usize,
    q: &[(String, bool, bool)],
    mu: &[(String, bool, bool)],
    own: &[(String, bool, bool)],
) -> Result<CompareRow> {
    let (accuracy, accuracy_se) = mean_se(&correct(q));
    let invalid_rate = q.iter().filter(|x| x.2).count() as f64 / q.len().max(1) as f64;
    let (gain, gain_se) = paired(q, mu)?;
    let (vs_run, vs_run_se) = paired(q, own)?;
    Ok(CompareRow {
        arm: arm.into(),
        iteration,
        questions: q.len(),
        accuracy,
        accuracy_se,
        invalid_rate,
        gain,
        gain_se,
        vs_run,
        vs_run_se,
    })
}

/// `compare.md`: one row per model, with the paired differences in standard errors.
fn table(s: &CompareSettings, train: &TrainSettings, numerics: &Numerics, rows: &[CompareRow]) -> Result<String> {
    let mut md = String::new();
    writeln!(
        md,
        "# Iteration {} of {}: objectives on the same data\n\nThe run's objective: {} ({}). \
         Every arm trained from the same μ on the same data set with the run's settings, in {}; \
         greedy pass@1 on the same {} held-out questions; ± one standard error over questions \
         (paired for the differences), `z` the difference in standard errors.\n",
        s.iteration,
        s.run.display(),
        train.objective.name(),
        train.baseline.describe(),
        numerics.describe(),
        rows.first().map_or(0, |r| r.questions)
    )?;
    writeln!(md, "| model | accuracy | invalid | gain over μ | z | − run's model | z |")?;
    writeln!(md, "|---|---:|---:|---:|---:|---:|---:|")?;
    let z = |m: f64, se: f64| if se > 0.0 { format!("{:+.1}", m / se) } else { "–".into() };
    for r in rows {
        let label = match r.arm.as_str() {
            "mu" => "μ (before the iteration)".to_string(),
            "run" => format!("the run's model ({})", train.objective.name()),
            a => a.to_string(),
        };
        writeln!(
            md,
            "| {label} | {:.3} ± {:.3} | {:.3} | {:+.3} ± {:.3} | {} | {:+.3} ± {:.3} | {} |",
            r.accuracy,
            r.accuracy_se,
            r.invalid_rate,
            r.gain,
            r.gain_se,
            z(r.gain, r.gain_se),
            r.vs_run,
            r.vs_run_se,
            z(r.vs_run, r.vs_run_se)
        )?;
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(flags: &[bool]) -> Vec<(String, bool, bool)> {
        flags.iter().enumerate().map(|(i, &c)| (format!("q{i}"), c, false)).collect()
    }

    /// The paired difference by its definition: the mean of per-question differences and their
    /// standard error; evaluations on other questions are refused.
    #[test]
    fn paired_difference_by_definition() {
        let a = q(&[true, true, false, true]);
        let b = q(&[false, true, false, false]);
        let (m, se) = paired(&a, &b).unwrap();
        // d = [1, 0, 0, 1]: mean 0.5, sample variance 1/3, SE sqrt(1/12).
        assert!((m - 0.5).abs() < 1e-12);
        assert!((se - (1.0f64 / 12.0).sqrt()).abs() < 1e-12);
        let mut c = q(&[true, true, false, true]);
        c[2].0 = "other".into();
        assert!(paired(&a, &c).is_err());
        let r = row("x", 1, &a, &b, &a).unwrap();
        assert!((r.accuracy - 0.75).abs() < 1e-12 && r.vs_run == 0.0 && r.vs_run_se == 0.0);
    }
}
