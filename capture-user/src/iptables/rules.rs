//! Rule generation for `iptables-restore` / `ip6tables-restore`, in the emission order of Istio's
//! `istio-iptables` (`tools/istio-iptables/pkg/capture/run.go` in istio/istio; its
//! `testdata/*.golden` are `tests/tests/userspace/istio_goldens.rs`'s expectations), REDIRECT and
//! TPROXY modes, with its DNS and owner-group variants.

use crate::config::{CaptureConfig, DnsCapture, InterceptionMode, OwnerGroups, Selection};

pub use capture_model::family::Family;

/// Does DNS capture redirect this family's queries (`captureAll`, or a nameserver of the
/// family)? Istio jumps to the DNS chain, and marks replies' conntrack zone, only then
/// (`SetupDNSRedir`, `addDNSConntrackZones` in run.go).
fn dns_in(family: Family, dns: &DnsCapture) -> bool {
    dns.capture_all || !family.nameservers(dns).is_empty()
}

/// `excludeInboundPorts` as RETURNs from `ISTIO_INBOUND` (nat in REDIRECT mode, mangle in TPROXY).
fn inbound_exclusions(cfg: &CaptureConfig) -> impl Iterator<Item = String> + '_ {
    cfg.exclude_inbound_ports
        .iter()
        .map(|p| format!("-A ISTIO_INBOUND -p tcp --dport {p} -j RETURN"))
}

/// The DNS chain, present only with DNS capture.
pub const DNS_CHAIN: &str = "ISTIO_OUTPUT_DNS";
/// The chain `--drop-invalid` sends invalid packets to.
pub const DROP_CHAIN: &str = "ISTIO_DROP";

/// The chains a table's rules create (their `-N` lines), which detach flushes and deletes.
#[must_use]
pub fn chains_of(rules: &[String]) -> Vec<&str> {
    rules.iter().filter_map(|r| r.strip_prefix("-N ")).collect()
}

/// The chains capture creates in the nat table for one family (and removes on detach).
#[must_use]
pub fn nat_chains(cfg: &CaptureConfig, family: Family) -> Vec<&'static str> {
    let mut c = vec![
        "ISTIO_INBOUND",
        "ISTIO_REDIRECT",
        "ISTIO_IN_REDIRECT",
        "ISTIO_OUTPUT",
    ];
    if cfg.dns.as_ref().is_some_and(|dns| dns_in(family, dns)) {
        c.push(DNS_CHAIN);
    }
    c
}

/// The nat-table rules for one family, one per line, without the table header and COMMIT.
#[must_use]
pub fn nat_rules(cfg: &CaptureConfig, family: Family) -> Vec<String> {
    let (passthrough_src, host_loopback) = match family {
        Family::V4 => (
            "127.0.0.6/32".to_string(),
            cfg.host_loopback_cidr.to_string(),
        ),
        Family::V6 => ("::6/128".to_string(), "::1/128".to_string()),
    };
    let mut r: Vec<String> = nat_chains(cfg, family)
        .iter()
        .map(|c| format!("-N {c}"))
        .collect();
    for nic in &cfg.exclude_interfaces {
        r.push(format!("-A PREROUTING -i {nic} -j RETURN"));
        r.push(format!("-A OUTPUT -o {nic} -j RETURN"));
    }
    // Virtual interfaces never reach inbound capture (T66); their redirects are inserted above
    // these RETURNs at the end.
    for nic in &cfg.reroute_virtual_interfaces {
        r.push(format!("-I PREROUTING 1 -i {nic} -j RETURN"));
    }
    r.push(format!(
        "-A ISTIO_INBOUND -p tcp --dport {} -j RETURN",
        cfg.tunnel_port
    ));
    r.push(format!(
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports {}",
        cfg.outbound_port
    ));
    r.push(format!(
        "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports {}",
        cfg.inbound_port
    ));

    nat_inbound(cfg, &mut r);

    r.push("-A OUTPUT -j ISTIO_OUTPUT".into());
    for p in &cfg.exclude_outbound_ports {
        r.push(format!("-A ISTIO_OUTPUT -p tcp --dport {p} -j RETURN"));
        r.push(format!("-A ISTIO_OUTPUT -p udp --dport {p} -j RETURN"));
    }
    r.push(format!(
        "-A ISTIO_OUTPUT -o lo -s {passthrough_src} -j RETURN"
    ));
    nat_owners(cfg, &host_loopback, &mut r);
    nat_dns(cfg, family, &mut r);
    r.push(format!("-A ISTIO_OUTPUT -d {host_loopback} -j RETURN"));
    for net in cfg.exclude_outbound_cidrs.iter().filter(|n| family.owns(n)) {
        r.push(format!("-A ISTIO_OUTPUT -d {net} -j RETURN"));
    }
    nat_destinations(cfg, family, &mut r);
    if cfg.spare_open_connections {
        // conntrack first sees a connection opened before the rules mid-stream, and takes that
        // packet for the first of a new connection, which NAT would redirect; a new connection's
        // first packet is always a SYN.
        for builtin in ["PREROUTING", "OUTPUT"] {
            r.push(format!(
                "-I {builtin} 1 -p tcp ! --syn -m comment --comment \"{SPARE_COMMENT}\" -j RETURN"
            ));
        }
    }
    r
}

/// Inbound capture in nat (REDIRECT mode; under TPROXY it is mangle's).
fn nat_inbound(cfg: &CaptureConfig, r: &mut Vec<String>) {
    // Under TPROXY, inbound capture lives in the mangle table; the nat chain stays unused.
    let tproxy = cfg.interception_mode == InterceptionMode::Tproxy;
    match &cfg.include_inbound_ports {
        _ if tproxy => {}
        Selection::List(ports) if ports.is_empty() => {}
        Selection::All => {
            r.push("-A PREROUTING -p tcp -j ISTIO_INBOUND".into());
            r.extend(inbound_exclusions(cfg));
            r.push("-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT".into());
        }
        // An explicit include list ignores the exclude list (parity-spec.md E.8).
        Selection::List(ports) => {
            r.push("-A PREROUTING -p tcp -j ISTIO_INBOUND".into());
            r.extend(
                ports
                    .iter()
                    .map(|p| format!("-A ISTIO_INBOUND -p tcp --dport {p} -j ISTIO_IN_REDIRECT")),
            );
        }
    }
}

/// The proxy's own connections (its uids and gids) and the owner-group lists.
fn nat_owners(cfg: &CaptureConfig, host_loopback: &str, r: &mut Vec<String>) {
    let dns = cfg.dns.as_ref();
    let no_lo_return = cfg.include_covers_loopback();
    for (flag, ids) in [
        ("--uid-owner", &cfg.proxy_uids),
        ("--gid-owner", &cfg.proxy_gids),
    ] {
        // Under DNS capture the uid rules spare port 53 from the inbound redirect, and every
        // lo-RETURN rule spares DNS (B9/B10 in the DNS golden).
        let spared = if dns.is_some() && flag == "--uid-owner" {
            format!("-m multiport ! --dports 53,{}", cfg.tunnel_port)
        } else {
            format!("! --dport {}", cfg.tunnel_port)
        };
        let lo_match = if dns.is_some() {
            "-o lo -p tcp ! --dport 53"
        } else {
            "-o lo"
        };
        for id in ids {
            r.push(format!(
                "-A ISTIO_OUTPUT -o lo ! -d {host_loopback} -p tcp {spared} -m owner {flag} {id} -j ISTIO_IN_REDIRECT"
            ));
            if !no_lo_return {
                r.push(format!(
                    "-A ISTIO_OUTPUT {lo_match} -m owner ! {flag} {id} -j RETURN"
                ));
            }
            r.push(format!("-A ISTIO_OUTPUT -m owner {flag} {id} -j RETURN"));
        }
    }
    match &cfg.owner_groups {
        OwnerGroups::All => {}
        OwnerGroups::Only(groups) => {
            let not_listed: String = groups
                .iter()
                .map(|g| format!(" -m owner ! --gid-owner {g}"))
                .collect();
            r.push(format!("-A ISTIO_OUTPUT{not_listed} -j RETURN"));
        }
        OwnerGroups::AllBut(groups) => {
            r.extend(
                groups
                    .iter()
                    .map(|g| format!("-A ISTIO_OUTPUT -m owner --gid-owner {g} -j RETURN")),
            );
        }
    }
}

/// DNS capture's chain, for a family whose queries it redirects.
fn nat_dns(cfg: &CaptureConfig, family: Family, r: &mut Vec<String>) {
    if let Some(dns) = cfg.dns.as_ref().filter(|dns| dns_in(family, dns)) {
        r.push(format!("-A ISTIO_OUTPUT -j {DNS_CHAIN}"));
        let targets: Vec<String> = if dns.capture_all {
            vec![String::new()]
        } else {
            family
                .nameservers(dns)
                .iter()
                .map(|n| format!(" -d {n}"))
                .collect()
        };
        for d in &targets {
            r.push(format!(
                "-A {DNS_CHAIN} -p tcp --dport 53{d} -j REDIRECT --to-ports {}",
                dns.port
            ));
        }
        for d in &targets {
            r.push(format!(
                "-A {DNS_CHAIN} -p udp --dport 53{d} -j REDIRECT --to-port {}",
                dns.port
            ));
        }
    }
}

/// The outbound destinations sent to the proxy: included ports and CIDRs, and what enters
/// through virtual interfaces.
fn nat_destinations(cfg: &CaptureConfig, family: Family, r: &mut Vec<String>) {
    for p in &cfg.include_outbound_ports {
        r.push(format!(
            "-A ISTIO_OUTPUT -p tcp --dport {p} -j ISTIO_REDIRECT"
        ));
    }
    match &cfg.include_outbound_cidrs {
        Selection::All => r.push("-A ISTIO_OUTPUT -j ISTIO_REDIRECT".into()),
        Selection::List(nets) => {
            for net in nets.iter().filter(|n| family.owns(n)) {
                r.push(format!("-A ISTIO_OUTPUT -d {net} -j ISTIO_REDIRECT"));
            }
        }
    }
    // Traffic entering through a virtual interface is the pod's outbound traffic (T64, T65).
    match &cfg.include_outbound_cidrs {
        Selection::All => {
            for nic in &cfg.reroute_virtual_interfaces {
                r.push(format!("-I PREROUTING 1 -i {nic} -j ISTIO_REDIRECT"));
            }
        }
        Selection::List(nets) => {
            for net in nets.iter().filter(|n| family.owns(n)) {
                for nic in &cfg.reroute_virtual_interfaces {
                    r.push(format!(
                        "-I PREROUTING 1 -i {nic} -d {net} -j ISTIO_REDIRECT"
                    ));
                }
            }
        }
    }
}

/// Names the rules that spare a repaired pod's open connections, for an operator reading
/// `iptables-save`.
pub const SPARE_COMMENT: &str = "capture: connections open before capture";

/// The raw-table rules for DNS capture: conntrack zones that keep the proxy's own DNS apart from
/// the app's, so that replies are un-NATed (`addDNSConntrackZones` in run.go). The proxy's zones
/// are set in every family, the app's only where its queries are redirected. Empty without DNS
/// capture.
#[must_use]
pub fn raw_rules(cfg: &CaptureConfig, family: Family) -> Vec<String> {
    let Some(dns) = &cfg.dns else {
        return Vec::new();
    };
    let redirected = dns_in(family, dns);
    let mut r = vec![format!("-N {DNS_CHAIN}")];
    if redirected {
        r.push("-N ISTIO_INBOUND".into());
    }
    r.push(format!("-A OUTPUT -j {DNS_CHAIN}"));
    for (flag, ids) in [
        ("--uid-owner", &cfg.proxy_uids),
        ("--gid-owner", &cfg.proxy_gids),
    ] {
        for id in ids {
            r.push(format!(
                "-A {DNS_CHAIN} -p udp --dport 53 -m owner {flag} {id} -j CT --zone 1"
            ));
            r.push(format!(
                "-A {DNS_CHAIN} -p udp --sport {} -m owner {flag} {id} -j CT --zone 2",
                dns.port
            ));
        }
    }
    if !redirected {
        return r;
    }
    r.push("-A PREROUTING -j ISTIO_INBOUND".into());
    let servers: Vec<(String, String)> = if dns.capture_all {
        vec![(String::new(), String::new())]
    } else {
        family
            .nameservers(dns)
            .iter()
            .map(|n| (format!(" -d {n}"), format!(" -s {n}")))
            .collect()
    };
    for (d, s) in servers {
        r.push(format!(
            "-A {DNS_CHAIN} -p udp --dport 53{d} -j CT --zone 2"
        ));
        r.push(format!(
            "-A ISTIO_INBOUND -p udp --sport 53{s} -j CT --zone 1"
        ));
    }
    r
}

fn table(out: &mut String, name: &str, lines: &[String]) {
    if lines.is_empty() {
        return;
    }
    out.push_str(&format!("* {name}\n"));
    for line in lines {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
}

/// The mark TPROXY gives captured inbound packets (`-t`), and the routing table that delivers
/// them locally (`-r`).
pub const TPROXY_MARK: u32 = 1337;
pub const TPROXY_TABLE: u32 = 133;
/// The mangle chains TPROXY mode creates.
pub const TPROXY_CHAINS: [&str; 3] = ["ISTIO_DIVERT", "ISTIO_TPROXY", "ISTIO_INBOUND"];

/// The mangle-table rules: `excludeInterfaces` under TPROXY, `--drop-invalid`'s, and TPROXY
/// inbound capture (`shortCircuitExcludeInterfaces`, then the rest of run.go's `Run`).
#[must_use]
pub fn mangle_rules(cfg: &CaptureConfig, family: Family) -> Vec<String> {
    let mut r = Vec::new();
    let tproxy = cfg.interception_mode == InterceptionMode::Tproxy;
    if tproxy {
        r.extend(TPROXY_CHAINS.iter().map(|c| format!("-N {c}")));
    }
    if cfg.drop_invalid {
        r.push(format!("-N {DROP_CHAIN}"));
    }
    // TPROXY captures inbound in this table, so an excluded interface must leave it here too,
    // as it leaves the nat table.
    if tproxy {
        for nic in &cfg.exclude_interfaces {
            r.push(format!("-A PREROUTING -i {nic} -j RETURN"));
            r.push(format!("-A OUTPUT -o {nic} -j RETURN"));
        }
    }
    if cfg.drop_invalid {
        r.push(format!(
            "-A PREROUTING -m conntrack --ctstate INVALID -j {DROP_CHAIN}"
        ));
        r.push(format!("-A {DROP_CHAIN} -j DROP"));
    }
    if !tproxy {
        return r;
    }
    let (passthrough_src, host_loopback) = match family {
        Family::V4 => (
            "127.0.0.6/32".to_string(),
            cfg.host_loopback_cidr.to_string(),
        ),
        Family::V6 => ("::6/128".to_string(), "::1/128".to_string()),
    };
    let (mark, port) = (TPROXY_MARK, cfg.inbound_port);
    r.push(format!("-A ISTIO_DIVERT -j MARK --set-mark {mark}"));
    r.push("-A ISTIO_DIVERT -j ACCEPT".into());
    r.push(format!(
        "-A ISTIO_TPROXY ! -d {host_loopback} -p tcp -j TPROXY --tproxy-mark {mark}/0xffffffff --on-port {port}"
    ));
    let established = "-m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT";
    match &cfg.include_inbound_ports {
        Selection::List(ports) if ports.is_empty() => {}
        // No tunnel-port exemption here: under TPROXY 15008 is captured too (parity-spec.md E.5, T56).
        Selection::All => {
            r.push("-A PREROUTING -p tcp -j ISTIO_INBOUND".into());
            r.extend(inbound_exclusions(cfg));
            r.push(format!("-A ISTIO_INBOUND -p tcp {established}"));
            r.push("-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY".into());
        }
        Selection::List(ports) => {
            r.push("-A PREROUTING -p tcp -j ISTIO_INBOUND".into());
            for p in ports {
                r.push(format!("-A ISTIO_INBOUND -p tcp --dport {p} {established}"));
                r.push(format!(
                    "-A ISTIO_INBOUND -p tcp --dport {p} -j ISTIO_TPROXY"
                ));
            }
        }
    }
    r.push(format!(
        "-A PREROUTING -p tcp -m mark --mark {mark} -j CONNMARK --save-mark"
    ));
    r.push(format!(
        "-A OUTPUT -p tcp -o lo -m mark --mark {mark} -j RETURN"
    ));
    for (flag, ids) in [
        ("--uid-owner", &cfg.proxy_uids),
        ("--gid-owner", &cfg.proxy_gids),
    ] {
        for id in ids {
            r.push(format!(
                "-A OUTPUT ! -d {host_loopback} -p tcp -o lo -m owner {flag} {id} -j MARK --set-mark {}",
                mark + 1
            ));
        }
    }
    r.push(format!(
        "-A OUTPUT -p tcp -m connmark --mark {mark} -j CONNMARK --restore-mark"
    ));
    r.push(format!(
        "-I ISTIO_INBOUND 1 -p tcp -m mark --mark {mark} -j RETURN"
    ));
    r.push(format!(
        "-I ISTIO_INBOUND 2 -p tcp -s {passthrough_src} -i lo -j RETURN"
    ));
    r.push(format!(
        "-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark {} -j RETURN",
        mark + 1
    ));
    r
}

/// Input for `iptables-restore --noflush` (or `ip6tables-restore`).
#[must_use]
pub fn restore_input(cfg: &CaptureConfig, family: Family) -> String {
    let mut out = String::new();
    table(&mut out, "mangle", &mangle_rules(cfg, family));
    table(&mut out, "nat", &nat_rules(cfg, family));
    table(&mut out, "raw", &raw_rules(cfg, family));
    out
}

#[cfg(test)]
#[path = "rules_tests.rs"]
mod tests;
