//! `capture trace`'s kernel half: a decision of a traced pod becomes one event in the ring
//! buffer of the pod's lease. While no pod is traced the gate's one load is all this costs.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, generated as gen};
use capture_common::trace::{
    TraceEvent, TraceHook, TraceLease, TraceStat, TraceVerdict, TRACE_INBOUND, TRACE_IPV6,
    TRACE_TASK, TRACE_UDP, TRACE_WINDOW_NS,
};

use crate::{
    maps::{
        TRACE_GATE, TRACE_PODS, TRACE_RING_0, TRACE_RING_1, TRACE_RING_2, TRACE_RING_3, TRACE_STATS,
    },
    rodata::constant,
};

/// Whether tracing is part of the loaded programs. The loader clears it only to measure the
/// programs without it (the benchmark's `ebpf-notrace`): the verifier then prunes every path it
/// guards, so those programs hold no trace code at all.
#[no_mangle]
static TRACE_BUILT_IN: u8 = 1;

/// One decision, as the hook saw it.
pub struct Decision {
    pub hook: TraceHook,
    pub inbound: bool,
    pub ipv6: bool,
    pub udp: bool,
    pub src: [u32; 4],
    pub src_port: u16,
    pub dst: [u32; 4],
    pub dst_port: u16,
    pub uid: u32,
    pub gid: u32,
    /// `OutboundRule` or `InboundRule` as a number.
    pub rule: u8,
    pub verdict: TraceVerdict,
    pub redirect_port: u16,
}

#[inline(always)]
fn count(stat: TraceStat) {
    if let Some(p) = TRACE_STATS.get_ptr_mut(stat as u32) {
        // SAFETY: this CPU's slot.
        unsafe { *p += 1 };
    }
}

/// The pod's lease and the time now, if the pod is traced now and its rate allows one more event.
#[inline(always)]
fn admitted(netns_cookie: u64) -> Option<(&'static mut TraceLease, u64)> {
    if constant(&TRACE_BUILT_IN) == 0 {
        return None;
    }
    if TRACE_GATE.get(0).is_none_or(|traced| *traced == 0) {
        return None;
    }
    // SAFETY: the entry stays valid while the program runs; CPUs race on its counters, which
    // only makes them approximate.
    let lease = unsafe { &mut *TRACE_PODS.get_ptr_mut(netns_cookie)? };
    // SAFETY: a plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if now > lease.expires_ns {
        return None;
    }
    if now.wrapping_sub(lease.window_start_ns) >= TRACE_WINDOW_NS {
        lease.window_start_ns = now;
        lease.window_events = 0;
    }
    if lease.window_events >= lease.events_per_second {
        lease.dropped += 1;
        count(TraceStat::Dropped);
        return None;
    }
    lease.window_events += 1;
    Some((lease, now))
}

/// Emits the decision `describe` gives for the pod if it is traced; an untraced pod's decision
/// is never described (on the connection's path that is the gate's load alone). `with_task`:
/// the hook runs in the calling task (not `sk_lookup`), so its pid and command are the
/// connection's.
#[inline(always)]
pub fn record(netns_cookie: u64, with_task: bool, describe: impl FnOnce() -> Decision) {
    let Some((lease, now)) = admitted(netns_cookie) else {
        return;
    };
    let d = &describe();
    let entry = match lease.slot {
        0 => TRACE_RING_0.reserve(0),
        1 => TRACE_RING_1.reserve(0),
        2 => TRACE_RING_2.reserve(0),
        3 => TRACE_RING_3.reserve(0),
        _ => None,
    };
    let Some(mut entry) = entry else {
        lease.dropped += 1;
        count(TraceStat::Dropped);
        return;
    };
    let mut flags = 0;
    for (on, flag) in [
        (d.ipv6, TRACE_IPV6),
        (d.udp, TRACE_UDP),
        (d.inbound, TRACE_INBOUND),
        (with_task, TRACE_TASK),
    ] {
        if on {
            flags |= flag;
        }
    }
    fill(entry.as_mut_ptr(), now, with_task, flags, d);
    entry.submit(0);
    lease.emitted += 1;
    count(TraceStat::Emitted);
}

/// Writes the event field by field: a struct or array written whole becomes a memset or memcpy
/// call, which BPF does not have ("number of funcs in `func_info` doesn't match number of
/// subprogs").
#[inline(always)]
#[expect(
    clippy::cast_ptr_alignment,
    reason = "comm sits at offset 16 of an 8-byte aligned ring buffer record"
)]
fn fill(p: *mut TraceEvent, now: u64, with_task: bool, flags: u8, d: &Decision) {
    use core::ptr::write_volatile as put;
    // SAFETY: `p` is a reserved, 8-byte aligned record of the event's size; every store stays in
    // its field, and the helpers write at most the 16 bytes of `comm`.
    unsafe {
        put(&raw mut (*p).time_ns, now);
        let comm = (&raw mut (*p).comm).cast::<u64>();
        put(comm, 0);
        put(comm.add(1), 0);
        if with_task {
            put(&raw mut (*p).pid_tgid, bpf_get_current_pid_tgid());
            let _ = gen::bpf_get_current_comm(comm.cast(), 16);
        } else {
            put(&raw mut (*p).pid_tgid, 0);
        }
        for i in 0..4 {
            put(&raw mut (*p).src[i], d.src[i]);
            put(&raw mut (*p).dst[i], d.dst[i]);
        }
        put(&raw mut (*p).uid, d.uid);
        put(&raw mut (*p).gid, d.gid);
        put(&raw mut (*p).src_port, d.src_port);
        put(&raw mut (*p).dst_port, d.dst_port);
        put(&raw mut (*p).redirect_port, d.redirect_port);
        put(&raw mut (*p).hook, d.hook as u8);
        put(&raw mut (*p).rule, d.rule);
        put(&raw mut (*p).verdict, d.verdict as u8);
        put(&raw mut (*p).flags, flags);
        let pad = (&raw mut (*p)._pad).cast::<u16>();
        for i in 0..3 {
            put(pad.add(i), 0);
        }
    }
}
