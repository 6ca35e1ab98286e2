//! Direct preference optimisation and its variants, on sequence log-probabilities of a chosen
//! and a rejected completion per prompt.
//!
//! ```text
//! ρ_w = log π(y_w) − log π_ref(y_w)     ρ_l = log π(y_l) − log π_ref(y_l)     Δ = ρ_w − ρ_l     h = β Δ
//!
//! Sigmoid (DPO, cDPO)   ℓ = −(1 − ε) log σ(h) − ε log σ(−h)            (ε: cDPO's label smoothing)
//! SigmoidNorm           the sigmoid loss on per-token averaged log-probs
//! Ipo                   ℓ = (Δ − 1/(2β))²                               (per-token averaged log-probs)
//! Hinge (RSO)           ℓ = max(0, 1 − h)
//! Robust (rDPO)         ℓ = [−(1 − ε) log σ(h) + ε log σ(−h)] / (1 − 2ε)
//! ExoPair (EXO)         ℓ = σ(h) [log σ(h) − log(1 − ε)] + σ(−h) [log σ(−h) − log ε]
//! NcaPair (NCA)         ℓ = −log σ(βρ_w) − ½ log σ(−βρ_w) − ½ log σ(−βρ_l)
//! BcoPair (BCO)         ℓ = −log σ(βρ_w) − log σ(−βρ_l)
//! SppoHard (SPPO)       ℓ = (ρ_w − 1/(2β))² + (ρ_l + 1/(2β))²
//! ApoZero (APO)         ℓ = σ(−βρ_w) + σ(βρ_l)
//! ApoDown (APO)         ℓ = σ(βρ_w) + σ(−h)
//! Discopop (DiscoPOP)   ℓ = −log σ(h) · σ(−h/τ) + e^{−h} · σ(h/τ)
//! Aot (AOT, paired)     the sigmoid loss on h_k = β (sort(m)_k − sort(m_ref)_k),  m = log π(y_w) − log π(y_l)
//! AotUnpaired           the sigmoid loss on h_k = β (sort(ρ_w)_k − sort(ρ_l)_k)
//! reference-free        log π_ref ≡ 0
//! ```
//!
//! `log σ` is computed as `log_sigmoid`, never `log(sigmoid(·))`, in f32 or wider, so margins of
//! `±1e4` give finite values and gradients. DiscoPOP's `e^{−h} σ(h/τ)` is computed as
//! `exp(log σ(h/τ) − h)`, whose exponent is bounded above for `τ ≤ 1`.
//!
//! Label smoothing `ε` is conservative DPO (cDPO, Mitchell 2023) in the sigmoid loss. TRL's
//! `loss_type="robust"` is a different loss ([`DpoVariant::Robust`](crate::DpoVariant::Robust), Chowdhury et al., arXiv
//! 2403.00409: the cDPO terms with the sign of the flipped term reversed, divided by `1 − 2ε`, an
//! unbiased estimate of the clean DPO loss under label noise).
//!
//! The two AOT variants sort margins across the batch: pair `i`'s loss depends on the other
//! pairs, so they are not split-invariant (micro-batches sort separately), and their per-pair
//! `terms` belong to ranks, not to pairs. Several losses can be combined with weights
//! (TRL's `loss_type=[..]`, `loss_weights=[..]`) by [`crate::DpoMix`].

use crate::aggregate::Normalizer;
use crate::dpo_config::DpoConfig;
use crate::dpo_pairs::{Inputs, Pairs, check_inputs, per_pair_loss};
use crate::error::LossError;
use crate::output::{LossOutput, OnDevice, diagnostics_struct};
use crate::validate;
use tch::{Kind, Tensor};

fn check_pairs(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Inputs, LossError> {
    cfg.validate()?;
    check_inputs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, !cfg.reference_free, cfg.checks)
}

/// The DPO loss (every [`DpoVariant`](crate::DpoVariant); with or without a reference), averaged over pairs.
///
/// ```text
/// ρ_w = π_w − ref_w    ρ_l = π_l − ref_l    Δ_i = ρ_w − ρ_l    h_i = β Δ_i   (log-probs; ref ≡ 0 if reference-free)
/// Sigmoid, SigmoidNorm: ℓ_i = −(1 − ε) log σ(h_i) − ε log σ(−h_i)
/// Ipo:         ℓ_i = (Δ_i − 1/(2β))²
/// Hinge:       ℓ_i = max(0, 1 − h_i)
/// Robust:      ℓ_i = [−(1 − ε) log σ(h_i) + ε log σ(−h_i)] / (1 − 2ε)
/// ExoPair:     ℓ_i = σ(h_i) [log σ(h_i) − log(1 − ε)] + σ(−h_i) [log σ(−h_i) − log ε]
/// NcaPair:     ℓ_i = −log σ(βρ_w) − ½ log σ(−βρ_w) − ½ log σ(−βρ_l)
/// BcoPair:     ℓ_i = −log σ(βρ_w) − log σ(−βρ_l)
/// SppoHard:    ℓ_i = (ρ_w − 1/(2β))² + (ρ_l + 1/(2β))²
/// ApoZero:     ℓ_i = σ(−βρ_w) + σ(βρ_l)
/// ApoDown:     ℓ_i = σ(βρ_w) + σ(−h_i)
/// Discopop:    ℓ_i = −log σ(h_i) σ(−h_i/τ) + exp(log σ(h_i/τ) − h_i)      (= … + e^{−h_i} σ(h_i/τ))
/// Aot:         ℓ_k = −(1 − ε) log σ(g_k) − ε log σ(−g_k),  g_k = β (sort(π_w − π_l)_k − sort(ref_w − ref_l)_k)
/// AotUnpaired: the same with g_k = β (sort(ρ_w)_k − sort(ρ_l)_k)
/// loss = (1/B) Σ_i ℓ_i
/// ```
///
/// Reference: Rafailov et al., arXiv 2305.18290 (DPO); Mitchell, *A note on DPO with noisy
/// preferences* (cDPO); Azar et al., arXiv 2310.12036 (IPO); Liu et al., arXiv 2309.06657 (RSO);
/// Chowdhury et al., arXiv 2403.00409 (robust); Ji et al., arXiv 2402.00856 (EXO); Chen et al.,
/// arXiv 2402.05369 (NCA); Jung et al., arXiv 2404.04656 (BCO); Wu et al., arXiv 2405.00675
/// (SPPO); Melnyk et al., arXiv 2406.05882 (AOT); D'Oosterlinck et al., arXiv 2408.06266 (APO);
/// Lu et al., arXiv 2406.08414 (DiscoPOP); TRL 1.16's `DPOTrainer` `loss_type` of the same names.
///
/// The AOT variants sort across the batch, so a pair's loss depends on the other pairs of the
/// call; the gradient flows through the sort to the pair each sorted value came from.
///
/// # Arguments
/// * `logp_chosen`, `logp_rejected` — `[B]` sequence log-probs of the preferred and
///   dispreferred completions under the policy (differentiable; summed over tokens for DPO,
///   averaged for IPO).
/// * `logp_ref_chosen`, `logp_ref_rejected` — `[B]` the same under the frozen reference (detached;
///   ignored when `cfg.reference_free`).
///
/// # Errors
/// [`LossError::InvalidConfig`] for a bad config, and the tensor checks of [`LossError`];
/// [`LossError::NonFiniteLoss`] (under [`Checks::Full`](crate::Checks::Full)) if the loss overflows, which only
/// DiscoPOP with `τ > 1` and a margin `h ≪ 0` can do.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_loss, DpoConfig};
///
/// let pc = Tensor::from_slice(&[-10.0f64]).set_requires_grad(true);
/// let pr = Tensor::from_slice(&[-12.0f64]).set_requires_grad(true);
/// let (rc, rr) = (Tensor::from_slice(&[-11.0f64]), Tensor::from_slice(&[-11.0f64]));
/// let loss = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::default())?;
/// // Δ = 1 − (−1) = 2, h = 0.2: loss = −log σ(0.2)
/// let want = (1.0 + (-0.2f64).exp()).ln();
/// assert!((loss.double_value(&[]) - want).abs() < 1e-12);
///
/// // Robust DPO with ε = 0.1: [−0.9 log σ(0.2) + 0.1 log σ(−0.2)] / 0.8
/// let robust = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::robust(0.1))?.double_value(&[]);
/// let log_sigmoid = |x: f64| -(1.0 + (-x).exp()).ln();
/// assert!((robust - (-0.9 * log_sigmoid(0.2) + 0.1 * log_sigmoid(-0.2)) / 0.8).abs() < 1e-12);
///
/// // DiscoPOP stays finite where e^{−h} overflows: h = −2000 gives ≈ −log σ(h) = 2000.
/// let far = Tensor::from_slice(&[-20_000.0f64]);
/// let z = Tensor::from_slice(&[0.0f64]);
/// let disco = dpo_loss(&far, &z, &z, &z, &DpoConfig::discopop())?.double_value(&[]);
/// assert!((disco - 2000.0).abs() < 1e-9);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_loss(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Tensor, LossError> {
    let inputs = check_pairs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, cfg)?;
    let p = inputs.pairs(cfg.reference_free)?;
    validate::finite_loss(per_pair_loss(&p, cfg)?.f_mean(None::<Kind>)?, cfg.checks)
}

/// [`dpo_loss`] with the number of pairs `S` from `norm` (`norm.sequences`, else `B`), its
/// per-pair terms `ℓ [B]` and its [`DpoDiagnostics`] from the same pass.
///
/// ```text
/// loss = Σ_i ℓ_i / S
/// ```
///
/// With `norm = Normalizer::sequences(S)` for the `S` pairs of a whole optimiser batch, the
/// losses of its micro-batches sum to the loss of the batch, except for the AOT variants, which
/// sort within the call (their `terms[k]` is the loss of rank `k`, not of pair `k`).
///
/// Reference: as [`dpo_loss`]; the diagnostics are TRL's `rewards/*` metrics.
///
/// # Errors
/// As [`dpo_loss`], and [`LossError::InvalidConfig`] for a non-positive count in `norm`.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_loss_output, DpoConfig, Normalizer};
///
/// let pc = Tensor::from_slice(&[-10.0f64, -5.0]);
/// let pr = Tensor::from_slice(&[-12.0f64, -4.0]);
/// let rc = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let rr = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let out = dpo_loss_output(&pc, &pr, &rc, &rr, &DpoConfig::dpo().with_beta(0.5), &Normalizer::sequences(4.0))?;
/// let d = out.diagnostics.read()?;
/// assert_eq!(d.accuracy, 0.5); // pair 0 ranked right, pair 1 wrong
/// assert!((d.margin - (1.0 - 0.5) / 2.0).abs() < 1e-12); // margins β·2 = 1 and β·(−1) = −0.5
/// let sum: f64 = Vec::<f64>::try_from(&out.terms)?.iter().sum();
/// assert!((out.loss.double_value(&[]) - sum / 4.0).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_loss_output(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
    norm: &Normalizer,
) -> Result<LossOutput<DpoDiagnostics>, LossError> {
    let inputs = check_pairs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, cfg)?;
    let p = inputs.pairs(cfg.reference_free)?;
    let pairs = norm.sequences_or(p.chosen.size()[0] as f64)?;
    let terms = per_pair_loss(&p, cfg)?;
    let loss = validate::finite_loss(terms.f_sum(None::<Kind>)?.f_div_scalar(pairs)?, cfg.checks)?;
    Ok(LossOutput { loss, terms, diagnostics: dpo_diagnostics(&p, cfg.beta)? })
}

/// [`DpoDiagnostics`] of the implicit rewards `β ρ`.
pub(crate) fn dpo_diagnostics(p: &Pairs, beta: f64) -> Result<OnDevice<DpoDiagnostics>, LossError> {
    let chosen = p.chosen.f_detach()?.f_mul_scalar(beta)?;
    let rejected = p.rejected.f_detach()?.f_mul_scalar(beta)?;
    let mean = |t: &Tensor| t.f_mean(Kind::Double);
    OnDevice::new(&[
        Tensor::f_scalar_tensor(chosen.size()[0] as f64, (Kind::Double, chosen.device()))?,
        mean(&chosen.f_gt_tensor(&rejected)?.f_to_kind(Kind::Double)?)?,
        mean(&chosen.f_sub(&rejected)?)?,
        mean(&chosen)?,
        mean(&rejected)?,
    ])
}

/// What a DPO trainer logs, from the same pass as the loss ([`dpo_loss_output`]).
///
/// ```text
/// r_w = β (log π(y_w) − log π_ref(y_w))     r_l = β (log π(y_l) − log π_ref(y_l))
/// accuracy = mean(r_w > r_l)                margin = mean(r_w − r_l)
/// ```
///
/// Reference: Rafailov et al., arXiv 2305.18290 (the implicit reward); TRL's `rewards/*` metrics.
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_loss_output, DpoConfig, Normalizer};
/// let x = Tensor::from_slice(&[-3.0f64]);
/// let d = dpo_loss_output(&x, &x, &x, &x, &DpoConfig::default(), &Normalizer::local())?.diagnostics.read()?;
/// assert_eq!((d.pairs, d.accuracy, d.margin, d.chosen_reward_mean), (1, 0.0, 0.0, 0.0)); // policy = reference
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct DpoDiagnostics {
    /// Number of pairs in this call.
    pub pairs: i64,
    /// Share of pairs whose chosen reward is strictly larger.
    pub accuracy: f64,
    /// Mean of `r_w − r_l`.
    pub margin: f64,
    /// Mean chosen reward.
    pub chosen_reward_mean: f64,
    /// Mean rejected reward.
    pub rejected_reward_mean: f64,
}

diagnostics_struct!(DpoDiagnostics { pairs, accuracy, margin, chosen_reward_mean, rejected_reward_mean });

/// The implicit rewards of chosen and rejected completions (detached), per pair.
///
/// ```text
/// r_w = β (log π(y_w) − log π_ref(y_w))     r_l = β (log π(y_l) − log π_ref(y_l))
/// ```
///
/// Their batch statistics (accuracy, margin, means) come with the loss in [`DpoDiagnostics`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_rewards, DpoConfig};
/// let x = Tensor::from_slice(&[-3.0f64]);
/// let r = dpo_rewards(&x, &x, &x, &x, &DpoConfig::default())?; // policy = reference
/// assert_eq!((r.chosen.double_value(&[0]), r.rejected.double_value(&[0])), (0.0, 0.0));
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct DpoRewards {
    /// `[B]` implicit rewards of the chosen completions (detached).
    pub chosen: Tensor,
    /// `[B]` implicit rewards of the rejected completions (detached).
    pub rejected: Tensor,
}

/// The implicit rewards `β (log π − log π_ref)` of chosen and rejected completions, per pair.
/// Takes the same arguments as [`dpo_loss`].
///
/// Reference: Rafailov et al., arXiv 2305.18290, §5 (the implicit reward).
///
/// # Errors
/// As [`dpo_loss`].
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{dpo_rewards, DpoConfig};
///
/// let pc = Tensor::from_slice(&[-10.0f64, -5.0]);
/// let pr = Tensor::from_slice(&[-12.0f64, -4.0]);
/// let rc = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let rr = Tensor::from_slice(&[-11.0f64, -5.0]);
/// let r = dpo_rewards(&pc, &pr, &rc, &rr, &DpoConfig::dpo().with_beta(0.5))?;
/// assert_eq!(Vec::<f64>::try_from(&r.chosen)?, vec![0.5, 0.0]);
/// assert_eq!(Vec::<f64>::try_from(&r.rejected)?, vec![-0.5, 0.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dpo_rewards(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<DpoRewards, LossError> {
    let inputs = check_pairs(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, cfg)?;
    let p = inputs.pairs(cfg.reference_free)?;
    Ok(DpoRewards {
        chosen: p.chosen.f_detach()?.f_mul_scalar(cfg.beta)?,
        rejected: p.rejected.f_detach()?.f_mul_scalar(cfg.beta)?,
    })
}
