//! The listener adopter's request and answer (capture-ebpf's `adopt-listeners` object).
//!
//! An agent without the node's PID namespace cannot take another process's descriptors
//! (`pidfd_open` only finds processes of its own PID namespace), so it cannot hand the kernel a
//! listener the pod's proxy opened before the attach. The adopter does it in the kernel instead:
//! user space runs it with `BPF_PROG_TEST_RUN` from inside the pod's netns, with one request in
//! the test packet; it looks the listener up by address (`bpf_sk_lookup_tcp`), registers it as the
//! attach would have, and writes its answer into the packet. Each run finds one socket: a
//! `SO_REUSEPORT` group answers with the member the source port hashes to, so user space varies
//! `source_port` until it has met every member `sock_diag` counted.

/// Where the request starts in the test packet: after the Ethernet header a `BPF_PROG_TEST_RUN`
/// of a traffic-control program needs.
pub const REQUEST_OFFSET: usize = 14;
/// Where the answer is written: after the request.
pub const ANSWER_OFFSET: usize = REQUEST_OFFSET + size_of::<AdoptRequest>();
/// The whole test packet.
pub const PACKET_LEN: usize = ANSWER_OFFSET + size_of::<AdoptAnswer>();

/// Register the listener for the pod's inbound capture: its socket state (the pod's netns,
/// `SOCK_INBOUND_LISTENER`) and the first free slot of the pod's listener map.
pub const ACTION_INBOUND: u32 = 1;
/// Give an outbound listener that has no socket state the pod's netns (`SOCK_NETNS_KNOWN`).
pub const ACTION_OUTBOUND: u32 = 2;

/// No listening TCP socket takes that address and port in the netns.
pub const OUTCOME_NOT_FOUND: u32 = 1;
/// Registered now (`slot` says where, for `ACTION_INBOUND`).
pub const OUTCOME_REGISTERED: u32 = 2;
/// Registered before (by the kernel at `listen()`, or an earlier run): nothing changed.
pub const OUTCOME_ALREADY: u32 = 3;
/// Every slot of the pod's family is taken by other sockets.
pub const OUTCOME_SLOTS_FULL: u32 = 4;
/// The kernel could not allocate the socket's state.
pub const OUTCOME_NO_STATE: u32 = 5;
/// The listener map refused the socket (`error` holds the errno).
pub const OUTCOME_MAP_REFUSED: u32 = 6;
/// The request was not one the adopter knows.
pub const OUTCOME_BAD_REQUEST: u32 = 7;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdoptRequest {
    pub netns_cookie: u64,
    /// The listener's local address, network order (IPv4 in the first word): its own, so that a
    /// listener on one address is told from a wildcard one on the same port.
    pub addr: [u32; 4],
    /// `AF_INET` or `AF_INET6`: the socket's family (a dual-stack listener is `AF_INET6`).
    pub family: u32,
    /// Host order.
    pub port: u16,
    /// The lookup's source port, host order.
    pub source_port: u16,
    /// `ACTION_*`.
    pub action: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<AdoptRequest>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdoptAnswer {
    /// Which socket the lookup found: equal for one socket and different between two while they
    /// live. Only compared, never shown (it is the socket's kernel address).
    pub socket: u64,
    /// `OUTCOME_*`.
    pub outcome: u32,
    /// The listener slot (`ACTION_INBOUND`), or the map's errno (`OUTCOME_MAP_REFUSED`).
    pub detail: u32,
}
const _: () = assert!(size_of::<AdoptAnswer>() == 16);
