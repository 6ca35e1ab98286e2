//! KL penalties against a reference policy, from per-token log-probs, as a loss term.
//!
//! With `d_t = log π_t − log π_ref,t` on tokens sampled from π:
//!
//! ```text
//! K1   k = d                      unbiased for KL(π‖π_ref), high variance, can be negative
//! K2   k = d² / 2                 biased, low variance; its gradient is that of the reverse KL
//! K3   k = e^{−d} + d − 1         unbiased, never negative, low variance ("low_var_kl")
//! ```
//!
//! Reference: Schulman, *Approximating KL divergence* (2020); GRPO (arXiv 2402.03300) uses K3.

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
#[non_exhaustive]
pub enum KlEstimator {
    /// `d`.
    K1,
    /// `d²/2`.
    K2,
    /// `e^{−d} + d − 1`.
    #[default]
    K3,
}

/// Configuration of [`kl_penalty`].
///
/// `Default` ([`KlConfig::k3`]): K3, coefficient 0.001, `d` clamped to ±20 (as verl does before
/// the exponential), token-mean.
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
#[non_exhaustive]
pub struct KlConfig {
    /// The estimator.
    pub estimator: KlEstimator,
    /// The coefficient `β` the aggregated penalty is multiplied by (finite, `≥ 0`).
    pub coef: f64,
    /// `d` is clamped to `±max_log_ratio` (> 0) before any use, so K3's `e^{−d}` stays finite.
    pub max_log_ratio: f64,
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
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
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

    /// The same config with another log-ratio clamp.
    ///
    /// ```
    /// assert_eq!(topr_loss::KlConfig::k3().with_max_log_ratio(5.0).max_log_ratio, 5.0);
    /// ```
    pub const fn with_max_log_ratio(self, max_log_ratio: f64) -> Self {
        Self { max_log_ratio, ..self }
    }

    /// The same config with another aggregation.
    ///
    /// ```
    /// use topr_loss::{AggregationMode, KlConfig};
    /// assert_eq!(KlConfig::k3().with_aggregation(AggregationMode::TokenSum).aggregation, AggregationMode::TokenSum);
    /// ```
    pub const fn with_aggregation(self, aggregation: AggregationMode) -> Self {
        Self { aggregation, ..self }
    }

    /// The same config with another checks level ([`Checks::Shapes`]: no host read per call).
    ///
    /// ```
    /// use topr_loss::{Checks, KlConfig};
    /// assert_eq!(KlConfig::k3().with_checks(Checks::Shapes).checks, Checks::Shapes);
    /// ```
    pub const fn with_checks(self, checks: Checks) -> Self {
        Self { checks, ..self }
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
        Ok(())
    }
}

/// The KL penalty `coef · aggregate(k(d))` of the policy against a reference, per token.
///
/// ```text
/// d_t = clamp(log π_t − sg(log π_ref,t), ±M)
/// k_t = d_t | d_t²/2 | e^{−d_t} + d_t − 1
/// loss = coef · Σ_i α_i Σ_t m k_t
/// ```
///
/// Add it to a policy loss built with the same mask and counts ([`kl_penalty_output`] takes a
/// [`Normalizer`]).
///
/// Reference: Schulman (2020); GRPO, arXiv 2402.03300 (K3 as a loss term).
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
    let d = x.delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?;
    let k = match cfg.estimator {
        KlEstimator::K1 => d,
        KlEstimator::K2 => d.f_square()?.f_mul_scalar(0.5)?,
        KlEstimator::K3 => d.f_neg()?.f_exp()?.f_add(&d)?.f_sub_scalar(1.0)?,
    };
    Ok((x, k))
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
