//! `kvtier bench --plot FILE.svg`: retrieve and store bandwidth against
//! context length, with fio's sequential and random read bandwidth on the
//! same directory as horizontal reference lines.
//!
//! SVG only (plotters' SVG backend): text is emitted as `<text>` elements the
//! viewer renders with its own fonts, so no font files or font crates are needed.

use kvtier::error::{Error, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use std::ops::Range;
use std::path::Path;

/// One line of the plot.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Series {
    pub label: String,
    /// (context tokens, GiB/s).
    pub points: Vec<(f64, f64)>,
}

const WIDTH: u32 = 900;
const HEIGHT: u32 = 540;

/// Distinct colours for the measured lines (Okabe-Ito: tells apart for
/// colour-blind readers too), and greys for fio's reference lines.
const LINE_COLORS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
];
const REF_COLORS: [RGBColor; 3] = [
    RGBColor(60, 60, 60),
    RGBColor(130, 130, 130),
    RGBColor(170, 80, 80),
];

/// A token count the way context lengths are spoken of: 4096 is "4K",
/// 131072 "128K", 1048576 "1M".
fn token_label(tokens: f64) -> String {
    let n = tokens.round().max(0.0) as u64;
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}K", n >> 10)
    } else if n >= 1 << 10 {
        format!("{:.1}K", n as f64 / 1024.0)
    } else {
        n.to_string()
    }
}

/// Tick positions (log2 of tokens): the measured context lengths when there
/// are a readable number of them, else the powers of two in range.
fn key_points(xs: &[f64], lo: f64, hi: f64) -> Vec<f64> {
    let mut distinct: Vec<f64> = Vec::new();
    for &x in xs {
        if !distinct.iter().any(|d| (d - x).abs() < 1e-9) {
            distinct.push(x);
        }
    }
    distinct.sort_by(f64::total_cmp);
    if (2..=12).contains(&distinct.len()) {
        return distinct;
    }
    let (first, last) = (lo.ceil() as i64, hi.floor() as i64);
    let step = ((last - first) / 12 + 1).max(1) as usize;
    (first..=last).step_by(step).map(|e| e as f64).collect()
}

/// The x axis: log2 of the context length, linear in that space, with bold
/// ticks where we choose (the measured contexts) and light grid lines at
/// every power of two.
struct Log2Axis {
    range: Range<f64>,
    bold: Vec<f64>,
    light: Vec<f64>,
}

impl Log2Axis {
    fn new(range: Range<f64>, bold: Vec<f64>) -> Log2Axis {
        let light = (range.start.ceil() as i64..=range.end.floor() as i64)
            .map(|e| e as f64)
            .collect();
        Log2Axis { range, bold, light }
    }
}

impl Ranged for Log2Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let span = self.range.end - self.range.start;
        let t = (value - self.range.start) / span;
        limit.0 + (t * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.light.clone()
        } else {
            self.bold.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

fn check_finite(what: &str, label: &str, v: f64) -> Result<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "plot: {what} {v} of {label:?} is not a finite number"
        )))
    }
}

/// A plotters failure, with the file it was drawing.
fn plot_error(path: &Path, e: &dyn std::fmt::Display) -> Error {
    Error::io(
        format!("drawing the plot {}", path.display()),
        std::io::Error::other(e.to_string()),
    )
}

/// Retrieve and store bandwidth against context length (x: log2 scale,
/// ticks labelled 4K, 16K, 64K, 128K...), with horizontal dashed reference
/// lines (e.g. fio's sequential and random read bandwidth, GiB/s). Writes an
/// SVG of 900x540 with a title, axis labels and a legend.
pub fn plot_bandwidth_svg(
    flag: &str,
    path: &Path,
    title: &str,
    series: &[Series],
    references: &[(String, f64)],
) -> Result<()> {
    // Validate and move x to log2 space.
    let mut lines: Vec<(&str, Vec<(f64, f64)>)> = Vec::with_capacity(series.len());
    for s in series {
        let mut pts = Vec::with_capacity(s.points.len());
        for &(tokens, gib_s) in &s.points {
            check_finite("context length", &s.label, tokens)?;
            check_finite("bandwidth", &s.label, gib_s)?;
            if tokens <= 0.0 {
                return Err(Error::invalid(format!(
                    "plot: context length {tokens} of {:?} must be positive (log scale)",
                    s.label
                )));
            }
            pts.push((tokens.log2(), gib_s));
        }
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        lines.push((&s.label, pts));
    }
    for (label, gib_s) in references {
        check_finite("reference bandwidth", label, *gib_s)?;
    }

    let xs: Vec<f64> = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(x, _)| x))
        .collect();
    let (mut lo, mut hi) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| {
            (l.min(x), h.max(x))
        });
    if xs.is_empty() {
        // Nothing measured: the usual 4K..128K frame, references only.
        (lo, hi) = (12.0, 17.0);
    } else if hi - lo < 1.0 {
        (lo, hi) = (lo - 0.5, hi + 0.5);
    }
    let keys = key_points(&xs, lo, hi);
    let pad = (hi - lo) * 0.05;
    let (x0, x1) = (lo - pad, hi + pad);

    let ymax = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
        .chain(references.iter().map(|(_, y)| *y))
        .fold(0.0f64, f64::max);
    let ymin = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
        .chain(references.iter().map(|(_, y)| *y))
        .fold(0.0f64, f64::min);
    // Head room above the highest line for the legend.
    let entries = (lines.len() + references.len()) as f64;
    let ymax = if ymax > 0.0 { ymax } else { 1.0 } * (1.12 + 0.06 * entries);

    let draw_err = |e: &dyn std::fmt::Display| plot_error(path, e);

    write_svg(flag, path, |root| {
        let mut chart = frame(root, title)
            .build_cartesian_2d(Log2Axis::new(x0..x1, keys), ymin..ymax)
            .map_err(|e| draw_err(&e))?;
        let x_fmt = |v: &f64| token_label(v.exp2());
        let y_fmt = |v: &f64| format!("{v:.1}");
        chart
            .configure_mesh()
            .x_desc("context length (tokens, log2 scale)")
            .y_desc("bandwidth (GiB/s)")
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 13))
            .y_max_light_lines(2)
            .light_line_style(RGBColor(238, 238, 238))
            .bold_line_style(RGBColor(205, 205, 205))
            .draw()
            .map_err(|e| draw_err(&e))?;

        for (i, (label, gib_s)) in references.iter().enumerate() {
            let style = REF_COLORS[i % REF_COLORS.len()].stroke_width(2);
            chart
                .draw_series(DashedLineSeries::new(
                    [(x0, *gib_s), (x1, *gib_s)],
                    10,
                    6,
                    style,
                ))
                .map_err(|e| draw_err(&e))?
                .label(format!("{label} ({gib_s:.2} GiB/s)"))
                .legend(move |(x, y)| DashedPathElement::new([(x, y), (x + 22, y)], 6, 4, style));
        }

        for (i, (label, pts)) in lines.iter().enumerate() {
            let color = LINE_COLORS[i % LINE_COLORS.len()];
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|e| draw_err(&e))?
                .label(*label)
                .legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + PathElement::new([(0, 0), (22, 0)], color.stroke_width(2))
                        + Circle::new((11, 0), 4, color.filled())
                });
            chart
                .draw_series(PointSeries::of_element(
                    pts.iter().copied(),
                    4,
                    color.filled(),
                    &|c, size, style| Circle::new(c, size, style),
                ))
                .map_err(|e| draw_err(&e))?;
        }

        if !lines.is_empty() || !references.is_empty() {
            draw_legend(&mut chart).map_err(|e| draw_err(&e))?;
        }
        Ok(())
    })
}

/// Draw a plot with `draw` on a white SVG canvas of WIDTH x HEIGHT, then
/// write it as the report `path` (given as `flag`).
fn write_svg(
    flag: &str,
    path: &Path,
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, plotters::coord::Shift>) -> Result<()>,
) -> Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_error(path, &e))?;
        draw(&root)?;
        root.present().map_err(|e| plot_error(path, &e))?;
    }
    crate::output::write_report(flag, path, crate::output::ReportKind::Svg, svg.as_bytes())
}

/// The frame both plots share: a title, margins and room for axis labels.
fn frame<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, SVGBackend<'b>> {
    let mut b = ChartBuilder::on(root);
    b.caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(52)
        .y_label_area_size(64);
    b
}

/// The legend both plots draw: upper left, over a light background.
fn draw_legend<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
) -> std::result::Result<(), DrawingAreaErrorKind<<SVGBackend<'a> as DrawingBackend>::ErrorType>> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .margin(10)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(RGBColor(160, 160, 160))
        .draw()
}

/// Lines on linear axes (e.g. `kvtier replay --sweep`: bubble time against
/// hit rate). `series` points are (x, y); labels go to the legend.
pub fn plot_lines_svg(
    flag: &str,
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<()> {
    for s in series {
        for &(x, y) in &s.points {
            check_finite("x", &s.label, x)?;
            check_finite("y", &s.label, y)?;
        }
    }
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &(x, _)| {
        (l.min(x), h.max(x))
    });
    let (x0, x1) = if x0.is_finite() && x1 > x0 {
        (x0, x1)
    } else {
        (0.0, 1.0)
    };
    let pad = (x1 - x0) * 0.05;
    let ymax = all().fold(0.0f64, |m, &(_, y)| m.max(y));
    let ymax = if ymax > 0.0 { ymax } else { 1.0 } * (1.15 + 0.06 * series.len() as f64);
    let draw_err = |e: &dyn std::fmt::Display| plot_error(path, e);
    write_svg(flag, path, |root| {
        let mut chart = frame(root, title)
            .build_cartesian_2d((x0 - pad)..(x1 + pad), 0.0..ymax)
            .map_err(|e| draw_err(&e))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 13))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()
            .map_err(|e| draw_err(&e))?;
        for (i, s) in series.iter().enumerate() {
            let color = LINE_COLORS[i % LINE_COLORS.len()];
            let mut pts = s.points.clone();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|e| draw_err(&e))?
                .label(s.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 22, y)], color.stroke_width(2))
                });
            chart
                .draw_series(PointSeries::of_element(
                    pts.iter().copied(),
                    4,
                    color.filled(),
                    &|c, size, style| Circle::new(c, size, style),
                ))
                .map_err(|e| draw_err(&e))?;
        }
        draw_legend(&mut chart).map_err(|e| draw_err(&e))?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_read_like_context_lengths() {
        assert_eq!(token_label(4096.0), "4K");
        assert_eq!(token_label(16384.0), "16K");
        assert_eq!(token_label(131072.0), "128K");
        assert_eq!(token_label(1048576.0), "1M");
        assert_eq!(token_label(100_000.0), "97.7K");
        assert_eq!(token_label(512.0), "512");
        assert_eq!(token_label(17f64.exp2()), "128K");
    }

    #[test]
    fn writes_svg_with_every_label() {
        let dir = kvtier::scratch::TestDir::new("plot-test");
        let path = dir.file("bw.svg");
        let ctx = [4096.0, 16384.0, 65536.0, 131072.0];
        let series = vec![
            Series {
                label: "retrieve".into(),
                points: ctx
                    .iter()
                    .zip([3.1, 5.2, 6.0, 6.1])
                    .map(|(&x, y)| (x, y))
                    .collect(),
            },
            Series {
                label: "store".into(),
                points: ctx
                    .iter()
                    .zip([2.0, 3.5, 4.1, 4.2])
                    .map(|(&x, y)| (x, y))
                    .collect(),
            },
        ];
        let refs = vec![
            ("fio seq read".to_string(), 6.8),
            ("fio rand read 80k".to_string(), 5.9),
        ];
        plot_bandwidth_svg("--plot", &path, "Llama-3-8B on /mnt/nvme", &series, &refs).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("<svg"), "{svg}");
        assert!(svg.contains("width=\"900\"") && svg.contains("height=\"540\""));
        for want in [
            "retrieve",
            "store",
            "fio seq read",
            "fio rand read 80k",
            "Llama-3-8B on /mnt/nvme",
            "GiB/s",
            "context length",
            "\n4K\n",
            "\n16K\n",
            "\n64K\n",
            "\n128K\n",
        ] {
            assert!(svg.contains(want), "{want} missing from the SVG");
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn draws_edge_cases() {
        let dir = kvtier::scratch::TestDir::new("plot-test");
        let path = dir.file("edge.svg");
        // No series, only references; a single point; zero bandwidth.
        plot_bandwidth_svg(
            "--plot",
            &path,
            "refs only",
            &[],
            &[("fio seq read".into(), 1.0)],
        )
        .unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("\n128K\n"));
        let one = Series {
            label: "retrieve".into(),
            points: vec![(32768.0, 0.0)],
        };
        plot_bandwidth_svg("--plot", &path, "one point", &[one], &[]).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("\n32K\n"));
        std::fs::remove_file(&path).unwrap();

        let bad = Series {
            label: "bad".into(),
            points: vec![(0.0, 1.0)],
        };
        assert!(plot_bandwidth_svg("--plot", &path, "t", &[bad], &[]).is_err());
        let nan = Series {
            label: "nan".into(),
            points: vec![(4096.0, f64::NAN)],
        };
        assert!(plot_bandwidth_svg("--plot", &path, "t", &[nan], &[]).is_err());
        let missing_dir = Path::new("/nonexistent-kvtier-dir/plot.svg");
        let e = plot_bandwidth_svg("--plot", missing_dir, "t", &[], &[]).unwrap_err();
        assert!(
            e.to_string().contains("/nonexistent-kvtier-dir/plot.svg"),
            "{e}"
        );
    }
}
