//! The mesh configuration file the agent reads (`--mesh-config`, Istio's `istio` ConfigMap's
//! `mesh` key mounted into the DaemonSet).
//!
//! The file is read again before each ADD and every [`POLL`], and a new content applies to the
//! pods set up afterwards; pods already captured keep what they were set up with, as pods
//! injected before a mesh change keep theirs under Istio. A content that cannot be used leaves
//! the last good one in force and is reported (log, `capture status`); with none before it (the
//! agent's first start), the agent is not ready and says why, since it cannot know the mesh's
//! DNS capture or interception mode and would set pods up wrongly.

use std::{
    path::PathBuf,
    sync::{Mutex, PoisonError},
    time::Duration,
};

use tracing::{info, warn};

use crate::{
    config::mesh_config::{MeshConfig, MeshConfigReport},
    fsutil::write_atomic,
    paths::Paths,
    record::now_unix,
};

/// How often the file is read when no ADD reads it: a ConfigMap change takes kubelet up to a
/// minute to bring to the node anyway.
pub const POLL: Duration = Duration::from_secs(2);

pub struct MeshWatch {
    path: PathBuf,
    report_path: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The content last read (or why it could not be), to tell a change.
    seen: Option<Result<Vec<u8>, String>>,
    report: MeshConfigReport,
}

impl MeshWatch {
    #[must_use]
    pub fn new(path: PathBuf, paths: &Paths) -> Self {
        let report = MeshConfigReport {
            path: path.clone(),
            ..MeshConfigReport::default()
        };
        Self {
            path,
            report_path: paths.mesh_config_report_path(),
            state: Mutex::new(State { seen: None, report }),
        }
    }

    /// Reads the file again if it changed; the configuration new pods get, if there is one.
    pub fn refresh(&self) -> Option<MeshConfig> {
        let read = std::fs::read(&self.path).map_err(|e| e.to_string());
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.seen.as_ref() != Some(&read) {
            state.seen = Some(read.clone());
            let parsed = read
                .map_err(|e| format!("cannot read it: {e}"))
                .and_then(|data| {
                    let text = String::from_utf8(data).map_err(|e| format!("not UTF-8: {e}"))?;
                    MeshConfig::parse(&text)
                });
            let path = self.path.display();
            let report = &mut state.report;
            match parsed {
                Ok(mesh) => {
                    info!(path = %path, interception_mode = ?mesh.interception_mode, proxy_metadata = ?mesh.proxy_metadata, "mesh configuration in use for new pods");
                    for warning in &mesh.warnings {
                        warn!(path = %path, %warning, "mesh configuration");
                    }
                    report.in_use = Some(mesh);
                    report.loaded_at_unix = Some(now_unix());
                    report.problem = None;
                    report.problem_since_unix = None;
                }
                Err(problem) => {
                    match &report.in_use {
                        Some(_) => {
                            warn!(path = %path, %problem, "the mesh configuration cannot be used; new pods get the last good one");
                        }
                        None => {
                            warn!(path = %path, %problem, "the mesh configuration cannot be used and none was before: not ready");
                        }
                    }
                    report.problem = Some(problem);
                    report.problem_since_unix = Some(now_unix());
                }
            }
            let data = serde_json::to_vec_pretty(&state.report).expect("reports serialise");
            if let Err(e) = write_atomic(&self.report_path, &data, None) {
                warn!(path = %self.report_path.display(), error = %e, "cannot write the mesh configuration's report for capture status");
            }
        }
        state.report.in_use.clone()
    }

    /// Why no configuration can be given to new pods, when none can.
    #[must_use]
    pub fn unusable(&self) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let report = &state.report;
        if report.in_use.is_some() {
            return None;
        }
        Some(format!(
            "the mesh configuration {} cannot be used: {} (fix the istio ConfigMap's mesh key, or drop --mesh-config)",
            self.path.display(),
            report.problem.as_deref().unwrap_or("not read yet")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_file_keeps_the_last_good_one_and_none_before_is_unusable() {
        let dir = std::env::temp_dir().join(format!("capture-mesh-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("mesh");
        let paths = Paths::new(dir.join("bpf"), &dir);
        let watch = MeshWatch::new(file.clone(), &paths);
        assert_eq!(watch.refresh(), None);
        assert!(watch.unusable().unwrap().contains("cannot read it"));

        let on = "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"true\"\n";
        std::fs::write(&file, on).unwrap();
        let good = watch.refresh().expect("a good file is used");
        assert_eq!(good.metadata("ISTIO_META_DNS_CAPTURE"), Some(true));
        assert_eq!(watch.unusable(), None);

        std::fs::write(&file, "defaultConfig: [").unwrap();
        assert_eq!(watch.refresh(), Some(good.clone()), "the last good one");
        let report: MeshConfigReport =
            serde_json::from_slice(&std::fs::read(paths.mesh_config_report_path()).unwrap())
                .unwrap();
        assert_eq!(report.in_use, Some(good));
        assert!(report.problem.unwrap().contains("not YAML"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
