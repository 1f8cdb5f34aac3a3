//! capture next to a network plugin's own cgroup programs: a socket load balancer attached at
//! the top of the pods' cgroup tree, as Cilium's kube-proxy replacement attaches one at the root.
//! The kernel runs a pod cgroup's programs before its parents', so capture decides first.

use std::net::SocketAddrV4;

use capture_tests::{
    cni::{CgroupDriver, Node, Pod, MESHED},
    guards::ChildGuard,
    probe::{connect_with, probe_in, Who},
    socket_lb::{SocketLb, PROGRAM_NAME},
    topology::capture_bin,
};

const SERVICE: &str = "10.96.0.50:80";

/// A meshed pod and an unmeshed backend on the node, both serving; the backend's address.
fn meshed_and_backend(node: &Node) -> (Pod, Pod, [Vec<ChildGuard>; 2], SocketAddrV4) {
    let mut meshed = node.pod("meshed", CgroupDriver::Cgroupfs, MESHED);
    let mut backend = node.pod("backend", CgroupDriver::Systemd, &[]);
    node.add(&mut meshed).expect("ADD meshed");
    node.add(&mut backend).expect("ADD backend");
    let servers = [meshed.start_servers(), backend.start_servers()];
    let to_backend = format!("{}:8080", backend.ip()).parse().unwrap();
    (meshed, backend, servers, to_backend)
}

#[test]
fn a_socket_load_balancer_above_the_pods_sees_connections_after_capture() {
    let node = Node::new();
    let _agent = node.start_agent("ebpf");
    let (meshed, backend, _servers, to_backend) = meshed_and_backend(&node);
    let _lb = SocketLb::attach(&node.cgroup_root, SERVICE.parse().unwrap(), to_backend)
        .expect("attaching the socket load balancer");

    // The app's connection to the service reaches its proxy, which learns the service address
    // (as under iptables capture): the balancer saw only 127.0.0.1:15001.
    let app = connect_with(meshed.app_client(), SERVICE);
    app.assert_served_by("outbound", "the app's connection to the service");
    assert_eq!(app.orig().as_deref(), Some(SERVICE), "{app:?}");

    // The proxy's own connection passes capture, and the balancer sends it to the backend.
    let proxy = probe_in(
        &meshed.netns.path(),
        Some(&meshed.cgroup),
        Some(&Who::proxy()),
    );
    let via_lb = connect_with(proxy, SERVICE);
    via_lb.assert_served_by("app", "the proxy's connection to the service");
    assert_eq!(
        via_lb.server_local(),
        Some(to_backend.to_string()),
        "{via_lb:?}"
    );

    // A pod capture leaves alone has only the balancer.
    let plain = connect_with(backend.app_client(), SERVICE);
    plain.assert_served_by("app", "an unmeshed pod's connection to the service");

    // `capture doctor` names the balancer and where it is attached.
    let out = std::process::Command::new(capture_bin())
        .arg("--bpffs")
        .arg(&node.dirs.bpffs)
        .arg("--state-dir")
        .arg(&node.dirs.state)
        .args(["doctor", "--json"])
        .output()
        .expect("capture doctor");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor JSON");
    let foreign = report["foreign_programs_above_pods"]
        .as_array()
        .expect("foreign programs");
    assert!(
        foreign.iter().any(|p| p["name"] == PROGRAM_NAME
            && p["hook"] == "cgroup/connect4"
            && p["cgroup"] == node.cgroup_root.display().to_string()),
        "{report}"
    );

    node.del(&meshed).expect("DEL meshed");
    node.del(&backend).expect("DEL backend");
}

/// Under the rule backends the balancer decides first: netfilter sees the connection only after
/// `connect()` rewrote it, so the proxy learns the backend, not the service, as under Istio's own
/// iptables capture. Hence Cilium's `socketLB.hostNamespaceOnly=true` for such pods (the balancer
/// then stays out of the pods' cgroups, and the nat rules see the service address).
#[test]
fn under_the_rule_backends_a_socket_load_balancer_in_the_pods_decides_first() {
    for mode in ["iptables", "nftables"] {
        let node = Node::new();
        let _agent = node.start_agent(mode);
        let (meshed, backend, _servers, to_backend) = meshed_and_backend(&node);
        let lb = SocketLb::attach(&node.cgroup_root, SERVICE.parse().unwrap(), to_backend)
            .expect("attaching the socket load balancer");
        let app = connect_with(meshed.app_client(), SERVICE);
        app.assert_served_by("outbound", mode);
        assert_eq!(app.orig(), Some(to_backend.to_string()), "{mode}: {app:?}");
        // Without the balancer in the pods' tree, the proxy learns the service. Routing comes
        // before the nat rules, and the test network has no default route, as nodes do.
        drop(lb);
        capture_tests::guards::run(std::process::Command::new("ip").args([
            "-n",
            &meshed.netns.name,
            "route",
            "add",
            "default",
            "dev",
            "eth0",
        ]));
        let app = connect_with(meshed.app_client(), SERVICE);
        app.assert_served_by("outbound", mode);
        assert_eq!(app.orig().as_deref(), Some(SERVICE), "{mode}: {app:?}");
        node.del(&meshed).expect("DEL meshed");
        node.del(&backend).expect("DEL backend");
    }
}
