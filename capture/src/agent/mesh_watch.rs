//! The mesh configurations the agent reads (`--mesh-config`): Istio's `istio` ConfigMap's `mesh`
//! key, and `istio-<revision>`'s for each revisioned control plane, mounted into the DaemonSet as
//! one directory with a file per ConfigMap (or, as before revisions were told apart, one file for
//! every pod).
//!
//! A pod gets its revision's file (`config::Revision`, from its annotations). Each file is read
//! again before each ADD of its revision and every [`POLL`], and a new content applies to the
//! pods set up afterwards; pods already captured keep what they were set up with, as pods
//! injected before a mesh change keep theirs under Istio. A content that cannot be used leaves
//! that file's last good one in force and is reported (log, `capture status`); with none before
//! it, the pods of that revision are refused, naming the file, and the others served. A pod whose
//! revision has no file is refused naming the ConfigMap to mount. With a single file, the agent
//! is not ready while it has never been usable, since it cannot know any pod's settings.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Mutex, PoisonError},
    time::Duration,
};

use tracing::{info, warn};

use super::last_good::{self, LastGood, Refreshed};
use crate::{
    config::{
        mesh_config::{MeshConfig, MeshConfigReport, MeshLayout},
        Revision,
    },
    fsutil::write_atomic,
    paths::Paths,
    record::now_unix,
};

/// How often the files are read when no ADD reads them: a ConfigMap change takes kubelet up to
/// a minute to bring to the node anyway.
pub const POLL: Duration = Duration::from_secs(2);

pub struct MeshWatch {
    layout: MeshLayout,
    /// The default revision's (or the one file's) report, as `capture status` reads it.
    report_path: PathBuf,
    /// Every revision's, where `--mesh-config` is a directory.
    reports_path: PathBuf,
    files: Mutex<BTreeMap<Revision, RevisionFile>>,
}

/// One revision's file: what was read last, and what is in use.
struct RevisionFile {
    /// Its ConfigMap's name, for `capture status`.
    name: String,
    file: LastGood<MeshConfig>,
    report: MeshConfigReport,
}

impl RevisionFile {
    fn new(path: PathBuf, name: String, revision: &Revision, layout: &MeshLayout) -> Self {
        let report = MeshConfigReport {
            path: path.clone(),
            revision: matches!(layout, MeshLayout::Dir(_)).then(|| revision.name().to_string()),
            ..MeshConfigReport::default()
        };
        Self {
            name,
            file: LastGood::new(path),
            report,
        }
    }

    /// Reads the file again; whether what it said changed.
    fn refresh(&mut self) -> bool {
        let had_one = self.file.in_use().is_some();
        let outcome = self
            .file
            .refresh(|data| MeshConfig::parse(last_good::text(data)?));
        let path = self.report.path.display().to_string();
        let report = &mut self.report;
        match outcome {
            Refreshed::Unchanged => return false,
            Refreshed::InUse => {
                let mesh = self.file.in_use().cloned().unwrap_or_default();
                info!(path = %path, interception_mode = ?mesh.interception_mode, proxy_metadata = ?mesh.proxy_metadata, "mesh configuration in use for new pods");
                for warning in &mesh.warnings {
                    warn!(path = %path, %warning, "mesh configuration");
                }
                report.in_use = Some(mesh);
                report.loaded_at_unix = Some(now_unix());
                report.problem = None;
                report.problem_since_unix = None;
            }
            Refreshed::Unusable => {
                let problem = self.file.problem().unwrap_or_default().to_string();
                if had_one {
                    warn!(path = %path, %problem, "the mesh configuration cannot be used; new pods get the last good one");
                } else {
                    warn!(path = %path, %problem, "the mesh configuration cannot be used and none was before: its pods are refused");
                }
                report.problem = Some(problem);
                report.problem_since_unix = Some(now_unix());
            }
        }
        true
    }

    fn usable(&self) -> Result<(MeshConfig, String), String> {
        match &self.report.in_use {
            Some(mesh) => Ok((mesh.clone(), self.name.clone())),
            None => Err(format!(
                "the mesh configuration {} ({}) cannot be used: {} (fix the ConfigMap's mesh key, or drop --mesh-config)",
                self.report.path.display(),
                self.name,
                self.report.problem.as_deref().unwrap_or("not read yet")
            )),
        }
    }
}

impl MeshWatch {
    #[must_use]
    pub fn new(path: &std::path::Path, paths: &Paths) -> Self {
        let watch = Self {
            layout: MeshLayout::of(path),
            report_path: paths.mesh_config_report_path(),
            reports_path: paths.mesh_configs_report_path(),
            files: Mutex::new(BTreeMap::new()),
        };
        if matches!(watch.layout, MeshLayout::File(_)) {
            let _ = std::fs::remove_file(&watch.reports_path);
        }
        watch
    }

    /// Reads every revision's file again where it changed (the directory's listing too).
    pub fn refresh_all(&self) {
        let mut files = self.files.lock().unwrap_or_else(PoisonError::into_inner);
        let present = self.layout.files();
        let mut changed = false;
        // A revision whose ConfigMap went (its control plane removed): its pods are refused.
        let before = files.len();
        files.retain(|rev, _| present.iter().any(|(r, _)| r == rev));
        changed |= files.len() != before;
        for (revision, path) in present {
            let name = self
                .layout
                .file_for(&revision)
                .map_or_else(|_| revision.config_map(), |(_, n)| n);
            let file = files
                .entry(revision.clone())
                .or_insert_with(|| RevisionFile::new(path, name, &revision, &self.layout));
            changed |= file.refresh();
        }
        if changed {
            self.write_reports(&files);
        }
    }

    /// The configuration new pods of `revision` get, with the name of its ConfigMap (or file);
    /// why there is none.
    ///
    /// # Errors
    /// The revision has no file, or its file has never been usable.
    pub fn for_revision(&self, revision: &Revision) -> Result<(MeshConfig, String), String> {
        let (path, name) = match self.layout.file_for(revision) {
            Ok(found) => found,
            Err(missing) => {
                let mut files = self.files.lock().unwrap_or_else(PoisonError::into_inner);
                if files.remove(revision).is_some() {
                    self.write_reports(&files);
                }
                return Err(missing);
            }
        };
        let mut files = self.files.lock().unwrap_or_else(PoisonError::into_inner);
        let file = files
            .entry(revision.clone())
            .or_insert_with(|| RevisionFile::new(path, name, revision, &self.layout));
        if file.refresh() {
            self.write_reports(&files);
        }
        files
            .get(revision)
            .map_or_else(|| Err("not read".to_string()), RevisionFile::usable)
    }

    fn write_reports(&self, files: &BTreeMap<Revision, RevisionFile>) {
        let write = |path: &PathBuf, data: Vec<u8>| {
            if let Err(e) = write_atomic(path, &data, None) {
                warn!(path = %path.display(), error = %e, "cannot write the mesh configuration's report for capture status");
            }
        };
        match files.get(&Revision::default_revision()) {
            Some(default) => write(
                &self.report_path,
                serde_json::to_vec_pretty(&default.report).expect("reports serialise"),
            ),
            None => {
                let _ = std::fs::remove_file(&self.report_path);
            }
        }
        if matches!(self.layout, MeshLayout::Dir(_)) {
            let all: Vec<&MeshConfigReport> = files.values().map(|f| &f.report).collect();
            write(
                &self.reports_path,
                serde_json::to_vec_pretty(&all).expect("reports serialise"),
            );
        }
    }

    /// Why no pod can be served, where none can: a single file that has never been usable. (A
    /// directory's revisions are refused one by one, never the node.)
    #[must_use]
    pub fn unusable(&self) -> Option<String> {
        let MeshLayout::File(path) = &self.layout else {
            return None;
        };
        let files = self.files.lock().unwrap_or_else(PoisonError::into_inner);
        match files.get(&Revision::default_revision()) {
            Some(file) => file.usable().err(),
            None => Some(format!(
                "the mesh configuration {} cannot be used: not read yet",
                path.display()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> (PathBuf, Paths) {
        let dir = std::env::temp_dir().join(format!("capture-mesh-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let paths = Paths::new(dir.join("bpf"), dir.join("state"));
        std::fs::create_dir_all(&paths.state_dir).unwrap();
        (dir, paths)
    }

    const DNS_ON: &str = "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"true\"\n";

    #[test]
    fn a_bad_file_keeps_the_last_good_one_and_none_before_is_unusable() {
        let (dir, paths) = scratch("file");
        let file = dir.join("mesh");
        let watch = MeshWatch::new(&file, &paths);
        watch.refresh_all();
        assert!(watch.unusable().unwrap().contains("cannot read it"));
        let default = Revision::default_revision();
        assert!(watch.for_revision(&default).is_err());

        std::fs::write(&file, DNS_ON).unwrap();
        let (good, _) = watch.for_revision(&default).expect("a good file is used");
        assert_eq!(good.metadata("ISTIO_META_DNS_CAPTURE"), Some(true));
        assert_eq!(watch.unusable(), None);
        // One file serves every revision.
        assert!(watch.for_revision(&Revision::named("canary")).is_ok());

        std::fs::write(&file, "defaultConfig: [").unwrap();
        watch.refresh_all();
        assert_eq!(
            watch.for_revision(&default).unwrap().0,
            good,
            "the last good one"
        );
        let report: MeshConfigReport =
            serde_json::from_slice(&std::fs::read(paths.mesh_config_report_path()).unwrap())
                .unwrap();
        assert_eq!(report.in_use, Some(good));
        assert!(report.problem.unwrap().contains("not YAML"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_serves_each_revision_its_own_file_and_refuses_one_it_lacks() {
        let (dir, paths) = scratch("dir");
        let mesh = dir.join("config");
        std::fs::create_dir_all(&mesh).unwrap();
        std::fs::write(mesh.join("istio"), "defaultConfig: {}\n").unwrap();
        // A ConfigMap mounted whole: a directory of its keys.
        std::fs::create_dir_all(mesh.join("istio-canary")).unwrap();
        std::fs::write(mesh.join("istio-canary").join("mesh"), DNS_ON).unwrap();
        let watch = MeshWatch::new(&mesh, &paths);
        watch.refresh_all();
        assert_eq!(watch.unusable(), None);
        let (default, name) = watch.for_revision(&Revision::default_revision()).unwrap();
        assert_eq!(
            (default.metadata("ISTIO_META_DNS_CAPTURE"), name.as_str()),
            (None, "istio")
        );
        let (canary, name) = watch.for_revision(&Revision::named("canary")).unwrap();
        assert_eq!(
            (canary.metadata("ISTIO_META_DNS_CAPTURE"), name.as_str()),
            (Some(true), "istio-canary")
        );
        let missing = watch.for_revision(&Revision::named("1-24")).unwrap_err();
        assert!(missing.contains("ConfigMap istio-1-24"), "{missing}");

        // A revision's broken file refuses its pods, and only its pods; the node stays ready.
        std::fs::write(mesh.join("istio-broken"), "defaultConfig: [").unwrap();
        let broken = watch.for_revision(&Revision::named("broken")).unwrap_err();
        assert!(
            broken.contains("istio-broken") && broken.contains("not YAML"),
            "{broken}"
        );
        assert_eq!(watch.unusable(), None);
        assert!(watch.for_revision(&Revision::named("canary")).is_ok());
        let reports: Vec<MeshConfigReport> =
            serde_json::from_slice(&std::fs::read(paths.mesh_configs_report_path()).unwrap())
                .unwrap();
        let revisions: Vec<_> = reports.iter().filter_map(|r| r.revision.clone()).collect();
        assert_eq!(revisions, ["default", "broken", "canary"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
