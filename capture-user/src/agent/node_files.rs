//! The files the agent reads for the pods it captures next: Istio's mesh configuration
//! (`--mesh-config`) and the annotation policy (`--annotation-policy`). Each keeps its last good
//! content; one that has none (unusable since the agent started) keeps the agent unready.

use super::{mesh_watch::MeshWatch, policy_watch::PolicyWatch, AgentConfig};
use crate::config::{policy::Policy, MeshConfig};

pub struct NodeFiles {
    mesh: Option<MeshWatch>,
    policy: Option<PolicyWatch>,
}

impl NodeFiles {
    /// The files `cfg` names, each read once.
    pub fn open(cfg: &AgentConfig) -> Self {
        let mesh = if let Some(path) = &cfg.mesh_config {
            Some(MeshWatch::new(path.clone(), &cfg.paths))
        } else {
            // A report of an earlier agent's file would say a configuration is in use.
            let _ = std::fs::remove_file(cfg.paths.mesh_config_report_path());
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

    /// Reads the mesh configuration again if it changed; the one new pods get.
    pub fn refresh_mesh(&self) -> Option<MeshConfig> {
        self.mesh.as_ref()?.refresh()
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
