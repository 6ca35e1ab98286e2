//! SAPO, *Soft Adaptive Policy Optimization*: PPO's hard clip replaced by a smooth gate on the
//! token ratio, with a sharper gate for tokens of non-positive advantage.
//!
//! With `δ = log π − log μ` clamped to `±M` and `r = exp(δ)`:
//!
//! ```text
//! f_τ(r) = σ(τ (r − 1)) · 4/τ          τ = τ_pos where A > 0, τ_neg where A ≤ 0
//! ℓ_t    = −f_τ(r_t) A_t
//! ∂ℓ_t/∂log π_t = −4 σ(τ(r−1)) (1 − σ(τ(r−1))) · r · A      (= −A on-policy, like REINFORCE)
//! ```
//!
//! On-policy the gate's slope is 1, so the gradient is the policy gradient; off-policy it decays
//! smoothly (like `sech²`) instead of dropping to zero at `1 ± ε` as PPO's clip does. The value is
//! `−(2/τ) A` on-policy, not `−A`: the gate is a surrogate whose gradient, not value, matters.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::LossOutput;
use crate::ppo::{PpoDiagnostics, ppo_diagnostics};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::Tensor;

/// Temperatures, ratio clamp and aggregation of [`sapo_loss`].
///
/// `Default` ([`SapoConfig::sapo`]) is the paper's and the peers' setting: `τ_pos = 1.0`,
/// `τ_neg = 1.05`, `δ` clamped to ±20, `SeqMeanTokenMean` (each sequence's token mean, averaged
/// over sequences).
///
/// Reference: Gao et al. (Qwen), *Soft Adaptive Policy Optimization*, arXiv 2511.20347; verl
/// `policy_loss.loss_mode=sapo` with `actor.tau_pos` / `actor.tau_neg`; TRL `loss_type="sapo"` with
/// `sapo_temperature_pos` / `sapo_temperature_neg`.
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, SapoConfig};
/// let cfg = SapoConfig::default();
/// assert_eq!((cfg.tau_pos, cfg.tau_neg), (1.0, 1.05));
/// assert_eq!(cfg.aggregation, AggregationMode::SeqMeanTokenMean);
/// assert!(cfg.with_temperatures(0.0, 1.0).validate().is_err()); // τ must be > 0
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct SapoConfig {
    /// `τ_pos > 0`: the gate's temperature for tokens with `A > 0`.
    pub tau_pos: f64,
    /// `τ_neg > 0`: for tokens with `A ≤ 0` (the paper takes it above `τ_pos`: negative updates
    /// fade faster off-policy).
    pub tau_neg: f64,
    /// `δ` is clamped to `±max_log_ratio` before `exp` (> 0; verl uses 20, TRL does not clamp).
    pub max_log_ratio: f64,
    /// How per-token losses are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for SapoConfig {
    fn default() -> Self {
        Self::sapo()
    }
}

impl SapoConfig {
    /// The paper's setting: `τ_pos = 1.0`, `τ_neg = 1.05`, `SeqMeanTokenMean` (verl's and TRL's
    /// defaults too). arXiv 2511.20347.
    ///
    /// ```
    /// assert_eq!(topr_loss::SapoConfig::sapo(), topr_loss::SapoConfig::default());
    /// ```
    pub const fn sapo() -> Self {
        Self {
            tau_pos: 1.0,
            tau_neg: 1.05,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::SeqMeanTokenMean,
            checks: Checks::Full,
        }
    }

    /// The same config with the temperatures `(τ_pos, τ_neg)`.
    ///
    /// ```
    /// let c = topr_loss::SapoConfig::sapo().with_temperatures(2.0, 4.0);
    /// assert_eq!((c.tau_pos, c.tau_neg), (2.0, 4.0));
    /// ```
    pub const fn with_temperatures(self, tau_pos: f64, tau_neg: f64) -> Self {
        Self { tau_pos, tau_neg, ..self }
    }

    crate::setters::setters!(SapoConfig, sapo(); checks, aggregation, max_log_ratio);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: a temperature that is not finite and `> 0`,
    /// a non-positive or NaN `max_log_ratio`.
    ///
    /// ```
    /// assert!(topr_loss::SapoConfig::sapo().with_temperatures(1.0, f64::NAN).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        for (v, field) in [(self.tau_pos, "tau_pos"), (self.tau_neg, "tau_neg")] {
            if !(v.is_finite() && v > 0.0) {
                return Err(LossError::InvalidConfig {
                    field,
                    value: v,
                    reason: "a gate temperature must be finite and > 0 (the paper uses 1.0 and 1.05)".into(),
                });
            }
        }
        validate::positive(
            self.max_log_ratio,
            "max_log_ratio",
            "the log-ratio clamp must be > 0 (published code uses 20)",
        )
    }
}

/// The checked inputs, the clamped ratio `r [B, T]` and the per-token loss `−f_τ(r) A`.
fn sapo_terms(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &SapoConfig,
) -> Result<(TokenInputs, Tensor, Tensor), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: true,
        checks: cfg.checks,
    })?;
    let r = x.delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?.f_exp()?;
    let adv = x.weights_per_token()?; // [B, 1] or [B, T]
    let tau = adv.f_full_like(cfg.tau_pos)?.f_where_self(&adv.f_gt(0.0)?, &adv.f_full_like(cfg.tau_neg)?)?;
    // σ(τ (r − 1)) · (4/τ): r ≤ e^M, so the argument is finite and σ saturates without overflow.
    let gate = r.f_sub_scalar(1.0)?.f_mul(&tau)?.f_sigmoid()?.f_mul(&tau.f_reciprocal()?.f_mul_scalar(4.0)?)?;
    let per_token = gate.f_mul(&adv)?.f_neg()?;
    Ok((x, r, per_token))
}

/// SAPO: the policy-gradient surrogate through a smooth, asymmetric gate on the token ratio.
///
/// ```text
/// r_t  = exp(clamp(log π_t − sg(log μ_t), ±M))
/// τ_t  = τ_pos if A_t > 0 else τ_neg
/// ℓ_t  = −σ(τ_t (r_t − 1)) · (4/τ_t) · A_t
/// loss = aggregate(ℓ, mask)                    (SeqMeanTokenMean by default)
/// ```
///
/// The gate is applied per token and the loss is each sequence's token mean averaged over
/// sequences, as in the paper's objective (its eq. for `J_SAPO`), verl and TRL; the paper's
/// sequence-level reading (the mean gate tracks a sequence gate when token ratios are close) is
/// an analysis, not a different loss.
///
/// Reference: Gao et al., *Soft Adaptive Policy Optimization*, arXiv 2511.20347; verl
/// `compute_policy_loss_sapo` (`loss_mode=sapo`, which always aggregates with
/// `seq-mean-token-mean`, whatever `loss_agg_mode` says); TRL `loss_type="sapo"`.
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy (differentiable) and of the
///   policy that sampled the data (detached).
/// * `advantages` — `[B]` (broadcast over tokens) or `[B, T]`.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`];
/// [`LossError::NonFiniteLoss`] if advantages are too large for the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{sapo_loss, SapoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let adv = Tensor::from_slice(&[0.5f64]);
/// // On-policy the gate is 2/τ and its slope 1: loss = −(2/τ_pos) A, gradient −A / L per token.
/// let loss = sapo_loss(&logp, &logp.detach(), &adv, &mask, &SapoConfig::sapo())?;
/// assert!((loss.double_value(&[]) + 1.0).abs() < 1e-12);
/// loss.backward();
/// assert_eq!(Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?, vec![-0.25, -0.25]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn sapo_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &SapoConfig,
) -> Result<Tensor, LossError> {
    let (x, _, per_token) = sapo_terms(logp, logp_mu, advantages, mask, cfg)?;
    validate::finite_loss(x.reduce_tokens(&per_token, cfg.aggregation, &Normalizer::local())?, cfg.checks)
}

/// [`sapo_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding) and
/// its [`PpoDiagnostics`] over unmasked tokens (SAPO has no hard clip: both clip fractions are 0).
///
/// Reference: as [`sapo_loss`].
///
/// # Errors
/// As [`sapo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{sapo_loss_output, Normalizer, SapoConfig};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0, 0.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.5f64, -1.0, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = sapo_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &SapoConfig::sapo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.clip_fraction), (2, 0.0));
/// assert!((d.ratio_max - 0.5f64.exp()).abs() < 1e-12);
/// assert_eq!(out.terms.double_value(&[0, 2]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn sapo_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &SapoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let (x, r, per_token) = sapo_terms(logp, logp_mu, advantages, mask, cfg)?;
    let loss = validate::finite_loss(x.reduce_tokens(&per_token, cfg.aggregation, norm)?, cfg.checks)?;
    let none = x.mask.f_zeros_like()?;
    let diagnostics = ppo_diagnostics(&r, &none, &none, &x.mask)?;
    Ok(LossOutput { loss, terms: x.zero_padding(&per_token)?, diagnostics })
}
