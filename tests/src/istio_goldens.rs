//! Istio's expected rules (`tests/data/istio/`, from the golden files of Istio's own rule tests)
//! and the means to compare them with what capture writes: both applied with their tools and
//! listed by the same one, as what they mean (chains sorted, each chain's rules in order).

use std::{
    collections::BTreeMap,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use crate::guards::{in_netns, output_text, run};

/// Where Istio's expected rules are kept.
pub const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/istio");

/// Group names Istio's owner-group cases use, resolved (in a private mount namespace) by both
/// capture and Istio's tools.
pub const GROUPS: &str = "java:x:4242:\nftp:x:4343:\n";

/// A command that sees `GROUPS` as the group database: a mount namespace of its own with a file
/// bound over /etc/group, so that group names resolve alike for capture and Istio's tools
/// without touching the host's.
pub fn with_groups(mut cmd: Command, groups: &Path) -> Command {
    use nix::{
        mount::{mount, MsFlags},
        sched::{unshare, CloneFlags},
    };
    let groups = groups.to_path_buf();
    // SAFETY: between fork and exec the child makes system calls only.
    unsafe {
        cmd.pre_exec(move || {
            unshare(CloneFlags::CLONE_NEWNS)?;
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )?;
            mount(
                Some(&groups),
                "/etc/group",
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )?;
            Ok(())
        });
    }
    cmd
}

/// `iptables-save`'s output as what it means: per table, the user chains (sorted) and each
/// chain's rules in order. Tables with neither are left out (the save tools list a table's
/// built-in chains once anything touched it).
pub fn normalize_iptables(saved: &str) -> String {
    let mut tables: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut table = String::new();
    for line in saved.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.to_string();
        } else if let Some(chain) = line.strip_prefix(':') {
            let mut words = chain.split_whitespace();
            let (name, policy) = (words.next().unwrap_or_default(), words.next());
            if policy == Some("-") {
                tables
                    .entry(table.clone())
                    .or_default()
                    .entry(name.to_string())
                    .or_default();
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split_whitespace().next().unwrap_or_default();
            tables
                .entry(table.clone())
                .or_default()
                .entry(chain.to_string())
                .or_default()
                .push(line.to_string());
        }
    }
    let mut out = String::new();
    for (table, chains) in tables {
        out.push_str(&format!("*{table}\n"));
        for (chain, rules) in chains {
            out.push_str(&format!(":{chain}\n"));
            for rule in rules {
                out.push_str(&rule);
                out.push('\n');
            }
        }
    }
    out
}

/// `nft list ruleset` as what it means: per table, each chain (sorted) with its hook line and
/// its rules in order, counters without their numbers.
pub fn normalize_nft(listed: &str) -> String {
    let mut tables: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let (mut table, mut chain) = (String::new(), String::new());
    for line in listed.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("table ") {
            table = rest.trim_end_matches(" {").to_string();
            tables.entry(table.clone()).or_default();
        } else if let Some(rest) = line.strip_prefix("chain ") {
            chain = rest.trim_end_matches(" {").to_string();
            tables
                .entry(table.clone())
                .or_default()
                .entry(chain.clone())
                .or_default();
        } else if line == "}" || line.is_empty() {
        } else {
            let rule = strip_counter_values(line);
            tables
                .entry(table.clone())
                .or_default()
                .entry(chain.clone())
                .or_default()
                .push(rule);
        }
    }
    let mut out = String::new();
    for (table, chains) in tables {
        out.push_str(&format!("table {table}\n"));
        for (chain, rules) in chains {
            out.push_str(&format!("  chain {chain}\n"));
            for rule in rules {
                out.push_str(&format!("    {rule}\n"));
            }
        }
    }
    out
}

fn strip_counter_values(rule: &str) -> String {
    let words: Vec<&str> = rule.split(' ').collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        out.push(words[i]);
        if words[i] == "counter" && words.get(i + 1) == Some(&"packets") {
            i += 5;
        } else {
            i += 1;
        }
    }
    out.join(" ")
}

/// Istio's iptables-restore inputs of golden `golden` in `dir`, IPv4 and, where it has one, IPv6,
/// each with its tool.
pub fn iptables_inputs(dir: &str, golden: &str) -> Vec<(&'static str, PathBuf)> {
    let mut inputs = Vec::new();
    for (tool, family) in [("iptables-restore", "v4"), ("ip6tables-restore", "v6")] {
        let path = Path::new(DATA).join(dir).join(format!("{golden}.{family}"));
        if path.exists() {
            inputs.push((tool, path));
        }
    }
    inputs
}

/// Applies Istio's inputs in `netns` with their tools (and `groups` as the group database).
///
/// # Panics
/// An input does not apply.
pub fn apply(netns: &Path, inputs: &[(&str, PathBuf)], groups: &Path) {
    for (tool, input) in inputs {
        let mut cmd = with_groups(in_netns(netns, tool), groups);
        match *tool {
            "nft" => cmd.arg("-f").arg(input),
            _ => cmd.arg(input),
        };
        let out = cmd.output().expect("Istio's rules applied");
        assert!(
            out.status.success(),
            "Istio's input {} does not apply: {}",
            input.display(),
            output_text(&out)
        );
    }
}

/// What `netns` holds, as `iptables-save` and `ip6tables-save` list it, normalized.
#[must_use]
pub fn listed_iptables(netns: &Path, groups: &Path) -> String {
    ["iptables-save", "ip6tables-save"]
        .iter()
        .map(|tool| {
            let out = run(&mut with_groups(in_netns(netns, tool), groups));
            format!("# {tool}\n{}", normalize_iptables(&out))
        })
        .collect()
}

/// What `netns` holds, as `nft list ruleset` lists it, normalized.
#[must_use]
pub fn listed_nft(netns: &Path, groups: &Path) -> String {
    let mut nft = with_groups(in_netns(netns, "nft"), groups);
    normalize_nft(&run(nft.args(["list", "ruleset"])))
}
