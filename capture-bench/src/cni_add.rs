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
    /// Each round's capture-cni ADD latencies, in the order the pods were made, ms.
    #[serde(default)]
    pub rounds: Vec<Vec<f64>>,
}

fn one() -> usize {
    1
}

/// The agent modes measured, and the ADDs in flight at once.
pub const MODES: [&str; 3] = ["ebpf", "iptables", "nftables"];
pub const BURST: usize = 8;
pub const ROUNDS: usize = 5;

/// One agent mode's node: its agent and its pods, each with its netns, cgroup and bridge
/// interface (the network plugin's ADD, untimed: the chained list runs it before capture-cni).
struct Bed {
    mode: String,
    node: Node,
    _agent: capture_tests::cni::Agent,
    list: serde_json::Value,
    pods: Vec<Pod>,
}

impl Bed {
    fn new(mode: &str, pods: usize) -> Self {
        let node = Node::new();
        let agent = node.start_agent(mode);
        let list = node.conflist();
        let pods = (0..pods)
            .map(|i| {
                let mut pod = node.pod(&format!("bench-{i}"), CgroupDriver::Cgroupfs, MESHED);
                node.add_network(&mut pod)
                    .unwrap_or_else(|e| panic!("bridge ADD failed: {e}"));
                pod
            })
            .collect();
        Self {
            mode: mode.into(),
            node,
            _agent: agent,
            list,
            pods,
        }
    }

    /// capture-cni's ADD of every pod, `concurrent` at a time: each pod's latency, ms. Every
    /// pod is checked captured, then released again by capture-cni's DEL (untimed) for the
    /// next round.
    fn burst(&self, concurrent: usize) -> Vec<f64> {
        let next = AtomicUsize::new(0);
        let done = Mutex::new(Vec::with_capacity(self.pods.len()));
        let confs: Vec<serde_json::Value> = self
            .pods
            .iter()
            .map(|pod| {
                self.node
                    .plugin_conf(&self.list, 1, pod, pod.result.as_ref())
            })
            .collect();
        std::thread::scope(|s| {
            for _ in 0..concurrent.max(1) {
                s.spawn(|| {
                    // A runtime execs its plugins from the node's netns without a fork of itself.
                    self.node.enter_netns();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(pod) = self.pods.get(i) else { break };
                        let start = Instant::now();
                        let result = self
                            .node
                            .exec_plugin_from_node_netns("ADD", pod, &confs[i], None);
                        let ms = start.elapsed().as_secs_f64() * 1e3;
                        if let Err(e) = result {
                            panic!("capture-cni ADD failed: {e}");
                        }
                        done.lock().expect("no worker panicked").push((i, ms));
                    }
                });
            }
        });
        let mut done = done.into_inner().expect("no worker panicked");
        done.sort_by_key(|(i, _)| *i);
        for (i, pod) in self.pods.iter().enumerate() {
            assert!(
                captured(&self.mode, pod),
                "capture-cni ADD succeeded but pod {i} is not captured in {} mode",
                self.mode
            );
            if let Err(e) = self.node.exec_plugin("DEL", pod, &confs[i], None) {
                panic!("capture-cni DEL of pod {i} failed: {e}");
            }
        }
        done.into_iter().map(|(_, ms)| ms).collect()
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for pod in &self.pods {
            let _ = self.node.del(pod);
        }
    }
}

/// ADDs `pods` pods per agent mode, on a node of their own each, `concurrent` at a time (each
/// figure of `concurrent`), `rounds` times: the modes and figures interleaved within a round,
/// their order rotating, so that the machine's noise falls on all of them alike.
pub fn measure(modes: &[String], pods: usize, concurrent: &[usize], rounds: usize) -> Vec<CniAdd> {
    let beds: Vec<Bed> = modes.iter().map(|m| Bed::new(m, pods)).collect();
    let mut runs: Vec<CniAdd> = concurrent
        .iter()
        .flat_map(|n| {
            modes.iter().map(|m| CniAdd {
                mode: m.clone(),
                pods,
                concurrent: (*n).max(1),
                rounds: Vec::with_capacity(rounds),
            })
        })
        .collect();
    let cells = runs.len();
    for round in 0..rounds.max(1) {
        eprintln!("bench: CNI ADD round {} of {}", round + 1, rounds.max(1));
        // The order rotates every round: what a burst leaves the kernel to finish (a rule
        // backend's netns work, freed links) falls on each cell in turn.
        for cell in (0..cells).map(|i| (i + round) % cells) {
            let run = &mut runs[cell];
            let bed = beds
                .iter()
                .find(|b| b.mode == run.mode)
                .expect("a bed per mode");
            run.rounds.push(bed.burst(run.concurrent));
        }
    }
    runs
}

/// Whether the pod's capture is in place: programs on its cgroup, or the Istio chains in its
/// netns (iptables' or nftables').
pub(crate) fn captured(mode: &str, pod: &Pod) -> bool {
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
        "| agent mode | ADDs at once | pods × rounds | p50 ms | p99 ms | max ms | p99 of each round, ms |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|");
    for c in runs {
        let (p50, p99, max) = c.summary();
        let (low, high) = c.p99_range();
        let _ = writeln!(
            o,
            "| {} | {} | {} × {} | {p50:.2} | {p99:.2} | {max:.2} | {low:.2} – {high:.2} |",
            c.mode,
            c.concurrent,
            c.pods,
            c.rounds.len()
        );
    }
    let _ = writeln!(o, "\nThe capture-cni step of a chained ADD, from the runtime's exec to the plugin's result: plugin start, the pod's cgroup found from its UID, the request to the agent and the agent's attach. Every pod of the burst is made and given its bridge interface first (the network plugin's ADD, not counted); then capture-cni runs for each, one after the other or several at once. The agent attaches one pod at a time (the node lock), so ADDs at once wait for each other: their latency is the queue's. capture-cni releases every pod again between rounds (untimed); the cells take turns within each round, in an order that rotates every round. p50, p99 and max are the medians of the rounds' own.\n");
}

impl CniAdd {
    /// p50, p99 and max, ms: each the median of the rounds' own.
    #[must_use]
    pub fn summary(&self) -> (f64, f64, f64) {
        let of_rounds = |stat: fn(&[f64]) -> f64| {
            median(self.rounds.iter().map(|r| stat(r)).collect::<Vec<_>>())
        };
        (
            of_rounds(|l| median(l.to_vec())),
            of_rounds(|l| percentile(l.to_vec(), 0.99)),
            of_rounds(|l| l.iter().copied().fold(0.0, f64::max)),
        )
    }

    /// The lowest and highest of the rounds' p99, ms.
    #[must_use]
    pub fn p99_range(&self) -> (f64, f64) {
        let p99s: Vec<f64> = self
            .rounds
            .iter()
            .map(|l| percentile(l.clone(), 0.99))
            .collect();
        (
            p99s.iter().copied().fold(f64::INFINITY, f64::min),
            p99s.iter().copied().fold(0.0, f64::max),
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
