//! The next token of every slot of a decoding step on the CPU, in one pass over its logits
//! ([`next_tokens`]).
//!
//! A decoding step turns each slot's logits `x [V]` into a token and two log-probabilities: under
//! the model, `log π(t) = x_t − log Σ_j e^{x_j}`, and under the sampling distribution (the logits
//! `z` after temperature, top-k and top-p), `log q(t)`. Greedy decoding takes the first maximum of
//! `x`; sampling draws by inversion with a uniform number `u ∈ [0, 1)`: the first token whose
//! cumulative weight passes `u` times the total,
//!
//! ```text
//! t = min { t : Σ_{j ≤ t} e^{z_j − max z} > u · Σ_j e^{z_j − max z} },
//! ```
//!
//! as [`crate::generate::draw`] does on any device. Written as libtorch operations this is a pass
//! over the `[S, V]` logits per operation (a finite check, a log-softmax, an exponential, a
//! cumulative sum in f64, a search, two gathers), most of them a new `[S, V]` tensor; here
//! (`csrc/next_tokens.cpp`) a row is read two or three times and nothing of its size is written:
//! its maximum and finiteness, the sum of its exponentials kept per block of 64 entries, then a
//! walk over the blocks' sums to the block where the draw falls and along that block's entries.
//! Every sum runs in a fixed order (a block's 64 exponentials as 16 lanes, the blocks in f64 in
//! order), so a row's result depends on that row alone. A token of weight 0 (below e^−87 of the
//! row's largest, or masked with −∞) is never drawn.

use anyhow::{Result, bail};
use std::ffi::{c_char, c_void};
use tch::{Device, Tensor};

unsafe extern "C" {
    fn topr_next_tokens(
        logits: *const c_void,
        z: *const c_void,
        u: *const c_void,
        width: i32,
        out: *mut *mut c_void,
        err: *mut c_char,
        cap: usize,
    ) -> bool;
}

/// Whether [`next_tokens`] takes logits on `device`: the CPU (logits are f32 there).
pub fn supports(device: Device) -> bool {
    device == Device::Cpu
}

/// What [`next_tokens`] returns for each of the `S` slots.
#[derive(Debug)]
pub struct Next {
    /// `[S]` int64: the token.
    pub token: Tensor,
    /// `[S]` f32: `log q(token)` under the sampling distribution (0 when greedy).
    pub logq: Tensor,
    /// `[S]` f32: `log π(token)` under the model at temperature 1.
    pub logp: Tensor,
    /// `[S]` bool: whether every logit of the slot is finite (where not, the other fields of
    /// that slot are unspecified, the token within the vocabulary).
    pub finite: Tensor,
}

/// The next token of each slot from its logits `logits [S, V]` (f32, CPU): the first maximum when
/// `u` is `None`, else a draw by inversion with `u [S]` (f64 in `[0, 1)`) from the distribution of
/// `sampling [S, V]` (the logits after temperature, top-k and top-p,
/// [`crate::generate::sampling_logits`]), or of the logits themselves when `sampling` is `None`.
/// See the [module](self) for the formulas. An error names a wrong shape, kind or `u`.
///
/// ```
/// use tch::{Kind, Tensor};
/// use topr_llama::next_tokens::next_tokens;
/// let logits = Tensor::from_slice(&[0.0f32, 2.0, 1.0, 5.0, -1.0, 5.0]).view([2, 3]);
/// let greedy = next_tokens(&logits, None, None)?;
/// assert_eq!(Vec::<i64>::try_from(&greedy.token)?, [1, 0]); // the first maximum of each row
/// // u = 0 draws the first token of positive weight, u close to 1 the last
/// let u = Tensor::from_slice(&[0.0f64, 0.999_999]);
/// let drawn = next_tokens(&logits, None, Some(&u))?;
/// assert_eq!(Vec::<i64>::try_from(&drawn.token)?, [0, 2]);
/// let want = logits.log_softmax(-1, Kind::Float).gather(1, &drawn.token.unsqueeze(1), false).squeeze_dim(1);
/// assert!(drawn.logp.allclose(&want, 1e-6, 1e-6, false));
/// # Ok::<(), anyhow::Error>(())
/// ```
pub fn next_tokens(logits: &Tensor, sampling: Option<&Tensor>, u: Option<&Tensor>) -> Result<Next> {
    next_on(logits, sampling, u, 0)
}

/// [`next_tokens`] on native vectors of `width` floats (4, 8 or 16, refused where the CPU lacks
/// them), 0 for the widest the CPU has.
fn next_on(logits: &Tensor, sampling: Option<&Tensor>, u: Option<&Tensor>, width: i32) -> Result<Next> {
    let mut err = [0u8; 1024];
    let mut out = [std::ptr::null_mut::<c_void>(); 4];
    let ptr = |t: Option<&Tensor>| t.map_or(std::ptr::null(), |t| t.as_ptr().cast::<c_void>());
    // SAFETY: live tensors (or NULL where the shim takes none); the shim checks shapes, kinds and
    // `u` before reading, writes four tensors to `out` on success, and catches every C++ exception.
    let ok = unsafe {
        topr_next_tokens(
            logits.as_ptr().cast(),
            ptr(sampling),
            ptr(u),
            width,
            out.as_mut_ptr(),
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    if !ok {
        bail!("choosing the next tokens failed: {}", crate::onednn::shim_message(&err));
    }
    // SAFETY: on success each entry is a `new at::Tensor`, which tch takes over and frees on drop.
    let [token, logq, logp, finite] = out.map(|p| unsafe { Tensor::from_ptr(p.cast()) });
    Ok(Next { token, logq, logp, finite })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{SamplingParams, draw, sampling_logits};
    use tch::Kind;

    /// The widths this CPU runs.
    fn widths() -> Vec<i32> {
        [4, 8, 16]
            .into_iter()
            .filter(|&w| next_on(&Tensor::zeros([1, 3], (Kind::Float, Device::Cpu)), None, None, w).is_ok())
            .collect()
    }

    /// Logits of `s` rows and `v` entries, spread `spread` times a standard normal.
    fn logits(s: i64, v: i64, spread: f64, seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn([s, v], (Kind::Float, Device::Cpu)) * spread
    }

    /// The token chosen by the formula in f64 from plain vectors: the first index whose
    /// cumulative weight passes `u` times the total.
    fn inverse_in_f64(z: &[f32], u: f64) -> usize {
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = z.iter().map(|&x| (x as f64 - m).exp()).collect();
        let target = u * w.iter().sum::<f64>();
        let mut cum = 0.0;
        w.iter()
            .position(|x| {
                cum += x;
                cum > target
            })
            .unwrap_or(w.len() - 1)
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_the_log_probabilities_are_the_log_softmax() {
        for width in widths() {
            for v in [1, 5, 64, 100, 49_152] {
                let x = logits(6, v, 3.0, v);
                // a tie at the maximum: the first wins, as argmax
                let _ = x.get(0).narrow(0, v - 1, 1).fill_(1e3);
                let _ = x.get(0).narrow(0, v / 2, 1).fill_(1e3);
                let n = next_on(&x, None, None, width).unwrap();
                assert!(n.token.equal(&x.argmax(-1, false)), "v {v} width {width}");
                let want = x.log_softmax(-1, Kind::Float).gather(1, &n.token.unsqueeze(1), false).squeeze_dim(1);
                assert!(n.logp.allclose(&want, 1e-5, 1e-5, false), "v {v} width {width}");
                assert!(bool::try_from(n.logq.eq(0.0).all()).unwrap());
                assert!(bool::try_from(n.finite.all()).unwrap());
            }
        }
    }

    /// Against the formula in f64 at many uniform numbers: the same token except where `u` falls
    /// within rounding of a boundary between two tokens (checked: then the cumulative weight at
    /// the boundary is within 1e-5 of the target).
    #[test]
    fn draws_invert_the_cumulative_weights_as_the_formula_in_f64() {
        for width in widths() {
            for (v, spread) in [(3, 1.0), (64, 2.0), (1000, 4.0), (49_152, 3.0), (777, 40.0)] {
                let s = 32;
                let x = logits(s, v, spread, v + 1);
                let u: Vec<f64> = (0..s).map(|i| (i as f64 + 0.5) / s as f64).collect();
                let n = next_on(&x, None, Some(&Tensor::from_slice(&u)), width).unwrap();
                let got = Vec::<i64>::try_from(&n.token).unwrap();
                for r in 0..s as usize {
                    let row = Vec::<f32>::try_from(x.get(r as i64)).unwrap();
                    let want = inverse_in_f64(&row, u[r]);
                    if got[r] as usize != want {
                        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                        let w: Vec<f64> = row.iter().map(|&x| (x as f64 - m).exp()).collect();
                        let total: f64 = w.iter().sum();
                        let lo = got[r].min(want as i64) as usize;
                        let at: f64 = w[..=lo].iter().sum::<f64>() / total;
                        assert!((at - u[r]).abs() < 1e-5, "v {v} row {r} width {width}: {} vs {want}", got[r]);
                    }
                }
                let want = x.log_softmax(-1, Kind::Float).gather(1, &n.token.unsqueeze(1), false).squeeze_dim(1);
                assert!(n.logp.allclose(&want, 1e-5, 1e-5, false), "v {v} width {width}");
                assert!(n.logq.allclose(&n.logp, 0.0, 0.0, false));
            }
        }
    }

    /// With temperature and top-k: tokens drawn from the masked distribution only, its own log q,
    /// and log π under the model's logits; and the same tokens as libtorch's inversion
    /// ([`draw`]) for most uniform numbers.
    #[test]
    fn draws_from_the_sampling_logits_with_the_models_log_probabilities() {
        let params = SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.9 };
        let (s, v) = (64, 5000);
        let x = logits(s, v, 2.0, 9);
        let z = sampling_logits(&x, &params);
        let u = Tensor::rand([s], (Kind::Double, Device::Cpu));
        for width in widths() {
            let n = next_on(&x, Some(&z), Some(&u), width).unwrap();
            let kept = z.gather(1, &n.token.unsqueeze(1), false).squeeze_dim(1);
            assert!(bool::try_from(kept.isfinite().all()).unwrap(), "a masked token drawn");
            let logq = z.log_softmax(-1, Kind::Float).gather(1, &n.token.unsqueeze(1), false).squeeze_dim(1);
            assert!(n.logq.allclose(&logq, 1e-5, 1e-5, false));
            let logp = x.log_softmax(-1, Kind::Float).gather(1, &n.token.unsqueeze(1), false).squeeze_dim(1);
            assert!(n.logp.allclose(&logp, 1e-5, 1e-5, false));
            let libtorch = draw(&z.log_softmax(-1, Kind::Float), &u);
            let same = n.token.eq_tensor(&libtorch).sum(Kind::Int64).int64_value(&[]);
            assert!(same >= s - 1, "{same} of {s} tokens as libtorch's inversion");
        }
    }

    /// Tokens of weight 0 are never drawn, whatever `u`: masked ones (−∞) and ones more than 87
    /// below the row's maximum (whose exponential underflows).
    #[test]
    fn a_token_of_no_weight_is_never_drawn() {
        let row = [f32::NEG_INFINITY, 0.0, -200.0, 0.0, f32::NEG_INFINITY];
        let x = Tensor::from_slice(&row).view([1, 5]).repeat([5, 1]);
        let u = Tensor::from_slice(&[0.0f64, 0.25, 0.5, 0.75, 1.0 - 1e-16]);
        for width in widths() {
            let n = next_on(&x, Some(&x), Some(&u), width).unwrap();
            assert_eq!(Vec::<i64>::try_from(&n.token).unwrap(), [1, 1, 3, 3, 3], "width {width}");
        }
    }

    /// The vector widths with fused products agree to the bit; a row's result does not depend
    /// on the rows beside it.
    #[test]
    fn the_widths_agree_and_a_row_stands_alone() {
        let x = logits(8, 49_152, 3.0, 4);
        let u = Tensor::rand([8], (Kind::Double, Device::Cpu));
        let fused: Vec<i32> = widths().into_iter().filter(|&w| w >= 8).collect();
        let on = |w: i32, x: &Tensor, u: &Tensor| next_on(x, None, Some(u), w).unwrap();
        for pair in fused.windows(2) {
            let (a, b) = (on(pair[0], &x, &u), on(pair[1], &x, &u));
            assert!(a.token.equal(&b.token) && a.logp.equal(&b.logp), "widths {pair:?}");
        }
        let all = on(0, &x, &u);
        for r in 0..8 {
            let one = on(0, &x.narrow(0, r, 1), &u.narrow(0, r, 1));
            assert!(one.token.equal(&all.token.narrow(0, r, 1)) && one.logp.equal(&all.logp.narrow(0, r, 1)));
        }
    }

    #[test]
    fn non_finite_rows_are_flagged_with_a_token_in_the_vocabulary() {
        let x = logits(4, 100, 1.0, 2);
        let _ = x.get(1).narrow(0, 7, 1).fill_(f64::NAN);
        let _ = x.get(2).narrow(0, 99, 1).fill_(f64::INFINITY);
        let _ = x.get(3).fill_(f64::NAN);
        let u = Tensor::from_slice(&[0.5f64; 4]);
        for u in [None, Some(&u)] {
            let n = next_tokens(&x, None, u).unwrap();
            assert_eq!(Vec::<bool>::try_from(&n.finite).unwrap(), [true, false, false, false]);
            let t = Vec::<i64>::try_from(&n.token).unwrap();
            assert!(t.iter().all(|&t| (0..100).contains(&t)), "{t:?}");
        }
    }

    #[test]
    fn refuses_bad_shapes_kinds_and_uniform_numbers_naming_them() {
        let x = logits(2, 10, 1.0, 3);
        let msg = |r: Result<Next>| format!("{:#}", r.unwrap_err());
        assert!(msg(next_tokens(&x.to_kind(Kind::Double), None, None)).contains("f32 logits"));
        assert!(msg(next_tokens(&x.view([20]), None, None)).contains("[S, V]"));
        assert!(msg(next_tokens(&x, Some(&x.narrow(1, 0, 5)), None)).contains("shaped as the logits"));
        assert!(msg(next_tokens(&x, None, Some(&Tensor::from_slice(&[0.5f64])))).contains("one entry per slot"));
        let bad = msg(next_tokens(&x, None, Some(&Tensor::from_slice(&[0.5f64, 1.0]))));
        assert!(bad.contains("slot 1's uniform number 1 is outside [0, 1)"), "{bad}");
        assert!(supports(Device::Cpu) && !supports(Device::Cuda(0)));
    }
}
