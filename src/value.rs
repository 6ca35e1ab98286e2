//! PPO's clipped value loss: the critic's squared error, with its new prediction kept within `ε`
//! of the value recorded at rollout time (Schulman et al., arXiv 1707.06347; the clip of OpenAI
//! baselines' PPO2).
//!
//! ```text
//! v_clip = clamp(v, v_old − ε, v_old + ε)
//! ℓ_t    = ½ · max((v_t − R_t)², (v_clip,t − R_t)²)
//! loss   = aggregate(ℓ, mask)
//! ```

use crate::aggregate::{AggregationMode, Normalizer, masked_fill_zero, sequence_weights_checked, weighted_sum};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct, stats};
use crate::validate;
use tch::{Kind, Tensor};

/// Configuration of [`value_loss`].
///
/// `Default` ([`ValueLossConfig::ppo`]): `ε = 0.2`, token-mean.
///
/// Reference: Schulman et al., arXiv 1707.06347; verl `compute_value_loss`
/// (`critic.cliprange_value`, default 0.5 = [`ValueLossConfig::verl`]).
///
/// # Example
/// ```
/// use topr_loss::ValueLossConfig;
/// assert_eq!(ValueLossConfig::default().clip, 0.2);
/// assert!(ValueLossConfig::ppo().with_clip(-1.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct ValueLossConfig {
    /// `ε`: the new value is kept within `v_old ± ε` in the clipped term (`≥ 0`; `∞`: no clip,
    /// the plain squared error).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub clip: f64,
    /// How per-token losses are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for ValueLossConfig {
    fn default() -> Self {
        Self::ppo()
    }
}

impl ValueLossConfig {
    /// `ε = 0.2` (OpenAI baselines' PPO2, TRL's `cliprange_value`), token-mean.
    ///
    /// ```
    /// assert_eq!(topr_loss::ValueLossConfig::ppo(), topr_loss::ValueLossConfig::default());
    /// ```
    pub const fn ppo() -> Self {
        Self { clip: 0.2, aggregation: AggregationMode::TokenMean, checks: Checks::Full }
    }

    /// verl's default `critic.cliprange_value = 0.5`, token-mean (`critic.loss_agg_mode`).
    ///
    /// ```
    /// assert_eq!(topr_loss::ValueLossConfig::verl().clip, 0.5);
    /// ```
    pub const fn verl() -> Self {
        Self::ppo().with_clip(0.5)
    }

    /// The same config with another clip range `ε`.
    ///
    /// ```
    /// assert!(topr_loss::ValueLossConfig::ppo().with_clip(f64::INFINITY).validate().is_ok());
    /// ```
    pub const fn with_clip(self, clip: f64) -> Self {
        Self { clip, ..self }
    }

    crate::setters::setters!(ValueLossConfig, ppo(); checks, aggregation);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming `clip` (negative or NaN).
    ///
    /// ```
    /// assert!(topr_loss::ValueLossConfig::ppo().with_clip(f64::NAN).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if self.clip.is_nan() || self.clip < 0.0 {
            return Err(LossError::InvalidConfig {
                field: "clip",
                value: self.clip,
                reason: "the value clip range must be >= 0 (inf: no clip)".into(),
            });
        }
        Ok(())
    }
}

/// What a trainer logs next to the value loss, from the same pass ([`value_loss_output`]).
///
/// ```text
/// clip_fraction = share of unmasked tokens where the clipped error is the larger
///                 ((v_clip − R)² > (v − R)²: no gradient there; verl's vf_clipfrac)
/// value_mean, return_mean = means of v and R over the unmasked tokens
/// ```
///
/// Reference: verl's `critic/vf_clipfrac`, `critic/vpred_mean`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{value_loss_output, Normalizer, ValueLossConfig};
/// let v = Tensor::from_slice2(&[[1.0f64, 0.0]]);
/// let out = value_loss_output(&v, &v, &v, &v.ones_like(), &ValueLossConfig::ppo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.tokens, d.clip_fraction, d.value_mean), (2, 0.0, 0.5));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct ValueDiagnostics {
    /// Number of unmasked tokens in this call.
    pub tokens: i64,
    /// Share of them where the clipped error decides the loss.
    pub clip_fraction: f64,
    /// Mean prediction `v`.
    pub value_mean: f64,
    /// Mean return `R`.
    pub return_mean: f64,
}

diagnostics_struct!(ValueDiagnostics { tokens, clip_fraction, value_mean, return_mean });

/// PPO's clipped value loss per token, reduced with an [`AggregationMode`].
///
/// ```text
/// v_clip,t = clamp(v_t, v_old,t − ε, v_old,t + ε)
/// ℓ_t      = ½ · max((v_t − R_t)², (v_clip,t − R_t)²)
/// loss     = Σ_i α_i Σ_t m ℓ_t
/// ```
///
/// The gradient is `v_t − R_t` (times `α_i`) where the unclipped error is the larger or equal,
/// and 0 where the clipped one is larger (the prediction has already moved more than `ε` in the
/// direction that lowers its error).
///
/// Reference: Schulman et al., arXiv 1707.06347 (PPO; the value clip is OpenAI baselines'
/// `cliprange_value`); verl 0.9.1 `compute_value_loss` (`critic.cliprange_value`,
/// `critic.loss_agg_mode`).
///
/// # Arguments
/// * `values` — `[B, T]`, the critic's predictions (differentiable; verl's `vpreds`).
/// * `values_old` — `[B, T]`, the values recorded at rollout time (detached).
/// * `returns` — `[B, T]`, the targets, e.g. from [`gae_advantages`](crate::gae_advantages)
///   (detached).
/// * `mask` — `[B, T]`.
///
/// # Errors
/// [`LossError::InvalidConfig`]; the tensor checks of [`LossError`] naming `values`,
/// `values_old`, `returns` or `mask`; [`LossError::NonFiniteLoss`] when the squared errors overflow
/// the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{value_loss, ValueLossConfig};
///
/// let v = Tensor::from_slice2(&[[1.0f64, 0.0]]).set_requires_grad(true);
/// let v_old = Tensor::from_slice2(&[[0.0f64, 0.0]]);
/// let ret = Tensor::from_slice2(&[[2.0f64, 1.0]]);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// // Token 0: max((1 − 2)², (0.2 − 2)²) = 3.24, clipped (no gradient); token 1: 1.
/// let loss = value_loss(&v, &v_old, &ret, &mask, &ValueLossConfig::ppo())?;
/// assert!((loss.double_value(&[]) - 0.5 * (3.24 + 1.0) / 2.0).abs() < 1e-12);
/// loss.backward();
/// assert_eq!(Vec::<f64>::try_from(&v.grad().flatten(0, -1))?, vec![0.0, -0.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn value_loss(
    values: &Tensor,
    values_old: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cfg: &ValueLossConfig,
) -> Result<Tensor, LossError> {
    let p = parts(values, values_old, returns, mask, cfg)?;
    p.reduce(cfg, &Normalizer::local())
}

/// [`value_loss`] with the counts of `norm`, its per-token terms `ℓ_t` (`[B, T]`, zero on
/// padding) and its [`ValueDiagnostics`] from the same pass.
///
/// Reference: as [`value_loss`].
///
/// # Errors
/// As [`value_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{value_loss_output, Normalizer, ValueLossConfig};
///
/// let v = Tensor::from_slice2(&[[1.0f64, 0.0]]);
/// let v_old = Tensor::from_slice2(&[[0.0f64, 0.0]]);
/// let ret = Tensor::from_slice2(&[[2.0f64, 1.0]]);
/// let out = value_loss_output(&v, &v_old, &ret, &v.ones_like(), &ValueLossConfig::ppo(), &Normalizer::local())?;
/// assert_eq!(out.diagnostics.read()?.clip_fraction, 0.5);
/// assert!((out.terms.double_value(&[0, 0]) - 1.62).abs() < 1e-12);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn value_loss_output(
    values: &Tensor,
    values_old: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cfg: &ValueLossConfig,
    norm: &Normalizer,
) -> Result<LossOutput<ValueDiagnostics>, LossError> {
    let p = parts(values, values_old, returns, mask, cfg)?;
    let loss = p.reduce(cfg, norm)?;
    let tokens = stats::count(&p.mask)?;
    let clipped = p.clipped_error.f_gt_tensor(&p.error)?.f_logical_and(&p.mask)?;
    let diagnostics = OnDevice::new(&[
        tokens.shallow_clone(),
        stats::share(&stats::count(&clipped)?, &tokens)?,
        stats::mean_where(&p.values, &p.mask)?,
        stats::mean_where(&p.returns, &p.mask)?,
    ])?;
    Ok(LossOutput { loss, terms: p.per_token, diagnostics })
}

/// The checked inputs and the pieces of the loss.
struct Parts {
    kind: Kind,
    mask: Tensor,
    values: Tensor,
    returns: Tensor,
    /// `(v − R)²`.
    error: Tensor,
    /// `(v_clip − R)²`.
    clipped_error: Tensor,
    /// `ℓ_t`, zero on padding.
    per_token: Tensor,
}

impl Parts {
    fn reduce(&self, cfg: &ValueLossConfig, norm: &Normalizer) -> Result<Tensor, LossError> {
        let alpha = sequence_weights_checked(&self.mask, cfg.aggregation, norm, self.kind, cfg.checks)?;
        validate::finite_loss(weighted_sum(&self.per_token, &alpha)?, cfg.checks)
    }
}

fn parts(
    values: &Tensor,
    values_old: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cfg: &ValueLossConfig,
) -> Result<Parts, LossError> {
    cfg.validate()?;
    let kind = validate::compute_kind(&[
        validate::float_tensor(values, "values")?,
        validate::float_tensor(values_old, "values_old")?,
        validate::float_tensor(returns, "returns")?,
    ]);
    let shape = validate::rank(values, "values", 2, "[B, T] per-token values")?;
    validate::non_empty(&shape, "values", "sequence")?;
    validate::same_shape(values_old, "values_old", &shape, "the shape of `values`")?;
    validate::same_shape(returns, "returns", &shape, "the shape of `values`")?;
    let m = validate::bool_mask_with(mask, "mask", cfg.checks)?;
    validate::same_shape(&m, "mask", &shape, "the shape of `values`")?;
    let device = values.device();
    validate::same_device(values_old, "values_old", device, "values")?;
    validate::same_device(returns, "returns", device, "values")?;
    validate::same_device(&m, "mask", device, "values")?;
    let v = masked_fill_zero(&values.f_to_kind(kind)?, &m)?;
    let v_old = masked_fill_zero(&values_old.f_detach()?.f_to_kind(kind)?, &m)?;
    let ret = masked_fill_zero(&returns.f_detach()?.f_to_kind(kind)?, &m)?;
    if cfg.checks.values() {
        validate::all_finite(&[
            validate::FiniteCheck { clean: &v, original: values, argument: "values", valid: Some(&m), also: None },
            validate::FiniteCheck {
                clean: &v_old,
                original: values_old,
                argument: "values_old",
                valid: Some(&m),
                also: None,
            },
            validate::FiniteCheck { clean: &ret, original: returns, argument: "returns", valid: Some(&m), also: None },
        ])?;
    }
    let clipped = if cfg.clip.is_finite() {
        let (lo, hi) = (v_old.f_sub_scalar(cfg.clip)?, v_old.f_add_scalar(cfg.clip)?);
        v.f_clamp_tensor(Some(&lo), Some(&hi))?
    } else {
        v.shallow_clone()
    };
    let error = v.f_sub(&ret)?.f_square()?;
    let clipped_error = clipped.f_sub(&ret)?.f_square()?;
    let per_token = masked_fill_zero(&error.f_maximum(&clipped_error)?.f_mul_scalar(0.5)?, &m)?;
    Ok(Parts { kind, mask: m, values: v, returns: ret, error, clipped_error, per_token })
}
