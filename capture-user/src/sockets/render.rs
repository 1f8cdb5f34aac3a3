//! `capture sockets` for people: one block per connection, `ss`-like, with the kernel's addresses
//! only where they differ from the app's.

use std::fmt::Write as _;

use super::{Connection, Holder, Kind, Report};

fn who(holder: Option<&Holder>) -> String {
    holder.map_or_else(
        || "(queued, not accepted yet)".into(),
        |h| format!("{}/{}", h.pid, h.command),
    )
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Outbound => "outbound",
        Kind::ProxyOutbound => "proxy end (outbound)",
        Kind::ProxyInbound => "proxy end (inbound)",
        Kind::Inbound => "inbound",
    }
}

fn decision(c: &Connection) -> String {
    let verdict = match (c.verdict, c.port) {
        (Some("redirect"), Some(port)) => format!("redirect to {port}"),
        (Some(v), _) => v.to_owned(),
        (None, _) => "no decision (within the pod)".to_owned(),
    };
    match (c.hook, c.rule) {
        (Some(hook), Some(rule)) => format!("{verdict} by {hook}, rule {rule}"),
        (Some(hook), None) => format!("{verdict} by {hook}"),
        _ => verdict,
    }
}

fn connection(out: &mut String, c: &Connection) {
    let _ = writeln!(
        out,
        "{:<21} {:<11} {} -> {}  {}",
        kind_name(c.kind),
        c.state,
        c.local,
        c.remote,
        who(c.holder.as_ref()),
    );
    if let Some(orig) = c.original_dst.filter(|o| *o != c.remote) {
        let _ = writeln!(out, "    original destination {orig}");
    }
    let mut via = if c.via_proxy {
        "through the proxy".to_owned()
    } else {
        "not through the proxy".to_owned()
    };
    if let Some(peer) = &c.peer {
        let _ = write!(via, "; other end {}/{}", peer.pid, peer.command);
    }
    let _ = writeln!(out, "    {via}; {}", decision(c));
    if (c.kernel_local, c.kernel_remote) != (c.local, c.remote) {
        let _ = writeln!(
            out,
            "    kernel: {} -> {} (what ss shows)",
            c.kernel_local, c.kernel_remote
        );
    }
    if let Some(note) = &c.note {
        let _ = writeln!(out, "    note: {note}");
    }
}

/// The report as text.
#[must_use]
pub fn render(report: &Report) -> String {
    let netns = if report.pod == report.netns {
        String::new()
    } else {
        format!(" (netns {})", report.netns)
    };
    let mut out = format!(
        "pod {}{netns}, backend {}: {} connections, {} listeners, {} in TIME-WAIT\n",
        report.pod,
        report.backend,
        report.connections.len(),
        report.listeners.len(),
        report.time_wait
    );
    for l in &report.listeners {
        let role = match (l.proxy_port, l.registered) {
            (Some(port), Some(false)) => {
                format!("  proxy {port} port, NOT known to the programs: inbound connections to the pod are refused")
            }
            (Some(port), _) => format!("  proxy {port} port"),
            (None, _) => String::new(),
        };
        let holder = l
            .holder
            .as_ref()
            .map_or_else(|| "-".to_owned(), |h| format!("{}/{}", h.pid, h.command));
        let _ = writeln!(out, "listen {:<36} {holder}{role}", l.local.to_string());
    }
    for c in &report.connections {
        connection(&mut out, c);
    }
    for note in &report.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}
