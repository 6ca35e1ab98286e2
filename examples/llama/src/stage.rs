//! Resumable stages, one mechanism: a stage records what it is made from when it starts (a run
//! record, serialised settings and input identities), compares that record with what a rerun
//! would make it from, and refuses to continue or reuse it when they differ, listing each field
//! ([`crate::Refusal::ChangedSettings`]). A finished stage leaves a done marker (its summary) and
//! is reused as it is; a finished file is copied whole or not at all.
//!
//! Every resumable thing uses these: `train`'s saved state, a sampled data set and its shards,
//! `iterate`'s work directory, the verifier's rounds, the study's and the comparison's arms
//! (through `iterate`).
//!
//! A saved record is read as the record type of this version before it is compared, so that a
//! record written before a setting existed (the field absent) matches a run without it: new
//! fields take their defaults, which mean "off".

use crate::{Refusal, Resumable};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::path::Path;

/// Writes the record of a new stage to `file` (pretty JSON, atomically).
pub fn write_record<T: Serialize>(file: &Path, record: &T) -> Result<()> {
    crate::io::write_file(file, serde_json::to_string_pretty(record)?)
}

/// The record in `file`, as JSON.
pub fn read_record(file: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))
}

/// What differs between the `saved` record and `now`, field by field (`field saved → now`, nested
/// fields dotted), but for the fields in `may_change`. `saved` is first read as a `T` where it
/// reads as one (see the module's docs).
pub fn changes<T: Serialize + DeserializeOwned>(saved: &Value, now: &T, may_change: &[&str]) -> Result<Vec<String>> {
    let saved = match serde_json::from_value::<T>(saved.clone()) {
        Ok(r) => serde_json::to_value(r)?,
        Err(_) => saved.clone(),
    };
    Ok(crate::identity::differences(&saved, &serde_json::to_value(now)?, may_change))
}

/// Refuses to continue (or reuse) the stage in `dir` when `saved` and `now` differ ([`changes`]).
pub fn check<T: Serialize + DeserializeOwned>(
    saved: &Value,
    now: &T,
    may_change: &[&str],
    dir: &Path,
    run: Resumable,
) -> Result<()> {
    refuse(dir, run, changes(saved, now, may_change)?)
}

/// [`Refusal::ChangedSettings`] for the stage in `dir` when `differences` is not empty.
pub fn refuse(dir: &Path, run: Resumable, differences: Vec<String>) -> Result<()> {
    if differences.is_empty() {
        return Ok(());
    }
    bail!(Refusal::ChangedSettings { dir: dir.to_path_buf(), differences, run })
}

/// Marks a stage finished: its summary in the done marker `file`, written whole or not at all.
pub fn write_done<T: Serialize>(file: &Path, summary: &T) -> Result<()> {
    crate::io::write_file(file, serde_json::to_string(summary)?)
}

/// The summary in a finished stage's done marker `file`.
pub fn read_done<T: DeserializeOwned>(file: &Path) -> Result<T> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    serde_json::from_str(&text).with_context(|| format!("reading {}", file.display()))
}

/// Puts a copy of the finished file `from` at `to` (a hard link where the file system allows),
/// unless `to` exists; `to` appears whole or not at all.
pub fn copy_finished(from: &Path, to: &Path) -> Result<()> {
    if to.exists() {
        return Ok(());
    }
    crate::io::replace_with(to, |tmp| {
        if std::fs::hard_link(from, tmp).is_err() {
            std::fs::copy(from, tmp).with_context(|| format!("copying {}", from.display()))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, serde::Deserialize)]
    struct Old {
        lr: f64,
    }

    #[derive(Serialize, serde::Deserialize)]
    struct New {
        lr: f64,
        #[serde(default)]
        kl_coef: f64,
        #[serde(default)]
        iterations: usize,
    }

    /// A record written before a field existed reads with its default; a changed value is listed;
    /// the fields that may change are not compared.
    #[test]
    fn a_saved_record_is_read_as_this_versions_before_it_is_compared() {
        let old = serde_json::to_value(Old { lr: 1e-5 }).unwrap();
        assert!(changes(&old, &New { lr: 1e-5, kl_coef: 0.0, iterations: 0 }, &[]).unwrap().is_empty());
        let d = changes(&old, &New { lr: 1e-5, kl_coef: 0.1, iterations: 3 }, &["iterations"]).unwrap();
        assert_eq!(d, ["kl_coef 0.0 → 0.1"]);
        let err = check(&old, &New { lr: 2e-5, kl_coef: 0.0, iterations: 0 }, &[], Path::new("w"), Resumable::Training)
            .unwrap_err();
        assert!(format!("{err}").contains("lr 1e-5 → 2e-5"), "{err}");
    }
}
