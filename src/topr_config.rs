//! The settings of the off-policy REINFORCE family: the truncation limits, the baseline and
//! the tie rule ([`ToprConfig`], [`TieRule`]), and the per-entry clamp they define, shared by the
//! losses (`topr.rs`, `topr_token.rs`) and their diagnostics (`diagnostics.rs`).

use crate::checks::Checks;
use crate::error::LossError;
use crate::validate;
use tch::Tensor;

/// Truncation limits and baseline of the off-policy REINFORCE family.
///
/// A sample whose shifted reward `R − baseline` is `≥ 0` (`> 0` under [`TieRule::Tapered`]) is
/// weighted by `[π/μ]` truncated to `[a_pos, b_pos]`; the others by `[π/μ]` truncated to
/// `[a_neg, b_neg]`. Limits satisfy `0 ≤ a ≤ b ≤ ∞` with `a` finite; `baseline` is finite.
///
/// `Default` is canonical TOPR, `(1, 1, 0, 1)` with `c = 0` and ties positive. Build other
/// settings from a preset with the `with_…` methods (the struct is `#[non_exhaustive]`, so new
/// fields are not breaking changes).
///
/// Reference: Le Roux, Bellemare et al., arXiv 2503.14286, §3 and Table 1.
///
/// # Example
/// ```
/// use topr_loss::ToprConfig;
///
/// let cfg = ToprConfig::canonical().with_baseline(-0.5);
/// assert_eq!((cfg.a_pos, cfg.b_pos, cfg.a_neg, cfg.b_neg), (1.0, 1.0, 0.0, 1.0));
/// assert!(cfg.validate().is_ok());
/// assert!(cfg.with_negative_limits(2.0, 1.0).validate().is_err()); // a− > b−
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct ToprConfig {
    /// Lower limit `a+` of the weight of samples with `R − c ≥ 0`.
    pub a_pos: f64,
    /// Upper limit `b+` of the weight of samples with `R − c ≥ 0` (may be `f64::INFINITY`).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub b_pos: f64,
    /// Lower limit `a−` of the weight of samples with `R − c < 0`.
    pub a_neg: f64,
    /// Upper limit `b−` of the weight of samples with `R − c < 0` (may be `f64::INFINITY`).
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_support::limit"))]
    pub b_neg: f64,
    /// The baseline `c` subtracted from every reward.
    pub baseline: f64,
    /// Which branch a sample with `R − c = 0` belongs to.
    pub tie: TieRule,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for ToprConfig {
    fn default() -> Self {
        Self::canonical()
    }
}

impl ToprConfig {
    const fn limits(a_pos: f64, b_pos: f64, a_neg: f64, b_neg: f64) -> Self {
        Self { a_pos, b_pos, a_neg, b_neg, baseline: 0.0, tie: TieRule::Positive, checks: Checks::Full }
    }

    /// Canonical TOPR `(a+, b+, a−, b−) = (1, 1, 0, 1)`: an SFT update on positives (weight 1,
    /// whatever the ratio) and a truncated-IS update on negatives (weight `min(π/μ, 1)`, which
    /// fades as π moves away from them). Le Roux, Bellemare et al., arXiv 2503.14286.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// assert_eq!(ToprConfig::canonical(), ToprConfig::default());
    /// ```
    pub const fn canonical() -> Self {
        Self::limits(1.0, 1.0, 0.0, 1.0)
    }

    /// Naive off-policy REINFORCE `(1, 1, 1, 1)`: weight 1 everywhere. With negative rewards its
    /// loss is unbounded below: it drives `log π` of sampled negatives to `−∞`.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// let c = ToprConfig::naive_reinforce();
    /// assert_eq!((c.a_pos, c.b_pos, c.a_neg, c.b_neg), (1.0, 1.0, 1.0, 1.0));
    /// ```
    pub const fn naive_reinforce() -> Self {
        Self::limits(1.0, 1.0, 1.0, 1.0)
    }

    /// Supervised fine-tuning on positives `(1, 1, 0, 0)`: negatives contribute nothing.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// let c = ToprConfig::sft();
    /// assert_eq!((c.a_neg, c.b_neg), (0.0, 0.0));
    /// ```
    pub const fn sft() -> Self {
        Self::limits(1.0, 1.0, 0.0, 0.0)
    }

    /// Truncated importance sampling `(0, 1, 0, 1)`: weight `min(π/μ, 1)` on every sample.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// let c = ToprConfig::tis();
    /// assert_eq!((c.a_pos, c.b_pos, c.a_neg, c.b_neg), (0.0, 1.0, 0.0, 1.0));
    /// ```
    pub const fn tis() -> Self {
        Self::limits(0.0, 1.0, 0.0, 1.0)
    }

    /// Plain importance sampling `(0, ∞, 0, ∞)`: unbiased, unbounded weight `π/μ`. The loss
    /// returns [`LossError::Overflow`] rather than `inf` when the weight exceeds the compute dtype.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// assert!(ToprConfig::importance_sampling().b_pos.is_infinite());
    /// ```
    pub const fn importance_sampling() -> Self {
        Self::limits(0.0, f64::INFINITY, 0.0, f64::INFINITY)
    }

    /// The same limits with baseline `c`.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// assert_eq!(ToprConfig::tis().with_baseline(0.3).baseline, 0.3);
    /// ```
    pub const fn with_baseline(self, baseline: f64) -> Self {
        Self { baseline, ..self }
    }

    /// The same config with the positive branch's limits `(a+, b+)`.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// let c = ToprConfig::canonical().with_positive_limits(0.5, 2.0);
    /// assert_eq!((c.a_pos, c.b_pos), (0.5, 2.0));
    /// ```
    pub const fn with_positive_limits(self, a_pos: f64, b_pos: f64) -> Self {
        Self { a_pos, b_pos, ..self }
    }

    /// The same config with the negative branch's limits `(a−, b−)`.
    ///
    /// ```
    /// use topr_loss::ToprConfig;
    /// let c = ToprConfig::canonical().with_negative_limits(0.0, 2.0);
    /// assert_eq!((c.a_neg, c.b_neg), (0.0, 2.0));
    /// ```
    pub const fn with_negative_limits(self, a_neg: f64, b_neg: f64) -> Self {
        Self { a_neg, b_neg, ..self }
    }

    /// The same config with another tie rule.
    ///
    /// ```
    /// use topr_loss::{TieRule, ToprConfig};
    /// assert_eq!(ToprConfig::canonical().with_tie(TieRule::Tapered).tie, TieRule::Tapered);
    /// ```
    pub const fn with_tie(self, tie: TieRule) -> Self {
        Self { tie, ..self }
    }

    crate::setters::setters!(ToprConfig, canonical(); checks);

    /// Checks the config: every limit non-negative and not NaN, `a ≤ b`, `a` finite, baseline finite.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] naming the field.
    ///
    /// ```
    /// use topr_loss::{LossError, ToprConfig};
    /// let bad = ToprConfig::default().with_negative_limits(0.0, f64::NAN);
    /// assert!(matches!(bad.validate(), Err(LossError::InvalidConfig { field: "b_neg", .. })));
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        validate::limits(self.a_pos, self.b_pos, "a_pos", "b_pos")?;
        validate::limits(self.a_neg, self.b_neg, "a_neg", "b_neg")?;
        validate::finite_field(self.baseline, "baseline")
    }
}

/// Which branch a sample whose shifted reward is exactly zero belongs to. It carries no weight
/// either way (`R' = 0`), but the choice shows in diagnostics and matters when the rewards are
/// used only for the branch (see the docs' table of published implementations).
///
/// ```
/// use topr_loss::{TieRule, ToprTokenConfig};
/// assert_eq!(ToprTokenConfig::paper().topr.tie, TieRule::Positive);
/// assert_eq!(ToprTokenConfig::trinity().topr.tie, TieRule::Tapered);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum TieRule {
    /// `R − c ≥ 0` is positive: the paper's rule.
    #[default]
    Positive,
    /// `R − c > 0` is positive; ties are tapered with the negative limits (Trinity-RFT, ROLL).
    Tapered,
}

/// `(ln a, ln b, on)` for one branch: `ln 0 = −∞` and `ln ∞ = ∞` leave that side unclamped;
/// `b = 0` (`T ≡ 0`) is switched off by `on = 0`, with finite dummy limits.
fn log_limits(a: f64, b: f64) -> (f64, f64, f64) {
    if b == 0.0 { (0.0, 0.0, 0.0) } else { (a.ln(), b.ln(), 1.0) }
}

/// `d = clamp(s, ln a±, ln b±)` with the limits picked per entry by `positive`, and `on`
/// (0 where the branch has `b = 0`, i.e. `T ≡ 0` and weight 0; else 1). The limits take the shape
/// of `positive` (`[B]` or `[B, 1]`), so this costs one clamp over `s`.
pub(crate) fn branch_clamp(s: &Tensor, positive: &Tensor, cfg: &ToprConfig) -> Result<(Tensor, Tensor), LossError> {
    let (lo_p, hi_p, on_p) = log_limits(cfg.a_pos, cfg.b_pos);
    let (lo_n, hi_n, on_n) = log_limits(cfg.a_neg, cfg.b_neg);
    let options = (s.f_kind()?, s.device());
    let pick = |p: f64, n: f64| -> Result<Tensor, LossError> {
        let n = Tensor::f_scalar_tensor(n, options)?;
        Ok(Tensor::f_scalar_tensor(p, options)?.f_where_self(positive, &n)?)
    };
    let (lo, hi, on) = (pick(lo_p, lo_n)?, pick(hi_p, hi_n)?, pick(on_p, on_n)?);
    Ok((s.f_clamp_tensor(Some(&lo), Some(&hi))?, on))
}
