//! Log-prob extraction, forward + backward, naive vs chunked vs fused, for V = 32k and 128k
//! (CPU, f32). Peak memory of the same three variants: `cargo bench --bench logprob_memory`.
//! Figures: docs/performance.md.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use tch::{Device, Kind, Tensor};
use topr_loss::{LogProbConfig, backward_through_fused_logprobs, backward_through_logprobs};

pub const B: i64 = 4;
pub const T: i64 = 256;
pub const H: i64 = 128;

fn inputs(v: i64) -> (Tensor, Tensor, Tensor) {
    tch::manual_seed(0);
    let opts = (Kind::Float, Device::Cpu);
    let hidden = (Tensor::randn([B, T, H], opts) * 0.5).set_requires_grad(true);
    let weight = (Tensor::randn([v, H], opts) * 0.05).set_requires_grad(true);
    let labels = Tensor::randint(v, [B, T], (Kind::Int64, Device::Cpu));
    (hidden, weight, labels)
}

fn logprobs(c: &mut Criterion) {
    let mut g = c.benchmark_group("logprobs_fwd_bwd");
    g.sample_size(10);
    for v in [32_768i64, 131_072] {
        let (hidden, weight, labels) = inputs(v);
        let cfg = LogProbConfig::new().with_chunk_tokens(64);
        g.bench_function(format!("naive/V={v}"), |b| {
            b.iter(|| {
                let logits = hidden.matmul(&weight.tr()); // [B, T, V]
                let lp = logits.log_softmax(-1, Kind::Float).gather(2, &labels.unsqueeze(2), false);
                let loss = -lp.sum(Kind::Float);
                loss.backward();
                black_box(loss)
            })
        });
        g.bench_function(format!("chunked/V={v}"), |b| {
            b.iter(|| {
                let logits = hidden.matmul(&weight.tr());
                black_box(
                    backward_through_logprobs(&logits, &labels, None, &cfg, |x| {
                        Ok::<_, topr_loss::LossError>(-x.logp.sum(Kind::Float))
                    })
                    .unwrap(),
                )
            })
        });
        g.bench_function(format!("fused/V={v}"), |b| {
            b.iter(|| {
                black_box(
                    backward_through_fused_logprobs(&hidden, &weight, &labels, None, &cfg, |x| {
                        Ok::<_, topr_loss::LossError>(-x.logp.sum(Kind::Float))
                    })
                    .unwrap(),
                )
            })
        });
    }
    g.finish();
}

// No HTML plots: criterion's plotting needs a system font that the machines this project runs on
// lack (it panicked with FontUnavailable); the numbers are what docs/performance.md reports.
criterion_group! {
    name = benches;
    config = Criterion::default().without_plots();
    targets = logprobs
}
criterion_main!(benches);
