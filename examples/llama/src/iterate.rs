//! The self-taught loop: for each iteration, sample a data set with the current model as μ,
//! optionally curate it, train a copy off-policy, evaluate it on held-out problems. Each stage
//! leaves its output in `work/iter-N/`; rerunning the command skips finished stages, and an
//! interrupted sampling stage resumes where it stopped.

use crate::Refusal;
use crate::checkpoint::{self, Placement};
use crate::eval::{self, EvalSettings, PromptStyle};
use crate::generate::{Decoding, Sampling};
use crate::metrics::IterationRecord;
use crate::sample::{self, Sample};
use crate::task::{self, Source, TaskSpec};
use crate::train::{self, TrainSettings};
use anyhow::{Context, Result, bail};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Which samples of a data set are trained on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Curation {
    All,
    /// Every negative, and one positive per question (as in the paper's curated runs).
    OnePositive,
}

impl Curation {
    pub fn apply(self, data: Vec<Sample>) -> Vec<Sample> {
        match self {
            Self::All => data,
            Self::OnePositive => {
                let mut seen = HashSet::new();
                data.into_iter().filter(|s| !s.correct || seen.insert(s.id.clone())).collect()
            }
        }
    }
}

/// The settings of the loop.
#[derive(Debug, Clone)]
pub struct IterateSettings {
    /// The training problems (sampled each iteration) and their prompts.
    pub task: TaskSpec,
    /// The training of each iteration; its `resume` also continues the loop in `work`, and its
    /// `skip_bad_records` also applies to the held-out file.
    pub train: TrainSettings,
    /// How μ samples (and the token budget of the greedy evaluation).
    pub sampling: Sampling,
    /// One folder per iteration, and `iterations.jsonl`.
    pub work: PathBuf,
    pub iterations: usize,
    pub samples_per_prompt: usize,
    /// Prompts per generation batch (each with all its samples).
    pub batch_prompts: usize,
    pub curate: Curation,
    /// Held-out problems: a GSM8K file, or else (synthetic task only) `eval_n` synthetic problems
    /// from another seed.
    pub eval_data: Option<PathBuf>,
    pub eval_n: usize,
    pub eval_batch_size: usize,
}

/// The held-out problems: the held-out file, else synthetic problems from another seed.
fn eval_problems(s: &IterateSettings) -> Result<Vec<task::Problem>> {
    match (&s.eval_data, &s.task.source) {
        (Some(p), _) => Ok(task::load_gsm8k(p, s.train.skip_bad_records)?.0.into_iter().take(s.eval_n).collect()),
        (None, Source::Synthetic { difficulty, .. }) => {
            Ok(task::synthetic_problems(s.task.seed.wrapping_add(999_983), s.eval_n, *difficulty))
        }
        (None, Source::Gsm8k(_)) => bail!("GSM8K evaluation needs a held-out data file (e.g. the test file)"),
    }
}

/// The loop's fixed inputs: where models are loaded, the problems and the held-out evaluation.
struct Loop<'a> {
    at: Placement,
    s: &'a IterateSettings,
    problems: Vec<task::Problem>,
    style: PromptStyle,
    held_out: Vec<task::Problem>,
}

impl Loop<'_> {
    /// Evaluates the model in `dir` once (greedy); the summary is cached in `out`, the
    /// per-question results beside it.
    fn evaluate_cached(&self, dir: &Path, out: &Path) -> Result<eval::Summary> {
        if let Some(s) = std::fs::read_to_string(out).ok().and_then(|t| serde_json::from_str::<eval::Summary>(&t).ok())
        {
            return Ok(s);
        }
        let (m, tok) = checkpoint::open(dir, self.at)?;
        let mut file = std::io::BufWriter::new(std::fs::File::create(out.with_extension("questions.jsonl"))?);
        let settings = EvalSettings {
            max_new_tokens: self.s.sampling.max_new_tokens,
            samples: 0,
            sampling: match self.s.sampling.decoding {
                Decoding::Sample(p) => p,
                Decoding::Greedy => Default::default(),
            },
            batch_size: self.s.eval_batch_size,
        };
        let s = eval::evaluate(&m, &tok, &self.held_out, &self.style, &settings, Some(&mut file))?;
        file.flush()?;
        std::fs::write(out, serde_json::to_string(&s)?)?;
        Ok(s)
    }

    /// Iteration `i`'s sampling (with μ from `mu_dir`) and training, or the summary of its
    /// finished training. Sampling resumes and a finished data set is never regenerated; μ is
    /// loaded once, sampled from, then trained in place (it becomes π) and saved to `model_dir`.
    fn sample_and_train(&self, i: usize, mu_dir: &Path, dir: &Path, model_dir: &Path) -> Result<train::Summary> {
        let done = dir.join("train.done.json");
        let data = dir.join("data.jsonl");
        if done.exists() && data.exists() {
            return serde_json::from_str(&std::fs::read_to_string(&done)?)
                .with_context(|| format!("reading {}", done.display()));
        }
        let s = self.s;
        let (m, tok) = checkpoint::open(mu_dir, self.at)?;
        let seed = (s.train.seed as i64).wrapping_add(1_000 * i as i64);
        sample::sample_dataset(
            &m,
            &tok,
            &self.problems,
            &self.style,
            s.samples_per_prompt,
            &s.sampling,
            seed,
            s.batch_prompts,
            &data,
        )?;
        let samples = train::load_data(
            &data,
            m.cfg.max_position_embeddings as usize,
            m.cfg.vocab_size,
            s.train.skip_bad_records,
        )?;
        let samples = s.curate.apply(samples);
        let summary = train::run(&m, &samples, &s.train, dir)?;
        checkpoint::save(&m, mu_dir, model_dir)?;
        train::finish(dir);
        std::fs::write(&done, serde_json::to_string(&summary)?)?;
        Ok(summary)
    }
}

/// Runs (or, with `s.train.resume`, continues) the loop from the model in `model`, loaded with
/// `at`; writes `iterations.jsonl` and `iterations.png` to `s.work` and prints the table.
pub fn run(model: &Path, at: Placement, s: &IterateSettings) -> Result<()> {
    let started = s.work.join("eval-initial.json").exists() || s.work.join("iter-1").exists();
    if started && !s.train.resume {
        bail!(Refusal::EarlierIterations(s.work.clone()));
    }
    std::fs::create_dir_all(&s.work)?;
    let (problems, style) = s.task.load()?;
    let held_out = eval_problems(s)?;
    let lp = Loop { at, s, problems, style, held_out };
    let mut rows = vec![];
    let before = lp.evaluate_cached(model, &s.work.join("eval-initial.json"))?;
    rows.push(IterationRecord {
        accuracy: before.pass1_greedy,
        data_positive_fraction: None,
        invalid_rate: before.invalid_rate_greedy,
        iteration: 0,
        p_tilde: None,
        truncated_fraction_neg: None,
    });
    eprintln!(
        "iteration 0 (initial model): held-out pass@1 {:.3}, invalid {:.3}",
        before.pass1_greedy, before.invalid_rate_greedy
    );
    let mut mu_dir = model.to_path_buf();
    for i in 1..=s.iterations {
        let dir = s.work.join(format!("iter-{i}"));
        std::fs::create_dir_all(&dir)?;
        let model_dir = dir.join("model");
        let summary = lp.sample_and_train(i, &mu_dir, &dir, &model_dir)?;
        let e = lp.evaluate_cached(&model_dir, &dir.join("eval.json"))?;
        let opt = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
        eprintln!(
            "iteration {i}: held-out pass@1 {:.3}, invalid {:.3}, data {:.1}% positive, p~ {}, truncated (neg) {}",
            e.pass1_greedy,
            e.invalid_rate_greedy,
            100.0 * summary.positive_fraction,
            opt(summary.p_tilde),
            opt(summary.truncated_fraction_neg)
        );
        rows.push(IterationRecord {
            accuracy: e.pass1_greedy,
            data_positive_fraction: Some(summary.positive_fraction),
            invalid_rate: e.invalid_rate_greedy,
            iteration: i,
            p_tilde: summary.p_tilde,
            truncated_fraction_neg: summary.truncated_fraction_neg,
        });
        mu_dir = model_dir;
    }
    write_table(&s.work.join("iterations.jsonl"), &rows)?;
    crate::plot::report("iterations", || crate::plot::plot_iterations(&s.work));
    print_table(&rows);
    Ok(())
}

fn write_table(path: &Path, rows: &[IterationRecord]) -> Result<()> {
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in rows {
        writeln!(w, "{}", serde_json::to_string(r)?)?;
    }
    w.flush()?;
    Ok(())
}

/// The table of iterations on stdout.
fn print_table(rows: &[IterationRecord]) {
    println!(
        "{:>9} {:>9} {:>8} {:>10} {:>7} {:>10}",
        "iteration", "accuracy", "invalid", "positives", "p~", "truncated"
    );
    let f = |v: Option<f64>| v.filter(|v| v.is_finite()).map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
    for r in rows {
        println!(
            "{:>9} {:>9} {:>8} {:>10} {:>7} {:>10}",
            r.iteration.to_string(),
            f(Some(r.accuracy)),
            f(Some(r.invalid_rate)),
            f(r.data_positive_fraction),
            f(r.p_tilde),
            f(r.truncated_fraction_neg)
        );
    }
}
