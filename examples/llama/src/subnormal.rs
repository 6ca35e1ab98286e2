//! Subnormal floats on the CPU: flushed to zero, so that a policy that collapses does not slow
//! training and generation by orders of magnitude.
//!
//! A float32 below 2⁻¹²⁶ ≈ 1.2 × 10⁻³⁸ is *subnormal*. x86 CPUs compute with subnormal operands
//! or results through a slow path: on a 2-core Intel Xeon (AVX-512) a 1024 × 2048 by 2048 × 576
//! float32 product took 3.3 s with subnormal entries against 15 ms with normal ones (MKL's sgemm
//! in libtorch, one thread, 2026-12-05). Training makes them when a policy collapses: the softmax
//! over the vocabulary puts probabilities below 10⁻³⁸ on many tokens, and the backward passes
//! multiply them. On SmolLM2-135M-Instruct trained by naive off-policy REINFORCE, whose policy
//! collapses (its log-ratio to μ below −60 a token), the study's steps went from 11 s to about
//! 200 s on that machine; a forward and backward pass of that collapsed model on two sampled
//! sequences of 160 tokens took 12.0 and 11.1 s with subnormals kept and 2.6 s flushed, where the
//! initial model takes 2.4 to 2.7 s either way (PyTorch 2.13, one thread, the same machine:
//! `scripts/subnormals.py`).
//!
//! [`flush_subnormals`] sets the calling thread's floating-point unit to treat subnormal operands
//! as zero and to round subnormal results to zero (on x86-64, MXCSR's DAZ and FTZ bits, as
//! PyTorch's `torch.set_flush_denormal(True)` does). A thread inherits the setting from the
//! thread that starts it (POSIX: the floating-point environment), so called first in `main`,
//! before libtorch starts its OpenMP threads, it covers every thread of the process. The `llama`
//! binary does so unless `TOPR_SUBNORMALS=keep` is set (for comparisons). Only values below
//! 1.2 × 10⁻³⁸ change: a probability that small is zero to every loss and every sampler here.

/// Sets the calling thread, and the threads it starts afterwards, to read subnormal float
/// operands as zero and to flush subnormal results to zero; returns whether this CPU
/// architecture has such a mode here (x86-64: MXCSR's DAZ and FTZ bits; elsewhere nothing is
/// changed and it returns `false`).
///
/// Call it first in `main`, before any tensor work: libtorch's thread pools, started later,
/// inherit the setting. Threads started before it keep theirs with GNU OpenMP (libgomp, which
/// PyTorch's Linux wheels ship); Intel's OpenMP instead copies the starting thread's setting into
/// its workers at each parallel region (`KMP_INHERIT_FP_CONTROL`).
///
/// # Safety
///
/// Rust and LLVM compile float code for the default floating-point environment, in which
/// subnormals are kept; this is why the standard library deprecated `_mm_setcsr`. After this
/// call, an operation the compiler evaluated while compiling (constant folding) can give a
/// subnormal where the same operation at run time gives zero, and the compiler may move float
/// operations across the call. The caller must call it before the float work whose results may
/// change (first in `main`, before any thread starts), in a program none of whose results rely on
/// values below 1.2 × 10⁻³⁸ being kept.
///
/// ```
/// use topr_llama::subnormal::{flush_subnormals, subnormals_flushed};
///
/// // On its own thread, so that the example changes nothing else.
/// std::thread::spawn(|| {
///     // SAFETY: first on a thread of its own; nothing here relies on subnormals being kept.
///     if unsafe { flush_subnormals() } {
///         assert!(subnormals_flushed());
///         let tiny = std::hint::black_box(f32::MIN_POSITIVE);
///         assert_eq!(tiny / 2.0, 0.0); // subnormal result, flushed
///     }
/// })
/// .join()
/// .unwrap();
/// ```
pub unsafe fn flush_subnormals() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let csr = mxcsr::read() | mxcsr::FLUSH;
        mxcsr::write(csr);
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the calling thread flushes subnormal floats to zero (both x86-64 bits set; `false`
/// on other architectures).
pub fn subnormals_flushed() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        mxcsr::read() & mxcsr::FLUSH == mxcsr::FLUSH
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod mxcsr {
    /// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) bits.
    pub const FLUSH: u32 = (1 << 15) | (1 << 6);

    /// The calling thread's MXCSR.
    pub fn read() -> u32 {
        let mut csr: u32 = 0;
        // SAFETY: stmxcsr stores the 32-bit register into the 4 bytes `csr` owns; x86-64 always
        // has SSE.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags)) };
        csr
    }

    /// Sets the calling thread's MXCSR to `csr` (a value read by [`read`] with mode bits
    /// changed: no reserved bit set).
    pub fn write(csr: u32) {
        // SAFETY: ldmxcsr loads 4 bytes from `csr`; the value differs from the current register
        // only in the FTZ and DAZ bits, which every x86-64 CPU has, so it cannot fault.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, readonly, preserves_flags)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flushing_sets_both_bits_on_this_thread_only() {
        let (before, flushed, tiny) = std::thread::spawn(|| {
            let before = subnormals_flushed();
            // SAFETY: first on a thread of its own, whose only float work reads the flush.
            let has = unsafe { flush_subnormals() };
            let tiny = std::hint::black_box(f32::MIN_POSITIVE) / 2.0;
            (before, has && subnormals_flushed(), tiny)
        })
        .join()
        .unwrap();
        assert!(!before, "a new test thread starts without the flush");
        if cfg!(target_arch = "x86_64") {
            assert!(flushed);
            assert_eq!(tiny, 0.0);
        }
        // Another thread, started by the harness before, is untouched.
        let normal = std::hint::black_box(f32::MIN_POSITIVE) / 2.0;
        assert!(normal > 0.0 && !normal.is_normal());
    }
}
