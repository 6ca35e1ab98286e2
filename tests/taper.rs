//! The taper and the truncated weight against their definitions.

mod common;

use common::*;
use proptest::prelude::*;
use tch::Tensor;
use topr_loss::{LossError, taper, taper_scalar, truncated_weight};

fn limits() -> impl Strategy<Value = (f64, f64)> {
    prop_oneof![
        (0.0f64..3.0, 0.0f64..3.0).prop_map(|(a, b)| (a.min(b), a.max(b))),
        (0.0f64..3.0).prop_map(|a| (a, f64::INFINITY)),
        Just((0.0, 0.0)),
        Just((1.0, 1.0)),
    ]
}

proptest! {
    #[test]
    fn taper_matches_definition_and_never_exceeds_the_ratio(deltas in prop::collection::vec(-20.0f64..20.0, 1..32), (a, b) in limits()) {
        let d = leaf(&t1(&deltas));
        let t = taper(&d, a, b).unwrap();
        t.sum(None).backward();
        let (tv, gv) = (vec1(&t), vec1(&d.grad()));
        for (i, &delta) in deltas.iter().enumerate() {
            let x = delta.exp();
            let want = ref_taper(x, a, b);
            prop_assert!((tv[i] - want).abs() <= 1e-9 * want.abs().max(1.0), "T({x}; {a}, {b}) = {} want {want}", tv[i]);
            prop_assert!(tv[i] <= x * (1.0 + 1e-12) + 1e-300, "T(x) <= x fails at x = {x}");
            // dT/dδ = x T'(x) = [x]_a^b
            let w = ref_weight(x, a, b);
            prop_assert!((gv[i] - w).abs() <= 1e-9 * w.max(1.0));
            prop_assert!((taper_scalar(delta, a, b) - tv[i]).abs() <= 1e-12 * tv[i].abs().max(1.0));
        }
        let w = vec1(&truncated_weight(&d, a, b).unwrap());
        for (i, &delta) in deltas.iter().enumerate() {
            let want = ref_weight(delta.exp(), a, b);
            prop_assert!((w[i] - want).abs() <= 1e-12 * want.max(1.0));
        }
    }

    #[test]
    fn taper_is_finite_for_huge_log_ratios_with_a_finite_upper_limit(delta in prop_oneof![-1.0e6f64..-1.0e3, 1.0e3f64..1.0e6], (a, b) in limits()) {
        prop_assume!(b.is_finite());
        let d = leaf(&t1(&[delta]));
        let t = taper(&d, a, b).unwrap();
        t.sum(None).backward();
        prop_assert!(scalar(&t).is_finite());
        prop_assert!(vec1(&d.grad())[0].is_finite());
    }
}

#[test]
fn special_cases_of_the_reference_sheet() {
    let d = t1(&[-2.0, 0.0, 3.0]);
    // T(x; 1, 1) = 1 + ln x
    assert_close(&vec1(&taper(&d, 1.0, 1.0).unwrap()), &[-1.0, 1.0, 4.0], 1e-15, "T(x;1,1)");
    // a = b = 0: T ≡ 0
    assert_eq!(vec1(&taper(&d, 0.0, 0.0).unwrap()), vec![0.0, 0.0, 0.0]);
    // C¹ at the limits: values and slopes agree on both sides of ln b.
    let b: f64 = 2.0;
    let eps = 1e-7;
    let around = leaf(&t1(&[b.ln() - eps, b.ln() + eps]));
    let t = taper(&around, 0.0, b).unwrap();
    t.sum(None).backward();
    let (v, g) = (vec1(&t), vec1(&around.grad()));
    assert!((v[0] - v[1]).abs() < 1e-6 && (g[0] - g[1]).abs() < 1e-6);
}

#[test]
fn bad_limits_are_errors() {
    let d = t1(&[0.0]);
    for (a, b) in [(f64::NAN, 1.0), (0.0, f64::NAN), (-1.0, 1.0), (2.0, 1.0), (f64::INFINITY, f64::INFINITY)] {
        assert!(matches!(taper(&d, a, b), Err(LossError::InvalidConfig { .. })), "({a}, {b})");
        assert!(matches!(truncated_weight(&d, a, b), Err(LossError::InvalidConfig { .. })), "({a}, {b})");
        assert!(taper_scalar(0.0, a, b).is_nan());
    }
    assert!(matches!(
        taper(&Tensor::from_slice(&[1i64]), 0.0, 1.0),
        Err(LossError::WrongDtype { argument: "delta", .. })
    ));
}
