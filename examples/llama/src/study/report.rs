//! The study's report, read from the records of what ran: `study.jsonl` (one [`StudyRow`] per
//! claim, arm, seed and iteration), `study-sampled.jsonl` ([`SampledRow`]), `verifier.jsonl`
//! ([`VerifierRow`]), `study.md` (a table per claim: mean and standard error over seeds, and the
//! paired difference of each arm to the claim's reference arm) and one `claim-NAME.png` per
//! claim.

use super::StudySettings;
use super::claims::{Arm, Claim};
use crate::demo::Scale;
use crate::layout::StudyDir;
use crate::metrics::{IterationRecord, read_jsonl};
use crate::plot::{Panel, Series};
use crate::stats::mean_se;
use crate::verify::VerifySummary;
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::Path;

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
    /// Each question's id and its values of [`SAMPLED_METRICS`], for differences paired by
    /// question (not in the record: the per-question files hold them).
    #[serde(skip)]
    pub(super) by_question: Vec<(String, [f64; 6])>,
}

/// The sampled evaluation's measures, in the order of [`SampledRow::values`].
const SAMPLED_METRICS: [&str; 6] =
    ["pass@1 (sampled)", "maj@k", "pass@k", "invalid samples", "no correct sample", "at most one correct"];

/// One question's values of [`SAMPLED_METRICS`] from its `k` samples.
fn question_values(r: &crate::eval::QuestionResult, k: usize) -> [f64; 6] {
    let correct = r.sample_correct.iter().filter(|c| **c).count();
    let b = |x: bool| f64::from(u8::from(x));
    [
        correct as f64 / k as f64,
        crate::eval::majority_credit(&r.sample_answers, r.reference),
        b(correct > 0),
        r.sample_answers.iter().filter(|a| a.is_none()).count() as f64 / k as f64,
        b(correct == 0),
        b(correct <= 1),
    ]
}

impl SampledRow {
    /// The row's values of [`SAMPLED_METRICS`].
    fn values(&self) -> [f64; 6] {
        [
            self.pass1_sampled,
            self.maj_at_k,
            self.pass_at_k,
            self.invalid_sampled,
            self.none_correct,
            self.at_most_one_correct,
        ]
    }

    /// The row of the per-question results in `questions` (`eval`'s lines, `k` samples each).
    pub(super) fn read(
        claim: Claim,
        arm: &str,
        seed: u64,
        iteration: usize,
        k: usize,
        questions: &Path,
    ) -> Result<Self> {
        let results: Vec<crate::eval::QuestionResult> = read_jsonl(questions)?;
        if results.is_empty() {
            anyhow::bail!("{}: no questions", questions.display());
        }
        if let Some(r) = results.iter().find(|r| r.sample_correct.len() != k) {
            anyhow::bail!("{}: question {} has {} samples, not {k}", questions.display(), r.id, r.sample_correct.len());
        }
        let by_question: Vec<(String, [f64; 6])> =
            results.iter().map(|r| (r.id.clone(), question_values(r, k))).collect();
        let mean = |j: usize| by_question.iter().map(|(_, v)| v[j]).sum::<f64>() / by_question.len() as f64;
        Ok(Self {
            claim,
            arm: arm.into(),
            seed,
            iteration,
            k,
            pass1_sampled: mean(0),
            maj_at_k: mean(1),
            pass_at_k: mean(2),
            invalid_sampled: mean(3),
            none_correct: mean(4),
            at_most_one_correct: mean(5),
            questions: results.len(),
            by_question,
        })
    }
}

/// The values of `a` and `b` for the ids both have, in `a`'s order: two measurements of the same
/// questions paired by question, whatever order their files list them in.
pub(super) fn pair_by_id<'a, T>(a: &'a [(String, T)], b: &'a [(String, T)]) -> Vec<(&'a T, &'a T)> {
    let b: std::collections::HashMap<&str, &T> = b.iter().map(|(id, v)| (id.as_str(), v)).collect();
    a.iter().filter_map(|(id, v)| Some((v, *b.get(id.as_str())?))).collect()
}

/// The sampled evaluations made so far, for the claims that have one.
pub fn sampled_rows(s: &StudySettings) -> Result<Vec<SampledRow>> {
    let mut out = vec![];
    for c in &s.claims {
        let Some(k) = c.sampled_k() else { continue };
        let last = c.iterations(s.scale.iterations);
        for arm in c.arms() {
            for &seed in &s.seeds {
                let work = StudyDir::new(&s.work).arm(seed, &arm.name);
                for i in [0, last] {
                    let file = work.sampled_eval(i, k);
                    let questions = crate::layout::questions_file(&file);
                    if file.exists() && questions.exists() {
                        out.push(SampledRow::read(*c, &arm.name, seed, i, k, &questions)?);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The sampled evaluation's table of claim `c`: the initial model, each arm at the last
/// iteration, and each other arm's paired difference to the first.
pub(super) fn sampled_section(md: &mut String, c: Claim, rows: &[SampledRow], s: &StudySettings) -> Result<()> {
    let (Some(k), arms) = (c.sampled_k(), c.arms()) else { return Ok(()) };
    let last = c.iterations(s.scale.iterations);
    let mine: Vec<&SampledRow> = rows.iter().filter(|r| r.claim == c).collect();
    if mine.is_empty() {
        return Ok(());
    }
    writeln!(
        md,
        "Sampled evaluation: {k} samples a question at the sampling temperature, on the same held-out \
         questions (mean ± SE over seeds; k = {k}). maj@k: a vote among the valid answers, a tie between \
         `t` leading answers scoring `1/t` for each correct one (the expected score of a random \
         tie-break); no valid answer scores 0. Each other arm minus {first}, paired by seed (SE over \
         seeds), and paired by question over all seeds' questions (SE over questions), and which \
         of the two standard errors is the larger:\n",
        first = arms[0].name
    )?;
    let mut header = "| model | seeds |".to_string();
    for name in SAMPLED_METRICS {
        write!(header, " {name} |")?;
    }
    writeln!(md, "{header}\n|{}", "---|".repeat(SAMPLED_METRICS.len() + 2))?;
    let at = |arm: &str, i: usize| -> Vec<&SampledRow> {
        mine.iter().copied().filter(|r| r.arm == arm && r.iteration == i).collect()
    };
    let line = |label: String, seeds: usize, v: &[Vec<f64>], one: &str| -> Result<String> {
        let mut l = format!("| {label} | {seeds} |");
        for m in v {
            write!(l, " {} |", fmt(mean_se(m)).replace(" (one seed)", one))?;
        }
        Ok(l)
    };
    let columns = |rows: Vec<[f64; 6]>| -> Vec<Vec<f64>> {
        (0..SAMPLED_METRICS.len()).map(|j| rows.iter().map(|v| v[j]).collect()).collect()
    };
    let values = |rs: &[&SampledRow]| columns(rs.iter().map(|r| r.values()).collect());
    let initial = at(&arms[0].name, 0);
    writeln!(md, "{}", line("initial model".into(), initial.len(), &values(&initial), " (one seed)")?)?;
    for arm in &arms {
        let rs = at(&arm.name, last);
        writeln!(md, "{}", line(format!("{} at iteration {last}", arm.name), rs.len(), &values(&rs), " (one seed)")?)?;
    }
    let first = at(&arms[0].name, last);
    for arm in arms.iter().skip(1) {
        let paired: Vec<(&SampledRow, &SampledRow)> = at(&arm.name, last)
            .into_iter()
            .filter_map(|r| Some((r, *first.iter().find(|f| f.seed == r.seed)?)))
            .collect();
        let diffs = |f: &dyn Fn(&SampledRow, &SampledRow) -> Vec<[f64; 6]>| -> Vec<[f64; 6]> {
            paired.iter().flat_map(|(a, b)| f(a, b)).collect()
        };
        let minus = |a: &[f64; 6], b: &[f64; 6]| std::array::from_fn::<f64, 6, _>(|j| a[j] - b[j]);
        let per_seed = diffs(&|a, b| vec![minus(&a.values(), &b.values())]);
        let per_question =
            diffs(&|a, b| pair_by_id(&a.by_question, &b.by_question).into_iter().map(|(x, y)| minus(x, y)).collect());
        let name = format!("{} − {}", arm.name, arms[0].name);
        let (by_seed, by_question) = (columns(per_seed), columns(per_question));
        writeln!(md, "{}", line(format!("{name}, paired by seed"), paired.len(), &by_seed, " (one seed)")?)?;
        writeln!(md, "{}", line(format!("{name}, paired by question"), paired.len(), &by_question, "")?)?;
        writeln!(md, "{}", larger_row(&name, paired.len(), &by_seed, &by_question)?)?;
    }
    writeln!(md)?;
    Ok(())
}

/// The sampled table's row saying, for each measure of a paired difference, which standard
/// error is the larger: over seeds (`by_seed`: one value a seed) or over questions.
fn larger_row(name: &str, seeds: usize, by_seed: &[Vec<f64>], by_question: &[Vec<f64>]) -> Result<String> {
    let mut l = format!("| {name}, larger SE | {seeds} |");
    for (a, b) in by_seed.iter().zip(by_question) {
        write!(l, " {} |", larger_se(mean_se(a).1, mean_se(b).1))?;
    }
    Ok(l)
}

/// Which standard error of a paired difference is the larger, over seeds (`a`) or over
/// questions (`b`): `–` when either is missing (one seed).
fn larger_se(a: f64, b: f64) -> &'static str {
    match (a, b) {
        (a, b) if a.is_nan() || b.is_nan() => "–",
        (a, b) if a > b => "seeds",
        (a, b) if a < b => "questions",
        _ => "equal",
    }
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
        let path = StudyDir::new(&s.work).verifier_dir(seed).summary();
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
    crate::io::write_file(&StudyDir::new(&s.work).verifier_table(), &jsonl(&rows)?)?;
    let c = Claim::Verifier;
    writeln!(md, "## {}\n\n{}\n", c.name(), c.question())?;
    writeln!(
        md,
        "{}",
        concat!(
            "Each cell: mean ± standard error over seeds of the held-out share (k = 4 solutions per question, ",
            "the seeds' warm models, two TOPR rounds of the judge on both verdicts of its own training solutions). ",
            "`SE questions`: the mean over seeds of each seed's standard error over its questions.\n"
        )
    )?;
    let series = verifier_table(&rows, md)?;
    let png = StudyDir::new(&s.work).claim_plot(c.name());
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
    writeln!(md, "![verifier]({})\n", StudyDir::claim_plot_name(c.name()))?;
    Ok(())
}

/// The verifier's table: each pick's share over seeds; returns the picks' curves over seeds.
fn verifier_table(rows: &[VerifierRow], md: &mut String) -> Result<Vec<Series>> {
    writeln!(md, "| measure | seeds | mean ± SE over seeds | SE questions |\n|---|---|---|---|")?;
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
            series.push(Series::new(
                name.split(' ').next().unwrap_or(name),
                rows.iter().map(|r| (r.seed as f64, pick(&r.summary).mean)).collect(),
            ));
        }
    }
    let base: Vec<f64> = rows.iter().map(|r| r.summary.positive_fraction).collect();
    writeln!(md, "| correct among judged (base rate) | {} | {} | |\n", base.len(), fmt(mean_se(&base)))?;
    Ok(series)
}

/// The rows of every finished iteration of the study's runs.
pub fn rows(s: &StudySettings) -> Result<Vec<StudyRow>> {
    let mut out = vec![];
    for c in &s.claims {
        for arm in c.arms() {
            for &seed in &s.seeds {
                let path = StudyDir::new(&s.work).arm(seed, &arm.name).table();
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
                    eval_n: c.eval_n(s.scale),
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
    let dir = StudyDir::new(&s.work);
    crate::io::write_file(&dir.table(), &jsonl(&rows)?)?;
    let sampled = sampled_rows(s)?;
    if !sampled.is_empty() {
        crate::io::write_file(&dir.sampled_table(), &jsonl(&sampled)?)?;
    }
    let mut md = String::new();
    // What the runs were made in, from the study's record (the settings' when it has none yet).
    let numerics = match super::StudyRecord::read(&s.work)? {
        Some(r) => r.numerics,
        None => crate::identity::Numerics::of(s.at),
    };
    if s.claims.iter().all(|c| c.is_real()) {
        writeln!(
            md,
            "# Study on a real model: {} seed(s) planned, {} held-out problems a seed, {}\n",
            s.seeds.len(),
            Scale::real().eval_n,
            numerics.describe()
        )?;
    } else {
        writeln!(
            md,
            "# Study: {} seed(s) planned, {} held-out problems a seed, {} iteration(s) unless a claim fixes its own, {}\n",
            s.seeds.len(),
            s.scale.eval_n,
            s.scale.iterations,
            numerics.describe()
        )?;
    }
    let own = if s.claims.iter().all(|c| c.is_real()) {
        "training questions, held-out questions, sampling and training seeds"
    } else {
        "own model initialisation, warm-up data, training questions and held-out questions"
    };
    writeln!(
        md,
        "Each cell: mean ± standard error over seeds of the greedy held-out accuracy (the seeds' \
         {own}), over the seeds that finished the arm (`seeds`; a seed still running is left out of \
         every column of its arm). \
         `gain`: last iteration minus iteration 0, per seed. `vs first`: the paired difference to \
         the claim's first arm at the last iteration, per seed. `SE questions`: the binomial \
         standard error of the pooled accuracy over all seeds' questions. `(one seed)`: one value, \
         no error bar; `—`: the reference arm itself; `–`: nothing finished yet.\n"
    )?;
    for c in &s.claims {
        match c {
            Claim::Verifier => verifier_section(s, &mut md)?,
            _ => claim_section(s, *c, &rows, &sampled, &mut md)?,
        }
    }
    crate::io::write_file(&dir.report(), &md)?;
    Ok(())
}

/// One JSON line per row.
fn jsonl<T: serde::Serialize>(rows: &[T]) -> Result<String> {
    let mut out = String::new();
    for r in rows {
        writeln!(out, "{}", serde_json::to_string(r)?)?;
    }
    Ok(out)
}

/// The rows of one claim, looked up by arm, seed and iteration.
struct ClaimRows<'a> {
    claim: Claim,
    rows: &'a [StudyRow],
}

impl ClaimRows<'_> {
    fn at(&self, arm: &str, seed: u64, i: usize) -> Option<&StudyRow> {
        self.rows.iter().find(|r| r.claim == self.claim && r.arm == arm && r.seed == seed && r.iteration == i)
    }
}

/// An arm's means over seeds at each iteration, with their standard errors over seeds.
struct Curves {
    accuracy: Series,
    invalid: Series,
}

/// Claim `c`'s section of `study.md` (its table, the sampled evaluation, the gains of each
/// iteration) and its plot.
fn claim_section(
    s: &StudySettings,
    c: Claim,
    rows: &[StudyRow],
    sampled: &[SampledRow],
    md: &mut String,
) -> Result<()> {
    writeln!(md, "## {}\n\n{}\n", c.name(), c.question())?;
    let iters = c.iterations(s.scale.iterations);
    let mut header = "| arm | seeds |".to_string();
    for i in 0..=iters {
        write!(header, " iteration {i} |")?;
    }
    writeln!(md, "{header} gain | vs first | invalid at last | positives in data (it. 1) | SE questions (last) |")?;
    writeln!(md, "|{}", "---|".repeat(iters + 8))?;
    let arms = c.arms();
    let table = ClaimRows { claim: c, rows };
    let (mut panels_acc, mut panels_inv) = (vec![], vec![]);
    for arm in &arms {
        let curves = arm_line(s, &table, arm, &arms[0], iters, md)?;
        panels_acc.push(curves.accuracy);
        panels_inv.push(curves.invalid);
    }
    writeln!(md)?;
    if c.is_real() {
        real_section(s, &table, &arms, iters, md)?;
        seeds_table(s, &table, &arms, iters, md)?;
    }
    sampled_section(md, c, sampled, s)?;
    if iters >= 2 {
        step_gains(md, &arms, &s.seeds, iters, |arm, seed, i| table.at(arm, seed, i).map(|r| r.accuracy))?;
    }
    let mut panels = vec![
        Panel {
            title: format!("{}: held-out accuracy (mean ± SE over seeds)", c.name()),
            x: "iteration".into(),
            y: "greedy pass@1".into(),
            series: panels_acc,
        },
        Panel {
            title: format!("{}: invalid answers (mean ± SE over seeds)", c.name()),
            x: "iteration".into(),
            y: "share of problems".into(),
            series: panels_inv,
        },
    ];
    panels.extend(composition_panel(&table, &arms, &s.seeds, iters));
    if arms.iter().any(|a| a.epochs > 1) {
        panels.extend(training_panels(s, &arms)?);
    }
    let png = StudyDir::new(&s.work).claim_plot(c.name());
    crate::plot::report("study", || {
        crate::plot::draw(&png, &panels, 2)?;
        Ok(png.clone())
    });
    writeln!(md, "![{}]({})\n", c.name(), StudyDir::claim_plot_name(c.name()))?;
    Ok(())
}

/// `arm`'s line of its claim's table (`first` the claim's reference arm); returns its curves.
fn arm_line(
    s: &StudySettings,
    table: &ClaimRows,
    arm: &Arm,
    first: &Arm,
    iters: usize,
    md: &mut String,
) -> Result<Curves> {
    let at = |name: &str, sd: u64, i: usize| table.at(name, sd, i);
    let seeds: Vec<u64> = s.seeds.iter().copied().filter(|&sd| at(&arm.name, sd, iters).is_some()).collect();
    let mut line = format!("| {} | {} |", arm.name, seeds.len());
    let mut curves = Curves { accuracy: Series::new(&arm.name, vec![]), invalid: Series::new(&arm.name, vec![]) };
    // Every column over the same seeds: those that finished the arm's last iteration.
    for i in 0..=iters {
        let v: Vec<f64> = seeds.iter().filter_map(|&sd| at(&arm.name, sd, i)).map(|r| r.accuracy).collect();
        let w: Vec<f64> = seeds.iter().filter_map(|&sd| at(&arm.name, sd, i)).map(|r| r.invalid_rate).collect();
        write!(line, " {} |", fmt(mean_se(&v)))?;
        if !v.is_empty() {
            for (curve, (m, se)) in [(&mut curves.accuracy, mean_se(&v)), (&mut curves.invalid, mean_se(&w))] {
                curve.points.push((i as f64, m));
                curve.errors.push(se);
            }
        }
    }
    let per_seed = |f: &dyn Fn(u64) -> Option<f64>| seeds.iter().filter_map(|&sd| f(sd)).collect::<Vec<f64>>();
    let gain = per_seed(&|sd| Some(at(&arm.name, sd, iters)?.accuracy - at(&arm.name, sd, 0)?.accuracy));
    let vs = per_seed(&|sd| Some(at(&arm.name, sd, iters)?.accuracy - at(&first.name, sd, iters)?.accuracy));
    let invalid = per_seed(&|sd| Some(at(&arm.name, sd, iters)?.invalid_rate));
    let last = per_seed(&|sd| Some(at(&arm.name, sd, iters)?.accuracy));
    let positives = per_seed(&|sd| at(&arm.name, sd, 1)?.data_positive_fraction);
    let pooled = mean_se(&last).0;
    let n_q = (last.len() * table.claim.eval_n(s.scale)) as f64;
    let se_q = if n_q > 0.0 { (pooled * (1.0 - pooled) / n_q).sqrt() } else { f64::NAN };
    writeln!(
        md,
        "{line} {} | {} | {} | {} | {} |",
        fmt(mean_se(&gain)),
        if arm == first { "—".into() } else { fmt(mean_se(&vs)) },
        fmt(mean_se(&invalid)),
        fmt(mean_se(&positives)),
        if se_q.is_nan() { "–".into() } else { format!("{se_q:.3}") }
    )?;
    Ok(curves)
}

/// A real-model claim's second table, at the last iteration: the share of right answers among
/// the answers given (accuracy over one minus the invalid rate: arithmetic apart from format),
/// and each arm's difference to the first arm with two standard errors, over seeds (the mean of
/// the seeds' paired differences) and over questions (all seeds' questions pooled, paired), and
/// which is larger.
fn real_section(s: &StudySettings, table: &ClaimRows, arms: &[Arm], iters: usize, md: &mut String) -> Result<()> {
    writeln!(
        md,
        "At iteration {iters}: right among the answers given (mean ± SE over seeds; a seed that gave no \
         answer is left out), and each arm minus {} with its standard error over seeds and over \
         questions (all seeds' questions, paired by seed and question id):\n",
        arms[0].name
    )?;
    writeln!(md, "| arm | right among given | − first (SE over seeds) | − first (SE over questions) | larger SE |")?;
    writeln!(md, "|---|---|---|---|---|")?;
    let dir = StudyDir::new(&s.work);
    let correct = |arm: &str, seed: u64| -> Result<Option<Vec<(String, f64)>>> {
        let file = crate::layout::questions_file(&dir.arm(seed, arm).iteration(iters).eval());
        if !file.exists() {
            return Ok(None);
        }
        let rows: Vec<crate::eval::QuestionResult> = read_jsonl(&file)?;
        Ok(Some(rows.into_iter().map(|q| (q.id, f64::from(u8::from(q.greedy_correct)))).collect()))
    };
    // The first arm's results, read once a seed.
    let firsts: Vec<Option<Vec<(String, f64)>>> =
        s.seeds.iter().map(|&sd| correct(&arms[0].name, sd)).collect::<Result<_>>()?;
    for arm in arms {
        let given: Vec<f64> = s
            .seeds
            .iter()
            .filter_map(|&sd| table.at(&arm.name, sd, iters))
            .filter(|r| r.invalid_rate < 1.0)
            .map(|r| r.accuracy / (1.0 - r.invalid_rate))
            .collect();
        let (mut per_seed, mut per_question) = (vec![], vec![]);
        for (&seed, first) in s.seeds.iter().zip(&firsts) {
            if let (Some(a), Some(b)) = (correct(&arm.name, seed)?, first) {
                // The same questions, matched by id (a seed's questions differ from another's).
                let d: Vec<f64> = pair_by_id(&a, b).into_iter().map(|(x, y)| x - y).collect();
                per_seed.push(mean_se(&d).0);
                per_question.extend(d);
            }
        }
        let (over_seeds, over_questions) = (mean_se(&per_seed), mean_se(&per_question));
        let larger = if arm == &arms[0] { "–" } else { larger_se(over_seeds.1, over_questions.1) };
        let vs = |m: (f64, f64)| if arm == &arms[0] { "—".to_string() } else { fmt(m) };
        writeln!(
            md,
            "| {} | {} | {} | {} | {larger} |",
            arm.name,
            fmt(mean_se(&given)),
            vs(over_seeds),
            vs(over_questions).replace(" (one seed)", "")
        )?;
    }
    writeln!(md)?;
    Ok(())
}

/// A real-model claim's seeds one by one: each seed's greedy pass@1 (its invalid rate in
/// parentheses) at iteration 0 (the initial model, as the first arm that has it recorded it) and
/// each arm's at every later iteration, so that the spread over seeds behind every mean is in view.
fn seeds_table(s: &StudySettings, table: &ClaimRows, arms: &[Arm], iters: usize, md: &mut String) -> Result<()> {
    writeln!(
        md,
        "Each seed: greedy pass@1 and, in parentheses, the share of invalid answers, of the initial \
         model and of each arm after each iteration (`–`: not finished):\n"
    )?;
    let mut header = "| arm |".to_string();
    for seed in &s.seeds {
        write!(header, " seed {seed} |")?;
    }
    writeln!(md, "{header}\n|{}", "---|".repeat(s.seeds.len() + 1))?;
    // One line: its label, then each seed's accuracy and invalid rate (`–` where none is recorded).
    let mut line = |label: &str, at: &dyn Fn(u64) -> Option<(f64, f64)>| -> Result<()> {
        write!(md, "| {label} |")?;
        for &seed in &s.seeds {
            match at(seed) {
                Some((accuracy, invalid)) => write!(md, " {accuracy:.3} ({invalid:.3}) |")?,
                None => write!(md, " – |")?,
            }
        }
        writeln!(md)?;
        Ok(())
    };
    let figures = |r: &StudyRow| (r.accuracy, r.invalid_rate);
    line("initial model", &|seed| arms.iter().find_map(|a| table.at(&a.name, seed, 0)).map(figures))?;
    for arm in arms {
        for i in 1..=iters {
            line(&format!("{} at iteration {i}", arm.name), &|seed| table.at(&arm.name, seed, i).map(figures))?;
        }
    }
    writeln!(md)?;
    Ok(())
}

/// The composition claims' panel (`None` for the others, and while no line has a seed that
/// finished every arm of it): accuracy at the last iteration
/// against p̃, a line per raw share of positives (the demo's arms by the share their data are
/// subsampled to; the real model's on its own samples), each point the mean ± SE over the seeds
/// that finished every arm of its line, so that a line never joins means over different seeds.
fn composition_panel(table: &ClaimRows, arms: &[Arm], seeds: &[u64], iters: usize) -> Option<Panel> {
    let mut composition: std::collections::BTreeMap<String, Vec<(f64, &str)>> = Default::default();
    for arm in arms {
        let line = match (arm.p_tilde(), arm.raw_share()) {
            (Some(p), Some(raw)) => Some((format!("raw share of positives {raw}"), p)),
            (Some(p), None) if table.claim == Claim::RealComposition => Some(("the model's own samples".into(), p)),
            _ => None,
        };
        if let Some((label, p)) = line {
            composition.entry(label).or_default().push((p, arm.name.as_str()));
        }
    }
    if composition.is_empty() {
        return None;
    }
    let series = composition.into_iter().map(|(label, mut arms)| {
        arms.sort_by(|a, b| a.0.total_cmp(&b.0));
        let common: Vec<u64> =
            seeds.iter().copied().filter(|&sd| arms.iter().all(|(_, a)| table.at(a, sd, iters).is_some())).collect();
        let n = common.len();
        let mut curve = Series::new(format!("{label} ({n} seed{})", if n == 1 { "" } else { "s" }), vec![]);
        for (p, a) in arms {
            let last: Vec<f64> = common.iter().filter_map(|&sd| Some(table.at(a, sd, iters)?.accuracy)).collect();
            if !last.is_empty() {
                let (m, se) = mean_se(&last);
                curve.points.push((p, m));
                curve.errors.push(se);
            }
        }
        curve
    });
    let series: Vec<Series> = series.collect();
    if series.iter().all(|c| c.points.is_empty()) {
        return None;
    }
    Some(Panel {
        title: format!("accuracy at iteration {iters} against p~ (± SE)"),
        x: "effective proportion of positives p~".into(),
        y: "greedy pass@1".into(),
        series,
    })
}

/// For claims of several epochs on one data set: per optimiser step of iteration 1, the mean
/// over seeds of the per-token log-ratio `log π − log μ` and of log10 of the gradient norm before
/// clipping — how far each arm's policy moved from μ, and whether its updates blew up.
pub(super) fn training_panels(s: &StudySettings, arms: &[Arm]) -> Result<Vec<Panel>> {
    let mut ratio = vec![];
    let mut norm = vec![];
    for arm in arms {
        // step -> (sum of log-ratios, sum of log10 norms, seeds)
        let mut by_step: std::collections::BTreeMap<usize, (f64, f64, usize)> = Default::default();
        for &seed in &s.seeds {
            let it = StudyDir::new(&s.work).arm(seed, &arm.name).iteration(1);
            if !it.trained() {
                continue;
            }
            for r in read_jsonl::<crate::metrics::StepRecord>(&it.metrics())? {
                let e = by_step.entry(r.step).or_default();
                e.0 += r.stats.log_ratio_mean;
                e.1 += r.grad_norm.max(1e-12).log10();
                e.2 += 1;
            }
        }
        let points = |f: fn(&(f64, f64, usize)) -> f64| by_step.iter().map(|(k, v)| (*k as f64, f(v))).collect();
        ratio.push(Series::new(&arm.name, points(|v| v.0 / v.2 as f64)));
        norm.push(Series::new(&arm.name, points(|v| v.1 / v.2 as f64)));
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
pub(super) fn step_gains(
    md: &mut String,
    arms: &[Arm],
    seeds: &[u64],
    iters: usize,
    accuracy: impl Fn(&str, u64, usize) -> Option<f64>,
) -> Result<()> {
    writeln!(
        md,
        "Gain of each iteration (its accuracy minus the previous one's, per seed; mean ± SE over the seeds that have both, \
         which may include a seed whose last iteration the tables above do not count yet):\n"
    )?;
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
