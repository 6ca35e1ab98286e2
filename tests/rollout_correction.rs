//! Rollout correction (TIS, MIS / IcePop, rejection, off-policy sequence mask, ESS, per-token
//! weights on any loss) against scalar references, verl's own functions and TRL's lines.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, CorrectionLevel, Divergence, KlConfig, LossError, Normalizer, PpoConfig, Rejection,
    RejectionScope, RolloutCorrection, ToprTokenConfig, WeightRule, apply_token_weights, cispo_loss_output,
    effective_sample_size, gspo_loss_output, kl_penalty_output, off_policy_sequence_mask, ppo_clip_loss_output,
    rollout_rejection_mask, rollout_rejection_mask_all, rollout_weights, topr_token_loss_output,
};

fn batch() -> impl Strategy<Value = TokenBatch> {
    token_batch(1.5, (-2.0f64..2.0).boxed())
}

fn configs() -> Vec<RolloutCorrection> {
    vec![
        RolloutCorrection::token_tis(2.0),
        RolloutCorrection::token_tis(1.5).with_bounds(0.5, 1.5),
        RolloutCorrection::sequence_tis(3.0),
        RolloutCorrection::token_mis(0.5, 2.0),
        RolloutCorrection::sequence_mis(0.3, 4.0),
        RolloutCorrection::token_tis(2.0).with_batch_normalize(true),
        RolloutCorrection::sequence_mis(0.3, 4.0).with_batch_normalize(true),
        RolloutCorrection::token_tis(f64::INFINITY),
        RolloutCorrection::geometric_tis(1.5),
        RolloutCorrection::geometric_mis(0.7, 1.4).with_batch_normalize(true),
        RolloutCorrection::token_mis(0.5, 2.0).with_sequence_normalize(true),
        RolloutCorrection::token_tis(1.5).with_sequence_normalize(true).with_batch_normalize(true),
    ]
}

/// Weights by the definitions: ratios from the clamped log-ratio, truncated or masked, then
/// normalised over the samples.
fn ref_weights(b: &TokenBatch, cfg: &RolloutCorrection) -> Vec<Vec<f64>> {
    let m = cfg.max_log_ratio;
    let limit = |d: f64| -> f64 {
        let d = d.clamp(-m, m);
        let r = d.exp();
        let outside = d < cfg.min.ln() || d > cfg.max.ln();
        match cfg.rule {
            WeightRule::Truncate => r.max(cfg.min).min(cfg.max),
            WeightRule::Mask => {
                if outside {
                    0.0
                } else {
                    r
                }
            }
            _ => unreachable!(),
        }
    };
    let mut w: Vec<Vec<f64>> = Vec::new();
    let mut samples = Vec::new();
    for i in 0..b.logp.len() {
        let deltas: Vec<f64> =
            (0..b.logp[i].len()).filter(|&t| b.mask[i][t]).map(|t| b.logp[i][t] - b.other[i][t]).collect();
        let row: Vec<f64> = match cfg.level {
            CorrectionLevel::Token => (0..b.logp[i].len())
                .map(|t| if b.mask[i][t] { limit(b.logp[i][t] - b.other[i][t]) } else { 0.0 })
                .collect(),
            CorrectionLevel::Sequence | CorrectionLevel::Geometric => {
                let total: f64 = deltas.iter().sum();
                let geometric = cfg.level == CorrectionLevel::Geometric;
                let wi = limit(if geometric { total / deltas.len().max(1) as f64 } else { total });
                if !deltas.is_empty() {
                    samples.push(wi);
                }
                b.mask[i].iter().map(|&mk| if mk { wi } else { 0.0 }).collect()
            }
            _ => unreachable!(),
        };
        if cfg.level == CorrectionLevel::Token {
            samples.extend(row.iter().zip(&b.mask[i]).filter(|(_, m)| **m).map(|(w, _)| *w));
        }
        w.push(row);
    }
    if cfg.sequence_normalize {
        for (row, m) in w.iter_mut().zip(&b.mask) {
            let n = m.iter().filter(|x| **x).count().max(1) as f64;
            let mean = row.iter().sum::<f64>() / n;
            if mean > 1e-8 {
                row.iter_mut().for_each(|x| *x /= mean);
            }
        }
        if cfg.level == CorrectionLevel::Token {
            samples = w
                .iter()
                .zip(&b.mask)
                .flat_map(|(r, m)| r.iter().zip(m).filter(|(_, m)| **m).map(|(x, _)| *x))
                .collect();
        }
    }
    if cfg.batch_normalize {
        let mean = samples.iter().sum::<f64>() / samples.len() as f64;
        if mean > 1e-8 {
            for row in &mut w {
                for x in row.iter_mut() {
                    *x /= mean;
                }
            }
        }
    }
    w
}

fn ref_ess(w: &[f64]) -> f64 {
    let s1: f64 = w.iter().sum();
    let s2: f64 = w.iter().map(|x| x * x).sum();
    if s2 == 0.0 { 0.0 } else { s1 * s1 / (w.len() as f64 * s2) }
}

/// The statistic of a rule per sequence or per token, and whether each token is kept.
fn ref_rejection(b: &TokenBatch, rule: &Rejection) -> Vec<Vec<bool>> {
    let stat = |d: f64| -> f64 {
        let d = d.clamp(-20.0, 20.0);
        match rule.divergence {
            Divergence::K1 => -d,
            Divergence::K2 => 0.5 * d * d,
            Divergence::K3 => d.exp() - 1.0 - d,
            _ => unreachable!(),
        }
    };
    let ok = |s: f64| -> bool {
        match rule.divergence {
            Divergence::K1 => s >= rule.min.ln() && s <= rule.max.ln(),
            _ => s <= rule.max,
        }
    };
    (0..b.logp.len())
        .map(|i| {
            let s: Vec<f64> =
                (0..b.logp[i].len()).filter(|&t| b.mask[i][t]).map(|t| stat(b.logp[i][t] - b.other[i][t])).collect();
            let seq = match rule.scope {
                RejectionScope::Token => None,
                RejectionScope::SequenceSum => Some(s.iter().sum::<f64>()),
                RejectionScope::SequenceMean => Some(s.iter().sum::<f64>() / (s.len().max(1) as f64)),
                RejectionScope::SequenceMax => Some(s.iter().copied().fold(0.0, f64::max)),
                _ => unreachable!(),
            };
            (0..b.logp[i].len())
                .map(|t| b.mask[i][t] && seq.map_or_else(|| ok(stat(b.logp[i][t] - b.other[i][t])), ok))
                .collect()
        })
        .collect()
}

fn rules() -> Vec<Rejection> {
    let mut v = Vec::new();
    for scope in [RejectionScope::Token, RejectionScope::SequenceSum, RejectionScope::SequenceMean] {
        v.push(Rejection::k1(scope, 0.6, 1.8));
    }
    for scope in
        [RejectionScope::Token, RejectionScope::SequenceSum, RejectionScope::SequenceMean, RejectionScope::SequenceMax]
    {
        v.push(Rejection::k2(scope, 0.3));
        v.push(Rejection::k3(scope, 0.25));
    }
    v
}

const LOSSES: [&str; 5] = ["ppo", "gspo", "cispo", "topr", "kl"];

/// A token-level loss's value and terms under `mode`, with this call's counts.
fn loss_and_terms(
    name: &str,
    lp: &Tensor,
    old: &Tensor,
    adv: &Tensor,
    m: &Tensor,
    mode: AggregationMode,
) -> (Tensor, Tensor) {
    let norm = Normalizer::local();
    let ppo = PpoConfig::ppo().with_aggregation(mode);
    match name {
        "ppo" => {
            let o = ppo_clip_loss_output(lp, old, adv, m, &ppo, &norm).unwrap();
            (o.loss, o.terms)
        }
        "gspo" => {
            let o = gspo_loss_output(lp, old, adv, m, &ppo, &norm).unwrap();
            (o.loss, o.terms)
        }
        "cispo" => {
            let o = cispo_loss_output(lp, old, adv, m, &ppo, &norm).unwrap();
            (o.loss, o.terms)
        }
        "topr" => {
            let o = topr_token_loss_output(lp, old, adv, m, &ToprTokenConfig::trinity().with_aggregation(mode), &norm)
                .unwrap();
            (o.loss, o.terms)
        }
        _ => {
            let o =
                kl_penalty_output(lp, old, m, &KlConfig::k3().with_coef(1.0).with_aggregation(mode), &norm).unwrap();
            (o.loss, o.terms)
        }
    }
}

fn bools(t: &Tensor) -> Vec<bool> {
    Vec::<bool>::try_from(&t.flatten(0, -1)).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn weights_match_scalar_reference_with_nan_padding(b in batch()) {
        let (lp, lr, _, m) = b.tensors(f64::NAN);
        for cfg in configs() {
            let w = rollout_weights(&lp, &lr, &m, &cfg).unwrap();
            let want = ref_weights(&b, &cfg);
            assert_close(&vec1(&w.weights), &want.concat(), 1e-12, &format!("{cfg:?}"));
            let d = w.diagnostics.read().unwrap();
            let valid: Vec<f64> =
                ref_weights(&b, &cfg.with_batch_normalize(false).with_sequence_normalize(false)).concat().into_iter().zip(b.mask.concat()).filter(|(_, m)| *m).map(|(w, _)| w).collect();
            assert_close(&[d.ess], &[ref_ess(&valid)], 1e-10, "ess");
            prop_assert!(d.weight_max <= cfg.max + 1e-12);
        }
    }

    #[test]
    fn rejection_matches_scalar_reference(b in batch()) {
        let (lp, lr, _, m) = b.tensors(f64::NAN);
        for rule in rules() {
            let kept = rollout_rejection_mask(&lp, &lr, &m, &rule).unwrap();
            prop_assert_eq!(bools(&kept), ref_rejection(&b, &rule).concat(), "{:?}", rule);
        }
    }

    /// Several rules at once: each scalar rule on the original mask, intersected (verl's
    /// combination), whatever the order of the rules.
    #[test]
    fn several_rules_match_the_intersection_of_each_on_the_original_mask(b in batch(), picks in prop::collection::vec(0usize..14, 1..4)) {
        let (lp, lr, _, m) = b.tensors(f64::NAN);
        let all = rules();
        let chosen: Vec<Rejection> = picks.iter().map(|&i| all[i % all.len()]).collect();
        let want: Vec<bool> = chosen
            .iter()
            .map(|r| ref_rejection(&b, r).concat())
            .fold(b.mask.concat(), |acc, k| acc.iter().zip(&k).map(|(a, b)| *a && *b).collect());
        let kept = rollout_rejection_mask_all(&lp, &lr, &m, &chosen).unwrap();
        prop_assert_eq!(bools(&kept), want.clone());
        let reversed: Vec<Rejection> = chosen.iter().rev().copied().collect();
        prop_assert_eq!(bools(&rollout_rejection_mask_all(&lp, &lr, &m, &reversed).unwrap()), want);
    }

    #[test]
    fn off_policy_mask_matches_scalar_reference(b in batch(), threshold in -0.5f64..1.0) {
        let (lp, lr, adv, m) = b.tensors(f64::NAN);
        let kept = off_policy_sequence_mask(&lp, &lr, &adv, &m, threshold).unwrap();
        let want: Vec<bool> = (0..b.logp.len())
            .flat_map(|i| {
                let d: Vec<f64> = (0..b.logp[i].len()).filter(|&t| b.mask[i][t]).map(|t| b.other[i][t] - b.logp[i][t]).collect();
                let kl = d.iter().sum::<f64>() / (d.len().max(1) as f64);
                let keep = b.weights[i] >= 0.0 || kl <= threshold;
                b.mask[i].iter().map(move |&mk| mk && keep).collect::<Vec<_>>()
            })
            .collect();
        prop_assert_eq!(bools(&kept), want);
    }

    /// With weights 1 the re-aggregated terms are the loss itself, for every token-level loss and
    /// aggregation; with any weights the result is the weighted sum of the terms by the
    /// aggregation's definition, and padding (NaN) gets exactly zero gradient.
    #[test]
    fn weighted_terms_match_definition_for_every_loss(b in batch(), mode_i in 0usize..6) {
        let mode = ALL_MODES[mode_i];
        let (lp0, old, adv, m) = b.tensors(f64::NAN);
        let w: Vec<Vec<f64>> = b.logp.iter().enumerate().map(|(i, r)| r.iter().enumerate().map(|(t, _)| 0.25 + ((i * 7 + t * 3) % 5) as f64 * 0.4).collect()).collect();
        let wt = t2(&w);
        let norm = Normalizer::local();
        let alpha = ref_alpha(&b.mask, mode, None);
        for name in LOSSES {
            let lp = leaf(&lp0);
            let (loss, terms) = loss_and_terms(name, &lp, &old, &adv, &m, mode);
            let ones = apply_token_weights(&terms, &wt.ones_like(), &m, mode, &norm).unwrap();
            assert_close(&[scalar(&ones)], &[scalar(&loss)], 1e-12, &format!("{name}: weights 1"));
            let weighted = apply_token_weights(&terms, &wt, &m, mode, &norm).unwrap();
            let tv = vec1(&terms);
            let tlen = b.mask[0].len();
            let mut want = 0.0;
            for i in 0..b.mask.len() {
                for t in 0..tlen {
                    if b.mask[i][t] { want += alpha[i] * w[i][t] * tv[i * tlen + t]; }
                }
            }
            assert_close(&[scalar(&weighted)], &[want], 1e-10, &format!("{name}: weighted"));
            weighted.backward();
            let g = vec1(&lp.grad());
            let padding_ok = g.iter().zip(b.mask.concat()).all(|(g, mk)| if mk { g.is_finite() } else { *g == 0.0 });
            prop_assert!(padding_ok, "{}: padding gradient {:?}", name, g);
        }
    }

    /// Weighted losses with global counts add up over micro-batches to the whole batch's loss.
    #[test]
    fn weighted_loss_is_split_invariant(b in batch(), split in 1usize..5) {
        let (lp, old, adv, m) = b.tensors(0.0);
        let w = rollout_weights(&lp, &old, &m, &RolloutCorrection::sequence_tis(2.0)).unwrap().weights;
        let mode = AggregationMode::SeqMeanTokenMean;
        let cfg = PpoConfig::gspo().with_clip(0.2, 0.2);
        let norm = Normalizer::from_masks(&[&m]).unwrap();
        let whole = {
            let o = gspo_loss_output(&lp, &old, &adv, &m, &cfg, &norm).unwrap();
            scalar(&apply_token_weights(&o.terms, &w, &m, mode, &norm).unwrap())
        };
        let n = b.mask.len() as i64;
        let k = (split as i64).min(n);
        let mut sum = 0.0;
        let mut start = 0;
        for part in 0..k {
            let len = n / k + i64::from(part < n % k);
            let s = |t: &Tensor| t.narrow(0, start, len);
            let o = gspo_loss_output(&s(&lp), &s(&old), &s(&adv), &s(&m), &cfg, &norm).unwrap();
            sum += scalar(&apply_token_weights(&o.terms, &s(&w), &s(&m), mode, &norm).unwrap());
            start += len;
        }
        assert_close(&[sum], &[whole], 1e-10, "split");
    }
}

#[test]
fn weighted_gradient_matches_finite_differences() {
    let logp = vec![-1.0, -0.4, -2.2, -0.9, -1.3, -0.2];
    let old = t2(&[vec![-1.1, -0.5, -2.0], vec![-0.7, -1.5, -0.3]]);
    let adv = t1(&[0.7, -1.3]);
    let m = t2(&[vec![1.0, 1.0, 1.0], vec![1.0, 1.0, 0.0]]);
    let w = t2(&[vec![0.5, 2.0, 1.0], vec![1.5, 0.25, 9.0]]);
    let cfg = PpoConfig::dapo().with_dual_clip(Some(3.0));
    // TOPR's value is its objective (CISPO's is only a surrogate: no finite-difference check).
    let topr = ToprTokenConfig::paper();
    let norm = Normalizer::local();
    let f = |x: &[f64]| -> f64 {
        let lp = Tensor::from_slice(x).view([2, 3]);
        let o = topr_token_loss_output(&lp, &old, &adv, &m, &topr, &norm).unwrap();
        scalar(&apply_token_weights(&o.terms, &w, &m, topr.aggregation, &norm).unwrap())
    };
    let lp = leaf(&Tensor::from_slice(&logp).view([2, 3]));
    let o = ppo_clip_loss_output(&lp, &old, &adv, &m, &cfg, &norm).unwrap();
    apply_token_weights(&o.terms, &w, &m, cfg.aggregation, &norm).unwrap().backward();
    let g = |x: &[f64]| -> f64 {
        let lp = Tensor::from_slice(x).view([2, 3]);
        let o = ppo_clip_loss_output(&lp, &old, &adv, &m, &cfg, &norm).unwrap();
        scalar(&apply_token_weights(&o.terms, &w, &m, cfg.aggregation, &norm).unwrap())
    };
    assert_close(&vec1(&lp.grad()), &finite_difference(&logp, 1e-6, g), 1e-6, "ppo weighted grad");
    let lp = leaf(&Tensor::from_slice(&logp).view([2, 3]));
    let o = topr_token_loss_output(&lp, &old, &adv, &m, &topr, &norm).unwrap();
    apply_token_weights(&o.terms, &w, &m, topr.aggregation, &norm).unwrap().backward();
    assert_close(&vec1(&lp.grad()), &finite_difference(&logp, 1e-6, f), 1e-6, "topr weighted grad");
}

#[test]
fn extreme_log_ratios_give_finite_bounded_weights() {
    let lp = t2(&[vec![0.0, -1e4, 0.0], vec![-3.0, -2.0, -1.0]]);
    let lr = t2(&[vec![-1e4, 0.0, 0.0], vec![-1e4, -1e4, -1e4]]);
    let m = t2(&[vec![1.0, 1.0, 1.0], vec![1.0, 1.0, 1.0]]);
    for cfg in configs() {
        let w = rollout_weights(&lp, &lr, &m, &cfg).unwrap();
        let v = vec1(&w.weights);
        assert!(v.iter().all(|x| x.is_finite() && *x >= 0.0), "{cfg:?}: {v:?}");
        let d = w.diagnostics.read().unwrap();
        assert!(d.ess.is_finite() && d.chi2.is_finite() && d.k3_kl.is_finite() && d.kl.is_finite(), "{d:?}");
    }
    for rule in rules() {
        let kept = rollout_rejection_mask(&lp, &lr, &m, &rule).unwrap();
        assert_eq!(kept.size(), vec![2, 3]);
    }
}

#[test]
fn half_precision_inputs_compute_in_f32() {
    let lp = Tensor::from_slice2(&[[-1.0f32, -2.0], [-0.5, -0.25]]);
    let lr = Tensor::from_slice2(&[[-1.5f32, -1.0], [-0.5, -3.0]]);
    let m = Tensor::from_slice2(&[[true, true], [true, false]]);
    let want = rollout_weights(&lp, &lr, &m, &RolloutCorrection::token_tis(2.0)).unwrap().weights;
    for kind in [Kind::Half, Kind::BFloat16] {
        let w = rollout_weights(&lp.to_kind(kind), &lr.to_kind(kind), &m, &RolloutCorrection::token_tis(2.0)).unwrap();
        assert_eq!(w.weights.kind(), Kind::Float);
        let tol = if kind == Kind::Half { 2e-3 } else { 2e-2 };
        assert_close(&vec1(&w.weights), &vec1(&want), tol, &format!("{kind:?}"));
    }
}

#[test]
fn effective_sample_size_by_definition() {
    let w = t1(&[1.0, 3.0, 0.0, 2.0]);
    let m = Tensor::from_slice(&[true, true, false, true]);
    assert_close(&[scalar(&effective_sample_size(&w, &m).unwrap())], &[ref_ess(&[1.0, 3.0, 2.0])], 1e-14, "ess");
    assert_eq!(scalar(&effective_sample_size(&w.zeros_like(), &m).unwrap()), 0.0);
    let one = t1(&[0.0, 0.0, 5.0]);
    assert_close(&[scalar(&effective_sample_size(&one, &one.ones_like()).unwrap())], &[1.0 / 3.0], 1e-14, "one");
}

#[test]
fn bad_inputs_are_errors_naming_the_argument() {
    let lp = t2(&[vec![-1.0, -2.0]]);
    let m = t2(&[vec![1.0, 1.0]]);
    let named = |e: LossError, want: &str| assert!(e.to_string().contains(want), "{e} lacks {want}");
    named(rollout_weights(&lp, &t2(&[vec![-1.0]]), &m, &RolloutCorrection::default()).unwrap_err(), "logp_rollout");
    named(rollout_weights(&lp, &lp, &m, &RolloutCorrection::token_tis(-1.0)).unwrap_err(), "max");
    named(rollout_weights(&lp, &lp, &m, &RolloutCorrection::token_mis(f64::NAN, 2.0)).unwrap_err(), "min");
    named(rollout_weights(&lp, &lp, &m, &RolloutCorrection::token_mis(1.0, 1.0)).unwrap_err(), "max");
    named(rollout_rejection_mask(&lp, &lp, &m, &Rejection::k3(RejectionScope::Token, 0.0)).unwrap_err(), "max");
    named(
        rollout_rejection_mask(&lp, &lp, &m, &Rejection::k1(RejectionScope::SequenceMax, 0.5, 2.0)).unwrap_err(),
        "scope",
    );
    named(
        rollout_rejection_mask(&lp, &t2(&[vec![f64::NAN, 0.0]]), &m, &Rejection::k2(RejectionScope::Token, 1.0))
            .unwrap_err(),
        "logp_rollout",
    );
    named(off_policy_sequence_mask(&lp, &lp, &t1(&[1.0, 2.0]), &m, 0.1).unwrap_err(), "advantages");
    named(off_policy_sequence_mask(&lp, &lp, &t1(&[1.0]), &m, f64::INFINITY).unwrap_err(), "threshold");
    named(
        apply_token_weights(&lp, &t1(&[1.0, 2.0]), &m, AggregationMode::TokenMean, &Normalizer::local()).unwrap_err(),
        "weights",
    );
    named(
        apply_token_weights(&lp, &t2(&[vec![f64::NAN, 1.0]]), &m, AggregationMode::TokenMean, &Normalizer::local())
            .unwrap_err(),
        "weights",
    );
    named(
        apply_token_weights(&t1(&[1.0]), &t1(&[1.0]), &m, AggregationMode::TokenMean, &Normalizer::local())
            .unwrap_err(),
        "terms",
    );
    named(effective_sample_size(&t1(&[1.0]), &t1(&[1.0, 1.0])).unwrap_err(), "mask");
}

/// Fixed inputs for the peer comparisons: two policies that differ by up to ±1.5 per token, some
/// padding, advantages of both signs.
type PeerBatch = (Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<f64>);

fn peer_batch() -> PeerBatch {
    let mut state = 12345u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let (b, t) = (6, 7);
    let mut logp = vec![vec![0.0; t]; b];
    let mut rollout = vec![vec![0.0; t]; b];
    let mut mask = vec![vec![0.0; t]; b];
    for i in 0..b {
        let len = 2 + i % 6;
        for j in 0..t {
            logp[i][j] = -0.05 - 3.0 * next();
            rollout[i][j] = logp[i][j] - (next() - 0.5) * if i % 2 == 0 { 0.6 } else { 3.0 };
            // Every log-prob at most 0, the policy's new log-probs (up to 0.15 above these) included.
            let [l, r, _] = non_positive([logp[i][j], rollout[i][j], logp[i][j] + 0.15]);
            (logp[i][j], rollout[i][j]) = (l, r);
            mask[i][j] = if j < len { 1.0 } else { 0.0 };
        }
    }
    let adv = (0..b).map(|i| if i % 3 == 0 { -1.0 + 0.1 * i as f64 } else { 0.8 - 0.2 * i as f64 }).collect();
    (logp, rollout, mask, adv)
}

#[test]
fn matches_verl_and_trl() {
    let (logp, rollout, mask, adv) = peer_batch();
    let (lp, lr, m, a) = (t2(&logp), t2(&rollout), t2(&mask), t1(&adv));
    let is_cases: Vec<(RolloutCorrection, &str, serde_json::Value)> = vec![
        (RolloutCorrection::token_tis(2.0), "token", json!(2.0)),
        (RolloutCorrection::token_tis(1.2), "token", json!(1.2)),
        (RolloutCorrection::sequence_tis(2.0), "sequence", json!(2.0)),
        (RolloutCorrection::token_mis(0.5, 2.0), "token", json!("0.5_2.0")),
        (RolloutCorrection::sequence_mis(0.5, 2.0), "sequence", json!("0.5_2.0")),
        (RolloutCorrection::token_tis(2.0).with_batch_normalize(true), "token", json!(2.0)),
        (RolloutCorrection::sequence_tis(3.0).with_batch_normalize(true), "sequence", json!(3.0)),
    ];
    let rs_cases: Vec<(Rejection, &str, &str)> = vec![
        (Rejection::k1(RejectionScope::Token, 0.6, 1.5), "token_k1", "0.6_1.5"),
        (Rejection::k2(RejectionScope::Token, 0.1), "token_k2", "0.1"),
        (Rejection::k3(RejectionScope::Token, 0.1), "token_k3", "0.1"),
        (Rejection::k1(RejectionScope::SequenceSum, 0.5, 2.0), "seq_sum_k1", "0.5_2.0"),
        (Rejection::k2(RejectionScope::SequenceSum, 0.5), "seq_sum_k2", "0.5"),
        (Rejection::k3(RejectionScope::SequenceSum, 0.4), "seq_sum_k3", "0.4"),
        (Rejection::k1(RejectionScope::SequenceMean, 0.8, 1.25), "seq_mean_k1", "0.8_1.25"),
        (Rejection::k2(RejectionScope::SequenceMean, 0.05), "seq_mean_k2", "0.05"),
        (Rejection::k3(RejectionScope::SequenceMean, 0.05), "seq_mean_k3", "0.05"),
        (Rejection::k2(RejectionScope::SequenceMax, 0.2), "seq_max_k2", "0.2"),
        (Rejection::k3(RejectionScope::SequenceMax, 0.2), "seq_max_k3", "0.2"),
    ];
    let trl_cases: Vec<(RolloutCorrection, &str, f64, f64)> = vec![
        (RolloutCorrection::token_tis(2.0).with_bounds(0.5, 2.0), "token_truncate", 0.5, 2.0),
        (RolloutCorrection::sequence_tis(3.0).with_bounds(0.2, 3.0), "sequence_truncate", 0.2, 3.0),
        (RolloutCorrection::token_mis(0.5, 2.0), "token_mask", 0.5, 2.0),
        (RolloutCorrection::sequence_mis(0.1, 3.0), "sequence_mask", 0.1, 3.0),
    ];
    // The policy losses with rollout weights: verl's vanilla PPO (dual clip 3) and GSPO.
    let logp_new: Vec<Vec<f64>> =
        logp.iter().map(|r| r.iter().enumerate().map(|(j, x)| x + 0.15 * ((j % 3) as f64 - 1.0)).collect()).collect();
    let tis = rollout_weights(&lp, &lr, &m, &RolloutCorrection::token_tis(2.0)).unwrap().weights;
    let seq_tis = rollout_weights(&lp, &lr, &m, &RolloutCorrection::sequence_tis(2.0)).unwrap().weights;
    let loss_cases: Vec<(&str, &str, AggregationMode, PpoConfig, &Tensor)> = vec![
        ("vanilla", "token-mean", AggregationMode::TokenMean, PpoConfig::ppo().with_dual_clip(Some(3.0)), &tis),
        (
            "vanilla",
            "seq-mean-token-sum",
            AggregationMode::SeqMeanTokenSum,
            PpoConfig::dapo().with_dual_clip(Some(3.0)),
            &seq_tis,
        ),
        // GSPO with sequence-level weights: verl's GSPO-token gives each token its own weight in the
        // gradient, this crate's GSPO spreads a sequence's loss over its tokens; the two agree when
        // the weight is constant over each sequence (see `apply_token_weights`).
        ("gspo", "seq-mean-token-mean", AggregationMode::SeqMeanTokenMean, PpoConfig::gspo(), &seq_tis),
        ("gspo", "token-mean", AggregationMode::TokenMean, PpoConfig::gspo().with_clip(0.2, 0.3), &seq_tis),
    ];

    let mut calls = Vec::new();
    for (_, level, thr) in &is_cases {
        let bn = calls.len() == 5 || calls.len() == 6;
        calls.push(json!({"fn": "verl.rollout_weights", "args": {"logp": logp, "logp_rollout": rollout, "mask": mask, "level": level, "threshold": thr, "batch_normalize": bn}}));
    }
    calls.push(json!({"fn": "verl.offpolicy_metrics", "args": {"logp": logp, "logp_rollout": rollout, "mask": mask}}));
    for (_, opt, thr) in &rs_cases {
        calls.push(json!({"fn": "verl.rejection_mask", "args": {"logp": logp, "logp_rollout": rollout, "mask": mask, "options": opt, "threshold": thr}}));
    }
    // Several options at once (verl: each on the original mask, intersected), a token rule first.
    let combos: Vec<(Vec<usize>, &str, &str)> = vec![
        (vec![1, 10], "token_k2,seq_max_k3", "0.1,0.2"),
        (vec![0, 4, 7], "token_k1,seq_sum_k2,seq_mean_k2", "0.6_1.5,0.5,0.05"),
        (vec![2, 5], "token_k3,seq_sum_k3", "0.1,0.4"),
    ];
    for (_, opt, thr) in &combos {
        calls.push(json!({"fn": "verl.rejection_mask", "args": {"logp": logp, "logp_rollout": rollout, "mask": mask, "options": opt, "threshold": thr}}));
    }
    for (_, mode, lo, hi) in &trl_cases {
        calls.push(json!({"fn": "trl.importance_sampling_ratio", "args": {"logp": logp, "logp_rollout": rollout, "mask": mask, "mode": mode, "clip_min": lo, "clip_max": hi}}));
    }
    for thr in [0.0, 0.05, 0.3] {
        calls.push(json!({"fn": "trl.off_policy_mask", "args": {"logp": logp, "logp_rollout": rollout, "advantages": adv, "mask": mask, "threshold": thr}}));
    }
    for (loss, agg, _, cfg, w) in &loss_cases {
        let wv: Vec<Vec<f64>> = (0..6).map(|i| vec1(&w.get(i))).collect();
        calls.push(json!({"fn": "verl.policy_loss_with_is", "args": {"loss": loss, "logp": logp_new, "logp_old": logp, "advantages": adv, "mask": mask, "weights": wv, "agg": agg, "clip_low": cfg.clip_low, "clip_high": cfg.clip_high}}));
    }
    let Some(res) = peer(&calls) else { return };
    let mut it = res.iter();

    for (cfg, _, _) in &is_cases {
        let r = it.next().unwrap();
        let w = rollout_weights(&lp, &lr, &m, cfg).unwrap();
        // Normalised weights differ by verl's masked_mean's (count + 1e-8).
        let tol = if cfg.batch_normalize { 1e-8 } else { 1e-12 };
        assert_close(&vec1(&w.weights), &json_f64(&r["weights"]), tol, &format!("verl weights {cfg:?}"));
        let d = w.diagnostics.read().unwrap();
        // verl's ESS is 1 / mean((w / (mean w + 1e-8))²): equal up to that 1e-8.
        assert_close(&[d.ess], &json_f64(&r["ess"]), 1e-7, &format!("verl ess {cfg:?}"));
        // verl's rollout_is_mean is the mean over tokens (sequence weights counted once per token)
        // before normalisation, and its masked_mean divides by (count + 1e-8).
        let raw = vec1(&rollout_weights(&lp, &lr, &m, &cfg.with_batch_normalize(false)).unwrap().weights);
        let token_mean =
            raw.iter().zip(mask.concat()).map(|(w, m)| w * m).sum::<f64>() / mask.concat().iter().sum::<f64>();
        assert_close(&[token_mean], &[json_f64(&r["mean"])[0]], 1e-8, &format!("verl mean {cfg:?}"));
        if cfg.level == CorrectionLevel::Token {
            assert_close(&[d.weight_mean], &[token_mean], 1e-12, "weight_mean");
        }
    }
    let r = it.next().unwrap();
    let d = rollout_weights(&lp, &lr, &m, &RolloutCorrection::default()).unwrap().diagnostics.read().unwrap();
    assert_close(
        &[d.kl, d.k3_kl, d.chi2],
        &[json_f64(&r["kl"])[0], json_f64(&r["k3_kl"])[0], json_f64(&r["chi2"])[0]],
        1e-8,
        "verl off-policy metrics (masked_mean: count + 1e-8)",
    );
    for (rule, opt, _) in &rs_cases {
        let r = it.next().unwrap();
        let kept = rollout_rejection_mask(&lp, &lr, &m, rule).unwrap();
        let want: Vec<bool> = json_f64(&r["mask"]).iter().map(|x| *x != 0.0).collect();
        assert_eq!(bools(&kept), want, "verl rejection {opt}");
        assert!(
            want.iter().filter(|k| !**k).count() > mask.concat().iter().filter(|x| **x == 0.0).count()
                || *opt == "seq_mean_k1",
            "{opt} rejects nothing: a weak case"
        );
    }
    let mut chained_differs = false;
    for (picks, opt, _) in &combos {
        let r = it.next().unwrap();
        let chosen: Vec<Rejection> = picks.iter().map(|&i| rs_cases[i].0).collect();
        let kept = rollout_rejection_mask_all(&lp, &lr, &m, &chosen).unwrap();
        let want: Vec<bool> = json_f64(&r["mask"]).iter().map(|x| *x != 0.0).collect();
        assert_eq!(bools(&kept), want, "verl rejection {opt}");
        let chained =
            chosen.iter().fold(m.shallow_clone(), |mk, rule| rollout_rejection_mask(&lp, &lr, &mk, rule).unwrap());
        chained_differs |= bools(&chained) != want;
    }
    assert!(chained_differs, "no combination where chaining differs from verl: a weak case");
    for (cfg, mode, _, _) in &trl_cases {
        let r = it.next().unwrap();
        let w = rollout_weights(&lp, &lr, &m, cfg).unwrap();
        assert_close(&vec1(&w.weights), &json_f64(&r["weights"]), 1e-12, &format!("TRL {mode}"));
    }
    for thr in [0.0, 0.05, 0.3] {
        let r = it.next().unwrap();
        let kept = off_policy_sequence_mask(&lp, &lr, &a, &m, thr).unwrap();
        let want: Vec<bool> = json_f64(&r["mask"]).iter().map(|x| *x != 0.0).collect();
        assert_eq!(bools(&kept), want, "TRL off-policy mask {thr}");
    }
    let lp_new = t2(&logp_new);
    for (loss, _, mode, cfg, w) in &loss_cases {
        let r = it.next().unwrap();
        let x = leaf(&lp_new);
        let cfg = cfg.with_aggregation(*mode);
        let norm = Normalizer::local();
        let out = match *loss {
            "vanilla" => ppo_clip_loss_output(&x, &lp, &a, &m, &cfg, &norm).unwrap(),
            _ => gspo_loss_output(&x, &lp, &a, &m, &cfg, &norm).unwrap(),
        };
        let v = apply_token_weights(&out.terms, w, &m, *mode, &norm).unwrap();
        v.backward();
        // verl's seq-mean-token-mean divides by (L + 1e-8).
        assert_close(&[scalar(&v)], &[json_f64(&r["value"])[0]], 1e-8, &format!("verl {loss} value"));
        assert_close(&vec1(&x.grad()), &json_f64(&r["grad"]), 1e-8, &format!("verl {loss} grad"));
    }
}

/// verl's bypass mode (the rollout's log-probs serve as the old policy) is a composition of this
/// crate's calls, tested against verl's own `compute_policy_loss_bypass_mode`:
/// - `loss_type="reinforce"` with token TIS at `C` and rejection rules: CISPO with no lower clip
///   and an upper clip at `C − 1` (its weight is `sg(min(r, C))`, the token-TIS weight of
///   `π / μ`) on the mask the rules keep;
/// - `loss_type="ppo_clip"`: PPO-clip of π against the rollout's log-probs on that mask.
#[test]
fn verls_bypass_mode_is_cispo_or_ppo_on_the_rejection_mask() {
    let (logp, rollout, mask, adv) = peer_batch();
    // The current policy a little away from the old one, so that the weights and the rules bite.
    let logp_new: Vec<Vec<f64>> = logp
        .iter()
        .map(|r| r.iter().enumerate().map(|(j, x)| (x + 0.15 * ((j % 3) as f64 - 1.0)).min(0.0)).collect())
        .collect();
    let per_token: Vec<Vec<f64>> = adv.iter().zip(&mask).map(|(a, r)| vec![*a; r.len()]).collect();
    let (lr, m, a) = (t2(&rollout), t2(&mask), t1(&adv));
    let rules = [Rejection::k2(RejectionScope::Token, 0.3), Rejection::k3(RejectionScope::SequenceMax, 0.5)];
    let cases = [
        ("reinforce", "token-mean", AggregationMode::TokenMean),
        ("reinforce", "seq-mean-token-mean", AggregationMode::SeqMeanTokenMean),
        ("ppo_clip", "token-mean", AggregationMode::TokenMean),
    ];
    let calls: Vec<serde_json::Value> = cases
        .iter()
        .map(|(ty, agg, _)| json!({"fn": "verl.bypass_mode", "args": {"logp": logp_new, "logp_rollout": rollout, "advantages": per_token, "mask": mask, "loss_type": ty, "rollout_is": "token", "is_threshold": 2.0, "rs": "token_k2,seq_max_k3", "rs_threshold": "0.3,0.5", "clip_low": 0.2, "clip_high": 0.28, "loss_agg_mode": agg}}))
        .collect();
    let Some(res) = peer(&calls) else { return };
    let mut rejected = 0;
    for ((ty, agg, mode), r) in cases.iter().zip(&res) {
        let x = leaf(&t2(&logp_new));
        let kept = rollout_rejection_mask_all(&x, &lr, &m, &rules).unwrap();
        rejected = bools(&kept).iter().filter(|k| !**k).count() - mask.concat().iter().filter(|v| **v == 0.0).count();
        let cfg = match *ty {
            "reinforce" => PpoConfig::cispo().with_clip(f64::INFINITY, 1.0),
            _ => PpoConfig::ppo().with_clip(0.2, 0.28).with_dual_clip(None),
        }
        .with_aggregation(*mode);
        let loss = match *ty {
            "reinforce" => cispo_loss_output(&x, &lr, &a, &kept, &cfg, &Normalizer::local()).unwrap().loss,
            _ => ppo_clip_loss_output(&x, &lr, &a, &kept, &cfg, &Normalizer::local()).unwrap().loss,
        };
        loss.backward();
        let what = format!("bypass {ty} {agg}");
        // verl's seq-mean-token-mean divides by L_i + 1e-8.
        let tol = if *agg == "token-mean" { 1e-12 } else { 1e-7 };
        assert_close(&[scalar(&loss)], &json_f64(&r["value"]), tol, &format!("{what} value"));
        assert_close(&vec1(&x.grad()), &json_f64(&r["grad"]), tol, &format!("{what} grad"));
    }
    assert!(rejected > 0, "the rules reject nothing: a weak case");
}
