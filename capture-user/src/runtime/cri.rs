//! The node's container runtime over CRI (the kubelet's API: `k8s-cri`'s v1 client over the
//! runtime's Unix socket). Every call has a deadline: a runtime that answers slowly is reported
//! as unreachable, never waited for while anything else waits on capture.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::{
    runtime_service_client::RuntimeServiceClient, ContainerEventResponse, ContainerState,
    ContainerStatusRequest, GetEventsRequest, ListPodSandboxRequest, PodSandboxStatusRequest,
    StopPodSandboxRequest, VersionRequest,
};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::sandbox::Sandbox;

/// containerd's CRI socket, the default.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
/// CRI-O's.
pub const CRIO_SOCKET: &str = "/var/run/crio/crio.sock";
/// How long one CRI call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The deadline of `StopPodSandbox`, the kubelet's own for runtime calls.
pub const STOP_TIMEOUT: Duration = Duration::from_mins(2);

#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("the container runtime at {socket} did not answer {call} within {secs} s")]
    Timeout {
        socket: String,
        call: &'static str,
        secs: u64,
    },
    #[error("the container runtime at {socket} failed {call}: {status} (is the CRI socket mounted, and is it the runtime's? --cri-socket names it)")]
    Call {
        socket: String,
        call: &'static str,
        status: String,
    },
    #[error("connecting to the container runtime at {socket}: {why}")]
    Connect { socket: String, why: String },
}

/// A client of one runtime's CRI socket; connections are made at the first call (and again after
/// the runtime restarts).
#[derive(Clone)]
pub struct Cri {
    socket: PathBuf,
    runtime: RuntimeServiceClient<Channel>,
    timeout: Duration,
}

impl Cri {
    /// A client of the CRI socket at `socket`; nothing is dialled yet.
    ///
    /// # Errors
    /// The endpoint cannot be built (never for a path).
    pub fn new(socket: &Path, timeout: Duration) -> Result<Self, CriError> {
        let path = socket.to_path_buf();
        // The URI is never dialled: every connection goes to the socket.
        let channel =
            Endpoint::try_from("http://[::]:0")
                .map_err(|e| CriError::Connect {
                    socket: socket.display().to_string(),
                    why: e.to_string(),
                })?
                .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?))
                    }
                }));
        Ok(Self {
            socket: socket.to_path_buf(),
            runtime: RuntimeServiceClient::new(channel),
            timeout,
        })
    }

    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn call<T>(
        &self,
        call: &'static str,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CriError> {
        self.call_within(self.timeout, call, fut).await
    }

    async fn call_within<T>(
        &self,
        deadline: Duration,
        call: &'static str,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CriError> {
        match tokio::time::timeout(deadline, fut).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(self.refused(call, &status)),
            Err(_) => Err(CriError::Timeout {
                socket: self.socket.display().to_string(),
                call,
                secs: deadline.as_secs(),
            }),
        }
    }

    fn refused(&self, call: &'static str, status: &tonic::Status) -> CriError {
        CriError::Call {
            socket: self.socket.display().to_string(),
            call,
            status: format!("{:?}: {}", status.code(), status.message()),
        }
    }

    /// The runtime's name and version, e.g. ("containerd", "1.6.20~ds1").
    ///
    /// # Errors
    /// The runtime does not answer.
    pub async fn version(&self) -> Result<(String, String), CriError> {
        let mut client = self.runtime.clone();
        let v = self
            .call("Version", client.version(VersionRequest::default()))
            .await?;
        Ok((v.runtime_name, v.runtime_version))
    }

    /// Every pod sandbox of the node as the list gives it (no network yet: see `describe`).
    ///
    /// # Errors
    /// The runtime does not answer the list.
    pub async fn list(&self) -> Result<Vec<Sandbox>, CriError> {
        let mut client = self.runtime.clone();
        let listed = self
            .call(
                "ListPodSandbox",
                client.list_pod_sandbox(ListPodSandboxRequest::default()),
            )
            .await?
            .items;
        Ok(listed.iter().map(Sandbox::listed).collect())
    }

    /// Adds the sandbox's network from its verbose status; false when the runtime no longer has
    /// it.
    ///
    /// # Errors
    /// The runtime does not answer.
    pub async fn describe(&self, sandbox: &mut Sandbox) -> Result<bool, CriError> {
        let mut client = self.runtime.clone();
        let request = PodSandboxStatusRequest {
            pod_sandbox_id: sandbox.id.clone(),
            verbose: true,
        };
        match self
            .call("PodSandboxStatus", client.pod_sandbox_status(request))
            .await
        {
            Ok(status) => {
                sandbox.describe(&status);
                Ok(true)
            }
            Err(CriError::Call { status, .. }) if status.starts_with("NotFound") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Every pod sandbox of the node, each described (a sandbox removed between the list and
    /// its status is left out; one whose status fails is kept without its network).
    ///
    /// # Errors
    /// The runtime does not answer the list.
    pub async fn sandboxes(&self) -> Result<Vec<Sandbox>, CriError> {
        let mut kept = Vec::new();
        for mut sandbox in self.list().await? {
            if !matches!(self.describe(&mut sandbox).await, Ok(false)) {
                kept.push(sandbox);
            }
        }
        Ok(kept)
    }

    /// Stops a sandbox: the kubelet sees it gone and creates the pod's sandbox again, through
    /// the CNI chain.
    ///
    /// # Errors
    /// The runtime does not answer or refuses.
    pub async fn stop_sandbox(&self, id: &str) -> Result<(), CriError> {
        let mut client = self.runtime.clone();
        let request = StopPodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        };
        // Stopping kills the pod's containers and tears its network down: the kubelet gives it
        // minutes (`--runtime-request-timeout`, 2 min); a deadline that cancels it midway would
        // leave the sandbox running.
        self.call_within(
            STOP_TIMEOUT,
            "StopPodSandbox",
            client.stop_pod_sandbox(request),
        )
        .await
        .map(|_| ())
    }
}

/// A container as the runtime names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Container {
    /// Its name in the pod spec.
    pub name: String,
    /// The pod's uid (the kubelet's `io.kubernetes.pod.uid` label), where the runtime keeps it.
    pub pod_uid: Option<String>,
    /// Created or running, not exited.
    pub running: bool,
    /// What it was created with, where asked for.
    pub config: Option<crate::config::ProxyContainerConfig>,
}

impl Cri {
    /// The container `id`, with the configuration it was created with (`verbose` asks the
    /// runtime for it: see `container_config`): `None` when the runtime does not know it.
    ///
    /// # Errors
    /// The runtime does not answer.
    pub async fn container(&self, id: &str, verbose: bool) -> Result<Option<Container>, CriError> {
        let mut client = self.runtime.clone();
        let request = ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose,
        };
        match self
            .call("ContainerStatus", client.container_status(request))
            .await
        {
            Ok(response) => Ok(response.status.map(|status| {
                let name = status.metadata.map(|m| m.name).unwrap_or_default();
                Container {
                    running: matches!(
                        ContainerState::try_from(status.state),
                        Ok(ContainerState::ContainerCreated | ContainerState::ContainerRunning)
                    ),
                    pod_uid: status.labels.get("io.kubernetes.pod.uid").cloned(),
                    config: verbose.then(|| {
                        super::container_config::from_verbose_info(&name, id, &response.info)
                    }),
                    name,
                }
            })),
            Err(CriError::Call { status, .. }) if status.starts_with("NotFound") => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// What `Cri::events` opened.
pub enum Events {
    /// The runtime's stream of container (and sandbox) events.
    Stream(Box<tonic::Streaming<ContainerEventResponse>>),
    /// The runtime has no `GetContainerEvents` (containerd before 1.7).
    Unoffered,
}

impl Cri {
    /// The runtime's container events (`GetContainerEvents`, what the kubelet's evented PLEG
    /// reads), where it offers them. No deadline: a runtime sends the stream's headers with its
    /// first event, which may be long in coming.
    ///
    /// # Errors
    /// The runtime cannot be reached or refuses.
    pub async fn events(&self) -> Result<Events, CriError> {
        let mut client = self.runtime.clone();
        match client.get_container_events(GetEventsRequest {}).await {
            Ok(response) => Ok(Events::Stream(Box::new(response.into_inner()))),
            Err(status) if status.code() == tonic::Code::Unimplemented => Ok(Events::Unoffered),
            Err(status) => Err(self.refused("GetContainerEvents", &status)),
        }
    }
}

/// The sandboxes of the runtime at `socket`, from a thread that has no async runtime (the CLI).
///
/// # Errors
/// As `Cri::sandboxes`, or no runtime could be started.
pub fn sandboxes_blocking(socket: &Path) -> Result<Vec<Sandbox>, CriError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CriError::Connect {
            socket: socket.display().to_string(),
            why: format!("starting an async runtime: {e}"),
        })?;
    rt.block_on(async { Cri::new(socket, CALL_TIMEOUT)?.sandboxes().await })
}
