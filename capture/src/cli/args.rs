//! The `capture` command line as clap reads it: the contract users and tests script against.

use std::{net::IpAddr, path::PathBuf};

use clap::{Parser, Subcommand};

use crate::{
    cli::values::{parse_annotation, parse_id_list, parse_listen_addr, parse_pod_name, IdList},
    config::ProxyIdentityMode,
    paths::{DEFAULT_BPFFS_DIR, DEFAULT_STATE_DIR},
    probe::{FallbackChoice, ModeChoice},
};

#[derive(Debug, Parser)]
#[command(
    name = "capture",
    version = env!("CAPTURE_VERSION"),
    about = "eBPF traffic capture for service-mesh sidecars"
)]
pub struct Cli {
    /// bpffs directory for pinned programs, maps and per-pod links.
    #[arg(long, global = true, env = "CAPTURE_BPFFS", default_value = DEFAULT_BPFFS_DIR)]
    pub bpffs: PathBuf,
    /// Directory for pod records and the node lock.
    #[arg(long, global = true, env = "CAPTURE_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// The pods the node's eBPF maps are sized for (default 256): give the kubelet's maxPods.
    /// Applied where the node's programs are loaded (the first attach, or the agent's start,
    /// which resizes a loaded node in place); a pod past it is refused (auto: iptables).
    #[arg(long, global = true, env = "CAPTURE_MAX_PODS")]
    pub max_pods: Option<u32>,
    /// The iptables variant that writes the iptables backend's rules: nft, legacy or plain (the
    /// unsuffixed names). Unset (or anything else), it is detected as Istio does: the variant
    /// whose rules the node's netns holds.
    #[arg(long, global = true, env = "CAPTURE_IPTABLES")]
    pub iptables_variant: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Capture a pod: attach the programs to its cgroup and configure it.
    Attach(AttachArgs),
    /// Name a captured pod's proxy container under proxy identity by container: the agent does
    /// this from the container runtime; nodes captured with the CLI alone do it themselves.
    ProxyContainer {
        #[command(flatten)]
        pod: PodArgs,
        /// The proxy container's cgroup v2 directory (below the pod's).
        #[arg(long, required_unless_present_any = ["none", "unknown"])]
        cgroup: Option<PathBuf>,
        /// The pod has no proxy container: every container is captured.
        #[arg(long, conflicts_with_all = ["cgroup", "unknown"])]
        none: bool,
        /// Forget it: the proxy's connections are refused until it is named again.
        #[arg(long, conflicts_with = "cgroup")]
        unknown: bool,
    },
    /// Stop capturing a pod and remove everything attach created for it.
    Detach {
        #[arg(long)]
        netns: PathBuf,
    },
    /// Prove, from inside a pod and as the proxy's uid, that capture is in force (like
    /// istio-validation). Exits 0 when it is, 126 with the reason when it is not.
    Validate {
        /// How long to keep probing.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        timeout: std::time::Duration,
        #[arg(long, default_value_t = crate::config::OUTBOUND_PORT)]
        outbound_port: u16,
        #[arg(long, default_value_t = crate::config::INBOUND_PORT)]
        inbound_port: u16,
    },
    /// Run the node agent: owns the kernel side, serves the CNI plugin, exposes health and metrics.
    Agent(AgentArgs),
    /// Copy capture-cni into the CNI bin directory and chain it last in the node's active network
    /// configuration (idempotent; other plugins, key order and indentation are kept).
    InstallCni {
        #[command(flatten)]
        dirs: CniDirs,
        /// Edit this configuration file instead of the active one (the first by name).
        #[arg(long)]
        conf_file: Option<PathBuf>,
        /// The plugin binary to install; default: capture-cni next to this binary.
        #[arg(long)]
        plugin_binary: Option<PathBuf>,
        /// The agent socket the plugin should use; default: <state-dir>/agent.sock.
        #[arg(long)]
        agent_socket: Option<PathBuf>,
        /// Where istio-cni is chained, take its place: its entry is kept in the configuration
        /// directory and `uninstall-cni` puts it back. Without this, install-cni refuses to
        /// chain beside it.
        #[arg(long)]
        replace_istio_cni: bool,
    },
    /// Take capture-cni out of every network configuration and remove its binary (idempotent).
    /// New pods then start uncaptured: run it only when removing capture from the node.
    UninstallCni {
        #[command(flatten)]
        dirs: CniDirs,
    },
    /// Probe this kernel and node for what capture needs, and say which mode `auto` would pick.
    Doctor {
        #[arg(long)]
        json: bool,
    },
    /// Say what capture does with one connection of a pod and why: the verdict, the rule that
    /// decides it (the same names `trace` prints), Istio's iptables rule for it, and, for an
    /// iptables pod, that rule in the pod's netns with its packet counter.
    Explain(ExplainArgs),
    /// Stream the decisions the kernel programs take for one pod, live: time, hook, process,
    /// owner, addresses, verdict and rule. Off until asked for, bounded by a rate limit, and over
    /// when this command ends (a lease the programs honour even if it is killed).
    Trace {
        #[command(flatten)]
        pod: PodArgs,
        /// One JSON object per decision.
        #[arg(long)]
        json: bool,
        /// Stop after this many seconds (default: until interrupted).
        #[arg(long)]
        duration: Option<u64>,
        /// Show only decisions matching every KEY=VALUE term (keys: rule, verdict, hook, proto,
        /// direction, dst, port, uid, pid, comm), e.g. "verdict=pass port=443".
        #[arg(long, default_value = "")]
        filter: crate::trace::event::Filter,
        /// Decisions per second the pod may emit; more are dropped and counted.
        #[arg(long, default_value_t = crate::trace::DEFAULT_RATE)]
        rate: u32,
    },
    /// List a pod's TCP connections: their addresses as the app sees them and as the kernel
    /// holds them (which `ss` shows), where each was going, whether it went through the proxy,
    /// and which hook decided it under which rule.
    Sockets {
        #[command(flatten)]
        pod: PodArgs,
        /// One JSON object (stable field names: `connections`, `listeners`, `notes`).
        #[arg(long)]
        json: bool,
    },
    /// What this binary is built from: its version (`<version>` for a release, else
    /// `<version>-dev.<commit>`), the commit, the kernel programs' build, the target and rustc.
    Version {
        /// One JSON object (`version`, `commit`, `programs`, `build`, `target`, `rustc`).
        #[arg(long)]
        json: bool,
    },
    /// Show captured pods, their configuration, whether capture is in force, and counters.
    Status {
        #[arg(long)]
        json: bool,
        /// Every pod sandbox of the node's container runtime too (over CRI): meshed or not,
        /// captured or not and by which backend, and why not; and records whose sandbox is gone.
        #[arg(long)]
        all: bool,
        /// The runtime's CRI socket (containerd's by default; CRI-O's is /var/run/crio/crio.sock).
        #[arg(long, default_value = crate::runtime::cri::CONTAINERD_SOCKET)]
        cri_socket: PathBuf,
        /// Where the node's CNI configuration is: the chained capture-cni entry's keys decide which
        /// pods are meshed, as at ADD.
        #[arg(long, default_value = "/etc/cni/net.d")]
        cni_conf_dir: PathBuf,
    },
    /// Run the acceleration's correctness checks on this node's kernel (a scratch pod, every
    /// case plain and accelerated, compared) and record the verdict the agent goes by.
    AccelCheck {
        #[arg(long)]
        json: bool,
        /// Also allow acceleration on this node, as the agent's --accelerate does (for nodes
        /// captured with `capture attach`, without the agent).
        #[arg(long)]
        allow: bool,
        /// With --allow: check cases whose differences this node accepts (comma-separated).
        #[arg(long, value_delimiter = ',', requires = "allow")]
        accepting: Vec<String>,
    },
    /// The checks' own cases, run inside their scratch pod (internal).
    #[command(hide = true)]
    AccelCases {
        #[arg(long)]
        destination: std::net::SocketAddr,
    },
    /// Write shell completions (bash, zsh, fish) and man pages for this command line into a
    /// directory (packaging; `cargo xtask completions` runs it).
    #[command(hide = true)]
    GenerateDocs {
        /// The directory: completions at its top, man pages in `man/`.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

/// `attach --defaults`: which of Istio's paths a pod's unset settings follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DefaultsChoice {
    Injector,
    Cni,
    IstioIptables,
}

impl From<DefaultsChoice> for crate::config::Defaults {
    fn from(choice: DefaultsChoice) -> Self {
        match choice {
            DefaultsChoice::Injector => Self::IstioInit,
            DefaultsChoice::Cni => Self::IstioCni,
            DefaultsChoice::IstioIptables => Self::IstioIptables,
        }
    }
}

/// `5s`, `500ms` or a plain number of seconds.
fn parse_duration(arg: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("{arg:?} is not a duration such as 5s or 500ms");
    if let Some(ms) = arg.strip_suffix("ms") {
        return ms
            .parse::<u64>()
            .map(std::time::Duration::from_millis)
            .map_err(|_| bad());
    }
    let secs = arg.strip_suffix('s').unwrap_or(arg);
    secs.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(std::time::Duration::from_secs_f64)
        .ok_or_else(bad)
}

/// Settings Istio takes from the mesh config and the proxy's environment, not from pod
/// annotations (a pod's `proxy.istio.io/config` still turns DNS capture on or off).
#[derive(Debug, Default, clap::Args)]
pub struct MeshArgs {
    /// Istio's mesh configurations: a directory with one file per control-plane revision, named
    /// as its ConfigMap (`istio`, `istio-<revision>`; the `mesh` key, or the whole ConfigMap),
    /// each pod reading its revision's; or one file for every pod. The defaultConfig's
    /// interception mode, `ISTIO_META_DNS_CAPTURE` and `INVALID_DROP` apply to pods that do not
    /// set their own, over the flags below, until the pod's proxy container says. The agent
    /// reads them again when they change, for the pods created afterwards.
    #[arg(long, value_name = "FILE|DIR")]
    pub mesh_config: Option<PathBuf>,
    /// Capture DNS (`ISTIO_META_DNS_CAPTURE`) for pods that do not say otherwise.
    #[arg(long)]
    pub redirect_dns: bool,
    /// With DNS capture, capture every port-53 destination, not only the nameservers.
    #[arg(long)]
    pub capture_all_dns: bool,
    /// A nameserver of the pod's resolv.conf whose DNS is captured; repeatable.
    #[arg(long = "dns-nameserver")]
    pub dns_nameservers: Vec<IpAddr>,
    /// `ISTIO_OUTBOUND_OWNER_GROUPS`: only sockets of these primary groups (gids or names) are
    /// captured; `*` (default) is every group.
    #[arg(long)]
    pub owner_groups: Option<String>,
    /// `ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE`: with `--owner-groups '*'`, groups never captured.
    #[arg(long)]
    pub owner_groups_exclude: Option<String>,
    /// `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR`: the loopback range that is never captured
    /// (default 127.0.0.1/32).
    #[arg(long)]
    pub ipv4_loopback_cidr: Option<String>,
    /// `INVALID_DROP`: drop packets conntrack deems invalid (iptables backend).
    #[arg(long)]
    pub drop_invalid: bool,
    /// How the proxy's own connections are told from the app's for pods that do not say
    /// (`capture.dev/proxy-identity`): `uid` is Istio's (the socket owner's uid or gid, in any
    /// container); `container` exempts them only from the proxy container's cgroup (ebpf
    /// backend only).
    #[arg(long, value_enum, default_value_t = ProxyIdentityMode::Uid)]
    pub proxy_identity: ProxyIdentityMode,
    /// The proxy container's name in the pod spec, for `--proxy-identity container`.
    #[arg(long, default_value = crate::config::proxy_identity::DEFAULT_PROXY_CONTAINER)]
    pub proxy_container: String,
}

impl MeshArgs {
    /// The flags' defaults, and the mesh configuration file, if one is given.
    #[must_use]
    pub fn into_parts(self) -> (crate::config::MeshDefaults, Option<PathBuf>) {
        let defaults = crate::config::MeshDefaults {
            redirect_dns: self.redirect_dns,
            capture_all_dns: self.capture_all_dns,
            nameservers: self.dns_nameservers,
            owner_groups: self.owner_groups,
            owner_groups_exclude: self.owner_groups_exclude,
            ipv4_loopback_cidr: self.ipv4_loopback_cidr,
            drop_invalid: self.drop_invalid,
            proxy_identity: crate::config::IdentityDefaults {
                mode: self.proxy_identity,
                container: self.proxy_container,
            },
        };
        (defaults, self.mesh_config)
    }
}

/// Which captured pod: by netns or by name.
#[derive(Debug, clap::Args)]
pub struct PodArgs {
    /// The pod's network namespace.
    #[arg(long, required_unless_present = "pod", conflicts_with = "pod")]
    pub netns: Option<PathBuf>,
    /// The pod as NAMESPACE/NAME (pods captured through the CNI plugin).
    #[arg(long, value_parser = parse_pod_name)]
    pub pod: Option<(String, String)>,
}

impl PodArgs {
    /// The selector; clap has made sure one of the two is given.
    ///
    /// # Errors
    /// Neither is (only when parsed other than by clap).
    pub fn selector(self) -> anyhow::Result<crate::record::PodSelector> {
        use crate::record::PodSelector;
        match (self.netns, self.pod) {
            (Some(netns), _) => Ok(PodSelector::Netns(netns)),
            (None, Some((namespace, name))) => Ok(PodSelector::Name { namespace, name }),
            (None, None) => anyhow::bail!("give --netns PATH or --pod NAMESPACE/NAME"),
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct CniDirs {
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    #[arg(long, default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
}

/// `capture attach`'s arguments.
#[derive(Debug, clap::Args)]
pub struct AttachArgs {
    /// The pod's network namespace (e.g. /var/run/netns/NAME or /proc/PID/ns/net).
    #[arg(long)]
    pub netns: PathBuf,
    /// The pod's cgroup directory: cgroup v2 (a cgroup v1 one only for the rule backends).
    #[arg(long)]
    pub cgroup: PathBuf,
    /// The pod's IP address; repeat for an IPv4 and an IPv6 address.
    #[arg(long = "pod-ip", required = true)]
    pub pod_ips: Vec<IpAddr>,
    /// A pod annotation, KEY=VALUE (Istio's traffic.sidecar.istio.io/* and friends); repeatable.
    #[arg(long = "annotation", value_parser = parse_annotation)]
    pub annotations: Vec<(String, String)>,
    /// The proxy's uid(s), comma-separated (default 1337).
    #[arg(long, value_parser = parse_id_list)]
    pub proxy_uid: Option<IdList>,
    /// The proxy's gid(s), comma-separated (default: the uids).
    #[arg(long, value_parser = parse_id_list)]
    pub proxy_gid: Option<IdList>,
    /// ebpf, iptables, nftables, or auto (ebpf where the kernel and the pod allow it, else
    /// the --fallback backend).
    #[arg(long, value_enum, default_value_t = ModeChoice::Ebpf)]
    pub mode: ModeChoice,
    /// What --mode auto falls back to: iptables, nftables, or auto (what the node already
    /// uses; nftables where the iptables tools are absent).
    #[arg(long, value_enum, default_value_t = FallbackChoice::Auto)]
    pub fallback: FallbackChoice,
    /// Where the pod's netns already holds Istio's own capture rules (istio-init's ISTIO_*
    /// chains, or Istio's nftables tables): remove them and capture the pod, rather than
    /// refuse it. Rules identical to what --mode iptables or nftables would write are
    /// adopted without this.
    #[arg(long)]
    pub take_over_istio_rules: bool,
    /// Under proxy identity by container: the proxy container's cgroup v2 directory (below
    /// the pod's). Without it, the pod's proxy-uid connections are refused until
    /// `capture proxy-container` names it.
    #[arg(long)]
    pub proxy_cgroup: Option<PathBuf>,
    /// Whose defaults fill in what the annotations leave out: the sidecar injector's as
    /// istio-init gets them (`injector`), istio-cni's as the agent applies them (`cni`), or
    /// istio-iptables' own flag defaults (`istio-iptables`: nothing excluded implicitly,
    /// inbound capture only for includeInboundPorts).
    #[arg(long, value_enum, default_value_t = DefaultsChoice::Injector)]
    pub defaults: DefaultsChoice,
    /// The node's policy for bypass annotations (YAML, see docs/using/proxy-identity.md); the
    /// pod's annotations must keep to it.
    #[arg(long, value_name = "FILE")]
    pub annotation_policy: Option<PathBuf>,
    #[command(flatten)]
    pub mesh: MeshArgs,
}

/// `capture agent`'s arguments.
#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// The Unix socket the CNI plugin talks to (root-only); default: <state-dir>/agent.sock.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Where /healthz, /readyz and /metrics are served (keep it on localhost).
    #[arg(long, default_value = "127.0.0.1:15300", value_parser = parse_listen_addr)]
    pub http: std::net::SocketAddr,
    /// Also serve /metrics alone here, for a Prometheus that scrapes the node's address (for
    /// example `$(NODE_IP):15301`); health stays on --http.
    #[arg(long, value_parser = parse_listen_addr)]
    pub metrics: Option<std::net::SocketAddr>,
    /// ebpf, iptables, nftables, or auto (ebpf where the kernel supports every hook, else the
    /// --fallback backend, also for each pod that needs what the kernel lacks).
    #[arg(long, value_enum, default_value_t = ModeChoice::Auto)]
    pub mode: ModeChoice,
    /// What --mode auto falls back to: iptables, nftables, or auto (what the node already
    /// uses; nftables where the iptables tools are absent).
    #[arg(long, value_enum, default_value_t = FallbackChoice::Auto)]
    pub fallback: FallbackChoice,
    /// The proxy's uid(s) for every pod this agent captures (default 1337).
    #[arg(long, value_parser = parse_id_list)]
    pub proxy_uid: Option<IdList>,
    /// The proxy's gid(s) (default: the uids).
    #[arg(long, value_parser = parse_id_list)]
    pub proxy_gid: Option<IdList>,
    /// As for attach. DNS capture through the agent captures every port-53 destination (the
    /// CNI path's default), unless nameservers are given.
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Keep capture-cni chained in the active CNI configuration: chain it again within a
    /// second when the network plugin rewrites or replaces its configuration (while
    /// capture-cni is installed in --cni-bin-dir; `uninstall-cni` takes it out for good).
    #[arg(long)]
    pub watch_cni_config: bool,
    /// Allow the app-to-proxy acceleration for pods that ask for it
    /// (capture.dev/accelerate: "true"), once this kernel has passed the acceleration's
    /// correctness checks, which the agent runs at start (once per kernel and build).
    #[arg(long)]
    pub accelerate: bool,
    /// With --accelerate: check cases whose differences this node accepts (comma-separated
    /// names, as `capture accel-check` prints them); a kernel that differs only in those is
    /// accelerated anyway.
    #[arg(long, value_delimiter = ',', requires = "accelerate")]
    pub accelerate_accepting: Vec<String>,
    /// A pod whose netns already holds Istio's own capture rules (istio-init's, in a cluster
    /// migrating from it) has them removed and replaced, rather than refused. Rules identical
    /// to what the pod's rule backend would write are adopted without this.
    #[arg(long)]
    pub take_over_istio_rules: bool,
    /// The container runtime's CRI socket, read at start and every --reconcile-period to find
    /// meshed pods capture never saw and records whose pod is gone (CRI-O's:
    /// /var/run/crio/crio.sock).
    #[arg(long, default_value = crate::runtime::cri::CONTAINERD_SOCKET)]
    pub cri_socket: PathBuf,
    /// What to do with a meshed pod found running uncaptured: capture it in place, restart
    /// its sandbox through the runtime (the kubelet recreates it through the CNI chain), or
    /// only report it.
    #[arg(long, value_enum, default_value_t = crate::runtime::Repair::Capture)]
    pub repair: crate::runtime::Repair,
    /// The node's policy for bypass annotations (YAML; the capture-annotation-policy
    /// ConfigMap): read before each ADD, so a change applies to new pods without a restart.
    #[arg(long, value_name = "FILE", env = "CAPTURE_ANNOTATION_POLICY")]
    pub annotation_policy: Option<PathBuf>,
    /// Seconds between reconcile passes; 0 turns the reconcile off.
    #[arg(long, default_value_t = 30, env = "CAPTURE_RECONCILE_PERIOD")]
    pub reconcile_period: u64,
    #[command(flatten)]
    pub cni: CniDirs,
}

/// `capture explain`'s arguments.
#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub pod: PodArgs,
    /// The destination: ADDR:PORT, or [ADDR]:PORT for IPv6 (for --direction inbound, the
    /// pod's address and port the connection arrives for).
    #[arg(long)]
    pub to: std::net::SocketAddr,
    /// The address the socket is bound to before it connects (127.0.0.6 is the proxy's
    /// inbound passthrough).
    #[arg(long)]
    pub from: Option<IpAddr>,
    /// The socket owner's uid, as the node sees it.
    #[arg(long, default_value_t = 0)]
    pub from_uid: u32,
    /// The socket owner's primary gid (default: the uid).
    #[arg(long)]
    pub from_gid: Option<u32>,
    /// The connecting process runs in another container than the pod's proxy container
    /// (pods under proxy identity by container exempt the proxy's ids only in it).
    #[arg(long)]
    pub from_other_container: bool,
    #[arg(long, value_enum, default_value = "tcp")]
    pub proto: crate::explain::Proto,
    #[arg(long, value_enum, default_value = "outbound")]
    pub direction: crate::explain::Direction,
    #[arg(long)]
    pub json: bool,
}
