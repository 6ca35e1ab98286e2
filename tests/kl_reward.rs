//! The KL penalty in the reward and the KL controllers against their formulas, padding, errors and
//! verl 0.9.1's `apply_kl_penalty`, `compute_rewards`, `AdaptiveKLController` and `FixedKLController`.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{AdaptiveKlController, FixedKlController, KlConfig, KlEstimator, LossError, kl_penalized_rewards};

fn estimate(d: f64, e: KlEstimator) -> f64 {
    match e {
        KlEstimator::K1 => d,
        KlEstimator::K2 => d * d / 2.0,
        KlEstimator::K3 => (-d).exp() + d - 1.0,
        KlEstimator::Abs => d.abs(),
        other => unreachable!("{other:?}"),
    }
}

/// β(1 + clip(kl/target − 1, ±0.2) n/horizon), from the paper's formula.
fn ref_adaptive(beta: f64, kl: f64, target: f64, n: u64, horizon: f64) -> f64 {
    beta * (1.0 + (kl / target - 1.0).clamp(-0.2, 0.2) * n as f64 / horizon)
}

proptest! {
    #[test]
    fn rewards_match_their_formula(b in token_batch(2.0, Just(0.0).boxed()), scores in prop::collection::vec(-2.0f64..2.0, 36), beta in 0.0f64..1.0) {
        let s: Vec<Vec<f64>> = b.logp.iter().enumerate().map(|(i, r)| (0..r.len()).map(|t| scores[i * 6 + t]).collect()).collect();
        let s_t = t2(&s.iter().zip(&b.mask).map(|(r, m)| r.iter().zip(m).map(|(x, m)| if *m { *x } else { f64::NAN }).collect()).collect::<Vec<Vec<f64>>>());
        for e in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3, KlEstimator::Abs] {
            let (lp, lr, _, mask) = b.tensors(f64::NAN);
            let lp = leaf(&lp);
            let out = kl_penalized_rewards(&lp, &lr, &s_t, &mask, &KlConfig::default().with_estimator(e).with_coef(beta)).unwrap();
            prop_assert!(!out.rewards.requires_grad());
            let (mut rewards, mut kl, mut seq_means) = (vec![], vec![], vec![]);
            for (i, si) in s.iter().enumerate() {
                let (mut sum, mut n) = (0.0, 0.0);
                for (t, st) in si.iter().enumerate() {
                    if b.mask[i][t] {
                        let k = estimate(b.logp[i][t] - b.other[i][t], e);
                        rewards.push(st - beta * k);
                        kl.push(k);
                        sum += k;
                        n += 1.0;
                    } else {
                        rewards.push(0.0);
                        kl.push(0.0);
                    }
                }
                seq_means.push(if n > 0.0 { sum / n } else { 0.0 });
            }
            assert_close(&vec1(&out.rewards), &rewards, 1e-12, &format!("{e:?} rewards"));
            assert_close(&vec1(&out.kl), &kl, 1e-12, &format!("{e:?} kl"));
            let mean = seq_means.iter().sum::<f64>() / seq_means.len() as f64;
            assert_close(&[scalar(&out.kl_mean)], &[mean], 1e-12, &format!("{e:?} kl_mean"));
        }
    }

    #[test]
    fn adaptive_controller_follows_its_formula(init in 0.0f64..1.0, target in 0.01f64..10.0, horizon in 1.0f64..1e5, steps in prop::collection::vec((0.0f64..20.0, 0u64..5000), 1..8)) {
        let mut c = AdaptiveKlController::new(init, target, horizon).unwrap();
        let mut beta = init;
        for (kl, n) in steps {
            let before = beta;
            let want = ref_adaptive(beta, kl, target, n, horizon);
            match c.update(kl, n) {
                Ok(v) => {
                    assert_close(&[v, c.value], &[want, want], 1e-12, "β");
                    beta = want;
                }
                Err(e) => {
                    // Only an update that would make β negative is refused, and β is kept.
                    prop_assert!(want < 0.0, "{e}");
                    let named = matches!(e, LossError::InvalidArgument { argument: "n_steps", .. });
                    prop_assert!(named, "{}", e);
                    prop_assert_eq!(c.value, beta);
                }
            }
            // Above the target β never falls, below it never rises.
            let monotone = if kl >= target { c.value >= before * (1.0 - 1e-15) } else { c.value <= before * (1.0 + 1e-15) };
            prop_assert!(monotone, "kl {} target {} β {}", kl, target, c.value);
        }
    }
}

#[test]
fn controllers_and_rewards_reject_bad_input() {
    for (args, name) in
        [((-0.1, 1.0, 1.0), "init_coef"), ((0.1, 0.0, 1.0), "target"), ((0.1, 1.0, f64::NAN), "horizon")]
    {
        let e = AdaptiveKlController::new(args.0, args.1, args.2).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument, .. } if argument == name), "{e}");
    }
    let mut c = AdaptiveKlController::new(0.1, 1.0, 10.0).unwrap();
    let e = c.update(f64::NAN, 1).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "current_kl", .. }), "{e}");
    let e = c.update(0.0, 100).unwrap_err(); // β · (1 − 0.2 · 10) < 0
    assert!(matches!(e, LossError::InvalidArgument { argument: "n_steps", .. }), "{e}");
    assert_eq!(c.value, 0.1);
    c.value = f64::INFINITY;
    assert!(matches!(c.update(1.0, 1), Err(LossError::InvalidArgument { argument: "value", .. })));
    assert!(FixedKlController::new(f64::NAN).is_err());
    assert_eq!(FixedKlController::new(0.2).unwrap().update(1e9, u64::MAX).unwrap(), 0.2);

    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let e = kl_penalized_rewards(&lp, &lp, &t1(&[1.0]), &m, &KlConfig::k1()).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "token_scores", .. }), "{e}");
    let e = kl_penalized_rewards(&lp, &lp, &Tensor::from_slice2(&[[f64::NAN, 0.0]]), &m, &KlConfig::k1()).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "token_scores", .. }), "{e}");
    let e = kl_penalized_rewards(&lp, &Tensor::from_slice2(&[[0.0f64]]), &lp, &m, &KlConfig::k1()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_ref", .. }), "{e}");
    let e = kl_penalized_rewards(&lp, &lp, &lp, &m, &KlConfig::k1().with_coef(-1.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "coef", .. }), "{e}");
    // f16/bf16 computed in f32; extreme log-ratios stay finite (d is clamped to ±20).
    for kind in [Kind::Half, Kind::BFloat16, Kind::Float] {
        let p = Tensor::from_slice2(&[[-1.0e4f64, 0.0]]).to_kind(kind);
        let r = Tensor::from_slice2(&[[0.0f64, -1.0e4]]).to_kind(kind);
        let out = kl_penalized_rewards(&p, &r, &p.zeros_like(), &m, &KlConfig::k3()).unwrap();
        assert_eq!(out.rewards.kind(), Kind::Float);
        assert!(vec1(&out.rewards).iter().all(|x| x.is_finite()));
    }
}

#[test]
fn matches_verl_apply_kl_penalty_and_controllers() {
    let logp = vec![vec![-0.3, -1.7, -2.2, -0.9], vec![-1.1, -0.2, -3.5, -0.6], vec![-0.4, -0.4, -0.8, -1.0]];
    let logp_ref = vec![vec![-0.5, -1.2, -1.3, -0.1], vec![-1.1, -0.9, -0.2, -0.4], vec![-0.1, -1.4, -0.3, -0.2]];
    let scores = vec![vec![0.0, 0.0, 1.0, 0.0], vec![0.0, 0.0, 0.0, -1.0], vec![0.5, 0.0, 0.0, 0.0]];
    let mask = vec![vec![1.0, 1.0, 1.0, 0.0], vec![1.0, 1.0, 1.0, 1.0], vec![1.0, 0.0, 0.0, 0.0]];
    let estimators: [(&str, KlConfig); 4] = [
        ("kl", KlConfig::k1()),
        ("abs", KlConfig::abs()),
        ("mse", KlConfig::k2()),
        ("low_var_kl", KlConfig::low_var_kl()),
    ];
    let (beta, target, horizon) = (0.05, 0.2, 100.0);
    let mut calls: Vec<_> = estimators
        .iter()
        .map(|(name, _)| json!({"fn": "verl.apply_kl_penalty", "args": {"token_scores": scores, "logp_old": logp, "logp_ref": logp_ref, "mask": mask, "estimator": name, "init_coef": beta, "target": target, "horizon": horizon}}))
        .collect();
    calls.push(json!({"fn": "verl.apply_kl_penalty", "args": {"token_scores": scores, "logp_old": logp, "logp_ref": logp_ref, "mask": mask, "estimator": "kl", "init_coef": beta, "target": null, "horizon": null}}));
    calls.push(json!({"fn": "verl.compute_rewards", "args": {"token_scores": scores, "logp_old": logp, "logp_ref": logp_ref, "coef": beta}}));
    let updates = [[0.5, 64.0], [0.01, 64.0], [0.21, 3.0], [0.2, 10.0], [5.0, 1.0]];
    calls.push(json!({"fn": "verl.kl_controller", "args": {"init_coef": beta, "target": target, "horizon": 1000.0, "updates": updates}}));
    calls.push(json!({"fn": "verl.kl_controller", "args": {"init_coef": beta, "target": null, "horizon": null, "updates": updates}}));
    let Some(res) = peer(&calls) else { return };
    let m = Tensor::stack(&mask.iter().map(|r| Tensor::from_slice(r)).collect::<Vec<_>>(), 0);
    let on_mask = |x: &[f64]| -> Vec<f64> {
        x.iter().zip(mask.iter().flatten()).map(|(x, m)| if *m > 0.0 { *x } else { 0.0 }).collect()
    };
    for (i, (name, cfg)) in estimators.iter().enumerate() {
        let mut ctrl = AdaptiveKlController::new(beta, target, horizon).unwrap();
        let out =
            kl_penalized_rewards(&t2(&logp), &t2(&logp_ref), &t2(&scores), &m, &cfg.with_coef(ctrl.value)).unwrap();
        // verl leaves the scores on padding; the crate zeroes it.
        assert_close(&vec1(&out.rewards), &on_mask(&json_f64(&res[i]["rewards"])), 1e-12, &format!("{name} rewards"));
        // verl's per-sequence mean divides by L_i + 1e-8.
        let kl = scalar(&out.kl_mean);
        assert_close(&[kl], &[res[i]["kl_mean"].as_f64().unwrap()], 1e-8, &format!("{name} kl_mean"));
        assert_eq!(res[i]["coef"].as_f64().unwrap(), beta);
        ctrl.update(kl, 3).unwrap();
        assert_close(&[ctrl.value], &[res[i]["coef_after"].as_f64().unwrap()], 1e-12, &format!("{name} β after"));
    }
    let fixed = &res[estimators.len()];
    let out =
        kl_penalized_rewards(&t2(&logp), &t2(&logp_ref), &t2(&scores), &m, &KlConfig::k1().with_coef(beta)).unwrap();
    assert_close(&vec1(&out.rewards), &on_mask(&json_f64(&fixed["rewards"])), 1e-12, "fixed rewards");
    assert_eq!(fixed["coef_after"].as_f64().unwrap(), beta);
    // compute_rewards: K1 on every token, no mask.
    let all = Tensor::ones([3, 4], (Kind::Bool, tch::Device::Cpu));
    let out =
        kl_penalized_rewards(&t2(&logp), &t2(&logp_ref), &t2(&scores), &all, &KlConfig::k1().with_coef(beta)).unwrap();
    assert_close(&vec1(&out.rewards), &json_f64(&res[estimators.len() + 1]["rewards"]), 1e-12, "compute_rewards");
    // The controllers, step by step.
    let mut adaptive = AdaptiveKlController::new(beta, target, 1000.0).unwrap();
    let mut fixed = FixedKlController::new(beta).unwrap();
    let (mut a, mut f) = (vec![], vec![]);
    for [kl, n] in updates {
        a.push(adaptive.update(kl, n as u64).unwrap());
        f.push(fixed.update(kl, n as u64).unwrap());
    }
    assert_close(&a, &json_f64(&res[estimators.len() + 2]["values"]), 1e-12, "adaptive controller");
    assert_close(&f, &json_f64(&res[estimators.len() + 3]["values"]), 0.0, "fixed controller");
}
