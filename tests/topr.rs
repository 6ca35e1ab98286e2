//! `topr_loss` against an independent scalar implementation, finite differences, and the
//! properties the paper states.

mod common;

use common::*;
use proptest::prelude::*;
use tch::{Kind, Tensor};
use topr_loss::{LossError, Normalizer, TieRule, ToprConfig, topr_loss, topr_loss_output};

fn limits(cfg: &ToprConfig) -> [f64; 4] {
    [cfg.a_pos, cfg.b_pos, cfg.a_neg, cfg.b_neg]
}

/// The presets and a few custom limits, each with a non-zero baseline.
fn configs() -> Vec<(&'static str, ToprConfig)> {
    vec![
        ("canonical", ToprConfig::canonical().with_baseline(0.3)),
        ("naive_reinforce", ToprConfig::naive_reinforce().with_baseline(-0.4)),
        ("sft", ToprConfig::sft().with_baseline(0.2)),
        ("tis", ToprConfig::tis().with_baseline(-0.25)),
        ("importance_sampling", ToprConfig::importance_sampling().with_baseline(0.1)),
        (
            "custom_wide",
            ToprConfig::canonical().with_positive_limits(0.5, 2.0).with_negative_limits(0.2, 1.5).with_baseline(0.35),
        ),
        (
            "custom_narrow",
            ToprConfig::canonical().with_positive_limits(0.9, 1.1).with_negative_limits(0.0, 0.5).with_baseline(-0.6),
        ),
        (
            "custom_equal",
            ToprConfig::canonical().with_positive_limits(0.7, 0.7).with_negative_limits(1.3, 1.3).with_baseline(0.05),
        ),
    ]
}

fn loss_and_grad(logp: &[f64], logp_mu: &[f64], rewards: &[f64], cfg: &ToprConfig) -> (f64, Vec<f64>) {
    let lp = leaf(&t1(logp));
    let loss = topr_loss(&lp, &t1(logp_mu), &t1(rewards), cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&lp.grad()))
}

fn batch() -> impl Strategy<Value = (Vec<f64>, Vec<f64>, Vec<f64>)> {
    (1usize..24).prop_flat_map(|n| {
        (
            prop::collection::vec(-40.0f64..-1.0, n),
            prop::collection::vec(-3.0f64..3.0, n),
            prop::collection::vec(prop_oneof![Just(1.0f64), Just(-1.0), -2.0f64..2.0], n),
        )
            .prop_map(|(logp, delta, r)| {
                let (logp, mu) = logp
                    .iter()
                    .zip(&delta)
                    .map(|(l, d)| {
                        let [l, m] = non_positive([*l, l - d]);
                        (l, m)
                    })
                    .unzip();
                (logp, mu, r)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn value_and_gradient_match_scalar_reference((logp, mu, r) in batch()) {
        for (name, cfg) in configs() {
            let (v, g) = loss_and_grad(&logp, &mu, &r, &cfg);
            let (rv, rg) = ref_topr(&logp, &mu, &r, limits(&cfg), cfg.baseline);
            assert_close(&[v], &[rv], 1e-10, &format!("{name} value"));
            assert_close(&g, &rg, 1e-10, &format!("{name} gradient"));
        }
    }

    #[test]
    fn on_policy_every_preset_matches_naive_reinforce((logp, _mu, r) in batch(), c in -0.9f64..0.9) {
        let naive = loss_and_grad(&logp, &logp, &r, &ToprConfig::naive_reinforce().with_baseline(c)).1;
        for cfg in [ToprConfig::canonical(), ToprConfig::tis(), ToprConfig::importance_sampling()] {
            let g = loss_and_grad(&logp, &logp, &r, &cfg.with_baseline(c)).1;
            assert_close(&g, &naive, 1e-12, "on-policy gradient");
        }
        // SFT has b− = 0: on-policy it equals naive REINFORCE on the positives and ignores negatives.
        let g = loss_and_grad(&logp, &logp, &r, &ToprConfig::sft().with_baseline(c)).1;
        let want: Vec<f64> = naive.iter().zip(&r).map(|(g, r)| if r - c >= 0.0 { *g } else { 0.0 }).collect();
        assert_close(&g, &want, 1e-12, "on-policy SFT gradient");
    }

    #[test]
    fn canonical_positive_branch_ignores_the_ratio((logp, mu, r) in batch(), shift in prop::collection::vec(-50.0f64..50.0, 24)) {
        let cfg = ToprConfig::canonical();
        let g1 = loss_and_grad(&logp, &mu, &r, &cfg).1;
        // μ moved anywhere at or below 0 (a log-probability), π kept: ratios from about e^{−40} to e^{+90}.
        let mu2: Vec<f64> = mu.iter().zip(&shift).map(|(m, s)| (m + s).min(0.0)).collect();
        let g2 = loss_and_grad(&logp, &mu2, &r, &cfg).1;
        let n = logp.len() as f64;
        for i in 0..logp.len() {
            if r[i] >= 0.0 {
                prop_assert_eq!(g1[i], g2[i]);
                prop_assert!((g1[i] + r[i] / n).abs() <= 1e-15);
            }
        }
    }

    #[test]
    fn value_is_a_lower_bound_of_the_importance_sampled_objective((logp, mu, r) in batch()) {
        // T(x) <= x, so with non-negative shifted rewards the TOPR objective is at most the IS one.
        let r: Vec<f64> = r.iter().map(|v| v.abs()).collect();
        let is = loss_and_grad(&logp, &mu, &r, &ToprConfig::importance_sampling()).0;
        for (name, cfg) in configs() {
            if cfg.baseline > 0.0 { continue; }
            let v = loss_and_grad(&logp, &mu, &r, &cfg.with_baseline(0.0)).0;
            prop_assert!(-v <= -is + 1e-12, "{}: J_topr {} > J_is {}", name, -v, -is);
        }
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let logp = [-3.1, -7.4, -2.2, -5.0, -9.3, -4.4];
    // Ratios e^δ spread over every branch of every config.
    let mu = [-3.5, -6.9, -2.2, -6.1, -8.0, -4.45];
    let rewards = [1.0, -1.0, 0.5, -0.3, 2.0, -2.0];
    for (name, cfg) in configs() {
        let f = |lp: &[f64]| scalar(&topr_loss(&t1(lp), &t1(&mu), &t1(&rewards), &cfg).unwrap());
        let fd = finite_difference(&logp, 1e-6, f);
        let (_, g) = loss_and_grad(&logp, &mu, &rewards, &cfg);
        assert_close(&g, &fd, 1e-7, &format!("{name} finite differences"));
    }
}

#[test]
fn logp_mu_never_receives_gradient() {
    let lp = leaf(&t1(&[-1.0, -2.0]));
    let mu = leaf(&t1(&[-1.5, -1.0]));
    topr_loss(&lp, &mu, &t1(&[1.0, -1.0]), &ToprConfig::tis()).unwrap().backward();
    assert!(!mu.grad().defined() || vec1(&mu.grad()).iter().all(|g| *g == 0.0));
}

#[test]
fn extreme_log_ratios_stay_finite_in_every_dtype() {
    let finite_presets = [ToprConfig::canonical(), ToprConfig::naive_reinforce(), ToprConfig::sft(), ToprConfig::tis()];
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half] {
        for cfg in finite_presets {
            let cfg = cfg.with_baseline(0.25);
            let logp =
                Tensor::from_slice(&[-1.0e4f64, 0.0, -5.0, -1.0e4, 0.0, -3.0]).to_kind(kind).set_requires_grad(true);
            let mu = Tensor::from_slice(&[0.0f64, -1.0e4, -5.0, 0.0, -1.0e4, -3.0]).to_kind(kind);
            let rewards = Tensor::from_slice(&[1.0f64, 1.0, 1.0, -1.0, -1.0, -1.0]).to_kind(kind);
            let loss = topr_loss(&logp, &mu, &rewards, &cfg).unwrap();
            assert_eq!(loss.kind(), if kind == Kind::Double { Kind::Double } else { Kind::Float });
            assert!(scalar(&loss).is_finite(), "{kind:?} {cfg:?}: value {}", scalar(&loss));
            loss.backward();
            let g = vec1(&logp.grad());
            assert!(g.iter().all(|v| v.is_finite()), "{kind:?} {cfg:?}: grad {g:?}");
        }
    }
}

#[test]
fn importance_sampling_overflow_is_an_error_not_inf() {
    let lp = leaf(&t1(&[0.0, -1.0]));
    let mu = t1(&[-1.0e4, -1.0]);
    let err = topr_loss(&lp, &mu, &t1(&[1.0, -1.0]), &ToprConfig::importance_sampling()).unwrap_err();
    match err {
        LossError::Overflow { field, max_log_ratio, compute_dtype } => {
            assert_eq!(field, "b_pos");
            assert_eq!(max_log_ratio, 1.0e4);
            assert_eq!(compute_dtype, "f64");
        }
        other => panic!("expected Overflow, got {other:?}"),
    }
    // A moderate ratio is fine, and equals the reference.
    let (v, g) = loss_and_grad(&[0.0, -1.0], &[-30.0, -1.0], &[1.0, -1.0], &ToprConfig::importance_sampling());
    let (rv, rg) = ref_topr(&[0.0, -1.0], &[-30.0, -1.0], &[1.0, -1.0], [0.0, f64::INFINITY, 0.0, f64::INFINITY], 0.0);
    assert_close(&[v], &[rv], 1e-12, "IS value");
    assert_close(&g, &rg, 1e-12, "IS grad");
    // In f32 the limit is about 88.7.
    let lp32 = Tensor::from_slice(&[0.0f32]).set_requires_grad(true);
    let err = topr_loss(
        &lp32,
        &Tensor::from_slice(&[-100.0f32]),
        &Tensor::from_slice(&[-1.0f32]),
        &ToprConfig::importance_sampling(),
    );
    assert!(matches!(err, Err(LossError::Overflow { field: "b_neg", .. })), "{err:?}");
}

#[test]
fn a_batch_of_only_zero_weight_rows_still_backpropagates() {
    // SFT on a batch of negatives: loss 0, gradient 0, but backward() works.
    let lp = leaf(&t1(&[-1.0, -2.0]));
    let loss = topr_loss(&lp, &t1(&[-1.0, -1.0]), &t1(&[-1.0, -1.0]), &ToprConfig::sft()).unwrap();
    assert_eq!(scalar(&loss), 0.0);
    loss.backward();
    assert_eq!(vec1(&lp.grad()), vec![0.0, 0.0]);
}

#[test]
fn ties_at_the_baseline_go_to_the_positive_branch() {
    // R' = 0 contributes nothing either way; the diagnostics show the branch.
    let diagnose = |cfg: ToprConfig| {
        let out =
            topr_loss_output(&t1(&[-1.0, -2.0]), &t1(&[-1.0, -2.0]), &t1(&[0.5, 1.0]), &cfg, &Normalizer::local());
        out.unwrap().diagnostics.read().unwrap()
    };
    assert_eq!(diagnose(ToprConfig::canonical().with_baseline(0.5)).negative_fraction, 0.0);
    // Trinity-RFT's and ROLL's rule puts the tie in the tapered branch.
    assert_eq!(diagnose(ToprConfig::canonical().with_baseline(0.5).with_tie(TieRule::Tapered)).negative_fraction, 0.5);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn micro_batches_with_the_global_sample_count_add_up((logp, mu, r) in batch(), split in 1usize..6) {
        prop_assume!(logp.len() > 1);
        let s = split.min(logp.len() - 1) as i64;
        let n = logp.len() as i64;
        let norm = Normalizer::sequences(n as f64);
        for (name, cfg) in configs().into_iter().filter(|(n, _)| *n != "importance_sampling") {
            let (full_lp, parts_lp) = (leaf(&t1(&logp)), leaf(&t1(&logp)));
            let full = topr_loss(&full_lp, &t1(&mu), &t1(&r), &cfg).unwrap();
            full.backward();
            let part = |o: i64, k: i64| {
                topr_loss_output(&parts_lp.narrow(0, o, k), &t1(&mu).narrow(0, o, k), &t1(&r).narrow(0, o, k), &cfg, &norm).unwrap()
            };
            let (a, b) = (part(0, s), part(s, n - s));
            let total = &a.loss + &b.loss;
            total.backward();
            assert_close(&[scalar(&total)], &[scalar(&full)], 1e-12, &format!("{name} split value"));
            assert_close(&vec1(&parts_lp.grad()), &vec1(&full_lp.grad()), 1e-12, &format!("{name} split grad"));
            // The terms are the per-sample values: their sum over S is the loss.
            let terms: f64 = vec1(&a.terms).iter().chain(&vec1(&b.terms)).sum();
            assert_close(&[terms / n as f64], &[scalar(&full)], 1e-12, &format!("{name} terms"));
        }
    }
}

#[test]
fn rewards_too_large_for_f32_are_an_error_not_inf() {
    let lp = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
    let mu = Tensor::from_slice(&[-1.0e4f32, -1.0e4]);
    let r = Tensor::from_slice(&[3.0e38f32, 3.0e38]);
    let err = topr_loss(&lp, &mu, &r, &ToprConfig::canonical()).unwrap_err();
    assert_eq!(err, LossError::NonFiniteLoss { compute_dtype: "f32" });
}
