//! `check`: the measurements of the GPU check that the other subcommands do not make. Each
//! prints one JSON line per measurement on stdout (a [`CheckRecord`]); `scripts/gpu_bundle/run.sh`
//! runs them and `report.py` turns their lines into the check's table.
//!
//! - `check parity`: one checkpoint's logits on `--device` (f32 and bf16) against the CPU in f32,
//!   and greedy generations in f32 on both;
//! - `check peak`: the device's bf16 matrix-product throughput (the denominator of the model FLOP
//!   utilisation that `bench` reports against);
//! - `check losses`: forward + backward of `topr_token_loss`, `ppo_clip_loss` and `dpo_loss` at a
//!   given batch and length, with full and with shape-only checks, and the host reads of each call.

use anyhow::{Result, bail};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;
use tch::{Device, Kind, Tensor};
use topr_llama::checkpoint::{self, Placement};
use topr_llama::generate::{self, Sampling};
use topr_llama::memory::{fits, gb};
use topr_loss::{Checks, DpoConfig, PpoConfig, SequenceReduce, ToprConfig, ToprTokenConfig, host_reads};

/// One measurement line of `check`.
#[derive(Debug, Serialize)]
#[serde(tag = "what", rename_all = "snake_case")]
pub enum CheckRecord {
    /// Logits and greedy generations on `device` against the CPU in f32.
    Parity {
        device: String,
        /// `max |Δ| / max |logit|` over the compared positions, f32 on the device.
        f32_rel: f64,
        /// The same in bf16 (weights and activations), against the CPU's f32.
        bf16_rel: f64,
        /// Share of positions whose bf16 argmax is the f32 CPU argmax.
        bf16_argmax_agreement: f64,
        positions: i64,
        /// Greedy generations in f32: identical token for token on the device and the CPU.
        greedy_identical: bool,
        greedy_tokens: usize,
        /// Sampled generations in f32 (temperature 1, seed 0): identical on the device and the
        /// CPU (each completion's draws are the same numbers on both; only rounding can differ).
        sampled_identical: bool,
        /// On a CUDA device: greedy and sampled generations in f32 identical with CUDA graphs
        /// and eagerly (absent elsewhere).
        #[serde(skip_serializing_if = "Option::is_none")]
        graphs_greedy_identical: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        graphs_sampled_identical: Option<bool>,
    },
    /// A large bf16 matrix product on the device.
    Peak { device: String, n: i64, tflops: f64 },
    /// One loss's forward + backward.
    Loss {
        device: String,
        loss: &'static str,
        checks: &'static str,
        batch: i64,
        len: i64,
        ms: f64,
        /// Host reads (device → host synchronisations) the loss call itself makes.
        host_reads_per_call: u64,
    },
}

fn emit(r: &CheckRecord) -> Result<()> {
    println!("{}", serde_json::to_string(r)?);
    Ok(())
}

fn device_name(d: Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}"),
    }
}

/// Waits for the device's queued work (a no-op on the CPU).
pub fn sync(d: Device) {
    if let Device::Cuda(i) = d {
        tch::Cuda::synchronize(i as i64);
    }
}

/// `check parity`: `prompts` random prompts of `len` byte-level tokens.
pub fn parity(dir: &Path, device: Device, prompts: i64, len: i64, new_tokens: i64) -> Result<()> {
    let (cpu, _) = checkpoint::open(dir, Placement::f32(Device::Cpu))?;
    let (mut dev32, _) = checkpoint::open(dir, Placement::f32(device))?;
    let (dev16, _) = checkpoint::open(dir, Placement { kind: Kind::BFloat16, ..Placement::f32(device) })?;
    // Ids the tokenizer produces (the byte tokens of `init`'s models are 0..256; any real
    // tokenizer has at least as many).
    let real = 256.min(cpu.cfg.vocab_size);
    let mut rng = topr_llama::task::Rng::new(0);
    let prompt_ids: Vec<Vec<i64>> = (0..prompts).map(|_| (0..len).map(|_| rng.range(0, real - 1)).collect()).collect();
    let ids = Tensor::from_slice(&prompt_ids.concat()).view([prompts, len]);
    let mask = Tensor::ones([prompts, len], (Kind::Int64, Device::Cpu));
    let (want, l32, l16) = tch::no_grad(|| -> Result<_> {
        let on = |m: &topr_llama::model::Llama| -> Result<Tensor> {
            Ok(m.logits(&ids.to(m.device()), &mask.to(m.device()))?.to_device(Device::Cpu).to_kind(Kind::Float))
        };
        Ok((on(&cpu)?, on(&dev32)?, on(&dev16)?))
    })?;
    let scale = want.abs().max().double_value(&[]);
    if !(scale.is_finite() && scale > 0.0) {
        bail!("the CPU logits of {} are {scale} at most: not a usable model", dir.display());
    }
    let rel = |l: &Tensor| (l - &want).abs().max().double_value(&[]) / scale;
    let agree = l16.argmax(-1, false).eq_tensor(&want.argmax(-1, false)).to_kind(Kind::Double).mean(Kind::Double);
    let s = Sampling::greedy(new_tokens);
    let a = generate::generate(&cpu, &prompt_ids, &s, &[], 0)?;
    let b = generate::generate(&dev32, &prompt_ids, &s, &[], 0)?;
    let sampled = Sampling::sample(generate::SamplingParams::default(), new_tokens);
    let sa = generate::generate(&cpu, &prompt_ids, &sampled, &[], 0)?;
    let sb = generate::generate(&dev32, &prompt_ids, &sampled, &[], 0)?;
    let same =
        |x: &[generate::Completion], y: &[generate::Completion]| x.iter().zip(y).all(|(p, q)| p.tokens == q.tokens);
    let (graphs_greedy_identical, graphs_sampled_identical) = if device.is_cuda() && topr_llama::cuda_graph::available()
    {
        dev32.set_cuda_graphs(true);
        let gb = generate::generate(&dev32, &prompt_ids, &s, &[], 0)?;
        let gs = generate::generate(&dev32, &prompt_ids, &sampled, &[], 0)?;
        (Some(same(&b, &gb)), Some(same(&sb, &gs)))
    } else {
        (None, None)
    };
    emit(&CheckRecord::Parity {
        device: device_name(device),
        f32_rel: rel(&l32),
        bf16_rel: rel(&l16),
        bf16_argmax_agreement: agree.double_value(&[]),
        positions: prompts * len,
        greedy_identical: same(&a, &b),
        greedy_tokens: a.iter().map(|c| c.tokens.len()).sum(),
        sampled_identical: same(&sa, &sb),
        graphs_greedy_identical,
        graphs_sampled_identical,
    })
}

/// TFLOP/s of an `n × n` matrix product in `kind` on `device`, best of 10 after a warm-up: the
/// machine's measured peak for that dtype. A failed allocation (three `n × n` matrices) is an
/// error naming the size.
pub fn matmul_tflops(device: Device, kind: Kind, n: i64) -> Result<f64> {
    let bytes = 3 * (n as u64).pow(2) * kind.elt_size_in_bytes() as u64;
    let what = format!("three {n} × {n} {kind:?} matrices");
    fits(device, bytes, &what)?;
    let run = || -> Result<f64, tch::TchError> {
        let a = Tensor::f_randn([n, n], (kind, device))?;
        let b = Tensor::f_randn([n, n], (kind, device))?;
        let _ = a.f_matmul(&b)?;
        sync(device);
        let mut best = f64::INFINITY;
        for _ in 0..10 {
            let t0 = Instant::now();
            let _ = a.f_matmul(&b)?;
            sync(device);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(2.0 * (n as f64).powi(3) / best / 1e12)
    };
    run().map_err(|e| anyhow::anyhow!("{what} ({}) on {device:?}: {}", gb(bytes), first_line(&e.to_string())))
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

/// `check peak`: TFLOP/s of an `n × n` bf16 matrix product.
pub fn peak(device: Device, n: i64) -> Result<()> {
    let tflops = matmul_tflops(device, Kind::BFloat16, n).map_err(|e| anyhow::anyhow!("--n {n}: {e}"))?;
    emit(&CheckRecord::Peak { device: device_name(device), n, tflops })
}

/// Bytes `check losses` holds per token at its peak (inputs, their gradient, the losses'
/// intermediates and the backward pass's buffers, in f32): the size check's estimate. Measured
/// on the CPU (2026-12-02): the peak resident size grows by 106 bytes a token from 1024 × 2048 to
/// 2048 × 2048 tokens, over about 0.5 GB for the process itself.
const LOSS_BYTES_PER_TOKEN: u64 = 128;

/// One loss call of `check losses`, on inputs it captures.
type LossCall<'a> = Box<dyn Fn() -> Result<Tensor> + 'a>;

/// `check losses`: mean time of `iters` forward + backward passes of each loss (after two
/// warm-up calls), with full and with shape-only checks.
pub fn losses(device: Device, batch: i64, len: i64, iters: usize) -> Result<()> {
    let bytes = (batch as u64) * (len as u64) * LOSS_BYTES_PER_TOKEN;
    let what = format!("--batch {batch} --len {len}: the losses' tensors");
    fits(device, bytes, &what)?;
    losses_on(device, batch, len, iters)
        .map_err(|e| anyhow::anyhow!("{what} (about {}) on {device:?}: {}", gb(bytes), first_line(&format!("{e:#}"))))
}

fn losses_on(device: Device, batch: i64, len: i64, iters: usize) -> Result<()> {
    tch::manual_seed(0);
    let opts = (Kind::Float, device);
    // Log-probs in (−2, 0], μ's within about 0.1 of them (and at most 0, as log-probs are).
    let logp = Tensor::f_rand([batch, len], opts)?.f_mul_scalar(-2.0)?.set_requires_grad(true);
    let noise = Tensor::f_randn([batch, len], opts)?.f_mul_scalar(0.1)?;
    let logp_mu = logp.f_detach()?.f_add(&noise)?.f_clamp_max(0.0)?;
    drop(noise);
    let lengths = Tensor::f_randint_low(len / 2, len + 1, [batch, 1], (Kind::Int64, device))?;
    let mask = Tensor::f_arange(len, (Kind::Int64, device))?.f_unsqueeze(0)?.f_lt_tensor(&lengths)?;
    let rewards = Tensor::f_randint(2, [batch], (Kind::Float, device))?.f_mul_scalar(2.0)?.f_sub_scalar(1.0)?;
    let half = batch / 2;
    for checks in [Checks::Full, Checks::Shapes] {
        let name = if checks == Checks::Full { "full" } else { "shapes" };
        let topr = ToprTokenConfig::paper().with_topr(ToprConfig::canonical().with_checks(checks));
        let ppo = PpoConfig::ppo().with_checks(checks);
        let dpo = DpoConfig::dpo().with_checks(checks);
        let calls: [(&'static str, LossCall); 3] = [
            ("topr_token_loss", Box::new(|| Ok(topr_loss::topr_token_loss(&logp, &logp_mu, &rewards, &mask, &topr)?))),
            ("ppo_clip_loss", Box::new(|| Ok(topr_loss::ppo_clip_loss(&logp, &logp_mu, &rewards, &mask, &ppo)?))),
            (
                "dpo_loss",
                Box::new(|| {
                    // Sequence log-probs of `half` pairs from the token log-probs, as a user
                    // of the crate gets them (padding replaced, checked).
                    let seq = topr_loss::sequence_logprobs_with_checks(&logp, &mask, SequenceReduce::Sum, checks)?;
                    let seq_mu =
                        topr_loss::sequence_logprobs_with_checks(&logp_mu, &mask, SequenceReduce::Sum, checks)?;
                    let (c, r) = (seq.narrow(0, 0, half), seq.narrow(0, half, half));
                    let (rc, rr) = (seq_mu.narrow(0, 0, half), seq_mu.narrow(0, half, half));
                    Ok(topr_loss::dpo_loss(&c, &r, &rc, &rr, &dpo)?)
                }),
            ),
        ];
        for (loss, call) in &calls {
            let step = || -> Result<u64> {
                let before = host_reads();
                let l = call()?;
                let reads = host_reads() - before;
                l.f_backward()?;
                Ok(reads)
            };
            step()?;
            step()?;
            sync(device);
            let t0 = Instant::now();
            let mut reads = 0;
            for _ in 0..iters {
                reads = step()?;
            }
            sync(device);
            let ms = t0.elapsed().as_secs_f64() * 1e3 / iters as f64;
            emit(&CheckRecord::Loss {
                device: device_name(device),
                loss,
                checks: name,
                batch,
                len,
                ms,
                host_reads_per_call: reads,
            })?;
        }
    }
    Ok(())
}
