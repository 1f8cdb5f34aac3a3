//! `cgroup/getpeername4/6`, `cgroup/getsockname4/6` and `cgroup/recvmsg4/6`: the app's redirected
//! socket reports the destination it asked for (from its storage, or from its loopback address
//! for the stateless redirect), both ends of a stateless redirect report the pod address for the
//! app's end (the kernel gave the app's socket a loopback source), and DNS replies from the DNS
//! proxy come from the nameserver the app asked, as they do under iptables (NAT rewrites packets,
//! not the socket).

use aya_ebpf::programs::SockAddrContext;
use capture_common::{
    addr::v4_mapped,
    decision::{LOCALHOST4, LOOPBACK6},
    state::{OriginalDst, SOCK_DNS_SENT, SOCK_REDIRECTED},
    AF_INET,
};

use crate::{
    ends::{ends4, ends6, views},
    loopback,
    sockaddr::sock_addr,
    storage,
};

/// The redirected original destination of the context's socket, if any.
#[inline(always)]
fn redirected_orig(ctx: &SockAddrContext) -> Option<OriginalDst> {
    let sk = sock_addr(ctx).sk();
    let state = storage::get(sk.cast())?;
    state.has(SOCK_REDIRECTED).then_some(state.orig)
}

#[inline(always)]
pub fn on_getpeername4(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let (peer, port) = (sa.user_ip4(), u16::from_be(sa.user_port() as u16));
    // The proxy's socket of a stateless redirect (also what accept() reports): its peer is the app.
    let sk = sa.sk();
    if let Some(pod) =
        ends4(sk).and_then(|e| loopback::pod_address_for(ctx, e.remote, e.local, e.local_port))
    {
        sock_addr(ctx).set_user_ip4(pod);
        return;
    }
    // The app's socket of a stateless redirect: its peer is the proxy's end.
    let Some(orig) = redirected_orig(ctx).or_else(|| loopback::destination_at(ctx, peer, port))
    else {
        return;
    };
    answer4(ctx, &orig);
}

/// Gives `orig` as the address of an IPv4 call (an IPv6 destination cannot be told there).
#[inline(always)]
fn answer4(ctx: &SockAddrContext, orig: &OriginalDst) {
    if orig.family != AF_INET {
        return;
    }
    let sa = sock_addr(ctx);
    sa.set_user_ip4(orig.addr[0]);
    sa.set_port(orig.port);
}

/// Gives `orig` as the address of an IPv6 call, an IPv4 one v4-mapped.
#[inline(always)]
fn answer6(ctx: &SockAddrContext, orig: &OriginalDst) {
    let addr = if orig.family == AF_INET {
        v4_mapped(orig.addr[0])
    } else {
        orig.addr
    };
    let sa = sock_addr(ctx);
    sa.set_user_ip6(addr);
    sa.set_port(orig.port);
}

#[inline(always)]
pub fn on_getpeername6(ctx: &SockAddrContext) {
    // The proxy's socket of a stateless redirect: its peer is the app (v4-mapped on a dual-stack
    // listener's socket).
    let sa = sock_addr(ctx);
    let (peer, port) = (sa.user_ip6(), u16::from_be(sa.user_port() as u16));
    let ends = views(sa.sk());
    if let Some(pod) = ends
        .v4
        .and_then(|e| loopback::pod_address_for(ctx, e.remote, e.local, e.local_port))
    {
        sock_addr(ctx).set_user_ip6(v4_mapped(pod));
        return;
    }
    if let Some(pod) = ends
        .v6
        .and_then(|e| loopback::pod_address6_for(ctx, &e.remote, &e.local, e.local_port))
    {
        sock_addr(ctx).set_user_ip6(pod);
        return;
    }
    // The app's socket of a stateless redirect: its peer is the proxy's end.
    let Some(orig) = redirected_orig(ctx).or_else(|| loopback::destination_at6(ctx, &peer, port))
    else {
        return;
    };
    answer6(ctx, &orig);
}

/// The app's socket of a stateless redirect: its own address is the pod's, as under iptables.
#[inline(always)]
pub fn on_getsockname4(ctx: &SockAddrContext) {
    let sk = sock_addr(ctx).sk();
    if let Some(pod) =
        ends4(sk).and_then(|e| loopback::pod_address_for(ctx, e.local, e.remote, e.remote_port))
    {
        sock_addr(ctx).set_user_ip4(pod);
    }
}

/// The original destination of a redirected UDP socket, if the datagram (from `src`:`port`, as
/// the context reports it) came from where capture sent the socket's queries.
#[inline(always)]
fn dns_reply_origin(ctx: &SockAddrContext, from_proxy: bool, port: u16) -> Option<OriginalDst> {
    let sk = sock_addr(ctx).sk();
    let state = storage::get(sk.cast())?;
    let redirected = state.has(SOCK_DNS_SENT | SOCK_REDIRECTED);
    (redirected && from_proxy && port == state.redirected_port && state.orig.port == 53)
        .then_some(state.orig)
}

#[inline(always)]
pub fn on_recvmsg4(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let port = u16::from_be(sa.user_port() as u16);
    let Some(orig) = dns_reply_origin(ctx, sa.user_ip4() == LOCALHOST4, port) else {
        return;
    };
    answer4(ctx, &orig);
}

#[inline(always)]
pub fn on_recvmsg6(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let from = sa.user_ip6();
    let mapped_localhost = v4_mapped(LOCALHOST4);
    let from_proxy = from == LOOPBACK6 || from == mapped_localhost;
    let port = u16::from_be(sa.user_port() as u16);
    let Some(orig) = dns_reply_origin(ctx, from_proxy, port) else {
        return;
    };
    answer6(ctx, &orig);
}

/// `on_getsockname4` for IPv6: the route to the twins gave the app's socket `[::1]`.
#[inline(always)]
pub fn on_getsockname6(ctx: &SockAddrContext) {
    let sk = sock_addr(ctx).sk();
    if let Some(pod) =
        ends6(sk).and_then(|e| loopback::pod_address6_for(ctx, &e.local, &e.remote, e.remote_port))
    {
        sock_addr(ctx).set_user_ip6(pod);
    }
}
