//! `cgroup/getpeername4/6` and `cgroup/recvmsg4/6`: the app's redirected socket reports the
//! destination it asked for (from its storage, or from its loopback address for the stateless
//! redirect), and DNS replies from the DNS proxy come from the nameserver the app
//! asked, as they do under iptables (NAT rewrites packets, not the socket).

use aya_ebpf::programs::SockAddrContext;
use capture_common::{
    addr::v4_mapped,
    decision::{LOCALHOST4, LOOPBACK6},
    state::{OriginalDst, SOCK_DNS_SENT, SOCK_REDIRECTED},
    AF_INET,
};

use crate::{loopback, storage};

/// The redirected original destination of the context's socket, if any.
#[inline(always)]
fn redirected_orig(ctx: &SockAddrContext) -> Option<OriginalDst> {
    // SAFETY: the context and its socket pointer are valid for the whole program run.
    let sk = unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk };
    let state = storage::get(sk.cast())?;
    (state.flags & SOCK_REDIRECTED != 0).then_some(state.orig)
}

#[inline(always)]
pub fn on_getpeername4(ctx: &SockAddrContext) {
    // SAFETY: as above.
    let (peer, port) = unsafe {
        (
            (*ctx.sock_addr).user_ip4,
            u16::from_be((*ctx.sock_addr).user_port as u16),
        )
    };
    // The app's socket of a stateless redirect: its peer is the proxy's end.
    let Some(orig) = redirected_orig(ctx).or_else(|| loopback::destination_at(ctx, peer, port))
    else {
        return;
    };
    if orig.family != AF_INET {
        return;
    }
    // SAFETY: as above.
    let sa = unsafe { &mut *ctx.sock_addr };
    sa.user_ip4 = orig.addr[0];
    sa.user_port = u32::from(orig.port.to_be());
}

#[inline(always)]
pub fn on_getpeername6(ctx: &SockAddrContext) {
    let Some(orig) = redirected_orig(ctx) else {
        return;
    };
    let addr = if orig.family == AF_INET {
        v4_mapped(orig.addr[0])
    } else {
        orig.addr
    };
    // SAFETY: as above.
    let sa = unsafe { &mut *ctx.sock_addr };
    sa.user_ip6[0] = addr[0];
    sa.user_ip6[1] = addr[1];
    sa.user_ip6[2] = addr[2];
    sa.user_ip6[3] = addr[3];
    sa.user_port = u32::from(orig.port.to_be());
}

/// The original destination of a redirected UDP socket, if the datagram (from `src`:`port`, as
/// the context reports it) came from where capture sent the socket's queries.
#[inline(always)]
fn dns_reply_origin(ctx: &SockAddrContext, from_proxy: bool, port: u16) -> Option<OriginalDst> {
    // SAFETY: the context and its socket pointer are valid for the whole program run.
    let sk = unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk };
    let state = storage::get(sk.cast())?;
    let redirected = state.flags & (SOCK_DNS_SENT | SOCK_REDIRECTED) != 0;
    (redirected && from_proxy && port == state.redirected_port && state.orig.port == 53)
        .then_some(state.orig)
}

#[inline(always)]
pub fn on_recvmsg4(ctx: &SockAddrContext) {
    // SAFETY: as above.
    let sa = unsafe { &mut *ctx.sock_addr };
    let port = u16::from_be(sa.user_port as u16);
    let Some(orig) = dns_reply_origin(ctx, sa.user_ip4 == LOCALHOST4, port) else {
        return;
    };
    if orig.family != AF_INET {
        return;
    }
    sa.user_ip4 = orig.addr[0];
    sa.user_port = u32::from(orig.port.to_be());
}

#[inline(always)]
pub fn on_recvmsg6(ctx: &SockAddrContext) {
    // SAFETY: as above.
    let sa = unsafe { &mut *ctx.sock_addr };
    let from = [
        sa.user_ip6[0],
        sa.user_ip6[1],
        sa.user_ip6[2],
        sa.user_ip6[3],
    ];
    let mapped_localhost = v4_mapped(LOCALHOST4);
    let from_proxy = from == LOOPBACK6 || from == mapped_localhost;
    let port = u16::from_be(sa.user_port as u16);
    let Some(orig) = dns_reply_origin(ctx, from_proxy, port) else {
        return;
    };
    let addr = if orig.family == AF_INET {
        v4_mapped(orig.addr[0])
    } else {
        orig.addr
    };
    sa.user_ip6[0] = addr[0];
    sa.user_ip6[1] = addr[1];
    sa.user_ip6[2] = addr[2];
    sa.user_ip6[3] = addr[3];
    sa.user_port = u32::from(orig.port.to_be());
}
