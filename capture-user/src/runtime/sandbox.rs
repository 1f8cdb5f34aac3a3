//! A pod sandbox as the container runtime knows it, read from CRI's `ListPodSandbox` and
//! `PodSandboxStatus` (verbose: the runtime's own description, where containerd and CRI-O give
//! the sandbox's OCI spec and with it the netns path).

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    path::PathBuf,
};

use k8s_cri::v1::{NamespaceMode, PodSandbox, PodSandboxState, PodSandboxStatusResponse};
use serde::Serialize;
use serde_json::Value;

/// One pod sandbox of the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Sandbox {
    /// The runtime's sandbox id: what a CNI ADD receives as `CNI_CONTAINERID`.
    pub id: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// `SANDBOX_READY`: its network is set up and its containers may run.
    pub ready: bool,
    pub annotations: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    /// The pod shares the node's network namespace (no CNI ADD ever runs for it).
    pub host_network: bool,
    /// The pod's network namespace, where the runtime's verbose status names it.
    pub netns: Option<PathBuf>,
    /// The pod's addresses (CRI's `ip` and `additional_ips`).
    pub ips: Vec<IpAddr>,
    /// What could not be read from the runtime's answer (an address that does not parse).
    pub unreadable: Vec<String>,
}

impl Sandbox {
    /// The sandbox from its list entry and, where the runtime answered it, its verbose status.
    #[must_use]
    pub fn from_cri(listed: &PodSandbox, status: Option<&PodSandboxStatusResponse>) -> Self {
        let mut sandbox = Self::listed(listed);
        if let Some(response) = status {
            sandbox.describe(response);
        }
        sandbox
    }

    /// What the list entry says: identity, state, annotations and labels. The network (host or
    /// not, addresses, netns) comes from the status (`describe`).
    #[must_use]
    pub fn listed(listed: &PodSandbox) -> Self {
        let metadata = listed.metadata.clone().unwrap_or_default();
        Self {
            id: listed.id.clone(),
            namespace: metadata.namespace,
            name: metadata.name,
            uid: metadata.uid,
            ready: listed.state == PodSandboxState::SandboxReady as i32,
            annotations: sorted(&listed.annotations),
            labels: sorted(&listed.labels),
            host_network: false,
            netns: None,
            ips: Vec::new(),
            unreadable: Vec::new(),
        }
    }

    /// Adds what the verbose status says of the sandbox's network.
    pub fn describe(&mut self, response: &PodSandboxStatusResponse) {
        if let Some(status) = &response.status {
            self.host_network = status
                .linux
                .as_ref()
                .and_then(|l| l.namespaces.as_ref())
                .and_then(|n| n.options.as_ref())
                .is_some_and(|o| o.network == NamespaceMode::Node as i32);
            if let Some(network) = &status.network {
                let all = std::iter::once(network.ip.as_str())
                    .chain(network.additional_ips.iter().map(|ip| ip.ip.as_str()))
                    .filter(|ip| !ip.is_empty());
                self.ips.clear();
                for ip in all {
                    match ip.parse() {
                        Ok(ip) => self.ips.push(ip),
                        Err(_) => self.unreadable.push(format!("address {ip:?}")),
                    }
                }
            }
        }
        self.netns = netns_path(&response.info);
    }

    /// `NAMESPACE/NAME`.
    #[must_use]
    pub fn display_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

fn sorted(map: &HashMap<String, String>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// The network namespace's path from a verbose status: its `info` entry is the runtime's JSON
/// description, whose `runtimeSpec` (containerd and CRI-O alike) lists the sandbox's namespaces.
fn netns_path(info: &HashMap<String, String>) -> Option<PathBuf> {
    let described: Value = serde_json::from_str(info.get("info")?).ok()?;
    described["runtimeSpec"]["linux"]["namespaces"]
        .as_array()?
        .iter()
        .find(|ns| ns["type"] == "network")?["path"]
        .as_str()
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use k8s_cri::v1::{
        LinuxPodSandboxStatus, Namespace, NamespaceOption, PodIp, PodSandboxMetadata,
        PodSandboxNetworkStatus, PodSandboxStatus,
    };

    use super::*;

    fn listed(state: PodSandboxState) -> PodSandbox {
        PodSandbox {
            id: "abc123".into(),
            metadata: Some(PodSandboxMetadata {
                name: "web-1".into(),
                uid: "u-1".into(),
                namespace: "shop".into(),
                attempt: 0,
            }),
            state: state as i32,
            annotations: HashMap::from([("sidecar.istio.io/status".into(), "{}".into())]),
            ..PodSandbox::default()
        }
    }

    fn status(network: NamespaceMode, ips: &[&str], info: &str) -> PodSandboxStatusResponse {
        PodSandboxStatusResponse {
            status: Some(PodSandboxStatus {
                network: Some(PodSandboxNetworkStatus {
                    ip: ips.first().copied().unwrap_or_default().into(),
                    additional_ips: ips[1..]
                        .iter()
                        .map(|ip| PodIp { ip: (*ip).into() })
                        .collect(),
                }),
                linux: Some(LinuxPodSandboxStatus {
                    namespaces: Some(Namespace {
                        options: Some(NamespaceOption {
                            network: network as i32,
                            ..NamespaceOption::default()
                        }),
                    }),
                }),
                ..PodSandboxStatus::default()
            }),
            info: HashMap::from([("info".into(), info.into())]),
            ..PodSandboxStatusResponse::default()
        }
    }

    /// The shape containerd's verbose status has (`pkg/cri/server/sandbox_status.go`).
    const CONTAINERD_INFO: &str = r#"{"pid":4242,"processStatus":"running","netNamespaceClosed":false,
        "runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"ipc"},{"type":"uts"},
        {"type":"mount"},{"type":"network","path":"/var/run/netns/cni-1f2e"}]}}}"#;

    #[test]
    fn a_ready_pod_network_sandbox_gives_its_netns_and_addresses() {
        let s = Sandbox::from_cri(
            &listed(PodSandboxState::SandboxReady),
            Some(&status(
                NamespaceMode::Pod,
                &["10.1.0.10", "fd00:1::10"],
                CONTAINERD_INFO,
            )),
        );
        assert!(s.ready && !s.host_network);
        assert_eq!(s.display_name(), "shop/web-1");
        assert_eq!(s.netns, Some(PathBuf::from("/var/run/netns/cni-1f2e")));
        assert_eq!(
            s.ips,
            vec![
                "10.1.0.10".parse::<IpAddr>().unwrap(),
                "fd00:1::10".parse().unwrap()
            ]
        );
        assert!(s.unreadable.is_empty());
    }

    #[test]
    fn host_network_not_ready_and_unreadable_answers_are_told() {
        let s = Sandbox::from_cri(
            &listed(PodSandboxState::SandboxNotready),
            Some(&status(
                NamespaceMode::Node,
                &["10.1.0.10", "nonsense"],
                "not json",
            )),
        );
        assert!(!s.ready && s.host_network);
        assert_eq!(s.netns, None, "no description, no netns");
        assert_eq!(s.unreadable, vec![r#"address "nonsense""#.to_string()]);
        let bare = Sandbox::from_cri(&listed(PodSandboxState::SandboxReady), None);
        assert!(bare.ips.is_empty() && bare.netns.is_none());
    }
}
