//! The stdout tables and the JSON report of the adapter benches.

use serde_json::{json, Value};

use super::bulk::{self, BulkResult, BULK_CALLERS};
use super::load::{
    self, quantile_ms, segment_order, Labels, PairResult, Side, SEGMENTS_PER_SIDE, WARMUP_OPS_PER_CLIENT,
};
use super::workload::TOTAL_KEYS;
use super::{write_report, Config};

/// A plain-text table: the first `left` columns left-aligned, the rest right-aligned, two spaces
/// between columns, a dashed rule under the header.
pub fn aligned(header: &[&str], rows: &[Vec<String>], left: usize) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let line = |cells: &[&str]| -> String {
        let mut out = String::new();
        for (i, (cell, width)) in cells.iter().zip(&widths).enumerate() {
            let width = *width;
            if i < left {
                out.push_str(&format!("{cell:<width$}  "));
            } else {
                out.push_str(&format!("{cell:>width$}  "));
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
        out
    };
    let mut out = line(header);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    out.push_str(&line(&rule.iter().map(String::as_str).collect::<Vec<_>>()));
    for row in rows {
        out.push_str(&line(&row.iter().map(String::as_str).collect::<Vec<_>>()));
    }
    out
}

/// One row per side of each pair; ratios on the facade's row.
fn pair_table(results: &[PairResult], labels: &Labels) -> String {
    let header = [
        "operation",
        "side",
        labels.calls_column,
        "ops",
        "errors",
        "ops/s",
        "p50 ms",
        "p99 ms",
        labels.counter_column,
        "p50 ratio",
        "ops/s ratio",
    ];
    let mut rows = Vec::new();
    for r in results {
        for side in r.sides() {
            let facade = side.side == Side::Facade;
            rows.push(vec![
                if facade { r.pair.name().to_owned() } else { String::new() },
                side.side.name().to_owned(),
                r.calls.to_owned(),
                side.ops.to_string(),
                (side.errors + side.warmup_errors).to_string(),
                format!("{:.0}", side.throughput()),
                format!("{:.3}", side.percentile_ms(0.50)),
                format!("{:.3}", side.percentile_ms(0.99)),
                side.counted_per_op(labels).map(|c| format!("{c:.2}")).unwrap_or_else(|| "-".into()),
                if facade { format!("{:.3}x", r.p50_ratio()) } else { String::new() },
                if facade { format!("{:.3}x", r.throughput_ratio()) } else { String::new() },
            ]);
        }
    }
    aligned(&header, &rows, 3)
}

/// One row per bulk phase.
fn bulk_table(results: &[BulkResult], labels: &Labels) -> String {
    let in_container = format!("in {}", labels.container);
    let header = [
        "operation",
        "precondition",
        labels.calls_column,
        "docs",
        "batches",
        "callers",
        "errors",
        "seconds",
        "docs/s",
        "batch p50 ms",
        "batch p99 ms",
        in_container.as_str(),
        "listed",
    ];
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            vec![
                r.label.to_owned(),
                r.precondition.to_owned(),
                r.calls.to_owned(),
                r.docs.to_string(),
                r.batches.to_string(),
                BULK_CALLERS.to_string(),
                r.errors.to_string(),
                format!("{:.2}", r.elapsed.as_secs_f64()),
                format!("{:.0}", r.docs_per_s()),
                format!("{:.1}", quantile_ms(&r.latency, 0.50)),
                format!("{:.1}", quantile_ms(&r.latency, 0.99)),
                r.verified.to_string(),
                r.listed.to_string(),
            ]
        })
        .collect();
    aligned(&header, &rows, 3)
}

/// Prints the pair table and, when there was a bulk phase, the bulk table, each followed by its
/// legend.
pub fn print_tables(labels: &Labels, results: &[PairResult], pair_legend: &str, bulk: Option<(&[BulkResult], &str)>) {
    println!();
    print!("{}", pair_table(results, labels));
    println!("{pair_legend}");
    if let Some((bulk, legend)) = bulk {
        println!();
        print!("{}", bulk_table(bulk, labels));
        println!("{legend}");
    }
}

/// What the report says about where the server came from.
pub struct Origin<'a> {
    pub name: &'a str,
    pub server: &'a str,
    pub server_origin: &'a str,
}

/// Prints what failed, writes the JSON report and says FAILED if anything did; whether all passed.
pub fn conclude(
    origin: &Origin<'_>,
    config: &Config,
    nproc: usize,
    results: &[PairResult],
    bulk: Option<&[BulkResult]>,
    labels: &Labels,
) -> Result<bool, String> {
    let pairs_passed = load::report_failures(origin.name, results);
    let passed = bulk.is_none_or(|bulk| bulk::report_failures(origin.name, bulk)) && pairs_passed;
    write_report(origin.name, &report_json(origin, config, nproc, passed, results, bulk, labels))?;
    if !passed {
        eprintln!("{}: FAILED: some operations errored", origin.name);
    }
    Ok(passed)
}

/// The JSON report: settings, then `operations` and, when the bench has a bulk phase,
/// `bulk_writes`.
fn report_json(
    origin: &Origin<'_>,
    config: &Config,
    nproc: usize,
    passed: bool,
    results: &[PairResult],
    bulk: Option<&[BulkResult]>,
    labels: &Labels,
) -> Value {
    let mut report = json!({
        "benchmark": origin.name,
        "server": origin.server,
        "server_origin": origin.server_origin,
        "nproc": nproc,
        "clients": config.clients,
        "seconds_per_side": config.seconds,
        "max_ops_per_side": config.max_requests,
        "segments_per_side": SEGMENTS_PER_SIDE,
        "segment_order": segment_order().iter().map(|s| s.name()).collect::<Vec<_>>(),
        "warmup_ops_per_side": WARMUP_OPS_PER_CLIENT * config.clients as u64,
        "documents": TOTAL_KEYS,
        "passed": passed,
        "operations": results.iter().map(|r| r.to_json(labels)).collect::<Vec<_>>(),
    });
    if let Some(bulk) = bulk {
        report["bulk_writes"] = bulk.iter().map(|b| b.to_json(labels)).collect();
    }
    report
}
