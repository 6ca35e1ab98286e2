//! The self-taught loop: for each iteration, sample a data set with the current model as μ,
//! optionally curate it, train a copy off-policy, evaluate it on held-out problems. Each stage
//! leaves its output in `work/iter-N/`; rerunning the command skips finished stages, and an
//! interrupted sampling stage resumes where it stopped.

use crate::Refusal;
use crate::checkpoint::{self, Placement};
use crate::dataset;
use crate::eval::{self, EvalSettings};
use crate::generate::Decoding;
use crate::identity::{Digest, ModelId};
use crate::io::{Append, Lock};
pub use crate::layout::questions_file;
use crate::layout::{self, IterationDir, LoopDir};
use crate::metrics::IterationRecord;
use crate::parallel::{self, ProcessGroup};
use crate::sample;
use crate::settings::TrainSettings;
pub use crate::settings::{Curation, IterateSettings};
use crate::stage;
use crate::task::{self, PromptStyle};
use crate::train;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The loop's fixed inputs: where models are loaded, the problems and the held-out evaluation.
/// [`crate::compare`] uses it to train other objectives on an iteration's data.
pub(crate) struct Loop<'a> {
    at: Placement,
    /// The ranks the stages are spread over (`None`: one process).
    group: Option<&'a ProcessGroup>,
    s: &'a IterateSettings,
    problems: Vec<task::Problem>,
    style: PromptStyle,
    held_out: Vec<task::Problem>,
    /// The loop's initial model (its evaluation is the one shared through `s.shared`).
    initial: PathBuf,
    /// `s.shared`'s sub-folder for this loop's task, sampling and evaluation settings.
    shared: Option<PathBuf>,
}

impl<'a> Loop<'a> {
    /// The loop of `s`: its training problems and held-out problems loaded.
    pub(crate) fn new(
        at: Placement,
        group: Option<&'a ProcessGroup>,
        s: &'a IterateSettings,
        initial: &Path,
    ) -> Result<Self> {
        let (problems, style) = s.task.load()?;
        let held_out = task::held_out(&s.task, s.eval_data.as_deref(), s.eval_n, s.train.skip_bad_records)?;
        let shared = match &s.shared {
            Some(dir) => {
                // What the initial evaluation and the first data set depend on.
                let key = (
                    ModelId::of(initial)?,
                    crate::identity::Numerics::of(at),
                    &s.task,
                    &s.sampling,
                    s.samples_per_prompt,
                    s.batch_prompts,
                    s.train.seed,
                    &s.eval_data,
                    s.eval_n,
                    s.eval_batch_size,
                );
                Some(dir.join(Digest::of_records([key])?.hash))
            }
            None => None,
        };
        Ok(Self { at, group, s, problems, style, held_out, initial: initial.to_path_buf(), shared })
    }

    /// Evaluates the model in `dir` once (greedy); the summary is cached in `out`, the
    /// per-question results beside it ([`questions_file`]). With a group, the ranks share the
    /// questions and rank 0 writes both files.
    pub(crate) fn evaluate_cached(&self, dir: &Path, out: &Path) -> Result<eval::Summary> {
        self.evaluate_cached_with(dir, out, 0)
    }

    /// [`Loop::evaluate_cached`] with `samples` sampled completions a question beside the
    /// greedy one (sampled pass@1, maj@k, pass@k), drawn from the loop's sampling distribution.
    fn evaluate_cached_with(&self, dir: &Path, out: &Path, samples: usize) -> Result<eval::Summary> {
        // A summary already here (a restored work directory's) is not made again in the shared
        // folder.
        if dir == self.initial
            && !parallel::main_sees(self.group, || cached_summary(out, samples).is_some())?
            && let Some(name) = out.file_name()
            && let Some(shared) = self.shared_dir()?
        {
            let first = shared.join(name);
            let summary = self.evaluate_here(dir, &first, samples)?;
            parallel::on_main(self.group, || {
                stage::copy_finished(&questions_file(&first), &questions_file(out))?;
                stage::copy_finished(&first, out)
            })?;
            return Ok(summary);
        }
        self.evaluate_here(dir, out, samples)
    }

    /// This loop's shared folder (created if needed), if the loop has one.
    fn shared_dir(&self) -> Result<Option<PathBuf>> {
        let Some(dir) = &self.shared else { return Ok(None) };
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Some(dir.clone()))
    }

    fn evaluate_here(&self, dir: &Path, out: &Path, samples: usize) -> Result<eval::Summary> {
        if parallel::main_sees(self.group, || cached_summary(out, samples).is_some())? {
            return cached_summary(out, samples)
                .with_context(|| format!("reading {} (written by rank 0)", out.display()));
        }
        let (m, tok) = checkpoint::open(dir, self.at)?;
        let settings = EvalSettings {
            max_new_tokens: self.s.sampling.max_new_tokens,
            samples,
            sampling: match self.s.sampling.decoding {
                Decoding::Sample(p) => p,
                Decoding::Greedy => Default::default(),
            },
            batch_size: self.s.eval_batch_size,
            seed: 0,
            shard: crate::shard::Shard::WHOLE,
        };
        let questions = questions_file(out);
        let s =
            eval::evaluate_parallel(&m, &tok, &self.held_out, &self.style, &settings, Some(&questions), self.group)?;
        parallel::on_main(self.group, || crate::io::write_file(out, serde_json::to_string(&s)?))?;
        Ok(s)
    }

    /// Iteration `i`'s sampling (with μ from `mu_dir`) and training in `dir`, or the summary of
    /// its finished training. Sampling resumes and a finished data set is never regenerated; μ is
    /// loaded once, sampled from, then trained in place (it becomes π) and saved to `dir`'s model.
    fn sample_and_train(&self, i: usize, mu_dir: &Path, dir: &IterationDir) -> Result<train::Summary> {
        let data = dir.data();
        if parallel::main_sees(self.group, || dir.trained() && (data.exists() || dir.has_model()))? {
            return stage::read_done(&dir.done());
        }
        let s = self.s;
        let (m, tok) = checkpoint::open(mu_dir, self.at)?;
        let seed = (s.train.seed as i64).wrapping_add(1_000 * i as i64);
        // The first data set of loops sharing a folder is sampled there once (a finished one is
        // not sampled again), then copied here.
        let first = if i == 1 { self.shared_dir()?.map(|d| layout::shared_first_data(&d)) } else { None };
        let sampling = sample::SampleSettings {
            samples_per_prompt: s.samples_per_prompt,
            sampling: s.sampling,
            seed,
            batch_prompts: s.batch_prompts,
            shard: crate::shard::Shard::WHOLE,
        };
        let sample_to = first.as_deref().unwrap_or(&data);
        sample::sample_parallel(&m, &tok, mu_dir, &self.problems, &self.style, &sampling, sample_to, self.group)?;
        if let Some(first) = &first {
            parallel::on_main(self.group, || {
                stage::copy_finished(&dataset::run_file(first), &dataset::run_file(&data))?;
                stage::copy_finished(first, &data)
            })?;
            // Every rank trains on the copy rank 0 made.
            parallel::barrier(self.group)?;
        }
        self.train_on(Some(m), mu_dir, &data, &s.train, dir.path(), &dir.model())
    }

    /// Trains a copy of μ (`mu_dir`; `mu` when it is already loaded) on the data set `data` with
    /// `train` (the loop's curation applied), saves it to `model_dir` and marks `dir` finished;
    /// or returns the summary of the finished training.
    pub(crate) fn train_on(
        &self,
        mu: Option<crate::model::Llama>,
        mu_dir: &Path,
        data: &Path,
        train: &TrainSettings,
        dir: &Path,
        model_dir: &Path,
    ) -> Result<train::Summary> {
        let done = layout::done_file(dir);
        if parallel::main_sees(self.group, || done.exists())? {
            return stage::read_done(&done);
        }
        let m = match mu {
            Some(m) => m,
            None => checkpoint::open(mu_dir, self.at)?.0,
        };
        let samples =
            train::load_data(data, m.cfg.max_position_embeddings as usize, m.cfg.vocab_size, train.skip_bad_records)?;
        let samples = self.s.curate.apply(samples);
        let record = train::RunRecord::new(mu_dir, self.at, data, &samples, train)?;
        let summary = train::run(&m, &samples, train, &record, dir, self.group)?;
        parallel::on_main(self.group, || {
            checkpoint::save(&m, mu_dir, model_dir)?;
            train::finish(dir);
            stage::write_done(&done, &summary)
        })?;
        // The next stage loads the saved model on every rank.
        parallel::barrier(self.group)?;
        Ok(summary)
    }
}

impl Loop<'_> {
    /// Rebuilds the models that the loop's first unfinished iteration starts from where only
    /// their records remain: a work directory restored from its committed records (settings,
    /// done markers, evaluations, metrics; never weights or data sets) on another machine.
    /// Each missing model is trained again from its μ on its data set, sampled again where it
    /// is missing (the seeds of the records give the same data), and the training's summary is
    /// compared with the recorded one. When they differ (other code, other numerics), that
    /// iteration's evaluation and every later iteration are dropped and made again from the
    /// rebuilt model, so that no record mixes two models.
    fn rebuild_missing(&self, work: &LoopDir, mut table: Option<&mut Table>) -> Result<()> {
        // A rebuild that a kill stopped after its training is settled first.
        self.settle_rebuilt(work, table.as_deref_mut())?;
        let Some(open) = self.first_unfinished(work)? else { return Ok(()) };
        // The open iteration needs μ (iteration open − 1), and its own model when only its
        // evaluation is missing or when it was being trained again from its records.
        let it = work.iteration(open);
        let last =
            if parallel::main_sees(self.group, || it.trained() || it.recorded().exists())? { open } else { open - 1 };
        self.ensure_models(work, last, table)
    }

    /// Puts the models of iterations 1 to `upto` back on disk where only their records remain
    /// (see [`Loop::rebuild_missing`]).
    fn ensure_models(&self, work: &LoopDir, upto: usize, mut table: Option<&mut Table>) -> Result<()> {
        let at = |i: usize| work.iteration(i);
        let mut start = 1;
        for k in (1..=upto).rev() {
            if parallel::main_sees(self.group, || at(k).has_model())? {
                start = k + 1;
                break;
            }
        }
        for k in start..=upto {
            let mu = if k == 1 { self.initial.clone() } else { at(k - 1).model() };
            self.rebuild(k, &mu, &at(k))?;
            if self.settle_rebuilt(work, table.as_deref_mut())? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Settles a rebuilt iteration whose recorded summary is still set aside (the rebuild just
    /// trained it, or a kill stopped the clean-up after it): the record goes only once the
    /// iteration's evaluation and the later iterations are dropped when the training differs
    /// from it, so that a kill at any moment leaves a state that settles the same way. Whether
    /// they were dropped.
    fn settle_rebuilt(&self, work: &LoopDir, table: Option<&mut Table>) -> Result<bool> {
        for k in 1..=self.s.iterations {
            let it = work.iteration(k);
            let (done, kept) = (it.done(), it.recorded());
            if !parallel::main_sees(self.group, || kept.exists() && done.exists() && it.has_model())? {
                continue;
            }
            let (recorded, now): (serde_json::Value, serde_json::Value) =
                (stage::read_done(&kept)?, stage::read_done(&done)?);
            let same = now == recorded;
            if parallel::is_main(self.group) {
                match same {
                    true => eprintln!("iteration {k}: rebuilt, the same training as recorded"),
                    false => eprintln!(
                        "iteration {k}: rebuilt, but its training differs from the record (recorded {recorded}, now {now}): its evaluation and the later iterations are made again"
                    ),
                }
            }
            if !same {
                self.forget_from(work, k, table)?;
            }
            parallel::on_main(self.group, || {
                std::fs::remove_file(&kept).with_context(|| format!("removing {}", kept.display()))
            })?;
            parallel::barrier(self.group)?;
            return Ok(!same);
        }
        Ok(false)
    }

    /// The first iteration that is not trained and evaluated, if any (one whose training was
    /// being made again from its records counts as finished: its records are all there).
    fn first_unfinished(&self, work: &LoopDir) -> Result<Option<usize>> {
        for i in 1..=self.s.iterations {
            let it = work.iteration(i);
            let recorded = || it.finished() || (it.recorded().exists() && it.eval().exists());
            if !parallel::main_sees(self.group, recorded)? {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// Trains iteration `i` again from μ in `mu_dir` (see [`Loop::rebuild_missing`]), its
    /// recorded summary set aside for [`Loop::settle_rebuilt`] to compare.
    fn rebuild(&self, i: usize, mu_dir: &Path, dir: &IterationDir) -> Result<()> {
        // The recorded summary is set aside (not removed) until the training is made again: a
        // rebuild that stops half-way is taken up again and still compared.
        let (done, kept) = (dir.done(), dir.recorded());
        parallel::on_main(self.group, || match kept.exists() {
            true => Ok(()),
            false => std::fs::rename(&done, &kept).with_context(|| format!("moving {}", done.display())),
        })?;
        parallel::barrier(self.group)?;
        if parallel::is_main(self.group) {
            eprintln!(
                "iteration {i}: its records are here but not its model; training it again from {}",
                mu_dir.display()
            );
        }
        self.sample_and_train(i, mu_dir, dir)?;
        Ok(())
    }

    /// Drops iteration `k`'s evaluations and every later iteration (folders and table rows):
    /// the rows first, each later iteration's done marker before its folder, so that a kill
    /// half-way leaves nothing that passes for finished ([`Loop::settle_rebuilt`] then does it
    /// again).
    fn forget_from(&self, work: &LoopDir, k: usize, table: Option<&mut Table>) -> Result<()> {
        parallel::on_main(self.group, || {
            table.map_or(Ok(()), |t| t.drop_from(k))?;
            for j in (k + 1..=self.s.iterations).rev() {
                let later = work.iteration(j);
                if later.path().exists() {
                    let _ = std::fs::remove_file(later.done());
                    std::fs::remove_dir_all(later.path())
                        .with_context(|| format!("removing {}", later.path().display()))?;
                }
            }
            let it = work.iteration(k);
            let evaluations = std::fs::read_dir(it.path())?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("eval")));
            for f in evaluations {
                std::fs::remove_file(&f).with_context(|| format!("removing {}", f.display()))?;
            }
            Ok(())
        })?;
        parallel::barrier(self.group)
    }
}

/// The summary cached in `out`, if it is one with `samples` sampled completions a question.
fn cached_summary(out: &Path, samples: usize) -> Option<eval::Summary> {
    std::fs::read_to_string(out)
        .ok()
        .and_then(|t| serde_json::from_str::<eval::Summary>(&t).ok())
        .filter(|c| c.samples_per_question == samples)
}

/// The record of the loop in `work` (`settings.json`), as a resumed loop compares it.
pub fn read_run(work: &Path) -> Result<IterateRun> {
    let file = LoopDir::new(work).settings();
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("reading {} (is {} an `iterate` work directory?)", file.display(), work.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))
}

/// What a loop was started from and with, recorded in `work/settings.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IterateRun {
    /// The initial model.
    pub model: ModelId,
    /// The dtype, device kind and kernels of every stage (absent from older records: f32 on
    /// the CPU, the default kernels).
    #[serde(default)]
    pub numerics: crate::identity::Numerics,
    /// The settings, as fields of the record (`iterations`, `train.lr`, ...).
    #[serde(flatten)]
    pub settings: IterateSettings,
}

/// Fields of [`IterateRun`] a resumed loop may change.
const MAY_CHANGE: [&str; 1] = ["iterations"];

/// Refuses to continue the loop in `work` with other inputs or settings than it was started
/// with (listing what differs), or one whose record is missing; records `run` in a new loop.
fn check_run(work: &Path, started: bool, run: &IterateRun) -> Result<()> {
    let file = LoopDir::new(work).settings();
    if !started {
        return stage::write_record(&file, run);
    }
    let saved = stage::read_record(&file).with_context(|| {
        format!(
            "{} holds an earlier run without the record of its settings ({} cannot be read; an older version wrote it), so resuming it cannot be checked: choose another work directory",
            work.display(),
            file.display()
        )
    })?;
    stage::check(&saved, run, &MAY_CHANGE, work, crate::Resumable::Iterations)
}

/// `iterations.jsonl`: the rows already there are kept as they are (a resumed loop with fewer
/// iterations does not drop later ones); a row is appended, checked and flushed, when its
/// iteration is evaluated.
struct Table {
    rows: Vec<IterationRecord>,
    file: Append,
    path: PathBuf,
}

impl Table {
    /// Opens the table; a last row cut short by an interrupted append is dropped (the loop adds
    /// the row of every iteration it passes, finished ones from their records, so it comes back).
    fn open(path: &Path) -> Result<Self> {
        let mut rows = vec![];
        if path.exists() {
            let mut bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            if crate::io::drop_cut_line(&mut bytes) {
                eprintln!("{}: dropping its last row, cut short by an interrupted write", path.display());
                crate::io::write_file(path, &bytes)?;
            }
            rows = crate::metrics::read_jsonl(path)?;
        }
        Ok(Self { rows, file: Append::open(path)?, path: path.to_path_buf() })
    }

    /// Drops the rows of iteration `k` and later (their iterations are made again).
    fn drop_from(&mut self, k: usize) -> Result<()> {
        self.rows.retain(|r| r.iteration < k);
        let mut text = String::new();
        for r in &self.rows {
            text.push_str(&serde_json::to_string(r)?);
            text.push('\n');
        }
        crate::io::write_file(&self.path, text)?;
        self.file = Append::open(&self.path)?;
        Ok(())
    }

    fn add(&mut self, row: IterationRecord) -> Result<()> {
        if self.rows.iter().any(|r| r.iteration == row.iteration) {
            return Ok(());
        }
        self.file.line(&serde_json::to_string(&row)?)?;
        self.rows.push(row);
        Ok(())
    }
}

/// Runs (or, with `s.train.resume`, continues) the loop from the model in `model`, loaded with
/// `at`; writes `iterations.jsonl` and `iterations.png` to `s.work` and prints the table.
///
/// Refused before anything is written: a work directory that is, contains or lies inside
/// `model`; one in use by another run (it is locked while this one runs); an earlier loop without
/// `resume`, or one started with other settings.
///
/// With a process `group`, every rank runs this with the same arguments: sampling and
/// evaluation are sharded over the ranks and training is data-parallel ([`crate::parallel`]);
/// rank 0 writes `s.work`, which must be on a file system every rank sees (each stage loads
/// the model the previous one saved).
pub fn run(model: &Path, at: Placement, s: &IterateSettings, group: Option<&ProcessGroup>) -> Result<()> {
    crate::io::refuse_overlap(model, &s.work, "work directory")?;
    s.curate.check()?;
    // The inputs first: a bad data file or model is reported before anything is written.
    let lp = Loop::new(at, group, s, model)?;
    let run =
        IterateRun { model: ModelId::of(model)?, numerics: crate::identity::Numerics::of(at), settings: s.clone() };
    parallel::agree(group, "iterate", &run, &["model.path"])?;
    let _lock = parallel::on_main(group, || {
        std::fs::create_dir_all(&s.work).with_context(|| format!("creating {}", s.work.display()))?;
        let lock = Lock::dir(&s.work)?;
        let started = LoopDir::new(&s.work).started();
        if started && !s.train.resume {
            bail!(Refusal::EarlierIterations(s.work.clone()));
        }
        check_run(&s.work, started, &run)?;
        Ok(lock)
    })?;
    // The others start once rank 0 has accepted the work directory.
    parallel::barrier(group)?;
    if !parallel::is_main(group) {
        return run_stages(&lp, model, None);
    }
    let mut table = Table::open(&LoopDir::new(&s.work).table())?;
    run_stages(&lp, model, Some(&mut table))?;
    crate::plot::report("iterations", || crate::plot::plot_iterations(&s.work));
    print_table(&table.rows);
    Ok(())
}

/// The loop's stages, on every rank; rank 0 keeps the `table` (the others pass `None`).
fn run_stages(lp: &Loop, model: &Path, mut table: Option<&mut Table>) -> Result<()> {
    let s = lp.s;
    let say = |line: String| {
        if parallel::is_main(lp.group) {
            eprintln!("{line}");
        }
    };
    let work = LoopDir::new(&s.work);
    lp.rebuild_missing(&work, table.as_deref_mut())?;
    let mut add = |row: IterationRecord| table.as_deref_mut().map_or(Ok(()), |t| t.add(row));
    let before = lp.evaluate_cached(model, &work.initial_eval())?;
    add(IterationRecord {
        accuracy: before.pass1_greedy,
        data_positive_fraction: None,
        invalid_rate: before.invalid_rate_greedy,
        iteration: 0,
        p_tilde: None,
        settings: Some(s.clone()),
        truncated_fraction_neg: None,
    })?;
    say(format!(
        "iteration 0 (initial model): held-out pass@1 {:.3}, invalid {:.3}",
        before.pass1_greedy, before.invalid_rate_greedy
    ));
    let mut mu_dir = model.to_path_buf();
    for i in 1..=s.iterations {
        let dir = work.iteration(i);
        std::fs::create_dir_all(dir.path()).with_context(|| format!("creating {}", dir.path().display()))?;
        // A finished iteration's records stand for it (its model may not be here: see
        // `Loop::rebuild_missing`).
        let summary = match parallel::main_sees(lp.group, || dir.finished())? {
            true => stage::read_done(&dir.done())?,
            false => lp.sample_and_train(i, &mu_dir, &dir)?,
        };
        let e = lp.evaluate_cached(&dir.model(), &dir.eval())?;
        let opt = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
        say(format!(
            "iteration {i}: held-out pass@1 {:.3}, invalid {:.3}, data {:.1}% positive, p~ {}, truncated (neg) {}",
            e.pass1_greedy,
            e.invalid_rate_greedy,
            100.0 * summary.positive_fraction,
            opt(summary.p_tilde),
            opt(summary.truncated_fraction_neg)
        ));
        add(IterationRecord {
            accuracy: e.pass1_greedy,
            data_positive_fraction: Some(summary.positive_fraction),
            invalid_rate: e.invalid_rate_greedy,
            iteration: i,
            p_tilde: summary.p_tilde,
            settings: Some(s.clone()),
            truncated_fraction_neg: summary.truncated_fraction_neg,
        })?;
        mu_dir = dir.model();
    }
    Ok(())
}

/// The held-out evaluation of the loop `s` at `iteration` (0: its initial model `model`; the
/// iteration must be finished) with `k` sampled completions a question from the loop's sampling
/// distribution beside the greedy one: sampled pass@1, maj@k and pass@k. Made once and cached in
/// [`LoopDir::sampled_eval`] (in the shared folder, when the loop has one), the per-question
/// results beside it ([`questions_file`], which this returns). One process.
pub fn evaluate_sampled(
    model: &Path,
    at: Placement,
    s: &IterateSettings,
    iteration: usize,
    k: usize,
) -> Result<(eval::Summary, PathBuf)> {
    let lp = Loop::new(at, None, s, model)?;
    let work = LoopDir::new(&s.work);
    let out = work.sampled_eval(iteration, k);
    let dir = if iteration == 0 {
        model.to_path_buf()
    } else {
        let it = work.iteration(iteration);
        if !it.trained() {
            bail!("iteration {iteration} of {} is not finished: nothing to evaluate", s.work.display());
        }
        if cached_summary(&out, k).is_none() && !it.has_model() {
            let mut table = Table::open(&work.table())?;
            lp.ensure_models(&work, iteration, Some(&mut table))?;
            if !it.finished() {
                bail!(
                    "iteration {iteration} of {} was trained again from its records and came out otherwise: rerun the loop, which makes it and its evaluation again",
                    s.work.display()
                );
            }
        }
        it.model()
    };
    let summary = lp.evaluate_cached_with(&dir, &out, k)?;
    Ok((summary, questions_file(&out)))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop recorded before a setting existed resumes under a version that has it (the field
    /// absent from `settings.json` reads as its default, "off"); a changed setting is refused.
    #[test]
    fn a_record_without_newer_settings_resumes() {
        let work = std::env::temp_dir().join(format!("iterate_check_run_{}", std::process::id()));
        std::fs::create_dir_all(&work).unwrap();
        let settings = crate::demo::iterate_settings(
            work.clone(),
            crate::demo::Scale::quick(),
            0,
            crate::demo::topr_settings().unwrap(),
        );
        let run = IterateRun {
            model: ModelId { path: "m".into(), config: "c".into(), weights: Default::default(), content: None },
            numerics: Default::default(),
            settings,
        };
        let mut old = serde_json::to_value(&run).unwrap();
        for key in ["dpo_mix", "off_policy_mask", "rejection", "rollout_correction", "kl_coef"] {
            assert!(old["train"].as_object_mut().unwrap().remove(key).is_some(), "{key}");
        }
        std::fs::write(work.join("settings.json"), old.to_string()).unwrap();
        check_run(&work, true, &run).unwrap();
        let mut changed = run.clone();
        changed.settings.train.lr *= 2.0;
        let err = check_run(&work, true, &changed).unwrap_err();
        assert!(format!("{err:#}").contains("train.lr"), "{err:#}");
        let _ = std::fs::remove_dir_all(&work);
    }
}
