//! PPO's clipped value loss against its formula, finite differences, padding, split invariance,
//! dtypes, errors and verl 0.9.1's `compute_value_loss`.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, BatchCounts, LossError, Normalizer, ValueLossConfig, aggregate, value_loss, value_loss_output,
};

/// A value batch: predictions, old values, returns and a mask.
#[derive(Debug, Clone)]
struct ValueBatch {
    v: Vec<Vec<f64>>,
    v_old: Vec<Vec<f64>>,
    ret: Vec<Vec<f64>>,
    mask: Vec<Vec<bool>>,
}

impl ValueBatch {
    fn tensors(&self, padding: f64) -> (Tensor, Tensor, Tensor, Tensor) {
        let fill = |x: &[Vec<f64>]| -> Tensor {
            t2(&x
                .iter()
                .zip(&self.mask)
                .map(|(x, m)| x.iter().zip(m).map(|(x, m)| if *m { *x } else { padding }).collect())
                .collect::<Vec<Vec<f64>>>())
        };
        let mask = Tensor::stack(&self.mask.iter().map(|r| Tensor::from_slice(r)).collect::<Vec<_>>(), 0);
        (fill(&self.v), fill(&self.v_old), fill(&self.ret), mask)
    }
}

fn value_batch() -> impl Strategy<Value = ValueBatch> {
    (1usize..5, 1usize..6).prop_flat_map(|(b, t)| {
        let rows = move || prop::collection::vec(prop::collection::vec(-2.0f64..2.0, t), b);
        (rows(), rows(), rows(), prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.8), t), b))
            .prop_map(|(v, v_old, ret, mut mask)| {
                mask[0][0] = true;
                ValueBatch { v, v_old, ret, mask }
            })
    })
}

/// `½ max((v − R)², (clip(v, v_old ± ε) − R)²)` per token, its derivative in `v`, and whether the
/// clipped error is the larger.
fn ref_token(v: f64, v_old: f64, ret: f64, eps: f64) -> (f64, f64, bool) {
    let vc = v.max(v_old - eps).min(v_old + eps);
    let (e1, e2) = ((v - ret).powi(2), (vc - ret).powi(2));
    if e2 > e1 {
        // The clipped error: its derivative in v is (vc − R) where v is inside the clip range, else 0.
        let inside = v > v_old - eps && v < v_old + eps;
        (0.5 * e2, if inside { vc - ret } else { 0.0 }, true)
    } else {
        (0.5 * e1, v - ret, false)
    }
}

/// Loss, gradient and clip fraction by loops.
fn ref_value(b: &ValueBatch, eps: f64, mode: AggregationMode, global: Option<(f64, f64)>) -> (f64, Vec<f64>, f64) {
    let alpha = ref_alpha(&b.mask, mode, global);
    let (mut loss, mut grad, mut clipped, mut n) = (0.0, vec![], 0.0, 0.0);
    for (i, a) in alpha.iter().enumerate() {
        for t in 0..b.v[i].len() {
            if b.mask[i][t] {
                let (l, g, c) = ref_token(b.v[i][t], b.v_old[i][t], b.ret[i][t], eps);
                loss += a * l;
                grad.push(a * g);
                clipped += if c { 1.0 } else { 0.0 };
                n += 1.0;
            } else {
                grad.push(0.0);
            }
        }
    }
    (loss, grad, clipped / n)
}

proptest! {
    #[test]
    fn matches_its_formula(b in value_batch(), eps in prop_oneof![Just(0.2f64), Just(0.5), Just(f64::INFINITY), 0.0f64..1.0]) {
        for mode in ALL_MODES {
            let cfg = ValueLossConfig::ppo().with_clip(eps).with_aggregation(mode);
            // NaN and inf on padding: ignored, zero gradient there.
            let (v, v_old, ret, mask) = b.tensors(f64::NAN);
            let v = leaf(&v);
            let loss = value_loss(&v, &v_old, &ret, &mask, &cfg).unwrap();
            loss.backward();
            let (want, grad, clip_fraction) = ref_value(&b, eps, mode, None);
            assert_close(&[scalar(&loss)], &[want], 1e-10, &format!("{mode:?} value"));
            assert_close(&vec1(&v.grad()), &grad, 1e-10, &format!("{mode:?} grad"));
            let out = value_loss_output(&v, &v_old, &ret, &mask, &cfg, &Normalizer::local()).unwrap();
            assert_close(&[scalar(&out.loss)], &[want], 1e-10, "output loss");
            let again = aggregate(&out.terms, &mask, mode, &Normalizer::local()).unwrap();
            assert_close(&[scalar(&again)], &[want], 1e-10, "terms reduce to the loss");
            let d = out.diagnostics.read().unwrap();
            prop_assert_eq!(d.tokens, b.mask.iter().flatten().filter(|m| **m).count() as i64);
            assert_close(&[d.clip_fraction], &[clip_fraction], 1e-12, "clip fraction");
        }
    }

    #[test]
    fn split_with_global_counts_sums_to_the_whole(b in value_batch()) {
        prop_assume!(b.v.len() >= 2 && b.mask[1].iter().any(|m| *m));
        let (v, v_old, ret, mask) = b.tensors(f64::INFINITY);
        let norm = Normalizer::from_masks(&[&mask]).unwrap();
        for mode in ALL_MODES {
            let cfg = ValueLossConfig::verl().with_aggregation(mode);
            let whole = scalar(&value_loss_output(&v, &v_old, &ret, &mask, &cfg, &norm).unwrap().loss);
            let part = |s: i64, n: i64| scalar(&value_loss_output(&v.narrow(0, s, n), &v_old.narrow(0, s, n), &ret.narrow(0, s, n), &mask.narrow(0, s, n), &cfg, &norm).unwrap().loss);
            let rows = b.v.len() as i64;
            assert_close(&[part(0, 1) + part(1, rows - 1)], &[whole], 1e-10, &format!("{mode:?}"));
        }
    }

    #[test]
    fn no_clip_is_half_the_squared_error_and_never_negative(b in value_batch()) {
        let (v, v_old, ret, mask) = b.tensors(0.0);
        let clipped = scalar(&value_loss(&v, &v_old, &ret, &mask, &ValueLossConfig::ppo()).unwrap());
        let plain = scalar(&value_loss(&v, &v_old, &ret, &mask, &ValueLossConfig::ppo().with_clip(f64::INFINITY)).unwrap());
        let (want, _, _) = ref_value(&b, f64::INFINITY, AggregationMode::TokenMean, None);
        assert_close(&[plain], &[want], 1e-10, "no clip");
        // The clip only ever raises the loss (max of the two errors), and both are >= 0.
        prop_assert!(clipped >= plain - 1e-12 && plain >= 0.0);
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let v = [0.3, -0.8, 1.4, 0.05, 0.7, -0.2];
    let v_old = t1(&[0.0, -0.5, 1.0, 0.5, 0.1, -0.9]).reshape([2, 3]);
    let ret = t1(&[1.0, -1.7, 0.2, 0.4, 0.6, 0.3]).reshape([2, 3]);
    let mask = Tensor::from_slice2(&[[true, true, true], [true, false, true]]);
    for mode in [AggregationMode::TokenMean, AggregationMode::SeqMeanTokenMean] {
        let cfg = ValueLossConfig::ppo().with_aggregation(mode);
        let f = |x: &[f64]| scalar(&value_loss(&t1(x).reshape([2, 3]), &v_old, &ret, &mask, &cfg).unwrap());
        let p = leaf(&t1(&v).reshape([2, 3]));
        value_loss(&p, &v_old, &ret, &mask, &cfg).unwrap().backward();
        assert_close(&vec1(&p.grad()), &finite_difference(&v, 1e-6, f), 1e-7, &format!("{mode:?}"));
    }
}

#[test]
fn dtypes_and_extremes() {
    let v = Tensor::from_slice2(&[[0.5f64, -1.0]]);
    let mask = Tensor::from_slice2(&[[1i64, 1]]);
    for kind in [Kind::Half, Kind::BFloat16, Kind::Float, Kind::Double] {
        let vk = v.to_kind(kind).set_requires_grad(true);
        let out = value_loss_output(
            &vk,
            &v.zeros_like().to_kind(kind),
            &v.ones_like().to_kind(kind),
            &mask,
            &ValueLossConfig::ppo(),
            &Normalizer::local(),
        )
        .unwrap();
        assert_eq!(out.loss.kind(), if kind == Kind::Double { Kind::Double } else { Kind::Float }, "{kind:?}");
        out.loss.backward();
        assert_eq!(vk.grad().kind(), kind);
    }
    // Squared errors beyond f32: a typed error; large but representable ones: finite.
    let huge = Tensor::from_slice2(&[[1e20f32, -1e20]]);
    let e = value_loss(&huge, &huge, &huge.zeros_like(), &mask, &ValueLossConfig::ppo()).unwrap_err();
    assert_eq!(e, LossError::NonFiniteLoss { compute_dtype: "f32" });
    let big = Tensor::from_slice2(&[[1e15f32, -1e15]]).set_requires_grad(true);
    let loss = value_loss(&big, &big.detach(), &big.zeros_like(), &mask, &ValueLossConfig::ppo()).unwrap();
    loss.backward();
    assert!(scalar(&loss).is_finite() && vec1(&big.grad()).iter().all(|g| g.is_finite()));
}

#[test]
fn bad_inputs_are_errors() {
    let v = Tensor::from_slice2(&[[0.5f64, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let cfg = ValueLossConfig::ppo();
    let e = value_loss(&v, &v, &v, &m, &cfg.with_clip(-0.1)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "clip", .. }), "{e}");
    let e = value_loss(&v, &t1(&[1.0]), &v, &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "values_old", .. }), "{e}");
    let e = value_loss(&v, &v, &Tensor::from_slice2(&[[f64::NAN, 0.0]]), &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "returns", .. }), "{e}");
    let e = value_loss(&Tensor::from_slice2(&[[1i64, 0]]), &v, &v, &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "values", .. }), "{e}");
    let e = value_loss(&v, &v, &v, &Tensor::from_slice2(&[[false, false]]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "mask", .. }), "{e}");
    let bad = Normalizer::global(BatchCounts { tokens: -1.0, sequences: 1.0 });
    let e = value_loss_output(&v, &v, &v, &m, &cfg, &bad).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "Normalizer::tokens", .. }), "{e}");
}

#[test]
fn matches_verl_compute_value_loss() {
    let v = vec![vec![0.3, -0.8, 1.4, 0.05], vec![0.7, -0.2, 0.9, 2.0], vec![-1.2, 0.4, 0.0, 0.6]];
    let v_old = vec![vec![0.0, -0.5, 1.0, 0.5], vec![0.1, -0.9, 0.8, 0.0], vec![-0.3, 0.45, 0.2, 0.1]];
    let ret = vec![vec![1.0, -1.7, 0.2, 0.4], vec![0.6, 0.3, 1.5, -1.0], vec![-2.0, 0.5, 0.1, 0.9]];
    let mask = vec![vec![1.0, 1.0, 1.0, 0.0], vec![1.0, 1.0, 1.0, 1.0], vec![1.0, 1.0, 0.0, 0.0]];
    let modes = [
        ("token-mean", AggregationMode::TokenMean),
        ("seq-mean-token-mean", AggregationMode::SeqMeanTokenMean),
        ("seq-mean-token-sum", AggregationMode::SeqMeanTokenSum),
    ];
    let clips = [0.2, 0.5, 1e9];
    let mut calls = vec![];
    for clip in clips {
        for (name, _) in modes {
            calls.push(json!({"fn": "verl.value_loss", "args": {"values": v, "values_old": v_old, "returns": ret, "mask": mask, "clip": clip, "agg": name}}));
        }
    }
    let Some(res) = peer(&calls) else { return };
    let m = Tensor::stack(&mask.iter().map(|r| Tensor::from_slice(r)).collect::<Vec<_>>(), 0);
    let mut i = 0;
    for clip in clips {
        for (name, mode) in modes {
            let p = leaf(&t2(&v));
            let cfg = ValueLossConfig::ppo().with_clip(clip).with_aggregation(mode);
            let out = value_loss_output(&p, &t2(&v_old), &t2(&ret), &m, &cfg, &Normalizer::local()).unwrap();
            out.loss.backward();
            // verl's seq-mean-token-mean divides each sequence's sum by L_i + 1e-8.
            let tol = if mode == AggregationMode::SeqMeanTokenMean { 1e-8 } else { 1e-12 };
            assert_close(
                &[scalar(&out.loss)],
                &[res[i]["value"].as_f64().unwrap()],
                tol,
                &format!("{name} {clip} value"),
            );
            assert_close(&vec1(&p.grad()), &json_f64(&res[i]["grad"]), tol, &format!("{name} {clip} grad"));
            // verl's masked mean divides by N + 1e-8.
            let d = out.diagnostics.read().unwrap();
            assert_close(&[d.clip_fraction], &[res[i]["clip_fraction"].as_f64().unwrap()], 1e-8, "clip fraction");
            i += 1;
        }
    }
}
