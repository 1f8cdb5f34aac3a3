//! `sock_ops`: hand the original destination from the app's socket to the proxy's accepted one.
//!
//! The app's socket knows where it was going (connect recorded it). When it reaches ESTABLISHED,
//! its tuple as the proxy will see it goes into `HANDOFF`; when the proxy's socket reaches
//! ESTABLISHED (always after, since the app's final ACK completes it), the entry moves into that
//! socket's own storage and leaves the map. The storage dies with the socket, so nothing grows.
//!
//! An entry the proxy never takes (the app gave up first) is removed when the app's socket
//! closes, so the map holds only handshakes in flight and LRU eviction, which would lose a
//! destination, needs more of those than the map has room for. Should a proxy's socket still
//! find no entry, it is marked lost and `SO_ORIGINAL_DST` is refused for it: the proxy can then
//! forward the connection nowhere, and `handoff_failed` counts it.
//!
//! Connections of the stateless redirect (`loopback`) need none of this: their address is their
//! original destination.

use aya_ebpf::{
    bindings::{
        BPF_NOEXIST, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_LISTEN_CB,
        BPF_TCP_CLOSE,
    },
    helpers::generated::bpf_get_netns_cookie,
    programs::SockOpsContext,
    EbpfContext as _,
};
use capture_common::{
    accel::{is_proxy, Side},
    addr::{is_loopback4, is_unspecified, same, unmap},
    config::{
        NodeError, PodConfig, PodCounter, FLAG_ACCELERATE, FLAG_HAS_POD_IP4, FLAG_HAS_POD_IP6,
    },
    decision::LOOPBACK6,
    keys::{HandoffKey, ListenerKey, LISTENER_SLOTS},
    loopback::{in_range, slot_of6},
    state::{
        SockState, SOCK_ACCEPTED_REDIRECTED, SOCK_CREATOR_KNOWN, SOCK_HANDOFF_LOST,
        SOCK_INBOUND_LISTENER, SOCK_NETNS_KNOWN, SOCK_REDIRECTED,
    },
    AF_INET, AF_INET6,
};

use crate::{
    accel,
    counters::{bump_node, bump_pod},
    creator, loopback,
    maps::{HANDOFF, INBOUND_LISTENERS, POD_CONFIGS},
    rodata::constant,
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

/// Why a `sock_ops` event left nothing behind: mostly a socket capture has nothing to do with;
/// the failures are counted by [`record`], as connect's refusals are.
enum Skipped {
    /// Not a socket, connection or pod capture hands anything off for.
    NotOurs,
    /// A redirected connection whose original destination could not be handed to the proxy's
    /// socket (the entry not written, or found and not kept): the proxy cannot forward it.
    HandoffFailed { netns_cookie: u64 },
    /// The pod's inbound listener found no free slot: inbound connections to it are refused.
    ListenerSlots { netns_cookie: u64 },
}

/// A missing socket, tuple, config or entry: not a socket capture handles.
trait OrNotOurs<T> {
    fn ours(self) -> Result<T, Skipped>;
}

impl<T> OrNotOurs<T> for Option<T> {
    #[inline(always)]
    fn ours(self) -> Result<T, Skipped> {
        self.ok_or(Skipped::NotOurs)
    }
}

/// Counts a failure where the node's and the pod's error counters show it.
#[inline(always)]
fn record(skipped: &Skipped) {
    let (kind, netns_cookie) = match *skipped {
        Skipped::NotOurs => return,
        Skipped::HandoffFailed { netns_cookie } => (NodeError::HandoffFailed, netns_cookie),
        Skipped::ListenerSlots { netns_cookie } => (NodeError::ListenerRegistration, netns_cookie),
    };
    bump_node(kind);
    bump_pod(netns_cookie, PodCounter::Errors);
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
            let t = match (unmap(&local), unmap(&remote)) {
                (Some(l), Some(r)) => (AF_INET, [l, 0, 0, 0], [r, 0, 0, 0]),
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

/// Set by the loader to 0 where `sock_ops` may not call `bpf_get_netns_cookie` (before Linux
/// 5.15). It lives in `.rodata`, so the verifier knows its value and never visits the call on
/// such kernels; one object serves every kernel.
#[no_mangle]
static SOCK_OPS_NETNS_COOKIE: u8 = 1;

/// The socket's netns: recorded at creation (or inherited from its listener); for a socket
/// created before capture was attached, asked of the kernel where it can tell. Where it cannot,
/// 0: no pod has that cookie, so such a socket is left alone (a listener is then not registered
/// and inbound connections to it are refused, never passed around the proxy).
#[inline(always)]
fn netns_of(ctx: &SockOpsContext, state: Option<&SockState>) -> u64 {
    match state {
        Some(s) if s.has(SOCK_CREATOR_KNOWN | SOCK_NETNS_KNOWN) => s.netns_cookie,
        _ if constant(&SOCK_OPS_NETNS_COOKIE) != 0 => {
            // SAFETY: a plain helper call on the program's context.
            unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
        }
        _ => 0,
    }
}

/// The proxy listens: if this is the pod's inbound listener (its inbound port, on the wildcard or
/// the pod address), register it for inbound capture.
#[inline(always)]
fn try_listen(ctx: &SockOpsContext) -> Result<(), Skipped> {
    let sk = sock(ctx).ours()?;
    let netns_cookie = netns_of(ctx, storage::get(sk).as_deref());
    // SAFETY: a plain value read once.
    let cfg = unsafe { POD_CONFIGS.get(netns_cookie) }.ours()?;
    let t = tuple(ctx).ours()?;
    if t.local_port != cfg.inbound_port {
        return Err(Skipped::NotOurs);
    }
    let any = is_unspecified(&t.local);
    let pod_addr = if t.family == AF_INET6 {
        cfg.pod_ip6
    } else {
        [cfg.pod_ip4, 0, 0, 0]
    };
    let own = same(&t.local, &pod_addr);
    if !any && !own {
        return Err(Skipped::NotOurs);
    }
    // The socket's own family: a dual-stack IPv6 listener is found as such for IPv4 traffic.
    // The first free slot: a slot whose socket closed was freed by the kernel.
    let family = ctx.family();
    let mut registered = false;
    for slot in 0..LISTENER_SLOTS {
        let key = ListenerKey {
            netns_cookie,
            family,
            slot,
        };
        // SAFETY: the context pointer is valid for the whole program run.
        let ops = unsafe { &mut *ctx.ops };
        if INBOUND_LISTENERS
            .update(key, ops, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            registered = true;
            break;
        }
    }
    if !registered {
        return Err(Skipped::ListenerSlots { netns_cookie });
    }
    let state = storage::get_or_create(sk).ours()?;
    state.netns_cookie = netns_cookie;
    state.flags |= SOCK_INBOUND_LISTENER;
    Ok(())
}

/// The hand-off key of a socket's connection, as the socket sees it.
#[inline(always)]
fn handoff_key(netns_cookie: u64, t: &Tuple) -> HandoffKey {
    HandoffKey::new(
        netns_cookie,
        t.family,
        (t.local, t.local_port),
        (t.remote, t.remote_port),
    )
}

/// The hand-off key of an app's socket: its tuple as the proxy's socket sees it.
#[inline(always)]
fn app_handoff_key(netns_cookie: u64, t: &Tuple) -> HandoffKey {
    handoff_key(netns_cookie, t).reversed()
}

/// A socket of the pod joins the acceleration if its connection is one it takes.
#[inline(always)]
fn accel_join(
    ctx: &SockOpsContext,
    t: &Tuple,
    side: impl FnOnce(&PodConfig, Option<&SockState>, *mut core::ffi::c_void) -> Side,
) -> Result<(), Skipped> {
    let sk = sock(ctx).ours()?;
    let state = storage::get(sk);
    let netns_cookie = netns_of(ctx, state.as_deref());
    // SAFETY: a plain value read once.
    let cfg = unsafe { POD_CONFIGS.get(netns_cookie) }.ours()?;
    if !cfg.has(FLAG_ACCELERATE) {
        return Err(Skipped::NotOurs);
    }
    let conn = accel::Conn {
        netns_cookie,
        family: t.family,
        local: t.local,
        remote: t.remote,
        local_port: t.local_port,
        remote_port: t.remote_port,
    };
    accel::join(ctx.ops, sk, cfg, &conn, side(cfg, state.as_deref(), sk));
    Ok(())
}

/// The connecting side: capture sent it to the proxy, or the proxy made it.
#[inline(always)]
fn connecting_side(cfg: &PodConfig, state: Option<&SockState>, sk: *mut core::ffi::c_void) -> Side {
    let owner = match state {
        Some(s) if s.has(SOCK_CREATOR_KNOWN) => Some((s.creator_uid, s.creator_gid)),
        _ if creator::from_file() => creator::tcp_owner(sk),
        _ => None,
    };
    Side::Connecting {
        redirected: state.is_some_and(|s| s.has(SOCK_REDIRECTED)),
        by_proxy: owner.is_some_and(|(uid, gid)| is_proxy(cfg, uid, gid)),
    }
}

/// The app's socket is connected (to the proxy): publish its original destination, and ask to
/// hear when the socket closes, to take back an entry the proxy never took.
#[inline(always)]
fn try_active_established(ctx: &SockOpsContext, t: &Tuple) -> Result<(), Skipped> {
    let state = storage::get(sock(ctx).ours()?).ours()?;
    if !state.has(SOCK_REDIRECTED) {
        return Err(Skipped::NotOurs);
    }
    let key = app_handoff_key(state.netns_cookie, t);
    if HANDOFF.insert(key, state.orig, 0).is_err() {
        return Err(Skipped::HandoffFailed {
            netns_cookie: state.netns_cookie,
        });
    }
    // Failing, the kernel only keeps not calling at the socket's state changes: its entry is
    // then left to the map's LRU.
    let _ = ctx.set_cb_flags(BPF_SOCK_OPS_STATE_CB_FLAG as i32);
    Ok(())
}

/// A redirected app socket changed state. Closed: its entry goes if the proxy never took it (the
/// tuple is still the socket's own, a `TIME_WAIT` successor holds it, so no newer connection can
/// own the key). Any other change with the entry already taken: nothing is left to clean up, so
/// the kernel stops calling for this socket's later state changes (each is a program run per
/// connection).
#[inline(always)]
fn try_state_change(ctx: &SockOpsContext) -> Result<(), Skipped> {
    let state = storage::get(sock(ctx).ours()?).ours()?;
    if !state.has(SOCK_REDIRECTED) {
        return Err(Skipped::NotOurs);
    }
    let t = tuple(ctx).ours()?;
    let key = app_handoff_key(state.netns_cookie, &t);
    if ctx.arg(1) == BPF_TCP_CLOSE {
        // Absent when the proxy took it: nothing to do either way.
        let _ = HANDOFF.remove(key);
        return Ok(());
    }
    // SAFETY: a plain lookup; the value is not read.
    if unsafe { HANDOFF.get(key) }.is_none() {
        // Failing, the kernel keeps calling: a wasted run per state change, nothing worse.
        let _ = ctx.set_cb_flags(0);
    }
    Ok(())
}

/// A connection from the pod's own address to a loopback address on its outbound port: what a
/// redirected connection looks like from the proxy's side.
#[inline(always)]
fn looks_redirected(cfg: &PodConfig, t: &Tuple) -> bool {
    if t.local_port != cfg.outbound_port {
        return false;
    }
    if t.family == AF_INET6 {
        cfg.has(FLAG_HAS_POD_IP6) && same(&t.remote, &cfg.pod_ip6) && same(&t.local, &LOOPBACK6)
    } else {
        cfg.has(FLAG_HAS_POD_IP4) && t.remote[0] == cfg.pod_ip4 && is_loopback4(t.local[0])
    }
}

/// The proxy accepted a connection: take the original destination the app published, or, for
/// a connection that inbound capture steered to it, its own local address.
#[inline(always)]
fn try_passive_established(ctx: &SockOpsContext, t: &Tuple) -> Result<(), Skipped> {
    let sk = sock(ctx).ours()?;
    let state = storage::get(sk);
    let inbound = state
        .as_deref()
        .is_some_and(|s| s.has(SOCK_INBOUND_LISTENER));
    // A connection of the stateless redirect: nothing to take.
    if !inbound && of_stateless_redirect(t, true) {
        return Err(Skipped::NotOurs);
    }
    let netns_cookie = netns_of(ctx, state.as_deref());
    let key = handoff_key(netns_cookie, t);
    // SAFETY: the value is read before the entry is removed.
    if let Some(orig) = unsafe { HANDOFF.get(key) } {
        let Some(state) = state.or_else(|| storage::get_or_create(sk)) else {
            return Err(Skipped::HandoffFailed { netns_cookie });
        };
        // Field by field: a struct copy between two map values compiles to memmove, which BPF lacks.
        state.orig.addr[0] = orig.addr[0];
        state.orig.addr[1] = orig.addr[1];
        state.orig.addr[2] = orig.addr[2];
        state.orig.addr[3] = orig.addr[3];
        state.orig.port = orig.port;
        state.orig.family = orig.family;
        state.flags = (state.flags & !SOCK_INBOUND_LISTENER) | SOCK_ACCEPTED_REDIRECTED;
        // The entry is taken: removing it only spares the map.
        let _ = HANDOFF.remove(key);
        return Ok(());
    }
    if !inbound {
        // SAFETY: a plain value read once.
        let cfg = unsafe { POD_CONFIGS.get(netns_cookie) }.ours()?;
        if !looks_redirected(cfg, t) {
            return Err(Skipped::NotOurs);
        }
        // Marked lost, so that SO_ORIGINAL_DST is refused rather than answered wrong.
        if let Some(state) = state.or_else(|| storage::get_or_create(sk)) {
            state.netns_cookie = netns_cookie;
            state.flags |= SOCK_HANDOFF_LOST;
        }
        return Err(Skipped::HandoffFailed { netns_cookie });
    }
    // Accepted by the inbound listener (its storage was cloned into this socket).
    let state = state.ours()?;
    state.orig.addr = t.local;
    state.orig.port = t.local_port;
    state.orig.family = t.family;
    state.flags = (state.flags & !SOCK_INBOUND_LISTENER) | SOCK_ACCEPTED_REDIRECTED;
    Ok(())
}

/// A connection of the stateless redirect, seen from either end: its proxy end (the remote one
/// on the app's socket, the local one on the proxy's) is in the range, or its IPv6 twin, which
/// is the stateless redirect's alone. Its address says where it was going, so there is nothing
/// to hand off, and no accelerated pod makes one (they keep the stateful path).
#[inline(always)]
fn of_stateless_redirect(t: &Tuple, passive: bool) -> bool {
    let proxy_end = if passive { &t.local } else { &t.remote };
    let ours = if t.family == AF_INET {
        in_range(proxy_end[0])
    } else {
        slot_of6(proxy_end).is_some()
    };
    ours && loopback::enabled()
}

/// One `sock_ops` event; each step's failure is counted, and a failed hand-off does not keep the
/// socket out of the acceleration (which needs no hand-off).
#[inline(always)]
pub fn on_sock_ops(ctx: &SockOpsContext) {
    match ctx.op() {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            let Some(t) = tuple(ctx) else { return };
            if of_stateless_redirect(&t, false) {
                return;
            }
            note(try_active_established(ctx, &t));
            note(accel_join(ctx, &t, connecting_side));
        }
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => {
            let Some(t) = tuple(ctx) else { return };
            note(try_passive_established(ctx, &t));
            if !of_stateless_redirect(&t, true) {
                note(accel_join(ctx, &t, |_, _, _| Side::Accepted));
            }
        }
        BPF_SOCK_OPS_TCP_LISTEN_CB => note(try_listen(ctx)),
        BPF_SOCK_OPS_STATE_CB => note(try_state_change(ctx)),
        _ => {}
    }
}

#[inline(always)]
fn note(result: Result<(), Skipped>) {
    if let Err(skipped) = result {
        record(&skipped);
    }
}
