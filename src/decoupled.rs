//! Stale and asynchronous data: decoupled PPO with a proximal policy, the proximal log-probs'
//! approximation from the behaviour and current policies, and M2PO's second-moment mask.
//!
//! In asynchronous training the policy that sampled a completion (the *behaviour* policy μ) can
//! be several updates behind the one being trained. Decoupled PPO separates the two jobs of
//! PPO's "old" policy: the trust region is taken around a recent *proximal* policy π_prox, and the
//! staleness of the data is corrected by an importance weight of π_prox against μ.
//!
//! ```text
//! r_t = exp(clamp(log π_t − sg(log π_prox,t), ±M))             the trust region's ratio
//! w_t = weight(exp(log π_prox,t − log μ_t))                     the behaviour correction (detached)
//! ℓ_t = w_t · (−min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t))   (dual clip as in PPO)
//! loss = aggregate(ℓ, mask)     the denominator counts every unmasked token, weighted 0 or not
//! ```
//!
//! Reference: Fu et al., *AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
//! Language Reasoning*, arXiv 2505.24298 (decoupled PPO); AReaL `ppo_actor_loss_fn`
//! (`areal/utils/functional`) with `use_decoupled_loss`; verl's "decoupled mode" of rollout
//! correction (`compute_policy_loss_vanilla` with `rollout_is_weights` of the old against the
//! rollout log-probs), tested.

use crate::aggregate::Normalizer;
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::LossOutput;
use crate::ppo::{PpoConfig, PpoDiagnostics, clip_terms};
use crate::rollout_correction::{RolloutCorrection, RolloutWeights, weights_of};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::{Kind, Tensor};

/// The trust region and the behaviour correction of [`decoupled_ppo_loss`].
///
/// `Default` is [`DecoupledPpoConfig::areal`].
///
/// # Example
/// ```
/// use topr_loss::{DecoupledPpoConfig, PpoConfig, RolloutCorrection};
/// let c = DecoupledPpoConfig::areal();
/// assert_eq!((c.ppo, c.behaviour), (PpoConfig::ppo(), RolloutCorrection::token_mis(0.0, 5.0)));
/// assert_eq!(DecoupledPpoConfig::verl().behaviour, RolloutCorrection::token_tis(2.0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct DecoupledPpoConfig {
    /// PPO-clip around the proximal policy (clip range, dual clip, aggregation).
    pub ppo: PpoConfig,
    /// The weight of the proximal policy against the behaviour policy: truncated
    /// ([`RolloutCorrection::token_tis`]) or masked ([`RolloutCorrection::token_mis`]), per token
    /// or per sequence.
    pub behaviour: RolloutCorrection,
}

impl Default for DecoupledPpoConfig {
    fn default() -> Self {
        Self::areal()
    }
}

impl DecoupledPpoConfig {
    /// AReaL's former default: PPO-clip (ε = 0.2, token mean) and the behaviour weight masked
    /// (set to 0) above 5 (`behav_imp_weight_cap = 5`, `token_mask`; in its newer
    /// `rejection_sampling` config, `{level: token, action: mask, metric: ratio, upper: 5}`).
    ///
    /// ```
    /// assert_eq!(topr_loss::DecoupledPpoConfig::areal().behaviour.max, 5.0);
    /// ```
    pub const fn areal() -> Self {
        Self { ppo: PpoConfig::ppo(), behaviour: RolloutCorrection::token_mis(0.0, 5.0) }
    }

    /// verl's decoupled mode as its presets set it: PPO-clip with verl's dual clip `c = 3` and
    /// token-level TIS at 2 (`rollout_is="token"`, `rollout_is_threshold=2.0`).
    ///
    /// ```
    /// assert_eq!(topr_loss::DecoupledPpoConfig::verl().ppo.dual_clip, Some(3.0));
    /// ```
    pub const fn verl() -> Self {
        Self { ppo: PpoConfig::ppo().with_dual_clip(Some(3.0)), behaviour: RolloutCorrection::token_tis(2.0) }
    }

    /// The same config with another behaviour correction.
    ///
    /// ```
    /// use topr_loss::{DecoupledPpoConfig, RolloutCorrection};
    /// let c = DecoupledPpoConfig::areal().with_behaviour(RolloutCorrection::sequence_tis(2.0));
    /// assert_eq!(c.behaviour, RolloutCorrection::sequence_tis(2.0));
    /// ```
    pub const fn with_behaviour(self, behaviour: RolloutCorrection) -> Self {
        Self { behaviour, ..self }
    }

    /// The same config with another PPO part.
    ///
    /// ```
    /// use topr_loss::{DecoupledPpoConfig, PpoConfig};
    /// let c = DecoupledPpoConfig::areal().with_ppo(PpoConfig::dapo());
    /// assert_eq!(c.ppo, PpoConfig::dapo());
    /// ```
    pub const fn with_ppo(self, ppo: PpoConfig) -> Self {
        Self { ppo, ..self }
    }

    /// The same config with another checks level for both parts ([`Checks::Shapes`]: no host
    /// read per call).
    ///
    /// ```
    /// use topr_loss::{Checks, DecoupledPpoConfig};
    /// let c = DecoupledPpoConfig::areal().with_checks(Checks::Shapes);
    /// assert_eq!((c.ppo.checks, c.behaviour.checks), (Checks::Shapes, Checks::Shapes));
    /// ```
    pub const fn with_checks(self, checks: Checks) -> Self {
        Self { ppo: self.ppo.with_checks(checks), behaviour: self.behaviour.with_checks(checks) }
    }

    /// Checks both parts.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field that [`PpoConfig::validate`] or
    /// [`RolloutCorrection::validate`] refuses.
    ///
    /// ```
    /// use topr_loss::{DecoupledPpoConfig, RolloutCorrection};
    /// assert!(DecoupledPpoConfig::areal().with_behaviour(RolloutCorrection::token_tis(-1.0)).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        self.ppo.validate()?;
        self.behaviour.validate()
    }
}

/// What [`decoupled_ppo_loss_output`] returns: PPO's output (the loss, its weighted per-token
/// terms and the trust region's [`PpoDiagnostics`]) and the behaviour weights with their
/// diagnostics, all from the same pass.
#[derive(Debug)]
#[non_exhaustive]
pub struct DecoupledPpoOutput {
    /// The loss, its per-token terms `w_t ℓ_t` (zero on padding) and the diagnostics of the ratio
    /// `π / π_prox`.
    pub output: LossOutput<PpoDiagnostics>,
    /// The weights `w` of `π_prox` against `μ` (`[B, T]`, detached) and their diagnostics.
    pub behaviour: RolloutWeights,
}

/// The checked inputs, the weighted per-token terms and the parts' outputs.
fn decoupled_terms(
    logp: &Tensor,
    logp_proximal: &Tensor,
    logp_behaviour: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DecoupledPpoConfig,
) -> Result<(TokenInputs, Tensor, crate::output::OnDevice<PpoDiagnostics>, RolloutWeights), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_proximal, "logp_proximal"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: true,
        checks: cfg.ppo.checks,
    })?;
    // `logp_proximal` passed every check above; what can fail here is `logp_behaviour`'s.
    let b = token_inputs::check(TokenArgs {
        logp: &logp_proximal.f_detach()?,
        other: (logp_behaviour, "logp_behaviour"),
        weights: None,
        mask,
        per_token_weights: false,
        checks: cfg.behaviour.checks,
    })?;
    let behaviour = weights_of(&b, &cfg.behaviour)?;
    let (per_token, diagnostics) = clip_terms(&x, &cfg.ppo)?;
    let weighted = per_token.f_mul(&behaviour.weights.f_to_kind(x.kind)?)?;
    Ok((x, weighted, diagnostics, behaviour))
}

/// Decoupled PPO: PPO-clip around a proximal policy, weighted by the proximal policy's
/// importance ratio against the behaviour policy that sampled the data.
///
/// ```text
/// r_t  = exp(clamp(log π_t − sg(log π_prox,t), ±M))
/// w_t  = weight of ρ_t = exp(log π_prox,t − log μ_t) by cfg.behaviour   (TIS: min(ρ, C); MIS: ρ·[ρ ≤ C])
/// ℓ_t  = w_t · (−min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t))     (dual clip: min(·, −c A_t) for A_t < 0)
/// loss = aggregate(ℓ, mask)
/// ```
///
/// Tokens the behaviour rule weighs 0 stay in the denominator (AReaL counts the loss mask before
/// its rejection; verl multiplies `pg_losses` by the weights). With `logp_proximal = logp_behaviour`
/// every weight is 1 and the loss is [`crate::ppo_clip_loss`]; with the proximal policy the
/// current one detached (AReaL's `reuse_train_logp`), `r = 1`: a behaviour-weighted REINFORCE.
///
/// Conventions against the peers: `δ` is clamped to ±`max_log_ratio` (20) in both ratios, as
/// verl does and AReaL does not (AReaL overflows to inf where verl and this crate stay finite);
/// AReaL's sequence-level behaviour weight is the geometric mean of the token ratios
/// ([`crate::CorrectionLevel::Geometric`]), verl's and this crate's `Sequence` their product.
///
/// Reference: AReaL `ppo_actor_loss_fn` (restated in the tests as a scalar reference); verl 0.9.1
/// decoupled mode, `compute_policy_loss_vanilla` with `compute_rollout_correction_weights`
/// (its values and gradients, tested).
///
/// # Arguments
/// * `logp` — `[B, T]` per-token log-probs of the policy being trained (differentiable).
/// * `logp_proximal` — `[B, T]`, the proximal policy's (detached): recomputed by the trainer
///   before the update, or approximated by [`proximal_logprobs`].
/// * `logp_behaviour` — `[B, T]`, the sampler's (detached).
/// * `advantages` — `[B]` (broadcast over tokens) or `[B, T]`.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`], naming
/// `logp`, `logp_proximal`, `logp_behaviour`, `advantages` or `mask`;
/// [`LossError::NonFiniteLoss`] if the loss overflows the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{decoupled_ppo_loss, DecoupledPpoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]).set_requires_grad(true);
/// let logp_prox = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
/// let logp_behaviour = Tensor::from_slice2(&[[-1.0f64, -3.0]]); // ρ = 1, then e² ≈ 7.4 > 5
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let loss = decoupled_ppo_loss(&logp, &logp_prox, &logp_behaviour, &Tensor::from_slice(&[1.0f64]), &mask, &DecoupledPpoConfig::areal())?;
/// // The second token is masked (weight 0) but still counted: loss = −(1 · 1 + 0) / 2.
/// assert!((loss.double_value(&[]) + 0.5).abs() < 1e-12);
/// loss.backward();
/// assert_eq!(Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?, vec![-0.5, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn decoupled_ppo_loss(
    logp: &Tensor,
    logp_proximal: &Tensor,
    logp_behaviour: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DecoupledPpoConfig,
) -> Result<Tensor, LossError> {
    let (x, weighted, _, _) = decoupled_terms(logp, logp_proximal, logp_behaviour, advantages, mask, cfg)?;
    x.sanitized_loss(&weighted, cfg.ppo.aggregation, &Normalizer::local())
}

/// [`decoupled_ppo_loss`] with the counts of `norm`, its weighted per-token terms, the trust
/// region's diagnostics and the behaviour weights with theirs ([`DecoupledPpoOutput`]).
///
/// Reference: as [`decoupled_ppo_loss`].
///
/// # Errors
/// As [`decoupled_ppo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{decoupled_ppo_loss_output, DecoupledPpoConfig, Normalizer};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -1.0, 0.0]]);
/// let behaviour = Tensor::from_slice2(&[[-1.0f64, -3.0, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let adv = Tensor::from_slice(&[1.0f64]);
/// let out = decoupled_ppo_loss_output(&lp, &lp, &behaviour, &adv, &mask, &DecoupledPpoConfig::areal(), &Normalizer::local())?;
/// let b = out.behaviour.diagnostics.read()?;
/// assert_eq!((b.samples, b.bounded_fraction), (2, 0.5)); // one token of two masked
/// assert_eq!(out.output.diagnostics.read()?.clip_fraction, 0.0);
/// assert_eq!(out.output.terms.double_value(&[0, 1]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn decoupled_ppo_loss_output(
    logp: &Tensor,
    logp_proximal: &Tensor,
    logp_behaviour: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &DecoupledPpoConfig,
    norm: &Normalizer,
) -> Result<DecoupledPpoOutput, LossError> {
    let (x, weighted, diagnostics, behaviour) =
        decoupled_terms(logp, logp_proximal, logp_behaviour, advantages, mask, cfg)?;
    let loss = x.sanitized_loss(&weighted, cfg.ppo.aggregation, norm)?;
    Ok(DecoupledPpoOutput { output: LossOutput { loss, terms: x.zero_padding(&weighted)?, diagnostics }, behaviour })
}

/// How [`proximal_logprobs`] interpolates between the behaviour and the current policy.
///
/// # Example
/// ```
/// assert_eq!(topr_loss::ProximalApproximation::default(), topr_loss::ProximalApproximation::LogLinear);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum ProximalApproximation {
    /// `log π_prox ≈ log μ + α (log π − log μ)`: geometric interpolation of the probabilities
    /// (AReaL's `prox_logp_method="loglinear"`, the one it trains with).
    #[default]
    LogLinear,
    /// `log π_prox ≈ log((1 − α) μ + α π)`: arithmetic interpolation of the probabilities
    /// (AReaL's "linear" approximation, which it logs but does not train with).
    Linear,
}

/// The proximal policy's log-probs approximated from the behaviour and the current policy's,
/// without a forward pass (AReaL's `prox_logp_method="loglinear"`).
///
/// ```text
/// s    = staleness: policy versions between the behaviour policy and the current one (v_θ − v_μ)
/// α    = clamp(1 − 1/s, 0, 1)   for s > 0, else 0      (the proximal policy is version v_θ − 1)
/// LogLinear   log π_prox ≈ log μ + α (sg(log π) − log μ)
/// Linear      log π_prox ≈ log((1 − α) e^{log μ} + α e^{sg(log π)})   (computed as a logaddexp)
/// ```
///
/// At staleness 1 (the data is one update old) the proximal policy is the behaviour policy; as
/// the staleness grows it moves towards the current policy. The result is detached and 0 on
/// padding. AReaL's `linear` adds `1e-10` inside the log; this computes the log exactly.
///
/// Reference: AReaL `compute_prox_logp_approximations` (`areal/trainer/ppo/actor.py`), restated in
/// the tests as a scalar reference.
///
/// # Arguments
/// * `logp_behaviour` — `[B, T]`, the sampler's log-probs.
/// * `logp` — `[B, T]`, the current policy's (any graph is ignored).
/// * `staleness` — `[B]` (per sequence) or `[B, T]` (per token), finite and `>= 0`, any float or
///   integer dtype.
/// * `mask` — `[B, T]`.
///
/// # Errors
/// The tensor checks of [`LossError`] naming `logp_behaviour`, `logp`, `staleness` or `mask`;
/// [`LossError::InvalidConfig`] naming `staleness` for a negative entry.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{proximal_logprobs, ProximalApproximation};
/// let behaviour = Tensor::from_slice2(&[[-2.0f64, -2.0]]);
/// let current = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
/// let mask = Tensor::from_slice2(&[[true, true]]);
/// let staleness = Tensor::from_slice(&[4i64]); // α = 3/4
/// let p = proximal_logprobs(&behaviour, &current, &staleness, &mask, ProximalApproximation::LogLinear)?;
/// assert_eq!(Vec::<f64>::try_from(&p.flatten(0, -1))?, vec![-1.25, -1.25]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn proximal_logprobs(
    logp_behaviour: &Tensor,
    logp: &Tensor,
    staleness: &Tensor,
    mask: &Tensor,
    method: ProximalApproximation,
) -> Result<Tensor, LossError> {
    proximal_logprobs_with_checks(logp_behaviour, logp, staleness, mask, method, Checks::Full)
}

/// [`proximal_logprobs`] at a chosen [`Checks`] level: [`Checks::Shapes`] checks shapes, kinds and
/// devices only and reads nothing back to the host (for a training loop's every micro-batch);
/// the values are the same, and a NaN or negative staleness is then not refused.
///
/// # Errors
/// As [`proximal_logprobs`]; under [`Checks::Shapes`] only the shape, kind and device errors.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{host_reads, proximal_logprobs_with_checks, Checks, ProximalApproximation};
/// let lb = Tensor::from_slice2(&[[-2.0f64]]);
/// let lp = Tensor::from_slice2(&[[-1.0f64]]);
/// let before = host_reads();
/// let p = proximal_logprobs_with_checks(&lb, &lp, &Tensor::from_slice(&[2.0f64]), &lp.ones_like(), ProximalApproximation::LogLinear, Checks::Shapes)?;
/// assert_eq!((host_reads(), p.double_value(&[0, 0])), (before, -1.5));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn proximal_logprobs_with_checks(
    logp_behaviour: &Tensor,
    logp: &Tensor,
    staleness: &Tensor,
    mask: &Tensor,
    method: ProximalApproximation,
    checks: Checks,
) -> Result<Tensor, LossError> {
    let x = token_inputs::check(TokenArgs {
        logp: &validate::detached(logp, "logp")?,
        other: (logp_behaviour, "logp_behaviour"),
        weights: None,
        mask,
        per_token_weights: false,
        checks,
    })?;
    let shape = x.mask.size();
    validate::real_tensor(staleness, "staleness")?;
    if staleness.dim() == 2 {
        validate::same_shape(staleness, "staleness", &shape, "the shape of `logp` (per-token staleness)")?;
    } else {
        validate::same_shape(staleness, "staleness", &shape[..1], "[B], one staleness per sequence")?;
    }
    validate::same_device(staleness, "staleness", logp.device(), "logp")?;
    let s = staleness.f_to_kind(Kind::Double)?;
    let s = if s.dim() == 1 { s.f_unsqueeze(1)? } else { s };
    let s = s.f_expand(shape.as_slice(), false)?;
    if checks.values() {
        check_staleness(&s, &x.mask)?;
    }
    let alpha = s.f_clamp_min(f64::MIN_POSITIVE)?.f_reciprocal()?.f_neg()?.f_add_scalar(1.0)?.f_clamp(0.0, 1.0)?;
    let alpha = alpha.f_to_kind(x.kind)?;
    // δ = log π − log μ, zero on padding: both forms below are then 0 there.
    let lb = x.logp()?.f_sub(&x.delta)?;
    let p = match method {
        ProximalApproximation::LogLinear => lb.f_add(&alpha.f_mul(&x.delta)?)?,
        ProximalApproximation::Linear => {
            let keep = alpha.f_neg()?.f_add_scalar(1.0)?.f_log()?.f_add(&lb)?;
            let moved = alpha.f_log()?.f_add(&x.logp()?)?;
            keep.f_logaddexp(&moved)?
        }
    };
    Ok(x.zero_padding(&p)?.f_detach()?)
}

/// Refuses a staleness that is not finite or negative where `mask` is real: its smallest and
/// largest real entries, read back in one host read, are finite only if every one is.
fn check_staleness(s: &Tensor, mask: &Tensor) -> Result<(), LossError> {
    let pad = mask.f_logical_not()?;
    let least = s.f_masked_fill(&pad, f64::INFINITY)?.f_min()?;
    let most = s.f_masked_fill(&pad, f64::NEG_INFINITY)?.f_max()?;
    let read = crate::checks::read_vec(&Tensor::f_stack(&[least, most], 0)?)?;
    let (least, most) = (read[0], read[1]);
    if !(least.is_finite() && most.is_finite()) && mask.f_any()?.f_int64_value(&[])? != 0 {
        validate::finite(s, "staleness", Some(mask))?;
    }
    if least < 0.0 {
        return Err(LossError::InvalidConfig {
            field: "staleness",
            value: least,
            reason: "a staleness counts policy versions and must be >= 0".into(),
        });
    }
    Ok(())
}

/// M2PO's second-moment mask: drop the tokens whose squared log-ratio between the proximal and
/// the behaviour policy is largest, fewest first, until the mean over the tokens kept is below
/// `τ`.
///
/// ```text
/// M_t = (log μ_t − log π_prox,t)²              over the unmasked tokens of the whole batch
/// sort descending M_(1) ≥ … ≥ M_(n);  k* = min { k : mean(M_(k+1), …, M_(n)) < τ }   (k* = n − 1 if none)
/// keep every unmasked token but the k* largest
/// ```
///
/// The statistic is over the whole batch passed (not per sequence), so the mask of a batch split
/// into micro-batches differs from the batch's: pass the whole step's tokens. Among tokens with
/// equal `M`, those later in row-major order are dropped first. Multiply the returned mask into a
/// loss's mask (AReaL then averages over the tokens kept) or pass it as 0/1 weights through
/// [`crate::apply_token_weights`] (the original denominator, as the M2PO paper has it).
///
/// Reference: Zheng et al., *Prosperity before Collapse: How Far Can Off-Policy RL Reach with
/// Stale Data on LLMs?*, arXiv 2510.01161 (M2PO); AReaL `_apply_m2po_masking` /
/// `_get_m2po_loss_mask` with `actor.m2_threshold` (restated in the tests as a scalar reference).
/// The paper restricts the statistic to the tokens in PPO's active quadrants; AReaL, followed
/// here, takes every token.
///
/// # Arguments
/// * `logp_proximal`, `logp_behaviour` — `[B, T]` (any graph is ignored).
/// * `mask` — `[B, T]`.
/// * `tau` — the second-moment budget, finite and `> 0` (the paper uses 0.04).
///
/// # Errors
/// [`LossError::InvalidConfig`] naming `tau`; the tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::m2po_mask;
/// let prox = Tensor::from_slice2(&[[-1.0f64, -1.0, -1.0, -1.0]]);
/// let behaviour = Tensor::from_slice2(&[[-1.0f64, -1.1, -1.5, -3.0]]); // M = 0, 0.01, 0.25, 4
/// let mask = Tensor::from_slice2(&[[true, true, true, true]]);
/// let kept = m2po_mask(&prox, &behaviour, &mask, 0.1)?;
/// // Dropping 4 leaves a mean of 0.087 < 0.1.
/// assert_eq!(Vec::<bool>::try_from(&kept.flatten(0, -1))?, vec![true, true, true, false]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn m2po_mask(
    logp_proximal: &Tensor,
    logp_behaviour: &Tensor,
    mask: &Tensor,
    tau: f64,
) -> Result<Tensor, LossError> {
    validate::positive(tau, "tau", "M2PO's second-moment budget must be finite and > 0 (the paper uses 0.04)")?;
    let x = token_inputs::check(TokenArgs {
        logp: &validate::detached(logp_proximal, "logp_proximal")?,
        other: (logp_behaviour, "logp_behaviour"),
        weights: None,
        mask,
        per_token_weights: false,
        checks: Checks::Full,
    })?;
    let shape = x.mask.size();
    let m2 = x.delta.f_to_kind(Kind::Double)?.f_square()?.f_flatten(0, -1)?;
    let valid = x.mask.f_flatten(0, -1)?;
    // Ascending order with padding last (+∞); among ties, earlier positions first.
    let keyed = m2.f_masked_fill(&valid.f_logical_not()?, f64::INFINITY)?;
    let (sorted, order) = keyed.f_sort_stable(true, 0, false)?;
    let n = valid.f_sum(Kind::Double)?;
    let count = Tensor::f_arange_start(1, sorted.size()[0] + 1, (Kind::Double, sorted.device()))?;
    let in_range = count.f_le_tensor(&n)?;
    let prefix = sorted.f_masked_fill(&in_range.f_logical_not()?, 0.0)?.f_cumsum(0, Kind::Double)?;
    let below = prefix.f_div(&count)?.f_lt(tau)?.f_logical_and(&in_range)?;
    // The most tokens kept: the longest prefix of the smallest values whose mean is below τ
    // (prefix means grow with the prefix), at least one token.
    let keep = count.f_mul(&below.f_to_kind(Kind::Double)?)?.f_max()?.f_clamp_min(1.0)?;
    let kept_sorted = count.f_le_tensor(&keep)?.f_logical_and(&in_range)?;
    let kept_sorted = kept_sorted.f_to_kind(Kind::Float)?;
    let kept = kept_sorted.f_zeros_like()?.f_scatter(0, &order, &kept_sorted)?.f_gt(0.5)?;
    Ok(kept.f_reshape(shape.as_slice())?.f_logical_and(&x.mask)?)
}
