//! deploy/capture.yaml's DaemonSet pod run by containerd through CRI, from the image `cargo xtask
//! image` builds (`cargo xtask test` builds it first): every container, command line, security
//! context, mount, environment variable and probe comes from the manifest. Its init container
//! chains capture-cni into the node's CNI configuration, its agent becomes ready by the
//! manifest's readiness probe, a meshed pod created afterwards is captured, removing the
//! DaemonSet's pod leaves it captured, and `capture uninstall-cni` from the image takes the
//! plugin out again.

use std::path::PathBuf;

use capture_tests::{
    cni::{Node, MESHED},
    containerd::{node_agent::http_status_in, Containerd, CriPod, PodSpec},
    daemonset,
};

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/capture.yaml")
}

fn run(
    runtime: &Containerd,
    name: &str,
    annotations: &'static [(&'static str, &'static str)],
) -> CriPod {
    let spec = PodSpec {
        name,
        namespace: "default",
        annotations,
        proxy: true,
    };
    runtime
        .run_pod(&spec)
        .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", runtime.log_tail()))
}

/// The conflist after the init container chained capture-cni into it, with what the test's
/// kubelet layout needs: capture-cni told where this node's pod cgroups are (a node's kubelet
/// keeps them where capture-cni looks by default), and a minute for the agent's answer.
fn point_capture_cni_at_the_test_node(node: &Node, file: &std::path::Path) -> serde_json::Value {
    let mut list: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).expect("the conflist")).expect("JSON");
    let plugins = list["plugins"].as_array_mut().expect("plugins");
    let capture = plugins
        .iter_mut()
        .find(|p| p["type"] == "capture-cni")
        .unwrap_or_else(|| panic!("install-cni did not chain capture-cni"));
    capture["cgroup_root"] = serde_json::json!(node.cgroup_root);
    capture["timeout_seconds"] = serde_json::json!(60);
    std::fs::write(file, serde_json::to_string_pretty(&list).unwrap()).unwrap();
    list
}

#[test]
fn the_daemonsets_pod_runs_from_the_image_and_captures_pods_created_afterwards() {
    let node = Node::new();
    let conflist = node.write_network_conflist();
    std::fs::create_dir_all(&node.dirs.bpffs).expect("the node's bpffs directory");
    let runtime = Containerd::start_as_node(&node, &node.dirs.bpffs);
    runtime.import_archive(&capture_tests::image_archive());
    // The node's address for the downward API: the node netns's own loopback, where the metrics
    // listener can bind before any pod network exists.
    let pod = daemonset::node_agent(&manifest(), "127.0.0.1");
    let Some(agent) = runtime.run_node_agent(&pod, "capture-node-test") else {
        return;
    };

    wait_ready(&node, &runtime, &pod);
    assert!(
        node.plugin_dir.join("capture-cni").is_file(),
        "install-cni copied capture-cni into the node's CNI bin directory"
    );
    point_capture_cni_at_the_test_node(&node, &conflist);

    let meshed = run(&runtime, "meshed", MESHED);
    let plain = run(&runtime, "plain", &[]);
    let got = runtime.connect_from(&meshed, "app", &format!("{}:8080", plain.ip));
    got.assert_served_by("outbound", "the meshed pod's app to another pod");
    assert_eq!(got.orig(), Some(format!("{}:8080", plain.ip)));

    // The DaemonSet's pod goes (an upgrade, a node drain): captured pods stay captured.
    remove(&runtime, &agent.id);
    let got = runtime.connect_from(&meshed, "app", &format!("{}:8080", plain.ip));
    got.assert_served_by("outbound", "after the agent's pod was removed");

    // Its successor takes over; pods deleted then are released through it.
    let agent = runtime
        .run_node_agent(&pod, "capture-node-test-2")
        .expect("the agent's pod ran before");
    wait_ready(&node, &runtime, &pod);
    for p in [&meshed, &plain] {
        let removed = runtime.remove_pod(p);
        removed.unwrap_or_else(|e| panic!("removing {}: {e}\n{}", p.name, runtime.log_tail()));
    }

    // `capture uninstall-cni` from the image, with the install-cni container's mounts and
    // directories, takes capture-cni out of the chain and the bin directory.
    let mut uninstall = pod.clone();
    let mut init = uninstall.init_containers.remove(0);
    init.argv = [init.argv[0].clone(), "uninstall-cni".to_string()]
        .into_iter()
        .chain(
            init.argv
                .iter()
                .filter(|a| a.starts_with("--cni-bin-dir") || a.starts_with("--cni-conf-dir"))
                .cloned(),
        )
        .collect();
    init.name = "uninstall-cni".into();
    uninstall.init_containers = vec![init];
    uninstall.containers.clear();
    let removal = runtime
        .run_node_agent(&uninstall, "capture-uninstall")
        .expect("the agent's pod ran before");
    let list: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&conflist).expect("the conflist"))
            .expect("JSON");
    let types: Vec<&str> = list["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["type"].as_str())
        .collect();
    assert_eq!(types, ["bridge"], "the chain after uninstall-cni: {list}");
    assert!(!node.plugin_dir.join("capture-cni").exists());
    remove(&runtime, &removal.id);
    remove(&runtime, &agent.id);
}

fn remove(runtime: &Containerd, id: &str) {
    runtime.cri().stop_pod(id).expect("StopPodSandbox");
    runtime.cri().remove_pod(id).expect("RemovePodSandbox");
}

/// Waits until the agent answers the manifest's readiness probe.
fn wait_ready(node: &Node, runtime: &Containerd, pod: &daemonset::NodeAgentPod) {
    let probe = pod.containers[0]
        .readiness
        .clone()
        .expect("the agent's readiness probe");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while http_status_in(&node.netns.path(), &probe.host, probe.port, &probe.path) != Some(200) {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent never became ready\n{}",
            runtime.log_tail()
        );
        std::thread::sleep(std::time::Duration::from_secs(probe.period_seconds.min(2)));
    }
}
