//! Batched generation with a KV cache: prompts of different lengths are left-padded into one
//! batch and each row keeps its own positions. Greedy, temperature, top-k and top-p sampling.
//!
//! For every sampled token it records two log-probabilities: under the model itself
//! (temperature 1, no truncation) and under the distribution actually sampled from (after
//! temperature, top-k and top-p), so that either can serve as μ for an off-policy loss.

use crate::model::Llama;
use anyhow::{Result, bail};
use tch::{Kind, Tensor};

/// The sampling distribution: temperature, then top-k, then top-p.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_p: f64,
    /// 0 disables top-k.
    pub top_k: i64,
}

impl Default for SamplingParams {
    /// Temperature 1, no truncation: the model's own distribution.
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: 0 }
    }
}

impl SamplingParams {
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            bail!("the temperature must be > 0 (greedy decoding takes the argmax), got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top-p must lie in (0, 1], got {}", self.top_p);
        }
        if self.top_k < 0 {
            bail!("top-k must be >= 0 (0 disables it), got {}", self.top_k);
        }
        Ok(())
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decoding {
    /// The most likely token.
    Greedy,
    /// A draw from the sampling distribution.
    Sample(SamplingParams),
}

/// Generation settings: the decoding and the token budget.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Sampling {
    pub decoding: Decoding,
    pub max_new_tokens: i64,
}

impl Sampling {
    /// Greedy decoding of at most `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: i64) -> Self {
        Self { decoding: Decoding::Greedy, max_new_tokens }
    }

    /// Sampling from `params`, at most `max_new_tokens` tokens.
    pub fn sample(params: SamplingParams, max_new_tokens: i64) -> Self {
        Self { decoding: Decoding::Sample(params), max_new_tokens }
    }

    pub fn check(&self) -> Result<()> {
        if let Decoding::Sample(p) = &self.decoding {
            p.check()?;
        }
        if self.max_new_tokens < 1 {
            bail!("the token budget (max new tokens) must be >= 1, got {}", self.max_new_tokens);
        }
        Ok(())
    }
}

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    Eos,
    Length,
}

/// One generated completion.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Generated ids, the end-of-sequence token included when it was produced.
    pub tokens: Vec<i64>,
    /// `log π(token)` under the model at temperature 1.
    pub logp_model: Vec<f32>,
    /// `log q(token)` under the sampling distribution (0 for greedy decoding).
    pub logp_sampling: Vec<f32>,
    pub stop: Stop,
}

/// Applies temperature, top-k and top-p (in that order, as transformers' logits processors) to
/// `logits [B, V]` (f32), masking removed tokens with −inf.
pub fn sampling_logits(logits: &Tensor, s: &SamplingParams) -> Tensor {
    let mut z = logits / s.temperature;
    let v = z.size()[1];
    if s.top_k > 0 && s.top_k < v {
        let (top, _) = z.topk(s.top_k, -1, true, true);
        let kth = top.narrow(1, s.top_k - 1, 1); // [B, 1]
        z = z.masked_fill(&z.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if s.top_p < 1.0 {
        // transformers' TopPLogitsWarper: ascending sort, drop the tokens whose cumulative
        // probability stays <= 1 − p, always keep the most likely one.
        let (sorted, idx) = z.sort(-1, false);
        let cum = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
        let remove = cum.le(1.0 - s.top_p);
        let _ = remove.narrow(1, v - 1, 1).fill_(0);
        let remove = remove.zeros_like().scatter(1, &idx, &remove);
        z = z.masked_fill(&remove, f64::NEG_INFINITY);
    }
    z
}

/// When rows that have finished (produced an end-of-sequence token) leave the decoding batch.
///
/// A finished row that stays is still computed at every step, its output ignored; leaving costs
/// one copy of the remaining rows' keys and values. Where rows finish at different lengths (a
/// greedy evaluation, `sample` with EOS) leaving saves most of the finished rows' work. Results
/// do not depend on it: sampling draws for every row of the original batch at every step (the
/// random stream is the same), and each row's logits are its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Finished rows stay until every row has finished.
    Never,
    /// Finished rows leave once they are at least `1/n` of the rows still computed (`n ≥ 1`;
    /// a large `n` releases every finished row at once).
    Fraction(usize),
}

impl Default for Release {
    /// Leave once an eighth of the computed rows have finished: at most a few copies of the
    /// cache per generation, and never more than 1/8 of a step's rows wasted.
    fn default() -> Self {
        Self::Fraction(8)
    }
}

/// Generates one completion per prompt (ids), all in one batch; finished rows leave the batch
/// as [`Release::default`] says.
pub fn generate(
    model: &Llama,
    prompts: &[Vec<i64>],
    s: &Sampling,
    eos: &[i64],
    pad_id: i64,
) -> Result<Vec<Completion>> {
    generate_releasing(model, prompts, s, eos, pad_id, Release::default())
}

/// [`generate`] with an explicit [`Release`] of finished rows.
pub fn generate_releasing(
    model: &Llama,
    prompts: &[Vec<i64>],
    s: &Sampling,
    eos: &[i64],
    pad_id: i64,
    release: Release,
) -> Result<Vec<Completion>> {
    s.check()?;
    if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
        bail!("every prompt needs at least one token");
    }
    if release == Release::Fraction(0) {
        bail!("Release::Fraction needs n >= 1");
    }
    let vocab = model.cfg.vocab_size;
    for p in prompts {
        check_ids(p, vocab, "a prompt")?;
    }
    check_ids(&[pad_id], vocab, "the padding id")?;
    let device = model.device();
    let b = prompts.len() as i64;
    let p_len = prompts.iter().map(Vec::len).max().unwrap_or(0) as i64;
    let limit = model.cfg.max_position_embeddings;
    if p_len + s.max_new_tokens > limit {
        bail!("prompt ({p_len} tokens) + max new tokens ({}) exceeds the model's context of {limit}", s.max_new_tokens);
    }
    // Left padding: [B, P] ids and mask.
    let mut ids = vec![pad_id; (b * p_len) as usize];
    let mut mask = vec![false; (b * p_len) as usize];
    for (r, p) in prompts.iter().enumerate() {
        let off = r * p_len as usize + (p_len as usize - p.len());
        ids[off..off + p.len()].copy_from_slice(p);
        mask[off..off + p.len()].iter_mut().for_each(|m| *m = true);
    }
    let ids = Tensor::from_slice(&ids).view([b, p_len]).to_device(device);
    let mask = Tensor::from_slice(&mask).view([b, p_len]).to_device(device);
    // Positions of the rows still in the cache.
    let mut positions = crate::model::positions_from_mask(&mask);
    let eos_t = Tensor::from_slice(eos).to_device(device);

    let mut out: Vec<Completion> = (0..b)
        .map(|_| Completion { tokens: vec![], logp_model: vec![], logp_sampling: vec![], stop: Stop::Length })
        .collect();
    let mut done = vec![false; b as usize];
    // live[i]: the prompt whose row is row i of the cache; live_t: the same as a tensor, None
    // while the cache holds every row in order.
    let mut live: Vec<usize> = (0..b as usize).collect();
    let mut live_t: Option<Tensor> = None;
    tch::no_grad(|| -> Result<()> {
        let (mut cache, logits) = model.prefill(&ids, &mask, p_len + s.max_new_tokens)?;
        // [B, V] for every prompt: a row that has left keeps its last logits, so that sampling
        // draws as many random numbers as with every row present.
        let mut logits = logits.to_kind(Kind::Float);
        for k in 0..s.max_new_tokens {
            // NaN logits would make the argmax arbitrary and the multinomial draw panic.
            if !bool::try_from(logits.isfinite().all())? {
                bail!("{}", non_finite_logits(k));
            }
            let logp_model = logits.log_softmax(-1, Kind::Float);
            let (next, logp_q) = match &s.decoding {
                Decoding::Greedy => (logits.argmax(-1, false), Tensor::zeros([b], (Kind::Float, device))),
                Decoding::Sample(params) => {
                    let z = sampling_logits(&logits, params);
                    let logq = z.log_softmax(-1, Kind::Float);
                    let next = logq.exp().multinomial(1, false).squeeze_dim(1);
                    let lq = logq.gather(1, &next.unsqueeze(1), false).squeeze_dim(1);
                    (next, lq)
                }
            };
            let lp = logp_model.gather(1, &next.unsqueeze(1), false).squeeze_dim(1);
            let is_eos = next.unsqueeze(1).eq_tensor(&eos_t.unsqueeze(0)).any_dim(1, false);
            let (next_v, lp_v, lq_v, eos_v) = (
                Vec::<i64>::try_from(&next.to_device(tch::Device::Cpu))?,
                Vec::<f32>::try_from(&lp.to_device(tch::Device::Cpu))?,
                Vec::<f32>::try_from(&logp_q.to_device(tch::Device::Cpu))?,
                Vec::<bool>::try_from(&is_eos.to_device(tch::Device::Cpu))?,
            );
            for &r in &live {
                if done[r] {
                    continue;
                }
                out[r].tokens.push(next_v[r]);
                out[r].logp_model.push(lp_v[r]);
                out[r].logp_sampling.push(lq_v[r]);
                if eos_v[r] {
                    done[r] = true;
                    out[r].stop = Stop::Eos;
                }
            }
            if done.iter().all(|d| *d) {
                break;
            }
            let finished = live.iter().filter(|&&r| done[r]).count();
            if matches!(release, Release::Fraction(n) if finished > 0 && finished.saturating_mul(n) >= live.len()) {
                let keep: Vec<i64> = (0..live.len()).filter(|&i| !done[live[i]]).map(|i| i as i64).collect();
                let keep_t = Tensor::from_slice(&keep).to_device(device);
                cache.keep_rows(&keep_t);
                positions = positions.index_select(0, &keep_t);
                live = keep.iter().map(|&i| live[i as usize]).collect();
                let rows: Vec<i64> = live.iter().map(|&r| r as i64).collect();
                live_t = Some(Tensor::from_slice(&rows).to_device(device));
            }
            let rows = live.len() as i64;
            let next_live = match &live_t {
                Some(t) => next.index_select(0, t),
                None => next,
            };
            positions = positions.narrow(1, positions.size()[1] - 1, 1) + 1; // [R, 1]
            let new_mask = Tensor::ones([rows, 1], (Kind::Bool, device));
            let step = model.step(&next_live.unsqueeze(1), &positions, &new_mask, &mut cache)?.to_kind(Kind::Float);
            match &live_t {
                Some(t) => {
                    let _ = logits.index_copy_(0, t, &step);
                }
                None => logits = step,
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Refuses token ids outside `0..vocab` (the embedding would panic on them).
pub fn check_ids(ids: &[i64], vocab: i64, what: &str) -> Result<()> {
    match ids.iter().find(|&&i| !(0..vocab).contains(&i)) {
        Some(i) => bail!("{what} holds token id {i}, outside the vocabulary (0..{vocab})"),
        None => Ok(()),
    }
}

fn non_finite_logits(k: i64) -> String {
    format!(
        "the model's logits for new token {} are not finite (NaN or infinite): its weights overflow in this dtype, or are broken",
        k + 1
    )
}

/// Teacher-forced log-probs of `completion` after `prompt` (ids), under the model at
/// temperature 1: one value per completion token.
pub fn score(model: &Llama, prompt: &[i64], completion: &[i64]) -> Result<Vec<f32>> {
    if prompt.is_empty() || completion.is_empty() {
        bail!("score needs a non-empty prompt and completion");
    }
    check_ids(prompt, model.cfg.vocab_size, "the prompt")?;
    check_ids(completion, model.cfg.vocab_size, "the completion")?;
    let all: Vec<i64> = prompt.iter().chain(completion).copied().collect();
    let n = all.len() as i64;
    if n > model.cfg.max_position_embeddings {
        bail!("prompt + completion ({n} tokens) exceed the model's context of {}", model.cfg.max_position_embeddings);
    }
    let device = model.device();
    let ids = Tensor::from_slice(&all).view([1, n]).to_device(device);
    let mask = Tensor::ones([1, n], (Kind::Bool, device));
    let logp = tch::no_grad(|| -> Result<Tensor> {
        let logits = model.logits(&ids, &mask)?.to_kind(Kind::Float); // [1, n, V]
        if !bool::try_from(logits.isfinite().all())? {
            bail!(
                "the model's logits are not finite (NaN or infinite): its weights overflow in this dtype, or are broken"
            );
        }
        let p = prompt.len() as i64;
        let c = completion.len() as i64;
        // The token at position t is predicted by the logits at t − 1.
        let pred = logits.narrow(1, p - 1, c).log_softmax(-1, Kind::Float);
        let labels = ids.narrow(1, p, c).unsqueeze(2);
        Ok(pred.gather(2, &labels, false).view([c]))
    })?;
    Ok(Vec::<f32>::try_from(&logp.to_device(tch::Device::Cpu))?)
}
