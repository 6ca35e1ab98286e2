//! Supervised terms mixed into RL: CHORD's weighted SFT loss on expert data with its schedule
//! `μ`, and VAPO's NLL on the policy's own positive samples.
//!
//! ```text
//! p_t = exp(log π_t) ∈ [0, 1]                          (a log-probability is ≤ 0: bounded)
//! SFT-φ     ℓ_t = −sg(w_t) · log π_t,  w = 1 (SFT), p(1 − p) (CHORD-φ), p (Trinity's sft_is)
//! CHORD     L = (1 − μ) · L_RL(usual rows) + μ · L_SFT(expert rows),  μ = chord_mu(step, ..)
//! VAPO      L = L_PPO + μ · L_NLL,  L_NLL = −Σ_{i ∈ T} Σ_t log π_{i,t} / Σ_{i ∈ T} |o_i|
//!           (T the batch's positive, i.e. verifier-correct, completions; μ = 0.1)
//! ```

use crate::aggregate::{
    AggregationMode, Normalizer, mask_float, masked_fill_zero, sequence_weights_checked, weighted_sum,
};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct, stats};
use crate::validate::{self, FiniteCheck, LogProbCheck};
use tch::{Device, Kind, Tensor};

/// CHORD's schedule of the SFT weight `μ`: a linear warm-up to `peak`, a cosine decay to
/// `valley`, then `valley`.
///
/// ```text
/// μ(s) = s / warmup · peak                                              s < warmup
///      = (peak − valley) · ½ (1 + cos(π (s − warmup) / decay)) + valley  warmup ≤ s < warmup + decay
///      = valley                                                         s ≥ warmup + decay
/// ```
///
/// With `warmup = decay = 0`, `μ = valley` at every step (CHORD-φ's constant 0.1). The warm-up
/// starts from 0 at step 0, not from `valley`. Combine the two losses as
/// `(1 − μ) · L_RL + μ · L_SFT`: see [`sft_phi_loss`].
///
/// Reference: Zhang, Xie et al., *On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised
/// Fine-Tuning and Reinforcement Learning via Dynamic Weighting* (CHORD), arXiv 2508.11408 (the
/// global coefficient μ of its hybrid loss); Trinity-RFT
/// `trinity/algorithm/policy_loss_fn/chord_policy_loss.py::mu_schedule_function(global_step,
/// mu_warmup_steps, mu_decay_steps, mu_peak, mu_valley)` (restated in the tests, equal values),
/// `mix_chord`'s defaults `0, 0, 0.1, 0.1`; its CHORD-μ example `0, 200, 0.9, 0.05` and the
/// `mix_chord` example `200, 400, 0.5, 0.02`.
///
/// # Arguments
/// * `step` — the training step (Trinity's `global_step`, the same for the whole batch).
/// * `warmup`, `decay` — the lengths of the two phases, in steps.
/// * `peak`, `valley` — `μ` at the end of the warm-up and after the decay, in `[0, 1]` (a mixing
///   weight; `valley > peak` makes the cosine phase rise).
///
/// # Errors
/// [`LossError::InvalidArgument`] naming `peak` or `valley` when it is not in `[0, 1]` (Trinity
/// does not check).
///
/// # Example
/// ```
/// use topr_loss::chord_mu;
/// assert_eq!(chord_mu(100, 200, 400, 0.5, 0.02)?, 0.25); // half-way through the warm-up
/// assert_eq!(chord_mu(200, 200, 400, 0.5, 0.02)?, 0.5); // the peak
/// assert!((chord_mu(400, 200, 400, 0.5, 0.02)? - 0.26).abs() < 1e-15); // half the decay: (0.5 + 0.02)/2
/// assert_eq!(chord_mu(600, 200, 400, 0.5, 0.02)?, 0.02); // the valley from then on
/// assert_eq!(chord_mu(7, 0, 0, 0.1, 0.1)?, 0.1); // CHORD-φ: constant
/// assert!(chord_mu(0, 0, 0, 1.5, 0.1).is_err());
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn chord_mu(step: u64, warmup: u64, decay: u64, peak: f64, valley: f64) -> Result<f64, LossError> {
    for (value, argument) in [(peak, "peak"), (valley, "valley")] {
        if !(0.0..=1.0).contains(&value) {
            return Err(LossError::InvalidArgument {
                argument,
                value,
                reason: "μ weighs the SFT term against the RL term: it must lie in [0, 1]".into(),
            });
        }
    }
    if step < warmup {
        return Ok(step as f64 / warmup as f64 * peak);
    }
    if step >= warmup.saturating_add(decay) {
        return Ok(valley);
    }
    let into = (step - warmup) as f64;
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * into / decay as f64).cos());
    Ok((peak - valley) * cosine + valley)
}

/// The stop-gradient weight of each expert token in [`sft_phi_loss`], a function of the policy's
/// probability of the token `p = exp(log π)`.
///
/// # Example
/// ```
/// assert_eq!(topr_loss::SftPhiConfig::default().weight, topr_loss::SftWeight::Phi);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum SftWeight {
    /// `w = 1`: plain SFT, the negative log-likelihood (Trinity's `sft`; CHORD-μ, which has
    /// `enable_phi_function=False`).
    Uniform,
    /// `w = p (1 − p)`: CHORD-φ, largest (1/4) at `p = 1/2`, vanishing for tokens the policy
    /// already predicts (`p → 1`) and for those far from it (`p → 0`) (Trinity's `sft_phi`).
    Phi,
    /// `w = p`: SFT weighted by the policy's own probability of the token, an importance weight
    /// against a deterministic expert (Trinity's `sft_is`).
    Probability,
}

/// The token weight, cutoff and aggregation of [`sft_phi_loss`].
///
/// `Default` is [`SftPhiConfig::chord_phi`].
///
/// Reference: CHORD, arXiv 2508.11408 (the token-wise weighting function `φ(p) = p (1 − p)` of
/// CHORD-φ); Trinity-RFT `chord_policy_loss.py`: `SFTPhiLossFn(use_token_level_loss,
/// cutoff_prob)` ("sft_phi"), `SFTISLossFn` ("sft_is"), and `sft_loss.py::SFTLossFn` ("sft").
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, SftPhiConfig, SftWeight};
/// let cfg = SftPhiConfig::default();
/// assert_eq!((cfg.weight, cfg.cutoff_prob, cfg.aggregation), (SftWeight::Phi, 1.0, AggregationMode::TokenMean));
/// assert!(cfg.with_cutoff_prob(0.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct SftPhiConfig {
    /// The token weight `w(p)`.
    pub weight: SftWeight,
    /// `c ∈ (0, 1]`: `log π` is clamped at `ln c`, so tokens with `p > c` get zero gradient
    /// (Trinity's `cutoff_prob`, default 1: no cutoff; `mix_chord` does not pass it). The weight
    /// is computed from the unclamped `p`.
    pub cutoff_prob: f64,
    /// How per-token losses are reduced (Trinity: `TokenMean`; `use_token_level_loss=False` is
    /// `SeqMeanTokenMean`).
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for SftPhiConfig {
    fn default() -> Self {
        Self::chord_phi()
    }
}

impl SftPhiConfig {
    /// CHORD-φ: `w = p (1 − p)`, no cutoff, `TokenMean` (Trinity's `sft_phi` defaults, and
    /// `mix_chord`'s `enable_phi_function=True`).
    ///
    /// ```
    /// assert_eq!(topr_loss::SftPhiConfig::chord_phi(), topr_loss::SftPhiConfig::default());
    /// ```
    pub const fn chord_phi() -> Self {
        Self { weight: SftWeight::Phi, cutoff_prob: 1.0, aggregation: AggregationMode::TokenMean, checks: Checks::Full }
    }

    /// Plain SFT, `w = 1`, `TokenMean` (Trinity's `sft`; CHORD-μ's SFT term).
    ///
    /// ```
    /// assert_eq!(topr_loss::SftPhiConfig::sft().weight, topr_loss::SftWeight::Uniform);
    /// ```
    pub const fn sft() -> Self {
        Self::chord_phi().with_weight(SftWeight::Uniform)
    }

    /// SFT weighted by `p`, `TokenMean` (Trinity's `sft_is`).
    ///
    /// ```
    /// assert_eq!(topr_loss::SftPhiConfig::sft_is().weight, topr_loss::SftWeight::Probability);
    /// ```
    pub const fn sft_is() -> Self {
        Self::chord_phi().with_weight(SftWeight::Probability)
    }

    /// The same config with another token weight.
    ///
    /// ```
    /// use topr_loss::{SftPhiConfig, SftWeight};
    /// assert_eq!(SftPhiConfig::chord_phi().with_weight(SftWeight::Uniform), SftPhiConfig::sft());
    /// ```
    pub const fn with_weight(self, weight: SftWeight) -> Self {
        Self { weight, ..self }
    }

    /// The same config with another cutoff probability.
    ///
    /// ```
    /// assert_eq!(topr_loss::SftPhiConfig::chord_phi().with_cutoff_prob(0.9).cutoff_prob, 0.9);
    /// ```
    pub const fn with_cutoff_prob(self, cutoff_prob: f64) -> Self {
        Self { cutoff_prob, ..self }
    }

    crate::setters::setters!(SftPhiConfig, chord_phi(); checks, aggregation);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming `cutoff_prob` when it is not in `(0, 1]` (Trinity
    /// accepts 0, where `ln 0 = −∞` makes every loss infinite).
    ///
    /// ```
    /// assert!(topr_loss::SftPhiConfig::chord_phi().with_cutoff_prob(f64::NAN).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if !(self.cutoff_prob > 0.0 && self.cutoff_prob <= 1.0) {
            return Err(LossError::InvalidConfig {
                field: "cutoff_prob",
                value: self.cutoff_prob,
                reason: "the cutoff probability must lie in (0, 1] (1: no cutoff)".into(),
            });
        }
        Ok(())
    }
}

/// What a trainer logs next to an SFT-φ term, over the unmasked tokens, from the same pass
/// ([`sft_phi_loss_output`]).
///
/// ```text
/// nll_mean         mean of −log π (the plain SFT loss, token-mean)
/// prob_mean        mean of p = exp(log π)
/// weight_mean      mean of the stop-gradient weight w
/// cutoff_fraction  share of tokens with p > cutoff_prob (zero gradient)
/// ```
///
/// Reference: Trinity-RFT logs the loss only (`sft_phi_loss`, `sft_is_loss`, `sft_loss`).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{sft_phi_loss_output, Normalizer, SftPhiConfig};
/// let lp = Tensor::from_slice2(&[[0.5f64.ln(), 1.0f64.ln()]]);
/// let d = sft_phi_loss_output(&lp, &lp.ones_like(), &SftPhiConfig::chord_phi(), &Normalizer::local())?.diagnostics.read()?;
/// assert_eq!(d.tokens, 2);
/// assert!((d.prob_mean - 0.75).abs() < 1e-12 && (d.weight_mean - 0.125).abs() < 1e-12); // φ = 1/4 and 0
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SftDiagnostics {
    /// Number of unmasked tokens in this call.
    pub tokens: i64,
    /// Mean `−log π` over them.
    pub nll_mean: f64,
    /// Mean `p` over them.
    pub prob_mean: f64,
    /// Mean weight `w` over them.
    pub weight_mean: f64,
    /// Share of them above the cutoff (`p > cutoff_prob`), which get no gradient.
    pub cutoff_fraction: f64,
}

diagnostics_struct!(SftDiagnostics { tokens, nll_mean, prob_mean, weight_mean, cutoff_fraction });

/// The checked `log π` in the compute dtype with padding replaced by zero (differentiable, zero
/// gradient there), the bool mask, what `more` returns (the checks of further arguments, given
/// the shape of `logp` and its device) and the dtype. Shapes, dtypes and devices of every argument
/// first, then the values (one host read).
fn check_logp<T>(
    logp: &Tensor,
    mask: &Tensor,
    checks: Checks,
    more: impl FnOnce(&[i64], Device) -> Result<T, LossError>,
) -> Result<(Tensor, Tensor, T, Kind), LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(logp, "logp")?]);
    let shape = validate::rank(logp, "logp", 2, "[B, T] per-token log-probabilities")?;
    validate::non_empty(&shape, "logp", "sequence")?;
    let m = validate::bool_mask_with(mask, "mask", checks)?;
    validate::same_shape(&m, "mask", &shape, "the shape of `logp`")?;
    validate::same_device(&m, "mask", logp.device(), "logp")?;
    let extra = more(&shape, logp.device())?;
    let clean = masked_fill_zero(&logp.f_to_kind(kind)?, &m)?;
    if checks.values() {
        let finite = [FiniteCheck { clean: &clean, original: logp, argument: "logp", valid: Some(&m), also: None }];
        let log_probs = [LogProbCheck { t: logp, argument: "logp", valid: Some(&m) }];
        validate::all_finite_sums_and_log_probs(&finite, &log_probs)?;
    }
    Ok((clean, m, extra, kind))
}

/// The per-token terms of [`sft_phi_loss`] (zero on padding), with what the diagnostics read:
/// `(terms, mask, dtype, log π zero on padding, p, w)`.
fn sft_terms(
    logp: &Tensor,
    mask: &Tensor,
    cfg: &SftPhiConfig,
) -> Result<(Tensor, Tensor, Kind, Tensor, Tensor, Tensor), LossError> {
    cfg.validate()?;
    let (lp, m, (), kind) = check_logp(logp, mask, cfg.checks, |_, _| Ok(()))?;
    // p = exp(min(log π, 0)) ∈ [0, 1]: a log-probability is ≤ 0, so the exponential is bounded;
    // the min only guards unchecked inputs (Checks::Shapes) and rounding above 0.
    let p = lp.f_detach()?.f_clamp_max(0.0)?.f_exp()?;
    let w = match cfg.weight {
        SftWeight::Uniform => p.f_ones_like()?,
        SftWeight::Phi => p.f_mul(&p.f_neg()?.f_add_scalar(1.0)?)?,
        SftWeight::Probability => p.shallow_clone(),
    };
    // Clamped only below a cutoff (as Trinity), so that `log π = 0` keeps its gradient at c = 1.
    let target = if cfg.cutoff_prob < 1.0 { lp.f_clamp_max(cfg.cutoff_prob.ln())? } else { lp.shallow_clone() };
    let per_token = match cfg.weight {
        SftWeight::Uniform => target.f_neg()?,
        _ => target.f_mul(&w)?.f_neg()?,
    };
    // Finite on padding (log π is 0 there, clamped to ln c): the 0/1 product zeroes it, and the
    // `where` in `check_logp` already gave padding exactly zero gradient.
    let terms = per_token.f_mul(&mask_float(&m, kind)?)?;
    Ok((terms, m, kind, lp, p, w))
}

/// CHORD's SFT term on expert data: the negative log-likelihood of each expert token weighted by
/// a stop-gradient function of the policy's probability of it.
///
/// ```text
/// p_t  = exp(log π_t)                       ≤ 1: log π ≤ 0, so the exponential is bounded
/// w_t  = 1 | p_t (1 − p_t) | p_t            (SftWeight::Uniform | Phi | Probability)
/// ℓ_t  = −sg(w_t) · min(log π_t, ln c)      (c = cutoff_prob; no clamp at c = 1)
/// loss = aggregate(ℓ, mask)                 (TokenMean by default)
/// ∂loss/∂log π_t = −α_i w_t where p_t ≤ c, 0 above it
/// ```
///
/// The value holds `log π` (a surrogate; with `w = 1` it is the SFT loss itself); the gradient
/// is exactly `−α_i w_t` per token: `w` is not differentiated. `φ` is largest (1/4) at `p = 1/2`
/// and vanishes at both ends, so CHORD-φ learns from the expert tokens the policy is unsure of
/// and leaves those it already predicts, or cannot follow, alone.
///
/// **CHORD's mix.** `L = (1 − μ) · L_RL + μ · L_SFT` with `μ` from [`chord_mu`]: the RL loss on
/// the policy's own (usual) rows, this loss on the expert rows, each a token mean over its own
/// rows. With one batch holding both kinds of rows, pass each loss its rows' mask (`mask ∧
/// ¬expert`, `mask ∧ expert`): a row masked out weighs nothing. The expert rows need finite
/// `logp_mu` and advantages for the RL call (any: e.g. `logp` detached and 0), and a batch without
/// an expert row has no SFT term (Trinity adds 0; a call with no token is
/// [`LossError::EmptyBatch`] unless its [`Normalizer`] gives the count). Trinity's RL loss is its
/// `PPOPolicyLossFn`: PPO-clip with `ε = 0.2` and dual clip `c = 3`, δ clamped to ±20, token-mean
/// ([`crate::PpoConfig::ppo`]`().with_dual_clip(Some(3.0))`).
///
/// **Trinity's rescaling and the crate's [`Normalizer`].** Trinity multiplies each micro-batch's
/// per-type token mean by `n_type · gradient_accumulation / train_batch_size_type` (and its actor
/// divides every micro-batch loss by `gradient_accumulation`), so that over a step the
/// micro-batches of each type add up weighted by their share of that type's rows. Here the same
/// aim is reached exactly with one [`Normalizer`] per type over the whole step:
/// `Normalizer::from_masks(&[usual masks of every micro-batch])` for the RL term and
/// `Normalizer::from_masks(&[expert masks …])` for the SFT term, passed to the `…_output` calls:
/// each type's micro-batch losses then add up to its token mean over the step, whatever the split.
/// The two agree when the step is one micro-batch (both are the plain per-type token means) or
/// when every micro-batch has as many tokens per row of a type; otherwise Trinity weighs rows, the
/// crate tokens.
///
/// Reference: CHORD, arXiv 2508.11408 (`L = (1 − μ) L_GRPO + μ L_SFT`; CHORD-φ's `φ = p(1 − p)`);
/// Trinity-RFT `chord_policy_loss.py`: `SFTPhiLossFn` (`masked_mean(-logprob * phi.detach(),
/// mask)`, `phi_function(p) = p * (1 - p)`, `cutoff_prob`), `SFTISLossFn`, `MIXCHORDPolicyLossFn`
/// ("mix_chord"); restated in `tests/reference/peer_trinity_chord.py` and matched, values and
/// gradients (Trinity's `masked_mean` adds 1e-8 to the count).
///
/// # Arguments
/// * `logp` — `[B, T]` per-token log-probs of the expert's tokens under the policy
///   (differentiable).
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating: the expert tokens.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`], naming
/// `logp` and `mask` (under [`Checks::Full`], also [`LossError::PositiveLogProb`]);
/// [`LossError::NonFiniteLoss`] if the result overflows.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{sft_phi_loss, SftPhiConfig};
///
/// let logp = Tensor::from_slice2(&[[0.5f64.ln(), 0.8f64.ln(), f64::NAN]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let loss = sft_phi_loss(&logp, &mask, &SftPhiConfig::chord_phi())?;
/// // φ(0.5) = 0.25, φ(0.8) = 0.16, token mean over 2.
/// let want = -(0.25 * 0.5f64.ln() + 0.16 * 0.8f64.ln()) / 2.0;
/// assert!((loss.double_value(&[]) - want).abs() < 1e-12);
/// loss.backward();
/// let g = Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?;
/// assert!((g[0] + 0.125).abs() < 1e-12 && (g[1] + 0.08).abs() < 1e-12 && g[2] == 0.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// CHORD's mix of PPO on the policy's own rows and SFT-φ on the expert's, at step 300 of
/// Trinity's `mix_chord` example schedule:
/// ```
/// use tch::Tensor;
/// use topr_loss::{chord_mu, ppo_clip_loss, sft_phi_loss, PpoConfig, SftPhiConfig};
///
/// let logp = Tensor::from_slice2(&[[-0.5f64, -1.0], [-0.2, -2.0], [-0.7, -0.1]]).set_requires_grad(true);
/// let logp_mu = logp.detach(); // the expert row's value is unused
/// let advantages = Tensor::from_slice(&[1.0f64, -1.0, 0.0]); // 0 on the expert row
/// let mask = Tensor::from_slice2(&[[true, true], [true, false], [true, true]]);
/// let expert = Tensor::from_slice(&[false, false, true]);
/// let usual_mask = mask.logical_and(&expert.logical_not().unsqueeze(1));
/// let expert_mask = mask.logical_and(&expert.unsqueeze(1));
///
/// let mu = chord_mu(300, 200, 400, 0.5, 0.02)?;
/// let ppo = PpoConfig::ppo().with_dual_clip(Some(3.0)); // Trinity's PPOPolicyLossFn
/// let rl = ppo_clip_loss(&logp, &logp_mu, &advantages, &usual_mask, &ppo)?;
/// let sft = sft_phi_loss(&logp, &expert_mask, &SftPhiConfig::chord_phi())?;
/// let loss = &rl * (1.0 - mu) + &sft * mu;
/// loss.backward();
/// // The usual rows get PPO's on-policy gradient −A/3 scaled by 1 − μ; the expert row −φ/2 · μ.
/// let g = logp.grad();
/// assert!((g.double_value(&[0, 0]) + (1.0 - mu) / 3.0).abs() < 1e-12);
/// let p = (-0.1f64).exp();
/// assert!((g.double_value(&[2, 1]) + mu * p * (1.0 - p) / 2.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn sft_phi_loss(logp: &Tensor, mask: &Tensor, cfg: &SftPhiConfig) -> Result<Tensor, LossError> {
    Ok(sft_phi_loss_output(logp, mask, cfg, &Normalizer::local())?.loss)
}

/// [`sft_phi_loss`] with the counts of `norm`, its per-token terms `−sg(w) min(log π, ln c)`
/// (`[B, T]`, zero on padding) and its [`SftDiagnostics`].
///
/// For the SFT term of a step split into micro-batches, `norm` counts the expert tokens of the
/// whole step (`Normalizer::from_masks(&[expert masks])`).
///
/// Reference: as [`sft_phi_loss`].
///
/// # Errors
/// As [`sft_phi_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{sft_phi_loss_output, BatchCounts, Normalizer, SftPhiConfig};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let norm = Normalizer::global(BatchCounts { tokens: 4.0, sequences: 2.0 }); // the whole step's
/// let out = sft_phi_loss_output(&lp, &mask, &SftPhiConfig::sft(), &norm)?;
/// assert!((out.loss.double_value(&[]) - 3.0 / 4.0).abs() < 1e-12);
/// assert_eq!(out.terms.double_value(&[0, 2]), 0.0);
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.tokens, d.nll_mean, d.cutoff_fraction), (2, 1.5, 0.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn sft_phi_loss_output(
    logp: &Tensor,
    mask: &Tensor,
    cfg: &SftPhiConfig,
    norm: &Normalizer,
) -> Result<LossOutput<SftDiagnostics>, LossError> {
    let (terms, m, kind, lp, p, w) = sft_terms(logp, mask, cfg)?;
    let alpha = sequence_weights_checked(&m, cfg.aggregation, norm, kind, cfg.checks)?;
    let loss = validate::finite_loss(weighted_sum(&terms, &alpha)?, cfg.checks)?;
    let tokens = stats::count(&m)?;
    let cut = p.f_gt(cfg.cutoff_prob)?.f_logical_and(&m)?;
    let diagnostics = OnDevice::new(&[
        tokens.shallow_clone(),
        stats::mean_where(&lp.f_detach()?.f_neg()?, &m)?,
        stats::mean_where(&p, &m)?,
        stats::mean_where(&w, &m)?,
        stats::share(&stats::count(&cut)?, &tokens)?,
    ])?;
    Ok(LossOutput { loss, terms, diagnostics })
}

/// The coefficient and aggregation of [`positive_nll_loss`].
///
/// `Default` is [`PositiveNllConfig::vapo`].
///
/// Reference: Yue et al. (ByteDance Seed), *VAPO: Efficient and Reliable Reinforcement Learning
/// for Advanced Reasoning Tasks*, arXiv 2504.05118, §3.3 "Positive Example LM Loss" (`μ = 0.1`).
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, PositiveNllConfig};
/// let cfg = PositiveNllConfig::default();
/// assert_eq!((cfg.coef, cfg.aggregation), (0.1, AggregationMode::TokenMean));
/// assert!(cfg.with_coef(f64::NAN).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct PositiveNllConfig {
    /// `μ`, the coefficient of the NLL term (finite; VAPO: 0.1). The loss is `μ · L_NLL`; 1 gives
    /// `L_NLL` itself.
    pub coef: f64,
    /// How the per-token NLL of the positive tokens is reduced (VAPO: `TokenMean`, over the
    /// positive tokens only).
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for PositiveNllConfig {
    fn default() -> Self {
        Self::vapo()
    }
}

impl PositiveNllConfig {
    /// VAPO's setting: `μ = 0.1`, a token mean over the positive tokens.
    ///
    /// ```
    /// assert_eq!(topr_loss::PositiveNllConfig::vapo(), topr_loss::PositiveNllConfig::default());
    /// ```
    pub const fn vapo() -> Self {
        Self { coef: 0.1, aggregation: AggregationMode::TokenMean, checks: Checks::Full }
    }

    /// The same config with another coefficient.
    ///
    /// ```
    /// assert_eq!(topr_loss::PositiveNllConfig::vapo().with_coef(1.0).coef, 1.0);
    /// ```
    pub const fn with_coef(self, coef: f64) -> Self {
        Self { coef, ..self }
    }

    /// The same config with another aggregation (over the positive tokens).
    ///
    /// ```
    /// use topr_loss::{AggregationMode, PositiveNllConfig};
    /// let c = PositiveNllConfig::vapo().with_aggregation(AggregationMode::SeqMeanTokenMean);
    /// assert_eq!(c.aggregation, AggregationMode::SeqMeanTokenMean);
    /// ```
    pub const fn with_aggregation(self, aggregation: AggregationMode) -> Self {
        Self { aggregation, ..self }
    }

    crate::setters::setters!(PositiveNllConfig, vapo(); checks);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming `coef` when it is not finite, or the fixed length of
    /// an [`AggregationMode::DrGrpo`] or [`AggregationMode::TokenSumNorm`] aggregation when it is
    /// not finite and `> 0` (checked here because a batch without a positive token has no loss to
    /// reduce).
    ///
    /// ```
    /// use topr_loss::{AggregationMode, PositiveNllConfig};
    /// let c = PositiveNllConfig::vapo().with_aggregation(AggregationMode::DrGrpo { length: 0.0 });
    /// assert!(c.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        validate::finite_field(self.coef, "coef")?;
        let length = match self.aggregation {
            AggregationMode::DrGrpo { length } => Some((length, "AggregationMode::DrGrpo::length")),
            AggregationMode::TokenSumNorm { length } => Some((length, "AggregationMode::TokenSumNorm::length")),
            _ => None,
        };
        if let Some((length, field)) = length {
            if !(length.is_finite() && length > 0.0) {
                return Err(LossError::InvalidConfig {
                    field,
                    value: length,
                    reason: "the fixed length must be finite and > 0".into(),
                });
            }
        }
        Ok(())
    }
}

/// What a trainer logs next to VAPO's NLL term, from the same pass ([`positive_nll_loss_output`]).
///
/// ```text
/// sequences   positive completions with at least one unmasked token
/// tokens      their unmasked tokens (the token mean's count)
/// nll_mean    mean −log π over those tokens, before coef (0 when there is none)
/// ```
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{positive_nll_loss_output, Normalizer, PositiveNllConfig};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -3.0], [-2.0, -2.0]]);
/// let positive = Tensor::from_slice(&[true, false]);
/// let out = positive_nll_loss_output(&lp, &lp.ones_like(), &positive, &PositiveNllConfig::vapo(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.sequences, d.tokens, d.nll_mean), (1, 2, 2.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct PositiveNllDiagnostics {
    /// Positive completions with at least one unmasked token in this call.
    pub sequences: i64,
    /// Their unmasked tokens.
    pub tokens: i64,
    /// Mean `−log π` over those tokens (0 when there is none).
    pub nll_mean: f64,
}

diagnostics_struct!(PositiveNllDiagnostics { sequences, tokens, nll_mean });

/// VAPO's positive-example LM loss: the negative log-likelihood of the policy's own correct
/// completions, a token mean over their tokens only, to add to a PPO loss.
///
/// ```text
/// T    = { i : positive_i }                    (verifier-correct completions of the batch)
/// L_NLL = −(1 / Σ_{i ∈ T} |o_i|) Σ_{i ∈ T} Σ_t m_{i,t} log π_{i,t}
/// loss  = μ · L_NLL                             (μ = coef = 0.1; 0 when T has no token)
/// L     = L_PPO + loss
/// ```
///
/// The normaliser is the number of **positive** tokens, not all tokens: with
/// [`AggregationMode::TokenMean`] this call divides by its own positive tokens (VAPO's batch
/// formula; cosmos-rl's per-micro-batch mean). That is not split-invariant: for a step split into
/// micro-batches, call [`positive_nll_loss_output`] with a [`Normalizer`] counting the positive
/// tokens of the whole step, `Normalizer::from_masks(&[&positive_mask_1, …])` with
/// `positive_mask_k = mask_k ∧ positive_k[:, None]` (its `sequences` then counts the positive
/// completions, for the sequence-mean modes). A batch without a positive token gives a loss of 0
/// (with zero gradient, not NaN: the `0/0` is guarded), where other losses refuse an empty batch.
///
/// The value is the NLL itself (no stop-gradient): the gradient is `−μ α_i` per positive token,
/// 0 elsewhere.
///
/// Reference: VAPO, arXiv 2504.05118, §3.3 (`L = L_PPO + μ L_NLL`, μ = 0.1, with DAPO's token-level
/// PPO and ε = 0.2/0.28: [`crate::PpoConfig::dapo`]); the paper's equation is restated in the
/// tests. Peer line: cosmos-rl's GRPO trainer (`train_policy.positive_nll_coef`; a completion is
/// positive when its reward is `> 0`; `loss += coef * -logp[positive_token_mask].mean()` per
/// micro-batch, skipped without a positive token), restated in
/// `tests/reference/peer_cosmos_nll.py`. Not in verl 0.9.1, TRL or NeMo-RL.
///
/// # Arguments
/// * `logp` — `[B, T]` per-token log-probs of the sampled tokens under the policy
///   (differentiable).
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
/// * `positive` — `[B]`, bool, integer or 0/1 floating: the completions whose tokens count (VAPO:
///   correct; e.g. `rewards.gt(0.0)`).
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`], naming
/// `logp`, `mask` and `positive` (under [`Checks::Full`], also [`LossError::PositiveLogProb`]);
/// [`LossError::NonFiniteLoss`] if the result overflows.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{positive_nll_loss, ppo_clip_loss, PositiveNllConfig, PpoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0, f64::NAN], [-0.5, -0.5, -0.5]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
/// let rewards = Tensor::from_slice(&[1.0f64, 0.0]);
/// let nll = positive_nll_loss(&logp, &mask, &rewards.gt(0.0), &PositiveNllConfig::vapo())?;
/// assert!((nll.double_value(&[]) - 0.1 * 1.5).abs() < 1e-12); // μ · (1 + 2)/2, row 0 only
/// let adv = Tensor::from_slice(&[1.0f64, -1.0]);
/// let loss = ppo_clip_loss(&logp, &logp.detach(), &adv, &mask, &PpoConfig::dapo())? + &nll;
/// loss.backward();
/// // Row 0: PPO's −A/5 and the NLL's −μ/2; row 1 (negative) PPO's only; padding 0.
/// let g = Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?;
/// assert!((g[0] + 0.2 + 0.05).abs() < 1e-12 && (g[3] - 0.2).abs() < 1e-12 && g[2] == 0.0);
/// // No positive completion: 0, not NaN.
/// let none = positive_nll_loss(&logp, &mask, &Tensor::from_slice(&[false, false]), &PositiveNllConfig::vapo())?;
/// assert_eq!(none.double_value(&[]), 0.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn positive_nll_loss(
    logp: &Tensor,
    mask: &Tensor,
    positive: &Tensor,
    cfg: &PositiveNllConfig,
) -> Result<Tensor, LossError> {
    Ok(positive_nll_loss_output(logp, mask, positive, cfg, &Normalizer::local())?.loss)
}

/// [`positive_nll_loss`] with the counts of `norm` (for split invariance, those of the positive
/// tokens of the whole step: see [`positive_nll_loss`]), its per-token terms `−μ log π` (`[B, T]`,
/// zero on padding and on the tokens of other completions) and its [`PositiveNllDiagnostics`].
///
/// Reference: as [`positive_nll_loss`].
///
/// # Errors
/// As [`positive_nll_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{positive_nll_loss_output, Normalizer, PositiveNllConfig};
///
/// // Two micro-batches of one step; the normaliser counts the step's positive tokens (3).
/// let (lp_a, m_a, pos_a) = (Tensor::from_slice2(&[[-1.0f64, -2.0]]), Tensor::from_slice2(&[[true, true]]), Tensor::from_slice(&[true]));
/// let (lp_b, m_b, pos_b) = (Tensor::from_slice2(&[[-3.0f64, 0.0]]), Tensor::from_slice2(&[[true, false]]), Tensor::from_slice(&[true]));
/// let positive_mask = |m: &Tensor, p: &Tensor| m.logical_and(&p.unsqueeze(1));
/// let norm = Normalizer::from_masks(&[&positive_mask(&m_a, &pos_a), &positive_mask(&m_b, &pos_b)])?;
/// let cfg = PositiveNllConfig::vapo().with_coef(1.0);
/// let a = positive_nll_loss_output(&lp_a, &m_a, &pos_a, &cfg, &norm)?.loss;
/// let b = positive_nll_loss_output(&lp_b, &m_b, &pos_b, &cfg, &norm)?.loss;
/// assert!((a.double_value(&[]) + b.double_value(&[]) - 2.0).abs() < 1e-12); // (1 + 2 + 3) / 3
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn positive_nll_loss_output(
    logp: &Tensor,
    mask: &Tensor,
    positive: &Tensor,
    cfg: &PositiveNllConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PositiveNllDiagnostics>, LossError> {
    cfg.validate()?;
    let (lp, m, flags, kind) = check_logp(logp, mask, cfg.checks, |shape, device| {
        let f = validate::bool_mask_with(positive, "positive", cfg.checks)?;
        validate::same_shape(&f, "positive", &shape[..1], "[B], one flag per sequence of `logp`")?;
        validate::same_device(&f, "positive", device, "logp")?;
        Ok(f)
    })?;
    let kept = m.f_logical_and(&flags.f_unsqueeze(1)?)?;
    // Replaced (not multiplied) outside the positive tokens: the other completions' tokens get
    // exactly zero value and gradient whatever they hold.
    let terms = masked_fill_zero(&lp.f_mul_scalar(-cfg.coef)?, &kept)?;
    // No positive token (and no global count): 0 instead of an empty-batch error. The config's
    // fixed lengths were checked above and `norm` is checked first, so nothing else is lost.
    let alpha = match sequence_weights_checked(&kept, cfg.aggregation, norm, kind, cfg.checks) {
        Err(LossError::EmptyBatch { .. }) => Tensor::f_zeros([m.size()[0]], (kind, lp.device()))?,
        other => other?,
    };
    let loss = validate::finite_loss(weighted_sum(&terms, &alpha)?, cfg.checks)?;
    let tokens = stats::count(&kept)?;
    let diagnostics = OnDevice::new(&[
        stats::count(&kept.f_sum_dim_intlist(1, false, Kind::Int64)?.f_gt(0)?)?,
        tokens,
        stats::mean_where(&lp.f_detach()?.f_neg()?, &kept)?,
    ])?;
    Ok(LossOutput { loss, terms, diagnostics })
}
