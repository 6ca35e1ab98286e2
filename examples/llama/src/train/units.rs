//! What training is made of: the units of a data set for an objective (a completion with the
//! value its loss weighs it by, or a DPO pair; group advantages computed here) and the
//! right-padded tensors of a micro-batch of them.

use crate::dataset::Sample;
use crate::settings::{Advantage, Objective};
use anyhow::{Result, bail};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};
use topr_loss::{
    GroupAdvantage, LensConfig, SingletonGroup, gdpo_advantages, group_advantages, lens_advantages, maxrl_advantages,
    opo_advantages, passk_advantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
};

/// A training unit: one completion with the value its loss weighs it by (the reward for the TOPR
/// family, the advantage for PPO and GRPO), or, for DPO, a (chosen, rejected) pair.
#[derive(Debug, Clone, Copy)]
pub enum Unit<'a> {
    Single(&'a Sample, f32),
    Pair(&'a Sample, &'a Sample),
}

impl Unit<'_> {
    /// Completions in this unit.
    pub fn completions(&self) -> usize {
        match self {
            Self::Single(..) => 1,
            Self::Pair(..) => 2,
        }
    }
}

/// Samples grouped by question id, in order of first appearance.
fn groups(samples: &[Sample]) -> Vec<Vec<&Sample>> {
    let mut index: BTreeMap<&str, usize> = BTreeMap::new();
    let mut out: Vec<Vec<&Sample>> = vec![];
    for s in samples {
        let k = *index.entry(&s.id).or_insert_with(|| {
            out.push(vec![]);
            out.len() - 1
        });
        out[k].push(s);
    }
    out
}

/// The training units of `samples` for `objective` with baseline `c`: group advantages (GRPO's)
/// are computed per question over all its completions in the data set; DPO pairs the i-th correct
/// with the i-th incorrect completion of each question.
pub fn units(samples: &[Sample], objective: Objective, c: f64) -> Result<Vec<Unit<'_>>> {
    units_with(samples, objective, c, Advantage::Grpo)
}

/// [`units`] with the group-advantage objectives' estimator `advantage`.
pub fn units_with(samples: &[Sample], objective: Objective, c: f64, advantage: Advantage) -> Result<Vec<Unit<'_>>> {
    Ok(match objective {
        Objective::Ppo => samples.iter().map(|s| Unit::Single(s, (s.reward - c) as f32)).collect(),
        o if o.uses_group_advantages() => group_units(samples, advantage)?,
        Objective::Dpo => {
            let mut out = vec![];
            for g in groups(samples) {
                let pos = g.iter().filter(|s| s.reward > 0.0);
                let neg = g.iter().filter(|s| s.reward <= 0.0);
                out.extend(pos.zip(neg).map(|(w, l)| Unit::Pair(w, l)));
            }
            if out.is_empty() {
                bail!("DPO needs questions with both a correct and an incorrect completion; this data set has none");
            }
            out
        }
        _ => samples.iter().map(|s| Unit::Single(s, s.reward as f32)).collect(),
    })
}

/// Pass@k advantages of each question's completions (normalised by the group's std, as verl's
/// default), in group order; a question with one completion is refused.
fn passk_values(groups: &[Vec<&Sample>]) -> Result<Vec<f64>> {
    let mut out = vec![];
    for g in groups {
        if g.len() < 2 {
            bail!("--advantage passk needs at least 2 completions a question ({} has 1)", g[0].id);
        }
        let r = Tensor::from_slice(&g.iter().map(|s| s.reward).collect::<Vec<_>>()).view([1, -1]);
        out.extend(Vec::<f64>::try_from(passk_advantages(&r, true, 1e-6)?.flatten(0, -1))?);
    }
    Ok(out)
}

/// Each completion with its group advantage under `advantage` (see [`Advantage`]).
fn group_units(samples: &[Sample], advantage: Advantage) -> Result<Vec<Unit<'_>>> {
    let groups = groups(samples);
    let per_group = |method: GroupAdvantage| -> Result<Vec<f64>> {
        let mut out = vec![];
        for g in &groups {
            let r = Tensor::from_slice(&g.iter().map(|s| s.reward).collect::<Vec<_>>()).view([1, -1]);
            out.extend(Vec::<f64>::try_from(group_advantages(&r, method)?.flatten(0, -1))?);
        }
        Ok(out)
    };
    let values: Vec<f64> = match advantage {
        Advantage::Grpo => per_group(GroupAdvantage::grpo())?,
        Advantage::DrGrpo => per_group(GroupAdvantage::DrGrpo)?,
        Advantage::Rloo => per_group(GroupAdvantage::Rloo)?,
        Advantage::Passk => passk_values(&groups)?,
        other => batch_values(&groups, other)?,
    };
    Ok(groups.iter().flatten().zip(values).map(|(s, a)| Unit::Single(s, a as f32)).collect())
}

/// The advantages of the estimators that need the data set as one `[G, K]` table (every
/// question with the same number of completions), in group order.
fn batch_values(groups: &[Vec<&Sample>], other: Advantage) -> Result<Vec<f64>> {
    // The batch-level estimators need the data set as one [G, K] table.
    let k = groups[0].len();
    if groups.iter().any(|g| g.len() != k) {
        bail!(
            "--advantage {other:?} needs the same number of completions for every question \
             (sample with a fixed --samples-per-question)"
        );
    }
    let g = groups.len() as i64;
    let rewards: Vec<f64> = groups.iter().flatten().map(|s| s.reward).collect();
    let r = Tensor::from_slice(&rewards).view([g, k as i64]);
    let lens: Vec<i64> = groups.iter().flatten().map(|s| s.completion_ids.len() as i64).collect();
    let t = lens.iter().copied().max().unwrap_or(1).max(1);
    let lengths = Tensor::from_slice(&lens);
    let mask = Tensor::arange(t, (Kind::Int64, tch::Device::Cpu)).unsqueeze(0).lt_tensor(&lengths.unsqueeze(1));
    // Token-level estimators give every token of a completion the same value here
    // (outcome rewards, γ = 1): a completion's advantage is its first token's.
    let first_token = |a: Tensor| -> Result<Vec<f64>> { Ok(Vec::<f64>::try_from(a.select(1, 0))?) };
    Ok(match other {
        Advantage::BatchStd => Vec::<f64>::try_from(group_advantages(&r, GroupAdvantage::batch_std())?.flatten(0, -1))?,
        Advantage::Opo => Vec::<f64>::try_from(
            opo_advantages(&r, &lengths.view([g, k as i64]), SingletonGroup::OwnMean)?.flatten(0, -1),
        )?,
        Advantage::Gdpo => {
            let dims: Vec<f64> = groups
                .iter()
                .flatten()
                .flat_map(|s| [f64::from(u8::from(s.correct)), f64::from(u8::from(!s.invalid))])
                .collect();
            let r = Tensor::from_slice(&dims).view([g, k as i64, 2]);
            let grpo = GroupAdvantage::grpo();
            first_token(gdpo_advantages(&r, &[1.0, 1.0], &mask, grpo, SingletonGroup::ZeroMeanUnitStd)?)?
        }
        Advantage::Maxrl => {
            Vec::<f64>::try_from(maxrl_advantages(&correctness(groups, g, k as i64), 1e-6)?.flatten(0, -1))?
        }
        Advantage::Lens => lens_values(groups, g, k as i64, t, &mask)?,
        Advantage::ReinforcePpBaseline => {
            first_token(reinforce_pp_baseline_advantages(&r, &mask, 1e-8, SingletonGroup::OwnMean)?)?
        }
        _ => {
            // REINFORCE++: the outcome reward on each completion's last token.
            let last = (&lengths - 1).clamp_min(0).unsqueeze(1);
            let tr = Tensor::zeros([g * k as i64, t], (Kind::Double, tch::Device::Cpu)).scatter(
                1,
                &last,
                &Tensor::from_slice(&rewards).unsqueeze(1),
            );
            first_token(reinforce_pp_advantages(&tr, &mask, 1.0, 1e-8)?.advantages)?
        }
    })
}

/// LENS advantages on correctness, μ's per-token log-probs `[G·K, T]` (right-padded by `mask`)
/// giving each wrong answer's confidence.
fn lens_values(groups: &[Vec<&Sample>], g: i64, k: i64, t: i64, mask: &Tensor) -> Result<Vec<f64>> {
    let mut logp = vec![0f64; (g * k * t) as usize];
    for (row, s) in groups.iter().flatten().enumerate() {
        for (j, lp) in s.logp_mu.iter().enumerate() {
            logp[row * t as usize + j] = f64::from(*lp);
        }
    }
    let logp = Tensor::from_slice(&logp).view([g * k, t]);
    let a = lens_advantages(&correctness(groups, g, k), &logp, mask, &LensConfig::lens())?;
    Ok(Vec::<f64>::try_from(a.flatten(0, -1))?)
}

/// Each completion's correctness, 1 or 0, as the `[G, K]` rewards of MaxRL and LENS.
fn correctness(groups: &[Vec<&Sample>], g: i64, k: i64) -> Tensor {
    let correct: Vec<f64> = groups.iter().flatten().map(|s| f64::from(u8::from(s.correct))).collect();
    Tensor::from_slice(&correct).view([g, k])
}

/// Right-padded tensors of a micro-batch: `ids [b, L]`, attention mask `[b, L]`, and, aligned with
/// the next-token predictions at positions `from..L−1`, the labels, the completion mask, μ's
/// log-probs `[b, L−1−from]`, with the per-row values `[b]` (rewards or advantages).
///
/// `from` is the first position whose prediction a completion needs (the shortest prompt's
/// length − 1): the prompt positions before it predict prompt tokens only, so the training
/// forward makes no logits there ([`crate::model::Llama::next_token_logits`]). With prompts of
/// about the completions' length, that is about half of the output layer's products (forward and
/// backward) and of the `[b·L, vocab]` logits and their gradient; the log-softmax ran on the
/// completion's tokens only before, too (verl and OpenRLHF keep the response's logits only,
/// too). With every completion empty and the prompts of one length (two tokens or more), `from`
/// is the last position but one, so that the tensors keep one (masked) column rather than none.
pub struct MicroBatch {
    pub ids: Tensor,
    pub attn: Tensor,
    /// The first prediction position of `labels`, `mask` and `logp_mu`.
    pub from: i64,
    pub labels: Tensor,
    pub mask: Tensor,
    pub logp_mu: Tensor,
    pub values: Tensor,
    /// `[b]` bool: whether each completion was graded correct.
    pub correct: Tensor,
}

pub fn micro_batch(rows: &[(&Sample, f32)], device: tch::Device) -> MicroBatch {
    // At least two positions, so that the batch keeps one (masked) column even when every row is
    // a one-token prompt with an empty completion: the second is padding, predicted by none.
    let len = rows.iter().map(|(s, _)| s.prompt_ids.len() + s.completion_ids.len()).max().unwrap_or(1).max(2);
    // A record's prompt holds at least one token (`Sample::check`): its last position predicts
    // the first completion token.
    let from = rows.iter().map(|(s, _)| s.prompt_ids.len().max(1) - 1).min().unwrap_or(0).min(len.saturating_sub(2));
    let (b, w) = (rows.len(), len - 1 - from);
    let mut ids = vec![0i64; b * len];
    let mut attn = vec![0i64; b * len];
    let mut mask = vec![false; b * w];
    let mut mu = vec![0f32; b * w];
    for (r, (s, _)) in rows.iter().enumerate() {
        let all: Vec<i64> = s.prompt_ids.iter().chain(&s.completion_ids).copied().collect();
        ids[r * len..r * len + all.len()].copy_from_slice(&all);
        attn[r * len..r * len + all.len()].iter_mut().for_each(|a| *a = 1);
        // Completion token k sits at position p + k and is predicted at position p + k − 1,
        // column p + k − 1 − from.
        let p = s.prompt_ids.len();
        for (k, lp) in s.logp_mu.iter().enumerate() {
            mask[r * w + p + k - 1 - from] = true;
            mu[r * w + p + k - 1 - from] = *lp;
        }
    }
    let (b, l, from, w) = (b as i64, len as i64, from as i64, w as i64);
    let ids = Tensor::from_slice(&ids).view([b, l]).to_device(device);
    MicroBatch {
        labels: ids.narrow(1, from + 1, w),
        ids,
        attn: Tensor::from_slice(&attn).view([b, l]).to_device(device),
        from,
        mask: Tensor::from_slice(&mask).view([b, w]).to_device(device),
        logp_mu: Tensor::from_slice(&mu).view([b, w]).to_device(device),
        values: Tensor::from_slice(&rows.iter().map(|r| r.1).collect::<Vec<_>>()).to_device(device),
        correct: Tensor::from_slice(&rows.iter().map(|r| r.0.correct).collect::<Vec<_>>()).to_device(device),
    }
}

/// The micro-batches of one step's units, about `micro` completions each: singles as they come;
/// pairs as `[chosen…, rejected…]`.
pub(super) fn micro_batches(batch: &[Unit], micro: usize, device: tch::Device) -> Result<Vec<MicroBatch>> {
    let per_micro = match batch.first() {
        Some(u) => (micro / u.completions()).max(1),
        None => bail!("an optimiser step needs at least one completion"),
    };
    Ok(batch
        .chunks(per_micro)
        .map(|c| {
            let mut rows: Vec<(&Sample, f32)> = vec![];
            let mut second = vec![];
            for u in c {
                match *u {
                    Unit::Single(s, v) => rows.push((s, v)),
                    Unit::Pair(w, l) => {
                        rows.push((w, 0.0));
                        second.push((l, 0.0));
                    }
                }
            }
            rows.extend(second);
            micro_batch(&rows, device)
        })
        .collect())
}
