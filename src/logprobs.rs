//! Token log-probabilities of given labels from a language model's output, in chunks, so that
//! the extra memory stays bounded by the chunk size instead of the batch's `[B, T, V]`.
//!
//! ```text
//! log π(y_t) = z_t[y_t]/τ − logsumexp(z_t/τ)         H_t = −Σ_v p_t,v log p_t,v,   p_t = softmax(z_t/τ)
//! ```
//!
//! Two inputs are supported:
//!
//! - **logits** `[B, T, V]` ([`token_logprobs`], [`backward_through_logprobs`]): each chunk of
//!   tokens is upcast to f32 on its own, so a bf16 model never makes a float32 copy of the whole
//!   `[B, T, V]`;
//! - **last hidden states** `[B, T, H]` and the output projection `[V, H]`
//!   ([`fused_token_logprobs`], [`backward_through_fused_logprobs`]): logits exist one chunk at a
//!   time and `[B, T, V]` is never materialised, as fused linear cross-entropy kernels do.
//!
//! **Gradients.** Autograd on chunked code would keep every chunk's f32 intermediates for the
//! backward pass, which is the very memory this module avoids. The `backward_through_*` functions
//! therefore run in two passes: they compute the log-probs (and entropies) without a graph, hand
//! them to your loss as leaf tensors, back-propagate the loss to those leaves, and then push the
//! gradient into the logits (or hidden states and projection) chunk by chunk with the closed form
//!
//! ```text
//! ∂ log π(y_t)/∂z_t = (onehot(y_t) − p_t)/τ        ∂H_t/∂z_t = −p_t (log p_t + H_t)/τ
//! ```
//!
//! The gradient equals that of the naive `log_softmax` + `gather` (tested to 1e-5 in f32).

use crate::aggregate::{mask_float, masked_fill_zero, zero_padding};
use crate::checks::{Checks, read_i64};
use crate::error::LossError;
use crate::validate;
use tch::{Device, Kind, Tensor};

/// Options of the log-prob extraction.
///
/// `Default` ([`LogProbConfig::new`]): chunks of 1024 tokens, no ignore index, no entropy,
/// temperature 1. Change one knob with the `with_…` methods.
///
/// # Example
/// ```
/// use topr_loss::LogProbConfig;
/// let cfg = LogProbConfig::new().with_entropy(true).with_ignore_index(Some(-100));
/// assert!(cfg.validate().is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct LogProbConfig {
    /// Tokens per chunk (> 0): the extra memory is about `chunk_tokens × V` f32 values (a few
    /// times that during the backward pass).
    pub chunk_tokens: i64,
    /// Labels equal to this value are treated as padding (as PyTorch's `ignore_index = -100`).
    pub ignore_index: Option<i64>,
    /// Also compute the per-token entropy of the (tempered) distribution.
    pub with_entropy: bool,
    /// Divide logits by this temperature (> 0) first; 1 gives the model's own distribution.
    pub temperature: f64,
}

impl Default for LogProbConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl LogProbConfig {
    /// Chunks of 1024 tokens, no ignore index, no entropy, temperature 1.
    ///
    /// ```
    /// assert_eq!(topr_loss::LogProbConfig::new().chunk_tokens, 1024);
    /// ```
    pub const fn new() -> Self {
        Self { chunk_tokens: 1024, ignore_index: None, with_entropy: false, temperature: 1.0 }
    }

    /// PyTorch's convention: labels equal to −100 are padding.
    ///
    /// ```
    /// assert_eq!(topr_loss::LogProbConfig::pytorch().ignore_index, Some(-100));
    /// ```
    pub const fn pytorch() -> Self {
        Self::new().with_ignore_index(Some(-100))
    }

    /// The same config with another chunk size.
    ///
    /// ```
    /// assert_eq!(topr_loss::LogProbConfig::new().with_chunk_tokens(256).chunk_tokens, 256);
    /// ```
    pub const fn with_chunk_tokens(self, chunk_tokens: i64) -> Self {
        Self { chunk_tokens, ..self }
    }

    /// The same config with another ignore index.
    ///
    /// ```
    /// assert_eq!(topr_loss::LogProbConfig::new().with_ignore_index(Some(0)).ignore_index, Some(0));
    /// ```
    pub const fn with_ignore_index(self, ignore_index: Option<i64>) -> Self {
        Self { ignore_index, ..self }
    }

    /// The same config with or without the per-token entropy.
    ///
    /// ```
    /// assert!(topr_loss::LogProbConfig::new().with_entropy(true).with_entropy);
    /// ```
    pub const fn with_entropy(self, with_entropy: bool) -> Self {
        Self { with_entropy, ..self }
    }

    /// The same config with another temperature.
    ///
    /// ```
    /// assert_eq!(topr_loss::LogProbConfig::new().with_temperature(0.7).temperature, 0.7);
    /// ```
    pub const fn with_temperature(self, temperature: f64) -> Self {
        Self { temperature, ..self }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`LossError::InvalidConfig`] for a non-positive chunk size or a non-positive or non-finite
    /// temperature.
    ///
    /// ```
    /// assert!(topr_loss::LogProbConfig::new().with_chunk_tokens(0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), LossError> {
        if self.chunk_tokens <= 0 {
            return Err(LossError::InvalidConfig {
                field: "chunk_tokens",
                value: self.chunk_tokens as f64,
                reason: "must be > 0".into(),
            });
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(LossError::InvalidConfig {
                field: "temperature",
                value: self.temperature,
                reason: "must be finite and > 0".into(),
            });
        }
        Ok(())
    }
}

/// Per-token log-probs (and entropies) with the mask they are valid under.
///
/// # Example
/// ```
/// use tch::{Kind, Tensor};
/// use topr_loss::{token_logprobs, LogProbConfig};
/// let logits = Tensor::zeros([1, 2, 4], (Kind::Float, tch::Device::Cpu)); // uniform over 4
/// let labels = Tensor::from_slice2(&[[3i64, -100]]);
/// let cfg = LogProbConfig::pytorch().with_entropy(true);
/// let out = token_logprobs(&logits, &labels, None, &cfg)?;
/// assert!((out.logp.double_value(&[0, 0]) + 4f64.ln()).abs() < 1e-6);
/// assert_eq!(out.logp.double_value(&[0, 1]), 0.0); // ignored
/// assert_eq!(out.mask.int64_value(&[0, 1]), 0);
/// assert!((out.entropy.unwrap().double_value(&[0, 0]) - 4f64.ln()).abs() < 1e-6);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct TokenLogProbs {
    /// `[B, T]` f32 (f64 for f64 inputs) `log π(y_t)`; 0 where `mask` is false.
    pub logp: Tensor,
    /// `[B, T]` entropies when asked for; 0 where `mask` is false.
    pub entropy: Option<Tensor>,
    /// `[B, T]` bool: the given mask, with ignored labels removed.
    pub mask: Tensor,
}

/// How [`sequence_logprobs`] reduces a sequence's token log-probs.
///
/// # Example
/// ```
/// assert_eq!(topr_loss::SequenceReduce::default(), topr_loss::SequenceReduce::Sum);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum SequenceReduce {
    /// `Σ_t m log π_t`: the sequence log-probability (DPO, TOPR).
    #[default]
    Sum,
    /// `Σ_t m log π_t / Σ_t m`: the per-token average (IPO, length-normalised ratios).
    Mean,
}

/// Validated shapes and flattened views of the inputs.
struct Prepared {
    /// `[N]` indices (into the flattened `[B·T]`) of the valid tokens.
    valid_idx: Tensor,
    /// `[N]` labels of the valid tokens.
    labels: Tensor,
    /// `[B, T]` bool.
    mask: Tensor,
    /// `[B, T]`.
    shape: [i64; 2],
    kind: Kind,
    device: Device,
}

fn prepare(
    labels: &Tensor,
    mask: Option<&Tensor>,
    shape: [i64; 2],
    vocab: i64,
    kind: Kind,
    device: Device,
    cfg: &LogProbConfig,
) -> Result<Prepared, LossError> {
    cfg.validate()?;
    validate::dense_tensor(labels, "labels")?;
    let lk = labels.f_kind().map_err(|_| LossError::WrongDtype {
        argument: "labels",
        found: "unknown".into(),
        expected: "an integer tensor of token ids",
    })?;
    if !matches!(lk, Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8) {
        return Err(LossError::WrongDtype {
            argument: "labels",
            found: format!("{lk:?}"),
            expected: "an integer tensor of token ids",
        });
    }
    validate::same_shape(labels, "labels", &shape, "[B, T], the first two dimensions of the model output")?;
    validate::same_device(labels, "labels", device, "the model output")?;
    let labels = labels.f_to_kind(Kind::Int64)?;
    let mut valid = match mask {
        Some(m) => {
            let m = validate::bool_mask(m, "mask")?;
            validate::same_shape(&m, "mask", &shape, "[B, T], the shape of `labels`")?;
            validate::same_device(&m, "mask", device, "the model output")?;
            m
        }
        None => labels.f_ones_like()?.f_to_kind(Kind::Bool)?,
    };
    if let Some(ignore) = cfg.ignore_index {
        valid = valid.f_logical_and(&labels.f_ne(ignore)?)?;
    }
    let out_of_range = labels.f_lt(0)?.f_logical_or(&labels.f_ge(vocab)?)?.f_logical_and(&valid)?;
    if read_i64(&out_of_range.f_any()?, &[])? != 0 {
        let bad = read_i64(&labels.f_masked_select(&out_of_range)?, &[0])?;
        return Err(LossError::InvalidArgument {
            argument: "labels",
            value: bad as f64,
            reason: format!("a token id outside the vocabulary [0, {vocab}) at an unmasked position"),
        });
    }
    let valid_idx = valid.f_flatten(0, -1)?.f_nonzero()?.f_squeeze_dim(1)?; // [N]
    let flat_labels = labels.f_flatten(0, -1)?.f_index_select(0, &valid_idx)?;
    Ok(Prepared { valid_idx, labels: flat_labels, mask: valid, shape, kind, device })
}

/// Chunk `c` of the valid tokens: `(indices into [B·T], labels)`.
fn chunks(p: &Prepared, cfg: &LogProbConfig) -> Result<Vec<(Tensor, Tensor)>, LossError> {
    let n = p.valid_idx.size()[0];
    let mut out = vec![];
    let mut start = 0;
    while start < n {
        let len = cfg.chunk_tokens.min(n - start);
        out.push((p.valid_idx.f_narrow(0, start, len)?, p.labels.f_narrow(0, start, len)?));
        start += len;
    }
    Ok(out)
}

/// The forward quantities of one chunk of logits `z [n, V]` (already in the compute dtype and
/// divided by the temperature): log-probs of the labels, and entropies if asked.
struct ChunkForward {
    logp: Tensor,
    entropy: Option<Tensor>,
}

fn chunk_forward(z: &Tensor, y: &Tensor, with_entropy: bool) -> Result<ChunkForward, LossError> {
    let lse = z.f_logsumexp([-1i64], true)?; // [n, 1]
    let logp = z.f_gather(1, &y.f_unsqueeze(1)?, false)?.f_sub(&lse)?.f_squeeze_dim(1)?;
    let entropy = if with_entropy {
        let logp_all = finite_floor(&z.f_sub(&lse)?)?;
        Some(logp_all.f_exp()?.f_mul(&logp_all)?.f_sum_dim_intlist(1, false, None::<Kind>)?.f_neg()?)
    } else {
        None
    };
    Ok(ChunkForward { logp, entropy })
}

/// `∂L/∂z [n, V]` of one chunk from `g_logp [n]` and `g_entropy [n]` (closed form), divided by
/// the temperature so that it is the gradient w.r.t. the raw logits.
/// Replaces `−inf` log-probabilities (vocabulary entries masked with `−inf` logits) by the
/// dtype's lowest finite value, so that `p log p = 0 · (−inf)` becomes `0`, not NaN.
fn finite_floor(logp_all: &Tensor) -> Result<Tensor, LossError> {
    let lowest = if logp_all.f_kind()? == Kind::Double { f64::MIN } else { f32::MIN as f64 };
    Ok(logp_all.f_clamp_min(lowest)?)
}

fn chunk_backward(
    z: &Tensor,
    y: &Tensor,
    g_logp: &Tensor,
    g_entropy: Option<&Tensor>,
    temperature: f64,
) -> Result<Tensor, LossError> {
    let logp_all = finite_floor(&z.f_log_softmax(-1, None::<Kind>)?)?;
    let p = logp_all.f_exp()?;
    // g_logp (onehot(y) − p)
    let mut grad = p.f_mul(&g_logp.f_unsqueeze(1)?)?.f_neg()?;
    let _ = grad.f_scatter_add_(1, &y.f_unsqueeze(1)?, &g_logp.f_unsqueeze(1)?)?;
    if let Some(ge) = g_entropy {
        // g_H · (−p (log p + H)), H = −Σ p log p
        let h = p.f_mul(&logp_all)?.f_sum_dim_intlist(1, true, None::<Kind>)?.f_neg()?;
        let dh = p.f_mul(&logp_all.f_add(&h)?)?.f_neg()?;
        grad = grad.f_add(&dh.f_mul(&ge.f_unsqueeze(1)?)?)?;
    }
    if temperature != 1.0 {
        grad = grad.f_div_scalar(temperature)?;
    }
    Ok(grad)
}

/// Runs the closed-form backward chunk by chunk, without a graph: for each chunk of valid tokens,
/// `use_grad(idx, ∂L/∂z)` with `idx [n]` the chunk's flat token indices and `∂L/∂z [n, V]` from
/// the loss's gradients w.r.t. the log-probs and entropies.
fn for_each_chunk_gradient(
    p: &Prepared,
    cfg: &LogProbConfig,
    rows: &dyn Fn(&Tensor) -> Result<Tensor, LossError>,
    grads: &LeafGrads,
    mut use_grad: impl FnMut(&Tensor, &Tensor) -> Result<(), LossError>,
) -> Result<(), LossError> {
    let g_logp = grads.logp.f_flatten(0, -1)?;
    let g_ent = grads.entropy.as_ref().map(|g| g.f_flatten(0, -1)).transpose()?;
    tch::no_grad(|| {
        for (idx, y) in chunks(p, cfg)? {
            let z = tempered(&rows(&idx)?, p.kind, cfg.temperature)?;
            let gl = g_logp.f_index_select(0, &idx)?;
            let ge = g_ent.as_ref().map(|g| g.f_index_select(0, &idx)).transpose()?;
            use_grad(&idx, &chunk_backward(&z, &y, &gl, ge.as_ref(), cfg.temperature)?)?;
        }
        Ok(())
    })
}

/// Scatters per-valid-token values `[N]` chunks back into a zero `[B, T]` tensor.
fn unflatten(p: &Prepared, parts: &[(Tensor, Tensor)]) -> Result<Tensor, LossError> {
    let mut out = Tensor::f_zeros([p.shape[0] * p.shape[1]], (p.kind, p.device))?;
    for (idx, v) in parts {
        let _ = out.f_index_copy_(0, idx, v)?;
    }
    Ok(out.f_reshape(p.shape)?)
}

fn compute_kind(kind: Kind) -> Kind {
    validate::compute_kind(&[kind])
}

/// Runs the chunked forward over a source of logit rows; `rows(idx)` returns the raw logits of
/// the tokens `idx` (`[n, V]`, any float dtype).
fn forward_with(
    p: &Prepared,
    cfg: &LogProbConfig,
    rows: &dyn Fn(&Tensor) -> Result<Tensor, LossError>,
) -> Result<TokenLogProbs, LossError> {
    let mut logps = vec![];
    let mut ents = vec![];
    tch::no_grad(|| -> Result<(), LossError> {
        for (idx, y) in chunks(p, cfg)? {
            let z = tempered(&rows(&idx)?, p.kind, cfg.temperature)?;
            let f = chunk_forward(&z, &y, cfg.with_entropy)?;
            logps.push((idx.shallow_clone(), f.logp));
            if let Some(e) = f.entropy {
                ents.push((idx, e));
            }
        }
        Ok(())
    })?;
    let logp = unflatten(p, &logps)?;
    // A label whose logit is −inf (or NaN logits) makes its log-prob non-finite: name it.
    validate::all_finite(&[validate::FiniteCheck {
        clean: &logp,
        original: &logp,
        argument: "logits",
        valid: Some(&p.mask),
        also: None,
    }])?;
    Ok(TokenLogProbs {
        logp,
        entropy: if cfg.with_entropy { Some(unflatten(p, &ents)?) } else { None },
        mask: p.mask.shallow_clone(),
    })
}

fn tempered(raw: &Tensor, kind: Kind, temperature: f64) -> Result<Tensor, LossError> {
    let z = raw.f_to_kind(kind)?;
    Ok(if temperature != 1.0 { z.f_div_scalar(temperature)? } else { z })
}

fn check_logits(logits: &Tensor) -> Result<(Kind, [i64; 2], i64), LossError> {
    let kind = compute_kind(validate::float_tensor(logits, "logits")?);
    let s = validate::rank(logits, "logits", 3, "[B, T, V] logits")?;
    validate::non_empty(&s[2..], "logits", "vocabulary entry")?;
    Ok((kind, [s[0], s[1]], s[2]))
}

/// Token log-probabilities of `labels` under `logits`, computed chunk by chunk without an
/// autograd graph (for the behaviour policy μ, a reference model, or evaluation).
///
/// ```text
/// logp[b, t] = log_softmax(logits[b, t] / τ)[labels[b, t]]        0 where masked
/// ```
///
/// Each chunk of `chunk_tokens` valid tokens is upcast to f32 on its own; masked tokens are not
/// computed at all. Equal to `log_softmax` + `gather` on the whole tensor within 1e-5 in f32.
///
/// Reference: the `logprobs_from_logits` helpers of verl, TRL and OpenRLHF, chunked.
///
/// # Arguments
/// * `logits` — `[B, T, V]`, floating (bf16/f16 upcast per chunk). Contiguous logits are read in
///   place; others are copied once by `flatten`.
/// * `labels` — `[B, T]`, integer token ids; position `t` is scored under `logits[:, t]` (shift
///   the labels yourself for next-token prediction).
/// * `mask` — optional `[B, T]`: which positions to score.
///
/// # Errors
/// The tensor checks of [`LossError`]; [`LossError::InvalidArgument`] for a label outside
/// `[0, V)` at a scored position; [`LossError::InvalidConfig`] for a bad config.
///
/// # Example
/// ```
/// use tch::{Kind, Tensor};
/// use topr_loss::{token_logprobs, LogProbConfig};
///
/// let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 0.0, 0.0]).reshape([1, 2, 3]);
/// let labels = Tensor::from_slice2(&[[2i64, 0]]);
/// let out = token_logprobs(&logits, &labels, None, &LogProbConfig::default())?;
/// let naive = logits.log_softmax(-1, Kind::Float).gather(2, &labels.unsqueeze(2), false).squeeze_dim(2);
/// assert!((out.logp - naive).abs().max().double_value(&[]) < 1e-6);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn token_logprobs(
    logits: &Tensor,
    labels: &Tensor,
    mask: Option<&Tensor>,
    cfg: &LogProbConfig,
) -> Result<TokenLogProbs, LossError> {
    let (kind, shape, vocab) = check_logits(logits)?;
    let p = prepare(labels, mask, shape, vocab, kind, logits.device(), cfg)?;
    let flat = logits.f_detach()?.f_flatten(0, 1)?; // [B·T, V], a view when contiguous
    forward_with(&p, cfg, &|idx| Ok(flat.f_index_select(0, idx)?))
}

/// `∂L/∂logp` and `∂L/∂H` (`[B, T]`, zero where masked) of the loss a `loss_fn` returned.
struct LeafGrads {
    logp: Tensor,
    entropy: Option<Tensor>,
}

/// Hands the log-probs (and entropies) to `loss_fn` as leaf tensors, checks that it returns a
/// scalar and back-propagates it to the leaves. Returns the loss value, detached, and the leaves'
/// gradients, or `None` when the loss does not depend on them (nothing to push further).
fn backward_to_leaves(
    fwd: TokenLogProbs,
    loss_fn: impl FnOnce(&TokenLogProbs) -> Result<Tensor, LossError>,
) -> Result<(Tensor, Option<LeafGrads>), LossError> {
    let leaf = |t: &Tensor| -> Result<Tensor, LossError> { Ok(t.f_detach()?.f_set_requires_grad(true)?) };
    let leaves = TokenLogProbs {
        logp: leaf(&fwd.logp)?,
        entropy: fwd.entropy.as_ref().map(leaf).transpose()?,
        mask: fwd.mask.shallow_clone(),
    };
    let loss = loss_fn(&leaves)?;
    if loss.numel() != 1 {
        return Err(LossError::WrongRank {
            argument: "loss_fn",
            found: loss.size(),
            expected_rank: 0,
            meaning: "a scalar loss",
        });
    }
    if !loss.requires_grad() {
        return Ok((loss.f_detach()?, None));
    }
    loss.f_backward()?;
    let grad_of = |t: &Tensor| -> Result<Tensor, LossError> {
        let g = t.f_grad()?;
        Ok(if g.defined() { masked_fill_zero(&g, &fwd.mask)? } else { t.f_zeros_like()? })
    };
    let grads = LeafGrads { logp: grad_of(&leaves.logp)?, entropy: leaves.entropy.as_ref().map(grad_of).transpose()? };
    Ok((loss.f_detach()?, Some(grads)))
}

/// Computes token log-probs (and entropies) from `logits` chunk by chunk, lets `loss_fn` turn them
/// into a scalar loss, and back-propagates that loss into `logits` (and so into the model that
/// produced them) with the closed-form gradient, chunk by chunk. Returns the loss value, detached.
///
/// ```text
/// ∂L/∂z_t = (∂L/∂logp_t (onehot(y_t) − p_t) − ∂L/∂H_t p_t (log p_t + H_t)) / τ
/// ```
///
/// Use it where you would write `loss.backward()`: the gradient accumulates into the model's
/// parameters as with a plain backward pass, and equals the naive `log_softmax` + `gather`
/// gradient. No float32 copy of `[B, T, V]` is made: the extra memory is the gradient of the
/// logits in their own dtype (which any backward through them needs) plus a few chunk-sized f32
/// buffers.
///
/// Reference: the closed-form softmax gradient used by fused cross-entropy kernels (Liger,
/// Apple's cut cross-entropy).
///
/// # Arguments
/// As [`token_logprobs`], plus `loss_fn`, which receives the log-probs (and entropies) as leaf
/// tensors `[B, T]` that require grad and returns a scalar loss (any of this crate's losses).
///
/// # Errors
/// As [`token_logprobs`]; whatever `loss_fn` returns; [`LossError::WrongRank`] if it returns more
/// than one value.
///
/// # Example
/// ```
/// use tch::{Kind, Tensor};
/// use topr_loss::{backward_through_logprobs, topr_token_loss, LogProbConfig, ToprTokenConfig};
///
/// let logits = Tensor::randn([2, 3, 5], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let labels = Tensor::from_slice2(&[[1i64, 4, 0], [2, 2, 3]]);
/// let mask = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
/// let logp_mu = Tensor::full([2, 3], -1.5, (Kind::Float, tch::Device::Cpu));
/// let rewards = Tensor::from_slice(&[1.0f32, -1.0]);
/// let loss = backward_through_logprobs(&logits, &labels, Some(&mask), &LogProbConfig::default(), |lp| {
///     topr_token_loss(&lp.logp, &logp_mu, &rewards, &lp.mask, &ToprTokenConfig::paper())
/// })?;
/// assert!(loss.double_value(&[]).is_finite());
/// assert!(logits.grad().defined()); // the gradient reached the logits
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn backward_through_logprobs<E: From<LossError>>(
    logits: &Tensor,
    labels: &Tensor,
    mask: Option<&Tensor>,
    cfg: &LogProbConfig,
    loss_fn: impl FnOnce(&TokenLogProbs) -> Result<Tensor, E>,
) -> Result<Tensor, E> {
    let mut failed = None;
    let out = logits_backward(logits, labels, mask, cfg, |lp| user_loss(lp, loss_fn, &mut failed));
    out.map_err(|e| failed.take().unwrap_or_else(|| E::from(e)))
}

/// Runs the caller's loss, keeping its error (of the caller's type) aside; the placeholder
/// [`LossError`] returned in its stead never reaches the caller.
fn user_loss<E>(
    lp: &TokenLogProbs,
    loss_fn: impl FnOnce(&TokenLogProbs) -> Result<Tensor, E>,
    failed: &mut Option<E>,
) -> Result<Tensor, LossError> {
    loss_fn(lp).map_err(|e| {
        *failed = Some(e);
        LossError::InvalidArgument { argument: "loss_fn", value: f64::NAN, reason: "the loss closure failed".into() }
    })
}

fn logits_backward(
    logits: &Tensor,
    labels: &Tensor,
    mask: Option<&Tensor>,
    cfg: &LogProbConfig,
    loss_fn: impl FnOnce(&TokenLogProbs) -> Result<Tensor, LossError>,
) -> Result<Tensor, LossError> {
    let (kind, shape, vocab) = check_logits(logits)?;
    let p = prepare(labels, mask, shape, vocab, kind, logits.device(), cfg)?;
    let flat = logits.f_detach()?.f_flatten(0, 1)?;
    let rows = |idx: &Tensor| -> Result<Tensor, LossError> { Ok(flat.f_index_select(0, idx)?) };
    let fwd = forward_with(&p, cfg, &rows)?;
    let (loss, grads) = backward_to_leaves(fwd, loss_fn)?;
    let Some(grads) = grads.filter(|_| logits.requires_grad()) else {
        return Ok(loss);
    };
    let mut grad = flat.f_zeros_like()?; // [B·T, V] in the logits' dtype
    for_each_chunk_gradient(&p, cfg, &rows, &grads, |idx, gz| {
        let _ = grad.f_index_copy_(0, idx, &gz.f_to_kind(grad.kind())?)?;
        Ok(())
    })?;
    // ∂/∂logits of Σ logits · grad is `grad`: one dot product pushes it into the graph.
    let surrogate = logits.f_flatten(0, -1)?.f_dot(&grad.f_flatten(0, -1)?)?;
    surrogate.f_backward()?;
    Ok(loss)
}

fn check_fused(hidden: &Tensor, weight: &Tensor) -> Result<(Kind, [i64; 2], i64), LossError> {
    let kinds = [validate::float_tensor(hidden, "hidden")?, validate::float_tensor(weight, "weight")?];
    // The chunks' products `h Wᵀ` run in the inputs' own dtype, which libtorch's matmul wants
    // the same on both sides.
    if kinds[0] != kinds[1] {
        return Err(LossError::WrongDtype {
            argument: "weight",
            found: format!("{:?}", kinds[1]),
            expected: "the dtype of `hidden`",
        });
    }
    let s = validate::rank(hidden, "hidden", 3, "[B, T, H] last hidden states")?;
    let w = validate::rank(weight, "weight", 2, "[V, H] output projection (lm_head)")?;
    validate::non_empty(&w, "weight", "vocabulary entry")?;
    if w[1] != s[2] {
        return Err(LossError::ShapeMismatch {
            argument: "weight",
            found: w.clone(),
            expected: vec![w[0], s[2]],
            reason: "[V, H] with H the last dimension of `hidden`",
        });
    }
    validate::same_device(weight, "weight", hidden.device(), "hidden")?;
    Ok((validate::compute_kind(&kinds), [s[0], s[1]], w[0]))
}

/// Token log-probabilities from the last hidden states and the output projection, without ever
/// forming `[B, T, V]`: each chunk's logits `h W^T` are computed, used and dropped. No autograd
/// graph (see [`backward_through_fused_logprobs`] for training).
///
/// ```text
/// logp[b, t] = log_softmax(hidden[b, t] · Wᵀ / τ)[labels[b, t]]
/// ```
///
/// Reference: fused linear cross-entropy (Liger Kernel; Wijmans et al., *Cut Your Losses in
/// Large-Vocabulary Language Models*, arXiv 2411.09009).
///
/// # Arguments
/// * `hidden` — `[B, T, H]`, floating.
/// * `weight` — `[V, H]`, the `lm_head` (or tied embedding) matrix; same device.
/// * `labels`, `mask`, `cfg` — as [`token_logprobs`].
///
/// # Errors
/// As [`token_logprobs`], plus [`LossError::ShapeMismatch`] when `weight` is not `[V, H]` and
/// [`LossError::WrongDtype`] when its dtype is not `hidden`'s.
///
/// # Example
/// ```
/// use tch::{Kind, Tensor};
/// use topr_loss::{fused_token_logprobs, token_logprobs, LogProbConfig};
///
/// let hidden = Tensor::randn([2, 4, 8], (Kind::Float, tch::Device::Cpu));
/// let weight = Tensor::randn([11, 8], (Kind::Float, tch::Device::Cpu));
/// let labels = Tensor::randint(11, [2, 4], (Kind::Int64, tch::Device::Cpu));
/// let cfg = LogProbConfig::new().with_chunk_tokens(3);
/// let fused = fused_token_logprobs(&hidden, &weight, &labels, None, &cfg)?;
/// let plain = token_logprobs(&hidden.matmul(&weight.tr()), &labels, None, &cfg)?;
/// assert!((fused.logp - plain.logp).abs().max().double_value(&[]) < 1e-5);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn fused_token_logprobs(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    mask: Option<&Tensor>,
    cfg: &LogProbConfig,
) -> Result<TokenLogProbs, LossError> {
    let (kind, shape, vocab) = check_fused(hidden, weight)?;
    let p = prepare(labels, mask, shape, vocab, kind, hidden.device(), cfg)?;
    let h = hidden.f_detach()?.f_flatten(0, 1)?; // [B·T, H]
    let w = weight.f_detach()?;
    forward_with(&p, cfg, &|idx| Ok(h.f_index_select(0, idx)?.f_matmul(&w.f_tr()?)?))
}

/// [`backward_through_logprobs`] from the last hidden states and the output projection: the
/// gradient reaches `hidden` (and through it the model) and `weight`, and `[B, T, V]` is never
/// materialised, in the forward or the backward pass.
///
/// ```text
/// z_c = h_c Wᵀ,  G_c = ∂L/∂z_c (closed form)      ∂L/∂h_c = G_c W      ∂L/∂W = Σ_c G_cᵀ h_c
/// ```
///
/// The gradient equals that of the naive `log_softmax(h Wᵀ)` + `gather` (tested).
///
/// Reference: Liger Kernel's fused linear cross-entropy; Wijmans et al., arXiv 2411.09009.
///
/// # Arguments
/// As [`fused_token_logprobs`], plus `loss_fn` as in [`backward_through_logprobs`].
///
/// # Errors
/// As [`fused_token_logprobs`] and [`backward_through_logprobs`].
///
/// # Example
/// ```
/// use tch::{Kind, Tensor};
/// use topr_loss::{backward_through_fused_logprobs, LogProbConfig};
///
/// let hidden = Tensor::randn([2, 4, 8], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let weight = Tensor::randn([11, 8], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
/// let labels = Tensor::randint(11, [2, 4], (Kind::Int64, tch::Device::Cpu));
/// let cfg = LogProbConfig::new().with_chunk_tokens(3);
/// // Negative log-likelihood, summed: SFT.
/// backward_through_fused_logprobs(&hidden, &weight, &labels, None, &cfg, |lp| Ok::<_, topr_loss::LossError>(-lp.logp.sum(Kind::Float)))?;
/// assert!(hidden.grad().defined() && weight.grad().defined());
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn backward_through_fused_logprobs<E: From<LossError>>(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    mask: Option<&Tensor>,
    cfg: &LogProbConfig,
    loss_fn: impl FnOnce(&TokenLogProbs) -> Result<Tensor, E>,
) -> Result<Tensor, E> {
    let mut failed = None;
    let out = fused_backward(hidden, weight, labels, mask, cfg, |lp| user_loss(lp, loss_fn, &mut failed));
    out.map_err(|e| failed.take().unwrap_or_else(|| E::from(e)))
}

fn fused_backward(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    mask: Option<&Tensor>,
    cfg: &LogProbConfig,
    loss_fn: impl FnOnce(&TokenLogProbs) -> Result<Tensor, LossError>,
) -> Result<Tensor, LossError> {
    let (kind, shape, vocab) = check_fused(hidden, weight)?;
    let p = prepare(labels, mask, shape, vocab, kind, hidden.device(), cfg)?;
    let h = hidden.f_detach()?.f_flatten(0, 1)?; // [B·T, H]
    let w = weight.f_detach()?;
    let wt = w.f_tr()?;
    let rows = |idx: &Tensor| -> Result<Tensor, LossError> { Ok(h.f_index_select(0, idx)?.f_matmul(&wt)?) };
    let fwd = forward_with(&p, cfg, &rows)?;
    let (loss, grads) = backward_to_leaves(fwd, loss_fn)?;
    let Some(grads) = grads.filter(|_| hidden.requires_grad() || weight.requires_grad()) else {
        return Ok(loss);
    };
    let mut grad_h = Tensor::f_zeros(h.size().as_slice(), (kind, h.device()))?; // [B·T, H]
    let mut grad_w = Tensor::f_zeros(w.size().as_slice(), (kind, w.device()))?; // [V, H]
    let wk = w.f_to_kind(kind)?;
    for_each_chunk_gradient(&p, cfg, &rows, &grads, |idx, gz| {
        let _ = grad_h.f_index_copy_(0, idx, &gz.f_matmul(&wk)?)?; // [n, V] · [V, H]
        let hc = h.f_index_select(0, idx)?.f_to_kind(kind)?;
        let _ = grad_w.f_add_(&gz.f_tr()?.f_matmul(&hc)?)?;
        Ok(())
    })?;
    let mut surrogate: Option<Tensor> = None;
    for (t, g) in [(hidden, grad_h.f_reshape(hidden.size().as_slice())?), (weight, grad_w)] {
        if t.requires_grad() {
            let term =
                t.f_flatten(0, -1)?.f_dot(&g.f_to_kind(t.f_kind()?)?.f_flatten(0, -1)?)?.f_to_kind(Kind::Double)?;
            surrogate = Some(match surrogate {
                Some(s) => s.f_add(&term)?,
                None => term,
            });
        }
    }
    if let Some(s) = surrogate {
        s.f_backward()?;
    }
    Ok(loss)
}

/// Sequence log-probabilities from token log-probs: the sum (or mean) over the unmasked tokens.
///
/// ```text
/// Sum:  Σ_t m_t logp_t          Mean: Σ_t m_t logp_t / Σ_t m_t   (0 for an empty sequence)
/// ```
///
/// Differentiable; padding is replaced (not multiplied), so NaN there gets zero gradient. Values
/// are checked ([`Checks::Full`]: one host read); [`sequence_logprobs_with_checks`] can skip that.
///
/// Reference: the sequence log-prob used by DPO (sum) and IPO (mean).
///
/// # Errors
/// The tensor checks of [`LossError`] (`logp` `[B, T]` floating, finite where unmasked).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{sequence_logprobs, SequenceReduce};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0, f64::NAN]]);
/// let m = Tensor::from_slice2(&[[true, true, false]]);
/// assert_eq!(sequence_logprobs(&lp, &m, SequenceReduce::Sum)?.double_value(&[0]), -3.0);
/// assert_eq!(sequence_logprobs(&lp, &m, SequenceReduce::Mean)?.double_value(&[0]), -1.5);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn sequence_logprobs(logp: &Tensor, mask: &Tensor, reduce: SequenceReduce) -> Result<Tensor, LossError> {
    sequence_logprobs_with_checks(logp, mask, reduce, Checks::Full)
}

/// [`sequence_logprobs`] at a chosen [`Checks`] level: [`Checks::Shapes`] checks shapes, kinds
/// and devices only and never reads a value back to the host (no device synchronisation), as the
/// losses do under that level; the values are the same.
///
/// ```text
/// Sum:  Σ_t m_t logp_t          Mean: Σ_t m_t logp_t / Σ_t m_t   (0 for an empty sequence)
/// ```
///
/// Reference: the sequence log-prob used by DPO (sum) and IPO (mean).
///
/// # Errors
/// As [`sequence_logprobs`]; under [`Checks::Shapes`] a NaN or inf where the mask holds is not
/// reported (it reaches the result).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::{host_reads, sequence_logprobs_with_checks, Checks, SequenceReduce};
/// let lp = Tensor::from_slice2(&[[-1.0f64, -2.0, f64::NAN]]);
/// let m = Tensor::from_slice2(&[[true, true, false]]);
/// let before = host_reads();
/// let s = sequence_logprobs_with_checks(&lp, &m, SequenceReduce::Sum, Checks::Shapes)?;
/// assert_eq!(host_reads(), before);
/// assert_eq!(s.double_value(&[0]), -3.0);
/// # Ok::<(), topr_loss::LossError>(())
/// ```
pub fn sequence_logprobs_with_checks(
    logp: &Tensor,
    mask: &Tensor,
    reduce: SequenceReduce,
    checks: Checks,
) -> Result<Tensor, LossError> {
    let kind = compute_kind(validate::float_tensor(logp, "logp")?);
    let shape = validate::rank(logp, "logp", 2, "[B, T] per-token log-probabilities")?;
    let m = validate::bool_mask_with(mask, "mask", checks)?;
    validate::same_shape(&m, "mask", &shape, "the shape of `logp`")?;
    validate::same_device(&m, "mask", logp.device(), "logp")?;
    let x = logp.f_to_kind(kind)?;
    let sum = if checks.values() {
        checked_masked_sum(&x, logp, &m)?
    } else {
        masked_fill_zero(&x, &m)?.f_sum_dim_intlist(1, false, None::<Kind>)?
    };
    Ok(match reduce {
        SequenceReduce::Sum => sum,
        SequenceReduce::Mean => sum.f_div(&m.f_sum_dim_intlist(1, false, kind)?.f_clamp_min(1.0)?)?,
    })
}

/// `Σ_t m_t x_t` per row with the value checks of [`sequence_logprobs`], in one host read when
/// every entry is finite: the padding zeroed by the mask product ([`zero_padding`]) and kept when
/// the sums the check reads are finite (which proves every entry finite, padding included);
/// otherwise, once the per-entry check has cleared the real entries (it names the first bad one),
/// the sums are made again with `where`.
fn checked_masked_sum(x: &Tensor, original: &Tensor, m: &Tensor) -> Result<Tensor, LossError> {
    let mask_f = mask_float(m, x.kind())?;
    let row_sums = |finite| -> Result<Tensor, LossError> {
        Ok(zero_padding(x, m, &mask_f, finite)?.f_sum_dim_intlist(1, false, None::<Kind>)?)
    };
    let product = row_sums(true)?;
    let sums = validate::all_finite_sums(&[validate::FiniteCheck {
        clean: &product,
        original,
        argument: "logp",
        valid: Some(m),
        also: None,
    }])?;
    if sums[0].is_finite() { Ok(product) } else { row_sums(false) }
}
