//! A test pod of the CNI node: its netns and kubelet-style cgroup, what ADD gave it, and the
//! servers and clients that stand for its proxy and app.

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use serde_json::Value;

use crate::{
    guards::{ChildGuard, NetnsGuard},
    probe::{probe_in, Who},
};

/// A pod as the runtime sees it.
pub struct Pod {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub container_id: String,
    pub netns: NetnsGuard,
    pub cgroup: PathBuf,
    pub annotations: BTreeMap<String, String>,
    pub ip: Option<String>,
    pub result: Option<Value>,
}

impl Pod {
    #[must_use]
    pub fn cni_args(&self) -> String {
        format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            self.namespace, self.name, self.container_id, self.uid
        )
    }

    #[must_use]
    pub fn ip(&self) -> &str {
        self.ip.as_deref().expect("the pod has been added")
    }

    /// Keeps a chained ADD's result (the prevResult of what follows) and the pod's address in
    /// it.
    pub fn set_result(&mut self, result: Value) {
        if let Some(addr) = result["ips"][0]["address"].as_str() {
            self.ip = addr.split('/').next().map(str::to_string);
        }
        self.result = Some(result);
    }

    /// Starts the proxy (15001, 15006 as 1337) and an app (8080, 9090 as 1000) in the pod.
    pub fn start_servers(&self) -> Vec<ChildGuard> {
        let mut servers = Vec::new();
        for (who, listeners) in [
            (Who::proxy(), vec![("outbound", 15001), ("inbound", 15006)]),
            (Who::app(), vec![("app", 8080), ("app", 9090)]),
        ] {
            let mut cmd = probe_in(&self.netns.path(), Some(&self.cgroup), Some(&who));
            cmd.arg("serve");
            for (name, port) in listeners {
                cmd.arg("--tcp").arg(format!("{name}=0.0.0.0:{port}"));
            }
            servers.push(ChildGuard::spawn_ready(&mut cmd));
        }
        servers
    }

    /// A connection from the pod's app.
    #[must_use]
    pub fn app_client(&self) -> Command {
        probe_in(&self.netns.path(), Some(&self.cgroup), Some(&Who::app()))
    }
}

/// The pod named `name` in `capture status --json` (panics naming the pods there if absent).
#[must_use]
pub fn pod_status<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["pods"]
        .as_array()
        .and_then(|pods| pods.iter().find(|p| p["pod"]["name"] == name))
        .unwrap_or_else(|| panic!("{name} not in {status}"))
}
