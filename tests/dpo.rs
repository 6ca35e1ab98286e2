//! The DPO family against scalar references, finite differences and extreme margins.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    Checks, DpoConfig, DpoMix, DpoVariant, LossError, Normalizer, dpo_loss, dpo_loss_output, dpo_mix_loss,
    dpo_mix_loss_output, dpo_rewards,
};

/// log σ(x) by cases, stable for large |x|.
fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 { -(-x).exp().ln_1p() } else { x - x.exp().ln_1p() }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `−(1 − ε) log σ(h) − ε log σ(−h)` and its derivative in `h`.
fn smoothed(h: f64, eps: f64) -> (f64, f64) {
    (-(1.0 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h), -(1.0 - eps) * sigmoid(-h) + eps * sigmoid(h))
}

/// One pair's loss and its derivatives in `c = ρ_w` and `r = ρ_l`, from the papers' formulas.
fn ref_pair(c: f64, r: f64, cfg: &DpoConfig) -> (f64, f64, f64) {
    let (b, eps) = (cfg.beta, cfg.label_smoothing);
    let d = c - r;
    let h = b * d;
    // (value, dℓ/dΔ) for the losses of the margin alone
    let margin = |v: f64, dd: f64| (v, dd, -dd);
    match cfg.variant {
        DpoVariant::Sigmoid | DpoVariant::SigmoidNorm => {
            let (v, g) = smoothed(h, eps);
            margin(v, b * g)
        }
        DpoVariant::Ipo => margin((d - 1.0 / (2.0 * b)).powi(2), 2.0 * (d - 1.0 / (2.0 * b))),
        DpoVariant::Hinge => margin((1.0 - h).max(0.0), if 1.0 - h > 0.0 { -b } else { 0.0 }),
        DpoVariant::Robust => {
            // Chowdhury et al. eq. (5): [(1 − ε) ℓ(h) − ε ℓ(−h)] / (1 − 2ε), ℓ(h) = −log σ(h)
            let v = ((1.0 - eps) * -log_sigmoid(h) - eps * -log_sigmoid(-h)) / (1.0 - 2.0 * eps);
            let g = (-(1.0 - eps) * sigmoid(-h) - eps * sigmoid(h)) / (1.0 - 2.0 * eps);
            margin(v, b * g)
        }
        DpoVariant::ExoPair => {
            // KL((σ(h), σ(−h)) ‖ (1 − ε, ε)); d/dh = σ(h) σ(−h) (h − log((1 − ε)/ε))
            let v = sigmoid(h) * (log_sigmoid(h) - (1.0 - eps).ln()) + sigmoid(-h) * (log_sigmoid(-h) - eps.ln());
            margin(v, b * sigmoid(h) * sigmoid(-h) * (h - ((1.0 - eps) / eps).ln()))
        }
        DpoVariant::NcaPair => {
            let (x, y) = (b * c, b * r);
            let v = -log_sigmoid(x) - 0.5 * log_sigmoid(-x) - 0.5 * log_sigmoid(-y);
            (v, b * (-sigmoid(-x) + 0.5 * sigmoid(x)), 0.5 * b * sigmoid(y))
        }
        DpoVariant::BcoPair => {
            let (x, y) = (b * c, b * r);
            (-log_sigmoid(x) - log_sigmoid(-y), -b * sigmoid(-x), b * sigmoid(y))
        }
        DpoVariant::SppoHard => {
            let t = 1.0 / (2.0 * b);
            ((c - t).powi(2) + (r + t).powi(2), 2.0 * (c - t), 2.0 * (r + t))
        }
        DpoVariant::ApoZero => {
            let (x, y) = (b * c, b * r);
            (1.0 - sigmoid(x) + sigmoid(y), -b * sigmoid(x) * sigmoid(-x), b * sigmoid(y) * sigmoid(-y))
        }
        DpoVariant::ApoDown => {
            let x = b * c;
            let s = b * sigmoid(h) * sigmoid(-h);
            (sigmoid(x) + 1.0 - sigmoid(h), b * sigmoid(x) * sigmoid(-x) - s, s)
        }
        DpoVariant::Discopop => {
            // the paper's form, with e^{−h} as it is (the inputs here keep it finite)
            let t = cfg.discopop_tau;
            let m = sigmoid(h / t);
            let dm = m * (1.0 - m) / t;
            let v = -log_sigmoid(h) * (1.0 - m) + (-h).exp() * m;
            let g = -sigmoid(-h) * (1.0 - m) + log_sigmoid(h) * dm - (-h).exp() * m + (-h).exp() * dm;
            margin(v, b * g)
        }
        other => unreachable!("a variant without a reference: {other:?}"),
    }
}

/// Indices that sort `v` ascending.
fn argsort(v: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&i, &j| v[i].partial_cmp(&v[j]).unwrap());
    idx
}

/// Value and gradients w.r.t. logp_chosen and logp_rejected, by hand.
fn ref_dpo(pc: &[f64], pr: &[f64], rc: &[f64], rr: &[f64], cfg: &DpoConfig) -> (f64, Vec<f64>, Vec<f64>) {
    let n = pc.len();
    let (b, eps) = (cfg.beta, cfg.label_smoothing);
    let ratio = |p: &[f64], r: &[f64]| -> Vec<f64> {
        (0..n).map(|i| if cfg.reference_free { p[i] } else { p[i] - r[i] }).collect()
    };
    let (c, r) = (ratio(pc, rc), ratio(pr, rr));
    let mut value = 0.0;
    let (mut gc, mut gr) = (vec![0.0; n], vec![0.0; n]);
    let nf = n as f64;
    match cfg.variant {
        DpoVariant::Aot | DpoVariant::AotUnpaired => {
            // rank k pairs the k-th smallest of two lists; the gradient goes to where each came from
            let (a, z) = if cfg.variant == DpoVariant::Aot {
                let m: Vec<f64> = (0..n).map(|i| pc[i] - pr[i]).collect();
                let q: Vec<f64> = (0..n).map(|i| if cfg.reference_free { 0.0 } else { rc[i] - rr[i] }).collect();
                (m, q)
            } else {
                (c.clone(), r.clone())
            };
            let (ia, iz) = (argsort(&a), argsort(&z));
            // for Aot both policy terms of a rank sit at ia[k]; for AotUnpaired the rejected one at iz[k]
            let rejected_at = |k: usize| if cfg.variant == DpoVariant::Aot { ia[k] } else { iz[k] };
            for k in 0..n {
                let (v, g) = smoothed(b * (a[ia[k]] - z[iz[k]]), eps);
                value += v / nf;
                gc[ia[k]] += b * g / nf;
                gr[rejected_at(k)] -= b * g / nf;
            }
        }
        _ => {
            for i in 0..n {
                let (v, dc, dr) = ref_pair(c[i], r[i], cfg);
                value += v / nf;
                gc[i] = dc / nf;
                gr[i] = dr / nf;
            }
        }
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
        DpoConfig::robust(0.1),
        DpoConfig::robust(0.3).with_beta(0.7),
        DpoConfig::robust(0.0).with_beta(0.2),
        DpoConfig::exo_pair(1e-3),
        DpoConfig::exo_pair(0.4).with_beta(0.6),
        DpoConfig::nca_pair().with_beta(0.3),
        DpoConfig::bco_pair(),
        DpoConfig::sppo_hard().with_beta(0.5),
        DpoConfig::aot(),
        DpoConfig::aot().with_beta(0.4).with_label_smoothing(0.2),
        DpoConfig::aot().with_reference_free(true),
        DpoConfig::aot_unpaired().with_beta(0.3).with_label_smoothing(0.1),
        DpoConfig::apo_zero().with_beta(0.2),
        DpoConfig::apo_down().with_beta(0.15),
        DpoConfig::discopop(),
        DpoConfig::discopop().with_beta(0.5).with_discopop_tau(0.3),
        DpoConfig::sigmoid_norm().with_beta(0.8),
        DpoConfig::nca_pair().with_reference_free(true),
    ]
}

/// Whether the loss sorts across the batch (and so is not split-invariant).
fn sorts(cfg: &DpoConfig) -> bool {
    matches!(cfg.variant, DpoVariant::Aot | DpoVariant::AotUnpaired)
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
        for cfg in configs().into_iter().filter(|c| !sorts(c)) {
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
            let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
            assert_eq!(loss.kind(), want, "computed in f32 or wider: {kind:?} {cfg:?}");
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
    for (bad, field) in [
        (DpoConfig::robust(0.5), "label_smoothing"),
        (DpoConfig::robust(-0.1), "label_smoothing"),
        (DpoConfig::exo_pair(0.0), "label_smoothing"),
        (DpoConfig::exo_pair(1.0), "label_smoothing"),
        (DpoConfig::exo_pair(f64::NAN), "label_smoothing"),
        (DpoConfig::aot().with_label_smoothing(0.6), "label_smoothing"),
        (DpoConfig::nca_pair().with_label_smoothing(0.1), "label_smoothing"),
        (DpoConfig::bco_pair().with_label_smoothing(0.1), "label_smoothing"),
        (DpoConfig::sppo_hard().with_label_smoothing(0.1), "label_smoothing"),
        (DpoConfig::apo_zero().with_label_smoothing(0.1), "label_smoothing"),
        (DpoConfig::apo_down().with_label_smoothing(0.1), "label_smoothing"),
        (DpoConfig::discopop().with_label_smoothing(0.1), "label_smoothing"),
        (DpoConfig::discopop().with_discopop_tau(0.0), "discopop_tau"),
        (DpoConfig::discopop().with_discopop_tau(f64::INFINITY), "discopop_tau"),
        (DpoConfig::dpo().with_discopop_tau(f64::NAN), "discopop_tau"),
    ] {
        let e = dpo_loss(&x, &x, &x, &x, &bad).unwrap_err();
        assert!(matches!(e, LossError::InvalidConfig { field: f, .. } if f == field), "{bad:?}: {e}");
        let mix = DpoMix::of(DpoConfig::dpo(), 1.0).with_term(bad, 0.5);
        let e = dpo_mix_loss(&x, &x, &x, &x, &mix).unwrap_err();
        assert!(matches!(e, LossError::InvalidConfig { field: f, .. } if f == field), "mix {bad:?}: {e}");
    }
    let mix = DpoMix::of(DpoConfig::dpo(), f64::INFINITY);
    let e = dpo_mix_loss(&x, &x, &x, &x, &mix).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "weight", .. }), "{e}");
    let five = (0..4).fold(DpoMix::of(DpoConfig::dpo(), 1.0), |m, _| m.with_term(DpoConfig::ipo(), 1.0));
    let e = dpo_mix_loss_output(&x, &x, &x, &x, &five, &Normalizer::local()).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "terms", .. }), "{e}");
    // The mix checks its tensors as dpo_loss does, the reference only when a term uses it.
    let mix = DpoMix::of(DpoConfig::aot(), 1.0).with_term(DpoConfig::bco_pair().with_reference_free(true), 1.0);
    let e = dpo_mix_loss(&x, &x, &Tensor::new(), &x, &mix).unwrap_err();
    assert!(matches!(e, LossError::UnsupportedTensor { argument: "logp_ref_chosen", .. }), "{e}");
    let e = dpo_mix_loss(&x, &t1(&[-1.0, f64::NAN]), &x, &x, &mix).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp_rejected", .. }), "{e}");
    let free = DpoMix::of(DpoConfig::apo_down().with_reference_free(true), 1.0);
    assert!(dpo_mix_loss(&x, &x, &Tensor::new(), &Tensor::new(), &free).is_ok());
    let e = dpo_mix_loss(&x.reshape([1, 2]), &x, &x, &x, &mix).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "logp_chosen", .. }), "{e}");
}

proptest! {
    #[test]
    fn robust_dpo_is_unbiased_and_is_dpo_without_noise((pc, pr, rc, rr) in pairs(), eps in 0.0f64..0.45, beta in 0.05f64..1.0) {
        // Chowdhury et al., Lemma 3.1: with labels flipped w.p. ε, E[ℓ̂] = the clean DPO loss.
        let robust = DpoConfig::robust(eps).with_beta(beta);
        let f = |a: &[f64], b: &[f64], ra: &[f64], rb: &[f64], cfg: &DpoConfig| {
            scalar(&dpo_loss(&t1(a), &t1(b), &t1(ra), &t1(rb), cfg).unwrap())
        };
        let expected = (1.0 - eps) * f(&pc, &pr, &rc, &rr, &robust) + eps * f(&pr, &pc, &rr, &rc, &robust);
        let dpo = f(&pc, &pr, &rc, &rr, &DpoConfig::dpo().with_beta(beta));
        assert_close(&[expected], &[dpo], 1e-9, "E[robust] = DPO");
        let zero = f(&pc, &pr, &rc, &rr, &DpoConfig::robust(0.0).with_beta(beta));
        assert_close(&[zero], &[dpo], 1e-12, "robust(0) = DPO");
    }

    #[test]
    fn exo_is_a_kl_divergence((pc, pr, rc, rr) in pairs(), eps in 1e-4f64..0.999, beta in 0.05f64..1.0) {
        let cfg = DpoConfig::exo_pair(eps).with_beta(beta);
        let out = dpo_loss_output(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &cfg, &Normalizer::local()).unwrap();
        prop_assert!(vec1(&out.terms).iter().all(|&t| t >= -1e-12), "KL ≥ 0: {:?}", vec1(&out.terms));
        // zero exactly where σ(h) = 1 − ε
        let h = ((1.0 - eps) / eps).ln();
        let [c, r] = non_positive([h / beta, 0.0]); // the margin h / β, both log-probs ≤ 0
        let at = dpo_loss(&t1(&[c]), &t1(&[r]), &t1(&[0.0]), &t1(&[0.0]), &cfg).unwrap();
        prop_assert!(scalar(&at).abs() < 1e-12, "{}", scalar(&at));
    }

    #[test]
    fn bounded_losses_stay_in_their_range((pc, pr, rc, rr) in pairs(), beta in 0.01f64..2.0) {
        for (cfg, lo, hi) in [
            (DpoConfig::apo_zero(), 0.0, 2.0),
            (DpoConfig::apo_down(), 0.0, 2.0),
            (DpoConfig::nca_pair(), 0.0, f64::INFINITY),
            (DpoConfig::bco_pair(), 0.0, f64::INFINITY),
            (DpoConfig::sppo_hard(), 0.0, f64::INFINITY),
            (DpoConfig::discopop(), 0.0, f64::INFINITY),
        ] {
            let cfg = cfg.with_beta(beta);
            let out = dpo_loss_output(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &cfg, &Normalizer::local()).unwrap();
            prop_assert!(vec1(&out.terms).iter().all(|&t| (lo..=hi).contains(&t)), "{:?}: {:?}", cfg.variant, vec1(&out.terms));
        }
    }

    #[test]
    fn sigmoid_norm_is_the_sigmoid_loss_on_averaged_log_probs((pc, pr, rc, rr) in pairs(), eps in 0.0f64..0.5) {
        let (a, b) = (DpoConfig::sigmoid_norm().with_label_smoothing(eps), DpoConfig::cdpo(eps));
        let (va, ga, _) = run(&pc, &pr, &rc, &rr, &a);
        let (vb, gb, _) = run(&pc, &pr, &rc, &rr, &b);
        prop_assert_eq!(va, vb);
        prop_assert_eq!(ga, gb);
    }

    #[test]
    fn aot_ignores_the_order_of_pairs((pc, pr, rc, rr) in pairs(), shift in 0usize..16) {
        for cfg in configs().into_iter().filter(sorts) {
            let n = pc.len();
            let rot = |v: &[f64]| -> Vec<f64> { (0..n).map(|i| v[(i + shift) % n]).collect() };
            let (v, gc, gr) = run(&pc, &pr, &rc, &rr, &cfg);
            let (w, hc, hr) = run(&rot(&pc), &rot(&pr), &rot(&rc), &rot(&rr), &cfg);
            assert_close(&[w], &[v], 1e-12, "rotated value");
            assert_close(&hc, &rot(&gc), 1e-12, "rotated grad chosen");
            assert_close(&hr, &rot(&gr), 1e-12, "rotated grad rejected");
            // one pair: nothing to sort, the (smoothed) sigmoid loss
            let one = |v: &[f64]| v[..1].to_vec();
            let (a, _, _) = run(&one(&pc), &one(&pr), &one(&rc), &one(&rr), &cfg);
            let (b, _, _) = run(&one(&pc), &one(&pr), &one(&rc), &one(&rr), &cfg.with_variant(DpoVariant::Sigmoid));
            assert_close(&[a], &[b], 1e-12, "AOT on one pair");
        }
    }

    #[test]
    fn a_mix_is_the_weighted_sum_of_its_terms((pc, pr, rc, rr) in pairs(), w in prop::collection::vec(-2.0f64..2.0, 4)) {
        let cs = configs();
        for k in 0..6 {
            let picks = [cs[(5 * k) % cs.len()], cs[(5 * k + 7) % cs.len()], cs[(5 * k + 13) % cs.len()]];
            let mix = DpoMix::of(picks[0], w[0]).with_term(picks[1], w[1]).with_term(picks[2], w[2]);
            let (c, r) = (leaf(&t1(&pc)), leaf(&t1(&pr)));
            let loss = dpo_mix_loss(&c, &r, &t1(&rc), &t1(&rr), &mix).unwrap();
            loss.backward();
            let (mut v, mut gc, mut gr) = (0.0, vec![0.0; pc.len()], vec![0.0; pc.len()]);
            for (cfg, wk) in picks.iter().zip(&w) {
                let (rv, rgc, rgr) = ref_dpo(&pc, &pr, &rc, &rr, cfg);
                v += wk * rv;
                gc.iter_mut().zip(&rgc).for_each(|(g, x)| *g += wk * x);
                gr.iter_mut().zip(&rgr).for_each(|(g, x)| *g += wk * x);
            }
            assert_close(&[scalar(&loss)], &[v], 1e-10, &format!("{mix:?} value"));
            assert_close(&vec1(&c.grad()), &gc, 1e-10, &format!("{mix:?} grad chosen"));
            assert_close(&vec1(&r.grad()), &gr, 1e-10, &format!("{mix:?} grad rejected"));
            // the output form: the same loss, per-pair terms, the first term's rewards
            let out = dpo_mix_loss_output(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &mix, &Normalizer::local()).unwrap();
            assert_close(&[scalar(&out.loss)], &[v], 1e-10, "output value");
            assert_close(&[vec1(&out.terms).iter().sum::<f64>() / pc.len() as f64], &[v], 1e-10, "output terms");
            let d = dpo_loss_output(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &picks[0], &Normalizer::local()).unwrap();
            prop_assert_eq!(vec1(out.diagnostics.tensor()), vec1(d.diagnostics.tensor()));
        }
    }

    #[test]
    fn a_mix_without_aot_adds_up_over_micro_batches((pc, pr, rc, rr) in pairs(), split in 1usize..5) {
        prop_assume!(pc.len() > 1);
        let s = split.min(pc.len() - 1) as i64;
        let n = pc.len() as i64;
        let norm = Normalizer::sequences(n as f64);
        let mix = DpoMix::of(DpoConfig::dpo(), 0.8)
            .with_term(DpoConfig::bco_pair(), 0.2)
            .with_term(DpoConfig::discopop().with_reference_free(true), 0.5)
            .with_term(DpoConfig::exo_pair(1e-3), 1.5);
        let (full_c, parts_c) = (leaf(&t1(&pc)), leaf(&t1(&pc)));
        let full = dpo_mix_loss(&full_c, &t1(&pr), &t1(&rc), &t1(&rr), &mix).unwrap();
        full.backward();
        let part = |o: i64, k: i64| {
            let cut = |v: &[f64]| t1(v).narrow(0, o, k);
            dpo_mix_loss_output(&parts_c.narrow(0, o, k), &cut(&pr), &cut(&rc), &cut(&rr), &mix, &norm).unwrap().loss
        };
        let total = part(0, s) + part(s, n - s);
        total.backward();
        assert_close(&[scalar(&total)], &[scalar(&full)], 1e-12, "split value");
        assert_close(&vec1(&parts_c.grad()), &vec1(&full_c.grad()), 1e-12, "split grad");
    }
}

#[test]
fn aot_couples_the_pairs_of_a_batch() {
    // Sorting happens within a call: two micro-batches sort separately, so AOT is not
    // split-invariant, unlike the per-pair losses.
    let pc = [-1.0, -9.0, -3.0, -2.0];
    let pr = [-5.0, -2.0, -4.0, -8.0];
    let rc = [-2.0, -3.0, -1.0, -4.0];
    let rr = [-1.0, -6.0, -2.0, -3.0];
    let norm = Normalizer::sequences(4.0);
    for cfg in [DpoConfig::aot(), DpoConfig::aot_unpaired()] {
        let full = dpo_loss(&t1(&pc), &t1(&pr), &t1(&rc), &t1(&rr), &cfg).unwrap();
        let part = |o: usize| {
            let cut = |v: &[f64]| t1(&v[o..o + 2]);
            scalar(&dpo_loss_output(&cut(&pc), &cut(&pr), &cut(&rc), &cut(&rr), &cfg, &norm).unwrap().loss)
        };
        let (a, b) = (scalar(&full), part(0) + part(2));
        assert!((a - b).abs() > 1e-3, "{cfg:?}: {a} vs {b}");
    }
}

#[test]
fn discopop_is_finite_where_the_plain_exponential_overflows() {
    // e^{−h} overflows f32 beyond h < −88.7 and f64 beyond h < −709.8; times σ(h/τ) = 0 it gives
    // NaN in TRL 1.16's form. exp(log σ(h/τ) − h) has the same value where that is finite.
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        for delta in [-1.0e4, -2.0e3, -900.0, -100.0, 100.0, 1.0e4] {
            // the margin Δ = chosen − rejected, both log-probs ≤ 0 (rejected = 0 for Δ < 0)
            let [chosen, rejected] = non_positive([delta, 0.0]);
            let c = Tensor::from_slice(&[chosen]).to_kind(kind).set_requires_grad(true);
            let r = Tensor::from_slice(&[rejected]).to_kind(kind);
            let z = Tensor::from_slice(&[0.0f64]).to_kind(kind);
            let cfg = DpoConfig::discopop().with_beta(1.0);
            let loss = dpo_loss(&c, &r, &z, &z, &cfg).unwrap();
            loss.backward();
            let v = scalar(&loss);
            assert!(v.is_finite() && scalar(&c.grad()).is_finite(), "{kind:?} Δ = {delta}: {v}");
            if delta < 0.0 {
                // the logistic part alone, −log σ(h) ≈ −h, up to the dtype's rounding of Δ
                let tol = if matches!(kind, Kind::BFloat16 | Kind::Half) { 1e-2 } else { 1e-6 };
                assert!((v + delta).abs() <= tol * delta.abs(), "{kind:?} Δ = {delta}: {v}");
            }
        }
    }
    // Where both are finite, the two forms agree.
    for h in [-30.0f64, -3.0, -0.1, 0.0, 0.2, 5.0, 40.0] {
        let cfg = DpoConfig::discopop().with_beta(1.0);
        let [c, r] = non_positive([h, 0.0]);
        let got = scalar(&dpo_loss(&t1(&[c]), &t1(&[r]), &t1(&[0.0]), &t1(&[0.0]), &cfg).unwrap());
        let m = sigmoid(h / 0.05);
        let want = -log_sigmoid(h) * (1.0 - m) + (-h).exp() * m;
        assert_close(&[got], &[want], 1e-13, &format!("h = {h}"));
    }
}

#[test]
fn discopop_with_a_temperature_above_one_overflows_to_a_typed_error() {
    // For τ > 1, e^{−h} σ(h/τ) ≈ e^{−h (1 − 1/τ)} grows without bound as h → −∞: the loss itself
    // is infinite in the dtype, a typed error under full checks, returned as it is under Shapes.
    let cfg = DpoConfig::discopop().with_beta(1.0).with_discopop_tau(2.0);
    let (c, z) = (t1(&[-2.0e3]), t1(&[0.0]));
    let e = dpo_loss(&c, &z, &z, &z, &cfg).unwrap_err();
    assert!(matches!(e, LossError::NonFiniteLoss { compute_dtype: "f64" }), "{e}");
    let loss = dpo_loss(&c, &z, &z, &z, &cfg.with_checks(Checks::Shapes)).unwrap();
    assert_eq!(scalar(&loss), f64::INFINITY);
    // a moderate margin is fine
    assert!(scalar(&dpo_loss(&t1(&[-20.0]), &z, &z, &z, &cfg).unwrap()).is_finite());
}

/// Deterministic inputs in `[lo, hi)`.
fn spread(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((x >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// The TRL `loss_type` of a variant.
fn trl_name(v: DpoVariant) -> &'static str {
    match v {
        DpoVariant::Sigmoid => "sigmoid",
        DpoVariant::Ipo => "ipo",
        DpoVariant::Hinge => "hinge",
        DpoVariant::Robust => "robust",
        DpoVariant::ExoPair => "exo_pair",
        DpoVariant::NcaPair => "nca_pair",
        DpoVariant::BcoPair => "bco_pair",
        DpoVariant::SppoHard => "sppo_hard",
        DpoVariant::Aot => "aot",
        DpoVariant::AotUnpaired => "aot_unpaired",
        DpoVariant::ApoZero => "apo_zero",
        DpoVariant::ApoDown => "apo_down",
        DpoVariant::Discopop => "discopop",
        DpoVariant::SigmoidNorm => "sigmoid_norm",
        other => unreachable!("no TRL name for {other:?}"),
    }
}

/// A batch of 8 pairs: summed log-probs and completion lengths.
struct Batch {
    pc: Vec<f64>,
    pr: Vec<f64>,
    rc: Vec<f64>,
    rr: Vec<f64>,
    lc: Vec<f64>,
    lr: Vec<f64>,
}

fn batch(seed: u64) -> Batch {
    let n = 8;
    let lc: Vec<f64> = spread(seed + 4, n, 3.0, 40.0).iter().map(|x| x.floor()).collect();
    let lr: Vec<f64> = spread(seed + 5, n, 3.0, 40.0).iter().map(|x| x.floor()).collect();
    let scaled =
        |s: u64, l: &[f64]| -> Vec<f64> { spread(s, n, -2.0, -0.2).iter().zip(l).map(|(x, l)| x * l).collect() };
    Batch {
        pc: scaled(seed, &lc),
        pr: scaled(seed + 1, &lr),
        rc: scaled(seed + 2, &lc),
        rr: scaled(seed + 3, &lr),
        lc,
        lr,
    }
}

/// TRL's `ipo` and `sigmoid_norm` average the summed log-ratios over the completion's tokens; the
/// crate takes the averaged log-probs (`SequenceReduce::Mean`), whose gradient is TRL's times the
/// length.
fn averages(v: DpoVariant) -> bool {
    matches!(v, DpoVariant::Ipo | DpoVariant::SigmoidNorm)
}

/// The crate's value and gradients (w.r.t. the summed log-probs) of a mix on a batch.
fn crate_mix(x: &Batch, mix: &DpoMix) -> (f64, Vec<f64>, Vec<f64>) {
    let avg = mix.terms().iter().any(|(c, _)| averages(c.variant));
    let per = |v: &[f64], l: &[f64]| -> Vec<f64> {
        if avg { v.iter().zip(l).map(|(v, l)| v / l).collect() } else { v.to_vec() }
    };
    let (c, r) = (leaf(&t1(&per(&x.pc, &x.lc))), leaf(&t1(&per(&x.pr, &x.lr))));
    let loss = dpo_mix_loss(&c, &r, &t1(&per(&x.rc, &x.lc)), &t1(&per(&x.rr, &x.lr)), mix).unwrap();
    loss.backward();
    let back =
        |g: Vec<f64>, l: &[f64]| -> Vec<f64> { if avg { g.iter().zip(l).map(|(g, l)| g / l).collect() } else { g } };
    (scalar(&loss), back(vec1(&c.grad()), &x.lc), back(vec1(&r.grad()), &x.lr))
}

fn trl_call(x: &Batch, names: &[&str], weights: &[f64], beta: f64, eps: f64, tau: f64) -> serde_json::Value {
    json!({"fn": "trl.dpo_loss", "args": {
        "chosen_logps": x.pc, "rejected_logps": x.pr, "ref_chosen_logps": x.rc, "ref_rejected_logps": x.rr,
        "loss_type": names, "loss_weights": weights, "beta": beta, "label_smoothing": eps,
        "discopop_tau": tau, "chosen_lens": x.lc, "rejected_lens": x.lr,
    }})
}

fn compare(cases: &[(DpoMix, serde_json::Value)], x: &[Batch]) {
    let calls: Vec<serde_json::Value> = cases.iter().map(|(_, c)| c.clone()).collect();
    let Some(res) = peer(&calls) else { return };
    for (i, ((mix, _), want)) in cases.iter().zip(&res).enumerate() {
        let (v, gc, gr) = crate_mix(&x[i % x.len()], mix);
        let what = format!("{mix:?}");
        assert_close(&[v], &json_f64(&want["value"]), 1e-10, &format!("{what} value"));
        assert_close(&gc, &json_f64(&want["grad_chosen"]), 1e-10, &format!("{what} grad chosen"));
        assert_close(&gr, &json_f64(&want["grad_rejected"]), 1e-10, &format!("{what} grad rejected"));
    }
}

/// Every variant, on batches of 8 pairs, for a few β and ε, against TRL 1.16.0's lines
/// (`tests/reference/peer_trl_dpo.py`). TRL shares one `label_smoothing` between its loss types and
/// ignores it in the others; the crate takes ε only where its variant uses it (TRL 1.16's
/// `sigmoid` has no label smoothing: cDPO is compared with ε = 0 there).
#[test]
fn every_variant_matches_trl_1_16() {
    let x: Vec<Batch> = (0..3).map(|k| batch(17 + 10 * k)).collect();
    let variants = [
        DpoVariant::Sigmoid,
        DpoVariant::Ipo,
        DpoVariant::Hinge,
        DpoVariant::Robust,
        DpoVariant::ExoPair,
        DpoVariant::NcaPair,
        DpoVariant::BcoPair,
        DpoVariant::SppoHard,
        DpoVariant::Aot,
        DpoVariant::AotUnpaired,
        DpoVariant::ApoZero,
        DpoVariant::ApoDown,
        DpoVariant::Discopop,
        DpoVariant::SigmoidNorm,
    ];
    let uses_eps = |v: DpoVariant| {
        matches!(v, DpoVariant::Robust | DpoVariant::ExoPair | DpoVariant::Aot | DpoVariant::AotUnpaired)
    };
    let mut cases = vec![];
    for (beta, eps, tau) in [(0.1, 0.1, 0.05), (0.5, 0.3, 0.3), (0.02, 1e-3, 0.05), (1.0, 0.45, 1.0)] {
        for v in variants {
            let cfg = DpoConfig::dpo()
                .with_variant(v)
                .with_beta(beta)
                .with_label_smoothing(if uses_eps(v) { eps } else { 0.0 })
                .with_discopop_tau(tau);
            let k = cases.len() % x.len();
            cases.push((DpoMix::of(cfg, 1.0), trl_call(&x[k], &[trl_name(v)], &[1.0], beta, eps, tau)));
        }
    }
    compare(&cases, &x);
}

/// TRL's weighted combination `Σ_k w_k mean(ℓ_k)` (`loss_type=[..]`, `loss_weights=[..]`, shared β,
/// ε and τ) against `DpoMix`.
#[test]
fn mixtures_match_trl_1_16() {
    let x: Vec<Batch> = (0..3).map(|k| batch(101 + 10 * k)).collect();
    let cfg =
        |v: DpoVariant, beta: f64, eps: f64| DpoConfig::dpo().with_variant(v).with_beta(beta).with_label_smoothing(eps);
    use DpoVariant as V;
    // (terms with their weights, β, the shared ε)
    type Mix = (Vec<(DpoVariant, f64)>, f64, f64);
    let mixes: Vec<Mix> = vec![
        (vec![(V::Sigmoid, 0.8), (V::BcoPair, 0.2)], 0.1, 0.0), // MPO's preference part
        (vec![(V::Robust, 1.0), (V::ExoPair, 0.5), (V::Aot, 2.0)], 0.3, 0.2),
        (vec![(V::ApoZero, 1.0), (V::Discopop, 0.25), (V::SppoHard, 0.1), (V::NcaPair, 3.0)], 0.2, 0.0),
        // both on averaged log-probs: a mix takes one set of inputs for all its terms
        (vec![(V::Ipo, 0.5), (V::SigmoidNorm, -1.5)], 0.4, 0.0),
        (vec![(V::AotUnpaired, 1.0), (V::ApoDown, 0.7)], 0.05, 0.1),
    ];
    let mut cases = vec![];
    for (k, (terms, beta, eps)) in mixes.iter().enumerate() {
        let eps_of =
            |v: DpoVariant| if matches!(v, V::Robust | V::ExoPair | V::Aot | V::AotUnpaired) { *eps } else { 0.0 };
        let mut mix = DpoMix::of(cfg(terms[0].0, *beta, eps_of(terms[0].0)), terms[0].1);
        for &(v, w) in &terms[1..] {
            mix = mix.with_term(cfg(v, *beta, eps_of(v)), w);
        }
        let names: Vec<&str> = terms.iter().map(|(v, _)| trl_name(*v)).collect();
        let weights: Vec<f64> = terms.iter().map(|(_, w)| *w).collect();
        cases.push((mix, trl_call(&x[k % x.len()], &names, &weights, *beta, *eps, 0.05)));
    }
    compare(&cases, &x);
}
