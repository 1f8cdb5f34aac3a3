//! A pod's list entries as the node-wide port and CIDR maps key them: what the maps are written
//! with (`pod_maps`) and what a pod's quota counts (`limits`).

use capture_common::config::ListKind;
use ipnet::IpNet;

use crate::config::{CaptureConfig, Selection};

/// The pod's port-list entries, by list.
pub fn port_entries(cfg: &CaptureConfig) -> Vec<(ListKind, u16)> {
    let with = |kind| move |p: &u16| (kind, *p);
    let mut out: Vec<_> = cfg
        .exclude_outbound_ports
        .iter()
        .map(with(ListKind::ExcludeOutboundPorts))
        .chain(
            cfg.include_outbound_ports
                .iter()
                .map(with(ListKind::IncludeOutboundPorts)),
        )
        .collect();
    match &cfg.include_inbound_ports {
        Selection::All => out.extend(
            cfg.exclude_inbound_ports
                .iter()
                .map(with(ListKind::ExcludeInboundPorts)),
        ),
        Selection::List(l) => out.extend(l.iter().map(with(ListKind::IncludeInboundPorts))),
    }
    out
}

/// The pod's CIDR-list entries (the DNS nameservers' among them), by list.
pub fn cidr_entries(cfg: &CaptureConfig) -> Vec<(ListKind, IpNet)> {
    let include: &[IpNet] = match &cfg.include_outbound_cidrs {
        Selection::All => &[],
        Selection::List(l) => l,
    };
    let nameservers = cfg
        .dns
        .as_ref()
        .map(|d| d.nameservers.as_slice())
        .unwrap_or_default();
    cfg.exclude_outbound_cidrs
        .iter()
        .map(|n| (ListKind::ExcludeOutboundCidrs, *n))
        .chain(include.iter().map(|n| (ListKind::IncludeOutboundCidrs, *n)))
        .chain(
            nameservers
                .iter()
                .map(|a| (ListKind::DnsNameservers, IpNet::from(*a))),
        )
        .collect()
}
