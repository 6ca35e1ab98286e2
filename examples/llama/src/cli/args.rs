//! The command line's arguments, one flattened group per concern, and their conversion to the
//! library's typed settings. Strings become enums here, once (clap value enums); below this
//! layer nothing matches on a string. Errors that name a flag are raised here.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use tch::{Device, Kind};
use topr_llama::checkpoint::Placement;
use topr_llama::generate::{Decoding, Sampling, SamplingParams};
use topr_llama::init;
use topr_llama::model::Kernels;
use topr_llama::optim::OptimizerConfig;
use topr_llama::settings::{Advantage, Baseline, DpoLoss, KlEstimatorSetting, Objective, Proximal, TrainSettings};
use topr_llama::settings::{Curation, IterateSettings};
use topr_llama::task::{Prompting, Source, TaskSpec};

/// Parses `--device` (cpu, cuda or cuda:N), refusing CUDA where no CUDA device is visible.
pub fn parse_device(s: &str) -> Result<Device, String> {
    let d = match s {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Device::Cuda(i),
            _ => return Err("expected cpu, cuda or cuda:N".into()),
        },
    };
    if let Device::Cuda(i) = d {
        let n = tch::Cuda::device_count() as usize;
        if n == 0 {
            return Err("CUDA is not available here (no GPU visible, or a CPU-only libtorch)".into());
        }
        if i >= n {
            return Err(format!("only {n} CUDA device(s) are visible (cuda:0 to cuda:{})", n - 1));
        }
    }
    Ok(d)
}

// Every numeric option is parsed by one of the functions below, so that a value out of its range
// is refused before anything is loaded or written, by clap, in one line naming the option
// ("invalid value '0' for '--batch-size <BATCH_SIZE>': …"). Options where 0 means "off" say so
// in their help; `--max-grad-norm` takes `none` instead.

/// A whole number in `lo..=hi` (the bounds keep absurd values from allocating without limit).
pub fn whole<T>(lo: T, hi: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
where
    T: Copy + TryInto<i128> + TryFrom<i128> + std::fmt::Display + Send + Sync + 'static,
{
    move |s: &str| {
        let range = || format!("expected a whole number in {lo}..={hi}");
        let v: i128 = s.trim().parse().map_err(|_| format!("{}, got {s:?}", range()))?;
        let (l, h) = (lo.try_into().unwrap_or(i128::MIN), hi.try_into().unwrap_or(i128::MAX));
        if v < l || v > h {
            return Err(format!("{}, got {v}", range()));
        }
        T::try_from(v).map_err(|_| range())
    }
}

fn number(s: &str) -> Result<f64, String> {
    s.trim().parse::<f64>().map_err(|_| format!("expected a number, got {s:?}"))
}

/// A finite number (any sign).
pub fn parse_finite(s: &str) -> Result<f64, String> {
    match number(s)? {
        v if v.is_finite() => Ok(v),
        v => Err(format!("must be finite, got {v}")),
    }
}

/// A finite number > 0.
pub fn parse_positive(s: &str) -> Result<f64, String> {
    match number(s)? {
        v if v.is_finite() && v > 0.0 => Ok(v),
        v => Err(format!("must be finite and > 0, got {v}")),
    }
}

/// A finite number >= 0.
pub fn parse_non_negative(s: &str) -> Result<f64, String> {
    match number(s)? {
        v if v.is_finite() && v >= 0.0 => Ok(v),
        v => Err(format!("must be finite and >= 0, got {v}")),
    }
}

/// Parses a share in `[0, 1]`.
pub fn parse_unit_interval(s: &str) -> Result<f64, String> {
    match number(s)? {
        v if (0.0..=1.0).contains(&v) => Ok(v),
        v => Err(format!("must lie in [0, 1], got {v}")),
    }
}

/// A share in `(0, 1)`, both ends excluded (`--raw-share`).
pub fn parse_open_unit_interval(s: &str) -> Result<f64, String> {
    match number(s)? {
        v if v > 0.0 && v < 1.0 => Ok(v),
        v => Err(format!("must lie in (0, 1), ends excluded, got {v}")),
    }
}

/// A probability mass in `(0, 1]` (top-p).
pub fn parse_top_p(s: &str) -> Result<f64, String> {
    match number(s)? {
        v if v > 0.0 && v <= 1.0 => Ok(v),
        v => Err(format!("must lie in (0, 1], got {v}")),
    }
}

/// `--max-grad-norm`: `none` (no clipping) or a finite number > 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradNorm(pub Option<f64>);

pub fn parse_grad_norm(s: &str) -> Result<GradNorm, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(GradNorm(None));
    }
    parse_positive(s).map(|v| GradNorm(Some(v))).map_err(|e| format!("expected none or a number > 0: {e}"))
}

/// `--rollout-correction`: `token-tis:MAX`, `sequence-tis:MAX`, `geometric-tis:MAX`,
/// `token-mis:MIN:MAX`, `sequence-mis:MIN:MAX` or `geometric-mis:MIN:MAX` (the bounds of the
/// importance ratio π/μ; `geometric`: the sequence's geometric-mean ratio), or `none`.
#[derive(Clone, Copy, Debug)]
pub struct CorrectionArg(pub Option<topr_loss::RolloutCorrection>);

pub fn parse_rollout_correction(s: &str) -> Result<CorrectionArg, String> {
    use topr_loss::RolloutCorrection as R;
    let usage = "expected none, token-tis:MAX, sequence-tis:MAX, geometric-tis:MAX, token-mis:MIN:MAX, sequence-mis:MIN:MAX or geometric-mis:MIN:MAX";
    let parts: Vec<&str> = s.trim().split(':').collect();
    let c = match parts.as_slice() {
        ["none"] => return Ok(CorrectionArg(None)),
        ["token-tis", max] => R::token_tis(parse_positive(max)?),
        ["sequence-tis", max] => R::sequence_tis(parse_positive(max)?),
        ["token-mis", min, max] => R::token_mis(parse_positive(min)?, parse_positive(max)?),
        ["sequence-mis", min, max] => R::sequence_mis(parse_positive(min)?, parse_positive(max)?),
        ["geometric-tis", max] => R::geometric_tis(parse_positive(max)?),
        ["geometric-mis", min, max] => R::geometric_mis(parse_positive(min)?, parse_positive(max)?),
        _ => return Err(format!("{usage}, got {s:?}")),
    };
    c.validate().map_err(|e| format!("{usage}: {e}"))?;
    Ok(CorrectionArg(Some(c)))
}

/// `--rejection`: comma-separated rules (verl's `rollout_rs` list), each `k1-SCOPE:MIN:MAX`
/// (bounds on the ratio μ/π) or `k2-SCOPE:MAX` / `k3-SCOPE:MAX`, SCOPE one of `token`, `seq-sum`,
/// `seq-mean`, `seq-max` (not with k1); or `none`.
#[derive(Clone, Debug)]
pub struct RejectionArg(pub Vec<topr_loss::Rejection>);

pub fn parse_rejection(s: &str) -> Result<RejectionArg, String> {
    let s = s.trim();
    if s == "none" {
        return Ok(RejectionArg(vec![]));
    }
    s.split(',').map(parse_rejection_rule).collect::<Result<_, _>>().map(RejectionArg)
}

/// One rule of `--rejection`.
fn parse_rejection_rule(s: &str) -> Result<topr_loss::Rejection, String> {
    use topr_loss::{Rejection, RejectionScope as Sc};
    let usage = "expected none or comma-separated rules k1-SCOPE:MIN:MAX, k2-SCOPE:MAX or k3-SCOPE:MAX with SCOPE token, seq-sum, seq-mean or seq-max";
    let s = s.trim();
    let parts: Vec<&str> = s.split(':').collect();
    let (stat, scope) = parts[0].split_once('-').ok_or_else(|| format!("{usage}, got {s:?}"))?;
    let scope = match scope {
        "token" => Sc::Token,
        "seq-sum" => Sc::SequenceSum,
        "seq-mean" => Sc::SequenceMean,
        "seq-max" => Sc::SequenceMax,
        _ => return Err(format!("{usage}, got {s:?}")),
    };
    let r = match (stat, &parts[1..]) {
        ("k1", [min, max]) => Rejection::k1(scope, parse_positive(min)?, parse_positive(max)?),
        ("k2", [max]) => Rejection::k2(scope, parse_positive(max)?),
        ("k3", [max]) => Rejection::k3(scope, parse_positive(max)?),
        _ => return Err(format!("{usage}, got {s:?}")),
    };
    r.validate().map_err(|e| format!("{usage}: {e}"))?;
    Ok(r)
}

/// `--dpo-mix`: `LOSS:WEIGHT[,LOSS:WEIGHT…]` (up to 4 terms), LOSS a `--dpo-loss` name.
#[derive(Clone, Debug)]
pub struct DpoMixArg(pub Vec<(DpoLoss, f64)>);

pub fn parse_dpo_mix(s: &str) -> Result<DpoMixArg, String> {
    use clap::ValueEnum;
    let usage = "expected LOSS:WEIGHT[,LOSS:WEIGHT…] (at most 4 terms, LOSS a --dpo-loss name), or none";
    if s.trim() == "none" {
        return Ok(DpoMixArg(vec![]));
    }
    let mut terms = vec![];
    for part in s.split(',') {
        let (name, w) = part.trim().split_once(':').ok_or_else(|| format!("{usage}, got {s:?}"))?;
        let loss = DpoLoss::from_str(name, false).map_err(|_| format!("{usage}: unknown loss {name:?}"))?;
        terms.push((loss, parse_finite(w)?));
    }
    if terms.is_empty() || terms.len() > topr_loss::DpoMix::MAX_TERMS {
        return Err(format!("{usage}, got {} terms", terms.len()));
    }
    Ok(DpoMixArg(terms))
}

/// Upper bounds of the sizes (far above any use, low enough that a typo fails at once rather than
/// after allocating for it).
const MAX_TOKENS: i64 = 1 << 20;
const MAX_BATCH: usize = 1 << 12;

#[derive(Clone, Copy, ValueEnum)]
pub enum Dtype {
    #[value(alias = "float32")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
    #[value(alias = "float16")]
    F16,
}

impl From<Dtype> for Kind {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => Kind::Float,
            Dtype::Bf16 => Kind::BFloat16,
            Dtype::F16 => Kind::Half,
        }
    }
}

/// Where a model comes from and where it runs.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// The weights' dtype (converted on load).
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    pub dtype: Dtype,
    /// The matrix products on the CPU: onednn (generation on weights packed once per generation,
    /// about twice as fast at decoding shapes; training through oneDNN for models of hidden
    /// size 512 or more) or plain (libtorch's matmul everywhere).
    #[arg(long, value_enum, default_value_t = Kernels::Onednn)]
    pub kernels: Kernels,
    /// On a CUDA device, record the decoding step once per batch size as a CUDA graph and replay
    /// it (one launch a token instead of hundreds); ignored on the CPU.
    #[arg(long)]
    pub cuda_graphs: bool,
}

impl ModelArgs {
    pub fn placement(&self) -> Placement {
        Placement { device: self.device, kind: self.dtype.into(), kernels: self.kernels, cuda_graphs: self.cuda_graphs }
    }
}

/// `--ratio`: the TOPR family's ratio level by its record name (`sequence`, `sequence-mean`
/// or `token`; `-` and `_` alike).
pub fn parse_ratio(s: &str) -> Result<topr_loss::RatioLevel, String> {
    serde_json::from_value(serde_json::Value::String(s.trim().replace('-', "_")))
        .map_err(|_| format!("expected sequence (one ratio per sequence, the paper), sequence-mean (the per-token mean log-ratio, verl) or token (one ratio per token, Trinity-RFT), got {s:?}"))
}

#[derive(Clone, Copy, ValueEnum)]
pub enum OptimizerArg {
    Adamw,
    /// Factored second moments, no first moment: the paper's optimiser and the one that fits an
    /// 8B model on one GPU.
    Adafactor,
}

/// The objective and what its loss weighs samples by.
#[derive(Args, Clone)]
pub struct ObjectiveArgs {
    #[arg(long, value_enum, default_value_t = Objective::Topr)]
    pub objective: Objective,
    /// The baseline c subtracted from rewards.
    #[arg(long, allow_hyphen_values = true, conflicts_with = "target_positive_proportion", value_parser = parse_finite)]
    pub baseline: Option<f64>,
    /// Derive the baseline from the data set's share of positives so that positives carry this
    /// share of the weight (the paper finds 0.1–0.2 best on GSM8K).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_unit_interval)]
    pub target_positive_proportion: Option<f64>,
    /// The TOPR family's ratio level: sequence (one ratio per sequence, the paper), sequence-mean
    /// (the per-token mean log-ratio of a sequence, verl) or token (one ratio per token,
    /// Trinity-RFT).
    #[arg(long, default_value = "sequence", value_parser = parse_ratio)]
    pub ratio: topr_loss::RatioLevel,
    /// DPO's β (strength of the implicit KL constraint to μ; > 0).
    #[arg(long, default_value_t = 0.1, allow_hyphen_values = true, value_parser = parse_positive)]
    pub dpo_beta: f64,
    /// The dro objective's penalty β on the squared log-ratio (> 0; verl's dro_beta).
    #[arg(long, default_value_t = topr_llama::settings::default_dro_beta(), allow_hyphen_values = true, value_parser = parse_positive)]
    pub dro_beta: f64,
    /// Decoupled PPO's proximal policy: the log-linear approximation from μ and the current
    /// policy (staleness 1 + the step), or the model as the run started (one more forward pass).
    #[arg(long, value_enum, default_value_t = Proximal::LogLinear)]
    pub proximal: Proximal,
    /// Which loss of the DPO family (TRL's loss_type names).
    #[arg(long, value_enum, default_value_t = DpoLoss::Sigmoid)]
    pub dpo_loss: DpoLoss,
    /// A weighted sum of DPO-family losses in place of --dpo-loss (TRL's loss_type list with
    /// loss_weights): `sigmoid:0.8,bco-pair:0.2`. β and ε are shared; the terms must all use summed
    /// log-probs or all per-token means (ipo, sigmoid-norm).
    #[arg(long, default_value = "none", value_parser = parse_dpo_mix, conflicts_with = "dpo_loss")]
    pub dpo_mix: DpoMixArg,
    /// Label smoothing ε of the DPO losses that take it (sigmoid: cDPO, robust, exo-pair, aot,
    /// aot-unpaired, sigmoid-norm); each loss checks its own range.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = parse_unit_interval)]
    pub dpo_label_smoothing: f64,
    /// Weight every token-level loss's terms by importance weights of π against μ, truncated
    /// (TIS) or masked outside a band (MIS/IcePop), per token or per sequence:
    /// `token-tis:2`, `sequence-tis:2`, `token-mis:0.5:2`, `sequence-mis:0.5:2`, or `none`;
    /// `geometric-tis:2`, `geometric-mis:0.5:2` weigh a sequence by its geometric-mean ratio.
    #[arg(long, default_value = "none", value_parser = parse_rollout_correction)]
    pub rollout_correction: CorrectionArg,
    /// How grpo, gspo, cispo, sapo, gmpo, clip-cov, kl-cov, dppo-tv, dppo-kl, dro, decoupled-ppo,
    /// vespo, bapo and prefix-ratio compute advantages from each
    /// question's rewards.
    #[arg(long, value_enum, default_value_t = Advantage::Grpo)]
    pub advantage: Advantage,
    /// Add a KL penalty of π to μ (the sampling model) with this coefficient (>= 0; 0: none).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = parse_non_negative)]
    pub kl_coef: f64,
    /// The KL penalty's estimator.
    #[arg(long, value_enum, default_value_t = KlEstimatorSetting::K3)]
    pub kl_estimator: KlEstimatorSetting,
    /// Add VAPO's NLL of the correct completions (their tokens' mean −log π) with this
    /// coefficient (>= 0; 0: none; VAPO uses 0.1).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = parse_non_negative)]
    pub positive_nll: f64,
    /// Add an entropy bonus with this coefficient (>= 0; 0: none).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = parse_non_negative)]
    pub entropy_coef: f64,
    /// Train only this share (0 to 1) of each micro-batch's tokens, those of highest entropy.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_unit_interval)]
    pub top_entropy: Option<f64>,
    /// Drop the tokens or completions whose k1/k2/k3 statistic of π against μ leaves the bounds
    /// (verl's rollout_rs): `k3-seq-max:0.01`, `k1-token:0.5:2`, `k2-seq-mean:0.05`, or `none`;
    /// several rules comma-separated (`k2-token:2,k3-seq-max:0.01`), each computed on the
    /// original mask and a token kept only if every rule keeps it, as verl combines them.
    #[arg(long, default_value = "none", value_parser = parse_rejection)]
    pub rejection: RejectionArg,
    /// DeepSeek-V3.2's off-policy sequence mask: drop a negative completion whose mean
    /// log μ − log π exceeds this.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_finite)]
    pub off_policy_mask: Option<f64>,
}

/// The optimiser and its schedule.
#[derive(Args, Clone)]
pub struct OptimizerArgs {
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    pub optimizer: OptimizerArg,
    /// The learning rate (> 0).
    #[arg(long, default_value_t = 1e-5, allow_hyphen_values = true, value_parser = parse_positive)]
    pub lr: f64,
    /// Decoupled weight decay (>= 0).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = parse_non_negative)]
    pub weight_decay: f64,
    /// Clip the gradient norm to this (> 0), or `none` for no clipping.
    #[arg(long, default_value = "1.0", allow_hyphen_values = true, value_parser = parse_grad_norm)]
    pub max_grad_norm: GradNorm,
    /// Linear warm-up of the learning rate over this many steps (0: none).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = whole(0usize, 1_000_000_000))]
    pub warmup_steps: usize,
    /// Decay the learning rate linearly to 0 after the warm-up (else constant).
    #[arg(long)]
    pub lr_decay: bool,
}

/// How the data is cut into steps.
#[derive(Args, Clone)]
pub struct BatchArgs {
    /// Completions per optimiser step (>= 1).
    #[arg(long, default_value_t = 16, allow_hyphen_values = true, value_parser = whole(1usize, 1_000_000))]
    pub batch_size: usize,
    /// Completions per forward/backward pass (gradient accumulation; same update for any value).
    #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = whole(1usize, MAX_BATCH))]
    pub micro_batch_size: usize,
    /// Passes over the data set (>= 1).
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = whole(1usize, 1_000_000))]
    pub epochs: usize,
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub train_seed: u64,
}

/// Bad records, saved state and resumption.
#[derive(Args, Clone)]
pub struct RunArgs {
    /// Skip malformed data-set records and completions longer than the context (counted).
    #[arg(long)]
    pub skip_bad_records: bool,
    /// Save the training state (model, optimiser, position) every this many steps, so that a
    /// killed run loses at most that many (0: never save; a killed run then starts again).
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = whole(0usize, 1_000_000_000))]
    pub save_every: usize,
    /// Continue an interrupted run from its saved state.
    #[arg(long)]
    pub resume: bool,
}

/// Training settings shared by `train` and `iterate`.
#[derive(Args, Clone)]
pub struct TrainArgs {
    #[command(flatten)]
    pub objective: ObjectiveArgs,
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    #[command(flatten)]
    pub batches: BatchArgs,
    #[command(flatten)]
    pub run: RunArgs,
}

impl TrainArgs {
    /// The training settings these options give, checked ([`TrainSettings::check`]); a refusal
    /// names the options of the fields it concerns.
    pub fn settings(&self) -> Result<TrainSettings> {
        let (obj, opt, batches, run) = (&self.objective, &self.optimizer, &self.batches, &self.run);
        let baseline = match (obj.baseline, obj.target_positive_proportion) {
            (Some(c), _) => Baseline::Fixed(c),
            (None, Some(p)) => Baseline::TargetPositiveProportion(p),
            (None, None) => Baseline::Zero,
        };
        let optimizer = match opt.optimizer {
            OptimizerArg::Adamw => OptimizerConfig::adamw(opt.weight_decay),
            OptimizerArg::Adafactor => OptimizerConfig::adafactor(opt.weight_decay),
        };
        let s = TrainSettings {
            objective: obj.objective,
            baseline,
            ratio: obj.ratio,
            optimizer: optimizer?,
            lr: opt.lr,
            batch_size: batches.batch_size,
            micro_batch_size: batches.micro_batch_size,
            epochs: batches.epochs,
            max_grad_norm: opt.max_grad_norm.0,
            warmup_steps: opt.warmup_steps,
            lr_decay: opt.lr_decay,
            seed: batches.train_seed,
            dpo_beta: obj.dpo_beta,
            dro_beta: obj.dro_beta,
            proximal: obj.proximal,
            positive_nll: obj.positive_nll,
            dpo_loss: obj.dpo_loss,
            dpo_label_smoothing: obj.dpo_label_smoothing,
            dpo_mix: obj.dpo_mix.0.clone(),
            advantage: obj.advantage,
            kl_coef: obj.kl_coef,
            kl_estimator: obj.kl_estimator,
            entropy_coef: obj.entropy_coef,
            top_entropy: obj.top_entropy,
            rejection: obj.rejection.0.clone(),
            off_policy_mask: obj.off_policy_mask,
            rollout_correction: obj.rollout_correction.0,
            skip_bad_records: run.skip_bad_records,
            save_every: run.save_every,
            resume: run.resume,
        };
        s.check().map_err(|e| anyhow::anyhow!("{}: {e}", flags(&e.fields)))?;
        Ok(s)
    }
}

/// The options of the training settings' `fields` (`dpo_mix` → `--dpo-mix`), joined by ` / `.
pub fn flags(fields: &[&str]) -> String {
    let flag = |f: &&str| match *f {
        "seed" => "--train-seed".to_string(),
        f => format!("--{}", f.replace('_', "-")),
    };
    fields.iter().map(flag).collect::<Vec<_>>().join(" / ")
}

/// Sampling settings shared by `eval`, `sample` and `iterate`.
#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// The token budget of a completion (>= 1).
    #[arg(long, default_value_t = 256, allow_hyphen_values = true, value_parser = whole(1i64, MAX_TOKENS))]
    pub max_new_tokens: i64,
    /// The sampling temperature (> 0).
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true, value_parser = parse_positive)]
    pub temperature: f64,
    /// Nucleus sampling's probability mass, in (0, 1] (1: off).
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true, value_parser = parse_top_p)]
    pub top_p: f64,
    /// Sample among the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = whole(0i64, MAX_TOKENS))]
    pub top_k: i64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams { temperature: self.temperature, top_p: self.top_p, top_k: self.top_k }
    }

    pub fn sampling(&self) -> Sampling {
        Sampling::sample(self.params(), self.max_new_tokens)
    }
}

/// `generate`'s decoding: greedy unless a sampling option is given.
#[derive(Args, Clone)]
pub struct DecodingArgs {
    /// The token budget of the completion (>= 1).
    #[arg(long, default_value_t = 256, allow_hyphen_values = true, value_parser = whole(1i64, MAX_TOKENS))]
    pub max_new_tokens: i64,
    /// Argmax decoding (the default when no sampling option is given).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    pub greedy: bool,
    /// Sample at this temperature (> 0).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_positive)]
    pub temperature: Option<f64>,
    /// Nucleus sampling's probability mass, in (0, 1].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_top_p)]
    pub top_p: Option<f64>,
    /// Sample among the k most likely tokens (0: off).
    #[arg(long, allow_hyphen_values = true, value_parser = whole(0i64, MAX_TOKENS))]
    pub top_k: Option<i64>,
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub seed: i64,
}

impl DecodingArgs {
    pub fn sampling(&self) -> Sampling {
        let sampling_given = self.temperature.is_some() || self.top_p.is_some() || self.top_k.is_some();
        let decoding = if self.greedy || !sampling_given {
            Decoding::Greedy
        } else {
            Decoding::Sample(SamplingParams {
                temperature: self.temperature.unwrap_or(1.0),
                top_p: self.top_p.unwrap_or(1.0),
                top_k: self.top_k.unwrap_or(0),
            })
        };
        Sampling { decoding, max_new_tokens: self.max_new_tokens }
    }
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
pub enum TaskArg {
    /// GSM8K from a JSONL file (needs --data).
    #[value(name = "gsm8k")]
    Gsm8k,
    /// Multi-step arithmetic word problems generated in Rust.
    Synthetic,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum PromptStyleArg {
    /// The model's chat template.
    Chat,
    /// Worked examples before the question, for base models.
    FewShot,
}

#[derive(Args, Clone)]
pub struct TaskArgs {
    #[arg(long, value_enum, default_value_t = TaskArg::Synthetic)]
    pub task: TaskArg,
    /// A GSM8K JSONL file (the public release's layout); only with --task gsm8k.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Use at most this many problems (0: all of them).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = whole(0usize, 1_000_000_000))]
    pub limit: usize,
    /// Synthetic task: number of problems (>= 1; default 200), difficulty (operations per
    /// problem, 1 to 20; default 2) and seed. --synthetic-n and --difficulty are refused with
    /// --task gsm8k.
    #[arg(long, allow_hyphen_values = true, value_parser = whole(1usize, 1_000_000))]
    pub synthetic_n: Option<usize>,
    #[arg(long, allow_hyphen_values = true, value_parser = whole(1usize, 20))]
    pub difficulty: Option<usize>,
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    pub task_seed: u64,
    #[arg(long, value_enum, default_value_t = PromptStyleArg::Chat)]
    pub prompt_style: PromptStyleArg,
    /// Worked examples for few-shot prompts (default 4; from --shots-data, else generated for
    /// the synthetic task; 0: none, a zero-shot prompt). Only with --prompt-style few-shot.
    #[arg(long, allow_hyphen_values = true, value_parser = whole(0usize, 256))]
    pub shots: Option<usize>,
    /// A GSM8K JSONL file of worked examples for few-shot prompts; only with --prompt-style
    /// few-shot.
    #[arg(long)]
    pub shots_data: Option<PathBuf>,
    /// Skip malformed data lines (counted) instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
}

impl TaskArgs {
    /// The task, refusing a flag that the chosen task or prompt style would ignore.
    pub fn spec(&self) -> Result<TaskSpec> {
        let source = match self.task {
            TaskArg::Gsm8k => {
                if self.synthetic_n.is_some() || self.difficulty.is_some() {
                    let flag = if self.synthetic_n.is_some() { "--synthetic-n" } else { "--difficulty" };
                    bail!("{flag}: the synthetic task's size and difficulty do not apply to --task gsm8k");
                }
                match &self.data {
                    Some(p) => Source::Gsm8k(p.clone()),
                    None => bail!("--task gsm8k needs --data PATH (a GSM8K JSONL file)"),
                }
            }
            TaskArg::Synthetic => {
                if let Some(p) = &self.data {
                    bail!(
                        "--data {}: a GSM8K file is read only with --task gsm8k (the task is synthetic)",
                        p.display()
                    );
                }
                Source::Synthetic { n: self.synthetic_n.unwrap_or(200), difficulty: self.difficulty.unwrap_or(2) }
            }
        };
        let prompting = match self.prompt_style {
            PromptStyleArg::Chat => {
                if self.shots.is_some() || self.shots_data.is_some() {
                    let flag = if self.shots.is_some() { "--shots" } else { "--shots-data" };
                    bail!(
                        "{flag}: worked examples are for --prompt-style few-shot (the prompts use the chat template)"
                    );
                }
                Prompting::Chat
            }
            PromptStyleArg::FewShot => {
                if self.shots_data.is_none() && self.task == TaskArg::Gsm8k {
                    bail!("--prompt-style few-shot with GSM8K needs --shots-data (e.g. the train file)");
                }
                Prompting::FewShot { shots: self.shots.unwrap_or(4), examples: self.shots_data.clone() }
            }
        };
        Ok(TaskSpec { source, seed: self.task_seed, limit: self.limit, prompting, skip_bad_lines: self.skip_bad_lines })
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum CurateArg {
    /// Train on every sample.
    #[value(name = "none", alias = "all")]
    All,
    /// Keep every negative and one positive per question.
    OnePositive,
}

impl From<CurateArg> for Curation {
    fn from(c: CurateArg) -> Self {
        match c {
            CurateArg::All => Curation::All,
            CurateArg::OnePositive => Curation::OnePositive,
        }
    }
}

/// The loop of `iterate`: its work directory, sizes and held-out evaluation.
#[derive(Args, Clone)]
pub struct LoopArgs {
    /// Working directory: one folder per iteration, and iterations.jsonl.
    #[arg(long)]
    pub work: PathBuf,
    /// Iterations of sampling and training (>= 1).
    #[arg(long, default_value_t = 3, allow_hyphen_values = true, value_parser = whole(1usize, 10_000))]
    pub iterations: usize,
    /// Completions sampled per prompt (>= 1).
    #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = whole(1usize, MAX_BATCH))]
    pub samples_per_prompt: usize,
    /// Completions in flight while sampling: this many prompts' samples (>= 1; continuous
    /// batching).
    #[arg(long, default_value_t = 32, allow_hyphen_values = true, value_parser = whole(1usize, MAX_BATCH))]
    pub batch_prompts: usize,
    /// Which samples are trained on.
    #[arg(long, value_enum, default_value_t = CurateArg::All)]
    pub curate: CurateArg,
    /// Subsample each data set to this raw share of positives, in (0, 1): the rarer kind kept
    /// whole, the other thinned (the paper's 10 % and 50 % data sets). Instead of --curate.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_open_unit_interval, conflicts_with = "curate")]
    pub raw_share: Option<f64>,
    /// Held-out evaluation: a GSM8K file (with --task gsm8k) or this many synthetic problems.
    #[arg(long)]
    pub eval_data: Option<PathBuf>,
    /// Held-out problems evaluated (>= 1; at most this many of --eval-data).
    #[arg(long, default_value_t = 128, allow_hyphen_values = true, value_parser = whole(1usize, 1_000_000))]
    pub eval_n: usize,
    /// Completions in flight while evaluating (>= 1; continuous batching).
    #[arg(long, default_value_t = 128, allow_hyphen_values = true, value_parser = whole(1usize, MAX_BATCH))]
    pub eval_batch_size: usize,
}

impl LoopArgs {
    pub fn settings(&self, task: &TaskArgs, train: &TrainArgs, sampling: &SamplingArgs) -> Result<IterateSettings> {
        if task.task == TaskArg::Gsm8k && self.eval_data.is_none() {
            bail!("--task gsm8k needs --eval-data PATH (e.g. the test file) for held-out evaluation");
        }
        Ok(IterateSettings {
            task: task.spec()?,
            train: train.settings()?,
            sampling: sampling.sampling(),
            work: self.work.clone(),
            iterations: self.iterations,
            samples_per_prompt: self.samples_per_prompt,
            batch_prompts: self.batch_prompts,
            curate: self.raw_share.map_or(self.curate.into(), Curation::RawShare),
            eval_data: self.eval_data.clone(),
            eval_n: self.eval_n,
            eval_batch_size: self.eval_batch_size,
            shared: None,
        })
    }
}

/// The sizes of a new model.
#[derive(Args, Clone)]
pub struct SizeArgs {
    /// Decoder layers (1 to 256).
    #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = whole(1i64, 256))]
    pub layers: i64,
    /// Hidden size (a multiple of --heads whose quotient, the head size, is even).
    #[arg(long, default_value_t = 128, allow_hyphen_values = true, value_parser = whole(1i64, 65_536))]
    pub hidden: i64,
    /// Attention heads (a multiple of --kv-heads).
    #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = whole(1i64, 1024))]
    pub heads: i64,
    /// Key-value heads (grouped-query attention).
    #[arg(long, default_value_t = 2, allow_hyphen_values = true, value_parser = whole(1i64, 1024))]
    pub kv_heads: i64,
    /// The MLP's inner size.
    #[arg(long, default_value_t = 384, allow_hyphen_values = true, value_parser = whole(1i64, 262_144))]
    pub intermediate: i64,
    /// The context length.
    #[arg(long, default_value_t = 512, allow_hyphen_values = true, value_parser = whole(1i64, MAX_TOKENS))]
    pub max_positions: i64,
}

impl SizeArgs {
    /// The sizes, refusing combinations the model cannot have (each bound alone is clap's).
    pub fn size(&self) -> Result<init::Size> {
        let SizeArgs { layers, hidden, heads, kv_heads, intermediate, max_positions } = *self;
        if hidden % heads != 0 {
            bail!("--hidden {hidden} is not a multiple of --heads {heads}");
        }
        if (hidden / heads) % 2 != 0 {
            bail!("--hidden / --heads = {} (the head size) must be even for rotary embeddings", hidden / heads);
        }
        if heads % kv_heads != 0 {
            bail!("--heads {heads} is not a multiple of --kv-heads {kv_heads}");
        }
        let size = init::Size { layers, hidden, heads, kv_heads, intermediate, max_positions };
        if let Err(e) = init::config(&size, init::vocab_size()) {
            bail!("--layers, --hidden, --intermediate: {e}");
        }
        Ok(size)
    }
}
