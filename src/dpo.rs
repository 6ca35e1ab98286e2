//! Direct preference optimisation and its variants, on sequence log-probabilities of a chosen
//! and a rejected completion per prompt.
//!
//! ```text
//! Δ = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))      h = β Δ
//!
//! Sigmoid (DPO, cDPO)   ℓ = −(1 − ε) log σ(h) − ε log σ(−h)       (ε: cDPO's label smoothing)
//! Ipo                   ℓ = (Δ − 1/(2β))²
//! Hinge (RSO)           ℓ = max(0, 1 − h)
//! reference-free        log π_ref ≡ 0
//! ```
//!
//! `log σ` is computed as `log_sigmoid`, never `log(sigmoid(·))`, in f32 or wider, so margins of
//! `±1e4` give finite values and gradients.
//!
//! Label smoothing `ε` is conservative DPO (cDPO, Mitchell 2023), TRL's `loss_type="sigmoid"` with
//! `label_smoothing`. TRL's `loss_type="robust"` is a different loss (Chowdhury et al., *Provably
//! Robust DPO*, arXiv 2403.00409: the cDPO terms with `+ε`, divided by `1 − 2ε`); it is not
//! implemented here.

use crate::aggregate::Normalizer;
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct};
use crate::validate::{self, FiniteCheck};
use tch::{Kind, Tensor};

/// The DPO loss family.
///
/// # Example
/// ```
/// use topr_loss::{DpoConfig, DpoVariant};
/// assert_eq!(DpoConfig::default().variant, DpoVariant::Sigmoid);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DpoVariant {
    /// `−(1 − ε) log σ(h) − ε log σ(−h)`: DPO (Rafailov et al., arXiv 2305.18290); with label
    /// smoothing `ε > 0`, conservative DPO (cDPO, Mitchell 2023). Not TRL's `robust` loss.
    #[default]
    Sigmoid,
    /// `(Δ − 1/(2β))²`: IPO (Azar et al., arXiv 2310.12036). IPO is defined on log-probs
    /// *averaged* over the response tokens: pass per-token means, not sums.
    Ipo,
    /// `max(0, 1 − β Δ)`: the hinge loss of SLiC / RSO (Liu et al., arXiv 2309.06657).
    Hinge,
}

/// Configuration of [`dpo_loss`] and [`dpo_rewards`].
///
/// `Default` ([`DpoConfig::dpo`]): `β = 0.1`, no label smoothing, the sigmoid loss, with a
/// reference model. Presets name each published loss; `with_…` methods change one knob.
///
/// Reference: Rafailov et al., *Direct Preference Optimization*, arXiv 2305.18290; TRL's
/// `DPOTrainer` for the option names.
///
/// # Example
/// ```
/// use topr_loss::DpoConfig;
/// let cfg = DpoConfig::cdpo(0.1);
/// assert!(cfg.validate().is_ok());
/// assert!(cfg.with_beta(0.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct DpoConfig {
    /// `β > 0`: the strength of the implicit KL constraint.
    pub beta: f64,
    /// `ε ∈ [0, 0.5]`: the assumed share of flipped preference labels (sigmoid variant only).
    pub label_smoothing: f64,
    /// Which loss.
    pub variant: DpoVariant,
    /// Ignore the reference log-probs (`log π_ref ≡ 0`); the `logp_ref_*` arguments may then be
    /// undefined tensors (`Tensor::new()`).
    pub reference_free: bool,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self::dpo()
    }
}

impl DpoConfig {
    /// DPO: the sigmoid loss, `β = 0.1`, with a reference. Rafailov et al., arXiv 2305.18290.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::dpo(), topr_loss::DpoConfig::default());
    /// ```
    pub const fn dpo() -> Self {
        Self {
            beta: 0.1,
            label_smoothing: 0.0,
            variant: DpoVariant::Sigmoid,
            reference_free: false,
            checks: Checks::Full,
        }
    }

    /// Conservative DPO: the sigmoid loss with label smoothing `ε` (the assumed share of flipped
    /// labels). Mitchell, *A note on DPO with noisy preferences*, 2023; TRL's `label_smoothing`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::cdpo(0.1).label_smoothing, 0.1);
    /// ```
    pub const fn cdpo(label_smoothing: f64) -> Self {
        Self::dpo().with_label_smoothing(label_smoothing)
    }

    /// IPO, `β = 0.1`. Azar et al., arXiv 2310.12036.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::ipo().variant, topr_loss::DpoVariant::Ipo);
    /// ```
    pub const fn ipo() -> Self {
        Self::dpo().with_variant(DpoVariant::Ipo)
    }

    /// The hinge loss of SLiC / RSO, `β = 0.1`. Liu et al., arXiv 2309.06657.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::hinge().variant, topr_loss::DpoVariant::Hinge);
    /// ```
    pub const fn hinge() -> Self {
        Self::dpo().with_variant(DpoVariant::Hinge)
    }

    /// The same config with another `β`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::dpo().with_beta(0.5).beta, 0.5);
    /// ```
    pub const fn with_beta(self, beta: f64) -> Self {
        Self { beta, ..self }
    }

    /// The same config with label smoothing `ε`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::dpo().with_label_smoothing(0.2).label_smoothing, 0.2);
    /// ```
    pub const fn with_label_smoothing(self, label_smoothing: f64) -> Self {
        Self { label_smoothing, ..self }
    }

    /// The same config with another variant.
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoVariant};
    /// assert_eq!(DpoConfig::dpo().with_variant(DpoVariant::Hinge), DpoConfig::hinge());
    /// ```
    pub const fn with_variant(self, variant: DpoVariant) -> Self {
        Self { variant, ..self }
    }

    /// The same config with or without the reference model.
    ///
    /// ```
    /// assert!(topr_loss::DpoConfig::dpo().with_reference_free(true).reference_free);
    /// ```
    pub const fn with_reference_free(self, reference_free: bool) -> Self {
        Self { reference_free, ..self }
    }

    /// The same config with another checks level ([`Checks::Shapes`]: no host read per call).
    ///
    /// ```
    /// use topr_loss::{Checks, DpoConfig};
    /// assert_eq!(DpoConfig::dpo().with_checks(Checks::Shapes).checks, Checks::Shapes);
    /// ```
    pub const fn with_checks(self, checks: Checks) -> Self {
        Self { checks, ..self }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`]: `β` not finite and `> 0`; `ε ∉ [0, 0.5]`; `ε > 0` with a
    /// variant other than `Sigmoid` (where it has no meaning).
    ///
    /// ```
    /// use topr_loss::DpoConfig;
    /// let bad = DpoConfig::ipo().with_label_smoothing(0.1);
    /// assert!(bad.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return Err(LossError::InvalidConfig {
                field: "beta",
                value: self.beta,
                reason: "β must be finite and > 0".into(),
            });
        }
        let eps = self.label_smoothing;
        if !(0.0..=0.5).contains(&eps) {
            return Err(LossError::InvalidConfig {
                field: "label_smoothing",
                value: eps,
                reason: "the share of flipped labels must lie in [0, 0.5]".into(),
            });
        }
        if eps > 0.0 && self.variant != DpoVariant::Sigmoid {
            return Err(LossError::InvalidConfig {
                field: "label_smoothing",
                value: eps,
                reason: format!("label smoothing applies to the sigmoid loss only, not {:?}", self.variant),
            });
        }
        Ok(())
    }
}

/// Checked inputs: the per-pair log-ratios of chosen and rejected, `[B]` each, in the compute dtype.
struct Pairs {
    chosen: Tensor,
    rejected: Tensor,
}

fn check_pairs(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Pairs, LossError> {
    cfg.validate()?;
    let mut args = vec![(logp_chosen, "logp_chosen"), (logp_rejected, "logp_rejected")];
    if !cfg.reference_free {
        args.push((logp_ref_chosen, "logp_ref_chosen"));
        args.push((logp_ref_rejected, "logp_ref_rejected"));
    }
    let mut kinds = vec![];
    for (t, name) in &args {
        kinds.push(validate::float_tensor(t, name)?);
    }
    let shape = validate::rank(logp_chosen, "logp_chosen", 1, "[B] sequence log-probabilities")?;
    validate::non_empty(&shape, "logp_chosen", "preference pair")?;
    let device = logp_chosen.device();
    for (t, name) in &args[1..] {
        validate::same_shape(t, name, &shape, "the shape of `logp_chosen`")?;
        validate::same_device(t, name, device, "logp_chosen")?;
    }
    if cfg.checks.values() {
        let checks: Vec<FiniteCheck> =
            args.iter().map(|&(t, argument)| FiniteCheck { clean: t, original: t, argument, valid: None }).collect();
        validate::all_finite(&checks)?;
    }
    let kind = validate::compute_kind(&kinds);
    let log_ratio = |policy: &Tensor, reference: &Tensor| -> Result<Tensor, LossError> {
        let p = policy.f_to_kind(kind)?;
        Ok(if cfg.reference_free { p } else { p.f_sub(&reference.f_detach()?.f_to_kind(kind)?)? })
    };
    Ok(Pairs {
        chosen: log_ratio(logp_chosen, logp_ref_chosen)?,
        rejected: log_ratio(logp_rejected, logp_ref_rejected)?,
    })
}

/// The DPO loss (sigmoid, cDPO, IPO, hinge; with or without a reference), averaged over pairs.
///
/// ```text
/// Δ_i = (π_w − ref_w) − (π_l − ref_l)        h_i = β Δ_i     (log-probs; ref ≡ 0 if reference-free)
/// Sigmoid: ℓ_i = −(1 − ε) log σ(h_i) − ε log σ(−h_i)
/// Ipo:     ℓ_i = (Δ_i − 1/(2β))²
/// Hinge:   ℓ_i = max(0, 1 − h_i)
/// loss = (1/B) Σ_i ℓ_i
/// ```
///
/// Reference: Rafailov et al., arXiv 2305.18290 (DPO); Mitchell, *A note on DPO with noisy
/// preferences* (cDPO); Azar et al., arXiv 2310.12036 (IPO); Liu et al., arXiv 2309.06657 (RSO).
///
/// # Arguments
/// * `logp_chosen`, `logp_rejected` — `[B]` sequence log-probs of the preferred and
///   dispreferred completions under the policy (differentiable; summed over tokens for DPO,
///   averaged for IPO).
/// * `logp_ref_chosen`, `logp_ref_rejected` — `[B]` the same under the frozen reference (detached;
///   ignored when `cfg.reference_free`).
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config, and the tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_loss, DpoConfig};
///
/// let pc = Tensor::from_slice(&[-10.0f64]).set_requires_grad(true);
/// let pr = Tensor::from_slice(&[-12.0f64]).set_requires_grad(true);
/// let (rc, rr) = (Tensor::from_slice(&[-11.0f64]), Tensor::from_slice(&[-11.0f64]));
/// let loss = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::default())?;
/// // Δ = 1 − (−1) = 2, h = 0.2: loss = −log σ(0.2)
/// let want = (1.0 + (-0.2f64).exp()).ln();
/// assert!((loss.double_value(&[]) - want).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_loss(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Tensor, LossError> {
    let p = check_pairs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, cfg)?;
    validate::finite_loss(per_pair_loss(&p, cfg)?.f_mean(None::<Kind>)?, cfg.checks)
}

/// `ℓ_i` of each pair.
fn per_pair_loss(p: &Pairs, cfg: &DpoConfig) -> Result<Tensor, LossError> {
    let delta = p.chosen.f_sub(&p.rejected)?;
    Ok(match cfg.variant {
        DpoVariant::Sigmoid => {
            let h = delta.f_mul_scalar(cfg.beta)?;
            let eps = cfg.label_smoothing;
            let agree = h.f_log_sigmoid()?.f_mul_scalar(-(1.0 - eps))?;
            if eps > 0.0 { agree.f_sub(&h.f_neg()?.f_log_sigmoid()?.f_mul_scalar(eps)?)? } else { agree }
        }
        DpoVariant::Ipo => delta.f_sub_scalar(1.0 / (2.0 * cfg.beta))?.f_square()?,
        DpoVariant::Hinge => delta.f_mul_scalar(-cfg.beta)?.f_add_scalar(1.0)?.f_relu()?,
    })
}

/// [`dpo_loss`] with the number of pairs `S` from `norm` (`norm.sequences`, else `B`), its
/// per-pair terms `ℓ [B]` and its [`DpoDiagnostics`] from the same pass.
///
/// ```text
/// loss = Σ_i ℓ_i / S
/// ```
///
/// With `norm = Normalizer::sequences(S)` for the `S` pairs of a whole optimiser batch, the
/// losses of its micro-batches sum to the loss of the batch.
///
/// Reference: as [`dpo_loss`]; the diagnostics are TRL's `rewards/*` metrics.
///
/// # Errors
/// As [`dpo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_loss_output, DpoConfig, Normalizer};
///
/// let pc = Tensor::from_slice(&[-10.0f64, -5.0]);
/// let pr = Tensor::from_slice(&[-12.0f64, -4.0]);
/// let rc = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let rr = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let out = dpo_loss_output(&pc, &pr, &rc, &rr, &DpoConfig::dpo().with_beta(0.5), &Normalizer::sequences(4.0))?;
/// let d = out.diagnostics.read()?;
/// assert_eq!(d.accuracy, 0.5); // pair 0 ranked right, pair 1 wrong
/// assert!((d.margin - (1.0 - 0.5) / 2.0).abs() < 1e-12); // margins β·2 = 1 and β·(−1) = −0.5
/// let sum: f64 = Vec::<f64>::try_from(&out.terms)?.iter().sum();
/// assert!((out.loss.double_value(&[]) - sum / 4.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_loss_output(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<DpoDiagnostics>, LossError> {
    let p = check_pairs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, cfg)?;
    let pairs = norm.sequences_or(p.chosen.size()[0] as f64)?;
    let terms = per_pair_loss(&p, cfg)?;
    let loss = validate::finite_loss(terms.f_sum(None::<Kind>)?.f_div_scalar(pairs)?, cfg.checks)?;
    let chosen = p.chosen.f_detach()?.f_mul_scalar(cfg.beta)?;
    let rejected = p.rejected.f_detach()?.f_mul_scalar(cfg.beta)?;
    let mean = |t: &Tensor| t.f_mean(Kind::Double);
    let diagnostics = OnDevice::new(&[
        Tensor::f_scalar_tensor(chosen.size()[0] as f64, (Kind::Double, chosen.device()))?,
        mean(&chosen.f_gt_tensor(&rejected)?.f_to_kind(Kind::Double)?)?,
        mean(&chosen.f_sub(&rejected)?)?,
        mean(&chosen)?,
        mean(&rejected)?,
    ])?;
    Ok(LossOutput { loss, terms, diagnostics })
}

/// What a DPO trainer logs, from the same pass as the loss ([`dpo_loss_output`]).
///
/// ```text
/// r_w = β (log π(y_w) − log π_ref(y_w))     r_l = β (log π(y_l) − log π_ref(y_l))
/// accuracy = mean(r_w > r_l)                margin = mean(r_w − r_l)
/// ```
///
/// Reference: Rafailov et al., arXiv 2305.18290 (the implicit reward); TRL's `rewards/*` metrics.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_loss_output, DpoConfig, Normalizer};
/// let x = Tensor::from_slice(&[-3.0f64]);
/// let d = dpo_loss_output(&x, &x, &x, &x, &DpoConfig::default(), &Normalizer::local())?.diagnostics.read()?;
/// assert_eq!((d.pairs, d.accuracy, d.margin, d.chosen_reward_mean), (1, 0.0, 0.0, 0.0)); // policy = reference
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct DpoDiagnostics {
    /// Number of pairs in this call.
    pub pairs: i64,
    /// Share of pairs whose chosen reward is strictly larger.
    pub accuracy: f64,
    /// Mean of `r_w − r_l`.
    pub margin: f64,
    /// Mean chosen reward.
    pub chosen_reward_mean: f64,
    /// Mean rejected reward.
    pub rejected_reward_mean: f64,
}

diagnostics_struct!(DpoDiagnostics { pairs, accuracy, margin, chosen_reward_mean, rejected_reward_mean });

/// The implicit rewards of chosen and rejected completions (detached), per pair.
///
/// ```text
/// r_w = β (log π(y_w) − log π_ref(y_w))     r_l = β (log π(y_l) − log π_ref(y_l))
/// ```
///
/// Their batch statistics (accuracy, margin, means) come with the loss in [`DpoDiagnostics`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_rewards, DpoConfig};
/// let x = Tensor::from_slice(&[-3.0f64]);
/// let r = dpo_rewards(&x, &x, &x, &x, &DpoConfig::default())?; // policy = reference
/// assert_eq!((r.chosen.double_value(&[0]), r.rejected.double_value(&[0])), (0.0, 0.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct DpoRewards {
    /// `[B]` implicit rewards of the chosen completions (detached).
    pub chosen: Tensor,
    /// `[B]` implicit rewards of the rejected completions (detached).
    pub rejected: Tensor,
}

/// The implicit rewards `β (log π − log π_ref)` of chosen and rejected completions, per pair.
/// Takes the same arguments as [`dpo_loss`].
///
/// Reference: Rafailov et al., arXiv 2305.18290, §5 (the implicit reward).
///
/// # Errors
/// As [`dpo_loss`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_rewards, DpoConfig};
///
/// let pc = Tensor::from_slice(&[-10.0f64, -5.0]);
/// let pr = Tensor::from_slice(&[-12.0f64, -4.0]);
/// let rc = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let rr = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let r = dpo_rewards(&pc, &pr, &rc, &rr, &DpoConfig::dpo().with_beta(0.5))?;
/// assert_eq!(Vec::<f64>::try_from(&r.chosen)?, vec![0.5, 0.0]);
/// assert_eq!(Vec::<f64>::try_from(&r.rejected)?, vec![-0.5, 0.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_rewards(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<DpoRewards, LossError> {
    let p = check_pairs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, cfg)?;
    Ok(DpoRewards {
        chosen: p.chosen.f_detach()?.f_mul_scalar(cfg.beta)?,
        rejected: p.rejected.f_detach()?.f_mul_scalar(cfg.beta)?,
    })
}
