//! Sampling a graded, off-policy data set: for each prompt of a task, `n` completions from the
//! model (μ), each with its token ids, μ's per-token and sequence log-probabilities, its reward and
//! the sampling settings, one JSON line per completion.
//!
//! The file is written batch by batch and flushed; a rerun with the same output resumes after the
//! last complete prompt and never regenerates what is there. Each batch reseeds the generator
//! from `seed` and the batch index, so a resumed run produces the same lines as an uninterrupted one.

use crate::generate::{self, Decoding, Sampling};
use crate::identity::{Digest, ModelId};
use crate::model::Llama;
use crate::parallel::{self, ProcessGroup};
use crate::shard::Shard;
use crate::task::{self, Problem, PromptStyle, prompt_ids};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The sampling settings recorded with every line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SamplingRecord {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    pub max_new_tokens: i64,
    pub seed: i64,
}

/// One sampled completion, as stored in the data set.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    pub id: String,
    pub sample: usize,
    pub question: String,
    pub prompt_ids: Vec<i64>,
    pub completion: String,
    pub completion_ids: Vec<i64>,
    /// `log μ(y_t)` under the model at temperature 1.
    pub logp_mu: Vec<f32>,
    /// `log q(y_t)` under the distribution actually sampled from (temperature, top-k, top-p).
    pub logp_sampling: Vec<f32>,
    pub seq_logp_mu: f64,
    pub seq_logp_sampling: f64,
    pub answer: Option<f64>,
    pub reference: f64,
    pub correct: bool,
    pub invalid: bool,
    /// +1 when correct, −1 otherwise (the paper's rewards).
    pub reward: f64,
    pub stop: generate::Stop,
    pub sampling: SamplingRecord,
}

impl Sample {
    /// Checks that the record can be trained on and scored: a non-empty prompt, as many μ
    /// log-probs as completion tokens, finite rewards and log-probs, and token ids in
    /// `0..vocab` (only `>= 0` when `vocab` is `None`). The error says what is wrong, without
    /// the file and line (the reader adds them).
    pub fn check(&self, vocab: Option<i64>) -> Result<()> {
        if self.prompt_ids.is_empty() {
            bail!("prompt_ids is empty (a completion needs a prompt to follow)");
        }
        for (field, ids) in [("prompt_ids", &self.prompt_ids), ("completion_ids", &self.completion_ids)] {
            let outside = |&&i: &&i64| i < 0 || vocab.is_some_and(|v| i >= v);
            if let Some((k, id)) = ids.iter().enumerate().find(|(_, i)| outside(i)) {
                match vocab {
                    Some(v) => bail!("{field}[{k}] = {id} lies outside the model's vocabulary (0..{v})"),
                    None => bail!("{field}[{k}] = {id} is not a token id (negative)"),
                }
            }
        }
        let n = self.completion_ids.len();
        // `logp_sampling` is recorded for the user and never read by training: only its values
        // are checked.
        if self.logp_mu.len() != n {
            bail!("logp_mu has {} values for {n} completion_ids", self.logp_mu.len());
        }
        for (field, lps) in [("logp_mu", &self.logp_mu), ("logp_sampling", &self.logp_sampling)] {
            if let Some((k, v)) = lps.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                bail!("{field}[{k}] = {v} is not finite (a log-probability; the value may overflow f32)");
            }
        }
        let scalars = [
            ("reward", self.reward),
            ("reference", self.reference),
            ("seq_logp_mu", self.seq_logp_mu),
            ("seq_logp_sampling", self.seq_logp_sampling),
            ("answer", self.answer.unwrap_or(0.0)),
        ];
        if let Some((field, v)) = scalars.iter().find(|(_, v)| !v.is_finite()) {
            bail!("{field} = {v} is not finite");
        }
        Ok(())
    }
}

/// What to do with a last line cut short (no end of line, not a whole record).
#[derive(Clone, Copy, PartialEq)]
enum CutLine {
    /// An error, or with `skip_bad` skipped and counted like any malformed record.
    Refuse,
    /// Dropped quietly: the sampler resuming its own interrupted file writes it again.
    Resume,
}

/// Reads a data set written by [`sample_dataset`] or [`write_solutions`], checking every record
/// ([`Sample::check`], token ids only for being non-negative). A malformed or inconsistent record
/// is an error naming the file and line (1-based), and so is a last line cut short (an
/// interrupted write); with `skip_bad` they are skipped, reported and counted (the second value).
pub fn read_dataset(path: &Path, skip_bad: bool) -> Result<(Vec<Sample>, usize)> {
    read_dataset_for(path, None, skip_bad)
}

/// [`read_dataset`] for a model with `vocab` token ids: ids outside `0..vocab` are refused too.
pub fn read_dataset_for(path: &Path, vocab: Option<i64>, skip_bad: bool) -> Result<(Vec<Sample>, usize)> {
    let (records, skipped) = read_records(path, vocab, skip_bad, CutLine::Refuse)?;
    Ok((records.into_iter().map(|(_, s)| s).collect(), skipped))
}

/// [`read_dataset`], keeping each record's line as it is in the file.
fn read_records(
    path: &Path,
    vocab: Option<i64>,
    skip_bad: bool,
    cut: CutLine,
) -> Result<(Vec<(String, Sample)>, usize)> {
    crate::io::refuse_device(path)?;
    let text = std::fs::read(path).with_context(|| format!("opening {}", path.display()))?;
    let text = String::from_utf8(text).map_err(|e| {
        anyhow::anyhow!("{}: not UTF-8 text (byte {} of the file)", path.display(), e.utf8_error().valid_up_to())
    })?;
    parse_records(path, &text, vocab, skip_bad, cut)
}

/// [`read_records`] of the text of `path`.
fn parse_records(
    path: &Path,
    text: &str,
    vocab: Option<i64>,
    skip_bad: bool,
    cut: CutLine,
) -> Result<(Vec<(String, Sample)>, usize)> {
    let ends_with_newline = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let last = lines.len();
    let mut out = vec![];
    let mut skipped = 0;
    for (n, line) in lines.into_iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), n + 1);
        let problem = match serde_json::from_str::<Sample>(line) {
            Ok(s) => match s.check(vocab) {
                Ok(()) => {
                    out.push((line.to_string(), s));
                    continue;
                }
                Err(e) => format!("invalid record: {e}"),
            },
            Err(_) if n + 1 == last && !ends_with_newline && cut == CutLine::Resume => continue,
            Err(e) if n + 1 == last && !ends_with_newline => {
                format!("the last record is cut short (an interrupted write?): {e}")
            }
            Err(e) => format!("malformed record: {e}"),
        };
        if !skip_bad {
            bail!("{at}: {problem}");
        }
        eprintln!("{at}: skipping: {problem}");
        skipped += 1;
    }
    Ok((out, skipped))
}

/// How a data set is sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSettings {
    /// Completions per prompt.
    pub samples_per_prompt: usize,
    /// A sampling distribution (greedy decoding is refused) and the token budget.
    pub sampling: Sampling,
    /// Each batch of prompts reseeds the generator with this plus the index of its first prompt.
    pub seed: i64,
    /// Prompts per generation batch (each with all its samples).
    pub batch_prompts: usize,
    /// The share of the batches this process samples ([`Shard::WHOLE`]: all). Shards are runs
    /// of whole batches, so each batch has the seed and the rows it has in a one-process run,
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

/// What a data set was sampled from, recorded in `OUT.run.json` beside it: a rerun that would
/// extend the file must match it field for field.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampleRun {
    /// μ: its directory, config hash and weight sizes.
    pub model: ModelId,
    /// The problems and their prompts (ids, questions, answers, prompt token ids): another task,
    /// seed, size, data file or prompt style changes it.
    pub prompts: Digest,
    pub problems: usize,
    pub samples_per_prompt: usize,
    pub batch_prompts: usize,
    pub sampling: SamplingRecord,
    /// The shard this file holds (absent: the whole data set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
}

impl SampleRun {
    /// The problems (indices into the task's list) the shard of this run covers: its share of
    /// the batches of `batch_prompts` prompts.
    pub fn shard_problems(&self) -> std::ops::Range<usize> {
        let bp = self.batch_prompts.max(1);
        let batches = self.problems.div_ceil(bp);
        let r = self.shard.unwrap_or(Shard::WHOLE).range(batches);
        (r.start * bp).min(self.problems)..(r.end * bp).min(self.problems)
    }
}

/// The file beside a data set `out` that records how it was sampled.
pub fn run_file(out: &Path) -> PathBuf {
    crate::io::with_suffix(out, ".run.json")
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
    let run = sample_run(model_dir, problems, &all_prompts, settings)?;
    check_run(out, &run)?;
    // This shard's problems (all of them for the whole): whole batches, seeded as in one process.
    let mine = run.shard_problems();
    let problems = &problems[mine.clone()];
    // Prompts are sampled in order, in batches of `batch_prompts`. What is there already is kept
    // up to the last whole batch whose prompts all have their `n` samples; the rest is redone, so
    // batches (and their seeds) are the same as in an uninterrupted run.
    let batch_prompts = batch_prompts.max(1);
    let mut start = 0;
    if out.exists() {
        // Kept lines are copied verbatim, never re-serialised.
        let existing = read_records(out, None, false, CutLine::Resume)?.0;
        let mut count: HashMap<&str, usize> = HashMap::new();
        for (_, smp) in &existing {
            if smp.sampling != record {
                bail!("{} was sampled with other settings ({:?}); use a new output file", out.display(), smp.sampling);
            }
            *count.entry(smp.id.as_str()).or_default() += 1;
        }
        let complete = problems.iter().take_while(|p| count.get(p.id.as_str()).copied().unwrap_or(0) >= n).count();
        // Shards start on a batch boundary, so rounding within the shard keeps the batches.
        start = if complete == problems.len() { complete } else { complete - complete % batch_prompts };
        let keep: std::collections::HashSet<&str> = problems[..start].iter().map(|p| p.id.as_str()).collect();
        crate::io::write_atomic(out, |w| {
            for (line, smp) in &existing {
                if keep.contains(smp.id.as_str()) {
                    writeln!(w, "{line}")?;
                }
            }
            Ok(())
        })?;
    }
    if start == problems.len() {
        if !out.exists() {
            // A shard with no batch (fewer batches than shards): its file is empty, and whole.
            crate::io::write_file(out, "")?;
        }
        eprintln!("{}: all {} prompts already sampled", out.display(), problems.len());
        return Ok(0);
    }
    // Indices into the whole task list: they seed the batches.
    let todo: Vec<(usize, &Problem)> =
        problems.iter().enumerate().skip(start).map(|(i, p)| (mine.start + i, p)).collect();
    let mut w = crate::io::Append::open(out)?;
    let pb = indicatif::ProgressBar::new((problems.len() * n) as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("sample [{bar:30}] {pos}/{len} completions {per_sec} ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb.inc(((problems.len() - todo.len()) * n) as u64);
    let mut written = 0;
    for chunk in todo.chunks(batch_prompts) {
        // Seeded by the position of its first problem: a resumed run reseeds as the original did.
        tch::manual_seed(seed.wrapping_add(chunk[0].0 as i64));
        let prompts: Vec<&Vec<i64>> = chunk.iter().map(|(i, _)| &all_prompts[*i]).collect();
        let rows: Vec<(usize, usize)> = (0..chunk.len()).flat_map(|i| (0..n).map(move |k| (i, k))).collect();
        let ids: Vec<Vec<i64>> = rows.iter().map(|(i, _)| prompts[*i].clone()).collect();
        // One batch is buffered (bounded), then written and flushed: a failed write stops here.
        let completions = generate::generate(model, &ids, &s, &tok.eos_ids, tok.pad_id)?;
        let mut buf = String::new();
        for ((i, k), c) in rows.iter().zip(completions) {
            let p = chunk[*i].1;
            let text = tok.decode(&c.tokens)?;
            let answer = task::extract_answer(&text);
            let correct = task::is_correct(answer, p.answer);
            let smp = Sample {
                id: p.id.clone(),
                sample: *k,
                question: p.question.clone(),
                prompt_ids: prompts[*i].clone(),
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
            };
            buf.push_str(&serde_json::to_string(&smp)?);
            buf.push('\n');
            written += 1;
        }
        w.write(buf.as_bytes())?;
        pb.inc(rows.len() as u64);
    }
    pb.finish_and_clear();
    Ok(written)
}

/// The record of sampling `problems` (with their prompts `prompts`) from the model of
/// `model_dir` with `settings`.
fn sample_run(
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
        shard: (!settings.shard.is_whole()).then_some(settings.shard),
    })
}

/// Whether `out` holds the whole data set `run` describes: its record equal to `run` and every
/// completion there (anything unreadable: no).
fn is_complete(out: &Path, run: &SampleRun) -> bool {
    let same = crate::stage::read_record(&run_file(out))
        .and_then(|saved| crate::stage::changes(&saved, run, &[]))
        .is_ok_and(|d| d.is_empty());
    same && read_dataset(out, false).is_ok_and(|(r, _)| r.len() == run.problems * run.samples_per_prompt)
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

/// The file shard `shard` of a data set `out` is sampled into when [`sample_parallel`] runs it
/// as one rank of a group: `OUT.shard-I-of-N`.
pub fn shard_file(out: &Path, shard: Shard) -> PathBuf {
    crate::io::with_suffix(out, &format!(".shard-{}-of-{}", shard.index, shard.count))
}

/// One shard's file as it will be merged: its run record and its lines.
struct ShardPart {
    run: SampleRun,
    text: String,
}

impl ShardPart {
    /// Reads and checks the shard file `path`: every record whole and valid, as many as its
    /// shard's problems times the samples per prompt.
    fn read(path: &Path) -> Result<Self> {
        let file = run_file(path);
        let run: SampleRun = serde_json::from_str(
            &std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?,
        )
        .with_context(|| format!("parsing {}", file.display()))?;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let part = Self { run, text };
        part.check(path)?;
        Ok(part)
    }

    fn check(&self, path: &Path) -> Result<()> {
        let (records, _) = parse_records(path, &self.text, None, false, CutLine::Refuse)?;
        let want = self.run.shard_problems().len() * self.run.samples_per_prompt;
        if records.len() != want {
            bail!(
                "{}: {} of its {want} completions are sampled (an unfinished shard: rerun its `sample`)",
                path.display(),
                records.len()
            );
        }
        Ok(())
    }
}

/// Joins the files of shards `0/n … n−1/n` of one data set (each written by `sample` with a
/// shard, in any order) into `out` and its run record, exactly as one process sampling the
/// whole writes them. Refused: shards of different runs (models, problems or settings), a
/// shard missing or given twice, an unfinished shard, and an `out` that exists already. Returns
/// the number of completions written.
pub fn merge_shards(shards: &[PathBuf], out: &Path) -> Result<usize> {
    crate::io::refuse_special(out)?;
    let parts = shards.iter().map(|p| ShardPart::read(p)).collect::<Result<Vec<_>>>()?;
    let names: Vec<String> = shards.iter().map(|p| p.display().to_string()).collect();
    write_merged(parts, &names, out)
}

fn write_merged(mut parts: Vec<ShardPart>, names: &[String], out: &Path) -> Result<usize> {
    if std::fs::metadata(out).is_ok_and(|m| m.len() > 0) {
        bail!("{} exists: merged shards go to a new file (remove it, or choose another)", out.display());
    }
    let Some(first) = parts.first() else { bail!("no shard to merge") };
    let count = first.run.shard.unwrap_or(Shard::WHOLE).count;
    let whole = SampleRun { shard: None, ..first.run.clone() };
    let mut seen = vec![None; count];
    for (part, name) in parts.iter().zip(names) {
        let shard = part.run.shard.unwrap_or(Shard::WHOLE);
        let same = SampleRun { shard: None, ..part.run.clone() };
        let differences = crate::stage::changes(&serde_json::to_value(&whole)?, &same, &[])?;
        if !differences.is_empty() {
            bail!("{name} and {} were sampled by different runs: {}", names[0], differences.join(", "));
        }
        if shard.count != count {
            bail!("{name} is shard {shard}, {} is one of {count}", names[0]);
        }
        if let Some(other) = seen[shard.index].replace(name) {
            bail!("{name} and {other} are both shard {shard}");
        }
    }
    if let Some(i) = seen.iter().position(Option::is_none) {
        bail!("shard {i}/{count} is missing");
    }
    parts.sort_by_key(|p| p.run.shard.map_or(0, |s| s.index));
    let _lock = crate::io::Lock::file(out)?;
    let mut written = 0;
    crate::io::write_atomic(out, |w| {
        for p in &parts {
            w.write_all(p.text.as_bytes())?;
            written += p.text.lines().filter(|l| !l.trim().is_empty()).count();
        }
        Ok(())
    })?;
    crate::stage::write_record(&run_file(out), &whole)?;
    Ok(written)
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
    let done = g.is_main() && out.exists() && {
        let whole = SampleSettings { shard: Shard::WHOLE, ..*settings };
        let prompts: Vec<Vec<i64>> = problems.iter().map(|p| prompt_ids(tok, style, p)).collect::<Result<_>>()?;
        is_complete(out, &sample_run(model_dir, problems, &prompts, &whole)?)
    };
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

/// Writes the worked solutions of `problems` as a data set in the same format, for supervised
/// warm-up (`train --objective sft`): each completion is the solution followed by the first EOS
/// token, with reward +1. μ's log-probs are recorded as 0: the SFT objective gives positives
/// weight 1 whatever the ratio, so they are never used.
///
/// With `slip_rate > 0`, that share of the solutions (drawn with `seed`) comes from a sloppy
/// teacher ([`task::slipped_solution`]): they are still demonstrations (reward +1), but graded
/// as they are (`correct`, `answer`), so the data set says how good its teacher was.
pub fn write_solutions(
    tok: &Tokenizer,
    problems: &[Problem],
    style: &PromptStyle,
    out: &Path,
    slip_rate: f64,
    seed: u64,
) -> Result<usize> {
    if !(0.0..=1.0).contains(&slip_rate) {
        bail!("the slip rate must lie in [0, 1], got {slip_rate}");
    }
    crate::io::write_atomic(out, |w| write_solution_lines(w, tok, problems, style, slip_rate, seed))?;
    Ok(problems.len())
}

fn write_solution_lines(
    w: &mut impl Write,
    tok: &Tokenizer,
    problems: &[Problem],
    style: &PromptStyle,
    slip_rate: f64,
    seed: u64,
) -> Result<()> {
    let mut rng = task::Rng::new(seed.wrapping_add(0x5EED));
    let eos = *tok.eos_ids.first().context("the tokenizer has no EOS id")?;
    let record = SamplingRecord { temperature: 0.0, top_p: 1.0, top_k: 0, max_new_tokens: 0, seed: 0 };
    for p in problems {
        let slip = slip_rate > 0.0 && rng.uniform() < slip_rate;
        let text = match slip {
            true => task::slipped_solution(&p.solution)
                .with_context(|| format!("{}: no answer line to slip in its solution", p.id))?,
            false => p.solution.clone(),
        };
        let answer = task::extract_answer(&text);
        let mut ids = tok.encode(&text, false)?;
        ids.push(eos);
        let smp = Sample {
            id: p.id.clone(),
            sample: 0,
            question: p.question.clone(),
            prompt_ids: prompt_ids(tok, style, p)?,
            completion: text.clone(),
            logp_mu: vec![0.0; ids.len()],
            logp_sampling: vec![0.0; ids.len()],
            completion_ids: ids,
            seq_logp_mu: 0.0,
            seq_logp_sampling: 0.0,
            answer,
            reference: p.answer,
            correct: task::is_correct(answer, p.answer),
            invalid: answer.is_none(),
            reward: 1.0,
            stop: generate::Stop::Eos,
            sampling: record.clone(),
        };
        writeln!(w, "{}", serde_json::to_string(&smp)?)?;
    }
    Ok(())
}
