//! Data-parallel collectives for [`tch`] on PyTorch's own engine.
//!
//! tch exposes no `torch.distributed` (tch-rs's GitHub issue 936). This crate reaches the engine behind
//! it, c10d, through a small C++ shim compiled against the libtorch that tch links: a `TCPStore`
//! rendezvous and a Gloo process group, the pair `torch.distributed.init_process_group("gloo")`
//! creates. No protocol of our own: the bytes on the wire are Gloo's, the rendezvous is the one
//! torchrun's workers use, and processes are launched the way torchrun launches them (`RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
//!
//! What it offers is what a data-parallel training step needs: [`ProcessGroup::all_reduce_sum`]
//! (gradients, counts), [`ProcessGroup::broadcast`] and [`ProcessGroup::barrier`], plus
//! [`ProcessGroup::all_reduce_gradients`], which sums the gradients of a model's parameters in
//! buckets the way PyTorch DDP does, and [`ProcessGroup::all_reduce_f64`] for scalars.
//!
//! Failures are errors, never hangs: a rank that dies makes the collectives of the others fail
//! (Gloo sees the connection close), and every collective and the rendezvous are bounded by the
//! group's time-out.
//!
//! Gloo works on CPU tensors (and stages CUDA tensors through the host); in a build against a
//! CUDA libtorch, [`ProcessGroup::use_nccl`] adds NCCL, the GPU engine of the same c10d, for CUDA
//! tensors (see `docs/distributed.md`).
//!
//! ```no_run
//! use std::time::Duration;
//! use tch::Tensor;
//! use topr_dist::{Launch, ProcessGroup};
//!
//! // Run as `RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 prog` and
//! // `RANK=1 WORLD_SIZE=2 ... prog` (or under torchrun).
//! let launch = Launch::from_env()?.expect("not launched as a group");
//! let pg = ProcessGroup::join(&launch, Duration::from_secs(60))?;
//! let mut t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
//! pg.all_reduce_sum(&mut t)?;
//! assert_eq!(t.double_value(&[0]), 3.0); // 1 + 2
//! # Ok::<(), topr_dist::DistError>(())
//! ```

#![warn(missing_docs)]

use std::ffi::{CString, c_char, c_int, c_void};
use std::ptr::NonNull;
use std::time::Duration;
use tch::Tensor;

/// What can go wrong joining a group or running a collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A launch variable is missing or unreadable.
    #[error("{var}={value:?}: {reason}")]
    Env {
        /// The variable's name (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, …).
        var: &'static str,
        /// What it held (empty when unset).
        value: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The rendezvous or the process group could not be set up.
    #[error("rank {rank} of {world_size} could not join the group at {addr}: {message}")]
    Join {
        /// This process's rank.
        rank: usize,
        /// The group's size.
        world_size: usize,
        /// The rendezvous address, `host:port`.
        addr: String,
        /// c10d's message, on one line.
        message: String,
    },
    /// A collective failed: a peer died, or it timed out.
    #[error("rank {rank}: {op} failed (a peer exited or stalled?): {message}")]
    Collective {
        /// This process's rank.
        rank: usize,
        /// What failed: the collective (`all-reduce`, `broadcast`, `barrier`) or the NCCL set-up.
        op: &'static str,
        /// c10d's message, on one line.
        message: String,
    },
    /// A tensor the collective cannot take.
    #[error("{arg}: {reason}")]
    Tensor {
        /// The argument that holds it.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// How this process joins its group, as torchrun says it: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// How many processes the group has.
    pub world_size: usize,
    /// Where rank 0 serves the rendezvous store.
    pub master_addr: String,
    /// Its port.
    pub master_port: u16,
}

impl Launch {
    /// The launch described by the environment; `None` when `WORLD_SIZE` is not set (a process
    /// started on its own). `MASTER_ADDR` defaults to `127.0.0.1` and `MASTER_PORT` to 29500, as
    /// in torchrun; `RANK` is required with `WORLD_SIZE`.
    ///
    /// ```
    /// // Not launched by torchrun or a launcher that sets WORLD_SIZE:
    /// unsafe { std::env::remove_var("WORLD_SIZE") };
    /// assert_eq!(topr_dist::Launch::from_env()?, None);
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn from_env() -> Result<Option<Self>, DistError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// A group of this process alone, its rendezvous on a free loopback port: what a
    /// data-parallel code path runs on with one process (every collective is then the identity),
    /// and what the examples of this crate use.
    ///
    /// ```
    /// let l = topr_dist::Launch::single()?;
    /// assert_eq!((l.rank, l.world_size, l.master_addr.as_str()), (0, 1, "127.0.0.1"));
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn single() -> Result<Self, DistError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| DistError::Env { var: "MASTER_PORT", value: "0".into(), reason: e.to_string() })?
            .port();
        Ok(Self { rank: 0, world_size: 1, master_addr: "127.0.0.1".into(), master_port: port })
    }

    /// [`Launch::from_env`] over any source of variables (for tests and launchers).
    ///
    /// ```
    /// let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29600")];
    /// let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
    /// let l = topr_dist::Launch::from_vars(get)?.unwrap();
    /// assert_eq!((l.rank, l.world_size, l.master_addr.as_str(), l.master_port), (1, 2, "127.0.0.1", 29600));
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, DistError> {
        let Some(world) = get("WORLD_SIZE") else { return Ok(None) };
        let parse = |var: &'static str, value: String| {
            value.trim().parse::<usize>().map_err(|e| DistError::Env { var, value, reason: e.to_string() })
        };
        let world_size = parse("WORLD_SIZE", world)?;
        if world_size == 0 {
            return Err(DistError::Env { var: "WORLD_SIZE", value: "0".into(), reason: "must be >= 1".into() });
        }
        let rank = match get("RANK") {
            Some(v) => parse("RANK", v)?,
            None => {
                return Err(DistError::Env {
                    var: "RANK",
                    value: String::new(),
                    reason: "not set, but WORLD_SIZE is: every process of a group needs its rank".into(),
                });
            }
        };
        if rank >= world_size {
            return Err(DistError::Env {
                var: "RANK",
                value: rank.to_string(),
                reason: format!("must lie in 0..{world_size} (WORLD_SIZE)"),
            });
        }
        let master_port = match get("MASTER_PORT") {
            Some(v) => v.trim().parse::<u16>().map_err(|e| DistError::Env {
                var: "MASTER_PORT",
                value: v.clone(),
                reason: e.to_string(),
            })?,
            None => 29500,
        };
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        Ok(Some(Self { rank, world_size, master_addr, master_port }))
    }
}

#[repr(C)]
struct RawGroup {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn topr_pg_new_gloo(
        host: *const c_char,
        port: u16,
        rank: c_int,
        world_size: c_int,
        timeout_ms: i64,
        err: *mut c_char,
        cap: usize,
    ) -> *mut RawGroup;
    fn topr_pg_free(pg: *mut RawGroup);
    fn topr_pg_all_reduce_sum(pg: *mut RawGroup, t: *mut c_void, err: *mut c_char, cap: usize) -> c_int;
    fn topr_pg_broadcast(pg: *mut RawGroup, t: *mut c_void, root: c_int, err: *mut c_char, cap: usize) -> c_int;
    fn topr_pg_barrier(pg: *mut RawGroup, err: *mut c_char, cap: usize) -> c_int;
}

#[cfg(topr_nccl)]
unsafe extern "C" {
    fn topr_pg_add_nccl(pg: *mut RawGroup, err: *mut c_char, cap: usize) -> c_int;
}

/// Whether this build has NCCL, c10d's GPU engine ([`ProcessGroup::use_nccl`]): its libtorch is
/// a CUDA build and NCCL's headers were found when it was compiled.
pub fn nccl_available() -> bool {
    cfg!(topr_nccl)
}

const ERR_CAP: usize = 2048;

fn message(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]);
    // One line: c10d's messages can run over several.
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A c10d Gloo process group this process has joined.
///
/// Every rank must call the same collectives in the same order (as with `torch.distributed`).
/// Dropping it leaves the group: an NCCL backend ([`ProcessGroup::use_nccl`]) is shut down first,
/// as `torch.distributed.destroy_process_group` does (the collectives in flight finish, then the
/// communicators are destroyed).
pub struct ProcessGroup {
    raw: NonNull<RawGroup>,
    rank: usize,
    world_size: usize,
    nccl: bool,
}

// The group is used from one thread at a time (`&self` methods run one collective to the end);
// c10d's process groups may move between threads.
unsafe impl Send for ProcessGroup {}

/// The gradient buckets [`ProcessGroup::all_reduce_gradients`] sums one at a time: 25 MiB of
/// f32, PyTorch DDP's default `bucket_cap_mb`.
pub const BUCKET_ELEMENTS: i64 = 25 * 1024 * 1024 / 4;

impl ProcessGroup {
    /// Joins the group `launch` describes: rank 0 serves the rendezvous at
    /// `master_addr:master_port`, the others connect to it; returns when all `world_size`
    /// ranks have joined. `timeout` bounds the rendezvous and every later collective.
    ///
    /// This is `torch.distributed.init_process_group("gloo", rank=…, world_size=…)` with the
    /// `env://` rendezvous: c10d's `TCPStore` and `ProcessGroupGloo`, with Gloo's devices made as
    /// PyTorch makes them (`GLOO_SOCKET_IFNAME` if set, else this host's address).
    ///
    /// ```
    /// use std::time::Duration;
    /// let pg = topr_dist::ProcessGroup::join(&topr_dist::Launch::single()?, Duration::from_secs(10))?;
    /// assert_eq!((pg.rank(), pg.world_size(), pg.is_main()), (0, 1, true));
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn join(launch: &Launch, timeout: Duration) -> Result<Self, DistError> {
        let join_err = |message: String| DistError::Join {
            rank: launch.rank,
            world_size: launch.world_size,
            addr: format!("{}:{}", launch.master_addr, launch.master_port),
            message,
        };
        let host = CString::new(launch.master_addr.clone()).map_err(|e| join_err(e.to_string()))?;
        let (rank, world) = (
            c_int::try_from(launch.rank).map_err(|e| join_err(e.to_string()))?,
            c_int::try_from(launch.world_size).map_err(|e| join_err(e.to_string()))?,
        );
        let ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX).max(1);
        let mut err = vec![0u8; ERR_CAP];
        // SAFETY: `host` and `err` outlive the call; the shim catches every C++ exception.
        let raw = unsafe {
            topr_pg_new_gloo(host.as_ptr(), launch.master_port, rank, world, ms, err.as_mut_ptr().cast(), ERR_CAP)
        };
        match NonNull::new(raw) {
            Some(raw) => Ok(Self { raw, rank: launch.rank, world_size: launch.world_size, nccl: false }),
            None => Err(join_err(message(&err))),
        }
    }

    /// From now on, collectives on CUDA tensors run on NCCL (c10d's `ProcessGroupNCCL`, over
    /// the same rendezvous store under the prefix `nccl/`, bounded by the group's time-out),
    /// device to device, instead of Gloo staging them through the host; CPU tensors stay on Gloo.
    /// Every rank must call it, before its first collective on a CUDA tensor, each with its own
    /// GPU (NCCL's communicators are made on the first collective, on the device of its tensor).
    /// An error in a build without NCCL ([`nccl_available`]).
    ///
    /// ```
    /// # use std::time::Duration;
    /// let mut pg = topr_dist::ProcessGroup::join(&topr_dist::Launch::single()?, Duration::from_secs(10))?;
    /// if !topr_dist::nccl_available() {
    ///     assert!(pg.use_nccl().is_err());
    /// }
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn use_nccl(&mut self) -> Result<(), DistError> {
        #[cfg(topr_nccl)]
        {
            // SAFETY: the group is live; the shim catches every C++ exception.
            self.run("NCCL set-up", |pg, err, cap| unsafe { topr_pg_add_nccl(pg, err, cap) })?;
            self.nccl = true;
            Ok(())
        }
        #[cfg(not(topr_nccl))]
        Err(DistError::Collective {
            rank: self.rank,
            op: "NCCL set-up",
            message: "this build has no NCCL (its libtorch is not a CUDA build, or NCCL's headers were missing)".into(),
        })
    }

    /// Whether collectives on CUDA tensors run on NCCL ([`ProcessGroup::use_nccl`]).
    pub fn uses_nccl(&self) -> bool {
        self.nccl
    }

    /// This process's rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether this is rank 0 (the one that writes shared outputs, by convention).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    fn check(&self, arg: &'static str, t: &Tensor) -> Result<(), DistError> {
        if !t.defined() {
            return Err(DistError::Tensor { arg, reason: "the tensor is undefined".into() });
        }
        if !t.is_contiguous() {
            return Err(DistError::Tensor { arg, reason: "the tensor must be contiguous".into() });
        }
        Ok(())
    }

    fn run(
        &self,
        op: &'static str,
        f: impl FnOnce(*mut RawGroup, *mut c_char, usize) -> c_int,
    ) -> Result<(), DistError> {
        let mut err = vec![0u8; ERR_CAP];
        match f(self.raw.as_ptr(), err.as_mut_ptr().cast(), ERR_CAP) {
            0 => Ok(()),
            _ => Err(DistError::Collective { rank: self.rank, op, message: message(&err) }),
        }
    }

    /// Replaces `t` on every rank with the sum over ranks of `t` (same shape and kind
    /// everywhere; contiguous): `t ← Σ_r t_r`, c10d's `allreduce` with `ReduceOp::SUM`.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # let pg = topr_dist::ProcessGroup::join(&topr_dist::Launch::single()?, Duration::from_secs(10))?;
    /// let mut t = tch::Tensor::from_slice(&[1.0f32, 2.0]);
    /// pg.all_reduce_sum(&mut t)?; // one rank: the sum is itself
    /// assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![1.0, 2.0]);
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), DistError> {
        self.check("t", t)?;
        // SAFETY: `t` is a live tensor handle for the call's duration.
        self.run("all-reduce", |pg, err, cap| unsafe { topr_pg_all_reduce_sum(pg, t.as_mut_ptr().cast(), err, cap) })
    }

    /// Copies rank `root`'s `t` into `t` on every other rank (c10d's `broadcast`).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # let pg = topr_dist::ProcessGroup::join(&topr_dist::Launch::single()?, Duration::from_secs(10))?;
    /// let mut t = tch::Tensor::from_slice(&[7i64]);
    /// pg.broadcast(&mut t, 0)?;
    /// assert!(pg.broadcast(&mut t, 1).is_err()); // no rank 1 in a group of one
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.check("t", t)?;
        if root >= self.world_size {
            return Err(DistError::Tensor {
                arg: "root",
                reason: format!("rank {root} is not in the group (0..{})", self.world_size),
            });
        }
        let root = root as c_int;
        // SAFETY: as in `all_reduce_sum`.
        self.run("broadcast", |pg, err, cap| unsafe { topr_pg_broadcast(pg, t.as_mut_ptr().cast(), root, err, cap) })
    }

    /// Returns once every rank has called it (c10d's `barrier`).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # let pg = topr_dist::ProcessGroup::join(&topr_dist::Launch::single()?, Duration::from_secs(10))?;
    /// pg.barrier()?;
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn barrier(&self) -> Result<(), DistError> {
        // SAFETY: the group is live.
        self.run("barrier", |pg, err, cap| unsafe { topr_pg_barrier(pg, err, cap) })
    }

    /// Sums `values` over ranks, in place (in f64, on the CPU): counts, metrics.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # let pg = topr_dist::ProcessGroup::join(&topr_dist::Launch::single()?, Duration::from_secs(10))?;
    /// let mut counts = [120.0, 8.0]; // this rank's tokens and sequences
    /// pg.all_reduce_f64(&mut counts)?; // now the whole batch's
    /// assert_eq!(counts, [120.0, 8.0]);
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), DistError> {
        if values.is_empty() {
            return Ok(());
        }
        let mut t = Tensor::from_slice(values);
        self.all_reduce_sum(&mut t)?;
        t.f_copy_data(values, values.len()).map_err(|e| DistError::Tensor { arg: "values", reason: e.to_string() })
    }

    /// Sums the gradients of `params` over ranks, in place, in buckets of at most
    /// [`BUCKET_ELEMENTS`] elements of one kind and device (each bucket is flattened into one
    /// tensor, summed in one collective, and copied back, as PyTorch DDP's reducer does). Every
    /// parameter must have a defined gradient on every rank (a rank that saw no data holds zeros).
    ///
    /// Divide by the world size afterwards only if each rank's loss was a mean over its own
    /// share; with a loss normalised by the counts of the whole batch (`topr_loss::Normalizer::
    /// global`), the sum is the gradient of the whole batch:
    /// `∇L = Σ_r ∇(Σ_{i ∈ share_r} ℓ_i / N)` with `N` the whole batch's count.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # let pg = topr_dist::ProcessGroup::join(&topr_dist::Launch::single()?, Duration::from_secs(10))?;
    /// let w = tch::Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
    /// (&w * 3.0).sum(tch::Kind::Float).backward();
    /// pg.all_reduce_gradients(&[w.shallow_clone()])?;
    /// assert_eq!(Vec::<f32>::try_from(w.grad()).unwrap(), vec![3.0, 3.0]);
    /// # Ok::<(), topr_dist::DistError>(())
    /// ```
    pub fn all_reduce_gradients(&self, params: &[Tensor]) -> Result<(), DistError> {
        let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
        if let Some(i) = grads.iter().position(|g| !g.defined()) {
            return Err(DistError::Tensor {
                arg: "params",
                reason: format!(
                    "parameter {i} has no gradient (run a backward pass, or a zero one, on every rank before the all-reduce)"
                ),
            });
        }
        let mut start = 0;
        while start < grads.len() {
            let (kind, device) = (grads[start].kind(), grads[start].device());
            let mut end = start;
            let mut size = 0;
            while end < grads.len()
                && grads[end].kind() == kind
                && grads[end].device() == device
                && (end == start || size + grads[end].numel() as i64 <= BUCKET_ELEMENTS)
            {
                size += grads[end].numel() as i64;
                end += 1;
            }
            self.all_reduce_bucket(&grads[start..end])?;
            start = end;
        }
        Ok(())
    }

    fn all_reduce_bucket(&self, grads: &[Tensor]) -> Result<(), DistError> {
        tch::no_grad(|| {
            let flat: Vec<Tensor> = grads.iter().map(|g| g.reshape([-1])).collect();
            let mut bucket = Tensor::cat(&flat, 0);
            self.all_reduce_sum(&mut bucket)?;
            let mut offset = 0;
            for g in grads {
                let n = g.numel() as i64;
                let mut g = g.shallow_clone();
                g.copy_(&bucket.narrow(0, offset, n).view_as(&g));
                offset += n;
            }
            Ok(())
        })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `topr_pg_new_gloo` and is freed once.
        unsafe { topr_pg_free(self.raw.as_ptr()) }
    }
}
