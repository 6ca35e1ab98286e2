//! The objectives and every call into `topr_loss` that training makes: baselines and the
//! effective positive proportion, GRPO's group advantages, and the loss of one micro-batch
//! (TOPR family, PPO-clip, DPO) with the diagnostics a step logs.

use super::batch::MicroBatch;
use crate::sample::Sample;
use anyhow::{Result, bail};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, Checks, ClipCovConfig, DpoConfig, DpoDiagnostics, DpoMix, EntropyConfig, GmpoConfig,
    GroupAdvantage, KlConfig, KlCovConfig, LossError, Normalizer, OnDevice, PpoConfig, Rejection, RolloutCorrection,
    SapoConfig, SequenceReduce, SingletonGroup, TokenLogProbs, ToprConfig, ToprDiagnostics, ToprTokenConfig,
    apply_token_weights, baseline_for_effective_proportion, cispo_loss_output, clip_cov_loss_output, dpo_loss_output,
    dpo_mix_loss_output, entropy_loss_output, gmpo_loss_output, group_advantages, gspo_loss_output, kl_cov_loss_output,
    kl_penalty_output, off_policy_sequence_mask, opo_advantages, ppo_clip_loss_output, reinforce_pp_advantages,
    reinforce_pp_baseline_advantages, rollout_rejection_mask, rollout_weights, sapo_loss_output, sequence_logprobs,
    top_entropy_mask, topr_token_loss_output,
};

/// The objectives `train` offers.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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
    /// GSPO (sequence ratio `exp(mean_t δ)`, ε = 3e-4/4e-4, sequence mean) with GRPO's group
    /// advantages.
    Gspo,
    /// CISPO (clipped, stop-gradient ratio on REINFORCE; ε_high = 0.28) with GRPO's group
    /// advantages.
    Cispo,
    /// SAPO (a smooth sigmoid gate in place of the clip) with group advantages.
    Sapo,
    /// GMPO (geometric mean of clipped token ratios) with group advantages.
    Gmpo,
    /// Clip-Cov (PPO without clipping except on a random share of high-covariance tokens).
    ClipCov,
    /// KL-Cov (PPO without clipping plus a KL term on the top-covariance tokens).
    KlCov,
}

impl Objective {
    /// Whether the objective weighs completions by group advantages (`--advantage`).
    pub fn uses_group_advantages(self) -> bool {
        matches!(self, Self::Grpo | Self::Gspo | Self::Cispo | Self::Sapo | Self::Gmpo | Self::ClipCov | Self::KlCov)
    }
}

/// How `--objective grpo|gspo|cispo|sapo|gmpo|clip-cov|kl-cov` turn each question's rewards into
/// advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Advantage {
    /// `(R − mean_g) / (std_g + 1e-6)` (GRPO).
    #[default]
    Grpo,
    /// `R − mean_g` (Dr. GRPO).
    DrGrpo,
    /// Leave-one-out mean (RLOO).
    Rloo,
    /// `(R − mean_g) / (std over the whole data set + 1e-4)` (TRL's `scale_rewards="batch"`).
    BatchStd,
    /// OPO's length-weighted group baseline `R − Σ L R / Σ L`.
    Opo,
    /// REINFORCE++: outcome reward at the last token, γ = 1, whitened over all tokens.
    ReinforcePp,
    /// REINFORCE++-baseline: `R − mean_g`, whitened over all tokens.
    ReinforcePpBaseline,
}

impl Objective {
    /// The truncation limits of the TOPR-family objectives (`None` for the others).
    pub fn limits(self) -> Option<ToprConfig> {
        Some(match self {
            Self::Topr => ToprConfig::canonical(),
            Self::Tis => ToprConfig::tis(),
            Self::Sft => ToprConfig::sft(),
            Self::Reinforce => ToprConfig::naive_reinforce(),
            Self::Is => ToprConfig::importance_sampling(),
            _ => return None,
        })
    }

    /// The objective's name as summaries write it and `--objective` takes it (`topr`, `ppo`,
    /// `clip-cov`, ...).
    pub fn name(self) -> String {
        match self {
            Self::ClipCov => "clip-cov".into(),
            Self::KlCov => "kl-cov".into(),
            other => format!("{other:?}").to_lowercase(),
        }
    }
}

/// Which loss of the DPO family `--objective dpo` trains with (TRL's `loss_type` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DpoLoss {
    #[default]
    Sigmoid,
    Ipo,
    Hinge,
    Robust,
    ExoPair,
    NcaPair,
    BcoPair,
    SppoHard,
    Aot,
    AotUnpaired,
    ApoZero,
    ApoDown,
    Discopop,
    SigmoidNorm,
}

impl DpoLoss {
    /// The crate's preset for this loss with `β` and label smoothing `ε` (the presets that take
    /// none ignore `ε`).
    pub fn config(self, beta: f64, eps: f64) -> DpoConfig {
        let c = match self {
            Self::Sigmoid => DpoConfig::cdpo(eps),
            Self::Ipo => DpoConfig::ipo(),
            Self::Hinge => DpoConfig::hinge(),
            Self::Robust => DpoConfig::robust(eps),
            Self::ExoPair => DpoConfig::exo_pair(eps),
            Self::NcaPair => DpoConfig::nca_pair(),
            Self::BcoPair => DpoConfig::bco_pair(),
            Self::SppoHard => DpoConfig::sppo_hard(),
            Self::Aot => DpoConfig::aot().with_label_smoothing(eps),
            Self::AotUnpaired => DpoConfig::aot_unpaired().with_label_smoothing(eps),
            Self::ApoZero => DpoConfig::apo_zero(),
            Self::ApoDown => DpoConfig::apo_down(),
            Self::Discopop => DpoConfig::discopop(),
            Self::SigmoidNorm => DpoConfig::sigmoid_norm().with_label_smoothing(eps),
        };
        c.with_beta(beta)
    }

    /// How sequence log-probs are formed: per-token means for IPO and sigmoid-norm (their
    /// published scale), sums otherwise.
    pub fn reduce(self) -> SequenceReduce {
        match self {
            Self::Ipo | Self::SigmoidNorm => SequenceReduce::Mean,
            _ => SequenceReduce::Sum,
        }
    }
}

/// The baseline `c` subtracted from rewards (TOPR family, PPO).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Baseline {
    /// `c = 0`.
    #[default]
    Zero,
    /// A given `c`.
    Fixed(f64),
    /// Derived from the data set's share of positives so that positives carry this share `p̃` of
    /// the weight (the paper finds 0.1–0.2 best on GSM8K).
    TargetPositiveProportion(f64),
}

impl Baseline {
    /// The baseline as tables write it: `c = 0`, `c = 0.3`, `c for p̃ = 0.5`.
    pub fn describe(self) -> String {
        match self {
            Self::Zero => "c = 0".into(),
            Self::Fixed(c) => format!("c = {c}"),
            Self::TargetPositiveProportion(p) => format!("c for p̃ = {p}"),
        }
    }
}

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
            Objective::Dpo if !o.dpo_mix.is_empty() => {
                let term = |l: DpoLoss| l.config(o.dpo_beta, o.dpo_label_smoothing).with_checks(fast);
                let (first, rest) = (o.dpo_mix[0], &o.dpo_mix[1..]);
                let mix = rest.iter().fold(DpoMix::of(term(first.0), first.1), |m, &(l, w)| m.with_term(term(l), w));
                Loss::DpoMix(mix, first.0.reduce())
            }
            Objective::Dpo => {
                Loss::Dpo(o.dpo_loss.config(o.dpo_beta, o.dpo_label_smoothing).with_checks(fast), o.dpo_loss.reduce())
            }
            Objective::Gspo => Loss::Gspo(PpoConfig::gspo().with_checks(fast)),
            Objective::Cispo => Loss::Cispo(PpoConfig::cispo().with_checks(fast)),
            Objective::Sapo => Loss::Sapo(SapoConfig::sapo().with_checks(fast)),
            Objective::Gmpo => Loss::Gmpo(GmpoConfig::gmpo().with_checks(fast)),
            Objective::ClipCov => Loss::ClipCov(ClipCovConfig::clip_cov().with_checks(fast)),
            Objective::KlCov => Loss::KlCov(KlCovConfig::kl_cov().with_checks(fast)),
            other => Loss::Topr(
                ToprTokenConfig::paper()
                    .with_topr(other.limits().unwrap_or_default().with_baseline(c).with_checks(fast))
                    .with_ratio(o.ratio),
            ),
        }
    }

    /// The loss of one micro-batch `p` given π's log-probs `lp`, with the counts of the whole
    /// step (`normalizer`, and `pairs_in_step` for DPO) and the step's `extras`, adding its
    /// diagnostics to `tally`. `keys_seed` seeds Clip-Cov's random choice of tokens.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn micro_batch(
        &self,
        lp: &TokenLogProbs,
        p: &MicroBatch,
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
            Loss::Sapo(cfg) => {
                let out = sapo_loss_output(logp, mu, adv, mask, cfg, norm)?;
                (out.loss, out.terms, cfg.aggregation)
            }
            Loss::Gmpo(cfg) => {
                let out = gmpo_loss_output(logp, mu, adv, mask, cfg, norm)?;
                (out.loss, out.terms, cfg.aggregation)
            }
            Loss::ClipCov(cfg) => {
                let keys = clip_cov_keys(&mask.size(), keys_seed, logp.device());
                let out = clip_cov_loss_output(logp, mu, adv, mask, &keys, cfg, norm)?;
                (out.loss, out.terms, cfg.aggregation)
            }
            Loss::KlCov(cfg) => {
                let out = kl_cov_loss_output(logp, mu, adv, mask, cfg, norm)?;
                (out.loss, out.terms, cfg.aggregation)
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
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras {
    /// Weights of π (detached) against μ on the loss's terms.
    pub correction: Option<RolloutCorrection>,
    /// Drop (weight 0) the tokens or sequences whose divergence statistic of π against μ
    /// leaves the rule's bounds.
    pub rejection: Option<Rejection>,
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
        if let Some(rule) = &self.rejection {
            factors.push(rollout_rejection_mask(&lp.logp, &p.logp_mu, &lp.mask, rule)?);
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

/// The training units of `samples` for `objective` with baseline `c`: group advantages (GRPO's)
/// are computed per question over all its completions in the data set; DPO pairs the i-th correct
/// with the i-th incorrect completion of each question.
pub fn units(samples: &[Sample], objective: Objective, c: f64) -> Result<Vec<Unit<'_>>> {
    units_with(samples, objective, c, Advantage::Grpo)
}

/// [`units`] with the group-advantage objectives' estimator `advantage`.
pub fn units_with(samples: &[Sample], objective: Objective, c: f64, advantage: Advantage) -> Result<Vec<Unit<'_>>> {
    Ok(match objective {
        Objective::Ppo => samples.iter().map(|s| Unit::Single(s, (s.reward - c) as f32)).collect(),
        o if o.uses_group_advantages() => group_units(samples, advantage)?,
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

/// Each completion with its group advantage under `advantage` (see [`Advantage`]).
fn group_units(samples: &[Sample], advantage: Advantage) -> Result<Vec<Unit<'_>>> {
    let groups = groups(samples);
    let per_group = |method: GroupAdvantage| -> Result<Vec<f64>> {
        let mut out = vec![];
        for g in &groups {
            let r = Tensor::from_slice(&g.iter().map(|s| s.reward).collect::<Vec<_>>()).view([1, -1]);
            out.extend(Vec::<f64>::try_from(group_advantages(&r, method)?.flatten(0, -1))?);
        }
        Ok(out)
    };
    let values: Vec<f64> = match advantage {
        Advantage::Grpo => per_group(GroupAdvantage::grpo())?,
        Advantage::DrGrpo => per_group(GroupAdvantage::DrGrpo)?,
        Advantage::Rloo => per_group(GroupAdvantage::Rloo)?,
        other => {
            // The batch-level estimators need the data set as one [G, K] table.
            let k = groups[0].len();
            if groups.iter().any(|g| g.len() != k) {
                bail!(
                    "--advantage {other:?} needs the same number of completions for every question \
                     (sample with a fixed --samples-per-question)"
                );
            }
            let g = groups.len() as i64;
            let rewards: Vec<f64> = groups.iter().flatten().map(|s| s.reward).collect();
            let r = Tensor::from_slice(&rewards).view([g, k as i64]);
            let lens: Vec<i64> = groups.iter().flatten().map(|s| s.completion_ids.len() as i64).collect();
            let t = lens.iter().copied().max().unwrap_or(1).max(1);
            let lengths = Tensor::from_slice(&lens);
            let mask = Tensor::arange(t, (Kind::Int64, tch::Device::Cpu)).unsqueeze(0).lt_tensor(&lengths.unsqueeze(1));
            // Token-level estimators give every token of a completion the same value here
            // (outcome rewards, γ = 1): a completion's advantage is its first token's.
            let first_token = |a: Tensor| -> Result<Vec<f64>> { Ok(Vec::<f64>::try_from(a.select(1, 0))?) };
            match other {
                Advantage::BatchStd => {
                    Vec::<f64>::try_from(group_advantages(&r, GroupAdvantage::batch_std())?.flatten(0, -1))?
                }
                Advantage::Opo => Vec::<f64>::try_from(
                    opo_advantages(&r, &lengths.view([g, k as i64]), SingletonGroup::OwnMean)?.flatten(0, -1),
                )?,
                Advantage::ReinforcePpBaseline => {
                    first_token(reinforce_pp_baseline_advantages(&r, &mask, 1e-8, SingletonGroup::OwnMean)?)?
                }
                _ => {
                    // REINFORCE++: the outcome reward on each completion's last token.
                    let last = (&lengths - 1).clamp_min(0).unsqueeze(1);
                    let tr = Tensor::zeros([g * k as i64, t], (Kind::Double, tch::Device::Cpu)).scatter(
                        1,
                        &last,
                        &Tensor::from_slice(&rewards).unsqueeze(1),
                    );
                    first_token(reinforce_pp_advantages(&tr, &mask, 1.0, 1e-8)?.advantages)?
                }
            }
        }
    };
    Ok(groups.iter().flatten().zip(values).map(|(s, a)| Unit::Single(s, a as f32)).collect())
}
