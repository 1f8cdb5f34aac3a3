//! Which iptables writes a pod's rules: the node's own variant, nft or legacy, found as Istio
//! finds it. Both write into the pod's netns, but the kernel of a node may support one only (no
//! `nf_tables` on an old kernel, no `ip_tables` on a new distribution), and a node's tools and people
//! expect one: the variant whose rules the node already holds (kube-proxy's, the kubelet's
//! canaries) is the one that works there. Where neither holds rules, the unsuffixed names
//! decide (`iptables-restore` on the PATH: nft in the agent's image, the alternatives' choice on a
//! host).
//!
//! The agent decides once, at its start, in the node's netns (its own); `capture attach` decides
//! per run. `--iptables-variant nft|legacy|plain` (or `CAPTURE_IPTABLES`) decides instead. Each
//! pod's record keeps the variant its rules were written with, and they are removed with the same
//! one.

use std::{process::Command, sync::OnceLock};

use super::rules::Family;

/// The environment variable the binary reads `--iptables-variant` from when the flag is not
/// given.
pub const OVERRIDE_ENV: &str = "CAPTURE_IPTABLES";

pub use capture_model::flavour::Flavour;

/// The variant chosen for this node, and why, in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub flavour: Flavour,
    pub reason: String,
}

/// The node's variant as the binary was told it (`--iptables-variant`), decided at the first
/// use and kept: detection runs the variants' save tools in this process's netns, which a
/// command that writes no rules never needs.
#[derive(Debug, Default)]
pub struct NodeVariant {
    forced: Option<String>,
    choice: OnceLock<Choice>,
}

impl NodeVariant {
    /// `forced`: `nft`, `legacy` or `plain`; anything else (or nothing) is detected.
    #[must_use]
    pub fn new(forced: Option<String>) -> Self {
        Self {
            forced,
            choice: OnceLock::new(),
        }
    }

    /// The choice, made at the first call.
    pub fn choice(&self) -> &Choice {
        self.choice
            .get_or_init(|| choose(self.forced.as_deref(), &|flavour| rule_lines(flavour)))
    }
}

/// The choice, given an override and a way to count a variant's rules in the node's netns
/// (`None`: the variant cannot be run).
fn choose(forced: Option<&str>, rules: &dyn Fn(Flavour) -> Option<usize>) -> Choice {
    if let Some(forced) = forced.filter(|s| !s.is_empty()) {
        if let Some(flavour) = Flavour::parse(forced) {
            return Choice {
                flavour,
                reason: format!("{OVERRIDE_ENV}={forced}"),
            };
        }
        tracing::warn!(
            value = forced,
            "{OVERRIDE_ENV} is not nft, legacy or plain; detecting instead"
        );
    }
    // nft first, as Istio: a node whose kube-proxy runs in nft mode may also carry a few legacy
    // chains the kubelet writes to both.
    for flavour in [Flavour::Nft, Flavour::Legacy] {
        if let Some(lines) = rules(flavour).filter(|n| *n > 0) {
            return Choice {
                flavour,
                reason: format!("the node's netns holds {lines} {} rules", flavour.name()),
            };
        }
    }
    Choice {
        flavour: Flavour::Plain,
        reason: "the node's netns holds no nft or legacy rules: the unsuffixed iptables".into(),
    }
}

/// The rules (`-A` lines; a table the kernel made with its built-in chains alone is not a user of
/// the variant) `<variant>-save` prints in this process's netns, or `None` when it cannot run.
fn rule_lines(flavour: Flavour) -> Option<usize> {
    let out = Command::new(flavour.tool(Family::V4, false))
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("-A "))
            .count(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nft_rules_win_then_legacy_ones_then_the_plain_names() {
        let both = |f: Flavour| Some(if f == Flavour::Nft { 3 } else { 5 });
        assert_eq!(choose(None, &both).flavour, Flavour::Nft);
        let legacy = |f: Flavour| (f == Flavour::Legacy).then_some(7);
        let c = choose(None, &legacy);
        assert_eq!(c.flavour, Flavour::Legacy);
        assert!(c.reason.contains("7 legacy rules"), "{}", c.reason);
        let empty = |_: Flavour| Some(0);
        assert_eq!(choose(None, &empty).flavour, Flavour::Plain);
        let missing = |_: Flavour| None;
        assert_eq!(choose(None, &missing).flavour, Flavour::Plain);
    }

    #[test]
    fn the_override_decides_and_a_bad_one_is_ignored() {
        let legacy = |f: Flavour| (f == Flavour::Legacy).then_some(7);
        let c = choose(Some("nft"), &legacy);
        assert_eq!(c.flavour, Flavour::Nft);
        assert_eq!(c.reason, "CAPTURE_IPTABLES=nft");
        assert_eq!(choose(Some("iptables"), &legacy).flavour, Flavour::Legacy);
    }

    #[test]
    fn tools_are_named_as_debian_names_them() {
        assert_eq!(
            Flavour::Legacy.tool(Family::V6, true),
            "ip6tables-legacy-restore"
        );
        assert_eq!(Flavour::Plain.tool(Family::V4, false), "iptables-save");
        assert_eq!(Flavour::Nft.tool(Family::V4, true), "iptables-nft-restore");
    }
}
