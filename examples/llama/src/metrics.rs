//! The records of the JSONL metric files, defined once: `train` writes a [`StepRecord`] per
//! optimiser step to `metrics.jsonl`, `iterate` an [`IterationRecord`] per iteration to
//! `iterations.jsonl`; the plots and the resume code read them back as the same types.
//!
//! The fields of every record written here are declared in alphabetical order: the files were
//! written through `serde_json::Value` (whose objects sort their keys) before these types
//! existed, and this order keeps them byte for byte the same.

use anyhow::{Context, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The TOPR family's weights and truncation in one step (sample-weighted over micro-batches).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct ToprStats {
    pub effective_positive_proportion: Option<f64>,
    pub log_ratio_mean: f64,
    pub negative_fraction: f64,
    pub truncated_fraction_neg: f64,
    pub truncated_fraction_pos: f64,
    pub weight_max: f64,
    pub weight_mean: f64,
}

/// What one optimiser step measured.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct StepStats {
    /// PPO and GRPO: share of tokens whose ratio lies outside `[1 − ε_low, 1 + ε_high]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_fraction: Option<f64>,
    /// DPO: share of pairs whose implicit reward ranks chosen above rejected, and the mean margin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo_accuracy: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo_margin: Option<f64>,
    /// Mean `log π − log μ` over the completion tokens.
    pub log_ratio_mean: f64,
    pub loss: f64,
    pub sequences: usize,
    pub tokens: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topr: Option<ToprStats>,
}

/// One line of `metrics.jsonl`: an optimiser step.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepRecord {
    /// The baseline `c` subtracted from rewards.
    pub baseline: f64,
    /// 0-based.
    pub epoch: usize,
    /// The gradient norm before clipping.
    pub grad_norm: f64,
    /// The learning rate of this step.
    pub lr: f64,
    /// The data set's effective positive proportion (`None` for GRPO and DPO).
    pub p_tilde: Option<f64>,
    pub stats: StepStats,
    /// 1-based.
    pub step: usize,
}

/// One line of `iterations.jsonl`: the held-out evaluation after an iteration (0: the initial
/// model) and what its training saw.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct IterationRecord {
    /// Greedy pass@1 on the held-out problems.
    pub accuracy: f64,
    /// The share of positives in the sampled data (absent for iteration 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_positive_fraction: Option<f64>,
    pub invalid_rate: f64,
    pub iteration: usize,
    pub p_tilde: Option<f64>,
    /// The settings of the run that made this row (absent in files written before they were
    /// recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<crate::settings::IterateSettings>,
    pub truncated_fraction_neg: Option<f64>,
}

/// Reads every non-empty line of a JSONL file as a `T`, naming the file and line of one that is not.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| serde_json::from_str(l).with_context(|| format!("{}:{}", path.display(), n + 1)))
        .collect()
}
