//! The node-wide maps' capacities and each pod's share of them.
//!
//! Every pod's list entries live in maps the whole node shares, so without a quota one pod with
//! long annotations could fill a map and make every later pod's ADD fail. A pod over its quota
//! is refused before anything of it is written; the others are untouched.

use std::{collections::BTreeSet, os::fd::AsFd as _};

use capture_common::{
    keys::LISTENER_SLOTS,
    layout::{
        MapId, MAX_ACCEL_SOCKETS, MAX_HANDOFFS, POD_CIDR_QUOTA, POD_INBOUND_ADDRESS_QUOTA,
        POD_PORT_QUOTA,
    },
    loopback::POD_LOOPBACK_QUOTA,
    trace::TRACE_SLOTS,
};
use serde::Serialize;

use super::{node, sizing::NodeSizing, sys};
use crate::{config::CaptureConfig, paths::Paths};

/// A pod whose lists would take more than its share of a node-wide map.
#[derive(Debug, thiserror::Error)]
#[error("the pod needs {count} {what} entries ({from}); a pod may have at most {quota} on the ebpf backend, its share of the node's maps: {fix}")]
pub struct QuotaExceeded {
    pub what: &'static str,
    pub from: &'static str,
    pub count: usize,
    pub quota: u32,
    pub fix: &'static str,
}

/// How much of each node-wide list map a pod's config takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodUsage {
    pub ports: usize,
    pub cidrs: usize,
    pub addresses: usize,
}

impl PodUsage {
    /// Distinct entries, as the maps key them (a repeated port or CIDR is one entry).
    #[must_use]
    pub fn of(cfg: &CaptureConfig) -> Self {
        let ports: BTreeSet<_> = super::list_entries::port_entries(cfg)
            .into_iter()
            .map(|(list, port)| (list as u8, port))
            .collect();
        let cidrs: BTreeSet<_> = super::list_entries::cidr_entries(cfg)
            .into_iter()
            .map(|(list, net)| (list as u8, net.trunc()))
            .collect();
        Self {
            ports: ports.len(),
            cidrs: cidrs.len(),
            addresses: usize::from(cfg.pod_ip4.is_some()) + usize::from(cfg.pod_ip6.is_some()),
        }
    }
}

/// Refuses a config over any quota, naming the annotations that fill it.
pub fn check(cfg: &CaptureConfig) -> Result<(), QuotaExceeded> {
    let usage = PodUsage::of(cfg);
    let shares = [
        QuotaExceeded {
            what: "port-list",
            from: "the include/exclude inbound and outbound port annotations",
            count: usage.ports,
            quota: POD_PORT_QUOTA,
            fix: "list fewer ports (includeInboundPorts '*' with excludeInboundPorts, or the reverse, often needs fewer), or capture this pod with --mode iptables",
        },
        QuotaExceeded {
            what: "CIDR-list",
            from: "includeOutboundIPRanges, excludeOutboundIPRanges and the DNS nameservers",
            count: usage.cidrs,
            quota: POD_CIDR_QUOTA,
            fix: "merge adjacent ranges into fewer, wider CIDRs, or capture this pod with --mode iptables",
        },
        QuotaExceeded {
            what: "inbound-address",
            from: "the pod's IPs",
            count: usage.addresses,
            quota: POD_INBOUND_ADDRESS_QUOTA,
            fix: "give the pod one address per family",
        },
    ];
    shares
        .into_iter()
        .find(|s| s.count > s.quota as usize)
        .map_or(Ok(()), Err)
}

/// One node-wide map: what it holds, its capacity, a pod's share, and how full it is now.
#[derive(Clone, Debug, Serialize)]
pub struct NodeLimit {
    pub map: &'static str,
    pub holds: &'static str,
    pub capacity: u32,
    /// `None` where the map needs no quota (a fixed number of entries per pod, or entries that
    /// live only as long as a handshake).
    pub per_pod: Option<u32>,
    /// Entries now, when the node's maps are pinned and readable.
    pub in_use: Option<usize>,
}

/// The node's limits, with the entries in use where the node is loaded. A pinned map's capacity
/// is its own; without pins, what `wanted` (`--max-pods`) would load.
#[must_use]
pub fn node_limits(paths: &Paths, wanted: NodeSizing) -> Vec<NodeLimit> {
    let record = node::read_node_record(paths);
    let maps_dir = record.as_ref().map(|r| r.maps_dir(paths));
    let sizing = record.map_or(wanted, |r| r.sizing());
    let open = |map: &str| sys::obj_get(&maps_dir.as_ref()?.join(map)).ok();
    let row = |map: MapId, holds, per_pod| {
        let fd = open(map.name());
        NodeLimit {
            map: map.name(),
            holds,
            capacity: fd
                .as_ref()
                .and_then(|fd| sys::map_definition(fd.as_fd()).ok())
                .map_or_else(
                    || sizing.capacity(map).unwrap_or_else(|| fixed_capacity(map)),
                    |d| d.max_entries,
                ),
            per_pod,
            in_use: fd.and_then(|fd| count_entries(&fd).ok()),
        }
    };
    vec![
        row(MapId::PodConfigs, "captured pods (--max-pods)", Some(1)),
        row(MapId::PodCounters, "pods' counters", Some(1)),
        row(
            MapId::PortLists,
            "port-list entries",
            Some(POD_PORT_QUOTA),
        ),
        row(
            MapId::CidrLists,
            "CIDR-list entries and DNS nameservers",
            Some(POD_CIDR_QUOTA),
        ),
        row(
            MapId::InboundPods,
            "pod addresses for inbound capture",
            Some(POD_INBOUND_ADDRESS_QUOTA),
        ),
        row(
            MapId::InboundListeners,
            "inbound listeners (per pod and family: 8 slots)",
            Some(2 * LISTENER_SLOTS),
        ),
        row(
            MapId::Handoff,
            "handshakes in flight between an app and its proxy (LRU: the oldest goes first)",
            None,
        ),
        row(
            MapId::LoopbackDests,
            "loopback addresses of the pods' destinations (stateless redirect; when a pod has no \
             address free, its connections to new destinations take the stateful path)",
            Some(POD_LOOPBACK_QUOTA),
        ),
        row(
            MapId::AccelPeers,
            "accelerated sockets (two per accelerated connection; when full, connections stay on TCP)",
            None,
        ),
        row(MapId::AccelCounters, "pods' acceleration counters", Some(1)),
        row(MapId::TracePods, "traced pods (capture trace)", None),
    ]
}

/// The capacity of a map that does not follow the number of pods.
fn fixed_capacity(map: MapId) -> u32 {
    match map {
        MapId::Handoff => MAX_HANDOFFS,
        MapId::AccelPeers => MAX_ACCEL_SOCKETS,
        MapId::TracePods => TRACE_SLOTS,
        _ => 0,
    }
}

/// Walks the keys of a map (the kernel has no entry count for hash and LPM maps).
fn count_entries(map: &std::os::fd::OwnedFd) -> std::io::Result<usize> {
    let def = sys::map_definition(map.as_fd())?;
    let mut key = vec![0u8; def.key_size as usize];
    let mut next = vec![0u8; def.key_size as usize];
    let mut n = 0;
    let mut first = true;
    while sys::map_next_key(map.as_fd(), (!first).then_some(key.as_slice()), &mut next)? {
        n += 1;
        first = false;
        std::mem::swap(&mut key, &mut next);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Selection;

    fn config() -> CaptureConfig {
        let spec = crate::config::PodSpec {
            pod_ips: vec!["10.1.0.10".parse().expect("ip")],
            ..crate::config::PodSpec::default()
        };
        CaptureConfig::from_pod(&spec).expect("the default config")
    }

    #[test]
    fn a_pod_at_its_quotas_is_accepted_and_one_more_entry_is_not() {
        let mut cfg = config();
        // The default config lists the proxy's own inbound ports already.
        let room = POD_PORT_QUOTA as usize - PodUsage::of(&cfg).ports;
        cfg.exclude_outbound_ports = (1..=room as u16).collect();
        assert!(check(&cfg).is_ok(), "{:?}", check(&cfg));
        cfg.exclude_outbound_ports.push(room as u16 + 1);
        let err = check(&cfg).expect_err("over the port quota");
        assert_eq!(err.count, POD_PORT_QUOTA as usize + 1);
        assert!(err.to_string().contains("--mode iptables"), "{err}");
    }

    #[test]
    fn repeated_entries_count_once() {
        let mut cfg = config();
        let before = PodUsage::of(&cfg).ports;
        cfg.exclude_outbound_ports = vec![80; 5000];
        assert_eq!(PodUsage::of(&cfg).ports, before + 1);
        assert!(check(&cfg).is_ok());
    }

    #[test]
    fn cidrs_of_every_list_share_the_quota() {
        let mut cfg = config();
        let nets = |first: u32, n: u32| -> Vec<ipnet::IpNet> {
            (first..first + n)
                .map(|i| {
                    ipnet::IpNet::V4(
                        ipnet::Ipv4Net::new(std::net::Ipv4Addr::from(i << 8), 24).expect("net"),
                    )
                })
                .collect()
        };
        // Network numbers of /24s: 10.0.0.0/24 onwards, 11.0.0.0/24 onwards, 12.0.0.0/24.
        cfg.exclude_outbound_cidrs = nets(0x0a_0000, POD_CIDR_QUOTA / 2);
        cfg.include_outbound_cidrs = Selection::List(nets(0x0b_0000, POD_CIDR_QUOTA / 2));
        assert_eq!(PodUsage::of(&cfg).cidrs, POD_CIDR_QUOTA as usize);
        assert!(check(&cfg).is_ok());
        cfg.exclude_outbound_cidrs.extend(nets(0x0c_0000, 1));
        let err = check(&cfg).expect_err("over the CIDR quota");
        assert!(err.to_string().contains("excludeOutboundIPRanges"), "{err}");
    }
}
