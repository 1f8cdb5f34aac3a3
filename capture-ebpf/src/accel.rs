//! The app-to-proxy acceleration: both sockets of a local connection with the proxy at one end
//! join `ACCEL_PEERS` when established (sock_ops), and the sk_msg program attached to that map
//! moves each write into the peer's receive queue, skipping the loopback TCP stack.
//!
//! Bytes must never arrive out of order. The kernel reads a socket's redirected bytes before
//! those in its TCP receive queue, so each socket decides once, at its first write, and keeps to
//! it: peer found, every write is redirected (while the peer is in the map: once it has closed,
//! writes go to TCP, which answers as it would for any closed peer); peer not found (its
//! handshake not yet complete), every write stays on TCP.

use aya_ebpf::{
    bindings::{bpf_sock_ops, sk_action::SK_PASS, BPF_ANY, BPF_F_INGRESS},
    programs::SkMsgContext,
};
use capture_common::{
    accel::{joins, Side},
    config::PodConfig,
    keys::HandoffKey,
    state::{ACCEL_PASSING, ACCEL_REDIRECTING},
};

use crate::{
    maps::{ACCEL_COUNTERS, ACCEL_PEERS},
    storage,
};

/// The socket's connection from its own side, in its netns.
pub struct Conn<'a> {
    pub netns_cookie: u64,
    pub family: u16,
    pub local: &'a [u32; 4],
    pub remote: &'a [u32; 4],
    pub local_port: u16,
    pub remote_port: u16,
}

/// An established socket joins `ACCEL_PEERS` if its pod accelerates and the connection is one
/// the acceleration takes. A socket the kernel refuses (one with a ULP, or the map full) simply
/// stays on TCP, and so does its peer: its writes will not find it.
#[inline(always)]
pub fn join(
    ops: *mut bpf_sock_ops,
    sk: *mut core::ffi::c_void,
    cfg: &PodConfig,
    c: &Conn<'_>,
    side: Side,
) {
    if !joins(cfg, c.family, c.remote, side) {
        return;
    }
    let Some(state) = storage::accel_or_create(sk) else {
        return;
    };
    state.peer.netns_cookie = c.netns_cookie;
    state.peer.local_addr = *c.remote;
    state.peer.remote_addr = *c.local;
    state.peer.local_port = c.remote_port;
    state.peer.remote_port = c.local_port;
    state.peer.family = c.family;
    state.flags = 0;
    let mut own = HandoffKey {
        netns_cookie: c.netns_cookie,
        local_addr: *c.local,
        remote_addr: *c.remote,
        local_port: c.local_port,
        remote_port: c.remote_port,
        family: c.family,
        _pad: 0,
    };
    // SAFETY: `ops` is the program's context, valid for the whole run.
    if ACCEL_PEERS
        .update(&mut own, unsafe { &mut *ops }, u64::from(BPF_ANY))
        .is_err()
    {
        state.flags = ACCEL_PASSING;
        count(c.netns_cookie, |n| n.unaccelerated_sends += 1);
    }
}

#[inline(always)]
fn count(netns_cookie: u64, f: impl FnOnce(&mut capture_common::config::AccelCounters)) {
    if let Some(p) = ACCEL_COUNTERS.get_ptr_mut(netns_cookie) {
        // SAFETY: this CPU's slot of the entry; nothing else writes it concurrently.
        f(unsafe { &mut *p });
    }
}

/// One write of an accelerated socket. Always `SK_PASS`: either the write was redirected to the
/// peer, or it goes through TCP as it would without acceleration. Never a drop, which would fail
/// the app's write.
#[inline(always)]
pub fn on_msg(ctx: &SkMsgContext) -> u32 {
    // SAFETY: the context pointer is valid; `sk` may be null and is checked.
    let sk = unsafe { (*ctx.msg).__bindgen_anon_3.sk };
    if sk.is_null() {
        return SK_PASS;
    }
    let Some(state) = storage::accel(sk.cast()) else {
        return SK_PASS;
    };
    if state.flags & ACCEL_PASSING != 0 {
        return SK_PASS;
    }
    let netns_cookie = state.peer.netns_cookie;
    let redirected = ACCEL_PEERS.redirect_msg(ctx, &mut state.peer, u64::from(BPF_F_INGRESS))
        == i64::from(SK_PASS);
    let size = u64::from(ctx.size());
    match (redirected, state.flags & ACCEL_REDIRECTING != 0) {
        (true, already) => {
            state.flags |= ACCEL_REDIRECTING;
            count(netns_cookie, |n| {
                n.accelerated_sends += u64::from(!already);
                n.accelerated_bytes += size;
            });
        }
        (false, false) => {
            state.flags |= ACCEL_PASSING;
            count(netns_cookie, |n| n.unaccelerated_sends += 1);
        }
        // The peer has left the map (it closed): TCP answers this write.
        (false, true) => {}
    }
    SK_PASS
}
