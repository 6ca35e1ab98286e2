//! The `llama` command line: the subcommands (this file), their argument groups
//! ([`args`]) and what each runs ([`commands`]). Only the binary compiles this module; the
//! pipeline it drives is the `topr_llama` library.

pub mod args;
mod bench;
mod check;
mod commands;

use args::{DecodingArgs, LoopArgs, ModelArgs, SamplingArgs, SizeArgs, TaskArgs, TrainArgs, parse_device};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use tch::Device;
use topr_llama::Refusal;
use topr_llama::parallel::{Launch, ProcessGroup};
use topr_llama::shard::Shard;

#[derive(Parser)]
#[command(
    name = "llama",
    about = "Llama checkpoints for topr-loss: generate, evaluate, sample, train off-policy, iterate"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Launched as one rank of a group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun
    /// sets them): seconds the rendezvous and each collective may wait for the other ranks
    /// before failing.
    #[arg(long, global = true, default_value_t = 600, value_parser = args::whole(1u64, 86_400))]
    pub dist_timeout: u64,
}

// Parsed once per run: the size difference between subcommands does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Print the completion of a prompt.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt in the model's chat template as a user message.
        #[arg(long)]
        chat: bool,
        #[command(flatten)]
        decoding: DecodingArgs,
    },
    /// Evaluate on a task: greedy pass@1, and with --samples K sampled pass@1, maj@K and pass@K;
    /// invalid-answer rate; mean length. Prints a JSON summary; --out writes one line per question.
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        task: TaskArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Samples per question for sampled pass@1, maj@K and pass@K (0: greedy only).
        #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = args::whole(0usize, 4096))]
        samples: usize,
        /// Completions in flight (>= 1; continuous batching: greedy, then sampled), and the
        /// questions in each batch that --shard deals out.
        #[arg(long, default_value_t = 128, allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
        batch_size: usize,
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        seed: i64,
        /// Per-question results (JSONL).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Evaluate only shard INDEX/COUNT of the batches of questions (0-based); the shards'
        /// --out files, concatenated in shard order, are the file of one process.
        #[arg(long)]
        shard: Option<Shard>,
    },
    /// Sample N completions per prompt from the model (μ), grade them and write a JSONL data set
    /// (prompt and completion ids, μ's per-token and sequence log-probs, reward, correct/invalid
    /// flags, sampling settings). Rerunning with the same --out resumes; nothing is regenerated.
    Sample {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        task: TaskArgs,
        #[arg(long)]
        out: PathBuf,
        /// Completions sampled per prompt (>= 1).
        #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
        samples_per_prompt: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Completions in flight: this many prompts' samples (>= 1; 32 prompts × 4 samples, 128
        /// slots, by default). Continuous batching: an ended completion's slot takes the next
        /// one; once none is left, the batch sheds its empty slots where that changes no bit.
        /// Another value changes speed, memory and, on some CPUs, the rounding of the batched
        /// products.
        #[arg(long, default_value_t = 32, allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
        batch_prompts: usize,
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        seed: i64,
        /// Sample only shard INDEX/COUNT of the batches of prompts (0-based) into --out; `merge`
        /// joins the shards' files into the file of one process.
        #[arg(long)]
        shard: Option<Shard>,
    },
    /// Join the files of the shards of one data set (`sample --shard I/N`) into the file one
    /// process sampling everything writes, byte for byte.
    Merge {
        /// The merged data set (must not exist).
        #[arg(long)]
        out: PathBuf,
        /// The shards' files, in any order.
        #[arg(required = true)]
        shards: Vec<PathBuf>,
    },
    /// Train the model off-policy on a sampled data set (see `sample`) with an objective of the
    /// TOPR family; writes the trained model (Hugging Face layout) and metrics.jsonl to --out.
    Train {
        #[command(flatten)]
        model: ModelArgs,
        /// A data set written by `sample`.
        #[arg(long)]
        data: PathBuf,
        /// Output directory: the trained model and metrics.jsonl.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        train: TrainArgs,
    },
    /// The whole loop for K iterations: sample with the current model as μ, optionally curate,
    /// train off-policy, evaluate on held-out problems. Rerun the same command to resume: finished
    /// stages are not redone and sampled data sets are never regenerated.
    Iterate {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        task: TaskArgs,
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
        #[command(flatten)]
        iterate: LoopArgs,
    },
    /// The generative verifier (the paper's second use of TOPR): samples K graded solutions per
    /// question, trains a copy of the model to judge them ("is this solution correct?", answered
    /// "The answer is 1/0.") with TOPR on both verdicts of every solution, off-policy, then lets it
    /// pick one of K solutions per held-out question; prints verifier@K against pass@1, maj@K and
    /// pass@K with standard errors, and writes verify.json and verify.jsonl to --work. Rerun to
    /// resume.
    Verify(VerifyArgs),
    /// Create a small Llama from scratch (random weights, byte-level tokenizer, chat template) in
    /// the Hugging Face layout: a model that needs nothing downloaded.
    Init {
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        size: SizeArgs,
        /// Embedding rows (default: the byte-level tokenizer's 260 ids). More rows are ids the
        /// tokenizer never produces: the embedding and output layer then cost what a real
        /// vocabulary's do (Llama 3's is 128256), for throughput measurements.
        #[arg(long, allow_hyphen_values = true, value_parser = args::whole(1i64, 1 << 22))]
        vocab_size: Option<i64>,
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        seed: i64,
    },
    /// Write a task's worked solutions as a data set (reward +1), for supervised warm-up with
    /// `train --objective sft`.
    SftData {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        task: TaskArgs,
        #[arg(long)]
        out: PathBuf,
        /// Share of solutions written by a sloppy teacher whose answer line copies the starting
        /// amount instead of the result (0: a perfect teacher). What the README's demo uses to
        /// show reinforcement learning correcting an imitated mistake.
        #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = args::parse_unit_interval)]
        slip_rate: f64,
    },
    /// The README's demo: a small Llama from scratch, a supervised warm-up on a sloppy teacher's
    /// worked solutions, then TOPR iterations on its own graded samples; prints the table and
    /// writes the plots. About 7 minutes on 2 CPU cores.
    Demo(DemoArgs),
    /// The paper's claims over seeds on the demo's task: per seed a new model, the warm-up and one
    /// `iterate` run per arm (objective and baseline) of the chosen claims; writes study.jsonl,
    /// study.md (mean ± standard error over seeds per claim) and claim-NAME.png. Resumes where it
    /// stopped; finished stages are reused.
    Study(StudyArgs),
    /// Other objectives on the same data as one iteration of an `iterate` run: each arm trains a
    /// copy of that iteration's μ on its data set with the run's settings (only the objective and
    /// baseline differ) and is evaluated on the run's held-out questions; writes
    /// RUN/compare-iter-I/ (compare.md, compare.jsonl: accuracy, gain over μ and difference to the
    /// run's model, with standard errors paired over questions). Resumes; finished arms are reused.
    Compare {
        /// The `iterate --work` directory.
        #[arg(long)]
        run: PathBuf,
        /// The (finished) iteration whose data set the arms train on.
        #[arg(long, default_value_t = 1, value_parser = args::whole(1usize, 100_000))]
        iteration: usize,
        /// The arms, comma-separated: an objective (topr, tis, sft, reinforce, is, ppo, grpo, dpo,
        /// gspo, cispo, sapo, gmpo, clip-cov, kl-cov, dppo-tv, dppo-kl, dro, decoupled-ppo, vespo,
        /// bapo, prefix-ratio),
        /// optionally with `-pP` for the baseline that
        /// gives positives the share P of the weight (e.g. topr-p0.2); without it the baseline is 0.
        #[arg(long, default_value = "sft,reinforce", value_parser = parse_arms)]
        arms: Arms,
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu", value_parser = parse_device)]
        device: Device,
        /// The weights' dtype (converted on load).
        #[arg(long, value_enum, default_value_t = args::Dtype::F32)]
        dtype: args::Dtype,
        /// The matrix products on the CPU (as for every command that loads a model).
        #[arg(long, value_enum, default_value_t = topr_llama::model::Kernels::Onednn)]
        kernels: topr_llama::model::Kernels,
    },
    /// Draw the PNG plots of a run again: `iterations.png` of an `iterate` work directory, or
    /// `training.png` of a `train` output directory.
    Plot {
        /// An `iterate --work` directory or a `train --out` directory.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Load a checkpoint and save it again (e.g. in another dtype), in the Hugging Face layout.
    Convert {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        out: PathBuf,
    },
    /// Measure generation and training forward+backward throughput; prints JSON.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        /// Tokens generated per measurement (>= 1).
        #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = args::whole(1i64, 1 << 20))]
        new_tokens: i64,
        /// Generation batch sizes to measure (repeat the flag, or comma-separated; default 1,16).
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16], allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
        gen_batch: Vec<usize>,
        /// Sequences of the training measurement (>= 1).
        #[arg(long, default_value_t = 8, allow_hyphen_values = true, value_parser = args::whole(1i64, 4096))]
        train_batch: i64,
        /// Tokens per sequence of the training measurement (>= 2, at most the model's context).
        #[arg(long, default_value_t = 128, allow_hyphen_values = true, value_parser = args::whole(2i64, 1 << 20))]
        train_len: i64,
        /// Also time this many alternating pairs of training steps with the two kernels of
        /// training (plain matmul, then oneDNN) on the same model and batch: one line per pair
        /// with both throughputs and their ratio (0: none).
        #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = args::whole(0usize, 1000))]
        kernel_pairs: usize,
        /// Also time this many alternating pairs of a training step on sequences whose first
        /// half is prompt: through the logits of every position, then through those from the
        /// prompt's last position on (the training forward); one line per pair (0: none).
        #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = args::whole(0usize, 1000))]
        prompt_pairs: usize,
        /// Also time a sampling workload of this many synthetic prompts (4 samples each, uneven
        /// lengths), with continuous batching and with draining batches (0: none).
        #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = args::whole(0usize, 100_000))]
        sample_prompts: usize,
        /// Completions in flight in the sampling workload.
        #[arg(long, default_value_t = 16, allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
        sample_slots: usize,
        /// In the sampling workload, also end a completion at every token id that is a multiple
        /// of this (0: only at the tokenizer's end-of-sequence tokens). A model with random
        /// weights draws its end-of-sequence token almost never, so that every completion runs to
        /// the budget; with 64, about one step in 64 ends a completion, giving the uneven lengths
        /// that continuous batching is for.
        #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = args::whole(0i64, 1 << 30))]
        sample_stop_every: i64,
        /// Last, also record a short greedy generation (up to 32 tokens) at each --profile-batch
        /// with libtorch's profiler (Kineto, as torch.profiler), eagerly and with CUDA graphs: one
        /// Chrome trace a run in this folder (open it in Perfetto) and one summary line each
        /// (kernels and launches a step, the device's busy share, copies to the host, the
        /// costliest kernels and operators). The profiler logs a few lines of its own on stderr
        /// (KINETO_LOG_LEVEL=5 silences most).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// The batch sizes --profile records (repeat the flag, or comma-separated).
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64], allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
        profile_batch: Vec<usize>,
    },
    /// The GPU check's own measurements (parity with the CPU, the bf16 peak, the losses' speed
    /// and host reads); one JSON line per measurement.
    Check {
        #[command(subcommand)]
        what: CheckCommand,
    },
    /// Print the teacher-forced log-probabilities of a completion as JSON.
    Score {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        prompt: String,
        #[arg(long)]
        completion: String,
        #[arg(long)]
        chat: bool,
    },
}

/// `verify`'s options.
#[derive(clap::Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub task: TaskArgs,
    /// How the solutions are sampled (--max-new-tokens: their budget).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The verifier's training (TOPR by default).
    #[command(flatten)]
    pub train: TrainArgs,
    /// Working directory: the solutions, the judge problems, the verifier's `iterate` run and
    /// the results.
    #[arg(long)]
    pub work: PathBuf,
    /// Solutions sampled per question (training and held-out; >= 1).
    #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
    pub samples: usize,
    /// Rounds of the verifier's training, each on both verdicts of every judged solution
    /// scored under the previous round's model (0: the model judges untrained).
    #[arg(long, default_value_t = 2, allow_hyphen_values = true, value_parser = args::whole(0usize, 1000))]
    pub judge_iterations: usize,
    /// Solutions in flight while sampling: this many questions' k solutions (>= 1; 32 × k by
    /// default, as `sample`'s; continuous batching). Another value changes speed, memory and, on
    /// some CPUs, the rounding of the batched products.
    #[arg(long, default_value_t = 32, allow_hyphen_values = true, value_parser = args::whole(1usize, 4096))]
    pub batch_prompts: usize,
    /// Held-out questions: a GSM8K file (needed with --task gsm8k).
    #[arg(long)]
    pub eval_data: Option<PathBuf>,
    /// Held-out questions used (the first N of --eval-data, or N synthetic ones).
    #[arg(long, default_value_t = 128, allow_hyphen_values = true, value_parser = args::whole(1usize, 1_000_000))]
    pub eval_n: usize,
    /// Seeds the solutions.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub seed: i64,
}

impl VerifyArgs {
    fn run(self) -> anyhow::Result<()> {
        if self.task.task == args::TaskArg::Gsm8k && self.eval_data.is_none() {
            anyhow::bail!("--task gsm8k needs --eval-data PATH (e.g. the test file) for the held-out questions");
        }
        let settings = topr_llama::verify::VerifySettings {
            task: self.task.spec()?,
            eval_data: self.eval_data,
            eval_n: self.eval_n,
            k: self.samples,
            sampling: self.sampling.sampling(),
            train: self.train.settings()?,
            judge_iterations: self.judge_iterations,
            batch_prompts: self.batch_prompts,
            seed: self.seed,
            work: self.work,
        };
        let summary = topr_llama::verify::run(&self.model.model, self.model.placement(), &settings)?;
        topr_llama::verify::print_summary(&summary);
        Ok(())
    }
}

/// `demo`'s options.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// Working directory (one folder per stage).
    #[arg(long, default_value = "runs/demo")]
    pub work: PathBuf,
    /// A CI-sized run (tiny model, a few steps): checks the pipeline, learns nothing
    /// (the same as --scale quick).
    #[arg(long, conflicts_with = "scale")]
    pub quick: bool,
    /// The demo's size: full (the README's, about 7 minutes on 2 CPU cores), gpu (the GPU
    /// check's larger model and data) or quick.
    #[arg(long, value_enum, default_value_t = DemoScale::Full)]
    pub scale: DemoScale,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// Continue an interrupted demo (finished stages are kept).
    #[arg(long)]
    pub resume: bool,
    /// On a CUDA device, generate by replaying CUDA graphs of the decoding step (as
    /// `sample --cuda-graphs`).
    #[arg(long)]
    pub cuda_graphs: bool,
    /// Epochs of the SFT warm-up (default: the scale's, 4 at full scale).
    #[arg(long, allow_hyphen_values = true, value_parser = args::whole(1usize, 1000))]
    pub sft_epochs: Option<usize>,
    /// TOPR iterations after the warm-up (default: the scale's, 3 at full scale).
    #[arg(long, allow_hyphen_values = true, value_parser = args::whole(1usize, 1000))]
    pub iterations: Option<usize>,
}

impl DemoArgs {
    fn run(self) -> anyhow::Result<()> {
        let mut scale = if self.quick { topr_llama::demo::Scale::quick() } else { demo_scale(self.scale) };
        scale.sft_epochs = self.sft_epochs.unwrap_or(scale.sft_epochs);
        scale.iterations = self.iterations.unwrap_or(scale.iterations);
        let at = topr_llama::checkpoint::Placement {
            cuda_graphs: self.cuda_graphs,
            ..topr_llama::checkpoint::Placement::f32(self.device)
        };
        topr_llama::demo::run(&self.work, scale, at, self.resume)
    }
}

/// `study`'s options.
#[derive(clap::Args)]
pub struct StudyArgs {
    /// Working directory (one folder per seed, one per arm inside it).
    #[arg(long, default_value = "runs/study")]
    pub work: PathBuf,
    /// The claims to test, comma-separated: negatives, degeneration, peers, natural,
    /// composition, off-policy and off-policy-baseline (one iteration each), iterated (5 iterations),
    /// learning-rate and warm-up-data (the demo's 3 iterations), verifier, or all (the demo
    /// model's claims); on a real model (--model): real-negatives, real-composition (one
    /// iteration each), real-iterated (2 iterations).
    #[arg(long, default_value = "negatives,degeneration", value_parser = parse_claims)]
    pub claims: Claims,
    /// Number of seeds (the seeds 0..n).
    #[arg(long, default_value_t = 5, value_parser = args::whole(1usize, 1000))]
    pub seeds: usize,
    /// The demo scale the runs use (default full: the README's model and data).
    #[arg(long, value_enum)]
    pub scale: Option<DemoScale>,
    /// Iterations per arm (default: the scale's), where a claim does not fix its own.
    #[arg(long, value_parser = args::whole(1usize, 1000))]
    pub iterations: Option<usize>,
    /// Training questions sampled per iteration (default: the scale's).
    #[arg(long, value_parser = args::whole(1usize, 1_000_000))]
    pub prompts: Option<usize>,
    /// Held-out questions per seed (default: the scale's).
    #[arg(long, value_parser = args::whole(1usize, 1_000_000))]
    pub eval_n: Option<usize>,
    /// cpu (default), cuda or cuda:N.
    #[arg(long, value_parser = parse_device)]
    pub device: Option<Device>,
    /// Only redraw study.jsonl, study.md and the plots from what is finished; run nothing
    /// (safe beside a running study of the same work directory). The sizes and numerics come
    /// from the study's record (study.json), so --scale, --iterations, --prompts, --eval-n and
    /// --device are refused with it; --model may be left out, and its folder need not exist.
    #[arg(long)]
    pub report_only: bool,
    /// The real model the real-model claims (real-negatives, real-composition, real-iterated)
    /// start from: SmolLM2-135M-Instruct, which scripts/smollm2.sh builds in
    /// models/smollm2-135m-instruct. Their sizes are fixed (256 training and 256 held-out
    /// questions a seed, a 128-token budget); --scale, --iterations, --prompts and --eval-n apply
    /// to the demo model's claims.
    #[arg(long)]
    pub model: Option<PathBuf>,
}

impl StudyArgs {
    fn run(self) -> anyhow::Result<()> {
        let mut scale = demo_scale(self.scale.unwrap_or(DemoScale::Full));
        scale.iterations = self.iterations.unwrap_or(scale.iterations);
        scale.prompts = self.prompts.unwrap_or(scale.prompts);
        scale.eval_n = self.eval_n.unwrap_or(scale.eval_n);
        let mut settings = topr_llama::study::StudySettings {
            work: self.work.clone(),
            claims: self.claims.0.clone(),
            seeds: topr_llama::study::seeds(self.seeds),
            scale,
            at: topr_llama::checkpoint::Placement::f32(self.device.unwrap_or(Device::Cpu)),
            model: self.model.clone(),
        };
        if !self.report_only {
            // Every refusal of the check concerns the real model: what --model gives, or lacks.
            topr_llama::study::check(&settings, true).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
            return topr_llama::study::run(&settings);
        }
        let asked = [
            ("--scale", self.scale.is_some()),
            ("--iterations", self.iterations.is_some()),
            ("--prompts", self.prompts.is_some()),
            ("--eval-n", self.eval_n.is_some()),
            ("--device", self.device.is_some()),
        ];
        if let Some((flag, _)) = asked.iter().find(|(_, given)| *given) {
            anyhow::bail!(
                "{flag}: --report-only reports what the runs were made with, from the study's record (study.json); drop {flag}"
            );
        }
        if !settings.work.is_dir() {
            let why = if settings.work.exists() { "not a directory" } else { "no such directory" };
            anyhow::bail!("--report-only: {} holds no study ({why})", settings.work.display());
        }
        let Some(record) = topr_llama::study::StudyRecord::read(&settings.work)? else {
            anyhow::bail!(
                "--report-only: {} has no study.json (a study started before 2026-12-02): run `study` once with the flags it was started with, which reuses every finished stage and records them",
                settings.work.display()
            );
        };
        settings.scale = record.scale;
        // The tables come from the records alone: the real model's weights need not be at hand
        // (a clone of the committed records has none), and --model may be left out.
        if settings.claims.iter().any(|c| c.is_real()) {
            settings.model = settings.model.or(record.model);
        }
        topr_llama::study::check(&settings, false).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
        topr_llama::study::report(&settings)
    }
}

impl Command {
    /// Whether the command runs as one rank of a group when launched as one (the others would
    /// all write the same files).
    fn data_parallel(&self) -> bool {
        matches!(self, Self::Eval { .. } | Self::Sample { .. } | Self::Train { .. } | Self::Iterate { .. })
    }

    /// The device of a data-parallel command's model.
    fn device(&self) -> Option<tch::Device> {
        match self {
            Self::Eval { model, .. }
            | Self::Sample { model, .. }
            | Self::Train { model, .. }
            | Self::Iterate { model, .. } => Some(model.device),
            _ => None,
        }
    }
}

/// The process group of a launched run (`None`: launched alone). Commands that do not run
/// data-parallel are refused under a group of more than one process.
fn join(command: &Command, timeout: std::time::Duration) -> anyhow::Result<Option<ProcessGroup>> {
    let Some(launch) = Launch::from_env()? else { return Ok(None) };
    if !command.data_parallel() {
        if launch.world_size > 1 {
            anyhow::bail!(
                "WORLD_SIZE={}: only eval, sample, train and iterate run as a group; run this command as one process (without WORLD_SIZE)",
                launch.world_size
            );
        }
        return Ok(None);
    }
    let mut group = ProcessGroup::join(&launch, timeout)?;
    // CUDA tensors on NCCL, device to device, unless TOPR_DIST_BACKEND=gloo asks for Gloo (which
    // stages them through the host), where the build has NCCL.
    let gloo = std::env::var("TOPR_DIST_BACKEND").is_ok_and(|b| b == "gloo");
    if command.device().is_some_and(|d| d.is_cuda()) && topr_dist::nccl_available() && !gloo {
        group.use_nccl()?;
    }
    // Which engine a GPU run's gradients take, said once (rank 0), so that a log shows it (on
    // the CPU it is always Gloo).
    if group.rank() == 0 && command.device().is_some_and(|d| d.is_cuda()) {
        let engine = if group.uses_nccl() { "NCCL, device to device" } else { "Gloo, through the host" };
        eprintln!("data parallel: {} rank(s), gradients on {engine}", group.world_size());
    }
    Ok(Some(group))
}

/// Runs one subcommand.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    use commands as c;
    let group = join(&cli.command, std::time::Duration::from_secs(cli.dist_timeout))?;
    let group = group.as_ref();
    match cli.command {
        Command::Generate { model, prompt, chat, decoding } => c::generate(&model, &prompt, chat, &decoding),
        Command::Eval { model, task, sampling, samples, batch_size, seed, out, shard } => {
            let how = c::EvalRun { samples, batch_size, seed, shard };
            c::eval(&model, &task, &sampling, &how, out.as_deref(), group)
        }
        Command::Sample { model, task, out, samples_per_prompt, sampling, batch_prompts, seed, shard } => {
            let how = c::SampleRunArgs { samples_per_prompt, batch_prompts, seed, shard };
            c::sample(&model, &task, &out, &sampling, &how, group)
        }
        Command::Merge { out, shards } => c::merge(&shards, &out),
        Command::Train { model, data, out, train } => c::train(&model, &data, &out, &train, group),
        Command::Iterate { model, task, train, sampling, iterate } => {
            let settings = iterate.settings(&task, &train, &sampling)?;
            topr_llama::iterate::run(&model.model, model.placement(), &settings, group)
        }
        Command::Verify(a) => a.run(),
        Command::Init { out, size, vocab_size, seed } => c::init(&out, &size, vocab_size, seed),
        Command::SftData { model, task, out, slip_rate } => c::sft_data(&model, &task, &out, slip_rate),
        Command::Demo(a) => a.run(),
        Command::Study(a) => a.run(),
        Command::Compare { run, iteration, arms, device, dtype, kernels } => {
            let at = topr_llama::checkpoint::Placement { device, kind: dtype.into(), kernels, cuda_graphs: false };
            let s = topr_llama::compare::CompareSettings { run, iteration, arms: arms.0, at };
            topr_llama::compare::run(&s).map(|_| ())
        }
        Command::Plot { dir } => c::plot(&dir),
        Command::Convert { model, out } => c::convert(&model, &out),
        Command::Bench {
            model,
            new_tokens,
            gen_batch,
            train_batch,
            train_len,
            kernel_pairs,
            prompt_pairs,
            sample_prompts,
            sample_slots,
            sample_stop_every,
            profile,
            profile_batch,
        } => {
            let (mut m, tok) = c::load(&model)?;
            let graphs = bench::run(&mut m, &tok, new_tokens, &gen_batch, train_batch, train_len)?;
            bench::sampling(&m, &tok, sample_prompts, sample_slots, new_tokens, sample_stop_every)?;
            bench::prompt_pairs(&m, train_batch, train_len, prompt_pairs)?;
            bench::kernel_pairs(&mut m, train_batch, train_len, kernel_pairs)?;
            match profile {
                Some(dir) => bench::profile(&mut m, &tok, new_tokens, graphs, &dir, &profile_batch),
                None => Ok(()),
            }
        }
        Command::Check { what } => match what {
            CheckCommand::Parity { model, device, prompts, len, new_tokens } => {
                check::parity(&model, device, prompts, len, new_tokens)
            }
            CheckCommand::Peak { device, n } => check::peak(device, n),
            CheckCommand::Losses { device, batch, len, iters } => check::losses(device, batch, len, iters),
        },
        Command::Score { model, prompt, completion, chat } => c::score(&model, &prompt, &completion, chat),
    }
}

/// `demo --scale`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum DemoScale {
    Full,
    Gpu,
    Quick,
}

fn demo_scale(s: DemoScale) -> topr_llama::demo::Scale {
    use topr_llama::demo::Scale;
    match s {
        DemoScale::Quick => Scale::quick(),
        DemoScale::Full => Scale::full(),
        DemoScale::Gpu => Scale::gpu(),
    }
}

/// `study --claims`: the claims, in the order given, without repeats.
#[derive(Clone, Debug)]
pub struct Claims(pub Vec<topr_llama::study::Claim>);

#[derive(Clone)]
pub struct Arms(pub Vec<topr_llama::compare::CompareArm>);

/// `sft,reinforce,topr-p0.2`: objectives by their command-line names, `-pP` for the baseline of
/// the effective positive proportion P.
fn parse_arms(s: &str) -> Result<Arms, String> {
    use topr_llama::train::Baseline;
    let mut out: Vec<topr_llama::compare::CompareArm> = vec![];
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let (objective, baseline) = match name.rsplit_once("-p").map(|(o, p)| (o, p.parse::<f64>())) {
            Some((o, Ok(p))) => {
                if !(p > 0.0 && p < 1.0) {
                    return Err(format!("arm {name:?}: the effective positive proportion must lie in (0, 1), got {p}"));
                }
                (o, Baseline::TargetPositiveProportion(p))
            }
            _ => (name, Baseline::Zero),
        };
        let objective = <topr_llama::settings::Objective as clap::ValueEnum>::from_str(objective, false)
            .map_err(|_| format!("arm {name:?}: unknown objective {objective:?} (see `llama train --help`)"))?;
        if out.iter().any(|a| a.name == name) {
            return Err(format!("arm {name:?} is listed twice"));
        }
        out.push(topr_llama::compare::CompareArm { name: name.into(), objective, baseline });
    }
    if out.is_empty() {
        return Err("no arm given".into());
    }
    Ok(Arms(out))
}

fn parse_claims(s: &str) -> Result<Claims, String> {
    use topr_llama::study::Claim;
    let mut out = vec![];
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let found: Vec<Claim> = if name == "all" {
            Claim::ALL.to_vec()
        } else {
            vec![Claim::parse(name).ok_or_else(|| {
                let known: Vec<&str> = Claim::ALL.iter().chain(&Claim::REAL).map(|c| c.name()).collect();
                format!("unknown claim {name:?}: expected one of {}, or all", known.join(", "))
            })?]
        };
        for c in found {
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    if out.is_empty() {
        return Err("no claim given".into());
    }
    Ok(Claims(out))
}

/// The measurements of `llama check`.
#[derive(Subcommand)]
pub enum CheckCommand {
    /// Logits of one checkpoint on --device in f32 and bf16 against the CPU in f32, and greedy
    /// generations in f32 on both.
    Parity {
        /// A model directory (Hugging Face layout).
        #[arg(long)]
        model: PathBuf,
        /// cuda, cuda:N or cpu (cpu compares the CPU with itself: a check of the command only).
        #[arg(long, default_value = "cuda", value_parser = parse_device)]
        device: Device,
        /// Random prompts (>= 1).
        #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = args::whole(1i64, 4096))]
        prompts: i64,
        /// Tokens per prompt (>= 1).
        #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = args::whole(1i64, 1 << 16))]
        len: i64,
        /// Greedy tokens generated per prompt (>= 1).
        #[arg(long, default_value_t = 32, allow_hyphen_values = true, value_parser = args::whole(1i64, 1 << 16))]
        new_tokens: i64,
    },
    /// TFLOP/s of an N × N bf16 matrix product (best of 10).
    Peak {
        #[arg(long, default_value = "cuda", value_parser = parse_device)]
        device: Device,
        /// The matrices' size (1 to 65536). They take 6·N² bytes: 0.4 GB at 8192, 25.8 GB at
        /// 65536; more than the available memory is refused.
        #[arg(long, default_value_t = 8192, allow_hyphen_values = true, value_parser = args::whole(1i64, 1 << 16))]
        n: i64,
    },
    /// Forward + backward time and host reads per call of topr_token_loss, ppo_clip_loss and
    /// dpo_loss, with full and with shape-only checks.
    Losses {
        #[arg(long, default_value = "cuda", value_parser = parse_device)]
        device: Device,
        /// Sequences (>= 2; DPO pairs the first half with the second).
        #[arg(long, default_value_t = 512, allow_hyphen_values = true, value_parser = args::whole(2i64, 1 << 20))]
        batch: i64,
        /// Tokens per sequence (>= 2).
        #[arg(long, default_value_t = 2048, allow_hyphen_values = true, value_parser = args::whole(2i64, 1 << 20))]
        len: i64,
        /// Timed calls per loss (>= 1). The run takes about 128 bytes per token (batch × len;
        /// 0.13 GB at the defaults) besides the process; more than the available memory is
        /// refused.
        #[arg(long, default_value_t = 20, allow_hyphen_values = true, value_parser = args::whole(1usize, 1 << 20))]
        iters: usize,
    },
}

/// The first paragraph of a multi-line message, as one line.
pub fn first_paragraph(text: &str) -> String {
    text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect::<Vec<_>>().join(" ")
}

/// An error as one line (`outer: inner: …`), the library's refusals worded with the flag that
/// lifts them.
pub fn message(e: &anyhow::Error) -> String {
    let part = |cause: &(dyn std::error::Error + 'static)| match cause.downcast_ref::<Refusal>() {
        Some(r) => refusal(r),
        None => cause.to_string(),
    };
    e.chain().map(part).collect::<Vec<_>>().join(": ")
}

fn refusal(r: &Refusal) -> String {
    match r {
        Refusal::InterruptedTraining { dir, state } => format!(
            "{} holds the state of an interrupted run: pass --resume to continue it, or remove {}",
            dir.display(),
            state.display()
        ),
        Refusal::EarlierIterations(work) => format!(
            "{} holds an earlier run: pass --resume to continue it (finished stages are kept), or choose another --work",
            work.display()
        ),
        Refusal::EarlierDemo(work) => {
            format!("{} holds an earlier demo: pass --resume to continue it, or choose another --work", work.display())
        }
        Refusal::FinishedModel(out) => {
            format!("{} holds a finished model: choose another --out, or remove it to train again", out.display())
        }
        Refusal::ChangedSettings { dir, differences, run } => {
            let (what, remedy) = match run {
                topr_llama::Resumable::Training => ("--resume: settings differ from the saved run in", "--out"),
                topr_llama::Resumable::Sampling => ("settings differ from those that sampled", "--out"),
                topr_llama::Resumable::Iterations => ("--resume: settings differ from the saved run in", "--work"),
                topr_llama::Resumable::Verifier => ("settings differ from the verifier's earlier run in", "--work"),
                topr_llama::Resumable::WarmUp => ("settings differ from those that made the warm-up in", "--work"),
                topr_llama::Resumable::Study => ("settings differ from those the study was started with in", "--work"),
            };
            format!("{what} {}: {} (use another {remedy} to start a new run)", dir.display(), differences.join(", "))
        }
        Refusal::RecordTooLong { path, record, id, tokens, context } => format!(
            "{}: record {record} ({id}) has {tokens} tokens, more than the model's context of {context} (--skip-bad-records skips such records)",
            path.display()
        ),
        Refusal::UnfinishedData { path, have, want } => format!(
            "{}: {have} of its {want} completions are sampled (an interrupted `sample`: rerun it with the same flags to finish)",
            path.display()
        ),
    }
}
