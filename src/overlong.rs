//! DAPO's soft overlong punishment: a reward term on a completion's length, 0 up to a soft
//! limit, then falling linearly over a buffer of tokens to `−penalty_factor` at the maximum
//! length. It is added to each completion's reward before the group advantages.

use crate::error::LossError;
use crate::validate;
use tch::{Kind, Tensor};

/// DAPO's overlong penalty of each completion, from its length in tokens.
///
/// ```text
/// L_soft = max_len − buffer_len
/// P(L) = min(−(L − L_soft) / buffer_len · penalty_factor, 0)
///      = 0                                              L ≤ L_soft
///      = −penalty_factor · (L − L_soft) / buffer_len      L_soft < L ≤ max_len   (−penalty_factor at max_len)
///      = the same line, below −penalty_factor            L > max_len
/// ```
///
/// Beyond `max_len` the crate follows verl's lines: the line goes on with no lower cap
/// (`L = max_len + buffer_len` gets `−2 · penalty_factor`). A sampler that stops at `max_len`
/// never produces such lengths; a length above it means the limits passed here are not the
/// sampler's.
///
/// Where the peers differ (inside the buffer all agree):
/// - TRL `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)` is the paper's
///   Eq. 13: no factor (1), and `−1` for every `L > max_len`.
/// - OpenRLHF `apply_overlong_penalty(.., generate_max_len, overlong_buffer_len,
///   overlong_penalty_factor)` caps the excess at the buffer: `−penalty_factor` for every
///   `L ≥ max_len`.
///
/// Reference: Yu et al., *DAPO*, arXiv 2503.14476, Eq. 13 (`L_max` 20480, `L_cache` 4096);
/// verl 0.9.1 `DAPORewardManager` (`verl/workers/reward_manager/dapo.py`, and
/// `experimental/reward_loop/reward_manager/dapo.py`) with `overlong_buffer_cfg = {enable: True,
/// len: buffer_len, penalty_factor}` and `max_resp_len = max_len`, whose length is the response's
/// attention-mask sum; it adds the term to the score on the last real token. The tests restate
/// verl's three lines (the class needs a tokenizer and verl's `DataProto`, so it is not called).
///
/// # Arguments
/// * `lengths` — any shape (`[B]`, `[G, K]`), integer or floating, `≥ 0`: the completions'
///   token counts (e.g. `mask.sum_dim_intlist(1, false, Kind::Int64)`).
/// * `max_len` — the sampler's maximum completion length (verl's `max_resp_len`).
/// * `buffer_len` — the buffer's length, `1 ≤ buffer_len ≤ max_len` (verl asserts both).
/// * `penalty_factor` — the penalty at `max_len`, finite, `≥ 0` (verl's default 1.0).
///
/// # Returns
/// The penalties, the shape of `lengths`, `≤ 0`, in f64 for f64 lengths and f32 otherwise.
///
/// # Errors
/// [`LossError::UnsupportedTensor`] or [`LossError::WrongDtype`] for `lengths`;
/// [`LossError::EmptyBatch`] for an empty `lengths`; [`LossError::NonFinite`] for a non-finite
/// length; [`LossError::InvalidArgument`] naming `lengths` (a negative length), `buffer_len`
/// (below 1 or above `max_len`) or `penalty_factor` (negative or not finite).
///
/// # Example
/// ```
/// use tch::Tensor;
/// use topr_loss::overlong_penalty;
///
/// let lengths = Tensor::from_slice(&[50i64, 80, 90, 100, 110]);
/// let p = overlong_penalty(&lengths, 100, 20, 1.0)?; // soft limit 80
/// assert_eq!(Vec::<f64>::try_from(&p)?, vec![0.0, 0.0, -0.5, -1.0, -1.5]);
/// // Added to the correctness reward before the group advantages.
/// let score = Tensor::from_slice(&[1.0f32, 1.0, 1.0, -1.0, -1.0]);
/// let reward = &score + &p;
/// assert_eq!(Vec::<f64>::try_from(&reward)?, vec![1.0, 1.0, 0.5, -2.0, -2.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn overlong_penalty(
    lengths: &Tensor,
    max_len: i64,
    buffer_len: i64,
    penalty_factor: f64,
) -> Result<Tensor, LossError> {
    if buffer_len < 1 {
        return Err(bad("buffer_len", buffer_len as f64, "the overlong buffer must hold at least 1 token"));
    }
    if buffer_len > max_len {
        return Err(bad(
            "buffer_len",
            buffer_len as f64,
            &format!("the overlong buffer cannot be longer than `max_len` = {max_len}"),
        ));
    }
    if !(penalty_factor.is_finite() && penalty_factor >= 0.0) {
        return Err(bad("penalty_factor", penalty_factor, "must be finite and >= 0 (the penalty is subtracted)"));
    }
    let len = length_values(lengths)?;
    let lowest = crate::checks::read_f64(&len.f_min()?.f_to_kind(Kind::Double)?)?;
    if lowest < 0.0 {
        return Err(bad("lengths", lowest, "a length must be >= 0"));
    }
    // verl: `min(−(L − (max_len − buffer_len)) / buffer_len · penalty_factor, 0)`; `+ 0.0` turns
    // the −0.0 of a length at the soft limit into 0.
    let exceed = len.f_sub_scalar((max_len - buffer_len) as f64)?;
    let penalty = exceed.f_neg()?.f_div_scalar(buffer_len as f64)?.f_mul_scalar(penalty_factor)?;
    Ok(penalty.f_clamp_max(0.0)?.f_add_scalar(0.0)?)
}

/// `lengths` checked (defined, dense, integer or floating, non-empty, finite), detached, in f64
/// for f64 and f32 otherwise.
fn length_values(lengths: &Tensor) -> Result<Tensor, LossError> {
    validate::real_tensor(lengths, "lengths")?;
    let compute = if lengths.f_kind()? == Kind::Double { Kind::Double } else { Kind::Float };
    if lengths.numel() == 0 {
        return Err(LossError::EmptyBatch { argument: "lengths", found: lengths.size(), unit: "completion" });
    }
    let len = lengths.f_detach()?.f_to_kind(compute)?;
    validate::finite(&len, "lengths", None)?;
    Ok(len)
}

fn bad(argument: &'static str, value: f64, reason: &str) -> LossError {
    LossError::InvalidArgument { argument, value, reason: reason.into() }
}
