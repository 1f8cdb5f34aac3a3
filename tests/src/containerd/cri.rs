//! A blocking CRI client: the kubelet's side of the runtime API (the `k8s-cri` crate's v1 gRPC
//! client, over containerd's Unix socket), with one current-thread tokio runtime per client.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::{
    image_service_client::ImageServiceClient, runtime_service_client::RuntimeServiceClient,
    ContainerConfig, CreateContainerRequest, ExecSyncRequest, ExecSyncResponse, ImageSpec,
    ImageStatusRequest, ListContainersRequest, ListPodSandboxRequest, PodSandbox, PodSandboxConfig,
    PodSandboxStatusRequest, PodSandboxStatusResponse, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StatusRequest, StopPodSandboxRequest,
    VersionRequest,
};
use tokio::{net::UnixStream, runtime::Runtime};
use tonic::{
    transport::{Channel, Endpoint, Uri},
    Status,
};

pub struct Cri {
    rt: Runtime,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
}

impl Cri {
    /// A client of the CRI socket at `socket`.
    pub fn connect(socket: &Path) -> Result<Self, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("a tokio runtime: {e}"))?;
        let socket: PathBuf = socket.to_path_buf();
        // The URI is never dialled: every connection goes to the socket, made at the first call
        // (and again after containerd restarts).
        let channel = rt
            .block_on(async {
                Endpoint::try_from("http://[::]:0").map(|endpoint| {
                    endpoint.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                        let socket = socket.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(
                                UnixStream::connect(socket).await?,
                            ))
                        }
                    }))
                })
            })
            .map_err(|e| format!("the CRI endpoint: {e}"))?;
        Ok(Self {
            rt,
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
        })
    }

    /// The runtime's name and version, e.g. ("containerd", "1.6.20~ds1").
    pub fn version(&mut self) -> Result<(String, String), Status> {
        let v = self
            .rt
            .block_on(self.runtime.version(VersionRequest::default()))?
            .into_inner();
        Ok((v.runtime_name, v.runtime_version))
    }

    /// The CNI configuration the runtime has loaded, as its verbose status gives it (containerd's
    /// `cniconfig`): it reloads the directory on change, a little after the file is written.
    pub fn loaded_cni_config(&mut self) -> Result<String, Status> {
        let status = self
            .rt
            .block_on(self.runtime.status(StatusRequest { verbose: true }))?
            .into_inner();
        Ok(status.info.get("cniconfig").cloned().unwrap_or_default())
    }

    /// Whether the runtime has `image`.
    pub fn has_image(&mut self, image: &str) -> Result<bool, Status> {
        let req = ImageStatusRequest {
            image: Some(image_spec(image)),
            verbose: false,
        };
        let status = self
            .rt
            .block_on(self.images.image_status(req))?
            .into_inner();
        Ok(status.image.is_some())
    }

    pub fn run_pod(&mut self, config: &PodSandboxConfig) -> Result<String, Status> {
        let req = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        };
        Ok(self
            .rt
            .block_on(self.runtime.run_pod_sandbox(req))?
            .into_inner()
            .pod_sandbox_id)
    }

    pub fn pod_status(&mut self, pod: &str) -> Result<PodSandboxStatusResponse, Status> {
        let req = PodSandboxStatusRequest {
            pod_sandbox_id: pod.to_string(),
            verbose: true,
        };
        Ok(self
            .rt
            .block_on(self.runtime.pod_sandbox_status(req))?
            .into_inner())
    }

    pub fn list_pods(&mut self) -> Result<Vec<PodSandbox>, Status> {
        Ok(self
            .rt
            .block_on(
                self.runtime
                    .list_pod_sandbox(ListPodSandboxRequest::default()),
            )?
            .into_inner()
            .items)
    }

    /// Creates and starts a container in `pod`; its id.
    pub fn start_container(
        &mut self,
        pod: &str,
        config: &ContainerConfig,
        sandbox: &PodSandboxConfig,
    ) -> Result<String, Status> {
        let req = CreateContainerRequest {
            pod_sandbox_id: pod.to_string(),
            config: Some(config.clone()),
            sandbox_config: Some(sandbox.clone()),
        };
        let id = self
            .rt
            .block_on(self.runtime.create_container(req))?
            .into_inner()
            .container_id;
        let req = StartContainerRequest {
            container_id: id.clone(),
        };
        self.rt.block_on(self.runtime.start_container(req))?;
        Ok(id)
    }

    /// The container's state (`ContainerState` as i32) and, once it has exited, its exit code.
    pub fn container_state(&mut self, container: &str) -> Result<(i32, i32), Status> {
        let req = k8s_cri::v1::ContainerStatusRequest {
            container_id: container.to_string(),
            verbose: false,
        };
        let status = self
            .rt
            .block_on(self.runtime.container_status(req))?
            .into_inner()
            .status
            .unwrap_or_default();
        Ok((status.state, status.exit_code))
    }

    /// The host PID of a running container's process (from the runtime's verbose status).
    pub fn container_pid(&mut self, container: &str) -> Result<Option<u32>, Status> {
        let req = k8s_cri::v1::ContainerStatusRequest {
            container_id: container.to_string(),
            verbose: true,
        };
        let info = self
            .rt
            .block_on(self.runtime.container_status(req))?
            .into_inner()
            .info;
        Ok(info
            .get("info")
            .and_then(|i| serde_json::from_str::<serde_json::Value>(i).ok())
            .and_then(|i| u32::try_from(i["pid"].as_u64()?).ok())
            .filter(|pid| *pid > 0))
    }

    /// The ids of the containers of `pod`.
    pub fn containers_of(&mut self, pod: &str) -> Result<Vec<String>, Status> {
        let req = ListContainersRequest {
            filter: Some(k8s_cri::v1::ContainerFilter {
                pod_sandbox_id: pod.to_string(),
                ..Default::default()
            }),
        };
        Ok(self
            .rt
            .block_on(self.runtime.list_containers(req))?
            .into_inner()
            .containers
            .into_iter()
            .map(|c| c.id)
            .collect())
    }

    /// Runs `cmd` in `container` (as the container's user, in its cgroup and namespaces) and
    /// waits for it.
    pub fn exec(&mut self, container: &str, cmd: &[&str]) -> Result<ExecSyncResponse, Status> {
        let req = ExecSyncRequest {
            container_id: container.to_string(),
            cmd: cmd.iter().map(ToString::to_string).collect(),
            timeout: 60,
        };
        Ok(self.rt.block_on(self.runtime.exec_sync(req))?.into_inner())
    }

    pub fn stop_pod(&mut self, pod: &str) -> Result<(), Status> {
        let req = StopPodSandboxRequest {
            pod_sandbox_id: pod.to_string(),
        };
        self.rt.block_on(self.runtime.stop_pod_sandbox(req))?;
        Ok(())
    }

    /// `StopContainer` (no grace: the probe ends on SIGTERM) then `RemoveContainer`.
    pub fn remove_container(&mut self, container: &str) -> Result<(), Status> {
        let req = k8s_cri::v1::StopContainerRequest {
            container_id: container.to_string(),
            timeout: 0,
        };
        self.rt.block_on(self.runtime.stop_container(req))?;
        let req = k8s_cri::v1::RemoveContainerRequest {
            container_id: container.to_string(),
        };
        self.rt.block_on(self.runtime.remove_container(req))?;
        Ok(())
    }

    pub fn remove_pod(&mut self, pod: &str) -> Result<(), Status> {
        let req = RemovePodSandboxRequest {
            pod_sandbox_id: pod.to_string(),
        };
        self.rt.block_on(self.runtime.remove_pod_sandbox(req))?;
        Ok(())
    }
}

#[must_use]
pub fn image_spec(image: &str) -> ImageSpec {
    ImageSpec {
        image: image.to_string(),
        ..Default::default()
    }
}
