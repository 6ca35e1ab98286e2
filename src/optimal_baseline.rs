//! The optimal token baseline (OTB): a baseline for each group of completions and each token
//! position, the group's returns weighted by each completion's accumulated gradient variance.
//!
//! ```text
//! G_{i,t} = Σ_{s ≥ t} m_{i,s} r_{i,s}                   the return (reward to go)
//! w_{i,t} = (1 − 2 π_{i,t} + Σ_v π_{i,t}(v)²) · ρ_{i,t}²   ‖∂ log π(y_t)/∂ logits‖², ρ = 1 without IS weights
//! W_{i,t} = Σ_{s ≤ t} m_{i,s} w_{i,s}                   accumulated along the positions
//! B_{g,t} = Σ_{i∈g} m_{i,t} W_{i,t} G_{i,t} / (Σ_{i∈g} m_{i,t} W_{i,t} + eps)
//! A_{i,t} = m_{i,t} (G_{i,t} − B_{g,t})
//! ```

use crate::advantages::SingletonGroup;
use crate::error::LossError;
use crate::token_advantages::{TokenAdvantages, check_token_values, finite_results};
use tch::{Kind, Tensor};

/// Optimal-token-baseline advantages: each token's return minus a baseline of its group at its
/// position, the group's returns there weighted by how much gradient variance each completion
/// accumulated up to that position (see the formulas below).
///
/// ```text
/// G_{i,t} = Σ_{s ≥ t} m_{i,s} r_{i,s}                            (the returns, 0 on padding)
/// w_{i,t} = 1 − 2 π_{i,t} + Σπ²_{i,t}      π_{i,t} = exp(logp_mu_{i,t});  × ρ_{i,t}² with `is_weights`
/// W_{i,t} = Σ_{s ≤ t} m_{i,s} w_{i,s}
/// B_{g,t} = Σ_{i∈g} m_{i,t} W_{i,t} G_{i,t} / (Σ_{i∈g} m_{i,t} W_{i,t} + eps)   (0 where the sum is 0)
/// A_{i,t} = m_{i,t} (G_{i,t} − B_{g,t})
/// ```
///
/// `w = ‖e_y − π‖²` is the squared norm of the gradient of `log π(y_t)` with respect to the
/// logits (never negative, since `Σπ² ≥ π²`): the baseline that minimises the variance of the
/// token-level policy gradient weighs each completion's return by the variance its path has
/// accumulated so far. Rows `g·K .. g·K + K − 1` are the `K = group_size` completions of prompt
/// `g`, as in the crate's other group estimators. With an outcome reward on the last real token,
/// `G_{i,t} = R_i` on every real token.
///
/// **Lone completions.** At a position where a completion is the only real one of its group (a
/// group of one, or the tail of a group's longest completion), the formula gives it its own
/// return as baseline and an advantage of about 0 (`G · eps / (W + eps)`):
///
/// | `singleton` | a completion alone at its position |
/// |---|---|
/// | [`SingletonGroup::ZeroMeanUnitStd`] (verl) | baseline 0: the advantage is the return `G` |
/// | [`SingletonGroup::OwnMean`] | the formula: `A = G · eps / (W + eps)`, about 0 |
///
/// Reference: Li, Xu et al., *The Optimal Token Baseline: Variance Reduction for Long-Horizon
/// LLM-RL*, arXiv 2602.07078; verl 0.9.1 `compute_optimal_token_baseline_advantage`
/// (`algorithm.adv_estimator=optimal_token_baseline` with
/// `actor_rollout_ref.actor.calculate_sum_pi_squared=True`; the trainer passes `rollout_is_weights`
/// when it has them, and `epsilon = 1e-8`, `handle_zero_tail = True`), tested against it
/// (`tests/reference/peer_verl_advantages.py`). Where the crate differs from verl:
///
/// - verl's `handle_zero_tail=True` sets the baseline of a group's longest completion (when it is
///   the only longest) to 0 from the second longest completion's *length* on; the crate's
///   [`SingletonGroup::ZeroMeanUnitStd`] sets it to 0 where the completion is the group's only
///   real one. With right-padded masks (verl's responses) the two are the same positions; with
///   holes or left padding verl's rule counts tokens, the crate's looks at the mask.
/// - verl gives a group of one baseline 0 even with `handle_zero_tail=False`; the crate's
///   [`SingletonGroup::OwnMean`] applies the formula there too (`A ≈ 0`, as a group of one gets
///   under the crate's default elsewhere). For groups of two or more it is verl's
///   `handle_zero_tail=False`.
/// - The returns are 0 on padding (verl's reverse cumulative sum leaves the return on padding
///   that precedes a real token); padding may hold NaN (verl multiplies it by the mask).
///
/// # Arguments
/// * `logp_mu` — `[G·K, T]`, `log π(y_t)` of each sampled token under the policy the
///   advantages are computed for (verl's `old_log_probs`), `≤ 0`.
/// * `sum_pi_squared` — `[G·K, T]`, `Σ_v π(v | s_t)²` from the same forward pass, in `[0, 1]`
///   (from logits `z`: `exp(logsumexp(2z) − 2 logsumexp(z))`).
/// * `token_rewards` — `[G·K, T]`, each token's reward (an outcome reward on the last real token).
/// * `mask` — `[G·K, T]`, bool, integer or 0/1 floating.
/// * `is_weights` — `None`, or `[G·K, T]` rollout importance weights `ρ ≥ 0` (e.g.
///   [`rollout_weights`](crate::rollout_weights)`(..).weights`): `w` is multiplied by `ρ²`.
/// * `group_size` — `K ≥ 1`, which divides the number of rows.
/// * `singleton` — the baseline of a completion alone at its position (see above; verl:
///   [`SingletonGroup::ZeroMeanUnitStd`]).
/// * `eps` — finite, `≥ 0`, added to the denominator (verl: 1e-8).
///
/// # Returns
/// [`TokenAdvantages`]: the advantages `A` and the returns `G`, `[G·K, T]`, 0 on padding,
/// detached, in f64 when any input is f64, else f32.
///
/// # Errors
/// The tensor checks of [`LossError`] naming `logp_mu`, `sum_pi_squared`, `token_rewards`,
/// `mask` or `is_weights` (rank, shape, dtype, device, NaN or inf where real);
/// [`LossError::PositiveLogProb`] for `logp_mu` above [`LOG_PROB_TOLERANCE`](crate::LOG_PROB_TOLERANCE)
/// where real; [`LossError::InvalidArgument`] naming `sum_pi_squared` outside `[0, 1]` (by more
/// than the same tolerance), `is_weights` negative, `group_size` below 1 or not dividing the
/// rows, or `eps`; [`LossError::NonFiniteLoss`] when the returns or advantages overflow the
/// compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{optimal_token_baseline_advantages, SingletonGroup};
///
/// // One prompt, two completions with outcome rewards 1 and 0; the second has one token.
/// let logp = Tensor::from_slice2(&[[-0.1f64, -2.0], [-1.0, f64::NAN]]);
/// let sum_pi2 = Tensor::from_slice2(&[[0.82f64, 0.4], [0.5, f64::NAN]]);
/// let rewards = Tensor::from_slice2(&[[0.0f64, 1.0], [0.0, f64::NAN]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, false]]);
/// let verl = SingletonGroup::ZeroMeanUnitStd;
/// let out = optimal_token_baseline_advantages(&logp, &sum_pi2, &rewards, &mask, None, 2, verl, 0.0)?;
/// let a = Vec::<f64>::try_from(&out.advantages.flatten(0, -1))?;
/// // Position 0: B = (W₁·1 + W₂·0)/(W₁ + W₂), w = 1 − 2π + Σπ².
/// let w1 = 1.0 - 2.0 * (-0.1f64).exp() + 0.82;
/// let w2 = 1.0 - 2.0 * (-1.0f64).exp() + 0.5;
/// assert!((a[0] - (1.0 - w1 / (w1 + w2))).abs() < 1e-12);
/// assert!((a[2] - (0.0 - w1 / (w1 + w2))).abs() < 1e-12);
/// // Position 1: the first completion is alone; under verl's convention its baseline is 0.
/// assert_eq!((a[1], a[3]), (1.0, 0.0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
// Eight inputs, as verl's function takes them: the four per-token tensors, the optional IS
// weights, the group layout and the two conventions.
#[allow(clippy::too_many_arguments)]
pub fn optimal_token_baseline_advantages(
    logp_mu: &Tensor,
    sum_pi_squared: &Tensor,
    token_rewards: &Tensor,
    mask: &Tensor,
    is_weights: Option<&Tensor>,
    group_size: i64,
    singleton: SingletonGroup,
    eps: f64,
) -> Result<TokenAdvantages, LossError> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(bad("eps", eps, "must be finite and >= 0"));
    }
    let mut values = vec![(logp_mu, "logp_mu"), (sum_pi_squared, "sum_pi_squared"), (token_rewards, "token_rewards")];
    if let Some(w) = is_weights {
        values.push((w, "is_weights"));
    }
    let (kind, m, clean) = check_token_values(&values, mask)?;
    let rows = m.size()[0];
    if group_size < 1 || rows % group_size != 0 {
        return Err(bad(
            "group_size",
            group_size as f64,
            &format!(
                "must be >= 1 and divide the {rows} rows: rows g·K .. g·K + K − 1 are the completions of prompt g"
            ),
        ));
    }
    check_ranges(&clean)?;
    let mf = m.f_to_kind(kind)?;
    let (lp, r) = (&clean[0], &clean[2]);
    let mut w = clean[1].f_sub(&lp.f_exp()?.f_mul_scalar(2.0)?)?.f_add_scalar(1.0)?;
    if let Some(rho) = clean.get(3) {
        w = w.f_mul(&rho.f_square()?)?;
    }
    let big_w = w.f_mul(&mf)?.f_cumsum(1, None::<Kind>)?.f_mul(&mf)?; // W, 0 on padding
    let returns = r.f_flip([1])?.f_cumsum(1, None::<Kind>)?.f_flip([1])?.f_mul(&mf)?; // r is 0 on padding
    let baseline = group_baseline(&returns, &big_w, &mf, group_size, singleton, eps)?;
    let advantages = crate::aggregate::masked_fill_zero(&returns.f_sub(&baseline)?, &m)?;
    finite_results(&[&advantages, &returns], kind)?;
    Ok(TokenAdvantages { advantages, returns })
}

/// `B_{g,t}` broadcast to every row of its group, `[G·K, T]`: `W` and the returns are 0 on
/// padding, `mf` the 0/1 mask.
fn group_baseline(
    returns: &Tensor,
    big_w: &Tensor,
    mf: &Tensor,
    k: i64,
    singleton: SingletonGroup,
    eps: f64,
) -> Result<Tensor, LossError> {
    let shape = returns.size();
    let (rows, t) = (shape[0], shape[1]);
    let grouped = |x: &Tensor| x.f_reshape([rows / k, k, t]);
    let num = grouped(&returns.f_mul(big_w)?)?.f_sum_dim_intlist(1, true, None::<Kind>)?; // [G, 1, T]
    let den = grouped(big_w)?.f_sum_dim_intlist(1, true, None::<Kind>)?.f_add_scalar(eps)?;
    let zero = num.f_zeros_like()?;
    let mut b = num.f_div(&den.f_where_scalarother(&den.f_ne(0.0)?, 1.0)?)?.f_where_self(&den.f_ne(0.0)?, &zero)?;
    if singleton == SingletonGroup::ZeroMeanUnitStd {
        let real = grouped(mf)?.f_sum_dim_intlist(1, true, None::<Kind>)?;
        b = zero.f_where_self(&real.f_le(1.0)?, &b)?;
    }
    Ok(b.f_expand([rows / k, k, t], false)?.f_reshape([rows, t])?)
}

/// `logp_mu ≤ tol`, `Σπ² ∈ [−tol, 1 + tol]`, `is_weights ≥ 0` on the inputs with padding already
/// zeroed (which passes every check), in one host read.
fn check_ranges(clean: &[Tensor]) -> Result<(), LossError> {
    let tol = crate::LOG_PROB_TOLERANCE;
    let mut stats = vec![clean[0].f_max()?, clean[1].f_min()?, clean[1].f_max()?];
    if let Some(rho) = clean.get(3) {
        stats.push(rho.f_min()?);
    }
    let stats = stats.iter().map(|s| s.f_to_kind(Kind::Double)).collect::<Result<Vec<_>, _>>()?;
    let v = crate::checks::read_vec(&Tensor::f_stack(&stats, 0)?)?;
    if v[0] > tol {
        // In f64, as `v[0]` was compared (see `validate::all_finite_sums_and_log_probs`).
        let first_index = first_true(&clean[0].f_to_kind(Kind::Double)?.f_gt(tol)?)?;
        return Err(LossError::PositiveLogProb { argument: "logp_mu", max: v[0], first_index });
    }
    if v[1] < -tol || v[2] > 1.0 + tol {
        let value = if v[1] < -tol { v[1] } else { v[2] };
        return Err(bad(
            "sum_pi_squared",
            value,
            "Σ_v π(v)² lies in [0, 1]: pass the sum of the squared probabilities",
        ));
    }
    if v.len() > 3 && v[3] < 0.0 {
        return Err(bad("is_weights", v[3], "an importance weight is never negative"));
    }
    Ok(())
}

/// The multi-index of the first true entry of `t` (which holds one).
fn first_true(t: &Tensor) -> Result<Vec<i64>, LossError> {
    let idx = t.f_nonzero()?.f_select(0, 0)?;
    Ok(crate::checks::read_vec(&idx)?.into_iter().map(|v| v as i64).collect())
}

fn bad(argument: &'static str, value: f64, reason: &str) -> LossError {
    LossError::InvalidArgument { argument, value, reason: reason.into() }
}
