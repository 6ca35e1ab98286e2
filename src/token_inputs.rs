//! Checking and sanitising the per-token inputs shared by every token-level loss: log-probs
//! `[B, T]` of the policy and of a second policy (behaviour, old or reference), optional
//! per-sequence or per-token weights (rewards, advantages) and a padding mask.

use crate::aggregate::{
    AggregationMode, Normalizer, mask_float, masked_fill_zero, sequence_weights_of_lengths, weighted_sum, zero_padding,
};
use crate::checks::Checks;
use crate::error::LossError;
use crate::validate::{self, FiniteCheck, LogProbCheck};
use tch::{Kind, Tensor};

/// The arguments of a token-level loss, with the names its signature gives them.
pub(crate) struct TokenArgs<'a> {
    pub logp: &'a Tensor,
    /// The second policy's log-probs and the argument's name (`logp_mu` or `logp_ref`).
    pub other: (&'a Tensor, &'static str),
    /// Rewards or advantages and the argument's name, if the loss takes them.
    pub weights: Option<(&'a Tensor, &'static str)>,
    pub mask: &'a Tensor,
    /// Whether per-token weights `[B, T]` are accepted besides per-sequence ones `[B]`.
    pub per_token_weights: bool,
    /// Whether values are checked (host reads) or only shapes.
    pub checks: Checks,
}

/// Checked token-level inputs in the compute dtype, with padding replaced by zero.
pub(crate) struct TokenInputs {
    pub kind: Kind,
    /// `[B, T]` bool.
    pub mask: Tensor,
    /// `[B, T]` `log π` in the compute dtype, differentiable, padding as given (possibly NaN):
    /// read it through [`TokenInputs::logp`], which zeroes the padding.
    logp_raw: Tensor,
    /// Whether the full checks proved every entry of both log-prob inputs finite, padding
    /// included (then padding can be zeroed by a product with the mask instead of `where`).
    padding_finite: bool,
    /// `[B, T]` `log π − sg(log other)`, zero on padding.
    pub delta: Tensor,
    /// `[B]` or `[B, T]` (zero on padding) rewards/advantages, detached; an undefined tensor
    /// (`Tensor::new()`) for a loss that takes none (any use of it is then a libtorch error).
    weights: Tensor,
    /// `[B, T]`, the mask as 0/1 in the compute dtype.
    pub mask_f: Tensor,
    /// `[B]`, `L_i` in the compute dtype.
    pub lengths: Tensor,
    /// `[B]`, 1 where `L_i > 0`, in the compute dtype.
    pub has_tokens: Tensor,
    /// The checks level of the call.
    pub checks: Checks,
}

pub(crate) fn check(args: TokenArgs) -> Result<TokenInputs, LossError> {
    let (other, other_name) = args.other;
    let mut kinds = vec![validate::float_tensor(args.logp, "logp")?, validate::float_tensor(other, other_name)?];
    if let Some((w, name)) = args.weights {
        kinds.push(validate::float_tensor(w, name)?);
    }
    let shape = validate::rank(args.logp, "logp", 2, "[B, T] per-token log-probabilities")?;
    validate::non_empty(&shape, "logp", "sequence")?;
    validate::same_shape(other, other_name, &shape, "the shape of `logp`")?;
    let m = validate::bool_mask_with(args.mask, "mask", args.checks)?;
    validate::same_shape(&m, "mask", &shape, "the shape of `logp`")?;
    let device = args.logp.device();
    validate::same_device(other, other_name, device, "logp")?;
    validate::same_device(&m, "mask", device, "logp")?;
    let per_token = match args.weights {
        Some((w, name)) => {
            let per_token = w.dim() == 2;
            if per_token && args.per_token_weights {
                validate::same_shape(w, name, &shape, "the shape of `logp` (per-token values)")?;
            } else {
                validate::same_shape(w, name, &shape[..1], "[B], one value per sequence of `logp`")?;
            }
            validate::same_device(w, name, device, "logp")?;
            per_token
        }
        None => false,
    };

    let kind = validate::compute_kind(&kinds);
    let lp = args.logp.f_to_kind(kind)?;
    let lo = other.f_detach()?.f_to_kind(kind)?;
    let weights = match args.weights {
        Some((w, _)) => {
            let w = w.f_detach()?.f_to_kind(kind)?;
            if per_token { masked_fill_zero(&w, &m)? } else { w }
        }
        None => Tensor::new(),
    };
    let mask_f = mask_float(&m, kind)?;
    let d = lp.f_sub(&lo)?;
    // Padding gets zero in `δ` and exactly zero gradient, whatever it holds. Under full checks `δ`
    // is first zeroed by the mask product ([`zero_padding`]), assuming padding finite; the sum the
    // finiteness check reads anyway then tells: a finite sum of `δ · m` proves every entry of `δ`
    // finite — hence both inputs finite everywhere — and the product stands (equal to `where` up
    // to the sign of zero). Otherwise (NaN or inf in padding, or an overflowing sum), and under
    // shape checks, which prove nothing, `δ` is zeroed by `where`.
    let full = args.checks.values();
    let first = zero_padding(&d, &m, &mask_f, full)?;
    // One pass covers both log-prob inputs: `δ = log π − log other` is finite exactly where both
    // are (an overflow of the difference only sends the check to each argument, which clears it).
    let mut checks = vec![FiniteCheck {
        clean: &first,
        original: args.logp,
        argument: "logp",
        valid: Some(&m),
        also: Some((other, other_name)),
    }];
    if let Some((original, argument)) = args.weights {
        checks.push(FiniteCheck { clean: &weights, original, argument, valid: per_token.then_some(&m), also: None });
    }
    let log_probs = [
        LogProbCheck { t: args.logp, argument: "logp", valid: Some(&m) },
        LogProbCheck { t: other, argument: other_name, valid: Some(&m) },
    ];
    let padding_finite = full && validate::all_finite_sums_and_log_probs(&checks, &log_probs)?[0].is_finite();
    let delta = if full && !padding_finite { zero_padding(&d, &m, &mask_f, false)? } else { first };
    let lengths = mask_f.f_sum_dim_intlist(1, false, kind)?;
    let has_tokens = lengths.f_gt(0.0)?.f_to_kind(kind)?;
    Ok(TokenInputs {
        kind,
        delta,
        logp_raw: lp,
        padding_finite,
        weights,
        mask_f,
        lengths,
        has_tokens,
        mask: m,
        checks: args.checks,
    })
}

impl TokenInputs {
    /// The weights (rewards or advantages) of a loss that takes them.
    pub(crate) fn weights(&self) -> &Tensor {
        &self.weights
    }

    /// `[B, T]` `log π`, zero on padding, differentiable (padding gets exactly zero gradient).
    pub(crate) fn logp(&self) -> Result<Tensor, LossError> {
        zero_padding(&self.logp_raw, &self.mask, &self.mask_f, self.padding_finite)
    }

    /// Per-sequence mean of `δ` over the unmasked tokens, `[B]` (0 for an empty sequence).
    pub(crate) fn mean_delta(&self) -> Result<Tensor, LossError> {
        Ok(self.delta.f_sum_dim_intlist(1, false, None::<Kind>)?.f_div(&self.lengths.f_clamp_min(1.0)?)?)
    }

    /// Weights broadcastable to `[B, T]`: `[B, 1]` for per-sequence ones.
    pub(crate) fn weights_per_token(&self) -> Result<Tensor, LossError> {
        let w = self.weights();
        Ok(if w.dim() == 1 { w.f_unsqueeze(1)? } else { w.shallow_clone() })
    }

    /// Per-token values broadcastable to `[B, T]`, expanded, with padding replaced by zero.
    pub(crate) fn zero_padding(&self, per_token: &Tensor) -> Result<Tensor, LossError> {
        masked_fill_zero(&per_token.f_expand(self.mask.size().as_slice(), false)?, &self.mask)
    }

    /// `Σ_i α_i Σ_t m ℓ_{i,t}` for per-token losses broadcastable to `[B, T]`; padding is replaced
    /// by zero whatever it holds.
    pub(crate) fn reduce_tokens(
        &self,
        per_token: &Tensor,
        mode: AggregationMode,
        norm: &Normalizer,
    ) -> Result<Tensor, LossError> {
        weighted_sum(&self.zero_padding(per_token)?, &self.sequence_weights(mode, norm)?)
    }

    /// [`TokenInputs::reduce_tokens`] for per-token terms computed from these sanitised inputs
    /// alone (padding zero in `logp`, `δ` and per-token weights), which are therefore finite on
    /// padding whenever the real entries are: padding is zeroed by multiplying with the 0/1 mask,
    /// one vectorised pass, where `where` is an element-by-element loop on the CPU (about 4×
    /// slower at `[512, 2048]`). `logp`'s padding still gets exactly zero gradient: the `where` or
    /// the mask product that sanitised `δ` (or [`TokenInputs::logp`]) zeroes whatever reaches it.
    pub(crate) fn reduce_sanitized_tokens(
        &self,
        per_token: &Tensor,
        mode: AggregationMode,
        norm: &Normalizer,
    ) -> Result<Tensor, LossError> {
        weighted_sum(&per_token.f_mul(&self.mask_f)?, &self.sequence_weights(mode, norm)?)
    }

    /// The loss of per-token terms computed from these sanitised inputs alone
    /// ([`TokenInputs::reduce_sanitized_tokens`]), refused when it is not finite under full
    /// checks ([`validate::finite_loss`]).
    pub(crate) fn sanitized_loss(
        &self,
        per_token: &Tensor,
        mode: AggregationMode,
        norm: &Normalizer,
    ) -> Result<Tensor, LossError> {
        validate::finite_loss(self.reduce_sanitized_tokens(per_token, mode, norm)?, self.checks)
    }

    /// `Σ_i α_i V_i` for per-sequence values `V [B]` (a sequence's total over its tokens).
    pub(crate) fn reduce_sequences(
        &self,
        per_seq: &Tensor,
        mode: AggregationMode,
        norm: &Normalizer,
    ) -> Result<Tensor, LossError> {
        Ok(per_seq.f_mul(&self.sequence_weights(mode, norm)?)?.f_sum(None::<Kind>)?)
    }

    /// The per-sequence weights `α [B]` of `mode` (`aggregate::sequence_weights_checked`), from the
    /// lengths computed once in [`check`].
    fn sequence_weights(&self, mode: AggregationMode, norm: &Normalizer) -> Result<Tensor, LossError> {
        sequence_weights_of_lengths(&self.lengths, &self.mask, mode, norm, self.kind, self.checks)
    }
}
