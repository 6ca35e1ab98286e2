//! TOPR's successors: BAPO's adaptive clip window, CTPO's prefix importance ratio, LENS's
//! confidence-calibrated rewards. BAPO and CTPO against the official code's lines restated
//! (`tests/reference/peer_successors.py`: window, values, gradients, clip fractions) and scalar
//! references with NaN padding; CTPO's documented gradient against finite differences, split
//! invariance, PPO on one-token sequences; LENS (no published code) against a scalar restatement
//! of its formulas, its properties and edge cases; extremes, half precision, host reads, errors.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::{Value, json};
use tch::{Kind, Tensor};
use topr_loss::{
    AggregationMode, BapoConfig, Checks, LensConfig, LossError, Normalizer, PpoConfig, PrefixClip, PrefixRatio,
    PrefixRatioConfig, ToprConfig, bapo_clip_bounds, bapo_loss, bapo_loss_output, host_reads, lens_advantages,
    lens_rewards, ppo_clip_loss, prefix_ratio_loss, prefix_ratio_loss_output, topr_loss,
};

fn batch() -> impl Strategy<Value = TokenBatch> {
    token_batch(1.2, (-2.0f64..2.0).boxed())
}

/// Random batches (LCG), log-ratios in ±`spread`, both log-probs at most 0, the first token real,
/// with per-token advantages beside the per-sequence ones.
fn random_batches(seed: u64, n: usize, spread: f64) -> Vec<(TokenBatch, Vec<Vec<f64>>)> {
    let mut next = uniform_stream(seed);
    (0..n)
        .map(|k| {
            let (rows, t) = (2 + k % 3, 3 + k % 4);
            let b = random_token_batch(&mut next, rows, t, spread);
            let per_token = (0..rows).map(|_| (0..t).map(|_| 4.0 * next() - 2.0).collect()).collect();
            (b, per_token)
        })
        .collect()
}

fn mask01(b: &TokenBatch) -> Vec<Vec<f64>> {
    b.mask.iter().map(|r| r.iter().map(|m| f64::from(u8::from(*m))).collect()).collect()
}

/// verl's per-sequence token mean divides by `L + 1e-8`: differences of about 1e-9 there.
fn value_tolerance(mode: AggregationMode) -> f64 {
    if mode == AggregationMode::SeqMeanTokenMean { 1e-7 } else { 1e-12 }
}

fn verl_mode(mode: AggregationMode) -> &'static str {
    match mode {
        AggregationMode::TokenMean => "token-mean",
        AggregationMode::SeqMeanTokenMean => "seq-mean-token-mean",
        AggregationMode::SeqMeanTokenSum => "seq-mean-token-sum",
        other => unreachable!("no verl name used here for {other:?}"),
    }
}

/// The value and gradient of `loss` with per-token advantages.
fn value_and_grad_per_token(
    b: &TokenBatch,
    adv: &[Vec<f64>],
    loss: &dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Tensor,
) -> (f64, Vec<f64>) {
    let (lp, old, _, m) = b.tensors(0.0);
    let lp = leaf(&lp);
    let l = loss(&lp, &old, &t2(adv), &m);
    l.backward();
    (scalar(&l), vec1(&lp.grad()))
}

/// `max(u, c)` with its derivative, a tie splitting the gradient in two (torch's `maximum`).
fn ref_max((u, gu): (f64, f64), (c, gc): (f64, f64)) -> (f64, f64) {
    if u > c {
        (u, gu)
    } else if c > u {
        (c, gc)
    } else {
        (u, (gu + gc) / 2.0)
    }
}

/// The PPO-form token loss `max(−A w, −A w̃)`, capped at `−A cap` where `A < 0`, and its
/// derivative from `∂w` and `∂w̃` (the derivatives of the weight and of its clipped value).
fn ref_ppo_form(a: f64, (w, dw): (f64, f64), (wc, dwc): (f64, f64), cap: Option<f64>) -> (f64, f64) {
    let (mut v, mut g) = ref_max((-a * w, -a * dw), (-a * wc, -a * dwc));
    if let Some(c) = cap {
        if a < 0.0 && v > -a * c {
            (v, g) = (-a * c, 0.0);
        }
    }
    (v, g)
}

// ---------------------------------------------------------------------------------------------
// BAPO
// ---------------------------------------------------------------------------------------------

/// The official loops on a scalar table: `(c_low, c_high, balance, steps)`.
fn ref_bapo_window(b: &TokenBatch, adv: &[Vec<f64>], cfg: &BapoConfig) -> (f64, f64, f64, i64) {
    let balance = |lo: f64, hi: f64| {
        let (mut p, mut n) = (0.0, 0.0);
        for (i, row) in b.mask.iter().enumerate() {
            for t in (0..row.len()).filter(|&t| row[t]) {
                let r = (b.logp[i][t] - b.other[i][t]).clamp(-cfg.max_log_ratio, cfg.max_log_ratio).exp();
                let a = adv[i][t];
                if a >= 0.0 {
                    p += r.min(hi) * a;
                } else {
                    n += r.max(lo) * -a;
                }
            }
        }
        if n <= 0.0 { f64::INFINITY } else { p / (n + cfg.eps) }
    };
    let (mut lo, mut hi, mut steps) = (cfg.lower_start, cfg.upper_start, 0);
    let mut q = balance(lo, hi);
    while q < cfg.target && lo < cfg.lower_max && cfg.lower_step > 0.0 {
        lo = (lo + cfg.lower_step).min(cfg.lower_max);
        steps += 1;
        q = balance(lo, hi);
    }
    while q < cfg.target && hi < cfg.upper_max && cfg.upper_step > 0.0 {
        hi = (hi + cfg.upper_step).min(cfg.upper_max);
        steps += 1;
        q = balance(lo, hi);
    }
    (lo, hi, q, steps)
}

/// BAPO's loss and gradient by the formula, with the window of [`ref_bapo_window`].
fn ref_bapo(b: &TokenBatch, adv: &[Vec<f64>], cfg: &BapoConfig) -> (f64, Vec<f64>) {
    let (lo, hi, _, _) = ref_bapo_window(b, adv, cfg);
    let al = ref_alpha(&b.mask, cfg.aggregation, None);
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        for t in (0..row.len()).filter(|&t| row[t]) {
            let d = b.logp[i][t] - b.other[i][t];
            let r = d.clamp(-cfg.max_log_ratio, cfg.max_log_ratio).exp();
            let dr = if d.abs() <= cfg.max_log_ratio { r } else { 0.0 };
            let inside = (lo..=hi).contains(&r);
            let (v, g) =
                ref_ppo_form(adv[i][t], (r, dr), (r.clamp(lo, hi), if inside { dr } else { 0.0 }), cfg.dual_clip);
            value += al[i] * v;
            grad[i][t] = al[i] * g;
        }
    }
    (value, grad.concat())
}

fn per_sequence(b: &TokenBatch) -> Vec<Vec<f64>> {
    b.weights.iter().zip(&b.mask).map(|(a, m)| vec![*a; m.len()]).collect()
}

fn bapo_configs() -> Vec<BapoConfig> {
    vec![
        BapoConfig::paper(),
        BapoConfig::recipe(),
        BapoConfig::paper().with_target(3.0),
        BapoConfig::paper().with_positive_share(0.3).with_aggregation(AggregationMode::SeqMeanTokenMean),
        BapoConfig::paper().with_lower(0.7, 0.7, 0.0).with_upper(1.1, 1.6, 0.1).with_dual_clip(None),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn bapo_matches_scalar_reference_with_nan_padding(b in batch()) {
        let adv = per_sequence(&b);
        for cfg in bapo_configs() {
            let got = value_and_grad(&b, f64::NAN, &|lp, old, a, m| bapo_loss(lp, old, a, m, &cfg).unwrap());
            assert_matches_reference(&b, &got, &ref_bapo(&b, &adv, &cfg), &format!("{cfg:?}"));
            let (lp, old, a, m) = b.tensors(f64::NAN);
            let w = bapo_clip_bounds(&lp, &old, &a, &m, &cfg).unwrap().read().unwrap();
            let (lo, hi, q, steps) = ref_bapo_window(&b, &adv, &cfg);
            prop_assert_eq!((w.c_low, w.c_high, w.steps), (lo, hi, steps));
            prop_assert!(q == w.balance || (q - w.balance).abs() <= 1e-12 * q.abs().max(1.0), "{} vs {}", w.balance, q);
        }
    }

    #[test]
    fn bapos_lower_bound_goes_to_its_maximum_whenever_the_start_misses(b in batch()) {
        // A negative token clipped at c_low still adds c_low |A| to N: raising c_low never raises
        // the balance, so the official search can only meet the target with the upper bound.
        let cfg = BapoConfig::paper().with_target(1.5);
        let (lp, old, a, m) = b.tensors(0.0);
        let start = cfg.with_lower(0.6, 0.6, 0.0).with_upper(1.2, 1.2, 0.0);
        let first = bapo_clip_bounds(&lp, &old, &a, &m, &start).unwrap().read().unwrap();
        let w = bapo_clip_bounds(&lp, &old, &a, &m, &cfg).unwrap().read().unwrap();
        if first.balance < cfg.target {
            prop_assert_eq!(w.c_low, 0.9);
        } else {
            prop_assert_eq!((w.c_low, w.c_high, w.steps), (0.6, 1.2, 0));
        }
    }
}

#[test]
fn bapo_matches_the_official_search_and_loss() {
    let batches = random_batches(0xba90, 8, 1.0);
    let configs = bapo_configs();
    let calls: Vec<Value> = configs
        .iter()
        .flat_map(|cfg| batches.iter().map(move |b| (cfg, b)))
        .map(|(cfg, (b, adv))| {
                json!({"fn": "bapo.loss", "args": {"logp": b.logp, "logp_old": b.other, "advantages": adv, "mask": mask01(b),
                "lower_start": cfg.lower_start, "lower_max": cfg.lower_max, "lower_step": cfg.lower_step,
                "upper_start": cfg.upper_start, "upper_max": cfg.upper_max, "upper_step": cfg.upper_step,
                "target": cfg.target, "eps": cfg.eps, "clip_ratio_c": cfg.dual_clip.unwrap_or(1e300),
                "loss_agg_mode": verl_mode(cfg.aggregation)}})
        })
        .collect();
    let Some(want) = peer(&calls) else { return };
    for (cfg, want) in configs.iter().zip(want.chunks(batches.len())) {
        let mut searched = 0;
        for ((b, adv), w) in batches.iter().zip(want) {
            let what = format!("{cfg:?}");
            let got = value_and_grad_per_token(b, adv, &|lp, old, a, m| bapo_loss(lp, old, a, m, cfg).unwrap());
            let tol = value_tolerance(cfg.aggregation);
            assert_close(&[got.0], &json_f64(&w["value"]), tol, &format!("{what} value"));
            assert_close(&got.1, &json_f64(&w["grad"]), tol, &format!("{what} grad"));
            let (lp, old, _, m) = b.tensors(0.0);
            let out = bapo_loss_output(&lp, &old, &t2(adv), &m, cfg, &Normalizer::local()).unwrap();
            let d = out.diagnostics.read().unwrap();
            let bounds = bapo_clip_bounds(&lp, &old, &t2(adv), &m, cfg).unwrap().read().unwrap();
            assert_eq!((d.c_low, d.c_high), (json_f64(&w["c_low"])[0], json_f64(&w["c_high"])[0]), "{what}");
            assert_eq!(bounds.steps as f64, json_f64(&w["steps"])[0], "{what}");
            searched += usize::from(bounds.steps > 0);
            let (pos, neg) = (json_f64(&w["positive"])[0], json_f64(&w["negative"])[0]);
            assert_close(&[bounds.positive, bounds.negative], &[pos, neg], 1e-12, &format!("{what} P, N"));
            // JSON writes an infinite balance (no negative contribution) as a number too large
            // to read; compare it only when finite.
            if neg > 0.0 {
                assert_close(&[d.balance], &json_f64(&w["balance"]), 1e-12, &format!("{what} balance"));
            } else {
                assert!(d.balance.is_infinite(), "{what}");
            }
            // verl's masked mean divides by `count + 1e-8`.
            assert_close(&[d.clip_fraction], &json_f64(&w["clip_fraction"]), 1e-7, &format!("{what} clip"));
            if cfg.dual_clip.is_some() {
                assert_close(
                    &[d.dual_clip_fraction],
                    &json_f64(&w["dual_clip_fraction"]),
                    1e-7,
                    &format!("{what} dual"),
                );
            }
        }
        assert!(searched > 0 || cfg.lower_step == 0.0 && cfg.upper_step == 0.0, "{cfg:?}: no search was exercised");
    }
}

#[test]
fn bapo_with_a_fixed_window_is_ppo_with_dual_clip() {
    let b = fixed_token_batch();
    for kind in [Kind::Double, Kind::Float] {
        for (lo, hi) in [(0.8, 1.2), (0.6, 1.28), (0.5, 2.0)] {
            let cfg = BapoConfig::paper().with_lower(lo, lo, 0.05).with_upper(hi, hi, 0.05);
            let ppo = PpoConfig::ppo().with_clip(1.0 - lo, hi - 1.0).with_dual_clip(Some(3.0));
            let (lp, old, a, m) = b.tensors(0.0);
            let (lp, old, a) = (lp.to_kind(kind), old.to_kind(kind), a.to_kind(kind));
            let (x, y) = (leaf(&lp), leaf(&lp));
            let l1 = bapo_loss(&x, &old, &a, &m, &cfg).unwrap();
            let l2 = ppo_clip_loss(&y, &old, &a, &m, &ppo).unwrap();
            l1.backward();
            l2.backward();
            // `1 − (1 − c_low)` is exact for c_low ≥ 0.5: the same bounds, bit for bit.
            assert_eq!(scalar(&l1), scalar(&l2), "{kind:?} ({lo}, {hi})");
            assert_eq!(vec1(&x.grad()), vec1(&y.grad()), "{kind:?} ({lo}, {hi})");
        }
    }
}

#[test]
fn bapo_gradient_matches_finite_differences() {
    // The window is a stop-gradient statistic; away from a step of the search the loss is
    // PPO-clip, and the gradient its derivative.
    let b = fixed_token_batch();
    for cfg in [BapoConfig::paper(), BapoConfig::recipe().with_target(0.5)] {
        let (_, g) = value_and_grad(&b, 0.0, &|lp, old, a, m| bapo_loss(lp, old, a, m, &cfg).unwrap());
        assert_gradient_matches_finite_differences(
            &b,
            &g,
            &|lp, old, a, m| bapo_loss(lp, old, a, m, &cfg).unwrap(),
            &format!("{cfg:?}"),
        );
    }
}

#[test]
fn bapo_edge_cases() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0, -0.5]]);
    let mu = Tensor::from_slice2(&[[-2.0f64, -1.0, -0.5]]);
    let m = Tensor::from_slice2(&[[true, true, false]]);
    let cfg = BapoConfig::paper();
    // Only positive (or zero) advantages: N = 0, the balance is infinite and nothing moves.
    for adv in [Tensor::from_slice(&[1.0f64]), Tensor::from_slice(&[0.0f64])] {
        let w = bapo_clip_bounds(&lp, &mu, &adv, &m, &cfg).unwrap().read().unwrap();
        assert_eq!((w.c_low, w.c_high, w.steps, w.negative), (0.6, 1.2, 0, 0.0));
        assert_eq!(w.balance, f64::INFINITY);
    }
    // Only negative advantages: P = 0, the target is never met: both bounds at their maximum.
    let w = bapo_clip_bounds(&lp, &mu, &Tensor::from_slice(&[-1.0f64]), &m, &cfg).unwrap().read().unwrap();
    assert_eq!((w.c_low, w.c_high, w.positive, w.balance), (0.9, 3.0, 0.0, 0.0));
    assert_eq!(w.steps, 6 + 37);
    // A target of 0 is met at the start.
    let w =
        bapo_clip_bounds(&lp, &mu, &Tensor::from_slice(&[-1.0f64]), &m, &cfg.with_target(0.0)).unwrap().read().unwrap();
    assert_eq!((w.c_low, w.c_high, w.steps), (0.6, 1.2, 0));
    // Padding holding NaN changes nothing.
    let nan = Tensor::from_slice2(&[[-1.0f64, -2.0, f64::NAN]]);
    let a = Tensor::from_slice2(&[[1.0f64, -0.5, f64::NAN]]);
    let w1 = bapo_clip_bounds(&nan, &mu, &a, &m, &cfg).unwrap().read().unwrap();
    let w2 = bapo_clip_bounds(&lp, &mu, &a.nan_to_num(0.0, None, None), &m, &cfg).unwrap().read().unwrap();
    assert_eq!(w1, w2);
}

#[test]
fn bapo_reads_nothing_back_under_shape_checks() {
    let b = fixed_token_batch();
    let (lp, old, a, m) = b.tensors(0.0);
    let lp = leaf(&lp);
    let fast = BapoConfig::paper().with_checks(Checks::Shapes);
    let before = host_reads();
    let loss = bapo_loss(&lp, &old, &a, &m, &fast).unwrap();
    let out = bapo_loss_output(&lp, &old, &a, &m, &fast, &Normalizer::local()).unwrap();
    let bounds = bapo_clip_bounds(&lp, &old, &a, &m, &fast).unwrap();
    assert_eq!(host_reads(), before, "the search reads nothing back");
    // Under full checks: the reads of PPO-clip's checks, none more for the search.
    let before = host_reads();
    let full = bapo_loss(&lp, &old, &a, &m, &BapoConfig::paper()).unwrap();
    let bapo_reads = host_reads() - before;
    let before = host_reads();
    let _ = ppo_clip_loss(&lp, &old, &a, &m, &PpoConfig::ppo()).unwrap();
    assert_eq!(bapo_reads, host_reads() - before);
    assert_eq!(scalar(&loss), scalar(&full));
    assert_eq!(out.diagnostics.read().unwrap().c_low, bounds.read().unwrap().c_low);
}

// ---------------------------------------------------------------------------------------------
// The prefix ratio (CTPO)
// ---------------------------------------------------------------------------------------------

/// CTPO's loss and documented gradient by the formula, per token and per sequence.
fn ref_prefix(
    b: &TokenBatch,
    adv: &[Vec<f64>],
    cfg: &PrefixRatioConfig,
    global: Option<(f64, f64)>,
) -> (f64, Vec<f64>) {
    let al = ref_alpha(&b.mask, cfg.aggregation, global);
    let cap_log = cfg.max_log_weight;
    let mut value = 0.0;
    let mut grad = vec![vec![0.0; b.mask[0].len()]; b.mask.len()];
    for (i, row) in b.mask.iter().enumerate() {
        let (mut sum, mut n) = (0.0, 0.0);
        for t in (0..row.len()).filter(|&t| row[t]) {
            n += 1.0;
            sum += (b.logp[i][t] - b.other[i][t]).clamp(-cfg.max_log_ratio, cfg.max_log_ratio);
            let k = if cfg.ratio == PrefixRatio::GeometricMean { sum / n } else { sum };
            let log_w = k.min(cap_log);
            let w = log_w.exp();
            // ∂w_t/∂log π_t = w_t below the cap (the prefix is a constant to the gradient).
            let dw = if k <= cap_log { w } else { 0.0 };
            let (clipped, cap) = match cfg.clip {
                PrefixClip::Ratio { clip_low, clip_high, dual_clip } => {
                    let (lo, hi) = (1.0 - clip_low, 1.0 + clip_high);
                    let inside = w >= lo && w <= hi;
                    ((w.clamp(lo.max(0.0), hi), if inside { dw } else { 0.0 }), dual_clip)
                }
                PrefixClip::LengthAdaptive { log_low, log_high, log_dual, power } => {
                    let s = n.max(1.0).powf(power);
                    let (lo, hi) = (-log_low * s, log_high * s);
                    let inside = log_w >= lo && log_w <= hi;
                    ((log_w.clamp(lo, hi).exp(), if inside { dw } else { 0.0 }), Some((log_dual * s).exp()))
                }
                _ => unreachable!(),
            };
            let (v, g) = ref_ppo_form(adv[i][t], (w, dw), clipped, cap);
            value += al[i] * v;
            grad[i][t] = al[i] * g;
        }
    }
    (value, grad.concat())
}

fn prefix_configs() -> Vec<PrefixRatioConfig> {
    vec![
        PrefixRatioConfig::ctpo_la(),
        PrefixRatioConfig::ctpo(),
        PrefixRatioConfig::ctpo_geomean_la(),
        PrefixRatioConfig::ctpo()
            .with_ratio(PrefixRatio::GeometricMean)
            .with_aggregation(AggregationMode::SeqMeanTokenMean),
        PrefixRatioConfig::ctpo_la()
            .with_clip(PrefixClip::LengthAdaptive { log_low: 0.2, log_high: 0.1, log_dual: 0.3, power: 0.75 })
            .with_max_log_weight(1.5)
            .with_aggregation(AggregationMode::SeqMeanTokenSum),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn prefix_ratio_matches_scalar_reference_with_nan_padding(b in batch()) {
        let adv = per_sequence(&b);
        for cfg in prefix_configs() {
            let got = value_and_grad(&b, f64::NAN, &|lp, old, a, m| prefix_ratio_loss(lp, old, a, m, &cfg).unwrap());
            assert_matches_reference(&b, &got, &ref_prefix(&b, &adv, &cfg, None), &format!("{cfg:?}"));
        }
    }

    #[test]
    fn prefix_ratio_split_into_micro_batches_with_global_counts_is_exact(b in batch(), split in 1usize..5) {
        for base in [PrefixRatioConfig::ctpo_la(), PrefixRatioConfig::ctpo_geomean_la()] {
            assert_split_invariant(&b, split, "prefix ratio", &|lp, old, a, m, mode, norm| {
                let cfg = base.with_aggregation(mode);
                match norm {
                    Some(n) => prefix_ratio_loss_output(lp, old, a, m, &cfg, n).map(|o| o.loss),
                    None => prefix_ratio_loss(lp, old, a, m, &cfg),
                }
            });
        }
    }

    #[test]
    fn prefix_ratio_on_policy_is_the_policy_gradient(b in batch()) {
        // Every prefix ratio is 1, inside every window: the gradient is −α A per token.
        let on = TokenBatch { other: b.logp.clone(), ..b.clone() };
        for cfg in prefix_configs() {
            let (_, g) = value_and_grad(&on, 0.0, &|lp, old, a, m| prefix_ratio_loss(lp, old, a, m, &cfg).unwrap());
            let al = ref_alpha(&on.mask, cfg.aggregation, None);
            let mut want = Vec::new();
            for (i, row) in on.mask.iter().enumerate() {
                want.extend(row.iter().map(|&real| if real { -al[i] * on.weights[i] } else { 0.0 }));
            }
            assert_close(&g, &want, 1e-12, &format!("{cfg:?}"));
        }
    }
}

#[test]
fn prefix_ratio_matches_ctpos_lines() {
    let batches = random_batches(0xc790, 8, 0.4);
    // CTPO's cap is fixed at 10: the configs with another cap have no peer setting.
    let configs: Vec<PrefixRatioConfig> = prefix_configs().into_iter().filter(|c| c.max_log_weight == 10.0).collect();
    let call = |cfg: &PrefixRatioConfig, b: &TokenBatch, adv: &[Vec<f64>]| {
        let (la, (cl, ch, c), (ll, lh, lc, p)) = match cfg.clip {
            PrefixClip::Ratio { clip_low, clip_high, dual_clip } => {
                (false, (clip_low, clip_high, dual_clip.unwrap()), (0.0, 0.0, 0.0, 0.0))
            }
            PrefixClip::LengthAdaptive { log_low, log_high, log_dual, power } => {
                (true, (0.2, 0.2, 3.0), (log_low, log_high, log_dual, power))
            }
            _ => unreachable!(),
        };
        let ratio_mode = if cfg.ratio == PrefixRatio::GeometricMean { "geomean" } else { "cumprod" };
        json!({"fn": "ctpo.loss", "args": {"logp": b.logp, "logp_old": b.other, "advantages": adv, "mask": mask01(b),
        "ratio_mode": ratio_mode, "length_adaptive": la, "clip_low": cl, "clip_high": ch, "clip_ratio_c": c,
        "la_clip_low": ll, "la_clip_high": lh, "la_clip_c": lc, "la_power": p,
        "loss_agg_mode": verl_mode(cfg.aggregation)}})
    };
    let calls: Vec<Value> =
        configs.iter().flat_map(|cfg| batches.iter().map(move |(b, adv)| call(cfg, b, adv))).collect();
    let Some(want) = peer(&calls) else { return };
    for (cfg, want) in configs.iter().zip(want.chunks(batches.len())) {
        let mut clipped = 0.0;
        for ((b, adv), w) in batches.iter().zip(want) {
            let what = format!("{cfg:?}");
            let got = value_and_grad_per_token(b, adv, &|lp, old, a, m| prefix_ratio_loss(lp, old, a, m, cfg).unwrap());
            let tol = value_tolerance(cfg.aggregation);
            assert_close(&[got.0], &json_f64(&w["value"]), tol, &format!("{what} value"));
            assert_close(&got.1, &json_f64(&w["grad"]), tol, &format!("{what} grad"));
            let (lp, old, _, m) = b.tensors(0.0);
            let d = prefix_ratio_loss_output(&lp, &old, &t2(adv), &m, cfg, &Normalizer::local()).unwrap();
            let d = d.diagnostics.read().unwrap();
            assert_close(&[d.clip_fraction], &json_f64(&w["clip_fraction"]), 1e-7, &format!("{what} clip"));
            assert_close(&[d.dual_clip_fraction], &json_f64(&w["dual_clip_fraction"]), 1e-7, &format!("{what} dual"));
            clipped += d.clip_fraction;
        }
        assert!(clipped > 0.0, "{cfg:?}: the clip was never exercised");
    }
}

#[test]
fn prefix_ratio_gradient_matches_finite_differences() {
    // The documented gradient is ∂ℓ_t/∂log π_t with every other token's term held: finite
    // differences of the value, taken with μ at the next real token of the row moved with π at
    // this one (so every later prefix, and hence every later term, stays as it was). With the
    // geometric mean the log-weight's value moves by 1/n_t per unit of log π_t and its gradient
    // by 1 (CTPO's `sg(K_t) + log π_t − sg(log π_t)`, as GSPO's token form): the gradient is
    // n_t times that derivative.
    let b = fixed_token_batch();
    for cfg in prefix_configs() {
        let (_, g) = value_and_grad(&b, 0.0, &|lp, old, a, m| prefix_ratio_loss(lp, old, a, m, &cfg).unwrap());
        let t = b.mask[0].len();
        let h = 1e-6;
        let fd: Vec<f64> = (0..b.mask.len() * t)
            .map(|k| {
                let (i, j) = (k / t, k % t);
                if !b.mask[i][j] {
                    return 0.0;
                }
                let next = (j + 1..t).find(|&s| b.mask[i][s]);
                let at = |e: f64| {
                    let mut bb = b.clone();
                    bb.logp[i][j] += e;
                    if let Some(s) = next {
                        bb.other[i][s] += e;
                    }
                    let (lp, old, a, m) = bb.tensors(0.0);
                    scalar(&prefix_ratio_loss(&lp, &old, &a, &m, &cfg).unwrap())
                };
                let n_t = b.mask[i][..=j].iter().filter(|r| **r).count() as f64;
                let scale = if cfg.ratio == PrefixRatio::GeometricMean { n_t } else { 1.0 };
                scale * (at(h) - at(-h)) / (2.0 * h)
            })
            .collect();
        assert_close(&g, &fd, 1e-6, &format!("{cfg:?} finite differences"));
    }
    // Without a clip the value's own derivative differs: a token's log-prob also moves every later
    // token's weight, which the gradient leaves out. Here the first token's derivative adds the
    // second's term: −(w_1 + w_2)/2 against the gradient's −w_1/2.
    let no_clip = PrefixClip::Ratio { clip_low: f64::INFINITY, clip_high: f64::INFINITY, dual_clip: None };
    let cfg = PrefixRatioConfig::ctpo().with_clip(no_clip);
    let two = TokenBatch {
        logp: vec![vec![-1.0, -1.0]],
        other: vec![vec![-1.2, -0.9]],
        mask: vec![vec![true, true]],
        weights: vec![1.0],
    };
    let (_, g) = value_and_grad(&two, 0.0, &|lp, old, a, m| prefix_ratio_loss(lp, old, a, m, &cfg).unwrap());
    let fd = finite_difference(&two.logp.concat(), 1e-6, |x| {
        let bb = TokenBatch { logp: vec![x.to_vec()], ..two.clone() };
        let (lp, old, a, m) = bb.tensors(0.0);
        scalar(&prefix_ratio_loss(&lp, &old, &a, &m, &cfg).unwrap())
    });
    let (w1, w2) = (0.2f64.exp(), 0.1f64.exp());
    assert_close(&g, &[-w1 / 2.0, -w2 / 2.0], 1e-12, "gradient");
    assert_close(&fd, &[-(w1 + w2) / 2.0, -w2 / 2.0], 1e-6, "the value's derivative");
}

#[test]
fn prefix_ratio_on_one_token_sequences_is_ppo() {
    let b = TokenBatch {
        logp: vec![vec![-0.7], vec![-2.0], vec![-0.5], vec![-1.0]],
        other: vec![vec![-0.9], vec![-1.2], vec![-0.2], vec![-3.0]],
        mask: vec![vec![true]; 4],
        weights: vec![1.0, -1.0, -0.5, 2.0],
    };
    for (eps_low, eps_high) in [(0.2, 0.2), (0.2, 0.28)] {
        let cfg = PrefixRatioConfig::ctpo().with_clip(PrefixClip::Ratio {
            clip_low: eps_low,
            clip_high: eps_high,
            dual_clip: Some(3.0),
        });
        let ppo = PpoConfig::ppo().with_clip(eps_low, eps_high).with_dual_clip(Some(3.0));
        let got = value_and_grad(&b, 0.0, &|lp, old, a, m| prefix_ratio_loss(lp, old, a, m, &cfg).unwrap());
        let want = value_and_grad(&b, 0.0, &|lp, old, a, m| ppo_clip_loss(lp, old, a, m, &ppo).unwrap());
        assert_close(&[got.0], &[want.0], 1e-14, "value");
        assert_close(&got.1, &want.1, 1e-14, "grad");
    }
}

#[test]
fn prefix_ratio_extreme_and_half_precision_inputs() {
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16] {
        // Prefixes of ±20 per token: the sum passes the cap (w = e^10) or sinks to w ≈ 0.
        let lp =
            Tensor::from_slice2(&[[-300.0f64, -300.0, -300.0], [0.0, 0.0, 0.0]]).to_kind(kind).set_requires_grad(true);
        let lq = Tensor::from_slice2(&[[0.0f64, 0.0, 0.0], [-300.0, -300.0, -300.0]]).to_kind(kind);
        let m = Tensor::from_slice2(&[[1i64, 1, 1], [1, 1, 1]]);
        let adv = Tensor::from_slice(&[1.0f64, -1.0]).to_kind(kind);
        for cfg in prefix_configs() {
            let loss = prefix_ratio_loss(&lp, &lq, &adv, &m, &cfg).unwrap();
            let want = if kind == Kind::Double { Kind::Double } else { Kind::Float };
            assert_eq!(loss.kind(), want, "{kind:?}");
            assert!(scalar(&loss).is_finite(), "{kind:?} {cfg:?}");
            let g = Tensor::run_backward(&[&loss], &[&lp], false, false);
            assert!(vec1(&g[0].to_kind(Kind::Double)).iter().all(|g| g.is_finite()), "{kind:?} {cfg:?}");
            let d = prefix_ratio_loss_output(&lp, &lq, &adv, &m, &cfg, &Normalizer::local()).unwrap();
            let d = d.diagnostics.read().unwrap();
            assert!(d.ratio_max <= 10f64.exp() * (1.0 + 1e-6) && d.log_ratio_mean.is_finite(), "{d:?}");
        }
    }
    // BAPO on the same extremes.
    for kind in [Kind::Float, Kind::Half] {
        let lp =
            Tensor::from_slice2(&[[-300.0f64, 0.0, -3.0], [0.0, -300.0, -1.0]]).to_kind(kind).set_requires_grad(true);
        let lq = Tensor::from_slice2(&[[0.0f64, -300.0, -3.0], [-300.0, 0.0, -1.0]]).to_kind(kind);
        let m = Tensor::from_slice2(&[[1i64, 1, 1], [1, 1, 1]]);
        let adv = Tensor::from_slice(&[1.0f64, -1.0]).to_kind(kind);
        let loss = bapo_loss(&lp, &lq, &adv, &m, &BapoConfig::paper()).unwrap();
        assert_eq!(loss.kind(), Kind::Float);
        assert!(scalar(&loss).is_finite());
    }
}

#[test]
fn prefix_ratio_reads_nothing_back_under_shape_checks() {
    let b = fixed_token_batch();
    let (lp, old, a, m) = b.tensors(f64::NAN);
    let before = host_reads();
    let cfg = PrefixRatioConfig::ctpo_la().with_checks(Checks::Shapes);
    let loss = prefix_ratio_loss(&leaf(&lp), &old, &a, &m, &cfg).unwrap();
    assert_eq!(host_reads(), before);
    assert!(scalar(&loss).is_finite()); // NaN padding: its δ is 0 under either checks level
}

#[test]
fn bad_configs_are_errors_naming_the_field() {
    let lp = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let m = Tensor::from_slice2(&[[true, true]]);
    let a = Tensor::from_slice(&[1.0f64]);
    let p = BapoConfig::paper();
    for (cfg, field) in [
        (p.with_lower(-0.1, 0.9, 0.05), "lower_start"),
        (p.with_lower(0.6, 1.1, 0.05), "lower_max"),
        (p.with_lower(0.6, 0.9, f64::NAN), "lower_step"),
        (p.with_upper(0.9, 3.0, 0.05), "upper_start"),
        (p.with_upper(1.2, f64::INFINITY, 0.05), "upper_max"),
        (p.with_upper(1.2, 3.0, 1e-6), "upper_step"),
        (p.with_target(-1.0), "target"),
        (p.with_eps(f64::INFINITY), "eps"),
        (p.with_dual_clip(Some(1.0)), "dual_clip"),
        (p.with_max_log_ratio(0.0), "max_log_ratio"),
    ] {
        for r in [bapo_loss(&lp, &lp, &a, &m, &cfg).map(|_| ()), bapo_clip_bounds(&lp, &lp, &a, &m, &cfg).map(|_| ())] {
            assert!(matches!(r, Err(LossError::InvalidConfig { field: f, .. }) if f == field), "{field}: {r:?}");
        }
    }
    let c = PrefixRatioConfig::ctpo_la();
    let la =
        |low, high, dual, power| PrefixClip::LengthAdaptive { log_low: low, log_high: high, log_dual: dual, power };
    for (cfg, field) in [
        (c.with_max_log_weight(0.0), "max_log_weight"),
        (c.with_max_log_weight(81.0), "max_log_weight"),
        (c.with_max_log_ratio(f64::INFINITY), "max_log_ratio"),
        (c.with_clip(la(-0.1, 0.05, 0.05, 0.5)), "log_low"),
        (c.with_clip(la(0.025, f64::NAN, 0.05, 0.5)), "log_high"),
        (c.with_clip(la(0.025, 0.05, 0.0, 0.5)), "log_dual"),
        (c.with_clip(la(0.025, 0.05, 0.05, f64::INFINITY)), "power"),
        (c.with_clip(PrefixClip::Ratio { clip_low: -0.2, clip_high: 0.2, dual_clip: None }), "clip_low"),
        (c.with_clip(PrefixClip::Ratio { clip_low: 0.2, clip_high: f64::NAN, dual_clip: None }), "clip_high"),
        (c.with_clip(PrefixClip::Ratio { clip_low: 0.2, clip_high: 0.2, dual_clip: Some(0.5) }), "dual_clip"),
    ] {
        let r = prefix_ratio_loss(&lp, &lp, &a, &m, &cfg);
        assert!(matches!(r, Err(LossError::InvalidConfig { field: f, .. }) if f == field), "{field}: {r:?}");
    }
    // Arguments are named.
    let e = bapo_loss(&lp, &lp, &Tensor::from_slice(&[1.0f64, 2.0]), &m, &p).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "advantages", .. }), "{e}");
    let e = prefix_ratio_loss(&lp, &Tensor::new(), &a, &m, &c).unwrap_err();
    assert_eq!(e, LossError::UnsupportedTensor { argument: "logp_mu", what: "undefined" });
    let e = LensConfig::lens().with_negative_weight(f64::NAN).validate().unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "negative_weight", .. }), "{e}");
}

// ---------------------------------------------------------------------------------------------
// LENS
// ---------------------------------------------------------------------------------------------

/// Groups of `K` completions with binary rewards and token log-probs, row `g·K + k`.
#[derive(Debug, Clone)]
struct Groups {
    rewards: Vec<Vec<f64>>,
    logp: Vec<Vec<f64>>,
    mask: Vec<Vec<bool>>,
}

impl Groups {
    fn tensors(&self, padding: f64) -> (Tensor, Tensor, Tensor) {
        let lp: Vec<Vec<f64>> = self
            .logp
            .iter()
            .zip(&self.mask)
            .map(|(r, m)| r.iter().zip(m).map(|(x, m)| if *m { *x } else { padding }).collect())
            .collect();
        let mask: Vec<Tensor> = self.mask.iter().map(|r| Tensor::from_slice(r)).collect();
        (t2(&self.rewards), t2(&lp), Tensor::stack(&mask, 0))
    }
}

fn groups() -> impl Strategy<Value = Groups> {
    (1usize..4, 1usize..6, 1usize..5).prop_flat_map(|(g, k, t)| {
        (
            prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.4), k), g),
            prop::collection::vec(prop::collection::vec(-3.0f64..-0.01, t), g * k),
            prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.8), t), g * k),
        )
            .prop_map(|(r, logp, mask)| Groups {
                rewards: r.iter().map(|row| row.iter().map(|c| f64::from(u8::from(*c))).collect()).collect(),
                logp,
                mask,
            })
    })
}

/// §5.1's formulas, directly (no log space): `r̃ [G][K]`.
fn ref_lens_rewards(x: &Groups) -> Vec<Vec<f64>> {
    let k = x.rewards[0].len();
    x.rewards
        .iter()
        .enumerate()
        .map(|(g, r)| {
            let rows = &x.logp[g * k..(g + 1) * k];
            let masks = &x.mask[g * k..(g + 1) * k];
            let (mut pbar, mut prob) = (vec![0.0; k], vec![0.0; k]);
            for j in 0..k {
                let real: Vec<f64> = rows[j].iter().zip(&masks[j]).filter(|(_, m)| **m).map(|(v, _)| *v).collect();
                let s: f64 = real.iter().sum();
                pbar[j] = if real.is_empty() { 1.0 } else { (s / real.len() as f64).exp() };
                prob[j] = s.exp();
            }
            let guard = 2.0 * pbar.iter().cloned().fold(f64::MIN, f64::max);
            let d = if r.contains(&1.0) {
                let d_imp = 1.0 / (r.iter().zip(&prob).map(|(r, p)| r / p).sum::<f64>() / k as f64);
                d_imp.max(guard)
            } else {
                guard
            };
            (0..k).map(|j| r[j] - (1.0 - r[j]) * (1.0 / k as f64) * pbar[j] / (d - pbar[j])).collect()
        })
        .collect()
}

/// GRPO on mixed groups, `α`-weighted centring on negative groups, 0 on positive ones.
fn ref_lens_advantages(x: &Groups, cfg: &LensConfig) -> Vec<Vec<f64>> {
    ref_lens_rewards(x)
        .iter()
        .zip(&x.rewards)
        .map(|(rt, r)| {
            let k = rt.len() as f64;
            let correct = r.iter().filter(|v| **v == 1.0).count() as f64;
            let mean = rt.iter().sum::<f64>() / k;
            let std = (rt.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (k - 1.0).max(1.0)).sqrt();
            rt.iter()
                .map(|v| {
                    if correct == k {
                        0.0
                    } else if correct == 0.0 {
                        cfg.negative_weight * (v - mean)
                    } else {
                        (v - mean) / (std + cfg.eps)
                    }
                })
                .collect()
        })
        .collect()
}

fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    let k = t.size()[1] as usize;
    vec1(t).chunks(k).map(<[f64]>::to_vec).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn lens_matches_scalar_reference_with_nan_padding(x in groups()) {
        let (r, lp, m) = x.tensors(f64::NAN);
        let got = rows(&lens_rewards(&r, &lp, &m).unwrap());
        assert_close(&got.concat(), &ref_lens_rewards(&x).concat(), 1e-10, "rewards");
        for cfg in [LensConfig::lens(), LensConfig::lens().with_negative_weight(1.0).with_eps(0.0)] {
            let got = rows(&lens_advantages(&r, &lp, &m, &cfg).unwrap());
            assert_close(&got.concat(), &ref_lens_advantages(&x, &cfg).concat(), 1e-10, "advantages");
        }
    }

    #[test]
    fn lens_properties(x in groups()) {
        let (r, lp, m) = x.tensors(0.0);
        let rt = rows(&lens_rewards(&r, &lp, &m).unwrap());
        let adv = rows(&lens_advantages(&r, &lp, &m, &LensConfig::lens()).unwrap());
        let k = x.rewards[0].len();
        for (g, (rt, r)) in rt.iter().zip(&x.rewards).enumerate() {
            let pbar: Vec<f64> = (0..k).map(|j| {
                let row = g * k + j;
                let real: Vec<f64> = x.logp[row].iter().zip(&x.mask[row]).filter(|(_, m)| **m).map(|(v, _)| *v).collect();
                if real.is_empty() { 0.0 } else { real.iter().sum::<f64>() / real.len() as f64 }
            }).collect();
            let correct = r.iter().filter(|v| **v == 1.0).count();
            for j in 0..k {
                prop_assert!((-1.0..=1.0).contains(&rt[j]));
                if r[j] == 1.0 {
                    prop_assert_eq!(rt[j], 1.0);
                } else {
                    prop_assert!(rt[j] < 0.0 && rt[j] >= -1.0 / k as f64 * (1.0 + 1e-12), "{}", rt[j]);
                }
                // Sign invariance in mixed groups: successes up, failures down.
                if correct > 0 && correct < k {
                    prop_assert!(if r[j] == 1.0 { adv[g][j] > 0.0 } else { adv[g][j] < 0.0 }, "{:?}", adv[g]);
                }
                // The more confident a failure, the larger its penalty.
                for i in 0..k {
                    if r[i] == 0.0 && r[j] == 0.0 && pbar[i] > pbar[j] + 1e-9 {
                        prop_assert!(rt[i] < rt[j]);
                    }
                }
            }
            if correct == 0 {
                // The most confident failure of a negative group gets exactly −1/K.
                let min = rt.iter().cloned().fold(f64::MAX, f64::min);
                prop_assert!((min + 1.0 / k as f64).abs() < 1e-12, "{min}");
                prop_assert!(adv[g].iter().sum::<f64>().abs() < 1e-12);
            }
            if correct == k {
                prop_assert!(adv[g].iter().all(|a| *a == 0.0));
            }
        }
    }
}

#[test]
fn lens_edge_cases() {
    let cfg = LensConfig::lens();
    // Groups of one: a failure gets −1 (D = 2 π̄), a success 1; both advantages 0.
    let x =
        Groups { rewards: vec![vec![0.0], vec![1.0]], logp: vec![vec![-0.3], vec![-2.0]], mask: vec![vec![true]; 2] };
    let (r, lp, m) = x.tensors(0.0);
    assert_eq!(vec1(&lens_rewards(&r, &lp, &m).unwrap()), vec![-1.0, 1.0]);
    assert_eq!(vec1(&lens_advantages(&r, &lp, &m, &cfg).unwrap()), vec![0.0, 0.0]);
    // All positive: r̃ = 1, A = 0. All negative: centred and weighted by α.
    let x = Groups {
        rewards: vec![vec![1.0, 1.0], vec![0.0, 0.0]],
        logp: vec![vec![-1.0], vec![-0.5], vec![-0.2], vec![-2.0]],
        mask: vec![vec![true]; 4],
    };
    let (r, lp, m) = x.tensors(0.0);
    let rt = vec1(&lens_rewards(&r, &lp, &m).unwrap());
    assert_eq!(&rt[..2], &[1.0, 1.0]);
    assert!((rt[2] + 0.5).abs() < 1e-15);
    let a = vec1(&lens_advantages(&r, &lp, &m, &cfg).unwrap());
    assert_eq!(&a[..2], &[0.0, 0.0]);
    assert!((a[2] - 0.25 * (rt[2] - rt[3]) / 2.0).abs() < 1e-15);
    // Long correct completions: 1/π_old overflows f64 (Σ log π = −6000), its log does not; the
    // guard 2 max π̄ decides and the rewards are those of D = 2 max π̄.
    let t = 2000;
    let x = Groups {
        rewards: vec![vec![1.0, 0.0, 0.0]],
        logp: vec![vec![-3.0; t], vec![-0.1; t], vec![-0.4; t]],
        mask: vec![vec![true; t]; 3],
    };
    for (kind, tol) in [(Kind::Double, 1e-12), (Kind::Float, 1e-6), (Kind::Half, 1e-3)] {
        let (r, lp, m) = x.tensors(0.0);
        let rt = lens_rewards(&r.to_kind(kind), &lp.to_kind(kind), &m).unwrap();
        assert_eq!(rt.kind(), if kind == Kind::Double { Kind::Double } else { Kind::Float });
        let rt = vec1(&rt);
        let d = 2.0 * (-0.1f64).exp();
        let want =
            [1.0, -(-0.1f64).exp() / (d - (-0.1f64).exp()) / 3.0, -(-0.4f64).exp() / (d - (-0.4f64).exp()) / 3.0];
        assert_close(&rt, &want, tol, &format!("{kind:?}"));
    }
    // A completion without a real token counts as π̄ = 1, the most confident.
    let x = Groups {
        rewards: vec![vec![0.0, 0.0]],
        logp: vec![vec![-1.0], vec![-1.0]],
        mask: vec![vec![true], vec![false]],
    };
    let (r, lp, m) = x.tensors(f64::NAN);
    let rt = vec1(&lens_rewards(&r, &lp, &m).unwrap());
    assert!((rt[1] + 0.5).abs() < 1e-15 && rt[0] > rt[1]);
}

#[test]
fn lens_arguments_are_checked_and_named() {
    let lp = Tensor::from_slice2(&[[-1.0f64], [-2.0]]);
    let m = Tensor::from_slice2(&[[true], [true]]);
    let r = Tensor::from_slice2(&[[1.0f64, 0.0]]);
    let e = lens_rewards(&Tensor::from_slice2(&[[1.0f64, 0.5]]), &lp, &m).unwrap_err();
    assert!(matches!(e, LossError::InvalidArgument { argument: "rewards", value, .. } if value == 0.5), "{e}");
    let e = lens_rewards(&Tensor::from_slice2(&[[1.0f64, 0.0, 1.0]]), &lp, &m).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "logp_old", .. }), "{e}");
    let e = lens_rewards(&r, &lp, &Tensor::from_slice2(&[[true, true], [true, true]])).unwrap_err();
    assert!(matches!(e, LossError::ShapeMismatch { argument: "mask", .. }), "{e}");
    let e = lens_rewards(&r, &Tensor::from_slice2(&[[0.5f64], [-2.0]]), &m).unwrap_err();
    assert!(matches!(e, LossError::PositiveLogProb { argument: "logp_old", .. }), "{e}");
    let e = lens_rewards(&r, &Tensor::from_slice2(&[[f64::NAN], [-2.0]]), &m).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp_old", .. }), "{e}");
    let e = lens_rewards(&Tensor::from_slice(&[1.0f64, 0.0]), &lp, &m).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "rewards", .. }), "{e}");
    let e = lens_advantages(&r, &lp, &m, &LensConfig::lens().with_eps(-1.0)).unwrap_err();
    assert!(matches!(e, LossError::InvalidConfig { field: "eps", .. }), "{e}");
    // NaN in padding is fine.
    let nan = Tensor::from_slice2(&[[-1.0f64, f64::NAN], [-2.0, 0.3]]);
    let mm = Tensor::from_slice2(&[[true, false], [true, false]]);
    assert!(lens_rewards(&r, &nan, &mm).is_ok());
}

#[test]
fn lens_rewards_as_toprs_rewards_push_confident_failures_down() {
    // TOPR on-policy with rewards r̃ and baseline 0: the gradient per completion is −r̃/B, the
    // supervised pull for successes and a confidence-weighted push for failures.
    let x = Groups {
        rewards: vec![vec![1.0, 0.0, 0.0]],
        logp: vec![vec![-1.0, -1.0], vec![-0.2, -0.4], vec![-2.0, -1.5]],
        mask: vec![vec![true; 2]; 3],
    };
    let (r, lp, m) = x.tensors(0.0);
    let rt = lens_rewards(&r, &lp, &m).unwrap().flatten(0, -1);
    let seq = leaf(&lp.sum_dim_intlist(1, false, None::<Kind>));
    topr_loss(&seq, &seq.detach(), &rt, &ToprConfig::canonical()).unwrap().backward();
    let want: Vec<f64> = vec1(&rt).iter().map(|v| -v / 3.0).collect();
    assert_close(&vec1(&seq.grad()), &want, 1e-15, "TOPR on LENS rewards");
    // With the raw 0/1 rewards the failures would get no gradient at all.
    let plain = leaf(&lp.sum_dim_intlist(1, false, None::<Kind>));
    topr_loss(&plain, &plain.detach(), &r.flatten(0, -1), &ToprConfig::canonical()).unwrap().backward();
    assert_eq!(&vec1(&plain.grad())[1..], &[0.0, 0.0]);
}
