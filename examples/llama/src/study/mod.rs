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
//!
//! The study is three rooms: [`claims`] (what is tested: the claims and their arms), this
//! module (running them: the seeds' stages and the arms' loops) and [`mod@report`] (the tables and
//! plots, from the records of what ran).

pub mod claims;
pub mod report;

pub use claims::{
    Arm, COMPOSITION_P_TILDES, COMPOSITION_RAW_SHARES, Claim, ITERATED_ITERATIONS, LEARNING_RATES,
    SAME_TIME_ITERATIONS, SAMPLED_K,
};
pub use report::{SampledRow, StudyRow, VerifierRow, report, rows, sampled_rows, verifier_rows};

use crate::checkpoint::Placement;
use crate::demo::{self, Recipe, Scale};
use crate::iterate;
use crate::layout::{SeedDir, StudyDir};
use crate::settings::{IterateSettings, TrainSettings};
use crate::verify::{self, VerifySettings};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// What a study runs.
#[derive(Debug, Clone)]
pub struct StudySettings {
    pub work: PathBuf,
    pub claims: Vec<Claim>,
    pub seeds: Vec<u64>,
    pub scale: Scale,
    pub at: Placement,
    /// The real model the real-model claims ([`Claim::REAL`]) start from (SmolLM2-135M-Instruct:
    /// `scripts/smollm2.sh` builds it); `None` when the study has none of them.
    pub model: Option<PathBuf>,
}

/// What every run of a study is made with, recorded in `study.json` when it starts: a continued
/// study must match it (claims and seeds may be added), and `--report-only` reads its labels
/// from it rather than from the command line.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StudyRecord {
    /// The demo model's sizes (the real-model claims have their own, [`Scale::real`]).
    pub scale: Scale,
    pub numerics: crate::identity::Numerics,
    /// The real model's directory, if the study has real-model claims.
    pub model: Option<PathBuf>,
}

impl StudyRecord {
    pub fn of(s: &StudySettings) -> Self {
        Self { scale: s.scale, numerics: crate::identity::Numerics::of(s.at), model: s.model.clone() }
    }

    /// The record in `work`, if the study there has one (versions before 2026-12-02 wrote none).
    pub fn read(work: &Path) -> Result<Option<Self>> {
        let file = StudyDir::new(work).record();
        if !file.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        Ok(Some(serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))?))
    }
}

/// Runs (or continues) the study; rewrites its tables and plots after every arm.
pub fn run(s: &StudySettings) -> Result<()> {
    check(s, true)?;
    std::fs::create_dir_all(&s.work).with_context(|| format!("creating {}", s.work.display()))?;
    let _lock = crate::io::Lock::dir(&s.work)?;
    let record = StudyRecord::of(s);
    let file = StudyDir::new(&s.work).record();
    match file.exists() {
        true => {
            crate::stage::check(&crate::stage::read_record(&file)?, &record, &[], &s.work, crate::Resumable::Study)?
        }
        false => crate::stage::write_record(&file, &record)?,
    }
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
        let warm = |recipe: Recipe| match (recipe, &s.model) {
            (Recipe::Real, Some(model)) => Ok(model.clone()),
            _ => demo::warm_up_with(&warm_up_dir(&dir, recipe), s.scale, seed, s.at, recipe),
        };
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
    eprintln!("[study {:.0} s] done: {}", t0.elapsed().as_secs_f64(), StudyDir::new(&s.work).report().display());
    Ok(())
}

/// Refuses a study whose real-model claims have no model, or whose model is given without any
/// of them or (with `weights`: to run, not only to report) holds no model ([`run`] checks it
/// first, with `weights`).
pub fn check(s: &StudySettings, weights: bool) -> Result<()> {
    let real = s.claims.iter().any(|c| c.is_real());
    match (&s.model, real) {
        (None, true) => anyhow::bail!(
            "the real-model claims need the model they start from (SmolLM2-135M-Instruct: scripts/smollm2.sh builds models/smollm2-135m-instruct)"
        ),
        (Some(m), false) => anyhow::bail!("a model ({}) is given, but no real-model claim uses it", m.display()),
        (Some(m), true) if weights && !m.join("config.json").exists() => {
            anyhow::bail!("{} holds no model (no config.json)", m.display())
        }
        _ => Ok(()),
    }
}

/// The `iterate` settings of `arm` for `seed`: the demo's TOPR iterations with the arm's
/// objective and baseline (for a real-model arm, with the real model's sizes and batches).
fn arm_settings(dir: &SeedDir, scale: Scale, seed: u64, arm: &Arm) -> Result<IterateSettings> {
    if arm.recipe == Recipe::Real {
        return real_arm_settings(dir, seed, arm);
    }
    let train = arm_train(arm, seed)?;
    // Every arm of a seed starts from its warm-up with the same questions and sampling: the
    // initial evaluation and the first data set are made once, in `shared`.
    Ok(IterateSettings {
        curate: arm.curate,
        iterations: arm.iterations(scale.iterations),
        shared: Some(dir.shared()),
        ..demo::iterate_settings(dir.arm(&arm.name).path().to_path_buf(), scale, seed, train)
    })
}

/// The demo's TOPR training with the arm's objective, baseline, epochs, clipping and learning
/// rate, seeded `seed`.
fn arm_train(arm: &Arm, seed: u64) -> Result<TrainSettings> {
    Ok(TrainSettings {
        objective: arm.objective,
        baseline: arm.baseline,
        epochs: arm.epochs,
        max_grad_norm: arm.max_grad_norm,
        lr: arm.lr,
        seed,
        ..demo::topr_settings()?
    })
}

/// A real-model arm's `iterate` settings: the sizes of [`Scale::real`], batches of 16 completions
/// in micro-batches of 8, the arm's learning rate ([`claims::REAL_LR`]), 32 prompts a generation
/// batch (128 completions in flight) and 128 completions in flight in an evaluation.
fn real_arm_settings(dir: &SeedDir, seed: u64, arm: &Arm) -> Result<IterateSettings> {
    let scale = Scale::real();
    let train = TrainSettings { batch_size: 16, micro_batch_size: 8, ..arm_train(arm, seed)? };
    Ok(IterateSettings {
        curate: arm.curate,
        iterations: arm.iterations(scale.iterations),
        shared: Some(dir.shared()),
        batch_prompts: 32,
        eval_batch_size: 128,
        ..demo::iterate_settings(dir.arm(&arm.name).path().to_path_buf(), scale, seed, train)
    })
}

/// The verifier's pipeline for `seed`, from the warm model: the demo's training questions and
/// sampling, k = 4 solutions a question, two rounds of the judge's TOPR training (the demo's TOPR
/// settings), the arms' held-out questions.
pub fn verifier_settings(dir: &SeedDir, scale: Scale, seed: u64) -> Result<VerifySettings> {
    let it = demo::iterate_settings(dir.verifier(), scale, seed, demo::topr_settings()?);
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
        work: dir.verifier(),
    })
}

/// The seeds `0..n`.
pub fn seeds(n: usize) -> Vec<u64> {
    (0..n as u64).collect()
}

/// Where a seed's warm-up of `recipe` lives: the seed's folder for the demo's, a sub-folder
/// `natural/` for the natural task's.
pub fn warm_up_dir(seed_dir: &SeedDir, recipe: Recipe) -> PathBuf {
    match recipe {
        Recipe::Sloppy => seed_dir.path().to_path_buf(),
        Recipe::Natural => seed_dir.natural(),
        Recipe::SloppyFresh => seed_dir.fresh(),
        // Not made by the study: the study's model (see `run`).
        Recipe::Real => seed_dir.path().to_path_buf(),
    }
}

/// Where the study of `work` keeps the stages of `seed`.
pub fn seed_dir(work: &Path, seed: u64) -> SeedDir {
    StudyDir::new(work).seed(seed)
}

#[cfg(test)]
mod tests {
    use super::report::{step_gains, training_panels};
    use super::*;
    use crate::settings::Objective;
    use claims::REAL_P_TILDES;

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
        assert!(all.iter().all(|a| !SeedDir::RESERVED.contains(&a.name.as_str())));
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
        let dir = &SeedDir::new("/nonexistent/seed-0");
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
        assert_eq!(warm_up_dir(&SeedDir::new(seed), fresh), seed.join("fresh"));
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
        let dir = &SeedDir::new("/nonexistent/seed-0");
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
        // Two samples each: both right; one right, one invalid; both wrong with the same answer;
        // a tie between a right and a wrong answer, in either order.
        let lines: String = [
            q("a", [Some(3.0), Some(3.0)]),
            q("b", [Some(3.0), None]),
            q("c", [Some(4.0), Some(4.0)]),
            q("d", [Some(3.0), Some(4.0)]),
            q("e", [Some(4.0), Some(3.0)]),
        ]
        .iter()
        .map(|r| serde_json::to_string(r).unwrap() + "\n")
        .collect();
        let file = dir.join("q.jsonl");
        std::fs::write(&file, lines).unwrap();
        let r = SampledRow::read(Claim::Negatives, "sft", 3, 2, 2, &file).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(r.pass1_sampled, 0.5), "{r:?}"); // (1 + 0.5 + 0 + 0.5 + 0.5) / 5
        // a and b (b's only valid answer is right), half of d and of e whatever the order
        assert!(close(r.maj_at_k, 3.0 / 5.0), "{r:?}");
        assert!(close(r.pass_at_k, 4.0 / 5.0), "{r:?}");
        assert!(close(r.invalid_sampled, 0.5 / 5.0), "{r:?}");
        assert!(close(r.none_correct, 1.0 / 5.0), "{r:?}");
        assert!(close(r.at_most_one_correct, 4.0 / 5.0), "{r:?}");
        assert_eq!((r.questions, r.k, r.seed, r.iteration), (5, 2, 3, 2));
        assert_eq!(r.by_question[3], ("d".to_string(), [0.5, 0.5, 1.0, 0.0, 0.0, 1.0]));
        // An empty file is refused, naming it, rather than read as a row of zeros.
        let empty = dir.join("empty.jsonl");
        std::fs::write(&empty, "").unwrap();
        let msg = format!("{:#}", SampledRow::read(Claim::Negatives, "sft", 3, 2, 2, &empty).unwrap_err());
        assert!(msg.contains("empty.jsonl: no questions"), "{msg}");
        // A file of another k is refused.
        assert!(SampledRow::read(Claim::Negatives, "sft", 3, 2, 8, &file).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The sampled table pairs two arms' questions by id, whatever order their files list them
    /// in, besides pairing the seeds' means.
    #[test]
    fn sampled_differences_pair_questions_by_id_and_seeds_by_seed() {
        let c = Claim::RealNegatives;
        let arms = c.arms();
        let s = StudySettings {
            work: std::env::temp_dir(),
            claims: vec![c],
            seeds: seeds(2),
            scale: Scale::quick(),
            at: Placement::f32(tch::Device::Cpu),
            model: None,
        };
        let last = c.iterations(s.scale.iterations);
        // Per question: pass@1 sampled only (the other measures 0); the second arm 0.25 above the
        // first on question "x" and 0.75 on "y", listed in the other order.
        let row = |arm: &str, seed: u64, qs: &[(&str, f64)]| {
            let by_question: Vec<(String, [f64; 6])> =
                qs.iter().map(|(id, v)| (id.to_string(), [*v, 0.0, 0.0, 0.0, 0.0, 0.0])).collect();
            let mean = qs.iter().map(|q| q.1).sum::<f64>() / qs.len() as f64;
            SampledRow {
                claim: c,
                arm: arm.into(),
                seed,
                iteration: last,
                k: 4,
                pass1_sampled: mean,
                maj_at_k: 0.0,
                pass_at_k: 0.0,
                invalid_sampled: 0.0,
                none_correct: 0.0,
                at_most_one_correct: 0.0,
                questions: qs.len(),
                by_question,
            }
        };
        let (a, b) = (&arms[0].name, &arms[1].name);
        let rows = vec![
            row(a, 0, &[("x", 0.0), ("y", 0.25)]),
            row(b, 0, &[("y", 1.0), ("x", 0.25)]),
            row(a, 1, &[("x", 0.5), ("y", 0.5)]),
            row(b, 1, &[("x", 0.75), ("y", 0.5)]),
        ];
        let mut md = String::new();
        report::sampled_section(&mut md, c, &rows, &s).unwrap();
        // By seed: 0.5 and 0.125, mean 0.3125, SE 0.1875. By question: 0.25, 0.75, 0.25, 0,
        // mean 0.3125, SE sqrt(0.0989583 / 4) = 0.157.
        assert!(md.contains(&format!("| {b} − {a}, paired by seed | 2 | 0.312 ± 0.188 |")), "{md}");
        assert!(md.contains(&format!("| {b} − {a}, paired by question | 2 | 0.312 ± 0.157 |")), "{md}");
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
            let dir = seed_dir(&work, seed).arm(&arm.name).iteration(1).path().to_path_buf();
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
            model: None,
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

    #[test]
    fn the_real_model_claims_train_from_the_model_on_one_shared_data_set() {
        let neg = Claim::RealNegatives.arms();
        assert_eq!(
            neg.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            ["real-topr-p0.5", "real-sft", "real-reinforce", "real-tis-p0.5"]
        );
        assert_eq!((neg[3].objective, neg[3].p_tilde()), (Objective::Tis, Some(0.5)));
        let comp = Claim::RealComposition.arms();
        assert_eq!(comp.iter().map(|a| a.p_tilde().unwrap()).collect::<Vec<_>>(), REAL_P_TILDES);
        // Its p̃ = 0.5 arm is the negatives claim's TOPR arm; the iterated claim continues it.
        assert_eq!(comp[0], neg[0]);
        let it = &Claim::RealIterated.arms()[0];
        assert_eq!((it.name.as_str(), it.iterations), ("real-topr-p0.5", Some(claims::REAL_ITERATIONS)));
        assert_eq!(Claim::RealNegatives.iterations(3), 1);
        assert_eq!(Claim::RealIterated.iterations(3), claims::REAL_ITERATIONS);
        let dir = &SeedDir::new("/nonexistent/seed-2");
        for a in neg.iter().chain(&comp) {
            assert_eq!((a.recipe, a.lr), (Recipe::Real, claims::REAL_LR), "{}", a.name);
            let s = arm_settings(dir, Scale::full(), 2, a).unwrap();
            // SmolLM2's single run: 256 questions × 4 samples, 128 tokens, batches of 16, lr 2e-5.
            assert_eq!(s.task.source, crate::task::Source::Synthetic { n: 256, difficulty: 1 });
            assert_eq!((s.samples_per_prompt, s.sampling.max_new_tokens, s.eval_n), (4, 128, 256));
            assert_eq!((s.train.batch_size, s.train.micro_batch_size, s.train.lr, s.train.seed), (16, 8, 2e-5, 2));
            // The arms of a seed share its first data set (one folder, the same loop but for
            // the objective, baseline and folder).
            assert_eq!(s.shared, Some(dir.shared()));
            let same = |x: &IterateSettings| IterateSettings {
                work: PathBuf::new(),
                train: TrainSettings { objective: Objective::Topr, baseline: Default::default(), ..x.train.clone() },
                ..x.clone()
            };
            assert_eq!(same(&s), same(&arm_settings(dir, Scale::full(), 2, &neg[0]).unwrap()));
        }
        for c in Claim::REAL {
            assert_eq!(Claim::parse(c.name()), Some(c));
            assert!(c.is_real() && !Claim::ALL.contains(&c));
            assert_eq!(c.eval_n(Scale::quick()), Scale::real().eval_n);
        }
    }

    #[test]
    fn a_real_model_claim_needs_its_model_and_a_model_needs_such_a_claim() {
        let s = |claims: Vec<Claim>, model: Option<PathBuf>| StudySettings {
            work: PathBuf::from("/nonexistent/study"),
            claims,
            seeds: seeds(1),
            scale: Scale::quick(),
            at: Placement::f32(tch::Device::Cpu),
            model,
        };
        for weights in [true, false] {
            let err = check(&s(vec![Claim::RealNegatives], None), weights).unwrap_err().to_string();
            assert!(err.contains("scripts/smollm2.sh"), "{err}");
            let err = check(&s(vec![Claim::Negatives], Some("/m".into())), weights).unwrap_err().to_string();
            assert!(err.contains("no real-model claim"), "{err}");
            check(&s(vec![Claim::Negatives], None), weights).unwrap();
        }
        let err = check(&s(vec![Claim::RealIterated], Some("/nonexistent/m".into())), true).unwrap_err().to_string();
        assert!(err.contains("no config.json"), "{err}");
        // Reporting reads only the records: the weights need not be there.
        check(&s(vec![Claim::RealIterated], Some("/nonexistent/m".into())), false).unwrap();
    }
}
