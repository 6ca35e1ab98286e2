//! GMPO, *Geometric-Mean Policy Optimization*: GRPO's arithmetic mean of token ratios replaced by
//! their geometric mean, each token's log-ratio clipped on the side the advantage's sign selects.
//!
//! With `δ_t = log π_t − log μ_t` (clamped to `±M`) and one advantage `A_i` per sequence:
//!
//! ```text
//! δ'_t = min(δ_t, ε_high)    where A_i > 0      (a token cannot push the ratio up past e^ε_high)
//! δ'_t = max(δ_t, −ε_low)    where A_i < 0      (nor down past e^−ε_low)
//! δ'_t = 0                   where A_i = 0
//! s_i  = exp((1/L_i) Σ_t δ'_t)                  the geometric mean of the clipped token ratios
//! ℓ_i  = −A_i s_i
//! ```
//!
//! This is `−sgn(A) (Π_t min(r_t |A|, clip(r_t, e^−ε_low, e^ε_high) |A|))^(1/L)`, the paper's
//! objective, written in log space. A clipped token gets no gradient; an unclipped one gets
//! `−A_i s_i / L_i` per unit of `∇log π_t` (each token of a sequence weighs the same), so a single
//! outlier token moves the sequence ratio far less than it moves an arithmetic mean.

use crate::aggregate::{AggregationMode, Normalizer, masked_fill_zero};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::LossOutput;
use crate::ppo::{PpoDiagnostics, ppo_diagnostics};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::{Kind, Tensor};

/// Clip ranges (in log space), ratio clamp and aggregation of [`gmpo_loss`].
///
/// `Default` ([`GmpoConfig::gmpo`]) is the paper's: `ε_low = ε_high = 0.4` on the token
/// log-ratio (the ratio is kept within `(e^−0.4, e^0.4)`), `δ` clamped to ±20, each sequence's loss
/// counted once (`SeqMeanTokenMean` over per-token terms that all carry `ℓ_i`).
///
/// Reference: Zhao et al., *Geometric-Mean Policy Optimization*, arXiv 2507.20673; verl
/// `policy_loss.loss_mode=geo_mean`, which reads its ranges from `actor.clip_ratio_low` /
/// `actor.clip_ratio_high` (default 0.2 each, set them to 0.4 for the paper).
///
/// # Example
/// ```
/// use topr_loss::GmpoConfig;
/// let cfg = GmpoConfig::default();
/// assert_eq!((cfg.clip_low, cfg.clip_high), (0.4, 0.4));
/// assert!(cfg.with_clip(-0.1, 0.4).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct GmpoConfig {
    /// `ε_low ≥ 0`: for `A < 0` a token's log-ratio is clipped below at `−ε_low` (`∞`: no clip).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub clip_low: f64,
    /// `ε_high ≥ 0`: for `A > 0` a token's log-ratio is clipped above at `ε_high` (`∞`: no clip).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub clip_high: f64,
    /// `δ` is clamped to `±max_log_ratio` before anything else (> 0; 20 as in the PPO family), so
    /// the unclipped side of the sequence ratio stays below `e^M`. verl does not clamp here.
    pub max_log_ratio: f64,
    /// How the per-token terms (each token of sequence `i` carries `ℓ_i`) are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for GmpoConfig {
    fn default() -> Self {
        Self::gmpo()
    }
}

impl GmpoConfig {
    /// The paper's setting: `ε_low = ε_high = 0.4` in log space, `SeqMeanTokenMean`
    /// (`(1/S) Σ_i ℓ_i`). arXiv 2507.20673.
    ///
    /// ```
    /// assert_eq!(topr_loss::GmpoConfig::gmpo(), topr_loss::GmpoConfig::default());
    /// ```
    pub const fn gmpo() -> Self {
        Self {
            clip_low: 0.4,
            clip_high: 0.4,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::SeqMeanTokenMean,
            checks: Checks::Full,
        }
    }

    /// The same config with the log-space clip ranges `(ε_low, ε_high)`.
    ///
    /// ```
    /// let c = topr_loss::GmpoConfig::gmpo().with_clip(0.2, 0.28);
    /// assert_eq!((c.clip_low, c.clip_high), (0.2, 0.28));
    /// ```
    pub const fn with_clip(self, clip_low: f64, clip_high: f64) -> Self {
        Self { clip_low, clip_high, ..self }
    }

    crate::setters::setters!(GmpoConfig, gmpo(); checks, aggregation, max_log_ratio);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: a negative or NaN clip range, a non-positive
    /// or NaN `max_log_ratio`.
    ///
    /// ```
    /// assert!(topr_loss::GmpoConfig::gmpo().with_max_log_ratio(0.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        for (v, field) in [(self.clip_low, "clip_low"), (self.clip_high, "clip_high")] {
            if v.is_nan() || v < 0.0 {
                return Err(LossError::InvalidConfig {
                    field,
                    value: v,
                    reason: "a log-space clip range must be >= 0 (the paper uses 0.4)".into(),
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

/// What one GMPO pass computes.
struct GmpoParts {
    x: TokenInputs,
    /// `[B]`, `ℓ_i = −A_i s_i`.
    per_seq: Tensor,
    /// `[B, T]`, the clamped token ratio `exp(δ_t)` (for the diagnostics).
    r: Tensor,
    /// `[B, T]`, where the sign-selected clip replaced `δ_t`.
    clipped: Tensor,
}

fn gmpo_parts(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &GmpoConfig,
) -> Result<GmpoParts, LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: false,
        checks: cfg.checks,
    })?;
    let delta = x.delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?; // [B, T], 0 on padding
    let adv = x.weights().f_unsqueeze(1)?; // [B, 1]
    let (pos, neg) = (adv.f_gt(0.0)?, adv.f_lt(0.0)?);
    let upper = if cfg.clip_high.is_finite() { delta.f_clamp_max(cfg.clip_high)? } else { delta.shallow_clone() };
    let lower = if cfg.clip_low.is_finite() { delta.f_clamp_min(-cfg.clip_low)? } else { delta.shallow_clone() };
    let zero = delta.f_zeros_like()?;
    let clipped_delta = upper.f_where_self(&pos, &lower.f_where_self(&neg, &zero)?)?;
    let clipped = upper
        .f_ne_tensor(&delta)?
        .f_logical_and(&pos)?
        .f_logical_or(&lower.f_ne_tensor(&delta)?.f_logical_and(&neg)?)?;
    let mean = masked_fill_zero(&clipped_delta, &x.mask)?
        .f_sum_dim_intlist(1, false, None::<Kind>)?
        .f_div(&x.lengths.f_clamp_min(1.0)?)?; // [B]
    let per_seq = mean.f_exp()?.f_mul(x.weights())?.f_neg()?;
    Ok(GmpoParts { r: delta.f_exp()?, clipped, per_seq, x })
}

/// GMPO: the geometric mean of the sign-clipped token ratios as the sequence ratio, times the
/// sequence's advantage.
///
/// ```text
/// δ_t  = clamp(log π_t − sg(log μ_t), ±M)
/// δ'_t = sgn(A_i) · min(sgn(A_i) δ_t, sgn(A_i) clamp(δ_t, −ε_low, ε_high))
/// ℓ_i  = −A_i · exp((1/L_i) Σ_t m δ'_t)
/// loss = aggregate over tokens, each token of sequence i carrying ℓ_i   ((1/S) Σ_i ℓ_i by default)
/// ```
///
/// Reference: Zhao et al., *Geometric-Mean Policy Optimization*, arXiv 2507.20673; verl
/// `compute_policy_loss_geo_mean` (`loss_mode=geo_mean`). verl divides by `L_i + 1e-8` (the
/// crate by `L_i`: values differ by about `1e-8` relative), averages `ℓ_i` over all `B` rows
/// (a row with no unmasked token counts in its denominator; here it does not) and ignores
/// `loss_agg_mode`.
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy (differentiable) and of the
///   policy that sampled the data (detached).
/// * `advantages` — `[B]`, one per sequence (the method is defined for sequence advantages).
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`];
/// [`LossError::NonFiniteLoss`] if advantages are too large for the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{gmpo_loss, GmpoConfig};
///
/// // A > 0: the first token's log-ratio 1.0 is clipped at 0.4, the second (−0.2) is kept.
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.2]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-2.0f64, -1.0]]);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let loss = gmpo_loss(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &GmpoConfig::gmpo())?;
/// let s = ((0.4f64 - 0.2) / 2.0).exp();
/// assert!((loss.double_value(&[]) + s).abs() < 1e-12);
/// loss.backward();
/// let g = Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?;
/// assert!(g[0] == 0.0 && (g[1] + s / 2.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn gmpo_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &GmpoConfig,
) -> Result<Tensor, LossError> {
    let p = gmpo_parts(logp, logp_mu, advantages, mask, cfg)?;
    validate::finite_loss(
        p.x.reduce_tokens(&p.per_seq.f_unsqueeze(1)?, cfg.aggregation, &Normalizer::local())?,
        cfg.checks,
    )
}

/// [`gmpo_loss`] with the counts of `norm`, its per-token terms (`[B, T]`: each unmasked token
/// carries its sequence's `ℓ_i`; zero on padding) and its [`PpoDiagnostics`] over unmasked
/// tokens: `clip_fraction` is the share of tokens whose log-ratio the sign-selected clip replaced,
/// the ratio statistics are those of the token ratios `exp(δ_t)`.
///
/// verl's `pg_clipfrac` / `pg_clipfrac_lower` count a token as clipped whenever `δ_t` lies outside
/// `[−ε_low, ε_high]`, split by the advantage's sign, even on the side the min leaves unclipped;
/// `clip_fraction` here counts only the tokens the clip changed.
///
/// Reference: as [`gmpo_loss`].
///
/// # Errors
/// As [`gmpo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{gmpo_loss_output, GmpoConfig, Normalizer};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.2]]);
/// let logp_mu = Tensor::from_slice2(&[[-2.0f64, -1.0]]);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let out = gmpo_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &GmpoConfig::gmpo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.clip_fraction), (2, 0.5));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn gmpo_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &GmpoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let p = gmpo_parts(logp, logp_mu, advantages, mask, cfg)?;
    let per_token = p.per_seq.f_unsqueeze(1)?;
    let loss = validate::finite_loss(p.x.reduce_tokens(&per_token, cfg.aggregation, norm)?, cfg.checks)?;
    let diagnostics = ppo_diagnostics(&p.r, &p.clipped, &p.x.mask.f_zeros_like()?, &p.x.mask)?;
    Ok(LossOutput { loss, terms: p.x.zero_padding(&per_token)?, diagnostics })
}
