//! The agent's reconcile with a real containerd: meshed pods that started before capture-cni was
//! chained are captured in place, restarted or reported (`--repair`), a record whose sandbox went
//! while its DEL could not reach capture is released, and an unreadable runtime changes nothing.

use std::time::Duration;

use std::{io::Read as _, net::Ipv4Addr, os::unix::net::UnixListener, sync::mpsc, time::Instant};

use capture_tests::{
    agent::Agent,
    cni::{CgroupDriver, Node, MESHED},
    containerd::{cri::Cri, image::PROBE, Containerd, CriPod, PodSpec},
    topology::{pinned_map_len, POD_MAPS},
    wait::wait_until,
};
use capture_user::{netns::Netns, sockdiag::open_connections};
use k8s_cri::v1::{NamespaceMode, PodSandboxConfig};
use serde_json::Value;

pub(super) const PATIENCE: Duration = Duration::from_secs(30);
const BAD_ANNOTATION: &str = "traffic.sidecar.istio.io/excludeInboundPorts";

pub(super) fn spec<'a>(name: &'a str, annotations: &'a [(&'a str, &'a str)]) -> PodSpec<'a> {
    PodSpec {
        name,
        namespace: "default",
        annotations,
        proxy: !annotations.is_empty(),
    }
}

/// The node's network configuration without capture-cni, its runtime, a meshed pod started
/// there (uncaptured) and a plain one; None where runc cannot start containers here.
fn uncaptured_start() -> Option<(Node, Containerd, CriPod, CriPod)> {
    let node = Node::new();
    node.write_network_conflist();
    let runtime = Containerd::start(&node);
    let early = runtime.run_pod_or_skip(&spec("early", MESHED))?;
    let other = runtime
        .run_pod(&spec("other", &[]))
        .unwrap_or_else(|e| panic!("RunPodSandbox other: {e}"));
    Some((node, runtime, early, other))
}

pub(super) fn agent_args<'a>(
    runtime: &'a Containerd,
    node_conf: &'a str,
    repair: &'a str,
) -> Vec<&'a str> {
    vec![
        "--cri-socket",
        runtime.socket().to_str().unwrap(),
        "--cni-conf-dir",
        node_conf,
        "--reconcile-period",
        "1",
        "--repair",
        repair,
    ]
}

pub(super) fn captured(node: &Node, pod: &CriPod) -> bool {
    node.status()["pods"].as_array().is_some_and(|pods| {
        pods.iter()
            .any(|p| p["pod"]["container_id"] == pod.id.as_str())
    })
}

/// The agent's last reconcile, once it has made one at least `after` (unix seconds).
fn reconcile_after(node: &Node, after: u64) -> Value {
    wait_until(PATIENCE, "a reconcile pass", || {
        let report = node.status()["reconcile"].clone();
        if report["at_unix"].as_u64().is_some_and(|at| at > after) {
            Ok(report)
        } else {
            Err(report.to_string())
        }
    })
}

pub(super) fn wait_for_metric(agent: &Agent, line: &str) {
    wait_until(PATIENCE, line, || {
        let metrics = agent.checked_metrics();
        if metrics.contains(line) {
            Ok(())
        } else {
            Err(metrics)
        }
    });
}

/// The agent's first pass since `start` could not read the runtime, and says `why`.
fn assert_unreadable(node: &Node, agent: &Agent, start: u64, why: &str) {
    let report = reconcile_after(node, start);
    assert!(
        report["runtime_error"]
            .as_str()
            .is_some_and(|e| e.contains(why)),
        "{report:#}"
    );
    assert!(agent
        .checked_metrics()
        .contains("capture_runtime_reachable 0"));
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A sandbox config turned into a `hostNetwork` pod's, as kubelet sends it (no hostname: the
/// node's UTS namespace is not renamed).
fn on_node_network(mut config: PodSandboxConfig) -> PodSandboxConfig {
    config.hostname.clear();
    let linux = config.linux.get_or_insert_with(Default::default);
    let context = linux.security_context.get_or_insert_with(Default::default);
    context
        .namespace_options
        .get_or_insert_with(Default::default)
        .network = NamespaceMode::Node as i32;
    config
}

/// A CRI socket at `path` that accepts connections, reads what it is sent and never answers;
/// the receiver hears when the first request arrives.
fn hang_forever(path: &std::path::Path) -> mpsc::Receiver<()> {
    let listener = UnixListener::bind(path).expect("the hung runtime's socket");
    let (asked, heard) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut stream in listener.incoming().flatten() {
            let mut buf = [0u8; 64];
            if stream.read(&mut buf).is_ok_and(|n| n > 0) {
                let _ = asked.send(());
            }
            held.push(stream);
        }
    });
    heard
}

/// The runtime's loaded CNI configuration has capture-cni chained, or not: containerd reloads
/// the directory a little after a change, and a pod made before that runs the old chain.
pub(super) fn wait_chain_loaded(runtime: &Containerd, chained: bool) {
    wait_until(
        PATIENCE,
        "the runtime to load the CNI configuration",
        || {
            let loaded = runtime
                .cri()
                .loaded_cni_config()
                .map_err(|e| e.to_string())?;
            let config: Value =
                serde_json::from_str(&loaded).map_err(|e| format!("{e}: {loaded}"))?;
            let types: Vec<&Value> = config["Networks"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|n| n["Config"]["Plugins"].as_array().into_iter().flatten())
                .map(|p| &p["Network"]["type"])
                .collect();
            if types.contains(&&Value::from("capture-cni")) == chained {
                Ok(())
            } else {
                Err(format!("{types:?}"))
            }
        },
    );
}

/// `app` of `pod` opens a connection to `to` (exec'd through the runtime on a client of its
/// own) and holds it `secs`, then asks again on it; the join gives the probe's report.
fn hold_from(
    runtime: &Containerd,
    pod: &CriPod,
    to: &str,
    secs: u64,
) -> std::thread::JoinHandle<Value> {
    let remote = to.to_owned();
    hold_from_in(runtime, pod, &pod.netns, to, secs, move |s| {
        s.remote.to_string() == remote
    })
}

/// As `hold_from`, with the pod's netns reached at `netns` (a runtime in a mount namespace of
/// its own keeps the netns files there: the host reaches it through the sandbox's process), and
/// the held connection known by `held` (a captured one's kernel peer is the proxy).
pub(super) fn hold_from_in(
    runtime: &Containerd,
    pod: &CriPod,
    netns: &std::path::Path,
    to: &str,
    secs: u64,
    held: impl Fn(&capture_user::sockdiag::KernelSocket) -> bool,
) -> std::thread::JoinHandle<Value> {
    let mut cri = Cri::connect(runtime.socket()).expect("a second CRI client");
    let container = pod.container("app").to_owned();
    let target = to.to_owned();
    let secs = secs.to_string();
    let handle = std::thread::spawn(move || {
        let out = cri
            .exec(&container, &[PROBE, "hold", &target, "--for-secs", &secs])
            .expect("ExecSync hold");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        serde_json::from_str(stdout.lines().last().unwrap_or_default())
            .unwrap_or_else(|e| panic!("hold printed {stdout:?}: {e}"))
    });
    let netns = Netns::open(netns).expect("the pod's netns");
    wait_until(PATIENCE, "the held connection established", || {
        let open = open_connections(&netns).map_err(|e| e.to_string())?;
        if open.iter().any(&held) {
            Ok(())
        } else if handle.is_finished() {
            // Its panic (the probe's output) comes with the join: say so rather than wait on.
            Err(format!(
                "the hold ended before its connection was seen: {open:?}"
            ))
        } else {
            Err(format!("{open:?}"))
        }
    });
    handle
}

/// The node's pod-map entries, summed (0 once no pod is captured).
fn pod_map_entries(node: &Node) -> usize {
    POD_MAPS
        .iter()
        .map(|map| pinned_map_len(&node.dirs.bpffs, map))
        .sum()
}

fn forget_neighbours(pod: &CriPod) {
    let mut flush = std::process::Command::new("ip");
    flush.args(["neigh", "flush", "all"]);
    let out = capture_user::netns::output_in(&pod.netns, &mut flush, b"").expect("ip neigh flush");
    assert!(out.status.success(), "ip neigh flush: {out:?}");
}

/// host-local hands out the address after the last one it reserved: the next pod gets `ip`.
fn next_pod_gets(node: &Node, ip: &str) {
    let ip: Ipv4Addr = ip.parse().expect("an IPv4 pod address");
    let before = Ipv4Addr::from(u32::from(ip) - 1);
    std::fs::write(
        node.ipam_dir
            .join("capture-test")
            .join("last_reserved_ip.0"),
        before.to_string(),
    )
    .expect("host-local's last reserved address");
}

/// A meshed pod that started before capture-cni was chained is captured in place with its open
/// connection left alone; one created while the network plugin's rewrite had dropped capture-cni
/// is captured within the period; a record whose sandbox went while no DEL could reach capture is
/// released with its map entries and address, and a new pod on that address works.
#[expect(
    clippy::too_many_lines,
    reason = "one scenario through containerd, its steps in the order they happen"
)]
fn repaired_and_released(mode: &str) {
    let Some((node, runtime, early, other)) = uncaptured_start() else {
        return;
    };
    // A meshed pod of an excluded namespace, started uncaptured too: never the reconcile's.
    let system = runtime
        .run_pod(&PodSpec {
            namespace: "kube-system",
            ..spec("system", MESHED)
        })
        .expect("RunPodSandbox system");
    // A meshed pod whose annotation cannot be read: reported, not captured, nothing else harmed.
    let unreadable: Vec<(&str, &str)> = MESHED
        .iter()
        .copied()
        .chain([(BAD_ANNOTATION, "eighty")])
        .collect();
    let bad = (mode == "ebpf").then(|| {
        runtime
            .run_pod(&spec("bad", &unreadable))
            .expect("RunPodSandbox bad")
    });
    // A meshed pod whose netns path someone removed (its processes keep the netns): reported,
    // not captured.
    let unmounted = (mode == "ebpf").then(|| {
        let pod = runtime
            .run_pod(&spec("unmounted", MESHED))
            .expect("RunPodSandbox unmounted");
        nix::mount::umount2(&pod.netns, nix::mount::MntFlags::MNT_DETACH).expect("umount");
        std::fs::remove_file(&pod.netns).expect("the netns path");
        pod
    });
    // A meshed pod on the node's network: no CNI ADD runs for it, and nothing may capture it.
    let host_network = (mode == "ebpf").then(|| {
        let spec = PodSpec {
            proxy: false,
            ..spec("hostnet", MESHED)
        };
        let config = on_node_network(runtime.prepare_pod(&spec));
        runtime
            .start_pod(&spec, &config)
            .expect("RunPodSandbox hostnet")
    });
    let to_other = format!("{}:8080", other.ip);
    let held = hold_from(&runtime, &early, &to_other, 25);
    node.run_install_cni(&[]).expect("install-cni");
    let conf = node.conf_dir();
    let conf = conf.to_str().unwrap();
    let mut agent = node.start_agent_with(mode, &agent_args(&runtime, conf, "capture"));
    wait_until(PATIENCE, "the early pod captured by the reconcile", || {
        if captured(&node, &early) {
            Ok(())
        } else {
            Err(node.status()["reconcile"].to_string())
        }
    });
    assert!(
        !held.is_finished(),
        "the held connection ended before the repair: it proves nothing"
    );
    // Its outbound connections go through its proxy, and its proxy's listener was adopted: a
    // connection to the pod lands on the proxy's inbound port.
    let got = runtime.connect_from(&early, "app", &to_other);
    got.assert_served_by("outbound", &format!("{mode}: the repaired pod's app"));
    assert_eq!(got.orig(), Some(to_other.clone()));
    let got = runtime.connect_from(&other, "app", &format!("{}:8080", early.ip));
    got.assert_served_by(
        "inbound",
        &format!("{mode}: a connection to the repaired pod"),
    );
    let metrics = agent.checked_metrics();
    assert!(
        metrics.contains("capture_repairs_total{action=\"capture\",result=\"ok\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("capture_repair_connections_left_open_total 1"),
        "{mode}: the held connection is counted\n{metrics}"
    );
    // The repaired pod is in force; the two that cannot be captured are not.
    let still = format!(
        "capture_pods_uncaptured {}",
        if mode == "ebpf" { 2 } else { 0 }
    );
    wait_for_metric(&agent, &still);
    assert!(
        !captured(&node, &other) && !captured(&node, &system),
        "an unmeshed pod and a kube-system pod are never touched"
    );
    if let Some(host_network) = &host_network {
        let report = node.status()["reconcile"].clone();
        assert!(!captured(&node, host_network), "{report:#}");
        assert!(
            !report["uncaptured"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|u| u["pod"] == "default/hostnet"),
            "a host-network pod is never a repair's: {report:#}"
        );
    }
    for (pod, why) in [(&bad, BAD_ANNOTATION), (&unmounted, "netns")] {
        let Some(pod) = pod else { continue };
        let report = node.status()["reconcile"].clone();
        let entry = report["uncaptured"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|u| u["pod"] == format!("default/{}", pod.name))
            .unwrap_or_else(|| panic!("{} is reported: {report:#}", pod.name));
        let result = entry["result"].as_str().unwrap_or_default();
        assert!(
            result.starts_with("failed:") && result.contains(why),
            "{report:#}"
        );
        assert!(!captured(&node, pod));
        assert!(
            metrics.contains("capture_repairs_total{action=\"capture\",result=\"failed\"}"),
            "{metrics}"
        );
    }

    // The network plugin rewrites the configuration without capture-cni (no watcher re-chains
    // it here): a meshed pod made now runs uncaptured until the next pass.
    node.write_network_conflist();
    wait_chain_loaded(&runtime, false);
    let late = runtime
        .run_pod(&spec("late", MESHED))
        .expect("RunPodSandbox late");
    // The late pod captured by the reconcile.
    wait_for_metric(
        &agent,
        "capture_repairs_total{action=\"capture\",result=\"ok\"} 2",
    );
    assert!(captured(&node, &late));
    runtime
        .connect_from(&late, "app", &to_other)
        .assert_served_by("outbound", &format!("{mode}: the late pod's app"));

    // The connection opened before the repair kept its path: both of its exchanges reached the
    // other pod's app directly, on the same socket.
    let held = held.join().expect("the hold thread");
    assert_eq!(held["ok"], true, "{held:#}");
    for exchange in ["first", "second"] {
        assert_eq!(
            held[exchange]["reply"]["server"], "app",
            "{mode}: {exchange} exchange of the held connection: {held:#}"
        );
    }

    // A DEL that cannot reach capture: the pod goes while capture-cni is not chained.
    // And one stopped (its network torn down) without the DEL reaching capture either.
    agent.stop();
    runtime.remove_pod(&early).expect("RemovePodSandbox");
    runtime
        .cri()
        .stop_pod(&late.id)
        .expect("StopPodSandbox late");
    assert!(captured(&node, &early), "the record outlives its sandbox");
    let entries = (mode == "ebpf").then(|| pod_map_entries(&node));
    node.run_install_cni(&[]).expect("install-cni");
    wait_chain_loaded(&runtime, true);
    let _agent = node.start_agent_with(mode, &agent_args(&runtime, conf, "capture"));
    wait_until(PATIENCE, "the orphan records released", || {
        if captured(&node, &early) || captured(&node, &late) {
            Err(node.status()["reconcile"].to_string())
        } else {
            Ok(())
        }
    });
    if let Some(entries) = entries {
        assert!(pod_map_entries(&node) < entries, "the orphan's map entries");
    }
    // A meshed pod created now on the released address is captured by its ADD and owns it.
    next_pod_gets(&node, &early.ip);
    let next = runtime
        .run_pod(&spec("next", MESHED))
        .expect("RunPodSandbox next");
    assert_eq!(
        next.ip, early.ip,
        "host-local handed out the orphan's address"
    );
    assert!(captured(&node, &next));
    runtime
        .connect_from(&next, "app", &to_other)
        .assert_served_by("outbound", &format!("{mode}: the next pod's app"));
    // The bridge plugin sends no gratuitous ARP: the other pod's neighbour entry for the reused
    // address still names the gone pod's interface until it goes stale, as on any such node.
    forget_neighbours(&other);
    let got = runtime.connect_from(&other, "app", &format!("{}:8080", next.ip));
    got.assert_served_by("inbound", &format!("{mode}: a connection to the next pod"));
    for pod in [&next, &late, &other, &system]
        .into_iter()
        .chain(&bad)
        .chain(&unmounted)
        .chain(&host_network)
    {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
    // Every DEL since reached capture: nothing of the orphan is left either.
    assert_eq!(
        node.status()["pods"].as_array().map(Vec::len),
        Some(0),
        "records left"
    );
    if mode == "ebpf" {
        for map in POD_MAPS {
            assert_eq!(
                pinned_map_len(&node.dirs.bpffs, map),
                0,
                "{map} keeps entries"
            );
        }
    }
}

#[test]
fn ebpf_repairs_in_place_and_releases_lost_dels() {
    repaired_and_released("ebpf");
}

#[test]
fn iptables_repairs_in_place_and_releases_lost_dels() {
    repaired_and_released("iptables");
}

#[test]
fn report_changes_nothing_an_unreadable_runtime_changes_nothing_and_restart_stops_the_sandbox() {
    let Some((node, runtime, early, other)) = uncaptured_start() else {
        return;
    };
    node.run_install_cni(&[]).expect("install-cni");
    let conf = node.conf_dir();
    let conf = conf.to_str().unwrap();

    let start = now_unix();
    let mut agent = node.start_agent_with("ebpf", &agent_args(&runtime, conf, "report"));
    // A pod the runtime does not list (yet: its RunPodSandbox has not returned) but whose netns
    // exists: its record is never released.
    let mut unlisted = node.pod("unlisted", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut unlisted).expect("ADD unlisted");
    let report = reconcile_after(&node, start);
    let uncaptured = report["uncaptured"].as_array().expect("uncaptured");
    assert_eq!(uncaptured.len(), 1, "{report:#}");
    assert_eq!(uncaptured[0]["pod"], "default/early", "{report:#}");
    assert_eq!(uncaptured[0]["action"], "report", "{report:#}");
    // containerd 1.6 has no GetContainerEvents: the periodic passes alone.
    assert_eq!(report["event_stream"], false, "{report:#}");
    assert!(!captured(&node, &early));
    let metrics = agent.checked_metrics();
    assert!(metrics.contains("capture_pods_uncaptured 1"), "{metrics}");
    assert!(metrics.contains("capture_runtime_reachable 1"), "{metrics}");
    let later = report["at_unix"].as_u64().unwrap() + 2;
    let report = reconcile_after(&node, later);
    assert_eq!(report["released"], serde_json::json!([]), "{report:#}");
    let pods = node.status()["pods"].clone();
    assert!(
        pods.as_array()
            .unwrap()
            .iter()
            .any(|p| p["pod"]["container_id"] == unlisted.container_id.as_str()),
        "the unlisted pod's record was released while its netns exists: {pods:#}"
    );
    node.del(&unlisted).expect("DEL unlisted");
    agent.stop();

    let start = now_unix();
    let mut agent = node.start_agent_with(
        "ebpf",
        &[
            "--cri-socket",
            "/nonexistent/cri.sock",
            "--reconcile-period",
            "1",
        ],
    );
    assert_unreadable(&node, &agent, start, "/nonexistent/cri.sock");
    assert!(!captured(&node, &early), "nothing changed");
    agent.stop();

    // A runtime that takes connections and never answers: each pass waits out its deadline, and
    // an ADD meanwhile is not held up by it.
    let hung = node.scratch_file("hung-cri.sock");
    let asked = hang_forever(&hung);
    let start = now_unix();
    let mut agent = node.start_agent_with(
        "ebpf",
        &[
            "--cri-socket",
            hung.to_str().unwrap(),
            "--reconcile-period",
            "1",
        ],
    );
    asked
        .recv_timeout(PATIENCE)
        .expect("the reconcile asks the hung runtime");
    // The pass waits 5 s from its request: an ADD that waited for it would end after that.
    let asked_at = Instant::now();
    let mut during = node.pod("during", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut during).expect("ADD while the runtime hangs");
    assert!(
        asked_at.elapsed() < Duration::from_secs(5),
        "the ADD ended {:?} after the reconcile asked the hung runtime: it waited for the pass",
        asked_at.elapsed()
    );
    assert_unreadable(&node, &agent, start, "did not answer ListPodSandbox");
    node.del(&during).expect("DEL during");
    agent.stop();

    let _agent = node.start_agent_with("ebpf", &agent_args(&runtime, conf, "restart"));
    wait_until(PATIENCE, "the early sandbox stopped", || {
        let pods = runtime.cri().list_pods().map_err(|e| e.to_string())?;
        let state = pods.iter().find(|p| p.id == early.id).map(|p| p.state);
        if state == Some(k8s_cri::v1::PodSandboxState::SandboxNotready as i32) {
            Ok(())
        } else {
            Err(format!("{state:?}"))
        }
    });
    assert!(!captured(&node, &early), "restart captures nothing itself");
    for pod in [&early, &other] {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
}
