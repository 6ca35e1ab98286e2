//! The statistics every report uses, written once: a mean and its standard error, and the
//! paired difference of two measurements of the same items (questions, or seeds).
//!
//! The standard error is the sample standard deviation (divided by `n − 1`) over `√n`. It is
//! undefined for fewer than two values and is then NaN (written `null` in JSON records, and shown
//! as "one seed" or "–" in tables), never 0: a single run has no error bar.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// Mean and standard error of `v`: `(NaN, NaN)` when empty, `(v[0], NaN)` for one value.
///
/// ```
/// let (m, se) = topr_llama::stats::mean_se(&[1.0, 2.0, 3.0, 6.0]);
/// assert_eq!(m, 3.0);
/// assert!((se - (14.0f64 / 3.0 / 4.0).sqrt()).abs() < 1e-15);
/// assert!(topr_llama::stats::mean_se(&[0.25]).1.is_nan());
/// ```
pub fn mean_se(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let m = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (m, f64::NAN);
    }
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

/// The mean of `a_i − b_i` and its standard error (the paired one, smaller than either side's
/// when the two are correlated). Refused when the two have different lengths.
///
/// ```
/// let (d, se) = topr_llama::stats::paired(&[1.0, 1.0, 0.0, 1.0], &[0.0, 1.0, 0.0, 0.0]).unwrap();
/// assert_eq!(d, 0.5);
/// assert!((se - (1.0f64 / 12.0).sqrt()).abs() < 1e-12);
/// ```
pub fn paired(a: &[f64], b: &[f64]) -> Result<(f64, f64)> {
    if a.len() != b.len() {
        bail!("a paired difference needs as many values on both sides, got {} and {}", a.len(), b.len());
    }
    Ok(mean_se(&a.iter().zip(b).map(|(x, y)| x - y).collect::<Vec<_>>()))
}

/// A mean with its standard error ([`mean_se`]), as records store it (`se` is `null` when
/// undefined).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    #[serde(with = "nan_as_null")]
    pub mean: f64,
    #[serde(with = "nan_as_null")]
    pub se: f64,
}

impl Estimate {
    /// The mean and standard error of `values`.
    ///
    /// ```
    /// let e = topr_llama::stats::Estimate::of(&[1.0, 0.0]);
    /// assert_eq!((e.mean, e.se), (0.5, 0.5));
    /// ```
    pub fn of(values: &[f64]) -> Self {
        let (mean, se) = mean_se(values);
        Self { mean, se }
    }
}

/// NaN as `null` and back (JSON has no NaN; `serde_json` writes it as `null` and refuses to read
/// `null` as a number).
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_nan() { s.serialize_none() } else { s.serialize_f64(*v) }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error_by_definition() {
        let (m, se) = mean_se(&[1.0, 2.0, 3.0, 6.0]);
        assert_eq!(m, 3.0);
        // sample variance (4 + 1 + 0 + 9) / 3, over n = 4
        assert!((se - (14.0f64 / 3.0 / 4.0).sqrt()).abs() < 1e-15);
        assert_eq!(mean_se(&[0.25]).0, 0.25);
        assert!(mean_se(&[0.25]).1.is_nan());
        assert!(mean_se(&[]).0.is_nan());
        assert!(paired(&[1.0], &[1.0, 2.0]).is_err());
    }

    #[test]
    fn an_undefined_error_survives_a_record() {
        let one = Estimate::of(&[0.75]);
        let text = serde_json::to_string(&one).unwrap();
        assert_eq!(text, r#"{"mean":0.75,"se":null}"#);
        let back: Estimate = serde_json::from_str(&text).unwrap();
        assert!(back.mean == 0.75 && back.se.is_nan());
        assert_eq!(serde_json::to_string(&Estimate::of(&[1.0, 0.0])).unwrap(), r#"{"mean":0.5,"se":0.5}"#);
    }
}
