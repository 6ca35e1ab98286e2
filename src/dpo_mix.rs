//! A weighted sum of DPO-family losses on the same preference pairs: TRL's
//! `loss_type=[..]` with `loss_weights=[..]` (e.g. MPO's sigmoid + BCO pair, arXiv 2411.10442).
//!
//! ```text
//! loss = Σ_k w_k · (1/B) Σ_i ℓ_k,i            ℓ_k: the per-pair loss of term k's DpoConfig
//! ```
//!
//! Each term is a full [`DpoConfig`] (its own variant, `β`, `ε`, `τ`, reference or not); TRL shares
//! one `β`, one `label_smoothing` and one `discopop_tau` between its terms, which is the special case
//! of equal fields. TRL's `sft` term (the chosen completions' mean token NLL) is not a function of
//! sequence log-probs: add it to the loss yourself.

use crate::aggregate::Normalizer;
use crate::checks::Checks;
use crate::dpo::{DpoDiagnostics, dpo_diagnostics};
use crate::dpo_config::DpoConfig;
use crate::dpo_pairs::{Inputs, check_inputs, per_pair_loss};
use crate::error::LossError;
use crate::output::LossOutput;
use crate::validate;
use tch::{Kind, Tensor};

/// A weighted combination of up to [`DpoMix::MAX_TERMS`] DPO-family losses, for
/// [`dpo_mix_loss`].
///
/// Built from one term with [`DpoMix::of`] and grown with [`DpoMix::with_term`] (`const fn`,
/// `Copy`, like the other configs). The inputs are checked once, at the strictest [`Checks`] of
/// the terms, and with the reference arguments whenever one term uses a reference.
///
/// Reference: TRL 1.16 `DPOConfig.loss_type` and `loss_weights` (`DPOTrainer`: the sum over loss
/// types of `loss_weight · per_sequence_loss.mean()`).
///
/// # Example
/// ```
/// use topr_loss::{DpoConfig, DpoMix};
/// // MPO's preference part: 0.8 · sigmoid + 0.2 · BCO pair.
/// let mix = DpoMix::of(DpoConfig::dpo(), 0.8).with_term(DpoConfig::bco_pair(), 0.2);
/// assert_eq!(mix.terms().len(), 2);
/// assert!(mix.validate().is_ok());
/// assert!(DpoMix::of(DpoConfig::dpo(), f64::NAN).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(into = "Vec<(DpoConfig, f64)>", try_from = "Vec<(DpoConfig, f64)>"))]
#[non_exhaustive]
pub struct DpoMix {
    terms: [(DpoConfig, f64); DpoMix::MAX_TERMS],
    len: usize,
    /// Terms given beyond `MAX_TERMS` (an error in `validate`).
    dropped: usize,
}

impl DpoMix {
    /// The most terms a mix holds (TRL's examples use up to three).
    pub const MAX_TERMS: usize = 4;

    /// A mix of one loss `cfg` with weight `weight`.
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoMix};
    /// assert_eq!(DpoMix::of(DpoConfig::ipo(), 2.0).terms(), &[(DpoConfig::ipo(), 2.0)]);
    /// ```
    pub const fn of(cfg: DpoConfig, weight: f64) -> Self {
        Self { terms: [(cfg, weight); Self::MAX_TERMS], len: 1, dropped: 0 }
    }

    /// The same mix with one more term `weight · loss(cfg)`; beyond [`Self::MAX_TERMS`] terms,
    /// [`validate`](Self::validate) fails.
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoMix};
    /// let mix = DpoMix::of(DpoConfig::dpo(), 1.0).with_term(DpoConfig::sppo_hard(), 0.5);
    /// assert_eq!(mix.terms()[1], (DpoConfig::sppo_hard(), 0.5));
    /// ```
    pub const fn with_term(self, cfg: DpoConfig, weight: f64) -> Self {
        let mut out = self;
        if self.len < Self::MAX_TERMS {
            out.terms[self.len] = (cfg, weight);
            out.len += 1;
        } else {
            out.dropped += 1;
        }
        out
    }

    /// The terms `(config, weight)`, in order.
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoMix};
    /// assert_eq!(DpoMix::of(DpoConfig::dpo(), 1.0).terms()[0].1, 1.0);
    /// ```
    pub fn terms(&self) -> &[(DpoConfig, f64)] {
        &self.terms[..self.len]
    }

    /// Checks every term.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`]: a term's config is invalid ([`DpoConfig::validate`]); a
    /// weight is not finite (`field: "weight"`); more than [`Self::MAX_TERMS`] terms were given
    /// (`field: "terms"`).
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoMix, LossError};
    /// let five = (0..4).fold(DpoMix::of(DpoConfig::dpo(), 1.0), |m, _| m.with_term(DpoConfig::hinge(), 1.0));
    /// assert!(matches!(five.validate(), Err(LossError::InvalidConfig { field: "terms", .. })));
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if self.dropped > 0 {
            return Err(LossError::InvalidConfig {
                field: "terms",
                value: (self.len + self.dropped) as f64,
                reason: format!("a DpoMix holds at most {} terms", Self::MAX_TERMS),
            });
        }
        for (cfg, weight) in self.terms() {
            cfg.validate()?;
            validate::finite_field(*weight, "weight")?;
        }
        Ok(())
    }

    /// `Full` if any term checks values.
    fn checks(&self) -> Checks {
        if self.terms().iter().any(|(c, _)| c.checks == Checks::Full) { Checks::Full } else { Checks::Shapes }
    }
}

/// `Σ_k w_k ℓ_k,i` per pair (per rank for AOT terms).
fn mixed_terms(inputs: &Inputs, mix: &DpoMix) -> Result<Tensor, LossError> {
    let mut total: Option<Tensor> = None;
    for (cfg, weight) in mix.terms() {
        let term = per_pair_loss(&inputs.pairs(cfg.reference_free)?, cfg)?.f_mul_scalar(*weight)?;
        total = Some(match total {
            Some(t) => t.f_add(&term)?,
            None => term,
        });
    }
    // `validate` guarantees at least one term (`of` makes it).
    total.ok_or_else(|| LossError::InvalidConfig { field: "terms", value: 0.0, reason: "no term".into() })
}

fn check_mix(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    mix: &DpoMix,
) -> Result<Inputs, LossError> {
    mix.validate()?;
    let with_reference = mix.terms().iter().any(|(c, _)| !c.reference_free);
    check_inputs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, with_reference, mix.checks())
}

/// A weighted sum of DPO-family losses on the same pairs, each averaged over the pairs.
///
/// ```text
/// loss = Σ_k w_k · (1/B) Σ_i ℓ_k,i       ℓ_k: the per-pair loss of term k (see dpo_loss)
/// ```
///
/// Takes [`crate::dpo_loss`]'s arguments; the reference arguments may be undefined when every term
/// is reference-free.
///
/// Reference: TRL 1.16 `DPOTrainer` with `loss_type=[..]`, `loss_weights=[..]`; MPO (Wang et
/// al., arXiv 2411.10442) is `0.8 · sigmoid + 0.2 · bco_pair + 1.0 · sft`, whose SFT term is
/// not included here.
///
/// # Errors
/// As [`crate::dpo_loss`], and [`DpoMix::validate`]'s.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_loss, dpo_mix_loss, DpoConfig, DpoMix};
///
/// let pc = Tensor::from_slice(&[-10.0f64, -5.0]);
/// let pr = Tensor::from_slice(&[-12.0f64, -4.0]);
/// let rc = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let rr = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let mix = DpoMix::of(DpoConfig::dpo(), 0.8).with_term(DpoConfig::bco_pair(), 0.2);
/// let loss = dpo_mix_loss(&pc, &pr, &rc, &rr, &mix)?.double_value(&[]);
/// let dpo = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::dpo())?.double_value(&[]);
/// let bco = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::bco_pair())?.double_value(&[]);
/// assert!((loss - (0.8 * dpo + 0.2 * bco)).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_mix_loss(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    mix: &DpoMix,
) -> Result<Tensor, LossError> {
    let inputs = check_mix(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, mix)?;
    validate::finite_loss(mixed_terms(&inputs, mix)?.f_mean(None::<Kind>)?, mix.checks())
}

/// [`dpo_mix_loss`] with the number of pairs `S` from `norm` (`norm.sequences`, else `B`), its
/// per-pair terms `Σ_k w_k ℓ_k [B]` and the [`DpoDiagnostics`] of the first term's `β` and
/// reference.
///
/// ```text
/// loss = Σ_i Σ_k w_k ℓ_k,i / S
/// ```
///
/// Split-invariant with the global pair count unless a term is an AOT variant (which sorts within
/// the call).
///
/// Reference: as [`dpo_mix_loss`].
///
/// # Errors
/// As [`dpo_mix_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_mix_loss_output, DpoConfig, DpoMix, Normalizer};
///
/// let pc = Tensor::from_slice(&[-10.0f64, -5.0]);
/// let pr = Tensor::from_slice(&[-12.0f64, -4.0]);
/// let rc = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let rr = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let mix = DpoMix::of(DpoConfig::dpo().with_beta(0.5), 1.0).with_term(DpoConfig::apo_zero(), 0.5);
/// let out = dpo_mix_loss_output(&pc, &pr, &rc, &rr, &mix, &Normalizer::sequences(4.0))?;
/// assert_eq!(out.diagnostics.read()?.accuracy, 0.5); // rewards of the first term's β
/// let sum: f64 = Vec::<f64>::try_from(&out.terms)?.iter().sum();
/// assert!((out.loss.double_value(&[]) - sum / 4.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_mix_loss_output(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    mix: &DpoMix,
    norm: &Normalizer,
) -> Result<LossOutput<DpoDiagnostics>, LossError> {
    let inputs = check_mix(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, mix)?;
    let (first, _) = mix.terms[0];
    let p = inputs.pairs(first.reference_free)?;
    let pairs = norm.sequences_or(p.chosen.size()[0] as f64)?;
    let terms = mixed_terms(&inputs, mix)?;
    let loss = validate::finite_loss(terms.f_sum(None::<Kind>)?.f_div_scalar(pairs)?, mix.checks())?;
    Ok(LossOutput { loss, terms, diagnostics: dpo_diagnostics(&p, first.beta)? })
}
