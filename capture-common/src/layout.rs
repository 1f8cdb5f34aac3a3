//! The versions of the pinned maps' layouts, and how an upgrade or a rollback carries each map
//! from the build that pinned it to the build that takes the node over.
//!
//! A map's version changes whenever its key or value type, or the meaning of an entry, changes;
//! the unit tests pin each version to the sizes of its types, so a change that forgets to bump
//! the version fails them. Pins from before versions existed are version 1 of every map.

use crate::{
    config::{AccelCounters, PodConfig, PodCounters},
    keys::{CidrKey, HandoffKey, ListenerKey, LoopbackKey, PodAddrKey, PortKey},
    state::{OriginalDst, SockState},
    trace::TraceLease,
};

/// What a takeover does with a pinned map whose layout or definition differs from its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carry {
    /// Derived from the pod records (configs, lists, pod addresses): written afresh in the new
    /// layout, whichever build the old one came from.
    FromRecords,
    /// Derived from the pods' listening sockets: registered afresh by finding them again.
    FromSockets,
    /// Counters: converted from a layout this build knows; one it does not know restarts at
    /// zero (Prometheus counters may reset).
    Counters,
    /// State of connections in flight (the hand-off, socket-local storage): kept only in a
    /// layout this build knows, since losing it loses original destinations. Another layout
    /// stops the takeover and leaves the running programs in force.
    Live,
}

/// Every map of the kernel objects, each declared once: its name (the kernel object's static of
/// that name), its layout version, how a takeover carries it and its key and value sizes. Adding
/// or changing a map is an edit here, which the compiler holds every user to, and the unit
/// tests hold to the sizes each version had.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MapId {
    PodConfigs,
    PodCounters,
    NodeErrors,
    PortLists,
    CidrLists,
    InboundPods,
    InboundListeners,
    Handoff,
    SocketStates,
    AccelCounters,
    AccelPeers,
    LoopbackDests,
    TraceGate,
    TracePods,
    TraceStats,
    TraceRing0,
    TraceRing1,
    TraceRing2,
    TraceRing3,
}

impl MapId {
    /// This build's maps, in the order user space pins them.
    pub const ALL: [Self; 19] = [
        Self::PodConfigs,
        Self::PodCounters,
        Self::NodeErrors,
        Self::PortLists,
        Self::CidrLists,
        Self::InboundPods,
        Self::InboundListeners,
        Self::Handoff,
        Self::SocketStates,
        Self::AccelCounters,
        Self::AccelPeers,
        Self::LoopbackDests,
        Self::TraceGate,
        Self::TracePods,
        Self::TraceStats,
        Self::TraceRing0,
        Self::TraceRing1,
        Self::TraceRing2,
        Self::TraceRing3,
    ];

    /// The map's name in the object (and its pin's file name).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::PodConfigs => "POD_CONFIGS",
            Self::PodCounters => "POD_COUNTERS",
            Self::NodeErrors => "NODE_ERRORS",
            Self::PortLists => "PORT_LISTS",
            Self::CidrLists => "CIDR_LISTS",
            Self::InboundPods => "INBOUND_PODS",
            Self::InboundListeners => "INBOUND_LISTENERS",
            Self::Handoff => "HANDOFF",
            Self::SocketStates => "SOCKET_STATES",
            Self::AccelCounters => "ACCEL_COUNTERS",
            Self::AccelPeers => "ACCEL_PEERS",
            Self::LoopbackDests => "LOOPBACK_DESTS",
            Self::TraceGate => "TRACE_GATE",
            Self::TracePods => "TRACE_PODS",
            Self::TraceStats => "TRACE_STATS",
            Self::TraceRing0 => "TRACE_RING_0",
            Self::TraceRing1 => "TRACE_RING_1",
            Self::TraceRing2 => "TRACE_RING_2",
            Self::TraceRing3 => "TRACE_RING_3",
        }
    }

    /// The name as the kernel keeps it (15 bytes of it).
    #[must_use]
    pub fn kernel_name(self) -> &'static str {
        let name = self.name();
        &name[..name.len().min(15)]
    }

    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The version of its key and value layout in this build.
    #[must_use]
    pub const fn version(self) -> u32 {
        match self {
            Self::PodConfigs => POD_CONFIGS_VERSION,
            Self::PodCounters => POD_COUNTERS_VERSION,
            _ => 1,
        }
    }

    /// The capacity the object declares for a map that holds a bounded share per pod, sized for
    /// `MAX_PODS` pods (the loader scales it to the node's pod limit); `None` for the maps whose
    /// capacity does not follow the number of pods.
    #[must_use]
    pub const fn declared_capacity(self) -> Option<u32> {
        match self {
            Self::PodConfigs | Self::PodCounters | Self::AccelCounters => Some(MAX_PODS),
            Self::PortLists => Some(MAX_PORT_ENTRIES),
            Self::CidrLists => Some(MAX_CIDR_ENTRIES),
            Self::InboundPods => Some(MAX_INBOUND_ADDRESSES),
            Self::InboundListeners => Some(MAX_INBOUND_LISTENERS),
            Self::LoopbackDests => Some(MAX_LOOPBACK_DESTS),
            _ => None,
        }
    }

    #[must_use]
    pub const fn carry(self) -> Carry {
        match self {
            Self::PodConfigs | Self::PortLists | Self::CidrLists | Self::InboundPods => {
                Carry::FromRecords
            }
            Self::PodCounters | Self::NodeErrors | Self::AccelCounters => Carry::Counters,
            Self::InboundListeners => Carry::FromSockets,
            Self::Handoff
            | Self::SocketStates
            | Self::AccelPeers
            | Self::LoopbackDests
            | Self::TraceGate
            | Self::TracePods
            | Self::TraceStats
            | Self::TraceRing0
            | Self::TraceRing1
            | Self::TraceRing2
            | Self::TraceRing3 => Carry::Live,
        }
    }

    /// Key and value sizes in this build (`sk_storage` keys are socket fds).
    #[must_use]
    pub const fn sizes(self) -> (usize, usize) {
        match self {
            Self::PodConfigs => (size_of::<u64>(), size_of::<PodConfig>()),
            Self::PodCounters => (size_of::<u64>(), size_of::<PodCounters>()),
            Self::NodeErrors => (size_of::<u32>(), size_of::<u64>()),
            Self::PortLists => (size_of::<PortKey>(), 1),
            // The LPM key's prefix length comes first.
            Self::CidrLists => (4 + size_of::<CidrKey>(), 1),
            Self::InboundPods => (size_of::<PodAddrKey>(), size_of::<u64>()),
            Self::InboundListeners => (size_of::<ListenerKey>(), size_of::<u32>()),
            Self::Handoff => (size_of::<HandoffKey>(), size_of::<OriginalDst>()),
            Self::SocketStates => (size_of::<i32>(), size_of::<SockState>()),
            Self::AccelCounters => (size_of::<u64>(), size_of::<AccelCounters>()),
            Self::AccelPeers => (size_of::<HandoffKey>(), size_of::<u32>()),
            Self::LoopbackDests => (size_of::<LoopbackKey>(), size_of::<OriginalDst>()),
            Self::TraceGate => (size_of::<u32>(), size_of::<u32>()),
            Self::TracePods => (size_of::<u64>(), size_of::<TraceLease>()),
            Self::TraceStats => (size_of::<u32>(), size_of::<u64>()),
            Self::TraceRing0 | Self::TraceRing1 | Self::TraceRing2 | Self::TraceRing3 => (0, 0),
        }
    }

    #[must_use]
    pub const fn layout(self) -> MapLayout {
        MapLayout {
            map: self,
            name: self.name(),
            version: self.version(),
            carry: self.carry(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapLayout {
    pub map: MapId,
    pub name: &'static str,
    pub version: u32,
    pub carry: Carry,
}

/// Every version a build that did not record them used.
pub const UNRECORDED_VERSION: u32 = 1;

/// The maps every build that did not record layouts pinned (later builds name theirs in the
/// node record).
pub const UNRECORDED_MAPS: [MapId; 9] = [
    MapId::PodConfigs,
    MapId::PodCounters,
    MapId::NodeErrors,
    MapId::PortLists,
    MapId::CidrLists,
    MapId::InboundPods,
    MapId::InboundListeners,
    MapId::Handoff,
    MapId::SocketStates,
];

// Version 2 added the proxy container's cgroup; the variant build's 128-byte version 2 never
// left the tests, and its layout is version 3 now.
#[cfg(not(feature = "layout-next"))]
const POD_CONFIGS_VERSION: u32 = 2;
#[cfg(feature = "layout-next")]
const POD_CONFIGS_VERSION: u32 = 3;
#[cfg(not(feature = "layout-next"))]
const POD_COUNTERS_VERSION: u32 = 1;
#[cfg(feature = "layout-next")]
const POD_COUNTERS_VERSION: u32 = 2;

/// `HANDOFF`'s capacity: connections between the app's `ESTABLISHED` and the proxy's accept.
/// The next-layout variant holds more (a definition change that keeps the layout, so that a
/// takeover copies the entries).
#[cfg(not(feature = "layout-next"))]
pub const MAX_HANDOFFS: u32 = 65536;
#[cfg(feature = "layout-next")]
pub const MAX_HANDOFFS: u32 = 65536 + 4096;

/// The most pods a node can be sized for (`--max-pods`). The object declares every per-pod map
/// for this many pods; the loader scales each one down to the node's own pod limit
/// (`MapId::declared_capacity`), so that a full node's pods, each at its quotas, fit exactly.
pub const MAX_PODS: u32 = 4096;

/// A pod's share of `PORT_LISTS`: one pod cannot take another's room, however long its port
/// annotations are.
pub const POD_PORT_QUOTA: u32 = 1024;
/// A pod's share of `CIDR_LISTS`.
pub const POD_CIDR_QUOTA: u32 = 256;

/// `PORT_LISTS`'s declared capacity: every pod's port-list entries at its quota.
pub const MAX_PORT_ENTRIES: u32 = MAX_PODS * POD_PORT_QUOTA;
/// `CIDR_LISTS`'s declared capacity: every pod's CIDR-list entries (and DNS nameservers) at its
/// quota.
pub const MAX_CIDR_ENTRIES: u32 = MAX_PODS * POD_CIDR_QUOTA;
/// `INBOUND_PODS`'s capacity: one address per family per pod.
pub const MAX_INBOUND_ADDRESSES: u32 = 2 * MAX_PODS;

/// A pod's share of `INBOUND_PODS`: its IPv4 and its IPv6 address, which the map has room for on
/// every pod of a full node.
pub const POD_INBOUND_ADDRESS_QUOTA: u32 = 2;

/// `INBOUND_LISTENERS`'s capacity: every pod's listener slots, both families. The variant's is
/// larger, so that a takeover between the two registers every pod's listeners again.
#[cfg(not(feature = "layout-next"))]
pub const MAX_INBOUND_LISTENERS: u32 = 2 * MAX_PODS * crate::keys::LISTENER_SLOTS;
#[cfg(feature = "layout-next")]
pub const MAX_INBOUND_LISTENERS: u32 = 2 * MAX_PODS * crate::keys::LISTENER_SLOTS + 1024;

/// `ACCEL_PEERS`'s capacity: accelerated sockets on the node, two per connection.
pub const MAX_ACCEL_SOCKETS: u32 = 131_072;

/// `LOOPBACK_DESTS`'s declared capacity: the loopback addresses of every pod's destinations, each
/// pod at its share (`loopback::POD_LOOPBACK_QUOTA`; past it, connections to new destinations
/// take the stateful path).
pub const MAX_LOOPBACK_DESTS: u32 = MAX_PODS * crate::loopback::POD_LOOPBACK_QUOTA;

/// This build's maps' layouts, in the order user space pins them.
pub const MAP_LAYOUTS: [MapLayout; MapId::ALL.len()] = {
    let mut out = [MapId::PodConfigs.layout(); MapId::ALL.len()];
    let mut i = 0;
    while i < out.len() {
        out[i] = MapId::ALL[i].layout();
        i += 1;
    }
    out
};

/// This build's layout of the map `name`.
#[must_use]
pub fn layout_of(name: &str) -> Option<MapLayout> {
    MapId::from_name(name).map(MapId::layout)
}

/// Reads one CPU's copy of a `POD_COUNTERS` value written in layout `version`, in this build's
/// layout; `None` for a layout this build does not know. Version 1 is the ten counters of
/// `PodCounters` up to `redirected_dns`; version 2 appends one.
#[must_use]
pub fn pod_counters_from(version: u32, bytes: &[u8]) -> Option<PodCounters> {
    let words = match version {
        1 => 10,
        2 => 11,
        _ => return None,
    };
    if version > POD_COUNTERS_VERSION || bytes.len() < words * 8 {
        return None;
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        u64::from_ne_bytes(b)
    };
    Some(PodCounters {
        redirected_outbound: word(0),
        redirected_inbound: word(1),
        passed_owner: word(2),
        passed_excluded: word(3),
        passed_local: word(4),
        errors: word(5),
        captured_inbound: word(6),
        passed_inbound: word(7),
        refused_inbound: word(8),
        redirected_dns: word(9),
        #[cfg(feature = "layout-next")]
        variant_events: if words > 10 { word(10) } else { 0 },
    })
}

/// `NODE_ERRORS` keeps one u64 per error kind in every version so far.
#[must_use]
pub fn node_error_from(version: u32, bytes: &[u8]) -> Option<u64> {
    (version == 1 && bytes.len() >= 8).then(|| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[..8]);
        u64::from_ne_bytes(b)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each version's sizes. A map whose types change size must get a new version (and a row
    /// here); a change of meaning at the same size must bump the version too.
    const KNOWN: [(MapId, u32, usize, usize); 22] = [
        (MapId::PodConfigs, 1, 8, 120),
        (MapId::PodConfigs, 2, 8, 136),
        (MapId::PodConfigs, 3, 8, 144),
        (MapId::PodCounters, 1, 8, 80),
        (MapId::PodCounters, 2, 8, 88),
        (MapId::NodeErrors, 1, 4, 8),
        (MapId::PortLists, 1, 16, 1),
        (MapId::CidrLists, 1, 32, 1),
        (MapId::InboundPods, 1, 20, 8),
        (MapId::InboundListeners, 1, 16, 4),
        (MapId::Handoff, 1, 48, 20),
        (MapId::SocketStates, 1, 4, 48),
        (MapId::AccelCounters, 1, 8, 24),
        (MapId::AccelPeers, 1, 48, 4),
        (MapId::LoopbackDests, 1, 16, 20),
        (MapId::TraceGate, 1, 4, 4),
        (MapId::TracePods, 1, 8, 48),
        (MapId::TraceStats, 1, 4, 8),
        (MapId::TraceRing0, 1, 0, 0),
        (MapId::TraceRing1, 1, 0, 0),
        (MapId::TraceRing2, 1, 0, 0),
        (MapId::TraceRing3, 1, 0, 0),
    ];

    #[test]
    fn names_are_one_each_and_read_back() {
        for map in MapId::ALL {
            assert_eq!(MapId::from_name(map.name()), Some(map));
            assert_eq!(layout_of(map.name()), Some(map.layout()));
        }
        assert_eq!(MapId::InboundListeners.kernel_name(), "INBOUND_LISTENE");
    }

    #[test]
    fn every_version_names_the_sizes_it_had() {
        for layout in MAP_LAYOUTS {
            let sizes = layout.map.sizes();
            let known = KNOWN
                .iter()
                .find(|(m, v, _, _)| *m == layout.map && *v == layout.version)
                .unwrap_or_else(|| panic!("{} v{} is not in KNOWN", layout.name, layout.version));
            assert_eq!(
                (known.2, known.3),
                sizes,
                "{} changed size without a new layout version",
                layout.name
            );
        }
    }

    #[test]
    fn counters_read_from_every_known_version() {
        let words: [u64; 11] = core::array::from_fn(|i| i as u64 + 1);
        let mut bytes = [0u8; 88];
        for (i, w) in words.iter().enumerate() {
            bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_ne_bytes());
        }
        let v1 = pod_counters_from(1, &bytes[..80]).expect("v1 is known");
        assert_eq!(v1.redirected_outbound, 1);
        assert_eq!(v1.redirected_dns, 10);
        assert_eq!(pod_counters_from(1, &bytes[..72]), None, "short value");
        assert_eq!(pod_counters_from(9, &bytes), None, "unknown version");
        assert_eq!(
            pod_counters_from(2, &bytes).is_some(),
            POD_COUNTERS_VERSION >= 2,
            "a build knows only the versions up to its own"
        );
    }
}
