//! `bench`: throughput of generation (greedy, fixed length, at each `--gen-batch`) and of a
//! training step (forward + backward of the mean next-token NLL, through the full logits and
//! through the crate's fused log-prob path), each after one warm-up run. One JSON line per
//! measurement on stdout. The roofline: a first line gives the machine's peak, a matrix product
//! in the model's dtype timed in the same run, and every throughput line carries the model FLOPs
//! a token, the achieved TFLOP/s and their share of that peak. With `--kernel-pairs N`, N
//! alternating pairs of training steps with the two kernels of training, in the same process;
//! with `--prompt-pairs N`, N alternating pairs of a step on half-prompt sequences through every
//! position's logits and through the completion's only.
//! On a CUDA device, generation is measured eagerly and with CUDA graphs, side by side, with
//! the share of the memory-bandwidth limit each achieves. With `--profile DIR`, last, a short
//! greedy generation at each `--profile-batch` is recorded by libtorch's profiler: a trace a run
//! in DIR and a summary line each (where a decoding step's time goes).

use super::check::sync;
use anyhow::{Context, Result};
use std::path::Path;
use std::time::Instant;
use tch::{Kind, Tensor};
use topr_llama::generate::{self, Sampling};
use topr_llama::model::{Kernels, Llama};
use topr_llama::profile::{self, Profiler, Window};
use topr_llama::tokenizer::Tokenizer;

/// Measures generation and training; returns whether CUDA graphs were measured and none failed.
pub fn run(
    m: &mut Llama,
    tok: &Tokenizer,
    new_tokens: i64,
    gen_batches: &[usize],
    train_batch: i64,
    train_len: i64,
) -> Result<bool> {
    if train_len > m.cfg.max_position_embeddings {
        anyhow::bail!("--train-len {train_len} exceeds the model's context of {}", m.cfg.max_position_embeddings);
    }
    let n = if m.device() == tch::Device::Cpu { 2048 } else { 8192 };
    let peak = super::check::matmul_tflops(m.device(), m.kind(), n)?;
    println!(
        "{}",
        serde_json::json!({"what": "peak", "impl": "topr-loss", "kind": format!("{:?}", m.kind()), "n": n, "tflops": peak})
    );
    let graphs = generation(m, tok, new_tokens, gen_batches, peak)?;
    training(m, train_batch, train_len, peak)?;
    Ok(graphs)
}

/// The roofline fields of a throughput line: FLOPs a token, achieved TFLOP/s, share of `peak`.
fn roofline(flops_per_token: f64, tokens_per_s: f64, peak: f64) -> serde_json::Value {
    let achieved = flops_per_token * tokens_per_s / 1e12;
    serde_json::json!({"flops_per_token": flops_per_token, "achieved_tflops": achieved, "share_of_peak": achieved / peak})
}

/// Inference FLOPs a generated token at context `ctx`: `2 N + 4 L d ctx` (the forward third of
/// [`flops_per_token`], with attention over the cached context).
fn generation_flops_per_token(m: &Llama, ctx: i64) -> f64 {
    let c = &m.cfg;
    let width = (c.num_attention_heads * c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1))) as f64;
    (flops_per_token(m, 0) / 3.0) + 4.0 * c.num_hidden_layers as f64 * width * ctx as f64
}

/// Merges the roofline fields into a JSON line.
fn with(mut line: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(a), Some(b)) = (line.as_object_mut(), extra.as_object()) {
        a.extend(b.clone());
    }
    line
}

/// Training FLOPs per token of a sequence of `len` tokens, as PaLM's model FLOP utilisation
/// counts them (Chowdhery et al. 2022, appendix B): `6 N + 12 L d T`, N the parameters that
/// multiply (the output layer included, the embedding lookup not), L layers, d the attention
/// width, T the sequence length (causal masking not discounted).
pub fn flops_per_token(m: &Llama, len: i64) -> f64 {
    let c = &m.cfg;
    let embedding = c.vocab_size as f64 * c.hidden_size as f64;
    let matmul = c.parameter_count() - if c.tie_word_embeddings { 0.0 } else { embedding };
    let width = (c.num_attention_heads * c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1))) as f64;
    6.0 * matmul + 12.0 * c.num_hidden_layers as f64 * width * len as f64
}

/// Greedy generation of `new_tokens` tokens (no EOS: fixed length) at each batch size, eagerly
/// and, on a CUDA device of a CUDA build, replaying CUDA graphs of the decoding step, side by
/// side; each line also gives the share of the memory-bandwidth limit achieved: the bytes a
/// decoding step reads (every weight it multiplies by, and the cached keys and values at the
/// mean context) per second, over a device-to-device copy's bandwidth measured in the same run.
///
/// `tokens_per_s` is the whole call's (prefill, the first step and, with graphs, their
/// recording included, as transformers' side is timed); `steady_tokens_per_s` is the decoding
/// steps' alone: the tokens of the second half of the budget over the time they added, from a
/// second run of half the budget on the same shapes (the cache's capacity held equal by a prompt
/// that no job decodes), so that what both runs pay once cancels. With graphs, a step recorded
/// per block of 64 keys reached, the blocks the second half adds (one eager step and one
/// recording each) stay in the steady figure: it is a slight underestimate, by about two steps'
/// time in every 64. Returns whether CUDA graphs were measured and none failed.
fn generation(m: &mut Llama, tok: &Tokenizer, new_tokens: i64, batches: &[usize], peak: f64) -> Result<bool> {
    let prompt = tok.prompt_ids(STORY, true)?;
    let s = Sampling::greedy(new_tokens);
    let bandwidth = copy_bandwidth(m.device(), m.kind());
    println!("{}", serde_json::json!({"what": "copy_bandwidth", "impl": "topr-loss", "bytes_per_s": bandwidth}));
    let graphs = m.device().is_cuda() && topr_llama::cuda_graph::available();
    let mut failed = false;
    let ctx = prompt.len() as i64 + new_tokens / 2;
    let before = m.cuda_graphs();
    for &batch in batches {
        for cuda_graphs in [false, true] {
            if cuda_graphs && (!graphs || failed) {
                continue;
            }
            m.set_cuda_graphs(cuda_graphs);
            let prompts = vec![prompt.clone(); batch];
            let one = |m: &mut Llama| -> Result<serde_json::Value> {
                // The warm-up runs enough steps to record the graph (the first step is eager).
                let warm = Sampling { max_new_tokens: new_tokens.min(4), ..s };
                generate::generate(m, &prompts, &warm, &[], 0)?;
                sync(m.device());
                let t0 = Instant::now();
                let out = generate::generate(m, &prompts, &s, &[], 0)?;
                sync(m.device());
                let secs = t0.elapsed().as_secs_f64();
                let n: usize = out.iter().map(|c| c.tokens.len()).sum();
                let tokens_per_s = n as f64 / secs;
                let steady = steady_tokens_per_s(m, &prompts, new_tokens, secs)?;
                let step_bytes = decode_step_bytes(m, batch as f64, ctx as f64);
                let share = step_bytes * (tokens_per_s / batch as f64) / bandwidth;
                Ok(with(
                    serde_json::json!({"what": "generate", "impl": "topr-loss", "batch": batch, "cuda_graphs": cuda_graphs, "new_tokens": new_tokens, "seconds": secs, "tokens_per_s": tokens_per_s, "steady_tokens_per_s": steady, "bytes_per_step": step_bytes, "bandwidth_share": share}),
                    roofline(generation_flops_per_token(m, ctx), tokens_per_s, peak),
                ))
            };
            if !cuda_graphs {
                println!("{}", one(m)?);
                continue;
            }
            // A failure of the graphs (an error, or a panic of a libtorch operation while
            // recording) is reported as a line and the other measurements go on eagerly: a GPU
            // run is rare, and its eager figures should not be lost with it. No graph is
            // recorded again in this process (a capture that failed may leave the device's
            // allocator mid-capture), so the later batch sizes and the sampling workload run
            // eagerly, and their lines say so.
            let error = match caught(|| one(m)) {
                Ok(line) => {
                    println!("{line}");
                    continue;
                }
                Err(error) => error,
            };
            println!(
                "{}",
                serde_json::json!({"what": "generate", "impl": "topr-loss", "batch": batch, "cuda_graphs": true, "error": error})
            );
            failed = true;
        }
    }
    m.set_cuda_graphs(before && !failed);
    Ok(graphs && !failed)
}

/// The prompt of the generation measurements.
const STORY: &str = "Tell me a long story about a dragon.";

/// `--profile`: greedy generation of up to 32 tokens at each of `batches`, eagerly and (when
/// `graphs`) replaying CUDA graphs, run once without and once with libtorch's profiler; each
/// trace goes to `dir/generate-bB-MODE.json` and its summary ([`profile::summarize`]: kernels and
/// launches a step, the device's busy share, copies to the host, the costliest kernels and
/// operators) to one JSON line, beside the unprofiled run's wall time a step. Eagerly a step is
/// one generated token, the prefill's share included; with graphs it is one replay, counted from
/// the first (the prefill, the eager first step and the recording, which every call makes, left
/// out). Called last: a profiler that fails costs its own lines (an error line each, the later
/// runs eager after a failed recording), and one that crashes the process loses nothing else.
pub fn profile(
    m: &mut Llama,
    tok: &Tokenizer,
    new_tokens: i64,
    mut graphs: bool,
    dir: &Path,
    batches: &[usize],
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let prompt = tok.prompt_ids(STORY, true)?;
    let s = Sampling::greedy(new_tokens.min(32));
    // Every eager run first: profiling graphs is the less proven path (Kineto and CUPTI have had
    // bugs with CUDA graphs), and a hang there should find the eager lines printed.
    for cuda_graphs in [false, true] {
        for &batch in batches {
            if cuda_graphs && !graphs {
                continue;
            }
            m.set_cuda_graphs(cuda_graphs);
            let prompts = vec![prompt.clone(); batch];
            let name = format!("generate-b{batch}-{}.json", if cuda_graphs { "graphs" } else { "eager" });
            let line = match caught(|| profile_one(m, &prompts, &s, &dir.join(&name))) {
                Ok(line) => line,
                Err(error) => {
                    graphs &= !cuda_graphs;
                    serde_json::json!({"error": error})
                }
            };
            let head = serde_json::json!({"what": "profile", "impl": "topr-loss", "batch": batch, "cuda_graphs": cuda_graphs, "trace": name});
            println!("{}", with(head, line));
        }
    }
    m.set_cuda_graphs(false);
    Ok(())
}

/// One run of [`profile`]: the fields of its line.
fn profile_one(m: &Llama, prompts: &[Vec<i64>], s: &Sampling, trace: &Path) -> Result<serde_json::Value> {
    let timed = |m: &Llama| -> Result<(Vec<generate::Completion>, f64)> {
        let t0 = Instant::now();
        let out = generate::generate(m, prompts, s, &[], 0)?;
        sync(m.device());
        Ok((out, t0.elapsed().as_secs_f64() * 1e6))
    };
    sync(m.device());
    let (_, unprofiled_us) = timed(m)?;
    let profiler = Profiler::start(m.device())?;
    let (out, wall_us) = timed(m)?;
    profiler.finish(trace)?;
    let steps = out.iter().map(|c| c.tokens.len()).max().unwrap_or(0).max(1) as u64;
    let window = if m.cuda_graphs() { Window::From("cudaGraphLaunch") } else { Window::All { steps, wall_us } };
    let summary = profile::summarize(trace, window, 12)?;
    let mut line = serde_json::json!({"tokens": steps, "unprofiled_wall_us_per_token": unprofiled_us / steps as f64, "summary": summary});
    if m.device().is_cuda() && summary.kernels_per_step == 0.0 {
        line["warning"] =
            "no GPU kernel in the trace: CUPTI unavailable? Only the host's operators were recorded".into();
    }
    Ok(line)
}

/// Runs `f`, turning its error or a panic inside it (a libtorch operation's) into the message.
fn caught<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into())),
    }
}

/// The decoding steps' tokens/s of [`generation`]: `prompts` (one completion each, greedy) run for
/// `new_tokens − new_tokens / 2` tokens after a run of `new_tokens` that took `full_secs`, on the
/// same cache capacity; `None` when the budget is too short to halve or the difference is not
/// positive (noise larger than the steps' time).
fn steady_tokens_per_s(m: &Llama, prompts: &[Vec<i64>], new_tokens: i64, full_secs: f64) -> Result<Option<f64>> {
    let half = new_tokens / 2;
    if half < 1 || prompts.is_empty() {
        return Ok(None);
    }
    // A prompt longer by the tokens left out, which no job decodes: the capacity (the longest
    // prompt plus the budget) is the full run's.
    let mut padded = prompts.to_vec();
    let mut longer = prompts.iter().max_by_key(|p| p.len()).cloned().unwrap_or_default();
    longer.extend(std::iter::repeat_n(*longer.last().unwrap_or(&0), (new_tokens - half) as usize));
    padded.push(longer);
    let jobs: Vec<generate::Job> = (0..prompts.len())
        .map(|i| generate::Job { prompt: i, stream: generate::Stream::new(0, i as u64, 0) })
        .collect();
    let s = Sampling::greedy(half);
    sync(m.device());
    let t0 = Instant::now();
    let out = generate::collect(m, &padded, &jobs, &s, &[], generate::Batching::default(), || ())?;
    sync(m.device());
    let secs = t0.elapsed().as_secs_f64();
    let half_tokens: usize = out.iter().map(|c| c.tokens.len()).sum();
    let added = (new_tokens as usize * prompts.len()).saturating_sub(half_tokens) as f64;
    Ok((full_secs > secs && added > 0.0).then(|| added / (full_secs - secs)))
}

/// A sampling workload with uneven lengths, with continuous batching and with draining batches
/// side by side: `prompts` synthetic problems (chat prompts), 4 samples each at temperature 1,
/// `new_tokens` at most, ending at the tokenizer's end-of-sequence tokens (and, with
/// `stop_every > 0`, at every id that is a multiple of it: see `bench --sample-stop-every`),
/// `slots` in flight. One line per mode: completions, generated tokens, seconds, tokens/s, and
/// the mean and largest completion length.
pub fn sampling(
    m: &Llama,
    tok: &Tokenizer,
    prompts: usize,
    slots: usize,
    new_tokens: i64,
    stop_every: i64,
) -> Result<()> {
    if prompts == 0 {
        return Ok(());
    }
    let problems = topr_llama::task::synthetic_problems(0, prompts, 2);
    let style = topr_llama::task::PromptStyle::Chat;
    let ids: Vec<Vec<i64>> =
        problems.iter().map(|p| topr_llama::task::prompt_ids(tok, &style, p)).collect::<Result<_>>()?;
    let jobs: Vec<generate::Job> = (0..prompts)
        .flat_map(|i| (0..4).map(move |k| generate::Job { prompt: i, stream: generate::Stream::new(0, i as u64, k) }))
        .collect();
    let s = Sampling::sample(generate::SamplingParams::default(), new_tokens);
    let mut eos = tok.eos_ids.clone();
    if stop_every > 0 {
        eos.extend((0..m.cfg.vocab_size).step_by(stop_every as usize).filter(|i| !tok.eos_ids.contains(i)));
    }
    for refill in [true, false] {
        let batching = generate::Batching { slots, refill, ..generate::Batching::default() };
        sync(m.device());
        let t0 = Instant::now();
        let out = generate::collect(m, &ids, &jobs, &s, &eos, batching, || ())?;
        sync(m.device());
        let secs = t0.elapsed().as_secs_f64();
        let lens: Vec<usize> = out.iter().map(|c| c.tokens.len()).collect();
        let n: usize = lens.iter().sum();
        println!(
            "{}",
            serde_json::json!({"what": "sample", "impl": "topr-loss", "batching": if refill { "continuous" } else { "draining" }, "slots": slots, "stop_every": stop_every, "cuda_graphs": m.cuda_graphs(), "completions": out.len(), "tokens": n, "seconds": secs, "tokens_per_s": n as f64 / secs, "mean_len": n as f64 / lens.len() as f64, "max_len": lens.iter().max()})
        );
    }
    Ok(())
}

/// Bytes a decoding step of `batch` rows at context `ctx` reads: the weights it multiplies by
/// (the embedding's looked-up rows aside; a tied output layer counted once) and the cached keys
/// and values.
fn decode_step_bytes(m: &Llama, batch: f64, ctx: f64) -> f64 {
    let c = &m.cfg;
    let elt = m.kind().elt_size_in_bytes() as f64;
    let embedding = c.vocab_size as f64 * c.hidden_size as f64;
    let weights = c.parameter_count() - if c.tie_word_embeddings { 0.0 } else { embedding };
    let kv = 2.0 * c.num_hidden_layers as f64 * (c.num_kv_heads() * c.head_dim()) as f64 * ctx * batch;
    (weights + kv) * elt
}

/// A device-to-device copy's bandwidth, bytes read plus bytes written per second: the mean of 10
/// copies of 1 GiB (64 MiB on the CPU) after one warm-up copy.
fn copy_bandwidth(device: tch::Device, kind: Kind) -> f64 {
    let bytes: i64 = if device.is_cuda() { 1 << 30 } else { 64 << 20 };
    let n = bytes / kind.elt_size_in_bytes() as i64;
    let src = Tensor::ones([n], (kind, device));
    let mut dst = Tensor::zeros([n], (kind, device));
    let secs = seconds_per_call(device, 10, || {
        dst.copy_(&src);
        Ok(())
    })
    .unwrap_or(f64::NAN);
    2.0 * bytes as f64 / secs
}

/// The training measurement's batch: `[B, T]` random token ids (seeded) and an all-ones mask.
fn training_batch(m: &Llama, train_batch: i64, train_len: i64) -> (Tensor, Tensor) {
    tch::manual_seed(0);
    let ids = Tensor::randint(m.cfg.vocab_size, [train_batch, train_len], (Kind::Int64, m.device()));
    (ids, Tensor::ones([train_batch, train_len], (Kind::Int64, m.device())))
}

/// One training step of the measurement: forward + backward of the mean next-token NLL through
/// the full logits.
fn nll_step(m: &Llama, ids: &Tensor, mask: &Tensor) -> Result<()> {
    let len = ids.size()[1];
    let logits = m.logits(ids, mask)?; // [B, T, V]
    let lp = logits.narrow(1, 0, len - 1).log_softmax(-1, Kind::Float);
    let nll = -lp.gather(2, &ids.narrow(1, 1, len - 1).unsqueeze(2), false).mean(Kind::Float);
    nll.backward();
    Ok(())
}

/// `pairs` alternating pairs of [`nll_step`] with [`Kernels::Plain`] and [`Kernels::Onednn`]
/// (after one warm-up step each): the in-process comparison of the two kernels of training,
/// which the machine's drift between runs would otherwise hide. Restores the model's kernels.
pub fn kernel_pairs(m: &mut Llama, train_batch: i64, train_len: i64, pairs: usize) -> Result<()> {
    if pairs == 0 {
        return Ok(());
    }
    let before = m.kernels();
    let (ids, mask) = training_batch(m, train_batch, train_len);
    let tokens = (train_batch * train_len) as f64;
    let timed = |m: &mut Llama, k: Kernels| -> Result<f64> {
        m.set_kernels(k);
        let t0 = Instant::now();
        nll_step(m, &ids, &mask)?;
        sync(m.device());
        Ok(tokens / t0.elapsed().as_secs_f64())
    };
    timed(m, Kernels::Plain)?;
    timed(m, Kernels::Onednn)?;
    for pair in 0..pairs {
        let plain = timed(m, Kernels::Plain)?;
        let onednn = timed(m, Kernels::Onednn)?;
        let onednn_applies = m.trains_with_onednn();
        println!(
            "{}",
            serde_json::json!({"what": "train_kernels_pair", "impl": "topr-loss", "pair": pair, "batch": train_batch, "len": train_len,
                "plain_tokens_per_s": plain, "onednn_tokens_per_s": onednn, "ratio": onednn / plain, "onednn_applies": onednn_applies})
        );
    }
    m.set_kernels(before);
    Ok(())
}

/// `pairs` alternating pairs of a training step on sequences whose first half is prompt (RL
/// fine-tuning's shape: a prompt, then the completion trained on), after one warm-up step each:
/// the completion's next-token NLL through `backward_through_logprobs` on the logits of every
/// position (the training forward before 2026-12-04), then on the logits from the prompt's last
/// position on only ([`Llama::next_token_logits`], the training forward now). In one process,
/// because the machine's drift between runs is larger than the difference.
pub fn prompt_pairs(m: &Llama, train_batch: i64, train_len: i64, pairs: usize) -> Result<()> {
    if pairs == 0 {
        return Ok(());
    }
    let (ids, mask) = training_batch(m, train_batch, train_len);
    let from = train_len / 2 - 1;
    let width = train_len - 1 - from;
    let labels = ids.narrow(1, from + 1, width);
    let cfg = topr_loss::LogProbConfig::default();
    let timed = |all_positions: bool| -> Result<f64> {
        let t0 = Instant::now();
        let logits = match all_positions {
            true => m.logits(&ids, &mask)?.narrow(1, from, width),
            false => m.next_token_logits(&ids, &mask, from)?,
        };
        let _ = topr_loss::backward_through_logprobs(&logits, &labels, None, &cfg, |lp| {
            Ok::<_, topr_loss::LossError>(-lp.logp.mean(Kind::Float))
        })?;
        sync(m.device());
        Ok(t0.elapsed().as_secs_f64())
    };
    timed(true)?;
    timed(false)?;
    for pair in 0..pairs {
        let all = timed(true)?;
        let completion = timed(false)?;
        println!(
            "{}",
            serde_json::json!({"what": "train_prompt_pair", "impl": "topr-loss", "pair": pair, "batch": train_batch, "len": train_len,
                "prompt": from + 1, "all_positions_s": all, "completion_positions_s": completion, "ratio": completion / all})
        );
    }
    Ok(())
}

fn training(m: &Llama, train_batch: i64, train_len: i64, peak: f64) -> Result<()> {
    let (ids, mask) = training_batch(m, train_batch, train_len);
    let step = || nll_step(m, &ids, &mask);
    let flops = flops_per_token(m, train_len);
    let iters = 3;
    let secs = seconds_per_call(m.device(), iters, step)?;
    println!(
        "{}",
        with(
            serde_json::json!({"what": "train_fwd_bwd", "impl": "topr-loss", "batch": train_batch, "len": train_len, "seconds": secs, "tokens_per_s": (train_batch * train_len) as f64 / secs}),
            roofline(flops, (train_batch * train_len) as f64 / secs, peak)
        )
    );
    // The same step through the crate's fused log-prob path: no [B, T, V] logits tensor.
    let cfg = topr_loss::LogProbConfig::default();
    let labels = ids.narrow(1, 1, train_len - 1);
    let fused_step = || -> Result<()> {
        let hidden = m.hidden(&ids, &mask)?.narrow(1, 0, train_len - 1); // [B, T−1, H]
        let _ = topr_loss::backward_through_fused_logprobs(&hidden, m.lm_head(), &labels, None, &cfg, |lp| {
            Ok::<_, topr_loss::LossError>(-lp.logp.mean(Kind::Float))
        })?;
        Ok(())
    };
    let secs = seconds_per_call(m.device(), iters, fused_step)?;
    println!(
        "{}",
        with(
            serde_json::json!({"what": "train_fwd_bwd_fused_logprobs", "impl": "topr-loss", "batch": train_batch, "len": train_len, "seconds": secs, "tokens_per_s": (train_batch * train_len) as f64 / secs}),
            roofline(flops, (train_batch * train_len) as f64 / secs, peak)
        )
    );
    Ok(())
}

/// Mean seconds of `iters` calls of `f` after one warm-up call, the device's queue drained
/// before and after the timed calls.
fn seconds_per_call(device: tch::Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    sync(device);
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    sync(device);
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}
