//! Importance ratios in log space: truncation `[x]_a^b` and the taper `T(x; a, b)`.
//!
//! Every objective of the off-policy REINFORCE family weights a sample by a truncated importance
//! ratio `[π/μ]_a^b`. The taper is the function whose derivative produces that weight:
//!
//! ```text
//! T(x; a, b) = a (1 + ln(x/a))   if x < a
//!            = x                 if a ≤ x ≤ b
//!            = b (1 + ln(x/b))   if x > b
//!
//! x · T'(x) = [x]_a^b,  so  ∇ T(π/μ) = [π/μ]_a^b ∇ log π
//! ```
//!
//! Both are computed from `δ = ln x = log π − log μ` without ever exponentiating an unbounded
//! value: with `d = clamp(δ, ln a, ln b)`,
//!
//! ```text
//! [x]_a^b    = exp(d)
//! T(x; a, b) = exp(d) · (1 + δ − d)
//! ```
//!
//! which is exactly the three branches above, bounded by `b` and linear in `δ` outside `[ln a, ln b]`.
//! Only an infinite upper limit (`b = ∞`, plain importance sampling) leaves `exp(δ)` unbounded.
//!
//! Reference: Le Roux, Bellemare et al., *Tapered Off-Policy REINFORCE*, arXiv 2503.14286, §3.

use crate::error::LossError;
use crate::validate;
use num_traits::Float;
use tch::Tensor;

/// `d = clamp(δ, ln a, ln b)`, skipping a bound that is `−∞` (`a = 0`) or `+∞` (`b = ∞`).
fn clamp_log(delta: &Tensor, a: f64, b: f64) -> Result<Tensor, LossError> {
    let lo = (a > 0.0).then(|| a.ln());
    let hi = b.is_finite().then(|| b.ln());
    Ok(match (lo, hi) {
        (Some(lo), Some(hi)) => delta.f_clamp(lo, hi)?,
        (Some(lo), None) => delta.f_clamp_min(lo)?,
        (None, Some(hi)) => delta.f_clamp_max(hi)?,
        (None, None) => delta.shallow_clone(),
    })
}

/// The truncated importance weight `[exp(δ)]_a^b`, computed as `exp(clamp(δ, ln a, ln b))`.
///
/// ```text
/// w = [x]_a^b = min(max(x, a), b),   x = exp(δ)
/// ```
///
/// The result is detached from the graph: it is the weight that the off-policy REINFORCE family
/// holds constant (`sg(·)`). It is finite for every finite `δ` when `b` is finite; with `b = ∞`
/// it overflows to `inf` once `δ` exceeds the dtype's range (about 88.7 in f32).
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286, eq. for the TOPR gradient.
///
/// # Arguments
/// * `delta` — log-ratios `log π − log μ`, any shape, floating dtype.
/// * `a`, `b` — the limits, `0 ≤ a ≤ b ≤ ∞`, `a` finite.
///
/// # Errors
/// [`LossError::InvalidConfig`] for NaN, negative or crossed limits; [`LossError::WrongDtype`] or
/// [`LossError::UnsupportedTensor`] for a tensor this crate cannot compute with.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::truncated_weight;
///
/// let delta = Tensor::from_slice(&[-1.0e4f64, 0.0, 2.0f64.ln(), 1.0e4]);
/// let w = truncated_weight(&delta, 0.0, 1.0)?; // truncated IS: [x]_0^1
/// assert_eq!(Vec::<f64>::try_from(&w)?, vec![0.0, 1.0, 1.0, 1.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn truncated_weight(delta: &Tensor, a: f64, b: f64) -> Result<Tensor, LossError> {
    validate::float_tensor(delta, "delta")?;
    validate::limits(a, b, "a", "b")?;
    let delta = delta.f_detach()?;
    if b == 0.0 {
        return Ok(delta.f_zeros_like()?);
    }
    Ok(clamp_log(&delta, a, b)?.f_exp()?)
}

/// The taper `T(exp(δ); a, b)`, differentiable, with `dT/dδ = [exp(δ)]_a^b`.
///
/// ```text
/// T = a (1 + δ − ln a)   if δ < ln a
///   = exp(δ)             if ln a ≤ δ ≤ ln b
///   = b (1 + δ − ln b)   if δ > ln b
///   = exp(d) (1 + δ − d),  d = clamp(δ, ln a, ln b)     (how it is computed)
/// ```
///
/// Properties: `T` is C¹ in `δ`; `T(x) ≤ x` with equality on `[a, b]`; `T(x; 1, 1) = 1 + ln x`;
/// `a = b = 0` gives `T ≡ 0` (with zero gradient). The gradient flows into `delta` only: to hold
/// `log μ` constant, detach it before forming `delta`.
///
/// Reference: Le Roux, Bellemare et al., *Tapered Off-Policy REINFORCE*, arXiv 2503.14286, §3.
///
/// # Arguments
/// * `delta` — log-ratios, any shape, floating dtype; the result has the same shape and dtype.
/// * `a`, `b` — the limits, `0 ≤ a ≤ b ≤ ∞`, `a` finite.
///
/// # Errors
/// As [`truncated_weight`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::taper;
///
/// // With a = b = 1 the taper is 1 + ln x = 1 + δ: linear in the log-probability (SFT).
/// let delta = Tensor::from_slice(&[-3.0f64, 0.0, 5.0]).set_requires_grad(true);
/// let t = taper(&delta, 1.0, 1.0)?;
/// assert_eq!(Vec::<f64>::try_from(&t)?, vec![-2.0, 1.0, 6.0]);
/// t.sum(None).backward();
/// assert_eq!(Vec::<f64>::try_from(&delta.grad())?, vec![1.0, 1.0, 1.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn taper(delta: &Tensor, a: f64, b: f64) -> Result<Tensor, LossError> {
    validate::float_tensor(delta, "delta")?;
    validate::limits(a, b, "a", "b")?;
    taper_unchecked(delta, a, b)
}

/// [`taper`] without argument checks, for callers that validated already.
pub(crate) fn taper_unchecked(delta: &Tensor, a: f64, b: f64) -> Result<Tensor, LossError> {
    if b == 0.0 {
        // T ≡ 0; multiplying keeps `delta` in the graph (with zero gradient) so that a batch made
        // only of such rows still yields a loss one can call backward() on.
        return Ok(delta.f_mul_scalar(0.0)?);
    }
    taper_from_clamped(delta, &clamp_log(delta, a, b)?)
}

/// `T = exp(d) (1 + δ − d)` from `δ` and `d = clamp(δ, ln a, ln b)`.
pub(crate) fn taper_from_clamped(delta: &Tensor, d: &Tensor) -> Result<Tensor, LossError> {
    let slope = delta.f_sub(d)?.f_add_scalar(1.0)?; // 1 + δ − d
    Ok(d.f_exp()?.f_mul(&slope)?)
}

/// The taper `T(exp(δ); a, b)` on one scalar, in log space, for any float type.
///
/// The same function as [`taper`], for plotting, logging and tests of callers.
///
/// ```text
/// T = exp(d) (1 + δ − d),   d = clamp(δ, ln a, ln b)
/// ```
///
/// Returns NaN when a limit is NaN, negative or `a > b` (it does not validate).
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286, §3.
///
/// # Example
/// ```
/// use topr_loss::taper_scalar;
///
/// // Above b = 1 the taper grows like 1 + ln x instead of x.
/// let t: f64 = taper_scalar(10.0f64.ln(), 0.0, 1.0);
/// assert!((t - (1.0 + 10.0f64.ln())).abs() < 1e-12);
/// // T(x) ≤ x everywhere.
/// assert!(taper_scalar(-3.0f64, 1.0, 1.0) <= (-3.0f64).exp());
/// ```
pub fn taper_scalar<F: Float>(delta: F, a: F, b: F) -> F {
    if !a.is_finite() || b.is_nan() || a < F::zero() || a > b {
        return F::nan();
    }
    if b == F::zero() {
        return F::zero();
    }
    let d = delta.max(a.ln()).min(b.ln());
    d.exp() * (F::one() + delta - d)
}
