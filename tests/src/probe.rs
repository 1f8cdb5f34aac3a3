//! Running the probe as a pod's process, and reading what it saw.

use std::process::Command;

use serde_json::Value;

pub use crate::probe_bin;

/// A process identity inside the pod.
#[derive(Clone, Debug)]
pub struct Who {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// Effective (and file-system) uid and gid, where they differ from the real ones.
    pub effective: Option<(u32, u32)>,
}

impl Who {
    #[must_use]
    pub fn new(uid: u32, gid: u32) -> Self {
        Self {
            uid,
            gid,
            groups: Vec::new(),
            effective: None,
        }
    }
    /// The application container (uid/gid 1000).
    #[must_use]
    pub fn app() -> Self {
        Self::new(1000, 1000)
    }
    /// The sidecar proxy (uid/gid 1337).
    #[must_use]
    pub fn proxy() -> Self {
        Self::new(1337, 1337)
    }
    /// Real ids as given, effective (and file-system) ids `uid`/`gid`.
    #[must_use]
    pub fn with_effective(mut self, uid: u32, gid: u32) -> Self {
        self.effective = Some((uid, gid));
        self
    }
    #[must_use]
    pub fn with_groups(mut self, groups: &[u32]) -> Self {
        self.groups = groups.to_vec();
        self
    }

    /// The probe arguments that enter a pod as this identity.
    pub fn args(&self, cmd: &mut Command) {
        cmd.arg("--uid")
            .arg(self.uid.to_string())
            .arg("--gid")
            .arg(self.gid.to_string());
        if !self.groups.is_empty() {
            let g: Vec<String> = self.groups.iter().map(u32::to_string).collect();
            cmd.arg("--groups").arg(g.join(","));
        }
        if let Some((uid, gid)) = self.effective {
            cmd.arg("--effective").arg(format!("{uid}:{gid}"));
        }
    }
}

/// How the probe connects.
#[derive(Clone, Debug, Default)]
pub struct ConnectOpts {
    /// Bind this source first (`ADDR:PORT`).
    pub bind: Option<String>,
    pub udp: bool,
    /// Create the socket as (uid, gid), connect as the `Who`.
    pub create_as: Option<(u32, u32)>,
    /// An `AF_INET6` socket for an IPv4 destination (v4-mapped).
    pub v6_socket: bool,
    /// `IP_TRANSPARENT` (original-source connections).
    pub transparent: bool,
    /// `SO_MARK`.
    pub mark: Option<u32>,
}

impl ConnectOpts {
    pub fn args(&self, cmd: &mut Command) {
        if let Some(b) = &self.bind {
            cmd.arg("--bind").arg(b);
        }
        if self.udp {
            cmd.arg("--udp");
        }
        if let Some((u, g)) = self.create_as {
            cmd.arg("--create-as").arg(format!("{u}:{g}"));
        }
        if self.v6_socket {
            cmd.arg("--v6-socket");
        }
        if self.transparent {
            cmd.arg("--transparent");
        }
        if let Some(m) = self.mark {
            cmd.arg("--mark").arg(m.to_string());
        }
    }
}

/// What one connection attempt saw: the client's view and the accepting server's report.
#[derive(Clone, Debug)]
pub struct Outcome(pub Value);

impl Outcome {
    /// Parses the probe's output line.
    pub fn parse(stdout: &str) -> Self {
        let line = stdout.lines().last().unwrap_or_default();
        Self(serde_json::from_str(line).unwrap_or_else(|e| panic!("probe printed {stdout:?}: {e}")))
    }
    fn str_at(&self, path: &[&str]) -> Option<String> {
        let mut v = &self.0;
        for p in path {
            v = v.get(p)?;
        }
        v.as_str().map(String::from)
    }
    #[must_use]
    pub fn ok(&self) -> bool {
        self.0["ok"].as_bool().unwrap_or(false)
    }
    /// The errno name of a failed attempt.
    #[must_use]
    pub fn error(&self) -> Option<String> {
        self.str_at(&["error"])
    }
    /// The name of the listener that accepted (`outbound`, `inbound`, `app`, `remote`).
    #[must_use]
    pub fn server(&self) -> Option<String> {
        self.str_at(&["reply", "server"])
    }
    /// Asserts which listener accepted; `context` (the mode, the case) leads the failure message.
    #[track_caller]
    pub fn assert_served_by(&self, server: &str, context: &str) {
        assert_eq!(
            self.server().as_deref(),
            Some(server),
            "{context}: {:?}",
            self.0
        );
    }
    /// `SO_ORIGINAL_DST` as the accepting listener read it.
    #[must_use]
    pub fn orig(&self) -> Option<String> {
        self.str_at(&["reply", "orig"])
    }
    /// The client address as the accepting listener saw it.
    #[must_use]
    pub fn peer_seen(&self) -> Option<String> {
        self.str_at(&["reply", "peer"])
    }
    /// The accepting socket's local address.
    #[must_use]
    pub fn server_local(&self) -> Option<String> {
        self.str_at(&["reply", "local"])
    }
    /// Where a UDP reply came from, as the app's socket reports it.
    #[must_use]
    pub fn reply_from(&self) -> Option<String> {
        self.str_at(&["reply", "reply_from"])
    }
    /// The accepting socket's `IP_TTL` / `IPV6_UNICAST_HOPS`.
    #[must_use]
    pub fn server_ttl(&self) -> Option<u64> {
        self.0["reply"]["ttl"].as_u64()
    }
    /// The `SO_ORIGINAL_DST` error of an accepting socket that has no original destination.
    #[must_use]
    pub fn orig_error(&self) -> Option<String> {
        self.str_at(&["reply", "orig", "error"])
    }
    /// The client's `getpeername()`.
    #[must_use]
    pub fn client_peer(&self) -> Option<String> {
        self.str_at(&["peer"])
    }
    /// The client's `getsockname()`.
    #[must_use]
    pub fn client_local(&self) -> Option<String> {
        self.str_at(&["local"])
    }
    /// The client's own address and the peer the accepting listener saw, if both are known and
    /// differ (v4-mapped addresses read as IPv4): one connection, seen from its two ends.
    #[must_use]
    pub fn ends_disagree(&self) -> Option<(String, String)> {
        let (local, peer) = (self.client_local()?, self.peer_seen()?);
        (unmapped(&local)? != unmapped(&peer)?).then_some((local, peer))
    }
}

/// `ADDR:PORT` with a v4-mapped IPv6 address read as the IPv4 one.
fn unmapped(addr: &str) -> Option<std::net::SocketAddr> {
    let a: std::net::SocketAddr = addr.parse().ok()?;
    Some(match a.ip() {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, |v4| (v4, a.port()).into()),
        std::net::IpAddr::V4(_) => a,
    })
}

/// The IP part of `ADDR:PORT` / `[ADDR]:PORT`.
#[must_use]
pub fn ip_of(addr: &str) -> String {
    addr.parse::<std::net::SocketAddr>()
        .map_or_else(|_| addr.to_string(), |a| a.ip().to_string())
}

/// A probe command that enters `netns` (and `cgroup`, if given) as `who`.
#[must_use]
pub fn probe_in(
    netns: &std::path::Path,
    cgroup: Option<&std::path::Path>,
    who: Option<&Who>,
) -> Command {
    let mut cmd = Command::new(probe_bin());
    if let Some(cg) = cgroup {
        cmd.arg("--cgroup").arg(cg);
    }
    cmd.arg("--netns").arg(netns);
    if let Some(w) = who {
        w.args(&mut cmd);
    }
    cmd
}

/// Probes that stay up for many connects: one `capture-probe session` per place and identity,
/// instead of a process per connect, which costs 0.2 s under the kernel matrix's emulation
/// (45% of a parity scenario's time on 5.10). Only for connects that need nothing of the process
/// beyond its place and identity (no source bound, no ids switched for the socket's creation, no
/// socket marks); the others start a probe of their own. Their processes end when this is
/// dropped: hold it only while a pod's cases run, so that no probe keeps its netns or cgroup
/// busy after.
#[derive(Default)]
pub struct Sessions(std::sync::Mutex<Vec<(Vec<std::ffi::OsString>, crate::guards::ChildGuard)>>);

impl Sessions {
    /// As `connect_opts` from wherever `cmd` enters.
    pub fn connect(&self, mut cmd: Command, to: &str, opts: &ConnectOpts) -> Outcome {
        let fits = opts.bind.is_none()
            && opts.create_as.is_none()
            && !opts.transparent
            && opts.mark.is_none();
        if !fits {
            return connect_opts(cmd, to, opts);
        }
        let key: Vec<std::ffi::OsString> = cmd.get_args().map(ToOwned::to_owned).collect();
        let mut sessions = self.0.lock().expect("probe sessions");
        let i = sessions
            .iter()
            .position(|(k, _)| *k == key)
            .unwrap_or_else(|| {
                cmd.arg("session");
                sessions.push((key, crate::guards::ChildGuard::spawn_ready(&mut cmd)));
                sessions.len() - 1
            });
        let request = serde_json::json!({ "to": to, "udp": opts.udp, "v6_socket": opts.v6_socket });
        Outcome::parse(&sessions[i].1.ask(&request.to_string()))
    }
}

/// Runs a probe `connect` (from wherever `cmd` enters) and parses its outcome.
pub fn connect_with(cmd: Command, to: &str) -> Outcome {
    connect_opts(cmd, to, &ConnectOpts::default())
}

/// As `connect_with`, with options.
pub fn connect_opts(cmd: Command, to: &str, opts: &ConnectOpts) -> Outcome {
    try_connect_opts(cmd, to, opts).unwrap_or_else(|e| panic!("{e}"))
}

/// As `connect_opts`, with the probe's failure (or its start's) as an error rather than a
/// panic: for callers that count failures, such as traffic kept up through an upgrade.
pub fn try_connect_opts(mut cmd: Command, to: &str, opts: &ConnectOpts) -> Result<Outcome, String> {
    cmd.arg("connect").arg("--to").arg(to);
    opts.args(&mut cmd);
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "probe failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(Outcome::parse(&String::from_utf8_lossy(&out.stdout)))
}
