//! Virtual and excluded interfaces (parity-spec.md C `inbound_redirect`, E.17, E.18; T64–T70): traffic
//! forwarded through the pod from a VM. The ebpf backend does not capture forwarded traffic, so a
//! pod that needs these rules runs on iptables or nftables: refused in ebpf mode, a visible
//! fallback in auto.

use capture_tests::{probe::Who, topology::Topology};

const KUBEVIRT: &str = "traffic.sidecar.istio.io/kubevirtInterfaces=eth1";

fn vm_pod(args: &[&str]) -> Topology {
    let mut topo = Topology::new();
    topo.add_vm();
    topo.attach(args);
    topo.start_all();
    topo
}

#[test]
fn virtual_interface_traffic_is_outbound_traffic() {
    for (mode, backend) in [
        ("iptables", "iptables"),
        ("nftables", "nftables"),
        ("auto", "iptables"),
    ] {
        let topo = vm_pod(&[
            "--mode",
            mode,
            "--fallback",
            "iptables",
            "--annotation",
            KUBEVIRT,
        ]);
        // T64: a VM's connection out goes to the outbound listener, on eth1's address.
        let got = topo.connect_from_vm("10.0.0.5:80");
        got.assert_served_by("outbound", mode);
        assert_eq!(got.orig().as_deref(), Some("10.0.0.5:80"), "{mode}");
        assert_eq!(
            got.server_local().as_deref(),
            Some("10.3.0.1:15001"),
            "{mode}"
        );
        // T65: even towards the pod itself, never inbound capture.
        let got = topo.connect_from_vm("10.3.0.1:8080");
        got.assert_served_by("outbound", mode);
        // The pod's own traffic is captured as usual.
        let got = topo.tcp(&Who::app(), "10.0.0.5:80");
        got.assert_served_by("outbound", mode);
        let pod = &topo.status()["pods"][0];
        assert_eq!(pod["mode"], backend, "{mode}");
        assert_eq!(pod["in_force"], true, "{mode}");
        if mode == "auto" {
            let why = pod["fallback_reason"]
                .as_str()
                .expect("auto mode says why it fell back");
            assert!(why.contains("eth1"), "{why}");
        }
    }
}

#[test]
fn virtual_interface_with_an_include_list() {
    // T66: non-matching VM traffic bypasses all capture, inbound included.
    for mode in ["iptables", "nftables"] {
        let topo = vm_pod(&[
            "--mode",
            mode,
            "--annotation",
            KUBEVIRT,
            "--annotation",
            "traffic.sidecar.istio.io/includeOutboundIPRanges=10.0.0.0/16",
        ]);
        let got = topo.connect_from_vm("10.0.0.5:80");
        got.assert_served_by("outbound", mode);
        let got = topo.connect_from_vm("1.1.0.5:80");
        got.assert_served_by("remote", mode);
        let got = topo.connect_from_vm("10.3.0.1:8080");
        got.assert_served_by("app", mode);
    }
}

#[test]
fn excluded_interfaces_are_left_alone_both_ways() {
    for mode in ["iptables", "nftables", "auto"] {
        let topo = vm_pod(&[
            "--mode",
            mode,
            "--annotation",
            "traffic.sidecar.istio.io/excludeInterfaces=eth1",
        ]);
        // T68: inbound through eth1 reaches the app directly.
        let got = topo.connect_from_vm("10.3.0.1:8080");
        got.assert_served_by("app", mode);
        // T69/T70: the pod's traffic out through eth1 is not captured either.
        let got = topo.tcp(&Who::app(), "10.3.0.2:80");
        got.assert_served_by("vm", mode);
        // Other interfaces are captured as usual.
        let got = topo.tcp(&Who::app(), "10.0.0.5:80");
        got.assert_served_by("outbound", mode);
    }
}

#[test]
fn ebpf_mode_refuses_what_it_cannot_capture() {
    let topo = Topology::new();
    let out = topo.try_attach(&["--mode", "ebpf", "--annotation", KUBEVIRT]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ebpf backend cannot capture") && err.contains("--mode iptables"),
        "{err}"
    );
    assert_eq!(topo.status()["pods"].as_array().map_or(0, Vec::len), 0);
}

#[test]
fn tproxy_pods_leave_excluded_interfaces_alone_in_both_tables() {
    // Under TPROXY inbound capture happens in the mangle table, so the interface's exclusion
    // must be there too (Istio's `shortCircuitExcludeInterfaces`): without it, a connection
    // arriving on eth1 was still handed to the proxy.
    for (args, backend) in [
        (&["--mode", "iptables"][..], "iptables"),
        (&["--mode", "nftables"], "nftables"),
        (&["--mode", "auto", "--fallback", "nftables"], "nftables"),
    ] {
        let mode = &args.join(" ");
        let mut topo = Topology::new();
        topo.add_vm();
        let mut attach = args.to_vec();
        attach.extend([
            "--annotation",
            "sidecar.istio.io/interceptionMode=TPROXY",
            "--annotation",
            "traffic.sidecar.istio.io/excludeInterfaces=eth1",
        ]);
        topo.attach(&attach);
        topo.start_remote();
        topo.start_app();
        topo.start_tproxy_proxy();
        topo.connect_from_vm("10.3.0.1:8080")
            .assert_served_by("app", mode);
        topo.connect_from_remote("10.1.0.10:8080")
            .assert_served_by("inbound", mode);
        topo.tcp(&Who::app(), "10.3.0.2:80")
            .assert_served_by("vm", mode);
        topo.tcp(&Who::app(), "10.0.0.5:80")
            .assert_served_by("outbound", mode);
        assert_eq!(topo.status()["pods"][0]["mode"], backend, "{mode}");
    }
}
