//! A Llama for the topr-loss examples: loads Hugging Face checkpoints (Llama 2, 3, 3.1, 3.2,
//! TinyLlama, SmolLM2), tokenizes with the `tokenizers` crate, generates with a KV cache, and runs
//! the paper's self-taught loop: sample graded data sets with μ, train off-policy with any of the
//! crate's objectives, evaluate, repeat.
//!
//! ```text
//! cargo run --release --example llama -- demo                       # the README's demo (7 min on 2 cores)
//! cargo run --release --example llama -- generate --model DIR --prompt "2+2?" --chat --greedy
//! cargo run --release --example llama -- sample --model DIR --task synthetic --out data.jsonl
//! cargo run --release --example llama -- train --model DIR --data data.jsonl --out DIR2 --objective topr
//! cargo run --release --example llama -- iterate --model DIR --work WORK --iterations 3
//! ```
//!
//! Results go to stdout (completions, JSON summaries, tables); logs and progress bars to stderr.
//! Every subcommand is described in `docs/llama.md`.

mod checkpoint;
mod config;
mod demo;
mod eval;
mod generate;
mod init;
mod iterate;
mod model;
mod optim;
mod plot;
mod sample;
mod task;
mod tokenizer;
mod train;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use tch::{Device, Kind};

#[derive(Parser)]
#[command(
    name = "llama",
    about = "Llama checkpoints for topr-loss: generate, evaluate, sample, train off-policy, iterate"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// A Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

/// Training settings shared by `train` and `iterate`.
#[derive(Args, Clone)]
struct TrainArgs {
    /// topr, tis, sft, reinforce, is (the TOPR family), ppo, grpo or dpo.
    #[arg(long, default_value = "topr")]
    objective: String,
    /// The baseline c subtracted from rewards.
    #[arg(long, allow_hyphen_values = true)]
    baseline: Option<f64>,
    /// Derive the baseline from the data set's share of positives so that positives carry this
    /// share of the weight (the paper finds 0.1–0.2 best on GSM8K).
    #[arg(long)]
    target_positive_proportion: Option<f64>,
    /// sequence (the paper), sequence-mean (verl) or token (Trinity-RFT).
    #[arg(long, default_value = "sequence")]
    ratio: String,
    #[arg(long, default_value_t = 1e-5)]
    lr: f64,
    /// adamw, or adafactor (factored second moments, no first moment: the paper's optimiser and
    /// the one that fits an 8B model on one GPU).
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// DPO's β (strength of the implicit KL constraint to μ).
    #[arg(long, default_value_t = 0.1)]
    dpo_beta: f64,
    /// Completions per optimiser step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Completions per forward/backward pass (gradient accumulation; same update for any value).
    #[arg(long, default_value_t = 4)]
    micro_batch_size: usize,
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// Decay the learning rate linearly to 0 after the warm-up (else constant).
    #[arg(long)]
    lr_decay: bool,
    #[arg(long, default_value_t = 0)]
    train_seed: u64,
    /// Skip malformed data-set records and completions longer than the context (counted).
    #[arg(long)]
    skip_bad_records: bool,
    /// Save the training state (model, optimiser, position) every this many steps, so that a
    /// killed run loses at most that many (0: never).
    #[arg(long, default_value_t = 1)]
    save_every: usize,
    /// Continue an interrupted run from its saved state.
    #[arg(long)]
    resume: bool,
}

impl TrainArgs {
    fn options(&self) -> Result<train::Options> {
        Ok(train::Options {
            objective: train::Objective::parse(&self.objective)?,
            baseline: self.baseline,
            target_positive_proportion: self.target_positive_proportion,
            ratio: match self.ratio.as_str() {
                "sequence" => topr_loss::RatioLevel::Sequence,
                "sequence-mean" => topr_loss::RatioLevel::SequenceMean,
                "token" => topr_loss::RatioLevel::Token,
                other => bail!("--ratio must be sequence, sequence-mean or token, got {other:?}"),
            },
            optimizer: optim::OptimizerConfig::parse(&self.optimizer, self.weight_decay)?,
            lr: self.lr,
            batch_size: self.batch_size.max(1),
            micro_batch_size: self.micro_batch_size.max(1),
            epochs: self.epochs,
            max_grad_norm: self.max_grad_norm,
            warmup_steps: self.warmup_steps,
            lr_decay: self.lr_decay,
            seed: self.train_seed,
            dpo_beta: self.dpo_beta,
            save_every: self.save_every,
            resume: self.resume,
        })
    }
}

/// Sampling settings shared by `eval` and `sample`.
#[derive(Args, Clone)]
struct SamplingArgs {
    #[arg(long, default_value_t = 256)]
    max_new_tokens: i64,
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: i64,
}

impl SamplingArgs {
    fn sampling(&self) -> generate::Sampling {
        generate::Sampling {
            greedy: false,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_new_tokens: self.max_new_tokens,
        }
    }
}

#[derive(Args, Clone)]
struct TaskArgs {
    /// gsm8k (needs --data) or synthetic.
    #[arg(long, default_value = "synthetic")]
    task: String,
    /// A GSM8K JSONL file (the public release's layout).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Use at most this many problems (0: all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Synthetic task: number of problems, difficulty (operations per problem) and seed.
    #[arg(long, default_value_t = 200)]
    synthetic_n: usize,
    #[arg(long, default_value_t = 2)]
    difficulty: usize,
    #[arg(long, default_value_t = 1)]
    task_seed: u64,
    /// chat (the model's chat template) or few-shot.
    #[arg(long, default_value = "chat")]
    prompt_style: String,
    /// Worked examples for few-shot prompts (from --shots-data for GSM8K, generated otherwise).
    #[arg(long, default_value_t = 4)]
    shots: usize,
    #[arg(long)]
    shots_data: Option<PathBuf>,
    /// Skip malformed data lines (counted) instead of stopping at the first.
    #[arg(long)]
    skip_bad_lines: bool,
}

impl TaskArgs {
    /// The problems and the prompt style.
    fn load(&self) -> Result<(Vec<task::Problem>, eval::PromptStyle)> {
        let mut problems = match self.task.as_str() {
            "gsm8k" => {
                let path = self.data.as_ref().context("--task gsm8k needs --data PATH (a GSM8K JSONL file)")?;
                let (p, skipped) = task::load_gsm8k(path, self.skip_bad_lines)?;
                if skipped > 0 {
                    eprintln!("skipped {skipped} malformed line(s) of {}", path.display());
                }
                p
            }
            "synthetic" => task::synthetic_problems(self.task_seed, self.synthetic_n, self.difficulty),
            other => bail!("--task must be gsm8k or synthetic, got {other:?}"),
        };
        if self.limit > 0 {
            problems.truncate(self.limit);
        }
        let style = match self.prompt_style.as_str() {
            "chat" => eval::PromptStyle::Chat,
            "few-shot" => {
                let shots = match (&self.shots_data, self.task.as_str()) {
                    (Some(p), _) => task::load_gsm8k(p, self.skip_bad_lines)?.0,
                    (None, "synthetic") => {
                        task::synthetic_problems(self.task_seed.wrapping_add(1_000_003), self.shots, self.difficulty)
                    }
                    (None, _) => bail!("--prompt-style few-shot with GSM8K needs --shots-data (e.g. the train file)"),
                };
                eval::PromptStyle::FewShot(shots.into_iter().take(self.shots).collect())
            }
            other => bail!("--prompt-style must be chat or few-shot, got {other:?}"),
        };
        Ok((problems, style))
    }
}

// Parsed once per run: the size difference between subcommands does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Print the completion of a prompt.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt in the model's chat template as a user message.
        #[arg(long)]
        chat: bool,
        #[arg(long, default_value_t = 256)]
        max_new_tokens: i64,
        /// Argmax decoding (the default when no sampling option is given).
        #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
        greedy: bool,
        #[arg(long)]
        temperature: Option<f64>,
        #[arg(long)]
        top_p: Option<f64>,
        #[arg(long)]
        top_k: Option<i64>,
        #[arg(long, default_value_t = 0)]
        seed: i64,
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
        #[arg(long, default_value_t = 0)]
        samples: usize,
        #[arg(long, default_value_t = 16)]
        batch_size: usize,
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// Per-question results (JSONL).
        #[arg(long)]
        out: Option<PathBuf>,
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
        #[arg(long, default_value_t = 4)]
        samples_per_prompt: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Prompts per generation batch (each with all its samples).
        #[arg(long, default_value_t = 4)]
        batch_prompts: usize,
        #[arg(long, default_value_t = 0)]
        seed: i64,
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
        /// Working directory: one folder per iteration, and iterations.jsonl.
        #[arg(long)]
        work: PathBuf,
        #[arg(long, default_value_t = 3)]
        iterations: usize,
        #[arg(long, default_value_t = 4)]
        samples_per_prompt: usize,
        #[arg(long, default_value_t = 8)]
        batch_prompts: usize,
        /// none, or one-positive: keep every negative and one positive per question.
        #[arg(long, default_value = "none")]
        curate: String,
        /// Held-out evaluation: a GSM8K file (with --task gsm8k) or this many synthetic problems.
        #[arg(long)]
        eval_data: Option<PathBuf>,
        #[arg(long, default_value_t = 128)]
        eval_n: usize,
        #[arg(long, default_value_t = 64)]
        eval_batch_size: usize,
    },
    /// Create a small Llama from scratch (random weights, byte-level tokenizer, chat template) in
    /// the Hugging Face layout: a model that needs nothing downloaded.
    Init {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 4)]
        layers: i64,
        #[arg(long, default_value_t = 128)]
        hidden: i64,
        #[arg(long, default_value_t = 4)]
        heads: i64,
        #[arg(long, default_value_t = 2)]
        kv_heads: i64,
        #[arg(long, default_value_t = 384)]
        intermediate: i64,
        #[arg(long, default_value_t = 512)]
        max_positions: i64,
        #[arg(long, default_value_t = 0)]
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
        #[arg(long, default_value_t = 0.0)]
        slip_rate: f64,
    },
    /// The README's demo: a small Llama from scratch, a supervised warm-up on a sloppy teacher's
    /// worked solutions, then TOPR iterations on its own graded samples; prints the table and
    /// writes the plots. About 7 minutes on 2 CPU cores.
    Demo {
        /// Working directory (one folder per stage).
        #[arg(long, default_value = "runs/demo")]
        work: PathBuf,
        /// A CI-sized run (tiny model, a few steps): checks the pipeline, learns nothing.
        #[arg(long)]
        quick: bool,
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Continue an interrupted demo (finished stages are kept).
        #[arg(long)]
        resume: bool,
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
    /// Measure generation (batch 1 and 16) and training forward+backward throughput; prints JSON.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value_t = 64)]
        new_tokens: i64,
        #[arg(long, default_value_t = 8)]
        train_batch: i64,
        #[arg(long, default_value_t = 128)]
        train_len: i64,
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

/// Parses `--device`, refusing CUDA when this machine has none.
pub fn parse_device(s: &str) -> Result<Device> {
    let d = match s {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Device::Cuda(i),
            _ => bail!("--device must be cpu, cuda or cuda:N, got {other:?}"),
        },
    };
    if let Device::Cuda(i) = d {
        let n = tch::Cuda::device_count() as usize;
        if n == 0 {
            bail!("--device {s}: CUDA is not available on this machine (no GPU, or a CPU-only libtorch)");
        }
        if i >= n {
            bail!("--device {s}: this machine has {n} CUDA device(s)");
        }
    }
    Ok(d)
}

/// Parses `--dtype`.
pub fn parse_dtype(s: &str) -> Result<Kind> {
    Ok(match s {
        "f32" | "float32" => Kind::Float,
        "bf16" | "bfloat16" => Kind::BFloat16,
        "f16" | "float16" => Kind::Half,
        other => bail!("--dtype must be f32, bf16 or f16, got {other:?}"),
    })
}

fn load(args: &ModelArgs) -> Result<(model::Llama, tokenizer::Tokenizer)> {
    let device = parse_device(&args.device)?;
    let kind = parse_dtype(&args.dtype)?;
    let t0 = std::time::Instant::now();
    let m = checkpoint::load(&args.model, device, kind).with_context(|| format!("loading {}", args.model.display()))?;
    let tok = tokenizer::Tokenizer::load(&args.model, &m.cfg)?;
    eprintln!(
        "loaded {} ({} layers, {:?}, {:?}) in {:.1} s",
        args.model.display(),
        m.cfg.num_hidden_layers,
        kind,
        device,
        t0.elapsed().as_secs_f64()
    );
    Ok((m, tok))
}

/// `train`: loads the model and the data set, trains, saves the model (Hugging Face layout) with
/// `metrics.jsonl` and `training.png` in `out`, and removes the training state.
fn train_to_dir(
    args: &ModelArgs,
    data: &std::path::Path,
    o: &train::Options,
    skip_bad: bool,
    out: &std::path::Path,
) -> Result<train::Summary> {
    let (m, _) = load(args)?;
    let samples = train::load_data(data, m.cfg.max_position_embeddings as usize, skip_bad)?;
    let summary = train::run(&m, &samples, o, out)?;
    checkpoint::save(&m, &args.model, out)?;
    train::finish(out);
    plot::report("training", || plot::plot_training(out));
    Ok(summary)
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate { model, prompt, chat, max_new_tokens, greedy, temperature, top_p, top_k, seed } => {
            let (m, tok) = load(&model)?;
            let sampling_given = temperature.is_some() || top_p.is_some() || top_k.is_some();
            let s = generate::Sampling {
                greedy: greedy || !sampling_given,
                temperature: temperature.unwrap_or(1.0),
                top_p: top_p.unwrap_or(1.0),
                top_k: top_k.unwrap_or(0),
                max_new_tokens,
            };
            tch::manual_seed(seed);
            let ids = tok.prompt_ids(&prompt, chat)?;
            let t0 = std::time::Instant::now();
            let out = generate::generate(&m, &[ids], &s, &tok.eos_ids, tok.pad_id)?;
            let c = &out[0];
            eprintln!(
                "{} tokens in {:.2} s ({:.1} tokens/s), stopped by {:?}",
                c.tokens.len(),
                t0.elapsed().as_secs_f64(),
                c.tokens.len() as f64 / t0.elapsed().as_secs_f64(),
                c.stop
            );
            println!("{}", tok.decode(&c.tokens)?);
        }
        Command::Eval { model, task, sampling, samples, batch_size, seed, out } => {
            let (m, tok) = load(&model)?;
            let (problems, style) = task.load()?;
            tch::manual_seed(seed);
            let max_new_tokens = sampling.max_new_tokens;
            let sampling = sampling.sampling();
            sampling.check()?;
            let mut file = match &out {
                Some(p) => Some(std::io::BufWriter::new(
                    std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
                )),
                None => None,
            };
            let sink = file.as_mut().map(|f| f as &mut dyn std::io::Write);
            let s = eval::evaluate(
                &m,
                &tok,
                &problems,
                &style,
                max_new_tokens,
                samples,
                sampling,
                batch_size.max(1),
                sink,
            )?;
            println!("{}", serde_json::to_string(&s)?);
        }
        Command::Sample { model, task, out, samples_per_prompt, sampling, batch_prompts, seed } => {
            let (m, tok) = load(&model)?;
            let (problems, style) = task.load()?;
            let s = sampling.sampling();
            let n =
                sample::sample_dataset(&m, &tok, &problems, &style, samples_per_prompt, &s, seed, batch_prompts, &out)?;
            let (all, _) = sample::read_dataset(&out, false)?;
            let correct = all.iter().filter(|x| x.correct).count();
            let invalid = all.iter().filter(|x| x.invalid).count();
            eprintln!("wrote {n} new completion(s) to {}", out.display());
            println!(
                "{}",
                serde_json::json!({"completions": all.len(), "correct_fraction": correct as f64 / all.len().max(1) as f64, "invalid_fraction": invalid as f64 / all.len().max(1) as f64})
            );
        }
        Command::Train { model, data, out, train } => {
            let summary = train_to_dir(&model, &data, &train.options()?, train.skip_bad_records, &out)?;
            eprintln!("saved the trained model and metrics.jsonl to {}", out.display());
            println!("{}", serde_json::to_string(&summary)?);
        }
        Command::Iterate {
            model,
            task,
            train,
            sampling,
            work,
            iterations,
            samples_per_prompt,
            batch_prompts,
            curate,
            eval_data,
            eval_n,
            eval_batch_size,
        } => {
            let it = iterate::Plan {
                task,
                options: train.options()?,
                skip_bad_lines: train.skip_bad_records,
                sampling: sampling.sampling(),
                work,
                iterations,
                samples_per_prompt,
                batch_prompts,
                curate: iterate::Curation::parse(&curate)?,
                eval_data,
                eval_n,
                eval_batch_size,
            };
            iterate::run(&model, &it)?;
        }
        Command::Init { out, layers, hidden, heads, kv_heads, intermediate, max_positions, seed } => {
            let size = init::Size { layers, hidden, heads, kv_heads, intermediate, max_positions };
            init::init(&out, size, seed)?;
            eprintln!("wrote a new model to {}", out.display());
        }
        Command::SftData { model, task, out, slip_rate } => {
            let cfg = config::LlamaConfig::load(&model.model)?;
            let tok = tokenizer::Tokenizer::load(&model.model, &cfg)?;
            let (problems, style) = task.load()?;
            let n = sample::write_solutions(&tok, &problems, &style, &out, slip_rate, task.task_seed)?;
            eprintln!("wrote {n} worked solutions to {}", out.display());
        }
        Command::Demo { work, quick, device, resume } => {
            demo::run(&work, if quick { demo::Scale::quick() } else { demo::Scale::full() }, &device, resume)?;
        }
        Command::Plot { dir } => {
            let path = if dir.join("iterations.jsonl").exists() {
                plot::plot_iterations(&dir)?
            } else if dir.join("metrics.jsonl").exists() {
                plot::plot_training(&dir)?
            } else {
                bail!("{} holds neither iterations.jsonl (iterate) nor metrics.jsonl (train)", dir.display());
            };
            eprintln!("wrote {}", path.display());
        }
        Command::Convert { model, out } => {
            let (m, _) = load(&model)?;
            checkpoint::save(&m, &model.model, &out)?;
            eprintln!("saved {}", out.display());
        }
        Command::Bench { model, new_tokens, train_batch, train_len } => {
            let (m, tok) = load(&model)?;
            bench(&m, &tok, new_tokens, train_batch, train_len)?;
        }
        Command::Score { model, prompt, completion, chat } => {
            let (m, tok) = load(&model)?;
            let p = tok.prompt_ids(&prompt, chat)?;
            let c = tok.encode(&completion, false)?;
            let logprobs = generate::score(&m, &p, &c)?;
            println!("{}", serde_json::json!({"tokens": c, "logprobs": logprobs}));
        }
    }
    Ok(())
}

/// Throughput of generation (greedy, fixed length, batch 1 and 16) and of a training step
/// (forward + backward of the mean next-token NLL), each after one warm-up run.
fn bench(
    m: &model::Llama,
    tok: &tokenizer::Tokenizer,
    new_tokens: i64,
    train_batch: i64,
    train_len: i64,
) -> Result<()> {
    use std::time::Instant;
    use tch::Tensor;
    let prompt = tok.prompt_ids("Tell me a long story about a dragon.", true)?;
    let s = generate::Sampling { greedy: true, temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: new_tokens };
    for batch in [1usize, 16] {
        let prompts = vec![prompt.clone(); batch];
        let warm = generate::Sampling { max_new_tokens: 4, ..s };
        generate::generate(m, &prompts, &warm, &[], tok.pad_id)?;
        let t0 = Instant::now();
        let out = generate::generate(m, &prompts, &s, &[], tok.pad_id)?; // no EOS: fixed length
        let secs = t0.elapsed().as_secs_f64();
        let n: usize = out.iter().map(|c| c.tokens.len()).sum();
        println!(
            "{}",
            serde_json::json!({"what": "generate", "impl": "topr-loss", "batch": batch, "new_tokens": new_tokens, "seconds": secs, "tokens_per_s": n as f64 / secs})
        );
    }
    tch::manual_seed(0);
    let ids = Tensor::randint(m.cfg.vocab_size, [train_batch, train_len], (Kind::Int64, m.device()));
    let mask = Tensor::ones([train_batch, train_len], (Kind::Int64, m.device()));
    let step = || {
        let logits = m.logits(&ids, &mask); // [B, T, V]
        let lp = logits.narrow(1, 0, train_len - 1).log_softmax(-1, Kind::Float);
        let nll = -lp.gather(2, &ids.narrow(1, 1, train_len - 1).unsqueeze(2), false).mean(Kind::Float);
        nll.backward();
    };
    step();
    let iters = 3;
    let t0 = Instant::now();
    for _ in 0..iters {
        step();
    }
    let secs = t0.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{}",
        serde_json::json!({"what": "train_fwd_bwd", "impl": "topr-loss", "batch": train_batch, "len": train_len, "seconds": secs, "tokens_per_s": (train_batch * train_len) as f64 / secs})
    );
    // The same step through the crate's fused log-prob path: no [B, T, V] logits tensor.
    let cfg = topr_loss::LogProbConfig::default();
    let labels = ids.narrow(1, 1, train_len - 1);
    let fused_step = || -> Result<()> {
        let hidden = m.hidden(&ids, &mask).narrow(1, 0, train_len - 1); // [B, T−1, H]
        let _ = topr_loss::backward_through_fused_logprobs(&hidden, m.lm_head(), &labels, None, &cfg, |lp| {
            Ok(-lp.logp.mean(Kind::Float))
        })?;
        Ok(())
    };
    fused_step()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        fused_step()?;
    }
    let secs = t0.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{}",
        serde_json::json!({"what": "train_fwd_bwd_fused_logprobs", "impl": "topr-loss", "batch": train_batch, "len": train_len, "seconds": secs, "tokens_per_s": (train_batch * train_len) as f64 / secs})
    );
    Ok(())
}
