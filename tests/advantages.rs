//! Group advantages and whitening against plain loops.

mod common;

use common::*;
use proptest::prelude::*;
use tch::Tensor;
use topr_loss::{GroupAdvantage, LossError, group_advantages, whiten};

fn ref_group(rows: &[Vec<f64>], method: GroupAdvantage) -> Vec<f64> {
    let mut out = vec![];
    for r in rows {
        let k = r.len() as f64;
        let mean = r.iter().sum::<f64>() / k;
        for (i, x) in r.iter().enumerate() {
            out.push(match method {
                GroupAdvantage::Grpo { eps } => {
                    let var =
                        if r.len() > 1 { r.iter().map(|y| (y - mean).powi(2)).sum::<f64>() / (k - 1.0) } else { 0.0 };
                    if r.len() > 1 { (x - mean) / (var.sqrt() + eps) } else { 0.0 }
                }
                GroupAdvantage::DrGrpo => x - mean,
                GroupAdvantage::Rloo => {
                    let others: f64 = r.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, y)| y).sum();
                    x - others / (k - 1.0)
                }
                GroupAdvantage::AsymRe { shift } => x - (mean + shift),
                other => unreachable!("a method without a reference: {other:?}"),
            });
        }
    }
    out
}

fn groups() -> impl Strategy<Value = Vec<Vec<f64>>> {
    (1usize..6, 2usize..9).prop_flat_map(|(g, k)| {
        prop::collection::vec(
            prop::collection::vec(prop_oneof![Just(1.0f64), Just(-1.0), Just(0.0), -3.0f64..3.0], k),
            g,
        )
    })
}

proptest! {
    #[test]
    fn group_advantages_match_their_definitions(rows in groups()) {
        let t = t2(&rows);
        for method in [GroupAdvantage::grpo(), GroupAdvantage::Grpo { eps: 0.1 }, GroupAdvantage::DrGrpo, GroupAdvantage::Rloo, GroupAdvantage::asymre()] {
            let got = vec1(&group_advantages(&t, method).unwrap());
            let want = ref_group(&rows, method);
            // A constant group has zero spread: GRPO divides 0 by eps.
            assert_close(&got, &want, 1e-9, &format!("{method:?}"));
        }
    }

    #[test]
    fn whitening_gives_zero_mean_unit_variance(x in prop::collection::vec(-10.0f64..10.0, 2..40)) {
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        prop_assume!(x.iter().any(|v| (v - mean).abs() > 1e-3));
        let w = vec1(&whiten(&t1(&x), None, 0.0).unwrap());
        let n = w.len() as f64;
        let m = w.iter().sum::<f64>() / n;
        let var = w.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0);
        prop_assert!(m.abs() < 1e-9 && (var - 1.0).abs() < 1e-9);
    }
}

#[test]
fn whitening_with_a_mask_ignores_padding() {
    let x = Tensor::from_slice2(&[[1.0f64, f64::NAN], [3.0, 2.0]]);
    let m = Tensor::from_slice2(&[[true, false], [true, true]]);
    let w = vec1(&whiten(&x, Some(&m), 0.0).unwrap());
    assert_close(&w, &[-1.0, 0.0, 1.0, 0.0], 1e-12, "masked whitening");
}

#[test]
fn bad_inputs_are_errors() {
    let one = Tensor::from_slice2(&[[1.0f64], [0.0]]);
    assert!(matches!(group_advantages(&one, GroupAdvantage::Rloo), Err(LossError::InvalidArgument { .. })));
    // GRPO on a group of one: advantage 0, not NaN.
    assert_eq!(vec1(&group_advantages(&one, GroupAdvantage::grpo()).unwrap()), vec![0.0, 0.0]);
    assert!(matches!(group_advantages(&t1(&[1.0, 0.0]), GroupAdvantage::DrGrpo), Err(LossError::WrongRank { .. })));
    assert!(matches!(
        group_advantages(&one, GroupAdvantage::Grpo { eps: -1.0 }),
        Err(LossError::InvalidArgument { .. })
    ));
    assert!(matches!(
        group_advantages(&Tensor::from_slice2(&[[f64::NAN, 1.0]]), GroupAdvantage::DrGrpo),
        Err(LossError::NonFinite { .. })
    ));
    assert!(matches!(whiten(&t1(&[1.0]), None, 1e-8), Err(LossError::EmptyBatch { .. })));
}
