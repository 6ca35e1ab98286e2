//! Evaluation on a task: greedy pass@1, and with `k` samples per question sampled pass@1, maj@k
//! and pass@k; invalid-answer rate and mean completion length; one JSON line per question.

use crate::generate::{self, Batching, Job, Sampling, SamplingParams, Stream};
use crate::identity::Numerics;
use crate::model::Llama;
use crate::parallel::{self, ProcessGroup};
use crate::shard::Shard;
use crate::task::{self, Problem};
pub use crate::task::{PromptStyle, prompt_ids};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use serde::Serialize;
use std::io::Write;

/// One question's results.
#[derive(Serialize, serde::Deserialize)]
pub struct QuestionResult {
    pub id: String,
    pub question: String,
    pub reference: f64,
    pub greedy_completion: String,
    pub greedy_answer: Option<f64>,
    pub greedy_correct: bool,
    pub greedy_invalid: bool,
    pub greedy_tokens: usize,
    pub sample_answers: Vec<Option<f64>>,
    pub sample_correct: Vec<bool>,
}

/// The aggregate metrics.
#[derive(Serialize, serde::Deserialize, Debug, Clone)]
pub struct Summary {
    pub questions: usize,
    pub pass1_greedy: f64,
    pub invalid_rate_greedy: f64,
    pub mean_tokens_greedy: f64,
    pub samples_per_question: usize,
    pub pass1_sampled: Option<f64>,
    /// The mean over questions of [`majority_credit`].
    pub maj_at_k: Option<f64>,
    pub pass_at_k: Option<f64>,
}

/// The most common valid answer (the first one reached on ties), if any: the generative
/// verifier's majority vote. maj@k scores ties by [`majority_credit`] instead.
pub fn majority(answers: &[Option<f64>]) -> Option<f64> {
    let mut best: Option<(f64, usize)> = None;
    for a in answers.iter().flatten() {
        let n = answers.iter().flatten().filter(|b| task::is_correct(Some(**b), *a)).count();
        if best.is_none_or(|(_, m)| n > m) {
            best = Some((*a, n));
        }
    }
    best.map(|(a, _)| a)
}

/// One question's maj@k: a vote among its valid answers (invalid ones cast none), a tie between
/// `t` leading answers scored `1/t` for each that is correct — the expected score of a vote that
/// breaks ties at random, which depends neither on the samples' order nor on a rule of thumb; 0
/// when no answer is valid. Answers that [`task::is_correct`] calls equal count as one.
///
/// ```
/// use topr_llama::eval::majority_credit;
/// assert_eq!(majority_credit(&[Some(2.0), None, Some(2.0), Some(6.0)], 2.0), 1.0);
/// // a tie between 2 and 6: half a point, whichever came first
/// assert_eq!(majority_credit(&[Some(6.0), None, Some(2.0), None], 2.0), 0.5);
/// assert_eq!(majority_credit(&[Some(2.0), Some(6.0), Some(7.0), Some(6.0)], 2.0), 0.0);
/// assert_eq!(majority_credit(&[None, None], 2.0), 0.0);
/// ```
pub fn majority_credit(answers: &[Option<f64>], reference: f64) -> f64 {
    let valid: Vec<f64> = answers.iter().flatten().copied().collect();
    let votes = |a: f64| valid.iter().filter(|b| task::is_correct(Some(**b), a)).count();
    let Some(top) = valid.iter().map(|a| votes(*a)).max() else { return 0.0 };
    let mut leaders: Vec<f64> = vec![];
    for &a in valid.iter().filter(|a| votes(**a) == top) {
        if !leaders.iter().any(|l| task::is_correct(Some(a), *l)) {
            leaders.push(a);
        }
    }
    let right = leaders.iter().filter(|l| task::is_correct(Some(**l), reference)).count();
    right as f64 / leaders.len() as f64
}

/// How an evaluation generates.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct EvalSettings {
    /// The token budget of every completion.
    pub max_new_tokens: i64,
    /// Sampled completions per question for sampled pass@1, maj@k and pass@k (0: greedy only).
    pub samples: usize,
    /// The distribution those are sampled from.
    pub sampling: SamplingParams,
    /// Completions in flight (continuous batching).
    pub batch_size: usize,
    /// Sample `k` of the task's question `i` draws from `Stream::new(seed, i, k)`, so that a
    /// shard samples what one process samples.
    pub seed: i64,
    /// The share of the batches of questions this process evaluates ([`Shard::WHOLE`]: all).
    pub shard: Shard,
}

/// Evaluates `problems` (the shard of them `settings.shard` names), writing one JSON line per
/// question to `out` when given.
pub fn evaluate(
    model: &Llama,
    tok: &Tokenizer,
    problems: &[Problem],
    style: &PromptStyle,
    settings: &EvalSettings,
    mut out: Option<&mut dyn Write>,
) -> Result<Summary> {
    let EvalSettings { max_new_tokens, samples, batch_size, seed, shard, .. } = *settings;
    let batch_size = batch_size.max(1);
    // Whole batches of questions, so that each is seeded and shaped as in one process.
    let batches = shard.range(problems.len().div_ceil(batch_size));
    let first = (batches.start * batch_size).min(problems.len());
    let mine = first..(batches.end * batch_size).min(problems.len());
    let greedy = Sampling::greedy(max_new_tokens);
    let sampled = Sampling::sample(settings.sampling, max_new_tokens);
    // Every question's prompt (jobs index them), so that every shard decodes on the shapes of
    // one process.
    let prompts: Vec<Vec<i64>> = problems.iter().map(|p| prompt_ids(tok, style, p)).collect::<Result<_>>()?;
    let problems = &problems[mine.clone()];
    let pb =
        crate::progress::Progress::new(&shard.label("eval"), "completions", (problems.len() * (1 + samples)) as u64, 0);
    let batching = Batching::slots(batch_size);
    // Greedy: one completion per question; sampled: `samples` per question, sample k of the
    // task's question i drawing from the stream (seed, i, k). `batch_size` in flight, each.
    let jobs: Vec<Job> = mine.clone().map(|i| Job { prompt: i, stream: Stream(0) }).collect();
    let g = generate::collect(model, &prompts, &jobs, &greedy, &tok.eos_ids, batching, || pb.inc(1))?;
    let jobs: Vec<Job> = mine
        .flat_map(|i| {
            (0..samples).map(move |k| Job { prompt: i, stream: Stream::new(seed as u64, i as u64, k as u64) })
        })
        .collect();
    let sampled = generate::collect(model, &prompts, &jobs, &sampled, &tok.eos_ids, batching, || pb.inc(1))?;
    let mut results = vec![];
    for (i, (p, c)) in problems.iter().zip(g).enumerate() {
        let answers = sampled[i * samples..(i + 1) * samples]
            .iter()
            .map(|c| Ok(task::extract_answer(&tok.decode(&c.tokens)?)))
            .collect::<Result<Vec<_>>>()?;
        let text = tok.decode(&c.tokens)?;
        let answer = task::extract_answer(&text);
        let r = QuestionResult {
            id: p.id.clone(),
            question: p.question.clone(),
            reference: p.answer,
            greedy_correct: task::is_correct(answer, p.answer),
            greedy_invalid: answer.is_none(),
            greedy_tokens: c.tokens.len(),
            greedy_answer: answer,
            greedy_completion: text,
            sample_correct: answers.iter().map(|a| task::is_correct(*a, p.answer)).collect(),
            sample_answers: answers,
        };
        if let Some(w) = out.as_deref_mut() {
            writeln!(w, "{}", serde_json::to_string(&r)?)?;
        }
        results.push(r);
    }
    pb.finish();
    Ok(summarize(&results, samples))
}

/// What the ranks of an evaluation must agree on.
#[derive(Serialize)]
struct EvalRecord<'a> {
    questions: crate::identity::Digest,
    settings: EvalSettings,
    model: &'a crate::config::LlamaConfig,
    numerics: Numerics,
}

/// [`evaluate`] spread over the ranks of a process `group` (one process without one): each rank
/// evaluates its shard, the per-question lines are gathered to every rank through the group, and
/// every rank returns the summary of all questions; rank 0 writes `out` (whole, atomically),
/// exactly the file one process writes. With a group the group decides the shard; without one,
/// `settings.shard` does (and `out` holds that shard's lines).
pub fn evaluate_parallel(
    model: &Llama,
    tok: &Tokenizer,
    problems: &[Problem],
    style: &PromptStyle,
    settings: &EvalSettings,
    out: Option<&std::path::Path>,
    group: Option<&ProcessGroup>,
) -> Result<Summary> {
    let settings = match group {
        Some(_) => EvalSettings { shard: parallel::shard(group), ..*settings },
        None => *settings,
    };
    // What each rank evaluates: the questions, the settings, the model's shapes and numerics.
    let questions = crate::identity::Digest::of_records(problems.iter().map(|p| (&p.id, &p.question, p.answer)))?;
    let record = EvalRecord {
        questions,
        settings: EvalSettings { shard: Shard::WHOLE, ..settings },
        model: &model.cfg,
        numerics: Numerics::of_model(model),
    };
    parallel::agree(group, "evaluation", &record, &[])?;
    let mut lines = vec![];
    evaluate(model, tok, problems, style, &settings, Some(&mut lines))?;
    let all = parallel::gather_bytes(group, &lines)?.concat();
    if let Some(path) = out.filter(|_| parallel::is_main(group)) {
        crate::io::write_atomic(path, |w| Ok(w.write_all(&all)?))?;
    }
    let text = String::from_utf8(all)?;
    let results = text.lines().map(serde_json::from_str).collect::<Result<Vec<QuestionResult>, _>>()?;
    Ok(summarize(&results, settings.samples))
}

pub fn summarize(results: &[QuestionResult], samples: usize) -> Summary {
    let n = results.len().max(1) as f64;
    let mean = |f: &dyn Fn(&QuestionResult) -> f64| results.iter().map(f).sum::<f64>() / n;
    let with_samples = samples > 0;
    Summary {
        questions: results.len(),
        pass1_greedy: mean(&|r| f64::from(u8::from(r.greedy_correct))),
        invalid_rate_greedy: mean(&|r| f64::from(u8::from(r.greedy_invalid))),
        mean_tokens_greedy: mean(&|r| r.greedy_tokens as f64),
        samples_per_question: samples,
        pass1_sampled: with_samples
            .then(|| mean(&|r| r.sample_correct.iter().filter(|c| **c).count() as f64 / samples as f64)),
        maj_at_k: with_samples.then(|| mean(&|r| majority_credit(&r.sample_answers, r.reference))),
        pass_at_k: with_samples.then(|| mean(&|r| f64::from(u8::from(r.sample_correct.iter().any(|c| *c))))),
    }
}
