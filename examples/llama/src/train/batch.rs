//! One optimiser step's gradient: the micro-batches of a step (right-padded tensors), the
//! accumulation of their losses' gradients with the counts of the whole step, gradient clipping
//! and the learning-rate schedule.

use super::objective::{Extras, Loss, Tally, TallySums};
use super::units::{MicroBatch, Unit, micro_batches};
use crate::metrics::{StepStats, ToprStats};
use crate::model::Llama;
use crate::parallel::{self, ProcessGroup};
use anyhow::{Result, bail};
use tch::{Kind, Tensor};
use topr_loss::{
    BatchCounts, Checks, LogProbConfig, LossError, Normalizer, ProximalApproximation, backward_through_logprobs,
    proximal_logprobs_with_checks, token_logprobs,
};

/// Where a step stands: what decoupled PPO's proximal policy and the step's random choices need.
#[derive(Clone, Copy)]
pub struct StepAt<'a> {
    /// Seeds the step's random choices (Clip-Cov).
    pub seed: u64,
    /// The 0-based step since the run started: the data's staleness is `1 + index` steps for
    /// decoupled PPO's log-linear proximal policy.
    pub index: usize,
    /// The model as the run started, for decoupled PPO's recomputed proximal policy.
    pub start: Option<&'a Llama>,
}

/// Decoupled PPO's proximal log-probs of micro-batch `p` (`None` for the other losses), given
/// π's log-probs `lp`: recomputed by the model the run started with, or AReaL's log-linear
/// approximation between μ and π at the step's staleness.
fn proximal(
    loss: &Loss,
    lp: &topr_loss::TokenLogProbs,
    p: &MicroBatch,
    at: StepAt,
) -> Result<Option<Tensor>, LossError> {
    use crate::settings::Proximal;
    let Loss::DecoupledPpo(_, how) = loss else { return Ok(None) };
    Ok(Some(match (how, at.start) {
        (Proximal::Recompute, Some(start)) => tch::no_grad(|| -> Result<Tensor, LossError> {
            let logits = start.next_token_logits(&p.ids, &p.attn, p.from).map_err(|e| LossError::InvalidConfig {
                field: "proximal",
                value: f64::NAN,
                reason: format!("the start model's forward pass failed: {e:#}"),
            })?;
            Ok(token_logprobs(&logits, &p.labels, Some(&p.mask), &LogProbConfig::default())?.logp)
        })?,
        (Proximal::Recompute, None) => {
            return Err(LossError::InvalidConfig {
                field: "proximal",
                value: f64::NAN,
                reason: "the recomputed proximal policy needs the model the run started with".into(),
            });
        }
        (_, _) => {
            let staleness = Tensor::full([p.mask.size()[0]], (at.index + 1) as f64, (Kind::Double, p.mask.device()));
            let how = ProximalApproximation::LogLinear;
            proximal_logprobs_with_checks(&p.logp_mu, &lp.logp, &staleness, &lp.mask, how, Checks::Shapes)?
        }
    }))
}

/// Accumulates the gradient of one optimiser step over micro-batches of about `micro`
/// completions (does not step). The loss uses the counts of the whole step, so the sum over
/// micro-batches is the full-batch loss and its gradient. `extras` adds what every token-level
/// loss of the step gets (rollout correction, top-entropy tokens, KL to μ, entropy bonus); `at`
/// seeds the step's random choices (Clip-Cov) and gives decoupled PPO its proximal policy.
///
/// With a process `group`, `batch` is the whole step and this rank computes its contiguous share
/// of it ([`parallel::shard`]): the counts are summed over ranks before any loss, the gradients
/// after the backward passes, and the metrics are those of the whole step. Every rank then holds
/// the gradient one process would hold (up to the order of float additions).
pub fn accumulate(
    model: &Llama,
    batch: &[Unit],
    micro: usize,
    loss: &Loss,
    extras: &Extras,
    at: StepAt,
    group: Option<&ProcessGroup>,
) -> Result<StepStats> {
    let seed = at.seed;
    if batch.is_empty() {
        bail!("an optimiser step needs at least one completion");
    }
    let share = parallel::shard(group).range(batch.len());
    let mine = &batch[share.clone()];
    let parts = if mine.is_empty() { vec![] } else { micro_batches(mine, micro, model.device())? };
    let masks: Vec<&Tensor> = parts.iter().map(|p| &p.mask).collect();
    let local = Normalizer::from_masks(&masks)?;
    let mut counts = [local.tokens.unwrap_or(0.0), local.sequences.unwrap_or(0.0), mine.len() as f64];
    parallel::sum(group, &mut counts)?;
    let normalizer = Normalizer::global(BatchCounts { tokens: counts[0], sequences: counts[1] });
    let pairs_in_step = counts[2];
    // The logits of the largest micro-batch, their log-softmax and their gradient (f32): a lower
    // bound of what the step holds, refused when even that cannot fit.
    if let Some(p) = parts.iter().max_by_key(|p| p.labels.numel()) {
        let (n, l) = (p.labels.size()[0], p.labels.size()[1]);
        let bytes = (p.labels.numel() as u64) * (model.cfg.vocab_size as u64) * 12;
        crate::memory::fits(
            model.device(),
            bytes,
            &format!(
                "the logits of a micro-batch of {n} completion(s) × {l} predicted positions × {} ids",
                model.cfg.vocab_size
            ),
        )?;
    }
    let lp_cfg = LogProbConfig::default().with_entropy(extras.needs_entropy());
    let mut tally = Tally::default();
    let (mut values, mut tokens) = (vec![], vec![]);
    for (k, p) in parts.iter().enumerate() {
        let logits = model.next_token_logits(&p.ids, &p.attn, p.from)?;
        let value = backward_through_logprobs(&logits, &p.labels, Some(&p.mask), &lp_cfg, |lp| {
            // Keyed by the rank's first unit and the micro-batch's index: distinct across ranks.
            let keys_seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add((share.start + k) as u64);
            let prox = proximal(loss, lp, p, at)?;
            loss.micro_batch(lp, p, prox.as_ref(), normalizer, pairs_in_step, extras, keys_seed, &mut tally)
        })?;
        values.push(value.detach());
        tokens.push(p.mask.sum(Kind::Int64));
    }
    parallel::sum_gradients(group, &model.vs.trainable_variables())?;
    // Every micro-batch is queued: the metrics are read now, in micro-batch order, and combined
    // over ranks.
    let mut part = StepPart::default();
    for (v, n) in values.iter().zip(&tokens) {
        part.loss += v.double_value(&[]);
        part.tokens += n.int64_value(&[]) as f64;
    }
    part.sequences = mine.iter().map(Unit::completions).sum::<usize>() as f64;
    part.add_tally(&tally.read()?);
    let rows = parallel::gather(group, &part.row())?;
    Ok(StepPart::combine(&rows).stats(loss, pairs_in_step))
}

/// One rank's sums of a step's metrics; [`StepPart::combine`] adds them over ranks (and takes
/// the maximum where the metric is one).
#[derive(Default)]
struct StepPart {
    loss: f64,
    tokens: f64,
    sequences: f64,
    log_ratio: f64,
    clipped: f64,
    dpo_accuracy: f64,
    dpo_margin: f64,
    /// The TOPR diagnostics: Σ samples, Σ samples · (negative fraction, truncated fractions,
    /// weight mean, log-ratio mean), the largest weight, Σ and count of the effective positive
    /// proportions.
    topr_samples: f64,
    topr_weighted: [f64; 5],
    topr_weight_max: f64,
    epp_sum: f64,
    epp_count: f64,
}

impl StepPart {
    const LEN: usize = 16;

    fn add_tally(&mut self, t: &TallySums) {
        self.log_ratio += t.log_ratio;
        self.clipped += t.clipped;
        self.dpo_accuracy += t.dpo_accuracy;
        self.dpo_margin += t.dpo_margin;
        for d in &t.diags {
            let s = d.samples as f64;
            self.topr_samples += s;
            let fields = [
                d.negative_fraction,
                d.truncated_fraction_pos,
                d.truncated_fraction_neg,
                d.weight_mean,
                d.log_ratio_mean,
            ];
            for (acc, f) in self.topr_weighted.iter_mut().zip(fields) {
                *acc += f * s;
            }
            self.topr_weight_max = self.topr_weight_max.max(d.weight_max);
            if let Some(p) = d.effective_positive_proportion {
                self.epp_sum += p;
                self.epp_count += 1.0;
            }
        }
    }

    fn row(&self) -> Vec<f64> {
        let mut r = vec![self.loss, self.tokens, self.sequences, self.log_ratio, self.clipped];
        r.extend([self.dpo_accuracy, self.dpo_margin, self.topr_samples]);
        r.extend(self.topr_weighted);
        r.extend([self.topr_weight_max, self.epp_sum, self.epp_count]);
        debug_assert_eq!(r.len(), Self::LEN);
        r
    }

    fn combine(rows: &[Vec<f64>]) -> Self {
        let mut sum = [0.0; Self::LEN];
        let mut max = 0.0f64;
        for r in rows {
            for (acc, v) in sum.iter_mut().zip(r) {
                *acc += v;
            }
            max = max.max(r[13]);
        }
        Self {
            loss: sum[0],
            tokens: sum[1],
            sequences: sum[2],
            log_ratio: sum[3],
            clipped: sum[4],
            dpo_accuracy: sum[5],
            dpo_margin: sum[6],
            topr_samples: sum[7],
            topr_weighted: [sum[8], sum[9], sum[10], sum[11], sum[12]],
            topr_weight_max: max,
            epp_sum: sum[14],
            epp_count: sum[15],
        }
    }

    fn stats(&self, loss: &Loss, pairs_in_step: f64) -> StepStats {
        let tokens = self.tokens.max(1.0);
        let mut stats = StepStats {
            sequences: self.sequences as usize,
            tokens: self.tokens as usize,
            loss: self.loss,
            log_ratio_mean: self.log_ratio / tokens,
            ..Default::default()
        };
        match loss {
            Loss::Topr(_) => {
                let n = self.topr_samples.max(1.0);
                let [neg, pos_t, neg_t, wmean, lrm] = self.topr_weighted.map(|v| v / n);
                stats.topr = Some(ToprStats {
                    negative_fraction: neg,
                    truncated_fraction_pos: pos_t,
                    truncated_fraction_neg: neg_t,
                    weight_mean: wmean,
                    weight_max: self.topr_weight_max,
                    log_ratio_mean: lrm,
                    effective_positive_proportion: (self.epp_count > 0.0).then(|| self.epp_sum / self.epp_count),
                })
            }
            Loss::Ppo(_) | Loss::Gspo(_) | Loss::Cispo(_) => stats.clip_fraction = Some(self.clipped / tokens),
            Loss::Sapo(_)
            | Loss::Gmpo(_)
            | Loss::ClipCov(_)
            | Loss::KlCov(_)
            | Loss::Dppo(_)
            | Loss::Dro(_)
            | Loss::DecoupledPpo(..)
            | Loss::Vespo(_)
            | Loss::Bapo(_)
            | Loss::PrefixRatio(_) => {}
            Loss::Dpo(..) | Loss::DpoMix(..) => {
                stats.dpo_accuracy = Some(self.dpo_accuracy / pairs_in_step);
                stats.dpo_margin = Some(self.dpo_margin / pairs_in_step);
            }
        }
        stats
    }
}

/// `sqrt(Σ g²)` over the trainable parameters, then scales the gradients so that it is at most
/// `max_norm` (when given). Returns the norm before clipping. One host read: the per-parameter
/// sums stay on the device until their total is read.
pub fn clip_grad_norm(vars: &[Tensor], max_norm: Option<f64>) -> f64 {
    let sums: Vec<Tensor> = vars
        .iter()
        .filter(|v| v.grad().defined())
        .map(|v| v.grad().to_kind(Kind::Double).square().sum(Kind::Double))
        .collect();
    let sq = if sums.is_empty() { 0.0 } else { Tensor::stack(&sums, 0).sum(Kind::Double).double_value(&[]) };
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
