//! Advantages from token-level rewards `[B, T]` with a padding mask: REINFORCE++ (discounted
//! returns, whitened over the batch's tokens), REINFORCE++-baseline (group mean, then whitened)
//! and ReMax (the reward of the greedy completion as baseline). GAE is in `src/gae.rs`.
//!
//! ```text
//! REINFORCE++            G_t = r_t + γ G_{t+1}  (over unmasked tokens)     A = whiten(G)
//! REINFORCE++-baseline   A = whiten((R − m_g) on every token of the completion)
//! ReMax                  G_t = Σ_{s ≥ t} r_s     A_t = G_t − R(greedy)
//! ```
//!
//! Padding (mask 0) is skipped: it carries the running return through unchanged, its reward is
//! ignored (it may hold NaN), and its advantage and return are 0. An outcome reward sits on the
//! completion's last real token.

use crate::advantages::{GroupAdvantage, SingletonGroup, group_advantages_with, rename, whiten};
use crate::aggregate::masked_fill_zero;
use crate::error::LossError;
use crate::validate;
use tch::{Kind, Tensor};

/// Advantages and returns per token, both `[B, T]`, 0 on padding, detached.
///
/// ```
/// use tch::Tensor;
/// use topr_loss::remax_advantages;
/// let r = Tensor::from_slice2(&[[0.0f64, 1.0]]);
/// let out = remax_advantages(&r, &Tensor::from_slice(&[0.5f64]), &r.ones_like())?;
/// assert_eq!((out.advantages.size(), out.returns.size()), (vec![1, 2], vec![1, 2]));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct TokenAdvantages {
    /// `[B, T]` advantages (0 on padding).
    pub advantages: Tensor,
    /// `[B, T]` returns, the value targets (0 on padding).
    pub returns: Tensor,
}

/// Token-level inputs checked against one another: the compute dtype, the bool mask and each
/// tensor detached, in the compute dtype, with padding replaced by 0.
pub(crate) fn check_token_values(
    values: &[(&Tensor, &'static str)],
    mask: &Tensor,
) -> Result<(Kind, Tensor, Vec<Tensor>), LossError> {
    let kinds = values.iter().map(|(t, name)| validate::float_tensor(t, name)).collect::<Result<Vec<_>, _>>()?;
    let kind = validate::compute_kind(&kinds);
    let (first, first_name) = values[0];
    let shape = validate::rank(first, first_name, 2, "[B, T] per-token values")?;
    validate::non_empty(&shape, first_name, "sequence")?;
    for (t, name) in &values[1..] {
        validate::same_shape(t, name, &shape, "the shape of the per-token values")?;
        validate::same_device(t, name, first.device(), first_name)?;
    }
    let m = validate::bool_mask(mask, "mask")?;
    validate::same_shape(&m, "mask", &shape, "the shape of the per-token values")?;
    validate::same_device(&m, "mask", first.device(), first_name)?;
    let mut clean = Vec::with_capacity(values.len());
    for (t, name) in values {
        validate::finite(t, name, Some(&m))?;
        clean.push(masked_fill_zero(&t.f_detach()?.f_to_kind(kind)?, &m)?);
    }
    Ok((kind, m, clean))
}

/// Checks a discount or trace factor: finite, in `[0, 1]`.
pub(crate) fn unit_interval(v: f64, argument: &'static str) -> Result<(), LossError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(LossError::InvalidArgument { argument, value: v, reason: "must be in [0, 1]".into() });
    }
    Ok(())
}

/// Discounted returns `G_t = r_t + γ G_{t+1}` right to left, skipping padding (which carries
/// `G` through unchanged and gets 0); `r` is zero on padding.
fn discounted_returns(r: &Tensor, m: &Tensor, gamma: f64) -> Result<Tensor, LossError> {
    let t_len = r.size()[1];
    let mut running = r.f_select(1, 0)?.f_zeros_like()?; // [B]
    let mut columns = Vec::with_capacity(t_len as usize);
    for t in (0..t_len).rev() {
        let real = m.f_select(1, t)?;
        let candidate = r.f_select(1, t)?.f_add(&running.f_mul_scalar(gamma)?)?;
        running = candidate.f_where_self(&real, &running)?;
        columns.push(candidate.f_where_self(&real, &candidate.f_zeros_like()?)?);
    }
    columns.reverse();
    Ok(Tensor::f_stack(&columns, 1)?)
}

/// REINFORCE++: discounted token returns, whitened over all unmasked tokens of the batch.
///
/// ```text
/// G_t = r_t + γ G_{t+1}          over the unmasked tokens of each sequence (padding skipped)
/// μ, σ² = mean and unbiased variance of G over the unmasked tokens of the batch
/// A_t = (G_t − μ) / sqrt(σ² + eps)
/// ```
///
/// Reference: Hu, *REINFORCE++*, arXiv 2501.03262; verl 0.9.1
/// `compute_reinforce_plus_plus_outcome_advantage` (`algorithm.adv_estimator=reinforce_plus_plus`,
/// `algorithm.gamma`), whose `masked_whiten` uses the unbiased variance and `eps = 1e-8`, as
/// [`whiten`] does (verl also divides its masked sums by `N + 1e-8` rather than `N`).
///
/// # Arguments
/// * `token_rewards` — `[B, T]`, the reward of each token (an outcome reward on the last one).
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
/// * `gamma` — the discount, in `[0, 1]` (verl's default 1).
/// * `eps` — added to the variance, `≥ 0` (verl: 1e-8).
///
/// # Returns
/// [`TokenAdvantages`]: the whitened advantages and the returns `G` (0 on padding).
///
/// # Errors
/// The tensor checks of [`LossError`] naming `token_rewards` or `mask`;
/// [`LossError::InvalidArgument`] for `gamma` outside `[0, 1]` or a bad `eps`;
/// [`LossError::EmptyBatch`] with fewer than two unmasked tokens; [`LossError::NonFiniteLoss`]
/// when the returns overflow the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::reinforce_pp_advantages;
///
/// let r = Tensor::from_slice2(&[[0.0f64, 1.0], [0.0, -1.0]]);
/// let out = reinforce_pp_advantages(&r, &r.ones_like(), 0.5, 0.0)?;
/// assert_eq!(Vec::<f64>::try_from(&out.returns.flatten(0, -1))?, vec![0.5, 1.0, -0.5, -1.0]);
/// let a = Vec::<f64>::try_from(&out.advantages.flatten(0, -1))?;
/// assert!(a.iter().sum::<f64>().abs() < 1e-12); // whitened: zero mean
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn reinforce_pp_advantages(
    token_rewards: &Tensor,
    mask: &Tensor,
    gamma: f64,
    eps: f64,
) -> Result<TokenAdvantages, LossError> {
    unit_interval(gamma, "gamma")?;
    let (kind, m, clean) = check_token_values(&[(token_rewards, "token_rewards")], mask)?;
    let returns = discounted_returns(&clean[0], &m, gamma)?;
    let advantages = whiten(&returns, Some(&m), eps).map_err(|e| rename(e, "values", "token_rewards", kind))?;
    Ok(TokenAdvantages { advantages, returns })
}

/// REINFORCE++-baseline: each completion's reward minus its group's mean, on every token of the
/// completion, whitened over all unmasked tokens of the batch.
///
/// ```text
/// A'_{g,k} = R_{g,k} − m_g                        (group of one: see SingletonGroup)
/// A_{b,t} = whiten(A'_b on the unmasked tokens of row b = g·K + k)
/// ```
///
/// Whitening is over tokens, so a long completion weighs more in the batch's mean and variance.
///
/// Reference: Hu, *REINFORCE++*, arXiv 2501.03262 (the `-baseline` variant); verl 0.9.1
/// `compute_reinforce_plus_plus_baseline_outcome_advantage`
/// (`algorithm.adv_estimator=reinforce_plus_plus_baseline`), which gives a group of one the mean 0
/// ([`SingletonGroup::ZeroMeanUnitStd`]) and whitens with `eps = 1e-8`.
///
/// # Arguments
/// * `rewards` — `[G, K]`, one reward per completion.
/// * `mask` — `[G·K, T]`, the completions' tokens, row `g·K + k` for completion `k` of prompt `g`.
/// * `eps` — added to the variance, `≥ 0` (verl: 1e-8).
/// * `singleton` — what a group of one gets.
///
/// # Errors
/// As [`group_advantages`](crate::group_advantages) for `rewards`; [`LossError::ShapeMismatch`]
/// naming `mask` unless it has `G·K` rows; [`LossError::EmptyBatch`] with fewer than two unmasked
/// tokens.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{reinforce_pp_baseline_advantages, SingletonGroup};
///
/// let r = Tensor::from_slice2(&[[1.0f64, 0.0]]); // one prompt, two completions
/// let mask = Tensor::from_slice2(&[[true, false], [true, true]]);
/// let a = reinforce_pp_baseline_advantages(&r, &mask, 0.0, SingletonGroup::OwnMean)?;
/// // Centred 0.5, −0.5, −0.5 on the three tokens: mean −1/6, unbiased variance 1/3.
/// let want = [(0.5 + 1.0 / 6.0) / (1.0f64 / 3.0).sqrt(), 0.0];
/// assert!((a.double_value(&[0, 0]) - want[0]).abs() < 1e-12 && a.double_value(&[0, 1]) == want[1]);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn reinforce_pp_baseline_advantages(
    rewards: &Tensor,
    mask: &Tensor,
    eps: f64,
    singleton: SingletonGroup,
) -> Result<Tensor, LossError> {
    let centred = group_advantages_with(rewards, GroupAdvantage::DrGrpo, singleton)?.f_flatten(0, -1)?; // [G·K]
    let m = validate::bool_mask(mask, "mask")?;
    let rows = centred.size()[0];
    let found = m.size();
    if found.len() != 2 || found[0] != rows {
        return Err(LossError::ShapeMismatch {
            argument: "mask",
            found,
            expected: vec![rows, m.size().last().copied().unwrap_or(0)],
            reason: "[G·K, T]: one row per completion of `rewards`",
        });
    }
    validate::same_device(&m, "mask", rewards.device(), "rewards")?;
    let per_token = centred.f_unsqueeze(1)?.f_expand(m.size().as_slice(), false)?;
    whiten(&per_token, Some(&m), eps).map_err(|e| rename(e, "values", "mask", centred.kind()))
}

/// ReMax: the return minus the reward of the greedy completion of the same prompt.
///
/// ```text
/// G_t = Σ_{s ≥ t} m_s r_s          A_t = G_t − R_greedy          (on unmasked tokens)
/// ```
///
/// With an outcome reward (on the last token) `G_t = R` on every token, so `A = R − R_greedy`
/// broadcast over the completion.
///
/// Reference: Li et al., *ReMax*, arXiv 2310.10505; verl 0.9.1 `compute_remax_outcome_advantage`
/// (`algorithm.adv_estimator=remax`; `reward_baselines` are the greedy completions' rewards).
///
/// # Arguments
/// * `token_rewards` — `[B, T]`, the reward of each token of the sampled completions.
/// * `greedy_rewards` — `[B]`, the reward of the greedy completion of each sequence's prompt.
/// * `mask` — `[B, T]`.
///
/// # Returns
/// [`TokenAdvantages`]: the advantages and the undiscounted returns `G` (0 on padding).
///
/// # Errors
/// The tensor checks of [`LossError`] naming `token_rewards`, `greedy_rewards` or `mask`;
/// [`LossError::NonFiniteLoss`] when the returns overflow the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::remax_advantages;
///
/// let r = Tensor::from_slice2(&[[0.0f64, 0.0, 1.0], [0.0, 1.0, f64::NAN]]);
/// let mask = Tensor::from_slice2(&[[true, true, true], [true, true, false]]);
/// let out = remax_advantages(&r, &Tensor::from_slice(&[1.0f64, 0.25]), &mask)?;
/// assert_eq!(Vec::<f64>::try_from(&out.advantages.flatten(0, -1))?, vec![0.0, 0.0, 0.0, 0.75, 0.75, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn remax_advantages(
    token_rewards: &Tensor,
    greedy_rewards: &Tensor,
    mask: &Tensor,
) -> Result<TokenAdvantages, LossError> {
    let (kind, m, clean) = check_token_values(&[(token_rewards, "token_rewards")], mask)?;
    let k = validate::compute_kind(&[kind, validate::float_tensor(greedy_rewards, "greedy_rewards")?]);
    validate::same_shape(greedy_rewards, "greedy_rewards", &m.size()[..1], "[B], one per sequence of `token_rewards`")?;
    validate::same_device(greedy_rewards, "greedy_rewards", token_rewards.device(), "token_rewards")?;
    validate::finite(greedy_rewards, "greedy_rewards", None)?;
    let returns = discounted_returns(&clean[0].f_to_kind(k)?, &m, 1.0)?;
    let baseline = greedy_rewards.f_detach()?.f_to_kind(k)?.f_unsqueeze(1)?;
    let advantages = masked_fill_zero(&returns.f_sub(&baseline)?, &m)?;
    finite_results(&[&advantages, &returns], k)?;
    Ok(TokenAdvantages { advantages, returns })
}

/// [`LossError::NonFiniteLoss`] unless every entry of `results` is finite (one host read): finite
/// rewards so large that their sums overflow the compute dtype.
pub(crate) fn finite_results(results: &[&Tensor], kind: Kind) -> Result<(), LossError> {
    let bad = results
        .iter()
        .map(|t| Ok(t.f_isfinite()?.f_logical_not()?.f_sum(Kind::Int64)?))
        .collect::<Result<Vec<_>, LossError>>()?;
    let bad = crate::checks::read_i64(&Tensor::f_stack(&bad, 0)?.f_sum(Kind::Int64)?, &[])?;
    if bad > 0 {
        return Err(LossError::NonFiniteLoss { compute_dtype: crate::error::kind_name(kind) });
    }
    Ok(())
}
