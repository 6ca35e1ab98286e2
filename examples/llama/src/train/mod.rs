//! Off-policy training of the model on a sampled data set: the reference way to use
//! `topr-loss` in a loop. Objectives: the TOPR family (TOPR, TIS, SFT, naive REINFORCE, IS),
//! PPO-clip and GRPO on μ's log-probs as the old policy, and DPO on pairs built from the correct
//! and incorrect completions of each prompt.
//!
//! One optimiser step takes `batch_size` completions, split into micro-batches of
//! `micro_batch_size`. The aggregation counts (`Normalizer`, or the number of DPO pairs) are those
//! of the whole step, so the accumulated gradient does not depend on the micro-batch size
//! (tested for every objective). Log-probabilities come from the crate's chunked path
//! (`backward_through_logprobs`), so no float32 copy of the `[B, T, V]` logits is kept for the
//! backward pass.
//!
//! With a state directory, the model, the optimiser state and the position in the data are saved
//! every `save_every` steps (atomically: a kill leaves the previous state whole), and a rerun
//! resumes there, taking the same steps as an uninterrupted run.

mod batch;
mod objective;
mod state;
mod units;

pub use crate::metrics::{StepStats, ToprStats};
pub use crate::settings::{Advantage, Baseline, DpoLoss, KlEstimatorSetting, Objective, SettingError, TrainSettings};
pub use batch::{StepAt, accumulate, clip_grad_norm, learning_rate};
pub use objective::{Extras, Loss, p_tilde, resolve_baseline};
pub use units::{MicroBatch, Unit, micro_batch, units, units_with};

use crate::Refusal;
use crate::checkpoint::{self, Placement};
use crate::dataset::Sample;
use crate::identity::{Digest, FileId, ModelId, Numerics};
use crate::metrics::StepRecord;
use crate::model::Llama;
use crate::optim::Optimizer;
use crate::parallel::{self, ProcessGroup};
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use state::{MetricsLog, Progress, StateDir};
use std::path::Path;
use tch::Tensor;

impl TrainSettings {
    /// What every token-level loss of a step gets besides its own terms.
    pub fn extras(&self) -> Extras {
        Extras {
            // The settings record the method; the losses of a step run without host reads.
            correction: self.rollout_correction.map(|c| c.with_checks(topr_loss::Checks::Shapes)),
            rejection: self.rejection.clone(),
            off_policy_mask: self.off_policy_mask,
            top_entropy: self.top_entropy,
            kl: (self.kl_coef > 0.0).then(|| self.kl_estimator.config(self.kl_coef)),
            positive_nll: (self.positive_nll > 0.0).then(|| {
                topr_loss::PositiveNllConfig::vapo().with_coef(self.positive_nll).with_checks(topr_loss::Checks::Shapes)
            }),
            entropy: (self.entropy_coef > 0.0).then(|| {
                topr_loss::EntropyConfig::bonus().with_coef(self.entropy_coef).with_checks(topr_loss::Checks::Shapes)
            }),
        }
    }
}

/// What a training run is made from, recorded with its saved state: a resumed run must match it
/// field for field (the refusal lists what differs).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    /// The model trained (its directory, config hash and weight sizes).
    pub model: ModelId,
    /// The data file read.
    pub data: FileId,
    /// The records trained on (after skipping bad records and any curation).
    pub records: Digest,
    /// The dtype, device kind and kernels of the training (absent from older records: f32 on
    /// the CPU, the default kernels).
    #[serde(default)]
    pub numerics: Numerics,
    /// The settings, as fields of the record (`lr`, `objective`, ...).
    #[serde(flatten)]
    pub settings: TrainSettings,
}

impl RunRecord {
    /// The record of training the model of `model_dir`, loaded `at`, on `samples`, read from
    /// `data`.
    pub fn new(model_dir: &Path, at: Placement, data: &Path, samples: &[Sample], o: &TrainSettings) -> Result<Self> {
        Ok(Self {
            model: ModelId::of(model_dir)?,
            data: FileId::of(data)?,
            records: Digest::of_records(samples)?,
            numerics: Numerics::of(at),
            settings: o.clone(),
        })
    }
}

/// The fields of a [`RunRecord`] the ranks of a group may hold differently: where each finds its
/// copy of the model and of the data (their contents are compared).
pub(crate) const PATHS: [&str; 2] = ["model.path", "data.path"];

/// What a training run did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub objective: String,
    pub completions: usize,
    pub positive_fraction: f64,
    pub baseline: f64,
    /// The effective positive proportion `p̃` (rewards ±1, baseline c; 1 for SFT, which gives
    /// negatives no weight; `None` for GRPO and DPO, whose weights are not `R − c`).
    pub p_tilde: Option<f64>,
    pub steps: usize,
    pub final_loss: f64,
    /// Mean over steps of the truncated fraction of the negative branch (TOPR family).
    pub truncated_fraction_neg: Option<f64>,
}

/// Reads a data set for training a model of `vocab` token ids and a context of `context`:
/// malformed or inconsistent records (see [`Sample::check`]), token ids outside the vocabulary
/// and completions longer than the context are errors naming the record, or are skipped and
/// counted with `skip_bad`.
pub fn load_data(path: &Path, context: usize, vocab: i64, skip_bad: bool) -> Result<Vec<Sample>> {
    let (mut samples, mut skipped) = crate::dataset::read_dataset_for(path, Some(vocab), skip_bad)?;
    crate::dataset::refuse_unfinished(path, samples.len() + skipped)?;
    let too_long = |s: &Sample| s.prompt_ids.len() + s.completion_ids.len() > context;
    if let Some((i, s)) = samples.iter().enumerate().find(|(_, s)| too_long(s)) {
        if !skip_bad {
            bail!(Refusal::RecordTooLong {
                path: path.to_path_buf(),
                record: i + 1,
                id: s.id.clone(),
                tokens: s.prompt_ids.len() + s.completion_ids.len(),
                context,
            });
        }
    }
    let before = samples.len();
    samples.retain(|s| !too_long(s) && !s.completion_ids.is_empty());
    skipped += before - samples.len();
    if skipped > 0 {
        eprintln!("skipped {skipped} record(s) of {}", path.display());
    }
    if samples.is_empty() {
        bail!("{}: no usable records", path.display());
    }
    Ok(samples)
}

/// What is fixed for a whole run: the baseline, the loss, the training units and the steps.
struct Plan<'a> {
    /// The baseline `c` and the data set's share of positives `p`.
    c: f64,
    p: f64,
    p_tilde: Option<f64>,
    loss: Loss,
    /// What every token-level loss of a step gets besides its own terms, built once.
    extras: Extras,
    units: Vec<Unit<'a>>,
    units_per_step: usize,
    steps_per_epoch: usize,
    total: usize,
    /// The model as the run started (decoupled PPO's recomputed proximal policy only).
    start: Option<Llama>,
}

impl Plan<'_> {
    /// What the run did, once it stands at `progress`.
    fn summary(&self, o: &TrainSettings, completions: usize, progress: &Progress) -> Summary {
        Summary {
            objective: o.objective.name(),
            completions,
            positive_fraction: self.p,
            baseline: self.c,
            p_tilde: self.p_tilde,
            steps: progress.step,
            final_loss: progress.last_loss,
            truncated_fraction_neg: matches!(self.loss, Loss::Topr(_))
                .then(|| progress.truncated_sum / progress.step.max(1) as f64),
        }
    }
}

impl<'a> Plan<'a> {
    /// `report`: say on stderr what the data set holds (one rank of a group does).
    fn new(samples: &'a [Sample], o: &TrainSettings, report: bool) -> Result<Self> {
        let (c, p) = resolve_baseline(samples, o.baseline)?;
        let p_tilde = p_tilde(o.objective, p, c)?;
        if report {
            eprintln!(
                "{} completions, {:.1}% positive; baseline c = {c:.4}{}",
                samples.len(),
                100.0 * p,
                p_tilde.map(|v| format!(", effective positive proportion p~ = {v:.3}")).unwrap_or_default()
            );
        }
        let loss = Loss::new(o, c);
        let units = units_with(samples, o.objective, c, o.advantage)?;
        let units_per_step = (o.batch_size / units[0].completions()).max(1);
        let steps_per_epoch = units.len().div_ceil(units_per_step);
        let (extras, total) = (o.extras(), steps_per_epoch * o.epochs);
        Ok(Self { c, p, p_tilde, loss, extras, units, units_per_step, steps_per_epoch, total, start: None })
    }

    /// The steps of `epoch`: (0-based step number, its units), in a deterministic shuffle
    /// (Fisher–Yates, seeded by the seed and the epoch).
    fn epoch(&self, epoch: usize, seed: u64) -> Vec<(usize, Vec<Unit<'a>>)> {
        let mut order: Vec<usize> = (0..self.units.len()).collect();
        let mut rng = crate::task::Rng::new(seed.wrapping_add(epoch as u64));
        for i in (1..order.len()).rev() {
            order.swap(i, rng.range(0, i as i64) as usize);
        }
        order
            .chunks(self.units_per_step)
            .enumerate()
            .map(|(k, chunk)| (epoch * self.steps_per_epoch + k, chunk.iter().map(|&i| self.units[i]).collect()))
            .collect()
    }
}

/// One optimiser step on `batch` (0-based `step` of `epoch`): gradient, clipping, schedule,
/// update. Returns its metrics record.
fn optimizer_step(
    model: &Llama,
    opt: &mut Optimizer,
    plan: &Plan,
    o: &TrainSettings,
    (epoch, step): (usize, usize),
    batch: &[Unit],
    group: Option<&ProcessGroup>,
) -> Result<StepRecord> {
    opt.zero_grad();
    let seed = o.seed.wrapping_mul(1_000_003).wrapping_add(step as u64);
    let at = StepAt { seed, index: step, start: plan.start.as_ref() };
    let stats = accumulate(model, batch, o.micro_batch_size, &plan.loss, &plan.extras, at, group)?;
    if !stats.loss.is_finite() {
        bail!("step {}: the loss is {} (not finite); lower the learning rate", step + 1, stats.loss);
    }
    let grad_norm = clip_grad_norm(&model.vs.trainable_variables(), o.max_grad_norm);
    let lr = learning_rate(o.lr, step, plan.total, o.warmup_steps, o.lr_decay);
    opt.step(lr)?;
    Ok(StepRecord { baseline: plan.c, epoch, grad_norm, lr, p_tilde: plan.p_tilde, stats, step: step + 1 })
}

/// Trains `model` in place on `samples`: micro-batching, clipping, schedule; one JSON line of
/// metrics per optimiser step to `dir/metrics.jsonl`; the training state in `dir/state` every
/// `save_every` steps (removed when the run finishes), with `record`, which a resumed run must
/// match. The caller holds `dir` (see [`crate::io::Lock`]).
///
/// With a process `group` (data parallelism, [`crate::parallel`]), every rank calls this with
/// the same model, samples and settings: each computes its share of every step, and all take
/// the same update. Only rank 0 writes `dir`; on resume, rank 0 settles the saved state first,
/// then the others load it (so `dir` must be on a file system every rank sees).
pub fn run(
    model: &Llama,
    samples: &[Sample],
    o: &TrainSettings,
    record: &RunRecord,
    dir: &Path,
    group: Option<&ProcessGroup>,
) -> Result<Summary> {
    o.check()?;
    parallel::agree(group, "training", record, &PATHS)?;
    let main = parallel::is_main(group);
    let state = StateDir { dir: dir.to_path_buf() };
    if main {
        state.check(record, o)?;
    }
    let mut plan = Plan::new(samples, o, main)?;
    // Before a resume loads the saved weights: the model the run started with.
    if matches!(plan.loss, Loss::DecoupledPpo(_, crate::settings::Proximal::Recompute)) {
        plan.start = Some(model.frozen_copy()?);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (mut opt, mut progress) = resume(model, o, record, &state, group)?;
    let mut metrics =
        if main { Some(MetricsLog::open(&crate::layout::metrics_file(dir), progress.step)?) } else { None };
    let pb = if main {
        crate::progress::Progress::new("train", "steps", plan.total as u64, progress.step as u64)
    } else {
        crate::progress::Progress::hidden()
    };
    for epoch in 0..o.epochs {
        for (step, batch) in plan.epoch(epoch, o.seed) {
            if step < progress.step {
                continue; // done before the run was interrupted
            }
            let record = optimizer_step(model, &mut opt, &plan, o, (epoch, step), &batch, group)?;
            if let Some(m) = metrics.as_mut() {
                m.write(&record)?;
            }
            pb.set_message(format!("loss {:.4}", record.stats.loss));
            pb.inc(1);
            progress.step = step + 1;
            progress.last_loss = record.stats.loss;
            progress.truncated_sum += record.stats.topr.as_ref().map_or(0.0, |t| t.truncated_fraction_neg);
            if main && o.save_every > 0 && progress.step % o.save_every == 0 && progress.step < plan.total {
                state.save(model, &opt, &progress)?;
            }
        }
    }
    pb.finish();
    opt.zero_grad();
    Ok(plan.summary(o, samples.len(), &progress))
}

/// The optimiser and where the run starts: rank 0 settles the saved state of an interrupted run
/// (or starts afresh), then the other ranks read it; every rank must then stand at the same
/// step.
fn resume(
    model: &Llama,
    o: &TrainSettings,
    record: &RunRecord,
    state: &StateDir,
    group: Option<&ProcessGroup>,
) -> Result<(Optimizer, Progress)> {
    let named: Vec<(String, Tensor)> = model.vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    let mut opt = Optimizer::new(o.optimizer, named);
    let progress = parallel::main_first(group, || state.resume(model, &mut opt, record, o))??;
    // Every rank must stand where rank 0 does: a rank that cannot see the saved state (no shared
    // file system) would start afresh and its gradients would belong to another step.
    let steps: Vec<f64> = parallel::gather(group, &[progress.step as f64])?.iter().map(|r| r[0]).collect();
    if steps.iter().any(|&s| s != steps[0]) {
        bail!(
            "the ranks resume from different steps ({steps:?}): {} must be on a file system every rank sees",
            state.dir.display()
        );
    }
    Ok((opt, progress))
}

/// Removes the training state of a finished run in `dir` (call once its model is saved).
pub fn finish(dir: &Path) {
    StateDir { dir: dir.to_path_buf() }.remove();
}

/// Refuses to train SFT on a data set none of whose samples it would weigh (no `R − c > 0`):
/// the model would come out unchanged. (DPO refuses a data set without pairs the same way, in
/// [`units`].)
fn refuse_no_op(samples: &[Sample], o: &TrainSettings, data: &Path) -> Result<()> {
    if o.objective != Objective::Sft {
        return Ok(());
    }
    let (c, _) = resolve_baseline(samples, o.baseline)?;
    if !samples.iter().any(|s| s.reward - c > 0.0) {
        bail!(
            "{}: SFT trains on the positives (reward minus baseline > 0), and this data set has none: the model would not change",
            data.display()
        );
    }
    Ok(())
}

/// `train` from directory to directory: loads the model of `model_dir` and the data set, trains,
/// saves the model (Hugging Face layout) with `metrics.jsonl` and `training.png` in `out`, and
/// removes the training state.
///
/// Refused before anything is loaded or written: an `out` that is, contains or lies inside
/// `model_dir`; an `out` in use by another run (it is locked while this one runs); an `out`
/// holding a finished model ([`Refusal::FinishedModel`]) or the state of another run.
///
/// With a process `group`, every rank runs this with the same arguments ([`run`]); rank 0 locks
/// and writes `out`.
pub fn train_dir(
    model_dir: &Path,
    at: Placement,
    data: &Path,
    o: &TrainSettings,
    out: &Path,
    group: Option<&ProcessGroup>,
) -> Result<Summary> {
    o.check()?;
    crate::io::refuse_overlap(model_dir, out, "output directory")?;
    // The data is checked against the model's config before the weights are loaded (and before
    // `out` is created): a bad record is reported at once.
    let cfg =
        crate::config::LlamaConfig::load(model_dir).with_context(|| format!("loading {}", model_dir.display()))?;
    let samples = load_data(data, cfg.max_position_embeddings as usize, cfg.vocab_size, o.skip_bad_records)?;
    refuse_no_op(&samples, o, data)?;
    let record = RunRecord::new(model_dir, at, data, &samples, o)?;
    let main = parallel::is_main(group);
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let _lock = if main { Some(crate::io::Lock::dir(out)?) } else { None };
    let state = StateDir { dir: out.to_path_buf() };
    if main && crate::io::holds_model(out) && !state.exists() {
        bail!(Refusal::FinishedModel(out.to_path_buf()));
    }
    if main {
        state.check(&record, o)?;
    }
    let (m, _) = checkpoint::open(model_dir, at)?;
    let summary = run(&m, &samples, o, &record, out, group)?;
    if main {
        checkpoint::save(&m, model_dir, out)?;
        finish(out);
        crate::plot::report("training", || crate::plot::plot_training(out));
    }
    Ok(summary)
}
