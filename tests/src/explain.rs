//! `capture explain` asked about a case of the parity matrix, as the case's process would make
//! its connection.

use serde_json::Value;

use crate::{cases::Case, topology::Topology};

/// `capture explain --json` for `case` in `direction` (`outbound` or `inbound`).
///
/// # Panics
/// If explain fails or its answer is no JSON.
#[must_use]
pub fn explain_case(topo: &Topology, case: &Case, direction: &str) -> Value {
    let netns = topo.pod.netns.path();
    let (uid, gid) = (case.who.uid.to_string(), case.who.gid.to_string());
    let mut args = vec![
        "explain",
        "--json",
        "--netns",
        netns.to_str().expect("netns path"),
        "--to",
        case.to,
        "--from-uid",
        &uid,
        "--from-gid",
        &gid,
        "--direction",
        direction,
    ];
    let from = case.opts.bind.as_ref().map(|b| {
        b.parse::<std::net::SocketAddr>()
            .expect("a case binds ADDR:PORT")
            .ip()
            .to_string()
    });
    if let Some(from) = &from {
        args.extend(["--from", from]);
    }
    if case.opts.udp {
        args.extend(["--proto", "udp"]);
    }
    let out = topo.capture(&args);
    assert!(
        out.status.success(),
        "{}: capture explain failed: {}",
        case.id,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("explain JSON")
}
