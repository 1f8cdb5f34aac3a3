//! What `classify` makes of the sockets a pod's netns holds under each backend's redirects.

use std::net::SocketAddr;

use capture_common::state::{SockState, SOCK_ACCEPTED_REDIRECTED, SOCK_INBOUND_LISTENER};

use super::*;
use crate::{
    config::{CaptureConfig, PodSpec, ANN_EXCLUDE_OUTBOUND_PORTS},
    sockdiag::{KernelSocket, TCP_LISTEN},
};

const ESTAB: u8 = 1;

fn cfg(annotations: &[(&str, &str)]) -> CaptureConfig {
    CaptureConfig::from_pod(&PodSpec::of_annotations(&["10.0.0.5"], annotations)).unwrap()
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A socket with its kernel addresses, held by `command` (pid = cookie) as uid `uid`.
fn socket(cookie: u64, state: u8, local: &str, remote: &str, uid: u32, command: &str) -> Observed {
    let mut seen = Observed::kernel_only(KernelSocket {
        cookie,
        inode: cookie,
        state,
        local: addr(local),
        remote: addr(remote),
        uid,
        ipv6: false,
    });
    seen.holder = Some(Holder {
        pid: u32::try_from(cookie).unwrap(),
        command: command.into(),
    });
    seen.fs_gid = Some(uid);
    seen
}

fn app_view(mut seen: Observed, local: &str, remote: &str) -> Observed {
    seen.app_local = Some(addr(local));
    seen.app_remote = Some(addr(remote));
    seen
}

fn listener(cookie: u64, local: &str, uid: u32, command: &str) -> Observed {
    socket(cookie, TCP_LISTEN, local, "0.0.0.0:0", uid, command)
}

fn by_cookie(connections: &[Connection], cookie: u64) -> &Connection {
    connections
        .iter()
        .find(|c| c.cookie == cookie)
        .unwrap_or_else(|| panic!("no connection {cookie} in {connections:#?}"))
}

#[test]
fn a_stateless_redirect_pairs_the_apps_socket_with_the_proxys() {
    let observed = vec![
        listener(1, "0.0.0.0:15001", 1337, "envoy"),
        app_view(
            socket(2, ESTAB, "127.2.0.9:40000", "127.2.0.9:15001", 0, "curl"),
            "10.0.0.5:40000",
            "10.96.0.1:80",
        ),
        Observed {
            original: Some(addr("10.96.0.1:80")),
            ..socket(
                3,
                ESTAB,
                "127.2.0.9:15001",
                "127.2.0.9:40000",
                1337,
                "envoy",
            )
        },
    ];
    let (connections, listeners, _) = classify(&observed, &cfg(&[]), Mode::Ebpf);
    let app = by_cookie(&connections, 2);
    assert_eq!(app.kind, Kind::Outbound);
    assert!(app.via_proxy);
    assert_eq!((app.verdict, app.port), (Some("redirect"), Some(15001)));
    assert_eq!(app.hook, Some("connect4"));
    assert_eq!(app.rule, Some("include-all-outbound"));
    assert_eq!(app.remote, addr("10.96.0.1:80"));
    assert_eq!(app.kernel_remote, addr("127.2.0.9:15001"));
    assert_eq!(app.peer.as_ref().map(|p| p.command.as_str()), Some("envoy"));
    assert_eq!(app.note, None);
    let proxy = by_cookie(&connections, 3);
    assert_eq!(proxy.kind, Kind::ProxyOutbound);
    assert_eq!(proxy.original_dst, Some(addr("10.96.0.1:80")));
    assert_eq!(proxy.rule, Some("include-all-outbound"));
    assert_eq!(
        proxy.peer.as_ref().map(|p| p.command.as_str()),
        Some("curl")
    );
    assert_eq!(listeners.len(), 1);
    assert_eq!(listeners[0].proxy_port, Some("outbound"));
}

#[test]
fn an_iptables_redirect_is_paired_through_the_proxys_original_destination() {
    let observed = vec![
        socket(2, ESTAB, "10.0.0.5:40000", "10.96.0.1:80", 0, "curl"),
        Observed {
            original: Some(addr("10.96.0.1:80")),
            ..socket(3, ESTAB, "127.0.0.1:15001", "10.0.0.5:40000", 1337, "envoy")
        },
        // Another connection of the app from the same local port, elsewhere and not redirected.
        socket(4, ESTAB, "10.0.0.5:40000", "10.96.0.2:22", 0, "curl"),
    ];
    let c = cfg(&[(ANN_EXCLUDE_OUTBOUND_PORTS, "22")]);
    let (connections, _, _) = classify(&observed, &c, Mode::Iptables);
    let app = by_cookie(&connections, 2);
    assert!(app.via_proxy, "{app:#?}");
    assert_eq!(
        app.port,
        Some(15001),
        "the proxy's port, not the destination's"
    );
    assert_eq!(app.hook, Some("nat OUTPUT"));
    let proxy = by_cookie(&connections, 3);
    assert_eq!(proxy.peer.as_ref().map(|p| p.pid), Some(2));
    assert_eq!(proxy.original_dst, Some(addr("10.96.0.1:80")));
    let excluded = by_cookie(&connections, 4);
    assert!(!excluded.via_proxy);
    assert_eq!(excluded.verdict, Some("pass"));
    assert_eq!(excluded.rule, Some("exclude-outbound-port"));
    assert_eq!(excluded.note, None);
}

#[test]
fn a_connection_opened_before_capture_says_so() {
    let observed = vec![socket(
        2,
        ESTAB,
        "10.0.0.5:40000",
        "10.96.0.1:80",
        0,
        "curl",
    )];
    let (connections, _, _) = classify(&observed, &cfg(&[]), Mode::Ebpf);
    let c = &connections[0];
    assert!(!c.via_proxy);
    assert_eq!(c.rule, Some("include-all-outbound"));
    assert!(
        c.note
            .as_deref()
            .is_some_and(|n| n.contains("before capture")),
        "{c:#?}"
    );
}

#[test]
fn inbound_through_the_proxy_and_its_passthrough_to_the_app() {
    let inherited = SockState {
        flags: SOCK_INBOUND_LISTENER,
        ..SockState::default()
    };
    let observed = vec![
        Observed {
            state: Some(inherited),
            ..listener(1, "0.0.0.0:15006", 1337, "envoy")
        },
        listener(5, "0.0.0.0:8080", 0, "app"),
        Observed {
            state: Some(SockState {
                flags: SOCK_ACCEPTED_REDIRECTED,
                ..SockState::default()
            }),
            original: Some(addr("10.0.0.5:8080")),
            ..socket(2, ESTAB, "10.0.0.5:8080", "10.0.0.9:5555", 1337, "envoy")
        },
        socket(3, ESTAB, "127.0.0.6:6000", "10.0.0.5:8080", 1337, "envoy"),
        socket(4, ESTAB, "10.0.0.5:8080", "127.0.0.6:6000", 0, "app"),
    ];
    let (connections, listeners, _) = classify(&observed, &cfg(&[]), Mode::Ebpf);
    let captured = by_cookie(&connections, 2);
    assert_eq!(captured.kind, Kind::ProxyInbound);
    assert_eq!(
        (captured.verdict, captured.port),
        (Some("redirect"), Some(15006))
    );
    assert_eq!(captured.hook, Some("sk_lookup"));
    assert_eq!(captured.rule, Some("include-all-inbound"));
    assert_eq!(captured.original_dst, Some(addr("10.0.0.5:8080")));
    let passthrough = by_cookie(&connections, 3);
    assert_eq!(passthrough.kind, Kind::Outbound);
    assert_eq!(passthrough.rule, Some("inbound-passthrough-source"));
    assert_eq!(passthrough.verdict, Some("pass"));
    let accepted = by_cookie(&connections, 4);
    assert_eq!(accepted.kind, Kind::Inbound);
    assert!(accepted.via_proxy, "opened by the proxy");
    assert_eq!((accepted.hook, accepted.rule), (None, None));
    let inbound = listeners.iter().find(|l| l.proxy_port == Some("inbound"));
    assert_eq!(inbound.and_then(|l| l.registered), Some(true));
    let app = listeners.iter().find(|l| l.local.port() == 8080);
    assert_eq!(app.map(|l| l.registered), Some(None));
}

#[test]
fn an_unregistered_inbound_listener_is_flagged_and_rendered() {
    let observed = vec![listener(1, "0.0.0.0:15006", 1337, "envoy")];
    let (connections, listeners, _) = classify(&observed, &cfg(&[]), Mode::Ebpf);
    assert_eq!(listeners[0].registered, Some(false));
    let text = render::render(&Report {
        pod: "default/web".into(),
        netns: "/run/netns/web".into(),
        backend: Mode::Ebpf,
        connections,
        listeners,
        time_wait: 0,
        notes: Vec::new(),
    });
    assert!(text.contains("NOT known to the programs"), "{text}");
}
