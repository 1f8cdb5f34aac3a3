//! A real container runtime for the end-to-end tests: Debian's containerd (its CRI plugin) and
//! runc, started by the test with root, state, socket and CNI directories of its own, so that a
//! containerd the host runs is never touched. It runs in the test node's netns (only the network
//! namespace: it shares the host's mounts, as a node's containerd does), so the bridge plugin it
//! runs builds the pod network there. Its CNI configuration directory is the node's, where
//! `capture install-cni` chains capture-cni after the reference bridge and host-local plugins.
//!
//! The test plays the kubelet: it creates each pod's cgroup where kubelet would, then drives the
//! runtime through the CRI API (RunPodSandbox, CreateContainer, StartContainer, ExecSync,
//! StopPodSandbox, RemovePodSandbox). Images come from [`image`], imported with `ctr`.
//!
//! Both of kubelet's cgroup drivers: with cgroupfs, the test makes the pod cgroup itself and runc
//! writes cgroupfs directly; with systemd ([`Containerd::start_systemd`]), runc creates every
//! container's scope through systemd, so a systemd runs as PID 1 of namespaces of its own
//! ([`systemd`]) and containerd and the agent run inside them.

mod cleanup;
mod config;
pub mod containers;
pub mod cri;
pub mod image;
pub mod node_agent;
pub mod systemd;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use k8s_cri::v1::{
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, PodSandboxConfig, PodSandboxMetadata,
};
use serde_json::Value;
use tonic::Status;

use self::{
    cleanup::{
        cgroup_v1_mounts, kill_shims_of, mounts_under, remove_cgroup_everywhere, runtime_ended,
        runtime_starts,
    },
    config::{
        allow_slow_attaches, container_config, containerd_config, namespaces, pod_slice,
        setup_tools_path,
    },
    cri::Cri,
    image::PROBE,
    systemd::SystemdNode,
};
use crate::{
    cni::{directory_tree, pod_cgroup_under, pod_uid, remove_cgroup_tree, CgroupDriver, Node},
    probe::Outcome,
    unique,
};

/// The reference plugins the conflist and containerd itself (`loopback`, for the pod's `lo`) run.
const REFERENCE_PLUGINS: &[&str] = &["bridge", "host-local", "loopback"];
/// The app container's identity (any uid but the proxy's).
pub const APP_UID: i64 = 1000;
pub const PROXY_UID: i64 = 1337;

/// A pod as the test asks for it.
pub struct PodSpec<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub annotations: &'a [(&'a str, &'a str)],
    /// Whether the pod has a proxy container (uid 1337) next to its app.
    pub proxy: bool,
}

/// A pod the runtime runs.
pub struct CriPod {
    pub id: String,
    pub name: String,
    pub uid: String,
    pub ip: String,
    /// The pod cgroup (cgroup v2), as kubelet made it.
    pub cgroup: PathBuf,
    /// The network namespace containerd made for it.
    pub netns: PathBuf,
    /// Container ids by name (`app`, and `proxy` when it has one).
    pub containers: BTreeMap<String, String>,
    pub config: PodSandboxConfig,
}

impl CriPod {
    #[must_use]
    pub fn container(&self, name: &str) -> &str {
        self.containers
            .get(name)
            .unwrap_or_else(|| panic!("pod {} has no container {name}", self.name))
    }
}

pub struct Containerd {
    dir: PathBuf,
    socket: PathBuf,
    netns: PathBuf,
    cgroup_mount: PathBuf,
    cgroup_root: PathBuf,
    child: Option<Child>,
    cri: Mutex<Cri>,
    /// Pod cgroups and netns paths made for this runtime's pods, removed on drop if still there.
    made: Mutex<Vec<PathBuf>>,
    /// The systemd managing the node's cgroups (the systemd driver), or None (cgroupfs).
    systemd: Option<SystemdNode>,
    /// Test directories containerd sees at a node's paths (source, node path): it then runs in a
    /// mount namespace of its own, and so do its shims, containers and CNI plugins.
    binds: Vec<(PathBuf, PathBuf)>,
}

impl Containerd {
    /// Starts a containerd for `node` (kubelet's cgroupfs driver) and imports the test images.
    #[must_use]
    pub fn start(node: &Node) -> Self {
        Self::start_with(node, None)
    }

    /// Starts systemd on the node's cgroup tree, then a containerd inside it with the systemd
    /// cgroup driver, and imports the test images. Start the agent with
    /// [`Self::inside`]`(true, capture)`, so that it sees the node's /run and cgroup mount (and
    /// a /proc of its own PID namespace).
    #[must_use]
    pub fn start_systemd(node: &Node) -> Self {
        Self::start_with(node, Some(SystemdNode::boot(&node.cgroup_root)))
    }

    fn start_with(node: &Node, systemd: Option<SystemdNode>) -> Self {
        Self::start_inner(node, systemd, Vec::new())
    }

    fn start_inner(
        node: &Node,
        systemd: Option<SystemdNode>,
        mut binds: Vec<(PathBuf, PathBuf)>,
    ) -> Self {
        // Counted out by drop; a start that fails before the runtime exists leaves the node's
        // fixed directories in place, which is the safe side.
        runtime_starts();
        let dir = std::env::temp_dir().join(unique("capture-containerd"));
        std::fs::create_dir_all(&dir).expect("the containerd directory");
        // A runtime that plays the node's: its socket where a node's containerd has it
        // (/run/containerd/containerd.sock), for a pod that mounts the node's runtime directory
        // (the DaemonSet's cri-socket volume). containerd makes that directory itself anyway.
        if !binds.is_empty() {
            std::fs::create_dir_all("/run/containerd").expect("the runtime's node directory");
            binds.push((dir.clone(), PathBuf::from("/run/containerd")));
        }
        for plugin in REFERENCE_PLUGINS {
            let link = node.plugin_dir.join(plugin);
            if !link.exists() {
                std::os::unix::fs::symlink(Path::new("/usr/lib/cni").join(plugin), link)
                    .expect("linking a reference plugin");
            }
        }
        std::fs::create_dir_all(node.conf_dir()).expect("the CNI configuration directory");
        allow_slow_attaches(&node.conf_dir());
        // runc runs through a wrapper that keeps, for a failure message, the log of each runc
        // command that fails (runc writes it into the container's bundle, which goes with it).
        let runc = setup_tools_path("runc");
        std::fs::create_dir_all(dir.join("bin")).expect("the runtime's bin directory");
        let wrapper = format!(
            "#!/bin/sh\n\
             {runc} --debug \"$@\" && exit 0\n\
             rc=$?\n\
             for a in \"$@\"; do [ \"$prev\" = --log ] && cat \"$a\" >> {log}; prev=$a; done\n\
             exit $rc\n",
            runc = runc.display(),
            log = dir.join("runc-failures.log").display(),
        );
        std::fs::write(dir.join("bin/runc"), wrapper).expect("the runc wrapper");
        std::fs::set_permissions(
            dir.join("bin/runc"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("the runc wrapper's mode");
        let socket = dir.join("containerd.sock");
        std::fs::write(
            dir.join("config.toml"),
            containerd_config(&dir, &socket, node, systemd.is_some()),
        )
        .expect("the containerd configuration");
        let cgroup_mount = capture_user::cgroup::cgroup2_mount().expect("cgroup2");
        let cri = Cri::connect(&socket).expect("a CRI client");
        // Made before anything can fail, so that drop cleans up after a failed start too.
        let mut runtime = Self {
            dir,
            socket,
            netns: node.netns.path(),
            cgroup_mount,
            cgroup_root: node.cgroup_root.clone(),
            child: None,
            cri: Mutex::new(cri),
            made: Mutex::new(Vec::new()),
            systemd,
            binds,
        };
        runtime.child = Some(runtime.spawn());
        runtime.wait_serving();
        runtime.import_images();
        runtime
    }

    /// The runtime's CRI socket.
    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The CRI client.
    pub fn cri(&self) -> MutexGuard<'_, Cri> {
        self.cri.lock().unwrap()
    }

    /// The runtime's name and version as it reports them over CRI.
    #[must_use]
    pub fn version(&self) -> (String, String) {
        self.cri().version().expect("CRI Version")
    }

    /// Stops containerd (SIGTERM, as systemd does on restart) and starts it again on the same
    /// directories; the pods' shims and containers keep running meanwhile.
    pub fn restart(&mut self) {
        self.stop_daemon();
        self.child = Some(self.spawn());
        self.wait_serving();
    }

    /// kubelet's part and the runtime's: [`Self::prepare_pod`], then [`Self::start_pod`].
    pub fn run_pod(&self, spec: &PodSpec<'_>) -> Result<CriPod, Status> {
        let config = self.prepare_pod(spec);
        self.start_pod(spec, &config)
    }

    /// [`Self::run_pod`], or `None` (a recorded skip) where runc cannot start containers here;
    /// any other failure panics with the runtime's log.
    #[must_use]
    pub fn run_pod_or_skip(&self, spec: &PodSpec<'_>) -> Option<CriPod> {
        match self.run_pod(spec) {
            Ok(pod) => Some(pod),
            Err(e)
                if self
                    .log_tail()
                    .contains("could not ensure we are a cloned binary") =>
            {
                crate::kernel::record_skip(
                    crate::kernel::Feature::RuncClonedBinary,
                    "runc cannot re-execute itself here",
                );
                drop(e);
                None
            }
            Err(e) => panic!("RunPodSandbox {}: {e}\n{}", spec.name, self.log_tail()),
        }
    }

    /// What kubelet does before it asks the runtime for a sandbox: a UID, the pod cgroup, and the
    /// sandbox config it sends (the same again on each retry).
    #[must_use]
    pub fn prepare_pod(&self, spec: &PodSpec<'_>) -> PodSandboxConfig {
        let uid = pod_uid();
        // kubelet's systemd driver names the pod's slice; systemd makes its cgroup.
        let parent = if let Some(systemd) = &self.systemd {
            systemd.start_pod_slice(&uid).0
        } else {
            let cgroup = self.pod_cgroup(&uid);
            std::fs::create_dir_all(&cgroup).expect("the pod cgroup");
            let rel = cgroup
                .strip_prefix(&self.cgroup_mount)
                .expect("under the cgroup2 mount");
            Path::new("/").join(rel).display().to_string()
        };
        self.made.lock().unwrap().push(self.pod_cgroup(&uid));
        self.sandbox_config(spec, &uid, parent)
    }

    /// RunPodSandbox with `config`, then the proxy (uid 1337, when the pod has one) and app
    /// (uid 1000) containers, each started and listening.
    pub fn start_pod(
        &self,
        spec: &PodSpec<'_>,
        config: &PodSandboxConfig,
    ) -> Result<CriPod, Status> {
        let uid = config.metadata.as_ref().expect("metadata").uid.clone();
        let cgroup = self.pod_cgroup(&uid);
        self.start_sandbox(spec, uid, cgroup, config.clone())
    }

    fn sandbox_config(&self, spec: &PodSpec<'_>, uid: &str, parent: String) -> PodSandboxConfig {
        let logs = self.dir.join("pods").join(uid);
        std::fs::create_dir_all(&logs).expect("the pod log directory");
        let labels = [
            ("io.kubernetes.pod.name", spec.name),
            ("io.kubernetes.pod.namespace", spec.namespace),
            ("io.kubernetes.pod.uid", uid),
        ];
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: spec.name.to_string(),
                uid: uid.to_string(),
                namespace: spec.namespace.to_string(),
                attempt: 0,
            }),
            hostname: spec.name.to_string(),
            log_directory: logs.display().to_string(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            annotations: spec
                .annotations
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: parent,
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn start_sandbox(
        &self,
        spec: &PodSpec<'_>,
        uid: String,
        cgroup: PathBuf,
        config: PodSandboxConfig,
    ) -> Result<CriPod, Status> {
        let id = self.cri().run_pod(&config)?;
        let status = self.cri().pod_status(&id)?;
        let ip = status
            .status
            .as_ref()
            .and_then(|s| s.network.as_ref())
            .map(|n| n.ip.clone())
            .unwrap_or_default();
        let netns = netns_of(&status.info).unwrap_or_default();
        self.made.lock().unwrap().push(netns.clone());
        let mut pod = CriPod {
            id,
            name: spec.name.to_string(),
            uid,
            ip,
            cgroup,
            netns,
            containers: BTreeMap::new(),
            config,
        };
        let mut wanted = vec![("app", image::APP_IMAGE, APP_UID)];
        if spec.proxy {
            wanted.insert(0, ("proxy", image::PROXY_IMAGE, PROXY_UID));
        }
        for (name, image, user) in wanted {
            let container = container_config(name, image, user);
            let cid = self
                .cri()
                .start_container(&pod.id, &container, &pod.config)?;
            Self::wait_listening(&pod, name);
            pod.containers.insert(name.to_string(), cid);
        }
        Ok(pod)
    }

    /// StopPodSandbox then RemovePodSandbox, as kubelet deletes a pod, then kubelet's removal of
    /// the pod cgroup.
    pub fn remove_pod(&self, pod: &CriPod) -> Result<(), Status> {
        self.cri().stop_pod(&pod.id)?;
        self.cri().remove_pod(&pod.id)?;
        match &self.systemd {
            Some(systemd) => systemd.stop_pod_slice(&pod_slice(&pod.uid)),
            None => remove_cgroup_everywhere(&self.cgroup_mount, &pod.cgroup),
        }
        Ok(())
    }

    /// Runs the probe's `connect` in `container` of `pod`, as that container's user.
    #[must_use]
    pub fn connect_from(&self, pod: &CriPod, container: &str, to: &str) -> Outcome {
        let out = self
            .cri()
            .exec(pod.container(container), &[PROBE, "connect", "--to", to])
            .unwrap_or_else(|e| panic!("ExecSync in {}/{container}: {e}", pod.name));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.exit_code,
            0,
            "connect from {}/{container}: {stdout}{}",
            pod.name,
            String::from_utf8_lossy(&out.stderr)
        );
        Outcome::parse(&stdout)
    }

    /// The last lines of containerd's log and the controllers of each cgroup of the node's
    /// tree, for a failure message.
    #[must_use]
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let mut out = lines[lines.len().saturating_sub(30)..].join("\n");
        if let Ok(runc) = std::fs::read_to_string(self.dir.join("runc-failures.log")) {
            let lines: Vec<&str> = runc.lines().collect();
            out.push_str("\nfailed runc commands' logs:\n");
            out.push_str(&lines[lines.len().saturating_sub(20)..].join("\n"));
        }
        let mut dirs = vec![self.cgroup_mount.clone()];
        dirs.extend(directory_tree(&self.cgroup_root));
        for dir in dirs {
            let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
            out.push_str(&format!(
                "\n{}: controllers [{}] enabled below [{}]",
                dir.display(),
                read("cgroup.controllers").trim(),
                read("cgroup.subtree_control").trim()
            ));
        }
        out
    }

    /// The pod's cgroup as the host sees it.
    fn pod_cgroup(&self, uid: &str) -> PathBuf {
        let driver = match self.systemd {
            Some(_) => CgroupDriver::Systemd,
            None => CgroupDriver::Cgroupfs,
        };
        pod_cgroup_under(&self.cgroup_root, driver, uid)
    }

    /// A command that runs `program` where containerd runs: on the host, or inside the systemd
    /// node's mount namespace (and PID namespace, with `pid`).
    #[must_use]
    pub fn inside(&self, pid: bool, program: impl AsRef<std::ffi::OsStr>) -> Command {
        match &self.systemd {
            Some(systemd) => systemd.command(pid, program),
            None => Command::new(program),
        }
    }

    /// containerd in the node netns (network namespace only, or also the systemd node's mount
    /// and PID namespaces), logging into its directory.
    fn spawn(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("containerd.log"))
            .expect("the containerd log");
        let mut cmd = Command::new("nsenter");
        if let Some(systemd) = &self.systemd {
            cmd.arg("-t")
                .arg(systemd.pid.to_string())
                .args(["--mount", "--cgroup", "--pid"]);
        }
        cmd.arg(format!("--net={}", self.netns.display()));
        let config = self.dir.join("config.toml");
        if self.binds.is_empty() {
            cmd.arg("containerd").arg("--config").arg(&config);
        } else {
            node_agent::with_binds(&mut cmd, &self.binds, &config);
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log);
        cmd.spawn()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}; `cargo xtask setup` installs containerd"))
    }

    fn wait_serving(&self) {
        let what = format!("containerd to serve CRI on {}", self.socket.display());
        crate::wait::wait_until(Duration::from_mins(2), &what, || {
            self.cri()
                .version()
                .map(drop)
                .map_err(|e| format!("{e}\n{}", self.log_tail()))
        });
    }

    /// Waits until the container's probe has printed `ready` to its log (every listener bound).
    pub(crate) fn wait_listening(pod: &CriPod, container: &str) {
        let log = Path::new(&pod.config.log_directory).join(format!("{container}.log"));
        let what = format!("{}/{container} to say ready", pod.name);
        crate::wait::wait_until(
            Duration::from_mins(1),
            &what,
            || match std::fs::read_to_string(&log) {
                Ok(l) if l.lines().any(|l| l.ends_with(" ready")) => Ok(()),
                other => Err(format!("its log: {other:?}")),
            },
        );
    }

    fn stop_daemon(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            // Killed below if it has not stopped by then.
            let _ = crate::wait::poll_until(Duration::from_secs(20), || {
                child.try_wait().ok().flatten().map(drop).ok_or(())
            });
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // What a test left running goes as kubelet would remove it.
        if self.child.is_some() {
            let pods = self.cri().list_pods().unwrap_or_default();
            for pod in pods {
                let _ = self.cri().stop_pod(&pod.id);
                let _ = self.cri().remove_pod(&pod.id);
            }
        }
        self.stop_daemon();
        kill_shims_of(&self.socket);
        let made = std::mem::take(&mut *self.made.lock().unwrap());
        for path in made.iter().filter(|p| !p.as_os_str().is_empty()) {
            if path.starts_with(&self.cgroup_mount) {
                remove_cgroup_everywhere(&self.cgroup_mount, path);
            } else if path.exists() {
                let _ = nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH);
                let _ = std::fs::remove_file(path);
            }
        }
        // runc makes the pods' parents in every cgroup v1 hierarchy too (hybrid hosts).
        if let Ok(rel) = self.cgroup_root.strip_prefix(&self.cgroup_mount) {
            for mount in cgroup_v1_mounts() {
                let mirror = mount.join(rel);
                if mirror.exists() {
                    remove_cgroup_tree(&mirror);
                }
            }
        }
        for mount in mounts_under(&self.dir) {
            let _ = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        if !self.binds.is_empty() {
            node_agent::release_bind_points();
        }
        runtime_ended();
    }
}

/// The pod's network namespace path from a verbose `PodSandboxStatus` (the runtime spec's
/// `network` namespace).
fn netns_of(info: &std::collections::HashMap<String, String>) -> Option<PathBuf> {
    let info: Value = serde_json::from_str(info.get("info")?).ok()?;
    info["runtimeSpec"]["linux"]["namespaces"]
        .as_array()?
        .iter()
        .find(|n| n["type"] == "network")
        .and_then(|n| n["path"].as_str())
        .map(PathBuf::from)
}
