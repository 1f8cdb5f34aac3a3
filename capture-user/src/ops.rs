//! The operations behind `capture attach|detach|status`, shared by the CLI and the agent.
//! Each validates all input before it changes anything, and takes the node lock for changes.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use capture_common::config::PodCounters;
use serde::Serialize;

use crate::{
    backend::{self, BackendError, PodTarget},
    cgroup::{self, CgroupError},
    config::{CaptureConfig, ConfigError, PodSpec},
    ebpf::EbpfBackend,
    lock::NodeLock,
    netns::{Netns, NetnsError},
    paths::{Paths, PathsError},
    record::{self, Mode, PodRecord, RecordError},
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
    #[error("pod netns {0} is not captured (no record in the state directory)")]
    NotAttached(PathBuf),
}

/// What `attach` is asked to do.
#[derive(Clone, Debug)]
pub struct AttachRequest {
    pub netns: PathBuf,
    pub cgroup: PathBuf,
    pub spec: PodSpec,
    pub mode: Mode,
}

fn lock(paths: &Paths) -> Result<NodeLock, Error> {
    let path = paths.lock_path();
    NodeLock::acquire(&path).map_err(|source| Error::Lock { path, source })
}

/// Captures a pod. Attaching the same pod again with the same request is a no-op.
pub fn attach(paths: &Paths, req: &AttachRequest) -> Result<PodRecord, Error> {
    let config = CaptureConfig::from_pod(&req.spec)?;
    let netns = Netns::open(&req.netns)?;
    let cgroup = cgroup::open_cgroup2(&req.cgroup)?;
    paths.prepare()?;
    let _lock = lock(paths)?;
    let netns_cookie = netns.cookie()?;
    let records = record::load_all(paths)?;
    if let Some(existing) = records.iter().find(|r| r.netns_cookie == netns_cookie) {
        if existing.config == config && existing.cgroup == req.cgroup && existing.mode == req.mode {
            return Ok(existing.clone());
        }
        return Err(Error::AlreadyAttached {
            netns: req.netns.clone(),
            cgroup: existing.cgroup.clone(),
            mode: existing.mode,
        });
    }

    let record = PodRecord {
        netns_cookie,
        netns: req.netns.clone(),
        cgroup: req.cgroup.clone(),
        mode: req.mode,
        annotations: req.spec.annotations.clone(),
        config,
        attached_at_unix: record::now_unix(),
    };
    let ebpf_pods = records.iter().filter(|r| r.mode == Mode::Ebpf).count();
    let mut backend = backend::for_attach(paths, req.mode, ebpf_pods)?;
    let target = PodTarget {
        netns_cookie,
        netns_path: &req.netns,
        netns: netns.file(),
        cgroup_path: &req.cgroup,
        cgroup: &cgroup,
    };
    backend.attach(&target, &record.config)?;
    if let Err(e) = record::save(paths, &record) {
        let _ = backend.detach(&record);
        return Err(e.into());
    }
    Ok(record)
}

/// Finds a pod's record by its netns: by cookie while the netns exists, else by the path it was
/// attached with (the pod's netns may be gone by the time it is detached).
fn find_record(paths: &Paths, netns_path: &Path) -> Result<Option<PodRecord>, Error> {
    let records = record::load_all(paths)?;
    let cookie = Netns::open(netns_path).ok().and_then(|n| n.cookie().ok());
    Ok(records
        .into_iter()
        .find(|r| cookie.map_or(r.netns == netns_path, |c| r.netns_cookie == c)))
}

/// Stops capturing a pod and removes everything attach created for it.
pub fn detach(paths: &Paths, netns_path: &Path) -> Result<PodRecord, Error> {
    if !paths.state_dir.exists() {
        return Err(Error::NotAttached(netns_path.into()));
    }
    let _lock = lock(paths)?;
    let record =
        find_record(paths, netns_path)?.ok_or_else(|| Error::NotAttached(netns_path.into()))?;
    match backend::existing(paths, record.mode) {
        Ok(mut backend) => backend.detach(&record)?,
        // No ebpf programs pinned on this node: nothing is left in the kernel but the pod's links.
        Err(_) => {
            let _ = std::fs::remove_dir_all(paths.pod_links_dir(record.netns_cookie));
        }
    }
    record::remove(paths, record.netns_cookie)?;
    Ok(record)
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
}

#[derive(Debug, Serialize)]
pub struct NodeStatus {
    pub bpffs: PathBuf,
    pub state_dir: PathBuf,
    pub programs_loaded: bool,
    pub pods: Vec<PodStatus>,
    pub node_errors: BTreeMap<&'static str, u64>,
    pub pending_handoffs: usize,
}

pub fn status(paths: &Paths) -> Result<NodeStatus, Error> {
    let records = record::load_all(paths)?;
    let ebpf = EbpfBackend::adopt(paths).ok();
    let mut backends = backend::ExistingBackends::new(paths);
    let pods = records
        .into_iter()
        .map(|record| {
            let (missing, counters) = match backends.get(record.mode) {
                Some(b) => (b.missing(&record), b.counters(&record)),
                None => (
                    vec![format!("the node's {} backend (not loaded)", record.mode)],
                    None,
                ),
            };
            PodStatus {
                in_force: missing.is_empty(),
                missing,
                counters,
                record,
            }
        })
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
    Ok(NodeStatus {
        bpffs: paths.bpffs.clone(),
        state_dir: paths.state_dir.clone(),
        programs_loaded: ebpf.is_some(),
        pods,
        node_errors,
        pending_handoffs: ebpf.as_ref().map_or(0, EbpfBackend::pending_handoffs),
    })
}
