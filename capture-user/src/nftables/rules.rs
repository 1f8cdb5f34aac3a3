//! The iptables backend's rules (`iptables/rules.rs`), rule for rule and in the same order, as
//! native nftables: one `inet` table per iptables table, named and laid out as Istio's
//! `tools/istio-nftables` lays them out (`istio-proxy-nat`, `-mangle`, `-raw`; base chains
//! `prerouting` and `output` at the priorities of the iptables tables they replace; user chains
//! `istio-inbound`, `istio-redirect`, ...), so that Istio's tooling and an operator reading
//! `nft list ruleset` recognise them.
//!
//! An `inet` table sees both families. A rule that names an address exists once per family the
//! pod has; a rule that names none exists once. A pod without IPv6 gets no IPv6 rules from the
//! iptables backend, so here each base chain first lets IPv6 through untouched.

mod mangle;
mod raw;

use ipnet::IpNet;
use nftables::types::{NfChainType, NfHook};

use super::stmt::{
    counter, daddr, dport, dport_not_in, iifname, jump, l4proto, nfproto, not_syn, oifname, owner,
    redirect, ret, saddr, Owner, Stmt, L4,
};
use crate::{
    config::{CaptureConfig, InterceptionMode, OwnerGroups, Selection},
    iptables::{
        apply::families,
        rules::{Family, SPARE_COMMENT},
    },
};

/// The tables capture writes, as Istio names them.
pub const NAT_TABLE: &str = "istio-proxy-nat";
pub const MANGLE_TABLE: &str = "istio-proxy-mangle";
pub const RAW_TABLE: &str = "istio-proxy-raw";
pub const TABLES: [&str; 3] = [NAT_TABLE, MANGLE_TABLE, RAW_TABLE];

pub const PREROUTING: &str = "prerouting";
pub const OUTPUT: &str = "output";
const INBOUND: &str = "istio-inbound";
const REDIRECT: &str = "istio-redirect";
const IN_REDIRECT: &str = "istio-in-redirect";
const ISTIO_OUTPUT: &str = "istio-output";
const OUTPUT_DNS: &str = "istio-output-dns";
const DIVERT: &str = "istio-divert";
const TPROXY: &str = "istio-tproxy";
const DROP_CHAIN: &str = "istio-drop";

/// A base chain: where it hooks and at which priority (the iptables table's: nat -100, mangle
/// -150, raw -300), and of which type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    pub kind: NfChainType,
    pub hook: NfHook,
    pub priority: i32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub stmts: Vec<Stmt>,
    pub comment: Option<&'static str>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub name: &'static str,
    pub hook: Option<Hook>,
    pub rules: Vec<Rule>,
}

/// One table's chains, in creation order, each with its rules in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub name: &'static str,
    pub chains: Vec<Chain>,
}

impl Table {
    fn new(name: &'static str, chains: &[&'static str]) -> Self {
        Self {
            name,
            chains: chains
                .iter()
                .map(|name| Chain {
                    name,
                    hook: None,
                    rules: Vec::new(),
                })
                .collect(),
        }
    }

    /// The chain, made a base chain on `hook` if it does not exist yet.
    fn chain(&mut self, name: &'static str) -> &mut Chain {
        let i = self
            .chains
            .iter()
            .position(|c| c.name == name)
            .unwrap_or_else(|| {
                self.chains.push(Chain {
                    name,
                    hook: Some(base_hook(self.name, name)),
                    rules: Vec::new(),
                });
                self.chains.len() - 1
            });
        &mut self.chains[i]
    }

    fn append(&mut self, chain: &'static str, stmts: Vec<Stmt>) {
        self.chain(chain).rules.push(Rule {
            stmts,
            comment: None,
        });
    }

    fn insert(&mut self, chain: &'static str, index: usize, rule: Rule) {
        self.chain(chain).rules.insert(index, rule);
    }

    /// A rule for each of `families`, where `rule` makes one (an address of that family).
    fn append_each(
        &mut self,
        chain: &'static str,
        families: &[Family],
        rule: impl Fn(Family) -> Option<Vec<Stmt>>,
    ) {
        for f in families {
            if let Some(stmts) = rule(*f) {
                self.append(chain, stmts);
            }
        }
    }

    /// IPv6 leaves every base chain untouched where the pod has no IPv6 rules.
    fn ipv4_only(&mut self) {
        for chain in self.chains.iter_mut().filter(|c| c.hook.is_some()) {
            chain.rules.insert(
                0,
                Rule {
                    stmts: vec![nfproto(Family::V6), counter(), ret()],
                    comment: None,
                },
            );
        }
    }
}

fn base_hook(table: &str, chain: &str) -> Hook {
    let hook = if chain == PREROUTING {
        NfHook::Prerouting
    } else {
        NfHook::Output
    };
    let (kind, priority) = match (table, hook) {
        (NAT_TABLE, _) => (NfChainType::NAT, -100),
        // A route chain re-routes a packet whose mark it changed, as iptables' mangle OUTPUT.
        (MANGLE_TABLE, NfHook::Output) => (NfChainType::Route, -150),
        (MANGLE_TABLE, _) => (NfChainType::Filter, -150),
        _ => (NfChainType::Filter, -300),
    };
    Hook {
        kind,
        hook,
        priority,
    }
}

fn net(addr: &str) -> IpNet {
    addr.parse().expect("a literal prefix")
}

/// The proxy's passthrough source (`127.0.0.6`) and the host loopback range, per family.
fn passthrough_src(family: Family) -> IpNet {
    match family {
        Family::V4 => net("127.0.0.6/32"),
        Family::V6 => net("::6/128"),
    }
}

fn host_loopback(cfg: &CaptureConfig, family: Family) -> IpNet {
    match family {
        Family::V4 => IpNet::V4(cfg.host_loopback_cidr),
        Family::V6 => net("::1/128"),
    }
}

fn of_family(net: &IpNet, family: Family) -> bool {
    matches!(
        (family, net),
        (Family::V4, IpNet::V4(_)) | (Family::V6, IpNet::V6(_))
    )
}

fn owners(cfg: &CaptureConfig) -> impl Iterator<Item = (Owner, u32)> + '_ {
    let uids = cfg.proxy_uids.iter().map(|id| (Owner::Uid, *id));
    uids.chain(cfg.proxy_gids.iter().map(|id| (Owner::Gid, *id)))
}

/// Every table the pod's rules use, in the order they are written.
#[must_use]
pub fn tables(cfg: &CaptureConfig) -> Vec<Table> {
    let families = families(cfg);
    let mut tables = vec![nat(cfg, &families)];
    if cfg.drop_invalid || cfg.interception_mode == InterceptionMode::Tproxy {
        tables.insert(0, mangle::mangle(cfg, &families));
    }
    if cfg.dns.is_some() {
        tables.push(raw::raw(cfg, &families));
    }
    if !families.contains(&Family::V6) {
        tables.iter_mut().for_each(Table::ipv4_only);
    }
    tables
}

fn nat(cfg: &CaptureConfig, families: &[Family]) -> Table {
    let dns = cfg.dns.as_ref();
    let mut chains = vec![INBOUND, REDIRECT, IN_REDIRECT, ISTIO_OUTPUT];
    if dns.is_some() {
        chains.push(OUTPUT_DNS);
    }
    let mut t = Table::new(NAT_TABLE, &chains);
    for nic in &cfg.exclude_interfaces {
        t.append(PREROUTING, vec![iifname(nic), counter(), ret()]);
        t.append(OUTPUT, vec![oifname(nic, true), counter(), ret()]);
    }
    for nic in &cfg.reroute_virtual_interfaces {
        t.insert(PREROUTING, 0, plain(vec![iifname(nic), counter(), ret()]));
    }
    let tcp = L4::Tcp;
    t.append(
        INBOUND,
        vec![dport(tcp, cfg.tunnel_port, true), counter(), ret()],
    );
    t.append(
        REDIRECT,
        vec![l4proto(tcp), counter(), redirect(cfg.outbound_port)],
    );
    t.append(
        IN_REDIRECT,
        vec![l4proto(tcp), counter(), redirect(cfg.inbound_port)],
    );
    if cfg.interception_mode != InterceptionMode::Tproxy {
        nat_inbound(cfg, &mut t);
    }
    t.append(OUTPUT, vec![counter(), jump(ISTIO_OUTPUT)]);
    for p in &cfg.exclude_outbound_ports {
        for proto in [L4::Tcp, L4::Udp] {
            t.append(ISTIO_OUTPUT, vec![dport(proto, *p, true), counter(), ret()]);
        }
    }
    t.append_each(ISTIO_OUTPUT, families, |f| {
        Some(vec![
            oifname("lo", true),
            saddr(&passthrough_src(f)),
            counter(),
            ret(),
        ])
    });
    nat_owners(cfg, families, &mut t);
    if let Some(dns) = dns {
        t.append(ISTIO_OUTPUT, vec![counter(), jump(OUTPUT_DNS)]);
        for proto in [L4::Tcp, L4::Udp] {
            let redirect_dns = |server: Option<IpNet>| {
                let mut s: Vec<Stmt> = server.map(|n| daddr(&n, true)).into_iter().collect();
                s.extend([dport(proto, 53, true), counter(), redirect(dns.port)]);
                s
            };
            if dns.capture_all {
                t.append(OUTPUT_DNS, redirect_dns(None));
            } else {
                for server in nameservers(cfg, families) {
                    t.append(OUTPUT_DNS, redirect_dns(Some(server)));
                }
            }
        }
    }
    t.append_each(ISTIO_OUTPUT, families, |f| {
        Some(vec![daddr(&host_loopback(cfg, f), true), counter(), ret()])
    });
    for n in cfg
        .exclude_outbound_cidrs
        .iter()
        .filter(|n| in_any(n, families))
    {
        t.append(ISTIO_OUTPUT, vec![daddr(n, true), counter(), ret()]);
    }
    for p in &cfg.include_outbound_ports {
        t.append(
            ISTIO_OUTPUT,
            vec![dport(tcp, *p, true), counter(), jump(REDIRECT)],
        );
    }
    nat_outbound(cfg, families, &mut t);
    if cfg.spare_open_connections {
        for chain in [PREROUTING, OUTPUT] {
            let rule = Rule {
                stmts: vec![not_syn(), counter(), ret()],
                comment: Some(SPARE_COMMENT),
            };
            t.insert(chain, 0, rule);
        }
    }
    t
}

fn plain(stmts: Vec<Stmt>) -> Rule {
    Rule {
        stmts,
        comment: None,
    }
}

fn in_any(net: &IpNet, families: &[Family]) -> bool {
    families.iter().any(|f| of_family(net, *f))
}

fn nameservers(cfg: &CaptureConfig, families: &[Family]) -> Vec<IpNet> {
    let Some(dns) = &cfg.dns else {
        return Vec::new();
    };
    dns.nameservers
        .iter()
        .map(|a| IpNet::from(*a))
        .filter(|n| in_any(n, families))
        .collect()
}

/// Inbound TCP into `istio-inbound`, and out of it again on the excluded ports (`exclusions`:
/// all ports are captured but those).
fn enter_inbound(cfg: &CaptureConfig, t: &mut Table, exclusions: bool) {
    t.append(PREROUTING, vec![l4proto(L4::Tcp), counter(), jump(INBOUND)]);
    for p in cfg.exclude_inbound_ports.iter().filter(|_| exclusions) {
        t.append(INBOUND, vec![dport(L4::Tcp, *p, true), counter(), ret()]);
    }
}

/// Inbound capture in REDIRECT mode: every port (but the excluded), or the listed ones only.
fn nat_inbound(cfg: &CaptureConfig, t: &mut Table) {
    let tcp = L4::Tcp;
    match &cfg.include_inbound_ports {
        Selection::List(ports) if ports.is_empty() => {}
        Selection::All => {
            enter_inbound(cfg, t, true);
            t.append(INBOUND, vec![l4proto(tcp), counter(), jump(IN_REDIRECT)]);
        }
        // An explicit include list ignores the exclude list, as in the iptables rules.
        Selection::List(ports) => {
            enter_inbound(cfg, t, false);
            for p in ports {
                t.append(
                    INBOUND,
                    vec![dport(tcp, *p, true), counter(), jump(IN_REDIRECT)],
                );
            }
        }
    }
}

/// The proxy's own traffic: back to itself over loopback (pod-to-self through the proxy), else
/// exempt; and the owner groups the mesh captures.
fn nat_owners(cfg: &CaptureConfig, families: &[Family], t: &mut Table) {
    let dns = cfg.dns.is_some();
    let no_lo_return = cfg.include_covers_loopback();
    for (who, id) in owners(cfg) {
        let spared = move || {
            if dns && who == Owner::Uid {
                dport_not_in(L4::Tcp, &[53, cfg.tunnel_port])
            } else {
                dport(L4::Tcp, cfg.tunnel_port, false)
            }
        };
        t.append_each(ISTIO_OUTPUT, families, |f| {
            Some(vec![
                oifname("lo", true),
                daddr(&host_loopback(cfg, f), false),
                spared(),
                owner(who, id, true),
                counter(),
                jump(IN_REDIRECT),
            ])
        });
        if !no_lo_return {
            let mut s = vec![oifname("lo", true)];
            if dns {
                s.push(dport(L4::Tcp, 53, false));
            }
            s.extend([owner(who, id, false), counter(), ret()]);
            t.append(ISTIO_OUTPUT, s);
        }
        t.append(ISTIO_OUTPUT, vec![owner(who, id, true), counter(), ret()]);
    }
    match &cfg.owner_groups {
        OwnerGroups::All => {}
        OwnerGroups::Only(groups) => {
            let mut s: Vec<Stmt> = groups
                .iter()
                .map(|g| owner(Owner::Gid, *g, false))
                .collect();
            s.extend([counter(), ret()]);
            t.append(ISTIO_OUTPUT, s);
        }
        OwnerGroups::AllBut(groups) => {
            for g in groups {
                t.append(
                    ISTIO_OUTPUT,
                    vec![owner(Owner::Gid, *g, true), counter(), ret()],
                );
            }
        }
    }
}

/// Outbound capture by destination, and traffic entering through a virtual interface, which is
/// the pod's own outbound traffic.
fn nat_outbound(cfg: &CaptureConfig, families: &[Family], t: &mut Table) {
    match &cfg.include_outbound_cidrs {
        Selection::All => {
            t.append(ISTIO_OUTPUT, vec![counter(), jump(REDIRECT)]);
            for nic in &cfg.reroute_virtual_interfaces {
                let rule = plain(vec![iifname(nic), counter(), jump(REDIRECT)]);
                t.insert(PREROUTING, 0, rule);
            }
        }
        Selection::List(nets) => {
            let nets: Vec<&IpNet> = nets.iter().filter(|n| in_any(n, families)).collect();
            for n in &nets {
                t.append(
                    ISTIO_OUTPUT,
                    vec![daddr(n, true), counter(), jump(REDIRECT)],
                );
            }
            for n in &nets {
                for nic in &cfg.reroute_virtual_interfaces {
                    let rule = plain(vec![
                        iifname(nic),
                        daddr(n, true),
                        counter(),
                        jump(REDIRECT),
                    ]);
                    t.insert(PREROUTING, 0, rule);
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "rules_tests.rs"]
mod tests;
