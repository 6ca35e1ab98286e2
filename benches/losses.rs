//! Forward + backward time of the TOPR losses at training-sized shapes (CPU, f32).
//! Run: `cargo bench --bench losses` (after `source scripts/env.sh`). Figures: docs/performance.md.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use tch::{Device, Kind, Tensor};
use topr_loss::{
    DpoConfig, KlConfig, PpoConfig, ToprConfig, ToprTokenConfig, cispo_loss, dpo_loss, gspo_loss, kl_penalty,
    ppo_clip_loss, topr_loss, topr_token_loss,
};

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

/// The other token-level objectives at the same shapes: PPO-clip (dual clip), GSPO, CISPO, KL k3.
fn other_objectives(c: &mut Criterion) {
    let mut g = c.benchmark_group("objectives");
    g.sample_size(10);
    for b in [64i64, 512] {
        for t in [256i64, 2048] {
            let opts = (Kind::Float, Device::Cpu);
            let logp = (Tensor::randn([b, t], opts) * 0.1 - 1.0).set_requires_grad(true);
            let old = Tensor::randn([b, t], opts) * 0.1 - 1.0;
            let adv = Tensor::randn([b], opts);
            let lengths = Tensor::randint_low(1, t + 1, [b, 1], (Kind::Int64, Device::Cpu));
            let mask = Tensor::arange(t, (Kind::Int64, Device::Cpu)).unsqueeze(0).lt_tensor(&lengths);
            let ppo = PpoConfig::ppo().with_dual_clip(Some(3.0));
            let cases: [(&str, &dyn Fn() -> Tensor); 4] = [
                ("ppo_clip_dual", &|| ppo_clip_loss(&logp, &old, &adv, &mask, &ppo).unwrap()),
                ("gspo", &|| gspo_loss(&logp, &old, &adv, &mask, &PpoConfig::gspo()).unwrap()),
                ("cispo", &|| cispo_loss(&logp, &old, &adv, &mask, &PpoConfig::cispo()).unwrap()),
                ("kl_k3", &|| kl_penalty(&logp, &old, &mask, &KlConfig::default()).unwrap()),
            ];
            for (name, f) in cases {
                g.bench_function(format!("{name}/B={b}/T={t}"), |bench| {
                    bench.iter(|| {
                        let loss = f();
                        loss.backward();
                        black_box(loss)
                    })
                });
            }
        }
        // DPO works on sequence log-probs [B].
        let opts = (Kind::Float, Device::Cpu);
        let pc = (Tensor::randn([b], opts) - 50.0).set_requires_grad(true);
        let pr = (Tensor::randn([b], opts) - 50.0).set_requires_grad(true);
        let (rc, rr) = (Tensor::randn([b], opts) - 50.0, Tensor::randn([b], opts) - 50.0);
        g.bench_function(format!("dpo_sigmoid/B={b}"), |bench| {
            bench.iter(|| {
                let loss = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::default()).unwrap();
                loss.backward();
                black_box(loss)
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
    targets = sequence_level, token_level, other_objectives
}
criterion_main!(benches);
