//! The DaemonSet's own pod (deploy/capture.yaml, read by [`crate::daemonset`]) as kubelet would
//! ask containerd for it: a sandbox in the node's namespaces the manifest names (network; PID
//! only with hostPID), privileged only if a container is; its init containers run to completion
//! in order, then its containers; each with the manifest's command line, environment, security
//! context (capabilities, read-only root, seccomp and `AppArmor` profiles) and mounts.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use k8s_cri::v1::{
    security_profile::ProfileType, Capability, ContainerConfig, Int64Value, KeyValue,
    LinuxContainerConfig, LinuxContainerSecurityContext, Mount, MountPropagation, NamespaceMode,
    NamespaceOption, PodSandboxConfig, SecurityProfile,
};

use super::{config::named_container, Containerd, PodSpec};
use crate::{
    cni::Node,
    daemonset::{ContainerSpec, NodeAgentPod},
};

/// The DaemonSet's pod, running: its sandbox and its containers by name.
pub struct NodeAgentRun {
    pub id: String,
    pub config: PodSandboxConfig,
    pub containers: Vec<(String, String)>,
}

impl Containerd {
    /// Runs the DaemonSet's pod as kubelet does: the sandbox, each init container to a zero exit
    /// (in order), then the containers. Panics with the runtime's log on a failure; None (the
    /// test skips, saying why) where runc cannot start a container at all for the one reason the
    /// kernel matrix knows of (`Feature::RuncClonedBinary`).
    pub fn run_node_agent(&self, pod: &NodeAgentPod, name: &str) -> Option<NodeAgentRun> {
        let spec = PodSpec {
            name,
            namespace: "istio-system",
            annotations: &[],
            proxy: false,
        };
        let config = sandbox(pod, self.prepare_pod(&spec));
        // The CRI client is released before a failure panics (its drop asks it again).
        let result = self.cri().run_pod(&config);
        let id = match result {
            Ok(id) => id,
            Err(e) => {
                let log = self.log_tail();
                if log.contains("could not ensure we are a cloned binary") {
                    crate::kernel::record_skip(
                        crate::kernel::Feature::RuncClonedBinary,
                        "runc could not re-execute itself from a sealed copy here",
                    );
                    return None;
                }
                panic!("RunPodSandbox {name}: {e}\n{log}")
            }
        };
        let mut containers = Vec::new();
        for c in &pod.init_containers {
            let cid = self.start_container_of(&id, &config, pod, c);
            self.wait_exit_zero(&cid, &c.name, &config);
            containers.push((c.name.clone(), cid));
        }
        for c in &pod.containers {
            containers.push((
                c.name.clone(),
                self.start_container_of(&id, &config, pod, c),
            ));
        }
        Some(NodeAgentRun {
            id,
            config,
            containers,
        })
    }

    fn start_container_of(
        &self,
        id: &str,
        config: &PodSandboxConfig,
        pod: &NodeAgentPod,
        c: &ContainerSpec,
    ) -> String {
        let result = self.cri().start_container(id, &container(pod, c), config);
        result.unwrap_or_else(|e| panic!("starting {}: {e}\n{}", c.name, self.log_tail()))
    }

    /// Waits until a container has exited, and asserts that it exited 0.
    fn wait_exit_zero(&self, cid: &str, name: &str, config: &PodSandboxConfig) {
        const EXITED: i32 = k8s_cri::v1::ContainerState::ContainerExited as i32;
        let what = format!("{name} to exit");
        let code = crate::wait::wait_until(std::time::Duration::from_mins(2), &what, || {
            let (state, code) = self.cri().container_state(cid).expect("ContainerStatus");
            if state == EXITED {
                Ok(code)
            } else {
                Err(self.log_tail())
            }
        });
        let log =
            std::fs::read_to_string(Path::new(&config.log_directory).join(format!("{name}.log")))
                .unwrap_or_default();
        assert_eq!(code, 0, "{name} exited {code}: {log}");
    }
    /// Starts a containerd (cgroupfs) that sees the node's directories where a node has them,
    /// for the DaemonSet's pod and its hostPath volumes: the node's CNI bin and configuration
    /// directories at /opt/cni/bin and /etc/cni/net.d, its capture state directory at
    /// /run/capture, and `bpffs` (a directory on the bpf filesystem) at /sys/fs/bpf, shared so
    /// that a `HostToContainer` mount of it is allowed. Everything else (/proc among them, which
    /// the DaemonSet mounts at /host/proc) is the host's: containerd's mount namespace is a copy
    /// of the host's, and its PID namespace the host's.
    #[must_use]
    pub fn start_as_node(node: &Node, bpffs: &Path) -> Self {
        std::fs::create_dir_all(&node.dirs.state).expect("the node's state directory");
        let sources = [
            node.plugin_dir.clone(),
            node.conf_dir(),
            node.dirs.state.clone(),
            bpffs.to_path_buf(),
        ];
        let binds: Vec<(PathBuf, PathBuf)> = sources
            .into_iter()
            .zip(NODE_MOUNT_POINTS.map(PathBuf::from))
            .collect();
        let mut points = BIND_POINTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (_, target) in &binds {
            let missing: Vec<&Path> = target.ancestors().take_while(|p| !p.exists()).collect();
            points
                .made
                .extend(missing.into_iter().rev().map(Path::to_path_buf));
            std::fs::create_dir_all(target).expect("a mount point");
        }
        points.users += 1;
        drop(points);
        Self::start_inner(node, None, binds)
    }
}

pub use crate::kernel::NODE_MOUNT_POINTS;

/// The mount points the host lacked for the node runtimes' binds, outermost first, and how many
/// such runtimes run. Only the last to stop removes them: removing a directory another mount
/// namespace has a mount on detaches that mount there (tests run side by side).
struct BindPoints {
    made: Vec<PathBuf>,
    users: usize,
}

static BIND_POINTS: std::sync::Mutex<BindPoints> = std::sync::Mutex::new(BindPoints {
    made: Vec::new(),
    users: 0,
});

/// A node runtime stopped: the last one removes the mount points made for them all.
pub(super) fn release_bind_points() {
    let mut points = BIND_POINTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    points.users = points.users.saturating_sub(1);
    if points.users == 0 {
        for dir in std::mem::take(&mut points.made).iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Makes `cmd` (nsenter, so far) start containerd in a mount namespace of its own where each
/// source directory is bind-mounted at its node path.
pub(super) fn with_binds(cmd: &mut Command, binds: &[(PathBuf, PathBuf)], config: &Path) {
    // Every path is the test's own (no quotes inside), quoted for the shell.
    // Every mount is made shared in this namespace (its changes still never reach the host's,
    // whose slaves they are), before the binds and after: containerd lets a hostPath mount
    // propagate (HostToContainer, Bidirectional) only from a shared source, and checks the
    // mount it finds first at the path.
    let mut script = String::from("set -e\nmount --make-rshared /\n");
    for (source, target) in binds {
        script.push_str(&format!(
            "mount --bind '{s}' '{t}'\n",
            s = source.display(),
            t = target.display()
        ));
    }
    script.push_str("mount --make-rshared /\n");
    script.push_str(&format!(
        "exec containerd --config '{}'\n",
        config.display()
    ));
    cmd.args(["unshare", "--mount", "--propagation", "slave", "bash", "-c"])
        .arg(script);
}

/// The namespaces of a pod with `hostNetwork` and `hostPID`.
fn host_namespaces(pod: &NodeAgentPod) -> NamespaceOption {
    let mode = |host: bool| {
        if host {
            NamespaceMode::Node as i32
        } else {
            NamespaceMode::Pod as i32
        }
    };
    NamespaceOption {
        network: mode(pod.host_network),
        pid: mode(pod.host_pid),
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// Turns a sandbox config into the DaemonSet pod's: the host's namespaces the manifest asks for,
/// privileged only if one of its containers is (kubelet's rule), and the pod's seccomp profile.
pub fn sandbox(pod: &NodeAgentPod, mut config: PodSandboxConfig) -> PodSandboxConfig {
    // kubelet sends no hostname for a pod on the node's network (its UTS namespace is the
    // node's, which runc will not rename).
    if pod.host_network {
        config.hostname.clear();
    }
    let linux = config.linux.get_or_insert_with(Default::default);
    let sc = linux.security_context.get_or_insert_with(Default::default);
    sc.namespace_options = Some(host_namespaces(pod));
    sc.privileged = pod
        .init_containers
        .iter()
        .chain(&pod.containers)
        .any(|c| c.privileged);
    // The sandbox (the pause container) runs under the pod-level profile, as kubelet asks.
    sc.seccomp = profile(pod.seccomp.as_deref());
    config
}

/// A `seccompProfile` or `appArmorProfile` type as the CRI's profile (None: the runtime's
/// choice for an unset one).
fn profile(kind: Option<&str>) -> Option<SecurityProfile> {
    let profile_type = match kind? {
        "RuntimeDefault" => ProfileType::RuntimeDefault,
        "Unconfined" => ProfileType::Unconfined,
        other => panic!("a profile of type {other} is not one the tests give"),
    };
    Some(SecurityProfile {
        profile_type: profile_type as i32,
        localhost_ref: String::new(),
    })
}

/// One container of the pod, as kubelet sends it.
pub fn container(pod: &NodeAgentPod, c: &ContainerSpec) -> ContainerConfig {
    let propagation = |p: &str| match p {
        "Bidirectional" => MountPropagation::PropagationBidirectional,
        "HostToContainer" => MountPropagation::PropagationHostToContainer,
        _ => MountPropagation::PropagationPrivate,
    } as i32;
    ContainerConfig {
        // kubelet passes the expanded command and args; one list is the same to the runtime.
        command: c.argv.clone(),
        envs: c
            .env
            .iter()
            .map(|(key, value)| KeyValue {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        mounts: c
            .mounts
            .iter()
            .map(|m| Mount {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                readonly: m.read_only,
                propagation: propagation(&m.propagation),
                ..Default::default()
            })
            .collect(),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                privileged: c.privileged,
                capabilities: Some(Capability {
                    add_capabilities: c.capabilities_add.clone(),
                    drop_capabilities: c.capabilities_drop.clone(),
                    ..Default::default()
                }),
                run_as_user: c.run_as_user.map(|value| Int64Value { value }),
                no_new_privs: c.allow_privilege_escalation == Some(false),
                readonly_rootfs: c.read_only_root_filesystem,
                seccomp: profile(c.seccomp.as_deref()),
                apparmor: profile(c.apparmor.as_deref()),
                namespace_options: Some(host_namespaces(pod)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..named_container(&c.name, &c.image)
    }
}

/// The status code of `GET path` on `host:port` inside the network namespace at `netns` (the
/// kubelet's httpGet probe of a hostNetwork pod), or None when nothing answers.
#[must_use]
pub fn http_status_in(netns: &Path, host: &str, port: u16, path: &str) -> Option<u16> {
    let netns = netns.to_path_buf();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let addr: std::net::SocketAddr = format!("{host}:{port}").parse().ok()?;
    std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        let file = std::fs::File::open(&netns).ok()?;
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).ok()?;
        let mut stream =
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2)).ok()?;
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .ok()?;
        stream.write_all(request.as_bytes()).ok()?;
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer.split_whitespace().nth(1)?.parse().ok()
    })
    .join()
    .ok()
    .flatten()
}
