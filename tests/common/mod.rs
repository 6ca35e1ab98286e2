//! Helpers shared by the integration tests: independent scalar references of the formulas in
//! `../shared/reference/objectives.md`, tensor <-> Vec conversion and finite differences.
//! Nothing here calls the library's own math.
#![allow(dead_code)]

use tch::{Kind, Tensor};

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
