//! What the agent's last reconcile pass found and did, kept in `<state-dir>/reconcile.json` for
//! `capture status` (the agent's view of the node, beside the records).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{fsutil::write_atomic, paths::Paths};

/// What the agent does with a meshed pod it finds running uncaptured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Repair {
    /// Capture it in place, as CNI ADD would have (its open connections stay as they are).
    Capture,
    /// Stop its sandbox through the runtime, so that the kubelet creates it again through the
    /// CNI chain.
    Restart,
    /// Change nothing; say so in the log, `capture status` and the metrics.
    Report,
}

impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Capture => "capture",
            Self::Restart => "restart",
            Self::Report => "report",
        })
    }
}

/// A meshed sandbox the pass found uncaptured, and what became of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Uncaptured {
    pub pod: String,
    pub sandbox_id: String,
    pub why: String,
    /// `capture`, `restart`, `report`, or `none` (not ready: nothing to act on yet).
    pub action: String,
    /// `ok`, `failed: ...`, or `pending`.
    pub result: String,
}

/// The last pass; the field names are stable.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcileReport {
    pub at_unix: u64,
    pub cri_socket: String,
    pub repair: Option<Repair>,
    pub period_secs: u64,
    /// Why the runtime could not be read: nothing was changed in that pass.
    pub runtime_error: Option<String>,
    pub sandboxes: usize,
    pub uncaptured: Vec<Uncaptured>,
    /// Pods released because their sandbox is gone (a DEL that never came).
    pub released: Vec<String>,
    /// Whether the runtime's event stream was open (passes also follow its events).
    #[serde(default)]
    pub event_stream: bool,
}

fn path(paths: &Paths) -> PathBuf {
    paths.state_dir.join("reconcile.json")
}

/// Keeps `report` for `capture status`.
///
/// # Errors
/// The state directory cannot be written.
pub fn save(paths: &Paths, report: &ReconcileReport) -> std::io::Result<()> {
    let text = serde_json::to_vec_pretty(report).map_err(std::io::Error::other)?;
    write_atomic(&path(paths), &text, None)
}

/// The last pass's report, if an agent wrote one.
#[must_use]
pub fn load(paths: &Paths) -> Option<ReconcileReport> {
    serde_json::from_slice(&std::fs::read(path(paths)).ok()?).ok()
}

/// Forgets the report (an agent that does not reconcile leaves none behind).
pub fn forget(paths: &Paths) {
    let _ = std::fs::remove_file(path(paths));
}
