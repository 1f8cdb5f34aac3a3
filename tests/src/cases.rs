//! Table-driven connection cases: who connects where, and where it must land.

use crate::{
    probe::{ip_of, ConnectOpts, Outcome, Who},
    topology::{Topology, POD_IP4, POD_IP6},
};

/// Where a connection must land.
#[derive(Clone, Debug)]
pub enum Expect {
    /// Accepted by the proxy's outbound listener (15001) with this `SO_ORIGINAL_DST`.
    Outbound(&'static str),
    /// Accepted by the proxy's inbound listener (15006) with this `SO_ORIGINAL_DST`.
    Inbound(&'static str),
    /// Reached the remote netns directly, at this address.
    Remote(&'static str),
    /// Reached the pod's own app listener directly.
    App,
    /// Refused with this errno name.
    Refused(&'static str),
    /// Captured DNS: answered by the DNS proxy (15053); over UDP the reply comes from this
    /// address, over TCP it is the proxy's `SO_ORIGINAL_DST`.
    Dns(&'static str),
    /// A connection from outside the pod accepted by the inbound listener with this
    /// `SO_ORIGINAL_DST`. By design the listener's local address differs: the original
    /// destination under ebpf (`sk_lookup`, no NAT), `pod IP:15006` under iptables (REDIRECT).
    Captured(&'static str),
}

/// The backend a case runs against, where outcomes differ by design.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Ebpf,
    Iptables,
    Nftables,
}

impl Backend {
    pub const ALL: [Self; 2] = [Self::Iptables, Self::Ebpf];
    /// Every backend, for the tests that hold each to the iptables path's answers.
    pub const EVERY: [Self; 3] = [Self::Iptables, Self::Nftables, Self::Ebpf];
    #[must_use]
    pub fn mode(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
        }
    }

    /// Whether this run holds this backend to the cases: all of them, unless
    /// `CAPTURE_TEST_BACKENDS` (a comma-separated list of modes) names fewer. CI's kernel matrix
    /// names `ebpf` on the kernel whose programs take other paths than the host's: the rule
    /// backends' answers there are the kernel's netfilter, which the whole matrix checks.
    #[must_use]
    pub fn wanted(self) -> bool {
        match std::env::var("CAPTURE_TEST_BACKENDS") {
            Ok(list) => list.split(',').any(|mode| mode.trim() == self.mode()),
            Err(_) => true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Case {
    /// The spec's case id (T01 …) or a short name.
    pub id: &'static str,
    pub who: Who,
    pub to: &'static str,
    pub opts: ConnectOpts,
    pub expect: Expect,
    /// The peer address the accepting listener must see, if the case pins it down.
    pub peer_ip: Option<&'static str>,
    /// The client is outside the pod (the remote netns), not one of the pod's processes.
    pub from_remote: bool,
    /// The client runs in this cgroup below the pod's (a container), not in the pod's own.
    pub cgroup: Option<std::path::PathBuf>,
}

impl Case {
    #[must_use]
    pub fn new(id: &'static str, who: Who, to: &'static str, expect: Expect) -> Self {
        Self {
            id,
            who,
            to,
            opts: ConnectOpts::default(),
            expect,
            peer_ip: None,
            from_remote: false,
            cgroup: None,
        }
    }
    /// A connection from the remote netns to `to`.
    #[must_use]
    pub fn remote(id: &'static str, to: &'static str, expect: Expect) -> Self {
        Self {
            from_remote: true,
            ..Self::new(id, Who::new(0, 0), to, expect)
        }
    }
    #[must_use]
    pub fn opts(mut self, opts: ConnectOpts) -> Self {
        self.opts = opts;
        self
    }
    /// The client runs in `cgroup` (a container's, below the pod's).
    #[must_use]
    pub fn in_cgroup(mut self, cgroup: &std::path::Path) -> Self {
        self.cgroup = Some(cgroup.to_path_buf());
        self
    }
    #[must_use]
    pub fn peer(mut self, ip: &'static str) -> Self {
        self.peer_ip = Some(ip);
        self
    }
}

/// The IP that a pod-originated connection should carry as source, by destination family.
#[must_use]
pub fn pod_ip_for(to: &str) -> &'static str {
    if to.starts_with('[') && !to.starts_with("[::ffff:") {
        POD_IP6
    } else {
        POD_IP4
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "one check per kind of expected outcome, each a few lines, in one place so that every case is judged alike"
)]
fn verify(case: &Case, got: &Outcome, backend: Option<Backend>) -> Result<(), String> {
    let want_server = |name: &str| -> Result<(), String> {
        if !got.ok() {
            return Err(format!(
                "expected {name}, connection failed: {:?}",
                got.error()
            ));
        }
        match got.server() {
            Some(s) if s == name => Ok(()),
            other => Err(format!("expected listener {name}, reached {other:?}")),
        }
    };
    match &case.expect {
        Expect::Outbound(orig) | Expect::Inbound(orig) => {
            let name = if matches!(case.expect, Expect::Outbound(_)) {
                "outbound"
            } else {
                "inbound"
            };
            want_server(name)?;
            if got.orig().as_deref() != Some(*orig) {
                return Err(format!("SO_ORIGINAL_DST {:?}, want {orig}", got.orig()));
            }
            // Both ends agree on the app's end (its getsockname is the proxy's peer), as without
            // NAT on the app's side: the pod address where routing gives it.
            if let Some((local, peer)) = got.ends_disagree() {
                return Err(format!(
                    "app getsockname {local}, but the listener saw peer {peer}"
                ));
            }
            // The app's socket keeps reporting the destination it asked for, as under iptables.
            if case.opts.create_as.is_none()
                && !case.opts.v6_socket
                && got.client_peer().as_deref() != Some(case.to)
            {
                return Err(format!(
                    "app getpeername {:?}, want {}",
                    got.client_peer(),
                    case.to
                ));
            }
        }
        Expect::Remote(addr) => {
            want_server("remote")?;
            if case.opts.udp && got.reply_from().as_deref() != Some(*addr) {
                return Err(format!(
                    "UDP reply from {:?}, want {addr}",
                    got.reply_from()
                ));
            }
            if got.server_local().as_deref() != Some(*addr) {
                return Err(format!(
                    "remote accepted on {:?}, want {addr}",
                    got.server_local()
                ));
            }
        }
        Expect::App => want_server("app")?,
        Expect::Dns(orig) => {
            want_server("dns")?;
            let seen = if case.opts.udp {
                got.reply_from()
            } else {
                got.orig()
            };
            if seen.as_deref() != Some(*orig) {
                let what = if case.opts.udp {
                    "reply from"
                } else {
                    "SO_ORIGINAL_DST"
                };
                return Err(format!("DNS {what} {seen:?}, want {orig}"));
            }
        }
        Expect::Captured(orig) => {
            want_server("inbound")?;
            if got.orig().as_deref() != Some(*orig) {
                return Err(format!("SO_ORIGINAL_DST {:?}, want {orig}", got.orig()));
            }
            let pod_ip = ip_of(orig);
            let want_local = match backend {
                Some(Backend::Iptables | Backend::Nftables) => {
                    Some(std::net::SocketAddr::new(pod_ip.parse().expect("ip"), 15006).to_string())
                }
                Some(Backend::Ebpf) => Some((*orig).to_string()),
                None => None,
            };
            if want_local.is_some() && got.server_local() != want_local {
                return Err(format!(
                    "inbound listener local address {:?}, want {want_local:?}",
                    got.server_local()
                ));
            }
        }
        Expect::Refused(errno) => {
            if got.ok() || got.error().as_deref() != Some(*errno) {
                return Err(format!("expected {errno}, got {:?}", got.0));
            }
        }
    }
    if let Some(ip) = case.peer_ip {
        let seen = got.peer_seen().map(|p| ip_of(&p));
        if seen.as_deref() != Some(ip) {
            return Err(format!("listener saw peer {seen:?}, want {ip}"));
        }
    }
    Ok(())
}

/// One configuration of the parity matrix.
#[derive(Clone, Copy)]
pub struct Scenario<'a> {
    /// Extra `capture attach` arguments (annotations, proxy ids).
    pub args: &'a [&'a str],
    /// The pod's addresses as attach is told them.
    pub pod_ips: &'a [&'a str],
    /// Which servers run (after attach, as in a pod whose containers start after network setup).
    pub start: fn(&mut Topology),
}

impl<'a> Scenario<'a> {
    /// A dual-stack pod with every server running.
    #[must_use]
    pub fn with(args: &'a [&'a str]) -> Self {
        Self {
            args,
            pod_ips: &[POD_IP4, POD_IP6],
            start: Topology::start_all,
        }
    }
}

/// The parity matrix: runs `cases` in `scenario` against each backend in turn, each on a fresh
/// pod, checking the same expectations (and the by-design differences) for both.
pub fn run_matrix(scenario: Scenario<'_>, cases: &[Case]) {
    // ebpf a second time with the app-to-proxy acceleration on, where the kernel's checks allow
    // it: every answer must stay the same.
    for (backend, accelerated) in [
        (Backend::Iptables, false),
        (Backend::Nftables, false),
        (Backend::Ebpf, false),
        (Backend::Ebpf, true),
    ] {
        // No pod made for nothing where the kernel does not accelerate.
        if !backend.wanted() || (accelerated && !crate::accel::kernel_allows()) {
            continue;
        }
        let mut topo = Topology::new();
        if accelerated {
            assert!(crate::accel::allow(&topo), "the kernel's verdict allows it");
        }
        let mut args = vec!["--mode", backend.mode()];
        if accelerated {
            args.extend(["--annotation", "capture.dev/accelerate=true"]);
        }
        args.extend(scenario.args);
        let out = topo.try_attach_with_ips(scenario.pod_ips, &args);
        assert!(
            out.status.success(),
            "{backend:?} attach failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if accelerated {
            let status = topo.status();
            assert_eq!(
                status["pods"][0]["acceleration"]["active"], true,
                "the accelerated run's pod is accelerated: {status}"
            );
        }
        (scenario.start)(&mut topo);
        run_cases_on(&topo, Some(backend), cases);
    }
}

/// Runs every case against the topology and panics listing all that failed.
pub fn run_cases(topo: &Topology, cases: &[Case]) {
    run_cases_on(topo, None, cases);
}

/// As `run_cases`, checking the by-design differences of `backend` too.
pub fn run_cases_on(topo: &Topology, backend: Option<Backend>, cases: &[Case]) {
    // One probe per identity for all the cases, gone before the pod is.
    let probes = crate::probe::Sessions::default();
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let got = if case.from_remote {
                probes.connect(
                    crate::probe::probe_in(&topo.remote.path(), None, None),
                    case.to,
                    &ConnectOpts::default(),
                )
            } else {
                let cgroup = case.cgroup.as_deref().unwrap_or(&topo.pod.cgroup.path);
                probes.connect(topo.probe_in_cgroup(cgroup, &case.who), case.to, &case.opts)
            };
            verify(case, &got, backend).err().map(|e| {
                format!(
                    "{} ({:?} -> {}): {e}\n    saw {}",
                    case.id, case.who, case.to, got.0
                )
            })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The default-sidecar cases of parity-spec.md sections I and E (IPv4, v4-mapped and IPv6), for any backend.
#[must_use]
#[expect(clippy::too_many_lines, reason = "a table: one entry per case")]
pub fn default_sidecar_cases() -> Vec<Case> {
    use Expect::{App, Inbound, Outbound, Refused, Remote};
    let app = Who::app;
    let proxy = Who::proxy;
    let bind = |addr: &str| ConnectOpts {
        bind: Some(addr.into()),
        ..ConnectOpts::default()
    };
    vec![
        Case::new("T01", app(), "10.0.0.5:80", Outbound("10.0.0.5:80")).peer("10.1.0.10"),
        Case::new("T04", proxy(), "10.0.0.5:80", Remote("10.0.0.5:80")),
        Case::new(
            "T05",
            Who::new(2000, 1337),
            "10.0.0.5:80",
            Remote("10.0.0.5:80"),
        ),
        Case::new("T06", app(), "127.0.0.1:9090", App),
        Case::new("T07", app(), "10.1.0.10:8080", App).peer("10.1.0.10"),
        Case::new("T09", proxy(), "10.1.0.10:8080", Inbound("10.1.0.10:8080")).peer("10.1.0.10"),
        Case::new("T11", proxy(), "10.1.0.10:8080", App)
            .opts(bind("127.0.0.6:0"))
            .peer("127.0.0.6"),
        Case::new("T15", proxy(), "127.0.0.2:8080", Inbound("127.0.0.2:8080")).peer("127.0.0.1"),
        // T27/T28: istio-validation's probe, as the proxy and as the app.
        Case::new(
            "T27",
            proxy(),
            "127.0.0.6:15002",
            Inbound("127.0.0.6:15002"),
        )
        .opts(bind("127.0.0.1:0")),
        Case::new("T28", app(), "127.0.0.6:15002", Refused("ECONNREFUSED"))
            .opts(bind("127.0.0.1:0")),
        Case::new("T18", app(), "10.0.0.5:15020", Outbound("10.0.0.5:15020")),
        Case::new("E3 proxy to 127.0.0.1", proxy(), "127.0.0.1:9090", App),
        Case::new("E3 app to other 127/8", app(), "127.0.0.2:9090", App),
        Case::new(
            "E5 proxy to own tunnel port",
            proxy(),
            "10.1.0.10:15008",
            App,
        ),
        Case::new(
            "app to tunnel port elsewhere",
            app(),
            "10.0.0.5:15008",
            Outbound("10.0.0.5:15008"),
        ),
        Case::new(
            "app source 127.0.0.6 to own IP",
            app(),
            "10.1.0.10:8080",
            App,
        )
        .opts(bind("127.0.0.6:0")),
        Case::new(
            "app to 1.1.0.5",
            app(),
            "1.1.0.5:80",
            Outbound("1.1.0.5:80"),
        ),
        Case::new("T83", app(), "10.0.0.5:80", Remote("10.0.0.5:80")).opts(ConnectOpts {
            create_as: Some((1337, 1337)),
            ..ConnectOpts::default()
        }),
        Case::new("T84", proxy(), "10.0.0.5:80", Outbound("10.0.0.5:80")).opts(ConnectOpts {
            create_as: Some((1000, 1000)),
            ..ConnectOpts::default()
        }),
        Case::new(
            "T85",
            Who::app().with_groups(&[1337]),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        ),
        // uid 1337's lo-RETURN rule (B10) passes a gid-only proxy before the gid rules are reached.
        Case::new(
            "gid 1337 to own IP",
            Who::new(2000, 1337),
            "10.1.0.10:8080",
            App,
        ),
        Case::new(
            "v4-mapped on a v6 socket",
            app(),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        )
        .opts(ConnectOpts {
            v6_socket: true,
            ..ConnectOpts::default()
        })
        .peer("10.1.0.10"),
        Case::new("T29", app(), "[fd00:2::5]:80", Outbound("[fd00:2::5]:80")).peer("fd00:1::10"),
        Case::new(
            "v6 proxy direct",
            proxy(),
            "[fd00:2::5]:80",
            Remote("[fd00:2::5]:80"),
        ),
        Case::new("v6 app to ::1", app(), "[::1]:9090", App),
        Case::new("v6 app to own IP", app(), "[fd00:1::10]:8080", App),
        Case::new(
            "v6 proxy to own IP",
            proxy(),
            "[fd00:1::10]:8080",
            Inbound("[fd00:1::10]:8080"),
        )
        .peer("fd00:1::10"),
        Case::new("v6 proxy to ::1", proxy(), "[::1]:9090", App),
        Case::new(
            "v6 proxy to own tunnel port",
            proxy(),
            "[fd00:1::10]:15008",
            App,
        ),
        Case::new(
            "v6 gid 1337",
            Who::new(2000, 1337),
            "[fd00:2::5]:80",
            Remote("[fd00:2::5]:80"),
        ),
        // T32: the inbound passthrough source ::6 (on lo for IPv6 pods) goes direct.
        Case::new("T32", proxy(), "[fd00:1::10]:8080", App)
            .opts(bind("[::6]:0"))
            .peer("::6"),
    ]
}

/// Connections from outside the pod under the default sidecar config (parity-spec.md C inbound, E, I).
#[must_use]
pub fn default_inbound_cases() -> Vec<Case> {
    use Expect::{App, Captured};
    vec![
        Case::remote("T19", "10.1.0.10:8080", Captured("10.1.0.10:8080")).peer("10.1.0.1"),
        Case::remote("T20", "10.1.0.10:15020", App),
        Case::remote("T21", "10.1.0.10:15021", App),
        Case::remote("T22", "10.1.0.10:15090", App),
        Case::remote("T23", "10.1.0.10:15008", App),
        Case::remote("T24", "10.1.0.10:15001", Captured("10.1.0.10:15001")),
        Case::remote("T25", "10.1.0.10:15006", Captured("10.1.0.10:15006")),
        Case::remote("T19 v6", "[fd00:1::10]:8080", Captured("[fd00:1::10]:8080"))
            .peer("fd00:1::1"),
        Case::remote("T20 v6", "[fd00:1::10]:15020", App),
        Case::remote("T23 v6", "[fd00:1::10]:15008", App),
        Case::remote(
            "T24 v6",
            "[fd00:1::10]:15001",
            Captured("[fd00:1::10]:15001"),
        ),
    ]
}
