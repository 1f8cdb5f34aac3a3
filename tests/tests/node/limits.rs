//! Limits: how many concurrent connections a captured pod holds under each backend, whether
//! every original destination reaches the proxy under load, and each pod's share of the node's
//! maps.

use capture_tests::{
    cases::Backend,
    flood::window_for,
    guards::{run, ChildGuard},
    probe::{probe_in, Who},
    topology::{cgroup_programs, delete_pinned_map_entries, pinned_map_len, Topology},
    wait::{poll_until, wait_until},
};
use std::{collections::BTreeMap, process::Command, time::Duration};

use serde_json::Value;

/// The app's destinations: all captured, so none leaves the pod (the proxy holds them all).
fn destinations(n: u8) -> Vec<String> {
    (1..=n).map(|i| format!("10.0.0.{i}:80")).collect()
}

/// Processes each side spreads the connections over: this machine's hard open-file limit may be
/// as low as 20,000 (no `CAP_SYS_RESOURCE`), and a connection has a descriptor on each side.
const APP_PROCESSES: usize = 8;
const PROXY_WORKERS: usize = 8;

/// What a pod's app processes and its proxy's workers saw of connections opened at once.
#[derive(Default)]
struct Concurrency {
    established: u64,
    accepted: u64,
    app_errors: BTreeMap<String, u64>,
    orig: BTreeMap<String, u64>,
    orig_errors: BTreeMap<String, u64>,
    /// The longest any app process waited for one of its connects to be established.
    slowest_connect_ms: u64,
}

fn add_counts(into: &mut BTreeMap<String, u64>, from: &Value) {
    for (k, v) in from.as_object().into_iter().flatten() {
        *into.entry(k.clone()).or_default() += v.as_u64().unwrap_or(0);
    }
}

fn concurrent_connections(backend: Backend, count: usize, dests: &[String]) -> Concurrency {
    let topo = Topology::new();
    topo.attach(&["--mode", backend.mode()]);
    let netns = topo.pod.netns.path();
    let cgroup = topo.pod.cgroup.path.clone();
    let mut sinks: Vec<ChildGuard> = (0..PROXY_WORKERS)
        .map(|_| {
            ChildGuard::spawn_ready(probe_in(&netns, Some(&cgroup), Some(&Who::proxy())).args([
                "sink",
                "--reuseport",
                "--listen",
                "0.0.0.0:15001",
            ]))
        })
        .collect();
    let mut floods: Vec<ChildGuard> = (0..APP_PROCESSES)
        .map(|i| {
            let share = count / APP_PROCESSES + usize::from(i < count % APP_PROCESSES);
            let mut cmd = probe_in(&netns, Some(&cgroup), Some(&Who::app()));
            cmd.args(["flood", "--count", &share.to_string()]);
            cmd.args(["--window", &window_for(APP_PROCESSES).to_string()]);
            for d in dests {
                cmd.args(["--to", d]);
            }
            ChildGuard::spawn(&mut cmd)
        })
        .collect();
    let mut got = Concurrency::default();
    for flood in &mut floods {
        let report: Value = serde_json::from_str(flood.read_line().trim())
            .unwrap_or_else(|e| panic!("{backend:?}: a flood's report: {e}"));
        got.established += report["established"].as_u64().unwrap_or(0);
        got.slowest_connect_ms = got
            .slowest_connect_ms
            .max(report["slowest_connect_ms"].as_u64().unwrap_or(0));
        add_counts(&mut got.app_errors, &report["errors"]);
    }
    // The workers may still be accepting the last of them.
    // What arrived by then is judged by the caller.
    let established = got.established;
    let reports = poll_until(Duration::from_mins(1), || {
        let reports: Vec<Value> = sinks
            .iter_mut()
            .map(|s| serde_json::from_str(s.ask("report").trim()).expect("sink report"))
            .collect();
        let accepted: u64 = reports.iter().filter_map(|r| r["accepted"].as_u64()).sum();
        if accepted >= established {
            Ok(reports)
        } else {
            Err(reports)
        }
    })
    .unwrap_or_else(|last| last);
    got.accepted = reports.iter().filter_map(|r| r["accepted"].as_u64()).sum();
    for r in &reports {
        add_counts(&mut got.orig, &r["orig"]);
        add_counts(&mut got.orig_errors, &r["orig_errors"]);
    }
    eprintln!(
        "{backend:?}: {} of {count} established (app errors {:?}; the slowest connect took {} ms), {} accepted, original destinations {:?}, errors {:?}",
        got.established, got.app_errors, got.slowest_connect_ms, got.accepted, got.orig, got.orig_errors
    );
    got
}

/// One pod, 30,000 connections at once over eight destinations: ebpf holds at least as many
/// as iptables, and the proxy learns the right original destination of every one. The kernel
/// matrix sets `CAPTURE_CONCURRENT_CONNECTIONS` lower: emulated CPUs take minutes for 60,000
/// sockets, and the spread that lifts ebpf past one port range is checked on every kernel by
/// the next test.
#[test]
fn thirty_thousand_concurrent_connections() {
    let count: usize = std::env::var("CAPTURE_CONCURRENT_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30_000);
    let dests = destinations(8);
    let mut results = Vec::new();
    for backend in Backend::ALL {
        let got = concurrent_connections(backend, count, &dests);
        // More may be accepted: a connect the app gave up on (conntrack full under iptables, on
        // a small machine) can still complete on the proxy's side.
        assert!(
            got.accepted >= got.established,
            "{backend:?}: {} established, {} reached the proxy",
            got.established,
            got.accepted
        );
        assert!(
            got.orig_errors.is_empty(),
            "{backend:?}: SO_ORIGINAL_DST failed for some: {:?}",
            got.orig_errors
        );
        for (addr, n) in &got.orig {
            assert!(
                dests.contains(addr),
                "{backend:?}: {n} connection(s) with original destination {addr}, not one the app used"
            );
        }
        results.push((backend, got));
    }
    let held = |b: Backend| {
        results
            .iter()
            .find(|(x, _)| *x == b)
            .map_or(0, |r| r.1.established)
    };
    assert!(
        held(Backend::Ebpf) >= held(Backend::Iptables),
        "ebpf held {} concurrent connections, iptables {}",
        held(Backend::Ebpf),
        held(Backend::Iptables)
    );
    assert_eq!(
        held(Backend::Ebpf),
        count as u64,
        "ebpf holds every connection"
    );
}

/// The spread goes only where the proxy's listener takes it: a proxy bound to 127.0.0.1 alone
/// gets every connection at 127.0.0.1, a wildcard one at the destination's own loopback address
/// (the stateless redirect's where the kernel serves it, else the stateful path's).
#[test]
fn connections_spread_only_to_addresses_the_proxy_listens_on() {
    let spread = if capture_tests::kernel::features().stateless_redirect {
        "127.2."
    } else {
        "127.1."
    };
    for (listen, want_local_prefix) in
        [("127.0.0.1:15001", "127.0.0.1:"), ("0.0.0.0:15001", spread)]
    {
        let topo = Topology::new();
        topo.attach(&["--mode", "ebpf"]);
        assert_eq!(
            topo.node_features(),
            serde_json::to_value(capture_tests::kernel::features()).expect("features as JSON"),
            "the node's programs are adapted to everything the kernel has"
        );
        let _proxy = topo.spawn_proxy_serving(&["--tcp", &format!("outbound={listen}")]);
        for to in ["10.0.0.5:80", "10.0.0.6:443"] {
            let got = topo.tcp(&Who::app(), to);
            got.assert_served_by("outbound", listen);
            assert_eq!(got.orig().as_deref(), Some(to), "proxy on {listen}");
            let local = got.server_local().unwrap_or_default();
            assert!(
                local.starts_with(want_local_prefix),
                "proxy on {listen}: accepted on {local}, want {want_local_prefix}…"
            );
        }
    }
}

/// A pod over its share of a node-wide map is refused before anything of it is written; the pod
/// already on the node keeps its entries and its capture, and doctor shows the node's limits.
#[test]
fn a_pod_over_its_quota_is_refused_and_leaves_the_node_as_it_was() {
    let mut first = Topology::new();
    first.attach(&[]);
    first.start_all();
    let dirs = first.dirs.shared();
    let second = Topology::numbered(dirs, 1);
    let count = |map: &str| pinned_map_len(&first.dirs.bpffs, map);
    let before = [
        count("CIDR_LISTS"),
        count("PORT_LISTS"),
        count("POD_CONFIGS"),
    ];

    // 300 distinct /24s, over the 256 a pod may have.
    let ranges: Vec<String> = (0..300u32)
        .map(|i| format!("10.{}.{}.0/24", 100 + i / 256, i % 256))
        .collect();
    let annotation = format!(
        "traffic.sidecar.istio.io/excludeOutboundIPRanges={}",
        ranges.join(",")
    );
    let out = second.try_attach(&["--annotation", &annotation]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "attach over the quota succeeded");
    assert!(
        err.contains("300 CIDR-list entries")
            && err.contains("at most 256")
            && err.contains("excludeOutboundIPRanges"),
        "the error names the count, the quota and the annotation: {err}"
    );
    assert_eq!(
        [
            count("CIDR_LISTS"),
            count("PORT_LISTS"),
            count("POD_CONFIGS")
        ],
        before,
        "the refused pod left entries behind"
    );
    assert!(
        cgroup_programs(&second.pod.cgroup.path).is_empty(),
        "the refused pod has programs attached"
    );
    first
        .tcp(&Who::app(), "10.0.0.5:80")
        .assert_served_by("outbound", "the first pod after the refusal");

    // At the quota it is accepted.
    let at_quota = format!(
        "traffic.sidecar.istio.io/excludeOutboundIPRanges={}",
        ranges[..256].join(",")
    );
    let out = second.try_attach(&["--annotation", &at_quota]);
    assert!(
        out.status.success(),
        "attach at the quota: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let doctor = first.capture(&["doctor", "--json"]);
    let report: Value = serde_json::from_slice(&doctor.stdout).expect("doctor JSON");
    let cidrs = report["limits"]
        .as_array()
        .and_then(|l| l.iter().find(|r| r["map"] == "CIDR_LISTS"))
        .unwrap_or_else(|| panic!("doctor lists CIDR_LISTS: {report}"));
    assert_eq!(cidrs["per_pod"], 256);
    let pods = report["limits"]
        .as_array()
        .and_then(|l| l.iter().find(|r| r["map"] == "POD_CONFIGS"))
        .unwrap_or_else(|| panic!("doctor lists POD_CONFIGS: {report}"));
    assert_eq!(
        cidrs["capacity"].as_u64(),
        pods["capacity"].as_u64().map(|n| n * 256),
        "room for every pod at its quota: {report}"
    );
    assert_eq!(cidrs["in_use"].as_u64(), Some(before[0] as u64 + 256));
    let text = String::from_utf8_lossy(&first.capture(&["doctor"]).stdout).to_string();
    assert!(text.contains("node limits"), "{text}");
}

/// A pod whose proxy completes connections only when data arrives (`TCP_DEFER_ACCEPT`): the app's
/// side is established, the proxy's is not, and the hand-off waits in the map meanwhile.
struct WaitingHandshakes {
    topo: Topology,
    sink: ChildGuard,
    flood: ChildGuard,
    established: u64,
}

fn waiting_handshakes(count: usize, conntrack: bool) -> WaitingHandshakes {
    let mut topo = Topology::new();
    // The hand-off is the stateful path's: the stateless redirect needs none.
    topo.capture_env
        .push(("CAPTURE_STATEFUL_REDIRECT", "1".to_string()));
    topo.attach(&["--mode", "ebpf"]);
    let netns = topo.pod.netns.path();
    if conntrack {
        // Someone else's rule that makes the kernel track the pod's connections: the kernel then
        // has an SO_ORIGINAL_DST answer of its own (the proxy's address) for every one.
        run(Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args([
                "iptables",
                "-A",
                "OUTPUT",
                "-m",
                "conntrack",
                "--ctstate",
                "NEW,ESTABLISHED",
                "-j",
                "ACCEPT",
            ]));
    }
    let cgroup = topo.pod.cgroup.path.clone();
    let sink =
        ChildGuard::spawn_ready(probe_in(&netns, Some(&cgroup), Some(&Who::proxy())).args([
            "sink",
            "--defer-accept",
            "60",
            "--listen",
            "0.0.0.0:15001",
        ]));
    let mut cmd = probe_in(&netns, Some(&cgroup), Some(&Who::app()));
    cmd.args(["flood", "--count", &count.to_string()]);
    cmd.args(["--window", &window_for(1).to_string()]);
    for d in destinations(4) {
        cmd.args(["--to", &d]);
    }
    let mut flood = ChildGuard::spawn(&mut cmd);
    let report: Value = serde_json::from_str(flood.read_line().trim()).expect("flood report");
    let established = report["established"].as_u64().unwrap_or(0);
    assert_eq!(established, count as u64, "{report}");
    WaitingHandshakes {
        topo,
        sink,
        flood,
        established,
    }
}

fn sink_report_when(sink: &mut ChildGuard, accepted: u64) -> Value {
    // The callers judge the report, with what they know of the case.
    poll_until(Duration::from_secs(30), || {
        let report: Value = serde_json::from_str(sink.ask("report").trim()).expect("sink report");
        if report["accepted"].as_u64() >= Some(accepted) {
            Ok(report)
        } else {
            Err(report)
        }
    })
    .unwrap_or_else(|last| last)
}

/// Hand-offs wait in the map while their handshakes are in flight and every one arrives; one
/// that is lost all the same (here: deleted, as an eviction would) fails closed: the proxy's
/// `SO_ORIGINAL_DST` is refused even where the kernel has an answer of its own, and the node
/// counts it.
#[test]
fn a_lost_handoff_fails_closed() {
    let mut w = waiting_handshakes(40, true);
    let bpffs = w.topo.dirs.bpffs.clone();
    assert_eq!(
        pinned_map_len(&bpffs, "HANDOFF"),
        40,
        "every established app socket waits with its hand-off"
    );
    let lost = delete_pinned_map_entries(&bpffs, "HANDOFF", 10);
    assert_eq!(lost, 10);
    assert_eq!(w.flood.ask("send").trim(), "sent");
    let report = sink_report_when(&mut w.sink, w.established);
    assert_eq!(report["accepted"].as_u64(), Some(w.established), "{report}");
    let answered: u64 = report["orig"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(addr, n)| {
            assert!(destinations(4).contains(addr), "orig {addr}");
            n.as_u64().unwrap_or(0)
        })
        .sum();
    assert_eq!(answered, 30, "the hand-offs that arrived: {report}");
    assert_eq!(
        report["orig_errors"]["EPERM"].as_u64(),
        Some(10),
        "the lost ones are refused: {report}"
    );
    assert_eq!(
        pinned_map_len(&bpffs, "HANDOFF"),
        0,
        "the map is empty again"
    );
    let status = w.topo.status();
    assert_eq!(
        status["node_errors"]["handoff_failed"].as_u64(),
        Some(10),
        "{status}"
    );
}

/// An app socket that gives up before its proxy's side completes takes its hand-off with it: the
/// map holds only handshakes in flight, so nothing accumulates for LRU eviction to act on.
#[test]
fn a_handoff_the_proxy_never_took_leaves_with_the_app_socket() {
    let mut w = waiting_handshakes(40, false);
    let bpffs = w.topo.dirs.bpffs.clone();
    assert_eq!(pinned_map_len(&bpffs, "HANDOFF"), 40);
    assert_eq!(w.flood.ask("reset").trim(), "closed");
    wait_until(
        Duration::from_secs(10),
        "the hand-offs of closed app sockets to leave the map",
        || match pinned_map_len(&bpffs, "HANDOFF") {
            0 => Ok(()),
            left => Err(format!("{left} entries")),
        },
    );
    let report = sink_report_when(&mut w.sink, 0);
    assert_eq!(report["accepted"].as_u64(), Some(0), "{report}");
}
