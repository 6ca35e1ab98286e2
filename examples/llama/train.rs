//! Off-policy training of the model on a sampled data set with an objective of the TOPR family
//! (TOPR, TIS, SFT, naive REINFORCE, IS): the reference way to use `topr-loss` in a loop.
//!
//! One optimiser step takes `batch_size` completions, split into micro-batches of
//! `micro_batch_size`. The aggregation counts (`Normalizer`) are those of the whole step, so the
//! accumulated gradient does not depend on the micro-batch size (tested). Log-probabilities come
//! from the crate's chunked path (`backward_through_logprobs`), so no float32 copy of the
//! `[B, T, V]` logits is kept for the backward pass.

use crate::model::Llama;
use crate::sample::Sample;
use anyhow::{Result, bail};
use serde::Serialize;
use tch::{Kind, Tensor};
use topr_loss::{
    LogProbConfig, Normalizer, ToprConfig, ToprDiagnostics, ToprTokenConfig, backward_through_logprobs,
    baseline_for_effective_proportion, topr_token_diagnostics, topr_token_loss,
};

/// The objectives of the TOPR family this command trains with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Topr,
    Tis,
    Sft,
    Reinforce,
    Is,
}

impl Objective {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "topr" => Self::Topr,
            "tis" => Self::Tis,
            "sft" => Self::Sft,
            "reinforce" => Self::Reinforce,
            "is" => Self::Is,
            other => bail!(
                "--objective {other:?} is not available yet; this version trains topr, tis, sft, reinforce and is"
            ),
        })
    }

    pub fn limits(self) -> ToprConfig {
        match self {
            Self::Topr => ToprConfig::canonical(),
            Self::Tis => ToprConfig::tis(),
            Self::Sft => ToprConfig::sft(),
            Self::Reinforce => ToprConfig::naive_reinforce(),
            Self::Is => ToprConfig::importance_sampling(),
        }
    }
}

/// The baseline: given, or derived from the data set's share of positives and a target
/// effective proportion `p̃` (rewards ±1).
pub fn resolve_baseline(data: &[Sample], baseline: Option<f64>, target: Option<f64>) -> Result<(f64, f64)> {
    let p = data.iter().filter(|s| s.reward > 0.0).count() as f64 / data.len().max(1) as f64;
    let c = match (baseline, target) {
        (Some(_), Some(_)) => bail!("give --baseline or --target-positive-proportion, not both"),
        (Some(c), None) => c,
        (None, Some(pt)) => baseline_for_effective_proportion(p, pt)?,
        (None, None) => 0.0,
    };
    Ok((c, p))
}

/// Right-padded tensors of a micro-batch: `ids [b, L]`, attention mask `[b, L]`, and, aligned with
/// the next-token predictions at positions `0..L−1`, the labels, the completion mask, μ's
/// log-probs `[b, L−1]` and the rewards `[b]`.
pub struct MicroBatch {
    pub ids: Tensor,
    pub attn: Tensor,
    pub labels: Tensor,
    pub mask: Tensor,
    pub logp_mu: Tensor,
    pub rewards: Tensor,
}

pub fn micro_batch(samples: &[&Sample], device: tch::Device) -> MicroBatch {
    let len = samples.iter().map(|s| s.prompt_ids.len() + s.completion_ids.len()).max().unwrap_or(1);
    let b = samples.len();
    let mut ids = vec![0i64; b * len];
    let mut attn = vec![0i64; b * len];
    let mut mask = vec![false; b * (len - 1)];
    let mut mu = vec![0f32; b * (len - 1)];
    for (r, s) in samples.iter().enumerate() {
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
        rewards: Tensor::from_slice(&samples.iter().map(|s| s.reward as f32).collect::<Vec<_>>()).to_device(device),
    }
}

/// What one optimiser step measured.
#[derive(Debug, Clone, Serialize, Default)]
pub struct StepStats {
    pub loss: f64,
    pub sequences: usize,
    pub tokens: usize,
    pub negative_fraction: f64,
    pub truncated_fraction_pos: f64,
    pub truncated_fraction_neg: f64,
    pub weight_mean: f64,
    pub weight_max: f64,
    pub log_ratio_mean: f64,
    pub effective_positive_proportion: Option<f64>,
}

/// Accumulates the gradient of one optimiser step over micro-batches (does not step). The loss
/// uses the counts of the whole step, so the sum over micro-batches is the full-batch loss.
pub fn accumulate(model: &Llama, batch: &[&Sample], micro: usize, cfg: &ToprTokenConfig) -> Result<StepStats> {
    let device = model.device();
    let parts: Vec<MicroBatch> = batch.chunks(micro.max(1)).map(|c| micro_batch(c, device)).collect();
    let masks: Vec<&Tensor> = parts.iter().map(|p| &p.mask).collect();
    let cfg = ToprTokenConfig { normalizer: Normalizer::from_masks(&masks)?, ..*cfg };
    let lp_cfg = LogProbConfig::default();
    let mut stats = StepStats { sequences: batch.len(), ..Default::default() };
    let mut diags: Vec<(ToprDiagnostics, f64)> = vec![];
    for p in &parts {
        let logits = model.logits(&p.ids, &p.attn);
        let l = p.ids.size()[1];
        let loss = backward_through_logprobs(&logits.narrow(1, 0, l - 1), &p.labels, Some(&p.mask), &lp_cfg, |lp| {
            let d = topr_token_diagnostics(&lp.logp, &p.logp_mu, &p.rewards, &lp.mask, &cfg)?;
            diags.push((d, d.samples as f64));
            topr_token_loss(&lp.logp, &p.logp_mu, &p.rewards, &lp.mask, &cfg)
        })?;
        stats.loss += loss.double_value(&[]);
        stats.tokens += p.mask.sum(Kind::Int64).int64_value(&[]) as usize;
    }
    // Sample-weighted means of the per-micro-batch diagnostics.
    let total: f64 = diags.iter().map(|d| d.1).sum::<f64>().max(1.0);
    let avg = |f: &dyn Fn(&ToprDiagnostics) -> f64| diags.iter().map(|(d, w)| f(d) * w).sum::<f64>() / total;
    stats.negative_fraction = avg(&|d| d.negative_fraction);
    stats.truncated_fraction_pos = avg(&|d| d.truncated_fraction_pos);
    stats.truncated_fraction_neg = avg(&|d| d.truncated_fraction_neg);
    stats.weight_mean = avg(&|d| d.weight_mean);
    stats.weight_max = diags.iter().map(|(d, _)| d.weight_max).fold(0.0, f64::max);
    stats.log_ratio_mean = avg(&|d| d.log_ratio_mean);
    let pos: Vec<f64> = diags.iter().filter_map(|(d, _)| d.effective_positive_proportion).collect();
    stats.effective_positive_proportion = (!pos.is_empty()).then(|| pos.iter().sum::<f64>() / pos.len() as f64);
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
    pub lr: f64,
    pub weight_decay: f64,
    pub batch_size: usize,
    pub micro_batch_size: usize,
    pub epochs: usize,
    pub max_grad_norm: f64,
    pub warmup_steps: usize,
    pub lr_decay: bool,
    pub seed: u64,
}

/// What a training run did.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Summary {
    pub completions: usize,
    pub positive_fraction: f64,
    pub baseline: f64,
    pub p_tilde: f64,
    pub steps: usize,
    pub final_loss: f64,
    /// Mean over steps of the truncated fraction of the negative branch.
    pub truncated_fraction_neg: f64,
}

/// Reads a data set for training: malformed lines and completions longer than `context` tokens
/// are errors naming the record, or are skipped and counted with `skip_bad`.
pub fn load_data(path: &std::path::Path, context: usize, skip_bad: bool) -> Result<Vec<Sample>> {
    let (mut samples, mut skipped) = crate::sample::read_dataset(path, skip_bad)?;
    let too_long = |s: &Sample| s.prompt_ids.len() + s.completion_ids.len() > context;
    if let Some((i, s)) = samples.iter().enumerate().find(|(_, s)| too_long(s)) {
        if !skip_bad {
            bail!(
                "{}: record {} ({}) has {} tokens, more than the model's context of {context} (use --skip-bad-lines to skip such records)",
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

/// Trains `model` in place on `samples`: AdamW, micro-batching, clipping, schedule; one JSON line
/// of metrics per optimiser step to `metrics_path`.
pub fn run(model: &Llama, samples: &[Sample], o: &Options, metrics_path: &std::path::Path) -> Result<Summary> {
    use std::io::Write;
    use tch::nn::OptimizerConfig;
    let (c, p) = resolve_baseline(samples, o.baseline, o.target_positive_proportion)?;
    let p_tilde = topr_loss::effective_positive_proportion(p, c.clamp(-1.0, 1.0))?;
    eprintln!(
        "{} completions, {:.1}% positive; baseline c = {c:.4}, effective positive proportion p~ = {p_tilde:.3}",
        samples.len(),
        100.0 * p
    );
    let cfg =
        ToprTokenConfig { topr: o.objective.limits().with_baseline(c), ratio: o.ratio, ..ToprTokenConfig::paper() };
    if let Some(dir) = metrics_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut metrics = std::io::BufWriter::new(std::fs::File::create(metrics_path)?);
    let mut opt = tch::nn::AdamW { wd: o.weight_decay, ..Default::default() }.build(&model.vs, o.lr)?;
    let total = samples.len().div_ceil(o.batch_size) * o.epochs;
    let pb = indicatif::ProgressBar::new(total as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("train [{bar:30}] {pos}/{len} steps {msg} ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let vars = model.vs.trainable_variables();
    let mut step = 0;
    let (mut last_loss, mut trunc_sum) = (f64::NAN, 0.0);
    for epoch in 0..o.epochs {
        // A deterministic shuffle per epoch (Fisher–Yates).
        let mut order: Vec<usize> = (0..samples.len()).collect();
        let mut rng = crate::task::Rng::new(o.seed.wrapping_add(epoch as u64));
        for i in (1..order.len()).rev() {
            order.swap(i, rng.range(0, i as i64) as usize);
        }
        for chunk in order.chunks(o.batch_size) {
            let batch: Vec<&Sample> = chunk.iter().map(|&i| &samples[i]).collect();
            let stats = accumulate(model, &batch, o.micro_batch_size, &cfg)?;
            let grad_norm = clip_grad_norm(&vars, Some(o.max_grad_norm));
            let lr_now = learning_rate(o.lr, step, total, o.warmup_steps, o.lr_decay);
            opt.set_lr(lr_now);
            opt.step();
            opt.zero_grad();
            let line = serde_json::json!({"step": step + 1, "epoch": epoch, "lr": lr_now, "grad_norm": grad_norm, "baseline": c, "p_tilde": p_tilde, "stats": stats});
            writeln!(metrics, "{line}")?;
            metrics.flush()?;
            pb.set_message(format!("loss {:.4}", stats.loss));
            pb.inc(1);
            last_loss = stats.loss;
            trunc_sum += stats.truncated_fraction_neg;
            step += 1;
        }
    }
    pb.finish_and_clear();
    Ok(Summary {
        completions: samples.len(),
        positive_fraction: p,
        baseline: c,
        p_tilde,
        steps: step,
        final_loss: last_loss,
        truncated_fraction_neg: trunc_sum / step.max(1) as f64,
    })
}
