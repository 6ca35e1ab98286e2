//! The optimisers of `train`: AdamW and Adafactor, written out over tch tensors so that their
//! state can be saved with a checkpoint and a killed run resumes with the same moments.
//!
//! ```text
//! AdamW (Loshchilov & Hutter, arXiv 1711.05101; torch.optim.AdamW)
//!   θ ← θ (1 − η λ)
//!   m ← β1 m + (1 − β1) g          v ← β2 v + (1 − β2) g²
//!   θ ← θ − η (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + ε)
//!
//! Adafactor (Shazeer & Stern, arXiv 1804.04235; as transformers.optimization.Adafactor with
//! relative_step=False, the form the TOPR paper trains with)
//!   ρ_t = 1 − t^(−0.8)               G = g² + ε1
//!   matrix [n, m]:  R ← ρ_t R + (1 − ρ_t) mean_col(G)   C ← ρ_t C + (1 − ρ_t) mean_row(G)
//!                   V̂ = (R / mean(R)) ⊗ C                (rank-1: n + m numbers, not n·m)
//!   vector:         V̂ ← ρ_t V̂ + (1 − ρ_t) G
//!   U = g / sqrt(V̂);  U ← U / max(1, RMS(U) / d)          (update clipping, d = 1)
//!   α = η · max(ε2, RMS(θ)) if scale_parameter else η
//!   [β1 set: U ← β1 M + (1 − β1) α U, M ← U; else U ← α U]
//!   θ ← θ − α λ θ − U
//! ```
//!
//! State is kept in float32 whatever the parameters' dtype. For bf16 and f16 parameters the
//! optimiser also keeps a float32 master copy (`{name}.master`, 4 bytes a parameter): updates
//! are applied to it and the parameter is its rounding. Without it, an update smaller than half
//! a bf16 ulp (0.2–0.4 % of the weight) would be rounded away, which at fine-tuning learning
//! rates is most of them.

use anyhow::{Result, bail};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// Which optimiser, with its hyper-parameters (the learning rate comes per step).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerConfig {
    #[serde(rename = "adamw")]
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
    Adafactor {
        beta1: Option<f64>,
        eps1: f64,
        eps2: f64,
        clip_threshold: f64,
        decay_rate: f64,
        weight_decay: f64,
        scale_parameter: bool,
    },
}

/// Adafactor's hyper-parameters, as [`OptimizerConfig::Adafactor`] holds them.
#[derive(Clone, Copy)]
struct Adafactor {
    beta1: Option<f64>,
    eps1: f64,
    eps2: f64,
    clip_threshold: f64,
    decay_rate: f64,
    weight_decay: f64,
    scale_parameter: bool,
}

impl OptimizerConfig {
    /// AdamW with torch's defaults (β1 0.9, β2 0.999, ε 1e-8) and `weight_decay`.
    pub fn adamw(weight_decay: f64) -> Result<Self> {
        Ok(Self::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: check_weight_decay(weight_decay)? })
    }

    /// Adafactor as the TOPR paper trains with it (transformers' defaults with
    /// `relative_step=False`, no first moment, no parameter scaling) and `weight_decay`.
    pub fn adafactor(weight_decay: f64) -> Result<Self> {
        Ok(Self::Adafactor {
            beta1: None,
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            weight_decay: check_weight_decay(weight_decay)?,
            scale_parameter: false,
        })
    }
}

fn check_weight_decay(weight_decay: f64) -> Result<f64> {
    if !(weight_decay.is_finite() && weight_decay >= 0.0) {
        bail!("the weight decay must be finite and >= 0, got {weight_decay}");
    }
    Ok(weight_decay)
}

/// An optimiser over named parameters, with state that can be saved and restored.
pub struct Optimizer {
    cfg: OptimizerConfig,
    params: Vec<(String, Tensor)>,
    state: BTreeMap<String, Tensor>,
    step: i64,
}

fn rms(x: &Tensor) -> Tensor {
    x.square().mean(Kind::Float).sqrt()
}

impl Optimizer {
    /// An optimiser over `params` (name, trainable tensor); state is created lazily.
    pub fn new(cfg: OptimizerConfig, mut params: Vec<(String, Tensor)>) -> Self {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Self { cfg, params, state: BTreeMap::new(), step: 0 }
    }

    /// Optimiser steps taken so far.
    pub fn steps(&self) -> i64 {
        self.step
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&self) {
        for (_, p) in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    fn slot(&mut self, key: String, init: impl FnOnce() -> Tensor) -> Tensor {
        self.state.entry(key).or_insert_with(init).shallow_clone()
    }

    /// One update with learning rate `lr` from the gradients now held by the parameters
    /// (parameters without a gradient are left alone).
    pub fn step(&mut self, lr: f64) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0) {
            bail!("learning rate must be finite and >= 0, got {lr}");
        }
        self.step += 1;
        let t = self.step as f64;
        let params: Vec<(String, Tensor)> = self.params.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).collect();
        tch::no_grad(|| -> Result<()> {
            for (name, p) in &params {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let g = g.to_kind(Kind::Float);
                let master = (p.kind() != Kind::Float && p.kind() != Kind::Double)
                    .then(|| self.slot(format!("{name}.master"), || p.to_kind(Kind::Float)));
                let theta = match &master {
                    Some(m) => m.shallow_clone(),
                    None => p.to_kind(Kind::Float),
                };
                let new = match self.cfg {
                    OptimizerConfig::AdamW { beta1, beta2, eps, weight_decay } => {
                        self.adamw(name, &g, theta, lr, t, (beta1, beta2, eps, weight_decay))
                    }
                    OptimizerConfig::Adafactor {
                        beta1,
                        eps1,
                        eps2,
                        clip_threshold,
                        decay_rate,
                        weight_decay,
                        scale_parameter,
                    } => self.adafactor(
                        name,
                        &g,
                        &theta,
                        lr,
                        t,
                        Adafactor { beta1, eps1, eps2, clip_threshold, decay_rate, weight_decay, scale_parameter },
                    ),
                };
                if let Some(mut m) = master {
                    m.copy_(&new);
                }
                let mut p = p.shallow_clone();
                p.copy_(&new.to_kind(p.kind()));
            }
            Ok(())
        })
    }

    /// AdamW's new value of `theta` (f32) at step `t` from its gradient `g`, with
    /// `(β1, β2, ε, weight decay)`; its moments in `name`'s slots.
    fn adamw(&mut self, name: &str, g: &Tensor, theta: Tensor, lr: f64, t: f64, c: (f64, f64, f64, f64)) -> Tensor {
        let (beta1, beta2, eps, weight_decay) = c;
        let mut m = self.slot(format!("{name}.exp_avg"), || g.zeros_like());
        let mut v = self.slot(format!("{name}.exp_avg_sq"), || g.zeros_like());
        let _ = m.g_mul_scalar_(beta1).g_add_(&(g * (1.0 - beta1)));
        let _ = v.g_mul_scalar_(beta2).g_add_(&(g.square() * (1.0 - beta2)));
        let (bc1, bc2) = (1.0 - beta1.powf(t), 1.0 - beta2.powf(t));
        let denom = (&v / bc2).sqrt() + eps;
        theta * (1.0 - lr * weight_decay) - (&m / &denom) * (lr / bc1)
    }

    /// Adafactor's new value of `theta` (f32) at step `t` from its gradient `g`: factored second
    /// moments for matrices (row and column means), full ones otherwise, the update clipped by
    /// its RMS, scaled by the parameter's RMS, optionally with a first moment.
    fn adafactor(&mut self, name: &str, g: &Tensor, theta: &Tensor, lr: f64, t: f64, c: Adafactor) -> Tensor {
        let rho = 1.0 - t.powf(c.decay_rate);
        let sq = g.square() + c.eps1;
        let mut u = if g.size().len() >= 2 {
            let (row, col) = (sq.mean_dim(-1, false, Kind::Float), sq.mean_dim(-2, false, Kind::Float));
            let mut r = self.slot(format!("{name}.exp_avg_sq_row"), || row.zeros_like());
            let mut cm = self.slot(format!("{name}.exp_avg_sq_col"), || col.zeros_like());
            let _ = r.g_mul_scalar_(rho).g_add_(&(row * (1.0 - rho)));
            let _ = cm.g_mul_scalar_(rho).g_add_(&(col * (1.0 - rho)));
            let r_factor = (&r / r.mean_dim(-1, true, Kind::Float)).rsqrt().unsqueeze(-1);
            let c_factor = cm.unsqueeze(-2).rsqrt();
            r_factor * c_factor * g
        } else {
            let mut v = self.slot(format!("{name}.exp_avg_sq"), || g.zeros_like());
            let _ = v.g_mul_scalar_(rho).g_add_(&(&sq * (1.0 - rho)));
            v.rsqrt() * g
        };
        u = &u / (rms(&u) / c.clip_threshold).clamp_min(1.0);
        let alpha = if c.scale_parameter { lr * rms(theta).double_value(&[]).max(c.eps2) } else { lr };
        u *= alpha;
        if let Some(b1) = c.beta1 {
            let mut m = self.slot(format!("{name}.exp_avg"), || g.zeros_like());
            let _ = m.g_mul_scalar_(b1).g_add_(&(&u * (1.0 - b1)));
            u = m.shallow_clone();
        }
        theta - theta * (alpha * c.weight_decay) - u
    }

    /// The state to save: every moment tensor, and the step count under `"step"`.
    pub fn state(&self) -> BTreeMap<String, Tensor> {
        let mut s: BTreeMap<String, Tensor> =
            self.state.iter().map(|(k, v)| (k.clone(), v.to(tch::Device::Cpu))).collect();
        s.insert("step".into(), Tensor::from_slice(&[self.step]));
        s
    }

    /// Restores a state written by [`Optimizer::state`]; refuses one that names unknown parameters
    /// or has the wrong shapes.
    pub fn load_state(&mut self, mut s: BTreeMap<String, Tensor>) -> Result<()> {
        let step = match s.remove("step") {
            Some(t) if t.numel() == 1 => t.f_int64_value(&[0])?,
            Some(t) => bail!("optimizer state: \"step\" holds {} values, not one", t.numel()),
            None => 0,
        };
        let device = self.params.first().map(|p| p.1.device()).unwrap_or(tch::Device::Cpu);
        let mut state = BTreeMap::new();
        for (k, v) in s {
            let Some((_, p)) =
                self.params.iter().find(|(n, _)| k.starts_with(n.as_str()) && k[n.len()..].starts_with('.'))
            else {
                bail!("optimizer state names {k:?}, which is not a parameter of this model");
            };
            // A factored moment (`_row`, `_col`) belongs to a matrix, never to a vector.
            let factored = k.ends_with("_row") || k.ends_with("_col");
            let ok = if factored && p.dim() < 2 {
                false
            } else if k.ends_with("_row") {
                v.size()[..] == p.size()[..p.dim() - 1]
            } else if k.ends_with("_col") {
                let mut want = p.size();
                want.remove(p.dim() - 2);
                v.size() == want
            } else {
                v.size() == p.size()
            };
            if !ok {
                bail!(
                    "optimizer state {k:?} has shape {:?}, which does not fit the parameter {:?}",
                    v.size(),
                    p.size()
                );
            }
            state.insert(k, v.to_kind(Kind::Float).to_device(device));
        }
        self.state = state;
        self.step = step;
        Ok(())
    }
}
