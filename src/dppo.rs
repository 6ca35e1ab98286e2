//! DPPO, *Divergence Proximal Policy Optimization*: PPO's ratio clip replaced by a trust region
//! on the token's probability itself, a binary total-variation or KL divergence between the
//! sampler's and the policy's probability of the sampled token.
//!
//! With `p_t = π(y_t)`, `q_t = μ(y_t)` (probabilities, `exp` of the log-probs) and
//! `r_t = exp(clamp(log π_t − log μ_t, ±M))`:
//!
//! ```text
//! TV:  keep_t = p_t − q_t ≤ δ_high          where A_t > 0
//!               p_t − q_t ≥ −δ_low          where A_t ≤ 0
//! KL:  D_t    = q log(q/p) + (1 − q) log((1 − q + ε)/(1 − p + ε))      (ε = 1e-8)
//!      keep_t = D_t ≤ δ_high ∨ p_t ≤ q_t    where A_t > 0
//!               D_t ≤ δ_low  ∨ p_t ≥ q_t    where A_t ≤ 0
//! ℓ_t = −A_t · sg(min(r_t, C)) · log π_t · sg(keep_t)
//! ```
//!
//! A token leaves the update only when the policy has already moved it beyond the trust region
//! *in the direction its advantage pushes*; otherwise it gets REINFORCE's gradient with a
//! truncated importance weight (`C`, verl's `clip_ratio_c`, 20 by default: large, the paper's
//! §5.4 advises against a tight truncation). Unlike a ratio clip, a rare token (small `q`) may
//! change its ratio a lot before its probability moves by `δ`, and a likely token little.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::LossOutput;
use crate::ppo::{PpoDiagnostics, ppo_diagnostics};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::Tensor;

/// The divergence of [`DppoConfig`]'s trust region.
///
/// # Example
/// ```
/// assert_ne!(topr_loss::DppoDivergence::TotalVariation, topr_loss::DppoDivergence::BinaryKl);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum DppoDivergence {
    /// `p − q`, the binary total variation's signed form (verl `dppo_tv`).
    TotalVariation,
    /// `KL(Bern(q) ‖ Bern(p))` (verl `dppo_kl`).
    BinaryKl,
}

/// The trust region, truncation and aggregation of [`dppo_loss`].
///
/// `Default` is [`DppoConfig::tv`].
///
/// Reference: Qi et al. (Sea AI Lab), *Rethinking the Trust Region in LLM Reinforcement
/// Learning*, arXiv 2602.04879; verl `policy_loss.loss_mode=dppo_tv|dppo_kl`, whose
/// `clip_ratio_low/high` are the `δ`s and `clip_ratio_c` is `C` (verl's DPPO example uses 0.15 for
/// TV and 0.05 for KL).
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, DppoConfig, DppoDivergence};
/// let cfg = DppoConfig::default();
/// assert_eq!((cfg.divergence, cfg.delta_low, cfg.delta_high), (DppoDivergence::TotalVariation, 0.15, 0.15));
/// assert_eq!((cfg.max_weight, cfg.aggregation), (20.0, AggregationMode::TokenMean));
/// assert!(cfg.with_deltas(0.0, 0.1).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct DppoConfig {
    /// The trust region's divergence.
    pub divergence: DppoDivergence,
    /// `δ_low > 0`: how far a token of non-positive advantage may move (TV: its probability
    /// down; KL: the divergence, where its probability went down).
    pub delta_low: f64,
    /// `δ_high > 0`: the same for a token of positive advantage (up).
    pub delta_high: f64,
    /// `C > 0` (`∞` allowed): the truncation of the stop-gradient importance weight.
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub max_weight: f64,
    /// `δ` is clamped to `±max_log_ratio` before `exp` (> 0; verl: 20).
    pub max_log_ratio: f64,
    /// How per-token losses are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for DppoConfig {
    fn default() -> Self {
        Self::tv()
    }
}

impl DppoConfig {
    /// DPPO-Binary-TV with `δ_low = δ_high = 0.15`, `C = 20`, `TokenMean` (verl's DPPO example).
    ///
    /// ```
    /// assert_eq!(topr_loss::DppoConfig::tv(), topr_loss::DppoConfig::default());
    /// ```
    pub const fn tv() -> Self {
        Self {
            divergence: DppoDivergence::TotalVariation,
            delta_low: 0.15,
            delta_high: 0.15,
            max_weight: 20.0,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// DPPO-Binary-KL with `δ_low = δ_high = 0.05`, `C = 20`, `TokenMean` (verl's DPPO example).
    ///
    /// ```
    /// let c = topr_loss::DppoConfig::binary_kl();
    /// assert_eq!((c.divergence, c.delta_high), (topr_loss::DppoDivergence::BinaryKl, 0.05));
    /// ```
    pub const fn binary_kl() -> Self {
        Self { divergence: DppoDivergence::BinaryKl, delta_low: 0.05, delta_high: 0.05, ..Self::tv() }
    }

    /// The same config with the trust region's `(δ_low, δ_high)`.
    ///
    /// ```
    /// let c = topr_loss::DppoConfig::tv().with_deltas(0.1, 0.2);
    /// assert_eq!((c.delta_low, c.delta_high), (0.1, 0.2));
    /// ```
    pub const fn with_deltas(self, delta_low: f64, delta_high: f64) -> Self {
        Self { delta_low, delta_high, ..self }
    }

    /// The same config with another truncation `C` of the importance weight.
    ///
    /// ```
    /// assert!(topr_loss::DppoConfig::tv().with_max_weight(f64::INFINITY).validate().is_ok());
    /// ```
    pub const fn with_max_weight(self, max_weight: f64) -> Self {
        Self { max_weight, ..self }
    }

    crate::setters::setters!(DppoConfig, tv(); checks, aggregation, max_log_ratio);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: a `δ` that is not finite and `> 0`, a `C`
    /// that is not `> 0` (NaN included), a non-positive or NaN `max_log_ratio`.
    ///
    /// ```
    /// assert!(topr_loss::DppoConfig::binary_kl().with_max_weight(0.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        for (v, field) in [(self.delta_low, "delta_low"), (self.delta_high, "delta_high")] {
            if !(v.is_finite() && v > 0.0) {
                return Err(LossError::InvalidConfig {
                    field,
                    value: v,
                    reason: "a trust-region bound must be finite and > 0 (verl's example: 0.15 for TV, 0.05 for KL)"
                        .into(),
                });
            }
        }
        validate::positive(self.max_weight, "max_weight", "the weight's truncation must be > 0 (verl uses 20)")?;
        validate::positive(
            self.max_log_ratio,
            "max_log_ratio",
            "the log-ratio clamp must be > 0 (published code uses 20)",
        )
    }
}

/// The checked inputs, the clamped ratio `r`, the trust-region mask `keep` (`[B, T]`) and the
/// per-token loss.
fn dppo_terms(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DppoConfig,
) -> Result<(TokenInputs, Tensor, Tensor, Tensor), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: true,
        checks: cfg.checks,
    })?;
    let lp = x.logp()?; // padding zeroed, differentiable
    let (lp_d, delta) = (lp.f_detach()?, x.delta.f_detach()?); // the weight and the region: no gradient
    // log μ = log π − δ, padding zeroed (δ is zero there).
    let lq = lp_d.f_sub(&delta)?;
    let r = delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?.f_exp()?;
    let (p, q) = (lp_d.f_exp()?, lq.f_exp()?);
    let adv = x.weights_per_token()?; // [B, 1] or [B, T]
    let positive = adv.f_gt(0.0)?;
    let (up, down) = match cfg.divergence {
        DppoDivergence::TotalVariation => {
            let moved = p.f_sub(&q)?;
            (moved.f_le(cfg.delta_high)?, moved.f_ge(-cfg.delta_low)?)
        }
        DppoDivergence::BinaryKl => {
            const EPS: f64 = 1e-8;
            let one_minus = |t: &Tensor| -> Result<Tensor, LossError> { Ok(t.f_neg()?.f_add_scalar(1.0 + EPS)?) };
            let d = q.f_mul(&lq.f_sub(&lp_d)?)?.f_add(
                &q.f_neg()?.f_add_scalar(1.0)?.f_mul(&one_minus(&q)?.f_log()?.f_sub(&one_minus(&p)?.f_log()?)?)?,
            )?;
            (
                d.f_le(cfg.delta_high)?.f_logical_or(&p.f_le_tensor(&q)?)?,
                d.f_le(cfg.delta_low)?.f_logical_or(&p.f_ge_tensor(&q)?)?,
            )
        }
    };
    let keep = up.f_where_self(&positive, &down)?;
    let weight = r.f_clamp_max(cfg.max_weight)?;
    let coef = weight.f_mul(&keep.f_to_kind(weight.kind())?)?.f_mul(&adv)?; // detached
    // Zero on padding (`lp` is, and `coef` is finite there: r = 1): the sanitised reduction applies.
    let per_token = coef.f_mul(&lp)?.f_neg()?;
    Ok((x, r, keep, per_token))
}

/// DPPO: REINFORCE with a truncated stop-gradient importance weight, inside a trust region on
/// the sampled token's probability `p_t = π(y_t)` against the sampler's `q_t = μ(y_t)`.
///
/// ```text
/// TV:  keep_t = p_t − q_t ≤ δ_high (A_t > 0),   p_t − q_t ≥ −δ_low (A_t ≤ 0)
/// KL:  D_t = q log(q/p) + (1 − q) log((1 − q + ε)/(1 − p + ε)),  ε = 1e-8
///      keep_t = D_t ≤ δ_high ∨ p_t ≤ q_t (A_t > 0),   D_t ≤ δ_low ∨ p_t ≥ q_t (A_t ≤ 0)
/// r_t  = exp(clamp(log π_t − log μ_t, ±M))
/// ℓ_t  = −A_t · sg(min(r_t, C)) · log π_t · sg(keep_t)
/// loss = aggregate(ℓ, mask)                     (TokenMean by default)
/// ∂ℓ_t/∂log π_t = −A_t · min(r_t, C) · keep_t
/// ```
///
/// The value is the published surrogate (it contains `log π`, so it is not an objective value);
/// the gradient is DPPO's. Padding gets exactly zero gradient whatever it holds.
///
/// Reference: Qi et al., *Rethinking the Trust Region in LLM Reinforcement Learning*, arXiv
/// 2602.04879; verl `compute_policy_loss_dppo_tv` and `compute_policy_loss_dppo_kl` (their values
/// and gradients, tested).
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy (differentiable) and of the
///   policy that sampled the data (detached); both at most 0 (they are turned into probabilities).
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
/// use topr_loss::{dppo_loss, DppoConfig};
///
/// // A likely token (q = 0.5) pushed up to p = 0.7 has left the TV region (0.2 > 0.15); a rare
/// // one (q = 0.01) at p = 0.05 has not, although its ratio is 5.
/// let logp = Tensor::from_slice2(&[[0.7f64.ln(), 0.05f64.ln()]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[0.5f64.ln(), 0.01f64.ln()]]);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let loss = dppo_loss(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &DppoConfig::tv())?;
/// loss.backward();
/// let g = Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?;
/// assert_eq!(g[0], 0.0);
/// assert!((g[1] + 5.0 / 2.0).abs() < 1e-12); // −A · r / (2 tokens)
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dppo_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DppoConfig,
) -> Result<Tensor, LossError> {
    let (x, _, _, per_token) = dppo_terms(logp, logp_mu, advantages, mask, cfg)?;
    x.sanitized_loss(&per_token, cfg.aggregation, &Normalizer::local())
}

/// [`dppo_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding) and
/// its [`PpoDiagnostics`] over unmasked tokens: `clip_fraction` is the share of tokens outside the
/// trust region (verl's `pg_clipfrac`), `dual_clip_fraction` the share inside it whose weight was
/// truncated at `C` (verl's `pg_clipfrac_lower`).
///
/// Reference: as [`dppo_loss`].
///
/// # Errors
/// As [`dppo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dppo_loss_output, DppoConfig, Normalizer};
/// let logp = Tensor::from_slice2(&[[0.7f64.ln(), 0.05f64.ln(), 0.0]]);
/// let logp_mu = Tensor::from_slice2(&[[0.5f64.ln(), 0.01f64.ln(), 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = dppo_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &DppoConfig::tv(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.clip_fraction, d.dual_clip_fraction), (2, 0.5, 0.0));
/// assert_eq!(out.terms.double_value(&[0, 0]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn dppo_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DppoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let (x, r, keep, per_token) = dppo_terms(logp, logp_mu, advantages, mask, cfg)?;
    let loss = x.sanitized_loss(&per_token, cfg.aggregation, norm)?;
    let outside = keep.f_logical_not()?;
    let truncated = r.f_gt(cfg.max_weight)?.f_logical_and(&keep)?;
    let diagnostics = ppo_diagnostics(&r, &outside, &truncated, &x.mask)?;
    Ok(LossOutput { loss, terms: x.zero_padding(&per_token)?, diagnostics })
}
