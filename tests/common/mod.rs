//! Helpers shared by the integration tests: independent scalar references of the published formulas
//! (the paper and the peers' code, as `docs/family.md` and `docs/methods.md` state them), tensor <-> Vec conversion and finite differences.
//! Nothing here calls the library's own math.
#![allow(dead_code)]

use proptest::prelude::*;
use tch::{Kind, Tensor};
use topr_loss::AggregationMode;

/// `[x]_a^b` from its definition.
pub fn ref_weight(x: f64, a: f64, b: f64) -> f64 {
    x.max(a).min(b)
}

/// The taper `T(x; a, b)` from its three-branch definition on the ratio `x` itself.
pub fn ref_taper(x: f64, a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else if x < a {
        a * (1.0 + (x / a).ln())
    } else if x <= b {
        x
    } else {
        b * (1.0 + (x / b).ln())
    }
}

/// `(a, b)` for a shifted reward under the paper's tie rule (`R' >= 0` positive) or the tapered one.
pub fn ref_limits(rp: f64, limits: [f64; 4], ties_positive: bool) -> (f64, f64) {
    let positive = if ties_positive { rp >= 0.0 } else { rp > 0.0 };
    if positive { (limits[0], limits[1]) } else { (limits[2], limits[3]) }
}

/// Sequence-level TOPR, value and gradient w.r.t. `logp`, by a plain loop.
pub fn ref_topr(logp: &[f64], logp_mu: &[f64], rewards: &[f64], limits: [f64; 4], c: f64) -> (f64, Vec<f64>) {
    let n = logp.len() as f64;
    let mut value = 0.0;
    let mut grad = vec![0.0; logp.len()];
    for i in 0..logp.len() {
        let rp = rewards[i] - c;
        let (a, b) = ref_limits(rp, limits, true);
        let x = (logp[i] - logp_mu[i]).exp();
        value -= rp * ref_taper(x, a, b) / n;
        grad[i] = -rp * ref_weight(x, a, b) / n;
    }
    (value, grad)
}

pub fn vec1(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double).flatten(0, -1)).unwrap()
}

pub fn scalar(t: &Tensor) -> f64 {
    t.to_kind(Kind::Double).double_value(&[])
}

pub fn t1(v: &[f64]) -> Tensor {
    Tensor::from_slice(v)
}

pub fn t2(v: &[Vec<f64>]) -> Tensor {
    let rows: Vec<Tensor> = v.iter().map(|r| Tensor::from_slice(r)).collect();
    Tensor::stack(&rows, 0)
}

pub fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// Asserts `|got - want| <= tol * max(1, |want|)` elementwise.
pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: got {g}, want {w} (tol {tol})\n got {got:?}\nwant {want:?}"
        );
    }
}

/// Central finite-difference gradient of `f` at `x` (f64).
pub fn finite_difference(x: &[f64], h: f64, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    (0..x.len())
        .map(|i| {
            let mut up = x.to_vec();
            let mut down = x.to_vec();
            up[i] += h;
            down[i] -= h;
            (f(&up) - f(&down)) / (2.0 * h)
        })
        .collect()
}

/// Every aggregation mode (the fixed length of the last is arbitrary).
pub const ALL_MODES: [AggregationMode; 6] = [
    AggregationMode::TokenMean,
    AggregationMode::TokenSum,
    AggregationMode::SeqMeanTokenSum,
    AggregationMode::SeqMeanTokenMean,
    AggregationMode::DrGrpo { length: 7.0 },
    AggregationMode::TokenSumNorm { length: 5.0 },
];

/// `α_i` of each mode, from the definitions (sequences with no token get 0).
pub fn ref_alpha(mask: &[Vec<bool>], mode: AggregationMode, global: Option<(f64, f64)>) -> Vec<f64> {
    let lens: Vec<f64> = mask.iter().map(|r| r.iter().filter(|m| **m).count() as f64).collect();
    let n_tok: f64 = lens.iter().sum();
    let n_seq = lens.iter().filter(|l| **l > 0.0).count() as f64;
    let (n_tok, n_seq) = global.unwrap_or((n_tok, n_seq));
    lens.iter()
        .map(|&l| {
            if l == 0.0 {
                return 0.0;
            }
            match mode {
                AggregationMode::TokenMean => 1.0 / n_tok,
                AggregationMode::TokenSum => 1.0,
                AggregationMode::SeqMeanTokenSum => 1.0 / n_seq,
                AggregationMode::SeqMeanTokenMean => 1.0 / (n_seq * l),
                AggregationMode::DrGrpo { length } => 1.0 / (n_seq * length),
                AggregationMode::TokenSumNorm { length } => 1.0 / length,
                _ => unreachable!("a mode without a reference: {mode:?}"),
            }
        })
        .collect()
}

/// A token-level batch: log-probs of π and of a second policy (μ, old, reference), a mask and
/// one weight (reward or advantage) per sequence.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    pub logp: Vec<Vec<f64>>,
    pub other: Vec<Vec<f64>>,
    pub mask: Vec<Vec<bool>>,
    pub weights: Vec<f64>,
}

impl TokenBatch {
    /// `(logp, other, weights, mask)` with `padding` written into every masked position.
    pub fn tensors(&self, padding: f64) -> (Tensor, Tensor, Tensor, Tensor) {
        let fill = |v: &[Vec<f64>]| -> Vec<Vec<f64>> {
            v.iter()
                .zip(&self.mask)
                .map(|(row, m)| row.iter().zip(m).map(|(x, m)| if *m { *x } else { padding }).collect())
                .collect()
        };
        let mask: Vec<Tensor> = self.mask.iter().map(|r| Tensor::from_slice(r)).collect();
        (t2(&fill(&self.logp)), t2(&fill(&self.other)), t1(&self.weights), Tensor::stack(&mask, 0))
    }
}

/// Log-probabilities that a loss sees only through their differences (`log π − log μ`, a policy
/// and its reference, chosen and rejected), shifted by one common amount so that none lies above 0,
/// as a log-probability must (full checks refuse more than `LOG_PROB_TOLERANCE` above it): the
/// largest becomes `min(largest, 0)`, every difference is kept.
pub fn non_positive<const N: usize>(xs: [f64; N]) -> [f64; N] {
    let s = xs.iter().fold(0.0f64, |s, x| s.max(*x));
    xs.map(|x| x - s)
}

/// [`non_positive`] on each pair of entries of two tables of the same shape, in place.
pub fn non_positive_rows(a: &mut [Vec<f64>], b: &mut [Vec<f64>]) {
    for (ra, rb) in a.iter_mut().zip(b.iter_mut()) {
        for (x, y) in ra.iter_mut().zip(rb.iter_mut()) {
            [*x, *y] = non_positive([*x, *y]);
        }
    }
}

/// Random batches of 1–5 sequences of 1–6 tokens, log-ratios in `±max_delta`, at least one real
/// token, weights drawn from `weights`. Both log-probs are at most 0 ([`non_positive`]).
pub fn token_batch(max_delta: f64, weights: BoxedStrategy<f64>) -> impl Strategy<Value = TokenBatch> {
    (1usize..6, 1usize..7).prop_flat_map(move |(b, t)| {
        (
            prop::collection::vec(prop::collection::vec(-4.0f64..-0.01, t), b),
            prop::collection::vec(prop::collection::vec(-max_delta..max_delta, t), b),
            prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.8), t), b),
            prop::collection::vec(weights.clone(), b),
        )
            .prop_map(|(mut logp, delta, mut mask, weights)| {
                mask[0][0] = true;
                let mut other: Vec<Vec<f64>> =
                    logp.iter().zip(&delta).map(|(l, d)| l.iter().zip(d).map(|(l, d)| l - d).collect()).collect();
                non_positive_rows(&mut logp, &mut other);
                TokenBatch { logp, other, mask, weights }
            })
    })
}

/// The peers' own values for `calls` (`[{"fn": name, "args": {...}}, ...]`), computed by
/// `tests/reference/peers.py` with `TOPR_REFERENCE_PYTHON`, one result per call; `None` (and a
/// note on stderr) when `TOPR_SKIP_REFERENCE=1` says the reference packages are not installed.
///
/// # Panics
/// When the reference Python is not set up (run the tests after `source scripts/env.sh`) or a
/// reference fails: a peer test must not pass silently for want of its peer.
pub fn peer(calls: &[serde_json::Value]) -> Option<Vec<serde_json::Value>> {
    use std::io::Write;
    if std::env::var("TOPR_SKIP_REFERENCE").as_deref() == Ok("1") {
        eprintln!("TOPR_SKIP_REFERENCE=1: peer values not compared");
        return None;
    }
    let python = std::env::var("TOPR_REFERENCE_PYTHON").expect(
        "TOPR_REFERENCE_PYTHON is not set: run the tests after `source scripts/env.sh`, which installs the peers \
         (or set TOPR_SKIP_REFERENCE=1 to skip the peer comparisons)",
    );
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/peers.py");
    let mut child = std::process::Command::new(python)
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("cannot start the reference Python");
    let request = serde_json::json!({ "calls": calls }).to_string();
    child.stdin.take().unwrap().write_all(request.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "peers.py failed:\n{}", String::from_utf8_lossy(&output.stderr));
    let v: serde_json::Value = serde_json::from_slice(&output.stdout).expect("peers.py printed no JSON");
    Some(v["results"].as_array().expect("no results").clone())
}

/// A JSON array of numbers as `Vec<f64>`, flattening nested arrays row by row.
pub fn json_f64(v: &serde_json::Value) -> Vec<f64> {
    match v {
        serde_json::Value::Array(items) => items.iter().flat_map(json_f64).collect(),
        serde_json::Value::Number(n) => vec![n.as_f64().unwrap()],
        other => panic!("not a number or array: {other}"),
    }
}

/// Nested `Vec<Vec<f64>>` as JSON.
pub fn json2(v: &[Vec<f64>]) -> serde_json::Value {
    serde_json::json!(v)
}

/// A token-level loss call under test: `(logp, logp_mu, advantages, mask, aggregation, counts)`,
/// `None` for the plain call (the batch's own counts).
pub type TokenLossCall<'a> = dyn Fn(
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        AggregationMode,
        Option<&topr_loss::Normalizer>,
    ) -> Result<Tensor, topr_loss::LossError>
    + 'a;

/// For every aggregation: the `_output` call with the whole batch's counts equals the plain call,
/// and the batch split at row `split` into two micro-batches, each called with the whole batch's
/// counts, sums to the same value and gradient (an empty part is skipped). `b` has NaN padding;
/// `what` names the call in a failure's message.
pub fn assert_split_invariant(b: &TokenBatch, split: usize, what: &str, call: &TokenLossCall) {
    use topr_loss::{LossError, Normalizer};
    if b.mask.len() < 2 {
        return;
    }
    let s = split.clamp(1, b.mask.len() - 1) as i64;
    let n = b.mask.len() as i64;
    let (lp, old, adv, m) = b.tensors(f64::NAN);
    let norm = Normalizer::from_masks(&[&m]).unwrap();
    for mode in ALL_MODES {
        let full_lp = leaf(&lp);
        let full = call(&full_lp, &old, &adv, &m, mode, Some(&norm)).unwrap();
        let local = call(&full_lp, &old, &adv, &m, mode, None).unwrap();
        assert_close(&[scalar(&full)], &[scalar(&local)], 1e-12, &format!("{what} {mode:?} output vs plain"));
        full.backward();
        let parts_lp = leaf(&lp);
        let part = |o: i64, k: i64| {
            call(
                &parts_lp.narrow(0, o, k),
                &old.narrow(0, o, k),
                &adv.narrow(0, o, k),
                &m.narrow(0, o, k),
                mode,
                Some(&norm),
            )
        };
        let total = match (part(0, s), part(s, n - s)) {
            (Ok(a), Ok(b)) => a + b,
            (Ok(a), Err(LossError::EmptyBatch { .. })) | (Err(LossError::EmptyBatch { .. }), Ok(a)) => a,
            other => panic!("{other:?}"),
        };
        total.backward();
        assert_close(&[scalar(&total)], &[scalar(&full)], 1e-12, &format!("{what} {mode:?} split value"));
        assert_close(&vec1(&parts_lp.grad()), &vec1(&full_lp.grad()), 1e-12, &format!("{what} {mode:?} split grad"));
    }
}

/// The value and `d/dlogp` of a token-level loss on `b` (padding filled with `padding`).
pub fn value_and_grad(
    b: &TokenBatch,
    padding: f64,
    loss: &dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Tensor,
) -> (f64, Vec<f64>) {
    let (lp, old, adv, m) = b.tensors(padding);
    let lp = leaf(&lp);
    let l = loss(&lp, &old, &adv, &m);
    l.backward();
    (scalar(&l), vec1(&lp.grad()))
}

/// `got` (value, gradient) equals the scalar reference `want` to 1e-10, and every padded
/// entry of the gradient is exactly zero.
pub fn assert_matches_reference(b: &TokenBatch, got: &(f64, Vec<f64>), want: &(f64, Vec<f64>), what: &str) {
    assert_close(&[got.0], &[want.0], 1e-10, &format!("{what} value"));
    assert_close(&got.1, &want.1, 1e-10, &format!("{what} grad"));
    for (k, m) in b.mask.concat().iter().enumerate() {
        assert!(*m || got.1[k] == 0.0, "{what}: padding gradient {} (exactly zero, either sign)", got.1[k]);
    }
}

/// A fixed `3 × 3` batch with padding, both advantage signs and log-ratios of up to about ±1.7:
/// the finite-difference tests' point.
pub fn fixed_token_batch() -> TokenBatch {
    TokenBatch {
        logp: vec![vec![-0.7, -1.2, -0.3], vec![-2.0, -0.4, -0.9], vec![-0.5, -0.6, -0.1]],
        other: vec![vec![-0.9, -0.05, -0.6], vec![-1.7, -0.45, -2.3], vec![-0.2, -0.9, -0.3]],
        mask: vec![vec![true, true, true], vec![true, true, false], vec![true, false, false]],
        weights: vec![1.0, -1.0, -0.5],
    }
}

/// The gradient `grad` of `loss` at `b`'s log-probs equals central finite differences of its
/// value (step 1e-6, tolerance 1e-6), `b` without padding values (0).
pub fn assert_gradient_matches_finite_differences(
    b: &TokenBatch,
    grad: &[f64],
    loss: &dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Tensor,
    what: &str,
) {
    let t = b.mask[0].len();
    let fd = finite_difference(&b.logp.concat(), 1e-6, |x| {
        let bb = TokenBatch { logp: x.chunks(t).map(<[f64]>::to_vec).collect(), ..b.clone() };
        let (lp, old, adv, m) = bb.tensors(0.0);
        scalar(&loss(&lp, &old, &adv, &m))
    });
    assert_close(grad, &fd, 1e-6, &format!("{what} finite differences"));
}

/// A deterministic stream of uniform draws in `[0, 1)` from `seed` (a 64-bit LCG, its top 53
/// bits): the tests' peer comparisons draw their inputs from it.
pub fn uniform_stream(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A `rows × t` batch drawn from `next`: log-probs in `(−3.05, −0.05)`, log-ratios in ±`spread`,
/// both at most 0 ([`non_positive_rows`]), 80 % of tokens real and the first always, weights in
/// `(−2, 2)`.
pub fn random_token_batch(next: &mut impl FnMut() -> f64, rows: usize, t: usize, spread: f64) -> TokenBatch {
    let mut logp: Vec<Vec<f64>> = (0..rows).map(|_| (0..t).map(|_| -0.05 - 3.0 * next()).collect()).collect();
    let mut other: Vec<Vec<f64>> =
        logp.iter().map(|r| r.iter().map(|x| x - spread * (2.0 * next() - 1.0)).collect()).collect();
    non_positive_rows(&mut logp, &mut other);
    let mut mask: Vec<Vec<bool>> = (0..rows).map(|_| (0..t).map(|_| next() < 0.8).collect()).collect();
    mask[0][0] = true;
    let weights = (0..rows).map(|_| 4.0 * next() - 2.0).collect();
    TokenBatch { logp, other, mask, weights }
}
