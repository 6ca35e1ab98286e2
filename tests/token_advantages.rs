//! REINFORCE++, REINFORCE++-baseline, ReMax and GAE against plain loops, their limits, padding,
//! dtypes, errors and verl 0.9.1's own estimators.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    LossError, SingletonGroup, gae_advantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
    remax_advantages, whiten,
};

type Rows = Vec<Vec<f64>>;

/// `G_t = r_t + γ G_{t+1}` over the real tokens, right to left; 0 on padding.
fn ref_returns(r: &Rows, m: &[Vec<bool>], gamma: f64) -> Rows {
    r.iter()
        .zip(m)
        .map(|(r, m)| {
            let mut g = vec![0.0; r.len()];
            let mut running = 0.0;
            for t in (0..r.len()).rev() {
                if m[t] {
                    running = r[t] + gamma * running;
                    g[t] = running;
                }
            }
            g
        })
        .collect()
}

/// `(x − μ)/sqrt(σ² + eps)` over the real entries (unbiased σ²); 0 on padding.
fn ref_whiten(x: &Rows, m: &[Vec<bool>], eps: f64) -> Rows {
    let vals: Vec<f64> = x.iter().flatten().zip(m.iter().flatten()).filter(|(_, m)| **m).map(|(x, _)| *x).collect();
    let n = vals.len() as f64;
    let mean = vals.iter().sum::<f64>() / n;
    let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    x.iter()
        .zip(m)
        .map(|(x, m)| x.iter().zip(m).map(|(x, m)| if *m { (x - mean) / (var + eps).sqrt() } else { 0.0 }).collect())
        .collect()
}

/// GAE by its recursion over the real tokens: `(advantages, returns)`, 0 on padding.
fn ref_gae(r: &Rows, v: &Rows, m: &[Vec<bool>], gamma: f64, lam: f64) -> (Rows, Rows) {
    let (mut adv, mut ret) = (vec![], vec![]);
    for i in 0..r.len() {
        let t_len = r[i].len();
        let (mut a, mut g) = (vec![0.0; t_len], vec![0.0; t_len]);
        let (mut next_v, mut next_a) = (0.0, 0.0);
        for t in (0..t_len).rev() {
            if !m[i][t] {
                continue;
            }
            let delta = r[i][t] + gamma * next_v - v[i][t];
            a[t] = delta + gamma * lam * next_a;
            g[t] = a[t] + v[i][t];
            next_v = v[i][t];
            next_a = a[t];
        }
        adv.push(a);
        ret.push(g);
    }
    (adv, ret)
}

fn flat(x: &Rows) -> Vec<f64> {
    x.iter().flatten().copied().collect()
}

fn mask_tensor(m: &[Vec<bool>]) -> Tensor {
    Tensor::stack(&m.iter().map(|r| Tensor::from_slice(r)).collect::<Vec<_>>(), 0)
}

/// `x` with `fill` written on the padding.
fn padded(x: &Rows, m: &[Vec<bool>], fill: f64) -> Tensor {
    t2(&x
        .iter()
        .zip(m)
        .map(|(x, m)| x.iter().zip(m).map(|(x, m)| if *m { *x } else { fill }).collect())
        .collect::<Rows>())
}

/// Batches of 1–4 sequences of 2–7 tokens, rewards and values in ±2, at least two real tokens.
fn batch() -> impl Strategy<Value = (Rows, Rows, Vec<Vec<bool>>)> {
    (1usize..5, 2usize..8).prop_flat_map(|(b, t)| {
        (
            prop::collection::vec(prop::collection::vec(prop_oneof![Just(0.0f64), -2.0f64..2.0], t), b),
            prop::collection::vec(prop::collection::vec(-2.0f64..2.0, t), b),
            prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.75), t), b),
        )
            .prop_map(move |(r, v, mut m)| {
                m[0][0] = true;
                m[b - 1][t - 1] = true;
                (r, v, m)
            })
    })
}

proptest! {
    #[test]
    fn reinforce_pp_matches_its_definition((r, _, m) in batch(), gamma in prop_oneof![Just(1.0f64), Just(0.0), 0.0f64..1.0]) {
        let g = ref_returns(&r, &m, gamma);
        let vals: Vec<f64> = flat(&g).into_iter().zip(m.iter().flatten()).filter(|(_, m)| **m).map(|(g, _)| g).collect();
        let mean = vals.iter().sum::<f64>() / vals.len() as f64;
        prop_assume!(vals.iter().any(|v| (v - mean).abs() > 1e-3));
        // NaN on padding: ignored.
        let out = reinforce_pp_advantages(&padded(&r, &m, f64::NAN), &mask_tensor(&m), gamma, 1e-8).unwrap();
        assert_close(&vec1(&out.returns), &flat(&g), 1e-12, "returns");
        assert_close(&vec1(&out.advantages), &flat(&ref_whiten(&g, &m, 1e-8)), 1e-9, "advantages");
        prop_assert!(!out.advantages.requires_grad());
        // The same with zeros on padding, bit for bit.
        let zero = reinforce_pp_advantages(&padded(&r, &m, 0.0), &mask_tensor(&m), gamma, 1e-8).unwrap();
        prop_assert_eq!(vec1(&zero.advantages), vec1(&out.advantages));
    }

    #[test]
    fn reinforce_pp_baseline_matches_its_definition(g in 1usize..4, k in 1usize..4, seed in any::<u64>(), verl in any::<bool>()) {
        let mut s = seed;
        let mut next = || { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (s >> 11) as f64 / (1u64 << 53) as f64 };
        let rows: Rows = (0..g).map(|_| (0..k).map(|_| next() * 4.0 - 2.0).collect()).collect();
        let t = 4;
        let mut m: Vec<Vec<bool>> = (0..g * k).map(|_| (0..t).map(|_| next() < 0.7).collect()).collect();
        m[0][0] = true;
        m[g * k - 1][t - 1] = true;
        let singleton = if verl { SingletonGroup::ZeroMeanUnitStd } else { SingletonGroup::OwnMean };
        // A'_{g,k} = R − m_g on every token of the completion, then whitened over tokens.
        let per_token: Rows = (0..g * k)
            .map(|b| {
                let (gi, ki) = (b / k, b % k);
                let mean = if k == 1 && verl { 0.0 } else { rows[gi].iter().sum::<f64>() / k as f64 };
                vec![rows[gi][ki] - mean; t]
            })
            .collect();
        let vals: Vec<f64> = flat(&per_token).into_iter().zip(m.iter().flatten()).filter(|(_, m)| **m).map(|(x, _)| x).collect();
        let mean = vals.iter().sum::<f64>() / vals.len() as f64;
        prop_assume!(vals.iter().any(|v| (v - mean).abs() > 1e-3));
        let got = reinforce_pp_baseline_advantages(&t2(&rows), &mask_tensor(&m), 1e-8, singleton).unwrap();
        assert_close(&vec1(&got), &flat(&ref_whiten(&per_token, &m, 1e-8)), 1e-9, "reinforce++-baseline");
    }

    #[test]
    fn remax_matches_its_definition((r, v, m) in batch()) {
        let greedy: Vec<f64> = v.iter().map(|row| row[0]).collect();
        let out = remax_advantages(&padded(&r, &m, f64::NAN), &t1(&greedy), &mask_tensor(&m)).unwrap();
        let g = ref_returns(&r, &m, 1.0);
        let want: Rows = g.iter().zip(&m).zip(&greedy).map(|((g, m), b)| g.iter().zip(m).map(|(g, m)| if *m { g - b } else { 0.0 }).collect()).collect();
        assert_close(&vec1(&out.returns), &flat(&g), 1e-12, "returns");
        assert_close(&vec1(&out.advantages), &flat(&want), 1e-12, "advantages");
        // An outcome reward on the last real token: R − R_greedy on every real token.
        let outcome: Rows = r.iter().zip(&m).map(|(row, mr)| {
            let last = mr.iter().rposition(|x| *x);
            (0..row.len()).map(|t| if Some(t) == last { row[0] } else { 0.0 }).collect()
        }).collect();
        let out = remax_advantages(&t2(&outcome), &t1(&greedy), &mask_tensor(&m)).unwrap();
        let want: Vec<f64> = (0..r.len()).flat_map(|i| (0..r[i].len()).map(|t| if m[i][t] { r[i][0] - greedy[i] } else { 0.0 }).collect::<Vec<_>>()).collect();
        assert_close(&vec1(&out.advantages), &want, 1e-12, "outcome advantages");
    }

    #[test]
    fn gae_matches_its_recursion((r, v, m) in batch(), gamma in 0.0f64..=1.0, lam in 0.0f64..=1.0) {
        let out = gae_advantages(&padded(&r, &m, f64::NAN), &padded(&v, &m, f64::INFINITY), &mask_tensor(&m), gamma, lam).unwrap();
        let (a, g) = ref_gae(&r, &v, &m, gamma, lam);
        assert_close(&vec1(&out.advantages), &flat(&a), 1e-12, "advantages");
        assert_close(&vec1(&out.returns), &flat(&g), 1e-12, "returns");
        prop_assert!(!out.advantages.requires_grad() && !out.returns.requires_grad());
        // λ = 1, γ = 1: the Monte-Carlo return minus V; λ = 0: the one-step TD error.
        let mc = gae_advantages(&t2(&r), &t2(&v), &mask_tensor(&m), 1.0, 1.0).unwrap();
        let g1 = ref_returns(&r, &m, 1.0);
        let want: Vec<f64> = flat(&g1).iter().zip(flat(&v)).zip(m.iter().flatten()).map(|((g, v), m)| if *m { g - v } else { 0.0 }).collect();
        assert_close(&vec1(&mc.advantages), &want, 1e-12, "λ = 1");
        let td = vec1(&gae_advantages(&t2(&r), &t2(&v), &mask_tensor(&m), gamma, 0.0).unwrap().advantages);
        for i in 0..r.len() {
            let real: Vec<usize> = (0..r[i].len()).filter(|t| m[i][*t]).collect();
            for (j, &t) in real.iter().enumerate() {
                let next_v = real.get(j + 1).map_or(0.0, |&u| v[i][u]);
                let want = r[i][t] + gamma * next_v - v[i][t];
                prop_assert!((td[i * r[i].len() + t] - want).abs() < 1e-12);
            }
        }
    }
}

#[test]
fn dtypes_and_extremes() {
    let r = Tensor::from_slice2(&[[0.0f64, 1.0, 0.5], [1.0, -1.0, 0.0]]);
    let v = Tensor::from_slice2(&[[0.1f64, 0.2, 0.3], [0.0, 0.5, 1.0]]);
    let m = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
    for kind in [Kind::Half, Kind::BFloat16, Kind::Float, Kind::Double] {
        let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        let (rk, vk) = (r.to_kind(kind), v.to_kind(kind));
        assert_eq!(reinforce_pp_advantages(&rk, &m, 0.9, 1e-8).unwrap().advantages.kind(), want);
        assert_eq!(gae_advantages(&rk, &vk, &m, 0.9, 0.8).unwrap().returns.kind(), want);
        assert_eq!(remax_advantages(&rk, &vk.select(1, 0), &m).unwrap().advantages.kind(), want);
        let rows = Tensor::from_slice2(&[[1.0f64, 0.0]]).to_kind(kind);
        assert_eq!(reinforce_pp_baseline_advantages(&rows, &m, 1e-8, SingletonGroup::OwnMean).unwrap().kind(), want);
    }
    // Rewards whose sums overflow f32: a typed error, never a silent inf or NaN.
    let huge = Tensor::from_slice2(&[[3e38f32, 3e38, 3e38]]);
    let ones = Tensor::from_slice2(&[[true, true, true]]);
    for r in [
        reinforce_pp_advantages(&huge, &ones, 1.0, 1e-8).map(|o| o.advantages),
        gae_advantages(&huge, &huge.zeros_like(), &ones, 1.0, 1.0).map(|o| o.advantages),
        remax_advantages(&huge, &Tensor::from_slice(&[0.0f32]), &ones).map(|o| o.advantages),
    ] {
        assert!(matches!(r, Err(LossError::NonFiniteLoss { compute_dtype: "f32" })), "{r:?}");
    }
    // Large but representable: finite.
    let big = Tensor::from_slice2(&[[1e30f32, -1e30, 1e30]]);
    let out = gae_advantages(&big, &big, &ones, 1.0, 1.0).unwrap();
    assert!(vec1(&out.advantages).iter().all(|a| a.is_finite()));
}

#[test]
fn bad_inputs_are_errors() {
    let r = Tensor::from_slice2(&[[0.0f64, 1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let e = reinforce_pp_advantages(&r, &m, 1.5, 1e-8).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "gamma", .. }), "{e}");
    let e = reinforce_pp_advantages(&r, &m, 1.0, -1.0).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "eps", .. }), "{e}");
    let e = reinforce_pp_advantages(&r, &Tensor::from_slice2(&[[true, false]]), 1.0, 1e-8).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "token_rewards", .. }), "{e}");
    let e = reinforce_pp_advantages(&t1(&[1.0, 2.0]), &m, 1.0, 1e-8).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "token_rewards", .. }), "{e}");
    let e = gae_advantages(&r, &Tensor::from_slice2(&[[0.0f64, f64::NAN]]), &m, 1.0, 1.0).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "values", .. }), "{e}");
    let e = gae_advantages(&r, &r, &m, 1.0, f64::NAN).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "lam", .. }), "{e}");
    let e = gae_advantages(&r, &t1(&[0.0]), &m, 1.0, 1.0).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "values", .. }), "{e}");
    let e = gae_advantages(&r, &r, &Tensor::from_slice(&[true, true]), 1.0, 1.0).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e}");
    let e = remax_advantages(&r, &t1(&[0.0, 1.0]), &m).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "greedy_rewards", .. }), "{e}");
    let e = remax_advantages(&r, &Tensor::from_slice(&[1i64]), &m).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "greedy_rewards", .. }), "{e}");
    let e = reinforce_pp_baseline_advantages(&Tensor::from_slice2(&[[1.0f64, 0.0]]), &m, 1e-8, SingletonGroup::OwnMean)
        .unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e}");
    let e = reinforce_pp_baseline_advantages(&r, &m, 1e-8, SingletonGroup::OwnMean).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e}");
}

/// A fixed batch: rewards, values, a 0/1 mask with leading, trailing and inner padding.
fn fixed() -> (Rows, Rows, Rows) {
    let r = vec![
        vec![0.0, 0.3, 0.0, 1.0, 0.0, 0.0],
        vec![0.2, 0.0, -0.5, 0.0, 0.0, -1.0],
        vec![0.0, 0.0, 0.7, 0.0, 0.4, 0.0],
        vec![1.5, 0.0, 0.0, 0.0, 0.0, 0.0],
    ];
    let v = vec![
        vec![0.1, 0.4, -0.2, 0.8, 0.3, 0.9],
        vec![0.5, -0.3, 0.2, 0.1, 0.7, -0.4],
        vec![0.0, 0.6, 0.1, -0.5, 0.2, 0.3],
        vec![0.9, 0.2, 0.4, 0.1, -0.1, 0.6],
    ];
    let m = vec![
        vec![1.0, 1.0, 1.0, 1.0, 0.0, 0.0],
        vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0],
        vec![0.0, 1.0, 1.0, 1.0, 1.0, 0.0],
        vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ];
    (r, v, m)
}

/// The entries of `x` on the real tokens of `m`.
fn on_mask(x: &[f64], m: &Rows) -> Vec<f64> {
    x.iter().zip(m.iter().flatten()).filter(|(_, m)| **m > 0.0).map(|(x, _)| *x).collect()
}

#[test]
fn token_advantages_match_verl() {
    let (r, v, m) = fixed();
    let mb: Vec<Vec<bool>> = m.iter().map(|row| row.iter().map(|x| *x > 0.0).collect()).collect();
    let mask = mask_tensor(&mb);
    let greedy = [0.25, -0.5, 1.0, 0.0];
    // REINFORCE++-baseline: two prompts of two completions, and four groups of one; outcome tokens.
    let outcome = [1.0, 0.0, 0.5, -1.0];
    let last: Vec<usize> = mb.iter().map(|row| row.iter().rposition(|x| *x).unwrap()).collect();
    let tokens: Rows = (0..4).map(|i| (0..6).map(|t| if t == last[i] { outcome[i] } else { 0.0 }).collect()).collect();
    let mut calls = vec![];
    for gamma in [1.0, 0.9] {
        calls.push(
            json!({"fn": "verl.reinforce_pp_advantage", "args": {"token_rewards": r, "mask": m, "gamma": gamma}}),
        );
    }
    for (gamma, lam) in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)] {
        calls.push(
            json!({"fn": "verl.gae", "args": {"token_rewards": r, "values": v, "mask": m, "gamma": gamma, "lam": lam}}),
        );
    }
    calls
        .push(json!({"fn": "verl.remax_advantage", "args": {"token_rewards": r, "greedy_rewards": greedy, "mask": m}}));
    calls.push(json!({"fn": "verl.reinforce_pp_baseline_advantage", "args": {"token_rewards": tokens, "mask": m, "index": [0, 0, 1, 1]}}));
    calls.push(json!({"fn": "verl.reinforce_pp_baseline_advantage", "args": {"token_rewards": tokens, "mask": m, "index": [0, 1, 2, 3]}}));
    let Some(res) = peer(&calls) else { return };
    // verl's masked whitening divides its sums by N + 1e-8 instead of N: agreement to ~1e-9.
    let whitened_tol = 1e-7;
    for (c, gamma) in [1.0, 0.9].into_iter().enumerate() {
        let out = reinforce_pp_advantages(&t2(&r), &mask, gamma, 1e-8).unwrap();
        assert_close(&vec1(&out.returns), &json_f64(&res[c]["returns"]), 1e-12, "REINFORCE++ returns");
        assert_close(&vec1(&out.advantages), &json_f64(&res[c]["advantages"]), whitened_tol, "REINFORCE++ advantages");
    }
    for (c, (gamma, lam)) in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)].into_iter().enumerate() {
        let out = gae_advantages(&t2(&r), &t2(&v), &mask, gamma, lam).unwrap();
        let p = &res[2 + c];
        // verl leaves on padding the next real token's advantage; compare the real tokens.
        assert_close(&on_mask(&vec1(&out.returns), &m), &on_mask(&json_f64(&p["returns"]), &m), 1e-12, "GAE returns");
        let w = whiten(&out.advantages, Some(&mask), 1e-8).unwrap();
        assert_close(
            &on_mask(&vec1(&w), &m),
            &on_mask(&json_f64(&p["advantages"]), &m),
            whitened_tol,
            "GAE advantages",
        );
    }
    let out = remax_advantages(&t2(&r), &t1(&greedy), &mask).unwrap();
    assert_close(&on_mask(&vec1(&out.advantages), &m), &on_mask(&json_f64(&res[5]["advantages"]), &m), 1e-12, "ReMax");
    assert_close(
        &on_mask(&vec1(&out.returns), &m),
        &on_mask(&json_f64(&res[5]["returns"]), &m),
        1e-12,
        "ReMax returns",
    );
    let verl = SingletonGroup::ZeroMeanUnitStd;
    let pairs = Tensor::from_slice2(&[[outcome[0], outcome[1]], [outcome[2], outcome[3]]]);
    let got = reinforce_pp_baseline_advantages(&pairs, &mask, 1e-8, verl).unwrap();
    assert_close(&vec1(&got), &json_f64(&res[6]["advantages"]), whitened_tol, "REINFORCE++-baseline");
    let singles = t1(&outcome).reshape([4, 1]);
    let got = reinforce_pp_baseline_advantages(&singles, &mask, 1e-8, verl).unwrap();
    assert_close(&vec1(&got), &json_f64(&res[7]["advantages"]), whitened_tol, "REINFORCE++-baseline, groups of one");
}
