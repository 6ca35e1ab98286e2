//! The settings of the self-taught loop ([`IterateSettings`]) and of which samples each
//! iteration trains on ([`Curation`]).

use crate::dataset::Sample;
use crate::generate::Sampling;
use crate::identity::Fnv;
use crate::settings::TrainSettings;
use crate::task::TaskSpec;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::PathBuf;

/// Which samples of a data set are trained on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Curation {
    All,
    /// Every negative, and one positive per question (as in the paper's curated runs).
    OnePositive,
    /// A data set whose raw share of positives is this (in (0, 1)): the rarer of the two kinds
    /// is kept whole and the other subsampled to `round` of the count that gives the share, the
    /// same samples on every run (chosen by a hash of question id and sample index, not by
    /// position). The paper compares data sets of 10 % and 50 % positives this way. A data set
    /// without positives or without negatives is kept as it is (no share can be reached).
    RawShare(f64),
}

impl Curation {
    pub fn apply(self, data: Vec<Sample>) -> Vec<Sample> {
        match self {
            Self::All => data,
            Self::OnePositive => {
                let mut seen = HashSet::new();
                data.into_iter().filter(|s| !s.correct || seen.insert(s.id.clone())).collect()
            }
            Self::RawShare(share) => raw_share(data, share),
        }
    }

    /// Refuses a raw share outside (0, 1).
    pub fn check(self) -> Result<()> {
        match self {
            Self::RawShare(s) if !(s > 0.0 && s < 1.0) => {
                bail!("curation: the raw share of positives must lie in (0, 1), got {s}")
            }
            _ => Ok(()),
        }
    }
}

/// `data` subsampled to the raw share `share` of positives (see [`Curation::RawShare`]); the
/// kept samples stay in their order.
fn raw_share(data: Vec<Sample>, share: f64) -> Vec<Sample> {
    let positives = data.iter().filter(|s| s.correct).count();
    let negatives = data.len() - positives;
    if positives == 0 || negatives == 0 {
        return data;
    }
    // Keep every sample of the kind that limits the share, and `keep` of the other.
    let (thin_positives, keep) = if positives as f64 / data.len() as f64 > share {
        (true, (share * negatives as f64 / (1.0 - share)).round() as usize)
    } else {
        (false, (positives as f64 * (1.0 - share) / share).round() as usize)
    };
    let mut thinned: Vec<(u64, usize)> = data
        .iter()
        .enumerate()
        .filter(|(_, s)| s.correct == thin_positives)
        .map(|(i, s)| (Fnv::default().bytes(s.id.as_bytes()).bytes(&(s.sample as u64).to_le_bytes()).value(), i))
        .collect();
    thinned.sort_unstable();
    let dropped: HashSet<usize> = thinned.iter().skip(keep).map(|&(_, i)| i).collect();
    data.into_iter().enumerate().filter(|(i, _)| !dropped.contains(i)).map(|(_, s)| s).collect()
}

/// The settings of the loop.
///
/// Serialised, they are recorded in `work/settings.json` and in every row of
/// `iterations.jsonl`; a resumed loop must match them field for field, but for `iterations`
/// (which may grow or shrink) and the training's `resume` and `save_every`. `work` is not
/// recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IterateSettings {
    /// The training problems (sampled each iteration) and their prompts.
    pub task: TaskSpec,
    /// The training of each iteration; its `resume` also continues the loop in `work`, and its
    /// `skip_bad_records` also applies to the held-out file.
    pub train: TrainSettings,
    /// How μ samples (and the token budget of the greedy evaluation).
    pub sampling: Sampling,
    /// One folder per iteration, and `iterations.jsonl`.
    #[serde(skip)]
    pub work: PathBuf,
    pub iterations: usize,
    pub samples_per_prompt: usize,
    /// Prompts per generation batch (each with all its samples).
    pub batch_prompts: usize,
    pub curate: Curation,
    /// Held-out problems: a GSM8K file, or else (synthetic task only) `eval_n` synthetic problems
    /// from another seed.
    pub eval_data: Option<PathBuf>,
    pub eval_n: usize,
    pub eval_batch_size: usize,
    /// A folder shared by loops that start from the same model and differ only in training (the
    /// study's arms): the initial evaluation and the first iteration's data set are made there
    /// once and copied into each loop's `work`. They are kept in a sub-folder named by a hash of
    /// everything that makes them (the initial model, task, sampling, sizes, seed, held-out
    /// settings), so loops that differ in any of those do not share; the data set's record is
    /// checked on use as well. Not recorded.
    #[serde(skip)]
    pub shared: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graded(id: usize, sample: usize, correct: bool) -> Sample {
        use crate::dataset::SamplingRecord;
        Sample {
            id: format!("q{id}"),
            sample,
            question: String::new(),
            prompt_ids: vec![1],
            completion: String::new(),
            completion_ids: vec![2],
            logp_mu: vec![0.0],
            logp_sampling: vec![0.0],
            seq_logp_mu: 0.0,
            seq_logp_sampling: 0.0,
            answer: None,
            reference: 0.0,
            correct,
            invalid: false,
            reward: if correct { 1.0 } else { -1.0 },
            stop: crate::generate::Stop::Eos,
            sampling: SamplingRecord { temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: 1, seed: 0 },
        }
    }

    fn keys(d: &[Sample]) -> Vec<(String, usize)> {
        d.iter().map(|s| (s.id.clone(), s.sample)).collect()
    }

    proptest::proptest! {
        /// A raw share keeps the rarer kind whole, thins the other to the rounded count that
        /// gives the share, keeps the samples' order, and picks the same samples whatever their
        /// order in the data set.
        #[test]
        fn raw_share_reaches_the_share(
            kinds in proptest::collection::vec(proptest::bool::ANY, 1..300),
            share in 0.01f64..0.99,
            rotate in 0usize..300,
        ) {
            let data: Vec<Sample> = kinds.iter().enumerate().map(|(i, &c)| graded(i / 4, i % 4, c)).collect();
            let (p, n) = (kinds.iter().filter(|c| **c).count(), kinds.iter().filter(|c| !**c).count());
            let kept = Curation::RawShare(share).apply(data.clone());
            let (kp, kn) = (kept.iter().filter(|s| s.correct).count(), kept.iter().filter(|s| !s.correct).count());
            if p == 0 || n == 0 {
                proptest::prop_assert_eq!(keys(&kept), keys(&data));
            } else if p as f64 / (p + n) as f64 > share {
                proptest::prop_assert_eq!(kn, n);
                proptest::prop_assert_eq!(kp, (share * n as f64 / (1.0 - share)).round() as usize);
            } else {
                proptest::prop_assert_eq!(kp, p);
                proptest::prop_assert_eq!(kn, (p as f64 * (1.0 - share) / share).round() as usize);
            }
            // The kept samples in the data set's order.
            let position = |k: &(String, usize)| keys(&data).iter().position(|d| d == k).unwrap();
            let order: Vec<usize> = keys(&kept).iter().map(position).collect();
            proptest::prop_assert!(order.windows(2).all(|w| w[0] < w[1]));
            // The same samples from a reordered data set.
            let mut rotated = data.clone();
            rotated.rotate_left(rotate % data.len());
            let mut a = keys(&kept);
            let mut b = keys(&Curation::RawShare(share).apply(rotated));
            a.sort();
            b.sort();
            proptest::prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn raw_share_worked_example_and_bad_shares() {
        // 2 positives, 18 negatives: a 50 % share keeps both positives and 2 negatives; a 5 %
        // share keeps the 18 negatives and one positive (18 · 0.05 / 0.95 = 0.947 → 1).
        let data: Vec<Sample> = (0..20).map(|i| graded(i, 0, i < 2)).collect();
        let half = Curation::RawShare(0.5).apply(data.clone());
        assert_eq!((half.len(), half.iter().filter(|s| s.correct).count()), (4, 2));
        let few = Curation::RawShare(0.05).apply(data);
        assert_eq!((few.len(), few.iter().filter(|s| s.correct).count()), (19, 1));
        for bad in [0.0, 1.0, -0.2, f64::NAN] {
            let err = Curation::RawShare(bad).check().unwrap_err().to_string();
            assert!(err.contains("raw share"), "{err}");
        }
        Curation::RawShare(0.1).check().unwrap();
    }
}
