//! GMPO, Clip-Cov and KL-Cov against scalar references of the published formulas, finite
//! differences, padding, split (in)variance, extremes, and verl's own functions.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, BatchCounts, ClipCovConfig, GmpoConfig, KlCovConfig, LossError, Normalizer, PpoConfig,
    clip_cov_loss, clip_cov_loss_output, gmpo_loss, gmpo_loss_output, gspo_loss, kl_cov_loss, kl_cov_loss_output,
    ppo_clip_loss,
};

type Batch = TokenBatch;

fn batch() -> impl Strategy<Value = Batch> {
    token_batch(1.0, (-2.0f64..2.0).boxed())
}

fn real_tokens(b: &Batch) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for (i, row) in b.mask.iter().enumerate() {
        for (t, m) in row.iter().enumerate() {
            if *m {
                v.push((i, t));
            }
        }
    }
    v
}

// ---------------------------------------------------------------- GMPO

/// GMPO's value and gradient from the paper's objective: per sequence, the geometric mean of the
/// sign-clipped token ratios times the advantage.
fn ref_gmpo(b: &Batch, cfg: &GmpoConfig, global: Option<(f64, f64)>) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.aggregation, global);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for i in 0..b.mask.len() {
        let toks: Vec<usize> = (0..b.mask[i].len()).filter(|&t| b.mask[i][t]).collect();
        if toks.is_empty() {
            continue;
        }
        let a = b.weights[i];
        let l = toks.len() as f64;
        let mut sum = 0.0;
        let mut free = Vec::new();
        for &t in &toks {
            let raw = b.logp[i][t] - b.other[i][t];
            let d = raw.clamp(-cfg.max_log_ratio, cfg.max_log_ratio);
            let inside = raw.abs() <= cfg.max_log_ratio; // past the clamp: no gradient
            let (dc, passes) = if a > 0.0 {
                if d > cfg.clip_high { (cfg.clip_high, false) } else { (d, true) }
            } else if a < 0.0 {
                if d < -cfg.clip_low { (-cfg.clip_low, false) } else { (d, true) }
            } else {
                (0.0, false)
            };
            sum += dc;
            free.push(passes && inside);
        }
        let s = (sum / l).exp();
        value += al[i] * l * (-a * s);
        for (&t, passes) in toks.iter().zip(free) {
            if passes {
                grad[i][t] = al[i] * (-a * s);
            }
        }
    }
    (value, grad.concat())
}

fn gmpo_configs() -> Vec<GmpoConfig> {
    vec![
        GmpoConfig::gmpo(),
        GmpoConfig::gmpo().with_clip(0.2, 0.28).with_aggregation(AggregationMode::TokenMean),
        GmpoConfig::gmpo().with_clip(f64::INFINITY, 0.1).with_aggregation(AggregationMode::SeqMeanTokenSum),
        GmpoConfig::gmpo().with_max_log_ratio(0.25).with_clip(0.5, 0.5),
    ]
}

fn run_gmpo(b: &Batch, cfg: &GmpoConfig, padding: f64) -> (f64, Vec<f64>) {
    let (lp, old, adv, m) = b.tensors(padding);
    let lp = leaf(&lp);
    let loss = gmpo_loss(&lp, &old, &adv, &m, cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&lp.grad()))
}

// ---------------------------------------------------------------- Clip-Cov and KL-Cov

/// Centred covariance terms over the unmasked tokens, by the definition.
fn ref_cov(b: &Batch) -> Vec<((usize, usize), f64)> {
    let toks = real_tokens(b);
    let n = toks.len() as f64;
    let a_mean = toks.iter().map(|&(i, _)| b.weights[i]).sum::<f64>() / n;
    let l_mean = toks.iter().map(|&(i, t)| b.logp[i][t]).sum::<f64>() / n;
    toks.iter().map(|&(i, t)| ((i, t), (b.weights[i] - a_mean) * (b.logp[i][t] - l_mean))).collect()
}

fn selected_count(n: usize, ratio: f64) -> usize {
    ((n as f64 * ratio).floor() as usize).max(1)
}

/// PPO-clip value and gradient of one token (no dual clip).
fn ref_ppo_token(delta: f64, a: f64, lo: f64, hi: f64, m: f64) -> (f64, f64, bool) {
    let r = delta.clamp(-m, m).exp();
    let dr = if delta.abs() > m { 0.0 } else { r };
    let c = r.max(1.0 - lo).min(1.0 + hi);
    let (unclipped, clipped) = (-r * a, -c * a);
    // Where the clipped side is the larger loss, r lies outside the range: no gradient.
    if clipped > unclipped { (clipped, 0.0, true) } else { (unclipped, -dr * a, false) }
}

/// Clip-Cov by its definition: candidates in the band that the clip leaves alone, the `k` of
/// smallest key (then lowest index) cut.
/// Clip-Cov's value, gradient and cut tokens.
type ClipCovRef = (f64, Vec<f64>, Vec<(usize, usize)>);

/// `None` when a covariance lies within 1e-12 of a band end (rounding may decide membership).
fn ref_clip_cov(b: &Batch, keys: &[Vec<f64>], cfg: &ClipCovConfig) -> Option<ClipCovRef> {
    let al = ref_alpha(&b.mask, cfg.aggregation, None);
    let cov = ref_cov(b);
    let mut candidates = Vec::new();
    let mut per_token = Vec::new();
    for &((i, t), c) in &cov {
        let (v, g, clip_decides) =
            ref_ppo_token(b.logp[i][t] - b.other[i][t], b.weights[i], cfg.clip_low, cfg.clip_high, cfg.max_log_ratio);
        per_token.push(((i, t), v, g));
        if (c - cfg.cov_low).abs() < 1e-12 || (c - cfg.cov_high).abs() < 1e-12 {
            return None; // on a band end, rounding decides
        }
        if !clip_decides && c > cfg.cov_low && c < cfg.cov_high {
            candidates.push((i, t));
        }
    }
    let width = b.mask[0].len();
    candidates.sort_by(|p, q| {
        keys[p.0][p.1].partial_cmp(&keys[q.0][q.1]).unwrap().then((p.0 * width + p.1).cmp(&(q.0 * width + q.1)))
    });
    candidates.truncate(selected_count(cov.len(), cfg.ratio));
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; width]; b.mask.len()];
    for ((i, t), v, g) in per_token {
        if !candidates.contains(&(i, t)) {
            value += al[i] * v;
            grad[i][t] = al[i] * g;
        }
    }
    Some((value, grad.concat(), candidates))
}

/// KL-Cov by its definition: the `k` unmasked tokens of largest covariance (then lowest index)
/// get `β|δ|`; no clip.
/// `None` when the k-th and (k+1)-th covariances are within 1e-12 of each other: rounding (the
/// order of a sum) may then decide the selection, in this reference or in the library.
fn ref_kl_cov(b: &Batch, cfg: &KlCovConfig) -> Option<(f64, Vec<f64>)> {
    let al = ref_alpha(&b.mask, cfg.aggregation, None);
    let mut cov = ref_cov(b);
    let n = cov.len();
    // Stable, and by IEEE order (−0 = +0): equal covariances keep their row-major order.
    cov.sort_by(|p, q| q.1.partial_cmp(&p.1).unwrap());
    let k = selected_count(n, cfg.ratio);
    if k < n && (cov[k - 1].1 - cov[k].1).abs() < 1e-12 {
        return None;
    }
    let chosen: Vec<(usize, usize)> = cov.iter().take(k).map(|c| c.0).collect();
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, t) in real_tokens(b) {
        let d = b.logp[i][t] - b.other[i][t];
        let r = d.clamp(-cfg.max_log_ratio, cfg.max_log_ratio).exp();
        let dr = if d.abs() > cfg.max_log_ratio { 0.0 } else { r };
        let a = b.weights[i];
        let (mut v, mut g) = (-r * a, -dr * a);
        if chosen.contains(&(i, t)) {
            v += cfg.coef * d.abs();
            g += cfg.coef * d.signum() * f64::from(u8::from(d != 0.0));
        }
        value += al[i] * v;
        grad[i][t] = al[i] * g;
    }
    Some((value, grad.concat()))
}

fn keys_for(b: &Batch, raw: &[f64]) -> Vec<Vec<f64>> {
    let w = b.mask[0].len();
    (0..b.mask.len()).map(|i| (0..w).map(|t| raw[(i * w + t) % raw.len()]).collect()).collect()
}

fn run_clip_cov(b: &Batch, keys: &[Vec<f64>], cfg: &ClipCovConfig, padding: f64) -> (f64, Vec<f64>) {
    let (lp, old, adv, m) = b.tensors(padding);
    let lp = leaf(&lp);
    let keys = t2(keys);
    let loss = clip_cov_loss(&lp, &old, &adv, &m, &keys, cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&lp.grad()))
}

fn run_kl_cov(b: &Batch, cfg: &KlCovConfig, padding: f64) -> (f64, Vec<f64>) {
    let (lp, old, adv, m) = b.tensors(padding);
    let lp = leaf(&lp);
    let loss = kl_cov_loss(&lp, &old, &adv, &m, cfg).unwrap();
    loss.backward();
    (scalar(&loss), vec1(&lp.grad()))
}

fn clip_cov_configs() -> Vec<ClipCovConfig> {
    vec![
        ClipCovConfig::clip_cov().with_band(0.1, 3.0).with_ratio(0.3),
        ClipCovConfig::clip_cov()
            .with_band(-1.0, 1.0)
            .with_ratio(1.0)
            .with_aggregation(AggregationMode::SeqMeanTokenMean),
        ClipCovConfig::clip_cov().with_clip(0.1, 0.3).with_band(0.0, f64::INFINITY).with_ratio(0.2),
        ClipCovConfig::clip_cov(),
    ]
}

fn kl_cov_configs() -> Vec<KlCovConfig> {
    vec![
        KlCovConfig::kl_cov(),
        KlCovConfig::kl_cov().with_ratio(0.3).with_coef(1.0),
        KlCovConfig::kl_cov().with_ratio(1.0).with_coef(0.5).with_aggregation(AggregationMode::SeqMeanTokenSum),
        KlCovConfig::kl_cov().with_ratio(0.5).with_max_log_ratio(0.4).with_aggregation(AggregationMode::TokenSum),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn gmpo_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in gmpo_configs() {
            let (v, g) = run_gmpo(&b, &cfg, f64::NAN);
            let (rv, rg) = ref_gmpo(&b, &cfg, None);
            assert_close(&[v], &[rv], 1e-10, &format!("{cfg:?} value"));
            assert_close(&g, &rg, 1e-10, &format!("{cfg:?} grad"));
            for (k, m) in b.mask.concat().iter().enumerate() {
                if !m { prop_assert!(g[k] == 0.0, "padding gradient {} (exactly zero, either sign)", g[k]); }
            }
        }
    }

    #[test]
    fn gmpo_on_policy_equals_gspo_on_policy(b in batch()) {
        // s = 1: both give −α_i A_i per unmasked token.
        let on = Batch { other: b.logp.clone(), ..b.clone() };
        let (_, g) = run_gmpo(&on, &GmpoConfig::gmpo(), 0.0);
        let (lp, old, adv, m) = on.tensors(0.0);
        let lp = leaf(&lp);
        gspo_loss(&lp, &old, &adv, &m, &PpoConfig::gspo()).unwrap().backward();
        assert_close(&g, &vec1(&lp.grad()), 1e-12, "on-policy GMPO vs GSPO");
    }

    #[test]
    fn gmpo_sequence_ratio_stays_inside_the_clip_on_the_advantage_side(b in batch()) {
        // A > 0: s ≤ e^ε_high; A < 0: s ≥ e^−ε_low, whatever the tokens do.
        let cfg = GmpoConfig::gmpo();
        let (lp, old, adv, m) = b.tensors(f64::NAN);
        let terms = gmpo_loss_output(&lp, &old, &adv, &m, &cfg, &Normalizer::local()).unwrap().terms;
        for (i, row) in b.mask.iter().enumerate() {
            let a = b.weights[i];
            if a == 0.0 || !row[0] { continue; }
            let s = -terms.double_value(&[i as i64, 0]) / a;
            if a > 0.0 { prop_assert!(s <= cfg.clip_high.exp() * (1.0 + 1e-12)); }
            else { prop_assert!(s >= (-cfg.clip_low).exp() * (1.0 - 1e-12)); }
        }
    }

    #[test]
    fn gmpo_split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        assert_split_invariant(&b, split, "GMPO", &|lp, old, adv, m, mode, norm| {
            let cfg = GmpoConfig::gmpo().with_aggregation(mode);
            match norm {
                Some(n) => gmpo_loss_output(lp, old, adv, m, &cfg, n).map(|o| o.loss),
                None => gmpo_loss(lp, old, adv, m, &cfg),
            }
        });
    }

    #[test]
    fn clip_cov_matches_scalar_reference_with_nan_padding(b in batch(), raw in prop::collection::vec(0.0f64..1.0, 1..40)) {
        let keys = keys_for(&b, &raw);
        for cfg in clip_cov_configs() {
            let (v, g) = run_clip_cov(&b, &keys, &cfg, f64::NAN);
            let Some((rv, rg, cut)) = ref_clip_cov(&b, &keys, &cfg) else { continue };
            assert_close(&[v], &[rv], 1e-10, &format!("{cfg:?} value"));
            assert_close(&g, &rg, 1e-10, &format!("{cfg:?} grad"));
            let w = b.mask[0].len();
            for (k, m) in b.mask.concat().iter().enumerate() {
                if !m { prop_assert!(g[k] == 0.0, "padding gradient {} (exactly zero, either sign)", g[k]); }
                if cut.contains(&(k / w, k % w)) { prop_assert_eq!(g[k], 0.0); } // ±0: 0 times −A
            }
            // The diagnostics count the cut tokens.
            let (lp, old, adv, m) = b.tensors(f64::NAN);
            let d = clip_cov_loss_output(&lp, &old, &adv, &m, &t2(&keys), &cfg, &Normalizer::local()).unwrap().diagnostics.read().unwrap();
            prop_assert!((d.clip_fraction * d.samples as f64 - cut.len() as f64).abs() < 1e-9);
        }
    }

    #[test]
    fn clip_cov_cuts_min_k_and_the_candidates(b in batch(), raw in prop::collection::vec(0.0f64..1.0, 1..40), ratio in 0.01f64..1.0) {
        // |D| = min(max(⌊ρN⌋, 1), |C|): with the whole real line as band and no clip on-policy,
        // every real token is a candidate.
        let on = Batch { other: b.logp.clone(), ..b.clone() };
        let cfg = ClipCovConfig::clip_cov().with_band(f64::NEG_INFINITY, f64::INFINITY).with_ratio(ratio);
        let (lp, old, adv, m) = on.tensors(0.0);
        let out = clip_cov_loss_output(&lp, &old, &adv, &m, &t2(&keys_for(&on, &raw)), &cfg, &Normalizer::local()).unwrap();
        let d = out.diagnostics.read().unwrap();
        let n = real_tokens(&on).len();
        prop_assert_eq!((d.clip_fraction * n as f64).round() as usize, selected_count(n, ratio).min(n));
    }

    #[test]
    fn kl_cov_matches_scalar_reference_with_nan_padding(b in batch()) {
        for cfg in kl_cov_configs() {
            let (v, g) = run_kl_cov(&b, &cfg, f64::NAN);
            let Some((rv, rg)) = ref_kl_cov(&b, &cfg) else { continue };
            assert_close(&[v], &[rv], 1e-10, &format!("{cfg:?} value"));
            assert_close(&g, &rg, 1e-10, &format!("{cfg:?} grad"));
            for (k, m) in b.mask.concat().iter().enumerate() {
                if !m { prop_assert!(g[k] == 0.0, "padding gradient {} (exactly zero, either sign)", g[k]); }
            }
        }
    }

    #[test]
    fn kl_cov_without_penalty_is_unclipped_importance_sampling(b in batch()) {
        // β = 0: −r A on every token, PPO with both clips off.
        let (v, g) = run_kl_cov(&b, &KlCovConfig::kl_cov().with_coef(0.0).with_ratio(0.5), 0.0);
        let (lp, old, adv, m) = b.tensors(0.0);
        let lp = leaf(&lp);
        let ppo = ppo_clip_loss(&lp, &old, &adv, &m, &PpoConfig::ppo().with_clip(f64::INFINITY, f64::INFINITY)).unwrap();
        ppo.backward();
        assert_close(&[v], &[scalar(&ppo)], 1e-12, "value");
        assert_close(&g, &vec1(&lp.grad()), 1e-12, "grad");
    }

    #[test]
    fn kl_cov_penalty_only_adds(b in batch(), coef in 0.0f64..2.0) {
        let cfg = KlCovConfig::kl_cov().with_ratio(0.4);
        let (v0, _) = run_kl_cov(&b, &cfg.with_coef(0.0), 0.0);
        let (v, _) = run_kl_cov(&b, &cfg.with_coef(coef), 0.0);
        prop_assert!(v >= v0 - 1e-12);
    }
}

fn fixed_batch() -> Batch {
    Batch {
        logp: vec![vec![-0.7, -1.2, -0.3], vec![-2.0, -0.4, -0.9], vec![-0.5, -0.6, -0.1]],
        other: vec![vec![-0.9, -0.75, -0.6], vec![-1.7, -0.45, -2.3], vec![-0.2, -0.9, -0.3]],
        mask: vec![vec![true, true, true], vec![true, true, false], vec![true, false, false]],
        weights: vec![1.0, -1.0, -0.5],
    }
}

#[test]
fn gradients_match_finite_differences() {
    let b = fixed_batch();
    let flat = b.logp.concat();
    let with = |x: &[f64]| Batch { logp: x.chunks(3).map(|c| c.to_vec()).collect(), ..b.clone() };
    for cfg in gmpo_configs() {
        let (_, g) = run_gmpo(&b, &cfg, 0.0);
        let fd = finite_difference(&flat, 1e-6, |x| {
            let (lp, old, adv, m) = with(x).tensors(0.0);
            scalar(&gmpo_loss(&lp, &old, &adv, &m, &cfg).unwrap())
        });
        assert_close(&g, &fd, 1e-6, &format!("GMPO {cfg:?}"));
    }
    // The selections are piecewise constant in logp: away from their switching points, the
    // gradient is the derivative of the value.
    let keys = vec![vec![0.3, 0.1, 0.7], vec![0.2, 0.9, 0.5], vec![0.4, 0.6, 0.8]];
    for cfg in clip_cov_configs() {
        let (_, g) = run_clip_cov(&b, &keys, &cfg, 0.0);
        let fd = finite_difference(&flat, 1e-6, |x| {
            let (lp, old, adv, m) = with(x).tensors(0.0);
            scalar(&clip_cov_loss(&lp, &old, &adv, &m, &t2(&keys), &cfg).unwrap())
        });
        assert_close(&g, &fd, 1e-6, &format!("Clip-Cov {cfg:?}"));
    }
    for cfg in kl_cov_configs() {
        let (_, g) = run_kl_cov(&b, &cfg, 0.0);
        let fd = finite_difference(&flat, 1e-6, |x| {
            let (lp, old, adv, m) = with(x).tensors(0.0);
            scalar(&kl_cov_loss(&lp, &old, &adv, &m, &cfg).unwrap())
        });
        assert_close(&g, &fd, 1e-6, &format!("KL-Cov {cfg:?}"));
    }
}

#[test]
fn covariance_selection_couples_micro_batches() {
    // The selection is per call: splitting a batch changes which tokens are penalised, so the
    // micro-batch losses do not add up to the full batch's even with global counts.
    let b = Batch {
        logp: vec![vec![-0.5, -3.0], vec![-0.5, -3.0], vec![-1.0, -1.5], vec![-2.0, -0.2]],
        other: vec![vec![-1.0, -2.0], vec![-0.1, -3.5], vec![-1.5, -1.0], vec![-1.0, -0.7]],
        mask: vec![vec![true; 2]; 4],
        weights: vec![1.0, -1.0, 0.5, -0.3],
    };
    let (lp, old, adv, m) = b.tensors(0.0);
    let norm = Normalizer::global(BatchCounts { tokens: 8.0, sequences: 4.0 });
    let cfg = KlCovConfig::kl_cov().with_coef(1.0).with_ratio(0.25); // 2 tokens of 8, 1 of 4
    let full = scalar(&kl_cov_loss_output(&lp, &old, &adv, &m, &cfg, &norm).unwrap().loss);
    let part = |o: i64| {
        scalar(
            &kl_cov_loss_output(
                &lp.narrow(0, o, 2),
                &old.narrow(0, o, 2),
                &adv.narrow(0, o, 2),
                &m.narrow(0, o, 2),
                &cfg,
                &norm,
            )
            .unwrap()
            .loss,
        )
    };
    assert!((part(0) + part(2) - full).abs() > 1e-3, "{} vs {full}", part(0) + part(2));
}

/// A loss of `logp` alone, the other inputs captured.
type LossCall<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;

#[test]
fn extreme_inputs_stay_finite_and_low_precision_computes_in_f32() {
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half] {
        let logp = || Tensor::from_slice2(&[[-1.0e4f64, 0.0], [0.0, -1.0e4]]).to_kind(kind).set_requires_grad(true);
        let old = Tensor::from_slice2(&[[0.0f64, -1.0e4], [-1.0e4, 0.0]]).to_kind(kind);
        let adv = Tensor::from_slice(&[1.0f64, -1.0]).to_kind(kind);
        let m = Tensor::from_slice2(&[[1i64, 1], [1, 1]]);
        let keys = Tensor::from_slice2(&[[0.1f64, 0.2], [0.3, 0.4]]).to_kind(kind);
        let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        let losses: Vec<(&str, LossCall)> = vec![
            ("gmpo", Box::new(|lp| gmpo_loss(lp, &old, &adv, &m, &GmpoConfig::gmpo()).unwrap())),
            (
                "gmpo unclipped",
                Box::new(|lp| {
                    gmpo_loss(lp, &old, &adv, &m, &GmpoConfig::gmpo().with_clip(f64::INFINITY, f64::INFINITY)).unwrap()
                }),
            ),
            (
                "clip_cov",
                Box::new(|lp| {
                    clip_cov_loss(
                        lp,
                        &old,
                        &adv,
                        &m,
                        &keys,
                        &ClipCovConfig::clip_cov().with_band(f64::NEG_INFINITY, f64::INFINITY).with_ratio(1.0),
                    )
                    .unwrap()
                }),
            ),
            ("kl_cov", Box::new(|lp| kl_cov_loss(lp, &old, &adv, &m, &KlCovConfig::kl_cov().with_ratio(1.0)).unwrap())),
        ];
        for (name, f) in losses {
            let lp = logp();
            let loss = f(&lp);
            assert_eq!(loss.kind(), want, "{name} {kind:?}");
            assert!(scalar(&loss).is_finite(), "{name} {kind:?}");
            loss.backward();
            assert!(vec1(&lp.grad()).iter().all(|g| g.is_finite()), "{name} {kind:?}");
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let adv = t1(&[1.0]);
    let keys = Tensor::from_slice2(&[[0.1f64, 0.2]]);
    let bad_mu = Tensor::from_slice(&[-1.0f64, -1.0]);
    let e = gmpo_loss(&lp, &bad_mu, &adv, &m, &GmpoConfig::gmpo()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_mu", .. }), "{e}");
    let e = gmpo_loss(&lp, &lp, &Tensor::from_slice2(&[[1.0f64, 1.0]]), &m, &GmpoConfig::gmpo()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "advantages", .. }), "{e}");
    let e = gmpo_loss(&lp, &lp, &adv, &m, &GmpoConfig::gmpo().with_clip(f64::NAN, 0.4)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "clip_low", .. }), "{e}");
    let e = clip_cov_loss(&lp, &lp, &adv, &m, &t1(&[0.1, 0.2]), &ClipCovConfig::clip_cov()).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "keys", .. }), "{e}");
    let e =
        clip_cov_loss(&lp, &lp, &adv, &m, &Tensor::from_slice2(&[[1i64, 2]]), &ClipCovConfig::clip_cov()).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "keys", .. }), "{e}");
    let e = clip_cov_loss(&lp, &lp, &adv, &m, &Tensor::from_slice2(&[[0.1f64, f64::NAN]]), &ClipCovConfig::clip_cov())
        .unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "keys", .. }), "{e}");
    let e = clip_cov_loss(&lp, &lp, &t1(&[f64::NAN]), &m, &keys, &ClipCovConfig::clip_cov()).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "advantages", .. }), "{e}");
    let e = clip_cov_loss(&lp, &lp, &adv, &m, &keys, &ClipCovConfig::clip_cov().with_band(1.0, 1.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "cov_low", .. }), "{e}");
    let e = clip_cov_loss(&lp, &lp, &adv, &m, &keys, &ClipCovConfig::clip_cov().with_ratio(0.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "ratio", .. }), "{e}");
    let e = kl_cov_loss(&lp, &lp, &adv, &m, &KlCovConfig::kl_cov().with_coef(-1.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "coef", .. }), "{e}");
    let e = kl_cov_loss(&lp, &lp, &adv, &m, &KlCovConfig::kl_cov().with_ratio(f64::NAN)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "ratio", .. }), "{e}");
    let e = kl_cov_loss(&lp, &lp, &adv, &Tensor::from_slice2(&[[false, false]]), &KlCovConfig::kl_cov()).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { argument: "mask", .. }), "{e}");
}

// ---------------------------------------------------------------- peers

fn peer_batches() -> Vec<Batch> {
    let mut seed = 0x9E3779B97F4A7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..8)
        .map(|k| {
            let (b, t) = (3 + k % 4, 4 + k % 5);
            let mut logp: Vec<Vec<f64>> = (0..b).map(|_| (0..t).map(|_| -4.0 * next() - 0.01).collect()).collect();
            let mut other: Vec<Vec<f64>> =
                logp.iter().map(|r| r.iter().map(|x| x - (2.0 * next() - 1.0) * 0.8).collect()).collect();
            non_positive_rows(&mut logp, &mut other);
            let mut mask: Vec<Vec<bool>> = (0..b).map(|_| (0..t).map(|_| next() < 0.8).collect()).collect();
            for row in &mut mask {
                row[0] = true;
            }
            let weights = (0..b).map(|_| 4.0 * next() - 2.0).collect();
            Batch { logp, other, mask, weights }
        })
        .collect()
}

fn mask01(mask: &[Vec<bool>]) -> Vec<Vec<f64>> {
    mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect()
}

fn per_token(b: &Batch) -> Vec<Vec<f64>> {
    b.weights.iter().zip(&b.mask).map(|(a, r)| vec![*a; r.len()]).collect()
}

fn verl_mode(mode: AggregationMode) -> &'static str {
    match mode {
        AggregationMode::TokenMean => "token-mean",
        AggregationMode::SeqMeanTokenSum => "seq-mean-token-sum",
        AggregationMode::SeqMeanTokenMean => "seq-mean-token-mean",
        other => unreachable!("{other:?}"),
    }
}

#[test]
fn gmpo_matches_verl() {
    let batches = peer_batches();
    let clips = [(0.4, 0.4), (0.2, 0.28)];
    let mut calls = Vec::new();
    for b in &batches {
        for (lo, hi) in clips {
            calls.push(json!({"fn": "verl.geo_mean", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": per_token(b), "mask": mask01(&b.mask), "clip_low": lo, "clip_high": hi}}));
        }
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    for b in &batches {
        for (lo, hi) in clips {
            let r = results.next().unwrap();
            let (v, g) = run_gmpo(b, &GmpoConfig::gmpo().with_clip(lo, hi), 0.0);
            // verl divides the log-ratio sum and the advantage sum by L_i + 1e-8.
            assert_close(&[v], &json_f64(&r["value"]), 1e-7, &format!("({lo}, {hi}) value"));
            assert_close(&g, &json_f64(&r["grad"]), 1e-7, &format!("({lo}, {hi}) grad"));
        }
    }
}

#[test]
fn clip_cov_matches_verl_with_the_same_seed() {
    // verl draws the cut tokens with `torch.randperm(|C|)` on the global generator after the
    // peer's `torch.manual_seed(seed)`; the same seed in this process's libtorch gives the same
    // permutation, turned into keys: the candidate at row-major position perm[p] gets key p.
    let batches = peer_batches();
    let cfgs = [
        ClipCovConfig::clip_cov().with_band(0.05, 2.0).with_ratio(0.2),
        ClipCovConfig::clip_cov()
            .with_clip(0.2, 0.28)
            .with_band(-0.5, 0.5)
            .with_ratio(0.3)
            .with_aggregation(AggregationMode::SeqMeanTokenSum),
    ];
    let mut calls = Vec::new();
    for (k, b) in batches.iter().enumerate() {
        for cfg in &cfgs {
            calls.push(json!({"fn": "verl.clip_cov", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": per_token(b), "mask": mask01(&b.mask), "clip_low": cfg.clip_low, "clip_high": cfg.clip_high, "ratio": cfg.ratio, "lb": cfg.cov_low, "ub": cfg.cov_high, "loss_agg_mode": verl_mode(cfg.aggregation), "seed": 1000 + k}}));
        }
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    let mut cut_some = 0;
    for (k, b) in batches.iter().enumerate() {
        for cfg in &cfgs {
            let r = results.next().unwrap();
            // The candidates by the definition (the keys do not change them), in row-major order.
            let no_keys = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
            let (_, _, all) = ref_clip_cov(b, &no_keys, &cfg.with_ratio(1.0)).expect("no covariance on a band end");
            tch::manual_seed(1000 + k as i64);
            let perm = Tensor::randperm(all.len() as i64, (Kind::Int64, tch::Device::Cpu));
            let mut keys = vec![vec![f64::MAX; b.mask[0].len()]; b.mask.len()];
            for (p, j) in Vec::<i64>::try_from(&perm).unwrap().into_iter().enumerate() {
                let (i, t) = all[j as usize];
                keys[i][t] = p as f64;
            }
            let (v, g) = run_clip_cov(b, &keys, cfg, 0.0);
            let (_, _, cut) = ref_clip_cov(b, &keys, cfg).unwrap();
            cut_some += usize::from(!cut.is_empty() && cut.len() < all.len());
            assert_close(&[v], &json_f64(&r["value"]), 1e-10, &format!("batch {k} {cfg:?} value"));
            assert_close(&g, &json_f64(&r["grad"]), 1e-10, &format!("batch {k} {cfg:?} grad"));
            let (lp, old, adv, m) = b.tensors(0.0);
            let d = clip_cov_loss_output(&lp, &old, &adv, &m, &t2(&keys), cfg, &Normalizer::local())
                .unwrap()
                .diagnostics
                .read()
                .unwrap();
            assert_close(&[d.clip_fraction], &json_f64(&r["pg_clipfrac"]), 1e-7, "pg_clipfrac");
        }
    }
    assert!(cut_some >= 4, "too few cases where the random choice mattered: {cut_some}");
}

#[test]
fn kl_cov_matches_verl() {
    let batches = peer_batches();
    let cfgs = [
        KlCovConfig::kl_cov(),
        KlCovConfig::kl_cov().with_ratio(0.3).with_coef(1.0),
        KlCovConfig::kl_cov().with_ratio(0.6).with_coef(0.5).with_aggregation(AggregationMode::SeqMeanTokenSum),
        KlCovConfig::kl_cov().with_ratio(0.2).with_aggregation(AggregationMode::SeqMeanTokenMean),
    ];
    let mut calls = Vec::new();
    for b in &batches {
        for cfg in &cfgs {
            calls.push(json!({"fn": "verl.kl_cov", "args": {"logp": b.logp, "logp_mu": b.other, "advantages": per_token(b), "mask": mask01(&b.mask), "ratio": cfg.ratio, "coef": cfg.coef, "loss_agg_mode": verl_mode(cfg.aggregation)}}));
        }
    }
    let Some(results) = peer(&calls) else { return };
    let mut results = results.into_iter();
    for b in &batches {
        for cfg in &cfgs {
            let r = results.next().unwrap();
            let (v, g) = run_kl_cov(b, cfg, 0.0);
            // verl's seq-mean-token-mean divides by L_i + 1e-8.
            let tol = if cfg.aggregation == AggregationMode::SeqMeanTokenMean { 1e-7 } else { 1e-10 };
            assert_close(&[v], &json_f64(&r["value"]), tol, &format!("{cfg:?} value"));
            assert_close(&g, &json_f64(&r["grad"]), tol, &format!("{cfg:?} grad"));
        }
    }
}

#[test]
fn huge_advantages_are_a_typed_error_in_f32() {
    let lp = Tensor::from_slice2(&[[-1.0f32, -1.5]]);
    let old = Tensor::from_slice2(&[[-1.2f32, -1.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let adv = Tensor::from_slice(&[3.0e38f32]);
    let sum = AggregationMode::TokenSum;
    let f32_overflow = LossError::NonFiniteLoss { compute_dtype: "f32" };
    let e = gmpo_loss(&lp, &old, &adv, &m, &GmpoConfig::gmpo().with_aggregation(sum)).unwrap_err();
    assert_eq!(e, f32_overflow);
    let keys = Tensor::from_slice2(&[[0.1f32, 0.2]]);
    let e = clip_cov_loss(&lp, &old, &adv, &m, &keys, &ClipCovConfig::clip_cov().with_aggregation(sum)).unwrap_err();
    assert_eq!(e, f32_overflow);
    let e = kl_cov_loss(&lp, &old, &adv, &m, &KlCovConfig::kl_cov().with_aggregation(sum)).unwrap_err();
    assert_eq!(e, f32_overflow);
    // The same in f64 is finite.
    let d = |t: &Tensor| t.to_kind(Kind::Double);
    let loss = kl_cov_loss(&d(&lp), &d(&old), &d(&adv), &m, &KlCovConfig::kl_cov().with_aggregation(sum)).unwrap();
    assert!(scalar(&loss).is_finite());
}

#[test]
fn shape_checks_read_nothing_back() {
    use topr_loss::{Checks, EntropyConfig, SapoConfig, entropy_loss, host_reads, sapo_loss, top_entropy_mask};
    let lp = Tensor::from_slice2(&[[-1.0f32, -1.5, f32::NAN], [-0.3, -2.0, -0.1]]);
    let old = Tensor::from_slice2(&[[-1.2f32, -1.0, 0.0], [-0.5, -2.5, -0.2]]);
    let m = Tensor::from_slice2(&[[true, true, false], [true, true, true]]);
    let adv = Tensor::from_slice(&[1.0f32, -0.5]);
    // Fixed keys: the peer test seeds the global generator, which this test must not draw from.
    let keys = Tensor::from_slice2(&[[0.3f32, 0.1, 0.2], [0.6, 0.5, 0.4]]);
    let s = Checks::Shapes;
    let before = host_reads();
    let losses = [
        sapo_loss(&lp, &old, &adv, &m, &SapoConfig::sapo().with_checks(s)).unwrap(),
        gmpo_loss(&lp, &old, &adv, &m, &GmpoConfig::gmpo().with_checks(s)).unwrap(),
        clip_cov_loss(&lp, &old, &adv, &m, &keys, &ClipCovConfig::clip_cov().with_checks(s)).unwrap(),
        kl_cov_loss(&lp, &old, &adv, &m, &KlCovConfig::kl_cov().with_checks(s)).unwrap(),
        entropy_loss(&lp.abs(), &m, &EntropyConfig::bonus().with_checks(s)).unwrap(),
        top_entropy_mask(&lp.abs(), &m, 0.2, s).unwrap(),
    ];
    assert_eq!(host_reads(), before);
    assert!(losses[..5].iter().all(|l| scalar(l).is_finite()));
}
