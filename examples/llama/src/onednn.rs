//! oneDNN's linear layer on weights packed once, for generation on the CPU, and a differentiable
//! one for training ([`train_linear`]).
//!
//! A decoding step multiplies a few rows (one per sequence) by every weight matrix of the model.
//! At those shapes libtorch's default CPU matrix product (MKL's `sgemm`, which `matmul` calls) is
//! far from the machine's peak; oneDNN, given the weight once in its own blocked layout, runs the
//! same products about twice as fast on the project's 2-core machine (docs/performance.md). The
//! operators are libtorch's own — `mkldnn::_reorder_linear_weight` packs, `mkldnn::_linear_pointwise`
//! multiplies, the pair torch.compile's CPU inference path uses — reached through a small C++
//! file (`csrc/onednn_linear.cpp`) because tch does not wrap them.
//!
//! Results are the same products summed in another order: equal to `x · Wᵀ` up to f32 rounding
//! (tested in this module). A packed weight is a copy: it does not follow later changes of the
//! weight it was made from; [`stamp`] tells whether a weight changed since it was packed.

use anyhow::{Result, bail};
use std::ffi::{c_char, c_int, c_void};
use tch::{Device, Kind, Tensor};

unsafe extern "C" {
    fn topr_onednn_available() -> c_int;
    fn topr_onednn_pack(weight: *const c_void, err: *mut c_char, cap: usize) -> *mut c_void;
    fn topr_onednn_linear(x: *const c_void, packed: *const c_void, err: *mut c_char, cap: usize) -> *mut c_void;
    fn topr_onednn_train_linear(x: *const c_void, w: *const c_void, err: *mut c_char, cap: usize) -> *mut c_void;
    fn topr_tensor_version(t: *const c_void, data: *mut usize) -> i64;
}

/// What identifies the current contents of a tensor: its data pointer and its version counter
/// (which every in-place change bumps: an optimiser step, a copy into it). Equal stamps of the
/// same tensor mean that nothing has written to it in between.
pub fn stamp(t: &Tensor) -> (usize, i64) {
    let mut data = 0usize;
    // SAFETY: `t` is a live tensor; the function only reads it.
    let version = unsafe { topr_tensor_version(t.as_ptr().cast(), &mut data) };
    (data, version)
}

const ERR_CAP: usize = 1024;

/// Whether this libtorch has oneDNN's linear operators (builds for x86-64 and ARM do). Asked of
/// libtorch's dispatcher once per process (every training forward and generation asks).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: no arguments; the function catches every C++ exception.
    *AVAILABLE.get_or_init(|| unsafe { topr_onednn_available() == 1 })
}

/// Whether oneDNN's products take weights of `kind` on the CPU the process runs on: f32 wherever it is
/// [`available`]; bf16 only where the CPU has AVX-512 (BW, VL, DQ), AVX-NE-CONVERT or ARM's bf16
/// (oneDNN refuses bf16 weights elsewhere, e.g. on AMD's Zen 3 or Intel's desktop CPUs without
/// AVX-512). Found out once per process by packing a small bf16 weight, the operation that refuses.
///
/// ```
/// use tch::Kind;
/// use topr_llama::onednn;
/// assert_eq!(onednn::takes(Kind::Float), onednn::available());
/// assert!(!onednn::takes(Kind::Half) && !onednn::takes(Kind::Double));
/// ```
pub fn takes(kind: Kind) -> bool {
    static BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match kind {
        Kind::Float => available(),
        Kind::BFloat16 => *BF16.get_or_init(|| {
            available()
                && tch::no_grad(|| PackedLinear::new(&Tensor::zeros([16, 16], (Kind::BFloat16, Device::Cpu))).is_ok())
        }),
        _ => false,
    }
}

/// The message a C++ shim wrote into `err` (NUL-terminated), on one line.
pub(crate) fn shim_message(err: &[u8]) -> String {
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    String::from_utf8_lossy(&err[..end]).split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Turns the shim's result into a tensor, or its message into an error.
fn take(raw: *mut c_void, err: &[u8], what: &str) -> Result<Tensor> {
    if raw.is_null() {
        bail!("oneDNN {what} failed: {}", shim_message(err));
    }
    // SAFETY: the shim returns a `new at::Tensor`, which tch takes over and frees on drop.
    Ok(unsafe { Tensor::from_ptr(raw.cast()) })
}

/// A weight `W [N, K]` in oneDNN's layout; [`PackedLinear::forward`] computes `x · Wᵀ`.
pub struct PackedLinear {
    packed: Tensor,
    in_features: i64,
    out_features: i64,
    kind: Kind,
}

impl PackedLinear {
    /// Packs `weight [N, K]` (f32 or bf16, on the CPU) for inputs of any number of rows (oneDNN's
    /// batch-size hint made no measurable difference at the example's shapes, so none is given).
    pub fn new(weight: &Tensor) -> Result<Self> {
        let size = weight.size();
        if size.len() != 2 || weight.device() != Device::Cpu || !matches!(weight.kind(), Kind::Float | Kind::BFloat16) {
            bail!(
                "oneDNN packs 2-d f32 or bf16 CPU weights, not {:?} {:?} on {:?}",
                size,
                weight.kind(),
                weight.device()
            );
        }
        let w = weight.detach();
        let mut err = [0u8; ERR_CAP];
        // SAFETY: `w` outlives the call; `err` holds ERR_CAP bytes.
        let raw = unsafe { topr_onednn_pack(w.as_ptr().cast(), err.as_mut_ptr().cast(), ERR_CAP) };
        Ok(Self {
            packed: take(raw, &err, "packing a weight")?,
            in_features: size[1],
            out_features: size[0],
            kind: weight.kind(),
        })
    }

    /// `K`, the features of an input row.
    pub fn in_features(&self) -> i64 {
        self.in_features
    }

    /// The weight's dtype (that of the inputs it takes).
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// `x [.., K] · Wᵀ`: `[.., N]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut shape = x.size();
        if shape.last() != Some(&self.in_features) {
            bail!("oneDNN linear: input {:?} does not end in {} features", shape, self.in_features);
        }
        let rows = x.reshape([-1, self.in_features]);
        let mut err = [0u8; ERR_CAP];
        // SAFETY: both tensors outlive the call; `err` holds ERR_CAP bytes.
        let raw = unsafe {
            topr_onednn_linear(rows.as_ptr().cast(), self.packed.as_ptr().cast(), err.as_mut_ptr().cast(), ERR_CAP)
        };
        let y = take(raw, &err, "linear")?;
        *shape.last_mut().expect("checked above") = self.out_features;
        Ok(y.view(shape.as_slice()))
    }
}

/// `x [.., K] · Wᵀ` for `W [N, K]` (f32 or bf16, on the CPU), differentiable in `x` and `W`, for
/// training: the product and the input's gradient `∂x = ∂y · W` by oneDNN (the weight packed on
/// each call: training changes it every step), the weight's gradient `∂W = ∂yᵀ · x` by
/// libtorch's `mm`, which beat oneDNN on that product at every shape measured
/// (docs/performance.md). Equal to `x.matmul(&w.tr())` and its gradients up to f32 rounding
/// (tested below); not twice differentiable.
pub fn train_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (xs, ws) = (x.size(), w.size());
    if ws.len() != 2 || xs.last() != ws.last() {
        bail!("oneDNN linear: input {xs:?} and weight {ws:?} do not match");
    }
    let mut err = [0u8; ERR_CAP];
    // SAFETY: both tensors outlive the call; `err` holds ERR_CAP bytes.
    let raw =
        unsafe { topr_onednn_train_linear(x.as_ptr().cast(), w.as_ptr().cast(), err.as_mut_ptr().cast(), ERR_CAP) };
    take(raw, &err, "linear")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_plain_product() -> Result<()> {
        if !available() {
            eprintln!("skipped: this libtorch has no oneDNN");
            return Ok(());
        }
        tch::manual_seed(0);
        for (n, k) in [(96, 64), (1000, 576)] {
            let w = Tensor::randn([n, k], (Kind::Float, Device::Cpu)) * 0.05;
            for rows in [1, 3, 16, 70] {
                let p = PackedLinear::new(&w)?;
                let x = Tensor::randn([2, rows, k], (Kind::Float, Device::Cpu));
                let y = p.forward(&x)?;
                assert_eq!(y.size(), vec![2, rows, n]);
                let want = x.matmul(&w.tr());
                let err = f64::try_from((&y - &want).abs().max())?;
                assert!(err < 1e-4, "({n}, {k}) rows {rows}: max difference {err}");
            }
        }
        Ok(())
    }

    #[test]
    fn the_training_product_and_its_gradients_match_the_plain_ones() -> Result<()> {
        if !available() {
            eprintln!("skipped: this libtorch has no oneDNN");
            return Ok(());
        }
        tch::manual_seed(1);
        for (n, k, rows) in [(96, 64, 5), (300, 128, 70)] {
            let w = (Tensor::randn([n, k], (Kind::Float, Device::Cpu)) * 0.05).set_requires_grad(true);
            let x = Tensor::randn([2, rows, k], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let up = Tensor::randn([2, rows, n], (Kind::Float, Device::Cpu));
            let y = train_linear(&x, &w)?;
            let want = x.matmul(&w.tr());
            assert_eq!(y.size(), want.size());
            let diff = |a: &Tensor, b: &Tensor| f64::try_from((a - b).abs().max()).unwrap();
            assert!(diff(&y, &want) < 1e-4, "({n}, {k}): product differs by {}", diff(&y, &want));
            let grads = |y: &Tensor| Tensor::run_backward(&[(y * &up).sum(Kind::Float)], &[&x, &w], false, false);
            let (got, exp) = (grads(&y), grads(&want));
            assert!(diff(&got[0], &exp[0]) < 1e-4, "∂x differs by {}", diff(&got[0], &exp[0]));
            assert!(diff(&got[1], &exp[1]) < 1e-3, "∂W differs by {}", diff(&got[1], &exp[1]));
            // Only the weight trainable (a frozen input) and only the input (a frozen weight).
            let grad_of = |y: Tensor, of: &Tensor| Tensor::run_backward(&[y.sum(Kind::Float)], &[of], false, false);
            let (xd, wd) = (x.detach(), w.detach());
            let (got, exp) = (grad_of(train_linear(&xd, &w)?, &w), grad_of(xd.matmul(&w.tr()), &w));
            assert!(diff(&got[0], &exp[0]) < 1e-3);
            let (got, exp) = (grad_of(train_linear(&x, &wd)?, &x), grad_of(x.matmul(&wd.tr()), &x));
            assert!(diff(&got[0], &exp[0]) < 1e-4);
        }
        assert!(
            train_linear(
                &Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)),
                &Tensor::zeros([4, 5], (Kind::Float, Device::Cpu))
            )
            .is_err()
        );
        Ok(())
    }

    #[test]
    fn stamps_change_with_in_place_writes_only() {
        let w = Tensor::zeros([3, 2], (Kind::Float, Device::Cpu));
        let s0 = stamp(&w);
        assert_eq!(stamp(&w), s0);
        let _ = (&w + 1.0).sum(Kind::Float);
        assert_eq!(stamp(&w), s0, "reading does not change the stamp");
        tch::no_grad(|| {
            let mut v = w.shallow_clone();
            let _ = v.g_add_scalar_(1.0);
        });
        assert_ne!(stamp(&w), s0, "an in-place update changes it");
        let w2 = w.copy();
        assert_ne!(stamp(&w2).0, stamp(&w).0, "another tensor has another stamp");
    }

    #[test]
    fn refuses_what_it_cannot_pack() {
        let w = Tensor::zeros([4, 4], (Kind::Int64, Device::Cpu));
        assert!(PackedLinear::new(&w).err().unwrap().to_string().contains("f32 or bf16"));
        if available() {
            let p = PackedLinear::new(&Tensor::zeros([4, 3], (Kind::Float, Device::Cpu))).unwrap();
            let e = p.forward(&Tensor::zeros([2, 4], (Kind::Float, Device::Cpu))).unwrap_err().to_string();
            assert!(e.contains("3 features"), "{e}");
        }
    }
}
