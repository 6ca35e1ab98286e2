//! The one error type of the crate.
//!
//! Every public function checks its arguments before it computes anything and returns a
//! [`LossError`] that names the argument at fault and what was found there. No input, however
//! malformed (undefined tensors, scalars, integer or complex tensors, tensors on two devices, NaN
//! limits, an empty batch), makes a public function panic.

use std::fmt;
use std::sync::Arc;
use tch::{Device, Kind};
use thiserror::Error;

/// What went wrong in a call to one of this crate's losses or utilities.
///
/// Each variant names the argument (`argument`) as it is spelled in the function's signature,
/// or the config field (`field`), so that the message alone says what to fix.
///
/// # Example
///
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_loss, LossError, ToprConfig};
///
/// let logp = Tensor::from_slice(&[-1.0f32, -2.0]);
/// let logp_mu = Tensor::from_slice(&[-1.0f32, -2.0, -3.0]); // one row too many
/// let rewards = Tensor::from_slice(&[1.0f32, -1.0]);
/// let err = topr_loss(&logp, &logp_mu, &rewards, &ToprConfig::default()).unwrap_err();
/// assert!(matches!(err, LossError::ShapeMismatch { argument: "logp_mu", .. }));
/// assert_eq!(
///     err.to_string(),
///     "`logp_mu` has shape [3], but shape [2] was expected (the shape of `logp`)"
/// );
/// ```
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum LossError {
    /// A tensor argument was `Tensor::new()` (undefined) or sparse.
    #[error("`{argument}` is {what}; pass a defined, dense (strided) tensor")]
    UnsupportedTensor {
        /// The argument's name.
        argument: &'static str,
        /// What it was ("undefined", "sparse").
        what: &'static str,
    },

    /// A tensor argument does not have the number of dimensions the function takes.
    #[error("`{argument}` has shape {found:?}, but a tensor of rank {expected_rank} ({meaning}) was expected")]
    WrongRank {
        /// The argument's name.
        argument: &'static str,
        /// Its shape.
        found: Vec<i64>,
        /// The rank the function takes.
        expected_rank: usize,
        /// What the dimensions mean, e.g. `"[B] sequence log-probabilities"`.
        meaning: &'static str,
    },

    /// A tensor argument does not have the shape that the other arguments imply.
    #[error("`{argument}` has shape {found:?}, but shape {expected:?} was expected ({reason})")]
    ShapeMismatch {
        /// The argument's name.
        argument: &'static str,
        /// Its shape.
        found: Vec<i64>,
        /// The shape it must have.
        expected: Vec<i64>,
        /// Which argument fixed that shape, in words.
        reason: &'static str,
    },

    /// The batch (or a required dimension) is empty, so a mean over it is undefined.
    #[error("`{argument}` is empty (shape {found:?}); a loss needs at least one {unit}")]
    EmptyBatch {
        /// The argument's name.
        argument: &'static str,
        /// Its shape.
        found: Vec<i64>,
        /// What was missing, e.g. "sequence" or "unmasked token".
        unit: &'static str,
    },

    /// A tensor argument has a dtype the function does not take.
    #[error("`{argument}` has dtype {found}, but {expected} was expected")]
    WrongDtype {
        /// The argument's name.
        argument: &'static str,
        /// The dtype found, as text (`Kind` debug form, or "unknown").
        found: String,
        /// What is accepted, in words.
        expected: &'static str,
    },

    /// Two tensor arguments live on different devices.
    #[error("`{argument}` is on {found:?}, but `{other}` is on {expected:?}; move them to one device")]
    DeviceMismatch {
        /// The argument's name.
        argument: &'static str,
        /// Its device.
        found: Device,
        /// The argument it was compared with.
        other: &'static str,
        /// The other argument's device.
        expected: Device,
    },

    /// A configuration value is out of its domain.
    #[error("invalid config: `{field}` = {value}: {reason}")]
    InvalidConfig {
        /// The field (or scalar argument) at fault.
        field: &'static str,
        /// Its value.
        value: f64,
        /// Why it is invalid.
        reason: String,
    },

    /// A scalar argument (a proportion, a baseline) is out of its domain.
    #[error("invalid argument `{argument}` = {value}: {reason}")]
    InvalidArgument {
        /// The argument's name.
        argument: &'static str,
        /// Its value.
        value: f64,
        /// Why it is invalid.
        reason: String,
    },

    /// A tensor argument holds NaN or ±inf where the mask (if any) says the data is real.
    #[error(
        "`{argument}` holds {count} non-finite value(s) (NaN or inf) in unmasked positions; the first is at index {first_index:?}"
    )]
    NonFinite {
        /// The argument's name.
        argument: &'static str,
        /// How many unmasked entries are NaN or infinite.
        count: i64,
        /// The multi-index of the first such entry.
        first_index: Vec<i64>,
    },

    /// A log-probability argument holds a value above 0, beyond [`crate::LOG_PROB_TOLERANCE`]
    /// (which allows for rounding), where the mask (if any) says the data is real: logits,
    /// probabilities or negated log-probabilities passed by mistake. Checked under
    /// [`crate::Checks::Full`] only.
    #[error(
        "`{argument}` holds log-probabilities above 0 (the largest is {max:.4e}, the first at index {first_index:?}): a log-probability is at most 0 (up to {tol} for rounding); pass log-probabilities, not logits or probabilities",
        tol = crate::LOG_PROB_TOLERANCE
    )]
    PositiveLogProb {
        /// The argument's name.
        argument: &'static str,
        /// Its largest real entry.
        max: f64,
        /// The multi-index of the first entry above the tolerance.
        first_index: Vec<i64>,
    },

    /// The result would overflow the compute dtype. This happens only with an infinite upper
    /// truncation limit (`b = ∞`, plain importance sampling), whose weight `exp(δ)` is unbounded.
    #[error(
        "the loss overflows: with `{field}` = inf the importance weight exp(logp - logp_mu) reaches {max_log_ratio:.4e} in log space, beyond what {compute_dtype} can hold; use a finite upper limit (TIS or TOPR) or bring the policies closer"
    )]
    Overflow {
        /// The config field whose infinite value allowed the overflow.
        field: &'static str,
        /// The largest log-ratio δ seen in the offending branch.
        max_log_ratio: f64,
        /// The dtype the loss was computed in.
        compute_dtype: &'static str,
    },

    /// The loss is not finite although every input is: the rewards or advantages (minus any
    /// baseline) are so large that the loss overflows the compute dtype.
    #[error(
        "the loss overflows {compute_dtype} although every input is finite: the rewards or advantages are too large; rescale them"
    )]
    NonFiniteLoss {
        /// The dtype the loss was computed in.
        compute_dtype: &'static str,
    },

    /// libtorch reported an error. Not expected after validation; kept so that no libtorch error
    /// ever becomes a panic. The original [`tch::TchError`] is the error's
    /// [`source`](std::error::Error::source).
    #[error("libtorch error: {0}")]
    Torch(#[source] TorchError),
}

impl From<tch::TchError> for LossError {
    fn from(e: tch::TchError) -> Self {
        LossError::Torch(TorchError(Arc::new(e)))
    }
}

/// A [`tch::TchError`] shared behind an [`Arc`], so that [`LossError`] stays `Clone` and
/// `PartialEq` (two `TorchError`s are equal when their messages are).
///
/// ```
/// use std::error::Error;
/// use tch::{Kind, Tensor};
/// use topr_loss::LossError;
///
/// let e: LossError = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)).f_view([3]).unwrap_err().into();
/// let LossError::Torch(inner) = &e else { unreachable!() };
/// assert!(e.source().is_some()); // the TorchError, which holds the TchError
/// assert!(matches!(inner.tch(), tch::TchError::Torch(_)));
/// ```
#[derive(Debug, Clone)]
pub struct TorchError(Arc<tch::TchError>);

impl TorchError {
    /// The libtorch error itself.
    pub fn tch(&self) -> &tch::TchError {
        &self.0
    }
}

impl fmt::Display for TorchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for TorchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for TorchError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

/// A short name for a dtype, used in messages.
pub(crate) fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Half => "f16",
        Kind::BFloat16 => "bf16",
        Kind::Float => "f32",
        Kind::Double => "f64",
        _ => "a non-floating dtype",
    }
}
