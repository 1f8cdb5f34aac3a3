//! A real transparent proxy, not the probe, as the pod's sidecar: HAProxy as uid 1337 forwards
//! every connection to its original destination and logs what it saw, under each backend. The
//! app and the remote client see the destination's answer; HAProxy's log shows the client each
//! `accept()` gave it (the pod address for the pod's own connections, the remote client's for
//! inbound ones) and the original destination its `SO_ORIGINAL_DST` gave it, as under iptables.

use std::time::Duration;

use capture_tests::{
    haproxy::{Haproxy, Logged, INBOUND_PASSTHROUGH_SRC},
    probe::{ip_of, Outcome, Who},
    topology::{Topology, POD_IP4},
};

/// How long HAProxy may take to log a connection, which it does when the connection ends.
/// Generous, for emulation on a busy host; a connection that never ends is logged after HAProxy's
/// own client and server timeouts (10 s), which this outlasts.
const PATIENCE: Duration = Duration::from_secs(30);

/// The pod captured by `backend`, with HAProxy as its sidecar, the app's listeners and the
/// remote side's.
fn pod_with_haproxy(backend: &str) -> (Topology, Haproxy) {
    let mut topo = Topology::new();
    topo.attach(&["--mode", backend]);
    topo.start_remote();
    topo.start_app();
    let proxy = Haproxy::start_in_pod(&topo.pod.netns.path(), &topo.pod.cgroup.path, &Who::proxy());
    (topo, proxy)
}

/// The port of `ADDR:PORT`.
fn port_of(addr: &str) -> String {
    addr.rsplit(':').next().unwrap_or_default().to_string()
}

#[track_caller]
fn logged(proxy: &Haproxy, backend: &str) -> Logged {
    proxy.next_logged(PATIENCE).unwrap_or_else(|| {
        panic!(
            "{backend}: HAProxy logged no connection within {PATIENCE:?}; it said: {}",
            proxy.said()
        )
    })
}

fn outbound_through_haproxy(backend: &str) {
    let (topo, proxy) = pod_with_haproxy(backend);
    for to in ["10.0.0.5:80", "10.0.0.6:8080", "10.0.0.5:80"] {
        let got: Outcome = topo.tcp(&Who::app(), to);
        got.assert_served_by(
            "remote",
            &format!("{backend}: the app's {to} through HAProxy"),
        );
        // HAProxy's own connection went direct, from the pod address.
        assert_eq!(
            got.peer_seen().map(|p| ip_of(&p)).as_deref(),
            Some(POD_IP4),
            "{backend}: the destination's peer: {:?}",
            got.0
        );
        let app_local = got.client_local().expect("the app's own address");
        assert_eq!(
            ip_of(&app_local),
            POD_IP4,
            "{backend}: the app's getsockname"
        );
        assert_eq!(
            got.client_peer().as_deref(),
            Some(to),
            "{backend}: the app's getpeername"
        );
        let seen = logged(&proxy, backend);
        assert_eq!(
            seen,
            Logged {
                frontend: "outbound".into(),
                client: format!("{POD_IP4}:{}", port_of(&app_local)),
                destination: to.into(),
            },
            "{backend}: what HAProxy saw of the app's connection to {to}"
        );
    }
}

fn inbound_through_haproxy(backend: &str) {
    let (topo, proxy) = pod_with_haproxy(backend);
    let to = format!("{}:8080", topo.ip4);
    let got = topo.connect_from_remote(&to);
    got.assert_served_by(
        "app",
        &format!("{backend}: inbound to {to} through HAProxy"),
    );
    // The app sees HAProxy's passthrough source, as under Istio.
    assert_eq!(
        got.peer_seen().map(|p| ip_of(&p)).as_deref(),
        Some(INBOUND_PASSTHROUGH_SRC),
        "{backend}: the app's peer: {:?}",
        got.0
    );
    let client = got.client_local().expect("the remote client's own address");
    let seen = logged(&proxy, backend);
    assert_eq!(
        seen,
        Logged {
            frontend: "inbound".into(),
            client,
            destination: to.clone(),
        },
        "{backend}: what HAProxy saw of the inbound connection to {to}"
    );
}

#[test]
fn haproxy_forwards_the_apps_connections_and_sees_the_pod_and_the_destination() {
    for backend in ["ebpf", "iptables"] {
        outbound_through_haproxy(backend);
    }
}

#[test]
fn haproxy_forwards_inbound_connections_and_sees_the_client_and_the_pod_port() {
    for backend in ["ebpf", "iptables"] {
        inbound_through_haproxy(backend);
    }
}

/// A newcomer's checkout as root on Debian is under /root (0700): the proxy's uid cannot enter
/// it. HAProxy started from such a directory still starts and forwards (it refuses to start when
/// it cannot return to its initial directory, unless the pod's processes leave the checkout).
#[test]
fn haproxy_started_from_a_checkout_under_a_private_directory_forwards() {
    use std::os::unix::fs::PermissionsExt as _;
    // A directory of its own, removed on drop: the private home, the checkout inside it.
    let home = capture_tests::guards::TempFile::new("README", "a home");
    let home_dir = home.path.parent().expect("the home");
    let checkout = home_dir.join("checkout");
    std::fs::create_dir(&checkout).expect("the checkout");
    std::fs::set_permissions(home_dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let mut topo = Topology::new();
    topo.attach(&["--mode", "ebpf"]);
    topo.start_remote();
    let proxy = Haproxy::start_in_pod_from(
        &topo.pod.netns.path(),
        &topo.pod.cgroup.path,
        &Who::proxy(),
        &checkout,
    );
    topo.tcp(&Who::app(), "10.0.0.5:80")
        .assert_served_by("remote", "the app's connection through HAProxy");
    assert_eq!(logged(&proxy, "ebpf").frontend, "outbound");
}
