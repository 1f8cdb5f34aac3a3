//! The node's truth: every sandbox the runtime has, beside the pods capture recorded. A meshed
//! sandbox without a record runs uncaptured; a record without a sandbox is a DEL that never came.
//! Pure: the agent's reconcile and `capture status --all` both read it.

use std::{collections::HashMap, path::Path};

use serde::Serialize;

use super::sandbox::Sandbox;
use crate::{
    cni::{selection::skip_reason, K8sArgs, PluginConfig, Skip},
    record::{Mode, PodRecord},
};

/// Where a sandbox stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Standing {
    /// Captured, by the backend in `captured`.
    Captured,
    /// Meshed, ready, and not captured: capture never saw its ADD.
    MeshedNotCaptured,
    /// Meshed, not captured, and not ready (its network is not set up, or it is going away).
    MeshedNotReady,
    /// Not meshed: no sidecar, or left alone by Istio's rules (`why`).
    NotMeshed,
    /// The pod shares the node's network namespace: no CNI ADD runs for it.
    HostNetwork,
}

/// One sandbox as `capture status --all` shows it; the field names are stable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SandboxView {
    /// `NAMESPACE/NAME`.
    pub pod: String,
    pub sandbox_id: String,
    pub ready: bool,
    pub meshed: bool,
    pub standing: Standing,
    /// The backend in force for a captured pod.
    pub captured: Option<Mode>,
    /// Why it is not captured, in words.
    pub why: Option<String>,
}

/// What the runtime says of an orphan's sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OrphanSandbox {
    /// Not listed: removed (or its ADD has not returned yet).
    Gone,
    /// Listed, not ready: stopped, its network torn down.
    Stopped,
}

impl std::fmt::Display for OrphanSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Gone => "gone",
            Self::Stopped => "stopped",
        })
    }
}

/// A record whose sandbox the runtime no longer has, or has stopped: its DEL may never have
/// reached capture (the reconcile releases it once its netns is gone too).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Orphan {
    pub pod: String,
    pub sandbox: OrphanSandbox,
    pub netns: String,
    pub netns_cookie: u64,
    pub container_id: String,
    /// When it was captured.
    pub attached_at_unix: u64,
}

/// Every sandbox with its standing, and the records no sandbox accounts for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeView {
    pub sandboxes: Vec<SandboxView>,
    pub orphans: Vec<Orphan>,
}

impl NodeView {
    /// The meshed sandboxes that run uncaptured (ready or not).
    pub fn uncaptured(&self) -> impl Iterator<Item = &SandboxView> {
        self.sandboxes.iter().filter(|s| {
            matches!(
                s.standing,
                Standing::MeshedNotCaptured | Standing::MeshedNotReady
            )
        })
    }
}

/// The records by what names their sandbox: the ADD's container id (the sandbox id), or, for a
/// pod captured with the CLI alone, its netns path. One lookup per sandbox, so a pass over a
/// thousand sandboxes costs a thousand lookups, not a million comparisons.
struct RecordIndex<'r> {
    by_id: HashMap<&'r str, &'r PodRecord>,
    by_netns: HashMap<&'r Path, &'r PodRecord>,
}

impl<'r> RecordIndex<'r> {
    fn new(records: &'r [PodRecord]) -> Self {
        let mut index = Self {
            by_id: HashMap::with_capacity(records.len()),
            by_netns: HashMap::new(),
        };
        for r in records {
            match r.pod.as_ref().filter(|p| !p.container_id.is_empty()) {
                Some(pod) => index.by_id.insert(&pod.container_id, r),
                None => index.by_netns.insert(&r.netns, r),
            };
        }
        index
    }

    /// `sandbox`'s record, if capture has one.
    fn of(&self, sandbox: &Sandbox) -> Option<&'r PodRecord> {
        self.by_id.get(sandbox.id.as_str()).copied().or_else(|| {
            sandbox
                .netns
                .as_deref()
                .and_then(|n| self.by_netns.get(n).copied())
        })
    }
}

fn k8s_args(sandbox: &Sandbox) -> K8sArgs {
    K8sArgs {
        namespace: sandbox.namespace.clone(),
        name: sandbox.name.clone(),
        uid: sandbox.uid.clone(),
        infra_container_id: sandbox.id.clone(),
    }
}

/// The node's sandboxes beside its records, with `selection` (the chained capture-cni's keys)
/// deciding which pods are meshed, as the CNI plugin decides it at ADD.
#[must_use]
pub fn node_view(
    sandboxes: &[Sandbox],
    records: &[PodRecord],
    selection: &PluginConfig,
) -> NodeView {
    let mut view = NodeView::default();
    let index = RecordIndex::new(records);
    for sandbox in sandboxes {
        let record = index.of(sandbox);
        let skip = skip_reason(selection, &k8s_args(sandbox), &sandbox.annotations);
        let meshed = skip.is_none() && !sandbox.host_network;
        let (standing, why) = match (record, sandbox.host_network, &skip) {
            (Some(_), _, _) => (Standing::Captured, None),
            (None, true, _) => (
                Standing::HostNetwork,
                Some("host network: the pod shares the node's netns, and no CNI ADD runs for it".into()),
            ),
            (None, false, Some(Skip::NoSidecar)) => (Standing::NotMeshed, Some(Skip::NoSidecar.to_string())),
            (None, false, Some(skip)) => (Standing::NotMeshed, Some(format!("left alone: {skip}"))),
            (None, false, None) if sandbox.ready => (
                Standing::MeshedNotCaptured,
                Some("no CNI ADD reached capture (the pod started before install-cni, or while the CNI chain lacked capture-cni)".into()),
            ),
            (None, false, None) => (
                Standing::MeshedNotReady,
                Some("the sandbox is not ready (its network is not set up, or it is going away)".into()),
            ),
        };
        view.sandboxes.push(SandboxView {
            pod: sandbox.display_name(),
            sandbox_id: sandbox.id.clone(),
            ready: sandbox.ready,
            meshed,
            standing,
            captured: record.map(|r| r.mode),
            why,
        });
    }
    // Only the pods a CNI ADD captured are the runtime's: one captured with the CLI alone is
    // no sandbox's, and its absence from the list says nothing.
    let listed: HashMap<&str, bool> = sandboxes.iter().map(|s| (s.id.as_str(), s.ready)).collect();
    view.orphans = records
        .iter()
        .filter_map(|r| {
            let pod = r.pod.as_ref().filter(|p| !p.container_id.is_empty())?;
            let sandbox = match listed.get(pod.container_id.as_str()) {
                Some(true) => return None,
                Some(false) => OrphanSandbox::Stopped,
                None => OrphanSandbox::Gone,
            };
            Some(Orphan {
                pod: r.display_name(),
                sandbox,
                netns: r.netns.display().to_string(),
                netns_cookie: r.netns_cookie,
                container_id: pod.container_id.clone(),
                attached_at_unix: r.attached_at_unix,
            })
        })
        .collect();
    view.sandboxes.sort_by(|a, b| a.pod.cmp(&b.pod));
    view
}
