//! DPPO against a scalar reference of the paper's trust regions (binary TV and KL), padding and
//! split invariance, on-policy equality with the policy gradient, extremes and half precision,
//! and verl's own `dppo_tv` / `dppo_kl` (values and gradients).
//!
//! No finite-difference test: the surrogate's weight `sg(min(r, C))` and mask depend on `log π`
//! in the forward pass but not in the gradient (stop-gradient), so the value's derivative is not
//! the loss's gradient by design; the gradient is checked against its definition instead.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, DppoConfig, DppoDivergence, LossError, Normalizer, PpoConfig, dppo_loss, dppo_loss_output,
    ppo_clip_loss,
};

type Batch = TokenBatch;

fn batch() -> impl Strategy<Value = Batch> {
    token_batch(1.5, (-2.0f64..2.0).boxed())
}

/// Whether the token stays in the trust region, from the paper's definitions.
fn ref_keep(lp: f64, lq: f64, a: f64, cfg: &DppoConfig) -> bool {
    let (p, q) = (lp.exp(), lq.exp());
    match cfg.divergence {
        DppoDivergence::TotalVariation => {
            if a > 0.0 {
                p - q <= cfg.delta_high
            } else {
                p - q >= -cfg.delta_low
            }
        }
        _ => {
            let d = q * (lq - lp) + (1.0 - q) * ((1.0 - q + 1e-8).ln() - (1.0 - p + 1e-8).ln());
            if a > 0.0 { d <= cfg.delta_high || p <= q } else { d <= cfg.delta_low || p >= q }
        }
    }
}

/// DPPO's value and d/dlog π for one token.
fn ref_token(lp: f64, lq: f64, a: f64, cfg: &DppoConfig) -> (f64, f64) {
    let r = (lp - lq).clamp(-cfg.max_log_ratio, cfg.max_log_ratio).exp();
    let w = r.min(cfg.max_weight) * f64::from(u8::from(ref_keep(lp, lq, a, cfg)));
    (-a * w * lp, -a * w)
}

fn ref_loss(b: &Batch, cfg: &DppoConfig, global: Option<(f64, f64)>) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.aggregation, global);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        for (t, _) in row.iter().enumerate().filter(|(_, m)| **m) {
            let (v, g) = ref_token(b.logp[i][t], b.other[i][t], b.weights[i], cfg);
            value += al[i] * v;
            grad[i][t] = al[i] * g;
        }
    }
    (value, grad.concat())
}

fn configs() -> Vec<DppoConfig> {
    vec![
        DppoConfig::tv(),
        DppoConfig::binary_kl(),
        DppoConfig::tv()
            .with_deltas(0.05, 0.3)
            .with_max_weight(1.5)
            .with_aggregation(AggregationMode::SeqMeanTokenMean),
        DppoConfig::binary_kl().with_deltas(0.2, 0.01).with_aggregation(AggregationMode::SeqMeanTokenSum),
        DppoConfig::tv().with_max_log_ratio(0.5).with_aggregation(AggregationMode::DrGrpo { length: 9.0 }),
    ]
}

fn run(b: &Batch, cfg: &DppoConfig, padding: f64) -> (f64, Vec<f64>) {
    value_and_grad(b, padding, &|lp, old, adv, m| dppo_loss(lp, old, adv, m, cfg).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn dppo_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in configs() {
            assert_matches_reference(&b, &run(&b, &cfg, f64::NAN), &ref_loss(&b, &cfg, None), &format!("{cfg:?}"));
        }
    }

    #[test]
    fn dppo_on_policy_is_the_policy_gradient(b in batch(), kl in proptest::bool::ANY) {
        // p = q: every token is in the region, r = 1, so DPPO's gradient is PPO's on-policy one.
        let on = Batch { other: b.logp.clone(), ..b.clone() };
        let mode = AggregationMode::SeqMeanTokenMean;
        let cfg = if kl { DppoConfig::binary_kl() } else { DppoConfig::tv() };
        let (_, g) = run(&on, &cfg.with_aggregation(mode), 0.0);
        let (lp, old, adv, m) = on.tensors(0.0);
        let lp = leaf(&lp);
        ppo_clip_loss(&lp, &old, &adv, &m, &PpoConfig::ppo().with_aggregation(mode)).unwrap().backward();
        assert_close(&g, &vec1(&lp.grad()), 1e-12, "on-policy DPPO vs PPO");
    }

    #[test]
    fn dppo_split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        assert_split_invariant(&b, split, "DPPO", &|lp, old, adv, m, mode, norm| {
            let cfg = DppoConfig::binary_kl().with_aggregation(mode);
            match norm {
                Some(n) => dppo_loss_output(lp, old, adv, m, &cfg, n).map(|o| o.loss),
                None => dppo_loss(lp, old, adv, m, &cfg),
            }
        });
    }

    /// The diagnostics count what the reference says: the share of real tokens outside the
    /// region, and of those inside whose weight was truncated.
    #[test]
    fn dppo_diagnostics_count_the_region_and_the_truncation(b in batch()) {
        let (lp, old, adv, m) = b.tensors(f64::NAN);
        let cfg = DppoConfig::tv().with_max_weight(1.2);
        let d = dppo_loss_output(&lp, &old, &adv, &m, &cfg, &Normalizer::local()).unwrap().diagnostics.read().unwrap();
        let (mut n, mut outside, mut truncated) = (0.0, 0.0, 0.0);
        for (i, row) in b.mask.iter().enumerate() {
            for (t, _) in row.iter().enumerate().filter(|(_, m)| **m) {
                let (l, q) = (b.logp[i][t], b.other[i][t]);
                let keep = ref_keep(l, q, b.weights[i], &cfg);
                n += 1.0;
                outside += f64::from(u8::from(!keep));
                truncated += f64::from(u8::from(keep && (l - q).exp() > 1.2));
            }
        }
        prop_assert_eq!(d.samples as f64, n);
        assert_close(&[d.clip_fraction, d.dual_clip_fraction], &[outside / n, truncated / n], 1e-12, "fractions");
    }
}

#[test]
fn extreme_and_half_precision_inputs_give_finite_results_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        for cfg in [DppoConfig::tv(), DppoConfig::binary_kl().with_max_weight(f64::INFINITY)] {
            let lp = Tensor::from_slice2(&[[-1.0e4f64, 0.0, -3.0, -20.0]]).to_kind(kind).set_requires_grad(true);
            let lq = Tensor::from_slice2(&[[0.0f64, -1.0e4, -3.0, 0.0]]).to_kind(kind);
            let m = Tensor::from_slice2(&[[1i64, 1, 1, 1]]);
            for a in [1.0f64, -1.0] {
                let loss = dppo_loss(&lp, &lq, &Tensor::from_slice(&[a]).to_kind(kind), &m, &cfg).unwrap();
                let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
                assert_eq!(loss.kind(), want, "{kind:?}");
                loss.backward();
                assert!(scalar(&loss).is_finite(), "{kind:?} {cfg:?} A = {a}");
                // Without truncation a weight of e^20 is beyond f16 (the gradient has `logp`'s
                // dtype): only the truncated config's gradient must fit every dtype.
                if cfg.max_weight.is_finite() || kind != Kind::Half {
                    assert!(vec1(&lp.grad().to_kind(Kind::Double)).iter().all(|g| g.is_finite()), "{kind:?} {cfg:?}");
                }
                let _ = lp.grad().zero_();
            }
        }
    }
}

#[test]
fn bad_configs_and_inputs_are_errors_naming_them() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let a = Tensor::from_slice(&[1.0f64]);
    let field = |cfg: DppoConfig| match dppo_loss(&lp, &lp, &a, &m, &cfg) {
        Err(LossError::InvalidConfig { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(field(DppoConfig::tv().with_deltas(0.0, 0.1)), "delta_low");
    assert_eq!(field(DppoConfig::tv().with_deltas(0.1, f64::INFINITY)), "delta_high");
    assert_eq!(field(DppoConfig::binary_kl().with_max_weight(f64::NAN)), "max_weight");
    assert_eq!(field(DppoConfig::tv().with_max_log_ratio(-1.0)), "max_log_ratio");
    let nan = Tensor::from_slice2(&[[-1.0f64, f64::NAN]]);
    assert!(matches!(
        dppo_loss(&lp, &nan, &a, &m, &DppoConfig::tv()),
        Err(LossError::NonFinite { argument: "logp_mu", .. })
    ));
    let short = Tensor::from_slice(&[1.0f64, 2.0]);
    assert!(matches!(
        dppo_loss(&lp, &lp, &short, &m, &DppoConfig::tv()),
        Err(LossError::ShapeMismatch { argument: "advantages", .. })
    ));
}

fn mask01(mask: &[Vec<bool>]) -> Vec<Vec<f64>> {
    mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect()
}

fn per_token(b: &Batch) -> Vec<Vec<f64>> {
    b.weights.iter().zip(&b.mask).map(|(a, r)| vec![*a; r.len()]).collect()
}

/// Batches where both the region and the truncation decide some tokens: log-probs spread over
/// (−3, 0], moves of up to ±1.5 in log space, every row with a real token (verl's token mean is
/// over all of them).
fn peer_batches() -> Vec<Batch> {
    let mut next = uniform_stream(0x5eed_d990_u64);
    (0..6)
        .map(|k| {
            let (b, t) = (2 + k % 3, 3 + k % 4);
            let mut logp: Vec<Vec<f64>> = (0..b).map(|_| (0..t).map(|_| -3.0 * next()).collect()).collect();
            let mut other: Vec<Vec<f64>> =
                logp.iter().map(|r| r.iter().map(|x| x - (2.0 * next() - 1.0) * 1.5).collect()).collect();
            non_positive_rows(&mut logp, &mut other);
            let mut mask: Vec<Vec<bool>> = (0..b).map(|_| (0..t).map(|_| next() < 0.8).collect()).collect();
            for row in &mut mask {
                row[0] = true;
            }
            let weights: Vec<f64> = (0..b).map(|_| 4.0 * next() - 2.0).collect();
            Batch { logp, other, mask, weights }
        })
        .collect()
}

#[test]
fn dppo_matches_verl() {
    let batches = peer_batches();
    let cases: Vec<(DppoConfig, &str, &str)> = vec![
        (DppoConfig::tv(), "tv", "token-mean"),
        (DppoConfig::tv().with_deltas(0.05, 0.25).with_max_weight(1.5), "tv", "token-mean"),
        (DppoConfig::binary_kl(), "kl", "token-mean"),
        (
            DppoConfig::binary_kl().with_deltas(0.1, 0.02).with_aggregation(AggregationMode::SeqMeanTokenMean),
            "kl",
            "seq-mean-token-mean",
        ),
    ];
    let mut calls = Vec::new();
    for b in &batches {
        for (cfg, div, agg) in &cases {
            calls.push(json!({"fn": "verl.dppo", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": per_token(b), "mask": mask01(&b.mask), "divergence": div, "clip_low": cfg.delta_low, "clip_high": cfg.delta_high, "clip_c": cfg.max_weight, "loss_agg_mode": agg}}));
        }
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    let (mut outside, mut truncated) = (0.0, 0.0);
    for b in &batches {
        for (cfg, div, agg) in &cases {
            let r = results.next().unwrap();
            let (lp, old, adv, m) = b.tensors(0.0);
            let lp = leaf(&lp);
            let out = dppo_loss_output(&lp, &old, &adv, &m, cfg, &Normalizer::local()).unwrap();
            out.loss.backward();
            let what = format!("{div} {agg} {cfg:?}");
            // verl's seq-mean-token-mean divides by L_i + 1e-8: about 1e-8 relative.
            let tol = if *agg == "token-mean" { 1e-12 } else { 1e-7 };
            assert_close(&[scalar(&out.loss)], &json_f64(&r["value"]), tol, &format!("{what} value"));
            assert_close(&vec1(&lp.grad()), &json_f64(&r["grad"]), tol, &format!("{what} grad"));
            let d = out.diagnostics.read().unwrap();
            assert_close(&[d.clip_fraction], &json_f64(&r["pg_clipfrac"]), 1e-7, &format!("{what} clipfrac"));
            assert_close(&[d.dual_clip_fraction], &json_f64(&r["pg_clipfrac_lower"]), 1e-7, &format!("{what} lower"));
            outside += d.clip_fraction;
            truncated += d.dual_clip_fraction;
        }
    }
    assert!(outside > 0.0 && truncated > 0.0, "the region or the truncation decides nothing: a weak case");
}
