//! Map keys. Every key that can contain a loopback address carries the pod's netns cookie, so two
//! pods on one node with identical `127.0.0.1` tuples never see each other's entries.

use crate::config::ListKind;

/// An entry of a per-pod port list (`PORT_LISTS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortKey {
    pub netns_cookie: u64,
    pub port: u16,
    pub list: u8,
    // Padding as separate scalars: a 5-byte array is zeroed with a memset call, which BPF lacks.
    pub _pad1: u8,
    pub _pad4: u32,
}
const _: () = assert!(size_of::<PortKey>() == 16);

impl PortKey {
    #[inline(always)]
    #[must_use]
    pub const fn new(netns_cookie: u64, list: ListKind, port: u16) -> Self {
        Self {
            netns_cookie,
            port,
            list: list as u8,
            _pad1: 0,
            _pad4: 0,
        }
    }
}

/// The data part of a `CIDR_LISTS` LPM key. The cookie, list and family are matched exactly, so the
/// prefix length of a key is `CIDR_KEY_FIXED_BITS` plus the CIDR's own prefix length.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CidrKey {
    /// The cookie as two words: a `u64` would align the key to 8 and pad it to 32 bytes.
    pub netns_cookie: [u32; 2],
    pub list: u8,
    pub family: u8,
    pub _pad: u16,
    /// Network order; an IPv4 address uses the first word only.
    pub addr: [u32; 4],
}
const _: () = assert!(size_of::<CidrKey>() == 28);
pub const CIDR_KEY_FIXED_BITS: u32 = 96;

impl CidrKey {
    #[inline(always)]
    #[must_use]
    pub const fn new(netns_cookie: u64, list: ListKind, ipv6: bool, addr: [u32; 4]) -> Self {
        Self {
            netns_cookie: [netns_cookie as u32, (netns_cookie >> 32) as u32],
            list: list as u8,
            family: if ipv6 { CIDR_FAMILY_V6 } else { CIDR_FAMILY_V4 },
            _pad: 0,
            addr,
        }
    }
}

/// Family byte in `CidrKey` (the address family as a single byte keeps the key compact).
pub const CIDR_FAMILY_V4: u8 = 4;
pub const CIDR_FAMILY_V6: u8 = 6;

/// A connection as the proxy's accepted socket sees it, used to hand the original destination
/// from the app's socket to the proxy's (`HANDOFF`). IPv4 addresses use the first word only, also
/// when a dual-stack socket carries them v4-mapped. Also each accelerated socket's key in
/// `ACCEL_PEERS`: its connection as it sees it, in its netns.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandoffKey {
    pub netns_cookie: u64,
    pub local_addr: [u32; 4],
    pub remote_addr: [u32; 4],
    pub local_port: u16,
    pub remote_port: u16,
    pub family: u16,
    pub _pad: u16,
}
const _: () = assert!(size_of::<HandoffKey>() == 48);

impl HandoffKey {
    /// A connection's key as one of its sockets sees it: `local` and `remote` are that socket's
    /// (address, port), IPv4 in word 0.
    #[inline(always)]
    #[must_use]
    pub const fn new(
        netns_cookie: u64,
        family: u16,
        local: ([u32; 4], u16),
        remote: ([u32; 4], u16),
    ) -> Self {
        Self {
            netns_cookie,
            local_addr: local.0,
            remote_addr: remote.0,
            local_port: local.1,
            remote_port: remote.1,
            family,
            _pad: 0,
        }
    }

    /// The same connection as its other end sees it.
    #[inline(always)]
    #[must_use]
    pub const fn reversed(&self) -> Self {
        Self::new(
            self.netns_cookie,
            self.family,
            (self.remote_addr, self.remote_port),
            (self.local_addr, self.local_port),
        )
    }
}

/// One of a pod's loopback addresses (`LOOPBACK_DESTS`: -> the original destination it stands
/// for; see `loopback`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoopbackKey {
    pub netns_cookie: u64,
    /// Network order.
    pub addr: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<LoopbackKey>() == 16);

/// A pod address (`INBOUND_PODS`: pod IP -> netns cookie). `sk_lookup` programs cannot learn their
/// netns, so inbound capture finds the pod by the destination address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PodAddrKey {
    /// `AF_INET` or `AF_INET6`.
    pub family: u32,
    /// Network order; IPv4 in the first word.
    pub addr: [u32; 4],
}
const _: () = assert!(size_of::<PodAddrKey>() == 20);

/// How many listening sockets per pod and family inbound capture keeps (Envoy opens one per
/// worker with `SO_REUSEPORT`). Any one of a reuseport group is enough: the kernel picks among the
/// group after `sk_lookup` assigns one. More slots keep inbound working while some of them close.
pub const LISTENER_SLOTS: u32 = 8;

/// One of a pod's inbound listeners (`INBOUND_LISTENERS`, a sockhash), per address family.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    pub netns_cookie: u64,
    pub family: u32,
    /// 0 to `LISTENER_SLOTS - 1`; a listener takes the first free one.
    pub slot: u32,
}
const _: () = assert!(size_of::<ListenerKey>() == 16);
