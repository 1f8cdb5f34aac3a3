//! docs/results/node-scale.md: one node with a thousand captured pods, as the agent and
//! capture-cni capture them. Every pod has its netns, cgroup and bridge interface (one /21 on one
//! bridge: a Linux bridge takes 1,024 ports), one in four at its quotas of the node-wide maps;
//! capture-cni ADDs them one after the other. Measured: each ADD (is the thousandth as fast as
//! the first?), the kernel's and the agent's memory per pod, one reconcile pass over the node's
//! sandboxes, and the agent's upgrade: the next build (new map layouts) takes the whole node
//! over while twenty pods exchange connections, none of which may fail.

use std::{
    fmt::Write as _,
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use capture_tests::{
    cni::{Agent, CgroupDriver, Node, Pod, MESHED},
    guards::ChildGuard,
    probe::{try_connect_opts, ConnectOpts},
};
use serde::{Deserialize, Serialize};

use crate::stats::{median, percentile};

/// The node's pod subnet: room for the thousand pods, and a bridge port each.
const SUBNET: &str = "10.80.0.0/21";
/// One pod in this many is at its quotas.
const AT_QUOTA_EVERY: usize = 4;
/// The pods that carry traffic through the takeover.
const SAMPLE: usize = 20;
/// The upgrade's target.
const TAKEOVER_TARGET: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeScale {
    pub pods: usize,
    pub at_quota: usize,
    pub kernel: String,
    /// capture-cni ADD of each pod, in order, ms.
    pub add_ms: Vec<f64>,
    /// Pods whose cgroup carries the programs after the ADDs, and after the takeovers.
    pub captured: usize,
    pub captured_after_takeover: usize,
    /// Growth of unreclaimable kernel memory over the ADDs, per pod, KiB.
    pub kernel_kib_per_pod: f64,
    /// The agent's resident memory before the ADDs and after them, KiB.
    pub agent_rss_kib: (u64, u64),
    /// CPU of one reconcile pass over this many sandboxes (synthetic runtime answer), each
    /// round's, ms.
    pub reconcile_cpu_ms: Vec<f64>,
    /// Each takeover (upgrade to the next build, rollback, upgrade again): from the old
    /// agent's SIGTERM to the next one's readiness, and from its start, ms.
    pub takeovers_ms: Vec<(f64, f64)>,
    /// Exchanges through the sampled pods during the takeovers (from a second before the first
    /// to a second after the last), and those that failed, with why.
    pub exchanges: usize,
    pub failures: Vec<String>,
}

impl NodeScale {
    /// p50 of the first and of the last hundred ADDs, ms.
    #[must_use]
    pub fn first_and_last_hundred(&self) -> (f64, f64) {
        let n = self.add_ms.len().min(100);
        (
            median(self.add_ms[..n].to_vec()),
            median(self.add_ms[self.add_ms.len() - n..].to_vec()),
        )
    }

    /// The median takeover, SIGTERM to ready and spawn to ready, ms.
    #[must_use]
    pub fn takeover_ms(&self) -> (f64, f64) {
        (
            median(self.takeovers_ms.iter().map(|t| t.0).collect()),
            median(self.takeovers_ms.iter().map(|t| t.1).collect()),
        )
    }

    /// The agent's resident memory growth per pod, KiB.
    #[must_use]
    pub fn agent_kib_per_pod(&self) -> f64 {
        let (before, after) = self.agent_rss_kib;
        after.saturating_sub(before) as f64 / self.pods.max(1) as f64
    }
}

fn at_quota_annotations() -> Vec<(String, String)> {
    // Within a few entries of the quotas (1,024 ports, 256 ranges): a pod holds a few of each
    // already (its own ports, the cluster's ranges), which sizing.rs in the node tests counts.
    let ports: Vec<String> = (1..=1000).map(|p| p.to_string()).collect();
    let ranges: Vec<String> = (0..240)
        .map(|i| format!("10.{}.{}.0/24", 100 + i / 256, i % 256))
        .collect();
    vec![
        (
            "traffic.sidecar.istio.io/excludeOutboundPorts".into(),
            ports.join(","),
        ),
        (
            "traffic.sidecar.istio.io/excludeOutboundIPRanges".into(),
            ranges.join(","),
        ),
    ]
}

fn agent_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Makes `count` pods on `node` with their bridge interfaces (untimed).
fn make_pods(node: &Node, count: usize) -> Vec<Pod> {
    let quota = at_quota_annotations();
    (0..count)
        .map(|i| {
            if i % 100 == 0 {
                eprintln!("bench: node-scale: making pod {i} of {count}");
            }
            let mut annotations: Vec<(&str, &str)> = MESHED.to_vec();
            if i % AT_QUOTA_EVERY == AT_QUOTA_EVERY - 1 {
                annotations.extend(quota.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            }
            let mut pod = node.pod(&format!("scale-{i}"), CgroupDriver::Cgroupfs, &annotations);
            node.add_network(&mut pod)
                .unwrap_or_else(|e| panic!("bridge ADD of pod {i} failed: {e}"));
            pod
        })
        .collect()
}

/// capture-cni's ADD of every pod, one after the other: each one's time, ms.
fn add_all(node: &Node, pods: &mut [Pod]) -> Vec<f64> {
    let list = node.conflist();
    let mut latencies = Vec::with_capacity(pods.len());
    std::thread::scope(|s| {
        s.spawn(|| {
            node.enter_netns();
            for (i, pod) in pods.iter_mut().enumerate() {
                let conf = node.plugin_conf(&list, 1, pod, pod.result.as_ref());
                let start = Instant::now();
                let result = node.exec_plugin_from_node_netns("ADD", pod, &conf, None);
                latencies.push(start.elapsed().as_secs_f64() * 1e3);
                pod.set_result(result.unwrap_or_else(|e| panic!("ADD of pod {i}: {e}")));
            }
        });
    });
    latencies
}

fn captured(pods: &[Pod]) -> usize {
    pods.iter()
        .filter(|p| crate::cni_add::captured("ebpf", p))
        .count()
}

/// One connection from `from`'s app to `to`'s app port: through `from`'s outbound capture and
/// `to`'s inbound capture, each proxy answering with the destination it was asked for.
fn exchange(from: &Pod, to: &Pod) -> Result<(), String> {
    let dest = format!("{}:8080", to.ip());
    let got = try_connect_opts(from.app_client(), &dest, &ConnectOpts::default())
        .map_err(|e| format!("{} to {dest}: {}", from.name, e.trim()))?;
    if got.server().as_deref() == Some("outbound") && got.orig().as_deref() == Some(&dest) {
        Ok(())
    } else {
        Err(format!("{} to {dest}: {:?}", from.name, got.0))
    }
}

/// The next build takes the node over, this one takes it back, and the next build again, while
/// the sampled pods exchange connections.
fn takeovers(
    node: &Node,
    agent: Agent,
    builds: &[&Path],
    sample: &[Pod],
    extra: &[&str],
) -> Takeovers {
    let exchanges = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for lane in 0..2 {
            let (exchanges, failures, stop) = (&exchanges, &failures, &stop);
            s.spawn(move || {
                let mut i = lane;
                while !stop.load(Ordering::Acquire) {
                    let (from, to) = (&sample[i % sample.len()], &sample[(i + 1) % sample.len()]);
                    match exchange(from, to) {
                        Ok(()) => {
                            exchanges.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failures.lock().expect("no lane panicked").push(e),
                    }
                    i += 2;
                }
            });
        }
        let mut agent = agent;
        let mut times = Vec::with_capacity(builds.len());
        for build in builds {
            std::thread::sleep(Duration::from_secs(1));
            let stopping = Instant::now();
            agent.stop();
            let spawned = Instant::now();
            agent = node.spawn_agent_of(build, "ebpf", extra);
            agent.wait_ready();
            times.push((
                stopping.elapsed().as_secs_f64() * 1e3,
                spawned.elapsed().as_secs_f64() * 1e3,
            ));
        }
        std::thread::sleep(Duration::from_secs(1));
        stop.store(true, Ordering::Release);
        Takeovers {
            agent,
            times,
            exchanges: exchanges.load(Ordering::Relaxed),
            failures: std::mem::take(&mut *failures.lock().expect("no lane panicked")),
        }
    })
}

/// What the takeovers gave: the last build's agent, their times, and the sampled traffic.
struct Takeovers {
    agent: Agent,
    times: Vec<(f64, f64)>,
    exchanges: usize,
    failures: Vec<String>,
}

/// The whole measurement, on a node of `pods` pods; `variant` is the next build's `capture`.
pub fn measure(pods: usize, variant: &Path) -> NodeScale {
    let node = Node::new();
    let mut list = node.conflist();
    list["plugins"][0]["ipam"]["ranges"] = serde_json::json!([[{"subnet": SUBNET}]]);
    node.use_conflist(list);
    let max_pods = pods.to_string();
    let extra = ["--max-pods", max_pods.as_str()];
    let agent = node.start_agent_with("ebpf", &extra);
    let mut made = make_pods(&node, pods);

    let (kernel_before, rss_before) = (crate::kernel_memory_kib(), agent_rss_kib(agent.pid()));
    eprintln!("bench: node-scale: capture-cni ADD of {pods} pods");
    let add_ms = add_all(&node, &mut made);
    let kernel_after = crate::kernel_memory_kib();
    let rss_after = agent_rss_kib(agent.pid());
    let captured_pods = captured(&made);

    let sample = &made[..SAMPLE.min(made.len())];
    let _servers: Vec<Vec<ChildGuard>> = sample.iter().map(Pod::start_servers).collect();
    eprintln!(
        "bench: node-scale: the next build takes the node over, this one takes it back, and again"
    );
    let this = capture_tests::topology::capture_bin();
    let builds = [variant, this.as_path(), variant];
    let taken = takeovers(&node, agent, &builds, sample, &extra);
    let captured_after_takeover = captured(&made);
    drop(taken.agent);

    eprintln!("bench: node-scale: reconcile passes over {pods} sandboxes");
    let reconcile = crate::reconcile_cost::measure(pods, 5);
    NodeScale {
        pods,
        at_quota: (0..pods)
            .filter(|i| i % AT_QUOTA_EVERY == AT_QUOTA_EVERY - 1)
            .count(),
        kernel: crate::kernel_release(),
        add_ms,
        captured: captured_pods,
        captured_after_takeover,
        kernel_kib_per_pod: kernel_after.saturating_sub(kernel_before) as f64 / pods.max(1) as f64,
        agent_rss_kib: (rss_before, rss_after),
        reconcile_cpu_ms: reconcile
            .passes
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect(),
        takeovers_ms: taken.times,
        exchanges: taken.exchanges,
        failures: taken.failures,
    }
}

/// The page.
#[must_use]
pub fn markdown(r: &NodeScale) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# A node of {} pods\n", r.pods);
    let _ = writeln!(
        o,
        "Produced by `cargo xtask bench --node-scale` on kernel {}: one node, the agent in ebpf mode with `--max-pods {}`, every pod made with its netns, cgroup and bridge interface first, then captured by capture-cni's ADD, one after the other. {} pods of {} carry annotations within a few entries of their quotas of the node-wide maps (1,000 excluded ports and 240 excluded ranges, of 1,024 and 256).\n",
        r.kernel, r.pods, r.at_quota, r.pods
    );
    let (first, last) = r.first_and_last_hundred();
    let _ = writeln!(o, "| figure | value |\n|---|---|");
    let _ = writeln!(o, "| pods captured | {} of {} |", r.captured, r.pods);
    let _ = writeln!(o, "| ADD p50, the first 100 pods | {first:.2} ms |");
    let _ = writeln!(o, "| ADD p50, the last 100 pods | {last:.2} ms |");
    let _ = writeln!(
        o,
        "| ADD p99, all pods | {:.2} ms |",
        percentile(r.add_ms.clone(), 0.99)
    );
    let _ = writeln!(
        o,
        "| kernel memory per pod (SUnreclaim + Percpu + VmallocUsed) | {:.1} KiB |",
        r.kernel_kib_per_pod
    );
    let _ = writeln!(
        o,
        "| agent resident memory | {} KiB before the ADDs, {} KiB after: {:.1} KiB per pod |",
        r.agent_rss_kib.0,
        r.agent_rss_kib.1,
        r.agent_kib_per_pod()
    );
    let _ = writeln!(
        o,
        "| one reconcile pass over {} sandboxes, CPU (median of {}) | {:.1} ms |",
        r.pods,
        r.reconcile_cpu_ms.len(),
        median(r.reconcile_cpu_ms.clone())
    );
    let (took, from_spawn) = r.takeover_ms();
    let each: Vec<String> = r
        .takeovers_ms
        .iter()
        .map(|t| format!("{:.0}", t.0))
        .collect();
    let _ = writeln!(
        o,
        "| takeover of the node: SIGTERM to ready (spawn to ready), median of {} | {took:.0} ms ({from_spawn:.0} ms); each: {} ms |",
        r.takeovers_ms.len(),
        each.join(", ")
    );
    let _ = writeln!(
        o,
        "| pods captured after the takeovers | {} of {} |",
        r.captured_after_takeover, r.pods
    );
    let _ = writeln!(
        o,
        "| connections through {SAMPLE} pods during the takeovers, failed | {}, {} |",
        r.exchanges,
        r.failures.len()
    );
    for f in r.failures.iter().take(5) {
        let _ = writeln!(o, "\n- failed: {f}");
    }
    let _ = writeln!(o, "\nEach takeover is a rolling update's: the old agent stops (SIGTERM), the other build's starts, adopts the pins, carries the node-wide maps into its own layouts, writes every pod's entries and moves every pod's links to its programs in place; its `/readyz` answers once all of it is done. The other build is this tree's with the next map layouts (`capture-user/layout-next`), the heaviest upgrade: maps are rebuilt or migrated both ways. Three takeovers: the upgrade, the rollback, the upgrade again. Connections go from one sampled pod's app to the next one's app port, through both pods' proxies, from a second before the first takeover to a second after the last.\n");
    let _ = writeln!(o, "Reconcile CPU is `capture-bench reconcile-cost`'s pass (docs/results/reconcile-cost.md) at this node's size: the runtime's answer decoded, the records read, the selection rules and the node view.\n");
    o
}

/// The targets: every pod captured before and after, ADD time flat, the takeover in 2 s with
/// no failed connection.
#[must_use]
pub fn targets(r: &NodeScale) -> Vec<(String, bool)> {
    let (first, last) = r.first_and_last_hundred();
    vec![
        (
            format!("every pod captured: {} of {}", r.captured, r.pods),
            r.captured == r.pods,
        ),
        (
            format!("ADD time flat: the last hundred's p50 {last:.2} ms ≤ 1.5 × the first hundred's {first:.2} ms"),
            last <= first * 1.5,
        ),
        (
            format!(
                "takeover of the node in ≤ {} s: {:.0} ms (the median)",
                TAKEOVER_TARGET.as_secs(),
                r.takeover_ms().0
            ),
            r.takeover_ms().0 <= TAKEOVER_TARGET.as_secs_f64() * 1e3,
        ),
        (
            format!(
                "no failed connection during the takeovers: {} of {}",
                r.failures.len(),
                r.exchanges + r.failures.len()
            ),
            r.failures.is_empty() && r.exchanges > 0,
        ),
        (
            format!(
                "every pod captured after the takeovers: {} of {}",
                r.captured_after_takeover, r.pods
            ),
            r.captured_after_takeover == r.pods,
        ),
    ]
}

/// Runs it and writes node-scale.{json,md} into `out`.
pub fn run(pods: usize, variant: &Path, out: &Path) -> NodeScale {
    let r = measure(pods, variant);
    std::fs::create_dir_all(out).expect("the output directory");
    std::fs::write(
        out.join("node-scale.json"),
        serde_json::to_string_pretty(&r).expect("serialisable"),
    )
    .expect("writing node-scale.json");
    let mut md = markdown(&r);
    let _ = writeln!(md, "## Targets\n");
    for (what, ok) in targets(&r) {
        let _ = writeln!(md, "- [{}] {what}", if ok { "x" } else { " " });
    }
    std::fs::write(out.join("node-scale.md"), md).expect("writing node-scale.md");
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scale() -> NodeScale {
        NodeScale {
            pods: 200,
            at_quota: 50,
            kernel: "test".into(),
            // The first hundred at 2 ms, the last at 2.5 ms.
            add_ms: (0..200).map(|i| if i < 100 { 2.0 } else { 2.5 }).collect(),
            captured: 200,
            captured_after_takeover: 200,
            kernel_kib_per_pod: 4.0,
            agent_rss_kib: (30_000, 30_400),
            reconcile_cpu_ms: vec![1.0, 2.0, 3.0],
            takeovers_ms: vec![(2100.0, 2000.0), (1500.0, 1400.0), (1900.0, 1800.0)],
            exchanges: 100,
            failures: Vec::new(),
        }
    }

    #[test]
    fn figures_and_targets() {
        let r = scale();
        assert_eq!(r.first_and_last_hundred(), (2.0, 2.5));
        assert_eq!(r.takeover_ms(), (1900.0, 1800.0));
        assert!((r.agent_kib_per_pod() - 2.0).abs() < 1e-9);
        assert!(targets(&r).iter().all(|(_, ok)| *ok), "{:?}", targets(&r));
        let md = markdown(&r);
        assert!(
            md.contains("| 1900 ms (1800 ms); each: 2100, 1500, 1900 ms |"),
            "{md}"
        );

        let failed = NodeScale {
            failures: vec!["scale-3 to 10.80.0.5:8080: refused".into()],
            takeovers_ms: vec![(2500.0, 2400.0)],
            captured_after_takeover: 199,
            ..scale()
        };
        let missed: Vec<String> = targets(&failed)
            .into_iter()
            .filter(|(_, ok)| !ok)
            .map(|(what, _)| what)
            .collect();
        assert_eq!(missed.len(), 3, "{missed:?}");
        assert!(markdown(&failed).contains("- failed: scale-3 to 10.80.0.5:8080: refused"));
    }
}
