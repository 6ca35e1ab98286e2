//! CUDA graphs: a piece of GPU work recorded once and replayed with one launch.
//!
//! A decoding step of a small model is hundreds of small kernels, and launching them one by one
//! from the host takes longer than the GPU takes to run them. Recorded as a CUDA graph, the whole
//! step is one launch. What is recorded is fixed: the kernels, their shapes and the addresses of
//! every tensor they read and write, so the step must run on fixed shapes, update its state in
//! place and read nothing back to the host ([`crate::model::Llama::decode`] and the decoding state
//! of [`crate::generate`] are written so). The graph comes from libtorch's `at::cuda::CUDAGraph`,
//! which tch does not wrap, through a small C++ file (`csrc/cuda_graph.cpp`); it is compiled when
//! the libtorch is a CUDA build, and [`available`] says whether it was.

use anyhow::{Result, bail};
use tch::Device;

#[cfg(topr_cuda_graphs)]
mod ffi {
    use std::ffi::{c_char, c_int, c_void};
    unsafe extern "C" {
        pub fn topr_cuda_graph_new(err: *mut c_char, cap: usize) -> *mut c_void;
        pub fn topr_cuda_graph_pool(first: *mut u64, second: *mut u64, err: *mut c_char, cap: usize) -> c_int;
        pub fn topr_cuda_graph_begin(
            g: *mut c_void,
            device: c_int,
            pool_first: u64,
            pool_second: u64,
            err: *mut c_char,
            cap: usize,
        ) -> c_int;
        pub fn topr_cuda_graph_end(g: *mut c_void, err: *mut c_char, cap: usize) -> c_int;
        pub fn topr_cuda_graph_replay(g: *mut c_void, err: *mut c_char, cap: usize) -> c_int;
        pub fn topr_cuda_graph_free(g: *mut c_void);
    }
}

/// Whether this build can record CUDA graphs (its libtorch is a CUDA build). A GPU is still
/// needed to record one.
pub fn available() -> bool {
    cfg!(topr_cuda_graphs)
}

/// A recorded piece of GPU work ([`CudaGraph::capture`]), replayed by [`CudaGraph::replay`]. The
/// tensors it read and wrote during the capture must stay alive, at the same addresses, while it
/// is replayed.
pub struct CudaGraph {
    #[cfg(topr_cuda_graphs)]
    raw: std::ptr::NonNull<std::ffi::c_void>,
}

#[cfg(topr_cuda_graphs)]
const ERR_CAP: usize = 1024;

#[cfg(topr_cuda_graphs)]
fn check(rc: std::ffi::c_int, err: &[u8], what: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    bail!("CUDA graph {what} failed: {}", crate::onednn::shim_message(err))
}

/// A memory pool that several graphs record into ([`CudaGraph::capture_in`]): the tensors their
/// steps allocate share one pool instead of one each. Safe when no tensor a recorded step
/// allocates outlives the step and the graphs never replay at the same time (one stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphPool(u64, u64);

impl GraphPool {
    /// A new pool (libtorch's `at::cuda::graph_pool_handle`).
    ///
    /// ```
    /// use topr_llama::cuda_graph::{CudaGraph, GraphPool};
    /// // Recording needs a CUDA device, into a pool or not; a build without CUDA has no pools.
    /// let pool = GraphPool::new().ok();
    /// assert!(CudaGraph::capture_in(tch::Device::Cpu, pool, || Ok(())).is_err());
    /// ```
    pub fn new() -> Result<Self> {
        #[cfg(topr_cuda_graphs)]
        {
            let (mut first, mut second, mut err) = (0u64, 0u64, [0u8; ERR_CAP]);
            // SAFETY: the shim writes the two halves of a new pool id, or a message; it catches
            // every C++ exception.
            let rc = unsafe { ffi::topr_cuda_graph_pool(&mut first, &mut second, err.as_mut_ptr().cast(), ERR_CAP) };
            check(rc, &err, "pool")?;
            Ok(Self(first, second))
        }
        #[cfg(not(topr_cuda_graphs))]
        bail!("this build's libtorch is not a CUDA build: it has no CUDA graph pools")
    }
}

impl CudaGraph {
    /// Records the libtorch operations that `body` issues on `device` (a CUDA device) as a graph:
    /// they are recorded, not run (replay the graph to run them). Recording happens on a side
    /// stream, after the device has finished its earlier work and the allocator has released its
    /// unused cached memory; `body` must not read from the device to the host, nor allocate
    /// pinned host memory. The tensors it allocates come from a pool of the graph's own.
    pub fn capture(device: Device, body: impl FnOnce() -> Result<()>) -> Result<Self> {
        Self::capture_in(device, None, body)
    }

    /// [`CudaGraph::capture`] into `pool`, shared with the other graphs recorded into it.
    pub fn capture_in(device: Device, pool: Option<GraphPool>, body: impl FnOnce() -> Result<()>) -> Result<Self> {
        let Device::Cuda(index) = device else {
            bail!("CUDA graphs need a CUDA device, not {device:?}");
        };
        Self::capture_on(index, pool.unwrap_or(GraphPool(0, 0)), body)
    }

    #[cfg(topr_cuda_graphs)]
    fn capture_on(index: usize, pool: GraphPool, body: impl FnOnce() -> Result<()>) -> Result<Self> {
        let mut err = [0u8; ERR_CAP];
        // SAFETY: the shim allocates a graph or returns null with a message; it catches every
        // C++ exception.
        let raw = unsafe { ffi::topr_cuda_graph_new(err.as_mut_ptr().cast(), ERR_CAP) };
        let Some(raw) = std::ptr::NonNull::new(raw) else {
            bail!("CUDA graph creation failed: {}", crate::onednn::shim_message(&err));
        };
        let graph = Self { raw };
        tch::Cuda::synchronize(index as i64);
        // SAFETY: `raw` is a live graph, owned by `graph`.
        check(
            unsafe {
                ffi::topr_cuda_graph_begin(raw.as_ptr(), index as _, pool.0, pool.1, err.as_mut_ptr().cast(), ERR_CAP)
            },
            &err,
            "capture",
        )?;
        // A panic of a libtorch operation inside `body` must not leave the stream capturing: the
        // capture is ended first, then the panic goes on.
        let recorded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
        // SAFETY: as above; the capture is ended whether `body` succeeded, failed or panicked.
        let ended =
            check(unsafe { ffi::topr_cuda_graph_end(raw.as_ptr(), err.as_mut_ptr().cast(), ERR_CAP) }, &err, "capture");
        let recorded = recorded.unwrap_or_else(|p| std::panic::resume_unwind(p));
        recorded?;
        ended?;
        Ok(graph)
    }

    #[cfg(not(topr_cuda_graphs))]
    fn capture_on(_: usize, _: GraphPool, _: impl FnOnce() -> Result<()>) -> Result<Self> {
        bail!("this build's libtorch is not a CUDA build: it cannot record CUDA graphs")
    }

    /// Runs the recorded work once, on the current stream.
    pub fn replay(&self) -> Result<()> {
        #[cfg(topr_cuda_graphs)]
        {
            let mut err = [0u8; ERR_CAP];
            // SAFETY: `self.raw` is a live, captured graph.
            check(
                unsafe { ffi::topr_cuda_graph_replay(self.raw.as_ptr(), err.as_mut_ptr().cast(), ERR_CAP) },
                &err,
                "replay",
            )
        }
        #[cfg(not(topr_cuda_graphs))]
        bail!("this build's libtorch is not a CUDA build: it cannot replay CUDA graphs")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: `self.raw` came from `topr_cuda_graph_new` and is freed once, here.
        #[cfg(topr_cuda_graphs)]
        unsafe {
            ffi::topr_cuda_graph_free(self.raw.as_ptr())
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU a capture is refused with an error naming the device; nothing is recorded.
    #[test]
    fn a_capture_on_the_cpu_is_refused() {
        let mut ran = false;
        let err = CudaGraph::capture(Device::Cpu, || {
            ran = true;
            Ok(())
        })
        .err()
        .expect("the CPU has no CUDA graphs");
        assert!(err.to_string().contains("Cpu"), "{err}");
        assert!(!ran);
    }
}
