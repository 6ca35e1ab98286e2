//! SAPO against a scalar reference of the paper's gate, finite differences, padding and split
//! invariance, extremes, and the peers' values (verl's own function, TRL's lines restated).

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, BatchCounts, LossError, Normalizer, PpoConfig, SapoConfig, ppo_clip_loss, sapo_loss,
    sapo_loss_output,
};

type Batch = TokenBatch;

fn batch() -> impl Strategy<Value = Batch> {
    token_batch(1.5, (-2.0f64..2.0).boxed())
}

/// SAPO's value and d/dlogp for one token, from the paper's gate `σ(τ(r − 1)) · 4/τ`.
fn ref_sapo_token(delta: f64, a: f64, cfg: &SapoConfig) -> (f64, f64) {
    let clamped = delta.clamp(-cfg.max_log_ratio, cfg.max_log_ratio);
    let r = clamped.exp();
    let tau = if a > 0.0 { cfg.tau_pos } else { cfg.tau_neg };
    let s = 1.0 / (1.0 + (-tau * (r - 1.0)).exp());
    let value = -s * 4.0 / tau * a;
    let slope = if delta.abs() > cfg.max_log_ratio { 0.0 } else { 4.0 * s * (1.0 - s) * r };
    (value, -slope * a)
}

fn ref_loss(b: &Batch, cfg: &SapoConfig, global: Option<(f64, f64)>) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.aggregation, global);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        for (t, _) in row.iter().enumerate().filter(|(_, m)| **m) {
            let (v, g) = ref_sapo_token(b.logp[i][t] - b.other[i][t], b.weights[i], cfg);
            value += al[i] * v;
            grad[i][t] = al[i] * g;
        }
    }
    (value, grad.concat())
}

fn configs() -> Vec<SapoConfig> {
    vec![
        SapoConfig::sapo(),
        SapoConfig::sapo().with_temperatures(2.0, 4.0).with_aggregation(AggregationMode::TokenMean),
        SapoConfig::sapo().with_temperatures(0.5, 0.5).with_aggregation(AggregationMode::SeqMeanTokenSum),
        SapoConfig::sapo().with_max_log_ratio(0.5).with_aggregation(AggregationMode::DrGrpo { length: 9.0 }),
    ]
}

fn run(b: &Batch, cfg: &SapoConfig, padding: f64) -> (f64, Vec<f64>) {
    let (lp, old, adv, m) = b.tensors(padding);
    let lp = leaf(&lp);
    let loss = sapo_loss(&lp, &old, &adv, &m, cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&lp.grad()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn sapo_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in configs() {
            let (v, g) = run(&b, &cfg, f64::NAN);
            let (rv, rg) = ref_loss(&b, &cfg, None);
            assert_close(&[v], &[rv], 1e-10, &format!("{cfg:?} value"));
            assert_close(&g, &rg, 1e-10, &format!("{cfg:?} grad"));
            for (k, m) in b.mask.concat().iter().enumerate() {
                if !m { prop_assert!(g[k] == 0.0, "padding gradient {} (exactly zero, either sign)", g[k]); }
            }
        }
    }

    #[test]
    fn sapo_pushes_every_token_along_its_advantage(b in batch()) {
        // The gate is increasing in r: the loss never decreases log π against the advantage's sign.
        let (_, g) = run(&b, &SapoConfig::sapo(), 0.0);
        for (i, row) in b.mask.iter().enumerate() {
            for (t, m) in row.iter().enumerate() {
                if *m { prop_assert!(g[i * row.len() + t] * b.weights[i] <= 0.0); }
            }
        }
    }

    #[test]
    fn sapo_on_policy_is_the_policy_gradient(b in batch(), tau_pos in 0.1f64..5.0, tau_neg in 0.1f64..5.0) {
        // r = 1: the gate's slope is 1 whatever τ, so SAPO's gradient is PPO's on-policy one.
        let on = Batch { other: b.logp.clone(), ..b.clone() };
        let mode = AggregationMode::SeqMeanTokenMean;
        let (_, g) = run(&on, &SapoConfig::sapo().with_temperatures(tau_pos, tau_neg), 0.0);
        let (lp, old, adv, m) = on.tensors(0.0);
        let lp = leaf(&lp);
        ppo_clip_loss(&lp, &old, &adv, &m, &PpoConfig::ppo().with_aggregation(mode)).unwrap().backward();
        assert_close(&g, &vec1(&lp.grad()), 1e-12, "on-policy SAPO vs PPO");
    }

    #[test]
    fn sapo_split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        assert_split_invariant(&b, split, "SAPO", &|lp, old, adv, m, mode, norm| {
            let cfg = SapoConfig::sapo().with_aggregation(mode);
            match norm {
                Some(n) => sapo_loss_output(lp, old, adv, m, &cfg, n).map(|o| o.loss),
                None => sapo_loss(lp, old, adv, m, &cfg),
            }
        });
    }
}

#[test]
fn sapo_gradient_matches_finite_differences() {
    let b = fixed_token_batch();
    for cfg in configs() {
        let (_, g) = run(&b, &cfg, 0.0);
        let loss = |lp: &Tensor, old: &Tensor, adv: &Tensor, m: &Tensor| sapo_loss(lp, old, adv, m, &cfg).unwrap();
        assert_gradient_matches_finite_differences(&b, &g, &loss, &format!("{cfg:?}"));
    }
}

#[test]
fn sapo_output_terms_and_diagnostics() {
    let b = fixed_token_batch();
    let (lp, old, adv, m) = b.tensors(f64::NAN);
    let cfg = SapoConfig::sapo();
    let out = sapo_loss_output(&lp, &old, &adv, &m, &cfg, &Normalizer::local()).unwrap();
    let again = topr_loss::aggregate(&out.terms, &m, cfg.aggregation, &Normalizer::local()).unwrap();
    assert_close(&[scalar(&again)], &[scalar(&out.loss)], 1e-12, "terms re-aggregated");
    let d = out.diagnostics.read().unwrap();
    assert_eq!((d.samples, d.clip_fraction, d.dual_clip_fraction), (6, 0.0, 0.0));
    let deltas: Vec<f64> = (0..3)
        .flat_map(|i| (0..3).map(move |t| (i, t)))
        .filter(|&(i, t)| b.mask[i][t])
        .map(|(i, t)| b.logp[i][t] - b.other[i][t])
        .collect();
    let max = deltas.iter().cloned().fold(f64::MIN, f64::max).exp();
    assert_close(&[d.ratio_max], &[max], 1e-12, "ratio_max");
    assert_close(&[d.log_ratio_mean], &[deltas.iter().sum::<f64>() / 6.0], 1e-12, "log_ratio_mean");
}

#[test]
fn sapo_extreme_inputs_stay_finite_and_low_precision_computes_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half] {
        let logp = Tensor::from_slice2(&[[-1.0e4f64, 0.0], [0.0, -1.0e4]]).to_kind(kind).set_requires_grad(true);
        let old = Tensor::from_slice2(&[[0.0f64, -1.0e4], [-1.0e4, 0.0]]).to_kind(kind);
        let adv = Tensor::from_slice(&[1.0f64, -1.0]).to_kind(kind);
        let m = Tensor::from_slice2(&[[1i64, 1], [1, 1]]);
        let loss = sapo_loss(&logp, &old, &adv, &m, &SapoConfig::sapo()).unwrap();
        let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        assert_eq!(loss.kind(), want, "{kind:?}");
        assert!(scalar(&loss).is_finite(), "{kind:?}");
        loss.backward();
        assert!(vec1(&logp.grad()).iter().all(|g| g.is_finite()), "{kind:?}");
    }
    // Huge advantages: finite in f64, a typed error where f32 overflows.
    let lp = Tensor::from_slice2(&[[-1.0f32, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let e = sapo_loss(
        &lp,
        &(&lp - 30.0),
        &Tensor::from_slice(&[3.0e38f32]),
        &m,
        &SapoConfig::sapo().with_aggregation(AggregationMode::TokenSum),
    )
    .unwrap_err();
    assert_eq!(e, LossError::NonFiniteLoss { compute_dtype: "f32" });
}

#[test]
fn sapo_bad_inputs_are_errors() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let adv = t1(&[1.0]);
    let cfg = SapoConfig::sapo();
    let e = sapo_loss(&lp, &Tensor::from_slice(&[-1.0f64, -1.0]), &adv, &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_mu", .. }), "{e}");
    let e = sapo_loss(&lp, &lp, &t1(&[1.0, 2.0]), &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "advantages", .. }), "{e}");
    let e = sapo_loss(&lp, &lp, &t1(&[f64::NAN]), &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "advantages", .. }), "{e}");
    let e = sapo_loss(&lp, &lp, &adv, &m, &cfg.with_temperatures(-1.0, 1.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "tau_pos", .. }), "{e}");
    let e = sapo_loss(&lp, &lp, &adv, &m, &cfg.with_temperatures(1.0, f64::INFINITY)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "tau_neg", .. }), "{e}");
    let e = sapo_loss(&lp, &lp, &adv, &m, &cfg.with_max_log_ratio(0.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "max_log_ratio", .. }), "{e}");
    let e = sapo_loss(&lp, &lp, &adv, &Tensor::from_slice2(&[[false, false]]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "mask", .. }), "{e}");
}

/// Deterministic batches for the peer comparisons (no proptest shrinking across a Python call).
pub fn peer_batches() -> Vec<Batch> {
    let mut seed = 0x2545F4914F6CDD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..8)
        .map(|k| {
            let (b, t) = (2 + k % 4, 3 + k % 5);
            let mut logp: Vec<Vec<f64>> = (0..b).map(|_| (0..t).map(|_| -4.0 * next() - 0.01).collect()).collect();
            let mut other: Vec<Vec<f64>> =
                logp.iter().map(|r| r.iter().map(|x| x - (2.0 * next() - 1.0) * 1.2).collect()).collect();
            non_positive_rows(&mut logp, &mut other);
            let mut mask: Vec<Vec<bool>> = (0..b).map(|_| (0..t).map(|_| next() < 0.8).collect()).collect();
            for row in &mut mask {
                row[0] = true; // every row has a token: verl and TRL average over all rows
            }
            let mut weights: Vec<f64> = (0..b).map(|_| 4.0 * next() - 2.0).collect();
            weights[0] = 0.0; // A = 0 takes τ_neg in both peers
            Batch { logp, other, mask, weights }
        })
        .collect()
}

fn mask01(mask: &[Vec<bool>]) -> Vec<Vec<f64>> {
    mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect()
}

fn per_token(b: &Batch) -> Vec<Vec<f64>> {
    b.weights.iter().zip(&b.mask).map(|(a, r)| vec![*a; r.len()]).collect()
}

#[test]
fn sapo_matches_verl_and_trl() {
    let batches = peer_batches();
    // verl's temperatures are taken in the advantages' dtype (f64); TRL's `torch.where` with Python
    // floats makes them f32, so TRL is compared at temperatures exact in f32.
    let verl_taus = [(1.0, 1.05), (2.0, 3.7)];
    let trl_taus = [(1.0, 1.25), (0.5, 2.0)];
    let mut calls = Vec::new();
    for b in &batches {
        for (p, n) in verl_taus {
            calls.push(json!({"fn": "verl.sapo", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": per_token(b), "mask": mask01(&b.mask), "tau_pos": p, "tau_neg": n}}));
        }
        for (p, n) in trl_taus {
            calls.push(json!({"fn": "trl.sapo", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": b.weights, "mask": mask01(&b.mask), "tau_pos": p, "tau_neg": n}}));
        }
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    for b in &batches {
        for (p, n) in verl_taus.into_iter().chain(trl_taus) {
            let r = results.next().unwrap();
            let (v, g) = run(b, &SapoConfig::sapo().with_temperatures(p, n), 0.0);
            // verl's seq-mean-token-mean divides by L_i + 1e-8: about 1e-8 relative.
            let tol = if verl_taus.contains(&(p, n)) { 1e-7 } else { 1e-10 };
            assert_close(&[v], &json_f64(&r["value"]), tol, &format!("τ = {p}, {n} value"));
            assert_close(&g, &json_f64(&r["grad"]), tol, &format!("τ = {p}, {n} grad"));
        }
    }
}

#[test]
fn sapo_with_an_empty_row_matches_trl_with_the_row_count_as_normaliser() {
    // TRL averages over every row, an empty one included: the normaliser's sequence count does it.
    let mut b = peer_batches()[1].clone();
    b.mask.push(vec![false; b.mask[0].len()]);
    b.logp.push(vec![-1.0; b.mask[0].len()]);
    b.other.push(vec![-1.0; b.mask[0].len()]);
    b.weights.push(0.7);
    let call = json!({"fn": "trl.sapo", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": b.weights, "mask": mask01(&b.mask), "tau_pos": 1.0, "tau_neg": 1.25}});
    let Some(r) = peer(&[call]) else { return };
    let (lp, old, adv, m) = b.tensors(0.0);
    let lp = leaf(&lp);
    let rows = b.mask.len() as f64;
    let norm = Normalizer::global(BatchCounts { tokens: 1.0, sequences: rows });
    let cfg = SapoConfig::sapo().with_temperatures(1.0, 1.25);
    let loss = sapo_loss_output(&lp, &old, &adv, &m, &cfg, &norm).unwrap().loss;
    loss.backward();
    assert_close(&[scalar(&loss)], &json_f64(&r[0]["value"]), 1e-10, "value");
    assert_close(&vec1(&lp.grad()), &json_f64(&r[0]["grad"]), 1e-10, "grad");
}
