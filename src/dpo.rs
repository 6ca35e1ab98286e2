//! Direct preference optimisation and its variants, on sequence log-probabilities of a chosen
//! and a rejected completion per prompt.
//!
//! ```text
//! Δ = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))      h = β Δ
//!
//! Sigmoid (DPO, cDPO)   ℓ = −(1 − ε) log σ(h) − ε log σ(−h)
//! Ipo                   ℓ = (Δ − 1/(2β))²
//! Hinge (RSO)           ℓ = max(0, 1 − h)
//! reference-free        log π_ref ≡ 0
//! ```
//!
//! `log σ` is computed as `log_sigmoid`, never `log(sigmoid(·))`, in f32 or wider, so margins of
//! `±1e4` give finite values and gradients.

use crate::error::LossError;
use crate::validate;
use tch::{Kind, Tensor};

/// The DPO loss family.
///
/// # Example
/// ```
/// use topr_loss::{DpoConfig, DpoVariant};
/// assert_eq!(DpoConfig::default().variant, DpoVariant::Sigmoid);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DpoVariant {
    /// `−(1 − ε) log σ(h) − ε log σ(−h)`: DPO (Rafailov et al., arXiv 2305.18290); with label
    /// smoothing `ε > 0`, conservative DPO (cDPO, Mitchell 2023) / robust DPO.
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
/// `Default`: `β = 0.1`, no label smoothing, the sigmoid loss, with a reference model.
///
/// Reference: Rafailov et al., *Direct Preference Optimization*, arXiv 2305.18290; TRL's
/// `DPOTrainer` for the option names.
///
/// # Example
/// ```
/// use topr_loss::DpoConfig;
/// let cfg = DpoConfig { label_smoothing: 0.1, ..DpoConfig::default() }; // cDPO
/// assert!(cfg.validate().is_ok());
/// assert!(DpoConfig { beta: 0.0, ..cfg }.validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoConfig {
    /// `β > 0`: the strength of the implicit KL constraint.
    pub beta: f64,
    /// `ε ∈ [0, 0.5]`: the assumed share of flipped preference labels (sigmoid variant only).
    pub label_smoothing: f64,
    /// Which loss.
    pub variant: DpoVariant,
    /// Ignore the reference log-probs (`log π_ref ≡ 0`); the `ref_*` arguments may then be
    /// undefined tensors (`Tensor::new()`).
    pub reference_free: bool,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self { beta: 0.1, label_smoothing: 0.0, variant: DpoVariant::Sigmoid, reference_free: false }
    }
}

impl DpoConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`]: `β` not finite and `> 0`; `ε ∉ [0, 0.5]`; `ε > 0` with a
    /// variant other than `Sigmoid` (where it has no meaning).
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoVariant};
    /// let bad = DpoConfig { variant: DpoVariant::Ipo, label_smoothing: 0.1, ..DpoConfig::default() };
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
    policy_chosen: &Tensor,
    policy_rejected: &Tensor,
    ref_chosen: &Tensor,
    ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Pairs, LossError> {
    cfg.validate()?;
    let mut args = vec![(policy_chosen, "policy_chosen"), (policy_rejected, "policy_rejected")];
    if !cfg.reference_free {
        args.push((ref_chosen, "ref_chosen"));
        args.push((ref_rejected, "ref_rejected"));
    }
    let mut kinds = vec![];
    for (t, name) in &args {
        kinds.push(validate::float_tensor(t, name)?);
    }
    let shape = validate::rank(policy_chosen, "policy_chosen", 1, "[B] sequence log-probabilities")?;
    validate::non_empty(&shape, "policy_chosen", "preference pair")?;
    let device = policy_chosen.device();
    for (t, name) in &args[1..] {
        validate::same_shape(t, name, &shape, "the shape of `policy_chosen`")?;
        validate::same_device(t, name, device, "policy_chosen")?;
    }
    for (t, name) in &args {
        validate::finite(t, name, None)?;
    }
    let kind = validate::compute_kind(&kinds);
    let log_ratio = |policy: &Tensor, reference: &Tensor| -> Result<Tensor, LossError> {
        let p = policy.f_to_kind(kind)?;
        Ok(if cfg.reference_free { p } else { p.f_sub(&reference.f_detach()?.f_to_kind(kind)?)? })
    };
    Ok(Pairs { chosen: log_ratio(policy_chosen, ref_chosen)?, rejected: log_ratio(policy_rejected, ref_rejected)? })
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
/// * `policy_chosen`, `policy_rejected` — `[B]` sequence log-probs of the preferred and
///   dispreferred completions under the policy (differentiable; summed over tokens for DPO,
///   averaged for IPO).
/// * `ref_chosen`, `ref_rejected` — `[B]` the same under the frozen reference (detached;
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
    policy_chosen: &Tensor,
    policy_rejected: &Tensor,
    ref_chosen: &Tensor,
    ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Tensor, LossError> {
    let p = check_pairs(policy_chosen, policy_rejected, ref_chosen, ref_rejected, cfg)?;
    let delta = p.chosen.f_sub(&p.rejected)?;
    let per_pair = match cfg.variant {
        DpoVariant::Sigmoid => {
            let h = delta.f_mul_scalar(cfg.beta)?;
            let eps = cfg.label_smoothing;
            let agree = h.f_log_sigmoid()?.f_mul_scalar(-(1.0 - eps))?;
            if eps > 0.0 { agree.f_sub(&h.f_neg()?.f_log_sigmoid()?.f_mul_scalar(eps)?)? } else { agree }
        }
        DpoVariant::Ipo => delta.f_sub_scalar(1.0 / (2.0 * cfg.beta))?.f_square()?,
        DpoVariant::Hinge => delta.f_mul_scalar(-cfg.beta)?.f_add_scalar(1.0)?.f_relu()?,
    };
    validate::finite_loss(per_pair.f_mean(None::<Kind>)?)
}

/// What a DPO trainer logs: the implicit rewards and how well they rank the pairs.
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
/// use topr_loss::{dpo_rewards, DpoConfig};
/// let x = Tensor::from_slice(&[-3.0f64]);
/// let r = dpo_rewards(&x, &x, &x, &x, &DpoConfig::default())?; // policy = reference
/// assert_eq!((r.accuracy, r.margin, r.chosen_mean), (0.0, 0.0, 0.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug)]
pub struct DpoRewards {
    /// `[B]` implicit rewards of the chosen completions (detached).
    pub chosen: Tensor,
    /// `[B]` implicit rewards of the rejected completions (detached).
    pub rejected: Tensor,
    /// Share of pairs whose chosen reward is strictly larger.
    pub accuracy: f64,
    /// Mean of `r_w − r_l`.
    pub margin: f64,
    /// Mean chosen reward.
    pub chosen_mean: f64,
    /// Mean rejected reward.
    pub rejected_mean: f64,
}

/// The implicit rewards `β (log π − log π_ref)` of chosen and rejected completions, with the
/// accuracy and mean margin. Takes the same arguments as [`dpo_loss`].
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
/// let r = dpo_rewards(&pc, &pr, &rc, &rr, &DpoConfig { beta: 0.5, ..DpoConfig::default() })?;
/// assert_eq!(r.accuracy, 0.5); // pair 0 ranked right, pair 1 wrong
/// assert!((r.margin - (1.0 - 0.5) / 2.0).abs() < 1e-12); // margins β·2 = 1 and β·(−1) = −0.5
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn dpo_rewards(
    policy_chosen: &Tensor,
    policy_rejected: &Tensor,
    ref_chosen: &Tensor,
    ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<DpoRewards, LossError> {
    let p = check_pairs(policy_chosen, policy_rejected, ref_chosen, ref_rejected, cfg)?;
    let chosen = p.chosen.f_detach()?.f_mul_scalar(cfg.beta)?;
    let rejected = p.rejected.f_detach()?.f_mul_scalar(cfg.beta)?;
    let mean = |t: &Tensor| -> Result<f64, LossError> { Ok(t.f_mean(Kind::Double)?.f_double_value(&[])?) };
    Ok(DpoRewards {
        accuracy: mean(&chosen.f_gt_tensor(&rejected)?)?,
        margin: mean(&chosen.f_sub(&rejected)?)?,
        chosen_mean: mean(&chosen)?,
        rejected_mean: mean(&rejected)?,
        chosen,
        rejected,
    })
}
