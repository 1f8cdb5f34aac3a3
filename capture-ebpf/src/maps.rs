//! Every map the programs share. User space creates them once per node (they are pinned) and
//! fills the per-pod entries on attach.

use crate::socket_states::SocketStates;
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{
        lpm_trie::Key, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf,
        SockHash,
    },
    macros::btf_map,
};
use capture_common::{
    config::{AccelCounters, ListKind, PodConfig, PodCounters, NODE_ERROR_KINDS},
    decision::PodLists,
    keys::{
        CidrKey, HandoffKey, ListenerKey, LoopbackKey, PodAddrKey, PortKey, CIDR_KEY_FIXED_BITS,
    },
    layout,
    state::OriginalDst,
    trace::{
        TraceEvent, TraceLease, TRACE_RING_BYTES, TRACE_SLOTS, TRACE_STATS as TRACE_STAT_COUNT,
    },
};

/// Pods one node can capture at once (the loader scales each per-pod map to the node's limit).
const MAX_PODS: usize = layout::MAX_PODS as usize;
const MAX_PORT_ENTRIES: usize = layout::MAX_PORT_ENTRIES as usize;
const MAX_CIDR_ENTRIES: usize = layout::MAX_CIDR_ENTRIES as usize;
/// Connections between the app's `ESTABLISHED` and the proxy's accept. Entries normally live for
/// one handshake; LRU eviction bounds what a lost handshake leaves behind.
const MAX_HANDOFFS: usize = layout::MAX_HANDOFFS as usize;

#[btf_map]
pub static POD_CONFIGS: HashMap<u64, PodConfig, MAX_PODS> = HashMap::new();

#[btf_map]
pub static POD_COUNTERS: PerCpuHashMap<u64, PodCounters, MAX_PODS> = PerCpuHashMap::new();

#[btf_map]
pub static NODE_ERRORS: PerCpuArray<u64, { NODE_ERROR_KINDS as usize }> = PerCpuArray::new();

/// Allocated as used: the capacity is every pod's quota, and most pods list a few ports.
#[btf_map]
pub static PORT_LISTS: HashMap<PortKey, u8, MAX_PORT_ENTRIES, { BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

#[btf_map]
pub static CIDR_LISTS: LpmTrie<CidrKey, u8, MAX_CIDR_ENTRIES> = LpmTrie::new();

/// Pod IP -> netns cookie, for inbound capture (`sk_lookup` knows only the destination address).
#[btf_map]
pub static INBOUND_PODS: HashMap<PodAddrKey, u64, { layout::MAX_INBOUND_ADDRESSES as usize }> =
    HashMap::new();

/// Each pod's inbound listener (15006) per family, registered when the proxy calls `listen()`.
#[btf_map]
pub static INBOUND_LISTENERS: SockHash<ListenerKey, { layout::MAX_INBOUND_LISTENERS as usize }> =
    SockHash::new();

#[btf_map]
pub static HANDOFF: LruHashMap<HandoffKey, OriginalDst, MAX_HANDOFFS> = LruHashMap::new();

#[btf_map]
pub static SOCKET_STATES: SocketStates = SocketStates::new();

/// Each accelerated socket under its own tuple (`HandoffKey`), so that its peer finds it; the
/// `sk_msg` program is attached to this map.
#[btf_map]
pub static ACCEL_PEERS: SockHash<HandoffKey, { layout::MAX_ACCEL_SOCKETS as usize }> =
    SockHash::new();

#[btf_map]
pub static ACCEL_COUNTERS: PerCpuHashMap<u64, AccelCounters, MAX_PODS> = PerCpuHashMap::new();

/// Each pod's loopback address per original destination (see `capture_common::loopback`):
/// written by the first connect to a destination, kept while the pod lives. Allocated as used,
/// since most pods use a sliver of their quota.
#[btf_map]
pub static LOOPBACK_DESTS: HashMap<
    LoopbackKey,
    OriginalDst,
    { layout::MAX_LOOPBACK_DESTS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// The pod's lists, read through the maps for one netns.
pub struct MapLists {
    pub netns_cookie: u64,
}

impl PodLists for MapLists {
    #[inline(always)]
    fn port_listed(&self, list: ListKind, port: u16) -> bool {
        // SAFETY: the value is a plain byte, read once.
        unsafe { PORT_LISTS.get(PortKey::new(self.netns_cookie, list, port)) }.is_some()
    }

    #[inline(always)]
    fn cidr_listed(&self, list: ListKind, ipv6: bool, addr: &[u32; 4]) -> bool {
        let bits = if ipv6 { 128 } else { 32 };
        let key = Key::new(
            CIDR_KEY_FIXED_BITS + bits,
            CidrKey::new(self.netns_cookie, list, ipv6, *addr),
        );
        CIDR_LISTS.get(&key).is_some()
    }
}

/// How many pods are traced (`capture trace`): the programs look at nothing else of tracing
/// while it is 0. One array element, which the verifier turns into a direct load.
#[btf_map]
pub static TRACE_GATE: Array<u32, 1> = Array::new();

/// Traced pods' leases, by netns cookie.
#[btf_map]
pub static TRACE_PODS: HashMap<u64, TraceLease, { TRACE_SLOTS as usize }> = HashMap::new();

/// Events emitted and dropped, node-wide (`TraceStat`).
#[btf_map]
pub static TRACE_STATS: PerCpuArray<u64, { TRACE_STAT_COUNT as usize }> = PerCpuArray::new();

/// One ring buffer per trace slot: each session reads its own.
#[btf_map]
pub static TRACE_RING_0: RingBuf<TraceEvent, { TRACE_RING_BYTES as usize }> = RingBuf::new();
#[btf_map]
pub static TRACE_RING_1: RingBuf<TraceEvent, { TRACE_RING_BYTES as usize }> = RingBuf::new();
#[btf_map]
pub static TRACE_RING_2: RingBuf<TraceEvent, { TRACE_RING_BYTES as usize }> = RingBuf::new();
#[btf_map]
pub static TRACE_RING_3: RingBuf<TraceEvent, { TRACE_RING_BYTES as usize }> = RingBuf::new();
