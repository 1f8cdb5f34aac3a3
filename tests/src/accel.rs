//! The acceleration in the parity matrix: on a kernel whose checks find differences only at the
//! edges (below), every parity case also runs in a pod with acceleration on.

use std::sync::OnceLock;

use serde_json::Value;

use crate::topology::Topology;

/// Cases in which acceleration differs from TCP at the edges (resets, buffer limits, socket
/// options, splice), as 6.18 does. Tests accept these, and only these, to run accelerated.
pub const EDGE_CASES: [&str; 5] = [
    "close_with_unread_data_by_app",
    "close_with_unread_data_by_proxy",
    "nonblocking_backpressure",
    "so_rcvlowat",
    "splice_both_ways",
];

/// The names of the cases a check report found different.
#[must_use]
pub fn differences(report: &Value) -> Vec<String> {
    report["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .filter(|c| c["passed"] == false)
        .map(|c| c["name"].as_str().expect("name").to_string())
        .collect()
}

/// This kernel's verdict (the node file `capture accel-check` writes), if acceleration moves
/// bytes here and differs only in `EDGE_CASES`; checked once per test run (the check takes
/// seconds, half a minute under emulation, and every binary of the parity matrix asks).
fn edge_only_verdict() -> Option<&'static Value> {
    static VERDICT: OnceLock<Option<Value>> = OnceLock::new();
    VERDICT
        .get_or_init(|| crate::once_per_run("accel-verdict", check_edge_only))
        .as_ref()
}

fn check_edge_only() -> Option<Value> {
    let topo = Topology::new();
    let out = topo.capture(&["accel-check", "--json"]);
    let report: Value = serde_json::from_slice(&out.stdout).ok()?;
    let moved = report["accelerated_bytes"].as_u64() > Some(0);
    let edge_only = differences(&report)
        .iter()
        .all(|d| EDGE_CASES.contains(&d.as_str()));
    if !(moved && edge_only) {
        eprintln!("acceleration is left out of the parity matrix on this kernel: {report}");
        return None;
    }
    let node = std::fs::read(topo.dirs.state.join("acceleration.json")).ok()?;
    serde_json::from_slice(&node).ok()
}

/// Whether this kernel accelerates with this build, differing only in `EDGE_CASES` (the
/// verdict `allow` writes into a node).
#[must_use]
pub fn kernel_allows() -> bool {
    edge_only_verdict().is_some()
}

/// Lets `topo`'s node accelerate pods that ask, accepting the edge cases: this kernel's verdict
/// (it holds for every node with this kernel and build) is written into its state directory.
/// False where the kernel differs in more than the edges.
#[must_use]
pub fn allow(topo: &Topology) -> bool {
    let Some(verdict) = edge_only_verdict() else {
        return false;
    };
    let mut node = verdict.clone();
    node["allowed"] = Value::Bool(true);
    node["accepted"] = EDGE_CASES.iter().map(|c| Value::from(*c)).collect();
    std::fs::create_dir_all(&topo.dirs.state).expect("state directory");
    std::fs::write(
        topo.dirs.state.join("acceleration.json"),
        serde_json::to_vec(&node).expect("JSON"),
    )
    .expect("acceleration.json");
    true
}
