//! Table-driven connection cases: who connects where, and where it must land.

use crate::{
    probe::{ip_of, ConnectOpts, Outcome, Who},
    topology::{Topology, POD_IP4, POD_IP6},
};

/// Where a connection must land.
#[derive(Clone, Debug)]
pub enum Expect {
    /// Accepted by the proxy's outbound listener (15001) with this `SO_ORIGINAL_DST`.
    Outbound(&'static str),
    /// Accepted by the proxy's inbound listener (15006) with this `SO_ORIGINAL_DST`.
    Inbound(&'static str),
    /// Reached the remote netns directly, at this address.
    Remote(&'static str),
    /// Reached the pod's own app listener directly.
    App,
    /// Refused with this errno name.
    Refused(&'static str),
}

#[derive(Clone, Debug)]
pub struct Case {
    /// The spec's case id (T01 …) or a short name.
    pub id: &'static str,
    pub who: Who,
    pub to: &'static str,
    pub opts: ConnectOpts,
    pub expect: Expect,
    /// The peer address the accepting listener must see, if the case pins it down.
    pub peer_ip: Option<&'static str>,
}

impl Case {
    #[must_use]
    pub fn new(id: &'static str, who: Who, to: &'static str, expect: Expect) -> Self {
        Self {
            id,
            who,
            to,
            opts: ConnectOpts::default(),
            expect,
            peer_ip: None,
        }
    }
    #[must_use]
    pub fn opts(mut self, opts: ConnectOpts) -> Self {
        self.opts = opts;
        self
    }
    #[must_use]
    pub fn peer(mut self, ip: &'static str) -> Self {
        self.peer_ip = Some(ip);
        self
    }
}

/// The IP that a pod-originated connection should carry as source, by destination family.
#[must_use]
pub fn pod_ip_for(to: &str) -> &'static str {
    if to.starts_with('[') && !to.starts_with("[::ffff:") {
        POD_IP6
    } else {
        POD_IP4
    }
}

fn verify(case: &Case, got: &Outcome) -> Result<(), String> {
    let want_server = |name: &str| -> Result<(), String> {
        if !got.ok() {
            return Err(format!(
                "expected {name}, connection failed: {:?}",
                got.error()
            ));
        }
        match got.server() {
            Some(s) if s == name => Ok(()),
            other => Err(format!("expected listener {name}, reached {other:?}")),
        }
    };
    match &case.expect {
        Expect::Outbound(orig) | Expect::Inbound(orig) => {
            let name = if matches!(case.expect, Expect::Outbound(_)) {
                "outbound"
            } else {
                "inbound"
            };
            want_server(name)?;
            if got.orig().as_deref() != Some(*orig) {
                return Err(format!("SO_ORIGINAL_DST {:?}, want {orig}", got.orig()));
            }
            // The app's socket keeps reporting the destination it asked for, as under iptables.
            if case.opts.create_as.is_none()
                && !case.opts.v6_socket
                && got.client_peer().as_deref() != Some(case.to)
            {
                return Err(format!(
                    "app getpeername {:?}, want {}",
                    got.client_peer(),
                    case.to
                ));
            }
        }
        Expect::Remote(addr) => {
            want_server("remote")?;
            if got.server_local().as_deref() != Some(*addr) {
                return Err(format!(
                    "remote accepted on {:?}, want {addr}",
                    got.server_local()
                ));
            }
        }
        Expect::App => want_server("app")?,
        Expect::Refused(errno) => {
            if got.ok() || got.error().as_deref() != Some(*errno) {
                return Err(format!("expected {errno}, got {:?}", got.0));
            }
        }
    }
    if let Some(ip) = case.peer_ip {
        let seen = got.peer_seen().map(|p| ip_of(&p));
        if seen.as_deref() != Some(ip) {
            return Err(format!("listener saw peer {seen:?}, want {ip}"));
        }
    }
    Ok(())
}

/// Runs every case against the topology and panics listing all that failed.
pub fn run_cases(topo: &Topology, cases: &[Case]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let got = topo.connect(&case.who, case.to, &case.opts);
            verify(case, &got).err().map(|e| {
                format!(
                    "{} ({:?} -> {}): {e}\n    saw {}",
                    case.id, case.who, case.to, got.0
                )
            })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
