//! Correcting for the mismatch between the sampler and the trainer: importance weights (TIS,
//! MIS / IcePop), rejection by divergence statistics, DeepSeek-V3.2's off-policy sequence mask,
//! the effective sample size, and applying per-token weights to any loss of the crate.
//!
//! An inference engine (vLLM, SGLang) computes the log-probs of the tokens it samples with other
//! kernels and often another precision than the trainer: even for the "same" policy the trainer's
//! `log π_old` and the sampler's `log μ` differ, and a PPO/GRPO step that treats the sampled data
//! as on-policy is biased — badly, on long sequences. With `δ_t = log π_old,t − log μ_t`:
//!
//! ```text
//! token level      ρ_t = e^{δ_t}                 sequence level   ρ_i = e^{Σ_t δ_{i,t}} (every token of i)
//! truncate (TIS)   w = min(max(ρ, lo), hi)        mask (MIS, IcePop)   w = ρ if lo ≤ ρ ≤ hi, else 0
//! rejection        drop a token / sequence whose k1, k2 or k3 statistic of δ leaves a band
//! OPSM             drop a sequence with A < 0 and mean_t (log μ − log π) > threshold
//! ```
//!
//! The weights are constants (detached) that multiply a loss's per-token terms before its
//! aggregation: [`apply_token_weights`]`(&out.terms, &w.weights, &mask, mode, &norm)` for the `terms`
//! of any `…_output` call; a rejection mask replaces the padding mask of the loss call (so that
//! `TokenMean` divides by the tokens kept, as verl does).
//!
//! Everything is computed in log space: the band tests compare `δ` with `ln lo` and `ln hi`, and
//! `exp` only ever sees `min(δ, ln hi)` or a `δ` clamped to `±max_log_ratio` (20, as verl), so no
//! weight overflows whatever the inputs.
//!
//! Sources: Yao et al., *Your efficient RL framework secretly brings you off-policy RL training*
//! (2025, TIS); Liu et al., *When speed kills stability* (2025, MIS); IcePop (Ling team, arXiv
//! 2510.18855); DeepSeek-V3.2 (arXiv 2512.02556, off-policy sequence masking); verl's
//! `rollout_corr_helper.py`; TRL's `vllm_importance_sampling_mode` and `off_policy_mask_threshold`.

use crate::aggregate::{AggregationMode, Normalizer, aggregate, masked_fill_zero};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{OnDevice, diagnostics_struct, stats};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::{Kind, Tensor};

/// Where importance ratios are formed.
///
/// # Example
/// ```
/// use topr_loss::{CorrectionLevel, RolloutCorrection};
/// assert_eq!(RolloutCorrection::default().level, CorrectionLevel::Token);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum CorrectionLevel {
    /// `ρ_t = e^{δ_t}` per token: biased, low variance (verl `rollout_is="token"`, TRL `token_*`).
    #[default]
    Token,
    /// `ρ_i = e^{Σ_t δ_{i,t}}` per sequence, given to each of its tokens: unbiased, high variance
    /// (verl `rollout_is="sequence"`, TRL `sequence_*`).
    Sequence,
    /// `ρ_i = e^{(1/L_i) Σ_t δ_{i,t}}`, the geometric mean of the sequence's token ratios, given
    /// to each of its tokens: a length-independent sequence weight (AReaL's sequence-level
    /// `rejection_sampling` with the ratio metric; verl's former `rollout_is_level="geometric"`).
    Geometric,
}

/// What happens to a ratio outside `[lo, hi]`.
///
/// # Example
/// ```
/// use topr_loss::WeightRule;
/// assert_ne!(WeightRule::Truncate, WeightRule::Mask);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum WeightRule {
    /// Truncated importance sampling (TIS): `w = min(max(ρ, lo), hi)`.
    #[default]
    Truncate,
    /// Masked importance sampling (MIS, IcePop): `w = ρ` inside `[lo, hi]`, `0` outside.
    Mask,
}

/// Configuration of [`rollout_weights`].
///
/// `Default` ([`RolloutCorrection::token_tis`]`(2.0)`): token level, truncated at 2, no lower
/// bound, no batch normalisation — verl's default `rollout_is="token"`, `rollout_is_threshold=2.0`.
///
/// Reference: verl `algorithm.rollout_correction` (`rollout_is`, `rollout_is_threshold`,
/// `rollout_is_batch_normalize`); TRL `GRPOConfig.vllm_importance_sampling_mode`,
/// `vllm_importance_sampling_clip_min/max`.
///
/// # Example
/// ```
/// use topr_loss::{CorrectionLevel, RolloutCorrection, WeightRule};
/// let cfg = RolloutCorrection::sequence_mis(0.5, 2.0);
/// assert_eq!((cfg.level, cfg.rule, cfg.min, cfg.max), (CorrectionLevel::Sequence, WeightRule::Mask, 0.5, 2.0));
/// assert!(cfg.validate().is_ok());
/// assert!(RolloutCorrection::token_tis(0.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct RolloutCorrection {
    /// Token or sequence ratios.
    pub level: CorrectionLevel,
    /// Truncate or mask outside `[min, max]`.
    pub rule: WeightRule,
    /// `lo ≥ 0` (0: no lower bound).
    pub min: f64,
    /// `hi > lo` (may be `∞`: no upper bound, plain importance sampling for `Truncate`).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub max: f64,
    /// Divide the weights by their mean over the batch's tokens (token level) or sequences
    /// (sequence level), so that they average 1 (verl `rollout_is_batch_normalize`).
    pub batch_normalize: bool,
    /// Token level only: divide each sequence's weights by their mean over its tokens, so that
    /// every sequence's weights average 1 (self-normalised importance sampling per sequence, verl
    /// PR #3980's `rollout_is_self_norm` with `seq-mean-token-mean`; applied before
    /// `batch_normalize`).
    pub sequence_normalize: bool,
    /// `δ` (or the sequence's `Σ δ`) is clamped to `±max_log_ratio` before any `exp` (verl: 20).
    pub max_log_ratio: f64,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for RolloutCorrection {
    fn default() -> Self {
        Self::token_tis(2.0)
    }
}

impl RolloutCorrection {
    /// Token-level truncated IS: `w_t = min(ρ_t, max)` (verl `rollout_is="token"`,
    /// `rollout_is_threshold=max`; TRL `token_truncate` with `clip_min=0`).
    ///
    /// ```
    /// assert_eq!(topr_loss::RolloutCorrection::token_tis(2.0), topr_loss::RolloutCorrection::default());
    /// ```
    pub const fn token_tis(max: f64) -> Self {
        Self {
            level: CorrectionLevel::Token,
            rule: WeightRule::Truncate,
            min: 0.0,
            max,
            batch_normalize: false,
            sequence_normalize: false,
            max_log_ratio: 20.0,
            checks: Checks::Full,
        }
    }

    /// Sequence-level truncated IS: `w_i = min(ρ_i, max)` (verl `rollout_is="sequence"`; TRL
    /// `sequence_truncate`).
    ///
    /// ```
    /// assert_eq!(topr_loss::RolloutCorrection::sequence_tis(5.0).level, topr_loss::CorrectionLevel::Sequence);
    /// ```
    pub const fn sequence_tis(max: f64) -> Self {
        Self { level: CorrectionLevel::Sequence, ..Self::token_tis(max) }
    }

    /// Token-level masked IS (IcePop): `w_t = ρ_t` inside `[min, max]`, else 0 (verl
    /// `rollout_is="token"`, `rollout_is_threshold="min_max"`; TRL `token_mask`).
    ///
    /// ```
    /// assert_eq!(topr_loss::RolloutCorrection::token_mis(0.5, 2.0).rule, topr_loss::WeightRule::Mask);
    /// ```
    pub const fn token_mis(min: f64, max: f64) -> Self {
        Self { rule: WeightRule::Mask, min, ..Self::token_tis(max) }
    }

    /// Sequence-level masked IS: `w_i = ρ_i` inside `[min, max]`, else 0 (verl
    /// `rollout_is="sequence"` with `"min_max"`; TRL `sequence_mask`).
    ///
    /// ```
    /// assert_eq!(topr_loss::RolloutCorrection::sequence_mis(0.5, 2.0).min, 0.5);
    /// ```
    pub const fn sequence_mis(min: f64, max: f64) -> Self {
        Self { level: CorrectionLevel::Sequence, ..Self::token_mis(min, max) }
    }

    /// Geometric-mean sequence TIS: `w_i = min(ρ_i, max)` with `ρ_i = e^{(1/L_i) Σ_t δ_{i,t}}`
    /// (AReaL's sequence-level `rejection_sampling` with `action: clamp`; verl's former
    /// `rollout_is_level="geometric"`).
    ///
    /// ```
    /// use topr_loss::{CorrectionLevel, RolloutCorrection};
    /// assert_eq!(RolloutCorrection::geometric_tis(2.0).level, CorrectionLevel::Geometric);
    /// ```
    pub const fn geometric_tis(max: f64) -> Self {
        Self { level: CorrectionLevel::Geometric, ..Self::token_tis(max) }
    }

    /// Geometric-mean sequence MIS: `w_i = ρ_i` (the geometric mean of the token ratios) inside
    /// `[min, max]`, else 0 (AReaL's sequence-level `rejection_sampling` with the ratio metric).
    ///
    /// ```
    /// assert_eq!(topr_loss::RolloutCorrection::geometric_mis(0.5, 2.0).min, 0.5);
    /// ```
    pub const fn geometric_mis(min: f64, max: f64) -> Self {
        Self { level: CorrectionLevel::Geometric, ..Self::token_mis(min, max) }
    }

    /// The same config with the bounds `[min, max]`.
    ///
    /// ```
    /// let c = topr_loss::RolloutCorrection::token_tis(2.0).with_bounds(0.1, 3.0);
    /// assert_eq!((c.min, c.max), (0.1, 3.0));
    /// ```
    pub const fn with_bounds(self, min: f64, max: f64) -> Self {
        Self { min, max, ..self }
    }

    /// The same config with (or without) batch normalisation.
    ///
    /// ```
    /// assert!(topr_loss::RolloutCorrection::token_tis(2.0).with_batch_normalize(true).batch_normalize);
    /// ```
    pub const fn with_batch_normalize(self, batch_normalize: bool) -> Self {
        Self { batch_normalize, ..self }
    }

    /// The same config with each sequence's token weights divided by their mean over the
    /// sequence (token level only).
    ///
    /// ```
    /// assert!(topr_loss::RolloutCorrection::token_tis(2.0).with_sequence_normalize(true).sequence_normalize);
    /// assert!(topr_loss::RolloutCorrection::sequence_tis(2.0).with_sequence_normalize(true).validate().is_err());
    /// ```
    pub const fn with_sequence_normalize(self, sequence_normalize: bool) -> Self {
        Self { sequence_normalize, ..self }
    }

    crate::setters::setters!(RolloutCorrection, token_tis(2.0); checks, max_log_ratio);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: `min` negative, NaN or infinite; `max` not
    /// above `min`; `max_log_ratio` not positive; `sequence_normalize` at a sequence level.
    ///
    /// ```
    /// assert!(topr_loss::RolloutCorrection::token_mis(2.0, 1.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        validate::limits(self.min, self.max, "min", "max")?;
        if self.max <= self.min {
            return Err(LossError::InvalidConfig {
                field: "max",
                value: self.max,
                reason: format!("the upper bound must exceed the lower bound `min` = {}", self.min),
            });
        }
        if self.sequence_normalize && self.level != CorrectionLevel::Token {
            return Err(LossError::InvalidConfig {
                field: "sequence_normalize",
                value: 1.0,
                reason: "a sequence-level weight is constant over its sequence: normalising it per sequence makes it 1"
                    .into(),
            });
        }
        validate::positive(self.max_log_ratio, "max_log_ratio", "the log-ratio clamp must be > 0 (verl uses 20)")
    }
}

/// Importance weights and what a trainer logs about them, from [`rollout_weights`].
#[derive(Debug)]
#[non_exhaustive]
pub struct RolloutWeights {
    /// `[B, T]` weights, detached, zero on padding (and on masked-out ratios for
    /// [`WeightRule::Mask`]); pass them to [`apply_token_weights`].
    pub weights: Tensor,
    /// Their diagnostics, computed in the same pass, not yet read back.
    pub diagnostics: OnDevice<RolloutDiagnostics>,
}

/// What a trainer logs about the sampler–trainer mismatch ([`rollout_weights`]).
///
/// Samples are unmasked tokens at [`CorrectionLevel::Token`], sequences with at least one token
/// at [`CorrectionLevel::Sequence`]; `ρ` is the (clamped) ratio at that level.
///
/// ```text
/// weight_mean/min/max   statistics of w over the samples (before batch normalisation; at sequence
///                       level each sequence counts once, where verl's rollout_is_mean counts tokens)
/// bounded_fraction      share of samples whose ρ left [lo, hi] (truncated or masked)
/// ess                   (Σ w)² / (n Σ w²) over the tokens: the effective sample size as a share of n
///                       (verl's rollout_is_eff_sample_size), 1 when all weights are equal
/// kl                    mean over tokens of log μ − log π_old   (the k1 estimate of KL(μ‖π_old))
/// k3_kl                 mean over tokens of ρ − 1 − ln ρ          (k3, never negative; δ clamped to ±M first,
///                       where verl exponentiates the raw δ)
/// chi2                  mean over tokens of ρ² − 1                (χ²(π_old‖μ), token level)
/// ```
///
/// Reference: verl's `compute_is_metrics` and `compute_offpolicy_metrics`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{rollout_weights, RolloutCorrection};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let d = rollout_weights(&lp, &lp, &lp.ones_like(), &RolloutCorrection::token_tis(2.0))?.diagnostics.read()?;
/// assert_eq!((d.samples, d.weight_mean, d.ess, d.kl, d.bounded_fraction), (2, 1.0, 1.0, 0.0, 0.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RolloutDiagnostics {
    /// Number of samples (tokens or sequences).
    pub samples: i64,
    /// Mean weight.
    pub weight_mean: f64,
    /// Smallest weight.
    pub weight_min: f64,
    /// Largest weight.
    pub weight_max: f64,
    /// Share of samples whose ratio left `[min, max]`.
    pub bounded_fraction: f64,
    /// Effective sample size as a share of the tokens, in `(0, 1]` (0 if every weight is 0).
    pub ess: f64,
    /// Mean `log μ − log π_old` over tokens.
    pub kl: f64,
    /// Mean `ρ − 1 − ln ρ` over tokens.
    pub k3_kl: f64,
    /// Mean `ρ² − 1` over tokens.
    pub chi2: f64,
}

diagnostics_struct!(RolloutDiagnostics {
    samples,
    weight_mean,
    weight_min,
    weight_max,
    bounded_fraction,
    ess,
    kl,
    k3_kl,
    chi2,
});

/// The checked inputs of a correction: `δ = log π − log μ` detached, zero on padding.
fn check(logp: &Tensor, logp_rollout: &Tensor, mask: &Tensor, checks: Checks) -> Result<TokenInputs, LossError> {
    token_inputs::check(TokenArgs {
        logp,
        other: (logp_rollout, "logp_rollout"),
        weights: None,
        mask,
        per_token_weights: false,
        checks,
    })
}

/// Importance weights that correct for the sampler–trainer mismatch, truncated (TIS) or masked
/// (MIS / IcePop), per token or per sequence.
///
/// ```text
/// δ_t = clamp(log π_t − log μ_t, ±M)                    (token level)
/// δ_i = clamp(Σ_t m δ_t, ±M), given to each token of i  (sequence level)
/// δ_i = clamp(Σ_t m δ_t / L_i, ±M), given to each token of i  (geometric level)
/// Truncate   w = exp(clamp(δ, ln lo, ln hi))             = min(max(ρ, lo), hi)
/// Mask       w = exp(δ) if ln lo ≤ δ ≤ ln hi else 0
/// sequence_normalize   w_{i,t} ← w_{i,t} / mean_t w_{i,t}   (token level; if that mean > 1e-8)
/// batch_normalize   w ← w / mean(w)   (over tokens, or over sequences at sequence level; if mean > 1e-8)
/// ```
///
/// Pass the trainer's log-probs of the sampled tokens as `logp` (verl's `old_log_prob`, computed
/// by the trainer before the update; or the current policy's, detached, in verl's bypass mode) and
/// the sampler's as `logp_rollout`. Multiply a loss's per-token terms with the weights through
/// [`apply_token_weights`].
///
/// Reference: verl `compute_rollout_correction_weights` (its values, tested); TRL
/// `vllm_importance_sampling_mode` (`token_truncate`, `token_mask`, `sequence_truncate`,
/// `sequence_mask`: TRL clamps to `[clip_min, clip_max]`, as [`WeightRule::Truncate`] with `min`).
///
/// # Arguments
/// * `logp` — `[B, T]`, the trainer's log-probs (any graph is ignored: the weights are constants).
/// * `logp_rollout` — `[B, T]`, the sampler's.
/// * `mask` — `[B, T]`.
///
/// # Errors
/// [`LossError::InvalidConfig`] and the tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{rollout_weights, RolloutCorrection};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0, -1.0]]);
/// let logp_rollout = Tensor::from_slice2(&[[-2.0f64, -1.0, -0.5]]); // ρ = e, 1, e^-0.5
/// let mask = Tensor::from_slice2(&[[true, true, true]]);
/// let w = rollout_weights(&logp, &logp_rollout, &mask, &RolloutCorrection::token_tis(2.0))?;
/// let v = Vec::<f64>::try_from(&w.weights.flatten(0, -1))?;
/// assert!((v[0] - 2.0).abs() < 1e-12 && v[1] == 1.0 && (v[2] - (-0.5f64).exp()).abs() < 1e-12);
/// let w = rollout_weights(&logp, &logp_rollout, &mask, &RolloutCorrection::token_mis(0.5, 2.0))?;
/// assert_eq!(w.weights.double_value(&[0, 0]), 0.0); // e is outside [0.5, 2]: masked
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rollout_weights(
    logp: &Tensor,
    logp_rollout: &Tensor,
    mask: &Tensor,
    cfg: &RolloutCorrection,
) -> Result<RolloutWeights, LossError> {
    cfg.validate()?;
    let x = check(&validate::detached(logp, "logp")?, logp_rollout, mask, cfg.checks)?;
    weights_of(&x, cfg)
}

/// [`rollout_weights`] of checked inputs (`x.delta` = `log π − log μ`, zero on padding).
pub(crate) fn weights_of(x: &TokenInputs, cfg: &RolloutCorrection) -> Result<RolloutWeights, LossError> {
    let m = cfg.max_log_ratio;
    let token_delta = x.delta.f_clamp(-m, m)?; // [B, T], 0 on padding
    let (delta, valid) = match cfg.level {
        CorrectionLevel::Token => (token_delta.shallow_clone(), x.mask.shallow_clone()),
        CorrectionLevel::Sequence => (
            x.delta.f_sum_dim_intlist(1, true, None::<Kind>)?.f_clamp(-m, m)?, // [B, 1]
            x.has_tokens.f_gt(0.0)?.f_unsqueeze(1)?,
        ),
        CorrectionLevel::Geometric => (
            x.delta
                .f_sum_dim_intlist(1, true, None::<Kind>)?
                .f_div(&x.lengths.f_clamp_min(1.0)?.f_unsqueeze(1)?)?
                .f_clamp(-m, m)?, // [B, 1]
            x.has_tokens.f_gt(0.0)?.f_unsqueeze(1)?,
        ),
    };
    let (ln_lo, ln_hi) = (cfg.min.ln(), cfg.max.ln());
    let below = delta.f_lt(ln_lo)?;
    let above = delta.f_gt(ln_hi)?;
    let outside = below.f_logical_or(&above)?;
    let w = match cfg.rule {
        // clamp with an infinite bound skipped: ln 0 = −∞ and ln ∞ = ∞ are no bounds.
        WeightRule::Truncate => clamp_log(&delta, ln_lo, ln_hi)?.f_exp()?,
        WeightRule::Mask => {
            let r = delta.f_clamp_max(ln_hi.min(m))?.f_exp()?;
            r.f_where_self(&outside.f_logical_not()?, &r.f_zeros_like()?)?
        }
    };
    let full = x.zero_padding(&w)?; // [B, T]
    let rho = token_delta.f_exp()?;
    let (w_min, w_max) = stats::min_max_where(&w, &valid)?;
    let samples = stats::count(&valid)?;
    let diagnostics = OnDevice::new(&[
        samples.shallow_clone(),
        stats::mean_where(&w, &valid)?,
        w_min,
        w_max,
        stats::share(&stats::count(&outside.f_logical_and(&valid)?)?, &samples)?,
        ess(&full, &x.mask)?,
        stats::mean_where(&x.delta.f_neg()?, &x.mask)?,
        stats::mean_where(&rho.f_sub_scalar(1.0)?.f_sub(&token_delta)?, &x.mask)?,
        stats::mean_where(&rho.f_square()?.f_sub_scalar(1.0)?, &x.mask)?,
    ])?;
    // Normalisations after the diagnostics, which describe the weights before them (as verl's).
    let (full, w) = if cfg.sequence_normalize {
        let per_sequence = per_sequence_mean(&full, x)?;
        (full.f_div(&per_sequence)?, w.f_div(&per_sequence)?)
    } else {
        (full, w)
    };
    let weights = if cfg.batch_normalize { normalise(&full, &w, &valid, x)? } else { full };
    Ok(RolloutWeights { weights, diagnostics })
}

/// `clamp(t, lo, hi)` with an infinite bound skipped.
fn clamp_log(t: &Tensor, lo: f64, hi: f64) -> Result<Tensor, LossError> {
    Ok(match (lo.is_finite(), hi.is_finite()) {
        (true, true) => t.f_clamp(lo, hi)?,
        (true, false) => t.f_clamp_min(lo)?,
        (false, true) => t.f_clamp_max(hi)?,
        (false, false) => t.shallow_clone(),
    })
}

/// Each sequence's mean weight over its tokens `[B, 1]`, 1 where it is not above 1e-8.
fn per_sequence_mean(full: &Tensor, x: &TokenInputs) -> Result<Tensor, LossError> {
    let mean = full.f_sum_dim_intlist(1, true, None::<Kind>)?.f_div(&x.lengths.f_clamp_min(1.0)?.f_unsqueeze(1)?)?;
    let ok = mean.f_gt(1e-8)?;
    Ok(mean.f_where_self(&ok, &mean.f_ones_like()?)?)
}

/// The weights divided by their mean over the samples, where that mean exceeds 1e-8.
fn normalise(full: &Tensor, w: &Tensor, valid: &Tensor, x: &TokenInputs) -> Result<Tensor, LossError> {
    let mean = stats::mean_where(&w.f_expand(valid.size().as_slice(), false)?, valid)?.f_to_kind(x.kind)?;
    let ok = mean.f_gt(1e-8)?;
    let scale = mean.f_where_self(&ok, &mean.f_ones_like()?)?;
    Ok(full.f_div(&scale)?)
}

/// `(Σ w)² / (n Σ w²)` over the true entries of `mask`, 0 if every weight there is 0.
fn ess(w: &Tensor, mask: &Tensor) -> Result<Tensor, LossError> {
    let w = w.f_to_kind(Kind::Double)?;
    let s1 = stats::sum_where(&w, mask)?;
    let s2 = stats::sum_where(&w.f_square()?, mask)?;
    let n = stats::count(mask)?;
    let den = n.f_mul(&s2)?;
    let pos = den.f_gt(0.0)?;
    Ok(s1.f_square()?.f_div(&den.f_clamp_min(f64::MIN_POSITIVE)?)?.f_where_self(&pos, &den.f_zeros_like()?)?)
}

/// The effective sample size of importance weights as a share of the samples,
/// `(Σ w)² / (n Σ w²)` over the unmasked entries: 1 when all weights are equal, `1/n` when one
/// weight carries everything, 0 when all are 0.
///
/// A 0-d f64 tensor on the weights' device (no host read). Kish's ESS is `n` times this.
///
/// Reference: Kish (1965); verl `rollout_is_eff_sample_size` (`1 / mean((w / mean w)²)`).
///
/// # Errors
/// The tensor checks of [`LossError`] for `weights` and `mask` (same shape, `[B]` or `[B, T]`).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::effective_sample_size;
/// let w = Tensor::from_slice(&[1.0f64, 1.0, 1.0, 5.0]);
/// let ess = effective_sample_size(&w, &w.ones_like())?.double_value(&[]);
/// assert!((ess - 64.0 / (4.0 * 28.0)).abs() < 1e-12);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn effective_sample_size(weights: &Tensor, mask: &Tensor) -> Result<Tensor, LossError> {
    validate::float_tensor(weights, "weights")?;
    let m = validate::bool_mask(mask, "mask")?;
    validate::same_shape(&m, "mask", &weights.size(), "the shape of `weights`")?;
    validate::same_device(&m, "mask", weights.device(), "weights")?;
    validate::finite(weights, "weights", Some(&m))?;
    ess(&masked_fill_zero(&weights.f_detach()?.f_to_kind(Kind::Double)?, &m)?, &m)
}

/// A loss's per-token terms multiplied by per-token (or per-sequence) weights, then aggregated:
/// how rollout-correction weights (or any importance, curriculum or token-selection weights)
/// enter every loss of the crate.
///
/// ```text
/// loss = aggregate(w ⊙ terms, mask, mode, norm)        w detached, [B, T] or [B] (broadcast)
/// ```
///
/// `terms` are the `terms` of a token-level `…_output` call (`ppo_clip_loss_output`,
/// `gspo_loss_output`, `cispo_loss_output`, `topr_token_loss_output`, `kl_penalty_output`, …)
/// made with the same `mask`, `mode` and `norm`: with all weights 1 the result is that call's
/// `loss`. Weights are detached (they change the measure, not the objective); padding gets zero
/// gradient whatever the weights hold there.
///
/// GSPO's terms carry the sequence's loss on each token, and its gradient reaches every token of
/// the sequence: per-token weights that vary within a sequence weigh that sequence by their mean.
/// verl's GSPO-token instead gives each token its own weight in the gradient; the two agree for
/// weights constant over each sequence ([`CorrectionLevel::Sequence`]), the natural level for a
/// sequence-level ratio.
///
/// Reference: verl multiplies `pg_losses` by `rollout_is_weights` before `agg_loss`; TRL
/// multiplies `per_token_loss` by `importance_sampling_ratio` (both tested for PPO and GSPO).
///
/// # Arguments
/// * `terms` — `[B, T]` per-token loss terms (differentiable).
/// * `weights` — `[B, T]` or `[B]`, finite on unmasked entries (checked: one host read).
/// * `mask` — `[B, T]`, the mask the terms were computed with.
///
/// # Errors
/// The tensor checks of [`LossError`]; [`LossError::InvalidConfig`] for a bad `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{apply_token_weights, ppo_clip_loss_output, rollout_weights, AggregationMode, Normalizer, PpoConfig, RolloutCorrection};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.2], [-0.5, -0.7]]).set_requires_grad(true);
/// let logp_rollout = Tensor::from_slice2(&[[-1.1f64, -1.0], [-0.5, -3.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, false]]);
/// let adv = Tensor::from_slice(&[1.0f64, -1.0]);
/// let (cfg, norm) = (PpoConfig::ppo(), Normalizer::local());
/// let out = ppo_clip_loss_output(&logp, &logp_rollout, &adv, &mask, &cfg, &norm)?;
/// // All weights 1: the loss itself.
/// let same = apply_token_weights(&out.terms, &mask.ones_like().to_kind(tch::Kind::Double), &mask, cfg.aggregation, &norm)?;
/// assert!((same.double_value(&[]) - out.loss.double_value(&[])).abs() < 1e-15);
/// // Token-level TIS weights of the trainer's log-probs against the sampler's.
/// let w = rollout_weights(&logp, &logp_rollout, &mask, &RolloutCorrection::token_tis(2.0))?;
/// let loss = apply_token_weights(&out.terms, &w.weights, &mask, cfg.aggregation, &norm)?;
/// loss.backward();
/// assert_eq!(logp.grad().double_value(&[1, 1]), 0.0); // padding
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn apply_token_weights(
    terms: &Tensor,
    weights: &Tensor,
    mask: &Tensor,
    mode: AggregationMode,
    norm: &Normalizer,
) -> Result<Tensor, LossError> {
    validate::float_tensor(terms, "terms")?;
    validate::float_tensor(weights, "weights")?;
    let shape = validate::rank(terms, "terms", 2, "[B, T] per-token loss terms")?;
    let m = validate::bool_mask(mask, "mask")?;
    validate::same_shape(&m, "mask", &shape, "the shape of `terms`")?;
    let per_token = weights.dim() == 2;
    if per_token {
        validate::same_shape(weights, "weights", &shape, "the shape of `terms` (per-token weights)")?;
    } else {
        validate::same_shape(weights, "weights", &shape[..1], "[B], one weight per sequence of `terms`")?;
    }
    validate::same_device(&m, "mask", terms.device(), "terms")?;
    validate::same_device(weights, "weights", terms.device(), "terms")?;
    let w = weights.f_detach()?;
    let w = if per_token { w } else { w.f_unsqueeze(1)? };
    let valid = m.f_expand(shape.as_slice(), false)?;
    validate::finite(&w.f_expand(shape.as_slice(), false)?, "weights", Some(&valid))?;
    let w = masked_fill_zero(&w.f_expand(shape.as_slice(), false)?, &m)?;
    let t = masked_fill_zero(terms, &m)?;
    aggregate(&t.f_mul(&w.f_to_kind(t.kind())?)?, &m, mode, norm)
}

/// The statistic a rejection rule tests, of `δ_t = clamp(log π_old,t − log μ_t, ±20)`.
///
/// ```text
/// K1   −δ        (log μ − log π: kept if ln lo ≤ stat ≤ ln hi)
/// K2   δ²/2      (kept if stat ≤ hi)
/// K3   e^δ − 1 − δ   (kept if stat ≤ hi)
/// ```
///
/// # Example
/// ```
/// assert_ne!(topr_loss::Divergence::K1, topr_loss::Divergence::K3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum Divergence {
    /// `−δ`, tested against a band `[ln lo, ln hi]` (bounds given as ratios `μ/π`).
    K1,
    /// `δ²/2`.
    K2,
    /// `e^δ − 1 − δ`.
    K3,
}

/// Over what a rejection statistic is taken.
///
/// # Example
/// ```
/// assert_ne!(topr_loss::RejectionScope::Token, topr_loss::RejectionScope::SequenceMean);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum RejectionScope {
    /// Each token on its own (rejects tokens).
    Token,
    /// The sum over the sequence's tokens (rejects sequences).
    #[cfg_attr(feature = "serde", serde(rename = "seq_sum"))]
    SequenceSum,
    /// The mean over the sequence's tokens (rejects sequences).
    #[cfg_attr(feature = "serde", serde(rename = "seq_mean"))]
    SequenceMean,
    /// The largest token value of the sequence (rejects sequences; not with [`Divergence::K1`]).
    #[cfg_attr(feature = "serde", serde(rename = "seq_max"))]
    SequenceMax,
}

/// One rejection rule of [`rollout_rejection_mask`]: drop what a divergence statistic puts out
/// of bounds.
///
/// Reference: verl `rollout_rs` options `token_k1` … `seq_max_k3` with `rollout_rs_threshold`
/// (`"lo_hi"` for the k1 options, where one number `hi` means `[1/hi, hi]`).
///
/// # Example
/// ```
/// use topr_loss::{Divergence, Rejection, RejectionScope};
/// let r = Rejection::k3(RejectionScope::SequenceMax, 0.01);
/// assert_eq!((r.divergence, r.max), (Divergence::K3, 0.01));
/// assert!(Rejection::k1(RejectionScope::Token, 2.0, 0.5).validate().is_err()); // lo > hi
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct Rejection {
    /// The statistic.
    pub divergence: Divergence,
    /// Over what.
    pub scope: RejectionScope,
    /// K1 only: the lower ratio bound `lo > 0` (`−δ ≥ ln lo`); ignored otherwise.
    pub min: f64,
    /// The upper bound: a ratio `hi > 0` for K1 (`−δ ≤ ln hi`), the statistic's maximum otherwise.
    pub max: f64,
    /// `δ` is clamped to `±max_log_ratio` first (verl: 20).
    #[cfg_attr(feature = "serde", serde(default = "crate::serde_support::rejection_max_log_ratio"))]
    pub max_log_ratio: f64,
}

impl Rejection {
    /// K1 (`log μ − log π`) kept within `[ln min, ln max]` (verl `token_k1`, `seq_sum_k1`,
    /// `seq_mean_k1` with threshold `"min_max"`).
    ///
    /// ```
    /// let r = topr_loss::Rejection::k1(topr_loss::RejectionScope::SequenceSum, 0.5, 2.0);
    /// assert_eq!((r.min, r.max), (0.5, 2.0));
    /// ```
    pub const fn k1(scope: RejectionScope, min: f64, max: f64) -> Self {
        Self { divergence: Divergence::K1, scope, min, max, max_log_ratio: 20.0 }
    }

    /// K2 (`δ²/2`) at most `max`.
    ///
    /// ```
    /// assert_eq!(topr_loss::Rejection::k2(topr_loss::RejectionScope::Token, 0.1).max, 0.1);
    /// ```
    pub const fn k2(scope: RejectionScope, max: f64) -> Self {
        Self { divergence: Divergence::K2, scope, min: 0.0, max, max_log_ratio: 20.0 }
    }

    /// K3 (`e^δ − 1 − δ`) at most `max`.
    ///
    /// ```
    /// assert_eq!(topr_loss::Rejection::k3(topr_loss::RejectionScope::Token, 0.1).divergence, topr_loss::Divergence::K3);
    /// ```
    pub const fn k3(scope: RejectionScope, max: f64) -> Self {
        Self { divergence: Divergence::K3, scope, min: 0.0, max, max_log_ratio: 20.0 }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: a bound that is not positive and finite
    /// (`min ≤ max` for K1), K1 with [`RejectionScope::SequenceMax`], a non-positive clamp.
    ///
    /// ```
    /// use topr_loss::{Rejection, RejectionScope};
    /// assert!(Rejection::k1(RejectionScope::SequenceMax, 0.5, 2.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        validate::positive(self.max, "max", "a rejection bound must be > 0")?;
        validate::finite_field(self.max, "max")?;
        if self.divergence == Divergence::K1 {
            validate::positive(self.min, "min", "the k1 lower ratio bound must be > 0")?;
            validate::limits(self.min, self.max, "min", "max")?;
            if self.scope == RejectionScope::SequenceMax {
                return Err(LossError::InvalidConfig {
                    field: "scope",
                    value: f64::NAN,
                    reason:
                        "the largest k1 of a sequence is not a divergence bound (k1 can be negative); use K2 or K3 \
                             with SequenceMax, as verl does"
                            .into(),
                });
            }
        }
        validate::positive(self.max_log_ratio, "max_log_ratio", "the log-ratio clamp must be > 0 (verl uses 20)")
    }
}

/// The padding mask with the tokens (or whole sequences) that a rejection rule drops set to
/// false: a hard trust region between the trainer's and the sampler's log-probs.
///
/// ```text
/// δ_t  = clamp(log π_old,t − log μ_t, ±20);  s_t = −δ_t | δ_t²/2 | e^{δ_t} − 1 − δ_t   (K1 | K2 | K3)
/// stat = s_t | Σ_t m s_t | mean_t s_t | max_t s_t        (Token | SequenceSum | SequenceMean | SequenceMax)
/// keep = ln lo ≤ stat ≤ ln hi  (K1)      stat ≤ hi  (K2, K3)
/// mask' = mask ∧ keep
/// ```
///
/// Pass `mask'` as the mask of the loss call (so that token means count the kept tokens only) and
/// to [`Normalizer::from_masks`] for global counts. For several rules use
/// [`rollout_rejection_mask_all`], which computes each on the original mask as verl's
/// comma-separated `rollout_rs` does; calling this again with `mask'` is another method (a
/// sequence rule then sees only the tokens the first rule kept).
///
/// Reference: verl `compute_rollout_rejection_mask` with one option (its values, tested).
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad rule; the tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{rollout_rejection_mask, Rejection, RejectionScope};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0], [-1.0, -1.0]]);
/// let logp_rollout = Tensor::from_slice2(&[[-1.0f64, -1.01], [-1.0, -3.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, true]]);
/// let kept = rollout_rejection_mask(&logp, &logp_rollout, &mask, &Rejection::k2(RejectionScope::SequenceMax, 0.5))?;
/// assert_eq!(Vec::<bool>::try_from(&kept.flatten(0, -1))?, vec![true, true, false, false]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rollout_rejection_mask(
    logp: &Tensor,
    logp_rollout: &Tensor,
    mask: &Tensor,
    rule: &Rejection,
) -> Result<Tensor, LossError> {
    rollout_rejection_mask_all(logp, logp_rollout, mask, std::slice::from_ref(rule))
}

/// The padding mask with what any of several rejection rules drops set to false: every rule is
/// computed on the original `mask` and the kept sets are intersected.
///
/// ```text
/// mask' = mask ∧ keep_1 ∧ … ∧ keep_n        (keep_r: rule r's test of rollout_rejection_mask,
///                                           its statistic taken over the tokens of `mask`)
/// ```
///
/// This is verl's comma-separated `rollout_rs` (e.g. `"token_k2,seq_max_k3"` with thresholds
/// `"0.1,0.2"`). It differs from passing the mask of one rule to the next when a token rule comes
/// before a sequence rule: chained, a sequence statistic is taken over the tokens the token rule
/// kept, so a sequence whose worst token the token rule dropped can pass the sequence rule; here
/// it does not.
///
/// Reference: verl `compute_rollout_rejection_mask` (its values, tested with several options).
///
/// # Errors
/// [`LossError::InvalidConfig`] naming `rules` when it is empty, or the field of a bad rule; the
/// tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{rollout_rejection_mask, rollout_rejection_mask_all, Rejection, RejectionScope};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0, -1.0]]);
/// let logp_rollout = Tensor::from_slice2(&[[-1.0f64, -1.1, -2.0]]); // the last token far off
/// let mask = Tensor::from_slice2(&[[true, true, true]]);
/// let token = Rejection::k2(RejectionScope::Token, 0.1);
/// let seq = Rejection::k3(RejectionScope::SequenceMax, 0.2);
/// // verl's combination: the sequence's worst token fails the sequence rule, the row goes.
/// let both = rollout_rejection_mask_all(&logp, &logp_rollout, &mask, &[token, seq])?;
/// assert_eq!(Vec::<bool>::try_from(&both.flatten(0, -1))?, vec![false, false, false]);
/// // Chained, the sequence rule no longer sees the token the first rule dropped.
/// let first = rollout_rejection_mask(&logp, &logp_rollout, &mask, &token)?;
/// let chained = rollout_rejection_mask(&logp, &logp_rollout, &first, &seq)?;
/// assert_eq!(Vec::<bool>::try_from(&chained.flatten(0, -1))?, vec![true, true, false]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rollout_rejection_mask_all(
    logp: &Tensor,
    logp_rollout: &Tensor,
    mask: &Tensor,
    rules: &[Rejection],
) -> Result<Tensor, LossError> {
    if rules.is_empty() {
        return Err(LossError::InvalidConfig {
            field: "rules",
            value: 0.0,
            reason: "at least one rejection rule is needed".into(),
        });
    }
    for rule in rules {
        rule.validate()?;
    }
    let x = check(&validate::detached(logp, "logp")?, logp_rollout, mask, Checks::Full)?;
    let mut kept = x.mask.shallow_clone();
    for rule in rules {
        kept = kept.f_logical_and(&rule_keeps(&x, rule)?)?;
    }
    Ok(kept)
}

/// What one rule keeps (broadcast over the tokens for a sequence rule), its statistic over the
/// tokens of `x`'s mask.
fn rule_keeps(x: &TokenInputs, rule: &Rejection) -> Result<Tensor, LossError> {
    let d = x.delta.f_clamp(-rule.max_log_ratio, rule.max_log_ratio)?;
    let s = match rule.divergence {
        Divergence::K1 => d.f_neg()?,
        Divergence::K2 => d.f_square()?.f_mul_scalar(0.5)?,
        Divergence::K3 => d.f_exp()?.f_sub_scalar(1.0)?.f_sub(&d)?,
    };
    let s = masked_fill_zero(&s, &x.mask)?;
    let stat = match rule.scope {
        RejectionScope::Token => s,
        RejectionScope::SequenceSum => s.f_sum_dim_intlist(1, true, None::<Kind>)?,
        RejectionScope::SequenceMean => {
            s.f_sum_dim_intlist(1, true, None::<Kind>)?.f_div(&x.lengths.f_clamp_min(1.0)?.f_unsqueeze(1)?)?
        }
        // Statistics are ≥ 0 for K2 and K3 and padding holds 0, so the max over the row is the
        // max over its tokens (0 for an empty row, as verl).
        RejectionScope::SequenceMax => s.f_amax(&[1i64][..], true)?,
    };
    Ok(match rule.divergence {
        Divergence::K1 => stat.f_ge(rule.min.ln())?.f_logical_and(&stat.f_le(rule.max.ln())?)?,
        Divergence::K2 | Divergence::K3 => stat.f_le(rule.max)?,
    })
}

/// DeepSeek-V3.2's off-policy sequence mask: drop a sequence with a negative advantage whose
/// policy has moved too far from the sampler's.
///
/// ```text
/// kl_i  = (1/L_i) Σ_t m (log μ_t − log π_t)            (π the current policy, detached)
/// keep_i = A_i ≥ 0  ∨  kl_i ≤ threshold
/// mask' = mask ∧ keep
/// ```
///
/// Negatives that the policy already finds unlikely carry little information and the largest
/// off-policy risk; positives are always kept.
///
/// Reference: DeepSeek-AI, *DeepSeek-V3.2*, arXiv 2512.02556 (off-policy sequence masking); TRL
/// `GRPOConfig.off_policy_mask_threshold` (its values, restated in the tests).
///
/// # Arguments
/// * `logp` — `[B, T]`, the current policy's log-probs (detached here).
/// * `logp_rollout` — `[B, T]`, the sampler's.
/// * `advantages` — `[B]`.
/// * `mask` — `[B, T]`.
/// * `threshold` — finite.
///
/// # Errors
/// [`LossError::InvalidArgument`] for a non-finite threshold; the tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::off_policy_sequence_mask;
/// let logp = Tensor::from_slice2(&[[-3.0f64, -3.0], [-3.0, -3.0], [-1.0, -1.0]]);
/// let logp_rollout = Tensor::from_slice2(&[[-1.0f64, -1.0], [-1.0, -1.0], [-1.0, -1.0]]);
/// let adv = Tensor::from_slice(&[1.0f64, -1.0, -1.0]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, true], [true, true]]);
/// let kept = off_policy_sequence_mask(&logp, &logp_rollout, &adv, &mask, 0.5)?;
/// // The positive is kept; the negative whose mean k1 is 2 > 0.5 is dropped; the on-policy one kept.
/// assert_eq!(Vec::<bool>::try_from(&kept.flatten(0, -1))?, vec![true, true, false, false, true, true]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn off_policy_sequence_mask(
    logp: &Tensor,
    logp_rollout: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    threshold: f64,
) -> Result<Tensor, LossError> {
    if !threshold.is_finite() {
        return Err(LossError::InvalidArgument {
            argument: "threshold",
            value: threshold,
            reason: "the KL threshold must be finite".into(),
        });
    }
    let x = token_inputs::check(TokenArgs {
        logp: &validate::detached(logp, "logp")?,
        other: (logp_rollout, "logp_rollout"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: false,
        checks: Checks::Full,
    })?;
    let kl = x.mean_delta()?.f_neg()?; // [B]
    let keep = x.weights().f_ge(0.0)?.f_logical_or(&kl.f_le(threshold)?)?;
    Ok(x.mask.f_logical_and(&keep.f_unsqueeze(1)?)?)
}
