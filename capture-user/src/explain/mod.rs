//! `capture explain`: what capture does with one connection of a pod, and why.
//!
//! The answer comes from the pod's recorded configuration, put into the kernel's form by the code
//! that writes the pod's maps (`kernel_config`, the list builders), and from the decision
//! procedure the kernel programs run (`capture_common::decision`): the same function, so the
//! answer cannot drift from what the kernel does. For an iptables pod the rule the answer names is
//! then looked up among the rules in the pod's netns, with its packet counter.

pub mod live;
pub mod rules;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
};

use capture_common::{
    config::{ListKind, PodConfig},
    decision::{
        inbound_rule, outbound_rule, Connect, InboundVerdict, OutboundRule, PodLists, Verdict,
    },
};
use ipnet::IpNet;
use serde::Serialize;

use self::{
    live::LiveRule,
    rules::{Equivalent, Facts},
};
use crate::{
    any_backend::ExistingBackends,
    config::CaptureConfig,
    ebpf::{
        list_entries::{cidr_entries, port_entries},
        pod_maps::{ip6_words, kernel_config},
    },
    iptables::rules::Family,
    netns::Netns,
    paths::Paths,
    record::{self, Mode, PodRecord, PodSelector},
    sockdiag,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// A connection the pod opens.
    Outbound,
    /// A connection arriving for the pod.
    Inbound,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

/// The hypothetical connection.
#[derive(Clone, Debug)]
pub struct Question {
    pub pod: PodSelector,
    pub to: SocketAddr,
    /// The address the socket is bound to before it connects, if any (`127.0.0.6` is the proxy's
    /// inbound passthrough).
    pub from: Option<IpAddr>,
    /// The socket owner's uid and primary gid, as the node sees them.
    pub uid: u32,
    pub gid: u32,
    pub proto: Proto,
    pub direction: Direction,
    /// The connecting process runs in another container than the pod's proxy container (only
    /// pods under proxy identity by container tell the two apart).
    pub outside_proxy_container: bool,
}

/// What happens to the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Sent to one of the proxy's listeners (`port`).
    Redirect,
    /// Goes where it asked to.
    Pass,
    /// Sent to a proxy port nothing listens on: the connection is refused.
    Refuse,
}

/// The answer; the field names are stable (scripts read `--json`).
#[derive(Debug, Serialize)]
pub struct Explanation {
    pub verdict: Outcome,
    /// Where the connection goes: the proxy's port, or its own for a pass.
    pub port: u16,
    /// The rule's stable name (the same as `capture trace` prints).
    pub rule: &'static str,
    /// The rule in words.
    pub reason: String,
    /// The Istio iptables rule the decision stands for, as `iptables -S` writes it, or why no
    /// rule matches.
    pub iptables_equivalent: String,
    /// The backend in force for the pod.
    pub backend: Mode,
    /// For an iptables pod: that rule as it is in the pod's netns, with its counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iptables_rule: Option<LiveRule>,
    /// Whether everything capture set up for the pod is in place (`capture status`).
    pub in_force: bool,
    pub pod: String,
    pub netns: PathBuf,
    pub direction: Direction,
    pub proto: Proto,
    pub to: SocketAddr,
    pub uid: u32,
    pub gid: u32,
    /// What else the reader should know (a fallback, something missing, nothing listening).
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("no captured pod matches {0}: `capture status` lists the pods capture knows")]
    UnknownPod(String),
    #[error(transparent)]
    Records(#[from] record::RecordError),
    #[error("{to} is IPv6 but the question is about pod {pod}'s IPv4 path only: {why}")]
    Family {
        to: SocketAddr,
        pod: String,
        why: &'static str,
    },
    #[error("reading pod {pod}'s iptables rules: {why}")]
    Iptables { pod: String, why: String },
}

/// The pod's lists as the kernel's maps hold them, from the builders the maps are written with.
struct RecordedLists {
    ports: Vec<(ListKind, u16)>,
    cidrs: Vec<(ListKind, IpNet)>,
}

/// An address of the decision's form (IPv4 in word 0, network order) as an `IpAddr`.
pub(crate) fn ip_of(ipv6: bool, words: &[u32; 4]) -> IpAddr {
    if ipv6 {
        let mut octets = [0u8; 16];
        for (chunk, word) in octets.chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(octets))
    } else {
        IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
    }
}

/// An `IpAddr` in the decision's form.
fn words_of(ip: IpAddr) -> [u32; 4] {
    match ip {
        IpAddr::V4(v4) => [u32::from_ne_bytes(v4.octets()), 0, 0, 0],
        IpAddr::V6(v6) => ip6_words(v6.octets()),
    }
}

impl PodLists for RecordedLists {
    fn port_listed(&self, list: ListKind, port: u16) -> bool {
        self.ports.iter().any(|&(k, p)| k == list && p == port)
    }

    fn cidr_listed(&self, list: ListKind, ipv6: bool, addr: &[u32; 4]) -> bool {
        let ip = ip_of(ipv6, addr);
        self.cidrs
            .iter()
            .any(|(k, n)| *k == list && n.contains(&ip))
    }
}

/// The record of the pod `which` names.
///
/// # Errors
/// No such pod, or the records cannot be read.
pub(crate) fn find_pod(paths: &Paths, which: &PodSelector) -> Result<PodRecord, ExplainError> {
    record::find(paths, which, crate::ebpf::netns_cookie::netns_cookie)?
        .ok_or_else(|| ExplainError::UnknownPod(which.to_string()))
}

/// The position of `id` among the first `count` of `ids` (the owner rule that matched), or 0
/// (the first rule, where a non-owner's local connection stops).
fn owner_index(ids: &[u32], count: u32, id: u32) -> usize {
    ids.iter()
        .take(count as usize)
        .position(|&i| i == id)
        .unwrap_or(0)
}

/// The decision for the question, in the kernel's terms.
pub(crate) struct Decision {
    pub(crate) rule: &'static str,
    words: &'static str,
    equivalent: Equivalent,
    /// The proxy's port for a redirect.
    pub(crate) redirect_to: Option<u16>,
}

fn decide_outbound(
    cfg: &CaptureConfig,
    kcfg: &PodConfig,
    lists: &RecordedLists,
    q: &Question,
) -> Decision {
    let ipv6 = q.to.is_ipv6();
    let conn = Connect {
        ipv6,
        dst: words_of(q.to.ip()),
        dst_port: q.to.port(),
        src: q.from.map_or([0; 4], words_of),
        uid: q.uid,
        gid: q.gid,
        udp: q.proto == Proto::Udp,
        outside_proxy_container: q.outside_proxy_container && cfg.proxy_identity.is_some(),
    };
    let rule = outbound_rule(kcfg, lists, &conn);
    let by_gid = matches!(
        rule,
        OutboundRule::ProxyGidToLocal | OutboundRule::LocalNotProxyGid | OutboundRule::ProxyGid
    );
    let owner_index = if by_gid {
        owner_index(&kcfg.proxy_gids, kcfg.proxy_gid_count, q.gid)
    } else {
        owner_index(&kcfg.proxy_uids, kcfg.proxy_uid_count, q.uid)
    };
    let facts = Facts {
        cfg,
        family: if ipv6 { Family::V6 } else { Family::V4 },
        udp: conn.udp,
        dst: q.to.ip(),
        dst_port: q.to.port(),
        owner_index,
        gid: q.gid,
    };
    let redirect_to = match rule.verdict() {
        Verdict::Outbound => Some(kcfg.outbound_port),
        Verdict::Inbound => Some(kcfg.inbound_port),
        Verdict::Dns => Some(kcfg.dns_port),
        Verdict::Pass(_) => None,
    };
    Decision {
        rule: rule.name(),
        words: rules::outbound_words(rule),
        equivalent: rules::outbound_equivalent(rule, &facts),
        redirect_to,
    }
}

fn decide_inbound(
    cfg: &CaptureConfig,
    kcfg: &PodConfig,
    lists: &RecordedLists,
    q: &Question,
) -> Decision {
    let rule = inbound_rule(kcfg, lists, q.to.port());
    Decision {
        rule: rule.name(),
        words: rules::inbound_words(rule),
        equivalent: rules::inbound_equivalent(rule, cfg, q.to.port()),
        redirect_to: (rule.verdict() == InboundVerdict::Capture).then_some(kcfg.inbound_port),
    }
}

/// What the kernel decides for `q` in a pod of configuration `cfg` (`q.pod` aside).
pub(crate) fn decide(cfg: &CaptureConfig, q: &Question) -> Decision {
    let kcfg = kernel_config(cfg);
    let lists = RecordedLists {
        ports: port_entries(cfg),
        cidrs: cidr_entries(cfg),
    };
    match q.direction {
        Direction::Outbound => decide_outbound(cfg, &kcfg, &lists, q),
        Direction::Inbound => decide_inbound(cfg, &kcfg, &lists, q),
    }
}

/// What proxy identity by container means for the answer.
fn identity_note(identity: &crate::config::ContainerIdentity, outside: bool) -> String {
    let whose = if outside {
        "another container's".to_string()
    } else {
        format!(
            "the {} container's (--from-other-container asks for another)",
            identity.container
        )
    };
    let mut note = format!(
        "proxy identity by container: the proxy's ids exempt only the {} container (now: {}); this answers for {whose} process",
        identity.container,
        identity.proxy.describe()
    );
    if identity.proxy == crate::config::ProxyContainer::Unknown && !outside {
        note.push_str("; while it is unknown, a connection the proxy's ids would send elsewhere than an app's is refused");
    }
    note
}

/// Answers `q` for a pod of this node.
///
/// # Errors
/// An unknown pod, unreadable records, or an iptables pod whose rules cannot be read.
pub fn explain(paths: &Paths, q: &Question) -> Result<Explanation, ExplainError> {
    let record = find_pod(paths, &q.pod)?;
    let pod = record.display_name();
    let decision = decide(&record.config, q);
    let mut notes = Vec::new();
    if let Some(why) = &record.fallback_reason {
        notes.push(format!("the pod fell back to iptables: {why}"));
    }
    if let (Some(identity), Direction::Outbound) = (&record.config.proxy_identity, q.direction) {
        notes.push(identity_note(identity, q.outside_proxy_container));
    }
    let missing = match ExistingBackends::new(paths).get(record.mode) {
        Ok(backend) => backend.missing(&record),
        Err(why) => vec![format!("the node's {} backend ({why})", record.mode)],
    };
    if !missing.is_empty() {
        notes.push(format!(
            "capture is not fully in force for the pod (missing: {}): the kernel may not do what this says; see `capture status`",
            missing.join("; ")
        ));
    }
    let mut verdict = if decision.redirect_to.is_some() {
        Outcome::Redirect
    } else {
        Outcome::Pass
    };
    if let Some(port) = decision.redirect_to {
        match Netns::open(&record.netns)
            .map_err(|e| e.to_string())
            .and_then(|n| sockdiag::listening(&n, port).map_err(|e| e.to_string()))
        {
            Ok(true) => {}
            Ok(false) => {
                verdict = Outcome::Refuse;
                notes.push(format!(
                    "nothing in the pod listens on {port}: the connection is refused until the proxy listens"
                ));
            }
            Err(why) => notes.push(format!(
                "could not tell whether the proxy listens on {port}: {why}"
            )),
        }
    }
    let iptables_equivalent = match &decision.equivalent {
        Equivalent::Rule { line, .. } => line.clone(),
        Equivalent::NoRule(why) => (*why).to_string(),
    };
    let iptables_rule = match (&decision.equivalent, record.mode) {
        (Equivalent::Rule { table, line }, Mode::Iptables) => {
            let family = if q.to.is_ipv6() {
                Family::V6
            } else {
                Family::V4
            };
            let save = live::save(&record.netns, record.iptables_flavour(), family, *table)
                .map_err(|why| ExplainError::Iptables {
                    pod: pod.clone(),
                    why,
                })?;
            let found = live::find_rule(&save, *table, line);
            if found.is_none() {
                notes.push(
                    "the rule is not among the pod's iptables rules: they differ from its record (see `capture status`)"
                        .to_string(),
                );
            }
            found
        }
        _ => None,
    };
    Ok(Explanation {
        verdict,
        port: decision.redirect_to.unwrap_or(q.to.port()),
        rule: decision.rule,
        reason: decision.words.to_string(),
        iptables_equivalent,
        backend: record.mode,
        iptables_rule,
        in_force: missing.is_empty(),
        pod,
        netns: record.netns.clone(),
        direction: q.direction,
        proto: q.proto,
        to: q.to,
        uid: q.uid,
        gid: q.gid,
        notes,
    })
}

#[cfg(test)]
mod tests;
