//! Two of TOPR's successors among the off-policy trust regions: BAPO's clip bounds chosen per call
//! to balance the positive and negative contributions, and CTPO's prefix (cumulative) importance
//! ratio with its position-dependent clip.
//!
//! ```text
//! BAPO   [c_low, c_high] = the first window on the search path with P/(N + eps) ≥ target
//!        ℓ_t = max(−A r_t, −A clip(r_t, c_low, c_high)), capped at −3A where A < 0
//! CTPO   w_t = Π_{s≤t} r_s (value), gradient through token t only; log w_t ≤ 10
//!        ℓ_t = max(−A w_t, −A clip_t(w_t)), capped at −A c_t where A < 0
//! ```
//!
//! Both answer the problem TOPR starts from, negative examples dominating an off-policy update, at
//! the level of PPO's clip: BAPO widens the window for positives (and narrows it for negatives)
//! until the positives carry a set share of the loss; CTPO weighs each token by the importance
//! ratio of the whole prefix that led to it, the correct per-token weight for a sequence sampled
//! by μ, and lets the clip window grow with the position as the prefix ratio's spread does.

use crate::aggregate::{AggregationMode, Normalizer};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct, stats};
use crate::ppo::{PpoDiagnostics, ppo_diagnostics};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate;
use tch::{Device, Kind, Tensor};

/// The most steps a search may take on each bound (`(max − start) / step`), so that a tiny step
/// cannot make the search path (and the tensor of its candidates) arbitrarily long.
pub const BAPO_MAX_STEPS: f64 = 1000.0;

/// The search and the loss of [`bapo_loss`] and [`bapo_clip_bounds`].
///
/// The bounds are **ratio values**, not PPO's `ε`: the window is `[c_low, c_high]`, each bound
/// searched between its `…_start` and its `…_max` in steps of its `…_step`. The search's target
/// is the official code's: `P / (N + eps) ≥ target` with `P`, `N` the positive and negative parts
/// of `Σ_t m_t r_eff,t A_t` (see [`bapo_clip_bounds`]).
///
/// `Default` is [`BapoConfig::paper`].
///
/// Two conventions for the target, one setting:
/// - the official code's `adv_ratio_target` is the ratio `P/(N + eps)` (default 1);
/// - the paper's README gives `ρ₀ = 0.5`, a **share** `P/(P + N)`; `P/(P + N) ≥ ρ₀` is
///   `P/N ≥ ρ₀/(1 − ρ₀)`, so `ρ₀ = 0.5` is the ratio 1. [`BapoConfig::with_positive_share`] sets
///   the target from `ρ₀`.
///
/// Reference: Xi et al., *BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via
/// Balanced Policy Optimization with Adaptive Clipping*, arXiv 2510.18927; the official code,
/// WooooDyy/BAPO `recipe/bapo/policy_loss.py::compute_policy_loss_bapo` (verl loss mode `bapo`,
/// `BAPOPolicyLossConfig` in `recipe/bapo/config.py`), restated in the tests.
///
/// # Example
/// ```
/// use topr_loss::BapoConfig;
/// let c = BapoConfig::paper();
/// assert_eq!((c.lower_start, c.lower_max, c.upper_start, c.upper_max), (0.6, 0.9, 1.2, 3.0));
/// assert_eq!((c.target, c.dual_clip), (1.0, Some(3.0)));
/// assert_eq!(BapoConfig::paper().with_positive_share(0.5), c); // ρ₀ = 0.5 is the ratio 1
/// assert!(c.with_lower(0.9, 0.6, 0.05).validate().is_err()); // a maximum below the start
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct BapoConfig {
    /// `a⁻`: where the lower bound starts, in `[0, 1]` (official `ratio_lower_start`).
    pub lower_start: f64,
    /// `b⁻`: the most the lower bound is raised to, in `[lower_start, 1]` (`ratio_lower_max`).
    pub lower_max: f64,
    /// The lower bound's step, finite and `≥ 0` (0: the bound stays at its start).
    pub lower_step: f64,
    /// `a⁺`: where the upper bound starts, finite and `≥ 1` (`ratio_upper_start`).
    pub upper_start: f64,
    /// `b⁺`: the most the upper bound is raised to, finite and `≥ upper_start` (`ratio_upper_max`).
    pub upper_max: f64,
    /// The upper bound's step, finite and `≥ 0`.
    pub upper_step: f64,
    /// The balance to reach, `P/(N + eps) ≥ target`, finite and `≥ 0` (`adv_ratio_target`).
    pub target: f64,
    /// Added to `N` in the balance, finite and `≥ 0` (official: 1e-8).
    pub eps: f64,
    /// Dual clip `c > 1` for `A < 0` (official: verl's `clip_ratio_c`, 3); `None` disables it.
    pub dual_clip: Option<f64>,
    /// `δ` is clamped to `±max_log_ratio` before `exp` (finite, `> 0`; official: 20).
    pub max_log_ratio: f64,
    /// How per-token losses are reduced (official: verl's `loss_agg_mode`, token-mean).
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for BapoConfig {
    fn default() -> Self {
        Self::paper()
    }
}

impl BapoConfig {
    /// The paper's setting as its README states it: lower bound `0.6 → 0.9`, upper `1.2 → 3.0`,
    /// steps 0.05, `ρ₀ = 0.5` (the ratio 1), `eps = 1e-8`, dual clip 3, token-mean.
    ///
    /// ```
    /// assert_eq!(topr_loss::BapoConfig::paper(), topr_loss::BapoConfig::default());
    /// ```
    pub const fn paper() -> Self {
        Self {
            lower_start: 0.6,
            lower_max: 0.9,
            lower_step: 0.05,
            upper_start: 1.2,
            upper_max: 3.0,
            upper_step: 0.05,
            target: 1.0,
            eps: 1e-8,
            dual_clip: Some(3.0),
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// The official recipe's setting (`recipe/bapo/config/bapo_trainer.yaml`): lower bound
    /// `0.6 → 0.8`, upper `1.2 → 2.0`, steps 0.05, target 1.
    ///
    /// ```
    /// let c = topr_loss::BapoConfig::recipe();
    /// assert_eq!((c.lower_max, c.upper_max), (0.8, 2.0));
    /// ```
    pub const fn recipe() -> Self {
        Self::paper().with_lower(0.6, 0.8, 0.05).with_upper(1.2, 2.0, 0.05)
    }

    /// The same config with the lower bound searched from `start` to `max` in steps of `step`.
    ///
    /// ```
    /// let c = topr_loss::BapoConfig::paper().with_lower(0.8, 0.8, 0.0); // fixed at 0.8
    /// assert_eq!((c.lower_start, c.lower_max, c.lower_step), (0.8, 0.8, 0.0));
    /// ```
    pub const fn with_lower(self, start: f64, max: f64, step: f64) -> Self {
        Self { lower_start: start, lower_max: max, lower_step: step, ..self }
    }

    /// The same config with the upper bound searched from `start` to `max` in steps of `step`.
    ///
    /// ```
    /// let c = topr_loss::BapoConfig::paper().with_upper(1.28, 2.0, 0.1);
    /// assert_eq!((c.upper_start, c.upper_max, c.upper_step), (1.28, 2.0, 0.1));
    /// ```
    pub const fn with_upper(self, start: f64, max: f64, step: f64) -> Self {
        Self { upper_start: start, upper_max: max, upper_step: step, ..self }
    }

    /// The same config with the target ratio `P/(N + eps) ≥ target` (the official
    /// `adv_ratio_target`).
    ///
    /// ```
    /// assert_eq!(topr_loss::BapoConfig::paper().with_target(2.0).target, 2.0);
    /// ```
    pub const fn with_target(self, target: f64) -> Self {
        Self { target, ..self }
    }

    /// The same config with the target given as the paper's share `ρ₀ = P/(P + N)`: the ratio
    /// `ρ₀/(1 − ρ₀)` (`ρ₀ = 1` gives an infinite target, refused by [`BapoConfig::validate`]).
    ///
    /// ```
    /// assert_eq!(topr_loss::BapoConfig::paper().with_positive_share(0.75).target, 3.0);
    /// ```
    pub const fn with_positive_share(self, rho: f64) -> Self {
        Self { target: rho / (1.0 - rho), ..self }
    }

    /// The same config with another `eps` in the balance.
    ///
    /// ```
    /// assert_eq!(topr_loss::BapoConfig::paper().with_eps(0.0).eps, 0.0);
    /// ```
    pub const fn with_eps(self, eps: f64) -> Self {
        Self { eps, ..self }
    }

    /// The same config with dual clip `c` (`None`: off).
    ///
    /// ```
    /// assert_eq!(topr_loss::BapoConfig::paper().with_dual_clip(None).dual_clip, None);
    /// ```
    pub const fn with_dual_clip(self, dual_clip: Option<f64>) -> Self {
        Self { dual_clip, ..self }
    }

    crate::setters::setters!(BapoConfig, paper(); aggregation, max_log_ratio);

    /// The same config with another checks level ([`Checks::Shapes`]: no host read per call,
    /// the search included).
    ///
    /// ```
    /// use topr_loss::{BapoConfig, Checks};
    /// assert_eq!(BapoConfig::paper().with_checks(Checks::Shapes).checks, Checks::Shapes);
    /// ```
    pub const fn with_checks(self, checks: Checks) -> Self {
        Self { checks, ..self }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: `lower_start` outside `[0, 1]`, `lower_max`
    /// outside `[lower_start, 1]`, `upper_start` not finite and `≥ 1`, `upper_max` not finite and
    /// `≥ upper_start`, a step not finite and `≥ 0` or taking more than [`BAPO_MAX_STEPS`] steps,
    /// `target` or `eps` not finite and `≥ 0`, `dual_clip` not finite and `> 1`, `max_log_ratio`
    /// not finite and `> 0`.
    ///
    /// ```
    /// use topr_loss::BapoConfig;
    /// assert!(BapoConfig::paper().with_upper(0.9, 2.0, 0.05).validate().is_err()); // below 1
    /// assert!(BapoConfig::paper().with_lower(0.6, 0.9, 1e-9).validate().is_err()); // too many steps
    /// assert!(BapoConfig::paper().with_positive_share(1.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        let bad = |field: &'static str, value: f64, reason: &str| {
            Err(LossError::InvalidConfig { field, value, reason: reason.into() })
        };
        if !(0.0..=1.0).contains(&self.lower_start) {
            return bad("lower_start", self.lower_start, "the lower ratio bound starts in [0, 1]");
        }
        if !(self.lower_start..=1.0).contains(&self.lower_max) {
            return bad("lower_max", self.lower_max, "the lower ratio bound's maximum lies in [lower_start, 1]");
        }
        if !(self.upper_start.is_finite() && self.upper_start >= 1.0) {
            return bad("upper_start", self.upper_start, "the upper ratio bound starts at a finite value >= 1");
        }
        if !(self.upper_max.is_finite() && self.upper_max >= self.upper_start) {
            return bad("upper_max", self.upper_max, "the upper ratio bound's maximum is finite and >= upper_start");
        }
        for (step, span, field) in [
            (self.lower_step, self.lower_max - self.lower_start, "lower_step"),
            (self.upper_step, self.upper_max - self.upper_start, "upper_step"),
        ] {
            if !(step.is_finite() && step >= 0.0) {
                return bad(field, step, "a search step is finite and >= 0");
            }
            if step > 0.0 && span / step > BAPO_MAX_STEPS {
                return bad(
                    field,
                    step,
                    "the search would take more than BAPO_MAX_STEPS (1000) steps; use a larger step",
                );
            }
        }
        for (v, field) in [(self.target, "target"), (self.eps, "eps")] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, v, "must be finite and >= 0 (the official target is 1, eps 1e-8)");
            }
        }
        if let Some(c) = self.dual_clip {
            if !(c.is_finite() && c > 1.0) {
                return bad("dual_clip", c, "the dual-clip constant must be finite and > 1 (BAPO uses 3)");
            }
        }
        if !(self.max_log_ratio.is_finite() && self.max_log_ratio > 0.0) {
            return bad(
                "max_log_ratio",
                self.max_log_ratio,
                "the log-ratio clamp must be finite and > 0 (BAPO uses 20)",
            );
        }
        Ok(())
    }
}

/// The candidate values of one bound, in the order the official loop visits them: `start`, then
/// `min(x + step, max)` in f64 until `max` (at most [`BAPO_MAX_STEPS`] steps, and none that would
/// not move).
fn ladder(start: f64, max: f64, step: f64) -> Vec<f64> {
    let mut out = vec![start];
    let mut x = start;
    while x < max && step > 0.0 && (out.len() as f64) <= BAPO_MAX_STEPS {
        let next = (x + step).min(max);
        if next <= x {
            break;
        }
        out.push(next);
        x = next;
    }
    out
}

/// Host values as an f64 tensor on `device` without a blocking copy: on an accelerator each value
/// is written by a small fill kernel (a copy from pageable host memory would wait for the device's
/// queue, a synchronisation like a read), on the CPU it is the slice itself.
fn host_values(v: &[f64], device: Device) -> Result<Tensor, LossError> {
    if device == Device::Cpu {
        return Ok(Tensor::f_from_slice(v)?);
    }
    let parts = v.iter().map(|x| Tensor::f_scalar_tensor(*x, (Kind::Double, device))).collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_stack(&parts, 0)?)
}

/// The clip window BAPO chose for one call, and the balance there ([`bapo_clip_bounds`]).
///
/// ```text
/// c_low, c_high   the window [c_low, c_high] (ratio values)
/// balance         P / (N + eps) at that window, +∞ when N = 0 (the official pos_neg_ratio)
/// positive        P = Σ_{A≥0} m min(r, c_high) A
/// negative        N = Σ_{A<0} m max(r, c_low) |A|
/// steps           how many steps the search took (lower bound first, then upper)
/// ```
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{bapo_clip_bounds, BapoConfig};
/// // Positives only: nothing to balance, the window stays at its start.
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let b = bapo_clip_bounds(&lp, &lp, &Tensor::from_slice(&[1.0f64]), &lp.ones_like(), &BapoConfig::paper())?.read()?;
/// assert_eq!((b.c_low, b.c_high, b.steps, b.negative), (0.6, 1.2, 0, 0.0));
/// assert!(b.balance.is_infinite());
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct BapoBounds {
    /// The lower ratio bound chosen.
    pub c_low: f64,
    /// The upper ratio bound chosen.
    pub c_high: f64,
    /// `P/(N + eps)` at the chosen window (`+∞` without a negative contribution).
    pub balance: f64,
    /// `P`, the positive advantages' contribution.
    pub positive: f64,
    /// `N`, the negative advantages' contribution (as a positive number).
    pub negative: f64,
    /// The number of steps the search took, both bounds together.
    pub steps: i64,
}

diagnostics_struct!(BapoBounds { c_low, c_high, balance, positive, negative, steps });

/// What a trainer logs about [`bapo_loss`]: [`PpoDiagnostics`]' fields over unmasked tokens, and
/// the window the search chose.
///
/// ```text
/// samples … approx_kl   as PpoDiagnostics (r = exp(clamp(δ, ±M)) per token)
/// c_low, c_high         the window chosen for this call
/// balance               P/(N + eps) there (the official code's logged pos_neg_ratio)
/// ```
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{bapo_loss_output, BapoConfig, Normalizer};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
/// let adv = Tensor::from_slice2(&[[1.0f64, -0.5]]);
/// let out = bapo_loss_output(&lp, &lp, &adv, &lp.ones_like(), &BapoConfig::paper(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// // On-policy P = 1, N = 0.5: the target is met at the start.
/// assert_eq!((d.samples, d.c_low, d.c_high, d.clip_fraction), (2, 0.6, 1.2, 0.0));
/// assert!((d.balance - 2.0).abs() < 1e-7);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct BapoDiagnostics {
    /// Number of unmasked tokens.
    pub samples: i64,
    /// Share of tokens where the clip decides the value (no gradient; verl's `pg_clipfrac`).
    pub clip_fraction: f64,
    /// Share of tokens where the dual-clip cap decides (verl's `pg_clipfrac_lower`).
    pub dual_clip_fraction: f64,
    /// Smallest ratio.
    pub ratio_min: f64,
    /// Mean ratio.
    pub ratio_mean: f64,
    /// Largest ratio.
    pub ratio_max: f64,
    /// Mean log-ratio.
    pub log_ratio_mean: f64,
    /// Mean of `r − 1 − ln r`, the k3 estimate of `KL(μ‖π)`.
    pub approx_kl: f64,
    /// The lower ratio bound chosen.
    pub c_low: f64,
    /// The upper ratio bound chosen.
    pub c_high: f64,
    /// `P/(N + eps)` at the chosen window.
    pub balance: f64,
}

diagnostics_struct!(BapoDiagnostics {
    samples,
    clip_fraction,
    dual_clip_fraction,
    ratio_min,
    ratio_mean,
    ratio_max,
    log_ratio_mean,
    approx_kl,
    c_low,
    c_high,
    balance,
});

/// The chosen window, on the device: the bounds in f64 as configured (for the record), the same
/// bounds in the compute dtype (for the clamp), and the sums there.
struct Window {
    low: Tensor,
    high: Tensor,
    low_k: Tensor,
    high_k: Tensor,
    balance: Tensor,
    positive: Tensor,
    negative: Tensor,
    steps: Tensor,
}

/// The search of [`bapo_clip_bounds`] on checked inputs, vectorised: no host read.
///
/// `P` depends on the upper bound only and `N` on the lower only. Each real token falls in one of
/// the intervals the candidate bounds cut the ratio axis into (`bucketize`); the per-interval sums
/// of `A` and `r A` (`index_add`) and their cumulative sums give `P` at every candidate upper
/// bound and `N` at every candidate lower bound, in f64, in one pass over the tokens. The first
/// window of the search path whose balance is not below the target is then picked on the device.
fn search(x: &TokenInputs, r: &Tensor, cfg: &BapoConfig) -> Result<Window, LossError> {
    let (kind, device) = (x.kind, r.device());
    let lows = host_values(&ladder(cfg.lower_start, cfg.lower_max, cfg.lower_step), device)?;
    let highs = host_values(&ladder(cfg.upper_start, cfg.upper_max, cfg.upper_step), device)?;
    let (nl, nh) = (lows.size()[0], highs.size()[0]);
    // The candidates as the compute dtype holds them: the official code compares in that dtype.
    let lows_k = lows.f_to_kind(kind)?.f_to_kind(Kind::Double)?;
    let highs_k = highs.f_to_kind(kind)?.f_to_kind(Kind::Double)?;

    let r64 = r.f_detach()?.f_to_kind(Kind::Double)?.f_flatten(0, -1)?;
    let shape = x.mask.size();
    let adv = x.weights_per_token()?.f_expand(shape.as_slice(), false)?.f_to_kind(Kind::Double)?;
    let a = adv.f_mul(&x.mask_f.f_to_kind(Kind::Double)?)?.f_flatten(0, -1)?; // m A
    let a_pos = a.f_clamp_min(0.0)?; // m A where A ≥ 0, else 0
    let a_neg = a.f_clamp_max(0.0)?.f_neg()?; // m |A| where A < 0, else 0
    // Per-interval sums of `w` and `r w`, then cumulative: `(Σ_{b≤j} w, Σ_{b≤j} r w)` for every
    // candidate j (the last interval, above every candidate, is only in the totals).
    let sums = |bounds: &Tensor, n: i64, w: &Tensor| -> Result<(Tensor, Tensor, Tensor, Tensor), LossError> {
        let bucket = r64.f_bucketize(bounds, false, false)?;
        let empty = Tensor::f_zeros([n + 1], (Kind::Double, device))?;
        let w_sum = empty.f_index_add(0, &bucket, w)?;
        let rw_sum = empty.f_index_add(0, &bucket, &r64.f_mul(w)?)?;
        let (w_total, rw_total) = (w_sum.f_sum(Kind::Double)?, rw_sum.f_sum(Kind::Double)?);
        let w_cum = w_sum.f_cumsum(0, Kind::Double)?.f_narrow(0, 0, n)?;
        let rw_cum = rw_sum.f_cumsum(0, Kind::Double)?.f_narrow(0, 0, n)?;
        Ok((w_cum, rw_cum, w_total, rw_total))
    };
    // P(h_j) = Σ_{r ≤ h_j} r A + h_j Σ_{r > h_j} A.
    let (w_cum, rw_cum, w_total, _) = sums(&highs_k, nh, &a_pos)?;
    let positive = rw_cum.f_add(&highs_k.f_mul(&w_total.f_sub(&w_cum)?)?)?; // [nh]
    // N(l_k) = l_k Σ_{r ≤ l_k} |A| + Σ_{r > l_k} r |A|.
    let (w_cum, rw_cum, _, rw_total) = sums(&lows_k, nl, &a_neg)?;
    let negative = lows_k.f_mul(&w_cum)?.f_add(&rw_total.f_sub(&rw_cum)?)?; // [nl]

    // Along the path: (l_k, h_0) for every k, then (l_last, h_j) for j ≥ 1. A value per lower
    // candidate `[nl]`, or per upper candidate `[nh]`, spread over the `nl + nh − 1` windows.
    let by_low = |t: &Tensor| -> Result<Tensor, LossError> {
        Ok(Tensor::f_cat(&[t.shallow_clone(), t.f_narrow(0, nl - 1, 1)?.f_expand([nh - 1], false)?], 0)?)
    };
    let by_high = |t: &Tensor| -> Result<Tensor, LossError> {
        Ok(Tensor::f_cat(&[t.f_narrow(0, 0, 1)?.f_expand([nl], false)?, t.f_narrow(0, 1, nh - 1)?], 0)?)
    };
    let (path_low, path_high) = (by_low(&lows)?, by_high(&highs)?);
    let (p_path, n_path) = (by_high(&positive)?, by_low(&negative)?);
    let ratio = p_path.f_div(&n_path.f_add_scalar(cfg.eps)?)?;
    let balance = ratio.f_where_self(&n_path.f_gt(0.0)?, &ratio.f_full_like(f64::INFINITY)?)?;
    // The official loops stop at the first window whose balance is not below the target (a NaN
    // balance stops them too), else at the last.
    let met = balance.f_lt(cfg.target)?.f_logical_not()?;
    let n = nl + nh - 1;
    let order = Tensor::f_arange(n, (Kind::Int64, device))?;
    let pick = order.f_where_scalarother(&met, n - 1)?.f_min()?.f_reshape([1])?;
    let at = |t: &Tensor| -> Result<Tensor, LossError> { Ok(t.f_index_select(0, &pick)?.f_reshape([])?) };
    let low = at(&path_low)?;
    let high = at(&path_high)?;
    Ok(Window {
        low_k: low.f_to_kind(kind)?,
        high_k: high.f_to_kind(kind)?,
        low,
        high,
        balance: at(&balance)?,
        positive: at(&p_path)?,
        negative: at(&n_path)?,
        steps: pick.f_reshape([])?.f_to_kind(Kind::Double)?,
    })
}

/// The checked inputs and the ratio `exp(clamp(δ, ±M))` (differentiable).
fn bapo_inputs(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &BapoConfig,
) -> Result<(TokenInputs, Tensor), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: true,
        checks: cfg.checks,
    })?;
    let r = x.delta.f_clamp(-cfg.max_log_ratio, cfg.max_log_ratio)?.f_exp()?;
    Ok((x, r))
}

/// BAPO's clip window for one call: the search of the official code, on the device.
///
/// ```text
/// r_t      = exp(clamp(log π_t − log μ_t, ±M))                       (stop-gradient here)
/// r_eff,t  = min(r_t, c_high) if A_t ≥ 0,  max(r_t, c_low) if A_t < 0
/// P = Σ_t m_t max(r_eff,t A_t, 0)      N = Σ_t m_t max(−r_eff,t A_t, 0)
/// balance  = P / (N + eps),  +∞ when N = 0
///
/// start at (c_low, c_high) = (lower_start, upper_start);
/// while balance < target and c_low < lower_max:  c_low  ← min(c_low + lower_step, lower_max)
/// while balance < target and c_high < upper_max: c_high ← min(c_high + upper_step, upper_max)
/// (each loop stops as soon as balance ≥ target)
/// ```
///
/// The **lower bound moves first**, then the upper, as in the official code. Note what the
/// official measure implies: a negative token clipped at `c_low` still adds `c_low |A|` to `N`,
/// so raising `c_low` can only *raise* `N` and never helps meet the target; whenever the start
/// misses the target, `c_low` ends at `lower_max` and the upper bound's search alone decides.
/// (Raising `c_low` does drop more negative tokens from the *gradient*, the paper's motive; the
/// official balance is of the clipped loss's value, not of its gradient.) The paper's Algorithm 1
/// may move both bounds in one loop; this crate follows the code, which it could check.
///
/// Computed without a host read: every candidate window of the path is evaluated in one
/// vectorised pass (each token's interval among the candidate bounds, per-interval sums in f64)
/// and the first that meets the target is picked on the device; the candidate bounds are written
/// there by fill kernels, not copied from the host (a blocking copy would wait for the device as
/// a read does). The result stays on the device until [`OnDevice::read`] (one host read). So the
/// official code's `.item()` reads at every step (up to 43 steps with the paper's ranges) become
/// none, and with [`Checks::Shapes`] the whole call reads nothing back. Under [`Checks::Full`]
/// the inputs' checks cost their usual read. The cost is that of a few elementwise passes over
/// the tokens (two `bucketize`, four `index_add`), whatever the number of candidates.
///
/// The window is a statistic of this call's tokens (advantages `A = 0` count on the positive
/// side and add nothing): calling per micro-batch gives each its own window, as the official
/// code does per loss call (its later version all-reduces `P` and `N` over data-parallel ranks,
/// which a single call here does not). It is not split-invariant.
///
/// Reference: arXiv 2510.18927; WooooDyy/BAPO `recipe/bapo/policy_loss.py`
/// (`_compute_effective_advantage` and the two `while` loops of `compute_policy_loss_bapo`),
/// restated in the tests and matched.
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy and of the policy that sampled
///   the data (both used without gradient here).
/// * `advantages` — `[B]` (broadcast over tokens) or `[B, T]`.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{bapo_clip_bounds, BapoConfig};
///
/// // A positive token at r = 2 (A = 1) and a negative one at r = 1 (A = −1.5): at the start
/// // P = min(2, 1.2) = 1.2 < N = 1.5. Raising c_low changes nothing (r = 1 > c_low), so c_low
/// // goes to 0.9; c_high then rises until P = c_high passes 1.5.
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.0 - 2f64.ln(), -1.0]]);
/// let adv = Tensor::from_slice2(&[[1.0f64, -1.5]]);
/// let b = bapo_clip_bounds(&logp, &logp_mu, &adv, &logp.ones_like(), &BapoConfig::paper())?.read()?;
/// assert_eq!(b.c_low, 0.9);
/// assert!((b.c_high - 1.55).abs() < 1e-9 && b.balance >= 1.0);
/// assert_eq!(b.steps, 6 + 7); // six steps of the lower bound, seven of the upper
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn bapo_clip_bounds(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &BapoConfig,
) -> Result<OnDevice<BapoBounds>, LossError> {
    let (x, r) = bapo_inputs(&validate::detached(logp, "logp")?, logp_mu, advantages, mask, cfg)?;
    let w = search(&x, &r, cfg)?;
    OnDevice::new(&[w.low, w.high, w.balance, w.positive, w.negative, w.steps])
}

/// The per-token surrogate with the window `w`, and its diagnostics' pieces.
fn bapo_terms(
    x: &TokenInputs,
    r: &Tensor,
    w: &Window,
    cfg: &BapoConfig,
) -> Result<(Tensor, Tensor, Tensor), LossError> {
    let adv = x.weights_per_token()?;
    let neg_adv = adv.f_neg()?;
    let unclipped = r.f_mul(&neg_adv)?;
    let clipped = r.f_clamp_tensor(Some(&w.low_k), Some(&w.high_k))?.f_mul(&neg_adv)?;
    let loss = unclipped.f_maximum(&clipped)?;
    let value = match cfg.dual_clip {
        Some(c) => {
            let cap = neg_adv.f_mul_scalar(c)?.f_where_scalarother(&adv.f_lt(0.0)?, f64::INFINITY)?;
            loss.f_minimum(&cap)?
        }
        None => loss.shallow_clone(),
    };
    let clip_active = clipped.f_gt_tensor(&unclipped)?;
    let dual_active = value.f_ne_tensor(&loss)?;
    Ok((value, clip_active, dual_active))
}

/// BAPO's policy loss: PPO-clip with the window [`bapo_clip_bounds`] chose for this call, and
/// the dual clip for negative advantages.
///
/// ```text
/// [c_low, c_high] = bapo_clip_bounds(..)                              (stop-gradient)
/// ℓ_t  = max(−A_t r_t, −A_t clip(r_t, c_low, c_high))
/// ℓ_t  = min(ℓ_t, −c A_t)   where A_t < 0                             (c = 3)
/// loss = aggregate(ℓ, mask)                                            (TokenMean by default)
/// ```
///
/// With a fixed window (`…_start = …_max`) this is [`crate::ppo_clip_loss`] with
/// `PpoConfig::ppo().with_clip(1 − c_low, c_high − 1).with_dual_clip(Some(3.0))` (tested, to the
/// last bit for `c_low ≥ 0.5`, where `1 − (1 − c_low)` is exact). The loss does not call it: the
/// window stays on the device (no host read), and for `c_low < 0.5` the `ε` round trip would move
/// the bound by an ulp.
///
/// Host reads: under [`Checks::Full`], the inputs' checks and the finite-loss check; under
/// [`Checks::Shapes`], none (the search reads nothing back; see [`bapo_clip_bounds`]).
///
/// Reference: arXiv 2510.18927; WooooDyy/BAPO `compute_policy_loss_bapo` (restated in the tests:
/// window, values, gradients and clip fractions). The official code starts the window from the
/// actor's `1 ∓ clip_ratio` when no start is set; here the config always holds it.
///
/// # Arguments
/// As [`bapo_clip_bounds`]; `logp` is differentiable.
///
/// # Errors
/// As [`bapo_clip_bounds`]; [`LossError::NonFiniteLoss`] if the loss overflows the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{bapo_loss, BapoConfig};
///
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-1.0 - 2f64.ln(), -1.0]]); // r = 2, then 1
/// let adv = Tensor::from_slice2(&[[1.0f64, -1.5]]);
/// let loss = bapo_loss(&logp, &logp_mu, &adv, &logp.ones_like(), &BapoConfig::paper())?;
/// // The window is [0.9, 1.55] (see bapo_clip_bounds): the positive token is clipped at 1.55.
/// assert!((loss.double_value(&[]) - (-1.55 + 1.5) / 2.0).abs() < 1e-9);
/// loss.backward();
/// assert_eq!(Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?, vec![0.0, 0.75]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn bapo_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &BapoConfig,
) -> Result<Tensor, LossError> {
    let (x, r) = bapo_inputs(logp, logp_mu, advantages, mask, cfg)?;
    let w = search(&x, &r, cfg)?;
    let (per_token, _, _) = bapo_terms(&x, &r, &w, cfg)?;
    x.sanitized_loss(&per_token, cfg.aggregation, &Normalizer::local())
}

/// [`bapo_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding) and
/// its [`BapoDiagnostics`] (the window chosen among them) from the same pass.
///
/// The counts make the aggregation split-invariant; the window is still this call's (see
/// [`bapo_clip_bounds`]).
///
/// Reference: as [`bapo_loss`].
///
/// # Errors
/// As [`bapo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{bapo_loss_output, BapoConfig, Normalizer};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0, 0.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.0 - 2f64.ln(), -1.0, 0.0]]);
/// let adv = Tensor::from_slice2(&[[1.0f64, -1.5, 0.0]]);
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = bapo_loss_output(&logp, &logp_mu, &adv, &mask, &BapoConfig::paper(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// assert_eq!((d.samples, d.clip_fraction, d.c_low), (2, 0.5, 0.9));
/// assert_eq!(out.terms.double_value(&[0, 2]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn bapo_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &BapoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<BapoDiagnostics>, LossError> {
    let (x, r) = bapo_inputs(logp, logp_mu, advantages, mask, cfg)?;
    let w = search(&x, &r, cfg)?;
    let (per_token, clip, dual) = bapo_terms(&x, &r, &w, cfg)?;
    let loss = x.sanitized_loss(&per_token, cfg.aggregation, norm)?;
    let ppo = ppo_diagnostics(&r, &clip, &dual, &x.mask)?;
    let mut values = ppo.tensor().f_unbind(0)?;
    values.extend([w.low, w.high, w.balance]);
    let diagnostics = OnDevice::new(&values)?;
    Ok(LossOutput { loss, terms: x.zero_padding(&per_token)?, diagnostics })
}

/// How [`prefix_ratio_loss`] combines the token log-ratios of a prefix.
///
/// ```text
/// Product        K_t = Σ_{s≤t} m_s δ_s             w_t = Π_{s≤t} r_s, the prefix's ratio (CTPO's cumprod)
/// GeometricMean  K_t = Σ_{s≤t} m_s δ_s / n_t       w_t = (Π_{s≤t} r_s)^{1/n_t} (CTPO's geomean)
/// ```
///
/// # Example
/// ```
/// use topr_loss::{PrefixRatio, PrefixRatioConfig};
/// assert_eq!(PrefixRatioConfig::ctpo_la().ratio, PrefixRatio::Product);
/// assert_eq!(PrefixRatioConfig::ctpo_geomean_la().ratio, PrefixRatio::GeometricMean);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum PrefixRatio {
    /// The product of the prefix's token ratios (CTPO's `cum-token-cumprod`).
    #[default]
    Product,
    /// Their geometric mean (CTPO's `cum-token-geomean`).
    GeometricMean,
}

/// The clip of [`prefix_ratio_loss`]: PPO's fixed window on the prefix weight, or CTPO-LA's
/// window in log space that widens with the position.
///
/// ```text
/// Ratio           w̃_t = clip(w_t, 1 − ε_low, 1 + ε_high)                     cap c
/// LengthAdaptive  s_t = max(n_t, 1)^p                                         (n_t the 1-based position)
///                 w̃_t = exp(clamp(log w_t, −log_low · s_t, log_high · s_t))   cap c_t = exp(log_dual · s_t)
/// ```
///
/// With CTPO-LA's defaults (0.025, 0.05, 0.05, `p = 0.5`) the window is `[0.975, 1.05]` at the
/// first token and `[0.78, 1.65]` at the hundredth: it grows as the spread of the prefix's log-ratio
/// does (`∝ √t` for the product; `p = −0.5` for the geometric mean, whose spread shrinks as `1/√t`).
///
/// # Example
/// ```
/// use topr_loss::PrefixClip;
/// assert_eq!(
///     PrefixClip::length_adaptive(),
///     PrefixClip::LengthAdaptive { log_low: 0.025, log_high: 0.05, log_dual: 0.05, power: 0.5 }
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum PrefixClip {
    /// PPO's window on the prefix weight (CTPO's `cum-token-cumprod` with the actor's clip).
    Ratio {
        /// `ε_low ≥ 0`: the weight is clipped below at `1 − ε_low` (`∞`: no lower clip).
        #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
        clip_low: f64,
        /// `ε_high ≥ 0`: clipped above at `1 + ε_high` (`∞`: no upper clip).
        #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
        clip_high: f64,
        /// Dual clip `c > 1` for `A < 0` (verl's `clip_ratio_c`, 3); `None`: off.
        dual_clip: Option<f64>,
    },
    /// CTPO-LA's position-scaled log-space window (`cum-token-cumprod-la`, `cum-token-geomean-la`).
    LengthAdaptive {
        /// The lower bound's base in log space, `> 0` (CTPO's `la_clip_low`, 0.025).
        log_low: f64,
        /// The upper bound's base in log space, `> 0` (`la_clip_high`, 0.05).
        log_high: f64,
        /// The dual-clip threshold's base in log space, `> 0` (`la_clip_c`, 0.05).
        log_dual: f64,
        /// The position's power `p`, finite (`clip_ratio_la_power`, 0.5; 0: the same window at
        /// every position).
        power: f64,
    },
}

impl PrefixClip {
    /// CTPO-LA's defaults: `(0.025, 0.05, 0.05)` with `p = 0.5`.
    ///
    /// ```
    /// assert!(matches!(topr_loss::PrefixClip::length_adaptive(), topr_loss::PrefixClip::LengthAdaptive { .. }));
    /// ```
    pub const fn length_adaptive() -> Self {
        Self::LengthAdaptive { log_low: 0.025, log_high: 0.05, log_dual: 0.05, power: 0.5 }
    }

    /// PPO's window `ε = 0.2` both sides with dual clip 3 (verl's actor defaults).
    ///
    /// ```
    /// use topr_loss::PrefixClip;
    /// assert_eq!(PrefixClip::ratio(), PrefixClip::Ratio { clip_low: 0.2, clip_high: 0.2, dual_clip: Some(3.0) });
    /// ```
    pub const fn ratio() -> Self {
        Self::Ratio { clip_low: 0.2, clip_high: 0.2, dual_clip: Some(3.0) }
    }
}

/// The prefix ratio, its clip and the aggregation of [`prefix_ratio_loss`].
///
/// `Default` is [`PrefixRatioConfig::ctpo_la`].
///
/// Reference: Zhang, Ye, Jin, Yu, Xiong, Sahu, Jiang, *Rethinking Importance Sampling in LLM Policy
/// Optimization: A Cumulative Token Perspective* (CTPO), arXiv 2605.07331; horizon-llm/CTPO
/// `verl/trainer/ppo/core_algos.py` (`_compute_policy_loss_cum_token_impl`,
/// `_compute_policy_loss_cum_token_la_impl`; loss modes `cum-token-cumprod(-la)`,
/// `cum-token-geomean(-la)`), restated in the tests.
///
/// # Example
/// ```
/// use topr_loss::{PrefixClip, PrefixRatio, PrefixRatioConfig};
/// let c = PrefixRatioConfig::ctpo_la();
/// assert_eq!((c.ratio, c.clip, c.max_log_weight), (PrefixRatio::Product, PrefixClip::length_adaptive(), 10.0));
/// assert!(c.with_max_log_weight(100.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct PrefixRatioConfig {
    /// Product or geometric mean of the prefix's ratios.
    pub ratio: PrefixRatio,
    /// The fixed or the length-adaptive window.
    pub clip: PrefixClip,
    /// `C`: the log-weight is capped at `C` (`w ≤ e^C`; CTPO: 10). Finite, in `(0, 80]`.
    pub max_log_weight: f64,
    /// Each token's `δ` is clamped to `±max_log_ratio` before the prefix sum (finite, `> 0`;
    /// CTPO: 20).
    pub max_log_ratio: f64,
    /// How per-token losses are reduced (CTPO: verl's `loss_agg_mode`, token-mean by default).
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for PrefixRatioConfig {
    fn default() -> Self {
        Self::ctpo_la()
    }
}

impl PrefixRatioConfig {
    /// CTPO-LA: the product of the prefix's ratios, the length-adaptive window
    /// ([`PrefixClip::length_adaptive`]), `C = 10`, `M = 20`, token-mean.
    ///
    /// ```
    /// assert_eq!(topr_loss::PrefixRatioConfig::ctpo_la(), topr_loss::PrefixRatioConfig::default());
    /// ```
    pub const fn ctpo_la() -> Self {
        Self {
            ratio: PrefixRatio::Product,
            clip: PrefixClip::length_adaptive(),
            max_log_weight: 10.0,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// CTPO without the length adaptation: the product of the prefix's ratios in PPO's window
    /// `ε = 0.2`, dual clip 3 ([`PrefixClip::ratio`]).
    ///
    /// ```
    /// assert_eq!(topr_loss::PrefixRatioConfig::ctpo().clip, topr_loss::PrefixClip::ratio());
    /// ```
    pub const fn ctpo() -> Self {
        Self::ctpo_la().with_clip(PrefixClip::ratio())
    }

    /// CTPO-LA on the geometric mean of the prefix's ratios, with the power `p = −0.5` that
    /// CTPO's code recommends for it (its default is 0.5 for both modes).
    ///
    /// ```
    /// use topr_loss::{PrefixClip, PrefixRatioConfig};
    /// let c = PrefixRatioConfig::ctpo_geomean_la();
    /// assert!(matches!(c.clip, PrefixClip::LengthAdaptive { power, .. } if power == -0.5));
    /// ```
    pub const fn ctpo_geomean_la() -> Self {
        Self::ctpo_la().with_ratio(PrefixRatio::GeometricMean).with_clip(PrefixClip::LengthAdaptive {
            log_low: 0.025,
            log_high: 0.05,
            log_dual: 0.05,
            power: -0.5,
        })
    }

    /// The same config with another way of combining the prefix.
    ///
    /// ```
    /// use topr_loss::{PrefixRatio, PrefixRatioConfig};
    /// let c = PrefixRatioConfig::ctpo().with_ratio(PrefixRatio::GeometricMean);
    /// assert_eq!(c.ratio, PrefixRatio::GeometricMean);
    /// ```
    pub const fn with_ratio(self, ratio: PrefixRatio) -> Self {
        Self { ratio, ..self }
    }

    /// The same config with another clip.
    ///
    /// ```
    /// use topr_loss::{PrefixClip, PrefixRatioConfig};
    /// let c = PrefixRatioConfig::ctpo_la().with_clip(PrefixClip::Ratio { clip_low: 0.2, clip_high: 0.28, dual_clip: None });
    /// assert!(matches!(c.clip, PrefixClip::Ratio { dual_clip: None, .. }));
    /// ```
    pub const fn with_clip(self, clip: PrefixClip) -> Self {
        Self { clip, ..self }
    }

    /// The same config with another cap on the log-weight.
    ///
    /// ```
    /// assert_eq!(topr_loss::PrefixRatioConfig::ctpo_la().with_max_log_weight(5.0).max_log_weight, 5.0);
    /// ```
    pub const fn with_max_log_weight(self, max_log_weight: f64) -> Self {
        Self { max_log_weight, ..self }
    }

    /// The same config with another clamp on each token's log-ratio.
    ///
    /// ```
    /// assert_eq!(topr_loss::PrefixRatioConfig::ctpo_la().with_max_log_ratio(5.0).max_log_ratio, 5.0);
    /// ```
    pub const fn with_max_log_ratio(self, max_log_ratio: f64) -> Self {
        Self { max_log_ratio, ..self }
    }

    crate::setters::setters!(PrefixRatioConfig, ctpo_la(); checks, aggregation);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: `max_log_weight` not finite or outside
    /// `(0, 80]` (so that `e^C` fits in f32), `max_log_ratio` not finite and `> 0`; for
    /// [`PrefixClip::Ratio`], a NaN or negative `clip_low`/`clip_high`, a `dual_clip` not finite
    /// and `> 1`; for [`PrefixClip::LengthAdaptive`], a `log_low`/`log_high`/`log_dual` not finite
    /// and `> 0` (CTPO asserts `> 0`), a non-finite `power`.
    ///
    /// ```
    /// use topr_loss::{PrefixClip, PrefixRatioConfig};
    /// let la = PrefixClip::LengthAdaptive { log_low: 0.0, log_high: 0.05, log_dual: 0.05, power: 0.5 };
    /// assert!(PrefixRatioConfig::ctpo_la().with_clip(la).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        let bad = |field: &'static str, value: f64, reason: &str| {
            Err(LossError::InvalidConfig { field, value, reason: reason.into() })
        };
        if !(self.max_log_weight.is_finite() && self.max_log_weight > 0.0 && self.max_log_weight <= 80.0) {
            return bad("max_log_weight", self.max_log_weight, "the log-weight cap lies in (0, 80] (CTPO uses 10)");
        }
        if !(self.max_log_ratio.is_finite() && self.max_log_ratio > 0.0) {
            return bad(
                "max_log_ratio",
                self.max_log_ratio,
                "the log-ratio clamp must be finite and > 0 (CTPO uses 20)",
            );
        }
        match self.clip {
            PrefixClip::Ratio { clip_low, clip_high, dual_clip } => {
                for (v, field) in [(clip_low, "clip_low"), (clip_high, "clip_high")] {
                    if v.is_nan() || v < 0.0 {
                        return bad(field, v, "a clip range must be >= 0");
                    }
                }
                if let Some(c) = dual_clip {
                    if !(c.is_finite() && c > 1.0) {
                        return bad("dual_clip", c, "the dual-clip constant must be finite and > 1 (commonly 3)");
                    }
                }
            }
            PrefixClip::LengthAdaptive { log_low, log_high, log_dual, power } => {
                for (v, field) in [(log_low, "log_low"), (log_high, "log_high"), (log_dual, "log_dual")] {
                    if !(v.is_finite() && v > 0.0) {
                        return bad(field, v, "a log-space clip base must be finite and > 0 (CTPO-LA asserts it)");
                    }
                }
                validate::finite_field(power, "power")?;
            }
        }
        Ok(())
    }
}

/// The checked inputs, the per-token loss, the log-weight and where the clip and the cap decide.
fn prefix_terms(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PrefixRatioConfig,
) -> Result<(TokenInputs, Tensor, Tensor, Tensor, Tensor), LossError> {
    cfg.validate()?;
    let x = token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: true,
        checks: cfg.checks,
    })?;
    let m = cfg.max_log_ratio;
    // δ is zero on padding, so the prefix sums skip it; `n_t` counts the real tokens up to t.
    let delta = x.delta.f_detach()?.f_clamp(-m, m)?;
    let sums = delta.f_cumsum(1, None::<Kind>)?;
    let position = x.mask_f.f_cumsum(1, None::<Kind>)?.f_clamp_min(1.0)?;
    let prefix = match cfg.ratio {
        PrefixRatio::GeometricMean => sums.f_div(&position)?,
        _ => sums,
    };
    // 0 on padding, as CTPO; the value of `log π − sg(log π)` is 0 and its gradient 1 at token t.
    let prefix = prefix.f_mul(&x.mask_f)?;
    let lp = x.logp()?;
    let log_w = prefix.f_add(&lp.f_sub(&lp.f_detach()?)?)?.f_clamp_max(cfg.max_log_weight)?;
    let w = log_w.f_exp()?; // ≤ e^C
    let adv = x.weights_per_token()?;
    let neg_adv = adv.f_neg()?;
    let (clipped, cap) = match cfg.clip {
        PrefixClip::Ratio { clip_low, clip_high, dual_clip } => {
            let (lo, hi) = (1.0 - clip_low, 1.0 + clip_high);
            let clipped = match (lo.is_finite(), hi.is_finite()) {
                (true, true) => w.f_clamp(lo, hi)?,
                (true, false) => w.f_clamp_min(lo)?,
                (false, true) => w.f_clamp_max(hi)?,
                (false, false) => w.shallow_clone(),
            };
            (clipped, dual_clip.map(|c| neg_adv.f_mul_scalar(c)).transpose()?)
        }
        PrefixClip::LengthAdaptive { log_low, log_high, log_dual, power } => {
            let scale = position.f_pow_tensor_scalar(power)?;
            let (lo, hi) = (scale.f_mul_scalar(-log_low)?, scale.f_mul_scalar(log_high)?);
            let clipped = log_w.f_clamp_tensor(Some(&lo), Some(&hi))?.f_exp()?;
            // The threshold's exponent is capped at C: past it the cap cannot bind (the loss is at
            // most |A| e^C), so the value is CTPO's and `exp` never sees an unbounded argument.
            let threshold = scale.f_mul_scalar(log_dual)?.f_clamp_max(cfg.max_log_weight)?.f_exp()?;
            (clipped, Some(neg_adv.f_mul(&threshold)?))
        }
    };
    let unclipped = w.f_mul(&neg_adv)?;
    let clipped = clipped.f_mul(&neg_adv)?;
    let loss = unclipped.f_maximum(&clipped)?;
    let value = match cap {
        Some(cap) => {
            let cap = cap.f_where_scalarother(&adv.f_lt(0.0)?, f64::INFINITY)?;
            loss.f_minimum(&cap)?
        }
        None => loss.shallow_clone(),
    };
    let clip_active = clipped.f_gt_tensor(&unclipped)?;
    let dual_active = value.f_ne_tensor(&loss)?;
    Ok((x, value, log_w, clip_active, dual_active))
}

/// The prefix (cumulative) importance ratio in PPO's clipped objective: CTPO, with CTPO-LA's
/// position-dependent window.
///
/// ```text
/// δ_s   = clamp(log π_s − log μ_s, ±M)
/// K_t   = Σ_{s≤t} m_s δ_s   (Product)   or   K_t / n_t   (GeometricMean)      n_t = Σ_{s≤t} m_s
/// log w_t = min(sg(K_t) + log π_t − sg(log π_t), C)                            C = 10
/// ℓ_t   = max(−A_t w_t, −A_t w̃_t)                    w̃_t the clipped weight (see PrefixClip)
/// ℓ_t   = min(ℓ_t, −A_t c_t)   where A_t < 0          c_t the dual-clip cap
/// loss  = aggregate(ℓ, mask)                          (TokenMean by default)
/// ```
///
/// The weight's **value** is the ratio of the whole prefix, `w_t = Π_{s≤t} r_s` (capped at
/// `e^C`), the importance weight that corrects token t for a sequence sampled by μ; its
/// **gradient** flows through token t alone: `∂w_t/∂log π_t = w_t`, `∂w_t/∂log π_s = 0` for
/// `s < t`. So the gradient of an unclipped token is `−α A_t w_t` (α its aggregation weight),
/// which is *not* the derivative of the loss's value (that would add the later tokens' terms to
/// each earlier token); past the cap, or clipped, a token gets none. With the geometric mean the
/// gradient keeps the coefficient 1 while the value moves by `1/n_t` per unit of `log π_t`
/// (CTPO's choice, GSPO's token-level form). A one-token sequence is PPO.
///
/// Numerics: each `δ` is clamped to ±20 before the sum, the log-weight capped at `C` before `exp`
/// (so `w ≤ e^10`), the dual-clip threshold's exponent capped at `C` too (it cannot bind beyond),
/// a prefix of very negative log-ratios gives `w = 0`, not an error. Padding holds NaN or inf
/// freely: its `δ` is 0, it does not enter any prefix and it gets exactly zero gradient.
///
/// Reference: arXiv 2605.07331; horizon-llm/CTPO `_compute_policy_loss_cum_token_impl` and
/// `_compute_policy_loss_cum_token_la_impl` (restated in the tests, values and gradients, all four
/// modes). CTPO writes `log w_t` as `sg(K_t) + log π_t − sg(log π_t)`; the crate computes
/// `sg(K_t) + (log π_t − sg(log π_t))`, the same gradient with the value `K_t` exactly (no
/// rounding through `log π_t`).
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy (differentiable) and of the
///   policy that sampled the data (detached).
/// * `advantages` — `[B]` (broadcast over tokens) or `[B, T]`.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`];
/// [`LossError::NonFiniteLoss`] if the loss overflows the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{prefix_ratio_loss, PrefixClip, PrefixRatioConfig};
///
/// // Two tokens whose ratios are 1.1 and 1.2: the second token's weight is 1.1 · 1.2 = 1.32.
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-1.0 - 1.1f64.ln(), -1.0 - 1.2f64.ln()]]);
/// let adv = Tensor::from_slice(&[1.0f64]);
/// let no_clip = PrefixClip::Ratio { clip_low: f64::INFINITY, clip_high: f64::INFINITY, dual_clip: None };
/// let cfg = PrefixRatioConfig::ctpo().with_clip(no_clip);
/// let loss = prefix_ratio_loss(&logp, &logp_mu, &adv, &logp.ones_like(), &cfg)?;
/// assert!((loss.double_value(&[]) + (1.1 + 1.32) / 2.0).abs() < 1e-12);
/// loss.backward();
/// // Each token's gradient is −A w_t / 2, through that token only.
/// let g = Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?;
/// assert!((g[0] + 1.1 / 2.0).abs() < 1e-12 && (g[1] + 1.32 / 2.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn prefix_ratio_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PrefixRatioConfig,
) -> Result<Tensor, LossError> {
    let (x, per_token, _, _, _) = prefix_terms(logp, logp_mu, advantages, mask, cfg)?;
    x.sanitized_loss(&per_token, cfg.aggregation, &Normalizer::local())
}

/// [`prefix_ratio_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on
/// padding) and its [`PpoDiagnostics`] over unmasked tokens, where the ratio is the prefix
/// weight `w_t`: `ratio_*` are statistics of `w_t` (which may be 0 for a far prefix),
/// `log_ratio_mean` the mean of `log w_t`, `approx_kl` the mean of `w_t − 1 − log w_t`, the clip
/// fraction counts the tokens where the clipped side decides (CTPO's `pg_clipfrac`), the dual
/// clip fraction those where the cap does.
///
/// Reference: as [`prefix_ratio_loss`].
///
/// # Errors
/// As [`prefix_ratio_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{prefix_ratio_loss_output, Normalizer, PrefixRatioConfig};
/// let logp = Tensor::from_slice2(&[[-1.0f64, -1.0, 0.0]]);
/// let logp_mu = Tensor::from_slice2(&[[-1.1f64, -1.1, 0.0]]); // r = e^0.1 twice
/// let mask = Tensor::from_slice2(&[[true, true, false]]);
/// let out = prefix_ratio_loss_output(&logp, &logp_mu, &Tensor::from_slice(&[1.0f64]), &mask, &PrefixRatioConfig::ctpo_la(), &Normalizer::local())?;
/// let d = out.diagnostics.read()?;
/// // The weights e^0.1 and e^0.2 pass CTPO-LA's upper bounds e^0.05 and e^(0.05·√2): both clipped.
/// assert_eq!((d.samples, d.clip_fraction), (2, 1.0));
/// assert!((d.log_ratio_mean - 0.15).abs() < 1e-12);
/// assert_eq!(out.terms.double_value(&[0, 2]), 0.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn prefix_ratio_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PrefixRatioConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let (x, per_token, log_w, clip, dual) = prefix_terms(logp, logp_mu, advantages, mask, cfg)?;
    let loss = x.sanitized_loss(&per_token, cfg.aggregation, norm)?;
    let valid = &x.mask;
    let log_w = log_w.f_detach()?.f_to_kind(Kind::Double)?;
    let w = log_w.f_exp()?;
    let samples = stats::count(valid)?;
    let (ratio_min, ratio_max) = stats::min_max_where(&w, valid)?;
    let k3 = w.f_sub_scalar(1.0)?.f_sub(&log_w)?;
    let diagnostics = OnDevice::new(&[
        samples.shallow_clone(),
        stats::share(&stats::count(&clip.f_logical_and(valid)?)?, &samples)?,
        stats::share(&stats::count(&dual.f_logical_and(valid)?)?, &samples)?,
        ratio_min,
        stats::mean_where(&w, valid)?,
        ratio_max,
        stats::mean_where(&log_w, valid)?,
        stats::mean_where(&k3, valid)?,
    ])?;
    Ok(LossOutput { loss, terms: x.zero_padding(&per_token)?, diagnostics })
}
