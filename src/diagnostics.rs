//! What a trainer logs next to a TOPR loss: how many samples are negative, how often the
//! truncation bites in each branch, the importance weights actually applied, and the effective
//! proportion of positives.
//!
//! They come from the same pass as the loss ([`crate::topr_loss_output`],
//! [`crate::topr_token_loss_output`]), stay on the device until read (one host read), and use the
//! same log-space quantities as the loss, so they are finite wherever the loss is (a weight may
//! be `inf` only with an infinite upper limit).

use crate::error::LossError;
use crate::output::{OnDevice, diagnostics_struct, stats};
use crate::topr_config::{ToprConfig, branch_clamp};
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
/// use topr_loss::{topr_loss_output, Normalizer, ToprConfig};
/// let lp = Tensor::from_slice(&[-1.0f32, -2.0]);
/// let rewards = Tensor::from_slice(&[1.0f32, -1.0]);
/// let d = topr_loss_output(&lp, &lp, &rewards, &ToprConfig::tis(), &Normalizer::local())?.diagnostics.read()?;
/// assert_eq!((d.samples, d.log_ratio_mean, d.weight_mean), (2, 0.0, 1.0)); // on-policy
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
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

diagnostics_struct!(ToprDiagnostics {
    samples,
    negative_fraction,
    truncated_fraction_pos,
    truncated_fraction_neg,
    weight_min,
    weight_mean,
    weight_max,
    log_ratio_mean,
    effective_positive_proportion,
});

/// Statistics over the entries of `s` where `valid`, with branch mask and `R'` broadcast to `s`,
/// as device tensors in [`ToprDiagnostics`] order: no host read.
pub(crate) fn topr_diagnostics(
    s: &Tensor,
    r_prime: &Tensor,
    positive: &Tensor,
    valid: &Tensor,
    cfg: &ToprConfig,
) -> Result<OnDevice<ToprDiagnostics>, LossError> {
    let s = s.f_detach()?.f_to_kind(Kind::Double)?;
    let shape = s.size();
    let expand = |t: &Tensor| t.f_expand(shape.as_slice(), false);
    let valid = expand(valid)?;
    let positive = expand(positive)?.f_logical_and(&valid)?;
    let negative = positive.f_logical_not()?.f_logical_and(&valid)?;
    let r_prime = expand(&r_prime.f_detach()?.f_to_kind(Kind::Double)?)?;

    // The weight applied, [ρ]_a^b = on · exp(clamp(ln ρ, ln a, ln b)); a ratio is truncated when
    // the clamp moved it, or when its branch is switched off (b = 0).
    let (d, on) = branch_clamp(&s, &positive, cfg)?;
    let w = d.f_exp()?.f_mul(&on)?;
    let cut = d.f_ne_tensor(&s)?.f_logical_or(&on.f_eq(0.0)?)?;

    let samples = stats::count(&valid)?;
    let (weight_min, weight_max) = stats::min_max_where(&w, &valid)?;
    let pos_weight = stats::sum_where(&r_prime.f_clamp_min(0.0)?, &valid)?;
    let total_weight = stats::sum_where(&r_prime.f_abs()?, &valid)?;
    // NaN (read as None) when every R' = 0.
    let nan = Tensor::f_scalar_tensor(f64::NAN, (Kind::Double, s.device()))?;
    let epp = pos_weight.f_div(&total_weight)?.f_where_self(&total_weight.f_gt(0.0)?, &nan)?;
    OnDevice::new(&[
        samples.shallow_clone(),
        stats::share(&stats::count(&negative)?, &samples)?,
        stats::share(&stats::count(&cut.f_logical_and(&positive)?)?, &stats::count(&positive)?)?,
        stats::share(&stats::count(&cut.f_logical_and(&negative)?)?, &stats::count(&negative)?)?,
        weight_min,
        stats::mean_where(&w, &valid)?,
        weight_max,
        stats::mean_where(&s, &valid)?,
        epp,
    ])
}
