//! `sock_ops`: hand the original destination from the app's socket to the proxy's accepted one.
//!
//! The app's socket knows where it was going (connect recorded it). When it reaches ESTABLISHED,
//! its tuple as the proxy will see it goes into `HANDOFF`; when the proxy's socket reaches
//! ESTABLISHED (always after, since the app's final ACK completes it), the entry moves into that
//! socket's own storage and leaves the map. The storage dies with the socket, so nothing grows.

use aya_ebpf::{
    bindings::{BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB},
    helpers::generated::bpf_get_netns_cookie,
    programs::SockOpsContext,
    EbpfContext as _,
};
use capture_common::{
    config::{NodeError, PodCounter},
    keys::HandoffKey,
    state::{SOCK_ACCEPTED_REDIRECTED, SOCK_CREATOR_KNOWN, SOCK_REDIRECTED},
    AF_INET, AF_INET6,
};

use crate::{
    connect::V4_MAPPED_PREFIX,
    counters::{bump_node, bump_pod},
    maps::HANDOFF,
    storage,
};

/// A connection's endpoints from the socket's own side; IPv4 (also v4-mapped) in word 0.
struct Tuple {
    family: u16,
    local: [u32; 4],
    remote: [u32; 4],
    local_port: u16,
    remote_port: u16,
}

#[inline(always)]
fn unmap(addr: [u32; 4]) -> Option<[u32; 4]> {
    (addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_PREFIX).then_some([addr[3], 0, 0, 0])
}

#[inline(always)]
fn tuple(ctx: &SockOpsContext) -> Option<Tuple> {
    // `local_port` is in host order; `remote_port` holds the network-order port in its upper half.
    let local_port = ctx.local_port() as u16;
    let remote_port = u16::from_be((ctx.remote_port() >> 16) as u16);
    match ctx.family() as u16 {
        AF_INET => Some(Tuple {
            family: AF_INET,
            local: [ctx.local_ip4(), 0, 0, 0],
            remote: [ctx.remote_ip4(), 0, 0, 0],
            local_port,
            remote_port,
        }),
        AF_INET6 => {
            let (local, remote) = (ctx.local_ip6(), ctx.remote_ip6());
            let t = match (unmap(local), unmap(remote)) {
                (Some(l), Some(r)) => (AF_INET, l, r),
                _ => (AF_INET6, local, remote),
            };
            Some(Tuple {
                family: t.0,
                local: t.1,
                remote: t.2,
                local_port,
                remote_port,
            })
        }
        _ => None,
    }
}

#[inline(always)]
fn sock(ctx: &SockOpsContext) -> Option<*mut core::ffi::c_void> {
    // SAFETY: the context pointer is valid; `sk` may be null and is checked.
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    (!sk.is_null()).then_some(sk.cast())
}

/// The app's socket is connected (to the proxy): publish its original destination.
#[inline(always)]
fn on_active_established(ctx: &SockOpsContext) -> Option<()> {
    let state = storage::get(sock(ctx)?)?;
    if state.flags & SOCK_REDIRECTED == 0 {
        return None;
    }
    let t = tuple(ctx)?;
    let key = HandoffKey {
        netns_cookie: state.netns_cookie,
        local_addr: t.remote,
        remote_addr: t.local,
        local_port: t.remote_port,
        remote_port: t.local_port,
        family: t.family,
        _pad: 0,
    };
    if HANDOFF.insert(key, state.orig, 0).is_err() {
        bump_node(NodeError::HandoffFailed);
        bump_pod(state.netns_cookie, PodCounter::Errors);
    }
    Some(())
}

/// The proxy accepted a connection: take the original destination, if the app published one.
#[inline(always)]
fn on_passive_established(ctx: &SockOpsContext) -> Option<()> {
    let sk = sock(ctx)?;
    // The accepted socket's storage is a clone of its listener's, which carries the netns. A
    // listener created before capture was attached has none: ask the kernel (Linux 6.0+).
    let state = storage::get(sk);
    let netns_cookie = match &state {
        Some(s) if s.flags & SOCK_CREATOR_KNOWN != 0 => s.netns_cookie,
        // SAFETY: a plain helper call on the program's context.
        _ => unsafe { bpf_get_netns_cookie(ctx.as_ptr()) },
    };
    let t = tuple(ctx)?;
    let key = HandoffKey {
        netns_cookie,
        local_addr: t.local,
        remote_addr: t.remote,
        local_port: t.local_port,
        remote_port: t.remote_port,
        family: t.family,
        _pad: 0,
    };
    // SAFETY: the value is read before the entry is removed.
    let orig = unsafe { HANDOFF.get(key) }?;
    let Some(state) = state.or_else(|| storage::get_or_create(sk)) else {
        bump_node(NodeError::HandoffFailed);
        bump_pod(netns_cookie, PodCounter::Errors);
        return None;
    };
    // Field by field: a struct copy between two map values compiles to memmove, which BPF lacks.
    state.orig.addr[0] = orig.addr[0];
    state.orig.addr[1] = orig.addr[1];
    state.orig.addr[2] = orig.addr[2];
    state.orig.addr[3] = orig.addr[3];
    state.orig.port = orig.port;
    state.orig.family = orig.family;
    state.flags |= SOCK_ACCEPTED_REDIRECTED;
    let _ = HANDOFF.remove(key);
    Some(())
}

#[inline(always)]
pub fn on_sock_ops(ctx: &SockOpsContext) {
    match ctx.op() {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            let _ = on_active_established(ctx);
        }
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => {
            let _ = on_passive_established(ctx);
        }
        _ => {}
    }
}
