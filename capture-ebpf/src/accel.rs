//! The app-to-proxy acceleration: both sockets of a local connection with the proxy at one end
//! join `ACCEL_PEERS` when established (`sock_ops`), and the `sk_msg` program attached to that map
//! moves each write into the peer's receive queue, skipping the loopback TCP stack.
//!
//! Bytes must never arrive out of order. The kernel reads a socket's redirected bytes before
//! those in its TCP receive queue, so each socket decides once, at its first write, and keeps to
//! it: peer found, every write is redirected (while the peer is in the map: once it has closed,
//! writes go to TCP, which answers as it would for any closed peer); peer not found (its
//! handshake not yet complete), every write stays on TCP. The decision lives in the socket's
//! `SockState` flags, which every joined socket has: no allocation beyond the map's own.

use aya_ebpf::{
    bindings::{bpf_sock_ops, sk_action::SK_PASS, sk_msg_md, BPF_ANY, BPF_F_INGRESS},
    programs::SkMsgContext,
};
use capture_common::{
    accel::{joins, Side},
    addr::unmap,
    config::{AccelCounters, PodConfig},
    keys::HandoffKey,
    state::{SOCK_ACCEL_PASSING, SOCK_ACCEL_REDIRECTING, SOCK_NETNS_KNOWN},
    AF_INET, AF_INET6,
};

use crate::{
    maps::{ACCEL_COUNTERS, ACCEL_PEERS},
    storage,
};

/// The socket's connection from its own side, in its netns; IPv4 (also v4-mapped) in word 0.
pub struct Conn {
    pub netns_cookie: u64,
    pub family: u16,
    pub local: [u32; 4],
    pub remote: [u32; 4],
    pub local_port: u16,
    pub remote_port: u16,
}

impl Conn {
    /// The key the socket joins the map under.
    #[inline(always)]
    fn own_key(&self) -> HandoffKey {
        HandoffKey::new(
            self.netns_cookie,
            self.family,
            (self.local, self.local_port),
            (self.remote, self.remote_port),
        )
    }

    /// The key its peer joined under: the same connection seen from the other end.
    #[inline(always)]
    fn peer_key(&self) -> HandoffKey {
        self.own_key().reversed()
    }
}

/// An established socket joins `ACCEL_PEERS` if its pod accelerates and the connection is one
/// the acceleration takes. A socket the kernel refuses (one with a ULP, or the map full) stays on
/// TCP, and so does its peer: its writes will not find it.
#[inline(always)]
pub fn join(
    ops: *mut bpf_sock_ops,
    sk: *mut core::ffi::c_void,
    cfg: &PodConfig,
    c: &Conn,
    side: Side,
) {
    if !joins(cfg, c.family, &c.remote, side) {
        return;
    }
    let Some(state) = storage::get_or_create(sk) else {
        return;
    };
    // The sk_msg program finds the pod by the socket's netns cookie (a socket accepted by a
    // listener that predates the attach may not have it yet).
    state.netns_cookie = c.netns_cookie;
    state.flags = (state.flags | SOCK_NETNS_KNOWN) & !(SOCK_ACCEL_REDIRECTING | SOCK_ACCEL_PASSING);
    let mut own = c.own_key();
    // SAFETY: `ops` is the program's context, valid for the whole run.
    let ops = unsafe { &mut *ops };
    if ACCEL_PEERS
        .update(&mut own, ops, u64::from(BPF_ANY))
        .is_err()
    {
        state.flags |= SOCK_ACCEL_PASSING;
        count(c.netns_cookie, |n| n.unaccelerated_sends += 1);
    }
}

#[inline(always)]
fn count(netns_cookie: u64, f: impl FnOnce(&mut AccelCounters)) {
    if let Some(p) = ACCEL_COUNTERS.get_ptr_mut(netns_cookie) {
        // SAFETY: this CPU's slot of the entry; nothing else writes it concurrently.
        f(unsafe { &mut *p });
    }
}

/// The writing socket's connection, as `sk_msg` sees it. Ports as `sock_ops` has them: the local one
/// in host order, the remote one in network order in the upper half.
#[inline(always)]
fn msg_conn(md: &sk_msg_md, netns_cookie: u64) -> Option<Conn> {
    let local_port = md.local_port as u16;
    let remote_port = u16::from_be((md.remote_port >> 16) as u16);
    let (family, local, remote) = match md.family as u16 {
        AF_INET => (AF_INET, [md.local_ip4, 0, 0, 0], [md.remote_ip4, 0, 0, 0]),
        AF_INET6 => {
            let (local, remote) = (md.local_ip6, md.remote_ip6);
            match (unmap(&local), unmap(&remote)) {
                (Some(l), Some(r)) => (AF_INET, [l, 0, 0, 0], [r, 0, 0, 0]),
                _ => (AF_INET6, local, remote),
            }
        }
        _ => return None,
    };
    Some(Conn {
        netns_cookie,
        family,
        local,
        remote,
        local_port,
        remote_port,
    })
}

/// One write of an accelerated socket. Always `SK_PASS`: either the write was redirected to the
/// peer, or it goes through TCP as it would without acceleration. Never a drop, which would fail
/// the app's write.
#[inline(always)]
pub fn on_msg(ctx: &SkMsgContext) -> u32 {
    // SAFETY: the context pointer is valid for the whole program run.
    let md = unsafe { &*ctx.msg };
    // SAFETY: `sk` is the union's only pointer member in sk_msg programs; it may be null.
    let sk = unsafe { md.__bindgen_anon_3.sk };
    if sk.is_null() {
        return SK_PASS;
    }
    let Some(state) = storage::get(sk.cast()) else {
        return SK_PASS;
    };
    if state.has(SOCK_ACCEL_PASSING) {
        return SK_PASS;
    }
    let Some(conn) = msg_conn(md, state.netns_cookie) else {
        return SK_PASS;
    };
    let mut peer = conn.peer_key();
    let redirected =
        ACCEL_PEERS.redirect_msg(ctx, &mut peer, u64::from(BPF_F_INGRESS)) == i64::from(SK_PASS);
    let size = u64::from(ctx.size());
    match (redirected, state.has(SOCK_ACCEL_REDIRECTING)) {
        (true, already) => {
            state.flags |= SOCK_ACCEL_REDIRECTING;
            count(conn.netns_cookie, |n| {
                n.accelerated_sends += u64::from(!already);
                n.accelerated_bytes += size;
            });
        }
        (false, false) => {
            state.flags |= SOCK_ACCEL_PASSING;
            count(conn.netns_cookie, |n| n.unaccelerated_sends += 1);
        }
        // The peer has left the map (it closed): TCP answers this write.
        (false, true) => {}
    }
    SK_PASS
}
