//! The DPO family against scalar references, finite differences and extreme margins.

mod common;

use common::*;
use proptest::prelude::*;
use tch::{Kind, Tensor};
use topr_loss::{DpoConfig, DpoVariant, LossError, Normalizer, dpo_loss, dpo_loss_output, dpo_rewards};

/// log σ(x) by cases, stable for large |x|.
fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 { -(-x).exp().ln_1p() } else { x - x.exp().ln_1p() }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Value and gradients w.r.t. logp_chosen and logp_rejected, by hand.
fn ref_dpo(pc: &[f64], pr: &[f64], rc: &[f64], rr: &[f64], cfg: &DpoConfig) -> (f64, Vec<f64>, Vec<f64>) {
    let n = pc.len() as f64;
    let (b, eps) = (cfg.beta, cfg.label_smoothing);
    let mut value = 0.0;
    let (mut gc, mut gr) = (vec![0.0; pc.len()], vec![0.0; pc.len()]);
    for i in 0..pc.len() {
        let (c, r) = if cfg.reference_free { (pc[i], pr[i]) } else { (pc[i] - rc[i], pr[i] - rr[i]) };
        let d = c - r;
        let h = b * d;
        // dℓ/dΔ
        let (v, dd) = match cfg.variant {
            DpoVariant::Sigmoid => (
                -(1.0 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h),
                b * (-(1.0 - eps) * (1.0 - sigmoid(h)) + eps * sigmoid(h)),
            ),
            DpoVariant::Ipo => ((d - 1.0 / (2.0 * b)).powi(2), 2.0 * (d - 1.0 / (2.0 * b))),
            DpoVariant::Hinge => ((1.0 - h).max(0.0), if 1.0 - h > 0.0 { -b } else { 0.0 }),
            other => unreachable!("a variant without a reference: {other:?}"),
        };
        value += v / n;
        gc[i] = dd / n;
        gr[i] = -dd / n;
    }
    (value, gc, gr)
}

fn configs() -> Vec<DpoConfig> {
    vec![
        DpoConfig::default(),
        DpoConfig::cdpo(0.2).with_beta(0.5),
        DpoConfig::ipo().with_beta(0.3),
        DpoConfig::hinge().with_beta(0.25),
        DpoConfig::dpo().with_beta(0.2).with_reference_free(true),
        DpoConfig::ipo().with_beta(1.0).with_reference_free(true),
    ]
}

fn run(pc: &[f64], pr: &[f64], rc: &[f64], rr: &[f64], cfg: &DpoConfig) -> (f64, Vec<f64>, Vec<f64>) {
    let (c, r) = (leaf(&t1(pc)), leaf(&t1(pr)));
    let loss = dpo_loss(&c, &r, &t1(rc), &t1(rr), cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&c.grad()), vec1(&r.grad()))
}

fn pairs() -> impl Strategy<Value = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>)> {
    (1usize..16).prop_flat_map(|n| {
        let v = || prop::collection::vec(-60.0f64..-1.0, n);
        (v(), v(), v(), v())
    })
}

proptest! {
    #[test]
    fn matches_scalar_reference((pc, pr, rc, rr) in pairs()) {
        for cfg in configs() {
            let (v, gc, gr) = run(&pc, &pr, &rc, &rr, &cfg);
            let (rv, rgc, rgr) = ref_dpo(&pc, &pr, &rc, &rr, &cfg);
            assert_close(&[v], &[rv], 1e-10, &format!("{cfg:?} value"));
            assert_close(&gc, &rgc, 1e-10, &format!("{cfg:?} grad chosen"));
            assert_close(&gr, &rgr, 1e-10, &format!("{cfg:?} grad rejected"));
        }
    }

    #[test]
    fn rewards_match_their_definition((pc, pr, rc, rr) in pairs(), beta in 0.01f64..2.0) {
        let cfg = DpoConfig::default().with_beta(beta);
        let r = dpo_rewards(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &cfg).unwrap();
        let wc: Vec<f64> = pc.iter().zip(&rc).map(|(p, r)| beta * (p - r)).collect();
        let wr: Vec<f64> = pr.iter().zip(&rr).map(|(p, r)| beta * (p - r)).collect();
        assert_close(&vec1(&r.chosen), &wc, 1e-12, "chosen rewards");
        assert_close(&vec1(&r.rejected), &wr, 1e-12, "rejected rewards");
        let n = pc.len() as f64;
        let acc = wc.iter().zip(&wr).filter(|(c, r)| c > r).count() as f64 / n;
        let margin = wc.iter().zip(&wr).map(|(c, r)| c - r).sum::<f64>() / n;
        let out = dpo_loss_output(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &cfg, &Normalizer::local()).unwrap();
        let d = out.diagnostics.read().unwrap();
        prop_assert_eq!(d.pairs, pc.len() as i64);
        prop_assert!((d.accuracy - acc).abs() < 1e-12);
        prop_assert!((d.margin - margin).abs() < 1e-10);
        prop_assert!((d.chosen_reward_mean - wc.iter().sum::<f64>() / n).abs() < 1e-10);
        prop_assert!((d.rejected_reward_mean - wr.iter().sum::<f64>() / n).abs() < 1e-10);
        // With the pairs' own count the output's loss is the plain one; the terms are per pair.
        let plain = dpo_loss(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &cfg).unwrap();
        assert_close(&[scalar(&out.loss)], &[scalar(&plain)], 1e-12, "output vs plain");
        assert_close(&[vec1(&out.terms).iter().sum::<f64>() / n], &[scalar(&plain)], 1e-12, "terms");
    }

    #[test]
    fn micro_batches_with_the_global_pair_count_add_up((pc, pr, rc, rr) in pairs(), split in 1usize..5) {
        prop_assume!(pc.len() > 1);
        let s = split.min(pc.len() - 1) as i64;
        let n = pc.len() as i64;
        let norm = Normalizer::sequences(n as f64);
        for cfg in configs() {
            let (full_c, parts_c) = (leaf(&t1(&pc)), leaf(&t1(&pc)));
            let full = dpo_loss(&full_c, &t1(&pr), &t1(&rc), &t1(&rr), &cfg).unwrap();
            full.backward();
            let part = |o: i64, k: i64| {
                let cut = |v: &[f64]| t1(v).narrow(0, o, k);
                dpo_loss_output(&parts_c.narrow(0, o, k), &cut(&pr), &cut(&rc), &cut(&rr), &cfg, &norm).unwrap().loss
            };
            let total = part(0, s) + part(s, n - s);
            total.backward();
            assert_close(&[scalar(&total)], &[scalar(&full)], 1e-12, &format!("{cfg:?} split value"));
            assert_close(&vec1(&parts_c.grad()), &vec1(&full_c.grad()), 1e-12, &format!("{cfg:?} split grad"));
        }
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let pc = [-10.0, -22.5, -7.25];
    let pr = [-11.0, -20.0, -9.0];
    let rc = [-10.5, -21.0, -8.0];
    let rr = [-10.4, -21.3, -8.6];
    for cfg in configs() {
        let (_, gc, gr) = run(&pc, &pr, &rc, &rr, &cfg);
        let f = |c: &[f64], r: &[f64]| scalar(&dpo_loss(&t1(c), &t1(r), &t1(&rc), &t1(&rr), &cfg).unwrap());
        assert_close(&gc, &finite_difference(&pc, 1e-6, |x| f(x, &pr)), 1e-7, &format!("{cfg:?} d/dchosen"));
        assert_close(&gr, &finite_difference(&pr, 1e-6, |x| f(&pc, x)), 1e-7, &format!("{cfg:?} d/drejected"));
    }
}

#[test]
fn extreme_margins_stay_finite() {
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half] {
        for cfg in configs() {
            let c = Tensor::from_slice(&[0.0f64, -1.0e4]).to_kind(kind).set_requires_grad(true);
            let r = Tensor::from_slice(&[-1.0e4f64, 0.0]).to_kind(kind).set_requires_grad(true);
            let z = Tensor::from_slice(&[0.0f64, 0.0]).to_kind(kind);
            let loss = dpo_loss(&c, &r, &z, &z, &cfg).unwrap();
            assert!(scalar(&loss).is_finite(), "{kind:?} {cfg:?}");
            loss.backward();
            assert!(vec1(&c.grad()).iter().chain(&vec1(&r.grad())).all(|g| g.is_finite()), "{kind:?} {cfg:?}");
        }
    }
}

#[test]
fn reference_free_ignores_the_reference_arguments() {
    let cfg = DpoConfig::default().with_reference_free(true);
    let (c, r) = (t1(&[-3.0]), t1(&[-4.0]));
    let a = dpo_loss(&c, &r, &Tensor::new(), &Tensor::new(), &cfg).unwrap();
    let b = dpo_loss(&c, &r, &t1(&[0.0]), &t1(&[0.0]), &DpoConfig::default()).unwrap();
    assert_eq!(scalar(&a), scalar(&b));
}

#[test]
fn bad_inputs_are_errors() {
    let x = t1(&[-1.0, -2.0]);
    let cfg = DpoConfig::default();
    let e = dpo_loss(&x, &t1(&[-1.0]), &x, &x, &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_rejected", .. }), "{e}");
    let e = dpo_loss(&x, &x, &t1(&[-1.0, f64::INFINITY]), &x, &cfg).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp_ref_chosen", .. }), "{e}");
    let e = dpo_loss(&x, &x, &Tensor::new(), &x, &cfg).unwrap_err();
    assert!(matches!(e, LossError::UnsupportedTensor { argument: "logp_ref_chosen", .. }), "{e}");
    let e = dpo_loss(&t1(&[]), &t1(&[]), &t1(&[]), &t1(&[]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { .. }), "{e}");
    for bad in [
        cfg.with_beta(f64::NAN),
        cfg.with_beta(-1.0),
        cfg.with_label_smoothing(0.7),
        cfg.with_label_smoothing(0.1).with_variant(DpoVariant::Hinge),
    ] {
        assert!(matches!(dpo_loss(&x, &x, &x, &x, &bad), Err(LossError::InvalidConfig { .. })), "{bad:?}");
    }
}
