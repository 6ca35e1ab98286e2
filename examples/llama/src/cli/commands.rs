//! What each subcommand does, from its parsed arguments: build the library's settings, call the
//! pipeline, print the result (stdout) and what was written (stderr).

use super::args::{DecodingArgs, ModelArgs, SamplingArgs, SizeArgs, TaskArgs, TrainArgs};
use anyhow::{Context, Result, bail};
use std::path::Path;
use topr_llama::eval::{self, EvalSettings};
use topr_llama::model::Llama;
use topr_llama::parallel::{self, ProcessGroup};
use topr_llama::shard::Shard;
use topr_llama::tokenizer::Tokenizer;
use topr_llama::{checkpoint, config, generate, init as new_model, io, plot, sample as sampling, train as training};

/// The model and tokenizer of `--model`, on `--device` in `--dtype`.
pub fn load(args: &ModelArgs) -> Result<(Llama, Tokenizer)> {
    checkpoint::open(&args.model, args.placement())
}

pub fn generate(model: &ModelArgs, prompt: &str, chat: bool, decoding: &DecodingArgs) -> Result<()> {
    let (m, tok) = load(model)?;
    let s = decoding.sampling();
    let ids = tok.prompt_ids(prompt, chat)?;
    let t0 = std::time::Instant::now();
    let out = generate::generate(&m, &[ids], &s, &tok.eos_ids, decoding.seed as u64)?;
    let c = &out[0];
    eprintln!(
        "{} tokens in {:.2} s ({:.1} tokens/s), stopped by {:?}",
        c.tokens.len(),
        t0.elapsed().as_secs_f64(),
        c.tokens.len() as f64 / t0.elapsed().as_secs_f64(),
        c.stop
    );
    println!("{}", tok.decode(&c.tokens)?);
    Ok(())
}

/// How `eval` runs, besides the model, task and sampling.
pub struct EvalRun {
    pub samples: usize,
    pub batch_size: usize,
    pub seed: i64,
    /// `--shard`: only this share of the questions.
    pub shard: Option<Shard>,
}

pub fn eval(
    model: &ModelArgs,
    task: &TaskArgs,
    sampling: &SamplingArgs,
    how: &EvalRun,
    out: Option<&Path>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    if how.shard.is_some() && group.is_some() {
        bail!("--shard and a launched group (WORLD_SIZE) both say which questions to take: use one");
    }
    // Everything that can be refused is, before the model is loaded.
    let spec = task.spec()?;
    let (problems, style) = spec.load()?;
    sampling.sampling().check()?;
    let main = parallel::is_main(group);
    let _lock = match out.filter(|_| main) {
        Some(p) => {
            io::refuse_special(p)?;
            io::refuse_overlap(&model.model, p, "output file")?;
            Some(io::Lock::file(p)?)
        }
        None => None,
    };
    let (m, tok) = load(model)?;
    let settings = EvalSettings {
        max_new_tokens: sampling.max_new_tokens,
        samples: how.samples,
        sampling: sampling.params(),
        batch_size: how.batch_size,
        seed: how.seed,
        shard: how.shard.unwrap_or(Shard::WHOLE),
    };
    // The per-question file appears (whole) only once the evaluation has finished.
    let s = eval::evaluate_parallel(&m, &tok, &problems, &style, &settings, out, group)?;
    if main {
        println!("{}", serde_json::to_string(&s)?);
    }
    Ok(())
}

/// How `sample` runs, besides the model, task, output and sampling distribution.
pub struct SampleRunArgs {
    pub samples_per_prompt: usize,
    pub batch_prompts: usize,
    pub seed: i64,
    /// `--shard`: only this share of the prompts, into `--out`.
    pub shard: Option<Shard>,
}

pub fn sample(
    model: &ModelArgs,
    task: &TaskArgs,
    out: &Path,
    sampling: &SamplingArgs,
    how: &SampleRunArgs,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    if how.shard.is_some() && group.is_some() {
        bail!("--shard and a launched group (WORLD_SIZE) both say which prompts to take: use one");
    }
    let spec = task.spec()?;
    let (problems, style) = spec.load()?;
    let s = sampling.sampling();
    s.check()?;
    io::refuse_special(out)?;
    io::refuse_overlap(&model.model, out, "output file")?;
    let (m, tok) = load(model)?;
    let settings = sampling::SampleSettings {
        samples_per_prompt: how.samples_per_prompt,
        sampling: s,
        seed: how.seed,
        batch_prompts: how.batch_prompts,
        shard: how.shard.unwrap_or(Shard::WHOLE),
    };
    let n = sampling::sample_parallel(&m, &tok, &model.model, &problems, &style, &settings, out, group)?;
    if !parallel::is_main(group) {
        return Ok(());
    }
    let (all, _) = sampling::read_dataset(out, false)?;
    let correct = all.iter().filter(|x| x.correct).count();
    let invalid = all.iter().filter(|x| x.invalid).count();
    eprintln!("wrote {n} new completion(s) to {}", out.display());
    println!(
        "{}",
        serde_json::json!({"completions": all.len(), "correct_fraction": correct as f64 / all.len().max(1) as f64, "invalid_fraction": invalid as f64 / all.len().max(1) as f64})
    );
    Ok(())
}

pub fn merge(shards: &[std::path::PathBuf], out: &Path) -> Result<()> {
    let n = sampling::merge_shards(shards, out)?;
    eprintln!("merged {} shard(s), {n} completion(s), into {}", shards.len(), out.display());
    Ok(())
}

pub fn train(
    model: &ModelArgs,
    data: &Path,
    out: &Path,
    train: &TrainArgs,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let summary = training::train_dir(&model.model, model.placement(), data, &train.settings()?, out, group)?;
    if parallel::is_main(group) {
        eprintln!("saved the trained model and metrics.jsonl to {}", out.display());
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(())
}

pub fn init(out: &Path, size: &SizeArgs, vocab_size: Option<i64>, seed: i64) -> Result<()> {
    let (size, vocab) = (size.size()?, vocab_size.unwrap_or_else(new_model::vocab_size));
    if let Err(e) = new_model::config(&size, vocab) {
        bail!("--vocab-size {vocab}: {e}");
    }
    new_model::init_with_vocab(out, size, vocab, seed)?;
    eprintln!("wrote a new model to {}", out.display());
    Ok(())
}

pub fn sft_data(model: &ModelArgs, task: &TaskArgs, out: &Path, slip_rate: f64) -> Result<()> {
    let spec = task.spec()?;
    io::refuse_overlap(&model.model, out, "output file")?;
    let cfg = config::LlamaConfig::load(&model.model)?;
    let tok = Tokenizer::load(&model.model, &cfg)?;
    let (problems, style) = spec.load()?;
    let n = sampling::write_solutions(&tok, &problems, &style, out, slip_rate, task.task_seed)?;
    eprintln!("wrote {n} worked solutions to {}", out.display());
    Ok(())
}

pub fn plot(dir: &Path) -> Result<()> {
    let path = if topr_llama::layout::LoopDir::new(dir).table().exists() {
        plot::plot_iterations(dir)?
    } else if topr_llama::layout::metrics_file(dir).exists() {
        plot::plot_training(dir)?
    } else {
        bail!("{} holds neither iterations.jsonl (iterate) nor metrics.jsonl (train)", dir.display());
    };
    eprintln!("wrote {}", path.display());
    Ok(())
}

pub fn convert(model: &ModelArgs, out: &Path) -> Result<()> {
    io::refuse_overlap(&model.model, out, "output directory")?;
    if io::holds_model(out) {
        bail!("{} holds a model already: choose another --out, or remove it", out.display());
    }
    let (m, _) = load(model)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let _lock = io::Lock::dir(out)?;
    checkpoint::save(&m, &model.model, out)?;
    eprintln!("saved {}", out.display());
    Ok(())
}

pub fn score(model: &ModelArgs, prompt: &str, completion: &str, chat: bool) -> Result<()> {
    let (m, tok) = load(model)?;
    let p = tok.prompt_ids(prompt, chat)?;
    let c = tok.encode(completion, false)?;
    let logprobs = generate::score(&m, &p, &c)?;
    println!("{}", serde_json::json!({"tokens": c, "logprobs": logprobs}));
    Ok(())
}
