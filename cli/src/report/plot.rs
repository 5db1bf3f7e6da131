//! The report's charts as SVG (plotters' SVG backend): latency, bandwidth and all-reduce time
//! against message size, each tbrdma series drawn beside the kernel floor measured in the same
//! run. Both axes are logarithmic, as perftest and nccl-tests plots usually are.

use anyhow::anyhow;
use plotters::prelude::*;
use serde_json::Value;

/// One chart, ready to embed.
#[derive(Debug)]
pub struct Chart {
    /// File stem and HTML id (`latency`, `bandwidth`, `allreduce`).
    pub id: &'static str,
    /// Caption.
    pub title: &'static str,
    /// What the chart shows, one sentence for the page.
    pub note: &'static str,
    /// The SVG document.
    pub svg: String,
    /// Series drawn, with their point counts.
    pub series: Vec<(String, usize)>,
}

struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    floor: bool,
}

/// Bytes per MiB/s → Gbit/s.
const MIB_S_TO_GBIT_S: f64 = 1_048_576.0 * 8.0 / 1e9;

/// `(x, y)` of every row of step `name` that has both keys, `y` scaled.
fn points(report: &Value, name: &str, x: &str, y: &str, scale: f64) -> Vec<(f64, f64)> {
    let step = report["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["name"] == name);
    let mut out: Vec<(f64, f64)> = step
        .and_then(|s| s["rows"].as_array())
        .into_iter()
        .flatten()
        .filter_map(|r| Some((r[x].as_f64()?, r[y].as_f64()? * scale)))
        .filter(|(x, y)| *x > 0.0 && *y > 0.0 && x.is_finite() && y.is_finite())
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

fn series(report: &Value, specs: &[(&str, &str, &str, &str, f64, bool)]) -> Vec<Series> {
    specs
        .iter()
        .map(|&(label, step, x, y, scale, floor)| Series {
            name: label.to_owned(),
            points: points(report, step, x, y, scale),
            floor,
        })
        .filter(|s| !s.points.is_empty())
        .collect()
}

fn bytes_label(v: f64) -> String {
    let v = v.round() as u64;
    match v {
        v if v >= 1 << 20 && v % (1 << 20) == 0 => format!("{}M", v >> 20),
        v if v >= 1 << 10 && v % (1 << 10) == 0 => format!("{}K", v >> 10),
        v => v.to_string(),
    }
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];
const FLOOR_COLORS: [RGBColor; 2] = [RGBColor(90, 90, 90), RGBColor(160, 120, 40)];

fn draw(title: &str, y_desc: &str, all: &[Series]) -> anyhow::Result<String> {
    let err = |e: &dyn std::fmt::Debug| anyhow!("drawing {title}: {e:?}");
    let xs = all.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let ys = all.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (y0, y1) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (820, 460)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(
                (x0 / 1.5..x1 * 1.5).log_scale(),
                (y0 / 1.5..y1 * 1.5).log_scale(),
            )
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .y_desc(y_desc)
            .x_label_formatter(&|v| bytes_label(*v))
            .draw()
            .map_err(|e| err(&e))?;
        let (mut tb, mut fl) = (0, 0);
        for s in all {
            let color = if s.floor {
                fl += 1;
                FLOOR_COLORS[(fl - 1) % FLOOR_COLORS.len()]
            } else {
                tb += 1;
                COLORS[(tb - 1) % COLORS.len()]
            };
            let width = if s.floor { 1 } else { 2 };
            chart
                .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(width)))
                .map_err(|e| err(&e))?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(width))
                });
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

/// The charts that have data in `report` (a chart with no series is left out).
pub fn charts(report: &Value) -> anyhow::Result<Vec<Chart>> {
    let specs: [(
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        Vec<Series>,
    ); 3] = [
        (
            "latency",
            "Latency by message size",
            "tbrdma pingpong (WRITE and SEND one-way, READ full round trip as ib_read_lat) beside a busy-polling kernel UDP ping-pong between the same hosts (one-way).",
            "µs (typical)",
            series(
                report,
                &[
                    (
                        "tbrdma WRITE (one-way)",
                        "latency_write",
                        "bytes",
                        "t_typical_us",
                        1.0,
                        false,
                    ),
                    (
                        "tbrdma SEND (one-way)",
                        "latency_send",
                        "bytes",
                        "t_typical_us",
                        1.0,
                        false,
                    ),
                    (
                        "tbrdma READ (round trip)",
                        "latency_read",
                        "bytes",
                        "t_typical_us",
                        1.0,
                        false,
                    ),
                    (
                        "kernel UDP ping-pong (one-way)",
                        "floor_udp_one_way",
                        "size",
                        "time_us",
                        1.0,
                        true,
                    ),
                ],
            ),
        ),
        (
            "bandwidth",
            "Bandwidth by message size",
            "tbrdma bw (WRITE, one queue pair) on one cable and on every cable, beside the bus bandwidth of a plain TCP ring all-reduce over the same links.",
            "Gbit/s",
            series(
                report,
                &[
                    (
                        "tbrdma WRITE, 1 rail",
                        "bandwidth_1_rail",
                        "bytes",
                        "bw_avg_mib_s",
                        MIB_S_TO_GBIT_S,
                        false,
                    ),
                    (
                        "tbrdma WRITE, all rails",
                        "bandwidth_all_rails",
                        "bytes",
                        "bw_avg_mib_s",
                        MIB_S_TO_GBIT_S,
                        false,
                    ),
                    (
                        "kernel TCP ring all-reduce (bus bw)",
                        "allreduce_tcp_ring",
                        "size",
                        "busbw_gbs",
                        8.0,
                        true,
                    ),
                ],
            ),
        ),
        (
            "allreduce",
            "All-reduce time by size",
            "tbrdma allreduce (f32 sum, as nccl-tests' all_reduce_perf) beside a plain TCP ring all-reduce and the kernel's floor for a two-rank exchange (both send, then both receive).",
            "µs per call",
            series(
                report,
                &[
                    (
                        "tbrdma all-reduce",
                        "allreduce_tbrdma",
                        "size",
                        "time_us",
                        1.0,
                        false,
                    ),
                    (
                        "kernel TCP ring all-reduce",
                        "allreduce_tcp_ring",
                        "size",
                        "time_us",
                        1.0,
                        true,
                    ),
                    (
                        "kernel UDP exchange (floor)",
                        "floor_udp_exchange",
                        "size",
                        "time_us",
                        1.0,
                        true,
                    ),
                ],
            ),
        ),
    ];
    let mut out = Vec::new();
    for (id, title, note, y, all) in specs {
        if all.is_empty() {
            continue;
        }
        out.push(Chart {
            id,
            title,
            note,
            svg: draw(title, y, &all)?,
            series: all
                .iter()
                .map(|s| (s.name.clone(), s.points.len()))
                .collect(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_draws_one_line_per_series_and_skips_empty_ones() {
        let report = serde_json::json!({"steps": [
            {"name": "latency_write", "rows": [{"bytes": 8, "t_typical_us": 5.0}, {"bytes": 4096, "t_typical_us": 9.0}]},
            {"name": "floor_udp_one_way", "rows": [{"size": 8, "time_us": 4.0}, {"size": 4096, "time_us": 7.5}]},
            {"name": "latency_send", "rows": [{"bytes": 8, "t_typical_us": "garbage"}]},
        ]});
        let charts = charts(&report).unwrap();
        assert_eq!(charts.len(), 1);
        assert_eq!(
            charts[0].series,
            [
                ("tbrdma WRITE (one-way)".to_string(), 2),
                ("kernel UDP ping-pong (one-way)".to_string(), 2)
            ]
        );
        assert!(
            charts[0].svg.matches("<polyline").count() >= 2,
            "a line per series"
        );
        assert!(charts[0].svg.contains("kernel UDP ping-pong"));
    }
}
