//! Per-pod capture configuration as the kernel programs read it (`POD_CONFIGS`, keyed by the pod's
//! netns cookie).

/// How many proxy uids (and, separately, gids) one pod may name. Istio's `-u`/`-g` take lists, but
/// real deployments name one or two; a fixed bound keeps the kernel loop unrollable.
pub const MAX_PROXY_IDS: usize = 4;

/// `IncludeCIDRs == "*"`: every destination not excluded goes to the proxy.
pub const FLAG_INCLUDE_ALL_OUTBOUND: u32 = 1 << 0;
/// The include-CIDR list has entries in `CIDR_LISTS`.
pub const FLAG_HAS_INCLUDE_CIDRS: u32 = 1 << 1;
/// The exclude-CIDR list has entries in `CIDR_LISTS`.
pub const FLAG_HAS_EXCLUDE_CIDRS: u32 = 1 << 2;
/// `excludeOutboundPorts` has entries in `PORT_LISTS`.
pub const FLAG_HAS_EXCLUDE_OUTBOUND_PORTS: u32 = 1 << 3;
/// `includeOutboundPorts` has entries in `PORT_LISTS`.
pub const FLAG_HAS_INCLUDE_OUTBOUND_PORTS: u32 = 1 << 4;
/// An include CIDR covers a loopback prefix: iptables then omits its `-o lo … RETURN` rules
/// (parity-spec.md E.9), so local destinations fall through to the CIDR checks.
pub const FLAG_INCLUDE_COVERS_LOOPBACK: u32 = 1 << 5;
/// The pod has an IPv4 address (`pod_ip4` is valid).
pub const FLAG_HAS_POD_IP4: u32 = 1 << 6;
/// The pod has an IPv6 address (`pod_ip6` is valid).
pub const FLAG_HAS_POD_IP6: u32 = 1 << 7;
/// `includeInboundPorts == "*"`: every inbound port but the excluded ones goes to the proxy.
pub const FLAG_INBOUND_ALL_PORTS: u32 = 1 << 8;
/// `includeInboundPorts` is an explicit, non-empty list in `PORT_LISTS`.
pub const FLAG_HAS_INCLUDE_INBOUND_PORTS: u32 = 1 << 9;
/// `excludeInboundPorts` has entries in `PORT_LISTS` (only read with `FLAG_INBOUND_ALL_PORTS`).
pub const FLAG_HAS_EXCLUDE_INBOUND_PORTS: u32 = 1 << 10;
/// DNS capture (`--redirect-dns`): port 53 to the pod's nameservers goes to the DNS proxy.
pub const FLAG_DNS_CAPTURE: u32 = 1 << 11;
/// With DNS capture: every port-53 destination, not only the nameservers (the CNI default).
pub const FLAG_DNS_CAPTURE_ALL: u32 = 1 << 12;
/// The pod's connections between app and proxy skip the loopback TCP stack: their sockets go into
/// `ACCEL_PEERS` and an `sk_msg` program moves each write into the peer's receive queue. A flag
/// builds without acceleration ignore, so the layout keeps its version.
pub const FLAG_ACCELERATE: u32 = 1 << 13;
/// Proxy identity by container (`capture.dev/proxy-identity: container`): the owner exemption
/// holds only for a socket whose connecting task is in the proxy container's cgroup
/// (`proxy_container`); every other container of the pod is captured whatever its ids.
pub const FLAG_PROXY_BY_CONTAINER: u32 = 1 << 14;
/// The pod's netns routes `100::/64` to `lo` (`loopback::address6`): its IPv6 TCP connections may
/// take the stateless redirect. Set only where attach added the route; a pod attached by an
/// earlier build has no route and keeps the stateful path.
pub const FLAG_STATELESS6: u32 = 1 << 15;

/// With [`FLAG_PROXY_BY_CONTAINER`]: the proxy container has not been seen yet. A connection the
/// proxy's ids would send elsewhere than an app's is refused (exempting it could let another
/// container past the proxy, capturing it could send the proxy to itself); the proxy retries.
pub const PROXY_CONTAINER_UNKNOWN: u32 = 0;
/// The proxy container's cgroup is `proxy_cgroup_id`.
pub const PROXY_CONTAINER_KNOWN: u32 = 1;
/// The pod has no proxy container: nothing is exempt by owner, every container is captured.
pub const PROXY_CONTAINER_NONE: u32 = 2;

/// How many owner groups (`ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]`) one pod may name.
pub const MAX_OWNER_GROUPS: usize = 8;
/// Owner groups: every group is captured (`*`, no exclusions).
pub const OWNER_GROUPS_ALL: u32 = 0;
/// Owner groups: only the listed primary gids are captured (an empty list captures nothing).
pub const OWNER_GROUPS_INCLUDE: u32 = 1;
/// Owner groups: every group but the listed ones is captured.
pub const OWNER_GROUPS_EXCLUDE: u32 = 2;

/// One pod's outbound capture rules, flattened for the kernel. Addresses are in network byte order
/// (as `bpf_sock_addr` holds them), ports in host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodConfig {
    pub flags: u32,
    pub proxy_uid_count: u32,
    pub proxy_gid_count: u32,
    /// Istio's `HostIPv4LoopbackCidr` (default 127.0.0.1/32): network and mask, network order.
    pub loopback4_net: u32,
    pub loopback4_mask: u32,
    pub pod_ip4: u32,
    pub pod_ip6: [u32; 4],
    pub proxy_uids: [u32; MAX_PROXY_IDS],
    pub proxy_gids: [u32; MAX_PROXY_IDS],
    /// Where outbound connections go (15001).
    pub outbound_port: u16,
    /// Where the proxy's connections to its own pod go (15006).
    pub inbound_port: u16,
    /// Never captured from the proxy to local addresses (HBONE, 15008).
    pub tunnel_port: u16,
    /// Where captured DNS goes (15053).
    pub dns_port: u16,
    /// `OWNER_GROUPS_ALL`, `_INCLUDE` or `_EXCLUDE`.
    pub owner_group_mode: u32,
    pub owner_group_count: u32,
    pub owner_groups: [u32; MAX_OWNER_GROUPS],
    /// With [`FLAG_PROXY_BY_CONTAINER`]: `PROXY_CONTAINER_UNKNOWN`, `_KNOWN` or `_NONE`.
    pub proxy_container: u32,
    /// Explicit padding (zero), so that the cgroup id is 8-byte aligned.
    pub reserved: u32,
    /// The proxy container's cgroup v2 id (its directory's inode number).
    pub proxy_cgroup_id: u64,
    /// Only in the next-layout variant build (see `layout`): makes its `POD_CONFIGS` differ.
    #[cfg(feature = "layout-next")]
    pub variant_reserved: [u32; 2],
}
#[cfg(not(feature = "layout-next"))]
const _: () = assert!(size_of::<PodConfig>() == 136);
#[cfg(feature = "layout-next")]
const _: () = assert!(size_of::<PodConfig>() == 144);

impl PodConfig {
    #[inline(always)]
    #[must_use]
    pub const fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }
}

/// Which per-pod list an entry in `PORT_LISTS` or `CIDR_LISTS` belongs to.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListKind {
    ExcludeOutboundPorts = 1,
    IncludeOutboundPorts = 2,
    ExcludeOutboundCidrs = 3,
    IncludeOutboundCidrs = 4,
    IncludeInboundPorts = 5,
    ExcludeInboundPorts = 6,
    /// The pod's nameservers (host prefixes in `CIDR_LISTS`), for DNS capture.
    DnsNameservers = 7,
}

/// Per-pod counters (`POD_COUNTERS`, per CPU; user space sums them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize))]
pub struct PodCounters {
    /// Connections rewritten to the outbound listener (15001).
    pub redirected_outbound: u64,
    /// Proxy connections to its own pod rewritten to the inbound listener (15006).
    pub redirected_inbound: u64,
    /// Passed because the socket belongs to the proxy (uid or gid).
    pub passed_owner: u64,
    /// Passed because a port or CIDR rule excludes it, or no include rule matched.
    pub passed_excluded: u64,
    /// Passed because it stays inside the pod (loopback, own pod IP, 127.0.0.6 source).
    pub passed_local: u64,
    /// Connections the kernel programs could not handle (refused, never passed uncaptured).
    pub errors: u64,
    /// Inbound connections steered to the inbound listener (15006).
    pub captured_inbound: u64,
    /// Inbound connections left to their own listener (excluded or not included port, tunnel).
    pub passed_inbound: u64,
    /// Inbound connections refused because the pod has no inbound listener (as iptables' REDIRECT).
    pub refused_inbound: u64,
    /// DNS queries and connections rewritten to the DNS proxy (15053).
    pub redirected_dns: u64,
    /// Only in the next-layout variant build (see `layout`): makes its `POD_COUNTERS` differ.
    #[cfg(feature = "layout-next")]
    pub variant_events: u64,
}
#[cfg(not(feature = "layout-next"))]
const _: () = assert!(size_of::<PodCounters>() == 80);
#[cfg(feature = "layout-next")]
const _: () = assert!(size_of::<PodCounters>() == 88);

/// Which `PodCounters` field an event counts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodCounter {
    RedirectedOutbound,
    RedirectedInbound,
    PassedOwner,
    PassedExcluded,
    PassedLocal,
    Errors,
    CapturedInbound,
    PassedInbound,
    RefusedInbound,
    RedirectedDns,
}

impl PodCounters {
    #[inline(always)]
    pub fn bump(&mut self, which: PodCounter) {
        let field = match which {
            PodCounter::RedirectedOutbound => &mut self.redirected_outbound,
            PodCounter::RedirectedInbound => &mut self.redirected_inbound,
            PodCounter::PassedOwner => &mut self.passed_owner,
            PodCounter::PassedExcluded => &mut self.passed_excluded,
            PodCounter::PassedLocal => &mut self.passed_local,
            PodCounter::Errors => &mut self.errors,
            PodCounter::CapturedInbound => &mut self.captured_inbound,
            PodCounter::PassedInbound => &mut self.passed_inbound,
            PodCounter::RefusedInbound => &mut self.refused_inbound,
            PodCounter::RedirectedDns => &mut self.redirected_dns,
        };
        *field += 1;
    }

    /// Field-wise sum (user space adds up the per-CPU copies).
    #[must_use]
    pub fn plus(self, o: &Self) -> Self {
        Self {
            redirected_outbound: self.redirected_outbound + o.redirected_outbound,
            redirected_inbound: self.redirected_inbound + o.redirected_inbound,
            passed_owner: self.passed_owner + o.passed_owner,
            passed_excluded: self.passed_excluded + o.passed_excluded,
            passed_local: self.passed_local + o.passed_local,
            errors: self.errors + o.errors,
            captured_inbound: self.captured_inbound + o.captured_inbound,
            passed_inbound: self.passed_inbound + o.passed_inbound,
            refused_inbound: self.refused_inbound + o.refused_inbound,
            redirected_dns: self.redirected_dns + o.redirected_dns,
            #[cfg(feature = "layout-next")]
            variant_events: self.variant_events + o.variant_events,
        }
    }
}

/// Per-pod counters of the app-to-proxy acceleration (`ACCEL_COUNTERS`, per CPU; user space sums
/// them). A map of its own: `POD_COUNTERS` keeps its layout, so takeovers between builds with and
/// without acceleration carry it unchanged.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize))]
pub struct AccelCounters {
    /// Socket directions whose writes went straight to the peer's receive queue.
    pub accelerated_sends: u64,
    /// Bytes moved that way.
    pub accelerated_bytes: u64,
    /// Socket directions that stayed on the TCP stack: the peer was not in the map at the first
    /// write (or the socket could not join it).
    pub unaccelerated_sends: u64,
}
const _: () = assert!(size_of::<AccelCounters>() == 24);

impl AccelCounters {
    /// Field-wise sum (user space adds up the per-CPU copies).
    #[must_use]
    pub fn plus(self, o: &Self) -> Self {
        Self {
            accelerated_sends: self.accelerated_sends + o.accelerated_sends,
            accelerated_bytes: self.accelerated_bytes + o.accelerated_bytes,
            unaccelerated_sends: self.unaccelerated_sends + o.unaccelerated_sends,
        }
    }
}

/// Node-wide error counters (`NODE_ERRORS`, a per-CPU array indexed by this enum).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeError {
    /// A capture program ran in a netns with no pod config: the connection was refused.
    UnknownPod = 0,
    /// Socket storage could not be allocated: the connection was refused.
    NoSocketStorage = 1,
    /// The original destination could not be handed to the proxy's socket.
    HandoffFailed = 2,
    /// The proxy's inbound listener could not be registered for inbound capture.
    ListenerRegistration = 3,
}
pub const NODE_ERROR_KINDS: u32 = 4;
