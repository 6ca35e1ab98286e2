//! The KL penalty as a *reward* term (PPO for language models, Ziegler et al., arXiv 1909.08593;
//! verl's `algorithm.use_kl_in_reward`), and the controllers of its coefficient.
//!
//! Instead of adding `β · KL` to the loss ([`crate::kl_penalty`]), the per-token estimate of
//! `KL(π_old‖π_ref)` on the sampled tokens is subtracted from the token-level scores before the
//! advantages are computed:
//!
//! ```text
//! k_t   = estimator(clamp(log π_old,t − log π_ref,t, ±M))      (KlConfig's estimator, K1 in verl)
//! r_t   = s_t − β k_t            on unmasked tokens; 0 on padding
//! kl    = (1/B) Σ_i (Σ_t m k_t / L_i)                          (verl's actor/reward_kl_penalty)
//!
//! fixed:     β stays
//! adaptive:  β ← β (1 + clip(kl / target − 1, −0.2, 0.2) · n_steps / horizon)
//! ```
//!
//! Reference: Ziegler et al., *Fine-Tuning Language Models from Human Preferences*,
//! arXiv 1909.08593 (the adaptive controller); verl `apply_kl_penalty`, `compute_rewards`,
//! `AdaptiveKLController`, `FixedKLController`.

use crate::error::LossError;
use crate::kl::{KlConfig, estimator_value};
use crate::token_inputs::{self, TokenArgs};
use crate::validate;
use tch::{Kind, Tensor};

/// Token-level rewards with the KL penalty subtracted, from [`kl_penalized_rewards`].
///
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_penalized_rewards, KlConfig};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let scores = Tensor::from_slice2(&[[0.0f64, 1.0]]);
/// let out = kl_penalized_rewards(&lp, &lp, &scores, &lp.ones_like(), &KlConfig::k1())?;
/// assert_eq!(out.kl_mean.double_value(&[]), 0.0); // the same policy: no penalty
/// assert_eq!(out.rewards.double_value(&[0, 1]), 1.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct KlRewards {
    /// `[B, T]`: `s_t − β k_t` on unmasked tokens, 0 on padding (detached).
    pub rewards: Tensor,
    /// `[B, T]`: the estimate `k_t`, 0 on padding (detached).
    pub kl: Tensor,
    /// 0-d: the mean over sequences of each sequence's mean `k_t` (a sequence with no token counts
    /// as 0), verl's `current_kl`: what [`AdaptiveKlController::update`](crate::AdaptiveKlController::update) takes (one host read).
    pub kl_mean: Tensor,
}

/// Subtracts `β · KL` from token-level scores (verl's `apply_kl_penalty` with
/// `algorithm.use_kl_in_reward=True`; its `compute_rewards` is the case K1 without a mask).
///
/// ```text
/// d_t = clamp(log π_t − log π_ref,t, ±M)        k_t = the estimator of cfg (value clamp, if set)
/// rewards_t = m_t (s_t − coef · k_t)           kl_mean = (1/B) Σ_i Σ_t m k_t / max(L_i, 1)
/// ```
///
/// `cfg.coef` is `β`: pass the controller's current value with
/// `cfg.with_coef(controller.value)`. `cfg.aggregation` and `cfg.straight_through` do not apply
/// (the result carries no gradient).
///
/// Reference: Ziegler et al., arXiv 1909.08593; verl `ray_trainer.apply_kl_penalty`
/// (`algorithm.kl_penalty`, default `kl` = [`KlConfig::k1`]) and `core_algos.compute_rewards`.
///
/// # Arguments
/// * `logp` — `[B, T]`, per-token log-probs of the policy that sampled the tokens (verl's
///   `old_log_probs`); detached.
/// * `logp_ref` — `[B, T]`, of the reference policy; detached.
/// * `token_scores` — `[B, T]`, the token-level scores (an outcome reward sits on the last token).
/// * `mask` — `[B, T]`.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`], naming the
/// argument (`token_scores` must be `[B, T]`).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_penalized_rewards, KlConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -2.0, f64::NAN]]);
/// let logp_ref = Tensor::from_slice2(&[[-1.5f64, -2.0, 0.0]]);
/// let scores = Tensor::from_slice2(&[[0.0f64, 1.0, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = kl_penalized_rewards(&logp, &logp_ref, &scores, &mask, &KlConfig::k1().with_coef(0.1))?;
/// assert_eq!(Vec::<f64>::try_from(&out.rewards.flatten(0, -1))?, vec![-0.05, 1.0, 0.0]);
/// assert!((out.kl_mean.double_value(&[]) - 0.25).abs() < 1e-15);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn kl_penalized_rewards(
    logp: &Tensor,
    logp_ref: &Tensor,
    token_scores: &Tensor,
    mask: &Tensor,
    cfg: &KlConfig,
) -> Result<KlRewards, LossError> {
    cfg.validate()?;
    validate::float_tensor(token_scores, "token_scores")?;
    validate::rank(token_scores, "token_scores", 2, "[B, T] token-level scores")?;
    let logp = validate::detached(logp, "logp")?;
    let x = token_inputs::check(TokenArgs {
        logp: &logp,
        other: (logp_ref, "logp_ref"),
        weights: Some((token_scores, "token_scores")),
        mask,
        per_token_weights: true,
        checks: cfg.checks,
    })?;
    let k = x.zero_padding(&estimator_value(&x.delta, &cfg.with_straight_through(false))?)?;
    let rewards = x.zero_padding(&x.weights().f_sub(&k.f_mul_scalar(cfg.coef)?)?)?;
    let per_seq = k.f_sum_dim_intlist(1, false, None::<Kind>)?.f_div(&x.lengths.f_clamp_min(1.0)?)?;
    let kl_mean = per_seq.f_mean(None::<Kind>)?;
    Ok(KlRewards { rewards, kl: k, kl_mean })
}
