//! What every loss returns beside its value: the per-token (or per-sequence, per-pair) terms it
//! reduced, and its diagnostics, all from the same pass.
//!
//! Each loss comes as a pair of functions (rlax's `(loss, extras)` pattern):
//!
//! ```text
//! xxx_loss(args.., &cfg)                 -> Result<Tensor>                     the loss, local counts
//! xxx_loss_output(args.., &cfg, &norm)   -> Result<LossOutput<XxxDiagnostics>> loss, terms, diagnostics
//! ```
//!
//! The diagnostics stay on the device as one small tensor ([`OnDevice`]) until you
//! [`read`](OnDevice::read) them: computing them costs no host synchronisation, reading them costs
//! exactly one, so a trainer can log every few steps without recomputing anything.

use crate::error::LossError;
use std::marker::PhantomData;
use tch::{Kind, Tensor};

/// A loss, the terms it reduced, and its diagnostics.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_token_loss_output, Normalizer, ToprTokenConfig};
///
/// let logp = Tensor::from_slice2(&[[-0.5f64, -1.0], [-0.2, -0.3]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-0.5f64, -1.0], [-0.1, -0.3]]);
/// let mask = Tensor::from_slice2(&[[true, false], [true, true]]);
/// let rewards = Tensor::from_slice(&[1.0f64, -1.0]);
/// let out = topr_token_loss_output(&logp, &logp_mu, &rewards, &mask, &ToprTokenConfig::paper(), &Normalizer::local())?;
/// out.loss.backward();
/// let d = out.diagnostics.read()?; // one host read
/// assert_eq!((d.samples, d.negative_fraction), (2, 0.5));
/// assert_eq!(out.terms.size(), vec![2, 2]); // each token's share of the loss, 0 on padding
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct LossOutput<D> {
    /// The scalar loss to minimise (differentiable), exactly what the plain `xxx_loss` returns
    /// for the same normaliser.
    pub loss: Tensor,
    /// The unreduced terms (differentiable): `[B, T]` per-token for the token-level losses (zero
    /// on padding), `[B]` per sequence or per pair for the sequence-level ones. Reducing them with
    /// the loss's aggregation gives `loss`: `aggregate(&terms, &mask, cfg.aggregation, &norm)` for
    /// the token-level losses, `Σ terms / S` for the sequence-level ones. Reduce them your own way
    /// for another weighting.
    pub terms: Tensor,
    /// The loss's diagnostics, computed in the same pass, not yet read back.
    pub diagnostics: OnDevice<D>,
}

/// Diagnostics that live on the device as one `[K]` f64 tensor until [`read`](Self::read).
///
/// ```
/// use tch::Tensor;
/// use topr_loss::{ppo_clip_loss_output, Diagnostics, Normalizer, PpoConfig, PpoDiagnostics};
///
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let out = ppo_clip_loss_output(&lp, &lp, &Tensor::from_slice(&[1.0f64]), &lp.ones_like(), &PpoConfig::ppo(), &Normalizer::local())?;
/// assert_eq!(out.diagnostics.tensor().size(), vec![PpoDiagnostics::NAMES.len() as i64]);
/// assert_eq!(out.diagnostics.read()?.clip_fraction, 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug)]
pub struct OnDevice<D> {
    values: Tensor,
    kind: PhantomData<D>,
}

impl<D: Diagnostics> OnDevice<D> {
    /// Stacks the scalar tensors, in [`Diagnostics::NAMES`] order, into one detached f64 tensor.
    pub(crate) fn new(values: &[Tensor]) -> Result<Self, LossError> {
        let values: Vec<Tensor> =
            values.iter().map(|v| v.f_detach()?.f_to_kind(Kind::Double)?.f_reshape([])).collect::<Result<_, _>>()?;
        Ok(Self { values: Tensor::f_stack(&values, 0)?, kind: PhantomData })
    }

    /// Reads the diagnostics back to the host: one device synchronisation.
    ///
    /// # Errors
    /// [`LossError::Torch`] if libtorch fails to copy the values.
    pub fn read(&self) -> Result<D, LossError> {
        Ok(D::from_values(&crate::checks::read_vec(&self.values)?))
    }

    /// The `[K]` f64 tensor, on the loss's device, in [`Diagnostics::NAMES`] order: for
    /// accumulating over micro-batches or all-reducing before one read.
    pub fn tensor(&self) -> &Tensor {
        &self.values
    }
}

pub(crate) mod sealed {
    /// Keeps [`super::Diagnostics`] implemented by this crate only.
    pub trait Sealed {}
}

/// The diagnostics of one loss family, decoded from the values of an [`OnDevice`]. Implemented
/// by this crate's diagnostics structs only.
pub trait Diagnostics: Sized + sealed::Sealed {
    /// The names of the values, in the order of [`OnDevice::tensor`].
    const NAMES: &'static [&'static str];

    /// Decodes the values (as many as `NAMES`).
    fn from_values(values: &[f64]) -> Self;
}

/// Implements [`Diagnostics`] for a struct of `f64` fields, named and ordered as the values.
macro_rules! diagnostics_struct {
    ($ty:ident { $($field:ident),+ $(,)? }) => {
        impl crate::output::sealed::Sealed for $ty {}
        impl crate::output::Diagnostics for $ty {
            const NAMES: &'static [&'static str] = &[$(stringify!($field)),+];
            fn from_values(values: &[f64]) -> Self {
                let mut it = values.iter().copied();
                let mut next = || it.next().unwrap_or(f64::NAN);
                Self { $($field: crate::output::FromValue::from_value(next())),+ }
            }
        }
    };
}
pub(crate) use diagnostics_struct;

/// How one decoded value becomes a field: counts as `i64`, `NaN` as `None`.
pub(crate) trait FromValue {
    fn from_value(v: f64) -> Self;
}

impl FromValue for f64 {
    fn from_value(v: f64) -> Self {
        v
    }
}

impl FromValue for i64 {
    fn from_value(v: f64) -> Self {
        if v.is_finite() { v.round() as i64 } else { 0 }
    }
}

impl FromValue for Option<f64> {
    fn from_value(v: f64) -> Self {
        (!v.is_nan()).then_some(v)
    }
}

/// Device-side statistics helpers: each returns a 0-d tensor, no host read.
pub(crate) mod stats {
    use crate::error::LossError;
    use tch::{Kind, Tensor};

    /// Number of true entries, as f64.
    pub fn count(m: &Tensor) -> Result<Tensor, LossError> {
        Ok(m.f_sum(Kind::Double)?)
    }

    /// `Σ_{m} t` in f64.
    pub fn sum_where(t: &Tensor, m: &Tensor) -> Result<Tensor, LossError> {
        let t = t.f_to_kind(Kind::Double)?;
        Ok(t.f_where_self(m, &t.f_zeros_like()?)?.f_sum(Kind::Double)?)
    }

    /// `num / den`, 0 where `den = 0`.
    pub fn share(num: &Tensor, den: &Tensor) -> Result<Tensor, LossError> {
        Ok(num.f_div(&den.f_clamp_min(1.0)?)?)
    }

    /// Mean of `t` over `m`, 0 when `m` is empty.
    pub fn mean_where(t: &Tensor, m: &Tensor) -> Result<Tensor, LossError> {
        share(&sum_where(t, m)?, &count(m)?)
    }

    /// Minimum and maximum of `t` over `m`, both 0 when `m` is empty.
    pub fn min_max_where(t: &Tensor, m: &Tensor) -> Result<(Tensor, Tensor), LossError> {
        let t = t.f_to_kind(Kind::Double)?;
        let any = m.f_any()?;
        let zero = Tensor::f_scalar_tensor(0.0, (Kind::Double, t.device()))?;
        let min = t.f_where_self(m, &t.f_full_like(f64::INFINITY)?)?.f_min()?;
        let max = t.f_where_self(m, &t.f_full_like(f64::NEG_INFINITY)?)?.f_max()?;
        Ok((min.f_where_self(&any, &zero)?, max.f_where_self(&any, &zero)?))
    }
}
