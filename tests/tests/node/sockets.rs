//! `capture sockets` on a pod with real connections held open, under both backends: the app's
//! redirected connection shows the destination it asked for (not the proxy's loopback address the
//! kernel holds under ebpf), paired with the proxy's end and its `SO_ORIGINAL_DST`; an excluded
//! port and the proxy's own connection pass under their rules; an arriving connection is the
//! proxy's inbound end with the pod's port as its original destination.

use capture_tests::{
    cases::Backend,
    guards::ChildGuard,
    probe::{probe_in, Who},
    topology::{Topology, POD_IP4},
};
use serde_json::Value;

const EXCLUDED_PORT: &str = "5555";

fn sockets(topo: &Topology) -> Value {
    let netns = topo.pod.netns.path();
    let out = topo.capture(&["sockets", "--json", "--netns", netns.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "capture sockets: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("sockets JSON")
}

/// The connection of `kind` owned by `uid` whose original destination (or, without one, remote
/// address as the app sees it) is `to`.
fn find<'r>(report: &'r Value, kind: &str, uid: u32, to: &str) -> &'r Value {
    report["connections"]
        .as_array()
        .expect("connections")
        .iter()
        .find(|c| {
            c["kind"] == kind
                && c["uid"] == uid
                && (c["original_dst"] == to || c["original_dst"].is_null() && c["remote"] == to)
        })
        .unwrap_or_else(|| panic!("no {kind} connection of uid {uid} to {to} in {report:#}"))
}

fn holder_from_remote(topo: &Topology, to: &str) -> ChildGuard {
    let mut cmd = probe_in(&topo.remote.path(), None, None);
    cmd.arg("hold").arg(to);
    ChildGuard::spawn_ready(&mut cmd)
}

#[test]
fn sockets_show_the_apps_view_the_proxy_and_the_deciding_rule_under_every_backend() {
    let (app, proxy) = (Who::app(), Who::proxy());
    let captured = "10.0.0.5:80";
    let excluded = format!("10.0.0.5:{EXCLUDED_PORT}");
    let proxys_own = "10.0.0.5:9090";
    let inbound = format!("{POD_IP4}:8080");
    for backend in Backend::EVERY {
        let mut topo = Topology::new();
        let exclusion = format!("traffic.sidecar.istio.io/excludeOutboundPorts={EXCLUDED_PORT}");
        topo.attach(&["--mode", backend.mode(), "--annotation", &exclusion]);
        topo.start_all();
        let _held = [
            topo.spawn_holder(&app, captured, false),
            topo.spawn_holder(&app, &excluded, false),
            topo.spawn_holder(&proxy, proxys_own, false),
            holder_from_remote(&topo, &inbound),
        ];
        let report = sockets(&topo);
        assert_eq!(report["backend"], backend.mode(), "{report:#}");
        let (hook_out, hook_in) = match backend {
            Backend::Ebpf => ("connect4", "sk_lookup"),
            Backend::Iptables => ("nat OUTPUT", "nat PREROUTING"),
            Backend::Nftables => (
                "inet istio-proxy-nat output",
                "inet istio-proxy-nat prerouting",
            ),
        };

        let app_side = find(&report, "outbound", 1000, captured);
        assert_eq!(app_side["remote"], captured, "the app's view: {app_side:#}");
        assert_eq!(app_side["via_proxy"], true, "{app_side:#}");
        assert_eq!(app_side["verdict"], "redirect", "{app_side:#}");
        assert_eq!(app_side["port"], 15001, "{app_side:#}");
        assert_eq!(app_side["hook"], hook_out, "{app_side:#}");
        assert_eq!(app_side["rule"], "include-all-outbound", "{app_side:#}");
        assert!(app_side["note"].is_null(), "{app_side:#}");
        let kernel_port = app_side["kernel_remote"]
            .as_str()
            .and_then(|a| a.rsplit_once(':'))
            .map(|(_, p)| p.to_owned());
        match backend {
            // The stateless redirect: the socket really is connected to the proxy's port.
            Backend::Ebpf => assert_eq!(kernel_port.as_deref(), Some("15001"), "{app_side:#}"),
            // NAT rewrites packets, not the socket.
            Backend::Iptables | Backend::Nftables => {
                assert_eq!(app_side["kernel_remote"], captured, "{app_side:#}");
            }
        }
        let proxy_end = find(&report, "proxy-outbound", 1337, captured);
        assert_eq!(proxy_end["via_proxy"], true, "{proxy_end:#}");
        assert_eq!(
            proxy_end["peer"]["pid"], app_side["holder"]["pid"],
            "the proxy's end is paired with the app's: {report:#}"
        );

        let passed = find(&report, "outbound", 1000, &excluded);
        assert_eq!(passed["via_proxy"], false, "{passed:#}");
        assert_eq!(passed["verdict"], "pass", "{passed:#}");
        assert_eq!(passed["rule"], "exclude-outbound-port", "{passed:#}");
        assert_eq!(passed["kernel_remote"], excluded.as_str(), "{passed:#}");

        let own = find(&report, "outbound", 1337, proxys_own);
        assert_eq!(own["via_proxy"], false, "{own:#}");
        assert_eq!(own["rule"], "proxy-uid", "{own:#}");

        let arrived = find(&report, "proxy-inbound", 1337, &inbound);
        assert_eq!(arrived["verdict"], "redirect", "{arrived:#}");
        assert_eq!(arrived["port"], 15006, "{arrived:#}");
        assert_eq!(arrived["hook"], hook_in, "{arrived:#}");
        assert_eq!(arrived["rule"], "include-all-inbound", "{arrived:#}");

        let listeners = report["listeners"].as_array().expect("listeners");
        for port in ["outbound", "inbound"] {
            assert!(
                listeners.iter().any(|l| l["proxy_port"] == port),
                "the proxy's {port} listener: {report:#}"
            );
        }
        if backend == Backend::Ebpf {
            assert!(
                listeners
                    .iter()
                    .filter(|l| l["proxy_port"] == "inbound")
                    .all(|l| l["registered"] == true),
                "{report:#}"
            );
        }
        let text = topo.capture(&[
            "sockets",
            "--netns",
            topo.pod.netns.path().to_str().unwrap(),
        ]);
        let text = String::from_utf8_lossy(&text.stdout);
        assert!(
            text.contains(&format!("-> {captured}")) && text.contains("through the proxy"),
            "{text}"
        );
    }
}

#[test]
fn sockets_of_an_unknown_pod_is_a_clear_error() {
    let topo = Topology::new();
    let netns = topo.pod.netns.path();
    let out = topo.capture(&["sockets", "--netns", netns.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no captured pod matches"),
        "{stderr}"
    );
}
