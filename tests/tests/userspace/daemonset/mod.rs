//! deploy/capture.yaml's DaemonSet pod run by containerd through CRI, from the image `cargo xtask
//! image` builds (`cargo xtask test` builds it first): every container, command line, security
//! context, mount, environment variable and probe comes from the manifest. Its init container
//! chains capture-cni into the node's CNI configuration, its agent becomes ready by the
//! manifest's readiness probe, a meshed pod created afterwards is captured, removing the
//! DaemonSet's pod leaves it captured, and `capture uninstall-cni` from the image takes the
//! plugin out again.

mod inside;
mod upgrade;

use std::path::PathBuf;

use capture_tests::{
    cni::{Node, MESHED},
    containerd::{
        node_agent::{http_status_in, NodeAgentRun},
        Containerd, CriPod, PodSpec,
    },
    daemonset, guards,
    kernel::{has_or_skip, Feature},
};

use self::inside::{
    assert_runs_restricted, container_of, exec_json, sockets_seen_from_the_agents_container,
    traced_from_the_agents_container,
};

/// The `mesh` key of the `istio` ConfigMap as istiod's chart writes it, with DNS capture on.
const ISTIOD_MESH: &str = "defaultConfig:\n  discoveryAddress: istiod.istio-system.svc:15012\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"true\"\nenablePrometheusMerge: true\nrootNamespace: istio-system\ntrustDomain: cluster.local\n";

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/capture.yaml")
}

pub(super) fn run(
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
pub(super) fn point_capture_cni_at_the_test_node(
    node: &Node,
    file: &std::path::Path,
) -> serde_json::Value {
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

/// A test node whose containerd runs the DaemonSet's pod from the image, its agent ready: the
/// runtime, the pod as the manifest gives it, the running pod and the chained conflist's path.
/// None where the runtime cannot run containers here (the test skips, saying why).
pub(super) fn node_with_the_daemonset(
    node: &Node,
) -> Option<(Containerd, daemonset::NodeAgentPod, NodeAgentRun, PathBuf)> {
    let (runtime, pod, conflist) = node_before_the_daemonset(node)?;
    let agent = runtime.run_node_agent(&pod, "capture-node-test")?;
    wait_ready(node, &runtime, &pod);
    Some((runtime, pod, agent, conflist))
}

/// A test node's runtime, the image imported and the network configured, with the DaemonSet's
/// pod as the manifest gives it, not yet running.
fn node_before_the_daemonset(
    node: &Node,
) -> Option<(Containerd, daemonset::NodeAgentPod, PathBuf)> {
    if !has_or_skip(
        Feature::WritableNodePaths,
        "the node paths of the DaemonSet's hostPath volumes cannot be made on this read-only \
         root (the kernel matrix's guests); the test runs on the host (cargo xtask test)",
    ) {
        return None;
    }
    let conflist = node.write_network_conflist();
    std::fs::create_dir_all(&node.dirs.bpffs).expect("the node's bpffs directory");
    let runtime = Containerd::start_as_node(node, &node.dirs.bpffs);
    runtime.import_archive(&capture_tests::image_archive());
    // The node's address for the downward API: the node netns's own loopback, where the metrics
    // listener can bind before any pod network exists.
    // Istio's mesh configuration, as kubelet projects the `istio` ConfigMap's `mesh` key.
    let config_maps = node.scratch_file("configmaps/istio/mesh");
    std::fs::write(&config_maps, ISTIOD_MESH).expect("the mesh configuration");
    let config_maps = config_maps.parent().unwrap().parent().unwrap();
    let pod = daemonset::node_agent(&manifest(), "127.0.0.1", config_maps);
    Some((runtime, pod, conflist))
}

#[test]
fn the_daemonsets_pod_runs_from_the_image_and_captures_pods_created_afterwards() {
    let node = Node::new();
    let Some((runtime, pod, agent, conflist)) = node_with_the_daemonset(&node) else {
        return;
    };
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
    let to_meshed = format!("{}:8080", meshed.ip);
    let got = runtime.connect_from(&plain, "app", &to_meshed);
    got.assert_served_by("inbound", "another pod to the meshed pod");
    assert_eq!(got.orig(), Some(to_meshed));
    let agent_cid = container_of(&agent, "agent");
    assert_runs_restricted(&runtime, &pod, &agent_cid);
    sockets_seen_from_the_agents_container(&runtime, &agent_cid);
    traced_from_the_agents_container(&runtime, &agent_cid, &meshed, &plain.ip);

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

/// A meshed pod that started before the DaemonSet, on a node where capture-cni was not chained
/// yet: the restricted agent's runtime reconcile captures it in place, and its proxy's
/// listeners, which predate the attach and belong to processes outside the agent's PID
/// namespace, are registered by the kernel, so a connection to the pod reaches the proxy's
/// inbound port. What the agent did is readable from its container, as `kubectl exec` reads it.
#[test]
fn the_restricted_agent_captures_in_place_a_pod_that_predates_it() {
    let node = Node::new();
    let Some((runtime, pod, conflist)) = node_before_the_daemonset(&node) else {
        return;
    };
    let early = run(&runtime, "early", MESHED);
    let other = run(&runtime, "other", &[]);
    let to_early = format!("{}:8080", early.ip);
    runtime
        .connect_from(&other, "app", &to_early)
        .assert_served_by("app", "before the DaemonSet: nothing captures the pod");

    let agent = runtime
        .run_node_agent(&pod, "capture-node-test")
        .expect("the agent's pod runs");
    wait_ready(&node, &runtime, &pod);
    point_capture_cni_at_the_test_node(&node, &conflist);
    capture_tests::wait::wait_until(
        std::time::Duration::from_mins(2),
        "the early pod captured in place by the agent's reconcile",
        || {
            if crate::reconcile::captured(&node, &early) {
                Ok(())
            } else {
                Err(format!(
                    "{}\n{}",
                    node.status()["reconcile"],
                    runtime.log_tail()
                ))
            }
        },
    );
    let got = runtime.connect_from(&other, "app", &to_early);
    got.assert_served_by("inbound", "a connection to the pod captured in place");
    assert_eq!(got.orig(), Some(to_early.clone()));
    let got = runtime.connect_from(&early, "app", &format!("{}:8080", other.ip));
    got.assert_served_by("outbound", "the pod captured in place, outbound");

    let agent_cid = container_of(&agent, "agent");
    let status = exec_json(&runtime, &agent_cid, &["status", "--json"]);
    let pods = status["pods"].as_array().cloned().unwrap_or_default();
    assert!(
        pods.iter()
            .any(|p| p["pod"]["name"] == "early" && p["mode"] == "ebpf" && p["in_force"] == true),
        "status from the agent's container: {status}"
    );
    let explained = exec_json(
        &runtime,
        &agent_cid,
        &[
            "explain",
            "--pod",
            "default/early",
            "--to",
            &to_early,
            "--direction",
            "inbound",
            "--json",
        ],
    );
    assert!(
        explained.to_string().contains("15006"),
        "explain from the agent's container: {explained}"
    );
    for p in [&early, &other] {
        runtime.remove_pod(p).expect("removing a pod");
    }
    remove(&runtime, &agent.id);
}

pub(super) fn remove(runtime: &Containerd, id: &str) {
    runtime.cri().stop_pod(id).expect("StopPodSandbox");
    runtime.cri().remove_pod(id).expect("RemovePodSandbox");
}

/// Waits until the agent answers the manifest's readiness probe.
pub(super) fn wait_ready(node: &Node, runtime: &Containerd, pod: &daemonset::NodeAgentPod) {
    let probe = pod.containers[0]
        .readiness
        .clone()
        .expect("the agent's readiness probe");
    capture_tests::wait::wait_until(
        std::time::Duration::from_mins(2),
        "the agent to become ready",
        || match http_status_in(&node.netns.path(), &probe.host, probe.port, &probe.path) {
            Some(200) => Ok(()),
            other => Err(format!("{other:?}\n{}", runtime.log_tail())),
        },
    );
}

/// On a node whose own netns holds native nftables tables and no iptables rules, the agent in
/// its image captures a TPROXY pod with the nftables backend (the manifest's `--fallback=auto`).
#[test]
fn the_agent_in_its_image_captures_a_tproxy_pod_with_nftables_on_an_nftables_node() {
    let node = Node::new();
    guards::run(guards::in_netns(&node.netns.path(), "nft").args([
        "add",
        "table",
        "inet",
        "node-firewall",
    ]));
    let Some((runtime, _pod, _agent, conflist)) = node_with_the_daemonset(&node) else {
        return;
    };
    point_capture_cni_at_the_test_node(&node, &conflist);
    let tproxy = run(&runtime, "tproxy", TPROXY);
    let netns = sandbox_netns(&runtime, &tproxy);
    let ruleset = guards::run(guards::in_netns(&netns, "nft").args(["list", "ruleset"]));
    assert!(
        ruleset.contains("tproxy") && ruleset.contains("15006"),
        "capture's nftables rules in the pod: {ruleset}"
    );
    for variant in ["legacy", "nft"] {
        let rules = guards::saved_rules(&netns, variant, &[]);
        assert!(
            !rules.contains("ISTIO"),
            "no {variant} iptables rules: {rules}"
        );
    }
    let status = node.status();
    let pods = status["pods"].as_array().cloned().unwrap_or_default();
    assert!(
        pods.iter()
            .any(|p| p["pod"]["name"] == "tproxy" && p["mode"] == "nftables"),
        "{status}"
    );
    runtime.remove_pod(&tproxy).expect("removing the pod");
}

/// A pod's netns as the host reaches it: through its sandbox's process (containerd mounted the
/// netns file in its own mount namespace).
pub(super) fn sandbox_netns(runtime: &Containerd, pod: &CriPod) -> PathBuf {
    let status = runtime.cri().pod_status(&pod.id).expect("PodSandboxStatus");
    let info: serde_json::Value =
        serde_json::from_str(status.info.get("info").expect("verbose info")).expect("JSON");
    PathBuf::from(format!("/proc/{}/ns/net", info["pid"]))
}

/// The agent in its image writes an iptables pod's rules with the node's own variant: a node
/// whose netns holds legacy rules gets legacy rules in its pods, one on nft nft rules. (TPROXY
/// pods are captured by iptables in the manifest's `auto` mode.)
#[test]
fn the_agent_in_its_image_writes_iptables_rules_in_the_nodes_variant() {
    for (variant, other) in [("legacy", "nft"), ("nft", "legacy")] {
        let node = Node::new();
        let in_node = |program: String, args: &[&str]| {
            guards::run(guards::in_netns(&node.netns.path(), program).args(args));
        };
        in_node(
            format!("iptables-{variant}"),
            &["-A", "INPUT", "-p", "255", "-j", "DROP"],
        );
        // A node on legacy iptables has loaded the tables' modules (kube-proxy's rules live in
        // nat); the image has no modprobe.
        for table in ["nat", "mangle"] {
            in_node(format!("iptables-{variant}"), &["-t", table, "-n", "-L"]);
        }
        let Some((runtime, _pod, agent, conflist)) = node_with_the_daemonset(&node) else {
            return;
        };
        point_capture_cni_at_the_test_node(&node, &conflist);
        let tproxy = run(&runtime, "tproxy", TPROXY);
        let netns = sandbox_netns(&runtime, &tproxy);
        let rules = |v: &str| guards::saved_rules(&netns, v, &[]);
        let agent_log = std::fs::read_to_string(
            std::path::Path::new(&agent.config.log_directory).join("agent.log"),
        )
        .unwrap_or_default();
        assert!(
            rules(variant).contains("-A ISTIO_INBOUND"),
            "{variant} rules in the pod:\n{}\n{other}:\n{}\nthe agent's log:\n{agent_log}",
            rules(variant),
            rules(other)
        );
        assert!(
            !rules(other).contains("ISTIO"),
            "no {other} rules in the pod:\n{}",
            rules(other)
        );
        runtime.remove_pod(&tproxy).expect("removing the pod");
    }
}

const TPROXY: &[(&str, &str)] = &[MESHED[0], ("sidecar.istio.io/interceptionMode", "TPROXY")];
