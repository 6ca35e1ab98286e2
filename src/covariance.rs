//! Clip-Cov and KL-Cov: PPO variants that act on the few tokens whose log-probability covaries
//! most with their advantage, the tokens that drive the collapse of the policy's entropy.
//!
//! Both rank the unmasked tokens of the call by the centred covariance term
//!
//! ```text
//! c_t = (A_t − Ā) · (log π_t − mean log π)      Ā, mean log π: plain means over the call's unmasked tokens
//! ```
//!
//! computed on detached values (the selection carries no gradient), with `k = max(⌊ρ N⌋, 1)`
//! tokens selected among the `N` unmasked ones:
//!
//! ```text
//! Clip-Cov  k tokens drawn at random among those with c_lb < c_t < c_ub that PPO's clip leaves
//!           alone; their loss (and gradient) is set to 0. The rest: PPO-clip, −min(r A, clip(r) A).
//! KL-Cov    the k tokens of largest c_t get −r A + β |δ|; the rest −r A (no clip at all).
//! ```
//!
//! **Coupling.** `c_t`, `N` and so `k` belong to the tensors of one call: the selection couples
//! the tokens of a batch, so these losses are not split-invariant. Splitting an optimiser batch into
//! micro-batches (gradient accumulation) or across data-parallel ranks changes which tokens are
//! selected, even with a global [`Normalizer`] (which keeps only the aggregation's counts global).
//! verl computes them per micro-batch, as here; call them on the whole optimiser batch (the
//! `[B, T]` log-probs can come from [`crate::backward_through_logprobs`] chunk by chunk) to select
//! over it.
//!
//! Reference: Cui et al., *The Entropy Mechanism of Reinforcement Learning for Reasoning Language
//! Models*, arXiv 2505.22617, §5; verl `compute_policy_loss_clip_cov` and
//! `compute_policy_loss_kl_cov`.

use crate::aggregate::{AggregationMode, Normalizer, masked_fill_zero};
use crate::checks::Checks;
use crate::error::LossError;
use crate::output::LossOutput;
use crate::ppo::{PpoDiagnostics, ppo_diagnostics};
use crate::token_inputs::{self, TokenArgs, TokenInputs};
use crate::validate::{self, FiniteCheck};
use tch::{Kind, Tensor};

/// Clip ranges, covariance band, selected share and aggregation of [`clip_cov_loss`].
///
/// `Default` ([`ClipCovConfig::clip_cov`]) is verl's: PPO clip `ε = 0.2` both sides, `ρ = 2e-4`
/// (`clip_cov_ratio`), band `(1, 5)` (`clip_cov_lb`, `clip_cov_ub`), token-mean, `δ` clamped to ±20.
///
/// Reference: Cui et al., arXiv 2505.22617; verl `policy_loss.loss_mode=clip_cov` with
/// `policy_loss.clip_cov_ratio`, `clip_cov_lb`, `clip_cov_ub` and `actor.clip_ratio_low/high`.
///
/// # Example
/// ```
/// use topr_loss::ClipCovConfig;
/// let cfg = ClipCovConfig::default();
/// assert_eq!((cfg.ratio, cfg.cov_low, cfg.cov_high), (2e-4, 1.0, 5.0));
/// assert!(cfg.with_ratio(0.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct ClipCovConfig {
    /// `ε_low ≥ 0`: PPO's ratio clip below at `1 − ε_low` (`∞`: none).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub clip_low: f64,
    /// `ε_high ≥ 0`: PPO's ratio clip above at `1 + ε_high` (`∞`: none).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub clip_high: f64,
    /// `ρ ∈ (0, 1]`: `k = max(⌊ρ N⌋, 1)` tokens are detached.
    pub ratio: f64,
    /// Lower end of the covariance band (exclusive).
    pub cov_low: f64,
    /// Upper end of the covariance band (exclusive, `> cov_low`).
    pub cov_high: f64,
    /// `δ` is clamped to `±max_log_ratio` before `exp` (> 0; verl does not clamp here).
    pub max_log_ratio: f64,
    /// How per-token losses are reduced (detached tokens still count in the token count).
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for ClipCovConfig {
    fn default() -> Self {
        Self::clip_cov()
    }
}

impl ClipCovConfig {
    /// verl's defaults: `ε = 0.2/0.2`, `ρ = 2e-4`, band `(1, 5)`, token-mean. arXiv 2505.22617.
    ///
    /// ```
    /// assert_eq!(topr_loss::ClipCovConfig::clip_cov(), topr_loss::ClipCovConfig::default());
    /// ```
    pub const fn clip_cov() -> Self {
        Self {
            clip_low: 0.2,
            clip_high: 0.2,
            ratio: 2e-4,
            cov_low: 1.0,
            cov_high: 5.0,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// The same config with PPO's clip ranges `(ε_low, ε_high)`.
    ///
    /// ```
    /// let c = topr_loss::ClipCovConfig::clip_cov().with_clip(0.2, 0.28);
    /// assert_eq!(c.clip_high, 0.28);
    /// ```
    pub const fn with_clip(self, clip_low: f64, clip_high: f64) -> Self {
        Self { clip_low, clip_high, ..self }
    }

    /// The same config with another selected share `ρ`.
    ///
    /// ```
    /// assert_eq!(topr_loss::ClipCovConfig::clip_cov().with_ratio(0.01).ratio, 0.01);
    /// ```
    pub const fn with_ratio(self, ratio: f64) -> Self {
        Self { ratio, ..self }
    }

    /// The same config with another covariance band `(low, high)`.
    ///
    /// ```
    /// let c = topr_loss::ClipCovConfig::clip_cov().with_band(0.5, 2.0);
    /// assert_eq!((c.cov_low, c.cov_high), (0.5, 2.0));
    /// ```
    pub const fn with_band(self, cov_low: f64, cov_high: f64) -> Self {
        Self { cov_low, cov_high, ..self }
    }

    crate::setters::setters!(ClipCovConfig, clip_cov(); checks, aggregation, max_log_ratio);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: a negative or NaN clip range, `ρ` outside
    /// `(0, 1]`, a NaN band bound or `cov_low ≥ cov_high`, a non-positive or NaN `max_log_ratio`.
    ///
    /// ```
    /// assert!(topr_loss::ClipCovConfig::clip_cov().with_band(5.0, 1.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        for (v, field) in [(self.clip_low, "clip_low"), (self.clip_high, "clip_high")] {
            if v.is_nan() || v < 0.0 {
                return Err(LossError::InvalidConfig { field, value: v, reason: "a clip range must be >= 0".into() });
            }
        }
        share(self.ratio, "ratio")?;
        for (v, field) in [(self.cov_low, "cov_low"), (self.cov_high, "cov_high")] {
            if v.is_nan() {
                return Err(LossError::InvalidConfig { field, value: v, reason: "a band bound cannot be NaN".into() });
            }
        }
        if self.cov_low >= self.cov_high {
            return Err(LossError::InvalidConfig {
                field: "cov_low",
                value: self.cov_low,
                reason: format!("the band's lower end must be below its upper end `cov_high` = {}", self.cov_high),
            });
        }
        validate::positive(self.max_log_ratio, "max_log_ratio", "the log-ratio clamp must be > 0 (commonly 20)")
    }

    /// `clip(r, 1 − ε_low, 1 + ε_high)`, a bound skipped when infinite.
    fn clip(&self, r: &Tensor) -> Result<Tensor, LossError> {
        let (lo, hi) = (1.0 - self.clip_low, 1.0 + self.clip_high);
        Ok(match (lo.is_finite(), hi.is_finite()) {
            (true, true) => r.f_clamp(lo, hi)?,
            (true, false) => r.f_clamp_min(lo)?,
            (false, true) => r.f_clamp_max(hi)?,
            (false, false) => r.shallow_clone(),
        })
    }
}

/// Selected share, penalty coefficient and aggregation of [`kl_cov_loss`].
///
/// `Default` ([`KlCovConfig::kl_cov`]) is verl's: `ρ = 2e-4` (`kl_cov_ratio`), `β = 0.1`
/// (`ppo_kl_coef`), token-mean, `δ` clamped to ±20 before `exp`.
///
/// Reference: Cui et al., arXiv 2505.22617; verl `policy_loss.loss_mode=kl_cov` with
/// `policy_loss.kl_cov_ratio` and `policy_loss.ppo_kl_coef`.
///
/// # Example
/// ```
/// use topr_loss::KlCovConfig;
/// let cfg = KlCovConfig::default();
/// assert_eq!((cfg.ratio, cfg.coef), (2e-4, 0.1));
/// assert!(cfg.with_coef(f64::NAN).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct KlCovConfig {
    /// `ρ ∈ (0, 1]`: `k = max(⌊ρ N⌋, 1)` tokens get the penalty.
    pub ratio: f64,
    /// `β` (finite, `≥ 0`): the coefficient of `|δ|` on the selected tokens.
    pub coef: f64,
    /// `δ` is clamped to `±max_log_ratio` before `exp` (> 0; verl does not clamp here). `|δ|` is
    /// taken unclamped.
    pub max_log_ratio: f64,
    /// How per-token losses are reduced.
    pub aggregation: AggregationMode,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for KlCovConfig {
    fn default() -> Self {
        Self::kl_cov()
    }
}

impl KlCovConfig {
    /// verl's defaults: `ρ = 2e-4`, `β = 0.1`, token-mean. arXiv 2505.22617.
    ///
    /// ```
    /// assert_eq!(topr_loss::KlCovConfig::kl_cov(), topr_loss::KlCovConfig::default());
    /// ```
    pub const fn kl_cov() -> Self {
        Self {
            ratio: 2e-4,
            coef: 0.1,
            max_log_ratio: 20.0,
            aggregation: AggregationMode::TokenMean,
            checks: Checks::Full,
        }
    }

    /// The same config with another selected share `ρ`.
    ///
    /// ```
    /// assert_eq!(topr_loss::KlCovConfig::kl_cov().with_ratio(0.002).ratio, 0.002);
    /// ```
    pub const fn with_ratio(self, ratio: f64) -> Self {
        Self { ratio, ..self }
    }

    /// The same config with another coefficient `β`.
    ///
    /// ```
    /// assert_eq!(topr_loss::KlCovConfig::kl_cov().with_coef(1.0).coef, 1.0);
    /// ```
    pub const fn with_coef(self, coef: f64) -> Self {
        Self { coef, ..self }
    }

    crate::setters::setters!(KlCovConfig, kl_cov(); checks, aggregation, max_log_ratio);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field: `ρ` outside `(0, 1]`, a negative or
    /// non-finite `coef`, a non-positive or NaN `max_log_ratio`.
    ///
    /// ```
    /// assert!(topr_loss::KlCovConfig::kl_cov().with_ratio(1.5).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        share(self.ratio, "ratio")?;
        if !(self.coef.is_finite() && self.coef >= 0.0) {
            return Err(LossError::InvalidConfig {
                field: "coef",
                value: self.coef,
                reason: "must be finite and >= 0".into(),
            });
        }
        validate::positive(self.max_log_ratio, "max_log_ratio", "the log-ratio clamp must be > 0 (commonly 20)")
    }
}

fn share(v: f64, field: &'static str) -> Result<(), LossError> {
    if !(v > 0.0 && v <= 1.0) {
        return Err(LossError::InvalidConfig {
            field,
            value: v,
            reason: "the selected share of tokens must lie in (0, 1] (verl's default is 2e-4)".into(),
        });
    }
    Ok(())
}

fn check_inputs(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    checks: Checks,
) -> Result<TokenInputs, LossError> {
    token_inputs::check(TokenArgs {
        logp,
        other: (logp_mu, "logp_mu"),
        weights: Some((advantages, "advantages")),
        mask,
        per_token_weights: true,
        checks,
    })
}

/// `[B, T]` centred covariance terms `(A_t − Ā)(log π_t − mean log π)` over the unmasked tokens,
/// detached, zero on padding; and `[B, T]` advantages.
fn covariance(x: &TokenInputs) -> Result<(Tensor, Tensor), LossError> {
    let adv = x.weights_per_token()?.f_expand(x.mask.size().as_slice(), false)?; // [B, T]
    let lp = x.logp()?.f_detach()?; // zero on padding already
    let n = x.mask.f_sum(x.kind)?.f_clamp_min(1.0)?;
    // `v − mean v` over the unmasked tokens, for `v` zero on padding.
    let centred = |v: &Tensor| -> Result<Tensor, LossError> { Ok(v.f_sub(&v.f_sum(None::<Kind>)?.f_div(&n)?)?) };
    let cov = masked_fill_zero(&centred(&masked_fill_zero(&adv, &x.mask)?)?.f_mul(&centred(&lp)?)?, &x.mask)?;
    Ok((cov, adv))
}

/// `k = max(⌊ρ N⌋, 1)` for the `N` unmasked tokens, as a 0-d f64 tensor on the device.
fn selected_count(mask: &Tensor, ratio: f64) -> Result<Tensor, LossError> {
    Ok(mask.f_sum(Kind::Double)?.f_mul_scalar(ratio)?.f_floor()?.f_clamp_min(1.0)?)
}

/// Each entry's position `[B, T]` (0 first) when the flattened `scores` are sorted stably
/// (equal scores keep their row-major order).
fn ranks(scores: &Tensor, descending: bool) -> Result<Tensor, LossError> {
    let flat = scores.f_flatten(0, -1)?;
    let (_, order) = flat.f_sort_stable(true, 0, descending)?;
    let positions = Tensor::f_arange(flat.size()[0], (Kind::Int64, flat.device()))?;
    Ok(positions.f_zeros_like()?.f_scatter(0, &order, &positions)?.f_reshape(scores.size().as_slice())?)
}

/// `r [B, T]` (clamped), `−r A`, and the checked inputs.
fn ratio_terms(x: &TokenInputs, adv: &Tensor, max_log_ratio: f64) -> Result<(Tensor, Tensor), LossError> {
    let r = x.delta.f_clamp(-max_log_ratio, max_log_ratio)?.f_exp()?;
    let unclipped = r.f_mul(adv)?.f_neg()?;
    Ok((r, unclipped))
}

/// Checks `keys` against the checked inputs.
fn check_keys(keys: &Tensor, x: &TokenInputs, logp: &Tensor) -> Result<(), LossError> {
    validate::float_tensor(keys, "keys")?;
    validate::same_shape(keys, "keys", &logp.size(), "the shape of `logp`")?;
    validate::same_device(keys, "keys", logp.device(), "logp")?;
    if x.checks.values() {
        let clean = masked_fill_zero(keys, &x.mask)?;
        validate::all_finite(&[FiniteCheck {
            clean: &clean,
            original: keys,
            argument: "keys",
            valid: Some(&x.mask),
            also: None,
        }])?;
    }
    Ok(())
}

/// What one Clip-Cov pass computes.
struct ClipCovParts {
    x: TokenInputs,
    per_token: Tensor,
    r: Tensor,
    selected: Tensor,
}

fn clip_cov_parts(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    keys: &Tensor,
    cfg: &ClipCovConfig,
) -> Result<ClipCovParts, LossError> {
    cfg.validate()?;
    let x = check_inputs(logp, logp_mu, advantages, mask, cfg.checks)?;
    check_keys(keys, &x, logp)?;
    let (cov, adv) = covariance(&x)?;
    let (r, unclipped) = ratio_terms(&x, &adv, cfg.max_log_ratio)?;
    let clipped = cfg.clip(&r)?.f_mul(&adv)?.f_neg()?;
    let clip_decides = clipped.f_gt_tensor(&unclipped)?;
    let candidate = x
        .mask
        .f_logical_and(&clip_decides.f_logical_not()?)?
        .f_logical_and(&cov.f_gt(cfg.cov_low)?)?
        .f_logical_and(&cov.f_lt(cfg.cov_high)?)?;
    // The k candidates of smallest key: a uniform random subset when the keys are i.i.d.
    let key = keys.f_detach()?.f_where_self(&candidate, &keys.f_full_like(f64::INFINITY)?)?;
    let k = selected_count(&x.mask, cfg.ratio)?;
    let selected = ranks(&key, false)?.f_to_kind(Kind::Double)?.f_lt_tensor(&k)?.f_logical_and(&candidate)?;
    let ppo = unclipped.f_maximum(&clipped)?;
    let per_token = ppo.f_zeros_like()?.f_where_self(&selected, &ppo)?;
    Ok(ClipCovParts { x, per_token, r, selected })
}

/// Clip-Cov: PPO-clip with the gradient of a few random high-covariance tokens cut.
///
/// ```text
/// r_t  = exp(clamp(log π_t − sg(log μ_t), ±M))
/// c_t  = (A_t − Ā) · (sg(log π_t) − mean sg(log π))         means over the call's unmasked tokens
/// C    = { t unmasked : c_lb < c_t < c_ub  and  clip(r_t) A_t ≥ r_t A_t (the clip does not decide) }
/// D    = the k = max(⌊ρ N⌋, 1) tokens of C with the smallest keys (all of C if fewer)
/// ℓ_t  = 0 for t ∈ D,   −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t) otherwise
/// loss = aggregate(ℓ, mask)              (token-mean by default; D still counts in N)
/// ```
///
/// **Randomness.** The paper and verl draw `D` uniformly from `C` (verl: `torch.randperm` on the
/// global generator). Here the caller passes `keys`, one value per token, and `D` is the `k`
/// candidates of smallest key (equal keys: lowest row-major index first). With i.i.d. keys,
/// e.g. `Tensor::rand_like(&logp)` after `tch::manual_seed(seed)`, `D` is a uniform random subset and the
/// call is reproducible; no global state is touched and nothing is read back to the host. To
/// reproduce verl's draw exactly, seed both with the same value and give the candidate at
/// row-major position `j` of `C` the key `p` where `perm[p] = j` for `perm = randperm(|C|)` (the
/// test `clip_cov_matches_verl_with_the_same_seed` does this).
///
/// **Coupling.** `c_t` and `k` depend on every token of the call: not split-invariant (see the
/// module docs).
///
/// Reference: Cui et al., arXiv 2505.22617, §5 (Clip-Cov); verl `compute_policy_loss_clip_cov`
/// (`loss_mode=clip_cov`). verl takes `Ā` and the mean log-prob with `masked_mean`, whose
/// denominator carries `+1e-8` (a difference only for covariances within ~1e-8 of a band end),
/// and does not clamp `δ`.
///
/// # Arguments
/// * `logp`, `logp_mu` — `[B, T]` per-token log-probs of the policy (differentiable) and of the
///   policy that sampled the data (detached).
/// * `advantages` — `[B]` (broadcast over tokens) or `[B, T]`.
/// * `mask` — `[B, T]`, bool, integer or 0/1 floating.
/// * `keys` — `[B, T]` floating random keys (detached; padding may hold anything).
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`] (for
/// `keys` too); [`LossError::NonFiniteLoss`] if advantages are too large for the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{clip_cov_loss, ClipCovConfig};
///
/// let logp = Tensor::from_slice2(&[[-0.5f64, -3.0], [-0.5, -3.0]]).set_requires_grad(true);
/// let mask = Tensor::from_slice2(&[[true, true], [true, true]]);
/// let adv = Tensor::from_slice(&[1.0f64, -1.0]);
/// // Covariances: (1)(1.25), (1)(−1.25), (−1)(1.25), (−1)(−1.25): tokens 0 and 3 lie in (1, 5).
/// let keys = Tensor::from_slice2(&[[0.9f64, 0.0], [0.0, 0.1]]); // token 3 has the smaller key
/// let cfg = ClipCovConfig::clip_cov().with_ratio(0.25); // k = ⌊0.25 · 4⌋ = 1
/// let loss = clip_cov_loss(&logp, &logp.detach(), &adv, &mask, &keys, &cfg)?;
/// loss.backward();
/// // On-policy PPO gives −A/4 per token; token 3 (the last) is cut.
/// assert_eq!(Vec::<f64>::try_from(&logp.grad().flatten(0, -1))?, vec![-0.25, -0.25, 0.25, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn clip_cov_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    keys: &Tensor,
    cfg: &ClipCovConfig,
) -> Result<Tensor, LossError> {
    let p = clip_cov_parts(logp, logp_mu, advantages, mask, keys, cfg)?;
    validate::finite_loss(p.x.reduce_tokens(&p.per_token, cfg.aggregation, &Normalizer::local())?, cfg.checks)
}

/// [`clip_cov_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding and
/// on the cut tokens) and its [`PpoDiagnostics`] over unmasked tokens: `clip_fraction` is the
/// share of tokens cut by the covariance rule (verl's `pg_clipfrac` for `clip_cov`), not of those
/// PPO's clip decides.
///
/// The counts of `norm` make the aggregation global; the selection stays per call.
///
/// Reference: as [`clip_cov_loss`].
///
/// # Errors
/// As [`clip_cov_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{clip_cov_loss_output, ClipCovConfig, Normalizer};
/// let logp = Tensor::from_slice2(&[[-0.5f64, -3.0], [-0.5, -3.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, true]]);
/// let adv = Tensor::from_slice(&[1.0f64, -1.0]);
/// let cfg = ClipCovConfig::clip_cov().with_ratio(0.5); // k = 2: both candidates
/// let out = clip_cov_loss_output(&logp, &logp, &adv, &mask, &logp.rand_like(), &cfg, &Normalizer::local())?;
/// assert_eq!(out.diagnostics.read()?.clip_fraction, 0.5);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn clip_cov_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    keys: &Tensor,
    cfg: &ClipCovConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let p = clip_cov_parts(logp, logp_mu, advantages, mask, keys, cfg)?;
    let loss = validate::finite_loss(p.x.reduce_tokens(&p.per_token, cfg.aggregation, norm)?, cfg.checks)?;
    let diagnostics = ppo_diagnostics(&p.r, &p.selected, &p.x.mask.f_zeros_like()?, &p.x.mask)?;
    Ok(LossOutput { loss, terms: p.x.zero_padding(&p.per_token)?, diagnostics })
}

/// What one KL-Cov pass computes.
struct KlCovParts {
    x: TokenInputs,
    per_token: Tensor,
    r: Tensor,
    selected: Tensor,
}

fn kl_cov_parts(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &KlCovConfig,
) -> Result<KlCovParts, LossError> {
    cfg.validate()?;
    let x = check_inputs(logp, logp_mu, advantages, mask, cfg.checks)?;
    let (cov, adv) = covariance(&x)?;
    let (r, unclipped) = ratio_terms(&x, &adv, cfg.max_log_ratio)?;
    // Padding ranks last; among equal covariances the lower row-major index comes first.
    let score = cov.f_where_self(&x.mask, &cov.f_full_like(f64::NEG_INFINITY)?)?;
    let k = selected_count(&x.mask, cfg.ratio)?;
    let selected = ranks(&score, true)?.f_to_kind(Kind::Double)?.f_lt_tensor(&k)?.f_logical_and(&x.mask)?;
    let penalised = unclipped.f_add(&x.delta.f_abs()?.f_mul_scalar(cfg.coef)?)?;
    let per_token = penalised.f_where_self(&selected, &unclipped)?;
    Ok(KlCovParts { x, per_token, r, selected })
}

/// KL-Cov: the unclipped importance-weighted policy gradient, with a `|δ|` penalty on the tokens
/// of largest covariance.
///
/// ```text
/// r_t  = exp(clamp(δ_t, ±M))              δ_t = log π_t − sg(log μ_t)
/// c_t  = (A_t − Ā) · (sg(log π_t) − mean sg(log π))          means over the call's unmasked tokens
/// K    = the k = max(⌊ρ N⌋, 1) unmasked tokens of largest c_t (equal c_t: lowest row-major index first)
/// ℓ_t  = −r_t A_t + β |δ_t|  for t ∈ K,     −r_t A_t otherwise      (no ratio clip)
/// loss = aggregate(ℓ, mask)               (token-mean by default)
/// ```
///
/// **Coupling.** `c_t` and `k` depend on every token of the call: not split-invariant (see the
/// module docs).
///
/// Reference: Cui et al., arXiv 2505.22617, §5 (KL-Cov); verl `compute_policy_loss_kl_cov`
/// (`loss_mode=kl_cov`). verl selects with `torch.topk`, whose order among equal covariances is
/// unspecified, and does not clamp `δ`.
///
/// # Arguments
/// As [`clip_cov_loss`], without `keys`.
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config; the tensor checks of [`LossError`];
/// [`LossError::NonFiniteLoss`] if advantages are too large for the compute dtype.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_cov_loss, KlCovConfig};
///
/// let logp = Tensor::from_slice2(&[[-0.5f64, -3.0], [-0.5, -3.0]]).set_requires_grad(true);
/// let logp_mu = Tensor::from_slice2(&[[-1.0f64, -3.0], [-0.5, -3.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, true]]);
/// let adv = Tensor::from_slice(&[1.0f64, -1.0]);
/// // Token 0 has the largest covariance (tied with token 3, but first): it gets β|δ| = 0.1 · 0.5.
/// let cfg = KlCovConfig::kl_cov().with_ratio(0.25);
/// let loss = kl_cov_loss(&logp, &logp_mu, &adv, &mask, &cfg)?;
/// let r0 = 0.5f64.exp();
/// let want = (-r0 + 0.05 - 1.0 + 1.0 + 1.0) / 4.0;
/// assert!((loss.double_value(&[]) - want).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn kl_cov_loss(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &KlCovConfig,
) -> Result<Tensor, LossError> {
    let p = kl_cov_parts(logp, logp_mu, advantages, mask, cfg)?;
    validate::finite_loss(p.x.reduce_tokens(&p.per_token, cfg.aggregation, &Normalizer::local())?, cfg.checks)
}

/// [`kl_cov_loss`] with the counts of `norm`, its per-token terms (`[B, T]`, zero on padding)
/// and its [`PpoDiagnostics`] over unmasked tokens: `clip_fraction` is the share of penalised
/// tokens.
///
/// The counts of `norm` make the aggregation global; the selection stays per call.
///
/// Reference: as [`kl_cov_loss`].
///
/// # Errors
/// As [`kl_cov_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{kl_cov_loss_output, KlCovConfig, Normalizer};
/// let logp = Tensor::from_slice2(&[[-0.5f64, -3.0], [-0.5, -3.0]]);
/// let mask = Tensor::from_slice2(&[[true, true], [true, true]]);
/// let adv = Tensor::from_slice(&[1.0f64, -1.0]);
/// let out = kl_cov_loss_output(&logp, &logp, &adv, &mask, &KlCovConfig::kl_cov(), &Normalizer::local())?;
/// assert_eq!(out.diagnostics.read()?.clip_fraction, 0.25); // k = max(⌊2e-4 · 4⌋, 1) = 1 of 4
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn kl_cov_loss_output(
    logp: &Tensor,
    logp_mu: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &KlCovConfig,
    norm: &Normalizer,
) -> Result<LossOutput<PpoDiagnostics>, LossError> {
    let p = kl_cov_parts(logp, logp_mu, advantages, mask, cfg)?;
    let loss = validate::finite_loss(p.x.reduce_tokens(&p.per_token, cfg.aggregation, norm)?, cfg.checks)?;
    let diagnostics = ppo_diagnostics(&p.r, &p.selected, &p.x.mask.f_zeros_like()?, &p.x.mask)?;
    Ok(LossOutput { loss, terms: p.x.zero_padding(&p.per_token)?, diagnostics })
}
