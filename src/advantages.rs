//! Advantages and baselines computed over groups of completions of the same prompt, and batch
//! whitening.
//!
//! Rewards come as a `[G, K]` tensor: `G` prompts (groups), `K` completions each. With
//! `m_g = (1/K) Σ_k R_{g,k}` and `s_g` the unbiased standard deviation of the group:
//!
//! ```text
//! Grpo { eps }      A = (R − m_g) / (s_g + eps)
//! DrGrpo            A = R − m_g
//! Rloo              A = R − (1/(K−1)) Σ_{j≠k} R_{g,j} = K/(K−1) (R − m_g)
//! AsymRe { shift }  A = R − (m_g + shift)
//! BatchStd { eps }  A = (R − m_g) / (s + eps)         s the unbiased std of all G·K rewards
//! opo_advantages    A = R − Σ_k L_{g,k} R_{g,k} / Σ_k L_{g,k}      (L: completion lengths)
//! maxrl_advantages  A = (R − m_g) / (m_g + eps)                   (rewards ≥ 0)
//! ```
//!
//! A group of one completion (`K = 1`) has no baseline of its own: [`SingletonGroup`] says what
//! it gets ([`group_advantages_with`]).

use crate::error::LossError;
use crate::validate;
use tch::{Kind, Tensor};

/// How a group's rewards become advantages.
///
/// Reference: GRPO, Shao et al., arXiv 2402.03300; Dr. GRPO, Liu et al., arXiv 2503.20783; RLOO,
/// Ahmadian et al., arXiv 2402.14740; AsymRE, Arnal et al., arXiv 2506.20520.
///
/// # Example
/// ```
/// use topr_loss::GroupAdvantage;
/// assert_eq!(GroupAdvantage::asymre(), GroupAdvantage::AsymRe { shift: -0.1 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum GroupAdvantage {
    /// `(R − m_g)/(s_g + eps)`, `s_g` the unbiased group standard deviation (as TRL and verl
    /// compute it); a group of one completion gets advantage 0.
    Grpo {
        /// Added to the standard deviation (commonly 1e-6 or 1e-4).
        eps: f64,
    },
    /// `R − m_g`: GRPO without the standard-deviation scaling, which biases towards easy and hard
    /// prompts.
    DrGrpo,
    /// `R − mean of the other K − 1 rewards of the group` (needs `K ≥ 2`).
    Rloo,
    /// `R − (m_g + shift)`: a shifted group baseline; a negative shift (−0.1) weighs positives more.
    AsymRe {
        /// The shift added to the group mean.
        shift: f64,
    },
    /// `(R − m_g)/(s + eps)`, `s` the unbiased standard deviation of all `G·K` rewards of the
    /// batch (group mean, batch std: TRL's `scale_rewards="batch"`, LitePPO, Liu et al.,
    /// arXiv 2508.08221). A batch of a single reward has `s = 0`, as in TRL.
    BatchStd {
        /// Added to the standard deviation (TRL: 1e-4).
        eps: f64,
    },
}

/// What a group of a single completion (`K = 1`) gets, where the group's own mean and spread
/// leave it no signal.
///
/// | method | `OwnMean` (default) | `ZeroMeanUnitStd` (verl) |
/// |---|---|---|
/// | `Grpo { eps }` | 0 | `R / (1 + eps)` |
/// | `DrGrpo`, [`opo_advantages`] | 0 | `R` |
/// | `Rloo` | [`LossError::InvalidArgument`] | `R` |
/// | `AsymRe { shift }` | `−shift` | `R − shift` |
/// | `BatchStd { eps }` | 0 | `R / (s + eps)` |
/// | [`optimal_token_baseline_advantages`](crate::optimal_token_baseline_advantages), a completion alone at its position | `G · eps / (W + eps)`, about 0 | `G`, the return |
///
/// Reference: verl 0.9.1 `compute_grpo_outcome_advantage` (and its RLOO, OPO and REINFORCE++-
/// baseline estimators), which give a group of one the mean 0 and the standard deviation 1; TRL
/// gives it its own mean (advantage 0).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{group_advantages_with, GroupAdvantage, SingletonGroup};
/// let r = Tensor::from_slice2(&[[2.0f64], [-1.0]]); // two prompts, one completion each
/// let a = group_advantages_with(&r, GroupAdvantage::DrGrpo, SingletonGroup::ZeroMeanUnitStd)?;
/// assert_eq!(Vec::<f64>::try_from(&a.flatten(0, -1))?, vec![2.0, -1.0]);
/// let a = group_advantages_with(&r, GroupAdvantage::DrGrpo, SingletonGroup::OwnMean)?;
/// assert_eq!(Vec::<f64>::try_from(&a.flatten(0, -1))?, vec![0.0, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum SingletonGroup {
    /// The completion is its own group mean (so its spread is 0): the crate's convention and
    /// TRL's; [`group_advantages`] uses it.
    #[default]
    OwnMean,
    /// The group mean is 0 and its standard deviation 1, verl's convention: the advantage is the
    /// raw reward (divided by `1 + eps` for GRPO).
    ZeroMeanUnitStd,
}

impl GroupAdvantage {
    /// GRPO with `eps = 1e-6`.
    ///
    /// ```
    /// assert_eq!(topr_loss::GroupAdvantage::grpo(), topr_loss::GroupAdvantage::Grpo { eps: 1e-6 });
    /// ```
    pub const fn grpo() -> Self {
        Self::Grpo { eps: 1e-6 }
    }

    /// AsymRE with the shift −0.1 of its paper.
    ///
    /// ```
    /// assert_eq!(topr_loss::GroupAdvantage::asymre(), topr_loss::GroupAdvantage::AsymRe { shift: -0.1 });
    /// ```
    pub const fn asymre() -> Self {
        Self::AsymRe { shift: -0.1 }
    }

    /// Group mean, batch standard deviation with TRL's `eps = 1e-4` (`scale_rewards="batch"`).
    ///
    /// ```
    /// assert_eq!(topr_loss::GroupAdvantage::batch_std(), topr_loss::GroupAdvantage::BatchStd { eps: 1e-4 });
    /// ```
    pub const fn batch_std() -> Self {
        Self::BatchStd { eps: 1e-4 }
    }
}

/// Advantages of `[G, K]` rewards, group by group (see [`GroupAdvantage`] for the formulas).
///
/// Computed in f64 for f64 rewards, else f32; the result is detached (advantages are constants
/// to the policy loss).
///
/// # Errors
/// [`LossError::WrongRank`] unless `rewards` is `[G, K]`; [`LossError::EmptyBatch`];
/// [`LossError::NonFinite`]; [`LossError::InvalidArgument`] for `Rloo` with `K < 2`, or a
/// non-finite or negative `eps`, or a non-finite `shift`, or finite rewards so large that the
/// advantages overflow the compute dtype (`argument: "rewards"`, the largest |reward| as the value).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{group_advantages, GroupAdvantage};
///
/// let r = Tensor::from_slice2(&[[1.0f64, 0.0, 0.0, 0.0]]);
/// let a = group_advantages(&r, GroupAdvantage::Rloo)?;
/// assert_eq!(Vec::<f64>::try_from(&a.flatten(0, -1))?, vec![1.0, -1.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0]);
/// let a = group_advantages(&r, GroupAdvantage::DrGrpo)?;
/// assert_eq!(Vec::<f64>::try_from(&a.flatten(0, -1))?, vec![0.75, -0.25, -0.25, -0.25]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn group_advantages(rewards: &Tensor, method: GroupAdvantage) -> Result<Tensor, LossError> {
    group_advantages_with(rewards, method, SingletonGroup::OwnMean)
}

/// [`group_advantages`] with a choice of what a group of one completion gets (see
/// [`SingletonGroup`]); with [`SingletonGroup::OwnMean`] it is [`group_advantages`].
///
/// ```text
/// K ≥ 2, or OwnMean:        as GroupAdvantage (m_g, s_g the group's mean and unbiased std)
/// K = 1, ZeroMeanUnitStd:   m_g = 0, s_g = 1 (verl): Grpo R/(1 + eps), DrGrpo R, Rloo R,
///                           AsymRe R − shift, BatchStd R/(s + eps)
/// ```
///
/// Reference: verl 0.9.1 `compute_grpo_outcome_advantage` (`norm_adv_by_std_in_grpo`),
/// `compute_rloo_outcome_advantage`; TRL 1.16.0 `scale_rewards` (`"group"`, `"batch"`, `"none"`).
///
/// # Errors
/// As [`group_advantages`] (`Rloo` with `K < 2` only under [`SingletonGroup::OwnMean`]).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{group_advantages_with, GroupAdvantage, SingletonGroup};
///
/// let r = Tensor::from_slice2(&[[1.0f64]]);
/// let a = group_advantages_with(&r, GroupAdvantage::Grpo { eps: 0.25 }, SingletonGroup::ZeroMeanUnitStd)?;
/// assert_eq!(a.double_value(&[0, 0]), 0.8); // 1 / (1 + 0.25)
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn group_advantages_with(
    rewards: &Tensor,
    method: GroupAdvantage,
    singleton: SingletonGroup,
) -> Result<Tensor, LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(rewards, "rewards")?]);
    let shape = validate::rank(rewards, "rewards", 2, "[G, K]: G prompts, K completions each")?;
    validate::non_empty(&shape, "rewards", "completion")?;
    validate::finite(rewards, "rewards", None)?;
    let k = shape[1] as f64;
    let r = rewards.f_detach()?.f_to_kind(kind)?;
    let zero_mean = shape[1] == 1 && singleton == SingletonGroup::ZeroMeanUnitStd;
    let mean = if zero_mean { r.f_zeros_like()? } else { r.f_mean_dim(1, true, None::<Kind>)? }; // [G, 1]
    let centred = r.f_sub(&mean)?;
    // The spread a method divides by (none for the others), checked with the result below.
    let mut spread: Option<Tensor> = None;
    let out = match method {
        GroupAdvantage::Grpo { eps } => {
            check_eps(eps)?;
            if zero_mean {
                return Ok(centred.f_div_scalar(1.0 + eps)?);
            }
            // Unbiased std; a group of one has no spread, so its advantages are 0.
            let var = centred.f_square()?.f_sum_dim_intlist(1, true, None::<Kind>)?.f_div_scalar((k - 1.0).max(1.0))?;
            let out = centred.f_div(&var.f_sqrt()?.f_add_scalar(eps)?.f_clamp_min(f64::MIN_POSITIVE)?)?;
            spread = Some(var);
            out
        }
        GroupAdvantage::DrGrpo => centred,
        GroupAdvantage::Rloo => {
            if zero_mean {
                return Ok(centred);
            }
            if shape[1] < 2 {
                return Err(bad("rewards", k, "leave-one-out needs at least 2 completions per group"));
            }
            centred.f_mul_scalar(k / (k - 1.0))?
        }
        GroupAdvantage::AsymRe { shift } => {
            if !shift.is_finite() {
                return Err(bad("shift", shift, "must be finite"));
            }
            centred.f_sub_scalar(shift)?
        }
        GroupAdvantage::BatchStd { eps } => {
            check_eps(eps)?;
            // Unbiased std of the raw rewards of the whole batch; 0 for a single reward (TRL).
            let n = r.numel() as f64;
            let var =
                r.f_sub(&r.f_mean(None::<Kind>)?)?.f_square()?.f_sum(None::<Kind>)?.f_div_scalar((n - 1.0).max(1.0))?;
            let out = centred.f_div(&var.f_sqrt()?.f_add_scalar(eps)?.f_clamp_min(f64::MIN_POSITIVE)?)?;
            spread = Some(var);
            out
        }
    };
    refuse_overflow(&r, &out, spread.as_ref())?;
    Ok(out)
}

/// GDPO's advantages for several reward dimensions: each dimension normalised within its groups
/// on its own, the results summed with `weights`, then whitened over every real token of the
/// batch.
///
/// ```text
/// A_{g,k,d} = group_advantages(R_{·,·,d}, method)            (each dimension alone)
/// S_{g,k}   = Σ_d w_d A_{g,k,d}
/// Â_{i,t}   = whiten(S_i broadcast over the tokens of completion i, mask, 1e-8)   (i = g·K + k)
/// ```
///
/// Summing the rewards first (GRPO on `Σ_d R_d`) lets a dimension of large spread drown the
/// others; normalising each dimension first gives each the same scale inside a group. The
/// whitening is over tokens, so a completion counts as many times as it has tokens (verl's
/// `masked_whiten` over the response mask).
///
/// Reference: GDPO, *Group reward-Decoupled Normalization Policy Optimization*, arXiv 2601.05242
/// (as verl cites it); verl 0.9.1 `compute_gdpo_outcome_advantage` (`adv_estimator=gdpo`,
/// `gdpo_reward_keys`, `gdpo_reward_weights`), tested against it.
///
/// # Arguments
/// * `rewards` — `[G, K, D]`, floating: `D` reward dimensions of `K` completions of `G` prompts.
/// * `weights` — `D` finite weights (verl: 1 each by default).
/// * `mask` — `[G·K, T]`, the completions' token masks (row `g·K + k`), at least 2 real tokens.
/// * `method`, `singleton` — the per-dimension normalisation (verl: [`GroupAdvantage::grpo`], or
///   [`GroupAdvantage::DrGrpo`] without `norm_adv_by_std_in_grpo`; [`SingletonGroup::ZeroMeanUnitStd`]).
///
/// # Errors
/// As [`group_advantages_with`]; [`LossError::InvalidArgument`] naming `weights` for a count
/// other than `D` or a non-finite weight; the tensor checks for `mask`, and
/// [`LossError::EmptyBatch`] naming it when it has fewer than two real tokens (the whitening
/// needs a variance); [`LossError::NonFiniteLoss`] when the weighted sums overflow the dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{gdpo_advantages, GroupAdvantage, SingletonGroup};
///
/// // One prompt, three completions, two reward dimensions (say, correctness and a style score).
/// let r = Tensor::from_slice(&[1.0f64, 0.0, 0.0, 3.0, 1.0, 6.0]).view([1, 3, 2]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, false], [true, true]]);
/// let (grpo, keep) = (GroupAdvantage::grpo(), SingletonGroup::ZeroMeanUnitStd);
/// let a = gdpo_advantages(&r, &[1.0, 1.0], &mask, grpo, keep)?;
/// // A dimension's scale does not matter: the style score ×100 gives the same advantages.
/// let scaled = &r * Tensor::from_slice(&[1.0f64, 100.0]);
/// let b = gdpo_advantages(&scaled, &[1.0, 1.0], &mask, grpo, keep)?;
/// let (a, b) = (Vec::<f64>::try_from(&a.flatten(0, -1))?, Vec::<f64>::try_from(&b.flatten(0, -1))?);
/// assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5));
/// assert_eq!(a[3], 0.0); // padding
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn gdpo_advantages(
    rewards: &Tensor,
    weights: &[f64],
    mask: &Tensor,
    method: GroupAdvantage,
    singleton: SingletonGroup,
) -> Result<Tensor, LossError> {
    validate::float_tensor(rewards, "rewards")?;
    let shape = validate::rank(rewards, "rewards", 3, "[G, K, D]: G prompts, K completions, D reward dimensions")?;
    validate::non_empty(&shape, "rewards", "reward")?;
    let (g, k, d) = (shape[0], shape[1], shape[2]);
    if weights.len() as i64 != d {
        return Err(bad("weights", weights.len() as f64, &format!("one weight per reward dimension ({d}) is needed")));
    }
    if let Some(w) = weights.iter().find(|w| !w.is_finite()) {
        return Err(bad("weights", *w, "a weight must be finite"));
    }
    validate::dense_tensor(mask, "mask")?;
    validate::rank(mask, "mask", 2, "[G·K, T]: each completion's token mask")?;
    validate::same_device(mask, "mask", rewards.device(), "rewards")?;
    if mask.size()[0] != g * k {
        return Err(LossError::ShapeMismatch {
            argument: "mask",
            found: mask.size(),
            expected: vec![g * k, mask.size()[1]],
            reason: "one row per completion, G·K rows",
        });
    }
    let mut sum: Option<Tensor> = None;
    for (i, w) in weights.iter().enumerate() {
        let a = group_advantages_with(&rewards.f_select(2, i as i64)?, method, singleton)?.f_mul_scalar(*w)?;
        sum = Some(match sum {
            Some(s) => s.f_add(&a)?,
            None => a,
        });
    }
    let sum = sum.ok_or_else(|| bad("weights", 0.0, "at least one reward dimension is needed"))?;
    let per_token = sum.f_reshape([g * k, 1])?.f_expand([g * k, mask.size()[1]], false)?;
    // The whitening's own errors name its arguments: too few real tokens is the mask's fault, and
    // a non-finite value the weighted sums' (finite rewards and weights too large for the dtype).
    whiten(&per_token, Some(mask), 1e-8).map_err(|e| rename(e, "values", "mask", per_token.kind()))
}

/// Pass@k advantages: in each group only the best completion gets an advantage, the margin of
/// its reward over the second best; every other completion gets 0.
///
/// ```text
/// k* = argmax_k R_{g,k}
/// A_{g,k*} = (R_(1) − R_(2)) / (std_g(R) + ε)      (/ (std + ε) only with `normalize`)
/// A_{g,k}  = 0 for k ≠ k*
/// ```
///
/// `R_(1) ≥ R_(2)` are the group's two largest rewards and `std_g` its unbiased standard
/// deviation. With a tie for the best there is no margin and every advantage of the group is 0
/// (which completion is "best" then does not matter). A REINFORCE-style objective on these
/// advantages raises the probability that the best of the group's samples is solved, the pass@k
/// of the group, rather than each sample's pass@1.
///
/// Reference: verl 0.9.1 `compute_grpo_passk_outcome_advantage` (`algorithm.adv_estimator=grpo_passk`,
/// `norm_adv_by_std_in_grpo` for `normalize`, ε = 1e-6 by default; it cites arXiv 2503.19595);
/// tested against it.
///
/// # Arguments
/// * `rewards` — `[G, K]`, floating, `K ≥ 2`.
/// * `normalize` — divide the margin by the group's standard deviation plus `eps`.
/// * `eps` — finite, `≥ 0`.
///
/// # Errors
/// The tensor checks of [`group_advantages`]; [`LossError::InvalidArgument`] naming `rewards`
/// for groups of fewer than 2 completions (verl raises too), or `eps`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::passk_advantages;
///
/// let r = Tensor::from_slice2(&[[0.0f64, 1.0, 0.5, 1.0], [0.2, 0.9, 0.1, 0.0]]);
/// let a = passk_advantages(&r, false, 1e-6)?;
/// // A tie for the best in the first group: no margin. In the second, 0.9 − 0.2 for the best.
/// let a = Vec::<f64>::try_from(&a.flatten(0, -1))?;
/// assert_eq!(&a[..4], &[0.0; 4]);
/// assert!((a[5] - 0.7).abs() < 1e-12 && a[4] == 0.0 && a[6] == 0.0 && a[7] == 0.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn passk_advantages(rewards: &Tensor, normalize: bool, eps: f64) -> Result<Tensor, LossError> {
    check_eps(eps)?;
    let kind = validate::compute_kind(&[validate::float_tensor(rewards, "rewards")?]);
    let shape = validate::rank(rewards, "rewards", 2, "[G, K]: G prompts, K completions each")?;
    validate::non_empty(&shape, "rewards", "completion")?;
    if shape[1] < 2 {
        return Err(bad("rewards", shape[1] as f64, "pass@k advantages need at least 2 completions per group"));
    }
    validate::finite(rewards, "rewards", None)?;
    let r = rewards.f_detach()?.f_to_kind(kind)?;
    let (top, at) = r.f_topk(2, 1, true, true)?; // [G, 2] each
    let mut margin = top.f_select(1, 0)?.f_sub(&top.f_select(1, 1)?)?; // [G]
    let mut spread = None;
    if normalize {
        let std = r.f_std_dim(&[1i64][..], true, false)?;
        margin = margin.f_div(&std.f_add_scalar(eps)?)?;
        spread = Some(std);
    }
    let out = r.f_zeros_like()?.f_scatter(1, &at.f_narrow(1, 0, 1)?, &margin.f_unsqueeze(1)?)?;
    refuse_overflow(rewards, &out, spread.as_ref())?;
    Ok(out)
}

/// MaxRL's advantages: each reward's gap to its group's mean, relative to that mean.
///
/// ```text
/// r̄_g = (1/K) Σ_k R_{g,k}
/// A_{g,k} = (R_{g,k} − r̄_g) / (r̄_g + eps)          0 for a group whose mean is 0, and for K = 1
/// ```
///
/// With binary rewards and `k` successes among `K` samples (`eps = 0`) a success gets
/// `(K − k)/k` and a failure `−1`. Dividing by the pass rate estimates the gradient of its log,
/// `∇ log p = ∇p / p` (the likelihood of success, maximised, rather than its expectation), so a
/// prompt the policy rarely solves weighs `1/p` times more. A group that is all failures or all
/// successes gets 0. The advantages of a group sum to 0, and without `eps` they do not change
/// when every reward is multiplied by the same positive factor.
///
/// The crate's conventions:
/// - **Rewards must be `≥ 0`** (refused otherwise): with negative rewards the mean can be 0 or
///   negative and the denominator changes sign. Map ±1 rewards to `{0, 1}` with `(R + 1)/2`.
///   Rewards above 1 are accepted (without `eps` only their ratios matter).
/// - **A group of one gets 0**, as it does under the crate's default elsewhere
///   ([`SingletonGroup::OwnMean`]) and in TRL.
/// - A group whose mean is 0 (every reward 0) gets 0 also with `eps = 0`.
///
/// Reference: Tajwar, Zeng et al., *Maximum Likelihood Reinforcement Learning*, arXiv 2602.02710.
/// No peer is called by the tests (MaxRL is not in verl 0.9.1, the crate's installed peer); the
/// two peer implementations, restated:
/// - SkyRL `compute_maxrl_advantage` (`trainer.algorithm.advantage_estimator=maxrl`, `epsilon`
///   1e-6): `(R − r̄)/(r̄ + ε)`, the crate's formula; a group of one gets its raw reward `R`, and
///   negative rewards are not guarded.
/// - TRL `MaxRLTrainer`: `(R − r̄)/(|r̄| + 1e-6)` with `ε` fixed; a group of one gets 0. For
///   rewards `≥ 0` it is the crate's formula with `eps = 1e-6`.
///
/// The original implementation (a verl fork) divides a group of one by `0 + 1e-6` (`R/1e-6`).
///
/// # Arguments
/// * `rewards` — `[G, K]`, floating, `≥ 0` (commonly 0/1 correctness).
/// * `eps` — finite, `≥ 0`, added to the group mean (SkyRL and TRL: 1e-6).
///
/// # Errors
/// The tensor checks of [`group_advantages`]; [`LossError::InvalidArgument`] naming `rewards`
/// for a negative reward (its value) or advantages that overflow the compute dtype (a tiny
/// positive mean with `eps = 0`), or naming `eps`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::maxrl_advantages;
///
/// // One success in four, then three in four, then none.
/// let r = Tensor::from_slice2(&[[1.0f64, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0; 4]]);
/// let a = Vec::<f64>::try_from(&maxrl_advantages(&r, 0.0)?.flatten(0, -1))?;
/// assert_eq!(&a[..4], &[3.0, -1.0, -1.0, -1.0]); // (K − k)/k for the success
/// assert!((a[4] - 1.0 / 3.0).abs() < 1e-15 && a[6] == -1.0);
/// assert_eq!(&a[8..], &[0.0; 4]);
/// assert!(maxrl_advantages(&Tensor::from_slice2(&[[1.0f64, -1.0]]), 1e-6).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn maxrl_advantages(rewards: &Tensor, eps: f64) -> Result<Tensor, LossError> {
    check_eps(eps)?;
    let kind = validate::compute_kind(&[validate::float_tensor(rewards, "rewards")?]);
    let shape = validate::rank(rewards, "rewards", 2, "[G, K]: G prompts, K completions each")?;
    validate::non_empty(&shape, "rewards", "completion")?;
    validate::finite(rewards, "rewards", None)?;
    let r = rewards.f_detach()?.f_to_kind(kind)?;
    let lowest = crate::checks::read_f64(&r.f_min()?.f_to_kind(Kind::Double)?)?;
    if lowest < 0.0 {
        return Err(bad(
            "rewards",
            lowest,
            "MaxRL divides by the group's mean reward, which needs rewards >= 0 (map ±1 rewards to {0, 1})",
        ));
    }
    if shape[1] == 1 {
        return Ok(r.f_zeros_like()?);
    }
    let mean = r.f_mean_dim(1, true, None::<Kind>)?; // [G, 1]
    let den = mean.f_add_scalar(eps)?;
    let positive = den.f_gt(0.0)?;
    let out = r.f_sub(&mean)?.f_div(&den.f_where_scalarother(&positive, 1.0)?)?;
    let out = out.f_where_self(&positive, &out.f_zeros_like()?)?;
    refuse_overflow(rewards, &out, None)?;
    Ok(out)
}

/// Refuses advantages that overflowed the compute dtype although every reward is finite: a
/// group's mean, or the variance a method divides by, beyond its range (the division by an
/// infinite standard deviation would otherwise return all zeros). One host read.
fn refuse_overflow(rewards: &Tensor, out: &Tensor, spread: Option<&Tensor>) -> Result<(), LossError> {
    let mut ok = out.f_isfinite()?.f_all()?;
    if let Some(s) = spread {
        ok = ok.f_logical_and(&s.f_isfinite()?.f_all()?)?;
    }
    if crate::checks::read_f64(&ok.f_to_kind(Kind::Double)?)? == 1.0 {
        return Ok(());
    }
    let largest = crate::checks::read_f64(&rewards.f_abs()?.f_max()?.f_to_kind(Kind::Double)?)?;
    Err(bad(
        "rewards",
        largest,
        &format!(
            "the advantages overflow {} (a group's mean or spread is beyond its range): rescale the rewards",
            crate::error::kind_name(rewards.kind())
        ),
    ))
}

fn bad(argument: &'static str, value: f64, reason: &str) -> LossError {
    LossError::InvalidArgument { argument, value, reason: reason.into() }
}

fn check_eps(eps: f64) -> Result<(), LossError> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(bad("eps", eps, "must be finite and >= 0"));
    }
    Ok(())
}

/// OPO's optimal baseline: each group's rewards weighted by the completions' lengths.
///
/// ```text
/// b_g = Σ_k L_{g,k} R_{g,k} / Σ_k L_{g,k}        A_{g,k} = R_{g,k} − b_g
/// ```
///
/// The baseline that minimises the variance of the sequence-level policy gradient when its
/// squared norm grows with the length (Hao et al., *On-Policy RL with Optimal Reward Baseline*,
/// 2025, arXiv 2505.23585). A group of one gets `0` ([`SingletonGroup::OwnMean`]) or `R`
/// ([`SingletonGroup::ZeroMeanUnitStd`], verl).
///
/// Reference: verl 0.9.1 `compute_opo_outcome_advantage` (`algorithm.adv_estimator=opo`), whose
/// lengths are the response masks' sums.
///
/// # Arguments
/// * `rewards` — `[G, K]`, floating.
/// * `lengths` — `[G, K]`, the completions' token counts `L` (integer or floating, `≥ 0`).
/// * `singleton` — what a group of one gets.
///
/// # Errors
/// As [`group_advantages`]; [`LossError::WrongDtype`], [`LossError::ShapeMismatch`] or
/// [`LossError::DeviceMismatch`] for `lengths`; [`LossError::InvalidArgument`] naming `lengths`
/// for a negative or non-finite length, or a group (of two or more) whose lengths sum to 0.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{opo_advantages, SingletonGroup};
///
/// let r = Tensor::from_slice2(&[[1.0f64, 0.0]]);
/// let len = Tensor::from_slice2(&[[3i64, 1]]); // b = (3·1 + 1·0) / 4
/// let a = opo_advantages(&r, &len, SingletonGroup::OwnMean)?;
/// assert_eq!(Vec::<f64>::try_from(&a.flatten(0, -1))?, vec![0.25, -0.75]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn opo_advantages(rewards: &Tensor, lengths: &Tensor, singleton: SingletonGroup) -> Result<Tensor, LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(rewards, "rewards")?]);
    let shape = validate::rank(rewards, "rewards", 2, "[G, K]: G prompts, K completions each")?;
    validate::non_empty(&shape, "rewards", "completion")?;
    validate::real_tensor(lengths, "lengths")?;
    validate::same_shape(lengths, "lengths", &shape, "the shape of `rewards`")?;
    validate::same_device(lengths, "lengths", rewards.device(), "rewards")?;
    validate::finite(rewards, "rewards", None)?;
    let r = rewards.f_detach()?.f_to_kind(kind)?;
    let len = lengths.f_detach()?.f_to_kind(kind)?;
    validate::finite(&len, "lengths", None)?;
    let negative = crate::checks::read_i64(&len.f_lt(0.0)?.f_sum(Kind::Int64)?, &[])?;
    if negative > 0 {
        return Err(bad("lengths", f64::NAN, "a length must be >= 0"));
    }
    if shape[1] == 1 {
        return Ok(match singleton {
            SingletonGroup::ZeroMeanUnitStd => r,
            _ => r.f_zeros_like()?,
        });
    }
    let total = len.f_sum_dim_intlist(1, true, None::<Kind>)?; // [G, 1]
    let empty = crate::checks::read_i64(&total.f_le(0.0)?.f_sum(Kind::Int64)?, &[])?;
    if empty > 0 {
        return Err(bad("lengths", 0.0, "the lengths of a group sum to 0: its length-weighted baseline is undefined"));
    }
    let baseline = len.f_mul(&r)?.f_sum_dim_intlist(1, true, None::<Kind>)?.f_div(&total)?;
    Ok(r.f_sub(&baseline)?)
}

/// Whitens values over a batch: `(x − mean) / sqrt(var + eps)`, mean and unbiased variance taken
/// over the unmasked entries (all entries without a mask). Masked entries come back as 0.
///
/// ```text
/// μ = Σ m x / Σ m      σ² = Σ m (x − μ)² / (Σ m − 1)      x̂ = m (x − μ) / sqrt(σ² + eps)
/// ```
///
/// Reference: the advantage whitening of PPO implementations (verl `masked_whiten`,
/// OpenAI baselines).
///
/// # Arguments
/// * `values` — any shape, floating.
/// * `mask` — `None`, or the shape of `values` (bool, integer or 0/1 floating).
/// * `eps` — `≥ 0`, added to the variance (commonly 1e-8).
///
/// # Errors
/// The tensor checks of [`LossError`]; [`LossError::EmptyBatch`] with fewer than 2 unmasked
/// entries; [`LossError::InvalidArgument`] for a negative or non-finite `eps`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::whiten;
/// let w = whiten(&Tensor::from_slice(&[1.0f64, 2.0, 3.0]), None, 0.0)?;
/// assert_eq!(Vec::<f64>::try_from(&w)?, vec![-1.0, 0.0, 1.0]);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn whiten(values: &Tensor, mask: Option<&Tensor>, eps: f64) -> Result<Tensor, LossError> {
    let kind = validate::compute_kind(&[validate::float_tensor(values, "values")?]);
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(LossError::InvalidArgument {
            argument: "eps",
            value: eps,
            reason: "must be finite and >= 0".into(),
        });
    }
    let shape = values.size();
    let m = match mask {
        Some(mask) => {
            let m = validate::bool_mask(mask, "mask")?;
            validate::same_shape(&m, "mask", &shape, "the shape of `values`")?;
            validate::same_device(&m, "mask", values.device(), "values")?;
            m
        }
        None => values.f_ones_like()?.f_to_kind(Kind::Bool)?,
    };
    validate::finite(values, "values", Some(&m))?;
    let count = crate::checks::read_i64(&m.f_sum(Kind::Int64)?, &[])?;
    if count < 2 {
        return Err(LossError::EmptyBatch {
            argument: "values",
            found: shape,
            unit: "pair of unmasked values (a variance needs two)",
        });
    }
    let x = crate::aggregate::masked_fill_zero(&values.f_detach()?.f_to_kind(kind)?, &m)?;
    let mf = m.f_to_kind(kind)?;
    let mean = x.f_sum(None::<Kind>)?.f_div_scalar(count as f64)?;
    let centred = x.f_sub(&mean)?.f_mul(&mf)?;
    let var = centred.f_square()?.f_sum(None::<Kind>)?.f_div_scalar((count - 1) as f64)?;
    let scale = var.f_add_scalar(eps)?.f_sqrt()?.f_clamp_min(f64::MIN_POSITIVE)?;
    Ok(centred.f_div(&scale)?)
}

/// Renames the argument of an error from [`whiten`] to the caller's; a non-finite value there can
/// only come from the caller's sums (returns, weighted advantages) that overflowed the compute
/// dtype.
pub(crate) fn rename(e: LossError, from: &'static str, to: &'static str, kind: Kind) -> LossError {
    match e {
        LossError::EmptyBatch { argument, found, unit } if argument == from => {
            LossError::EmptyBatch { argument: to, found, unit }
        }
        LossError::NonFinite { argument, .. } if argument == from => {
            LossError::NonFiniteLoss { compute_dtype: crate::error::kind_name(kind) }
        }
        other => other,
    }
}
