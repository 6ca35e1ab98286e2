//! `llama`, the command line of the Llama example: loads Hugging Face checkpoints (Llama 2, 3, 3.1, 3.2,
//! TinyLlama, SmolLM2), tokenizes with the `tokenizers` crate, generates with a KV cache, and runs
//! the paper's self-taught loop: sample graded data sets with μ, train off-policy with any of the
//! crate's objectives, evaluate, repeat.
//!
//! ```text
//! cargo llama demo                       # the README's demo (7 min on 2 cores)
//! cargo llama generate --model DIR --prompt "2+2?" --chat --greedy
//! cargo llama sample --model DIR --task synthetic --out data.jsonl
//! cargo llama train --model DIR --data data.jsonl --out DIR2 --objective topr
//! cargo llama iterate --model DIR --work WORK --iterations 3
//! ```
//!
//! Results go to stdout (completions, JSON summaries, tables); logs and progress bars to stderr.
//! Every subcommand is described in `docs/llama.md`. The pipeline is the `topr_llama` library;
//! this binary parses arguments into its settings and prints what it returns.

mod cli;

use clap::Parser;

fn main() {
    // Rust ignores SIGPIPE, so `println!` into a closed pipe (`llama bench | head -1`) panics;
    // a command-line tool should end quietly there, as `cat` does: restore the default action.
    #[cfg(unix)]
    // SAFETY: called first in main, before any thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    keep_freed_memory();
    // Before libtorch starts its threads, which inherit it (`topr_llama::subnormal`);
    // TOPR_SUBNORMALS=keep leaves them as they are (for comparisons).
    if std::env::var_os("TOPR_SUBNORMALS").is_none_or(|v| v != "keep") {
        // SAFETY: before any float work and any thread; no result of the binary relies on
        // values below 1.2e-38 being kept.
        unsafe { topr_llama::subnormal::flush_subnormals() };
    }
    let parsed = match cli::Cli::try_parse() {
        Ok(parsed) => parsed,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // clap's message as one line: its first paragraph (the usage and tips follow).
            eprintln!("{}", cli::first_paragraph(&e.to_string()));
            std::process::exit(2);
        }
    };
    // A libtorch error that a non-fallible tch call turns into a panic (a CUDA out-of-memory, say)
    // ends as every other error does: one line, exit code 1. The main thread's panic message is
    // printed here instead of by the hook (RUST_BACKTRACE set: by the hook too, with its trace);
    // other threads' panics keep the default report.
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() != Some("main") {
                default(info);
            }
        }));
    }
    let message = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cli::run(parsed))) {
        Ok(Ok(())) => return,
        Ok(Err(e)) => cli::message(&e),
        Err(payload) => {
            let text = payload.downcast_ref::<String>().map(String::as_str);
            let text = text.or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("a panic without a message");
            text.lines().find(|l| !l.trim().is_empty()).unwrap_or(text).trim().to_string()
        }
    };
    eprintln!("error: {message}");
    std::process::exit(1);
}

/// glibc's allocator serves each large tensor (≥ 128 KiB at first) with a fresh `mmap` and gives
/// it back on free, so every intermediate tensor of a forward or backward pass page-faults its
/// memory in again: on the CPU that cost 2.4× in the losses at B = 512, T = 2048 and about 1.8×
/// in generation at batch 1 (docs/performance.md). Serve tensors up to 32 MiB (the most glibc
/// allows) from the heap and keep up to 1 GiB of freed heap for reuse. Memory is not used for
/// longer than the tensors hold it; the process's resident size stays near its peak.
fn keep_freed_memory() {
    // TOPR_MALLOC=default keeps glibc's own behaviour (for A/B measurements).
    if std::env::var_os("TOPR_MALLOC").is_some_and(|v| v == "default") {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any allocation-heavy work.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
