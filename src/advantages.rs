//! Advantages and baselines computed over groups of completions of the same prompt, and batch
//! whitening.
//!
//! Rewards come as a `[G, K]` tensor: `G` prompts (groups), `K` completions each. With
//! `m_g = (1/K) Σ_k R_{g,k}` and `s_g` the unbiased standard deviation of the group:
//!
//! ```text
//! Grpo { eps }      A = (R − m_g) / (s_g + eps)
//! DrGrpo            A = R − m_g
//! Rloo              A = R − (1/(K−1)) Σ_{j≠k} R_{g,j} = K/(K−1) (R − m_g)
//! AsymRe { shift }  A = R − (m_g + shift)
//! ```

use crate::error::LossError;
use crate::validate;
use tch::{Kind, Tensor};

/// How a group's rewards become advantages.
///
/// Reference: GRPO, Shao et al., arXiv 2402.03300; Dr. GRPO, Liu et al., arXiv 2503.20783; RLOO,
/// Ahmadian et al., arXiv 2402.14740; AsymRE, Arnal et al., arXiv 2506.20520.
///
/// # Example
/// ```
/// use topr_loss::GroupAdvantage;
/// assert_eq!(GroupAdvantage::asymre(), GroupAdvantage::AsymRe { shift: -0.1 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum GroupAdvantage {
    /// `(R − m_g)/(s_g + eps)`, `s_g` the unbiased group standard deviation (as TRL and verl
    /// compute it); a group of one completion gets advantage 0.
    Grpo {
        /// Added to the standard deviation (commonly 1e-6 or 1e-4).
        eps: f64,
    },
    /// `R − m_g`: GRPO without the standard-deviation scaling, which biases towards easy and hard
    /// prompts.
    DrGrpo,
    /// `R − mean of the other K − 1 rewards of the group` (needs `K ≥ 2`).
    Rloo,
    /// `R − (m_g + shift)`: a shifted group baseline; a negative shift (−0.1) weighs positives more.
    AsymRe {
        /// The shift added to the group mean.
        shift: f64,
    },
}

impl GroupAdvantage {
    /// GRPO with `eps = 1e-6`.
    ///
    /// ```
    /// assert_eq!(topr_loss::GroupAdvantage::grpo(), topr_loss::GroupAdvantage::Grpo { eps: 1e-6 });
    /// ```
    pub const fn grpo() -> Self {
        Self::Grpo { eps: 1e-6 }
    }

    /// AsymRE with the shift −0.1 of its paper.
    ///
    /// ```
    /// assert_eq!(topr_loss::GroupAdvantage::asymre(), topr_loss::GroupAdvantage::AsymRe { shift: -0.1 });
    /// ```
    pub const fn asymre() -> Self {
        Self::AsymRe { shift: -0.1 }
    }
}

/// Advantages of `[G, K]` rewards, group by group (see [`GroupAdvantage`] for the formulas).
///
/// Computed in f64 for f64 rewards, else f32; the result is detached (advantages are constants
/// to the policy loss).
///
/// # Errors
/// [`LossError::WrongRank`] unless `rewards` is `[G, K]`; [`LossError::EmptyBatch`];
/// [`LossError::NonFinite`]; [`LossError::InvalidArgument`] for `Rloo` with `K < 2`, or a
/// non-finite or negative `eps`, or a non-finite `shift`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{group_advantages, GroupAdvantage};
///
/// let r = Tensor::from_slice2(&[[1.0f64, 0.0, 0.0, 0.0]]);
/// let a = group_advantages(&r, GroupAdvantage::Rloo)?;
/// assert_eq!(Vec::<f64>::try_from(&a.flatten(0, -1))?, vec![1.0, -1.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0]);
/// let a = group_advantages(&r, GroupAdvantage::DrGrpo)?;
/// assert_eq!(Vec::<f64>::try_from(&a.flatten(0, -1))?, vec![0.75, -0.25, -0.25, -0.25]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn group_advantages(rewards: &Tensor, method: GroupAdvantage) -> Result<Tensor, LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(rewards, "rewards")?]);
    let shape = validate::rank(rewards, "rewards", 2, "[G, K]: G prompts, K completions each")?;
    validate::non_empty(&shape, "rewards", "completion")?;
    validate::finite(rewards, "rewards", None)?;
    let k = shape[1] as f64;
    let r = rewards.f_detach()?.f_to_kind(kind)?;
    let mean = r.f_mean_dim(1, true, None::<Kind>)?; // [G, 1]
    let centred = r.f_sub(&mean)?;
    let bad =
        |argument, value: f64, reason: &str| LossError::InvalidArgument { argument, value, reason: reason.into() };
    Ok(match method {
        GroupAdvantage::Grpo { eps } => {
            if !(eps.is_finite() && eps >= 0.0) {
                return Err(bad("eps", eps, "must be finite and >= 0"));
            }
            // Unbiased std; a group of one has no spread, so its advantages are 0.
            let var = centred.f_square()?.f_sum_dim_intlist(1, true, None::<Kind>)?.f_div_scalar((k - 1.0).max(1.0))?;
            centred.f_div(&var.f_sqrt()?.f_add_scalar(eps)?.f_clamp_min(f64::MIN_POSITIVE)?)?
        }
        GroupAdvantage::DrGrpo => centred,
        GroupAdvantage::Rloo => {
            if shape[1] < 2 {
                return Err(bad("rewards", k, "leave-one-out needs at least 2 completions per group"));
            }
            centred.f_mul_scalar(k / (k - 1.0))?
        }
        GroupAdvantage::AsymRe { shift } => {
            if !shift.is_finite() {
                return Err(bad("shift", shift, "must be finite"));
            }
            centred.f_sub_scalar(shift)?
        }
    })
}

/// Whitens values over a batch: `(x − mean) / sqrt(var + eps)`, mean and unbiased variance taken
/// over the unmasked entries (all entries without a mask). Masked entries come back as 0.
///
/// ```text
/// μ = Σ m x / Σ m      σ² = Σ m (x − μ)² / (Σ m − 1)      x̂ = m (x − μ) / sqrt(σ² + eps)
/// ```
///
/// Reference: the advantage whitening of PPO implementations (verl `masked_whiten`,
/// OpenAI baselines).
///
/// # Arguments
/// * `values` — any shape, floating.
/// * `mask` — `None`, or the shape of `values` (bool, integer or 0/1 floating).
/// * `eps` — `≥ 0`, added to the variance (commonly 1e-8).
///
/// # Errors
/// The tensor checks of [`LossError`]; [`LossError::EmptyBatch`] with fewer than 2 unmasked
/// entries; [`LossError::InvalidArgument`] for a negative or non-finite `eps`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::whiten;
/// let w = whiten(&Tensor::from_slice(&[1.0f64, 2.0, 3.0]), None, 0.0)?;
/// assert_eq!(Vec::<f64>::try_from(&w)?, vec![-1.0, 0.0, 1.0]);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn whiten(values: &Tensor, mask: Option<&Tensor>, eps: f64) -> Result<Tensor, LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(values, "values")?]);
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(LossError::InvalidArgument {
            argument: "eps",
            value: eps,
            reason: "must be finite and >= 0".into(),
        });
    }
    let shape = values.size();
    let m = match mask {
        Some(mask) => {
            let m = validate::bool_mask(mask, "mask")?;
            validate::same_shape(&m, "mask", &shape, "the shape of `values`")?;
            validate::same_device(&m, "mask", values.device(), "values")?;
            m
        }
        None => values.f_ones_like()?.f_to_kind(Kind::Bool)?,
    };
    validate::finite(values, "values", Some(&m))?;
    let count = crate::checks::read_i64(&m.f_sum(Kind::Int64)?, &[])?;
    if count < 2 {
        return Err(LossError::EmptyBatch {
            argument: "values",
            found: shape,
            unit: "pair of unmasked values (a variance needs two)",
        });
    }
    let x = crate::aggregate::masked_fill_zero(&values.f_detach()?.f_to_kind(kind)?, &m)?;
    let mf = m.f_to_kind(kind)?;
    let mean = x.f_sum(None::<Kind>)?.f_div_scalar(count as f64)?;
    let centred = x.f_sub(&mean)?.f_mul(&mf)?;
    let var = centred.f_square()?.f_sum(None::<Kind>)?.f_div_scalar((count - 1) as f64)?;
    let scale = var.f_add_scalar(eps)?.f_sqrt()?.f_clamp_min(f64::MIN_POSITIVE)?;
    Ok(centred.f_div(&scale)?)
}
