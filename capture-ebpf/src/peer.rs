//! `cgroup/getpeername4/6`: the app's redirected socket reports the destination it asked for,
//! as it does under iptables (NAT rewrites packets, not the socket).

use aya_ebpf::programs::SockAddrContext;
use capture_common::{state::SOCK_REDIRECTED, AF_INET};

use crate::storage;

/// The redirected original destination of the context's socket, if any.
#[inline(always)]
fn redirected_orig(ctx: &SockAddrContext) -> Option<capture_common::state::OriginalDst> {
    // SAFETY: the context and its socket pointer are valid for the whole program run.
    let sk = unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk };
    let state = storage::get(sk.cast())?;
    (state.flags & SOCK_REDIRECTED != 0).then_some(state.orig)
}

#[inline(always)]
pub fn on_getpeername4(ctx: &SockAddrContext) {
    let Some(orig) = redirected_orig(ctx) else {
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
        [0, 0, crate::connect::V4_MAPPED_PREFIX, orig.addr[0]]
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
