//! The entropy bonus and the top-entropy token mask against scalar references, finite
//! differences, padding and split invariance, and the peers (verl's `agg_loss`, TRL's mask).

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, Checks, EntropyConfig, LogProbConfig, LossError, Normalizer, backward_through_logprobs,
    entropy_loss, entropy_loss_output, token_logprobs, top_entropy_mask,
};

/// Entropies `[B, T]` in `[0, 3)` with a mask, at least one real token.
fn entropies() -> impl Strategy<Value = (Vec<Vec<f64>>, Vec<Vec<bool>>)> {
    (1usize..6, 1usize..7).prop_flat_map(|(b, t)| {
        (
            prop::collection::vec(prop::collection::vec(0.0f64..3.0, t), b),
            prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.8), t), b),
        )
            .prop_map(|(h, mut m)| {
                m[0][0] = true;
                (h, m)
            })
    })
}

fn padded(h: &[Vec<f64>], m: &[Vec<bool>], padding: f64) -> (Tensor, Tensor) {
    let filled: Vec<Vec<f64>> =
        h.iter().zip(m).map(|(r, mr)| r.iter().zip(mr).map(|(x, k)| if *k { *x } else { padding }).collect()).collect();
    let rows: Vec<Tensor> = m.iter().map(|r| Tensor::from_slice(r)).collect();
    (t2(&filled), Tensor::stack(&rows, 0))
}

/// `−coef Σ_i α_i Σ_t m H` and its gradient `−coef α_i`.
fn ref_bonus(h: &[Vec<f64>], m: &[Vec<bool>], cfg: &EntropyConfig, global: Option<(f64, f64)>) -> (f64, Vec<f64>) {
    let al = ref_alpha(m, cfg.aggregation, global);
    let mut value = 0.0;
    let mut grad = Vec::new();
    for i in 0..h.len() {
        for t in 0..h[i].len() {
            if m[i][t] {
                value -= cfg.coef * al[i] * h[i][t];
                grad.push(-cfg.coef * al[i]);
            } else {
                grad.push(0.0);
            }
        }
    }
    (value, grad)
}

/// The top-entropy mask by its definition: H ≥ the linearly interpolated (1 − ρ)-quantile of the
/// unmasked entropies (torch's `lerp` form of the interpolation).
fn ref_top(h: &[Vec<f64>], m: &[Vec<bool>], rho: f64) -> Vec<bool> {
    let mut real: Vec<f64> =
        h.iter().zip(m).flat_map(|(r, mr)| r.iter().zip(mr).filter(|(_, k)| **k).map(|(x, _)| *x)).collect();
    real.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = real.len();
    let p = (n as f64 - 1.0) * (1.0 - rho);
    let (lo, hi) = (real[p.floor() as usize], real[p.ceil() as usize]);
    let w = p - p.floor();
    let q = if w < 0.5 { lo + w * (hi - lo) } else { hi - (hi - lo) * (1.0 - w) };
    h.iter().zip(m).flat_map(|(r, mr)| r.iter().zip(mr).map(move |(x, k)| *k && *x >= q)).collect()
}

fn configs() -> Vec<EntropyConfig> {
    vec![
        EntropyConfig::bonus(),
        EntropyConfig::bonus().with_coef(0.3).with_aggregation(AggregationMode::SeqMeanTokenMean),
        EntropyConfig::bonus().with_coef(-0.2).with_aggregation(AggregationMode::DrGrpo { length: 8.0 }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn entropy_bonus_matches_scalar_reference_with_nan_padding((h, m) in entropies()) {
        for cfg in configs() {
            let (ht, mt) = padded(&h, &m, f64::NAN);
            let ht = leaf(&ht);
            let loss = entropy_loss(&ht, &mt, &cfg).unwrap();
            loss.backward();
            let g = vec1(&ht.grad());
            let (rv, rg) = ref_bonus(&h, &m, &cfg, None);
            assert_close(&[scalar(&loss)], &[rv], 1e-12, &format!("{cfg:?} value"));
            assert_close(&g, &rg, 1e-12, &format!("{cfg:?} grad"));
            for (k, real) in m.concat().iter().enumerate() {
                if !real { prop_assert!(g[k] == 0.0, "padding gradient {} (exactly zero, either sign)", g[k]); }
            }
        }
    }

    #[test]
    fn entropy_bonus_split_with_global_counts_is_exact((h, m) in entropies(), split in 1usize..5) {
        prop_assume!(m.len() > 1);
        let s = split.min(m.len() - 1) as i64;
        let n = m.len() as i64;
        let (ht, mt) = padded(&h, &m, f64::NAN);
        let norm = Normalizer::from_masks(&[&mt]).unwrap();
        for mode in ALL_MODES {
            let cfg = EntropyConfig::bonus().with_coef(0.5).with_aggregation(mode);
            let full = entropy_loss_output(&ht, &mt, &cfg, &norm).unwrap();
            let again = topr_loss::aggregate(&full.terms, &mt, mode, &norm).unwrap();
            assert_close(&[scalar(&again)], &[scalar(&full.loss)], 1e-12, "terms re-aggregated");
            let part = |o: i64, k: i64| entropy_loss_output(&ht.narrow(0, o, k), &mt.narrow(0, o, k), &cfg, &norm).map(|o| scalar(&o.loss));
            let total = match (part(0, s), part(s, n - s)) {
                (Ok(a), Ok(b)) => a + b,
                (Ok(a), Err(LossError::EmptyBatch { .. })) | (Err(LossError::EmptyBatch { .. }), Ok(a)) => a,
                other => panic!("{other:?}"),
            };
            assert_close(&[total], &[scalar(&full.loss)], 1e-12, &format!("{mode:?} split"));
        }
    }

    #[test]
    fn top_entropy_mask_matches_its_definition((h, m) in entropies(), rho in 0.0f64..=1.0) {
        let (ht, mt) = padded(&h, &m, f64::NAN);
        let keep = Vec::<bool>::try_from(&top_entropy_mask(&ht, &mt, rho, Checks::Full).unwrap().flatten(0, -1)).unwrap();
        prop_assert_eq!(&keep, &ref_top(&h, &m, rho));
        // Padding is never kept; with distinct entropies the count is ⌊ρ (N − 1)⌋ + 1.
        for (k, real) in m.concat().iter().enumerate() {
            if !real { prop_assert!(!keep[k]); }
        }
        let n = m.concat().iter().filter(|x| **x).count();
        let mut real: Vec<f64> = h.concat().into_iter().zip(m.concat()).filter(|(_, k)| *k).map(|(x, _)| x).collect();
        real.sort_by(|a, b| a.partial_cmp(b).unwrap());
        real.dedup();
        if real.len() == n {
            let p = (n as f64 - 1.0) * (1.0 - rho);
            prop_assert_eq!(keep.iter().filter(|k| **k).count(), n - p.ceil() as usize);
            prop_assert_eq!(n - p.ceil() as usize, (rho * (n as f64 - 1.0) + 1e-9).floor() as usize + 1);
        }
    }

    #[test]
    fn top_entropy_mask_grows_with_rho((h, m) in entropies(), a in 0.0f64..=1.0, b in 0.0f64..=1.0) {
        let (lo, hi) = (a.min(b), a.max(b));
        let (ht, mt) = padded(&h, &m, 0.0);
        let small = top_entropy_mask(&ht, &mt, lo, Checks::Shapes).unwrap();
        let large = top_entropy_mask(&ht, &mt, hi, Checks::Shapes).unwrap();
        prop_assert_eq!(small.logical_and(&large.logical_not()).any().int64_value(&[]), 0);
    }
}

#[test]
fn entropy_bonus_gradient_matches_finite_differences_through_the_logits() {
    // From logits: the bonus's gradient through `token_logprobs`' entropy equals the finite
    // difference of its value.
    let logits =
        Tensor::from_slice(&[0.3f64, -1.2, 0.7, 2.0, -0.4, 0.1, 1.5, -2.0, 0.0, 0.9, 0.2, -0.6]).reshape([1, 4, 3]);
    let labels = Tensor::from_slice2(&[[0i64, 2, 1, 0]]);
    let mask = Tensor::from_slice2(&[[true, true, true, false]]);
    let lcfg = LogProbConfig::new().with_entropy(true);
    let cfg = EntropyConfig::bonus().with_coef(0.7).with_aggregation(AggregationMode::SeqMeanTokenSum);
    let value = |x: &[f64]| {
        let l = Tensor::from_slice(x).reshape([1, 4, 3]);
        let out = token_logprobs(&l, &labels, Some(&mask), &lcfg).unwrap();
        scalar(&entropy_loss(&out.entropy.unwrap(), &mask, &cfg).unwrap())
    };
    let l = leaf(&logits);
    let _loss = backward_through_logprobs(&l, &labels, Some(&mask), &lcfg, |x| {
        entropy_loss(x.entropy.as_ref().expect("entropy asked for"), &mask, &cfg)
    })
    .unwrap();
    let fd = finite_difference(&vec1(&logits), 1e-6, value);
    assert_close(&vec1(&l.grad()), &fd, 1e-7, "d bonus / d logits");
}

#[test]
fn entropy_diagnostics_and_dtypes() {
    let h = Tensor::from_slice2(&[[0.5f64, 2.5, f64::INFINITY], [1.0, 0.0, 0.0]]);
    let m = Tensor::from_slice2(&[[true, true, false], [true, false, false]]);
    let d =
        entropy_loss_output(&h, &m, &EntropyConfig::bonus(), &Normalizer::local()).unwrap().diagnostics.read().unwrap();
    assert_eq!((d.tokens, d.entropy_mean, d.entropy_min, d.entropy_max), (3, 4.0 / 3.0, 0.5, 2.5));
    for kind in [Kind::Half, Kind::BFloat16, Kind::Float, Kind::Double] {
        let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        let loss = entropy_loss(&h.to_kind(kind), &m, &EntropyConfig::bonus()).unwrap();
        assert_eq!(loss.kind(), want, "{kind:?}");
        let keep = top_entropy_mask(&h.to_kind(kind), &m, 0.2, Checks::Full).unwrap();
        assert_eq!(Vec::<bool>::try_from(&keep.flatten(0, -1)).unwrap(), vec![false, true, false, false, false, false]);
    }
    // Huge entropies in f32 overflow the sum: a typed error, not inf.
    let big = Tensor::from_slice2(&[[3.0e38f32, 3.0e38]]);
    let e = entropy_loss(
        &big,
        &big.ones_like(),
        &EntropyConfig::bonus().with_coef(1.0).with_aggregation(AggregationMode::TokenSum),
    )
    .unwrap_err();
    assert_eq!(e, LossError::NonFiniteLoss { compute_dtype: "f32" });
}

#[test]
fn entropy_bad_inputs_are_errors() {
    let h = Tensor::from_slice2(&[[0.5f64, 1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let cfg = EntropyConfig::bonus();
    let e = entropy_loss(&Tensor::from_slice(&[0.5f64, 1.0]), &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "entropy", .. }), "{e}");
    let e = entropy_loss(&Tensor::from_slice2(&[[1i64, 2]]), &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "entropy", .. }), "{e}");
    let e = entropy_loss(&Tensor::from_slice2(&[[0.5f64, f64::NAN]]), &m, &cfg).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "entropy", .. }), "{e}");
    let e = entropy_loss(&h, &Tensor::from_slice2(&[[true, true, true]]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e}");
    let e = entropy_loss(&h, &Tensor::from_slice2(&[[false, false]]), &cfg).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "mask", .. }), "{e}");
    let e = entropy_loss(&h, &m, &cfg.with_coef(f64::NAN)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "coef", .. }), "{e}");
    for rho in [-0.1, 1.1, f64::NAN] {
        let e = top_entropy_mask(&h, &m, rho, Checks::Full).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument: "rho", .. }), "{e}");
    }
    let e = top_entropy_mask(&Tensor::from_slice2(&[[0.5f64, f64::NAN]]), &m, 0.2, Checks::Full).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "entropy", .. }), "{e}");
    // Nothing unmasked: nothing kept.
    let none = top_entropy_mask(&h, &Tensor::from_slice2(&[[false, false]]), 0.2, Checks::Full).unwrap();
    assert_eq!(none.any().int64_value(&[]), 0);
}

fn mask01(m: &[Vec<bool>]) -> Vec<Vec<f64>> {
    m.iter().map(|r| r.iter().map(|x| f64::from(u8::from(*x))).collect()).collect()
}

/// Deterministic entropies on a grid of 1/64 (exact in f32, so TRL's f32 quantile is exact too).
/// Entropies and a mask.
type Case = (Vec<Vec<f64>>, Vec<Vec<bool>>);

fn peer_cases() -> Vec<Case> {
    let mut seed = 0xD1B54A32D192ED03u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed >> 11
    };
    (0..10)
        .map(|k| {
            let (b, t) = (2 + k % 4, 3 + k % 6);
            let h = (0..b).map(|_| (0..t).map(|_| (next() % 256) as f64 / 64.0).collect()).collect();
            let mut m: Vec<Vec<bool>> = (0..b).map(|_| (0..t).map(|_| next() % 5 != 0).collect()).collect();
            for row in &mut m {
                row[0] = true;
            }
            (h, m)
        })
        .collect()
}

#[test]
fn entropy_bonus_matches_verl_agg_loss() {
    let cases = peer_cases();
    let modes = [
        (AggregationMode::TokenMean, "token-mean"),
        (AggregationMode::SeqMeanTokenSum, "seq-mean-token-sum"),
        (AggregationMode::SeqMeanTokenMean, "seq-mean-token-mean"),
        (AggregationMode::TokenSum, "token-sum"),
    ];
    let mut calls = Vec::new();
    for (h, m) in &cases {
        for (_, name) in modes {
            calls.push(json!({"fn": "verl.entropy_bonus", "args": {"entropy": h, "mask": mask01(m), "coef": 0.01, "loss_agg_mode": name}}));
        }
        // verl 0.9.1's seq-mean-token-sum-norm is the sequence mean of token sums divided by the
        // padded length T when no scale is set: the crate's DrGrpo { length: T }.
        calls.push(json!({"fn": "verl.entropy_bonus", "args": {"entropy": h, "mask": mask01(m), "coef": 0.01, "loss_agg_mode": "seq-mean-token-sum-norm"}}));
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    for (h, m) in &cases {
        let length = h[0].len() as f64;
        let all = modes.iter().map(|(mode, _)| *mode).chain([AggregationMode::DrGrpo { length }]);
        for mode in all {
            let r = results.next().unwrap();
            let (ht, mt) = padded(h, m, 0.0);
            let ht = leaf(&ht);
            let loss = entropy_loss(&ht, &mt, &EntropyConfig::bonus().with_coef(0.01).with_aggregation(mode)).unwrap();
            loss.backward();
            // verl's seq-mean-token-mean divides by L_i + 1e-8.
            let tol = if mode == AggregationMode::SeqMeanTokenMean { 1e-7 } else { 1e-12 };
            assert_close(&[scalar(&loss)], &json_f64(&r["value"]), tol, &format!("{mode:?} value"));
            assert_close(&vec1(&ht.grad()), &json_f64(&r["grad"]), tol, &format!("{mode:?} grad"));
        }
    }
}

#[test]
fn token_entropy_matches_verl_entropy_from_logits() {
    // The entropies the bonus takes, from `token_logprobs`, are verl's `entropy_from_logits`.
    let logits: Vec<f64> = (0..2 * 3 * 5).map(|k| ((k * 37 % 11) as f64 - 5.0) * 0.4).collect();
    let nested: Vec<Vec<Vec<f64>>> = logits.chunks(15).map(|s| s.chunks(5).map(|r| r.to_vec()).collect()).collect();
    let Some(r) = peer(&[json!({"fn": "verl.entropy_from_logits", "args": {"logits": nested}})]) else { return };
    let out = token_logprobs(
        &Tensor::from_slice(&logits).reshape([2, 3, 5]),
        &Tensor::zeros([2, 3], (Kind::Int64, tch::Device::Cpu)),
        None,
        &LogProbConfig::new().with_entropy(true),
    )
    .unwrap();
    assert_close(&vec1(&out.entropy.unwrap()), &json_f64(&r[0]["value"]), 1e-12, "entropy");
}

#[test]
fn top_entropy_mask_matches_trl() {
    let cases = peer_cases();
    let rhos = [0.2, 0.05, 0.5, 0.0, 1.0, 0.3];
    let mut calls = Vec::new();
    for (h, m) in &cases {
        for rho in rhos {
            calls.push(json!({"fn": "trl.top_entropy_mask", "args": {"entropy": h, "mask": mask01(m), "rho": rho}}));
        }
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    for (h, m) in &cases {
        for rho in rhos {
            let r = results.next().unwrap();
            let (ht, mt) = padded(h, m, 0.0);
            let keep = top_entropy_mask(&ht, &mt, rho, Checks::Full).unwrap().to_kind(Kind::Double);
            assert_eq!(vec1(&keep), json_f64(&r["value"]), "ρ = {rho}, {h:?} {m:?}");
        }
    }
}
