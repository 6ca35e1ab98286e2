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
        let mut lp: Vec<Vec<f64>> = rows.iter().map(|r| r.iter().map(|x| x.0).collect()).collect();
        let mut lr: Vec<Vec<f64>> = rows.iter().map(|r| r.iter().map(|x| x.0 - x.1).collect()).collect();
        non_positive_rows(&mut lp, &mut lr);
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

// ---- abs, the value clamp, straight-through and the importance-corrected KL ----

use serde_json::json;
use topr_loss::{kl_penalty_corrected, kl_penalty_corrected_output};

/// The estimate and its derivative in `d` with the value clamp `C` and the straight-through form.
fn k_full(d: f64, e: KlEstimator, clamp: Option<f64>, straight_through: bool) -> (f64, f64) {
    let (mut v, mut g) = match e {
        KlEstimator::Abs => (
            d.abs(),
            if d > 0.0 {
                1.0
            } else if d < 0.0 {
                -1.0
            } else {
                0.0
            },
        ),
        other => k(d, other),
    };
    if let Some(c) = clamp {
        if v > c || v < -c {
            v = v.clamp(-c, c);
            g = 0.0;
        }
    }
    if straight_through && e != KlEstimator::K2 {
        g = d; // the gradient of d²/2
    }
    (v, g)
}

const ALL_ESTIMATORS: [KlEstimator; 4] = [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3, KlEstimator::Abs];

proptest! {
    #[test]
    fn variants_match_their_formulas(b in token_batch(2.5, Just(0.0).boxed()), coef in 0.0f64..2.0, clamp in prop_oneof![Just(None), Just(Some(0.3f64)), Just(Some(10.0))]) {
        let n = b.mask.iter().flatten().filter(|m| **m).count() as f64;
        for e in ALL_ESTIMATORS {
            for st in [false, true] {
                let cfg = KlConfig::default().with_estimator(e).with_coef(coef).with_max_estimate(clamp).with_straight_through(st);
                let (lp, lr, _, mask) = b.tensors(f64::NAN);
                let p = leaf(&lp);
                let loss = kl_penalty(&p, &lr, &mask, &cfg).unwrap();
                loss.backward();
                let (mut v, mut g) = (0.0, vec![]);
                for i in 0..b.logp.len() {
                    for t in 0..b.logp[i].len() {
                        if b.mask[i][t] {
                            let (kv, kg) = k_full(b.logp[i][t] - b.other[i][t], e, clamp, st);
                            v += coef * kv / n;
                            g.push(coef * kg / n);
                        } else {
                            g.push(0.0);
                        }
                    }
                }
                assert_close(&[scalar(&loss)], &[v], 1e-10, &format!("{e:?} {clamp:?} {st} value"));
                assert_close(&vec1(&p.grad()), &g, 1e-10, &format!("{e:?} {clamp:?} {st} grad"));
            }
        }
    }

    #[test]
    fn corrected_matches_its_formula(b in token_batch(2.0, Just(0.0).boxed()), shift in prop::collection::vec(-1.5f64..1.5, 30), mode in prop::sample::select(ALL_MODES.to_vec())) {
        // log μ = log π − s: the weight is e^{s}; π, π_ref and μ shifted together to stay ≤ 0.
        let mut b = b;
        let mut mu: Vec<Vec<f64>> = b.logp.iter().enumerate().map(|(i, r)| r.iter().enumerate().map(|(t, x)| x - shift[(i * 6 + t) % 30]).collect()).collect();
        for ((l, o), m) in b.logp.iter_mut().flatten().zip(b.other.iter_mut().flatten()).zip(mu.iter_mut().flatten()) {
            [*l, *o, *m] = non_positive([*l, *o, *m]);
        }
        let (lp, lr, _, mask) = b.tensors(f64::NAN);
        let mu_t = t2(&mu.iter().zip(&b.mask).map(|(r, m)| r.iter().zip(m).map(|(x, m)| if *m { *x } else { f64::INFINITY }).collect()).collect::<Vec<Vec<f64>>>());
        let alpha = ref_alpha(&b.mask, mode, None);
        for e in ALL_ESTIMATORS {
            let cfg = KlConfig::default().with_estimator(e).with_coef(0.7).with_aggregation(mode);
            let p = leaf(&lp);
            let out = kl_penalty_corrected_output(&p, &mu_t, &lr, &mask, &cfg, &Normalizer::local()).unwrap();
            out.loss.backward();
            let (mut v, mut g, mut terms) = (0.0, vec![], vec![]);
            for i in 0..b.logp.len() {
                for (t, mu_t) in mu[i].iter().enumerate() {
                    if b.mask[i][t] {
                        let (kv, kg) = k_full(b.logp[i][t] - b.other[i][t], e, None, false);
                        let w = (b.logp[i][t] - mu_t).exp();
                        v += alpha[i] * 0.7 * w * kv;
                        // ∇(w k) = w k + w k' in log π.
                        g.push(alpha[i] * 0.7 * w * (kv + kg));
                        terms.push(0.7 * w * kv);
                    } else {
                        g.push(0.0);
                        terms.push(0.0);
                    }
                }
            }
            assert_close(&[scalar(&out.loss)], &[v], 1e-10, &format!("{e:?} value"));
            assert_close(&vec1(&p.grad()), &g, 1e-10, &format!("{e:?} grad"));
            assert_close(&vec1(&out.terms), &terms, 1e-10, &format!("{e:?} terms"));
            let plain = kl_penalty_corrected(&lp, &mu_t, &lr, &mask, &cfg).unwrap();
            assert_close(&[scalar(&plain)], &[v], 1e-10, "plain call");
        }
        // On-policy: the value of the plain penalty.
        let on = kl_penalty_corrected(&lp, &lp, &lr, &mask, &KlConfig::k3()).unwrap();
        let plain = kl_penalty(&lp, &lr, &mask, &KlConfig::k3()).unwrap();
        assert_close(&[scalar(&on)], &[scalar(&plain)], 1e-12, "on-policy");
    }
}

#[test]
fn corrected_and_abs_gradients_match_finite_differences() {
    let lp = [-0.3, -1.7, -2.2, -0.9];
    let lr = t1(&[-0.5, -1.2, -2.9, -0.1]).reshape([2, 2]);
    let mu = t1(&[-0.1, -2.0, -2.0, -1.3]).reshape([2, 2]);
    let m = Tensor::from_slice2(&[[true, true], [true, false]]);
    for e in ALL_ESTIMATORS {
        for aggregation in [AggregationMode::TokenMean, AggregationMode::SeqMeanTokenMean] {
            let cfg = KlConfig::default().with_estimator(e).with_coef(0.7).with_aggregation(aggregation);
            let f = |x: &[f64]| scalar(&kl_penalty_corrected(&t1(x).reshape([2, 2]), &mu, &lr, &m, &cfg).unwrap());
            let p = leaf(&t1(&lp).reshape([2, 2]));
            kl_penalty_corrected(&p, &mu, &lr, &m, &cfg).unwrap().backward();
            assert_close(&vec1(&p.grad()), &finite_difference(&lp, 1e-6, f), 1e-7, &format!("corrected {e:?}"));
            // The clamp of the estimate (active on the third token for K3 at 0.3).
            let cfg = cfg.with_max_estimate(Some(0.3));
            let f = |x: &[f64]| scalar(&kl_penalty(&t1(x).reshape([2, 2]), &lr, &m, &cfg).unwrap());
            let p = leaf(&t1(&lp).reshape([2, 2]));
            kl_penalty(&p, &lr, &m, &cfg).unwrap().backward();
            assert_close(&vec1(&p.grad()), &finite_difference(&lp, 1e-6, f), 1e-7, &format!("clamped {e:?}"));
        }
    }
}

#[test]
fn variants_are_finite_at_extremes_and_in_every_dtype() {
    for kind in [Kind::Half, Kind::BFloat16, Kind::Float, Kind::Double] {
        for e in ALL_ESTIMATORS {
            for st in [false, true] {
                let cfg = KlConfig::default()
                    .with_estimator(e)
                    .with_coef(1.0)
                    .with_straight_through(st)
                    .with_max_estimate(Some(10.0));
                // log-ratios to the reference −1e4, 1e4, 0 and to μ −2e4, 1e4, −3, every log-prob ≤ 0
                let p = Tensor::from_slice2(&[[-2.0e4f64, 0.0, -3.0]]).to_kind(kind).set_requires_grad(true);
                let r = Tensor::from_slice2(&[[-1.0e4f64, -1.0e4, -3.0]]).to_kind(kind);
                let mu = Tensor::from_slice2(&[[0.0f64, -1.0e4, 0.0]]).to_kind(kind);
                let m = Tensor::from_slice2(&[[1i64, 1, 1]]);
                let loss = kl_penalty_corrected(&p, &mu, &r, &m, &cfg).unwrap();
                let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
                assert_eq!(loss.kind(), want, "{e:?} {kind:?}");
                assert!(scalar(&loss).is_finite(), "{e:?} {kind:?}");
                loss.backward();
                assert!(vec1(&p.grad()).iter().all(|g| g.is_finite()), "{e:?} {kind:?}");
                assert!(scalar(&kl_penalty(&p, &r, &m, &cfg).unwrap()).is_finite());
            }
        }
    }
}

#[test]
fn variant_errors_name_the_field_or_argument() {
    let p = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    for c in [0.0, -1.0, f64::NAN] {
        let e = kl_penalty(&p, &p, &m, &KlConfig::k3().with_max_estimate(Some(c))).unwrap_err();
        assert!(matches!(e, LossError::InvalidConfig { field: "max_estimate", .. }), "{e}");
    }
    let e = kl_penalty_corrected(&p, &Tensor::from_slice2(&[[0.0f64, f64::NAN]]), &p, &m, &KlConfig::k3()).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp_mu", .. }), "{e}");
    let e = kl_penalty_corrected(&p, &p, &t1(&[1.0, 2.0]), &m, &KlConfig::k3()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_ref", .. }), "{e}");
    let e = kl_penalty_corrected(&p, &t1(&[1.0, 2.0]), &p, &m, &KlConfig::k3()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_mu", .. }), "{e}");
    // NaN on padding of logp_mu is fine.
    let pad = Tensor::from_slice2(&[[true, false]]);
    assert!(kl_penalty_corrected(&p, &Tensor::from_slice2(&[[0.0f64, f64::NAN]]), &p, &pad, &KlConfig::k3()).is_ok());
}

#[test]
fn variants_match_verl_and_trl() {
    // d spans both signs and, at −3.5 and +3.0, K3 values above 10 (verl clamps them); every
    // log-prob is at most 0.
    let logp = vec![vec![-0.3, -1.7, -3.5, -0.9, -4.0], vec![-1.1, -0.2, -3.5, -0.6, -2.0]];
    let logp_ref = vec![vec![-0.5, -1.2, 0.0, -0.1, -7.0], vec![-1.1, -0.9, -3.1, -0.4, -1.5]];
    let logp_mu = vec![vec![-0.2, -1.9, -3.3, -1.3, -3.6], vec![-1.0, -0.5, -3.0, -0.6, -2.4]];
    let mask = vec![vec![1.0, 1.0, 1.0, 1.0, 0.0], vec![1.0, 1.0, 1.0, 1.0, 1.0]];
    let variants: [(&str, KlConfig); 8] = [
        ("abs", KlConfig::abs()),
        ("abs+", KlConfig::abs().with_straight_through(true)),
        ("k1+", KlConfig::k1().with_straight_through(true)),
        ("k2+", KlConfig::k2().with_straight_through(true)),
        ("low_var_kl", KlConfig::low_var_kl()),
        ("k3", KlConfig::low_var_kl()),
        ("k3+", KlConfig::low_var_kl().with_straight_through(true)),
        ("mse", KlConfig::k2()),
    ];
    let mut calls: Vec<_> = variants
        .iter()
        .map(|(name, _)| json!({"fn": "verl.kl_penalty", "args": {"logp": logp, "logp_ref": logp_ref, "estimator": name}}))
        .collect();
    calls.push(json!({"fn": "trl.corrected_kl", "args": {"logp": logp, "logp_mu": logp_mu, "logp_ref": logp_ref, "mask": mask}}));
    let Some(res) = peer(&calls) else { return };
    let all = Tensor::ones([2, 5], (Kind::Bool, tch::Device::Cpu));
    for (i, (name, cfg)) in variants.iter().enumerate() {
        // Per token: TokenSum with coef 1 gives the sum, whose gradient is each token's.
        let cfg = cfg.with_coef(1.0).with_aggregation(AggregationMode::TokenSum);
        let p = leaf(&t2(&logp));
        let out = kl_penalty_output(&p, &t2(&logp_ref), &all, &cfg, &Normalizer::local()).unwrap();
        out.loss.backward();
        assert_close(&vec1(&out.terms), &json_f64(&res[i]["value"]), 1e-12, &format!("verl {name} value"));
        assert_close(&vec1(&p.grad()), &json_f64(&res[i]["grad"]), 1e-12, &format!("verl {name} grad"));
    }
    let m = Tensor::stack(&mask.iter().map(|r| Tensor::from_slice(r)).collect::<Vec<_>>(), 0);
    let p = leaf(&t2(&logp));
    let out = kl_penalty_corrected_output(
        &p,
        &t2(&logp_mu),
        &t2(&logp_ref),
        &m,
        &KlConfig::k3().with_coef(1.0),
        &Normalizer::local(),
    )
    .unwrap();
    out.loss.backward();
    let trl = &res[variants.len()];
    assert_close(&[scalar(&out.loss)], &[trl["value"].as_f64().unwrap()], 1e-12, "TRL corrected KL value");
    assert_close(&vec1(&p.grad()), &json_f64(&trl["grad"]), 1e-12, "TRL corrected KL grad");
    let per_token: Vec<f64> =
        json_f64(&trl["per_token"]).iter().zip(mask.iter().flatten()).map(|(k, m)| k * m).collect();
    assert_close(&vec1(&out.terms), &per_token, 1e-12, "TRL corrected KL per token");
}

proptest! {
    #[test]
    fn corrected_split_with_global_counts_sums_to_the_whole(b in token_batch(2.0, Just(0.0).boxed())) {
        prop_assume!(b.logp.len() >= 2);
        let (lp, lr, _, mask) = b.tensors(f64::NAN);
        let mu = lp.where_self(&mask, &lp.zeros_like()) - 0.3;
        let norm = Normalizer::from_masks(&[&mask]).unwrap();
        prop_assume!(norm.tokens.unwrap() > 0.0);
        let rows = b.logp.len() as i64;
        for mode in ALL_MODES {
            let cfg = KlConfig::low_var_kl().with_coef(1.0).with_straight_through(true).with_aggregation(mode);
            let run = |s: i64, n: i64| scalar(&kl_penalty_corrected_output(&lp.narrow(0, s, n), &mu.narrow(0, s, n), &lr.narrow(0, s, n), &mask.narrow(0, s, n), &cfg, &norm).unwrap().loss);
            assert_close(&[run(0, 1) + run(1, rows - 1)], &[run(0, rows)], 1e-10, &format!("{mode:?}"));
        }
    }
}
