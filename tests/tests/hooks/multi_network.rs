//! A pod on two networks (Multus adds the second): two IPv4 addresses on two interfaces, eth0's
//! (10.1.0.10) first, eth1's (10.3.0.1) second. Istio's rules name no pod address, so connections
//! arriving on either network are captured inbound and the app's own traffic out of either is
//! captured outbound, unless the secondary interface is excluded. The ebpf backend knows one
//! address per family: it refuses such a pod and says which addresses, and auto falls back.

use capture_tests::{
    guards::output_text,
    probe::Who,
    topology::{Topology, POD_IP4, POD_IP6},
};

const SECONDARY: &str = "10.3.0.1";

fn two_network_pod(args: &[&str]) -> Topology {
    let mut topo = Topology::new();
    topo.add_vm();
    let out = topo.try_attach_with_ips(&[POD_IP4, SECONDARY, POD_IP6], args);
    assert!(out.status.success(), "{args:?}: {}", output_text(&out));
    topo.start_all();
    topo
}

#[test]
fn both_networks_are_captured_by_the_rule_backends() {
    for (args, backend) in [
        (&["--mode", "iptables"][..], "iptables"),
        (
            &["--mode", "auto", "--fallback", "nftables"][..],
            "nftables",
        ),
    ] {
        let topo = two_network_pod(args);
        let context = args.join(" ");
        topo.connect_from_remote(&format!("{POD_IP4}:8080"))
            .assert_served_by("inbound", &context);
        topo.connect_from_vm(&format!("{SECONDARY}:8080"))
            .assert_served_by("inbound", &context);
        topo.tcp(&Who::app(), "10.0.0.5:80")
            .assert_served_by("outbound", &context);
        topo.tcp(&Who::app(), "10.3.0.2:80")
            .assert_served_by("outbound", &context);
        let pod = &topo.status()["pods"][0];
        assert_eq!(pod["mode"], backend, "{context}: {pod}");
        assert_eq!(pod["config"]["other_pod_ips"][0], SECONDARY, "{pod}");
        if args[1] == "auto" {
            let why = pod["fallback_reason"].as_str().unwrap_or_default();
            assert!(why.contains(SECONDARY), "{pod}");
        }
    }
}

#[test]
fn an_excluded_secondary_interface_is_left_alone() {
    for mode in ["iptables", "nftables"] {
        let topo = two_network_pod(&[
            "--mode",
            mode,
            "--annotation",
            "traffic.sidecar.istio.io/excludeInterfaces=eth1",
        ]);
        topo.connect_from_vm(&format!("{SECONDARY}:8080"))
            .assert_served_by("app", mode);
        topo.tcp(&Who::app(), "10.3.0.2:80")
            .assert_served_by("vm", mode);
        topo.connect_from_remote(&format!("{POD_IP4}:8080"))
            .assert_served_by("inbound", mode);
    }
}

#[test]
fn the_ebpf_backend_refuses_a_second_address_and_names_it() {
    let mut topo = Topology::new();
    topo.add_vm();
    let out = topo.try_attach_with_ips(&[POD_IP4, SECONDARY], &["--mode", "ebpf"]);
    let err = output_text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(SECONDARY) && err.contains("more than one address"),
        "{err}"
    );
    assert_eq!(topo.status()["pods"].as_array().map_or(0, Vec::len), 0);
}
