//! Entropy control and supervised terms mixed into RL: Skywork-OR1's adaptive entropy coefficient
//! against its `EntController` (restated in Rust and in Python) and its properties; CHORD's
//! schedule, SFT-φ loss and mix against Trinity-RFT's lines restated
//! (`tests/reference/peer_trinity_chord.py`), a scalar reference, finite differences, padding and
//! split invariance; VAPO's positive-example NLL against its formula, cosmos-rl's line and the
//! paper's (`tests/reference/peer_cosmos_nll.py`), padding, split invariance and errors.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::{Value, json};
use tch::{Kind, Tensor};
use topr_loss::{
    AdaptiveEntropyController, AggregationMode, BatchCounts, Checks, EntropyConfig, LossError, Normalizer,
    PositiveNllConfig, PpoConfig, SftPhiConfig, SftWeight, chord_mu, entropy_loss, positive_nll_loss,
    positive_nll_loss_output, ppo_clip_loss, ppo_clip_loss_output, sft_phi_loss, sft_phi_loss_output,
};

// ---------------------------------------------------------------------------------------------
// Adaptive entropy coefficient (Skywork-OR1)

/// Skywork's `EntController.update`, restated: `(value, enabled)` after one update.
fn ref_ent_update(value: f64, e: f64, target: f64, delta: f64, min: f64, max: f64) -> (f64, bool) {
    let v = if e < target { value + delta } else { value - delta };
    (v.max(min).min(max), e < target)
}

/// `(init, target, delta, min, max)` with `0 ≤ min ≤ init ≤ max`.
fn controller_settings() -> impl Strategy<Value = (f64, f64, f64, f64, f64)> {
    (0.0f64..0.1, 0.0f64..0.5, 0.0f64..1.0, 0.0f64..1.5, 0.0f64..0.05).prop_map(|(min, width, at, target, delta)| {
        let max = min + width;
        (min + at * width, target, delta, min, max)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn controller_follows_skyworks_update_and_stays_in_bounds(
        (init, target, delta, min, max) in controller_settings(),
        entropies in prop::collection::vec(0.0f64..2.0, 1..40),
    ) {
        let mut c = AdaptiveEntropyController::new(init, target, delta, min, max).unwrap();
        prop_assert!(c.enabled() && c.coefficient() == init);
        let mut value = init;
        for e in entropies {
            let before = c;
            let got = c.update(e).unwrap();
            let enabled;
            (value, enabled) = ref_ent_update(value, e, target, delta, min, max);
            prop_assert_eq!((c.value(), c.enabled()), (value, enabled));
            prop_assert_eq!(got, if enabled { value } else { 0.0 });
            prop_assert_eq!(got, c.coefficient());
            prop_assert!(min <= c.value() && c.value() <= max);
            // Monotone response: from the same state, a lower entropy never gives a lower value
            // or coefficient than a higher one.
            for other in [0.0, e / 2.0, target, e + 0.5] {
                let mut d = before;
                d.update(other).unwrap();
                if other <= e {
                    prop_assert!(d.value() >= c.value() && d.coefficient() >= c.coefficient());
                } else {
                    prop_assert!(d.value() <= c.value() && d.coefficient() <= c.coefficient());
                }
            }
        }
    }
}

#[test]
fn controller_at_the_target_falls_and_switches_the_bonus_off() {
    let mut c = AdaptiveEntropyController::new(0.01, 0.2, 0.002, 0.0, 0.5).unwrap();
    assert_eq!(c.update(0.2).unwrap(), 0.0); // e = target: not below (Skywork's `<`)
    assert!(!c.enabled());
    assert!((c.value() - 0.008).abs() < 1e-15);
    // Δ = 0 keeps the value but still switches the bonus.
    let mut fixed = AdaptiveEntropyController::new(0.01, 0.2, 0.0, 0.0, 0.5).unwrap();
    assert_eq!(fixed.update(0.1).unwrap(), 0.01);
    assert_eq!(fixed.update(0.3).unwrap(), 0.0);
    assert_eq!(fixed.value(), 0.01);
    // Clipped at both ends.
    let mut low = AdaptiveEntropyController::new(0.0005, 0.2, 0.001, 0.0, 0.5).unwrap();
    assert_eq!((low.update(1.0).unwrap(), low.value()), (0.0, 0.0));
    assert_eq!(
        AdaptiveEntropyController::skywork(),
        AdaptiveEntropyController::new(0.005, 0.2, 0.001, 0.0, 0.5).unwrap()
    );
}

#[test]
fn controller_drives_the_entropy_bonus_as_skywork_does() {
    // Skywork's actor: `pg_loss − entropy_coeff · entropy_loss_enabled · masked_mean(H)`.
    let h = Tensor::from_slice2(&[[0.4f64, 0.2, f64::NAN], [0.1, 0.3, 0.5]]);
    let mask = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
    let mut c = AdaptiveEntropyController::skywork();
    for e in [0.1, 0.15, 0.3, 0.05] {
        let loss = entropy_loss(&h, &mask, &EntropyConfig::bonus().with_coef(c.coefficient())).unwrap();
        let on = if c.enabled() { 1.0 } else { 0.0 };
        assert_close(&[scalar(&loss)], &[-c.value() * on * 1.5 / 5.0], 1e-15, &format!("bonus before e = {e}"));
        c.update(e).unwrap();
    }
}

#[test]
fn controller_matches_skyworks_entcontroller() {
    // Random entropy sequences around each target (LCG), the 7B settings and clipped variants.
    let mut next = uniform_stream(0x5e7_u64);
    let settings = [(0.005, 0.2, 0.001, 0.0, 0.5), (0.45, 0.6, 0.02, 0.0, 0.5), (0.02, 0.3, 0.01, 0.01, 0.05)];
    let mut calls = Vec::new();
    let mut sequences = Vec::new();
    for (init, target, delta, min, max) in settings {
        let entropies: Vec<f64> = (0..60).map(|_| target * (0.4 + 1.2 * next())).collect();
        calls.push(json!({"fn": "skywork.ent_controller", "args": {"init": init, "target": target, "delta": delta,
            "min_coef": min, "max_coef": max, "entropies": entropies}}));
        sequences.push(entropies);
    }
    let Some(results) = peer(&calls) else { return };
    for (((init, target, delta, min, max), entropies), r) in settings.iter().zip(&sequences).zip(&results) {
        let mut c = AdaptiveEntropyController::new(*init, *target, *delta, *min, *max).unwrap();
        let (mut values, mut enabled, mut realised) = (vec![], vec![], vec![]);
        for e in entropies {
            realised.push(c.update(*e).unwrap());
            values.push(c.value());
            enabled.push(if c.enabled() { 1.0 } else { 0.0 });
        }
        // The same operations in the same order on IEEE doubles; 1e-15 for the last bit, which
        // serde_json's default float parser may round differently from Python's printing.
        assert_close(&values, &json_f64(&r["values"]), 1e-15, "coefficient");
        assert_close(&enabled, &json_f64(&r["enabled"]), 0.0, "enabled");
        assert_close(&realised, &json_f64(&r["realised"]), 1e-15, "value · enabled");
        assert!(enabled.contains(&0.0) && enabled.contains(&1.0), "both sides of the target visited");
    }
}

#[test]
fn controller_errors_name_the_argument_and_keep_the_state() {
    for ((init, target, delta, min, max), name) in [
        ((0.6, 0.2, 0.001, 0.0, 0.5), "init"),
        ((-0.1, 0.2, 0.001, -0.2, 0.5), "min"),
        ((0.1, f64::NAN, 0.001, 0.0, 0.5), "target"),
        ((0.1, 0.2, -0.001, 0.0, 0.5), "delta"),
        ((0.1, 0.2, f64::INFINITY, 0.0, 0.5), "delta"),
        ((0.1, 0.2, 0.001, 0.0, f64::INFINITY), "max"),
        ((0.1, 0.2, 0.001, 0.6, 0.5), "min"),
        ((f64::NAN, 0.2, 0.001, 0.0, 0.5), "init"),
    ] {
        let e = AdaptiveEntropyController::new(init, target, delta, min, max).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument, .. } if argument == name), "{name}: {e}");
    }
    let mut c = AdaptiveEntropyController::skywork();
    for bad in [f64::NAN, f64::INFINITY, -0.5] {
        let e = c.update(bad).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument: "entropy", .. }), "{e}");
        assert_eq!(c, AdaptiveEntropyController::skywork());
    }
    // Rounding below 0 (a mean of log-probs up to the tolerance above 0) is an entropy of 0.
    assert!(c.update(-1e-4).is_ok());
}

// ---------------------------------------------------------------------------------------------
// CHORD: the schedule μ

#[test]
fn chord_mu_matches_trinitys_schedule() {
    let settings =
        [(0u64, 0u64, 0.1, 0.1), (200, 400, 0.5, 0.02), (0, 200, 0.9, 0.05), (10, 0, 0.3, 0.7), (7, 3, 0.2, 0.6)];
    let steps: Vec<u64> = (0..700).step_by(7).chain([0, 1, 9, 10, 11, 199, 200, 201, 599, 600, 601]).collect();
    let calls: Vec<Value> = settings
        .iter()
        .map(|(w, d, p, v)| json!({"fn": "trinity.mu_schedule", "args": {"steps": steps, "warmup": w, "decay": d, "peak": p, "valley": v}}))
        .collect();
    let Some(results) = peer(&calls) else { return };
    for ((w, d, p, v), r) in settings.iter().zip(&results) {
        let got: Vec<f64> = steps.iter().map(|s| chord_mu(*s, *w, *d, *p, *v).unwrap()).collect();
        assert_close(&got, &json_f64(&r["values"]), 1e-15, &format!("μ({w}, {d}, {p}, {v})"));
    }
}

proptest! {
    #[test]
    fn chord_mu_is_continuous_and_bounded(warmup in 0u64..300, decay in 0u64..300, peak in 0.0f64..=1.0, valley in 0.0f64..=1.0, step in 0u64..1000) {
        let mu = chord_mu(step, warmup, decay, peak, valley).unwrap();
        prop_assert!((0.0..=1.0).contains(&mu));
        if step >= warmup {
            prop_assert!(mu >= peak.min(valley) - 1e-15 && mu <= peak.max(valley) + 1e-15);
        } else {
            prop_assert!(mu <= peak);
        }
        // The phases join: the peak at the end of the warm-up (when there is a decay), the valley
        // at the end of the decay.
        if decay > 0 {
            prop_assert!((chord_mu(warmup, warmup, decay, peak, valley).unwrap() - peak).abs() < 1e-15);
        }
        prop_assert_eq!(chord_mu(warmup + decay, warmup, decay, peak, valley).unwrap(), valley);
    }
}

#[test]
fn chord_mu_refuses_weights_outside_the_unit_interval() {
    for (peak, valley, name) in
        [(1.5, 0.1, "peak"), (f64::NAN, 0.1, "peak"), (0.5, -0.1, "valley"), (0.5, f64::INFINITY, "valley")]
    {
        let e = chord_mu(3, 2, 2, peak, valley).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument, .. } if argument == name), "{name}: {e}");
    }
    assert_eq!(chord_mu(u64::MAX, 1, u64::MAX, 0.5, 0.2).unwrap(), 0.2); // no overflow of warmup + decay
}

// ---------------------------------------------------------------------------------------------
// CHORD: the SFT-φ loss

fn weight_of(w: SftWeight, p: f64) -> (f64, f64) {
    // (w, dw/dlog π)
    match w {
        SftWeight::Uniform => (1.0, 0.0),
        SftWeight::Phi => (p * (1.0 - p), p - 2.0 * p * p),
        SftWeight::Probability => (p, p),
        other => unreachable!("{other:?}"),
    }
}

/// The SFT-φ loss by its formula: value and the documented (stop-gradient) gradient.
fn ref_sft(b: &TokenBatch, cfg: &SftPhiConfig, global: Option<(f64, f64)>) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.aggregation, global);
    let ln_c = cfg.cutoff_prob.ln();
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        for (t, _) in row.iter().enumerate().filter(|(_, m)| **m) {
            let lp = b.logp[i][t];
            let (w, _) = weight_of(cfg.weight, lp.exp());
            let above = cfg.cutoff_prob < 1.0 && lp > ln_c;
            value += al[i] * -w * if above { ln_c } else { lp };
            grad[i][t] = if above { 0.0 } else { -al[i] * w };
        }
    }
    (value, grad.concat())
}

fn sft_configs() -> Vec<SftPhiConfig> {
    vec![
        SftPhiConfig::chord_phi(),
        SftPhiConfig::sft(),
        SftPhiConfig::sft_is(),
        SftPhiConfig::chord_phi().with_cutoff_prob(0.5),
        SftPhiConfig::sft().with_cutoff_prob(0.3).with_aggregation(AggregationMode::SeqMeanTokenMean),
        SftPhiConfig::sft_is().with_aggregation(AggregationMode::DrGrpo { length: 8.0 }),
    ]
}

fn run_sft(b: &TokenBatch, cfg: &SftPhiConfig, padding: f64) -> (f64, Vec<f64>) {
    value_and_grad(b, padding, &|lp, _, _, m| sft_phi_loss(lp, m, cfg).unwrap())
}

fn batch() -> impl Strategy<Value = TokenBatch> {
    token_batch(1.0, (-2.0f64..2.0).boxed())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn sft_phi_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in sft_configs() {
            assert_matches_reference(&b, &run_sft(&b, &cfg, f64::NAN), &ref_sft(&b, &cfg, None), &format!("{cfg:?}"));
        }
    }

    #[test]
    fn sft_phi_split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        for cfg in [SftPhiConfig::chord_phi(), SftPhiConfig::sft_is().with_cutoff_prob(0.4)] {
            assert_split_invariant(&b, split, "SFT-φ", &|lp, _, _, m, mode, norm| {
                let cfg = cfg.with_aggregation(mode);
                match norm {
                    Some(n) => sft_phi_loss_output(lp, m, &cfg, n).map(|o| o.loss),
                    None => sft_phi_loss(lp, m, &cfg),
                }
            });
        }
    }

    #[test]
    fn sft_phi_terms_reaggregate_to_the_loss_and_weights_are_bounded(b in batch()) {
        let (lp, _, _, m) = b.tensors(f64::NAN);
        for cfg in sft_configs() {
            let norm = Normalizer::local();
            let out = sft_phi_loss_output(&lp, &m, &cfg, &norm).unwrap();
            let again = topr_loss::aggregate(&out.terms, &m, cfg.aggregation, &norm).unwrap();
            assert_close(&[scalar(&again)], &[scalar(&out.loss)], 1e-12, "terms");
            let d = out.diagnostics.read().unwrap();
            let bound = if cfg.weight == SftWeight::Phi { 0.25 } else { 1.0 };
            prop_assert!(d.weight_mean >= 0.0 && d.weight_mean <= bound + 1e-15 && d.prob_mean <= 1.0);
            prop_assert!((0.0..=1.0).contains(&d.cutoff_fraction));
        }
    }
}

#[test]
fn sft_phi_gradient_is_the_documented_one_by_finite_differences() {
    // w is a stop-gradient weight: the value's derivative is −α (w + min(log π, ln c) · dw/dlog π)
    // (with the clamp's own derivative, 0 above the cutoff); the gradient is its first part,
    // −α w, as documented. Plain SFT (dw = 0) is checked without correction.
    let b = fixed_token_batch();
    for cfg in sft_configs() {
        let (_, g) = run_sft(&b, &cfg, 0.0);
        let t = b.mask[0].len();
        let fd = finite_difference(&b.logp.concat(), 1e-6, |x| {
            let bb = TokenBatch { logp: x.chunks(t).map(<[f64]>::to_vec).collect(), ..b.clone() };
            let (lp, _, _, m) = bb.tensors(0.0);
            scalar(&sft_phi_loss(&lp, &m, &cfg).unwrap())
        });
        let al = ref_alpha(&b.mask, cfg.aggregation, None);
        let ln_c = cfg.cutoff_prob.ln();
        let mut want = Vec::new();
        for (i, row) in b.mask.iter().enumerate() {
            for (k, real) in row.iter().enumerate() {
                let lp = b.logp[i][k];
                let (_, dw) = weight_of(cfg.weight, lp.exp());
                let clamped = if cfg.cutoff_prob < 1.0 { lp.min(ln_c) } else { lp };
                want.push(if *real { fd[i * t + k] + al[i] * clamped * dw } else { 0.0 });
            }
        }
        assert_close(&g, &want, 1e-6, &format!("{cfg:?} finite differences"));
    }
}

#[test]
fn sft_phi_extreme_and_half_precision_inputs_compute_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        let lp =
            Tensor::from_slice2(&[[-300.0f64, 0.0, -1e-3], [-20.0, -0.5, 5e-4]]).to_kind(kind).set_requires_grad(true);
        let m = Tensor::from_slice2(&[[1i64, 1, 1], [1, 1, 1]]);
        for cfg in sft_configs() {
            let loss = sft_phi_loss(&lp, &m, &cfg).unwrap();
            let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
            assert_eq!(loss.kind(), want, "{kind:?}");
            assert!(scalar(&loss).is_finite(), "{kind:?} {cfg:?}");
            let g = Tensor::run_backward(&[&loss], &[&lp], false, false);
            assert!(vec1(&g[0].to_kind(Kind::Double)).iter().all(|g| g.is_finite()), "{kind:?}");
        }
        // Unchecked log-probs above 0 still give p ≤ 1 (the exponential is of min(log π, 0)).
        let above = Tensor::from_slice2(&[[50.0f64, -1.0]]).to_kind(kind);
        let shapes = SftPhiConfig::chord_phi().with_checks(Checks::Shapes);
        let d = sft_phi_loss_output(&above, &m.narrow(0, 0, 1).narrow(1, 0, 2), &shapes, &Normalizer::local()).unwrap();
        let d = d.diagnostics.read().unwrap();
        assert!(d.prob_mean <= 1.0 && d.weight_mean.is_finite(), "{kind:?} {d:?}");
    }
}

#[test]
fn sft_phi_bad_inputs_are_errors_naming_the_argument() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    for c in [0.0, -0.5, 1.5, f64::NAN] {
        let e = sft_phi_loss(&lp, &m, &SftPhiConfig::chord_phi().with_cutoff_prob(c)).unwrap_err();
        assert!(matches!(e, LossError::InvalidConfig { field: "cutoff_prob", .. }), "{c}: {e}");
    }
    let e = sft_phi_loss(&Tensor::new(), &m, &SftPhiConfig::chord_phi()).unwrap_err();
    assert_eq!(e, LossError::UnsupportedTensor { argument: "logp", what: "undefined" });
    let e = sft_phi_loss(&lp, &Tensor::from_slice(&[true, true]), &SftPhiConfig::chord_phi()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e}");
    let e = sft_phi_loss(&Tensor::from_slice2(&[[0.5f64, -1.0]]), &m, &SftPhiConfig::chord_phi()).unwrap_err();
    assert!(matches!(e, LossError::PositiveLogProb { argument: "logp", .. }), "{e}");
    let e = sft_phi_loss(&Tensor::from_slice2(&[[f64::NAN, -1.0]]), &m, &SftPhiConfig::chord_phi()).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp", .. }), "{e}");
    let e = sft_phi_loss(&lp, &m.logical_not(), &SftPhiConfig::chord_phi()).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "mask", .. }), "{e}");
    // With the step's count, an empty micro-batch weighs 0.
    let empty = sft_phi_loss_output(&lp, &m.logical_not(), &SftPhiConfig::chord_phi(), &Normalizer::tokens(4.0));
    assert_eq!(scalar(&empty.unwrap().loss), 0.0);
}

/// Random batches (LCG): log-probs in `(−3, −0.05)`, log-ratios to the old policy in ±`spread`, each
/// row's first token real, weights (advantages) in `(−2, 2)`.
fn random_batches(seed: u64, n: usize, spread: f64) -> Vec<TokenBatch> {
    let mut next = uniform_stream(seed);
    (0..n)
        .map(|k| {
            let (rows, t) = (3 + k % 3, 3 + k % 4);
            let mut logp: Vec<Vec<f64>> = (0..rows).map(|_| (0..t).map(|_| -0.05 - 3.0 * next()).collect()).collect();
            let mut other: Vec<Vec<f64>> =
                logp.iter().map(|r| r.iter().map(|x| x - spread * (2.0 * next() - 1.0)).collect()).collect();
            non_positive_rows(&mut logp, &mut other);
            let mask: Vec<Vec<bool>> = (0..rows).map(|_| (0..t).map(|j| j == 0 || next() < 0.75).collect()).collect();
            let weights = (0..rows).map(|_| 4.0 * next() - 2.0).collect();
            TokenBatch { logp, other, mask, weights }
        })
        .collect()
}

fn mask01(b: &TokenBatch) -> Vec<Vec<f64>> {
    b.mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect()
}

#[test]
fn sft_losses_match_trinitys_lines() {
    let batches = random_batches(0xc40d, 6, 0.0);
    let cases = [
        ("phi", SftWeight::Phi, 1.0),
        ("phi", SftWeight::Phi, 0.6),
        ("uniform", SftWeight::Uniform, 1.0),
        ("probability", SftWeight::Probability, 1.0),
    ];
    let mut calls = Vec::new();
    for b in &batches {
        for (name, _, cutoff) in cases {
            for token_level in [true, false] {
                calls.push(json!({"fn": "trinity.sft", "args": {"logp": b.logp, "mask": mask01(b), "weight": name,
                    "cutoff_prob": cutoff, "token_level": token_level}}));
            }
        }
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.iter();
    for b in &batches {
        for (name, weight, cutoff) in cases {
            for mode in [AggregationMode::TokenMean, AggregationMode::SeqMeanTokenMean] {
                let r = results.next().unwrap();
                let cfg = SftPhiConfig::chord_phi().with_weight(weight).with_cutoff_prob(cutoff).with_aggregation(mode);
                let got = run_sft(b, &cfg, 0.0);
                // Trinity's masked_mean divides by count + 1e-8.
                assert_close(&[got.0], &json_f64(&r["value"]), 1e-7, &format!("{name} {cutoff} {mode:?} value"));
                assert_close(&got.1, &json_f64(&r["grad"]), 1e-7, &format!("{name} {cutoff} {mode:?} grad"));
            }
        }
    }
}

#[test]
fn sft_with_an_empty_row_matches_trinitys_sequence_mean_over_every_row() {
    // Trinity's `use_token_level_loss=False` averages over all B rows, an empty one included:
    // `SeqMeanTokenMean` with the row count B as the normaliser's sequence count.
    let mut b = random_batches(0xe3, 1, 0.0).remove(0);
    b.mask[1] = vec![false; b.mask[1].len()];
    let call = json!({"fn": "trinity.sft", "args": {"logp": b.logp, "mask": mask01(&b), "weight": "phi", "cutoff_prob": 1.0, "token_level": false}});
    let Some(r) = peer(&[call]) else { return };
    let cfg = SftPhiConfig::chord_phi().with_aggregation(AggregationMode::SeqMeanTokenMean);
    let norm = Normalizer::sequences(b.mask.len() as f64);
    let got = value_and_grad(&b, f64::NAN, &|lp, _, _, m| sft_phi_loss_output(lp, m, &cfg, &norm).unwrap().loss);
    assert_close(&[got.0], &json_f64(&r[0]["value"]), 1e-7, "value");
    assert_close(&got.1, &json_f64(&r[0]["grad"]), 1e-7, "grad");
}

/// CHORD's mix by the crate's calls: PPO (Trinity's: ε = 0.2, dual clip 3) on the usual rows'
/// mask, SFT on the expert rows' mask (skipped without one), `(1 − μ) L_RL + μ L_SFT`.
fn crate_mix(
    b: &TokenBatch,
    expert: &[bool],
    mu: f64,
    sft: &SftPhiConfig,
    norms: Option<(&Normalizer, &Normalizer)>,
    lp: &Tensor,
) -> Tensor {
    let (_, old, adv, m) = b.tensors(f64::NAN);
    let e = Tensor::from_slice(expert);
    let usual_mask = m.logical_and(&e.logical_not().unsqueeze(1));
    let expert_mask = m.logical_and(&e.unsqueeze(1));
    let ppo = PpoConfig::ppo().with_dual_clip(Some(3.0));
    let local = Normalizer::local();
    let (nu, ne) = norms.unwrap_or((&local, &local));
    let rl = (expert.iter().any(|x| !x) || norms.is_some())
        .then(|| ppo_clip_loss_output(lp, &old, &adv, &usual_mask, &ppo, nu).unwrap().loss * (1.0 - mu));
    let sft = (expert.iter().any(|x| *x) || norms.is_some())
        .then(|| sft_phi_loss_output(lp, &expert_mask, sft, ne).unwrap().loss * mu);
    rl.into_iter().chain(sft).fold(lp.zeros_like().sum(Kind::Double), |total, term| total + term)
}

#[test]
fn chord_mix_matches_trinitys_mix_chord() {
    let batches = random_batches(0x3c0d, 6, 0.8);
    let mut flags = Vec::new();
    let mut calls = Vec::new();
    for (k, b) in batches.iter().enumerate() {
        let rows = b.mask.len();
        // Mixed rows, then all usual, then all expert.
        let expert: Vec<bool> = (0..rows)
            .map(|i| match k % 3 {
                0 => i % 2 == 1,
                1 => false,
                _ => k == 5 || i == 0,
            })
            .collect();
        let (n_usual, n_expert) = (expert.iter().filter(|x| !**x).count(), expert.iter().filter(|x| **x).count());
        for (step, enable_phi) in [(300u64, true), (50, false)] {
            calls.push(json!({"fn": "trinity.mix_chord", "args": {"logp": b.logp, "logp_old": b.other, "mask": mask01(b),
                "advantages": b.weights, "expert": expert, "step": step, "warmup": 200, "decay": 400, "peak": 0.5, "valley": 0.02,
                "enable_phi": enable_phi, "clip": 0.2, "gradient_accumulation": 1,
                "train_batch_size_usual": n_usual.max(1), "train_batch_size_expert": n_expert.max(1)}}));
        }
        flags.push(expert);
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.iter();
    for (b, expert) in batches.iter().zip(&flags) {
        for (step, sft) in [(300u64, SftPhiConfig::chord_phi()), (50, SftPhiConfig::sft())] {
            let r = results.next().unwrap();
            let mu = chord_mu(step, 200, 400, 0.5, 0.02).unwrap();
            assert_close(&[mu], &json_f64(&r["mu"]), 1e-15, "μ");
            let got = value_and_grad(b, f64::NAN, &|lp, _, _, _| crate_mix(b, expert, mu, &sft, None, lp));
            assert_close(&[got.0], &json_f64(&r["value"]), 1e-7, &format!("{expert:?} step {step} value"));
            assert_close(&got.1, &json_f64(&r["grad"]), 1e-7, &format!("{expert:?} step {step} grad"));
        }
    }
}

#[test]
fn chord_mix_over_micro_batches_with_per_type_normalisers_matches_trinitys_rescaling() {
    // Two micro-batches whose rows are all full (as many tokens per row of each type): Trinity's
    // per-type rescaling (n_type · accumulation / train_batch_size_type, each micro-batch then
    // divided by the accumulation) equals the crate's per-type normalisers over the step.
    let mut b = random_batches(0x2b, 1, 0.6).remove(0);
    b.logp.extend(random_batches(0x2c, 1, 0.6).remove(0).logp); // 6 rows of 3 tokens
    b.other = b.logp.iter().map(|r| r.iter().map(|x| x - 0.1).collect()).collect();
    b.mask = vec![vec![true; b.logp[0].len()]; b.logp.len()];
    b.weights = (0..b.logp.len()).map(|i| if i % 2 == 0 { 1.0 } else { -0.5 }).collect();
    let rows = b.mask.len();
    let expert: Vec<bool> = (0..rows).map(|i| i % 3 == 2).collect();
    let half = rows / 2;
    let parts = [(0, half), (half, rows - half)];
    let (n_usual, n_expert) = (expert.iter().filter(|x| !**x).count(), expert.iter().filter(|x| **x).count());
    let part = |o: usize, k: usize| TokenBatch {
        logp: b.logp[o..o + k].to_vec(),
        other: b.other[o..o + k].to_vec(),
        mask: b.mask[o..o + k].to_vec(),
        weights: b.weights[o..o + k].to_vec(),
    };
    let calls: Vec<Value> = parts
        .iter()
        .map(|&(o, k)| {
            let p = part(o, k);
            json!({"fn": "trinity.mix_chord", "args": {"logp": p.logp, "logp_old": p.other, "mask": mask01(&p),
                "advantages": p.weights, "expert": &expert[o..o + k], "step": 300, "warmup": 200, "decay": 400, "peak": 0.5,
                "valley": 0.02, "enable_phi": true, "clip": 0.2, "gradient_accumulation": 2,
                "train_batch_size_usual": n_usual, "train_batch_size_expert": n_expert}})
        })
        .collect();
    let Some(results) = peer(&calls) else { return };
    let trinity: f64 = results.iter().map(|r| json_f64(&r["value"])[0] / 2.0).sum();
    let e = Tensor::from_slice(&expert);
    let (_, _, _, m) = b.tensors(0.0);
    let nu = Normalizer::from_masks(&[&m.logical_and(&e.logical_not().unsqueeze(1))]).unwrap();
    let ne = Normalizer::from_masks(&[&m.logical_and(&e.unsqueeze(1))]).unwrap();
    let mu = chord_mu(300, 200, 400, 0.5, 0.02).unwrap();
    let ours: f64 = parts
        .iter()
        .map(|&(o, k)| {
            let p = part(o, k);
            let (lp, _, _, _) = p.tensors(0.0);
            scalar(&crate_mix(&p, &expert[o..o + k], mu, &SftPhiConfig::chord_phi(), Some((&nu, &ne)), &lp))
        })
        .sum();
    assert_close(&[ours], &[trinity], 1e-7, "rescaled micro-batches");
}

// ---------------------------------------------------------------------------------------------
// VAPO: the NLL of positive completions

/// The positive flags of a batch: the completions with a positive weight (reward).
fn positives(b: &TokenBatch) -> Vec<bool> {
    b.weights.iter().map(|w| *w > 0.0).collect()
}

/// The mask of the positive completions' tokens.
fn kept_mask(b: &TokenBatch) -> Vec<Vec<bool>> {
    b.mask.iter().zip(positives(b)).map(|(r, p)| r.iter().map(|m| *m && p).collect()).collect()
}

/// `coef · aggregate(−log π, mask ∧ positive)` by its formula, 0 without a positive token.
fn ref_nll(b: &TokenBatch, cfg: &PositiveNllConfig, global: Option<(f64, f64)>) -> (f64, Vec<f64>) {
    let kept = kept_mask(b);
    let none = kept.iter().flatten().all(|k| !k);
    let al = if none && global.is_none() { vec![0.0; kept.len()] } else { ref_alpha(&kept, cfg.aggregation, global) };
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; kept[0].len()]; kept.len()];
    for (i, row) in kept.iter().enumerate() {
        for (t, _) in row.iter().enumerate().filter(|(_, k)| **k) {
            value += al[i] * -cfg.coef * b.logp[i][t];
            grad[i][t] = -al[i] * cfg.coef;
        }
    }
    (value, grad.concat())
}

fn nll_configs() -> Vec<PositiveNllConfig> {
    vec![
        PositiveNllConfig::vapo(),
        PositiveNllConfig::vapo().with_coef(1.0).with_aggregation(AggregationMode::SeqMeanTokenMean),
        PositiveNllConfig::vapo().with_coef(-0.3).with_aggregation(AggregationMode::DrGrpo { length: 6.0 }),
        PositiveNllConfig::vapo().with_aggregation(AggregationMode::TokenSum),
    ]
}

fn run_nll(b: &TokenBatch, cfg: &PositiveNllConfig, padding: f64, norm: &Normalizer) -> (f64, Vec<f64>) {
    let positive = Tensor::from_slice(&positives(b));
    value_and_grad(b, padding, &|lp, _, _, m| positive_nll_loss_output(lp, m, &positive, cfg, norm).unwrap().loss)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn positive_nll_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in nll_configs() {
            let want = ref_nll(&b, &cfg, None);
            assert_matches_reference(&b, &run_nll(&b, &cfg, f64::NAN, &Normalizer::local()), &want, &format!("{cfg:?}"));
            let (lp, _, _, m) = b.tensors(f64::NAN);
            let plain = positive_nll_loss(&lp, &m, &Tensor::from_slice(&positives(&b)), &cfg).unwrap();
            assert_close(&[scalar(&plain)], &[want.0], 1e-12, "plain call");
        }
    }

    #[test]
    fn positive_nll_split_with_a_normaliser_of_positive_tokens_is_exact(b in batch(), split in 1usize..5) {
        prop_assume!(b.mask.len() > 1);
        let s = split.min(b.mask.len() - 1);
        let (lp, _, _, m) = b.tensors(f64::NAN);
        let positive = Tensor::from_slice(&positives(&b));
        let kept = m.logical_and(&positive.unsqueeze(1));
        let norm = Normalizer::from_masks(&[&kept]).unwrap();
        let counts = (norm.tokens.unwrap(), norm.sequences.unwrap());
        for mode in ALL_MODES {
            let cfg = PositiveNllConfig::vapo().with_aggregation(mode);
            let want = if counts.0 > 0.0 { ref_nll(&b, &cfg, Some(counts)) } else { ref_nll(&b, &cfg, None) };
            let full_lp = leaf(&lp);
            let full = positive_nll_loss_output(&full_lp, &m, &positive, &cfg, &norm);
            // A step without a positive token has zero counts, which no normaliser may hold.
            let Ok(full) = full else {
                prop_assert!(counts.0 == 0.0, "{:?}", full.map(|_| ()));
                continue;
            };
            full.loss.backward();
            let parts_lp = leaf(&lp);
            let part = |o: usize, k: usize| {
                let (o, k) = (o as i64, k as i64);
                positive_nll_loss_output(&parts_lp.narrow(0, o, k), &m.narrow(0, o, k), &positive.narrow(0, o, k), &cfg, &norm).unwrap().loss
            };
            let total = part(0, s) + part(s, b.mask.len() - s);
            total.backward();
            assert_close(&[scalar(&total), scalar(&full.loss)], &[want.0, want.0], 1e-12, &format!("{mode:?} split value"));
            assert_close(&vec1(&parts_lp.grad()), &want.1, 1e-12, &format!("{mode:?} split grad"));
            assert_close(&vec1(&full_lp.grad()), &want.1, 1e-12, &format!("{mode:?} grad"));
        }
    }
}

#[test]
fn positive_nll_without_a_positive_token_is_zero_with_zero_gradient() {
    let none = TokenBatch { weights: vec![-1.0, 0.0, -0.5], ..fixed_token_batch() };
    let mut empty = TokenBatch { weights: vec![-1.0, 1.0, -0.5], ..fixed_token_batch() };
    empty.mask[1] = vec![false; 3]; // the one positive completion has no token
    for b in [none, empty] {
        for checks in [Checks::Full, Checks::Shapes] {
            let (lp, _, _, m) = b.tensors(f64::NAN);
            let lp = leaf(&lp);
            let cfg = PositiveNllConfig::vapo().with_checks(checks);
            let positive = Tensor::from_slice(&positives(&b));
            let out = positive_nll_loss_output(&lp, &m, &positive, &cfg, &Normalizer::local()).unwrap();
            assert_eq!(scalar(&out.loss), 0.0, "{checks:?} {:?}", b.weights);
            let g = Tensor::run_backward(&[&out.loss], &[&lp], false, false);
            assert!(vec1(&g[0]).iter().all(|g| *g == 0.0), "{checks:?}");
            let d = out.diagnostics.read().unwrap();
            assert_eq!((d.sequences, d.tokens, d.nll_mean), (0, 0, 0.0));
        }
    }
}

#[test]
fn positive_nll_gradient_matches_finite_differences() {
    let b = fixed_token_batch(); // weights 1, −1, −0.5: one positive completion
    for cfg in nll_configs() {
        let (_, g) = run_nll(&b, &cfg, 0.0, &Normalizer::local());
        let positive = Tensor::from_slice(&positives(&b));
        let loss = |lp: &Tensor, _: &Tensor, _: &Tensor, m: &Tensor| positive_nll_loss(lp, m, &positive, &cfg).unwrap();
        assert_gradient_matches_finite_differences(&b, &g, &loss, &format!("{cfg:?}"));
    }
}

#[test]
fn positive_nll_matches_cosmos_rls_line_and_the_papers_formula() {
    let mut batches = random_batches(0x7a90, 6, 0.0);
    batches[2].weights = vec![-1.0; batches[2].weights.len()]; // no positive completion
    let mut calls = Vec::new();
    for b in &batches {
        calls.push(json!({"fn": "cosmos.positive_nll", "args": {"logp": b.logp, "mask": mask01(b), "rewards": b.weights, "coef": 0.1}}));
        calls.push(json!({"fn": "vapo.nll", "args": {"logp": b.logp, "mask": mask01(b), "positive": positives(b)}}));
    }
    let Some(results) = peer(&calls) else { return };
    for (b, r) in batches.iter().zip(results.chunks(2)) {
        let vapo = run_nll(b, &PositiveNllConfig::vapo(), f64::NAN, &Normalizer::local());
        assert_close(&[vapo.0], &json_f64(&r[0]["value"]), 1e-12, "cosmos-rl value");
        assert_close(&vapo.1, &json_f64(&r[0]["grad"]), 1e-12, "cosmos-rl grad");
        let unscaled = run_nll(b, &PositiveNllConfig::vapo().with_coef(1.0), 0.0, &Normalizer::local());
        assert_close(&[unscaled.0], &json_f64(&r[1]["value"]), 1e-12, "paper value");
        assert_close(&unscaled.1, &json_f64(&r[1]["grad"]), 1e-12, "paper grad");
    }
}

#[test]
fn positive_nll_extreme_and_half_precision_inputs_compute_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        let lp =
            Tensor::from_slice2(&[[-300.0f64, 0.0, -3.0], [-1e4, -2.0, -1.0]]).to_kind(kind).set_requires_grad(true);
        let m = Tensor::from_slice2(&[[1i64, 1, 1], [1, 1, 0]]);
        let positive = Tensor::from_slice(&[1i64, 0]);
        let loss = positive_nll_loss(&lp, &m, &positive, &PositiveNllConfig::vapo()).unwrap();
        let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        assert_eq!(loss.kind(), want, "{kind:?}");
        assert_close(&[scalar(&loss)], &[0.1 * 303.0 / 3.0], 1e-3, &format!("{kind:?}"));
        let g = Tensor::run_backward(&[&loss], &[&lp], false, false);
        assert!(vec1(&g[0].to_kind(Kind::Double)).iter().all(|g| g.is_finite()), "{kind:?}");
    }
}

#[test]
fn positive_nll_bad_inputs_are_errors_naming_the_argument() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0], [-1.0, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true], [true, false]]);
    let pos = Tensor::from_slice(&[true, false]);
    let cfg = PositiveNllConfig::vapo();
    let e = positive_nll_loss(&lp, &m, &Tensor::from_slice(&[true]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "positive", .. }), "{e}");
    let e = positive_nll_loss(&lp, &m, &Tensor::from_slice2(&[[true], [false]]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "positive", .. }), "{e}");
    let e = positive_nll_loss(&lp, &m, &Tensor::from_slice(&[0.5f32, 1.0]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "positive", .. }), "{e}");
    let e = positive_nll_loss(&lp, &m, &Tensor::new(), &cfg).unwrap_err();
    assert_eq!(e, LossError::UnsupportedTensor { argument: "positive", what: "undefined" });
    let e = positive_nll_loss(&lp, &m, &pos, &cfg.with_coef(f64::INFINITY)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "coef", .. }), "{e}");
    let bad_len = cfg.with_aggregation(AggregationMode::TokenSumNorm { length: f64::NAN });
    let e = positive_nll_loss(&lp, &m, &Tensor::from_slice(&[false, false]), &bad_len).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "AggregationMode::TokenSumNorm::length", .. }), "{e}");
    let e = positive_nll_loss(&Tensor::from_slice2(&[[0.5f64, -1.0], [-1.0, -1.0]]), &m, &pos, &cfg).unwrap_err();
    assert!(matches!(e, LossError::PositiveLogProb { argument: "logp", .. }), "{e}");
    // A non-finite log-prob of a real token is refused even in a negative completion.
    let e = positive_nll_loss(&Tensor::from_slice2(&[[-1.0f64, -1.0], [f64::NAN, -1.0]]), &m, &pos, &cfg).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp", .. }), "{e}");
    let e = positive_nll_loss(&Tensor::zeros([0, 2], (Kind::Double, tch::Device::Cpu)), &m, &pos, &cfg).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "logp", .. }), "{e}");
    let norm = Normalizer::global(BatchCounts { tokens: 0.0, sequences: 1.0 });
    let e = positive_nll_loss_output(&lp, &m, &pos, &cfg, &norm).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "Normalizer::tokens", .. }), "{e}");
}

#[test]
fn vapos_loss_is_ppo_plus_the_positive_nll() {
    // L = L_PPO (DAPO's clip, token-mean over all tokens) + 0.1 · L_NLL (token-mean over the
    // positive tokens): the gradients add.
    let b = random_batches(0x7a, 1, 0.5).remove(0);
    let (lp, old, adv, m) = b.tensors(f64::NAN);
    let positive = Tensor::from_slice(&positives(&b));
    let total = leaf(&lp);
    (ppo_clip_loss(&total, &old, &adv, &m, &PpoConfig::dapo()).unwrap()
        + positive_nll_loss(&total, &m, &positive, &PositiveNllConfig::vapo()).unwrap())
    .backward();
    let ppo_only = leaf(&lp);
    ppo_clip_loss(&ppo_only, &old, &adv, &m, &PpoConfig::dapo()).unwrap().backward();
    let (_, nll_grad) = ref_nll(&b, &PositiveNllConfig::vapo(), None);
    let want: Vec<f64> = vec1(&ppo_only.grad()).iter().zip(&nll_grad).map(|(a, b)| a + b).collect();
    assert_close(&vec1(&total.grad()), &want, 1e-12, "L_PPO + μ L_NLL");
}
