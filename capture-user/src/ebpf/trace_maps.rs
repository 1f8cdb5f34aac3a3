//! The node's trace maps (`capture_common::trace`), opened from the pins of the build the node
//! runs: the leases, the gate the programs check first, the node-wide counters and one ring
//! buffer per slot.

use std::path::PathBuf;

use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf};
use capture_common::{layout::MapId, trace::TraceLease};

use super::{
    loader::LoadError,
    node::{open_map, read_node_record},
};
use crate::paths::Paths;

pub struct TraceMaps {
    pub leases: HashMap<MapData, u64, TraceLease>,
    pub gate: Array<MapData, u32>,
    pub stats: PerCpuArray<MapData, u64>,
    maps_dir: PathBuf,
}

const RINGS: [MapId; 4] = [
    MapId::TraceRing0,
    MapId::TraceRing1,
    MapId::TraceRing2,
    MapId::TraceRing3,
];

impl TraceMaps {
    /// The maps of the node's programs.
    ///
    /// # Errors
    /// No programs on the node, or programs of a build without tracing.
    pub fn open(paths: &Paths) -> Result<Self, LoadError> {
        let record = read_node_record(paths)
            .ok_or_else(|| LoadError::NotLoaded(paths.node_record_path()))?;
        let maps_dir = record.maps_dir(paths);
        Ok(Self {
            leases: open_map(&maps_dir, MapId::TracePods)?,
            gate: open_map(&maps_dir, MapId::TraceGate)?,
            stats: open_map(&maps_dir, MapId::TraceStats)?,
            maps_dir,
        })
    }

    /// The ring buffer of `slot`.
    ///
    /// # Errors
    /// Its pin cannot be opened.
    pub fn ring(&self, slot: u32) -> Result<RingBuf<MapData>, LoadError> {
        let map = RINGS
            .get(slot as usize)
            .copied()
            .ok_or(LoadError::MissingMap("TRACE_RING_<slot>"))?;
        open_map(&self.maps_dir, map)
    }

    /// Emitted and dropped events, node-wide (`TraceStat`), summed over CPUs; zeros when unread.
    #[must_use]
    pub fn totals(&self) -> (u64, u64) {
        let sum = |i: u32| {
            self.stats
                .get(&i, 0)
                .map_or(0, |per_cpu| per_cpu.iter().sum())
        };
        (sum(0), sum(1))
    }
}
