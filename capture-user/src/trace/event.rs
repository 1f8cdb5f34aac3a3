//! One traced decision for people and scripts: decoded from the kernel's record, filtered, and
//! written as a line or as JSON.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use capture_common::{
    decision::{InboundRule, OutboundRule},
    trace::{TraceEvent, TraceHook, TRACE_INBOUND, TRACE_IPV6, TRACE_TASK, TRACE_UDP},
};
use serde::Serialize;

use crate::explain::ip_of;

/// A decision as `trace` prints it; `--json` gives these field names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Line {
    pub time_unix_ns: u128,
    pub hook: &'static str,
    pub direction: &'static str,
    /// The calling process, where the hook runs in one (not `sk_lookup`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<String>,
    /// The owner the decision used (outbound).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    pub proto: &'static str,
    /// The bound source (outbound; unspecified when unbound) or the client (inbound).
    pub src: SocketAddr,
    /// The destination the connection asked for: its original destination.
    pub dst: SocketAddr,
    pub verdict: &'static str,
    /// The proxy's port for a redirect.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The rule, named as `capture explain` names it.
    pub rule: &'static str,
}

/// `event`'s rule by name, `unknown` for a number this build does not know.
fn rule_name(event: &TraceEvent) -> &'static str {
    if event.flags & TRACE_INBOUND != 0 {
        InboundRule::ALL
            .into_iter()
            .find(|r| *r as u8 == event.rule)
            .map_or("unknown", InboundRule::name)
    } else {
        OutboundRule::ALL
            .into_iter()
            .find(|r| *r as u8 == event.rule)
            .map_or("unknown", OutboundRule::name)
    }
}

/// Decodes `event`; `boot_to_unix` turns its monotonic time into wall-clock time.
#[must_use]
pub fn decode(event: &TraceEvent, monotonic_to_unix: i128) -> Line {
    let ipv6 = event.flags & TRACE_IPV6 != 0;
    let inbound = event.flags & TRACE_INBOUND != 0;
    let task = event.flags & TRACE_TASK != 0;
    let addr = |words: &[u32; 4], port: u16| SocketAddr::new(ip_of(ipv6, words), port);
    let comm_len = event.comm.iter().position(|&b| b == 0).unwrap_or(16);
    Line {
        time_unix_ns: u128::try_from(i128::from(event.time_ns) + monotonic_to_unix).unwrap_or(0),
        hook: TraceHook::from_u8(event.hook).map_or("unknown", TraceHook::name),
        direction: if inbound { "inbound" } else { "outbound" },
        pid: task.then_some((event.pid_tgid >> 32) as u32),
        comm: task.then(|| String::from_utf8_lossy(&event.comm[..comm_len]).into_owned()),
        uid: (!inbound).then_some(event.uid),
        gid: (!inbound).then_some(event.gid),
        proto: if event.flags & TRACE_UDP != 0 {
            "udp"
        } else {
            "tcp"
        },
        src: addr(&event.src, event.src_port),
        dst: addr(&event.dst, event.dst_port),
        verdict: match event.verdict {
            1 => "redirect",
            2 => "pass",
            3 => "refuse",
            _ => "unknown",
        },
        port: (event.redirect_port != 0).then_some(event.redirect_port),
        rule: rule_name(event),
    }
}

/// `HH:MM:SS.micros` UTC.
fn clock(unix_ns: u128) -> String {
    let d = UNIX_EPOCH + Duration::from_nanos(u64::try_from(unix_ns).unwrap_or(0));
    let since = d.duration_since(UNIX_EPOCH).unwrap_or_default();
    let day_secs = since.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        day_secs / 3600,
        day_secs / 60 % 60,
        day_secs % 60,
        since.subsec_micros()
    )
}

impl Line {
    /// One line for people.
    #[must_use]
    pub fn render(&self) -> String {
        let who = match (&self.comm, self.pid) {
            (Some(comm), Some(pid)) => format!(" {comm}[{pid}]"),
            _ => String::new(),
        };
        let owner = match (self.uid, self.gid) {
            (Some(uid), Some(gid)) => format!(" uid {uid} gid {gid}"),
            _ => String::new(),
        };
        let verdict = match self.port {
            Some(port) => format!("{} {port}", self.verdict),
            None => self.verdict.to_string(),
        };
        format!(
            "{} {}{who}{owner} {} {} -> {} {verdict} rule {}",
            clock(self.time_unix_ns),
            self.hook,
            self.proto,
            self.src,
            self.dst,
            self.rule
        )
    }
}

/// `--filter`: `KEY=VALUE` terms, all of which an event must match.
#[derive(Clone, Debug, Default)]
pub struct Filter(Vec<(Key, String)>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Rule,
    Verdict,
    Hook,
    Proto,
    Direction,
    Dst,
    Port,
    Uid,
    Pid,
    Comm,
}

const KEYS: [(&str, Key); 10] = [
    ("rule", Key::Rule),
    ("verdict", Key::Verdict),
    ("hook", Key::Hook),
    ("proto", Key::Proto),
    ("direction", Key::Direction),
    ("dst", Key::Dst),
    ("port", Key::Port),
    ("uid", Key::Uid),
    ("pid", Key::Pid),
    ("comm", Key::Comm),
];

impl std::str::FromStr for Filter {
    type Err = String;

    fn from_str(expr: &str) -> Result<Self, String> {
        let names: Vec<&str> = KEYS.iter().map(|(n, _)| *n).collect();
        expr.split_whitespace()
            .map(|term| {
                let (name, value) = term.split_once('=').ok_or_else(|| {
                    format!(
                        "filter term {term:?} is not KEY=VALUE (keys: {})",
                        names.join(", ")
                    )
                })?;
                let key = KEYS
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, k)| *k)
                    .ok_or_else(|| {
                        format!(
                            "filter key {name:?} is unknown; use one of {}",
                            names.join(", ")
                        )
                    })?;
                Ok((key, value.to_string()))
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

impl Filter {
    #[must_use]
    pub fn matches(&self, line: &Line) -> bool {
        self.0.iter().all(|(key, value)| {
            let number = |n: Option<u32>| n.is_some_and(|n| n.to_string() == *value);
            match key {
                Key::Rule => line.rule == value,
                Key::Verdict => line.verdict == value,
                Key::Hook => line.hook == value,
                Key::Proto => line.proto == value,
                Key::Direction => line.direction == value,
                Key::Dst => {
                    line.dst.to_string() == *value
                        || value.parse::<IpAddr>().is_ok_and(|ip| ip == line.dst.ip())
                }
                Key::Port => line.dst.port().to_string() == *value,
                Key::Uid => number(line.uid),
                Key::Pid => number(line.pid),
                Key::Comm => line.comm.as_deref() == Some(value.as_str()),
            }
        })
    }
}

/// How far `CLOCK_MONOTONIC` is behind the wall clock now, in nanoseconds.
#[must_use]
pub fn monotonic_to_unix() -> i128 {
    let unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    i128::try_from(unix).unwrap_or(0) - i128::from(super::monotonic_ns())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> TraceEvent {
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"curl");
        TraceEvent {
            time_ns: 1_000,
            pid_tgid: (4242u64 << 32) + 4243,
            comm,
            src: [0; 4],
            dst: [u32::from_ne_bytes([10, 0, 0, 5]), 0, 0, 0],
            uid: 1000,
            gid: 1000,
            src_port: 0,
            dst_port: 80,
            redirect_port: 15001,
            hook: TraceHook::Connect4 as u8,
            rule: OutboundRule::AllOutbound as u8,
            verdict: 1,
            flags: TRACE_TASK,
            _pad: [0; 6],
        }
    }

    #[test]
    fn an_event_decodes_to_the_rule_explain_names() {
        let line = decode(&event(), 0);
        assert_eq!(line.rule, "include-all-outbound");
        assert_eq!(
            (line.hook, line.verdict, line.port),
            ("connect4", "redirect", Some(15001))
        );
        assert_eq!((line.pid, line.comm.as_deref()), (Some(4242), Some("curl")));
        assert_eq!(line.dst.to_string(), "10.0.0.5:80");
        assert!(line.render().ends_with("curl[4242] uid 1000 gid 1000 tcp 0.0.0.0:0 -> 10.0.0.5:80 redirect 15001 rule include-all-outbound"), "{}", line.render());
        let mut inbound = event();
        inbound.flags = TRACE_INBOUND;
        inbound.rule = InboundRule::ExcludedPort as u8;
        inbound.verdict = 2;
        inbound.redirect_port = 0;
        let line = decode(&inbound, 0);
        assert_eq!(
            (line.rule, line.verdict, line.pid, line.uid),
            ("exclude-inbound-port", "pass", None, None)
        );
    }

    #[test]
    fn filters_take_every_term_and_name_their_keys() {
        let line = decode(&event(), 0);
        for (expr, matches) in [
            ("", true),
            ("rule=include-all-outbound", true),
            ("verdict=redirect dst=10.0.0.5", true),
            ("dst=10.0.0.5:80 port=80 uid=1000 comm=curl pid=4242", true),
            ("verdict=pass", false),
            ("rule=include-all-outbound uid=0", false),
        ] {
            let filter: Filter = expr.parse().unwrap();
            assert_eq!(filter.matches(&line), matches, "{expr}");
        }
        let err = "colour=red".parse::<Filter>().unwrap_err();
        assert!(
            err.contains("colour") && err.contains("rule, verdict"),
            "{err}"
        );
        assert!("rule".parse::<Filter>().unwrap_err().contains("KEY=VALUE"));
    }
}
