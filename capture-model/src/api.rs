//! The agent's protocol on its Unix socket: one JSON request line, one JSON response line. The
//! CNI plugin is its main client; anything root on the node may use it.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    net::IpAddr,
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

use crate::record::PodRef;

pub const DEFAULT_SOCKET: &str = "/run/capture/agent.sock";

/// The largest request line: a pod's annotations with every list at Istio's limits fit in a
/// fraction of it.
pub const MAX_REQUEST: u64 = 1 << 20;

/// A pod to capture, as the CNI plugin knows it during network setup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRequest {
    pub netns: PathBuf,
    pub cgroup: PathBuf,
    pub pod_ips: Vec<IpAddr>,
    pub annotations: BTreeMap<String, String>,
    pub pod: PodRef,
    /// The pod's labels, where the runtime reports them (the reconcile; a CNI ADD has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Capture a pod (CNI ADD).
    Add {
        pod: PodRequest,
        /// When the plugin started ([`plugin_clock_ns`]), so that the agent can export the ADD
        /// as the plugin sees it. Absent from other clients and from earlier plugins.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        plugin_started_ns: Option<u64>,
    },
    /// Release a pod; succeeds when it is not captured (CNI DEL).
    Del {
        container_id: String,
        netns: Option<PathBuf>,
    },
    /// Is capture in force for the pod (CNI CHECK)?
    Check { container_id: String },
    /// Is the agent ready to capture pods (CNI STATUS)?
    Status,
    /// Release every CNI-attached pod not in the list (CNI GC).
    Gc { valid_container_ids: Vec<String> },
    /// A pod Istio injected that capture-cni left alone (ADD), for status and metrics. Older
    /// agents answer it as a bad request; the plugin goes on either way.
    LeftAlone {
        report: crate::left_alone::LeftAlone,
    },
}

/// Why a request failed, so the plugin can pick the CNI error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The agent is up but cannot serve yet (CNI code 11 / 50).
    NotReady,
    /// The pod's annotations or addresses are not acceptable (CNI code 7).
    InvalidConfig,
    /// Capture could not be put in place or is not in force.
    CaptureFailed,
    /// The request itself was malformed.
    BadRequest,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<FailureKind>,
    /// Human-readable outcome ("captured netns … with ebpf", "not captured", …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The backend that captured the pod (a successful ADD).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<crate::record::Mode>,
}

impl Response {
    #[must_use]
    pub fn ok(detail: impl Into<String>) -> Self {
        Self {
            ok: true,
            detail: Some(detail.into()),
            ..Self::default()
        }
    }
    #[must_use]
    pub fn failed(kind: FailureKind, error: impl Into<String>) -> Self {
        Self {
            ok: false,
            error: Some(error.into()),
            kind: Some(kind),
            ..Self::default()
        }
    }
}

/// The clock the plugin's start is told in: `CLOCK_BOOTTIME`, one clock for every process of
/// the node (a container's included; time namespaces, which would offset it, are not used for
/// node agents), ns.
#[must_use]
pub fn plugin_clock_ns() -> Option<u64> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).ok()?;
    u64::try_from(i128::from(now.tv_sec()) * 1_000_000_000 + i128::from(now.tv_nsec())).ok()
}

/// The agent's reading of one request line (the bytes up to and including its newline, at most
/// one byte over [`MAX_REQUEST`] so that an overlong line is told apart): the request, or the
/// answer that refuses it.
pub fn parse_request(line: &[u8]) -> Result<Request, Response> {
    if line.len() as u64 > MAX_REQUEST {
        return Err(Response::failed(
            FailureKind::BadRequest,
            format!("a request line longer than {MAX_REQUEST} bytes"),
        ));
    }
    serde_json::from_slice(line)
        .map_err(|e| Response::failed(FailureKind::BadRequest, format!("unreadable request: {e}")))
}

/// The line a client sends for `request`.
#[must_use]
pub fn request_line(request: &Request) -> String {
    let mut line = serde_json::to_string(request).expect("requests serialise");
    line.push('\n');
    line
}

/// The client's reading of the agent's answer line.
pub fn parse_response(answer: &str) -> Result<Response, serde_json::Error> {
    serde_json::from_str(answer)
}

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("the capture agent socket {path} does not exist: the agent is not running on this node (start the capture DaemonSet)")]
    NoSocket { path: PathBuf },
    #[error(
        "{path} is not a socket; point the plugin's agent_socket at the capture agent's socket"
    )]
    NotSocket { path: PathBuf },
    #[error("cannot reach the capture agent at {path}: {reason}")]
    Unreachable { path: PathBuf, reason: String },
    #[error("the capture agent at {path} did not answer within {secs}s")]
    Timeout { path: PathBuf, secs: u64 },
    #[error("the capture agent at {path} sent an unreadable answer: {reason}")]
    BadAnswer { path: PathBuf, reason: String },
}

/// Sends one request to the agent and waits for its answer.
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Response, CallError> {
    use std::os::unix::fs::FileTypeExt as _;
    let path = socket.to_path_buf();
    match std::fs::metadata(socket) {
        Err(_) => return Err(CallError::NoSocket { path }),
        Ok(m) if !m.file_type().is_socket() => return Err(CallError::NotSocket { path }),
        Ok(_) => {}
    }
    let unreachable = |e: std::io::Error| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            CallError::Timeout {
                path: socket.into(),
                secs: timeout.as_secs(),
            }
        } else {
            CallError::Unreachable {
                path: socket.into(),
                reason: e.to_string(),
            }
        }
    };
    let mut stream = UnixStream::connect(socket).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(unreachable)?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(unreachable)?;
    // An agent that turns the client away (too many clients) may answer and close before the
    // request is in: the write then fails, but the answer is there to read.
    let written = stream.write_all(request_line(request).as_bytes());
    let mut answer = String::new();
    let read = BufReader::new(&stream).read_line(&mut answer);
    if answer.is_empty() {
        written.map_err(unreachable)?;
        read.map_err(unreachable)?;
        return Err(CallError::Unreachable {
            path,
            reason: "the agent closed the connection".into(),
        });
    }
    parse_response(&answer).map_err(|e| CallError::BadAnswer {
        path,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz seeds are lines as capture-cni and the agent write them: requests, and the
    /// agent's answers (`answer-*`).
    #[test]
    fn the_fuzz_seeds_are_protocol_lines() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/socket_request");
        let mut ops = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let line = std::fs::read_to_string(&path).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("answer-") {
                parse_response(&line).unwrap_or_else(|e| panic!("{name}: {e}"));
            } else {
                let request =
                    parse_request(line.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e:?}"));
                assert_eq!(request_line(&request), line, "{name}");
                let value: serde_json::Value = serde_json::from_str(&line).unwrap();
                ops.push(value["op"].as_str().unwrap().to_string());
            }
        }
        ops.sort();
        ops.dedup();
        assert_eq!(ops, ["add", "check", "del", "gc", "left_alone", "status"]);
    }

    #[test]
    fn overlong_and_unreadable_lines_are_refused() {
        let long = vec![b' '; usize::try_from(MAX_REQUEST).unwrap() + 1];
        let refusal = parse_request(&long).unwrap_err();
        assert_eq!(refusal.kind, Some(FailureKind::BadRequest));
        assert!(refusal.error.unwrap().contains("longer than"));
        let refusal = parse_request(b"{\"op\":\"launch\"}\n").unwrap_err();
        assert!(refusal.error.unwrap().starts_with("unreadable request"));
    }
}
