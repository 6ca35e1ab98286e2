//! `topr_token_loss` against a scalar reference for every ratio level and aggregation mode,
//! padding that holds NaN/inf, finite differences, split invariance and diagnostics.

mod common;

use common::*;
use proptest::prelude::*;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, LossError, Normalizer, RatioLevel, TieRule, ToprConfig, ToprTokenConfig, aggregate,
    topr_token_loss, topr_token_loss_output,
};

const MODES: [AggregationMode; 6] = ALL_MODES;
const LEVELS: [RatioLevel; 3] = [RatioLevel::Sequence, RatioLevel::SequenceMean, RatioLevel::Token];

type Batch = TokenBatch;

fn batch() -> impl Strategy<Value = Batch> {
    token_batch(0.8, prop_oneof![Just(1.0f64), Just(-1.0), Just(0.0), -2.0f64..2.0].boxed())
}

/// Value and per-token gradient of the token-level loss, by plain loops.
fn ref_token(b: &Batch, cfg: &ToprTokenConfig, global: Option<(f64, f64)>) -> (f64, Vec<Vec<f64>>) {
    let lim = [cfg.topr.a_pos, cfg.topr.b_pos, cfg.topr.a_neg, cfg.topr.b_neg];
    let ties_positive = cfg.topr.tie == TieRule::Positive;
    let alpha = ref_alpha(&b.mask, cfg.aggregation, global);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for i in 0..b.mask.len() {
        let rp = b.weights[i] - cfg.topr.baseline;
        let (a, bb) = ref_limits(rp, lim, ties_positive);
        let toks: Vec<usize> = (0..b.mask[i].len()).filter(|&t| b.mask[i][t]).collect();
        if toks.is_empty() {
            continue;
        }
        let deltas: Vec<f64> = toks.iter().map(|&t| b.logp[i][t] - b.other[i][t]).collect();
        let l = toks.len() as f64;
        match cfg.ratio {
            RatioLevel::Sequence | RatioLevel::SequenceMean => {
                let s: f64 = deltas.iter().sum::<f64>() / if cfg.ratio == RatioLevel::Sequence { 1.0 } else { l };
                let x = s.exp();
                let scale = if cfg.ratio == RatioLevel::Sequence { 1.0 } else { l };
                value += alpha[i] * scale * -rp * ref_taper(x, a, bb);
                for &t in &toks {
                    grad[i][t] = alpha[i] * -rp * ref_weight(x, a, bb);
                }
            }
            RatioLevel::Token => {
                for (&t, d) in toks.iter().zip(&deltas) {
                    let x = d.exp();
                    value += alpha[i] * -rp * ref_taper(x, a, bb);
                    grad[i][t] = alpha[i] * -rp * ref_weight(x, a, bb);
                }
            }
            other => unreachable!("a ratio level without a reference: {other:?}"),
        }
    }
    (value, grad)
}

fn run(b: &Batch, cfg: &ToprTokenConfig, padding: f64) -> (f64, Vec<f64>) {
    let (lp, mu, r, m) = b.tensors(padding);
    let lp = leaf(&lp);
    let loss = topr_token_loss(&lp, &mu, &r, &m, cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&lp.grad()))
}

fn configs() -> Vec<ToprTokenConfig> {
    let mut out = vec![];
    for topr in [
        ToprConfig::canonical().with_baseline(0.2),
        ToprConfig::tis().with_baseline(-0.3),
        ToprConfig::sft(),
        ToprConfig::canonical().with_positive_limits(0.5, 1.5).with_negative_limits(0.1, 0.9).with_baseline(0.1),
    ] {
        for ratio in LEVELS {
            for aggregation in MODES {
                for tie in [TieRule::Positive, TieRule::Tapered] {
                    out.push(
                        ToprTokenConfig::paper()
                            .with_topr(topr.with_tie(tie))
                            .with_ratio(ratio)
                            .with_aggregation(aggregation),
                    );
                }
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in configs() {
            let (v, g) = run(&b, &cfg, f64::NAN);
            let (rv, rg) = ref_token(&b, &cfg, None);
            assert_close(&[v], &[rv], 1e-10, &format!("{cfg:?} value"));
            assert_close(&g, &rg.concat(), 1e-10, &format!("{cfg:?} grad"));
        }
    }

    #[test]
    fn padding_gets_exactly_zero_gradient_whatever_it_holds(b in batch(), pad in prop_oneof![Just(f64::NAN), Just(f64::INFINITY), Just(f64::NEG_INFINITY), Just(1e30)]) {
        for cfg in [ToprTokenConfig::paper(), ToprTokenConfig::verl(), ToprTokenConfig::trinity()] {
            let (v, g) = run(&b, &cfg, pad);
            let (v0, g0) = run(&b, &cfg, 0.0);
            prop_assert!(v.is_finite());
            prop_assert_eq!(v, v0);
            for (k, m) in b.mask.concat().iter().enumerate() {
                if !m { prop_assert!(g[k] == 0.0, "padding gradient {} (exactly zero, either sign)", g[k]); }
            }
            prop_assert_eq!(g, g0);
        }
    }

    #[test]
    fn split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        for ratio in LEVELS {
            assert_split_invariant(&b, split, &format!("{ratio:?}"), &|lp, mu, r, m, mode, norm| {
                let topr = ToprConfig::canonical().with_baseline(0.1);
                let cfg = ToprTokenConfig::paper().with_topr(topr).with_ratio(ratio).with_aggregation(mode);
                match norm {
                    Some(n) => topr_token_loss_output(lp, mu, r, m, &cfg, n).map(|o| o.loss),
                    None => topr_token_loss(lp, mu, r, m, &cfg),
                }
            });
        }
    }

    #[test]
    fn terms_aggregate_to_the_loss_value_and_gradient(b in batch()) {
        let (lp, mu, r, m) = b.tensors(f64::NAN);
        let norm = Normalizer::from_masks(&[&m]).unwrap();
        for cfg in configs() {
            let (lp_a, lp_b) = (leaf(&lp), leaf(&lp));
            let out = topr_token_loss_output(&lp_a, &mu, &r, &m, &cfg, &norm).unwrap();
            out.loss.backward();
            let again = aggregate(&topr_token_loss_output(&lp_b, &mu, &r, &m, &cfg, &norm).unwrap().terms, &m, cfg.aggregation, &norm).unwrap();
            again.backward();
            assert_close(&[scalar(&again)], &[scalar(&out.loss)], 1e-12, &format!("{cfg:?} terms value"));
            assert_close(&vec1(&lp_b.grad()), &vec1(&lp_a.grad()), 1e-12, &format!("{cfg:?} terms grad"));
            for (k, mk) in b.mask.concat().iter().enumerate() {
                if !mk { prop_assert_eq!(vec1(&out.terms)[k], 0.0); }
            }
        }
    }

    #[test]
    fn sequence_level_matches_topr_loss_on_summed_log_probs(b in batch()) {
        // With the paper's sequence ratio and SeqMeanTokenSum, the token form is `topr_loss` on Σ_t logp.
        let cfg = ToprTokenConfig::paper().with_aggregation(AggregationMode::SeqMeanTokenSum);
        prop_assume!(b.mask.iter().all(|r| r.iter().any(|m| *m)));
        let (lp, mu, r, m) = b.tensors(0.0);
        let mf = m.to_kind(Kind::Double);
        let seq = topr_loss::topr_loss(&(&lp * &mf).sum_dim_intlist(1, false, None::<Kind>), &(&mu * &mf).sum_dim_intlist(1, false, None::<Kind>), &r, &cfg.topr).unwrap();
        let tok = topr_token_loss(&lp, &mu, &r, &m, &cfg).unwrap();
        assert_close(&[scalar(&tok)], &[scalar(&seq)], 1e-12, "token vs sequence form");
    }
}

#[test]
fn gradient_matches_finite_differences_at_every_level() {
    let b = Batch {
        logp: vec![vec![-0.7, -1.2, -0.3], vec![-2.0, -0.4, -0.9], vec![-0.5, -0.6, -0.1]],
        other: vec![vec![-0.9, -1.0, -0.6], vec![-1.7, -0.45, -1.4], vec![-0.2, -0.9, -0.3]],
        mask: vec![vec![true, true, true], vec![true, true, false], vec![true, false, false]],
        weights: vec![1.0, -1.0, -0.5],
    };
    for cfg in configs() {
        let (_, g) = run(&b, &cfg, 0.0);
        let flat = b.logp.concat();
        let f = |x: &[f64]| {
            let mut bb = b.clone();
            bb.logp = x.chunks(3).map(|c| c.to_vec()).collect();
            let (lp, mu, r, m) = bb.tensors(0.0);
            scalar(&topr_token_loss(&lp, &mu, &r, &m, &cfg).unwrap())
        };
        let fd = finite_difference(&flat, 1e-6, f);
        assert_close(&g, &fd, 1e-7, &format!("{cfg:?} finite differences"));
    }
}

#[test]
fn per_token_rewards_at_the_token_level() {
    let logp = Tensor::from_slice2(&[[-0.5f64, -1.0], [-0.3, f64::NAN]]);
    let mu = Tensor::from_slice2(&[[-0.7f64, -0.6], [-0.3, 0.0]]);
    let mask = Tensor::from_slice2(&[[true, true], [true, false]]);
    let adv = Tensor::from_slice2(&[[1.0f64, -1.0], [-0.5, f64::NAN]]);
    let lp = leaf(&logp);
    let loss = topr_token_loss(&lp, &mu, &adv, &mask, &ToprTokenConfig::trinity()).unwrap();
    loss.backward();
    let g = vec1(&lp.grad());
    // Token-mean over 3 tokens: weights 1 (positive), min(e^{-0.4}, 1), min(e^0, 1).
    let want = [-1.0 / 3.0, (-0.4f64).exp() / 3.0, 0.5 / 3.0, 0.0];
    assert_close(&g, &want, 1e-12, "per-token advantages");
    // Per-token rewards need the token level.
    let err = topr_token_loss(&leaf(&logp), &mu, &adv, &mask, &ToprTokenConfig::paper()).unwrap_err();
    assert!(matches!(err, LossError::ShapeMismatch { argument: "rewards", .. }), "{err}");
}

#[test]
fn extreme_token_log_ratios_stay_finite() {
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16] {
        for cfg in [ToprTokenConfig::paper(), ToprTokenConfig::verl(), ToprTokenConfig::trinity()] {
            let logp = Tensor::from_slice2(&[[-1.0e4f64, 0.0], [0.0, -1.0e4]]).to_kind(kind).set_requires_grad(true);
            let mu = Tensor::from_slice2(&[[0.0f64, -1.0e4], [-1.0e4, 0.0]]).to_kind(kind);
            let r = Tensor::from_slice(&[1.0f64, -1.0]).to_kind(kind);
            let m = Tensor::from_slice2(&[[1i64, 1], [1, 1]]);
            let loss = topr_token_loss(&logp, &mu, &r, &m, &cfg).unwrap();
            assert!(scalar(&loss).is_finite(), "{kind:?} {cfg:?}");
            loss.backward();
            assert!(vec1(&logp.grad()).iter().all(|g| g.is_finite()), "{kind:?} {cfg:?}");
        }
    }
}

#[test]
fn diagnostics_count_tokens_and_branches() {
    let b = Batch {
        logp: vec![vec![-1.0, -1.0], vec![-1.0, -2.0]],
        other: vec![vec![-1.5, -0.5], vec![-1.0, 9.0]],
        mask: vec![vec![true, true], vec![true, false]],
        weights: vec![1.0, -1.0],
    };
    let (lp, mu, r, m) = b.tensors(f64::NAN);
    // Token level: ratios e^{0.5}, e^{-0.5} (positive, both cut to 1), e^0 (negative, kept).
    let diagnose = |cfg: &ToprTokenConfig| {
        topr_token_loss_output(&lp, &mu, &r, &m, cfg, &Normalizer::local()).unwrap().diagnostics.read().unwrap()
    };
    let d = diagnose(&ToprTokenConfig::trinity());
    assert_eq!(d.samples, 3);
    assert!((d.negative_fraction - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(d.truncated_fraction_pos, 1.0);
    assert_eq!(d.truncated_fraction_neg, 0.0);
    assert_eq!((d.weight_min, d.weight_max, d.weight_mean), (1.0, 1.0, 1.0));
    assert_eq!(d.effective_positive_proportion, Some(2.0 / 3.0));
    // Sequence level: sequence 0 has ratio e^0 = 1 (not truncated), sequence 1 ratio 1.
    let d = diagnose(&ToprTokenConfig::paper());
    assert_eq!(d.samples, 2);
    assert_eq!(d.truncated_fraction_pos, 0.0);
    assert_eq!(d.effective_positive_proportion, Some(0.5));
    assert_eq!(d.log_ratio_mean, 0.0);
}
