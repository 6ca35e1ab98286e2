//! Sampling a graded, off-policy data set: for each prompt of a task, `n` completions from the
//! model (μ), each with its token ids, μ's per-token and sequence log-probabilities, its reward and
//! the sampling settings, one JSON line per completion.
//!
//! The file is written prompt by prompt, in order, and flushed; a rerun with the same output
//! resumes after the last complete prompt and never regenerates what is there. Every completion
//! draws from its own random stream (the seed, the prompt's index in the task, the sample's
//! number: [`generate::Stream`]) and decodes on the same shapes whatever runs beside it, so a
//! resumed or sharded run writes the lines of an uninterrupted one.

use crate::dataset::{CutLine, ShardPart, read_records, write_merged};
pub use crate::dataset::{
    Sample, SampleRun, SamplingRecord, Streams, merge_shards, read_dataset, read_dataset_for, run_file, shard_file,
    write_solutions,
};
use crate::generate::{self, Batching, Decoding, Job, Sampling, Stream};
use crate::identity::{Digest, ModelId};
use crate::model::Llama;
use crate::parallel::{self, ProcessGroup};
use crate::shard::Shard;
use crate::task::{self, Problem, PromptStyle, prompt_ids};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

/// How a data set is sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSettings {
    /// Completions per prompt.
    pub samples_per_prompt: usize,
    /// A sampling distribution (greedy decoding is refused) and the token budget.
    pub sampling: Sampling,
    /// Completion `k` of the task's problem `i` draws from `Stream::new(seed, i, k)`.
    pub seed: i64,
    /// Completions in flight are `batch_prompts ·` [`SampleSettings::samples_per_prompt`]
    /// (continuous batching: an ended completion's slot takes the next one at once).
    pub batch_prompts: usize,
    /// The share of the batches this process samples ([`Shard::WHOLE`]: all). Shards are runs
    /// of whole batches of `batch_prompts` prompts,
    /// and [`merge_shards`] joins the shards' files into exactly the file one process writes.
    pub shard: Shard,
}

impl SampleSettings {
    /// The sampling settings every line records; greedy decoding is refused (it would repeat
    /// one completion per prompt).
    pub fn record(&self) -> Result<SamplingRecord> {
        let Decoding::Sample(params) = self.sampling.decoding else {
            bail!("a data set is sampled: greedy decoding would repeat one completion per prompt");
        };
        Ok(SamplingRecord {
            temperature: params.temperature,
            top_p: params.top_p,
            top_k: params.top_k,
            max_new_tokens: self.sampling.max_new_tokens,
            seed: self.seed,
        })
    }
}

/// Samples `settings.samples_per_prompt` completions for each problem into `out` (JSONL) with
/// the model loaded from `model_dir`, resuming an existing file sampled with the same model,
/// problems and settings (any other is refused, listing what differs). `out` is locked
/// (`OUT.lock`) while this runs; every write is checked, so a full disk stops it at once.
pub fn sample_dataset(
    model: &Llama,
    tok: &Tokenizer,
    model_dir: &Path,
    problems: &[Problem],
    style: &PromptStyle,
    settings: &SampleSettings,
    out: &Path,
) -> Result<usize> {
    let SampleSettings { samples_per_prompt: n, sampling: s, seed, batch_prompts, .. } = *settings;
    s.check()?;
    let record = settings.record()?;
    if n == 0 {
        bail!("the number of samples per prompt must be >= 1, got 0");
    }
    crate::io::refuse_special(out)?;
    crate::io::refuse_overlap(model_dir, out, "output file")?;
    let _lock = crate::io::Lock::file(out)?;
    let all_prompts: Vec<Vec<i64>> = problems.iter().map(|p| prompt_ids(tok, style, p)).collect::<Result<_>>()?;
    let run = sample_run(model, model_dir, problems, &all_prompts, settings)?;
    check_run(out, &run)?;
    // This shard's problems (all of them for the whole): whole batches, seeded as in one process.
    let mine = run.shard_problems();
    let problems = &problems[mine.clone()];
    let batch_prompts = batch_prompts.max(1);
    let start = if out.exists() { keep_complete_prompts(out, problems, n, &record)? } else { 0 };
    if start == problems.len() {
        if !out.exists() {
            // A shard with no batch (fewer batches than shards): its file is empty, and whole.
            crate::io::write_file(out, "")?;
        }
        eprintln!("{}: all {} prompts already sampled", out.display(), problems.len());
        return Ok(0);
    }
    // Indices into the whole task list: they key the streams.
    let todo: Vec<(usize, &Problem)> =
        problems.iter().enumerate().skip(start).map(|(i, p)| (mine.start + i, p)).collect();
    let pb = crate::progress::Progress::new(
        &settings.shard.label("sample"),
        "completions",
        (problems.len() * n) as u64,
        ((problems.len() - todo.len()) * n) as u64,
    );
    // Every completion of every prompt left, `batch_prompts · n` in flight (continuous
    // batching); completion k of problem i draws from the stream (seed, i, k).
    // Every prompt of the task is given (jobs index them), so that every shard and every resume
    // decodes on the same shapes.
    let jobs: Vec<Job> = todo
        .iter()
        .flat_map(|(i, _)| {
            (0..n).map(move |k| Job { prompt: *i, stream: Stream::new(seed as u64, *i as u64, k as u64) })
        })
        .collect();
    let mut w =
        InOrder { out: crate::io::Append::open(out)?, pending: vec![vec![None; n]; todo.len()], next: 0, written: 0 };
    let batching = Batching::slots(batch_prompts * n);
    generate::run(model, &all_prompts, &jobs, &s, &tok.eos_ids, batching, |j, c| {
        w.add(j / n, j % n, c, |t, k, c| graded(tok, todo[t].1, k, &all_prompts[todo[t].0], c, &record))?;
        pb.inc(1);
        Ok(())
    })?;
    pb.finish();
    Ok(w.written)
}

/// Completions end out of order; a prompt's lines are written (and flushed) once it and every
/// prompt before it are complete, so that the file always ends on a whole prompt.
struct InOrder {
    out: crate::io::Append,
    /// Per prompt (from the first not yet written), its samples' completions so far.
    pending: Vec<Vec<Option<generate::Completion>>>,
    next: usize,
    written: usize,
}

impl InOrder {
    /// Adds completion `k` of prompt `t`, then writes every prompt now complete in order, each
    /// sample turned into its line by `line`.
    fn add(
        &mut self,
        t: usize,
        k: usize,
        c: generate::Completion,
        line: impl Fn(usize, usize, generate::Completion) -> Result<Sample>,
    ) -> Result<()> {
        self.pending[t][k] = Some(c);
        let mut buf = String::new();
        while self.next < self.pending.len() && self.pending[self.next].iter().all(Option::is_some) {
            for (k, c) in std::mem::take(&mut self.pending[self.next]).into_iter().enumerate() {
                let c = c.ok_or_else(|| anyhow::anyhow!("a completion went missing"))?;
                buf.push_str(&serde_json::to_string(&line(self.next, k, c)?)?);
                buf.push('\n');
                self.written += 1;
            }
            self.next += 1;
        }
        if !buf.is_empty() {
            self.out.write(buf.as_bytes())?;
        }
        Ok(())
    }
}

/// Keeps the lines of `out` up to the last prompt that has all its `n` samples, with every prompt
/// before it (rewritten atomically, each kept line verbatim, never re-serialised); returns the
/// number of `problems` kept. The rest is redone: each completion draws from its own stream, so
/// the redone lines are those an uninterrupted run writes. A line sampled with other settings
/// than `record` is refused.
fn keep_complete_prompts(out: &Path, problems: &[Problem], n: usize, record: &SamplingRecord) -> Result<usize> {
    let existing = read_records(out, None, false, CutLine::Resume)?.0;
    let mut count: HashMap<&str, usize> = HashMap::new();
    for (_, smp) in &existing {
        if smp.sampling != *record {
            bail!("{} was sampled with other settings ({:?}); use a new output file", out.display(), smp.sampling);
        }
        *count.entry(smp.id.as_str()).or_default() += 1;
    }
    let start = problems.iter().take_while(|p| count.get(p.id.as_str()).copied().unwrap_or(0) >= n).count();
    let keep: std::collections::HashSet<&str> = problems[..start].iter().map(|p| p.id.as_str()).collect();
    crate::io::write_atomic(out, |w| {
        for (line, smp) in &existing {
            if keep.contains(smp.id.as_str()) {
                writeln!(w, "{line}")?;
            }
        }
        Ok(())
    })?;
    Ok(start)
}

/// Sample `k` of problem `p` (prompt `prompt`): the completion `c` decoded and graded, ±1.
fn graded(
    tok: &Tokenizer,
    p: &Problem,
    k: usize,
    prompt: &[i64],
    c: generate::Completion,
    record: &SamplingRecord,
) -> Result<Sample> {
    let text = tok.decode(&c.tokens)?;
    let answer = task::extract_answer(&text);
    let correct = task::is_correct(answer, p.answer);
    Ok(Sample {
        id: p.id.clone(),
        sample: k,
        question: p.question.clone(),
        prompt_ids: prompt.to_vec(),
        completion: text,
        seq_logp_mu: c.logp_model.iter().map(|&x| x as f64).sum(),
        seq_logp_sampling: c.logp_sampling.iter().map(|&x| x as f64).sum(),
        completion_ids: c.tokens,
        logp_mu: c.logp_model,
        logp_sampling: c.logp_sampling,
        answer,
        reference: p.answer,
        correct,
        invalid: answer.is_none(),
        reward: if correct { 1.0 } else { -1.0 },
        stop: c.stop,
        sampling: record.clone(),
    })
}

/// The record of sampling `problems` (with their prompts `prompts`) from `model`, loaded from
/// `model_dir`, with `settings`.
fn sample_run(
    model: &Llama,
    model_dir: &Path,
    problems: &[Problem],
    prompts: &[Vec<i64>],
    settings: &SampleSettings,
) -> Result<SampleRun> {
    Ok(SampleRun {
        model: ModelId::of(model_dir)?,
        prompts: Digest::of_records(problems.iter().zip(prompts).map(|(p, ids)| (&p.id, &p.question, p.answer, ids)))?,
        problems: problems.len(),
        samples_per_prompt: settings.samples_per_prompt,
        batch_prompts: settings.batch_prompts,
        sampling: settings.record()?,
        streams: Streams::PerCompletion,
        shard: (!settings.shard.is_whole()).then_some(settings.shard),
        numerics: crate::identity::Numerics::of_model(model),
    })
}

/// Whether `out` holds the whole data set `run` describes: its record equal to `run` and every
/// completion there (anything unreadable: no).
fn is_complete(out: &Path, run: &SampleRun) -> bool {
    let same = crate::stage::read_record(&run_file(out))
        .and_then(|saved| crate::stage::changes(&saved, run, &[]))
        .is_ok_and(|d| d.is_empty());
    same && read_dataset(out, false).is_ok_and(|(r, _)| r.len() == run.completions())
}

/// Refuses to extend `out` when it was sampled otherwise than `run` (or its record is missing);
/// records `run` beside a new (or empty) `out`.
fn check_run(out: &Path, run: &SampleRun) -> Result<()> {
    let file = run_file(out);
    let started = std::fs::metadata(out).is_ok_and(|m| m.len() > 0);
    if started {
        let saved = crate::stage::read_record(&file).with_context(|| {
            format!(
                "{} exists, and {} that records how it was sampled cannot be read (an older version, or another command, wrote it): use a new output file",
                out.display(),
                file.display()
            )
        })?;
        let mut differences = crate::stage::changes(&saved, run, &[])?;
        if differences.iter().any(|d| d.starts_with("prompts.")) {
            differences.push("(the problems or their prompts differ: another task, task seed, size, data file, prompt style or tokenizer)".into());
        }
        return crate::stage::refuse(out, crate::Resumable::Sampling, differences);
    }
    crate::stage::write_record(&file, run)
}

/// [`sample_dataset`] spread over the ranks of a process `group` (one process without one):
/// rank `r` of `n` samples shard `r/n` into [`shard_file`]`(out)` (resumable, like any data
/// set), the shards' files are gathered to rank 0 through the group, and rank 0 writes `out`
/// exactly as one process would; the shard files are then removed. When `out` is complete
/// already and was sampled with the same model, problems and settings (a rerun), nothing is
/// sampled. Returns the completions written by all ranks. With a group the group decides the
/// shard; without one, `settings.shard` does.
#[allow(clippy::too_many_arguments)]
pub fn sample_parallel(
    model: &Llama,
    tok: &Tokenizer,
    model_dir: &Path,
    problems: &[Problem],
    style: &PromptStyle,
    settings: &SampleSettings,
    out: &Path,
    group: Option<&ProcessGroup>,
) -> Result<usize> {
    let Some(g) = group else {
        return sample_dataset(model, tok, model_dir, problems, style, settings, out);
    };
    let whole = SampleSettings { shard: Shard::WHOLE, ..*settings };
    let prompts: Vec<Vec<i64>> = problems.iter().map(|p| prompt_ids(tok, style, p)).collect::<Result<_>>()?;
    let run = sample_run(model, model_dir, problems, &prompts, &whole)?;
    parallel::agree(group, "sampling", &run, &["model.path"])?;
    let done = g.is_main() && out.exists() && is_complete(out, &run);
    if parallel::main_says(group, done)? {
        return Ok(0);
    }
    let shard = parallel::shard(group);
    let part = shard_file(out, shard);
    let written =
        sample_dataset(model, tok, model_dir, problems, style, &SampleSettings { shard, ..*settings }, &part)?;
    let run_text = std::fs::read(run_file(&part)).with_context(|| format!("reading {}", run_file(&part).display()))?;
    let text = std::fs::read(&part).with_context(|| format!("reading {}", part.display()))?;
    let runs = parallel::gather_bytes(group, &run_text)?;
    let texts = parallel::gather_bytes(group, &text)?;
    if g.is_main() {
        let mut parts = vec![];
        let mut names = vec![];
        for (k, (run, text)) in runs.iter().zip(texts).enumerate() {
            let name = format!("shard {k}/{} of {}", g.world_size(), out.display());
            let run: SampleRun = serde_json::from_slice(run).with_context(|| format!("parsing the run of {name}"))?;
            let text = String::from_utf8(text).with_context(|| format!("{name}: not UTF-8"))?;
            let part = ShardPart { run, text };
            part.check(Path::new(&name))?;
            parts.push(part);
            names.push(name);
        }
        // What one process would have recorded: refuses an `out` started with other settings.
        check_run(out, &SampleRun { shard: None, ..parts[0].run.clone() })?;
        let _ = std::fs::remove_file(out);
        write_merged(parts, &names, out)?;
    }
    parallel::barrier(group)?;
    let _ = std::fs::remove_file(&part);
    let _ = std::fs::remove_file(run_file(&part));
    let mut total = [written as f64];
    parallel::sum(group, &mut total)?;
    Ok(total[0] as usize)
}
