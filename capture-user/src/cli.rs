//! The `capture` command line: the contract users and tests script against.

use std::{net::IpAddr, path::PathBuf};

use clap::{Parser, Subcommand};

use crate::{
    config::{parse_annotation, parse_id_list, IdList, PodSpec},
    ops::{self, AttachRequest, NodeStatus},
    paths::{Paths, DEFAULT_BPFFS_DIR, DEFAULT_STATE_DIR},
    probe::ModeChoice,
    record::Mode,
};

#[derive(Debug, Parser)]
#[command(
    name = "capture",
    version,
    about = "eBPF traffic capture for service-mesh sidecars"
)]
pub struct Cli {
    /// bpffs directory for pinned programs, maps and per-pod links.
    #[arg(long, global = true, env = "CAPTURE_BPFFS", default_value = DEFAULT_BPFFS_DIR)]
    pub bpffs: PathBuf,
    /// Directory for pod records and the node lock.
    #[arg(long, global = true, env = "CAPTURE_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Capture a pod: attach the programs to its cgroup and configure it.
    Attach {
        /// The pod's network namespace (e.g. /var/run/netns/NAME or /proc/PID/ns/net).
        #[arg(long)]
        netns: PathBuf,
        /// The pod's cgroup v2 directory.
        #[arg(long)]
        cgroup: PathBuf,
        /// The pod's IP address; repeat for an IPv4 and an IPv6 address.
        #[arg(long = "pod-ip", required = true)]
        pod_ips: Vec<IpAddr>,
        /// A pod annotation, KEY=VALUE (Istio's traffic.sidecar.istio.io/* and friends); repeatable.
        #[arg(long = "annotation", value_parser = parse_annotation)]
        annotations: Vec<(String, String)>,
        /// The proxy's uid(s), comma-separated (default 1337).
        #[arg(long, value_parser = parse_id_list)]
        proxy_uid: Option<IdList>,
        /// The proxy's gid(s), comma-separated (default: the uids).
        #[arg(long, value_parser = parse_id_list)]
        proxy_gid: Option<IdList>,
        /// ebpf, iptables, or auto (ebpf where the kernel and the pod allow it, else iptables).
        #[arg(long, value_enum, default_value_t = ModeChoice::Ebpf)]
        mode: ModeChoice,
        #[command(flatten)]
        mesh: MeshArgs,
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
    Agent {
        /// The Unix socket the CNI plugin talks to (root-only); default: <state-dir>/agent.sock.
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Where /healthz, /readyz and /metrics are served (keep it on localhost).
        #[arg(long, default_value = "127.0.0.1:15300")]
        http: std::net::SocketAddr,
        /// ebpf, iptables, or auto (ebpf where the kernel supports every hook).
        #[arg(long, value_enum, default_value_t = ModeChoice::Auto)]
        mode: ModeChoice,
        /// The proxy's uid(s) for every pod this agent captures (default 1337).
        #[arg(long, value_parser = parse_id_list)]
        proxy_uid: Option<IdList>,
        /// The proxy's gid(s) (default: the uids).
        #[arg(long, value_parser = parse_id_list)]
        proxy_gid: Option<IdList>,
        /// As for attach. DNS capture through the agent captures every port-53 destination (the
        /// CNI path's default), unless nameservers are given.
        #[command(flatten)]
        mesh: MeshArgs,
    },
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
    /// Show captured pods, their configuration, whether capture is in force, and counters.
    Status {
        #[arg(long)]
        json: bool,
    },
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

/// What a command asks the process to exit with.
pub enum Outcome {
    Success,
    /// `capture validate` found capture not in force.
    NotCaptured(String),
}

/// Settings Istio takes from the mesh config and the proxy's environment, not from pod
/// annotations (a pod's `proxy.istio.io/config` still turns DNS capture on or off).
#[derive(Debug, Default, clap::Args)]
pub struct MeshArgs {
    /// Capture DNS (ISTIO_META_DNS_CAPTURE) for pods that do not say otherwise.
    #[arg(long)]
    pub redirect_dns: bool,
    /// With DNS capture, capture every port-53 destination, not only the nameservers.
    #[arg(long)]
    pub capture_all_dns: bool,
    /// A nameserver of the pod's resolv.conf whose DNS is captured; repeatable.
    #[arg(long = "dns-nameserver")]
    pub dns_nameservers: Vec<IpAddr>,
    /// ISTIO_OUTBOUND_OWNER_GROUPS: only sockets of these primary groups (gids or names) are
    /// captured; `*` (default) is every group.
    #[arg(long)]
    pub owner_groups: Option<String>,
    /// ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE: with `--owner-groups '*'`, groups never captured.
    #[arg(long)]
    pub owner_groups_exclude: Option<String>,
    /// ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR: the loopback range that is never captured
    /// (default 127.0.0.1/32).
    #[arg(long)]
    pub ipv4_loopback_cidr: Option<String>,
    /// INVALID_DROP: drop packets conntrack deems invalid (iptables backend).
    #[arg(long)]
    pub drop_invalid: bool,
}

impl MeshArgs {
    #[must_use]
    pub fn into_defaults(self) -> crate::config::MeshDefaults {
        crate::config::MeshDefaults {
            redirect_dns: self.redirect_dns,
            capture_all_dns: self.capture_all_dns,
            nameservers: self.dns_nameservers,
            owner_groups: self.owner_groups,
            owner_groups_exclude: self.owner_groups_exclude,
            ipv4_loopback_cidr: self.ipv4_loopback_cidr,
            drop_invalid: self.drop_invalid,
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

/// Runs one command; the binary prints the error chain on one line.
pub fn run(cli: Cli) -> anyhow::Result<Outcome> {
    let paths = Paths::new(&cli.bpffs, &cli.state_dir);
    match cli.command {
        Command::Attach {
            netns,
            cgroup,
            pod_ips,
            annotations,
            proxy_uid,
            proxy_gid,
            mode,
            mesh,
        } => {
            let (node_mode, allow_fallback) = match mode {
                ModeChoice::Ebpf => (Mode::Ebpf, false),
                ModeChoice::Iptables => (Mode::Iptables, false),
                ModeChoice::Auto => {
                    let (m, _why) = crate::probe::choose(mode, &crate::probe::probe())
                        .map_err(anyhow::Error::msg)?;
                    (m, true)
                }
            };
            let req = AttachRequest {
                netns,
                cgroup,
                spec: PodSpec {
                    pod_ips,
                    annotations: annotations.into_iter().collect(),
                    proxy_uids: proxy_uid.unwrap_or_default().0,
                    proxy_gids: proxy_gid.unwrap_or_default().0,
                    mesh: mesh.into_defaults(),
                },
                mode: node_mode,
                pod: None,
                allow_fallback,
            };
            let record = ops::attach(&paths, &req)?;
            println!(
                "captured netns {} (cookie {}) cgroup {} mode {}{}",
                record.netns.display(),
                record.netns_cookie,
                record.cgroup.display(),
                record.mode,
                record
                    .fallback_reason
                    .as_ref()
                    .map(|r| format!(" (fallback: {r})"))
                    .unwrap_or_default()
            );
        }
        Command::Detach { netns } => {
            let record = ops::detach(&paths, &netns)?;
            println!(
                "released netns {} (cookie {})",
                record.netns.display(),
                record.netns_cookie
            );
        }
        Command::Validate {
            timeout,
            outbound_port,
            inbound_port,
        } => {
            return Ok(
                match crate::validate::validate(outbound_port, inbound_port, timeout) {
                    Ok(v) => {
                        println!(
                        "capture is in force: the probe to {} arrived on {inbound_port} after {:.0?}",
                        v.original_dst, v.elapsed
                    );
                        Outcome::Success
                    }
                    Err(e @ crate::validate::ValidateError::NotCaptured { .. }) => {
                        Outcome::NotCaptured(e.to_string())
                    }
                    Err(e) => return Err(e.into()),
                },
            );
        }
        Command::Agent {
            socket,
            http,
            mode,
            proxy_uid,
            proxy_gid,
            mesh,
        } => {
            let mut mesh = mesh.into_defaults();
            mesh.capture_all_dns |= mesh.nameservers.is_empty();
            let socket = socket.unwrap_or_else(|| paths.state_dir.join("agent.sock"));
            crate::agent::run(crate::agent::AgentConfig {
                paths,
                socket,
                http,
                mode,
                proxy_uids: proxy_uid.unwrap_or_default().0,
                proxy_gids: proxy_gid.unwrap_or_default().0,
                mesh,
            })?;
        }
        Command::InstallCni {
            dirs,
            conf_file,
            plugin_binary,
            agent_socket,
        } => {
            let plugin_binary = match plugin_binary {
                Some(p) => p,
                None => std::env::current_exe()?.with_file_name("capture-cni"),
            };
            let opts = crate::install::InstallOptions {
                cni_bin_dir: dirs.cni_bin_dir,
                cni_conf_dir: dirs.cni_conf_dir,
                conf_file,
                plugin_binary,
                agent_socket: agent_socket.unwrap_or_else(|| paths.state_dir.join("agent.sock")),
            };
            let done = crate::install::install(&opts)?;
            println!(
                "capture-cni {} in {}; {} {}",
                if done.binary_changed {
                    "installed"
                } else {
                    "already installed"
                },
                opts.cni_bin_dir.display(),
                if done.config_changed {
                    "chained into"
                } else {
                    "already chained in"
                },
                done.config.display()
            );
        }
        Command::UninstallCni { dirs } => {
            let opts = crate::install::InstallOptions {
                cni_bin_dir: dirs.cni_bin_dir,
                cni_conf_dir: dirs.cni_conf_dir,
                conf_file: None,
                plugin_binary: PathBuf::new(),
                agent_socket: PathBuf::new(),
            };
            let changed = crate::install::uninstall(&opts)?;
            println!(
                "capture-cni removed from {} configuration(s) and {}",
                changed.len(),
                opts.cni_bin_dir.display()
            );
        }
        Command::Doctor { json } => {
            let probe = crate::probe::probe();
            if json {
                println!("{}", serde_json::to_string_pretty(&probe)?);
            } else {
                print!("{}", render_probe(&probe));
            }
        }
        Command::Status { json } => {
            let status = ops::status(&paths)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{}", render_status(&status));
            }
        }
    }
    Ok(Outcome::Success)
}

/// The human-readable probe report.
#[must_use]
pub fn render_probe(probe: &crate::probe::Probe) -> String {
    use std::fmt::Write as _;
    let mut out = format!("kernel {}\n", probe.kernel);
    for c in &probe.checks {
        let _ = writeln!(
            out,
            "  [{}] {:<34} {}",
            match (c.ok, c.optional) {
                (true, _) => " ok ",
                (false, true) => "miss",
                (false, false) => "FAIL",
            },
            c.name,
            c.detail
        );
    }
    if let Some(features) = probe.features {
        let _ = writeln!(
            out,
            "  [info] {:<34} {}",
            "sock_ops netns cookie",
            if features.sock_ops_netns_cookie {
                "yes"
            } else {
                "no (before Linux 5.15): a listener opened before capture attached is not \
                 registered, so inbound connections to it are refused"
            }
        );
    }
    let pick = crate::probe::choose(ModeChoice::Auto, probe);
    let _ = writeln!(
        out,
        "ebpf backend: {}; iptables backend: {}",
        if probe.ebpf_usable {
            "usable"
        } else {
            "NOT usable"
        },
        if probe.iptables_usable {
            "usable"
        } else {
            "NOT usable"
        }
    );
    let _ = match pick {
        Ok((mode, why)) => writeln!(out, "--mode auto would use {mode} ({why})"),
        Err(why) => writeln!(out, "--mode auto would fail: {why}"),
    };
    out
}

/// The human-readable status table.
#[must_use]
pub fn render_status(status: &NodeStatus) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node: programs {} (bpffs {}), {} pod(s), kernel errors {:?}",
        if status.programs_loaded {
            "loaded"
        } else {
            "not loaded"
        },
        status.bpffs.display(),
        status.pods.len(),
        status.node_errors
    );
    for pod in &status.pods {
        let r = &pod.record;
        let _ = writeln!(
            out,
            "pod netns {} cookie {} cgroup {} mode {}: {}",
            r.netns.display(),
            r.netns_cookie,
            r.cgroup.display(),
            match &r.fallback_reason {
                Some(why) => format!("{} (fallback: {why})", r.mode),
                None => r.mode.to_string(),
            },
            if pod.in_force {
                "capture in force".to_string()
            } else {
                format!("NOT IN FORCE, missing {}", pod.missing.join(", "))
            }
        );
        let ips: Vec<String> = r
            .config
            .pod_ip4
            .map(|a| a.to_string())
            .into_iter()
            .chain(r.config.pod_ip6.map(|a| a.to_string()))
            .collect();
        let _ = writeln!(
            out,
            "  ips {}  proxy uids {:?} gids {:?}  outbound -> {}  include {:?}  exclude cidrs {:?}  ports include {:?} exclude {:?}",
            ips.join(","),
            r.config.proxy_uids,
            r.config.proxy_gids,
            r.config.outbound_port,
            r.config.include_outbound_cidrs,
            r.config.exclude_outbound_cidrs,
            r.config.include_outbound_ports,
            r.config.exclude_outbound_ports
        );
        if let Some(c) = &pod.counters {
            let _ = writeln!(
                out,
                "  redirected outbound {} inbound {}  passed owner {} excluded {} local {}  errors {}",
                c.redirected_outbound, c.redirected_inbound, c.passed_owner, c.passed_excluded, c.passed_local, c.errors
            );
        }
    }
    out
}
