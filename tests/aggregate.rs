//! `aggregate` against its table of formulas, and split invariance for every mode.

mod common;

use common::*;
use proptest::prelude::*;
use tch::Tensor;
use topr_loss::{AggregationMode, BatchCounts, LossError, Normalizer, aggregate, sequence_weights};

const MODES: [AggregationMode; 6] = ALL_MODES;

/// The table of the reference sheet, written out.
fn ref_aggregate(l: &[Vec<f64>], m: &[Vec<bool>], mode: AggregationMode) -> f64 {
    let rows: Vec<(f64, f64)> = l
        .iter()
        .zip(m)
        .map(|(l, m)| {
            (l.iter().zip(m).filter(|(_, m)| **m).map(|(x, _)| x).sum(), m.iter().filter(|m| **m).count() as f64)
        })
        .collect();
    let n: f64 = rows.iter().map(|r| r.1).sum();
    let s = rows.iter().filter(|r| r.1 > 0.0).count() as f64;
    match mode {
        AggregationMode::TokenMean => rows.iter().map(|r| r.0).sum::<f64>() / n,
        AggregationMode::TokenSum => rows.iter().map(|r| r.0).sum(),
        AggregationMode::SeqMeanTokenSum => rows.iter().map(|r| r.0).sum::<f64>() / s,
        AggregationMode::SeqMeanTokenMean => rows.iter().filter(|r| r.1 > 0.0).map(|r| r.0 / r.1).sum::<f64>() / s,
        AggregationMode::DrGrpo { length } => rows.iter().map(|r| r.0).sum::<f64>() / (s * length),
        AggregationMode::TokenSumNorm { length } => rows.iter().map(|r| r.0).sum::<f64>() / length,
        _ => unreachable!("a mode without a reference: {mode:?}"),
    }
}

fn batch() -> impl Strategy<Value = (Vec<Vec<f64>>, Vec<Vec<bool>>)> {
    (2usize..7, 1usize..6).prop_flat_map(|(b, t)| {
        (
            prop::collection::vec(prop::collection::vec(-5.0f64..5.0, t), b),
            prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.7), t), b),
        )
            .prop_map(|(l, mut m)| {
                m[0][0] = true;
                (l, m)
            })
    })
}

fn tensors(l: &[Vec<f64>], m: &[Vec<bool>]) -> (Tensor, Tensor) {
    let masked: Vec<Vec<f64>> =
        l.iter().zip(m).map(|(l, m)| l.iter().zip(m).map(|(x, m)| if *m { *x } else { f64::NAN }).collect()).collect();
    let mt: Vec<Tensor> = m.iter().map(|r| Tensor::from_slice(r)).collect();
    (t2(&masked), Tensor::stack(&mt, 0))
}

proptest! {
    #[test]
    fn matches_the_table((l, m) in batch()) {
        let (lt, mt) = tensors(&l, &m);
        for mode in MODES {
            let got = scalar(&aggregate(&lt, &mt, mode, &Normalizer::local()).unwrap());
            assert_close(&[got], &[ref_aggregate(&l, &m, mode)], 1e-12, &format!("{mode:?}"));
        }
    }

    #[test]
    fn micro_batches_with_global_counts_sum_to_the_full_batch((l, m) in batch(), cuts in prop::collection::vec(1usize..6, 1..4)) {
        let (lt, mt) = tensors(&l, &m);
        let b = l.len() as i64;
        let mut bounds: Vec<i64> = cuts.iter().map(|c| (*c as i64).min(b - 1)).collect();
        bounds.push(0);
        bounds.push(b);
        bounds.sort();
        bounds.dedup();
        let norm = Normalizer::from_masks(&[&mt]).unwrap();
        for mode in MODES {
            let full_leaf = leaf(&lt);
            let full = aggregate(&full_leaf, &mt, mode, &norm).unwrap();
            full.backward();
            let part_leaf = leaf(&lt);
            let mut total = 0.0;
            for w in bounds.windows(2) {
                let (o, k) = (w[0], w[1] - w[0]);
                match aggregate(&part_leaf.narrow(0, o, k), &mt.narrow(0, o, k), mode, &norm) {
                    Ok(part) => { total += scalar(&part); part.backward(); }
                    Err(LossError::EmptyBatch { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            assert_close(&[total], &[scalar(&full)], 1e-12, &format!("{mode:?} value"));
            let g_full: Vec<f64> = vec1(&full_leaf.grad());
            let g_part: Vec<f64> = vec1(&part_leaf.grad());
            assert_close(&g_part, &g_full, 1e-12, &format!("{mode:?} grad"));
        }
    }

    #[test]
    fn averaging_local_means_is_off_by_the_token_imbalance((l, m) in batch()) {
        // The bug class this module exists to prevent: per-micro-batch token-mean differs from
        // the full-batch token-mean whenever the halves have different token counts.
        let (lt, mt) = tensors(&l, &m);
        let b = l.len() as i64;
        let h = b / 2;
        let lens: Vec<usize> = m.iter().map(|r| r.iter().filter(|x| **x).count()).collect();
        let (n1, n2): (usize, usize) = (lens[..h as usize].iter().sum(), lens[h as usize..].iter().sum());
        prop_assume!(n1 > 0 && n2 > 0 && n1 != n2);
        let full = scalar(&aggregate(&lt, &mt, AggregationMode::TokenMean, &Normalizer::local()).unwrap());
        let a = scalar(&aggregate(&lt.narrow(0, 0, h), &mt.narrow(0, 0, h), AggregationMode::TokenMean, &Normalizer::local()).unwrap());
        let c = scalar(&aggregate(&lt.narrow(0, h, b - h), &mt.narrow(0, h, b - h), AggregationMode::TokenMean, &Normalizer::local()).unwrap());
        // Averaging the two local means (what a trainer with local counts does) is off by
        // (a − c)(n2 − n1) / (2 (n1 + n2)): zero only when the halves have equal token counts.
        let (n1, n2) = (n1 as f64, n2 as f64);
        let naive = (a + c) / 2.0;
        prop_assert!((naive - full - (a - c) * (n2 - n1) / (2.0 * (n1 + n2))).abs() < 1e-9);
        prop_assume!((a - c).abs() > 1e-3);
        prop_assert!((naive - full).abs() > 1e-9);
    }
}

#[test]
fn sequence_weights_and_errors() {
    let m = Tensor::from_slice2(&[[true, false, false], [false, false, false], [true, true, true]]);
    let a = vec1(&sequence_weights(&m, AggregationMode::SeqMeanTokenMean, &Normalizer::local()).unwrap());
    assert_close(&a, &[0.5, 0.0, 1.0 / 6.0], 1e-7, "empty rows get 0; S counts non-empty rows");
    let none = Tensor::from_slice2(&[[false, false]]);
    let l = Tensor::from_slice2(&[[1.0f64, 2.0]]);
    assert!(matches!(
        aggregate(&l, &none, AggregationMode::TokenMean, &Normalizer::local()),
        Err(LossError::EmptyBatch { .. })
    ));
    for mode in [AggregationMode::DrGrpo { length: 0.0 }, AggregationMode::TokenSumNorm { length: f64::NAN }] {
        let e = aggregate(&l, &Tensor::from_slice2(&[[true, true]]), mode, &Normalizer::local()).unwrap_err();
        assert!(matches!(e, LossError::InvalidConfig { .. }), "{mode:?}: {e}");
    }
    assert!(matches!(
        aggregate(
            &l,
            &Tensor::from_slice2(&[[true, true]]),
            AggregationMode::TokenMean,
            &Normalizer::global(BatchCounts { tokens: f64::NAN, sequences: 1.0 })
        ),
        Err(LossError::InvalidConfig { .. })
    ));
}

/// verl 0.9.1's `agg_loss` on the same per-token losses: `token-mean`, `token-sum`,
/// `seq-mean-token-sum`, `seq-mean-token-mean` (verl divides by `L_i + 1e-8`) and
/// `seq-mean-token-sum-norm`, which in verl 0.9.1 divides the *sequence mean* of the token sums by
/// the fixed length: Dr. GRPO's reduction, `AggregationMode::DrGrpo { length }` (verl releases
/// before 0.9 did not divide by the number of sequences: `TokenSumNorm { length }`).
#[test]
fn modes_match_verl_agg_loss() {
    let loss = vec![
        vec![0.5, -1.0, 2.0, 0.25],
        vec![1.5, 0.0, 0.0, 0.0],
        vec![-0.75, 3.0, 1.0, 0.0],
        vec![9.0, 9.0, 9.0, 9.0],
    ];
    let mask =
        vec![vec![1.0, 1.0, 1.0, 1.0], vec![1.0, 0.0, 0.0, 0.0], vec![1.0, 1.0, 1.0, 0.0], vec![0.0, 0.0, 0.0, 0.0]];
    let cases = [
        ("token-mean", AggregationMode::TokenMean, None),
        ("token-sum", AggregationMode::TokenSum, None),
        ("seq-mean-token-sum", AggregationMode::SeqMeanTokenSum, None),
        ("seq-mean-token-mean", AggregationMode::SeqMeanTokenMean, None),
        ("seq-mean-token-sum-norm", AggregationMode::DrGrpo { length: 7.0 }, Some(7.0)),
    ];
    let calls: Vec<serde_json::Value> = cases
        .iter()
        .map(|(name, _, l)| serde_json::json!({"fn": "verl.agg_loss", "args": {"loss": loss, "mask": mask, "mode": name, "loss_scale_factor": l}}))
        .collect();
    let Some(res) = peer(&calls) else { return };
    let (l, m) = (t2(&loss), t2(&mask));
    for ((name, mode, _), r) in cases.iter().zip(&res) {
        let got = scalar(&aggregate(&l, &m, *mode, &Normalizer::local()).unwrap());
        // verl's seq-mean-token-mean divides by L_i + 1e-8.
        assert_close(&[got], &json_f64(&r["value"]), 1e-8, name);
    }
    // And TokenSumNorm is S times verl 0.9.1's value (3 sequences with tokens here).
    let tsn = scalar(&aggregate(&l, &m, AggregationMode::TokenSumNorm { length: 7.0 }, &Normalizer::local()).unwrap());
    assert_close(&[tsn], &[3.0 * json_f64(&res[4]["value"])[0]], 1e-12, "TokenSumNorm");
}
