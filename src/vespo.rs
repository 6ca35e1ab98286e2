//! VESPO, *Variational sEquence-level Soft Policy Optimization*: REINFORCE on every token with
//! a per-sequence, stop-gradient weight `φ(w)` of the sequence's importance ratio — a smooth
//! gamma-shaped kernel in place of a clip, shaped differently for positive and negative
//! advantages.
//!
//! ```text
//! S_i   = Σ_t m clamp(log π_t − log μ_t, ±M)          the sequence's log-ratio (a sum, not a mean)
//! w_i   = exp(clamp(S_i, ln 1e-8, M))
//! (k, λ) = (k₊, λ₊) if A_i ≥ 0 else (k₋, λ₋)
//! φ_i   = exp(λ + k ln w_i − λ w_i) = e^λ w_i^k e^{−λ w_i}      φ(1) = 1, largest at w = k/λ
//! ℓ_t   = −sg(φ_i) · A_i · log π_t
//! ```
//!
//! On-policy (`w = 1`) the gradient is REINFORCE's. Off-policy, a sequence the policy has moved
//! far in either direction (`w → 0` or `w → ∞`) gets a vanishing weight instead of a clipped one,
//! and the kernel's peak sits below 1 for positive advantages (`k₊/λ₊ = 2/3`) and above 1 for
//! negative ones (`3/2`): the update leans away from sequences the policy already favours too much
//! when they are good, and keeps pushing down those it still favours when they are bad.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct, stats};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::{Kind, Tensor};

/// The smallest sequence weight VESPO's kernel sees: `w ≥ 1e-8` (TRL's `log(1e-8)` clamp).
pub const VESPO_MIN_LOG_WEIGHT: f64 = -18.420_680_743_952_367;

/// The kernel's shapes and the aggregation of [`vespo_loss`].
///
/// `Default` is [`VespoConfig::vespo`].
///
/// Reference: *VESPO: Variational Sequence-Level Soft Policy Optimization*, arXiv 2602.10693;
/// TRL `GRPOConfig(loss_type="vespo")` with `vespo_k_pos`, `vespo_lambda_pos`, `vespo_k_neg`,
/// `vespo_lambda_neg` (`GRPOTrainer.get_gamma_weights`; its lines restated in the tests).
///
/// # Example
/// ```
/// use topr_loss::VespoConfig;
/// let c = VespoConfig::vespo();
/// assert_eq!((c.k_pos, c.lambda_pos, c.k_neg, c.lambda_neg), (2.0, 3.0, 3.0, 2.0));
/// assert!(c.with_positive(2.0, 0.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct VespoConfig {
    /// `k₊ ≥ 0`, the kernel's power for sequences with `A ≥ 0`.
    pub k_pos: f64,
    /// `λ₊ > 0`, its rate.
    pub lambda_pos: f64,
    /// `k₋ ≥ 0`, the power for sequences with `A < 0`.
    pub k_neg: f64,
    /// `λ₋ > 0`, their rate.
    pub lambda_neg: f64,
    /// `M`: each token's log-ratio and the sequence's are clamped to `±M` (TRL: 20).
    pub max_log_ratio: f64,
    /// How per-token losses are reduced (TRL: a global token mean).
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for VespoConfig {
    fn default() -> Self {
        Self::vespo()
    }
}

impl VespoConfig {
    /// TRL's defaults: `(k₊, λ₊) = (2, 3)`, `(k₋, λ₋) = (3, 2)`, `M = 20`, `TokenMean`.
    ///
    /// ```
    /// assert_eq!(topr_loss::VespoConfig::vespo(), topr_loss::VespoConfig::default());
    /// ```
    pub const fn vespo() -> Self {
        Self {
            k_pos: 2.0,
            lambda_pos: 3.0,
            k_neg: 3.0,
            lambda_neg: 2.0,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// The same config with the kernel `(k₊, λ₊)` for `A ≥ 0`.
    ///
    /// ```
    /// assert_eq!(topr_loss::VespoConfig::vespo().with_positive(1.0, 1.0).k_pos, 1.0);
    /// ```
    pub const fn with_positive(self, k: f64, lambda: f64) -> Self {
        Self { k_pos: k, lambda_pos: lambda, ..self }
    }

    /// The same config with the kernel `(k₋, λ₋)` for `A < 0`.
    ///
    /// ```
    /// assert_eq!(topr_loss::VespoConfig::vespo().with_negative(1.0, 4.0).lambda_neg, 4.0);
    /// ```
    pub const fn with_negative(self, k: f64, lambda: f64) -> Self {
        Self { k_neg: k, lambda_neg: lambda, ..self }
    }

    crate::setters::setters!(VespoConfig, vespo(); checks, aggregation);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming `k_pos`/`k_neg` when not finite and `>= 0`,
    /// `lambda_pos`/`lambda_neg` when not finite and `> 0` (TRL floors λ at 1e-4 instead), or
    /// `max_log_ratio` when not `> 0`.
    ///
    /// ```
    /// assert!(topr_loss::VespoConfig::vespo().with_negative(-1.0, 2.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        for (v, field) in [(self.k_pos, "k_pos"), (self.k_neg, "k_neg")] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(LossError::InvalidConfig {
                    field,
                    value: v,
                    reason: "the kernel's power must be finite and >= 0".into(),
                });
            }
        }
        for (v, field) in [(self.lambda_pos, "lambda_pos"), (self.lambda_neg, "lambda_neg")] {
            if !(v.is_finite() && v > 0.0) {
                return Err(LossError::InvalidConfig {
                    field,
                    value: v,
                    reason: "the kernel's rate must be finite and > 0".into(),
                });
            }
        }
        validate::positive(self.max_log_ratio, "max_log_ratio", "the log-ratio clamp must be > 0 (TRL uses 20)")
    }
}

/// What a trainer logs about VESPO's weights, over the sequences with at least one token.
///
/// ```text
/// phi_mean/min/max     statistics of φ_i (TRL's vespo/phi_seq_mean is the mean)
/// log_weight_mean      mean of the clamped ln w_i (0 on-policy)
/// ```
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{vespo_loss_output, Normalizer, VespoConfig};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let out = vespo_loss_output(&lp, &lp, &Tensor::from_slice(&[1.0f64]), &lp.ones_like(), &VespoConfig::vespo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.phi_mean, d.log_weight_mean), (1, 1.0, 0.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct VespoDiagnostics {
    /// Number of sequences with at least one token.
    pub samples: i64,
    /// Mean weight `φ`.
    pub phi_mean: f64,
    /// Smallest weight.
    pub phi_min: f64,
    /// Largest weight.
    pub phi_max: f64,
    /// Mean clamped sequence log-ratio `ln w`.
    pub log_weight_mean: f64,
}

diagnostics_struct!(VespoDiagnostics { samples, phi_mean, phi_min, phi_max, log_weight_mean });

/// The checked inputs, the per-token loss, the weights `φ [B]` and `ln w [B]`.
fn vespo_terms(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &VespoConfig,
) -> Result<(TokenInputs, Tensor, Tensor, Tensor), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: false,
        checks: cfg.checks,
    })?;
    let m = cfg.max_log_ratio;
    let total = x.delta.f_clamp(-m, m)?.f_sum_dim_intlist(1, false, None::<Kind>)?;
    let log_w = total.f_clamp(VESPO_MIN_LOG_WEIGHT.max(-m), m)?.f_detach()?; // [B]
    let positive = x.weights().f_ge(0.0)?;
    let pick = |a: f64, b: f64| -> Result<Tensor, LossError> {
        let a = log_w.f_full_like(a)?;
        Ok(a.f_where_self(&positive, &log_w.f_full_like(b)?)?)
    };
    let (k, lambda) = (pick(cfg.k_pos, cfg.k_neg)?, pick(cfg.lambda_pos, cfg.lambda_neg)?);
    // λ + k ln w − λ w: bounded above by λ + k ln(k/λ) − k for the clamped w.
    let exponent = lambda.f_add(&k.f_mul(&log_w)?)?.f_sub(&lambda.f_mul(&log_w.f_exp()?)?)?;
    let phi = exponent.f_exp()?;
    // A kernel whose peak overflows the dtype weighs 0, as TRL's nan_to_num does.
    let phi = phi.f_where_self(&phi.f_isfinite()?, &phi.f_zeros_like()?)?;
    let weight = phi.f_mul(x.weights())?.f_unsqueeze(1)?; // [B, 1], detached
    let per_token = x.logp()?.f_mul(&weight)?.f_neg()?;
    Ok((x, per_token, phi, log_w))
}

/// VESPO's policy loss: REINFORCE with a stop-gradient, gamma-shaped weight of each sequence's
/// importance ratio (TRL's `loss_type="vespo"`).
///
/// ```text
/// w_i  = exp(clamp(Σ_t m clamp(log π_t − log μ_t, ±M), ln 1e-8, M))
/// φ_i  = exp(λ + k ln w_i − λ w_i)        (k, λ) by the sign of A_i
/// ℓ_t  = −sg(φ_i) A_i log π_t
/// loss = aggregate(ℓ, mask)                (TokenMean by default)
/// ```
///
/// The value holds `log π` (a surrogate); the gradient `−φ_i A_i` per token is exact. Pass the
/// sampler's log-probs as `logp_mu` to fold the sampler–trainer mismatch into `w`, as TRL does
/// with its vLLM importance weights (TRL adds their log to `S_i`).
///
/// Reference: arXiv 2602.10693; TRL `GRPOTrainer.get_gamma_weights` and `_compute_loss` for
/// `loss_type="vespo"` (restated in the tests, values and gradients). TRL floors `λ` at 1e-4
/// where [`VespoConfig::validate`] refuses `λ ≤ 0`.
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy (differentiable) and of the
///   policy that sampled the data (detached).
/// * `advantages` — `[B]`, one per sequence.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`];
/// [`LossError::NonFiniteLoss`] if the loss overflows the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{vespo_loss, VespoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let adv = Tensor::from_slice(&[1.0f64]);
/// // μ lower by ln 2 over the sequence: w = 2, φ = e^3 · 2² · e^−6 = 4 e^−3.
/// let logp_mu = Tensor::from_slice2(&[[-1.0f64, -1.0 - 2f64.ln()]]);
/// let loss = vespo_loss(&logp, &logp_mu, &adv, &mask, &VespoConfig::vespo())?;
/// loss.backward();
/// let phi = 4.0 * (-3.0f64).exp();
/// assert!((logp.grad().double_value(&[0, 1]) + phi / 2.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn vespo_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &VespoConfig,
) -> Result<Tensor, LossError> {
    let (x, per_token, _, _) = vespo_terms(logp, logp_mu, advantages, mask, cfg)?;
    x.sanitized_loss(&per_token, cfg.aggregation, &Normalizer::local())
}

/// [`vespo_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding) and
/// its [`VespoDiagnostics`] from the same pass.
///
/// Reference: as [`vespo_loss`].
///
/// # Errors
/// As [`vespo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{vespo_loss_output, Normalizer, VespoConfig};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0, 0.0]]);
/// let mu = Tensor::from_slice2(&[[-1.0f64, -3.0, 0.0]]); // w = e
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = vespo_loss_output(&lp, &mu, &Tensor::from_slice(&[-1.0f64]), &mask, &VespoConfig::vespo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// // A < 0: k = 3, λ = 2, φ = e^{2 + 3 − 2e}.
/// assert!((d.phi_mean - (5.0 - 2.0 * 1f64.exp()).exp()).abs() < 1e-12);
/// assert_eq!(out.terms.double_value(&[0, 2]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn vespo_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &VespoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<VespoDiagnostics>, LossError> {
    let (x, per_token, phi, log_w) = vespo_terms(logp, logp_mu, advantages, mask, cfg)?;
    let loss = x.sanitized_loss(&per_token, cfg.aggregation, norm)?;
    let valid = x.has_tokens.f_gt(0.0)?;
    let (phi_min, phi_max) = stats::min_max_where(&phi, &valid)?;
    let diagnostics = OnDevice::new(&[
        stats::count(&valid)?,
        stats::mean_where(&phi, &valid)?,
        phi_min,
        phi_max,
        stats::mean_where(&log_w, &valid)?,
    ])?;
    Ok(LossOutput { loss, terms: x.zero_padding(&per_token)?, diagnostics })
}
