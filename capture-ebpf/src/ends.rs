//! A connected socket's two ends, as the program's `bpf_sock` holds them: IPv4 (also v4-mapped
//! on an IPv6 socket, a dual-stack listener's), or IPv6.

use aya_ebpf::bindings::bpf_sock;
use capture_common::{addr::unmap, AF_INET, AF_INET6};

/// Both ends of a connection: addresses in network order (`u32` for IPv4, four words for IPv6),
/// ports in host order.
pub struct Ends<A> {
    pub local: A,
    pub local_port: u16,
    pub remote: A,
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

/// Every field either family's ends need, read before anything branches on the family: loads
/// chosen by a branch are merged by the compiler into one load at a computed offset, and the
/// verifier refuses arithmetic on a socket pointer.
struct Raw {
    family: u16,
    local_port: u16,
    remote_port: u16,
    local4: u32,
    remote4: u32,
    local6: [u32; 4],
    remote6: [u32; 4],
}

#[inline(always)]
fn read(sk: *const bpf_sock) -> Option<Raw> {
    if sk.is_null() {
        return None;
    }
    // SAFETY: `sk` was checked for null; only field addresses are formed, each read through
    // `field`, and every one is readable in sock_addr and sockopt programs.
    unsafe {
        Some(Raw {
            family: field(&raw const (*sk).family) as u16,
            local_port: field(&raw const (*sk).src_port) as u16,
            remote_port: u16::from_be(field(&raw const (*sk).dst_port)),
            local4: field(&raw const (*sk).src_ip4),
            remote4: field(&raw const (*sk).dst_ip4),
            local6: [
                field(&raw const (*sk).src_ip6[0]),
                field(&raw const (*sk).src_ip6[1]),
                field(&raw const (*sk).src_ip6[2]),
                field(&raw const (*sk).src_ip6[3]),
            ],
            remote6: [
                field(&raw const (*sk).dst_ip6[0]),
                field(&raw const (*sk).dst_ip6[1]),
                field(&raw const (*sk).dst_ip6[2]),
                field(&raw const (*sk).dst_ip6[3]),
            ],
        })
    }
}

impl Raw {
    /// IPv4 ends, also v4-mapped ones of an IPv6 socket (an IPv6 socket's that are not v4-mapped
    /// read as 0.0.0.0, which no check of the callers takes).
    #[inline(always)]
    fn v4(&self) -> Option<Ends<u32>> {
        let (local, remote) = match self.family {
            AF_INET => (self.local4, self.remote4),
            AF_INET6 => (
                unmap(&self.local6).unwrap_or(0),
                unmap(&self.remote6).unwrap_or(0),
            ),
            _ => return None,
        };
        Some(Ends {
            local,
            local_port: self.local_port,
            remote,
            remote_port: self.remote_port,
        })
    }

    /// An IPv6 socket's ends (v4-mapped ones included, which no check of the callers takes for
    /// IPv6 ones).
    #[inline(always)]
    fn v6(&self) -> Option<Ends<[u32; 4]>> {
        (self.family == AF_INET6).then_some(Ends {
            local: self.local6,
            local_port: self.local_port,
            remote: self.remote6,
            remote_port: self.remote_port,
        })
    }
}

/// Both families' view of a socket's ends, from one read of it: for a caller that may need
/// either (an IPv6 socket may hold an IPv4 connection, v4-mapped).
pub struct Views {
    pub v4: Option<Ends<u32>>,
    pub v6: Option<Ends<[u32; 4]>>,
}

#[inline(always)]
pub fn views(sk: *const bpf_sock) -> Views {
    match read(sk) {
        Some(raw) => Views {
            v4: raw.v4(),
            v6: raw.v6(),
        },
        None => Views { v4: None, v6: None },
    }
}

/// The ends of `sk`'s connection, if it is IPv4 (see `Raw::v4`).
#[inline(always)]
pub fn ends4(sk: *const bpf_sock) -> Option<Ends<u32>> {
    read(sk)?.v4()
}

/// The ends of `sk`'s connection, if it is an IPv6 socket's (see `Raw::v6`).
#[inline(always)]
pub fn ends6(sk: *const bpf_sock) -> Option<Ends<[u32; 4]>> {
    read(sk)?.v6()
}
