//! From a model's logits to TOPR's loss and its gradient: the step the README shows.
//!
//! A stand-in model (one linear layer over random hidden states) scores two completions of four
//! tokens, the second one token shorter (padding). At sampling time the sampler's log-probs
//! `logp_mu` were saved with the data (here: the same model's, so the data is on-policy and every
//! importance ratio is 1); at training time the loss runs inside `backward_through_logprobs`,
//! which hands it the policy's log-probs and takes the gradient back to the logits.
//!
//! Run: `cargo run --example logits_to_loss` (after `source scripts/env.sh`).

use tch::{Device, Kind, Tensor, nn, nn::Module};
use topr_loss::{LogProbConfig, ToprTokenConfig, backward_through_logprobs, token_logprobs, topr_token_loss};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (b, t, h, v) = (2, 4, 8, 32);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), h, v, Default::default());
    let hidden = Tensor::randn([b, t, h], (Kind::Float, Device::Cpu));
    let labels = Tensor::from_slice2(&[[3i64, 7, 1, 4], [5, 2, 9, 0]]); // the sampled tokens
    let mask = Tensor::from_slice2(&[[true, true, true, true], [true, true, true, false]]);
    let rewards = Tensor::from_slice(&[1.0f32, -1.0]); // graded: right, wrong
    let cfg = LogProbConfig::new();

    // README: start
    // Sampling time: μ's log-probs of the sampled tokens (no graph), saved with the data.
    let logp_mu = token_logprobs(&model.forward(&hidden), &labels, Some(&mask), &cfg)?.logp;

    // Training time: the policy's logits [B, T, V] (position t scores token t), the loss on its
    // log-probs, and the gradient back into the model's weights.
    let logits = model.forward(&hidden);
    let loss = backward_through_logprobs(&logits, &labels, Some(&mask), &cfg, |lp| {
        topr_token_loss(&lp.logp, &logp_mu, &rewards, &lp.mask, &ToprTokenConfig::paper())
    })?;
    // README: end

    let grad: f64 = vs.trainable_variables().iter().map(|w| w.grad().norm().double_value(&[])).sum();
    println!("loss {:.4}, gradient norm {:.4}", loss.double_value(&[]), grad);
    assert!(grad > 0.0, "the gradient reached the weights");
    Ok(())
}
