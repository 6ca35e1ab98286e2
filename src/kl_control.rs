//! Controllers of the KL coefficient `β`: fixed, or adapted towards a target KL (Ziegler et al.,
//! arXiv 1909.08593, §2.2), as verl's `FixedKLController` and `AdaptiveKLController`.
//!
//! ```text
//! fixed:     β stays
//! adaptive:  e = clip(kl / target − 1, −0.2, 0.2)      β ← β (1 + e · n_steps / horizon)
//! ```
//!
//! Plain host state (`f64`), updated once per training step with the measured KL (for the reward
//! penalty, [`crate::KlRewards::kl_mean`]) and the number of samples of the step (verl passes the
//! batch size).

use crate::error::LossError;

/// A coefficient that never changes (verl's `FixedKLController`, `kl_ctrl.type=fixed`).
///
/// ```
/// use topr_loss::FixedKlController;
/// let mut c = FixedKlController::new(0.05)?;
/// assert_eq!(c.update(3.0, 256)?, 0.05);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct FixedKlController {
    /// The coefficient `β`.
    pub value: f64,
}

impl FixedKlController {
    /// A controller holding `coef`.
    ///
    /// Reference: verl `FixedKLController` (`algorithm.kl_ctrl.kl_coef`, default 0.001).
    ///
    /// # Errors
    /// [`LossError::InvalidArgument`] for a negative or non-finite `coef`.
    ///
    /// ```
    /// assert!(topr_loss::FixedKlController::new(-1.0).is_err());
    /// ```
    pub fn new(coef: f64) -> Result<Self, LossError> {
        non_negative(coef, "coef")?;
        Ok(Self { value: coef })
    }

    /// Does nothing to `β` (checks `current_kl`, so that a NaN is caught here as with the adaptive
    /// controller) and returns it.
    ///
    /// # Errors
    /// [`LossError::InvalidArgument`] for a non-finite `current_kl`.
    ///
    /// ```
    /// let mut c = topr_loss::FixedKlController::new(0.1)?;
    /// assert_eq!(c.update(0.0, 1)?, 0.1);
    /// assert!(c.update(f64::NAN, 1).is_err());
    /// # Ok::<(), topr_loss::LossError>(())
    /// ```
    pub fn update(&mut self, current_kl: f64, n_steps: u64) -> Result<f64, LossError> {
        let _ = n_steps;
        finite(current_kl, "current_kl")?;
        Ok(self.value)
    }
}

/// A coefficient adapted towards a target KL (Ziegler et al., arXiv 1909.08593, §2.2; verl's
/// `AdaptiveKLController`, `kl_ctrl.type=adaptive`).
///
/// ```text
/// e = clip(current_kl / target − 1, −0.2, 0.2)
/// β ← β · (1 + e · n_steps / horizon)
/// ```
///
/// Above the target `β` grows, below it shrinks, by at most 20 % per `horizon` steps. As in the
/// paper and verl, `n_steps / horizon` is not bounded; an update that would make `β` negative
/// (`n_steps > 5 · horizon` below the target), which verl would apply, is an error here: keep
/// `n_steps` (the samples per update) well below `horizon` (verl's default 10 000).
///
/// # Example
/// ```
/// use topr_loss::AdaptiveKlController;
/// let mut c = AdaptiveKlController::new(0.1, 6.0, 10_000.0)?;
/// // KL twice the target: the error is clipped at +0.2; 256 samples move β by 0.2 · 256 / 10⁴.
/// let beta = c.update(12.0, 256)?;
/// assert!((beta - 0.1 * (1.0 + 0.2 * 0.0256)).abs() < 1e-15);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct AdaptiveKlController {
    /// The current coefficient `β`.
    pub value: f64,
    /// The target KL (> 0; verl's `kl_ctrl.target_kl`, default 0.1).
    pub target: f64,
    /// The horizon (> 0; verl's `kl_ctrl.horizon`, default 10 000).
    pub horizon: f64,
}

impl AdaptiveKlController {
    /// A controller starting at `init_coef`.
    ///
    /// Reference: verl `AdaptiveKLController(init_kl_coef, target_kl, horizon)`.
    ///
    /// # Errors
    /// [`LossError::InvalidArgument`] naming `init_coef` (negative or non-finite), `target` or
    /// `horizon` (not finite and > 0).
    ///
    /// ```
    /// use topr_loss::{AdaptiveKlController, LossError};
    /// let e = AdaptiveKlController::new(0.1, 0.0, 10_000.0).unwrap_err();
    /// assert!(matches!(e, LossError::InvalidArgument { argument: "target", .. }));
    /// ```
    pub fn new(init_coef: f64, target: f64, horizon: f64) -> Result<Self, LossError> {
        let c = Self { value: init_coef, target, horizon };
        c.validate("init_coef")?;
        Ok(c)
    }

    /// Moves `β` towards the target and returns the new value.
    ///
    /// ```text
    /// β ← β · (1 + clip(current_kl / target − 1, −0.2, 0.2) · n_steps / horizon)
    /// ```
    ///
    /// # Errors
    /// [`LossError::InvalidArgument`] for a non-finite `current_kl`, for `n_steps` that would make
    /// `β` negative or infinite, or for fields made invalid since [`AdaptiveKlController::new`]
    /// (`value`, `target`, `horizon`); `β` is then unchanged.
    ///
    /// ```
    /// let mut c = topr_loss::AdaptiveKlController::new(1.0, 1.0, 100.0)?;
    /// assert_eq!(c.update(1.0, 10)?, 1.0);          // on target: unchanged
    /// assert!((c.update(0.9, 10)? - 0.99).abs() < 1e-15); // 10 % below: β · (1 − 0.1 · 0.1)
    /// # Ok::<(), topr_loss::LossError>(())
    /// ```
    pub fn update(&mut self, current_kl: f64, n_steps: u64) -> Result<f64, LossError> {
        self.validate("value")?;
        finite(current_kl, "current_kl")?;
        let error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
        let value = self.value * (1.0 + error * n_steps as f64 / self.horizon);
        if !(value.is_finite() && value >= 0.0) {
            return Err(LossError::InvalidArgument {
                argument: "n_steps",
                value: n_steps as f64,
                reason: format!("the coefficient would become {value}; keep n_steps well below horizon"),
            });
        }
        self.value = value;
        Ok(value)
    }

    fn validate(&self, value_name: &'static str) -> Result<(), LossError> {
        non_negative(self.value, value_name)?;
        for (v, argument) in [(self.target, "target"), (self.horizon, "horizon")] {
            if !(v.is_finite() && v > 0.0) {
                return Err(LossError::InvalidArgument { argument, value: v, reason: "must be finite and > 0".into() });
            }
        }
        Ok(())
    }
}

fn non_negative(v: f64, argument: &'static str) -> Result<(), LossError> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(LossError::InvalidArgument { argument, value: v, reason: "must be finite and >= 0".into() });
    }
    Ok(())
}

fn finite(v: f64, argument: &'static str) -> Result<(), LossError> {
    if !v.is_finite() {
        return Err(LossError::InvalidArgument { argument, value: v, reason: "must be finite".into() });
    }
    Ok(())
}
