//! What the agent is started with (its flags, parsed), and why it may fail to start.

use std::{io, net::SocketAddr, path::PathBuf};

use super::{CniWatch, ReconcileConfig};
use crate::{ops, paths::Paths, probe};

pub struct AgentConfig {
    pub paths: Paths,
    /// The node's sizing and iptables variant (`--max-pods`, `--iptables-variant`).
    pub node: std::sync::Arc<capture_user::node::NodeChoices>,
    pub socket: PathBuf,
    pub http: SocketAddr,
    /// Where /metrics alone is also served (the node's address, for Prometheus).
    pub metrics: Option<SocketAddr>,
    pub mode: probe::ModeChoice,
    /// What `--mode auto` falls back to (`--fallback`).
    pub fallback: probe::FallbackChoice,
    pub proxy_uids: Vec<u32>,
    pub proxy_gids: Vec<u32>,
    pub mesh: crate::config::MeshDefaults,
    /// Istio's mesh configuration file (`--mesh-config`).
    pub mesh_config: Option<PathBuf>,
    /// The node's policy for bypass annotations (`--annotation-policy`).
    pub annotation_policy: Option<PathBuf>,
    /// The runtime's CRI socket: the reconcile's, and where pods' proxy containers are named.
    pub cri_socket: PathBuf,
    /// Keep capture-cni chained in the node's CNI configuration.
    pub cni_watch: Option<CniWatch>,
    /// Allow the app-to-proxy acceleration (`--accelerate`).
    pub accelerate: bool,
    /// Check cases whose differences are accepted (`--accelerate-accepting`).
    pub accelerate_accepting: Vec<String>,
    /// Replace Istio's own rules found in a pod's netns (`--take-over-istio-rules`).
    pub take_over_istio_rules: bool,
    /// Hold the runtime's sandboxes against the records (`--cri-socket`, `--repair`).
    pub reconcile: Option<ReconcileConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The kernel offers no mode the agent may run in (the probe's reason, in words).
    #[error("choosing the capture mode: {0}")]
    Mode(String),
    #[error("preparing the node's directories: {0}")]
    Paths(#[from] crate::paths::PathsError),
    #[error("loading the node's kernel programs: {0}")]
    Programs(#[source] crate::ebpf::EbpfError),
    #[error("reading the node's captured pods: {0}")]
    Status(#[source] ops::Error),
    #[error("listening on {what} {addr}: {source}")]
    Listen {
        what: &'static str,
        addr: String,
        source: io::Error,
    },
    #[error("starting the async runtime: {0}")]
    Runtime(io::Error),
    #[error("a start-up task of the agent failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The node's programs are another build's and this one cannot take them over: they stay in
    /// force, and the agent stays up (not ready) to say why rather than crash-looping.
    #[error("{0}")]
    TakeoverStopped(#[source] crate::ebpf::loader::LoadError),
}
