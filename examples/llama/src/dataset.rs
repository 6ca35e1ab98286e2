//! The data-set record and its files: one JSON line per completion ([`Sample`], with its
//! sampling settings [`SamplingRecord`]), the record of how a data set was sampled
//! ([`SampleRun`], in `OUT.run.json` beside it), the checked reader, the shard files and their
//! byte-for-byte merge, and the teacher's worked solutions written as a data set. The sampler
//! that makes them is [`crate::sample`].

use crate::generate;
use crate::identity::{Digest, ModelId};
use crate::shard::Shard;
use crate::task::{self, Problem, PromptStyle, prompt_ids};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
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
pub(crate) enum CutLine {
    /// An error, or with `skip_bad` skipped and counted like any malformed record.
    Refuse,
    /// Dropped quietly, whole or not (its bytes before decoding, so that a cut inside a character
    /// is no error): the sampler resuming its own interrupted file writes it again.
    Resume,
}

/// Reads a data set written by [`crate::sample::sample_dataset`] or [`write_solutions`], checking every record
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
pub(crate) fn read_records(
    path: &Path,
    vocab: Option<i64>,
    skip_bad: bool,
    cut: CutLine,
) -> Result<(Vec<(String, Sample)>, usize)> {
    crate::io::refuse_device(path)?;
    let mut text = std::fs::read(path).with_context(|| format!("opening {}", path.display()))?;
    // A line cut short by an interrupted write may end inside a character: when that line is to
    // be dropped anyway, it goes before the text is decoded.
    if cut == CutLine::Resume {
        crate::io::drop_cut_line(&mut text);
    }
    let text = String::from_utf8(text).map_err(|e| {
        anyhow::anyhow!("{}: not UTF-8 text (byte {} of the file)", path.display(), e.utf8_error().valid_up_to())
    })?;
    parse_records(path, &text, vocab, skip_bad, cut)
}

/// [`read_records`] of the text of `path`.
pub(crate) fn parse_records(
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
    /// How the random draws were made (absent in a record of an earlier version: [`Streams::Batch`]).
    #[serde(default)]
    pub streams: Streams,
    /// The shard this file holds (absent: the whole data set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
    /// μ's dtype, device kind and kernels (absent from older records: f32 on the CPU, the
    /// default kernels).
    #[serde(default)]
    pub numerics: crate::identity::Numerics,
}

/// How a data set's completions drew their random numbers: a file is only ever extended by the
/// same scheme, since another draws other completions from the same seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Streams {
    /// Versions before continuous batching: libtorch's generator, reseeded with the seed plus the
    /// index of the first prompt of each batch.
    #[default]
    Batch,
    /// One stream per completion, keyed by the seed, the prompt's index in the task and the
    /// sample's number ([`crate::generate::Stream`]): the same in every shard and every resume.
    PerCompletion,
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

    /// The run record of the data set `data` (its [`run_file`]).
    pub fn read(data: &Path) -> Result<Self> {
        let file = run_file(data);
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))
    }

    /// The completions a finished file of this run holds: its shard's problems times the
    /// samples per prompt.
    pub fn completions(&self) -> usize {
        self.shard_problems().len() * self.samples_per_prompt
    }
}

/// Refuses the data set `path` holding `records` records when its run record (`OUT.run.json`,
/// written by `sample`) counts more: an interrupted `sample` left it, and training on it would
/// train on its first prompts only. A data set without a readable run record (written by hand,
/// or by `sft-data`) is taken as it is.
pub fn refuse_unfinished(path: &Path, records: usize) -> Result<()> {
    let Ok(run) = SampleRun::read(path) else { return Ok(()) };
    let want = run.completions();
    if records < want {
        bail!(crate::Refusal::UnfinishedData { path: path.to_path_buf(), have: records, want });
    }
    Ok(())
}

/// The file beside a data set `out` that records how it was sampled.
pub fn run_file(out: &Path) -> PathBuf {
    crate::io::with_suffix(out, ".run.json")
}

/// The file shard `shard` of a data set `out` is sampled into when [`crate::sample::sample_parallel`] runs it
/// as one rank of a group: `OUT.shard-I-of-N`.
pub fn shard_file(out: &Path, shard: Shard) -> PathBuf {
    crate::io::with_suffix(out, &format!(".shard-{}-of-{}", shard.index, shard.count))
}

/// One shard's file as it will be merged: its run record and its lines.
pub(crate) struct ShardPart {
    pub(crate) run: SampleRun,
    pub(crate) text: String,
}

impl ShardPart {
    /// Reads and checks the shard file `path`: every record whole and valid, as many as its
    /// shard's problems times the samples per prompt.
    fn read(path: &Path) -> Result<Self> {
        let run = SampleRun::read(path)?;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let part = Self { run, text };
        part.check(path)?;
        Ok(part)
    }

    pub(crate) fn check(&self, path: &Path) -> Result<()> {
        let (records, _) = parse_records(path, &self.text, None, false, CutLine::Refuse)?;
        let want = self.run.completions();
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

pub(crate) fn write_merged(mut parts: Vec<ShardPart>, names: &[String], out: &Path) -> Result<usize> {
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
