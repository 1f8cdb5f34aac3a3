//! What the decision answers: the rule of Istio's iptables path that decided a connection, and
//! the verdict that follows from it. The kernel programs act on the verdict; `capture explain`
//! names the rule and `capture trace` carries its number, so both speak of why, not only where.

/// Why a connection goes where it asked to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// `excludeOutboundPorts` (ranks above everything, parity-spec.md E.7).
    ExcludedPort,
    /// Source `127.0.0.6`/`::6` towards a local address (B8).
    InboundPassthroughSource,
    /// The proxy's own connection (uid or gid).
    Owner,
    /// Stays inside the pod: a non-proxy socket to a local address (B10), or the host loopback CIDR (B15).
    Local,
    /// `excludeOutboundIPRanges`.
    ExcludedCidr,
    /// No include rule (ports or CIDRs) matched.
    NotIncluded,
    /// IPv6 in a pod without an IPv6 address: Istio writes no ip6tables rules for such a pod.
    FamilyNotCaptured,
    /// The socket's primary group is not captured (`ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]`).
    OwnerGroup,
    /// UDP that is not captured DNS: only TCP goes to the proxy.
    NotTcp,
}

/// What the decision does with a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Rewrite to the outbound listener (`ISTIO_REDIRECT`, 15001).
    Outbound,
    /// Rewrite to the inbound listener (`ISTIO_IN_REDIRECT` from the proxy, 15006).
    Inbound,
    /// Rewrite to the DNS proxy (`ISTIO_OUTPUT_DNS`, 15053), TCP and UDP.
    Dns,
    Pass(Pass),
}

/// Why an arriving connection keeps its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboundPass {
    /// `includeInboundPorts` is empty: no inbound capture at all.
    Disabled,
    /// The HBONE tunnel port (15008) is never captured in REDIRECT mode (B1).
    Tunnel,
    /// `excludeInboundPorts` (with `includeInboundPorts == "*"`).
    ExcludedPort,
    /// Not in an explicit `includeInboundPorts` list.
    NotIncluded,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboundVerdict {
    /// Steer to the inbound listener (`ISTIO_IN_REDIRECT`, 15006).
    Capture,
    Pass(InboundPass),
}

/// The rule that decided an outbound connection, in the order the procedure tries them (spec
/// section C, `outbound`; the B numbers are the iptables rules of parity-spec.md section B).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutboundRule {
    /// IPv6 in a pod without an IPv6 address: no ip6tables rules at all.
    FamilyNotCaptured = 1,
    /// `excludeOutboundPorts` (ranks above everything, parity-spec.md E.7).
    ExcludedPort,
    /// Source `127.0.0.6`/`::6` over `lo` (B8).
    InboundPassthroughSource,
    /// A proxy uid's connection to a local address: to the inbound listener (B9).
    ProxyUidToLocal,
    /// A non-proxy uid's connection to a local address stays in the pod (B10).
    LocalNotProxyUid,
    /// The proxy uid's own connection (B11).
    ProxyUid,
    /// As [`Self::ProxyUidToLocal`], by the proxy gid (B12).
    ProxyGidToLocal,
    /// As [`Self::LocalNotProxyUid`], by the proxy gid (B13).
    LocalNotProxyGid,
    /// As [`Self::ProxyUid`], by the proxy gid (B14).
    ProxyGid,
    /// The socket's primary group is not captured (`ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]`).
    OwnerGroup,
    /// DNS to a captured nameserver: to the DNS proxy (`ISTIO_OUTPUT_DNS`).
    Dns,
    /// UDP that is not captured DNS.
    NotTcp,
    /// The host loopback range (B15).
    HostLoopback,
    /// `excludeOutboundIPRanges`.
    ExcludedCidr,
    /// `includeOutboundPorts`.
    IncludedPort,
    /// `includeOutboundIPRanges: "*"`.
    AllOutbound,
    /// A listed `includeOutboundIPRanges` range.
    IncludedCidr,
    /// No include rule matched.
    NotIncluded,
}

impl OutboundRule {
    /// Every rule, in the procedure's order.
    pub const ALL: [Self; 18] = [
        Self::FamilyNotCaptured,
        Self::ExcludedPort,
        Self::InboundPassthroughSource,
        Self::ProxyUidToLocal,
        Self::LocalNotProxyUid,
        Self::ProxyUid,
        Self::ProxyGidToLocal,
        Self::LocalNotProxyGid,
        Self::ProxyGid,
        Self::OwnerGroup,
        Self::Dns,
        Self::NotTcp,
        Self::HostLoopback,
        Self::ExcludedCidr,
        Self::IncludedPort,
        Self::AllOutbound,
        Self::IncludedCidr,
        Self::NotIncluded,
    ];

    /// Did the socket's owner (the proxy's uid or gid) decide it? Under proxy identity by
    /// container, such a connection waits until the proxy container is known.
    #[inline(always)]
    #[must_use]
    pub const fn by_proxy_owner(self) -> bool {
        matches!(
            self,
            Self::ProxyUidToLocal | Self::ProxyUid | Self::ProxyGidToLocal | Self::ProxyGid
        )
    }

    /// A stable name for scripts and `trace`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::FamilyNotCaptured => "family-not-captured",
            Self::ExcludedPort => "exclude-outbound-port",
            Self::InboundPassthroughSource => "inbound-passthrough-source",
            Self::ProxyUidToLocal => "proxy-uid-to-local",
            Self::LocalNotProxyUid => "local-not-proxy-uid",
            Self::ProxyUid => "proxy-uid",
            Self::ProxyGidToLocal => "proxy-gid-to-local",
            Self::LocalNotProxyGid => "local-not-proxy-gid",
            Self::ProxyGid => "proxy-gid",
            Self::OwnerGroup => "owner-group-not-captured",
            Self::Dns => "dns",
            Self::NotTcp => "udp-not-dns",
            Self::HostLoopback => "host-loopback",
            Self::ExcludedCidr => "exclude-outbound-cidr",
            Self::IncludedPort => "include-outbound-port",
            Self::AllOutbound => "include-all-outbound",
            Self::IncludedCidr => "include-outbound-cidr",
            Self::NotIncluded => "not-included",
        }
    }

    #[inline(always)]
    #[must_use]
    pub const fn verdict(self) -> Verdict {
        match self {
            Self::ProxyUidToLocal | Self::ProxyGidToLocal => Verdict::Inbound,
            Self::Dns => Verdict::Dns,
            Self::IncludedPort | Self::AllOutbound | Self::IncludedCidr => Verdict::Outbound,
            Self::FamilyNotCaptured => Verdict::Pass(Pass::FamilyNotCaptured),
            Self::ExcludedPort => Verdict::Pass(Pass::ExcludedPort),
            Self::InboundPassthroughSource => Verdict::Pass(Pass::InboundPassthroughSource),
            Self::LocalNotProxyUid | Self::LocalNotProxyGid | Self::HostLoopback => {
                Verdict::Pass(Pass::Local)
            }
            Self::ProxyUid | Self::ProxyGid => Verdict::Pass(Pass::Owner),
            Self::OwnerGroup => Verdict::Pass(Pass::OwnerGroup),
            Self::NotTcp => Verdict::Pass(Pass::NotTcp),
            Self::ExcludedCidr => Verdict::Pass(Pass::ExcludedCidr),
            Self::NotIncluded => Verdict::Pass(Pass::NotIncluded),
        }
    }
}

/// The rule that decided an arriving connection (parity-spec.md section C, `inbound_redirect`).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboundRule {
    /// `includeInboundPorts` is empty.
    Disabled = 1,
    /// The HBONE tunnel port (B1).
    Tunnel,
    /// `excludeInboundPorts` under `includeInboundPorts: "*"`.
    ExcludedPort,
    /// `includeInboundPorts: "*"`.
    AllPorts,
    /// A port of an explicit `includeInboundPorts` list.
    IncludedPort,
    /// Not in the explicit list.
    NotIncluded,
}

impl InboundRule {
    /// Every rule, in the procedure's order.
    pub const ALL: [Self; 6] = [
        Self::Disabled,
        Self::Tunnel,
        Self::ExcludedPort,
        Self::AllPorts,
        Self::IncludedPort,
        Self::NotIncluded,
    ];

    /// A stable name for scripts and `trace`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Disabled => "inbound-disabled",
            Self::Tunnel => "inbound-tunnel-port",
            Self::ExcludedPort => "exclude-inbound-port",
            Self::AllPorts => "include-all-inbound",
            Self::IncludedPort => "include-inbound-port",
            Self::NotIncluded => "inbound-not-included",
        }
    }

    #[inline(always)]
    #[must_use]
    pub const fn verdict(self) -> InboundVerdict {
        match self {
            Self::AllPorts | Self::IncludedPort => InboundVerdict::Capture,
            Self::Disabled => InboundVerdict::Pass(InboundPass::Disabled),
            Self::Tunnel => InboundVerdict::Pass(InboundPass::Tunnel),
            Self::ExcludedPort => InboundVerdict::Pass(InboundPass::ExcludedPort),
            Self::NotIncluded => InboundVerdict::Pass(InboundPass::NotIncluded),
        }
    }
}
