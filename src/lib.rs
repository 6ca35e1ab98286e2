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
//! - [`topr_loss`] on sequence log-probabilities `[B]` (`src/topr.rs`), and [`ToprConfig`] with
//!   its presets and [`TieRule`] (`src/topr_config.rs`).
//! - [`topr_token_loss`] — the same family on per-token log-probabilities `[B, T]` with a padding
//!   mask, at the paper's, verl's or Trinity-RFT's ratio level (`src/topr_token.rs`).
//! - [`taper`], [`truncated_weight`], [`taper_scalar`] — truncation and the taper, in log space
//!   (`src/taper.rs`).
//! - [`effective_positive_proportion`] and its inverse, measured or solved on reward tensors —
//!   the baseline as a knob on the weight of positives (`src/baseline.rs`).
//! - [`ToprDiagnostics`] — what a trainer logs, from the same pass as the loss (`src/diagnostics.rs`).
//!
//! What users compare it with:
//! - [`ppo_clip_loss`], [`gspo_loss`], [`cispo_loss`] with [`PpoConfig`] and [`PpoDiagnostics`] —
//!   PPO-clip (dual clip, clip-higher), GSPO, CISPO (`src/ppo.rs`).
//! - [`dpo_loss`], [`dpo_rewards`] with [`DpoConfig`] and [`DpoDiagnostics`] — DPO, cDPO, IPO,
//!   hinge, reference-free, and TRL's other pairwise losses: robust DPO, EXO, NCA, BCO, SPPO, AOT,
//!   APO, DiscoPOP, length-normalised DPO ([`DpoVariant`]; `src/dpo.rs`, the settings in
//!   `src/dpo_config.rs`, the per-pair formulas in `src/dpo_pairs.rs`).
//! - [`dpo_mix_loss`] with [`DpoMix`] — a weighted sum of DPO-family losses, TRL's
//!   `loss_type=[..]` with `loss_weights` (`src/dpo_mix.rs`).
//! - [`group_advantages`] ([`GroupAdvantage`]: GRPO, Dr. GRPO, RLOO, AsymRE, batch-std scaling),
//!   [`group_advantages_with`] and [`SingletonGroup`] (what a group of one gets: 0, or verl's raw
//!   reward), [`opo_advantages`] (OPO's length-weighted baseline), [`maxrl_advantages`] (MaxRL:
//!   the gap to the group mean over the mean) and [`whiten`] (`src/advantages.rs`).
//! - [`optimal_token_baseline_advantages`] — the optimal token baseline: per group and position,
//!   returns weighted by each completion's accumulated gradient variance (`src/optimal_baseline.rs`);
//!   [`overlong_penalty`] — DAPO's soft overlong punishment, a reward term on lengths
//!   (`src/overlong.rs`).
//! - [`reinforce_pp_advantages`], [`reinforce_pp_baseline_advantages`], [`remax_advantages`] and
//!   [`TokenAdvantages`] — REINFORCE++, REINFORCE++-baseline and ReMax from token-level rewards
//!   (`src/token_advantages.rs`); [`gae_advantages`] — GAE (`src/gae.rs`).
//! - [`value_loss`] with [`ValueLossConfig`] and [`ValueDiagnostics`] — PPO's clipped value loss
//!   (`src/value.rs`).
//! - [`kl_penalty`] with [`KlConfig`] and [`KlDiagnostics`] — the k1, abs, k2, k3 estimators as a
//!   loss term, with verl's clamp of the estimate and its straight-through `+` forms;
//!   [`kl_penalty_corrected`] — TRL's importance-corrected KL (`src/kl.rs`).
//! - [`kl_penalized_rewards`] and [`KlRewards`] — the KL penalty in the reward
//!   (`src/kl_reward.rs`), with [`AdaptiveKlController`] and [`FixedKlController`] for its
//!   coefficient (`src/kl_control.rs`).
//! - [`sapo_loss`] with [`SapoConfig`] — SAPO's smooth, asymmetric gate in place of the clip
//!   (`src/sapo.rs`).
//! - [`dppo_loss`] with [`DppoConfig`] — DPPO's trust region on the token's probability (binary
//!   total variation or KL) in place of the ratio clip (`src/dppo.rs`).
//! - [`dro_loss`] with [`DroConfig`] — REINFORCE with a quadratic log-ratio penalty, verl's `dro`
//!   (`src/dro.rs`).
//! - [`vespo_loss`] with [`VespoConfig`] and [`VespoDiagnostics`] — VESPO's gamma-shaped weight of
//!   each sequence's ratio on REINFORCE (`src/vespo.rs`).
//! - [`gmpo_loss`] with [`GmpoConfig`] — GMPO's geometric mean of sign-clipped token ratios
//!   (`src/gmpo.rs`).
//! - [`clip_cov_loss`] with [`ClipCovConfig`], [`kl_cov_loss`] with [`KlCovConfig`] — Clip-Cov and
//!   KL-Cov, which act on the tokens of largest covariance between log-probability and advantage;
//!   the selection couples the tokens of a call (`src/covariance.rs`).
//! - [`entropy_loss`] with [`EntropyConfig`] and [`EntropyDiagnostics`] — the entropy bonus as a
//!   loss term; [`top_entropy_mask`] — train on the highest-entropy share of tokens
//!   (`src/entropy.rs`).
//! - [`AdaptiveEntropyController`] — Skywork-OR1's adaptive coefficient of the entropy bonus: up
//!   by Δ while the measured entropy is below a target, down otherwise, the bonus off at or above
//!   it (`src/entropy_control.rs`).
//! - [`sft_phi_loss`] with [`SftPhiConfig`], [`SftWeight`] and [`SftDiagnostics`], and
//!   [`chord_mu`] — CHORD's SFT term on expert data (each token weighted by the stop-gradient
//!   `p(1 − p)`, `p` or 1) and its schedule `μ` for `(1 − μ) L_RL + μ L_SFT`;
//!   [`positive_nll_loss`] with [`PositiveNllConfig`] and [`PositiveNllDiagnostics`] — VAPO's NLL
//!   on the policy's own positive samples, added to PPO (`src/sft_mixing.rs`).
//!
//! Correcting for the sampler–trainer mismatch (`src/rollout_correction.rs`):
//! - [`rollout_weights`] with [`RolloutCorrection`] (token or sequence level, truncated (TIS) or
//!   masked (MIS / IcePop)) and [`RolloutDiagnostics`] (incl. the effective sample size);
//! - [`rollout_rejection_mask`] with [`Rejection`] (k1/k2/k3 statistics per token or sequence),
//!   [`off_policy_sequence_mask`] (DeepSeek-V3.2), [`effective_sample_size`];
//! - [`apply_token_weights`] — per-token weights on the `terms` of any loss, then its aggregation.
//!
//! Stale and asynchronous data (`src/decoupled.rs`):
//! - [`decoupled_ppo_loss`] with [`DecoupledPpoConfig`] and [`DecoupledPpoOutput`] — PPO-clip
//!   around a proximal policy, weighted by its ratio to the behaviour policy (AReaL, verl's
//!   decoupled mode);
//! - [`proximal_logprobs`] with [`ProximalApproximation`] — the proximal log-probs approximated
//!   from the behaviour and current policies and the data's staleness;
//! - [`m2po_mask`] — M2PO's second-moment mask.
//!
//! TOPR's successors (`src/successors.rs`, `src/lens.rs`):
//! - [`bapo_loss`] with [`BapoConfig`] and [`BapoDiagnostics`] — BAPO: PPO-clip with a clip window
//!   searched per call until the positive advantages carry a set share of the loss;
//!   [`bapo_clip_bounds`] with [`BapoBounds`] — the search alone, on the device;
//! - [`prefix_ratio_loss`] with [`PrefixRatioConfig`], [`PrefixRatio`] and [`PrefixClip`] — CTPO:
//!   each token weighted by the importance ratio of its whole prefix, with CTPO-LA's window that
//!   widens with the position;
//! - [`lens_rewards`], [`lens_advantages`] with [`LensConfig`] — LENS: incorrect completions
//!   penalised by the sampler's confidence, so that groups without a correct answer teach too
//!   (usable as TOPR's rewards).
//!
//! Shared pieces:
//! - [`LossOutput`], [`OnDevice`], [`Diagnostics`] — what the `…_output` functions return: the
//!   loss, its unreduced terms and its diagnostics from the same pass (`src/output.rs`).
//! - [`aggregate`], [`AggregationMode`], [`Normalizer`], [`BatchCounts`] — reducing per-token
//!   losses, with global counts for split-invariant gradient accumulation (`src/aggregate.rs`).
//! - [`token_logprobs`], [`fused_token_logprobs`], [`backward_through_logprobs`],
//!   [`backward_through_fused_logprobs`], [`sequence_logprobs`] — log-probabilities from logits or
//!   from hidden states, in chunks, with bounded memory (`src/logprobs.rs`).
//! - [`LossError`] — the one error type (`src/error.rs`); no public function panics.
//! - [`Checks`], [`host_reads`] — value checks or shape checks only, and the host reads they
//!   cost (`src/checks.rs`).
//!
//! Which calls reproduce which published method (PPO, GRPO, Dr. GRPO, DAPO, GSPO, CISPO, SAPO,
//! GMPO, Clip-Cov, KL-Cov, RLOO, REINFORCE++, ReMax, OPO, MaxRL, the optimal token baseline, GAE,
//! DPO and its TRL variants, TOPR in the paper, verl, Trinity-RFT and ROLL, rollout correction,
//! Skywork-OR1's adaptive entropy, CHORD, VAPO's positive NLL, BAPO, CTPO, LENS):
//! `docs/methods.md`.
//!
//! ## One API for every loss
//!
//! Every loss is a pair of functions: the plain one returns the loss tensor; the `…_output` one
//! takes the same arguments plus the step's [`Normalizer`] and returns a [`LossOutput`]: the same
//! loss, its unreduced terms, and its diagnostics from the same pass (on the device until read).
//!
//! | loss | plain call | with counts, terms, diagnostics | config presets | diagnostics |
//! |---|---|---|---|---|
//! | TOPR family, `[B]` | `topr_loss(logp, logp_mu, rewards, cfg)` | [`topr_loss_output`]`(.., cfg, norm)` | [`ToprConfig`]`::{canonical, naive_reinforce, sft, tis, importance_sampling}` | [`ToprDiagnostics`] |
//! | TOPR family, `[B, T]` | `topr_token_loss(logp, logp_mu, rewards, mask, cfg)` | [`topr_token_loss_output`]`(.., cfg, norm)` | [`ToprTokenConfig`]`::{paper, verl, trinity}` | [`ToprDiagnostics`] |
//! | PPO-clip | `ppo_clip_loss(logp, logp_mu, advantages, mask, cfg)` | [`ppo_clip_loss_output`]`(.., cfg, norm)` | [`PpoConfig`]`::{ppo, dapo}` | [`PpoDiagnostics`] |
//! | GSPO | `gspo_loss(logp, logp_mu, advantages, mask, cfg)` | [`gspo_loss_output`]`(.., cfg, norm)` | [`PpoConfig::gspo`] | [`PpoDiagnostics`] |
//! | CISPO | `cispo_loss(logp, logp_mu, advantages, mask, cfg)` | [`cispo_loss_output`]`(.., cfg, norm)` | [`PpoConfig::cispo`] | [`PpoDiagnostics`] |
//! | DPO family | `dpo_loss(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, cfg)` | [`dpo_loss_output`]`(.., cfg, norm)` | [`DpoConfig`]`::{dpo, cdpo, ipo, hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sigmoid_norm}` | [`DpoDiagnostics`] |
//! | DPO mixture | `dpo_mix_loss(logp_chosen, logp_rejected, logp_ref_chosen, logp_ref_rejected, mix)` | [`dpo_mix_loss_output`]`(.., mix, norm)` | [`DpoMix`]`::of(cfg, w).with_term(cfg, w)` | [`DpoDiagnostics`] |
//! | KL penalty | `kl_penalty(logp, logp_ref, mask, cfg)` | [`kl_penalty_output`]`(.., cfg, norm)` | [`KlConfig`]`::{k1, k2, k3, abs, low_var_kl}` | [`KlDiagnostics`] |
//! | importance-corrected KL | `kl_penalty_corrected(logp, logp_mu, logp_ref, mask, cfg)` | [`kl_penalty_corrected_output`]`(.., cfg, norm)` | [`KlConfig`] as above | [`KlDiagnostics`] |
//! | clipped value loss | `value_loss(values, values_old, returns, mask, cfg)` | [`value_loss_output`]`(.., cfg, norm)` | [`ValueLossConfig`]`::{ppo, verl}` | [`ValueDiagnostics`] |
//! | SAPO | `sapo_loss(logp, logp_mu, advantages, mask, cfg)` | [`sapo_loss_output`]`(.., cfg, norm)` | [`SapoConfig::sapo`] | [`PpoDiagnostics`] |
//! | DPPO | `dppo_loss(logp, logp_mu, advantages, mask, cfg)` | [`dppo_loss_output`]`(.., cfg, norm)` | [`DppoConfig::tv`], [`DppoConfig::binary_kl`] | [`PpoDiagnostics`] |
//! | DRO | `dro_loss(logp, logp_mu, advantages, mask, cfg)` | [`dro_loss_output`]`(.., cfg, norm)` | [`DroConfig::new`] | [`PpoDiagnostics`] |
//! | decoupled PPO | `decoupled_ppo_loss(logp, logp_proximal, logp_behaviour, advantages, mask, cfg)` | [`decoupled_ppo_loss_output`]`(.., cfg, norm)` | [`DecoupledPpoConfig`]`::{areal, verl}` | [`PpoDiagnostics`] and [`RolloutDiagnostics`] |
//! | VESPO | `vespo_loss(logp, logp_mu, advantages, mask, cfg)` | [`vespo_loss_output`]`(.., cfg, norm)` | [`VespoConfig::vespo`] | [`VespoDiagnostics`] |
//! | GMPO | `gmpo_loss(logp, logp_mu, advantages, mask, cfg)` | [`gmpo_loss_output`]`(.., cfg, norm)` | [`GmpoConfig::gmpo`] | [`PpoDiagnostics`] |
//! | Clip-Cov | `clip_cov_loss(logp, logp_mu, advantages, mask, keys, cfg)` | [`clip_cov_loss_output`]`(.., cfg, norm)` | [`ClipCovConfig::clip_cov`] | [`PpoDiagnostics`] |
//! | KL-Cov | `kl_cov_loss(logp, logp_mu, advantages, mask, cfg)` | [`kl_cov_loss_output`]`(.., cfg, norm)` | [`KlCovConfig::kl_cov`] | [`PpoDiagnostics`] |
//! | entropy bonus | `entropy_loss(entropy, mask, cfg)` | [`entropy_loss_output`]`(.., cfg, norm)` | [`EntropyConfig::bonus`] | [`EntropyDiagnostics`] |
//! | CHORD's SFT term | `sft_phi_loss(logp, mask, cfg)` | [`sft_phi_loss_output`]`(.., cfg, norm)` | [`SftPhiConfig`]`::{chord_phi, sft, sft_is}` | [`SftDiagnostics`] |
//! | VAPO's positive NLL | `positive_nll_loss(logp, mask, positive, cfg)` | [`positive_nll_loss_output`]`(.., cfg, norm)` | [`PositiveNllConfig::vapo`] | [`PositiveNllDiagnostics`] |
//! | BAPO | `bapo_loss(logp, logp_mu, advantages, mask, cfg)` | [`bapo_loss_output`]`(.., cfg, norm)` | [`BapoConfig`]`::{paper, recipe}` | [`BapoDiagnostics`] |
//! | prefix ratio (CTPO) | `prefix_ratio_loss(logp, logp_mu, advantages, mask, cfg)` | [`prefix_ratio_loss_output`]`(.., cfg, norm)` | [`PrefixRatioConfig`]`::{ctpo_la, ctpo, ctpo_geomean_la}` | [`PpoDiagnostics`] |
//!
//! Advantages are computed before the loss, detached, in f64 for f64 rewards and f32 otherwise:
//!
//! | estimator | call | returns |
//! |---|---|---|
//! | GRPO, Dr. GRPO, RLOO, AsymRE, batch std | [`group_advantages`]`(rewards [G, K], method)`, [`group_advantages_with`]`(.., singleton)` | `[G, K]` |
//! | OPO | [`opo_advantages`]`(rewards [G, K], lengths [G, K], singleton)` | `[G, K]` |
//! | MaxRL | [`maxrl_advantages`]`(rewards [G, K] ≥ 0, eps)` | `[G, K]` |
//! | LENS | [`lens_rewards`]`(rewards [G, K] ∈ {0, 1}, logp_old, mask [G·K, T])`, [`lens_advantages`]`(.., cfg)` | `[G, K]` |
//! | optimal token baseline | [`optimal_token_baseline_advantages`]`(logp_mu, sum_pi_squared, token_rewards, mask [G·K, T], is_weights, group_size, singleton, eps)` | [`TokenAdvantages`] |
//! | DAPO overlong penalty (a reward term) | [`overlong_penalty`]`(lengths, max_len, buffer_len, penalty_factor)` | the shape of `lengths` |
//! | REINFORCE++ | [`reinforce_pp_advantages`]`(token_rewards, mask, gamma, eps)` | [`TokenAdvantages`] |
//! | REINFORCE++-baseline | [`reinforce_pp_baseline_advantages`]`(rewards [G, K], mask [G·K, T], eps, singleton)` | `[G·K, T]` |
//! | ReMax | [`remax_advantages`]`(token_rewards, greedy_rewards, mask)` | [`TokenAdvantages`] |
//! | GAE | [`gae_advantages`]`(token_rewards, values, mask, gamma, lam)` | [`TokenAdvantages`] |
//! | KL in the reward | [`kl_penalized_rewards`]`(logp, logp_ref, token_scores, mask, cfg)` | [`KlRewards`] |
//!
//! The conventions behind the table:
//!
//! - **Order**: the policy's log-probs first, then the other policy's, then the per-sequence (or
//!   per-token) signal, then the mask, then the config, then (for `…_output`) the normaliser.
//! - **Names** say the role: `logp` is the policy being trained (differentiable); `logp_mu` the
//!   behaviour policy μ that sampled the data (PPO's "old" policy is μ); `logp_ref` a fixed
//!   reference model (KL, DPO). `rewards` are raw rewards `R` from which the loss subtracts its
//!   own baseline (`cfg.baseline`, the TOPR family); `advantages` are used as given (the PPO
//!   family). Advantages can be passed to the TOPR family as rewards with baseline 0 (the
//!   branch then follows the advantage's sign, as in verl and Trinity-RFT).
//! - **Masks**: a loss on `[B, T]` inputs always takes `mask: &Tensor` (bool, integer or 0/1
//!   floating); utilities that can run without padding ([`token_logprobs`], [`whiten`]) take
//!   `Option<&Tensor>`.
//! - **Counts** are per call: the plain function uses this call's counts; pass the
//!   [`Normalizer`] of the whole optimiser step to `…_output` for split-invariant gradient
//!   accumulation. Configs hold only run-long settings.
//! - **Configs** are `#[non_exhaustive]`: start from a preset (`const fn`), change knobs with
//!   `with_…` methods; `Default` is the first preset. So are the enums: match them with a `_` arm.
//! - Every loss is a scalar to **minimise**, the negative of the objective.
//! - `logp_mu` and `logp_ref` are always detached.
//! - f16 and bf16 inputs are computed in f32; f64 inputs in f64.
//! - **Checks**: by default every loss checks values too (NaN in real entries, 0/1 masks, empty
//!   batches, a finite result), which reads a few values back to the host per call. Set
//!   `with_checks(Checks::Shapes)` on the config for shape, dtype and device checks only and no
//!   host read at all (a GPU training loop that never stalls); [`host_reads`] counts the reads.
//! - Inputs are validated first; a bad argument gives a [`LossError`] that names it, with the
//!   libtorch error as its `source()` where there is one. Closures given to
//!   [`backward_through_logprobs`] return the caller's own error type.
//! - Padding may hold NaN or inf; it gets exactly zero gradient.
//!
//! ## Features
//!
//! - `serde`: `Serialize` and `Deserialize` for every config and its enums, to record a run's
//!   settings or read them from a file. Enum values are the snake-case names of their variants
//!   (`"sequence_mean"`, `"seq_max"` for [`RejectionScope::SequenceMax`] as in verl,
//!   `{"dr_grpo": {"length": 512.0}}`); an infinite limit (`b_pos` of
//!   [`ToprConfig::importance_sampling`], `clip_low` of [`PpoConfig::cispo`]) is written as `null`;
//!   a config with a `Default` reads a record that leaves fields out with the default's values; a
//!   [`DpoMix`] is the list of its `(config, weight)` terms. A config read from a file is checked
//!   like any other (its `validate`, and every loss call).
//!
//!   ```
//!   # #[cfg(feature = "serde")] {
//!   let cfg: topr_loss::ToprConfig = serde_json::from_str(r#"{"baseline": -0.5}"#).unwrap();
//!   assert_eq!(cfg, topr_loss::ToprConfig::canonical().with_baseline(-0.5));
//!   assert_eq!(serde_json::to_string(&topr_loss::RatioLevel::Token).unwrap(), r#""token""#);
//!   # }
//!   ```
//! - `doc-only`: builds the documentation without libtorch (docs.rs); the library cannot run.

#![warn(missing_docs)]

mod advantages;
mod aggregate;
mod baseline;
mod checks;
mod covariance;
mod decoupled;
mod diagnostics;
mod dpo;
mod dpo_config;
mod dpo_mix;
mod dpo_pairs;
mod dppo;
mod dro;
mod entropy;
mod entropy_control;
mod error;
mod gae;
mod gmpo;
mod kl;
mod kl_control;
mod kl_reward;
mod lens;
mod logprobs;
mod optimal_baseline;
mod output;
mod overlong;
mod ppo;
mod rollout_correction;
mod sapo;
#[cfg(feature = "serde")]
mod serde_support;
mod setters;
mod sft_mixing;
mod successors;
mod taper;
mod token_advantages;
mod token_inputs;
mod topr;
mod topr_config;
mod topr_token;
mod validate;
mod value;
mod vespo;

pub use advantages::{
    GroupAdvantage, SingletonGroup, gdpo_advantages, group_advantages, group_advantages_with, maxrl_advantages,
    opo_advantages, passk_advantages, whiten,
};
pub use aggregate::{AggregationMode, BatchCounts, Normalizer, aggregate, sequence_weights};
pub use baseline::{
    baseline_for_effective_proportion, baseline_for_rewards, effective_positive_proportion,
    effective_positive_proportion_of_rewards,
};
pub use checks::{Checks, LOG_PROB_TOLERANCE, host_reads};
pub use covariance::{
    ClipCovConfig, KlCovConfig, clip_cov_loss, clip_cov_loss_output, kl_cov_loss, kl_cov_loss_output,
};
pub use decoupled::{
    DecoupledPpoConfig, DecoupledPpoOutput, ProximalApproximation, decoupled_ppo_loss, decoupled_ppo_loss_output,
    m2po_mask, proximal_logprobs, proximal_logprobs_with_checks,
};
pub use diagnostics::ToprDiagnostics;
pub use dpo::{DpoDiagnostics, DpoRewards, dpo_loss, dpo_loss_output, dpo_rewards};
pub use dpo_config::{DpoConfig, DpoVariant};
pub use dpo_mix::{DpoMix, dpo_mix_loss, dpo_mix_loss_output};
pub use dppo::{DppoConfig, DppoDivergence, dppo_loss, dppo_loss_output};
pub use dro::{DroConfig, dro_loss, dro_loss_output};
pub use entropy::{EntropyConfig, EntropyDiagnostics, entropy_loss, entropy_loss_output, top_entropy_mask};
pub use entropy_control::AdaptiveEntropyController;
pub use error::{LossError, TorchError};
pub use gae::gae_advantages;
pub use gmpo::{GmpoConfig, gmpo_loss, gmpo_loss_output};
pub use kl::{
    KlConfig, KlDiagnostics, KlEstimator, kl_penalty, kl_penalty_corrected, kl_penalty_corrected_output,
    kl_penalty_output,
};
pub use kl_control::{AdaptiveKlController, FixedKlController};
pub use kl_reward::{KlRewards, kl_penalized_rewards};
pub use lens::{LensConfig, lens_advantages, lens_rewards};
pub use logprobs::{
    LogProbConfig, SequenceReduce, TokenLogProbs, backward_through_fused_logprobs, backward_through_logprobs,
    fused_token_logprobs, sequence_logprobs, sequence_logprobs_with_checks, token_logprobs,
};
pub use optimal_baseline::optimal_token_baseline_advantages;
pub use output::{Diagnostics, LossOutput, OnDevice};
pub use overlong::overlong_penalty;
pub use ppo::{
    PpoConfig, PpoDiagnostics, cispo_loss, cispo_loss_output, gspo_loss, gspo_loss_output, ppo_clip_loss,
    ppo_clip_loss_output,
};
pub use rollout_correction::{
    CorrectionLevel, Divergence, Rejection, RejectionScope, RolloutCorrection, RolloutDiagnostics, RolloutWeights,
    WeightRule, apply_token_weights, effective_sample_size, off_policy_sequence_mask, rollout_rejection_mask,
    rollout_rejection_mask_all, rollout_weights,
};
pub use sapo::{SapoConfig, sapo_loss, sapo_loss_output};
pub use sft_mixing::{
    PositiveNllConfig, PositiveNllDiagnostics, SftDiagnostics, SftPhiConfig, SftWeight, chord_mu, positive_nll_loss,
    positive_nll_loss_output, sft_phi_loss, sft_phi_loss_output,
};
pub use successors::{
    BAPO_MAX_STEPS, BapoBounds, BapoConfig, BapoDiagnostics, PrefixClip, PrefixRatio, PrefixRatioConfig,
    bapo_clip_bounds, bapo_loss, bapo_loss_output, prefix_ratio_loss, prefix_ratio_loss_output,
};
pub use taper::{taper, taper_scalar, truncated_weight};
pub use token_advantages::{
    TokenAdvantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages, remax_advantages,
};
pub use topr::{topr_loss, topr_loss_output};
pub use topr_config::{TieRule, ToprConfig};
pub use topr_token::{RatioLevel, ToprTokenConfig, topr_token_loss, topr_token_loss_output};
pub use value::{ValueDiagnostics, ValueLossConfig, value_loss, value_loss_output};
pub use vespo::{VESPO_MIN_LOG_WEIGHT, VespoConfig, VespoDiagnostics, vespo_loss, vespo_loss_output};
