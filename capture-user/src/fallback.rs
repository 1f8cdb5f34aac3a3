//! What `--mode auto` falls back to, for the node when its kernel cannot run the programs and per
//! pod when a pod needs what the kernel lacks: `--fallback iptables|nftables|auto`.
//!
//! `auto` prefers what the node already uses, as Istio's own detection prefers the iptables
//! variant whose rules the node holds (`iptables/flavour.rs`): a node whose netns holds iptables
//! rules (kube-proxy's, the kubelet's) keeps iptables, one that holds native nftables tables and
//! no iptables rules (kube-proxy in nftables mode) gets nftables, and a node without the
//! iptables tools gets nftables.

use std::process::Command;

use serde::Serialize;

use crate::{
    iptables::flavour::{self, Flavour},
    record::Mode,
};

/// The agent's and the CLI's `--fallback`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FallbackChoice {
    Iptables,
    Nftables,
    /// What the node already uses; nftables where the iptables tools are absent.
    #[default]
    Auto,
}

/// What the node's own netns holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeRules {
    /// The iptables variant holding rules there, with how many (none: no iptables rules).
    pub iptables: Option<String>,
    /// Native nftables tables (not iptables-nft's own `filter`, `nat`, ...), as `family name`.
    pub nftables: Vec<String>,
}

/// The tables iptables-nft and ebtables-nft create: they are iptables rules, not native ones.
const XTABLES_NAMES: [&str; 6] = ["filter", "nat", "mangle", "raw", "security", "broute"];

impl NodeRules {
    /// Looks at this process's netns (the agent runs in the node's).
    #[must_use]
    pub fn of_this_netns(nft_usable: bool, variant: &flavour::NodeVariant) -> Self {
        let choice = variant.choice();
        let iptables = (choice.flavour != Flavour::Plain).then(|| choice.reason.clone());
        let nftables = if nft_usable {
            native_tables().unwrap_or_default()
        } else {
            Vec::new()
        };
        Self { iptables, nftables }
    }
}

fn native_tables() -> Option<Vec<String>> {
    let out = Command::new("nft")
        .args(["-j", "list", "tables"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let listing: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(
        listing
            .get("nftables")?
            .as_array()?
            .iter()
            .filter_map(|o| o.get("table"))
            .filter_map(|t| Some((t.get("family")?.as_str()?, t.get("name")?.as_str()?)))
            .filter(|(_, name)| !XTABLES_NAMES.contains(name))
            .map(|(family, name)| format!("{family} {name}"))
            .collect(),
    )
}

/// The backend a fallback goes to on a node whose iptables tools (`ipt`) and nft (`nft`) are or
/// are not installed, and why; or why there is none.
pub fn resolve(
    choice: FallbackChoice,
    ipt: bool,
    nft: bool,
    node: &NodeRules,
) -> Result<(Mode, String), String> {
    match choice {
        FallbackChoice::Iptables if ipt => Ok((Mode::Iptables, "--fallback iptables".into())),
        FallbackChoice::Iptables => Err(
            "--fallback iptables, but iptables-restore or ip6tables-restore is not installed: \
             install iptables, or give --fallback nftables"
                .into(),
        ),
        FallbackChoice::Nftables if nft => Ok((Mode::Nftables, "--fallback nftables".into())),
        FallbackChoice::Nftables => Err(
            "--fallback nftables, but nft is not installed: install nftables, or give \
             --fallback iptables"
                .into(),
        ),
        FallbackChoice::Auto => auto(ipt, nft, node),
    }
}

fn auto(ipt: bool, nft: bool, node: &NodeRules) -> Result<(Mode, String), String> {
    match (ipt, nft) {
        (true, true) => match (&node.iptables, node.nftables.is_empty()) {
            (None, false) => Ok((
                Mode::Nftables,
                format!(
                    "--fallback auto: the node holds native nftables tables ({}) and no iptables rules",
                    node.nftables.join(", ")
                ),
            )),
            (Some(rules), _) => Ok((Mode::Iptables, format!("--fallback auto: {rules}"))),
            (None, true) => Ok((
                Mode::Iptables,
                "--fallback auto: the node holds no rules of either kind; iptables".into(),
            )),
        },
        (true, false) => Ok((
            Mode::Iptables,
            "--fallback auto: nft is not installed".into(),
        )),
        (false, true) => Ok((
            Mode::Nftables,
            "--fallback auto: the iptables tools are not installed".into(),
        )),
        (false, false) => Err(
            "--fallback auto: neither the iptables tools nor nft is installed: install \
             iptables or nftables"
                .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(iptables: Option<&str>, nftables: &[&str]) -> NodeRules {
        NodeRules {
            iptables: iptables.map(str::to_owned),
            nftables: nftables.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn auto_keeps_what_the_node_uses() {
        let kube_nft = node(None, &["ip kube-proxy", "ip6 kube-proxy"]);
        let (mode, why) = auto(true, true, &kube_nft).unwrap();
        assert_eq!(mode, Mode::Nftables);
        assert!(why.contains("ip kube-proxy"), "{why}");
        let kube_ipt = node(
            Some("the node's netns holds 40 nft rules"),
            &["ip kube-proxy"],
        );
        assert_eq!(auto(true, true, &kube_ipt).unwrap().0, Mode::Iptables);
        assert_eq!(
            auto(true, true, &node(None, &[])).unwrap().0,
            Mode::Iptables
        );
    }

    #[test]
    fn auto_takes_the_tool_that_is_there_and_says_when_none_is() {
        assert_eq!(
            auto(false, true, &node(None, &[])).unwrap().0,
            Mode::Nftables
        );
        assert_eq!(
            auto(true, false, &node(None, &["inet x"])).unwrap().0,
            Mode::Iptables
        );
        let none = auto(false, false, &node(None, &[])).unwrap_err();
        assert!(none.contains("install iptables or nftables"), "{none}");
    }
}
