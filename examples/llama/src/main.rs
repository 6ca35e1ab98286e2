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
    let parsed = match cli::Cli::try_parse() {
        Ok(parsed) => parsed,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // clap's message as one line: its first paragraph (the usage and tips follow).
            eprintln!("{}", cli::first_paragraph(&e.to_string()));
            std::process::exit(2);
        }
    };
    if let Err(e) = cli::run(parsed.command) {
        eprintln!("error: {}", cli::message(&e));
        std::process::exit(1);
    }
}
