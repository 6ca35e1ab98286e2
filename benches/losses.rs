//! Forward + backward time of the TOPR losses at training-sized shapes (CPU, f32).
//! Run: `cargo bench --bench losses` (after `source scripts/env.sh`). Figures: docs/performance.md.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use tch::{Device, Kind, Tensor};
use topr_loss::{ToprConfig, ToprTokenConfig, topr_loss, topr_token_loss};

fn sequence_level(c: &mut Criterion) {
    let mut g = c.benchmark_group("topr_loss");
    for b in [64i64, 512] {
        let opts = (Kind::Float, Device::Cpu);
        let logp = (Tensor::randn([b], opts) - 50.0).set_requires_grad(true);
        let logp_mu = Tensor::randn([b], opts) - 50.0;
        let rewards = Tensor::randn([b], opts).sign();
        g.bench_function(format!("B={b}"), |bench| {
            bench.iter(|| {
                let loss = topr_loss(&logp, &logp_mu, &rewards, &ToprConfig::canonical()).unwrap();
                loss.backward();
                black_box(loss)
            })
        });
    }
    g.finish();
}

fn token_level(c: &mut Criterion) {
    let mut g = c.benchmark_group("topr_token_loss");
    g.sample_size(10);
    for b in [64i64, 512] {
        for t in [256i64, 2048] {
            let opts = (Kind::Float, Device::Cpu);
            let logp = (Tensor::randn([b, t], opts) * 0.1 - 1.0).set_requires_grad(true);
            let logp_mu = Tensor::randn([b, t], opts) * 0.1 - 1.0;
            let rewards = Tensor::randn([b], opts).sign();
            let lengths = Tensor::randint_low(1, t + 1, [b, 1], (Kind::Int64, Device::Cpu));
            let mask = Tensor::arange(t, (Kind::Int64, Device::Cpu)).unsqueeze(0).lt_tensor(&lengths);
            // Context: Trinity-RFT's surrogate written directly in tch, with no input checks, no
            // log-space guard and no value beyond the surrogate. The gap is what checks cost.
            g.bench_function(format!("unchecked_surrogate/B={b}/T={t}"), |bench| {
                bench.iter(|| {
                    let ratio = (&logp - &logp_mu).exp();
                    let r = rewards.unsqueeze(1);
                    let alpha = ratio.clamp(0.0, 1.0).where_self(&r.le(0.0), &ratio.ones_like()).detach();
                    let mf = mask.to_kind(Kind::Float);
                    let loss = (-(alpha * &r * &logp) * &mf).sum(Kind::Float) / mf.sum(Kind::Float);
                    loss.backward();
                    black_box(loss)
                })
            });
            for (name, cfg) in [
                ("paper", ToprTokenConfig::paper()),
                ("verl", ToprTokenConfig::verl()),
                ("trinity", ToprTokenConfig::trinity()),
            ] {
                g.bench_function(format!("{name}/B={b}/T={t}"), |bench| {
                    bench.iter(|| {
                        let loss = topr_token_loss(&logp, &logp_mu, &rewards, &mask, &cfg).unwrap();
                        loss.backward();
                        black_box(loss)
                    })
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, sequence_level, token_level);
criterion_main!(benches);
