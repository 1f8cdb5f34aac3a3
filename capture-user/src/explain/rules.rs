//! What each rule of the decision means: a name for scripts, the rule in words, and the Istio
//! iptables rule it stands for, written as `rules.rs` writes it for the pod's configuration so
//! that an iptables pod's live rule (and its packet counter) can be found by it.

use std::net::IpAddr;

use capture_common::decision::{InboundRule, OutboundRule};
use ipnet::IpNet;

use crate::{
    config::{CaptureConfig, InterceptionMode, OwnerGroups, Selection},
    iptables::rules::{Family, DNS_CHAIN},
};

/// Where an iptables rule lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Table {
    Nat,
    Mangle,
}

/// The Istio iptables rule a decision stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Equivalent {
    /// One rule, as `iptables -S` writes it (and `rules.rs` emits it).
    Rule { table: Table, line: String },
    /// No rule matches: the connection leaves the chains unchanged, for the reason given.
    NoRule(&'static str),
}

/// The facts of one connection an equivalent rule is written with.
pub struct Facts<'a> {
    pub cfg: &'a CaptureConfig,
    pub family: Family,
    pub udp: bool,
    pub dst: IpAddr,
    pub dst_port: u16,
    /// The index of the proxy uid (or gid) the owner rules matched or stopped at.
    pub owner_index: usize,
    pub gid: u32,
}

impl Facts<'_> {
    fn proto(&self) -> &'static str {
        if self.udp {
            "udp"
        } else {
            "tcp"
        }
    }

    fn host_loopback(&self) -> String {
        match self.family {
            Family::V4 => self.cfg.host_loopback_cidr.to_string(),
            Family::V6 => "::1/128".to_string(),
        }
    }

    fn first_net<'n>(&self, nets: &'n [IpNet]) -> Option<&'n IpNet> {
        nets.iter().find(|n| n.contains(&self.dst))
    }

    fn id(&self, ids: &[u32]) -> u32 {
        ids.get(self.owner_index).copied().unwrap_or_default()
    }

    /// Rule B9/B12: a proxy id's connection to a local address goes to the inbound listener.
    fn to_local(&self, flag: &str, id: u32) -> String {
        let tunnel = self.cfg.tunnel_port;
        let spared = if self.cfg.dns.is_some() && flag == "--uid-owner" {
            format!("-m multiport ! --dports 53,{tunnel}")
        } else {
            format!("! --dport {tunnel}")
        };
        format!(
            "-A ISTIO_OUTPUT -o lo ! -d {} -p tcp {spared} -m owner {flag} {id} -j ISTIO_IN_REDIRECT",
            self.host_loopback()
        )
    }

    /// Rule B10/B13: anyone else's connection to a local address stays in the pod.
    fn local_other(&self, flag: &str, id: u32) -> String {
        let lo_match = if self.cfg.dns.is_some() {
            "-o lo -p tcp ! --dport 53"
        } else {
            "-o lo"
        };
        format!("-A ISTIO_OUTPUT {lo_match} -m owner ! {flag} {id} -j RETURN")
    }
}

fn nat(line: String) -> Equivalent {
    Equivalent::Rule {
        table: Table::Nat,
        line,
    }
}

/// An outbound rule in words.
#[must_use]
pub const fn outbound_words(rule: OutboundRule) -> &'static str {
    use OutboundRule as R;
    match rule {
            R::FamilyNotCaptured => "IPv6 in a pod without an IPv6 address: Istio writes no ip6tables rules for it",
            R::ExcludedPort => "the destination port is in excludeOutboundPorts, which ranks above every other rule",
            R::InboundPassthroughSource => "the source is 127.0.0.6 (::6), the proxy's inbound passthrough, towards a local address",
            R::ProxyUidToLocal | R::ProxyGidToLocal => "the proxy's own connection to the pod's address goes to the inbound listener",
            R::LocalNotProxyUid | R::LocalNotProxyGid => "a connection to a local address by anyone but the proxy stays inside the pod",
            R::ProxyUid | R::ProxyGid => "the proxy's own connection (uid or gid 1337 by default) is never captured",
            R::OwnerGroup => "the socket's primary group is not captured (ISTIO_OUTBOUND_OWNER_GROUPS)",
            R::Dns => "DNS to a captured nameserver goes to the DNS proxy",
            R::NotTcp => "UDP other than captured DNS is never sent to the proxy",
            R::HostLoopback => "the host loopback range stays inside the pod",
            R::ExcludedCidr => "the destination is in excludeOutboundIPRanges",
            R::IncludedPort => "the destination port is in includeOutboundPorts",
            R::AllOutbound => "includeOutboundIPRanges is \"*\": every other TCP destination goes to the proxy",
            R::IncludedCidr => "the destination is in includeOutboundIPRanges",
            R::NotIncluded => "no include rule (includeOutboundIPRanges, includeOutboundPorts) matches",
        }
}

/// The Istio iptables rule an outbound decision stands for, for the connection of `facts`.
#[must_use]
pub fn outbound_equivalent(rule: OutboundRule, facts: &Facts<'_>) -> Equivalent {
    use OutboundRule as R;
    let cfg = facts.cfg;
    match rule {
        R::FamilyNotCaptured => {
            Equivalent::NoRule("no ip6tables rules for a pod without an IPv6 address")
        }
        R::ExcludedPort => nat(format!(
            "-A ISTIO_OUTPUT -p {} --dport {} -j RETURN",
            facts.proto(),
            facts.dst_port
        )),
        R::InboundPassthroughSource => nat(format!(
            "-A ISTIO_OUTPUT -o lo -s {} -j RETURN",
            match facts.family {
                Family::V4 => "127.0.0.6/32",
                Family::V6 => "::6/128",
            }
        )),
        R::ProxyUidToLocal => nat(facts.to_local("--uid-owner", facts.id(&cfg.proxy_uids))),
        R::ProxyGidToLocal => nat(facts.to_local("--gid-owner", facts.id(&cfg.proxy_gids))),
        R::LocalNotProxyUid => nat(facts.local_other("--uid-owner", facts.id(&cfg.proxy_uids))),
        R::LocalNotProxyGid => nat(facts.local_other("--gid-owner", facts.id(&cfg.proxy_gids))),
        R::ProxyUid => nat(format!(
            "-A ISTIO_OUTPUT -m owner --uid-owner {} -j RETURN",
            facts.id(&cfg.proxy_uids)
        )),
        R::ProxyGid => nat(format!(
            "-A ISTIO_OUTPUT -m owner --gid-owner {} -j RETURN",
            facts.id(&cfg.proxy_gids)
        )),
        R::OwnerGroup => nat(match &cfg.owner_groups {
            OwnerGroups::Only(groups) => {
                let not_listed: String = groups
                    .iter()
                    .map(|g| format!(" -m owner ! --gid-owner {g}"))
                    .collect();
                format!("-A ISTIO_OUTPUT{not_listed} -j RETURN")
            }
            OwnerGroups::All | OwnerGroups::AllBut(_) => format!(
                "-A ISTIO_OUTPUT -m owner --gid-owner {} -j RETURN",
                facts.gid
            ),
        }),
        R::Dns => {
            let Some(dns) = &cfg.dns else {
                return Equivalent::NoRule("DNS capture is off");
            };
            let to = if dns.capture_all {
                String::new()
            } else {
                format!(" -d {}", IpNet::from(facts.dst))
            };
            let (proto, to_port) = if facts.udp {
                ("udp", "--to-port")
            } else {
                ("tcp", "--to-ports")
            };
            nat(format!(
                "-A {DNS_CHAIN} -p {proto} --dport 53{to} -j REDIRECT {to_port} {}",
                dns.port
            ))
        }
        R::NotTcp => Equivalent::NoRule(
            "ISTIO_REDIRECT and ISTIO_IN_REDIRECT match TCP only: UDP other than DNS falls through",
        ),
        R::HostLoopback => nat(format!(
            "-A ISTIO_OUTPUT -d {} -j RETURN",
            facts.host_loopback()
        )),
        R::ExcludedCidr => match facts.first_net(&cfg.exclude_outbound_cidrs) {
            Some(net) => nat(format!("-A ISTIO_OUTPUT -d {net} -j RETURN")),
            None => Equivalent::NoRule("no excludeOutboundIPRanges range holds the destination"),
        },
        R::IncludedPort => nat(format!(
            "-A ISTIO_OUTPUT -p tcp --dport {} -j ISTIO_REDIRECT",
            facts.dst_port
        )),
        R::AllOutbound => nat("-A ISTIO_OUTPUT -j ISTIO_REDIRECT".to_string()),
        R::IncludedCidr => match &cfg.include_outbound_cidrs {
            Selection::List(nets) => match facts.first_net(nets) {
                Some(net) => nat(format!("-A ISTIO_OUTPUT -d {net} -j ISTIO_REDIRECT")),
                None => {
                    Equivalent::NoRule("no includeOutboundIPRanges range holds the destination")
                }
            },
            Selection::All => nat("-A ISTIO_OUTPUT -j ISTIO_REDIRECT".to_string()),
        },
        R::NotIncluded => Equivalent::NoRule(
            "no rule of ISTIO_OUTPUT matches: the connection leaves OUTPUT unchanged",
        ),
    }
}

/// An inbound rule in words.
#[must_use]
pub const fn inbound_words(rule: InboundRule) -> &'static str {
    use InboundRule as R;
    match rule {
        R::Disabled => "includeInboundPorts is empty: no inbound capture",
        R::Tunnel => "the HBONE tunnel port (15008) is never captured in REDIRECT mode",
        R::ExcludedPort => "the port is in excludeInboundPorts",
        R::AllPorts => {
            "includeInboundPorts is \"*\": every other port goes to the inbound listener"
        }
        R::IncludedPort => "the port is in includeInboundPorts",
        R::NotIncluded => "the port is not in the explicit includeInboundPorts list",
    }
}

/// The Istio iptables rule an inbound decision stands for, for an arriving connection to `port`.
#[must_use]
pub fn inbound_equivalent(rule: InboundRule, cfg: &CaptureConfig, port: u16) -> Equivalent {
    use InboundRule as R;
    let tproxy = cfg.interception_mode == InterceptionMode::Tproxy;
    let (table, capture) = if tproxy {
        (Table::Mangle, "ISTIO_TPROXY")
    } else {
        (Table::Nat, "ISTIO_IN_REDIRECT")
    };
    let in_table = |line: String| Equivalent::Rule { table, line };
    match rule {
        R::Disabled => Equivalent::NoRule("no PREROUTING jump to ISTIO_INBOUND"),
        R::Tunnel if tproxy => Equivalent::NoRule("under TPROXY the tunnel port is captured too"),
        R::Tunnel | R::ExcludedPort => {
            in_table(format!("-A ISTIO_INBOUND -p tcp --dport {port} -j RETURN"))
        }
        R::AllPorts => in_table(format!("-A ISTIO_INBOUND -p tcp -j {capture}")),
        R::IncludedPort => in_table(format!(
            "-A ISTIO_INBOUND -p tcp --dport {port} -j {capture}"
        )),
        R::NotIncluded => Equivalent::NoRule(
            "no rule of ISTIO_INBOUND matches: the connection keeps its destination",
        ),
    }
}
