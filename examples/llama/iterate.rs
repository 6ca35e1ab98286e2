//! The self-taught loop: for each iteration, sample a data set with the current model as μ,
//! optionally curate it, train a copy off-policy, evaluate it on held-out problems. Each stage
//! leaves its output in `work/iter-N/`; rerunning the command skips finished stages, and an
//! interrupted sampling stage resumes where it stopped.

use crate::eval::{self, PromptStyle};
use crate::generate::Sampling;
use crate::sample::{self, Sample};
use crate::train::{self, Options};
use crate::{ModelArgs, TaskArgs, checkpoint, load, task};
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
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "none" | "all" => Self::All,
            "one-positive" => Self::OnePositive,
            other => bail!("--curate must be none or one-positive, got {other:?}"),
        })
    }

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

pub struct Plan {
    pub task: TaskArgs,
    pub options: Options,
    pub skip_bad_lines: bool,
    pub sampling: Sampling,
    pub work: PathBuf,
    pub iterations: usize,
    pub samples_per_prompt: usize,
    pub batch_prompts: usize,
    pub curate: Curation,
    pub eval_data: Option<PathBuf>,
    pub eval_n: usize,
    pub eval_batch_size: usize,
}

/// The held-out problems: `--eval-data` for GSM8K, else synthetic problems from another seed.
fn eval_problems(plan: &Plan) -> Result<Vec<task::Problem>> {
    match (&plan.eval_data, plan.task.task.as_str()) {
        (Some(p), _) => Ok(task::load_gsm8k(p, plan.skip_bad_lines)?.0.into_iter().take(plan.eval_n).collect()),
        (None, "synthetic") => {
            Ok(task::synthetic_problems(plan.task.task_seed.wrapping_add(999_983), plan.eval_n, plan.task.difficulty))
        }
        (None, _) => bail!("--task gsm8k needs --eval-data PATH (e.g. the test file) for held-out evaluation"),
    }
}

/// Evaluates the model in `dir` once; the summary is cached in `out`.
fn evaluate_cached(
    dir: &Path,
    args: &ModelArgs,
    problems: &[task::Problem],
    style: &PromptStyle,
    plan: &Plan,
    out: &Path,
) -> Result<eval::Summary> {
    if let Some(s) = std::fs::read_to_string(out).ok().and_then(|t| serde_json::from_str::<eval::Summary>(&t).ok()) {
        return Ok(s);
    }
    let (m, tok) = load(&ModelArgs { model: dir.to_path_buf(), ..args.clone() })?;
    let mut file = std::io::BufWriter::new(std::fs::File::create(out.with_extension("questions.jsonl"))?);
    let s = eval::evaluate(
        &m,
        &tok,
        problems,
        style,
        plan.sampling.max_new_tokens,
        0,
        plan.sampling,
        plan.eval_batch_size,
        Some(&mut file),
    )?;
    file.flush()?;
    std::fs::write(out, serde_json::to_string(&s)?)?;
    Ok(s)
}

pub fn run(args: &ModelArgs, plan: &Plan) -> Result<()> {
    let started = plan.work.join("eval-initial.json").exists() || plan.work.join("iter-1").exists();
    if started && !plan.options.resume {
        bail!(
            "{} holds an earlier run: pass --resume to continue it (finished stages are kept), or choose another --work",
            plan.work.display()
        );
    }
    std::fs::create_dir_all(&plan.work)?;
    let (problems, style) = plan.task.load()?;
    let held_out = eval_problems(plan)?;
    let table = plan.work.join("iterations.jsonl");
    let mut rows = vec![];
    let before = evaluate_cached(&args.model, args, &held_out, &style, plan, &plan.work.join("eval-initial.json"))?;
    rows.push(serde_json::json!({"iteration": 0, "accuracy": before.pass1_greedy, "invalid_rate": before.invalid_rate_greedy, "p_tilde": null, "truncated_fraction_neg": null}));
    eprintln!(
        "iteration 0 (initial model): held-out pass@1 {:.3}, invalid {:.3}",
        before.pass1_greedy, before.invalid_rate_greedy
    );
    let mut mu_dir = args.model.clone();
    for i in 1..=plan.iterations {
        let dir = plan.work.join(format!("iter-{i}"));
        std::fs::create_dir_all(&dir)?;
        let model_dir = dir.join("model");
        let done = dir.join("train.done.json");
        // 1. Sample with μ (resumable; a finished data set is never regenerated), then 2–3. curate
        //    and train that same loaded model (it becomes π), unless this iteration's training
        //    finished already. μ is loaded once per iteration.
        let data = dir.join("data.jsonl");
        let summary: train::Summary = if done.exists() && data.exists() {
            serde_json::from_str(&std::fs::read_to_string(&done)?)
                .with_context(|| format!("reading {}", done.display()))?
        } else {
            let (m, tok) = load(&ModelArgs { model: mu_dir.clone(), ..args.clone() })?;
            let seed = (plan.options.seed as i64).wrapping_add(1_000 * i as i64);
            sample::sample_dataset(
                &m,
                &tok,
                &problems,
                &style,
                plan.samples_per_prompt,
                &plan.sampling,
                seed,
                plan.batch_prompts,
                &data,
            )?;
            let samples = train::load_data(&data, m.cfg.max_position_embeddings as usize, plan.skip_bad_lines)?;
            let samples = plan.curate.apply(samples);
            let s = train::run(&m, &samples, &plan.options, &dir)?;
            checkpoint::save(&m, &mu_dir, &model_dir)?;
            train::finish(&dir);
            std::fs::write(&done, serde_json::to_string(&s)?)?;
            s
        };
        // 4. Evaluate.
        let e = evaluate_cached(&model_dir, args, &held_out, &style, plan, &dir.join("eval.json"))?;
        let opt = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
        eprintln!(
            "iteration {i}: held-out pass@1 {:.3}, invalid {:.3}, data {:.1}% positive, p~ {}, truncated (neg) {}",
            e.pass1_greedy,
            e.invalid_rate_greedy,
            100.0 * summary.positive_fraction,
            opt(summary.p_tilde),
            opt(summary.truncated_fraction_neg)
        );
        rows.push(serde_json::json!({"iteration": i, "accuracy": e.pass1_greedy, "invalid_rate": e.invalid_rate_greedy, "p_tilde": summary.p_tilde, "truncated_fraction_neg": summary.truncated_fraction_neg, "data_positive_fraction": summary.positive_fraction}));
        mu_dir = model_dir;
    }
    let mut w = std::io::BufWriter::new(std::fs::File::create(&table)?);
    for r in &rows {
        writeln!(w, "{r}")?;
    }
    w.flush()?;
    crate::plot::report("iterations", || crate::plot::plot_iterations(&plan.work));
    println!(
        "{:>9} {:>9} {:>8} {:>10} {:>7} {:>10}",
        "iteration", "accuracy", "invalid", "positives", "p~", "truncated"
    );
    for r in &rows {
        let f = |k: &str| r[k].as_f64().map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
        println!(
            "{:>9} {:>9} {:>8} {:>10} {:>7} {:>10}",
            r["iteration"].to_string(),
            f("accuracy"),
            f("invalid_rate"),
            f("data_positive_fraction"),
            f("p_tilde"),
            f("truncated_fraction_neg")
        );
    }
    Ok(())
}
