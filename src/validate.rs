//! Argument checks shared by every public function. Each returns a [`LossError`] naming the
//! argument; none panics, whatever the tensor (undefined, sparse, complex, empty).

use crate::checks::{Checks, read_f64, read_i64, read_vec};
use crate::error::LossError;
use tch::{Device, Kind, Tensor};

/// Checks that `t` is a defined, dense tensor of a floating dtype this crate computes with
/// (f16, bf16, f32, f64) and returns its dtype.
pub(crate) fn float_tensor(t: &Tensor, argument: &'static str) -> Result<Kind, LossError> {
    dense_tensor(t, argument)?;
    let kind = t.f_kind().map_err(|_| LossError::WrongDtype {
        argument,
        found: "unknown".into(),
        expected: "a floating dtype (f16, bf16, f32 or f64)",
    })?;
    match kind {
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double => Ok(kind),
        other => Err(LossError::WrongDtype {
            argument,
            found: format!("{other:?}"),
            expected: "a floating dtype (f16, bf16, f32 or f64)",
        }),
    }
}

/// Checks that `t` is defined and dense.
pub(crate) fn dense_tensor(t: &Tensor, argument: &'static str) -> Result<(), LossError> {
    if !t.defined() {
        return Err(LossError::UnsupportedTensor { argument, what: "undefined" });
    }
    if t.is_sparse() {
        return Err(LossError::UnsupportedTensor { argument, what: "sparse" });
    }
    Ok(())
}

/// Checks that `t` is defined, dense, and of an integer or floating dtype (not bool or complex):
/// counts and lengths given in whatever real dtype the caller has.
pub(crate) fn real_tensor(t: &Tensor, argument: &'static str) -> Result<(), LossError> {
    dense_tensor(t, argument)?;
    let kind = t.f_kind().ok();
    if matches!(
        kind,
        Some(
            Kind::Uint8
                | Kind::Int8
                | Kind::Int16
                | Kind::Int
                | Kind::Int64
                | Kind::Half
                | Kind::BFloat16
                | Kind::Float
                | Kind::Double
        )
    ) {
        return Ok(());
    }
    Err(LossError::WrongDtype {
        argument,
        found: kind.map_or("unknown".into(), |k| format!("{k:?}")),
        expected: "an integer or floating dtype",
    })
}

/// `t` detached from the graph, once it is known to be defined and dense (an error naming
/// `argument` otherwise, rather than libtorch's own).
pub(crate) fn detached(t: &Tensor, argument: &'static str) -> Result<Tensor, LossError> {
    dense_tensor(t, argument)?;
    Ok(t.f_detach()?)
}

/// Checks the rank of `t` and returns its shape.
pub(crate) fn rank(
    t: &Tensor,
    argument: &'static str,
    expected_rank: usize,
    meaning: &'static str,
) -> Result<Vec<i64>, LossError> {
    let found = t.size();
    if found.len() != expected_rank {
        return Err(LossError::WrongRank { argument, found, expected_rank, meaning });
    }
    Ok(found)
}

/// Checks that `t` has exactly the shape `expected`.
pub(crate) fn same_shape(
    t: &Tensor,
    argument: &'static str,
    expected: &[i64],
    reason: &'static str,
) -> Result<(), LossError> {
    let found = t.size();
    if found != expected {
        return Err(LossError::ShapeMismatch { argument, found, expected: expected.to_vec(), reason });
    }
    Ok(())
}

/// Checks that `t` lives on `device`, the device of `other`.
pub(crate) fn same_device(
    t: &Tensor,
    argument: &'static str,
    device: Device,
    other: &'static str,
) -> Result<(), LossError> {
    let found = t.device();
    if found != device {
        return Err(LossError::DeviceMismatch { argument, found, other, expected: device });
    }
    Ok(())
}

/// Checks that the first dimension is non-empty.
pub(crate) fn non_empty(shape: &[i64], argument: &'static str, unit: &'static str) -> Result<(), LossError> {
    if shape.contains(&0) {
        return Err(LossError::EmptyBatch { argument, found: shape.to_vec(), unit });
    }
    Ok(())
}

/// Checks that every entry of `t` where `valid` is true (every entry when `valid` is `None`)
/// is finite. `valid` must broadcast to `t`'s shape.
pub(crate) fn finite(t: &Tensor, argument: &'static str, valid: Option<&Tensor>) -> Result<(), LossError> {
    let mut bad = t.f_isfinite()?.f_logical_not()?;
    if let Some(valid) = valid {
        bad = bad.f_logical_and(valid)?;
    }
    let count = read_i64(&bad.f_sum(Kind::Int64)?, &[])?;
    if count > 0 {
        return Err(LossError::NonFinite { argument, count, first_index: first_index(&bad)? });
    }
    Ok(())
}

/// The multi-index of the first true entry of the bool tensor `bad` (which holds one).
fn first_index(bad: &Tensor) -> Result<Vec<i64>, LossError> {
    let idx = bad.f_nonzero()?; // [count, rank]
    Ok(read_vec(&idx.f_select(0, 0)?)?.into_iter().map(|v| v as i64).collect())
}

/// One tensor argument to check for NaN and inf, see [`all_finite`].
pub(crate) struct FiniteCheck<'a> {
    /// The argument with masked entries already replaced (and possibly upcast).
    pub clean: &'a Tensor,
    /// The argument as passed.
    pub original: &'a Tensor,
    pub argument: &'static str,
    /// Where the entries are real (`None`: everywhere).
    pub valid: Option<&'a Tensor>,
    /// A second argument that `clean` also covers (`clean = a − b` is finite exactly where both
    /// are), checked with the first when the sum is not finite.
    pub also: Option<(&'a Tensor, &'static str)>,
}

/// Checks several arguments for NaN and inf with a single device sync on the happy path: a
/// finite sum of a `clean` tensor proves its entries finite. Only when a sum is not finite does
/// the exact per-entry check run, to name the first offending index (or to clear a sum that merely
/// overflowed).
pub(crate) fn all_finite(items: &[FiniteCheck]) -> Result<(), LossError> {
    all_finite_sums(items).map(|_| ())
}

/// [`all_finite`], returning each `clean` tensor's sum (in f64): a finite sum also proves its
/// masked entries finite when `clean` zeroed them by a product with the 0/1 mask.
pub(crate) fn all_finite_sums(items: &[FiniteCheck]) -> Result<Vec<f64>, LossError> {
    all_finite_sums_and_log_probs(items, &[])
}

/// A log-probability argument, checked to lie at most [`crate::LOG_PROB_TOLERANCE`] above 0.
pub(crate) struct LogProbCheck<'a> {
    pub t: &'a Tensor,
    pub argument: &'static str,
    /// Where the entries are real (`None`: everywhere).
    pub valid: Option<&'a Tensor>,
}

/// [`all_finite_sums`], and each of `log_probs` at most [`crate::LOG_PROB_TOLERANCE`] above 0
/// where real ([`LossError::PositiveLogProb`]): the sums and the maxima are read back together,
/// in one host read on the happy path.
pub(crate) fn all_finite_sums_and_log_probs(
    items: &[FiniteCheck],
    log_probs: &[LogProbCheck],
) -> Result<Vec<f64>, LossError> {
    let mut reductions =
        items.iter().map(|c| c.clean.f_sum(None::<Kind>)?.f_to_kind(Kind::Double)).collect::<Result<Vec<_>, _>>()?;
    let real_or_below = |c: &LogProbCheck| -> Result<Tensor, LossError> {
        Ok(match c.valid {
            Some(v) => c.t.f_detach()?.f_masked_fill(&v.f_logical_not()?, f64::NEG_INFINITY)?,
            None => c.t.f_detach()?,
        })
    };
    for c in log_probs {
        reductions.push(real_or_below(c)?.f_max()?.f_to_kind(Kind::Double)?);
    }
    let read = read_vec(&Tensor::f_stack(&reductions, 0)?)?;
    let (sums, maxima) = read.split_at(items.len());
    for (c, s) in items.iter().zip(sums) {
        if !s.is_finite() {
            finite(c.original, c.argument, c.valid)?;
            if let Some((original, argument)) = c.also {
                finite(original, argument, c.valid)?;
            }
        }
    }
    for (c, &max) in log_probs.iter().zip(maxima) {
        // Not NaN here: a NaN where real made a sum above non-finite, and that was refused.
        if max > crate::LOG_PROB_TOLERANCE {
            // Compared in f64 as `max` was: in the tensor's own dtype the tolerance would round
            // to that dtype, and an entry at the rounded tolerance would be found by one test only.
            let first_index =
                first_index(&real_or_below(c)?.f_to_kind(Kind::Double)?.f_gt(crate::LOG_PROB_TOLERANCE)?)?;
            return Err(LossError::PositiveLogProb { argument: c.argument, max, first_index });
        }
    }
    Ok(sums.to_vec())
}

/// Turns a mask (bool, integer or floating with values 0/1) into a bool tensor, checking that a
/// floating mask holds only 0 and 1.
pub(crate) fn bool_mask(mask: &Tensor, argument: &'static str) -> Result<Tensor, LossError> {
    bool_mask_with(mask, argument, Checks::Full)
}

/// [`bool_mask`]; under [`Checks::Shapes`] a floating mask's nonzero entries are real, unchecked.
pub(crate) fn bool_mask_with(mask: &Tensor, argument: &'static str, checks: Checks) -> Result<Tensor, LossError> {
    dense_tensor(mask, argument)?;
    let kind = mask.f_kind().map_err(|_| LossError::WrongDtype {
        argument,
        found: "unknown".into(),
        expected: "a bool, integer or 0/1 floating mask",
    })?;
    match kind {
        Kind::Bool => Ok(mask.shallow_clone()),
        Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 => Ok(mask.f_ne(0)?),
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double if !checks.values() => Ok(mask.f_ne(0.0)?),
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double => {
            let is_zero = mask.f_eq(0.0)?;
            let is_one = mask.f_eq(1.0)?;
            let other = is_zero.f_logical_or(&is_one)?.f_logical_not()?;
            let count = read_i64(&other.f_sum(Kind::Int64)?, &[])?;
            if count > 0 {
                return Err(LossError::WrongDtype {
                    argument,
                    found: format!("{kind:?} holding {count} value(s) other than 0 and 1"),
                    expected: "a bool, integer or 0/1 floating mask",
                });
            }
            Ok(is_one)
        }
        other => Err(LossError::WrongDtype {
            argument,
            found: format!("{other:?}"),
            expected: "a bool, integer or 0/1 floating mask",
        }),
    }
}

/// The dtype a loss is computed in: f64 when any input is f64, else f32 (f16 and bf16 are upcast).
pub(crate) fn compute_kind(kinds: &[Kind]) -> Kind {
    if kinds.contains(&Kind::Double) { Kind::Double } else { Kind::Float }
}

/// Checks a truncation pair `a ≤ b`, both non-negative and not NaN, `a` finite.
pub(crate) fn limits(a: f64, b: f64, a_name: &'static str, b_name: &'static str) -> Result<(), LossError> {
    for (v, name) in [(a, a_name), (b, b_name)] {
        if v.is_nan() {
            return Err(LossError::InvalidConfig {
                field: name,
                value: v,
                reason: "a truncation limit cannot be NaN".into(),
            });
        }
        if v < 0.0 {
            return Err(LossError::InvalidConfig {
                field: name,
                value: v,
                reason: "a truncation limit bounds an importance ratio, which is never negative; use a value >= 0"
                    .into(),
            });
        }
    }
    if a.is_infinite() {
        return Err(LossError::InvalidConfig {
            field: a_name,
            value: a,
            reason: "the lower limit must be finite (only the upper limit may be infinite)".into(),
        });
    }
    if a > b {
        return Err(LossError::InvalidConfig {
            field: a_name,
            value: a,
            reason: format!("the lower limit must not exceed the upper limit `{b_name}` = {b}"),
        });
    }
    Ok(())
}

/// Checks that a scalar is finite.
pub(crate) fn finite_field(v: f64, field: &'static str) -> Result<(), LossError> {
    if !v.is_finite() {
        return Err(LossError::InvalidConfig { field, value: v, reason: "must be finite".into() });
    }
    Ok(())
}

/// Returns the loss if its value is finite, else [`LossError::NonFiniteLoss`] (one device sync);
/// under [`Checks::Shapes`] returns it unread.
pub(crate) fn finite_loss(loss: Tensor, checks: Checks) -> Result<Tensor, LossError> {
    if !checks.values() || read_f64(&loss)?.is_finite() {
        Ok(loss)
    } else {
        Err(LossError::NonFiniteLoss { compute_dtype: crate::error::kind_name(loss.f_kind()?) })
    }
}

/// Checks that a config value is `> 0` (NaN fails; `∞` passes).
pub(crate) fn positive(v: f64, field: &'static str, reason: &str) -> Result<(), LossError> {
    if v.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return Err(LossError::InvalidConfig { field, value: v, reason: reason.into() });
    }
    Ok(())
}
