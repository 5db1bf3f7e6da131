//! report.html: one self-contained page (inline CSS and SVG, no scripts or outside resources)
//! with both hosts, the charts, the tensor-parallel estimate, every step's command and status,
//! and report.json itself embedded for whoever wants the numbers.

use std::fmt::Write as _;

use serde_json::Value;

use crate::report::plot::Chart;

/// Escapes text for HTML (every value from the peer or a file is untrusted).
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "–".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn links(machine: &Value) -> String {
    let list: Vec<String> = machine["links"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            format!(
                "{} ({}, MTU {})",
                text(&d["interface"]),
                d["addresses"]
                    .as_array()
                    .map(|a| a.iter().map(text).collect::<Vec<_>>().join(", "))
                    .unwrap_or_default(),
                text(&d["mtu"])
            )
        })
        .collect();
    list.join("; ")
}

/// How one row of the hosts table reads a host's description.
type Field = fn(&Value) -> String;

fn machines(report: &Value) -> String {
    let mut out =
        String::from("<table><tr><th></th><th>this host (client)</th><th>peer (server)</th></tr>");
    let rows: [(&str, Field); 6] = [
        ("host", |m| text(&m["hostname"])),
        ("kernel", |m| text(&m["kernel"])),
        ("CPU", |m| {
            format!("{} × {}", text(&m["cpus"]), text(&m["cpu"]))
        }),
        ("glibc", |m| text(&m["glibc"])),
        ("links", links),
        ("busy poll / read", |m| {
            let s = &m["settings"]["sysctls"];
            format!(
                "{} / {}",
                text(&s["net.core.busy_poll"]),
                text(&s["net.core.busy_read"])
            )
        }),
    ];
    for (label, get) in rows {
        let _ = write!(
            out,
            "<tr><th>{label}</th><td>{}</td><td>{}</td></tr>",
            esc(&get(&report["client"])),
            esc(&get(&report["server"]))
        );
    }
    out.push_str("</table>");
    out
}

fn tensor_parallel(report: &Value) -> String {
    let rows: Vec<&Value> = report["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["name"].as_str().is_some_and(|n| n.starts_with("tp_")))
        .collect();
    if rows.is_empty() {
        return "<p>Not measured (the collective runs need a hostfile).</p>".into();
    }
    let mut out = String::from(
        "<table><tr><th>model</th><th>hidden × layers</th><th>bytes per all-reduce</th><th>all-reduce (µs, mean)</th><th>communication per token (ms)</th><th>tokens/s ceiling from communication</th></tr>",
    );
    for step in rows {
        let name = step["name"]
            .as_str()
            .unwrap_or("")
            .trim_start_matches("tp_");
        let Some(r) = step["rows"].as_array().and_then(|r| r.first()) else {
            let _ = write!(
                out,
                "<tr><td>{}</td><td colspan=5>failed: {}</td></tr>",
                esc(name),
                esc(&text(&step["error"]))
            );
            continue;
        };
        let f = |k: &str, digits: usize| {
            r[k].as_f64()
                .map_or("–".into(), |v| format!("{v:.digits$}"))
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{} × {}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(name),
            esc(&text(&r["hidden"])),
            esc(&text(&r["layers"])),
            esc(&text(&r["bytes_per_allreduce"])),
            f("allreduce_us_mean", 1),
            f("comm_ms_per_token", 3),
            f("tokens_per_s_ceiling", 1)
        );
    }
    out.push_str("</table>");
    out
}

fn steps(report: &Value) -> String {
    let mut out = String::from("<table><tr><th>step</th><th>command</th><th>result</th></tr>");
    for s in report["steps"].as_array().into_iter().flatten() {
        let result = if s["ok"] == true {
            format!("{} rows", s["rows"].as_array().map_or(0, Vec::len))
        } else {
            format!("failed: {}", text(&s["error"]))
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td><code>{}</code></td><td>{}</td></tr>",
            esc(&text(&s["name"])),
            esc(&text(&s["command"])),
            esc(&result)
        );
    }
    out.push_str("</table>");
    out
}

/// The whole page.
pub fn html(report: &Value, charts: &[Chart]) -> String {
    let mut figures = String::new();
    for c in charts {
        let series: Vec<String> = c
            .series
            .iter()
            .map(|(n, k)| format!("{n}: {k} points"))
            .collect();
        let _ = write!(
            figures,
            "<figure id=\"{id}\" data-series=\"{count}\"><figcaption><b>{title}</b>. {note} <small>({series})</small></figcaption>{svg}</figure>",
            id = c.id,
            count = c.series.len(),
            title = esc(c.title),
            note = esc(c.note),
            series = esc(&series.join("; ")),
            svg = c
                .svg
                .trim_start_matches("<?xml version=\"1.0\" encoding=\"UTF-8\"?>")
                .trim(),
        );
    }
    if charts.is_empty() {
        figures.push_str("<p>No figures: every step failed (see the table below).</p>");
    }
    // Inside <script>, only `</` can end the element: escape it.
    let data = serde_json::to_string(report)
        .unwrap_or_default()
        .replace("</", "<\\/");
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>tbrdma report: {host} ↔ {peer}</title>\
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}table{{border-collapse:collapse;margin:1em 0}}\
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}}figure{{margin:2em 0}}svg{{max-width:100%;height:auto}}\
code{{font-size:90%}}</style></head><body>\
<h1>tbrdma report</h1><p>tbrdma {version}{quick}, between {host} and {peer}. Every figure was measured in this run; the kernel's floors beside them too.</p>\
<h2>Hosts</h2>{machines}<h2>Figures</h2>{figures}<h2>Tensor-parallel decode estimate</h2>{tp}<h2>Steps</h2>{steps}\
<script type=\"application/json\" id=\"report-data\">{data}</script></body></html>\n",
        host = esc(&text(&report["client"]["hostname"])),
        peer = esc(&text(&report["peer"])),
        version = esc(&text(&report["version"])),
        quick = if report["quick"] == true {
            " (quick sweep)"
        } else {
            ""
        },
        machines = machines(report),
        tp = tensor_parallel(report),
        steps = steps(report),
    )
}
