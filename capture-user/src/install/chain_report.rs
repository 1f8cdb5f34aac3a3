//! capture-cni's place in the node's CNI configuration as the agent's watcher sees it
//! (`agent::cni_watch`), kept in the state directory for `capture status`: whether it is
//! chained, and a neighbour that keeps rewriting the configuration without it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Who rewrites the configuration, as far as the directory tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Neighbour {
    /// Cilium with `cni.exclusive=true`: files renamed to `*.cilium_bak`, or a `cilium-cni`
    /// conflist.
    CiliumExclusive,
    Unknown,
}

impl Neighbour {
    /// Reads the configuration directory for the rewriter's traces.
    #[must_use]
    pub fn of(conf_dir: &Path, active: Option<&Path>) -> Self {
        let renamed_by_cilium = std::fs::read_dir(conf_dir).is_ok_and(|dir| {
            dir.flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".cilium_bak"))
        });
        let cilium_conflist = active
            .and_then(|f| std::fs::read_to_string(f).ok())
            .is_some_and(|text| text.contains("\"cilium-cni\""));
        if renamed_by_cilium || cilium_conflist {
            Self::CiliumExclusive
        } else {
            Self::Unknown
        }
    }

    /// What to do about it, in words.
    #[must_use]
    pub fn fix(self, file: &Path) -> String {
        match self {
            Self::CiliumExclusive => format!(
                "Cilium owns the CNI configuration exclusively (files renamed to *.cilium_bak) and writes {} again on every change: set cni.exclusive=false in Cilium's Helm values (or cni-exclusive: \"false\" in the cilium-config ConfigMap) so that chained plugins stay",
                file.display()
            ),
            Self::Unknown => format!(
                "another process writes {} again whenever capture-cni is chained: find it (auditctl -w {} -p wa, or inotifywait) and configure it to keep chained plugins, or to leave the file alone",
                file.display(),
                file.display()
            ),
        }
    }
}

/// A fight, as `capture status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fight {
    /// The configuration file that keeps losing capture-cni.
    pub file: PathBuf,
    pub neighbour: Neighbour,
    pub since_unix: u64,
    /// Re-chainings since it began.
    pub rechains: u64,
    pub fix: String,
}

/// The state of capture-cni in the node's configuration, for readiness, status and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainReport {
    pub conf_dir: PathBuf,
    /// capture-cni is in the active configuration now.
    pub chained: bool,
    /// The active configuration file, where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<PathBuf>,
    /// Why it is not chained, while it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// When the next re-chaining is due, while it waits (seconds from the report's writing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_rechain_in_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fight: Option<Fight>,
}

/// The report the agent keeps, if it keeps capture-cni chained.
#[must_use]
pub fn load(paths: &crate::paths::Paths) -> Option<ChainReport> {
    let data = std::fs::read(paths.cni_chain_report_path()).ok()?;
    serde_json::from_slice(&data).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cilium_is_recognised_by_what_it_leaves_in_the_directory() {
        let dir = std::env::temp_dir().join(format!("capture-cni-fight-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(Neighbour::of(&dir, None), Neighbour::Unknown);
        std::fs::write(dir.join("10-calico.conflist.cilium_bak"), "{}").unwrap();
        assert_eq!(Neighbour::of(&dir, None), Neighbour::CiliumExclusive);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
