//! Chunked and fused log-probs against the naive `log_softmax` + `gather`, values and gradients.

mod common;

use common::*;
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};
use topr_loss::{
    Checks, LogProbConfig, LossError, SequenceReduce, backward_through_fused_logprobs, backward_through_logprobs,
    fused_token_logprobs, host_reads, sequence_logprobs, sequence_logprobs_with_checks, token_logprobs,
};

const CPU: Device = Device::Cpu;

/// Naive per-token log-probs and entropies on the whole tensor, in `kind`.
fn naive(logits: &Tensor, labels: &Tensor, temperature: f64, kind: Kind) -> (Tensor, Tensor) {
    let z = logits.to_kind(kind) / temperature;
    let lsm = z.log_softmax(-1, kind);
    let logp = lsm.gather(2, &labels.unsqueeze(2), false).squeeze_dim(2);
    let ent = -(lsm.exp() * &lsm).sum_dim_intlist(2, false, kind);
    (logp, ent)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn chunked_equals_naive_in_f32(b in 1i64..4, t in 1i64..9, v in 2i64..50, chunk in 1i64..20, scale in 0.1f64..30.0, temp in prop_oneof![Just(1.0f64), 0.3f64..2.0], seed in 0i64..1000) {
        tch::manual_seed(seed);
        let logits = Tensor::randn([b, t, v], (Kind::Float, CPU)) * scale;
        let labels = Tensor::randint(v, [b, t], (Kind::Int64, CPU));
        let mask = Tensor::rand([b, t], (Kind::Float, CPU)).lt(0.8);
        let cfg = LogProbConfig::new().with_chunk_tokens(chunk).with_entropy(true).with_temperature(temp);
        let out = token_logprobs(&logits, &labels, Some(&mask), &cfg).unwrap();
        let (lp, ent) = naive(&logits, &labels, temp, Kind::Float);
        let m = mask.to_kind(Kind::Float);
        prop_assert!(max_abs_diff(&out.logp, &(lp * &m)) < 1e-5 * scale.max(1.0));
        prop_assert!(max_abs_diff(out.entropy.as_ref().unwrap(), &(ent * &m)) < 1e-5 * scale.max(1.0));
    }

    #[test]
    fn backward_equals_naive_autograd(b in 1i64..4, t in 1i64..7, v in 2i64..30, chunk in 1i64..10, temp in prop_oneof![Just(1.0f64), 0.5f64..2.0], ent_coef in -0.5f64..0.5, seed in 0i64..1000) {
        tch::manual_seed(seed);
        let logits = Tensor::randn([b, t, v], (Kind::Double, CPU)) * 3.0;
        let labels = Tensor::randint(v, [b, t], (Kind::Int64, CPU));
        let mask = Tensor::rand([b, t], (Kind::Float, CPU)).lt(0.8);
        let w = Tensor::randn([b, t], (Kind::Double, CPU));
        let mf = mask.to_kind(Kind::Double);
        // The naive loss: Σ w logp + c Σ H over the mask.
        let naive_leaf = leaf(&logits);
        let (lp, ent) = naive(&naive_leaf, &labels, temp, Kind::Double);
        ((lp * &w * &mf).sum(Kind::Double) + (ent * &mf).sum(Kind::Double) * ent_coef).backward();
        let ours_leaf = leaf(&logits);
        let cfg = LogProbConfig::new().with_chunk_tokens(chunk).with_entropy(true).with_temperature(temp);
        let _ = backward_through_logprobs(&ours_leaf, &labels, Some(&mask), &cfg, |x| {
            Ok::<_, LossError>((&x.logp * &w).sum(Kind::Double) + x.entropy.as_ref().unwrap().sum(Kind::Double) * ent_coef)
        }).unwrap();
        prop_assert!(max_abs_diff(&ours_leaf.grad(), &naive_leaf.grad()) < 1e-10);
    }

    #[test]
    fn fused_equals_naive_values_and_gradients(b in 1i64..3, t in 1i64..6, h in 1i64..9, v in 2i64..30, chunk in 1i64..8, seed in 0i64..1000) {
        tch::manual_seed(seed);
        let hidden = Tensor::randn([b, t, h], (Kind::Double, CPU));
        let weight = Tensor::randn([v, h], (Kind::Double, CPU));
        let labels = Tensor::randint(v, [b, t], (Kind::Int64, CPU));
        let mask = Tensor::rand([b, t], (Kind::Float, CPU)).lt(0.8);
        let w = Tensor::randn([b, t], (Kind::Double, CPU));
        let mf = mask.to_kind(Kind::Double);
        let (hn, wn) = (leaf(&hidden), leaf(&weight));
        let (lp, ent) = naive(&hn.matmul(&wn.tr()), &labels, 1.0, Kind::Double);
        ((lp * &w * &mf).sum(Kind::Double) - (ent * &mf).sum(Kind::Double) * 0.1).backward();
        let (ho, wo) = (leaf(&hidden), leaf(&weight));
        let cfg = LogProbConfig::new().with_chunk_tokens(chunk).with_entropy(true);
        let fwd = fused_token_logprobs(&hidden, &weight, &labels, Some(&mask), &cfg).unwrap();
        let loss = backward_through_fused_logprobs(&ho, &wo, &labels, Some(&mask), &cfg, |x| {
            Ok::<_, LossError>((&x.logp * &w).sum(Kind::Double) - x.entropy.as_ref().unwrap().sum(Kind::Double) * 0.1)
        }).unwrap();
        let (lp2, _) = naive(&hidden.matmul(&weight.tr()), &labels, 1.0, Kind::Double);
        prop_assert!(max_abs_diff(&fwd.logp, &(lp2 * &mf)) < 1e-10);
        prop_assert!(scalar(&loss).is_finite());
        prop_assert!(max_abs_diff(&ho.grad(), &hn.grad()) < 1e-10);
        prop_assert!(max_abs_diff(&wo.grad(), &wn.grad()) < 1e-10);
    }
}

#[test]
fn bf16_logits_are_upcast_per_chunk() {
    tch::manual_seed(1);
    let logits = (Tensor::randn([3, 5, 40], (Kind::Float, CPU)) * 8.0).to_kind(Kind::BFloat16);
    let labels = Tensor::randint(40, [3, 5], (Kind::Int64, CPU));
    let out = token_logprobs(&logits, &labels, None, &LogProbConfig::new().with_chunk_tokens(4)).unwrap();
    assert_eq!(out.logp.kind(), Kind::Float);
    let (lp, _) = naive(&logits, &labels, 1.0, Kind::Float); // the same bf16 values, in f32
    assert!(max_abs_diff(&out.logp, &lp) < 1e-5);
    // The gradient reaches bf16 logits, equal to the f32 naive one rounded to bf16.
    let l = logits.detach().set_requires_grad(true);
    let _ = backward_through_logprobs(&l, &labels, None, &LogProbConfig::default(), |x| {
        Ok::<_, LossError>(x.logp.sum(Kind::Float))
    })
    .unwrap();
    let lf = logits.to_kind(Kind::Float).set_requires_grad(true);
    naive(&lf, &labels, 1.0, Kind::Float).0.sum(Kind::Float).backward();
    assert_eq!(l.grad().kind(), Kind::BFloat16);
    assert!(max_abs_diff(&l.grad(), &lf.grad()) < 1e-2);
}

#[test]
fn masked_positions_are_not_computed_and_get_zero_gradient() {
    let logits = Tensor::randn([1, 3, 6], (Kind::Double, CPU));
    let _ = logits.narrow(1, 2, 1).fill_(f64::NAN); // padding position holds NaN logits
    let labels = Tensor::from_slice2(&[[1i64, 2, -100]]);
    let cfg = LogProbConfig::pytorch().with_entropy(true);
    let l = leaf(&logits);
    let loss =
        backward_through_logprobs(&l, &labels, None, &cfg, |x| Ok::<_, LossError>(x.logp.sum(Kind::Double))).unwrap();
    assert!(scalar(&loss).is_finite());
    let g = l.grad();
    assert_eq!(g.narrow(1, 2, 1).abs().sum(Kind::Double).double_value(&[]), 0.0);
    assert!(g.isfinite().all().int64_value(&[]) == 1);
}

#[test]
fn minus_inf_logits_of_banned_tokens_stay_finite() {
    let logits = Tensor::from_slice(&[0.0f32, f32::NEG_INFINITY, 1.0, 2.0]).reshape([1, 1, 4]).set_requires_grad(true);
    let labels = Tensor::from_slice2(&[[2i64]]);
    let cfg = LogProbConfig::new().with_entropy(true);
    let out = token_logprobs(&logits, &labels, None, &cfg).unwrap();
    assert!(out.entropy.unwrap().isfinite().all().int64_value(&[]) == 1);
    let _ = backward_through_logprobs(&logits, &labels, None, &cfg, |x| {
        Ok::<_, LossError>(x.logp.sum(Kind::Float) + x.entropy.as_ref().unwrap().sum(Kind::Float))
    })
    .unwrap();
    let g = vec1(&logits.grad());
    assert!(g.iter().all(|v| v.is_finite()), "{g:?}");
    assert_eq!(g[1], 0.0);
    // A label whose own logit is −inf has log-prob −inf: an error naming the logits.
    let e = token_logprobs(&logits, &Tensor::from_slice2(&[[1i64]]), None, &cfg).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logits", .. }), "{e}");
}

#[test]
fn sequence_logprobs_sum_and_mean() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0, f64::NAN], [-0.5, -0.5, -0.5]]).set_requires_grad(true);
    let m = Tensor::from_slice2(&[[1i64, 1, 0], [1, 1, 1]]);
    let s = sequence_logprobs(&lp, &m, SequenceReduce::Sum).unwrap();
    assert_eq!(vec1(&s), vec![-3.0, -1.5]);
    let mean = sequence_logprobs(&lp, &m, SequenceReduce::Mean).unwrap();
    assert_eq!(vec1(&mean), vec![-1.5, -0.5]);
    mean.sum(Kind::Double).backward();
    assert_close(&vec1(&lp.grad()), &[0.5, 0.5, 0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0], 1e-15, "mean grad");
}

#[test]
fn sequence_logprobs_name_the_first_non_finite_real_entry() {
    // NaN and −inf where the mask holds: an error naming `logp` and the first such entry.
    for bad in [f64::NAN, f64::NEG_INFINITY, f64::INFINITY] {
        let lp = Tensor::from_slice2(&[[-1.0f64, -2.0, f64::NAN], [-0.5, bad, -0.5]]);
        let m = Tensor::from_slice2(&[[1i64, 1, 0], [1, 1, 1]]);
        let e = sequence_logprobs(&lp, &m, SequenceReduce::Sum).unwrap_err();
        match e {
            LossError::NonFinite { argument: "logp", count: 1, ref first_index } => {
                assert_eq!(first_index, &vec![1, 1], "{e}")
            }
            other => panic!("{bad}: {other}"),
        }
    }
    // Shape checks only: no host read, the same values.
    let lp = Tensor::from_slice2(&[[-1.0f32, -2.0, f32::NAN], [-0.5, -0.25, -0.5]]);
    let m = Tensor::from_slice2(&[[1.0f32, 1.0, 0.0], [1.0, 1.0, 1.0]]);
    for reduce in [SequenceReduce::Sum, SequenceReduce::Mean] {
        let full = sequence_logprobs(&lp, &m, reduce).unwrap();
        let before = host_reads();
        let fast = sequence_logprobs_with_checks(&lp, &m, reduce, Checks::Shapes).unwrap();
        assert_eq!(host_reads(), before);
        assert_eq!(vec1(&fast), vec1(&full));
    }
    // Finite entries whose sum overflows f32 are not an error: the sum is −inf.
    let lp = Tensor::from_slice2(&[[-3.0e38f32, -3.0e38]]);
    let s = sequence_logprobs(&lp, &Tensor::from_slice2(&[[true, true]]), SequenceReduce::Sum).unwrap();
    assert_eq!(s.double_value(&[0]), f64::NEG_INFINITY);
}

#[test]
fn sequence_logprobs_full_checks_equal_the_where_path_values_and_gradients() {
    // Full checks sum a product with the 0/1 mask when every entry is finite and fall back to
    // `where` otherwise; shape checks always use `where`. Both must give the same values and
    // gradients, padding's gradient exactly zero, in one host read for finite inputs.
    tch::manual_seed(7);
    for pad in [-0.25f32, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let raw = -Tensor::rand([6, 9], (Kind::Float, CPU)) * 5.0;
        let m = Tensor::rand([6, 9], (Kind::Float, CPU)).gt(0.4);
        let _ = m.get(2).fill_(0); // an empty row
        let raw = raw.where_self(&m, &Tensor::from(pad));
        for reduce in [SequenceReduce::Sum, SequenceReduce::Mean] {
            let grads = |checks: Checks| {
                let lp = raw.copy().set_requires_grad(true);
                let before = host_reads();
                let s = sequence_logprobs_with_checks(&lp, &m, reduce, checks).unwrap();
                let reads = host_reads() - before;
                (&s * Tensor::arange(6, (Kind::Float, CPU))).sum(Kind::Float).backward();
                (vec1(&s), vec1(&lp.grad()), reads)
            };
            let (v_full, g_full, reads_full) = grads(Checks::Full);
            let (v_where, g_where, reads_where) = grads(Checks::Shapes);
            assert_eq!(v_full, v_where, "{pad} {reduce:?}");
            assert_eq!(g_full, g_where, "{pad} {reduce:?}");
            assert!(v_full.iter().all(|v| v.is_finite()), "{pad}");
            let mask = vec1(&m.to_kind(Kind::Double));
            for (g, w) in g_full.iter().zip(&mask) {
                assert!(*w == 1.0 || *g == 0.0, "padding gradient {g} ({pad})");
            }
            assert_eq!(reads_where, 0);
            assert_eq!(reads_full, if pad.is_finite() { 1 } else { 2 }, "{pad}");
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let logits = Tensor::zeros([1, 2, 4], (Kind::Float, CPU));
    let cfg = LogProbConfig::default();
    let e = token_logprobs(&logits, &Tensor::from_slice2(&[[0i64, 4]]), None, &cfg).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "labels", value, .. } if value == 4.0), "{e}");
    // Out of range but masked: fine.
    assert!(
        token_logprobs(&logits, &Tensor::from_slice2(&[[0i64, 4]]), Some(&Tensor::from_slice2(&[[true, false]])), &cfg)
            .is_ok()
    );
    let e = token_logprobs(&logits, &Tensor::from_slice2(&[[0.0f32, 1.0]]), None, &cfg).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "labels", .. }), "{e}");
    let e = token_logprobs(&logits, &Tensor::from_slice(&[0i64, 1]), None, &cfg).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "labels", .. }), "{e}");
    let e = token_logprobs(&logits.reshape([2, 4]), &Tensor::from_slice(&[0i64, 1]), None, &cfg).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "logits", .. }), "{e}");
    let e = fused_token_logprobs(
        &Tensor::zeros([1, 2, 3], (Kind::Float, CPU)),
        &Tensor::zeros([5, 4], (Kind::Float, CPU)),
        &Tensor::from_slice2(&[[0i64, 1]]),
        None,
        &cfg,
    )
    .unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "weight", .. }), "{e}");
    let e = token_logprobs(&logits, &Tensor::from_slice2(&[[0i64, 1]]), None, &cfg.with_temperature(0.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "temperature", .. }), "{e}");
    // A loss_fn that returns a vector is refused.
    let l = logits.set_requires_grad(true);
    let e =
        backward_through_logprobs(&l, &Tensor::from_slice2(&[[0i64, 1]]), None, &cfg, |x| Ok(x.logp.shallow_clone()))
            .unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "loss_fn", .. }), "{e}");
}
