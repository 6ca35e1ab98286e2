//! LENS, *Likelihood Estimation with Negative Samples*: binary rewards recalibrated by the
//! sampler's confidence, so that a group with no correct completion still teaches something, and
//! a confident mistake is penalised more than an unsure one.
//!
//! With `K` completions per group (the paper's `G`), `r ∈ {0, 1}` their correctness and
//! `π̄ = exp(mean_t log π_old)` each completion's length-normalised probability under the sampler:
//!
//! ```text
//! D_imp = ((1/K) Σ_k r_k / π_old(o_k))^{-1}            π_old(o) = exp(Σ_t log π_old), not normalised
//! D     = max(D_imp, 2 max_k π̄_k)   if the group has a correct completion
//!       = 2 max_k π̄_k               if it has none
//! r̃_k   = r_k − (1 − r_k) (1/K) π̄_k / (D − π̄_k)
//! ```
//!
//! A correct completion keeps `r̃ = 1`; an incorrect one gets `r̃ ∈ [−1/K, 0)`, the more negative
//! the more probable it was. The paper derives this from a maximum-likelihood view of the reward
//! model (its Theorem 1): the policy gradient of the calibrated reward is the gradient of a
//! likelihood in which `π_θ(o|q)/D(q)` is the probability that `o` is correct.
//!
//! LENS cites TOPR, and composes with it: TOPR with 0/1 rewards (baseline 0) learns nothing from a
//! failure (`R = 0`); with the calibrated rewards a failure gets `r̃ < 0` on TOPR's truncated
//! importance-sampling branch, weighted by the sampler's confidence, and a success keeps TOPR's
//! supervised branch with weight 1 (see [`lens_rewards`]'s example).

use crate::aggregate::masked_fill_zero;
use crate::error::LossError;
use crate::validate::{self, FiniteCheck, LogProbCheck};
use tch::{Kind, Tensor};

/// The weight of the all-negative groups and GRPO's `eps` in [`lens_advantages`].
///
/// `Default` is [`LensConfig::lens`].
///
/// Reference: Feng, Jain, Hartshorn, Duan, Kempe, *Don't Waste Mistakes: Leveraging Negative
/// RL-Groups via Confidence Reweighting*, arXiv 2510.08696, §5.1 (`α = 0.25`).
///
/// # Example
/// ```
/// use topr_loss::LensConfig;
/// let c = LensConfig::lens();
/// assert_eq!((c.negative_weight, c.eps), (0.25, 1e-6));
/// assert!(c.with_negative_weight(-1.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct LensConfig {
    /// `α ≥ 0`, finite: the advantages of a group with no correct completion are multiplied by it
    /// (the paper: 0.25).
    pub negative_weight: f64,
    /// Added to the standard deviation of a mixed group (GRPO's `eps`; finite, `≥ 0`).
    pub eps: f64,
}

impl Default for LensConfig {
    fn default() -> Self {
        Self::lens()
    }
}

impl LensConfig {
    /// The paper's `α = 0.25`, with GRPO's `eps = 1e-6` (verl's and this crate's
    /// [`crate::GroupAdvantage::grpo`]).
    ///
    /// ```
    /// assert_eq!(topr_loss::LensConfig::lens(), topr_loss::LensConfig::default());
    /// ```
    pub const fn lens() -> Self {
        Self { negative_weight: 0.25, eps: 1e-6 }
    }

    /// The same config with another weight `α` for the all-negative groups.
    ///
    /// ```
    /// assert_eq!(topr_loss::LensConfig::lens().with_negative_weight(1.0).negative_weight, 1.0);
    /// ```
    pub const fn with_negative_weight(self, negative_weight: f64) -> Self {
        Self { negative_weight, ..self }
    }

    /// The same config with another `eps`.
    ///
    /// ```
    /// assert_eq!(topr_loss::LensConfig::lens().with_eps(0.0).eps, 0.0);
    /// ```
    pub const fn with_eps(self, eps: f64) -> Self {
        Self { eps, ..self }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming `negative_weight` or `eps` when not finite and `≥ 0`.
    ///
    /// ```
    /// assert!(topr_loss::LensConfig::lens().with_eps(f64::NAN).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        for (v, field) in [(self.negative_weight, "negative_weight"), (self.eps, "eps")] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(LossError::InvalidConfig {
                    field,
                    value: v,
                    reason: "must be finite and >= 0 (LENS: negative_weight 0.25)".into(),
                });
            }
        }
        Ok(())
    }
}

/// The calibrated rewards `[G, K]` and, per group, the number of correct completions `[G, 1]`.
fn calibrate(rewards: &Tensor, logp_old: &Tensor, mask: &Tensor) -> Result<(Tensor, Tensor), LossError> {
    let kind = validate::compute_kind(&[
        validate::float_tensor(rewards, "rewards")?,
        validate::float_tensor(logp_old, "logp_old")?,
    ]);
    let shape = validate::rank(rewards, "rewards", 2, "[G, K]: G prompts, K completions each")?;
    validate::non_empty(&shape, "rewards", "completion")?;
    let (g, k) = (shape[0], shape[1]);
    let tokens = validate::rank(logp_old, "logp_old", 2, "[G·K, T]: each completion's per-token log-probabilities")?;
    if tokens[0] != g * k {
        return Err(LossError::ShapeMismatch {
            argument: "logp_old",
            found: tokens,
            expected: vec![g * k, logp_old.size()[1]],
            reason: "one row per completion, G·K rows (completion k of group g in row g·K + k)",
        });
    }
    validate::non_empty(&tokens, "logp_old", "token position")?;
    let m = validate::bool_mask(mask, "mask")?;
    validate::same_shape(&m, "mask", &tokens, "the shape of `logp_old`")?;
    let device = rewards.device();
    validate::same_device(logp_old, "logp_old", device, "rewards")?;
    validate::same_device(&m, "mask", device, "rewards")?;
    validate::finite(rewards, "rewards", None)?;
    let r = rewards.f_detach()?.f_to_kind(kind)?;
    let binary = r.f_eq(0.0)?.f_logical_or(&r.f_eq(1.0)?)?;
    let others = crate::checks::read_i64(&binary.f_logical_not()?.f_sum(Kind::Int64)?, &[])?;
    if others > 0 {
        let first = r.f_masked_select(&binary.f_logical_not()?)?.f_select(0, 0)?.f_to_kind(Kind::Double)?;
        return Err(LossError::InvalidArgument {
            argument: "rewards",
            value: crate::checks::read_f64(&first)?,
            reason: format!("LENS takes binary correctness rewards, 0 or 1 ({others} value(s) are neither)"),
        });
    }
    let lp = masked_fill_zero(&logp_old.f_detach()?.f_to_kind(kind)?, &m)?;
    // One read: the sum proves the real log-probs finite, the maximum that they are at most 0.
    validate::all_finite_sums_and_log_probs(
        &[FiniteCheck { clean: &lp, original: logp_old, argument: "logp_old", valid: Some(&m), also: None }],
        &[LogProbCheck { t: logp_old, argument: "logp_old", valid: Some(&m) }],
    )?;

    let total = lp.f_sum_dim_intlist(1, false, None::<Kind>)?; // log π_old(o), [G·K]
    let lengths = m.f_to_kind(kind)?.f_sum_dim_intlist(1, false, None::<Kind>)?;
    // A completion without a token counts as log π̄ = 0 (the mean over no token taken as 0).
    let log_pbar = total.f_div(&lengths.f_clamp_min(1.0)?)?.f_reshape([g, k])?;
    let seq = total.f_reshape([g, k])?;
    let correct = r.f_eq(1.0)?;
    let n_correct = correct.f_to_kind(kind)?.f_sum_dim_intlist(1, true, None::<Kind>)?; // [G, 1]
    // With L = max_k ln π̄_k, write D = 2 e^L e^x: x = max(ln D_imp − ln 2 − L, 0) where the group
    // has a correct completion, 0 where it has none (the guard 2 max π̄ alone). Then
    // π̄_k / (D − π̄_k) = z / (2 − z), z = exp(−(L − ln π̄_k) − x) ∈ (0, 1]: every `exp` sees a
    // non-positive argument, and the most confident completion of a negative group gets z = 1,
    // the weight 1 exactly (r̃ = −1/K).
    let top = log_pbar.f_amax(1, true)?; // L, [G, 1]
    // ln D_imp = ln K − ln Σ_{correct} exp(−log π_old(o)), a log-sum-exp: 1/π_old overflows as
    // soon as a correct completion is long, its logarithm does not.
    let inverse = seq.f_neg()?.f_masked_fill(&correct.f_logical_not()?, f64::NEG_INFINITY)?;
    let log_d_imp = inverse.f_logsumexp(1, true)?.f_neg()?.f_add_scalar((k as f64).ln())?;
    let excess = log_d_imp.f_sub(&top)?.f_sub_scalar(std::f64::consts::LN_2)?.f_clamp_min(0.0)?;
    let excess = excess.f_where_self(&n_correct.f_gt(0.0)?, &excess.f_zeros_like()?)?;
    let z = top.f_sub(&log_pbar)?.f_add(&excess)?.f_neg()?.f_exp()?;
    let weight = z.f_div(&z.f_neg()?.f_add_scalar(2.0)?)?;
    let penalty = r.f_neg()?.f_add_scalar(1.0)?.f_mul(&weight)?.f_div_scalar(k as f64)?;
    Ok((r.f_sub(&penalty)?, n_correct))
}

/// LENS's calibrated rewards: each incorrect completion penalised by the sampler's confidence in
/// it (arXiv 2510.08696, §5.1).
///
/// ```text
/// π̄_k   = exp((1/L_k) Σ_t m log π_old,k,t)              length-normalised probability
/// D_imp = K / Σ_{k: r_k = 1} exp(−Σ_t m log π_old,k,t)  (Eq. 14, in log space)
/// D     = max(D_imp, 2 max_k π̄_k)  with a correct completion,  2 max_k π̄_k  without
/// r̃_k   = r_k − (1 − r_k) (1/K) π̄_k / (D − π̄_k)
/// ```
///
/// Properties (tested): `r̃ = 1` for a correct completion; `r̃ ∈ [−1/K, 0)` for an incorrect one,
/// decreasing with `π̄`, so `r̃ ∈ [−1, 1]`; in a group without a correct completion the most
/// probable one gets exactly `−1/K` (`D = 2 π̄_max`); `D ≥ 2 π̄` keeps `D − π̄ > 0`. The `1/K` keeps
/// a group's signs: after GRPO's centring the correct completions stay positive and the
/// incorrect ones negative ([`lens_advantages`]).
///
/// Computed in log space throughout: `D_imp` as a log-sum-exp of the sequence log-probs (which the
/// paper does not length-normalise, so `1/π_old` overflows for long completions), and
/// `π̄/(D − π̄)` as `z/(2 − z)` with `z = 2π̄/D = exp(ln π̄ − ln D + ln 2) ∈ (0, 1]`, whose exponent
/// is never positive (`z = 1` exactly for the most probable failure of a negative group). Rewards are returned detached,
/// in f64 when `rewards` or `logp_old` is f64, else f32. A completion without a real token counts
/// as `π̄ = 1`.
///
/// With TOPR: pass `r̃` flattened as TOPR's rewards with baseline 0 ([`crate::ToprConfig::canonical`]):
/// successes keep the supervised branch with weight 1, failures get TOPR's truncated
/// importance-sampling branch with the weight `r̃ < 0` instead of a reward of 0 that teaches
/// nothing. As the paper uses it, with GRPO: [`lens_advantages`].
///
/// Reference: arXiv 2510.08696, Eq. 10 (the calibrated reward), Eq. 14 (`D_imp`) and §5.1 (the
/// practical version: `π̄`, the guard `2 max π̄`, the factor `1/G`). No peer code is published: the
/// tests check a scalar restatement of these formulas.
///
/// # Arguments
/// * `rewards` — `[G, K]`, floating, each 0 or 1 (correctness).
/// * `logp_old` — `[G·K, T]` per-token log-probs of the policy that sampled the completions
///   (completion `k` of group `g` in row `g·K + k`); padding may hold anything.
/// * `mask` — `[G·K, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::WrongRank`], [`LossError::ShapeMismatch`] (naming `logp_old` for a row count
/// other than `G·K`, or `mask`), [`LossError::EmptyBatch`], [`LossError::WrongDtype`],
/// [`LossError::DeviceMismatch`]; [`LossError::NonFinite`] and [`LossError::PositiveLogProb`] for
/// real entries of `logp_old`; [`LossError::InvalidArgument`] naming `rewards` for a reward other
/// than 0 or 1.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{lens_rewards, topr_loss, ToprConfig};
///
/// // One group of three, all wrong; the first completion is the most probable (π̄ = 0.5).
/// let r = Tensor::from_slice2(&[[0.0f64, 0.0, 0.0]]);
/// let logp_old = Tensor::from_slice2(&[[0.5f64.ln(), 0.5f64.ln()], [0.25f64.ln(), 0.0], [0.1f64.ln(), 0.1f64.ln()]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, false], [true, true]]);
/// let rt = lens_rewards(&r, &logp_old, &mask)?;
/// let v = Vec::<f64>::try_from(&rt.flatten(0, -1))?;
/// // D = 2 · 0.5: the most confident mistake gets −1/K, the others less.
/// assert!((v[0] + 1.0 / 3.0).abs() < 1e-12);
/// assert!((v[1] + 0.25 / (1.0 - 0.25) / 3.0).abs() < 1e-12);
/// assert!(v[0] < v[1] && v[1] < v[2] && v[2] < 0.0);
///
/// // As TOPR's rewards: the failures now carry a gradient, the most confident the largest.
/// let logp = Tensor::from_slice(&[-1.4f64, -1.4, -4.6]).set_requires_grad(true);
/// let logp_mu = logp.detach();
/// let loss = topr_loss(&logp, &logp_mu, &rt.flatten(0, -1), &ToprConfig::canonical())?;
/// loss.backward();
/// let g = Vec::<f64>::try_from(&logp.grad())?;
/// assert!(g[0] > g[1] && g[1] > g[2] && g[2] > 0.0); // pushed down, by −r̃ / 3
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn lens_rewards(rewards: &Tensor, logp_old: &Tensor, mask: &Tensor) -> Result<Tensor, LossError> {
    Ok(calibrate(rewards, logp_old, mask)?.0)
}

/// LENS's advantages: the calibrated rewards ([`lens_rewards`]) GRPO-normalised in the groups
/// with a correct completion, only centred (and weighted by `α`) in the groups without.
///
/// ```text
/// mixed group (0 < #correct < K):  A_k = (r̃_k − mean r̃) / (std r̃ + eps)     (unbiased std)
/// negative group (#correct = 0):   A_k = α (r̃_k − mean r̃)                    (α = 0.25)
/// positive group (#correct = K):   A_k = 0                                   (r̃ = 1 for all, as GRPO)
/// ```
///
/// The paper's objective is `J_GRPO[mixed groups] + α J_GRPO[negative groups]`; multiplying the
/// negative groups' advantages by `α` puts both terms in one loss call (the same objective when
/// one aggregation covers the whole batch; a trainer that averages each term over its own groups
/// differs by the ratio of their counts). A group of one gets 0 (centred, or all positive). Signs
/// are kept in mixed groups: correct completions get `A > 0`, incorrect ones `A < 0` (tested).
/// Plain GRPO gives negative groups 0; LENS makes them push their most confident mistakes down.
///
/// Pass the advantages (flattened to `[G·K]`) to a PPO-family loss as the paper does with GRPO,
/// e.g. [`crate::ppo_clip_loss`], or to TOPR as rewards with baseline 0.
///
/// Reference: arXiv 2510.08696, §5.1 (GRPO normalisation of mixed groups, centring only of
/// negative groups, `α = 0.25`). No peer code is published: the tests check a scalar restatement.
///
/// # Arguments
/// As [`lens_rewards`], and `cfg` ([`LensConfig`]).
///
/// # Errors
/// As [`lens_rewards`]; [`LossError::InvalidConfig`] for a bad config.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{lens_advantages, LensConfig};
///
/// // Group 0: one success among two; group 1: two failures; group 2: two successes.
/// let r = Tensor::from_slice2(&[[1.0f64, 0.0], [0.0, 0.0], [1.0, 1.0]]);
/// let logp_old = Tensor::from_slice2(&[[-1.0f64], [-2.0], [-0.5], [-3.0], [-1.0], [-1.0]]);
/// let a = lens_advantages(&r, &logp_old, &logp_old.ones_like(), &LensConfig::lens())?;
/// let a = Vec::<f64>::try_from(&a.flatten(0, -1))?;
/// assert!(a[0] > 0.0 && a[1] < 0.0); // signs kept in the mixed group
/// assert!(a[2] < 0.0 && a[3] > 0.0 && (a[2] + a[3]).abs() < 1e-12); // the confident failure pushed down
/// assert_eq!(&a[4..], &[0.0, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn lens_advantages(
    rewards: &Tensor,
    logp_old: &Tensor,
    mask: &Tensor,
    cfg: &LensConfig,
) -> Result<Tensor, LossError> {
    cfg.validate()?;
    let (rt, n_correct) = calibrate(rewards, logp_old, mask)?;
    let k = rt.size()[1];
    let centred = rt.f_sub(&rt.f_mean_dim(1, true, None::<Kind>)?)?;
    let var = centred.f_square()?.f_sum_dim_intlist(1, true, None::<Kind>)?.f_div_scalar(((k - 1) as f64).max(1.0))?;
    let grpo = centred.f_div(&var.f_sqrt()?.f_add_scalar(cfg.eps)?.f_clamp_min(f64::MIN_POSITIVE)?)?;
    let negative = centred.f_mul_scalar(cfg.negative_weight)?;
    let mixed = n_correct.f_gt(0.0)?.f_logical_and(&n_correct.f_lt(k as f64)?)?;
    let none = n_correct.f_eq(0.0)?;
    let out = grpo.f_where_self(&mixed, &negative.f_where_self(&none, &rt.f_zeros_like()?)?)?;
    Ok(out)
}
