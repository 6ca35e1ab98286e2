//! The study's catalogue: the paper's claims ([`Claim`]) and the arms that test each one
//! ([`Arm`]: an objective, its baseline, and what else differs from the demo's TOPR iterations).

use crate::demo::{self, Recipe, Scale};
use crate::settings::{Baseline, Curation, Objective};

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
    /// A better result in the same time: the demo's TOPR iterations at other
    /// learning rates ([`LEARNING_RATES`]), the same steps, data and wall time, for the demo's
    /// [`SAME_TIME_ITERATIONS`] iterations.
    LearningRate,
    /// A better result in the same time: the same warm-up steps on twice the
    /// problems for half the epochs ([`Recipe::SloppyFresh`]), then the demo's TOPR iterations.
    WarmUpData,
    /// On a real model (the study's `model`, SmolLM2-135M-Instruct: [`Recipe::Real`]), where the
    /// data are almost all negative: TOPR (p̃ = 0.5) against SFT on the positives, naive REINFORCE
    /// and TIS with TOPR's baseline, on the same data set.
    RealNegatives,
    /// The composition claim on the real model: TOPR with p̃ ∈ [`REAL_P_TILDES`] on the same data
    /// sets (a raw share of positives near 2 %): does the paper's optimum near 10–20 % appear?
    RealComposition,
    /// The real model's TOPR arm continued for [`REAL_ITERATIONS`] iterations, μ refreshed.
    RealIterated,
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

    /// The claims on a real model (the study's `model`), apart from [`Claim::ALL`], the demo
    /// model's: `--claims all` is the demo model's.
    pub const REAL: [Claim; 3] = [Claim::RealNegatives, Claim::RealComposition, Claim::RealIterated];

    /// Whether its arms start from the study's real model.
    pub fn is_real(self) -> bool {
        Self::REAL.contains(&self)
    }

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
            Self::RealNegatives => "real-negatives",
            Self::RealComposition => "real-composition",
            Self::RealIterated => "real-iterated",
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
            Self::RealNegatives => {
                "On a real model (SmolLM2-135M-Instruct) with almost all samples negative: do negatives help? TOPR (p̃ = 0.5) against SFT on the positives, naive REINFORCE and TIS with TOPR's baseline, on the same data."
            }
            Self::RealComposition => {
                "On the real model: how does accuracy depend on p̃ when the raw share of positives is about 2 %?"
            }
            Self::RealIterated => "On the real model: do TOPR's gains continue over a second iteration (μ refreshed)?",
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
            Self::RealNegatives | Self::RealComposition | Self::RealIterated => self.real_arms(),
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

    /// The real-model claims' arms: the demo's arms from the real model ([`Recipe::Real`]) at
    /// [`REAL_LR`], one iteration unless the claim fixes more (the study's `--iterations` is the
    /// demo model's), named `real-…`.
    fn real_arms(self) -> Vec<Arm> {
        let real = |a: Arm| Arm {
            name: format!("real-{}", a.name),
            recipe: Recipe::Real,
            lr: REAL_LR,
            iterations: Some(a.iterations.unwrap_or(1)),
            ..a
        };
        let topr = Arm::topr(demo::DEMO_P_TILDE);
        match self {
            Self::RealNegatives => vec![
                real(topr.clone()),
                real(Arm::new("sft", Objective::Sft, Baseline::Zero)),
                real(Arm::new("reinforce", Objective::Reinforce, Baseline::Zero)),
                real(Arm::new("tis-p0.5", Objective::Tis, topr.baseline)),
            ],
            Self::RealComposition => REAL_P_TILDES.into_iter().map(|p| real(Arm::topr(p))).collect(),
            Self::RealIterated => vec![real(Arm { iterations: Some(REAL_ITERATIONS), ..topr })],
            _ => vec![],
        }
    }

    /// The samples a question of its sampled evaluation (sampled pass@1, maj@k, pass@k, and the
    /// share of questions with no or one correct sample), made for the initial model and each
    /// arm's last iteration; `None`: greedy pass@1 only.
    pub fn sampled_k(self) -> Option<usize> {
        match self {
            Self::Negatives | Self::Natural => Some(SAMPLED_K),
            Self::RealNegatives => Some(REAL_SAMPLED_K),
            _ => None,
        }
    }

    /// The iterations its table shows: the most of its arms', where `study` is the study's
    /// `--iterations` (the arms that do not fix their own).
    pub fn iterations(self, study: usize) -> usize {
        self.arms().iter().map(|a| a.iterations(study)).max().unwrap_or(study)
    }

    /// Held-out questions a seed: the real model's ([`Scale::real`]) or the study's `scale`'s.
    pub fn eval_n(self, scale: Scale) -> usize {
        if self.is_real() { Scale::real().eval_n } else { scale.eval_n }
    }

    /// Parses a claim's name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().chain(Self::REAL).find(|c| c.name() == s)
    }
}

/// The real-model composition claim's effective proportions of positives p̃, the default 0.5
/// first: the reference its tables compare every other p̃ with (does 0.1 or 0.2 beat it, as the
/// paper's optimum near 10–20 % would?).
pub const REAL_P_TILDES: [f64; 4] = [0.5, 0.05, 0.1, 0.2];
/// The real-model iterated claim's iterations.
pub const REAL_ITERATIONS: usize = 2;
/// The learning rate of the real model's arms (SmolLM2's single run: AdamW 2e-5).
pub const REAL_LR: f64 = 2e-5;

/// The composition claim's raw shares of positives (each data set subsampled to it, as in the
/// paper's 10 % and 50 % data sets).
pub const COMPOSITION_RAW_SHARES: [f64; 2] = [0.1, 0.5];

/// The composition claim's effective proportions of positives p̃ (its arms' baselines).
pub const COMPOSITION_P_TILDES: [f64; 4] = [0.05, 0.2, 0.5, 0.9];

/// Samples a question in the sampled evaluation of the claims that report pass@k
/// ([`Claim::sampled_k`]).
pub const SAMPLED_K: usize = 8;

/// Samples a question in the real-model negatives claim's sampled evaluation: 4 (1,024
/// completions of up to 128 tokens for 256 questions, about as many as an arm's training data)
/// keeps the initial model and each of its four arms within a quarter of a seed's time on 2
/// cores.
pub const REAL_SAMPLED_K: usize = 4;

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

    pub(super) fn new(name: &str, objective: Objective, baseline: Baseline) -> Self {
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
    pub(super) fn off_policy(name: &str, objective: Objective, baseline: Baseline) -> Self {
        Self {
            epochs: 4,
            max_grad_norm: Some(100.0),
            iterations: Some(1),
            ..Self::new(&format!("{name}-offpolicy"), objective, baseline)
        }
    }

    /// TOPR with the baseline that gives positives the share `p̃` of the weight.
    pub(super) fn topr(p_tilde: f64) -> Self {
        Self::new(&format!("topr-p{p_tilde}"), Objective::Topr, Baseline::TargetPositiveProportion(p_tilde))
    }
}
