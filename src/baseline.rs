//! The baseline `c` as a knob on how much weight positive examples carry.
//!
//! With rewards `±1` and a baseline `c ∈ [−1, 1]`, a positive's shifted reward is `1 − c` and a
//! negative's `−(1 + c)`. If a share `p` of the samples is positive, the share of the total
//! weight `Σ|R − c|` that positives carry, the *effective positive proportion*, is
//!
//! ```text
//! p̃ = p (1 − c) / (1 + (1 − 2p) c)          c = (p − p̃) / (p + p̃ − 2 p p̃)
//! ```
//!
//! `c = 0` keeps `p̃ = p`; `c = −1` gives `p̃ = 1` (dropping the negatives, SFT). The paper finds
//! that GSM8K accuracy peaks around `p̃ ≈ 10–20 %` whatever the data set's own `p`. For general
//! rewards the same share is measured directly: `p̃ = Σ_{R>c} (R − c) / Σ |R − c|`.
//!
//! Reference: Le Roux, Bellemare et al., arXiv 2503.14286, §4 (effective proportion of positives).

use crate::error::LossError;
use crate::validate;
use tch::Tensor;

fn proportion(v: f64, argument: &'static str) -> Result<(), LossError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(LossError::InvalidArgument {
            argument,
            value: v,
            reason: "a proportion must lie in [0, 1]".into(),
        });
    }
    Ok(())
}

/// The share of the total weight carried by positives, for rewards `±1`, a share `p` of
/// positives and a baseline `c`.
///
/// ```text
/// p̃ = p (1 − c) / (1 + (1 − 2p) c)
/// ```
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286, §4.
///
/// # Errors
/// [`LossError::InvalidArgument`] when `p ∉ [0, 1]`, `c ∉ [−1, 1]`, either is NaN, or when the
/// total weight vanishes (`p = 1, c = 1`: only positives, each weighing 0; `p = 0, c = −1`:
/// only negatives, each weighing 0).
///
/// # Example
/// ```
/// use topr_loss::effective_positive_proportion;
/// assert!((effective_positive_proportion(0.1, -0.8)? - 0.5).abs() < 1e-12);
/// assert!((effective_positive_proportion(0.5, 0.6)? - 0.2).abs() < 1e-12);
/// assert_eq!(effective_positive_proportion(0.3, -1.0)?, 1.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn effective_positive_proportion(p: f64, c: f64) -> Result<f64, LossError> {
    proportion(p, "p")?;
    if !(-1.0..=1.0).contains(&c) {
        return Err(LossError::InvalidArgument {
            argument: "c",
            value: c,
            reason: "with rewards ±1 the baseline must lie in [-1, 1]; beyond, one class changes sign".into(),
        });
    }
    let denominator = 1.0 + (1.0 - 2.0 * p) * c; // = p(1 − c) + (1 − p)(1 + c) ≥ 0
    if denominator <= 0.0 {
        return Err(LossError::InvalidArgument {
            argument: "c",
            value: c,
            reason: format!("with p = {p} every sample weighs zero, so no proportion is defined"),
        });
    }
    Ok((p * (1.0 - c) / denominator).clamp(0.0, 1.0))
}

/// The baseline that gives positives the share `p_tilde` of the weight when a share `p` of the
/// samples is positive (rewards `±1`): the inverse of [`effective_positive_proportion`].
///
/// ```text
/// c = (p − p̃) / (p + p̃ − 2 p p̃)
/// ```
///
/// `p = p̃` returns `c = 0`.
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286, §4.
///
/// # Errors
/// [`LossError::InvalidArgument`] when an argument is outside `[0, 1]` or NaN, or when no
/// baseline reaches `p̃` (`p = 0` with `p̃ > 0`: there are no positives to weigh; `p = 1` with
/// `p̃ < 1`: there are no negatives).
///
/// # Example
/// ```
/// use topr_loss::{baseline_for_effective_proportion, effective_positive_proportion};
/// let c = baseline_for_effective_proportion(0.1, 0.5)?;
/// assert!((c + 0.8).abs() < 1e-12);
/// assert!((effective_positive_proportion(0.1, c)? - 0.5).abs() < 1e-12);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn baseline_for_effective_proportion(p: f64, p_tilde: f64) -> Result<f64, LossError> {
    proportion(p, "p")?;
    proportion(p_tilde, "p_tilde")?;
    if p == p_tilde {
        return Ok(0.0);
    }
    if p == 0.0 || p == 1.0 {
        return Err(LossError::InvalidArgument {
            argument: "p_tilde",
            value: p_tilde,
            reason: format!("with p = {p} every sample has the same sign, so no baseline changes their share"),
        });
    }
    let c = (p - p_tilde) / (p + p_tilde - 2.0 * p * p_tilde);
    Ok(c.clamp(-1.0, 1.0))
}

/// Rewards as f64 on the host, checked: a non-empty, finite, floating tensor of any shape.
fn host_rewards(rewards: &Tensor) -> Result<Vec<f64>, LossError> {
    validate::float_tensor(rewards, "rewards")?;
    let shape = rewards.size();
    validate::non_empty(&shape, "rewards", "reward")?;
    validate::finite(rewards, "rewards", None)?;
    crate::checks::read_vec(&rewards.f_detach()?)
}

fn share_of(rewards: &[f64], c: f64) -> Option<f64> {
    let (pos, total) = rewards.iter().fold((0.0, 0.0), |(pos, total), &r| {
        let d = r - c;
        (if d > 0.0 { pos + d } else { pos }, total + d.abs())
    });
    (total > 0.0).then(|| pos / total)
}

/// The effective positive proportion measured on actual rewards: the share of `Σ|R − c|` that
/// the samples with `R > c` carry.
///
/// ```text
/// p̃(c) = Σ_{R_i > c} (R_i − c) / Σ_i |R_i − c|
/// ```
///
/// For rewards `±1` this is [`effective_positive_proportion`] with `p` the share of `+1`.
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286, §4, extended to general rewards.
///
/// # Errors
/// [`LossError::InvalidArgument`] for a non-finite `c` or when every reward equals `c` (no weight
/// at all); the tensor checks of [`LossError`] for `rewards` (any shape, floating, finite,
/// non-empty).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::effective_positive_proportion_of_rewards;
/// let r = Tensor::from_slice(&[1.0f64, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]);
/// let p = effective_positive_proportion_of_rewards(&r, -0.8)?;
/// assert!((p - 0.5).abs() < 1e-12);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn effective_positive_proportion_of_rewards(rewards: &Tensor, c: f64) -> Result<f64, LossError> {
    if !c.is_finite() {
        return Err(LossError::InvalidArgument {
            argument: "c",
            value: c,
            reason: "the baseline must be finite".into(),
        });
    }
    let r = host_rewards(rewards)?;
    share_of(&r, c).ok_or_else(|| LossError::InvalidArgument {
        argument: "c",
        value: c,
        reason: "every reward equals the baseline, so no sample carries any weight".into(),
    })
}

/// The baseline `c` at which the positives of these rewards carry the share `p_tilde` of the
/// weight: the inverse of [`effective_positive_proportion_of_rewards`], found by bisection
/// (`p̃(c)` falls continuously from 1 at `c = min R` to 0 at `c = max R`).
///
/// For rewards `±1` it equals [`baseline_for_effective_proportion`] with the measured `p`.
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286, §4, extended to general rewards.
///
/// # Errors
/// [`LossError::InvalidArgument`] when `p_tilde ∉ [0, 1]` or NaN, or when all rewards are equal
/// (no baseline separates them); the tensor checks for `rewards`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{baseline_for_rewards, effective_positive_proportion_of_rewards};
/// let r = Tensor::from_slice(&[1.0f64, 0.5, 0.0, 0.0, -1.0]);
/// let c = baseline_for_rewards(&r, 0.2)?;
/// assert!((effective_positive_proportion_of_rewards(&r, c)? - 0.2).abs() < 1e-9);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn baseline_for_rewards(rewards: &Tensor, p_tilde: f64) -> Result<f64, LossError> {
    proportion(p_tilde, "p_tilde")?;
    let r = host_rewards(rewards)?;
    let (lo, hi) = r.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    if lo == hi {
        return Err(LossError::InvalidArgument {
            argument: "rewards",
            value: lo,
            reason: "all rewards are equal, so no baseline splits them into positives and negatives".into(),
        });
    }
    // p̃ is continuous and non-increasing on [lo, hi], 1 at lo and 0 at hi.
    let (mut a, mut b) = (lo, hi);
    for _ in 0..200 {
        let mid = 0.5 * (a + b);
        if mid <= a || mid >= b {
            break;
        }
        match share_of(&r, mid) {
            Some(s) if s > p_tilde => a = mid,
            _ => b = mid,
        }
    }
    Ok(0.5 * (a + b))
}
