//! The node-wide maps' fill levels at each scrape: entries in use and capacity per map (the table
//! `capture doctor` prints), so that an alert can fire before a map is full and ADDs fail. The
//! kernel keeps no entry count for hash and LPM maps: counting walks a map's keys, so a scrape
//! costs in proportion to the entries in use.

use std::fmt;

use prometheus_client::{
    collector::Collector, encoding::DescriptorEncoder, metrics::gauge::ConstGauge,
};

use super::node_metrics::family;
use crate::{
    ebpf::{limits::node_limits, sizing::NodeSizing},
    paths::Paths,
};

pub struct MapsCollector {
    paths: Paths,
    /// What the node would be loaded with, for the capacities of maps not loaded yet.
    sizing: NodeSizing,
}

impl MapsCollector {
    pub fn new(paths: Paths, sizing: NodeSizing) -> Self {
        Self { paths, sizing }
    }
}

impl fmt::Debug for MapsCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapsCollector").finish_non_exhaustive()
    }
}

impl Collector for MapsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        // Only maps that could be read: a node without programs has no series.
        let limits: Vec<_> = node_limits(&self.paths, self.sizing)
            .into_iter()
            .filter_map(|l| Some((l.map, l.in_use?, l.capacity)))
            .collect();
        let gauge = |n: usize| ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX));
        let entries: Vec<_> = limits
            .iter()
            .map(|(map, in_use, _)| ([("map", *map)], gauge(*in_use)))
            .collect();
        family(
            &mut encoder,
            "capture_map_entries",
            "Entries in use in a node-wide kernel map (capture doctor lists what each holds).",
            &entries,
        )?;
        let capacity: Vec<_> = limits
            .iter()
            .map(|(map, _, capacity)| ([("map", *map)], gauge(*capacity as usize)))
            .collect();
        family(
            &mut encoder,
            "capture_map_capacity",
            "Entries a node-wide kernel map holds at most; past it, new pods' ADDs or new connections' fast paths fail (capture doctor says which).",
            &capacity,
        )
    }
}
