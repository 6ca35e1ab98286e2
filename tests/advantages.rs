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

// ---- Batch-std scaling, OPO and groups of one (issue #11) ----

use serde_json::json;
use topr_loss::{SingletonGroup, gdpo_advantages, group_advantages_with, opo_advantages, passk_advantages};

/// Unbiased standard deviation of `x` (0 for fewer than two values).
fn ref_std(x: &[f64]) -> f64 {
    if x.len() < 2 {
        return 0.0;
    }
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
}

/// `(R − m_g)/(s_batch + eps)` by loops; a group of one under verl's convention has `m_g = 0`.
fn ref_batch_std(rows: &[Vec<f64>], eps: f64, zero_mean_singletons: bool) -> Vec<f64> {
    let all: Vec<f64> = rows.iter().flatten().copied().collect();
    let s = ref_std(&all);
    let mut out = vec![];
    for r in rows {
        let mean = if r.len() == 1 && zero_mean_singletons { 0.0 } else { r.iter().sum::<f64>() / r.len() as f64 };
        out.extend(r.iter().map(|x| (x - mean) / (s + eps)));
    }
    out
}

/// OPO's length-weighted baseline by loops.
fn ref_opo(rows: &[Vec<f64>], lens: &[Vec<f64>], zero_mean_singletons: bool) -> Vec<f64> {
    let mut out = vec![];
    for (r, l) in rows.iter().zip(lens) {
        let b = if r.len() == 1 {
            if zero_mean_singletons { 0.0 } else { r[0] }
        } else {
            r.iter().zip(l).map(|(x, l)| x * l).sum::<f64>() / l.iter().sum::<f64>()
        };
        out.extend(r.iter().map(|x| x - b));
    }
    out
}

/// The verl convention for a group of one (mean 0, std 1) by formula.
fn ref_singleton_verl(r: f64, method: GroupAdvantage, batch_std: f64) -> f64 {
    match method {
        GroupAdvantage::Grpo { eps } => r / (1.0 + eps),
        GroupAdvantage::DrGrpo | GroupAdvantage::Rloo => r,
        GroupAdvantage::AsymRe { shift } => r - shift,
        GroupAdvantage::BatchStd { eps } => r / (batch_std + eps),
        other => unreachable!("{other:?}"),
    }
}

fn lengths() -> impl Strategy<Value = (Vec<Vec<f64>>, Vec<Vec<f64>>)> {
    (1usize..5, 1usize..6).prop_flat_map(|(g, k)| {
        (
            prop::collection::vec(prop::collection::vec(prop_oneof![Just(1.0f64), Just(0.0), -3.0f64..3.0], k), g),
            prop::collection::vec(prop::collection::vec((1u32..50).prop_map(f64::from), k), g),
        )
    })
}

proptest! {
    #[test]
    fn batch_std_matches_its_definition(rows in groups(), eps in prop_oneof![Just(1e-4f64), 0.0f64..0.5]) {
        let got = vec1(&group_advantages(&t2(&rows), GroupAdvantage::BatchStd { eps }).unwrap());
        let all: Vec<f64> = rows.iter().flatten().copied().collect();
        prop_assume!(ref_std(&all) + eps > 1e-6);
        assert_close(&got, &ref_batch_std(&rows, eps, false), 1e-10, "batch std");
        // Batch scaling is a common factor: the group-centred advantages, rescaled.
        let dr = vec1(&group_advantages(&t2(&rows), GroupAdvantage::DrGrpo).unwrap());
        let scale = ref_std(&all) + eps;
        assert_close(&got, &dr.iter().map(|a| a / scale).collect::<Vec<_>>(), 1e-10, "batch std as a rescaled Dr. GRPO");
    }

    /// Pass@k: the margin of the best over the second best, at the best (the first of several
    /// equal bests gets a margin of 0, like the others), divided by the unbiased standard
    /// deviation plus ε when asked.
    #[test]
    fn passk_matches_its_definition(rows in groups(), normalize in any::<bool>(), eps in 0.0f64..0.1) {
        prop_assume!(rows[0].len() >= 2);
        let got = vec1(&passk_advantages(&t2(&rows), normalize, eps).unwrap());
        let mut want = vec![];
        for r in &rows {
            let mut sorted = r.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let margin = sorted[0] - sorted[1];
            let best = r.iter().position(|x| *x == sorted[0]).unwrap();
            let scale = if normalize { ref_std(r) + eps } else { 1.0 };
            prop_assume!(scale > 1e-9);
            want.extend((0..r.len()).map(|k| if k == best { margin / scale } else { 0.0 }));
        }
        assert_close(&got, &want, 1e-10, "pass@k");
        prop_assert!(got.iter().all(|a| *a >= 0.0), "pass@k advantages are never negative");
    }

    #[test]
    fn opo_matches_its_definition((rows, lens) in lengths(), verl in any::<bool>()) {
        let singleton = if verl { SingletonGroup::ZeroMeanUnitStd } else { SingletonGroup::OwnMean };
        let got = vec1(&opo_advantages(&t2(&rows), &t2(&lens), singleton).unwrap());
        assert_close(&got, &ref_opo(&rows, &lens, verl), 1e-10, "opo");
        // Equal lengths: the plain group mean (Dr. GRPO).
        let ones: Vec<Vec<f64>> = lens.iter().map(|l| vec![7.0; l.len()]).collect();
        let equal = vec1(&opo_advantages(&t2(&rows), &t2(&ones), singleton).unwrap());
        let dr = vec1(&group_advantages_with(&t2(&rows), GroupAdvantage::DrGrpo, singleton).unwrap());
        assert_close(&equal, &dr, 1e-10, "opo with equal lengths");
        // The length-weighted advantages sum to zero in every group of two or more.
        if rows[0].len() > 1 {
            for (g, l) in lens.iter().enumerate() {
                let k = l.len();
                let s: f64 = (0..k).map(|j| l[j] * got[g * k + j]).sum();
                prop_assert!(s.abs() < 1e-9 * l.iter().sum::<f64>().max(1.0) * 10.0);
            }
        }
    }

    #[test]
    fn groups_of_one_follow_the_chosen_convention(r in prop::collection::vec(-3.0f64..3.0, 1..6)) {
        let rows: Vec<Vec<f64>> = r.iter().map(|x| vec![*x]).collect();
        let t = t2(&rows);
        let s = ref_std(&r);
        for method in [GroupAdvantage::grpo(), GroupAdvantage::DrGrpo, GroupAdvantage::Rloo, GroupAdvantage::asymre(), GroupAdvantage::batch_std()] {
            let got = vec1(&group_advantages_with(&t, method, SingletonGroup::ZeroMeanUnitStd).unwrap());
            let want: Vec<f64> = r.iter().map(|x| ref_singleton_verl(*x, method, s)).collect();
            assert_close(&got, &want, 1e-10, &format!("{method:?} verl singleton"));
            // The default is unchanged: OwnMean is `group_advantages`.
            let own = group_advantages_with(&t, method, SingletonGroup::OwnMean).map(|a| vec1(&a));
            let default = group_advantages(&t, method).map(|a| vec1(&a));
            prop_assert_eq!(own, default);
        }
    }
}

#[test]
fn advantages_are_detached_and_computed_in_f32_or_f64() {
    let r = Tensor::from_slice2(&[[1.0f64, 0.0, 0.5]]).set_requires_grad(true);
    let len = Tensor::from_slice2(&[[3i64, 1, 2]]);
    for kind in [tch::Kind::Half, tch::Kind::BFloat16, tch::Kind::Float, tch::Kind::Double] {
        let rk = r.to_kind(kind);
        let want = if kind == tch::Kind::Double { tch::Kind::Double } else { tch::Kind::Float };
        let a = group_advantages(&rk, GroupAdvantage::batch_std()).unwrap();
        assert_eq!((a.kind(), a.requires_grad()), (want, false), "{kind:?}");
        let a = opo_advantages(&rk, &len, SingletonGroup::OwnMean).unwrap();
        assert_eq!((a.kind(), a.requires_grad()), (want, false), "{kind:?}");
    }
    // Huge rewards: finite advantages while their spread fits the compute dtype (f32 here),
    // refused beyond it rather than turned into zeros (an infinite standard deviation).
    let big = Tensor::from_slice2(&[[1e15f64, -1e15, 0.0]]).to_kind(tch::Kind::Float);
    let a = vec1(&group_advantages(&big, GroupAdvantage::batch_std()).unwrap());
    assert!(a.iter().all(|a| a.is_finite()) && a[0] > 0.9, "{a:?}");
    let huge = Tensor::from_slice2(&[[1e30f64, -1e30, 0.0]]).to_kind(tch::Kind::Float);
    assert!(matches!(group_advantages(&huge, GroupAdvantage::batch_std()), Err(LossError::InvalidArgument { .. })));
}

#[test]
fn opo_and_singleton_errors_name_the_argument() {
    let r = Tensor::from_slice2(&[[1.0f64, 0.0]]);
    let e = opo_advantages(&r, &Tensor::from_slice2(&[[1i64, 2, 3]]), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "lengths", .. }), "{e}");
    let e = opo_advantages(&r, &Tensor::from_slice2(&[[true, false]]), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "lengths", .. }), "{e}");
    let e = opo_advantages(&r, &Tensor::from_slice2(&[[-1.0f64, 2.0]]), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "lengths", .. }), "{e}");
    let e = opo_advantages(&r, &Tensor::from_slice2(&[[0i64, 0]]), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "lengths", .. }), "{e}");
    let e = opo_advantages(&r, &Tensor::from_slice2(&[[f64::NAN, 1.0]]), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "lengths", .. }), "{e}");
    let e = opo_advantages(&t1(&[1.0]), &t1(&[1.0]), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "rewards", .. }), "{e}");
    let e = group_advantages(&r, GroupAdvantage::BatchStd { eps: f64::NAN }).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "eps", .. }), "{e}");
    // RLOO on groups of one: an error by default, the raw reward under verl's convention.
    let one = Tensor::from_slice2(&[[2.0f64], [1.0]]);
    assert!(group_advantages_with(&one, GroupAdvantage::Rloo, SingletonGroup::OwnMean).is_err());
    assert_eq!(
        vec1(&group_advantages_with(&one, GroupAdvantage::Rloo, SingletonGroup::ZeroMeanUnitStd).unwrap()),
        vec![2.0, 1.0]
    );
}

/// One completion per row with its reward on the last real token, as verl's outcome estimators take it.
fn outcome_tokens(rewards: &[f64], mask: &[Vec<f64>]) -> Vec<Vec<f64>> {
    rewards
        .iter()
        .zip(mask)
        .map(|(r, m)| {
            let last = m.iter().rposition(|x| *x > 0.0).unwrap();
            (0..m.len()).map(|t| if t == last { *r } else { 0.0 }).collect()
        })
        .collect()
}

/// A fixed batch of `g` groups of `k` with rewards, masks (every row has a real token) and lengths.
fn fixed_groups(g: usize, k: usize, seed: u64) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let rows: Vec<Vec<f64>> =
        (0..g).map(|_| (0..k).map(|_| (next() * 4.0 - 2.0).round() / 2.0 + next() * 0.1).collect()).collect();
    let t = 5;
    let mask: Vec<Vec<f64>> = (0..g * k)
        .map(|_| {
            let len = 1 + (next() * t as f64) as usize % t;
            (0..t).map(|j| if j < len { 1.0 } else { 0.0 }).collect()
        })
        .collect();
    (rows, mask)
}

/// Per-sequence advantages compared with a peer's per-token ones on the real tokens.
fn compare_on_tokens(per_seq: &[f64], peer_tokens: &[f64], mask: &[Vec<f64>], tol: f64, what: &str) {
    let t = mask[0].len();
    let (mut got, mut want) = (vec![], vec![]);
    for (i, m) in mask.iter().enumerate() {
        for j in 0..t {
            if m[j] > 0.0 {
                got.push(per_seq[i]);
                want.push(peer_tokens[i * t + j]);
            }
        }
    }
    assert_close(&got, &want, tol, what);
}

#[test]
fn group_advantages_match_verl_and_trl() {
    let cases = [(3, 4, 1u64), (2, 2, 2), (4, 1, 3), (1, 6, 4)];
    let mut calls = vec![];
    for &(g, k, seed) in &cases {
        let (rows, mask) = fixed_groups(g, k, seed);
        let flat: Vec<f64> = rows.iter().flatten().copied().collect();
        let tokens = outcome_tokens(&flat, &mask);
        let index: Vec<usize> = (0..g * k).map(|i| i / k).collect();
        calls.push(json!({"fn": "verl.grpo_advantage", "args": {"token_rewards": tokens, "mask": mask, "index": index, "epsilon": 1e-6, "norm_by_std": true}}));
        calls.push(json!({"fn": "verl.grpo_advantage", "args": {"token_rewards": tokens, "mask": mask, "index": index, "epsilon": 1e-6, "norm_by_std": false}}));
        calls.push(
            json!({"fn": "verl.rloo_advantage", "args": {"token_rewards": tokens, "mask": mask, "index": index}}),
        );
        calls
            .push(json!({"fn": "verl.opo_advantage", "args": {"token_rewards": tokens, "mask": mask, "index": index}}));
        calls.push(json!({"fn": "trl.batch_std_advantage", "args": {"rewards": flat, "num_generations": k}}));
    }
    // Pass@k needs two completions a group (verl raises otherwise; so does the crate).
    let passk_cases: Vec<&(usize, usize, u64)> = cases.iter().filter(|c| c.1 >= 2).collect();
    for &&(g, k, seed) in &passk_cases {
        let (rows, mask) = fixed_groups(g, k, seed);
        let flat: Vec<f64> = rows.iter().flatten().copied().collect();
        let tokens = outcome_tokens(&flat, &mask);
        let index: Vec<usize> = (0..g * k).map(|i| i / k).collect();
        for norm in [true, false] {
            calls.push(json!({"fn": "verl.passk_advantage", "args": {"token_rewards": tokens, "mask": mask, "index": index, "epsilon": 1e-6, "norm_by_std": norm}}));
        }
    }
    let Some(res) = peer(&calls) else { return };
    for (c, &(g, k, seed)) in cases.iter().enumerate() {
        let (rows, mask) = fixed_groups(g, k, seed);
        let r = t2(&rows);
        let lens: Vec<Vec<f64>> =
            (0..g).map(|i| (0..k).map(|j| mask[i * k + j].iter().sum::<f64>()).collect()).collect();
        let verl = SingletonGroup::ZeroMeanUnitStd;
        let p = |n: usize, key: &str| json_f64(&res[c * 5 + n][key]);
        // verl computes a group of one's `1 + eps` in f32 (its mean 0 and std 1 are f32 tensors).
        let tol = if k == 1 { 1e-7 } else { 1e-10 };
        let ours = vec1(&group_advantages_with(&r, GroupAdvantage::grpo(), verl).unwrap());
        compare_on_tokens(&ours, &p(0, "advantages"), &mask, tol, &format!("GRPO {g}x{k}"));
        let ours = vec1(&group_advantages_with(&r, GroupAdvantage::DrGrpo, verl).unwrap());
        compare_on_tokens(&ours, &p(1, "advantages"), &mask, 1e-10, &format!("Dr. GRPO {g}x{k}"));
        let ours = vec1(&group_advantages_with(&r, GroupAdvantage::Rloo, verl).unwrap());
        compare_on_tokens(&ours, &p(2, "advantages"), &mask, 1e-10, &format!("RLOO {g}x{k}"));
        let ours = vec1(&opo_advantages(&r, &t2(&lens), verl).unwrap());
        compare_on_tokens(&ours, &p(3, "advantages"), &mask, 1e-10, &format!("OPO {g}x{k}"));
        // TRL gives a group of one its own mean: the crate's default.
        let ours = vec1(&group_advantages(&r, GroupAdvantage::batch_std()).unwrap());
        assert_close(&ours, &p(4, "advantages"), 1e-10, &format!("batch std {g}x{k}"));
    }
    let mut at = cases.len() * 5;
    for &&(g, k, seed) in &passk_cases {
        let (rows, mask) = fixed_groups(g, k, seed);
        for norm in [true, false] {
            let ours = vec1(&passk_advantages(&t2(&rows), norm, 1e-6).unwrap());
            compare_on_tokens(
                &ours,
                &json_f64(&res[at]["advantages"]),
                &mask,
                1e-10,
                &format!("pass@k {g}x{k} {norm}"),
            );
            at += 1;
        }
    }
    let one = passk_advantages(&Tensor::from_slice2(&[[1.0f64], [0.0]]), true, 1e-6);
    assert!(matches!(one, Err(LossError::InvalidArgument { argument: "rewards", .. })), "{one:?}");
}

/// Finite rewards so large that a group's variance overflows the compute dtype are refused, not
/// turned into all-zero advantages (as dividing by an infinite standard deviation would), in f32
/// and in f64; the same rewards scaled down are fine.
#[test]
fn advantages_that_overflow_are_refused_naming_the_rewards() {
    let cases = [
        (Tensor::from_slice2(&[[1e20f32, -1e20, 1e20, -1e20]]), f64::from(1e20f32)),
        (Tensor::from_slice2(&[[1e200f64, -1e200, 1e200, -1e200]]), 1e200),
    ];
    for (r, largest) in cases {
        for method in [GroupAdvantage::grpo(), GroupAdvantage::batch_std()] {
            match group_advantages(&r, method) {
                Err(LossError::InvalidArgument { argument: "rewards", value, reason }) => {
                    assert_eq!(value, largest, "{method:?}");
                    assert!(reason.contains("overflow") && reason.contains("rescale"), "{reason}");
                }
                other => panic!("{method:?} on {largest:e}: {other:?}"),
            }
        }
        let scaled = &r / largest;
        let a = vec1(&group_advantages(&scaled, GroupAdvantage::grpo()).unwrap());
        assert!(a.iter().all(|x| (x.abs() - 0.866).abs() < 1e-3), "{a:?}");
    }
}

/// GDPO by its definition: GRPO per dimension, the weighted sum, whitened over the real tokens
/// (each completion counted once per token, unbiased variance, 1e-8 added); rescaling one
/// dimension changes nothing (up to GRPO's ε).
#[test]
fn gdpo_matches_its_definition_and_ignores_each_dimensions_scale() {
    let (g, k) = (3usize, 4usize);
    let dims = [
        vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25, 0.75, 0.0],
        (0..12).map(|i| (i * 7 % 5) as f64).collect::<Vec<_>>(),
    ];
    let weights = [1.0, 0.5];
    let (_, mask) = fixed_groups(g, k, 9);
    let mut flat = vec![];
    for i in 0..g * k {
        flat.extend(dims.iter().map(|d| d[i]));
    }
    let r = Tensor::from_slice(&flat).view([g as i64, k as i64, 2]);
    let m = t2(&mask);
    let got =
        vec1(&gdpo_advantages(&r, &weights, &m, GroupAdvantage::grpo(), SingletonGroup::ZeroMeanUnitStd).unwrap());
    let mut sum = vec![0.0; g * k];
    for (d, w) in dims.iter().zip(weights) {
        let rows: Vec<Vec<f64>> = d.chunks(k).map(<[f64]>::to_vec).collect();
        for (gi, row) in rows.iter().enumerate() {
            let mean = row.iter().sum::<f64>() / k as f64;
            for (j, x) in row.iter().enumerate() {
                sum[gi * k + j] += w * (x - mean) / (ref_std(row) + 1e-6);
            }
        }
    }
    let tokens: Vec<f64> =
        mask.iter().zip(&sum).flat_map(|(m, s)| m.iter().filter(|x| **x > 0.0).map(move |_| *s)).collect();
    let n = tokens.len() as f64;
    let mean = tokens.iter().sum::<f64>() / n;
    let var = tokens.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let want: Vec<f64> =
        mask.iter().zip(&sum).flat_map(|(m, s)| m.iter().map(move |x| x * (s - mean) / (var + 1e-8).sqrt())).collect();
    assert_close(&got, &want, 1e-10, "GDPO");
    let scaled = &r * Tensor::from_slice(&[1.0f64, 1000.0]);
    let again =
        vec1(&gdpo_advantages(&scaled, &weights, &m, GroupAdvantage::grpo(), SingletonGroup::ZeroMeanUnitStd).unwrap());
    assert_close(&again, &got, 1e-5, "GDPO with a rescaled dimension");
    let e = gdpo_advantages(&r, &[1.0], &m, GroupAdvantage::grpo(), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "weights", .. }), "{e:?}");
    let e =
        gdpo_advantages(&r, &weights, &m.narrow(0, 0, 5), GroupAdvantage::grpo(), SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e:?}");
}

#[test]
fn gdpo_matches_verl() {
    let (g, k) = (3usize, 4usize);
    // Values exact in f32, which verl reads them in.
    let dims = [
        vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25, 0.75, 0.0],
        (0..12).map(|i| (i * 7 % 5) as f64).collect::<Vec<_>>(),
    ];
    let (_, mask) = fixed_groups(g, k, 11);
    let index: Vec<usize> = (0..g * k).map(|i| i / k).collect();
    let mut flat = vec![];
    for i in 0..g * k {
        flat.extend(dims.iter().map(|d| d[i]));
    }
    let r = Tensor::from_slice(&flat).view([g as i64, k as i64, 2]);
    let cases = [([1.0, 1.0], true), ([2.0, 0.5], true), ([1.0, 3.0], false)];
    let calls: Vec<serde_json::Value> = cases
        .iter()
        .map(|(w, norm)| json!({"fn": "verl.gdpo_advantage", "args": {"scores": dims, "weights": w, "mask": mask, "index": index, "epsilon": 1e-6, "norm_by_std": norm}}))
        .collect();
    let Some(res) = peer(&calls) else { return };
    for ((w, norm), r_peer) in cases.iter().zip(&res) {
        let method = if *norm { GroupAdvantage::grpo() } else { GroupAdvantage::DrGrpo };
        let ours = vec1(&gdpo_advantages(&r, w, &t2(&mask), method, SingletonGroup::ZeroMeanUnitStd).unwrap());
        // verl computes in float32.
        assert_close(&ours, &json_f64(&r_peer["advantages"]), 1e-5, &format!("GDPO {w:?} {norm}"));
    }
}
