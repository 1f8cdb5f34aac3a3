//! Rule generation for `iptables-restore` / `ip6tables-restore`, in the emission order of Istio's
//! `istio-iptables` (spec section B), REDIRECT mode.

use ipnet::IpNet;

use crate::config::{CaptureConfig, Selection};

/// Which of the two rule sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn owns(self, net: &IpNet) -> bool {
        matches!(
            (self, net),
            (Self::V4, IpNet::V4(_)) | (Self::V6, IpNet::V6(_))
        )
    }
}

/// The chains capture creates in the nat table (and removes on detach).
pub const NAT_CHAINS: [&str; 4] = [
    "ISTIO_INBOUND",
    "ISTIO_REDIRECT",
    "ISTIO_IN_REDIRECT",
    "ISTIO_OUTPUT",
];

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
    let mut r: Vec<String> = NAT_CHAINS.iter().map(|c| format!("-N {c}")).collect();
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

    match &cfg.include_inbound_ports {
        Selection::List(ports) if ports.is_empty() => {}
        Selection::All => {
            r.push("-A PREROUTING -p tcp -j ISTIO_INBOUND".into());
            r.extend(
                cfg.exclude_inbound_ports
                    .iter()
                    .map(|p| format!("-A ISTIO_INBOUND -p tcp --dport {p} -j RETURN")),
            );
            r.push("-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT".into());
        }
        // An explicit include list ignores the exclude list (spec E.8).
        Selection::List(ports) => {
            r.push("-A PREROUTING -p tcp -j ISTIO_INBOUND".into());
            r.extend(
                ports
                    .iter()
                    .map(|p| format!("-A ISTIO_INBOUND -p tcp --dport {p} -j ISTIO_IN_REDIRECT")),
            );
        }
    }

    r.push("-A OUTPUT -j ISTIO_OUTPUT".into());
    for p in &cfg.exclude_outbound_ports {
        r.push(format!("-A ISTIO_OUTPUT -p tcp --dport {p} -j RETURN"));
        r.push(format!("-A ISTIO_OUTPUT -p udp --dport {p} -j RETURN"));
    }
    r.push(format!(
        "-A ISTIO_OUTPUT -o lo -s {passthrough_src} -j RETURN"
    ));
    let no_lo_return = cfg.include_covers_loopback();
    for (flag, ids) in [
        ("--uid-owner", &cfg.proxy_uids),
        ("--gid-owner", &cfg.proxy_gids),
    ] {
        for id in ids {
            r.push(format!(
                "-A ISTIO_OUTPUT -o lo ! -d {host_loopback} -p tcp ! --dport {} -m owner {flag} {id} -j ISTIO_IN_REDIRECT",
                cfg.tunnel_port
            ));
            if !no_lo_return {
                r.push(format!(
                    "-A ISTIO_OUTPUT -o lo -m owner ! {flag} {id} -j RETURN"
                ));
            }
            r.push(format!("-A ISTIO_OUTPUT -m owner {flag} {id} -j RETURN"));
        }
    }
    r.push(format!("-A ISTIO_OUTPUT -d {host_loopback} -j RETURN"));
    for net in cfg.exclude_outbound_cidrs.iter().filter(|n| family.owns(n)) {
        r.push(format!("-A ISTIO_OUTPUT -d {net} -j RETURN"));
    }
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
    r
}

/// Input for `iptables-restore --noflush` (or `ip6tables-restore`).
#[must_use]
pub fn restore_input(cfg: &CaptureConfig, family: Family) -> String {
    let mut out = String::from("* nat\n");
    for line in nat_rules(cfg, family) {
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    out
}

#[cfg(test)]
#[path = "rules_tests.rs"]
mod tests;
