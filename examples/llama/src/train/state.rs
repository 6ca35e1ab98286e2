//! A training run's saved state and its resumption: `dir/state` (model, optimiser, progress),
//! the record of the inputs and settings that ties it to its run, and the per-step metrics file,
//! whose lines past the resumed step are dropped.

use super::{RunRecord, TrainSettings};
use crate::io::Append;
use crate::metrics::StepRecord;
use crate::model::Llama;
use crate::optim::Optimizer;
use crate::{Refusal, Resumable};
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::Tensor;

/// Where a run stands, saved with the model and optimiser state.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub(super) struct Progress {
    pub step: usize,
    pub last_loss: f64,
    pub truncated_sum: f64,
    /// What the run was made from, so that a state is not resumed on other inputs or settings
    /// (absent in states written before it was recorded, which cannot be resumed).
    #[serde(default)]
    pub run: Option<RunRecord>,
}

/// The training state of a run: `dir/state` (model, optimiser, progress). Written to
/// `state.tmp` and renamed, so a kill at any moment leaves a whole state (the previous one).
pub(super) struct StateDir {
    pub dir: PathBuf,
}

impl StateDir {
    pub fn path(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Whether an interrupted run left a state (possibly only the previous one, after a kill
    /// between the two renames).
    pub fn exists(&self) -> bool {
        self.path().exists() || self.dir.join("state.old").exists()
    }

    pub fn save(&self, model: &Llama, opt: &Optimizer, progress: &Progress) -> Result<()> {
        let tmp = self.dir.join("state.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        crate::checkpoint::write_safetensors(&crate::checkpoint::weights(model), &tmp.join("model.safetensors"))?;
        crate::checkpoint::write_safetensors(&opt.state(), &tmp.join("optimizer.safetensors"))?;
        crate::io::write_file(&tmp.join("progress.json"), serde_json::to_string(progress)?)?;
        let old = self.dir.join("state.old");
        let _ = std::fs::remove_dir_all(&old);
        let rename = |from: &Path, to: &Path| {
            std::fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))
        };
        if self.path().exists() {
            rename(&self.path(), &old)?;
        }
        rename(&tmp, &self.path())?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    /// The progress of the saved state, if any (after a kill between the two renames, the
    /// previous one).
    fn progress(&self) -> Result<Option<Progress>> {
        let old = self.dir.join("state.old");
        if !self.path().exists() && old.exists() {
            std::fs::rename(&old, self.path())
                .with_context(|| format!("renaming {} to {}", old.display(), self.path().display()))?;
        }
        let dir = self.path();
        if !dir.exists() {
            return Ok(None);
        }
        let file = dir.join("progress.json");
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        Ok(Some(serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))?))
    }

    /// Loads the saved model and optimiser state into `model` and `opt`.
    fn load(&self, model: &Llama, opt: &mut Optimizer) -> Result<()> {
        let dir = self.path();
        let ctx = || format!("resuming from {}", dir.display());
        crate::checkpoint::read_weights(model, &[dir.join("model.safetensors")], &dir).with_context(ctx)?;
        let state = Tensor::read_safetensors(dir.join("optimizer.safetensors")).with_context(ctx)?;
        opt.load_state(state.into_iter().collect()).with_context(ctx)?;
        Ok(())
    }

    /// Removes the state and what a save interrupted by a kill can leave beside it (the previous
    /// state, a half-written new one), so that a finished run leaves nothing `exists` finds.
    pub fn remove(&self) {
        for name in ["state", "state.old", "state.tmp"] {
            let _ = std::fs::remove_dir_all(self.dir.join(name));
        }
    }

    /// The saved state a run with `run` and `o` would resume (`None`: it starts afresh),
    /// without loading it. A saved state without `o.resume`, or one made with other inputs or
    /// settings, is refused, listing what differs.
    pub fn check(&self, run: &RunRecord, o: &TrainSettings) -> Result<Option<Progress>> {
        if !self.exists() {
            return Ok(None);
        }
        if !o.resume {
            bail!(Refusal::InterruptedTraining { dir: self.dir.clone(), state: self.path() });
        }
        let Some(saved) = self.progress()? else {
            return Ok(None);
        };
        let Some(saved_run) = &saved.run else {
            bail!(
                "{}: the saved state records neither its inputs nor its settings (an older version wrote it), so resuming it cannot be checked; remove it to start afresh",
                self.path().display()
            );
        };
        crate::stage::check(&serde_json::to_value(saved_run)?, run, &[], &self.dir, Resumable::Training)?;
        Ok(Some(saved))
    }

    /// Where the run starts: from the saved state of an interrupted run (loaded into `model` and
    /// `opt`) when `o.resume` is set, else from the beginning (see [`Self::check`]).
    pub fn resume(&self, model: &Llama, opt: &mut Optimizer, run: &RunRecord, o: &TrainSettings) -> Result<Progress> {
        let Some(saved) = self.check(run, o)? else {
            return Ok(Progress { run: Some(run.clone()), last_loss: f64::NAN, ..Default::default() });
        };
        self.load(model, opt)?;
        if opt.steps() as usize != saved.step {
            bail!(
                "{}: the optimiser state is at step {}, the progress at {}",
                self.path().display(),
                opt.steps(),
                saved.step
            );
        }
        eprintln!("resuming after step {}", saved.step);
        Ok(saved)
    }
}

/// `metrics.jsonl`: one [`StepRecord`] per line, each write checked and flushed.
pub(super) struct MetricsLog {
    file: Append,
}

impl MetricsLog {
    /// Opens `path` keeping the lines of steps `1..=step` (a resumed run drops those of steps it
    /// will redo; the kept lines are rewritten atomically).
    pub fn open(path: &Path, step: usize) -> Result<Self> {
        let kept = keep_metrics(path, step)?;
        crate::io::write_file(path, kept)?;
        Ok(Self { file: Append::open(path)? })
    }

    pub fn write(&mut self, record: &StepRecord) -> Result<()> {
        self.file.line(&serde_json::to_string(record)?)
    }
}

/// The metrics lines of steps `1..=step`, as they are in the file.
fn keep_metrics(path: &Path, step: usize) -> Result<String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {} to resume it", path.display())),
    };
    let mut kept = String::new();
    for line in text.lines() {
        let n = serde_json::from_str::<StepRecord>(line).ok().map(|r| r.step);
        if n.is_some_and(|n| n <= step) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    Ok(kept)
}
