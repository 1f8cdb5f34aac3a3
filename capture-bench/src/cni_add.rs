//! CNI ADD latency on the path kubelet pays: the runtime runs capture-cni after the network
//! plugin, capture-cni asks the agent, the agent attaches; timed from exec to the plugin's result.

use std::{process::Command, time::Instant};

use capture_tests::{
    cni::{CgroupDriver, Node, Pod, MESHED},
    topology::cgroup_programs,
};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CniAdd {
    /// The agent's capture mode.
    pub mode: String,
    pub pods: usize,
    /// capture-cni ADD latency of each pod in order, ms.
    pub latencies_ms: Vec<f64>,
}

/// ADDs `pods` pods one after the other on a node of their own with the agent in `mode`; every
/// pod gets its bridge interface first (untimed), as the chained list runs.
pub fn measure(mode: &str, pods: usize) -> CniAdd {
    let node = Node::new();
    let _agent = node.start_agent(mode);
    let list = node.conflist();
    let mut latencies_ms = Vec::with_capacity(pods);
    let mut added = Vec::with_capacity(pods);
    for i in 0..pods {
        let mut pod = node.pod(&format!("bench-{i}"), CgroupDriver::Cgroupfs, MESHED);
        let bridge = node.plugin_conf(&list, 0, &pod, None);
        let prev = node
            .exec_plugin("ADD", &pod, &bridge, None)
            .unwrap_or_else(|e| panic!("bridge ADD failed: {e}"));
        let capture = node.plugin_conf(&list, 1, &pod, Some(&prev));
        let start = Instant::now();
        let result = node.exec_plugin("ADD", &pod, &capture, None);
        latencies_ms.push(start.elapsed().as_secs_f64() * 1e3);
        pod.result = Some(result.unwrap_or_else(|e| panic!("capture-cni ADD failed: {e}")));
        assert!(
            captured(mode, &pod),
            "capture-cni ADD succeeded but pod {i} is not captured in {mode} mode"
        );
        added.push(pod);
    }
    for pod in &added {
        let _ = node.del(pod);
    }
    CniAdd {
        mode: mode.into(),
        pods,
        latencies_ms,
    }
}

/// Whether the pod's capture is in place: programs on its cgroup, or the Istio chains in its
/// netns (iptables' or nftables').
fn captured(mode: &str, pod: &Pod) -> bool {
    let (lister, chain): (&[&str], &str) = match mode {
        "ebpf" => return !cgroup_programs(&pod.cgroup).is_empty(),
        "nftables" => (
            &["nft", "list", "table", "inet", "istio-proxy-nat"],
            "istio-redirect",
        ),
        _ => (&["iptables-save", "-t", "nat"], "ISTIO_REDIRECT"),
    };
    Command::new("nsenter")
        .arg(format!("--net={}", pod.netns.path().display()))
        .args(lister)
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(chain))
}
