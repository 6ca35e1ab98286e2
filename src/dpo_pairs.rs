//! The per-pair losses of the DPO family (the formulas of [`crate::DpoVariant`]) and the checked
//! inputs they take: policy and reference sequence log-probs, `[B]` each, in the compute dtype.
//!
//! ```text
//! ρ_w = log π(y_w) − log π_ref(y_w)     ρ_l = log π(y_l) − log π_ref(y_l)     h = β (ρ_w − ρ_l)
//! ```
//!
//! Each loss is a few tensor operations on `ρ_w`, `ρ_l` (and, for paired AOT, on the policy and
//! reference margins), in f32 or wider, with `log_sigmoid` for every `log σ`.

use crate::checks::Checks;
use crate::dpo_config::{DpoConfig, DpoVariant};
use crate::error::LossError;
use crate::validate::{self, FiniteCheck, LogProbCheck};
use tch::Tensor;

/// Checked inputs in the compute dtype, `[B]` each; the reference detached, `None` when no
/// reference was asked for.
pub(crate) struct Inputs {
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Option<Tensor>,
    ref_rejected: Option<Tensor>,
}

/// The per-pair log-ratios `ρ_w`, `ρ_l` of one loss, and the inputs they came from (for AOT).
pub(crate) struct Pairs<'a> {
    pub(crate) chosen: Tensor,
    pub(crate) rejected: Tensor,
    inputs: &'a Inputs,
    reference_free: bool,
}

/// Checks the four log-prob arguments (the reference ones only when `with_reference`) and casts
/// them to the compute dtype.
pub(crate) fn check_inputs(
    logp_chosen: &Tensor,
    logp_rejected: &Tensor,
    logp_ref_chosen: &Tensor,
    logp_ref_rejected: &Tensor,
    with_reference: bool,
    checks: Checks,
) -> Result<Inputs, LossError> {
    let mut args = vec![(logp_chosen, "logp_chosen"), (logp_rejected, "logp_rejected")];
    if with_reference {
        args.push((logp_ref_chosen, "logp_ref_chosen"));
        args.push((logp_ref_rejected, "logp_ref_rejected"));
    }
    let mut kinds = vec![];
    for (t, name) in &args {
        kinds.push(validate::float_tensor(t, name)?);
    }
    let shape = validate::rank(logp_chosen, "logp_chosen", 1, "[B] sequence log-probabilities")?;
    validate::non_empty(&shape, "logp_chosen", "preference pair")?;
    let device = logp_chosen.device();
    for (t, name) in &args[1..] {
        validate::same_shape(t, name, &shape, "the shape of `logp_chosen`")?;
        validate::same_device(t, name, device, "logp_chosen")?;
    }
    if checks.values() {
        let checks: Vec<FiniteCheck> = args
            .iter()
            .map(|&(t, argument)| FiniteCheck { clean: t, original: t, argument, valid: None, also: None })
            .collect();
        let log_probs: Vec<LogProbCheck> =
            args.iter().map(|&(t, argument)| LogProbCheck { t, argument, valid: None }).collect();
        validate::all_finite_sums_and_log_probs(&checks, &log_probs)?;
    }
    let kind = validate::compute_kind(&kinds);
    let reference = |t: &Tensor| -> Result<Option<Tensor>, LossError> {
        Ok(if with_reference { Some(t.f_detach()?.f_to_kind(kind)?) } else { None })
    };
    Ok(Inputs {
        chosen: logp_chosen.f_to_kind(kind)?,
        rejected: logp_rejected.f_to_kind(kind)?,
        ref_chosen: reference(logp_ref_chosen)?,
        ref_rejected: reference(logp_ref_rejected)?,
    })
}

impl Inputs {
    /// The log-ratios `ρ = log π − log π_ref` (`log π` alone when `reference_free`).
    pub(crate) fn pairs(&self, reference_free: bool) -> Result<Pairs<'_>, LossError> {
        let log_ratio = |policy: &Tensor, reference: &Option<Tensor>| -> Result<Tensor, LossError> {
            Ok(match reference {
                Some(r) if !reference_free => policy.f_sub(r)?,
                _ => policy.shallow_clone(),
            })
        };
        Ok(Pairs {
            chosen: log_ratio(&self.chosen, &self.ref_chosen)?,
            rejected: log_ratio(&self.rejected, &self.ref_rejected)?,
            inputs: self,
            reference_free,
        })
    }
}

/// `ℓ_i` of each pair (of each rank, for the AOT variants).
pub(crate) fn per_pair_loss(p: &Pairs, cfg: &DpoConfig) -> Result<Tensor, LossError> {
    let beta = cfg.beta;
    let eps = cfg.label_smoothing;
    let (w, l) = (&p.chosen, &p.rejected);
    Ok(match cfg.variant {
        DpoVariant::Sigmoid | DpoVariant::SigmoidNorm => smoothed_sigmoid(&margin(p, beta)?, eps)?,
        DpoVariant::Ipo => w.f_sub(l)?.f_sub_scalar(1.0 / (2.0 * beta))?.f_square()?,
        DpoVariant::Hinge => margin(p, -beta)?.f_add_scalar(1.0)?.f_relu()?,
        DpoVariant::Robust => {
            // [−(1 − ε) log σ(h) + ε log σ(−h)] / (1 − 2ε)
            let h = margin(p, beta)?;
            let clean = h.f_log_sigmoid()?.f_mul_scalar(-(1.0 - eps))?;
            let flipped = h.f_neg()?.f_log_sigmoid()?.f_mul_scalar(eps)?;
            clean.f_add(&flipped)?.f_div_scalar(1.0 - 2.0 * eps)?
        }
        DpoVariant::ExoPair => {
            // KL((σ(h), σ(−h)) ‖ (1 − ε, ε)); σ · log σ is 0·finite where σ underflows.
            let h = margin(p, beta)?;
            let side = |x: &Tensor, log_p: f64| -> Result<Tensor, LossError> {
                Ok(x.f_sigmoid()?.f_mul(&x.f_log_sigmoid()?.f_sub_scalar(log_p)?)?)
            };
            side(&h, (-eps).ln_1p())?.f_add(&side(&h.f_neg()?, eps.ln())?)?
        }
        DpoVariant::NcaPair => {
            let (rw, rl) = (w.f_mul_scalar(beta)?, l.f_mul_scalar(beta)?);
            let half = rw.f_neg()?.f_log_sigmoid()?.f_add(&rl.f_neg()?.f_log_sigmoid()?)?.f_mul_scalar(0.5)?;
            rw.f_log_sigmoid()?.f_add(&half)?.f_neg()?
        }
        DpoVariant::BcoPair => {
            let (rw, rl) = (w.f_mul_scalar(beta)?, l.f_mul_scalar(-beta)?);
            rw.f_log_sigmoid()?.f_add(&rl.f_log_sigmoid()?)?.f_neg()?
        }
        DpoVariant::SppoHard => {
            let target = 0.5 / beta;
            w.f_sub_scalar(target)?.f_square()?.f_add(&l.f_add_scalar(target)?.f_square()?)?
        }
        DpoVariant::Aot | DpoVariant::AotUnpaired => smoothed_sigmoid(&aot_margin(p, cfg)?, eps)?,
        // 1 − σ(x) as σ(−x): the same value, without cancellation.
        DpoVariant::ApoZero => w.f_mul_scalar(-beta)?.f_sigmoid()?.f_add(&l.f_mul_scalar(beta)?.f_sigmoid()?)?,
        DpoVariant::ApoDown => w.f_mul_scalar(beta)?.f_sigmoid()?.f_add(&margin(p, -beta)?.f_sigmoid()?)?,
        DpoVariant::Discopop => discopop(&margin(p, beta)?, cfg.discopop_tau)?,
    })
}

/// `s (ρ_w − ρ_l)`: the scaled margin.
fn margin(p: &Pairs, s: f64) -> Result<Tensor, LossError> {
    Ok(p.chosen.f_sub(&p.rejected)?.f_mul_scalar(s)?)
}

/// `−(1 − ε) log σ(h) − ε log σ(−h)`.
fn smoothed_sigmoid(h: &Tensor, eps: f64) -> Result<Tensor, LossError> {
    let agree = h.f_log_sigmoid()?.f_mul_scalar(-(1.0 - eps))?;
    Ok(if eps > 0.0 { agree.f_sub(&h.f_neg()?.f_log_sigmoid()?.f_mul_scalar(eps)?)? } else { agree })
}

/// AOT's `h_k`: `β (sort(m)_k − sort(m_ref)_k)` (paired), `β (sort(ρ_w)_k − sort(ρ_l)_k)`
/// (unpaired), ascending sorts across the batch; the gradient flows back through the sort to the
/// pair each sorted value came from.
fn aot_margin(p: &Pairs, cfg: &DpoConfig) -> Result<Tensor, LossError> {
    let sorted = |t: &Tensor| -> Result<Tensor, LossError> { Ok(t.f_sort(0, false)?.0) };
    let delta = if cfg.variant == DpoVariant::AotUnpaired {
        sorted(&p.chosen)?.f_sub(&sorted(&p.rejected)?)?
    } else {
        let x = p.inputs;
        let policy = sorted(&x.chosen.f_sub(&x.rejected)?)?;
        match (&x.ref_chosen, &x.ref_rejected) {
            (Some(rc), Some(rr)) if !p.reference_free => policy.f_sub(&sorted(&rc.f_sub(rr)?)?)?,
            _ => policy,
        }
    };
    Ok(delta.f_mul_scalar(cfg.beta)?)
}

/// DiscoPOP's `−log σ(h) · σ(−h/τ) + e^{−h} · σ(h/τ)`, its second term as `exp(log σ(h/τ) − h)`:
/// the same value, but the exponent `log σ(h/τ) − h ≤ h (1/τ − 1)` for `h < 0` is bounded above
/// for `τ ≤ 1` where `e^{−h}` alone overflows (and times `σ(h/τ) = 0`, gives NaN).
fn discopop(h: &Tensor, tau: f64) -> Result<Tensor, LossError> {
    let ht = h.f_div_scalar(tau)?;
    let logistic = h.f_log_sigmoid()?.f_neg()?.f_mul(&ht.f_neg()?.f_sigmoid()?)?;
    let exponential = ht.f_log_sigmoid()?.f_sub(h)?.f_exp()?;
    Ok(logistic.f_add(&exponential)?)
}
