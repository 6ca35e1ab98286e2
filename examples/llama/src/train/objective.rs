//! The objectives and every call into `topr_loss` that training makes: baselines and the
//! effective positive proportion, GRPO's group advantages, and the loss of one micro-batch
//! (TOPR family, PPO-clip, DPO) with the diagnostics a step logs.

use super::units::MicroBatch;
use crate::dataset::Sample;
use crate::settings::{Baseline, Objective, Proximal};
use anyhow::Result;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, BapoConfig, Checks, ClipCovConfig, DecoupledPpoConfig, DpoConfig, DpoDiagnostics, DpoMix,
    DppoConfig, DroConfig, EntropyConfig, GmpoConfig, KlConfig, KlCovConfig, LossError, Normalizer, OnDevice,
    PositiveNllConfig, PpoConfig, PrefixRatioConfig, Rejection, RolloutCorrection, SapoConfig, SequenceReduce,
    TokenLogProbs, ToprDiagnostics, ToprTokenConfig, VespoConfig, apply_token_weights, bapo_loss_output,
    baseline_for_effective_proportion, cispo_loss_output, clip_cov_loss_output, decoupled_ppo_loss_output,
    dpo_loss_output, dpo_mix_loss_output, dppo_loss_output, dro_loss_output, entropy_loss_output, gmpo_loss_output,
    gspo_loss_output, kl_cov_loss_output, kl_penalty_output, off_policy_sequence_mask, positive_nll_loss_output,
    ppo_clip_loss_output, prefix_ratio_loss_output, rollout_rejection_mask_all, rollout_weights, sapo_loss_output,
    sequence_logprobs, top_entropy_mask, topr_token_loss_output, vespo_loss_output,
};

/// The baseline `c` and the data set's share of positives `p`: `c` given, or derived from `p`
/// and a target effective proportion `p̃` (rewards ±1; `c = 0`, with a warning, when every
/// sample has the same sign, as no baseline can then change their share).
pub fn resolve_baseline(data: &[Sample], baseline: Baseline) -> Result<(f64, f64)> {
    let p = data.iter().filter(|s| s.reward > 0.0).count() as f64 / data.len().max(1) as f64;
    let c = match baseline {
        Baseline::Fixed(c) => c,
        // All samples of one sign: no baseline changes their share. Train with c = 0 rather than
        // stop a loop whose model got every sample wrong (or right) this time.
        Baseline::TargetPositiveProportion(_) if p == 0.0 || p == 1.0 => {
            eprintln!(
                "warning: every completion is {}: the target positive proportion cannot be met; using baseline c = 0",
                if p == 0.0 { "wrong" } else { "right" }
            );
            0.0
        }
        Baseline::TargetPositiveProportion(pt) => baseline_for_effective_proportion(p, pt)?,
        Baseline::Zero => 0.0,
    };
    Ok((c, p))
}

/// The effective positive proportion `p̃` of a data set with share of positives `p` under
/// baseline `c` (rewards ±1; 1 for SFT, which gives negatives no weight; `None` for GRPO and DPO,
/// whose weights are not `R − c`).
pub fn p_tilde(objective: Objective, p: f64, c: f64) -> Result<Option<f64>> {
    Ok(match objective {
        Objective::Sft => Some(1.0),
        o if o == Objective::Dpo || o.uses_group_advantages() => None,
        _ => Some(topr_loss::effective_positive_proportion(p, c.clamp(-1.0, 1.0))?),
    })
}

/// The loss one step computes, with everything fixed for the run.
#[derive(Debug, Clone, Copy)]
pub enum Loss {
    /// The TOPR family on rewards (the baseline is in the config).
    Topr(ToprTokenConfig),
    /// PPO-clip on per-sequence advantages.
    Ppo(PpoConfig),
    /// GSPO on per-sequence advantages.
    Gspo(PpoConfig),
    /// CISPO on per-sequence advantages.
    Cispo(PpoConfig),
    /// SAPO on per-sequence advantages.
    Sapo(SapoConfig),
    /// GMPO on per-sequence advantages.
    Gmpo(GmpoConfig),
    /// Clip-Cov on per-sequence advantages.
    ClipCov(ClipCovConfig),
    /// KL-Cov on per-sequence advantages.
    KlCov(KlCovConfig),
    /// DPPO on per-sequence advantages.
    Dppo(DppoConfig),
    /// DRO's penalised REINFORCE on per-sequence advantages.
    Dro(DroConfig),
    /// Decoupled PPO on per-sequence advantages, with where its proximal policy comes from.
    DecoupledPpo(DecoupledPpoConfig, Proximal),
    /// VESPO on per-sequence advantages.
    Vespo(VespoConfig),
    /// BAPO on per-sequence advantages (bounds chosen per micro-batch).
    Bapo(BapoConfig),
    /// CTPO's prefix ratio on per-sequence advantages.
    PrefixRatio(PrefixRatioConfig),
    /// DPO-family loss on pairs, with sequence log-probs summed or averaged over tokens.
    Dpo(DpoConfig, SequenceReduce),
    /// A weighted sum of DPO-family losses on the same pairs (TRL's `loss_weights`).
    DpoMix(DpoMix, SequenceReduce),
}

impl Loss {
    /// The loss of `objective` with baseline `c`, TOPR's `ratio` level and DPO's `dpo_beta`.
    ///
    /// The losses run with [`Checks::Shapes`]: no host synchronisation inside a loss call. Their
    /// inputs come from checked records and the model's own log-probs, and a non-finite loss
    /// is still refused once per optimiser step (`optimizer_step`), where the step's loss is read
    /// for its metrics anyway.
    pub fn new(o: &super::TrainSettings, c: f64) -> Self {
        let fast = Checks::Shapes;
        match o.objective {
            Objective::Ppo => Loss::Ppo(PpoConfig::ppo().with_checks(fast)),
            Objective::Grpo => {
                Loss::Ppo(PpoConfig::ppo().with_aggregation(AggregationMode::SeqMeanTokenMean).with_checks(fast))
            }
            Objective::Dpo => match (o.dpo_mix_config(fast), o.dpo_mix.first()) {
                (Some(mix), Some((first, _))) => Loss::DpoMix(mix, first.reduce()),
                _ => Loss::Dpo(
                    o.dpo_loss.config(o.dpo_beta, o.dpo_label_smoothing).with_checks(fast),
                    o.dpo_loss.reduce(),
                ),
            },
            Objective::Gspo => Loss::Gspo(PpoConfig::gspo().with_checks(fast)),
            Objective::Cispo => Loss::Cispo(PpoConfig::cispo().with_checks(fast)),
            Objective::Sapo => Loss::Sapo(SapoConfig::sapo().with_checks(fast)),
            Objective::Gmpo => Loss::Gmpo(GmpoConfig::gmpo().with_checks(fast)),
            Objective::ClipCov => Loss::ClipCov(ClipCovConfig::clip_cov().with_checks(fast)),
            Objective::KlCov => Loss::KlCov(KlCovConfig::kl_cov().with_checks(fast)),
            Objective::DppoTv => Loss::Dppo(DppoConfig::tv().with_checks(fast)),
            Objective::DppoKl => Loss::Dppo(DppoConfig::binary_kl().with_checks(fast)),
            Objective::Dro => Loss::Dro(DroConfig::new(o.dro_beta).with_checks(fast)),
            Objective::DecoupledPpo => Loss::DecoupledPpo(DecoupledPpoConfig::areal().with_checks(fast), o.proximal),
            Objective::Vespo => Loss::Vespo(VespoConfig::vespo().with_checks(fast)),
            Objective::Bapo => Loss::Bapo(BapoConfig::paper().with_checks(fast)),
            Objective::PrefixRatio => Loss::PrefixRatio(PrefixRatioConfig::ctpo_la().with_checks(fast)),
            other => Loss::Topr(
                ToprTokenConfig::paper()
                    .with_topr(other.limits().unwrap_or_default().with_baseline(c).with_checks(fast))
                    .with_ratio(o.ratio),
            ),
        }
    }

    /// The loss of one micro-batch `p` given π's log-probs `lp`, with the counts of the whole
    /// step (`normalizer`, and `pairs_in_step` for DPO) and the step's `extras`, adding its
    /// diagnostics to `tally`. `keys_seed` seeds Clip-Cov's random choice of tokens; `proximal`
    /// is decoupled PPO's proximal log-probs (`[B, T]`, detached).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn micro_batch(
        &self,
        lp: &TokenLogProbs,
        p: &MicroBatch,
        proximal: Option<&Tensor>,
        normalizer: Normalizer,
        pairs_in_step: f64,
        extras: &Extras,
        keys_seed: u64,
        tally: &mut Tally,
    ) -> Result<Tensor, LossError> {
        let delta = &lp.logp.detach() - &p.logp_mu;
        tally.log_ratio.push(masked_sum(&delta, &lp.mask));
        let (logp, mu, adv, mask) = (&lp.logp, &p.logp_mu, &p.values, &lp.mask);
        let norm = &normalizer;
        // The main loss's value, its per-token terms and its aggregation.
        let (loss, terms, mode) = match self {
            Loss::Topr(cfg) => {
                // The loss and its diagnostics from one pass, with the step's counts.
                let out = topr_token_loss_output(logp, mu, adv, mask, cfg, norm)?;
                tally.diags.push(out.diagnostics);
                (out.loss, out.terms, cfg.aggregation)
            }
            Loss::Ppo(cfg) | Loss::Gspo(cfg) | Loss::Cispo(cfg) => {
                let ratio = delta.exp();
                let outside = ratio.lt(1.0 - cfg.clip_low).logical_or(&ratio.gt(1.0 + cfg.clip_high));
                tally.clipped.push(masked_sum(&outside, mask));
                let out = match self {
                    Loss::Gspo(_) => gspo_loss_output(logp, mu, adv, mask, cfg, norm)?,
                    Loss::Cispo(_) => cispo_loss_output(logp, mu, adv, mask, cfg, norm)?,
                    _ => ppo_clip_loss_output(logp, mu, adv, mask, cfg, norm)?,
                };
                (out.loss, out.terms, cfg.aggregation)
            }
            Loss::Sapo(cfg) => value_and_terms(sapo_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation),
            Loss::Gmpo(cfg) => value_and_terms(gmpo_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation),
            Loss::ClipCov(cfg) => {
                let keys = clip_cov_keys(&mask.size(), keys_seed, logp.device());
                let out = clip_cov_loss_output(logp, mu, adv, mask, &keys, cfg, norm)?;
                (out.loss, out.terms, cfg.aggregation)
            }
            Loss::KlCov(cfg) => value_and_terms(kl_cov_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation),
            Loss::Dppo(cfg) => value_and_terms(dppo_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation),
            Loss::Dro(cfg) => value_and_terms(dro_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation),
            Loss::DecoupledPpo(cfg, _) => decoupled(cfg, proximal, lp, p, norm)?,
            Loss::Vespo(cfg) => value_and_terms(vespo_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation),
            Loss::Bapo(cfg) => value_and_terms(bapo_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation),
            Loss::PrefixRatio(cfg) => {
                value_and_terms(prefix_ratio_loss_output(logp, mu, adv, mask, cfg, norm)?, cfg.aggregation)
            }
            Loss::Dpo(cfg, reduce) => {
                // Σ ℓ over this micro-batch's pairs, divided by the pairs of the whole step.
                let (pw, pl, rw, rl, n) = dpo_pairs(lp, p, *reduce)?;
                let out = dpo_loss_output(&pw, &pl, &rw, &rl, cfg, &Normalizer::sequences(pairs_in_step))?;
                tally.dpo.push((out.diagnostics, n));
                return Ok(out.loss);
            }
            Loss::DpoMix(mix, reduce) => {
                let (pw, pl, rw, rl, n) = dpo_pairs(lp, p, *reduce)?;
                let out = dpo_mix_loss_output(&pw, &pl, &rw, &rl, mix, &Normalizer::sequences(pairs_in_step))?;
                tally.dpo.push((out.diagnostics, n));
                return Ok(out.loss);
            }
        };
        extras.apply(loss, &terms, mode, lp, p, norm)
    }
}

/// Decoupled PPO's value, terms and aggregation on micro-batch `p`, μ as the behaviour policy.
fn decoupled(
    cfg: &DecoupledPpoConfig,
    proximal: Option<&Tensor>,
    lp: &TokenLogProbs,
    p: &MicroBatch,
    norm: &Normalizer,
) -> Result<(Tensor, Tensor, AggregationMode), LossError> {
    let prox = proximal.ok_or_else(|| LossError::InvalidConfig {
        field: "proximal",
        value: f64::NAN,
        reason: "decoupled PPO needs its proximal log-probs".into(),
    })?;
    let out = decoupled_ppo_loss_output(&lp.logp, prox, &p.logp_mu, &p.values, &lp.mask, cfg, norm)?;
    Ok(value_and_terms(out.output, cfg.ppo.aggregation))
}

/// A token-level loss's value, its per-token terms and their aggregation.
fn value_and_terms<D>(out: topr_loss::LossOutput<D>, mode: AggregationMode) -> (Tensor, Tensor, AggregationMode) {
    (out.loss, out.terms, mode)
}

/// A DPO micro-batch's sequence log-probs of π and μ for its chosen (first half) and rejected
/// (second half) completions, and its number of pairs.
fn dpo_pairs(
    lp: &TokenLogProbs,
    p: &MicroBatch,
    reduce: SequenceReduce,
) -> Result<(Tensor, Tensor, Tensor, Tensor, f64), LossError> {
    let n = lp.logp.size()[0] / 2;
    let seq = sequence_logprobs(&lp.logp, &lp.mask, reduce)?;
    let mu = sequence_logprobs(&p.logp_mu, &lp.mask, reduce)?;
    Ok((seq.narrow(0, 0, n), seq.narrow(0, n, n), mu.narrow(0, 0, n), mu.narrow(0, n, n), n as f64))
}

/// Clip-Cov's random keys `[B, T]`: uniform draws from the example's own generator, seeded per
/// step and micro-batch, so that a resumed run draws the same tokens.
fn clip_cov_keys(shape: &[i64], seed: u64, device: tch::Device) -> Tensor {
    let mut rng = crate::task::Rng::new(seed);
    let n: i64 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
    Tensor::from_slice(&v).view(shape).to_device(device)
}

/// What every token-level loss of a step gets besides its own terms: importance weights of π
/// against μ (rollout correction), the top-entropy token selection, a KL penalty to μ and an
/// entropy bonus. `Default` is none of them.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    /// Weights of π (detached) against μ on the loss's terms.
    pub correction: Option<RolloutCorrection>,
    /// Drop (weight 0) the tokens or sequences whose divergence statistic of π against μ
    /// leaves any rule's bounds, every rule computed on the original mask (verl's combination).
    pub rejection: Vec<Rejection>,
    /// DeepSeek-V3.2's off-policy sequence mask at this threshold: drop a completion whose value
    /// (reward for the TOPR family, advantage otherwise) is negative and whose mean
    /// `log μ − log π` exceeds it.
    pub off_policy_mask: Option<f64>,
    /// Train only this share of each micro-batch's tokens, those of highest entropy (the
    /// others get weight 0, and the counts stay those of all tokens, as TRL).
    pub top_entropy: Option<f64>,
    /// A KL penalty of π to μ (the model that sampled the data: the iteration's start).
    pub kl: Option<KlConfig>,
    /// An entropy bonus.
    pub entropy: Option<EntropyConfig>,
    /// VAPO's NLL of the correct completions, with its coefficient.
    pub positive_nll: Option<PositiveNllConfig>,
}

impl Extras {
    /// Whether the per-token entropy must be computed.
    pub fn needs_entropy(&self) -> bool {
        self.top_entropy.is_some() || self.entropy.is_some()
    }

    /// `loss`, re-aggregated from its `terms` with the weights that apply, plus the KL and
    /// entropy terms.
    fn apply(
        &self,
        loss: Tensor,
        terms: &Tensor,
        mode: AggregationMode,
        lp: &TokenLogProbs,
        p: &MicroBatch,
        norm: &Normalizer,
    ) -> Result<Tensor, LossError> {
        // Every factor of the weights: importance weights, then 0/1 selections.
        let mut factors: Vec<Tensor> = vec![];
        if let Some(rc) = &self.correction {
            factors.push(rollout_weights(&lp.logp, &p.logp_mu, &lp.mask, rc)?.weights);
        }
        if !self.rejection.is_empty() {
            factors.push(rollout_rejection_mask_all(&lp.logp, &p.logp_mu, &lp.mask, &self.rejection)?);
        }
        if let Some(threshold) = self.off_policy_mask {
            factors.push(off_policy_sequence_mask(&lp.logp, &p.logp_mu, &p.values, &lp.mask, threshold)?);
        }
        if let (Some(rho), Some(h)) = (self.top_entropy, &lp.entropy) {
            factors.push(top_entropy_mask(&h.detach(), &lp.mask, rho, Checks::Shapes)?);
        }
        let kind = lp.logp.kind();
        let weights = factors.into_iter().map(|f| f.to_kind(kind)).reduce(|a, b| a * b);
        let mut parts = vec![match weights {
            Some(w) => apply_token_weights(terms, &w, &lp.mask, mode, norm)?,
            None => loss,
        }];
        if let Some(kl) = &self.kl {
            parts.push(kl_penalty_output(&lp.logp, &p.logp_mu, &lp.mask, kl, norm)?.loss);
        }
        if let (Some(e), Some(h)) = (&self.entropy, &lp.entropy) {
            parts.push(entropy_loss_output(h, &lp.mask, e, norm)?.loss);
        }
        if let Some(nll) = &self.positive_nll {
            parts.push(positive_nll_loss_output(&lp.logp, &lp.mask, &p.correct, nll, norm)?.loss);
        }
        Ok(parts.into_iter().reduce(|a, b| a + b).unwrap_or_else(|| Tensor::from(0.0)))
    }
}

/// The diagnostics of one step's micro-batches, kept on the device until the step has queued
/// all its work: reading them per micro-batch would stall the device after each one.
#[derive(Default)]
pub(super) struct Tally {
    pub diags: Vec<OnDevice<ToprDiagnostics>>,
    /// Tokens whose PPO ratio lies outside the clip range, per micro-batch (f64 scalars).
    pub clipped: Vec<Tensor>,
    /// Σ `log π − log μ` over the completion tokens, per micro-batch (f64 scalars).
    pub log_ratio: Vec<Tensor>,
    /// DPO: each micro-batch's diagnostics and pairs.
    pub dpo: Vec<(OnDevice<DpoDiagnostics>, f64)>,
}

/// The sums a step's metrics need, read from a [`Tally`] once its micro-batches are queued, in
/// micro-batch order (so that the sums are the same as when read one micro-batch at a time).
pub(super) struct TallySums {
    pub diags: Vec<ToprDiagnostics>,
    pub clipped: f64,
    pub log_ratio: f64,
    pub dpo_accuracy: f64,
    pub dpo_margin: f64,
}

impl Tally {
    pub fn read(&self) -> Result<TallySums, LossError> {
        let sum = |v: &[Tensor]| v.iter().map(|t| t.double_value(&[])).sum::<f64>();
        let mut out = TallySums {
            diags: self.diags.iter().map(OnDevice::read).collect::<Result<_, _>>()?,
            clipped: sum(&self.clipped),
            log_ratio: sum(&self.log_ratio),
            dpo_accuracy: 0.0,
            dpo_margin: 0.0,
        };
        for (d, n) in &self.dpo {
            let d = d.read()?;
            out.dpo_accuracy += d.accuracy * n;
            out.dpo_margin += d.margin * n;
        }
        Ok(out)
    }
}

/// Σ over the masked tokens of `x`, as an f64 scalar on the device.
fn masked_sum(x: &Tensor, mask: &Tensor) -> Tensor {
    x.detach().to_kind(Kind::Double).masked_select(mask).sum(Kind::Double)
}
