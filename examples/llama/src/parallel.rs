//! Data-parallel training over a c10d process group ([`topr_dist`]): each rank takes its
//! contiguous share of every optimiser step's units, the step's counts (tokens, sequences,
//! pairs) are summed over ranks before any loss is computed, and the gradients are summed over
//! ranks before clipping and the update, so that every rank takes exactly the step one process
//! takes on the whole batch (up to the order of float additions). See `docs/distributed.md`.
//!
//! Every function takes `Option<&ProcessGroup>`: `None` is one process, and then each is the
//! identity (no copy, no collective).

use crate::shard::Shard;
use anyhow::Result;
use tch::{Kind, Tensor};
pub use topr_dist::{Launch, ProcessGroup};

/// This process's share: `rank/world_size`, or the whole.
pub fn shard(group: Option<&ProcessGroup>) -> Shard {
    group.map_or(Shard::WHOLE, |g| Shard { index: g.rank(), count: g.world_size() })
}

/// Whether this process writes the run's shared outputs (rank 0, or the only process).
pub fn is_main(group: Option<&ProcessGroup>) -> bool {
    group.is_none_or(ProcessGroup::is_main)
}

/// Sums `values` over the ranks, in place.
pub fn sum(group: Option<&ProcessGroup>, values: &mut [f64]) -> Result<()> {
    if let Some(g) = group {
        g.all_reduce_f64(values)?;
    }
    Ok(())
}

/// Every rank's `row` (all of one length), in rank order: an all-gather, done as the sum of
/// rows placed in a `[world, len]` matrix of zeros (exact: each entry is one rank's value plus
/// zeros).
pub fn gather(group: Option<&ProcessGroup>, row: &[f64]) -> Result<Vec<Vec<f64>>> {
    let Some(g) = group else { return Ok(vec![row.to_vec()]) };
    let mut all = vec![0.0; g.world_size() * row.len()];
    all[g.rank() * row.len()..(g.rank() + 1) * row.len()].copy_from_slice(row);
    g.all_reduce_f64(&mut all)?;
    Ok(all.chunks(row.len().max(1)).map(<[f64]>::to_vec).collect())
}

/// Sums the gradients of `vars` over the ranks. A rank whose share of the step was empty holds
/// no gradient yet: it joins with zeros.
pub fn sum_gradients(group: Option<&ProcessGroup>, vars: &[Tensor]) -> Result<()> {
    let Some(g) = group else { return Ok(()) };
    if vars.iter().any(|v| !v.grad().defined()) {
        let zero = vars.iter().map(|v| v.sum(Kind::Float) * 0.0).fold(Tensor::from(0.0f32), |a, b| a + b);
        zero.backward();
    }
    g.all_reduce_gradients(vars)?;
    Ok(())
}

/// Waits for every rank (the main rank's writes are then visible to the others on a shared
/// file system).
pub fn barrier(group: Option<&ProcessGroup>) -> Result<()> {
    if let Some(g) = group {
        g.barrier()?;
    }
    Ok(())
}

/// Every rank's `bytes`, in rank order (an all-gather of byte strings of any lengths: the
/// lengths first, then the bytes placed in a buffer of zeros and summed, which is exact).
pub fn gather_bytes(group: Option<&ProcessGroup>, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let Some(g) = group else { return Ok(vec![bytes.to_vec()]) };
    let lengths: Vec<usize> = gather(group, &[bytes.len() as f64])?.iter().map(|r| r[0] as usize).collect();
    let offset: usize = lengths[..g.rank()].iter().sum();
    let total: usize = lengths.iter().sum();
    if total == 0 {
        return Ok(vec![vec![]; lengths.len()]);
    }
    let mut all = vec![0u8; total];
    all[offset..offset + bytes.len()].copy_from_slice(bytes);
    let mut t = Tensor::from_slice(&all);
    g.all_reduce_sum(&mut t)?;
    t.f_copy_data(&mut all, total)?;
    let mut out = vec![];
    let mut at = 0;
    for n in lengths {
        out.push(all[at..at + n].to_vec());
        at += n;
    }
    Ok(out)
}

/// Refuses to go on, on every rank alike, unless every rank's `record` of what it was started
/// with (settings, the model's and the data's identity) is rank 0's, but for the fields in
/// `may_differ` (dotted paths, e.g. `model.path`: copies of one model at other paths are the same
/// model). A group started with other arguments on some rank would otherwise train one model on
/// a mix of both. The error lists, per rank, each field that differs (`field rank 0's → its`).
/// Every rank gathers every record, so every rank reaches the same verdict and none is left
/// waiting.
pub fn agree<T: serde::Serialize>(
    group: Option<&ProcessGroup>,
    what: &str,
    record: &T,
    may_differ: &[&str],
) -> Result<()> {
    let Some(g) = group else { return Ok(()) };
    if g.world_size() < 2 {
        return Ok(());
    }
    let records = gather_bytes(group, &serde_json::to_vec(record)?)?;
    let parsed: Vec<serde_json::Value> = records.iter().map(|r| serde_json::from_slice(r)).collect::<Result<_, _>>()?;
    let mut disagreements = vec![];
    for (rank, r) in parsed.iter().enumerate().skip(1) {
        let d = crate::identity::differences(&parsed[0], r, may_differ);
        if !d.is_empty() {
            disagreements.push(format!("rank {rank}: {}", d.join(", ")));
        }
    }
    if !disagreements.is_empty() {
        anyhow::bail!(
            "the ranks of the group were started with different {what} inputs or settings (rank 0's → the other rank's): {}; start every rank with the same arguments, data and model",
            disagreements.join("; ")
        );
    }
    Ok(())
}

/// Whether rank 0 says so: rank 0's `value` on every rank.
pub fn main_says(group: Option<&ProcessGroup>, value: bool) -> Result<bool> {
    let Some(g) = group else { return Ok(value) };
    let mut flag = [if g.is_main() && value { 1.0 } else { 0.0 }];
    g.all_reduce_f64(&mut flag)?;
    Ok(flag[0] > 0.0)
}

/// Whether `cond` holds on rank 0, on every rank (evaluated on rank 0 only): for a decision
/// about files only rank 0 writes, e.g. whether a stage is finished.
pub fn main_sees(group: Option<&ProcessGroup>, cond: impl FnOnce() -> bool) -> Result<bool> {
    let value = is_main(group) && cond();
    main_says(group, value)
}

/// Runs `f` on rank 0, then (after a barrier) on the other ranks: for a step whose files rank 0
/// settles and the others then read (a resumed training state). Every rank reaches the barrier,
/// whatever `f` returned on rank 0, so an error there does not leave the others waiting.
pub fn main_first<T>(group: Option<&ProcessGroup>, mut f: impl FnMut() -> T) -> Result<T> {
    let first = is_main(group).then(&mut f);
    barrier(group)?;
    Ok(match first {
        Some(v) => v,
        None => f(),
    })
}

/// Runs `f` on rank 0 only (the writes of the run's shared outputs); `None` on the others.
pub fn on_main<T>(group: Option<&ProcessGroup>, f: impl FnOnce() -> Result<T>) -> Result<Option<T>> {
    if is_main(group) { f().map(Some) } else { Ok(None) }
}
