//! How much a loss checks its inputs, and how often this crate reads values back to the host.
//!
//! Shape, dtype and device checks cost nothing: they read tensor metadata. Checks on values —
//! NaN or inf in real entries, a floating mask holding values other than 0 and 1, an empty batch,
//! a non-finite result — need the values on the host, and on a GPU each such read is a
//! synchronisation that stalls the pipeline until the device catches up. [`Checks::Full`] (the
//! default) does them all; [`Checks::Shapes`] does only the free ones, so that a loss call makes
//! no host read at all.
//!
//! [`host_reads`] counts the reads this crate made on the calling thread, so that a training loop
//! (or a test) can see what a call costs.

use crate::error::LossError;
use std::cell::Cell;
use tch::{Device, Tensor};

/// How much a loss checks its inputs' values.
///
/// | | `Full` (default) | `Shapes` |
/// |---|---|---|
/// | undefined, sparse, wrong dtype, wrong rank or shape, two devices, bad config | error | error |
/// | NaN or inf in a real (unmasked) entry | [`LossError::NonFinite`] | propagates into the loss |
/// | a floating mask holding values other than 0 and 1 | [`LossError::WrongDtype`] | nonzero is real |
/// | no real token in the batch (local counts) | [`LossError::EmptyBatch`] | the loss is 0 |
/// | a non-finite loss (overflow) | [`LossError::Overflow`], [`LossError::NonFiniteLoss`] | returned as it is |
/// | host reads per loss call | a few (see [`host_reads`]) | none |
///
/// Padding gets exactly zero gradient in both modes, whatever it holds. Use `Shapes` in a
/// training loop whose inputs you trust (on a GPU, it keeps the loss from stalling the
/// pipeline), and `Full` while developing or for data you did not produce.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{host_reads, topr_token_loss, Checks, ToprConfig, ToprTokenConfig};
///
/// let logp = Tensor::from_slice2(&[[-0.5f32, -1.0], [-0.2, f32::NAN]]);
/// let logp_mu = Tensor::from_slice2(&[[-0.4f32, -1.0], [-0.2, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, false]]);
/// let rewards = Tensor::from_slice(&[1.0f32, -1.0]);
/// let fast = ToprTokenConfig::paper().with_topr(ToprConfig::canonical().with_checks(Checks::Shapes));
/// let before = host_reads();
/// let loss = topr_token_loss(&logp, &logp_mu, &rewards, &mask, &fast)?;
/// assert_eq!(host_reads(), before); // no value was read back
/// assert!(loss.double_value(&[]).is_finite());
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum Checks {
    /// Every check, values included: a few host reads per call.
    #[default]
    Full,
    /// Shape, dtype, device and config checks only: no host read.
    Shapes,
}

impl Checks {
    /// Whether value checks run.
    pub(crate) fn values(self) -> bool {
        self == Checks::Full
    }
}

/// How far above 0 a log-probability argument may lie under [`Checks::Full`] before it is
/// refused ([`LossError::PositiveLogProb`]): `1e-3`, room for rounding (a token's log-softmax
/// can land a few ulps above 0; a sequence sum of thousands of such tokens stays far below this)
/// while logits, probabilities and negated log-probabilities, the mistakes the check exists for,
/// are caught.
///
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_loss, LossError, ToprConfig, LOG_PROB_TOLERANCE};
///
/// let rewards = Tensor::from_slice(&[1.0f32, -1.0]);
/// let logp_mu = Tensor::from_slice(&[-1.0f32, -2.0]);
/// let rounded = Tensor::from_slice(&[1e-6f32, -2.0]); // rounding: accepted
/// assert!(topr_loss(&rounded, &logp_mu, &rewards, &ToprConfig::canonical()).is_ok());
/// let logits = Tensor::from_slice(&[3.5f32, -2.0]); // not a log-probability: refused
/// let err = topr_loss(&logits, &logp_mu, &rewards, &ToprConfig::canonical()).unwrap_err();
/// assert!(matches!(err, LossError::PositiveLogProb { argument: "logp", .. }));
/// assert!(3.5 > LOG_PROB_TOLERANCE);
/// ```
pub const LOG_PROB_TOLERANCE: f64 = 1e-3;

thread_local! {
    static HOST_READS: Cell<u64> = const { Cell::new(0) };
}

/// The number of times this crate has read tensor values back to the host on the calling thread
/// (each is a device synchronisation on a GPU). Compare it before and after a call to count that
/// call's reads.
///
/// ```
/// use tch::Tensor;
/// use topr_loss::{host_reads, topr_loss, ToprConfig};
///
/// let x = Tensor::from_slice(&[-1.0f32, -2.0]);
/// let before = host_reads();
/// topr_loss(&x, &x, &Tensor::from_slice(&[1.0f32, -1.0]), &ToprConfig::canonical())?;
/// assert!(host_reads() > before); // full checks read the inputs' sums and the loss back
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn host_reads() -> u64 {
    HOST_READS.with(Cell::get)
}

fn count_read() {
    HOST_READS.with(|c| c.set(c.get() + 1));
}

/// Reads a one-element tensor as f64 (one host read).
pub(crate) fn read_f64(t: &Tensor) -> Result<f64, LossError> {
    count_read();
    Ok(t.f_double_value(&[])?)
}

/// Reads one element of an integer tensor (one host read).
pub(crate) fn read_i64(t: &Tensor, index: &[i64]) -> Result<i64, LossError> {
    count_read();
    Ok(t.f_int64_value(index)?)
}

/// Reads a whole tensor as `Vec<f64>` (one host read).
pub(crate) fn read_vec(t: &Tensor) -> Result<Vec<f64>, LossError> {
    count_read();
    let flat = t.f_to_kind(tch::Kind::Double)?.f_flatten(0, -1)?.f_to_device(Device::Cpu)?;
    Ok(Vec::<f64>::try_from(&flat)?)
}
