//! Runs a parsed command: each subcommand calls into `ops`, the agent, the installer or the
//! probe, and prints what it found.

use std::path::{Path, PathBuf};

use capture_user::node::NodeChoices;

use super::{
    args::{AgentArgs, AttachArgs, Cli, CniDirs, Command, ExplainArgs, PodArgs},
    render::{render_explanation, render_status},
    render_doctor::render_probe,
};
use crate::{
    config::PodSpec,
    explain::Question,
    ops::{self, AttachRequest},
    paths::Paths,
    probe::ModeChoice,
    record::Mode,
};

/// What a command asks the process to exit with.
pub enum Outcome {
    Success,
    /// `capture validate` found capture not in force.
    NotCaptured(String),
    /// The command ran, and its answer is no (the message says why).
    Refused(String),
}

/// Runs one command; the binary prints the error chain on one line.
pub fn run(cli: Cli) -> anyhow::Result<Outcome> {
    let paths = Paths::new(&cli.bpffs, &cli.state_dir);
    let node = NodeChoices::new(cli.max_pods, cli.iptables_variant)?;
    match cli.command {
        Command::Attach(args) => attach(&paths, &node, args)?,
        Command::ProxyContainer {
            pod,
            cgroup,
            none,
            unknown: _,
        } => proxy_container(&paths, pod, cgroup, none)?,
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
        } => return validate(timeout, outbound_port, inbound_port),
        Command::Agent(args) => agent(paths, node, args)?,
        Command::InstallCni {
            dirs,
            conf_file,
            plugin_binary,
            agent_socket,
            replace_istio_cni,
        } => install_cni(
            &paths,
            dirs,
            conf_file,
            plugin_binary,
            agent_socket,
            replace_istio_cni,
        )?,
        Command::UninstallCni { dirs } => uninstall_cni(dirs)?,
        Command::Doctor { json } => doctor(&paths, &node, json)?,
        Command::Version { json } => {
            let info = crate::build_info::this();
            if json {
                println!("{}", serde_json::to_string_pretty(&info)?);
            } else {
                print!("{info}");
            }
        }
        Command::AccelCheck {
            json,
            allow,
            accepting,
        } => return accel_check(&paths, &node, json, allow, accepting),
        Command::AccelCases { destination } => {
            crate::accel::check::run_cases_here(destination)?;
        }
        Command::GenerateDocs { out } => {
            for path in super::docs::generate(&out)? {
                println!("{}", path.display());
            }
        }
        Command::Explain(args) => explain(&paths, args)?,
        Command::Trace {
            pod,
            json,
            duration,
            filter,
            rate,
        } => trace(&paths, pod, json, duration, filter, rate)?,
        Command::Sockets { pod, json } => {
            let report = crate::sockets::sockets(&paths, &pod.selector()?)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::sockets::render::render(&report));
            }
        }
        Command::Status {
            json,
            all,
            cri_socket,
            cni_conf_dir,
        } => status(&paths, json, all, &cri_socket, &cni_conf_dir)?,
    }
    Ok(Outcome::Success)
}

/// `capture attach`.
fn attach(paths: &Paths, node: &NodeChoices, args: AttachArgs) -> anyhow::Result<()> {
    let AttachArgs {
        netns,
        cgroup,
        pod_ips,
        annotations,
        proxy_uid,
        proxy_gid,
        mode,
        fallback,
        take_over_istio_rules,
        proxy_cgroup,
        defaults,
        annotation_policy,
        mesh,
    } = args;
    let (node_mode, fallback) = match mode {
        ModeChoice::Ebpf => (Mode::Ebpf, None),
        ModeChoice::Iptables => (Mode::Iptables, None),
        ModeChoice::Nftables => (Mode::Nftables, None),
        ModeChoice::Auto => {
            let probe = crate::probe::probe(&node.iptables);
            let (m, _why) =
                crate::probe::choose(mode, fallback, &probe).map_err(anyhow::Error::msg)?;
            let to = probe.pod_fallback(mode, m, fallback).ok().flatten();
            (m, to.map(|(to, _)| to))
        }
    };
    let (mesh, mesh_config) = mesh.into_parts();
    let annotations: std::collections::BTreeMap<String, String> = annotations.into_iter().collect();
    let (mesh_config, mesh_source) = match mesh_config {
        Some(path) => {
            let (mesh, source) = crate::config::mesh_config::read_for(
                &crate::config::mesh_config::MeshLayout::of(&path),
                &crate::config::Revision::of_pod(&annotations),
            )
            .map_err(anyhow::Error::msg)?;
            (Some(mesh), Some(source))
        }
        None => (None, None),
    };
    let req = AttachRequest {
        netns,
        cgroup,
        spec: PodSpec {
            pod_ips,
            annotations,
            proxy_uids: proxy_uid.unwrap_or_default().0,
            proxy_gids: proxy_gid.unwrap_or_default().0,
            mesh,
            mesh_config,
            mesh_source,
            proxy_container: None,
            defaults: defaults.into(),
        },
        mode: node_mode,
        pod: None,
        fallback,
        in_place: false,
        take_over_istio_rules,
        proxy_cgroup,
        policy: match annotation_policy {
            Some(path) => Some(crate::config::policy::read(&path)?),
            None => None,
        },
        labels: None,
    };
    let record = ops::attach(paths, node, &req)?;
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
    Ok(())
}

/// `capture proxy-container`.
fn proxy_container(
    paths: &Paths,
    pod: PodArgs,
    cgroup: Option<PathBuf>,
    none: bool,
) -> anyhow::Result<()> {
    let naming = match (cgroup, none) {
        (Some(path), _) => crate::identity::Naming::Cgroup {
            path,
            container_id: None,
        },
        (None, true) => crate::identity::Naming::None,
        (None, false) => crate::identity::Naming::Unknown,
    };
    let learned = crate::identity::set_proxy_container(paths, &pod.selector()?, naming)?;
    let proxy = learned
        .record
        .config
        .proxy_identity
        .as_ref()
        .map(|i| i.proxy.describe())
        .unwrap_or_default();
    println!(
        "netns {}: proxy container {proxy}{}",
        learned.record.netns.display(),
        if learned.changed { "" } else { " (unchanged)" }
    );
    Ok(())
}

/// `capture agent`: runs until it is stopped.
fn agent(paths: Paths, node: NodeChoices, args: AgentArgs) -> anyhow::Result<()> {
    let AgentArgs {
        socket,
        http,
        metrics,
        mode,
        fallback,
        proxy_uid,
        proxy_gid,
        mesh,
        watch_cni_config,
        accelerate,
        accelerate_accepting,
        take_over_istio_rules,
        cri_socket,
        repair,
        annotation_policy,
        reconcile_period,
        cni,
    } = args;
    let reconcile = (reconcile_period > 0).then(|| crate::agent::ReconcileConfig {
        cri_socket: cri_socket.clone(),
        repair,
        period: std::time::Duration::from_secs(reconcile_period),
        cni_conf_dir: cni.cni_conf_dir.clone(),
    });
    let (mut mesh, mesh_config) = mesh.into_parts();
    mesh.capture_all_dns |= mesh.nameservers.is_empty();
    let socket = socket.unwrap_or_else(|| paths.state_dir.join("agent.sock"));
    let cni_watch = watch_cni_config.then(|| crate::agent::CniWatch {
        conf_dir: cni.cni_conf_dir,
        bin_dir: cni.cni_bin_dir,
        agent_socket: socket.clone(),
        state_dir: paths.state_dir.clone(),
    });
    crate::agent::run(crate::agent::AgentConfig {
        paths,
        node: std::sync::Arc::new(node),
        socket,
        http,
        metrics,
        mode,
        fallback,
        proxy_uids: proxy_uid.unwrap_or_default().0,
        proxy_gids: proxy_gid.unwrap_or_default().0,
        mesh,
        mesh_config,
        annotation_policy,
        cri_socket,
        cni_watch,
        accelerate,
        accelerate_accepting,
        take_over_istio_rules,
        reconcile,
    })?;
    Ok(())
}

/// `capture install-cni`.
fn install_cni(
    paths: &Paths,
    dirs: CniDirs,
    conf_file: Option<PathBuf>,
    plugin_binary: Option<PathBuf>,
    agent_socket: Option<PathBuf>,
    replace_istio_cni: bool,
) -> anyhow::Result<()> {
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
        state_dir: Some(paths.state_dir.clone()),
        replace_istio_cni,
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
    if done.replaced_istio_cni {
        println!(
            "istio-cni's entry taken out of {} and kept in {}: `capture uninstall-cni` puts it back",
            done.config.display(),
            crate::install::istio::saved_path(done.config.parent().unwrap_or(&opts.cni_conf_dir)).display()
        );
    }
    Ok(())
}

/// `capture uninstall-cni`.
fn uninstall_cni(dirs: CniDirs) -> anyhow::Result<()> {
    let opts = crate::install::InstallOptions {
        cni_bin_dir: dirs.cni_bin_dir,
        cni_conf_dir: dirs.cni_conf_dir,
        conf_file: None,
        plugin_binary: PathBuf::new(),
        agent_socket: PathBuf::new(),
        state_dir: None,
        replace_istio_cni: false,
    };
    let changed = crate::install::uninstall(&opts)?;
    println!(
        "capture-cni removed from {} configuration(s) and {}",
        changed.len(),
        opts.cni_bin_dir.display()
    );
    Ok(())
}

/// `capture doctor`.
fn doctor(paths: &Paths, node: &NodeChoices, json: bool) -> anyhow::Result<()> {
    let probe = crate::probe::probe(&node.iptables);
    let builds = crate::ebpf::takeover::preview(paths, node.sizing);
    let foreign = crate::cgroup::cgroup2_mount()
        .map(|root| {
            let pods = crate::record::load_all(paths).unwrap_or_default();
            crate::ebpf::foreign::above_pods(&root, &pods)
        })
        .unwrap_or_default();
    let limits = crate::ebpf::limits::node_limits(paths, node.sizing);
    let acceleration = crate::accel::node_report(paths);
    let iptables = node.iptables.choice();
    let missing = capture_user::privileges::missing(
        &capture_user::capabilities::Capabilities::of_this_process(),
        true,
        true,
    );
    let privileges = capture_user::privileges::refusal(&missing);
    if json {
        let names: Vec<String> = missing.iter().map(|n| n.capability.name()).collect();
        let report = serde_json::json!({
            "capabilities": {"missing": names, "reason": privileges},
            "probe": probe,
            "iptables": {"variant": iptables.flavour, "reason": iptables.reason},
            "builds": builds,
            "limits": limits,
            "foreign_programs_above_pods": foreign,
            "acceleration": acceleration,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render_probe(&probe));
        match &privileges {
            None => println!("  [ ok ] {:<34} every one the agent needs", "capabilities"),
            Some(why) => println!("  [FAIL] {:<34} {why}", "capabilities"),
        }
        println!(
            "iptables backend: the {} variant ({})",
            iptables.flavour.name(),
            iptables.reason
        );
        print!("{}", crate::cli::render_doctor::render_builds(&builds));
        print!("{}", crate::cli::render_doctor::render_limits(&limits));
        print!("{}", crate::cli::render_doctor::render_foreign(&foreign));
        print!(
            "{}",
            crate::cli::render_doctor::render_acceleration(&acceleration)
        );
    }
    Ok(())
}

/// `capture accel-check`.
fn accel_check(
    paths: &Paths,
    node: &NodeChoices,
    json: bool,
    allow: bool,
    accepting: Vec<String>,
) -> anyhow::Result<Outcome> {
    let report = ops::accel_check(paths, node)?;
    if allow {
        let mut node = crate::accel::load(paths);
        node.allowed = true;
        node.accepted = accepting;
        crate::accel::save(paths, &node)?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", crate::cli::render_doctor::render_accel_check(&report));
    }
    let node = crate::accel::load(paths);
    let unaccepted = report.verdict().unaccepted(&node.accepted);
    if !unaccepted.is_empty() {
        return Ok(Outcome::Refused(format!(
            "accel-check: differences on this kernel: {}; pods are not accelerated",
            unaccepted.join(", ")
        )));
    }
    Ok(Outcome::Success)
}

/// `capture trace`: streams the pod's decisions to stdout, the summary to stderr.
fn trace(
    paths: &Paths,
    pod: PodArgs,
    json: bool,
    duration: Option<u64>,
    filter: crate::trace::event::Filter,
    rate: u32,
) -> anyhow::Result<()> {
    let request = crate::trace::TraceRequest {
        pod: pod.selector()?,
        json,
        duration: duration.map(std::time::Duration::from_secs),
        filter,
        rate,
    };
    let summary = crate::trace::run(paths, &request, &mut std::io::stdout().lock())?;
    if json {
        eprintln!("{}", serde_json::to_string(&summary)?);
    } else {
        eprintln!(
            "trace: {} decisions, {} shown, {} dropped by the rate limit or a full buffer",
            summary.events, summary.shown, summary.dropped
        );
    }
    Ok(())
}

/// `capture status`.
fn status(
    paths: &Paths,
    json: bool,
    all: bool,
    cri_socket: &Path,
    cni_conf_dir: &Path,
) -> anyhow::Result<()> {
    let mut status = ops::status(paths)?;
    if all {
        status.runtime = Some(crate::runtime::report_blocking(
            paths,
            cri_socket,
            cni_conf_dir,
        )?);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render_status(&status));
    }
    Ok(())
}

/// `capture explain`.
fn explain(paths: &Paths, args: ExplainArgs) -> anyhow::Result<()> {
    let ExplainArgs {
        pod,
        to,
        from,
        from_uid,
        from_gid,
        from_other_container,
        proto,
        direction,
        json,
    } = args;
    let question = Question {
        outside_proxy_container: from_other_container,
        pod: pod.selector()?,
        to,
        from,
        uid: from_uid,
        gid: from_gid.unwrap_or(from_uid),
        proto,
        direction,
    };
    let answer = crate::explain::explain(paths, &question)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else {
        print!("{}", render_explanation(&answer));
    }
    Ok(())
}

/// `capture validate`: what Istio's `istio-validation` init container does.
fn validate(
    timeout: std::time::Duration,
    outbound_port: u16,
    inbound_port: u16,
) -> anyhow::Result<Outcome> {
    match crate::validate::validate(outbound_port, inbound_port, timeout) {
        Ok(v) => {
            println!(
                "capture is in force: the probe to {} arrived on {inbound_port} after {:.0?}",
                v.original_dst, v.elapsed
            );
            Ok(Outcome::Success)
        }
        Err(e @ crate::validate::ValidateError::NotCaptured { .. }) => {
            Ok(Outcome::NotCaptured(e.to_string()))
        }
        Err(e) => Err(e.into()),
    }
}
