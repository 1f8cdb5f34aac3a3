//! A connected socket's two ends, as the program's `bpf_sock` holds them: IPv4, or v4-mapped on
//! an IPv6 socket (a dual-stack listener's).

use aya_ebpf::bindings::bpf_sock;
use capture_common::{addr::unmap, AF_INET, AF_INET6};

/// Both ends of an IPv4 connection: addresses in network order, ports in host order.
pub struct Ends4 {
    pub local: u32,
    pub local_port: u16,
    pub remote: u32,
    pub remote_port: u16,
}

/// One field of the socket, read with a load of its own.
///
/// # Safety
/// `p` is the address of a field of a non-null `bpf_sock` the program was given.
#[inline(always)]
unsafe fn field<T: Copy>(p: *const T) -> T {
    // SAFETY: see the function's contract.
    unsafe { core::ptr::read_volatile(p) }
}

/// The ends of `sk`'s connection, if it is IPv4 (an IPv6 socket's that are not v4-mapped read
/// as 0.0.0.0, which no check of the callers takes).
#[inline(always)]
pub fn ends4(sk: *const bpf_sock) -> Option<Ends4> {
    if sk.is_null() {
        return None;
    }
    // Every field is read, each with a volatile load of its own, before anything branches on
    // the family: loads chosen by a branch are merged by the compiler into one load at a
    // computed offset, and the verifier refuses arithmetic on a socket pointer.
    // SAFETY: `sk` was checked for null; only field addresses are formed, each read through
    // `field`, and every one is readable in sock_addr and sockopt programs.
    let (family, local_port, remote_port, local4, remote4, local6, remote6) = unsafe {
        (
            field(&raw const (*sk).family) as u16,
            field(&raw const (*sk).src_port) as u16,
            u16::from_be(field(&raw const (*sk).dst_port)),
            field(&raw const (*sk).src_ip4),
            field(&raw const (*sk).dst_ip4),
            [
                field(&raw const (*sk).src_ip6[0]),
                field(&raw const (*sk).src_ip6[1]),
                field(&raw const (*sk).src_ip6[2]),
                field(&raw const (*sk).src_ip6[3]),
            ],
            [
                field(&raw const (*sk).dst_ip6[0]),
                field(&raw const (*sk).dst_ip6[1]),
                field(&raw const (*sk).dst_ip6[2]),
                field(&raw const (*sk).dst_ip6[3]),
            ],
        )
    };
    let (local, remote) = match family {
        AF_INET => (local4, remote4),
        AF_INET6 => (unmap(&local6).unwrap_or(0), unmap(&remote6).unwrap_or(0)),
        _ => return None,
    };
    Some(Ends4 {
        local,
        local_port,
        remote,
        remote_port,
    })
}
