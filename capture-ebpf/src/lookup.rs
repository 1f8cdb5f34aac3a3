//! `sk_lookup` on the pod's netns: inbound capture. A TCP connection arriving for a pod address
//! from outside the pod is assigned to the pod's inbound listener (15006) when parity-spec.md section C's
//! inbound procedure says so. Nothing is rewritten: the accepted socket's local address is the
//! original destination.
//!
//! Fail closed: a port that must be captured but has no listener is refused (the client gets a
//! RST at once, as with iptables' REDIRECT to a closed port), never delivered to the app.

use aya_ebpf::programs::SkLookupContext;
use capture_common::{
    addr::{is_loopback4, same},
    config::{NodeError, PodCounter},
    decision::{inbound_rule, InboundRule, InboundVerdict, INBOUND_PASSTHROUGH_SRC6, LOOPBACK6},
    keys::{ListenerKey, PodAddrKey, LISTENER_SLOTS},
    loopback::slot_of6,
    trace::{TraceHook, TraceVerdict},
    AF_INET, AF_INET6,
};

use crate::{
    counters::{bump_node, bump_pod},
    maps::{MapLists, INBOUND_LISTENERS, INBOUND_PODS, POD_CONFIGS},
    trace,
};

pub const SK_PASS: u32 = 1;
pub const SK_DROP: u32 = 0;
const IPPROTO_TCP: u32 = 6;

/// Is `src` the pod itself (its own address, loopback, or the inbound-passthrough source `::6`)?
/// Such connections bypass inbound capture, as iptables' PREROUTING never sees locally generated
/// traffic.
#[inline(always)]
fn from_the_pod(ipv6: bool, src: &[u32; 4], dst: &[u32; 4]) -> bool {
    same(src, dst)
        || if ipv6 {
            same(src, &LOOPBACK6) || same(src, &INBOUND_PASSTHROUGH_SRC6)
        } else {
            is_loopback4(src[0])
        }
}

/// Assigns the connection to one of the pod's listeners of `family` (the kernel then picks
/// within its reuseport group, if it has one).
#[inline(always)]
fn assign_family(ctx: &SkLookupContext, netns_cookie: u64, family: u32) -> Result<(), i32> {
    let mut result = Err(0);
    for slot in 0..LISTENER_SLOTS {
        let key = ListenerKey {
            netns_cookie,
            family,
            slot,
        };
        result = INBOUND_LISTENERS.redirect_sk_lookup(ctx, key, 0);
        if result.is_ok() {
            break;
        }
    }
    result
}

/// Assigns the connection to the pod's listener: same family first, then a dual-stack IPv6
/// listener for IPv4 traffic.
#[inline(always)]
fn assign(ctx: &SkLookupContext, netns_cookie: u64, family: u32) -> Result<(), i32> {
    match assign_family(ctx, netns_cookie, family) {
        Err(_) if family == u32::from(AF_INET) => {
            assign_family(ctx, netns_cookie, u32::from(AF_INET6))
        }
        other => other,
    }
}

#[inline(always)]
pub fn on_sk_lookup(ctx: &SkLookupContext) -> u32 {
    let l = ctx.lookup;
    // Every context field is read with its own load from the context pointer: the verifier
    // rejects loads through a pointer derived from it ("dereference of modified ctx ptr").
    // SAFETY: the context pointer is valid for the whole program run.
    let field = |p: *const u32| unsafe { core::ptr::read_volatile(p) };
    // SAFETY: as above; only field addresses are formed, never dereferenced as a whole.
    let (family, protocol, local_port, remote_port) = unsafe {
        (
            field(&raw const (*l).family),
            field(&raw const (*l).protocol),
            field(&raw const (*l).local_port),
            // A 2-byte load, in network order: kernels before 5.19 declare a 4-byte field there
            // and take narrow loads of it.
            core::ptr::read_volatile(&raw const (*l).remote_port),
        )
    };
    if protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    // SAFETY: as above.
    let (ipv6, dst, src) = unsafe {
        match family as u16 {
            AF_INET => (
                false,
                [field(&raw const (*l).local_ip4), 0, 0, 0],
                [field(&raw const (*l).remote_ip4), 0, 0, 0],
            ),
            AF_INET6 => (
                true,
                [
                    field(&raw const (*l).local_ip6[0]),
                    field(&raw const (*l).local_ip6[1]),
                    field(&raw const (*l).local_ip6[2]),
                    field(&raw const (*l).local_ip6[3]),
                ],
                [
                    field(&raw const (*l).remote_ip6[0]),
                    field(&raw const (*l).remote_ip6[1]),
                    field(&raw const (*l).remote_ip6[2]),
                    field(&raw const (*l).remote_ip6[3]),
                ],
            ),
            _ => return SK_PASS,
        }
    };
    // A connection to a loopback address or to the IPv6 stateless redirect's `100::/64` (every
    // redirected one, to the proxy) is never for a pod address: spare it the lookup.
    let to_the_proxy = if ipv6 {
        same(&dst, &LOOPBACK6) || slot_of6(&dst).is_some()
    } else {
        is_loopback4(dst[0])
    };
    if to_the_proxy {
        return SK_PASS;
    }
    // SAFETY: plain values read once.
    let Some(&netns_cookie) = (unsafe { INBOUND_PODS.get(PodAddrKey { family, addr: dst }) })
    else {
        return SK_PASS;
    };
    if from_the_pod(ipv6, &src, &dst) {
        return SK_PASS;
    }
    // SAFETY: as above.
    let Some(cfg) = (unsafe { POD_CONFIGS.get(netns_cookie) }) else {
        bump_node(NodeError::UnknownPod);
        return SK_DROP;
    };
    let rule = inbound_rule(cfg, &MapLists { netns_cookie }, local_port as u16);
    let (verdict, counter, action) = match rule.verdict() {
        InboundVerdict::Pass(_) => (TraceVerdict::Pass, PodCounter::PassedInbound, SK_PASS),
        InboundVerdict::Capture if assign(ctx, netns_cookie, family).is_ok() => {
            (TraceVerdict::Redirect, PodCounter::CapturedInbound, SK_PASS)
        }
        InboundVerdict::Capture => (TraceVerdict::Refuse, PodCounter::RefusedInbound, SK_DROP),
    };
    bump_pod(netns_cookie, counter);
    let ends = Ends {
        ipv6,
        src,
        // local_port is in host order.
        src_port: u16::from_be(remote_port),
        dst,
        dst_port: local_port as u16,
    };
    let redirect_port = if verdict == TraceVerdict::Redirect {
        cfg.inbound_port
    } else {
        0
    };
    trace_inbound(netns_cookie, &ends, rule, verdict, redirect_port);
    action
}

/// The addresses of an arriving connection.
struct Ends {
    ipv6: bool,
    src: [u32; 4],
    src_port: u16,
    dst: [u32; 4],
    dst_port: u16,
}

/// Tells `capture trace` of the decision, if the pod is traced (no task: `sk_lookup` runs in
/// the receiving softirq).
#[inline(always)]
fn trace_inbound(
    netns_cookie: u64,
    ends: &Ends,
    rule: InboundRule,
    verdict: TraceVerdict,
    redirect_port: u16,
) {
    trace::record(netns_cookie, false, || trace::Decision {
        hook: TraceHook::SkLookup,
        inbound: true,
        ipv6: ends.ipv6,
        udp: false,
        src: ends.src,
        src_port: ends.src_port,
        dst: ends.dst,
        dst_port: ends.dst_port,
        uid: 0,
        gid: 0,
        rule: rule as u8,
        verdict,
        redirect_port,
    });
}
