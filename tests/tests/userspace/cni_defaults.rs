//! Istio CNI's defaults on the CNI path (parity-spec.md section A, E.21, case T37), through the plugin on
//! both backends: a pod that names no outbound exclusions has outbound 15020 left alone, and the
//! inbound exclusions always end with 15020, 15021, 15090. The CLI keeps istio-init's defaults
//! (`outbound::default_sidecar`, T18: outbound 15020 is captured).

use capture_tests::{
    cni::{CgroupDriver, Node, Pod, MESHED},
    guards::ChildGuard,
    probe::{connect_with, probe_in, Who},
};

/// The app's listeners on every port the defaults are about, and the pod's proxy.
fn start(pod: &Pod) -> Vec<ChildGuard> {
    let mut servers = pod.start_servers();
    let mut cmd = probe_in(&pod.netns.path(), Some(&pod.cgroup), Some(&Who::app()));
    cmd.arg("serve");
    for port in [15020, 15021, 15090, 9000] {
        cmd.arg("--tcp").arg(format!("app=0.0.0.0:{port}"));
    }
    servers.push(ChildGuard::spawn_ready(&mut cmd));
    servers
}

fn run(mode: &str) {
    let node = Node::new();
    let _agent = node.start_agent(mode);
    let mut plain = node.pod("plain", CgroupDriver::Cgroupfs, MESHED);
    let with_excludes = [
        MESHED[0],
        ("traffic.sidecar.istio.io/excludeInboundPorts", "9000"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "9090"),
    ];
    let mut annotated = node.pod("annotated", CgroupDriver::Systemd, &with_excludes);
    node.add(&mut plain).expect("ADD plain");
    node.add(&mut annotated).expect("ADD annotated");
    let _servers = [start(&plain), start(&annotated)];
    let from_node = |ip: &str, port: u16| connect_with(node.client(), &format!("{ip}:{port}"));

    // Inbound: 15020, 15021 and 15090 always go straight to the app; the annotation adds to them.
    for port in [15020, 15021, 15090] {
        for pod in [&plain, &annotated] {
            let context = format!("{mode}: inbound {}:{port} ({})", pod.ip(), pod.name);
            from_node(pod.ip(), port).assert_served_by("app", &context);
        }
    }
    from_node(annotated.ip(), 9000).assert_served_by(
        "app",
        &format!("{mode}: the annotated pod's own inbound exclusion"),
    );
    from_node(plain.ip(), 9000).assert_served_by(
        "inbound",
        &format!("{mode}: 9000 is captured where no annotation excludes it"),
    );

    // Outbound: T37, 15020 leaves the plain pod uncaptured (and the other pod's inbound side
    // excludes it too, so its app answers). A pod naming its own exclusions gets only those.
    let t37 = connect_with(plain.app_client(), &format!("{}:15020", annotated.ip()));
    t37.assert_served_by("app", &format!("{mode}: T37"));
    let own = connect_with(annotated.app_client(), &format!("{}:15020", plain.ip()));
    own.assert_served_by(
        "outbound",
        &format!("{mode}: a pod with excludeOutboundPorts has 15020 captured"),
    );
    assert_eq!(own.orig(), Some(format!("{}:15020", plain.ip())), "{own:?}");
    // Its own exclusion leaves it uncaptured at the source; the destination pod's inbound
    // capture takes it.
    let excluded = connect_with(annotated.app_client(), &format!("{}:9090", plain.ip()));
    excluded.assert_served_by(
        "inbound",
        &format!("{mode}: the pod's own outbound exclusion"),
    );

    node.del(&plain).expect("DEL plain");
    node.del(&annotated).expect("DEL annotated");
}

#[test]
fn the_cni_path_applies_istio_cnis_defaults_with_ebpf() {
    run("ebpf");
}

#[test]
fn the_cni_path_applies_istio_cnis_defaults_with_iptables() {
    run("iptables");
}
