//! Writing and removing the rules inside a pod's netns with `iptables-restore`, started inside
//! that netns (`netns::output_in`) so that nothing but that netns is touched.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use super::flavour::Flavour;
use super::rules::{
    chains_of, mangle_rules, nat_chains, nat_rules, raw_rules, restore_input, Family, TPROXY_MARK,
    TPROXY_TABLE,
};
use crate::{
    config::{CaptureConfig, InterceptionMode},
    netns::output_in,
};

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error("running {tool} in netns {netns}: {reason}; install iptables (Debian: apt-get install iptables)")]
    Spawn {
        tool: &'static str,
        netns: PathBuf,
        reason: String,
    },
    #[error("{tool} in netns {netns} refused the rules: {stderr}")]
    Rejected {
        tool: &'static str,
        netns: PathBuf,
        stderr: String,
    },
}

/// The families a pod gets rules for: IPv4 always, IPv6 when it has an IPv6 address (as Istio).
#[must_use]
pub fn families(cfg: &CaptureConfig) -> Vec<Family> {
    let mut f = vec![Family::V4];
    if cfg.pod_ip6.is_some() {
        f.push(Family::V6);
    }
    f
}

/// Runs an iptables tool in the netns, feeding `input` on stdin; returns its stdout.
fn in_netns(
    netns: &Path,
    tool: &'static str,
    args: &[&str],
    input: &str,
) -> Result<String, IptablesError> {
    let out = run_in_netns(netns, tool, args, input)?;
    if !out.status.success() {
        return Err(rejected(
            netns,
            tool,
            String::from_utf8_lossy(&out.stderr).trim(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `ip ARGS` in the netns.
fn ip_in_netns(netns: &Path, args: &[&str]) -> Result<(), IptablesError> {
    let out = run_in_netns(netns, "ip", args, "")?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(rejected(
        netns,
        "ip",
        &format!("ip {}: {}", args.join(" "), stderr.trim()),
    ))
}

fn run_in_netns(
    netns: &Path,
    tool: &'static str,
    args: &[&str],
    input: &str,
) -> Result<Output, IptablesError> {
    output_in(netns, Command::new(tool).args(args), input.as_bytes()).map_err(|e| {
        IptablesError::Spawn {
            tool,
            netns: netns.into(),
            reason: e.to_string(),
        }
    })
}

fn rejected(netns: &Path, tool: &'static str, stderr: &str) -> IptablesError {
    IptablesError::Rejected {
        tool,
        netns: netns.into(),
        stderr: stderr.replace('\n', "; "),
    }
}

/// TPROXY's routing: packets marked 1337 are delivered locally (table 133), so that captured
/// inbound traffic reaches the transparent listener and replies to original-source connections
/// come back to the proxy.
pub fn tproxy_routing(netns: &Path, cfg: &CaptureConfig, add: bool) -> Result<(), IptablesError> {
    let (mark, table) = (TPROXY_MARK.to_string(), TPROXY_TABLE.to_string());
    for family in families(cfg) {
        let f = if family == Family::V4 { "-4" } else { "-6" };
        if add {
            ip_in_netns(
                netns,
                &[f, "rule", "add", "fwmark", &mark, "lookup", &table],
            )?;
            ip_in_netns(
                netns,
                &[
                    f, "route", "add", "local", "default", "dev", "lo", "table", &table,
                ],
            )?;
        } else {
            let _ = ip_in_netns(
                netns,
                &[f, "rule", "del", "fwmark", &mark, "lookup", &table],
            );
            let _ = ip_in_netns(netns, &[f, "route", "flush", "table", &table]);
        }
    }
    Ok(())
}

/// Writes the pod's rules (all families or none) with `flavour`'s tools.
pub fn apply(netns: &Path, cfg: &CaptureConfig, flavour: Flavour) -> Result<(), IptablesError> {
    apply_rules(netns, cfg, flavour)?;
    if cfg.interception_mode == InterceptionMode::Tproxy {
        if let Err(e) = tproxy_routing(netns, cfg, true) {
            let _ = tproxy_routing(netns, cfg, false);
            let _ = remove(netns, cfg, flavour);
            return Err(e);
        }
    }
    Ok(())
}

fn apply_rules(netns: &Path, cfg: &CaptureConfig, flavour: Flavour) -> Result<(), IptablesError> {
    let mut done = Vec::new();
    for family in families(cfg) {
        if let Err(e) = in_netns(
            netns,
            flavour.tool(family, true),
            &["--noflush"],
            &restore_input(cfg, family),
        ) {
            for f in done {
                let _ = remove_family(netns, cfg, f, flavour);
            }
            return Err(e);
        }
        done.push(family);
    }
    Ok(())
}

/// The lines that undo one table's rules: its jumps from the built-in chains deleted, then the
/// chains it created flushed and deleted.
fn undo(rules: &[String]) -> Vec<String> {
    let mut out: Vec<String> = rules
        .iter()
        .filter_map(|rule| {
            ["PREROUTING", "OUTPUT"].iter().find_map(|builtin| {
                let spec = rule
                    .strip_prefix(&format!("-A {builtin} "))
                    .or_else(|| rule.strip_prefix(&format!("-I {builtin} 1 ")))?;
                Some(format!("-D {builtin} {spec}"))
            })
        })
        .collect();
    let chains = chains_of(rules);
    out.extend(chains.iter().map(|c| format!("-F {c}")));
    out.extend(chains.iter().map(|c| format!("-X {c}")));
    out
}

/// The restore input that removes exactly what `apply` wrote for one family.
#[must_use]
pub fn removal_input(cfg: &CaptureConfig, family: Family) -> String {
    let mut out = String::new();
    for (name, lines) in [
        ("mangle", undo(&mangle_rules(cfg, family))),
        ("nat", undo(&nat_rules(cfg, family))),
        ("raw", undo(&raw_rules(cfg, family))),
    ] {
        if lines.is_empty() {
            continue;
        }
        out.push_str(&format!("* {name}\n"));
        for l in lines {
            out.push_str(&l);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// Removes one family's rules: exactly what the rules of `cfg` are, then whatever of capture's
/// the netns still lists (a pod captured by an earlier build, whose rules for the same settings
/// differed, holds rules or chains the first pass does not name).
fn remove_family(
    netns: &Path,
    cfg: &CaptureConfig,
    family: Family,
    flavour: Flavour,
) -> Result<(), IptablesError> {
    let tool = flavour.tool(family, true);
    // Where this fails (a rule of it is not there), the listing below removes what is.
    let _ = in_netns(netns, tool, &["--noflush"], &removal_input(cfg, family));
    let saved = in_netns(netns, flavour.tool(family, false), &[], "")?;
    let left = removal_of_listed(cfg, &saved);
    if left.is_empty() {
        return Ok(());
    }
    in_netns(netns, tool, &["--noflush"], &left).map(drop)
}

/// The restore input that removes, from the tables as `iptables-save` lists them, every rule of
/// a built-in chain that capture writes for `cfg` (jumps into Istio's chains, the interface and
/// open-connection RETURNs, TPROXY's marks, `--drop-invalid`'s DROP, in any build's form) and
/// every `ISTIO_*` chain. Empty when the tables hold none.
#[must_use]
pub fn removal_of_listed(cfg: &CaptureConfig, saved: &str) -> String {
    let mut out = String::new();
    let mut table = "";
    let mut lines: Vec<String> = Vec::new();
    let mut chains: Vec<&str> = Vec::new();
    let mut flush = |table: &str, lines: &mut Vec<String>, chains: &mut Vec<&str>| {
        lines.extend(chains.iter().map(|c| format!("-F {c}")));
        lines.extend(chains.iter().map(|c| format!("-X {c}")));
        if !lines.is_empty() {
            out.push_str(&format!("*{table}\n{}\nCOMMIT\n", lines.join("\n")));
        }
        lines.clear();
        chains.clear();
    };
    for line in saved.lines() {
        if let Some(name) = line.strip_prefix('*') {
            flush(table, &mut lines, &mut chains);
            table = name;
        } else if let Some(chain) = line.strip_prefix(':') {
            chains.extend(
                chain
                    .split_whitespace()
                    .next()
                    .filter(|c| c.starts_with("ISTIO_")),
            );
        } else if let Some((chain, spec)) = line.strip_prefix("-A ").and_then(|r| r.split_once(' '))
        {
            if matches!(chain, "PREROUTING" | "OUTPUT") && written_by_capture(cfg, table, spec) {
                lines.push(format!("-D {chain} {spec}"));
            }
        }
    }
    flush(table, &mut lines, &mut chains);
    out
}

/// Is this rule of a built-in chain, as listed, one that capture writes for `cfg`?
fn written_by_capture(cfg: &CaptureConfig, table: &str, spec: &str) -> bool {
    let words: Vec<&str> = spec.split_whitespace().collect();
    let by_interface = spec.ends_with("-j RETURN")
        && words.windows(2).any(|w| {
            matches!(w[0], "-i" | "-o")
                && cfg
                    .exclude_interfaces
                    .iter()
                    .chain(&cfg.reroute_virtual_interfaces)
                    .any(|nic| nic == w[1])
        });
    let mangle = table == "mangle";
    let tproxy_mark = cfg.interception_mode == InterceptionMode::Tproxy
        && ["0x539", "0x53a"].iter().any(|m| spec.contains(m));
    spec.contains("-j ISTIO_")
        || by_interface
        || spec.contains(super::rules::SPARE_COMMENT)
        || (mangle && tproxy_mark)
        || (mangle && cfg.drop_invalid && spec.contains("--ctstate INVALID -j DROP"))
}

/// Removes the pod's rules (and TPROXY's routing) with the tools that wrote them; every family is
/// attempted, the first error is returned.
pub fn remove(netns: &Path, cfg: &CaptureConfig, flavour: Flavour) -> Result<(), IptablesError> {
    if cfg.interception_mode == InterceptionMode::Tproxy {
        let _ = tproxy_routing(netns, cfg, false);
    }
    families(cfg)
        .into_iter()
        .map(|f| remove_family(netns, cfg, f, flavour))
        .fold(Ok(()), Result::and)
}

/// What is missing from the netns (empty when the rules are in force): each family's chains and
/// the jumps into them.
#[must_use]
pub fn missing(netns: &Path, cfg: &CaptureConfig, flavour: Flavour) -> Vec<String> {
    let mut missing = Vec::new();
    for family in families(cfg) {
        let saved = match in_netns(netns, flavour.tool(family, false), &["-t", "nat"], "") {
            Ok(s) => s,
            Err(e) => {
                missing.push(e.to_string());
                continue;
            }
        };
        for chain in nat_chains(cfg, family) {
            if !saved.lines().any(|l| l.starts_with(&format!(":{chain} "))) {
                missing.push(format!("{family:?} chain {chain}"));
            }
        }
        if !saved
            .lines()
            .any(|l| l.starts_with("-A OUTPUT") && l.ends_with("-j ISTIO_OUTPUT"))
        {
            missing.push(format!("{family:?} OUTPUT jump"));
        }
    }
    missing
}
