//! TOPR, Tapered Off-Policy REINFORCE, and the off-policy REINFORCE family it generalises,
//! on sequence log-probabilities `[B]`.
//!
//! Per sample τ_i drawn from μ, with `R'_i = R_i − c`, `δ_i = log π(τ_i) − log μ(τ_i)`,
//! `x_i = exp(δ_i)` and the limits `(a, b) = (a+, b+)` when `R'_i ≥ 0`, else `(a−, b−)`:
//!
//! ```text
//! loss     = −(1/B) Σ_i R'_i · T(x_i; a, b)                 (T the taper, see `taper`)
//! ∇ loss   = −(1/B) Σ_i R'_i · [x_i]_a^b · ∇ log π(τ_i)     (the weight held constant)
//! ```
//!
//! | preset | a+ | b+ | a− | b− | |
//! |---|---|---|---|---|---|
//! | [`ToprConfig::canonical`] (default) | 1 | 1 | 0 | 1 | SFT on positives, truncated IS on negatives |
//! | [`ToprConfig::naive_reinforce`] | 1 | 1 | 1 | 1 | unbounded below with negatives |
//! | [`ToprConfig::sft`] | 1 | 1 | 0 | 0 | negatives ignored |
//! | [`ToprConfig::tis`] | 0 | 1 | 0 | 1 | truncated importance sampling |
//! | [`ToprConfig::importance_sampling`] | 0 | ∞ | 0 | ∞ | unbiased, unbounded weights |
//!
//! Reference: Le Roux, Bellemare et al., *Tapered Off-Policy REINFORCE: Stable and efficient
//! reinforcement learning for LLMs*, arXiv 2503.14286.

use crate::aggregate::Normalizer;
use crate::checks::{Checks, read_f64};
use crate::diagnostics::{ToprDiagnostics, topr_diagnostics};
use crate::error::{LossError, kind_name};
use crate::output::LossOutput;
use crate::taper::taper_from_clamped;
use crate::topr_config::{TieRule, ToprConfig, branch_clamp};
use crate::validate::{self, FiniteCheck, LogProbCheck};
use tch::{Kind, Tensor};

/// `−R' · T(exp(s); a±, b±)` per entry, the limits picked per entry by `positive`. One
/// evaluation of the taper with per-entry limits (`clamp` against tensors), so no unused branch
/// is computed whose `inf` could turn into a NaN gradient. `s`, `r_prime` and `positive`
/// broadcast together.
pub(crate) fn tapered_terms(
    s: &Tensor,
    r_prime: &Tensor,
    positive: &Tensor,
    cfg: &ToprConfig,
) -> Result<Tensor, LossError> {
    let (d, on) = branch_clamp(s, positive, cfg)?;
    let t = taper_from_clamped(s, &d)?;
    Ok(t.f_mul(&r_prime.f_mul(&on)?.f_neg()?)?)
}

/// The branch mask `R' ≥ 0` (or `> 0` under [`TieRule::Tapered`]).
pub(crate) fn positive_branch(r_prime: &Tensor, tie: TieRule) -> Result<Tensor, LossError> {
    Ok(match tie {
        TieRule::Positive => r_prime.f_ge(0.0)?,
        TieRule::Tapered => r_prime.f_gt(0.0)?,
    })
}

/// Turns a non-finite loss into an error: [`LossError::Overflow`] when an infinite upper limit
/// let the importance weight overflow (naming the unbounded branch with the largest log-ratio
/// `s`), else [`LossError::NonFiniteLoss`] (rewards too large for the compute dtype). Reads the
/// loss back: one device sync.
pub(crate) fn guard_finite(loss: &Tensor, s: &Tensor, positive: &Tensor, cfg: &ToprConfig) -> Result<(), LossError> {
    if !cfg.checks.values() || read_f64(loss)?.is_finite() {
        return Ok(());
    }
    let compute_dtype = kind_name(s.kind());
    let max_exponent = if s.kind() == Kind::Double { f64::MAX.ln() } else { (f32::MAX as f64).ln() };
    let negative = positive.f_logical_not()?;
    let floor = s.f_full_like(f64::NEG_INFINITY)?;
    let mut worst: Option<(&'static str, f64)> = None;
    for (field, b, rows) in [("b_pos", cfg.b_pos, positive), ("b_neg", cfg.b_neg, &negative)] {
        if b.is_infinite() {
            let max = read_f64(&s.f_where_self(rows, &floor)?.f_max()?)?;
            if worst.is_none_or(|(_, w)| max > w) {
                worst = Some((field, max));
            }
        }
    }
    match worst {
        // The weight e^δ alone exceeds the square root of the dtype's range: the ratio overflowed.
        Some((field, max_log_ratio)) if max_log_ratio > 0.5 * max_exponent => {
            Err(LossError::Overflow { field, max_log_ratio, compute_dtype })
        }
        _ => Err(LossError::NonFiniteLoss { compute_dtype }),
    }
}

/// Checked `[B]` inputs of the sequence-level losses, upcast to the compute dtype.
pub(crate) struct SequenceInputs {
    pub logp: Tensor,
    pub logp_mu: Tensor,
    pub rewards: Tensor,
}

pub(crate) fn check_sequence_inputs(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    checks: Checks,
) -> Result<SequenceInputs, LossError> {
    let kinds = [
        validate::float_tensor(logp, "logp")?,
        validate::float_tensor(logp_mu, "logp_mu")?,
        validate::float_tensor(rewards, "rewards")?,
    ];
    let shape = validate::rank(logp, "logp", 1, "[B] sequence log-probabilities")?;
    validate::non_empty(&shape, "logp", "sequence")?;
    validate::same_shape(logp_mu, "logp_mu", &shape, "the shape of `logp`")?;
    validate::same_shape(rewards, "rewards", &shape, "the shape of `logp`")?;
    let device = logp.device();
    validate::same_device(logp_mu, "logp_mu", device, "logp")?;
    validate::same_device(rewards, "rewards", device, "logp")?;
    let kind = validate::compute_kind(&kinds);
    let x = SequenceInputs {
        logp: logp.f_to_kind(kind)?,
        logp_mu: logp_mu.f_detach()?.f_to_kind(kind)?,
        rewards: rewards.f_detach()?.f_to_kind(kind)?,
    };
    if !checks.values() {
        return Ok(x);
    }
    let check = |clean, original, argument| FiniteCheck { clean, original, argument, valid: None, also: None };
    let log_prob = |t, argument| LogProbCheck { t, argument, valid: None };
    validate::all_finite_sums_and_log_probs(
        &[check(&x.logp, logp, "logp"), check(&x.logp_mu, logp_mu, "logp_mu"), check(&x.rewards, rewards, "rewards")],
        &[log_prob(&x.logp, "logp"), log_prob(&x.logp_mu, "logp_mu")],
    )?;
    Ok(x)
}

/// The TOPR loss on sequence log-probabilities: the negative of the tapered off-policy objective,
/// averaged over the batch.
///
/// ```text
/// R'_i = R_i − c,   δ_i = logp_i − sg(logp_mu_i),   (a, b) = (a+, b+) if R'_i ≥ 0 else (a−, b−)
///
/// loss   = −(1/B) Σ_i R'_i · T(e^{δ_i}; a, b)
/// ∇loss  = −(1/B) Σ_i R'_i · [e^{δ_i}]_a^b · ∇logp_i
/// ```
///
/// (`R'_i > 0` picks the positive branch under [`TieRule::Tapered`].) The value is the objective
/// itself (a lower bound on the expected reward where the paper proves it, Proposition 3.1), not
/// only a surrogate with the right gradient. Everything is computed in log space: for finite
/// inputs and finite limits, value and gradient are finite for any `δ` (`±1e4` included). bf16
/// and f16 inputs are computed in f32, f64 in f64; the loss has the compute dtype.
///
/// With an infinite upper limit ([`ToprConfig::importance_sampling`]) the weight `e^δ` is
/// unbounded: when it overflows the compute dtype the function returns [`LossError::Overflow`]
/// instead of `inf`. Any other non-finite result (rewards near the dtype's largest value) is
/// [`LossError::NonFiniteLoss`]. These checks read the loss back (one device sync), as the
/// input checks do.
///
/// For a global batch size under gradient accumulation, and for the per-sample terms and the
/// diagnostics, use [`topr_loss_output`].
///
/// Reference: Le Roux, Bellemare et al., *Tapered Off-Policy REINFORCE*, arXiv 2503.14286, eq. (7)
/// and §3.
///
/// # Arguments
/// * `logp` — `[B]`, `log π(τ_i)` under the policy being trained, differentiable: a completion's
///   log-probability is the sum of its tokens' log-probabilities: inside
///   [`crate::backward_through_logprobs`] (which hands the loss the tokens' log-probs of a model's
///   logits and takes the gradient back to the logits), sum them with
///   [`crate::sequence_logprobs`]`(.., SequenceReduce::Sum)`; or keep them per token and call
///   [`crate::topr_token_loss`].
/// * `logp_mu` — `[B]`, `log μ(τ_i)` under the policy that generated the data (the sampler's
///   log-probs, or [`crate::token_logprobs`] of the sampling model's logits, summed the same way);
///   detached.
/// * `rewards` — `[B]`, `R(τ_i)`; the loss subtracts `cfg.baseline`.
/// * `cfg` — limits, baseline and tie rule.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; [`LossError::UnsupportedTensor`],
/// [`LossError::WrongDtype`], [`LossError::WrongRank`], [`LossError::ShapeMismatch`],
/// [`LossError::EmptyBatch`], [`LossError::DeviceMismatch`] and [`LossError::NonFinite`] for bad
/// tensors; [`LossError::Overflow`] and [`LossError::NonFiniteLoss`] as above.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_loss, ToprConfig};
///
/// let logp = Tensor::from_slice(&[-2.0f64, -3.0, -1.5]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice(&[-2.5f64, -2.0, -1.5]);
/// let rewards = Tensor::from_slice(&[1.0f64, -1.0, -1.0]);
/// let loss = topr_loss(&logp, &logp_mu, &rewards, &ToprConfig::default())?;
/// loss.backward();
/// // Positive: weight 1. Negatives: weight min(π/μ, 1) = e^{-1} and 1.
/// let g = Vec::<f64>::try_from(&logp.grad())?;
/// let expected = [-1.0 / 3.0, (-1.0f64).exp() / 3.0, 1.0 / 3.0];
/// for (g, e) in g.iter().zip(expected) { assert!((g - e).abs() < 1e-12); }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn topr_loss(logp: &Tensor, logp_mu: &Tensor, rewards: &Tensor, cfg: &ToprConfig) -> Result<Tensor, LossError> {
    Ok(sequence_forward(logp, logp_mu, rewards, cfg, &Normalizer::local())?.loss)
}

/// [`topr_loss`] with the batch size `S` from `norm` (`norm.sequences`, else `B`), its
/// per-sample terms and its diagnostics from the same pass.
///
/// ```text
/// terms_i = −R'_i · T(e^{δ_i}; a, b)        loss = Σ_i terms_i / S
/// ```
///
/// With `norm = Normalizer::sequences(S)` for the `S` samples of a whole optimiser batch, the
/// losses of its micro-batches sum to the loss of the batch (value and gradient).
///
/// Reference: as [`topr_loss`]; the diagnostics are those of [`ToprDiagnostics`].
///
/// # Errors
/// As [`topr_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{topr_loss, topr_loss_output, Normalizer, ToprConfig};
///
/// let logp = Tensor::from_slice(&[-1.0f64, -3.0, -2.0, -2.0]);
/// let logp_mu = Tensor::from_slice(&[-2.0f64, -2.0, -2.0, -1.0]);
/// let rewards = Tensor::from_slice(&[1.0f64, 1.0, -1.0, -1.0]);
/// let cfg = ToprConfig::canonical();
/// // Two micro-batches of a batch of 4 add up to the loss of the batch.
/// let half = |t: &Tensor, i: i64| t.narrow(0, 2 * i, 2);
/// let parts: f64 = (0..2)
///     .map(|i| topr_loss_output(&half(&logp, i), &half(&logp_mu, i), &half(&rewards, i), &cfg, &Normalizer::sequences(4.0)))
///     .map(|o| o.map(|o| o.loss.double_value(&[])))
///     .sum::<Result<f64, _>>()?;
/// let whole = topr_loss(&logp, &logp_mu, &rewards, &cfg)?.double_value(&[]);
/// assert!((parts - whole).abs() < 1e-12);
///
/// let d = topr_loss_output(&logp, &logp_mu, &rewards, &cfg, &Normalizer::local())?.diagnostics.read()?;
/// assert_eq!(d.negative_fraction, 0.5);
/// assert_eq!(d.truncated_fraction_pos, 1.0); // ratios e and 1/e are both cut to 1
/// assert_eq!(d.truncated_fraction_neg, 0.0); // ratios 1 and 1/e lie in [0, 1]
/// assert_eq!(d.effective_positive_proportion, Some(0.5));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn topr_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    cfg: &ToprConfig,
    norm: &Normalizer,
) -> Result<LossOutput<ToprDiagnostics>, LossError> {
    let f = sequence_forward(logp, logp_mu, rewards, cfg, norm)?;
    let valid = f.delta.f_ones_like()?.f_to_kind(Kind::Bool)?;
    let diagnostics = topr_diagnostics(&f.delta, &f.r_prime, &f.positive, &valid, cfg)?;
    Ok(LossOutput { loss: f.loss, terms: f.terms, diagnostics })
}

/// The loss of [`topr_loss`] with the per-sample pieces its output and diagnostics reuse.
struct SequenceForward {
    loss: Tensor,
    /// `−R'_i T(e^{δ_i})`, `[B]`.
    terms: Tensor,
    /// `δ`, detached.
    delta: Tensor,
    r_prime: Tensor,
    positive: Tensor,
}

fn sequence_forward(
    logp: &Tensor,
    logp_mu: &Tensor,
    rewards: &Tensor,
    cfg: &ToprConfig,
    norm: &Normalizer,
) -> Result<SequenceForward, LossError> {
    cfg.validate()?;
    let x = check_sequence_inputs(logp, logp_mu, rewards, cfg.checks)?;
    let samples = norm.sequences_or(x.logp.size()[0] as f64)?;
    let r_prime = x.rewards.f_sub_scalar(cfg.baseline)?;
    let positive = positive_branch(&r_prime, cfg.tie)?;
    let delta = x.logp.f_sub(&x.logp_mu)?;
    let terms = tapered_terms(&delta, &r_prime, &positive, cfg)?;
    let loss = terms.f_sum(None::<Kind>)?.f_div_scalar(samples)?;
    let delta = delta.f_detach()?;
    guard_finite(&loss, &delta, &positive, cfg)?;
    Ok(SequenceForward { loss, terms, delta, r_prime, positive })
}
