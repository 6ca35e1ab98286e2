//! `Checks::Shapes` makes no host read in any loss, gives the same loss and gradient as full
//! checks on valid inputs, and still gives padding exactly zero gradient; full checks read a
//! few values back, counted by `host_reads`.

mod common;

use common::*;
use proptest::prelude::*;
use tch::Tensor;
use topr_loss::*;

/// A loss call as a function of the checks level and the policy's log-probs `[B, T]`.
type Call = Box<dyn Fn(Checks, &Tensor) -> Result<Tensor, LossError>>;

/// Every loss and `…_output` call on a token batch, by name.
fn calls(b: &TokenBatch, padding: f64) -> Vec<(&'static str, Call)> {
    let (_, mu, w, m) = b.tensors(padding);
    let norm = Normalizer::from_masks(&[&m]).unwrap();
    let seq = |t: &Tensor| t.nan_to_num(0.0, None, None).sum_dim_intlist(1, false, None::<tch::Kind>);
    let (mu_s, w_s) = (seq(&mu), w.shallow_clone());
    let mut out: Vec<(&'static str, Call)> = vec![];
    for (name, level) in [("topr_token sequence", RatioLevel::Sequence), ("topr_token token", RatioLevel::Token)] {
        let (mu, w, m) = (mu.shallow_clone(), w.shallow_clone(), m.shallow_clone());
        out.push((
            name,
            Box::new(move |c, lp| {
                let cfg = ToprTokenConfig::paper().with_ratio(level).with_topr(ToprConfig::canonical().with_checks(c));
                topr_token_loss(lp, &mu, &w, &m, &cfg)
            }),
        ));
    }
    {
        let (mu, w, m) = (mu.shallow_clone(), w.shallow_clone(), m.shallow_clone());
        out.push((
            "topr_token_loss_output",
            Box::new(move |c, lp| {
                let cfg = ToprTokenConfig::verl().with_topr(ToprConfig::tis().with_checks(c));
                Ok(topr_token_loss_output(lp, &mu, &w, &m, &cfg, &norm)?.loss)
            }),
        ));
    }
    {
        let (mu_s, w_s) = (mu_s.shallow_clone(), w_s.shallow_clone());
        let m = m.shallow_clone();
        out.push((
            "topr_loss",
            Box::new(move |c, lp| {
                let lp = lp.where_self(&m, &lp.zeros_like()).sum_dim_intlist(1, false, None::<tch::Kind>);
                topr_loss(&lp, &mu_s, &w_s, &ToprConfig::canonical().with_checks(c))
            }),
        ));
    }
    type Ppo = fn(&Tensor, &Tensor, &Tensor, &Tensor, &PpoConfig) -> Result<Tensor, LossError>;
    for (name, f, cfg) in [
        ("ppo_clip_loss", ppo_clip_loss as Ppo, PpoConfig::ppo().with_dual_clip(Some(3.0))),
        ("gspo_loss", gspo_loss as Ppo, PpoConfig::gspo()),
        ("cispo_loss", cispo_loss as Ppo, PpoConfig::cispo()),
    ] {
        let (mu, w, m) = (mu.shallow_clone(), w.shallow_clone(), m.shallow_clone());
        out.push((name, Box::new(move |c, lp| f(lp, &mu, &w, &m, &cfg.with_checks(c)))));
    }
    {
        let (mu, w, m) = (mu.shallow_clone(), w.shallow_clone(), m.shallow_clone());
        out.push((
            "ppo_clip_loss_output",
            Box::new(move |c, lp| {
                Ok(ppo_clip_loss_output(lp, &mu, &w, &m, &PpoConfig::dapo().with_checks(c), &norm)?.loss)
            }),
        ));
    }
    {
        let (mu, m) = (mu.shallow_clone(), m.shallow_clone());
        out.push(("kl_penalty", Box::new(move |c, lp| kl_penalty(lp, &mu, &m, &KlConfig::k3().with_checks(c)))));
    }
    {
        let (mu, m) = (mu.shallow_clone(), m.shallow_clone());
        out.push((
            "kl_penalty_output",
            Box::new(move |c, lp| Ok(kl_penalty_output(lp, &mu, &m, &KlConfig::k2().with_checks(c), &norm)?.loss)),
        ));
    }
    {
        let (mu_s, m) = (mu_s.shallow_clone(), m.shallow_clone());
        out.push((
            "dpo_loss",
            Box::new(move |c, lp| {
                let lp = lp.where_self(&m, &lp.zeros_like()).sum_dim_intlist(1, false, None::<tch::Kind>);
                let rejected = &lp - 1.0;
                dpo_loss(&lp, &rejected, &mu_s, &mu_s, &DpoConfig::dpo().with_checks(c))
            }),
        ));
    }
    {
        let (mu_s, m) = (mu_s.shallow_clone(), m.shallow_clone());
        out.push((
            "dpo_loss_output",
            Box::new(move |c, lp| {
                let lp = lp.where_self(&m, &lp.zeros_like()).sum_dim_intlist(1, false, None::<tch::Kind>);
                let rejected = &lp - 1.0;
                let n = Normalizer::sequences(7.0);
                Ok(dpo_loss_output(&lp, &rejected, &mu_s, &mu_s, &DpoConfig::ipo().with_checks(c), &n)?.loss)
            }),
        ));
    }
    out
}

fn batch() -> impl Strategy<Value = TokenBatch> {
    token_batch(0.8, prop_oneof![Just(1.0f64), Just(-1.0), -2.0f64..2.0].boxed())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn shape_checks_make_no_host_read_and_change_nothing(b in batch()) {
        for (name, f) in calls(&b, f64::NAN) {
            let (lp, _, _, _) = b.tensors(f64::NAN);
            let (full_lp, fast_lp) = (leaf(&lp), leaf(&lp));
            let before = host_reads();
            let full = f(Checks::Full, &full_lp).unwrap();
            prop_assert!(host_reads() > before, "{name}: full checks read nothing back");
            full.backward();
            let before = host_reads();
            let fast = f(Checks::Shapes, &fast_lp).unwrap();
            fast.backward();
            prop_assert_eq!(host_reads(), before, "{}: shape checks read values back", name);
            assert_close(&[scalar(&fast)], &[scalar(&full)], 0.0, &format!("{name} value"));
            let (gf, gs) = (vec1(&full_lp.grad()), vec1(&fast_lp.grad()));
            assert_close(&gs, &gf, 0.0, &format!("{name} grad"));
            // Padding (NaN here) still gets exactly zero gradient.
            for (k, real) in b.mask.concat().iter().enumerate() {
                if !real { prop_assert!(gs[k] == 0.0, "padding gradient {} (exactly zero, either sign), {}", gs[k], name); }
            }
        }
    }
}

#[test]
fn shape_checks_let_bad_values_through_where_full_checks_refuse() {
    let lp = Tensor::from_slice2(&[[-1.0f64, f64::NAN]]);
    let mu = Tensor::from_slice2(&[[-1.0f64, -1.0]]);
    let r = Tensor::from_slice(&[1.0f64]);
    let real = Tensor::from_slice2(&[[true, true]]);
    let cfg = |c| ToprTokenConfig::paper().with_topr(ToprConfig::canonical().with_checks(c));
    // NaN in a real entry: an error under full checks, NaN under shape checks.
    let e = topr_token_loss(&lp, &mu, &r, &real, &cfg(Checks::Full)).unwrap_err();
    assert!(matches!(e, LossError::NonFinite { argument: "logp", .. }), "{e}");
    assert!(scalar(&topr_token_loss(&lp, &mu, &r, &real, &cfg(Checks::Shapes)).unwrap()).is_nan());
    // An empty batch: an error under full checks, a zero loss under shape checks.
    let none = Tensor::from_slice2(&[[false, false]]);
    let e = topr_token_loss(&lp, &mu, &r, &none, &cfg(Checks::Full)).unwrap_err();
    assert!(matches!(e, LossError::EmptyBatch { .. }), "{e}");
    assert_eq!(scalar(&topr_token_loss(&lp, &mu, &r, &none, &cfg(Checks::Shapes)).unwrap()), 0.0);
    // A floating mask with a value other than 0/1: refused, or read as "nonzero is real".
    let half = Tensor::from_slice2(&[[1.0f64, 0.5]]);
    let ok = Tensor::from_slice2(&[[-1.0f64, -2.0]]);
    let e = topr_token_loss(&ok, &mu, &r, &half, &cfg(Checks::Full)).unwrap_err();
    assert!(matches!(e, LossError::WrongDtype { argument: "mask", .. }), "{e}");
    let fast = topr_token_loss(&ok, &mu, &r, &half, &cfg(Checks::Shapes)).unwrap();
    let both = topr_token_loss(&ok, &mu, &r, &real, &cfg(Checks::Full)).unwrap();
    assert_eq!(scalar(&fast), scalar(&both));
    // Shape errors stay errors under shape checks.
    let e = topr_token_loss(&ok, &Tensor::from_slice(&[1.0f64]), &r, &real, &cfg(Checks::Shapes)).unwrap_err();
    assert!(matches!(e, LossError::WrongRank { argument: "logp_mu", .. } | LossError::ShapeMismatch { .. }), "{e}");
}

#[test]
fn host_reads_per_call_under_full_checks() {
    // The numbers docs/performance.md quotes: what one call of each loss costs in host reads
    // with value checks on, on valid f32 inputs with a bool mask and local counts.
    let lp = Tensor::from_slice2(&[[-1.0f32, -2.0], [-0.5, -0.1]]);
    let mu = Tensor::from_slice2(&[[-1.1f32, -1.9], [-0.4, -0.3]]);
    let m = Tensor::from_slice2(&[[true, true], [true, false]]);
    let r = Tensor::from_slice(&[1.0f32, -1.0]);
    let count = |f: &dyn Fn() -> Result<Tensor, LossError>| {
        let before = host_reads();
        let _loss = f().unwrap();
        host_reads() - before
    };
    let topr = count(&|| topr_token_loss(&lp, &mu, &r, &m, &ToprTokenConfig::paper()));
    let ppo = count(&|| ppo_clip_loss(&lp, &mu, &r, &m, &PpoConfig::ppo()));
    let seq = Tensor::from_slice(&[-1.5f32, -2.5]); // sequence log-probs
    let dpo = count(&|| dpo_loss(&seq, &seq, &seq, &seq, &DpoConfig::dpo()));
    // Input sums (1), the count the aggregation divides by (1), the finite result (1).
    assert_eq!((topr, ppo, dpo), (3, 3, 2));
    // Reading a LossOutput's diagnostics is one more.
    let out = topr_token_loss_output(&lp, &mu, &r, &m, &ToprTokenConfig::paper(), &Normalizer::local()).unwrap();
    let before = host_reads();
    out.diagnostics.read().unwrap();
    assert_eq!(host_reads() - before, 1);
}
