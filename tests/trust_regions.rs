//! VESPO against a scalar reference of its formula, finite differences, padding, split invariance,
//! extremes and TRL's lines; and the peers' trust regions that are existing calls of this crate
//! (TRL's `delta`, TRL's LUSPO, prime-rl's default loss, SkyRL's CISPO with either anchor), each
//! tested against the peer's restated lines.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::{Value, json};
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, DppoConfig, KlConfig, LossError, PpoConfig, VespoConfig, cispo_loss, dppo_loss, gspo_loss,
    kl_penalty, ppo_clip_loss, vespo_loss, vespo_loss_output,
};

fn batch() -> impl Strategy<Value = TokenBatch> {
    token_batch(1.0, (-2.0f64..2.0).boxed())
}

fn configs() -> Vec<VespoConfig> {
    vec![
        VespoConfig::vespo(),
        VespoConfig::vespo().with_positive(1.0, 0.5).with_negative(0.0, 4.0),
        VespoConfig::vespo().with_aggregation(AggregationMode::SeqMeanTokenMean),
        VespoConfig::vespo().with_aggregation(AggregationMode::DrGrpo { length: 8.0 }),
    ]
}

/// φ of one sequence by the formula.
fn ref_phi(deltas: &[f64], a: f64, cfg: &VespoConfig) -> f64 {
    let s: f64 = deltas.iter().map(|d| d.clamp(-cfg.max_log_ratio, cfg.max_log_ratio)).sum();
    let log_w = s.clamp(1e-8f64.ln(), cfg.max_log_ratio);
    let (k, l) = if a >= 0.0 { (cfg.k_pos, cfg.lambda_pos) } else { (cfg.k_neg, cfg.lambda_neg) };
    (l + k * log_w - l * log_w.exp()).exp()
}

fn ref_loss(b: &TokenBatch, cfg: &VespoConfig) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.aggregation, None);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        let real: Vec<usize> = (0..row.len()).filter(|&t| row[t]).collect();
        let deltas: Vec<f64> = real.iter().map(|&t| b.logp[i][t] - b.other[i][t]).collect();
        let phi = ref_phi(&deltas, b.weights[i], cfg);
        for &t in &real {
            value += al[i] * -phi * b.weights[i] * b.logp[i][t];
            grad[i][t] = al[i] * -phi * b.weights[i];
        }
    }
    (value, grad.concat())
}

fn run(b: &TokenBatch, cfg: &VespoConfig, padding: f64) -> (f64, Vec<f64>) {
    value_and_grad(b, padding, &|lp, old, adv, m| vespo_loss(lp, old, adv, m, cfg).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn vespo_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in configs() {
            assert_matches_reference(&b, &run(&b, &cfg, f64::NAN), &ref_loss(&b, &cfg), &format!("{cfg:?}"));
        }
    }

    #[test]
    fn vespo_on_policy_is_reinforce(b in batch()) {
        // w = 1: φ = e^{λ − λ} = 1 on every sequence.
        let on = TokenBatch { other: b.logp.clone(), ..b.clone() };
        let (_, g) = run(&on, &VespoConfig::vespo(), 0.0);
        let (lp, old, adv, m) = on.tensors(0.0);
        let lp = leaf(&lp);
        ppo_clip_loss(&lp, &old, &adv, &m, &PpoConfig::ppo()).unwrap().backward();
        assert_close(&g, &vec1(&lp.grad()), 1e-12, "on-policy VESPO vs PPO");
    }

    #[test]
    fn vespo_split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        assert_split_invariant(&b, split, "VESPO", &|lp, old, adv, m, mode, norm| {
            let cfg = VespoConfig::vespo().with_aggregation(mode);
            match norm {
                Some(n) => vespo_loss_output(lp, old, adv, m, &cfg, n).map(|o| o.loss),
                None => vespo_loss(lp, old, adv, m, &cfg),
            }
        });
    }
}

#[test]
fn vespo_gradient_matches_finite_differences() {
    // φ is a stop-gradient weight: the value's derivative holds φ's own, so finite differences
    // are taken with μ moved along with π (φ then constant) — the gradient is −φ A per token.
    let b = fixed_token_batch();
    for cfg in configs() {
        let (_, g) = run(&b, &cfg, 0.0);
        let t = b.mask[0].len();
        let fd = finite_difference(&b.logp.concat(), 1e-6, |x| {
            let logp: Vec<Vec<f64>> = x.chunks(t).map(<[f64]>::to_vec).collect();
            let shift: Vec<Vec<f64>> =
                logp.iter().zip(&b.logp).map(|(n, o)| n.iter().zip(o).map(|(n, o)| n - o).collect()).collect();
            let other =
                b.other.iter().zip(&shift).map(|(r, s)| r.iter().zip(s).map(|(x, s)| x + s).collect()).collect();
            let (lp, old, adv, m) = TokenBatch { logp, other, ..b.clone() }.tensors(0.0);
            scalar(&vespo_loss(&lp, &old, &adv, &m, &cfg).unwrap())
        });
        assert_close(&g, &fd, 1e-6, &format!("{cfg:?} finite differences"));
    }
}

#[test]
fn extreme_and_half_precision_inputs_compute_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        let lp =
            Tensor::from_slice2(&[[-300.0f64, 0.0, -3.0], [0.0, -300.0, -1.0]]).to_kind(kind).set_requires_grad(true);
        let lq = Tensor::from_slice2(&[[0.0f64, -300.0, -3.0], [-300.0, 0.0, -1.0]]).to_kind(kind);
        let m = Tensor::from_slice2(&[[1i64, 1, 1], [1, 1, 1]]);
        let adv = Tensor::from_slice(&[1.0f64, -1.0]).to_kind(kind);
        let cfg = VespoConfig::vespo().with_positive(40.0, 1e-3); // a peak that overflows f32: weight 0
        for c in [VespoConfig::vespo(), cfg] {
            let loss = vespo_loss(&lp, &lq, &adv, &m, &c).unwrap();
            let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
            assert_eq!(loss.kind(), want, "{kind:?}");
            assert!(scalar(&loss).is_finite(), "{kind:?}");
            let g = Tensor::run_backward(&[&loss], &[&lp], false, false);
            assert!(vec1(&g[0].to_kind(Kind::Double)).iter().all(|g| g.is_finite()), "{kind:?}");
        }
    }
}

#[test]
fn bad_configs_are_errors_naming_the_field() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let a = Tensor::from_slice(&[1.0f64]);
    let v = VespoConfig::vespo();
    for (cfg, field) in [
        (v.with_positive(-1.0, 1.0), "k_pos"),
        (v.with_positive(1.0, 0.0), "lambda_pos"),
        (v.with_negative(f64::NAN, 1.0), "k_neg"),
        (v.with_negative(1.0, f64::INFINITY), "lambda_neg"),
    ] {
        let r = vespo_loss(&lp, &lp, &a, &m, &cfg);
        assert!(matches!(r, Err(LossError::InvalidConfig { field: f, .. }) if f == field), "{field}: {r:?}");
    }
    let per_token = Tensor::from_slice2(&[[1.0f64, 1.0]]);
    assert!(format!("{:?}", vespo_loss(&lp, &lp, &per_token, &m, &v)).contains("advantages"));
}

/// Random batches (LCG), log-ratios in ±`spread`, both log-probs at most 0, the first token real.
fn random_batches(seed: u64, n: usize, spread: f64) -> Vec<TokenBatch> {
    let mut next = uniform_stream(seed);
    (0..n).map(|k| random_token_batch(&mut next, 2 + k % 3, 3 + k % 4, spread)).collect()
}

fn mask01(b: &TokenBatch) -> Vec<Vec<f64>> {
    b.mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect()
}

/// The peer's value and gradient for each batch, `call` building its JSON; `None` when the
/// references are skipped.
fn peer_values(batches: &[TokenBatch], call: &dyn Fn(&TokenBatch) -> Value) -> Option<Vec<(f64, Vec<f64>)>> {
    let calls: Vec<Value> = batches.iter().map(call).collect();
    let r = peer(&calls)?;
    Some(r.iter().map(|r| (json_f64(&r["value"])[0], json_f64(&r["grad"]))).collect())
}

#[test]
fn vespo_matches_trls_lines() {
    let batches = random_batches(0x7e5b0, 6, 0.8);
    let cfgs = [VespoConfig::vespo(), VespoConfig::vespo().with_positive(1.0, 0.5).with_negative(0.5, 4.0)];
    for cfg in cfgs {
        let call = |b: &TokenBatch| {
            json!({"fn": "trl.vespo", "args": {"logp": b.logp, "logp_old": b.other, "advantages": b.weights, "mask": mask01(b),
            "k_pos": cfg.k_pos, "lambda_pos": cfg.lambda_pos, "k_neg": cfg.k_neg, "lambda_neg": cfg.lambda_neg}})
        };
        let Some(want) = peer_values(&batches, &call) else { return };
        for (b, (v, g)) in batches.iter().zip(want) {
            let got = run(b, &cfg, 0.0);
            assert_close(&[got.0], &[v], 1e-12, "value");
            assert_close(&got.1, &g, 1e-12, "grad");
        }
    }
}

/// TRL's `delta` (INTELLECT-2's two-sided clip) with `Δ ≥ 1 + ε_high` is PPO's dual clip `c = Δ`.
#[test]
fn trls_delta_clip_is_the_dual_clip() {
    let batches = random_batches(0xde17a, 6, 1.5);
    for (eps_low, eps_high, delta) in [(0.2, 0.2, 1.2), (0.2, 0.28, 4.0), (0.1, 0.3, 2.0)] {
        let call = |b: &TokenBatch| {
            json!({"fn": "trl.delta_clip", "args": {"logp": b.logp, "logp_old": b.other, "advantages": b.weights, "mask": mask01(b),
            "eps_low": eps_low, "eps_high": eps_high, "delta": delta}})
        };
        let Some(want) = peer_values(&batches, &call) else { return };
        let cfg = PpoConfig::ppo().with_clip(eps_low, eps_high).with_dual_clip(Some(delta));
        for (b, (v, g)) in batches.iter().zip(want) {
            let got = value_and_grad(b, 0.0, &|lp, old, adv, m| ppo_clip_loss(lp, old, adv, m, &cfg).unwrap());
            assert_close(&[got.0], &[v], 1e-12, &format!("Δ = {delta} value"));
            assert_close(&got.1, &g, 1e-12, &format!("Δ = {delta} grad"));
        }
    }
}

/// TRL's LUSPO is GSPO with each sequence weighted by its length: `SeqMeanTokenSum`.
#[test]
fn trls_luspo_is_gspo_summed_over_tokens() {
    let batches = random_batches(0x105b0, 6, 0.4);
    let call = |b: &TokenBatch| {
        json!({"fn": "trl.luspo", "args": {"logp": b.logp, "logp_old": b.other, "advantages": b.weights, "mask": mask01(b),
        "eps_low": 0.2, "eps_high": 0.2}})
    };
    let Some(want) = peer_values(&batches, &call) else { return };
    let cfg = PpoConfig::gspo().with_clip(0.2, 0.2).with_aggregation(AggregationMode::SeqMeanTokenSum);
    for (b, (v, g)) in batches.iter().zip(want) {
        let got = value_and_grad(b, 0.0, &|lp, old, adv, m| gspo_loss(lp, old, adv, m, &cfg).unwrap());
        assert_close(&[got.0], &[v], 1e-12, "value");
        assert_close(&got.1, &g, 1e-12, "grad");
    }
}

/// prime-rl's default loss (DPPO-TV's mask, an untruncated ratio, `kl_tau · δ²`) has the gradient
/// of DPPO-TV with `C = ∞` plus a k2 KL term of coefficient `2 kl_tau` against the sampler (the
/// values differ: DPPO's surrogate holds `log π`, prime-rl's the ratio).
#[test]
fn prime_rls_default_loss_is_dppo_plus_a_squared_log_ratio() {
    let batches = random_batches(0x9213e, 6, 0.6);
    for (low, high, tau) in [(0.2, 0.2, 1e-3), (0.05, 0.1, 0.5)] {
        let call = |b: &TokenBatch| {
            json!({"fn": "prime_rl.default_loss", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": b.weights, "mask": mask01(b),
            "mask_low": low, "mask_high": high, "kl_tau": tau, "adv_tau": 1.0}})
        };
        let Some(want) = peer_values(&batches, &call) else { return };
        let dppo = DppoConfig::tv().with_deltas(low, high).with_max_weight(f64::INFINITY);
        let kl = KlConfig::k2().with_coef(2.0 * tau);
        for (b, (_, g)) in batches.iter().zip(want) {
            let got = value_and_grad(b, 0.0, &|lp, mu, adv, m| {
                dppo_loss(lp, mu, adv, m, &dppo).unwrap() + kl_penalty(lp, mu, m, &kl).unwrap()
            });
            assert_close(&got.1, &g, 1e-12, &format!("δ = ({low}, {high}), τ = {tau} grad"));
        }
    }
}

/// SkyRL's CISPO, anchored on the old or the rollout log-probs, is `cispo_loss` with those
/// log-probs as `logp_mu` and the clip `(1, 4)` (its defaults; `1 − 1 = 0` bounds nothing).
#[test]
fn skyrls_cispo_is_cispo_on_its_anchor() {
    let batches = random_batches(0xc1590, 6, 1.8);
    let call = |b: &TokenBatch| {
        json!({"fn": "skyrl.cispo", "args": {"logp": b.logp, "logp_anchor": b.other, "advantages": b.weights, "mask": mask01(b),
        "eps_low": 1.0, "eps_high": 4.0}})
    };
    let Some(want) = peer_values(&batches, &call) else { return };
    let cfg = PpoConfig::cispo().with_clip(1.0, 4.0);
    for (b, (v, g)) in batches.iter().zip(want) {
        let got = value_and_grad(b, 0.0, &|lp, anchor, adv, m| cispo_loss(lp, anchor, adv, m, &cfg).unwrap());
        assert_close(&[got.0], &[v], 1e-12, "value");
        assert_close(&got.1, &g, 1e-12, "grad");
    }
}
