//! `cgroup/connect4/6` and `cgroup/sendmsg4/6`: the outbound decision, and the rewrite to the
//! proxy. TCP connects are decided always; UDP only towards port 53 (DNS capture), on connect for
//! connected sockets and on sendmsg for unconnected ones.
//!
//! Fail closed: a connection that should be decided but cannot be (no pod config for this netns,
//! no socket storage to remember the original destination) is refused, never passed uncaptured.

use aya_ebpf::{
    bindings::{bpf_sock, sockaddr},
    helpers::generated::{
        bpf_bind, bpf_get_current_cgroup_id, bpf_get_current_uid_gid, bpf_get_netns_cookie,
    },
    programs::SockAddrContext,
    EbpfContext as _,
};
use capture_common::{
    addr::{is_loopback4, unmap, v4_mapped},
    config::{
        NodeError, PodConfig, PodCounter, FLAG_ACCELERATE, FLAG_HAS_POD_IP4, FLAG_HAS_POD_IP6,
        FLAG_PROXY_BY_CONTAINER, FLAG_STATELESS6, PROXY_CONTAINER_KNOWN, PROXY_CONTAINER_NONE,
    },
    decision::{
        outbound_rule, spread_loopback4, Connect, OutboundRule, Pass, Verdict, DNS_PORT,
        LOCALHOST4, LOOPBACK6,
    },
    loopback::address6,
    state::{OriginalDst, SockState, SOCK_CREATOR_KNOWN, SOCK_DNS_SENT, SOCK_REDIRECTED},
    trace::{TraceHook, TraceVerdict},
    AF_INET, AF_INET6, SOCK_DGRAM, SOCK_STREAM,
};

use crate::{
    counters::{bump_node, bump_pod},
    creator, loopback,
    maps::{MapLists, POD_CONFIGS},
    sockaddr::{sock_addr, SockAddr, SockaddrIn, SockaddrIn6},
    storage, trace,
};

/// Why a connection was refused.
pub enum ConnectError {
    UnknownPod,
    NoSocketStorage,
    /// The proxy's ids asked for their exemption before the pod's proxy container was known.
    ProxyContainerUnknown,
}

/// Which hook decides.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Connect,
    Sendmsg,
}

/// Where a redirected connection or datagram goes instead.
struct Redirect {
    port: u16,
    /// Bind the socket to this pod address first (IPv4 in word 0), so that the proxy sees the pod
    /// IP as its peer and the app its pod IP as local address, as with iptables, which picks the
    /// source before it rewrites the destination.
    bind_to: Option<[u32; 4]>,
    /// An IPv4 TCP connect: it may go to a loopback address of its own (`spread_loopback4`).
    spreadable: bool,
    /// The original destination (IPv4 in word 0) and port.
    orig: [u32; 4],
    orig_port: u16,
    /// The stateless redirect's slot address for the destination (`loopback`; an IPv6
    /// connection goes to its twin): the socket keeps no state, the address says where it was
    /// going.
    stateless: Option<u32>,
}

/// The socket's owner as iptables' `-m owner` sees it, where it is not read from the socket
/// itself (`creator`): its creator's uid and primary gid, recorded by `sock_create`; for a socket
/// created before capture was attached, the caller's.
#[inline(always)]
fn owner(state: &SockState) -> (u32, u32) {
    if state.has(SOCK_CREATOR_KNOWN) {
        (state.creator_uid, state.creator_gid)
    } else {
        // SAFETY: a plain helper call.
        let ids = unsafe { bpf_get_current_uid_gid() };
        (ids as u32, (ids >> 32) as u32)
    }
}

/// Is the calling task outside the pod's proxy container? `Some(false)` without proxy identity
/// by container (the ids alone decide), `None` while the proxy container is not known yet.
///
/// The connecting task is judged, not the socket's creator: a proxy socket handed to another
/// container is that container's when it connects. The task's own cgroup must be the proxy
/// container's, as the runtime placed it: a cgroup the container made below its own is not it.
#[inline(always)]
fn outside_proxy_container(cfg: &PodConfig) -> Option<bool> {
    if !cfg.has(FLAG_PROXY_BY_CONTAINER) {
        return Some(false);
    }
    match cfg.proxy_container {
        PROXY_CONTAINER_KNOWN => {
            // SAFETY: a plain helper call, allowed in sock_addr programs since 5.7.
            let id = unsafe { bpf_get_current_cgroup_id() };
            Some(id != cfg.proxy_cgroup_id)
        }
        PROXY_CONTAINER_NONE => Some(true),
        _ => None,
    }
}

#[inline(always)]
fn counter_for(verdict: Verdict) -> PodCounter {
    match verdict {
        Verdict::Outbound => PodCounter::RedirectedOutbound,
        Verdict::Inbound => PodCounter::RedirectedInbound,
        Verdict::Dns => PodCounter::RedirectedDns,
        Verdict::Pass(Pass::Owner) => PodCounter::PassedOwner,
        Verdict::Pass(Pass::Local | Pass::InboundPassthroughSource) => PodCounter::PassedLocal,
        Verdict::Pass(
            Pass::ExcludedPort
            | Pass::ExcludedCidr
            | Pass::NotIncluded
            | Pass::FamilyNotCaptured
            | Pass::OwnerGroup
            | Pass::NotTcp,
        ) => PodCounter::PassedExcluded,
    }
}

/// The pod's own address in the connection's family, if it has one.
#[inline(always)]
fn pod_address(cfg: &PodConfig, ipv6: bool) -> Option<[u32; 4]> {
    if ipv6 {
        cfg.has(FLAG_HAS_POD_IP6).then_some(cfg.pod_ip6)
    } else {
        cfg.has(FLAG_HAS_POD_IP4).then_some([cfg.pod_ip4, 0, 0, 0])
    }
}

#[inline(always)]
fn port_of(user_port: u32) -> u16 {
    u16::from_be(user_port as u16)
}

/// Is this call one capture decides? `Some(udp)` if so: every TCP connect, and UDP to port 53.
#[inline(always)]
fn admitted(sa: SockAddr, call: Call) -> Option<bool> {
    match sa.sock_type() {
        SOCK_STREAM if call == Call::Connect => Some(false),
        SOCK_DGRAM if port_of(sa.user_port()) == DNS_PORT => Some(true),
        _ => None,
    }
}

/// The socket's storage, created if it has none; a socket the kernel cannot give any is
/// refused, since its original destination could not be kept.
#[inline(always)]
fn storage_of(
    netns_cookie: u64,
    sk: *mut bpf_sock,
) -> Result<&'static mut SockState, ConnectError> {
    storage::get_or_create(sk.cast()).ok_or_else(|| {
        bump_pod(netns_cookie, PodCounter::Errors);
        ConnectError::NoSocketStorage
    })
}

/// A socket may connect again after a failed attempt: an earlier stateful rewrite no longer
/// answers for it (`state` is its storage if the caller holds it already).
#[inline(always)]
fn forget_redirect(state: Option<&mut SockState>, sk: *mut bpf_sock) {
    if let Some(state) = state.or_else(|| storage::get(sk.cast())) {
        state.flags &= !SOCK_REDIRECTED;
    }
}

/// Tells `capture trace` of the decision, if the pod is traced. `v4_hook`: the IPv4 program runs
/// (a v4-mapped connection is decided as IPv4 by the IPv6 program).
#[inline(always)]
fn trace_decision(
    netns_cookie: u64,
    conn: &Connect,
    call: Call,
    v4_hook: bool,
    rule: OutboundRule,
    redirect_port: u16,
) {
    let hook = match (call, v4_hook) {
        (Call::Connect, true) => TraceHook::Connect4,
        (Call::Connect, false) => TraceHook::Connect6,
        (Call::Sendmsg, true) => TraceHook::Sendmsg4,
        (Call::Sendmsg, false) => TraceHook::Sendmsg6,
    };
    let verdict = if redirect_port == 0 {
        TraceVerdict::Pass
    } else {
        TraceVerdict::Redirect
    };
    trace::record(netns_cookie, true, || trace::Decision {
        hook,
        inbound: false,
        ipv6: conn.ipv6,
        udp: conn.udp,
        src: conn.src,
        src_port: 0,
        dst: conn.dst,
        dst_port: conn.dst_port,
        uid: conn.uid,
        gid: conn.gid,
        rule: rule as u8,
        verdict,
        redirect_port,
    });
}

/// Decides one connect or datagram and records the original destination; `Ok(None)` lets it
/// through unchanged. `v4_hook`: the IPv4 program runs (the IPv6 one decides a v4-mapped
/// connection as IPv4).
#[inline(always)]
#[expect(
    clippy::too_many_lines,
    reason = "the decision in the order the kernel runs it; a split is a new program for the verifier on every kernel of the matrix"
)]
fn decide(
    ctx: &SockAddrContext,
    sk: *mut bpf_sock,
    mut conn: Connect,
    call: Call,
    v4_hook: bool,
) -> Result<Option<Redirect>, ConnectError> {
    // SAFETY: sock_addr programs may ask for their netns cookie (5.7+).
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: the entry is a plain value, read while the program runs.
    let cfg: &PodConfig =
        unsafe { POD_CONFIGS.get(netns_cookie) }.ok_or(ConnectError::UnknownPod)?;
    // A TCP socket's owner is read from the socket where the kernel allows it; only a socket
    // that is redirected then needs storage (for its original destination).
    let file_owner = if !conn.udp && creator::from_file() {
        creator::tcp_owner(sk.cast())
    } else {
        None
    };
    let mut state = None;
    (conn.uid, conn.gid) = match file_owner {
        Some(ids) => ids,
        None => owner(state.insert(storage_of(netns_cookie, sk)?)),
    };

    let identity = outside_proxy_container(cfg);
    conn.outside_proxy_container = identity.unwrap_or(false);
    let lists = MapLists { netns_cookie };
    let rule = outbound_rule(cfg, &lists, &conn);
    // Before the proxy container is known, the proxy's ids decide only where the app's would
    // decide the same (its localhost, an excluded port): exempting could pass another container
    // around the proxy, capturing could send the proxy to itself.
    if identity.is_none() && rule.by_proxy_owner() {
        let as_app = Connect {
            outside_proxy_container: true,
            ..conn
        };
        if outbound_rule(cfg, &lists, &as_app).verdict() != rule.verdict() {
            bump_pod(netns_cookie, PodCounter::Errors);
            return Err(ConnectError::ProxyContainerUnknown);
        }
    }
    let verdict = rule.verdict();
    bump_pod(netns_cookie, counter_for(verdict));
    let port = match verdict {
        Verdict::Outbound => cfg.outbound_port,
        Verdict::Inbound => cfg.inbound_port,
        Verdict::Dns => cfg.dns_port,
        Verdict::Pass(_) => 0,
    };
    trace_decision(netns_cookie, &conn, call, v4_hook, rule, port);
    if matches!(verdict, Verdict::Pass(_)) {
        if call == Call::Connect {
            forget_redirect(state, sk);
        }
        return Ok(None);
    }

    // Only TCP sockets are bound: a UDP socket bound without a port would not be given one.
    // A loopback destination keeps its loopback source, as routing would pick it.
    let dst_is_loopback = if conn.ipv6 {
        conn.dst == LOOPBACK6
    } else {
        u32::from_be(conn.dst[0]) >> 24 == 127
    };
    let unbound = conn.src == [0; 4];
    let bind_to = if !conn.udp && unbound && !dst_is_loopback {
        pod_address(cfg, conn.ipv6)
    } else {
        None
    };
    // The stateless redirect binds nothing and keeps the connection on loopback addresses: the
    // kernel gives an unbound socket the loopback source of its route (IPv6: the preferred
    // source `::1` of attach's route of `100::/64`; without it the kernel would pick `::6`), and
    // getsockname and getpeername report the pod address for it (peer.rs). So both ends'
    // routes stay on `lo`, where the kernel caches them; the pod address as the proxy's peer is
    // a local route of the pod's interface, which it would build and free per connection,
    // twice. A socket whose own source
    // is a loopback address (bound so, or for a loopback destination) keeps the stateful path,
    // so that a loopback peer on the stateless range always stands for the pod address. A
    // v4-mapped connection keeps it too.
    let own_loopback_source = if conn.ipv6 {
        conn.src == LOOPBACK6
    } else {
        is_loopback4(conn.src[0])
    };
    let source_unambiguous = bind_to.is_some() || (!unbound && !own_loopback_source);
    let family_served = if conn.ipv6 {
        !v4_hook && cfg.has(FLAG_STATELESS6)
    } else {
        v4_hook
    };
    let stateless = family_served
        && file_owner.is_some()
        && verdict == Verdict::Outbound
        && call == Call::Connect
        && !conn.udp
        && source_unambiguous
        && loopback::enabled()
        && !cfg.has(FLAG_ACCELERATE);
    let orig = OriginalDst {
        addr: conn.dst,
        port: conn.dst_port,
        family: if conn.ipv6 { AF_INET6 } else { AF_INET },
    };
    if stateless {
        if let Some(addr) = loopback::address_for(ctx, netns_cookie, &orig, port) {
            forget_redirect(state, sk);
            return Ok(Some(Redirect {
                port,
                bind_to: None,
                spreadable: false,
                orig: conn.dst,
                orig_port: conn.dst_port,
                stateless: Some(addr),
            }));
        }
    }

    let state = match state {
        Some(state) => state,
        None => storage_of(netns_cookie, sk)?,
    };
    state.orig = orig;
    state.netns_cookie = netns_cookie;
    state.redirected_port = port;
    state.flags |= if call == Call::Connect {
        SOCK_REDIRECTED
    } else {
        SOCK_DNS_SENT
    };

    Ok(Some(Redirect {
        port,
        bind_to,
        spreadable: call == Call::Connect && !conn.udp && !conn.ipv6,
        orig: conn.dst,
        orig_port: conn.dst_port,
        stateless: None,
    }))
}

/// Where an IPv4 redirect goes: the destination's own loopback address if a listener of the
/// proxy's port takes it (a wildcard listener, as Envoy's), else 127.0.0.1 as with iptables. The
/// listener is looked up, not assumed, so a proxy bound to 127.0.0.1 alone keeps working.
#[inline(always)]
fn loopback_target(ctx: &SockAddrContext, redirect: &Redirect) -> u32 {
    if !redirect.spreadable {
        return LOCALHOST4;
    }
    let candidate = spread_loopback4(redirect.orig[0], redirect.orig_port);
    if loopback::listener_takes(ctx, candidate, redirect.port) {
        candidate
    } else {
        LOCALHOST4
    }
}

/// Binds the socket's source address (the port is left to `connect()`). A failure only costs the
/// peer-address parity, not capture, so it is ignored.
///
/// The sockaddr is built in a `u64` buffer with one volatile store per word and field: built as a
/// struct or a zeroed array, its zeroing becomes a memset call, which BPF does not have ("number
/// of funcs in `func_info` doesn't match number of subprogs").
#[inline(always)]
#[expect(
    clippy::cast_ptr_alignment,
    reason = "the buffer is a [u64; 4], 8-byte aligned, and each store's offset is a multiple of its type's alignment"
)]
fn bind_source(ctx: &SockAddrContext, ipv6: bool, addr: [u32; 4]) {
    let mut buf = core::mem::MaybeUninit::<[u64; 4]>::uninit();
    let p = buf.as_mut_ptr().cast::<u8>();
    // SAFETY: every store is inside the 32-byte buffer, which is fully zeroed first; bpf_bind
    // reads `len` bytes of it, is permitted in connect programs, and defers the port to connect().
    unsafe {
        for i in 0..4 {
            core::ptr::write_volatile(p.cast::<u64>().add(i), 0);
        }
        let len = if ipv6 {
            // sockaddr_in6: family at 0, port at 2 (0), flowinfo at 4 (0), address at 8.
            core::ptr::write_volatile(p.cast::<u16>(), AF_INET6);
            for (i, word) in addr.iter().enumerate() {
                core::ptr::write_volatile(p.add(8 + 4 * i).cast::<u32>(), *word);
            }
            size_of::<SockaddrIn6>()
        } else {
            // sockaddr_in: family at 0, port at 2 (0), address at 4.
            core::ptr::write_volatile(p.cast::<u16>(), AF_INET);
            core::ptr::write_volatile(p.add(4).cast::<u32>(), addr[0]);
            size_of::<SockaddrIn>()
        };
        let _ = bpf_bind(ctx.sock_addr, p.cast::<sockaddr>(), len as i32);
    }
}

/// `connect4` and `sendmsg4`.
#[inline(always)]
pub fn try_outbound4(ctx: &SockAddrContext, call: Call) -> Result<(), ConnectError> {
    let sa = sock_addr(ctx);
    let Some(udp) = admitted(sa, call) else {
        return Ok(());
    };
    let sk = sa.sk();
    // SAFETY: `sk` is the context's socket, never null in sock_addr programs.
    let src = unsafe { (*sk).src_ip4 };
    let conn = Connect {
        ipv6: false,
        dst: [sa.user_ip4(), 0, 0, 0],
        dst_port: port_of(sa.user_port()),
        src: [src, 0, 0, 0],
        uid: 0,
        gid: 0,
        udp,
        outside_proxy_container: false,
    };
    let Some(redirect) = decide(ctx, sk, conn, call, true)? else {
        return Ok(());
    };
    if let Some(addr) = redirect.bind_to {
        bind_source(ctx, false, addr);
    }
    let to = match redirect.stateless {
        Some(addr) => addr,
        None => loopback_target(ctx, &redirect),
    };
    let sa = sock_addr(ctx);
    sa.set_user_ip4(to);
    sa.set_port(redirect.port);
    Ok(())
}

/// `connect6` and `sendmsg6`, including v4-mapped destinations on dual-stack sockets: the kernel
/// runs no IPv4 program for those, so they get the IPv4 decision here and stay v4-mapped.
#[inline(always)]
pub fn try_outbound6(ctx: &SockAddrContext, call: Call) -> Result<(), ConnectError> {
    let sa = sock_addr(ctx);
    let Some(udp) = admitted(sa, call) else {
        return Ok(());
    };
    let sk = sa.sk();
    let dst = sa.user_ip6();
    // SAFETY: as in try_outbound4.
    let src = unsafe {
        [
            (*sk).src_ip6[0],
            (*sk).src_ip6[1],
            (*sk).src_ip6[2],
            (*sk).src_ip6[3],
        ]
    };
    let mapped = unmap(&dst);
    let dst_port = port_of(sa.user_port());
    let conn = if let Some(dst4) = mapped {
        let src4 = unmap(&src).unwrap_or(0);
        Connect {
            ipv6: false,
            dst: [dst4, 0, 0, 0],
            src: [src4, 0, 0, 0],
            dst_port,
            uid: 0,
            gid: 0,
            udp,
            outside_proxy_container: false,
        }
    } else {
        Connect {
            ipv6: true,
            dst,
            src,
            dst_port,
            uid: 0,
            gid: 0,
            udp,
            outside_proxy_container: false,
        }
    };
    let Some(redirect) = decide(ctx, sk, conn, call, false)? else {
        return Ok(());
    };
    let (to, bind) = match (mapped, redirect.stateless) {
        (Some(_), _) => (
            v4_mapped(loopback_target(ctx, &redirect)),
            redirect.bind_to.map(|a| v4_mapped(a[0])),
        ),
        (None, Some(slot)) => (address6(slot), redirect.bind_to),
        (None, None) => (LOOPBACK6, redirect.bind_to),
    };
    if let Some(addr) = bind {
        bind_source(ctx, true, addr);
    }
    let sa = sock_addr(ctx);
    sa.set_user_ip6(to);
    sa.set_port(redirect.port);
    Ok(())
}

/// Maps a refusal to its node counter; the caller returns the "reject" verdict. A refusal for an
/// unknown proxy container is the pod's alone, counted in its `errors`.
#[inline(always)]
pub fn record_refusal(err: &ConnectError) {
    bump_node(match err {
        ConnectError::UnknownPod => NodeError::UnknownPod,
        ConnectError::NoSocketStorage => NodeError::NoSocketStorage,
        ConnectError::ProxyContainerUnknown => return,
    });
}
