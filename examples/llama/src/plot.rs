//! PNG plots of a run, drawn with plotters from the JSONL metrics: for `iterate`, held-out
//! accuracy per iteration and the per-step training curves of every iteration; for `train`, the
//! curves of one run.
//!
//! Text needs a TrueType font: `$TOPR_PLOT_FONT`, else DejaVu Sans or Liberation Sans from the
//! usual system folders (Debian's `fonts-dejavu-core`). Without one, plotting is skipped with a
//! message; the metrics are in the JSONL files either way.

use crate::layout::{self, LoopDir};
use crate::metrics::{IterationRecord, StepRecord, ToprStats, read_jsonl};
use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const FONT_PATHS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial Unicode.ttf",
];

/// Registers a font as "sans-serif" once per process.
fn font() -> Result<()> {
    static FONT: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = std::env::var_os("TOPR_PLOT_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.map(PathBuf::from))
            .collect();
        let Some(path) = candidates.iter().find(|p| p.exists()) else {
            return Err("no TrueType font found: install fonts-dejavu-core or set TOPR_PLOT_FONT to a .ttf file".into());
        };
        let bytes = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
            .map_err(|_| format!("{} is not a font plotters can read", path.display()))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// One line of a panel, with an error bar at each point where `errors` gives one.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// The half-height of the error bar at each point, in the points' order (a standard error
    /// over seeds, say); none where it is missing, zero or not finite.
    pub errors: Vec<f64>,
}

impl Series {
    /// A line through `points`, without error bars.
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self { label: label.into(), points, errors: vec![] }
    }

    /// The same line with an error bar of half-height `errors[i]` at point `i`.
    pub fn with_errors(self, errors: Vec<f64>) -> Self {
        Self { errors, ..self }
    }

    /// The points with their error bars' half-heights, where both are drawable.
    fn bars(&self) -> impl Iterator<Item = (f64, f64, f64)> + '_ {
        self.points
            .iter()
            .zip(&self.errors)
            .filter(|((x, y), e)| x.is_finite() && y.is_finite() && e.is_finite() && **e > 0.0)
            .map(|(&(x, y), &e)| (x, y, e))
    }
}

/// One chart: title, axis names and its lines.
pub struct Panel {
    pub title: String,
    pub x: String,
    pub y: String,
    pub series: Vec<Series>,
}

impl Panel {
    /// A panel of per-step curves.
    fn steps(title: &str, y: &str, series: Vec<Series>) -> Self {
        Self { title: title.into(), x: "optimiser step".into(), y: y.into(), series }
    }
}

const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The corner of the plot area (x and y ranges) with the fewest points near it, for the legend.
fn emptiest_corner(points: &[(f64, f64)], (x0, x1): (f64, f64), (y0, y1): (f64, f64)) -> SeriesLabelPosition {
    // A legend covers about 40 % of the width and, with several lines, 40 % of the height.
    let near = |right: bool, top: bool| {
        points
            .iter()
            .filter(|(x, y)| {
                let fx = (x - x0) / (x1 - x0);
                let fy = (y - y0) / (y1 - y0);
                (if right { fx > 0.6 } else { fx < 0.4 }) && (if top { fy > 0.6 } else { fy < 0.4 })
            })
            .count()
    };
    // In order of preference when tied: the plots' usual empty corners first.
    [
        (near(true, false), SeriesLabelPosition::LowerRight),
        (near(true, true), SeriesLabelPosition::UpperRight),
        (near(false, true), SeriesLabelPosition::UpperLeft),
        (near(false, false), SeriesLabelPosition::LowerLeft),
    ]
    .into_iter()
    .min_by_key(|(n, _)| *n)
    .map_or(SeriesLabelPosition::UpperRight, |(_, p)| p)
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    // 5 % either side; a flat series gets ±5 % of its value (or ±0.05 around 0) so that its
    // ticks stay readable.
    let pad = ((hi - lo) * 0.05).max(0.05 * hi.abs().max(lo.abs())).max(if hi == lo { 0.05 } else { 0.0 });
    (lo - pad, hi + pad)
}

/// The y range of `series`: their points and the ends of their error bars.
fn y_range(series: &[Series]) -> (f64, f64) {
    let points = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let ends = series.iter().flat_map(|s| s.bars().flat_map(|(_, y, e)| [y - e, y + e]));
    range(points.chain(ends))
}

/// plotters' drawing errors, as anyhow errors.
fn drawing(e: impl std::fmt::Debug) -> anyhow::Error {
    anyhow::anyhow!("drawing a plot: {e:?}")
}

/// Draws `panels` on a grid of `cols` columns into the PNG `path`, atomically (drawn into a
/// temporary PNG beside it, renamed once whole). A series's colour is its place in its panel, so
/// that the same arms keep their colours across panels; a series with no finite point is left out,
/// legend entry included.
pub fn draw(path: &Path, panels: &[Panel], cols: usize) -> Result<()> {
    font()?;
    crate::io::replace_with(path, |tmp| draw_into(tmp, panels, cols))
}

fn draw_into(path: &Path, panels: &[Panel], cols: usize) -> Result<()> {
    let rows = panels.len().div_ceil(cols.max(1));
    let size = (480 * cols as u32, 340 * rows as u32);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    let areas = root.split_evenly((rows, cols));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        draw_panel(area, panel)?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Draws one panel into its area: axes, one line per series with its error bars, a legend.
fn draw_panel(area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>, panel: &Panel) -> Result<()> {
    let (x0, x1) = range(panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let (y0, y1) = y_range(&panel.series);
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(drawing)?;
    // Steps and iterations are whole numbers: label them so, one tick per iteration.
    let ticks = if panel.x == "iteration" { ((x1 - x0).round() as usize + 1).clamp(2, 12) } else { 10 };
    let mut xs = panel.series.iter().flat_map(|s| &s.points).map(|p| p.0).peekable();
    let whole = xs.peek().is_some() && xs.all(|x| x.fract() == 0.0);
    let x_label = |x: &f64| if whole { format!("{x:.0}") } else { format!("{x:.2}") };
    chart
        .configure_mesh()
        .x_labels(ticks)
        .x_label_formatter(&x_label)
        .light_line_style(WHITE)
        .x_desc(panel.x.as_str())
        .y_desc(panel.y.as_str())
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(drawing)?;
    for (k, s) in panel.series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| p.1.is_finite()).collect();
        // A series with nothing to draw (an arm no seed has finished yet) gets no legend
        // entry; the others keep their colours.
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(1)))
            .map_err(drawing)?
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2)));
        if pts.len() <= 30 {
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled()))).map_err(drawing)?;
        }
        chart
            .draw_series(
                s.bars().map(|(x, y, e)| ErrorBar::new_vertical(x, y - e, y, y + e, colour.stroke_width(1), 8)),
            )
            .map_err(drawing)?;
    }
    if panel.series.len() > 1 || !panel.series.iter().all(|s| s.label.is_empty()) {
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 12))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(emptiest_corner(
                &panel.series.iter().flat_map(|s| s.points.iter().copied()).collect::<Vec<_>>(),
                (x0, x1),
                (y0, y1),
            ))
            .draw()
            .map_err(drawing)?;
    }
    Ok(())
}

/// A metric of a step record, NaN when the step has none.
type StepMetric = fn(&StepRecord) -> Option<f64>;

/// The TOPR-family statistics of a step, if any.
fn topr(r: &StepRecord) -> Option<&ToprStats> {
    r.stats.topr.as_ref()
}

/// The per-step panels of training metrics, each line offset by its run's first step.
fn step_panels(runs: &[(String, Vec<StepRecord>)]) -> Vec<Panel> {
    let line = |metric: StepMetric, label: &dyn Fn(&str) -> String| -> Vec<Series> {
        let mut offset = 0.0;
        runs.iter()
            .map(|(name, rows)| {
                let points: Vec<(f64, f64)> =
                    rows.iter().map(|r| (offset + r.step as f64, metric(r).unwrap_or(f64::NAN))).collect();
                offset += rows.len() as f64;
                Series::new(label(name), points)
            })
            .collect()
    };
    let one = |metric: StepMetric, label: &str| -> Series {
        let mut s = Series::new(label, vec![]);
        for row in line(metric, &|_| String::new()) {
            s.points.extend(row.points);
        }
        s
    };
    let mut panels = vec![
        Panel::steps("training loss", "loss", line(|r| Some(r.stats.loss), &|n| n.to_string())),
        Panel::steps("gradient norm (before clipping)", "‖g‖", vec![one(|r| Some(r.grad_norm), "")]),
    ];
    let has_topr = runs.iter().any(|(_, rows)| rows.iter().any(|r| topr(r).is_some()));
    if has_topr {
        panels.push(Panel::steps(
            "effective positive proportion",
            "share of weight on positives",
            vec![
                one(|r| topr(r).and_then(|t| t.effective_positive_proportion), "in the batch"),
                one(|r| r.p_tilde, "target p~ (data set)"),
            ],
        ));
        panels.push(Panel::steps(
            "truncated fractions",
            "share of samples",
            vec![
                one(|r| topr(r).map(|t| t.truncated_fraction_pos), "positives (ratio outside [a+, b+])"),
                one(|r| topr(r).map(|t| t.truncated_fraction_neg), "negatives (ratio > 1)"),
            ],
        ));
        panels.push(Panel::steps(
            "importance weights",
            "weight",
            vec![
                one(|r| topr(r).map(|t| t.weight_mean), "mean applied weight"),
                one(|r| topr(r).map(|t| t.weight_max), "max applied weight"),
            ],
        ));
    }
    panels.push(Panel::steps(
        "log-ratio log pi - log mu (per token)",
        "mean",
        vec![one(|r| Some(r.stats.log_ratio_mean), "")],
    ));
    panels
}

/// `dir/training.png` from `dir/metrics.jsonl`.
pub fn plot_training(dir: &Path) -> Result<PathBuf> {
    let rows: Vec<StepRecord> = read_jsonl(&layout::metrics_file(dir))?;
    if rows.is_empty() {
        bail!("{}: no steps to plot", layout::metrics_file(dir).display());
    }
    let out = layout::training_plot(dir);
    draw(&out, &step_panels(&[("run".into(), rows)]), 3)?;
    Ok(out)
}

/// `work/iterations.png`: held-out accuracy and invalid rate per iteration, the data's share of
/// positives, and the per-step curves of every iteration's training.
pub fn plot_iterations(work: &Path) -> Result<PathBuf> {
    let run = LoopDir::new(work);
    let table: Vec<IterationRecord> = read_jsonl(&run.table())?;
    let per_iter = |metric: fn(&IterationRecord) -> Option<f64>| -> Vec<(f64, f64)> {
        table.iter().map(|r| (r.iteration as f64, metric(r).unwrap_or(f64::NAN))).collect()
    };
    let mut panels = vec![Panel {
        title: "held-out accuracy (greedy pass@1)".into(),
        x: "iteration".into(),
        y: "share of problems".into(),
        series: vec![
            Series::new("accuracy", per_iter(|r| Some(r.accuracy))),
            Series::new("invalid answers", per_iter(|r| Some(r.invalid_rate))),
            Series::new("positives in the sampled data", per_iter(|r| r.data_positive_fraction)),
        ],
    }];
    let mut runs = vec![];
    for r in table.iter().skip(1) {
        let i = r.iteration;
        let m = run.iteration(i).metrics();
        if m.exists() {
            runs.push((format!("iteration {i}"), read_jsonl(&m)?));
        }
    }
    panels.extend(step_panels(&runs));
    let out = run.plot();
    draw(&out, &panels, 3)?;
    Ok(out)
}

/// Runs `f`, turning a failure into a message on stderr: plots never fail a finished run.
pub fn report(what: &str, f: impl FnOnce() -> Result<PathBuf>) {
    match f() {
        Ok(p) => eprintln!("wrote {what} plot {}", p.display()),
        Err(e) => eprintln!("no {what} plot: {e:#}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bars_are_drawn_where_finite_and_positive_and_the_range_holds_their_ends() {
        let s = Series::new("arm", vec![(0.0, 0.5), (1.0, 0.6), (2.0, f64::NAN), (3.0, 0.55), (4.0, 0.52)])
            .with_errors(vec![0.3, f64::NAN, 0.2, 0.0]);
        // The second has no finite error, the third no finite point, the fourth a zero error and
        // the fifth none at all.
        assert_eq!(s.bars().collect::<Vec<_>>(), vec![(0.0, 0.5, 0.3)]);
        let (lo, hi) = y_range(std::slice::from_ref(&s));
        assert!(lo < 0.2 && hi > 0.8, "{lo} {hi}");
        let (lo, hi) = y_range(&[Series::new("arm", s.points.clone())]);
        assert!(lo > 0.4 && hi < 0.7, "{lo} {hi}");
    }
}
