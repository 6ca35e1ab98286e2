//! `llama study`: the paper's claims tested over seeds, on the demo's task and model.
//!
//! For every seed the study builds its own shared stages once — a new model (`init`, seeded), the
//! sloppy teacher's worked solutions and the supervised warm-up (the demo's stages 1–3, with the
//! seed in the model's initialisation and in the problems) — then runs each *arm* (an objective
//! and its baseline) as an `iterate` loop from that warm-up, with the seed's own training and
//! held-out questions. Every arm of every seed is a directory of its own; a killed study resumes
//! where it stopped (finished stages are reused, an interrupted `iterate` continues).
//!
//! A *claim* groups the arms it compares ([`Claim::arms`]); arms shared by several claims run
//! once. After each arm the study rewrites `study.jsonl` (one [`StudyRow`] per claim, arm, seed
//! and iteration), `study.md` (a table per claim: mean and standard error over seeds, and the
//! paired difference of each arm to the claim's reference arm) and `claim-NAME.png`.

use crate::checkpoint::Placement;
use crate::demo::{self, Recipe, Scale};
use crate::iterate;
use crate::metrics::{IterationRecord, read_jsonl};
use crate::plot::{Panel, Series};
use crate::settings::{Baseline, Curation, IterateSettings, Objective, TrainSettings};
use crate::stats::mean_se;
use crate::verify::{self, VerifySettings, VerifySummary};
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One claim of the paper, and the arms that test it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Claim {
    /// Negatives help: TOPR on all graded samples against SFT on the positives of the same data.
    Negatives,
    /// Naive off-policy REINFORCE with negatives degenerates; TOPR does not.
    Degeneration,
    /// Dataset composition: accuracy against the effective positive proportion p̃, on data sets
    /// subsampled to two raw shares of positives ([`COMPOSITION_RAW_SHARES`]); one iteration
    /// (one data set from the warm model), whatever the study's `--iterations`.
    Composition,
    /// TOPR against PPO, GRPO and DPO on the same data and budget.
    Peers,
    /// Stability far off-policy: four epochs on one data set sampled once from the warm model μ
    /// (one iteration, whatever the study's `--iterations`), the gradient clipped at 100 (the
    /// paper's setting for IS): TOPR against IS, TIS, naive REINFORCE and PPO.
    OffPolicy,
    /// A natural task: nothing planted (a perfect teacher, a one-epoch warm-up, [`Recipe::Natural`]),
    /// so that what the loop can use is the model's own variation (pass@k well above pass@1).
    /// TOPR against SFT on the positives of the same data, from that warm-up.
    Natural,
    /// Iterated training: do TOPR's gains continue over [`ITERATED_ITERATIONS`] iterations, each
    /// sampling from the model the previous one trained (μ refreshed)? The demo's TOPR arm,
    /// continued; its first iterations are the other claims' `topr-p0.5` rows.
    Iterated,
    /// The generative verifier: the warm model trained with TOPR to judge its own solutions (on
    /// both verdicts of each), it picks one of k held-out solutions; against pass@1 and majority
    /// voting ([`crate::verify`]). Not an `iterate` arm: its own pipeline per seed.
    Verifier,
    /// Far off-policy, the baseline held equal: TIS and naive REINFORCE with TOPR's baseline for
    /// p̃ = 0.5 (the off-policy claim runs them with c = 0), so that what differs from TOPR's
    /// arm is the objective alone. The off-policy claim's setting.
    OffPolicyBaseline,
    /// A better result in the same time (issue #13): the demo's TOPR iterations at other
    /// learning rates ([`LEARNING_RATES`]), the same steps, data and wall time, for the demo's
    /// [`SAME_TIME_ITERATIONS`] iterations.
    LearningRate,
    /// A better result in the same time (issue #13): the same warm-up steps on twice the
    /// problems for half the epochs ([`Recipe::SloppyFresh`]), then the demo's TOPR iterations.
    WarmUpData,
}

impl Claim {
    /// Every claim.
    pub const ALL: [Claim; 11] = [
        Claim::Negatives,
        Claim::Degeneration,
        Claim::Composition,
        Claim::Peers,
        Claim::OffPolicy,
        Claim::Natural,
        Claim::Iterated,
        Claim::Verifier,
        Claim::OffPolicyBaseline,
        Claim::LearningRate,
        Claim::WarmUpData,
    ];

    /// The claim's name on the command line and in file names.
    pub fn name(self) -> &'static str {
        match self {
            Self::Negatives => "negatives",
            Self::Degeneration => "degeneration",
            Self::Composition => "composition",
            Self::Peers => "peers",
            Self::OffPolicy => "off-policy",
            Self::Natural => "natural",
            Self::Iterated => "iterated",
            Self::Verifier => "verifier",
            Self::OffPolicyBaseline => "off-policy-baseline",
            Self::LearningRate => "learning-rate",
            Self::WarmUpData => "warm-up-data",
        }
    }

    /// The question the claim's table answers.
    pub fn question(self) -> &'static str {
        match self {
            Self::Negatives => {
                "Do negatives help? TOPR on all graded samples against SFT on the positives of the same data."
            }
            Self::Degeneration => {
                "Does naive off-policy REINFORCE degenerate with negatives where TOPR does not? (invalid rate, accuracy)"
            }
            Self::Composition => "How does accuracy depend on the effective positive proportion p̃ of the TOPR data?",
            Self::Peers => "TOPR against PPO, GRPO and DPO on the same data and budget.",
            Self::OffPolicy => {
                "Far off-policy (4 epochs per data set, gradient norm clipped at 100): does TOPR stay stable where IS, TIS, naive REINFORCE or PPO do not?"
            }
            Self::Natural => {
                "A natural task (nothing planted: a perfect teacher, a one-epoch warm-up): does the loop improve the model from its own variation, and do negatives help there? TOPR against SFT on the positives of the same data."
            }
            Self::Iterated => {
                "Do TOPR's gains continue over several iterations, each sampling from the model the previous one trained?"
            }
            Self::Verifier => {
                "Does a verifier trained with TOPR to judge the model's own solutions pick a better one among k than majority voting?"
            }
            Self::OffPolicyBaseline => {
                "Far off-policy with the baseline held equal: is TOPR's stability its objective or its baseline? TOPR against TIS and naive REINFORCE, all with the baseline for p̃ = 0.5."
            }
            Self::LearningRate => {
                "A better result in the same time? The demo's TOPR iterations at other learning rates (same steps, data and time)."
            }
            Self::WarmUpData => {
                "A better result in the same time? The warm-up's steps on twice the problems for half the epochs, then the demo's iterations."
            }
        }
    }

    /// The claim's arms; the first is the reference the others are compared with. The verifier
    /// claim has none (it runs [`crate::verify::run`] per seed).
    pub fn arms(self) -> Vec<Arm> {
        let topr = Arm::topr(demo::DEMO_P_TILDE);
        let p_half = topr.baseline;
        // The demo's arm at the demo's length: the reference of the same-time claims.
        let demo_length = Arm { iterations: Some(SAME_TIME_ITERATIONS), ..topr.clone() };
        match self {
            Self::Verifier => vec![],
            Self::Negatives => vec![topr, Arm::new("sft", Objective::Sft, Baseline::Zero)],
            Self::Degeneration => vec![topr, Arm::new("reinforce", Objective::Reinforce, Baseline::Zero)],
            Self::Composition => COMPOSITION_RAW_SHARES
                .into_iter()
                .flat_map(|raw| {
                    COMPOSITION_P_TILDES.into_iter().map(move |p| Arm {
                        name: format!("topr-p{p}-raw{raw}"),
                        curate: Curation::RawShare(raw),
                        iterations: Some(1),
                        ..Arm::topr(p)
                    })
                })
                .collect(),
            Self::Peers => vec![
                topr,
                Arm::new("ppo", Objective::Ppo, Baseline::Zero),
                Arm::new("grpo", Objective::Grpo, Baseline::Zero),
                Arm::new("dpo", Objective::Dpo, Baseline::Zero),
            ],
            Self::OffPolicy => [
                ("topr", Objective::Topr, p_half),
                ("is", Objective::Is, Baseline::Zero),
                ("tis", Objective::Tis, Baseline::Zero),
                ("reinforce", Objective::Reinforce, Baseline::Zero),
                ("ppo", Objective::Ppo, Baseline::Zero),
            ]
            .into_iter()
            .map(|(n, o, b)| Arm::off_policy(n, o, b))
            .collect(),
            Self::OffPolicyBaseline => [
                ("topr", Objective::Topr, p_half),
                ("tis-p0.5", Objective::Tis, p_half),
                ("reinforce-p0.5", Objective::Reinforce, p_half),
            ]
            .into_iter()
            .map(|(n, o, b)| Arm::off_policy(n, o, b))
            .collect(),
            Self::Natural => [topr, Arm::new("sft", Objective::Sft, Baseline::Zero)]
                .into_iter()
                .map(|a| Arm { name: format!("natural-{}", a.name), recipe: Recipe::Natural, ..a })
                .collect(),
            Self::Iterated => vec![Arm { iterations: Some(ITERATED_ITERATIONS), ..topr }],
            Self::LearningRate => std::iter::once(demo_length.clone())
                .chain(LEARNING_RATES.map(|lr| Arm {
                    name: format!("{}-lr{lr}", topr.name),
                    lr,
                    ..demo_length.clone()
                }))
                .collect(),
            Self::WarmUpData => vec![
                demo_length.clone(),
                Arm { name: format!("fresh-{}", topr.name), recipe: Recipe::SloppyFresh, ..demo_length },
            ],
        }
    }

    /// The samples a question of its sampled evaluation (sampled pass@1, maj@k, pass@k, and the
    /// share of questions with no or one correct sample), made for the initial model and each
    /// arm's last iteration; `None`: greedy pass@1 only.
    pub fn sampled_k(self) -> Option<usize> {
        matches!(self, Self::Negatives | Self::Natural).then_some(SAMPLED_K)
    }

    /// The iterations its table shows: the most of its arms', where `study` is the study's
    /// `--iterations` (the arms that do not fix their own).
    pub fn iterations(self, study: usize) -> usize {
        self.arms().iter().map(|a| a.iterations(study)).max().unwrap_or(study)
    }

    /// Parses a claim's name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == s)
    }
}

/// The composition claim's raw shares of positives (each data set subsampled to it, as in the
/// paper's 10 % and 50 % data sets).
pub const COMPOSITION_RAW_SHARES: [f64; 2] = [0.1, 0.5];
/// The composition claim's effective proportions of positives p̃ (its arms' baselines).
pub const COMPOSITION_P_TILDES: [f64; 4] = [0.05, 0.2, 0.5, 0.9];
/// Samples a question in the sampled evaluation of the claims that report pass@k
/// ([`Claim::sampled_k`]).
pub const SAMPLED_K: usize = 8;
/// The iterated claim's iterations, whatever the study's `--iterations`.
pub const ITERATED_ITERATIONS: usize = 5;
/// The learning-rate claim's rates beside the demo's [`demo::DEMO_LR`].
pub const LEARNING_RATES: [f64; 3] = [3e-5, 3e-4, 1e-3];
/// The iterations of the claims that compare with the demo at its own length (learning-rate,
/// warm-up-data): the demo's.
pub const SAME_TIME_ITERATIONS: usize = 3;

/// One training setting of the study: an objective and its baseline, applied at every
/// iteration on the model's own graded samples; everything else is the demo's.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Arm {
    /// Directory name and table label.
    pub name: String,
    pub objective: Objective,
    pub baseline: Baseline,
    /// Epochs on each iteration's data (the demo's: 1).
    pub epochs: usize,
    /// The gradient-norm clip (the demo's: 1).
    pub max_grad_norm: Option<f64>,
    /// The learning rate of its training (the demo's: [`demo::DEMO_LR`]).
    pub lr: f64,
    /// Which samples of each data set are trained on (the demo's: all).
    pub curate: Curation,
    /// The warm-up the arm starts from (the demo's: the sloppy teacher).
    pub recipe: Recipe,
    /// Its iterations, where its claim fixes them; `None`: the study's `--iterations`. An arm
    /// shared by claims with different counts runs the most (a loop may be continued), and each
    /// claim reads the rows it needs.
    pub iterations: Option<usize>,
}

impl Arm {
    /// The effective proportion of positives its baseline targets, if it has one.
    pub fn p_tilde(&self) -> Option<f64> {
        match self.baseline {
            Baseline::TargetPositiveProportion(p) => Some(p),
            _ => None,
        }
    }

    /// Its iterations in a study of `study` iterations.
    pub fn iterations(&self, study: usize) -> usize {
        self.iterations.unwrap_or(study)
    }

    /// The raw share of positives its data sets are subsampled to, if any.
    pub fn raw_share(&self) -> Option<f64> {
        match self.curate {
            Curation::RawShare(r) => Some(r),
            _ => None,
        }
    }

    fn new(name: &str, objective: Objective, baseline: Baseline) -> Self {
        Self {
            name: name.into(),
            objective,
            baseline,
            epochs: 1,
            max_grad_norm: Some(1.0),
            lr: demo::DEMO_LR,
            curate: Curation::All,
            recipe: Recipe::Sloppy,
            iterations: None,
        }
    }

    /// An arm of the far off-policy setting: four epochs on one data set (one iteration), the
    /// gradient norm clipped at 100; named `{name}-offpolicy`.
    fn off_policy(name: &str, objective: Objective, baseline: Baseline) -> Self {
        Self {
            epochs: 4,
            max_grad_norm: Some(100.0),
            iterations: Some(1),
            ..Self::new(&format!("{name}-offpolicy"), objective, baseline)
        }
    }

    /// TOPR with the baseline that gives positives the share `p̃` of the weight.
    fn topr(p_tilde: f64) -> Self {
        Self::new(&format!("topr-p{p_tilde}"), Objective::Topr, Baseline::TargetPositiveProportion(p_tilde))
    }
}

/// What a study runs.
#[derive(Debug, Clone)]
pub struct StudySettings {
    pub work: PathBuf,
    pub claims: Vec<Claim>,
    pub seeds: Vec<u64>,
    pub scale: Scale,
    pub at: Placement,
}

/// One line of `study.jsonl`: an arm's held-out result at one iteration for one seed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StudyRow {
    pub claim: Claim,
    pub arm: String,
    pub seed: u64,
    pub iteration: usize,
    /// Greedy pass@1 on the seed's held-out problems.
    pub accuracy: f64,
    pub invalid_rate: f64,
    /// The share of positives in the data the iteration trained on (absent for iteration 0).
    pub data_positive_fraction: Option<f64>,
    /// Held-out problems.
    pub eval_n: usize,
}

/// One line of `study-sampled.jsonl`: the sampled evaluation ([`Claim::sampled_k`]) of an arm's
/// model at one iteration (0: the initial model) for one seed, from its per-question results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampledRow {
    pub claim: Claim,
    pub arm: String,
    pub seed: u64,
    pub iteration: usize,
    /// Samples a question.
    pub k: usize,
    /// The mean share of correct samples.
    pub pass1_sampled: f64,
    /// The share of questions whose most common sampled answer is correct.
    pub maj_at_k: f64,
    /// The share of questions with at least one correct sample.
    pub pass_at_k: f64,
    /// The share of samples with no answer.
    pub invalid_sampled: f64,
    /// The share of questions none of whose samples is correct.
    pub none_correct: f64,
    /// The share of questions with at most one correct sample.
    pub at_most_one_correct: f64,
    /// Held-out questions.
    pub questions: usize,
}

impl SampledRow {
    /// The row of the per-question results in `questions` (`eval`'s lines, `k` samples each).
    fn read(claim: Claim, arm: &str, seed: u64, iteration: usize, k: usize, questions: &Path) -> Result<Self> {
        let results: Vec<crate::eval::QuestionResult> = read_jsonl(questions)?;
        let n = results.len().max(1) as f64;
        let share = |f: &dyn Fn(&crate::eval::QuestionResult) -> f64| results.iter().map(f).sum::<f64>() / n;
        let correct = |r: &crate::eval::QuestionResult| r.sample_correct.iter().filter(|c| **c).count();
        if let Some(r) = results.iter().find(|r| r.sample_correct.len() != k) {
            anyhow::bail!("{}: question {} has {} samples, not {k}", questions.display(), r.id, r.sample_correct.len());
        }
        Ok(Self {
            claim,
            arm: arm.into(),
            seed,
            iteration,
            k,
            pass1_sampled: share(&|r| correct(r) as f64 / k as f64),
            maj_at_k: share(&|r| {
                f64::from(u8::from(crate::task::is_correct(crate::eval::majority(&r.sample_answers), r.reference)))
            }),
            pass_at_k: share(&|r| f64::from(u8::from(correct(r) > 0))),
            invalid_sampled: share(&|r| r.sample_answers.iter().filter(|a| a.is_none()).count() as f64 / k as f64),
            none_correct: share(&|r| f64::from(u8::from(correct(r) == 0))),
            at_most_one_correct: share(&|r| f64::from(u8::from(correct(r) <= 1))),
            questions: results.len(),
        })
    }
}

/// The sampled evaluations made so far, for the claims that have one.
pub fn sampled_rows(s: &StudySettings) -> Result<Vec<SampledRow>> {
    let mut out = vec![];
    for c in &s.claims {
        let Some(k) = c.sampled_k() else { continue };
        let last = c.iterations(s.scale.iterations);
        for arm in c.arms() {
            for &seed in &s.seeds {
                let work = seed_dir(&s.work, seed).join(&arm.name);
                for i in [0, last] {
                    let file = iterate::sampled_eval_file(&work, i, k);
                    let questions = iterate::questions_file(&file);
                    if file.exists() && questions.exists() {
                        out.push(SampledRow::read(*c, &arm.name, seed, i, k, &questions)?);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// One column of the sampled evaluation's table: a value of a row.
type Metric = fn(&SampledRow) -> f64;

/// The sampled evaluation's table of claim `c`: the initial model, each arm at the last
/// iteration, and each other arm's paired difference to the first.
fn sampled_section(md: &mut String, c: Claim, rows: &[SampledRow], s: &StudySettings) -> Result<()> {
    let (Some(k), arms) = (c.sampled_k(), c.arms()) else { return Ok(()) };
    let last = c.iterations(s.scale.iterations);
    let mine: Vec<&SampledRow> = rows.iter().filter(|r| r.claim == c).collect();
    if mine.is_empty() {
        return Ok(());
    }
    let metrics: [(&str, Metric); 6] = [
        ("pass@1 (sampled)", |r| r.pass1_sampled),
        ("maj@k", |r| r.maj_at_k),
        ("pass@k", |r| r.pass_at_k),
        ("invalid samples", |r| r.invalid_sampled),
        ("no correct sample", |r| r.none_correct),
        ("at most one correct", |r| r.at_most_one_correct),
    ];
    writeln!(
        md,
        "Sampled evaluation: {k} samples a question at the sampling temperature, on the same held-out \
         questions (mean ± SE over seeds; k = {k}):\n"
    )?;
    let mut header = "| model | seeds |".to_string();
    for (name, _) in &metrics {
        write!(header, " {name} |")?;
    }
    writeln!(md, "{header}\n|{}", "---|".repeat(metrics.len() + 2))?;
    let at = |arm: &str, i: usize| -> Vec<&SampledRow> {
        mine.iter().copied().filter(|r| r.arm == arm && r.iteration == i).collect()
    };
    let mut line = |label: String, v: Vec<Vec<f64>>| -> Result<()> {
        let mut l = format!("| {label} | {} |", v.first().map_or(0, Vec::len));
        for m in &v {
            write!(l, " {} |", fmt(mean_se(m)))?;
        }
        writeln!(md, "{l}")?;
        Ok(())
    };
    let values = |rs: &[&SampledRow]| metrics.iter().map(|(_, f)| rs.iter().map(|r| f(r)).collect()).collect();
    line("initial model".into(), values(&at(&arms[0].name, 0)))?;
    for arm in &arms {
        line(format!("{} at iteration {last}", arm.name), values(&at(&arm.name, last)))?;
    }
    let first = at(&arms[0].name, last);
    for arm in arms.iter().skip(1) {
        let paired: Vec<(&SampledRow, &SampledRow)> = at(&arm.name, last)
            .into_iter()
            .filter_map(|r| Some((r, *first.iter().find(|f| f.seed == r.seed)?)))
            .collect();
        let diffs = metrics.iter().map(|(_, f)| paired.iter().map(|(a, b)| f(a) - f(b)).collect()).collect();
        line(format!("{} − {}, paired", arm.name, arms[0].name), diffs)?;
    }
    writeln!(md)?;
    Ok(())
}

/// Runs (or continues) the study; rewrites its tables and plots after every arm.
pub fn run(s: &StudySettings) -> Result<()> {
    std::fs::create_dir_all(&s.work).with_context(|| format!("creating {}", s.work.display()))?;
    let _lock = crate::io::Lock::dir(&s.work)?;
    let t0 = std::time::Instant::now();
    // Each arm once; one that several claims share runs the most iterations any of them needs.
    let mut arms: Vec<Arm> = vec![];
    for c in &s.claims {
        for a in c.arms() {
            match arms.iter_mut().find(|b| b.name == a.name) {
                Some(b) => b.iterations = Some(b.iterations(s.scale.iterations).max(a.iterations(s.scale.iterations))),
                None => arms.push(a),
            }
        }
    }
    let total = arms.len() * s.seeds.len();
    let mut done = 0;
    for &seed in &s.seeds {
        let dir = seed_dir(&s.work, seed);
        // Each recipe's warm-up is made once per seed, when an arm (or the verifier) first needs it.
        let warm = |recipe: Recipe| demo::warm_up_with(&warm_up_dir(&dir, recipe), s.scale, seed, s.at, recipe);
        for arm in &arms {
            eprintln!(
                "[study {:.0} s] seed {seed}, arm {} ({}/{total})",
                t0.elapsed().as_secs_f64(),
                arm.name,
                done + 1
            );
            let (warm_model, settings) = (warm(arm.recipe)?, arm_settings(&dir, s.scale, seed, arm)?);
            iterate::run(&warm_model, s.at, &settings, None)?;
            for c in s.claims.iter().filter(|c| c.arms().iter().any(|a| a.name == arm.name)) {
                if let Some(k) = c.sampled_k() {
                    for i in [0, c.iterations(s.scale.iterations)] {
                        iterate::evaluate_sampled(&warm_model, s.at, &settings, i, k)?;
                    }
                }
            }
            done += 1;
            report(s)?;
        }
        if s.claims.contains(&Claim::Verifier) {
            eprintln!("[study {:.0} s] seed {seed}, the verifier", t0.elapsed().as_secs_f64());
            verify::run(&warm(Recipe::Sloppy)?, s.at, &verifier_settings(&dir, s.scale, seed)?)?;
            report(s)?;
        }
    }
    eprintln!("[study {:.0} s] done: {}", t0.elapsed().as_secs_f64(), s.work.join("study.md").display());
    Ok(())
}

/// The `iterate` settings of `arm` for `seed`: the demo's TOPR iterations with the arm's
/// objective and baseline.
fn arm_settings(dir: &Path, scale: Scale, seed: u64, arm: &Arm) -> Result<IterateSettings> {
    let base = demo::topr_settings()?;
    let train = TrainSettings {
        objective: arm.objective,
        baseline: arm.baseline,
        epochs: arm.epochs,
        max_grad_norm: arm.max_grad_norm,
        lr: arm.lr,
        seed,
        ..base
    };
    // Every arm of a seed starts from its warm-up with the same questions and sampling: the
    // initial evaluation and the first data set are made once, in `shared`.
    Ok(IterateSettings {
        curate: arm.curate,
        iterations: arm.iterations(scale.iterations),
        shared: Some(dir.join("shared")),
        ..demo::iterate_settings(dir.join(&arm.name), scale, seed, train)
    })
}

/// The verifier's pipeline for `seed`, from the warm model: the demo's training questions and
/// sampling, k = 4 solutions a question, two rounds of the judge's TOPR training (the demo's TOPR
/// settings), the arms' held-out questions.
pub fn verifier_settings(dir: &Path, scale: Scale, seed: u64) -> Result<VerifySettings> {
    let it = demo::iterate_settings(dir.join("verifier"), scale, seed, demo::topr_settings()?);
    Ok(VerifySettings {
        task: it.task,
        eval_data: None,
        eval_n: scale.eval_n,
        k: 4,
        sampling: it.sampling,
        train: TrainSettings { seed, ..it.train },
        judge_iterations: 2,
        batch_prompts: 16,
        seed: seed as i64,
        work: dir.join("verifier"),
    })
}

/// One seed's verifier result, a line of `verifier.jsonl`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VerifierRow {
    pub seed: u64,
    pub summary: VerifySummary,
}

/// The verifier results of the seeds that have one.
pub fn verifier_rows(s: &StudySettings) -> Result<Vec<VerifierRow>> {
    let mut out = vec![];
    for &seed in &s.seeds {
        let path = seed_dir(&s.work, seed).join("verifier").join("verify.json");
        if path.exists() {
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let summary = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            out.push(VerifierRow { seed, summary });
        }
    }
    Ok(out)
}

/// The verifier claim's section of `study.md` and its plot.
fn verifier_section(s: &StudySettings, md: &mut String) -> Result<()> {
    let rows = verifier_rows(s)?;
    let mut jsonl = String::new();
    for r in &rows {
        writeln!(jsonl, "{}", serde_json::to_string(r)?)?;
    }
    write_text(&s.work.join("verifier.jsonl"), &jsonl)?;
    let c = Claim::Verifier;
    writeln!(
        md,
        "## {}

{}
",
        c.name(),
        c.question()
    )?;
    writeln!(
        md,
        "{}",
        concat!(
            "Each cell: mean ± standard error over seeds of the held-out share (k = 4 solutions per question, ",
            "the seeds' warm models, two TOPR rounds of the judge on both verdicts of its own training solutions). ",
            "`SE questions`: the mean over seeds of each seed's standard error over its questions.\n"
        )
    )?;
    writeln!(
        md,
        "| measure | seeds | mean ± SE over seeds | SE questions |
|---|---|---|---|"
    )?;
    type Pick = fn(&VerifySummary) -> crate::verify::Estimate;
    let measures: [(&str, Pick); 6] = [
        ("pass@1 (a sampled solution)", |v| v.pass1),
        ("maj@k (majority vote)", |v| v.maj_at_k),
        ("verifier@k (its pick)", |v| v.verifier_at_k),
        ("pass@k (oracle)", |v| v.pass_at_k),
        ("verifier − majority (paired)", |v| v.verifier_minus_majority),
        ("judgement accuracy", |v| v.judgement_accuracy),
    ];
    let mut series = vec![];
    for (name, pick) in measures {
        let v: Vec<f64> = rows.iter().map(|r| pick(&r.summary).mean).collect();
        let se_q: Vec<f64> = rows.iter().map(|r| pick(&r.summary).se).collect();
        writeln!(
            md,
            "| {name} | {} | {} | {} |",
            v.len(),
            fmt(mean_se(&v)),
            fmt((mean_se(&se_q).0, f64::NAN)).replace(" (one seed)", "")
        )?;
        if !name.starts_with("verifier −") && !name.starts_with("judgement") {
            series.push(Series {
                label: name.split(' ').next().unwrap_or(name).to_string(),
                points: rows.iter().map(|r| (r.seed as f64, pick(&r.summary).mean)).collect(),
            });
        }
    }
    let base: Vec<f64> = rows.iter().map(|r| r.summary.positive_fraction).collect();
    writeln!(
        md,
        "| correct among judged (base rate) | {} | {} | |
",
        base.len(),
        fmt(mean_se(&base))
    )?;
    let png = s.work.join("claim-verifier.png");
    let panels = [Panel {
        title: "verifier: held-out accuracy of each pick, per seed".into(),
        x: "seed".into(),
        y: "share of questions".into(),
        series,
    }];
    crate::plot::report("study", || {
        crate::plot::draw(&png, &panels, 1)?;
        Ok(png.clone())
    });
    writeln!(
        md,
        "![verifier](claim-verifier.png)
"
    )?;
    Ok(())
}

/// The rows of every finished iteration of the study's runs.
pub fn rows(s: &StudySettings) -> Result<Vec<StudyRow>> {
    let mut out = vec![];
    for c in &s.claims {
        for arm in c.arms() {
            for &seed in &s.seeds {
                let path = seed_dir(&s.work, seed).join(&arm.name).join("iterations.jsonl");
                if !path.exists() {
                    continue;
                }
                let table: Vec<IterationRecord> = read_jsonl(&path)?;
                // An arm shared with a claim of more iterations has rows this claim does not show.
                let last = c.iterations(s.scale.iterations);
                out.extend(table.into_iter().filter(|r| r.iteration <= last).map(|r| StudyRow {
                    claim: *c,
                    arm: arm.name.clone(),
                    seed,
                    iteration: r.iteration,
                    accuracy: r.accuracy,
                    invalid_rate: r.invalid_rate,
                    data_positive_fraction: r.data_positive_fraction,
                    eval_n: s.scale.eval_n,
                }));
            }
        }
    }
    Ok(out)
}

fn fmt(ms: (f64, f64)) -> String {
    match (ms.0.is_nan(), ms.1.is_nan()) {
        (true, _) => "–".into(),
        (false, true) => format!("{:.3} (one seed)", ms.0),
        (false, false) => format!("{:.3} ± {:.3}", ms.0, ms.1),
    }
}

/// `study.jsonl`, `study.md` and one plot per claim, from the finished iterations.
pub fn report(s: &StudySettings) -> Result<()> {
    let rows = rows(s)?;
    let mut jsonl = String::new();
    for r in &rows {
        writeln!(jsonl, "{}", serde_json::to_string(r)?)?;
    }
    write_text(&s.work.join("study.jsonl"), &jsonl)?;
    let sampled = sampled_rows(s)?;
    if !sampled.is_empty() {
        let mut lines = String::new();
        for r in &sampled {
            writeln!(lines, "{}", serde_json::to_string(r)?)?;
        }
        write_text(&s.work.join("study-sampled.jsonl"), &lines)?;
    }
    let mut md = String::new();
    writeln!(
        md,
        "# Study: {} seed(s), {} held-out problems a seed, {} iteration(s) unless a claim fixes its own\n",
        s.seeds.len(),
        s.scale.eval_n,
        s.scale.iterations
    )?;
    writeln!(
        md,
        "Each cell: mean ± standard error over seeds of the greedy held-out accuracy (the seeds' \
         own model initialisation, warm-up data, training questions and held-out questions). \
         `gain`: last iteration minus iteration 0, per seed. `vs first`: the paired difference to \
         the claim's first arm at the last iteration, per seed. `SE questions`: the binomial \
         standard error of the pooled accuracy over all seeds' questions.\n"
    )?;
    for c in &s.claims {
        if *c == Claim::Verifier {
            verifier_section(s, &mut md)?;
            continue;
        }
        writeln!(md, "## {}\n\n{}\n", c.name(), c.question())?;
        let iters = c.iterations(s.scale.iterations);
        let mut header = "| arm | seeds |".to_string();
        for i in 0..=iters {
            write!(header, " iteration {i} |")?;
        }
        writeln!(md, "{header} gain | vs first | invalid at last | positives in data (it. 1) | SE questions (last) |")?;
        writeln!(md, "|{}", "---|".repeat(iters + 8))?;
        let arms = c.arms();
        let at = |arm: &str, seed: u64, i: usize| -> Option<&StudyRow> {
            rows.iter().find(|r| r.claim == *c && r.arm == arm && r.seed == seed && r.iteration == i)
        };
        let mut panels_acc = vec![];
        let mut panels_inv = vec![];
        // Raw share of positives -> (p̃, mean accuracy at the last iteration), for the
        // composition claim's accuracy-against-p̃ panel.
        let mut composition: std::collections::BTreeMap<String, Vec<(f64, f64)>> = Default::default();
        for arm in &arms {
            let seeds: Vec<u64> = s.seeds.iter().copied().filter(|&sd| at(&arm.name, sd, iters).is_some()).collect();
            let mut line = format!("| {} | {} |", arm.name, seeds.len());
            let mut acc_points = vec![];
            let mut inv_points = vec![];
            for i in 0..=iters {
                let v: Vec<f64> = s.seeds.iter().filter_map(|&sd| at(&arm.name, sd, i)).map(|r| r.accuracy).collect();
                let w: Vec<f64> =
                    s.seeds.iter().filter_map(|&sd| at(&arm.name, sd, i)).map(|r| r.invalid_rate).collect();
                write!(line, " {} |", fmt(mean_se(&v)))?;
                if !v.is_empty() {
                    acc_points.push((i as f64, mean_se(&v).0));
                    inv_points.push((i as f64, mean_se(&w).0));
                }
            }
            let gain: Vec<f64> = seeds
                .iter()
                .filter_map(|&sd| Some(at(&arm.name, sd, iters)?.accuracy - at(&arm.name, sd, 0)?.accuracy))
                .collect();
            let vs: Vec<f64> = seeds
                .iter()
                .filter_map(|&sd| Some(at(&arm.name, sd, iters)?.accuracy - at(&arms[0].name, sd, iters)?.accuracy))
                .collect();
            let invalid: Vec<f64> =
                seeds.iter().filter_map(|&sd| at(&arm.name, sd, iters)).map(|r| r.invalid_rate).collect();
            let last: Vec<f64> = seeds.iter().filter_map(|&sd| at(&arm.name, sd, iters)).map(|r| r.accuracy).collect();
            let positives: Vec<f64> =
                seeds.iter().filter_map(|&sd| at(&arm.name, sd, 1)?.data_positive_fraction).collect();
            let pooled = mean_se(&last).0;
            if let (Some(p), Some(raw)) = (arm.p_tilde(), arm.raw_share()) {
                composition.entry(format!("{raw}")).or_default().push((p, pooled));
            }
            let n_q = (last.len() * s.scale.eval_n) as f64;
            let se_q = if n_q > 0.0 { (pooled * (1.0 - pooled) / n_q).sqrt() } else { f64::NAN };
            writeln!(
                md,
                "{line} {} | {} | {} | {} | {} |",
                fmt(mean_se(&gain)),
                if arm == &arms[0] { "—".into() } else { fmt(mean_se(&vs)) },
                fmt(mean_se(&invalid)),
                fmt(mean_se(&positives)),
                if se_q.is_nan() { "–".into() } else { format!("{se_q:.3}") }
            )?;
            panels_acc.push(Series { label: arm.name.clone(), points: acc_points });
            panels_inv.push(Series { label: arm.name.clone(), points: inv_points });
        }
        writeln!(md)?;
        sampled_section(&mut md, *c, &sampled, s)?;
        if iters >= 3 {
            step_gains(&mut md, &arms, &s.seeds, iters, |arm, seed, i| at(arm, seed, i).map(|r| r.accuracy))?;
        }
        let png = s.work.join(format!("claim-{}.png", c.name()));
        let mut panels = vec![
            Panel {
                title: format!("{}: held-out accuracy (mean over seeds)", c.name()),
                x: "iteration".into(),
                y: "greedy pass@1".into(),
                series: panels_acc,
            },
            Panel {
                title: format!("{}: invalid answers (mean over seeds)", c.name()),
                x: "iteration".into(),
                y: "share of problems".into(),
                series: panels_inv,
            },
        ];
        if !composition.is_empty() {
            panels.push(Panel {
                title: format!("{}: accuracy at iteration {iters} against p~", c.name()),
                x: "effective proportion of positives p~".into(),
                y: "greedy pass@1".into(),
                series: composition
                    .into_iter()
                    .map(|(raw, mut points)| {
                        points.sort_by(|a, b| a.0.total_cmp(&b.0));
                        Series { label: format!("raw share of positives {raw}"), points }
                    })
                    .collect(),
            });
        }
        if arms.iter().any(|a| a.epochs > 1) {
            panels.extend(training_panels(s, &arms)?);
        }
        crate::plot::report("study", || {
            crate::plot::draw(&png, &panels, 2)?;
            Ok(png.clone())
        });
        writeln!(
            md,
            "![{}]({})\n",
            c.name(),
            png.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default()
        )?;
    }
    write_text(&s.work.join("study.md"), &md)?;
    Ok(())
}

/// For claims of several epochs on one data set: per optimiser step of iteration 1, the mean
/// over seeds of the per-token log-ratio `log π − log μ` and of log10 of the gradient norm before
/// clipping — how far each arm's policy moved from μ, and whether its updates blew up.
fn training_panels(s: &StudySettings, arms: &[Arm]) -> Result<Vec<Panel>> {
    let mut ratio = vec![];
    let mut norm = vec![];
    for arm in arms {
        // step -> (sum of log-ratios, sum of log10 norms, seeds)
        let mut by_step: std::collections::BTreeMap<usize, (f64, f64, usize)> = Default::default();
        for &seed in &s.seeds {
            let it = seed_dir(&s.work, seed).join(&arm.name).join("iter-1");
            if !it.join("train.done.json").exists() {
                continue;
            }
            for r in read_jsonl::<crate::metrics::StepRecord>(&it.join("metrics.jsonl"))? {
                let e = by_step.entry(r.step).or_default();
                e.0 += r.stats.log_ratio_mean;
                e.1 += r.grad_norm.max(1e-12).log10();
                e.2 += 1;
            }
        }
        let points = |f: fn(&(f64, f64, usize)) -> f64| by_step.iter().map(|(k, v)| (*k as f64, f(v))).collect();
        ratio.push(Series { label: arm.name.clone(), points: points(|v| v.0 / v.2 as f64) });
        norm.push(Series { label: arm.name.clone(), points: points(|v| v.1 / v.2 as f64) });
    }
    Ok(vec![
        Panel {
            title: "training (iteration 1): log pi/mu a token".into(),
            x: "optimiser step".into(),
            y: "mean log pi - log mu (mean over seeds)".into(),
            series: ratio,
        },
        Panel {
            title: "training (iteration 1): gradient norm".into(),
            x: "optimiser step".into(),
            y: "log10 norm before clipping (mean over seeds)".into(),
            series: norm,
        },
    ])
}

/// The table of each iteration's own gain (its accuracy minus the previous one's, per seed; mean
/// ± standard error over the seeds that have both), which says whether gains continue.
fn step_gains(
    md: &mut String,
    arms: &[Arm],
    seeds: &[u64],
    iters: usize,
    accuracy: impl Fn(&str, u64, usize) -> Option<f64>,
) -> Result<()> {
    writeln!(md, "Gain of each iteration (its accuracy minus the previous one's, per seed):\n")?;
    let mut header = "| arm |".to_string();
    for i in 1..=iters {
        write!(header, " {} → {i} |", i - 1)?;
    }
    writeln!(md, "{header}\n|{}", "---|".repeat(iters + 1))?;
    for arm in arms {
        let mut line = format!("| {} |", arm.name);
        for i in 1..=iters {
            let d: Vec<f64> = seeds
                .iter()
                .filter_map(|&sd| Some(accuracy(&arm.name, sd, i)? - accuracy(&arm.name, sd, i - 1)?))
                .collect();
            write!(line, " {} |", fmt(mean_se(&d)))?;
        }
        writeln!(md, "{line}")?;
    }
    writeln!(md)?;
    Ok(())
}

/// `text` into `path`, atomically.
fn write_text(path: &Path, text: &str) -> Result<()> {
    use std::io::Write as _;
    crate::io::write_atomic(path, |w| Ok(w.write_all(text.as_bytes())?))
}

/// The seeds `0..n`.
pub fn seeds(n: usize) -> Vec<u64> {
    (0..n as u64).collect()
}

/// Where a seed's warm-up of `recipe` lives: the seed's folder for the demo's, a sub-folder
/// `natural/` for the natural task's.
pub fn warm_up_dir(seed_dir: &Path, recipe: Recipe) -> PathBuf {
    match recipe {
        Recipe::Sloppy => seed_dir.to_path_buf(),
        Recipe::Natural => seed_dir.join("natural"),
        Recipe::SloppyFresh => seed_dir.join("fresh"),
    }
}

/// Where the study of `work` keeps the stages of `seed`.
pub fn seed_dir(work: &Path, seed: u64) -> PathBuf {
    work.join(format!("seed-{seed}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_parse_and_share_the_topr_arm() {
        for c in Claim::ALL {
            assert_eq!(Claim::parse(c.name()), Some(c));
            assert_eq!(c.arms().is_empty(), c == Claim::Verifier);
        }
        assert_eq!(Claim::Negatives.arms()[0], Claim::Degeneration.arms()[0]);
        assert_eq!(Claim::parse("stability"), None);
    }

    #[test]
    fn composition_crosses_raw_shares_with_p_tildes() {
        let arms = Claim::Composition.arms();
        assert_eq!(arms.len(), COMPOSITION_RAW_SHARES.len() * COMPOSITION_P_TILDES.len());
        for raw in COMPOSITION_RAW_SHARES {
            for p in COMPOSITION_P_TILDES {
                let arm = arms.iter().find(|a| a.raw_share() == Some(raw) && a.p_tilde() == Some(p)).unwrap();
                assert_eq!(arm.name, format!("topr-p{p}-raw{raw}"));
            }
        }
        // Names are distinct, and none is the seed's shared folder.
        let all: Vec<Arm> = Claim::ALL.into_iter().flat_map(|c| c.arms()).collect();
        assert!(all.iter().all(|a| !["shared", "natural", "fresh"].contains(&a.name.as_str())));
        // The natural task's arms start from its own warm-up.
        let natural = Claim::Natural.arms();
        assert_eq!(natural.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["natural-topr-p0.5", "natural-sft"]);
        assert!(natural.iter().all(|a| a.recipe == Recipe::Natural));
        assert!(
            all.iter()
                .filter(|a| !a.name.starts_with("natural-") && !a.name.starts_with("fresh-"))
                .all(|a| a.recipe == Recipe::Sloppy)
        );
        assert!(all.iter().filter(|a| a.name.starts_with("fresh-")).all(|a| a.recipe == Recipe::SloppyFresh));
        let mut names: Vec<&str> = all.iter().map(|a| a.name.as_str()).collect();
        names.sort();
        names.dedup();
        for n in &names {
            let same: Vec<&Arm> = all.iter().filter(|a| a.name == *n).collect();
            // Arms of one name differ at most in their iterations (a loop may be continued).
            let settings = |a: &Arm| Arm { iterations: None, ..a.clone() };
            assert!(same.windows(2).all(|w| settings(w[0]) == settings(w[1])), "two different arms named {n}");
        }
    }

    #[test]
    fn the_iterated_claim_continues_the_demo_arm_for_its_own_iterations() {
        let arms = Claim::Iterated.arms();
        assert_eq!(arms.len(), 1);
        assert_eq!(arms[0].name, Claim::Negatives.arms()[0].name);
        assert_eq!(Claim::Iterated.iterations(2), ITERATED_ITERATIONS);
        assert_eq!(Claim::Negatives.iterations(2), 2);
        assert_eq!(Claim::Verifier.iterations(3), 3);
        // One data set sampled once: the off-policy and composition claims run one iteration.
        assert_eq!(Claim::OffPolicy.iterations(2), 1);
        assert_eq!(Claim::Composition.iterations(3), 1);
        let dir = Path::new("/nonexistent/seed-0");
        let it = arm_settings(dir, Scale::quick(), 0, &arms[0]).unwrap();
        assert_eq!(it.iterations, ITERATED_ITERATIONS);
        let neg = arm_settings(dir, Scale::quick(), 0, &Claim::Negatives.arms()[0]).unwrap();
        assert_eq!(neg.iterations, Scale::quick().iterations);
        // The same loop, but for its length: the iterated claim continues the negatives claim's run.
        assert_eq!(IterateSettings { iterations: 0, ..it }, IterateSettings { iterations: 0, ..neg });
    }

    #[test]
    fn the_off_policy_baseline_claim_holds_the_baseline_and_the_setting_equal() {
        let arms = Claim::OffPolicyBaseline.arms();
        assert_eq!(
            arms.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            ["topr-offpolicy", "tis-p0.5-offpolicy", "reinforce-p0.5-offpolicy"]
        );
        // Its TOPR arm is the off-policy claim's (run once for both).
        assert_eq!(arms[0], Claim::OffPolicy.arms()[0]);
        for a in &arms {
            assert_eq!(a.p_tilde(), Some(demo::DEMO_P_TILDE), "{}", a.name);
            assert_eq!(
                Arm { name: String::new(), objective: Objective::Topr, ..a.clone() },
                Arm { name: String::new(), ..arms[0].clone() }
            );
        }
        assert_eq!((arms[1].objective, arms[2].objective), (Objective::Tis, Objective::Reinforce));
        assert_eq!(Claim::OffPolicyBaseline.iterations(2), 1);
    }

    #[test]
    fn the_fresh_warm_up_takes_the_demo_warm_ups_steps_on_twice_the_problems() {
        let full = Scale::full();
        let (fresh, sloppy) = (Recipe::SloppyFresh, Recipe::Sloppy);
        assert_eq!((fresh.sft_problems(full), fresh.sft_epochs(full)), (8000, 2));
        assert_eq!((sloppy.sft_problems(full), sloppy.sft_epochs(full)), (4000, 4));
        assert_eq!(fresh.slip_rate(), sloppy.slip_rate());
        // One epoch stays one epoch (the quick scale), on as many problems.
        let quick = Scale::quick();
        assert_eq!((fresh.sft_problems(quick), fresh.sft_epochs(quick)), (quick.sft_problems, 1));
        let arms = Claim::WarmUpData.arms();
        assert_eq!(arms.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["topr-p0.5", "fresh-topr-p0.5"]);
        assert_eq!(
            Arm { name: String::new(), recipe: Recipe::Sloppy, ..arms[1].clone() },
            Arm { name: String::new(), ..arms[0].clone() }
        );
        let seed = Path::new("/s/seed-3");
        assert_eq!(warm_up_dir(seed, fresh), seed.join("fresh"));
    }

    #[test]
    fn the_learning_rate_claim_changes_only_the_rate_of_the_demo_arm() {
        let arms = Claim::LearningRate.arms();
        assert_eq!(
            arms.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            ["topr-p0.5", "topr-p0.5-lr0.00003", "topr-p0.5-lr0.0003", "topr-p0.5-lr0.001"]
        );
        assert_eq!(SAME_TIME_ITERATIONS, Scale::full().iterations);
        assert_eq!(Claim::LearningRate.iterations(2), Scale::full().iterations);
        let dir = Path::new("/nonexistent/seed-0");
        let demo = arm_settings(dir, Scale::full(), 0, &Claim::Negatives.arms()[0]).unwrap();
        for (arm, lr) in arms.iter().zip([demo::DEMO_LR, 3e-5, 3e-4, 1e-3]) {
            let it = arm_settings(dir, Scale::full(), 0, arm).unwrap();
            assert_eq!(it.train.lr, lr);
            // The same loop but for the rate, the folder and the length.
            let same = |s: &IterateSettings| IterateSettings {
                iterations: 0,
                work: PathBuf::new(),
                train: TrainSettings { lr: 0.0, ..s.train.clone() },
                ..s.clone()
            };
            assert_eq!(same(&it), same(&demo));
        }
    }

    #[test]
    fn sampled_rows_count_correct_samples_per_question() {
        let dir = std::env::temp_dir().join(format!("study_sampled_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let q = |id: &str, answers: [Option<f64>; 2]| crate::eval::QuestionResult {
            id: id.into(),
            question: String::new(),
            reference: 3.0,
            greedy_completion: String::new(),
            greedy_answer: None,
            greedy_correct: false,
            greedy_invalid: true,
            greedy_tokens: 0,
            sample_correct: answers.iter().map(|a| *a == Some(3.0)).collect(),
            sample_answers: answers.to_vec(),
        };
        // Two samples each: both right; one right, one invalid; both wrong with the same answer.
        let lines: String = [q("a", [Some(3.0), Some(3.0)]), q("b", [Some(3.0), None]), q("c", [Some(4.0), Some(4.0)])]
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        let file = dir.join("q.jsonl");
        std::fs::write(&file, lines).unwrap();
        let r = SampledRow::read(Claim::Negatives, "sft", 3, 2, 2, &file).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(r.pass1_sampled, 0.5), "{r:?}"); // (1 + 0.5 + 0) / 3
        assert!(close(r.maj_at_k, 2.0 / 3.0), "{r:?}"); // a and b (b's only valid answer is right)
        assert!(close(r.pass_at_k, 2.0 / 3.0), "{r:?}");
        assert!(close(r.invalid_sampled, 1.0 / 6.0), "{r:?}");
        assert!(close(r.none_correct, 1.0 / 3.0), "{r:?}");
        assert!(close(r.at_most_one_correct, 2.0 / 3.0), "{r:?}");
        assert_eq!((r.questions, r.k, r.seed, r.iteration), (3, 2, 3, 2));
        // A file of another k is refused.
        assert!(SampledRow::read(Claim::Negatives, "sft", 3, 2, 8, &file).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn training_panels_average_finished_seeds_per_step() {
        let work = std::env::temp_dir().join(format!("study_training_{}", std::process::id()));
        let arm = &Claim::OffPolicy.arms()[0];
        let step = |step: usize, log_ratio: f64, grad_norm: f64| crate::metrics::StepRecord {
            baseline: 0.0,
            epoch: 0,
            grad_norm,
            lr: 1e-4,
            p_tilde: None,
            stats: crate::metrics::StepStats { log_ratio_mean: log_ratio, ..Default::default() },
            step,
        };
        // Seeds 0 and 1 finished, seed 2 unfinished (ignored).
        for (seed, rows, done) in [
            (0, vec![step(1, 0.0, 1.0), step(2, -1.0, 100.0)], true),
            (1, vec![step(1, 0.0, 10.0), step(2, -3.0, 1000.0)], true),
            (2, vec![step(1, -50.0, 1e9)], false),
        ] {
            let dir = seed_dir(&work, seed).join(&arm.name).join("iter-1");
            std::fs::create_dir_all(&dir).unwrap();
            let text: String = rows.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
            std::fs::write(dir.join("metrics.jsonl"), text).unwrap();
            if done {
                std::fs::write(dir.join("train.done.json"), "{}").unwrap();
            }
        }
        let s = StudySettings {
            work: work.clone(),
            claims: vec![Claim::OffPolicy],
            seeds: seeds(3),
            scale: Scale::quick(),
            at: Placement::f32(tch::Device::Cpu),
        };
        let panels = training_panels(&s, std::slice::from_ref(arm)).unwrap();
        assert_eq!(panels[0].series[0].points, vec![(1.0, 0.0), (2.0, -2.0)]);
        assert_eq!(panels[1].series[0].points, vec![(1.0, 0.5), (2.0, 2.5)]);
        std::fs::remove_dir_all(&work).unwrap();
    }

    #[test]
    fn step_gains_are_paired_differences_over_the_seeds_that_have_both() {
        let arms = vec![Arm::topr(0.5)];
        // seed 0: 0.1, 0.2, 0.4; seed 1: 0.1, 0.3 (iteration 2 missing).
        let acc = |_: &str, seed: u64, i: usize| match (seed, i) {
            (0, 0) | (1, 0) => Some(0.1),
            (0, 1) => Some(0.2),
            (0, 2) => Some(0.4),
            (1, 1) => Some(0.3),
            _ => None,
        };
        let mut md = String::new();
        step_gains(&mut md, &arms, &[0, 1], 2, acc).unwrap();
        // 0 → 1: mean of 0.1 and 0.2 with SE 0.05; 1 → 2: seed 0 only.
        assert!(md.contains("| topr-p0.5 | 0.150 ± 0.050 | 0.200 (one seed) |"), "{md}");
        assert!(md.contains("| arm | 0 → 1 | 1 → 2 |"), "{md}");
    }
}
