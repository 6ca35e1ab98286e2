//! How far a long stage is, on stderr: indicatif's bar on a terminal; elsewhere — a log file or a
//! pipe, a run in the background — a plain line at most once every [`PLAIN_EVERY`] and one when
//! the stage ends, so that a log says how far each stage is and about how long it has left
//! (indicatif draws nothing when stderr is not a terminal).
//!
//! ```text
//! train: 12/64 steps (18 %), loss -0.0028, 6.1 min so far, about 26.4 min left
//! ```

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most often a plain progress line is written.
pub const PLAIN_EVERY: Duration = Duration::from_secs(60);

/// A stage's progress: `what` (e.g. `train`) counts `total` units (e.g. `steps`).
///
/// ```
/// use topr_llama::progress::Progress;
/// let p = Progress::new("score", "problems", 3, 1); // one done before a resume
/// for _ in 0..2 {
///     p.inc(1);
/// }
/// p.finish(); // off a terminal: "score: 3/3 problems (100 %), 0.0 min so far, done"
/// ```
pub struct Progress {
    bar: ProgressBar,
    plain: Option<Mutex<Plain>>,
}

/// The state of the plain lines.
struct Plain {
    what: String,
    unit: String,
    total: u64,
    pos: u64,
    /// The position when the stage started (a resumed stage's rate counts only its own work).
    from: u64,
    started: Instant,
    last: Instant,
    msg: String,
}

impl Plain {
    /// The line at `now`, if one is due (never twice within [`PLAIN_EVERY`]; always at the end).
    fn due(&mut self, now: Instant, end: bool) -> Option<String> {
        if !end && now.duration_since(self.last) < PLAIN_EVERY {
            return None;
        }
        self.last = now;
        Some(self.line(now, end))
    }

    fn line(&self, now: Instant, end: bool) -> String {
        let minutes = |d: f64| format!("{:.1} min", d / 60.0);
        let elapsed = now.duration_since(self.started).as_secs_f64();
        let share = (self.pos * 100).checked_div(self.total).map(|s| format!(" ({s} %)")).unwrap_or_default();
        let msg = if self.msg.is_empty() { String::new() } else { format!(", {}", self.msg) };
        let done = self.pos.saturating_sub(self.from);
        let left = if end {
            ", done".to_string()
        } else if done > 0 && self.total >= self.pos {
            format!(", about {} left", minutes(elapsed / done as f64 * (self.total - self.pos) as f64))
        } else {
            String::new()
        };
        format!(
            "{}: {}/{} {}{share}{msg}, {} so far{left}",
            self.what,
            self.pos,
            self.total,
            self.unit,
            minutes(elapsed)
        )
    }
}

impl Progress {
    /// A stage of `total` `unit`s, `done` of them already (a resumed stage).
    pub fn new(what: &str, unit: &str, total: u64, done: u64) -> Self {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(&format!("{what} [{{bar:30}}] {{pos}}/{{len}} {unit} {{msg}} ETA {{eta}}"))
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(done);
        let now = Instant::now();
        let plain = (!std::io::stderr().is_terminal()).then(|| {
            Mutex::new(Plain {
                what: what.into(),
                unit: unit.into(),
                total,
                pos: done,
                from: done,
                started: now,
                last: now,
                msg: String::new(),
            })
        });
        Self { bar, plain }
    }

    /// Nothing shown (another rank's share of a data-parallel stage).
    pub fn hidden() -> Self {
        Self { bar: ProgressBar::hidden(), plain: None }
    }

    fn plain(&self, f: impl FnOnce(&mut Plain) -> Option<String>) {
        if let Some(p) = &self.plain {
            let line = f(&mut p.lock().unwrap_or_else(|e| e.into_inner()));
            if let Some(line) = line {
                eprintln!("{line}");
            }
        }
    }

    /// `n` more units done.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
        self.plain(|p| {
            p.pos += n;
            p.due(Instant::now(), false)
        });
    }

    /// A short note shown beside the count (e.g. the last loss).
    pub fn set_message(&self, msg: String) {
        self.plain(|p| {
            p.msg.clone_from(&msg);
            None
        });
        self.bar.set_message(msg);
    }

    /// The stage ended: the bar goes; the plain lines end with one of the final count.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
        self.plain(|p| p.due(Instant::now(), true));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(total: u64, from: u64) -> (Plain, Instant) {
        let t0 = Instant::now();
        let p = Plain {
            what: "train".into(),
            unit: "steps".into(),
            total,
            pos: from,
            from,
            started: t0,
            last: t0,
            msg: String::new(),
        };
        (p, t0)
    }

    #[test]
    fn plain_lines_come_at_most_once_a_minute_and_at_the_end() {
        let (mut p, t0) = plain(64, 0);
        p.pos = 5;
        assert_eq!(p.due(t0 + Duration::from_secs(30), false), None);
        p.pos = 12;
        p.msg = "loss -0.0028".into();
        // 12 steps in 6.1 minutes: 52 left take about 26.4 more.
        let at = t0 + Duration::from_secs(366);
        assert_eq!(
            p.due(at, false).as_deref(),
            Some("train: 12/64 steps (18 %), loss -0.0028, 6.1 min so far, about 26.4 min left")
        );
        assert_eq!(p.due(at + Duration::from_secs(59), false), None);
        assert!(p.due(at + Duration::from_secs(60), false).is_some());
        p.pos = 64;
        let end = p.due(at + Duration::from_secs(61), true).unwrap();
        assert_eq!(end, "train: 64/64 steps (100 %), loss -0.0028, 7.1 min so far, done");
    }

    #[test]
    fn a_resumed_stage_rates_only_its_own_work() {
        let (mut p, t0) = plain(100, 50);
        p.pos = 60;
        // 10 steps in 2 minutes: 40 left take 8 more.
        let line = p.due(t0 + Duration::from_secs(120), false).unwrap();
        assert!(line.ends_with("2.0 min so far, about 8.0 min left"), "{line}");
        // Nothing done yet: no estimate.
        let (mut p, t0) = plain(100, 50);
        let line = p.due(t0 + Duration::from_secs(120), false).unwrap();
        assert!(line.ends_with("2.0 min so far"), "{line}");
    }
}
