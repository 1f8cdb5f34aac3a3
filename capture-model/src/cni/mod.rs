//! The chained CNI plugin's logic, apart from the protocol plumbing (rscni-plugin does that in
//! the `capture-cni` binary): which pods to capture (parity-spec.md section F), who they are, where their
//! cgroup is, and how to ask the agent.

pub mod selection;

pub use selection::{skip_reason, Skip};

use std::{collections::BTreeMap, path::PathBuf};

use serde::Deserialize;

/// The plugin's own keys in its conflist entry.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginConfig {
    /// The capture agent's socket.
    pub agent_socket: PathBuf,
    /// Namespaces whose pods are never captured (Istio's Helm default: kube-system).
    pub exclude_namespaces: Vec<String>,
    /// Where to look for pod cgroups; default: the cgroup2 mount.
    pub cgroup_root: Option<PathBuf>,
    /// How long to wait for the agent.
    pub timeout_seconds: u64,
    /// The agent's state directory, where its claims tell DEL which pods it captured.
    pub state_dir: PathBuf,
}

impl Default for PluginConfig {
    fn default() -> Self {
        Self {
            agent_socket: crate::api::DEFAULT_SOCKET.into(),
            exclude_namespaces: vec!["kube-system".into()],
            cgroup_root: None,
            timeout_seconds: 10,
            state_dir: crate::paths::DEFAULT_STATE_DIR.into(),
        }
    }
}

/// The `CNI_ARGS` keys Kubernetes runtimes pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct K8sArgs {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub infra_container_id: String,
}

/// Parses `CNI_ARGS` (`K=V;K=V`). Every key capture needs must be there.
pub fn parse_cni_args(raw: Option<&str>) -> Result<K8sArgs, String> {
    let map: BTreeMap<&str, &str> = raw
        .unwrap_or_default()
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .collect();
    let get = |k: &str| {
        map.get(k)
            .map(|v| (*v).to_string())
            .filter(|v| !v.is_empty())
    };
    let missing: Vec<&str> = ["K8S_POD_NAMESPACE", "K8S_POD_NAME", "K8S_POD_UID"]
        .into_iter()
        .filter(|k| get(k).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "CNI_ARGS lacks {} (got {:?}); the runtime must pass the pod's Kubernetes identity",
            missing.join(", "),
            raw.unwrap_or_default()
        ));
    }
    Ok(K8sArgs {
        namespace: get("K8S_POD_NAMESPACE").unwrap_or_default(),
        name: get("K8S_POD_NAME").unwrap_or_default(),
        uid: get("K8S_POD_UID").unwrap_or_default(),
        infra_container_id: get("K8S_POD_INFRA_CONTAINER_ID").unwrap_or_default(),
    })
}

/// The runtime capability that carries the pod's annotations (containerd, CRI-O).
pub const POD_ANNOTATIONS_CAPABILITY: &str = "io.kubernetes.cri.pod-annotations";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cni_args() {
        let a = parse_cni_args(Some("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u-1;K8S_POD_INFRA_CONTAINER_ID=c"))
            .unwrap();
        assert_eq!(
            (
                a.namespace.as_str(),
                a.name.as_str(),
                a.uid.as_str(),
                a.infra_container_id.as_str()
            ),
            ("ns", "p", "u-1", "c")
        );
        let e = parse_cni_args(Some("K8S_POD_NAMESPACE=ns")).unwrap_err();
        assert!(
            e.contains("K8S_POD_NAME") && e.contains("K8S_POD_UID"),
            "{e}"
        );
        assert!(parse_cni_args(None).is_err());
    }
}
