//! The `with_…` setters that many configs share, written once.
//!
//! `setters!(PpoConfig, ppo(); checks, aggregation, max_log_ratio)` inside `impl PpoConfig`
//! writes `with_checks`, `with_aggregation` and `with_max_log_ratio`: each returns the same
//! config with one field replaced, and has its rustdoc and a doc example built from the type's
//! name and the constructor given (which must be callable as `PpoConfig::ppo()`).

/// Writes the named setters (`checks`, `aggregation`, `max_log_ratio`) of a config type.
macro_rules! setters {
    ($ty:ident, $new:expr; $($field:ident),+ $(,)?) => {
        $( $crate::setters::setters!(@one $field, $ty, $new); )+
    };
    (@one checks, $ty:ident, $new:expr) => {
        #[doc = "The same config with another checks level ([`Checks::Shapes`]: no host read per call)."]
        #[doc = ""]
        #[doc = "```"]
        #[doc = concat!("use topr_loss::{Checks, ", stringify!($ty), "};")]
        #[doc = concat!("assert_eq!(", stringify!($ty), "::", stringify!($new), ".with_checks(Checks::Shapes).checks, Checks::Shapes);")]
        #[doc = concat!("assert_eq!(", stringify!($ty), "::", stringify!($new), ".with_checks(Checks::Full).checks, Checks::Full);")]
        #[doc = "```"]
        #[doc = ""]
        #[doc = "[`Checks::Shapes`]: crate::Checks::Shapes"]
        pub const fn with_checks(self, checks: $crate::Checks) -> Self {
            Self { checks, ..self }
        }
    };
    (@one aggregation, $ty:ident, $new:expr) => {
        #[doc = "The same config with another aggregation ([`AggregationMode`])."]
        #[doc = ""]
        #[doc = "```"]
        #[doc = concat!("use topr_loss::{AggregationMode, ", stringify!($ty), "};")]
        #[doc = "for mode in [AggregationMode::TokenSum, AggregationMode::SeqMeanTokenMean] {"]
        #[doc = concat!("    assert_eq!(", stringify!($ty), "::", stringify!($new), ".with_aggregation(mode).aggregation, mode);")]
        #[doc = "}"]
        #[doc = "```"]
        #[doc = ""]
        #[doc = "[`AggregationMode`]: crate::AggregationMode"]
        pub const fn with_aggregation(self, aggregation: $crate::AggregationMode) -> Self {
            Self { aggregation, ..self }
        }
    };
    (@one max_log_ratio, $ty:ident, $new:expr) => {
        #[doc = "The same config with another clamp on the log-ratio (`max_log_ratio`, > 0)."]
        #[doc = ""]
        #[doc = "```"]
        #[doc = concat!("let c = topr_loss::", stringify!($ty), "::", stringify!($new), ".with_max_log_ratio(7.5);")]
        #[doc = "assert_eq!(c.max_log_ratio, 7.5);"]
        #[doc = "```"]
        pub const fn with_max_log_ratio(self, max_log_ratio: f64) -> Self {
            Self { max_log_ratio, ..self }
        }
    };
}

pub(crate) use setters;
