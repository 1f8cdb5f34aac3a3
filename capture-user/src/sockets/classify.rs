//! From observed sockets to connections: which end of what each socket is, which sockets are the
//! two ends of one connection, and the decision the pod's configuration gives for it. Pure, so
//! the tests can feed it what a netns would hold.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use capture_common::state::{
    SockState, SOCK_ACCEPTED_REDIRECTED, SOCK_CREATOR_KNOWN, SOCK_INBOUND_LISTENER,
};

use super::{Connection, Holder, Kind, Listener};
use crate::{
    config::CaptureConfig,
    explain::{decide, Direction, Proto, Question},
    record::{Mode, PodSelector},
    sockdiag::{state_name, KernelSocket, TCP_TIME_WAIT},
};

/// One socket of the pod as the kernel and its holder's descriptor show it.
#[derive(Clone, Debug)]
pub struct Observed {
    pub kernel: KernelSocket,
    pub holder: Option<Holder>,
    pub fs_gid: Option<u32>,
    /// `getsockname` and `getpeername` through the holder's descriptor.
    pub app_local: Option<SocketAddr>,
    pub app_remote: Option<SocketAddr>,
    /// What the kernel programs recorded for the socket (ebpf backend).
    pub state: Option<SockState>,
    /// The `SO_ORIGINAL_DST` answer, asked of the proxy's ends only.
    pub original: Option<SocketAddr>,
}

impl Observed {
    /// A socket no process holds (or whose holder could not be asked).
    #[must_use]
    pub fn kernel_only(kernel: KernelSocket) -> Self {
        Self {
            kernel,
            holder: None,
            fs_gid: None,
            app_local: None,
            app_remote: None,
            state: None,
            original: None,
        }
    }

    fn has(&self, flags: u32) -> bool {
        self.state.is_some_and(|s| s.has(flags))
    }

    fn local(&self) -> SocketAddr {
        self.app_local.unwrap_or(self.kernel.local)
    }

    fn remote(&self) -> SocketAddr {
        self.app_remote.unwrap_or(self.kernel.remote)
    }

    /// The owner the decision went by: the creator the programs recorded, else the socket's file
    /// owner and its holder's fs gid.
    fn owner(&self) -> (u32, u32) {
        match self.state {
            Some(s) if s.has(SOCK_CREATOR_KNOWN) => (s.creator_uid, s.creator_gid),
            _ => (self.kernel.uid, self.fs_gid.unwrap_or(self.kernel.uid)),
        }
    }
}

/// Which of the proxy's ends `seen` is, if it is one: accepted on the proxy's outbound or
/// inbound port, or, under the ebpf backend, by the inbound listener for another port of the pod
/// (`sk_lookup`): such sockets keep their destination, and `sock_ops` marks them redirected when
/// they are established (until then they carry the listener's flag).
fn proxy_end_kind(seen: &Observed, cfg: &CaptureConfig) -> Option<Kind> {
    let port = seen.kernel.local.port();
    if seen.kernel.is_listener() {
        None
    } else if port == cfg.outbound_port {
        Some(Kind::ProxyOutbound)
    } else if port == cfg.inbound_port || seen.has(SOCK_INBOUND_LISTENER | SOCK_ACCEPTED_REDIRECTED)
    {
        Some(Kind::ProxyInbound)
    } else {
        None
    }
}

/// Whether `seen` may be the proxy's end of a redirected connection, whose `SO_ORIGINAL_DST` is
/// worth asking.
#[must_use]
pub fn may_be_proxy_end(seen: &Observed, cfg: &CaptureConfig) -> bool {
    proxy_end_kind(seen, cfg).is_some()
}

fn proxy_port(port: u16, cfg: &CaptureConfig) -> Option<&'static str> {
    if port == cfg.outbound_port {
        Some("outbound")
    } else if port == cfg.inbound_port {
        Some("inbound")
    } else {
        None
    }
}

fn kind_of(seen: &Observed, cfg: &CaptureConfig, listeners: &[&Observed]) -> Kind {
    let local = seen.kernel.local;
    if let Some(kind) = proxy_end_kind(seen, cfg) {
        kind
    } else if listeners.iter().any(|l| {
        l.kernel.local.port() == local.port()
            && (l.kernel.local.ip().is_unspecified() || l.kernel.local.ip() == local.ip())
    }) {
        Kind::Inbound
    } else {
        Kind::Outbound
    }
}

/// The sockets of the pod by their ends, to find each one's other end in one lookup.
struct Ends {
    /// (local, remote) → position, every socket but the listeners.
    by_ends: HashMap<(SocketAddr, SocketAddr), usize>,
    /// (remote, original destination) → position, the sockets that have an original destination.
    by_original: HashMap<(SocketAddr, SocketAddr), usize>,
}

impl Ends {
    fn new(all: &[Observed]) -> Self {
        let mut ends = Self {
            by_ends: HashMap::with_capacity(all.len()),
            by_original: HashMap::new(),
        };
        for (i, o) in all
            .iter()
            .enumerate()
            .filter(|(_, o)| !o.kernel.is_listener())
        {
            ends.by_ends
                .entry((o.kernel.local, o.kernel.remote))
                .or_insert(i);
            if let Some(original) = o.original {
                ends.by_original
                    .entry((o.kernel.remote, original))
                    .or_insert(i);
            }
        }
        ends
    }

    /// The position of `all[i]`'s other end in the pod: the socket whose addresses are its own
    /// reversed, or, for the iptables backend's NAT, the proxy's end whose peer is its local
    /// address and whose original destination is its peer (and, from the proxy's end, the app's
    /// socket whose ends are its peer and its original destination).
    fn peer_of(&self, all: &[Observed], i: usize) -> Option<usize> {
        let seen = &all[i];
        let k = &seen.kernel;
        [
            self.by_ends.get(&(k.remote, k.local)),
            self.by_original.get(&(k.local, k.remote)),
            seen.original
                .and_then(|original| self.by_ends.get(&(k.remote, original))),
        ]
        .into_iter()
        .flatten()
        .copied()
        .find(|&p| p != i)
    }
}

/// What the pod's configuration decides for a connection from `owner` to `to`.
fn decision(
    cfg: &CaptureConfig,
    direction: Direction,
    to: SocketAddr,
    from: Option<IpAddr>,
    owner: (u32, u32),
) -> crate::explain::Decision {
    decide(
        cfg,
        &Question {
            // Not read: the configuration is given.
            pod: PodSelector::Netns(PathBuf::new()),
            to,
            from,
            uid: owner.0,
            gid: owner.1,
            proto: Proto::Tcp,
            direction,
            // The socket's container is not known here: judged as the proxy container's.
            outside_proxy_container: false,
        },
    )
}

fn outbound_hook(mode: Mode, ipv6: bool) -> &'static str {
    match (mode, ipv6) {
        (Mode::Ebpf, false) => "connect4",
        (Mode::Ebpf, true) => "connect6",
        (Mode::Iptables, _) => "nat OUTPUT",
        (Mode::Nftables, _) => "inet istio-proxy-nat output",
    }
}

fn inbound_hook(mode: Mode) -> &'static str {
    match mode {
        Mode::Ebpf => "sk_lookup",
        Mode::Iptables => "nat PREROUTING",
        Mode::Nftables => "inet istio-proxy-nat prerouting",
    }
}

/// The pod's connections, its listeners and how many sockets wait in `TIME-WAIT`.
#[must_use]
pub fn classify(
    observed: &[Observed],
    cfg: &CaptureConfig,
    mode: Mode,
) -> (Vec<Connection>, Vec<Listener>, usize) {
    let listeners: Vec<&Observed> = observed.iter().filter(|o| o.kernel.is_listener()).collect();
    let time_wait = observed
        .iter()
        .filter(|o| o.kernel.state == TCP_TIME_WAIT)
        .count();
    let kinds: Vec<Kind> = observed
        .iter()
        .map(|o| kind_of(o, cfg, &listeners))
        .collect();
    let ends = Ends::new(observed);
    let mut connections = Vec::new();
    for (i, (seen, &kind)) in observed.iter().zip(&kinds).enumerate() {
        if seen.kernel.is_listener() || seen.kernel.state == TCP_TIME_WAIT {
            continue;
        }
        let peer_at = ends.peer_of(observed, i);
        let peer = peer_at.map(|p| &observed[p]);
        let peer_kind = peer_at.map(|p| kinds[p]);
        let mut c = Connection {
            kind,
            state: state_name(seen.kernel.state),
            holder: seen.holder.clone(),
            uid: seen.kernel.uid,
            local: seen.local(),
            remote: seen.remote(),
            kernel_local: seen.kernel.local,
            kernel_remote: seen.kernel.remote,
            original_dst: None,
            via_proxy: false,
            hook: None,
            verdict: None,
            port: None,
            rule: None,
            peer: peer.and_then(|p| p.holder.clone()),
            note: None,
            cookie: seen.kernel.cookie,
        };
        match kind {
            Kind::Outbound => {
                let proxy = peer.filter(|_| {
                    matches!(peer_kind, Some(Kind::ProxyOutbound | Kind::ProxyInbound))
                });
                outbound(&mut c, seen, proxy, cfg, mode);
            }
            Kind::ProxyOutbound | Kind::ProxyInbound => proxy_end(&mut c, seen, peer, cfg, mode),
            Kind::Inbound => inbound(&mut c, seen, peer, cfg, mode),
        }
        connections.push(c);
    }
    // Each kind together, the app's connections first.
    connections.sort_by_key(|c| (c.kind, c.local));
    let listeners = listeners
        .into_iter()
        .map(|l| {
            let proxy_port = proxy_port(l.kernel.local.port(), cfg);
            Listener {
                local: l.kernel.local,
                holder: l.holder.clone(),
                uid: l.kernel.uid,
                proxy_port,
                registered: (mode == Mode::Ebpf
                    && proxy_port == Some("inbound")
                    && l.holder.is_some())
                .then(|| l.has(SOCK_INBOUND_LISTENER)),
            }
        })
        .collect();
    (connections, listeners, time_wait)
}

/// A connection the pod opened: through the proxy when its other end is `proxy`'s.
fn outbound(
    c: &mut Connection,
    seen: &Observed,
    proxy: Option<&Observed>,
    cfg: &CaptureConfig,
    mode: Mode,
) {
    let redirected = proxy.is_some();
    let to = seen.remote();
    let decided = decision(
        cfg,
        Direction::Outbound,
        to,
        Some(seen.local().ip()),
        seen.owner(),
    );
    c.original_dst = Some(to);
    c.via_proxy = redirected;
    c.hook = Some(outbound_hook(mode, seen.kernel.ipv6));
    c.rule = Some(decided.rule);
    if let Some(proxy) = proxy {
        c.verdict = Some("redirect");
        c.port = Some(proxy.kernel.local.port());
    } else {
        c.verdict = Some("pass");
    }
    c.note = disagreement(redirected, decided.redirect_to);
}

/// The proxy's end: its original destination, and the decision of the connection it belongs to.
fn proxy_end(
    c: &mut Connection,
    seen: &Observed,
    peer: Option<&Observed>,
    cfg: &CaptureConfig,
    mode: Mode,
) {
    c.via_proxy = true;
    c.verdict = Some("redirect");
    if let Some(app) = peer {
        // Redirected on the way out of the pod (or to its own address): the app's decision.
        let to = app.remote();
        let decided = decision(
            cfg,
            Direction::Outbound,
            to,
            Some(app.local().ip()),
            app.owner(),
        );
        c.original_dst = seen.original.or(Some(to));
        c.hook = Some(outbound_hook(mode, app.kernel.ipv6));
        c.rule = Some(decided.rule);
        c.port = Some(seen.kernel.local.port());
    } else {
        // Arrived from outside: the inbound decision for the port it was going to.
        let to = seen.original.unwrap_or(seen.kernel.local);
        let decided = decision(cfg, Direction::Inbound, to, None, (0, 0));
        c.original_dst = Some(to);
        c.hook = Some(inbound_hook(mode));
        c.rule = Some(decided.rule);
        c.port = Some(cfg.inbound_port);
        c.note = disagreement(true, decided.redirect_to);
    }
}

/// A connection accepted by a listener of the app: from the proxy (its inbound passthrough) or
/// another process of the pod, which no hook decides, or from outside, let through.
fn inbound(
    c: &mut Connection,
    seen: &Observed,
    peer: Option<&Observed>,
    cfg: &CaptureConfig,
    mode: Mode,
) {
    if let Some(opener) = peer {
        let (uid, gid) = opener.owner();
        c.via_proxy = cfg.proxy_uids.contains(&uid)
            || cfg.proxy_gids.contains(&gid)
            || host_proxy(cfg, uid, gid);
        return;
    }
    let decided = decision(cfg, Direction::Inbound, seen.kernel.local, None, (0, 0));
    c.hook = Some(inbound_hook(mode));
    c.verdict = Some("pass");
    c.rule = Some(decided.rule);
    c.note = disagreement(false, decided.redirect_to);
}

/// Whether the node-side ids of a user-namespaced pod's proxy are `uid` or `gid`.
fn host_proxy(cfg: &CaptureConfig, uid: u32, gid: u32) -> bool {
    cfg.host_ids
        .as_ref()
        .is_some_and(|h| h.proxy_uids.contains(&uid) || h.proxy_gids.contains(&gid))
}

/// Why what happened differs from what the configuration says, if it does.
fn disagreement(redirected: bool, today: Option<u16>) -> Option<String> {
    match (redirected, today) {
        (true, None) => Some(
            "went through the proxy, but the pod's configuration lets it pass now: it was decided before a configuration change".into(),
        ),
        (false, Some(port)) => Some(format!(
            "not through the proxy, but the pod's configuration sends such connections to {port}: it was opened before capture was in force (adoption leaves open connections alone) or under another configuration"
        )),
        _ => None,
    }
}
