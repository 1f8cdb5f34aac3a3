//! Per-socket state, kept in socket-local storage (`SOCKET_STATES`) so it dies with the socket.

/// A destination before capture rewrote it. IPv4 uses the first address word only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OriginalDst {
    /// Network order.
    pub addr: [u32; 4],
    /// Host order.
    pub port: u16,
    /// `AF_INET` or `AF_INET6` (a v4-mapped destination is `AF_INET`).
    pub family: u16,
}
const _: () = assert!(size_of::<OriginalDst>() == 20);

/// The creator's uid/gid are recorded (`sock_create` ran for this socket).
pub const SOCK_CREATOR_KNOWN: u32 = 1 << 0;
/// The app's socket whose `connect()` was rewritten: getpeername and getsockopt answer `orig`.
pub const SOCK_REDIRECTED: u32 = 1 << 1;
/// The proxy's accepted socket for a redirected connection: getsockopt answers `orig`.
pub const SOCK_ACCEPTED_REDIRECTED: u32 = 1 << 2;
/// The pod's inbound listener (15006). Its accepted sockets inherit the flag and, unless the
/// hand-off names another destination, report their own local address as the original one.
pub const SOCK_INBOUND_LISTENER: u32 = 1 << 3;
/// A UDP socket that sent a datagram to a nameserver which capture redirected to the DNS proxy:
/// replies from the proxy are reported as coming from `orig`.
pub const SOCK_DNS_SENT: u32 = 1 << 4;
/// `netns_cookie` is known although the creator is not: a listener that predates the attach,
/// given its pod's netns by user space (its accepted sockets inherit both).
pub const SOCK_NETNS_KNOWN: u32 = 1 << 5;

/// The proxy's accepted socket for a connection from its pod to the outbound port whose
/// hand-off was not found: its original destination is lost, so `SO_ORIGINAL_DST` is refused
/// (EPERM) rather than answered with anything the proxy could forward to. A flag old builds
/// ignore, so the layout keeps its version.
pub const SOCK_HANDOFF_LOST: u32 = 1 << 6;

/// Acceleration: the socket's first write found its peer in `ACCEL_PEERS`, so every write goes
/// to the peer directly while the peer is in the map. Flags old builds ignore.
pub const SOCK_ACCEL_REDIRECTING: u32 = 1 << 7;
/// Acceleration: the socket's first write did not find its peer (or the socket could not join
/// the map) and went through TCP, so every later one does too: the peer must never read bytes out
/// of order, and the kernel reads redirected bytes before those in the TCP receive queue.
pub const SOCK_ACCEL_PASSING: u32 = 1 << 8;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockState {
    /// The netns the socket was created in, recorded at creation (listeners pass it to the
    /// sockets they accept, because the storage map clones into child sockets).
    pub netns_cookie: u64,
    pub orig: OriginalDst,
    pub flags: u32,
    /// The socket creator's credentials: iptables' owner match uses them, not the caller's.
    pub creator_uid: u32,
    pub creator_gid: u32,
    /// The local port `orig` was rewritten to (15001, 15006, 15053).
    pub redirected_port: u16,
    pub _pad16: u16,
    pub _pad32: u32,
}
const _: () = assert!(size_of::<SockState>() == 48);

impl SockState {
    /// Whether any of `flags` is set.
    #[inline(always)]
    #[must_use]
    pub const fn has(&self, flags: u32) -> bool {
        self.flags & flags != 0
    }
}
