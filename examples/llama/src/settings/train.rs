//! The settings of a training run, typed and checked in one place: [`TrainSettings`] and the
//! enums it is made of ([`Objective`], [`Baseline`], [`Advantage`], [`DpoLoss`],
//! [`KlEstimatorSetting`]). [`TrainSettings::check`] owns every rule over them, single-field and
//! cross-field, so that the command line, the demo and the study (which build settings directly)
//! are refused alike; a refusal is a [`SettingError`] naming the fields, never a flag.
//!
//! The enums' names are spelled once, by their variants: serde writes them in snake case in run
//! records (`clip_cov`), the command line takes them in kebab case (`clip-cov`, clap's
//! `ValueEnum`), and [`Objective::name`] is that command-line name.

use crate::optim::OptimizerConfig;
use serde::{Deserialize, Serialize};
use topr_loss::{DpoConfig, SequenceReduce, ToprConfig};

/// Everything [`crate::train::run`] needs besides the model and the data.
///
/// Serialised, it is the record of a run's settings that a resumed run must match (see
/// [`crate::stage`]): every field but `save_every` and `resume`, which do not change the
/// result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSettings {
    pub objective: Objective,
    pub baseline: Baseline,
    /// The ratio level of the TOPR family (the paper's is `Sequence`).
    pub ratio: topr_loss::RatioLevel,
    pub optimizer: OptimizerConfig,
    pub lr: f64,
    /// Completions per optimiser step.
    pub batch_size: usize,
    /// Completions per forward/backward pass (gradient accumulation; same update for any value).
    pub micro_batch_size: usize,
    pub epochs: usize,
    /// Clip the gradient's norm to this (`None`: no clipping).
    pub max_grad_norm: Option<f64>,
    pub warmup_steps: usize,
    /// Decay the learning rate linearly to 0 after the warm-up (else constant).
    pub lr_decay: bool,
    /// The seed of the per-epoch shuffles.
    pub seed: u64,
    /// DPO's β.
    pub dpo_beta: f64,
    /// The `dro` objective's penalty β (absent from older records: 0.1, the default).
    #[serde(default = "default_dro_beta")]
    pub dro_beta: f64,
    /// Decoupled PPO's proximal policy (absent from older records: the log-linear
    /// approximation, the default).
    #[serde(default)]
    pub proximal: Proximal,
    /// VAPO's NLL of the correct completions added with this coefficient (0: none; absent from
    /// older records: 0).
    #[serde(default)]
    pub positive_nll: f64,
    /// Which DPO-family loss (absent from older run records: sigmoid).
    #[serde(default)]
    pub dpo_loss: DpoLoss,
    /// Label smoothing ε of the DPO losses that take it (absent from older run records: 0).
    #[serde(default)]
    pub dpo_label_smoothing: f64,
    /// A weighted sum of DPO-family losses in place of `dpo_loss` (empty: none; absent from
    /// older records: none).
    #[serde(default)]
    pub dpo_mix: Vec<(DpoLoss, f64)>,
    /// How the group-advantage objectives compute advantages (absent from older records: GRPO's).
    #[serde(default)]
    pub advantage: Advantage,
    /// The coefficient of a KL penalty of π to μ (0: none; absent from older records: 0).
    #[serde(default)]
    pub kl_coef: f64,
    /// Its estimator (absent from older records: k3).
    #[serde(default)]
    pub kl_estimator: KlEstimatorSetting,
    /// The coefficient of an entropy bonus (0: none; absent from older records: 0).
    #[serde(default)]
    pub entropy_coef: f64,
    /// Train only this share of each micro-batch's tokens, the highest-entropy ones (absent from
    /// older records: all tokens).
    #[serde(default)]
    pub top_entropy: Option<f64>,
    /// Drop what any of these divergence rules of π against μ rejects, each rule computed on the
    /// original mask and the results intersected (verl's comma-separated `rollout_rs`). Empty:
    /// none. Older records wrote one rule or `null`; they read as a list of it or as none.
    #[serde(default, deserialize_with = "one_or_many")]
    pub rejection: Vec<topr_loss::Rejection>,
    /// DeepSeek-V3.2's off-policy sequence mask threshold (absent from older records: none).
    #[serde(default)]
    pub off_policy_mask: Option<f64>,
    /// Importance weights of π against μ on the token-level losses' terms (`None`: off). Absent
    /// from run records written before it existed, which then read as off.
    #[serde(default)]
    pub rollout_correction: Option<topr_loss::RolloutCorrection>,
    /// Skip malformed data-set records and completions longer than the context (counted) instead
    /// of refusing the data set.
    pub skip_bad_records: bool,
    /// Save the training state every this many steps (0: never; a kill then restarts the stage).
    #[serde(skip)]
    pub save_every: usize,
    /// Continue from the saved state of an interrupted run in the same output directory.
    #[serde(skip)]
    pub resume: bool,
}

/// The KL estimators `--kl-estimator` offers, with verl's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimatorSetting {
    K1,
    K2,
    #[default]
    K3,
    Abs,
    /// verl's `low_var_kl`: k3 with its value clamped to ±10.
    LowVarKl,
    /// k3's value with k2's gradient (verl's `k3+`).
    K3Plus,
    /// k1's value with k2's gradient (verl's `k1+`).
    K1Plus,
}

impl KlEstimatorSetting {
    /// The crate's config for this estimator with coefficient `coef`, token-mean.
    pub fn config(self, coef: f64) -> topr_loss::KlConfig {
        use topr_loss::KlConfig;
        let c = match self {
            Self::K1 => KlConfig::k1(),
            Self::K2 => KlConfig::k2(),
            Self::K3 => KlConfig::k3(),
            Self::Abs => KlConfig::abs(),
            Self::LowVarKl => KlConfig::low_var_kl(),
            Self::K3Plus => KlConfig::k3().with_straight_through(true),
            Self::K1Plus => KlConfig::k1().with_straight_through(true),
        };
        c.with_coef(coef).with_checks(topr_loss::Checks::Shapes)
    }
}

/// The objectives `train` offers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// TOPR (the paper's truncation limits).
    Topr,
    /// Truncated importance sampling.
    Tis,
    /// Supervised fine-tuning (positives only).
    Sft,
    /// Naive REINFORCE (ratio ignored).
    Reinforce,
    /// Plain importance sampling.
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
    /// DPPO with the binary total-variation trust region (δ = 0.15) and group advantages.
    DppoTv,
    /// DPPO with the binary KL trust region (δ = 0.05) and group advantages.
    DppoKl,
    /// REINFORCE with verl's `dro` quadratic log-ratio penalty `(β/2) δ²` (`--dro-beta`) and
    /// group advantages.
    Dro,
    /// Decoupled PPO (AReaL): PPO-clip around a proximal policy (`--proximal`), weighted by the
    /// proximal policy's ratio to μ (masked above 5), with group advantages.
    DecoupledPpo,
    /// VESPO: REINFORCE with a gamma-shaped weight of each sequence's ratio to μ (TRL's
    /// defaults), with group advantages.
    Vespo,
    /// BAPO: PPO-clip whose clip bounds are chosen per micro-batch so that the positive
    /// advantages' share of the loss reaches the target (the paper's ranges), with group
    /// advantages.
    Bapo,
    /// CTPO-LA: the prefix importance ratio with its length-adaptive clip, with group advantages.
    PrefixRatio,
}

/// Where decoupled PPO's proximal policy comes from (`--proximal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Proximal {
    /// AReaL's log-linear approximation from μ and the current policy, with the staleness
    /// counted in optimiser steps since the run started (`1 + step`): no extra forward pass.
    #[default]
    LogLinear,
    /// The model as the run started (loaded once more, frozen), one extra forward pass per
    /// micro-batch.
    Recompute,
}

impl Objective {
    /// Whether the objective weighs completions by group advantages (`--advantage`).
    pub fn uses_group_advantages(self) -> bool {
        matches!(
            self,
            Self::Grpo
                | Self::Gspo
                | Self::Cispo
                | Self::Sapo
                | Self::Gmpo
                | Self::ClipCov
                | Self::KlCov
                | Self::DppoTv
                | Self::DppoKl
                | Self::Dro
                | Self::DecoupledPpo
                | Self::Vespo
                | Self::Bapo
                | Self::PrefixRatio
        )
    }
}

/// How `--objective grpo|gspo|cispo|sapo|gmpo|clip-cov|kl-cov|dppo-tv|dppo-kl|dro|decoupled-ppo|vespo|bapo|prefix-ratio` turn each question's rewards into
/// advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
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
    /// Pass@k: the best completion of each question gets its margin over the second best,
    /// divided by the group's std + 1e-6; the others 0 (verl's `grpo_passk`).
    Passk,
    /// GDPO over two reward dimensions, correctness (1 or 0) and a well-formed answer (1 when an
    /// answer was found, else 0): each normalised within its question's group (GRPO), summed,
    /// whitened over every token of the data set (verl's `gdpo`).
    Gdpo,
    /// MaxRL: `(R − r̄) / (r̄ + 1e-6)` per question on correctness (1 or 0).
    Maxrl,
    /// LENS: correctness recalibrated by μ's confidence in each wrong answer (the per-token
    /// geometric mean of its probability), GRPO-normalised on mixed questions, only centred (and
    /// weighted 0.25) on all-wrong ones.
    Lens,
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
        use clap::ValueEnum;
        self.to_possible_value().map_or_else(|| format!("{self:?}"), |v| v.get_name().to_string())
    }
}

/// Which loss of the DPO family `--objective dpo` trains with (TRL's `loss_type` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
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
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
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

impl TrainSettings {
    /// Refuses settings that would train on nothing or silently mean something else. Every
    /// rule over the settings is here:
    ///
    /// - sizes and epochs of 0; a learning rate, clipping norm or DPO β that is not finite and
    ///   `> 0`; a baseline that is not finite, or a target positive proportion outside `[0, 1]`;
    ///   KL and entropy coefficients that are not finite and `>= 0`; a top-entropy share outside
    ///   `(0, 1]`; an off-policy mask threshold that is not finite; a rollout correction or
    ///   rejection rule that its own `validate` refuses;
    /// - DPO with anything that acts on token-level terms (a rollout correction, rejection rule,
    ///   off-policy mask, KL penalty, entropy bonus or top-entropy selection): DPO's loss is over
    ///   pairs of sequences;
    /// - a DPO mixture with another objective, with a weight that is not in `(0, f32::MAX]` (0 trains
    ///   nothing, a negative weight ascends the loss), with terms that reduce sequences differently
    ///   (IPO and sigmoid-norm take per-token means, the others sums), or that the library's
    ///   [`topr_loss::DpoMix::validate`] refuses; a DPO loss whose β and label smoothing its
    ///   [`topr_loss::DpoConfig::validate`] refuses;
    /// - an advantage estimator other than GRPO's for an objective without group advantages.
    ///
    /// The error names the fields ([`SettingError::fields`]), so that a front end can name its
    /// own options for them.
    pub fn check(&self) -> Result<(), SettingError> {
        self.check_values()?;
        self.check_dpo()?;
        if self.dro_beta != default_dro_beta() && self.objective != Objective::Dro {
            return Err(SettingError::new(&["dro_beta", "objective"], "the DRO beta applies to the dro objective"));
        }
        if self.proximal != Proximal::default() && self.objective != Objective::DecoupledPpo {
            return Err(SettingError::new(
                &["proximal", "objective"],
                "the proximal policy applies to the decoupled-ppo objective",
            ));
        }
        if self.advantage != Advantage::default() && !self.objective.uses_group_advantages() {
            return Err(SettingError::new(
                &["advantage"],
                "the advantage estimator applies to the group-advantage objectives (grpo, gspo, cispo, sapo, gmpo, clip-cov, kl-cov, dppo-tv, dppo-kl, dro, decoupled-ppo, vespo, bapo, prefix-ratio)",
            ));
        }
        Ok(())
    }

    /// The rules on single fields.
    fn check_values(&self) -> Result<(), SettingError> {
        let sizes = [
            ("batch_size", "batch size", self.batch_size),
            ("micro_batch_size", "micro-batch size", self.micro_batch_size),
            ("epochs", "epoch count", self.epochs),
        ];
        if let Some((field, what, _)) = sizes.iter().find(|(_, _, v)| *v == 0) {
            return Err(SettingError::new(&[field], format!("the {what} must be >= 1, got 0")));
        }
        let positive = [
            ("lr", "learning rate", Some(self.lr)),
            ("max_grad_norm", "clipping norm", self.max_grad_norm),
            ("dpo_beta", "DPO beta", Some(self.dpo_beta)),
            ("dro_beta", "DRO beta", Some(self.dro_beta)),
        ];
        for (field, what, v) in positive {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(SettingError::new(&[field], format!("the {what} must be finite and > 0, got {v}")));
            }
        }
        let coefficients = [
            ("kl_coef", "KL coefficient", self.kl_coef),
            ("entropy_coef", "entropy coefficient", self.entropy_coef),
            ("positive_nll", "positive-NLL coefficient", self.positive_nll),
        ];
        for (field, what, v) in coefficients {
            if !(v.is_finite() && v >= 0.0) {
                return Err(SettingError::new(&[field], format!("the {what} must be finite and >= 0, got {v}")));
            }
        }
        if let Some(t) = self.top_entropy.filter(|t| !(*t > 0.0 && *t <= 1.0)) {
            return Err(SettingError::new(
                &["top_entropy"],
                format!("the top-entropy share must lie in (0, 1] (a share of 0 would train no token), got {t}"),
            ));
        }
        if let Some(m) = self.off_policy_mask.filter(|m| !m.is_finite()) {
            return Err(SettingError::new(
                &["off_policy_mask"],
                format!("the off-policy mask threshold must be finite, got {m}"),
            ));
        }
        let library = |field: &'static str, r: Result<(), topr_loss::LossError>| {
            r.map_err(|e| SettingError::new(&[field], e.to_string()))
        };
        if let Some(c) = &self.rollout_correction {
            library("rollout_correction", c.validate())?;
        }
        for r in &self.rejection {
            library("rejection", r.validate())?;
        }
        match self.baseline {
            Baseline::Fixed(c) if !c.is_finite() => {
                Err(SettingError::new(&["baseline"], format!("the baseline must be finite, got {c}")))
            }
            Baseline::TargetPositiveProportion(p) if !(0.0..=1.0).contains(&p) => Err(SettingError::new(
                &["target_positive_proportion"],
                format!("the target positive proportion must lie in [0, 1], got {p}"),
            )),
            _ => Ok(()),
        }
    }

    /// The rules of the DPO objective and its mixture.
    fn check_dpo(&self) -> Result<(), SettingError> {
        if self.objective == Objective::Dpo {
            let token_level = [
                ("rollout_correction", "a rollout correction", self.rollout_correction.is_some()),
                ("kl_coef", "a KL penalty", self.kl_coef > 0.0),
                ("entropy_coef", "an entropy bonus", self.entropy_coef > 0.0),
                ("positive_nll", "the NLL of the correct completions", self.positive_nll > 0.0),
                ("top_entropy", "the top-entropy selection", self.top_entropy.is_some()),
                ("rejection", "a rejection rule", !self.rejection.is_empty()),
                ("off_policy_mask", "the off-policy sequence mask", self.off_policy_mask.is_some()),
            ];
            if let Some((field, what, _)) = token_level.iter().find(|(_, _, on)| *on) {
                return Err(SettingError::new(
                    &[field],
                    format!("{what} applies to the token-level losses, not to DPO's pairs"),
                ));
            }
        }
        if let Some((first, _)) = self.dpo_mix.first() {
            if self.objective != Objective::Dpo {
                return Err(SettingError::new(&["dpo_mix"], "a DPO mixture applies to the DPO objective"));
            }
            if let Some((_, w)) = self.dpo_mix.iter().find(|(_, w)| !(*w > 0.0 && *w <= f64::from(f32::MAX))) {
                return Err(SettingError::new(
                    &["dpo_mix"],
                    format!(
                        "a DPO mixture's weights must be > 0 and at most {:e} (f32's largest; a weight of 0 trains nothing, a negative one ascends the loss), got {w}",
                        f32::MAX
                    ),
                ));
            }
            if self.dpo_mix.iter().any(|(l, _)| l.reduce() != first.reduce()) {
                return Err(SettingError::new(
                    &["dpo_mix"],
                    "ipo and sigmoid-norm take per-token means, the others sums: they cannot share one mixture",
                ));
            }
            if let Some(mix) = self.dpo_mix_config(topr_loss::Checks::Full) {
                mix.validate().map_err(|e| SettingError::new(&["dpo_mix"], e.to_string()))?;
            }
        }
        self.dpo_loss
            .config(self.dpo_beta, self.dpo_label_smoothing)
            .validate()
            .map_err(|e| SettingError::new(&["dpo_loss", "dpo_label_smoothing"], e.to_string()))
    }

    /// The library's mixture of `dpo_mix`'s terms, each with the run's β and label smoothing and
    /// `checks`; `None` when `dpo_mix` is empty (DPO then trains `dpo_loss` alone).
    pub fn dpo_mix_config(&self, checks: topr_loss::Checks) -> Option<topr_loss::DpoMix> {
        let term = |l: DpoLoss| l.config(self.dpo_beta, self.dpo_label_smoothing).with_checks(checks);
        let ((first, w), rest) = self.dpo_mix.split_first()?;
        Some(rest.iter().fold(topr_loss::DpoMix::of(term(*first), *w), |m, &(l, w)| m.with_term(term(l), w)))
    }
}

/// Settings that [`TrainSettings::check`] refuses: the fields concerned (as the settings name
/// them, e.g. `dpo_mix`, `dpo_loss` and `dpo_label_smoothing`) and what is wrong, in words that
/// name no command-line option.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct SettingError {
    /// The settings' field names, the first the one to change.
    pub fields: Vec<&'static str>,
    /// What is wrong.
    pub message: String,
}

impl SettingError {
    fn new(fields: &[&'static str], message: impl Into<String>) -> Self {
        Self { fields: fields.to_vec(), message: message.into() }
    }
}

/// Reads a list of rejection rules also from the forms older records wrote: `null` (none) or one
/// rule.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<topr_loss::Rejection>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Many(Vec<topr_loss::Rejection>),
        One(topr_loss::Rejection),
    }
    Ok(match Option::<Form>::deserialize(d)? {
        None => vec![],
        Some(Form::One(r)) => vec![r],
        Some(Form::Many(v)) => v,
    })
}

/// The `dro` objective's default penalty (verl's `dro_beta` example value, the library's default).
pub const fn default_dro_beta() -> f64 {
    0.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use topr_loss::{Rejection, RejectionScope};

    /// Older records wrote `rejection` as `null` or as one rule; both read as this version's list.
    #[test]
    fn older_records_rejection_forms_read_as_a_list() {
        let rules = vec![Rejection::k2(RejectionScope::Token, 2.0), Rejection::k3(RejectionScope::SequenceMax, 0.5)];
        let s = TrainSettings { rejection: rules.clone(), ..crate::demo::topr_settings().unwrap() };
        let mut v = serde_json::to_value(&s).unwrap();
        let read = |v: &serde_json::Value| serde_json::from_value::<TrainSettings>(v.clone()).unwrap().rejection;
        assert_eq!(read(&v), rules);
        v["rejection"] = serde_json::to_value(rules[1]).unwrap();
        assert_eq!(read(&v), vec![rules[1]]);
        v["rejection"] = serde_json::Value::Null;
        assert_eq!(read(&v), vec![]);
        v.as_object_mut().unwrap().remove("rejection");
        v.as_object_mut().unwrap().remove("dro_beta");
        let old: TrainSettings = serde_json::from_value(v).unwrap();
        assert_eq!((old.rejection, old.dro_beta), (vec![], default_dro_beta()));
    }

    #[test]
    fn the_dro_beta_is_refused_without_the_dro_objective() {
        let s = TrainSettings { dro_beta: 0.3, ..crate::demo::topr_settings().unwrap() };
        assert_eq!(s.check().unwrap_err().fields, vec!["dro_beta", "objective"]);
        let dro = TrainSettings { objective: Objective::Dro, ..s };
        dro.check().unwrap();
        let bad = TrainSettings { dro_beta: f64::NAN, ..dro };
        assert_eq!(bad.check().unwrap_err().fields, vec!["dro_beta"]);
    }
}
