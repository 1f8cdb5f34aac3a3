//! The two address families a pod's rules come in (`iptables` and `ip6tables`, nftables' `ip`
//! and `ip6` matches).

use std::net::IpAddr;

use ipnet::IpNet;

use crate::config::DnsCapture;

/// Which of the two rule sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    #[must_use]
    pub fn owns(self, net: &IpNet) -> bool {
        matches!(
            (self, net),
            (Self::V4, IpNet::V4(_)) | (Self::V6, IpNet::V6(_))
        )
    }

    /// The family's nameservers, as host prefixes.
    #[must_use]
    pub fn nameservers(self, dns: &DnsCapture) -> Vec<IpNet> {
        dns.nameservers
            .iter()
            .map(|a: &IpAddr| IpNet::from(*a))
            .filter(|n| self.owns(n))
            .collect()
    }
}
