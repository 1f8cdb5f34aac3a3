//! The node's truth: every sandbox the runtime has, beside the pods capture recorded. A meshed
//! sandbox without a record runs uncaptured; a record without a sandbox is a DEL that never came.
//! Pure: the agent's reconcile and `capture status --all` both read it.

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

/// A record whose sandbox the runtime no longer has.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Orphan {
    pub pod: String,
    pub netns: String,
    pub netns_cookie: u64,
    pub container_id: String,
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

/// Whether `record` is `sandbox`'s: the ADD's container id is the sandbox id; a pod captured
/// with the CLI alone has no id, and is matched by its netns.
fn record_of(sandbox: &Sandbox, record: &PodRecord) -> bool {
    match &record.pod {
        Some(pod) if !pod.container_id.is_empty() => pod.container_id == sandbox.id,
        _ => sandbox.netns.as_ref() == Some(&record.netns),
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
    for sandbox in sandboxes {
        let record = records.iter().find(|r| record_of(sandbox, r));
        let k8s = K8sArgs {
            namespace: sandbox.namespace.clone(),
            name: sandbox.name.clone(),
            uid: sandbox.uid.clone(),
            infra_container_id: sandbox.id.clone(),
        };
        let skip = skip_reason(selection, &k8s, &sandbox.annotations);
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
    view.orphans = records
        .iter()
        .filter(|r| !sandboxes.iter().any(|s| record_of(s, r)))
        .filter_map(|r| {
            let pod = r.pod.as_ref().filter(|p| !p.container_id.is_empty())?;
            Some(Orphan {
                pod: r.display_name(),
                netns: r.netns.display().to_string(),
                netns_cookie: r.netns_cookie,
                container_id: pod.container_id.clone(),
            })
        })
        .collect();
    view.sandboxes.sort_by(|a, b| a.pod.cmp(&b.pod));
    view
}
