//! The stateless redirect (`capture_common::loopback`): the table of a pod's loopback address per
//! original destination, and the listener check that decides whether a loopback address other
//! than 127.0.0.1 reaches the proxy at all.
//!
//! Off (a `.rodata` switch the loader sets) on kernels where the programs cannot read a socket's
//! owner from the socket: there every socket has storage anyway, and the stateful path serves.

use aya_ebpf::{
    bindings::{bpf_sock_tuple, BPF_F_CURRENT_NETNS, BPF_NOEXIST},
    helpers::generated::{bpf_get_netns_cookie, bpf_sk_lookup_tcp, bpf_sk_release},
    EbpfContext,
};
use capture_common::{
    addr::{is_loopback4, same},
    config::{FLAG_HAS_POD_IP4, FLAG_HAS_POD_IP6},
    decision::LOOPBACK6,
    keys::LoopbackKey,
    loopback::{address6, candidate, hash_input, in_range, slot_of6, LOOPBACK_PROBES},
    state::OriginalDst,
    AF_INET6,
};

use crate::{
    maps::{LOOPBACK_DESTS, POD_CONFIGS},
    rodata::constant,
};

#[no_mangle]
static STATELESS_REDIRECT: u8 = 0;

/// Does the stateless redirect serve on this kernel?
#[inline(always)]
pub fn enabled() -> bool {
    constant(&STATELESS_REDIRECT) != 0
}

/// Does a TCP listener in the caller's netns take connections to `addr:port` (network order,
/// host order)? The proxy's wildcard listener takes every local address; one bound to 127.0.0.1
/// alone does not take the others.
#[inline(always)]
pub fn listener_takes<C: EbpfContext>(ctx: &C, addr: u32, port: u16) -> bool {
    // bpf_sock_tuple.ipv4: saddr, daddr, sport, dport (network order); built with volatile stores
    // (a struct or zeroed array would become a memset call, which BPF does not have).
    let mut buf = core::mem::MaybeUninit::<[u32; 3]>::uninit();
    let p = buf.as_mut_ptr().cast::<u32>();
    // SAFETY: three stores inside the 12-byte buffer, which the lookup reads exactly.
    unsafe {
        core::ptr::write_volatile(p, 0);
        core::ptr::write_volatile(p.add(1), addr);
        core::ptr::write_volatile(p.add(2), u32::from(port.to_be()) << 16);
        found(ctx, p, 12)
    }
}

/// `listener_takes` for an IPv6 address: a listener on `[::]` (or on the address) takes it, one
/// on `[::1]` alone does not.
#[inline(always)]
pub fn listener_takes6<C: EbpfContext>(ctx: &C, addr: &[u32; 4], port: u16) -> bool {
    // bpf_sock_tuple.ipv6: saddr[4], daddr[4], sport, dport (network order), stored as above.
    let mut buf = core::mem::MaybeUninit::<[u32; 9]>::uninit();
    let p = buf.as_mut_ptr().cast::<u32>();
    // SAFETY: nine stores inside the 36-byte buffer, which the lookup reads exactly.
    unsafe {
        for (i, word) in addr.iter().enumerate() {
            core::ptr::write_volatile(p.add(i), 0);
            core::ptr::write_volatile(p.add(4 + i), *word);
        }
        core::ptr::write_volatile(p.add(8), u32::from(port.to_be()) << 16);
        found(ctx, p, 36)
    }
}

/// Looks the tuple at `tuple` (`len` bytes) up among the netns's TCP sockets.
///
/// # Safety
/// `tuple` points to `len` initialised bytes on the program's stack.
#[inline(always)]
unsafe fn found<C: EbpfContext>(ctx: &C, tuple: *mut u32, len: u32) -> bool {
    // SAFETY: see the contract; a socket the lookup returns is released before returning.
    unsafe {
        let sk = bpf_sk_lookup_tcp(
            ctx.as_ptr(),
            tuple.cast::<bpf_sock_tuple>(),
            len,
            BPF_F_CURRENT_NETNS as u64,
            0,
        );
        if sk.is_null() {
            return false;
        }
        bpf_sk_release(sk.cast());
    }
    true
}

#[inline(always)]
fn is_destination(value: &OriginalDst, orig: &OriginalDst) -> bool {
    value.family == orig.family && same(&value.addr, &orig.addr) && value.port == orig.port
}

/// The pod's slot address for `orig` (an `OriginalDst` of either family), given one if it has
/// none yet and the proxy's listener on `proxy_port` takes its address in `orig`'s family.
/// `None` sends the connection down the stateful path: no slot free among the probes, the node's
/// table full, or no listener that takes it.
#[inline(always)]
pub fn address_for<C: EbpfContext>(
    ctx: &C,
    netns_cookie: u64,
    orig: &OriginalDst,
    proxy_port: u16,
) -> Option<u32> {
    let ipv6 = orig.family == AF_INET6;
    let hashed = hash_input(&orig.addr);
    for probe in 0..LOOPBACK_PROBES {
        let addr = candidate(hashed, orig.port, probe);
        let key = LoopbackKey {
            netns_cookie,
            addr,
            _pad: 0,
        };
        // SAFETY: a plain value, read once.
        if let Some(value) = unsafe { LOOPBACK_DESTS.get(key) } {
            if is_destination(value, orig) {
                return Some(addr);
            }
            continue;
        }
        // Checked once per destination, when its address is given: entries are never
        // rewritten, so a proxy that starts listening on 127.0.0.1 alone later is a proxy
        // replaced under a running pod, which capture does not follow.
        let takes = if ipv6 {
            listener_takes6(ctx, &address6(addr), proxy_port)
        } else {
            listener_takes(ctx, addr, proxy_port)
        };
        if !takes {
            return None;
        }
        if LOOPBACK_DESTS
            .insert(key, *orig, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return Some(addr);
        }
        // Another CPU gave this address away meanwhile, perhaps to this destination.
        // SAFETY: as above.
        if unsafe { LOOPBACK_DESTS.get(key) }.is_some_and(|v| is_destination(v, orig)) {
            return Some(addr);
        }
    }
    None
}

/// The original destination of a connection the stateless redirect sent to the proxy, seen from
/// either end: `addr:port` (network order, host order) is the proxy's end of it, one of the
/// caller's pod's loopback addresses on the pod's outbound port.
#[inline(always)]
pub fn destination_at<C: EbpfContext>(ctx: &C, addr: u32, port: u16) -> Option<OriginalDst> {
    if !enabled() || !in_range(addr) {
        return None;
    }
    // SAFETY: sock_addr (5.7+) and sockopt (5.8+) programs may ask for their netns cookie; the
    // switch is on only where both can.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: a plain value read once.
    let cfg = unsafe { POD_CONFIGS.get(netns_cookie) }?;
    if port != cfg.outbound_port {
        return None;
    }
    let key = LoopbackKey {
        netns_cookie,
        addr,
        _pad: 0,
    };
    // SAFETY: a plain value, copied out.
    unsafe { LOOPBACK_DESTS.get(key) }.copied()
}

/// The pod address to report in place of `app`, the app's end of a connection whose proxy end is
/// `proxy:port` (network order, host order), if that is a connection of the stateless redirect
/// whose app socket the kernel gave a loopback source: `connect4` binds such a socket to
/// nothing (see `connect.rs`), where iptables would have left it the pod address. Either end
/// asks: the app's getsockname, the proxy's accept and getpeername.
#[inline(always)]
pub fn pod_address_for<C: EbpfContext>(ctx: &C, app: u32, proxy: u32, port: u16) -> Option<u32> {
    if !enabled() || !in_range(proxy) || !is_loopback4(app) {
        return None;
    }
    // SAFETY: sock_addr programs may ask for their netns cookie (5.7+).
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: a plain value read once.
    let cfg = unsafe { POD_CONFIGS.get(netns_cookie) }?;
    (port == cfg.outbound_port && cfg.has(FLAG_HAS_POD_IP4)).then_some(cfg.pod_ip4)
}

/// `destination_at` for an IPv6 socket's proxy end `addr`: a slot's twin in `100::/64`.
#[inline(always)]
pub fn destination_at6<C: EbpfContext>(ctx: &C, addr: &[u32; 4], port: u16) -> Option<OriginalDst> {
    destination_at(ctx, slot_of6(addr)?, port)
}

/// `pod_address_for` for IPv6: the app's end is `[::1]`, the source of the route to the twins,
/// and the proxy's end a slot's twin.
#[inline(always)]
pub fn pod_address6_for<C: EbpfContext>(
    ctx: &C,
    app: &[u32; 4],
    proxy: &[u32; 4],
    port: u16,
) -> Option<[u32; 4]> {
    if !enabled() || slot_of6(proxy).is_none() || !same(app, &LOOPBACK6) {
        return None;
    }
    // SAFETY: as in pod_address_for.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // SAFETY: a plain value read once.
    let cfg = unsafe { POD_CONFIGS.get(netns_cookie) }?;
    (port == cfg.outbound_port && cfg.has(FLAG_HAS_POD_IP6)).then_some(cfg.pod_ip6)
}
