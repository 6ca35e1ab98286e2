//! `bench`: throughput of generation (greedy, fixed length, batch 1 and 16) and of a training
//! step (forward + backward of the mean next-token NLL), each after one warm-up run. One JSON
//! line per measurement on stdout.

use anyhow::Result;
use std::time::Instant;
use tch::{Kind, Tensor};
use topr_llama::generate::{self, Sampling};
use topr_llama::model::Llama;
use topr_llama::tokenizer::Tokenizer;

pub fn run(m: &Llama, tok: &Tokenizer, new_tokens: i64, train_batch: i64, train_len: i64) -> Result<()> {
    if train_len > m.cfg.max_position_embeddings {
        anyhow::bail!("--train-len {train_len} exceeds the model's context of {}", m.cfg.max_position_embeddings);
    }
    generation(m, tok, new_tokens)?;
    training(m, train_batch, train_len)
}

fn generation(m: &Llama, tok: &Tokenizer, new_tokens: i64) -> Result<()> {
    let prompt = tok.prompt_ids("Tell me a long story about a dragon.", true)?;
    let s = Sampling::greedy(new_tokens);
    for batch in [1usize, 16] {
        let prompts = vec![prompt.clone(); batch];
        let warm = Sampling { max_new_tokens: 4, ..s };
        generate::generate(m, &prompts, &warm, &[], tok.pad_id)?;
        let t0 = Instant::now();
        let out = generate::generate(m, &prompts, &s, &[], tok.pad_id)?; // no EOS: fixed length
        let secs = t0.elapsed().as_secs_f64();
        let n: usize = out.iter().map(|c| c.tokens.len()).sum();
        println!(
            "{}",
            serde_json::json!({"what": "generate", "impl": "topr-loss", "batch": batch, "new_tokens": new_tokens, "seconds": secs, "tokens_per_s": n as f64 / secs})
        );
    }
    Ok(())
}

fn training(m: &Llama, train_batch: i64, train_len: i64) -> Result<()> {
    tch::manual_seed(0);
    let ids = Tensor::randint(m.cfg.vocab_size, [train_batch, train_len], (Kind::Int64, m.device()));
    let mask = Tensor::ones([train_batch, train_len], (Kind::Int64, m.device()));
    let step = || {
        let logits = m.logits(&ids, &mask); // [B, T, V]
        let lp = logits.narrow(1, 0, train_len - 1).log_softmax(-1, Kind::Float);
        let nll = -lp.gather(2, &ids.narrow(1, 1, train_len - 1).unsqueeze(2), false).mean(Kind::Float);
        nll.backward();
    };
    step();
    let iters = 3;
    let t0 = Instant::now();
    for _ in 0..iters {
        step();
    }
    let secs = t0.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{}",
        serde_json::json!({"what": "train_fwd_bwd", "impl": "topr-loss", "batch": train_batch, "len": train_len, "seconds": secs, "tokens_per_s": (train_batch * train_len) as f64 / secs})
    );
    // The same step through the crate's fused log-prob path: no [B, T, V] logits tensor.
    let cfg = topr_loss::LogProbConfig::default();
    let labels = ids.narrow(1, 1, train_len - 1);
    let fused_step = || -> Result<()> {
        let hidden = m.hidden(&ids, &mask).narrow(1, 0, train_len - 1); // [B, T−1, H]
        let _ = topr_loss::backward_through_fused_logprobs(&hidden, m.lm_head(), &labels, None, &cfg, |lp| {
            Ok::<_, topr_loss::LossError>(-lp.logp.mean(Kind::Float))
        })?;
        Ok(())
    };
    fused_step()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        fused_step()?;
    }
    let secs = t0.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{}",
        serde_json::json!({"what": "train_fwd_bwd_fused_logprobs", "impl": "topr-loss", "batch": train_batch, "len": train_len, "seconds": secs, "tokens_per_s": (train_batch * train_len) as f64 / secs})
    );
    Ok(())
}
