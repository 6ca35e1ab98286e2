//! Generalized advantage estimation (Schulman et al., arXiv 1506.02438) over token-level rewards
//! and a critic's values `[B, T]`, with a padding mask.
//!
//! ```text
//! δ_t = r_t + γ V_{t+1} − V_t           A_t = δ_t + γλ A_{t+1}           R_t = A_t + V_t
//! ```
//!
//! `t + 1` is the next *unmasked* token of the sequence (padding in between is skipped, as verl
//! skips observation tokens); after the last one, `V = 0` and `A = 0` (the completion ended: no
//! bootstrap).

use crate::error::LossError;
use crate::token_advantages::{TokenAdvantages, check_token_values, finite_results, unit_interval};
use tch::Tensor;

/// GAE advantages and returns (the critic's targets).
///
/// ```text
/// δ_t = r_t + γ V_next − V_t            V_next: V of the next unmasked token, 0 after the last
/// A_t = δ_t + γ λ A_next                A_next: A of the next unmasked token, 0 after the last
/// R_t = A_t + V_t                       (A_t = R_t = 0 on padding)
/// ```
///
/// `λ = 1` gives the Monte-Carlo return minus `V`; `λ = 0` the one-step TD error. The advantages
/// are not whitened: verl whitens them afterwards over the batch's tokens, which
/// [`whiten`](crate::whiten)`(&out.advantages, Some(&mask), 1e-8)` reproduces (the returns stay
/// unwhitened).
///
/// Reference: Schulman et al., *High-Dimensional Continuous Control Using Generalized Advantage
/// Estimation*, arXiv 1506.02438; verl 0.9.1 `compute_gae_advantage_return`
/// (`algorithm.adv_estimator=gae`, `algorithm.gamma`, `algorithm.lam`), which leaves on padding the
/// advantage of the next real token (here 0).
///
/// # Arguments
/// * `token_rewards` — `[B, T]`, the reward of each token (an outcome reward on the last one, minus
///   any KL penalty: [`kl_penalized_rewards`](crate::kl_penalized_rewards)).
/// * `values` — `[B, T]`, the critic's value of each token's state (detached here).
/// * `mask` — `[B, T]`.
/// * `gamma`, `lam` — the discount and the trace factor, each in `[0, 1]` (verl: 1 and 1).
///
/// # Errors
/// The tensor checks of [`LossError`] naming `token_rewards`, `values` or `mask`;
/// [`LossError::InvalidArgument`] for `gamma` or `lam` outside `[0, 1]`;
/// [`LossError::NonFiniteLoss`] when the advantages or returns overflow the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::gae_advantages;
///
/// let r = Tensor::from_slice2(&[[0.0f64, 1.0, f64::NAN]]);
/// let v = Tensor::from_slice2(&[[0.5f64, 0.25, f64::NAN]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = gae_advantages(&r, &v, &mask, 1.0, 1.0)?;
/// // λ = γ = 1: A_t = (sum of the rewards from t on) − V_t; R_t = 1.
/// assert_eq!(Vec::<f64>::try_from(&out.advantages.flatten(0, -1))?, vec![0.5, 0.75, 0.0]);
/// assert_eq!(Vec::<f64>::try_from(&out.returns.flatten(0, -1))?, vec![1.0, 1.0, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn gae_advantages(
    token_rewards: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    gamma: f64,
    lam: f64,
) -> Result<TokenAdvantages, LossError> {
    unit_interval(gamma, "gamma")?;
    unit_interval(lam, "lam")?;
    let (kind, m, clean) = check_token_values(&[(token_rewards, "token_rewards"), (values, "values")], mask)?;
    let (r, v) = (&clean[0], &clean[1]);
    let t_len = r.size()[1];
    let mut next_value = r.f_select(1, 0)?.f_zeros_like()?; // [B]
    let mut next_adv = next_value.f_zeros_like()?;
    let mut columns = Vec::with_capacity(t_len as usize);
    for t in (0..t_len).rev() {
        let real = m.f_select(1, t)?;
        let v_t = v.f_select(1, t)?;
        let delta = r.f_select(1, t)?.f_add(&next_value.f_mul_scalar(gamma)?)?.f_sub(&v_t)?;
        let adv = delta.f_add(&next_adv.f_mul_scalar(gamma * lam)?)?;
        next_value = v_t.f_where_self(&real, &next_value)?;
        next_adv = adv.f_where_self(&real, &next_adv)?;
        columns.push(adv.f_where_self(&real, &adv.f_zeros_like()?)?);
    }
    columns.reverse();
    let advantages = Tensor::f_stack(&columns, 1)?;
    let returns = advantages.f_add(v)?; // v is 0 on padding, and so is A
    finite_results(&[&advantages, &returns], kind)?;
    Ok(TokenAdvantages { advantages, returns })
}
