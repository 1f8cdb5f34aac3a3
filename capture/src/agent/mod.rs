//! `capture agent`: the node agent. It owns the kernel side (loads the programs once, or adopts
//! the pinned ones after a restart without touching any pod), serves capture requests from the
//! CNI plugin on a root-only Unix socket, and exposes health and Prometheus metrics on localhost.
//!
//! Stopping the agent (or killing it) never releases a pod: capture lives in pinned kernel objects
//! and netns rules, not in this process.

mod background;
mod cni_fight;
mod cni_watch;
mod http;
mod last_good;
mod map_metrics;
mod mesh_watch;
mod metrics;
mod node_files;
mod node_metrics;
mod options;
mod policy_watch;
mod prepare;
mod privileges;
mod proxy_learned;
mod proxy_watch;
mod reconcile;
mod requests;
mod socket;

pub use http::HEADER_READ_TIMEOUT;

pub use cni_watch::{ChainState, CniWatch};
pub use options::{AgentConfig, AgentError};
pub use reconcile::ReconcileConfig;

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError},
    time::Instant,
};

use tokio::{
    net::TcpListener,
    signal::unix::{signal, SignalKind},
};
use tracing::{error, info, warn};

use crate::{
    api::{FailureKind, PodRequest, Request, Response},
    claims,
    cni::selection::{sidecar_status, Status},
    config::PodSpec,
    ops::{self, AttachRequest},
    probe,
    record::Mode,
};

/// Where the agent is in its life; it serves capture requests in `Serving` only.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Loading (or taking over) the node's kernel programs.
    Starting,
    Serving,
    /// The node's programs are another build's and this one cannot take them over: they stay in
    /// force, and the agent stays up to say why rather than crash-looping.
    CannotServe(String),
    Stopping,
}

pub struct Agent {
    cfg: AgentConfig,
    mode: Mode,
    /// Where a pod the ebpf backend cannot serve goes (auto mode with a usable fallback).
    fallback: Option<Mode>,
    phase: Mutex<Phase>,
    files: node_files::NodeFiles,
    /// Learns the proxy containers of pods under proxy identity by container.
    proxies: Option<Arc<proxy_watch::ProxyWatch>>,
    /// capture-cni's place in the node's CNI configuration, where the agent keeps it chained.
    chain: Option<ChainState>,
    metrics: metrics::Metrics,
}

impl Agent {
    /// Ready, or every reason why not: serving, with a mesh configuration for new pods where it
    /// reads one (a file that cannot be used is told from the start, not only once the programs
    /// are loaded).
    fn readiness(&self) -> Result<(), String> {
        let phase = self
            .phase
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let phase = match phase {
            Phase::Starting => {
                Some("the agent is starting (loading the node's kernel programs)".to_string())
            }
            Phase::CannotServe(why) => Some(format!("the agent cannot serve this node: {why}")),
            Phase::Stopping => Some("the agent is stopping".to_string()),
            Phase::Serving => None,
        };
        match (phase, self.files.unusable()) {
            (None, None) => Ok(()),
            (Some(why), None) | (None, Some(why)) => Err(why),
            (Some(phase), Some(mesh)) => Err(format!("{phase}; and {mesh}")),
        }
    }

    /// The node's readiness (`/readyz`): serving, and, where the agent keeps capture-cni
    /// chained, capture-cni in the active CNI configuration, so that a node whose pods would
    /// start without it is not ready (as istio-cni's node agent is not). ADDs are served
    /// whatever the chain's state: one that arrives came through capture-cni.
    fn node_readiness(&self) -> Result<(), String> {
        let chain = self.chain.as_ref().and_then(ChainState::unready);
        match (self.readiness(), chain) {
            (Ok(()), None) => Ok(()),
            (Err(why), None) | (Ok(()), Some(why)) => Err(why),
            (Err(serving), Some(chain)) => Err(format!("{serving}; and {chain}")),
        }
    }

    fn is_ready(&self) -> bool {
        self.node_readiness().is_ok()
    }

    fn enter(&self, phase: Phase) {
        *self.phase.lock().unwrap_or_else(PoisonError::into_inner) = phase;
        self.metrics.set_ready(self.is_ready());
    }

    /// Reads the mesh configurations again where they changed (and the readiness that follows).
    fn refresh_mesh(&self) {
        self.files.refresh_mesh();
        self.metrics.set_ready(self.is_ready());
    }

    /// Reads the annotation policy again if it changed (and the readiness that follows).
    fn refresh_policy(&self) -> Option<crate::config::policy::Policy> {
        let policy = self.files.refresh_policy();
        self.metrics.set_ready(self.is_ready());
        policy
    }

    /// One scrape's exposition, encoded on a blocking thread: the node's series are read from
    /// its pins and pod records.
    async fn render_metrics(self: &Arc<Self>) -> Result<String, String> {
        let agent = Arc::clone(self);
        match tokio::task::spawn_blocking(move || agent.metrics.encode()).await {
            Ok(Ok(body)) => Ok(body),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("the encoding thread failed: {e}")),
        }
    }

    /// Serves one request; runs on a blocking thread (the operations take the node lock and make
    /// syscalls).
    fn handle(&self, request: Request) -> Response {
        let (op, response) = match request {
            Request::Add {
                pod,
                plugin_started_ns,
            } => {
                let response = self.add(pod, false);
                self.metrics
                    .observe_cni_add(self.mode, &response, plugin_started_ns);
                ("add", response)
            }
            Request::Del {
                container_id,
                netns,
            } => ("del", self.del(container_id, netns)),
            Request::Check { container_id } => ("check", self.check(container_id)),
            Request::Status => (
                "status",
                match self.readiness() {
                    Ok(()) => Response::ok(format!("ready, mode {}", self.mode)),
                    Err(why) => Response::failed(FailureKind::NotReady, why),
                },
            ),
            Request::Gc {
                valid_container_ids,
            } => ("gc", self.gc(&valid_container_ids)),
            Request::LeftAlone { report } => ("left_alone", self.left_alone(report)),
        };
        self.metrics.count_request(op, response.ok);
        response
    }

    /// CNI ADD, or (`in_place`) the reconcile's capture of a pod that already runs.
    fn add(&self, pod: PodRequest, in_place: bool) -> Response {
        // Before the readiness check: a file fixed since the last poll serves this pod already.
        let revision = crate::config::Revision::of_pod(&pod.annotations);
        let mesh = self.files.mesh_for(&revision);
        self.metrics.set_ready(self.is_ready());
        let policy = self.refresh_policy();
        if let Err(why) = self.readiness() {
            return Response::failed(FailureKind::NotReady, format!("{why}; retry"));
        }
        let (mesh_config, mesh_source) = match mesh {
            Ok(Some((mesh, source))) => (Some(mesh), Some(source)),
            Ok(None) => (None, None),
            // This revision's pods wait for their mesh configuration; the others are served.
            Err(why) => {
                warn!(namespace = %pod.pod.namespace, pod = %pod.pod.name, %revision, %why, "refused");
                return Response::failed(FailureKind::NotReady, format!("{why}; retry"));
            }
        };
        let start = Instant::now();
        let container_id = pod.pod.container_id.clone();
        if let Status::Unreadable(why) = sidecar_status(&pod.annotations) {
            warn!(namespace = %pod.pod.namespace, pod = %pod.pod.name, %why, "unreadable sidecar status");
        }
        // Before anything is attached: from here on, DEL must wait for this agent.
        if let Err(e) = claims::claim(&self.cfg.paths, &container_id) {
            return Response::failed(
                FailureKind::CaptureFailed,
                format!(
                    "cannot record the claim on container {container_id} in {}: {e}",
                    self.cfg.paths.claims_dir().display()
                ),
            );
        }
        let req = AttachRequest {
            proxy_cgroup: None,
            policy,
            labels: pod.labels.clone(),
            netns: pod.netns,
            cgroup: pod.cgroup,
            spec: PodSpec {
                pod_ips: pod.pod_ips,
                annotations: pod.annotations,
                proxy_uids: self.cfg.proxy_uids.clone(),
                proxy_gids: self.cfg.proxy_gids.clone(),
                mesh: self.cfg.mesh.clone(),
                mesh_config,
                mesh_source,
                proxy_container: None,
                // Only capture-cni asks the agent to attach.
                defaults: crate::config::Defaults::IstioCni,
            },
            mode: self.mode,
            pod: Some(pod.pod.clone()),
            fallback: self.fallback,
            in_place,
            take_over_istio_rules: self.cfg.take_over_istio_rules,
        };
        match ops::attach(&self.cfg.paths, &self.cfg.node, &req) {
            Ok(record) => {
                self.metrics.observe_attach(start.elapsed());
                if let Some(proxies) = &self.proxies {
                    proxies.watch(&record);
                }
                if let Some(reason) = &record.fallback_reason {
                    warn!(namespace = %pod.pod.namespace, pod = %pod.pod.name, %reason, "captured with iptables instead of ebpf");
                }
                info!(namespace = %pod.pod.namespace, pod = %pod.pod.name, netns = %record.netns.display(), mode = %record.mode, took = ?start.elapsed(), "captured");
                Response {
                    mode: Some(record.mode),
                    ..Response::ok(format!(
                        "captured {}/{} with {}",
                        pod.pod.namespace, pod.pod.name, record.mode
                    ))
                }
            }
            Err(e) => {
                warn!(namespace = %pod.pod.namespace, pod = %pod.pod.name, error = %e, "capture failed");
                // The attach rolled back: nothing of capture remains for the container.
                self.withdraw_claim(&container_id);
                // The pod's own doing (its annotations, the policy they break, a mode this node
                // cannot give it): the same CNI error as a malformed annotation.
                let kind = if matches!(
                    e,
                    ops::Error::Config(_) | ops::Error::Policy(_) | ops::Error::Identity(_)
                ) {
                    FailureKind::InvalidConfig
                } else {
                    FailureKind::CaptureFailed
                };
                Response::failed(kind, e.to_string())
            }
        }
    }
}

async fn bind_http(what: &'static str, addr: SocketAddr) -> Result<TcpListener, AgentError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AgentError::Listen {
            what,
            addr: addr.to_string(),
            source,
        })
}

async fn serve(cfg: AgentConfig) -> Result<(), AgentError> {
    let refused = privileges::refusal(&cfg);
    let (probe, mode, fallback) = match &refused {
        None => choose_backends(&cfg).await?,
        Some(_) => privileges::requested(&cfg),
    };
    // A record that cannot be read costs its own pod only: the node starts with the others.
    if let Ok(scan) = crate::record::scan(&cfg.paths) {
        for d in &scan.damaged {
            warn!(record = %d.path.display(), error = %d.error, "a pod record is damaged: its pod is left out until CNI DEL releases it");
        }
    }

    let http = bind_http("http", cfg.http).await?;
    let metrics_http = match cfg.metrics {
        Some(addr) => Some(bind_http("metrics", addr).await?),
        None => None,
    };
    let socket = socket::bind(&cfg.socket).map_err(|source| AgentError::Listen {
        what: "socket",
        addr: cfg.socket.display().to_string(),
        source,
    })?;
    let socket_path = cfg.socket.clone();
    let paths = cfg.paths.clone();
    let read_node = Box::new(move || {
        ops::status(&paths)
            .inspect_err(|e| warn!(error = %e, "reading the node's status for /metrics"))
            .ok()
    });
    // Small files: read before anything else, so that readiness tells a bad one from the start.
    let files = node_files::NodeFiles::open(&cfg);
    let (learned, learned_rx) = std::sync::mpsc::channel();
    let proxies = match proxy_watch::ProxyWatch::start(
        cfg.paths.clone(),
        &cfg.cri_socket,
        cfg.mesh.proxy_identity.container.clone(),
        learned,
    ) {
        Ok(watch) => Some(watch),
        Err(e) => {
            error!(error = %e, "cannot watch pod cgroups for proxy containers: pods keep the settings ADD gave them, and those under proxy identity by container keep their proxy's connections refused");
            None
        }
    };
    let mut metrics = metrics::Metrics::new(mode, &probe.checks, read_node)
        .with_map_fill(cfg.paths.clone(), cfg.node.sizing);
    let chain = cfg.cni_watch.as_ref().map(|watch| {
        let state = ChainState::new(&watch.conf_dir, cfg.paths.cni_chain_report_path());
        (state, metrics.cni_chain())
    });
    if chain.is_none() {
        let _ = std::fs::remove_file(cfg.paths.cni_chain_report_path());
    }
    let agent = Arc::new(Agent {
        files,
        proxies,
        chain: chain.as_ref().map(|(state, _)| state.clone()),
        cfg,
        mode,
        fallback,
        phase: Mutex::new(Phase::Starting),
        metrics,
    });
    proxy_learned::spawn(Arc::clone(&agent), learned_rx).map_err(AgentError::Runtime)?;
    // Served from now on, so that /healthz answers and /readyz says "not ready" while the
    // programs load.
    tokio::spawn(http::serve(Arc::clone(&agent), http, http::Endpoints::All));
    if let Some(listener) = metrics_http {
        tokio::spawn(http::serve(
            Arc::clone(&agent),
            listener,
            http::Endpoints::MetricsOnly,
        ));
    }

    let serving = prepare_or_refuse(&agent, refused).await?;
    if let (Some(watch), Some((state, chain_metrics))) = (agent.cfg.cni_watch.clone(), chain) {
        watch
            .spawn(chain_metrics, state)
            .map_err(AgentError::Runtime)?;
        // The watcher's thread changes the readiness the gauge reports.
        let a = Arc::clone(&agent);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tick.tick().await;
                a.metrics.set_ready(a.is_ready());
            }
        });
    }
    if serving {
        start_serving(&agent, &socket_path);
    }

    accept_until_stopped(&agent, &socket).await?;
    agent.enter(Phase::Stopping);
    let _ = std::fs::remove_file(&socket_path);
    info!("stopping; captured pods stay captured");
    Ok(())
}

/// Loads (or adopts) the kernel side before declaring readiness, and reports what survived a
/// restart; or, for an agent that lacks a privilege (`refused`), says why it serves no pod.
/// Whether the agent serves.
async fn prepare_or_refuse(
    agent: &Arc<Agent>,
    refused: Option<String>,
) -> Result<bool, AgentError> {
    if let Some(why) = refused {
        error!(reason = %why, "the agent lacks a privilege it needs: it serves no pod and stays not ready");
        agent.enter(Phase::CannotServe(why));
        return Ok(false);
    }
    let a = Arc::clone(agent);
    match tokio::task::spawn_blocking(move || prepare::prepare(&a)).await? {
        Ok(()) => Ok(true),
        Err(AgentError::TakeoverStopped(why)) => {
            error!(error = %why, "cannot take the node over; its programs stay in force and this agent serves no pod");
            agent.enter(Phase::CannotServe(why.to_string()));
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// The node's mode from the kernel probe and the flags, and where pods the mode cannot serve
/// fall back to; logs both, and the iptables variant.
async fn choose_backends(
    cfg: &AgentConfig,
) -> Result<(probe::Probe, Mode, Option<Mode>), AgentError> {
    let node = Arc::clone(&cfg.node);
    let probe = tokio::task::spawn_blocking(move || probe::probe(&node.iptables)).await?;
    let (mode, why) = probe::choose(cfg.mode, cfg.fallback, &probe).map_err(AgentError::Mode)?;
    info!(%mode, reason = %why, kernel = %probe.kernel, "mode chosen");
    let fallback = match probe.pod_fallback(cfg.mode, mode, cfg.fallback) {
        Ok(to) => to.map(|(to, why)| {
            info!(fallback = %to, reason = %why, "pods the kernel cannot serve fall back");
            to
        }),
        Err(why) => {
            warn!(reason = %why, "no fallback backend: pods the kernel cannot serve are refused");
            None
        }
    };
    let node = Arc::clone(&cfg.node);
    let iptables = tokio::task::spawn_blocking(move || node.iptables.choice().clone()).await?;
    info!(
        variant = iptables.flavour.name(),
        reason = %iptables.reason,
        "iptables variant chosen for the iptables backend"
    );
    Ok((probe, mode, fallback))
}

/// What a serving agent runs beside the socket: release retries, the proxy containers' watch,
/// the node files' poll and the reconcile; then it says whether it is ready.
fn start_serving(agent: &Arc<Agent>, socket_path: &std::path::Path) {
    let paths = agent.cfg.paths.clone();
    tokio::task::spawn_blocking(move || prepare::report_pods(&paths));
    tokio::spawn(background::retry_failed_releases(agent.cfg.paths.clone()));
    if let Some(proxies) = agent.proxies.clone() {
        let paths = agent.cfg.paths.clone();
        tokio::task::spawn_blocking(move || {
            for record in crate::record::load_all(&paths).unwrap_or_default() {
                proxies.watch(&record);
            }
        });
    }
    if agent.files.any() {
        tokio::spawn(background::poll_node_files(Arc::clone(agent)));
    }
    match agent.cfg.reconcile.clone() {
        Some(cfg) => {
            tokio::spawn(reconcile::run(Arc::clone(agent), cfg));
        }
        None => crate::runtime::report::forget(&agent.cfg.paths),
    }
    agent.enter(Phase::Serving);
    match agent.node_readiness().err() {
        None => info!(
            socket = %socket_path.display(),
            http = %agent.cfg.http,
            metrics = ?agent.cfg.metrics,
            "ready"
        ),
        Some(why) => error!(reason = %why, "not ready"),
    }
}

/// Serves the CNI plugin's connections until SIGTERM or SIGINT.
async fn accept_until_stopped(
    agent: &Arc<Agent>,
    socket: &tokio::net::UnixListener,
) -> Result<(), AgentError> {
    let clients = socket::Clients::new();
    let mut term = signal(SignalKind::terminate()).map_err(AgentError::Runtime)?;
    let mut int = signal(SignalKind::interrupt()).map_err(AgentError::Runtime)?;
    loop {
        tokio::select! {
            conn = socket.accept() => match conn {
                Ok((stream, _)) => socket::spawn_client(Arc::clone(agent), stream, &clients),
                Err(e) => error!(error = %e, "accept on the agent socket"),
            },
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    Ok(())
}

/// Runs the agent until SIGTERM or SIGINT.
pub fn run(cfg: AgentConfig) -> Result<(), AgentError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(AgentError::Runtime)?;
    runtime.block_on(serve(cfg))
}
