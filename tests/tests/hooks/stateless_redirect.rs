//! The stateless redirect: a TCP connection is sent to a loopback address of its own destination
//! (`127.2.0.0/19`, one per destination and pod, kept while the pod lives; an IPv6 one to that
//! address's twin in `100::/64`, which attach routes to `lo`), so that the proxy's
//! `SO_ORIGINAL_DST` and the app's getpeername are read from the connection's address and no
//! socket keeps any state. Where the kernel cannot serve it (or it is switched off, as here with
//! `CAPTURE_STATEFUL_REDIRECT=1`), the stateful path answers the same.

use std::{
    collections::BTreeMap,
    net::{SocketAddr, SocketAddrV6, TcpListener, TcpStream},
    os::fd::AsRawFd,
    time::Duration,
};

use capture_user::{
    netns::Netns,
    sockdiag::{tcp_sockets, StateFlags},
};

use capture_tests::{
    kernel::{has_or_skip, Feature},
    probe::{ip_of, ConnectOpts, Outcome, Who},
    topology::{pinned_map_len, Topology, POD_IP4, POD_IP6},
};

const DESTINATIONS: [&str; 3] = ["10.0.0.5:80", "10.0.0.5:443", "10.0.0.6:80"];
const DESTINATIONS6: [&str; 3] = ["[fd00:2::5]:80", "[fd00:2::5]:443", "[fd00:2::6]:80"];

/// The prefix of the IPv6 twins of the range (`100::7f02:0/115`), as addresses print.
const RANGE6_PREFIX: &str = "100::7f02:";

/// Two connections to each destination; the proxy's local address of each, by destination.
fn connect_twice_to_each(
    topo: &Topology,
    destinations: [&'static str; 3],
) -> BTreeMap<&'static str, Vec<String>> {
    let mut locals: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for _ in 0..2 {
        for to in destinations {
            let got = topo.tcp(&Who::app(), to);
            assert!(got.ok(), "{to}: {:?}", got.error());
            got.assert_served_by("outbound", to);
            assert_eq!(got.orig().as_deref(), Some(to), "SO_ORIGINAL_DST");
            assert_eq!(
                got.client_peer().as_deref(),
                Some(to),
                "the app's getpeername"
            );
            assert_pod_end(&got, to.starts_with('['));
            locals.entry(to).or_default().push(ip_of(
                &got.server_local().expect("the proxy's local address"),
            ));
        }
    }
    locals
}

/// The app's end of the connection is the pod address, from both ends: the app's getsockname
/// and the proxy's accept (whatever source the kernel gave the app's socket).
#[track_caller]
fn assert_pod_end(got: &Outcome, ipv6: bool) {
    let local = got.client_local().unwrap_or_default();
    let pod = if ipv6 { POD_IP6 } else { POD_IP4 };
    assert_eq!(ip_of(&local), pod, "the app's getsockname: {:?}", got.0);
    assert_eq!(got.ends_disagree(), None, "the proxy's peer: {:?}", got.0);
}

/// A pod captured by ebpf with its proxy and app running, where the kernel serves the stateless
/// redirect (`None`, after recording the skip, elsewhere).
fn captured_pod() -> Option<Topology> {
    if !has_or_skip(
        Feature::StatelessRedirect,
        "every redirect takes the stateful path here",
    ) {
        return None;
    }
    let mut topo = Topology::new();
    topo.attach(&["--mode", "ebpf"]);
    topo.start_all();
    Some(topo)
}

fn loopback_destinations(topo: &Topology) -> Option<u64> {
    let status = topo.status();
    let netns = topo.pod.netns.path().display().to_string();
    let pods = status["pods"].as_array().expect("pods");
    let pod = pods
        .iter()
        .find(|p| p["netns"] == netns.as_str())
        .expect("the pod is in the status");
    pod["loopback_destinations"].as_u64()
}

/// Each destination has one address of its own, in the range, the same for every connection to
/// it; the proxy and the app get the original destination from it; status counts the pod's
/// destinations, and they leave the node's table with the pod.
#[test]
fn each_destination_has_an_address_of_its_own_that_answers_for_it() {
    let Some(topo) = captured_pod() else {
        return;
    };
    let locals = connect_twice_to_each(&topo, DESTINATIONS);
    let mut seen = Vec::new();
    for (to, addrs) in &locals {
        assert!(
            addrs.iter().all(|a| a.starts_with("127.2.")),
            "{to}: accepted on {addrs:?}, want 127.2.0.0/19"
        );
        assert!(addrs.windows(2).all(|w| w[0] == w[1]), "{to}: {addrs:?}");
        seen.push(addrs[0].clone());
    }
    seen.sort();
    seen.dedup();
    assert_eq!(
        seen.len(),
        DESTINATIONS.len(),
        "one address per destination: {locals:?}"
    );
    assert_eq!(
        loopback_destinations(&topo),
        Some(DESTINATIONS.len() as u64)
    );

    // A second pod's entries stay when the first goes; the first's go with it.
    let mut other = Topology::numbered(topo.dirs.shared(), 1);
    other.attach(&["--mode", "ebpf"]);
    other.start_all();
    let got = other.tcp(&Who::app(), "10.0.0.5:80");
    assert_eq!(got.orig().as_deref(), Some("10.0.0.5:80"));
    assert_eq!(pinned_map_len(&topo.dirs.bpffs, "LOOPBACK_DESTS"), 4);
    let out = topo.detach();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(pinned_map_len(&topo.dirs.bpffs, "LOOPBACK_DESTS"), 1);
    assert_eq!(loopback_destinations(&other), Some(1));
}

/// A proxy with a dual-stack IPv6 listener alone: the stateless address reaches it too, and the
/// accepted socket (IPv6, the addresses v4-mapped) answers `SO_ORIGINAL_DST` for the IPv4
/// destination.
#[test]
fn a_dual_stack_listener_gets_the_address_v4_mapped_and_answers() {
    if !has_or_skip(
        Feature::StatelessRedirect,
        "every redirect takes the stateful path here",
    ) {
        return;
    }
    let topo = Topology::new();
    topo.attach(&["--mode", "ebpf"]);
    let _proxy = topo.spawn_proxy_serving(&["--dual-stack", "--tcp", "outbound=[::]:15001"]);
    for to in DESTINATIONS {
        let got = topo.tcp(&Who::app(), to);
        got.assert_served_by("outbound", "[::]:15001");
        assert_eq!(got.orig().as_deref(), Some(to));
        assert_eq!(got.client_peer().as_deref(), Some(to));
        let local = got.server_local().unwrap_or_default();
        assert!(local.contains("127.2."), "accepted on {local}");
        assert_pod_end(&got, false);
    }
}

/// The app's own source decides the path: bound to the pod address (or unbound), the connection
/// takes the stateless redirect and both ends see the pod address; bound to a loopback address,
/// it takes the stateful path, and the proxy sees that address as its peer, as it is.
#[test]
fn a_socket_bound_to_a_loopback_source_keeps_it_and_the_stateful_path() {
    let Some(topo) = captured_pod() else {
        return;
    };
    let bound = |addr: &str| ConnectOpts {
        bind: Some(addr.to_string()),
        ..ConnectOpts::default()
    };
    let to = "10.0.0.5:80";
    let pod = topo.connect(&Who::app(), to, &bound(&format!("{POD_IP4}:0")));
    pod.assert_served_by("outbound", "bound to the pod address");
    assert_eq!(pod.orig().as_deref(), Some(to));
    assert!(
        ip_of(&pod.server_local().unwrap_or_default()).starts_with("127.2."),
        "bound to the pod address, the stateless redirect: {:?}",
        pod.0
    );
    assert_pod_end(&pod, false);

    let lo = topo.connect(&Who::app(), to, &bound("127.0.0.1:0"));
    lo.assert_served_by("outbound", "bound to 127.0.0.1");
    assert_eq!(lo.orig().as_deref(), Some(to));
    assert_eq!(lo.client_peer().as_deref(), Some(to));
    assert!(
        !ip_of(&lo.server_local().unwrap_or_default()).starts_with("127.2."),
        "bound to a loopback source, the stateful path: {:?}",
        lo.0
    );
    assert_eq!(
        lo.peer_seen().map(|p| ip_of(&p)).as_deref(),
        Some("127.0.0.1"),
        "{:?}",
        lo.0
    );
    assert_eq!(lo.ends_disagree(), None, "{:?}", lo.0);
}

/// Switched off, every redirect takes the stateful path (the hand-off and socket storage) and
/// answers the same; the pod has no loopback addresses of the table.
#[test]
fn the_stateful_path_answers_the_same_when_the_stateless_one_is_off() {
    let mut topo = Topology::new();
    topo.capture_env
        .push(("CAPTURE_STATEFUL_REDIRECT", "1".to_string()));
    topo.attach(&["--mode", "ebpf"]);
    topo.start_all();
    for destinations in [DESTINATIONS, DESTINATIONS6] {
        let locals = connect_twice_to_each(&topo, destinations);
        for (to, addrs) in &locals {
            assert!(
                addrs
                    .iter()
                    .all(|a| !a.starts_with("127.2.") && !a.starts_with(RANGE6_PREFIX)),
                "{to}: accepted on {addrs:?}, outside the stateless range"
            );
        }
    }
    assert_eq!(loopback_destinations(&topo).unwrap_or(0), 0);
}

/// IPv6: each destination has the twin of a slot of its own in `100::/64`, the same for every
/// connection to it, from the slots IPv4 destinations take theirs from; both ends see the pod's
/// IPv6 address for the app's end (the kernel gives the app's socket `[::1]`, the route's source).
#[test]
fn ipv6_destinations_have_addresses_of_their_own_in_100_slash_64() {
    let Some(topo) = captured_pod() else {
        return;
    };
    let locals = connect_twice_to_each(&topo, DESTINATIONS6);
    let mut seen: Vec<&String> = locals.values().map(|addrs| &addrs[0]).collect();
    for (to, addrs) in &locals {
        assert!(
            addrs.iter().all(|a| a.starts_with(RANGE6_PREFIX)),
            "{to}: accepted on {addrs:?}, want {RANGE6_PREFIX}0/115"
        );
        assert!(addrs.windows(2).all(|w| w[0] == w[1]), "{to}: {addrs:?}");
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), DESTINATIONS6.len(), "{locals:?}");
    // One IPv4 destination beside them: the families share the pod's slots and its count.
    let got = topo.tcp(&Who::app(), DESTINATIONS[0]);
    assert_eq!(got.orig().as_deref(), Some(DESTINATIONS[0]));
    assert_eq!(
        loopback_destinations(&topo),
        Some(DESTINATIONS6.len() as u64 + 1)
    );
}

/// IPv6 takes the stateful path where the stateless one cannot answer as iptables would: a
/// proxy listening on `[::1]` alone (no listener takes `100::/64`), and an app socket bound to
/// `[::1]` itself (its peer must be that address, not the pod's).
#[test]
fn ipv6_keeps_the_stateful_path_for_a_loopback_listener_or_source() {
    let Some(topo) = captured_pod() else {
        return;
    };
    let to = DESTINATIONS6[0];
    let bound = ConnectOpts {
        bind: Some("[::1]:0".to_string()),
        ..ConnectOpts::default()
    };
    let lo = topo.connect(&Who::app(), to, &bound);
    lo.assert_served_by("outbound", "bound to [::1]");
    assert_eq!(lo.orig().as_deref(), Some(to));
    assert_eq!(lo.client_peer().as_deref(), Some(to));
    assert_eq!(
        ip_of(&lo.server_local().unwrap_or_default()),
        "::1",
        "{:?}",
        lo.0
    );
    assert_eq!(lo.peer_seen().map(|p| ip_of(&p)).as_deref(), Some("::1"));
    drop(topo);

    let topo = Topology::new();
    topo.attach(&["--mode", "ebpf"]);
    let _proxy = topo.spawn_proxy_serving(&["--tcp", "outbound=[::1]:15001"]);
    let got = topo.tcp(&Who::app(), to);
    got.assert_served_by("outbound", "[::1]:15001 alone");
    assert_eq!(got.orig().as_deref(), Some(to));
    assert_eq!(got.client_peer().as_deref(), Some(to));
    assert_pod_end(&got, true);
    assert_eq!(loopback_destinations(&topo).unwrap_or(0), 0);
}

/// The stateful path binds the pod's IPv6 address and connects to `[::1]` (as
/// `the_stateful_path_answers_the_same_when_the_stateless_one_is_off` shows). Once the app's
/// socket is a time-wait socket, the kernel routes its answers (the ACK of the proxy's FIN) to
/// `::1` strictly through the interface of the pod's address, which attach gives a route of
/// `::1`; without it the answers are lost, the proxy's end of a connection the app closed first
/// waits in `LAST-ACK`, and a connect reusing its port waits in `SYN-SENT`. Sockets of that
/// shape, made in the pod's netns, with the proxy's end closed a moment after the app's.
#[test]
fn ipv6_on_the_stateful_path_leaves_no_proxy_end_waiting_for_its_last_ack() {
    let topo = Topology::new();
    topo.attach(&["--mode", "ebpf"]);
    let netns = Netns::open(&topo.pod.netns.path()).expect("the pod's netns");
    let pod_end = SocketAddrV6::new(POD_IP6.parse().expect("an address"), 0, 0, 0);
    let (listener, apps) = netns
        .run_in(|| {
            let listener = TcpListener::bind("[::1]:0").expect("a listener on [::1]");
            let to = listener.local_addr().expect("its address");
            let apps: Vec<TcpStream> = (0..8).map(|_| bound_and_connected(pod_end, to)).collect();
            (listener, apps)
        })
        .expect("entering the pod's netns");
    for app in apps {
        let (proxy_end, _) = listener.accept().expect("the proxy's end");
        drop(app);
        std::thread::sleep(Duration::from_millis(20));
        drop(proxy_end);
    }
    // An ACK that gets through ends `LAST-ACK` at once; a lost one leaves the proxy's end
    // retransmitting its FIN for seconds.
    std::thread::sleep(Duration::from_millis(300));
    let waiting = tcp_sockets(&netns, StateFlags::LAST_ACK).expect("the pod's sockets");
    assert!(waiting.is_empty(), "proxy ends in LAST-ACK: {waiting:#?}");
}

/// A TCP socket bound to `from` and connected to `to`, as the stateful redirect leaves the app's.
fn bound_and_connected(from: SocketAddrV6, to: SocketAddr) -> TcpStream {
    use nix::sys::socket::{
        bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn6, SockaddrStorage,
    };
    let fd = socket(
        AddressFamily::Inet6,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("a socket");
    bind(fd.as_raw_fd(), &SockaddrIn6::from(from)).expect("binding the pod's address");
    connect(fd.as_raw_fd(), &SockaddrStorage::from(to)).expect("connecting to [::1]");
    TcpStream::from(fd)
}

/// The kernel refuses a route through an interface that is down (`ENETDOWN`): a pod whose IPv6
/// address's interface is down is still captured, without the route of `::1` (the one of
/// `100::/64` is there); a pod whose interface is up has it.
#[test]
fn a_pod_whose_interface_is_down_is_captured_without_the_loopback_reply_route() {
    let topo = Topology::new();
    let pod = topo.pod.netns.name.as_str();
    // Taking an interface down drops its IPv6 addresses; one added while it is down stays.
    capture_tests::guards::ip(&["-n", pod, "link", "set", "eth0", "down"]);
    let address = format!("{POD_IP6}/64");
    capture_tests::guards::ip(&["-n", pod, "addr", "add", &address, "dev", "eth0", "nodad"]);
    topo.attach(&["--mode", "ebpf"]);
    let routes = capture_tests::guards::ip(&["-n", pod, "-6", "route", "show", "table", "local"]);
    assert!(routes.contains("local 100::/64 dev lo"), "{routes}");
    assert!(!routes.contains("local ::1 dev eth0"), "{routes}");
    let topo_up = Topology::new();
    topo_up.attach(&["--mode", "ebpf"]);
    let routes = capture_tests::guards::ip(&[
        "-n",
        topo_up.pod.netns.name.as_str(),
        "-6",
        "route",
        "show",
        "table",
        "local",
    ]);
    assert!(routes.contains("local ::1 dev eth0"), "{routes}");
}
