//! `cgroup/getsockopt`: answer `SO_ORIGINAL_DST` / `IP6T_SO_ORIGINAL_DST` for redirected
//! connections, from the socket's storage or, for the stateless redirect, from the connection's
//! loopback address. Every other option, and every socket without a recorded destination, keeps
//! exactly the kernel's answer: the program sets `optlen` to 0, which tells the kernel to leave the
//! caller's buffer and length as its own getsockopt wrote them. Left alone instead, an answer
//! longer than a page (the program's view of the buffer stops at one) fails with EFAULT before
//! Linux 6.5, and the rest are copied back from the program's copy for nothing. The one refusal:
//! `SO_ORIGINAL_DST` on a proxy socket whose hand-off was lost (see sockops.rs) fails with EPERM.

use aya_ebpf::{bindings::bpf_sock, programs::SockoptContext};
use capture_common::{
    loopback::{in_range, slot_of6},
    state::{OriginalDst, SOCK_ACCEPTED_REDIRECTED, SOCK_HANDOFF_LOST, SOCK_REDIRECTED},
    AF_INET, AF_INET6, SOL_IP, SOL_IPV6, SO_ORIGINAL_DST,
};

use crate::{
    ends::views,
    loopback,
    sockaddr::{SockaddrIn, SockaddrIn6},
    storage,
};

/// What to do with one getsockopt call.
enum Reply {
    /// The kernel's own answer.
    Kernel,
    /// The recorded original destination.
    Answer(OriginalDst),
    /// Refused (EPERM): the proxy asks for a destination that was lost.
    Refuse,
}

#[inline(always)]
fn reply(ctx: &SockoptContext) -> Reply {
    // SAFETY: the context pointer is valid for the whole program run.
    let so = unsafe { &*ctx.sockopt };
    // SAFETY: `sk` is the union's pointer member; it is checked for null.
    let sk = unsafe { so.__bindgen_anon_1.sk };
    let lost = so.optname == SO_ORIGINAL_DST
        && matches!(so.level, SOL_IP | SOL_IPV6)
        && !sk.is_null()
        && storage::get(sk.cast()).is_some_and(|s| s.has(SOCK_HANDOFF_LOST));
    if lost {
        return Reply::Refuse;
    }
    original_dst(ctx).map_or(Reply::Kernel, Reply::Answer)
}

/// The original destination to report for this option on this socket, if any.
#[inline(always)]
fn original_dst(ctx: &SockoptContext) -> Option<OriginalDst> {
    // SAFETY: the context pointer is valid for the whole program run.
    let so = unsafe { &*ctx.sockopt };
    if so.optname != SO_ORIGINAL_DST {
        return None;
    }
    // SAFETY: `sk` is the union's pointer member; it is checked for null.
    let sk = unsafe { so.__bindgen_anon_1.sk };
    if sk.is_null() {
        return None;
    }
    let orig = match storage::get(sk.cast()) {
        Some(state) if state.has(SOCK_REDIRECTED | SOCK_ACCEPTED_REDIRECTED) => state.orig,
        _ => stateless_orig(ctx, sk)?,
    };
    let family_matches = match so.level {
        SOL_IP => orig.family == AF_INET,
        SOL_IPV6 => orig.family == AF_INET6,
        _ => false,
    };
    family_matches.then_some(orig)
}

/// The original destination of a connection the stateless redirect sent to the proxy: read from
/// the proxy's side's local address, or the app's side's remote one, when it is one of the pod's
/// slot addresses (or, IPv6, a slot's twin) on its outbound port. An IPv6 socket of an IPv4
/// connection (a dual-stack listener's) holds the addresses v4-mapped.
#[inline(always)]
fn stateless_orig(ctx: &SockoptContext, sk: *mut bpf_sock) -> Option<OriginalDst> {
    let ends = views(sk);
    if let Some(v6) = ends.v6 {
        // The proxy's end is the local one on the proxy's socket, the remote one on the app's.
        let (addr, port) = if slot_of6(&v6.local).is_some() {
            (v6.local, v6.local_port)
        } else {
            (v6.remote, v6.remote_port)
        };
        if let Some(orig) = loopback::destination_at6(ctx, &addr, port) {
            return Some(orig);
        }
    }
    let v4 = ends.v4?;
    let (addr, port) = if in_range(v4.local) {
        (v4.local, v4.local_port)
    } else {
        (v4.remote, v4.remote_port)
    };
    loopback::destination_at(ctx, addr, port)
}

/// Copies `value` into the option buffer and reports success, if the caller's buffer holds it;
/// otherwise the kernel's answer stands.
#[inline(always)]
fn answer<T>(ctx: &SockoptContext, value: T) {
    // SAFETY: the buffer is bounds-checked against optval_end before the write, as the verifier
    // demands.
    unsafe {
        let so = &mut *ctx.sockopt;
        let start = so.__bindgen_anon_2.optval.cast::<u8>();
        let end = so.__bindgen_anon_3.optval_end.cast::<u8>();
        if start.add(size_of::<T>()) > end {
            keep_kernel_answer(ctx);
            return;
        }
        start.cast::<T>().write_unaligned(value);
        // Separate volatile stores: merged into one 8-byte store they are rejected by the verifier
        // ("invalid bpf_context access off=... size=8").
        core::ptr::write_volatile(&raw mut so.optlen, size_of::<T>() as i32);
        core::ptr::write_volatile(&raw mut so.retval, 0);
    }
}

/// Leaves the kernel's answer to the caller untouched (see the module's comment).
#[inline(always)]
fn keep_kernel_answer(ctx: &SockoptContext) {
    // SAFETY: the context pointer is valid for the whole program run, and optlen is writable. A
    // plain store, so that it stays one instruction at the field's offset from the context (the
    // verifier refuses a store through a context pointer moved beforehand).
    unsafe { (*ctx.sockopt).optlen = 0 };
}

#[inline(always)]
/// Returns the verdict: `false` refuses the call (EPERM).
pub fn on_getsockopt(ctx: &SockoptContext) -> bool {
    let orig = match reply(ctx) {
        Reply::Kernel => {
            keep_kernel_answer(ctx);
            return true;
        }
        Reply::Refuse => return false,
        Reply::Answer(orig) => orig,
    };
    let port = orig.port.to_be();
    if orig.family == AF_INET {
        answer(
            ctx,
            SockaddrIn {
                family: AF_INET,
                port,
                addr: orig.addr[0],
                zero: [0; 8],
            },
        );
    } else {
        answer(
            ctx,
            SockaddrIn6 {
                family: AF_INET6,
                port,
                flowinfo: 0,
                addr: orig.addr,
                scope_id: 0,
            },
        );
    }
    true
}
