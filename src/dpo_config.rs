//! The settings of the DPO family: which pairwise loss ([`DpoVariant`]) and its knobs
//! ([`DpoConfig`]: β, label smoothing, the reference), shared by the losses (`dpo.rs`,
//! `dpo_mix.rs`) and the per-pair formulas (`dpo_pairs.rs`).

use crate::checks::Checks;
use crate::error::LossError;

/// The DPO loss family.
///
/// # Example
/// ```
/// use topr_loss::{DpoConfig, DpoVariant};
/// assert_eq!(DpoConfig::default().variant, DpoVariant::Sigmoid);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum DpoVariant {
    /// `−(1 − ε) log σ(h) − ε log σ(−h)`: DPO (Rafailov et al., arXiv 2305.18290); with label
    /// smoothing `ε > 0`, conservative DPO (cDPO, Mitchell 2023). Not TRL's `robust` loss.
    #[default]
    Sigmoid,
    /// `(Δ − 1/(2β))²`: IPO (Azar et al., arXiv 2310.12036). IPO is defined on log-probs
    /// *averaged* over the response tokens: pass per-token means, not sums.
    Ipo,
    /// `max(0, 1 − β Δ)`: the hinge loss of SLiC / RSO (Liu et al., arXiv 2309.06657).
    Hinge,
    /// `[−(1 − ε) log σ(h) + ε log σ(−h)] / (1 − 2ε)`: robust DPO (Chowdhury et al., arXiv
    /// 2403.00409; TRL's `robust`), the unbiased estimate of the DPO loss when a share `ε` of the
    /// labels is flipped. `ε ∈ [0, 0.5)`; with `ε = 0` it is DPO. Not cDPO: the flipped term has
    /// the opposite sign, and the loss is unbounded below as `h → +∞` when `ε > 0`.
    Robust,
    /// `σ(h) [log σ(h) − log(1 − ε)] + σ(−h) [log σ(−h) − log ε]`: EXO on pairs (Ji et al.,
    /// arXiv 2402.00856, eq. 16; TRL's `exo_pair`), the reverse KL from the policy's pairwise
    /// preference `σ(h)` to the smoothed label `(1 − ε, ε)`. Needs `ε ∈ (0, 1)` (the paper uses
    /// `1e-3`): at `ε = 0`, `log ε = −∞`.
    ExoPair,
    /// `−log σ(βρ_w) − ½ log σ(−βρ_w) − ½ log σ(−βρ_l)`: NCA on pairs (Chen et al., arXiv
    /// 2402.05369; TRL's `nca_pair`), on each completion's own reward rather than the margin.
    NcaPair,
    /// `−log σ(βρ_w) − log σ(−βρ_l)`: BCO on pairs (Jung et al., arXiv 2404.04656; TRL's
    /// `bco_pair`) *without* the paper's reward shift δ (a running mean of the rewards), as TRL.
    BcoPair,
    /// `(ρ_w − 1/(2β))² + (ρ_l + 1/(2β))²`: SPPO with hard preference probabilities 1 and 0 (Wu et
    /// al., arXiv 2405.00675, eq. 4.7; TRL's `sppo_hard`).
    SppoHard,
    /// The sigmoid loss (with label smoothing `ε`, as cDPO) on `h_k = β (sort(m)_k − sort(m_ref)_k)`,
    /// `m = log π(y_w) − log π(y_l)` and `m_ref` the same under the reference, each sorted across
    /// the batch: AOT, paired (Melnyk et al., arXiv 2406.05882; TRL's `aot`). Couples the pairs of
    /// a batch: not split-invariant.
    Aot,
    /// The sigmoid loss (with label smoothing `ε`) on `h_k = β (sort(ρ_w)_k − sort(ρ_l)_k)`: AOT
    /// for unpaired data (Melnyk et al., arXiv 2406.05882; TRL's `aot_unpaired`). Couples the pairs
    /// of a batch: not split-invariant.
    AotUnpaired,
    /// `σ(−βρ_w) + σ(βρ_l)`: APO-zero (D'Oosterlinck et al., arXiv 2408.06266, eq. 7; TRL's
    /// `apo_zero`): raise the chosen likelihood, lower the rejected one.
    ApoZero,
    /// `σ(βρ_w) + σ(−h)`: APO-down (D'Oosterlinck et al., arXiv 2408.06266, eq. 8; TRL's
    /// `apo_down`): lower both likelihoods, the rejected one more.
    ApoDown,
    /// `−log σ(h) · σ(−h/τ) + e^{−h} · σ(h/τ)`: DiscoPOP, the log-ratio modulated loss (Chris Lu et
    /// al., arXiv 2406.08414, eq. 5; TRL's `discopop`), with `τ` = [`DpoConfig::discopop_tau`].
    Discopop,
    /// `−(1 − ε) log σ(h) − ε log σ(−h)` on log-probs *averaged* over each completion's tokens
    /// (TRL's `sigmoid_norm`): the same formula as `Sigmoid`; pass
    /// `sequence_logprobs(.., SequenceReduce::Mean)` for policy and reference, as for IPO.
    SigmoidNorm,
}

/// Configuration of [`dpo_loss`](crate::dpo_loss) and [`dpo_rewards`](crate::dpo_rewards).
///
/// `Default` ([`DpoConfig::dpo`]): `β = 0.1`, no label smoothing, the sigmoid loss, with a
/// reference model. Presets name each published loss; `with_…` methods change one knob.
///
/// Reference: Rafailov et al., *Direct Preference Optimization*, arXiv 2305.18290; TRL's
/// `DPOTrainer` for the option names.
///
/// # Example
/// ```
/// use topr_loss::DpoConfig;
/// let cfg = DpoConfig::cdpo(0.1);
/// assert!(cfg.validate().is_ok());
/// assert!(cfg.with_beta(0.0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct DpoConfig {
    /// `β > 0`: the strength of the implicit KL constraint.
    pub beta: f64,
    /// `ε`: the assumed share of flipped preference labels: `[0, 0.5]` for `Sigmoid`,
    /// `SigmoidNorm`, `Aot`, `AotUnpaired` (cDPO), `[0, 0.5)` for `Robust`; EXO's smoothing
    /// `(0, 1)` for `ExoPair`; 0 for the other variants.
    pub label_smoothing: f64,
    /// Which loss.
    pub variant: DpoVariant,
    /// `τ > 0`: DiscoPOP's temperature ([`DpoVariant::Discopop`] only; TRL's `discopop_tau`,
    /// default 0.05). `τ ≤ 1` keeps the loss finite for every finite margin.
    pub discopop_tau: f64,
    /// Ignore the reference log-probs (`log π_ref ≡ 0`); the `logp_ref_*` arguments may then be
    /// undefined tensors (`Tensor::new()`).
    pub reference_free: bool,
    /// Value checks (and their host reads) or shape checks only; see [`Checks`].
    pub checks: Checks,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self::dpo()
    }
}

impl DpoConfig {
    /// DPO: the sigmoid loss, `β = 0.1`, with a reference. Rafailov et al., arXiv 2305.18290.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::dpo(), topr_loss::DpoConfig::default());
    /// ```
    pub const fn dpo() -> Self {
        Self {
            beta: 0.1,
            label_smoothing: 0.0,
            variant: DpoVariant::Sigmoid,
            discopop_tau: 0.05,
            reference_free: false,
            checks: Checks::Full,
        }
    }

    /// Conservative DPO: the sigmoid loss with label smoothing `ε` (the assumed share of flipped
    /// labels). Mitchell, *A note on DPO with noisy preferences*, 2023. Earlier TRL releases applied
    /// `label_smoothing` to `loss_type="sigmoid"` this way; TRL 1.16's sigmoid loss ignores it
    /// (its smoothed forms are `robust`, `exo_pair` and `aot`).
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::cdpo(0.1).label_smoothing, 0.1);
    /// ```
    pub const fn cdpo(label_smoothing: f64) -> Self {
        Self::dpo().with_label_smoothing(label_smoothing)
    }

    /// IPO, `β = 0.1`. Azar et al., arXiv 2310.12036.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::ipo().variant, topr_loss::DpoVariant::Ipo);
    /// ```
    pub const fn ipo() -> Self {
        Self::dpo().with_variant(DpoVariant::Ipo)
    }

    /// The hinge loss of SLiC / RSO, `β = 0.1`. Liu et al., arXiv 2309.06657.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::hinge().variant, topr_loss::DpoVariant::Hinge);
    /// ```
    pub const fn hinge() -> Self {
        Self::dpo().with_variant(DpoVariant::Hinge)
    }

    /// Robust DPO with the share `ε ∈ [0, 0.5)` of flipped labels. Chowdhury et al., arXiv
    /// 2403.00409; TRL's `loss_type="robust"` with `label_smoothing`.
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoVariant};
    /// assert_eq!(DpoConfig::robust(0.1).variant, DpoVariant::Robust);
    /// assert!(DpoConfig::robust(0.5).validate().is_err()); // 1 − 2ε = 0
    /// ```
    pub const fn robust(label_smoothing: f64) -> Self {
        Self::dpo().with_variant(DpoVariant::Robust).with_label_smoothing(label_smoothing)
    }

    /// EXO on pairs with label smoothing `ε ∈ (0, 1)` (the paper uses `1e-3`). Ji et al., arXiv
    /// 2402.00856; TRL's `loss_type="exo_pair"` with `label_smoothing`.
    ///
    /// ```
    /// use topr_loss::DpoConfig;
    /// assert!(DpoConfig::exo_pair(1e-3).validate().is_ok());
    /// assert!(DpoConfig::exo_pair(0.0).validate().is_err()); // log ε = −∞
    /// ```
    pub const fn exo_pair(label_smoothing: f64) -> Self {
        Self::dpo().with_variant(DpoVariant::ExoPair).with_label_smoothing(label_smoothing)
    }

    /// NCA on pairs, `β = 0.1`. Chen et al., arXiv 2402.05369; TRL's `loss_type="nca_pair"`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::nca_pair().variant, topr_loss::DpoVariant::NcaPair);
    /// ```
    pub const fn nca_pair() -> Self {
        Self::dpo().with_variant(DpoVariant::NcaPair)
    }

    /// BCO on pairs without the reward shift δ, `β = 0.1`. Jung et al., arXiv 2404.04656; TRL's
    /// `loss_type="bco_pair"`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::bco_pair().variant, topr_loss::DpoVariant::BcoPair);
    /// ```
    pub const fn bco_pair() -> Self {
        Self::dpo().with_variant(DpoVariant::BcoPair)
    }

    /// SPPO with hard probabilities, `β = 0.1`. Wu et al., arXiv 2405.00675; TRL's
    /// `loss_type="sppo_hard"`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::sppo_hard().variant, topr_loss::DpoVariant::SppoHard);
    /// ```
    pub const fn sppo_hard() -> Self {
        Self::dpo().with_variant(DpoVariant::SppoHard)
    }

    /// AOT, paired, `β = 0.1`, no label smoothing. Melnyk et al., arXiv 2406.05882; TRL's
    /// `loss_type="aot"`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::aot().variant, topr_loss::DpoVariant::Aot);
    /// ```
    pub const fn aot() -> Self {
        Self::dpo().with_variant(DpoVariant::Aot)
    }

    /// AOT for unpaired data, `β = 0.1`, no label smoothing. Melnyk et al., arXiv 2406.05882;
    /// TRL's `loss_type="aot_unpaired"`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::aot_unpaired().variant, topr_loss::DpoVariant::AotUnpaired);
    /// ```
    pub const fn aot_unpaired() -> Self {
        Self::dpo().with_variant(DpoVariant::AotUnpaired)
    }

    /// APO-zero, `β = 0.1`. D'Oosterlinck et al., arXiv 2408.06266; TRL's `loss_type="apo_zero"`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::apo_zero().variant, topr_loss::DpoVariant::ApoZero);
    /// ```
    pub const fn apo_zero() -> Self {
        Self::dpo().with_variant(DpoVariant::ApoZero)
    }

    /// APO-down, `β = 0.1`. D'Oosterlinck et al., arXiv 2408.06266; TRL's `loss_type="apo_down"`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::apo_down().variant, topr_loss::DpoVariant::ApoDown);
    /// ```
    pub const fn apo_down() -> Self {
        Self::dpo().with_variant(DpoVariant::ApoDown)
    }

    /// DiscoPOP, `β = 0.1`, `τ = 0.05`. Chris Lu et al., arXiv 2406.08414; TRL's
    /// `loss_type="discopop"` with `discopop_tau`.
    ///
    /// ```
    /// let cfg = topr_loss::DpoConfig::discopop();
    /// assert_eq!((cfg.variant, cfg.discopop_tau), (topr_loss::DpoVariant::Discopop, 0.05));
    /// ```
    pub const fn discopop() -> Self {
        Self::dpo().with_variant(DpoVariant::Discopop)
    }

    /// DPO on per-token averaged log-probs, `β = 0.1`: TRL's `loss_type="sigmoid_norm"`. Pass
    /// `sequence_logprobs(.., SequenceReduce::Mean)` for policy and reference.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::sigmoid_norm().variant, topr_loss::DpoVariant::SigmoidNorm);
    /// ```
    pub const fn sigmoid_norm() -> Self {
        Self::dpo().with_variant(DpoVariant::SigmoidNorm)
    }

    /// The same config with DiscoPOP's temperature `τ`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::discopop().with_discopop_tau(0.1).discopop_tau, 0.1);
    /// ```
    pub const fn with_discopop_tau(self, discopop_tau: f64) -> Self {
        Self { discopop_tau, ..self }
    }

    /// The same config with another `β`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::dpo().with_beta(0.5).beta, 0.5);
    /// ```
    pub const fn with_beta(self, beta: f64) -> Self {
        Self { beta, ..self }
    }

    /// The same config with label smoothing `ε`.
    ///
    /// ```
    /// assert_eq!(topr_loss::DpoConfig::dpo().with_label_smoothing(0.2).label_smoothing, 0.2);
    /// ```
    pub const fn with_label_smoothing(self, label_smoothing: f64) -> Self {
        Self { label_smoothing, ..self }
    }

    /// The same config with another variant.
    ///
    /// ```
    /// use topr_loss::{DpoConfig, DpoVariant};
    /// assert_eq!(DpoConfig::dpo().with_variant(DpoVariant::Hinge), DpoConfig::hinge());
    /// ```
    pub const fn with_variant(self, variant: DpoVariant) -> Self {
        Self { variant, ..self }
    }

    /// The same config with or without the reference model.
    ///
    /// ```
    /// assert!(topr_loss::DpoConfig::dpo().with_reference_free(true).reference_free);
    /// ```
    pub const fn with_reference_free(self, reference_free: bool) -> Self {
        Self { reference_free, ..self }
    }

    crate::setters::setters!(DpoConfig, dpo(); checks);

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`]: `β` not finite and `> 0`; `ε` outside its variant's range
    /// (`[0, 0.5]` for the cDPO-smoothed `Sigmoid`, `SigmoidNorm`, `Aot`, `AotUnpaired`;
    /// `[0, 0.5)` for `Robust`; `(0, 1)` for `ExoPair`; `ε > 0` with a variant that has no label
    /// smoothing); DiscoPOP's `τ` not finite and `> 0`.
    ///
    /// ```
    /// use topr_loss::DpoConfig;
    /// let bad = DpoConfig::ipo().with_label_smoothing(0.1);
    /// assert!(bad.validate().is_err());
    /// assert!(DpoConfig::discopop().with_discopop_tau(0.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return Err(LossError::InvalidConfig {
                field: "beta",
                value: self.beta,
                reason: "β must be finite and > 0".into(),
            });
        }
        if !(self.discopop_tau.is_finite() && self.discopop_tau > 0.0) {
            return Err(LossError::InvalidConfig {
                field: "discopop_tau",
                value: self.discopop_tau,
                reason: "DiscoPOP's temperature τ must be finite and > 0".into(),
            });
        }
        let eps = self.label_smoothing;
        let bad = |reason: String| Err(LossError::InvalidConfig { field: "label_smoothing", value: eps, reason });
        match self.variant {
            DpoVariant::ExoPair if !(eps > 0.0 && eps < 1.0) => {
                return bad("EXO's label smoothing must lie in (0, 1): log ε and log(1 − ε) must be finite".into());
            }
            DpoVariant::ExoPair => {}
            _ if !(0.0..=0.5).contains(&eps) => {
                return bad("the share of flipped labels must lie in [0, 0.5]".into());
            }
            DpoVariant::Robust if eps >= 0.5 => {
                return bad("robust DPO divides by 1 − 2ε: the share of flipped labels must lie in [0, 0.5)".into());
            }
            DpoVariant::Sigmoid
            | DpoVariant::SigmoidNorm
            | DpoVariant::Robust
            | DpoVariant::Aot
            | DpoVariant::AotUnpaired => {}
            other if eps > 0.0 => {
                return bad(format!(
                    "label smoothing applies to the Sigmoid, SigmoidNorm, Robust, ExoPair, Aot and AotUnpaired \
                     losses only, not {other:?}"
                ));
            }
            _ => {}
        }
        Ok(())
    }
}
