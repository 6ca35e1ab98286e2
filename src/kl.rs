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
use crate::error::LossError;
use crate::token_inputs::{self, TokenArgs};
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
/// `Default`: K3, coefficient 0.001, `d` clamped to ±20 (as verl does before the exponential),
/// token-mean with local counts.
///
/// Reference: Schulman (2020), *Approximating KL divergence*; verl `kl_penalty`.
///
/// # Example
/// ```
/// use topr_loss::{KlConfig, KlEstimator};
/// let cfg = KlConfig { estimator: KlEstimator::K2, coef: 0.05, ..KlConfig::default() };
/// assert!(cfg.validate().is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlConfig {
    /// The estimator.
    pub estimator: KlEstimator,
    /// The coefficient `β` the aggregated penalty is multiplied by (finite, `≥ 0`).
    pub coef: f64,
    /// `d` is clamped to `±max_log_ratio` (> 0) before any use, so K3's `e^{−d}` stays finite.
    pub max_log_ratio: f64,
    /// How per-token penalties are reduced.
    pub aggregation: AggregationMode,
    /// The counts the aggregation divides by.
    pub normalizer: Normalizer,
}

impl Default for KlConfig {
    fn default() -> Self {
        Self {
            estimator: KlEstimator::K3,
            coef: 0.001,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            normalizer: Normalizer::local(),
        }
    }
}

impl KlConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field.
    ///
    /// ```
    /// assert!(topr_loss::KlConfig { coef: -1.0, ..Default::default() }.validate().is_err());
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
/// Add it to a policy loss built with the same mask and normalizer.
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
/// use topr_loss::{kl_penalty, KlConfig, KlEstimator};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let cfg = KlConfig { coef: 1.0, estimator: KlEstimator::K3, ..KlConfig::default() };
/// // Equal policies: zero penalty, zero gradient.
/// let kl = kl_penalty(&logp, &logp.detach(), &mask, &cfg)?;
/// assert_eq!(kl.double_value(&[]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn kl_penalty(logp: &Tensor, logp_ref: &Tensor, mask: &Tensor, cfg: &KlConfig) -> Result<Tensor, LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_ref, "logp_ref"),
        weights: None,
        mask,
        per_token_weights: false,
    })?;
    let d = x.delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?;
    let k = match cfg.estimator {
        KlEstimator::K1 => d,
        KlEstimator::K2 => d.f_square()?.f_mul_scalar(0.5)?,
        KlEstimator::K3 => d.f_neg()?.f_exp()?.f_add(&d)?.f_sub_scalar(1.0)?,
    };
    validate::finite_loss(x.reduce_tokens(&k, cfg.aggregation, &cfg.normalizer)?.f_mul_scalar(cfg.coef)?)
}
