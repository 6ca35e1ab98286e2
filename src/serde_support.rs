//! Serialisation of the configs (the `serde` feature): what the derives cannot say on their own.
//!
//! JSON has no infinity, and `serde_json` writes `inf` as `null`, which it then refuses to read
//! back as a number. The limits that may be infinite (`ToprConfig::b_pos`, `PpoConfig::clip_low`,
//! `RolloutCorrection::max`, …, each documented as "may be ∞") are therefore written as `null` for
//! `+∞` ("no limit") and read back so: every config round-trips through JSON. A config with a
//! `Default` reads a record that leaves fields out with the default's values for them.

/// `+∞` as `null`, any other value as itself.
pub(crate) mod limit {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if *v == f64::INFINITY { s.serialize_none() } else { s.serialize_f64(*v) }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::INFINITY))
    }
}

/// [`crate::Rejection`]'s clamp when a record leaves it out: its constructors' (verl's) 20.
pub(crate) fn rejection_max_log_ratio() -> f64 {
    20.0
}

impl From<crate::DpoMix> for Vec<(crate::DpoConfig, f64)> {
    fn from(mix: crate::DpoMix) -> Self {
        mix.terms().to_vec()
    }
}

/// A mix of the listed terms, in order; refused when empty or longer than
/// [`crate::DpoMix::MAX_TERMS`] (the terms' values are checked by `validate`, as for any config).
impl TryFrom<Vec<(crate::DpoConfig, f64)>> for crate::DpoMix {
    type Error = crate::LossError;

    fn try_from(terms: Vec<(crate::DpoConfig, f64)>) -> Result<Self, Self::Error> {
        let Some((first, rest)) = terms.split_first() else {
            return Err(crate::LossError::InvalidConfig {
                field: "terms",
                value: 0.0,
                reason: "a DpoMix holds at least one term".into(),
            });
        };
        let mix = rest.iter().fold(Self::of(first.0, first.1), |m, (c, w)| m.with_term(*c, *w));
        if terms.len() > Self::MAX_TERMS {
            mix.validate()?;
        }
        Ok(mix)
    }
}
