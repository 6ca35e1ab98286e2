//! The `serde` feature: every config and enum round-trips through JSON, with the names the docs
//! use, and infinite limits written as `null`. (The workspace's Llama crate enables the feature,
//! so a plain `cargo test` at the root runs these; `cargo test -p topr-loss --features serde`
//! alone does too.)
#![cfg(feature = "serde")]

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use topr_loss::*;

/// `v` as JSON, checked to read back as the same value.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(v: T) -> Value {
    let text = serde_json::to_string(&v).unwrap();
    let back: T = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    assert_eq!(back, v, "{text}");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn every_preset_round_trips() {
    for c in [
        ToprConfig::canonical(),
        ToprConfig::naive_reinforce(),
        ToprConfig::sft(),
        ToprConfig::tis().with_baseline(-0.25).with_tie(TieRule::Tapered),
        ToprConfig::importance_sampling().with_checks(Checks::Shapes),
    ] {
        round_trip(c);
    }
    for c in [ToprTokenConfig::paper(), ToprTokenConfig::verl(), ToprTokenConfig::trinity()] {
        round_trip(c);
    }
    for c in [PpoConfig::ppo(), PpoConfig::dapo(), PpoConfig::gspo(), PpoConfig::cispo()] {
        round_trip(c);
    }
    for c in [DpoConfig::dpo(), DpoConfig::cdpo(0.1), DpoConfig::ipo(), DpoConfig::discopop(), DpoConfig::aot()] {
        round_trip(c);
    }
    for c in [KlConfig::k1(), KlConfig::k2(), KlConfig::k3(), KlConfig::abs(), KlConfig::low_var_kl()] {
        round_trip(c);
    }
    round_trip(ValueLossConfig::ppo().with_clip(f64::INFINITY));
    round_trip(ValueLossConfig::verl());
    round_trip(SapoConfig::sapo());
    round_trip(DppoConfig::tv());
    round_trip(DroConfig::new(0.3));
    round_trip(DecoupledPpoConfig::verl().with_behaviour(RolloutCorrection::geometric_tis(2.0)));
    round_trip(ProximalApproximation::Linear);
    round_trip(VespoConfig::vespo().with_negative(1.0, 4.0));
    round_trip(DppoConfig::binary_kl().with_max_weight(f64::INFINITY));
    round_trip(GmpoConfig::gmpo());
    round_trip(ClipCovConfig::clip_cov());
    round_trip(KlCovConfig::kl_cov());
    round_trip(EntropyConfig::bonus().with_coef(0.01));
    for c in [SftPhiConfig::chord_phi(), SftPhiConfig::sft(), SftPhiConfig::sft_is().with_cutoff_prob(0.9)] {
        round_trip(c);
    }
    round_trip(PositiveNllConfig::vapo().with_aggregation(AggregationMode::SeqMeanTokenMean));
    for c in [BapoConfig::paper(), BapoConfig::recipe().with_positive_share(0.6).with_dual_clip(None)] {
        round_trip(c);
    }
    for c in [PrefixRatioConfig::ctpo_la(), PrefixRatioConfig::ctpo(), PrefixRatioConfig::ctpo_geomean_la()] {
        round_trip(c);
    }
    round_trip(LensConfig::lens().with_negative_weight(0.5));
    round_trip(RolloutCorrection::sequence_mis(0.5, 2.0).with_batch_normalize(true));
    round_trip(Rejection::k1(RejectionScope::SequenceMean, 0.5, 2.0));
    round_trip(Rejection::k3(RejectionScope::SequenceMax, 0.01));
    round_trip(DpoMix::of(DpoConfig::dpo(), 0.8).with_term(DpoConfig::bco_pair(), 0.2));
    for g in [GroupAdvantage::grpo(), GroupAdvantage::DrGrpo, GroupAdvantage::Rloo] {
        round_trip(g);
    }
    for a in [AggregationMode::TokenMean, AggregationMode::DrGrpo { length: 512.0 }] {
        round_trip(a);
    }
    round_trip(SingletonGroup::ZeroMeanUnitStd);
}

#[test]
fn names_are_the_documented_ones() {
    assert_eq!(round_trip(RatioLevel::SequenceMean), json!("sequence_mean"));
    assert_eq!(round_trip(TieRule::Tapered), json!("tapered"));
    assert_eq!(round_trip(Checks::Shapes), json!("shapes"));
    // verl's names for the rejection scopes (`seq_sum_k1`, `seq_max_k2`, …).
    assert_eq!(round_trip(RejectionScope::SequenceSum), json!("seq_sum"));
    assert_eq!(round_trip(RejectionScope::SequenceMax), json!("seq_max"));
    assert_eq!(round_trip(DpoVariant::AotUnpaired), json!("aot_unpaired"));
    assert_eq!(round_trip(AggregationMode::SeqMeanTokenMean), json!("seq_mean_token_mean"));
    assert_eq!(round_trip(AggregationMode::DrGrpo { length: 4.0 }), json!({"dr_grpo": {"length": 4.0}}));
    let topr = round_trip(ToprConfig::canonical());
    assert_eq!(
        topr,
        json!({"a_pos": 1.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 1.0, "baseline": 0.0, "tie": "positive", "checks": "full"})
    );
}

#[test]
fn infinite_limits_are_null_and_read_back() {
    let is = round_trip(ToprConfig::importance_sampling());
    assert_eq!((is["b_pos"].clone(), is["b_neg"].clone()), (Value::Null, Value::Null));
    let cispo = round_trip(PpoConfig::cispo());
    assert_eq!(cispo["clip_low"], Value::Null);
    let tis: RolloutCorrection =
        serde_json::from_value(round_trip(RolloutCorrection::token_tis(f64::INFINITY))).unwrap();
    assert_eq!(tis.max, f64::INFINITY);
}

#[test]
fn a_mix_reads_from_its_terms_and_refuses_none_or_too_many() {
    let two = round_trip(DpoMix::of(DpoConfig::ipo(), 2.0).with_term(DpoConfig::hinge(), 0.5));
    assert_eq!(two.as_array().map(Vec::len), Some(2));
    assert!(serde_json::from_value::<DpoMix>(json!([])).is_err());
    let five = Value::Array(vec![two[0].clone(); DpoMix::MAX_TERMS + 1]);
    let err = serde_json::from_value::<DpoMix>(five).unwrap_err().to_string();
    assert!(err.contains("at most"), "{err}");
    // A config read from JSON is checked like any other: a bad value is refused by `validate`.
    let bad: ToprConfig = serde_json::from_value(json!({"a_pos": 2.0, "b_pos": 1.0, "a_neg": 0.0, "b_neg": 1.0, "baseline": 0.0, "tie": "positive", "checks": "full"})).unwrap();
    assert!(bad.validate().is_err());
}

#[test]
fn fields_left_out_take_the_defaults_values() {
    let c: ToprConfig = serde_json::from_value(json!({"b_neg": 2.0})).unwrap();
    assert_eq!(c, ToprConfig::canonical().with_negative_limits(0.0, 2.0));
    let p: PpoConfig = serde_json::from_value(json!({})).unwrap();
    assert_eq!(p, PpoConfig::default());
    // A rejection rule has no default, but its clamp does (the constructors' 20).
    let r: Rejection =
        serde_json::from_value(json!({"divergence": "k3", "scope": "token", "min": 0.0, "max": 0.1})).unwrap();
    assert_eq!(r, Rejection::k3(RejectionScope::Token, 0.1));
    assert!(serde_json::from_value::<Rejection>(json!({"divergence": "k3"})).is_err());
}

#[test]
fn entropy_control_and_sft_mixing_records() {
    assert_eq!(round_trip(SftWeight::Probability), json!("probability"));
    let sft = round_trip(SftPhiConfig::chord_phi());
    assert_eq!(sft, json!({"weight": "phi", "cutoff_prob": 1.0, "aggregation": "token_mean", "checks": "full"}));
    let c: SftPhiConfig = serde_json::from_value(json!({"weight": "uniform"})).unwrap();
    assert_eq!(c, SftPhiConfig::sft());
    let n: PositiveNllConfig = serde_json::from_value(json!({"coef": 0.2})).unwrap();
    assert_eq!(n, PositiveNllConfig::vapo().with_coef(0.2));
    // The controller's state, mid-run: it resumes where it was.
    let mut ctrl = AdaptiveEntropyController::skywork();
    ctrl.update(0.3).unwrap();
    let record = round_trip(ctrl);
    assert_eq!(
        record,
        json!({"value": 0.004, "enabled": false, "target": 0.2, "delta": 0.001, "min": 0.0, "max": 0.5})
    );
    // A record outside its bounds is refused by its first update, naming the field.
    let mut bad: AdaptiveEntropyController = serde_json::from_value(
        json!({"value": 0.9, "enabled": true, "target": 0.2, "delta": 0.001, "min": 0.0, "max": 0.5}),
    )
    .unwrap();
    assert!(matches!(bad.validate(), Err(LossError::InvalidArgument { argument: "value", .. })));
    assert!(matches!(bad.update(0.1), Err(LossError::InvalidArgument { argument: "value", .. })));
}

#[test]
fn successors_records() {
    assert_eq!(round_trip(PrefixRatio::GeometricMean), json!("geometric_mean"));
    assert_eq!(
        round_trip(PrefixClip::length_adaptive()),
        json!({"length_adaptive": {"log_low": 0.025, "log_high": 0.05, "log_dual": 0.05, "power": 0.5}})
    );
    // PPO's window without an upper clip: the infinite range is written as `null`.
    let open = PrefixClip::Ratio { clip_low: 0.2, clip_high: f64::INFINITY, dual_clip: None };
    assert_eq!(round_trip(open), json!({"ratio": {"clip_low": 0.2, "clip_high": null, "dual_clip": null}}));
    let bapo: BapoConfig = serde_json::from_value(json!({"upper_max": 2.0, "target": 2.0})).unwrap();
    assert_eq!(bapo, BapoConfig::paper().with_upper(1.2, 2.0, 0.05).with_target(2.0));
    let ctpo: PrefixRatioConfig = serde_json::from_value(json!({"ratio": "geometric_mean"})).unwrap();
    assert_eq!(ctpo, PrefixRatioConfig::ctpo_la().with_ratio(PrefixRatio::GeometricMean));
    let lens: LensConfig = serde_json::from_value(json!({})).unwrap();
    assert_eq!(lens, LensConfig::lens());
}
