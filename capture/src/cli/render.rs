//! The human-readable reports of `capture status` and `capture explain`.

use super::render_doctor::features_line;
use crate::ops::NodeStatus;

/// The human-readable status table.
#[must_use]
pub fn render_status(status: &NodeStatus) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node: programs {} (build {}{}; this binary is build {}; bpffs {}), {} pod(s), kernel errors {:?}",
        if status.programs_loaded {
            "loaded"
        } else {
            "not loaded"
        },
        status.node_build.as_deref().unwrap_or("none"),
        status
            .node_features
            .map(|f| format!(", {}", features_line(f)))
            .unwrap_or_default(),
        status.build,
        status.bpffs.display(),
        status.pods.len(),
        status.node_errors
    );
    if status.mesh_configs.is_empty() {
        if let Some(mesh) = &status.mesh_config {
            out.push_str(&render_mesh_config(mesh));
        }
    }
    for mesh in &status.mesh_configs {
        out.push_str(&render_mesh_config(mesh));
    }
    if let Some(chain) = &status.cni_chain {
        out.push_str(&render_cni_chain(chain));
    }
    if let Some(trace) = status
        .trace
        .as_ref()
        .filter(|t| t.traced_pods > 0 || t.dropped > 0)
    {
        let _ = writeln!(
            out,
            "trace: {} pod(s) traced now; {} decisions emitted, {} dropped since the programs loaded",
            trace.traced_pods, trace.emitted, trace.dropped
        );
        for s in &trace.sessions {
            let _ = writeln!(
                out,
                "  traced: netns cookie {} by process {} (slot {}, {} dropped)",
                s.netns_cookie, s.pid, s.slot, s.dropped
            );
        }
    }
    for damaged in &status.damaged_records {
        let _ = writeln!(
            out,
            "DAMAGED record {}: {} (its pod is left out; CNI DEL of the pod releases it)",
            damaged.path.display(),
            damaged.error
        );
    }
    for pod in &status.pods {
        out.push_str(&render_pod(pod));
    }
    for left in &status.left_alone {
        let _ = writeln!(
            out,
            "left alone: pod {}/{} (container {}), {}: {}",
            left.pod.namespace,
            left.pod.name,
            left.pod.container_id,
            left.reason.as_str(),
            left.detail
        );
    }
    if let Some(r) = &status.reconcile {
        out += &render_reconcile(r);
    }
    if let Some(runtime) = &status.runtime {
        out += &render_runtime(runtime);
    }
    out
}

/// One captured pod's lines of `capture status`.
fn render_pod(pod: &crate::ops::PodStatus) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
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
    if let Some(build) = &pod.program_build {
        let _ = writeln!(out, "  programs of build {build}");
    }
    let ips: Vec<String> = r
        .config
        .pod_ip4
        .map(|a| a.to_string())
        .into_iter()
        .chain(r.config.pod_ip6.map(|a| a.to_string()))
        .chain(r.config.other_pod_ips.iter().map(ToString::to_string))
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
    let _ = writeln!(out, "  proxy identity {}", identity_line(&r.config));
    for note in &pod.notes {
        let _ = writeln!(out, "  note: {note}");
    }
    if !r.settings.is_empty() {
        let settings: Vec<String> = r.settings.iter().map(render_setting).collect();
        let _ = writeln!(out, "  settings: {}", settings.join("; "));
    }
    if let Some(proxy) = &r.proxy_container {
        let refused = r
            .proxy_settings_refused
            .as_ref()
            .map(|why| format!("; its settings REFUSED, ADD's kept: {why}"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  proxy container {} ({}){refused}",
            proxy.name, proxy.container_id
        );
    }
    if let Some(c) = &pod.counters {
        let _ = writeln!(
            out,
            "  redirected outbound {} inbound {}  passed owner {} excluded {} local {}  errors {}",
            c.redirected_outbound,
            c.redirected_inbound,
            c.passed_owner,
            c.passed_excluded,
            c.passed_local,
            c.errors
        );
    }
    out
}

/// The agent's last reconcile pass.
fn render_reconcile(r: &crate::runtime::ReconcileReport) -> String {
    use std::fmt::Write as _;
    let repair = r.repair.map_or_else(|| "-".to_owned(), |m| m.to_string());
    let events = if r.event_stream {
        " and on its events"
    } else {
        ""
    };
    let mut out = format!(
        "reconcile: the agent reads {} every {} s{events} (repair {repair}); last pass at {} (unix): ",
        r.cri_socket, r.period_secs, r.at_unix
    );
    if let Some(e) = &r.runtime_error {
        let _ = writeln!(out, "RUNTIME UNREADABLE, nothing repaired or released: {e}");
        return out;
    }
    let _ = writeln!(
        out,
        "{} sandboxes, {} meshed and not captured, {} released",
        r.sandboxes,
        r.uncaptured.len(),
        r.released.len()
    );
    for u in &r.uncaptured {
        let _ = writeln!(
            out,
            "  meshed, not captured: {} ({}): {}; {}: {}",
            u.pod, u.sandbox_id, u.why, u.action, u.result
        );
    }
    for pod in &r.released {
        let _ = writeln!(out, "  released {pod}: its sandbox is gone");
    }
    out
}

/// `status --all`: the runtime's sandboxes, the uncaptured meshed ones first.
fn render_runtime(r: &crate::runtime::RuntimeReport) -> String {
    use std::fmt::Write as _;

    use crate::runtime::Standing;
    let mut out = format!(
        "runtime: {} (meshed pods chosen by {})\n",
        r.cri_socket, r.selection
    );
    if let Some(e) = &r.error {
        let _ = writeln!(
            out,
            "  UNREADABLE: {e}; nothing is known of the node's sandboxes"
        );
        return out;
    }
    let uncaptured = r.view.uncaptured().count();
    let _ = writeln!(
        out,
        "  {} sandboxes, {} meshed, {} meshed and NOT captured, {} records without a running sandbox",
        r.view.sandboxes.len(),
        r.view.sandboxes.iter().filter(|s| s.meshed).count(),
        uncaptured,
        r.view.orphans.len()
    );
    let mut rows: Vec<_> = r.view.sandboxes.iter().collect();
    rows.sort_by_key(|s| (s.captured.is_some() || !s.meshed, !s.meshed, s.pod.clone()));
    for s in rows {
        let standing = match (s.standing, s.captured) {
            (Standing::Captured, Some(mode)) => format!("captured ({mode})"),
            (Standing::MeshedNotCaptured | Standing::MeshedNotReady, _) => {
                "MESHED, NOT CAPTURED".into()
            }
            (Standing::HostNetwork, _) => "host network".into(),
            _ => "not meshed".into(),
        };
        let why = s
            .why
            .as_deref()
            .map(|w| format!(": {w}"))
            .unwrap_or_default();
        let _ = writeln!(out, "  {:<40} {standing}{why}", s.pod);
    }
    for o in &r.view.orphans {
        let _ = writeln!(
            out,
            "  record of a sandbox {}: {} (netns {}): its DEL never reached capture; released once the netns is gone",
            o.sandbox, o.pod, o.netns
        );
    }
    out
}

/// `dns_capture=true (mesh defaultConfig.proxyMetadata.ISTIO_META_DNS_CAPTURE)`, with what it
/// overrides.
fn render_setting(s: &crate::config::Setting) -> String {
    let mut line = format!("{}={} ({}", s.name, s.value, s.source.as_str());
    if !s.from.is_empty() {
        line.push(' ');
        line.push_str(&s.from);
    }
    line.push(')');
    for o in &s.overrides {
        line.push_str(&format!(
            ", over {} {}={}",
            o.source.as_str(),
            o.from,
            o.value
        ));
    }
    line
}

fn render_mesh_config(mesh: &crate::config::mesh_config::MeshConfigReport) -> String {
    let revision = mesh
        .revision
        .as_ref()
        .map(|r| format!(" (revision {r})"))
        .unwrap_or_default();
    let mut out = format!("mesh configuration {}{revision}: ", mesh.path.display());
    match (&mesh.in_use, mesh.loaded_at_unix) {
        (Some(m), Some(at)) => out.push_str(&format!(
            "in use for new pods since {at} (unix): interceptionMode {}, proxyMetadata {:?}\n",
            m.interception_mode.as_deref().unwrap_or("unset"),
            m.proxy_metadata
        )),
        _ => out.push_str("NONE IN USE: its pods are refused\n"),
    }
    if let Some(m) = &mesh.in_use {
        for w in &m.warnings {
            out.push_str(&format!("  warning: {w}\n"));
        }
    }
    if let Some(problem) = &mesh.problem {
        out.push_str(&format!(
            "  the file's present content cannot be used (since {} unix): {problem}\n",
            mesh.problem_since_unix.unwrap_or_default()
        ));
    }
    out
}

fn render_cni_chain(chain: &crate::install::chain_report::ChainReport) -> String {
    let mut out = format!("cni: capture-cni in {}: ", chain.conf_dir.display());
    match (&chain.active, chain.chained) {
        (Some(active), true) => out.push_str(&format!("chained in {}\n", active.display())),
        _ => out.push_str(&format!(
            "NOT CHAINED ({}){}: new pods start uncaptured until the reconcile captures them\n",
            chain.problem.as_deref().unwrap_or("unknown"),
            chain
                .next_rechain_in_seconds
                .map(|s| format!("; chained again in {s} s"))
                .unwrap_or_default()
        )),
    }
    if let Some(fight) = &chain.fight {
        out.push_str(&format!(
            "  FIGHT: {} keeps being rewritten without capture-cni (since {} unix, {} re-chainings, by {:?}): {}\n",
            fight.file.display(),
            fight.since_unix,
            fight.rechains,
            fight.neighbour,
            fight.fix
        ));
    }
    out
}

/// `capture explain`'s answer for a reader.
pub fn render_explanation(e: &crate::explain::Explanation) -> String {
    use crate::explain::Outcome;
    let mut out = format!(
        "pod:      {} (netns {}), backend {}{}\n",
        e.pod,
        e.netns.display(),
        e.backend,
        if e.in_force {
            ""
        } else {
            ", NOT fully in force"
        }
    );
    out += &format!(
        "question: {} {} to {} from uid {} gid {}\n",
        serde_plain(&e.direction),
        serde_plain(&e.proto),
        e.to,
        e.uid,
        e.gid
    );
    out += &match e.verdict {
        Outcome::Redirect => format!("verdict:  redirect to {}\n", e.port),
        Outcome::Pass => format!("verdict:  pass (to {})\n", e.to),
        Outcome::Refuse => format!(
            "verdict:  refuse (redirected to {}, where nothing listens)\n",
            e.port
        ),
    };
    out += &format!("rule:     {}: {}\n", e.rule, e.reason);
    out += &format!("iptables: {}\n", e.iptables_equivalent);
    if let Some(live) = &e.iptables_rule {
        out += &format!(
            "in netns: {} packets, {} bytes: {}\n",
            live.packets, live.bytes, live.line
        );
    }
    for note in &e.notes {
        out += &format!("note:     {note}\n");
    }
    out
}

/// A unit enum's serde name (`outbound`).
fn serde_plain<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The pod's proxy identity: by uid (Istio's), or by container with what is known of it.
fn identity_line(cfg: &crate::config::CaptureConfig) -> String {
    match &cfg.proxy_identity {
        None => "uid (the owner's uid or gid, any container)".into(),
        Some(i) => format!("container {:?}: {}", i.container, i.proxy.describe()),
    }
}
