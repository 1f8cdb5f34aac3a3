//! CNI ADD latency on the path kubelet pays: the runtime runs capture-cni after the network
//! plugin, capture-cni asks the agent, the agent attaches; timed from exec to the plugin's result.
//! A burst of pods, added one after the other or several at once, as a node sees when a drain
//! elsewhere or a scale-up lands many pods on it together.

use std::{
    fmt::Write as _,
    process::Command,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Mutex,
    },
    time::Instant,
};

use capture_tests::{
    cni::{CgroupDriver, Node, Pod, MESHED},
    topology::cgroup_programs,
};
use serde::{Deserialize, Serialize};

use crate::stats::{median, percentile};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CniAdd {
    /// The agent's capture mode.
    pub mode: String,
    pub pods: usize,
    /// ADDs in flight at once (1: one after the other).
    #[serde(default = "one")]
    pub concurrent: usize,
    /// capture-cni ADD latency of each pod in the order the pods were made, ms.
    pub latencies_ms: Vec<f64>,
}

fn one() -> usize {
    1
}

/// The agent modes measured, and the ADDs in flight at once.
pub const MODES: [&str; 3] = ["ebpf", "iptables", "nftables"];
pub const BURST: usize = 8;

/// ADDs `pods` pods on a node of their own with the agent in `mode`, `concurrent` at a time.
/// Every pod gets its netns, cgroup and bridge interface first (untimed, as the chained list
/// runs the network plugin before capture-cni), so that the burst is capture-cni's alone.
pub fn measure(mode: &str, pods: usize, concurrent: usize) -> CniAdd {
    let node = Node::new();
    let _agent = node.start_agent(mode);
    let list = node.conflist();
    let mut made: Vec<Pod> = (0..pods)
        .map(|i| {
            let mut pod = node.pod(&format!("bench-{i}"), CgroupDriver::Cgroupfs, MESHED);
            let bridge = node.plugin_conf(&list, 0, &pod, None);
            let prev = node
                .exec_plugin("ADD", &pod, &bridge, None)
                .unwrap_or_else(|e| panic!("bridge ADD failed: {e}"));
            pod.result = Some(prev);
            pod
        })
        .collect();
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::with_capacity(pods));
    std::thread::scope(|s| {
        for _ in 0..concurrent.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(pod) = made.get(i) else { break };
                let capture = node.plugin_conf(&list, 1, pod, pod.result.as_ref());
                let start = Instant::now();
                let result = node.exec_plugin("ADD", pod, &capture, None);
                let ms = start.elapsed().as_secs_f64() * 1e3;
                let result = result.unwrap_or_else(|e| panic!("capture-cni ADD failed: {e}"));
                done.lock()
                    .expect("no worker panicked")
                    .push((i, ms, result));
            });
        }
    });
    let mut done = done.into_inner().expect("no worker panicked");
    done.sort_by_key(|(i, _, _)| *i);
    let mut latencies_ms = Vec::with_capacity(pods);
    for (i, ms, result) in done {
        let pod = &mut made[i];
        pod.result = Some(result);
        assert!(
            captured(mode, pod),
            "capture-cni ADD succeeded but pod {i} is not captured in {mode} mode"
        );
        latencies_ms.push(ms);
    }
    for pod in &made {
        let _ = node.del(pod);
    }
    CniAdd {
        mode: mode.into(),
        pods,
        concurrent: concurrent.max(1),
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

/// The report's section: each run's p50, p99 and max.
pub fn write_table(o: &mut String, runs: &[CniAdd]) {
    let _ = writeln!(o, "## CNI ADD\n");
    let _ = writeln!(
        o,
        "| agent mode | ADDs at once | pods | p50 ms | p99 ms | max ms |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|");
    for c in runs {
        let (p50, p99, max) = c.summary();
        let _ = writeln!(
            o,
            "| {} | {} | {} | {p50:.2} | {p99:.2} | {max:.2} |",
            c.mode, c.concurrent, c.pods
        );
    }
    let _ = writeln!(o, "\nThe capture-cni step of a chained ADD, from the runtime's exec to the plugin's result: plugin start, the pod's cgroup found from its UID, the request to the agent and the agent's attach. Every pod of the burst is made and given its bridge interface first (the network plugin's ADD, not counted); then capture-cni runs for each, one after the other or several at once. The agent attaches one pod at a time (the node lock), so ADDs at once wait for each other: their latency is the queue's.\n");
}

impl CniAdd {
    /// p50, p99 and max, ms.
    #[must_use]
    pub fn summary(&self) -> (f64, f64, f64) {
        let l = &self.latencies_ms;
        (
            median(l.clone()),
            percentile(l.clone(), 0.99),
            l.iter().copied().fold(0.0, f64::max),
        )
    }
}

/// The targets: ebpf p99 ≤ 5 ms one at a time and ≤ 20 ms in a burst of eight; the rule
/// backends' p99 ≤ 10 ms one at a time.
#[must_use]
pub fn targets(runs: &[CniAdd]) -> Vec<(String, bool)> {
    runs.iter()
        .filter_map(|c| {
            let aim = match (c.mode.as_str(), c.concurrent) {
                ("ebpf", 1) => 5.0,
                ("ebpf", BURST) => 20.0,
                ("iptables" | "nftables", 1) => 10.0,
                _ => return None,
            };
            let p99 = c.summary().1;
            Some((
                format!(
                    "{} CNI ADD p99 ≤ {aim:.0} ms, {} at once: {p99:.2} ms",
                    c.mode, c.concurrent
                ),
                p99 <= aim,
            ))
        })
        .collect()
}
