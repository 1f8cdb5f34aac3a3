//! `capture trace`: the decisions of one pod's programs, streamed live while someone looks.
//!
//! A trace session leases one of [`TRACE_SLOTS`] ring buffers for one pod (`TRACE_PODS`, keyed by
//! the pod's netns cookie). The programs check a one-element gate first (`TRACE_GATE`, the number
//! of leases): while nobody traces, that load is all tracing costs. A lease expires on its own
//! (`expires_ns`), so a session that dies leaves no pod traced for longer than one lease, and it
//! limits the pod's events per second; what the limit or a full ring drops is counted.

/// Ring buffers, so pods traced at the same time per node.
pub const TRACE_SLOTS: u32 = 4;
/// Bytes of each ring buffer (a power of two, a multiple of the page size).
pub const TRACE_RING_BYTES: u32 = 256 * 1024;
/// How long a lease lasts unless renewed; a session renews it every second.
pub const TRACE_LEASE_NS: u64 = 5_000_000_000;
/// The rate-limit window.
pub const TRACE_WINDOW_NS: u64 = 1_000_000_000;

/// The program that decided.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceHook {
    Connect4 = 1,
    Connect6,
    Sendmsg4,
    Sendmsg6,
    SkLookup,
}

impl TraceHook {
    pub const ALL: [Self; 5] = [
        Self::Connect4,
        Self::Connect6,
        Self::Sendmsg4,
        Self::Sendmsg6,
        Self::SkLookup,
    ];

    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Connect4 => "connect4",
            Self::Connect6 => "connect6",
            Self::Sendmsg4 => "sendmsg4",
            Self::Sendmsg6 => "sendmsg6",
            Self::SkLookup => "sk_lookup",
        }
    }

    #[must_use]
    pub fn from_u8(value: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|h| *h as u8 == value)
    }
}

/// What happened to the connection.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceVerdict {
    /// Sent to the proxy's `redirect_port`.
    Redirect = 1,
    Pass,
    /// Inbound to a port the proxy does not listen on: dropped, the client gets a reset.
    Refuse,
}

/// [`TraceEvent::flags`]: an IPv6 connection (v4-mapped ones count as IPv4).
pub const TRACE_IPV6: u8 = 1;
/// [`TraceEvent::flags`]: UDP.
pub const TRACE_UDP: u8 = 2;
/// [`TraceEvent::flags`]: inbound (the rule is an `InboundRule`).
pub const TRACE_INBOUND: u8 = 4;
/// [`TraceEvent::flags`]: `pid_tgid` and `comm` are the calling task's (not in `sk_lookup`).
pub const TRACE_TASK: u8 = 8;

/// One decision, as the ring buffer carries it. Addresses are in network order (IPv4 in word 0),
/// ports in host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// `bpf_ktime_get_ns` (`CLOCK_MONOTONIC`).
    pub time_ns: u64,
    pub pid_tgid: u64,
    pub comm: [u8; 16],
    /// The socket's bound source (outbound), or the client (inbound).
    pub src: [u32; 4],
    /// The destination the connection asked for: the original destination.
    pub dst: [u32; 4],
    /// The owner the decision used (outbound).
    pub uid: u32,
    pub gid: u32,
    pub src_port: u16,
    pub dst_port: u16,
    /// The proxy's port for a redirect, else 0.
    pub redirect_port: u16,
    pub hook: u8,
    /// `OutboundRule` or `InboundRule` (by [`TRACE_INBOUND`]) as a number.
    pub rule: u8,
    pub verdict: u8,
    pub flags: u8,
    pub _pad: [u8; 6],
}

const _: () = assert!(size_of::<TraceEvent>() == 88);

/// A pod's trace lease (`TRACE_PODS`' value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceLease {
    /// `CLOCK_MONOTONIC` nanoseconds after which the programs stop emitting.
    pub expires_ns: u64,
    pub window_start_ns: u64,
    /// Events the rate limit or a full ring buffer dropped (approximate: CPUs race on it).
    pub dropped: u64,
    pub emitted: u64,
    /// The session's process, so that a second session can tell a live lease from a dead one.
    pub owner_pid: u32,
    /// Which ring buffer (`TRACE_RING_<slot>`).
    pub slot: u32,
    pub events_per_second: u32,
    pub window_events: u32,
}

const _: () = assert!(size_of::<TraceLease>() == 48);

/// `TRACE_STATS`' indices: node-wide, per CPU, for metrics.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceStat {
    Emitted = 0,
    Dropped = 1,
}

pub const TRACE_STATS: u32 = 2;
