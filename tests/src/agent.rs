//! The capture agent a test started: its HTTP endpoint (health, readiness, metrics checked as
//! Prometheus takes them) and how it stops.

use std::{
    io::{Read as _, Write as _},
    net::{TcpStream, ToSocketAddrs},
    process::Child,
    time::Duration,
};

/// What the agent's /metrics says it serves: the Prometheus text format, version 0.0.4.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How long an agent may take to answer, and to become ready. Generous: a deadline costs nothing
/// when the agent is quick, and under emulation (the kernel matrix) it is not. On 5.10 a
/// takeover of a node of fifteen pods under traffic, which rebuilds and migrates maps, took about
/// a minute from start to ready with the unoptimized BTF parse of early December 2026, 14 s
/// since (2026-12-03, an idle reference machine); the slowest CI hosts emulate 2.5 times slower,
/// beside another VM, and a deadline that a slow minute passes is a flake, not a finding.
pub const READY_PATIENCE: Duration = Duration::from_mins(5);

/// The running agent, killed on drop.
pub struct Agent {
    pub(crate) child: Option<Child>,
    pub(crate) http: u16,
}

/// One answer of the agent's HTTP endpoint.
pub struct HttpResponse {
    pub code: u16,
    /// Header lines as sent, `Name: value` each.
    pub head: String,
    pub body: String,
}

impl HttpResponse {
    /// The value of header `name` (any case).
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Sends `method path` to `addr` on a new connection that asks to be closed after the answer,
/// and reads the answer to the end; None when the server cannot be reached or answers nothing.
/// A chunked body (Prometheus' larger answers) is put back together.
#[must_use]
pub fn http_request(addr: impl ToSocketAddrs, method: &str, path: &str) -> Option<HttpResponse> {
    let mut s = TcpStream::connect(addr).ok()?;
    // Generous: under emulation, with traffic running, a scrape of many pods takes seconds.
    s.set_read_timeout(Some(Duration::from_mins(1))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let code = resp.split_whitespace().nth(1)?.parse().ok()?;
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let head = head.split_once("\r\n").map_or("", |(_, h)| h);
    let mut resp = HttpResponse {
        code,
        head: head.replace("\r\n", "\n"),
        body: body.to_string(),
    };
    if resp
        .header("transfer-encoding")
        .is_some_and(|te| te.eq_ignore_ascii_case("chunked"))
    {
        resp.body = unchunked(&resp.body)?;
    }
    Some(resp)
}

/// The data of a chunked HTTP/1.1 body: `<hex size>\r\n<data>\r\n` until a zero size.
fn unchunked(mut rest: &str) -> Option<String> {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(body);
        }
        body.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

impl Agent {
    /// A plain TCP connection to the agent's HTTP port.
    #[must_use]
    pub fn connect(&self) -> TcpStream {
        TcpStream::connect(("127.0.0.1", self.http)).expect("connecting to the agent's HTTP port")
    }

    /// Sends `method path` on a new connection and reads the answer to the end (the agent closes
    /// each connection after one response).
    #[must_use]
    pub fn request(&self, method: &str, path: &str) -> Option<HttpResponse> {
        http_request(("127.0.0.1", self.http), method, path)
    }

    /// `GET path` on the agent's HTTP port: (status code, body).
    #[must_use]
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        self.request("GET", path).map(|r| (r.code, r.body))
    }

    /// A scrape of /metrics, checked the way Prometheus would take it: status 200, the content
    /// type of the Prometheus text format, nothing `promtool check metrics` objects to, and each
    /// family's lines in one group.
    #[must_use]
    pub fn checked_metrics(&self) -> String {
        let resp = self.request("GET", "/metrics").expect("scraping /metrics");
        assert_eq!(resp.code, 200, "{}", resp.body);
        assert_eq!(
            resp.header("content-type"),
            Some(METRICS_CONTENT_TYPE),
            "{}",
            resp.head
        );
        let checked = crate::promtool::check_metrics(&resp.body)
            .and_then(|()| crate::promtool::check_grouping(&resp.body));
        if let Err(problems) = checked {
            panic!("{problems}\nin the scrape:\n{}", resp.body);
        }
        resp.body
    }

    /// Waits until /readyz says ready.
    pub fn wait_ready(&self) {
        crate::wait::wait_until(READY_PATIENCE, "the agent to be ready", || {
            match self.get("/readyz") {
                Some((200, _)) => Ok(()),
                Some((code, body)) => Err(format!("{code} {body}")),
                None => Err("no answer".into()),
            }
        });
    }

    /// Waits until the agent answers /readyz at all; its answer.
    #[must_use]
    pub fn wait_answer(&self, path: &str) -> (u16, String) {
        crate::wait::wait_until(
            READY_PATIENCE,
            &format!("the agent to answer {path}"),
            || self.get(path).ok_or_else(|| "no answer".to_string()),
        )
    }

    /// The agent's process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGKILL, as a node under pressure or a crash would.
    pub fn kill_hard(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait, as a rolling update would.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = c.wait();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill_hard();
    }
}
