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

/// A pod to capture, as the CNI plugin knows it during network setup.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodRequest {
    pub netns: PathBuf,
    pub cgroup: PathBuf,
    pub pod_ips: Vec<IpAddr>,
    pub annotations: BTreeMap<String, String>,
    pub pod: PodRef,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Capture a pod (CNI ADD).
    Add { pod: PodRequest },
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

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<FailureKind>,
    /// Human-readable outcome ("captured netns … with ebpf", "not captured", …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
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
    let mut line = serde_json::to_string(request).expect("requests serialise");
    line.push('\n');
    // An agent that turns the client away (too many clients) may answer and close before the
    // request is in: the write then fails, but the answer is there to read.
    let written = stream.write_all(line.as_bytes());
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
    serde_json::from_str(&answer).map_err(|e| CallError::BadAnswer {
        path,
        reason: e.to_string(),
    })
}
