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
//! kubelet and runtime use the cgroupfs driver here. The systemd driver cannot run on these
//! machines: runc then creates every container's scope through systemd over D-Bus, and no
//! systemd runs as PID 1 here. (containerd picks the systemd form of a container's cgroup path by
//! the parent's `.slice` suffix alone, so a systemd-style parent under the cgroupfs driver would
//! put the containers outside the pod cgroup: not a layout any node runs.)

pub mod cri;
pub mod image;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, Int64Value, LinuxContainerConfig,
    LinuxContainerSecurityContext, LinuxPodSandboxConfig, LinuxSandboxSecurityContext,
    NamespaceMode, NamespaceOption, PodSandboxConfig, PodSandboxMetadata,
};
use serde_json::Value;
use tonic::Status;

use self::{cri::Cri, image::PROBE};
use crate::{
    cni::{pod_cgroup_under, pod_uid, remove_cgroup_tree, CgroupDriver, Node},
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
    /// The [`FIXED_DIRS`] that did not exist before: removed on drop when empty.
    fixed_dirs: Vec<&'static Path>,
}

/// Where containerd 1.6 makes directories whatever its configuration says, deepest first.
const FIXED_DIRS: &[&str] = &[
    "/run/containerd/s",
    "/run/containerd/fifo",
    "/run/containerd",
];

impl Containerd {
    /// Starts a containerd for `node` and imports the test images into it.
    #[must_use]
    pub fn start(node: &Node) -> Self {
        let dir = std::env::temp_dir().join(unique("capture-containerd"));
        std::fs::create_dir_all(&dir).expect("the containerd directory");
        for plugin in REFERENCE_PLUGINS {
            let link = node.plugin_dir.join(plugin);
            if !link.exists() {
                std::os::unix::fs::symlink(Path::new("/usr/lib/cni").join(plugin), link)
                    .expect("linking a reference plugin");
            }
        }
        std::fs::create_dir_all(node.conf_dir()).expect("the CNI configuration directory");
        let socket = dir.join("containerd.sock");
        std::fs::write(dir.join("config.toml"), config(&dir, &socket, node))
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
            fixed_dirs: FIXED_DIRS
                .iter()
                .map(Path::new)
                .filter(|d| !d.exists())
                .collect(),
        };
        runtime.child = Some(spawn(&runtime.dir, &runtime.netns));
        runtime.wait_serving();
        runtime.import_images();
        runtime
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
        self.child = Some(spawn(&self.dir, &self.netns));
        self.wait_serving();
    }

    /// kubelet's part and the runtime's: [`Self::prepare_pod`], then [`Self::start_pod`].
    pub fn run_pod(&self, spec: &PodSpec<'_>) -> Result<CriPod, Status> {
        let config = self.prepare_pod(spec);
        self.start_pod(spec, &config)
    }

    /// What kubelet does before it asks the runtime for a sandbox: a UID, the pod cgroup, and the
    /// sandbox config it sends (the same again on each retry).
    #[must_use]
    pub fn prepare_pod(&self, spec: &PodSpec<'_>) -> PodSandboxConfig {
        let uid = pod_uid();
        let cgroup = self.pod_cgroup(&uid);
        std::fs::create_dir_all(&cgroup).expect("the pod cgroup");
        self.made.lock().unwrap().push(cgroup.clone());
        self.sandbox_config(spec, &uid, &cgroup)
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

    fn sandbox_config(&self, spec: &PodSpec<'_>, uid: &str, cgroup: &Path) -> PodSandboxConfig {
        let parent = Path::new("/").join(
            cgroup
                .strip_prefix(&self.cgroup_mount)
                .expect("under the cgroup2 mount"),
        );
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
                cgroup_parent: parent.display().to_string(),
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
            self.wait_listening(&pod, name);
            pod.containers.insert(name.to_string(), cid);
        }
        Ok(pod)
    }

    /// StopPodSandbox then RemovePodSandbox, as kubelet deletes a pod, then kubelet's removal of
    /// the pod cgroup.
    pub fn remove_pod(&self, pod: &CriPod) -> Result<(), Status> {
        self.cri().stop_pod(&pod.id)?;
        self.cri().remove_pod(&pod.id)?;
        remove_cgroup_everywhere(&self.cgroup_mount, &pod.cgroup);
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

    /// The last lines of containerd's log, for a failure message.
    #[must_use]
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn pod_cgroup(&self, uid: &str) -> PathBuf {
        pod_cgroup_under(&self.cgroup_root, CgroupDriver::Cgroupfs, uid)
    }

    fn wait_serving(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if self.cri().version().is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not serve CRI on {}:\n{}",
                self.socket.display(),
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn import_images(&self) {
        let archive = self.dir.join("images.tar");
        image::write_archive(&archive).expect("writing the test images");
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", "k8s.io", "images", "import"])
            .arg(&archive)
            .output()
            .expect("running ctr (`cargo xtask setup` installs it with containerd)");
        assert!(
            out.status.success(),
            "ctr images import: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = std::fs::remove_file(&archive);
        for image in [image::PAUSE_IMAGE, image::APP_IMAGE, image::PROXY_IMAGE] {
            assert!(
                self.cri().has_image(image).expect("CRI ImageStatus"),
                "{image} is not there after the import"
            );
        }
    }

    /// Waits until the container's probe has printed `ready` to its log (every listener bound).
    fn wait_listening(&self, pod: &CriPod, container: &str) {
        let log = Path::new(&pod.config.log_directory).join(format!("{container}.log"));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&log).is_ok_and(|l| l.lines().any(|l| l.ends_with(" ready")))
        {
            assert!(
                Instant::now() < deadline,
                "{}/{container} never said ready; its log: {:?}",
                pod.name,
                std::fs::read_to_string(&log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stop_daemon(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
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
        for dir in &self.fixed_dirs {
            // Only when empty: another containerd may have started using it meanwhile.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn config(dir: &Path, socket: &Path, node: &Node) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # The pod sandbox's oom_score_adj is kept at containerd's own or above, as for a rootless
  # containerd: where the tests run in a container without CAP_SYS_RESOURCE, runc could not
  # lower it to kubelet's -998.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
        socket = socket.display(),
        pause = image::PAUSE_IMAGE,
        bin = node.plugin_dir.display(),
        conf = node.conf_dir().display(),
    )
}

/// containerd in `netns` (network namespace only), logging into `dir`.
fn spawn(dir: &Path, netns: &Path) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("containerd.log"))
        .expect("the containerd log");
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", netns.display()))
        .arg("containerd")
        .arg("--config")
        .arg(dir.join("config.toml"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("the log"))
        .stderr(log);
    cmd.spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}; `cargo xtask setup` installs containerd"))
}

fn namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Pod as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

fn container_config(name: &str, image: &str, user: i64) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_string(),
            attempt: 0,
        }),
        image: Some(cri::image_spec(image)),
        log_path: format!("{name}.log"),
        labels: [("io.kubernetes.container.name".to_string(), name.to_string())].into(),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                run_as_user: Some(Int64Value { value: user }),
                run_as_group: Some(Int64Value { value: user }),
                namespace_options: Some(namespaces()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pod's network namespace path from a verbose PodSandboxStatus (the runtime spec's
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

/// Removes a pod cgroup in cgroup v2 and, on a hybrid host, in every v1 hierarchy runc used.
fn remove_cgroup_everywhere(v2_mount: &Path, cgroup: &Path) {
    remove_cgroup_tree(cgroup);
    if let Ok(rel) = cgroup.strip_prefix(v2_mount) {
        for mount in cgroup_v1_mounts() {
            let mirror = mount.join(rel);
            if mirror.exists() {
                remove_cgroup_tree(&mirror);
            }
        }
    }
}

fn cgroup_v1_mounts() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, point, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup").then(|| PathBuf::from(point))
        })
        .collect()
}

/// Mount points at or below `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4).map(PathBuf::from))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points
}

/// SIGKILLs the shims of the containerd serving `socket` (they outlive a killed containerd).
fn kill_shims_of(socket: &Path) {
    let needle = socket.display().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("containerd-shim") && cmdline.contains(&needle) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}
