//! The generative verifier, the paper's second use of TOPR (Le Roux et al. 2025, section 5.3):
//! the model learns to judge a completion — "is this solution correct?", answered in text — from
//! graded samples, with TOPR, and its judgement then picks one of `k` sampled solutions per
//! question.
//!
//! Each graded solution becomes a *judge problem* ([`judge_problem`]): the original problem and
//! the solution, and the question whether it is correct, answered "The answer is 1." (correct) or
//! "The answer is 0." (not) — the answer format of every task of this crate. [`run`] chains the
//! stages in a work directory, each reused when it is done:
//!
//! 1. `solutions.jsonl`: `k` graded solutions per training question, sampled from the solver;
//! 2. `heldout-solutions.jsonl`: `k` per held-out question;
//! 3. `judge-train.jsonl`, `judge-heldout.jsonl`: their judge problems (GSM8K layout, so that
//!    `--task gsm8k --data` reads them);
//! 4. `verifier/round-R/`: rounds of off-policy training of a copy of the solver. In each round,
//!    both verdicts of every training judge problem are scored under the current model (μ) and
//!    become a data set of graded completions — the true verdict with reward +1, the false one
//!    with −1 — on which the model trains (TOPR by default, with the `train` settings); the round's
//!    model is μ of the next. Training on both verdicts, rather than on sampled judgements, is
//!    what makes the stage work from a model that has never judged: a small model asked to judge
//!    first writes a solution, not a verdict, and its own samples would be all negatives (every
//!    judgement invalid). It is off-policy data of exactly the kind TOPR is for: completions not
//!    drawn from the policy, with their log-probabilities under μ, half of them negatives.
//! 5. `verify.jsonl` (one line per held-out question) and `verify.json` ([`VerifySummary`]): the
//!    verifier scores every held-out solution by `P(1) = σ(log p(“…1.”) − log p(“…0.”))`, teacher
//!    forced, and picks the highest; against the first sample (pass@1), majority voting (maj@k)
//!    and the oracle (pass@k), each with its standard error over questions.

use crate::checkpoint::{self, Placement};
use crate::dataset::{self, Sample, SamplingRecord};
use crate::eval::majority;
use crate::generate::{self, Sampling};
use crate::layout::VerifyDir;
use crate::sample::{self, SampleSettings};
use crate::settings::TrainSettings;
use crate::shard::Shard;
use crate::task::{self, Problem, PromptStyle, TaskSpec, prompt_ids};
use crate::tokenizer::Tokenizer;
use crate::train;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The judge's question about `completion` as an answer to `question`.
pub fn judge_question(question: &str, completion: &str) -> String {
    format!("Problem: {question}\nSolution: {}\nIs the solution correct? 1 if yes, 0 if no.", completion.trim())
}

/// The judge problem of a graded completion: answer 1 when it is correct, else 0.
///
/// ```
/// # use topr_llama::{generate::Stop, dataset::{Sample, SamplingRecord}, verify::judge_problem};
/// let s = Sample {
///     id: "q7".into(), sample: 2, question: "What is 2 + 3?".into(), prompt_ids: vec![1],
///     completion: "2 + 3 = 5. The answer is 5.".into(), completion_ids: vec![2], logp_mu: vec![0.0],
///     logp_sampling: vec![0.0], seq_logp_mu: 0.0, seq_logp_sampling: 0.0, answer: Some(5.0),
///     reference: 5.0, correct: true, invalid: false, reward: 1.0, stop: Stop::Eos,
///     sampling: SamplingRecord { temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: 8, seed: 0 },
/// };
/// let p = judge_problem(&s, &s.completion);
/// assert_eq!((p.id.as_str(), p.answer), ("judge:q7:2", 1.0));
/// assert!(p.question.contains("Solution: 2 + 3 = 5."));
/// ```
pub fn judge_problem(s: &Sample, shown: &str) -> Problem {
    let answer = if s.correct { 1.0 } else { 0.0 };
    Problem {
        id: format!("judge:{}:{}", s.id, s.sample),
        question: judge_question(&s.question, shown),
        solution: format!("The answer is {answer}."),
        answer,
    }
}

/// The judge problems of `samples` for a model of context `context` that answers in at most
/// `answer_tokens`: a completion too long for the judge's prompt to fit is shown by its end (its
/// answer line), cut at the front with "…". Returns them with the number so cut.
pub fn judge_problems(
    tok: &Tokenizer,
    samples: &[Sample],
    context: i64,
    answer_tokens: i64,
) -> Result<(Vec<Problem>, usize)> {
    let mut out = vec![];
    let mut cut = 0;
    for s in samples {
        let mut shown: &str = &s.completion;
        loop {
            let p =
                judge_problem(s, &if shown.len() < s.completion.len() { format!("…{shown}") } else { shown.into() });
            let n = prompt_ids(tok, &PromptStyle::Chat, &p)?.len() as i64;
            if n + answer_tokens <= context {
                cut += usize::from(shown.len() < s.completion.len());
                out.push(p);
                break;
            }
            if shown.is_empty() {
                bail!(
                    "{}: the judge's prompt without the solution ({n} tokens) exceeds the context of {context}",
                    s.id
                );
            }
            // Keep the last 80 % (at a character boundary).
            let mut at = shown.len() - shown.len() * 4 / 5;
            while !shown.is_char_boundary(at) {
                at += 1;
            }
            shown = &shown[at..];
        }
    }
    Ok((out, cut))
}

/// Writes `problems` to `out` in the GSM8K layout (`question`, `answer` ending in `#### N`), so
/// that `--task gsm8k --data OUT` reads them.
pub fn write_problems(problems: &[Problem], out: &Path) -> Result<()> {
    crate::io::write_atomic(out, |w| {
        for p in problems {
            let line =
                serde_json::json!({"question": p.question, "answer": format!("{}\n#### {}", p.solution, p.answer)});
            writeln!(w, "{line}")?;
        }
        Ok(())
    })
}

use std::io::Write as _;

/// What [`run`] does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifySettings {
    /// The solver's training questions (their graded solutions teach the verifier).
    pub task: TaskSpec,
    /// Held-out questions: a GSM8K file, else (synthetic task) `eval_n` problems from another seed.
    pub eval_data: Option<PathBuf>,
    pub eval_n: usize,
    /// Solutions sampled per question, for training (`solutions.jsonl`) and selection.
    pub k: usize,
    /// How the solver samples them.
    pub sampling: Sampling,
    /// The verifier's training: its objective and optimiser (TOPR by default).
    pub train: TrainSettings,
    /// Rounds of the verifier's training (0: the solver judges untrained).
    pub judge_iterations: usize,
    /// Questions whose k solutions are sampled at once (`batch_prompts · k` in flight).
    pub batch_prompts: usize,
    /// Seeds the solutions (the held-out ones with `seed + 1`).
    pub seed: i64,
    #[serde(skip)]
    pub work: PathBuf,
}

/// One held-out question's solutions, their verifier scores and what each rule picks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VerifiedQuestion {
    pub id: String,
    pub reference: f64,
    pub answers: Vec<Option<f64>>,
    pub correct: Vec<bool>,
    /// The verifier's `P(correct)` of each solution.
    pub p_correct: Vec<f64>,
    /// The solution the verifier picks (the first of equal scores).
    pub picked: usize,
    pub majority_correct: bool,
}

/// A mean over questions with its standard error ([`crate::stats`]).
pub use crate::stats::Estimate;

/// What the selection measured on the held-out questions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VerifySummary {
    pub questions: usize,
    pub k: usize,
    /// The share of correct solutions (sampled pass@1).
    pub pass1: Estimate,
    pub maj_at_k: Estimate,
    /// The verifier's pick.
    pub verifier_at_k: Estimate,
    /// Any of the `k` correct (the oracle's pick).
    pub pass_at_k: Estimate,
    /// `verifier@k − maj@k`, paired by question.
    pub verifier_minus_majority: Estimate,
    /// The verifier's judgement accuracy on the held-out solutions (`P(correct) > 0.5` iff correct).
    pub judgement_accuracy: Estimate,
    /// Share of correct solutions among those judged (the base rate of the judgement).
    pub positive_fraction: f64,
}

/// Runs (or continues: finished stages are reused) the generative-verifier pipeline from the
/// solver in `model`, loaded with `at`, in `s.work`; returns and writes its summary.
pub fn run(model: &Path, at: Placement, s: &VerifySettings) -> Result<VerifySummary> {
    if s.k == 0 {
        bail!("the number of solutions per question must be >= 1");
    }
    crate::io::refuse_overlap(model, &s.work, "work directory")?;
    let (problems, style) = s.task.load()?;
    let held = task::held_out(&s.task, s.eval_data.as_deref(), s.eval_n, s.train.skip_bad_records)?;
    let cfg = crate::config::LlamaConfig::load(model)?;
    let tok = Tokenizer::load(model, &cfg)?;
    let verdicts = [tok.encode("The answer is 0.", false)?, tok.encode("The answer is 1.", false)?];
    let answer_tokens = verdicts.iter().map(Vec::len).max().unwrap_or(0) as i64;
    // Every question's judge prompt must fit with no solution shown, before anything is sampled.
    for p in problems.iter().chain(&held) {
        let empty = Problem { question: judge_question(&p.question, ""), ..p.clone() };
        let n = prompt_ids(&tok, &PromptStyle::Chat, &empty)?.len() as i64;
        if n + answer_tokens > cfg.max_position_embeddings {
            bail!(
                "{}: the judge's prompt without the solution ({n} tokens) and its verdict ({answer_tokens}) exceed the model's context of {}: the judge cannot read this question",
                p.id,
                cfg.max_position_embeddings
            );
        }
    }
    std::fs::create_dir_all(&s.work).with_context(|| format!("creating {}", s.work.display()))?;
    // One run at a time in a work directory, as every other command's.
    let _lock = crate::io::Lock::dir(&s.work)?;
    // 1–2. The solver's graded solutions.
    let layout = VerifyDir::new(&s.work);
    let (solutions, held_solutions) = layout.solutions();
    solve(model, at, s, &style, [(&solutions, &problems, s.seed), (&held_solutions, &held, s.seed.wrapping_add(1))])?;
    // 3. The judge problems (solutions too long for the judge's context shown by their end).
    let held_samples = dataset::read_dataset(&held_solutions, false)?.0;
    let fit = |samples: &[Sample]| judge_problems(&tok, samples, cfg.max_position_embeddings, answer_tokens);
    let (train_problems, cut_train) = fit(&dataset::read_dataset(&solutions, false)?.0)?;
    let (held_problems, cut_held) = fit(&held_samples)?;
    if cut_train + cut_held > 0 {
        eprintln!("{} solution(s) shown by their end only, to fit the judge's context", cut_train + cut_held);
    }
    let (judge_train, judge_held) = layout.judge_problems();
    write_problems(&train_problems, &judge_train)?;
    write_problems(&held_problems, &judge_held)?;
    // 4. The verifier: rounds of TOPR on both verdicts of every training judge problem.
    let mut verifier = model.to_path_buf();
    for round in 1..=s.judge_iterations {
        verifier = train_round(&verifier, at, s, round, &tok, &train_problems, &verdicts)?;
    }
    // 5. Selection on the held-out questions.
    let (v, _) = checkpoint::open(&verifier, at)?;
    let rows = select(&v, &tok, &held, &held_samples, &held_problems, &verdicts)?;
    crate::io::write_atomic(&layout.questions(), |w| {
        for r in &rows {
            writeln!(w, "{}", serde_json::to_string(r)?)?;
        }
        Ok(())
    })?;
    let summary = summarize(&rows, s.k);
    crate::io::write_file(&layout.summary(), serde_json::to_string_pretty(&summary)?)?;
    Ok(summary)
}

/// The solver's `s.k` graded solutions of each problem set into its file (`(file, problems,
/// seed)`), resumable like any data set.
fn solve(
    model: &Path,
    at: Placement,
    s: &VerifySettings,
    style: &PromptStyle,
    sets: [(&Path, &[Problem], i64); 2],
) -> Result<()> {
    let (m, tok) = checkpoint::open(model, at)?;
    for (path, probs, seed) in sets {
        let settings = SampleSettings {
            samples_per_prompt: s.k,
            sampling: s.sampling,
            seed,
            batch_prompts: s.batch_prompts,
            shard: Shard::WHOLE,
        };
        sample::sample_dataset(&m, &tok, model, probs, style, &settings, path).map_err(|e| verifier_refusal(e, s))?;
    }
    Ok(())
}

/// A sampled file's refusal to be extended with other settings, as the verifier's (its work
/// directory is what a rerun changes, not an output file).
fn verifier_refusal(e: anyhow::Error, s: &VerifySettings) -> anyhow::Error {
    match e.downcast::<crate::Refusal>() {
        Ok(crate::Refusal::ChangedSettings { differences, run: crate::Resumable::Sampling, .. }) => {
            crate::Refusal::ChangedSettings { dir: s.work.clone(), differences, run: crate::Resumable::Verifier }.into()
        }
        Ok(other) => other.into(),
        Err(e) => e,
    }
}

/// The verifier `v`'s pick among each held-out question's solutions (`held_samples`, their judge
/// problems `held_problems`): its `P(correct)` of each, `σ(log p(1) − log p(0))` of the verdicts.
fn select(
    v: &crate::model::Llama,
    tok: &Tokenizer,
    held: &[Problem],
    held_samples: &[Sample],
    held_problems: &[Problem],
    verdicts: &[Vec<i64>; 2],
) -> Result<Vec<VerifiedQuestion>> {
    let [zero, one] = verdicts;
    let mut by_question: BTreeMap<usize, Vec<(&Sample, &Problem)>> = BTreeMap::new();
    let index: BTreeMap<&str, usize> = held.iter().enumerate().map(|(i, p)| (p.id.as_str(), i)).collect();
    for (smp, judge) in held_samples.iter().zip(held_problems) {
        let i = *index.get(smp.id.as_str()).with_context(|| format!("{}: not a held-out question", smp.id))?;
        by_question.entry(i).or_default().push((smp, judge));
    }
    let pb = crate::progress::Progress::new("verify: judge", "solutions", held_samples.len() as u64, 0);
    let mut rows = vec![];
    for (i, sols) in by_question {
        let mut p_correct = vec![];
        for (_, judge) in &sols {
            let prompt = prompt_ids(tok, &PromptStyle::Chat, judge)?;
            let l1: f64 = generate::score(v, &prompt, one)?.iter().map(|&x| f64::from(x)).sum();
            let l0: f64 = generate::score(v, &prompt, zero)?.iter().map(|&x| f64::from(x)).sum();
            // σ(l1 − l0), in a form that cannot overflow.
            let d = l1 - l0;
            p_correct.push(if d >= 0.0 { 1.0 / (1.0 + (-d).exp()) } else { d.exp() / (1.0 + d.exp()) });
            pb.inc(1);
        }
        let picked = (0..p_correct.len()).fold(0, |b, j| if p_correct[j] > p_correct[b] { j } else { b });
        let answers: Vec<Option<f64>> = sols.iter().map(|x| x.0.answer).collect();
        rows.push(VerifiedQuestion {
            id: held[i].id.clone(),
            reference: held[i].answer,
            majority_correct: task::is_correct(majority(&answers), held[i].answer),
            correct: sols.iter().map(|x| x.0.correct).collect(),
            answers,
            p_correct,
            picked,
        });
    }
    pb.finish();
    Ok(rows)
}

/// One round of the verifier's training from the model in `mu` (μ), in
/// `work/verifier/round-R/`: the data set of both verdicts of every judge problem with μ's
/// log-probs, then training; returns the round's model (reused when the round is done).
fn train_round(
    mu: &Path,
    at: Placement,
    s: &VerifySettings,
    round: usize,
    tok: &Tokenizer,
    problems: &[Problem],
    verdicts: &[Vec<i64>; 2],
) -> Result<PathBuf> {
    let dir = VerifyDir::new(&s.work).round(round);
    let (model_dir, done, data) = (dir.join("model"), crate::layout::done_file(&dir), dir.join("data.jsonl"));
    let settings = TrainSettings { resume: true, ..s.train.clone() };
    if done.exists() {
        // A finished round is reused only for the same inputs and training settings.
        let text = std::fs::read_to_string(&done).with_context(|| format!("reading {}", done.display()))?;
        if let Ok(saved) = serde_json::from_str::<RoundDone>(&text) {
            let cfg = crate::config::LlamaConfig::load(mu)?;
            let samples = train::load_data(&data, cfg.max_position_embeddings as usize, cfg.vocab_size, false)?;
            let record = train::RunRecord::new(mu, at, &data, &samples, &settings)?;
            crate::stage::check(
                &serde_json::to_value(&saved.record)?,
                &record,
                &[],
                &s.work,
                crate::Resumable::Verifier,
            )?;
        }
        return Ok(model_dir);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (m, _) = checkpoint::open(mu, at)?;
    if !data.exists() {
        write_verdicts(&m, tok, problems, verdicts, &data)?;
    }
    let samples = train::load_data(&data, m.cfg.max_position_embeddings as usize, m.cfg.vocab_size, false)?;
    let record = train::RunRecord::new(mu, at, &data, &samples, &settings)?;
    let summary = train::run(&m, &samples, &settings, &record, &dir, None)?;
    checkpoint::save(&m, mu, &model_dir)?;
    train::finish(&dir);
    crate::stage::write_done(&done, &RoundDone { record, summary })?;
    Ok(model_dir)
}

/// The data set of a round: both verdicts of every judge problem, each with μ's (`m`'s)
/// log-probs and reward ±1 by whether it is the right verdict.
fn write_verdicts(
    m: &crate::model::Llama,
    tok: &Tokenizer,
    problems: &[Problem],
    verdicts: &[Vec<i64>; 2],
    data: &Path,
) -> Result<()> {
    let record = SamplingRecord { temperature: 0.0, top_p: 1.0, top_k: 0, max_new_tokens: 0, seed: 0 };
    let pb = crate::progress::Progress::new("verify: score verdicts", "problems", problems.len() as u64, 0);
    crate::io::write_atomic(data, |w| {
        for p in problems {
            let prompt = prompt_ids(tok, &PromptStyle::Chat, p)?;
            for (d, ids) in verdicts.iter().enumerate() {
                let logp = generate::score(m, &prompt, ids)?;
                let seq: f64 = logp.iter().map(|&x| f64::from(x)).sum();
                let correct = (d as f64 - p.answer).abs() < 0.5;
                let smp = Sample {
                    id: p.id.clone(),
                    sample: d,
                    question: p.question.clone(),
                    prompt_ids: prompt.clone(),
                    completion: format!("The answer is {d}."),
                    completion_ids: ids.clone(),
                    logp_sampling: logp.clone(),
                    logp_mu: logp,
                    seq_logp_mu: seq,
                    seq_logp_sampling: seq,
                    answer: Some(d as f64),
                    reference: p.answer,
                    correct,
                    invalid: false,
                    reward: if correct { 1.0 } else { -1.0 },
                    stop: generate::Stop::Length,
                    sampling: record.clone(),
                };
                writeln!(w, "{}", serde_json::to_string(&smp)?)?;
            }
            pb.inc(1);
        }
        Ok(())
    })?;
    pb.finish();
    Ok(())
}

/// `train.done.json` of a finished round: what it trained on and with, and what it did.
#[derive(Serialize, Deserialize)]
struct RoundDone {
    record: train::RunRecord,
    summary: train::Summary,
}

/// The summary of the held-out questions' rows.
pub fn summarize(rows: &[VerifiedQuestion], k: usize) -> VerifySummary {
    let per = |f: &dyn Fn(&VerifiedQuestion) -> f64| Estimate::of(&rows.iter().map(f).collect::<Vec<_>>());
    let b = |x: bool| f64::from(u8::from(x));
    let judged: Vec<(bool, f64)> =
        rows.iter().flat_map(|r| r.correct.iter().copied().zip(r.p_correct.iter().copied())).collect();
    VerifySummary {
        questions: rows.len(),
        k,
        pass1: per(&|r| r.correct.iter().filter(|c| **c).count() as f64 / r.correct.len().max(1) as f64),
        maj_at_k: per(&|r| b(r.majority_correct)),
        verifier_at_k: per(&|r| b(r.correct.get(r.picked).copied().unwrap_or(false))),
        pass_at_k: per(&|r| b(r.correct.iter().any(|c| *c))),
        verifier_minus_majority: per(&|r| b(r.correct.get(r.picked).copied().unwrap_or(false)) - b(r.majority_correct)),
        judgement_accuracy: Estimate::of(&judged.iter().map(|(c, p)| b((*p > 0.5) == *c)).collect::<Vec<_>>()),
        positive_fraction: judged.iter().filter(|(c, _)| *c).count() as f64 / judged.len().max(1) as f64,
    }
}

/// The summary as a small table (stdout).
pub fn print_summary(s: &VerifySummary) {
    println!("{} held-out questions, {} solutions each (mean ± standard error over questions)", s.questions, s.k);
    let row = |name: &str, e: Estimate| println!("{name:>26} {:>7.3} ± {:.3}", e.mean, e.se);
    row("pass@1 (a sampled solution)", s.pass1);
    row("maj@k (majority vote)", s.maj_at_k);
    row("verifier@k (its pick)", s.verifier_at_k);
    row("pass@k (oracle)", s.pass_at_k);
    row("verifier − majority", s.verifier_minus_majority);
    row("judgement accuracy", s.judgement_accuracy);
    println!("{:>26} {:>7.3}", "correct among judged", s.positive_fraction);
}
