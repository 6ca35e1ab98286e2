//! Stale-data corrections: decoupled PPO against a scalar reference of AReaL's formula, finite
//! differences, padding, split invariance and verl's decoupled mode (values and gradients); the
//! proximal log-probs' approximation and M2PO's mask against scalar restatements of AReaL's code.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, CorrectionLevel, DecoupledPpoConfig, LossError, PpoConfig, ProximalApproximation,
    RolloutCorrection, WeightRule, decoupled_ppo_loss, decoupled_ppo_loss_output, m2po_mask, ppo_clip_loss,
    proximal_logprobs,
};

/// A batch (π, π_prox = `other`) and the behaviour log-probs, at most 0, whose log-ratio to the
/// proximal policy spans ±2.5 (so that caps at 2 and 5 both bite).
fn batch() -> impl Strategy<Value = (TokenBatch, Vec<Vec<f64>>)> {
    token_batch(1.2, (-2.0f64..2.0).boxed()).prop_flat_map(|b| {
        let (rows, cols) = (b.mask.len(), b.mask[0].len());
        (Just(b), prop::collection::vec(prop::collection::vec(-2.5f64..2.5, cols), rows)).prop_map(|(b, d)| {
            let behaviour =
                b.other.iter().zip(&d).map(|(o, d)| o.iter().zip(d).map(|(o, d)| (o - d).min(0.0)).collect()).collect();
            (b, behaviour)
        })
    })
}

fn configs() -> Vec<DecoupledPpoConfig> {
    vec![
        DecoupledPpoConfig::areal(),
        DecoupledPpoConfig::verl(),
        DecoupledPpoConfig::areal()
            .with_ppo(PpoConfig::dapo().with_aggregation(AggregationMode::SeqMeanTokenMean))
            .with_behaviour(RolloutCorrection::sequence_tis(3.0)),
        DecoupledPpoConfig::verl().with_behaviour(RolloutCorrection::geometric_mis(0.5, 2.0)),
        DecoupledPpoConfig::areal().with_ppo(PpoConfig::ppo().with_aggregation(AggregationMode::SeqMeanTokenSum)),
    ]
}

/// PPO-clip's value and gradient for one token (as in `tests/ppo.rs`).
fn ref_ppo_token(delta: f64, a: f64, cfg: &PpoConfig) -> (f64, f64) {
    let r = delta.clamp(-cfg.max_log_ratio, cfg.max_log_ratio).exp();
    let unclipped = -r * a;
    let c = r.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let clipped = -c * a;
    let (mut v, mut g) = if unclipped >= clipped {
        (unclipped, -r * a)
    } else {
        (clipped, if r > 1.0 - cfg.clip_low && r < 1.0 + cfg.clip_high { -r * a } else { 0.0 })
    };
    if let Some(dual) = cfg.dual_clip {
        if a < 0.0 && -dual * a < v {
            (v, g) = (-dual * a, 0.0);
        }
    }
    (v, g)
}

/// The behaviour weights by the definition (AReaL: `exp(log π_prox − log μ)`, masked or truncated;
/// verl and this crate clamp the log-ratio to ±20 first).
fn ref_behaviour(b: &TokenBatch, behaviour: &[Vec<f64>], c: &RolloutCorrection) -> Vec<Vec<f64>> {
    let limit = |d: f64| {
        let d = d.clamp(-c.max_log_ratio, c.max_log_ratio);
        let r = d.exp();
        match c.rule {
            WeightRule::Truncate => r.clamp(c.min, c.max),
            _ => {
                if d >= c.min.ln() && d <= c.max.ln() {
                    r
                } else {
                    0.0
                }
            }
        }
    };
    (0..b.mask.len())
        .map(|i| {
            let real: Vec<usize> = (0..b.mask[i].len()).filter(|&t| b.mask[i][t]).collect();
            let total: f64 = real.iter().map(|&t| b.other[i][t] - behaviour[i][t]).sum();
            let seq = match c.level {
                CorrectionLevel::Token => None,
                CorrectionLevel::Sequence => Some(limit(total)),
                _ => Some(limit(total / real.len().max(1) as f64)),
            };
            (0..b.mask[i].len())
                .map(|t| if b.mask[i][t] { seq.unwrap_or_else(|| limit(b.other[i][t] - behaviour[i][t])) } else { 0.0 })
                .collect()
        })
        .collect()
}

fn ref_loss(b: &TokenBatch, behaviour: &[Vec<f64>], cfg: &DecoupledPpoConfig) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.ppo.aggregation, None);
    let w = ref_behaviour(b, behaviour, &cfg.behaviour);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        for (t, _) in row.iter().enumerate().filter(|(_, m)| **m) {
            let (v, g) = ref_ppo_token(b.logp[i][t] - b.other[i][t], b.weights[i], &cfg.ppo);
            value += al[i] * w[i][t] * v;
            grad[i][t] = al[i] * w[i][t] * g;
        }
    }
    (value, grad.concat())
}

fn padded(b: &TokenBatch, v: &[Vec<f64>], padding: f64) -> Tensor {
    let rows: Vec<Vec<f64>> = v
        .iter()
        .zip(&b.mask)
        .map(|(r, m)| r.iter().zip(m).map(|(x, m)| if *m { *x } else { padding }).collect())
        .collect();
    t2(&rows)
}

fn run(b: &TokenBatch, behaviour: &[Vec<f64>], cfg: &DecoupledPpoConfig, padding: f64) -> (f64, Vec<f64>) {
    let lb = padded(b, behaviour, padding);
    value_and_grad(b, padding, &|lp, prox, adv, m| decoupled_ppo_loss(lp, prox, &lb, adv, m, cfg).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn decoupled_ppo_matches_scalar_reference_with_nan_padding((b, behaviour) in batch()) {
        for cfg in configs() {
            let got = run(&b, &behaviour, &cfg, f64::NAN);
            assert_matches_reference(&b, &got, &ref_loss(&b, &behaviour, &cfg), &format!("{cfg:?}"));
        }
    }

    #[test]
    fn decoupled_ppo_with_the_behaviour_as_proximal_policy_is_ppo(b in token_batch(1.2, (-2.0f64..2.0).boxed())) {
        let behaviour = b.other.clone();
        let cfg = DecoupledPpoConfig::verl();
        let (v, g) = run(&b, &behaviour, &cfg, 0.0);
        let (lp, old, adv, m) = b.tensors(0.0);
        let lp = leaf(&lp);
        let ppo = ppo_clip_loss(&lp, &old, &adv, &m, &cfg.ppo).unwrap();
        ppo.backward();
        assert_close(&[v], &[scalar(&ppo)], 1e-12, "value");
        assert_close(&g, &vec1(&lp.grad()), 1e-12, "grad");
    }

    #[test]
    fn decoupled_ppo_split_into_micro_batches_with_global_counts_is_exact(b in token_batch(1.2, (-2.0f64..2.0).boxed()), split in 1usize..5) {
        assert_split_invariant(&b, split, "decoupled PPO", &|lp, prox, adv, m, mode, norm| {
            // The behaviour log-probs as a function of the proximal ones, so that each micro-batch
            // gets its own rows: log ratios in ±2.5.
            let lb = (prox - (prox * 7.0).sin() * 2.5).clamp_max(0.0);
            let cfg = DecoupledPpoConfig::areal().with_ppo(PpoConfig::ppo().with_aggregation(mode));
            match norm {
                Some(n) => decoupled_ppo_loss_output(lp, prox, &lb, adv, m, &cfg, n).map(|o| o.output.loss),
                None => decoupled_ppo_loss(lp, prox, &lb, adv, m, &cfg),
            }
        });
    }
}

#[test]
fn decoupled_ppo_gradient_matches_finite_differences() {
    let b = fixed_token_batch();
    let behaviour: Vec<Vec<f64>> = b
        .other
        .iter()
        .enumerate()
        .map(|(i, r)| r.iter().map(|x| (x - 0.6 * (i as f64) + 0.3).min(0.0)).collect())
        .collect();
    for cfg in configs() {
        let (_, g) = run(&b, &behaviour, &cfg, 0.0);
        let lb = padded(&b, &behaviour, 0.0);
        let loss = |lp: &Tensor, prox: &Tensor, adv: &Tensor, m: &Tensor| {
            decoupled_ppo_loss(lp, prox, &lb, adv, m, &cfg).unwrap()
        };
        assert_gradient_matches_finite_differences(&b, &g, &loss, &format!("{cfg:?}"));
    }
}

#[test]
fn extreme_and_half_precision_inputs_compute_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        let lp = Tensor::from_slice2(&[[-300.0f64, 0.0, -3.0]]).to_kind(kind).set_requires_grad(true);
        let prox = Tensor::from_slice2(&[[0.0f64, -300.0, -3.0]]).to_kind(kind);
        let lb = Tensor::from_slice2(&[[-300.0f64, 0.0, -1.0]]).to_kind(kind);
        let m = Tensor::from_slice2(&[[1i64, 1, 1]]);
        let adv = Tensor::from_slice(&[-1.0f64]).to_kind(kind);
        let loss = decoupled_ppo_loss(&lp, &prox, &lb, &adv, &m, &DecoupledPpoConfig::verl()).unwrap();
        let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        assert_eq!(loss.kind(), want, "{kind:?}");
        loss.backward();
        assert!(scalar(&loss).is_finite(), "{kind:?}");
        assert!(vec1(&lp.grad().to_kind(Kind::Double)).iter().all(|g| g.is_finite()), "{kind:?}");
    }
}

#[test]
fn bad_inputs_are_errors_naming_the_argument() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let a = Tensor::from_slice(&[1.0f64]);
    let cfg = DecoupledPpoConfig::areal();
    let short = Tensor::from_slice2(&[[-1.0f64]]);
    let nan = Tensor::from_slice2(&[[-1.0f64, f64::NAN]]);
    let positive = Tensor::from_slice2(&[[-1.0f64, 0.5]]);
    let named = |r: Result<Tensor, LossError>| format!("{:?}", r.unwrap_err());
    assert!(named(decoupled_ppo_loss(&lp, &short, &lp, &a, &m, &cfg)).contains("logp_proximal"));
    assert!(named(decoupled_ppo_loss(&lp, &lp, &short, &a, &m, &cfg)).contains("logp_behaviour"));
    assert!(named(decoupled_ppo_loss(&lp, &lp, &nan, &a, &m, &cfg)).contains("logp_behaviour"));
    assert!(named(decoupled_ppo_loss(&lp, &nan, &lp, &a, &m, &cfg)).contains("logp_proximal"));
    assert!(named(decoupled_ppo_loss(&lp, &lp, &positive, &a, &m, &cfg)).contains("logp_behaviour"));
    let bad = cfg.with_behaviour(RolloutCorrection::token_tis(0.0));
    assert!(matches!(decoupled_ppo_loss(&lp, &lp, &lp, &a, &m, &bad), Err(LossError::InvalidConfig { .. })));
    // Shape checks only: no host read, NaN in the behaviour log-probs is not looked for.
    let fast = cfg.with_checks(topr_loss::Checks::Shapes);
    let before = topr_loss::host_reads();
    let _ = decoupled_ppo_loss(&lp, &lp, &lp, &a, &m, &fast).unwrap();
    assert_eq!(topr_loss::host_reads(), before);
}

/// verl 0.9.1's decoupled mode: `compute_rollout_correction_weights(old − rollout)` then
/// `compute_policy_loss_vanilla(old, log_prob, …, rollout_is_weights)`, both verl's own.
#[test]
fn decoupled_ppo_matches_verls_decoupled_mode() {
    let mut next = uniform_stream(0xdec0_u64);
    let cases = [
        ("token", 2.0, "token-mean", AggregationMode::TokenMean),
        ("sequence", 3.0, "seq-mean-token-sum", AggregationMode::SeqMeanTokenSum),
    ];
    let mut batches = Vec::new();
    let mut weight_calls = Vec::new();
    for k in 0..4 {
        let (rows, t) = (2 + k % 3, 3 + k % 4);
        let logp: Vec<Vec<f64>> = (0..rows).map(|_| (0..t).map(|_| -0.1 - 3.0 * next()).collect()).collect();
        let prox: Vec<Vec<f64>> =
            logp.iter().map(|r| r.iter().map(|x| (x - 0.6 * (2.0 * next() - 1.0)).min(0.0)).collect()).collect();
        let behaviour: Vec<Vec<f64>> =
            prox.iter().map(|r| r.iter().map(|x| (x - 1.6 * (2.0 * next() - 1.0)).min(0.0)).collect()).collect();
        let mut mask: Vec<Vec<bool>> = (0..rows).map(|_| (0..t).map(|_| next() < 0.8).collect()).collect();
        mask[0][0] = true;
        let weights: Vec<f64> = (0..rows).map(|_| 4.0 * next() - 2.0).collect();
        let m01: Vec<Vec<f64>> = mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect();
        for (level, threshold, _, _) in &cases {
            weight_calls.push(json!({"fn": "verl.rollout_weights", "args": {"logp": prox, "logp_rollout": behaviour, "mask": m01, "level": level, "threshold": threshold}}));
        }
        batches.push((TokenBatch { logp, other: prox, mask, weights }, behaviour, m01));
    }
    let Some(weights) = peer(&weight_calls) else { return };
    let mut loss_calls = Vec::new();
    for (k, (b, _, m01)) in batches.iter().enumerate() {
        for (j, (_, _, agg, _)) in cases.iter().enumerate() {
            let w = &weights[k * cases.len() + j]["weights"];
            loss_calls.push(json!({"fn": "verl.policy_loss_with_is", "args": {"loss": "vanilla", "logp": b.logp, "logp_old": b.other, "advantages": b.weights, "mask": m01, "weights": w, "agg": agg, "clip_low": 0.2, "clip_high": 0.2}}));
        }
    }
    let results = peer(&loss_calls).unwrap();
    let mut results = results.into_iter();
    for (b, behaviour, _) in &batches {
        for (level, threshold, agg, mode) in &cases {
            let r = results.next().unwrap();
            let correction = if *level == "token" {
                RolloutCorrection::token_tis(*threshold)
            } else {
                RolloutCorrection::sequence_tis(*threshold)
            };
            let cfg = DecoupledPpoConfig::verl()
                .with_behaviour(correction)
                .with_ppo(PpoConfig::ppo().with_dual_clip(Some(3.0)).with_aggregation(*mode));
            let (v, g) = run(b, behaviour, &cfg, 0.0);
            assert_close(&[v], &json_f64(&r["value"]), 1e-12, &format!("{level} {agg} value"));
            assert_close(&g, &json_f64(&r["grad"]), 1e-12, &format!("{level} {agg} grad"));
        }
    }
}

/// AReaL's `compute_prox_logp_approximations`, restated for one token.
fn ref_proximal(lb: f64, lp: f64, s: f64, method: ProximalApproximation) -> f64 {
    let alpha = if s > 0.0 { ((s - 1.0) / s).clamp(0.0, 1.0) } else { 0.0 };
    match method {
        ProximalApproximation::LogLinear => lb + alpha * (lp - lb),
        _ => ((1.0 - alpha) * lb.exp() + alpha * lp.exp()).ln(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn proximal_logprobs_match_arealss_approximations(
        b in token_batch(2.0, (-2.0f64..2.0).boxed()),
        per_token in any::<bool>(),
        staleness in prop::collection::vec(0.0f64..8.0, 36),
    ) {
        let (rows, cols) = (b.mask.len(), b.mask[0].len());
        let s_at = |i: usize, t: usize| if per_token { staleness[(i * cols + t) % 36] } else { staleness[i] };
        let s = if per_token {
            t2(&(0..rows).map(|i| (0..cols).map(|t| s_at(i, t)).collect()).collect::<Vec<_>>())
        } else {
            t1(&staleness[..rows])
        };
        let (lp, lb, _, m) = b.tensors(f64::NAN);
        for method in [ProximalApproximation::LogLinear, ProximalApproximation::Linear] {
            let got = vec1(&proximal_logprobs(&lb, &leaf(&lp), &s, &m, method).unwrap());
            let want: Vec<f64> = (0..rows).flat_map(|i| (0..cols).map(move |t| (i, t))).map(|(i, t)| {
                if b.mask[i][t] { ref_proximal(b.other[i][t], b.logp[i][t], s_at(i, t), method) } else { 0.0 }
            }).collect();
            assert_close(&got, &want, 1e-12, &format!("{method:?}"));
        }
    }
}

#[test]
fn proximal_logprobs_edge_cases() {
    let lb = Tensor::from_slice2(&[[-2.0f64, -0.5]]);
    let lp = Tensor::from_slice2(&[[-1.0f64, -3.0]]).set_requires_grad(true);
    let m = Tensor::from_slice2(&[[true, true]]);
    for method in [ProximalApproximation::LogLinear, ProximalApproximation::Linear] {
        // Staleness 0 or 1: the proximal policy is the behaviour policy, exactly.
        for s in [0.0, 1.0] {
            let p = proximal_logprobs(&lb, &lp, &t1(&[s]), &m, method).unwrap();
            assert_eq!(vec1(&p), vec![-2.0, -0.5], "{method:?} s = {s}");
            assert!(!p.requires_grad());
        }
        // Very stale: the current policy.
        let p = proximal_logprobs(&lb, &lp, &t1(&[1e12]), &m, method).unwrap();
        assert_close(&vec1(&p), &[-1.0, -3.0], 1e-9, &format!("{method:?} stale"));
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let r = proximal_logprobs(&lb, &lp, &t1(&[bad]), &m, method);
            assert!(format!("{r:?}").contains("staleness"), "{bad}: {r:?}");
        }
        let r = proximal_logprobs(&lb, &lp, &t1(&[1.0, 2.0]), &m, method);
        assert!(format!("{r:?}").contains("staleness"), "{r:?}");
    }
    // Padding with NaN: 0 there, and a negative staleness on padding is ignored.
    let lb = Tensor::from_slice2(&[[-2.0f64, f64::NAN]]);
    let m = Tensor::from_slice2(&[[true, false]]);
    let s = Tensor::from_slice2(&[[3i64, -5]]);
    let p = proximal_logprobs(&lb, &lp, &s, &m, ProximalApproximation::LogLinear).unwrap();
    assert_close(&vec1(&p), &[-2.0 + (2.0 / 3.0), 0.0], 1e-12, "padding");
}

/// AReaL's `_get_m2po_loss_mask`, restated: sort descending, mask the fewest largest until the
/// mean of the rest is below τ (keep one if never).
fn ref_m2po(prox: &[Vec<f64>], behaviour: &[Vec<f64>], mask: &[Vec<bool>], tau: f64) -> Vec<bool> {
    let mut items: Vec<(f64, usize)> = Vec::new();
    let cols = mask[0].len();
    for (i, row) in mask.iter().enumerate() {
        for (t, _) in row.iter().enumerate().filter(|(_, m)| **m) {
            let d = behaviour[i][t] - prox[i][t];
            items.push((d * d, i * cols + t));
        }
    }
    items.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(b.1.cmp(&a.1)));
    let n = items.len();
    let mut k_star = n.saturating_sub(1);
    for k in 0..n {
        let rest = &items[k..];
        if rest.iter().map(|x| x.0).sum::<f64>() / (rest.len() as f64) < tau {
            k_star = k;
            break;
        }
    }
    let mut kept = mask.concat();
    for &(_, flat) in &items[..k_star] {
        kept[flat] = false;
    }
    kept
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn m2po_mask_matches_arealss_rule(b in token_batch(1.0, (-1.0f64..1.0).boxed()), tau in 0.005f64..0.5) {
        let (prox, behaviour, _, m) = b.tensors(f64::NAN);
        let got: Vec<bool> = Vec::<bool>::try_from(&m2po_mask(&prox, &behaviour, &m, tau).unwrap().flatten(0, -1)).unwrap();
        prop_assert_eq!(&got, &ref_m2po(&b.logp, &b.other, &b.mask, tau));
        // What is kept has a second moment below τ, or is one token.
        let kept: Vec<f64> = got.iter().enumerate().filter(|(_, k)| **k).map(|(f, _)| {
            let (i, t) = (f / b.mask[0].len(), f % b.mask[0].len());
            (b.other[i][t] - b.logp[i][t]).powi(2)
        }).collect();
        prop_assert!(kept.len() == 1 || kept.iter().sum::<f64>() / kept.len() as f64 <= tau);
    }
}

#[test]
fn m2po_mask_edge_cases() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -1.0], [-1.0, -1.0]]);
    let far = Tensor::from_slice2(&[[-5.0f64, -4.0], [-3.0, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true], [true, false]]);
    // Nothing moved: everything kept. Everything far: one token kept, the closest.
    assert_eq!(
        Vec::<bool>::try_from(&m2po_mask(&lp, &lp, &m, 0.04).unwrap().flatten(0, -1)).unwrap(),
        vec![true, true, true, false]
    );
    assert_eq!(
        Vec::<bool>::try_from(&m2po_mask(&lp, &far, &m, 0.04).unwrap().flatten(0, -1)).unwrap(),
        vec![false, false, true, false]
    );
    // Ties: the later positions go first.
    let tied = Tensor::from_slice2(&[[-2.0f64, -2.0], [-1.0, -1.0]]);
    assert_eq!(
        Vec::<bool>::try_from(&m2po_mask(&lp, &tied, &m, 0.6).unwrap().flatten(0, -1)).unwrap(),
        vec![true, false, true, false]
    );
    for tau in [0.0, -1.0, f64::NAN] {
        assert!(matches!(m2po_mask(&lp, &lp, &m, tau), Err(LossError::InvalidConfig { field: "tau", .. })));
    }
    let r = m2po_mask(&lp, &Tensor::from_slice2(&[[-1.0f64]]), &m, 0.04);
    assert!(format!("{r:?}").contains("logp_behaviour"), "{r:?}");
}
