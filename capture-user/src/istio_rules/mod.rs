//! Istio's own capture rules found in a pod's netns before capture attaches: istio-init's (or an
//! istio-cni's) `ISTIO_*` chains in the iptables nat and mangle tables, in either iptables
//! variant, or the native nftables tables of Istio's nftables mode (`inet istio-proxy-*`). A pod
//! migrating from istio-init to capture has them; capturing it again on top would send each
//! connection through two captures.
//!
//! `decide` says what becomes of them: a rule backend adopts rules exactly like its own; other
//! rules, and any under the ebpf backend, are refused, or removed when the operator asked for
//! that (`--take-over-istio-rules`).

mod same;

use std::{
    fmt,
    path::{Path, PathBuf},
    process::Command,
};

pub use same::identical;

use crate::{
    config::CaptureConfig,
    iptables::{flavour::Flavour, rules::Family},
    netns::{output_in, Netns},
    nf_tables,
    record::Mode,
};

#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    #[error("pod netns {netns} already holds Istio's capture rules ({found}){why}: capturing it again would send its connections through two captures; restart the pod without istio-init, or give --take-over-istio-rules to have capture replace them")]
    Found {
        netns: PathBuf,
        found: String,
        why: String,
    },
    #[error("looking for Istio's rules in pod netns {netns}: {reason}")]
    Unreadable { netns: PathBuf, reason: String },
}

/// Istio's rules in a pod's netns that are exactly what its rule backend writes, taken as the
/// pod's capture.
pub struct Adopted {
    /// The iptables variant that holds them (iptables backend).
    pub iptables: Option<Flavour>,
}

/// What becomes of Istio's own rules in the pod's netns before `mode` captures it with `cfg`:
/// nothing when there are none; adopted when they are exactly `mode`'s; else refused, or
/// removed when `take_over`.
pub fn decide(
    netns: &Path,
    cfg: &CaptureConfig,
    mode: Mode,
    take_over: bool,
) -> Result<Option<Adopted>, RulesError> {
    let unreadable = |reason: String| RulesError::Unreadable {
        netns: netns.into(),
        reason,
    };
    let found = find(netns).map_err(unreadable)?;
    if found.is_empty() {
        return Ok(None);
    }
    let Some(why) = identical(netns, cfg, mode, &found).map_err(unreadable)? else {
        tracing::info!(netns = %netns.display(), %found, "adopting Istio's rules, identical to capture's");
        return Ok(Some(Adopted {
            iptables: found.iptables_flavour(),
        }));
    };
    if !take_over {
        return Err(RulesError::Found {
            netns: netns.into(),
            found: found.to_string(),
            why: if mode == Mode::Ebpf {
                String::new()
            } else {
                format!(", which differ from capture's: {why}")
            },
        });
    }
    tracing::warn!(netns = %netns.display(), %found, "removing Istio's rules: --take-over-istio-rules");
    remove(netns, &found).map_err(unreadable)?;
    Ok(None)
}

/// The iptables tables Istio's chains live in.
const IPTABLES_TABLES: [&str; 3] = ["nat", "mangle", "raw"];

/// One iptables table's `ISTIO_*` chains, in one variant and family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptablesChains {
    pub flavour: Flavour,
    pub family: Family,
    pub table: &'static str,
    pub chains: Vec<String>,
}

/// What a pod's netns holds of Istio's rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Found {
    pub iptables: Vec<IptablesChains>,
    /// Native nftables tables of Istio's names.
    pub nftables: Vec<String>,
}

impl Found {
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.iptables.is_empty() && self.nftables.is_empty()
    }

    /// The one iptables variant holding them, if exactly one does.
    #[must_use]
    pub fn iptables_flavour(&self) -> Option<Flavour> {
        let first = self.iptables.first()?.flavour;
        self.iptables
            .iter()
            .all(|c| c.flavour == first)
            .then_some(first)
    }
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = self
            .iptables
            .iter()
            .map(|c| {
                let tool = c.flavour.tool(c.family, false);
                format!("{} in {tool} -t {}", c.chains.join(", "), c.table)
            })
            .collect();
        parts.extend(
            self.nftables
                .iter()
                .map(|t| format!("nftables table inet {t}")),
        );
        f.write_str(&parts.join("; "))
    }
}

/// Looks for Istio's rules in the netns. A variant or family whose tools are missing holds
/// nothing this node could have written.
pub fn find(netns: &Path) -> Result<Found, String> {
    let Tables { iptables, nftables } = tables(netns)?;
    let mut found = Found {
        nftables,
        ..Found::default()
    };
    for (flavour, family, table) in iptables {
        let saved = run(
            netns,
            Command::new(flavour.tool(family, false)).args(["-t", table]),
        );
        let Ok(saved) = saved else { continue };
        let chains: Vec<String> = saved
            .lines()
            .filter_map(|l| l.strip_prefix(':'))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| c.starts_with("ISTIO_"))
            .map(str::to_owned)
            .collect();
        if !chains.is_empty() {
            found.iptables.push(IptablesChains {
                flavour,
                family,
                table,
                chains,
            });
        }
    }
    Ok(found)
}

/// The (variant, family, table) triples that hold a table in the netns, and the netns's native
/// nftables tables of Istio's names: legacy ones from `/proc/net/ip{,6}_tables_names` (read
/// inside the netns: listing them with the legacy tools would load the modules), nft ones from
/// the kernel's list of nftables tables (asked in-process: no tool runs unless a table is there).
fn tables(netns: &Path) -> Result<Tables, String> {
    let ns = Netns::open(netns).map_err(|e| e.to_string())?;
    let legacy = ns
        .run_in(|| {
            [
                (Family::V4, "ip_tables_names"),
                (Family::V6, "ip6_tables_names"),
            ]
            .map(|(f, file)| {
                let names = std::fs::read_to_string(format!("/proc/thread-self/net/{file}"))
                    .unwrap_or_default();
                (f, names)
            })
        })
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (family, names) in legacy {
        for table in IPTABLES_TABLES {
            if names.lines().any(|n| n.trim() == table) {
                out.push((Flavour::Legacy, family, table));
            }
        }
    }
    let nft_tables = nf_tables::tables(&ns).map_err(|e| e.to_string())?;
    for (family, nft_family) in [(Family::V4, "ip"), (Family::V6, "ip6")] {
        for table in IPTABLES_TABLES {
            if nft_tables
                .iter()
                .any(|t| t.family == nft_family && t.name == table)
            {
                out.push((Flavour::Nft, family, table));
            }
        }
    }
    Ok(Tables {
        iptables: out,
        nftables: crate::nftables::apply::ours(nft_tables),
    })
}

/// Where Istio's rules could be: iptables tables by (variant, family, table), and the native
/// nftables tables of Istio's names.
struct Tables {
    iptables: Vec<(Flavour, Family, &'static str)>,
    nftables: Vec<String>,
}

fn run(netns: &Path, cmd: &mut Command) -> Result<String, String> {
    let out = output_in(netns, cmd, b"").map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Removes what `find` found: each iptables table is restored without its `ISTIO_*` chains and
/// the rules that jump to them (one `-restore` per table, which the kernel swaps in whole), and
/// the nftables tables are deleted.
pub fn remove(netns: &Path, found: &Found) -> Result<(), String> {
    for c in &found.iptables {
        let saved = run(
            netns,
            Command::new(c.flavour.tool(c.family, false)).args(["-t", c.table]),
        )?;
        let kept: String = saved
            .lines()
            .filter(|l| !is_istio_line(l))
            .map(|l| format!("{l}\n"))
            .collect();
        let out = output_in(
            netns,
            Command::new(c.flavour.tool(c.family, true)).args(["-T", c.table]),
            kept.as_bytes(),
        )
        .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "removing Istio's chains from {} -t {}: {}",
                c.flavour.tool(c.family, true),
                c.table,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    if !found.nftables.is_empty() {
        crate::nftables::apply::remove(netns).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// An `iptables-save` line of Istio's: a chain of its, a rule in one, or a jump to one.
fn is_istio_line(line: &str) -> bool {
    line.starts_with(":ISTIO_")
        || line.starts_with("-A ISTIO_")
        || line.split_whitespace().any(|w| w.starts_with("ISTIO_")) && line.starts_with("-A ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn istio_lines_are_its_chains_its_rules_and_jumps_to_them() {
        assert!(is_istio_line(":ISTIO_OUTPUT - [0:0]"));
        assert!(is_istio_line("-A ISTIO_OUTPUT -j RETURN"));
        assert!(is_istio_line("-A OUTPUT -p tcp -j ISTIO_OUTPUT"));
        assert!(!is_istio_line(":OUTPUT ACCEPT [0:0]"));
        assert!(!is_istio_line("-A OUTPUT -p tcp -j KUBE-SERVICES"));
        assert!(!is_istio_line("*nat"));
    }
}
