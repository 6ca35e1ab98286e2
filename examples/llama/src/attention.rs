//! The attention of a decoding step on the CPU, slot by slot ([`decode_attention`]).
//!
//! In a decoding step every slot brings one new query per head and attends to the keys its own
//! completion has cached. Written as libtorch products, that is a batch of tiny matrix products
//! (`[g, hd] × [hd, n]` for the `g` query heads sharing a key head), which cost a quarter of a
//! SmolLM2-135M decoding step on 2 CPU cores, and which must span the longest slot's keys, the
//! others masked. [`decode_attention`] (`csrc/decode_attention.cpp`) computes each slot and key
//! head on its own, over exactly the positions that slot may see, in a fixed order: the work is
//! that of the keys in use, and a slot's result depends on its own query, keys and values only —
//! the same bits whatever runs beside it, however large the batch or the cache.
//!
//! For slot `s`, query head `i` (key head `i / g`) and its positions `first[s] ≤ j ≤ last[s]`:
//!
//! ```text
//! y[s, i] = Σ_j softmax_j(q[s, i] · k[s, i/g, j] / √hd) · v[s, i/g, j]
//! ```
//!
//! the same formula as [`Tensor::scaled_dot_product_attention`] with every other key masked,
//! equal to it up to f32 rounding (tested here against an f64 reference).

use anyhow::{Result, bail};
use std::ffi::{c_char, c_void};
use tch::{Device, Kind, Tensor};

unsafe extern "C" {
    fn topr_decode_attention(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        first: *const c_void,
        last: *const c_void,
        width: i32,
        err: *mut c_char,
        cap: usize,
    ) -> *mut c_void;
    #[cfg(test)]
    fn topr_decode_attention_runs_width(width: i32) -> bool;
}

/// Whether [`decode_attention`] takes queries on `device` in `kind`: on the CPU, in f32.
pub fn supports(device: Device, kind: Kind) -> bool {
    device == Device::Cpu && kind == Kind::Float
}

/// Attention of one query per slot: `q [S, nh, 1, hd]` (rotary embedding applied) over the
/// caches `k`, `v [S, nkv, P, hd]` (the head dimension contiguous; `nh` a multiple of `nkv`),
/// slot `s` seeing its positions `first[s]..=last[s]` (`first`, `last`: `[S]`, int64):
/// `[S, nh, 1, hd]`. See the [module](self) for the formula. f32 on the CPU only
/// ([`supports`]); an error names what is wrong with the shapes or the ranges.
///
/// ```
/// use tch::{Kind, Tensor};
/// let (s, nh, nkv, p, hd) = (2, 4, 2, 8, 16);
/// let q = Tensor::randn([s, nh, 1, hd], (Kind::Float, tch::Device::Cpu));
/// let k = Tensor::randn([s, nkv, p, hd], (Kind::Float, tch::Device::Cpu));
/// let v = Tensor::randn([s, nkv, p, hd], (Kind::Float, tch::Device::Cpu));
/// // slot 0 sees positions 0..=3, slot 1 positions 2..=7
/// let first = Tensor::from_slice(&[0i64, 2]);
/// let last = Tensor::from_slice(&[3i64, 7]);
/// let y = topr_llama::attention::decode_attention(&q, &k, &v, &first, &last)?;
/// assert_eq!(y.size(), [s, nh, 1, hd]);
/// // a range past the cache is refused
/// let past = Tensor::from_slice(&[0i64, 8]);
/// assert!(topr_llama::attention::decode_attention(&q, &k, &v, &first, &past).is_err());
/// # Ok::<(), anyhow::Error>(())
/// ```
pub fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, first: &Tensor, last: &Tensor) -> Result<Tensor> {
    attend_on(q, k, v, first, last, 0)
}

/// [`decode_attention`] on native vectors of `width` floats (4, 8 or 16, refused where the CPU
/// lacks them), 0 for the widest the CPU has, −1 for the scalar loops.
fn attend_on(q: &Tensor, k: &Tensor, v: &Tensor, first: &Tensor, last: &Tensor, width: i32) -> Result<Tensor> {
    let mut err = [0u8; 1024];
    // SAFETY: live tensors; the shim checks shapes, kinds and ranges before reading, and catches
    // every C++ exception.
    let raw = unsafe {
        topr_decode_attention(
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            first.as_ptr().cast(),
            last.as_ptr().cast(),
            width,
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    if raw.is_null() {
        bail!("the decoding attention failed: {}", crate::onednn::shim_message(&err));
    }
    // SAFETY: the shim returns a `new at::Tensor`, which tch takes over and frees on drop.
    Ok(unsafe { Tensor::from_ptr(raw.cast()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formula in f64, one slot and head at a time, from plain vectors.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, first: &[i64], last: &[i64]) -> Vec<f64> {
        let (s, nh, hd) = (q.size()[0], q.size()[1], q.size()[3]);
        let (nkv, p) = (k.size()[1], k.size()[2]);
        let flat = |t: &Tensor| Vec::<f64>::try_from(t.to_kind(Kind::Double).contiguous().view(-1)).unwrap();
        let (q, k, v) = (flat(q), flat(k), flat(v));
        let mut y = vec![0.0; (s * nh * hd) as usize];
        for slot in 0..s {
            for i in 0..nh {
                let h = i / (nh / nkv);
                let at = |t: &[f64], j: i64, d: i64| t[(((slot * nkv + h) * p + j) * hd + d) as usize];
                let qi = |d: i64| q[((slot * nh + i) * hd + d) as usize];
                let keys: Vec<i64> = (first[slot as usize]..=last[slot as usize]).collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| (0..hd).map(|d| qi(d) * at(&k, j, d)).sum::<f64>() / (hd as f64).sqrt())
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let total: f64 = e.iter().sum();
                for d in 0..hd {
                    y[((slot * nh + i) * hd + d) as usize] =
                        keys.iter().zip(&e).map(|(&j, w)| w / total * at(&v, j, d)).sum();
                }
            }
        }
        y
    }

    /// Queries `spread` times a standard normal, keys and values standard normals.
    fn spread_inputs(s: i64, nh: i64, nkv: i64, p: i64, hd: i64, seed: i64, spread: f64) -> (Tensor, Tensor, Tensor) {
        tch::manual_seed(seed);
        let o = (Kind::Float, Device::Cpu);
        (
            Tensor::randn([s, nh, 1, hd], o) * spread,
            Tensor::randn([s, nkv, p, hd], o),
            Tensor::randn([s, nkv, p, hd], o),
        )
    }

    fn inputs(s: i64, nh: i64, nkv: i64, p: i64, hd: i64, seed: i64) -> (Tensor, Tensor, Tensor) {
        spread_inputs(s, nh, nkv, p, hd, seed, 2.0)
    }

    /// The versions this CPU runs: the scalar loops (−1) and each vector width it has.
    fn widths() -> Vec<i32> {
        // SAFETY: a query of the CPU's features, no arguments to get wrong.
        [-1, 4, 8, 16].into_iter().filter(|&w| w == -1 || unsafe { topr_decode_attention_runs_width(w) }).collect()
    }

    /// Head sizes 64 and 128 (the vector code), others (plain loops); scores of spread about 2
    /// and about 60 (most of a row's exponentials then underflow to 0, as in f64 they round to);
    /// every version this CPU runs, and the one picked by default.
    #[test]
    fn matches_the_formula_in_f64_for_every_head_size_spread_of_scores_and_version() {
        for ((nh, nkv, hd), spread) in [(9, 3, 64), (8, 2, 128), (4, 2, 20), (2, 2, 16), (6, 1, 33)]
            .into_iter()
            .flat_map(|c| [(c, 2.0), (c, 60.0)])
        {
            let (s, p) = (5, 37);
            let (q, k, v) = spread_inputs(s, nh, nkv, p, hd, hd, spread);
            let first = [0i64, 3, 36, 10, 0];
            let last = [36i64, 3, 36, 30, 0];
            let want = reference(&q, &k, &v, &first, &last);
            for width in [0].into_iter().chain(widths()) {
                let (f, l) = (Tensor::from_slice(&first), Tensor::from_slice(&last));
                let y = attend_on(&q, &k, &v, &f, &l, width).unwrap();
                let got = Vec::<f64>::try_from(y.to_kind(Kind::Double).view(-1)).unwrap();
                let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                // f32 scores carry an error that grows with their size; so does the output's
                // for a peaked softmax (the scalar loops, one running sum, reach 1.4e-5 at 60).
                let tolerance = 1e-5 * (1.0 + spread / 30.0);
                assert!(
                    worst < tolerance,
                    "nh {nh} nkv {nkv} hd {hd} spread {spread} width {width}: largest difference {worst}"
                );
            }
        }
    }

    /// The 16 lanes' sums run in one order whatever vectors hold them: the AVX2 and AVX-512
    /// versions (both fusing products and sums) give the same bits, where the CPU runs both; the
    /// default is the widest.
    #[test]
    fn the_vector_widths_with_fused_products_give_the_same_bits() {
        let (q, k, v) = inputs(3, 8, 2, 80, 128, 11);
        let (first, last) = (Tensor::from_slice(&[0i64, 17, 79]), Tensor::from_slice(&[79i64, 60, 79]));
        let on = |w| attend_on(&q, &k, &v, &first, &last, w).unwrap();
        let fused: Vec<i32> = widths().into_iter().filter(|&w| w >= 8).collect();
        for pair in fused.windows(2) {
            assert!(on(pair[0]).equal(&on(pair[1])), "widths {pair:?}");
        }
        assert!(on(0).equal(&on(*widths().last().unwrap())));
        let lacking = [8, 16].into_iter().find(|w| !widths().contains(w));
        if let Some(w) = lacking {
            let msg = format!("{:#}", attend_on(&q, &k, &v, &first, &last, w).unwrap_err());
            assert!(msg.contains(&format!("vectors of {w} floats")), "{msg}");
        }
    }

    #[test]
    fn a_slot_gets_the_same_bits_alone_beside_others_and_in_a_larger_cache() {
        let (s, nh, nkv, p, hd) = (6, 9, 3, 70, 64);
        let (q, k, v) = inputs(s, nh, nkv, p, hd, 7);
        let first = Tensor::from_slice(&[0i64, 5, 0, 64, 1, 2]);
        let last = Tensor::from_slice(&[69i64, 40, 0, 66, 63, 2]);
        let all = decode_attention(&q, &k, &v, &first, &last).unwrap();
        for slot in 0..s {
            let one = |t: &Tensor| t.narrow(0, slot, 1);
            // alone, and alone with its cache cut to the positions it sees
            let end = last.int64_value(&[slot]) + 1;
            let alone = decode_attention(&one(&q), &one(&k), &one(&v), &one(&first), &one(&last)).unwrap();
            let cut = decode_attention(
                &one(&q),
                &one(&k).narrow(2, 0, end),
                &one(&v).narrow(2, 0, end),
                &one(&first),
                &one(&last),
            )
            .unwrap();
            assert!(alone.equal(&all.narrow(0, slot, 1)), "slot {slot} alone");
            assert!(cut.equal(&alone), "slot {slot} in a cut cache");
        }
    }

    #[test]
    fn equals_libtorch_attention_with_the_other_keys_masked() {
        let (s, nh, nkv, p, hd) = (4, 8, 2, 50, 64);
        let (q, k, v) = inputs(s, nh, nkv, p, hd, 3);
        let (first, last) = (Tensor::from_slice(&[0i64, 7, 49, 20]), Tensor::from_slice(&[49i64, 30, 49, 21]));
        let j = Tensor::arange(p, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let mask = j.ge_tensor(&first.unsqueeze(1)).logical_and(&j.le_tensor(&last.unsqueeze(1))).view([s, 1, 1, p]);
        let want = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), 0.0, false, None, true);
        let got = decode_attention(&q, &k, &v, &first, &last).unwrap();
        let worst = (got - want).abs().max().double_value(&[]);
        assert!(worst < 1e-5, "largest difference {worst}");
    }

    /// A NaN key reaches its own slot's output as NaN (which generation then refuses), not as a
    /// finite number, and leaves the other slots alone.
    #[test]
    fn a_nan_key_makes_its_slots_output_nan_and_no_other() {
        for (hd, width) in [64, 20].into_iter().flat_map(|hd| widths().into_iter().map(move |w| (hd, w))) {
            let (q, k, v) = inputs(2, 4, 2, 8, hd, 5);
            let _ = k.get(1).get(0).get(3).get(0).fill_(f64::NAN);
            let (first, last) = (Tensor::from_slice(&[0i64, 0]), Tensor::from_slice(&[0i64, 7]));
            let y = attend_on(&q, &k, &v, &first, &last, width).unwrap();
            // Slot 1, query heads 0 and 1 (key head 0): NaN everywhere; key head 1 finite.
            assert!(bool::try_from(y.get(1).narrow(0, 0, 2).isnan().all()).unwrap(), "head size {hd} width {width}");
            assert!(bool::try_from(y.get(1).narrow(0, 2, 2).isfinite().all()).unwrap(), "head size {hd} width {width}");
            assert!(bool::try_from(y.get(0).isfinite().all()).unwrap(), "head size {hd} width {width}");
        }
    }

    #[test]
    fn refuses_bad_ranges_kinds_and_shapes_naming_them() {
        let (q, k, v) = inputs(2, 4, 2, 8, 16, 1);
        let ok = Tensor::from_slice(&[0i64, 0]);
        let msg = |r: Result<Tensor>| format!("{:#}", r.unwrap_err());
        let bad_range =
            msg(decode_attention(&q, &k, &v, &Tensor::from_slice(&[0i64, 5]), &Tensor::from_slice(&[3i64, 4])));
        assert!(bad_range.contains("slot 1 attends to positions 5..=4"), "{bad_range}");
        let past = msg(decode_attention(&q, &k, &v, &ok, &Tensor::from_slice(&[0i64, 8])));
        assert!(past.contains("of a cache of 8"), "{past}");
        let kind = msg(decode_attention(&q.to_kind(Kind::Double), &k, &v, &ok, &ok));
        assert!(kind.contains("f32"), "{kind}");
        let heads = msg(decode_attention(&q.narrow(1, 0, 3), &k, &v, &ok, &ok));
        assert!(heads.contains("multiple of key heads"), "{heads}");
        let slots = msg(decode_attention(&q, &k, &v, &Tensor::from_slice(&[0i64]), &ok));
        assert!(slots.contains("one entry per slot"), "{slots}");
        assert!(supports(q.device(), q.kind()) && !supports(q.device(), Kind::BFloat16));
    }
}
