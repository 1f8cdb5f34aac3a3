//! The node's container runtime, read over CRI: the pod sandboxes it runs, beside the pods
//! capture recorded (`view`), so that a meshed pod capture never saw and a record whose pod is
//! gone are both told.

pub mod container_config;
pub mod cri;
pub mod report;
pub mod sandbox;
pub mod view;
#[cfg(test)]
mod view_tests;

use std::path::Path;

use serde::Serialize;

pub use self::{
    cri::{Cri, CriError},
    report::{ReconcileReport, Repair},
    sandbox::Sandbox,
    view::{node_view, NodeView, Orphan, OrphanSandbox, SandboxView, Standing},
};
use crate::{cni::PluginConfig, paths::Paths, record};

/// `capture status --all`'s view of the runtime; the field names are stable.
#[derive(Clone, Debug, Serialize)]
pub struct RuntimeReport {
    pub cri_socket: String,
    /// Why the runtime could not be read; nothing else is then known.
    pub error: Option<String>,
    /// Where the rules for which pods are meshed came from (the chained capture-cni entry, or
    /// the plugin's defaults where capture is not chained).
    pub selection: String,
    #[serde(flatten)]
    pub view: NodeView,
}

/// The selection rules the node's capture-cni applies: its chained entry's keys, or its
/// defaults (with where they came from, in words).
#[must_use]
pub fn selection_rules(cni_conf_dir: &Path) -> (PluginConfig, String) {
    match crate::install::chained_plugin_config(cni_conf_dir) {
        Ok(Some(cfg)) => (
            cfg,
            format!(
                "the capture-cni entry chained in {}",
                cni_conf_dir.display()
            ),
        ),
        Ok(None) => (
            PluginConfig::default(),
            format!(
                "capture-cni's defaults (it is not chained in {})",
                cni_conf_dir.display()
            ),
        ),
        Err(e) => (
            PluginConfig::default(),
            format!("capture-cni's defaults (the chained entry cannot be read: {e})"),
        ),
    }
}

/// The node's sandboxes beside its records, read now (blocking: for the CLI).
///
/// # Errors
/// The records cannot be read. An unreachable runtime is a report with its error.
pub fn report_blocking(
    paths: &Paths,
    cri_socket: &Path,
    cni_conf_dir: &Path,
) -> Result<RuntimeReport, record::RecordError> {
    let records = record::load_all(paths)?;
    let (selection_cfg, selection) = selection_rules(cni_conf_dir);
    let (view, error) = match cri::sandboxes_blocking(cri_socket) {
        Ok(sandboxes) => (node_view(&sandboxes, &records, &selection_cfg), None),
        Err(e) => (NodeView::default(), Some(e.to_string())),
    };
    Ok(RuntimeReport {
        cri_socket: cri_socket.display().to_string(),
        error,
        selection,
        view,
    })
}
