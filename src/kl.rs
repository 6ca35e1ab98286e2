//! KL penalties against a reference policy, from per-token log-probs, as a loss term.
//!
//! With `d_t = log π_t − log π_ref,t` on tokens sampled from π:
//!
//! ```text
//! K1   k = d                      unbiased for KL(π‖π_ref), high variance, can be negative
//! Abs  k = |d|                    biased, never negative (verl's `abs`)
//! K2   k = d² / 2                 biased, low variance; its gradient is that of the reverse KL
//! K3   k = e^{−d} + d − 1         unbiased, never negative, low variance ("low_var_kl")
//!
//! value clamp (optional)   k ← clamp(k, ±C)              verl clamps K3 at C = 10
//! straight-through ("+")   k ← d²/2 − sg(d²/2) + sg(k)   the value of k, the gradient of K2
//! importance-corrected     k ← k · exp(log π − sg(log μ))  TRL's use_bias_correction_kl
//! ```
//!
//! Reference: Schulman, *Approximating KL divergence* (2020); GRPO (arXiv 2402.03300) uses K3;
//! verl `kl_penalty` (the `+` suffix); DeepSeek-V3.2 (arXiv 2512.02556) and TRL
//! `use_bias_correction_kl` for the importance correction.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct, stats};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::Tensor;

/// Which estimator of `KL(π ‖ π_ref)` a token contributes.
///
/// # Example
/// ```
/// use topr_loss::{KlConfig, KlEstimator};
/// assert_eq!(KlConfig::default().estimator, KlEstimator::K3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum KlEstimator {
    /// `d`.
    K1,
    /// `d²/2`.
    K2,
    /// `e^{−d} + d − 1`.
    #[default]
    K3,
    /// `|d|` (verl's `abs`): never negative, biased; its gradient is `sign(d)` (0 at `d = 0`).
    Abs,
}

/// Configuration of [`kl_penalty`].
///
/// `Default` ([`KlConfig::k3`]): K3, coefficient 0.001, `d` clamped to ±20 (as verl does before
/// the exponential), no clamp of the estimate, no straight-through, token-mean.
/// [`KlConfig::low_var_kl`] is verl's K3 exactly (its estimate clamped to ±10).
///
/// Reference: Schulman (2020), *Approximating KL divergence*; verl `kl_penalty`.
///
/// # Example
/// ```
/// use topr_loss::{KlConfig, KlEstimator};
/// let cfg = KlConfig::k2().with_coef(0.05);
/// assert_eq!((cfg.estimator, cfg.coef), (KlEstimator::K2, 0.05));
/// assert!(cfg.validate().is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct KlConfig {
    /// The estimator.
    pub estimator: KlEstimator,
    /// The coefficient `β` the aggregated penalty is multiplied by (finite, `≥ 0`).
    pub coef: f64,
    /// `d` is clamped to `±max_log_ratio` (> 0) before any use, so K3's `e^{−d}` stays finite.
    pub max_log_ratio: f64,
    /// `Some(C)`: the estimate `k` is clamped to `±C` (> 0) after it is computed; the clamped
    /// tokens get zero gradient. verl clamps K3 at 10 (`low_var_kl`, `k3`); it clamps no other
    /// estimator. `None` (the default): no clamp.
    pub max_estimate: Option<f64>,
    /// Straight-through (verl's `+` suffix: `k1+`, `k3+`, `abs+`): the value of the estimator with
    /// the gradient of K2, `d²/2 − sg(d²/2) + sg(k)`, whose expected gradient is that of
    /// `KL(π‖π_ref)`. No effect on K2. `false` by default.
    pub straight_through: bool,
    /// How per-token penalties are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for KlConfig {
    fn default() -> Self {
        Self::k3()
    }
}

impl KlConfig {
    /// K3 (`e^{−d} + d − 1`, verl's `low_var_kl`, GRPO's), coefficient 0.001, token-mean.
    ///
    /// ```
    /// assert_eq!(topr_loss::KlConfig::k3(), topr_loss::KlConfig::default());
    /// ```
    pub const fn k3() -> Self {
        Self {
            estimator: KlEstimator::K3,
            coef: 0.001,
            max_log_ratio: 20.0,
            max_estimate: None,
            straight_through: false,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// verl's `low_var_kl` (and `k3`) exactly: K3 with `d` clamped to ±20 and the estimate clamped
    /// to ±10, otherwise as [`KlConfig::k3`].
    ///
    /// ```
    /// use topr_loss::{KlConfig, KlEstimator};
    /// let cfg = KlConfig::low_var_kl();
    /// assert_eq!((cfg.estimator, cfg.max_estimate), (KlEstimator::K3, Some(10.0)));
    /// ```
    pub const fn low_var_kl() -> Self {
        Self::k3().with_max_estimate(Some(10.0))
    }

    /// `|d|` (verl's `abs`), otherwise as [`KlConfig::k3`].
    ///
    /// ```
    /// assert_eq!(topr_loss::KlConfig::abs().estimator, topr_loss::KlEstimator::Abs);
    /// ```
    pub const fn abs() -> Self {
        Self::k3().with_estimator(KlEstimator::Abs)
    }

    /// K1 (`d`, verl's `kl`), otherwise as [`KlConfig::k3`].
    ///
    /// ```
    /// assert_eq!(topr_loss::KlConfig::k1().estimator, topr_loss::KlEstimator::K1);
    /// ```
    pub const fn k1() -> Self {
        Self::k3().with_estimator(KlEstimator::K1)
    }

    /// K2 (`d²/2`, verl's `mse`), otherwise as [`KlConfig::k3`].
    ///
    /// ```
    /// assert_eq!(topr_loss::KlConfig::k2().estimator, topr_loss::KlEstimator::K2);
    /// ```
    pub const fn k2() -> Self {
        Self::k3().with_estimator(KlEstimator::K2)
    }

    /// The same config with another estimator.
    ///
    /// ```
    /// use topr_loss::{KlConfig, KlEstimator};
    /// assert_eq!(KlConfig::k3().with_estimator(KlEstimator::K1), KlConfig::k1());
    /// ```
    pub const fn with_estimator(self, estimator: KlEstimator) -> Self {
        Self { estimator, ..self }
    }

    /// The same config with another coefficient.
    ///
    /// ```
    /// assert_eq!(topr_loss::KlConfig::k3().with_coef(0.1).coef, 0.1);
    /// ```
    pub const fn with_coef(self, coef: f64) -> Self {
        Self { coef, ..self }
    }

    crate::setters::setters!(KlConfig, k3(); checks, aggregation, max_log_ratio);

    /// The same config with another clamp of the estimate (`None`: no clamp).
    ///
    /// ```
    /// assert_eq!(topr_loss::KlConfig::k3().with_max_estimate(Some(10.0)), topr_loss::KlConfig::low_var_kl());
    /// ```
    pub const fn with_max_estimate(self, max_estimate: Option<f64>) -> Self {
        Self { max_estimate, ..self }
    }

    /// The same config with the straight-through gradient on or off (verl's `+` suffix).
    ///
    /// ```
    /// assert!(topr_loss::KlConfig::k3().with_straight_through(true).straight_through);
    /// ```
    pub const fn with_straight_through(self, straight_through: bool) -> Self {
        Self { straight_through, ..self }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field.
    ///
    /// ```
    /// assert!(topr_loss::KlConfig::k3().with_coef(-1.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if !(self.coef.is_finite() && self.coef >= 0.0) {
            return Err(LossError::InvalidConfig {
                field: "coef",
                value: self.coef,
                reason: "must be finite and >= 0".into(),
            });
        }
        validate::positive(self.max_log_ratio, "max_log_ratio", "the log-ratio clamp must be > 0")?;
        if let Some(c) = self.max_estimate {
            validate::positive(c, "max_estimate", "the clamp of the estimate must be > 0 (verl uses 10)")?;
        }
        Ok(())
    }
}

/// The KL penalty `coef · aggregate(k(d))` of the policy against a reference, per token.
///
/// ```text
/// d_t = clamp(log π_t − sg(log π_ref,t), ±M)
/// k_t = d_t | |d_t| | d_t²/2 | e^{−d_t} + d_t − 1
/// k_t ← clamp(k_t, ±C)                        with max_estimate = Some(C)
/// k_t ← d_t²/2 − sg(d_t²/2) + sg(k_t)          with straight_through
/// loss = coef · Σ_i α_i Σ_t m k_t
/// ```
///
/// Add it to a policy loss built with the same mask and counts ([`kl_penalty_output`] takes a
/// [`Normalizer`]).
///
/// Reference: Schulman (2020); GRPO, arXiv 2402.03300 (K3 as a loss term); verl `kl_penalty`
/// (`kl`, `abs`, `mse`, `low_var_kl` = [`KlConfig::low_var_kl`], and the `+` forms with
/// [`KlConfig::with_straight_through`]).
///
/// # Arguments
/// * `logp` — `[B, T]`, per-token log-probs of the policy (differentiable).
/// * `logp_ref` — `[B, T]`, of the reference policy (detached).
/// * `mask` — `[B, T]`.
///
/// # Errors
/// [`LossError::InvalidConfig`] and the tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_penalty, KlConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let cfg = KlConfig::k3().with_coef(1.0);
/// // Equal policies: zero penalty, zero gradient.
/// let kl = kl_penalty(&logp, &logp.detach(), &mask, &cfg)?;
/// assert_eq!(kl.double_value(&[]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn kl_penalty(logp: &Tensor, logp_ref: &Tensor, mask: &Tensor, cfg: &KlConfig) -> Result<Tensor, LossError> {
    let (x, k) = estimate(logp, logp_ref, mask, cfg)?;
    validate::finite_loss(
        x.reduce_tokens(&k, cfg.aggregation, &Normalizer::local())?.f_mul_scalar(cfg.coef)?,
        cfg.checks,
    )
}

/// [`kl_penalty`] with the counts of `norm`, its per-token terms `coef · k_t` (`[B, T]`, zero on
/// padding) and its [`KlDiagnostics`] from the same pass.
///
/// Reference: as [`kl_penalty`].
///
/// # Errors
/// As [`kl_penalty`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_penalty_output, KlConfig, Normalizer};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let logp_ref = Tensor::from_slice2(&[[-1.5f64, -2.0]]);
/// let mask = Tensor::from_slice2(&[[true, false]]);
/// let out = kl_penalty_output(&logp, &logp_ref, &mask, &KlConfig::k1().with_coef(2.0), &Normalizer::local())?;
/// assert_eq!(out.loss.double_value(&[]), 1.0); // 2 · 0.5
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.tokens, d.kl_mean), (1, 0.5));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn kl_penalty_output(
    logp: &Tensor,
    logp_ref: &Tensor,
    mask: &Tensor,
    cfg: &KlConfig,
    norm: &Normalizer,
) -> Result<LossOutput<KlDiagnostics>, LossError> {
    let (x, k) = estimate(logp, logp_ref, mask, cfg)?;
    let loss = validate::finite_loss(x.reduce_tokens(&k, cfg.aggregation, norm)?.f_mul_scalar(cfg.coef)?, cfg.checks)?;
    let tokens = stats::count(&x.mask)?;
    let diagnostics = OnDevice::new(&[tokens.shallow_clone(), stats::mean_where(&k, &x.mask)?])?;
    Ok(LossOutput { loss, terms: x.zero_padding(&k.f_mul_scalar(cfg.coef)?)?, diagnostics })
}

/// The importance-corrected KL penalty: each token's estimate weighted by the (differentiable)
/// ratio of the policy to the behaviour policy μ that sampled the tokens, so that its gradient is
/// an unbiased estimate of the gradient of `KL(π‖π_ref)` on tokens sampled from μ ≠ π.
///
/// ```text
/// d_t = clamp(log π_t − sg(log π_ref,t), ±M)          k_t as in kl_penalty (estimator, clamp, "+")
/// w_t = exp(clamp(log π_t − sg(log μ_t), ±M))         not detached: its gradient is w_t ∇log π_t
/// loss = coef · Σ_i α_i Σ_t m w_t k_t
/// ```
///
/// With K3 this is TRL's `use_bias_correction_kl=True` at `importance_sampling_level="token"`
/// (the per-token k3 times the non-detached ratio `exp(log π − log π_old)`); TRL clamps neither
/// `d` nor the ratio, which only matters past `|δ| = M`. On-policy (`logp_mu = logp`) the value
/// equals [`kl_penalty`]'s but the gradient does not: `∇(w k) = k ∇log π + ∇k` there.
///
/// Reference: DeepSeek-V3.2, arXiv 2512.02556 (the unbiased KL estimate); TRL 1.16.0
/// `GRPOConfig.use_bias_correction_kl` (`grpo_trainer.py`, `_compute_loss`).
///
/// # Arguments
/// * `logp` — `[B, T]`, per-token log-probs of the policy (differentiable).
/// * `logp_mu` — `[B, T]`, of the policy that sampled the tokens (TRL's `old_per_token_logps`;
///   detached).
/// * `logp_ref` — `[B, T]`, of the reference policy (detached).
/// * `mask` — `[B, T]`.
///
/// # Errors
/// [`LossError::InvalidConfig`] and the tensor checks of [`LossError`], naming `logp`,
/// `logp_mu`, `logp_ref` or `mask`; [`LossError::NonFiniteLoss`] if the weighted estimate
/// overflows the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_penalty, kl_penalty_corrected, KlConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0]]).set_requires_grad(true);
/// let logp_ref = Tensor::from_slice2(&[[-1.5f64, -1.0]]);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let cfg = KlConfig::k3().with_coef(1.0);
/// // On-policy the weight is 1: the same value as the plain penalty.
/// let corrected = kl_penalty_corrected(&logp, &logp.detach(), &logp_ref, &mask, &cfg)?;
/// let plain = kl_penalty(&logp, &logp_ref, &mask, &cfg)?;
/// assert!((corrected.double_value(&[]) - plain.double_value(&[])).abs() < 1e-15);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn kl_penalty_corrected(
    logp: &Tensor,
    logp_mu: &Tensor,
    logp_ref: &Tensor,
    mask: &Tensor,
    cfg: &KlConfig,
) -> Result<Tensor, LossError> {
    let (x, k) = estimate_corrected(logp, logp_mu, logp_ref, mask, cfg)?;
    validate::finite_loss(
        x.reduce_tokens(&k, cfg.aggregation, &Normalizer::local())?.f_mul_scalar(cfg.coef)?,
        cfg.checks,
    )
}

/// [`kl_penalty_corrected`] with the counts of `norm`, its per-token terms `coef · w_t k_t`
/// (`[B, T]`, zero on padding) and its [`KlDiagnostics`] (`kl_mean`: the mean of the weighted
/// estimate `w_t k_t`) from the same pass.
///
/// Reference: as [`kl_penalty_corrected`].
///
/// # Errors
/// As [`kl_penalty_corrected`], and [`LossError::InvalidConfig`] for a non-positive count in
/// `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_penalty_corrected_output, KlConfig, Normalizer};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.0f64 - 2f64.ln(), -2.0]]); // w = 2, then 1
/// let logp_ref = Tensor::from_slice2(&[[-1.5f64, -2.0]]);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let out = kl_penalty_corrected_output(&logp, &logp_mu, &logp_ref, &mask, &KlConfig::k1().with_coef(1.0), &Normalizer::local())?;
/// assert!((out.loss.double_value(&[]) - 0.5).abs() < 1e-12); // (2 · 0.5 + 1 · 0) / 2
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn kl_penalty_corrected_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    logp_ref: &Tensor,
    mask: &Tensor,
    cfg: &KlConfig,
    norm: &Normalizer,
) -> Result<LossOutput<KlDiagnostics>, LossError> {
    let (x, k) = estimate_corrected(logp, logp_mu, logp_ref, mask, cfg)?;
    let loss = validate::finite_loss(x.reduce_tokens(&k, cfg.aggregation, norm)?.f_mul_scalar(cfg.coef)?, cfg.checks)?;
    let tokens = stats::count(&x.mask)?;
    let diagnostics = OnDevice::new(&[tokens.shallow_clone(), stats::mean_where(&k, &x.mask)?])?;
    Ok(LossOutput { loss, terms: x.zero_padding(&k.f_mul_scalar(cfg.coef)?)?, diagnostics })
}

/// The checked inputs (against `logp_ref`) and the importance-weighted estimate per token.
fn estimate_corrected(
    logp: &Tensor,
    logp_mu: &Tensor,
    logp_ref: &Tensor,
    mask: &Tensor,
    cfg: &KlConfig,
) -> Result<(TokenInputs, Tensor), LossError> {
    let (x, k) = estimate(logp, logp_ref, mask, cfg)?;
    let mu = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: None,
        mask,
        per_token_weights: false,
        checks: cfg.checks,
    })?;
    let w = mu.delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?.f_exp()?;
    Ok((x, k.f_mul(&w)?))
}

/// The checked inputs and the estimator's value per token.
fn estimate(
    logp: &Tensor,
    logp_ref: &Tensor,
    mask: &Tensor,
    cfg: &KlConfig,
) -> Result<(TokenInputs, Tensor), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_ref, "logp_ref"),
        weights: None,
        mask,
        per_token_weights: false,
        checks: cfg.checks,
    })?;
    let k = estimator_value(&x.delta, cfg)?;
    Ok((x, k))
}

/// The per-token estimate of `cfg` for `δ = log π − sg(log π_ref)`: clamp, estimator, value
/// clamp, straight-through.
pub(crate) fn estimator_value(delta: &Tensor, cfg: &KlConfig) -> Result<Tensor, LossError> {
    let d = delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?;
    let half_square = || -> Result<Tensor, LossError> { Ok(d.f_square()?.f_mul_scalar(0.5)?) };
    let mut k = match cfg.estimator {
        KlEstimator::K1 => d.shallow_clone(),
        KlEstimator::Abs => d.f_abs()?,
        KlEstimator::K2 => half_square()?,
        KlEstimator::K3 => d.f_neg()?.f_exp()?.f_add(&d)?.f_sub_scalar(1.0)?,
    };
    if let Some(c) = cfg.max_estimate {
        k = k.f_clamp(-c, c)?;
    }
    if cfg.straight_through && cfg.estimator != KlEstimator::K2 {
        let k2 = half_square()?;
        k = k2.f_sub(&k2.f_detach()?)?.f_add(&k.f_detach()?)?;
    }
    Ok(k)
}

/// What a trainer logs next to a KL penalty, from the same pass ([`kl_penalty_output`]).
///
/// ```text
/// kl_mean = mean over unmasked tokens of k_t    (the estimate of KL(π‖π_ref) per token, before coef)
/// ```
///
/// Reference: verl's `actor/kl_loss` metric.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_penalty_output, KlConfig, Normalizer};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let d = kl_penalty_output(&lp, &lp, &lp.ones_like(), &KlConfig::k3(), &Normalizer::local())?.diagnostics.read()?;
/// assert_eq!((d.tokens, d.kl_mean), (2, 0.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct KlDiagnostics {
    /// Number of unmasked tokens in this call.
    pub tokens: i64,
    /// Mean estimator value over them.
    pub kl_mean: f64,
}

diagnostics_struct!(KlDiagnostics { tokens, kl_mean });
