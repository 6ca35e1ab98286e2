//! DRO-style policy loss: REINFORCE on every token with a quadratic penalty on the log-ratio to
//! the sampling policy, a soft trust region in place of a clip.
//!
//! ```text
//! δ_t = log π_t − sg(log μ_t)
//! ℓ_t = −(A_t · log π_t − (β/2) · δ_t²)
//! ∂ℓ_t/∂log π_t = −A_t + β · δ_t
//! ```
//!
//! On-policy (`δ = 0`) the gradient is REINFORCE's; off-policy each token is pulled back towards
//! μ with a force proportional to how far it moved, whatever the sign of its advantage. The
//! penalty is `β/2 · δ²`, half of the squared log-ratio, i.e. `β` times the k2 estimate of the
//! KL divergence.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::LossOutput;
use crate::ppo::{PpoDiagnostics, ppo_diagnostics};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use tch::Tensor;

/// The penalty and aggregation of [`dro_loss`].
///
/// `Default` is [`DroConfig::new`]`(0.1)` with `TokenMean`.
///
/// Reference: verl `policy_loss.loss_mode=dro` with `policy_loss.dro_beta` (its values and
/// gradients, tested); Richemond et al., *Offline Regularised Reinforcement Learning for Large
/// Language Models Alignment* (Direct Reward Optimisation), for the quadratic regulariser of the
/// log-ratio.
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, DroConfig};
/// let cfg = DroConfig::new(0.5);
/// assert_eq!((cfg.beta, cfg.aggregation), (0.5, AggregationMode::TokenMean));
/// assert!(DroConfig::new(0.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct DroConfig {
    /// `β > 0`, the penalty's coefficient (verl requires it positive).
    pub beta: f64,
    /// How per-token losses are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for DroConfig {
    fn default() -> Self {
        Self::new(0.1)
    }
}

impl DroConfig {
    /// The penalty `β`, `TokenMean` (verl's default aggregation).
    ///
    /// ```
    /// assert_eq!(topr_loss::DroConfig::new(0.1), topr_loss::DroConfig::default());
    /// ```
    pub const fn new(beta: f64) -> Self {
        Self { beta, aggregation: AggregationMode::TokenMean, checks: Checks::Full }
    }

    crate::setters::setters!(DroConfig, new(0.1); checks, aggregation);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming `beta` when it is not finite and `> 0`.
    ///
    /// ```
    /// assert!(topr_loss::DroConfig::new(f64::INFINITY).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return Err(LossError::InvalidConfig {
                field: "beta",
                value: self.beta,
                reason: "the penalty's coefficient must be finite and > 0".into(),
            });
        }
        Ok(())
    }
}

/// The checked inputs and the per-token loss.
fn dro_terms(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DroConfig,
) -> Result<(TokenInputs, Tensor), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: true,
        checks: cfg.checks,
    })?;
    let adv = x.weights_per_token()?; // [B, 1] or [B, T]
    let penalty = x.delta.f_square()?.f_mul_scalar(0.5 * cfg.beta)?;
    // Zero on padding (δ and `logp` are): the sanitised reduction applies.
    let per_token = penalty.f_sub(&x.logp()?.f_mul(&adv)?)?;
    Ok((x, per_token))
}

/// REINFORCE with a quadratic log-ratio penalty (verl's `dro` policy loss).
///
/// ```text
/// ℓ_t  = −(A_t · log π_t − (β/2) (log π_t − sg(log μ_t))²)
/// loss = aggregate(ℓ, mask)                     (TokenMean by default)
/// ```
///
/// The value holds `log π` (a surrogate, not an objective value); the gradient `−A + β δ` per
/// token is exact (nothing is stopped but μ). `δ²` of log-probs a few hundred nats apart is finite
/// in f32, and the loss is refused ([`LossError::NonFiniteLoss`]) only if it overflows.
///
/// Reference: verl `compute_policy_loss_dro` (tested); see [`DroConfig`].
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy (differentiable) and of the
///   policy that sampled the data (detached).
/// * `advantages` — `[B]` (broadcast over tokens) or `[B, T]`.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`];
/// [`LossError::NonFiniteLoss`] if the loss overflows the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dro_loss, DroConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-1.0f64, -1.0]]); // the second token moved by δ = −1
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let loss = dro_loss(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &DroConfig::new(0.5))?;
/// loss.backward();
/// // (−A + β δ) / 2 tokens: −0.5 for the token on μ, (−1 − 0.5) / 2 for the one that moved.
/// assert_eq!(Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?, vec![-0.5, -0.75]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dro_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DroConfig,
) -> Result<Tensor, LossError> {
    let (x, per_token) = dro_terms(logp, logp_mu, advantages, mask, cfg)?;
    x.sanitized_loss(&per_token, cfg.aggregation, &Normalizer::local())
}

/// [`dro_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding) and
/// its [`PpoDiagnostics`] over unmasked tokens (no clip: both clip fractions are 0; the ratio
/// statistics use `δ` clamped to ±20).
///
/// Reference: as [`dro_loss`].
///
/// # Errors
/// As [`dro_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dro_loss_output, DroConfig, Normalizer};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0, 0.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.0f64, -1.0, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = dro_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &DroConfig::new(0.5), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.clip_fraction), (2, 0.0));
/// assert!((d.log_ratio_mean + 0.5).abs() < 1e-12);
/// assert_eq!(out.terms.double_value(&[0, 2]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn dro_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DroConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let (x, per_token) = dro_terms(logp, logp_mu, advantages, mask, cfg)?;
    let loss = x.sanitized_loss(&per_token, cfg.aggregation, norm)?;
    let r = x.delta.f_detach()?.f_clamp(-20.0, 20.0)?.f_exp()?;
    let none = x.mask.f_zeros_like()?;
    let diagnostics = ppo_diagnostics(&r, &none, &none, &x.mask)?;
    Ok(LossOutput { loss, terms: x.zero_padding(&per_token)?, diagnostics })
}
