//! `cgroup/sock_create`: remember who created each UDP socket, and in which netns; TCP sockets
//! too where the programs cannot read a socket's owner from the socket itself (`creator`).
//!
//! iptables' owner match judges a socket by its creator's credentials, not by whoever calls
//! `connect()` later (parity-spec.md E.12, T83); only this hook runs in the creator's context.

use aya_ebpf::{
    helpers::generated::{bpf_get_current_uid_gid, bpf_get_netns_cookie},
    programs::SockContext,
    EbpfContext as _,
};
use capture_common::{
    config::NodeError, state::SOCK_CREATOR_KNOWN, AF_INET, AF_INET6, SOCK_DGRAM, SOCK_STREAM,
};

use crate::{counters::bump_node, creator, storage};

/// Fails open: a socket without a recorded creator is judged by its caller's credentials at
/// `connect()`, which matches iptables except for sockets handed between users.
#[inline(always)]
pub fn on_sock_create(ctx: &SockContext) {
    // SAFETY: the context pointer is valid for the whole program run.
    let sk = unsafe { &*ctx.sock };
    let family = sk.family as u16;
    // UDP too: DNS capture judges UDP sockets by their creator as well.
    if (sk.type_ != SOCK_STREAM && sk.type_ != SOCK_DGRAM)
        || (family != AF_INET && family != AF_INET6)
    {
        return;
    }
    // A TCP socket's owner is read from the socket itself when it connects, where the kernel
    // allows that; recording it here would cost every socket an allocation.
    if sk.type_ == SOCK_STREAM && creator::from_file() {
        return;
    }
    let Some(state) = storage::get_or_create(ctx.sock.cast()) else {
        bump_node(NodeError::NoSocketStorage);
        return;
    };
    // SAFETY: plain helper calls, both permitted in cgroup sock programs.
    let (ids, netns_cookie) = unsafe {
        (
            bpf_get_current_uid_gid(),
            bpf_get_netns_cookie(ctx.as_ptr()),
        )
    };
    state.creator_uid = ids as u32;
    state.creator_gid = (ids >> 32) as u32;
    state.netns_cookie = netns_cookie;
    state.flags |= SOCK_CREATOR_KNOWN;
}
