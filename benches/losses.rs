//! Forward + backward time of the TOPR losses at training-sized shapes (CPU, f32).
//! Run: `cargo bench --bench losses` (after `source scripts/env.sh`). Figures: docs/performance.md.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use tch::{Device, Kind, Tensor};
use topr_loss::{
    AggregationMode, Checks, ClipCovConfig, DecoupledPpoConfig, DpoConfig, DpoMix, DppoConfig, DroConfig,
    EntropyConfig, GmpoConfig, GroupAdvantage, KlConfig, KlCovConfig, Normalizer, PositiveNllConfig, PpoConfig,
    ProximalApproximation, Rejection, RejectionScope, RolloutCorrection, SapoConfig, SftPhiConfig, SingletonGroup,
    ToprConfig, ToprTokenConfig, ValueLossConfig, VespoConfig, apply_token_weights, cispo_loss, clip_cov_loss,
    decoupled_ppo_loss, dpo_loss, dpo_mix_loss, dppo_loss, dro_loss, entropy_loss, gae_advantages, gdpo_advantages,
    gmpo_loss, gspo_loss, kl_cov_loss, kl_penalty, kl_penalty_corrected, m2po_mask, maxrl_advantages,
    optimal_token_baseline_advantages, overlong_penalty, passk_advantages, positive_nll_loss, ppo_clip_loss,
    ppo_clip_loss_output, proximal_logprobs, reinforce_pp_advantages, rollout_rejection_mask,
    rollout_rejection_mask_all, rollout_weights, sapo_loss, sft_phi_loss, top_entropy_mask, topr_loss, topr_token_loss,
    value_loss, vespo_loss,
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

/// The research objectives and the terms composed with them, at B = 64, T = 256 and B = 512, T = 2048:
/// SAPO, GMPO, Clip-Cov, KL-Cov, the entropy bonus and top-entropy mask, the KL variants, the
/// value loss, rollout correction (weights, a rejection rule, PPO re-weighted), token-level
/// advantage estimators, DPPO, DRO, pass@k and GDPO advantages, CHORD's SFT-φ term and VAPO's
/// positive-example NLL, and every DPO-family loss at B = 512.
fn research_objectives(c: &mut Criterion) {
    let mut g = c.benchmark_group("research_objectives");
    g.sample_size(10);
    for (b, t) in [(64i64, 256i64), (512, 2048)] {
        let opts = (Kind::Float, Device::Cpu);
        let logp = (Tensor::randn([b, t], opts) * 0.1 - 1.0).set_requires_grad(true);
        let old = Tensor::randn([b, t], opts) * 0.1 - 1.0;
        let refp = Tensor::randn([b, t], opts) * 0.1 - 1.0;
        let adv = Tensor::randn([b], opts);
        let lengths = Tensor::randint_low(1, t + 1, [b, 1], (Kind::Int64, Device::Cpu));
        let mask = Tensor::arange(t, (Kind::Int64, Device::Cpu)).unsqueeze(0).lt_tensor(&lengths);
        let keys = Tensor::rand([b, t], opts);
        let entropy = (Tensor::rand([b, t], opts) * 3.0).set_requires_grad(true);
        let values = Tensor::randn([b, t], opts).set_requires_grad(true);
        let values_old = Tensor::randn([b, t], opts);
        let returns = Tensor::randn([b, t], opts);
        let token_rewards = Tensor::randn([b, t], opts) * 0.01;
        // Σπ² of a two-token distribution with the sampled token at π = exp(old): π² + (1 − π)².
        let pi = old.exp();
        let sum_pi2 = &pi * &pi + (-&pi + 1.0).square();
        let norm = Normalizer::local();
        let positive = adv.gt(0.0);
        let backward = |f: &dyn Fn() -> Tensor| {
            let loss = f();
            loss.backward();
            black_box(loss)
        };
        let cases: &[(&str, &dyn Fn() -> Tensor)] = &[
            ("sapo", &|| backward(&|| sapo_loss(&logp, &old, &adv, &mask, &SapoConfig::sapo()).unwrap())),
            ("dppo_tv", &|| backward(&|| dppo_loss(&logp, &old, &adv, &mask, &DppoConfig::tv()).unwrap())),
            ("dro", &|| backward(&|| dro_loss(&logp, &old, &adv, &mask, &DroConfig::default()).unwrap())),
            ("decoupled_ppo", &|| {
                backward(&|| decoupled_ppo_loss(&logp, &old, &refp, &adv, &mask, &DecoupledPpoConfig::areal()).unwrap())
            }),
            ("proximal_logprobs", &|| {
                let s = Tensor::full([b], 3.0, opts);
                proximal_logprobs(&refp, &logp, &s, &mask, ProximalApproximation::LogLinear).unwrap()
            }),
            ("m2po_mask", &|| m2po_mask(&old, &refp, &mask, 0.04).unwrap()),
            ("vespo", &|| backward(&|| vespo_loss(&logp, &old, &adv, &mask, &VespoConfig::vespo()).unwrap())),
            ("passk_advantages", &|| passk_advantages(&adv.reshape([1, -1]), true, 1e-6).unwrap()),
            ("gdpo_advantages", &|| {
                let r = adv.reshape([1, -1, 1]).repeat([1, 1, 2]);
                let m = mask.narrow(0, 0, 1).repeat([adv.size()[0], 1]);
                gdpo_advantages(&r, &[1.0, 0.5], &m, GroupAdvantage::grpo(), SingletonGroup::ZeroMeanUnitStd).unwrap()
            }),
            ("maxrl_advantages", &|| maxrl_advantages(&adv.abs().reshape([-1, 8]), 1e-6).unwrap()),
            ("optimal_token_baseline_advantages", &|| {
                let verl = SingletonGroup::ZeroMeanUnitStd;
                optimal_token_baseline_advantages(&old, &sum_pi2, &token_rewards, &mask, None, 8, verl, 1e-8)
                    .unwrap()
                    .advantages
            }),
            ("overlong_penalty", &|| overlong_penalty(&lengths, t, t / 4, 1.0).unwrap()),
            ("gmpo", &|| backward(&|| gmpo_loss(&logp, &old, &adv, &mask, &GmpoConfig::gmpo()).unwrap())),
            ("clip_cov", &|| {
                backward(&|| clip_cov_loss(&logp, &old, &adv, &mask, &keys, &ClipCovConfig::clip_cov()).unwrap())
            }),
            ("kl_cov", &|| backward(&|| kl_cov_loss(&logp, &old, &adv, &mask, &KlCovConfig::kl_cov()).unwrap())),
            ("entropy_bonus", &|| backward(&|| entropy_loss(&entropy, &mask, &EntropyConfig::bonus()).unwrap())),
            ("top_entropy_mask", &|| top_entropy_mask(&entropy.detach(), &mask, 0.2, Checks::Full).unwrap()),
            ("sft_phi", &|| backward(&|| sft_phi_loss(&logp, &mask, &SftPhiConfig::chord_phi()).unwrap())),
            ("positive_nll", &|| {
                backward(&|| positive_nll_loss(&logp, &mask, &positive, &PositiveNllConfig::vapo()).unwrap())
            }),
            ("kl_abs", &|| backward(&|| kl_penalty(&logp, &refp, &mask, &KlConfig::abs()).unwrap())),
            ("kl_k3_plus", &|| {
                backward(&|| kl_penalty(&logp, &refp, &mask, &KlConfig::k3().with_straight_through(true)).unwrap())
            }),
            ("kl_corrected", &|| {
                backward(&|| kl_penalty_corrected(&logp, &old, &refp, &mask, &KlConfig::k3()).unwrap())
            }),
            ("value_loss", &|| {
                backward(&|| value_loss(&values, &values_old, &returns, &mask, &ValueLossConfig::ppo()).unwrap())
            }),
            ("rollout_weights_token_tis", &|| {
                rollout_weights(&logp, &old, &mask, &RolloutCorrection::token_tis(2.0)).unwrap().weights
            }),
            ("rejection_seq_max_k3", &|| {
                rollout_rejection_mask(&logp, &old, &mask, &Rejection::k3(RejectionScope::SequenceMax, 0.01)).unwrap()
            }),
            ("rejection_token_k2_and_seq_max_k3", &|| {
                let rules =
                    [Rejection::k2(RejectionScope::Token, 0.1), Rejection::k3(RejectionScope::SequenceMax, 0.01)];
                rollout_rejection_mask_all(&logp, &old, &mask, &rules).unwrap()
            }),
            ("ppo_with_token_tis", &|| {
                backward(&|| {
                    let w = rollout_weights(&logp, &old, &mask, &RolloutCorrection::token_tis(2.0)).unwrap().weights;
                    let out = ppo_clip_loss_output(&logp, &old, &adv, &mask, &PpoConfig::ppo(), &norm).unwrap();
                    apply_token_weights(&out.terms, &w, &mask, AggregationMode::TokenMean, &norm).unwrap()
                })
            }),
            ("gae_then_reinforce_pp", &|| {
                let a = gae_advantages(&token_rewards, &values_old, &mask, 1.0, 0.95).unwrap().advantages;
                let r = reinforce_pp_advantages(&token_rewards, &mask, 1.0, 1e-8).unwrap().advantages;
                a + r
            }),
            // TOPR's successors (paths in full: the import list above is shared).
            ("bapo", &|| {
                backward(&|| topr_loss::bapo_loss(&logp, &old, &adv, &mask, &topr_loss::BapoConfig::paper()).unwrap())
            }),
            ("prefix_ratio_la", &|| {
                let cfg = topr_loss::PrefixRatioConfig::ctpo_la();
                backward(&|| topr_loss::prefix_ratio_loss(&logp, &old, &adv, &mask, &cfg).unwrap())
            }),
            ("lens_advantages", &|| {
                let r = adv.gt(0.0).to_kind(Kind::Float).reshape([-1, 8]);
                topr_loss::lens_advantages(&r, &old, &mask, &topr_loss::LensConfig::lens()).unwrap()
            }),
        ];
        for (name, f) in cases {
            g.bench_function(format!("{name}/B={b}/T={t}"), |bench| bench.iter(f));
        }
    }
    let b = 512i64;
    let opts = (Kind::Float, Device::Cpu);
    let pc = (Tensor::randn([b], opts) - 50.0).set_requires_grad(true);
    let pr = (Tensor::randn([b], opts) - 50.0).set_requires_grad(true);
    let (rc, rr) = (Tensor::randn([b], opts) - 50.0, Tensor::randn([b], opts) - 50.0);
    let dpo = [
        ("robust", DpoConfig::robust(0.1)),
        ("exo_pair", DpoConfig::exo_pair(1e-3)),
        ("nca_pair", DpoConfig::nca_pair()),
        ("bco_pair", DpoConfig::bco_pair()),
        ("sppo_hard", DpoConfig::sppo_hard()),
        ("aot", DpoConfig::aot()),
        ("aot_unpaired", DpoConfig::aot_unpaired()),
        ("apo_zero", DpoConfig::apo_zero()),
        ("apo_down", DpoConfig::apo_down()),
        ("discopop", DpoConfig::discopop()),
        ("sigmoid_norm", DpoConfig::sigmoid_norm()),
    ];
    for (name, cfg) in dpo {
        g.bench_function(format!("dpo_{name}/B={b}"), |bench| {
            bench.iter(|| {
                let loss = dpo_loss(&pc, &pr, &rc, &rr, &cfg).unwrap();
                loss.backward();
                black_box(loss)
            })
        });
    }
    let mix = DpoMix::of(DpoConfig::dpo(), 0.8).with_term(DpoConfig::bco_pair(), 0.2);
    g.bench_function(format!("dpo_mix_sigmoid_bco/B={b}"), |bench| {
        bench.iter(|| {
            let loss = dpo_mix_loss(&pc, &pr, &rc, &rr, &mix).unwrap();
            loss.backward();
            black_box(loss)
        })
    });
    g.finish();
}

// No HTML plots: criterion's plotting needs a system font that the machines this project runs on
// lack (it panicked with FontUnavailable); the numbers are what docs/performance.md reports.
criterion_group! {
    name = benches;
    config = Criterion::default().without_plots();
    targets = sequence_level, token_level, other_objectives, research_objectives
}
criterion_main!(benches);
