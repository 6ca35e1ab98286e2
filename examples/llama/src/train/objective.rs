//! The objectives and every call into `topr_loss` that training makes: baselines and the
//! effective positive proportion, GRPO's group advantages, and the loss of one micro-batch
//! (TOPR family, PPO-clip, DPO) with the diagnostics a step logs.

use super::batch::MicroBatch;
use crate::metrics::ToprStats;
use crate::sample::Sample;
use anyhow::{Result, bail};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, Checks, DpoConfig, DpoDiagnostics, GroupAdvantage, LossError, Normalizer, OnDevice, PpoConfig,
    RolloutCorrection, SequenceReduce, TokenLogProbs, ToprConfig, ToprDiagnostics, ToprTokenConfig,
    apply_token_weights, baseline_for_effective_proportion, cispo_loss_output, dpo_loss_output, group_advantages,
    gspo_loss_output, ppo_clip_loss_output, rollout_weights, sequence_logprobs, topr_token_loss_output,
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
            Self::Ppo | Self::Grpo | Self::Dpo | Self::Gspo | Self::Cispo => return None,
        })
    }

    /// The objective's name as summaries write it (`topr`, `ppo`, ...).
    pub fn name(self) -> String {
        format!("{self:?}").to_lowercase()
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
        Objective::Grpo | Objective::Dpo | Objective::Gspo | Objective::Cispo => None,
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
    /// DPO-family loss on pairs, with sequence log-probs summed or averaged over tokens.
    Dpo(DpoConfig, SequenceReduce),
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
            Objective::Dpo => {
                Loss::Dpo(o.dpo_loss.config(o.dpo_beta, o.dpo_label_smoothing).with_checks(fast), o.dpo_loss.reduce())
            }
            Objective::Gspo => Loss::Gspo(PpoConfig::gspo().with_checks(fast)),
            Objective::Cispo => Loss::Cispo(PpoConfig::cispo().with_checks(fast)),
            other => Loss::Topr(
                ToprTokenConfig::paper()
                    .with_topr(other.limits().unwrap_or_default().with_baseline(c).with_checks(fast))
                    .with_ratio(o.ratio),
            ),
        }
    }

    /// The loss of one micro-batch `p` given π's log-probs `lp`, with the counts of the whole
    /// step (`normalizer`, and `pairs_in_step` for DPO), adding its diagnostics to `tally`.
    pub(super) fn micro_batch(
        &self,
        lp: &TokenLogProbs,
        p: &MicroBatch,
        normalizer: Normalizer,
        pairs_in_step: f64,
        correction: Option<&RolloutCorrection>,
        tally: &mut Tally,
    ) -> Result<Tensor, LossError> {
        let delta = &lp.logp.detach() - &p.logp_mu;
        tally.log_ratio.push(masked_sum(&delta, &lp.mask));
        match self {
            Loss::Topr(cfg) => {
                // The loss and its diagnostics from one pass, with the step's counts.
                let out = topr_token_loss_output(&lp.logp, &p.logp_mu, &p.values, &lp.mask, cfg, &normalizer)?;
                tally.diags.push(out.diagnostics);
                self.corrected(out.loss, &out.terms, lp, p, cfg.aggregation, &normalizer, correction)
            }
            Loss::Ppo(cfg) | Loss::Gspo(cfg) | Loss::Cispo(cfg) => {
                let ratio = delta.exp();
                let outside = ratio.lt(1.0 - cfg.clip_low).logical_or(&ratio.gt(1.0 + cfg.clip_high));
                tally.clipped.push(masked_sum(&outside, &lp.mask));
                let (logp, mu, adv, mask) = (&lp.logp, &p.logp_mu, &p.values, &lp.mask);
                let out = match self {
                    Loss::Gspo(_) => gspo_loss_output(logp, mu, adv, mask, cfg, &normalizer)?,
                    Loss::Cispo(_) => cispo_loss_output(logp, mu, adv, mask, cfg, &normalizer)?,
                    _ => ppo_clip_loss_output(logp, mu, adv, mask, cfg, &normalizer)?,
                };
                self.corrected(out.loss, &out.terms, lp, p, cfg.aggregation, &normalizer, correction)
            }
            Loss::Dpo(cfg, reduce) => {
                let n = lp.logp.size()[0] / 2;
                let seq = sequence_logprobs(&lp.logp, &lp.mask, *reduce)?;
                let mu = sequence_logprobs(&p.logp_mu, &lp.mask, *reduce)?;
                let (pw, pl) = (seq.narrow(0, 0, n), seq.narrow(0, n, n));
                let (rw, rl) = (mu.narrow(0, 0, n), mu.narrow(0, n, n));
                // Σ ℓ over this micro-batch's pairs, divided by the pairs of the whole step.
                let out = dpo_loss_output(&pw, &pl, &rw, &rl, cfg, &Normalizer::sequences(pairs_in_step))?;
                tally.dpo.push((out.diagnostics, n as f64));
                Ok(out.loss)
            }
        }
    }
}

impl Loss {
    /// `loss`, or, with a rollout correction, the loss's per-token `terms` weighted by the
    /// correction's importance weights of π (detached) against μ and reduced the same way
    /// (verl's "bypass mode": the current policy stands for the trainer's π_old).
    #[allow(clippy::too_many_arguments)]
    fn corrected(
        &self,
        loss: Tensor,
        terms: &Tensor,
        lp: &TokenLogProbs,
        p: &MicroBatch,
        mode: AggregationMode,
        normalizer: &Normalizer,
        correction: Option<&RolloutCorrection>,
    ) -> Result<Tensor, LossError> {
        let Some(rc) = correction else { return Ok(loss) };
        let w = rollout_weights(&lp.logp, &p.logp_mu, &lp.mask, rc)?;
        apply_token_weights(terms, &w.weights, &lp.mask, mode, normalizer)
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

/// The TOPR-family statistics, weighted by each micro-batch's sample count.
pub(super) fn topr_stats(diags: &[ToprDiagnostics]) -> ToprStats {
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
        Objective::Grpo | Objective::Gspo | Objective::Cispo => {
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
