//! The effective proportion of positives and its inverses.

mod common;

use common::*;
use proptest::prelude::*;
use topr_loss::{
    LossError, baseline_for_effective_proportion, baseline_for_rewards, effective_positive_proportion,
    effective_positive_proportion_of_rewards,
};

/// p̃ from first principles: the share of Σ|R − c| that positives carry, with rewards ±1.
fn ref_share(p: f64, c: f64) -> f64 {
    let pos = p * (1.0 - c);
    let neg = (1.0 - p) * (1.0 + c);
    pos / (pos + neg)
}

#[test]
fn the_worked_examples() {
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    for p in [0.0, 0.1, 0.37, 0.5, 1.0] {
        assert!(close(effective_positive_proportion(p, 0.0).unwrap(), p), "c = 0 keeps p = {p}");
    }
    for p in [0.01, 0.1, 0.5, 0.99, 1.0] {
        assert!(close(effective_positive_proportion(p, -1.0).unwrap(), 1.0), "c = -1 gives 1 for p = {p}");
    }
    assert!(close(effective_positive_proportion(0.1, -0.8).unwrap(), 0.5));
    assert!(close(effective_positive_proportion(0.5, 0.6).unwrap(), 0.2));
    assert!(close(baseline_for_effective_proportion(0.1, 0.5).unwrap(), -0.8));
    assert!(close(baseline_for_effective_proportion(0.5, 0.2).unwrap(), 0.6));
}

#[test]
fn out_of_range_or_nan_arguments_are_errors() {
    for (p, c) in
        [(f64::NAN, 0.0), (0.5, f64::NAN), (-0.1, 0.0), (1.1, 0.0), (0.5, 1.5), (0.5, -1.01), (1.0, 1.0), (0.0, -1.0)]
    {
        assert!(matches!(effective_positive_proportion(p, c), Err(LossError::InvalidArgument { .. })), "p={p} c={c}");
    }
    for (p, pt) in [(f64::NAN, 0.5), (0.5, f64::NAN), (0.5, 1.2), (-0.5, 0.5), (0.0, 0.3), (1.0, 0.3)] {
        assert!(
            matches!(baseline_for_effective_proportion(p, pt), Err(LossError::InvalidArgument { .. })),
            "p={p} p~={pt}"
        );
    }
    let same = t1(&[1.0, 1.0]);
    assert!(matches!(
        effective_positive_proportion_of_rewards(&same, 1.0),
        Err(LossError::InvalidArgument { argument: "c", .. })
    ));
    assert!(matches!(baseline_for_rewards(&same, 0.3), Err(LossError::InvalidArgument { argument: "rewards", .. })));
    assert!(matches!(
        effective_positive_proportion_of_rewards(&t1(&[1.0, f64::NAN]), 0.0),
        Err(LossError::NonFinite { .. })
    ));
    assert!(matches!(effective_positive_proportion_of_rewards(&t1(&[]), 0.0), Err(LossError::EmptyBatch { .. })));
}

proptest! {
    #[test]
    fn formula_matches_the_definition(p in 0.0f64..=1.0, c in -0.999f64..0.999) {
        let got = effective_positive_proportion(p, c).unwrap();
        prop_assert!((got - ref_share(p, c)).abs() < 1e-12);
    }

    #[test]
    fn inverse_round_trips(p in 0.001f64..0.999, pt in 0.0f64..=1.0) {
        let c = baseline_for_effective_proportion(p, pt).unwrap();
        prop_assert!((-1.0..=1.0).contains(&c));
        prop_assert!((effective_positive_proportion(p, c).unwrap() - pt).abs() < 1e-9);
    }

    #[test]
    fn measured_on_pm1_rewards_equals_the_formula(n_pos in 1usize..40, n_neg in 1usize..40, c in -0.99f64..0.99) {
        let mut r = vec![1.0; n_pos];
        r.extend(vec![-1.0; n_neg]);
        let p = n_pos as f64 / (n_pos + n_neg) as f64;
        let measured = effective_positive_proportion_of_rewards(&t1(&r), c).unwrap();
        prop_assert!((measured - effective_positive_proportion(p, c).unwrap()).abs() < 1e-12);
    }

    #[test]
    fn rewards_solver_round_trips(r in prop::collection::vec(-3.0f64..3.0, 2..30), pt in 0.0f64..=1.0) {
        prop_assume!(r.iter().any(|v| (v - r[0]).abs() > 1e-6));
        let c = baseline_for_rewards(&t1(&r), pt).unwrap();
        let got = effective_positive_proportion_of_rewards(&t1(&r), c).unwrap();
        prop_assert!((got - pt).abs() < 1e-8, "c={} got {} want {}", c, got, pt);
    }

    #[test]
    fn rewards_solver_agrees_with_the_formula_on_pm1(n_pos in 1usize..40, n_neg in 1usize..40, pt in 0.01f64..0.99) {
        let mut r = vec![1.0; n_pos];
        r.extend(vec![-1.0; n_neg]);
        let p = n_pos as f64 / (n_pos + n_neg) as f64;
        let solved = baseline_for_rewards(&t1(&r), pt).unwrap();
        prop_assert!((solved - baseline_for_effective_proportion(p, pt).unwrap()).abs() < 1e-9);
    }
}
