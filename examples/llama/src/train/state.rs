//! A training run's saved state and its resumption: `dir/state` (model, optimiser, progress),
//! the fingerprint that ties it to its data and settings, and the per-step metrics file, whose
//! lines past the resumed step are dropped.

use super::TrainSettings;
use crate::Refusal;
use crate::metrics::StepRecord;
use crate::model::Llama;
use crate::optim::Optimizer;
use crate::sample::Sample;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// Where a run stands, saved with the model and optimiser state.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub(super) struct Progress {
    pub step: usize,
    pub last_loss: f64,
    pub truncated_sum: f64,
    /// A fingerprint of the data and settings, so that a state is not resumed on other data.
    pub fingerprint: String,
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
        std::fs::create_dir_all(&tmp)?;
        crate::checkpoint::write_safetensors(&crate::checkpoint::weights(model), &tmp.join("model.safetensors"))?;
        crate::checkpoint::write_safetensors(&opt.state(), &tmp.join("optimizer.safetensors"))?;
        std::fs::write(tmp.join("progress.json"), serde_json::to_string(progress)?)?;
        let old = self.dir.join("state.old");
        let _ = std::fs::remove_dir_all(&old);
        if self.path().exists() {
            std::fs::rename(self.path(), &old)?;
        }
        std::fs::rename(&tmp, self.path())?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    /// The saved state, if any (after a kill between the two renames, the previous one).
    fn load(&self, model: &Llama, opt: &mut Optimizer) -> Result<Option<Progress>> {
        let old = self.dir.join("state.old");
        if !self.path().exists() && old.exists() {
            std::fs::rename(&old, self.path())?;
        }
        let dir = self.path();
        if !dir.exists() {
            return Ok(None);
        }
        let ctx = || format!("resuming from {}", dir.display());
        let progress: Progress =
            serde_json::from_str(&std::fs::read_to_string(dir.join("progress.json")).with_context(ctx)?)
                .with_context(ctx)?;
        crate::checkpoint::read_weights(model, &[dir.join("model.safetensors")], &dir).with_context(ctx)?;
        let state = Tensor::read_safetensors(dir.join("optimizer.safetensors")).with_context(ctx)?;
        opt.load_state(state.into_iter().collect()).with_context(ctx)?;
        Ok(Some(progress))
    }

    pub fn remove(&self) {
        let _ = std::fs::remove_dir_all(self.path());
    }

    /// Where the run starts: from the saved state of an interrupted run (loaded into `model` and
    /// `opt`) when `o.resume` is set, else from the beginning. A saved state without `resume`, or
    /// one made with other data or settings, is refused.
    pub fn resume(
        &self,
        model: &Llama,
        opt: &mut Optimizer,
        samples: &[Sample],
        o: &TrainSettings,
    ) -> Result<Progress> {
        let fp = fingerprint(samples, o);
        let fresh = Progress { fingerprint: fp.clone(), last_loss: f64::NAN, ..Default::default() };
        if !self.exists() {
            return Ok(fresh);
        }
        if !o.resume {
            bail!(Refusal::InterruptedTraining { dir: self.dir.clone(), state: self.path() });
        }
        let Some(saved) = self.load(model, opt)? else {
            return Ok(fresh);
        };
        if saved.fingerprint != fp {
            bail!(
                "{}: the saved state was made with other data or settings (objective, batch size, epochs, seed, optimizer); remove it to start afresh",
                self.path().display()
            );
        }
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

/// A short fingerprint of the data and the settings that shape the steps.
fn fingerprint(samples: &[Sample], o: &TrainSettings) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for s in samples {
        (&s.id, s.sample, &s.completion_ids, s.reward.to_bits()).hash(&mut h);
    }
    format!("{:?}|{}|{}|{}|{:?}|{:016x}", o.objective, o.batch_size, o.epochs, o.seed, o.optimizer, h.finish())
}

/// `metrics.jsonl`: one [`StepRecord`] per line, flushed after each.
pub(super) struct MetricsLog {
    file: std::io::BufWriter<std::fs::File>,
}

impl MetricsLog {
    /// Opens `path` keeping the lines of steps `1..=step` (a resumed run drops those of steps it
    /// will redo).
    pub fn open(path: &Path, step: usize) -> Result<Self> {
        let kept = keep_metrics(path, step);
        let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
        file.write_all(kept.as_bytes())?;
        Ok(Self { file })
    }

    pub fn write(&mut self, record: &StepRecord) -> Result<()> {
        writeln!(self.file, "{}", serde_json::to_string(record)?)?;
        self.file.flush()?;
        Ok(())
    }
}

/// The metrics lines of steps `1..=step`, as they are in the file.
fn keep_metrics(path: &Path, step: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut kept = String::new();
    for line in text.lines() {
        let n = serde_json::from_str::<StepRecord>(line).ok().map(|r| r.step);
        if n.is_some_and(|n| n <= step) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}
