//! PPO-clip and its relatives: dual-clip PPO, DAPO's asymmetric clip, GSPO's sequence-level
//! ratio and CISPO's clipped importance-sampling weight.
//!
//! All take per-token log-probs `[B, T]` of the policy and of the behaviour policy μ that sampled
//! the data (PPO's "old" policy, `logp_mu` as everywhere in this crate), the advantages and a
//! padding mask, and reduce per-token losses with an [`AggregationMode`].
//! With `δ = log π − log μ` and `r = exp(δ)`:
//!
//! ```text
//! PPO-clip   ℓ_t = −min(r_t A, clip(r_t, 1 − ε_low, 1 + ε_high) A)
//! dual-clip  ℓ_t = min(ℓ_t, −c A)                      where A < 0   (c > 1)
//! GSPO       s_i = exp(mean_t δ_{i,t});  ℓ_i = −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i)
//! CISPO      ℓ_t = −sg(clip(r_t, 1 − ε_low, 1 + ε_high)) A log π_t
//! ```
//!
//! Numerics: as in the published implementations (verl, TRL, OpenRLHF), `δ` is clamped to
//! `±max_log_ratio` (default 20) before the exponential, so `r ≤ e^20 ≈ 4.9e8` and every value and
//! gradient is finite for finite inputs; past the clamp the gradient is zero. Unlike the TOPR
//! family, PPO's unclipped side is unbounded for `A < 0` (`|A| r`), which is what dual-clip caps.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct, stats};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::{Kind, Tensor};

/// Clip ranges, dual clip, ratio clamp and aggregation of the PPO family.
///
/// `Default` is PPO as in most trainers: `ε_low = ε_high = 0.2`, no dual clip, `δ` clamped to
/// ±20, token-mean over the mask. Build other settings from a preset with the `with_…` methods.
///
/// Reference: Schulman et al., *Proximal Policy Optimization Algorithms*, arXiv 1707.06347; dual
/// clip: Ye et al., arXiv 1912.09729; DAPO (clip-higher): Yu et al., arXiv 2503.14476; GSPO: Zheng
/// et al., arXiv 2507.18071; CISPO: MiniMax, arXiv 2506.13585.
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, PpoConfig};
/// let cfg = PpoConfig::default();
/// assert_eq!((cfg.clip_low, cfg.clip_high, cfg.dual_clip), (0.2, 0.2, None));
/// assert_eq!(cfg.aggregation, AggregationMode::TokenMean);
/// assert!(cfg.with_dual_clip(Some(0.5)).validate().is_err()); // c must exceed 1
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct PpoConfig {
    /// `ε_low`: the ratio is clipped below at `1 − ε_low` (`≥ 0`; `∞` means no lower clip).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub clip_low: f64,
    /// `ε_high`: the ratio is clipped above at `1 + ε_high` (`≥ 0`; `∞` means no upper clip).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub clip_high: f64,
    /// Dual clip `c > 1`: for `A < 0` the loss is capped at `−c A`. `None` disables it.
    pub dual_clip: Option<f64>,
    /// `δ` is clamped to `±max_log_ratio` before `exp` (> 0; published code uses 20).
    pub max_log_ratio: f64,
    /// How per-token losses are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self::ppo()
    }
}

impl PpoConfig {
    /// PPO-clip, `ε = 0.2` both sides, token-mean. Schulman et al., arXiv 1707.06347.
    ///
    /// ```
    /// assert_eq!(topr_loss::PpoConfig::ppo(), topr_loss::PpoConfig::default());
    /// ```
    pub const fn ppo() -> Self {
        Self {
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: None,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// DAPO's clip-higher: `ε_low = 0.2`, `ε_high = 0.28`, token-mean. Yu et al., arXiv 2503.14476.
    ///
    /// ```
    /// assert_eq!(topr_loss::PpoConfig::dapo().clip_high, 0.28);
    /// ```
    pub const fn dapo() -> Self {
        Self::ppo().with_clip(0.2, 0.28)
    }

    /// GSPO's setting for [`gspo_loss`]: `ε_low = 3e-4`, `ε_high = 4e-4` on the sequence ratio,
    /// sequence-mean aggregation (each sequence's loss counted once). Zheng et al., arXiv 2507.18071.
    ///
    /// ```
    /// use topr_loss::{AggregationMode, PpoConfig};
    /// assert_eq!(PpoConfig::gspo().aggregation, AggregationMode::SeqMeanTokenMean);
    /// ```
    pub const fn gspo() -> Self {
        Self::ppo().with_clip(3e-4, 4e-4).with_aggregation(AggregationMode::SeqMeanTokenMean)
    }

    /// CISPO's setting for [`cispo_loss`]: no lower clip (`ε_low = ∞`), `ε_high = 0.28`
    /// (MiniMax-M1 tunes only the upper bound), token-mean. MiniMax, arXiv 2506.13585.
    ///
    /// ```
    /// assert!(topr_loss::PpoConfig::cispo().clip_low.is_infinite());
    /// ```
    pub const fn cispo() -> Self {
        Self::ppo().with_clip(f64::INFINITY, 0.28)
    }

    /// The same config with the clip ranges `(ε_low, ε_high)`.
    ///
    /// ```
    /// let c = topr_loss::PpoConfig::ppo().with_clip(0.1, 0.3);
    /// assert_eq!((c.clip_low, c.clip_high), (0.1, 0.3));
    /// ```
    pub const fn with_clip(self, clip_low: f64, clip_high: f64) -> Self {
        Self { clip_low, clip_high, ..self }
    }

    /// The same config with dual clip `c` (`None`: off).
    ///
    /// ```
    /// assert_eq!(topr_loss::PpoConfig::ppo().with_dual_clip(Some(3.0)).dual_clip, Some(3.0));
    /// ```
    pub const fn with_dual_clip(self, dual_clip: Option<f64>) -> Self {
        Self { dual_clip, ..self }
    }

    crate::setters::setters!(PpoConfig, ppo(); checks, aggregation, max_log_ratio);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: a negative or NaN clip range, a dual clip not
    /// above 1 or not finite, a non-positive or NaN `max_log_ratio`.
    ///
    /// ```
    /// use topr_loss::PpoConfig;
    /// assert!(PpoConfig::default().with_clip(f64::NAN, 0.2).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        for (v, field) in [(self.clip_low, "clip_low"), (self.clip_high, "clip_high")] {
            if v.is_nan() || v < 0.0 {
                return Err(LossError::InvalidConfig { field, value: v, reason: "a clip range must be >= 0".into() });
            }
        }
        if let Some(c) = self.dual_clip {
            if !(c.is_finite() && c > 1.0) {
                return Err(LossError::InvalidConfig {
                    field: "dual_clip",
                    value: c,
                    reason: "the dual-clip constant must be finite and > 1 (commonly 3)".into(),
                });
            }
        }
        validate::positive(
            self.max_log_ratio,
            "max_log_ratio",
            "the log-ratio clamp must be > 0 (published code uses 20)",
        )?;
        Ok(())
    }

    /// `clip(r, 1 − ε_low, 1 + ε_high)`, a bound skipped when infinite.
    fn clip(&self, r: &Tensor) -> Result<Tensor, LossError> {
        let lo = 1.0 - self.clip_low;
        let hi = 1.0 + self.clip_high;
        Ok(match (lo.is_finite(), hi.is_finite()) {
            (true, true) => r.f_clamp(lo, hi)?,
            (true, false) => r.f_clamp_min(lo)?,
            (false, true) => r.f_clamp_max(hi)?,
            (false, false) => r.shallow_clone(),
        })
    }

    /// `exp(clamp(δ, ±max_log_ratio))`.
    fn ratio(&self, delta: &Tensor) -> Result<Tensor, LossError> {
        Ok(delta.f_clamp(-self.max_log_ratio, self.max_log_ratio)?.f_exp()?)
    }

    /// The clipped surrogate `−min(r A, clip(r) A)`, dual-clipped where `A < 0`.
    fn clipped_surrogate(&self, r: &Tensor, adv: &Tensor) -> Result<Tensor, LossError> {
        Ok(self.surrogate_parts(r, adv)?.value)
    }

    /// The clipped surrogate and the two sides it was chosen from, computed once, so that the
    /// diagnostics read where the clip and the dual clip decided without recomputing them.
    fn surrogate_parts(&self, r: &Tensor, adv: &Tensor) -> Result<SurrogateParts, LossError> {
        // −A once (per sequence when A is): `r · (−A)` equals `−(r · A)` exactly, one pass less.
        let neg_adv = adv.f_neg()?;
        let unclipped = r.f_mul(&neg_adv)?;
        let clipped = self.clip(r)?.f_mul(&neg_adv)?;
        let loss = unclipped.f_maximum(&clipped)?;
        let value = match self.dual_clip {
            Some(c) => {
                // min(loss, −c A) where A < 0, loss elsewhere: the cap is +∞ where A ≥ 0, chosen
                // at the advantages' size, so the full-size work is one `minimum`.
                let cap = neg_adv.f_mul_scalar(c)?.f_where_scalarother(&adv.f_lt(0.0)?, f64::INFINITY)?;
                loss.f_minimum(&cap)?
            }
            None => loss.shallow_clone(),
        };
        Ok(SurrogateParts { value, unclipped, clipped, loss })
    }
}

/// The pieces of `PpoConfig::surrogate_parts`.
struct SurrogateParts {
    /// The dual-clipped surrogate.
    value: Tensor,
    /// `−r A`.
    unclipped: Tensor,
    /// `−clip(r) A`.
    clipped: Tensor,
    /// `max` of the two, before the dual clip.
    loss: Tensor,
}

impl SurrogateParts {
    /// Where the clip decides the surrogate (`clip(r) A` is the min, so no gradient) and where
    /// the dual clip does (`−c A` caps it). For the diagnostics.
    fn clip_masks(&self) -> Result<(Tensor, Tensor), LossError> {
        Ok((self.clipped.f_gt_tensor(&self.unclipped)?, self.value.f_ne_tensor(&self.loss)?))
    }
}

/// What a PPO-family trainer logs, from the same pass as the loss ([`ppo_clip_loss_output`],
/// [`gspo_loss_output`], [`cispo_loss_output`]; also [`crate::sapo_loss_output`],
/// [`crate::gmpo_loss_output`], [`crate::clip_cov_loss_output`], [`crate::kl_cov_loss_output`],
/// whose docs say what their clip fraction counts).
///
/// A *sample* is an unmasked token (PPO, CISPO) or a sequence with at least one unmasked token
/// (GSPO); `r` is the (clamped) ratio at that level.
///
/// ```text
/// clip_fraction       = share of samples where the clip decides: PPO/GSPO where clip(r)·A is
///                       the min (no gradient; verl's pg_clipfrac), CISPO where the weight was clipped
/// dual_clip_fraction  = share of samples where the dual-clip cap −c·A decides (verl's pg_clipfrac_lower)
/// ratio_min/mean/max  = statistics of r
/// log_ratio_mean      = mean of ln r
/// approx_kl           = mean of r − 1 − ln r  (the k3 estimate of KL(μ‖π), ≥ 0)
/// ```
///
/// Reference: verl's `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl`; Schulman's k3 estimator.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{ppo_clip_loss_output, Normalizer, PpoConfig};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.5f64, -1.0]]); // r = e^0.5 (clipped at 1.2), then 1
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let out = ppo_clip_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &PpoConfig::ppo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.clip_fraction, d.dual_clip_fraction), (2, 0.5, 0.0));
/// assert!((d.ratio_max - 0.5f64.exp()).abs() < 1e-12);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct PpoDiagnostics {
    /// Number of samples (unmasked tokens, or sequences for GSPO).
    pub samples: i64,
    /// Share of samples where the clip decides the value.
    pub clip_fraction: f64,
    /// Share of samples where the dual-clip cap decides the value (0 without dual clip).
    pub dual_clip_fraction: f64,
    /// Smallest ratio.
    pub ratio_min: f64,
    /// Mean ratio.
    pub ratio_mean: f64,
    /// Largest ratio.
    pub ratio_max: f64,
    /// Mean log-ratio (0 on-policy).
    pub log_ratio_mean: f64,
    /// Mean of `r − 1 − ln r`, the k3 estimate of `KL(μ‖π)`.
    pub approx_kl: f64,
}

diagnostics_struct!(PpoDiagnostics {
    samples,
    clip_fraction,
    dual_clip_fraction,
    ratio_min,
    ratio_mean,
    ratio_max,
    log_ratio_mean,
    approx_kl,
});

/// [`PpoDiagnostics`] over the samples where `valid`, all broadcast to `r`'s shape.
pub(crate) fn ppo_diagnostics(
    r: &Tensor,
    clip_active: &Tensor,
    dual_active: &Tensor,
    valid: &Tensor,
) -> Result<OnDevice<PpoDiagnostics>, LossError> {
    let r = r.f_detach()?.f_to_kind(Kind::Double)?;
    let shape = r.size();
    let valid = valid.f_expand(shape.as_slice(), false)?;
    let active =
        |m: &Tensor| -> Result<Tensor, LossError> { Ok(m.f_expand(shape.as_slice(), false)?.f_logical_and(&valid)?) };
    let samples = stats::count(&valid)?;
    let (ratio_min, ratio_max) = stats::min_max_where(&r, &valid)?;
    let log_r = r.f_log()?;
    let k3 = r.f_sub_scalar(1.0)?.f_sub(&log_r)?;
    OnDevice::new(&[
        samples.shallow_clone(),
        stats::share(&stats::count(&active(clip_active)?)?, &samples)?,
        stats::share(&stats::count(&active(dual_active)?)?, &samples)?,
        ratio_min,
        stats::mean_where(&r, &valid)?,
        ratio_max,
        stats::mean_where(&log_r, &valid)?,
        stats::mean_where(&k3, &valid)?,
    ])
}

fn check_inputs(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    per_token_advantages: bool,
    cfg: &PpoConfig,
) -> Result<TokenInputs, LossError> {
    cfg.validate()?;
    token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: per_token_advantages,
        checks: cfg.checks,
    })
}

/// Reduces per-token losses (broadcastable to `[B, T]`) with the config's aggregation.
fn reduce(per_token: &Tensor, x: &TokenInputs, cfg: &PpoConfig, norm: &Normalizer) -> Result<Tensor, LossError> {
    // PPO's, GSPO's and CISPO's terms are functions of the sanitised inputs alone.
    validate::finite_loss(x.reduce_sanitized_tokens(per_token, cfg.aggregation, norm)?, cfg.checks)
}

/// The output of a PPO-family loss: the loss, the per-token terms and the diagnostics over
/// `valid` samples.
fn output(
    per_token: &Tensor,
    x: &TokenInputs,
    cfg: &PpoConfig,
    norm: &Normalizer,
    diagnostics: OnDevice<PpoDiagnostics>,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let loss = reduce(per_token, x, cfg, norm)?;
    Ok(LossOutput { loss, terms: x.zero_padding(per_token)?, diagnostics })
}

/// The PPO clipped surrogate loss, per token, with optional dual clip and asymmetric
/// (clip-higher) ranges.
///
/// With `A = advantages`, `ε_low = cfg.clip_low`, `ε_high = cfg.clip_high`,
/// `c = cfg.dual_clip` and `M = cfg.max_log_ratio` (20 by default: the log-ratio's clamp before
/// `exp`, so that the ratio never overflows):
///
/// ```text
/// r_t  = exp(clamp(logp_t − sg(logp_mu_t), −M, M))
/// ℓ_t  = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)
/// ℓ_t  = min(ℓ_t, −c A_t)   where A_t < 0, with dual clip c
/// loss = aggregate(ℓ, mask, cfg.aggregation)        (token-mean by default)
/// ```
///
/// `logp_mu` is PPO's old policy `π_old`: the sampler's log-probs, or the trainer's recomputed
/// before the update.
///
/// Reference: Schulman et al., arXiv 1707.06347; dual clip: Ye et al., arXiv 1912.09729;
/// asymmetric clip: DAPO, arXiv 2503.14476.
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
/// use topr_loss::{ppo_clip_loss, PpoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-1.5f64, -1.0]]); // r = e^0.5 ≈ 1.65, then 1
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let adv = Tensor::from_slice(&[1.0f64]);
/// let loss = ppo_clip_loss(&logp, &logp_mu, &adv, &mask, &PpoConfig::default())?;
/// // Token 0 is clipped at 1.2 (no gradient), token 1 is not: loss = −(1.2 + 1)/2.
/// assert!((loss.double_value(&[]) + 1.1).abs() < 1e-12);
/// loss.backward();
/// assert_eq!(Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?, vec![0.0, -0.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn ppo_clip_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
) -> Result<Tensor, LossError> {
    let x = check_inputs(logp, logp_mu, advantages, mask, true, cfg)?;
    let r = cfg.ratio(&x.delta)?;
    let per_token = cfg.clipped_surrogate(&r, &x.weights_per_token()?)?;
    reduce(&per_token, &x, cfg, &Normalizer::local())
}

/// [`ppo_clip_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding)
/// and its [`PpoDiagnostics`] from the same pass.
///
/// Reference: as [`ppo_clip_loss`].
///
/// # Errors
/// As [`ppo_clip_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{aggregate, ppo_clip_loss_output, BatchCounts, Normalizer, PpoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0, 0.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.5f64, -1.0, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let norm = Normalizer::global(BatchCounts { tokens: 4.0, sequences: 2.0 });
/// let cfg = PpoConfig::ppo();
/// let out = ppo_clip_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &cfg, &norm)?;
/// assert!((out.loss.double_value(&[]) + (1.2 + 1.0) / 4.0).abs() < 1e-12);
/// assert_eq!(out.terms.double_value(&[0, 2]), 0.0);
/// let again = aggregate(&out.terms, &mask, cfg.aggregation, &norm)?;
/// assert!((again.double_value(&[]) - out.loss.double_value(&[])).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn ppo_clip_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let x = check_inputs(logp, logp_mu, advantages, mask, true, cfg)?;
    let (per_token, diagnostics) = clip_terms(&x, cfg)?;
    output(&per_token, &x, cfg, norm, diagnostics)
}

/// PPO-clip's per-token terms (zero on padding up to the sanitised reduction) and diagnostics
/// from checked inputs; [`crate::decoupled_ppo_loss`] weighs the same terms.
pub(crate) fn clip_terms(x: &TokenInputs, cfg: &PpoConfig) -> Result<(Tensor, OnDevice<PpoDiagnostics>), LossError> {
    let r = cfg.ratio(&x.delta)?;
    let adv = x.weights_per_token()?;
    let parts = cfg.surrogate_parts(&r, &adv)?;
    let (clip, dual) = parts.clip_masks()?;
    let diagnostics = ppo_diagnostics(&r, &clip, &dual, &x.mask)?;
    Ok((parts.value, diagnostics))
}

/// GSPO: the PPO clipped objective on the length-normalised sequence ratio.
///
/// ```text
/// s_i = exp(clamp(mean_t (log π_{i,t} − sg(log π_old,i,t)), ±M))
/// ℓ_i = −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i)        (dual clip as in PPO)
/// loss = aggregate over tokens, each token of sequence i carrying ℓ_i
/// ```
///
/// With [`PpoConfig::gspo`] (`SeqMeanTokenMean`) the loss is `(1/S) Σ_i ℓ_i` and its gradient
/// `−(1/S) Σ_i s_i A_i (1/L_i) Σ_t ∇log π_{i,t}` where unclipped, GSPO's update.
///
/// Reference: Zheng et al., *Group Sequence Policy Optimization*, arXiv 2507.18071.
///
/// # Arguments
/// As [`ppo_clip_loss`], with `advantages` `[B]` (one per sequence).
///
/// # Errors
/// As [`ppo_clip_loss`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{gspo_loss, PpoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0, 0.0]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let adv = Tensor::from_slice(&[0.5f64]);
/// // On-policy: s = 1, loss = −A.
/// let loss = gspo_loss(&logp, &logp.detach(), &adv, &mask, &PpoConfig::gspo())?;
/// assert!((loss.double_value(&[]) + 0.5).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn gspo_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
) -> Result<Tensor, LossError> {
    let x = check_inputs(logp, logp_mu, advantages, mask, false, cfg)?;
    let s = cfg.ratio(&x.mean_delta()?)?; // [B]
    let per_seq = cfg.clipped_surrogate(&s, x.weights())?; // [B]
    reduce(&per_seq.f_unsqueeze(1)?, &x, cfg, &Normalizer::local())
}

/// [`gspo_loss`] with the counts of `norm`, its per-token terms (`[B, T]`: each unmasked token
/// carries its sequence's `ℓ_i`; zero on padding) and its [`PpoDiagnostics`] over sequences.
///
/// Reference: as [`gspo_loss`].
///
/// # Errors
/// As [`gspo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{gspo_loss_output, Normalizer, PpoConfig};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0], [-1.0, -1.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, false]]);
/// let adv = Tensor::from_slice(&[0.5f64, -0.5]);
/// let out = gspo_loss_output(&logp, &logp, &adv, &mask, &PpoConfig::gspo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.ratio_mean, d.clip_fraction), (2, 1.0, 0.0)); // two sequences, on-policy
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn gspo_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let x = check_inputs(logp, logp_mu, advantages, mask, false, cfg)?;
    let s = cfg.ratio(&x.mean_delta()?)?; // [B]
    let parts = cfg.surrogate_parts(&s, x.weights())?;
    let (clip, dual) = parts.clip_masks()?;
    let per_seq = parts.value;
    let diagnostics = ppo_diagnostics(&s, &clip, &dual, &x.has_tokens.f_gt(0.0)?)?;
    output(&per_seq.f_unsqueeze(1)?, &x, cfg, norm, diagnostics)
}

/// CISPO: REINFORCE on every token with a clipped, stop-gradient importance weight, so clipped
/// tokens still contribute gradient (unlike PPO, which drops them).
///
/// ```text
/// w_t = sg(clip(exp(clamp(δ_t, ±M)), 1 − ε_low, 1 + ε_high))
/// ℓ_t = −w_t A_t log π_t
/// loss = aggregate(ℓ, mask)
/// ```
///
/// The value is the published surrogate (it contains `log π`, so it is not an objective value);
/// the gradient `−w_t A_t ∇log π_t` is CISPO's.
///
/// Reference: MiniMax, *MiniMax-M1*, arXiv 2506.13585, §3.1.
///
/// # Arguments
/// As [`ppo_clip_loss`].
///
/// # Errors
/// As [`ppo_clip_loss`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{cispo_loss, PpoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-2.0f64, -1.0]]); // r = e ≈ 2.72 (clipped to 1.28), then 1
/// let mask = Tensor::from_slice2(&[[1i64, 1]]);
/// let loss = cispo_loss(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &PpoConfig::cispo())?;
/// loss.backward();
/// let g = Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?;
/// assert!((g[0] + 1.28 / 2.0).abs() < 1e-12 && (g[1] + 0.5).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn cispo_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
) -> Result<Tensor, LossError> {
    let x = check_inputs(logp, logp_mu, advantages, mask, true, cfg)?;
    let w = cfg.clip(&cfg.ratio(&x.delta.f_detach()?)?)?;
    let per_token = w.f_mul(&x.weights_per_token()?)?.f_mul(&x.logp()?)?.f_neg()?;
    reduce(&per_token, &x, cfg, &Normalizer::local())
}

/// [`cispo_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding) and
/// its [`PpoDiagnostics`] (the clip fraction counts the tokens whose weight was clipped).
///
/// Reference: as [`cispo_loss`].
///
/// # Errors
/// As [`cispo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{cispo_loss_output, Normalizer, PpoConfig};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-2.0f64, -1.0]]); // r = e (clipped to 1.28), then 1
/// let mask = Tensor::from_slice2(&[[1i64, 1]]);
/// let out = cispo_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &PpoConfig::cispo(), &Normalizer::local())?;
/// assert_eq!(out.diagnostics.read()?.clip_fraction, 0.5);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn cispo_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PpoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let x = check_inputs(logp, logp_mu, advantages, mask, true, cfg)?;
    let r = cfg.ratio(&x.delta.f_detach()?)?;
    let w = cfg.clip(&r)?;
    let per_token = w.f_mul(&x.weights_per_token()?)?.f_mul(&x.logp()?)?.f_neg()?;
    let clipped = w.f_ne_tensor(&r)?;
    let diagnostics = ppo_diagnostics(&r, &clipped, &clipped.f_zeros_like()?, &x.mask)?;
    output(&per_token, &x, cfg, norm, diagnostics)
}
