//! Reducing a per-token loss `ℓ [B, T]` under a mask `m [B, T]` to the scalar an optimiser
//! minimises, in a way that does not depend on how a batch is split.
//!
//! | mode | formula |
//! |---|---|
//! | [`AggregationMode::TokenMean`] | `Σ_{i,t} m ℓ / N` |
//! | [`AggregationMode::TokenSum`] | `Σ_{i,t} m ℓ` |
//! | [`AggregationMode::SeqMeanTokenSum`] | `(1/S) Σ_i Σ_t m ℓ` |
//! | [`AggregationMode::SeqMeanTokenMean`] | `(1/S) Σ_i (Σ_t m ℓ / L_i)` |
//! | [`AggregationMode::DrGrpo`] | `(1/S) Σ_i Σ_t m ℓ / L` (`L` a fixed length) |
//! | [`AggregationMode::TokenSumNorm`] | `Σ_{i,t} m ℓ / L` (`L` a fixed length) |
//!
//! `L_i = Σ_t m_{i,t}` is a sequence's length. `N` (the number of unmasked tokens) and `S` (the
//! number of sequences) come from a [`Normalizer`]: by default the counts of the tensors passed in,
//! or, for gradient accumulation and data parallelism, the counts of the *whole* optimiser batch.
//! With global counts, the sum of the losses of the micro-batches equals the loss of the full batch,
//! value and gradient, whatever the split. Normalising each micro-batch by its own counts (the
//! default of several public trainers) changes the update with the micro-batch size.
//!
//! Every mode weighs all tokens of one sequence equally, so each reduces to `Σ_i α_i Σ_t m ℓ`
//! with a per-sequence weight `α_i`; [`sequence_weights`] returns it.

use crate::checks::{Checks, read_f64, read_i64};
use crate::error::LossError;
use crate::validate;
use tch::{Kind, Tensor};

/// How per-token losses are reduced to a scalar.
///
/// | variant | verl `loss_agg_mode` | formula |
/// |---|---|---|
/// | `TokenMean` | `token-mean` | `Σ m ℓ / N` |
/// | `TokenSum` | — | `Σ m ℓ` |
/// | `SeqMeanTokenSum` | `seq-mean-token-sum` | `(1/S) Σ_i Σ_t m ℓ` |
/// | `SeqMeanTokenMean` | `seq-mean-token-mean` | `(1/S) Σ_i Σ_t m ℓ / L_i` |
/// | `DrGrpo { length }` | `seq-mean-token-sum-norm` (verl ≥ 0.9; Dr. GRPO's reduction) | `(1/S) Σ_i Σ_t m ℓ / L` |
/// | `TokenSumNorm { length }` | `seq-mean-token-sum-norm` of verl releases before 0.9 | `Σ_i Σ_t m ℓ / L` |
///
/// verl's `seq-mean-token-sum-norm` changed meaning: earlier releases divided the sum over all
/// sequences by the fixed length only ([`AggregationMode::TokenSumNorm`]); verl 0.9.1 divides the
/// sequence mean of the token sums by it, which is Dr. GRPO's reduction
/// ([`AggregationMode::DrGrpo`], tested against verl 0.9.1's `agg_loss`). The two differ by the
/// factor `S`.
///
/// Reference: verl `agg_loss`; Dr. GRPO, Liu et al., arXiv 2503.20783.
///
/// # Example
/// ```
/// use topr_loss::AggregationMode;
/// assert_eq!(AggregationMode::default(), AggregationMode::TokenMean);
/// let dr_grpo = AggregationMode::DrGrpo { length: 512.0 };
/// # let _ = dr_grpo;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum AggregationMode {
    /// `Σ m ℓ / N`: every token weighs the same (PPO in verl, DAPO, Trinity-RFT).
    #[default]
    TokenMean,
    /// `Σ m ℓ`: no normalisation.
    TokenSum,
    /// `(1/S) Σ_i Σ_t m ℓ`: every sequence weighs the same, long ones push harder.
    SeqMeanTokenSum,
    /// `(1/S) Σ_i Σ_t m ℓ / L_i`: every sequence weighs the same, its tokens averaged (GRPO).
    SeqMeanTokenMean,
    /// `(1/S) Σ_i Σ_t m ℓ / L`: as `SeqMeanTokenSum` divided by a fixed length `L` (Dr. GRPO,
    /// Liu et al., arXiv 2503.20783).
    DrGrpo {
        /// The fixed length `L` (> 0), e.g. the maximum generation length.
        length: f64,
    },
    /// `Σ_i Σ_t m ℓ / L`: the token sum divided by a fixed length `L` (the
    /// `seq-mean-token-sum-norm` of verl releases before 0.9, which did not divide by the number
    /// of sequences; verl 0.9.1's is [`AggregationMode::DrGrpo`]).
    TokenSumNorm {
        /// The fixed length `L` (> 0), e.g. the maximum generation length.
        length: f64,
    },
}

/// The counts an aggregation divides by, given to each call (they belong to one optimiser step,
/// not to a run-long config). `None` means "count the tensors of this call".
///
/// For exact gradient accumulation, compute the counts once over the whole optimiser batch
/// (all micro-batches, all data-parallel ranks) and pass the same `Normalizer` to every
/// micro-batch: the micro-batch losses then sum to the full-batch loss.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{BatchCounts, Normalizer};
///
/// let mask_a = Tensor::from_slice2(&[[1i64, 1, 0], [1, 0, 0]]);
/// let mask_b = Tensor::from_slice2(&[[1i64, 1, 1]]);
/// let n = Normalizer::from_masks(&[&mask_a, &mask_b])?;
/// assert_eq!(n, Normalizer::global(BatchCounts { tokens: 6.0, sequences: 3.0 }));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct Normalizer {
    /// Total number of unmasked tokens `N` (used by `TokenMean`).
    pub tokens: Option<f64>,
    /// Total number of sequences `S` (used by the `SeqMean*` and `DrGrpo` modes, and as the number
    /// of samples or pairs by the sequence-level losses).
    pub sequences: Option<f64>,
}

/// The counts of a whole optimiser batch, by name so that they cannot be swapped.
///
/// ```
/// use topr_loss::{BatchCounts, Normalizer};
/// let n = Normalizer::global(BatchCounts { tokens: 100.0, sequences: 8.0 });
/// assert_eq!((n.tokens, n.sequences), (Some(100.0), Some(8.0)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchCounts {
    /// Unmasked tokens in the whole batch.
    pub tokens: f64,
    /// Sequences (with at least one unmasked token), or preference pairs for DPO.
    pub sequences: f64,
}

impl Normalizer {
    /// Counts taken from the tensors of each call (not split-invariant).
    ///
    /// ```
    /// use topr_loss::Normalizer;
    /// assert_eq!(Normalizer::local(), Normalizer::default());
    /// ```
    pub const fn local() -> Self {
        Self { tokens: None, sequences: None }
    }

    /// Fixed global counts of the whole optimiser batch.
    ///
    /// ```
    /// use topr_loss::{BatchCounts, Normalizer};
    /// assert_eq!(Normalizer::global(BatchCounts { tokens: 100.0, sequences: 8.0 }).tokens, Some(100.0));
    /// ```
    pub const fn global(counts: BatchCounts) -> Self {
        Self { tokens: Some(counts.tokens), sequences: Some(counts.sequences) }
    }

    /// Only the sequence count fixed (what the sequence-level losses and DPO use); the token count
    /// is taken from each call.
    ///
    /// ```
    /// use topr_loss::Normalizer;
    /// assert_eq!(Normalizer::sequences(32.0).sequences, Some(32.0));
    /// assert_eq!(Normalizer::sequences(32.0).tokens, None);
    /// ```
    pub const fn sequences(sequences: f64) -> Self {
        Self { tokens: None, sequences: Some(sequences) }
    }

    /// Only the token count fixed; the sequence count is taken from each call.
    ///
    /// ```
    /// use topr_loss::Normalizer;
    /// assert_eq!(Normalizer::tokens(512.0).tokens, Some(512.0));
    /// ```
    pub const fn tokens(tokens: f64) -> Self {
        Self { tokens: Some(tokens), sequences: None }
    }

    /// Global counts from the masks `[B_k, T_k]` of all micro-batches of one optimiser step.
    /// A sequence counts when it has at least one unmasked token.
    ///
    /// # Errors
    /// [`LossError::WrongRank`] or [`LossError::WrongDtype`] for a mask that is not a 2-D
    /// bool/integer/0-1 tensor.
    pub fn from_masks(masks: &[&Tensor]) -> Result<Self, LossError> {
        let (mut tokens, mut sequences) = (0.0, 0.0);
        for mask in masks {
            let m = validate::bool_mask(mask, "masks")?;
            validate::rank(&m, "masks", 2, "[B, T] tokens")?;
            let lengths = m.f_sum_dim_intlist(1, false, Kind::Int64)?;
            tokens += read_i64(&lengths.f_sum(Kind::Int64)?, &[])? as f64;
            sequences += read_i64(&lengths.f_gt(0)?.f_sum(Kind::Int64)?, &[])? as f64;
        }
        Ok(Self::global(BatchCounts { tokens, sequences }))
    }

    /// The sequence count: the global one, else `local`. Checked first.
    pub(crate) fn sequences_or(&self, local: f64) -> Result<f64, LossError> {
        self.check()?;
        Ok(self.sequences.unwrap_or(local))
    }

    pub(crate) fn check(&self) -> Result<(), LossError> {
        for (v, field) in [(self.tokens, "Normalizer::tokens"), (self.sequences, "Normalizer::sequences")] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(LossError::InvalidConfig {
                        field,
                        value: v,
                        reason: "a normalising count must be finite and > 0".into(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// The per-sequence weights `α [B]` such that `aggregate(ℓ) = Σ_i α_i Σ_t m_{i,t} ℓ_{i,t}`.
///
/// ```text
/// TokenMean: 1/N    TokenSum: 1    SeqMeanTokenSum: 1/S    SeqMeanTokenMean: 1/(S L_i)
/// DrGrpo{L}: 1/(S L)             TokenSumNorm{L}: 1/L
/// ```
///
/// A sequence with no unmasked token gets `α = 0`. `mask` is a bool tensor `[B, T]`; the weights
/// are in `kind`. A count not given by `norm` is this call's: read back (one host read) and
/// checked non-zero under [`Checks::Full`], kept on the device (an empty batch weighs 0) under
/// [`Checks::Shapes`].
pub(crate) fn sequence_weights_checked(
    mask: &Tensor,
    mode: AggregationMode,
    norm: &Normalizer,
    kind: Kind,
    checks: Checks,
) -> Result<Tensor, LossError> {
    sequence_weights_of_lengths(&mask_lengths(mask, kind)?, mask, mode, norm, kind, checks)
}

/// [`sequence_weights_checked`] from the lengths `L [B]` (in `kind`) of `mask`, for callers that
/// have them already; `mask` only names the argument in an error.
pub(crate) fn sequence_weights_of_lengths(
    lengths: &Tensor,
    mask: &Tensor,
    mode: AggregationMode,
    norm: &Normalizer,
    kind: Kind,
    checks: Checks,
) -> Result<Tensor, LossError> {
    norm.check()?;
    let has_tokens = lengths.f_gt(0.0)?;
    let ones = has_tokens.f_to_kind(kind)?;
    // The one count the mode divides by (TokenSum and TokenSumNorm divide by none, but an empty
    // batch is still an error under full checks, as for the sequence modes).
    let count = if matches!(mode, AggregationMode::TokenMean) {
        Count::of(norm.tokens, || Ok(lengths.f_sum(kind)?), checks)?
    } else {
        Count::of(norm.sequences, || Ok(ones.f_sum(kind)?), checks)?
    };
    if let Count::Host(0.0) = count {
        return Err(LossError::EmptyBatch { argument: "mask", found: mask.size(), unit: "unmasked token" });
    }
    Ok(match mode {
        AggregationMode::TokenMean | AggregationMode::SeqMeanTokenSum => count.divide(&ones, 1.0)?,
        AggregationMode::TokenSum => ones,
        AggregationMode::SeqMeanTokenMean => {
            // 1 / (S L_i) where L_i > 0, else 0 (never divides by zero).
            let safe = lengths.f_clamp_min(1.0)?;
            count.divide(&ones.f_div(&safe)?, 1.0)?
        }
        AggregationMode::DrGrpo { length } => {
            count.divide(&ones, fixed_length(length, "AggregationMode::DrGrpo::length")?)?
        }
        AggregationMode::TokenSumNorm { length } => {
            ones.f_div_scalar(fixed_length(length, "AggregationMode::TokenSumNorm::length")?)?
        }
    })
}

/// A count the aggregation divides by: on the host (given, or read back), or on the device.
enum Count {
    Host(f64),
    Device(Tensor),
}

impl Count {
    /// The given count, else this call's, read back only when values are checked.
    fn of(
        given: Option<f64>,
        local: impl FnOnce() -> Result<Tensor, LossError>,
        checks: Checks,
    ) -> Result<Self, LossError> {
        Ok(match given {
            Some(v) => Count::Host(v),
            None if checks.values() => Count::Host(read_f64(&local()?)?),
            None => Count::Device(local()?),
        })
    }

    /// `t / (count · factor)`; a zero count on the device gives 0 weights (`t` is 0 there too).
    fn divide(&self, t: &Tensor, factor: f64) -> Result<Tensor, LossError> {
        Ok(match self {
            Count::Host(v) => t.f_div_scalar(*v * factor)?,
            Count::Device(c) => t.f_div(&c.f_clamp_min(1.0)?.f_mul_scalar(factor)?)?,
        })
    }
}

fn fixed_length(length: f64, field: &'static str) -> Result<f64, LossError> {
    if length.is_finite() && length > 0.0 {
        Ok(length)
    } else {
        Err(LossError::InvalidConfig { field, value: length, reason: "the fixed length must be finite and > 0".into() })
    }
}

/// The per-sequence weights `α_i` of an aggregation mode (see the module docs).
///
/// # Arguments
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating; true/nonzero marks a real token.
/// * `mode`, `norm` — the aggregation and its counts.
///
/// # Returns
/// `α [B]` in f32, with `aggregate(ℓ) = Σ_i α_i Σ_t m ℓ`.
///
/// # Errors
/// [`LossError::WrongRank`], [`LossError::WrongDtype`] for a bad mask; [`LossError::EmptyBatch`]
/// when nothing is unmasked and no global count is given; [`LossError::InvalidConfig`] for a
/// non-positive count or length.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{sequence_weights, AggregationMode, Normalizer};
///
/// let mask = Tensor::from_slice2(&[[1i64, 1, 0, 0], [1, 1, 1, 1]]);
/// let a = sequence_weights(&mask, AggregationMode::SeqMeanTokenMean, &Normalizer::local())?;
/// assert_eq!(Vec::<f32>::try_from(&a)?, vec![0.25, 0.125]); // 1/(2·2), 1/(2·4)
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn sequence_weights(mask: &Tensor, mode: AggregationMode, norm: &Normalizer) -> Result<Tensor, LossError> {
    let m = validate::bool_mask(mask, "mask")?;
    validate::rank(&m, "mask", 2, "[B, T] tokens")?;
    sequence_weights_checked(&m, mode, norm, Kind::Float, Checks::Full)
}

/// Reduces a per-token loss `ℓ [B, T]` to a scalar under a mask, split-invariantly when `norm`
/// holds global counts.
///
/// ```text
/// aggregate(ℓ) = Σ_i α_i Σ_t m_{i,t} ℓ_{i,t}      (α_i from the mode, see the module table)
/// ```
///
/// Masked positions get exactly zero gradient even when `ℓ` holds NaN or inf there (they are
/// replaced, not multiplied by zero). Unmasked non-finite values are an error.
///
/// Reference: verl `agg_loss` (mode names); the split-invariance requirement is the bug class
/// reported against verl, TRL and torchtune gradient accumulation.
///
/// # Arguments
/// * `loss` — `[B, T]` per-token losses, floating (bf16/f16 upcast to f32).
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// Shape, dtype, device, empty and non-finite checks as named in [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{aggregate, AggregationMode, Normalizer};
///
/// let loss = Tensor::from_slice2(&[[1.0f64, 2.0, f64::NAN], [3.0, 4.0, 5.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
/// let full = aggregate(&loss, &mask, AggregationMode::TokenMean, &Normalizer::local())?;
/// assert!((full.double_value(&[]) - 3.0).abs() < 1e-12); // (1+2+3+4+5)/5
///
/// // Two micro-batches with the global count add up to the same loss.
/// let g = Normalizer::global(topr_loss::BatchCounts { tokens: 5.0, sequences: 2.0 });
/// let a = aggregate(&loss.narrow(0, 0, 1), &mask.narrow(0, 0, 1), AggregationMode::TokenMean, &g)?;
/// let b = aggregate(&loss.narrow(0, 1, 1), &mask.narrow(0, 1, 1), AggregationMode::TokenMean, &g)?;
/// assert!((a.double_value(&[]) + b.double_value(&[]) - 3.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn aggregate(loss: &Tensor, mask: &Tensor, mode: AggregationMode, norm: &Normalizer) -> Result<Tensor, LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(loss, "loss")?]);
    let shape = validate::rank(loss, "loss", 2, "[B, T] per-token losses")?;
    let m = validate::bool_mask(mask, "mask")?;
    validate::same_shape(&m, "mask", &shape, "the shape of `loss`")?;
    validate::same_device(&m, "mask", loss.device(), "loss")?;
    validate::finite(loss, "loss", Some(&m))?;
    let alpha = sequence_weights_checked(&m, mode, norm, kind, Checks::Full)?;
    let clean = masked_fill_zero(&loss.f_to_kind(kind)?, &m)?;
    weighted_sum(&clean, &alpha)
}

/// `L_i = Σ_t m_{i,t}` of a bool mask `[B, T]`, in `kind`. Read as bytes: libtorch converts
/// bool to float element by element, but bytes in vectorised loops (about 6× faster on the CPU at
/// `[512, 2048]`).
pub(crate) fn mask_lengths(mask: &Tensor, kind: Kind) -> Result<Tensor, LossError> {
    Ok(mask_float(mask, kind)?.f_sum_dim_intlist(1, false, kind)?)
}

/// A bool mask as 0/1 in `kind`, converted through bytes (see [`mask_lengths`]).
pub(crate) fn mask_float(mask: &Tensor, kind: Kind) -> Result<Tensor, LossError> {
    Ok(mask.f_view_dtype(Kind::Uint8)?.f_to_kind(kind)?)
}

/// `t` with its padding zeroed, value and gradient exactly zero there. When every entry of `t` is
/// known finite (padding included, as a finite sum of `t · m` proves), by a product with the 0/1
/// `mask_f`: one vectorised pass, gradient `g · m`. Otherwise by `where` ([`masked_fill_zero`]),
/// which is right whatever padding holds but is an element loop on the CPU, several times slower
/// at `[512, 2048]` (docs/performance.md); `0 · NaN` is NaN, so the product needs the proof.
pub(crate) fn zero_padding(
    t: &Tensor,
    mask: &Tensor,
    mask_f: &Tensor,
    known_finite: bool,
) -> Result<Tensor, LossError> {
    if known_finite { Ok(t.f_mul(mask_f)?) } else { masked_fill_zero(t, mask) }
}

/// `where(mask, t, 0)`: masked entries replaced by zero, with zero gradient, whatever they held.
pub(crate) fn masked_fill_zero(t: &Tensor, mask: &Tensor) -> Result<Tensor, LossError> {
    // `where` with a scalar: no zero tensor is made, forward or backward (its gradient is
    // `where(mask, grad, 0)`), so padding gets exactly zero gradient whatever it holds.
    Ok(t.f_where_scalarother(mask, 0.0)?)
}

/// `Σ_i α_i Σ_t ℓ_{i,t}` for a zero-filled `ℓ [B, T]` and `α [B]`.
pub(crate) fn weighted_sum(clean: &Tensor, alpha: &Tensor) -> Result<Tensor, LossError> {
    let per_seq = clean.f_sum_dim_intlist(1, false, None::<Kind>)?;
    Ok(per_seq.f_mul(alpha)?.f_sum(None::<Kind>)?)
}
