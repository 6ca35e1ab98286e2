//! TOPR on per-token log-probabilities `[B, T]` with a padding mask: the form a training loop
//! feeds, with the ratio level and aggregation of each published implementation.
//!
//! Every setting gives, per unmasked token `t` of sequence `i`, the gradient
//!
//! ```text
//! ∇ℓ_{i,t} = −R'_i · [ρ]_a^b · ∇log π(y_{i,t})         ρ the ratio at the chosen level:
//!   RatioLevel::Sequence      ρ_i   = exp(Σ_t δ_{i,t})         (the paper)
//!   RatioLevel::SequenceMean  ρ_i   = exp((1/L_i) Σ_t δ_{i,t}) (verl's `topr` loss mode)
//!   RatioLevel::Token         ρ_i,t = exp(δ_{i,t})             (Trinity-RFT, ROLL)
//! ```
//!
//! reduced by an [`AggregationMode`] (`loss = Σ_i α_i Σ_t m ℓ_{i,t}`). The *value* is the tapered
//! objective whose gradient that is: a sequence contributes `−R'_i T(ρ_i)` (its tokens share it)
//! at the `Sequence` level, `−L_i R'_i T(ρ_i)` at the `SequenceMean` level (each token carries
//! `−R'_i T(ρ_i)`, as each token of verl's surrogate carries the same weight), and
//! `Σ_t −R'_i T(ρ_{i,t})` at the `Token` level. So published settings map one to one:
//!
//! | implementation | `ratio` | `aggregation` | `tie` |
//! |---|---|---|---|
//! | paper, length-normalised loss | `Sequence` | `SeqMeanTokenMean` | `Positive` |
//! | paper, no length normalisation | `Sequence` | `SeqMeanTokenSum` | `Positive` |
//! | verl `loss_mode=topr` | `SequenceMean` | `SeqMeanTokenMean` (verl's `loss_agg_mode`) | `Positive` |
//! | Trinity-RFT `topr` | `Token` | `TokenMean` | `Tapered` |
//!
//! Padding (mask false/0) may hold anything, NaN and inf included: it is replaced before any
//! arithmetic, so it gets exactly zero gradient.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::diagnostics::{ToprDiagnostics, topr_diagnostics};
use crate::error::LossError;
use crate::output::LossOutput;
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::topr::{guard_finite, positive_branch, tapered_terms};
use crate::topr_config::{TieRule, ToprConfig};
use tch::{Kind, Tensor};

/// At which level the importance ratio `π/μ` is formed.
///
/// Reference: the paper (arXiv 2503.14286) uses `Sequence`; verl `SequenceMean`; Trinity-RFT and
/// ROLL `Token`.
///
/// ```
/// use topr_loss::{RatioLevel, ToprTokenConfig};
/// assert_eq!(ToprTokenConfig::verl().ratio, RatioLevel::SequenceMean);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum RatioLevel {
    /// The sequence ratio `exp(Σ_t δ_t)` = `π(τ)/μ(τ)`: the paper's.
    #[default]
    Sequence,
    /// The length-normalised (geometric-mean) ratio `exp(mean_t δ_t)`: verl's.
    SequenceMean,
    /// One ratio per token, `exp(δ_t)`: Trinity-RFT's and ROLL's.
    Token,
}

/// Configuration of [`topr_token_loss`]: the family's limits, baseline and tie rule, the ratio
/// level and the aggregation.
///
/// `Default` is the paper: canonical limits, sequence ratio, each sequence's loss divided by its
/// length (`SeqMeanTokenMean`), ties positive. The counts the aggregation divides by are not
/// part of the config: they belong to one optimiser step and are given to
/// [`topr_token_loss_output`] as a [`Normalizer`].
///
/// # Example
/// ```
/// use topr_loss::{AggregationMode, RatioLevel, ToprConfig, ToprTokenConfig};
///
/// let cfg = ToprTokenConfig::trinity();
/// assert_eq!(cfg.ratio, RatioLevel::Token);
/// assert_eq!(cfg.aggregation, AggregationMode::TokenMean);
/// let tis = ToprTokenConfig::paper().with_topr(ToprConfig::tis()).with_aggregation(AggregationMode::TokenMean);
/// assert_eq!(tis.topr, ToprConfig::tis());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct ToprTokenConfig {
    /// Truncation limits, baseline and tie rule.
    pub topr: ToprConfig,
    /// The ratio level.
    pub ratio: RatioLevel,
    /// How per-token losses are reduced.
    pub aggregation: AggregationMode,
}

impl Default for ToprTokenConfig {
    fn default() -> Self {
        Self::paper()
    }
}

impl ToprTokenConfig {
    /// The paper (Le Roux, Bellemare et al., arXiv 2503.14286): canonical limits, sequence ratio
    /// `π(τ)/μ(τ)`, each sequence's loss divided by its length, ties positive.
    ///
    /// ```
    /// use topr_loss::{AggregationMode, RatioLevel, ToprConfig, ToprTokenConfig};
    /// let c = ToprTokenConfig::paper();
    /// assert_eq!((c.topr, c.ratio, c.aggregation), (ToprConfig::canonical(), RatioLevel::Sequence, AggregationMode::SeqMeanTokenMean));
    /// ```
    pub const fn paper() -> Self {
        Self {
            topr: ToprConfig::canonical(),
            ratio: RatioLevel::Sequence,
            aggregation: AggregationMode::SeqMeanTokenMean,
        }
    }

    /// verl's `loss_mode=topr` (as proposed in its open pull request): canonical limits on the
    /// length-normalised ratio `exp(mean_t δ_t)`, `loss_agg_mode=seq-mean-token-mean`, weight 1
    /// when the advantage is `≥ 0`.
    ///
    /// ```
    /// use topr_loss::{AggregationMode, RatioLevel, ToprTokenConfig};
    /// let c = ToprTokenConfig::verl();
    /// assert_eq!((c.ratio, c.aggregation), (RatioLevel::SequenceMean, AggregationMode::SeqMeanTokenMean));
    /// ```
    pub const fn verl() -> Self {
        Self::paper().with_ratio(RatioLevel::SequenceMean)
    }

    /// Trinity-RFT's `topr` policy loss: per-token ratios, weight `clamp(exp(δ_t), 0, 1)` where
    /// the advantage is `≤ 0` (threshold 0), weight 1 elsewhere, token-mean.
    ///
    /// ```
    /// use topr_loss::{TieRule, ToprTokenConfig};
    /// assert_eq!(ToprTokenConfig::trinity().topr.tie, TieRule::Tapered);
    /// ```
    pub const fn trinity() -> Self {
        Self {
            topr: ToprConfig::canonical().with_tie(TieRule::Tapered),
            ratio: RatioLevel::Token,
            aggregation: AggregationMode::TokenMean,
        }
    }

    /// The same config with other limits, baseline or tie rule.
    ///
    /// ```
    /// use topr_loss::{ToprConfig, ToprTokenConfig};
    /// let c = ToprTokenConfig::paper().with_topr(ToprConfig::sft());
    /// assert_eq!(c.topr, ToprConfig::sft());
    /// ```
    pub const fn with_topr(self, topr: ToprConfig) -> Self {
        Self { topr, ..self }
    }

    /// The same config with another ratio level.
    ///
    /// ```
    /// use topr_loss::{RatioLevel, ToprTokenConfig};
    /// assert_eq!(ToprTokenConfig::paper().with_ratio(RatioLevel::Token).ratio, RatioLevel::Token);
    /// ```
    pub const fn with_ratio(self, ratio: RatioLevel) -> Self {
        Self { ratio, ..self }
    }

    crate::setters::setters!(ToprTokenConfig, paper(); aggregation);
}

/// TOPR (and every member of its family) on per-token log-probabilities with a padding mask.
///
/// ```text
/// R'_i = R_i − c   (or R'_{i,t} with per-token rewards at the Token level)
/// δ_{i,t} = m_{i,t} (log π_{i,t} − sg(log μ_{i,t}))
/// s_i = Σ_t δ_{i,t}  (Sequence)   |   Σ_t δ_{i,t} / L_i  (SequenceMean)   |   s_{i,t} = δ_{i,t}  (Token)
/// V_i = −R'_i T(e^{s_i})           |   −L_i R'_i T(e^{s_i})                |   Σ_t m −R'_{i,t} T(e^{s_{i,t}})
/// loss = Σ_i α_i V_i               (α_i from the aggregation mode and normalizer)
/// ```
///
/// with the limits `(a+, b+)` where `R' ≥ 0` (`> 0` under [`TieRule::Tapered`]), else `(a−, b−)`.
/// The gradient per unmasked token is `−α_i R' [ρ]_a^b ∇log π_{i,t}` (times `L_i` at the
/// `SequenceMean` level, see the module docs), with the truncated weight held constant.
///
/// The counts `α` divides by are this call's; pass the [`Normalizer::global`] counts of the whole
/// optimiser batch to [`topr_token_loss_output`] to make the loss split-invariant under gradient
/// accumulation. A sequence with no unmasked token contributes nothing.
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286; verl and Trinity-RFT `topr` losses.
///
/// # Arguments
/// * `logp` — `[B, T]`, per-token `log π(y_t | ·)`, differentiable: the log-softmax of the
///   model's logits (`[B, T, V]`, position `t` scoring token `t`) at each completion token. Call
///   the loss inside [`crate::backward_through_logprobs`]`(&logits, &labels, Some(&mask), &cfg,
///   |lp| topr_token_loss(&lp.logp, ..))`, which hands it these log-probs and takes the gradient
///   back to the logits in bounded memory.
/// * `logp_mu` — `[B, T]`, per-token `log μ(y_t | ·)` of the data-generating policy (the
///   sampler's, recorded at sampling time, or [`crate::token_logprobs`] of the sampling model's
///   logits, which builds no graph); detached.
/// * `rewards` — `[B]` per-sequence rewards, or `[B, T]` per-token rewards/advantages at the
///   `Token` level.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating; true/1 marks a real completion token.
/// * `cfg` — see [`ToprTokenConfig`].
///
/// # Errors
/// As [`crate::topr_loss`], plus [`LossError::EmptyBatch`] when no token is unmasked.
///
/// # Example
/// ```
/// use tch::{Kind, Tensor};
/// use topr_loss::{topr_token_loss, ToprTokenConfig};
///
/// // Two sequences of lengths 2 and 3; the padding holds NaN.
/// let logp = Tensor::from_slice2(&[[-0.5f64, -1.0, f64::NAN], [-0.2, -0.3, -0.4]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-0.5f64, -1.0, f64::NAN], [-0.1, -0.3, -0.4]]);
/// let mask = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
/// let rewards = Tensor::from_slice(&[1.0f64, -1.0]);
/// let loss = topr_token_loss(&logp, &logp_mu, &rewards, &mask, &ToprTokenConfig::paper())?;
/// loss.backward();
/// let g = logp.grad();
/// assert_eq!(g.double_value(&[0, 2]), 0.0); // padding: exactly zero
/// // The negative sequence has ratio e^{-0.1}: each of its tokens gets e^{-0.1} / (B · L) = e^{-0.1}/6.
/// assert!((g.double_value(&[1, 0]) - (-0.1f64).exp() / 6.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn topr_token_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    cfg: &ToprTokenConfig,
) -> Result<Tensor, LossError> {
    Ok(forward(logp, logp_mu, rewards, mask, cfg, &Normalizer::local())?.0)
}

/// [`topr_token_loss`] with the counts of `norm`, its per-token terms and its diagnostics from
/// the same pass.
///
/// ```text
/// terms_{i,t} = m_{i,t} V_i / L_i    (Sequence)   |   m_{i,t} V_i / L_i = m −R'_i T(e^{s_i})  (SequenceMean)
///             | m_{i,t} −R'_{i,t} T(e^{s_{i,t}})   (Token)
/// loss = aggregate(terms, mask, cfg.aggregation, norm)
/// ```
///
/// Each token carries its share of its sequence's value, so that any aggregation of the terms
/// weighs the sequence as the loss does. The diagnostics ([`ToprDiagnostics`]) count sequences at
/// the sequence levels and unmasked tokens at the token level.
///
/// Reference: as [`topr_token_loss`].
///
/// # Errors
/// As [`topr_token_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{aggregate, topr_token_loss_output, BatchCounts, Normalizer, ToprTokenConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0], [-1.0, f64::NAN]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.0f64, -1.5], [-0.5, 0.0]]);
/// let mask = Tensor::from_slice2(&[[1i64, 1], [1, 0]]);
/// let rewards = Tensor::from_slice(&[-1.0f64, -1.0]);
/// let cfg = ToprTokenConfig::trinity();
/// let norm = Normalizer::global(BatchCounts { tokens: 6.0, sequences: 4.0 }); // a batch of which this is half
/// let out = topr_token_loss_output(&logp, &logp_mu, &rewards, &mask, &cfg, &norm)?;
/// let again = aggregate(&out.terms, &mask, cfg.aggregation, &norm)?;
/// assert!((out.loss.double_value(&[]) - again.double_value(&[])).abs() < 1e-12);
/// let d = out.diagnostics.read()?;
/// assert_eq!(d.samples, 3); // three unmasked tokens
/// assert!((d.truncated_fraction_neg - 1.0 / 3.0).abs() < 1e-12); // ratio e^{0.5} > 1 is cut
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn topr_token_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    cfg: &ToprTokenConfig,
    norm: &Normalizer,
) -> Result<LossOutput<ToprDiagnostics>, LossError> {
    let (loss, x, r) = forward(logp, logp_mu, rewards, mask, cfg, norm)?;
    let (terms, valid) = match cfg.ratio {
        RatioLevel::Sequence => {
            let share = r.terms.f_div(&x.lengths.f_clamp_min(1.0)?)?.f_unsqueeze(1)?; // V_i / L_i
            (x.zero_padding(&share)?, x.has_tokens.f_gt(0.0)?)
        }
        RatioLevel::SequenceMean => (x.zero_padding(&r.terms.f_unsqueeze(1)?)?, x.has_tokens.f_gt(0.0)?),
        RatioLevel::Token => (x.zero_padding(&r.terms)?, x.mask.shallow_clone()),
    };
    let diagnostics = topr_diagnostics(&r.s, &r.r_prime, &r.positive, &valid, &cfg.topr)?;
    Ok(LossOutput { loss, terms, diagnostics })
}

/// The loss of [`topr_token_loss`] with its checked inputs and level terms.
fn forward(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    cfg: &ToprTokenConfig,
    norm: &Normalizer,
) -> Result<(Tensor, TokenInputs, LevelTerms), LossError> {
    cfg.topr.validate()?;
    let x = check_inputs(logp, logp_mu, rewards, mask, cfg.ratio, cfg.topr.checks)?;
    let r = level_terms(&x, cfg)?;
    let mode = cfg.aggregation;
    let loss = match cfg.ratio {
        RatioLevel::Sequence => x.reduce_sequences(&r.terms.f_mul(&x.has_tokens)?, mode, norm)?,
        RatioLevel::SequenceMean => x.reduce_sequences(&r.terms.f_mul(&x.lengths)?, mode, norm)?,
        RatioLevel::Token => x.reduce_tokens(&r.terms, mode, norm)?,
    };
    guard_finite(&loss, &r.s.f_detach()?, &r.positive, &cfg.topr)?;
    Ok((loss, x, r))
}

/// The checked inputs of [`topr_token_loss`] and its diagnostics.
fn check_inputs(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    ratio: RatioLevel,
    checks: Checks,
) -> Result<TokenInputs, LossError> {
    token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((rewards, "rewards")),
        mask,
        per_token_weights: ratio == RatioLevel::Token,
        checks,
    })
}

/// The log-ratio at the configured level, the branch and `−R' T(e^s)` per entry.
struct LevelTerms {
    /// `[B]` (sequence levels) or `[B, T]` (token level).
    pub s: Tensor,
    /// `R − c`, broadcastable to `s`.
    pub r_prime: Tensor,
    /// Branch mask, broadcastable to `s`.
    pub positive: Tensor,
    /// `−R' T(e^s; a±, b±)`, the shape of `s`.
    pub terms: Tensor,
}

fn level_terms(x: &TokenInputs, cfg: &ToprTokenConfig) -> Result<LevelTerms, LossError> {
    let s = match cfg.ratio {
        RatioLevel::Sequence => x.delta.f_sum_dim_intlist(1, false, None::<Kind>)?,
        RatioLevel::SequenceMean => x.mean_delta()?,
        RatioLevel::Token => x.delta.shallow_clone(),
    };
    let mut r_prime = x.weights().f_sub_scalar(cfg.topr.baseline)?;
    if cfg.ratio == RatioLevel::Token && r_prime.dim() == 1 {
        r_prime = r_prime.f_unsqueeze(1)?; // [B, 1], broadcast over tokens
    }
    let positive = positive_branch(&r_prime, cfg.topr.tie)?;
    let terms = tapered_terms(&s, &r_prime, &positive, &cfg.topr)?;
    Ok(LevelTerms { s, r_prime, positive, terms })
}
