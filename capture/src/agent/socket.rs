//! The agent's Unix socket, which capture-cni talks to: one JSON request line, one JSON response
//! line per connection.
//!
//! Only root may use it: the socket file is 0600, and a client that reaches it all the same
//! (through a mount that loosened the mode, or with `CAP_DAC_OVERRIDE` under another uid) is turned
//! away by its `SO_PEERCRED` uid. A client cannot hold the agent's resources: its request line must
//! arrive within [`REQUEST_TIMEOUT`] and be at most [`MAX_REQUEST`] bytes, and at most
//! [`MAX_CLIENTS`] are served at once (the others are answered that the agent is busy, which
//! capture-cni reports as "try again later").

use std::{io, os::unix::fs::PermissionsExt as _, path::Path, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
    sync::Semaphore,
};
use tracing::{debug, warn};

use super::Agent;
use crate::api::{parse_request, FailureKind, Response, MAX_REQUEST};
/// How long a client has to send its request line.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Clients served at once: far more than the CNI ADDs a node runs at a time.
pub const MAX_CLIENTS: usize = 64;

/// The slots of the clients being served.
pub struct Clients(Arc<Semaphore>);

impl Clients {
    pub fn new() -> Self {
        Self(Arc::new(Semaphore::new(MAX_CLIENTS)))
    }
}

/// Serves `stream` on a task of its own.
pub fn spawn_client(agent: Arc<Agent>, stream: UnixStream, clients: &Clients) {
    let slot = Arc::clone(&clients.0).try_acquire_owned();
    tokio::spawn(async move {
        let result = if let Ok(_slot) = slot {
            serve(agent, stream).await
        } else {
            let busy = Response::failed(
                FailureKind::NotReady,
                format!("the agent is serving {MAX_CLIENTS} clients already; try again"),
            );
            respond(stream, &busy).await
        };
        if let Err(e) = result {
            debug!(error = %e, "socket client");
        }
    });
}

async fn serve(agent: Arc<Agent>, mut stream: UnixStream) -> io::Result<()> {
    if let Some(refused) = refusal(&stream) {
        warn!(reason = %refused, "refused a socket client");
        return respond(stream, &Response::failed(FailureKind::BadRequest, refused)).await;
    }
    let mut line = Vec::new();
    let read = {
        let (read_half, _) = stream.split();
        let mut reader = BufReader::new(read_half).take(MAX_REQUEST + 1);
        tokio::time::timeout(REQUEST_TIMEOUT, reader.read_until(b'\n', &mut line)).await
    };
    let response = match read {
        Err(_) => Response::failed(
            FailureKind::BadRequest,
            format!("no request line within {REQUEST_TIMEOUT:?}"),
        ),
        Ok(Err(e)) => return Err(e),
        Ok(Ok(_)) => match parse_request(&line) {
            Ok(request) => tokio::task::spawn_blocking(move || agent.handle(request))
                .await
                .unwrap_or_else(|e| {
                    Response::failed(FailureKind::CaptureFailed, format!("internal error: {e}"))
                }),
            Err(refused) => refused,
        },
    };
    respond(stream, &response).await
}

/// Why the peer may not use the socket, if it may not: anyone but root.
fn refusal(stream: &UnixStream) -> Option<String> {
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == 0 => None,
        Ok(cred) => Some(format!(
            "only root may use the agent socket (this client runs as uid {})",
            cred.uid()
        )),
        Err(e) => Some(format!("the client's credentials are unreadable: {e}")),
    }
}

async fn respond(mut stream: UnixStream, response: &Response) -> io::Result<()> {
    let mut out = serde_json::to_string(response).expect("responses serialise");
    out.push('\n');
    stream.write_all(out.as_bytes()).await
}

/// Binds the socket, replacing a stale one left by a killed agent, root-only.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "another agent is serving it",
        ));
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}
