//! Pod annotations (Istio's) → one validated capture configuration (parity-spec.md section A).
//!
//! Defaults are those of an injected sidecar. Every bad value is an error that names the
//! annotation, the value and what would be accepted; nothing is silently dropped.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

mod inbound_ports;
pub mod mesh_config;
mod owner_groups;
pub mod policy;
mod proxy_config;
pub mod proxy_container;
pub mod proxy_identity;
pub mod revision;
pub mod settings;
pub mod values;

pub use self::{
    mesh_config::MeshConfig,
    proxy_container::ProxyContainerConfig,
    proxy_identity::{ContainerIdentity, IdentityDefaults, ProxyContainer, ProxyIdentityMode},
    revision::Revision,
    settings::Setting,
};

use self::{
    owner_groups::owner_groups,
    values::{
        bad, host_loopback_cidr, parse_cidr_selection, parse_cidrs, parse_interfaces, parse_port,
        parse_port_selection, parse_ports,
    },
};

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Serialize};

pub const ANN_INCLUDE_OUTBOUND_CIDRS: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
pub const ANN_EXCLUDE_OUTBOUND_CIDRS: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
pub const ANN_INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
pub const ANN_EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
pub const ANN_INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
pub const ANN_EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
pub const ANN_EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
pub const ANN_KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";
pub const ANN_REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";
pub const ANN_INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
pub const ANN_STATUS_PORT: &str = "status.sidecar.istio.io/port";
/// capture's own: `"true"` asks for the app-to-proxy acceleration (`sk_msg`). The node must allow
/// it too (the agent's `--accelerate`, and a kernel that passed the acceleration's checks).
pub const ANN_ACCELERATE: &str = "capture.dev/accelerate";
/// Proxy configuration merged over the mesh's `defaultConfig`; capture reads `interceptionMode`
/// and `proxyMetadata.ISTIO_META_DNS_CAPTURE` and `INVALID_DROP` from it.
pub const ANN_PROXY_CONFIG: &str = "proxy.istio.io/config";
pub const DNS_CAPTURE_METADATA: &str = mesh_config::DNS_CAPTURE;

pub const DEFAULT_PROXY_ID: u32 = 1337;
pub const OUTBOUND_PORT: u16 = 15001;
pub const INBOUND_PORT: u16 = 15006;
pub const TUNNEL_PORT: u16 = 15008;
/// The istio-agent's DNS proxy.
pub const DNS_PORT: u16 = 15053;
/// How many owner groups one pod may name (the kernel loop bound).
pub const MAX_OWNER_GROUPS: usize = capture_common::config::MAX_OWNER_GROUPS;
pub const DEFAULT_STATUS_PORT: u16 = 15020;
/// Ports the injector always excludes from inbound capture, before the annotation's.
pub const ALWAYS_EXCLUDED_INBOUND_PORTS: [u16; 2] = [15090, 15021];
/// How many proxy uids, and gids, one pod may name (the kernel loop bound).
pub const MAX_PROXY_IDS: usize = capture_common::config::MAX_PROXY_IDS;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("annotation {key}={value:?}: {reason}")]
    Annotation {
        key: String,
        value: String,
        reason: String,
    },
    #[error("annotation {key}={value:?} is not supported by capture yet: {reason}")]
    Unsupported {
        key: String,
        value: String,
        reason: String,
    },
    #[error("{0}")]
    Pod(String),
    #[error("owner groups {value:?}: {reason}")]
    OwnerGroups { value: String, reason: String },
    #[error("the mesh configuration's {0}")]
    Mesh(String),
    /// A setting of the pod's proxy container (its environment, its security context).
    #[error("the pod's proxy container: {0}")]
    ProxyContainer(String),
}

/// `*` or an explicit list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection<T> {
    All,
    List(Vec<T>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum InterceptionMode {
    Redirect,
    /// Inbound delivered by TPROXY with the original destination as local address; the proxy
    /// may run as uid 0 (its gid identifies it) and make original-source connections.
    Tproxy,
}

/// DNS capture (`--redirect-dns`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsCapture {
    /// Every port-53 destination (the CNI path's default), not only the nameservers.
    pub capture_all: bool,
    /// The pod's resolv.conf nameservers (used when not capturing all).
    pub nameservers: Vec<IpAddr>,
    /// The DNS proxy's port (15053).
    pub port: u16,
}

/// Whose traffic is captured, by the socket's primary group (`ISTIO_OUTBOUND_OWNER_GROUPS`,
/// `ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OwnerGroups {
    /// `*` and no exclusions: every group.
    All,
    /// Only these gids (an empty list captures nothing).
    Only(Vec<u32>),
    /// Every gid but these.
    AllBut(Vec<u32>),
}

/// Everything capture needs to know about one pod, validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureConfig {
    /// The pod's first address of each family (its primary interface's, as the network plugin
    /// lists it first).
    pub pod_ip4: Option<Ipv4Addr>,
    pub pod_ip6: Option<Ipv6Addr>,
    /// Its other addresses (a second network's, as Multus adds, or a second address of a
    /// family). Istio's rules name no pod address, so they capture all of them alike; the ebpf
    /// backend knows one address per family and leaves such pods to the fallback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_pod_ips: Vec<IpAddr>,
    pub proxy_uids: Vec<u32>,
    pub proxy_gids: Vec<u32>,
    pub interception_mode: InterceptionMode,
    pub outbound_port: u16,
    pub inbound_port: u16,
    pub tunnel_port: u16,
    pub include_outbound_cidrs: Selection<IpNet>,
    pub exclude_outbound_cidrs: Vec<IpNet>,
    pub include_outbound_ports: Vec<u16>,
    pub exclude_outbound_ports: Vec<u16>,
    pub include_inbound_ports: Selection<u16>,
    pub exclude_inbound_ports: Vec<u16>,
    /// Istio's `HostIPv4LoopbackCidr`.
    pub host_loopback_cidr: Ipv4Net,
    #[serde(default)]
    pub dns: Option<DnsCapture>,
    #[serde(default = "all_owner_groups")]
    pub owner_groups: OwnerGroups,
    /// `excludeInterfaces`: traffic through these interfaces is never captured, either way.
    #[serde(default)]
    pub exclude_interfaces: Vec<String>,
    /// `reroute-virtual-interfaces` (KubeVirt): traffic entering through these is treated as the
    /// pod's outbound traffic.
    #[serde(default)]
    pub reroute_virtual_interfaces: Vec<String>,
    /// `--drop-invalid` (`INVALID_DROP`): conntrack-invalid packets are dropped.
    #[serde(default)]
    pub drop_invalid: bool,
    /// The proxy's ids (and the owner groups) as the host sees them, for a pod with a user
    /// namespace of its own; absent for every other pod (see userns.rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ids: Option<HostIds>,
    /// The app-to-proxy acceleration is on for the pod: it asked (`ANN_ACCELERATE`) and, when
    /// attached, its node allowed it (see `ops::attach`).
    #[serde(default)]
    pub accelerate: bool,
    /// Connections the pod had open when it was captured keep the path they were opened on: set
    /// when the reconcile captures a running pod in place (`AttachRequest::in_place`). Only the
    /// iptables backend needs it: its NAT takes the next packet of such a connection for the
    /// first of a new one and redirects it (a reset); the kernel programs decide at connect.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub spare_open_connections: bool,
    /// The pod's netns routes `100::/64` to `lo`, which the IPv6 stateless redirect sends
    /// connections to: set when the ebpf backend's attach added the route (see `ops::attach`).
    /// A pod attached by a build before it has no route, and its IPv6 connections keep the
    /// stateful path.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stateless_redirect6: bool,
    /// Proxy identity by container; absent: Istio's, by the owner's uid or gid alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_identity: Option<ContainerIdentity>,
}

pub use capture_sys::userns::HostIds;

fn all_owner_groups() -> OwnerGroups {
    OwnerGroups::All
}

/// Node-wide capture settings that Istio takes from the mesh config or the proxy's environment
/// rather than from pod annotations; a pod's `proxy.istio.io/config` can override DNS capture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshDefaults {
    /// `ISTIO_META_DNS_CAPTURE` for pods that do not set it.
    pub redirect_dns: bool,
    pub capture_all_dns: bool,
    pub nameservers: Vec<IpAddr>,
    /// `ISTIO_OUTBOUND_OWNER_GROUPS` (default `*`).
    pub owner_groups: Option<String>,
    /// `ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE`.
    pub owner_groups_exclude: Option<String>,
    /// `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR` (default 127.0.0.1/32).
    pub ipv4_loopback_cidr: Option<String>,
    /// `INVALID_DROP`.
    pub drop_invalid: bool,
    /// Proxy identity for pods that do not name theirs (`capture.dev/proxy-identity`), and the
    /// proxy container's name.
    pub proxy_identity: IdentityDefaults,
}

/// Whose defaults fill in what a pod's annotations leave out: Istio's two capture paths differ
/// (parity-spec.md section A, E.21).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Defaults {
    /// istio-init's, as the sidecar injector passes them: inbound excludes 15090, 15021, the
    /// annotation's ports, then the status port; no outbound port excluded. The CLI's.
    #[default]
    IstioInit,
    /// Istio CNI's: inbound excludes are the annotation's ports followed by 15020, 15021 and
    /// 15090; outbound 15020 is excluded unless the pod names its own outbound exclusions. The
    /// CNI path's.
    IstioCni,
    /// `istio-iptables`' own, for its flags given by hand: nothing is excluded that the
    /// annotations do not name, and only what `includeInboundPorts` and
    /// `includeOutboundIPRanges` (or `includeOutboundPorts`) name is captured (its `-b` and `-i`
    /// default to none). What Istio's rule tests configure
    /// (`tools/istio-iptables/pkg/capture/run_test.go`).
    IstioIptables,
}

/// The status port Istio CNI excludes from outbound capture when a pod names no outbound
/// exclusions, and the inbound ports it always excludes, in its order.
pub const CNI_DEFAULT_OUTBOUND_EXCLUDED_PORT: u16 = 15020;
pub const CNI_ALWAYS_EXCLUDED_INBOUND_PORTS: [u16; 3] = [15020, 15021, 15090];

/// What the caller knows about a pod before validation.
#[derive(Clone, Debug, Default)]
pub struct PodSpec {
    pub pod_ips: Vec<IpAddr>,
    pub annotations: BTreeMap<String, String>,
    /// Empty means the default, 1337.
    pub proxy_uids: Vec<u32>,
    /// Empty means "the same as the uids", as with `istio-iptables -g`.
    pub proxy_gids: Vec<u32>,
    pub mesh: MeshDefaults,
    /// Istio's mesh configuration, where the agent reads one (`--mesh-config`).
    pub mesh_config: Option<MeshConfig>,
    /// Where it came from (the ConfigMap of the pod's revision), for `capture status`.
    pub mesh_source: Option<String>,
    /// The pod's proxy container as the runtime created it, once it exists: istio-cni's source
    /// of the pod's settings.
    pub proxy_container: Option<ProxyContainerConfig>,
    pub defaults: Defaults,
}

impl PodSpec {
    /// A pod known by its addresses and annotations alone, everything else at its default (the
    /// injector's defaults, uid and gid 1337, no mesh file, no proxy container): what the tests
    /// and `capture attach` without flags start from.
    ///
    /// # Panics
    /// An address that is not one: the callers write them as literals.
    #[must_use]
    pub fn of_annotations(pod_ips: &[&str], annotations: &[(&str, &str)]) -> Self {
        Self {
            pod_ips: pod_ips
                .iter()
                .map(|ip| ip.parse().unwrap_or_else(|e| panic!("pod IP {ip:?}: {e}")))
                .collect(),
            annotations: annotations
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            ..Self::default()
        }
    }
}

/// A pod's first IPv4 and first IPv6 address, and the others, each once.
#[expect(
    clippy::type_complexity,
    reason = "the three parts of one pod's addresses, named at the call"
)]
fn pod_addresses(
    pod_ips: &[IpAddr],
) -> Result<(Option<Ipv4Addr>, Option<Ipv6Addr>, Vec<IpAddr>), ConfigError> {
    let (mut pod_ip4, mut pod_ip6, mut other_pod_ips) = (None, None, Vec::new());
    for ip in pod_ips {
        match ip {
            IpAddr::V4(a) if pod_ip4.is_none() => pod_ip4 = Some(*a),
            IpAddr::V6(a) if pod_ip6.is_none() => pod_ip6 = Some(*a),
            _ if other_pod_ips.contains(ip)
                || [pod_ip4.map(IpAddr::V4), pod_ip6.map(IpAddr::V6)].contains(&Some(*ip)) => {}
            _ => other_pod_ips.push(*ip),
        }
    }
    if pod_ip4.is_none() && pod_ip6.is_none() {
        return Err(ConfigError::Pod("no pod IP given; pass --pod-ip".into()));
    }
    Ok((pod_ip4, pod_ip6, other_pod_ips))
}

impl CaptureConfig {
    /// Validates a pod's annotations and addresses into its capture configuration.
    pub fn from_pod(spec: &PodSpec) -> Result<Self, ConfigError> {
        Self::from_pod_with_settings(spec).map(|(config, _)| config)
    }

    /// As [`Self::from_pod`], with the settings more than one place decides and where each came
    /// from (see `settings`).
    pub fn from_pod_with_settings(spec: &PodSpec) -> Result<(Self, Vec<Setting>), ConfigError> {
        let ann = |key: &str| spec.annotations.get(key).map(String::as_str);

        let exclude_interfaces = ann(ANN_EXCLUDE_INTERFACES).map_or(Ok(Vec::new()), |v| {
            parse_interfaces(ANN_EXCLUDE_INTERFACES, v)
        })?;
        // The newer annotation wins over the deprecated one.
        let reroute_virtual_interfaces = match (
            ann(ANN_REROUTE_VIRTUAL_INTERFACES),
            ann(ANN_KUBEVIRT_INTERFACES),
        ) {
            (Some(v), _) => parse_interfaces(ANN_REROUTE_VIRTUAL_INTERFACES, v)?,
            (None, Some(v)) => parse_interfaces(ANN_KUBEVIRT_INTERFACES, v)?,
            (None, None) => Vec::new(),
        };
        // Errors name the value as given, untrimmed, as every other annotation's do.
        let settings::Resolved {
            interception_mode,
            dns,
            drop_invalid,
            ids,
            settings,
        } = settings::resolve_pod(spec)?;

        let accelerate = match ann(ANN_ACCELERATE) {
            None => false,
            Some(v) => match v.trim() {
                "true" => true,
                "false" => false,
                _ => return Err(bad(ANN_ACCELERATE, v, "must be true or false")),
            },
        };

        let identity_mode = proxy_identity::mode_of(
            ann(proxy_identity::ANN_PROXY_IDENTITY),
            &spec.mesh.proxy_identity,
        )?;
        let proxy_identity = proxy_identity::container_identity(
            identity_mode,
            ann(proxy_identity::ANN_SIDECAR_STATUS),
            &spec.mesh.proxy_identity,
        )?;

        let (pod_ip4, pod_ip6, other_pod_ips) = pod_addresses(&spec.pod_ips)?;

        let (proxy_uids, proxy_gids) = (ids.uids, ids.gids);
        for (what, ids) in [("uids", &proxy_uids), ("gids", &proxy_gids)] {
            if ids.len() > MAX_PROXY_IDS {
                return Err(ConfigError::Pod(format!(
                    "{} proxy {what} given; capture supports at most {MAX_PROXY_IDS}",
                    ids.len()
                )));
            }
        }

        let include_outbound_cidrs = match (ann(ANN_INCLUDE_OUTBOUND_CIDRS), spec.defaults) {
            (None, Defaults::IstioIptables) => Selection::List(Vec::new()),
            (None, _) => Selection::All,
            (Some(v), _) => parse_cidr_selection(ANN_INCLUDE_OUTBOUND_CIDRS, v)?,
        };
        let exclude_outbound_cidrs = ann(ANN_EXCLUDE_OUTBOUND_CIDRS)
            .map_or(Ok(Vec::new()), |v| {
                parse_cidrs(ANN_EXCLUDE_OUTBOUND_CIDRS, v)
            })?;
        let include_outbound_ports = ann(ANN_INCLUDE_OUTBOUND_PORTS)
            .map_or(Ok(Vec::new()), |v| {
                parse_ports(ANN_INCLUDE_OUTBOUND_PORTS, v)
            })?;
        let exclude_outbound_ports = match (ann(ANN_EXCLUDE_OUTBOUND_PORTS), spec.defaults) {
            (Some(v), _) => parse_ports(ANN_EXCLUDE_OUTBOUND_PORTS, v)?,
            (None, Defaults::IstioCni) => vec![CNI_DEFAULT_OUTBOUND_EXCLUDED_PORT],
            (None, Defaults::IstioInit | Defaults::IstioIptables) => Vec::new(),
        };
        let include_inbound_ports = inbound_ports::included(spec)?;
        let exclude_inbound_ports = inbound_ports::excluded(spec)?;

        let owner_groups = owner_groups(&spec.mesh)?;
        let host_loopback_cidr = host_loopback_cidr(spec.mesh.ipv4_loopback_cidr.as_deref())?;

        let config = Self {
            dns,
            owner_groups,
            pod_ip4,
            pod_ip6,
            other_pod_ips,
            proxy_uids,
            proxy_gids,
            interception_mode,
            outbound_port: OUTBOUND_PORT,
            inbound_port: INBOUND_PORT,
            tunnel_port: TUNNEL_PORT,
            include_outbound_cidrs,
            exclude_outbound_cidrs,
            include_outbound_ports,
            exclude_outbound_ports,
            include_inbound_ports,
            exclude_inbound_ports,
            host_loopback_cidr,
            exclude_interfaces,
            reroute_virtual_interfaces,
            drop_invalid,
            host_ids: None,
            accelerate,
            spare_open_connections: false,
            stateless_redirect6: false,
            proxy_identity,
        };
        Ok((config, settings))
    }

    /// The proxy's ids and the owner-group list's gids as the pod sees them: what a pod with a
    /// user namespace of its own has translated to the host's (`capture_sys::userns::host_ids`).
    #[must_use]
    pub fn pod_ids(&self) -> HostIds {
        let owner_groups = match &self.owner_groups {
            OwnerGroups::All => Vec::new(),
            OwnerGroups::Only(g) | OwnerGroups::AllBut(g) => g.clone(),
        };
        HostIds {
            proxy_uids: self.proxy_uids.clone(),
            proxy_gids: self.proxy_gids.clone(),
            owner_groups,
        }
    }

    /// Why the ebpf backend cannot capture this pod (the agent's `auto` mode then falls back to
    /// iptables for it), or `None`.
    #[must_use]
    pub fn ebpf_unsupported(&self) -> Option<EbpfUnsupported> {
        let (cause, reason) = if self.interception_mode == InterceptionMode::Tproxy {
            (
                FallbackCause::Tproxy,
                format!("{ANN_INTERCEPTION_MODE}=TPROXY: original-source connections from the proxy need TPROXY's marks and routing, which the ebpf backend does not implement"),
            )
        } else if !self.reroute_virtual_interfaces.is_empty() {
            (
                FallbackCause::VirtualInterfaces,
                format!(
                    "{ANN_REROUTE_VIRTUAL_INTERFACES} ({}): forwarded traffic from virtual interfaces is not captured by the ebpf backend",
                    self.reroute_virtual_interfaces.join(",")
                ),
            )
        } else if !self.exclude_interfaces.is_empty() {
            (
                FallbackCause::ExcludeInterfaces,
                format!(
                    "{ANN_EXCLUDE_INTERFACES} ({}): per-interface exclusion is not implemented by the ebpf backend",
                    self.exclude_interfaces.join(",")
                ),
            )
        } else if !self.other_pod_ips.is_empty() {
            let others: Vec<String> = self.other_pod_ips.iter().map(ToString::to_string).collect();
            (
                FallbackCause::SeveralAddresses,
                format!(
                    "the pod has more than one address of a family ({} besides its first): the ebpf backend captures one IPv4 and one IPv6 address per pod",
                    others.join(", ")
                ),
            )
        } else {
            return None;
        };
        Some(EbpfUnsupported { cause, reason })
    }

    /// Does an include CIDR start at a loopback address? Istio then drops its `-o lo` RETURN rules.
    #[must_use]
    pub fn include_covers_loopback(&self) -> bool {
        match &self.include_outbound_cidrs {
            Selection::All => false,
            Selection::List(cidrs) => cidrs.iter().any(|c| c.network().is_loopback()),
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod settings_tests;

/// Why a pod runs on iptables in a node whose mode is ebpf: one of a few fixed causes (a metric's
/// label), the words for people being in [`EbpfUnsupported::reason`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FallbackCause {
    /// `interceptionMode: TPROXY`.
    Tproxy,
    /// `rerouteVirtualInterfaces`.
    VirtualInterfaces,
    /// `excludeInterfaces`.
    ExcludeInterfaces,
    /// The kernel refused a hook the pod needs.
    KernelHook,
    /// The node's maps hold `--max-pods` pods already.
    NodeFull,
    /// The pod's cgroup is a cgroup v1 one.
    CgroupV1,
    /// The pod has more than one address of a family (a second network).
    SeveralAddresses,
}

impl FallbackCause {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tproxy => "tproxy",
            Self::VirtualInterfaces => "virtual_interfaces",
            Self::ExcludeInterfaces => "exclude_interfaces",
            Self::KernelHook => "kernel_hook",
            Self::NodeFull => "node_full",
            Self::CgroupV1 => "cgroup_v1",
            Self::SeveralAddresses => "several_addresses",
        }
    }
}

/// What [`CaptureConfig::ebpf_unsupported`] finds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EbpfUnsupported {
    pub cause: FallbackCause,
    pub reason: String,
}

impl EbpfUnsupported {
    /// Why a pod whose cgroup `path` is a v1 one cannot have the ebpf backend.
    #[must_use]
    pub fn cgroup_v1(path: &std::path::Path) -> Self {
        Self {
            cause: FallbackCause::CgroupV1,
            reason: format!(
                "its cgroup {} is on a cgroup v1 hierarchy, and the ebpf backend attaches to cgroup v2 \
                 only (boot the node with cgroup v2: systemd.unified_cgroup_hierarchy=1)",
                path.display()
            ),
        }
    }
}

impl std::fmt::Display for EbpfUnsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}
