//! The operations behind `capture attach|detach|status`, shared by the CLI and the agent.
//! Each validates all input before it changes anything, and takes the node lock for changes.

use std::{collections::BTreeMap, path::PathBuf};

use capture_common::config::PodCounters;
use serde::Serialize;

pub use crate::record::PodSelector;

mod release;

pub use release::{
    detach, release_abandoned_attaches, release_pod, retry_failed_releases, Retried,
};

use crate::{
    any_backend::{AnyBackend, BackendError, ExistingBackends},
    backend::PodTarget,
    cgroup::{self, CgroupError},
    config::{
        policy::{self, Policy, PolicyError, Subject},
        CaptureConfig, ConfigError, FallbackCause, PodSpec,
    },
    ebpf::{EbpfBackend, EbpfError},
    lock::NodeLock,
    netns::{Netns, NetnsError},
    node::NodeChoices,
    paths::{Paths, PathsError},
    record::{self, Mode, PodRecord, PodRef, RecordError},
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Paths(#[from] PathsError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(transparent)]
    Userns(#[from] crate::userns::UsernsError),
    #[error("taking the node lock {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("pod netns {netns} is already captured ({mode}, cgroup {cgroup}) with a different configuration; run `capture detach --netns {netns}` first")]
    AlreadyAttached {
        netns: PathBuf,
        cgroup: PathBuf,
        mode: Mode,
    },
    #[error("the ebpf backend cannot capture this pod: {0}; attach it with --mode iptables or --mode nftables, or run in --mode auto")]
    EbpfUnsupported(String),
    #[error(transparent)]
    IstioRules(#[from] crate::istio_rules::RulesError),
    #[error("pod netns {0} is not captured (no record in the state directory)")]
    NotAttached(PathBuf),
    #[error(transparent)]
    AccelCheck(Box<crate::accel::check::CheckError>),
    #[error("recording the acceleration's verdict: {0}")]
    AccelVerdict(#[source] std::io::Error),
    #[error("{0}")]
    Identity(String),
    #[error("reopening the pod: {0}")]
    OpenPod(#[from] crate::backend::OpenPodError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// What `attach` is asked to do.
#[derive(Clone, Debug)]
pub struct AttachRequest {
    pub netns: PathBuf,
    pub cgroup: PathBuf,
    pub spec: PodSpec,
    pub mode: Mode,
    /// The pod's Kubernetes identity, when known (CNI).
    pub pod: Option<PodRef>,
    /// With mode ebpf: the backend that captures a pod the ebpf backend cannot serve (auto
    /// mode's `--fallback`), rather than refusing it.
    pub fallback: Option<Mode>,
    /// The pod already runs (the reconcile's repair): its open connections are spared.
    pub in_place: bool,
    /// Istio's own rules in the pod's netns (istio-init's) are removed and replaced, rather than
    /// refused (`--take-over-istio-rules`).
    pub take_over_istio_rules: bool,
    /// Under proxy identity by container: the proxy container's cgroup, where the caller knows
    /// it (the CLI's `--proxy-cgroup`).
    pub proxy_cgroup: Option<PathBuf>,
    /// The node's annotation policy (`None`: no policy file).
    pub policy: Option<Policy>,
    /// The pod's labels, where the runtime reported them.
    pub labels: Option<BTreeMap<String, String>>,
}

pub(crate) fn lock(paths: &Paths) -> Result<NodeLock, Error> {
    let path = paths.lock_path();
    NodeLock::acquire(&path).map_err(|source| Error::Lock { path, source })
}

/// Captures a pod. Attaching the same pod again with the same request is a no-op.
pub fn attach(paths: &Paths, node: &NodeChoices, req: &AttachRequest) -> Result<PodRecord, Error> {
    let subject = Subject {
        namespace: req.pod.as_ref().map(|p| p.namespace.as_str()),
        labels: req.labels.as_ref(),
        annotations: &req.spec.annotations,
    };
    match &req.policy {
        Some(policy) => policy.check(&subject)?,
        None => policy::check_without_policy(&subject)?,
    }
    let (mut config, settings) = CaptureConfig::from_pod_with_settings(&req.spec)?;
    let identity = config.proxy_identity.is_some();
    let (cgroup, layout) = cgroup::open_pod_cgroup(&req.cgroup)?;
    let gap = config.ebpf_unsupported().or_else(|| {
        (layout == cgroup::Layout::V1)
            .then(|| crate::config::EbpfUnsupported::cgroup_v1(&req.cgroup))
    });
    let (mode, fallback) = choose_mode(req, gap, identity)?;
    crate::config::proxy_identity::resolve_proxy_cgroup(
        &mut config,
        &req.cgroup,
        req.proxy_cgroup.as_deref(),
    )?;
    let netns = Netns::open(&req.netns)?;
    // Before the comparison with an existing record, which holds them too.
    config.host_ids = crate::userns::host_ids(netns.file(), &config.pod_ids())?;
    config.accelerate &= mode == Mode::Ebpf && crate::accel::why_not(paths).is_none();
    config.spare_open_connections = req.in_place && matches!(mode, Mode::Iptables | Mode::Nftables);
    paths.prepare()?;
    let _lock = lock(paths)?;
    let netns_cookie = netns.cookie(crate::ebpf::netns_cookie::netns_cookie)?;
    // One record read, not all of them: attach must not slow down as the node fills up.
    if let Some(existing) = record::load(paths, netns_cookie)? {
        return existing_attach(existing, &config, req, mode);
    }

    let mut record = PodRecord {
        netns_cookie,
        netns: req.netns.clone(),
        cgroup: req.cgroup.clone(),
        mode,
        annotations: req.spec.annotations.clone(),
        config,
        attached_at_unix: record::now_unix(),
        pod: req.pod.clone(),
        fallback_cause: fallback.as_ref().map(|gap| gap.cause),
        fallback_reason: fallback.map(|gap| gap.reason),
        release_failed: None,
        iptables: None,
        settings,
        proxy_container: None,
        proxy_settings_refused: None,
    };
    let adopt = crate::istio_rules::decide(
        &req.netns,
        &record.config,
        record.mode,
        req.take_over_istio_rules,
    )?;
    // The IPv6 redirects' routes are the ebpf backend's alone; with the stateless one in place
    // the pod's config says so, and its IPv6 connections may take the redirect.
    let ebpf_routes = record.mode == Mode::Ebpf && adopt.is_none();
    let added_v6 = match record.config.pod_ip6 {
        Some(pod_ip6) => crate::lo_address::prepare_ipv6_pod(&netns, pod_ip6, ebpf_routes)?,
        None => crate::lo_address::LoAdded::default(),
    };
    record.config.stateless_redirect6 = ebpf_routes && record.config.pod_ip6.is_some();
    let target = PodTarget::new(
        netns_cookie,
        (&req.netns, netns.file()),
        (&req.cgroup, &cgroup),
    );
    let attached = match adopt {
        // Istio's rules are there already, exactly as this backend writes them: they are the
        // pod's capture from now on.
        Some(adopted) => {
            record.iptables = adopted.iptables;
            record::save(paths, &record).map_err(Error::from)
        }
        None => attach_backend(paths, node, &target, &mut record, req.fallback),
    };
    if attached.is_err() {
        // A failed attach leaves the pod as it found it.
        if let Err(e) = crate::lo_address::undo_ipv6_pod(&netns, added_v6) {
            tracing::warn!(error = %e, "rolling back a failed attach");
        }
    }
    attached.map(|()| record)
}

/// The backend a pod gets: the request's, or its fallback where the ebpf backend cannot serve
/// the pod (`gap`); a pod under proxy identity is refused rather than weakened.
fn choose_mode(
    req: &AttachRequest,
    gap: Option<crate::config::EbpfUnsupported>,
    identity: bool,
) -> Result<(Mode, Option<crate::config::EbpfUnsupported>), Error> {
    Ok(match (req.mode, gap, req.fallback) {
        // A fallback would weaken proxy identity to the uid rules: refuse instead.
        (Mode::Ebpf, Some(gap), _) if identity => {
            return Err(Error::Identity(crate::config::proxy_identity::no_fallback(
                &gap.reason,
            )))
        }
        (Mode::Ebpf, Some(gap), Some(to)) => (to, Some(gap)),
        (Mode::Ebpf, Some(gap), None) => return Err(Error::EbpfUnsupported(gap.reason)),
        (Mode::Iptables | Mode::Nftables, _, _) if identity => {
            return Err(Error::Identity(
                crate::config::proxy_identity::IPTABLES_CANNOT.into(),
            ))
        }
        (mode, _, _) => (mode, None),
    })
}

/// An attach of a pod that has a record already: the same request again is a no-op, another
/// one is refused.
fn existing_attach(
    existing: PodRecord,
    config: &CaptureConfig,
    req: &AttachRequest,
    mode: Mode,
) -> Result<PodRecord, Error> {
    // A pod that fell back stays where it fell: asking again is the same request.
    let same_mode =
        existing.mode == mode || (req.fallback.is_some() && existing.fallback_reason.is_some());
    // Acceleration is decided once, at the first attach; the node may allow it since. The
    // proxy container may have become known since too.
    let same_config = existing.config
        == CaptureConfig {
            accelerate: existing.config.accelerate,
            stateless_redirect6: existing.config.stateless_redirect6,
            proxy_identity: crate::config::proxy_identity::as_learned(
                config.proxy_identity.clone(),
                existing.config.proxy_identity.as_ref(),
            ),
            ..config.clone()
        };
    if same_config && existing.cgroup == req.cgroup && same_mode {
        return Ok(existing);
    }
    Err(Error::AlreadyAttached {
        netns: req.netns.clone(),
        cgroup: existing.cgroup.clone(),
        mode: existing.mode,
    })
}

/// Attaches the pod's backend (falling back to `fallback` for a hook the kernel refuses, when
/// given) and saves its record; on failure nothing of either is left.
fn attach_backend(
    paths: &Paths,
    node: &NodeChoices,
    target: &PodTarget<'_>,
    record: &mut PodRecord,
    fallback: Option<Mode>,
) -> Result<(), Error> {
    let mut backend = AnyBackend::for_attach(paths, record.mode, node)?;
    // Proxy identity has no rule form: such a pod is refused rather than weakened.
    let fallback = fallback.filter(|_| record.config.proxy_identity.is_none());
    let may_fall_back = fallback.is_some();
    let fell_back = match backend.attach(target, &record.config) {
        Err(BackendError::Ebpf(EbpfError::MissingHook(missing))) if may_fall_back => Some((
            FallbackCause::KernelHook,
            format!(
                "this kernel refused {}, which the pod needs: {}",
                missing.hook, missing.reason
            ),
        )),
        Err(BackendError::Ebpf(full @ EbpfError::NodeFull { .. })) if may_fall_back => {
            Some((FallbackCause::NodeFull, full.to_string()))
        }
        result => result.map(|()| None)?,
    };
    if let (Some((cause, reason)), Some(to)) = (fell_back, fallback) {
        record.mode = to;
        record.fallback_cause = Some(cause);
        record.fallback_reason = Some(reason);
        record.config.accelerate = false;
        backend = AnyBackend::for_attach(paths, to, node)?;
        backend.attach(target, &record.config)?;
    }
    record.iptables = backend.iptables_flavour();
    if let Err(e) = record::save(paths, record) {
        let _ = backend.detach(record);
        return Err(e.into());
    }
    Ok(())
}

/// Runs the acceleration's correctness checks and records the verdict.
pub fn accel_check(
    paths: &Paths,
    node: &NodeChoices,
) -> Result<crate::accel::check::Report, Error> {
    paths.prepare()?;
    let report =
        crate::accel::check::run(paths, node.sizing).map_err(|e| Error::AccelCheck(Box::new(e)))?;
    let mut node = crate::accel::load(paths);
    node.check = Some(report.verdict());
    crate::accel::save(paths, &node).map_err(Error::AccelVerdict)?;
    Ok(report)
}

/// Releases every pod whose container id is not in `valid` (CNI GC). Pods attached without a
/// container id (by hand) are not the runtime's to collect and stay.
pub fn collect_garbage(paths: &Paths, valid: &[String]) -> Result<Vec<PodRecord>, Error> {
    if !paths.state_dir.exists() {
        return Ok(Vec::new());
    }
    let _lock = lock(paths)?;
    let stale: Vec<PodRecord> = record::load_all(paths)?
        .into_iter()
        .filter(|r| {
            r.pod
                .as_ref()
                .is_some_and(|p| !valid.contains(&p.container_id))
        })
        .collect();
    for r in &stale {
        release::release(paths, r)?;
    }
    Ok(stale)
}

/// The status of one captured pod, `None` if it is not captured.
pub fn pod_status(paths: &Paths, which: &PodSelector) -> Result<Option<PodStatus>, Error> {
    let Some(record) = record::find(paths, which, crate::ebpf::netns_cookie::netns_cookie)? else {
        return Ok(None);
    };
    let mut backends = ExistingBackends::new(paths);
    Ok(Some(status_of(paths, &mut backends, record)))
}

fn status_of(paths: &Paths, backends: &mut ExistingBackends<'_>, record: PodRecord) -> PodStatus {
    let (missing, counters, program_build, loopback_destinations) = match backends.get(record.mode)
    {
        Ok(b) => (
            b.missing(&record),
            b.counters(&record),
            b.program_build(&record),
            b.loopback_destinations(&record),
        ),
        Err(why) => (
            vec![format!("the node's {} backend ({why})", record.mode)],
            None,
            None,
            None,
        ),
    };
    let mut missing = missing;
    if let Some(why) = &record.release_failed {
        missing.push(format!("a release that failed and is tried again: {why}"));
    }
    let accel_counters = || {
        EbpfBackend::adopt(paths)
            .ok()
            .and_then(|b| b.accel_counters(record.netns_cookie))
    };
    let acceleration = crate::accel::of_pod(
        paths,
        &record,
        record.config.accelerate.then(accel_counters).flatten(),
    );
    let notes = match crate::cni::selection::sidecar_status(&record.annotations) {
        crate::cni::selection::Status::Unreadable(why) => vec![why],
        _ => Vec::new(),
    };
    PodStatus {
        in_force: missing.is_empty(),
        missing,
        notes,
        counters,
        program_build,
        loopback_destinations,
        acceleration,
        record,
    }
}

/// One pod as `capture status` shows it.
#[derive(Debug, Serialize)]
pub struct PodStatus {
    #[serde(flatten)]
    pub record: PodRecord,
    /// Every hook linked and the config in the map.
    pub in_force: bool,
    /// What is missing when not in force.
    pub missing: Vec<String>,
    pub counters: Option<PodCounters>,
    /// Which build's kernel programs capture the pod (ebpf pods).
    pub program_build: Option<String>,
    /// Destinations the pod has a loopback address for (ebpf pods with the stateless redirect):
    /// at most `POD_LOOPBACK_QUOTA`; connections to others take the stateful path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loopback_destinations: Option<usize>,
    /// For pods that ask for the app-to-proxy acceleration: whether they have it, and why not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acceleration: Option<crate::accel::PodAcceleration>,
    /// What an operator should know about the pod's input (an injector status capture could not
    /// read, say), though capture is in force.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct NodeStatus {
    pub bpffs: PathBuf,
    pub state_dir: PathBuf,
    pub programs_loaded: bool,
    /// This binary's build.
    pub build: String,
    /// The build whose programs the node has pinned (its node record), if any.
    pub node_build: Option<String>,
    /// What the node's programs were adapted to (its node record), if it says.
    pub node_features: Option<crate::ebpf::loader::KernelFeatures>,
    pub pods: Vec<PodStatus>,
    /// Records that cannot be read back: their pods are left out of everything else.
    pub damaged_records: Vec<record::DamagedRecord>,
    pub node_errors: BTreeMap<&'static str, u64>,
    pub pending_handoffs: usize,
    /// Pods Istio injected that capture leaves alone (an istio-init pod, a gateway, ...).
    pub left_alone: Vec<crate::left_alone::LeftAlone>,
    /// The mesh configuration the agent reads, if it reads one (the default revision's).
    pub mesh_config: Option<crate::config::mesh_config::MeshConfigReport>,
    /// Every revision's, where `--mesh-config` is a directory.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mesh_configs: Vec<crate::config::mesh_config::MeshConfigReport>,
    /// capture-cni in the node's CNI configuration, where the agent keeps it chained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cni_chain: Option<crate::install::chain_report::ChainReport>,
    /// `capture trace` on this node, where the node's programs have it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<crate::trace::NodeTrace>,
    /// Every sandbox of the node's runtime beside capture's records (`status --all`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<crate::runtime::RuntimeReport>,
    /// The agent's last reconcile with the runtime, where it runs one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reconcile: Option<crate::runtime::ReconcileReport>,
}

pub fn status(paths: &Paths) -> Result<NodeStatus, Error> {
    let record::Scan {
        records,
        damaged: damaged_records,
    } = record::scan(paths)?;
    let ebpf = EbpfBackend::adopt(paths).ok();
    let mut backends = ExistingBackends::new(paths);
    let pods = records
        .into_iter()
        .map(|record| status_of(paths, &mut backends, record))
        .collect();
    let names = [
        "unknown_pod",
        "no_socket_storage",
        "handoff_failed",
        "listener_registration",
    ];
    let node_errors = ebpf
        .as_ref()
        .map(|b| names.into_iter().zip(b.node_errors()).collect())
        .unwrap_or_default();
    let node_record = crate::ebpf::node::read_node_record(paths);
    Ok(NodeStatus {
        bpffs: paths.bpffs.clone(),
        state_dir: paths.state_dir.clone(),
        programs_loaded: ebpf.is_some(),
        build: crate::ebpf::loader::build_name(),
        node_build: node_record
            .as_ref()
            .map(crate::ebpf::node::NodeRecord::build),
        node_features: node_record.and_then(|r| r.features),
        pods,
        damaged_records,
        node_errors,
        pending_handoffs: ebpf.as_ref().map_or(0, EbpfBackend::pending_handoffs),
        left_alone: crate::left_alone::list(paths),
        mesh_config: std::fs::read(paths.mesh_config_report_path())
            .ok()
            .and_then(|data| serde_json::from_slice(&data).ok()),
        mesh_configs: std::fs::read(paths.mesh_configs_report_path())
            .ok()
            .and_then(|data| serde_json::from_slice(&data).ok())
            .unwrap_or_default(),
        cni_chain: crate::install::chain_report::load(paths),
        trace: crate::trace::node_trace(paths),
        runtime: None,
        reconcile: crate::runtime::report::load(paths),
    })
}
