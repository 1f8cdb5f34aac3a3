//! The outbound capture decision of the iptables path (parity-spec.md section C, `outbound`), as one pure
//! function. The kernel's `connect4`/`connect6` programs call it with map-backed lists; the unit
//! tests call it with in-memory lists. Both therefore run the same rules in the same order.

use crate::config::{
    ListKind, PodConfig, FLAG_DNS_CAPTURE, FLAG_DNS_CAPTURE_ALL, FLAG_HAS_EXCLUDE_CIDRS,
    FLAG_HAS_EXCLUDE_INBOUND_PORTS, FLAG_HAS_EXCLUDE_OUTBOUND_PORTS, FLAG_HAS_INCLUDE_CIDRS,
    FLAG_HAS_INCLUDE_INBOUND_PORTS, FLAG_HAS_INCLUDE_OUTBOUND_PORTS, FLAG_HAS_POD_IP4,
    FLAG_HAS_POD_IP6, FLAG_INBOUND_ALL_PORTS, FLAG_INCLUDE_ALL_OUTBOUND,
    FLAG_INCLUDE_COVERS_LOOPBACK, MAX_OWNER_GROUPS, MAX_PROXY_IDS, OWNER_GROUPS_EXCLUDE,
    OWNER_GROUPS_INCLUDE,
};

pub use crate::addr::ip4;
use crate::addr::{is_loopback4, same as same6};
pub use crate::verdict::{InboundPass, InboundRule, InboundVerdict, OutboundRule, Pass, Verdict};

/// `127.0.0.6`: the source Envoy's inbound clusters bind, passed on `lo` for everyone (B8).
pub const INBOUND_PASSTHROUGH_SRC4: u32 = ip4(127, 0, 0, 6);
/// `::6`, the IPv6 counterpart.
pub const INBOUND_PASSTHROUGH_SRC6: [u32; 4] = [0, 0, 0, ip4(0, 0, 0, 6)];
/// `::1`.
pub const LOOPBACK6: [u32; 4] = [0, 0, 0, ip4(0, 0, 0, 1)];
/// `127.0.0.1`, where iptables' REDIRECT sends locally generated IPv4 traffic.
pub const LOCALHOST4: u32 = ip4(127, 0, 0, 1);

/// The loopback address an IPv4 TCP connection to `dst:port` is sent to when the proxy's listener
/// takes every local address: one of 127.1.0.0/16, picked by the original destination. Every
/// captured connection of a pod would otherwise share one address pair (pod IP to 127.0.0.1:15001)
/// and so the one ephemeral port range, while iptables' REDIRECT lets the pod use that range
/// once per destination; spreading by destination gives each destination its own tuple space.
/// `dst` is in network order, `port` in host order; the result is in network order.
#[must_use]
pub const fn spread_loopback4(dst: u32, port: u16) -> u32 {
    let mut h = dst ^ (port as u32).wrapping_mul(0x9E37_79B1);
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 16;
    ip4(127, 1, (h >> 8) as u8, h as u8)
}

/// One `connect()` as the decision sees it. IPv4 uses the first word of each address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connect {
    pub ipv6: bool,
    pub dst: [u32; 4],
    /// Host order.
    pub dst_port: u16,
    /// The source the socket is bound to, all zero when unbound.
    pub src: [u32; 4],
    /// The socket creator's uid and primary gid (iptables' owner match).
    pub uid: u32,
    pub gid: u32,
    /// A UDP socket (connect or sendmsg); TCP otherwise.
    pub udp: bool,
    /// Proxy identity by container: the connecting task is not in the proxy container, so its
    /// ids exempt nothing (`FLAG_PROXY_BY_CONTAINER`).
    pub outside_proxy_container: bool,
}

/// The per-pod lists the decision consults; the kernel backs them with maps.
pub trait PodLists {
    fn port_listed(&self, list: ListKind, port: u16) -> bool;
    fn cidr_listed(&self, list: ListKind, ipv6: bool, addr: &[u32; 4]) -> bool;
}

/// Would the kernel route `dst` over `lo` (iptables' `-o lo`)? Inside a pod that is the loopback
/// range and the pod's own addresses (plus `::6`, which Istio adds to `lo`). IPv4 in word 0.
#[inline(always)]
#[must_use]
pub fn routed_over_lo(cfg: &PodConfig, ipv6: bool, dst: &[u32; 4]) -> bool {
    if ipv6 {
        same6(dst, &LOOPBACK6)
            || same6(dst, &INBOUND_PASSTHROUGH_SRC6)
            || (cfg.has(FLAG_HAS_POD_IP6) && same6(dst, &cfg.pod_ip6))
    } else {
        is_loopback4(dst[0]) || (cfg.has(FLAG_HAS_POD_IP4) && dst[0] == cfg.pod_ip4)
    }
}

#[inline(always)]
fn leaves_through_lo(cfg: &PodConfig, c: &Connect) -> bool {
    routed_over_lo(cfg, c.ipv6, &c.dst)
}

/// Istio's `LOOP` set: `HostIPv4LoopbackCidr` or `::1/128`.
#[inline(always)]
fn in_host_loopback(cfg: &PodConfig, c: &Connect) -> bool {
    if c.ipv6 {
        same6(&c.dst, &LOOPBACK6)
    } else {
        c.dst[0] & cfg.loopback4_mask == cfg.loopback4_net
    }
}

#[inline(always)]
fn from_inbound_passthrough(c: &Connect) -> bool {
    if c.ipv6 {
        same6(&c.src, &INBOUND_PASSTHROUGH_SRC6)
    } else {
        c.src[0] == INBOUND_PASSTHROUGH_SRC4
    }
}

/// The three owner rules that iptables emits per proxy id (B9–B11, B12–B14), evaluated for one
/// id. With DNS capture, the lo-RETURN rule spares port 53 (and UDP), and the uid rules' inbound
/// redirect spares port 53 too (`uid_rule`).
#[inline(always)]
fn owner_rules(
    cfg: &PodConfig,
    c: &Connect,
    local: bool,
    owner_matches: bool,
    uid_rule: bool,
) -> Option<OutboundRule> {
    let (to_local, local_other, proxy) = if uid_rule {
        (
            OutboundRule::ProxyUidToLocal,
            OutboundRule::LocalNotProxyUid,
            OutboundRule::ProxyUid,
        )
    } else {
        (
            OutboundRule::ProxyGidToLocal,
            OutboundRule::LocalNotProxyGid,
            OutboundRule::ProxyGid,
        )
    };
    let dns = cfg.has(FLAG_DNS_CAPTURE);
    let dns_port = c.dst_port == DNS_PORT;
    if local
        && owner_matches
        && !c.udp
        && !in_host_loopback(cfg, c)
        && c.dst_port != cfg.tunnel_port
        && !(dns && uid_rule && dns_port)
    {
        return Some(to_local);
    }
    if local
        && !owner_matches
        && !cfg.has(FLAG_INCLUDE_COVERS_LOOPBACK)
        && (!dns || (!c.udp && !dns_port))
    {
        return Some(local_other);
    }
    if owner_matches {
        return Some(proxy);
    }
    None
}

/// Can the socket's ids make it the proxy's? Not from outside the proxy container when the pod's
/// proxy is identified by its container.
#[inline(always)]
const fn owner_may_match(c: &Connect) -> bool {
    !c.outside_proxy_container
}

/// Is the socket's primary group one whose traffic is captured?
#[inline(always)]
fn owner_group_captured(cfg: &PodConfig, gid: u32) -> bool {
    let mut listed = false;
    for i in 0..MAX_OWNER_GROUPS {
        if (i as u32) < cfg.owner_group_count && cfg.owner_groups[i] == gid {
            listed = true;
        }
    }
    match cfg.owner_group_mode {
        OWNER_GROUPS_INCLUDE => listed,
        OWNER_GROUPS_EXCLUDE => !listed,
        _ => true,
    }
}

/// The DNS port.
pub const DNS_PORT: u16 = 53;

/// parity-spec.md section C, `outbound`, for a TCP `connect()` or a UDP `connect()`/`sendmsg()`: where the
/// connection goes.
#[inline(always)]
pub fn decide_outbound<L: PodLists>(cfg: &PodConfig, lists: &L, c: &Connect) -> Verdict {
    outbound_rule(cfg, lists, c).verdict()
}

/// parity-spec.md section C, `outbound`: the rule that decides the connection.
#[inline(always)]
pub fn outbound_rule<L: PodLists>(cfg: &PodConfig, lists: &L, c: &Connect) -> OutboundRule {
    if c.ipv6 && !cfg.has(FLAG_HAS_POD_IP6) {
        return OutboundRule::FamilyNotCaptured;
    }
    if cfg.has(FLAG_HAS_EXCLUDE_OUTBOUND_PORTS)
        && lists.port_listed(ListKind::ExcludeOutboundPorts, c.dst_port)
    {
        return OutboundRule::ExcludedPort;
    }
    let local = leaves_through_lo(cfg, c);
    if local && from_inbound_passthrough(c) {
        return OutboundRule::InboundPassthroughSource;
    }
    // The bounds keep the loops unrollable for the verifier; the counts select the live entries.
    for i in 0..MAX_PROXY_IDS {
        if (i as u32) < cfg.proxy_uid_count {
            if let Some(rule) = owner_rules(
                cfg,
                c,
                local,
                owner_may_match(c) && c.uid == cfg.proxy_uids[i],
                true,
            ) {
                return rule;
            }
        }
    }
    for i in 0..MAX_PROXY_IDS {
        if (i as u32) < cfg.proxy_gid_count {
            if let Some(rule) = owner_rules(
                cfg,
                c,
                local,
                owner_may_match(c) && c.gid == cfg.proxy_gids[i],
                false,
            ) {
                return rule;
            }
        }
    }
    if !owner_group_captured(cfg, c.gid) {
        return OutboundRule::OwnerGroup;
    }
    if cfg.has(FLAG_DNS_CAPTURE)
        && c.dst_port == DNS_PORT
        && (cfg.has(FLAG_DNS_CAPTURE_ALL)
            || lists.cidr_listed(ListKind::DnsNameservers, c.ipv6, &c.dst))
    {
        return OutboundRule::Dns;
    }
    // Only DNS is captured for UDP (ISTIO_REDIRECT and ISTIO_IN_REDIRECT are TCP-only).
    if c.udp {
        return OutboundRule::NotTcp;
    }
    if in_host_loopback(cfg, c) {
        return OutboundRule::HostLoopback;
    }
    if cfg.has(FLAG_HAS_EXCLUDE_CIDRS)
        && lists.cidr_listed(ListKind::ExcludeOutboundCidrs, c.ipv6, &c.dst)
    {
        return OutboundRule::ExcludedCidr;
    }
    if cfg.has(FLAG_HAS_INCLUDE_OUTBOUND_PORTS)
        && lists.port_listed(ListKind::IncludeOutboundPorts, c.dst_port)
    {
        return OutboundRule::IncludedPort;
    }
    if cfg.has(FLAG_INCLUDE_ALL_OUTBOUND) {
        return OutboundRule::AllOutbound;
    }
    if cfg.has(FLAG_HAS_INCLUDE_CIDRS)
        && lists.cidr_listed(ListKind::IncludeOutboundCidrs, c.ipv6, &c.dst)
    {
        return OutboundRule::IncludedCidr;
    }
    OutboundRule::NotIncluded
}

/// parity-spec.md section C, `inbound_redirect`, for a TCP connection arriving from outside the pod.
#[inline(always)]
pub fn decide_inbound<L: PodLists>(cfg: &PodConfig, lists: &L, dst_port: u16) -> InboundVerdict {
    inbound_rule(cfg, lists, dst_port).verdict()
}

/// parity-spec.md section C, `inbound_redirect`: the rule that decides the arriving connection.
#[inline(always)]
pub fn inbound_rule<L: PodLists>(cfg: &PodConfig, lists: &L, dst_port: u16) -> InboundRule {
    let all = cfg.has(FLAG_INBOUND_ALL_PORTS);
    if !all && !cfg.has(FLAG_HAS_INCLUDE_INBOUND_PORTS) {
        return InboundRule::Disabled;
    }
    if dst_port == cfg.tunnel_port {
        return InboundRule::Tunnel;
    }
    if all {
        if cfg.has(FLAG_HAS_EXCLUDE_INBOUND_PORTS)
            && lists.port_listed(ListKind::ExcludeInboundPorts, dst_port)
        {
            return InboundRule::ExcludedPort;
        }
        return InboundRule::AllPorts;
    }
    // An explicit include list ignores the exclude list (parity-spec.md E.8).
    if lists.port_listed(ListKind::IncludeInboundPorts, dst_port) {
        InboundRule::IncludedPort
    } else {
        InboundRule::NotIncluded
    }
}

#[cfg(test)]
#[path = "decision_tests.rs"]
mod tests;
