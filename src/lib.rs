//! # topr-loss
//!
//! Reinforcement-learning losses for fine-tuning language models on libtorch, built around
//! **TOPR**, *Tapered Off-Policy REINFORCE* (Le Roux, Bellemare et al., arXiv 2503.14286).
//!
//! ## The problem
//!
//! Fine-tuning an LLM with RL means training on completions sampled from an *older* model μ
//! while the model being trained, π, moves away from it. Plain REINFORCE on such data is
//! unstable: a negative example's loss `R · log π(τ)` with `R < 0` is unbounded below, and the
//! optimiser drives `log π` of every sampled mistake to `−∞`, taking the rest of the model with
//! it. Importance sampling fixes the bias but its weights `π/μ` explode over long sequences.
//! TOPR keeps the best of both: positives get the plain supervised update (weight 1, whatever
//! the ratio), negatives get the importance weight *truncated at 1*, which fades as π moves away
//! from them. It needs no KL penalty and learns from negatives stably.
//!
//! ## The family on one screen
//!
//! ```text
//! R' = R − c     δ = log π(τ) − log μ(τ)     x = e^δ     (a, b) = (a+, b+) if R' ≥ 0 else (a−, b−)
//!
//! ∇J   = E_μ[ R' · [x]_a^b · ∇log π(τ) ]                       [x]_a^b = min(max(x, a), b)
//! J    = E_μ[ R' · T(x; a, b) ]    T(x) = a(1+ln(x/a)) if x<a;  x on [a,b];  b(1+ln(x/b)) if x>b
//! loss = −J                         computed as e^d (1 + δ − d), d = clamp(δ, ln a, ln b)
//!
//!          a+  b+  a−  b−
//! TOPR      1   1   0   1     SFT on positives + truncated IS on negatives
//! REINFORCE 1   1   1   1     SFT      1 1 0 0     TIS   0 1 0 1     IS   0 ∞ 0 ∞
//! ```
//!
//! ## A first example
//!
//! ```
//! use tch::Tensor;
//! use topr_loss::{topr_loss, ToprConfig};
//!
//! // log π(τ_i) from the model being trained (here a leaf tensor), log μ(τ_i) from the sampler.
//! let logp = Tensor::from_slice(&[-12.0f32, -30.0, -25.0]).set_requires_grad(true);
//! let logp_mu = Tensor::from_slice(&[-11.0f32, -28.0, -26.0]);
//! let rewards = Tensor::from_slice(&[1.0f32, -1.0, -1.0]);
//!
//! let loss = topr_loss(&logp, &logp_mu, &rewards, &ToprConfig::default())?;
//! loss.backward();
//! assert!(logp.grad().isfinite().all().int64_value(&[]) == 1);
//! # Ok::<(), topr_loss::LossError>(())
//! ```
//!
//! ## Map of the crate
//!
//! The TOPR family:
//! - [`topr_loss`] and [`ToprConfig`] with its presets, on sequence log-probabilities `[B]`
//!   (`src/topr.rs`).
//! - [`topr_token_loss`] — the same family on per-token log-probabilities `[B, T]` with a padding
//!   mask, at the paper's, verl's or Trinity-RFT's ratio level (`src/topr_token.rs`).
//! - [`taper`], [`truncated_weight`], [`taper_scalar`] — truncation and the taper, in log space
//!   (`src/taper.rs`).
//! - [`effective_positive_proportion`] and its inverse, measured or solved on reward tensors —
//!   the baseline as a knob on the weight of positives (`src/baseline.rs`).
//! - [`topr_diagnostics`], [`topr_token_diagnostics`] — what a trainer logs (`src/diagnostics.rs`).
//!
//! What users compare it with:
//! - [`ppo_clip_loss`], [`gspo_loss`], [`cispo_loss`] with [`PpoConfig`] — PPO-clip (dual clip,
//!   clip-higher), GSPO, CISPO (`src/ppo.rs`).
//! - [`dpo_loss`], [`dpo_rewards`] with [`DpoConfig`] — DPO, cDPO, IPO, hinge, reference-free
//!   (`src/dpo.rs`).
//! - [`group_advantages`] ([`GroupAdvantage`]: GRPO, Dr. GRPO, RLOO, AsymRE) and [`whiten`]
//!   (`src/advantages.rs`).
//! - [`kl_penalty`] with [`KlConfig`] — the k1, k2, k3 estimators as a loss term (`src/kl.rs`).
//!
//! Shared pieces:
//! - [`aggregate`], [`AggregationMode`], [`Normalizer`] — reducing per-token losses, with global
//!   counts for split-invariant gradient accumulation (`src/aggregate.rs`).
//! - [`token_logprobs`], [`fused_token_logprobs`], [`backward_through_logprobs`],
//!   [`backward_through_fused_logprobs`], [`sequence_logprobs`] — log-probabilities from logits or
//!   from hidden states, in chunks, with bounded memory (`src/logprobs.rs`).
//! - [`LossError`] — the one error type (`src/error.rs`); no public function panics.
//!
//! Which calls reproduce which published method (PPO, GRPO, Dr. GRPO, DAPO, GSPO, CISPO, RLOO,
//! DPO, cDPO, IPO, TOPR in the paper, verl, Trinity-RFT and ROLL): `docs/methods.md`.
//!
//! ## Conventions
//!
//! - Every loss is a scalar to **minimise**, the negative of the objective.
//! - `logp_mu` (and every reference or old log-prob) is always detached.
//! - f16 and bf16 inputs are computed in f32; f64 inputs in f64.
//! - Inputs are validated first; a bad argument gives a [`LossError`] that names it.
//! - Padding may hold NaN or inf; it gets exactly zero gradient.

#![warn(missing_docs)]

mod advantages;
mod aggregate;
mod baseline;
mod diagnostics;
mod dpo;
mod error;
mod kl;
mod logprobs;
mod ppo;
mod taper;
mod token_inputs;
mod topr;
mod topr_token;
mod validate;

pub use advantages::{GroupAdvantage, group_advantages, whiten};
pub use aggregate::{AggregationMode, Normalizer, aggregate, sequence_weights};
pub use baseline::{
    baseline_for_effective_proportion, baseline_for_rewards, effective_positive_proportion,
    effective_positive_proportion_of_rewards,
};
pub use diagnostics::{ToprDiagnostics, topr_diagnostics, topr_token_diagnostics};
pub use dpo::{DpoConfig, DpoRewards, DpoVariant, dpo_loss, dpo_rewards};
pub use error::LossError;
pub use kl::{KlConfig, KlEstimator, kl_penalty};
pub use logprobs::{
    LogProbConfig, SequenceReduce, TokenLogProbs, backward_through_fused_logprobs, backward_through_logprobs,
    fused_token_logprobs, sequence_logprobs, token_logprobs,
};
pub use ppo::{PpoConfig, cispo_loss, gspo_loss, ppo_clip_loss};
pub use taper::{taper, taper_scalar, truncated_weight};
pub use topr::{TieRule, ToprConfig, topr_loss};
pub use topr_token::{RatioLevel, ToprTokenConfig, topr_token_loss};
