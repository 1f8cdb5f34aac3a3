//! Chaos under churn: pods added and deleted through capture-cni while the agent is `SIGKILLed` at
//! random points, with traffic checked all along; then thousands of ADD/DEL cycles, counted for
//! leaks. The sizes come from the environment (the kernel matrix runs smaller ones under
//! emulation): `CAPTURE_CHAOS_PODS` (200), `CAPTURE_CHAOS_KILLS` (50), `CAPTURE_CHAOS_CYCLES` (3,000).

use std::{
    collections::BTreeMap,
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use capture_tests::{
    agent::Agent,
    cni::{directory_tree, CgroupDriver, Node, Pod, MESHED},
    guards::{run, ChildGuard},
    probe::{connect_with, Outcome},
    topology::{capture_bin, cgroup_programs, pinned_map_len, pod_pins_left, POD_MAPS},
    wait::wait_until,
};

/// The leak count takes the kernel's program, link and map totals: these tests run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn scale(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A small xorshift: the kill points need to vary, not to be unpredictable.
struct Jitter(u64);

impl Jitter {
    fn new() -> Self {
        Self(u64::from(std::process::id()) << 32 | 0x9E37_79B9)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Sets its flag when dropped: the churn's helper threads stop even when the churn panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The app's connection to the node's listener, as the pod's app makes it.
fn app_connects(pod: &Pod) -> Outcome {
    connect_with(pod.app_client(), GATEWAY_80)
}

/// The pods' gateway (the bridge's address), where the node's `remote` listener is.
const GATEWAY_80: &str = "10.88.0.1:80";

/// ADD until it succeeds (a failed ADD is cleaned up with a DEL, as runtimes do), and how many
/// attempts failed on the way.
fn add_until_done(node: &Node, pod: &mut Pod) -> usize {
    let mut failed = 0;
    wait_until(Duration::from_mins(2), "ADD to succeed", || {
        node.add(pod).map(drop).map_err(|e| {
            failed += 1;
            e.to_string()
        })
    });
    failed
}

fn del_until_done(node: &Node, pod: &Pod) {
    wait_until(Duration::from_mins(2), "DEL to succeed", || {
        node.del(pod).map_err(|e| e.to_string())
    });
}

/// Everything of capture's a pod could leave behind, counted node-wide.
#[derive(Debug, PartialEq, Eq)]
struct Footprint {
    map_entries: BTreeMap<&'static str, usize>,
    records: usize,
    pins: usize,
    programs: usize,
    links: usize,
    maps: usize,
}

fn bpftool_count(object: &str) -> usize {
    let out = run(Command::new("bpftool").args(["-j", object, "show"]));
    serde_json::from_str::<serde_json::Value>(out.trim())
        .ok()
        .and_then(|v| v.as_array().map(Vec::len))
        .unwrap_or(0)
}

fn footprint(node: &Node) -> Footprint {
    let records =
        std::fs::read_dir(node.dirs.state.join("pods")).map_or(0, |d| d.flatten().count());
    let pins = directory_tree(&node.dirs.bpffs)
        .iter()
        .map(|d| std::fs::read_dir(d).map_or(0, |e| e.flatten().count()))
        .sum();
    Footprint {
        map_entries: POD_MAPS
            .iter()
            .map(|m| (*m, pinned_map_len(&node.dirs.bpffs, m)))
            .collect(),
        records,
        pins,
        programs: bpftool_count("prog"),
        links: bpftool_count("link"),
        maps: bpftool_count("map"),
    }
}

fn assert_no_pod_left(node: &Node, pods: &[Pod]) {
    let left = footprint(node);
    for (map, n) in &left.map_entries {
        assert_eq!(*n, 0, "{map} keeps {n} entries of deleted pods: {left:?}");
    }
    assert_eq!(left.records, 0, "records of deleted pods: {left:?}");
    assert!(
        !pod_pins_left(&node.dirs.bpffs),
        "link pins of deleted pods stay"
    );
    for pod in pods {
        assert!(
            cgroup_programs(&pod.cgroup).is_empty(),
            "programs left on {}",
            pod.cgroup.display()
        );
    }
}

#[test]
fn churn_with_the_agent_killed_at_random_never_bypasses_and_leaves_nothing() {
    let _serial = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let pod_count = scale("CAPTURE_CHAOS_PODS", 200);
    let kills_wanted = scale("CAPTURE_CHAOS_KILLS", 50);
    let node = Node::new();
    let _remote = node.start_remote();
    let agent = Mutex::new(node.start_agent("ebpf"));
    let kills = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let bypassed = AtomicUsize::new(0);
    let checked = AtomicUsize::new(0);

    // Pods that stay captured the whole time, checked continuously while the agent dies and
    // comes back: their programs are pinned, so nothing of theirs depends on the agent.
    let mut residents: Vec<Pod> = (0..4)
        .map(|i| node.pod(&format!("resident-{i}"), CgroupDriver::Cgroupfs, MESHED))
        .collect();
    let _resident_servers: Vec<Vec<ChildGuard>> = residents
        .iter_mut()
        .map(|pod| {
            add_until_done(&node, pod);
            pod.start_servers()
        })
        .collect();

    let mut interrupted = 0;
    let mut churned = 0;
    std::thread::scope(|s| {
        // However the churn ends, a panic included, the helper threads stop with it.
        let _stop = StopOnDrop(&done);
        s.spawn(|| {
            let mut jitter = Jitter::new();
            let mut restart = Duration::ZERO;
            while !done.load(Ordering::SeqCst) && kills.load(Ordering::SeqCst) < kills_wanted {
                // Up at least as long as it took to come back: under emulation a restart takes
                // seconds, and an agent killed sooner would never serve anyone.
                std::thread::sleep(restart + Duration::from_millis(20 + jitter.below(300)));
                let mut a = agent.lock().expect("agent");
                a.kill_hard();
                kills.fetch_add(1, Ordering::SeqCst);
                // Down a while, as a crash-looping agent would be.
                std::thread::sleep(Duration::from_millis(jitter.below(200)));
                let started = Instant::now();
                *a = node.start_agent("ebpf");
                restart = started.elapsed();
            }
        });
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) {
                for pod in &residents {
                    let got = app_connects(pod);
                    checked.fetch_add(1, Ordering::SeqCst);
                    if got.server().as_deref() != Some("outbound") {
                        bypassed.fetch_add(1, Ordering::SeqCst);
                        eprintln!("resident {}: {:?}", pod.name, got.0);
                    }
                }
            }
        });
        let mut round = 0;
        while round == 0 || kills.load(Ordering::SeqCst) < kills_wanted {
            for i in 0..pod_count {
                let mut pod = node.pod(
                    &format!("churn-{round}-{i}"),
                    CgroupDriver::Cgroupfs,
                    MESHED,
                );
                let _servers = pod.start_servers();
                interrupted += add_until_done(&node, &mut pod);
                let got = app_connects(&pod);
                checked.fetch_add(1, Ordering::SeqCst);
                if got.server().as_deref() != Some("outbound") {
                    bypassed.fetch_add(1, Ordering::SeqCst);
                    eprintln!("pod {} after its ADD: {:?}", pod.name, got.0);
                }
                del_until_done(&node, &pod);
                churned += 1;
                if round > 0 && kills.load(Ordering::SeqCst) >= kills_wanted {
                    break;
                }
            }
            round += 1;
        }
        done.store(true, Ordering::SeqCst);
    });
    eprintln!(
        "chaos: {churned} pods added and deleted, {} agent kills, {interrupted} interrupted ADDs retried, {} connections checked",
        kills.load(Ordering::SeqCst),
        checked.load(Ordering::SeqCst)
    );
    assert_eq!(
        bypassed.load(Ordering::SeqCst),
        0,
        "connections from captured pods bypassed the proxy"
    );
    assert!(kills.load(Ordering::SeqCst) >= kills_wanted);
    for pod in &residents {
        del_until_done(&node, pod);
    }
    assert_no_pod_left(&node, &residents);
}

/// The agent's open files (its threads are no measure: the runtime's blocking pool grows and
/// shrinks with the load).
fn open_files(agent: &Agent) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", agent.pid())).map_or(0, |d| d.flatten().count())
}

/// The agent back to `baseline` open files: a file leaked per cycle shows at the next check,
/// where the process's file limit would take a thousand cycles to show it. A moment is allowed
/// for the agent to close the connection of the DEL that just ended.
fn assert_open_files_back_to(agent: &Agent, baseline: usize, after: &str) {
    wait_until(
        Duration::from_secs(5),
        &format!("the agent's {baseline} open files after {after}"),
        || match open_files(agent) {
            n if n == baseline => Ok(()),
            n => Err(format!("{n} open")),
        },
    );
}

/// An agent that dies in every ADD after the pod's map entries and before its links and record.
fn start_agent_dying_after_maps(node: &Node) -> Agent {
    let mut cmd = Command::new(capture_bin());
    cmd.env("CAPTURE_DIE_AT", "after-maps");
    node.start_agent_as(cmd, "ebpf")
}

fn inbound_entries(node: &Node) -> usize {
    pinned_map_len(&node.dirs.bpffs, "INBOUND_PODS")
}

#[test]
fn an_add_that_died_half_way_leaves_nothing_once_deleted_or_retried() {
    let _serial = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let node = Node::new();
    let mut pod = node.pod("halfway", CgroupDriver::Cgroupfs, MESHED);

    // Died half-way, then deleted while no agent runs: `capture detach` finds the pod's ebpf
    // state by its netns cookie, though no record names it.
    let dying = start_agent_dying_after_maps(&node);
    assert!(node.add(&mut pod).is_err(), "the agent died in the ADD");
    drop(dying);
    assert_eq!(
        inbound_entries(&node),
        1,
        "the half-way ADD wrote the pod's address"
    );
    let out = Command::new(capture_bin())
        .arg("--bpffs")
        .arg(&node.dirs.bpffs)
        .arg("--state-dir")
        .arg(&node.dirs.state)
        .args(["detach", "--netns"])
        .arg(pod.netns.path())
        .output()
        .expect("capture detach");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not captured"),
        "{out:?}"
    );
    assert_eq!(
        inbound_entries(&node),
        0,
        "detach released the half-way ADD"
    );
    assert!(
        !pod_pins_left(&node.dirs.bpffs),
        "detach removed its links directory"
    );

    // Died half-way again; the runtime's DEL released the pod's address and its retry gets
    // another one. Nothing of the first address may stay once the pod is deleted.
    let dying = start_agent_dying_after_maps(&node);
    assert!(node.add(&mut pod).is_err(), "the agent died in the ADD");
    drop(dying);
    assert_eq!(inbound_entries(&node), 1);
    let _agent = node.start_agent("ebpf");
    add_until_done(&node, &mut pod);
    let _servers = pod.start_servers();
    assert_eq!(app_connects(&pod).server().as_deref(), Some("outbound"));
    assert_eq!(
        inbound_entries(&node),
        1,
        "only the address the pod has now"
    );
    del_until_done(&node, &pod);
    assert_no_pod_left(&node, &[pod]);
}

#[test]
fn add_del_cycles_leak_nothing() {
    let _serial = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cycles = scale("CAPTURE_CHAOS_CYCLES", 3_000);
    let node = Node::new();
    let agent = node.start_agent("ebpf");
    // Lists in every node-wide map, so that a leak anywhere shows.
    let mut pod = node.pod(
        "cycling",
        CgroupDriver::Cgroupfs,
        &[
            (MESHED[0].0, MESHED[0].1),
            ("traffic.sidecar.istio.io/excludeOutboundPorts", "9000,9001"),
            (
                "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                "10.9.0.0/16,fd00:9::/64",
            ),
            ("traffic.sidecar.istio.io/includeInboundPorts", "8080,9090"),
        ],
    );
    // Another pod captured the whole time, as on any node: the kernel then keeps its cgroup-BPF
    // hooks switched on, instead of patching its code on every CPU at each cycle's first attach
    // and last detach (a tenth of the cycles' time).
    let mut neighbour = node.pod("neighbour", CgroupDriver::Cgroupfs, MESHED);
    add_until_done(&node, &mut neighbour);
    // The network plugin's part once; capture-cni's ADD and DEL in every cycle.
    add_until_done(&node, &mut pod);
    let _servers = pod.start_servers();
    let list = node.conflist();
    let conf = node.plugin_conf(&list, 1, &pod, pod.result.as_ref());
    let capture_del = |pod: &Pod| node.exec_plugin("DEL", pod, &conf, None);
    capture_del(&pod).expect("DEL");
    let baseline = footprint(&node);
    let files = open_files(&agent);
    let started = Instant::now();
    for cycle in 0..cycles {
        node.exec_plugin("ADD", &pod, &conf, None)
            .unwrap_or_else(|e| panic!("cycle {cycle}: ADD: {e}"));
        if cycle % 500 == 0 {
            // Captured while added.
            let got = app_connects(&pod);
            assert_eq!(
                got.server().as_deref(),
                Some("outbound"),
                "cycle {cycle}: {:?}",
                got.0
            );
        }
        capture_del(&pod).unwrap_or_else(|e| panic!("cycle {cycle}: DEL: {e}"));
        if cycle % 500 == 499 {
            assert_eq!(footprint(&node), baseline, "after {} cycles", cycle + 1);
            assert_open_files_back_to(&agent, files, &format!("{} cycles", cycle + 1));
        }
    }
    eprintln!(
        "{cycles} ADD/DEL cycles in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(footprint(&node), baseline, "after {cycles} cycles");
    assert_open_files_back_to(&agent, files, &format!("{cycles} cycles"));
    del_until_done(&node, &neighbour);
    assert_no_pod_left(&node, &[pod, neighbour]);
}

/// A truncated record costs its own pod only: the agent starts, every other pod keeps working
/// and can be added and deleted, status names the damaged record, and the pod's DEL releases
/// what it has in the kernel and the record.
#[test]
fn a_damaged_record_costs_only_its_own_pod() {
    let _serial = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let node = Node::new();
    let _remote = node.start_remote();
    let mut agent = node.start_agent("ebpf");
    let mut pods: Vec<Pod> = ["healthy-a", "damaged", "healthy-b"]
        .iter()
        .map(|name| node.pod(name, CgroupDriver::Cgroupfs, MESHED))
        .collect();
    let _servers: Vec<Vec<ChildGuard>> = pods
        .iter_mut()
        .map(|pod| {
            add_until_done(&node, pod);
            pod.start_servers()
        })
        .collect();
    let cookie = capture_user::netns::Netns::open(&pods[1].netns.path())
        .and_then(|n| n.cookie(capture_user::ebpf::netns_cookie::netns_cookie))
        .expect("the pod's netns cookie");
    let record = node.dirs.state.join("pods").join(format!("{cookie}.json"));
    agent.kill_hard();
    let full = std::fs::read(&record).expect("the pod's record");
    std::fs::write(&record, &full[..full.len() / 2]).expect("truncating the record");

    let agent = node.start_agent("ebpf");
    let metrics = agent.checked_metrics();
    assert!(
        metrics.contains("capture_damaged_records 1"),
        "the agent's metrics count the damaged record"
    );
    for pod in [&pods[0], &pods[2]] {
        let got = app_connects(pod);
        assert_eq!(
            got.server().as_deref(),
            Some("outbound"),
            "{}: {:?}",
            pod.name,
            got.0
        );
    }
    let status = |node: &Node| -> serde_json::Value {
        let out = run(Command::new(capture_bin())
            .arg("--bpffs")
            .arg(&node.dirs.bpffs)
            .arg("--state-dir")
            .arg(&node.dirs.state)
            .args(["status", "--json"]));
        serde_json::from_str(&out).expect("status JSON")
    };
    let before = status(&node);
    assert_eq!(
        before["damaged_records"][0]["path"],
        serde_json::json!(record),
        "status names the damaged record: {before}"
    );
    assert_eq!(before["pods"].as_array().map_or(0, Vec::len), 2, "{before}");

    // The node goes on: another pod comes and goes, a healthy one goes.
    let mut late = node.pod("late", CgroupDriver::Cgroupfs, MESHED);
    let _late_servers = late.start_servers();
    add_until_done(&node, &mut late);
    let got = app_connects(&late);
    assert_eq!(got.server().as_deref(), Some("outbound"), "{:?}", got.0);
    del_until_done(&node, &late);
    del_until_done(&node, &pods[0]);

    // The damaged pod's DEL releases it.
    del_until_done(&node, &pods[1]);
    let after = status(&node);
    assert_eq!(
        after["damaged_records"].as_array().map_or(0, Vec::len),
        0,
        "{after}"
    );
    assert!(!record.exists(), "the damaged record stays");
    assert_eq!(
        pinned_map_len(&node.dirs.bpffs, "POD_CONFIGS"),
        1,
        "only healthy-b is left"
    );
    assert!(
        cgroup_programs(&pods[1].cgroup).is_empty(),
        "the damaged pod's programs stay"
    );
    del_until_done(&node, &pods[2]);
    assert_no_pod_left(&node, &pods);
}
