//! Which iptables variant writes a pod's rules (`nft`, `legacy`, or the unsuffixed names): each
//! pod's record keeps the one its rules were written with. The node's choice is
//! `capture-user/src/iptables/flavour.rs`'s.

use serde::{Deserialize, Serialize};

use crate::family::Family;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    /// The unsuffixed names (`iptables-restore`): what records from builds before the choice
    /// were written with.
    #[default]
    Plain,
    Nft,
    Legacy,
}

impl Flavour {
    /// The program for `family`: `iptables-nft-restore`, `ip6tables-legacy-save`, ...
    #[must_use]
    pub fn tool(self, family: Family, restore: bool) -> &'static str {
        use Family::{V4, V6};
        match (self, family, restore) {
            (Self::Plain, V4, true) => "iptables-restore",
            (Self::Plain, V4, false) => "iptables-save",
            (Self::Plain, V6, true) => "ip6tables-restore",
            (Self::Plain, V6, false) => "ip6tables-save",
            (Self::Nft, V4, true) => "iptables-nft-restore",
            (Self::Nft, V4, false) => "iptables-nft-save",
            (Self::Nft, V6, true) => "ip6tables-nft-restore",
            (Self::Nft, V6, false) => "ip6tables-nft-save",
            (Self::Legacy, V4, true) => "iptables-legacy-restore",
            (Self::Legacy, V4, false) => "iptables-legacy-save",
            (Self::Legacy, V6, true) => "ip6tables-legacy-restore",
            (Self::Legacy, V6, false) => "ip6tables-legacy-save",
        }
    }

    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Nft => "nft",
            Self::Legacy => "legacy",
        }
    }

    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "plain" => Some(Self::Plain),
            "nft" => Some(Self::Nft),
            "legacy" => Some(Self::Legacy),
            _ => None,
        }
    }
}
