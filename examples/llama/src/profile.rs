//! Where the time goes: libtorch's profiler (Kineto, the one behind `torch.profiler`), which tch
//! does not wrap, through a small C++ file (`csrc/profile.cpp`), and a summary of its trace.
//!
//! [`Profiler::start`] records the libtorch operators the calling thread runs and, on a CUDA
//! device, the CUDA runtime's calls and each kernel the GPU ran (through CUPTI, kernels replayed
//! from CUDA graphs included); [`Profiler::finish`] writes the record as a Chrome trace
//! (open it in Perfetto or `chrome://tracing`), the file `torch.profiler`'s
//! `export_chrome_trace` writes. [`summarize`] reads such a trace back into the figures that say
//! whether a decoding step is bound by its kernels or by launching them: the kernels' count and
//! time a step, the share of the wall time the device was busy, the launches, the copies from
//! the device to the host (each one a host read that stalls the stream), and the kernels and
//! operators that took the most time.

use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use tch::Device;

unsafe extern "C" {
    fn topr_profile_start(cuda: c_int, err: *mut c_char, cap: usize) -> c_int;
    fn topr_profile_stop(path: *const c_char, err: *mut c_char, cap: usize) -> c_int;
}

const ERR_CAP: usize = 1024;

/// Whether a profiler is running in this process (libtorch has one).
static RUNNING: AtomicBool = AtomicBool::new(false);

/// A running profiler: started by [`Profiler::start`], stopped by [`Profiler::finish`] (which
/// writes the trace) or, without a trace, when dropped. One at a time in a process, and bound to
/// the thread that started it (libtorch records operators per thread): it is not `Send`.
pub struct Profiler {
    running: bool,
    _thread: std::marker::PhantomData<*const ()>,
}

impl Profiler {
    /// Starts recording the libtorch operators of the calling thread and, when `device` is a CUDA
    /// device, the CUDA activity of every device. Refused while another profiler runs.
    ///
    /// ```
    /// use topr_llama::profile::{Profiler, Window, summarize};
    /// let p = Profiler::start(tch::Device::Cpu)?;
    /// let x = tch::Tensor::ones([64, 64], (tch::Kind::Float, tch::Device::Cpu));
    /// let _ = x.matmul(&x);
    /// let trace = std::env::temp_dir().join(format!("profile-doc-{}.json", std::process::id()));
    /// p.finish(&trace)?;
    /// let s = summarize(&trace, Window::All { steps: 1, wall_us: 1e3 }, 5)?;
    /// assert!(s.top_ops.iter().any(|o| o.name == "aten::matmul"));
    /// # std::fs::remove_file(&trace)?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn start(device: Device) -> Result<Self> {
        if RUNNING.swap(true, Ordering::SeqCst) {
            bail!("a profiler is already running in this process");
        }
        let mut err = [0u8; ERR_CAP];
        // SAFETY: the shim starts libtorch's profiler or writes a message; it catches every C++
        // exception.
        let rc = unsafe { topr_profile_start(c_int::from(device.is_cuda()), err.as_mut_ptr().cast(), ERR_CAP) };
        if rc != 0 {
            RUNNING.store(false, Ordering::SeqCst);
            bail!("starting libtorch's profiler failed: {}", crate::onednn::shim_message(&err));
        }
        Ok(Self { running: true, _thread: std::marker::PhantomData })
    }

    /// Stops recording and writes the trace (Chrome's JSON trace format) to `trace`, whole or not
    /// at all (to a temporary file beside it, renamed once the export succeeded).
    pub fn finish(mut self, trace: &Path) -> Result<()> {
        crate::io::replace_with(trace, |tmp| {
            let path = CString::new(tmp.as_os_str().as_encoded_bytes())
                .with_context(|| format!("{}: a path with a NUL byte", tmp.display()))?;
            self.stop(path.as_ptr()).context("exporting the profiler's trace")
        })
    }

    fn stop(&mut self, path: *const c_char) -> Result<()> {
        if !std::mem::replace(&mut self.running, false) {
            return Ok(());
        }
        let mut err = [0u8; ERR_CAP];
        // SAFETY: a profiler started by `start` is running; `path` is null or a NUL-terminated
        // string that outlives the call. The shim catches every C++ exception.
        let rc = unsafe { topr_profile_stop(path, err.as_mut_ptr().cast(), ERR_CAP) };
        RUNNING.store(false, Ordering::SeqCst);
        if rc != 0 {
            bail!("stopping libtorch's profiler failed: {}", crate::onednn::shim_message(&err));
        }
        Ok(())
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        // A profiler left running would record (and hold) everything after it.
        let _ = self.stop(std::ptr::null());
    }
}

/// One kernel or operator of a [`Summary`]: its name (cut to 160 characters), how many times it
/// ran and its time, both per step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Entry {
    /// The kernel's or the operator's name.
    pub name: String,
    /// Times it ran, per step.
    pub calls_per_step: f64,
    /// Its time per step, in microseconds (an operator's includes the operators it called).
    pub us_per_step: f64,
}

/// What a trace says of the steps of its [`Window`] (see [`summarize`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// The steps the trace holds (what "per step" divides by).
    pub steps: u64,
    /// The wall time of the window, per step, in microseconds.
    pub wall_us_per_step: f64,
    /// GPU kernels run, per step (0 on the CPU).
    pub kernels_per_step: f64,
    /// The kernels' summed time, per step, in microseconds.
    pub kernel_us_per_step: f64,
    /// The kernels' time over the wall time: near 1, the step is bound by its kernels; far below,
    /// by launching them (or by the host).
    pub device_busy_share: f64,
    /// Launches from the host (the CUDA runtime's kernel and graph launches), per step.
    pub launches_per_step: f64,
    /// Copies from the device to the host, per step: each is a host read that waits for the
    /// device.
    pub device_to_host_per_step: f64,
    /// The kernels that took the most time.
    pub top_kernels: Vec<Entry>,
    /// The libtorch operators that took the most time on the host (inclusive times).
    pub top_ops: Vec<Entry>,
}

/// Which part of a trace [`summarize`] reads, and what a step of it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Window {
    /// Every event: `steps` steps that took `wall_us` microseconds in all (measured by the
    /// caller).
    All { steps: u64, wall_us: f64 },
    /// The events that start at or after the first event named `name` (e.g. `cudaGraphLaunch`:
    /// the replays of a recorded decoding step, without the prefill, the eager first step and the
    /// recording before them), one step per such event; the wall time is the span from its start
    /// to the end of the last event.
    From(&'static str),
}

/// Reads a Chrome trace written by [`Profiler::finish`] (or by `torch.profiler`) and returns the
/// [`Summary`] of its `window`, with the `top` kernels and operators by time. Events are Chrome's
/// complete events (`"ph": "X"`) with Kineto's categories: `kernel` (GPU kernels), `cpu_op`
/// (libtorch operators), `cuda_runtime` and `cuda_driver` (the runtime's and driver's calls:
/// `cudaLaunchKernel`, `cuLaunchKernelEx`, `cudaGraphLaunch`, …) and `gpu_memcpy` (copies; a name
/// with `DtoH` goes to the host). An error for a file that is not such a trace, a window without
/// steps, or no event of a [`Window::From`]'s name.
pub fn summarize(trace: &Path, window: Window, top: usize) -> Result<Summary> {
    let file = std::fs::File::open(trace).with_context(|| format!("opening the trace {}", trace.display()))?;
    let json: serde_json::Value = serde_json::from_reader(std::io::BufReader::new(file))
        .with_context(|| format!("{}: not a JSON trace", trace.display()))?;
    let Some(events) = json.get("traceEvents").and_then(|e| e.as_array()) else {
        bail!("{}: no traceEvents list", trace.display());
    };
    // (category, name, start, duration) of the complete events.
    let complete: Vec<(&str, &str, f64, f64)> = events
        .iter()
        .filter(|e| e.get("ph").and_then(|p| p.as_str()) == Some("X"))
        .map(|e| {
            let num = |k: &str| e.get(k).and_then(|d| d.as_f64()).unwrap_or(0.0);
            (e["cat"].as_str().unwrap_or(""), e["name"].as_str().unwrap_or(""), num("ts"), num("dur"))
        })
        .collect();
    let (from, steps, wall_us) = bounds(&complete, window).with_context(|| format!("{}", trace.display()))?;
    let per = |x: f64| x / steps as f64;
    let (mut kernels, mut ops, mut launches, mut to_host) = (Tally::default(), Tally::default(), 0u64, 0u64);
    for &(cat, name, _, dur) in complete.iter().filter(|e| e.2 >= from) {
        match cat {
            "kernel" => kernels.add(name, dur),
            "cpu_op" => ops.add(name, dur),
            "cuda_runtime" | "cuda_driver" if name.contains("LaunchKernel") || name.contains("GraphLaunch") => {
                launches += 1
            }
            "gpu_memcpy" if name.contains("DtoH") => to_host += 1,
            _ => {}
        }
    }
    let entries = |t: &Tally| -> Vec<Entry> {
        let mut v: Vec<(&String, &(u64, f64))> = t.by_name.iter().collect();
        v.sort_by(|a, b| b.1.1.total_cmp(&a.1.1).then_with(|| a.0.cmp(b.0)));
        v.into_iter()
            .take(top)
            .map(|(name, &(calls, us))| Entry {
                name: name.chars().take(160).collect(),
                calls_per_step: per(calls as f64),
                us_per_step: per(us),
            })
            .collect()
    };
    Ok(Summary {
        steps,
        wall_us_per_step: per(wall_us),
        kernels_per_step: per(kernels.calls as f64),
        kernel_us_per_step: per(kernels.us),
        device_busy_share: kernels.us / wall_us,
        launches_per_step: per(launches as f64),
        device_to_host_per_step: per(to_host as f64),
        top_kernels: entries(&kernels),
        top_ops: entries(&ops),
    })
}

/// Where `window` starts in `complete` (category, name, start, duration), its steps and its wall
/// time in microseconds.
fn bounds(complete: &[(&str, &str, f64, f64)], window: Window) -> Result<(f64, u64, f64)> {
    let (from, steps, wall_us) = match window {
        Window::All { steps, wall_us } => (f64::NEG_INFINITY, steps, wall_us),
        Window::From(name) => {
            let marks: Vec<f64> = complete.iter().filter(|e| e.1 == name).map(|e| e.2).collect();
            let Some(first) = marks.iter().copied().reduce(f64::min) else {
                bail!("no {name} event to count steps from");
            };
            let last = complete.iter().map(|e| e.2 + e.3).fold(first, f64::max);
            (first, marks.len() as u64, last - first)
        }
    };
    if steps == 0 || wall_us.is_nan() || wall_us <= 0.0 {
        bail!("the window's steps ({steps}) and wall time ({wall_us} µs) must be positive");
    }
    Ok((from, steps, wall_us))
}

/// Calls and summed durations, in all and by name.
#[derive(Default)]
struct Tally {
    calls: u64,
    us: f64,
    by_name: HashMap<String, (u64, f64)>,
}

impl Tally {
    fn add(&mut self, name: &str, us: f64) {
        self.calls += 1;
        self.us += us;
        let e = self.by_name.entry(name.to_string()).or_default();
        e.0 += 1;
        e.1 += us;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace written by hand: two steps of a GPU decoding step, with a launch each, one copy to
    /// the host, a memset and events of other phases that count for nothing.
    #[test]
    fn a_summary_counts_what_the_trace_holds() {
        let trace = serde_json::json!({"traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 0.0, "dur": 30.0},
            {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 40.0, "dur": 30.0},
            {"ph": "X", "cat": "kernel", "name": "rms_norm", "ts": 80.0, "dur": 5.0},
            {"ph": "X", "cat": "kernel", "name": "rms_norm", "ts": 90.0, "dur": 5.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 12.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20.0, "dur": 12.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 40.0, "dur": 4.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 3.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 50.0, "dur": 3.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 60.0, "dur": 9.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": 99.0, "dur": 1.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 2.0, "dur": 1.0},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 3.0, "dur": 1.0},
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5.0},
            {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 5.0}
        ]});
        let path = std::env::temp_dir().join(format!("topr-profile-test-{}.json", std::process::id()));
        std::fs::write(&path, trace.to_string()).unwrap();
        let s = summarize(&path, Window::All { steps: 2, wall_us: 200.0 }, 1).unwrap();
        // From the first graph launch (ts 50) on: one step, 50 to 100 µs.
        let g = summarize(&path, Window::From("cudaGraphLaunch"), 5).unwrap();
        assert!(summarize(&path, Window::From("cudaNothing"), 5).is_err());
        std::fs::remove_file(&path).unwrap();
        assert_eq!((g.steps, g.wall_us_per_step, g.kernels_per_step, g.kernel_us_per_step), (1, 50.0, 2.0, 10.0));
        assert_eq!((g.launches_per_step, g.device_to_host_per_step, g.top_ops.len()), (1.0, 1.0, 0));
        assert_eq!((s.steps, s.wall_us_per_step, s.kernels_per_step, s.kernel_us_per_step), (2, 100.0, 2.0, 35.0));
        assert_eq!(s.device_busy_share, 70.0 / 200.0);
        assert_eq!((s.launches_per_step, s.device_to_host_per_step), (1.0, 0.5));
        assert_eq!(s.top_kernels, vec![Entry { name: "gemv".into(), calls_per_step: 1.0, us_per_step: 30.0 }]);
        assert_eq!(s.top_ops, vec![Entry { name: "aten::mm".into(), calls_per_step: 1.0, us_per_step: 12.0 }]);
    }

    /// The real profiler, once at a time: a second start is refused while one runs, a dropped
    /// one stops (another can start), and a finished one writes a trace of what ran.
    #[test]
    fn one_profiler_at_a_time_and_its_trace_holds_the_operators() {
        let first = Profiler::start(Device::Cpu).unwrap();
        assert!(Profiler::start(Device::Cpu).is_err());
        drop(first);
        let p = Profiler::start(Device::Cpu).unwrap();
        let x = tch::Tensor::ones([32, 32], (tch::Kind::Float, Device::Cpu));
        let _ = x.matmul(&x).softmax(-1, tch::Kind::Float);
        let path = std::env::temp_dir().join(format!("topr-profile-real-{}.json", std::process::id()));
        p.finish(&path).unwrap();
        let s = summarize(&path, Window::All { steps: 1, wall_us: 1e3 }, 50).unwrap();
        std::fs::remove_file(&path).unwrap();
        for op in ["aten::matmul", "aten::softmax"] {
            assert!(s.top_ops.iter().any(|o| o.name == op && o.calls_per_step >= 1.0), "{op} not in {:?}", s.top_ops);
        }
        assert_eq!((s.kernels_per_step, s.device_to_host_per_step), (0.0, 0.0));
    }

    #[test]
    fn a_summary_refuses_what_is_not_a_trace() {
        let path = std::env::temp_dir().join(format!("topr-profile-bad-{}.json", std::process::id()));
        std::fs::write(&path, "{\"events\": []}").unwrap();
        let all = |steps| Window::All { steps, wall_us: 1.0 };
        assert!(format!("{:#}", summarize(&path, all(1), 1).unwrap_err()).contains("no traceEvents"));
        std::fs::write(&path, "{\"traceEvents\": []}").unwrap();
        assert!(summarize(&path, all(0), 1).is_err());
        assert!(summarize(&path, all(1), 1).is_ok());
        std::fs::remove_file(&path).unwrap();
        assert!(summarize(&path, all(1), 1).is_err());
    }
}
