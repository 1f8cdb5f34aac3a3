//! How many pods the node's maps are sized for (`--max-pods`).
//!
//! Every map that holds a share per pod (configs, counters, port and CIDR lists, pod addresses,
//! listener slots, loopback destinations) is created with room for exactly `max_pods` pods at
//! their quotas, and an attach past `max_pods` pods is refused before anything is written. So no
//! combination of pods within their quotas can take the room of another: the node runs out of
//! pods (the kubelet's `maxPods`) before it runs out of map entries. The maps whose entries follow
//! connections, not pods (hand-offs, accelerated sockets), keep fixed capacities: see
//! docs/how-it-works/limits.md for why neither lets one pod block another.

use capture_common::layout::{MapId, MAX_PODS};

/// Kubernetes' own default `maxPods` is 110, and managed platforms allow up to about 250.
pub const DEFAULT_MAX_PODS: u32 = 256;

/// The pod limit the node's maps are (or are to be) sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NodeSizing {
    pub max_pods: u32,
}

#[derive(Debug, thiserror::Error)]
#[error("--max-pods {given}: a node can be sized for 1 to {MAX_PODS} pods; give the kubelet's maxPods (or more)")]
pub struct SizingError {
    pub given: u32,
}

impl NodeSizing {
    /// For loads that only probe the kernel: the smallest maps.
    pub const PROBE: Self = Self { max_pods: 1 };

    pub fn new(max_pods: u32) -> Result<Self, SizingError> {
        if (1..=MAX_PODS).contains(&max_pods) {
            Ok(Self { max_pods })
        } else {
            Err(SizingError { given: max_pods })
        }
    }

    /// The capacity of `map` on a node of this sizing: the object's declared capacity scaled
    /// from `MAX_PODS` pods to `max_pods` (rounded up); `None` for a map of fixed capacity.
    #[must_use]
    pub fn capacity(self, map: MapId) -> Option<u32> {
        let declared = u64::from(map.declared_capacity()?);
        let scaled = (declared * u64::from(self.max_pods)).div_ceil(u64::from(MAX_PODS));
        Some(u32::try_from(scaled).expect("at most the declared capacity"))
    }

    /// Every sized map with its capacity, for the loader.
    pub fn capacities(self) -> impl Iterator<Item = (MapId, u32)> {
        MapId::ALL
            .into_iter()
            .filter_map(move |m| Some((m, self.capacity(m)?)))
    }

    /// The name of the pin directory of this build's programs at this sizing: a node resized
    /// by its agent is taken over in place like a node of another build.
    #[must_use]
    pub fn pin_dir_name(self, object_id: &str) -> String {
        if self == Self::default() {
            object_id.to_string()
        } else {
            format!("{object_id}-{}pods", self.max_pods)
        }
    }
}

impl Default for NodeSizing {
    fn default() -> Self {
        Self {
            max_pods: DEFAULT_MAX_PODS,
        }
    }
}

#[cfg(test)]
mod tests {
    use capture_common::layout::{
        MAX_INBOUND_LISTENERS, POD_CIDR_QUOTA, POD_INBOUND_ADDRESS_QUOTA, POD_PORT_QUOTA,
    };

    use super::*;

    #[test]
    fn every_pod_at_its_quotas_fits_a_node_of_any_size() {
        for max_pods in [1, 3, DEFAULT_MAX_PODS, 1000, MAX_PODS] {
            let sizing = NodeSizing::new(max_pods).expect("in range");
            let cap = |m| sizing.capacity(m).expect("sized");
            assert_eq!(cap(MapId::PodConfigs), max_pods);
            assert_eq!(cap(MapId::PodCounters), max_pods);
            assert_eq!(cap(MapId::AccelCounters), max_pods);
            assert!(cap(MapId::PortLists) >= max_pods * POD_PORT_QUOTA);
            assert!(cap(MapId::CidrLists) >= max_pods * POD_CIDR_QUOTA);
            assert!(cap(MapId::InboundPods) >= max_pods * POD_INBOUND_ADDRESS_QUOTA);
            assert!(
                cap(MapId::InboundListeners) >= 2 * max_pods * capture_common::keys::LISTENER_SLOTS
            );
            assert_eq!(
                cap(MapId::LoopbackDests),
                max_pods * capture_common::loopback::POD_LOOPBACK_QUOTA
            );
        }
        assert_eq!(
            NodeSizing::new(MAX_PODS)
                .expect("in range")
                .capacity(MapId::InboundListeners),
            Some(MAX_INBOUND_LISTENERS)
        );
    }

    #[test]
    fn maps_of_connections_keep_their_capacity() {
        for map in [MapId::Handoff, MapId::AccelPeers, MapId::SocketStates] {
            assert_eq!(NodeSizing::default().capacity(map), None, "{map:?}");
        }
    }

    #[test]
    fn out_of_range_sizes_are_refused_with_the_fix() {
        for given in [0, MAX_PODS + 1] {
            let err = NodeSizing::new(given).expect_err("out of range");
            assert!(err.to_string().contains("maxPods"), "{err}");
        }
    }

    #[test]
    fn the_default_sizing_keeps_the_builds_pin_directory() {
        assert_eq!(NodeSizing::default().pin_dir_name("abc"), "abc");
        let larger = NodeSizing::new(512).expect("in range");
        assert_eq!(larger.pin_dir_name("abc"), "abc-512pods");
    }
}
