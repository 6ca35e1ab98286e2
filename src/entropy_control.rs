//! An adaptive coefficient for the entropy bonus: Skywork-OR1's adaptive entropy control
//! (MAGIC, arXiv 2505.22312), as its `EntController`.
//!
//! ```text
//! e_k      the policy's entropy measured at step k (Skywork: the sampled-token NLL, below)
//! c_{k+1}  = clip(c_k + Δ, c_min, c_max)   if e_k < target
//!          = clip(c_k − Δ, c_min, c_max)   otherwise
//! on_{k+1} = 1{e_k < target}                (on_0 = 1: the first step has the bonus)
//! bonus at step k+1:  entropy_loss(H, mask, coef = c_{k+1} · on_{k+1})
//! ```
//!
//! Plain host state (`f64`), updated once per training step with one measured entropy. The
//! coefficient rises while the entropy stays below the target and falls once it is reached; the
//! bonus itself is switched off while the entropy is at or above the target, so the coefficient
//! only acts against a collapse, never pushes the entropy up past its target.

use crate::error::LossError;

/// The entropy bonus's coefficient adapted to keep the policy's entropy at a target
/// (Skywork-OR1's adaptive entropy control).
///
/// ```text
/// update(e):  c ← clip(c + Δ, min, max)  if e < target,  else clip(c − Δ, min, max)
///             on ← (e < target)
/// coefficient() = c · on                  the `coef` of the next step's entropy bonus
/// ```
///
/// **`<`, not `≤`.** An entropy exactly at the target lowers the coefficient and switches the
/// bonus off, as the peer's `current_ent < self.target_ent` does in both places. The paper writes
/// the realised coefficient as `c_k · 1{e_k ≤ target}` (not checked against its text); the two
/// differ only at equality, which a measured entropy essentially never hits.
///
/// **Which entropy.** Skywork-OR1 feeds `update` the *sampled-token NLL* of the step's batch,
/// `e = −Σ m log μ / Σ m`: the mean of `−log μ(y_t)` over every response token of the whole
/// batch, from the log-probs the trainer recomputes before the actor update (its
/// `old_log_probs`), logged as `actor/entropy_loss`. That is a Monte Carlo estimate of the
/// policy's entropy, not the full-vocabulary entropy `H_t = −Σ_v π log π` that the bonus itself
/// maximises (from [`crate::token_logprobs`] with `LogProbConfig::with_entropy(true)`). Both are
/// in nats; pass whichever you measure, but the target is tuned for the one you pass.
///
/// **Order.** The bonus of step `k` uses the coefficient as it was at the start of the step;
/// `update` is called once at the end of the step with that step's measured entropy (Skywork
/// snapshots the controller before the update and calls `update` after it). The first step uses
/// `init` with the bonus on.
///
/// **Use with [`crate::entropy_loss`]:** `EntropyConfig::bonus().with_coef(ctrl.coefficient())`,
/// i.e. `value() · enabled()` (Skywork's `entropy_coeff * entropy_loss_enabled`), with the policy
/// loss's mask, aggregation and [`crate::Normalizer`] (Skywork: a token mean per micro-batch).
///
/// Reference: He et al., *Skywork Open Reasoner 1 Technical Report*, arXiv 2505.22312, the
/// adaptive entropy control of MAGIC's loss; SkyworkAI/Skywork-OR1 `verl/trainer/ppo/core_algos.py`
/// `EntController(init_ent_coef, max_ent_coef, min_ent_coef, delta_ent_coef, target_ent,
/// use_adapt_ent)` and its use in `ray_trainer.py` (`update(metrics["actor/entropy_loss"])`) and
/// `dp_actor.py` (`pg_loss - entropy_coeff * entropy_loss_enabled * masked_mean(entropy)`); config
/// `actor_rollout_ref.actor.adaptive_entropy.{enabled, target_entropy, delta_ent_coef,
/// min_ent_coef, max_ent_coef}` with `actor.entropy_coeff` as `init`. Not in verl 0.9.1, TRL or
/// OpenRLHF, which offer a fixed coefficient only.
///
/// # Example
/// ```
/// use tch::{Kind, Tensor};
/// use topr_loss::{entropy_loss, AdaptiveEntropyController, EntropyConfig};
///
/// // Skywork-OR1's 7B settings: c₀ = 0.005, target 0.2, Δ = 0.001, c ∈ [0, 0.5].
/// let mut ctrl = AdaptiveEntropyController::new(0.005, 0.2, 0.001, 0.0, 0.5)?;
/// let mask = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
/// let h = Tensor::from_slice2(&[[0.3f64, 0.1, 0.0], [0.2, 0.05, 0.15]]).set_requires_grad(true);
/// // This step's bonus, with the coefficient as it stands.
/// let bonus = entropy_loss(&h, &mask, &EntropyConfig::bonus().with_coef(ctrl.coefficient()))?;
/// bonus.backward();
/// // The step's sampled-token NLL, from μ's log-probs over every response token of the batch.
/// let logp_mu = Tensor::from_slice2(&[[-0.1f64, -0.2, 0.0], [-0.05, -0.1, -0.15]]);
/// let m = mask.to_kind(Kind::Double);
/// let measured = -((&logp_mu * &m).sum(Kind::Double) / m.sum(Kind::Double)).double_value(&[]);
/// assert!((measured - 0.12).abs() < 1e-12);
/// // Below the target: the coefficient rises by Δ and the next step keeps the bonus.
/// assert!((ctrl.update(measured)? - 0.006).abs() < 1e-15);
/// assert!(ctrl.enabled());
/// // At or above it: the coefficient falls and the bonus is off until the entropy drops again.
/// assert_eq!(ctrl.update(0.2)?, 0.0);
/// assert!(!ctrl.enabled() && (ctrl.value() - 0.005).abs() < 1e-15);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct AdaptiveEntropyController {
    /// The coefficient `c`, in `[min, max]`.
    value: f64,
    /// Whether the bonus applies at the next step (`e < target` at the last update; true before
    /// the first).
    enabled: bool,
    /// The target entropy.
    target: f64,
    /// The step `Δ ≥ 0`.
    delta: f64,
    /// The bounds `0 ≤ min ≤ max`.
    min: f64,
    max: f64,
}

impl AdaptiveEntropyController {
    /// A controller starting at `init`, with the bonus on.
    ///
    /// ```text
    /// c₀ = init ∈ [min, max]    on₀ = 1
    /// ```
    ///
    /// Reference: Skywork-OR1 `EntController.__init__` (`value = init_ent_coef`,
    /// `entropy_loss_enabled = 1`); its yaml defaults are target 0, Δ 0.001, `[0, 0.5]`.
    ///
    /// # Arguments
    /// * `init` — the starting coefficient `c₀` (Skywork's `actor.entropy_coeff`).
    /// * `target` — the target entropy, in nats, of the quantity passed to
    ///   [`update`](Self::update) (finite).
    /// * `delta` — `Δ ≥ 0`, the change per step (0 keeps `c` fixed but still switches the bonus).
    /// * `min`, `max` — the bounds of `c`, `0 ≤ min ≤ max`, finite.
    ///
    /// # Errors
    /// [`LossError::InvalidArgument`] naming `target` (not finite), `delta` (negative or not
    /// finite), `min` (negative, not finite, or above `max`), `max` (not finite) or `init` (not
    /// in `[min, max]`; the peer would keep an out-of-range start until the first update clips
    /// it).
    ///
    /// ```
    /// use topr_loss::{AdaptiveEntropyController, LossError};
    /// let e = AdaptiveEntropyController::new(0.6, 0.2, 0.001, 0.0, 0.5).unwrap_err();
    /// assert!(matches!(e, LossError::InvalidArgument { argument: "init", .. }));
    /// ```
    pub fn new(init: f64, target: f64, delta: f64, min: f64, max: f64) -> Result<Self, LossError> {
        let c = Self { value: init, enabled: true, target, delta, min, max };
        c.check("init")?;
        Ok(c)
    }

    /// Skywork-OR1's settings of its 7B run (`or1_script/train/run_ds_7b.sh`):
    /// `c₀ = 0.005`, target 0.2, `Δ = 0.001`, `c ∈ [0, 0.5]`.
    ///
    /// ```
    /// let c = topr_loss::AdaptiveEntropyController::skywork();
    /// assert_eq!((c.value(), c.target(), c.delta(), c.min(), c.max()), (0.005, 0.2, 0.001, 0.0, 0.5));
    /// ```
    pub const fn skywork() -> Self {
        Self { value: 0.005, enabled: true, target: 0.2, delta: 0.001, min: 0.0, max: 0.5 }
    }

    /// Moves the coefficient by `Δ` towards keeping `entropy` at the target, sets whether the
    /// next step has the bonus, and returns the next step's [`coefficient`](Self::coefficient).
    ///
    /// ```text
    /// c ← clip(c + Δ, min, max) if entropy < target, else clip(c − Δ, min, max)
    /// on ← entropy < target
    /// returns c · on
    /// ```
    ///
    /// Reference: Skywork-OR1 `EntController.update` (with `use_adapt_ent=True`; with it false
    /// the peer never changes anything: use a fixed [`crate::EntropyConfig`] coefficient instead).
    ///
    /// # Errors
    /// [`LossError::InvalidArgument`] naming `entropy` when it is not finite or is negative
    /// (beyond [`crate::LOG_PROB_TOLERANCE`], for rounding: an entropy and a sampled-token NLL are
    /// `≥ 0`; a negative value is usually the mean log-probability itself, not its negation), or
    /// naming a field (`value`, `target`, `delta`, `min`, `max`) of a state read from a record that
    /// [`new`](Self::new) would refuse; the state is then unchanged.
    ///
    /// ```
    /// let mut c = topr_loss::AdaptiveEntropyController::new(0.499, 1.0, 0.01, 0.0, 0.5)?;
    /// assert_eq!(c.update(0.5)?, 0.5); // clipped at max
    /// assert!(c.update(-0.3).is_err()); // a mean log-probability, not an entropy
    /// assert_eq!(c.value(), 0.5);
    /// # Ok::<(), topr_loss::LossError>(())
    /// ```
    pub fn update(&mut self, entropy: f64) -> Result<f64, LossError> {
        self.check("value")?;
        if !(entropy.is_finite() && entropy >= -crate::LOG_PROB_TOLERANCE) {
            return Err(LossError::InvalidArgument {
                argument: "entropy",
                value: entropy,
                reason: "a measured entropy must be finite and >= 0 (pass −mean log π, the sampled-token NLL)".into(),
            });
        }
        let below = entropy < self.target;
        let step = if below { self.delta } else { -self.delta };
        self.value = (self.value + step).clamp(self.min, self.max);
        self.enabled = below;
        Ok(self.coefficient())
    }

    /// The coefficient of the next step's entropy bonus: `value() · enabled()`, 0 while the bonus
    /// is off.
    ///
    /// ```
    /// let c = topr_loss::AdaptiveEntropyController::skywork();
    /// assert_eq!(c.coefficient(), 0.005); // on before the first update
    /// ```
    pub fn coefficient(&self) -> f64 {
        if self.enabled { self.value } else { 0.0 }
    }

    /// The coefficient `c`, whether the bonus is on or not (Skywork's `actor/entropy_coeff`).
    ///
    /// ```
    /// assert_eq!(topr_loss::AdaptiveEntropyController::skywork().value(), 0.005);
    /// ```
    pub fn value(&self) -> f64 {
        self.value
    }

    /// Whether the next step has the bonus: the last measured entropy was below the target (true
    /// before the first update). Skywork's `entropy_loss_enabled`.
    ///
    /// ```
    /// assert!(topr_loss::AdaptiveEntropyController::skywork().enabled());
    /// ```
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The target entropy.
    ///
    /// ```
    /// assert_eq!(topr_loss::AdaptiveEntropyController::skywork().target(), 0.2);
    /// ```
    pub fn target(&self) -> f64 {
        self.target
    }

    /// The change `Δ` per update.
    ///
    /// ```
    /// assert_eq!(topr_loss::AdaptiveEntropyController::skywork().delta(), 0.001);
    /// ```
    pub fn delta(&self) -> f64 {
        self.delta
    }

    /// The lower bound of `c`.
    ///
    /// ```
    /// assert_eq!(topr_loss::AdaptiveEntropyController::skywork().min(), 0.0);
    /// ```
    pub fn min(&self) -> f64 {
        self.min
    }

    /// The upper bound of `c`.
    ///
    /// ```
    /// assert_eq!(topr_loss::AdaptiveEntropyController::skywork().max(), 0.5);
    /// ```
    pub fn max(&self) -> f64 {
        self.max
    }

    /// Checks every field, as [`new`](Self::new) does its arguments: for a controller read from a
    /// record (the `serde` feature), before the first [`update`](Self::update), which checks too.
    ///
    /// # Errors
    /// [`LossError::InvalidArgument`] naming the field (`value`, `target`, `delta`, `min`, `max`).
    ///
    /// ```
    /// assert!(topr_loss::AdaptiveEntropyController::skywork().validate().is_ok());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        self.check("value")
    }

    /// The field checks, with the coefficient named `value_name` (`init` in the constructor).
    fn check(&self, value_name: &'static str) -> Result<(), LossError> {
        let bad = |argument: &'static str, value: f64, reason: &str| {
            Err(LossError::InvalidArgument { argument, value, reason: reason.into() })
        };
        if !self.target.is_finite() {
            return bad("target", self.target, "the target entropy must be finite");
        }
        if !(self.delta.is_finite() && self.delta >= 0.0) {
            return bad("delta", self.delta, "the step must be finite and >= 0 (Skywork uses 0.001)");
        }
        if !self.max.is_finite() {
            return bad("max", self.max, "the upper bound must be finite (Skywork uses 0.5)");
        }
        if !(self.min.is_finite() && self.min >= 0.0 && self.min <= self.max) {
            return bad("min", self.min, &format!("the lower bound must be finite, >= 0 and <= max = {}", self.max));
        }
        if !(self.value >= self.min && self.value <= self.max) {
            return bad(
                value_name,
                self.value,
                &format!("the coefficient must lie in [min, max] = [{}, {}]", self.min, self.max),
            );
        }
        Ok(())
    }
}
