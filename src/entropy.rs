//! The policy's entropy in a loss: as a bonus term, and as a selector of the tokens a policy loss
//! trains on.
//!
//! Both take the per-token entropies `H [B, T]` of the policy's next-token distributions, which
//! [`crate::token_logprobs`] returns with `LogProbConfig::with_entropy(true)` (differentiable
//! through the logits).
//!
//! ```text
//! entropy bonus      loss = −coef · aggregate(H, mask)               (added to a policy loss)
//! top-entropy mask   keep the unmasked tokens with H ≥ q_{1−ρ}, the (1 − ρ)-quantile of the
//!                    batch's unmasked entropies: about the highest-entropy share ρ
//! ```

use crate::aggregate::{AggregationMode, Normalizer, masked_fill_zero, sequence_weights_checked, weighted_sum};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct, stats};
use crate::validate::{self, FiniteCheck};
use tch::{Kind, Tensor};

/// Coefficient, aggregation and checks of [`entropy_loss`].
///
/// `Default` ([`EntropyConfig::bonus`]): `coef = 0.001`, token-mean. verl 0.9.1's
/// `actor.entropy_coeff` defaults to 0 (no bonus); 0.001 was its earlier default.
///
/// Reference: Williams & Peng (1991), entropy regularisation; Mnih et al., arXiv 1602.01783 (A3C);
/// verl `actor.entropy_coeff` with `agg_loss` over `loss_agg_mode`.
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, EntropyConfig};
/// let cfg = EntropyConfig::default();
/// assert_eq!((cfg.coef, cfg.aggregation), (0.001, AggregationMode::TokenMean));
/// assert!(cfg.with_coef(f64::INFINITY).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct EntropyConfig {
    /// The coefficient (finite; positive rewards entropy, negative penalises it).
    pub coef: f64,
    /// How per-token entropies are reduced (use the policy loss's mode and [`Normalizer`]).
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for EntropyConfig {
    fn default() -> Self {
        Self::bonus()
    }
}

impl EntropyConfig {
    /// An entropy bonus of 0.001, token-mean.
    ///
    /// ```
    /// assert_eq!(topr_loss::EntropyConfig::bonus(), topr_loss::EntropyConfig::default());
    /// ```
    pub const fn bonus() -> Self {
        Self { coef: 0.001, aggregation: AggregationMode::TokenMean, checks: Checks::Full }
    }

    /// The same config with another coefficient.
    ///
    /// ```
    /// assert_eq!(topr_loss::EntropyConfig::bonus().with_coef(0.01).coef, 0.01);
    /// ```
    pub const fn with_coef(self, coef: f64) -> Self {
        Self { coef, ..self }
    }

    crate::setters::setters!(EntropyConfig, bonus(); checks, aggregation);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] for a non-finite `coef`.
    ///
    /// ```
    /// assert!(topr_loss::EntropyConfig::bonus().with_coef(f64::NAN).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        validate::finite_field(self.coef, "coef")
    }
}

/// The checked entropies in the compute dtype with padding replaced by zero, and the bool mask.
fn check_entropy(entropy: &Tensor, mask: &Tensor, checks: Checks) -> Result<(Tensor, Tensor, Kind), LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(entropy, "entropy")?]);
    let shape = validate::rank(entropy, "entropy", 2, "[B, T] per-token entropies")?;
    validate::non_empty(&shape, "entropy", "sequence")?;
    let m = validate::bool_mask_with(mask, "mask", checks)?;
    validate::same_shape(&m, "mask", &shape, "the shape of `entropy`")?;
    validate::same_device(&m, "mask", entropy.device(), "entropy")?;
    let clean = masked_fill_zero(&entropy.f_to_kind(kind)?, &m)?;
    if checks.values() {
        validate::all_finite(&[FiniteCheck {
            clean: &clean,
            original: entropy,
            argument: "entropy",
            valid: Some(&m),
            also: None,
        }])?;
    }
    Ok((clean, m, kind))
}

/// The entropy bonus as a loss term: minus the coefficient times the aggregated entropy.
///
/// ```text
/// loss = −coef · Σ_i α_i Σ_t m_{i,t} H_{i,t}        (α from the aggregation and the normaliser)
/// ```
///
/// Add it to a policy loss built with the same mask, aggregation and counts. With
/// [`Normalizer`] global counts (via [`entropy_loss_output`]) it is split-invariant like the
/// policy losses.
///
/// Reference: Mnih et al., arXiv 1602.01783 (entropy regularisation); verl `actor.entropy_coeff`
/// (`policy_loss -= entropy_coeff * agg_loss(entropy, response_mask, loss_agg_mode)`).
///
/// # Arguments
/// * `entropy` — `[B, T]` per-token entropies (differentiable, e.g. from [`crate::token_logprobs`]).
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`], naming
/// `entropy` and `mask`; [`LossError::NonFiniteLoss`] if the result overflows.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{entropy_loss, EntropyConfig};
///
/// let h = Tensor::from_slice2(&[[0.5f64, 1.5, f64::NAN]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let loss = entropy_loss(&h, &mask, &EntropyConfig::bonus().with_coef(0.1))?;
/// assert!((loss.double_value(&[]) + 0.1).abs() < 1e-12); // −0.1 · (0.5 + 1.5)/2
/// loss.backward();
/// assert_eq!(Vec::<f64>::try_from(&h.grad().flatten(0, -1))?, vec![-0.05, -0.05, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn entropy_loss(entropy: &Tensor, mask: &Tensor, cfg: &EntropyConfig) -> Result<Tensor, LossError> {
    Ok(entropy_loss_output(entropy, mask, cfg, &Normalizer::local())?.loss)
}

/// [`entropy_loss`] with the counts of `norm`, its per-token terms `−coef · H` (`[B, T]`, zero on
/// padding) and its [`EntropyDiagnostics`].
///
/// Reference: as [`entropy_loss`].
///
/// # Errors
/// As [`entropy_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{entropy_loss_output, EntropyConfig, Normalizer};
/// let h = Tensor::from_slice2(&[[0.5f64, 1.5], [1.0, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, false]]);
/// let out = entropy_loss_output(&h, &mask, &EntropyConfig::bonus(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.tokens, d.entropy_mean, d.entropy_min, d.entropy_max), (3, 1.0, 0.5, 1.5));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn entropy_loss_output(
    entropy: &Tensor,
    mask: &Tensor,
    cfg: &EntropyConfig,
    norm: &Normalizer,
) -> Result<LossOutput<EntropyDiagnostics>, LossError> {
    cfg.validate()?;
    let (h, m, kind) = check_entropy(entropy, mask, cfg.checks)?;
    let alpha = sequence_weights_checked(&m, cfg.aggregation, norm, kind, cfg.checks)?;
    let terms = h.f_mul_scalar(-cfg.coef)?;
    let loss = validate::finite_loss(weighted_sum(&terms, &alpha)?, cfg.checks)?;
    let (min, max) = stats::min_max_where(&h, &m)?;
    let diagnostics = OnDevice::new(&[stats::count(&m)?, stats::mean_where(&h, &m)?, min, max])?;
    Ok(LossOutput { loss, terms, diagnostics })
}

/// What a trainer logs next to an entropy bonus, from the same pass ([`entropy_loss_output`]).
///
/// ```text
/// entropy_mean / min / max = statistics of H over the unmasked tokens (before coef)
/// ```
///
/// Reference: verl's `actor/entropy` metric.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{entropy_loss_output, EntropyConfig, Normalizer};
/// let h = Tensor::from_slice2(&[[2.0f64, 4.0]]);
/// let d = entropy_loss_output(&h, &h.ones_like(), &EntropyConfig::bonus(), &Normalizer::local())?.diagnostics.read()?;
/// assert_eq!((d.tokens, d.entropy_mean), (2, 3.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct EntropyDiagnostics {
    /// Number of unmasked tokens in this call.
    pub tokens: i64,
    /// Mean entropy over them.
    pub entropy_mean: f64,
    /// Smallest entropy over them (0 when there is none).
    pub entropy_min: f64,
    /// Largest entropy over them (0 when there is none).
    pub entropy_max: f64,
}

diagnostics_struct!(EntropyDiagnostics { tokens, entropy_mean, entropy_min, entropy_max });

/// The mask of the highest-entropy tokens: the unmasked tokens whose entropy is at least the
/// `(1 − ρ)`-quantile of the batch's unmasked entropies ("forking tokens").
///
/// ```text
/// H_(0) ≤ … ≤ H_(N−1)   the N unmasked entropies, sorted
/// p  = (1 − ρ)(N − 1),   q = H_(⌊p⌋) + (p − ⌊p⌋)(H_(⌈p⌉) − H_(⌊p⌋))      (linear interpolation)
/// keep_t = m_t ∧ (H_t ≥ q)
/// ```
///
/// **Count and ties.** With distinct entropies this keeps `⌊ρ (N − 1)⌋ + 1` tokens: `⌈ρ N⌉` in
/// most cases (e.g. 2 of 10, 3 of 11 at ρ = 0.2), one fewer when the fractional part of `ρ N` is
/// below ρ (1 of 4 at ρ = 0.3), always at least 1 (ρ = 0 keeps the maximum), all at ρ = 1. Tokens
/// tied at the quantile are all kept, so ties can add more. The quantile is over this call's
/// tokens: a mask computed per micro-batch differs from one over the whole batch (compute it on
/// the concatenated entropies to select over the batch). The mask carries no gradient.
///
/// Use it as the `mask` of a policy loss (train on the high-entropy tokens only) with the
/// aggregation counting the kept tokens, or multiply the per-token terms of a `…_output` by it and
/// keep the full mask for the counts, as TRL does.
///
/// Reference: Wang et al., *Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
/// Reinforcement Learning for LLM Reasoning*, arXiv 2506.01939 (ρ = 0.2); TRL
/// `top_entropy_quantile=ρ` (`GRPOTrainer.get_high_entropy_mask`, the rule above, computed in
/// f32). verl 0.9.1 has no such option.
///
/// # Arguments
/// * `entropy` — `[B, T]` per-token entropies (padding may hold anything).
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
/// * `rho` — the share to keep, in `[0, 1]`.
/// * `checks` — [`Checks::Full`] checks the unmasked entropies for NaN and inf (one host read);
///   [`Checks::Shapes`] reads nothing back. An empty mask gives an all-false mask either way.
///
/// # Returns
/// A `[B, T]` bool tensor, false on padding.
///
/// # Errors
/// [`LossError::InvalidArgument`] for `rho` outside `[0, 1]`; the tensor checks of [`LossError`],
/// naming `entropy` and `mask`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{top_entropy_mask, Checks};
///
/// let h = Tensor::from_slice2(&[[0.1f64, 2.0, 0.3, 0.2, 0.5], [0.9, 0.4, 1.5, 0.7, 9.0]]);
/// let mask = Tensor::from_slice2(&[[1i64, 1, 1, 1, 1], [1, 1, 1, 1, 0]]);
/// let keep = top_entropy_mask(&h, &mask, 0.2, Checks::Full)?;
/// // N = 9: p = 0.8 · 8 = 6.4, the two highest entropies (2.0 and 1.5); the 9.0 is padding.
/// assert_eq!(Vec::<bool>::try_from(&keep.flatten(0, -1))?, vec![false, true, false, false, false, false, false, true, false, false]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn top_entropy_mask(entropy: &Tensor, mask: &Tensor, rho: f64, checks: Checks) -> Result<Tensor, LossError> {
    if !(0.0..=1.0).contains(&rho) {
        return Err(LossError::InvalidArgument {
            argument: "rho",
            value: rho,
            reason: "the share of tokens to keep must lie in [0, 1] (the paper uses 0.2)".into(),
        });
    }
    let (_, m, kind) = check_entropy(entropy, mask, checks)?;
    let h = entropy.f_detach()?.f_to_kind(kind)?;
    // Padding sorts last; the N unmasked entropies come first, ascending.
    let (sorted, _) = h.f_where_self(&m, &h.f_full_like(f64::INFINITY)?)?.f_flatten(0, -1)?.f_sort(0, false)?;
    let n = m.f_sum(kind)?;
    let rank = n.f_sub_scalar(1.0)?.f_clamp_min(0.0)?.f_mul_scalar(1.0 - rho)?;
    let below = rank.f_floor()?;
    let weight = rank.f_sub(&below)?;
    let at = |i: &Tensor| -> Result<Tensor, LossError> {
        Ok(sorted.f_gather(0, &i.f_to_kind(Kind::Int64)?.f_reshape([1])?, false)?)
    };
    let q = at(&below)?.f_lerp_tensor(&at(&rank.f_ceil()?)?, &weight.f_reshape([1])?)?;
    Ok(h.f_ge_tensor(&q)?.f_logical_and(&m)?)
}
