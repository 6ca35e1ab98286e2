//! What a trainer logs next to a TOPR loss: how many samples are negative, how often the
//! truncation bites in each branch, the importance weights actually applied, and the effective
//! proportion of positives.
//!
//! The statistics are read back to the host (one device sync); compute them every few steps, not
//! necessarily every step. They use the same log-space quantities as the loss, so they are finite
//! wherever the loss is (a weight may be `inf` only with an infinite upper limit).

use crate::error::LossError;
use crate::topr::{TieRule, ToprConfig, branch_clamp, check_sequence_inputs, positive_branch};
use crate::topr_token::{ToprTokenConfig, check_inputs, level_terms};
use tch::{Kind, Tensor};

/// Batch statistics of the off-policy REINFORCE family, for logging.
///
/// A *sample* is a sequence for sequence-level ratios and an unmasked token for
/// [`crate::RatioLevel::Token`]. With `ρ` the ratio at that level and `w = [ρ]_a^b` the weight
/// applied:
///
/// ```text
/// negative_fraction        = #{R' in the negative branch} / #samples
/// truncated_fraction_pos   = #{positive, ρ ∉ [a+, b+]} / #positive      (0 when no positive)
/// truncated_fraction_neg   = #{negative, ρ ∉ [a−, b−]} / #negative      (0 when no negative)
/// weight_min/mean/max      = statistics of w over all samples
/// log_ratio_mean           = mean of ln ρ
/// effective_positive_proportion = Σ_{R'>0} R' / Σ |R'|                  (None when Σ|R'| = 0)
/// ```
///
/// Reference: the quantities the TOPR paper (arXiv 2503.14286) plots and discusses: effective
/// positive proportion (§4), truncation of the negative branch (§3).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_diagnostics, ToprConfig};
/// let lp = Tensor::from_slice(&[-1.0f32, -2.0]);
/// let d = topr_diagnostics(&lp, &lp, &Tensor::from_slice(&[1.0f32, -1.0]), &ToprConfig::tis())?;
/// assert_eq!((d.samples, d.log_ratio_mean, d.weight_mean), (2, 0.0, 1.0)); // on-policy
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ToprDiagnostics {
    /// Number of samples (sequences, or unmasked tokens at the token level).
    pub samples: i64,
    /// Share of samples in the negative branch.
    pub negative_fraction: f64,
    /// Share of positive-branch samples whose ratio lies outside `[a+, b+]`.
    pub truncated_fraction_pos: f64,
    /// Share of negative-branch samples whose ratio lies outside `[a−, b−]`.
    pub truncated_fraction_neg: f64,
    /// Smallest applied weight `[ρ]_a^b`.
    pub weight_min: f64,
    /// Mean applied weight.
    pub weight_mean: f64,
    /// Largest applied weight.
    pub weight_max: f64,
    /// Mean log-ratio `ln ρ` (0 on-policy).
    pub log_ratio_mean: f64,
    /// Share of `Σ|R − c|` carried by samples with `R − c > 0`; `None` when every `R = c`.
    pub effective_positive_proportion: Option<f64>,
}

/// Statistics over the entries of `s` where `valid`, with branch mask and `R'` broadcast to `s`.
fn diagnose(
    s: &Tensor,
    r_prime: &Tensor,
    positive: &Tensor,
    valid: &Tensor,
    cfg: &ToprConfig,
) -> Result<ToprDiagnostics, LossError> {
    let s = s.f_detach()?.f_to_kind(Kind::Double)?;
    let shape = s.size();
    let expand = |t: &Tensor| t.f_expand(shape.as_slice(), false);
    let valid = expand(valid)?;
    let positive = expand(positive)?.f_logical_and(&valid)?;
    let negative = positive.f_logical_not()?.f_logical_and(&valid)?;
    let r_prime = expand(&r_prime.f_to_kind(Kind::Double)?)?;

    // The weight applied, [ρ]_a^b = on · exp(clamp(ln ρ, ln a, ln b)); a ratio is truncated when
    // the clamp moved it, or when its branch is switched off (b = 0).
    let (d, on) = branch_clamp(&s, &positive, cfg)?;
    let w = d.f_exp()?.f_mul(&on)?;
    let cut = d.f_ne_tensor(&s)?.f_logical_or(&on.f_eq(0.0)?)?;

    let count = |m: &Tensor| -> Result<i64, LossError> { Ok(m.f_sum(Kind::Int64)?.f_int64_value(&[])?) };
    let sum_where = |t: &Tensor, m: &Tensor| -> Result<f64, LossError> {
        Ok(t.f_where_self(m, &t.f_zeros_like()?)?.f_sum(Kind::Double)?.f_double_value(&[])?)
    };
    let ratio = |num: i64, den: i64| if den > 0 { num as f64 / den as f64 } else { 0.0 };

    let samples = count(&valid)?;
    let n_pos = count(&positive)?;
    let n_neg = count(&negative)?;
    let w_valid = w.f_masked_select(&valid)?;
    let (weight_min, weight_max) = if samples > 0 {
        (w_valid.f_min()?.f_double_value(&[])?, w_valid.f_max()?.f_double_value(&[])?)
    } else {
        (0.0, 0.0)
    };
    let pos_weight = sum_where(&r_prime.f_clamp_min(0.0)?, &valid)?;
    let total_weight = sum_where(&r_prime.f_abs()?, &valid)?;
    Ok(ToprDiagnostics {
        samples,
        negative_fraction: ratio(n_neg, samples),
        truncated_fraction_pos: ratio(count(&cut.f_logical_and(&positive)?)?, n_pos),
        truncated_fraction_neg: ratio(count(&cut.f_logical_and(&negative)?)?, n_neg),
        weight_min,
        weight_mean: if samples > 0 { sum_where(&w, &valid)? / samples as f64 } else { 0.0 },
        weight_max,
        log_ratio_mean: if samples > 0 { sum_where(&s, &valid)? / samples as f64 } else { 0.0 },
        effective_positive_proportion: (total_weight > 0.0).then(|| pos_weight / total_weight),
    })
}

/// Diagnostics of [`crate::topr_loss`] on the same inputs (sequence log-probs `[B]`).
///
/// # Errors
/// The same as [`crate::topr_loss`], except [`LossError::Overflow`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_diagnostics, ToprConfig};
///
/// let logp = Tensor::from_slice(&[-1.0f64, -3.0, -2.0, -2.0]);
/// let logp_mu = Tensor::from_slice(&[-2.0f64, -2.0, -2.0, -1.0]);
/// let rewards = Tensor::from_slice(&[1.0f64, 1.0, -1.0, -1.0]);
/// let d = topr_diagnostics(&logp, &logp_mu, &rewards, &ToprConfig::canonical())?;
/// assert_eq!(d.negative_fraction, 0.5);
/// assert_eq!(d.truncated_fraction_pos, 1.0); // ratios e and 1/e are both cut to 1
/// assert_eq!(d.truncated_fraction_neg, 0.0); // ratios 1 and 1/e lie in [0, 1]
/// assert_eq!(d.weight_max, 1.0);
/// assert_eq!(d.effective_positive_proportion, Some(0.5));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn topr_diagnostics(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    cfg: &ToprConfig,
) -> Result<ToprDiagnostics, LossError> {
    cfg.validate()?;
    let x = check_sequence_inputs(logp, logp_mu, rewards)?;
    let r_prime = x.rewards.f_sub_scalar(cfg.baseline)?;
    let positive = positive_branch(&r_prime, TieRule::Positive)?;
    let delta = x.logp.f_sub(&x.logp_mu)?;
    let valid = delta.f_ones_like()?.f_to_kind(Kind::Bool)?;
    diagnose(&delta, &r_prime, &positive, &valid, cfg)
}

/// Diagnostics of [`crate::topr_token_loss`] on the same inputs: per sequence at the sequence
/// ratio levels (sequences with at least one unmasked token), per unmasked token at the token level.
///
/// # Errors
/// The same as [`crate::topr_token_loss`], except [`LossError::Overflow`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_token_diagnostics, ToprTokenConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0], [-1.0, f64::NAN]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.0f64, -1.5], [-0.5, 0.0]]);
/// let mask = Tensor::from_slice2(&[[1i64, 1], [1, 0]]);
/// let rewards = Tensor::from_slice(&[-1.0f64, -1.0]);
/// let d = topr_token_diagnostics(&logp, &logp_mu, &rewards, &mask, &ToprTokenConfig::trinity())?;
/// assert_eq!(d.samples, 3); // three unmasked tokens
/// assert!((d.truncated_fraction_neg - 1.0 / 3.0).abs() < 1e-12); // ratio e^{0.5} > 1 is cut
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn topr_token_diagnostics(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    cfg: &ToprTokenConfig,
) -> Result<ToprDiagnostics, LossError> {
    cfg.topr.validate()?;
    let x = check_inputs(logp, logp_mu, rewards, mask, cfg.ratio)?;
    let r = level_terms(&x, cfg)?;
    let valid = match cfg.ratio {
        crate::RatioLevel::Token => x.mask.shallow_clone(),
        _ => x.has_tokens.f_gt(0.0)?,
    };
    diagnose(&r.s, &r.r_prime, &r.positive, &valid, &cfg.topr)
}
