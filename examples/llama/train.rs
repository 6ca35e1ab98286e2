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

use crate::model::Llama;
use crate::optim::{Optimizer, OptimizerConfig};
use crate::sample::Sample;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, DpoConfig, GroupAdvantage, LogProbConfig, Normalizer, PpoConfig, SequenceReduce, ToprConfig,
    ToprDiagnostics, ToprTokenConfig, backward_through_logprobs, baseline_for_effective_proportion, dpo_loss,
    dpo_rewards, group_advantages, ppo_clip_loss, sequence_logprobs, topr_token_diagnostics, topr_token_loss,
};

/// The objectives `train` offers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Topr,
    Tis,
    Sft,
    Reinforce,
    Is,
    /// PPO-clip (ε = 0.2, token-mean) with advantages `R − c`.
    Ppo,
    /// PPO-clip with GRPO's group-normalised advantages and sequence-mean-token-mean aggregation.
    Grpo,
    /// DPO (sigmoid) on (correct, incorrect) pairs of the same prompt, μ as the reference.
    Dpo,
}

impl Objective {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "topr" => Self::Topr,
            "tis" => Self::Tis,
            "sft" => Self::Sft,
            "reinforce" => Self::Reinforce,
            "is" => Self::Is,
            "ppo" => Self::Ppo,
            "grpo" => Self::Grpo,
            "dpo" => Self::Dpo,
            other => bail!("--objective must be topr, tis, sft, reinforce, is, ppo, grpo or dpo, got {other:?}"),
        })
    }

    /// The truncation limits of the TOPR-family objectives (`None` for the others).
    pub fn limits(self) -> Option<ToprConfig> {
        Some(match self {
            Self::Topr => ToprConfig::canonical(),
            Self::Tis => ToprConfig::tis(),
            Self::Sft => ToprConfig::sft(),
            Self::Reinforce => ToprConfig::naive_reinforce(),
            Self::Is => ToprConfig::importance_sampling(),
            Self::Ppo | Self::Grpo | Self::Dpo => return None,
        })
    }
}

/// The baseline: given, or derived from the data set's share of positives and a target
/// effective proportion `p̃` (rewards ±1; `c = 0`, with a warning, when every sample has the same
/// sign, as no baseline can then change their share).
pub fn resolve_baseline(data: &[Sample], baseline: Option<f64>, target: Option<f64>) -> Result<(f64, f64)> {
    let p = data.iter().filter(|s| s.reward > 0.0).count() as f64 / data.len().max(1) as f64;
    let c = match (baseline, target) {
        (Some(_), Some(_)) => bail!("give --baseline or --target-positive-proportion, not both"),
        (Some(c), None) => c,
        // All samples of one sign: no baseline changes their share. Train with c = 0 rather than
        // stop a loop whose model got every sample wrong (or right) this time.
        (None, Some(_)) if p == 0.0 || p == 1.0 => {
            eprintln!(
                "warning: every completion is {}: --target-positive-proportion cannot be met; using baseline c = 0",
                if p == 0.0 { "wrong" } else { "right" }
            );
            0.0
        }
        (None, Some(pt)) => baseline_for_effective_proportion(p, pt)?,
        (None, None) => 0.0,
    };
    Ok((c, p))
}

/// The loss one step computes, with everything fixed for the run.
#[derive(Debug, Clone, Copy)]
pub enum Loss {
    /// The TOPR family on rewards (the baseline is in the config).
    Topr(ToprTokenConfig),
    /// PPO-clip on per-sequence advantages.
    Ppo(PpoConfig),
    /// DPO on pairs.
    Dpo(DpoConfig),
}

/// A training unit: one completion with the value its loss weighs it by (the reward for the TOPR
/// family, the advantage for PPO and GRPO), or, for DPO, a (chosen, rejected) pair.
#[derive(Debug, Clone, Copy)]
pub enum Unit<'a> {
    Single(&'a Sample, f32),
    Pair(&'a Sample, &'a Sample),
}

impl Unit<'_> {
    /// Completions in this unit.
    pub fn completions(&self) -> usize {
        match self {
            Self::Single(..) => 1,
            Self::Pair(..) => 2,
        }
    }
}

/// Samples grouped by question id, in order of first appearance.
fn groups(samples: &[Sample]) -> Vec<Vec<&Sample>> {
    let mut index: BTreeMap<&str, usize> = BTreeMap::new();
    let mut out: Vec<Vec<&Sample>> = vec![];
    for s in samples {
        let k = *index.entry(&s.id).or_insert_with(|| {
            out.push(vec![]);
            out.len() - 1
        });
        out[k].push(s);
    }
    out
}

/// The training units of `samples` for `objective` with baseline `c`: GRPO advantages are
/// computed per question over all its completions in the data set; DPO pairs the i-th correct
/// with the i-th incorrect completion of each question.
pub fn units(samples: &[Sample], objective: Objective, c: f64) -> Result<Vec<Unit<'_>>> {
    Ok(match objective {
        Objective::Ppo => samples.iter().map(|s| Unit::Single(s, (s.reward - c) as f32)).collect(),
        Objective::Grpo => {
            let mut out = vec![];
            for g in groups(samples) {
                let r = Tensor::from_slice(&g.iter().map(|s| s.reward).collect::<Vec<_>>()).view([1, -1]);
                let a = Vec::<f64>::try_from(group_advantages(&r, GroupAdvantage::grpo())?.flatten(0, -1))?;
                out.extend(g.iter().zip(a).map(|(s, a)| Unit::Single(s, a as f32)));
            }
            out
        }
        Objective::Dpo => {
            let mut out = vec![];
            for g in groups(samples) {
                let pos = g.iter().filter(|s| s.reward > 0.0);
                let neg = g.iter().filter(|s| s.reward <= 0.0);
                out.extend(pos.zip(neg).map(|(w, l)| Unit::Pair(w, l)));
            }
            if out.is_empty() {
                bail!("DPO needs questions with both a correct and an incorrect completion; this data set has none");
            }
            out
        }
        _ => samples.iter().map(|s| Unit::Single(s, s.reward as f32)).collect(),
    })
}

/// Right-padded tensors of a micro-batch: `ids [b, L]`, attention mask `[b, L]`, and, aligned with
/// the next-token predictions at positions `0..L−1`, the labels, the completion mask, μ's
/// log-probs `[b, L−1]` and the per-row values `[b]` (rewards or advantages).
pub struct MicroBatch {
    pub ids: Tensor,
    pub attn: Tensor,
    pub labels: Tensor,
    pub mask: Tensor,
    pub logp_mu: Tensor,
    pub values: Tensor,
}

pub fn micro_batch(rows: &[(&Sample, f32)], device: tch::Device) -> MicroBatch {
    let len = rows.iter().map(|(s, _)| s.prompt_ids.len() + s.completion_ids.len()).max().unwrap_or(1);
    let b = rows.len();
    let mut ids = vec![0i64; b * len];
    let mut attn = vec![0i64; b * len];
    let mut mask = vec![false; b * (len - 1)];
    let mut mu = vec![0f32; b * (len - 1)];
    for (r, (s, _)) in rows.iter().enumerate() {
        let all: Vec<i64> = s.prompt_ids.iter().chain(&s.completion_ids).copied().collect();
        ids[r * len..r * len + all.len()].copy_from_slice(&all);
        attn[r * len..r * len + all.len()].iter_mut().for_each(|a| *a = 1);
        // Completion token k sits at position p + k and is predicted at position p + k − 1.
        let p = s.prompt_ids.len();
        for (k, lp) in s.logp_mu.iter().enumerate() {
            mask[r * (len - 1) + p + k - 1] = true;
            mu[r * (len - 1) + p + k - 1] = *lp;
        }
    }
    let (b, l) = (b as i64, len as i64);
    let ids = Tensor::from_slice(&ids).view([b, l]).to_device(device);
    MicroBatch {
        labels: ids.narrow(1, 1, l - 1),
        ids,
        attn: Tensor::from_slice(&attn).view([b, l]).to_device(device),
        mask: Tensor::from_slice(&mask).view([b, l - 1]).to_device(device),
        logp_mu: Tensor::from_slice(&mu).view([b, l - 1]).to_device(device),
        values: Tensor::from_slice(&rows.iter().map(|r| r.1).collect::<Vec<_>>()).to_device(device),
    }
}

/// The TOPR family's weights and truncation in one step (sample-weighted over micro-batches).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct ToprStats {
    pub negative_fraction: f64,
    pub truncated_fraction_pos: f64,
    pub truncated_fraction_neg: f64,
    pub weight_mean: f64,
    pub weight_max: f64,
    pub log_ratio_mean: f64,
    pub effective_positive_proportion: Option<f64>,
}

/// What one optimiser step measured.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct StepStats {
    pub loss: f64,
    pub sequences: usize,
    pub tokens: usize,
    /// Mean `log π − log μ` over the completion tokens.
    pub log_ratio_mean: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topr: Option<ToprStats>,
    /// PPO and GRPO: share of tokens whose ratio lies outside `[1 − ε_low, 1 + ε_high]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_fraction: Option<f64>,
    /// DPO: share of pairs whose implicit reward ranks chosen above rejected, and the mean margin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dpo_accuracy: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dpo_margin: Option<f64>,
}

/// Σ over the masked tokens of `x`, as f64.
fn masked_sum(x: &Tensor, mask: &Tensor) -> f64 {
    x.detach().to_kind(Kind::Double).masked_select(mask).sum(Kind::Double).double_value(&[])
}

/// The TOPR-family statistics, weighted by each micro-batch's sample count.
fn topr_stats(diags: &[ToprDiagnostics]) -> ToprStats {
    let total: f64 = diags.iter().map(|d| d.samples as f64).sum::<f64>().max(1.0);
    let avg = |f: &dyn Fn(&ToprDiagnostics) -> f64| diags.iter().map(|d| f(d) * d.samples as f64).sum::<f64>() / total;
    let pos: Vec<f64> = diags.iter().filter_map(|d| d.effective_positive_proportion).collect();
    ToprStats {
        negative_fraction: avg(&|d| d.negative_fraction),
        truncated_fraction_pos: avg(&|d| d.truncated_fraction_pos),
        truncated_fraction_neg: avg(&|d| d.truncated_fraction_neg),
        weight_mean: avg(&|d| d.weight_mean),
        weight_max: diags.iter().map(|d| d.weight_max).fold(0.0, f64::max),
        log_ratio_mean: avg(&|d| d.log_ratio_mean),
        effective_positive_proportion: (!pos.is_empty()).then(|| pos.iter().sum::<f64>() / pos.len() as f64),
    }
}

/// Accumulates the gradient of one optimiser step over micro-batches of about `micro`
/// completions (does not step). The loss uses the counts of the whole step, so the sum over
/// micro-batches is the full-batch loss and its gradient.
pub fn accumulate(model: &Llama, batch: &[Unit], micro: usize, loss: &Loss) -> Result<StepStats> {
    let device = model.device();
    let per_micro = match batch.first() {
        Some(u) => (micro / u.completions()).max(1),
        None => bail!("an optimiser step needs at least one completion"),
    };
    // Rows of each micro-batch: singles as they come; pairs as [chosen…, rejected…].
    let parts: Vec<MicroBatch> = batch
        .chunks(per_micro)
        .map(|c| {
            let mut rows: Vec<(&Sample, f32)> = vec![];
            let mut second = vec![];
            for u in c {
                match *u {
                    Unit::Single(s, v) => rows.push((s, v)),
                    Unit::Pair(w, l) => {
                        rows.push((w, 0.0));
                        second.push((l, 0.0));
                    }
                }
            }
            rows.extend(second);
            micro_batch(&rows, device)
        })
        .collect();
    let masks: Vec<&Tensor> = parts.iter().map(|p| &p.mask).collect();
    let normalizer = Normalizer::from_masks(&masks)?;
    let pairs_in_step = batch.len() as f64;
    let lp_cfg = LogProbConfig::default();
    let mut stats = StepStats { sequences: batch.iter().map(Unit::completions).sum(), ..Default::default() };
    let (mut diags, mut clipped, mut log_ratio) = (vec![], 0.0, 0.0);
    let (mut dpo_acc, mut dpo_margin) = (0.0, 0.0);
    for p in &parts {
        let logits = model.logits(&p.ids, &p.attn);
        let l = p.ids.size()[1];
        let value = backward_through_logprobs(&logits.narrow(1, 0, l - 1), &p.labels, Some(&p.mask), &lp_cfg, |lp| {
            let delta = &lp.logp.detach() - &p.logp_mu;
            log_ratio += masked_sum(&delta, &lp.mask);
            match loss {
                Loss::Topr(cfg) => {
                    let cfg = ToprTokenConfig { normalizer, ..*cfg };
                    diags.push(topr_token_diagnostics(&lp.logp, &p.logp_mu, &p.values, &lp.mask, &cfg)?);
                    topr_token_loss(&lp.logp, &p.logp_mu, &p.values, &lp.mask, &cfg)
                }
                Loss::Ppo(cfg) => {
                    let cfg = PpoConfig { normalizer, ..*cfg };
                    let ratio = delta.exp();
                    let outside = ratio.lt(1.0 - cfg.clip_low).logical_or(&ratio.gt(1.0 + cfg.clip_high));
                    clipped += masked_sum(&outside, &lp.mask);
                    ppo_clip_loss(&lp.logp, &p.logp_mu, &p.values, &lp.mask, &cfg)
                }
                Loss::Dpo(cfg) => {
                    let n = lp.logp.size()[0] / 2;
                    let seq = sequence_logprobs(&lp.logp, &lp.mask, SequenceReduce::Sum)?;
                    let mu = sequence_logprobs(&p.logp_mu, &lp.mask, SequenceReduce::Sum)?;
                    let (pw, pl) = (seq.narrow(0, 0, n), seq.narrow(0, n, n));
                    let (rw, rl) = (mu.narrow(0, 0, n), mu.narrow(0, n, n));
                    let r = dpo_rewards(&pw, &pl, &rw, &rl, cfg)?;
                    dpo_acc += r.accuracy * n as f64;
                    dpo_margin += r.margin * n as f64;
                    // dpo_loss averages over this micro-batch's pairs; weigh it by its share of the step.
                    Ok(dpo_loss(&pw, &pl, &rw, &rl, cfg)? * (n as f64 / pairs_in_step))
                }
            }
        })?;
        stats.loss += value.double_value(&[]);
        stats.tokens += p.mask.sum(Kind::Int64).int64_value(&[]) as usize;
    }
    stats.log_ratio_mean = log_ratio / stats.tokens.max(1) as f64;
    match loss {
        Loss::Topr(_) => stats.topr = Some(topr_stats(&diags)),
        Loss::Ppo(_) => stats.clip_fraction = Some(clipped / stats.tokens.max(1) as f64),
        Loss::Dpo(_) => {
            stats.dpo_accuracy = Some(dpo_acc / pairs_in_step);
            stats.dpo_margin = Some(dpo_margin / pairs_in_step);
        }
    }
    Ok(stats)
}

/// `sqrt(Σ g²)` over the trainable parameters, then scales the gradients so that it is at most
/// `max_norm` (when given). Returns the norm before clipping.
pub fn clip_grad_norm(vars: &[Tensor], max_norm: Option<f64>) -> f64 {
    let sq: f64 = vars
        .iter()
        .filter(|v| v.grad().defined())
        .map(|v| v.grad().to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]))
        .sum();
    let norm = sq.sqrt();
    if let Some(max) = max_norm {
        if norm > max && norm.is_finite() {
            let scale = max / (norm + 1e-6);
            tch::no_grad(|| {
                for v in vars {
                    let mut g = v.grad();
                    if g.defined() {
                        let _ = g.g_mul_scalar_(scale);
                    }
                }
            });
        }
    }
    norm
}

/// The learning rate at `step` (0-based) of `total`: linear warm-up, then constant or linear decay.
pub fn learning_rate(base: f64, step: usize, total: usize, warmup: usize, decay: bool) -> f64 {
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    if decay && total > warmup {
        let frac = (step - warmup) as f64 / (total - warmup) as f64;
        return base * (1.0 - frac).max(0.0);
    }
    base
}

/// Everything `run` needs besides the model and the data.
#[derive(Debug, Clone)]
pub struct Options {
    pub objective: Objective,
    pub baseline: Option<f64>,
    pub target_positive_proportion: Option<f64>,
    pub ratio: topr_loss::RatioLevel,
    pub optimizer: OptimizerConfig,
    pub lr: f64,
    pub batch_size: usize,
    pub micro_batch_size: usize,
    pub epochs: usize,
    pub max_grad_norm: f64,
    pub warmup_steps: usize,
    pub lr_decay: bool,
    pub seed: u64,
    /// DPO's β.
    pub dpo_beta: f64,
    /// Save the training state every this many steps (0: never; a kill then restarts the stage).
    pub save_every: usize,
    /// Continue from the saved state of an interrupted run in the same output directory.
    pub resume: bool,
}

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

/// Reads a data set for training: malformed lines and completions longer than `context` tokens
/// are errors naming the record, or are skipped and counted with `skip_bad`.
pub fn load_data(path: &std::path::Path, context: usize, skip_bad: bool) -> Result<Vec<Sample>> {
    let (mut samples, mut skipped) = crate::sample::read_dataset(path, skip_bad)?;
    let too_long = |s: &Sample| s.prompt_ids.len() + s.completion_ids.len() > context;
    if let Some((i, s)) = samples.iter().enumerate().find(|(_, s)| too_long(s)) {
        if !skip_bad {
            bail!(
                "{}: record {} ({}) has {} tokens, more than the model's context of {context} (--skip-bad-records skips such records)",
                path.display(),
                i + 1,
                s.id,
                s.prompt_ids.len() + s.completion_ids.len()
            );
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

/// Where a run stands, saved with the model and optimiser state.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
struct Progress {
    step: usize,
    last_loss: f64,
    truncated_sum: f64,
    /// A fingerprint of the data and settings, so that a state is not resumed on other data.
    fingerprint: String,
}

/// The training state of a run: `dir/state` (model, optimiser, progress). Written to
/// `state.tmp` and renamed, so a kill at any moment leaves a whole state (the previous one).
struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    fn path(&self) -> PathBuf {
        self.dir.join("state")
    }

    fn save(&self, model: &Llama, opt: &Optimizer, progress: &Progress) -> Result<()> {
        let tmp = self.dir.join("state.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        crate::checkpoint::write_safetensors(&crate::checkpoint::weights(model), &tmp.join("model.safetensors"))?;
        crate::checkpoint::write_safetensors(&opt.state(), &tmp.join("optimizer.safetensors"))?;
        std::fs::write(tmp.join("progress.json"), serde_json::to_string(progress)?)?;
        let old = self.dir.join("state.old");
        let _ = std::fs::remove_dir_all(&old);
        if self.path().exists() {
            std::fs::rename(self.path(), &old)?;
        }
        std::fs::rename(&tmp, self.path())?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    /// The saved state, if any (after a kill between the two renames, the previous one).
    fn load(&self, model: &Llama, opt: &mut Optimizer) -> Result<Option<Progress>> {
        let old = self.dir.join("state.old");
        if !self.path().exists() && old.exists() {
            std::fs::rename(&old, self.path())?;
        }
        let dir = self.path();
        if !dir.exists() {
            return Ok(None);
        }
        let ctx = || format!("resuming from {}", dir.display());
        let progress: Progress =
            serde_json::from_str(&std::fs::read_to_string(dir.join("progress.json")).with_context(ctx)?)
                .with_context(ctx)?;
        crate::checkpoint::read_weights(model, &[dir.join("model.safetensors")], &dir).with_context(ctx)?;
        let state = Tensor::read_safetensors(dir.join("optimizer.safetensors")).with_context(ctx)?;
        opt.load_state(state.into_iter().collect()).with_context(ctx)?;
        Ok(Some(progress))
    }

    fn remove(&self) {
        let _ = std::fs::remove_dir_all(self.path());
    }
}

/// A short fingerprint of the data and the settings that shape the steps.
fn fingerprint(samples: &[Sample], o: &Options) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for s in samples {
        (&s.id, s.sample, &s.completion_ids, s.reward.to_bits()).hash(&mut h);
    }
    format!("{:?}|{}|{}|{}|{:?}|{:016x}", o.objective, o.batch_size, o.epochs, o.seed, o.optimizer, h.finish())
}

/// The metrics lines of steps `1..=step` (a resumed run drops those of steps it will redo).
fn keep_metrics(path: &Path, step: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut kept = String::new();
    for line in text.lines() {
        let n = serde_json::from_str::<serde_json::Value>(line).ok().and_then(|v| v["step"].as_u64());
        if n.is_some_and(|n| n as usize <= step) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}

/// Trains `model` in place on `samples`: micro-batching, clipping, schedule; one JSON line of
/// metrics per optimiser step to `dir/metrics.jsonl`; the training state in `dir/state` every
/// `save_every` steps (removed when the run finishes).
pub fn run(model: &Llama, samples: &[Sample], o: &Options, dir: &Path) -> Result<Summary> {
    use std::io::Write;
    let (c, p) = resolve_baseline(samples, o.baseline, o.target_positive_proportion)?;
    // SFT gives negatives no weight: all of it is on positives.
    let p_tilde = match o.objective {
        Objective::Sft => Some(1.0),
        Objective::Grpo | Objective::Dpo => None,
        _ => Some(topr_loss::effective_positive_proportion(p, c.clamp(-1.0, 1.0))?),
    };
    eprintln!(
        "{} completions, {:.1}% positive; baseline c = {c:.4}{}",
        samples.len(),
        100.0 * p,
        p_tilde.map(|v| format!(", effective positive proportion p~ = {v:.3}")).unwrap_or_default()
    );
    let loss = match o.objective {
        Objective::Ppo => Loss::Ppo(PpoConfig::ppo()),
        Objective::Grpo => Loss::Ppo(PpoConfig { aggregation: AggregationMode::SeqMeanTokenMean, ..PpoConfig::ppo() }),
        Objective::Dpo => Loss::Dpo(DpoConfig { beta: o.dpo_beta, ..DpoConfig::default() }),
        other => Loss::Topr(ToprTokenConfig {
            topr: other.limits().unwrap_or_default().with_baseline(c),
            ratio: o.ratio,
            ..ToprTokenConfig::paper()
        }),
    };
    let units = units(samples, o.objective, c)?;
    std::fs::create_dir_all(dir)?;
    let metrics_path = dir.join("metrics.jsonl");
    let state = StateDir { dir: dir.to_path_buf() };
    let named: Vec<(String, Tensor)> = model.vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    let mut opt = Optimizer::new(o.optimizer, named);
    let fp = fingerprint(samples, o);
    let mut progress = Progress { fingerprint: fp.clone(), last_loss: f64::NAN, ..Default::default() };
    if state.path().exists() || dir.join("state.old").exists() {
        if !o.resume {
            bail!(
                "{} holds the state of an interrupted run: pass --resume to continue it, or remove {}",
                dir.display(),
                state.path().display()
            );
        }
        if let Some(saved) = state.load(model, &mut opt)? {
            if saved.fingerprint != fp {
                bail!(
                    "{}: the saved state was made with other data or settings (objective, batch size, epochs, seed, optimizer); remove it to start afresh",
                    state.path().display()
                );
            }
            if opt.steps() as usize != saved.step {
                bail!(
                    "{}: the optimiser state is at step {}, the progress at {}",
                    state.path().display(),
                    opt.steps(),
                    saved.step
                );
            }
            eprintln!("resuming after step {}", saved.step);
            progress = saved;
        }
    }
    let kept = keep_metrics(&metrics_path, progress.step);
    let mut metrics = std::io::BufWriter::new(std::fs::File::create(&metrics_path)?);
    metrics.write_all(kept.as_bytes())?;
    let units_per_step = (o.batch_size / units[0].completions()).max(1);
    let steps_per_epoch = units.len().div_ceil(units_per_step);
    let total = steps_per_epoch * o.epochs;
    let pb = indicatif::ProgressBar::new(total as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("train [{bar:30}] {pos}/{len} steps {msg} ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb.set_position(progress.step as u64);
    let vars: Vec<Tensor> = model.vs.trainable_variables();
    for epoch in 0..o.epochs {
        // A deterministic shuffle per epoch (Fisher–Yates).
        let mut order: Vec<usize> = (0..units.len()).collect();
        let mut rng = crate::task::Rng::new(o.seed.wrapping_add(epoch as u64));
        for i in (1..order.len()).rev() {
            order.swap(i, rng.range(0, i as i64) as usize);
        }
        for (k, chunk) in order.chunks(units_per_step).enumerate() {
            let step = epoch * steps_per_epoch + k;
            if step < progress.step {
                continue; // done before the run was interrupted
            }
            let batch: Vec<Unit> = chunk.iter().map(|&i| units[i]).collect();
            opt.zero_grad();
            let stats = accumulate(model, &batch, o.micro_batch_size, &loss)?;
            if !stats.loss.is_finite() {
                bail!("step {}: the loss is {} (not finite); lower the learning rate", step + 1, stats.loss);
            }
            let grad_norm = clip_grad_norm(&vars, Some(o.max_grad_norm));
            let lr_now = learning_rate(o.lr, step, total, o.warmup_steps, o.lr_decay);
            opt.step(lr_now)?;
            let line = serde_json::json!({"step": step + 1, "epoch": epoch, "lr": lr_now, "grad_norm": grad_norm, "baseline": c, "p_tilde": p_tilde, "stats": stats});
            writeln!(metrics, "{line}")?;
            metrics.flush()?;
            pb.set_message(format!("loss {:.4}", stats.loss));
            pb.inc(1);
            progress.step = step + 1;
            progress.last_loss = stats.loss;
            progress.truncated_sum += stats.topr.as_ref().map_or(0.0, |t| t.truncated_fraction_neg);
            if o.save_every > 0 && progress.step % o.save_every == 0 && progress.step < total {
                state.save(model, &opt, &progress)?;
            }
        }
    }
    pb.finish_and_clear();
    opt.zero_grad();
    Ok(Summary {
        objective: format!("{:?}", o.objective).to_lowercase(),
        completions: samples.len(),
        positive_fraction: p,
        baseline: c,
        p_tilde,
        steps: progress.step,
        final_loss: progress.last_loss,
        truncated_fraction_neg: matches!(loss, Loss::Topr(_))
            .then(|| progress.truncated_sum / progress.step.max(1) as f64),
    })
}

/// Removes the training state of a finished run in `dir` (call once its model is saved).
pub fn finish(dir: &Path) {
    StateDir { dir: dir.to_path_buf() }.remove();
}
