//! capture driven by a real container runtime: Debian's containerd and runc, with the node's CNI
//! configuration chained by `capture install-cni`, pods created through the CRI API as kubelet
//! creates them (metadata, Istio annotations, the cgroup parent kubelet's cgroupfs or systemd
//! driver gives), the proxy container running as uid 1337 and the app as uid 1000, each started
//! by runc inside the sandbox.

use capture_tests::{
    cni::{Node, MESHED},
    containerd::{Containerd, CriPod, PodSpec},
    kernel::{has_or_skip, record_skip, Feature},
    topology::{
        capture_bin, cgroup_programs, pinned_map_len, pod_pins_left, POD_CGROUP_HOOKS, POD_MAPS,
    },
};

/// The node and its runtime: capture-cni chained into the node's CNI configuration.
fn node_with_containerd(mode: &str) -> (Node, capture_tests::agent::Agent, Containerd) {
    let node = Node::new();
    node.install_cni();
    let agent = node.start_agent(mode);
    let runtime = Containerd::start(&node);
    (node, agent, runtime)
}

fn meshed(name: &str) -> PodSpec<'_> {
    PodSpec {
        name,
        namespace: "default",
        annotations: MESHED,
        proxy: true,
    }
}

fn run(runtime: &Containerd, spec: &PodSpec<'_>) -> CriPod {
    runtime
        .run_pod(spec)
        .unwrap_or_else(|e| panic!("RunPodSandbox {}: {e}\n{}", spec.name, runtime.log_tail()))
}

/// The first pod of a test: as [`run`], but None (the test skips, saying why) where runc cannot
/// start any container at all for the one reason the kernel matrix knows of (see
/// `Feature::RuncClonedBinary`).
fn first(runtime: &Containerd, spec: &PodSpec<'_>) -> Option<CriPod> {
    match runtime.run_pod(spec) {
        Ok(pod) => Some(pod),
        Err(e) => {
            let log = runtime.log_tail();
            if log.contains("could not ensure we are a cloned binary") {
                record_skip(
                    Feature::RuncClonedBinary,
                    "runc could not re-execute itself from a sealed copy here",
                );
                return None;
            }
            panic!("RunPodSandbox {}: {e}\n{log}", spec.name)
        }
    }
}

/// The pod records the agent keeps.
fn records(node: &Node) -> usize {
    std::fs::read_dir(node.dirs.state.join("pods")).map_or(0, Iterator::count)
}

/// What a pod's traffic looks like in each direction, on real connections made inside its
/// containers (CRI ExecSync, so as the container's user, in its cgroup).
fn assert_captured(runtime: &Containerd, a: &CriPod, b: &CriPod, plain: &CriPod) {
    // a's app calling b lands on a's own proxy, which can ask where it was going.
    let got = runtime.connect_from(a, "app", &format!("{}:8080", b.ip));
    got.assert_served_by("outbound", "a's app to b");
    assert_eq!(got.orig(), Some(format!("{}:8080", b.ip)));
    // A connection from another pod to a lands on a's inbound listener, original port intact.
    let got = runtime.connect_from(plain, "app", &format!("{}:8080", a.ip));
    got.assert_served_by("inbound", "another pod to a");
    assert_eq!(got.orig(), Some(format!("{}:8080", a.ip)));
    // The proxy's own connection goes where it asked.
    let got = runtime.connect_from(a, "proxy", &format!("{}:8080", plain.ip));
    got.assert_served_by("app", "a's proxy to the plain pod");
}

#[test]
fn containerd_pods_are_captured_and_removal_leaves_nothing() {
    let (node, _agent, runtime) = node_with_containerd("ebpf");
    // runc writes cgroupfs itself: a container's cgroup is its id.
    captured_then_removed(&node, &runtime, |name| {
        name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())
    });
}

#[test]
fn the_systemd_cgroup_driver_captures_the_same() {
    if !has_or_skip(
        Feature::UnifiedCgroupControllers,
        "the cpu controller is bound to a cgroup v1 hierarchy (a hybrid host), and runc's \
         systemd driver sets every container's cpu.weight on cgroup v2",
    ) {
        return;
    }
    let node = Node::new();
    node.install_cni();
    let runtime = Containerd::start_systemd(&node);
    let _agent = node.start_agent_as(runtime.inside(true, capture_bin()), "ebpf");
    // runc asks systemd for each container's scope in the pod's slice.
    captured_then_removed(&node, &runtime, |name| {
        name.starts_with("cri-containerd-")
            && std::path::Path::new(name).extension() == Some("scope".as_ref())
    });
}

/// Meshed, unmeshed and kube-system pods on `runtime`, the traffic of each, then their removal.
/// `container_cgroup` tells the cgroup the runtime gives a container under the pod's.
fn captured_then_removed(node: &Node, runtime: &Containerd, container_cgroup: fn(&str) -> bool) {
    let (name, version) = runtime.version();
    eprintln!("runtime: {name} {version}");
    let Some(a) = first(runtime, &meshed("a")) else {
        return;
    };
    let b = run(runtime, &meshed("b"));
    let plain = run(runtime, &plain("plain"));
    let system = run(
        runtime,
        &PodSpec {
            name: "dns",
            namespace: "kube-system",
            ..meshed("dns")
        },
    );
    for pod in [&a, &b] {
        assert_eq!(
            cgroup_programs(&pod.cgroup).len(),
            POD_CGROUP_HOOKS,
            "{} is captured",
            pod.name
        );
    }
    for pod in [&plain, &system] {
        assert!(
            cgroup_programs(&pod.cgroup).is_empty(),
            "{} is left alone",
            pod.name
        );
    }
    assert_eq!(records(node), 2);
    for pod in [&a, &b, &plain, &system] {
        let containers: Vec<String> = std::fs::read_dir(&pod.cgroup)
            .unwrap_or_else(|e| panic!("{}: {e}", pod.cgroup.display()))
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let want = if pod.containers.contains_key("proxy") {
            3
        } else {
            2
        };
        assert_eq!(
            containers.iter().filter(|c| container_cgroup(c)).count(),
            want,
            "{}'s containers (pause included) run in its cgroup: {containers:?}",
            pod.name
        );
    }

    assert_captured(runtime, &a, &b, &plain);
    // b is captured the same way, on any port.
    let got = runtime.connect_from(&b, "app", &format!("{}:9090", plain.ip));
    got.assert_served_by("outbound", "b's app to the plain pod");
    // The unmeshed and the kube-system pods are untouched both ways.
    for (from, to) in [(&plain, &system), (&system, &plain)] {
        let got = runtime.connect_from(from, "app", &format!("{}:8080", to.ip));
        got.assert_served_by("app", &format!("{} to {}", from.name, to.name));
    }

    // StopPodSandbox tears the network down (CNI DEL): capture goes with it, while the cgroup,
    // which kubelet removes only after RemovePodSandbox, is still there to look at.
    runtime.cri().stop_pod(&a.id).expect("StopPodSandbox a");
    assert!(
        cgroup_programs(&a.cgroup).is_empty(),
        "a keeps programs after StopPodSandbox"
    );
    assert_eq!(records(node), 1, "a's record outlives StopPodSandbox");
    for pod in [&a, &b, &plain, &system] {
        runtime
            .remove_pod(pod)
            .unwrap_or_else(|e| panic!("removing {}: {e}", pod.name));
        assert!(
            !pod.netns.exists() || pod.netns.as_os_str().is_empty(),
            "{} netns left",
            pod.name
        );
    }
    assert_eq!(records(node), 0, "records left after RemovePodSandbox");
    assert!(!pod_pins_left(&node.dirs.bpffs), "link pins left");
    for map in POD_MAPS {
        assert_eq!(
            pinned_map_len(&node.dirs.bpffs, map),
            0,
            "{map} keeps entries"
        );
    }
}

fn plain(name: &str) -> PodSpec<'_> {
    PodSpec {
        name,
        namespace: "default",
        annotations: &[],
        proxy: false,
    }
}

#[test]
fn the_iptables_backend_through_containerd() {
    let (node, _agent, runtime) = node_with_containerd("iptables");
    let Some(a) = first(&runtime, &meshed("a")) else {
        return;
    };
    let b = run(&runtime, &meshed("b"));
    let other = run(&runtime, &plain("plain"));
    assert!(
        cgroup_programs(&a.cgroup).is_empty(),
        "iptables mode attaches no program"
    );
    assert_captured(&runtime, &a, &b, &other);
    for pod in [&a, &b, &other] {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
    assert_eq!(records(&node), 0, "records left after RemovePodSandbox");
}

#[test]
fn a_pod_created_while_the_agent_is_down_starts_when_the_runtime_retries() {
    let node = Node::new();
    node.install_cni();
    let runtime = Containerd::start(&node);

    // With no agent, a meshed pod's sandbox fails and nothing of it is left to run.
    let spec = meshed("early");
    let config = runtime.prepare_pod(&spec);
    let failed = runtime
        .start_pod(&spec, &config)
        .err()
        .expect("a meshed pod must not start while the agent is down");
    assert!(
        failed.message().contains("capture-cni") && failed.message().contains("agent"),
        "the runtime's error says capture's agent is missing: {failed}"
    );
    assert!(
        runtime
            .cri()
            .list_pods()
            .expect("ListPodSandbox")
            .is_empty(),
        "the failed sandbox is gone"
    );
    // An unmeshed pod does not need the agent.
    let Some(other) = first(&runtime, &plain("plain")) else {
        return;
    };

    let _agent = node.start_agent("ebpf");
    let late = runtime
        .start_pod(&spec, &config)
        .unwrap_or_else(|e| panic!("the retry after the agent came up: {e}"));
    assert_eq!(cgroup_programs(&late.cgroup).len(), POD_CGROUP_HOOKS);
    let got = runtime.connect_from(&late, "app", &format!("{}:8080", other.ip));
    got.assert_served_by("outbound", "the late pod's app");
    for pod in [&late, &other] {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
    assert_eq!(records(&node), 0);
}

#[test]
fn restarting_containerd_or_the_agent_changes_nothing_for_running_pods() {
    let (node, mut agent, mut runtime) = node_with_containerd("ebpf");
    let Some(a) = first(&runtime, &meshed("a")) else {
        return;
    };
    let b = run(&runtime, &meshed("b"));
    let other = run(&runtime, &plain("plain"));
    assert_captured(&runtime, &a, &b, &other);

    runtime.restart();
    assert_eq!(runtime.cri().list_pods().expect("ListPodSandbox").len(), 3);
    assert_captured(&runtime, &a, &b, &other);

    // The agent SIGKILLed: running pods stay captured by the kernel programs alone.
    agent.kill_hard();
    assert_captured(&runtime, &a, &b, &other);
    let _agent = node.start_agent("ebpf");
    assert_captured(&runtime, &a, &b, &other);
    assert_eq!(cgroup_programs(&a.cgroup).len(), POD_CGROUP_HOOKS);
    assert_eq!(records(&node), 2);
    // And the restarted pair still captures a new pod.
    let c = run(&runtime, &meshed("c"));
    let got = runtime.connect_from(&c, "app", &format!("{}:8080", other.ip));
    got.assert_served_by("outbound", "a pod made after both restarts");

    for pod in [&a, &b, &c, &other] {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
    assert_eq!(records(&node), 0);
    assert!(!pod_pins_left(&node.dirs.bpffs), "link pins left");
}

/// `capture status --all --json` over the node's directories and `runtime`'s socket.
fn status_all(node: &Node, runtime: &Containerd, socket: Option<&str>) -> serde_json::Value {
    let socket = socket.map_or_else(|| runtime.socket().display().to_string(), str::to_owned);
    let conf_dir = node.conf_dir();
    let out = node.capture(&[
        "status",
        "--all",
        "--json",
        "--cri-socket",
        &socket,
        "--cni-conf-dir",
        conf_dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "capture status --all: {out:?}");
    serde_json::from_slice(&out.stdout).expect("status JSON")
}

fn standing(status: &serde_json::Value, pod: &str) -> String {
    let found = status["runtime"]["sandboxes"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["pod"] == format!("default/{pod}")));
    found.unwrap_or_else(|| panic!("no sandbox default/{pod} in {status:#}"))["standing"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn status_all_tells_meshed_pods_capture_never_saw_and_records_whose_pod_is_gone() {
    let node = Node::new();
    node.write_network_conflist();
    let runtime = Containerd::start(&node);
    // Before install-cni: a meshed pod starts, and runs uncaptured.
    let Some(early) = first(&runtime, &meshed("early")) else {
        return;
    };
    let other = run(&runtime, &plain("plain"));
    let before = status_all(&node, &runtime, None);
    assert!(before["runtime"]["error"].is_null(), "{before:#}");
    assert_eq!(
        standing(&before, "early"),
        "meshed-not-captured",
        "{before:#}"
    );
    assert_eq!(standing(&before, "plain"), "not-meshed", "{before:#}");

    node.run_install_cni(&[]).expect("install-cni");
    let agent = node.start_agent("ebpf");
    let late = run(&runtime, &meshed("late"));
    let during = status_all(&node, &runtime, None);
    assert_eq!(standing(&during, "late"), "captured", "{during:#}");
    assert!(
        during["runtime"]["selection"]
            .as_str()
            .is_some_and(|s| s.contains("chained")),
        "{during:#}"
    );
    assert_eq!(standing(&during, "early"), "meshed-not-captured");
    let text = node.capture(&[
        "status",
        "--all",
        "--cri-socket",
        runtime.socket().to_str().unwrap(),
        "--cni-conf-dir",
        node.conf_dir().to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("default/early") && text.contains("MESHED, NOT CAPTURED"),
        "{text}"
    );

    // A DEL that never reaches capture (the chain lost capture-cni) leaves an orphan record.
    node.uninstall_cni().expect("uninstall-cni");
    runtime.remove_pod(&late).expect("RemovePodSandbox");
    let after = status_all(&node, &runtime, None);
    let orphans = after["runtime"]["orphans"].as_array().expect("orphans");
    assert_eq!(orphans.len(), 1, "{after:#}");
    assert_eq!(orphans[0]["container_id"], late.id.as_str(), "{after:#}");

    // An unreachable runtime is said, and nothing else is claimed.
    let gone = status_all(&node, &runtime, Some("/nonexistent/cri.sock"));
    assert!(
        gone["runtime"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("/nonexistent/cri.sock")),
        "{gone:#}"
    );
    assert!(gone["runtime"]["sandboxes"]
        .as_array()
        .is_some_and(Vec::is_empty));
    drop(agent);
    for pod in [&early, &other] {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
}

/// The image archive as containerd reads it: the name points at the image index (both platforms
/// listed), and containerd takes each platform's manifest from it by the index's platform fields:
/// the image mounted for linux/arm64 holds an arm64 capture, for this machine's platform this
/// machine's. This is how an arm64 node's containerd would choose, checked without one.
#[test]
fn containerd_takes_each_platforms_image_from_the_index() {
    let node = Node::new();
    let runtime = Containerd::start(&node);
    let archive = capture_tests::image_archive();
    let images = capture_oci::read_archive(&archive).expect("the image archive");
    let name = images[0].name.clone();
    let index = images[0].index.clone().expect("an image index");
    let ctr = |args: &[&str]| runtime.ctr("capture-platforms", args);
    let host = match capture_oci::oci_architecture() {
        "arm64" => ("linux/arm64/v8", 183_u16),
        _ => ("linux/amd64", 62),
    };
    for (platform, machine) in [("linux/arm64/v8", 183_u16), host] {
        // `ctr images mount` unpacks for the platform it is given; import's own unpack would
        // take this machine's.
        ctr(&[
            "images",
            "import",
            "--no-unpack",
            "--platform",
            platform,
            &archive.to_string_lossy(),
        ]);
        let listed = ctr(&["images", "ls"]);
        let line = listed
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not imported: {listed}"));
        assert!(
            line.contains("application/vnd.oci.image.index.v1+json"),
            "{line}"
        );
        assert!(line.contains(&index), "{line}");
        assert!(
            line.contains("linux/amd64") && line.contains("linux/arm64"),
            "{line}"
        );
        let mount = std::env::temp_dir().join(capture_tests::unique("capture-platform-mount"));
        std::fs::create_dir_all(&mount).expect("a mount point");
        let mount_path = mount.to_string_lossy().into_owned();
        ctr(&[
            "images",
            "mount",
            "--platform",
            platform,
            &name,
            &mount_path,
        ]);
        let capture = std::fs::read(mount.join("usr/local/bin/capture"));
        ctr(&["images", "unmount", "--rm", &mount_path]);
        let _ = std::fs::remove_dir(&mount);
        let capture = capture.expect("capture in the mounted image");
        assert_eq!(
            u16::from_le_bytes([capture[18], capture[19]]),
            machine,
            "the capture containerd mounts for {platform}"
        );
    }
}
