//! The human-readable reports of `capture doctor`: what the kernel offers, the builds the node has
//! met, its limits, foreign programs and acceleration.

use crate::probe::{FallbackChoice, ModeChoice};

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
        let _ = writeln!(
            out,
            "  [info] {:<34} {}",
            "TCP owner read from the socket",
            if features.owner_from_file {
                "yes"
            } else {
                "no: recorded in socket storage at creation (an allocation per socket; a \
                 socket created before capture attached is judged by its caller)"
            }
        );
        let _ = writeln!(
            out,
            "  [info] {:<34} {}",
            "stateless IPv4 redirect",
            if features.stateless_redirect {
                "yes: a loopback address per destination, no per-connection state"
            } else {
                "no: every redirect keeps its destination in socket storage and a hand-off"
            }
        );
    }
    let pick = crate::probe::choose(ModeChoice::Auto, FallbackChoice::Auto, probe);
    let usable = |ok: bool| if ok { "usable" } else { "NOT usable" };
    let _ = writeln!(
        out,
        "ebpf backend: {}; iptables backend: {}; nftables backend: {}",
        usable(probe.ebpf_usable),
        usable(probe.iptables_usable),
        usable(probe.nftables_usable),
    );
    let _ = match pick {
        Ok((mode, why)) => writeln!(out, "--mode auto would use {mode} ({why})"),
        Err(why) => writeln!(out, "--mode auto would fail: {why}"),
    };
    let _ = match probe.fallback(FallbackChoice::Auto) {
        Ok((mode, why)) => writeln!(out, "pods that fall back would use {mode} ({why})"),
        Err(why) => writeln!(out, "pods that need a fallback would be refused: {why}"),
    };
    out
}

/// Which builds the node has met, and what a takeover by this one would do.
#[must_use]
pub fn render_builds(builds: &crate::ebpf::takeover::Builds) -> String {
    use std::fmt::Write as _;
    let mut out = format!("this binary: build {}\n", builds.this);
    let _ = match &builds.node {
        Some(node) => writeln!(
            out,
            "node programs: build {node}, used by {} pod(s), maps sized for {} pods (--max-pods)",
            builds.pods,
            builds.max_pods.unwrap_or_default()
        ),
        None => writeln!(out, "node programs: none pinned"),
    };
    match &builds.takeover {
        None => {}
        Some(Ok(maps)) => {
            let _ = writeln!(out, "this build's agent would take the node over in place:");
            for (map, carried) in maps {
                let _ = writeln!(out, "  {map:<18} {carried:?}");
            }
        }
        Some(Err(why)) => {
            let _ = writeln!(
                out,
                "this build's agent would NOT take the node over: {why}"
            );
        }
    }
    out
}

/// The node-wide maps' capacities, each pod's share, and how full they are.
#[must_use]
pub fn render_limits(limits: &[crate::ebpf::limits::NodeLimit]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "node limits (ebpf backend):
",
    );
    for l in limits {
        let in_use = l.in_use.map_or_else(|| "-".to_string(), |n| n.to_string());
        let per_pod = l.per_pod.map_or_else(|| "-".to_string(), |n| n.to_string());
        let _ = writeln!(
            out,
            "  {:<18} {in_use:>6} of {:>6} in use, {per_pod:>5} per pod  {}",
            l.map, l.capacity, l.holds
        );
    }
    out
}

/// Whether pods that ask are accelerated on this node, and the checks' verdict.
#[must_use]
pub fn render_acceleration(report: &crate::accel::NodeReport) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "acceleration (app to proxy, sk_msg): {}\n",
        match &report.why_not {
            None => "on for pods that ask (capture.dev/accelerate: \"true\")".to_string(),
            Some(why) => format!("off: {why}"),
        }
    );
    if let Some(v) = &report.setting.check {
        let _ = writeln!(
            out,
            "  last checks: kernel {}, build {}: {} cases, {} difference(s){}",
            v.kernel,
            v.build,
            v.cases,
            v.failed.len(),
            if v.is_current() {
                ""
            } else {
                " (another kernel or build: not in force)"
            }
        );
        for f in &v.failed {
            let accepted = report.setting.accepted.contains(&f.name);
            let _ = writeln!(
                out,
                "    {}{}",
                f.name,
                if accepted { " (accepted)" } else { "" }
            );
        }
    }
    out
}

/// Other programs on the cgroups above the pods, which run after capture's.
#[must_use]
pub fn render_foreign(foreign: &[crate::ebpf::foreign::ForeignProgram]) -> String {
    use std::fmt::Write as _;
    if foreign.is_empty() {
        return "programs of others above the pod cgroups: none\n".into();
    }
    let mut out = String::from(
        "programs of others above the pod cgroups (the kernel runs them after capture's):\n",
    );
    for p in foreign {
        let _ = writeln!(
            out,
            "  {} {}: program {} ({})",
            p.cgroup.display(),
            p.hook,
            p.id,
            p.name
        );
    }
    out
}

/// The acceleration checks, one line per case.
#[must_use]
pub fn render_accel_check(report: &crate::accel::check::Report) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "acceleration checks on kernel {} with build {}: {}\n",
        report.kernel,
        report.build,
        if report.passed { "passed" } else { "FAILED" }
    );
    for case in &report.cases {
        let _ = writeln!(
            out,
            "  {:<40} {}",
            case.name,
            if case.passed { "same" } else { "DIFFERS" }
        );
        if !case.passed {
            let _ = writeln!(out, "    plain:       {:?}", case.plain);
            let _ = writeln!(out, "    accelerated: {:?}", case.accelerated);
        }
    }
    let _ = writeln!(out, "  bytes accelerated: {}", report.accelerated_bytes);
    out
}

/// The node's features in a few words: what its programs were loaded with.
pub(super) fn features_line(f: capture_user::ebpf::loader::KernelFeatures) -> String {
    let yes_no = |on: bool| if on { "yes" } else { "no" };
    format!(
        "stateless redirect {}, owner from socket {}, sock_ops netns cookie {}",
        yes_no(f.stateless_redirect),
        yes_no(f.owner_from_file),
        yes_no(f.sock_ops_netns_cookie)
    )
}
