//! PPO-clip, GSPO and CISPO against scalar references, finite differences, extremes, padding and
//! split invariance.

mod common;

use common::*;
use proptest::prelude::*;
use tch::Tensor;
use topr_loss::{
    AggregationMode, LossError, LossOutput, Normalizer, PpoConfig, PpoDiagnostics, cispo_loss, cispo_loss_output,
    gspo_loss, gspo_loss_output, ppo_clip_loss, ppo_clip_loss_output,
};

type Batch = TokenBatch;

fn batch() -> impl Strategy<Value = Batch> {
    token_batch(0.6, (-2.0f64..2.0).boxed())
}

/// The aggregation weights by the definitions, with this batch's counts.
fn alpha(mask: &[Vec<bool>], mode: AggregationMode) -> Vec<f64> {
    ref_alpha(mask, mode, None)
}

fn clip(r: f64, cfg: &PpoConfig) -> f64 {
    r.max(1.0 - cfg.clip_low).min(1.0 + cfg.clip_high)
}

/// PPO value and d/dlogp of one token, by cases.
fn ref_ppo_token(delta: f64, a: f64, cfg: &PpoConfig) -> (f64, f64) {
    let r = delta.exp();
    let unclipped = -r * a;
    let clipped = -clip(r, cfg) * a;
    // Gradient flows only through the active branch: the unclipped one, or the clipped one when
    // r lies inside the clip range.
    let (mut v, mut g) = if unclipped >= clipped {
        (unclipped, -r * a)
    } else {
        let inside = r > 1.0 - cfg.clip_low && r < 1.0 + cfg.clip_high;
        (clipped, if inside { -r * a } else { 0.0 })
    };
    if let Some(c) = cfg.dual_clip {
        if a < 0.0 && -c * a < v {
            v = -c * a;
            g = 0.0;
        }
    }
    (v, g)
}

fn ref_loss(b: &Batch, cfg: &PpoConfig, which: &str) -> (f64, Vec<Vec<f64>>) {
    let al = alpha(&b.mask, cfg.aggregation);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for i in 0..b.mask.len() {
        let toks: Vec<usize> = (0..b.mask[i].len()).filter(|&t| b.mask[i][t]).collect();
        if toks.is_empty() {
            continue;
        }
        let a = b.weights[i];
        match which {
            "ppo" => {
                for &t in &toks {
                    let (v, g) = ref_ppo_token(b.logp[i][t] - b.other[i][t], a, cfg);
                    value += al[i] * v;
                    grad[i][t] = al[i] * g;
                }
            }
            "gspo" => {
                let l = toks.len() as f64;
                let mean: f64 = toks.iter().map(|&t| b.logp[i][t] - b.other[i][t]).sum::<f64>() / l;
                let (v, g) = ref_ppo_token(mean, a, cfg);
                value += al[i] * l * v;
                for &t in &toks {
                    grad[i][t] = al[i] * g; // d mean / d logp_t = 1/L, times L tokens carrying ℓ_i
                }
            }
            "cispo" => {
                for &t in &toks {
                    let w = clip((b.logp[i][t] - b.other[i][t]).exp(), cfg);
                    value += al[i] * -w * a * b.logp[i][t];
                    grad[i][t] = al[i] * -w * a;
                }
            }
            _ => unreachable!(),
        }
    }
    (value, grad)
}

type LossFn = fn(&Tensor, &Tensor, &Tensor, &Tensor, &PpoConfig) -> Result<Tensor, LossError>;
const LOSSES: [(&str, LossFn); 3] = [("ppo", ppo_clip_loss), ("gspo", gspo_loss), ("cispo", cispo_loss)];
type OutputFn =
    fn(&Tensor, &Tensor, &Tensor, &Tensor, &PpoConfig, &Normalizer) -> Result<LossOutput<PpoDiagnostics>, LossError>;
const OUTPUTS: [(&str, OutputFn); 3] =
    [("ppo", ppo_clip_loss_output), ("gspo", gspo_loss_output), ("cispo", cispo_loss_output)];

fn configs() -> Vec<PpoConfig> {
    vec![
        PpoConfig::ppo(),
        PpoConfig::dapo(),
        PpoConfig::ppo().with_dual_clip(Some(3.0)),
        PpoConfig::ppo()
            .with_clip(0.1, 0.3)
            .with_dual_clip(Some(1.5))
            .with_aggregation(AggregationMode::SeqMeanTokenMean),
        PpoConfig::gspo()
            .with_clip(PpoConfig::gspo().clip_low, 0.05)
            .with_aggregation(AggregationMode::SeqMeanTokenSum),
        PpoConfig::cispo().with_clip(0.5, 0.5).with_aggregation(AggregationMode::TokenSum),
    ]
}

fn run(b: &Batch, cfg: &PpoConfig, f: LossFn, padding: f64) -> (f64, Vec<f64>) {
    let (lp, old, adv, m) = b.tensors(padding);
    let lp = leaf(&lp);
    let loss = f(&lp, &old, &adv, &m, cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&lp.grad()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in configs() {
            for (name, f) in LOSSES {
                let (v, g) = run(&b, &cfg, f, f64::NAN);
                let (rv, rg) = ref_loss(&b, &cfg, name);
                assert_close(&[v], &[rv], 1e-10, &format!("{name} {cfg:?} value"));
                assert_close(&g, &rg.concat(), 1e-10, &format!("{name} {cfg:?} grad"));
                for (k, m) in b.mask.concat().iter().enumerate() {
                    if !m { prop_assert!(g[k] == 0.0, "padding gradient {} (exactly zero, either sign)", g[k]); }
                }
            }
        }
    }

    #[test]
    fn on_policy_ppo_and_cispo_are_vanilla_policy_gradient(b in batch()) {
        // r = 1: PPO, GSPO and CISPO all give −α A ∇log π per token.
        let on = Batch { other: b.logp.clone(), ..b.clone() };
        let cfg = PpoConfig::default();
        let (_, g_ppo) = run(&on, &cfg, ppo_clip_loss, 0.0);
        let (_, g_cispo) = run(&on, &cfg, cispo_loss, 0.0);
        assert_close(&g_ppo, &g_cispo, 1e-12, "on-policy PPO vs CISPO");
    }

    #[test]
    fn split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        for ((name, output), (_, plain)) in OUTPUTS.into_iter().zip(LOSSES) {
            assert_split_invariant(&b, split, name, &|lp, old, adv, m, mode, norm| {
                let cfg = PpoConfig::dapo().with_aggregation(mode).with_dual_clip(Some(2.0));
                match norm {
                    Some(n) => output(lp, old, adv, m, &cfg, n).map(|o| o.loss),
                    None => plain(lp, old, adv, m, &cfg),
                }
            });
        }
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let b = Batch {
        logp: vec![vec![-0.7, -1.2, -0.3], vec![-2.0, -0.4, -0.9], vec![-0.5, -0.6, -0.1]],
        other: vec![vec![-0.9, -1.05, -0.6], vec![-1.7, -0.45, -1.3], vec![-0.2, -0.9, -0.3]],
        mask: vec![vec![true, true, true], vec![true, true, false], vec![true, false, false]],
        weights: vec![1.0, -1.0, -0.5],
    };
    for cfg in configs() {
        // CISPO's weight is held constant by design, so its gradient is not the derivative of its
        // value; the scalar reference checks it instead.
        for (name, f) in LOSSES.into_iter().filter(|(n, _)| *n != "cispo") {
            let (_, g) = run(&b, &cfg, f, 0.0);
            let fd = finite_difference(&b.logp.concat(), 1e-6, |x| {
                let bb = Batch { logp: x.chunks(3).map(|c| c.to_vec()).collect(), ..b.clone() };
                let (lp, old, adv, m) = bb.tensors(0.0);
                scalar(&f(&lp, &old, &adv, &m, &cfg).unwrap())
            });
            assert_close(&g, &fd, 1e-6, &format!("{name} {cfg:?} finite differences"));
        }
    }
}

#[test]
fn extreme_log_ratios_stay_finite() {
    use tch::Kind;
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16] {
        for cfg in [PpoConfig::ppo(), PpoConfig::ppo().with_dual_clip(Some(3.0)), PpoConfig::gspo(), PpoConfig::cispo()]
        {
            for (name, f) in LOSSES {
                let logp =
                    Tensor::from_slice2(&[[-1.0e4f64, 0.0], [0.0, -1.0e4]]).to_kind(kind).set_requires_grad(true);
                let old = Tensor::from_slice2(&[[0.0f64, -1.0e4], [-1.0e4, 0.0]]).to_kind(kind);
                let adv = Tensor::from_slice(&[1.0f64, -1.0]).to_kind(kind);
                let m = Tensor::from_slice2(&[[1i64, 1], [1, 1]]);
                let loss = f(&logp, &old, &adv, &m, &cfg).unwrap();
                assert!(scalar(&loss).is_finite(), "{name} {kind:?}");
                loss.backward();
                assert!(vec1(&logp.grad()).iter().all(|g| g.is_finite()), "{name} {kind:?}");
            }
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let adv = t1(&[1.0]);
    for (name, f) in LOSSES {
        let e = f(&lp, &Tensor::from_slice(&[-1.0f64, -1.0]), &adv, &m, &PpoConfig::default()).unwrap_err();
        assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_mu", .. }), "{name}: {e}");
        let e = f(&lp, &lp, &t1(&[1.0, 2.0]), &m, &PpoConfig::default()).unwrap_err();
        assert!(matches!(e, LossError::ShapeMismatch { argument: "advantages", .. }), "{name}: {e}");
        let e = f(&lp, &lp, &t1(&[f64::NAN]), &m, &PpoConfig::default()).unwrap_err();
        assert!(matches!(e, LossError::NonFinite { argument: "advantages", .. }), "{name}: {e}");
        let e = f(&lp, &lp, &adv, &m, &PpoConfig::default().with_clip(-0.1, 0.2)).unwrap_err();
        assert!(matches!(e, LossError::InvalidConfig { field: "clip_low", .. }), "{name}: {e}");
        let e = f(&lp, &lp, &adv, &m, &PpoConfig::default().with_max_log_ratio(f64::NAN)).unwrap_err();
        assert!(matches!(e, LossError::InvalidConfig { field: "max_log_ratio", .. }), "{name}: {e}");
    }
    // Advantages too large for f32 give NonFiniteLoss, not inf.
    let lp32 = Tensor::from_slice2(&[[-1.0f32, -1.0]]);
    let e = ppo_clip_loss(
        &lp32,
        &lp32,
        &Tensor::from_slice(&[3.0e38f32]),
        &m,
        &PpoConfig::default().with_aggregation(AggregationMode::TokenSum),
    )
    .unwrap_err();
    assert_eq!(e, LossError::NonFiniteLoss { compute_dtype: "f32" });
    // GSPO takes one advantage per sequence.
    let e = gspo_loss(&lp, &lp, &Tensor::from_slice2(&[[1.0f64, 1.0]]), &m, &PpoConfig::gspo()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "advantages", .. }), "{e}");
}

#[test]
fn on_policy_reinforce_through_topr_equals_ppo() {
    // docs/methods.md: RLOO / AsymRE as on-policy REINFORCE via the TOPR family equal PPO on-policy.
    use topr_loss::{RatioLevel, ToprConfig, ToprTokenConfig, topr_token_loss};
    let b = Batch {
        logp: vec![vec![-0.7, -1.2, -0.3], vec![-2.0, -0.4, -0.9]],
        other: vec![vec![-0.7, -1.2, -0.3], vec![-2.0, -0.4, -0.9]],
        mask: vec![vec![true, true, true], vec![true, true, false]],
        weights: vec![0.8, -1.3],
    };
    for aggregation in [AggregationMode::TokenMean, AggregationMode::SeqMeanTokenMean, AggregationMode::SeqMeanTokenSum]
    {
        let (_, g_ppo) = run(&b, &PpoConfig::ppo().with_aggregation(aggregation), ppo_clip_loss, 0.0);
        let (lp, old, adv, m) = b.tensors(0.0);
        let lp = leaf(&lp);
        let cfg = ToprTokenConfig::default()
            .with_topr(ToprConfig::naive_reinforce())
            .with_ratio(RatioLevel::Token)
            .with_aggregation(aggregation);
        topr_token_loss(&lp, &old, &adv, &m, &cfg).unwrap().backward();
        assert_close(&vec1(&lp.grad()), &g_ppo, 1e-12, &format!("{aggregation:?}"));
    }
}
