//! A Llama for topr-loss: loads Hugging Face checkpoints (Llama 2, 3, 3.1, 3.2, TinyLlama,
//! SmolLM2), tokenizes with the `tokenizers` crate, generates with a KV cache, and runs the
//! paper's self-taught loop: sample graded data sets with μ, train off-policy with any of the
//! crate's objectives, evaluate, repeat.
//!
//! The library holds everything but the command line; the `llama` binary of this crate is a thin
//! CLI over it (`cargo llama --help`). Dependencies point one way: CLI → `topr_llama` →
//! `topr_loss`. Settings come in as typed values ([`train::TrainSettings`],
//! [`generate::Sampling`], [`task::TaskSpec`], [`iterate::IterateSettings`],
//! [`checkpoint::Placement`]); errors describe the problem, not a command-line flag, and the
//! refusals a caller can lift by a setting are typed ([`Refusal`]).
//!
//! | module | what |
//! |---|---|
//! | [`config`] | `config.json`: fields, defaults, both rope layouts, refusal of unsupported settings |
//! | [`model`] | the decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, KV cache |
//! | [`attention`] | the decoding step's attention on the CPU, slot by slot over each slot's own keys |
//! | [`next_tokens`] | the decoding step's next tokens on the CPU, from the logits in one pass a row |
//! | [`checkpoint`] | loading and saving the Hugging Face layout (single or sharded safetensors) |
//! | [`tokenizer`] | `tokenizer.json`, the chat template, every EOS id |
//! | [`generate`] | batched generation (greedy or sampled), teacher-forced scoring |
//! | [`task`] | GSM8K and the synthetic task: prompts, answer extraction, grading |
//! | [`eval`] | greedy and sampled pass@1, maj@k, pass@k |
//! | [`dataset`] | the data-set record, its checked reader, shard files and their merge, the teacher's solutions |
//! | [`sample`] | sampling a graded off-policy data set, resumable, in shards |
//! | [`shard`] | a share of the work of several processes |
//! | [`parallel`] | data-parallel training over a c10d process group |
//! | [`settings`] | typed, checked settings of training and of the loop, every rule over them in one place |
//! | [`train`] | off-policy training with every objective, micro-batching, resume |
//! | [`optim`] | AdamW and Adafactor with savable state |
//! | [`iterate`] | the self-taught loop |
//! | [`metrics`] | the records of the JSONL metric files, shared by writers and readers |
//! | [`plot`] | the PNG plots |
//! | [`profile`] | libtorch's profiler (Kineto) and a summary of its trace: where a step's time goes |
//! | [`stats`] | a mean and its standard error, paired differences: the one definition every report uses |
//! | [`init`] | a small Llama from scratch with a byte-level tokenizer |
//! | [`io`] | atomic and checked writes, locks, the refusal to write into an input |
//! | [`layout`] | every file and folder name of the work directories, spelled once |
//! | [`stage`] | resumable stages: run records compared on resume, done markers, whole copies |
//! | [`identity`] | what a resumable run was made from, and what differs on resume |
//! | [`demo`] | the README's demo |
//! | [`verify`] | the generative verifier: trained with TOPR to judge solutions, then picking among k |

pub mod attention;
pub mod checkpoint;
pub mod compare;
pub mod config;
pub mod cuda_graph;
pub mod dataset;
pub mod demo;
pub mod eval;
pub mod generate;
pub mod identity;
pub mod init;
pub mod io;
pub mod iterate;
pub mod layout;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod next_tokens;
pub mod onednn;
pub mod optim;
pub mod parallel;
pub mod plot;
pub mod profile;
pub mod progress;
pub mod sample;
pub mod settings;
pub mod shard;
pub mod stage;
pub mod stats;
pub mod study;
pub mod subnormal;
pub mod task;
pub mod tokenizer;
pub mod train;
pub mod verify;

use std::path::PathBuf;

/// What kind of run [`Refusal::ChangedSettings`] refused to continue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Resumable {
    /// `train`'s output directory.
    Training,
    /// A sampled data set.
    Sampling,
    /// `iterate`'s work directory.
    Iterations,
    /// The verifier's work directory (its solutions and its judge's rounds).
    Verifier,
    /// The demo's (or a study seed's) warm-up stages.
    WarmUp,
    /// A study's work directory (its sizes and numerics, `study.json`).
    Study,
}

/// A refusal that a caller lifts by changing a setting (continuing an earlier run, or skipping
/// bad records). Front ends can recognise it (`anyhow::Error::downcast_ref`) and name their own
/// option for the remedy; its message names none.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// A training output directory holds the saved state of an interrupted run.
    #[error(
        "{} holds the state of an interrupted run: resume it (train with `resume` set), or remove {}",
        dir.display(),
        state.display()
    )]
    InterruptedTraining { dir: PathBuf, state: PathBuf },
    /// An `iterate` work directory holds an earlier run.
    #[error(
        "{} holds an earlier run: resume it (finished stages are kept), or choose another work directory",
        .0.display()
    )]
    EarlierIterations(PathBuf),
    /// A demo work directory holds an earlier demo.
    #[error("{} holds an earlier demo: resume it, or choose another work directory", .0.display())]
    EarlierDemo(PathBuf),
    /// A training output directory holds a finished model (not the state of an interrupted run).
    #[error(
        "{} holds a finished model: choose another output directory, or remove it to train again",
        .0.display()
    )]
    FinishedModel(PathBuf),
    /// A resumed run (or a sampled data set being extended) was made with other inputs or
    /// settings; `differences` lists them, each as `field saved → now`.
    #[error(
        "settings differ from the saved run in {}: {} (start a new run elsewhere)",
        dir.display(),
        differences.join(", ")
    )]
    ChangedSettings { dir: PathBuf, differences: Vec<String>, run: Resumable },
    /// A data-set record longer than the model's context.
    #[error(
        "{}: record {record} ({id}) has {tokens} tokens, more than the model's context of {context} (skipping bad records skips such records)",
        path.display()
    )]
    RecordTooLong { path: PathBuf, record: usize, id: String, tokens: usize, context: usize },
    /// A data set whose `sample` was interrupted: its run record counts more completions than
    /// the file holds.
    #[error(
        "{}: {have} of its {want} completions are sampled (an interrupted `sample`: rerun it with the same settings to finish)",
        path.display()
    )]
    UnfinishedData { path: PathBuf, have: usize, want: usize },
}
