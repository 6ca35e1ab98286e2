//! Allocations checked before they are made: a size the machine cannot hold is refused with an
//! error naming it ([`fits`]), rather than ending in a failed allocation (a panic in libtorch's
//! infallible calls) or, on overcommitted memory, in the kernel's out-of-memory kill once the
//! pages are touched.

use anyhow::{Result, bail};
use tch::Device;

/// `bytes` as `12.9 GB`.
pub fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// The memory the kernel says a new allocation can take (Linux: `MemAvailable` of
/// `/proc/meminfo`), if known.
pub fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Refuses `bytes` of CPU tensors for `what` (e.g. "the KV cache of 64 slots") that the
/// available memory cannot hold. On a GPU nothing is refused here: libtorch's
/// CUDA out-of-memory error is clean, and callers using fallible calls return it.
///
/// ```
/// # use tch::Device;
/// assert!(topr_llama::memory::fits(Device::Cpu, 1 << 20, "a megabyte").is_ok());
/// let err = topr_llama::memory::fits(Device::Cpu, u64::MAX, "the tensors").unwrap_err();
/// assert!(err.to_string().starts_with("the tensors would take 18446744073.7 GB"));
/// ```
pub fn fits(device: Device, bytes: u64, what: &str) -> Result<()> {
    if device == Device::Cpu
        && let Some(free) = available()
        && bytes > free
    {
        bail!("{what} would take {}, and {} of memory is available: use smaller sizes", gb(bytes), gb(free));
    }
    Ok(())
}
