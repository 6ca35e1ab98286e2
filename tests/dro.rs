//! The DRO policy loss against a scalar reference of its formula, finite differences (nothing is
//! stopped but μ), padding and split invariance, on-policy equality with REINFORCE, extremes and
//! half precision, and verl's own `dro` (values and gradients).

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{AggregationMode, DroConfig, LossError, PpoConfig, dro_loss, dro_loss_output, ppo_clip_loss};

type Batch = TokenBatch;

fn batch() -> impl Strategy<Value = Batch> {
    token_batch(1.5, (-2.0f64..2.0).boxed())
}

fn ref_loss(b: &Batch, cfg: &DroConfig, global: Option<(f64, f64)>) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.aggregation, global);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        for (t, _) in row.iter().enumerate().filter(|(_, m)| **m) {
            let (lp, a) = (b.logp[i][t], b.weights[i]);
            let d = lp - b.other[i][t];
            value += al[i] * -(a * lp - 0.5 * cfg.beta * d * d);
            grad[i][t] = al[i] * (-a + cfg.beta * d);
        }
    }
    (value, grad.concat())
}

fn configs() -> Vec<DroConfig> {
    vec![
        DroConfig::default(),
        DroConfig::new(1.0).with_aggregation(AggregationMode::SeqMeanTokenMean),
        DroConfig::new(0.02).with_aggregation(AggregationMode::SeqMeanTokenSum),
        DroConfig::new(3.0).with_aggregation(AggregationMode::DrGrpo { length: 9.0 }),
    ]
}

fn run(b: &Batch, cfg: &DroConfig, padding: f64) -> (f64, Vec<f64>) {
    value_and_grad(b, padding, &|lp, old, adv, m| dro_loss(lp, old, adv, m, cfg).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn dro_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in configs() {
            assert_matches_reference(&b, &run(&b, &cfg, f64::NAN), &ref_loss(&b, &cfg, None), &format!("{cfg:?}"));
        }
    }

    #[test]
    fn dro_on_policy_is_the_policy_gradient(b in batch(), beta in 0.01f64..5.0) {
        // δ = 0: the penalty and its gradient vanish, leaving REINFORCE's (PPO's on-policy) gradient.
        let on = Batch { other: b.logp.clone(), ..b.clone() };
        let mode = AggregationMode::SeqMeanTokenMean;
        let (_, g) = run(&on, &DroConfig::new(beta).with_aggregation(mode), 0.0);
        let (lp, old, adv, m) = on.tensors(0.0);
        let lp = leaf(&lp);
        ppo_clip_loss(&lp, &old, &adv, &m, &PpoConfig::ppo().with_aggregation(mode)).unwrap().backward();
        assert_close(&g, &vec1(&lp.grad()), 1e-12, "on-policy DRO vs PPO");
    }

    #[test]
    fn dro_split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        assert_split_invariant(&b, split, "DRO", &|lp, old, adv, m, mode, norm| {
            let cfg = DroConfig::new(0.7).with_aggregation(mode);
            match norm {
                Some(n) => dro_loss_output(lp, old, adv, m, &cfg, n).map(|o| o.loss),
                None => dro_loss(lp, old, adv, m, &cfg),
            }
        });
    }
}

#[test]
fn dro_gradient_matches_finite_differences() {
    let b = fixed_token_batch();
    for cfg in configs() {
        let (_, g) = run(&b, &cfg, 0.0);
        let loss = |lp: &Tensor, old: &Tensor, adv: &Tensor, m: &Tensor| dro_loss(lp, old, adv, m, &cfg).unwrap();
        assert_gradient_matches_finite_differences(&b, &g, &loss, &format!("{cfg:?}"));
    }
}

#[test]
fn extreme_and_half_precision_inputs_compute_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        let lp = Tensor::from_slice2(&[[-300.0f64, 0.0, -3.0]]).to_kind(kind).set_requires_grad(true);
        let lq = Tensor::from_slice2(&[[0.0f64, -300.0, -3.0]]).to_kind(kind);
        let m = Tensor::from_slice2(&[[1i64, 1, 1]]);
        let loss = dro_loss(&lp, &lq, &Tensor::from_slice(&[1.0f64]).to_kind(kind), &m, &DroConfig::new(0.1)).unwrap();
        let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        assert_eq!(loss.kind(), want, "{kind:?}");
        loss.backward();
        assert!(scalar(&loss).is_finite(), "{kind:?}");
        assert!(vec1(&lp.grad().to_kind(Kind::Double)).iter().all(|g| g.is_finite()), "{kind:?}");
    }
}

#[test]
fn bad_configs_are_errors_naming_beta() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let a = Tensor::from_slice(&[1.0f64]);
    for beta in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let r = dro_loss(&lp, &lp, &a, &m, &DroConfig::new(beta));
        assert!(matches!(r, Err(LossError::InvalidConfig { field: "beta", .. })), "{beta}: {r:?}");
    }
}

#[test]
fn dro_matches_verl() {
    let mut next = uniform_stream(0xd20_u64);
    let mut calls = Vec::new();
    let mut batches = Vec::new();
    let cases = [
        (0.1, "token-mean", AggregationMode::TokenMean),
        (2.0, "seq-mean-token-sum", AggregationMode::SeqMeanTokenSum),
    ];
    for k in 0..4 {
        let (b, t) = (2 + k % 3, 3 + k % 4);
        let mut logp: Vec<Vec<f64>> = (0..b).map(|_| (0..t).map(|_| -3.0 * next()).collect()).collect();
        let mut other: Vec<Vec<f64>> =
            logp.iter().map(|r| r.iter().map(|x| x - (2.0 * next() - 1.0)).collect()).collect();
        non_positive_rows(&mut logp, &mut other);
        let mut mask: Vec<Vec<bool>> = (0..b).map(|_| (0..t).map(|_| next() < 0.8).collect()).collect();
        for row in &mut mask {
            row[0] = true;
        }
        let weights: Vec<f64> = (0..b).map(|_| 4.0 * next() - 2.0).collect();
        let bt = Batch { logp, other, mask, weights };
        let adv: Vec<Vec<f64>> = bt.weights.iter().zip(&bt.mask).map(|(a, r)| vec![*a; r.len()]).collect();
        let m01: Vec<Vec<f64>> = bt.mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect();
        for (beta, agg, _) in &cases {
            calls.push(json!({"fn": "verl.dro", "args": {"logp": bt.logp, "logp_mu": bt.other, "advantages": adv, "mask": m01, "beta": beta, "loss_agg_mode": agg}}));
        }
        batches.push(bt);
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    for b in &batches {
        for (beta, agg, mode) in &cases {
            let r = results.next().unwrap();
            let (v, g) = run(b, &DroConfig::new(*beta).with_aggregation(*mode), 0.0);
            assert_close(&[v], &json_f64(&r["value"]), 1e-12, &format!("β = {beta} {agg} value"));
            assert_close(&g, &json_f64(&r["grad"]), 1e-12, &format!("β = {beta} {agg} grad"));
        }
    }
}
