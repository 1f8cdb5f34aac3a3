//! The decision procedure against parity-spec.md section C/E, without a kernel.

extern crate std;
use std::{vec, vec::Vec};

use super::*;
use crate::config::{
    FLAG_DNS_CAPTURE, FLAG_DNS_CAPTURE_ALL, FLAG_HAS_EXCLUDE_INBOUND_PORTS,
    FLAG_HAS_INCLUDE_INBOUND_PORTS, FLAG_HAS_POD_IP6, FLAG_INBOUND_ALL_PORTS, MAX_OWNER_GROUPS,
    OWNER_GROUPS_ALL, OWNER_GROUPS_EXCLUDE, OWNER_GROUPS_INCLUDE,
};

const POD4: u32 = ip4(10, 1, 0, 10);
const POD6: [u32; 4] = [
    u32::from_ne_bytes([0xfd, 0, 0, 1]),
    0,
    0,
    u32::from_ne_bytes([0, 0, 0, 0x10]),
];

#[derive(Default)]
struct Lists {
    ports: Vec<(ListKind, u16)>,
    cidrs4: Vec<(ListKind, u32, u32)>, // list, network, mask (network order)
}

impl PodLists for Lists {
    fn port_listed(&self, list: ListKind, port: u16) -> bool {
        self.ports.contains(&(list, port))
    }
    fn cidr_listed(&self, list: ListKind, ipv6: bool, addr: &[u32; 4]) -> bool {
        !ipv6
            && self
                .cidrs4
                .iter()
                .any(|(l, net, mask)| *l == list && addr[0] & mask == *net)
    }
}

fn default_cfg() -> PodConfig {
    PodConfig {
        flags: FLAG_INCLUDE_ALL_OUTBOUND | FLAG_HAS_POD_IP4 | FLAG_HAS_POD_IP6,
        proxy_uid_count: 1,
        proxy_gid_count: 1,
        loopback4_net: LOCALHOST4,
        loopback4_mask: u32::MAX,
        pod_ip4: POD4,
        pod_ip6: POD6,
        proxy_uids: [1337, 0, 0, 0],
        proxy_gids: [1337, 0, 0, 0],
        outbound_port: 15001,
        inbound_port: 15006,
        tunnel_port: 15008,
        dns_port: 15053,
        owner_group_mode: OWNER_GROUPS_ALL,
        owner_group_count: 0,
        owner_groups: [0; MAX_OWNER_GROUPS],
        proxy_container: 0,
        reserved: 0,
        proxy_cgroup_id: 0,
        #[cfg(feature = "layout-next")]
        variant_reserved: [0; 2],
    }
}

fn v4(dst: u32, port: u16, uid: u32, gid: u32) -> Connect {
    Connect {
        ipv6: false,
        dst: [dst, 0, 0, 0],
        dst_port: port,
        src: [0; 4],
        uid,
        gid,
        udp: false,
        outside_proxy_container: false,
    }
}

fn decide(cfg: &PodConfig, lists: &Lists, c: Connect) -> Verdict {
    decide_outbound(cfg, lists, &c)
}

#[test]
fn default_sidecar_cases() {
    let cfg = default_cfg();
    let l = Lists::default();
    let remote = ip4(10, 0, 0, 5);
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 1000, 1000)),
        Verdict::Outbound,
        "T01"
    );
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 1337, 1337)),
        Verdict::Pass(Pass::Owner),
        "T04"
    );
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 2000, 1337)),
        Verdict::Pass(Pass::Owner),
        "T05"
    );
    assert_eq!(
        decide(&cfg, &l, v4(LOCALHOST4, 9090, 1000, 1000)),
        Verdict::Pass(Pass::Local),
        "T06"
    );
    assert_eq!(
        decide(&cfg, &l, v4(POD4, 8080, 1000, 1000)),
        Verdict::Pass(Pass::Local),
        "T07"
    );
    assert_eq!(
        decide(&cfg, &l, v4(POD4, 8080, 1337, 1337)),
        Verdict::Inbound,
        "T09"
    );
    assert_eq!(
        decide(&cfg, &l, v4(ip4(127, 0, 0, 2), 8080, 1337, 1337)),
        Verdict::Inbound,
        "T15"
    );
    assert_eq!(
        decide(&cfg, &l, v4(LOCALHOST4, 8080, 1337, 1337)),
        Verdict::Pass(Pass::Owner),
        "E3"
    );
    assert_eq!(
        decide(&cfg, &l, v4(POD4, 15008, 1337, 1337)),
        Verdict::Pass(Pass::Owner),
        "E5"
    );
    assert_eq!(
        decide(&cfg, &l, v4(remote, 15020, 1000, 1000)),
        Verdict::Outbound,
        "T18"
    );
    let mut c = v4(POD4, 8080, 1337, 1337);
    c.src = [INBOUND_PASSTHROUGH_SRC4, 0, 0, 0];
    assert_eq!(
        decide(&cfg, &l, c),
        Verdict::Pass(Pass::InboundPassthroughSource),
        "T11"
    );
}

#[test]
fn precedence_of_port_and_cidr_lists() {
    let mut cfg = default_cfg();
    cfg.flags = FLAG_HAS_POD_IP4
        | FLAG_HAS_EXCLUDE_CIDRS
        | FLAG_HAS_INCLUDE_OUTBOUND_PORTS
        | FLAG_HAS_EXCLUDE_OUTBOUND_PORTS;
    let l = Lists {
        ports: vec![
            (ListKind::IncludeOutboundPorts, 32000),
            (ListKind::ExcludeOutboundPorts, 5555),
        ],
        cidrs4: vec![(
            ListKind::ExcludeOutboundCidrs,
            ip4(10, 2, 0, 0),
            ip4(255, 255, 0, 0),
        )],
    };
    assert_eq!(
        decide(&cfg, &l, v4(ip4(10, 2, 0, 7), 32000, 1000, 1000)),
        Verdict::Pass(Pass::ExcludedCidr),
        "T43"
    );
    assert_eq!(
        decide(&cfg, &l, v4(ip4(10, 0, 0, 5), 32000, 1000, 1000)),
        Verdict::Outbound
    );
    assert_eq!(
        decide(&cfg, &l, v4(ip4(10, 0, 0, 5), 80, 1000, 1000)),
        Verdict::Pass(Pass::NotIncluded)
    );
    assert_eq!(
        decide(&cfg, &l, v4(POD4, 5555, 1337, 1337)),
        Verdict::Pass(Pass::ExcludedPort),
        "T44 first"
    );
}

#[test]
fn several_uids_and_loopback_include() {
    let mut cfg = default_cfg();
    cfg.proxy_uid_count = 2;
    cfg.proxy_uids = [1337, 1338, 0, 0];
    let l = Lists::default();
    assert_eq!(
        decide(&cfg, &l, v4(POD4, 8080, 1338, 1338)),
        Verdict::Pass(Pass::Local),
        "T72"
    );
    cfg.flags |= FLAG_INCLUDE_COVERS_LOOPBACK;
    cfg.flags &= !FLAG_INCLUDE_ALL_OUTBOUND;
    cfg.flags |= FLAG_HAS_INCLUDE_CIDRS;
    let l = Lists {
        cidrs4: vec![(ListKind::IncludeOutboundCidrs, ip4(127, 1, 2, 3), u32::MAX)],
        ..Lists::default()
    };
    assert_eq!(
        decide(&cfg, &l, v4(ip4(127, 1, 2, 3), 80, 1000, 1000)),
        Verdict::Outbound,
        "T73"
    );
    assert_eq!(
        decide(&cfg, &l, v4(LOCALHOST4, 80, 1000, 1000)),
        Verdict::Pass(Pass::Local),
        "LOOP stays direct"
    );
}

#[test]
fn ipv6() {
    let cfg = default_cfg();
    let l = Lists::default();
    let remote6 = [
        u32::from_ne_bytes([0xfd, 0, 0, 2]),
        0,
        0,
        u32::from_ne_bytes([0, 0, 0, 5]),
    ];
    let c = |dst, uid| Connect {
        ipv6: true,
        dst,
        dst_port: 80,
        src: [0; 4],
        uid,
        gid: uid,
        udp: false,
        outside_proxy_container: false,
    };
    assert_eq!(decide(&cfg, &l, c(remote6, 1000)), Verdict::Outbound, "T29");
    assert_eq!(
        decide(&cfg, &l, c(LOOPBACK6, 1000)),
        Verdict::Pass(Pass::Local)
    );
    assert_eq!(decide(&cfg, &l, c(POD6, 1337)), Verdict::Inbound);
    assert_eq!(
        decide(&cfg, &l, c(LOOPBACK6, 1337)),
        Verdict::Pass(Pass::Owner)
    );
    let mut v4_only = cfg;
    v4_only.flags &= !FLAG_HAS_POD_IP6;
    assert_eq!(
        decide(&v4_only, &l, c(remote6, 1000)),
        Verdict::Pass(Pass::FamilyNotCaptured)
    );
}

#[test]
fn inbound() {
    let mut cfg = default_cfg();
    cfg.flags |= FLAG_INBOUND_ALL_PORTS | FLAG_HAS_EXCLUDE_INBOUND_PORTS;
    let l = Lists {
        ports: vec![
            (ListKind::ExcludeInboundPorts, 15020),
            (ListKind::IncludeInboundPorts, 8080),
        ],
        ..Lists::default()
    };
    assert_eq!(
        decide_inbound(&cfg, &l, 8080),
        InboundVerdict::Capture,
        "T19"
    );
    assert_eq!(
        decide_inbound(&cfg, &l, 15020),
        InboundVerdict::Pass(InboundPass::ExcludedPort),
        "T20"
    );
    assert_eq!(
        decide_inbound(&cfg, &l, 15008),
        InboundVerdict::Pass(InboundPass::Tunnel),
        "T23"
    );
    assert_eq!(
        decide_inbound(&cfg, &l, 15001),
        InboundVerdict::Capture,
        "T24"
    );
    cfg.flags &= !FLAG_INBOUND_ALL_PORTS;
    cfg.flags |= FLAG_HAS_INCLUDE_INBOUND_PORTS;
    let l = Lists {
        ports: vec![
            (ListKind::ExcludeInboundPorts, 8080),
            (ListKind::IncludeInboundPorts, 8080),
        ],
        ..Lists::default()
    };
    assert_eq!(
        decide_inbound(&cfg, &l, 8080),
        InboundVerdict::Capture,
        "T45: exclude ignored"
    );
    assert_eq!(
        decide_inbound(&cfg, &l, 9090),
        InboundVerdict::Pass(InboundPass::NotIncluded)
    );
    cfg.flags &= !(FLAG_HAS_INCLUDE_INBOUND_PORTS | FLAG_HAS_EXCLUDE_INBOUND_PORTS);
    assert_eq!(
        decide_inbound(&cfg, &l, 8080),
        InboundVerdict::Pass(InboundPass::Disabled)
    );
}

fn udp(dst: u32, port: u16, uid: u32) -> Connect {
    Connect {
        udp: true,
        ..v4(dst, port, uid, uid)
    }
}

#[test]
fn dns_capture() {
    let ns = ip4(10, 96, 0, 10);
    let mut cfg = default_cfg();
    cfg.flags |= FLAG_DNS_CAPTURE;
    let l = Lists {
        cidrs4: vec![(ListKind::DnsNameservers, ns, u32::MAX)],
        ..Lists::default()
    };
    assert_eq!(decide(&cfg, &l, udp(ns, 53, 1000)), Verdict::Dns, "T47");
    assert_eq!(
        decide(&cfg, &l, v4(ns, 53, 1000, 1000)),
        Verdict::Dns,
        "T47 over TCP"
    );
    assert_eq!(
        decide(&cfg, &l, udp(ns, 53, 1337)),
        Verdict::Pass(Pass::Owner),
        "T50"
    );
    assert_eq!(
        decide(&cfg, &l, udp(ip4(10, 0, 0, 5), 53, 1000)),
        Verdict::Pass(Pass::NotTcp),
        "not a nameserver"
    );
    assert_eq!(
        decide(&cfg, &l, udp(ns, 5000, 1000)),
        Verdict::Pass(Pass::NotTcp),
        "T16 stays"
    );
    // The proxy's port-53 connection to its own pod is not sent to 15006 under DNS capture.
    assert_eq!(
        decide(&cfg, &l, v4(POD4, 53, 1337, 1337)),
        Verdict::Pass(Pass::Owner)
    );
    // An app's UDP DNS to a local resolver passes the lo-RETURN rule (TCP-only under DNS capture);
    // not a nameserver, so it keeps its destination.
    assert_eq!(
        decide(&cfg, &Lists::default(), udp(ip4(127, 0, 0, 53), 53, 1000)),
        Verdict::Pass(Pass::NotTcp)
    );
    cfg.flags |= FLAG_DNS_CAPTURE_ALL;
    assert_eq!(
        decide(&cfg, &l, udp(ip4(10, 0, 0, 5), 53, 1000)),
        Verdict::Dns,
        "T52"
    );
    assert_eq!(
        decide(&cfg, &l, udp(ip4(127, 0, 0, 53), 53, 1000)),
        Verdict::Dns,
        "capture-all takes local resolvers too"
    );
    // Without DNS capture, UDP 53 is just UDP.
    let plain = default_cfg();
    assert_eq!(
        decide(&plain, &l, udp(ns, 53, 1000)),
        Verdict::Pass(Pass::NotTcp)
    );
}

#[test]
fn owner_groups() {
    let remote = ip4(10, 0, 0, 5);
    let mut cfg = default_cfg();
    cfg.owner_group_mode = OWNER_GROUPS_INCLUDE;
    cfg.owner_group_count = 2;
    cfg.owner_groups[..2].copy_from_slice(&[202, 303]);
    let l = Lists::default();
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 1000, 202)),
        Verdict::Outbound,
        "T75 listed"
    );
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 1000, 1000)),
        Verdict::Pass(Pass::OwnerGroup),
        "T75 not listed"
    );
    cfg.owner_group_count = 0;
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 1000, 202)),
        Verdict::Pass(Pass::OwnerGroup),
        "empty include captures nothing"
    );
    cfg.owner_group_mode = OWNER_GROUPS_EXCLUDE;
    cfg.owner_group_count = 1;
    cfg.owner_groups[0] = 888;
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 1000, 888)),
        Verdict::Pass(Pass::OwnerGroup),
        "T76"
    );
    assert_eq!(
        decide(&cfg, &l, v4(remote, 80, 1000, 1000)),
        Verdict::Outbound
    );
}

#[test]
fn spread_addresses_are_loopback_and_differ_by_destination() {
    let mut seen = std::collections::BTreeSet::new();
    for host in 1..=64u8 {
        for port in [80u16, 443, 8080] {
            let a = spread_loopback4(ip4(10, 0, 0, host), port);
            assert_eq!(a.to_ne_bytes()[..2], [127, 1], "{:?}", a.to_ne_bytes());
            assert_eq!(
                a,
                spread_loopback4(ip4(10, 0, 0, host), port),
                "deterministic"
            );
            seen.insert(a);
        }
    }
    // 192 destinations over 65,536 addresses: a handful of collisions at most.
    assert!(seen.len() >= 185, "{} distinct of 192", seen.len());
}

#[test]
fn outside_the_proxy_container_the_proxy_ids_exempt_nothing() {
    let cfg = default_cfg();
    let l = Lists::default();
    let remote = ip4(10, 0, 0, 5);
    let outside = |c: Connect| Connect {
        outside_proxy_container: true,
        ..c
    };
    for (uid, gid) in [(1337, 1000), (1000, 1337), (1337, 1337)] {
        let c = v4(remote, 80, uid, gid);
        let rule = outbound_rule(&cfg, &l, &c);
        assert!(rule.by_proxy_owner(), "{uid}/{gid} is the proxy's by id");
        assert_eq!(
            decide(&cfg, &l, outside(c)),
            Verdict::Outbound,
            "{uid}/{gid} outside the proxy container is the app"
        );
    }
    // The proxy's ids to its own pod go to the inbound listener; from another container they are
    // the app's local traffic, which stays in the pod as an app's would.
    assert_eq!(
        decide(&cfg, &l, outside(v4(POD4, 8080, 1337, 1337))),
        Verdict::Pass(Pass::Local)
    );
    assert!(!outbound_rule(&cfg, &l, &v4(remote, 80, 1000, 1000)).by_proxy_owner());
}
