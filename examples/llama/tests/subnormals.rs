//! `topr_llama::subnormal`: flushed before libtorch starts its threads, subnormal floats read as
//! zero in the work those threads do (a product and an element-wise op split across them). Its
//! own test binary, so that no other test has started libtorch's threads before the flush. (With
//! GNU OpenMP, which PyTorch's Linux wheels ship, the product below keeps its subnormals when the
//! pool starts first.)

use tch::{Device, Kind, Tensor};
use topr_llama::subnormal::{flush_subnormals, subnormals_flushed};

#[test]
fn libtorch_threads_started_after_the_flush_read_subnormals_as_zero() {
    if !cfg!(target_arch = "x86_64") {
        // SAFETY: nothing is changed on this architecture.
        assert!(!unsafe { flush_subnormals() });
        return;
    }
    // A subnormal made from its bits: no float operation, which the flush would round to zero.
    let tiny = f32::from_bits(1 << 20);
    assert!(tiny > 0.0 && !tiny.is_normal());
    // Before: four elements (no thread pool), kept by libtorch's multiply.
    let few = Tensor::from_slice(&[tiny; 4]);
    assert!(f64::try_from((&few * 1.0).max()).unwrap() > 0.0, "a subnormal is kept before the flush");
    // SAFETY: before libtorch's threads start; the test's results rely on the flush, not on
    // subnormals being kept.
    assert!(unsafe { flush_subnormals() } && subnormals_flushed());
    assert_eq!(f64::try_from((&few * 1.0).max()).unwrap(), 0.0);
    // After: work large enough to be split across libtorch's threads, started now.
    tch::set_num_threads(2);
    let n = 512;
    let a = Tensor::from_slice(&vec![tiny; n * n]).view([n as i64, n as i64]);
    let ones = Tensor::ones([n as i64, n as i64], (Kind::Float, Device::Cpu));
    // Unflushed, every entry of the product would be 512 · 1.5e-39 ≈ 7.5e-37, a normal float.
    assert_eq!(f64::try_from(a.mm(&ones).abs().max()).unwrap(), 0.0, "product");
    assert_eq!(f64::try_from((&a * 1.0).abs().max()).unwrap(), 0.0, "element-wise");
}
