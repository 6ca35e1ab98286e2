//! KL estimators against their formulas, finite differences and extremes.

mod common;

use common::*;
use proptest::prelude::*;
use tch::{Kind, Tensor};
use topr_loss::{AggregationMode, KlConfig, KlEstimator, LossError, Normalizer, kl_penalty, kl_penalty_output};

fn k(d: f64, e: KlEstimator) -> (f64, f64) {
    match e {
        KlEstimator::K1 => (d, 1.0),
        KlEstimator::K2 => (d * d / 2.0, d),
        KlEstimator::K3 => ((-d).exp() + d - 1.0, 1.0 - (-d).exp()),
        _ => unreachable!("an estimator without a reference: {e:?}"),
    }
}

const ESTIMATORS: [KlEstimator; 3] = [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3];

proptest! {
    #[test]
    fn matches_formula_token_mean(rows in (1usize..5, 1usize..6).prop_flat_map(|(b, t)| prop::collection::vec(prop::collection::vec((-3.0f64..-0.1, -1.0f64..1.0, prop::bool::weighted(0.8)), t), b)), coef in 0.0f64..2.0) {
        let mut rows = rows;
        rows[0][0].2 = true;
        let lp: Vec<Vec<f64>> = rows.iter().map(|r| r.iter().map(|x| x.0).collect()).collect();
        let lr: Vec<Vec<f64>> = rows.iter().map(|r| r.iter().map(|x| x.0 - x.1).collect()).collect();
        let m: Vec<Tensor> = rows.iter().map(|r| Tensor::from_slice(&r.iter().map(|x| x.2).collect::<Vec<_>>())).collect();
        let mask = Tensor::stack(&m, 0);
        let n = rows.iter().flatten().filter(|x| x.2).count() as f64;
        for e in ESTIMATORS {
            let cfg = KlConfig::default().with_estimator(e).with_coef(coef);
            let p = leaf(&t2(&lp));
            let loss = kl_penalty(&p, &t2(&lr), &mask, &cfg).unwrap();
            loss.backward();
            let (mut v, mut g) = (0.0, vec![]);
            for r in &rows {
                for x in r {
                    let (kv, kg) = k(x.1, e);
                    if x.2 { v += coef * kv / n; g.push(coef * kg / n) } else { g.push(0.0) }
                }
            }
            assert_close(&[scalar(&loss)], &[v], 1e-10, &format!("{e:?} value"));
            assert_close(&vec1(&p.grad()), &g, 1e-10, &format!("{e:?} grad"));
            // The output: the same loss, per-token terms coef·k (0 on padding), the mean estimate.
            let out = kl_penalty_output(&t2(&lp), &t2(&lr), &mask, &cfg, &Normalizer::local()).unwrap();
            assert_close(&[scalar(&out.loss)], &[v], 1e-10, &format!("{e:?} output value"));
            let terms: Vec<f64> = rows.iter().flatten().map(|x| if x.2 { coef * k(x.1, e).0 } else { 0.0 }).collect();
            assert_close(&vec1(&out.terms), &terms, 1e-10, &format!("{e:?} terms"));
            let d = out.diagnostics.read().unwrap();
            prop_assert_eq!(d.tokens, n as i64);
            let mean = rows.iter().flatten().filter(|x| x.2).map(|x| k(x.1, e).0).sum::<f64>() / n;
            assert_close(&[d.kl_mean], &[mean], 1e-10, &format!("{e:?} kl_mean"));
        }
    }
}

#[test]
fn k3_is_non_negative_and_finite_at_extremes() {
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16] {
        for e in ESTIMATORS {
            let p = Tensor::from_slice2(&[[-1.0e4f64, 0.0, -3.0]]).to_kind(kind).set_requires_grad(true);
            let r = Tensor::from_slice2(&[[0.0f64, -1.0e4, -3.0]]).to_kind(kind);
            let m = Tensor::from_slice2(&[[1i64, 1, 1]]);
            let loss = kl_penalty(&p, &r, &m, &KlConfig::default().with_estimator(e).with_coef(1.0)).unwrap();
            assert!(scalar(&loss).is_finite(), "{e:?} {kind:?}");
            if e == KlEstimator::K3 {
                assert!(scalar(&loss) >= 0.0);
            }
            loss.backward();
            assert!(vec1(&p.grad()).iter().all(|g| g.is_finite()));
        }
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let lp = [-0.3, -1.7, -2.2, -0.9];
    let lr = [-0.5, -1.2, -2.9, -0.1];
    let m = Tensor::from_slice2(&[[true, true], [true, false]]);
    for e in ESTIMATORS {
        for aggregation in [AggregationMode::TokenMean, AggregationMode::SeqMeanTokenMean] {
            let cfg = KlConfig::default().with_estimator(e).with_coef(0.7).with_aggregation(aggregation);
            let f =
                |x: &[f64]| scalar(&kl_penalty(&t1(x).reshape([2, 2]), &t1(&lr).reshape([2, 2]), &m, &cfg).unwrap());
            let p = leaf(&t1(&lp).reshape([2, 2]));
            kl_penalty(&p, &t1(&lr).reshape([2, 2]), &m, &cfg).unwrap().backward();
            assert_close(&vec1(&p.grad()), &finite_difference(&lp, 1e-6, f), 1e-7, &format!("{e:?} {aggregation:?}"));
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let p = Tensor::from_slice2(&[[-1.0f64]]);
    let m = Tensor::from_slice2(&[[true]]);
    let e = kl_penalty(&p, &Tensor::from_slice2(&[[f64::NAN]]), &m, &KlConfig::default()).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp_ref", .. }), "{e}");
    let e = kl_penalty(&p, &p, &m, &KlConfig::default().with_coef(f64::NAN)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "coef", .. }), "{e}");
}
