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

// ---- Batch-std scaling, OPO and groups of one ----

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
    let mut next = uniform_stream(seed);
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

// ---- The optimal token baseline, MaxRL and DAPO's overlong penalty ----

use topr_loss::{maxrl_advantages, optimal_token_baseline_advantages, overlong_penalty};

/// The inputs of the optimal token baseline, one row per completion, rows `g·K .. g·K + K − 1`
/// forming group `g`.
#[derive(Debug, Clone)]
struct OtbCase {
    lp: Vec<Vec<f64>>,
    sp: Vec<Vec<f64>>,
    r: Vec<Vec<f64>>,
    mask: Vec<Vec<bool>>,
    is_weights: Option<Vec<Vec<f64>>>,
    k: usize,
}

/// `(log π(y), Σ_v π(v)²)` of a softmax over `z`, by loops.
fn token_probs(z: &[f64], y: usize) -> (f64, f64) {
    let zmax = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = z.iter().map(|v| (v - zmax).exp()).sum();
    let p: Vec<f64> = z.iter().map(|v| (v - zmax).exp() / total).collect();
    (p[y].ln(), p.iter().map(|x| x * x).sum())
}

impl OtbCase {
    /// `(logp_mu, sum_pi_squared, token_rewards, mask, is_weights)` with `padding` in every
    /// masked entry.
    fn tensors(&self, padding: f64) -> (Tensor, Tensor, Tensor, Tensor, Option<Tensor>) {
        let fill = |v: &[Vec<f64>]| -> Tensor {
            let rows: Vec<Vec<f64>> = v
                .iter()
                .zip(&self.mask)
                .map(|(row, m)| row.iter().zip(m).map(|(x, m)| if *m { *x } else { padding }).collect())
                .collect();
            t2(&rows)
        };
        let mask = Tensor::stack(&self.mask.iter().map(|r| Tensor::from_slice(r)).collect::<Vec<_>>(), 0);
        (fill(&self.lp), fill(&self.sp), fill(&self.r), mask, self.is_weights.as_ref().map(|w| fill(w)))
    }

    fn mask_f64(&self) -> Vec<Vec<f64>> {
        self.mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect()
    }

    /// `v` with 0 on padding (what the peer is given: verl multiplies padding by the mask).
    fn zero_padded(&self, v: &[Vec<f64>]) -> Vec<Vec<f64>> {
        v.iter()
            .zip(&self.mask)
            .map(|(row, m)| row.iter().zip(m).map(|(x, m)| if *m { *x } else { 0.0 }).collect())
            .collect()
    }

    fn run(&self, padding: f64, verl: bool, eps: f64) -> Result<topr_loss::TokenAdvantages, LossError> {
        let (lp, sp, r, m, w) = self.tensors(padding);
        let singleton = if verl { SingletonGroup::ZeroMeanUnitStd } else { SingletonGroup::OwnMean };
        optimal_token_baseline_advantages(&lp, &sp, &r, &m, w.as_ref(), self.k as i64, singleton, eps)
    }
}

/// The optimal token baseline by loops, from the formulas of verl's
/// `compute_optimal_token_baseline_advantage` written per position: returns `G`, path variance
/// `W`, the group's `W`-weighted mean of `G` at each position (0 where its weights sum to 0) and,
/// with `lone_zero`, baseline 0 for a completion that is the only real one of its group at a
/// position. Returns `(advantages, returns)`, flattened, 0 on padding.
fn ref_otb(c: &OtbCase, lone_zero: bool, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let (b, t) = (c.mask.len(), c.mask[0].len());
    let mut ret = vec![vec![0.0; t]; b];
    let mut big_w = vec![vec![0.0; t]; b];
    for i in 0..b {
        let mut g = 0.0;
        for s in (0..t).rev() {
            if c.mask[i][s] {
                g += c.r[i][s];
                ret[i][s] = g;
            }
        }
        let mut acc = 0.0;
        for s in 0..t {
            if c.mask[i][s] {
                let rho = c.is_weights.as_ref().map_or(1.0, |w| w[i][s]);
                acc += (1.0 - 2.0 * c.lp[i][s].exp() + c.sp[i][s]) * rho * rho;
                big_w[i][s] = acc;
            }
        }
    }
    let mut adv = vec![0.0; b * t];
    for first in (0..b).step_by(c.k) {
        for s in 0..t {
            let real: Vec<usize> = (first..first + c.k).filter(|&i| c.mask[i][s]).collect();
            let num: f64 = real.iter().map(|&i| ret[i][s] * big_w[i][s]).sum();
            let den: f64 = real.iter().map(|&i| big_w[i][s]).sum::<f64>() + eps;
            let base = if (lone_zero && real.len() == 1) || den == 0.0 { 0.0 } else { num / den };
            for &i in &real {
                adv[i * t + s] = ret[i][s] - base;
            }
        }
    }
    (adv, ret.concat())
}

/// Random OTB inputs: `G ≤ 3` groups of `K ≤ 4`, `T ≤ 5` positions, log-probs and `Σπ²` of a
/// softmax over 3 logits, any mask (holes included), per-token rewards, optional IS weights.
fn otb_cases() -> impl Strategy<Value = OtbCase> {
    (1usize..4, 1usize..5, 1usize..6, any::<bool>()).prop_flat_map(|(g, k, t, with_is)| {
        let token = (
            prop::array::uniform3(-3.0f64..3.0),
            0usize..3,
            prop_oneof![Just(0.0f64), -2.0f64..2.0],
            0.0f64..2.0,
            prop::bool::weighted(0.8),
        );
        prop::collection::vec(prop::collection::vec(token, t), g * k).prop_map(move |rows| {
            let mut c =
                OtbCase { lp: vec![], sp: vec![], r: vec![], mask: vec![], is_weights: with_is.then(Vec::new), k };
            for row in rows {
                let (lp, sp): (Vec<f64>, Vec<f64>) = row.iter().map(|(z, y, ..)| token_probs(z, *y)).unzip();
                c.lp.push(lp);
                c.sp.push(sp);
                c.r.push(row.iter().map(|x| x.2).collect());
                c.mask.push(row.iter().map(|x| x.4).collect());
                if let Some(w) = c.is_weights.as_mut() {
                    w.push(row.iter().map(|x| x.3).collect());
                }
            }
            c
        })
    })
}

/// A fixed OTB batch with right-padded masks (verl's responses): lengths 1..=T, an outcome reward
/// (0 or 1) on each last real token plus a small reward on some tokens, IS weights if asked.
fn otb_fixed(g: usize, k: usize, t: usize, seed: u64, with_is: bool) -> OtbCase {
    let mut next = uniform_stream(seed);
    let mut c = OtbCase { lp: vec![], sp: vec![], r: vec![], mask: vec![], is_weights: with_is.then(Vec::new), k };
    for _ in 0..g * k {
        let len = 1 + (next() * t as f64) as usize % t;
        let outcome = if next() < 0.5 { 1.0 } else { 0.0 };
        let (mut lp, mut sp, mut r, mut w) = (vec![], vec![], vec![], vec![]);
        for j in 0..t {
            let z = [next() * 6.0 - 3.0, next() * 6.0 - 3.0, next() * 6.0 - 3.0, next() * 2.0];
            let (l, p) = token_probs(&z, (next() * 4.0) as usize % 4);
            lp.push(l);
            sp.push(p);
            let step = if next() < 0.3 { next() * 0.2 - 0.1 } else { 0.0 };
            r.push(step + if j + 1 == len { outcome } else { 0.0 });
            w.push(0.5 + next());
        }
        c.mask.push((0..t).map(|j| j < len).collect());
        c.lp.push(lp);
        c.sp.push(sp);
        c.r.push(r);
        if let Some(iw) = c.is_weights.as_mut() {
            iw.push(w);
        }
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The optimal token baseline equals its loop definition, under both conventions for a lone
    /// completion and whatever the padding holds.
    #[test]
    fn optimal_token_baseline_matches_its_definition(c in otb_cases(), verl in any::<bool>(), eps in prop_oneof![Just(0.0f64), Just(1e-8), 0.0f64..0.5]) {
        let out = c.run(f64::NAN, verl, eps).unwrap();
        let (want_a, want_r) = ref_otb(&c, verl, eps);
        assert_close(&vec1(&out.advantages), &want_a, 1e-10, "OTB advantages");
        assert_close(&vec1(&out.returns), &want_r, 1e-10, "OTB returns");
        prop_assert_eq!((out.advantages.kind(), out.advantages.requires_grad()), (tch::Kind::Double, false));
    }

    /// Without `eps`: at each position the advantages of a group's real completions, weighted by
    /// `W`, sum to 0; a constant importance weight changes nothing (it scales every `W`); adding
    /// the same reward to every completion's last real token changes nothing (`B` moves with `G`).
    #[test]
    fn optimal_token_baseline_properties(c in otb_cases(), rho in 0.1f64..3.0, shift in -2.0f64..2.0) {
        let a = vec1(&c.run(0.0, false, 0.0).unwrap().advantages);
        let (b, t) = (c.mask.len(), c.mask[0].len());
        let big_w = |i: usize, s: usize| -> f64 {
            (0..=s).filter(|&j| c.mask[i][j]).map(|j| {
                let rho = c.is_weights.as_ref().map_or(1.0, |w| w[i][j]);
                (1.0 - 2.0 * c.lp[i][j].exp() + c.sp[i][j]) * rho * rho
            }).sum()
        };
        for first in (0..b).step_by(c.k) {
            for s in 0..t {
                let real: Vec<usize> = (first..first + c.k).filter(|&i| c.mask[i][s]).collect();
                let total: f64 = real.iter().map(|&i| big_w(i, s)).sum();
                let sum: f64 = real.iter().map(|&i| big_w(i, s) * a[i * t + s]).sum();
                prop_assert!(sum.abs() <= 1e-9 * total.max(1.0) * 10.0, "group {first}, position {s}: {sum}");
            }
        }
        let mut constant = c.clone();
        constant.is_weights = Some(vec![vec![rho; t]; b]);
        let mut plain = c.clone();
        plain.is_weights = None;
        let (x, y) = (vec1(&constant.run(0.0, false, 0.0).unwrap().advantages), vec1(&plain.run(0.0, false, 0.0).unwrap().advantages));
        assert_close(&x, &y, 1e-9, "a constant IS weight");
        let mut shifted = c.clone();
        for (r, m) in shifted.r.iter_mut().zip(&c.mask) {
            if let Some(last) = m.iter().rposition(|x| *x) {
                r[last] += shift;
            }
        }
        assert_close(&vec1(&shifted.run(0.0, false, 0.0).unwrap().advantages), &a, 1e-9, "a shifted outcome reward");
    }

    /// With the same token distribution everywhere and equal lengths, every completion has the same
    /// `W` at each position: OTB on outcome rewards is the group-mean baseline (Dr. GRPO) on every
    /// token, under either convention for groups of one.
    #[test]
    fn optimal_token_baseline_with_uniform_weights_is_dr_grpo(rows in groups(), t in 1usize..5, z in prop::array::uniform3(-3.0f64..3.0), verl in any::<bool>()) {
        let k = rows[0].len();
        let (lp, sp) = token_probs(&z, 0);
        let flat: Vec<f64> = rows.iter().flatten().copied().collect();
        let c = OtbCase {
            lp: vec![vec![lp; t]; flat.len()],
            sp: vec![vec![sp; t]; flat.len()],
            r: flat.iter().map(|r| (0..t).map(|j| if j + 1 == t { *r } else { 0.0 }).collect()).collect(),
            mask: vec![vec![true; t]; flat.len()],
            is_weights: None,
            k,
        };
        let a = vec1(&c.run(0.0, verl, 0.0).unwrap().advantages);
        let singleton = if verl { SingletonGroup::ZeroMeanUnitStd } else { SingletonGroup::OwnMean };
        let dr = vec1(&group_advantages_with(&t2(&rows), GroupAdvantage::DrGrpo, singleton).unwrap());
        let want: Vec<f64> = dr.iter().flat_map(|a| vec![*a; t]).collect();
        assert_close(&a, &want, 1e-9, "OTB with uniform weights");
    }
}

/// The crate against verl's own `compute_optimal_token_baseline_advantage` on right-padded
/// batches (per-token and outcome rewards, with and without IS weights, groups of one): verl's
/// `handle_zero_tail=True` is `SingletonGroup::ZeroMeanUnitStd`, `handle_zero_tail=False` is
/// `SingletonGroup::OwnMean` for groups of two or more.
#[test]
fn optimal_token_baseline_matches_verl() {
    let cases =
        [(3, 4, 6, 1u64, false), (2, 2, 5, 2, true), (4, 1, 4, 3, false), (1, 6, 7, 4, true), (2, 3, 3, 5, true)];
    let mut calls = vec![];
    let mut runs = vec![];
    for &(g, k, t, seed, with_is) in &cases {
        let c = otb_fixed(g, k, t, seed, with_is);
        let index: Vec<usize> = (0..g * k).map(|i| i / k).collect();
        for (zero_tail, eps) in [(true, 1e-8), (false, 1e-8), (true, 0.25)] {
            if !zero_tail && k == 1 {
                continue; // verl's group of one keeps baseline 0 either way
            }
            calls.push(json!({"fn": "verl.optimal_token_baseline_advantage", "args": {
                "token_rewards": c.zero_padded(&c.r), "mask": c.mask_f64(), "index": index,
                "old_log_probs": c.zero_padded(&c.lp), "sum_pi_squared": c.zero_padded(&c.sp),
                "rollout_is_weights": c.is_weights.as_ref().map(|w| c.zero_padded(w)),
                "handle_zero_tail": zero_tail, "epsilon": eps}}));
            runs.push((c.clone(), zero_tail, eps));
        }
    }
    // The zero-tail rule is exercised: some group has a unique longest completion.
    let lone = runs.iter().any(|(c, ..)| {
        c.mask.chunks(c.k).any(|grp| {
            let mut lens: Vec<usize> = grp.iter().map(|m| m.iter().filter(|x| **x).count()).collect();
            lens.sort_unstable();
            lens.len() > 1 && lens[lens.len() - 1] > lens[lens.len() - 2]
        })
    });
    assert!(lone, "no case has a unique longest completion");
    let Some(res) = peer(&calls) else { return };
    for ((c, zero_tail, eps), p) in runs.iter().zip(&res) {
        let out = c.run(f64::NAN, *zero_tail, *eps).unwrap();
        let what = format!("OTB K={} zero_tail={zero_tail} eps={eps} IS={}", c.k, c.is_weights.is_some());
        assert_close(&vec1(&out.advantages), &json_f64(&p["advantages"]), 1e-10, &what);
        assert_close(&vec1(&out.returns), &json_f64(&p["returns"]), 1e-10, &what);
    }
}

#[test]
fn optimal_token_baseline_errors_name_the_argument() {
    let c = otb_fixed(2, 2, 3, 7, true);
    let (lp, sp, r, m, w) = c.tensors(0.0);
    let w = w.unwrap();
    let verl = SingletonGroup::ZeroMeanUnitStd;
    let call = |lp: &Tensor, sp: &Tensor, r: &Tensor, m: &Tensor, w: Option<&Tensor>, k: i64, eps: f64| {
        optimal_token_baseline_advantages(lp, sp, r, m, w, k, verl, eps).unwrap_err()
    };
    for k in [0, -1, 3] {
        let e = call(&lp, &sp, &r, &m, Some(&w), k, 1e-8);
        assert!(matches!(e, LossError::InvalidArgument { argument: "group_size", .. }), "{e}");
    }
    let e = call(&lp, &sp, &r, &m, None, 2, -1.0);
    assert!(matches!(e, LossError::InvalidArgument { argument: "eps", .. }), "{e}");
    let e = call(&lp, &(&sp + 1.0), &r, &m, None, 2, 1e-8);
    assert!(matches!(e, LossError::InvalidArgument { argument: "sum_pi_squared", .. }), "{e}");
    let e = call(&lp, &(-&sp), &r, &m, None, 2, 1e-8);
    assert!(matches!(e, LossError::InvalidArgument { argument: "sum_pi_squared", .. }), "{e}");
    let e = call(&lp, &sp, &r, &m, Some(&(-&w)), 2, 1e-8);
    assert!(matches!(e, LossError::InvalidArgument { argument: "is_weights", .. }), "{e}");
    let e = call(&(-&lp), &sp, &r, &m, None, 2, 1e-8);
    assert!(matches!(e, LossError::PositiveLogProb { argument: "logp_mu", .. }), "{e}");
    let e = call(&lp, &sp, &r, &m, Some(&w.narrow(1, 0, 2)), 2, 1e-8);
    assert!(matches!(e, LossError::ShapeMismatch { argument: "is_weights", .. }), "{e}");
    let e = call(&lp, &sp, &r.to_kind(tch::Kind::Int64), &m, None, 2, 1e-8);
    assert!(matches!(e, LossError::WrongDtype { argument: "token_rewards", .. }), "{e}");
    let e = call(&lp, &sp.copy().fill_diagonal_(f64::NAN, false), &r, &m, None, 2, 1e-8);
    assert!(matches!(e, LossError::NonFinite { argument: "sum_pi_squared", .. }), "{e}");
    let e = call(&lp, &sp, &r, &m.narrow(0, 0, 3), None, 1, 1e-8);
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e}");
    // f32 (and f16) inputs give f32 results, detached.
    let (lp, sp, r, m, w) = c.tensors(0.0);
    let half = w.map(|w| w.to_kind(tch::Kind::Half));
    let out = optimal_token_baseline_advantages(
        &lp.to_kind(tch::Kind::Float),
        &sp.to_kind(tch::Kind::Float),
        &r.to_kind(tch::Kind::Half),
        &m,
        half.as_ref(),
        2,
        verl,
        1e-8,
    )
    .unwrap();
    assert_eq!(
        (out.advantages.kind(), out.returns.kind(), out.advantages.requires_grad()),
        (tch::Kind::Float, tch::Kind::Float, false)
    );
    // Padding is not checked: NaN, positive log-probs and out-of-range Σπ² there are ignored.
    let (lp, sp, r, m, w) = c.tensors(f64::NAN);
    let pad = m.logical_not();
    let (lp, sp) = (lp.masked_fill(&pad, 5.0), sp.masked_fill(&pad, -3.0));
    assert!(optimal_token_baseline_advantages(&lp, &sp, &r, &m, w.as_ref(), 2, verl, 1e-8).is_ok());
}

/// MaxRL by loops: `(R − r̄)/(r̄ + eps)`, 0 for a group of one and where `r̄ + eps = 0`.
fn ref_maxrl(rows: &[Vec<f64>], eps: f64) -> Vec<f64> {
    let mut out = vec![];
    for r in rows {
        let mean = r.iter().sum::<f64>() / r.len() as f64;
        out.extend(r.iter().map(|x| if r.len() == 1 || mean + eps == 0.0 { 0.0 } else { (x - mean) / (mean + eps) }));
    }
    out
}

/// SkyRL's `compute_maxrl_advantage` restated: `(R − r̄)/(r̄ + ε)`, a group of one gets `R`.
fn skyrl_maxrl(rows: &[Vec<f64>], eps: f64) -> Vec<f64> {
    rows.iter()
        .flat_map(|r| {
            let mean = if r.len() > 1 { r.iter().sum::<f64>() / r.len() as f64 } else { 0.0 };
            let scale = if r.len() > 1 { mean + eps } else { 1.0 };
            r.iter().map(move |x| (x - mean) / scale).collect::<Vec<_>>()
        })
        .collect()
}

/// TRL's `MaxRLTrainer` lines restated: `(R − r̄)/(|r̄| + 1e-6)` over `rewards.view(-1, K)`.
fn trl_maxrl(rows: &[Vec<f64>]) -> Vec<f64> {
    rows.iter()
        .flat_map(|r| {
            let mean = r.iter().sum::<f64>() / r.len() as f64;
            r.iter().map(move |x| (x - mean) / (mean.abs() + 1e-6)).collect::<Vec<_>>()
        })
        .collect()
}

fn non_negative_groups() -> impl Strategy<Value = Vec<Vec<f64>>> {
    (1usize..6, 1usize..9).prop_flat_map(|(g, k)| {
        prop::collection::vec(prop::collection::vec(prop_oneof![Just(1.0f64), Just(0.0), 0.0f64..3.0], k), g)
    })
}

proptest! {
    #[test]
    fn maxrl_matches_its_definition_and_its_peers(rows in non_negative_groups(), eps in prop_oneof![Just(0.0f64), Just(1e-6), 0.0f64..0.5]) {
        let got = vec1(&maxrl_advantages(&t2(&rows), eps).unwrap());
        assert_close(&got, &ref_maxrl(&rows, eps), 1e-10, "MaxRL");
        // TRL's formula for rewards >= 0 (groups of one included); SkyRL's for groups of two or more
        let trl = vec1(&maxrl_advantages(&t2(&rows), 1e-6).unwrap());
        assert_close(&trl, &trl_maxrl(&rows), 1e-10, "MaxRL as TRL");
        // (SkyRL's 0/0 for an all-zero group with eps = 0 is NaN; the crate's is 0.)
        if rows[0].len() > 1 && eps > 0.0 {
            assert_close(&got, &skyrl_maxrl(&rows, eps), 1e-10, "MaxRL as SkyRL");
        }
        // Each group's advantages sum to 0; times (r̄ + eps) they are Dr. GRPO's.
        let k = rows[0].len();
        let dr = vec1(&group_advantages(&t2(&rows), GroupAdvantage::DrGrpo).unwrap());
        for (g, r) in rows.iter().enumerate() {
            let a = &got[g * k..(g + 1) * k];
            prop_assert!(a.iter().sum::<f64>().abs() < 1e-9 * (k as f64) * a.iter().fold(1.0f64, |m, x| m.max(x.abs())));
            let mean = r.iter().sum::<f64>() / k as f64;
            if k > 1 && mean + eps > 0.0 {
                let scaled: Vec<f64> = a.iter().map(|x| x * (mean + eps)).collect();
                assert_close(&scaled, &dr[g * k..(g + 1) * k], 1e-9, "MaxRL × (r̄ + eps)");
            }
        }
    }

    /// Binary rewards, `eps = 0`: with `c` successes among `K`, a success gets `(K − c)/c`, a
    /// failure −1 (0 for the whole group when `c` is 0 or `K`); scaling every reward changes nothing.
    #[test]
    fn maxrl_on_binary_rewards(rows in prop::collection::vec(prop::collection::vec(any::<bool>(), 2..9), 1..6), scale in 0.1f64..10.0) {
        let k = rows.iter().map(Vec::len).min().unwrap();
        let rows: Vec<Vec<f64>> = rows.iter().map(|r| r[..k].iter().map(|b| f64::from(u8::from(*b))).collect()).collect();
        let got = vec1(&maxrl_advantages(&t2(&rows), 0.0).unwrap());
        let mut want = vec![];
        for r in &rows {
            let c = r.iter().sum::<f64>();
            let all_same = c == 0.0 || c == k as f64;
            want.extend(r.iter().map(|x| if all_same { 0.0 } else if *x == 1.0 { (k as f64 - c) / c } else { -1.0 }));
        }
        assert_close(&got, &want, 1e-12, "MaxRL on 0/1 rewards");
        let scaled: Vec<Vec<f64>> = rows.iter().map(|r| r.iter().map(|x| x * scale).collect()).collect();
        assert_close(&vec1(&maxrl_advantages(&t2(&scaled), 0.0).unwrap()), &got, 1e-12, "MaxRL on scaled rewards");
    }
}

#[test]
fn maxrl_errors_name_the_argument() {
    let e = maxrl_advantages(&Tensor::from_slice2(&[[1.0f64, -0.5]]), 1e-6).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "rewards", value, .. } if value == -0.5), "{e}");
    for eps in [-1.0, f64::NAN, f64::INFINITY] {
        let e = maxrl_advantages(&Tensor::from_slice2(&[[1.0f64, 0.0]]), eps).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument: "eps", .. }), "{e}");
    }
    let e = maxrl_advantages(&t1(&[1.0, 0.0]), 1e-6).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "rewards", .. }), "{e}");
    let e = maxrl_advantages(&Tensor::from_slice2(&[[f64::NAN, 0.0]]), 1e-6).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "rewards", .. }), "{e}");
    // A group mean beyond the dtype's range is refused, not turned into NaN.
    let e = maxrl_advantages(&Tensor::from_slice2(&[[3e38f32, 3e38, 3e38]]), 1e-6).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "rewards", .. }), "{e}");
    // Groups of one get 0; f32 rewards give f32 advantages.
    let a = maxrl_advantages(&Tensor::from_slice2(&[[1.0f32], [0.0]]), 1e-6).unwrap();
    assert_eq!((vec1(&a), a.kind()), (vec![0.0, 0.0], tch::Kind::Float));
}

/// verl's three lines (`DAPORewardManager.__call__`, dapo.py) restated:
/// `expected_len = max_resp_len − len`, `exceed_len = L − expected_len`,
/// `overlong_reward = min(−exceed_len / len · penalty_factor, 0)`.
fn verl_overlong(l: f64, max_resp_len: i64, len: i64, factor: f64) -> f64 {
    let expected_len = (max_resp_len - len) as f64;
    let exceed_len = l - expected_len;
    (-exceed_len / len as f64 * factor).min(0.0)
}

/// OpenRLHF's `apply_overlong_penalty` restated: the excess capped at the buffer.
fn openrlhf_overlong(l: f64, max_len: i64, buffer: i64, factor: f64) -> f64 {
    let exceed = (l - (max_len - buffer) as f64).min(buffer as f64);
    if exceed > 0.0 { -exceed / buffer as f64 * factor } else { 0.0 }
}

/// TRL's `get_soft_overlong_punishment` restated (DAPO's Eq. 13, factor 1).
fn trl_overlong(l: f64, max_len: i64, cache: i64) -> f64 {
    let soft = (max_len - cache) as f64;
    if l <= soft {
        0.0
    } else if l <= max_len as f64 {
        (soft - l) / cache as f64
    } else {
        -1.0
    }
}

fn overlong_settings() -> impl Strategy<Value = (Vec<f64>, i64, i64, f64)> {
    (1i64..400).prop_flat_map(|max_len| {
        (
            prop::collection::vec((0i64..(2 * max_len + 5)).prop_map(|l| l as f64), 1..20),
            Just(max_len),
            1i64..=max_len,
            prop_oneof![Just(1.0f64), Just(0.0), 0.0f64..3.0],
        )
    })
}

proptest! {
    #[test]
    fn overlong_penalty_matches_verl_and_its_shape((lengths, max_len, buffer, factor) in overlong_settings()) {
        let got = vec1(&overlong_penalty(&t1(&lengths), max_len, buffer, factor).unwrap());
        let want: Vec<f64> = lengths.iter().map(|l| verl_overlong(*l, max_len, buffer, factor)).collect();
        assert_close(&got, &want, 1e-12, "overlong penalty");
        let soft = (max_len - buffer) as f64;
        for (l, p) in lengths.iter().zip(&got) {
            prop_assert!(*p <= 0.0 && (*l > soft || *p == 0.0));
            if *l <= max_len as f64 {
                prop_assert!((p - openrlhf_overlong(*l, max_len, buffer, factor)).abs() < 1e-12, "as OpenRLHF within max_len");
                prop_assert!(*p >= -factor - 1e-12);
            } else {
                prop_assert!(*p < -factor || factor == 0.0, "beyond max_len the line goes on");
            }
        }
        // Integer lengths give the same (in f32), and TRL's values inside max_len with factor 1.
        let ints: Vec<i64> = lengths.iter().map(|l| *l as i64).collect();
        let from_ints = vec1(&overlong_penalty(&Tensor::from_slice(&ints), max_len, buffer, 1.0).unwrap());
        for (l, p) in lengths.iter().zip(&from_ints) {
            let trl = trl_overlong(*l, max_len, buffer);
            if *l <= max_len as f64 {
                prop_assert!((p - trl).abs() < 1e-5, "as TRL: {p} vs {trl}");
            }
        }
        // Non-increasing in the length.
        let mut sorted = lengths.clone();
        sorted.sort_by(f64::total_cmp);
        let s = vec1(&overlong_penalty(&t1(&sorted), max_len, buffer, factor).unwrap());
        prop_assert!(s.windows(2).all(|w| w[1] <= w[0]));
    }
}

#[test]
fn overlong_penalty_dtypes_and_errors() {
    let l = Tensor::from_slice2(&[[80i64, 90], [100, 120]]);
    for kind in
        [tch::Kind::Int64, tch::Kind::Int, tch::Kind::Uint8, tch::Kind::Half, tch::Kind::Float, tch::Kind::Double]
    {
        let p = overlong_penalty(&l.to_kind(kind), 100, 20, 0.5).unwrap();
        let want = if kind == tch::Kind::Double { tch::Kind::Double } else { tch::Kind::Float };
        assert_eq!((p.size(), p.kind()), (vec![2, 2], want), "{kind:?}");
        assert_eq!(vec1(&p), vec![0.0, -0.25, -0.5, -1.0], "{kind:?}");
    }
    // The whole buffer (buffer_len = max_len): the penalty starts at length 0.
    assert_eq!(vec1(&overlong_penalty(&t1(&[0.0, 5.0]), 10, 10, 1.0).unwrap()), vec![0.0, -0.5]);
    let ok = t1(&[10.0]);
    for (max_len, buffer) in [(100, 0), (100, -5), (100, 101), (0, 1)] {
        let e = overlong_penalty(&ok, max_len, buffer, 1.0).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument: "buffer_len", .. }), "{e}");
    }
    for factor in [-0.5, f64::NAN, f64::INFINITY] {
        let e = overlong_penalty(&ok, 100, 20, factor).unwrap_err();
        assert!(matches!(e, LossError::InvalidArgument { argument: "penalty_factor", .. }), "{e}");
    }
    let e = overlong_penalty(&t1(&[10.0, -1.0]), 100, 20, 1.0).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "lengths", value, .. } if value == -1.0), "{e}");
    let e = overlong_penalty(&t1(&[f64::NAN]), 100, 20, 1.0).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "lengths", .. }), "{e}");
    let e = overlong_penalty(&Tensor::from_slice(&[true]), 100, 20, 1.0).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "lengths", .. }), "{e}");
    let e = overlong_penalty(&t1(&[]), 100, 20, 1.0).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "lengths", .. }), "{e}");
    let e = overlong_penalty(&Tensor::new(), 100, 20, 1.0).unwrap_err();
    assert_eq!(e, LossError::UnsupportedTensor { argument: "lengths", what: "undefined" });
}
