//! A real transparent proxy as a pod's sidecar: Debian's HAProxy, run inside the pod as the
//! proxy's uid, forwarding each connection to its original destination (`server … 0.0.0.0:0`,
//! which HAProxy reads with `SO_ORIGINAL_DST` on IPv4) and logging, per connection, the client
//! it accepted and the destination it forwarded to. None of capture's code or the probe's is on
//! its side of the connection, so what it logs is what any proxy would see. The benchmark runs it
//! with HAProxy's defaults instead (`default_sidecar_config`), which log nothing.

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    sync::mpsc::{self, Receiver},
    time::{Duration, Instant},
};

use crate::probe::{probe_in, Who};

/// The source Istio's inbound passthrough connects from, which the capture rules let through.
pub const INBOUND_PASSTHROUGH_SRC: &str = "127.0.0.6";

/// The sidecar's listeners, where capture sends the pod's outbound and inbound connections.
pub const OUTBOUND_PORT: u16 = 15001;
pub const INBOUND_PORT: u16 = 15006;

/// What HAProxy logged for one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    /// The frontend that accepted it (`outbound` or `inbound`).
    pub frontend: String,
    /// The client's address as HAProxy's `accept()` gave it.
    pub client: String,
    /// The destination it forwarded to (its `SO_ORIGINAL_DST`).
    pub destination: String,
}

/// The running HAProxy; killed, and its configuration removed, on drop.
pub struct Haproxy {
    child: Child,
    dir: PathBuf,
    lines: Receiver<String>,
    /// Its standard error, where it says why it did not start.
    errors: PathBuf,
}

/// How long HAProxy may take to listen: a bound, not a measure. Its start-up is slow under
/// emulation: 7.4 s to listen in an idle 5.10 guest on the reference machine (2026-12-03), and
/// CI's slowest machines emulate more than twice as slowly, beside other VMs; the kernel matrix's
/// 5.10 failure of an earlier CI run was a deadline shorter than that.
const LISTEN_PATIENCE: Duration = Duration::from_secs(90);

fn config(outbound_port: u16, inbound_port: u16) -> String {
    format!(
        "global\n  log stdout format raw local0\n  maxconn 256\n  nbthread 1\n\
         defaults\n  mode tcp\n  log global\n  timeout connect 5s\n  timeout client 10s\n  timeout server 10s\n\
         listen outbound\n  bind 0.0.0.0:{outbound_port}\n  log-format \"outbound %ci:%cp %fi:%fp\"\n\
         \x20 server original 0.0.0.0:0\n\
         listen inbound\n  bind 0.0.0.0:{inbound_port}\n  log-format \"inbound %ci:%cp %fi:%fp\"\n\
         \x20 server original 0.0.0.0:0 source {INBOUND_PASSTHROUGH_SRC}\n"
    )
}

/// A sidecar with HAProxy's defaults but for what transparent forwarding needs: TCP mode, the
/// outbound listener and the original-destination server. The timeouts only bound idle
/// connections and connects (HAProxy warns without them); everything else (threads, maxconn,
/// buffers, no logging) is HAProxy's default. The benchmark's sidecar (`--real-proxy`).
#[must_use]
pub fn default_sidecar_config() -> String {
    format!(
        "defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\n\n\
         listen outbound\n  bind 0.0.0.0:{OUTBOUND_PORT}\n  server original 0.0.0.0:0\n"
    )
}

/// Is a TCP socket of the netns `/proc/<pid>/net/tcp` shows listening on `port`?
fn listening(pid: u32, port: u16) -> bool {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    let local = format!(":{port:04X}");
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() > 3 && fields[1].ends_with(&local) && fields[3] == "0A"
    })
}

/// The first line of `haproxy FLAG`'s output that `wanted` takes, trimmed; empty when haproxy
/// cannot be run or says no such line.
fn said_by_haproxy(flag: &str, wanted: impl Fn(&str) -> bool) -> String {
    std::process::Command::new("haproxy")
        .arg(flag)
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| wanted(l))
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

impl Haproxy {
    /// Starts HAProxy in the pod (netns and cgroup) as `who`, listening on the outbound and
    /// inbound ports, and waits until both listen.
    #[must_use]
    pub fn start_in_pod(netns: &Path, cgroup: &Path, who: &Who) -> Self {
        Self::logging(netns, cgroup, who, None)
    }

    /// As [`Self::start_in_pod`], with [`default_sidecar_config`]: no log, no inbound listener,
    /// HAProxy's defaults.
    #[must_use]
    pub fn start_default_sidecar(netns: &Path, cgroup: &Path, who: &Who) -> Self {
        Self::start_in_pod_with(
            netns,
            cgroup,
            who,
            &default_sidecar_config(),
            &[OUTBOUND_PORT],
            None,
        )
    }

    /// As [`Self::start_in_pod`], started from `dir` (a checkout's directory that the proxy's
    /// uid may not enter, as one under /root).
    #[must_use]
    pub fn start_in_pod_from(netns: &Path, cgroup: &Path, who: &Who, dir: &Path) -> Self {
        Self::logging(netns, cgroup, who, Some(dir))
    }

    /// The logging sidecar, on both listeners, started from `started_from` where given.
    fn logging(netns: &Path, cgroup: &Path, who: &Who, started_from: Option<&Path>) -> Self {
        Self::start_in_pod_with(
            netns,
            cgroup,
            who,
            &config(OUTBOUND_PORT, INBOUND_PORT),
            &[OUTBOUND_PORT, INBOUND_PORT],
            started_from,
        )
    }

    fn start_in_pod_with(
        netns: &Path,
        cgroup: &Path,
        who: &Who,
        config: &str,
        ports: &[u16],
        started_from: Option<&Path>,
    ) -> Self {
        let dir = std::env::temp_dir().join(crate::unique("capture-haproxy"));
        std::fs::create_dir_all(&dir).expect("the HAProxy directory");
        let file = dir.join("haproxy.cfg");
        std::fs::write(&file, config).expect("the HAProxy configuration");
        let errors = dir.join("stderr");
        let stderr = std::fs::File::create(&errors).expect("HAProxy's stderr file");
        let mut cmd = probe_in(netns, Some(cgroup), Some(who));
        if let Some(dir) = started_from {
            cmd.current_dir(dir);
        }
        cmd.arg("exec")
            .arg("--")
            .args(["haproxy", "-db", "-f"])
            .arg(&file)
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut proxy = Self {
            child,
            dir,
            lines,
            errors,
        };
        proxy.wait_listening(ports);
        proxy
    }

    /// HAProxy's process (its threads are its tasks), to place on CPUs.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The first line of `haproxy -v` (`HAProxy version 2.6.12-1+deb12u4 …`).
    #[must_use]
    pub fn version() -> String {
        said_by_haproxy("-v", |_| true)
    }

    /// What `haproxy -vv` says of its threads (`Built with multi-threading support (…,
    /// default=2).`): how many it runs when its configuration does not say.
    #[must_use]
    pub fn threads() -> String {
        said_by_haproxy("-vv", |l| l.contains("multi-threading"))
    }

    fn wait_listening(&mut self, ports: &[u16]) {
        let pid = self.child.id();
        let deadline = Instant::now() + LISTEN_PATIENCE;
        while !ports.iter().all(|p| listening(pid, *p)) {
            let exited = self.child.try_wait().ok().flatten();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "HAProxy did not listen on {ports:?} within {LISTEN_PATIENCE:?} (exited: \
                 {exited:?}; is it installed? `cargo xtask setup` installs Debian's haproxy); \
                 it said: {}",
                self.said()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What HAProxy wrote to its standard error so far.
    #[must_use]
    pub fn said(&self) -> String {
        std::fs::read_to_string(&self.errors).unwrap_or_default()
    }

    /// The next connection HAProxy logs, within `patience`. Lines not of the connection log's
    /// format (a notice of HAProxy's own) are passed over.
    #[must_use]
    pub fn next_logged(&self, patience: Duration) -> Option<Logged> {
        let deadline = Instant::now() + patience;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let line = self.lines.recv_timeout(left).ok()?;
            if let [frontend @ ("outbound" | "inbound"), client, destination] =
                line.split_whitespace().collect::<Vec<_>>()[..]
            {
                return Some(Logged {
                    frontend: frontend.to_string(),
                    client: client.to_string(),
                    destination: destination.to_string(),
                });
            }
        }
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
