//! The files the agent reads for the pods it captures next: Istio's mesh configuration
//! (`--mesh-config`) and the annotation policy (`--annotation-policy`). Each keeps its last good
//! content; one that has none (unusable since the agent started) keeps the agent unready.

use super::{mesh_watch::MeshWatch, policy_watch::PolicyWatch, AgentConfig};
use crate::config::{policy::Policy, MeshConfig, Revision};

pub struct NodeFiles {
    mesh: Option<MeshWatch>,
    policy: Option<PolicyWatch>,
}

impl NodeFiles {
    /// The files `cfg` names, each read once.
    pub fn open(cfg: &AgentConfig) -> Self {
        let mesh = if let Some(path) = &cfg.mesh_config {
            Some(MeshWatch::new(path, &cfg.paths))
        } else {
            // A report of an earlier agent's file would say a configuration is in use.
            let _ = std::fs::remove_file(cfg.paths.mesh_config_report_path());
            let _ = std::fs::remove_file(cfg.paths.mesh_configs_report_path());
            None
        };
        let policy = cfg.annotation_policy.clone().map(PolicyWatch::new);
        let files = Self { mesh, policy };
        files.refresh_mesh();
        files.refresh_policy();
        files
    }

    /// Whether the agent reads any file again from time to time.
    pub fn any(&self) -> bool {
        self.mesh.is_some() || self.policy.is_some()
    }

    /// Reads every mesh configuration again where it changed.
    pub fn refresh_mesh(&self) {
        if let Some(mesh) = &self.mesh {
            mesh.refresh_all();
        }
    }

    /// The mesh configuration new pods of `revision` get (read again if it changed) and its
    /// ConfigMap's name; none without `--mesh-config`.
    ///
    /// # Errors
    /// The revision has none, or none that could ever be used.
    pub fn mesh_for(&self, revision: &Revision) -> Result<Option<(MeshConfig, String)>, String> {
        self.mesh
            .as_ref()
            .map(|mesh| mesh.for_revision(revision))
            .transpose()
    }

    /// Reads the annotation policy again if it changed; the one new pods are held to.
    pub fn refresh_policy(&self) -> Option<Policy> {
        self.policy.as_ref()?.refresh()
    }

    /// Why new pods cannot be served, for every file that has never been usable.
    pub fn unusable(&self) -> Option<String> {
        let mesh = self.mesh.as_ref().and_then(MeshWatch::unusable);
        let policy = self.policy.as_ref().and_then(PolicyWatch::unusable);
        match (mesh, policy) {
            (Some(m), Some(p)) => Some(format!("{m}; {p}")),
            (m, p) => m.or(p),
        }
    }
}
