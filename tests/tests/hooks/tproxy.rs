//! TPROXY interception mode (parity-spec.md B TPROXY variant, C `inbound_tproxy`, T54–T63). The ebpf
//! backend does not implement TPROXY's original-source path, so such pods run on iptables or
//! nftables: explicitly, or as auto mode's visible per-pod fallback (to the `--fallback` backend).

use capture_tests::{
    probe::{ip_of, ConnectOpts, Who},
    topology::Topology,
};

const TPROXY: &str = "sidecar.istio.io/interceptionMode=TPROXY";

/// The ways a TPROXY pod is captured: `--mode` (and `--fallback`), and the backend it gets.
const MODES: [(&[&str], &str); 4] = [
    (&["--mode", "iptables"], "iptables"),
    (&["--mode", "nftables"], "nftables"),
    (&["--mode", "auto", "--fallback", "iptables"], "iptables"),
    (&["--mode", "auto", "--fallback", "nftables"], "nftables"),
];

fn tproxy_pod(mode: &str, with_proxy: bool) -> Topology {
    tproxy_pod_with(&["--mode", mode], with_proxy)
}

fn tproxy_pod_with(mode: &[&str], with_proxy: bool) -> Topology {
    let mut topo = Topology::new();
    let mut args = mode.to_vec();
    args.extend(["--annotation", TPROXY]);
    topo.attach(&args);
    topo.start_remote();
    topo.start_app();
    if with_proxy {
        topo.start_tproxy_proxy();
    }
    topo
}

#[test]
fn inbound_keeps_the_original_destination() {
    for (args, backend) in MODES {
        let mode = &args.join(" ");
        let topo = tproxy_pod_with(args, true);
        // T54: on the inbound listener, with the original destination as local address.
        let got = topo.connect_from_remote("10.1.0.10:8080");
        got.assert_served_by("inbound", mode);
        assert_eq!(
            got.server_local().as_deref(),
            Some("10.1.0.10:8080"),
            "{mode}"
        );
        assert_eq!(
            got.peer_seen().map(|p| ip_of(&p)).as_deref(),
            Some("10.1.0.1"),
            "{mode}"
        );
        // T56: the tunnel port is captured too under TPROXY (the quirk).
        let got = topo.connect_from_remote("10.1.0.10:15008");
        got.assert_served_by("inbound", mode);
        // Excluded ports still reach the app.
        let got = topo.connect_from_remote("10.1.0.10:15020");
        got.assert_served_by("app", mode);
        // Outbound is REDIRECT as before.
        let got = topo.tcp(&Who::app(), "10.0.0.5:80");
        got.assert_served_by("outbound", mode);
        // T58: the proxy runs as uid 0; its gid makes its own-pod traffic go to 15006.
        let got = topo.tcp(&Who::new(0, 1337), "10.1.0.10:8080");
        got.assert_served_by("inbound", mode);
        let pod = &topo.status()["pods"][0];
        assert_eq!(pod["mode"], backend, "{mode}");
        assert_eq!(pod["in_force"], true, "{mode}: {pod}");
        if args[1] == "auto" {
            assert!(
                pod["fallback_reason"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("TPROXY"),
                "{pod}"
            );
        }
    }
}

#[test]
fn original_source_connections_from_the_proxy_complete() {
    // T61: the proxy connects to the app as the original client (IP_TRANSPARENT, mark 1337); the
    // app sees the client's address and the reply finds its way back through table 133.
    for mode in ["iptables", "nftables"] {
        let topo = tproxy_pod(mode, true);
        let opts = ConnectOpts {
            bind: Some("10.1.0.1:0".into()),
            transparent: true,
            mark: Some(1337),
            ..ConnectOpts::default()
        };
        let got = topo.connect(&Who::new(0, 1337), "10.1.0.10:8080", &opts);
        assert!(got.ok(), "{mode}: {:?}", got.0);
        got.assert_served_by("app", mode);
        assert_eq!(
            got.peer_seen().map(|p| ip_of(&p)).as_deref(),
            Some("10.1.0.1"),
            "{mode}: {:?}",
            got.0
        );
    }
}

#[test]
fn no_listener_means_the_syn_is_dropped() {
    // T63: TPROXY to a port nobody listens on drops the SYN: the client times out.
    for mode in ["iptables", "nftables"] {
        let topo = tproxy_pod(mode, false);
        let got = topo.connect_from_remote("10.1.0.10:8080");
        assert!(!got.ok(), "{mode}: {:?}", got.0);
        assert_eq!(
            got.error().as_deref(),
            Some("ETIMEDOUT"),
            "{mode}: {:?}",
            got.0
        );
    }
}

#[test]
fn detach_removes_the_marks_and_routes() {
    for mode in ["iptables", "nftables"] {
        let topo = tproxy_pod(mode, false);
        let routes = |t: &Topology| {
            capture_tests::guards::run(std::process::Command::new("ip").args([
                "-n",
                &t.pod.netns.name,
                "rule",
                "show",
            ]))
        };
        assert!(
            routes(&topo).contains("lookup 133"),
            "{mode}: {}",
            routes(&topo)
        );
        assert!(topo.detach().status.success());
        assert!(
            !routes(&topo).contains("lookup 133"),
            "{mode}: {}",
            routes(&topo)
        );
        let got = topo.connect_from_remote("10.1.0.10:8080");
        got.assert_served_by("app", mode);
    }
}

#[test]
fn ebpf_mode_refuses_tproxy() {
    let topo = Topology::new();
    let out = topo.try_attach(&["--mode", "ebpf", "--annotation", TPROXY]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("TPROXY"));
}
