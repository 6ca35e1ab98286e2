//! Where a work directory keeps what: every file and folder name of `iterate`'s, `train`'s,
//! `compare`'s, the verifier's and the study's work directories is spelled here, once, and every
//! command that writes or reads them (iterate, compare, study, plot, verify, the CLI) asks these
//! types for the path.
//!
//! ```text
//! LOOP/                      an `iterate` work directory (LoopDir)
//!   settings.json            the loop's record: initial model and settings
//!   eval-initial.json        the initial model's held-out summary (+ .questions.jsonl beside it)
//!   eval-initial-kK.json     its sampled evaluation with K samples a question
//!   iterations.jsonl         one row per evaluated iteration; iterations.png its plot
//!   iter-I/                  one iteration (IterationDir): data.jsonl (+ .run.json), model/,
//!                            metrics.jsonl, train.done.json, eval.json, eval-kK.json
//!   compare-iter-I/ARM/      `compare`'s arms, each a training directory with eval.json
//! TRAIN/                     a training directory: metrics.jsonl, training.png, state/,
//!                            train.done.json when it is a stage of another command
//! DEMO/                      the demo (DemoDir): warm-up.json (the warm-up's record), init/,
//!                            sft.jsonl, warm-up/, topr/ (a LOOP)
//! VERIFY/                    the verifier (VerifyDir): solutions.jsonl, heldout-solutions.jsonl,
//!                            judge-train.jsonl, judge-heldout.jsonl, verifier/round-R/ (a
//!                            training stage with data.jsonl and model/), verify.jsonl, verify.json
//! STUDY/                     a study (StudyDir): study.jsonl, study-sampled.jsonl, study.md,
//!                            verifier.jsonl, claim-NAME.png
//!   seed-S/                  a seed: the demo's warm-up stages (a DEMO without topr/), shared/,
//!                            one LOOP per arm, natural/ and fresh/ (other warm-ups), verifier/
//! ```

use std::path::{Path, PathBuf};

/// The done marker of a finished training stage in `dir` (its summary).
pub fn done_file(dir: &Path) -> PathBuf {
    dir.join("train.done.json")
}

/// The per-step metrics of a training directory.
pub fn metrics_file(dir: &Path) -> PathBuf {
    dir.join("metrics.jsonl")
}

/// The training plot of a training directory.
pub fn training_plot(dir: &Path) -> PathBuf {
    dir.join("training.png")
}

/// The per-question results written beside an evaluation's summary `summary`.
pub fn questions_file(summary: &Path) -> PathBuf {
    summary.with_extension("questions.jsonl")
}

/// An `iterate` work directory.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopDir(PathBuf);

impl LoopDir {
    pub fn new(work: impl Into<PathBuf>) -> Self {
        Self(work.into())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The loop's record (initial model and settings).
    pub fn settings(&self) -> PathBuf {
        self.0.join("settings.json")
    }

    /// The initial model's held-out summary.
    pub fn initial_eval(&self) -> PathBuf {
        self.0.join("eval-initial.json")
    }

    /// One row per evaluated iteration.
    pub fn table(&self) -> PathBuf {
        self.0.join("iterations.jsonl")
    }

    /// The plot of the table.
    pub fn plot(&self) -> PathBuf {
        self.0.join("iterations.png")
    }

    /// Iteration `i` (1-based).
    pub fn iteration(&self, i: usize) -> IterationDir {
        IterationDir(self.0.join(format!("iter-{i}")))
    }

    /// Whether a loop has started here (its initial evaluation or first iteration exists).
    pub fn started(&self) -> bool {
        self.initial_eval().exists() || self.iteration(1).path().exists()
    }

    /// The held-out evaluation at `iteration` (0: the initial model) with `k` samples a
    /// question.
    pub fn sampled_eval(&self, iteration: usize, k: usize) -> PathBuf {
        match iteration {
            0 => self.0.join(format!("eval-initial-k{k}.json")),
            i => self.iteration(i).sampled_eval(k),
        }
    }

    /// `compare`'s folder for iteration `i`.
    pub fn compare(&self, i: usize) -> PathBuf {
        self.0.join(format!("compare-iter-{i}"))
    }
}

/// One iteration of a loop.
#[derive(Debug, Clone, PartialEq)]
pub struct IterationDir(PathBuf);

impl IterationDir {
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The data set sampled from μ (its run record beside it).
    pub fn data(&self) -> PathBuf {
        self.0.join("data.jsonl")
    }

    /// The model trained on it.
    pub fn model(&self) -> PathBuf {
        self.0.join("model")
    }

    /// The training's done marker.
    pub fn done(&self) -> PathBuf {
        done_file(&self.0)
    }

    /// Whether the training finished.
    pub fn trained(&self) -> bool {
        self.done().exists()
    }

    /// The done marker of a training being made again from its records (see `iterate`): the
    /// recorded summary it must reproduce, kept until it has.
    pub fn recorded(&self) -> PathBuf {
        self.0.join("train.done.recorded.json")
    }

    /// Whether the trained model is on disk (a work directory restored from its records has
    /// the done marker and the evaluation, not the weights).
    pub fn has_model(&self) -> bool {
        crate::io::holds_model(&self.model())
    }

    /// Whether the iteration is finished: trained and evaluated.
    pub fn finished(&self) -> bool {
        self.trained() && self.eval().exists()
    }

    /// The training's per-step metrics.
    pub fn metrics(&self) -> PathBuf {
        metrics_file(&self.0)
    }

    /// The trained model's held-out summary.
    pub fn eval(&self) -> PathBuf {
        self.0.join("eval.json")
    }

    /// Its sampled evaluation with `k` samples a question.
    pub fn sampled_eval(&self, k: usize) -> PathBuf {
        self.0.join(format!("eval-k{k}.json"))
    }
}

/// The folder shared by loops from one initial model: the first iteration's data set.
pub fn shared_first_data(shared: &Path) -> PathBuf {
    shared.join("iter-1-data.jsonl")
}

/// The demo's work directory (and each study seed's warm-up stages).
#[derive(Debug, Clone, PartialEq)]
pub struct DemoDir(PathBuf);

impl DemoDir {
    pub fn new(work: impl Into<PathBuf>) -> Self {
        Self(work.into())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The model made from scratch.
    pub fn init(&self) -> PathBuf {
        self.0.join("init")
    }

    /// The teacher's worked solutions.
    pub fn sft_data(&self) -> PathBuf {
        self.0.join("sft.jsonl")
    }

    /// The supervised warm-up (a training directory holding the warm model).
    pub fn warm_up(&self) -> PathBuf {
        self.0.join("warm-up")
    }

    /// The record of what the three warm-up stages are made from.
    pub fn warm_up_record(&self) -> PathBuf {
        self.0.join("warm-up.json")
    }

    /// The TOPR iterations.
    pub fn topr(&self) -> LoopDir {
        LoopDir::new(self.0.join("topr"))
    }
}

/// The verifier's work directory.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyDir(PathBuf);

impl VerifyDir {
    pub fn new(work: impl Into<PathBuf>) -> Self {
        Self(work.into())
    }

    /// The solver's solutions of the judge's training problems and of the held-out ones.
    pub fn solutions(&self) -> (PathBuf, PathBuf) {
        (self.0.join("solutions.jsonl"), self.0.join("heldout-solutions.jsonl"))
    }

    /// The judge's problems made of them: training and held-out.
    pub fn judge_problems(&self) -> (PathBuf, PathBuf) {
        (self.0.join("judge-train.jsonl"), self.0.join("judge-heldout.jsonl"))
    }

    /// Round `r` of the judge's training (a training stage: data.jsonl, model/, done marker).
    pub fn round(&self, r: usize) -> PathBuf {
        self.0.join("verifier").join(format!("round-{r}"))
    }

    /// One line per held-out question.
    pub fn questions(&self) -> PathBuf {
        self.0.join("verify.jsonl")
    }

    /// The summary.
    pub fn summary(&self) -> PathBuf {
        self.0.join("verify.json")
    }
}

/// A study's work directory.
#[derive(Debug, Clone, PartialEq)]
pub struct StudyDir(PathBuf);

impl StudyDir {
    pub fn new(work: impl Into<PathBuf>) -> Self {
        Self(work.into())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Where the stages of `seed` live.
    pub fn seed(&self, seed: u64) -> SeedDir {
        SeedDir(self.0.join(format!("seed-{seed}")))
    }

    /// The loop of `arm` for `seed`.
    pub fn arm(&self, seed: u64, arm: &str) -> LoopDir {
        self.seed(seed).arm(arm)
    }

    /// The verifier's work directory for `seed`.
    pub fn verifier_dir(&self, seed: u64) -> VerifyDir {
        VerifyDir::new(self.seed(seed).verifier())
    }

    /// The record of what the study's runs are made with (`study.json`: sizes, numerics).
    pub fn record(&self) -> PathBuf {
        self.0.join("study.json")
    }

    /// One row per claim, arm, seed and iteration.
    pub fn table(&self) -> PathBuf {
        self.0.join("study.jsonl")
    }

    /// The sampled evaluations' rows.
    pub fn sampled_table(&self) -> PathBuf {
        self.0.join("study-sampled.jsonl")
    }

    /// The verifier's rows.
    pub fn verifier_table(&self) -> PathBuf {
        self.0.join("verifier.jsonl")
    }

    /// The report.
    pub fn report(&self) -> PathBuf {
        self.0.join("study.md")
    }

    /// The plot of claim `name` (as `study.md` links it).
    pub fn claim_plot(&self, name: &str) -> PathBuf {
        self.0.join(Self::claim_plot_name(name))
    }

    /// The file name of claim `name`'s plot.
    pub fn claim_plot_name(name: &str) -> String {
        format!("claim-{name}.png")
    }
}

/// One seed of a study: the demo's warm-up stages ([`DemoDir`] without its `topr/`), the arms'
/// loops, the folder they share, the other warm-ups and the verifier.
#[derive(Debug, Clone, PartialEq)]
pub struct SeedDir(PathBuf);

impl SeedDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self(dir.into())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The loop of `arm`.
    pub fn arm(&self, arm: &str) -> LoopDir {
        LoopDir::new(self.0.join(arm))
    }

    /// The folder the arms share (initial evaluation, first data set).
    pub fn shared(&self) -> PathBuf {
        self.0.join("shared")
    }

    /// The verifier's work directory.
    pub fn verifier(&self) -> PathBuf {
        self.0.join("verifier")
    }

    /// The natural task's warm-up stages.
    pub fn natural(&self) -> PathBuf {
        self.0.join("natural")
    }

    /// The fresh-data warm-up's stages.
    pub fn fresh(&self) -> PathBuf {
        self.0.join("fresh")
    }

    /// The names that are not arms' (an arm may not be called so).
    pub const RESERVED: [&'static str; 4] = ["shared", "verifier", "natural", "fresh"];
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names as earlier versions wrote them: a work directory made by one version is read by
    /// the next.
    #[test]
    fn the_names_stay_those_of_existing_work_directories() {
        let l = LoopDir::new("/w");
        assert_eq!(l.settings(), Path::new("/w/settings.json"));
        assert_eq!(l.initial_eval(), Path::new("/w/eval-initial.json"));
        assert_eq!(l.table(), Path::new("/w/iterations.jsonl"));
        assert_eq!(l.iteration(2).data(), Path::new("/w/iter-2/data.jsonl"));
        assert_eq!(l.iteration(2).done(), Path::new("/w/iter-2/train.done.json"));
        assert_eq!(l.sampled_eval(0, 8), Path::new("/w/eval-initial-k8.json"));
        assert_eq!(l.sampled_eval(3, 8), Path::new("/w/iter-3/eval-k8.json"));
        assert_eq!(l.compare(1), Path::new("/w/compare-iter-1"));
        assert_eq!(questions_file(&l.initial_eval()), Path::new("/w/eval-initial.questions.jsonl"));
        let s = StudyDir::new("/s");
        assert_eq!(s.arm(3, "sft").iteration(1).metrics(), Path::new("/s/seed-3/sft/iter-1/metrics.jsonl"));
        assert_eq!(s.seed(0).shared(), Path::new("/s/seed-0/shared"));
        assert_eq!((s.seed(1).natural(), s.seed(1).fresh()), ("/s/seed-1/natural".into(), "/s/seed-1/fresh".into()));
        assert_eq!(s.verifier_dir(0).summary(), Path::new("/s/seed-0/verifier/verify.json"));
        assert_eq!(s.verifier_dir(0).round(2), Path::new("/s/seed-0/verifier/verifier/round-2"));
        assert_eq!(s.claim_plot("off-policy"), Path::new("/s/claim-off-policy.png"));
        let d = DemoDir::new("/d");
        assert_eq!(
            (d.init(), d.sft_data(), d.warm_up()),
            ("/d/init".into(), "/d/sft.jsonl".into(), "/d/warm-up".into())
        );
        assert_eq!(d.topr().plot(), Path::new("/d/topr/iterations.png"));
    }
}
