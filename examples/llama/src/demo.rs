//! The README's demo in one command: a small Llama from scratch learns the synthetic arithmetic
//! task by imitating a sloppy teacher, then TOPR iterations on its own graded samples correct the
//! teacher's mistake. Every stage leaves its output in the work directory and is skipped when
//! rerun with `--resume`.
//!
//! 1. `init`: 4 layers, hidden 128, byte-level tokenizer (0.8 M parameters: 820,864, embeddings tied).
//! 2. `sft-data`: 4,000 worked solutions of one-step problems; in 60 % of them the teacher's answer
//!    line copies the starting amount instead of the result (`--slip-rate 0.6`).
//! 3. `train --objective sft`: the warm-up. The model learns the format and some arithmetic, and
//!    imitates the slip: its greedy answer is usually the starting amount.
//! 4. `iterate`: per iteration, 4 samples for each of 512 new questions, graded ±1, TOPR with
//!    `target-positive-proportion`, evaluated greedily on 256 held-out questions.

use crate::checkpoint::Placement;
use crate::generate::{Sampling, SamplingParams};
use crate::iterate;
use crate::layout::DemoDir;
use crate::settings::{Baseline, Curation, IterateSettings, Objective, TrainSettings};
use crate::task::TaskSpec;
use crate::train;
use crate::{Refusal, init, optim, tokenizer};
use anyhow::{Context, Result, bail};
use std::path::Path;

/// The demo's sizes: the README run, or a CI-sized one for tests.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Scale {
    pub size: init::Size,
    pub sft_problems: usize,
    pub sft_epochs: usize,
    pub prompts: usize,
    pub samples_per_prompt: usize,
    pub iterations: usize,
    pub eval_n: usize,
    pub max_new_tokens: i64,
}

impl Scale {
    pub fn full() -> Self {
        Self {
            size: init::Size { layers: 4, hidden: 128, heads: 4, kv_heads: 2, intermediate: 384, max_positions: 512 },
            sft_problems: 4000,
            sft_epochs: 4,
            prompts: 512,
            samples_per_prompt: 4,
            iterations: 3,
            eval_n: 256,
            max_new_tokens: 96,
        }
    }

    /// The GPU check's demo: a 13.9 M-parameter model (8 layers, hidden 384), four times the
    /// warm-up problems and twice the questions of [`Scale::full`], evaluated on 512 questions.
    pub fn gpu() -> Self {
        Self {
            size: init::Size { layers: 8, hidden: 384, heads: 6, kv_heads: 2, intermediate: 1152, max_positions: 512 },
            sft_problems: 16000,
            sft_epochs: 2,
            prompts: 1024,
            samples_per_prompt: 4,
            iterations: 3,
            eval_n: 512,
            max_new_tokens: 96,
        }
    }

    /// A real model's loop (SmolLM2-135M-Instruct's single run, 2026-11): 256 training
    /// questions a seed with 4 samples each, a 128-token budget, 256 held-out questions a seed.
    /// The model's size is the checkpoint's (`size` is unused).
    pub fn real() -> Self {
        Self { prompts: 256, eval_n: 256, max_new_tokens: 128, iterations: 1, ..Self::full() }
    }

    pub fn quick() -> Self {
        Self {
            size: init::Size { layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64, max_positions: 256 },
            sft_problems: 48,
            sft_epochs: 1,
            prompts: 6,
            samples_per_prompt: 2,
            iterations: 1,
            eval_n: 6,
            max_new_tokens: 16,
        }
    }
}

/// The demo's tasks: one-step synthetic problems from `seed`, chat prompts.
pub fn task(seed: u64, n: usize) -> TaskSpec {
    TaskSpec::synthetic(seed, n, 1)
}

/// The seed of the warm-up's problems for a run seeded `seed` (the demo's is 0: problems seed 1).
pub fn warm_up_seed(seed: u64) -> u64 {
    1 + 1000 * seed
}

/// The seed of the iterations' problems for a run seeded `seed` (the demo's: 2). The held-out
/// problems derive from it (`iterate`).
pub fn prompt_seed(seed: u64) -> u64 {
    2 + 1000 * seed
}

/// The TOPR iterations' training settings (the warm-up differs where `warm_up` says).
pub fn topr_settings() -> Result<TrainSettings> {
    Ok(TrainSettings {
        objective: Objective::Topr,
        baseline: Baseline::TargetPositiveProportion(DEMO_P_TILDE),
        ratio: topr_loss::RatioLevel::Sequence,
        optimizer: optim::OptimizerConfig::adamw(0.0)?,
        lr: DEMO_LR,
        batch_size: 64,
        micro_batch_size: 32,
        epochs: 1,
        max_grad_norm: Some(1.0),
        warmup_steps: 0,
        lr_decay: false,
        seed: 0,
        dpo_beta: 0.1,
        dro_beta: crate::settings::default_dro_beta(),
        proximal: Default::default(),
        positive_nll: 0.0,
        rollout_correction: None,
        dpo_loss: Default::default(),
        dpo_label_smoothing: 0.0,
        dpo_mix: vec![],
        advantage: Default::default(),
        kl_coef: 0.0,
        kl_estimator: Default::default(),
        entropy_coef: 0.0,
        top_entropy: None,
        rejection: vec![],
        off_policy_mask: None,
        skip_bad_records: false,
        save_every: 4,
        resume: true,
    })
}

/// How the model is warmed up before the RL iterations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recipe {
    /// The demo's: the sloppy teacher (60 % of its answer lines copy the starting amount), the
    /// scale's epochs (4 at full scale). A planted habit that the model's own correct samples
    /// reveal.
    #[default]
    Sloppy,
    /// Nothing planted: a perfect teacher and one epoch, a model that is rarely right at once but
    /// often right among several samples (seed 0: sampled pass@1 0.019, pass@8 0.133), so that
    /// what RL can use is the model's own variation.
    Natural,
    /// The sloppy teacher with the same number of optimiser steps spread over more problems:
    /// twice the scale's problems for half its epochs (8,000 × 2 at full scale instead of
    /// 4,000 × 4), so the warm-up takes the same time and sees each solution half as often.
    SloppyFresh,
    /// No warm-up: a real model as it is (the study's `model`, SmolLM2-135M-Instruct), with the
    /// real model's sizes ([`Scale::real`]) and training batches.
    Real,
}

impl Recipe {
    /// The share of the teacher's solutions with the planted slip.
    pub fn slip_rate(self) -> f64 {
        match self {
            Self::Sloppy | Self::SloppyFresh => 0.6,
            Self::Natural | Self::Real => 0.0,
        }
    }

    /// Epochs of the supervised warm-up.
    pub fn sft_epochs(self, scale: Scale) -> usize {
        match self {
            Self::Sloppy => scale.sft_epochs,
            Self::Natural => 1,
            Self::SloppyFresh => scale.sft_epochs.div_ceil(2),
            Self::Real => 0,
        }
    }

    /// Problems of the supervised warm-up.
    pub fn sft_problems(self, scale: Scale) -> usize {
        match self {
            Self::Sloppy | Self::Natural => scale.sft_problems,
            Self::Real => 0,
            // The same solutions seen in all: problems × epochs as the sloppy recipe's.
            Self::SloppyFresh => scale.sft_problems * scale.sft_epochs / self.sft_epochs(scale),
        }
    }
}

/// The demo's stages 1–3 in `dir` for a run seeded `seed` (the demo's is 0): a new model
/// initialised with `seed`, the sloppy teacher's worked solutions and the supervised warm-up.
/// Finished stages are kept; returns the warm-up model's directory.
pub fn warm_up(dir: &Path, scale: Scale, seed: u64, at: Placement) -> Result<std::path::PathBuf> {
    warm_up_with(dir, scale, seed, at, Recipe::Sloppy)
}

/// [`warm_up`] with the teacher and epochs of `recipe`.
pub fn warm_up_with(dir: &Path, scale: Scale, seed: u64, at: Placement, recipe: Recipe) -> Result<std::path::PathBuf> {
    let t0 = std::time::Instant::now();
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let stages = DemoDir::new(dir);
    check_warm_up(&stages, &WarmUpRecord::new(scale, seed, recipe))?;
    // 1. A new model.
    let init_dir = stages.init();
    // A model is whole once its config.json is written (the last file).
    if !init_dir.join("config.json").exists() {
        let _ = std::fs::remove_dir_all(&init_dir); // what an interrupted init left
        init::init(&init_dir, scale.size, seed as i64)?;
    }
    // 2. The sloppy teacher's worked solutions (deterministic: rewritten if missing).
    let sft = stages.sft_data();
    if !sft.exists() {
        let cfg = crate::config::LlamaConfig::load(&init_dir)?;
        let tok = tokenizer::Tokenizer::load(&init_dir, &cfg)?;
        let (problems, style) = task(warm_up_seed(seed), recipe.sft_problems(scale)).load()?;
        crate::dataset::write_solutions(&tok, &problems, &style, &sft, recipe.slip_rate(), 1)?;
    }
    // 3. Supervised warm-up.
    let warm = stages.warm_up();
    if !warm.join("config.json").exists() {
        eprintln!("[warm-up {:.0} s] supervised warm-up on {}", t0.elapsed().as_secs_f64(), sft.display());
        let o = TrainSettings {
            objective: Objective::Sft,
            baseline: Baseline::Zero,
            lr: 2e-3,
            batch_size: 32,
            epochs: recipe.sft_epochs(scale),
            warmup_steps: 20,
            lr_decay: true,
            save_every: 25,
            seed,
            ..topr_settings()?
        };
        train::train_dir(&init_dir, at, &sft, &o, &warm, None)?;
    }
    Ok(warm)
}

/// What the warm-up stages of a run are made from: a stage made with other sizes, seed or recipe
/// is not reused (`demo --resume --sft-epochs 3` on a demo warmed up for 4 epochs is refused).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct WarmUpRecord {
    recipe: Recipe,
    seed: u64,
    size: init::Size,
    sft_problems: usize,
    sft_epochs: usize,
    slip_rate: f64,
}

impl WarmUpRecord {
    fn new(scale: Scale, seed: u64, recipe: Recipe) -> Self {
        Self {
            recipe,
            seed,
            size: scale.size,
            sft_problems: recipe.sft_problems(scale),
            sft_epochs: recipe.sft_epochs(scale),
            slip_rate: recipe.slip_rate(),
        }
    }
}

/// Records `record` for new warm-up stages in `stages`, or refuses to reuse stages made otherwise
/// (listing what differs), or made by a version that did not record them.
fn check_warm_up(stages: &DemoDir, record: &WarmUpRecord) -> Result<()> {
    let file = stages.warm_up_record();
    if file.exists() {
        let saved = crate::stage::read_record(&file)?;
        return crate::stage::check(&saved, record, &[], stages.path(), crate::Resumable::WarmUp);
    }
    if [stages.init(), stages.sft_data(), stages.warm_up()].iter().any(|p| p.exists()) {
        bail!(
            "{} holds warm-up stages without the record of what made them (an older version made them), so reusing them cannot be checked: choose another work directory",
            stages.path().display()
        );
    }
    crate::stage::write_record(&file, record)
}

/// The demo's iterations (step 4) for a run seeded `seed`, training with `train`, in `work`.
pub fn iterate_settings(work: std::path::PathBuf, scale: Scale, seed: u64, train: TrainSettings) -> IterateSettings {
    IterateSettings {
        task: task(prompt_seed(seed), scale.prompts),
        train,
        sampling: Sampling::sample(SamplingParams::default(), scale.max_new_tokens),
        work,
        iterations: scale.iterations,
        samples_per_prompt: scale.samples_per_prompt,
        batch_prompts: 16,
        curate: Curation::All,
        eval_data: None,
        eval_n: scale.eval_n,
        eval_batch_size: 64,
        shared: None,
    }
}

/// Runs (or, with `resume`, continues) the demo in `work`, its models placed as `at` says (in
/// f32: the demo's recipe).
pub fn run(work: &Path, scale: Scale, at: Placement, resume: bool) -> Result<()> {
    if DemoDir::new(work).init().exists() && !resume {
        bail!(Refusal::EarlierDemo(work.to_path_buf()));
    }
    std::fs::create_dir_all(work).with_context(|| format!("creating {}", work.display()))?;
    let _lock = crate::io::Lock::dir(work)?;
    let t0 = std::time::Instant::now();
    let at = Placement { kind: tch::Kind::Float, ..at };
    let warm = warm_up(work, scale, 0, at)?;
    // 4. TOPR iterations on the model's own graded samples.
    eprintln!("[demo {:.0} s] TOPR iterations", t0.elapsed().as_secs_f64());
    let topr = DemoDir::new(work).topr();
    let settings = iterate_settings(topr.path().to_path_buf(), scale, 0, topr_settings()?);
    iterate::run(&warm, at, &settings, None)?;
    eprintln!("[demo {:.0} s] done; plots: {}", t0.elapsed().as_secs_f64(), topr.plot().display());
    Ok(())
}

/// The demo's target effective positive proportion and learning rate.
pub const DEMO_P_TILDE: f64 = 0.5;
pub const DEMO_LR: f64 = 1e-4;
