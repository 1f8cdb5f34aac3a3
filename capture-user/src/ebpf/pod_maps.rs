//! One pod's entries in the node's maps: its config, its lists, its counters.

use std::net::IpAddr;

use aya::maps::{lpm_trie::Key, MapError, PerCpuValues};
use capture_common::{
    config::{
        AccelCounters, ListKind, PodConfig, PodCounters, FLAG_ACCELERATE, FLAG_DNS_CAPTURE,
        FLAG_DNS_CAPTURE_ALL, FLAG_HAS_EXCLUDE_CIDRS, FLAG_HAS_EXCLUDE_INBOUND_PORTS,
        FLAG_HAS_EXCLUDE_OUTBOUND_PORTS, FLAG_HAS_INCLUDE_CIDRS, FLAG_HAS_INCLUDE_INBOUND_PORTS,
        FLAG_HAS_INCLUDE_OUTBOUND_PORTS, FLAG_HAS_POD_IP4, FLAG_HAS_POD_IP6,
        FLAG_INBOUND_ALL_PORTS, FLAG_INCLUDE_ALL_OUTBOUND, FLAG_INCLUDE_COVERS_LOOPBACK,
        FLAG_PROXY_BY_CONTAINER, FLAG_STATELESS6, MAX_OWNER_GROUPS, MAX_PROXY_IDS,
        OWNER_GROUPS_ALL, OWNER_GROUPS_EXCLUDE, OWNER_GROUPS_INCLUDE, PROXY_CONTAINER_KNOWN,
        PROXY_CONTAINER_NONE, PROXY_CONTAINER_UNKNOWN,
    },
    keys::{
        CidrKey, ListenerKey, LoopbackKey, PodAddrKey, PortKey, CIDR_KEY_FIXED_BITS, LISTENER_SLOTS,
    },
    loopback, AF_INET, AF_INET6,
};
use ipnet::IpNet;

use super::{
    list_entries::{cidr_entries, port_entries},
    node::Maps,
};
use crate::config::{CaptureConfig, OwnerGroups, ProxyContainer, Selection};

#[derive(Debug, thiserror::Error)]
pub enum PodMapsError {
    #[error("writing {what} for the pod: {source}{hint}")]
    Write {
        what: String,
        source: MapError,
        hint: &'static str,
    },
    #[error("counting possible CPUs: {0}")]
    Cpus(std::io::Error),
    #[error(transparent)]
    Quota(#[from] super::limits::QuotaExceeded),
    /// The per-pod maps hold `--max-pods` pods already: the pod's first entry found no room.
    #[error("the node's per-pod maps are full")]
    NodeFull,
}

pub fn ip6_words(octets: [u8; 16]) -> [u32; 4] {
    let w = |i: usize| u32::from_ne_bytes([octets[i], octets[i + 1], octets[i + 2], octets[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

fn ids(list: &[u32]) -> [u32; MAX_PROXY_IDS] {
    let mut out = [0; MAX_PROXY_IDS];
    out[..list.len()].copy_from_slice(list);
    out
}

/// The kernel's view of a validated config.
#[must_use]
pub fn kernel_config(cfg: &CaptureConfig) -> PodConfig {
    let mut flags = 0;
    let mut set = |cond: bool, flag: u32| {
        if cond {
            flags |= flag;
        }
    };
    let (include_all, include_cidrs) = match &cfg.include_outbound_cidrs {
        Selection::All => (true, false),
        Selection::List(l) => (false, !l.is_empty()),
    };
    set(include_all, FLAG_INCLUDE_ALL_OUTBOUND);
    set(include_cidrs, FLAG_HAS_INCLUDE_CIDRS);
    set(
        !cfg.exclude_outbound_cidrs.is_empty(),
        FLAG_HAS_EXCLUDE_CIDRS,
    );
    set(
        !cfg.exclude_outbound_ports.is_empty(),
        FLAG_HAS_EXCLUDE_OUTBOUND_PORTS,
    );
    set(
        !cfg.include_outbound_ports.is_empty(),
        FLAG_HAS_INCLUDE_OUTBOUND_PORTS,
    );
    set(cfg.include_covers_loopback(), FLAG_INCLUDE_COVERS_LOOPBACK);
    let (inbound_all, inbound_list) = match &cfg.include_inbound_ports {
        Selection::All => (true, false),
        Selection::List(l) => (false, !l.is_empty()),
    };
    set(inbound_all, FLAG_INBOUND_ALL_PORTS);
    set(inbound_list, FLAG_HAS_INCLUDE_INBOUND_PORTS);
    set(
        inbound_all && !cfg.exclude_inbound_ports.is_empty(),
        FLAG_HAS_EXCLUDE_INBOUND_PORTS,
    );
    set(cfg.dns.is_some(), FLAG_DNS_CAPTURE);
    set(
        cfg.dns.as_ref().is_some_and(|d| d.capture_all),
        FLAG_DNS_CAPTURE_ALL,
    );
    set(cfg.accelerate, FLAG_ACCELERATE);
    set(cfg.pod_ip4.is_some(), FLAG_HAS_POD_IP4);
    set(cfg.pod_ip6.is_some(), FLAG_HAS_POD_IP6);
    set(cfg.proxy_identity.is_some(), FLAG_PROXY_BY_CONTAINER);
    set(cfg.stateless_redirect6, FLAG_STATELESS6);
    let (proxy_container, proxy_cgroup_id) = match cfg.proxy_identity.as_ref().map(|i| &i.proxy) {
        None | Some(ProxyContainer::Unknown) => (PROXY_CONTAINER_UNKNOWN, 0),
        Some(ProxyContainer::Known { cgroup_id, .. }) => (PROXY_CONTAINER_KNOWN, *cgroup_id),
        Some(ProxyContainer::None) => (PROXY_CONTAINER_NONE, 0),
    };
    let (owner_group_mode, mut owner_groups): (u32, &[u32]) = match &cfg.owner_groups {
        OwnerGroups::All => (OWNER_GROUPS_ALL, &[]),
        OwnerGroups::Only(g) => (OWNER_GROUPS_INCLUDE, g),
        OwnerGroups::AllBut(g) => (OWNER_GROUPS_EXCLUDE, g),
    };
    // The programs see host ids: a pod with a user namespace of its own has its ids translated.
    let (mut proxy_uids, mut proxy_gids) = (cfg.proxy_uids.as_slice(), cfg.proxy_gids.as_slice());
    if let Some(host) = &cfg.host_ids {
        proxy_uids = &host.proxy_uids;
        proxy_gids = &host.proxy_gids;
        owner_groups = &host.owner_groups;
    }
    PodConfig {
        flags,
        proxy_uid_count: proxy_uids.len() as u32,
        proxy_gid_count: proxy_gids.len() as u32,
        loopback4_net: u32::from_ne_bytes(cfg.host_loopback_cidr.network().octets()),
        loopback4_mask: u32::from_ne_bytes(cfg.host_loopback_cidr.netmask().octets()),
        pod_ip4: cfg.pod_ip4.map_or(0, |a| u32::from_ne_bytes(a.octets())),
        pod_ip6: cfg.pod_ip6.map_or([0; 4], |a| ip6_words(a.octets())),
        proxy_uids: ids(proxy_uids),
        proxy_gids: ids(proxy_gids),
        outbound_port: cfg.outbound_port,
        inbound_port: cfg.inbound_port,
        tunnel_port: cfg.tunnel_port,
        dns_port: cfg.dns.as_ref().map_or(crate::config::DNS_PORT, |d| d.port),
        owner_group_mode,
        owner_group_count: owner_groups.len() as u32,
        owner_groups: {
            let mut g = [0; MAX_OWNER_GROUPS];
            g[..owner_groups.len()].copy_from_slice(owner_groups);
            g
        },
        proxy_container,
        reserved: 0,
        proxy_cgroup_id,
        #[cfg(feature = "layout-next")]
        variant_reserved: [0; 2],
    }
}

/// The LPM key of a CIDR in one pod's list.
#[must_use]
pub fn cidr_key(netns_cookie: u64, list: ListKind, net: &IpNet) -> Key<CidrKey> {
    let (ipv6, addr) = match net {
        IpNet::V4(n) => (false, [u32::from_ne_bytes(n.network().octets()), 0, 0, 0]),
        IpNet::V6(n) => (true, ip6_words(n.network().octets())),
    };
    Key::new(
        CIDR_KEY_FIXED_BITS + u32::from(net.prefix_len()),
        CidrKey::new(netns_cookie, list, ipv6, addr),
    )
}

/// The pod's addresses as inbound capture looks them up.
fn pod_addr_keys(cfg: &CaptureConfig) -> Vec<PodAddrKey> {
    pod_addrs(cfg).into_iter().map(|(_, key)| key).collect()
}

fn pod_addrs(cfg: &CaptureConfig) -> Vec<(IpAddr, PodAddrKey)> {
    let v4 = cfg.pod_ip4.map(|a| {
        let key = PodAddrKey {
            family: u32::from(AF_INET),
            addr: [u32::from_ne_bytes(a.octets()), 0, 0, 0],
        };
        (IpAddr::V4(a), key)
    });
    let v6 = cfg.pod_ip6.map(|a| {
        let key = PodAddrKey {
            family: u32::from(AF_INET6),
            addr: ip6_words(a.octets()),
        };
        (IpAddr::V6(a), key)
    });
    v4.into_iter().chain(v6).collect()
}

/// The pod's addresses whose inbound entry does not lead to the pod: never written, or taken
/// over by a pod that got the address since (Kubernetes reuses pod IPs quickly).
pub fn addresses_not_owned(maps: &Maps, netns_cookie: u64, cfg: &CaptureConfig) -> Vec<String> {
    pod_addrs(cfg)
        .into_iter()
        .filter_map(|(addr, key)| match maps.inbound_pods.get(&key, 0) {
            Ok(owner) if owner == netns_cookie => None,
            Ok(owner) => Some(format!(
                "inbound address {addr} (now held by the pod of netns cookie {owner})"
            )),
            Err(_) => Some(format!("inbound address {addr}")),
        })
        .collect()
}

/// `BPF_NOEXIST`.
const NOEXIST: u64 = 1;

const FULL_HINT: &str =
    " (the node-wide map may be full: too many pods or list entries on this node)";

/// Writes the pod's entries; the config goes last, since its presence is what the programs act on.
pub fn install(
    maps: &mut Maps,
    netns_cookie: u64,
    cfg: &CaptureConfig,
) -> Result<(), PodMapsError> {
    // The entry's name is formatted only for a failed write: an at-quota pod has over a
    // thousand entries, and a takeover writes every pod's.
    let write = |what: String| {
        move |source| PodMapsError::Write {
            what,
            source,
            hint: FULL_HINT,
        }
    };
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| PodMapsError::Cpus(e))?;
    let zero = PerCpuValues::try_from(vec![PodCounters::default(); cpus]).expect("non-empty");
    // NOEXIST: a takeover refills the maps of pods whose counters it keeps.
    // The per-pod maps are sized for exactly --max-pods pods, so the first insert of a pod past
    // them is the one that finds no room, before anything of the pod is written.
    match maps.pod_counters.insert(netns_cookie, zero, NOEXIST) {
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::E2BIG) => {
            return Err(PodMapsError::NodeFull);
        }
        result => result.map_err(write("counters".into()))?,
    }
    if let (true, Some(accel)) = (cfg.accelerate, maps.accel_counters.as_mut()) {
        let zero = PerCpuValues::try_from(vec![AccelCounters::default(); cpus]).expect("non-empty");
        match accel.insert(netns_cookie, zero, NOEXIST) {
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
            result => result.map_err(write("acceleration counters".into()))?,
        }
    }
    for (list, port) in port_entries(cfg) {
        maps.port_lists
            .insert(PortKey::new(netns_cookie, list, port), 1, 0)
            .map_err(|e| write(format!("{list:?} port {port}"))(e))?;
    }
    for key in pod_addr_keys(cfg) {
        maps.inbound_pods
            .insert(key, netns_cookie, 0)
            .map_err(write("pod address for inbound capture".into()))?;
    }
    for (list, net) in cidr_entries(cfg) {
        maps.cidr_lists
            .insert(&cidr_key(netns_cookie, list, &net), 1, 0)
            .map_err(|e| write(format!("{list:?} CIDR {net}"))(e))?;
    }
    maps.pod_configs
        .insert(netns_cookie, kernel_config(cfg), 0)
        .map_err(write("config".into()))
}

/// Removes the pod's entries as its config names them: cost proportional to the pod, not to the
/// node (detach of a recorded pod).
pub fn remove_exact(maps: &mut Maps, netns_cookie: u64, cfg: &CaptureConfig) {
    let _ = maps.pod_configs.remove(&netns_cookie);
    // Only the pod's own: another pod may hold the address by now. Every writer holds the node
    // lock, so the entry cannot change hands between the read and the removal.
    for key in pod_addr_keys(cfg) {
        if maps
            .inbound_pods
            .get(&key, 0)
            .is_ok_and(|owner| owner == netns_cookie)
        {
            let _ = maps.inbound_pods.remove(&key);
        }
    }
    for key in listener_keys(netns_cookie) {
        let _ = maps.inbound_listeners.remove(&key);
    }
    for (list, port) in port_entries(cfg) {
        let _ = maps
            .port_lists
            .remove(&PortKey::new(netns_cookie, list, port));
    }
    for (list, net) in cidr_entries(cfg) {
        let _ = maps.cidr_lists.remove(&cidr_key(netns_cookie, list, &net));
    }
    let _ = maps.pod_counters.remove(&netns_cookie);
    if let Some(accel) = maps.accel_counters.as_mut() {
        let _ = accel.remove(&netns_cookie);
    }
    remove_loopback_dests(maps, netns_cookie);
}

/// Removes the list entries `old` has and `new` lacks: a pod reconfigured in place (its proxy
/// container's settings) after `install` wrote `new`'s.
pub fn remove_stale(maps: &mut Maps, netns_cookie: u64, old: &CaptureConfig, new: &CaptureConfig) {
    let ports = port_entries(new);
    for (list, port) in port_entries(old).into_iter().filter(|e| !ports.contains(e)) {
        let _ = maps
            .port_lists
            .remove(&PortKey::new(netns_cookie, list, port));
    }
    let cidrs = cidr_entries(new);
    for (list, net) in cidr_entries(old).into_iter().filter(|e| !cidrs.contains(e)) {
        let _ = maps.cidr_lists.remove(&cidr_key(netns_cookie, list, &net));
    }
}

/// Every listener slot of the pod, both families.
fn listener_keys(netns_cookie: u64) -> impl Iterator<Item = ListenerKey> {
    [AF_INET, AF_INET6].into_iter().flat_map(move |family| {
        (0..LISTENER_SLOTS).map(move |slot| ListenerKey {
            netns_cookie,
            family: u32::from(family),
            slot,
        })
    })
}

/// How many listening sockets inbound capture holds for the pod.
pub fn listeners_registered(maps: &Maps, netns_cookie: u64) -> usize {
    maps.inbound_listeners
        .keys()
        .flatten()
        .filter(|k| k.netns_cookie == netns_cookie)
        .count()
}

/// Removes every entry of the pod, whatever its config was (also after a partial install).
pub fn remove(maps: &mut Maps, netns_cookie: u64) {
    let _ = maps.pod_configs.remove(&netns_cookie);
    let addrs: Vec<PodAddrKey> = maps
        .inbound_pods
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, c)| *c == netns_cookie)
        .map(|(k, _)| k)
        .collect();
    for k in addrs {
        let _ = maps.inbound_pods.remove(&k);
    }
    let listeners: Vec<_> = maps
        .inbound_listeners
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.netns_cookie == netns_cookie)
        .collect();
    for k in listeners {
        let _ = maps.inbound_listeners.remove(&k);
    }
    let ports: Vec<PortKey> = maps
        .port_lists
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.netns_cookie == netns_cookie)
        .collect();
    for k in ports {
        let _ = maps.port_lists.remove(&k);
    }
    let cookie_words =
        CidrKey::new(netns_cookie, ListKind::ExcludeOutboundCidrs, false, [0; 4]).netns_cookie;
    let cidrs: Vec<_> = maps
        .cidr_lists
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.data().netns_cookie == cookie_words)
        .collect();
    for k in cidrs {
        let _ = maps.cidr_lists.remove(&k);
    }
    let _ = maps.pod_counters.remove(&netns_cookie);
    if let Some(accel) = maps.accel_counters.as_mut() {
        let _ = accel.remove(&netns_cookie);
    }
    remove_loopback_dests(maps, netns_cookie);
}

/// The pod's loopback addresses (the stateless redirect). A walk of the node's table finds them
/// while it holds fewer entries than a pod's range; past that, trying each address of the range
/// is cheaper. Either way a detach costs at most two ranges' worth of map calls, however full the
/// node is.
fn remove_loopback_dests(maps: &mut Maps, netns_cookie: u64) {
    let Some(dests) = maps.loopback_dests.as_mut() else {
        return;
    };
    let mut walked = 0usize;
    let mut found = Vec::new();
    for key in dests.keys() {
        walked += 1;
        if walked > loopback::LOOPBACK_SLOTS as usize {
            break;
        }
        match key {
            Ok(k) if k.netns_cookie == netns_cookie => found.push(k.addr),
            _ => {}
        }
    }
    let addrs: Vec<u32> = if walked > loopback::LOOPBACK_SLOTS as usize {
        loopback::all().collect()
    } else {
        found
    };
    for addr in addrs {
        let _ = dests.remove(&LoopbackKey {
            netns_cookie,
            addr,
            _pad: 0,
        });
    }
}

/// How many destinations the pod has loopback addresses for (the stateless redirect); `None`
/// where the node's programs have no such table.
#[must_use]
pub fn loopback_destinations(maps: &Maps, netns_cookie: u64) -> Option<usize> {
    let dests = maps.loopback_dests.as_ref()?;
    Some(
        dests
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.netns_cookie == netns_cookie)
            .count(),
    )
}

/// The pod's counters summed over CPUs.
#[must_use]
pub fn counters(maps: &Maps, netns_cookie: u64) -> Option<PodCounters> {
    let per_cpu = maps.pod_counters.get(&netns_cookie, 0).ok()?;
    Some(
        per_cpu
            .iter()
            .fold(PodCounters::default(), PodCounters::plus),
    )
}

/// The pod's acceleration counters summed over CPUs (none for a pod without acceleration).
#[must_use]
pub fn accel_counters(maps: &Maps, netns_cookie: u64) -> Option<AccelCounters> {
    let per_cpu = maps.accel_counters.as_ref()?.get(&netns_cookie, 0).ok()?;
    Some(
        per_cpu
            .iter()
            .fold(AccelCounters::default(), AccelCounters::plus),
    )
}
